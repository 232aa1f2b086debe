"""``mmformer plot RUN [--out DIR]``: PNG training curves from a run's ``metrics.csv``
(``mmformer.training.plots``), written into the run folder (``plots/``) unless ``--out`` says otherwise.

RUN is a run folder (``runs/<recipe>/<run id>``), its ``metrics.csv``, a recipe's folder of runs
(``runs/<recipe>``: its newest run) or a recipe name under the runs root (``$MMFORMER_RUNS``, default
``runs``).
"""

from __future__ import annotations

from pathlib import Path

from omegaconf import OmegaConf

from ..training.plots import plot_run
from ..training.runs import runs_root


def resolve_run(run: Path) -> Path:
    """The run folder RUN names (see the module docstring). Raises ``FileNotFoundError`` when there is
    none, naming what was looked for."""
    for candidate in (run, runs_root() / run):
        if candidate.is_file() and candidate.name == "metrics.csv":
            return candidate.parent
        if (candidate / "metrics.csv").is_file():
            return candidate
        if candidate.is_dir():  # a recipe's folder: its newest run (run ids sort by start time)
            runs = sorted(p.parent for p in candidate.glob("*/metrics.csv"))
            if runs:
                return runs[-1]
    raise FileNotFoundError(
        f"no run at {run}: give a run folder (runs/<recipe>/<run id>), its metrics.csv, or a recipe's "
        f"folder of runs (also looked in {runs_root() / run})"
    )


def cmd_plot(args) -> int:
    run_dir = resolve_run(args.run)
    recipe_file = run_dir / "recipe.yaml"
    recipe = OmegaConf.to_container(OmegaConf.load(recipe_file)) if recipe_file.is_file() else None
    written = plot_run(run_dir, args.out, recipe)
    for path, titles in written.items():
        print(f"{path}  ({'; '.join(titles)})")
    return 0
