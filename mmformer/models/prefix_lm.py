"""Prefix-LM over a multimodal sequence: image or audio tokens as a bidirectional prefix, then text
generated causally — one sequence through one causal backbone (the prefix-LM mask of Raffel et al.
2020, "T5", §3.2.1; image → text as in SimVLM, Wang et al. 2022, arXiv:2108.10904). When the prefix
tokenizer has a tower of its own (a pretrained encoder) and a ``projector`` head maps the tower's
output to the backbone's width, this is the LLaVA bridge (Liu et al. 2023, arXiv:2304.08485):
encoder → projector → language model, the encoder's tokens as the prefix.

Sequence layout: ``[prefix (Np tokens, padding included) | text (L tokens)]``; the prefix is span 1
(every prefix token sees every real prefix token), text tokens see the whole prefix and the text up to
themselves; padding is never attended. Positions for the backbone (RoPE / ALiBi) count the real tokens
of the whole sequence (text continues after the prefix); the text tokenizer's own learned positions
(``max_len``) count from the text's first token, so a caption is embedded the same with any prefix.

Decoding: greedy and beam search (``generate``, ``mmformer.models.decoding``) with the KV cache; the
prefix and ``bos`` are prefilled in one forward.

Shape legend: B batch, Np prefix tokens, L text tokens, D backbone width, V vocabulary, K beam size.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
from torch import Tensor

from ..nn.kv_cache import KVCache
from ..nn.tokens import ConditionedTokens, Tokens, cat_tokens
from .decoding import beam_search, greedy, text_tokens
from .heads import token_cross_entropy
from .model import MultimodalModel


def _sequence_positions(valid: Tensor, n_axes: int, start: Tensor | None = None) -> Tensor:
    """``(B, N, n_axes)`` long: each real token's index among the row's real tokens (plus ``start (B,)``);
    padding repeats its predecessor's index (it is never attended)."""
    pos = (valid.long().cumsum(dim=1) - 1).clamp_min(0)
    if start is not None:
        pos = pos + start[:, None]
    return pos.unsqueeze(-1).expand(*valid.shape, n_axes)


@dataclass(frozen=True)
class PrefixLM:
    """The names of a prefix-LM's parts in a ``MultimodalModel``.

    Attributes:
        tokenizer: the prefix's tokenizer (image or audio); with a tower of its own, the tower's output.
        caption_tokenizer: the text tokenizer (a ``TextEmbedding``) of the generated text.
        caption_head: the LM head over the text positions.
        projector: optional head ``(hidden (B, Np, D_tower), tokens) → Tokens`` of the backbone's width
            (the LLaVA projector), applied to the prefix after its tower.
    """

    tokenizer: str
    caption_tokenizer: str
    caption_head: str
    projector: str | None = None

    # ------------------------------------------------------------------ sequences
    def prefix(self, model: MultimodalModel, inputs: Tensor, prefix_valid: Tensor | None = None) -> Tokens:
        """``inputs`` (images ``(B, C, H, W)``, or waves ``(B, S)`` with ``prefix_valid (B, S)`` bool, True =
        real sample) → prefix Tokens of the backbone's width. Raises ``ValueError`` for a conditioning
        (DiT) tokenizer."""
        kwargs = {"valid": prefix_valid} if prefix_valid is not None else {}
        tokens = model.tokenizers[self.tokenizer](inputs, **kwargs)
        if isinstance(tokens, ConditionedTokens):
            raise ValueError(
                f"tokenizer {self.tokenizer!r} returns a conditioning vector; it cannot be a prefix"
            )
        if self.tokenizer in model.towers:
            tokens = replace(tokens, x=model.towers[self.tokenizer](tokens))
        if self.projector is not None:
            tokens = model.heads[self.projector](tokens.x, tokens)
        return tokens

    def _text(self, model: MultimodalModel, ids: Tensor, valid: Tensor | None, start: int = 0) -> Tokens:
        """Text Tokens; the text tokenizer's own positions count from ``start`` (its first token = 0)."""
        return text_tokens(model.tokenizers[self.caption_tokenizer], ids, valid, start)

    @staticmethod
    def _n_axes(model: MultimodalModel) -> int:
        rope = model.backbone.rope
        return rope.n_axes if rope is not None else 1

    def _join(self, model: MultimodalModel, prefix: Tokens, text: Tokens) -> tuple[Tokens, Tensor]:
        """``[prefix | text]`` with sequence positions, and its span ids ``(B, Np + L)`` (1 = prefix)."""
        if not model.backbone.causal:
            raise ValueError("a prefix-LM generates text: the backbone must be causal")
        n_axes = self._n_axes(model)
        parts = [
            replace(t, positions=t.positions[..., :1].expand(*t.valid.shape, n_axes)) for t in (prefix, text)
        ]
        seq = cat_tokens(parts)
        seq.positions = _sequence_positions(seq.valid, n_axes)
        seq.document = torch.zeros_like(seq.document)
        span = torch.zeros_like(seq.document)
        span[:, : prefix.x.shape[1]] = 1
        return seq, span

    def logits(
        self,
        model: MultimodalModel,
        inputs: Tensor,
        ids: Tensor,
        valid: Tensor,
        prefix_valid: Tensor | None = None,
    ) -> Tensor:
        """Teacher-forced next-token logits ``(B, L, V)`` at the text positions: position ``t`` predicts
        text token ``t + 1``. ``ids (B, L)`` long, ``valid (B, L)`` bool (True = real token)."""
        hidden, text = self.text_hidden(model, inputs, ids, valid, prefix_valid)
        return model.heads[self.caption_head](hidden, text)

    def text_hidden(
        self,
        model: MultimodalModel,
        inputs: Tensor,
        ids: Tensor,
        valid: Tensor,
        prefix_valid: Tensor | None = None,
    ) -> tuple[Tensor, Tokens]:
        """The backbone's output ``(B, L, D)`` at the text positions of ``[prefix | text]``, and the text
        Tokens (what ``logits`` projects)."""
        prefix = self.prefix(model, inputs, prefix_valid)
        text = self._text(model, ids, valid)
        seq, span = self._join(model, prefix, text)
        return model.backbone(seq, span=span)[:, prefix.x.shape[1] :], text

    def cross_entropy(
        self,
        model: MultimodalModel,
        inputs: Tensor,
        ids: Tensor,
        valid: Tensor,
        targets: Tensor,
        reduction: str = "mean",
        prefix_valid: Tensor | None = None,
    ) -> Tensor:
        """The teacher-forced cross-entropy of ``logits`` against ``targets (B, L - 1)`` (``-100`` =
        not counted; ``reduction`` as ``F.cross_entropy``'s, ``"none"`` → ``(B, L - 1)``), without the
        ``(B, L, V)`` logits for an ``LMHead`` (``heads.token_cross_entropy``)."""
        hidden, text = self.text_hidden(model, inputs, ids, valid, prefix_valid)
        head = model.heads[self.caption_head]
        return token_cross_entropy(head, hidden, text, targets, -100, reduction)

    # ------------------------------------------------------------------ decoding
    def _step(self, model: MultimodalModel, cache: KVCache, ids: Tensor, t: int) -> Tensor:
        """Feed ``ids (B, 1)`` as text token ``t``; returns the next-token logits ``(B, V)``."""
        text = self._text(model, ids, None, start=t)
        text.positions = _sequence_positions(text.valid, self._n_axes(model), start=cache.valid.sum(dim=1))
        hidden = model.backbone(text, cache=cache, span=torch.zeros_like(ids))
        return model.heads[self.caption_head](hidden, text)[:, -1]

    @torch.no_grad()
    def generate(
        self,
        model: MultimodalModel,
        inputs: Tensor,
        bos_id: int,
        eos_id: int | None,
        max_new_tokens: int,
        beam_size: int = 1,
        length_penalty: float = 1.0,
        prefix_valid: Tensor | None = None,
        fixed_steps: bool = False,
    ) -> list[list[int]]:
        """Text for each prefix: a list of new ids per row (without ``bos`` and ``eos``). ``beam_size=1``
        is greedy decoding. With learned text positions the text stops at the tokenizer's ``max_len``.
        ``fixed_steps``: no early stop (``decoding.greedy``).

        Raises ``ValueError`` for ``beam_size < 1`` or ``max_new_tokens < 1``.
        """
        if beam_size < 1 or max_new_tokens < 1:
            raise ValueError(f"beam_size and max_new_tokens must be >= 1, got {beam_size}, {max_new_tokens}")
        model.for_decoding()
        max_len = getattr(model.tokenizers[self.caption_tokenizer], "max_len", None)
        if max_len is not None:
            max_new_tokens = min(max_new_tokens, max_len - 1)
        prefix = self.prefix(model, inputs, prefix_valid)
        B = prefix.x.shape[0]
        bos = torch.full((B, 1), bos_id, dtype=torch.long, device=prefix.x.device)
        text = self._text(model, bos, None)
        seq, span = self._join(model, prefix, text)
        cache = KVCache(capacity=seq.x.shape[1] + max_new_tokens)
        hidden = model.backbone(seq, cache=cache, span=span)
        logits = model.heads[self.caption_head](hidden[:, -1:], text)[:, -1]  # (B, V)
        step = lambda ids, t: self._step(model, cache, ids, t)  # noqa: E731
        if beam_size == 1:
            return greedy(step, logits, eos_id, max_new_tokens, fixed_steps=fixed_steps)
        return beam_search(
            step, cache, logits, eos_id, max_new_tokens, beam_size, length_penalty, fixed_steps=fixed_steps
        )
