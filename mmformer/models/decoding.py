"""Greedy and beam-search decoding over a KV cache, shared by the prefix-LM and the encoder–decoder.

A model plugs in through ``step(ids (B', 1) long, t) → logits (B', V)``: feed the token generated at
step ``t - 1`` (``t`` counts generated tokens from 1; its text position is the prompt length plus
``t - 1``), appending it to the KV cache, and return the next-token logits. Both decoders start from
the logits of the prefilled prompt; ``B'`` is B for greedy and B·K for beam search.

Beam search keeps ``beam_size`` live hypotheses per row; a hypothesis ending in ``eos`` among the best
``beam_size`` candidates of a step is finished with score ``sum log p / length ** length_penalty``
(length = generated tokens, ``eos`` included; Wu et al. 2016 use a similar normalisation); a row stops
once it has ``beam_size`` finished hypotheses and its best live one, normalised at its current length,
cannot beat the worst of them (exact for ``length_penalty = 0``, as Hugging Face's
``early_stopping=False``); at ``max_new_tokens`` the live hypotheses are finished as they are.

Token suppression (Whisper's decoding rules, Radford et al. 2022 §4.5 / CTranslate2's
``suppress_tokens`` and ``suppress_blank``): ``suppress`` ids are never generated; ``suppress_begin`` ids
are not generated as the first token. Suppressed logits are set to ``-inf`` before the argmax / the
log-softmax.

Shape legend: B batch, K beam size, V vocabulary.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import Tensor

from ..nn.kv_cache import KVCache
from ..nn.tokens import Tokens

Step = Callable[[Tensor, int], Tensor]


def text_tokens(embedding, ids: Tensor, valid: Tensor | None, start: int = 0) -> Tokens:
    """``ids (B, L)`` through a ``TextEmbedding`` with positions counting from ``start`` (the text's first
    token is position 0; a token decoded after ``start`` cached ones is position ``start``)."""
    pos = None
    if start:
        pos = start + torch.arange(ids.shape[1], device=ids.device).view(1, -1, 1)
        pos = pos.expand(*ids.shape, embedding.n_pos_axes)
    return embedding(ids, valid=valid, positions=pos)


def _suppressor(ids: Sequence[int], vocab: int, device) -> Tensor | None:
    if not ids:
        return None
    mask = torch.zeros(vocab, dtype=torch.bool, device=device)
    mask[torch.tensor([i for i in ids if 0 <= i < vocab], dtype=torch.long, device=device)] = True
    return mask


def _apply(logits: Tensor, *masks: Tensor | None) -> Tensor:
    for mask in masks:
        if mask is not None:
            logits = logits.masked_fill(mask, float("-inf"))
    return logits


def greedy(
    step: Step,
    logits: Tensor,
    eos_id: int | None,
    max_new_tokens: int,
    suppress: Sequence[int] = (),
    suppress_begin: Sequence[int] = (),
    fixed_steps: bool = False,
) -> list[list[int]]:
    """Greedy decoding from the prompt's next-token ``logits (B, V)``: the new ids per row, without
    ``eos``. No forward is run for logits nobody reads (after the last step or, unless ``fixed_steps``,
    when every row ended). ``fixed_steps``: always ``max_new_tokens - 1`` forwards, whatever the text —
    what a sharded (FSDP2) model needs, whose every forward all ranks must join. ``max_new_tokens`` must
    be >= 1 (the callers check)."""
    B, V = logits.shape
    always, first = _suppressor(suppress, V, logits.device), _suppressor(suppress_begin, V, logits.device)
    out: list[list[int]] = [[] for _ in range(B)]
    done = torch.zeros(B, dtype=torch.bool, device=logits.device)
    for t in range(max_new_tokens):
        nxt = _apply(logits, always, first if t == 0 else None).argmax(dim=-1)
        for i, (tok, ended) in enumerate(zip(nxt.tolist(), done.tolist())):
            if not ended and tok != eos_id:
                out[i].append(tok)
        if eos_id is not None:
            done |= nxt == eos_id
        if (bool(done.all()) and not fixed_steps) or t == max_new_tokens - 1:
            break
        logits = step(nxt[:, None], t + 1)
    return out


def beam_search(
    step: Step,
    cache: KVCache,
    logits: Tensor,
    eos_id: int | None,
    max_new_tokens: int,
    beam_size: int,
    length_penalty: float = 1.0,
    suppress: Sequence[int] = (),
    suppress_begin: Sequence[int] = (),
    fixed_steps: bool = False,
) -> list[list[int]]:
    """Beam search from the prompt's next-token ``logits (B, V)`` (``cache`` holds B rows and is expanded
    to B·K, row ``b·K + k`` being beam ``k`` of source ``b``); the best finished hypothesis per row,
    without ``eos``. ``fixed_steps`` as in ``greedy`` (rows that ended are carried along, unchanged).
    ``max_new_tokens`` and ``beam_size`` must be >= 1 (the callers check)."""
    B, V = logits.shape
    K, dev = beam_size, logits.device
    always, first = _suppressor(suppress, V, dev), _suppressor(suppress_begin, V, dev)
    norm = lambda score, n: score / max(n, 1) ** length_penalty  # noqa: E731
    cache.reorder(torch.arange(B, device=dev).repeat_interleave(K))
    logp = _apply(logits.float(), always, first).log_softmax(-1).repeat_interleave(K, 0)  # (B·K, V)
    scores = torch.full((B, K), -torch.inf, device=dev)
    scores[:, 0] = 0.0  # K identical beams: only the first expands at the first step
    seqs: list[list[list[int]]] = [[[] for _ in range(K)] for _ in range(B)]
    finished: list[list[tuple[float, list[int]]]] = [[] for _ in range(B)]
    done = [False] * B
    for t in range(max_new_tokens):
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
                        finished[b].append((norm(s, t + 1), seqs[b][parent]))
                    continue
                parents[b, n], tokens[b, n], new_scores[b, n] = parent, tok, s
                new_seqs[b][n] = seqs[b][parent] + [tok]
                n += 1
                if n == K:
                    break
            finished[b] = sorted(finished[b], key=lambda f: -f[0])[:K]
            if n == 0 or (
                len(finished[b]) >= K and norm(float(new_scores[b, 0]), t + 1) <= finished[b][-1][0]
            ):
                done[b] = True
        seqs, scores = new_seqs, new_scores.to(dev)
        if (all(done) and not fixed_steps) or t == max_new_tokens - 1:
            break
        # a beam's parent is a beam of the same source: the cross-attention keys/values stay in place
        cache.reorder((torch.arange(B).unsqueeze(1) * K + parents).view(-1).to(dev), cross=False)
        logp = _apply(step(tokens.view(-1, 1).to(dev), t + 1).float(), always).log_softmax(-1)
    out = []
    for b in range(B):
        pool = list(finished[b])
        if not done[b]:  # out of steps: the live hypotheses end here
            length = len(seqs[b][0])
            pool += [
                (norm(float(scores[b, k]), length), seqs[b][k]) for k in range(K) if scores[b, k] > -torch.inf
            ]
        out.append(max(pool, key=lambda f: f[0])[1] if pool else [])
    return out
