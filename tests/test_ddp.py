"""Two processes (DDP, gloo on CPU) launched through the CLI, as users launch them: one run folder,
only rank 0 writes, validation metrics synchronised over ranks and not inflated by padding."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from mmformer.training.threads import choose_threads, usable_cores
from tests.wandb_records import history_and_config


def _cli(args, env, timeout=240):
    return subprocess.run(
        [sys.executable, "-m", "mmformer.cli", *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=timeout,
    )


def _final(stdout: str) -> dict[str, float]:
    return {ln.split()[0]: float(ln.split()[1]) for ln in stdout.splitlines() if ln.startswith("val/")}


@pytest.mark.slow
def test_ddp_two_processes_cpu(tiny_recipe, workdir):
    # An odd number of validation images: padded sharding would count one twice.
    (workdir / "images" / "val" / "dark" / "000.png").unlink()
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    res = _cli(
        ["train", str(tiny_recipe), "trainer.devices=2", "trainer.strategy=ddp", "logger.mode=offline"], env
    )
    assert res.returncode == 0, res.stderr[-3000:]
    ddp = _final(res.stdout)
    assert set(ddp) == {"val/toy/acc", "val/toy/balanced_acc", "val/toy/loss"}
    assert res.stdout.count("val/toy/acc") == 1  # printed by rank 0 only

    runs = [p for p in (workdir / "runs" / "tiny").iterdir() if p.is_dir()]
    assert len(runs) == 1  # every process agreed on the run folder
    run = runs[0]
    info = json.loads((run / "run.json").read_text())
    assert info["world_size"] == 2
    # the cores split between the two processes (2 × 2 threads on 2 cores ran 7× slower than 2 × 1)
    assert info["threads"] == choose_threads(None, 2, usable_cores()).threads
    assert len(list((run / "wandb").glob("offline-run-*"))) == 1  # one W&B run, from rank 0
    ckpts = sorted(p.name for p in (run / "checkpoints").iterdir())
    assert "last.ckpt" in ckpts and not any(p.endswith(".tmp") for p in ckpts)
    rows, _ = history_and_config(next((run / "wandb").glob("offline-run-*/*.wandb")))
    assert any("val/toy/acc" in r for r in rows)

    # One process evaluating the same weights on all 7 images gives the same numbers: the DDP
    # metrics were synchronised over both ranks and each image counted once.
    single = _cli(
        ["validate", str(run / "checkpoints" / "last.ckpt"), "trainer.devices=1", "trainer.strategy=auto"],
        env,
    )
    assert single.returncode == 0, single.stderr[-3000:]
    one = _final(single.stdout)
    assert one["val/toy/loss"] == pytest.approx(ddp["val/toy/loss"], abs=1e-5)
    assert one["val/toy/acc"] == pytest.approx(ddp["val/toy/acc"], abs=1e-6)


def test_a_finished_command_destroys_the_process_group_it_created(tmp_path, monkeypatch):
    """Left to interpreter exit, gloo's threads can abort a successful run (exit -6, "terminate called
    without an active exception"); a command that returns normally destroys the group its run created
    (as Lightning's strategies do, inside the command), and leaves alone one its caller had already."""
    import torch.distributed as dist

    from mmformer import cli
    from mmformer.commands import info

    def command_that_starts_a_group(args):
        dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'own'}", rank=0, world_size=1)
        return 0

    monkeypatch.setattr(info, "cmd_info", command_that_starts_a_group)
    try:
        assert cli.main(["info", "any.yaml"]) == 0
        assert not dist.is_initialized()

        dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'caller'}", rank=0, world_size=1)
        assert cli.main(["data", "list"]) == 0
        assert dist.is_initialized()  # the caller's group
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
