"""The shared backbone's settings as a few small nested configs, one per part, for ``build_backbone``:

  ``AttentionConfig``    heads, biases, QK-norm, dropout, and the kernel with its own options
                         (``sdpa_backend``, the performer's random features)
  ``MlpConfig``          the feed-forward's width, activation, biases, dropout
  ``PositionConfig``     the relative position scheme applied inside attention (RoPE, ALiBi, T5 /
                         Toeplitz learned biases) and its parameters
  ``LongContextConfig``  sparse attention patterns: a sliding window, BigBird blocks (``BigBirdConfig``)
  ``BlockConfig``        the block family and the settings only some families read

Plain frozen dataclasses (no OmegaConf, no Lightning: the model library stands alone, DESIGN.md). Each
checks its own values in ``__post_init__`` and raises ``ValueError`` for an unknown choice or an
impossible value. A recipe's flat ``model.backbone`` section is mapped onto them by
``mmformer.components.backbones`` (the recipe schema and checkpoints do not change); the leaf modules
(``Attention``, ``Mlp``, the blocks) keep plain keyword arguments, which ``build_backbone`` fills.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field

import torch
from torch import Tensor

from ..nn.attention import KERNELS, SDPA_BACKENDS
from ..nn.kernels import check_options
from ..nn.masks import bigbird_layout
from ..nn.mlp import ACTIVATIONS

BLOCKS = ("pre", "post", "cross", "adaln", "conformer")
POSITIONS = ("none", "rope", "alibi", "t5", "toeplitz")


def _choice(name: str, value: str, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        raise ValueError(f"unknown {name} {value!r}; choose from {allowed}")


def _positive(owner: object, *names: str) -> None:
    for name in names:
        value = getattr(owner, name)
        if value is not None and value <= 0:
            raise ValueError(f"{type(owner).__name__}.{name} must be positive, got {value}")


def _probability(owner: object, *names: str) -> None:
    for name in names:
        value = getattr(owner, name)
        if not 0.0 <= value < 1.0:
            raise ValueError(f"{type(owner).__name__}.{name} must be in [0, 1), got {value}")


@dataclass(frozen=True)
class AttentionConfig:
    """Every layer's self-attention (and a ``cross`` block's cross-attention).

    Attributes:
        n_heads: query heads ``H`` (``d_model`` must be divisible by it).
        n_kv_heads: key/value heads (``None`` → ``n_heads``; 1 = multi-query; must divide ``n_heads``).
        qkv_bias: bias on the input projections; proj_bias: bias on the output projection (Llama: none).
        qk_norm: RMSNorm over each head's queries and keys (Dehghani et al. 2023, arXiv:2302.05442).
        attn_drop: dropout on the attention weights; proj_drop: after the output projection (training only).
        kernel: ``auto``, ``eager``, ``sdpa``, ``flex`` or ``performer`` (``mmformer.nn.attention``).
        sdpa_backend: the SDPA backend forced on CUDA (``auto``, ``flash``, ``efficient``, ``cudnn``, ``math``).
        performer_features: random features per head of the ``performer`` kernel (FAVOR+, Choromanski et
            al. 2021, arXiv:2009.14794 §2.4); more features, a closer approximation of softmax attention.
        kernel_options: the options of a registered kernel (``mmformer.nn.kernels``: ``lsh``, ``aft_*``,
            ``rfa`` …), e.g. ``{"n_buckets": 16, "n_hashes": 2}``.
    """

    n_heads: int
    n_kv_heads: int | None = None
    qkv_bias: bool = True
    proj_bias: bool = True
    qk_norm: bool = False
    attn_drop: float = 0.0
    proj_drop: float = 0.0
    kernel: str = "auto"
    sdpa_backend: str = "auto"
    performer_features: int = 256
    kernel_options: dict = field(default_factory=dict, hash=False)

    def __post_init__(self) -> None:
        _positive(self, "n_heads", "n_kv_heads", "performer_features")
        _choice("attention kernel", self.kernel, KERNELS)
        check_options(self.kernel, self.kernel_options)
        _probability(self, "attn_drop", "proj_drop")
        if self.n_kv_heads is not None and self.n_heads % self.n_kv_heads:
            raise ValueError(f"n_heads={self.n_heads} is not divisible by n_kv_heads={self.n_kv_heads}")
        _choice("attention kernel", self.kernel, KERNELS)
        _choice("sdpa_backend", self.sdpa_backend, SDPA_BACKENDS)


@dataclass(frozen=True)
class MlpConfig:
    """The feed-forward of every block (a ``conformer`` block's two half-step ones too).

    Attributes:
        ratio: inner width as a multiple of ``d_model``; hidden: the inner width itself (overrides
            ``ratio``: Llama-style sizes such as 1,536 for 576).
        act: ``gelu`` (exact erf), ``gelu_tanh`` (GPT-2), ``relu`` or ``swiglu`` (a gated MLP, Shazeer 2020).
        bias: biases on both projections.
        drop: dropout after the activation and after the output projection (a ``conformer`` block also
            uses it after its attention and convolution modules).
    """

    ratio: float = 4.0
    hidden: int | None = None
    act: str = "gelu"
    bias: bool = True
    drop: float = 0.0

    def __post_init__(self) -> None:
        _positive(self, "ratio", "hidden")
        _probability(self, "drop")
        _choice("MLP activation", self.act, ACTIVATIONS)

    def hidden_dim(self, d_model: int) -> int:
        """The inner width for a model of width ``d_model``."""
        return self.hidden or int(d_model * self.ratio)


@dataclass(frozen=True)
class PositionConfig:
    """The relative position scheme applied inside attention (tokenizers add absolute embeddings).

    Attributes:
        kind: ``none``; ``rope`` (Su et al. 2021, arXiv:2104.09864); ``alibi`` (Press et al. 2022,
            arXiv:2108.12409); or a learned per-head bias shared by every layer: ``t5`` (log-spaced
            buckets, Raffel et al. 2020 §2.1) or ``toeplitz`` (one value per clipped offset).
        rope_base: RoPE θ; rope_axes: position axes RoPE rotates by (1 for sequences, 2 for the
            (row, column) of patch grids: Qwen2-VL's multimodal RoPE, arXiv:2409.12191).
        rel_buckets: ``t5`` buckets; rel_max_distance: ``t5`` / ``toeplitz``, offsets (in tokens) beyond
            which all share the last bucket.
    """

    kind: str = "none"
    rope_base: float = 10_000.0
    rope_axes: int = 1
    rel_buckets: int = 32
    rel_max_distance: int = 128

    def __post_init__(self) -> None:
        _choice("positions", self.kind, POSITIONS)
        _positive(self, "rope_base", "rope_axes", "rel_buckets", "rel_max_distance")


@dataclass(frozen=True)
class BigBirdConfig:
    """BigBird block-sparse attention (Zaheer et al. 2020, §2 and App. D, "ITC"): blocks of ``block``
    tokens read a band of ``window`` blocks on each side, the ``global_blocks`` leading blocks (which
    read and are read by every block) and ``random_blocks`` other blocks, drawn with a fixed seed for
    each head and layer (``layer_layouts``: the layer's index is its seed, as in BigBird's encoder)."""

    block: int
    window: int = 1
    global_blocks: int = 1
    random_blocks: int = 1

    def __post_init__(self) -> None:
        _positive(self, "block")
        for name in ("window", "global_blocks", "random_blocks"):
            if getattr(self, name) < 0:
                raise ValueError(f"BigBirdConfig.{name} must be >= 0, got {getattr(self, name)}")

    def layout(
        self, n_tokens: int, causal: bool = False, n_heads: int | None = None, seed: int = 0
    ) -> Tensor:
        """The ``(n_blocks, n_blocks)`` bool block layout (True = query block may read key block) over
        ``n_tokens`` tokens, the last block possibly partial (``mmformer.nn.masks.bigbird_layout``;
        ``causal``: random blocks among earlier ones only, the same rows at every length); ``n_heads``:
        ``(n_heads, n_blocks, n_blocks)``, random blocks drawn for each head, as BigBird draws them;
        ``seed``: the draws' seed (a backbone gives each layer its index, as BigBird's encoder does)."""
        n_blocks = math.ceil(n_tokens / self.block)
        return bigbird_layout(
            n_blocks, self.window, self.global_blocks, self.random_blocks, seed, causal, n_heads
        )

    def layer_layouts(
        self, n_tokens: int, causal: bool, n_heads: int, n_layers: int, device: torch.device | None = None
    ) -> Tensor:
        """``(n_layers, n_heads, n_blocks, n_blocks)``: each layer's layout (``layout(…, seed=layer)``) on
        ``device`` (default CPU). Cached per shape and device (a forward reads it every step): read-only.
        A causal layout's rows never depend on later blocks, so one drawn for the next power of two of
        blocks serves every shorter length (decoding grows the sequence a block at a time)."""
        n_blocks = math.ceil(n_tokens / self.block)
        drawn = 1 << (n_blocks - 1).bit_length() if causal else n_blocks
        layouts = _layer_layouts(self, drawn, causal, n_heads, n_layers, torch.device(device or "cpu"))
        return layouts[..., :n_blocks, :n_blocks]


@dataclass(frozen=True)
class LongContextConfig:
    """Sparse attention patterns that keep long sequences affordable; both may be combined (AND).

    Attributes:
        window: sliding-window attention, in tokens: a query reads keys less than ``window`` tokens
            away (earlier ones only, when causal); None for none.
        bigbird: BigBird block sparsity, or None for none.
    """

    window: int | None = None
    bigbird: BigBirdConfig | None = None

    def __post_init__(self) -> None:
        _positive(self, "window")


@dataclass(frozen=True)
class BlockConfig:
    """The block family (``mmformer.nn.blocks``) and the settings only some families read.

    Attributes:
        kind: ``pre`` (pre-norm: GPT-2, ViT, Llama), ``post`` (post-norm: BERT), ``cross`` (a decoder
            block with cross-attention: forward with ``context=``), ``adaln`` (DiT's adaLN-Zero: forward
            with ``cond=``) or ``conformer`` (Gulati et al. 2020).
        drop_path: stochastic depth of the last block, rising linearly from 0 over depth (DeiT).
        layer_scale: initial per-channel residual scale (CaiT, e.g. 1e-5), or None for none.
        d_cond: ``adaln``: conditioning width (default ``d_model``).
        d_context: ``cross``: width of the context it attends to (default ``d_model``).
        conv_kernel: ``conformer``: depthwise convolution width, in tokens (odd).
        reversible: ``pre`` only: Reformer's reversible layers (``mmformer.nn.reversible``), activation
            memory flat in depth for about a third more compute per training step.
        ff_chunks: ``reversible``: the feed-forward runs over this many pieces of the sequence.

    Raises ``ValueError`` for ``reversible`` with another kind (post-norm, cross-attention, adaLN and
    conformer blocks do not split into Reformer's two sub-layers), or ``ff_chunks > 1`` without it.
    """

    kind: str = "pre"
    drop_path: float = 0.0
    layer_scale: float | None = None
    d_cond: int | None = None
    d_context: int | None = None
    conv_kernel: int = 31
    reversible: bool = False
    ff_chunks: int = 1

    def __post_init__(self) -> None:
        _choice("block", self.kind, BLOCKS)
        _positive(self, "d_cond", "d_context", "conv_kernel", "ff_chunks")
        _probability(self, "drop_path")
        if self.reversible and self.kind != "pre":
            raise ValueError(
                f"reversible layers need pre-norm blocks (kind 'pre'): a {self.kind!r} block does not split "
                "into Reformer's two sub-layers Y1 = X1 + Attention(X2), Y2 = X2 + FeedForward(Y1)"
            )
        if self.ff_chunks > 1 and not self.reversible:
            raise ValueError("ff_chunks chunks the feed-forward of reversible layers: set reversible=True")


@functools.lru_cache(maxsize=16)
def _layer_layouts(
    cfg: BigBirdConfig, n_blocks: int, causal: bool, n_heads: int, n_layers: int, device: torch.device
) -> Tensor:
    layouts = [cfg.layout(n_blocks * cfg.block, causal, n_heads, seed=i) for i in range(n_layers)]
    return torch.stack(layouts).to(device)
