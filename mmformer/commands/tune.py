"""``mmformer tune lr RECIPE [key=value …]`` and ``mmformer tune batch-size RECIPE [key=value …]``:
Lightning's learning-rate finder and batch-size finder (``lightning.pytorch.tuner.Tuner``) on a recipe,
each ending with the override to train with: ``optim.lr=…``, ``tasks.<task>.data.batch_size=…``.

``lr``: the LR range test (Smith, "Cyclical Learning Rates for Training Neural Networks", arXiv:1506.01186,
§3.3) as ``Tuner.lr_find`` runs it: ``--num-training`` optimizer steps from ``--min-lr`` to ``--max-lr``
(exponentially), the loss of each recorded; the suggestion is the LR of the steepest descent of the
smoothed loss. The sweep stands in for the recipe's schedule (warmup, decay) and gives every parameter
group the same LR (``optim.layer_decay``'s per-layer scales are not applied during it); the weights are
restored afterwards. The plot (PNG, the suggestion marked) and the curve (CSV) are written to
``<runs root>/<recipe name>/tune/``.

``batch-size``: ``Tuner.scale_batch_size`` on one task's training batch size (``--task``; the only task
by default): ``power`` doubles it until a step runs out of memory, ``binsearch`` then bisects. On CPU
nothing runs out of memory: the search stops at ``--max-val`` or at the size of the training set.

Both run on one device of the recipe's accelerator (a DDP / FSDP recipe too: the numbers are per device),
without loggers or checkpoints, with the recipe's precision, accumulation and clipping.
"""

from __future__ import annotations

import csv
import datetime as dt
import secrets
from pathlib import Path

import lightning as L

from ..build import build_datamodule, build_module
from ..build.trainer import progress_bars, trainer_arguments
from ..data.datamodule import MultiTaskDataModule
from ..errors import UsageError, did_you_mean
from ..recipe import load_recipe
from ..training.checkpoint_io import AtomicCheckpointIO
from ..training.runs import runs_root


def cmd_tune(args) -> int:
    """``args``: ``what`` (``lr`` | ``batch-size``), ``recipe``, ``overrides`` and the finder's options.

    Raises:
        RecipeError: the recipe or an override is refused (``load_recipe``).
        UsageError: ``--task`` names no task of the recipe, or a recipe with several tasks has none.
    """
    recipe = load_recipe(args.recipe, args.overrides)
    if args.what == "lr":
        return tune_lr(
            recipe,
            min_lr=args.min_lr,
            max_lr=args.max_lr,
            num_training=args.num_training,
            mode=args.mode or "exponential",
        )
    return tune_batch_size(
        recipe,
        task=args.task,
        mode=args.mode or "power",
        init_val=args.init_val,
        max_trials=args.max_trials,
        steps_per_trial=args.steps_per_trial,
        max_val=args.max_val,
    )


def tune_lr(
    recipe, min_lr: float = 1e-8, max_lr: float = 1.0, num_training: int = 100, mode: str = "exponential"
) -> int:
    """Run the LR range test on ``recipe``; prints where the plot and curve went and ``optim.lr=<lr>``.
    Returns 0, or 1 when the sweep recorded too few finite losses to suggest anything."""
    from lightning.pytorch.tuner import Tuner

    folder, stamp = _tune_folder(recipe), _stamp()
    trainer, module, datamodule = _setup(recipe, folder, max_steps=num_training)
    finder = Tuner(trainer).lr_find(
        module,
        datamodule=datamodule,
        min_lr=min_lr,
        max_lr=max_lr,
        num_training=num_training,
        mode=mode,
        update_attr=False,  # the suggestion is printed as an override, not set on the module
    )
    if finder is None:  # Lightning skips the finder under trainer.fast_dev_run
        print("no learning rates tried (trainer.fast_dev_run skips Lightning's LR finder)")
        return 1
    lrs, losses = finder.results["lr"], finder.results["loss"]
    curve = folder / f"lr_find-{stamp}.csv"
    with open(curve, "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["lr", "loss"])
        writer.writerows(zip(lrs, losses))
    suggestion = finder.suggestion()
    plot = folder / f"lr_find-{stamp}.png"
    _save_plot(finder, plot)
    print(f"LR range test: {len(lrs)} steps, lr {min_lr:g} → {max(lrs, default=min_lr):.3g} ({mode})")
    print(f"plot: {plot}\ncurve: {curve}")
    if suggestion is None:
        print("no suggestion: too few finite losses (raise --num-training, or lower --max-lr)")
        return 1
    print(f"suggested learning rate (steepest descent of the loss); train with:\noptim.lr={suggestion:.3g}")
    return 0


def tune_batch_size(
    recipe,
    task: str | None = None,
    mode: str = "power",
    init_val: int = 2,
    max_trials: int = 25,
    steps_per_trial: int = 3,
    max_val: int = 8192,
) -> int:
    """Run Lightning's batch-size finder on ``task``'s training batch size; prints
    ``tasks.<task>.data.batch_size=<n>``. Returns 0.

    Raises:
        UsageError: ``task`` is not a task of the recipe (did-you-mean), or is None with several tasks.
    """
    from lightning.pytorch.tuner import Tuner

    task = _task(recipe, task)
    folder = _tune_folder(recipe)
    trainer, module, datamodule = _setup(recipe, folder, max_steps=steps_per_trial)
    datamodule.setup("fit")
    train = datamodule.data[task].train
    n_train = len(train) if hasattr(train, "__len__") else max_val  # shards: as many as --max-val
    datamodule.__class__ = OneTaskBatchSize  # Lightning reads and sets datamodule.batch_size
    datamodule.tuned_task = task
    limit = min(max_val, n_train)
    found = Tuner(trainer).scale_batch_size(
        module,
        datamodule=datamodule,
        mode=mode,
        init_val=min(init_val, limit),
        max_trials=max_trials,
        steps_per_trial=steps_per_trial,
        max_val=limit,
    )
    device = trainer.strategy.root_device.type
    print(f"Lightning's batch-size finder ({mode}, {steps_per_trial} steps per size, one {device} device)")
    if found >= limit:
        why = f"--max-val {max_val}" if max_val <= n_train else f"the {n_train} training samples of {task!r}"
        print(
            f"note: the search stopped at its limit, {limit} ({why}), before running out of memory"
            + (" (on CPU nothing does)" if device == "cpu" else "")
            + "; Lightning does not try the limit itself"
        )
    print(f"train with:\ntasks.{task}.data.batch_size={found}")
    return 0


class OneTaskBatchSize(MultiTaskDataModule):
    """The datamodule with a ``batch_size`` attribute: task ``tuned_task``'s training batch size, which
    Lightning's batch-size finder reads and sets (``lightning_getattr``); the loaders built next use it."""

    tuned_task: str

    @property
    def batch_size(self) -> int:
        self.setup()
        return self.data[self.tuned_task].batch_size

    @batch_size.setter
    def batch_size(self, value: int) -> None:
        self.setup()
        self.data[self.tuned_task].batch_size = int(value)


def _setup(recipe, folder: Path, max_steps: int):
    """``(trainer, module, datamodule)`` for a finder: one device, no loggers or checkpoints, the run's
    length ``max_steps`` optimizer steps (the finder sets its own; this keeps the schedule finite)."""
    L.seed_everything(recipe.seed, workers=True, verbose=False)
    datamodule = build_datamodule(recipe)
    module = build_module(recipe)
    t = recipe.trainer
    module.compile_blocks, module.checkpoint_blocks = t.compile, t.activation_checkpointing
    module.onednn_linears = t.onednn_linears
    bars = progress_bars(t)
    devices = t.devices if isinstance(t.devices, list) and len(t.devices) == 1 else 1
    trainer = L.Trainer(
        **trainer_arguments(t, folder)
        | dict(
            devices=devices,
            num_nodes=1,
            strategy="auto",
            max_epochs=None,
            max_steps=max_steps,
            enable_progress_bar=bool(bars),
            callbacks=bars,
            logger=False,
            enable_checkpointing=False,
            inference_mode=False,
            default_root_dir=str(folder),
            use_distributed_sampler=False,
            plugins=[AtomicCheckpointIO()],
        )
    )
    return trainer, module, datamodule


def _task(recipe, task: str | None) -> str:
    if task is None:
        if len(recipe.tasks) > 1:
            raise UsageError(
                f"the recipe has several tasks: name one with --task ({', '.join(recipe.tasks)})"
            )
        return next(iter(recipe.tasks))
    if task not in recipe.tasks:
        raise UsageError(
            f"--task {task!r} is not a task of the recipe.{did_you_mean(task, recipe.tasks)} "
            f"Tasks: {', '.join(recipe.tasks)}"
        )
    return task


def _tune_folder(recipe) -> Path:
    folder = runs_root() / recipe.name / "tune"
    folder.mkdir(parents=True, exist_ok=True)
    return folder


def _stamp() -> str:
    return dt.datetime.now().strftime("%Y%m%d-%H%M%S-") + secrets.token_hex(2)


def _save_plot(finder, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")  # a file, never a window
    import matplotlib.pyplot as plt

    fig = finder.plot(suggest=True)
    fig.axes[0].set_title("LR range test (the suggestion in red)")
    fig.savefig(path, dpi=100, bbox_inches="tight")
    plt.close(fig)
