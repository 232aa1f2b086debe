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

Decoding: greedy and beam search (``generate``) with the KV cache; the prefix and ``bos`` are
prefilled in one forward. Beam search keeps ``beam_size`` live hypotheses per row; a hypothesis ending
in ``eos`` among the best ``beam_size`` candidates of a step is finished with score
``sum log p / length ** length_penalty`` (length = generated tokens, ``eos`` included; Wu et al. 2016
use a similar normalisation); a row stops once it has ``beam_size`` finished hypotheses and its best
live one, normalised at its current length, cannot beat the worst of them (exact for
``length_penalty = 0``, as Hugging Face's ``early_stopping=False``); at ``max_new_tokens`` the live
hypotheses are finished as they are.

Shape legend: B batch, Np prefix tokens, L text tokens, D backbone width, V vocabulary, K beam size.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
from torch import Tensor

from ..nn.attention import KVCache
from ..nn.tokens import Tokens, cat_tokens
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
        out = model.tokenizers[self.tokenizer](inputs, **kwargs)
        if isinstance(out, tuple):
            raise ValueError(
                f"tokenizer {self.tokenizer!r} returns a conditioning vector; it cannot be a prefix"
            )
        tokens = out
        if self.tokenizer in model.towers:
            tokens = replace(tokens, x=model.towers[self.tokenizer](tokens))
        if self.projector is not None:
            tokens = model.heads[self.projector](tokens.x, tokens)
        return tokens

    def _text(self, model: MultimodalModel, ids: Tensor, valid: Tensor | None, start: int = 0) -> Tokens:
        """Text Tokens; the text tokenizer's own positions count from ``start`` (its first token = 0)."""
        emb = model.tokenizers[self.caption_tokenizer]
        pos = None
        if start:
            pos = torch.full((*ids.shape, emb.n_pos_axes), start, dtype=torch.long, device=ids.device)
            pos = pos + torch.arange(ids.shape[1], device=ids.device).view(1, -1, 1)
        return emb(ids, valid=valid, positions=pos)

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
        prefix = self.prefix(model, inputs, prefix_valid)
        text = self._text(model, ids, valid)
        seq, span = self._join(model, prefix, text)
        hidden = model.backbone(seq, span=span)
        return model.heads[self.caption_head](hidden[:, prefix.x.shape[1] :], text)

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
    ) -> list[list[int]]:
        """Text for each prefix: a list of new ids per row (without ``bos`` and ``eos``). ``beam_size=1``
        is greedy decoding. With learned text positions the text stops at the tokenizer's ``max_len``.

        Raises ``ValueError`` for ``beam_size < 1`` or ``max_new_tokens < 1``.
        """
        if beam_size < 1 or max_new_tokens < 1:
            raise ValueError(f"beam_size and max_new_tokens must be >= 1, got {beam_size}, {max_new_tokens}")
        model.eval()
        max_len = getattr(model.tokenizers[self.caption_tokenizer], "max_len", None)
        if max_len is not None:
            max_new_tokens = min(max_new_tokens, max_len - 1)
        prefix = self.prefix(model, inputs, prefix_valid)
        B = prefix.x.shape[0]
        bos = torch.full((B, 1), bos_id, dtype=torch.long, device=prefix.x.device)
        text = self._text(model, bos, None)
        seq, span = self._join(model, prefix, text)
        cache = KVCache()
        hidden = model.backbone(seq, cache=cache, span=span)
        logits = model.heads[self.caption_head](hidden[:, -1:], text)[:, -1]  # (B, V)
        if beam_size == 1:
            return self._greedy(model, cache, logits, eos_id, max_new_tokens)
        return self._beam(model, cache, logits, eos_id, max_new_tokens, beam_size, length_penalty)

    def _greedy(self, model, cache: KVCache, logits: Tensor, eos_id, max_new: int) -> list[list[int]]:
        B = logits.shape[0]
        out: list[list[int]] = [[] for _ in range(B)]
        done = torch.zeros(B, dtype=torch.bool, device=logits.device)
        for step in range(max_new):
            nxt = logits.argmax(dim=-1)
            for i, t in enumerate(nxt.tolist()):
                if not done[i] and t != eos_id:
                    out[i].append(t)
            if eos_id is not None:
                done |= nxt == eos_id
            if bool(done.all()) or step == max_new - 1:  # no forward for logits nobody reads
                break
            logits = self._step(model, cache, nxt[:, None], step + 1)
        return out

    def _beam(
        self, model, cache: KVCache, logits: Tensor, eos_id, max_new: int, K: int, length_penalty: float
    ) -> list[list[int]]:
        B, V = logits.shape
        dev = logits.device
        norm = lambda score, n: score / max(n, 1) ** length_penalty
        cache.reorder(torch.arange(B, device=dev).repeat_interleave(K))
        logp = logits.float().log_softmax(-1).repeat_interleave(K, 0)  # (B·K, V)
        scores = torch.full((B, K), -torch.inf, device=dev)
        scores[:, 0] = 0.0  # K identical beams: only the first expands at the first step
        seqs: list[list[list[int]]] = [[[] for _ in range(K)] for _ in range(B)]
        finished: list[list[tuple[float, list[int]]]] = [[] for _ in range(B)]
        done = [False] * B
        for step in range(max_new):
            cand = (scores.unsqueeze(-1) + logp.view(B, K, V)).view(B, K * V)
            top_s, top_i = cand.topk(min(2 * K, K * V), dim=-1)
            parents = torch.zeros(B, K, dtype=torch.long)
            tokens = torch.full((B, K), eos_id if eos_id is not None else 0, dtype=torch.long)
            new_scores = torch.full((B, K), -torch.inf)
            new_seqs: list[list[list[int]]] = [[[] for _ in range(K)] for _ in range(B)]
            for b in range(B):
                if done[b]:
                    continue
                n = 0
                for rank, (s, i) in enumerate(zip(top_s[b].tolist(), top_i[b].tolist())):
                    if s == -torch.inf:
                        break
                    parent, tok = divmod(i, V)
                    if tok == eos_id:
                        if rank < K:  # a hypothesis that would have been among the K kept
                            finished[b].append((norm(s, step + 1), seqs[b][parent]))
                        continue
                    parents[b, n], tokens[b, n], new_scores[b, n] = parent, tok, s
                    new_seqs[b][n] = seqs[b][parent] + [tok]
                    n += 1
                    if n == K:
                        break
                finished[b] = sorted(finished[b], key=lambda f: -f[0])[:K]
                if n == 0 or (
                    len(finished[b]) >= K and norm(float(new_scores[b, 0]), step + 1) <= finished[b][-1][0]
                ):
                    done[b] = True
            seqs, scores = new_seqs, new_scores.to(dev)
            if all(done) or step == max_new - 1:
                break
            index = (torch.arange(B).unsqueeze(1) * K + parents).view(-1).to(dev)
            cache.reorder(index)
            logp = self._step(model, cache, tokens.view(-1, 1).to(dev), step + 1).float().log_softmax(-1)
        out = []
        for b in range(B):
            pool = list(finished[b])
            if not done[b]:  # out of steps: the live hypotheses end here
                length = len(seqs[b][0])
                pool += [
                    (norm(float(scores[b, k]), length), seqs[b][k])
                    for k in range(K)
                    if scores[b, k] > -torch.inf
                ]
            out.append(max(pool, key=lambda f: f[0])[1] if pool else [])
        return out
