"""The analytic FLOP count (``FlopMeter``, what throughput / MFU logging uses) equals
``torch.utils.flop_counter`` (``count_flops``: softmax kernels on the eager path, every other kernel as
itself), for each model family and each attention kernel."""

from __future__ import annotations

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

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
from mmformer.nn.attention import Attention
from mmformer.nn.lora import apply_lora
from mmformer.nn.masks import MaskSpec
from mmformer.nn.tokens import Tokens
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


# every kernel that is not softmax attention, with options for a small model (AFT's biases cover N);
# N = 75 tokens: not a multiple of LSH's chunks (16) nor AFT-local's blocks (8), more than one chunk of the
# Performer's and RFA's causal scans (64)
N = 75
KERNEL_CASES = [
    ("eager", {}),
    ("performer", {}),
    ("lsh", {"n_buckets": 4, "n_hashes": 2, "chunk_size": 16}),
    ("lsh", {"n_buckets": 1, "chunk_size": 32}),
    ("aft_full", {"max_len": 128}),
    ("aft_local", {"window": 8, "max_len": 128}),
    ("aft_simple", {}),
    ("rfa", {"n_features": 8}),
]
KERNEL_IDS = ["eager", "performer", "lsh", "lsh-one-bucket", "aft_full", "aft_local", "aft_simple", "rfa"]


def _text_model(
    kernel: str, options: dict, causal: bool, block: BlockConfig | None = None, performer_features: int = 12
) -> MultimodalModel:
    attention = AttentionConfig(
        4, kernel=kernel, kernel_options=options, performer_features=performer_features
    )
    backbone = build_backbone(
        32, 2, attention, positions=PositionConfig("rope"), causal=causal, block=block or BlockConfig()
    )
    return MultimodalModel({"text": TextEmbedding(97, 32)}, backbone, {"lm": LMHead(32, 97)})


def _padded_ids() -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.randint(0, 97, (2, N))
    valid = torch.ones(2, N, dtype=torch.bool)
    valid[1, N - 11 :] = False  # right padding in one row
    return ids, valid


def _softmax_flops(model: MultimodalModel, ids: torch.Tensor, valid: torch.Tensor) -> int:
    """The model's measured forward FLOPs with every layer on the eager softmax kernel, then restored."""
    kernel = model.backbone.blocks[0].attn.kernel
    model.backbone.set_attn_kernel("eager")
    try:
        return count_flops(model, ids, "text", "lm", valid=valid)["forward"]
    finally:
        model.backbone.set_attn_kernel(kernel)


@pytest.mark.parametrize("causal", [False, True], ids=["bidirectional", "causal"])
@pytest.mark.parametrize(("kernel", "options"), KERNEL_CASES, ids=KERNEL_IDS)
def test_analytic_flops_equal_the_flop_counter_for_every_kernel(kernel, options, causal):
    torch.manual_seed(0)
    model = _text_model(kernel, options, causal)
    ids, valid = _padded_ids()
    measured = count_flops(model, ids, "text", "lm", valid=valid)
    assert analytic_flops(model, ids, "text", "lm", valid=valid) == measured["forward"]
    assert measured["train"] > 2 * measured["forward"]  # the kernel's backward ran and was counted too
    softmax = _softmax_flops(model, ids, valid)
    if kernel == "eager":
        assert measured["forward"] == softmax
    elif kernel == "aft_full":  # exp(w) @ (exp(K) ⊙ V) and exp(w) @ exp(K): softmax's two N × N × Dh products
        assert measured["forward"] == softmax
    else:
        assert measured["forward"] != softmax


def test_the_counts_follow_the_kernel_options_and_rfa_gate():
    """A causal RFA-Gate backbone counts its gate's logits; more LSH rounds, RFA features or Performer
    features cost more, as measured."""
    torch.manual_seed(0)
    ids, valid = _padded_ids()

    def measured_and_analytic(kernel: str, options: dict, **model) -> int:
        m = _text_model(kernel, options, causal=True, **model)
        measured = count_flops(m, ids, "text", "lm", valid=valid)["forward"]
        assert analytic_flops(m, ids, "text", "lm", valid=valid) == measured
        return measured

    rfa = measured_and_analytic("rfa", {"n_features": 8})
    gated = measured_and_analytic("rfa", {"n_features": 8, "gate": True})
    assert gated - rfa == 2 * (2 * 2 * 4 * N * 8)  # two layers' logits w_g · k_t: 2 · B · H · N · Dh each
    assert measured_and_analytic("rfa", {"n_features": 16}) > rfa
    lsh = {"n_buckets": 4, "chunk_size": 16}
    assert measured_and_analytic("lsh", {**lsh, "n_hashes": 2}) > measured_and_analytic("lsh", lsh)
    performer = measured_and_analytic("performer", {})
    assert measured_and_analytic("performer", {}, performer_features=24) > performer


def test_a_reversible_lsh_model_is_counted_as_it_runs():
    """Reformer's shape: reversible blocks with LSH attention."""
    torch.manual_seed(0)
    model = _text_model(
        "lsh", {"n_buckets": 4, "chunk_size": 16}, causal=True, block=BlockConfig(reversible=True)
    )
    ids, valid = _padded_ids()
    measured = count_flops(model, ids, "text", "lm", valid=valid)
    assert analytic_flops(model, ids, "text", "lm", valid=valid) == measured["forward"]
    assert measured["forward"] != _softmax_flops(model, ids, valid)


@pytest.mark.parametrize(
    ("kernel", "options"),
    [
        ("eager", {}),
        ("performer", {}),
        ("aft_full", {"max_len": 128}),
        ("aft_simple", {}),
        ("rfa", {"n_features": 8}),
    ],
    ids=["eager", "performer", "aft_full", "aft_simple", "rfa"],
)
def test_cross_attention_kernels_are_counted_over_the_context(kernel, options):
    """Cross-attention (never causal) reads ``N_ctx`` keys for ``N`` queries: kernels that attend across."""
    torch.manual_seed(0)
    attention = AttentionConfig(4, kernel=kernel, kernel_options=options, performer_features=12)
    backbone = build_backbone(32, 2, attention, block=BlockConfig("cross"), causal=True)
    x, ctx = torch.randn(2, 21, 32), torch.randn(2, 9, 32)
    ctx_valid = torch.ones(2, 9, dtype=torch.bool)
    ctx_valid[0, 6:] = False
    meter = FlopMeter(backbone)
    with FlopCounterMode(display=False) as counter, torch.no_grad():
        backbone(Tokens.from_embeddings(x, 0), context=Tokens.from_embeddings(ctx, 0, valid=ctx_valid))
    meter.close()
    assert meter.take() == counter.get_total_flops()


@pytest.mark.parametrize("n", [1, 7, 16, 64, 65, 128])
@pytest.mark.parametrize(
    ("kernel", "options"),
    [*KERNEL_CASES, ("rfa", {"n_features": 8, "gate": True}), ("aft_local", {"window": 50, "max_len": 256})],
    ids=[*KERNEL_IDS, "rfa-gate", "aft_local-wide"],
)
def test_a_layer_counts_its_kernel_at_every_length(kernel, options, n):
    """One chunk or several, a partial last chunk or none, a window wider than the sequence: the layer's
    ``attention_flops`` is what the counter measures between its two projections."""
    torch.manual_seed(0)
    attn = Attention(32, 4, kernel=kernel, kernel_options=options, performer_features=12)
    for causal in (True,) if options.get("gate") else (False, True):
        with FlopCounterMode(display=False) as counter, torch.no_grad():
            attn(torch.randn(2, n, 32), MaskSpec(causal=causal))
        projections = 2 * 2 * n * 32 * (3 * 32) + 2 * 2 * n * 32 * 32  # qkv and proj
        assert attn.attention_flops(2, n, n, causal) == counter.get_total_flops() - projections
