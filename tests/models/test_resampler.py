"""Perceiver resampler: a fixed token budget whatever the input length, padding never read (batched
equals one-at-a-time), and a recipe that puts one between a ViT tokenizer and the backbone trains."""

from __future__ import annotations

import torch

from mmformer.cli import main
from mmformer.models.resampler import PerceiverResampler
from tests.conftest import TINY_RECIPE


def test_fixed_budget_and_padding_is_never_read():
    torch.manual_seed(0)
    r = PerceiverResampler(32, num_latents=6, n_layers=2, n_heads=4).eval()
    lengths = [3, 11, 7]
    x = torch.randn(3, 11, 32)
    valid = torch.arange(11)[None] < torch.tensor(lengths)[:, None]
    x = torch.where(valid[..., None], x, torch.full_like(x, 1e4))  # garbage in the padding
    with torch.no_grad():
        batched = r(x, valid)
        alone = [r(x[i : i + 1, :n]) for i, n in enumerate(lengths)]
    assert batched.shape == (3, 6, 32) and alone[0].shape == (1, 6, 32)
    for i in range(3):
        torch.testing.assert_close(batched[i : i + 1], alone[i], rtol=1e-5, atol=1e-5)


def test_latents_attend_to_inputs_and_to_themselves():
    """One layer by hand: softmax attention of the normed latents over [normed inputs; normed latents]."""
    torch.manual_seed(1)
    r = PerceiverResampler(16, num_latents=3, n_layers=1, n_heads=1, mlp_ratio=1.0).eval()
    x = torch.randn(1, 5, 16)
    layer = r.layers[0]
    with torch.no_grad():
        q_in = layer["norm_latents"](r.latents[None])
        ctx = torch.cat([layer["norm_x"](x), q_in], dim=1)
        attn = layer["attn"]
        q = attn.q(q_in)
        k, v = attn.kv(ctx).chunk(2, dim=-1)
        w = torch.softmax(q @ k.transpose(1, 2) / 16**0.5, dim=-1)
        lat = r.latents[None] + attn.proj(w @ v)
        lat = lat + layer["mlp"](layer["norm_mlp"](lat))
        torch.testing.assert_close(r(x), r.norm(lat), rtol=1e-5, atol=1e-5)


def test_a_resampled_vit_trains_through_the_cli(workdir, capsys):
    from tests.conftest import make_image_folder

    folder = make_image_folder(workdir / "images")
    recipe = workdir / "r.yaml"
    text = TINY_RECIPE.format(name="resampled", root=folder)
    text = text.replace(
        "  backbone: {preset: debug}",
        "  backbone: {preset: debug}\n  resamplers: {image: {num_latents: 4, n_heads: 2}}",
    )
    text = text.replace("num_classes: 2}", "num_classes: 2, pool: mean}")  # no class token after resampling
    recipe.write_text(text)
    assert main(["train", str(recipe), "trainer.max_epochs=1"]) == 0
    assert "val/toy/acc" in capsys.readouterr().out
    assert main(["train", str(recipe), "model.resamplers={imagee: {num_latents: 4}}"]) == 2
    assert "Did you mean 'image'?" in capsys.readouterr().err
