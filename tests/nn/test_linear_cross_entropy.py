"""``nn.linear_cross_entropy``: the loss and gradients of ``F.cross_entropy(F.linear(h, W, b))``, chunk
by chunk, never holding the ``(N, V)`` logits."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from mmformer.nn.linear_cross_entropy import linear_cross_entropy
from mmformer.nn.onednn import _AVAILABLE

N, D, V = 10, 8, 37


def _case(dtype=torch.float64, bias=True, seed=0):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(2, N // 2, D, generator=g, dtype=dtype, requires_grad=True)
    w = torch.randn(V, D, generator=g, dtype=dtype, requires_grad=True)
    b = torch.randn(V, generator=g, dtype=dtype, requires_grad=True) if bias else None
    t = torch.randint(0, V, (2, N // 2), generator=g)
    t[0, 1] = t[1, 4] = t[1, 0] = -100  # ignored rows (7 counted: a mean that float32 cannot hold exactly)
    return h, w, b, t


def _grads(loss, inputs):
    return torch.autograd.grad(loss, [x for x in inputs if x is not None])


@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize("chunk_rows", [1, 3, 1024])
def test_loss_and_gradients_equal_the_unfused_computation(reduction, chunk_rows):
    h, w, b, t = _case()
    want = F.cross_entropy(F.linear(h, w, b).flatten(0, 1), t.flatten(), reduction=reduction)
    got = linear_cross_entropy(h, w, t, b, reduction=reduction, chunk_rows=chunk_rows)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    # the incoming gradient (3.5) scales every gradient, as a weighted loss would
    for g_got, g_want in zip(_grads(3.5 * got, (h, w, b)), _grads(3.5 * want, (h, w, b))):
        torch.testing.assert_close(g_got, g_want, rtol=1e-10, atol=1e-12)


def test_float32_without_bias_and_a_tied_embedding():
    """The LM head tied to the token embedding: the weight's gradient sums both uses, as unfused."""
    h, w, _, t = _case(torch.float32, bias=False)
    ids = torch.randint(0, V, (2, N // 2), generator=torch.Generator().manual_seed(1))

    def loss(fused):
        x = h + F.embedding(ids, w)  # the weight is read twice: embedding and head
        if fused:
            return linear_cross_entropy(x, w, t, chunk_rows=4)
        return F.cross_entropy(F.linear(x, w).flatten(0, 1), t.flatten())

    torch.testing.assert_close(loss(True), loss(False), rtol=1e-6, atol=1e-6)
    for a, b in zip(_grads(loss(True), (h, w)), _grads(loss(False), (h, w))):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_no_tensor_of_the_full_logits_is_ever_created():
    h, w, b, t = _case(torch.float32)

    class Largest(TorchDispatchMode):
        numel = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            for o in out if isinstance(out, tuple | list) else [out]:
                if isinstance(o, torch.Tensor):
                    Largest.numel = max(Largest.numel, o.numel())
            return out

    with Largest():
        loss = linear_cross_entropy(h, w, t, b, chunk_rows=3)
        loss.backward()
    assert Largest.numel == V * D  # the weight's gradient; a chunk of logits is 3 × V
    with Largest():
        F.cross_entropy(F.linear(h, w, b).flatten(0, 1), t.flatten()).backward()
    assert Largest.numel == N * V  # what the chunks avoid


def test_reduction_none_gives_each_rows_loss_with_or_without_gradients():
    h, w, b, t = _case()
    want = F.cross_entropy(F.linear(h, w, b).flatten(0, 1), t.flatten(), reduction="none").view(2, N // 2)
    with torch.no_grad():
        torch.testing.assert_close(linear_cross_entropy(h, w, t, b, reduction="none", chunk_rows=3), want)
    got = linear_cross_entropy(h, w, t, b, reduction="none")  # with gradients: the unfused computation
    torch.testing.assert_close(got, want)
    assert got.requires_grad and float(got.detach()[0, 1]) == 0.0  # an ignored row


def test_no_gradient_needed_computes_the_loss_alone():
    h, w, b, t = _case()
    want = F.cross_entropy(F.linear(h, w, b).flatten(0, 1), t.flatten())
    with torch.no_grad():
        got = linear_cross_entropy(h, w, t, b, chunk_rows=4)
    torch.testing.assert_close(got, want)
    assert not got.requires_grad


def test_every_row_ignored_gives_nan_as_cross_entropy_does_and_zero_gradients():
    """A batch with nothing to predict (every caption empty, say): the mean is NaN as ``F.cross_entropy``'s,
    and its gradients are zero as ``F.cross_entropy``'s — not NaN, which would make a training step (and
    an accumulation window where this batch is weighted 0) skip its update."""
    h, w, b, t = _case()
    h, w, b = (x.clone().requires_grad_() for x in (h, w, b))
    t = torch.full_like(t, -100)
    want = F.cross_entropy(F.linear(h, w, b).flatten(0, 1), t.flatten())
    got = linear_cross_entropy(h, w, t, b)
    assert torch.isnan(want) and torch.isnan(got)
    for a, c in zip(torch.autograd.grad(got, (h, w, b)), torch.autograd.grad(want, (h, w, b))):
        assert torch.equal(a, torch.zeros_like(a)) and torch.equal(c, torch.zeros_like(c))


@pytest.mark.skipif(not _AVAILABLE, reason="PyTorch built without oneDNN")
def test_products_on_onednn_equal_pytorchs():
    h, w, b, t = _case(torch.float32)
    a = linear_cross_entropy(h, w, t, b, chunk_rows=4, onednn=True)
    ref = F.cross_entropy(F.linear(h, w, b).flatten(0, 1), t.flatten())
    torch.testing.assert_close(a, ref, rtol=1e-5, atol=1e-6)
    for x, y in zip(_grads(a, (h, w, b)), _grads(ref, (h, w, b))):
        torch.testing.assert_close(x, y, rtol=1e-5, atol=1e-6)


def test_under_bf16_autocast_it_follows_the_unfused_loss():
    h, w, b, t = _case(torch.float32)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        want = F.cross_entropy(F.linear(h, w, b).float().flatten(0, 1), t.flatten())
        got = linear_cross_entropy(h, w, t, b, chunk_rows=4)
    torch.testing.assert_close(got, want, rtol=2e-2, atol=2e-2)
    grads = _grads(got, (h, w, b))
    assert [g.dtype for g in grads] == [torch.float32] * 3  # the inputs' dtype
    for x, y in zip(grads, _grads(want, (h, w, b))):
        torch.testing.assert_close(x, y, rtol=5e-2, atol=5e-3)


def test_a_second_backward_is_refused_not_double_counted():
    h, w, b, t = _case()
    loss = linear_cross_entropy(h, w, t, b)
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="second time"):
        loss.backward()


@pytest.mark.parametrize(
    "kwargs, match",
    [({"reduction": "avg"}, "reduction must be one of"), ({"chunk_rows": 0}, "chunk_rows must be >= 1")],
)
def test_bad_arguments_are_named(kwargs, match):
    h, w, b, t = _case()
    with pytest.raises(ValueError, match=match):
        linear_cross_entropy(h, w, t, b, **kwargs)
    with pytest.raises(ValueError, match=r"targets \(10,\) must have hidden's shape"):
        linear_cross_entropy(h, w, t.flatten(), b)
