"""Output heads: pooling and output projections (timm names ``fc_norm``, ``head``).

Shape legend: B batch, N tokens, D model width, K classes.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..nn.linear_cross_entropy import linear_cross_entropy, logits_cross_entropy
from ..nn.onednn import runs_own_forward, uses_onednn
from ..nn.tokens import Tokens


class ClassifierHead(nn.Module):
    """Pool the backbone's hidden states and project to class logits.

    Args:
        d_model: hidden width ``D``.
        num_classes: ``K``; ``0`` keeps no projection (``head`` is ``nn.Identity``): the output is the
            pooled, ``fc_norm``-ed features ``(B, D)``, as timm's ``num_classes=0`` (a feature extractor).
        pool: ``"cls"`` takes the first token (the tokenizer's class token); ``"mean"`` averages the
            valid non-prefix tokens (timm ``global_pool="avg"``).
        num_prefix_tokens: tokens (class token, registers) excluded from mean pooling; the builder
            takes it from the tokenizer.
        fc_norm: LayerNorm after pooling (timm's average-pool ViTs, with the backbone's final norm off).
        drop: dropout before the projection.
        norm_eps: LayerNorm epsilon of ``fc_norm``.

    ``forward(hidden (B, N, D), tokens) → logits (B, K)`` float (``(B, D)`` features for ``K = 0``).
    ``reads``: ``slice(0, 1)`` for ``pool="cls"`` (the rows the head reads: ``MultimodalModel.forward``
    then hands it ``hidden (B, 1, D)``, and the backbone's last block computes that row only), else None.
    Raises ``ValueError`` for ``pool="cls"`` when the tokenizer has no prefix token, or ``num_classes < 0``.
    """

    def __init__(
        self,
        d_model: int,
        num_classes: int,
        pool: str = "cls",
        num_prefix_tokens: int = 1,
        fc_norm: bool = False,
        drop: float = 0.0,
        norm_eps: float = 1e-6,
    ):
        super().__init__()
        if pool not in ("cls", "mean"):
            raise ValueError(f"pool must be 'cls' or 'mean', got {pool!r}")
        if pool == "cls" and num_prefix_tokens < 1:
            raise ValueError("pool='cls' needs a tokenizer with a class token (class_token: true)")
        if num_classes < 0:
            raise ValueError(f"num_classes must be >= 0, got {num_classes}")
        self.d_model, self.num_classes = d_model, num_classes
        self.pool, self.num_prefix_tokens = pool, num_prefix_tokens
        self.fc_norm = nn.LayerNorm(d_model, eps=norm_eps) if fc_norm else nn.Identity()
        self.head_drop = nn.Dropout(drop)
        self.head = nn.Linear(d_model, num_classes) if num_classes else nn.Identity()
        self.init_weights()

    @property
    def reads(self) -> slice | None:
        return slice(0, 1) if self.pool == "cls" else None

    def init_weights(self) -> None:
        """Zero-init projection so every class starts equally likely (timm ``init_weights(mode="jax")``)."""
        if self.num_classes:
            nn.init.zeros_(self.head.weight)
            nn.init.zeros_(self.head.bias)

    def forward(self, hidden: Tensor, tokens: Tokens) -> Tensor:
        if self.pool == "cls":
            x = hidden[:, 0]  # (B, D)
        else:
            h = hidden[:, self.num_prefix_tokens :]  # (B, N - prefix, D)
            w = tokens.valid[:, self.num_prefix_tokens :].unsqueeze(-1).to(h.dtype)  # (B, N - prefix, 1)
            x = (h * w).sum(1) / w.sum(1).clamp_min(1.0)  # mean over real tokens only
        return self.head(self.head_drop(self.fc_norm(x)))


class ProjectionHead(nn.Module):
    """Pool the backbone's hidden states into one vector and project it into a shared embedding space
    (CLIP's ``visual.proj`` / ``text_projection``, Radford et al. 2021 §2.4; no bias, as CLIP).

    Args:
        d_model: hidden width ``D`` (of the backbone or tower that feeds this head).
        embed_dim: ``E``, the shared embedding width.
        pool: ``cls`` (first token), ``mean`` (valid non-prefix tokens) or ``last`` (the last valid token —
            CLIP's end-of-text token; the one pooling that suits a causal text encoder).
        num_prefix_tokens: tokens excluded from mean pooling (class token); from the tokenizer.
        norm: LayerNorm before the projection (CLIP's ``ln_post``; off when the backbone ends in a norm).

    ``forward(hidden (B, N, D), tokens) → (B, E)`` in the hidden dtype, not normalised (the objective
    normalises). ``reads``: ``slice(0, 1)`` for ``pool="cls"`` (as ``ClassifierHead.reads``), else None.
    Raises ``ValueError`` for an unknown ``pool``.
    """

    POOLS = ("cls", "mean", "last")

    def __init__(
        self, d_model: int, embed_dim: int, pool: str = "cls", num_prefix_tokens: int = 0, norm: bool = False
    ):
        super().__init__()
        if pool not in self.POOLS:
            raise ValueError(f"pool must be one of {self.POOLS}, got {pool!r}")
        if pool == "cls" and num_prefix_tokens < 1:
            raise ValueError("pool='cls' needs a tokenizer with a class token; use 'mean' or 'last'")
        self.pool, self.num_prefix_tokens = pool, num_prefix_tokens
        self.norm = nn.LayerNorm(d_model, eps=1e-6) if norm else nn.Identity()
        self.proj = nn.Linear(d_model, embed_dim, bias=False)
        nn.init.normal_(self.proj.weight, std=d_model**-0.5)  # CLIP: width ** -0.5

    @property
    def reads(self) -> slice | None:
        return slice(0, 1) if self.pool == "cls" else None

    def forward(self, hidden: Tensor, tokens: Tokens) -> Tensor:
        if self.pool == "cls":
            x = hidden[:, 0]
        elif self.pool == "last":
            valid = tokens.valid  # (B, N); right padding or left, the last True is the last real token
            last = (valid.long() * torch.arange(valid.shape[1], device=valid.device)).argmax(1)
            x = hidden[torch.arange(hidden.shape[0], device=hidden.device), last]
        else:
            h = hidden[:, self.num_prefix_tokens :]
            w = tokens.valid[:, self.num_prefix_tokens :].unsqueeze(-1).to(h.dtype)
            x = (h * w).sum(1) / w.sum(1).clamp_min(1.0)
        return self.proj(self.norm(x))


class LMHead(nn.Module):
    """Next-token logits ``(B, N, V)`` from hidden states ``(B, N, D)`` (``head``, no bias as GPT-2 /
    Llama). ``tie_to(embedding)`` shares the token-embedding matrix (Press & Wolf 2017,
    arXiv:1608.05859). Raises ``ValueError`` when the shapes differ. ``cross_entropy`` is the loss of
    these logits without holding them (``chunk_rows`` rows at a time)."""

    chunk_rows = 1024  # rows of logits alive at once in ``cross_entropy`` (GPT-2's vocabulary: 206 MB)

    def __init__(self, d_model: int, vocab_size: int):
        super().__init__()
        self.head = nn.Linear(d_model, vocab_size, bias=False)
        nn.init.normal_(self.head.weight, std=0.02)

    def tie_to(self, embedding: nn.Embedding) -> None:
        if embedding.weight.shape != self.head.weight.shape:
            raise ValueError(
                f"cannot tie a {tuple(self.head.weight.shape)} head to a "
                f"{tuple(embedding.weight.shape)} embedding"
            )
        self.head.weight = embedding.weight

    def forward(self, hidden: Tensor, tokens: Tokens) -> Tensor:
        return self.head(hidden)

    def cross_entropy(
        self, hidden: Tensor, targets: Tensor, ignore_index: int = -100, reduction: str = "mean"
    ) -> Tensor:
        """``F.cross_entropy`` of ``self(hidden)`` (float32) against ``targets (...)`` for hidden
        ``(..., D)`` — ``reduction`` ``"mean"`` over the rows not ``ignore_index``, ``"sum"`` or ``"none"``
        (``(...)``) — computed by ``nn.linear_cross_entropy``: never more than ``chunk_rows`` rows of
        logits at once, the gradients taken with the loss. The same loss and gradients up to rounding.
        A head whose linear was replaced (LoRA), hooked, sharded (a DTensor weight) or compiled runs
        the plain computation. Raises ``linear_cross_entropy``'s ``ValueError`` for a bad ``reduction``
        or mismatched shapes."""
        lin = self.head
        if (
            type(lin) is nn.Linear
            and (runs_own_forward(lin) or uses_onednn(lin))
            and not (lin._forward_hooks or lin._forward_pre_hooks)
            and type(lin.weight.data) is torch.Tensor
            and not torch.compiler.is_compiling()
        ):
            return linear_cross_entropy(
                hidden,
                lin.weight,
                targets,
                lin.bias,
                ignore_index,
                reduction,
                self.chunk_rows,
                uses_onednn(lin),
            )
        return logits_cross_entropy(self.head(hidden), targets, ignore_index, reduction)


def token_cross_entropy(
    head: nn.Module,
    hidden: Tensor,
    tokens: Tokens,
    targets: Tensor,
    ignore_index: int = -100,
    reduction: str = "mean",
) -> Tensor:
    """The cross-entropy of ``head``'s logits at the first ``M`` positions of ``hidden (B, N, D)``
    against ``targets (B, M)`` long, ``M ≤ N`` (a next-token loss: ``M = N - 1``, the last position
    predicting nothing; ``ignore_index`` where a position counts for nothing). ``reduction`` as
    ``F.cross_entropy``'s: ``"mean"`` over the counted positions, ``"sum"``, or ``"none"`` → ``(B, M)``
    float32. An ``LMHead`` computes it without the ``(B, M, V)`` logits (``LMHead.cross_entropy``), any
    other head — or an ``LMHead`` with forward hooks, which must see its logits — from its logits
    ``head(hidden, tokens)``. Raises ``ValueError`` when ``targets`` is longer
    than ``hidden`` or the reduction is unknown."""
    if targets.dim() != 2 or targets.shape[0] != hidden.shape[0] or targets.shape[1] > hidden.shape[1]:
        raise ValueError(
            f"targets {tuple(targets.shape)} must be (B, M) with M <= N for hidden {tuple(hidden.shape)}"
        )
    M = targets.shape[1]
    if isinstance(head, LMHead) and not (head._forward_hooks or head._forward_pre_hooks):
        # position-wise: the positions without a target are never projected
        return head.cross_entropy(hidden[:, :M], targets, ignore_index, reduction)
    return logits_cross_entropy(head(hidden, tokens)[:, :M], targets, ignore_index, reduction)


class MLMHead(nn.Module):
    """BERT's masked-LM head (``BertLMPredictionHead``, Devlin et al. 2019): ``dense (D → D)``, GELU,
    LayerNorm, then a decoder over the vocabulary with its own bias, the decoder weight tied to the token
    embedding by ``tie_to``. Hidden ``(B, N, D)`` → logits ``(B, N, V)``. Raises ``ValueError`` when the
    tied shapes differ."""

    def __init__(self, d_model: int, vocab_size: int, norm_eps: float = 1e-12):
        super().__init__()
        self.dense = nn.Linear(d_model, d_model)
        self.norm = nn.LayerNorm(d_model, eps=norm_eps)
        self.decoder = nn.Linear(d_model, vocab_size)
        for layer in (self.dense, self.decoder):
            nn.init.normal_(layer.weight, std=0.02)
            nn.init.zeros_(layer.bias)

    def tie_to(self, embedding: nn.Embedding) -> None:
        if embedding.weight.shape != self.decoder.weight.shape:
            raise ValueError(
                f"cannot tie a {tuple(self.decoder.weight.shape)} decoder to a "
                f"{tuple(embedding.weight.shape)} embedding"
            )
        self.decoder.weight = embedding.weight

    def forward(self, hidden: Tensor, tokens: Tokens) -> Tensor:
        return self.decoder(self.norm(F.gelu(self.dense(hidden))))


class DiTFinalLayer(nn.Module):
    """DiT's output layer: adaLN-modulated LayerNorm → Linear to ``p·p·C_out`` per token → unpatchify
    (Peebles & Xie 2023, §3.2; facebookresearch/DiT ``FinalLayer`` and ``unpatchify``). Zero-initialised
    (``adaLN_modulation`` and ``linear``), so the model predicts zeros at initialisation.

    Args:
        d_model: hidden width ``D``.
        patch_size: ``p``; grid_size: the tokenizer's ``(Gh, Gw)``.
        out_chans: ``C_out`` — the image channels, doubled with a learned variance (Nichol & Dhariwal
            2021): the first half the mean prediction (ε, v or velocity), the second the variance
            interpolation.
        d_cond: conditioning width (default ``D``).

    ``forward(hidden (B, N, D), tokens, cond (B, Dc)) → (B, C_out, Gh·p, Gw·p)`` in the hidden dtype.
    Raises ``ValueError`` without ``cond`` or when ``N != Gh·Gw``.
    """

    def __init__(
        self,
        d_model: int,
        patch_size: int,
        grid_size: tuple[int, int],
        out_chans: int,
        d_cond: int | None = None,
    ):
        super().__init__()
        self.patch_size, self.grid_size, self.out_chans = patch_size, tuple(grid_size), out_chans
        self.norm_final = nn.LayerNorm(d_model, elementwise_affine=False, eps=1e-6)
        self.linear = nn.Linear(d_model, patch_size * patch_size * out_chans)
        self.adaLN_modulation = nn.Sequential(nn.SiLU(), nn.Linear(d_cond or d_model, 2 * d_model))
        for layer in (self.linear, self.adaLN_modulation[-1]):
            nn.init.zeros_(layer.weight)
            nn.init.zeros_(layer.bias)

    def forward(self, hidden: Tensor, tokens: Tokens, cond: Tensor | None = None) -> Tensor:
        if cond is None:
            raise ValueError("DiTFinalLayer needs the conditioning vector cond (B, Dc)")
        (Gh, Gw), p, C = self.grid_size, self.patch_size, self.out_chans
        B, N, _ = hidden.shape
        if N != Gh * Gw:
            raise ValueError(f"expected {Gh}×{Gw} = {Gh * Gw} patch tokens, got {N}")
        shift, scale = self.adaLN_modulation(cond).chunk(2, dim=-1)
        x = self.norm_final(hidden) * (1 + scale.unsqueeze(1)) + shift.unsqueeze(1)
        x = self.linear(x)  # (B, N, p·p·C), channels last within each patch as DiT
        x = x.reshape(B, Gh, Gw, p, p, C)
        return x.permute(0, 5, 1, 3, 2, 4).reshape(B, C, Gh * p, Gw * p)  # DiT: nhwpqc → nchpwq


class ProjectorHead(nn.Module):
    """Maps an encoder's output tokens into a language model's embedding space, to be its prefix: the
    LLaVA-1.5 projector (Liu et al. 2023, arXiv:2310.03744: ``Linear → GELU → Linear``), after stacking
    ``stack`` consecutive tokens into one (frame stacking, as the window-level Q-Former of SALMONN or the
    pooling of Qwen2-Audio shorten 50 Hz Whisper frames before the LLM).

    Args:
        d_in: the encoder's width; d_out: the language model's ``d_model``.
        stack: consecutive tokens concatenated into one (the last group is padded).
        hidden: the MLP's inner width (default ``d_out``).

    ``forward(hidden (B, N, d_in), tokens) → Tokens`` with ``x (B, ⌈N / stack⌉, d_out)``; a stacked token is
    real when any of its tokens is (padding inside it reads as zeros), positions count the stacked
    tokens, modality is kept.
    """

    def __init__(self, d_in: int, d_out: int, stack: int = 1, hidden: int | None = None):
        super().__init__()
        if stack < 1:
            raise ValueError(f"stack must be >= 1, got {stack}")
        self.stack = stack
        self.fc1 = nn.Linear(d_in * stack, hidden or d_out)
        self.act = nn.GELU()
        self.fc2 = nn.Linear(hidden or d_out, d_out)

    def forward(self, hidden: Tensor, tokens: Tokens) -> Tokens:
        B, N, D = hidden.shape
        k = self.stack
        pad = (-N) % k
        valid = torch.nn.functional.pad(tokens.valid, (0, pad), value=False)
        x = torch.nn.functional.pad(hidden * tokens.valid.unsqueeze(-1).to(hidden.dtype), (0, 0, 0, pad))
        x = x.reshape(B, (N + pad) // k, k * D)
        valid = valid.view(B, -1, k).any(-1)
        out = Tokens.from_embeddings(self.fc2(self.act(self.fc1(x))), 0, valid=valid)
        out.modality = tokens.modality[:, :1].expand_as(valid)
        return out
