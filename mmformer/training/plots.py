"""Training curves from a run's ``metrics.csv`` (``mmformer plot RUN``), for people who would rather look
than read: per task its loss and main metric (training vs validation), the learning rate, throughput
and the gradient norm, each figure one PNG.

``metrics.csv`` is Lightning's CSV log (docs/runs.md): a ``step`` column (optimizer steps before the
row's step), ``epoch``, and one column per logged key (``train/<task>/loss``, ``val/<task>/<metric>``,
``lr``, ``train/grad_norm``, ``throughput/…``); a row holds only what its step logged (empty cells).

Drawn with matplotlib's object API (``Figure`` on an Agg canvas, no ``pyplot`` state). A figure of ``n``
panels is ``n · PANEL_W`` by ``PANEL_H`` pixels.
"""

from __future__ import annotations

import csv
import math
from dataclasses import dataclass, field
from pathlib import Path

from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

DPI = 100
PANEL_W, PANEL_H = 420, 300  # pixels per panel
SMOOTHING = 0.8  # EMA weight of the smoothed training curve drawn over the raw one (TensorBoard's slider)
TRAIN, VAL = "#0969da", "#cf222e"

# The metric each task kind's best checkpoint monitors by default (``Task.main_metric``), read from the
# run's ``recipe.yaml``; decoding tasks (prefix_lm, seq2seq) use wer for audio inputs, else exact_match.
MAIN_METRIC = {"classification": "acc", "masked_lm": "acc", "contrastive": "recall@1", "causal_lm": "ppl"}
# Without a recipe: the first of these a task logs.
PREFERRED = ("acc", "recall@1", "wer", "exact_match", "ppl")
_AUDIO_KEYS = ("sample_rate", "n_mels", "max_seconds")  # what only an audio tokenizer's config holds

Series = tuple[list[int], list[float]]  # (steps, values)


@dataclass
class Panel:
    """One plot: ``lines`` label → (steps, values); ``log``: a logarithmic y axis."""

    title: str
    lines: dict[str, Series] = field(default_factory=dict)
    ylabel: str = ""
    log: bool = False


def read_metrics(path: Path) -> dict[str, Series]:
    """Every column of a ``metrics.csv`` but ``step`` and ``epoch`` → the (step, value) pairs of the rows
    that logged it, in file order; empty and non-finite cells are left out. Raises ``FileNotFoundError``
    when the file is missing, ``ValueError`` when it has no ``step`` column."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"no metrics file {path}")
    with path.open(newline="") as f:
        reader = csv.DictReader(f)
        if "step" not in (reader.fieldnames or []):
            raise ValueError(f"{path} has no 'step' column: not a metrics.csv of mmformer train")
        out: dict[str, Series] = {k: ([], []) for k in reader.fieldnames if k not in ("step", "epoch")}
        for row in reader:
            if not row.get("step"):
                continue
            step = int(float(row["step"]))
            for key, (steps, values) in out.items():
                cell = row.get(key)
                if cell:
                    v = float(cell)
                    if math.isfinite(v):
                        steps.append(step)
                        values.append(v)
    return {k: s for k, s in out.items() if s[0]}


def task_names(metrics: dict[str, Series]) -> list[str]:
    """The tasks a run logged (``train/<task>/loss``, ``val/<task>/<metric>``), in order of first column."""
    names: dict[str, None] = {}
    for key in metrics:
        parts = key.split("/")
        if len(parts) == 3 and parts[0] in ("train", "val") and parts[1] != "modality":
            names.setdefault(parts[1])
    return list(names)


def main_metric(task: str, metrics: dict[str, Series], recipe: dict | None = None) -> str | None:
    """The task's main validation metric (what its best checkpoint monitors by default) among those it
    logged, or None when it logs only its loss: the recipe's ``tasks.<task>.main_metric``, else the
    ``checkpoint.monitor`` when it names this task, else the default of the task's kind, else the first
    of ``PREFERRED`` it logged, else its first non-loss metric."""
    logged = [k.split("/", 2)[2] for k in metrics if k.startswith(f"val/{task}/")]
    recipe = recipe or {}
    cfg = (recipe.get("tasks") or {}).get(task) or {}
    monitor = (recipe.get("checkpoint") or {}).get("monitor") or ""
    candidates = [
        cfg.get("main_metric"),
        monitor[len(f"val/{task}/") :] if monitor.startswith(f"val/{task}/") else None,
    ]
    kind = cfg.get("kind")
    if kind in ("prefix_lm", "seq2seq"):
        tok = ((recipe.get("model") or {}).get("tokenizers") or {}).get(cfg.get("tokenizer"), {}) or {}
        candidates.append("wer" if any(k in tok for k in _AUDIO_KEYS) else "exact_match")
    candidates += [MAIN_METRIC.get(kind), *PREFERRED, *(m for m in logged if m != "loss")]
    return next((m for m in candidates if m and m != "loss" and m in logged), None)


def figures(metrics: dict[str, Series], recipe: dict | None = None) -> dict[str, list[Panel]]:
    """The figures of a run, file stem → panels; a figure or panel whose values were never logged is
    left out. ``task-<task>``: its loss (training vs validation) and main metric; ``lr``: the learning
    rate(s); ``throughput``: samples/s (and tokens/s, model TFLOP/s per device, MFU when logged);
    ``grad_norm``: the global gradient norm before clipping, on a log scale."""

    def lines(**keys: str) -> dict[str, Series]:
        return {label: metrics[key] for label, key in keys.items() if key in metrics}

    out: dict[str, list[Panel]] = {}
    for task in task_names(metrics):
        panels = [Panel(f"{task}: loss", lines(train=f"train/{task}/loss", val=f"val/{task}/loss"), "loss")]
        metric = main_metric(task, metrics, recipe)
        if metric is not None:
            panels.append(
                Panel(
                    f"{task}: {metric}",
                    lines(train=f"train/{task}/{metric}", val=f"val/{task}/{metric}"),
                    metric,
                )
            )
        out[f"task-{task}"] = [p for p in panels if p.lines]
    lrs = {key: metrics[key] for key in metrics if key == "lr" or key.startswith(("lr-", "lr/"))}
    out["lr"] = [Panel("learning rate", lrs, "lr")]
    out["throughput"] = [
        Panel("samples / s (all ranks)", lines(train="throughput/samples_per_sec"), "samples/s"),
        Panel("text tokens / s (all ranks)", lines(train="throughput/tokens_per_sec"), "tokens/s"),
        Panel("model TFLOP/s per device", lines(train="throughput/device/tflops"), "TFLOP/s"),
        Panel("MFU", lines(train="throughput/mfu"), "MFU"),
    ]
    out["grad_norm"] = [Panel("gradient norm", lines(train="train/grad_norm"), "‖g‖", log=True)]
    out = {name: [p for p in panels if p.lines] for name, panels in out.items()}
    return {name: panels for name, panels in out.items() if panels}


def smoothed(values: list[float], weight: float = SMOOTHING) -> list[float]:
    """Debiased exponential moving average (TensorBoard's smoothing): ``weight`` 0 = the values."""
    out, avg = [], 0.0
    for i, v in enumerate(values):
        avg = weight * avg + (1 - weight) * v
        out.append(avg / (1 - weight ** (i + 1)))
    return out


def draw(panels: list[Panel], path: Path) -> Path:
    """Write ``panels`` side by side as one PNG (``len(panels) · PANEL_W`` by ``PANEL_H`` pixels): the
    training line raw and, past 10 points, smoothed; the validation line with a marker per validation.
    Raises ``ValueError`` without panels."""
    if not panels:
        raise ValueError("nothing to draw: no panel")
    fig = Figure(figsize=(len(panels) * PANEL_W / DPI, PANEL_H / DPI), dpi=DPI, facecolor="white")
    axes = fig.subplots(1, len(panels), squeeze=False)[0]
    for ax, panel in zip(axes, panels):
        for label, (steps, values) in panel.lines.items():
            if label == "val":
                ax.plot(steps, values, "o-", color=VAL, ms=4, lw=1.5, label="val")
            elif label == "train" and len(values) > 10:
                ax.plot(steps, values, color=TRAIN, alpha=0.3, lw=1)
                ax.plot(steps, smoothed(values), color=TRAIN, lw=1.5, label="train (smoothed)")
            else:
                ax.plot(steps, values, lw=1.5, label=label, **({"color": TRAIN} if label == "train" else {}))
        if panel.log and all(v > 0 for _, vs in panel.lines.values() for v in vs):
            ax.set_yscale("log")
        ax.set_title(panel.title, fontsize=10)
        ax.set_xlabel("step", fontsize=9)
        ax.set_ylabel(panel.ylabel, fontsize=9)
        ax.tick_params(labelsize=8)
        ax.grid(alpha=0.3)
        if len(panel.lines) > 1 or "val" in panel.lines:
            ax.legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    FigureCanvasAgg(fig).print_png(str(path))
    return path


def plot_run(run_dir: Path, out_dir: Path | None = None, recipe: dict | None = None) -> dict[Path, list[str]]:
    """Draw every figure of ``run_dir/metrics.csv`` into ``out_dir`` (default ``run_dir/plots``) as
    ``<figure>.png``; ``recipe``: the run's recipe as a plain dict (for the tasks' main metrics).
    Returns each written file → its panels' titles. Raises ``FileNotFoundError`` without a
    ``metrics.csv``, ``ValueError`` when it holds nothing to plot."""
    run_dir = Path(run_dir)
    metrics = read_metrics(run_dir / "metrics.csv")
    figs = figures(metrics, recipe)
    if not figs:
        raise ValueError(f"{run_dir / 'metrics.csv'} holds no value to plot yet")
    out_dir = Path(out_dir) if out_dir is not None else run_dir / "plots"
    return {draw(panels, out_dir / f"{name}.png"): [p.title for p in panels] for name, panels in figs.items()}
