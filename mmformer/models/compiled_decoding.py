"""Compiled decoding steps, for ``generate(..., compile=True | "cached" | "frozen")``: ``torch.compile``
(inductor) of ``Backbone.run_blocks`` (``cached``) or of the whole forward with frozen weights (``frozen``).

Why: a KV-cache decoding step of a small model spends ~45 % of its time on ~1,600 small operators
and the Python around them (``bench/README.md``, "Where a decoding step goes"); eager mode cannot
remove that, a graph can. Inductor fuses the norms, RoPE, SiLU and residual adds of every block into a
few generated kernels. In ``cached`` mode what is compiled is the loop over the blocks only: the checks
before them (``Backbone.attention_inputs``: ``MaskSpec.from_tokens``, the positions check) run eagerly,
so the blocks trace as one graph, once, with no graph break and no restarted trace (module floats such
as the norms' ``eps`` are specialized: left symbolic under ``dynamic=True`` they restart the trace).

Two modes, measured on the real SmolLM2-135M, 1 CPU thread (``bench/README.md``, "A compiled decoding
step"):

- ``cached`` (``compile=True``): the weights are graph inputs, so inductor's FX graph cache and
  AOTAutograd's cache store the compiled graph on disk (``TORCHINDUCTOR_CACHE_DIR``, by default under
  the system temp folder) and a later process loads it: ``mmformer generate --compile`` took 54 s with an
  empty cache and 19 s with a warm one (13 s eager). Per token 1.62× transformers' eager ``generate``
  at batch 1 (the head, after the blocks, eagerly on a column-major copy: ``nn.packed``), only 1.16× at
  batch 4 on that CPU, whose four-row products are 1.7–2.9× faster on oneDNN-packed weights than MKL's
  on plain ones. So where oneDNN is the faster library (``nn.onednn.faster_here``), several rows'
  products run in the graph as ``mmformer::packed_linear`` (``nn.packed``): one opaque operator that
  finds the packed copy of the weight it is given at run time (never a stale one), so the weights stay
  graph inputs and the graph stays cacheable. On a CPU where oneDNN is slower the blocks keep MKL's
  products: 1.30× / 1.47× transformers' eager ``generate`` at batch 1 / 4 there, 1.28× / 1.42× with
  the packing forced.
- ``frozen``: the whole forward compiled with inductor's ``freezing``, which makes the weights constants
  and prepacks them for oneDNN's matrix kernels — 1.49× / 1.71× transformers' eager ``generate`` at
  batch 1 / 4 — but prepacked (mkldnn) constants cannot be pickled into inductor's cache and AOTAutograd
  refuses frozen graphs, so every process compiles again (80–110 s at 1 thread). It compiles the whole forward, not
  the blocks alone: freezing the blocks' graph failed in inductor (a size argument bound to a weight)
  when the mask's key count equalled the head size. A frozen graph holds the weights it was compiled
  with: ``compiled_step`` fingerprints them and compiles anew after any change.

Shapes are dynamic (``dynamic=True``): a growing cache, another prompt length or capacity do not
recompile; going from batch 1 to more rows does, once. One more compile happens when, at the first
compiled step of padded rows, the number of cached keys + 1 equals a static size of the model (the
head size, say): dynamo gives equal sizes one symbol ("duck sizing"), so the mask's key dimension is
specialized with it (turning duck sizing off trips an assertion in torch 2.14's guards for the cache's
buffers). In ``cached`` mode weights are read at every call, so training between generations, loading
other weights or decoding another model of the same architecture never runs stale values (a change of
strides or dtypes recompiles). A reversible backbone (``block.reversible``) decodes eagerly.

A compile that fails inside torch (dynamo, inductor) does not end the generation: torch's own fallback
(``torch._dynamo.config.suppress_errors``, set while a step runs) logs the error as a warning and runs the
compiled function's frame uncompiled from then on in the process — the same ids — though dynamo still
compiles the functions it calls (the blocks, one graph per layer up to its recompile limit). torch 2.14
failed now and then while building the shape guards of a recompile (``sources must not be empty for
symbol s…``) in prompt lookup: when its verification width followed the timed draft lengths (~1 call in
40 under load), and, less often, when the one-position graph was recompiled for the draft's width. So
prompt lookup verifies at two widths only (``prompt_lookup_greedy(fixed_width=True)``), and each width and
batch size is compiled as a function of its own (``_blocks_per_shape``), never as a recompile of another's
graph.
"""

from __future__ import annotations

import types
from collections.abc import Callable

import torch
import torch._inductor.config as inductor_config
from torch import nn

MODES = ("cached", "frozen")
_current: dict = {}  # the one compiled step: its model, tokenizer, mode, weights' fingerprint and the step


def _fingerprint(model: nn.Module) -> tuple:
    """Per parameter and buffer: identity, in-place-modification counter, storage, dtype, device, strides —
    what changes when weights are updated in place (optimizer steps, ``load_state_dict``), replaced
    (``assign=True``, LoRA merges) or re-stored (``p.data = …``, ``.to()``)."""
    return tuple(
        (id(t), t._version, t.data_ptr(), t.dtype, t.device, t.stride())
        for t in (*model.parameters(), *model.buffers())
    )


def compiled_step(model: nn.Module, tokenizer: str, mode: str = "cached") -> Callable:
    """``model.forward`` for decoding steps (call it under ``torch.no_grad``) with the blocks of the
    backbone that reads ``tokenizer`` (``model.backbone_of``) compiled; compiled at the first call, reused
    while it is asked for the same model, tokenizer and mode (and, ``frozen``, unchanged weights). Same
    arguments and result as ``model.forward`` up to the rounding of fused kernels (greedy ids equal the
    eager model's in ``tests/models/test_compiled_decoding.py`` and in ``bench/peers.py``). Only the calls
    of the returned step run compiled: the model's own forward (the prefill, training) stays eager.

    ``mode``: ``cached`` (weights are graph inputs; the graph is stored on disk) or ``frozen`` (weights
    are constants, prepacked; compiled in every process). A frozen graph holds the weights it was
    compiled with, so after any change of them (``_fingerprint``) or for another model every compiled
    graph of the process is dropped first (``torch._dynamo.reset()``: dynamo keys its code by function,
    not by weights; other compiled code of the process recompiles at its next call). Not detected: writes
    through ``p.data`` (``p.data.copy_(…)``), which bypass the version counter — call ``clear()`` after
    them. Raises ``ValueError`` for another ``mode``.
    """
    if mode not in MODES:
        raise ValueError(f"compile mode {mode!r}: choose one of {MODES}")
    fingerprint = _fingerprint(model) if mode == "frozen" else None
    key = (model, tokenizer, mode)
    if _current.get("key") != key or _current["fingerprint"] != fingerprint:
        if _current.get("key", (None, None, None))[2] == "frozen" or mode == "frozen":
            torch._dynamo.reset()  # no frozen graph may serve other weights
        if mode == "frozen":
            step = _frozen(torch.compile(model.forward, dynamic=True))
        else:
            backbone = model.backbone_of(tokenizer)
            step = _with_compiled_blocks(model, backbone, _blocks_per_shape(backbone))
        _current.update(key=key, fingerprint=fingerprint, step=step)
    return _current["step"]


def clear() -> None:
    """Forget the compiled step and every graph dynamo holds in this process (``torch._dynamo.reset()``),
    releasing the model and any frozen weights; the on-disk cache stays."""
    if _current:
        _current.clear()
        torch._dynamo.reset()


def _blocks_per_shape(backbone: nn.Module) -> Callable:
    """``backbone.run_blocks`` compiled once for one position per row (a decoding step) and, at its first
    use, once more for several (prompt lookup's verification of a draft), as two functions: two code
    objects, so each width is a first compile of its own instead of a recompile of the other's graph;
    likewise each batch size (the recompile from one prompt to a batch of four failed the same way).
    torch 2.14's recompile from width 1 to a symbolic width failed now and then while building its shape
    guards (``sources must not be empty for symbol s…``, seen on a test-sized model); dynamo then skipped
    the loop and compiled the blocks one by one, each layer a recompile up to its limit of 8, the rest
    eager. (A graph break does the same: the one SmolLM2-135M met, sdpa's ``is_causal`` given a SymBool,
    cost its first prompt-lookup call 50 s and its drafted steps their speed; fixed in ``nn.attention``.)"""
    compiled: dict[tuple[bool, int], Callable] = {}
    fn = type(backbone).run_blocks

    def blocks(x, *args, **kwargs):
        key = (x.shape[1] > 1, x.shape[0])  # (a draft's width, rows): each a first compile of its own
        if key not in compiled:
            name = "run_blocks" if not compiled else f"run_blocks_{'wide' if key[0] else 'one'}_{key[1]}"
            code = fn.__code__.replace(co_name=name)
            copy = types.FunctionType(code, fn.__globals__, name, fn.__defaults__, fn.__closure__)
            compiled[key] = torch.compile(types.MethodType(copy, backbone), dynamic=True)
        return compiled[key](x, *args, **kwargs)

    return blocks


def _with_compiled_blocks(model: nn.Module, backbone: nn.Module, blocks: Callable) -> Callable:
    """``model``'s forward with ``backbone.compiled_blocks`` set to ``blocks`` for the duration of the call
    (``Backbone.forward`` runs it in place of ``run_blocks``), module floats specialized while it compiles
    (dynamo reads its config then, which ``torch.compile``'s arguments do not reach) and compile errors
    falling back to eager (module docstring)."""

    def step(*args, **kwargs):
        backbone.compiled_blocks = blocks
        try:
            with torch._dynamo.config.patch(specialize_float=True, suppress_errors=True):
                return model(*args, **kwargs)
        finally:
            backbone.compiled_blocks = None

    return step


def _frozen(compiled: Callable) -> Callable:
    """``compiled`` run with inductor's ``freezing`` on: it is read from the global config while a graph
    compiles (at the first call, and at recompiles), which ``torch.compile(options=...)`` does not reach;
    compile errors falling back to eager (module docstring)."""

    def step(*args, **kwargs):
        with inductor_config.patch(freezing=True), torch._dynamo.config.patch(suppress_errors=True):
            return compiled(*args, **kwargs)

    return step
