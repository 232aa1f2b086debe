"""``mmformer train RECIPE [key=value …]``: train a recipe (resume, stop on a signal, report)."""

from __future__ import annotations

import os
import signal
from functools import partial

import lightning as L
from lightning.pytorch.accelerators import CPUAccelerator
from lightning.pytorch.utilities.exceptions import SIGTERMException

from ..build import BuildContext, build_datamodule, build_module, build_trainer
from ..build.trainer import refuse_kernels_untrainable_here
from ..recipe import load_recipe, recipe_to_yaml
from ..recipe.defaults import non_defaults_yaml
from ..recipe.model_changes import model_changes
from ..training.callbacks import LastValidationStep
from ..training.cpu_bf16 import bf16_hint
from ..training.loggers import check_loggers, finish_loggers, wandb_run_url, wandb_sync_command
from ..training.preemption import Preempted
from ..training.runs import describe_resume, exported, open_run
from ..training.sharded import read_meta
from ..training.threads import choose_threads, load_hint, usable_cores
from .info import describe_model


def _is_rank_zero() -> bool:
    return all(os.environ.get(v, "0") == "0" for v in ("RANK", "LOCAL_RANK", "NODE_RANK", "SLURM_PROCID"))


def _say(msg: str) -> None:
    if _is_rank_zero():
        print(msg, flush=True)


def cmd_train(args) -> int:

    recipe = load_recipe(args.recipe, args.overrides)
    kept = [o for o in args.overrides if not o.startswith("resume=")]
    again = " ".join(["mmformer train", str(args.recipe), *kept, "resume=auto"])
    try:
        trainer, run = train(recipe, verbose=True)
    except Preempted as e:  # every rank stopped at the same step; exit as the signal's default would
        saved = (
            f"saved {e.checkpoint}" if e.checkpoint else "no checkpoint saved (checkpoint.save_last=false)"
        )
        _say(f"stopped by {signal.Signals(e.signum).name} at step {e.step}; {saved}\ncontinue with: {again}")
        return e.exit_code
    except SIGTERMException:  # Lightning's own handler (a signal before the run's handler was installed)
        _say(f"stopped by SIGTERM before training started; continue with: {again}")
        return 143
    if not trainer.is_global_zero:
        return 0
    if trainer.interrupted:
        print(f"interrupted at step {trainer.global_step}; run folder: {run.dir}\ncontinue with: {again}")
        return 130
    _report(trainer, run)
    return 0


def train(recipe, extra_callbacks=(), verbose: bool = False):
    """Train a resolved recipe (what ``mmformer train`` does); returns ``(trainer, run)``.

    Ends with a validation of the final weights when the last step was not already validated.
    ``verbose`` prints the recipe's non-defaults, the model's size and FLOPs, and what is resumed.
    Raises ``UsageError`` at once, before any data is read, for W&B online without an API key or a
    ``logger.kinds`` entry whose package is not installed, and ``RecipeError`` for a kernel with no
    backward pass on the device the run trains on (flex on the CPU).
    """
    check_loggers(recipe.logger)
    refuse_kernels_untrainable_here(recipe)

    L.seed_everything(recipe.seed, workers=True, verbose=False)
    run = open_run(recipe.name, recipe.resume, partial(model_changes, recipe=recipe))
    with exported(run):
        trainer = _fit(recipe, run, extra_callbacks, verbose)
    return trainer, run


def _fit(recipe, run, extra_callbacks, verbose: bool):
    trainer = None
    resumed = None if run.resume_from is None else read_meta(run.resume_from)  # recipe, tokenizers, step
    ctx = BuildContext.from_checkpoint(recipe, resumed)  # a resumed run reads data with its own tokenizers
    try:
        datamodule = build_datamodule(recipe, ctx)  # fails here, before anything long, on bad data paths
        module = build_module(recipe, ctx=ctx)
        if verbose:
            whole = run.dir / "recipe.yaml"
            _say(
                f"# recipe, what differs from the defaults (the whole recipe: {whole})\n"
                + non_defaults_yaml(recipe)
            )
            _say("\n".join(describe_model(module.model, recipe)))
        tracker = LastValidationStep()
        trainer = build_trainer(recipe, run, module, extra_callbacks=[tracker, *extra_callbacks])
        if verbose:
            _say(_threads_line(recipe, trainer))
            on = "cpu" if isinstance(trainer.accelerator, CPUAccelerator) else "accelerator"
            if hint := bf16_hint(recipe.trainer.precision, on):
                _say(hint)
        if verbose and (url := wandb_run_url(trainer.loggers)):
            _say(f"W&B run: {url}")
        if run.resume_from is not None and verbose:
            _say(describe_resume(run, recipe_to_yaml(recipe), resumed))
        if recipe.trainer.validate_first and run.resume_from is None:  # the "before" numbers, at step 0
            trainer.validate(module, datamodule=datamodule, verbose=False)
            if verbose:
                _say("before training: " + _val_metrics(trainer))
        trainer.fit(
            module, datamodule=datamodule, ckpt_path=str(run.resume_from) if run.resume_from else None
        )
        if not trainer.interrupted and tracker.step != trainer.global_step:  # final weights not validated yet
            trainer.validate(module, datamodule=datamodule, verbose=False)
    finally:
        if trainer is not None:
            finish_loggers(trainer.loggers)
    return trainer


def _threads_line(recipe, trainer) -> str:
    procs, cores = trainer.num_devices, usable_cores()
    choice = choose_threads(recipe.trainer.threads, procs, cores)
    why = (
        "set by trainer.threads"
        if choice.reason == "trainer.threads"
        else f"{choice.reason}; trainer.threads sets it"
    )
    line = f"threads: {choice.threads} per process ({why})"
    hint = load_hint(choice, procs, cores)
    return f"{line}\n{hint}" if hint else line


def _val_metrics(trainer) -> str:
    metrics = {k: float(v) for k, v in trainer.callback_metrics.items() if k.startswith("val/")}
    return ", ".join(f"{k} {metrics[k]:.4f}" for k in sorted(metrics))


def _report(trainer, run) -> None:
    metrics = {k: float(v) for k, v in trainer.callback_metrics.items() if k.startswith("val/")}
    for key in sorted(metrics):
        print(f"{key} {metrics[key]:.4f}")
    print(f"run folder: {run.dir}")
    saved = sorted(run.checkpoints.glob("*.ckpt")) if run.checkpoints.is_dir() else []
    print(f"checkpoints: {run.checkpoints}" if saved else "checkpoints: none written")
    url, sync = wandb_run_url(trainer.loggers), wandb_sync_command(run.dir, run.wandb_id)
    if url:
        print(f"W&B run: {url}")
    if sync:
        print(f"W&B (offline), upload every segment of the run with: {sync}")
