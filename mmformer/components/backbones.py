"""Backbone kinds: ``transformer`` (the shared backbone built from its sizes, ``mmformer.models.Backbone``)
and ``pretrained`` (the backbone of real pretrained weights, ``mmformer.models.pretrained``)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

from omegaconf import MISSING

from ..errors import RecipeError, did_you_mean, positive, probability
from ..models import Backbone, build_backbone
from ..models.backbone_config import (
    BLOCKS,
    POSITIONS,
    AttentionConfig,
    BigBirdConfig,
    BlockConfig,
    LongContextConfig,
    MlpConfig,
    PositionConfig,
)
from ..models.presets import preset
from ..nn.attention import KERNELS, SDPA_BACKENDS
from ..nn.kernels import (
    attends_across,
    check_options,
    kernel_needs,
    kernel_rules,
    position_biases,
    supporting,
    takes_score_bias,
)
from ..nn.mlp import ACTIVATIONS
from ..nn.norms import NORMS
from ..nn.tokens import MODALITY_IDS
from ..registry import register
from .context import BuildContext

_WINDOW = " A sliding window is a mask for any kernel that implements it: set window (in tokens)."
_BIGBIRD = " BigBird is a mask for the softmax kernels: set bigbird_block (and bigbird_window, …)."

# the papers' names for what mmformer spells otherwise (attn_kernel typos that are no typo)
PAPER_NAMES = {
    "reformer": " Did you mean 'lsh' (the Reformer's LSH attention; reversible: true for its blocks)?",
    "aft": " Did you mean 'aft_full', 'aft_local' or 'aft_simple' (the Attention-Free Transformer)?",
    "bigbird": _BIGBIRD,
    "longformer": _WINDOW,
    "local": _WINDOW,
    "window": _WINDOW,
    "sliding_window": _WINDOW,
    "block_sparse": _BIGBIRD,
    "flash": " FlashAttention runs inside 'sdpa' on CUDA (sdpa_backend: flash forces it).",
}


@dataclass
class BackboneConfig:
    """``model.backbone``: the shared transformer (``mmformer.models.Backbone``)."""

    kind: str = "transformer"
    preset: Optional[str] = None  # debug | tiny | small | base | large: fills unset sizes
    d_model: Optional[int] = None
    n_layers: Optional[int] = None
    n_heads: Optional[int] = None
    n_kv_heads: Optional[int] = None  # grouped-query attention (1 = multi-query)
    mlp_ratio: float = 4.0
    mlp_hidden: Optional[int] = None  # overrides mlp_ratio · d_model
    block: str = "pre"  # pre | post (BERT) | cross (decoder with cross-attention) | adaln (DiT) | conformer
    conv_kernel: int = 31  # conformer: depthwise convolution width, in tokens (odd)
    reversible: bool = False  # pre: Reformer's reversible layers, activation memory flat in depth
    ff_chunks: int = 1  # reversible: the feed-forward runs over this many pieces of the sequence
    d_context: Optional[int] = None  # cross: width of the encoder output it attends to (default d_model)
    norm: str = "layernorm"  # layernorm | rmsnorm
    norm_eps: float = 1e-6
    act: str = "gelu"  # gelu | gelu_tanh | relu | swiglu
    qkv_bias: bool = True
    proj_bias: bool = True  # attention output bias (Llama: false)
    mlp_bias: bool = True
    qk_norm: bool = False
    drop: float = 0.0
    attn_drop: float = 0.0
    drop_path: float = 0.0  # stochastic depth at the last block (linear over depth)
    layer_scale: Optional[float] = None  # initial LayerScale value, e.g. 1e-5
    causal: bool = False
    # modalities whose tokens attend to each other both ways in a causal backbone (Transfusion): a
    # causal LM and image / audio tasks sharing one backbone, e.g. [image, audio]
    bidirectional: list[str] = field(default_factory=list)
    positions: str = "none"  # none (tokenizers add absolute ones) | rope | alibi | t5 | toeplitz
    rel_buckets: int = 32  # t5: relative-position buckets
    rel_max_distance: int = 128  # t5 / toeplitz: offsets beyond this share the last bucket
    rope_base: float = 10_000.0
    rope_axes: int = 1  # 2 = multimodal RoPE over (row, column) of patch grids (Qwen2-VL sections)
    window: Optional[int] = None  # sliding-window attention, in tokens
    # BigBird block-sparse attention: blocks of bigbird_block tokens read a band of bigbird_window
    # blocks each side, bigbird_global leading blocks (which read everything) and bigbird_random others
    bigbird_block: Optional[int] = None
    bigbird_window: int = 1
    bigbird_global: int = 1
    bigbird_random: int = 1
    d_cond: Optional[int] = None  # adaln: conditioning width (default d_model)
    final_norm: bool = True
    attn_kernel: str = "auto"  # auto | sdpa | flex | eager | performer (random-feature linear attention)
    performer_features: int = 256  # performer: random features per head
    # options of a registered kernel (mmformer/nn/kernels: lsh, aft_full, aft_local, aft_simple, rfa …)
    kernel_options: dict[str, Any] = field(default_factory=dict)
    sdpa_backend: str = "auto"  # auto | flash | efficient | cudnn | math (CUDA only)

    def __post_init__(self) -> None:
        if self.preset is not None:
            for k, v in preset(self.preset).items():
                if getattr(self, k) is None:
                    setattr(self, k, v)
        for k in ("d_model", "n_layers", "n_heads"):
            if getattr(self, k) is None:
                raise ValueError(f"{k} is required (or set preset: debug|tiny|small|base|large)")
        positive(self, "d_model", "n_layers", "n_heads", "n_kv_heads", "mlp_ratio")
        probability(self, "drop", "attn_drop", "drop_path")
        if self.d_model % self.n_heads:
            raise ValueError(f"d_model={self.d_model} is not divisible by n_heads={self.n_heads}")
        if self.n_kv_heads is not None and self.n_heads % self.n_kv_heads:
            raise ValueError(f"n_heads={self.n_heads} is not divisible by n_kv_heads={self.n_kv_heads}")
        if self.attn_kernel not in KERNELS:
            hint = PAPER_NAMES.get(self.attn_kernel.lower()) or did_you_mean(
                self.attn_kernel, KERNELS, quote="'"
            )
            raise ValueError(f"attn_kernel={self.attn_kernel!r}.{hint} Choose from {', '.join(KERNELS)}")
        check_options(self.attn_kernel, dict(self.kernel_options), self.n_heads, self.d_model // self.n_heads)
        for name, allowed in (
            ("block", BLOCKS),
            ("norm", NORMS),
            ("act", ACTIVATIONS),
            ("positions", POSITIONS),
            ("sdpa_backend", SDPA_BACKENDS),
        ):
            if getattr(self, name) not in allowed:
                hint = did_you_mean(getattr(self, name), allowed, quote="'")
                raise ValueError(f"{name}={getattr(self, name)!r}.{hint} Choose from {', '.join(allowed)}")
        if self.positions == "rope" and self.head_dim % 2:
            raise ValueError(f"RoPE needs an even head_dim, got {self.head_dim}")
        positive(self, "window", "mlp_hidden", "d_cond", "rope_axes")
        for name in self.bidirectional:
            if name not in MODALITY_IDS or name == "text":
                allowed = [m for m in MODALITY_IDS if m != "text"]
                raise ValueError(f"bidirectional: {name!r} is not a modality; choose from {allowed}")
        if self.bidirectional and not self.causal:
            raise ValueError("bidirectional lists modalities exempt from a causal mask: set causal: true")
        if self.bigbird_block is not None and self.bigbird_block < 1:
            raise ValueError(
                f"bigbird_block must be > 0, got {self.bigbird_block} (tokens per block; null turns BigBird off)"
            )
        positive(self, "performer_features", "ff_chunks", "conv_kernel")
        for name in ("bigbird_window", "bigbird_global", "bigbird_random"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        bigbird_set = [
            n for n in ("bigbird_window", "bigbird_global", "bigbird_random") if getattr(self, n) != 1
        ]
        if bigbird_set and self.bigbird_block is None:
            raise ValueError(
                f"{', '.join(bigbird_set)} set without bigbird_block, which turns BigBird on: set bigbird_block "
                "(tokens per block, e.g. 64) or leave the BigBird options out"
            )
        if self.attn_drop and self.attn_kernel not in ("auto", "eager", "sdpa"):
            raise ValueError(
                f"attn_drop drops softmax attention weights, which attn_kernel {self.attn_kernel} does not form: "
                "set attn_drop: 0 (drop applies to the attention output), or attn_kernel eager or sdpa"
            )
        self.block_config()  # reversible, ff_chunks, conv_kernel, … checked at load, not at build

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads

    def block_config(self) -> BlockConfig:
        """The block family's settings (``models.BlockConfig``). Raises its ``ValueError``."""
        return BlockConfig(
            kind=self.block,
            drop_path=self.drop_path,
            layer_scale=self.layer_scale,
            d_cond=self.d_cond,
            d_context=self.d_context,
            conv_kernel=self.conv_kernel,
            reversible=self.reversible,
            ff_chunks=self.ff_chunks,
        )

    def mask_rules(self, recipe, where: str) -> set[str]:
        """The mask rules (``nn.kernels.MASK_RULES``) this backbone's attention must implement in
        ``recipe``: its own settings, and the tasks that read it (``reading_tasks``: a prefix-LM's
        bidirectional prefix is a span, a causal LM's order is causal)."""
        needs = {"causal"} if self.causal else set()
        needs |= {"spans"} if self.bidirectional else set()
        needs |= {"window"} if self.window else set()
        needs |= {"sparse"} if self.bigbird_block else set()
        reading = reading_tasks(recipe, where)  # model.backbone or model.towers.<tokenizer>
        kinds = {getattr(recipe.tasks[t], "kind", None) for t in reading}
        needs |= {"causal"} if kinds & {"causal_lm", "prefix_lm"} else set()
        needs |= {"spans"} if "prefix_lm" in kinds else set()
        needs |= {"documents"} if packed_tasks(recipe, reading) else set()
        return needs

    def check(self, recipe, where: str) -> None:
        """Refuses an ``attn_kernel`` that does not implement a mask rule the recipe needs, naming the
        kernels that do."""
        needs = self.mask_rules(recipe, where)
        if not takes_score_bias(self.attn_kernel) and self.positions in (
            "alibi",
            "t5",
            "toeplitz",
        ):
            raise RecipeError(
                f"'{where}.attn_kernel': {self.attn_kernel} takes no score bias, which positions "
                f"{self.positions} adds; use positions rope or none with it, or kernel eager, sdpa or flex"
            )
        lacking = kernel_needs(self.attn_kernel, dict(self.kernel_options)) - needs
        if lacking:
            raise RecipeError(
                f"'{where}.kernel_options': {self.attn_kernel} with {dict(self.kernel_options)} needs "
                f"{', '.join(sorted(lacking))} attention, which this recipe does not use (set "
                f"{where}.causal: true, or drop the option)"
            )
        if self.block == "cross" and not attends_across(self.attn_kernel, dict(self.kernel_options)):
            able = [k for k in KERNELS if k != "auto" and attends_across(k, {})]
            gated = (
                " with gate: true (its gate decays along one sequence)" if self.attn_kernel == "rfa" else ""
            )
            raise RecipeError(
                f"'{where}.attn_kernel': {self.attn_kernel}{gated} is self-attention only, and block: cross "
                f"attends to another sequence too; kernels that can: {', '.join(able)}"
            )
        missing = needs - kernel_rules(self.attn_kernel)
        if missing:
            packed = packed_tasks(recipe, reading_tasks(recipe, where)) if "documents" in missing else []
            unpack = (
                f" ({', '.join(packed)}: pack: true puts several documents in a row, which documents "
                "masks keep apart; set pack: false to pad each document alone)"
                if packed
                else ""
            )
            raise RecipeError(
                f"'{where}.attn_kernel': {self.attn_kernel} does not implement {', '.join(sorted(missing))} "
                f"masks, which this recipe needs ({', '.join(sorted(needs))}); kernels that do: "
                f"{', '.join(supporting(frozenset(needs)))}{unpack}"
            )


def require_kernel_rules(backbone, needs: frozenset[str], why: str) -> None:
    """Refuses ``model.backbone.attn_kernel`` when it lacks one of the mask rules ``needs``
    (``nn.kernels.MASK_RULES``), saying ``why`` the recipe needs them and naming the kernels that have
    them all."""
    missing = needs - kernel_rules(backbone.attn_kernel)
    if missing:
        raise RecipeError(
            f"'model.backbone.attn_kernel': {backbone.attn_kernel} does not implement "
            f"{', '.join(sorted(missing))} masks, which {why}; kernels that do: {', '.join(supporting(needs))}"
        )


def require_position_biases(recipe, tokenizer: str, n_tokens: int, why: str) -> None:
    """Refuses a backbone whose kernel holds learned position biases (AFT-full, AFT-local:
    ``kernel_options.max_len``) for fewer than the ``n_tokens`` tokens per sequence that tokenizer
    ``tokenizer``'s data gives (``why`` says where that number comes from), at load rather than at the
    first step. The backbone is the tokenizer's tower, else the shared one; a Perceiver resampler after
    the tokenizer (``model.resamplers``) hands it ``num_latents`` tokens instead."""
    resampler = recipe.model.resamplers.get(tokenizer)
    if resampler is not None:
        n_tokens, why = resampler.num_latents, f"'model.resamplers.{tokenizer}.num_latents'"
    backbone = recipe.model.towers.get(tokenizer, recipe.model.backbone)
    where = f"model.towers.{tokenizer}" if tokenizer in recipe.model.towers else "model.backbone"
    kernel = getattr(backbone, "attn_kernel", None)
    biases = position_biases(kernel, dict(backbone.kernel_options)) if kernel else None
    if biases is not None and n_tokens > biases:
        raise RecipeError(
            f"'{where}.kernel_options.max_len' is {biases}, but {why} gives {n_tokens} tokens per sequence: "
            f"the {kernel} kernel holds position biases for max_len tokens; set max_len: {n_tokens} or more"
        )


def reading_tasks(recipe, where: str) -> list[str]:
    """The tasks whose tokens the backbone at ``where`` reads: a tower's (``model.towers.<tokenizer>``)
    those of a task using that tokenizer, the shared backbone's those using any other."""
    tower = where.removeprefix("model.towers.") if where.startswith("model.towers.") else None
    towers = set(recipe.model.towers)
    return [
        name
        for name, task in recipe.tasks.items()
        if any((tok == tower) if tower else (tok not in towers) for tok in task.tokenizer_refs().values())
    ]


def packed_tasks(recipe, tasks: list[str]) -> list[str]:
    """The ``tasks.<name>.data`` entries of ``tasks`` that pack several documents into one row
    (``data.pack: true``): attention between them is cut by document masks."""
    return [
        f"tasks.{name}.data"
        for name in tasks
        if getattr(getattr(recipe.tasks[name], "data", None), "pack", False) is True
    ]


@dataclass
class PretrainedBackboneConfig:
    """``model.backbone`` of kind ``pretrained``: the backbone of real pretrained weights
    (``mmformer.models.pretrained``: a known name, a ``.gguf`` file or an HF Llama / BERT directory)."""

    kind: str = "pretrained"
    source: str = MISSING  # smollm2-135m-instruct | all-minilm-l6-v2 | whisper-tiny.en | PATH
    # an encoder–decoder source (Whisper): encoder (default; a tower) | decoder (the causal
    # cross-attention blocks, the shared backbone of a seq2seq task; the whole model is loaded)
    part: Optional[str] = None
    freeze_layers: int = 0  # freeze the first k blocks; all of them: the final norm too (the tokenizer's
    # `freeze` freezes the embeddings)

    def __post_init__(self) -> None:
        if self.freeze_layers < 0:
            raise ValueError(f"freeze_layers must be >= 0, got {self.freeze_layers}")
        if self.part not in (None, "encoder", "decoder"):
            raise ValueError(f"part={self.part!r}; choose encoder or decoder (of an encoder–decoder source)")


@register("backbone", "transformer", BackboneConfig)
def build_transformer(cfg: BackboneConfig, ctx: BuildContext) -> Backbone:
    """The flat recipe keys mapped onto ``build_backbone``'s nested configs (``drop`` is the dropout of
    both the attention output and the MLP, as it always was)."""
    attention = AttentionConfig(
        n_heads=cfg.n_heads,
        n_kv_heads=cfg.n_kv_heads,
        qkv_bias=cfg.qkv_bias,
        proj_bias=cfg.proj_bias,
        qk_norm=cfg.qk_norm,
        attn_drop=cfg.attn_drop,
        proj_drop=cfg.drop,
        kernel=cfg.attn_kernel,
        sdpa_backend=cfg.sdpa_backend,
        performer_features=cfg.performer_features,
        kernel_options=dict(cfg.kernel_options),
    )
    mlp = MlpConfig(ratio=cfg.mlp_ratio, hidden=cfg.mlp_hidden, act=cfg.act, bias=cfg.mlp_bias, drop=cfg.drop)
    positions = PositionConfig(
        kind=cfg.positions,
        rope_base=cfg.rope_base,
        rope_axes=cfg.rope_axes,
        rel_buckets=cfg.rel_buckets,
        rel_max_distance=cfg.rel_max_distance,
    )
    bigbird = None
    if cfg.bigbird_block:
        bigbird = BigBirdConfig(cfg.bigbird_block, cfg.bigbird_window, cfg.bigbird_global, cfg.bigbird_random)
    block = cfg.block_config()
    return build_backbone(
        cfg.d_model,
        cfg.n_layers,
        attention,
        mlp=mlp,
        positions=positions,
        long_context=LongContextConfig(window=cfg.window, bigbird=bigbird),
        block=block,
        norm=cfg.norm,
        norm_eps=cfg.norm_eps,
        final_norm=cfg.final_norm,
        causal=cfg.causal,
        bidirectional_modalities=tuple(MODALITY_IDS[m] for m in cfg.bidirectional),
    )


def freeze(module, frozen: bool = True) -> None:
    for p in module.parameters():
        p.requires_grad_(not frozen)


def part_backbone(pretrained, part: str | None) -> Backbone:
    """The blocks of ``part`` of a pretrained source: its backbone, or an encoder–decoder's (Whisper,
    loaded whole or as the encoder alone: ``encoder`` → the audio tower, ``decoder`` → the decoder).
    Raises ``RecipeError`` for a ``part`` of a source that has no parts."""
    model = pretrained.model
    if pretrained.family != "whisper":
        if part is not None:
            raise RecipeError(f"'part' applies to encoder–decoder sources (Whisper), not {pretrained.source}")
        return model.backbone
    if part == "decoder":
        return model.backbone
    return model.towers["audio"] if "audio" in model.towers else model.backbone


@register("backbone", "pretrained", PretrainedBackboneConfig)
def build_pretrained_backbone(cfg: PretrainedBackboneConfig, ctx: BuildContext) -> Backbone:
    backbone = part_backbone(ctx.pretrained(cfg.source), cfg.part)
    if cfg.freeze_layers > len(backbone.blocks):
        raise RecipeError(
            f"'model.backbone.freeze_layers' is {cfg.freeze_layers} but {cfg.source} has "
            f"{len(backbone.blocks)} blocks"
        )
    for block in backbone.blocks[: cfg.freeze_layers]:
        freeze(block)
    if cfg.freeze_layers == len(backbone.blocks):  # the whole backbone: its final norm too
        freeze(backbone.norm)
    return backbone
