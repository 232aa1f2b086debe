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

What a draft costs decides its length. Drafts come after matches of ``min_ngram``–``max_ngram`` ids
(transformers' defaults draft after a single matching id, which rarely predicts the next ones: with
SmolLM2-135M a draft from a 1-gram kept 0.3–0.7 ids on average, from a 4-gram 5–8), and at every step
the draft length K is the one with the most ids expected per second: a row is expected to keep the mean
of ``min(kept, K)`` over its last ``HISTORY`` drafts — each scored against what the row then generated,
whether it was verified or not, so a row whose drafts were cut off still learns when copying starts to
pay; a row with no scored draft yet borrows the other live rows' runs, and with none at all expects its
whole draft kept, so drafting is tried before it is judged — and a forward over 1 + K positions per
row costs what this call's forwards measured (``ForwardCost``). In a batch every row pays for the
longest draft, so the length is the one at which the slowest row advances fastest (``draft_length``):
on a CPU a row without a draft then keeps the others' drafts short; on a GPU, where the extra positions
cost nearly nothing, they stay long. Since the length follows measured times, two identical calls may
verify different drafts and count different forwards; the ids are greedy decoding's either way.

Rows of a batch verify in one forward (a row without a draft, or a shorter one, is padded with ids
that are never kept) and each advances by its own kept run: the KV cache keeps the longest, and in
the other rows the positions after theirs become padding (``KVCache.pad_tail``), which later queries
mask as they mask left padding, while positions count each row's real tokens. transformers' prompt
lookup decodes one row at a time (assisted decoding refuses a batch).

Shape legend: B batch, K draft length, V vocabulary.
"""

from __future__ import annotations

import statistics
import time
from collections import deque
from collections.abc import Callable, Sequence

import torch
from torch import Tensor

from ..nn.kv_cache import KVCache

HISTORY = 8  # drafts per row whose kept runs predict the next one's
NEAR = 0.97  # draft lengths whose slowest row is this close to the best count as equal (draft_length)


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


class ForwardCost:
    """Seconds of one verification forward against its width ``w`` (1 + K positions per row), learned
    from the forwards of one call: each width's median over its last 5 forwards, not counting its first
    (which may carry a one-off cost: a compile, a new oneDNN primitive), and where two or more widths are
    known, a least-squares line through their medians (slope >= 0) for every width. With one width
    known every width costs what it does (1.0 with none), so a draft is tried before it is judged. A
    width used only early keeps the medians of a shorter context; the line follows the widths in use."""

    def __init__(self) -> None:
        self.seen: dict[int, int] = {}
        self.times: dict[int, deque[float]] = {}
        self._line = (1.0, 1.0, 0.0)  # (mean width, mean seconds, slope): refit when a time is observed

    def observe(self, width: int, seconds: float) -> None:
        self.seen[width] = self.seen.get(width, 0) + 1
        if self.seen[width] > 1:
            self.times.setdefault(width, deque(maxlen=5)).append(seconds)
            self._line = self._fit()

    def _fit(self) -> tuple[float, float, float]:
        known = {w: statistics.median(t) for w, t in self.times.items()}
        if len(known) < 2:
            return (1.0, min(known.values()), 0.0)
        mean_w = sum(known) / len(known)
        mean_t = sum(known.values()) / len(known)
        spread = sum((w - mean_w) ** 2 for w in known)
        slope = max(0.0, sum((w - mean_w) * (t - mean_t) for w, t in known.items()) / spread)
        return (mean_w, mean_t, slope)

    def __call__(self, width: int) -> float:
        mean_w, mean_t, slope = self._line
        return max(mean_t + slope * (width - mean_w), 1e-9)


def kept_run(text: Sequence[int], start: int, proposed: Sequence[int]) -> int | None:
    """How many of the ``proposed`` ids greedy decoding kept, judged by what it generated: the length of
    the common prefix of ``proposed`` and ``text[start:]``, or ``None`` while ``text`` has not yet
    reached a mismatch or the draft's end."""
    seen = text[start : start + len(proposed)]
    miss = next((j for j, (a, b) in enumerate(zip(seen, proposed)) if a != b), None)
    if miss is not None:
        return miss
    return len(proposed) if len(seen) == len(proposed) else None


def draft_length(kept_if: list[list[float]], cost: Callable[[int], float], max_k: int) -> int:
    """The draft length K (0 to ``min(max_k, longest draft)``) for the next forward of the live rows: the
    one at which the slowest row advances fastest, ``min over rows of (1 + kept_if[row][min(K, len - 1)])
    / cost(1 + K)`` ids per second; among the lengths within ``NEAR`` of that best (timing noise), the
    one with the most ids per second summed over rows; then the shorter. ``kept_if[row][k]``: the ids the
    row is expected to keep of its draft cut to ``k`` ids (``kept_if[row][0] == 0``; one entry per
    drafted id beyond it; at least one row). The slowest row decides because a batch is done when its
    last row is: a draft that speeds some rows but slows the others (they carry its positions and gain
    nothing) makes the call no shorter — unless the positions are nearly free (a GPU), when the sum
    decides."""
    longest = min(max(map(len, kept_if)) - 1, max_k)

    def rates(K: int) -> list[float]:
        seconds = max(cost(1 + K), 1e-12)
        return [(1 + row[min(K, len(row) - 1)]) / seconds for row in kept_if]

    each = [rates(K) for K in range(longest + 1)]
    best = max(map(min, each))
    near = [K for K in range(longest + 1) if min(each[K]) >= NEAR * best]
    return max(near, key=lambda K: (sum(each[K]), -K))


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
    cost: Callable[[int], float] | None = None,
    drop_ended: bool = True,
    fixed_width: bool = False,
) -> list[list[int]]:
    """Greedy decoding from the prompt's next-token ``logits (B, V)`` with prompt-lookup drafts; returns
    each row's new ids, up to and excluding ``eos``, as greedy decoding does.

    ``verify(ids (B', W) long) → logits (B', W, V)`` runs the model over the last generated token and the
    draft (padded to the longest, K; W = 1 + K, or ``1 + n_draft`` with ``fixed_width``) of each of the B'
    rows the cache holds, appending them to ``cache`` at positions that count each row's real tokens
    (``cache.valid``); then the positions after the longest kept run are dropped (``KVCache.truncate``) and,
    in a row that kept fewer, its rejected ones become padding (``KVCache.pad_tail``), so every row advances
    by its own kept run. A row that ended (eos or ``max_new_tokens``) leaves the cache (``KVCache.reorder``),
    so the later forwards compute only the rows still decoding (their forward costs timed anew);
    ``drop_ended=False`` keeps every row (a compiled step's graph is built for its batch size).
    ``fixed_width``: every forward with a draft verifies ``1 + n_draft`` positions per row (the drafts padded
    with ids never kept), so a compiled step sees two widths, 1 and ``1 + n_draft``, whatever lengths the
    costs choose (a compiled graph is traced anew for new widths, and torch 2.14 failed now and then building
    such a recompile's guards). ``texts``: each row's real prompt ids (no padding), extended in place with
    what is generated — the drafts are looked up there. ``n_draft``: at most this many ids drafted per step
    (transformers' ``prompt_lookup_num_tokens``); ``max_ngram`` / ``min_ngram``: the longest and shortest
    n-gram matched (``draft``). ``cost(w)``: the seconds of a verification over ``w`` positions per row, which
    with each row's kept runs chooses the draft length (module docstring); ``None`` measures this call's
    forwards (``ForwardCost``). ``bar``: a progress bar (``update(n)``) told of the longest row's new ids.
    ``stats``, when given, is filled with ``forwards`` (passes after the prompt), ``drafted`` and ``accepted``
    (draft ids verified and kept, summed over rows). No forward runs for logits nobody reads, and a row's
    draft never reaches past its ``max_new_tokens``. ``max_new_tokens`` must be >= 1 (the caller checks)."""
    B = logits.shape[0]
    out: list[list[int]] = [[] for _ in range(B)]
    done = [False] * B
    produced = [0] * B  # new ids per row so far
    runs = [deque(maxlen=HISTORY) for _ in range(B)]  # each row's kept runs of its last drafts
    pending: list[list[tuple[int, list[int]]]] = [[] for _ in range(B)]  # drafts not yet scored
    measured = ForwardCost() if cost is None else None
    cost_of = measured if cost is None else cost
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

    def score(i: int) -> None:  # a draft's kept run is known once the row has generated past it
        waiting = []
        for start, d in pending[i]:
            run = kept_run(texts[i], start, d)
            if run is not None:
                runs[i].append(run)
            elif not done[i]:
                waiting.append((start, d))
        pending[i] = waiting

    def expected(i: int, k: int, pooled: list[int]) -> float:  # ids row i should keep of a k-long draft
        history = runs[i] or pooled
        return sum(min(r, k) for r in history) / len(history) if history else k

    nxt = logits.argmax(dim=-1).tolist()  # each row's next id, not yet fed
    for i, tok in enumerate(nxt):
        emit(i, tok)
    tell(0)
    rows = list(range(B))  # the rows the cache holds, in its order
    while not all(done):
        going = [p for p, i in enumerate(rows) if not done[i]]
        if drop_ended and len(going) < len(rows):  # rows that ended leave the batch
            cache.reorder(torch.tensor(going, device=logits.device))
            rows = [rows[p] for p in going]
            if measured is not None:  # a forward over fewer rows costs what it costs: timed anew
                measured = cost_of = ForwardCost()
        alive = [not done[i] for i in rows]  # the rows this forward decodes for
        live = [i for i, a in zip(rows, alive) if a]
        # one forward yields at most K + 1 ids: a draft stays within what its row has left to generate
        drafts: list[list[int]] = []
        for i in rows:
            room = 0 if done[i] else min(n_draft, max_new_tokens - produced[i] - 1)
            drafts.append(draft(texts[i], room, max_ngram, min_ngram) if room > 0 else [])
            if drafts[-1]:
                pending[i].append((len(texts[i]), drafts[-1]))
        pooled = [r for i in live for r in runs[i]]
        kept_if = [
            [expected(i, k, pooled) for k in range(1 + len(d))] for i, d, a in zip(rows, drafts, alive) if a
        ]
        if fixed_width:  # a draft of any length costs a forward over 1 + n_draft positions
            K = draft_length(kept_if, lambda w, c=cost_of: c(1 if w == 1 else 1 + n_draft), n_draft)
        else:  # measured costs: a forward grows at most two positions past the widest one timed so far
            max_k = n_draft if measured is None else max(measured.times, default=1) + 1
            K = draft_length(kept_if, cost_of, max_k)
        drafts = [d[:K] for d in drafts]
        width = 1 + (n_draft if fixed_width and K else K)
        chunk = torch.zeros(len(rows), width, dtype=torch.long)
        chunk[:, 0] = torch.tensor([nxt[i] for i in rows])
        for p, d in enumerate(drafts):
            if d:
                chunk[p, 1 : 1 + len(d)] = torch.tensor(d)
        before = cache.length
        t0 = time.perf_counter()
        pred = verify(chunk.to(logits.device)).argmax(dim=-1).cpu()  # (B', 1 + K): the choice after each id
        if measured is not None:
            measured.observe(width, time.perf_counter() - t0)
        counts["forwards"] += 1
        # each row's kept run: its drafted ids equal to the model's choice before them
        agree = (
            (pred[:, :K] == chunk[:, 1 : 1 + K]).long().cumprod(dim=1).sum(dim=1).tolist()
            if K
            else [0] * len(rows)
        )
        kept = [min(n, len(d)) for n, d in zip(agree, drafts)]
        counts["drafted"] += sum(map(len, drafts))
        counts["accepted"] += sum(kept)
        longest = max(k for k, a in zip(kept, alive) if a)
        pred = pred.tolist()
        most = max(produced)
        for p, i in enumerate(rows):
            if not alive[p]:
                continue
            for j in range(kept[p] + 1):  # the kept drafts, then the model's next choice
                emit(i, pred[p][j])
                if done[i]:
                    break
            nxt[i] = pred[p][kept[p]]
            score(i)
        tell(most)
        if all(done):
            break
        cache.truncate(before + 1 + longest)  # each fed token and the longest kept run stay cached
        if any(k != longest for k, a in zip(kept, alive) if a):
            keep = [1 + (k if a else longest) for k, a in zip(kept, alive)]
            cache.pad_tail(before, torch.tensor(keep, device=logits.device))
    if stats is not None:
        stats.update(counts)
    return out
