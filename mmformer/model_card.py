"""Model cards for exports: the ``README.md`` the Hugging Face Hub shows for a model repository.

A card is written from what a run recorded, never from memory: the checkpoint's recipe (name, model
parts, tasks, data kinds and roots, optimisation), its training step and epoch, the validation metrics
the run measured (``metrics.csv`` in the run folder; else the checkpoint callback's monitored score),
the pretrained sources it started from, and the mmformer version. Its YAML front matter is the Hub's
metadata (https://huggingface.co/docs/hub/model-cards): ``library_name`` (``timm`` /
``transformers``), ``pipeline_tag``, ``tags``, ``datasets``, ``license``, ``metrics`` and, when values
were measured, a ``model-index`` with them (the Hub's evaluation results).

:func:`checkpoint_facts` gathers the facts from a checkpoint's state and its run folder;
:func:`render_card` turns them into the card's text; :func:`write_card` writes it beside an export.
"""

from __future__ import annotations

import csv
import math
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from . import __version__
from .data.prepare import BUNDLED

# mmformer's metric names → the Hub's metric ids (https://huggingface.co/metrics), where one exists
HUB_METRICS = {"acc": "accuracy", "balanced_acc": "balanced_accuracy", "ppl": "perplexity", "f1": "f1"}
# (task kind, input modality) → the Hub's task type; a kind alone covers every modality
PIPELINE = {
    ("classification", "image"): "image-classification",
    ("classification", "text"): "text-classification",
    ("classification", "audio"): "audio-classification",
    ("causal_lm", None): "text-generation",
    ("masked_lm", None): "fill-mask",
    ("contrastive", None): "feature-extraction",
}


@dataclass
class Metrics:
    """Validation metrics of one run: at the exported checkpoint's step (``this``), the best row by the
    monitored metric (``best``) and the last row (``last``): ``{metric name: value}``, each with the
    step it was measured at (``*_step``)."""

    monitor: str | None = None
    mode: str = "max"
    this: dict[str, float] = field(default_factory=dict)
    this_step: int | None = None
    best: dict[str, float] = field(default_factory=dict)
    best_step: int | None = None
    last: dict[str, float] = field(default_factory=dict)
    last_step: int | None = None


@dataclass
class CardFacts:
    """Everything a card says about a model. ``recipe`` is the parsed recipe YAML (None for weights
    that did not come from an mmformer run), ``modalities`` ``{task: input modality}``."""

    name: str
    recipe: dict | None = None
    modalities: dict[str, str] = field(default_factory=dict)
    metrics: Metrics = field(default_factory=Metrics)
    global_step: int | None = None
    epoch: int | None = None
    pretrained: list[str] = field(default_factory=list)
    source: str = ""


def read_metrics(csv_path: Path, global_step: int | None, monitor: str | None, mode: str) -> Metrics:
    """The validation rows of a run's ``metrics.csv`` (rows with any ``val/…`` value). The exported
    checkpoint's own row is the last one logged before its ``global_step`` (validation logs at the step
    it ran after, one less than the step the checkpoint then records). Unreadable values are skipped."""
    out = Metrics(monitor=monitor, mode=mode)
    rows = []
    with open(csv_path, newline="") as f:
        for row in csv.DictReader(f):
            vals = {
                k: _float(v) for k, v in row.items() if k and k.startswith("val/") and _float(v) is not None
            }
            if vals:
                rows.append((int(float(row.get("step") or 0)), vals))
    if not rows:
        return out
    out.last_step, out.last = rows[-1]
    before = [r for r in rows if global_step is None or r[0] < global_step]
    if before:
        out.this_step, out.this = before[-1]
    scored = [r for r in rows if monitor in r[1]]
    if scored:
        pick = max if mode == "max" else min
        out.best_step, out.best = pick(scored, key=lambda r: r[1][monitor])
    return out


def _float(text) -> float | None:
    try:
        value = float(text)
    except (TypeError, ValueError):
        return None
    return value if math.isfinite(value) else None


def checkpoint_facts(path: str | Path, state: dict, modalities: dict[str, str] | None = None) -> CardFacts:
    """The card facts of an mmformer training checkpoint: ``state`` is its loaded dictionary, ``path``
    where it lies (``runs/<name>/<id>/checkpoints/…``: the run folder's ``metrics.csv`` is read when it
    is there). Without the CSV, the checkpoint callback's monitored score stands for the metrics."""
    path = Path(path)
    recipe = yaml.safe_load(state["mmformer"]["recipe_yaml"])
    monitor, mode, score = _callback_monitor(state)
    monitor = monitor or (recipe.get("checkpoint") or {}).get("monitor")
    step = state.get("global_step")
    run = path.parent.parent if path.parent.name == "checkpoints" else path.parent
    if (run / "metrics.csv").is_file():
        metrics = read_metrics(run / "metrics.csv", step, monitor, mode)
    else:
        metrics = Metrics(monitor=monitor, mode=mode)
        if monitor and score is not None:
            metrics.this, metrics.this_step = {monitor: score}, step
    return CardFacts(
        name=recipe.get("name", path.stem),
        recipe=recipe,
        modalities=dict(modalities or {}),
        metrics=metrics,
        global_step=step,
        epoch=state.get("epoch"),
        pretrained=sorted(state["mmformer"].get("pretrained") or {}),
        source=str(path),
    )


def _callback_monitor(state: dict) -> tuple[str | None, str, float | None]:
    for key, cb in (state.get("callbacks") or {}).items():
        if key.startswith("ModelCheckpoint") and isinstance(cb, dict) and cb.get("monitor"):
            score = cb.get("current_score")
            mode = "min" if "'mode': 'min'" in key else "max"  # Lightning's state key names the mode
            return cb["monitor"], mode, _float(score.item() if hasattr(score, "item") else score)
    return None, "max", None


# -------------------------------------------------------------------------------------------- render
@dataclass
class ExportInfo:
    """What was exported: ``fmt`` (``timm``, ``transformers`` or ``safetensors``), ``pipeline_tag``,
    ``parts`` (one line: what the files hold, and what they leave out), ``usage`` (a code block's text),
    ``n_params``, ``license`` (an SPDX-style Hub id, or ``other``), ``repo_id`` for the snippets."""

    fmt: str
    pipeline_tag: str | None
    parts: str
    usage: str
    n_params: int | None = None
    license: str = "other"
    repo_id: str | None = None
    limitations: list[str] = field(default_factory=list)


def render_card(facts: CardFacts, export: ExportInfo) -> str:
    """The card's text: YAML front matter, then recipe, data, measured metrics, usage, intended use and
    limitations, license."""
    meta = _front_matter(facts, export)
    body = [f"# {facts.name}", "", _summary(facts, export), ""]
    body += _model_section(facts, export)
    body += _data_section(facts)
    body += _metrics_section(facts)
    body += _recipe_section(facts)
    body += ["## How to use", "", "```python", export.usage.strip(), "```", ""]
    body += _intended_use(facts, export)
    body += ["## License", "", _license_text(export.license), ""]
    front = yaml.safe_dump(meta, sort_keys=False, allow_unicode=True, width=1000)
    return f"---\n{front}---\n\n" + "\n".join(body).rstrip() + "\n"


def write_card(path: str | Path, facts: CardFacts, export: ExportInfo) -> Path:
    """Write :func:`render_card` to ``path`` (``OUT/README.md`` beside a directory export)."""
    path = Path(path)
    path.write_text(render_card(facts, export), encoding="utf-8")
    return path


def _tasks(facts: CardFacts) -> dict[str, dict]:
    return (facts.recipe or {}).get("tasks") or {}


def _dataset_id(data: dict) -> str:
    root = str(data.get("root") or data.get("kind") or "data")
    return root if root in BUNDLED else Path(root).name or root


def _front_matter(facts: CardFacts, export: ExportInfo) -> dict:
    meta: dict = {}
    if export.fmt in ("timm", "transformers"):
        meta["library_name"] = export.fmt
    if export.pipeline_tag:
        meta["pipeline_tag"] = export.pipeline_tag
    meta["license"] = export.license
    kinds = sorted({t.get("kind", "") for t in _tasks(facts).values()} - {""})
    tags = ["mmformer", *([export.fmt] if export.fmt != "safetensors" else []), *kinds]
    meta["tags"] = list(dict.fromkeys(t.replace("_", "-") for t in tags))
    datasets = [_dataset_id(t.get("data") or {}) for t in _tasks(facts).values()]
    if datasets:
        meta["datasets"] = list(dict.fromkeys(datasets))
    if facts.pretrained:
        meta["base_model"] = facts.pretrained[0] if len(facts.pretrained) == 1 else facts.pretrained
    measured = facts.metrics.this or facts.metrics.last
    if measured:
        names = [n.rsplit("/", 1)[-1] for n in measured]
        meta["metrics"] = list(dict.fromkeys(HUB_METRICS.get(n, n) for n in names))
        meta["model-index"] = [{"name": facts.name, "results": _results(facts, measured)}]
    return meta


def _results(facts: CardFacts, measured: dict[str, float]) -> list[dict]:
    results = []
    for task, spec in _tasks(facts).items():
        mine = {k: v for k, v in measured.items() if k.startswith(f"val/{task}/")}
        if not mine:
            continue
        data = spec.get("data") or {}
        kind = spec.get("kind", "")
        results.append(
            {
                "task": {"type": _pipeline(kind, facts.modalities.get(task)) or kind, "name": task},
                "dataset": {"name": _dataset_id(data), "type": _dataset_id(data), "split": "validation"},
                "metrics": [
                    {
                        "type": HUB_METRICS.get(n.rsplit("/", 1)[-1], n.rsplit("/", 1)[-1]),
                        "name": n,
                        "value": v,
                    }
                    for n, v in mine.items()
                ],
            }
        )
    return results


def _pipeline(kind: str, modality: str | None) -> str | None:
    return PIPELINE.get((kind, modality)) or PIPELINE.get((kind, None))


def _summary(facts: CardFacts, export: ExportInfo) -> str:
    if facts.recipe is None:
        return f"Weights from `{facts.source}`, exported by mmformer {__version__} as {export.fmt}."
    steps = (
        f"{facts.global_step:,} optimiser steps"
        if facts.global_step is not None
        else "an unknown number of steps"
    )
    epochs = f", epoch {facts.epoch} counting from 0" if facts.epoch is not None else ""
    base = f", starting from {', '.join(f'`{p}`' for p in facts.pretrained)}" if facts.pretrained else ""
    return (
        f"Trained with mmformer {__version__} by the recipe `{facts.name}` "
        f"({steps}{epochs}{base}), exported in the {export.fmt} layout."
    )


def _model_section(facts: CardFacts, export: ExportInfo) -> list[str]:
    lines = ["## Model", ""]
    model = (facts.recipe or {}).get("model") or {}
    for part in ("tokenizers", "heads"):
        for name, spec in (model.get(part) or {}).items():
            lines.append(f"- {part[:-1]} `{name}`: {_describe(spec)}")
    if model.get("backbone"):
        bb = model["backbone"]
        keys = ("kind", "d_model", "n_layers", "n_heads", "n_kv_heads", "block", "norm", "act", "positions")
        lines.append("- backbone: " + ", ".join(f"{k} {bb[k]}" for k in keys if bb.get(k) is not None))
    if export.n_params is not None:
        lines.append(f"- parameters (exported): {export.n_params:,}")
    lines += [f"- exported: {export.parts}", ""]
    return lines


def _describe(spec: dict) -> str:
    shown = {k: v for k, v in spec.items() if v not in (None, [], {}) and not isinstance(v, dict)}
    return ", ".join(f"{k} {v}" for k, v in list(shown.items())[:8])


def _data_section(facts: CardFacts) -> list[str]:
    if not _tasks(facts):
        return []
    lines = ["## Training data", ""]
    for task, spec in _tasks(facts).items():
        data = spec.get("data") or {}
        root = str(data.get("root", ""))
        about = f" — {BUNDLED[root].description}" if root in BUNDLED else ""
        lines.append(
            f"- task `{task}` ({spec.get('kind')}, weight {spec.get('weight', 1.0)}): "
            f"`{data.get('kind')}` data at `{root}`{about}"
        )
    return [*lines, ""]


def _metrics_section(facts: CardFacts) -> list[str]:
    m = facts.metrics
    lines = ["## Evaluation", ""]
    if not (m.this or m.best or m.last):
        return [*lines, "No validation metrics were recorded for these weights.", ""]
    names = list(dict.fromkeys([*m.this, *m.best, *m.last]))
    cols = [
        ("these weights", m.this, m.this_step),
        ("best", m.best, m.best_step),
        ("last", m.last, m.last_step),
    ]
    cols = [c for c in cols if c[1]]
    lines.append("| metric | " + " | ".join(f"{label} (step {step})" for label, _, step in cols) + " |")
    lines.append("|---" * (len(cols) + 1) + "|")
    for n in names:
        lines.append(f"| `{n}` | " + " | ".join(_fmt(vals.get(n)) for _, vals, _ in cols) + " |")
    monitor = f" `best` is the row with the {m.mode} `{m.monitor}`." if m.monitor and m.best else ""
    lines += [
        "",
        "Measured by mmformer on each task's validation split during training (steps count optimiser "
        f"steps).{monitor}",
        "",
    ]
    return lines


def _fmt(value: float | None) -> str:
    return "" if value is None else f"{value:.4g}"


def _recipe_section(facts: CardFacts) -> list[str]:
    if facts.recipe is None:
        return []
    r = facts.recipe
    optim, trainer = r.get("optim") or {}, r.get("trainer") or {}
    keys = ("optimizer", "lr", "weight_decay", "warmup_steps", "schedule", "min_lr")
    lines = ["## Training recipe", ""]
    lines.append("- optimisation: " + ", ".join(f"{k} {optim[k]}" for k in keys if optim.get(k) is not None))
    keys = ("max_steps", "max_epochs", "precision", "accumulate_grad_batches", "devices")
    lines.append(
        "- trainer: " + ", ".join(f"{k} {trainer[k]}" for k in keys if trainer.get(k) not in (None, -1))
    )
    lines.append(f"- seed: {r.get('seed')}")
    text = yaml.safe_dump(r, sort_keys=False, allow_unicode=True)
    lines += [
        "",
        "<details><summary>The full resolved recipe</summary>",
        "",
        "```yaml",
        text.rstrip(),
        "```",
        "",
    ]
    lines += ["</details>", ""]
    return lines


def _intended_use(facts: CardFacts, export: ExportInfo) -> list[str]:
    data = (
        ", ".join(f"`{_dataset_id(t.get('data') or {})}`" for t in _tasks(facts).values())
        or "its source data"
    )
    lines = [
        "## Intended use and limitations",
        "",
        f"Intended for research, teaching and as a baseline for the tasks above, on data like {data}. "
        "The numbers above come from the run's own validation split only: the model has not been "
        "evaluated for robustness, out-of-distribution inputs, bias or safety, and is not meant for "
        "decisions about people.",
        "",
    ]
    lines += [f"- {item}" for item in export.limitations]
    return [*lines, ""] if export.limitations else lines


def _license_text(license_id: str) -> str:
    if license_id == "other":
        return (
            "Not set: the weights' terms follow from the training data and any pretrained source named "
            "above. Set the `license` field before publishing (`mmformer export … --license ID`)."
        )
    return (
        f"`{license_id}` (as declared at export: check it agrees with the data's and the base model's terms)."
    )
