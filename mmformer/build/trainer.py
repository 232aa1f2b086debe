"""The trainer side of the composition root: callbacks, loggers, strategy and ``Trainer`` from a
loaded recipe and its run folder, and the metric the best checkpoint monitors."""

from __future__ import annotations

import sys
from pathlib import Path

import lightning as L
from lightning.fabric.plugins.environments import SLURMEnvironment
from lightning.pytorch.callbacks import ModelCheckpoint, TQDMProgressBar
from lightning.pytorch.profilers import AdvancedProfiler, PyTorchProfiler, SimpleProfiler
from lightning.pytorch.strategies import DDPStrategy

from ..errors import RecipeError, did_you_mean
from ..progress import setting as progress_setting
from ..progress import shows
from ..recipe import recipe_to_dict, recipe_to_yaml
from ..tasks import MultiTaskModule
from ..training.callbacks import BadSampleReport, EMAWeights, MediaSamples, ThroughputLogger
from ..training.checkpoint_io import AtomicCheckpointIO, LastCheckpoint
from ..training.freeze import FreezePretrained
from ..training.fsdp2 import FSDP2Strategy
from ..training.history import ResumableHistory
from ..training.loggers import build_loggers
from ..training.preemption import StopOnSignal
from ..training.runs import Run, RunFolder
from ..training.sharded_ema import ShardedEMAWeights
from ..training.threads import set_threads


def default_monitor(recipe, module: MultiTaskModule) -> tuple[str, str]:
    """The metric the best checkpoint tracks and its direction: ``checkpoint.monitor`` (checked against
    the metrics the tasks log), or the first task's main validation metric.

    Raises ``RecipeError`` (with a did-you-mean) for a monitor no task logs.
    """
    known = {"train/loss": "min"}
    for name, task in module.tasks.items():
        known[f"train/{name}/loss"] = "min"
        main_name, main_mode = getattr(task, "main_metric", ("loss", "min"))
        for metric in [*getattr(task, "val_metrics", {}), *getattr(task, "epoch_metric_names", ())]:
            known[f"val/{name}/{metric}"] = (
                main_mode
                if metric == main_name
                else ("min" if metric.endswith(("loss", "ppl", "wer", "cer")) else "max")
            )
    first = next(iter(recipe.tasks))
    metric, mode = getattr(module.tasks[first], "main_metric", ("loss", "min"))
    monitor = recipe.checkpoint.monitor or f"val/{first}/{metric}"
    if monitor not in known:
        raise RecipeError(
            f"'checkpoint.monitor' is {monitor!r}, which no task logs.{did_you_mean(monitor, known)} "
            f"Logged: {', '.join(sorted(known))}"
        )
    return monitor, recipe.checkpoint.mode or (mode if monitor == f"val/{first}/{metric}" else known[monitor])


def progress_bars(t) -> list[TQDMProgressBar]:
    """The progress bar of ``train`` and ``validate`` alike, for trainer section ``t``: none when
    ``trainer.enable_progress_bar`` is false or ``MMFORMER_PROGRESS=0`` (pass
    ``enable_progress_bar=bool(bars)``, or Lightning adds its own); redrawn every step on a terminal
    (or with ``MMFORMER_PROGRESS=1``), into a log file a line every 20 steps. Lightning draws it on the
    first process only."""
    if not t.enable_progress_bar or progress_setting() is False:
        return []
    return [TQDMProgressBar(refresh_rate=1 if shows() else 20)]


def pretrained_parts(recipe):
    """``module → [modules of kind pretrained: tokenizers, towers, backbone]`` for ``optim.freeze_pretrained_epochs``
    (heads are left training: a new classifier is what the frozen stage trains).
    """
    m = recipe.model  # that there are some, and a strategy that allows it, is checked at load
    names = [n for n, c in m.tokenizers.items() if c.kind == "pretrained"]
    towers = [n for n, c in m.towers.items() if c.kind == "pretrained"]

    def parts(pl_module):
        model = pl_module.model
        return (
            [model.tokenizers[n] for n in names]
            + [model.towers[n] for n in towers]
            + ([model.backbone] if m.backbone.kind == "pretrained" else [])
        )

    return parts


def refuse_kernels_untrainable_here(recipe) -> None:
    """Raises ``RecipeError`` before any data is read when the run would train on the CPU
    (``trainer.accelerator: cpu``, or ``auto`` without a CUDA device) with ``attn_kernel: flex`` in
    ``model.backbone`` or a tower, which has no backward pass there (``nn.attention.flex_attention``);
    flex still serves evaluation and generation on the CPU, so ``info``, ``validate`` and ``generate``
    take it. A pretrained backbone has no ``attn_kernel`` setting."""
    import torch

    t = recipe.trainer
    on_cpu = t.accelerator == "cpu" or (t.accelerator == "auto" and not torch.cuda.is_available())
    parts = {"model.backbone": recipe.model.backbone}
    parts |= {f"model.towers.{n}": c for n, c in recipe.model.towers.items()}
    for where, cfg in parts.items():
        if on_cpu and getattr(cfg, "attn_kernel", None) == "flex":
            why = "trainer.accelerator=cpu" if t.accelerator == "cpu" else "no CUDA device here"
            raise RecipeError(
                f"'{where}.attn_kernel': flex has no backward pass on the CPU, where this run would train "
                f"({why}): set attn_kernel sdpa (or auto), or train on a GPU; flex serves evaluation and "
                "generation on the CPU"
            )


def build_strategy(t, unused: bool = False, sharded: bool = False):
    """``trainer.strategy`` as Lightning takes it: ``fsdp2`` → ``FSDP2Strategy`` (``sharded``: each rank
    saves its own shard); ``ddp`` told about parameters that some steps leave without gradient
    (``unused``); other names unchanged."""
    if t.strategy == "fsdp2":
        return FSDP2Strategy(sharded=sharded)
    name = t.strategy.removesuffix("_find_unused_parameters_true")
    if name in DDP_START_METHODS:
        told = unused or name != t.strategy  # the recipe named the _find_unused_parameters_true variant
        return DDPStrategy(find_unused_parameters=told, start_method=DDP_START_METHODS[name])
    return t.strategy


# Lightning's DDP strategy names and how each starts its processes (``strategies/ddp.py`` registry).
DDP_START_METHODS = {"ddp": "popen", "ddp_spawn": "spawn", "ddp_fork": "fork", "ddp_notebook": "fork"}


def _interactive() -> bool:
    """A notebook or REPL: where Lightning's ``auto`` picks forked DDP processes (as it decides)."""
    return hasattr(sys, "ps1") or bool(sys.flags.interactive)


# ``trainer.profiler: <name>``: the profiler, writing its report to ``<run folder>/<stage>-profile.txt``
PROFILERS = {"simple": SimpleProfiler, "advanced": AdvancedProfiler, "pytorch": PyTorchProfiler}


def trainer_arguments(t, root: Path) -> dict:
    """The ``lightning.Trainer`` arguments that trainer section ``t`` sets: the typed ones, then every other
    one (``t.extra``: ``fast_dev_run``, ``overfit_batches``, ``detect_anomaly`` …) as written; a profiler
    named ``simple`` / ``advanced`` / ``pytorch`` writes its report to ``root/<stage>-profile.txt`` (fit,
    validate). Lightning's own model summary is off unless ``trainer.enable_model_summary`` turns it on
    (the CLI prints parameters and FLOPs per sample instead). Strategy and mmformer's own arguments
    (loggers, callbacks, run folder …) are the caller's."""
    args = dict(
        accelerator=t.accelerator,
        devices=t.devices,
        num_nodes=t.num_nodes,
        precision=t.precision,
        max_epochs=t.max_epochs,
        max_steps=t.max_steps,
        max_time=t.max_time,
        gradient_clip_val=t.gradient_clip_val,
        gradient_clip_algorithm=t.gradient_clip_algorithm,
        accumulate_grad_batches=t.accumulate_grad_batches,
        log_every_n_steps=t.log_every_n_steps,
        val_check_interval=t.val_check_interval,
        check_val_every_n_epoch=t.check_val_every_n_epoch,
        limit_train_batches=t.limit_train_batches,
        limit_val_batches=t.limit_val_batches,
        num_sanity_val_steps=t.num_sanity_val_steps,
        deterministic=t.deterministic,
        enable_progress_bar=t.enable_progress_bar,
        enable_model_summary=False,
    )
    args.update(t.extra)
    profiler = args.get("profiler")
    if isinstance(profiler, str) and profiler.lower() in PROFILERS:
        args["profiler"] = PROFILERS[profiler.lower()](dirpath=str(root), filename="profile")
    return args


def is_fast_dev_run(t) -> bool:
    """``trainer.fast_dev_run`` is on: a few batches as a smoke test, no checkpoints or logs."""
    return bool(t.extra.get("fast_dev_run"))


class RunNotes(L.Callback):
    """What a run's end-of-run report would otherwise leave out, printed by rank 0 when ``fit`` ends: that
    a ``trainer.fast_dev_run`` wrote no checkpoint, ``metrics.csv`` or W&B run, and where the profiler's
    report goes (Lightning writes it just after, when the stage tears down)."""

    def on_fit_end(self, trainer, pl_module) -> None:
        if not trainer.is_global_zero:
            return
        if trainer.fast_dev_run:
            n = int(trainer.fast_dev_run)
            print(
                f"trainer.fast_dev_run: a smoke test of {n} training and {n} validation batch(es) per task "
                f"({trainer.global_step} optimizer step(s)); no checkpoint, metrics.csv or W&B run was "
                "written and resume=auto will not pick this run up",
                flush=True,
            )
        profiler = trainer.profiler
        if isinstance(profiler, tuple(PROFILERS.values())) and profiler.dirpath and profiler.filename:
            print(f"profiler report: {Path(profiler.dirpath) / profiler._prepare_filename()}", flush=True)


def _slurm() -> list:
    """Under SLURM, Lightning's cluster environment without its SIGUSR1 auto-requeue: that handler saves a
    checkpoint from inside the signal handler, with a barrier each rank reaches at a different point of
    its step (the hang ``training.preemption`` avoids for SIGTERM). mmformer stops on SIGTERM at an agreed
    step instead, and ``docker/train_slurm.sbatch`` requeues the job (docs/distributed.md, SLURM)."""
    return [SLURMEnvironment(auto_requeue=False)] if SLURMEnvironment.detect() else []


def build_trainer(recipe, run: Run, module: MultiTaskModule, extra_callbacks=()) -> L.Trainer:
    """The Lightning ``Trainer`` of a run: checkpoints (best, last, and a stop on SIGTERM / Ctrl-C),
    throughput and media callbacks, EMA, freezing, loggers and the distribution strategy, with every
    Lightning argument of the recipe's ``trainer`` section (``trainer_arguments``). Under
    ``trainer.fast_dev_run`` no ``last.ckpt`` and no loggers are made (Lightning turns off its own
    checkpoints and loggers there; W&B would start a run for nothing)."""
    monitor, mode = default_monitor(recipe, module)
    smoke_test = is_fast_dev_run(recipe.trainer)
    ck = recipe.checkpoint
    checkpoint = ModelCheckpoint(
        dirpath=str(run.checkpoints),
        filename="best-epoch{epoch:03d}-step{step:06d}",
        monitor=monitor,
        mode=mode,
        save_top_k=ck.save_top_k,
        save_last=False,  # LastCheckpoint keeps last.ckpt fresh
        auto_insert_metric_name=False,  # validation only: a step-triggered save would carry a stale score
    )
    last = (
        [LastCheckpoint(str(run.checkpoints), ck.every_n_train_steps)]
        if ck.save_last and not smoke_test
        else []
    )
    # after the checkpoint callbacks: a stop on a signal keeps the best / last checkpoints of its step
    stop = StopOnSignal(last[0] if last else None)
    progress = progress_bars(recipe.trainer)
    ema = []
    if recipe.optim.ema_decay is not None:  # under FSDP2 each rank averages its own shard
        sharded_ema = recipe.trainer.strategy == "fsdp2"
        ema = [(ShardedEMAWeights if sharded_ema else EMAWeights)(recipe.optim.ema_decay)]
    freeze = []
    if recipe.optim.freeze_pretrained_epochs:
        freeze = [FreezePretrained(recipe.optim.freeze_pretrained_epochs, pretrained_parts(recipe))]
    loggers = (
        []
        if smoke_test
        else build_loggers(
            recipe.logger, run.dir, f"{recipe.name}/{run.run_id}", run.wandb_id, recipe_to_dict(recipe)
        )
    )
    t = recipe.trainer
    # frozen parameters, or the parts of the tasks a sampled step does not train, get no gradient:
    # DDP must be told (find_unused_parameters), or it waits for them forever
    unused = bool(freeze) or (recipe.multitask.schedule == "sampled" and len(recipe.tasks) > 1)
    strategy = build_strategy(t, unused, sharded=recipe.checkpoint.sharded)
    module.compile_blocks, module.checkpoint_blocks = t.compile, t.activation_checkpointing
    module.onednn_linears = t.onednn_linears
    kwargs = trainer_arguments(t, run.dir) | dict(
        enable_progress_bar=bool(progress),
        inference_mode=False,  # no_grad: metric states stay usable when validate_first runs before fit
        default_root_dir=str(run.dir),
        use_distributed_sampler=False,  # the datamodule shards itself (no padded evaluation)
        logger=loggers,
        callbacks=[
            RunFolder(run, recipe_to_yaml(recipe)),
            checkpoint,
            *last,
            stop,
            ThroughputLogger(),
            ResumableHistory(),
            BadSampleReport(),
            MediaSamples(),
            *ema,
            *freeze,
            *progress,
            *extra_callbacks,
            RunNotes(),
        ],
        plugins=[AtomicCheckpointIO(), *_slurm()],
    )
    trainer = L.Trainer(strategy=strategy, **kwargs)
    if unused and strategy == "auto" and type(trainer.strategy) is DDPStrategy:  # "auto" chose DDP: tell it
        start = "fork" if _interactive() else "popen"
        trainer = L.Trainer(strategy=DDPStrategy(find_unused_parameters=True, start_method=start), **kwargs)
    set_threads(t.threads, trainer.num_devices)  # every rank process builds its trainer: each sets its own
    return trainer
