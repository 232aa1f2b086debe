"""Long Range Arena comparison (Tay et al. 2021, Tables 1 and 2) over mmformer's attention kernels, with
the recipes of ``recipes/long_context/`` and one small model for every kernel.

    python bench/lra.py accuracy --tasks listops,pathfinder --jobs 2 --set trainer.threads=1  # Table 1
    python bench/lra.py accuracy --tasks text,image --steps 300         # Table 1 at a stated smaller budget
    python bench/lra.py speed --lengths 1024,2048,4096 --steps 4              # Table 2: steps/s, memory
    python bench/lra.py baselines --tasks listops     # what the majority class and the first tokens give

``accuracy`` trains each (task, kernel) at the recipe's budget (or ``trainer.max_steps=STEPS``, validated
at the end) and prints the final validation accuracy. ``speed`` trains the byte-level text recipe at each length (every
passage cut to it) for a few steps and reports training steps per second (after the first step) and the
peak resident memory of the training steps above the memory at the start of training (the high-water
mark reset there: Linux ``/proc/self/clear_refs``), relative to softmax attention (sdpa). ``baselines``
reads each task's data only: the validation accuracy of the majority class, and of the majority label
given the first ``k`` tokens (counted on the training split) — for ListOps the first token is the
outermost operator, which alone decides a large part of the answer. Every run is its own process
(``mmformer train`` with ``logger.mode=disabled``) so peak memory is that run's alone. The data must be
prepared first (each recipe's header says how). Numbers go to ``bench/README.md``; nothing here is a test.
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import os
import subprocess
import sys
import tempfile
import time
from collections import Counter, defaultdict
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
RECIPES = {
    "listops": "recipes/long_context/lra_listops.yaml",
    "text": "recipes/long_context/lra_text_kjv.yaml",
    "retrieval": "recipes/long_context/lra_retrieval_kjv.yaml",
    "image": "recipes/long_context/lra_image_mnist5k.yaml",
    "pathfinder": "recipes/long_context/lra_pathfinder.yaml",
}
# kernel → the overrides that choose it (options sized for these recipes' lengths)
KERNELS = {
    "sdpa": [],
    "window": ["model.backbone.window=128"],
    "bigbird": ["model.backbone.bigbird_block=64"],
    "performer": ["model.backbone.attn_kernel=performer", "model.backbone.performer_features=128"],
    "rfa": ["model.backbone.attn_kernel=rfa", "model.backbone.kernel_options={n_features: 128}"],
    "lsh": [
        "model.backbone.attn_kernel=lsh",
        "model.backbone.kernel_options={n_buckets: 32, chunk_size: 64}",
    ],
    "lsh+reversible": [
        "model.backbone.attn_kernel=lsh",
        "model.backbone.kernel_options={n_buckets: 32, chunk_size: 64}",
        "model.backbone.reversible=true",
    ],
    "aft_local": [
        "model.backbone.attn_kernel=aft_local",
        "model.backbone.kernel_options={max_len: 4096, window: 64}",
    ],
    "aft_full": [
        "model.backbone.attn_kernel=aft_full",
        "model.backbone.kernel_options={max_len: 4096}",
    ],
    "aft_simple": ["model.backbone.attn_kernel=aft_simple"],
}
RUN = """
import resource, sys
from pathlib import Path
import lightning as L
import mmformer.commands.train as command
from mmformer.cli import main


def vm(key):  # kB from /proc/self/status
    line = next(ln for ln in Path("/proc/self/status").read_text().splitlines() if ln.startswith(key))
    return int(line.split()[1])


class TrainingPeak(L.Callback):
    # the peak resident memory of the training steps alone: the high-water mark is reset when training
    # starts (Linux: writing 5 to /proc/self/clear_refs), after the model summary's FLOP count (an eager
    # forward+backward at full length) and the data loading
    def on_train_start(self, trainer, pl_module):
        Path("/proc/self/clear_refs").write_text("5")
        self.base = vm("VmRSS:")

    def on_train_end(self, trainer, pl_module):
        print("train_peak_mb", (vm("VmHWM:") - self.base) / 1024)


plain = command.train
command.train = lambda recipe, extra_callbacks=(), verbose=False: plain(
    recipe, [*extra_callbacks, TrainingPeak()], verbose
)
sys.exit(main(sys.argv[1:]))
"""


def train(recipe: str, overrides: list[str], runs: Path) -> dict:
    """One ``mmformer train`` in its own process: final validation metrics, peak RSS (MB), the run's
    ``metrics.csv`` rows and wall seconds."""
    # glibc hands freed tensors back to the system, so resident memory follows the live tensors
    env = dict(os.environ, MMFORMER_RUNS=str(runs), MALLOC_MMAP_THRESHOLD_="131072")
    args = [
        sys.executable,
        "-c",
        RUN,
        "train",
        recipe,
        "logger.mode=disabled",
        "trainer.enable_progress_bar=false",
    ]
    start = time.perf_counter()
    done = subprocess.run([*args, *overrides], cwd=ROOT, env=env, capture_output=True, text=True)
    seconds = time.perf_counter() - start
    if done.returncode != 0:
        return {"error": (done.stderr.strip().splitlines() or ["?"])[-1], "seconds": seconds}
    out = dict(
        line.split()[:2] for line in done.stdout.splitlines() if line.startswith(("val/", "train_peak_mb"))
    )
    rows = []
    for path in runs.glob("*/*/metrics.csv"):
        with open(path, newline="") as f:
            rows = list(csv.DictReader(f))
    return {"metrics": out, "rows": rows, "seconds": seconds}


def accuracy(
    tasks: list[str], kernels: list[str], steps: int | None, extra: list[str], jobs: int, out: Path | None
) -> None:
    """Train every (task, kernel) pair, ``jobs`` processes at a time, and print Table 1: the final
    validation accuracy of each. ``steps`` ``None`` keeps each recipe's own budget. Each finished run
    is appended to ``out`` (JSON lines: task, kernel, accuracy, seconds, steps) as it ends."""
    from concurrent.futures import ThreadPoolExecutor

    def one(task: str, kernel: str) -> dict:
        with tempfile.TemporaryDirectory() as runs:
            budget = [f"trainer.max_steps={steps}", f"trainer.val_check_interval={steps}"] if steps else []
            r = train(RECIPES[task], [*KERNELS[kernel], *budget, *extra], Path(runs))
        acc = next((v for k, v in r.get("metrics", {}).items() if k.endswith("/acc")), None)
        row = {
            "task": task,
            "kernel": kernel,
            "acc": float(acc) if acc else None,
            "error": r.get("error"),
            "seconds": round(r["seconds"], 1),
            "steps": steps or "recipe",
            "set": extra,
        }
        cell = f"{row['acc']:.3f}" if acc else f"error: {(r.get('error') or '?')[:60]}"
        print(f"  {task} {kernel}: {cell} ({r['seconds']:.0f} s)", file=sys.stderr, flush=True)
        if out is not None:
            with open(out, "a") as f:
                f.write(json.dumps(row) + "\n")
        return row

    unknown = [t for t in tasks if t not in RECIPES] + [k for k in kernels if k not in KERNELS]
    if unknown:
        raise SystemExit(
            f"unknown tasks / kernels {unknown}; tasks: {list(RECIPES)}, kernels: {list(KERNELS)}"
        )
    pairs = [(t, k) for t in tasks for k in kernels]
    with ThreadPoolExecutor(max_workers=jobs) as pool:
        rows = list(pool.map(lambda tk: one(*tk), pairs))
    cell = {(r["task"], r["kernel"]): f"{r['acc']:.3f}" if r["acc"] is not None else "error" for r in rows}
    print(f"| task | {' | '.join(kernels)} |\n|---|{'---|' * len(kernels)}")
    for task in tasks:
        print(f"| {task} | {' | '.join(cell[task, k] for k in kernels)} |", flush=True)


def baselines(tasks: list[str], overrides: list[str] = (), firsts: tuple[int, ...] = (1, 2, 3)) -> None:
    """Validation accuracy of label-only and first-tokens-only predictors, from each task's data; on the
    byte-level tasks, of order-free predictors (counts of bytes, 4-byte windows, words) and of a bag of
    bytes trained with the recipe's optimiser, head and budget (``trained_bag``; ``overrides`` apply to
    each task's recipe, those naming a task, ``tasks.text.…``, to its recipe only)."""
    from mmformer.data.roots import resolve_root
    from mmformer.data.sequence_format import read_meta, read_split
    from mmformer.recipe import load_recipe

    print("| task | majority class | " + " | ".join(f"first {k} tokens" for k in firsts) + " |")
    print("|---|---|" + "---|" * len(firsts))
    for task in tasks:
        (cfg,) = load_recipe(ROOT / RECIPES[task]).tasks.values()
        root = resolve_root(str(cfg.data.root))
        meta = read_meta(root)
        split, k_max = {}, max(firsts)
        for name in (cfg.data.train_split, cfg.data.val_split):  # only the first tokens are ever read
            tokens, offsets, labels = read_split(root, name, meta)
            starts, ends = offsets[:-1], offsets[1:]
            split[name] = [
                (tuple(tokens[a : min(a + k_max, b)]), int(y)) for a, b, y in zip(starts, ends, labels)
            ]
        train, val = split[cfg.data.train_split], split[cfg.data.val_split]
        majority = Counter(label for _, label in train).most_common(1)[0][0]
        cells = [sum(label == majority for _, label in val) / len(val)]
        for k in firsts:
            seen: dict[tuple, Counter] = defaultdict(Counter)
            for ids, label in train:
                seen[ids[:k]][label] += 1
            guess = {key: c.most_common(1)[0][0] for key, c in seen.items()}
            cells.append(sum(guess.get(ids[:k], majority) == label for ids, label in val) / len(val))
        print(f"| {task} | " + " | ".join(f"{c:.3f}" for c in cells) + " |", flush=True)
    byte_tasks = [t for t in tasks if t in ("text", "retrieval")]
    if byte_tasks:  # what the byte-level data holds, read without order
        print(
            "\n| task | predictor (no order) | " + " | ".join(UNITS) + " |\n|---|---|" + "---|" * len(UNITS)
        )
    for task in byte_tasks:
        (cfg,) = load_recipe(ROOT / RECIPES[task]).tasks.values()
        root = resolve_root(str(cfg.data.root))
        meta = read_meta(root)
        name, predict = {
            "text": ("multinomial naive Bayes", _naive_bayes),
            "retrieval": (
                "TF-IDF cosine of the two passages, threshold fit on the training pairs",
                _tfidf_pairs,
            ),
        }[task]
        cells = []
        for units in UNITS.values():
            train, val = (
                _passages(root, meta, split, units) for split in (cfg.data.train_split, cfg.data.val_split)
            )
            cells.append(predict(train, val))
        print(f"| {task} | {name} | " + " | ".join(f"{c:.3f}" for c in cells) + " |", flush=True)
    for task in byte_tasks:  # the recipe's optimiser and budget on its model without blocks
        # an override of another recipe's task (tasks.<other>.…) is that recipe's
        own = [o for o in overrides if not o.startswith("tasks.") or o.startswith(f"tasks.{task}.")]
        recipe = load_recipe(ROOT / RECIPES[task], own)
        (cfg,) = recipe.tasks.values()
        root = resolve_root(str(cfg.data.root))
        meta = read_meta(root)
        train, val = (
            _sequences(root, meta, split, cfg.data.max_len, cfg.data.pairs)
            for split in (cfg.data.train_split, cfg.data.val_split)
        )
        acc = trained_bag(train, val, recipe)
        print(
            f"\n| {task} | a bag of bytes trained as the recipe trains (d_model {recipe.model.backbone.d_model}, "
            f"lr {recipe.optim.lr:g}, {recipe.trainer.max_steps} steps × {cfg.data.batch_size}) | {acc:.3f} |",
            flush=True,
        )


def _sequences(
    root: Path, meta: dict, split: str, max_len: int | None, pairs: bool = False
) -> list[tuple[list[np.ndarray], int]]:
    """Each stored sequence as its passages — with ``pairs`` (``data.pairs``: LRA's Retrieval read by two
    towers) the two of "A, separator, B", else the whole sequence — each cut to its first ``max_len``
    ids, and its label."""
    from mmformer.data.sequence_format import read_split

    tokens, offsets, labels = read_split(root, split, meta)
    separator = meta.get("separator") if pairs else None
    out = []
    for a, b, label in zip(offsets[:-1], offsets[1:], labels):
        ids = tokens[a:b]
        cuts = [0, *(np.flatnonzero(ids == separator) if separator is not None else []), len(ids)]
        parts = [ids[i + (i > 0) : j][:max_len] for i, j in zip(cuts[:-1], cuts[1:])]
        out.append((parts, int(label)))
    return out


def trained_bag(train: list, val: list, recipe) -> float:
    """Validation accuracy of the recipe's model without its blocks and positions — a bag of ids: the
    mean of each passage's token embeddings (the recipe's tokenizer's ``embed``, as initialised there),
    read by the recipe's own head with mean pooling (Text: LayerNorm and linear; Retrieval: the two-tower
    pair head, LayerNorm of each passage's mean, ``[u, v, u·v, u−v]`` and its MLP) — trained with the
    recipe's optimiser and schedule (``build_optimizer``: its parameter groups, weight decay on matrices
    only; ``build_scheduler``), batch size, step count, gradient clipping and seed; batches drawn epoch by
    epoch from a seeded permutation. ``train`` / ``val``: ``(passages, label)`` as ``_sequences`` reads
    them. What the recipe's budget teaches a model that can only count ids: the transformer's blocks can
    represent it (mean pooling over the residual stream). Raises ``ValueError`` for a head that reads a
    class token (``pool: cls``), which a bag has not."""
    import torch
    from torch import nn

    from mmformer.build.model import build_model
    from mmformer.nn.tokens import Tokens
    from mmformer.training.optim import build_optimizer, build_scheduler

    (cfg,) = recipe.tasks.values()
    if recipe.model.heads[cfg.head].pool != "mean":
        raise ValueError(f"the bag of ids has no class token: model.heads.{cfg.head}.pool must be mean")
    torch.manual_seed(recipe.seed)
    built = build_model(recipe)
    tokenizer = built.tokenizers[cfg.tokenizer]
    prefix = getattr(tokenizer, "num_prefix_tokens", 0)  # rows the head's mean pooling skips
    bag = nn.Module()
    bag.embed = nn.EmbeddingBag.from_pretrained(tokenizer.embed.weight.detach().clone(), False, mode="mean")
    bag.head = built.heads[cfg.head]
    steps = recipe.trainer.max_steps
    opt = build_optimizer(bag, recipe.optim)
    sched = build_scheduler(opt, recipe.optim, steps)

    def logits(batch: list) -> torch.Tensor:
        # the first passages of the batch, then the second ones (the pair head's 2B rows), one token each
        ids = [
            torch.as_tensor(parts[k].astype(np.int64)) for k in range(len(batch[0][0])) for parts, _ in batch
        ]
        offsets = torch.tensor([0, *(len(x) for x in ids[:-1])]).cumsum(0)
        means = bag.embed(torch.cat(ids), offsets)[:, None]  # (rows, 1, D)
        hidden = torch.cat([means.new_zeros(len(ids), prefix, means.shape[-1]), means], dim=1)
        return bag.head(hidden, Tokens.from_embeddings(hidden, 0))

    g = torch.Generator().manual_seed(recipe.seed)
    order: list[int] = []
    for _ in range(steps):
        if len(order) < cfg.data.batch_size:
            order += torch.randperm(len(train), generator=g).tolist()
        batch = [train[i] for i in order[: cfg.data.batch_size]]
        del order[: cfg.data.batch_size]
        loss = nn.functional.cross_entropy(logits(batch), torch.tensor([y for _, y in batch]))
        opt.zero_grad()
        loss.backward()
        if recipe.trainer.gradient_clip_val:
            nn.utils.clip_grad_norm_(bag.parameters(), recipe.trainer.gradient_clip_val)
        opt.step()
        sched.step()
    bag.eval()  # the head's dropout, if any, off
    with torch.no_grad():
        predicted = torch.cat([logits(val[i : i + 64]).argmax(-1) for i in range(0, len(val), 64)])
    return (predicted == torch.tensor([y for _, y in val])).float().mean().item()


def _passages(root: Path, meta: dict, split: str, units) -> list[tuple[list[Counter], int]]:
    """Each stored sequence as counts of its ``units`` (a function of the passage's bytes), one count per
    passage — two for a pair stored as "A, separator, B" — and its label."""
    from mmformer.data.sequence_format import read_split

    tokens, offsets, labels = read_split(root, split, meta)
    separator = meta.get("separator")
    out = []
    for a, b, label in zip(offsets[:-1], offsets[1:], labels):
        ids = tokens[a:b]
        cuts = [0, *(np.flatnonzero(ids == separator) if separator is not None else []), len(ids)]
        parts = [ids[i + (i > 0) : j] for i, j in zip(cuts[:-1], cuts[1:])]
        out.append(([units(bytes(p.astype(np.uint8))) for p in parts], int(label)))
    return out


# what a passage is counted in: its bytes, its overlapping 4-byte windows, its words (split on
# whitespace, punctuation stripped, lower case)
UNITS = {
    "bytes": lambda text: Counter(text),
    "byte 4-grams": lambda text: Counter(text[i : i + 4] for i in range(len(text) - 3)),
    "words": lambda text: Counter(w.strip(b".,;:?!()'\"").lower() for w in text.split()),
}


def _naive_bayes(train: list, val: list) -> float:
    """Multinomial naive Bayes (add-one smoothing) over each passage's units (bytes, 4-byte windows or
    words, ``UNITS``): validation accuracy."""
    counts: dict[int, Counter] = defaultdict(Counter)
    prior = Counter(label for _, label in train)
    for (words,), label in train:
        counts[label].update(words)
    vocab = len(set().union(*counts.values()))
    totals = {k: sum(c.values()) + vocab for k, c in counts.items()}

    def guess(words: Counter) -> int:
        return max(
            counts,
            key=lambda k: (
                math.log(prior[k])
                + sum(n * math.log((counts[k][w] + 1) / totals[k]) for w, n in words.items())
            ),
        )

    return sum(guess(words) == label for (words,), label in val) / len(val)


def _tfidf_pairs(train: list, val: list) -> float:
    """Cosine similarity of the two passages' TF-IDF word vectors (document frequencies from the
    training passages), "same" above the threshold that is most accurate on the training pairs:
    validation accuracy."""
    df = Counter(w for halves, _ in train for words in halves for w in words)
    n_docs = 2 * len(train)

    def cosine(u: Counter, v: Counter) -> float:
        wu = {w: n * math.log(n_docs / (1 + df[w])) for w, n in u.items()}
        wv = {w: n * math.log(n_docs / (1 + df[w])) for w, n in v.items()}
        dot = sum(x * wv.get(w, 0.0) for w, x in wu.items())
        norm = math.sqrt(sum(x * x for x in wu.values()) * sum(x * x for x in wv.values()))
        return dot / norm if norm else 0.0

    scored = sorted((cosine(*halves), label) for halves, label in train)
    # "same" from a threshold on: each distinct score is a candidate, and +inf ("never same"); pairs of
    # equal score (often 0: no shared word) fall on one side together
    positives_above, negatives_below = sum(label for _, label in scored), 0
    best, threshold = len(scored) - positives_above, float("inf")  # never same: every negative right
    for i, (score, label) in enumerate(scored):
        if i == 0 or score != scored[i - 1][0]:
            if negatives_below + positives_above > best:
                best, threshold = negatives_below + positives_above, score
        negatives_below += label == 0
        positives_above -= label == 1
    return sum((cosine(*halves) >= threshold) == bool(label) for halves, label in val) / len(val)


def speed(lengths: list[int], kernels: list[str], steps: int, extra: list[str]) -> None:
    """Table 2: training steps/s and peak memory of the Text recipe cut to each length, per kernel (ratios
    to the first kernel), with the recipe overrides ``extra`` (e.g. ``trainer.threads=1``)."""
    print("| kernel | " + " | ".join(f"{n} steps/s | {n} training MB" for n in lengths) + " |")
    print("|---|" + "---|---|" * len(lengths))
    base: dict[int, tuple[float, float]] = {}
    for kernel in kernels:
        cells = []
        for n in lengths:
            with tempfile.TemporaryDirectory() as runs:
                budget = [
                    f"trainer.max_steps={steps}",
                    "trainer.limit_val_batches=0",
                    "trainer.log_every_n_steps=1",
                    f"tasks.text.data.max_len={n}",
                    "tasks.text.data.bucket_by_length=false",
                ]
                r = train(RECIPES["text"], [*KERNELS[kernel], *budget, *extra], Path(runs))
            if "error" in r:
                cells += [f"error: {r['error'][:50]}", ""]
                continue
            rate = [
                float(x["throughput/samples_per_sec"])
                for x in r["rows"]
                if x.get("throughput/samples_per_sec")
            ]
            batch = 4
            sps = rate[-1] / batch if rate else float("nan")
            mem = float(r["metrics"].get("train_peak_mb", "nan"))
            base.setdefault(n, (sps, mem))
            cells += [f"{sps:.2f} ({sps / base[n][0]:.2f}×)", f"{mem:.0f} ({mem / base[n][1]:.2f}×)"]
            print(f"  {kernel} {n}: {cells[-2]} {cells[-1]}", file=sys.stderr, flush=True)
        print(f"| {kernel} | " + " | ".join(cells) + " |", flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("mode", choices=["accuracy", "speed", "baselines"])
    p.add_argument("--tasks", default=",".join(RECIPES))
    p.add_argument("--kernels", default=",".join(KERNELS))
    p.add_argument("--steps", type=int, default=None, help="accuracy: training steps; speed: steps per run")
    p.add_argument("--lengths", default="1024,2048,4096")
    p.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="a recipe override for every run (repeatable), e.g. trainer.threads=1; baselines: the trained bag's",
    )
    p.add_argument("--jobs", type=int, default=1, help="accuracy: runs at a time (give each trainer.threads)")
    p.add_argument(
        "--out", type=Path, default=None, help="accuracy: append each finished run here (JSON lines)"
    )
    a = p.parse_args()
    a.out = a.out.resolve() if a.out else None
    os.chdir(ROOT)  # data roots resolve as the runs' (started in the repository) do, from any folder
    kernels = a.kernels.split(",")
    if a.mode == "baselines":
        baselines(a.tasks.split(","), a.set)
    elif a.mode == "accuracy":
        accuracy(a.tasks.split(","), kernels, a.steps, a.set, a.jobs, a.out)
    else:
        speed([int(n) for n in a.lengths.split(",")], kernels, a.steps or 4, a.set)


if __name__ == "__main__":
    main()
