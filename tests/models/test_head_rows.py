"""Computing only the rows a head reads (``Backbone.forward(rows=…)``, ``ClassifierHead.reads``): the same
values and gradients as the full forward's rows, the shortcut taken where the mask allows it and refused
where a row's attention depends on the row."""

import pytest
import torch

from mmformer.models import (
    AttentionConfig,
    BlockConfig,
    LongContextConfig,
    MlpConfig,
    MultimodalModel,
    PositionConfig,
    build_backbone,
)
from mmformer.models.heads import ClassifierHead, ProjectionHead
from mmformer.nn import Attention, KVCache, MaskSpec, Tokens
from mmformer.tokenizers import ViTPatchTokenizer

D, B, N = 32, 3, 7
CLS = slice(0, 1)

FAMILIES = {  # build_backbone's settings; "attention" beyond n_heads
    "vit": dict(block=BlockConfig(drop_path=0.3, layer_scale=0.5)),
    "bert": dict(block=BlockConfig("post"), norm_eps=1e-12),
    "bidirectional_llama": dict(  # RoPE, GQA, qk-norm, RMSNorm, SwiGLU; not causal
        attention=dict(n_kv_heads=2, qkv_bias=False, qk_norm=True),
        norm="rmsnorm",
        mlp=MlpConfig(act="swiglu", bias=False),
        positions=PositionConfig("rope"),
    ),
    "cross": dict(block=BlockConfig("cross")),  # an encoder with cross-attention to a context
}


def _backbone(family: str, kernel: str, **override):
    settings = {**FAMILIES.get(family, {}), **override}
    attention = AttentionConfig(4, kernel=kernel, **settings.pop("attention", {}))
    torch.manual_seed(0)
    return build_backbone(D, 3, attention, **settings)


def _tokens(padded: bool = True, grad: bool = True) -> tuple[Tokens, torch.Tensor]:
    torch.manual_seed(1)
    x = torch.randn(B, N, D, requires_grad=grad)
    valid = torch.ones(B, N, dtype=torch.bool)
    if padded:
        valid[1, 4:] = False
        valid[2, 6:] = False
    return Tokens.from_embeddings(x, 0, valid=valid), x


def _last_mlp_rows(backbone) -> list[int]:
    """Record how many rows the last block's attention outputs (the shortcut's visible effect)."""
    seen = []
    backbone.blocks[-1].attn.register_forward_hook(lambda m, args, out: seen.append(out.shape[1]))
    return seen


def _run(backbone, tokens, rows=None, seed=2, **kw):
    torch.manual_seed(seed)  # the same stochastic depth draws in both runs
    return backbone(tokens, rows=rows, **kw)


@pytest.mark.parametrize("kernel", ["eager", "sdpa"])
@pytest.mark.parametrize("family", list(FAMILIES))
def test_rows_equal_the_full_forwards_rows_with_their_gradients(family, kernel):
    backbone = _backbone(family, kernel).train()
    kw = {}
    if family == "cross":
        kw["context"] = Tokens.from_embeddings(torch.randn(B, 4, D), 1)
    tokens, x = _tokens()
    full = _run(backbone, tokens, **kw)
    (full[:, CLS] ** 2).sum().backward()
    grads = {n: p.grad.clone() for n, p in backbone.named_parameters() if p.grad is not None}
    grad_x = x.grad.clone()
    backbone.zero_grad(set_to_none=True)
    x.grad = None

    seen = _last_mlp_rows(backbone)
    part = _run(backbone, tokens, rows=CLS, **kw)
    assert part.shape == (B, 1, D) and seen == [1]  # the last block computed the class token only
    torch.testing.assert_close(part, full[:, CLS], rtol=1e-5, atol=1e-6)
    (part**2).sum().backward()
    torch.testing.assert_close(x.grad, grad_x, rtol=1e-5, atol=1e-6)
    for name, p in backbone.named_parameters():
        if name in grads:
            torch.testing.assert_close(p.grad, grads[name], rtol=1e-5, atol=1e-6, msg=name)
        else:  # a parameter the class token's loss never reaches gets no gradient either way
            assert p.grad is None or not p.grad.any(), name


def test_a_middle_slice_of_rows_and_positions_that_do_not_start_at_zero():
    backbone = _backbone("bidirectional_llama", "sdpa").eval()
    torch.manual_seed(1)
    x = torch.randn(B, N, D)
    tokens = Tokens.from_embeddings(x, 0, positions=(40 + torch.arange(N)).view(1, N, 1).expand(B, N, 1))
    with torch.no_grad():
        full = backbone(tokens)
        torch.testing.assert_close(backbone(tokens, rows=slice(2, 5)), full[:, 2:5], rtol=1e-5, atol=1e-6)


FALLBACKS = {  # settings whose last block must compute every row: the result is still full[:, rows]
    "causal": dict(causal=True),
    "window": dict(long_context=LongContextConfig(window=3)),
    "alibi": dict(positions=PositionConfig("alibi")),
    "t5": dict(positions=PositionConfig("t5")),
    "reversible": dict(block=BlockConfig(reversible=True)),
    "adaln": dict(block=BlockConfig("adaln", d_cond=8)),
    "conformer": dict(block=BlockConfig("conformer")),
}


@pytest.mark.parametrize("case", list(FALLBACKS))
def test_rows_where_the_last_block_needs_every_row_select_them_after_it(case):
    backbone = _backbone(case, "eager", **FALLBACKS[case]).eval()
    kw = {"cond": torch.randn(B, 8)} if case == "adaln" else {}
    tokens, _ = _tokens(grad=False)
    with torch.no_grad():
        full = backbone(tokens, **kw)
        seen = _last_mlp_rows(backbone)
        part = backbone(tokens, rows=CLS, **kw)
    assert seen == [N]  # no shortcut
    torch.testing.assert_close(part, full[:, CLS])


def test_rows_with_a_kv_cache_fall_back_and_still_extend_the_cache():
    backbone = _backbone("vit", "eager", causal=True).eval()
    tokens, _ = _tokens(padded=False, grad=False)
    with torch.no_grad():
        full = backbone(tokens)
        cache = KVCache()
        part = backbone(tokens, cache=cache, rows=slice(N - 1, N))
    torch.testing.assert_close(part, full[:, -1:])
    assert cache.length == N


def test_performer_kernel_falls_back():
    backbone = _backbone("vit", "performer").eval()
    tokens, _ = _tokens(grad=False)
    with torch.no_grad():
        torch.manual_seed(0)
        full = backbone(tokens)
        seen = _last_mlp_rows(backbone)
        torch.manual_seed(0)
        part = backbone(tokens, rows=CLS)
    assert seen == [N]
    torch.testing.assert_close(part, full[:, CLS])


def test_attention_rows_refuses_what_depends_on_the_row():
    attn = Attention(D, 4, kernel="eager")
    x = torch.randn(B, N, D)
    torch.testing.assert_close(attn(x, rows=slice(1, 3)), attn(x)[:, 1:3])
    with pytest.raises(ValueError, match="same for every query row"):
        attn(x, MaskSpec(causal=True), rows=CLS)
    with pytest.raises(ValueError, match="same for every query row"):
        attn(x, MaskSpec(window=2), rows=CLS)
    with pytest.raises(ValueError, match="without a KV cache"):
        attn(x, MaskSpec(), cache=KVCache(), rows=CLS)
    with pytest.raises(ValueError, match="without a KV cache"):
        Attention(D, 4, kernel="eager", cross=True)(x, context=x, rows=CLS)
    with pytest.raises(ValueError, match="sdpa or eager"):
        Attention(D, 4, kernel="performer")(x, rows=CLS)


def test_heads_name_the_rows_they_read():
    assert ClassifierHead(D, 5, pool="cls", num_prefix_tokens=1).reads == CLS
    assert ClassifierHead(D, 5, pool="mean").reads is None
    assert ProjectionHead(D, 8, pool="cls", num_prefix_tokens=1).reads == CLS
    assert ProjectionHead(D, 8, pool="mean").reads is None


def test_a_vit_classifier_gives_the_full_forwards_logits_and_gradients():
    """``MultimodalModel.forward`` hands a class-token head only its row: the logits and every gradient
    equal the head applied to the full hidden states."""
    torch.manual_seed(0)
    backbone = build_backbone(D, 2, AttentionConfig(4, kernel="sdpa"))
    tokenizer = ViTPatchTokenizer(D, image_size=16, patch_size=4)
    head = ClassifierHead(D, 5, pool="cls", num_prefix_tokens=1)
    torch.nn.init.normal_(head.head.weight)  # not the zero init: every gradient flows
    model = MultimodalModel({"image": tokenizer}, backbone, {"cls": head})
    images = torch.randn(4, 3, 16, 16)
    seen = _last_mlp_rows(backbone)
    logits = model(images, "image", "cls")
    assert seen == [1]
    logits.logsumexp(-1).sum().backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    hidden, tokens = model.encode("image", images)
    expected = head(hidden, tokens)
    torch.testing.assert_close(logits, expected, rtol=1e-5, atol=1e-6)
    expected.logsumexp(-1).sum().backward()
    for name, p in model.named_parameters():  # float32 sums in another order: errors scale with the gradient
        atol = 1e-6 * max(1.0, p.grad.abs().max().item())  # cls_token / pos_embed: |grad| up to ~350
        torch.testing.assert_close(grads[name], p.grad, rtol=1e-5, atol=atol, msg=name)


def test_checkpointed_blocks_take_the_shortcut_with_the_same_gradients():
    """Activation checkpointing (``trainer.activation_checkpointing``) wraps the blocks: the wrapper passes
    ``rows`` on and the gradients are unchanged."""
    from mmformer.models import parallelize

    def model():
        torch.manual_seed(0)
        head = ClassifierHead(D, 5, pool="cls")
        torch.nn.init.normal_(head.head.weight)
        tokenizer = ViTPatchTokenizer(D, image_size=16, patch_size=4)
        return MultimodalModel({"image": tokenizer}, build_backbone(D, 2, AttentionConfig(4)), {"cls": head})

    plain, wrapped = model(), model()
    assert parallelize.checkpoint_blocks(wrapped) == 2
    images = torch.randn(4, 3, 16, 16)
    for m in (plain, wrapped):
        m(images, "image", "cls").square().sum().backward()
        assert m.backbone.rows_computed == CLS
    for a, b in zip(plain.parameters(), wrapped.parameters()):
        torch.testing.assert_close(a.grad, b.grad)


@pytest.mark.parametrize("route", ["plain", "onednn", "hooked", "lora"])
def test_only_the_rows_queries_are_projected_where_the_qkv_product_is_a_plain_linear(route):
    """A plain ``qkv`` linear (on PyTorch's or oneDNN's products) is computed in two — the queries of the
    rows, the keys and values of every row — which ``FlopCounterMode`` sees; a hooked or LoRA-wrapped one
    runs whole (its hooks and adapter see every row). The rows' outputs and the gradients equal the full
    forward's either way, and ``analytic_flops`` counts what runs."""
    from torch.utils.flop_counter import FlopCounterMode

    from mmformer.nn.lora import apply_lora
    from mmformer.nn.onednn import use_onednn

    torch.manual_seed(0)
    attn = Attention(64, 4, n_kv_heads=2, kernel="eager")  # qkv: 64 → 128 (64 queries, 32 + 32 keys, values)
    if route == "onednn":
        assert use_onednn(attn, min_weights=0) == 2
    elif route == "hooked":
        seen = []
        attn.qkv.register_forward_hook(lambda m, args, out: seen.append(out.shape))
    elif route == "lora":
        apply_lora(attn, targets=("qkv",), rank=2)
        torch.nn.init.normal_(attn.qkv.lora_B.weight)
    assert attn.splits_qkv() == (route in ("plain", "onednn"))
    x = torch.randn(2, 9, 64, requires_grad=True)
    rows = slice(0, 2)
    with FlopCounterMode(display=False) as counter:
        part = attn(x, rows=rows)
    products = 2 * 2 * 64 * ((2 * 64 + 9 * 64) if attn.splits_qkv() else 9 * 128)  # qkv
    products += 2 * 2 * 2 * 64 * 64  # proj, the rows only
    attention = 4 * 2 * 4 * 2 * 9 * 16  # 2 query rows × 9 keys per head
    lora = 2 * 2 * 9 * 2 * (64 + 128) if route == "lora" else 0
    assert counter.get_total_flops() == products + attention + lora
    if route == "hooked":
        assert seen == [(2, 9, 128)]
    full = attn(x)[:, rows]
    torch.testing.assert_close(part, full, rtol=1e-5, atol=1e-6)
    wrt = [x, *(p for p in attn.parameters() if p.requires_grad)]  # LoRA freezes the base weights
    grads, want = (torch.autograd.grad(y.square().sum(), wrt) for y in (part, full))
    for a, b in zip(grads, want):  # float32 sums in another order: errors scale with the gradient
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6 * max(1.0, b.abs().max().item()))


def test_a_backward_hook_on_qkv_keeps_it_whole():
    attn = Attention(64, 4, kernel="eager")
    seen = []
    attn.qkv.register_full_backward_hook(lambda m, grad_in, grad_out: seen.append(grad_out[0].shape))
    assert not attn.splits_qkv()
    attn(torch.randn(2, 9, 64, requires_grad=True), rows=CLS).sum().backward()
    assert seen == [(2, 9, 192)]
