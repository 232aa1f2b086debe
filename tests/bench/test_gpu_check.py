"""``bench/gpu_check.py`` runs whole on the CPU at tiny sizes (``--cpu-smoke``) with Lightning, W&B,
OmegaConf and torchmetrics unimportable — as on the lent GPU machine, which lacks them — and its
numbers mean what they say: every variant of the GPT-2 language-model step starts from the same
weights, so eager and compiled first losses agree, at ln V for an untrained model."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
BLOCKED = ("lightning", "pytorch_lightning", "wandb", "omegaconf", "torchmetrics")
RUN = f"""
import runpy, sys
for name in {BLOCKED!r}:
    sys.modules[name] = None  # import fails, as on a machine without them
sys.argv = ["gpu_check.py", *sys.argv[1:]]
runpy.run_path("bench/gpu_check.py", run_name="__main__")
"""


@pytest.mark.slow
def test_the_gpu_script_runs_standalone_and_its_variants_share_weights(tmp_path):
    env = {"OUT": str(tmp_path), "PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin", "OMP_NUM_THREADS": "1"}
    done = subprocess.run(
        [sys.executable, "-c", RUN, "--cpu-smoke"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    results = json.loads((tmp_path / "gpu_check.json").read_text())
    assert "errors" not in results, results["errors"]
    assert len(results["flex_vs_eager"]) == 16 and all(v["ok"] for v in results["flex_vs_eager"].values())
    assert {r["case"] for r in results["attention"]} == {"sdpa causal"}  # flex cases are CUDA-only
    rows = {r["variant"]: r for r in results["gpt2_medium"]}
    assert list(rows) == [
        "sdpa, eager",
        "sdpa, compile_blocks",
        "flex, compile_blocks",
        "sdpa, compiled loss fn",
    ]
    assert "no backward pass on CPU" in rows["flex, compile_blocks"]["error"]  # refused, named
    eager = rows["sdpa, eager"]["first_loss"]
    assert abs(eager - math.log(1000)) < 0.05  # vocab 1,000 at initialisation
    for name in ("sdpa, compile_blocks", "sdpa, compiled loss fn"):
        assert rows[name]["first_loss"] == pytest.approx(eager, abs=1e-3), name
        assert rows[name]["ms"] > 0 and rows[name]["compile_s"] >= 0
    assert [r["model"] for r in results["train_step"]] == ["debug", "debug causal rope"]
