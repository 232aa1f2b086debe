"""Platform overhead: ``mmformer train`` against a bare PyTorch loop over the same model, batches and optimizer.

    python bench/overhead.py                                          # the quickstart recipe
                                     # (warm-up 40 steps: past its first epoch, which fills the image cache)
    python bench/overhead.py recipes/text/gpt_mini_lm_kjv.yaml --steps 120 --warmup 20
    python bench/overhead.py RECIPE --only bare-memory,bare,mmformer --rounds 5
    python bench/overhead.py --data-path                              # the loader alone, old vs new

Every variant trains the recipe's model (built by ``build_module``, the same code and initialisation)
for ``--steps`` optimizer steps on one process and reports the mean wall time per step over the steps
after ``--warmup``:

    bare-memory       forward, loss, backward, gradient clipping (the recipe's), the recipe's optimizer
                      and LR schedule (``build_optimizer`` / ``build_scheduler``) over batches collated
                      in advance and held in memory: the model's own cost, the floor. One process on the
                      CPU, fp32, no accumulation, compile or checkpointing, the model's parameters only
                      (not a task's own, e.g. a contrastive temperature): a recipe that needs those is
                      compared by its model's step alone
    bare              the same loop pulling each batch from the recipe's training loader
                      (``build_datamodule``: reading, per-sample seeded augmentation, collation)
    mmformer          ``mmformer.commands.train.train``: the whole platform as a user runs it, with the
                      recipe's logger (W&B offline without credentials), progress bar, throughput / FLOPs
                      meter, non-finite-gradient check, gradient-norm logging, last.ckpt
    mmformer-<part>   the same without one part, to price it: ``wandb`` (``logger.mode=disabled``; the
                      CSV log stays), ``progress`` (no progress bar), ``throughput`` (no throughput
                      callback), ``finite`` (no non-finite-gradient check), ``ckpt`` (no last.ckpt),
                      ``all`` (none of those)

Validation is off on every side (``limit_val_batches=0``): the loop, not the evaluation, is measured.
The variants run interleaved, ``--rounds`` times (bare-memory, bare, mmformer, …, then again), so each
sees the same machine state; the table gives each variant's median over the rounds and the median of
the per-round ratios to ``bare-memory`` (the overhead: ``mmformer`` / ``bare-memory`` − 1) and to
``bare``. Imports Lightning and the whole platform (unlike the model-library benches).

``--data-path`` times the training loader alone of an image-folder recipe with crop / flip augmentation:
batches of the recipe's size drawn with torchvision v2's ``RandomCrop`` / ``RandomHorizontalFlip`` inside
``torch.random.fork_rng`` per sample (how mmformer augmented before ``data.crop_flip``) against
``RandomCropFlip`` inside ``seeding.seeded`` (the same pixels), alternately, ``--rounds`` × 4 times.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from anywhere in the checkout

import lightning as L  # noqa: E402
import torch  # noqa: E402

QUICKSTART = "recipes/image/vit_tiny_classify_mnist5k.yaml"
PARTS = ("wandb", "progress", "throughput", "finite", "ckpt", "all")
VARIANTS = ("bare-memory", "bare", "mmformer", *(f"mmformer-{p}" for p in PARTS))


def load(recipe_path: str, steps: int, threads: int, extra=()):
    from mmformer.recipe import load_recipe

    overrides = [
        f"trainer.max_steps={steps}",
        "trainer.limit_val_batches=0",
        "trainer.num_sanity_val_steps=0",
        f"trainer.threads={threads}",
        "trainer.accelerator=cpu",  # the bare loop runs on the CPU
        *extra,
    ]
    return load_recipe(recipe_path, overrides)


# ------------------------------------------------------------------------------------------ bare loops
def bare_loop(recipe, steps: int, warmup: int, in_memory: bool) -> float:
    """Seconds per step of a plain training loop over the recipe's model, optimizer and batches."""
    from mmformer.build import BuildContext, build_datamodule, build_module
    from mmformer.data.windows import WINDOW
    from mmformer.nn.onednn import use_onednn
    from mmformer.training.optim import build_optimizer, build_scheduler

    L.seed_everything(recipe.seed, verbose=False)
    ctx = BuildContext(recipe)
    datamodule = build_datamodule(recipe, ctx)
    module = build_module(recipe, ctx=ctx)
    model, tasks, weights = module.model, module.tasks, module.weights
    module.onednn_linears = recipe.trainer.onednn_linears  # as build.trainer sets it for mmformer train
    if module.routes_onednn():  # the same products as mmformer train (its configure_model)
        use_onednn(model)
    optimizer = build_optimizer(model, recipe.optim)
    scheduler = build_scheduler(optimizer, recipe.optim, steps)
    params = [p for g in optimizer.param_groups for p in g["params"]]
    clip = recipe.trainer.gradient_clip_val
    loader = datamodule.train_dataloader()

    def forever():
        while True:
            yield from loader

    batches = forever()
    if in_memory:
        batches = iter(list(itertools.islice(batches, steps)))
    model.train()
    stamps = []
    for _ in range(steps):
        stamps.append(time.perf_counter())
        batch = next(batches)
        batch.pop(WINDOW, None)
        loss = sum(weights[n] * tasks[n].training_loss(model, b) for n, b in batch.items() if b is not None)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        if clip:
            torch.nn.utils.clip_grad_norm_(params, clip)
        optimizer.step()
        scheduler.step()
    stamps.append(time.perf_counter())
    return (stamps[-1] - stamps[warmup]) / (steps - warmup)


# ------------------------------------------------------------------------------------------ data path
def data_path(recipe_path: str, rounds: int, batches: int = 10) -> None:
    """ms per training batch: torchvision's transforms under ``fork_rng`` vs ``RandomCropFlip`` under
    ``seeded``, interleaved."""
    from torchvision.transforms import v2

    import mmformer.data.seeding as seeding
    from mmformer.build import BuildContext, build_datamodule

    recipe = load(recipe_path, 1, 1)
    datamodule = build_datamodule(recipe, BuildContext(recipe))
    datamodule.setup()
    name, data = next(iter(datamodule.data.items()))
    transform = data.train.transform
    new_steps = list(transform.train_transforms)
    (crop_flip,) = new_steps  # an image-folder recipe with crop_padding / hflip
    old_steps = [v2.RandomCrop(crop_flip.size, padding=crop_flip.padding)] if crop_flip.padding else []
    old_steps += [v2.RandomHorizontalFlip(crop_flip.flip_p)] if crop_flip.flip_p else []
    new_seeded = seeding.seeded

    @contextlib.contextmanager
    def old_seeded(seed: int):
        with torch.random.fork_rng(devices=[]):
            torch.default_generator.manual_seed(seed)
            yield

    loader = datamodule.train_dataloader()
    for _ in itertools.islice(loader, len(loader)):  # the first epoch fills the decoded-image cache
        pass

    def per_batch(old: bool) -> float:
        transform.train_transforms = [v2.Compose(old_steps)] if old else new_steps
        seeding.seeded = old_seeded if old else new_seeded
        it = iter(loader)
        start = time.perf_counter()
        for _ in range(batches):
            next(it)
        return (time.perf_counter() - start) / batches

    times = {True: [], False: []}
    try:
        for _ in range(4 * rounds):
            for old in (True, False):
                times[old].append(per_batch(old))
    finally:
        transform.train_transforms, seeding.seeded = new_steps, new_seeded
    ratios = sorted(o / n for o, n in zip(times[True], times[False]))
    q = statistics.quantiles(ratios, n=4)
    print(
        f"{name}: a training batch of {data.batch_size}: torchvision + fork_rng "
        f"{statistics.median(times[True]) * 1e3:.1f} ms, RandomCropFlip + seeded "
        f"{statistics.median(times[False]) * 1e3:.1f} ms; ratio {statistics.median(ratios):.2f} "
        f"(IQR {q[0]:.2f}–{q[2]:.2f}, {len(ratios)} rounds of {batches} batches)"
    )


# ------------------------------------------------------------------------------------------ the platform
class StepClock(L.Callback):
    """The wall-clock time at the start of every training step and at the end of training."""

    def __init__(self):
        self.stamps: list[float] = []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self.stamps.append(time.perf_counter())

    def on_train_end(self, trainer, pl_module) -> None:
        self.stamps.append(time.perf_counter())


class _Off(L.Callback):
    """Stands in for a callback priced out of the run."""

    def __init__(self, *args, **kwargs):
        pass


@contextlib.contextmanager
def without(part: str | None):
    """Patch the platform so the run leaves ``part`` out (throughput callback, finite check)."""
    import mmformer.build.trainer as build_trainer
    import mmformer.tasks.router as router

    saved = build_trainer.ThroughputLogger, router.checked_grad_norm
    if part in ("throughput", "all"):
        build_trainer.ThroughputLogger = _Off
    if part in ("finite", "all"):  # the norm that clipping needs stays; the decision on it goes
        router.checked_grad_norm = lambda params, reduce=None: (router._grad_norm(params), True)
    try:
        yield
    finally:
        build_trainer.ThroughputLogger, router.checked_grad_norm = saved


def platform_run(recipe_path: str, steps: int, warmup: int, threads: int, part: str | None) -> float:
    """Seconds per step of ``mmformer train`` (without ``part``)."""
    from mmformer.commands.train import train

    extra = []
    if part in ("wandb", "all"):
        extra.append("logger.mode=disabled")
    if part in ("progress", "all"):
        extra.append("trainer.enable_progress_bar=false")
    if part in ("ckpt", "all"):
        extra.append("checkpoint.save_last=false")
    recipe = load(recipe_path, steps, threads, extra)
    clock = StepClock()
    with without(part), contextlib.redirect_stdout(open(os.devnull, "w")):
        train(recipe, extra_callbacks=[clock])
    stamps = clock.stamps
    if len(stamps) < steps + 1:
        raise RuntimeError(f"the run took {len(stamps) - 1} steps, not {steps}")
    return (stamps[steps] - stamps[warmup]) / (steps - warmup)


def run_variant(name: str, recipe_path: str, steps: int, warmup: int, threads: int) -> float:
    torch.set_num_threads(threads)
    if name.startswith("bare"):
        return bare_loop(load(recipe_path, steps, threads), steps, warmup, in_memory=name == "bare-memory")
    part = name.removeprefix("mmformer").removeprefix("-") or None
    return platform_run(recipe_path, steps, warmup, threads, part)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("recipe", nargs="?", default=QUICKSTART)
    p.add_argument("--steps", type=int, default=200, help="optimizer steps per variant (default 200)")
    p.add_argument(
        "--warmup",
        type=int,
        default=40,
        help="steps not timed first (default 40: the quickstart's first epoch)",
    )
    p.add_argument("--rounds", type=int, default=3, help="interleaved rounds (default 3)")
    p.add_argument("--threads", type=int, default=1, help="torch threads on every side (default 1)")
    p.add_argument("--only", default=",".join(VARIANTS), help=f"comma-separated subset of {VARIANTS}")
    p.add_argument("--data-path", action="store_true", help="time the training loader alone, old vs new")
    a = p.parse_args()
    if a.data_path:
        torch.set_num_threads(a.threads)
        data_path(a.recipe, a.rounds)
        return
    only = [v.strip() for v in a.only.split(",") if v.strip()]
    unknown = sorted(set(only) - set(VARIANTS))
    if unknown:
        p.error(f"unknown variants {unknown}; choose from {VARIANTS}")
    if not 0 <= a.warmup < a.steps:
        p.error("need 0 <= --warmup < --steps")
    os.environ.setdefault("MMFORMER_RUNS", tempfile.mkdtemp(prefix="mmformer-overhead-"))
    os.environ.setdefault("WANDB_SILENT", "true")
    print(
        f"{a.recipe}: {a.steps} steps per variant ({a.warmup} warm-up), {a.rounds} rounds, {a.threads} "
        f"thread(s), torch {torch.__version__}; load {os.getloadavg()[0]:.2f}",
        flush=True,
    )
    times: dict[str, list[float]] = {v: [] for v in only}
    for r in range(a.rounds):
        for v in only:
            t = run_variant(v, a.recipe, a.steps, a.warmup, a.threads)
            times[v].append(t)
            print(f"round {r + 1}: {v:20} {t * 1e3:8.1f} ms/step", flush=True)
    print(f"\nload {os.getloadavg()[0]:.2f}")
    print("| variant | ms per step (median) | × bare-memory (IQR) | × bare |")
    print("| --- | --- | --- | --- |")
    for v in only:
        med = statistics.median(times[v])
        cells = []
        for ref in ("bare-memory", "bare"):
            if ref in times:
                ratios = sorted(t / b for t, b in zip(times[v], times[ref]))
                q = statistics.quantiles(ratios, n=4) if len(ratios) > 1 else [ratios[0]] * 3
                cells.append(f"{statistics.median(ratios):.3f} ({q[0]:.2f}–{q[2]:.2f})")
            else:
                cells.append("-")
        print(f"| {v} | {med * 1e3:.1f} | {cells[0]} | {cells[1]} |")


if __name__ == "__main__":
    main()
