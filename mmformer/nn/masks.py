"""Attention masks described as rules and converted to what each kernel needs.

Convention everywhere in mmformer: ``True`` = may attend / is real. Conversions to other
conventions (additive float masks, ``nn.MultiheadAttention``'s True = ignore) happen only here.

Shape legend: B batch, N tokens (queries = keys for self-attention).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass(frozen=True)
class MaskSpec:
    """Rules that decide whether query ``i`` may attend to key ``j``.

    Attributes:
        causal: ``j <= i`` only.
        valid: optional ``(B, N)`` bool, keys that are real tokens (padding is never attended).
        document: optional ``(B, N)`` long, tokens attend only within their own document.
    """

    causal: bool = False
    valid: Tensor | None = None
    document: Tensor | None = None

    @classmethod
    def from_tokens(cls, valid: Tensor, document: Tensor, causal: bool) -> MaskSpec:
        """Drop rules that allow everything, so kernels can take their fast path.

        ``valid.all()`` and the document check sync with the device once per forward.
        """
        keep_valid = None if bool(valid.all()) else valid
        keep_doc = None if bool((document == document[:, :1]).all()) else document
        return cls(causal=causal, valid=keep_valid, document=keep_doc)

    @property
    def is_full(self) -> bool:
        """Every query may attend to every key: no mask at all."""
        return not self.causal and self.valid is None and self.document is None

    @property
    def is_causal_only(self) -> bool:
        """Plain causal: kernels take ``is_causal=True`` instead of a dense mask."""
        return self.causal and self.valid is None and self.document is None

    def dense(self, n: int, device: torch.device | None = None) -> Tensor:
        """The mask as a dense bool tensor ``(B or 1, 1, N, N)``, True = may attend."""
        ref = self.valid if self.valid is not None else self.document
        device = ref.device if ref is not None else device
        mask = torch.ones(1, 1, n, n, dtype=torch.bool, device=device)
        if self.causal:
            mask = mask & torch.ones(n, n, dtype=torch.bool, device=device).tril()
        if self.valid is not None:
            mask = mask & self.valid[:, None, None, :]  # (B, 1, 1, N) keys
        if self.document is not None:
            mask = mask & (self.document[:, None, :, None] == self.document[:, None, None, :])
        return mask


def to_additive(mask: Tensor, dtype: torch.dtype) -> Tensor:
    """Bool mask (True = may attend) → additive float mask (0 or the dtype's most negative value)."""
    return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill(~mask, torch.finfo(dtype).min)


def to_ignore(mask: Tensor) -> Tensor:
    """Bool mask (True = may attend) → ``nn.MultiheadAttention`` convention (True = ignore)."""
    return ~mask
