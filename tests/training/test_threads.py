"""``trainer.threads``: intra-op threads per process — chosen from the cores and the processes per node
(never from the momentary load, so a resume keeps its run's summation order), or as the recipe /
``OMP_NUM_THREADS`` says; applied in the process that trains."""

from __future__ import annotations

import json

import pytest
import torch

from mmformer.cli import main
from mmformer.recipe.sections import TrainerConfig
from mmformer.training.threads import ThreadChoice, choose_threads, load_hint


@pytest.mark.parametrize(
    "requested, procs, cores, env, expected",
    [
        (None, 1, 2, {}, 2),  # one process: every core
        (None, 2, 2, {}, 1),  # DDP on 2 cores: 1 each, not 2 × 2 threads fighting over 2 cores
        (None, 3, 2, {}, 1),  # more processes than cores: still at least one thread
        (None, 2, 16, {}, 8),
        (None, 4, 18, {}, 4),  # rounded down: 4 × 4 ≤ 18
        (None, 2, 16, {"OMP_NUM_THREADS": "3"}, 3),  # the environment's choice stands
        (None, 2, 16, {"OMP_NUM_THREADS": "many"}, 8),  # not a count: ignored
        (5, 2, 2, {"OMP_NUM_THREADS": "3"}, 5),  # the recipe wins over everything
    ],
)
def test_the_thread_count_follows_cores_processes_environment_and_recipe(
    requested, procs, cores, env, expected
):
    assert choose_threads(requested, procs, cores, env).threads == expected


def test_a_thread_count_below_one_is_refused():
    with pytest.raises(ValueError, match="trainer.threads=0"):
        choose_threads(0, 1, 2, {})
    with pytest.raises(ValueError, match="threads=-2; need >= 1"):
        TrainerConfig(threads=-2)


def test_the_load_only_advises():
    auto = ThreadChoice(2, "2 cores / 1 process per node")
    hint = load_hint(auto, processes_per_node=1, cores=2, load=1.9)
    assert "~1.9 of 2 cores busy" in hint and "trainer.threads=1" in hint
    assert load_hint(auto, processes_per_node=1, cores=2, load=0.2) == ""  # a quiet machine: nothing to say
    assert load_hint(ThreadChoice(2, "trainer.threads"), 1, 2, load=1.9) == ""  # the user chose: no advice
    assert load_hint(ThreadChoice(8, "16 cores / 2 processes per node"), 2, 16, load=0.4) == ""  # room left


def test_training_runs_with_the_recipes_thread_count_and_records_it(tiny_recipe, workdir, capsys):
    before = torch.get_num_threads()
    try:
        code = main(
            ["train", str(tiny_recipe), "trainer.threads=1", "trainer.max_epochs=1", "logger.mode=disabled"]
        )
        assert code == 0
        assert torch.get_num_threads() == 1  # applied in the process that trained
    finally:
        torch.set_num_threads(before)
    assert "threads: 1 per process (set by trainer.threads)" in capsys.readouterr().out
    (run_json,) = (workdir / "runs" / "tiny").glob("*/run.json")
    assert json.loads(run_json.read_text())["threads"] == 1
