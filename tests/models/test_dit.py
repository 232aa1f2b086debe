"""DiT pieces against the reference implementation's formulas (facebookresearch/DiT models.py)."""

from __future__ import annotations

import numpy as np
import torch

from mmformer.models import AttentionConfig, BlockConfig, build_backbone
from mmformer.models.heads import DiTFinalLayer
from mmformer.models.model import MultimodalModel
from mmformer.nn.tokens import ConditionedTokens
from mmformer.tokenizers.diffusion import LabelEmbedder, TimestepEmbedder, sincos_pos_embed_2d


def _dit_reference_pos_embed(embed_dim: int, grid_size: int) -> np.ndarray:
    """DiT's get_2d_sincos_pos_embed, verbatim in numpy."""

    def from_grid_1d(dim, pos):
        omega = np.arange(dim // 2, dtype=np.float64) / (dim / 2.0)
        omega = 1.0 / 10000**omega
        out = np.einsum("m,d->md", pos.reshape(-1), omega)
        return np.concatenate([np.sin(out), np.cos(out)], axis=1)

    grid_h = np.arange(grid_size, dtype=np.float32)
    grid_w = np.arange(grid_size, dtype=np.float32)
    grid = np.stack(np.meshgrid(grid_w, grid_h), axis=0).reshape([2, 1, grid_size, grid_size])
    emb_h = from_grid_1d(embed_dim // 2, grid[0])
    emb_w = from_grid_1d(embed_dim // 2, grid[1])
    return np.concatenate([emb_h, emb_w], axis=1)


def test_pos_embed_equals_dit():
    ours = sincos_pos_embed_2d(64, (7, 7)).numpy()
    np.testing.assert_allclose(ours, _dit_reference_pos_embed(64, 7), atol=1e-6)


def test_timestep_frequencies_equal_dit_and_are_distinct_over_all_steps():
    emb = TimestepEmbedder(32, freq_dim=256)
    t = torch.arange(1000)
    f = emb.frequencies(t)
    half = 128
    freqs = torch.exp(-np.log(10000) * torch.arange(half, dtype=torch.float32) / half)
    args = t[:, None].float() * freqs[None]
    torch.testing.assert_close(f, torch.cat([torch.cos(args), torch.sin(args)], -1))
    d = torch.cdist(f, f) + torch.eye(1000) * 1e9
    assert d.min() > 0.1  # every pair of steps is told apart
    # flow-matching times t ∈ [0, 1] are embedded as 1000·t: as spread as the integer steps
    g = emb.frequencies(torch.linspace(0, 1, 1000) * 1000)
    assert (torch.cdist(g, g) + torch.eye(1000) * 1e9).min() > 0.1


def test_labels_become_the_null_class_at_the_configured_rate_in_training_only():
    emb = LabelEmbedder(10, 8, dropout=0.1)
    torch.manual_seed(0)
    labels = torch.randint(0, 10, (200_000,))
    out = emb.train().drop(labels)
    dropped = out == 10
    assert abs(dropped.float().mean().item() - 0.1) < 0.003
    assert torch.equal(out[~dropped], labels[~dropped])  # the others are untouched
    assert torch.equal(emb.eval().drop(labels), labels)  # no dropout outside training
    forced = torch.zeros_like(labels, dtype=torch.bool)
    forced[:5] = True
    assert (emb.eval().drop(labels, forced)[:5] == 10).all()  # guidance's unconditional half


def test_unpatchify_equals_dit():
    torch.manual_seed(0)
    head = DiTFinalLayer(16, patch_size=4, grid_size=(7, 7), out_chans=2)
    torch.nn.init.normal_(head.linear.weight)
    hidden, cond = torch.randn(3, 49, 16), torch.randn(3, 16)
    out = head(hidden, None, cond)
    # DiT: FinalLayer then unpatchify with einsum("nhwpqc->nchpwq")
    shift, scale = head.adaLN_modulation(cond).chunk(2, dim=1)
    x = head.linear(head.norm_final(hidden) * (1 + scale[:, None]) + shift[:, None])
    x = x.reshape(3, 7, 7, 4, 4, 2)
    ref = torch.einsum("nhwpqc->nchpwq", x).reshape(3, 2, 28, 28)
    torch.testing.assert_close(out, ref)


def test_dit_starts_as_identity_blocks_and_predicts_zero():
    from mmformer.tokenizers.diffusion import DiTTokenizer

    tok = DiTTokenizer(32, image_size=8, patch_size=2, in_chans=1, num_classes=3)
    backbone = build_backbone(32, 3, AttentionConfig(4), block=BlockConfig("adaln"), final_norm=False)
    model = MultimodalModel({"x": tok}, backbone, {"eps": DiTFinalLayer(32, 2, (4, 4), 1)})
    x = torch.randn(2, 1, 8, 8)
    tokens = tok(x, torch.tensor([5, 900]), torch.tensor([0, 2]))
    assert isinstance(tokens, ConditionedTokens) and tokens.cond.shape == (2, 32)
    torch.testing.assert_close(backbone(tokens, cond=tokens.cond), tokens.x)  # every block is the identity
    out = model(x, "x", "eps", t=torch.tensor([5, 900]), labels=torch.tensor([0, 2]))
    assert out.shape == (2, 1, 8, 8) and torch.equal(out, torch.zeros_like(out))
