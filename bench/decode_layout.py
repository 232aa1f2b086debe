"""Row-major vs column-major linear weights on the CPU, at the shapes of KV-cache decoding
(``mmformer.nn.layout``): ``F.linear(x, W)`` with ``x (M, D_in)`` and ``W (D_out, D_in)`` stored row-major
(``nn.Linear``'s default) or column-major (``W.t().contiguous().t()``, what ``for_decoding`` switches
to). Weights are small enough to stay in cache here, so this isolates the kernels' choice of algorithm;
end-to-end decoding is memory-bound and gains less (``bench/peers.py --only generate``).

    python bench/decode_layout.py                 # SmolLM2-135M's projections, M = 1, 4, 16, 64, 512
    python bench/decode_layout.py --rows 4 --threads 2
    python bench/decode_layout.py --floor         # the memory floor of one decoding step

``--floor``: one decoding step must read every weight once. This runs ``F.linear`` at M = 1 and 4 over
all of SmolLM2-135M's weights (30 blocks' projections and the 49152 × 576 tied output layer, 538 MB fp32,
column-major as decoding uses them, far beyond the caches), so it is the time of a step that does nothing
but its products; compare it with the per-token step time of ``bench/peers.py --only generate``
(mmformer and transformers) to see how much of a step is left for anything else.
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F

N_LAYERS, VOCAB, D_MODEL = 30, 49152, 576
# (name, out, in): SmolLM2-135M's block projections (d_model 576, 9 heads / 3 kv heads, SwiGLU 1536)
SHAPES = [("qkv", 960, 576), ("attn proj", 576, 576), ("gate+up", 3072, 576), ("down", 576, 1536)]


def best_us(fn, iters: int, repeats: int = 5) -> float:
    for _ in range(max(3, iters // 10)):
        fn()
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        for _ in range(iters):
            fn()
        times.append((time.perf_counter() - t) / iters * 1e6)
    return min(times)


def floor(threads: int) -> None:
    """Print the time of one sweep of ``F.linear`` over every weight of SmolLM2-135M, at M = 1 and 4."""
    weights = [
        torch.randn(d_out, d_in).t().contiguous().t() for _ in range(N_LAYERS) for _, d_out, d_in in SHAPES
    ]
    weights.append(torch.randn(VOCAB, D_MODEL).t().contiguous().t())
    size = sum(w.numel() * w.element_size() for w in weights)
    print(f"torch {torch.__version__}, {threads} threads; {len(weights)} weights, {size / 1e6:.0f} MB fp32")
    for m in (1, 4):
        xs = {w.shape[1]: torch.randn(m, w.shape[1]) for w in weights}

        def sweep(xs=xs):
            for w in weights:
                F.linear(xs[w.shape[1]], w)

        ms = best_us(sweep, iters=5) / 1e3
        print(
            f"M = {m}: one sweep {ms:.1f} ms = {size / ms / 1e6:.1f} GB/s; at most {1e3 / ms:.1f} steps/s, "
            f"{m * 1e3 / ms:.1f} new tokens/s"
        )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", default="1,4,16,64,512", help="comma-separated M (sequences decoded at once)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--floor", action="store_true", help="time one sweep over all the weights instead")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    if args.floor:
        return floor(args.threads)
    torch.manual_seed(0)
    print(f"torch {torch.__version__}, {args.threads} threads; best of 5, µs per call")
    print(f"{'M':>5} {'projection':>10} {'out×in':>10} {'row-major':>10} {'col-major':>10} {'row/col':>8}")
    for m in (int(r) for r in args.rows.split(",")):
        for name, d_out, d_in in SHAPES:
            x = torch.randn(m, d_in)
            w = torch.randn(d_out, d_in)
            w_col = w.t().contiguous().t()
            torch.testing.assert_close(F.linear(x, w), F.linear(x, w_col), rtol=1e-4, atol=1e-4)
            iters = 200 if m <= 16 else 20
            row = best_us(lambda x=x, w=w: F.linear(x, w), iters)
            col = best_us(lambda x=x, w=w_col: F.linear(x, w), iters)
            print(f"{m:>5} {name:>10} {f'{d_out}×{d_in}':>10} {row:>10.0f} {col:>10.0f} {row / col:>8.2f}")


if __name__ == "__main__":
    main()
