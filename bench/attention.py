"""Attention kernels: forward+backward time and peak memory against sequence length, and the error of the
approximate kernels against exact softmax attention.

    python bench/attention.py                      # CPU: N = 256 … 8192, eager vs sdpa (+ flex forward)
    python bench/attention.py --device cuda --max-len 32768
    python bench/attention.py --kernels all --max-len 2048 --threads 1   # every kernel in nn.attention.KERNELS
    python bench/attention.py --kernels eager,sdpa,lsh --option lsh.n_hashes=2    # a kernel option by hand
    python bench/attention.py --approx             # Performer / RFA error vs features, LSH error vs hash rounds

``--kernels`` takes any names of ``mmformer.nn.attention.KERNELS`` (``all``: every one but ``auto``), the
registered kernels (``mmformer.nn.kernels``: ``lsh``, ``aft_*``, ``rfa`` …) with options that fit the length
(``bench_options``: ``aft_full``/``aft_local`` ``max_len = N``, ``aft_local`` window 64, ``lsh`` chunks of 64
and ``n_buckets ≈ 2N/64``, ``rfa`` ``features/2`` frequencies = the Performer's ``features`` features);
``--option KERNEL.KEY=VALUE`` overrides one. Two sparse masks run as kernels too, on sdpa: ``window``
(sliding window, ``window`` 128 tokens: a dense mask on CPU) and ``bigbird`` (BigBird's block layout per
head, ``block`` 64, ``window`` / ``global`` / ``random`` 1 block each: sdpa gathers the key blocks,
``mmformer.nn.block_sparse``). Attention is causal; a kernel without a causal rule runs bidirectional and
is compared with eager and sdpa run bidirectional too.

Each (kernel, N) runs in its own process so peak memory is that kernel's alone: on CPU the process's max RSS
(``peak MB``, which includes ~500 MB of interpreter and torch) and its rise during the steps over what was
there before them (``step MB``: the step's own working memory; the child runs with
``MALLOC_MMAP_THRESHOLD_=131072`` so that RSS follows the live tensors); on GPU
``torch.cuda.max_memory_allocated`` and its rise over the allocation before the steps. Time is the median
step's wall time (``ms``) and, on CPU, the process's CPU time (``CPU ms``), less sensitive than wall time to
other load on a shared machine (with ``--threads 1``; still ±30 % between runs on a loaded 2-core machine):
the ratios use it on CPU. Ratios are to eager's and sdpa's in the same mode (forward+backward, or forward
only for flex on CPU, which has no backward). Prints Markdown tables. Uses only the model library
(``mmformer.nn``), so it runs on machines without the training stack.
"""

from __future__ import annotations

import argparse
import ast
import inspect
import json
import math
import os
import resource
import statistics
import subprocess
import sys
import time

import torch

SPARSE_MASKS = {  # masks benchmarked as kernels: sdpa under them, with these options
    "window": {"window": 128},
    "bigbird": {"block": 64, "window": 1, "global": 1, "random": 1},
}


def bench_options(kernel: str, n: int, features: int, overrides: dict | None = None) -> dict:
    """Options for registered ``kernel`` at length ``n``: the bench's defaults for the options it requires or
    that scale with ``n`` (those the kernel's ``__init__`` takes), then ``overrides`` (all of them: a name the
    kernel does not take is refused when the layer is built). A sparse mask's (``SPARSE_MASKS``) likewise."""
    from mmformer.nn.kernels import KERNEL_CLASSES

    if kernel in SPARSE_MASKS:
        unknown = set(overrides or {}) - set(SPARSE_MASKS[kernel])
        if unknown:
            raise SystemExit(
                f"{kernel} takes options {', '.join(SPARSE_MASKS[kernel])}, not {', '.join(unknown)}"
            )
        return {**SPARSE_MASKS[kernel], **(overrides or {})}
    cls = KERNEL_CLASSES.get(kernel)
    if cls is None:  # eager, sdpa, flex, performer, auto: no options
        return {}
    defaults = {
        "aft_full": {"max_len": n},
        "aft_local": {"max_len": n, "window": 64},
        "lsh": {"n_buckets": max(2, n // 32 // 2 * 2), "chunk_size": 64},  # 2N / chunk, HF's automatic value
        "rfa": {"n_features": max(1, features // 2)},  # sin and cos: 2·n_features features per vector
    }.get(kernel, {})
    takes = list(inspect.signature(cls.__init__).parameters)[3:]  # after self, n_heads, head_dim
    return {**{k: v for k, v in defaults.items() if k in takes}, **(overrides or {})}


def supports_causal(kernel: str) -> bool:
    from mmformer.nn.kernels import kernel_rules

    if kernel in SPARSE_MASKS:
        return True
    return "causal" in kernel_rules(kernel)


def measure(
    kernel: str,
    n: int,
    device: str,
    dtype: str,
    heads: int,
    head_dim: int,
    repeats: int,
    features: int = 256,
    causal: bool = True,
    options: dict | None = None,
) -> dict:
    from mmformer.nn import Attention, MaskSpec
    from mmformer.nn.masks import bigbird_layout

    torch.manual_seed(0)
    dt = getattr(torch, dtype)
    mask = MaskSpec(causal=causal)
    if kernel == "window":
        mask = MaskSpec(causal=causal, window=options["window"])
    elif kernel == "bigbird":
        o = options
        layout = bigbird_layout(-(-n // o["block"]), o["window"], o["global"], o["random"], 0, causal, heads)
        mask = MaskSpec(causal=causal, sparse_layout=layout.to(device), sparse_block=o["block"])
    layer_kernel = "sdpa" if kernel in SPARSE_MASKS else kernel
    layer_options = None if kernel in SPARSE_MASKS else options
    attn = Attention(
        heads * head_dim,
        heads,
        kernel=layer_kernel,
        performer_features=features,
        kernel_options=layer_options,
    ).to(device, dt)
    x = torch.randn(1, n, heads * head_dim, device=device, dtype=dt)
    train = not (kernel == "flex" and device == "cpu")  # flex has no CPU backward
    x.requires_grad_(train)

    def step():
        if train:
            attn(x, mask).float().sum().backward()
        else:
            with torch.no_grad():
                attn(x, mask)

    def peak() -> int:
        if device == "cuda":
            return torch.cuda.max_memory_allocated()
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024

    with torch.no_grad():  # load the libraries' lazy parts first, so "step MB" is the step's own memory
        attn(x[:, : min(n, 64)].detach(), mask)
    if device == "cuda":
        torch.cuda.synchronize()
    before = torch.cuda.memory_allocated() if device == "cuda" else peak()
    step()  # warm-up (and compilation for flex on GPU)
    if device == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    times, cpu_times = [], []
    for _ in range(repeats):
        t, c = time.perf_counter(), time.process_time()
        step()
        if device == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t)
        cpu_times.append(time.process_time() - c)
    top = peak()
    return {
        "kernel": kernel,
        "n": n,
        "causal": causal,
        "ms": 1e3 * statistics.median(times),
        "cpu_ms": 1e3 * statistics.median(cpu_times),
        "peak_mb": top / 2**20,
        "step_mb": (top - before) / 2**20,
        "mode": "fwd+bwd" if train else "fwd",
        "options": options or {},
    }


def parse_overrides(items: list[str]) -> dict[str, dict]:
    """``["lsh.n_hashes=2", …]`` → ``{"lsh": {"n_hashes": 2}}`` (values as Python literals)."""
    out: dict[str, dict] = {}
    for item in items:
        name, _, assignment = item.partition(".")
        key, eq, value = assignment.partition("=")
        if not (name and key and eq):
            raise SystemExit(f"--option wants KERNEL.KEY=VALUE, got {item!r}")
        try:
            parsed = ast.literal_eval(value)
        except (ValueError, SyntaxError):
            parsed = value
        out.setdefault(name, {})[key] = parsed
    return out


def main() -> None:
    from mmformer.nn.attention import KERNELS

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default=None, help="float32 on CPU, bfloat16 on CUDA by default")
    p.add_argument("--min-len", type=int, default=256)
    p.add_argument("--max-len", type=int, default=8192)
    p.add_argument(
        "--lengths", default=None, help="comma-separated N (instead of min-len … max-len doubling)"
    )
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument(
        "--threads", type=int, default=None, help="torch threads per measurement (default torch's)"
    )
    p.add_argument(
        "--kernels",
        default="eager,sdpa,flex",
        help=f"comma-separated, or 'all': {', '.join(KERNELS)}, {', '.join(SPARSE_MASKS)} (sdpa under the mask)",
    )
    p.add_argument("--features", type=int, default=256, help="performer / rfa: random features per head")
    p.add_argument(
        "--option", action="append", default=[], metavar="KERNEL.KEY=VALUE", help="a kernel option"
    )
    p.add_argument("--approx", action="store_true", help="approximation errors vs exact attention, then exit")
    p.add_argument("--approx-len", type=int, default=1024, help="--approx: sequence length")
    p.add_argument("--one", nargs=2, metavar=("KERNEL", "N"), help=argparse.SUPPRESS)
    p.add_argument("--one-spec", default="{}", help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.threads:
        torch.set_num_threads(a.threads)
    dtype = a.dtype or ("bfloat16" if a.device == "cuda" else "float32")
    if a.approx:
        approximation(a.head_dim, a.approx_len)
        return
    if a.one:
        spec = json.loads(a.one_spec)
        args = (a.device, dtype, a.heads, a.head_dim, a.repeats, a.features, spec["causal"], spec["options"])
        print(json.dumps(measure(a.one[0], int(a.one[1]), *args)))
        return
    names = [*KERNELS, *SPARSE_MASKS]
    kernels = [k for k in names if k != "auto"] if a.kernels == "all" else a.kernels.split(",")
    unknown = [k for k in kernels if k not in names]
    if unknown:
        p.error(f"unknown kernel(s) {', '.join(unknown)}; choose from {', '.join(names)} or 'all'")
    overrides = parse_overrides(a.option)
    if a.lengths:
        lengths = [int(n) for n in a.lengths.split(",")]
    else:
        lengths, n = [], a.min_len
        while n <= a.max_len:
            lengths.append(n)
            n *= 2
    causal_of = {k: supports_causal(k) for k in kernels}
    baselines = [(b, c) for b in ("eager", "sdpa") for c in sorted(set(causal_of.values()), reverse=True)]
    runs = list(dict.fromkeys([*[(k, causal_of[k]) for k in kernels], *baselines]))
    rows: dict[tuple[str, int, bool], dict] = {}
    # glibc hands every freed block above 128 KiB back to the system, so RSS follows the live tensors
    env = {"MALLOC_MMAP_THRESHOLD_": "131072", **os.environ}
    for n in lengths:
        for kernel, causal in runs:
            options = bench_options(kernel, n, a.features, overrides.get(kernel))
            cmd = [sys.executable, __file__, "--device", a.device, "--dtype", dtype, "--heads", str(a.heads)]
            cmd += ["--head-dim", str(a.head_dim), "--repeats", str(a.repeats), "--features", str(a.features)]
            cmd += ["--threads", str(a.threads)] if a.threads else []
            cmd += ["--one", kernel, str(n), "--one-spec", json.dumps({"causal": causal, "options": options})]
            out = subprocess.run(cmd, capture_output=True, text=True, env=env)
            if out.returncode != 0:
                last = (out.stderr.strip().splitlines() or ["failed"])[-1]
                rows[(kernel, n, causal)] = {"kernel": kernel, "n": n, "causal": causal, "error": last[:90]}
                continue
            rows[(kernel, n, causal)] = json.loads(out.stdout.strip().splitlines()[-1])
    # on CPU the ratios compare process CPU time, which other load on a shared machine barely changes (with
    # one thread; more threads add their spinning); on GPU wall time
    key = "cpu_ms" if a.device == "cpu" else "ms"
    print(f"self-attention, batch 1, {a.heads} heads × {a.head_dim}, {dtype}, {a.device}", end="")
    print(f", {a.threads} thread(s)" if a.threads else "")
    ratios = "× eager time | × eager step MB | × sdpa time | × sdpa step MB"
    print(f"| N | kernel | mask | mode | ms | CPU ms | peak MB | step MB | {ratios} |")
    print("| --- " * 12 + "|")
    for n in lengths:
        for kernel in dict.fromkeys([*kernels, "eager", "sdpa"]):
            causal = causal_of.get(kernel, True)
            r = rows[(kernel, n, causal)]
            label = kernel + "".join(f" {k}={v}" for k, v in r.get("options", {}).items())
            mask = "causal" if causal else "full"
            if "error" in r:
                print(f"| {n} | {label} | {mask} | error: {r['error']} |")
                continue
            ratios = []
            for base in ("eager", "sdpa"):
                b = rows.get((base, n, causal), {})
                same = b.get("mode") == r["mode"] and key in b
                ratios.append(f"{r[key] / b[key]:.2f}" if same else "-")
                ratios.append(f"{r['step_mb'] / b['step_mb']:.2f}" if same and b["step_mb"] > 0 else "-")
            print(
                f"| {n} | {label} | {mask} | {r['mode']} | {r['ms']:,.1f} | {r['cpu_ms']:,.1f} | "
                f"{r['peak_mb']:,.0f} | {r['step_mb']:,.0f} | " + " | ".join(ratios) + " |"
            )


def _relative_error(approx: torch.Tensor, exact: torch.Tensor) -> float:
    return float((approx - exact).norm() / exact.norm())


def approximation(head_dim: int, n: int = 1024, seeds: int = 3, sigmas=(1.0, 0.5)) -> None:
    """Relative error ‖approx − exact‖ / ‖exact‖ on random q, k, v (entries N(0, 0.5²), 4 heads), mean over
    ``seeds`` draws of the random features / hash rotations, bidirectional and causal:

    * Performer (FAVOR+, ``m`` features) against ``softmax(q·k / √Dh)``;
    * RFA (``m/2`` frequencies: ``m`` sine and cosine features) against ``softmax(q̂·k̂ / σ²)`` over
      ℓ2-normalised q, k — another target, so its numbers are not comparable with the Performer's;
    * LSH (``n_hashes`` rounds, chunks of 64, ``2N/64`` buckets) against full shared-QK attention (the keys
      are the queries scaled to length √Dh, a token reads itself only when nothing else is allowed), on the
      random queries and on clustered ones (32 centres ~ N(0, I), noise 0.25).
    """
    from mmformer.nn import MaskSpec
    from mmformer.nn.attention import eager_attention
    from mmformer.nn.kernels import KERNEL_CLASSES, build_kernel
    from mmformer.nn.linear_attention import favor_attention, orthogonal_features

    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 4, n, head_dim, generator=g) * 0.5 for _ in range(3))
    causal_mask = torch.ones(n, n, dtype=torch.bool).tril()
    masks = {False: None, True: causal_mask}
    print(
        f"relative error vs exact attention, N = {n}, 4 heads × {head_dim}, q, k, v ~ N(0, 0.5²), "
        f"{seeds} seeds"
    )
    exact = {c: eager_attention(q, k, v, m) for c, m in masks.items()}
    targets = {}
    if "rfa" in KERNEL_CLASSES:
        from mmformer.nn.kernels.rfa import fourier_frequencies, rfa_attention

        qn, kn = (torch.nn.functional.normalize(t, dim=-1) for t in (q, k))
        for s in sigmas:  # eager scales by 1/√Dh: undo it, then 1/σ²
            targets[s] = {c: eager_attention(qn * head_dim**0.5 / s**2, kn, v, m) for c, m in masks.items()}
    head = "| features | performer full | performer causal |"
    head += "".join(f" rfa σ={s} full | rfa σ={s} causal |" for s in targets)
    print(head)
    print("|" + " --- |" * (head.count("|") - 1))
    for m in (16, 64, 256, 1024, 4096):
        cells = []
        for causal in (False, True):
            e = []
            for seed in range(seeds):
                w = orthogonal_features(m, head_dim, torch.Generator().manual_seed(seed))
                e.append(_relative_error(favor_attention(q, k, v, w, causal=causal), exact[causal]))
            cells.append(sum(e) / seeds)
        for s in targets:
            for causal in (False, True):
                e = []
                for seed in range(seeds):
                    w = fourier_frequencies(max(1, m // 2), head_dim, s, seed)
                    e.append(_relative_error(rfa_attention(q, k, v, w, causal=causal), targets[s][causal]))
                cells.append(sum(e) / seeds)
        print(f"| {m} | " + " | ".join(f"{c:.3f}" for c in cells) + " |")
    if "lsh" in KERNEL_CLASSES:
        # random queries are nearly orthogonal in Dh dimensions: shared-QK attention over them is flat, the
        # worst case for LSH; clustered queries (what hashing is for) put ~97 % of each row's mass in its cluster
        centers = torch.randn(1, 4, 32, head_dim, generator=g)
        clusters = torch.randint(0, 32, (n,), generator=g)
        clustered = centers[:, :, clusters] + 0.25 * torch.randn(1, 4, n, head_dim, generator=g)
        buckets = max(2, n // 32 // 2 * 2)
        print(f"\nLSH vs full shared-QK attention, {buckets} buckets, chunks of 64")
        print("| n_hashes | random q, full | random q, causal | clustered q, full | clustered q, causal |")
        print("| --- | --- | --- | --- | --- |")
        shared = {
            name: _shared_qk(x, v, causal_mask) for name, x in (("random", q), ("clustered", clustered))
        }
        for rounds in (1, 2, 4, 8):
            cells = []
            for name, x in (("random", q), ("clustered", clustered)):
                for causal in (False, True):
                    e = []
                    for seed in range(seeds):
                        opts = {"n_buckets": buckets, "n_hashes": rounds, "chunk_size": 64, "seed": seed}
                        kernel = build_kernel("lsh", 4, head_dim, opts)
                        with torch.no_grad():
                            approx = kernel(x, x, v, MaskSpec(causal=causal))
                        e.append(_relative_error(approx, shared[name][causal]))
                    cells.append(sum(e) / seeds)
            print(f"| {rounds} | " + " | ".join(f"{c:.3f}" for c in cells) + " |")


def _shared_qk(q: torch.Tensor, v: torch.Tensor, causal_mask: torch.Tensor) -> dict[bool, torch.Tensor]:
    """Exact shared-QK attention as the ``lsh`` kernel defines it, bidirectional (False) and causal (True):
    keys are the queries scaled to length √Dh, scores ``q·k / √Dh``, a token reads itself only when nothing
    else is allowed."""
    from mmformer.nn.kernels.lsh import SELF_SCORE

    keys = q * torch.rsqrt(q.square().mean(-1, keepdim=True) + 1e-6)
    scores = (q @ keys.transpose(-1, -2)) / math.sqrt(q.shape[-1])  # (B, H, N, N)
    scores = scores.masked_fill(torch.eye(q.shape[-2], dtype=torch.bool), SELF_SCORE)
    causal = scores.masked_fill(~causal_mask, float("-inf"))
    return {False: scores.softmax(-1) @ v, True: causal.softmax(-1) @ v}


if __name__ == "__main__":
    main()
