"""The analytic FLOP count (``FlopMeter``, what throughput / MFU logging uses) equals
``torch.utils.flop_counter`` on the eager attention path, for each model family."""

from __future__ import annotations

import pytest
import torch

from mmformer.models import (
    AttentionConfig,
    BlockConfig,
    MlpConfig,
    PositionConfig,
    build_backbone,
    count_flops,
)
from mmformer.models.flops import FlopMeter, analytic_flops
from mmformer.models.heads import ClassifierHead, DiTFinalLayer, LMHead
from mmformer.models.model import MultimodalModel
from mmformer.nn.lora import apply_lora
from mmformer.tokenizers import TextEmbedding
from mmformer.tokenizers.diffusion import DiTTokenizer
from mmformer.tokenizers.image import ViTPatchTokenizer


def _vit():
    return (
        MultimodalModel(
            {"image": ViTPatchTokenizer(48, 32, 8, 3)},
            build_backbone(48, 2, AttentionConfig(4)),
            {"cls": ClassifierHead(48, 5, pool="cls")},
        ),
        torch.randn(3, 3, 32, 32),
        "image",
        "cls",
    )


def _llama():
    emb = TextEmbedding(97, 64)
    backbone = build_backbone(
        64,
        2,
        AttentionConfig(4, n_kv_heads=2, qkv_bias=False),
        mlp=MlpConfig(act="swiglu"),
        positions=PositionConfig("rope"),
        norm="rmsnorm",
        causal=True,
    )
    return (
        MultimodalModel({"text": emb}, backbone, {"lm": LMHead(64, 97)}),
        torch.randint(0, 97, (2, 13)),
        "text",
        "lm",
    )


def _dit():
    tok = DiTTokenizer(32, image_size=8, patch_size=2, in_chans=1, num_classes=3)
    model = MultimodalModel(
        {"x": tok},
        build_backbone(32, 2, AttentionConfig(4), block=BlockConfig("adaln"), final_norm=False),
        {"eps": DiTFinalLayer(32, 2, (4, 4), 1)},
    )
    return model, tok.example_input(2), "x", "eps"


def _conformer():
    emb = TextEmbedding(97, 32)
    backbone = build_backbone(
        32,
        2,
        AttentionConfig(4),
        positions=PositionConfig("rope"),
        block=BlockConfig("conformer", conv_kernel=5),
    )
    return (
        MultimodalModel({"text": emb}, backbone, {"lm": LMHead(32, 97)}),
        torch.randint(0, 97, (2, 9)),
        "text",
        "lm",
    )


def _vit_lora():
    """LoRA-wrapped products (``attn.qkv.base`` …) and a class-token head: the last block's qkv still runs
    over every token, the rest over the class token only."""
    model, *rest = _vit()
    apply_lora(model, within="backbone", rank=4)
    return (model, *rest)


def _vit_mean():  # a mean-pooling head reads every row: no row is skipped
    model, *rest = _vit()
    model.heads["cls"] = ClassifierHead(48, 5, pool="mean")
    return (model, *rest)


@pytest.mark.parametrize(
    "make",
    [_vit, _vit_lora, _vit_mean, _llama, _dit, _conformer],
    ids=["vit", "vit-lora", "vit-mean-pool", "llama-gqa-swiglu", "dit-adaln", "conformer"],
)
def test_analytic_flops_equal_the_flop_counter_on_the_eager_path(make):
    torch.manual_seed(0)
    model, inputs, tokenizer, head = make()
    measured = count_flops(model, inputs, tokenizer, head)
    assert analytic_flops(model, inputs, tokenizer, head) == measured["forward"]
    if not all(p.requires_grad for p in model.parameters()):
        return  # LoRA: the frozen weights get no gradient products
    # a training step: backward costs about twice the forward (less the first layer's input gradient;
    # the counter charges a depthwise convolution's backward a little more)
    assert 2.7 * measured["forward"] < measured["train"] <= 3.25 * measured["forward"]


def test_the_meter_counts_every_call_and_detaches():
    model, inputs, tokenizer, head = _vit()
    meter = FlopMeter(model)
    with torch.no_grad():
        model(inputs, tokenizer, head)
        one = meter.take()
        model(inputs, tokenizer, head)
        model(inputs, tokenizer, head)
    assert meter.take() == 2 * one and one > 0
    meter.close()
    with torch.no_grad():
        model(inputs, tokenizer, head)
    assert meter.take() == 0
