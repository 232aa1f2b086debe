"""Conformer block: equal to torchaudio's ConformerLayer with the same weights; padding changes nothing
(batched equals one-at-a-time, garbage in the padding); builds as a backbone family."""

from __future__ import annotations

import pytest
import torch
from torchaudio.models.conformer import ConformerLayer

from mmformer.models import AttentionConfig, BlockConfig, PositionConfig, build_backbone
from mmformer.nn.attention import Attention, AttentionInputs
from mmformer.nn.conformer import ConformerBlock
from mmformer.nn.masks import MaskSpec
from mmformer.nn.tokens import Tokens


def _copy_from_torchaudio(ours: ConformerBlock, ta: ConformerLayer) -> None:
    with torch.no_grad():
        for mine, theirs in ((ours.ffn1, ta.ffn1.sequential), (ours.ffn2, ta.ffn2.sequential)):
            mine.norm.load_state_dict(theirs[0].state_dict())
            mine.fc1.load_state_dict(theirs[1].state_dict())
            mine.fc2.load_state_dict(theirs[4].state_dict())
        ours.norm_attn.load_state_dict(ta.self_attn_layer_norm.state_dict())
        ours.attn.qkv.weight.copy_(ta.self_attn.in_proj_weight)
        ours.attn.qkv.bias.copy_(ta.self_attn.in_proj_bias)
        ours.attn.proj.load_state_dict(ta.self_attn.out_proj.state_dict())
        conv = ta.conv_module
        ours.conv.norm.load_state_dict(conv.layer_norm.state_dict())
        ours.conv.pointwise_in.load_state_dict(conv.sequential[0].state_dict())
        ours.conv.depthwise.load_state_dict(conv.sequential[2].state_dict())
        ours.conv.batch_norm.load_state_dict(conv.sequential[3].state_dict())
        ours.conv.pointwise_out.load_state_dict(conv.sequential[5].state_dict())
        ours.norm_out.load_state_dict(ta.final_layer_norm.state_dict())


def test_equals_torchaudio_conformer_layer():
    torch.manual_seed(0)
    ta = ConformerLayer(32, 64, 4, depthwise_conv_kernel_size=7).eval()
    with torch.no_grad():  # non-trivial BatchNorm running statistics
        ta.conv_module.sequential[3].running_mean.uniform_(-0.5, 0.5)
        ta.conv_module.sequential[3].running_var.uniform_(0.5, 2.0)
    ours = ConformerBlock(32, Attention(32, 4, kernel="eager"), 64, conv_kernel=7).eval()
    _copy_from_torchaudio(ours, ta)
    x = torch.randn(3, 20, 32)
    with torch.no_grad():
        expected = ta(x.transpose(0, 1), None).transpose(0, 1)
        torch.testing.assert_close(ours(x, AttentionInputs()), expected, rtol=1e-5, atol=1e-5)


def test_padding_changes_nothing():
    torch.manual_seed(0)
    block = ConformerBlock(32, Attention(32, 4), 64, conv_kernel=5).eval()
    lengths = [20, 9, 14]
    x = torch.randn(3, 20, 32)
    valid = torch.arange(20)[None] < torch.tensor(lengths)[:, None]
    x = torch.where(valid[..., None], x, torch.full_like(x, 30.0))
    with torch.no_grad():
        batched = block(x, AttentionInputs(mask=MaskSpec(valid=valid)))
        for i, n in enumerate(lengths):
            alone = block(x[i : i + 1, :n], AttentionInputs())
            torch.testing.assert_close(batched[i : i + 1, :n], alone, rtol=1e-5, atol=1e-5)


def test_a_conformer_backbone_builds_and_trains_a_step():
    backbone = build_backbone(
        32,
        2,
        AttentionConfig(4),
        positions=PositionConfig("rope"),
        block=BlockConfig("conformer", conv_kernel=5),
    )
    x = torch.randn(2, 12, 32, requires_grad=True)
    out = backbone(Tokens.from_embeddings(x, modality=2))
    out.square().mean().backward()
    assert out.shape == (2, 12, 32) and x.grad is not None
    with pytest.raises(ValueError, match="odd"):
        build_backbone(32, 1, AttentionConfig(4), block=BlockConfig("conformer", conv_kernel=4))
