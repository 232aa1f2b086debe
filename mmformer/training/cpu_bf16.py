"""bfloat16 on a CPU: computed by oneDNN's kernels, or by PyTorch's slow fallback where they are missing.

``trainer.precision: bf16-mixed`` (Lightning's ``torch.autocast("cpu", torch.bfloat16)``) and
``bf16-true`` run a CPU's matrix products and convolutions in bfloat16 through oneDNN, whose bfloat16
kernels need AVX-512 (``avx512bw``, ``avx512vl``, ``avx512dq``; native with AVX512-BF16 or AMX, converted
on the fly without them): ``torch.ops.mkldnn._is_mkldnn_bf16_supported()``, what PyTorch's own CPU
autocast tests and inductor ask. On a CPU without them (AVX2 only) PyTorch falls back to a reference
bfloat16 product. Measured on an AMD EPYC with AVX2 (2026-12-06, 1 thread): a 1024 × 1024 product 35 ms in
float32 against 2,220 ms in bfloat16 (63×); ``recipes/multimodal/whisper_tiny_lora_asr_asterisk.yaml``
trained 0.05 samples/s with ``bf16-mixed`` against 0.48 with ``32-true``. ``mmformer train`` prints
:func:`bf16_hint`'s line at the start of such a run, so that nobody waits hours for what float32 does in
minutes; it changes nothing itself (the recipe's precision is the user's choice, and numbers that must
match a GPU run's bfloat16 need it).
"""

from __future__ import annotations

import torch


def onednn_bf16() -> bool:
    """Whether this CPU has oneDNN's bfloat16 kernels (AVX-512 or newer; ``False`` where it cannot be asked)."""
    try:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):  # a build without oneDNN
        return False


def bf16_hint(precision: str, device_type: str, supported: bool | None = None) -> str:
    """A one-line warning when ``precision`` (``trainer.precision``: ``bf16-mixed``, ``bf16-true``, ``bf16``)
    runs on a ``device_type == "cpu"`` without oneDNN's bfloat16 kernels (``supported``; asked with
    :func:`onednn_bf16` when ``None``), else ``""``."""
    if device_type != "cpu" or not str(precision).startswith("bf16"):
        return ""
    if supported is None:
        supported = onednn_bf16()
    if supported:
        return ""
    return (
        f"trainer.precision={precision} on a CPU without oneDNN's bfloat16 kernels (they need AVX-512; this "
        f"one: {torch.backends.cpu.get_cpu_capability()}): its bfloat16 products run PyTorch's slow "
        "fallback, tens of times slower than float32 here; trainer.precision=32-true trains in float32"
    )
