"""Encoder–decoder (Vaswani et al. 2017, §3.1; Whisper, Radford et al. 2022, §2.2): an encoder reads the
source (audio, image or text) once; a causal decoder of ``CrossAttentionBlock``s generates text, each
block attending to the encoder's output.

In a ``MultimodalModel`` the encoder is the source tokenizer's tower (``model.towers[tokenizer]``) and
the decoder is the shared backbone (``block: cross``, ``causal: true``), read out by an LM head — the
same parts a recipe names for every other task, so an encoder–decoder needs no model class of its own.

Training: teacher forcing — the decoder reads the whole target ``bos … eos`` at once and position ``t``
predicts token ``t + 1`` (``logits``). Decoding (``generate``): the encoder runs once; the prompt (one
``bos``, or Whisper's ``<|startoftranscript|> <|notimestamps|>``) is prefilled into the KV cache, then
one token per step: the self-attention cache grows, and each block's cross-attention keys/values are
projected from the encoder output at the first step and reused (``KVCache.cross``). Greedy or beam
search (``mmformer.models.decoding``), with Whisper's token-suppression rules when asked.

Shape legend: B batch, M source tokens, L text tokens, D decoder width, V vocabulary.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

import torch
from torch import Tensor

from ..nn.kv_cache import KVCache
from ..nn.tokens import ConditionedTokens, Tokens
from .decoding import beam_search, greedy, text_tokens
from .heads import token_cross_entropy
from .model import MultimodalModel


@dataclass(frozen=True)
class EncoderDecoder:
    """The names of an encoder–decoder's parts in a ``MultimodalModel``.

    Attributes:
        tokenizer: the source tokenizer; its tower is the encoder.
        text_tokenizer: the decoder's text tokenizer (a ``TextEmbedding``).
        lm_head: the LM head over the decoder's output.
    """

    tokenizer: str
    text_tokenizer: str
    lm_head: str

    def check(self, model: MultimodalModel) -> None:
        """Raises ``ValueError`` when the model's parts cannot form an encoder–decoder."""
        if self.tokenizer not in model.towers:
            raise ValueError(
                f"an encoder–decoder encodes with the source tokenizer's tower: model.towers has no "
                f"{self.tokenizer!r} (towers: {list(model.towers)})"
            )
        if not model.backbone.causal or not hasattr(model.backbone.blocks[0], "cross_attn"):
            raise ValueError("the decoder (the shared backbone) must be causal with cross-attention blocks")

    def encode(self, model: MultimodalModel, inputs: Tensor, source_valid: Tensor | None = None) -> Tokens:
        """Source ``inputs`` (waves ``(B, S)`` with ``source_valid (B, S)`` bool, True = real sample;
        images; ids) → the encoder's output as Tokens ``(B, M, D_enc)`` (its ``valid`` marks real tokens)."""
        kwargs = {"valid": source_valid} if source_valid is not None else {}
        tokens = model.tokenizers[self.tokenizer](inputs, **kwargs)
        if isinstance(tokens, ConditionedTokens):
            raise ValueError(
                f"tokenizer {self.tokenizer!r} returns a conditioning vector; it cannot be a source"
            )
        return replace(tokens, x=model.towers[self.tokenizer](tokens))

    def _text(self, model: MultimodalModel, ids: Tensor, valid: Tensor | None, start: int = 0) -> Tokens:
        return text_tokens(model.tokenizers[self.text_tokenizer], ids, valid, start)

    def decode(
        self, model: MultimodalModel, context: Tokens, ids: Tensor, valid: Tensor | None = None
    ) -> Tensor:
        """Teacher-forced next-token logits ``(B, L, V)`` of text ``ids (B, L)`` long (``valid (B, L)``
        bool, True = real token) given the encoder output ``context``."""
        return model.heads[self.lm_head](*self._decoded(model, context, ids, valid))

    def _decoded(
        self, model: MultimodalModel, context: Tokens, ids: Tensor, valid: Tensor | None
    ) -> tuple[Tensor, Tokens]:
        """The decoder's output ``(B, L, D)`` for text ``ids`` given ``context``, and the text Tokens."""
        text = self._text(model, ids, valid)
        return model.backbone(text, context=context), text

    def cross_entropy(
        self,
        model: MultimodalModel,
        inputs: Tensor,
        ids: Tensor,
        valid: Tensor,
        targets: Tensor,
        reduction: str = "mean",
        source_valid: Tensor | None = None,
    ) -> Tensor:
        """The teacher-forced cross-entropy of ``logits`` against ``targets (B, L - 1)`` (``-100`` = not
        counted; ``reduction`` as ``F.cross_entropy``'s, ``"none"`` → ``(B, L - 1)``), without the
        ``(B, L, V)`` logits for an ``LMHead`` (``heads.token_cross_entropy``; Whisper's 51,865-token
        vocabulary: 0.2 MB per target position). The interface ``PrefixLM.cross_entropy`` has. Raises
        ``ValueError`` as ``logits``."""
        self.check(model)
        hidden, text = self._decoded(model, self.encode(model, inputs, source_valid), ids, valid)
        return token_cross_entropy(model.heads[self.lm_head], hidden, text, targets, -100, reduction)

    def logits(
        self,
        model: MultimodalModel,
        inputs: Tensor,
        ids: Tensor,
        valid: Tensor,
        source_valid: Tensor | None = None,
    ) -> Tensor:
        """Encode ``inputs`` and return the teacher-forced logits ``(B, L, V)``: position ``t`` predicts
        text token ``t + 1`` (the interface ``PrefixLM.logits`` has, so one task trains both). Raises
        ``ValueError`` when the model's parts cannot form an encoder–decoder (``check``)."""
        self.check(model)
        return self.decode(model, self.encode(model, inputs, source_valid), ids, valid)

    @torch.no_grad()
    def generate(
        self,
        model: MultimodalModel,
        inputs: Tensor,
        prompt: int | Sequence[int],
        eos_id: int | None,
        max_new_tokens: int,
        beam_size: int = 1,
        length_penalty: float = 1.0,
        source_valid: Tensor | None = None,
        suppress: Sequence[int] = (),
        suppress_begin: Sequence[int] = (),
        fixed_steps: bool = False,
    ) -> list[list[int]]:
        """Text for each source: the new ids per row (without the prompt and ``eos``). ``prompt``: the
        ``bos`` id or the ids every row starts with. ``beam_size=1`` is greedy. ``suppress`` ids are never
        generated, ``suppress_begin`` ids not first (Whisper's rules). With learned text positions the
        text stops at the tokenizer's ``max_len``. ``fixed_steps``: no early stop (``decoding.greedy``).

        Raises ``ValueError`` for ``beam_size < 1`` or ``max_new_tokens < 1``, a prompt that fills the
        decoder's positions, or parts that do not form an encoder–decoder.
        """
        if beam_size < 1 or max_new_tokens < 1:
            raise ValueError(f"beam_size and max_new_tokens must be >= 1, got {beam_size}, {max_new_tokens}")
        self.check(model)
        model.for_decoding()
        prompt = [prompt] if isinstance(prompt, int) else list(prompt)
        max_len = getattr(model.tokenizers[self.text_tokenizer], "max_len", None)
        if max_len is not None:
            if len(prompt) >= max_len:
                raise ValueError(f"a prompt of {len(prompt)} tokens fills the decoder's {max_len} positions")
            max_new_tokens = min(max_new_tokens, max_len - len(prompt))
        context = self.encode(model, inputs, source_valid)
        B = context.x.shape[0]
        ids = torch.tensor(prompt, dtype=torch.long, device=context.x.device).expand(B, -1)
        cache = KVCache(capacity=ids.shape[1] + max_new_tokens)
        text = self._text(model, ids, None)
        hidden = model.backbone(text, context=context, cache=cache)
        logits = model.heads[self.lm_head](hidden[:, -1:], text)[:, -1]  # (B, V)

        contexts = {B: context}  # beam search runs B·K rows: row b·K + k reads source b

        def step(nxt: Tensor, t: int) -> Tensor:  # ``nxt (B', 1)`` → next-token logits (B', V)
            rows = nxt.shape[0]
            if rows not in contexts:  # its keys/values are cached; the backbone reads only its mask
                contexts[rows] = _repeat_rows(context, rows // B)
            text = self._text(model, nxt, None, start=cache.length)
            hidden = model.backbone(text, context=contexts[rows], cache=cache)
            return model.heads[self.lm_head](hidden, text)[:, -1]

        if beam_size == 1:
            return greedy(step, logits, eos_id, max_new_tokens, suppress, suppress_begin, fixed_steps)
        return beam_search(
            step,
            cache,
            logits,
            eos_id,
            max_new_tokens,
            beam_size,
            length_penalty,
            suppress,
            suppress_begin,
            fixed_steps,
        )


def _repeat_rows(tokens: Tokens, k: int) -> Tokens:
    """Each row of ``tokens`` (every field ``(B, M, …)``) repeated ``k`` times in place → ``(B·k, M, …)``
    (beam search's rows ``b·k + j``)."""
    return Tokens(
        tokens.x.repeat_interleave(k, 0),
        tokens.valid.repeat_interleave(k, 0),
        tokens.positions.repeat_interleave(k, 0),
        tokens.document.repeat_interleave(k, 0),
        tokens.modality.repeat_interleave(k, 0),
    )
