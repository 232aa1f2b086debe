"""The diffusion task end to end through the CLI on a tiny image folder: trains a tiny DiT with EMA,
writes sample grids, checkpoints the EMA weights, validates reproducibly and samples from the CLI."""

from __future__ import annotations

import torch
from PIL import Image

from mmformer.cli import main
from tests.conftest import make_image_folder

RECIPE = """\
name: tinydit
model:
  tokenizers: {{image: {{kind: dit, image_size: 28, patch_size: 7, in_chans: 1, num_classes: 2}}}}
  backbone: {{d_model: 32, n_layers: 2, n_heads: 2, block: adaln, final_norm: false}}
  heads: {{eps: {{kind: dit, learn_sigma: {learn_sigma}}}}}
tasks:
  toy:
    kind: diffusion
    tokenizer: image
    head: eps
    objective: {objective}
    sample_steps: 2
    samples_per_class: 3
    data: {{kind: image_folder, root: {root}, batch_size: 4, num_workers: 0}}
optim: {{lr: 1e-3, warmup_steps: 1, ema_decay: 0.5}}
trainer: {{max_steps: 4, accelerator: cpu, devices: 1, log_every_n_steps: 1, enable_progress_bar: false,
          num_sanity_val_steps: 0}}
logger: {{mode: disabled}}
"""


def _train(workdir, capsys, objective="gaussian", learn_sigma="false"):
    root = make_image_folder(workdir / "imgs", n_per_class=4)
    recipe = workdir / "dit.yaml"
    recipe.write_text(RECIPE.format(root=root, objective=objective, learn_sigma=learn_sigma))
    assert main(["train", str(recipe)]) == 0
    out = capsys.readouterr().out
    run = next((workdir / "runs" / "tinydit").glob("*"))
    return recipe, run, out


def test_trains_checkpoints_ema_weights_and_writes_sample_grids(workdir, capsys):
    _, run, out = _train(workdir, capsys)
    loss = float(next(ln.split()[1] for ln in out.splitlines() if ln.startswith("val/toy/loss")))
    grids = sorted((run / "samples").glob("toy-step*.png"))
    assert grids and Image.open(grids[-1]).size == (3 * 29 + 1, 2 * 29 + 1)  # 3 per class, 2 classes
    ckpt = torch.load(run / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=True)
    ema, current = ckpt["state_dict"], ckpt["current_model_state"]
    key = "model.backbone.blocks.0.attn.qkv.weight"
    assert not torch.equal(ema[key], current[key])  # the EMA, not the last step, is what was saved
    # validation noise is seeded: the checkpoint validates to exactly the loss the run reported
    assert main(["validate", str(run / "checkpoints" / "last.ckpt")]) == 0
    again = capsys.readouterr().out
    assert f"val/toy/loss {loss:.4f}" in again


def test_sample_cli_writes_a_grid_and_refuses_bad_classes(workdir, capsys):
    _, run, _ = _train(workdir, capsys)
    ckpt = str(run / "checkpoints" / "last.ckpt")
    out = workdir / "grid.png"
    assert (
        main(
            [
                "sample",
                ckpt,
                "--class",
                "1",
                "--n",
                "4",
                "--cfg-scale",
                "3",
                "--steps",
                "2",
                "--out",
                str(out),
            ]
        )
        == 0
    )
    assert Image.open(out).size == (4 * 29 + 1, 29 + 1)
    assert main(["sample", ckpt, "--class", "2", "--out", str(out)]) == 2
    assert "outside the model's classes 0…1" in capsys.readouterr().err
    assert main(["sample", ckpt, "--sampler", "euler", "--out", str(out)]) == 2
    assert "does not fit gaussian diffusion" in capsys.readouterr().err


def test_flow_matching_trains(workdir, capsys):
    _, _, out = _train(workdir, capsys, objective="flow")
    assert "val/toy/loss" in out


def test_learned_variance_trains(workdir, capsys):
    _, _, out = _train(workdir, capsys, learn_sigma="true")
    assert "val/toy/loss" in out
