"""One media callback for every task: it asks each task for its records after a validation and logs
them once, by name (``<name>/<task>``), on rank 0 — under FSDP2 every rank runs the tasks' hooks (their
forwards gather weights from all ranks), never during the sanity check; images are also written to
the run folder."""

from __future__ import annotations

from types import SimpleNamespace

import torch
from lightning.pytorch.loggers import WandbLogger
from PIL import Image as PILImage

from mmformer.tasks.base import TaskBase
from mmformer.training.callbacks import MediaSamples
from mmformer.training.media import Audio, Image, MediaContext, Table


class _Wandb(WandbLogger):
    """Records what would reach W&B (no run is started)."""

    def __init__(self):
        self.calls: list[tuple] = []

    def log_table(self, key, columns=None, data=None, dataframe=None, step=None):
        self.calls.append(("table", key, columns, data, step))

    def log_image(self, key, images, step=None, **kwargs):
        self.calls.append(("image", key, images, step, kwargs))


class _Shows(TaskBase):
    def __init__(self, records):
        super().__init__()
        self.records, self.asked = records, 0

    def media(self, ctx: MediaContext):
        assert ctx.task in ("text", "grid")
        self.asked += 1
        return self.records


def _setup(tmp_path, rank: int = 0, sharded: bool = False, sanity: bool = False):
    wave = torch.linspace(-1, 1, 80)
    text = _Shows([Table("decoded", ["reference", "decoded"], [["a b", "a c"]])])
    grid = _Shows(
        [
            Image("samples", torch.rand(1, 5, 7), caption="a cat | a dog"),
            Table("audio", ["audio", "label"], [[Audio(wave, 8000), "low"]]),
        ]
    )
    wandb = _Wandb()
    trainer = SimpleNamespace(
        sanity_checking=sanity,
        is_global_zero=rank == 0,
        global_step=7,
        fit_loop=SimpleNamespace(epoch_loop=SimpleNamespace(_batches_that_stepped=6)),
        default_root_dir=str(tmp_path),
        loggers=[wandb],
        callbacks=[],
    )
    module = SimpleNamespace(tasks={"text": text, "grid": grid}, device_mesh=object() if sharded else None)
    return trainer, module, wandb, (text, grid)


def test_every_tasks_media_is_logged_once_by_name_and_images_are_written(tmp_path):
    trainer, module, wandb, tasks = _setup(tmp_path)
    callback = MediaSamples()
    callback.on_validation_end(trainer, module)
    assert [t.asked for t in tasks] == [1, 1]
    kinds = [(c[0], c[1]) for c in wandb.calls]
    assert kinds == [("table", "decoded/text"), ("image", "samples/grid"), ("table", "audio/grid")]
    # at the step Lightning logs the validation's metrics at (6 optimizer steps before this one), not 7
    assert wandb.calls[0][2:] == (["reference", "decoded"], [["a b", "a c"]], 6)
    assert wandb.calls[1][4] == {"caption": ["a cat | a dog"]} and wandb.calls[1][3] == 6
    clip = wandb.calls[2][3][0][0]
    assert type(clip).__name__ == "Audio" and wandb.calls[2][3][0][1] == "low"  # a playable wandb.Audio
    png = tmp_path / "samples" / "grid-step000006.png"
    assert PILImage.open(png).size == (7, 5)
    assert set(callback.last) == {"decoded/text", "samples/grid", "audio/grid"}


def test_other_ranks_run_the_hooks_only_when_sharded_and_never_log(tmp_path):
    for sharded, asked in ((False, 0), (True, 1)):
        trainer, module, wandb, tasks = _setup(tmp_path, rank=1, sharded=sharded)
        MediaSamples().on_validation_end(trainer, module)
        assert [t.asked for t in tasks] == [asked, asked] and wandb.calls == []
    assert not (tmp_path / "samples").exists()
    trainer, module, wandb, tasks = _setup(tmp_path, sanity=True)
    MediaSamples().on_validation_end(trainer, module)
    assert [t.asked for t in tasks] == [0, 0] and wandb.calls == []


def test_a_task_without_media_shows_nothing():
    assert TaskBase().media(MediaContext("t", None, None)) == []


def test_prefix_lm_shows_its_decoded_examples():
    from mmformer.models.prefix_lm import PrefixLM
    from mmformer.tasks.prefix_lm import PrefixLMTask

    task = PrefixLMTask(PrefixLM("audio", "text", "lm"), "audio", text=None, max_new_tokens=3)
    assert task.media(MediaContext("asr", None, None)) == []
    task.examples = [("a b", "a c")]
    (table,) = task.media(MediaContext("asr", None, None))
    assert (table.name, table.columns, table.rows) == ("decoded", ["reference", "decoded"], [["a b", "a c"]])


def test_prefix_lm_puts_each_clip_beside_its_texts():
    from types import SimpleNamespace

    from mmformer.models.prefix_lm import PrefixLM
    from mmformer.tasks.prefix_lm import PrefixLMTask
    from mmformer.training.media import Audio

    task = PrefixLMTask(PrefixLM("audio", "text", "lm"), "audio", text=None, max_new_tokens=3)
    task.examples = [("a b", "a c"), ("d", "d")]
    waves = torch.randn(2, 800)
    valid = torch.arange(800)[None] < torch.tensor([[800], [300]])  # the second clip is 300 samples long
    task.example_inputs = (waves, valid)
    module = SimpleNamespace(model=SimpleNamespace(tokenizers={"audio": SimpleNamespace(sample_rate=8000)}))
    table, picture = task.media(MediaContext("asr", None, module))
    assert table.columns == ["input", "reference", "decoded"]
    assert [r[1:] for r in table.rows] == [["a b", "a c"], ["d", "d"]]
    clips = [r[0] for r in table.rows]
    assert all(isinstance(c, Audio) and c.sample_rate == 8000 for c in clips)
    assert torch.equal(clips[0].wave, waves[0]) and torch.equal(clips[1].wave, waves[1, :300])
    assert picture.name == "predictions" and picture.image.dim() == 3
