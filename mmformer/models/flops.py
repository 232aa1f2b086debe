"""FLOPs: counted analytically as the model runs (``FlopMeter``, for throughput and MFU), and measured by
``torch.utils.flop_counter`` (``count_flops``, the cross-check).

``FlopCounterMode`` does not count ``scaled_dot_product_attention`` on CPU (nor FlexAttention), so
``count_flops`` switches the softmax kernels (``auto``, ``sdpa``, ``flex``) to the eager kernel (plain
matmuls, the same attention) for the measurement and restores them afterwards; the Performer and the
registered kernels (``nn.kernels``: LSH, AFT, RFA) run as themselves, so their own products are counted.
"""

from __future__ import annotations

import functools

import torch
from torch import Tensor, nn
from torch.utils.flop_counter import FlopCounterMode

from ..nn.attention import Attention
from ..nn.block_sparse import gather_plan, layout_pairs, window_band
from ..nn.kernels import SOFTMAX_KERNELS
from ..nn.masks import MaskSpec
from ..nn.reversible import stored_activations
from .backbone import Backbone
from .model import MultimodalModel


def _linear_flops(m: nn.Linear, rows: int) -> int:
    return 2 * rows * m.in_features * m.out_features


class FlopMeter:
    """Forward FLOPs of a model, added up from the shapes of what it runs (1 FLOP = 1 multiply or add;
    matmuls and convolutions only, as ``FlopCounterMode`` counts; elementwise ops, norms, softmax and
    FFTs are not counted). Hooks only, outside the blocks, so it works with compiled blocks:

    - each ``Backbone`` call of ``B`` sequences of ``N`` tokens: every block's linear layers and 1-D
      convolutions per token (the adaLN modulation per sequence; cross-attention keys/values per
      context token) plus attention as its kernel computes it (``Attention.attention_flops``, causal
      as the backbone is, cross-attention never): for the softmax kernels ``4 · B · H · N · N_k ·
      head_dim`` (scores and the weighted sum, full ``N × N_k`` as the kernels compute it, causal or not;
      ``N_k = N`` plus cached tokens) — with BigBird the query-key pairs its layouts read instead of
      ``N × N_k``, each layer's, averaged over heads (``block_sparse.layout_pairs``; the gathering sdpa
      also scores the masked filler of rows that read fewer blocks than others, uncounted), with a
      sliding window alone the pairs of the band of blocks sdpa gathers for it (``window_band``, where it
      gathers; flex reads a similar band of its own 128-token blocks); both count every pair with a
      score bias (ALiBi, a relative bias: sdpa then takes a dense mask), a window with prefix-LM spans
      too — for the
      Performer, LSH, AFT and RFA the products they run
      (``AttentionKernel.flops``); a last block that computed only the rows a head reads
      (``Backbone.rows_computed``) is counted for those rows past its keys and values;
    - every other ``nn.Linear`` and convolution (tokenizers, heads, towers' outside) from its input shape.

    A training step costs ``3 ×`` the forward (backward = 2 × forward for matmuls; Kaplan et al. 2020,
    §2.1). ``take()`` returns the FLOPs counted since the last call. ``close()`` removes the hooks.
    """

    def __init__(self, model: nn.Module):
        self.flops = 0
        self._hooks = []
        self._pending: dict[int, tuple[int, int, int, int]] = {}  # backbone id → (B, N, N_k, N_ctx)
        inside = set()
        for bb in (m for m in model.modules() if isinstance(m, Backbone)):
            self._hooks.append(bb.register_forward_pre_hook(self._backbone_starts, with_kwargs=True))
            self._hooks.append(bb.register_forward_hook(self._backbone_ends))
            for block in bb.blocks:
                inside.update(id(m) for m in block.modules())
        for m in model.modules():
            if id(m) not in inside and isinstance(m, (nn.Linear, nn.Conv1d, nn.Conv2d)):
                self._hooks.append(m.register_forward_hook(self._leaf))

    def take(self) -> int:
        flops, self.flops = self.flops, 0
        return flops

    def close(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks = []

    def _leaf(self, module, inputs, output) -> None:
        if isinstance(module, nn.Linear):
            self.flops += _linear_flops(module, inputs[0].numel() // module.in_features)
        else:  # convolution: 2 · outputs · (in_channels / groups) · kernel size
            k = module.in_channels // module.groups
            for size in module.kernel_size:
                k *= size
            self.flops += 2 * output.numel() * k

    def _backbone_starts(self, backbone: Backbone, args, kwargs) -> None:
        tokens = args[0] if args else kwargs["tokens"]
        B, N = tokens.x.shape[:2]
        cache, context = kwargs.get("cache"), kwargs.get("context")
        n_k = N + (cache.length if cache is not None and hasattr(cache, "length") else 0)
        n_ctx = context.x.shape[1] if context is not None else 0
        span = kwargs.get("span")  # prefix-LM spans: a causal window's band no longer covers them
        self._pending[id(backbone)] = (B, N, n_k, n_ctx, span)  # the cache grows during the forward

    def _backbone_ends(self, backbone: Backbone, args, output) -> None:
        B, N, n_k, n_ctx, span = self._pending.pop(id(backbone))
        rows = backbone.rows_computed  # the rows the last block computed alone (a class token), if any
        last = len(backbone.blocks) - 1
        bigbird, window = backbone.long_context.bigbird, backbone.long_context.window
        biased = backbone.positions.kind == "alibi" or backbone.rel_bias is not None  # sdpa: every pair
        pairs = (None,) * len(backbone.blocks)  # per layer: the query-key pairs per head sdpa reads
        if bigbird is not None and not biased:  # each layer's attention reads its own layout's blocks
            pairs = _bigbird_pairs(bigbird, backbone.causal, backbone.n_heads, len(backbone.blocks), N, n_k)
        elif (
            window is not None and not biased
        ):  # sdpa gathers the band of blocks covering it, where that pays
            plan = gather_plan(MaskSpec(causal=backbone.causal, window=window, span=span), N, n_k)
            if plan is not None and plan.worth:
                pairs = (_band_pairs(window, backbone.causal, N, n_k),) * len(backbone.blocks)
        for i, block in enumerate(backbone.blocks):
            n_rows = len(range(N)[rows]) if rows is not None and i == last else N
            self.flops += _block_flops(block, B, N, n_rows, n_k, n_ctx, backbone.causal, pairs[i])


@functools.lru_cache(maxsize=64)
def _bigbird_pairs(
    bigbird, causal: bool, n_heads: int, n_layers: int, n_q: int, n_k: int
) -> tuple[float, ...]:
    layouts = bigbird.layer_layouts(n_k, causal, n_heads, n_layers)
    return tuple(layout_pairs(layout, bigbird.block, n_q, n_k) for layout in layouts)


@functools.lru_cache(maxsize=64)
def _band_pairs(window: int, causal: bool, n_q: int, n_k: int) -> float:
    band, block = window_band(window, n_k, causal)
    return layout_pairs(band, block, n_q, n_k)


def _block_flops(
    block: nn.Module,
    B: int,
    N: int,
    n_rows: int,
    n_k: int,
    n_ctx: int,
    causal: bool = False,
    pairs: float | None = None,
) -> int:
    """One block over ``N`` tokens of which ``n_rows`` are computed past the self-attention's keys and
    values (``Backbone.forward(rows=…)``; else ``N``), against ``n_k`` keys and ``n_ctx`` context tokens;
    ``causal``: the self-attention's mask (cross-attention's never is); ``pairs``: the query-key pairs
    per head a BigBird layout lets the self-attention read (``Attention.attention_flops``)."""
    flops = 0
    for name, m in block.named_modules():
        parts = name.split(".")  # a LoRA-wrapped product: attn.qkv.base, attn.qkv.lora_A, …
        if isinstance(m, nn.Conv1d):  # a conformer's convolutions run along the N tokens
            flops += 2 * B * N * m.out_channels * (m.in_channels // m.groups * m.kernel_size[0])
        elif isinstance(m, Attention):
            cross = "cross" in name
            if cross:
                flops += m.attention_flops(B, n_rows, n_ctx, False)
            else:
                flops += m.attention_flops(B, n_rows, n_k, causal, pairs)
        elif not isinstance(m, nn.Linear):
            continue
        elif "adaLN" in name:
            flops += _linear_flops(m, B)
        elif "kv" in parts and "cross" in name:
            flops += _linear_flops(m, B * n_ctx)
        elif "qkv" in parts:  # keys and values of every token, queries of the rows computed
            attn = block.get_submodule(".".join(parts[: parts.index("qkv")]))
            if n_rows < N and attn.splits_qkv():  # Attention.forward(rows=…): the queries of n_rows only
                q_out, kv_out = attn.n_heads * attn.head_dim, 2 * attn.n_kv_heads * attn.head_dim
                flops += 2 * B * m.in_features * (n_rows * q_out + N * kv_out)
            else:  # queries too: one fused product
                flops += _linear_flops(m, B * N)
        else:
            flops += _linear_flops(m, B * n_rows)
    return flops


def analytic_flops(
    model: MultimodalModel, inputs: Tensor, tokenizer: str, head: str, **tokenizer_kwargs
) -> int:
    """Forward FLOPs of ``model(inputs, tokenizer, head, **tokenizer_kwargs)`` (e.g. ``valid=``) by
    ``FlopMeter`` (the number ``count_flops`` measures)."""
    meter = FlopMeter(model)
    try:
        with torch.no_grad():
            model(inputs, tokenizer, head, **tokenizer_kwargs)
    finally:
        meter.close()
    return meter.take()


def count_flops(
    model: MultimodalModel, inputs: Tensor, tokenizer: str, head: str, **tokenizer_kwargs
) -> dict[str, int]:
    """FLOPs for one forward and one forward+backward of ``model(inputs, tokenizer, head,
    **tokenizer_kwargs)`` (e.g. ``valid=``), measured by ``FlopCounterMode`` (1 FLOP = 1 multiply or add;
    a multiply-accumulate counts 2; matmuls and convolutions). Divide by ``inputs.shape[0]`` for
    per-sample values. The softmax kernels ``auto``, ``sdpa`` and ``flex`` run as ``eager`` meanwhile
    (the counter does not see sdpa on CPU): every other kernel (``eager``, ``performer``, the registered
    ones) runs as itself.

    Returns ``{"forward": int, "train": int}``; ``train`` counts forward + backward of a scalar loss.
    """
    attns = [m for m in model.modules() if isinstance(m, Attention)]
    kernels = [a.kernel for a in attns]
    for a in attns:
        if a.kernel == "auto" or a.kernel in SOFTMAX_KERNELS:
            a.kernel = "eager"
    try:
        with FlopCounterMode(display=False) as fwd:
            with torch.no_grad():
                model(inputs, tokenizer, head, **tokenizer_kwargs)
        # reversible layers counted as the function they compute (their recomputation is not counted,
        # as MFU's definition asks); FlopCounterMode cannot follow their own backward
        with FlopCounterMode(display=False) as train, stored_activations():
            model(inputs, tokenizer, head, **tokenizer_kwargs).float().sum().backward()
        model.zero_grad(set_to_none=True)
    finally:
        for a, k in zip(attns, kernels):
            a.kernel = k
    return {"forward": fwd.get_total_flops(), "train": train.get_total_flops()}
