"""Prompt-lookup decoding (``generate(prompt_lookup_num_tokens=…)``, ``mmformer.models.prompt_lookup``)
against greedy decoding and transformers' own prompt lookup, on the real SmolLM2-135M-Instruct.

    python bench/prompt_lookup.py --threads 1                  # every workload, batch 1 and 4
    python bench/prompt_lookup.py --only typos,open --pairs 3   # some workloads
    python bench/prompt_lookup.py --quick                       # 16 new tokens, 1 round: checks the script
    python bench/prompt_lookup.py --compile --n-draft 3         # mmformer's sides with the compiled blocks

Each workload is one chat prompt whose answer copies its input to a varying degree (fixing the spelling of a
passage, rewriting a function, renaming a variable) or not at all (a poem), decoded greedily to ``eos`` or
``--new-tokens``. Per workload, batch 1, timed round-robin (each side twice in a row, the second call timed,
so a switch's re-packing of weights is not counted): mmformer's prompt lookup with its defaults (drafts of up
to 10 ids after 2–4-gram matches, of the length with the most ids expected per second), mmformer's greedy
decoding, transformers' greedy ``generate`` and transformers' ``generate(prompt_lookup_num_tokens=10)``
(1–2-gram matches, fixed length). Batch 4 (the four copying prompts left-padded together): mmformer's prompt
lookup and greedy decoding, transformers' greedy ``generate`` (its prompt lookup refuses a batch). Every
side's ids are checked against mmformer's greedy ones. ``--compile``: both mmformer sides decode with the
compiled (``cached``) blocks, whose prompt-lookup forwards are all over 1 or ``1 + n_draft`` positions per
row (``fixed_width``); the first calls, which compile (or load from the on-disk cache), are timed apart.
Ratios are other / mmformer's prompt lookup (> 1: prompt lookup is faster), median and IQR over the
rounds. Numbers go to ``bench/README.md``; nothing here is a test.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from functools import partial
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # peers.py beside this file
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
from peers import Settings, paired_multi, smollm2  # noqa: E402

from mmformer.models.generate import generate  # noqa: E402

PASSAGE = (
    "In the begining God created the heaven and the earth. And the earth was without form, and void; and "
    "darknes was upon the face of the deep. And the Spirit of God moved upon the face of the watters. And "
    "God said, Let there be light: and there was light."
)
FUNCTION = """def moving_average(values, window):
    if window <= 0:
        raise ValueError("window must be positive")
    out = []
    total = 0.0
    for i, v in enumerate(values):
        total += v
        if i >= window:
            total -= values[i - window]
        if i >= window - 1:
            out.append(total / window)
    return out
"""
WORKLOADS = {
    "typos": f"Fix the spelling mistakes in this text and return the corrected text:\n\n{PASSAGE}",
    "rename": "Rename the variable `total` to `running_sum` in this Python function and return the whole "
    f"function:\n\n```python\n{FUNCTION}```",
    "docstring": f"Add type hints and a docstring to this Python function:\n\n```python\n{FUNCTION}```",
    "quote": f"{PASSAGE}\n\nQuote the sentences of this passage that mention light.",
    "open": "Write a short poem about the sea.",
}
COPYING = ("typos", "rename", "docstring", "quote")


def first_difference(a: list[int], b: list[int]) -> int | None:
    """The first index where ``a`` and ``b`` differ (a length included), None when equal."""
    if a == b:
        return None
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def chat_ids(tok, text: str) -> list[int]:
    """``text`` as one user turn of the tokenizer's chat template, encoded."""
    return tok.encode(tok.apply_chat_template([{"role": "user", "content": text}]))


def hf_generate(ref, ids, valid, new: int, eos: int, **kwargs) -> list[list[int]]:
    """transformers' greedy ``generate`` of left-padded ``ids, valid``: each row's new ids before eos."""
    with torch.no_grad():
        out = ref.generate(
            input_ids=ids.masked_fill(~valid, eos), attention_mask=valid.long(), max_new_tokens=new,
            do_sample=False, eos_token_id=eos, pad_token_id=eos, **kwargs,
        )  # fmt: skip
    rows = out[:, ids.shape[1] :].tolist()
    return [r[: r.index(eos)] if eos in r else r for r in rows]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--only", default=",".join(WORKLOADS), help=f"comma-separated of {', '.join(WORKLOADS)}")
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--pairs", type=int, default=3, help="timed rounds")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--n-draft", type=int, default=10, help="prompt_lookup_num_tokens, both sides")
    p.add_argument("--no-batch", action="store_true", help="skip batch 4")
    p.add_argument("--compile", action="store_true", help="mmformer's sides with generate(compile=True)")
    p.add_argument("--quick", action="store_true")
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    new, pairs = (16, 1) if a.quick else (a.new_tokens, a.pairs)
    s = Settings(quick=a.quick, pairs=pairs, warmup=1, optimizer="-", block=2)
    m = smollm2()
    ours, ref, tok = m["ours"].eval(), m["ref"].eval(), m["tokenizer"]
    eos = tok.eos_id
    print(
        f"torch {torch.__version__}, {torch.get_num_threads()} thread(s), fp32, up to {new} new tokens, greedy"
    )

    def mm(ids, valid, lookup: int | None, stats=None):
        return generate(
            ours,
            "text",
            "lm",
            ids,
            valid,
            new,
            eos_id=eos,
            prompt_lookup_num_tokens=lookup,
            stats=stats,
            compile=a.compile,
        )

    def hf(ids, valid, lookup: int | None):
        kwargs = {"prompt_lookup_num_tokens": lookup} if lookup else {}
        return hf_generate(ref, ids, valid, new, eos, **kwargs)

    def timed_first(call, *args):  # a first call, which may compile: its time is said, never in the ratios
        t0 = time.perf_counter()
        out = call(*args)
        print(f"  first call ({'prompt lookup' if args[2] else 'greedy'}): {time.perf_counter() - t0:.1f} s")
        return out

    rows = []
    for name in a.only.split(","):
        ids = torch.tensor([chat_ids(tok, WORKLOADS[name])])
        valid = torch.ones_like(ids, dtype=torch.bool)
        stats: dict = {}
        want = timed_first(mm, ids, valid, None)
        got = timed_first(mm, ids, valid, a.n_draft, stats)
        n_new = len(want[0])
        print(
            f"\n[{name}] batch 1, prompt {ids.shape[1]} tokens, {n_new} new; mmformer prompt lookup: "
            f"{stats['forwards']} forwards after the prompt (greedy: {n_new - 1}), "
            f"{stats['accepted']}/{stats['drafted']} drafted ids kept",
            flush=True,
        )
        sides = {
            "mmformer greedy": partial(mm, ids, valid, None),
            "HF greedy": partial(hf, ids, valid, None),
            "HF prompt lookup": partial(hf, ids, valid, a.n_draft),
        }
        same = {"mmformer prompt lookup": first_difference(got[0], want[0])}
        same.update({label: first_difference(call()[0], want[0]) for label, call in sides.items()})
        print(
            "  ids vs mmformer greedy: "
            + ", ".join(f"{k} {'identical' if v is None else f'differ at {v}'}" for k, v in same.items())
        )
        results, _ = paired_multi(
            f"{name} b1", partial(mm, ids, valid, a.n_draft), list(sides.items()), n_new, "new tokens/s", s,
            mm_label="mm lookup",
        )  # fmt: skip
        rows.append((name, 1, n_new, stats, results))

    if not a.no_batch and not a.quick:
        seqs = [chat_ids(tok, WORKLOADS[n]) for n in COPYING]
        ids, valid = tok.pad_batch(seqs, side="left")
        stats = {}
        want = timed_first(mm, ids, valid, None)
        got = timed_first(mm, ids, valid, a.n_draft, stats)
        peer = hf(ids, valid, None)
        n_new = sum(map(len, want))
        print(
            f"\n[batch 4: {', '.join(COPYING)}] prompts {[len(q) for q in seqs]} tokens, {[len(w) for w in want]} "
            f"new; mmformer prompt lookup: {stats['forwards']} forwards, {stats['accepted']}/{stats['drafted']} "
            f"drafted ids kept; ids identical: prompt lookup {got == want}, HF greedy {peer == want}",
            flush=True,
        )
        sides = {"mmformer greedy": partial(mm, ids, valid, None), "HF greedy": partial(hf, ids, valid, None)}
        results, _ = paired_multi(
            "copying b4", partial(mm, ids, valid, a.n_draft), list(sides.items()), n_new, "new tokens/s", s,
            mm_label="mm lookup",
        )  # fmt: skip
        rows.append(("4 copying prompts", 4, n_new, stats, results))

    print("\n| workload | batch | new ids | forwards | kept / drafted | " + " | ".join(
        f"{r.peer} / mm lookup (IQR)" for r in rows[0][4]) + " |")  # fmt: skip
    for name, batch, n_new, st, results in rows:
        ratios = {r.peer: f"**{r.ratio:.2f}** ({r.q1:.2f}–{r.q3:.2f})" for r in results}
        cells = [ratios.get(r.peer, "–") for r in rows[0][4]]
        print(
            f"| {name} | {batch} | {n_new} | {st['forwards']} | {st['accepted']} / {st['drafted']} | "
            + " | ".join(cells) + " |"
        )  # fmt: skip
    lookup_s = statistics.median(r[4][0].mm_s for r in rows)
    print(f"\n(median mmformer prompt-lookup call: {lookup_s:.2f} s)")


if __name__ == "__main__":
    t0 = time.perf_counter()
    main()
    print(f"total {time.perf_counter() - t0:.0f} s")
