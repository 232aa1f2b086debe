"""An LM head's loss chunked (``mmformer.nn.linear_cross_entropy``) against ``F.cross_entropy`` of the full
logits: time and peak memory of the loss's forward + backward, per number of rows.

    python bench/lm_loss.py                                   # GPT-2 small's head, 1 thread
    python bench/lm_loss.py --vocab 49152 --d-model 576 --rows 2048,8192   # SmolLM2-135M's

For ``rows`` hidden states ``(rows, d_model)`` and a ``(vocab, d_model)`` weight: the loss, the hidden
states' and the weight's gradients, timed alternately (full logits, chunked, full, …) after a warm-up;
printed: each side's median and the median / IQR of the per-round ratio full / chunked (> 1: chunked
faster). Peak memory: each variant in its own process, the resident high-water mark above the one before
the loss (Linux ``/proc/self/clear_refs``; glibc told to return freed tensors,
``MALLOC_MMAP_THRESHOLD_``), in MB. Uses the model library only; nothing here is a test.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from mmformer.nn.linear_cross_entropy import linear_cross_entropy


def inputs(rows: int, vocab: int, d_model: int):
    g = torch.Generator().manual_seed(0)
    h = torch.randn(rows, d_model, generator=g, requires_grad=True)
    w = (0.02 * torch.randn(vocab, d_model, generator=g)).requires_grad_()
    t = torch.randint(0, vocab, (rows,), generator=g)
    return h, w, t


def full(h, w, t):
    return F.cross_entropy(F.linear(h, w).float(), t)


def chunked(h, w, t, chunk_rows=1024):
    return linear_cross_entropy(h, w, t, chunk_rows=chunk_rows)


def step(loss_fn, h, w, t) -> float:
    start = time.perf_counter()
    torch.autograd.grad(loss_fn(h, w, t), (h, w))
    return time.perf_counter() - start


def vm_kb(key: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key):
            return int(line.split()[1])
    raise KeyError(key)


def peak_child(variant: str, rows: int, vocab: int, d_model: int, chunk_rows: int) -> None:
    """In a child process: one loss forward + backward, printing the peak resident MB above the start."""
    h, w, t = inputs(rows, vocab, d_model)
    fn = full if variant == "full" else lambda *a: chunked(*a, chunk_rows=chunk_rows)
    step(fn, *inputs(8, vocab, d_model))  # warm-up: libraries' workspaces are nobody's peak
    Path("/proc/self/clear_refs").write_text("5")  # reset VmHWM to the current resident size
    base = vm_kb("VmRSS:")
    step(fn, h, w, t)
    print((vm_kb("VmHWM:") - base) / 1024)


def peak_mb(variant: str, rows: int, a) -> float:
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="131072", OMP_NUM_THREADS=str(a.threads))
    args = [sys.executable, __file__, "--child", variant, "--rows", str(rows), "--vocab", str(a.vocab)]
    args += ["--d-model", str(a.d_model), "--chunk-rows", str(a.chunk_rows)]
    done = subprocess.run(args, env=env, capture_output=True, text=True, check=True)
    return float(done.stdout.split()[-1])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--vocab", type=int, default=50257)
    p.add_argument("--d-model", type=int, default=768)
    p.add_argument("--rows", default="256,1024,4096")
    p.add_argument("--chunk-rows", type=int, default=1024)
    p.add_argument("--rounds", type=int, default=6)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    if a.child:
        peak_child(a.child, int(a.rows), a.vocab, a.d_model, a.chunk_rows)
        return
    print(f"vocab {a.vocab}, d_model {a.d_model}, chunks of {a.chunk_rows} rows, {a.threads} thread(s)")
    print("rows  | full logits | chunked   | full / chunked (IQR)  | peak MB full | chunked")
    for rows in map(int, a.rows.split(",")):
        h, w, t = inputs(rows, a.vocab, a.d_model)
        fn = lambda *x: chunked(*x, chunk_rows=a.chunk_rows)  # noqa: E731
        torch.testing.assert_close(fn(h, w, t), full(h, w, t), rtol=1e-5, atol=1e-5)
        step(full, h, w, t), step(fn, h, w, t)  # warm-up
        pairs = [(step(full, h, w, t), step(fn, h, w, t)) for _ in range(a.rounds)]
        ratios = sorted(f / c for f, c in pairs)
        q = statistics.quantiles(ratios, n=4) if len(ratios) > 1 else [ratios[0]] * 3
        f_ms, c_ms = (1e3 * statistics.median(x) for x in zip(*pairs))
        mem = [peak_mb(v, rows, a) for v in ("full", "chunked")]
        print(
            f"{rows:5d} | {f_ms:8.1f} ms | {c_ms:6.1f} ms | {statistics.median(ratios):.2f} "
            f"({q[0]:.2f}–{q[2]:.2f})      | {mem[0]:8.0f}     | {mem[1]:.0f}",
            flush=True,
        )


if __name__ == "__main__":
    main()
