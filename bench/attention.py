"""Attention kernels: forward+backward time and peak memory against sequence length.

    python bench/attention.py                      # CPU: N = 256 … 8192, eager vs sdpa (+ flex forward)
    python bench/attention.py --device cuda --max-len 32768
    python bench/attention.py --kernels eager,sdpa,performer --features 256   # + random-feature attention
    python bench/attention.py --approx             # FAVOR+ error against exact softmax attention vs features

Each (kernel, N) runs in its own process so peak memory is that kernel's alone (max RSS on CPU,
``torch.cuda.max_memory_allocated`` on GPU). Prints a table with sdpa/eager ratios. Uses only the
model library (``mmformer.nn``), so it runs on machines without the training stack.
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import time

import torch


def measure(
    kernel: str, n: int, device: str, dtype: str, heads: int, head_dim: int, repeats: int, features: int = 256
) -> dict:
    from mmformer.nn import Attention, MaskSpec

    torch.manual_seed(0)
    dt = getattr(torch, dtype)
    attn = Attention(heads * head_dim, heads, kernel=kernel, performer_features=features).to(device, dt)
    x = torch.randn(1, n, heads * head_dim, device=device, dtype=dt)
    mask = MaskSpec(causal=True)
    train = not (kernel == "flex" and device == "cpu")  # flex has no CPU backward
    x.requires_grad_(train)

    def step():
        if train:
            attn(x, mask).float().sum().backward()
        else:
            with torch.no_grad():
                attn(x, mask)

    step()  # warm-up (and compilation for flex on GPU)
    if device == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        step()
        if device == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t)
    peak = (
        torch.cuda.max_memory_allocated()
        if device == "cuda"
        else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    )
    return {
        "kernel": kernel,
        "n": n,
        "ms": 1e3 * statistics.median(times),
        "peak_mb": peak / 2**20,
        "mode": "fwd+bwd" if train else "fwd",
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default=None, help="float32 on CPU, bfloat16 on CUDA by default")
    p.add_argument("--min-len", type=int, default=256)
    p.add_argument("--max-len", type=int, default=8192)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--kernels", default="eager,sdpa,flex")
    p.add_argument("--features", type=int, default=256, help="performer: random features per head")
    p.add_argument("--approx", action="store_true", help="FAVOR+ approximation error vs features, then exit")
    p.add_argument("--one", nargs=2, metavar=("KERNEL", "N"), help=argparse.SUPPRESS)
    a = p.parse_args()
    dtype = a.dtype or ("bfloat16" if a.device == "cuda" else "float32")
    if a.approx:
        approximation(a.head_dim)
        return
    if a.one:
        args = (a.device, dtype, a.heads, a.head_dim, a.repeats, a.features)
        print(json.dumps(measure(a.one[0], int(a.one[1]), *args)))
        return
    lengths, n = [], a.min_len
    while n <= a.max_len:
        lengths.append(n)
        n *= 2
    rows: dict[tuple[str, int], dict] = {}
    for n in lengths:
        for kernel in a.kernels.split(","):
            cmd = [
                sys.executable,
                __file__,
                "--device",
                a.device,
                "--dtype",
                dtype,
                "--heads",
                str(a.heads),
                "--head-dim",
                str(a.head_dim),
                "--repeats",
                str(a.repeats),
                "--features",
                str(a.features),
                "--one",
                kernel,
                str(n),
            ]
            out = subprocess.run(cmd, capture_output=True, text=True)
            if out.returncode != 0:
                rows[(kernel, n)] = {
                    "kernel": kernel,
                    "n": n,
                    "error": out.stderr.strip().splitlines()[-1][:60],
                }
                continue
            rows[(kernel, n)] = json.loads(out.stdout.strip().splitlines()[-1])
    print(f"causal self-attention, batch 1, {a.heads} heads × {a.head_dim}, {dtype}, {a.device}")
    print(
        f"{'N':>6} | {'kernel':6} | {'mode':7} | {'ms':>9} | {'peak MB':>8} | "
        f"{'× eager time':>12} | {'× eager mem':>11}"
    )
    for n in lengths:
        base = rows.get(("eager", n), {})
        for kernel in a.kernels.split(","):
            r = rows[(kernel, n)]
            if "error" in r:
                print(f"{n:>6} | {kernel:6} | error: {r['error']}")
                continue
            same_mode = base.get("mode") == r["mode"] and "ms" in base
            rt = f"{r['ms'] / base['ms']:.2f}" if same_mode else "-"
            rm = f"{r['peak_mb'] / base['peak_mb']:.2f}" if same_mode else "-"
            print(
                f"{n:>6} | {kernel:6} | {r['mode']:7} | {r['ms']:9.1f} | {r['peak_mb']:8.0f} | {rt:>12} | {rm:>11}"
            )


def approximation(head_dim: int, n: int = 1024, seeds: int = 3) -> None:
    """Relative error ‖FAVOR+ − softmax‖ / ‖softmax‖ of random-feature attention (causal and not) on
    random q, k, v (entries N(0, 0.5²)), mean over ``seeds`` feature draws, as the features grow."""
    from mmformer.nn.attention import eager_attention
    from mmformer.nn.linear_attention import favor_attention, orthogonal_features

    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 4, n, head_dim, generator=g) * 0.5 for _ in range(3))
    print(f"FAVOR+ relative error vs exact softmax attention, N = {n}, 4 heads × {head_dim}")
    print(f"{'features':>8} | {'bidirectional':>13} | {'causal':>8}")
    causal_mask = torch.ones(n, n, dtype=torch.bool).tril()
    exact = {False: eager_attention(q, k, v, None), True: eager_attention(q, k, v, causal_mask)}
    for m in (16, 64, 256, 1024, 4096):
        errs = {}
        for causal in (False, True):
            e = []
            for seed in range(seeds):
                w = orthogonal_features(m, head_dim, torch.Generator().manual_seed(seed))
                approx = favor_attention(q, k, v, w, causal=causal)
                e.append(float((approx - exact[causal]).norm() / exact[causal].norm()))
            errs[causal] = sum(e) / len(e)
        print(f"{m:>8} | {errs[False]:>13.3f} | {errs[True]:>8.3f}")


if __name__ == "__main__":
    main()
