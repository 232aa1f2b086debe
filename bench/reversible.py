"""Reversible layers: peak training memory and step time against depth, standard pre-norm vs reversible.

    python bench/reversible.py                          # CPU: d 256, N 1024, batch 4, depth 2, 4, 8, 16
    python bench/reversible.py --ff-chunks 4            # + reversible with the feed-forward in 4 pieces
    python bench/reversible.py --device cuda --depths 2,4,8,16,32 --batch 8

Each (variant, depth) runs in a fresh process, so its peak is its own. Memory of one forward+backward
step (the activations kept for backward, the parameters' gradients, the step's transient buffers):
  * CPU: the process's max RSS after the first step minus its max RSS just before it (model and input
    built). The child runs with ``MALLOC_MMAP_THRESHOLD_=131072``: glibc then serves every tensor above
    128 KiB by ``mmap`` and returns it on free. With glibc's default (a threshold that rises to the size
    of the blocks freed) freed activations stay in the heap, and RSS also counts what fragmentation
    keeps (``--default-malloc`` shows it).
  * CUDA: ``torch.cuda.max_memory_allocated`` during the step minus ``memory_allocated`` before it,
    after a warm-up step.
Time: on CPU the process's CPU time of the measured step, with 1 thread by default (wall time on a
shared machine is noisy, and with 2 threads OpenMP's spin-waiting inflates CPU time under load); on
CUDA the step's wall time. Uses only the model library.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time

import torch


def measure(reversible: bool, ff_chunks: int, depth: int, d: int, n: int, batch: int, device: str) -> dict:
    from mmformer.models import AttentionConfig, BlockConfig, build_backbone
    from mmformer.nn import Tokens

    torch.manual_seed(0)
    block = BlockConfig(reversible=reversible, ff_chunks=ff_chunks)
    backbone = build_backbone(d, depth, AttentionConfig(d // 64), block=block).to(device)
    x = torch.randn(batch, n, d, device=device, requires_grad=True)

    clock = time.perf_counter if device == "cuda" else time.process_time

    def step() -> float:
        t = clock()
        backbone(Tokens.from_embeddings(x, 0)).square().mean().backward()
        if device == "cuda":
            torch.cuda.synchronize()
        return clock() - t

    if device == "cuda":
        step()  # warm-up: kernels, cuBLAS workspaces
        backbone.zero_grad(set_to_none=True)
        x.grad = None
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        seconds = step()
        peak = torch.cuda.max_memory_allocated() - before
    else:
        before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        seconds = step()
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - before
    params = sum(p.numel() for p in backbone.parameters())
    return {"peak_mb": peak / 2**20, "seconds": seconds, "params_m": params / 1e6}


def run_child(args: argparse.Namespace, reversible: bool, ff_chunks: int, depth: int) -> dict:
    spec = dict(
        reversible=reversible, ff_chunks=ff_chunks, depth=depth, d=args.d, n=args.n, batch=args.batch,
        device=args.device,
    )  # fmt: skip
    cmd = [sys.executable, __file__, "--child", json.dumps(spec), "--threads", str(args.threads)]
    env = dict(os.environ) if args.default_malloc else {**os.environ, "MALLOC_MMAP_THRESHOLD_": "131072"}
    out = subprocess.run(cmd, capture_output=True, text=True, check=True, env=env)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cpu")
    p.add_argument("--depths", default="2,4,8,16")
    p.add_argument("--d", type=int, default=256, help="d_model (heads of 64)")
    p.add_argument("--n", type=int, default=1024, help="tokens per sequence")
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--ff-chunks", type=int, default=0, help="also run reversible with this many ff chunks")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--default-malloc", action="store_true", help="CPU: glibc's default mmap threshold")
    p.add_argument("--child", help=argparse.SUPPRESS)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    if args.child:
        print(json.dumps(measure(**json.loads(args.child))))
        return
    variants = [("standard", False, 1), ("reversible", True, 1)]
    if args.ff_chunks > 1:
        variants.append((f"reversible, ff_chunks {args.ff_chunks}", True, args.ff_chunks))
    malloc = "default malloc" if args.default_malloc else "MALLOC_MMAP_THRESHOLD_=131072"
    print(
        f"# {args.device}, d {args.d}, N {args.n}, batch {args.batch}, fp32, {args.threads} threads, {malloc}"
    )
    head = " | ".join(f"{name} MB" for name, _, _ in variants)
    times = " | ".join(f"{name} s" for name, _, _ in variants)
    print(f"| layers | params (M) | {head} | reversible / standard memory | {times} |")
    print("| --- " * (3 + 2 * len(variants)) + "|")
    for depth in (int(s) for s in args.depths.split(",")):
        rows = [run_child(args, rev, chunks, depth) for _, rev, chunks in variants]
        mem = " | ".join(f"{r['peak_mb']:,.0f}" for r in rows)
        sec = " | ".join(f"{r['seconds']:.2f}" for r in rows)
        ratio = rows[1]["peak_mb"] / rows[0]["peak_mb"]
        print(f"| {depth} | {rows[0]['params_m']:.1f} | {mem} | {ratio:.2f} | {sec} |", flush=True)


if __name__ == "__main__":
    main()
