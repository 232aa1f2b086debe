"""A linear layer's training products on oneDNN (``mmformer.nn.onednn``) against PyTorch's (MKL), per shape.

    python bench/linears.py                 # the default grid, 1 thread
    python bench/linears.py --threads 2 --rows 256,1024 --shapes 768x2304,768x50257

For each ``rows × in → out`` product: forward, and forward + backward (the input's and the weight's
gradients, plus the bias's), timed alternately (PyTorch, oneDNN, PyTorch, …) after warm-up; printed: each
side's median and the median / IQR of the per-round ratio PyTorch time / oneDNN time (> 1: oneDNN
faster). The default grid holds the products of the models ``bench/peers.py`` trains (GPT-2 small,
SmolLM2-135M, ViT-S/16 and their heads) and the small widths of the test-sized recipes, where the
per-call cost of a oneDNN primitive decides. Uses the model library only.
"""

from __future__ import annotations

import argparse
import statistics
import time
from functools import partial

import torch
import torch.nn.functional as F

from mmformer.nn.onednn import onednn_linear

SHAPES = (
    "64x64,64x256,128x128,128x512,256x256,256x1024,384x1152,384x1536,576x1728,576x3072,768x768,768x2304,"
    "768x3072,3072x768,576x49152,768x50257"
)


def quartiles(xs: list[float]) -> tuple[float, float, float]:
    q1, q2, q3 = statistics.quantiles(xs, n=4, method="inclusive")
    return q1, q2, q3


def _forward(x, w, b, f) -> None:
    with torch.no_grad():
        f(x, w, b)


def _train(x, w, b, dy, f) -> None:
    torch.autograd.backward(f(x, w, b), dy, inputs=[x, w, b])
    x.grad = w.grad = b.grad = None


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", default="16,64,256,1024", help="rows of the input (batch × tokens)")
    p.add_argument("--shapes", default=SHAPES, help="in x out, comma-separated")
    p.add_argument("--rounds", type=int, default=9)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--budget", type=float, default=0.5, help="seconds of timing per side and shape, at least")
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    print(f"torch {torch.__version__}, {a.threads} thread(s); ratio = PyTorch / oneDNN (> 1: oneDNN faster)")
    print(
        f"{'rows':>5} {'in':>5} {'out':>6} | {'fwd aten':>9} {'fwd dnn':>9} {'ratio':>6} | "
        f"{'f+b aten':>9} {'f+b dnn':>9} {'ratio':>6} {'IQR':>11}"
    )
    for rows in (int(r) for r in a.rows.split(",")):
        for shape in a.shapes.split(","):
            k, n = (int(v) for v in shape.split("x"))
            if rows * k * n > 1e10:  # the vocabulary heads at 256 rows at most
                continue
            g = torch.Generator().manual_seed(0)
            x = torch.randn(rows, k, generator=g, requires_grad=True)
            w = (torch.randn(n, k, generator=g) / k**0.5).requires_grad_()
            b = torch.zeros(n, requires_grad=True)
            dy = torch.randn(rows, n, generator=g)

            out = {}
            for kind, call in (("fwd", partial(_forward, x, w, b)), ("train", partial(_train, x, w, b, dy))):
                call(F.linear), call(onednn_linear)
                t0 = time.perf_counter()
                call(F.linear)
                reps = max(1, min(50, int(a.budget / a.rounds / max(time.perf_counter() - t0, 1e-6))))
                times = {F.linear: [], onednn_linear: []}
                for _ in range(a.rounds):
                    for f in (F.linear, onednn_linear):
                        t0 = time.perf_counter()
                        for _ in range(reps):
                            call(f)
                        times[f].append((time.perf_counter() - t0) / reps)
                ratios = [u / v for u, v in zip(times[F.linear], times[onednn_linear])]
                out[kind] = (
                    statistics.median(times[F.linear]),
                    statistics.median(times[onednn_linear]),
                    *quartiles(ratios),
                )
            fa, fd, _, fr, _ = out["fwd"]
            ta, td, q1, tr, q3 = out["train"]
            print(
                f"{rows:5} {k:5} {n:6} | {fa * 1e3:7.3f}ms {fd * 1e3:7.3f}ms {fr:6.2f} | "
                f"{ta * 1e3:7.3f}ms {td * 1e3:7.3f}ms {tr:6.2f} {q1:5.2f}–{q3:4.2f}",
                flush=True,
            )


if __name__ == "__main__":
    main()
