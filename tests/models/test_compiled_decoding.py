"""``generate(..., compile=True)``: the blocks of every decoding step as one compiled graph (inductor)
give the eager model's ids, read the current weights at every call, and load from inductor's on-disk
cache in a later process. The compiles themselves take a minute (slow tier); when a step is reused,
what is traced and the hook's lifetime are checked without them (fast tier)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from mmformer.models import compiled_decoding
from mmformer.models import generate as generate_module
from mmformer.models.generate import generate
from tests.nn.test_layout import _model as tiny_llama  # decisive argmaxes: no near-ties to round apart

ROOT = Path(__file__).resolve().parents[2]


def _prompts(rows: int = 2, n: int = 7) -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.randint(1, 96, (rows, n), generator=torch.Generator().manual_seed(1))
    valid = torch.ones_like(ids, dtype=torch.bool)
    valid[1:, :3] = False  # rows after the first are n - 3 tokens, left-padded
    return ids, valid


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["cached", "cached-packed", "frozen"])
def test_compiled_steps_generate_the_eager_ids_and_follow_weight_changes(mode, monkeypatch):
    """``cached-packed``: the cached blocks multiply on oneDNN-packed weights (``nn.packed``), as they do
    where oneDNN is the faster library; forced here whatever this CPU measures."""
    if mode == "cached-packed":
        monkeypatch.setattr(generate_module, "faster_here", lambda: True)
        mode = "cached"
    model = tiny_llama().eval()
    ids, valid = _prompts()

    def both(n, m=model):
        eager = generate(m, "text", "lm", ids, valid, n)
        compiled = generate(m, "text", "lm", ids, valid, n, compile=mode)
        return eager, compiled

    try:
        eager, compiled = both(12)
        assert compiled == eager and len(set(map(tuple, eager))) == 2
        step = compiled_decoding._current["step"]
        eager, compiled = both(9)  # other lengths and cache capacity: the same compiled step
        assert compiled == eager and compiled_decoding._current["step"] is step

        with torch.no_grad():  # a training step's in-place update: never the old weights
            for p in model.parameters():
                p.add_(torch.randn_like(p), alpha=0.5)
        changed, compiled = both(12)
        assert compiled == changed and changed != eager

        with torch.no_grad():  # weights re-stored without an in-place write (no version bump)
            for p in model.parameters():
                p.data = p.data * 0.7 - 0.02
        restored, compiled = both(12)
        assert compiled == restored != changed

        other = tiny_llama().eval()  # another model of the same class: its own weights, not the last
        want, compiled = both(12, other)
        assert compiled == want != restored
        assert model.backbone.compiled_blocks is None and other.backbone.compiled_blocks is None
    finally:
        compiled_decoding.clear()
    assert not compiled_decoding._current


@pytest.mark.slow
def test_compiled_blocks_verify_prompt_lookup_drafts(capfd):
    """A token and its draft (several positions) through the compiled blocks: greedy decoding's ids, with
    drafts kept and rejected, and the compiled step reused by the next call. After a greedy call compiled
    the one-position graph, the draft's width is a compile of its own, not a recompile of that graph
    (which failed in torch 2.14 and left the blocks compiled one layer at a time: ``_blocks_per_shape``)."""
    model = tiny_llama().eval()
    ids, valid = _prompts()
    want = generate(model, "text", "lm", ids, valid, 24)
    kwargs = {"prompt_lookup_num_tokens": 4, "min_matching_ngram_size": 1, "compile": True}
    try:
        assert generate(model, "text", "lm", ids, valid, 12, compile=True) == [r[:12] for r in want]
        stats: dict = {}
        assert generate(model, "text", "lm", ids, valid, 24, stats=stats, **kwargs) == want
        assert 0 < stats["accepted"] < stats["drafted"]
        step = compiled_decoding._current["step"]
        assert generate(model, "text", "lm", ids, valid, 20, **kwargs) == [r[:20] for r in want]
        assert compiled_decoding._current["step"] is step
    finally:
        compiled_decoding.clear()
    err = capfd.readouterr().err
    assert "WON'T CONVERT" not in err and "recompile_limit" not in err, err[-2000:]


@pytest.mark.slow
def test_a_compile_that_fails_inside_torch_decodes_eagerly_with_the_same_ids(monkeypatch, capfd):
    """torch 2.14 failed now and then while building a recompile's shape guards; that function raises
    its error here at every compile: the generation goes on eagerly (torch's ``suppress_errors``
    fallback), says why, and gives the eager ids. (``frozen`` mode sets the same fallback.)"""
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    def failing(self, *args, **kwargs):
        raise AssertionError("sources must not be empty for symbol s31")

    model = tiny_llama().eval()
    ids, valid = _prompts()
    want = generate(model, "text", "lm", ids, valid, 8)
    monkeypatch.setattr(ShapeEnv, "produce_guards_verbose", failing)
    try:
        assert generate(model, "text", "lm", ids, valid, 8, compile=True) == want
        assert generate(model, "text", "lm", ids, valid, 8, compile=True, prompt_lookup_num_tokens=3) == want
    finally:
        compiled_decoding.clear()
    assert "sources must not be empty for symbol s31" in capfd.readouterr().err


_LOAD_TWICE = textwrap.dedent(
    """
    import json, os, torch
    from torch._dynamo.utils import counters
    from mmformer.models import generate as generate_module
    from mmformer.models.generate import generate
    # the library fixed in both processes: faster_here() times oneDNN against PyTorch in each process, and
    # under load two processes can choose differently (other graphs, so no cache hit to find)
    packed = bool(os.environ.get("PACKED"))  # the blocks on packed weights, as where oneDNN is faster
    generate_module.faster_here = lambda: packed
    from tests.models.test_compiled_decoding import _prompts
    from tests.nn.test_layout import _model as tiny_llama
    torch.set_num_threads(1)
    ids, valid = _prompts()
    out = generate(tiny_llama().eval(), "text", "lm", ids, valid, 6, compile=True)
    print(json.dumps({"ids": out, **{k: dict(counters[k]) for k in ("inductor", "aot_autograd")}}))
    """
)


@pytest.mark.slow
@pytest.mark.parametrize("packed", [False, True])
def test_a_later_process_loads_the_compiled_step_from_the_disk_cache(tmp_path, packed):
    """Two processes with the same (empty, private) inductor cache: the first compiles and stores the
    graph, the second finds it — FX graph and AOTAutograd cache hits, nothing compiled — and gives the
    same ids. (Frozen weights defeated both caches: every process compiled again.) ``packed``: the
    graph's products are ``mmformer::packed_linear`` (oneDNN-packed weights found at run time), which
    the cache keeps too."""
    env = {
        **os.environ,
        "TORCHINDUCTOR_CACHE_DIR": str(tmp_path),
        "PYTHONPATH": str(ROOT),
        "OMP_NUM_THREADS": "1",
        "PACKED": "1" if packed else "",
    }

    def run() -> dict:
        done = subprocess.run(
            [sys.executable, "-c", _LOAD_TWICE],
            env=env,
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=600,
        )
        assert done.returncode == 0, done.stderr[-3000:]
        return json.loads(done.stdout.strip().splitlines()[-1])

    first, second = run(), run()
    assert first["inductor"].get("fxgraph_cache_miss", 0) >= 1 and not first["inductor"].get(
        "fxgraph_cache_hit"
    )
    assert second["inductor"].get("fxgraph_cache_hit", 0) >= 1
    assert not second["inductor"].get("fxgraph_cache_miss") and not second["inductor"].get(
        "fxgraph_cache_bypass"
    )
    assert second["aot_autograd"].get("autograd_cache_hit", 0) >= 1
    assert second["ids"] == first["ids"]


def test_the_step_is_reused_per_model_and_the_hook_lives_for_one_call(monkeypatch):
    """``compiled_step``'s bookkeeping with ``torch.compile`` replaced by a recorder around the eager
    blocks: one compile per model (weight changes need none: the graph reads the weights), the
    compiled blocks run only inside the step's calls (the prefill, a plain forward and a failing step
    leave the backbone eager), ``clear`` forgets the step."""
    compiled_decoding.clear()
    compiles, runs = [], []

    def fake_compile(fn, **kwargs):
        compiles.append(kwargs)

        def blocks(x, *args):
            runs.append(x.shape[1])
            return fn(x, *args)

        return blocks

    monkeypatch.setattr(torch, "compile", fake_compile)
    model = tiny_llama().eval()
    ids, valid = _prompts()
    try:
        want = generate(model, "text", "lm", ids, valid, 5)
        assert generate(model, "text", "lm", ids, valid, 5, compile=True) == want
        assert compiles == [{"dynamic": True}] and runs == [1, 1, 1, 1]  # the steps, not the prefill
        step = compiled_decoding._current["step"]
        with torch.no_grad():
            for p in model.parameters():
                p.add_(torch.randn_like(p), alpha=0.5)
        assert generate(model, "text", "lm", ids, valid, 5, compile=True) == generate(
            model, "text", "lm", ids, valid, 5
        )
        assert compiled_decoding._current["step"] is step and len(compiles) == 1
        assert model.backbone.compiled_blocks is None
        with torch.no_grad():
            model(ids, "text", "lm", valid=valid)  # a plain forward: eager
        assert len(runs) == 8
        with pytest.raises(KeyError):  # a step that fails still unsets the hook
            step(ids[:, :1], "text", "no-such-head", valid=valid[:, :1])
        assert model.backbone.compiled_blocks is None

        other = tiny_llama().eval()
        generate(other, "text", "lm", ids, valid, 3, compile=True)
        assert compiled_decoding._current["key"][0] is other and len(compiles) == 2
    finally:
        compiled_decoding.clear()
    assert not compiled_decoding._current


@pytest.mark.parametrize("rows, packed", [(1, False), (2, False), (2, True)])
def test_the_blocks_trace_once_for_every_decoding_step(monkeypatch, rows, packed):
    """One frame, one graph, for every decoding step of this call and the next (other prompt capacity,
    other lengths): the data-dependent checks before the blocks stay eager, so nothing breaks the graph
    and no later step retraces. A counting backend instead of inductor: tracing only, seconds. (Prompts
    of 9: with 7, the first step's 8 keys equal the head size and are specialized with it, see
    ``compiled_decoding``.) ``packed``: the blocks' products on oneDNN-packed weights (where oneDNN is
    the faster library; forced here), each one ``mmformer::packed_linear`` in the graph, every block's
    linear found packed at run time."""
    from mmformer.nn import packed as packed_module

    compiled_decoding.clear()
    graphs, compile = [], torch.compile

    def backend(gm, example_inputs):  # records the traced graph, runs it eagerly
        graphs.append(gm)
        return gm.forward

    monkeypatch.setattr(torch, "compile", lambda fn, **kwargs: compile(fn, backend=backend, **kwargs))
    monkeypatch.setattr(generate_module, "faster_here", lambda: packed)
    products, real = [], packed_module._product
    monkeypatch.setattr(packed_module, "_product", lambda *a: products.append(1) or real(*a))
    model = tiny_llama().eval()
    ids, valid = _prompts(rows, 9)
    try:
        want = generate(model, "text", "lm", ids, valid, 8)  # 7 steps after the prefill
        assert generate(model, "text", "lm", ids, valid, 3, compile=True) == [w[:3] for w in want]
        assert len(graphs) == 1
        assert generate(model, "text", "lm", ids, valid, 8, compile=True) == want  # 7 steps, other lengths
        assert len(graphs) == 1
        ops = [n for n in graphs[0].graph.nodes if "packed_linear" in str(n.target)]
        linears = sum(isinstance(m, torch.nn.Linear) for m in model.backbone.modules())
        assert len(ops) == (linears if packed else 0)
        # oneDNN products on packed weights: none at one row (column-major weights instead); at two, every
        # linear of the 7 eager steps, and of the 2 + 7 compiled steps the head, or every linear if packed
        per_compiled_step = linears + 1 if packed else 1
        assert len(products) == (0 if rows == 1 else 7 * (linears + 1) + 9 * per_compiled_step)
    finally:
        compiled_decoding.clear()


def test_a_frozen_step_is_rebuilt_after_any_weight_change(monkeypatch):
    """``frozen`` mode's bookkeeping (``torch.compile`` and ``torch._dynamo.reset`` recorded): the same step
    while the weights stay; after an in-place update, re-stored weights or for another model, every graph
    is dropped and the blocks compile again; a cached step after a frozen one drops the frozen graphs
    too; an unknown mode is refused."""
    compiled_decoding.clear()
    compiles, resets = [], []
    monkeypatch.setattr(torch, "compile", lambda fn, **kwargs: compiles.append(kwargs) or fn)
    monkeypatch.setattr(torch._dynamo, "reset", lambda: resets.append(1))
    model = tiny_llama().eval()
    ids, valid = _prompts()

    def step(m=model, mode="frozen"):
        out = generate(m, "text", "lm", ids, valid, 4, compile=mode)
        assert out == generate(m, "text", "lm", ids, valid, 4)
        return compiled_decoding._current["step"]

    try:
        first = step()
        assert step() is first and len(compiles) == 1 and len(resets) == 1
        with torch.no_grad():
            for p in model.parameters():
                p.add_(torch.randn_like(p), alpha=0.5)
        second = step()
        assert second is not first and len(compiles) == 2 and len(resets) == 2
        with torch.no_grad():  # re-stored without an in-place write (no version bump)
            for p in model.parameters():
                p.data = p.data * 0.7 - 0.02
        assert step() is not second and len(compiles) == 3 and len(resets) == 3
        step(tiny_llama().eval())
        assert len(compiles) == 4 and len(resets) == 4
        step(mode="cached")
        assert len(compiles) == 5 and len(resets) == 5
        with pytest.raises(ValueError, match="cached"):
            generate(model, "text", "lm", ids, valid, 4, compile="fast")
    finally:
        compiled_decoding.clear()


def test_prompt_lookup_traces_the_draft_width_as_whole_blocks(monkeypatch):
    """One unpadded prompt with drafts: the verification forward (1 + N positions against a longer cache)
    traces as the whole loop over the blocks with no graph break — ``Nq == Nk`` is symbolic there and
    sdpa's ``is_causal`` takes a bool only; a break left the blocks compiled one layer at a time — and the
    next prompt retraces nothing (recompiles add up to dynamo's limit in a long-lived process, past which
    it compiles layer by layer again). A recording backend instead of inductor: tracing only."""
    from torch._dynamo.utils import counters

    compiled_decoding.clear()
    counters.clear()
    graphs, compile = [], torch.compile

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    monkeypatch.setattr(torch, "compile", lambda fn, **kwargs: compile(fn, backend=backend, **kwargs))
    model = tiny_llama().eval()
    ids, valid = _prompts(1, 9)
    kwargs = {"prompt_lookup_num_tokens": 4, "min_matching_ngram_size": 1, "compile": True}
    try:
        stats: dict = {}
        assert generate(model, "text", "lm", ids, valid, 24, stats=stats, **kwargs) == generate(
            model, "text", "lm", ids, valid, 24
        )
        assert stats["drafted"] > 0
        # another prompt length and budget: no retrace. One graph per width (one position; 1 + N) — the
        # cache has room for a draft verified at the last step, so its buffers never grow in a graph
        ids, valid = _prompts(1, 11)
        want = generate(model, "text", "lm", ids, valid, 20)
        assert generate(model, "text", "lm", ids, valid, 20, **kwargs) == want
        assert len(graphs) == 2
    finally:
        compiled_decoding.clear()
    assert not counters["graph_break"], dict(counters["graph_break"])
    last = len(model.backbone.blocks) - 1
    for gm in graphs:  # each graph holds every block, the last one included
        names = [n.name for n in gm.graph.nodes if n.op == "placeholder"]
        assert any(f"blocks_modules_{last}_" in n for n in names)
