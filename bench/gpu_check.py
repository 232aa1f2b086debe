"""GPU-only checks and timings for the backbone, in one command of a few minutes.

    PYTHONPATH=. python bench/gpu_check.py              # on a CUDA machine; results also in $OUT/gpu_check.json
    PYTHONPATH=. python bench/gpu_check.py --cpu-smoke  # tiny sizes on CPU: checks the script's code paths
    PYTHONPATH=. python bench/gpu_check.py --only attention,gpt2_medium   # some sections again

Imports only the model library (``mmformer.nn``, ``mmformer.models``) and torch, so it runs on a GPU box
with its own torch and without Lightning, W&B or OmegaConf. It reports:
  1. which SDPA backend actually runs for bf16 causal attention (profiler kernel names), whether
     flash / memory-efficient / cuDNN can each be forced, and sdpa with a dense mask (left padding,
     GQA, fully masked rows) against eager, forward and backward;
  2. FlexAttention forward and backward against the eager reference for packed documents, prefix-LM,
     modality spans, sliding windows, BigBird's per-head block layouts and ALiBi (fp32 and bf16); sdpa's
     gathered BigBird blocks and window band against eager too;
  3. attention TFLOP/s for sdpa and flex at long sequence lengths;
  4. the device's measured bf16 matmul peak;
  5. a full bf16 training step (forward, backward, AdamW) of ViT-B/16 and GPT-2-small-sized backbones:
     step time, tokens/s, achieved TFLOP/s and MFU against the measured matmul peak (and the H100 /
     H200 989 TFLOP/s dense bf16 spec);
  6. the whole GPT-2-medium language model (355M parameters, vocab 50,257, tied head, 1,024 tokens) as
     ``mmformer train`` runs it (the LM head's chunked cross-entropy, fused AdamW, bf16 autocast): sdpa
     eager, sdpa with regional ``torch.compile`` (``compile_blocks``), flex with it, and sdpa with the
     embedding and backbone compiled as one function — step time, MFU, peak memory, compile time apart
     (issue 26's goal: ≥ 55 % of the measured matmul peak).
Attention TFLOP/s (3.) is timed forward-only and forward + backward at 4k, 8k and 16k tokens with head
dim 64, and at 16k with 128 (issue 26's goal: ≥ 450 TFLOP/s). Each section's wall time is in the JSON.
Each section is guarded: a failure is recorded and the next section runs; the JSON is rewritten after
every section, so a crash loses nothing already measured.
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch
import torch._dynamo

from mmformer.models import AttentionConfig, MlpConfig, PositionConfig, build_backbone
from mmformer.models.presets import PRESETS
from mmformer.nn import Attention, AttentionInputs, MaskSpec, Tokens
from mmformer.nn.masks import bigbird_layout
from mmformer.nn.positions import alibi_slopes

RESULTS: dict = {}
SECTIONS = (
    "sdpa_backends",
    "sdpa_dense",
    "flex_vs_eager",
    "attention",
    "matmul_peak",
    "gpt2_medium",
    "train_step",
)
# dense bf16 FLOP/s from NVIDIA's datasheets (no sparsity); MFU is reported against the measured peak too
BF16_SPEC = {"NVL": 835e12, "H100 PCIe": 756e12, "H200": 989e12, "H100": 989e12, "A100": 312e12}


def spec_peak(name: str) -> float | None:
    """The datasheet's dense bf16 FLOP/s of a device named ``name`` (first matching key), else None."""
    return next((v for k, v in BF16_SPEC.items() if k in name), None)


def save() -> None:
    out_dir = os.environ.get("OUT")
    if out_dir:
        with open(os.path.join(out_dir, "gpu_check.json"), "w") as f:
            json.dump(RESULTS, f, indent=2, default=str)


def section(name: str, fn, *args):
    """Run one section; record an exception instead of stopping the script, and its wall time."""
    start = time.perf_counter()
    try:
        return fn(*args)
    except Exception as e:  # noqa: BLE001 - one run on a borrowed GPU: keep going, report everything
        RESULTS.setdefault("errors", {})[name] = f"{type(e).__name__}: {str(e)[:500]}"
        print(f"   [{name}] FAILED: {type(e).__name__}: {str(e).splitlines()[0][:200]}")
        return None
    finally:
        RESULTS.setdefault("section_seconds", {})[name] = round(time.perf_counter() - start, 1)
        save()


def timed(fn, device: str, repeats: int = 10, warmup: int = 3) -> float:
    """Median seconds per call."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        if device == "cuda":
            torch.cuda.synchronize()
        t = time.perf_counter()
        fn()
        if device == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t)
    return sorted(times)[len(times) // 2]


def check_sdpa_backends(device: str, n: int) -> None:
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.profiler import ProfilerActivity, profile

    q = torch.randn(2, 8, n, 64, device=device, dtype=torch.bfloat16)
    f = torch.nn.functional.scaled_dot_product_attention
    acts = [ProfilerActivity.CUDA] if device == "cuda" else [ProfilerActivity.CPU]
    with profile(activities=acts) as prof:
        f(q, q, q, is_causal=True)
        if device == "cuda":
            torch.cuda.synchronize()
    names = sorted(
        {
            e.key
            for e in prof.key_averages()
            if "attention" in e.key.lower()
            or "flash" in e.key.lower()
            or "fmha" in e.key.lower()
            or "cudnn" in e.key.lower()
        }
    )
    forced = {}
    for name, backend in (
        ("flash", SDPBackend.FLASH_ATTENTION),
        ("efficient", SDPBackend.EFFICIENT_ATTENTION),
        ("cudnn", SDPBackend.CUDNN_ATTENTION),
        ("math", SDPBackend.MATH),
    ):
        try:
            with sdpa_kernel(backend):
                f(q, q, q, is_causal=True)
            forced[name] = "ok"
        except RuntimeError as e:
            forced[name] = f"unavailable: {str(e).splitlines()[0][:80]}"
    RESULTS["sdpa_default_kernels"] = names
    RESULTS["sdpa_forced"] = forced
    print("1. SDPA, bf16 causal: kernels that ran by default:", names or "(none matched)")
    for k, v in forced.items():
        print(f"   forcing {k:9s}: {v}")


def _masks(B: int, N: int, device: str, H: int = 4) -> dict[str, MaskSpec]:
    doc = (torch.arange(N, device=device) // (N // 4)).expand(B, N)
    prefix = (torch.arange(N, device=device) < N // 4).long().expand(B, N)
    run = torch.arange(N, device=device) // (N // 8)  # 8 runs, odd ones are image spans with their own ids
    spans = torch.where(run % 2 == 1, run // 2 + 1, torch.zeros_like(run)).expand(B, N)
    valid = torch.ones(B, N, dtype=torch.bool, device=device)
    valid[-1, -N // 3 :] = False
    return {
        "documents": MaskSpec(causal=True, document=doc, valid=valid),
        "prefix_lm": MaskSpec(causal=True, span=prefix),
        "modality_spans": MaskSpec(causal=True, span=spans),
        "window": MaskSpec(causal=True, window=N // 8),
        # BigBird's blocks, a layout per head (N / 16 tokens each; sdpa gathers them, flex a block mask)
        "bigbird": MaskSpec(
            valid=valid, sparse_layout=bigbird_layout(16, n_heads=H).to(device), sparse_block=N // 16
        ),
        "bigbird_causal": MaskSpec(
            causal=True,
            sparse_layout=bigbird_layout(16, causal=True, n_heads=H).to(device),
            sparse_block=N // 16,
        ),
    }


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach().float(), b.detach().float()
    return float((a - b).norm() / b.norm().clamp_min(1e-12))


def check_flex(device: str, n: int) -> None:
    B, H, Dh = 2, 4, 64
    out = {}
    for dtype, tol in ((torch.float32, 2e-4), (torch.bfloat16, 2e-2)):
        for alibi in (False, True):
            for name, mask in _masks(B, n, device).items():
                torch.manual_seed(0)
                ref = Attention(H * Dh, H, kernel="eager").to(device)
                flex = Attention(H * Dh, H, kernel="flex").to(device, dtype)
                flex.load_state_dict(ref.state_dict())
                pos = torch.arange(n, device=device).expand(B, n)
                inputs = AttentionInputs(
                    mask=mask,
                    alibi_slopes=alibi_slopes(H).to(device) if alibi else None,
                    q_pos=pos,
                    k_pos=pos,
                )
                x = torch.randn(B, n, H * Dh, device=device)
                train = device == "cuda"  # FlexAttention has no CPU backward
                x_ref, x_flex = x.clone().requires_grad_(train), x.clone().to(dtype).requires_grad_(train)
                with torch.set_grad_enabled(train):
                    y_ref, y_flex = ref(x_ref, inputs), flex(x_flex, inputs)
                key = f"{name}{'+alibi' if alibi else ''}/{str(dtype).split('.')[-1]}"
                out[key] = {"forward_rel_err": _rel(y_flex, y_ref)}
                if train:
                    grad = torch.randn_like(y_ref)
                    y_ref.backward(grad)
                    y_flex.backward(grad.to(dtype))
                    out[key]["grad_rel_err"] = _rel(x_flex.grad, x_ref.grad)
                if name.startswith("bigbird") or name == "window":  # sdpa gathers the key blocks
                    sdpa = Attention(H * Dh, H, kernel="sdpa").to(device, dtype)
                    sdpa.load_state_dict(ref.state_dict())
                    x_sdpa = x.clone().to(dtype).requires_grad_(train)
                    with torch.set_grad_enabled(train):
                        y_sdpa = sdpa(x_sdpa, inputs)
                    out[key]["sdpa_forward_rel_err"] = _rel(y_sdpa, y_ref)
                    if train:
                        y_sdpa.backward(grad.to(dtype))
                        out[key]["sdpa_grad_rel_err"] = _rel(x_sdpa.grad, x_ref.grad)
                out[key]["ok"] = all(
                    err < (tol if "forward" in k else tol * 5)
                    for k, err in out[key].items()
                    if k.endswith("err")
                )
    RESULTS["flex_vs_eager"] = out
    bad = [k for k, v in out.items() if not v["ok"]]
    print(
        f"2. flex vs eager (forward and input gradients), N={n}: {len(out) - len(bad)}/{len(out)} within tolerance"
    )
    for k in bad:
        print(f"   MISMATCH {k}: {out[k]}")


def attention_tflops(device: str, shapes: list[tuple[int, int]]) -> None:
    """Kernel-only timing (prebuilt q, k, v and block mask), forward alone and forward + backward: sdpa
    causal, flex causal, flex over four equal documents, and a causal sliding window of ``min(1024,
    N / 4)`` tokens computed by sdpa over its gathered band of blocks (``nn.block_sparse``) and by flex,
    at each ``(tokens, head dim)`` of ``shapes``. B·H·Dh = 2 × 2,048 at every head dim.

    FLOPs (FlashAttention-2 paper's convention, Dao 2023 §4.1): forward 4·B·H·N²·Dh, halved when causal;
    backward 2.5× forward (so forward + backward 3.5×); four equal causal documents a quarter of causal;
    a causal window ``W``: the pairs it allows, ``N·W − W(W−1)/2`` in place of ``N²/2``.
    """
    from mmformer.nn.attention import flex_attention
    from mmformer.nn.block_sparse import block_sparse_attention, gather_plan

    rows = []
    for n, dh in shapes:
        B, H = 2, 2048 // dh
        q, k, v = (
            torch.randn(B, H, n, dh, device=device, dtype=torch.bfloat16, requires_grad=True)
            for _ in range(3)
        )
        doc_mask = _masks(B, n, device)["documents"]
        doc_mask = MaskSpec(causal=True, document=doc_mask.document)  # documents only, no padding
        w = min(1024, n // 4)
        window = MaskSpec(causal=True, window=w)
        plan = gather_plan(window, n, n, q.device)
        cases = {
            "sdpa causal": lambda q=q, k=k, v=v: torch.nn.functional.scaled_dot_product_attention(
                q, k, v, is_causal=True
            ),
            "sdpa window": lambda m=window, p=plan, q=q, k=k, v=v: block_sparse_attention(q, k, v, m, 0.0, p),
        }
        if device == "cuda":
            causal_bm = MaskSpec(causal=True).block_mask(B, n, n, q.device)
            doc_bm = doc_mask.block_mask(B, n, n, q.device)
            window_bm = window.block_mask(B, n, n, q.device)
            cases["flex causal"] = lambda bm=causal_bm, q=q, k=k, v=v: flex_attention(q, k, v, bm)
            cases["flex documents"] = lambda bm=doc_bm, q=q, k=k, v=v: flex_attention(q, k, v, bm)
            cases["flex window"] = lambda bm=window_bm, q=q, k=k, v=v: flex_attention(q, k, v, bm)
        for name, fn in cases.items():
            forward = 4 * B * H * n * n * dh * 0.5 / (4 if name == "flex documents" else 1)
            if name.endswith("window"):
                forward = 4 * B * H * dh * (n * w - w * (w - 1) / 2)
            t_fwd = timed(fn, device, repeats=5)  # grad mode on: the same compiled graph as below
            dout = torch.randn_like(q)  # made once: the timing holds the kernels' work only
            t_both = timed(
                lambda fn=fn, dout=dout, qkv=(q, k, v): torch.autograd.grad(fn(), qkv, dout),
                device,
                repeats=5,
            )
            row = {
                "n": n,
                "head_dim": dh,
                "case": name,
                "fwd_ms": t_fwd * 1e3,
                "fwd_tflops": forward / t_fwd / 1e12,
                "fwd_bwd_ms": t_both * 1e3,
                "fwd_bwd_tflops": 3.5 * forward / t_both / 1e12,
            }
            rows.append(row)
            print(
                f"3. attention N={n:6d} Dh={dh:3d} {name:15s} forward {t_fwd * 1e3:7.2f} ms "
                f"{row['fwd_tflops']:6.1f} TFLOP/s | fwd+bwd {t_both * 1e3:7.2f} ms "
                f"{row['fwd_bwd_tflops']:6.1f} TFLOP/s"
            )
    RESULTS["attention"] = rows


def check_sdpa_dense(device: str, n: int) -> None:
    """sdpa with a dense mask (left padding + causal, GQA, one fully padded row) against eager."""
    B, H, Dh = 3, 8, 64
    valid = torch.ones(B, n, dtype=torch.bool, device=device)
    valid[0, : n // 3] = False  # left padding
    valid[2] = False  # nothing real at all
    mask = MaskSpec(causal=True, valid=valid)
    torch.manual_seed(0)
    ref = Attention(H * Dh, H, n_kv_heads=2, kernel="eager").to(device)
    fast = Attention(H * Dh, H, n_kv_heads=2, kernel="sdpa").to(device, torch.bfloat16)
    fast.load_state_dict(ref.state_dict())
    x = torch.randn(B, n, H * Dh, device=device)
    x_ref, x_fast = x.clone().requires_grad_(), x.clone().bfloat16().requires_grad_()
    y_ref, y_fast = ref(x_ref, mask), fast(x_fast, mask)
    y_ref[:2].float().sum().backward()
    y_fast[:2].float().sum().backward()
    res = {
        "forward_rel_err": _rel(y_fast[:2], y_ref[:2]),
        "grad_rel_err": _rel(x_fast.grad[:2], x_ref.grad[:2]),
        "finite": bool(torch.isfinite(y_fast).all() and torch.isfinite(x_fast.grad).all()),
        # an all-padding row attends to nothing: its output is the projection bias alone, as in eager
        "dead_row_matches_eager": _rel(y_fast[2], y_ref[2]) < 1e-2,
    }
    RESULTS["sdpa_dense_mask_vs_eager"] = res
    print(f"1b. sdpa bf16 dense mask (left padding, GQA 8/2, an all-padding row) vs eager: {res}")


def matmul_peak(device: str, n: int) -> float:
    a = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    b = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    t = timed(lambda: a @ b, device, repeats=20)
    peak = 2 * n**3 / t
    RESULTS["matmul_peak_tflops"] = peak / 1e12
    print(f"4. measured bf16 matmul peak ({n}³): {peak / 1e12:.1f} TFLOP/s")
    return peak


def train_step_mfu(device: str, peak: float, cfgs: dict) -> None:
    from mmformer.models import count_flops  # noqa: F401  (FLOPs below are analytic, cross-checked in tests)

    rows = []
    for name, (size, kwargs, batch, n) in cfgs.items():
        torch.manual_seed(0)
        kwargs = dict(kwargs)  # build_backbone's keywords; "attention": AttentionConfig's beyond n_heads
        attention = AttentionConfig(size["n_heads"], **kwargs.pop("attention", {}))
        backbone = build_backbone(size["d_model"], size["n_layers"], attention, **kwargs).to(device)
        opt = torch.optim.AdamW(backbone.parameters(), lr=1e-4, fused=device == "cuda")
        x = torch.randn(batch, n, size["d_model"], device=device)

        def step(backbone=backbone, x=x, opt=opt):
            with torch.autocast(device, dtype=torch.bfloat16):
                out = backbone(Tokens.from_embeddings(x, 0))
            out.float().square().mean().backward()
            opt.step()
            opt.zero_grad(set_to_none=True)

        t = timed(step, device, repeats=10)
        params = sum(p.numel() for p in backbone.parameters())
        D, L = size["d_model"], size["n_layers"]
        causal = 0.5 if kwargs.get("causal") else 1.0
        flops = 6 * params * batch * n + 3 * 4 * batch * n * n * D * L * causal  # matmuls + attention
        row = {
            "model": name,
            "batch": batch,
            "tokens": n,
            "ms": t * 1e3,
            "tokens_per_s": batch * n / t,
            "tflops": flops / t / 1e12,
            "mfu": flops / t / peak,
        }
        rows.append(row)
        print(
            f"5. bf16 train step {name:22s} batch {batch:3d} × {n:5d}: {t * 1e3:8.1f} ms, "
            f"{batch * n / t:10.0f} tokens/s, {flops / t / 1e12:6.1f} TFLOP/s, MFU {100 * flops / t / peak:5.1f} %"
        )
    RESULTS["train_step"] = rows


def backbone_sizes(big: bool) -> dict:
    """Section 5's backbones: name → (size, build_backbone keywords, batch, tokens)."""
    return (
        {
            "ViT-B/16 (197 tokens)": (PRESETS["base"], {}, 128, 197),
            "GPT-2 small (1024 ctx)": (
                PRESETS["base"],
                {"causal": True, "mlp": MlpConfig(act="gelu_tanh")},
                16,
                1024,
            ),
            "Llama-style (2048 ctx)": (
                PRESETS["base"],
                {
                    "attention": {"n_kv_heads": 4, "qkv_bias": False},
                    "causal": True,
                    "norm": "rmsnorm",
                    "mlp": MlpConfig(act="swiglu", bias=False),
                    "positions": PositionConfig("rope"),
                },
                8,
                2048,
            ),
        }
        if big
        else {
            "debug": (PRESETS["debug"], {}, 2, 16),
            "debug causal rope": (
                PRESETS["debug"],
                {"causal": True, "positions": PositionConfig("rope")},
                2,
                16,
            ),
        }
    )


def lm_step_flops(backbone: torch.nn.Module, vocab_size: int, batch: int, n: int) -> float:
    """Model FLOPs of one causal-LM training step (forward + backward) over ``batch × n`` tokens, PaLM's
    convention (Chowdhery et al. 2022, App. B): per token 6·(non-embedding parameters + the head's V·D)
    for the matrix products and 6·L·N·D for attention's two products (4·N·D per layer forward over all
    keys, halved for causal, ×3 with the backward). Norms, activations and the embedding lookup are
    not counted."""
    d = backbone.d_model
    n_layers = len(backbone.blocks)
    params = sum(p.numel() for p in backbone.parameters())
    return batch * n * (6 * (params + vocab_size * d) + 6 * n_layers * n * d)


def gpt2_medium_mfu(device: str, peak: float, small: bool) -> None:
    """The whole GPT-2-medium language model's bf16 training step, as ``mmformer train`` runs it: token
    and learned position embeddings, 24 pre-norm causal blocks (d_model 1,024, 16 heads, GELU-tanh), the
    tied LM head's chunked cross-entropy (``LMHead.cross_entropy``, never holding the logits), fused
    AdamW, bf16 autocast over fp32 weights. Batch 8 × 1,024 tokens. One row per variant: sdpa eager,
    sdpa and flex with regional ``torch.compile`` (``compile_blocks``: one graph for every block, as
    torchtitan compiles), and sdpa with ``model.encode`` (embedding + backbone) compiled as one function,
    the chunked loss eager (compiled, ``LMHead.cross_entropy`` would take its full-logits path). Each
    variant's first step is timed apart (compile time = first step − median step), its peak memory
    counted from a clean start (the previous variant freed, compiled code included). FLOPs:
    ``lm_step_flops``; MFU against the measured bf16 matmul peak and against the datasheet's.
    """
    import gc

    from mmformer.models import AttentionConfig, MlpConfig, MultimodalModel, build_backbone
    from mmformer.models.heads import LMHead
    from mmformer.models.parallelize import compile_blocks
    from mmformer.tokenizers import TextEmbedding

    d, L, H, V, n, batch = (64, 2, 4, 1000, 64, 2) if small else (1024, 24, 16, 50257, 1024, 8)
    torch.manual_seed(0)
    ids = torch.randint(0, V, (batch, n), device=device)
    spec = spec_peak(RESULTS.get("device", ""))
    variants = {
        "sdpa, eager": ("sdpa", None),
        "sdpa, compile_blocks": ("sdpa", "blocks"),
        "flex, compile_blocks": ("flex", "blocks"),
        "sdpa, compiled encode": ("sdpa", "whole"),
    }
    rows = []
    for name, (kernel, compiled) in variants.items():
        torch._dynamo.reset()
        torch.manual_seed(0)
        emb = TextEmbedding(V, d, max_len=n)
        head = LMHead(d, V)
        head.tie_to(emb.embed)
        backbone = build_backbone(
            d,
            L,
            AttentionConfig(H, kernel=kernel),
            mlp=MlpConfig(act="gelu_tanh"),
            norm_eps=1e-5,
            causal=True,
        )
        model = MultimodalModel({"text": emb}, backbone, {"lm": head}).to(device)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)

        encode = torch.compile(model.encode) if compiled == "whole" else model.encode
        if compiled == "blocks":
            compile_blocks(model)

        def loss_fn(model=model, encode=encode):
            hidden, _ = encode("text", ids)
            return model.heads["lm"].cross_entropy(hidden[:, :-1], ids[:, 1:])

        def step(model=model, opt=opt, loss_fn=loss_fn):
            with torch.autocast(device, dtype=torch.bfloat16):
                loss = loss_fn()
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            return loss

        row = {"variant": name, "batch": batch, "tokens": n}
        try:
            if device == "cuda":
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()
            t0 = time.perf_counter()
            row["first_loss"] = float(step())  # ln V ≈ 10.8 at initialisation
            first = time.perf_counter() - t0
            t = timed(step, device, repeats=10, warmup=2)
            flops = lm_step_flops(model.backbone, V, batch, n)
            row.update(
                ms=t * 1e3,
                tokens_per_s=batch * n / t,
                tflops=flops / t / 1e12,
                mfu_measured_peak=flops / t / peak,
                mfu_spec=flops / t / spec if spec else None,
                first_step_s=first,
                compile_s=max(first - t, 0.0),
                peak_gb=torch.cuda.max_memory_allocated() / 2**30 if device == "cuda" else None,
            )
            print(
                f"6. GPT-2-medium LM bf16 step, {name:24s} batch {batch} × {n}: {t * 1e3:8.1f} ms, "
                f"{batch * n / t:8.0f} tokens/s, {flops / t / 1e12:6.1f} TFLOP/s, "
                f"MFU {100 * flops / t / peak:5.1f} % of measured peak"
                + (f" ({100 * flops / t / spec:5.1f} % of spec)" if spec else "")
                + f", first step {first:.1f} s, loss {row['first_loss']:.3f}"
                + (f", peak {row['peak_gb']:.1f} GiB" if row["peak_gb"] else "")
            )
        except Exception as e:  # noqa: BLE001 - one variant failing must not hide the others
            row["error"] = f"{type(e).__name__}: {str(e)[:500]}"
            print(f"6. GPT-2-medium LM bf16 step, {name}: FAILED: {row['error'][:200]}")
        rows.append(row)
        RESULTS["gpt2_medium"] = rows
        save()
        del model, opt, emb, head, backbone, encode, loss_fn, step  # the closures hold the model too
        torch._dynamo.reset()  # compiled blocks hold themselves in a cycle: free their code first
        gc.collect()
        if device == "cuda":
            torch.cuda.empty_cache()
            row["left_allocated_gb"] = torch.cuda.memory_allocated() / 2**30  # ~0: nothing leaks


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cpu-smoke", action="store_true", help="tiny sizes on CPU, to check the script itself")
    p.add_argument("--only", default=None, help=f"comma-separated sections of {', '.join(SECTIONS)}")
    a = p.parse_args()
    only = set(a.only.split(",")) if a.only else set(SECTIONS)
    if only - set(SECTIONS):
        raise SystemExit(f"unknown sections {sorted(only - set(SECTIONS))}; sections: {', '.join(SECTIONS)}")
    device = "cpu" if a.cpu_smoke else "cuda"
    if device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("no CUDA device: run on a GPU machine, or use --cpu-smoke")
    RESULTS["device"] = torch.cuda.get_device_name() if device == "cuda" else "cpu"
    RESULTS["torch"] = torch.__version__
    print(f"device: {RESULTS['device']}, torch {torch.__version__}")
    for knob in ("recompile_limit", "cache_size_limit"):  # many distinct flex graphs in one process
        if hasattr(torch._dynamo.config, knob):
            setattr(torch._dynamo.config, knob, 256)
    big = device == "cuda"
    if "sdpa_backends" in only:
        section("sdpa_backends", check_sdpa_backends, device, 4096 if big else 64)
    if "sdpa_dense" in only:
        section("sdpa_dense", check_sdpa_dense, device, 1024 if big else 32)
    if "flex_vs_eager" in only:
        section("flex_vs_eager", check_flex, device, 1024 if big else 64)
    if "attention" in only:
        shapes = [(4096, 64), (8192, 64), (16384, 64), (16384, 128)] if big else [(128, 64)]
        section("attention", attention_tflops, device, shapes)
    peak = None
    if only & {"matmul_peak", "train_step", "gpt2_medium"}:
        peak = section("matmul_peak", matmul_peak, device, 8192 if big else 256)
    peak = peak or spec_peak(RESULTS["device"]) or BF16_SPEC["H100"]
    if "gpt2_medium" in only:
        section("gpt2_medium", gpt2_medium_mfu, device, peak, not big)
    if "train_step" in only:
        section("train_step", train_step_mfu, device, peak, backbone_sizes(big))
    print("errors:", RESULTS.get("errors", "none"))


if __name__ == "__main__":
    main()
