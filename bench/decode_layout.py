"""Row-major vs column-major linear weights on the CPU, at the shapes of KV-cache decoding
(``mmformer.nn.layout``): ``F.linear(x, W)`` with ``x (M, D_in)`` and ``W (D_out, D_in)`` stored row-major
(``nn.Linear``'s default) or column-major (``W.t().contiguous().t()``, what ``for_decoding`` switches
to). Weights are small enough to stay in cache here, so this isolates the kernels' choice of algorithm;
end-to-end decoding is memory-bound and gains less (``bench/peers.py --only generate``).

    python bench/decode_layout.py                 # SmolLM2-135M's projections, M = 1, 4, 16, 64, 512
    python bench/decode_layout.py --rows 4 --threads 2
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F

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


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", default="1,4,16,64,512", help="comma-separated M (sequences decoded at once)")
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
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
