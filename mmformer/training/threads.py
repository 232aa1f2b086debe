"""How many intra-op (OpenMP) threads each training process uses: ``trainer.threads``.

PyTorch starts every process with as many threads as the machine has cores. Two DDP processes on a
2-core machine then run 4 threads on 2 cores, and OpenMP's spinning threads wait on each other: the same
step measured 7× slower than with one thread per process. torchrun sets ``OMP_NUM_THREADS=1`` for every
worker (too few where a node has more cores than processes); mmformer divides the cores this process may
run on (``os.sched_getaffinity``: a SLURM or container CPU limit counts) by the processes per node.

- ``trainer.threads: N`` — N threads in every process, as asked.
- unset (``null``) with ``OMP_NUM_THREADS`` in the environment — the environment's choice stands.
- unset otherwise — ``max(1, cores // processes_per_node)``.

The choice depends only on the machine and the recipe, never on the load at the moment: a resumed run
gets the thread count of the run it continues (a different count changes the floating-point summation
order, so the resume would no longer equal the uninterrupted run bit for bit). Other jobs' load is only
reported (:func:`load_hint`), for the user to decide.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class ThreadChoice:
    """``threads`` per process and why (``reason``, one line for the run's start printout)."""

    threads: int
    reason: str


def usable_cores() -> int:
    """The cores this process may run on (its CPU affinity; ``os.cpu_count()`` where that is unknown)."""
    if hasattr(os, "sched_getaffinity"):
        return max(1, len(os.sched_getaffinity(0)))
    return max(1, os.cpu_count() or 1)


def choose_threads(
    requested: int | None, processes_per_node: int, cores: int, environ: dict[str, str] | None = None
) -> ThreadChoice:
    """The intra-op thread count for one of ``processes_per_node`` processes on ``cores`` cores.

    ``requested``: ``trainer.threads`` (``None``: choose). ``environ`` defaults to ``os.environ``; a valid
    ``OMP_NUM_THREADS`` there is kept when nothing is requested. Raises ``ValueError`` for a count < 1.
    """
    environ = os.environ if environ is None else environ
    if requested is not None:
        if requested < 1:
            raise ValueError(f"trainer.threads={requested}; need >= 1 (or null to choose from the cores)")
        return ThreadChoice(requested, "trainer.threads")
    omp = environ.get("OMP_NUM_THREADS", "").strip()
    if omp.isdigit() and int(omp) >= 1:
        return ThreadChoice(int(omp), "OMP_NUM_THREADS")
    procs = max(1, processes_per_node)
    n = max(1, cores // procs)
    return ThreadChoice(n, f"{cores} cores / {procs} process{'es' if procs > 1 else ''} per node")


def set_threads(requested: int | None, processes_per_node: int) -> ThreadChoice:
    """Choose (:func:`choose_threads`) and apply with ``torch.set_num_threads`` in this process."""
    choice = choose_threads(requested, processes_per_node, usable_cores())
    if torch.get_num_threads() != choice.threads:
        torch.set_num_threads(choice.threads)
    return choice


def load_hint(choice: ThreadChoice, processes_per_node: int, cores: int, load: float | None = None) -> str:
    """A suggestion when other jobs already keep the cores busy (``load``: the 1-minute load average,
    read from ``os.getloadavg`` when not given), else ``""``. Only advice: the choice never follows load."""
    if load is None:
        try:
            load = os.getloadavg()[0]
        except OSError:  # not available on this platform
            return ""
    free = cores - load
    wanted = choice.threads * max(1, processes_per_node)
    if choice.reason == "trainer.threads" or wanted <= max(1.0, free) + 0.5:
        return ""
    fewer = max(1, int(max(1.0, free)) // max(1, processes_per_node))
    return (
        f"other jobs keep ~{load:.1f} of {cores} cores busy: {wanted} threads will compete with them; "
        f"trainer.threads={fewer} may be faster"
    )
