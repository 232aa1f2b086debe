"""The VQ codec (``mmformer.tokenizers.vq``): straight-through gradients, the nearest-code lookup against
brute force, exact id round trips, dead-code restarts, perplexity, the tokenizer's Tokens, and the
errors for bad input (sizes, ids, a checkpoint of other sizes)."""

from __future__ import annotations

import dataclasses
import inspect
import math

import pytest
import torch
import torch.nn.functional as F

from mmformer.components.vq import VQTokenizerConfig
from mmformer.tokenizers import Tokenizer
from mmformer.tokenizers.vq import VQVAE, FactorizedQuantizer, VQTokenizer, code_perplexity, load_vq

TINY = dict(image_size=16, in_chans=1, channels=(8, 8), d_latent=8, codebook_size=16, code_dim=4)


def tiny(**kw) -> VQVAE:
    torch.manual_seed(0)
    return VQVAE(**{**TINY, **kw})


def test_shapes_and_grids_of_the_two_datasets():
    mnist, emoji = VQVAE(image_size=28, in_chans=1), VQVAE(image_size=32, in_chans=3)
    assert mnist.grid == (7, 7) and emoji.grid == (8, 8)
    out = emoji(torch.rand(2, 3, 32, 32) * 2 - 1)
    assert out.recon.shape == (2, 3, 32, 32) and out.ids.shape == (2, 64) and out.ids.dtype == torch.long
    assert mnist.encode(torch.zeros(3, 1, 28, 28, dtype=torch.uint8)).shape == (3, 49)


def test_straight_through_gradient_reaches_the_encoder_as_if_quantisation_were_identity():
    q = FactorizedQuantizer(d_latent=6, codebook_size=10, code_dim=3, restart_after=0)
    z = torch.randn(2, 6, 3, 3, requires_grad=True)
    w = torch.randn(2, 6, 3, 3)
    (q(z).z_q * w).sum().backward()
    # reference: the same function with the code replaced by the encoder's own (normalised) vector
    z2 = z.detach().clone().requires_grad_(True)
    (q._up(q.project(z2), (3, 3)) * w).sum().backward()
    assert z.grad.abs().sum() > 0
    torch.testing.assert_close(z.grad, z2.grad)
    # and through the whole codec: the reconstruction loss alone moves the encoder's first conv
    vq = tiny(restart_after=0)
    F.mse_loss(vq(torch.rand(2, 1, 16, 16)).recon, torch.zeros(2, 1, 16, 16)).backward()
    assert vq.encoder.conv_in.weight.grad.abs().sum() > 0


def test_lookup_equals_the_brute_force_nearest_normalised_code():
    torch.manual_seed(1)
    q = FactorizedQuantizer(d_latent=5, codebook_size=37, code_dim=4)
    z = torch.randn(3, 5, 4, 4)
    ids = q(z).ids  # (3, 16)
    vectors = F.normalize(q.in_proj(z.flatten(2).transpose(1, 2)), dim=-1)  # (3, 16, 4)
    codes = q.codebook / q.codebook.norm(dim=-1, keepdim=True)
    for b in range(3):
        for n in range(16):
            distances = [float(((vectors[b, n] - codes[k]) ** 2).sum().detach()) for k in range(37)]
            assert ids[b, n] == min(range(37), key=distances.__getitem__)


def test_code_ids_round_trip_exactly():
    vq = tiny().eval()
    ids = torch.randint(0, 16, (4, vq.num_codes))
    codes = vq.quantizer.normalized_codebook()[ids]  # what decode feeds the decoder, before out_proj
    assert torch.equal(vq.quantizer.nearest(codes), ids)  # each code is its own nearest code
    x = torch.rand(4, 1, 16, 16) * 2 - 1
    with torch.no_grad():
        out = vq(x)
        assert torch.equal(vq.encode(x), out.ids)
        torch.testing.assert_close(vq.decode(out.ids), out.recon.clamp(-1, 1), atol=1e-5, rtol=0)
        assert vq.decode(ids).abs().max() <= 1


def test_a_dead_code_is_restarted_from_the_batch_and_used_codes_are_kept():
    torch.manual_seed(2)
    q = FactorizedQuantizer(d_latent=4, codebook_size=8, code_dim=4, restart_after=2).train()
    q.in_proj.weight.data.copy_(torch.eye(4))
    q.in_proj.bias.data.zero_()
    q.codebook.data.copy_(torch.cat([torch.eye(4), -torch.eye(4)]))  # ±axes: codes 0-3 = +e_i, 4-7 = −e_i
    z = torch.tensor([[1.0, 0.1, 0, 0], [0, 1.0, 0.1, 0]]).view(2, 4, 1, 1)  # chooses codes 0 and 1 only
    before = q.codebook.detach().clone()
    q(z)
    assert q.unused_steps.tolist() == [0, 0, 1, 1, 1, 1, 1, 1]
    assert torch.equal(q.codebook, before)
    out = q(z)  # the second step without codes 2-7: restarted
    assert q.unused_steps.tolist() == [0] * 8
    assert torch.equal(q.codebook[:2], before[:2])
    batch = F.normalize(z.view(2, 4), dim=-1)
    for k in range(2, 8):
        assert not torch.equal(q.codebook[k], before[k])
        assert (F.normalize(q.codebook[k], dim=0) @ batch.t()).max() > 0.99  # a batch vector, plus noise
    assert out.counts.tolist() == [1, 1, 0, 0, 0, 0, 0, 0]
    # eval mode, no-grad or a frozen codebook: never restarted
    q.unused_steps.fill_(5)
    for mode in ("eval", "no_grad", "frozen"):
        q.train(mode != "eval").requires_grad_(mode != "frozen")
        with torch.set_grad_enabled(mode != "no_grad"):
            q(z)
        assert q.unused_steps.tolist()[2:] == [5] * 6


def test_perplexity_and_usage():
    assert math.isclose(float(code_perplexity(torch.ones(16))), 16.0, rel_tol=1e-6)
    assert math.isclose(float(code_perplexity(torch.tensor([0, 7, 0, 0]))), 1.0)
    p = torch.tensor([3.0, 1.0])
    assert math.isclose(
        float(code_perplexity(p)), math.exp(-(0.75 * math.log(0.75) + 0.25 * math.log(0.25))), rel_tol=1e-6
    )
    out = tiny()(torch.rand(2, 1, 16, 16))
    assert float(out.usage) == (out.counts > 0).float().mean() and int(out.counts.sum()) == 2 * 16


def test_tokenizer_embeds_codes_on_a_2d_grid():
    vq = tiny()
    tok = VQTokenizer(vq, d_model=12)
    assert isinstance(tok, Tokenizer)
    x = torch.randint(0, 256, (2, 1, 16, 16), dtype=torch.uint8)
    tokens = tok(x)
    assert tokens.x.shape == (2, 16, 12) and tokens.positions.shape == (2, 16, 2)
    assert tokens.positions[0, 5].tolist() == [1, 1]  # row-major over the 4×4 grid
    torch.testing.assert_close(tok(vq.encode(x)).x, tokens.x)  # ids in = images in
    with pytest.raises(ValueError, match=r"ids \(B, 16\)"):
        tok(torch.zeros(2, 15, dtype=torch.long))


def test_component_defaults_are_the_codec_defaults():
    """``load_vq`` rebuilds a codec from a stored recipe; the recipe's defaults must be the codec's."""
    codec = {k: p.default for k, p in inspect.signature(VQVAE.__init__).parameters.items() if k != "self"}
    config = {f.name: getattr(VQTokenizerConfig(), f.name) for f in dataclasses.fields(VQTokenizerConfig)}
    for key, value in codec.items():
        assert config[key] == (list(value) if isinstance(value, tuple) else value), key


@pytest.mark.parametrize(
    "kw, message",
    [
        (dict(image_size=18), "image_size=18 is not divisible by 2\\*\\*len\\(channels\\)=4"),
        (dict(codebook_size=0), "positive"),
    ],
)
def test_bad_sizes_are_named(kw, message):
    with pytest.raises(ValueError, match=message):
        tiny(**kw)


def test_bad_inputs_are_named():
    vq = tiny()
    with pytest.raises(ValueError, match=r"expects images \(B, 1, 16, 16\), got \(2, 3, 16, 16\)"):
        vq.encode(torch.zeros(2, 3, 16, 16))
    with pytest.raises(ValueError, match=r"must be in \[0, 16\), got \[16, 16\]"):
        vq.decode(torch.full((1, 16), 16))
    with pytest.raises(ValueError, match=r"expects ids \(B, 16\)"):
        vq.decode(torch.zeros(1, 49, dtype=torch.long))


def _fake_run_checkpoint(path, vq: VQVAE) -> None:
    """A checkpoint as a vq run writes it: the recipe and the codec's weights under its tokenizer."""
    sizes = {**vq.config, "channels": list(vq.config["channels"])}
    recipe = {
        "model": {"tokenizers": {"img": {"kind": "vq", **sizes, "checkpoint": None}}},
        "tasks": {"rec": {"kind": "vq", "tokenizer": "img"}},
    }
    import yaml

    state = {f"model.tokenizers.img.vq.{k}": v for k, v in vq.state_dict().items()}
    torch.save({"mmformer": {"recipe_yaml": yaml.safe_dump(recipe)}, "state_dict": state}, path)


def test_load_vq_rebuilds_the_codec_frozen_and_refuses_other_sizes(tmp_path):
    vq = tiny()
    path = tmp_path / "vq.ckpt"
    _fake_run_checkpoint(path, vq)
    loaded = load_vq(path, image_size=16, codebook_size=16)
    assert not loaded.training and not any(p.requires_grad for p in loaded.parameters())
    x = torch.rand(2, 1, 16, 16)
    assert torch.equal(loaded.encode(x), vq.encode(x))
    with pytest.raises(ValueError, match=r"image_size=16 \(asked: 28\).*codebook_size=16 \(asked: 512\)"):
        load_vq(path, image_size=28, codebook_size=512)
    with pytest.raises(ValueError, match=r"in_chans=1 \(asked: 3\)"):
        load_vq(path, in_chans=3)
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_vq(tmp_path / "missing.ckpt")
    torch.save({"state_dict": {}}, tmp_path / "foreign.ckpt")
    with pytest.raises(ValueError, match="not an mmformer training checkpoint"):
        load_vq(tmp_path / "foreign.ckpt")
