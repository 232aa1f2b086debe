"""``generate(..., compile=True)``: the decoding steps as one compiled graph (inductor, frozen weights)
give the eager model's ids, and frozen weights never go stale after the parameters change. The compile
itself takes minutes (slow tier); when a step is reused or rebuilt is checked without it (fast tier)."""

from __future__ import annotations

import pytest
import torch

from mmformer.models import compiled_decoding
from mmformer.models.generate import generate
from tests.nn.test_layout import _model as tiny_llama  # decisive argmaxes: no near-ties to round apart


@pytest.mark.slow
def test_compiled_steps_generate_the_eager_ids_and_follow_weight_changes():
    model = tiny_llama().eval()
    ids = torch.randint(1, 96, (2, 7), generator=torch.Generator().manual_seed(1))
    valid = torch.ones_like(ids, dtype=torch.bool)
    valid[1, :3] = False  # the second prompt is 4 tokens, left-padded

    def both(n):
        eager = generate(model, "text", "lm", ids, valid, n)
        compiled = generate(model, "text", "lm", ids, valid, n, compile=True)
        return eager, compiled

    eager, compiled = both(12)
    assert compiled == eager and len(set(map(tuple, eager))) == 2
    step = compiled_decoding._current["step"]
    eager, compiled = both(9)  # other lengths and cache capacity: the same compiled step
    assert compiled == eager and compiled_decoding._current["step"] is step

    with torch.no_grad():  # a training step's in-place update: frozen weights must not be reused
        for p in model.parameters():
            p.add_(torch.randn_like(p), alpha=0.5)
    changed, compiled = both(12)
    assert compiled == changed and changed != eager
    assert compiled_decoding._current["step"] is not step

    step = compiled_decoding._current["step"]
    with torch.no_grad():  # weights re-stored without an in-place write (no version bump)
        for p in model.parameters():
            p.data = p.data * 0.7 - 0.02
    restored, compiled = both(12)
    assert compiled == restored != changed and compiled_decoding._current["step"] is not step

    other = tiny_llama().eval()  # another model of the same class: its own weights, not the last
    want = generate(other, "text", "lm", ids, valid, 12)
    assert generate(other, "text", "lm", ids, valid, 12, compile=True) == want != restored
    compiled_decoding.clear()
    assert not compiled_decoding._current


def test_the_step_is_reused_for_unchanged_weights_and_rebuilt_after_any_change(monkeypatch):
    """``compiled_step``'s bookkeeping with ``torch.compile`` replaced by the eager forward: the same step
    while the model and its weights stay, a fresh one (after dropping every graph) for an in-place
    update, re-stored weights or another model; ``clear`` forgets it."""
    compiled_decoding.clear()
    compiles, resets = [], []
    monkeypatch.setattr(torch, "compile", lambda fn, **kwargs: compiles.append(kwargs) or fn)
    monkeypatch.setattr(torch._dynamo, "reset", lambda: resets.append(1))
    model = tiny_llama().eval()
    ids = torch.randint(1, 96, (2, 7), generator=torch.Generator().manual_seed(1))
    valid = torch.ones_like(ids, dtype=torch.bool)
    valid[1, :3] = False

    def compiled(m, n=12):
        out = generate(m, "text", "lm", ids, valid, n, compile=True)
        assert out == generate(m, "text", "lm", ids, valid, n)
        return out, compiled_decoding._current["step"]

    try:
        eager, step = compiled(model)
        assert compiles == [{"dynamic": True}] and resets == []
        assert compiled(model, 9)[1] is step and len(compiles) == 1  # other lengths: the same step

        with torch.no_grad():  # an in-place update (an optimizer step)
            for p in model.parameters():
                p.add_(torch.randn_like(p), alpha=0.5)
        changed, new = compiled(model)
        assert new is not step and changed != eager and len(compiles) == 2 and len(resets) == 1

        with torch.no_grad():  # re-stored without an in-place write (no version bump)
            for p in model.parameters():
                p.data = p.data * 0.7 - 0.02
        assert compiled(model)[1] is not new and len(compiles) == 3 and len(resets) == 2

        other = tiny_llama().eval()  # another model of the same class
        assert compiled(other)[0] == eager and compiled_decoding._current["model"] is other
        assert len(compiles) == 4 and len(resets) == 3
    finally:
        compiled_decoding.clear()
    assert not compiled_decoding._current and len(resets) == 4


@pytest.mark.parametrize("rows", [1, 2])
def test_later_decoding_steps_reuse_the_first_steps_graphs(monkeypatch, rows):
    """The frames captured for the first two decoding steps serve every later one, in this call and the
    next (other prompt capacity, other lengths): the first step is traced at the prompt's cache length,
    the second once more with the length dynamic, and no later step compiles again. A counting backend
    instead of inductor: tracing only, seconds."""
    from torch._dynamo.testing import CompileCounter

    compiled_decoding.clear()
    counter, compile = CompileCounter(), torch.compile
    monkeypatch.setattr(torch, "compile", lambda fn, **kwargs: compile(fn, backend=counter, **kwargs))
    model = tiny_llama().eval()
    ids = torch.randint(1, 96, (rows, 7), generator=torch.Generator().manual_seed(1))
    valid = torch.ones_like(ids, dtype=torch.bool)
    valid[1:, :3] = False  # with two rows, the second is left-padded
    try:
        want = generate(model, "text", "lm", ids, valid, 8)
        assert generate(model, "text", "lm", ids, valid, 3, compile=True) == [w[:3] for w in want]
        frames = counter.frame_count  # two decoding steps traced
        assert frames > 0
        assert generate(model, "text", "lm", ids, valid, 8, compile=True) == want  # 7 steps, other lengths
        assert counter.frame_count == frames
    finally:
        compiled_decoding.clear()
