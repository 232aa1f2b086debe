"""The tied lookup (``nn.tied_embedding``): the embedding matrix's gradient equals autograd's own — the
LM head's and the lookup's summed — in every way the two can meet in a backward pass, and the V × D
tensor of zeros is really skipped where the hand-over happens."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from mmformer.nn.linear_cross_entropy import linear_cross_entropy
from mmformer.nn.tied_embedding import embed, hand_over, latest_lookup

V, D = 37, 8


class _Calls(TorchDispatchMode):
    """Counts ``embedding_dense_backward``: the zeros-then-rows weight gradient of a plain lookup."""

    def __init__(self):
        super().__init__()
        self.dense = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.dense += func is torch.ops.aten.embedding_dense_backward.default
        return func(*args, **(kwargs or {}))


def _model(seed=0):
    torch.manual_seed(seed)
    emb, mix = nn.Embedding(V, D).double(), nn.Linear(D, D).double()
    return emb, mix


def _loss(emb, mix, ids, fused, scale=1.0):
    """A tied LM: lookup → a layer → the head sharing the lookup's weight, next-token cross-entropy."""
    h = torch.tanh(mix(embed(emb, ids) if fused else F.embedding(ids, emb.weight)))
    if fused:
        loss = linear_cross_entropy(h[:, :-1], emb.weight, ids[:, 1:])
    else:
        loss = F.cross_entropy(F.linear(h[:, :-1], emb.weight).flatten(0, 1), ids[:, 1:].flatten())
    return scale * loss


def _grads(emb, mix, step):
    emb.zero_grad(set_to_none=True)
    mix.zero_grad(set_to_none=True)
    calls = _Calls()
    with calls:
        step()
    return [emb.weight.grad.clone(), mix.weight.grad.clone()], calls.dense


def _ids(rows=2, n=9, seed=1):
    return torch.randint(0, V, (rows, n), generator=torch.Generator().manual_seed(seed))


def test_the_tied_weight_gradient_equals_autograds_and_skips_the_zeros():
    emb, mix = _model()
    ids = _ids()
    want, dense = _grads(emb, mix, lambda: _loss(emb, mix, ids, False, 2.5).backward())
    assert dense == 1
    got, dense = _grads(emb, mix, lambda: _loss(emb, mix, ids, True, 2.5).backward())
    assert dense == 0  # the lookup added its rows into the head's gradient
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-14)


def _two_batches(emb, mix, a, b, fused):
    (_loss(emb, mix, a, fused) + 0.5 * _loss(emb, mix, b, fused)).backward()


def _two_heads(emb, mix, a, fused):
    """One lookup read by two losses: the first head's gradient is handed over, the second's stays autograd's."""
    h = torch.tanh(mix(embed(emb, a) if fused else F.embedding(a, emb.weight)))
    if fused:
        losses = [linear_cross_entropy(h[:, :-1], emb.weight, a[:, 1:]) for _ in range(2)]
    else:
        logits = F.linear(h[:, :-1], emb.weight).flatten(0, 1)
        losses = [F.cross_entropy(logits, a[:, 1:].flatten()) for _ in range(2)]
    (losses[0] + 3 * losses[1]).backward()


@pytest.mark.parametrize("case", ["two micro-batches in one backward", "two heads on one lookup"])
def test_several_heads_and_lookups_of_one_weight_in_one_backward(case):
    emb, mix = _model()
    a, b = _ids(seed=1), _ids(seed=2)

    def step(fused):
        if case == "two heads on one lookup":
            return lambda: _two_heads(emb, mix, a, fused)
        return lambda: _two_batches(emb, mix, a, b, fused)

    want, _ = _grads(emb, mix, step(False))
    got, dense = _grads(emb, mix, step(True))
    assert dense == 0  # every lookup took a head's gradient
    for x, y in zip(got, want):
        torch.testing.assert_close(x, y, rtol=1e-12, atol=1e-14)


def test_a_backward_that_skips_the_lookup_keeps_the_heads_gradient():
    """``backward(inputs=...)`` without the embedding: the lookup does not run, so nothing is handed to
    it; the next full backward is exact again (nothing stale is carried over)."""
    emb, mix = _model()
    ids = _ids()
    loss = _loss(emb, mix, ids, True)
    loss.backward(inputs=[mix.weight])
    assert emb.weight.grad is None
    want = mix.weight.grad.clone()
    mix.zero_grad(set_to_none=True)
    _loss(emb, mix, ids, False).backward(inputs=[mix.weight])
    torch.testing.assert_close(mix.weight.grad, want, rtol=1e-12, atol=1e-14)
    # the head alone asked for: the weight's gradient is the head's, the lookup's rows not in it
    h = torch.tanh(mix(embed(emb, ids))).detach()
    (g,) = torch.autograd.grad(linear_cross_entropy(h[:, :-1], emb.weight, ids[:, 1:]), [emb.weight])
    (r,) = torch.autograd.grad(
        F.cross_entropy(F.linear(h[:, :-1], emb.weight).flatten(0, 1), ids[:, 1:].flatten()), [emb.weight]
    )
    torch.testing.assert_close(g, r, rtol=1e-12, atol=1e-14)
    want, _ = _grads(emb, mix, lambda: _loss(emb, mix, ids, False).backward())
    got, dense = _grads(emb, mix, lambda: _loss(emb, mix, ids, True).backward())
    assert dense == 0
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-14)


def test_a_lookup_that_already_ran_or_another_weight_is_never_handed_a_gradient():
    emb, _ = _model()
    other = nn.Embedding(V, D).double()
    out = embed(emb, _ids())
    lookup = latest_lookup(emb.weight)
    assert lookup is not None and latest_lookup(other.weight) is None

    class Offer(torch.autograd.Function):  # a head offering its weight gradient during the backward
        taken: list[bool] = []

        @staticmethod
        def forward(ctx, x):
            return x.clone()

        @staticmethod
        def backward(ctx, g):
            Offer.taken.append(hand_over(lookup, torch.zeros(V, D, dtype=torch.float64)))
            return g

    out.sum().backward(retain_graph=True)  # the lookup has run
    Offer.apply(out).sum().backward()
    wrong_shape = torch.zeros(V + 1, D, dtype=torch.float64)
    assert Offer.taken == [False] and not hand_over(lookup, wrong_shape) and not hand_over(None, wrong_shape)


@pytest.mark.parametrize(
    "module",
    [nn.Embedding(V, D, padding_idx=0), nn.Embedding(V, D, max_norm=1.0), nn.Embedding(V, D, sparse=True)],
    ids=["padding_idx", "max_norm", "sparse"],
)
def test_embeddings_with_their_own_gradient_rules_run_as_they_are(module):
    ids = _ids()
    out = embed(module, ids)
    assert type(out.grad_fn).__name__ == "EmbeddingBackward0"
    assert latest_lookup(module.weight) is None


def test_no_grad_and_frozen_weights_take_the_plain_lookup():
    emb, _ = _model()
    ids = _ids()
    with torch.no_grad():
        assert torch.equal(embed(emb, ids), emb(ids))
    emb.weight.requires_grad_(False)
    assert embed(emb, ids).grad_fn is None
    with pytest.raises(IndexError):
        embed(nn.Embedding(V, D), torch.tensor([V]))
