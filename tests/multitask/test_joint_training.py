"""Joint multi-task training through the CLI: an image classifier and a causal LM on one shared
backbone (causal, images bidirectional), with every-task and sampled schedules, per-task and
per-modality logs, the cross-task leak check, and DDP where ranks train different tasks."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
import torch.multiprocessing as mp

from mmformer.cli import main
from mmformer.data.roots import DataError
from mmformer.recipe import RecipeError, recipe_from_yaml
from tests.conftest import make_image_folder

JOINT = """\
name: joint
seed: 0
model:
  tokenizers:
    image: {{kind: vit_patch, image_size: 28, patch_size: 7, in_chans: 1, mean: [0.5], std: [0.25]}}
    text: {{kind: bpe, vocab_size: 300, max_len: 32}}
  backbone: {{preset: debug, causal: true, bidirectional: [image]}}
  heads: {{cls: {{kind: classifier, num_classes: 2, pool: mean}}, lm: {{kind: lm}}}}
tasks:
  shapes:
    kind: classification
    tokenizer: image
    head: cls
    data: {{kind: image_folder, root: {images}, batch_size: 4}}
  corpus:
    kind: causal_lm
    tokenizer: text
    head: lm
    data: {{kind: text, root: {corpus}, seq_len: 32, batch_size: 4, val_fraction: 0.25}}
optim: {{lr: 3e-3, warmup_steps: 2}}
trainer: {{max_epochs: 1, accelerator: cpu, devices: 1, log_every_n_steps: 1, enable_progress_bar: false,
          num_sanity_val_steps: 0}}
logger: {{mode: disabled}}
"""


@pytest.fixture
def joint(workdir):
    images = make_image_folder(workdir / "images")
    docs = [f"Chapter {i}\nAnd the light was good, and the day was {i}.\nAnd it was so." for i in range(40)]
    (workdir / "corpus.txt").write_text("\n\n".join(docs) + "\n")
    path = workdir / "joint.yaml"
    path.write_text(JOINT.format(images=images, corpus=workdir / "corpus.txt"))
    return path


def _metrics(run_dir) -> set[str]:
    import csv

    with open(next(run_dir.rglob("metrics.csv"))) as f:
        return set(next(csv.reader(f)))


@pytest.mark.parametrize("schedule", ["all", "sampled"])
def test_joint_training_logs_per_task_and_per_modality(joint, workdir, schedule, capsys):
    assert main(["train", str(joint), f"multitask.schedule={schedule}"]) == 0
    out = capsys.readouterr().out
    finals = {ln.split()[0] for ln in out.splitlines() if ln.startswith("val/")}
    assert {"val/shapes/acc", "val/corpus/ppl"} <= finals
    keys = _metrics(next((workdir / "runs" / "joint").iterdir()))
    for key in (
        "train/shapes/loss",
        "train/corpus/loss",
        "train/modality/image/loss",
        "train/modality/text/loss",
        "throughput/shapes/samples_per_sec",
        "throughput/corpus/tokens_per_sec",
        "throughput/modality/image/samples_per_sec",
        "throughput/samples_per_sec",
    ):
        assert key in keys, key


def test_sample_weights_name_every_task(joint):
    text = joint.read_text()
    with pytest.raises(RecipeError, match="Did you mean 'corpus'"):
        recipe_from_yaml(
            text, ["multitask.schedule=sampled", "multitask.sample_weights={shapes: 1, corpas: 1}"]
        )
    with pytest.raises(RecipeError, match="gives no weight to corpus"):
        recipe_from_yaml(text, ["multitask.schedule=sampled", "multitask.sample_weights={shapes: 1}"])
    with pytest.raises(RecipeError, match="needs multitask.schedule: sampled"):
        recipe_from_yaml(text, ["multitask.sample_weights={shapes: 1, corpus: 1}"])
    with pytest.raises(RecipeError, match="exempt from a causal mask"):
        recipe_from_yaml(text, ["model.backbone.causal=false"])


def test_a_validation_sample_in_another_tasks_training_data_is_refused(joint, workdir):
    # a second image task trains on a copy (another root, same bytes) of the first task's val images
    import shutil

    from mmformer.build import build_datamodule

    shutil.copytree(workdir / "images" / "val", workdir / "leak" / "train")
    shutil.copytree(workdir / "images" / "train", workdir / "leak" / "val")
    text = (
        joint.read_text()
        .replace(
            "  corpus:\n",
            "  copy:\n    kind: classification\n    tokenizer: image\n    head: cls2\n"
            f"    data: {{kind: image_folder, root: {workdir / 'leak'}, batch_size: 4}}\n  corpus:\n",
        )
        .replace("lm: {kind: lm}}", "lm: {kind: lm}, cls2: {kind: classifier, num_classes: 2, pool: mean}}")
    )
    recipe = recipe_from_yaml(text)
    with pytest.raises(
        DataError, match="validation samples of task 'shapes' are training samples of task 'copy'"
    ):
        build_datamodule(recipe)
    build_datamodule(recipe_from_yaml(text, ["multitask.check_leaks=false"]))  # when intended


@pytest.mark.slow
def test_ddp_ranks_training_different_tasks_neither_fail_nor_hang(joint, workdir):
    # Every step each rank draws its own task: one rank's step has no image, the other's no text.
    # DDP must be told about the unused parameters (find_unused_parameters), or it raises or hangs.
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    args = [
        "train",
        str(joint),
        "trainer.devices=2",
        "trainer.strategy=ddp",
        "multitask.schedule=sampled",
        "multitask.same_task_on_all_ranks=false",
        "multitask.steps_per_epoch=6",
    ]
    res = subprocess.run(
        [sys.executable, "-m", "mmformer.cli", *args], capture_output=True, text=True, env=env, timeout=300
    )
    assert res.returncode == 0, res.stderr[-3000:]
    assert "val/shapes/acc" in res.stdout and "val/corpus/ppl" in res.stdout


# ------------------------------------------------------------------ gradient semantics under DDP
def _two_task_setup(joint_text: str):
    from mmformer.build import build_datamodule, build_module

    recipe = recipe_from_yaml(joint_text)
    torch.manual_seed(0)
    module = build_module(recipe)
    dm = build_datamodule(recipe)
    img = next(
        iter(
            torch.utils.data.DataLoader(
                dm.data["shapes"].train, batch_size=4, collate_fn=dm.data["shapes"].collate
            )
        )
    )
    txt = next(
        iter(
            torch.utils.data.DataLoader(
                dm.data["corpus"].train, batch_size=4, collate_fn=dm.data["corpus"].collate
            )
        )
    )
    return module, {"shapes": img, "corpus": txt}


class _Step(torch.nn.Module):  # what Lightning's DDP wrapper does: forward = the training step's loss
    def __init__(self, module):
        super().__init__()
        self.module = module

    def forward(self, batch):
        return sum(self.module.tasks[n].training_loss(self.module.model, b) for n, b in batch.items())


def _ddp_worker(rank, joint_text, init_file, out):
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    module, batches = _two_task_setup(joint_text)
    module.train()
    torch.manual_seed(0)  # identical dropout / drop-path draws (the debug preset has none)
    ddp = DDP(_Step(module), find_unused_parameters=True)
    name = ["shapes", "corpus"][rank]  # rank 0 trains the image task, rank 1 the text task
    ddp({name: batches[name]}).backward()
    grads = {n: p.grad.clone() if p.grad is not None else None for n, p in module.model.named_parameters()}
    torch.save(grads, f"{out}.{rank}")
    dist.destroy_process_group()


@pytest.mark.slow
def test_ddp_with_different_tasks_per_rank_averages_like_one_process(joint, tmp_path):
    text = joint.read_text()
    mp.spawn(_ddp_worker, args=(text, str(tmp_path / "init"), str(tmp_path / "g")), nprocs=2, join=True)
    module, batches = _two_task_setup(text)
    module.train()
    loss = 0.5 * sum(module.tasks[n].training_loss(module.model, b) for n, b in batches.items())
    loss.backward()
    for rank in range(2):
        grads = torch.load(tmp_path / f"g.{rank}", weights_only=True)
        for name, p in module.model.named_parameters():
            expected = p.grad if p.grad is not None else torch.zeros_like(p)
            got = grads[name] if grads[name] is not None else torch.zeros_like(p)
            torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-6, msg=name)


def test_only_keeps_one_task_and_the_parts_it_uses(joint):
    recipe = recipe_from_yaml(
        joint.read_text(),
        [
            "multitask.schedule=sampled",
            "multitask.sample_weights={shapes: 1, corpus: 2}",
            "multitask.only=[corpus]",
        ],
    )
    assert list(recipe.tasks) == ["corpus"] and recipe.name == "joint-only-corpus"
    assert list(recipe.model.tokenizers) == ["text"] and list(recipe.model.heads) == ["lm"]
    assert recipe.multitask.schedule == "all" and not recipe.multitask.sample_weights
    from mmformer.recipe import recipe_to_yaml

    assert recipe_from_yaml(recipe_to_yaml(recipe)) == recipe  # reloads (from a checkpoint) unchanged
    with pytest.raises(RecipeError, match="Did you mean 'corpus'"):
        recipe_from_yaml(joint.read_text(), ["multitask.only=[corpse]"])


def test_ranks_drawing_their_own_tasks_is_refused_when_a_task_gathers_across_ranks(joint):
    text = (
        joint.read_text()
        .replace(
            "  corpus:\n",
            "  pairs:\n    kind: contrastive\n    tokenizer: image\n    head: emb\n    caption_tokenizer: text\n"
            "    caption_head: cap\n    data: {kind: image_caption, root: x, batch_size: 4, max_len: 16}\n  corpus:\n",
        )
        .replace(
            "lm: {kind: lm}}",
            "lm: {kind: lm}, emb: {kind: projection, embed_dim: 8, pool: mean}, "
            "cap: {kind: projection, embed_dim: 8, pool: mean}}",
        )
    )
    recipe_from_yaml(text, ["multitask.schedule=sampled"])  # same task on every rank: fine
    with pytest.raises(RecipeError, match="would hang: task 'pairs' gathers"):
        recipe_from_yaml(text, ["multitask.schedule=sampled", "multitask.same_task_on_all_ranks=false"])


def test_only_forgets_a_monitor_of_a_dropped_task(joint):
    recipe = recipe_from_yaml(
        joint.read_text(), ["checkpoint.monitor=val/shapes/acc", "multitask.only=[corpus]"]
    )
    assert recipe.checkpoint.monitor is None
