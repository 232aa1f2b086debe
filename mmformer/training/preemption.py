"""Stopping on SIGTERM or Ctrl-C at a point every rank agrees on, with one saved ``last.ckpt``.

A scheduler's preemption (SLURM, Kubernetes, ``docker stop``) sends SIGTERM to one process, several, or
all of them, possibly a step apart; a user presses Ctrl-C (SIGINT to every process of the terminal).
Lightning 2.6's own SIGTERM handler runs a ``dist.broadcast`` inside the signal handler, i.e. on one
rank, at whatever point that rank was interrupted: the other ranks are in a different collective (or
none) and every rank hangs. Here the handler only records the signal; the ranks agree at the next
point they all reach in the same order — the end of an optimizer step, or the end of a validation
during training — with one all-reduce, then every rank saves ``last.ckpt`` at that same point and
raises :class:`Preempted`, which the CLI turns into a message and exit status 128 + signal (143 for
SIGTERM, 130 for SIGINT), so schedulers and retry loops see a run that did not finish.

A second Ctrl-C stops at once (``KeyboardInterrupt``, no checkpoint). A signal that arrives during a
validation lets it finish and stops right after it, once its best / last checkpoints are written (after
the epoch's end hooks when it is the epoch-end validation). A stop agreed at the end of a step comes
before that step's validation, if one was due: the resumed run does not repeat it.
"""

from __future__ import annotations

import os
import signal
import threading

import lightning as L
import torch
from lightning.pytorch.callbacks import Checkpoint
from lightning.pytorch.loggers import WandbLogger

HANDLED = (signal.SIGTERM, signal.SIGINT)


class Preempted(Exception):
    """Training stopped on a signal after saving ``checkpoint`` (``None``: checkpointing is off) at
    ``step``; ``exit_code`` is the shell's 128 + signal number."""

    def __init__(self, signum: int, step: int, checkpoint: str | None):
        self.signum, self.step, self.checkpoint = signum, step, checkpoint
        super().__init__(f"{signal.Signals(signum).name} at step {step}")

    @property
    def exit_code(self) -> int:
        return 128 + self.signum


class StopOnSignal(Checkpoint):
    """Turns SIGTERM / SIGINT into a stop at the next agreed safe point, saving ``last.ckpt`` first.

    A :class:`~lightning.pytorch.callbacks.Checkpoint`, so Lightning runs its hooks after the other
    callbacks and the other checkpoint callbacks listed before it (the best and last checkpoints of a
    validation are written before it stops). ``last`` is the callback that keeps ``last.ckpt``
    (``None`` when the recipe turns it off: the run then stops without saving).
    """

    def __init__(self, last=None):
        self.last = last
        self.signum: int | None = None  # the first signal received, until the run stops
        self._previous: dict[int, object] = {}
        self._step_seen = -1
        self._fitting = False  # a fit stops at its next safe point; a validation alone runs to its end
        self._pending = (
            0  # agreed after an epoch-end validation: stop once the epoch's checkpoints are written
        )

    # -- the handler: record only, no collective and no I/O beyond one line on stderr -----------------
    def _on_signal(self, signum, frame) -> None:
        if self.signum is not None and signum == signal.SIGINT:
            raise KeyboardInterrupt  # the second Ctrl-C: stop now
        if self.signum is None:
            self.signum = signum
            name = signal.Signals(signum).name
            again = " (Ctrl-C again stops at once, without saving)" if signum == signal.SIGINT else ""
            what = "stopping at the next safe point" if self._fitting else "finishing this validation first"
            os.write(2, f"\nmmformer: {name} received: {what}{again}\n".encode())

    def _install(self, trainer) -> None:
        # Lightning registers its own SIGTERM handler when a fit / validate starts, before these hooks;
        # during a validation alone this one keeps Lightning's broadcast out of the handler too.
        self._fitting = trainer.state.fn == "fit"
        if threading.current_thread() is not threading.main_thread():
            return
        for s in HANDLED:
            if signal.getsignal(s) != self._on_signal:
                self._previous.setdefault(s, signal.getsignal(s))
                signal.signal(s, self._on_signal)

    def _restore(self) -> None:
        # Lightning's teardown may have put back what it found first: only a handler still ours is replaced
        if threading.current_thread() is threading.main_thread():
            for s, handler in self._previous.items():
                if signal.getsignal(s) == self._on_signal:
                    signal.signal(s, handler)
        self._previous = {}

    def on_sanity_check_start(self, trainer, pl_module) -> None:
        self._install(trainer)

    def on_train_start(self, trainer, pl_module) -> None:
        self._install(trainer)
        self._step_seen = trainer.global_step  # a resumed run's first batch may sit inside a window

    def on_validation_start(self, trainer, pl_module) -> None:
        self._install(trainer)

    def teardown(self, trainer, pl_module, stage: str) -> None:
        self._restore()

    def on_exception(self, trainer, pl_module, exception: BaseException) -> None:
        self._restore()

    # -- the safe points -----------------------------------------------------------------------------
    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if trainer.global_step == self._step_seen:
            return  # inside an accumulation window (or a skipped step): its gradients are not applied yet
        self._step_seen = trainer.global_step
        self._stop_if_agreed(trainer)

    def on_validation_end(self, trainer, pl_module) -> None:
        if trainer.sanity_checking or trainer.state.fn != "fit":
            return
        if trainer.is_last_batch:  # an epoch-end validation: its checkpoints are written at the epoch's end
            self._pending = self._agreed(trainer)
        else:
            self._stop_if_agreed(trainer)

    def on_train_epoch_end(self, trainer, pl_module) -> None:
        finished = (trainer.max_steps != -1 and trainer.global_step >= trainer.max_steps) or (
            trainer.max_epochs not in (None, -1) and trainer.current_epoch + 1 >= trainer.max_epochs
        )
        if self._pending and not finished:  # a run that ends here anyway ends as a finished run
            self._stop(trainer, self._pending)

    def _stop_if_agreed(self, trainer: L.Trainer) -> None:
        signum = self._agreed(trainer)
        if signum:
            self._stop(trainer, signum)

    def _agreed(self, trainer: L.Trainer) -> int:
        """The signal any rank received (0: none); a collective: every rank calls it at the same point."""
        signum = int(self.signum or 0)
        if trainer.world_size > 1:
            mine = torch.tensor(signum, dtype=torch.int32, device=trainer.strategy.root_device)
            signum = int(trainer.strategy.reduce(mine, reduce_op="max"))
        return signum

    def _stop(self, trainer: L.Trainer, signum: int) -> None:
        path = self.last.save_now(trainer) if self.last is not None else None
        for logger in trainer.loggers:  # W&B shows the run as preempted (resumable), not as finished
            if isinstance(logger, WandbLogger) and trainer.is_global_zero:
                logger.experiment.mark_preempting()
        raise Preempted(signum, trainer.global_step, path)
