"""``nn.packed``: a decoding step's few rows multiplied on oneDNN-prepacked weights give ``F.linear``'s values,
never with stale weights, and leave the modules as they were (copyable, picklable) after the context."""

from __future__ import annotations

import copy
import io

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from mmformer.models.generate import generate
from mmformer.nn import packed
from mmformer.nn.packed import packed_linears
from tests.nn.test_layout import _model as tiny_llama

pytestmark = pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="needs oneDNN (mkldnn)")


def _linear(bias: bool = True) -> nn.Linear:
    torch.manual_seed(0)
    return nn.Linear(24, 40, bias=bias)


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("rows", [2, 4, 7])
def test_packed_rows_equal_f_linear(bias, rows):
    lin = _linear(bias)
    x = torch.randn(rows, 1, 24)
    with torch.no_grad(), packed_linears([lin], rows) as n:
        assert n == 1 and "forward" in lin.__dict__
        got = lin(x)
    torch.testing.assert_close(got, F.linear(x, lin.weight, lin.bias), rtol=1e-5, atol=1e-5)
    assert "forward" not in lin.__dict__


def test_more_rows_than_the_context_a_column_major_row_and_gradients_take_f_linear(monkeypatch):
    """The packed kernel for inputs of at most the context's ``rows`` rows without gradients — one position
    per sequence, or a token and its prompt-lookup draft: a prefill (more rows) or a training forward
    multiply as before, and so does one row of a column-major weight (read faster as it is)."""
    lin, col = _linear(), _linear()
    with torch.no_grad():
        col.weight.data = col.weight.data.t().contiguous().t()  # the blocks' decode layout
    calls = []
    real = torch.ops.mkldnn._linear_pointwise
    monkeypatch.setattr(packed.torch.ops.mkldnn, "_linear_pointwise", lambda *a: calls.append(1) or real(*a))
    with packed_linears([lin, col], 4):
        with torch.no_grad():
            lin(torch.randn(1, 5, 24))  # more rows than the context's
            col(torch.randn(1, 1, 24))  # one row of a column-major weight
        lin(torch.randn(4, 1, 24)).sum().backward()  # gradients
        assert calls == [] and lin.weight.grad is not None
        with torch.no_grad():
            for x in (
                torch.randn(4, 1, 24),
                torch.randn(1, 4, 24),
                torch.randn(2, 2, 24),
                torch.randn(1, 1, 24),
            ):
                torch.testing.assert_close(lin(x), F.linear(x, lin.weight, lin.bias), rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(col(torch.randn(1, 3, 24)).shape, (1, 3, 40))
    assert calls == [1] * 5


def test_a_weight_changed_after_packing_is_never_read_stale():
    lin = _linear()
    x = torch.randn(3, 1, 24)
    with torch.no_grad(), packed_linears([lin], 3):
        before = lin(x)
        lin.weight.add_(1.0)  # in place: the version counter moves
        after = lin(x)
        torch.testing.assert_close(after, F.linear(x, lin.weight, lin.bias))
        assert not torch.allclose(before, after)
        lin.weight.data = lin.weight.data.t().contiguous().t() * 2  # re-stored: storage and strides move
        torch.testing.assert_close(lin(x), F.linear(x, lin.weight, lin.bias), rtol=1e-5, atol=1e-5)
    with torch.no_grad(), packed_linears([lin], 3):  # packed again for the new weights
        torch.testing.assert_close(lin(x), F.linear(x, lin.weight, lin.bias), rtol=1e-5, atol=1e-5)


def test_a_compiled_graph_finds_the_packed_weight_at_run_time_and_never_a_stale_one(monkeypatch):
    """Traced into a graph (one frame, no break), a packed linear is one opaque ``mmformer::packed_linear``
    whose run looks the packed weight up by the weight it is given: oneDNN's product inside the context,
    ``F.linear`` after an in-place change of the weight or outside the context — the same graph, never
    the old values."""
    lin, x = _linear(), torch.randn(3, 1, 24)
    products, real = [], packed._product
    monkeypatch.setattr(packed, "_product", lambda *a: products.append(1) or real(*a))
    graphs = []

    def backend(gm, example_inputs):  # records the traced graph, runs it eagerly
        graphs.append(gm)
        return gm.forward

    torch._dynamo.reset()
    try:
        with torch.no_grad(), packed_linears([lin], 3):
            step = torch.compile(lambda t: lin(t) * 2, backend=backend, dynamic=True)
            want = 2 * F.linear(x, lin.weight, lin.bias)
            torch.testing.assert_close(step(x), want, rtol=1e-5, atol=1e-5)
            assert products == [1] and len(graphs) == 1
            assert any("packed_linear" in str(n.target) for n in graphs[0].graph.nodes)
            lin.weight.add_(1.0)  # in place, while packed: the graph must read the new values
            want = 2 * F.linear(x, lin.weight, lin.bias)
            torch.testing.assert_close(step(x), want, rtol=1e-5, atol=1e-5)
            assert products == [1] and len(graphs) == 1
        assert not packed._active  # the context's packed weights are forgotten on exit
        with torch.no_grad():
            got = packed.packed_linear(x[:, 0], lin.weight, lin.bias)
        torch.testing.assert_close(got, F.linear(x[:, 0], lin.weight, lin.bias))
        assert products == [1]
    finally:
        torch._dynamo.reset()


def test_the_registry_of_packed_weights_is_undone_exactly(monkeypatch):
    """What a compiled graph may find (``packed._active``) is exactly the open contexts' packed weights:
    a nested context that re-packs a changed weight, a weight shared by two linears (tied), a module met
    twice, and a failure while packing all leave nothing behind and every forward as it was."""
    a, x = _linear(), torch.randn(2, 1, 24)
    tied = nn.Linear(24, 40)
    tied.weight = a.weight
    with torch.no_grad(), packed_linears([a], 2):
        a.weight.mul_(1.0)  # in place: the inner context packs it again, under another key
        with packed_linears([a, tied], 2):
            assert len(packed._active) == 2 and max(packed._opened.values()) == 2
        assert len(packed._active) == 1  # the outer context's entry, still counted once
        torch.testing.assert_close(a(x), F.linear(x, a.weight, a.bias))
    assert (
        not packed._active and not packed._opened and "forward" not in vars(a) and "forward" not in vars(tied)
    )

    seq = nn.Sequential(_linear())
    with torch.no_grad(), packed_linears([seq, seq[0]], 2) as n:  # the same linear twice
        assert n == 2
    assert not packed._active and "forward" not in vars(seq[0])

    calls = []

    def failing(w, rows):
        if calls:
            raise KeyboardInterrupt
        calls.append(1)
        return real(w, rows)

    real = packed._pack
    monkeypatch.setattr(packed, "_pack", failing)
    two = nn.Sequential(_linear(), nn.Linear(24, 24))
    with pytest.raises(KeyboardInterrupt), packed_linears([two], 2):
        pass
    assert not packed._active and all("forward" not in vars(m) for m in two)


def test_one_row_reads_a_column_major_copy_of_a_row_major_weight_only():
    lin, col = _linear(), _linear()
    with torch.no_grad():
        col.weight.data = col.weight.data.t().contiguous().t()  # the blocks' decode layout
    x = torch.randn(1, 1, 24)
    with torch.no_grad(), packed_linears([lin, col], 1) as n:
        assert n == 1 and "forward" in lin.__dict__ and "forward" not in col.__dict__
        copy_ = packed._packed[lin][2]
        assert copy_.t().is_contiguous() and torch.equal(copy_, lin.weight)
        torch.testing.assert_close(lin(x), F.linear(x, lin.weight, lin.bias))
        lin.weight.mul_(2)  # changed after packing: the weight, not the copy
        torch.testing.assert_close(lin(x), F.linear(x, lin.weight, lin.bias))


def test_one_row_beside_a_draft_reads_a_column_major_copy(monkeypatch):
    """``one_row=True`` (prompt lookup of one sequence): a row-major weight keeps a column-major copy for
    one-row inputs beside its oneDNN-packed copy for a token and its draft; both give ``F.linear``'s
    values."""
    lin = _linear()
    calls = []
    real = torch.ops.mkldnn._linear_pointwise
    monkeypatch.setattr(packed.torch.ops.mkldnn, "_linear_pointwise", lambda *a: calls.append(1) or real(*a))
    with torch.no_grad(), packed_linears([lin], 11, one_row=True):
        single = packed._packed[lin][4]
        assert single.t().is_contiguous() and torch.equal(single, lin.weight)
        for x in (torch.randn(1, 1, 24), torch.randn(1, 6, 24)):
            torch.testing.assert_close(lin(x), F.linear(x, lin.weight, lin.bias), rtol=1e-5, atol=1e-5)
    assert calls == [1]  # the six-row input only


def test_no_rows_packs_nothing_and_the_context_restores_on_error():
    lin = _linear()
    with packed_linears([lin], 0) as n:
        assert n == 0 and "forward" not in lin.__dict__
    with pytest.raises(RuntimeError, match="boom"), packed_linears([lin], 2):
        raise RuntimeError("boom")
    assert "forward" not in lin.__dict__


@pytest.mark.parametrize("rows", [1, 2])
def test_generation_gives_the_unpacked_ids_and_the_model_stays_copyable(monkeypatch, rows):
    """Greedy decoding (one prompt; two, left-padded) with packing equals it without (oneDNN reported
    unavailable in the reference run); afterwards the model deep-copies and saves."""
    model = tiny_llama().eval()
    ids = torch.randint(1, 96, (rows, 7), generator=torch.Generator().manual_seed(1))
    valid = torch.ones_like(ids, dtype=torch.bool)
    valid[1:, :3] = False
    with_packed = generate(model, "text", "lm", ids, valid, 10)
    used = [m for m in model.modules() if m in packed._packed]
    # several rows: qkv, proj, gate_up, down per block and the LM head; one row: the head (row-major)
    assert len(used) == (2 * 4 + 1 if rows == 2 else 1)
    with monkeypatch.context() as m:
        m.setattr(torch.backends.mkldnn, "is_available", lambda: False)
        assert generate(model, "text", "lm", ids, valid, 10) == with_packed
    copy.deepcopy(model)
    torch.save(model, io.BytesIO())
    model.backbone.restore_layout()  # a training step: the blocks' packed copies are released
    assert [m for m in model.backbone.modules() if m in packed._packed] == []
    packed.release([model])
