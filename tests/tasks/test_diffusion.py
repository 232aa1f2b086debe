"""The diffusion task end to end through the CLI on a tiny image folder: trains a tiny DiT with EMA,
writes sample grids, checkpoints the EMA weights, validates reproducibly and samples from the CLI."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from PIL import Image

from mmformer.cli import main
from tests.conftest import make_image_folder

MNIST_RECIPE = Path(__file__).parents[2] / "recipes/diffusion/dit_classcond_mnist5k.yaml"

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
logger: {{mode: {logger}}}
"""


def _train(workdir, capsys, objective="gaussian", learn_sigma="false", logger="disabled"):
    root = make_image_folder(workdir / "imgs", n_per_class=4)
    recipe = workdir / "dit.yaml"
    recipe.write_text(RECIPE.format(root=root, objective=objective, learn_sigma=learn_sigma, logger=logger))
    assert main(["train", str(recipe)]) == 0
    out = capsys.readouterr().out
    run = next((workdir / "runs" / "tinydit").glob("*"))
    return recipe, run, out


def test_trains_checkpoints_ema_weights_and_writes_sample_grids(workdir, capsys):
    from tests.wandb_records import read_records

    _, run, out = _train(workdir, capsys, logger="offline")
    records = read_records(next(run.glob("wandb/offline-run-*/*.wandb")))
    keys = {"/".join(i.nested_key) or i.key for r in records if r.HasField("history") for i in r.history.item}
    assert "samples/toy/_type" in keys  # the grid reached W&B
    loss = float(next(ln.split()[1] for ln in out.splitlines() if ln.startswith("val/toy/loss")))
    assert "val/toy/loss_uncond" in out  # the same loss with the class dropped
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


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["model.tokenizers.image.class_dropout=0"], "needs the null class trained"),
        (["tasks.digits.prediction=v", "tasks.digits.min_snr_gamma=5"], "prediction, min_snr_gamma apply to"),
        (["tasks.digits.objective=gaussian"], "t_sampling applies to objective: flow"),
        (
            [
                "tasks.digits.objective=gaussian",
                "tasks.digits.t_sampling=uniform",
                "tasks.digits.num_timesteps=20",
            ],
            "sample_steps=50 exceeds num_timesteps=20",
        ),
        (["model.backbone.block=pre"], "set model.backbone.block: adaln"),
        (["model.heads.velocity.learn_sigma=true"], "learn_sigma is for objective"),
    ],
)
def test_recipe_mistakes_are_named(overrides, message):
    from mmformer.build import build_module
    from mmformer.recipe import RecipeError, load_recipe

    with pytest.raises(RecipeError, match=message):
        build_module(load_recipe(MNIST_RECIPE, overrides))


def test_ema_warms_up_and_skips_integer_tensors():
    from mmformer.training.callbacks import EMAWeights

    ema = EMAWeights(0.999)
    avg, cur = [torch.zeros(3), torch.tensor([7])], [torch.ones(3), torch.tensor([9])]
    ema._update(avg, cur, torch.tensor(0))  # n = 0: decay min(0.999, 1/10) = 0.1
    torch.testing.assert_close(avg[0], torch.full((3,), 0.9))
    assert avg[1].item() == 7
    ema._update(avg, cur, torch.tensor(10_000))  # later: the configured decay
    torch.testing.assert_close(avg[0], torch.full((3,), 0.9 + 0.1 * 0.001))


TEXT_RECIPE = """\
name: tinytext
model:
  tokenizers:
    image: {{kind: dit, image_size: 16, patch_size: 4, in_chans: 3, text_conditional: true}}
    caption: {{kind: bpe, vocab_size: 300}}
  backbone: {{d_model: 32, n_layers: 2, n_heads: 2, block: adaln, final_norm: false}}
  heads: {{eps: {{kind: dit}}}}
tasks:
  toy:
    kind: diffusion
    tokenizer: image
    caption_tokenizer: caption
    head: eps
    sample_steps: 2
    samples_per_class: 2
    data: {{kind: image_caption, root: {root}, batch_size: 4, num_workers: 0}}
optim: {{lr: 1e-3, warmup_steps: 1, ema_decay: 0.9}}
trainer: {{max_steps: 3, accelerator: cpu, devices: 1, log_every_n_steps: 1, enable_progress_bar: false,
          num_sanity_val_steps: 0}}
logger: {{mode: disabled}}
"""


def make_captioned(root):
    import json

    import numpy as np

    rng = np.random.default_rng(0)
    words = ["red", "green", "blue", "circle", "square", "small", "large"]
    (root / "img").mkdir(parents=True)
    for split, n in (("train", 12), ("val", 4)):
        rows = []
        for i in range(n):
            path = f"img/{split}{i}.png"
            Image.fromarray(rng.integers(0, 255, (20, 20, 3), dtype=np.uint8)).save(root / path)
            rows.append(json.dumps({"image": path, "caption": " ".join(rng.choice(words, 3))}))
        (root / f"{split}.jsonl").write_text("\n".join(rows) + "\n")
    return root


def test_text_conditional_trains_on_captions_and_samples_from_prompts(workdir, capsys):
    root = make_captioned(workdir / "caps")
    recipe = workdir / "text.yaml"
    recipe.write_text(TEXT_RECIPE.format(root=root))
    assert main(["train", str(recipe)]) == 0
    run = next((workdir / "runs" / "tinytext").glob("*"))
    grid = sorted((run / "samples").glob("toy-step*.png"))[-1]
    assert Image.open(grid).size == (2 * 17 + 1, 4 * 17 + 1)  # 2 per caption, the 4 val captions
    ckpt = str(run / "checkpoints" / "last.ckpt")
    out = workdir / "p.png"
    capsys.readouterr()
    args = ["sample", ckpt, "--prompt", "red circle", "--prompt", "blue square", "--n", "3", "--steps", "2"]
    assert main([*args, "--cfg-scale", "3", "--out", str(out)]) == 0
    assert Image.open(out).size == (3 * 17 + 1, 2 * 17 + 1)
    assert main(["sample", ckpt, "--out", str(out)]) == 2
    assert "give --prompt" in capsys.readouterr().err


def test_caption_conditioning_differs_by_caption_and_null_is_learned():
    from mmformer.tokenizers.diffusion import TextConditionEmbedder

    emb = TextConditionEmbedder(8, dropout=0.0).eval()
    torch.nn.init.normal_(emb.null)
    pooled = torch.randn(3, 8)
    out = emb(pooled)
    assert not torch.allclose(out[0], out[1])
    dropped = emb(pooled, torch.tensor([True, False, True]))
    assert torch.equal(dropped[0], emb.null) and torch.equal(dropped[2], emb.null)
    assert torch.equal(dropped[1], out[1])
    emb.dropout = 0.25
    rate = (emb.train()(torch.randn(40_000, 8)) == emb.null).all(-1).float().mean().item()
    assert abs(rate - 0.25) < 0.01


def test_validation_reports_the_unconditional_loss_on_the_same_noise():
    from mmformer.build import build_module
    from mmformer.recipe import recipe_from_yaml

    recipe = RECIPE.format(root="unused", objective="gaussian", learn_sigma="false", logger="disabled")
    module = build_module(recipe_from_yaml(recipe))
    model, task = module.model, module.tasks["toy"]
    for layer in (model.heads["eps"].linear, model.heads["eps"].adaLN_modulation[-1]):
        torch.nn.init.normal_(layer.weight)  # a head that reads its input and the condition
    images = torch.randint(0, 256, (4, 1, 28, 28), dtype=torch.uint8)
    batch = {"image": images, "label": torch.tensor([0, 1, 0, 1])}

    def losses():
        for metric in task.val_metrics.values():
            metric.reset()
        task.on_validation_epoch_start(model)
        task.validation_update(model.eval(), batch)
        return float(task.val_metrics["loss"].compute()), float(task.val_metrics["loss_uncond"].compute())

    table = model.tokenizers["image"].y_embedder.embedding_table.weight
    with torch.no_grad():
        table.copy_(table[2].expand_as(table))  # every class embeds like the null class (row 2)
    conditional, unconditional = losses()
    assert conditional == unconditional  # same noise, same timesteps, a condition that says nothing
    with torch.no_grad():
        torch.nn.init.normal_(table)
    conditional, unconditional = losses()
    assert conditional != unconditional and losses() == (conditional, unconditional)  # seeded
