"""Tokens: the one thing a modality tokenizer hands the backbone (DESIGN.md, Contracts).

Shape legend: B batch, N tokens, D model width, P position axes.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import torch
from torch import Tensor

# Modality ids carried in ``Tokens.modality``; a tokenizer stamps its own id on every token.
MODALITY_IDS = {"text": 0, "image": 1, "audio": 2, "diffusion": 3}


@dataclass
class Tokens:
    """A batch of token embeddings and their per-token metadata.

    Attributes:
        x: ``(B, N, D)`` float embeddings, absolute position embeddings already added.
        valid: ``(B, N)`` bool, ``True`` for real tokens, ``False`` for padding.
        positions: ``(B, N, P)`` long position indices for relative schemes applied in attention.
        document: ``(B, N)`` long packed-sequence ids; tokens attend only within their document.
        modality: ``(B, N)`` long, which tokenizer made each token (``MODALITY_IDS``).
    """

    x: Tensor
    valid: Tensor
    positions: Tensor
    document: Tensor
    modality: Tensor

    def __post_init__(self) -> None:
        B, N = self.x.shape[:2]
        for name in ("valid", "document", "modality"):
            t = getattr(self, name)
            if t.shape != (B, N):
                raise ValueError(f"Tokens.{name} must have shape {(B, N)}, got {tuple(t.shape)}")
        if self.positions.dim() != 3 or self.positions.shape[:2] != (B, N):
            raise ValueError(
                f"Tokens.positions must have shape (B, N, P)={(B, N)}+(P,), got {tuple(self.positions.shape)}"
            )
        if self.valid.dtype != torch.bool:
            raise TypeError(f"Tokens.valid must be bool, got {self.valid.dtype}")

    @classmethod
    def from_embeddings(
        cls,
        x: Tensor,
        modality: int,
        valid: Tensor | None = None,
        positions: Tensor | None = None,
        n_pos_axes: int = 1,
    ) -> Tokens:
        """Fill every field with its default: all valid, consecutive positions, one document.

        Args:
            x: ``(B, N, D)`` embeddings.
            modality: the tokenizer's modality id.
            valid: optional ``(B, N)`` bool; default all ``True``.
            positions: optional ``(B, N, P)`` long; default: each row counts ``0, 1, …`` from its first
                real token (so left padding does not shift positions; padding before it gets 0),
                repeated on ``n_pos_axes`` axes.
        """
        B, N = x.shape[:2]
        dev = x.device
        if valid is None:
            valid = torch.ones(B, N, dtype=torch.bool, device=dev)
        if positions is None:
            pos = (valid.long().cumsum(dim=1) - 1).clamp_min(0)  # (B, N)
            positions = pos.unsqueeze(-1).expand(B, N, n_pos_axes)
        document = torch.zeros(B, N, dtype=torch.long, device=dev)
        modality_t = torch.full((B, N), modality, dtype=torch.long, device=dev)
        return cls(x=x, valid=valid, positions=positions, document=document, modality=modality_t)

    @property
    def all_valid(self) -> bool:
        """True when no token is padding (forces a host sync on accelerators)."""
        return bool(self.valid.all())


@dataclass
class ConditionedTokens(Tokens):
    """Tokens with a conditioning vector for the whole sequence, what a conditioning tokenizer (DiT's
    timestep + class / caption embedding) hands the model, which passes it on as the backbone's (and the
    head's) ``cond``.

    Attributes:
        cond: ``(B, D_c)`` float, one vector per sample (adaLN conditioning); not a per-token field, so
            conditioned Tokens are neither concatenated nor used as a prefix or a cross-attention source.
    """

    cond: Tensor

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.cond.dim() != 2 or self.cond.shape[0] != self.x.shape[0]:
            raise ValueError(
                f"ConditionedTokens.cond must have shape (B, D_c) with B={self.x.shape[0]}, "
                f"got {tuple(self.cond.shape)}"
            )

    @classmethod
    def of(cls, tokens: Tokens, cond: Tensor) -> ConditionedTokens:
        """``tokens`` (every per-token field as is) with the conditioning vector ``cond (B, D_c)``."""
        return cls(**{f.name: getattr(tokens, f.name) for f in fields(Tokens)}, cond=cond)


def cat_tokens(parts: list[Tokens]) -> Tokens:
    """Concatenate Tokens along the token axis (every field), e.g. image prefix + text.

    Raises:
        ValueError: if batch size, width or number of position axes differ, or a part carries a
            conditioning vector (``ConditionedTokens``).
    """
    if not parts:
        raise ValueError("cat_tokens needs at least one Tokens")
    if any(isinstance(t, ConditionedTokens) for t in parts):
        raise ValueError(
            "cat_tokens: conditioned Tokens (a DiT's) carry one cond per sample; not concatenable"
        )
    B, D, P = parts[0].x.shape[0], parts[0].x.shape[-1], parts[0].positions.shape[-1]
    for t in parts[1:]:
        if t.x.shape[0] != B or t.x.shape[-1] != D or t.positions.shape[-1] != P:
            raise ValueError("cat_tokens: parts differ in batch size, width or position axes")
    return Tokens(**{f.name: torch.cat([getattr(t, f.name) for t in parts], dim=1) for f in fields(Tokens)})
