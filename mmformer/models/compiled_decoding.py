"""One decoding step as a compiled graph: ``torch.compile`` (inductor) of the model's forward with
``freezing``, for ``generate(..., compile=True)``.

Why: a KV-cache decoding step of a small model spends ~45 % of its time on ~1,600 small operators
and the Python around them (``bench/README.md``, "Where a decoding step goes"); eager mode cannot
remove that, a graph can. Inductor fuses the norms, RoPE, SiLU and residual adds of every block into a
few generated kernels, and ``freezing`` (inference only) treats the weights as constants and
prepacks them for the CPU's matrix kernels (``torch._inductor.config.freezing``; measured at batch 4
while a graph break still split every block: 0.76× eager without freezing, 1.07× with). The blocks
trace as one graph: the only data-dependent checks left run before them (``MaskSpec.from_tokens``).
Measured on the real SmolLM2-135M, 2 CPU threads, against transformers' ``generate`` in the same run:
batch 1 **1.46×**, batch 4 **1.37×** its speed, the same greedy ids (``python bench/peers.py --only
generate --compile-decoding``; eager mmformer is at parity with it); 1.34× / 1.33× at 1 thread beside
other jobs, and 1.05× / 1.12× transformers' own static cache + ``torch.compile`` (``--peer-compile``).

Costs: the first call compiles (about 1.5 minutes for SmolLM2's 30 blocks at batch 1, 1 thread, and
about 4 more when a batch of several rows follows; every process again: inductor's on-disk cache skips
graphs holding prepacked weights); prepacked weights may add a copy in memory.
Shapes are dynamic (``dynamic=True``): a growing cache, another prompt length or capacity do not
recompile; going from batch 1 to more rows does, once.

Frozen weights would silently go stale if the parameters changed afterwards (a training step, a
``load_state_dict``) or another model of the same class came along: every parameter's identity,
version counter and storage are recorded at compile time and compared at each ``compiled_step``
call, and any change compiles anew, from a clean slate (``compiled_step`` says what it cannot see).
Meant for inference on fixed weights (``mmformer generate --compile``, benchmarks, serving), not for
samples generated between training steps.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch._inductor.config as inductor_config
from torch import nn

_current: dict = {}  # the one compiled step: its model, the weights' fingerprint, the step


def _fingerprint(model: nn.Module) -> tuple:
    """Per parameter and buffer: identity, in-place-modification counter, storage, dtype, device, strides —
    what changes when weights are updated in place (optimizer steps, ``load_state_dict``), replaced
    (``assign=True``, LoRA merges) or re-stored (``p.data = …``, ``.to()``)."""
    return tuple(
        (id(t), t._version, t.data_ptr(), t.dtype, t.device, t.stride())
        for t in (*model.parameters(), *model.buffers())
    )


def compiled_step(model: nn.Module) -> Callable:
    """The compiled ``model.forward`` for decoding steps (call it under ``torch.no_grad``), compiled at
    the first call and reused while it is asked for the same model with unchanged weights. Same
    arguments and result as ``model.forward`` up to the rounding of fused kernels (greedy ids equal the
    eager model's in ``tests/models/test_compiled_decoding.py`` and in ``bench/peers.py``).

    For another model, or after the weights changed (``_fingerprint``), every compiled graph of the
    process is dropped first (``torch._dynamo.reset()``): dynamo keys its compiled code by the Python
    function, not by the module's weights, so a frozen graph would otherwise be reused with the old
    values (tested). Other ``torch.compile``d code of the process (compiled training blocks) recompiles
    at its next call; alternating between two models recompiles at every switch. Not detected: writes
    through ``p.data`` (``p.data.copy_(…)``), which bypass the version counter — call ``clear()`` after
    them. The last model stays referenced (and its graphs cached by dynamo) until ``clear()``.
    """
    fingerprint = _fingerprint(model)
    if _current.get("model") is not model or _current["fingerprint"] != fingerprint:
        if _current:
            torch._dynamo.reset()
        _current.update(
            model=model,
            fingerprint=fingerprint,
            step=_frozen(torch.compile(model.forward, dynamic=True)),
        )
    return _current["step"]


def clear() -> None:
    """Forget the compiled step and every graph dynamo holds (``torch._dynamo.reset()``), releasing the
    model and its frozen weights."""
    if _current:
        _current.clear()
        torch._dynamo.reset()


def _frozen(compiled: Callable) -> Callable:
    """``compiled`` run with inductor's ``freezing`` on: it is read from the global config while a graph
    compiles (at the first call, and at recompiles), which ``torch.compile(options=...)`` does not reach."""

    def step(*args, **kwargs):
        with inductor_config.patch(freezing=True):
            return compiled(*args, **kwargs)

    return step
