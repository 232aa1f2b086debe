"""What the LM tasks' tests check of a loss computed without the logits (``heads.token_cross_entropy``):
the same value and the same gradients as the cross-entropy of the full logits."""

from __future__ import annotations

import torch
from torch import Tensor, nn

from mmformer.models import heads


def spy_chunked_loss(monkeypatch) -> list[int]:
    """Count the calls of ``nn.linear_cross_entropy`` made by ``LMHead.cross_entropy`` from now on: each
    appends the number of rows it was given (so a test can tell the chunked path ran, not the logits')."""
    calls, real = [], heads.linear_cross_entropy

    def spy(hidden, *args, **kwargs):
        calls.append(hidden.shape[:-1].numel())
        return real(hidden, *args, **kwargs)

    monkeypatch.setattr(heads, "linear_cross_entropy", spy)
    return calls


def assert_same_loss_and_gradients(model: nn.Module, loss: Tensor, want: Tensor) -> None:
    """``loss`` equals ``want`` and so does its gradient for every trainable parameter of ``model`` (those
    neither reaches compared as absent on both sides). Each is backpropagated once."""
    torch.testing.assert_close(loss, want, rtol=1e-6, atol=1e-6)
    params = [p for p in model.parameters() if p.requires_grad]
    got = torch.autograd.grad(loss, params, allow_unused=True)
    ref = torch.autograd.grad(want, params, allow_unused=True)
    reached = 0
    for (name, _), a, b in zip(((n, p) for n, p in model.named_parameters() if p.requires_grad), got, ref):
        assert (a is None) == (b is None), name
        if a is not None:
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=lambda m, n=name: f"{n}: {m}")
            reached += 1
    assert reached > 0
