"""The ``vq`` task end to end through the CLI on a tiny image folder: trains a codec, logs its metrics and
reconstruction pictures, and its checkpoint loads with ``load_vq`` and as a frozen ``vq`` tokenizer of
another recipe; recipe mistakes are named."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from PIL import Image

from mmformer.cli import main
from mmformer.errors import RecipeError
from mmformer.recipe import load_recipe
from mmformer.tokenizers.vq import load_vq
from tests.conftest import make_image_folder

TOKENIZER = "{kind: vq, image_size: 16, channels: [8, 8], d_latent: 8, codebook_size: 16, code_dim: 4}"

RECIPE = """\
name: tinyvq
model:
  tokenizers: {{image: {tokenizer}}}
  backbone: {{d_model: 8, n_layers: 1, n_heads: 1}}
tasks:
  rec:
    kind: vq
    tokenizer: image
    media_images: 3
    data: {{kind: image_folder, root: {root}, batch_size: 4, num_workers: 0}}
optim: {{lr: 1e-3, warmup_steps: 1, weight_decay: 0.0}}
trainer: {{max_steps: 3, accelerator: cpu, devices: 1, log_every_n_steps: 1, enable_progress_bar: false,
          num_sanity_val_steps: 0}}
logger: {{mode: {logger}}}
"""

CONSUMER = """\
name: onvq
model:
  tokenizers: {{image: {{kind: vq, image_size: {size}, codebook_size: 16, checkpoint: {ckpt}}}}}
  backbone: {{d_model: 16, n_layers: 1, n_heads: 2}}
  heads: {{cls: {{kind: classifier, num_classes: 2, pool: mean}}}}
tasks:
  toy:
    kind: classification
    tokenizer: image
    head: cls
    data: {{kind: image_folder, root: {root}, batch_size: 4, num_workers: 0}}
optim: {{lr: 1e-3, warmup_steps: 1}}
trainer: {{max_steps: 2, accelerator: cpu, devices: 1, enable_progress_bar: false, num_sanity_val_steps: 0}}
logger: {{mode: disabled}}
"""


def _train(workdir, capsys, logger="disabled"):
    root = make_image_folder(workdir / "imgs", n_per_class=4, size=16)
    recipe = workdir / "vq.yaml"
    recipe.write_text(RECIPE.format(tokenizer=TOKENIZER, root=root, logger=logger))
    assert main(["train", str(recipe)]) == 0
    out = capsys.readouterr().out
    run = next((workdir / "runs" / "tinyvq").glob("*"))
    return root, run, out


@pytest.fixture
def trained(workdir, capsys):
    return _train(workdir, capsys)


@pytest.mark.slow
def test_the_reconstruction_picture_reaches_wandb(workdir, capsys):
    from tests.wandb_records import read_records

    _, run, _ = _train(workdir, capsys, logger="offline")
    records = read_records(next(run.glob("wandb/offline-run-*/*.wandb")))
    keys = {"/".join(i.nested_key) or i.key for r in records if r.HasField("history") for i in r.history.item}
    assert "reconstructions/rec/_type" in keys


def test_trains_logs_reconstructions_and_loads_with_load_vq(trained, workdir):
    root, run, out = trained
    metrics = {ln.split()[0]: float(ln.split()[1]) for ln in out.splitlines() if ln.startswith("val/rec/")}
    assert set(metrics) == {f"val/rec/{k}" for k in ("loss", "mse", "psnr", "usage", "perplexity")}
    assert 0 < metrics["val/rec/usage"] <= 1 and 1 <= metrics["val/rec/perplexity"] <= 16
    pictures = sorted((run / "reconstructions").glob("rec-step*.png"))
    assert pictures and Image.open(pictures[-1]).size == (3 * 17 + 1, 2 * 17 + 1)  # 3 originals over 3 recons

    ckpt = run / "checkpoints" / "last.ckpt"
    vq = load_vq(ckpt, image_size=16, in_chans=1, codebook_size=16)
    state = torch.load(ckpt, map_location="cpu", weights_only=True)["state_dict"]
    for key, value in vq.state_dict().items():
        assert torch.equal(value, state[f"model.tokenizers.image.vq.{key}"]), key
    # the held-out MSE the run reported is the loaded codec's on the same images
    files = sorted((root / "val").rglob("*.png"))
    images = torch.stack([torch.from_numpy(np.array(Image.open(p))).unsqueeze(0) for p in files])
    x = images.float() / 127.5 - 1
    per_image = ((vq.decode(vq.encode(images)) - x) / 2).pow(2).flatten(1).mean(1)
    assert float(per_image.mean()) == pytest.approx(metrics["val/rec/mse"], abs=5e-4)


def test_a_trained_codec_is_a_frozen_tokenizer_of_another_recipe(trained, workdir, capsys):
    root, run, _ = trained
    ckpt = run / "checkpoints" / "last.ckpt"
    consumer = workdir / "consumer.yaml"
    consumer.write_text(CONSUMER.format(size=16, ckpt=ckpt, root=root))
    assert main(["train", str(consumer)]) == 0
    out = capsys.readouterr().out
    assert "val/toy/acc" in out
    trained_run = next((workdir / "runs" / "onvq").glob("*"))
    state = torch.load(trained_run / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=True)
    codec = load_vq(ckpt)
    for key, value in codec.state_dict().items():  # frozen: the codec did not move
        assert torch.equal(state["state_dict"][f"model.tokenizers.image.vq.{key}"], value), key
    # a recipe that asks for other sizes than the codec's: both named
    consumer.write_text(CONSUMER.format(size=32, ckpt=ckpt, root=root))
    assert main(["train", str(consumer)]) != 0
    err = capsys.readouterr().err
    assert "model.tokenizers.image.checkpoint" in err and "image_size=16 (asked: 32)" in err


@pytest.mark.parametrize(
    "change, message",
    [
        (("checkpoint: null}", "checkpoint: x.ckpt}"), "loads a frozen codec, which task 'rec'"),
        (("media_images: 3", "media_images: 0"), "media_images must be > 0"),
        (("devices: 1,", "devices: 1, strategy: ddp,"), "ddp_find_unused_parameters_true"),
    ],
)
def test_recipe_mistakes_are_named(tmp_path, change, message):
    text = RECIPE.format(
        tokenizer=TOKENIZER.replace("}", ", checkpoint: null}"), root=tmp_path, logger="disabled"
    )
    assert change[0] in text
    path = tmp_path / "r.yaml"
    path.write_text(text.replace(*change))
    with pytest.raises(RecipeError, match=message):
        load_recipe(path)


def test_the_vq_task_needs_a_vq_tokenizer(tmp_path):
    tokenizer = "{kind: dit, image_size: 16, patch_size: 4, in_chans: 1}"
    path = tmp_path / "r.yaml"
    path.write_text(RECIPE.format(tokenizer=tokenizer, root=tmp_path, logger="disabled"))
    with pytest.raises(RecipeError, match="trains a tokenizer of kind vq; 'image' is dit"):
        load_recipe(path)


def test_an_untrained_codec_without_checkpoint_is_refused(tmp_path):
    text = CONSUMER.format(size=16, ckpt="null", root=tmp_path)
    path = tmp_path / "r.yaml"
    path.write_text(text)
    with pytest.raises(RecipeError, match="has no checkpoint and no vq task trains it"):
        load_recipe(path)
