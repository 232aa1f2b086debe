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

Rows of a batch verify in one forward (a row without a draft, or a shorter one, is padded with ids
that are never kept) and each advances by its own kept run: the KV cache keeps the longest, and in
the other rows the positions after theirs become padding (``KVCache.pad_tail``), which later queries
mask as they mask left padding, while positions count each row's real tokens. transformers' prompt
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

    ``verify(ids (B, 1 + K) long) → logits (B, 1 + K, V)`` runs the model over each row's last generated
    token and its draft (padded to the longest, K), appending them to ``cache`` at positions that count
    each row's real tokens (``cache.valid``); then the positions after the longest kept run are dropped
    (``KVCache.truncate``) and, in a row that kept fewer, its rejected ones become padding
    (``KVCache.pad_tail``), so every row advances by its own kept run. ``texts``: each row's real prompt
    ids (no padding), extended in place with what is generated — the drafts are looked up there.
    ``n_draft``: at most this many ids drafted per step (transformers' ``prompt_lookup_num_tokens``);
    ``max_ngram`` / ``min_ngram``: the longest and shortest n-gram matched (``draft``). ``bar``: a
    progress bar (``update(n)``) told of the longest row's new ids. ``stats``, when given, is filled with
    ``forwards`` (passes after the prompt), ``drafted`` and ``accepted`` (draft ids verified and kept,
    summed over rows). No forward runs for logits nobody reads, and a row's draft never reaches past its
    ``max_new_tokens``. ``max_new_tokens`` must be >= 1 (the caller checks)."""
    B = logits.shape[0]
    out: list[list[int]] = [[] for _ in range(B)]
    done = [False] * B
    produced = [0] * B  # new ids per row so far
    allowed = [n_draft] * B  # the draft length each row's last verification earned
    counts = {"forwards": 0, "drafted": 0, "accepted": 0}

    def emit(i: int, tok: int) -> None:
        produced[i] += 1
        if tok == eos_id:
            done[i] = True
            return
        out[i].append(tok)
        texts[i].append(tok)
        done[i] = produced[i] == max_new_tokens

    def tell(before: int) -> None:  # the progress bar follows the longest row
        if bar is not None and max(produced) > before:
            bar.update(max(produced) - before)

    nxt = logits.argmax(dim=-1).tolist()  # each row's next id, not yet fed
    for i, tok in enumerate(nxt):
        emit(i, tok)
    tell(0)
    while not all(done):
        # one forward yields at most K + 1 ids: a draft stays within what its row has left to generate
        rooms = [0 if done[i] else min(allowed[i], max_new_tokens - produced[i] - 1) for i in range(B)]
        drafts = [
            draft(texts[i], room, max_ngram, min_ngram) if room > 0 else [] for i, room in enumerate(rooms)
        ]
        K = max(map(len, drafts))
        chunk = torch.zeros(B, 1 + K, dtype=torch.long)
        chunk[:, 0] = torch.tensor(nxt)
        for i, d in enumerate(drafts):
            if d:
                chunk[i, 1 : 1 + len(d)] = torch.tensor(d)
        before = cache.length
        pred = verify(chunk.to(logits.device)).argmax(dim=-1).cpu()  # (B, 1 + K): the choice after each id
        counts["forwards"] += 1
        # each row's kept run: its drafted ids equal to the model's choice before them
        agree = (pred[:, :K] == chunk[:, 1:]).long().cumprod(dim=1).sum(dim=1).tolist() if K else [0] * B
        kept = [min(a, len(d)) for a, d in zip(agree, drafts)]
        counts["drafted"] += sum(map(len, drafts))
        counts["accepted"] += sum(kept)
        for i, d in enumerate(drafts):  # longer after a draft kept whole, the kept run + 1 after a rejection
            if d:
                full = kept[i] == len(d)
                allowed[i] = min(n_draft, allowed[i] + 2) if full else max(min(2, n_draft), kept[i] + 1)
        live = [not ended for ended in done]  # the rows this forward decoded for
        longest = max(k for k, alive in zip(kept, live) if alive)
        pred = pred.tolist()
        most = max(produced)
        for i in range(B):
            if done[i]:
                continue
            for j in range(kept[i] + 1):  # the kept drafts, then the model's next choice
                emit(i, pred[i][j])
                if done[i]:
                    break
            nxt[i] = pred[i][kept[i]]
        tell(most)
        if all(done):
            break
        cache.truncate(before + 1 + longest)  # each fed token and the longest kept run stay cached
        if any(k != longest for k, alive in zip(kept, live) if alive):
            keep = [1 + (k if alive else longest) for k, alive in zip(kept, live)]
            cache.pad_tail(before, torch.tensor(keep, device=logits.device))
    if stats is not None:
        stats.update(counts)
    return out
