"""One norm pass answers the non-finite check, the logged gradient norm and the clipping: the same
decisions as the per-tensor check, the same clipped gradients and weights as Lightning's own clipping."""

import lightning as L
import pytest
import torch

from mmformer.tasks.router import MultiTaskModule, all_finite, checked_grad_norm


def _params(*grads):
    params = [torch.nn.Parameter(torch.zeros(len(g))) for g in grads]
    for p, g in zip(params, grads):
        p.grad = torch.tensor(g, dtype=torch.float32)
    return params


@pytest.mark.parametrize(
    "grads,finite",
    [
        (([3.0, 4.0], [12.0]), True),
        (([3.0, float("nan")], [1.0]), False),
        (([1.0], [float("-inf")]), False),
        (([1e20], [1.0]), True),  # finite, but its square overflows fp32: the norm is inf, the check is not
    ],
)
def test_the_norm_decides_as_the_per_tensor_check(grads, finite):
    params = _params(*grads)
    norm, ok = checked_grad_norm(params)
    assert ok is finite is all_finite(params)
    if grads[0] == [3.0, 4.0]:
        assert norm.item() == 13.0
    if finite and not torch.isfinite(norm):
        assert grads[0] == [1e20]


def test_reduce_makes_every_rank_decide_alike():
    params = _params([1.0], [2.0])
    calls = []

    def reduce(t, reduce_op):  # another rank saw a NaN
        calls.append(reduce_op)
        return t + 1

    _, ok = checked_grad_norm(params, reduce)
    assert ok is False and calls and set(calls) == {"sum"}


def _trained_weights(tiny_recipe, monkeypatch, lightning_clipping: bool) -> dict:
    from mmformer.commands.train import train
    from mmformer.recipe import load_recipe

    if lightning_clipping:
        monkeypatch.setattr(
            MultiTaskModule, "configure_gradient_clipping", L.LightningModule.configure_gradient_clipping
        )
    norms = []

    class SeeNorm(L.Callback):  # callbacks run before the module's hook: the unclipped gradients
        def on_before_optimizer_step(self, trainer, pl_module, optimizer):
            grads = [p.grad for g in optimizer.param_groups for p in g["params"] if p.grad is not None]
            norms.append(torch.nn.utils.get_total_norm(grads).item())

    overrides = ["trainer.max_steps=3", "trainer.max_epochs=-1", "trainer.gradient_clip_val=0.05"]
    trainer, _ = train(load_recipe(tiny_recipe, overrides), extra_callbacks=[SeeNorm()])
    monkeypatch.undo()
    assert len(norms) == 3 and min(norms) > 0.05  # the limit really clips every step
    return {k: v.detach().clone() for k, v in trainer.lightning_module.state_dict().items()}


def test_clipping_with_the_known_norm_equals_lightnings_clipping(tiny_recipe, monkeypatch):
    ours = _trained_weights(tiny_recipe, monkeypatch, lightning_clipping=False)
    theirs = _trained_weights(tiny_recipe, monkeypatch, lightning_clipping=True)
    assert ours.keys() == theirs.keys()
    for k in ours:
        assert torch.equal(ours[k], theirs[k]), k
