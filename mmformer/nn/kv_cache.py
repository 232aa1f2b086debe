"""``KVCache``: the keys and values of past tokens, per layer, that decoding appends to one step at a time
(``Attention`` writes into it; ``Backbone.forward(tokens, cache=cache)`` extends its per-token metadata).

Shapes: ``B`` batch, ``Hkv`` key/value heads, ``Nk`` cached positions, ``Dh`` head dim, ``P`` position axes.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .masks import require_bool


class KVCache:
    """Keys and values of past tokens, per layer, plus the per-token metadata masks need.

    ``Backbone.forward(tokens, cache=cache)`` appends the new tokens; their positions are the caller's
    Tokens', which must count on from the cached ones (``next_positions`` gives them; ``MultimodalModel``
    uses it when called without ``positions``, and the backbone refuses positions that restart). Keys and
    values of padding are stored zeroed (``Attention`` zeroes them as they enter), so later steps need
    not zero the cache again.

    Keys and values live in buffers with room to grow (capacity doubled when full, as a ``list``), so a
    decoding step writes its one new position instead of copying the whole cache (``torch.cat`` each
    step, as transformers' default ``DynamicCache``, moves O(N) bytes per step and layer); ``keys`` /
    ``values`` are views of the filled part. For inference (under ``torch.no_grad``): appends write in
    place, so autograd refuses a backward through several cached steps.
    """

    def __init__(self, capacity: int = 0) -> None:
        """``capacity``: positions to make room for at the first append (the prompt plus the tokens to
        decode, when the caller knows them: one allocation, no doubling)."""
        self.capacity = capacity
        self.keys: dict[int, Tensor] = {}  # layer → (B, Hkv, Nk, Dh), a view of the layer's buffer
        self.values: dict[int, Tensor] = {}
        self._buffers: dict[int, tuple[Tensor, Tensor]] = {}  # layer → (B, Hkv, capacity, Dh) each
        self.valid: Tensor | None = None  # (B, Nk) bool
        self.document: Tensor | None = None  # (B, Nk) long
        self.positions: Tensor | None = None  # (B, Nk, P) long
        self.span_open: Tensor | None = (
            None  # (B,) bool: the last cached token is inside a bidirectional span
        )
        # cross-attention keys/values of the context (encoder–decoder): computed at the first step and
        # reused by every later one, since the context does not change while decoding
        self.cross: dict[int, tuple[Tensor, Tensor]] = {}  # layer → (B, Hkv, M, Dh) each

    @property
    def length(self) -> int:
        return 0 if self.valid is None else self.valid.shape[1]

    def next_positions(self, valid: Tensor) -> Tensor:
        """Positions ``(B, N, P)`` long of ``N`` new tokens, ``valid (B, N)`` bool, that follow the cached
        ones: each row counts its real tokens on from its cached real tokens (``self.valid.sum(1)``, so
        left padding is not counted; padding repeats its predecessor's index) — what
        ``Tokens.from_embeddings`` gives the whole row, so a cached step equals the full forward. Rows of
        a batch may hold different numbers of real tokens. ``P``: the cached positions' axes (1 when the
        cache is empty). Raises ``TypeError`` when ``valid`` is not bool."""
        require_bool(valid, "valid")
        past = self.valid.sum(dim=1, keepdim=True) if self.valid is not None else 0  # (B, 1)
        pos = (past + valid.long().cumsum(dim=1) - 1).clamp_min(0)  # (B, N)
        n_axes = self.positions.shape[-1] if self.positions is not None else 1
        return pos.unsqueeze(-1).expand(*valid.shape, n_axes)

    def update(self, layer: int, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        """Append ``k, v (B, Hkv, Nq, Dh)`` for ``layer``; returns all keys and values so far (views)."""
        n = self.keys[layer].shape[2] if layer in self.keys else 0
        end = n + k.shape[2]
        buf_k, buf_v = self._buffers.get(layer, (None, None))
        if buf_k is None or end > buf_k.shape[2]:
            room = self.capacity if buf_k is None and self.capacity >= end else max(2 * end, 16)
            shape = (*k.shape[:2], room, k.shape[3])
            grown_k, grown_v = k.new_empty(shape), v.new_empty(shape)
            if n:
                grown_k[:, :, :n], grown_v[:, :, :n] = self.keys[layer], self.values[layer]
            buf_k, buf_v = self._buffers[layer] = grown_k, grown_v
        buf_k[:, :, n:end], buf_v[:, :, n:end] = k, v
        self.keys[layer], self.values[layer] = buf_k[:, :, :end], buf_v[:, :, :end]
        return self.keys[layer], self.values[layer]

    def reorder(self, index: Tensor, cross: bool = True) -> None:
        """Keep batch rows ``index (B',)`` long, in that order (beam search: each surviving hypothesis
        continues from its parent's keys and values; a row may be repeated). ``cross=False`` leaves the
        cross-attention keys/values as they are: right when every row keeps its source (beams of one
        source replacing each other), and it saves copying them every step."""
        pick = lambda t: None if t is None else t.index_select(0, index)
        for layer, (buf_k, buf_v) in self._buffers.items():  # whole buffers: their room is kept
            n = self.keys[layer].shape[2]
            buf_k, buf_v = self._buffers[layer] = pick(buf_k), pick(buf_v)
            self.keys[layer], self.values[layer] = buf_k[:, :, :n], buf_v[:, :, :n]
        self.valid, self.document, self.positions = (
            pick(self.valid),
            pick(self.document),
            pick(self.positions),
        )
        self.span_open = pick(self.span_open)
        if cross:
            self.cross = {layer: (pick(k), pick(v)) for layer, (k, v) in self.cross.items()}

    def truncate(self, length: int) -> None:
        """Forget every position from ``length`` on (the buffers keep their room; the next append writes
        at ``length``): a Transfusion denoising step reads the cached text, then its image chunk is
        dropped, the next step's image taking its place. ``span_open`` becomes unknown (None), so the
        next chunk is not checked against the span the forgotten tokens were in. Raises ``ValueError``
        for a ``length`` outside ``[0, self.length]``."""
        if not 0 <= length <= self.length:
            raise ValueError(f"cannot truncate a cache of {self.length} positions to {length}")
        if self.valid is None:  # empty: nothing to forget
            return
        for layer in self.keys:
            self.keys[layer] = self.keys[layer][:, :, :length]
            self.values[layer] = self.values[layer][:, :, :length]
        self.valid, self.document = self.valid[:, :length], self.document[:, :length]
        self.positions, self.span_open = self.positions[:, :length], None

    def pad_tail(self, start: int, keep: Tensor) -> None:
        """Of the positions from ``start`` on, row ``b`` keeps its first ``keep[b]`` and the rest become
        padding: not valid (masked from every later query) and their keys and values zeroed, as padding
        is stored. Prompt-lookup decoding advances each row of a batch by its own kept run
        (``models.prompt_lookup``); later positions count each row's valid tokens
        (``next_positions``), so a row continues where its real tokens end. ``keep (B,)`` long. Raises
        ``ValueError`` for a ``start`` outside ``[0, self.length]``."""
        if not 0 <= start <= self.length:
            raise ValueError(f"cannot pad from position {start} of a cache of {self.length}")
        if self.valid is None or start == self.length:
            return
        offsets = torch.arange(self.length - start, device=self.valid.device)
        pad = offsets[None, :] >= keep.to(self.valid.device)[:, None]  # (B, length - start)
        self.valid = torch.cat([self.valid[:, :start], self.valid[:, start:] & ~pad], dim=1)
        zero = pad[:, None, :, None]
        for layer in self.keys:  # views of the buffers: written in place
            self.keys[layer][:, :, start:].masked_fill_(zero, 0.0)
            self.values[layer][:, :, start:].masked_fill_(zero, 0.0)

    def extend(self, valid: Tensor, document: Tensor, positions: Tensor) -> None:
        """Append the new tokens' metadata (called once per forward, after every layer ran). The first
        call stores copies, not the caller's tensors: those may be views (an ``expand``), and a compiled
        decoding step guards on it — a view after the prompt and a fresh tensor after every ``cat`` would
        compile the whole step twice."""
        cat = lambda old, new: new.clone() if old is None else torch.cat([old, new], dim=1)
        self.valid, self.document = cat(self.valid, valid), cat(self.document, document)
        self.positions = cat(self.positions, positions)
