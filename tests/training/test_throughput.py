"""Throughput logging: model FLOPs per step (3 × the analytic forward count), TFLOP/s and MFU over the
window, the data-wait fraction and peak memory, in the run's logs."""

from __future__ import annotations

import csv

import pytest
import torch

from mmformer.commands.train import train
from mmformer.models import count_flops
from mmformer.recipe import load_recipe
from mmformer.training.callbacks import ThroughputLogger, _Rate


def test_rate_reports_flops_and_mfu_over_its_window():
    rate = _Rate(window=3, world_size=2, available_flops=8e12)
    out = {}
    for _ in range(4):  # 0.5 s per step, 2e12 model FLOPs per device per step
        out = rate.update(0.5, samples=4, tokens=0, flops=int(2e12))
    assert out["flops_per_sec"] == pytest.approx(4e12)
    assert out["mfu"] == pytest.approx(0.5)
    assert out["samples_per_sec"] == pytest.approx(8.0)


def test_training_logs_tflops_data_wait_and_peak_memory(tiny_recipe, workdir):
    logger = ThroughputLogger(window_size=2)
    recipe = load_recipe(tiny_recipe, ["trainer.max_epochs=1"])
    trainer, run = train(recipe, [logger])
    # the FLOPs fed to the meter for a step = 3 × the eager forward count of that batch (4 images)
    model = trainer.lightning_module.model
    forward = count_flops(model, torch.zeros(4, 1, 28, 28), "image", "cls")["forward"]
    assert logger.rates[""].samples_meter._flops[-1] == 3 * forward

    rows = list(csv.DictReader(open(run.dir / "metrics.csv")))
    values = {k: float(r[k]) for r in rows for k in r if r[k] and k.startswith(("throughput", "memory"))}
    assert values["throughput/device/tflops"] > 0
    assert 0.0 <= values["throughput/data_wait"] < 1.0
    assert values["memory/peak_gb"] > 0.05
    assert "throughput/mfu" not in values  # no known peak for a CPU


@pytest.mark.parametrize("onednn", [True, False, None])
def test_training_routes_large_cpu_linears_through_onednn_as_the_recipe_says(tiny_recipe, workdir, onednn):
    """true / false force it; null (the default) routes them where oneDNN measures faster on this CPU."""
    from mmformer.nn.onednn import MIN_WEIGHTS, faster_here, uses_onednn

    recipe = load_recipe(
        tiny_recipe,
        [
            "trainer.max_steps=1",
            "model.backbone.d_model=384",
            *([] if onednn is None else [f"trainer.onednn_linears={str(onednn).lower()}"]),
        ],
    )
    assert recipe.trainer.onednn_linears is onednn  # null unless the recipe says otherwise
    trainer, _ = train(recipe, [])
    block = trainer.lightning_module.model.backbone.blocks[0]
    linears = [m for m in block.modules() if isinstance(m, torch.nn.Linear)]
    routes = faster_here() if onednn is None else onednn
    routed = [uses_onednn(m) for m in linears]
    assert routed == [routes and m.weight.numel() > MIN_WEIGHTS for m in linears]
    # qkv 384 × 1152, fc1, fc2; not the 384 × 384 projection
    assert routed.count(True) == (3 if routes else 0)


def _measure_worker(rank: int, init_file: str, out: str) -> None:
    import types

    import torch.distributed as dist

    import mmformer.tasks.router as router

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    router.faster_here = lambda: rank == 0  # oneDNN measured faster on rank 0 only
    measured = types.SimpleNamespace(onednn_linears=None, _trainer=None)
    forced = types.SimpleNamespace(onednn_linears=True, _trainer=None)
    routes = [router.MultiTaskModule.routes_onednn(m) for m in (measured, forced)]
    torch.save(routes, f"{out}.{rank}")
    dist.destroy_process_group()


@pytest.mark.slow
def test_ranks_that_measure_differently_all_keep_pytorchs_linears(tmp_path):
    """Two real gloo ranks whose measurements disagree: both take PyTorch's linears (a forced choice is
    not measured, so it needs no collective)."""
    import torch.multiprocessing as mp

    mp.spawn(_measure_worker, args=(str(tmp_path / "init"), str(tmp_path / "out")), nprocs=2, join=True)
    for rank in range(2):
        assert torch.load(tmp_path / f"out.{rank}", weights_only=True) == [False, True]
