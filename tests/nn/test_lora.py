"""LoRA: a fresh adapter changes nothing, merging gives the same function, only adapters train."""

import pytest
import torch
from torch import nn

from mmformer.models.pretrained.llama import build_llama
from mmformer.nn.lora import LoRALinear, apply_lora, merge_lora
from tests.conftest import TINY_LLAMA


def test_lora_linear_is_base_plus_scaled_low_rank_update():
    torch.manual_seed(0)
    base = nn.Linear(6, 5)
    lora = LoRALinear(base, rank=2, alpha=4.0)
    x = torch.randn(3, 6)
    torch.testing.assert_close(lora(x), base(x))  # B = 0 at init
    nn.init.normal_(lora.lora_B.weight)
    want = base(x) + 2.0 * x @ lora.lora_A.weight.T @ lora.lora_B.weight.T
    torch.testing.assert_close(lora(x), want)
    assert not base.weight.requires_grad and lora.lora_A.weight.requires_grad


def test_merged_model_equals_adapter_model():
    torch.manual_seed(0)
    model = build_llama(TINY_LLAMA).eval()
    wrapped = apply_lora(model, rank=4, alpha=8.0, within="backbone")
    assert len(wrapped) == 2 * 4 and all(n.startswith("backbone.blocks.") for n in wrapped)
    for m in model.modules():
        if isinstance(m, LoRALinear):
            nn.init.normal_(m.lora_B.weight, std=0.1)  # as if trained
    ids = torch.randint(0, 50, (2, 7))
    with torch.no_grad():
        adapted = model(ids, "text", "lm")
        assert merge_lora(model) == 8
        assert not any(isinstance(m, LoRALinear) for m in model.modules())
        torch.testing.assert_close(model(ids, "text", "lm"), adapted, rtol=1e-5, atol=1e-5)


def test_only_adapters_receive_gradients():
    model = build_llama(TINY_LLAMA)
    for p in model.parameters():
        p.requires_grad_(False)
    apply_lora(model, targets=("qkv",), within="backbone")
    model(torch.randint(0, 50, (1, 5)), "text", "lm").sum().backward()
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable and all(".lora_" in n for n in trainable)
    assert all(p.grad is not None for n, p in model.named_parameters() if n in trainable)


def test_a_target_that_matches_nothing_is_an_error():
    with pytest.raises(ValueError, match="no nn.Linear named"):
        apply_lora(build_llama(TINY_LLAMA), targets=("q_proj",))
