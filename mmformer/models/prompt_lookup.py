"""Prompt-lookup decoding (Saxena 2023, github.com/apoorvumang/prompt-lookup-decoding; transformers'
``generate(prompt_lookup_num_tokens=…)``, vLLM's n-gram speculator): speculative decoding whose draft is
copied from the text itself. The ids that followed the earliest earlier occurrence of the text's last
n-gram are proposed as the next tokens; one forward over the last token and the draft scores every
proposed position at once, and the longest prefix of the draft that equals the model's own greedy choices
is kept, plus the model's choice after it. The ids are greedy decoding's (each kept id *is* the argmax
at its position, up to the rounding of a forward over several positions); what changes is how many
forward passes produce them: one per kept run instead of one per token. That pays where the output
repeats its input or itself (edits of a given text or code, quotes, extraction, the loops of small
models) and costs where it does not: a forward over 1 + K positions costs more than over one — on the
CPU ~1.2× for 2 positions and ~1.9× for 11 with oneDNN-packed weights (``bench/README.md``, "Prompt
lookup"), on a GPU nearly nothing.

Two choices keep the cost of rejected drafts down (both differ from transformers' defaults, whose drafts
are all ``prompt_lookup_num_tokens`` long and may come from a single matching id): n-grams of
``min_ngram``–``max_ngram`` ids (a lone matching id rarely predicts the next ones: with SmolLM2-135M a
draft from a 1-gram kept 0.3–0.7 ids on average, from a 4-gram 5–8), and a draft length that adapts as
transformers' schedule for assistant models does: two longer after a draft kept whole, the kept run + 1
after a rejection (at least 2, at most ``n_draft``).

Rows of a batch advance together: a step keeps the shortest accepted run of the rows still decoding
(each row's KV cache holds the same number of positions). A row without a draft pads its chunk with any
ids: a padded id that equals the model's choice is as correct as a drafted one. transformers' prompt
lookup decodes one row at a time (assisted decoding refuses a batch).

Shape legend: B batch, K draft length, V vocabulary.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import Tensor

from ..nn.kv_cache import KVCache


def draft(ids: Sequence[int], n_draft: int, max_ngram: int = 2, min_ngram: int = 1) -> list[int]:
    """Up to ``n_draft`` ids copied from ``ids`` itself: for n from ``max_ngram`` down to ``min_ngram``,
    the ids that follow the earliest earlier occurrence of the last n ids (the longest n with a
    continuation wins); ``[]`` when none occurs. With ``min_ngram=1`` it is transformers'
    ``PromptLookupCandidateGenerator`` (without logits processors). Raises ``ValueError`` for
    ``n_draft < 1`` or not ``1 <= min_ngram <= max_ngram``."""
    if n_draft < 1 or not 1 <= min_ngram <= max_ngram:
        raise ValueError(
            f"need n_draft >= 1 and 1 <= min_ngram <= max_ngram, got {n_draft}, {min_ngram}, {max_ngram}"
        )
    ids = list(ids)
    total = len(ids)
    for n in range(min(max_ngram, total - 1), min_ngram - 1, -1):
        tail = ids[-n:]
        first = tail[0]
        for start in range(total - n):  # an occurrence ending before the text's end has a continuation
            if ids[start] == first and ids[start : start + n] == tail:
                return ids[start + n : start + n + n_draft]
    return []


def prompt_lookup_greedy(
    verify: Callable[[Tensor], Tensor],
    cache: KVCache,
    logits: Tensor,
    texts: list[list[int]],
    max_new_tokens: int,
    eos_id: int | None = None,
    n_draft: int = 10,
    max_ngram: int = 4,
    min_ngram: int = 2,
    stats: dict | None = None,
    bar=None,
) -> list[list[int]]:
    """Greedy decoding from the prompt's next-token ``logits (B, V)`` with prompt-lookup drafts; returns
    each row's new ids, up to and excluding ``eos``, as greedy decoding does.

    ``verify(ids (B, 1 + K) long) → logits (B, 1 + K, V)`` runs the model over the last generated token
    and K drafted ones, appending them to ``cache``; the positions of rejected drafts are then dropped
    (``KVCache.truncate``). ``texts``: each row's real prompt ids (no padding), extended in place with
    what is generated — the drafts are looked up there. ``n_draft``: at most this many ids drafted per
    step (transformers' ``prompt_lookup_num_tokens``); ``max_ngram`` / ``min_ngram``: the longest and
    shortest n-gram matched (``draft``). ``bar``: a progress bar (``update(n)``) told of each new id.
    ``stats``, when given, is filled with ``forwards`` (passes after the
    prompt), ``drafted`` and ``accepted`` (draft ids verified and kept, summed over rows). No forward runs
    for logits nobody reads; a draft never reaches past ``max_new_tokens``, so no position beyond plain
    greedy decoding's last is written. ``max_new_tokens`` must be >= 1 (the caller checks)."""
    B = logits.shape[0]
    out: list[list[int]] = [[] for _ in range(B)]
    done = [False] * B
    counts = {"forwards": 0, "drafted": 0, "accepted": 0}
    produced = 0  # new ids per row so far: every row advances by the same number
    allowed = n_draft  # the draft length the last verification earned

    def emit(tokens: list[int]) -> None:
        nonlocal produced
        produced += 1
        if bar is not None:
            bar.update(1)
        for i, tok in enumerate(tokens):
            if done[i]:
                continue
            if tok == eos_id:
                done[i] = True
            else:
                out[i].append(tok)
                texts[i].append(tok)

    nxt = logits.argmax(dim=-1)  # (B,)
    while True:
        emit(nxt.tolist())
        left = max_new_tokens - produced
        if all(done) or left == 0:
            break
        # one forward yields at most K + 1 ids: the draft stays within what is left to generate
        room = min(allowed, left - 1)
        drafts = [
            [] if done[i] or room == 0 else draft(texts[i], room, max_ngram, min_ngram) for i in range(B)
        ]
        K = max(map(len, drafts), default=0)
        chunk = nxt.new_zeros(B, 1 + K)
        chunk[:, 0] = nxt
        for i, d in enumerate(drafts):
            if d:
                chunk[i, 1 : 1 + len(d)] = torch.tensor(d)
        before = cache.length
        pred = verify(chunk).argmax(dim=-1)  # (B, 1 + K): the model's choice after each fed id
        counts["forwards"] += 1
        # the kept run: drafted ids equal to the model's choice before them, the same length in every row
        agree = pred[:, :K] == chunk[:, 1:]
        agree[torch.tensor(done, device=agree.device)] = True
        kept = int(agree.long().cumprod(dim=1).sum(dim=1).min()) if K else 0
        if K:  # longer after a draft kept whole, the kept run + 1 after a rejection (never below 2)
            allowed = min(n_draft, allowed + 2) if kept == K else max(min(2, n_draft), kept + 1)
        counts["drafted"] += sum(len(d) for d in drafts)
        counts["accepted"] += sum(min(kept, len(d)) for d in drafts)
        for j in range(kept):
            emit(pred[:, j].tolist())
            if all(done):
                break
        if all(done):
            break
        cache.truncate(before + 1 + kept)  # the fed token and the kept drafts stay cached
        nxt = pred[:, kept]
    if stats is not None:
        stats.update(counts)
    return out
