"""The LightningModule every recipe trains: the composed model plus one objective per task.

Each step receives ``{task_name: batch}`` (every task, or one sampled task: ``multitask.schedule``);
the training loss is the weighted sum of the losses of the tasks present. Logged: ``train/<task>/loss``,
``train/modality/<modality>/loss`` (the mean loss of the present tasks that read that modality, when
the recipe has several tasks), ``train/loss``, ``lr``, ``train/grad_norm``, ``train/nonfinite_steps``
(updates skipped because a loss or gradient was NaN / inf on some rank — all ranks skip together),
``val/<task>/<metric>`` (torchmetrics objects, synchronised across ranks at epoch end, and a task's
``epoch_metrics()`` computed over the whole validation set). Tasks satisfy the ``Task`` protocol
(``tasks.base``), whose hooks this module calls. A task's own parameters (a contrastive temperature)
train in an extra optimizer group without weight decay.
Checkpoints carry the resolved recipe as plain YAML text and the RNG states, so they load with
``torch.load(weights_only=True)`` and resumed runs continue the same random streams.
"""

from __future__ import annotations

import random

import lightning as L
import numpy as np
import torch
from lightning.pytorch.accelerators import CPUAccelerator
from lightning.pytorch.plugins.precision import MixedPrecision, Precision
from lightning.pytorch.utilities import rank_zero_warn
from torch import nn

from ..data.windows import WINDOW
from ..models import parallelize
from ..models.backbone import Backbone
from ..models.model import MultimodalModel
from ..nn.onednn import faster_here, use_onednn
from ..training.checkpoint_io import resume_hint
from ..training.optim import build_optimizer, build_scheduler
from ..training.steps import forget_step_values
from .base import Task


def _on_every_rank(flag: bool) -> bool:
    """``flag`` if it holds on every rank of the default process group (a MIN all-reduce; the flag
    itself without one)."""
    dist = torch.distributed
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return flag
    t = torch.tensor([int(flag)])  # CPU accelerators only: gloo
    dist.all_reduce(t, op=dist.ReduceOp.MIN)
    return bool(t.item())


def _rng_state() -> dict:
    np_state = np.random.get_state()
    return {
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [],
        "numpy": [np_state[0], torch.from_numpy(np_state[1].copy()), *np_state[2:]],
        "python": random.getstate(),
    }


def _seed_all(seed: int) -> None:
    seed %= 2**32
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def _set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    if state.get("cuda") and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
    kind, keys, *rest = state["numpy"]
    np.random.set_state((kind, keys.numpy(), *rest))
    random.setstate(state["python"])


def all_finite(params: list[torch.Tensor], reduce=None) -> bool:
    """True when every ``param.grad`` is finite on every rank. ``reduce(tensor, reduce_op="sum")`` sums
    over ranks (the strategy's ``reduce``; None on one process): one scalar all-reduce, so all ranks
    decide together even when their gradients differ (sharded, or not yet averaged)."""
    bad = torch.zeros((), device=params[0].device if params else "cpu")
    for p in params:
        grad = p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad  # an FSDP2 shard
        bad = bad + (~torch.isfinite(grad)).any().to(bad.dtype)
    if reduce is not None:
        bad = reduce(bad, reduce_op="sum")
    return bool(bad == 0)


def total_grad_norm(params: list[torch.Tensor]) -> torch.Tensor:
    """The 2-norm of all ``param.grad`` together (before clipping); FSDP2 shards are reduced over
    ranks, so every rank logs the full model's norm."""
    return _local_norm(_grad_norm(params))


def _grad_norm(params: list[torch.Tensor]) -> torch.Tensor:
    """``torch.nn.utils.get_total_norm`` of the gradients (what ``clip_grad_norm_`` computes first; a
    DTensor for FSDP2 shards)."""
    grads = [p.grad for p in params]
    return torch.nn.utils.get_total_norm(grads, 2.0) if grads else torch.zeros(())


def _local_norm(norm: torch.Tensor) -> torch.Tensor:
    return norm.full_tensor() if hasattr(norm, "full_tensor") else norm


def checked_grad_norm(params: list[torch.Tensor], reduce=None) -> tuple[torch.Tensor, bool]:
    """``(norm, finite)``: the gradients' total 2-norm (as ``get_total_norm`` gives it: a DTensor for
    FSDP2 shards) and whether every gradient is finite on every rank. A NaN or ±inf entry makes the norm
    NaN or inf, so the one pass that clipping and the logged norm need answers the check too, where a
    check per tensor cost 4 operations per parameter every step. Only a non-finite norm (a non-finite
    entry, or finite entries whose squares overflow) falls back to ``all_finite``, which tells the two
    apart. ``reduce`` as in ``all_finite``: all ranks decide together."""
    norm = _grad_norm(params)
    bad = (~torch.isfinite(_local_norm(norm))).to(torch.float32)
    if reduce is not None:
        bad = reduce(bad, reduce_op="sum")
    if bool(bad == 0):
        return norm, True
    return norm, all_finite(params, reduce)


def _shapes(batch: dict) -> str:
    """``key (shape) dtype`` of a batch's tensors, for error messages."""
    return ", ".join(
        f"{k} {tuple(v.shape)} {str(v.dtype).removeprefix('torch.')}"
        for k, v in batch.items()
        if isinstance(v, torch.Tensor)
    )


class MultiTaskModule(L.LightningModule):
    """Args:
    model: the composed ``MultimodalModel``.
    tasks: task name → objective module (a ``Task``: ``training_loss``, ``validation_update``,
        ``val_metrics``, …).
    weights: task name → loss weight.
    optim: ``OptimConfig``.
    recipe_yaml: the resolved recipe, stored in every checkpoint.
    seed: the recipe's seed; each rank's random stream (dropout, augmentation in the main
        process) is seeded from it and the rank, so ranks do not draw identical masks and crops.
    compile_blocks, checkpoint_blocks: ``torch.compile`` / activation checkpointing per block
        (``trainer.compile``, ``trainer.activation_checkpointing``), applied in ``configure_model``.
    onednn_linears: the model's CPU float32 linears on oneDNN (``trainer.onednn_linears``;
        ``nn.onednn.use_onednn``), applied in ``configure_model`` before the other two; None: where
        ``nn.onednn.faster_here()`` measures oneDNN faster on this CPU — on every rank, under DDP / FSDP2 —
        (never on another accelerator).
    task_modalities: task → the modality of its input tokenizer (per-modality losses).
    tokenizer_files: text tokenizer name → its JSON, stored in every checkpoint (it stands alone).
    pretrained_configs: pretrained source → its family and config, stored in every checkpoint.

    Raises ``TypeError`` for a task that does not satisfy ``Task``.
    """

    def __init__(
        self,
        model: MultimodalModel,
        tasks: dict[str, nn.Module],
        weights: dict[str, float],
        optim,
        recipe_yaml: str = "",
        seed: int = 0,
        *,
        compile_blocks: bool = False,
        checkpoint_blocks: bool = False,
        onednn_linears: bool | None = False,
        task_modalities: dict[str, str] | None = None,
        tokenizer_files: dict[str, str] | None = None,
        pretrained_configs: dict[str, dict] | None = None,
    ):
        super().__init__()
        for name, task in tasks.items():
            if not isinstance(task, Task):
                raise TypeError(
                    f"task {name!r} ({type(task).__name__}) does not satisfy mmformer.tasks.base.Task; "
                    "derive it from TaskBase"
                )
        self.model = model
        self.tasks = nn.ModuleDict(tasks)
        self.weights, self.optim_cfg, self.recipe_yaml, self.seed = dict(weights), optim, recipe_yaml, seed
        self.compile_blocks, self.checkpoint_blocks = compile_blocks, checkpoint_blocks
        self.onednn_linears = onednn_linears
        self.task_modalities = dict(task_modalities or {})
        self.tokenizer_files = dict(tokenizer_files or {})
        self.pretrained_configs = dict(pretrained_configs or {})
        self.last_tasks: list[str] = []  # the tasks of the current training step (for messages)
        self.nonfinite_steps = 0  # updates skipped so far (this process's run)
        self.nonfinite_in_a_row = 0
        self._configured = False
        self._forgot_at = -1  # the global step whose first micro-batch dropped the previous step's values
        self._window_loss: dict[str, list] = {}  # task → [Σ loss·units, units, micro-batches] this window
        self._window_steps = 0  # micro-batches of this rank's window so far
        self._window_totals: list[list[float]] = []  # per task: micro-batches, units, over all ranks
        self._step_norm = None  # (params, gradient norm) of this optimizer step, for its clipping

    def routes_onednn(self) -> bool:
        """Whether ``configure_model`` routes the linears through oneDNN: ``onednn_linears``, or for None
        whether oneDNN measures faster here (on a CPU accelerator, or with no trainer attached). Under
        ``torch.distributed`` every rank measures and all take oneDNN only if all found it faster (a
        collective: call it on every rank), so ranks never multiply with different libraries."""
        if self.onednn_linears is not None:
            return self.onednn_linears
        on_cpu = self._trainer is None or isinstance(self.trainer.accelerator, CPUAccelerator)
        return on_cpu and _on_every_rank(faster_here())

    def configure_model(self) -> None:
        """oneDNN linears on the CPU (``nn.onednn``), then activation checkpointing, ``torch.compile`` and
        FSDP2 sharding, per block, in that order (``models.parallelize``; keys stay clean). Under
        ``trainer.strategy: fsdp2`` the whole module is the root unit, so the tasks' own parameters (a
        contrastive temperature) are sharded and averaged too. Runs once, whatever the number of ``fit`` /
        ``validate`` calls."""
        if self._configured:
            return
        self._configured = True
        if self.routes_onednn():  # a linear on another device, or under compile / autocast, runs F.linear
            use_onednn(self.model)
        if self.checkpoint_blocks:
            parallelize.checkpoint_blocks(self.model)
        if self.compile_blocks:
            parallelize.compile_blocks(self.model)
        mesh = self.device_mesh
        if mesh is not None:
            parallelize.shard_model(self.model, mesh["data_parallel"], root=self)
            for task in self.tasks.values():  # decoding tasks run the same number of forwards on every rank
                task.lockstep = True

    def setup(self, stage: str) -> None:
        if stage == "fit":  # after the model's (identical) initialisation, before any checkpoint restore
            _seed_all(self.seed + 1_000_003 * self.global_rank)

    # ------------------------------------------------------------------ steps
    def forward(self, fn, *args, **kwargs):
        """``fn(*args, **kwargs)``, run as this module's forward. Every step goes through here, so under
        FSDP2 (this module is the root unit) the parameters outside the blocks — tokenizers, heads, the
        tasks' own — are gathered around the step and their gradients reduced after backward, whatever
        the task calls (``model.encode``, a tokenizer, a head). Elsewhere a plain call."""
        return fn(*args, **kwargs)

    def training_step(self, batch: dict[str, dict], batch_idx: int) -> torch.Tensor:
        window = batch.pop(WINDOW, None)  # this step's accumulation-window totals (data.windows)
        scale = self._window_scale(window)
        self.last_tasks = [n for n, b in batch.items() if b is not None]
        losses = self(self._training_losses, batch)
        total = 0.0
        for name, loss in losses.items():
            units = window["units"][name] if window is not None else self.loss_units(name, batch[name])
            total = total + self.weights[name] * loss * scale(name, units)
            acc = self._window_loss.setdefault(name, [0.0, 0, 0])  # Σ loss·units, units, micro-batches
            acc[0], acc[1], acc[2] = acc[0] + loss.detach() * units, acc[1] + units, acc[2] + 1
        self._window_steps += 1
        if window is None or window["index"] == window["size"] - 1:
            self._log_window_losses()
        return total

    def _training_losses(self, batch: dict[str, dict]) -> dict[str, torch.Tensor]:
        losses = {}
        for name, task_batch in batch.items():
            if task_batch is None:
                continue
            try:
                losses[name] = self.tasks[name].training_loss(self.model, task_batch)
            except torch.OutOfMemoryError as e:
                raise torch.OutOfMemoryError(
                    f"out of memory in task {name!r}'s training step, batch {_shapes(task_batch)}: lower "
                    f"tasks.{name}.data.batch_size (and raise trainer.accumulate_grad_batches to keep the "
                    "global batch), use trainer.precision=bf16-mixed, or shorten the sequences"
                ) from e
        return losses

    # ------------------------------------------------------------------ accumulation windows
    def loss_units(self, task: str, batch: dict) -> int:
        """How many terms task ``task``'s training loss averages in ``batch``: the task's
        ``loss_units(batch)`` (target tokens of a language model; by default its ``batch_size``)."""
        return int(self.tasks[task].loss_units(batch))

    def _window_scale(self, window: dict | None):
        """``scale(task, units)`` for the loss of a micro-batch holding ``units`` of ``task``, so that the
        accumulated update (Lightning divides every micro-batch by ``K = accumulate_grad_batches``, DDP
        and FSDP average over ranks) is the gradient of ``Σ_task weight · (k / j) · Σ loss·units / N``:
        ``N`` the task's units and ``k`` its micro-batches in the window over all ranks (k per rank on
        average), ``j`` the window's micro-batches — the token-weighted mean of the whole window, and with
        ``(k / j)`` the share of the window a sampled task trained. ``scale = K · k · units / (j · N)``:
        1 when every micro-batch holds the same number of units."""
        if window is None:  # steps from elsewhere (a user's own loader): plain means
            return lambda name, units: 1.0
        names = list(self.tasks)
        if window["index"] == 0:
            self._window_loss, self._window_steps = {}, 0
            t = torch.zeros(len(names), 2, dtype=torch.float64, device=self.device)
            for name, (k, n) in window["tasks"].items():
                t[names.index(name)] = torch.tensor([k, n], dtype=torch.float64)
            if self.trainer.world_size > 1:  # one small all-reduce per window
                t = self.trainer.strategy.reduce(t, reduce_op="sum")
            self._window_totals = t.tolist()  # one host synchronisation per window
        totals, K, j = self._window_totals, self.trainer.accumulate_grad_batches, window["size"]

        def scale(name: str, units: int) -> float:
            k, n = totals[names.index(name)]
            return K * k * units / (j * max(n, 1.0))

        return scale

    def _log_window_losses(self) -> None:
        """``train/<task>/loss``: this rank's token-weighted mean over the window (the same whatever the
        accumulation splits it into); ``train/loss`` their weighted sum as trained; per modality the mean of
        its tasks' losses."""
        total, by_modality = 0.0, {}
        for name, (summed, units, k) in self._window_loss.items():
            loss = summed / max(units, 1)
            total = total + self.weights[name] * loss * k / self._window_steps
            self.log(f"train/{name}/loss", loss)
            by_modality.setdefault(self.task_modalities.get(name, "?"), []).append(loss)
        if len(self.tasks) > 1:
            for modality, losses in by_modality.items():
                self.log(f"train/modality/{modality}/loss", torch.stack(losses).mean())
        self.log("train/loss", total, prog_bar=True)
        self.log("lr", max(g["lr"] for g in self.optimizers().param_groups), prog_bar=True)
        self._window_loss, self._window_steps = {}, 0

    def validation_step(self, batch: dict[str, dict], batch_idx: int) -> None:
        for name, task_batch in batch.items():
            if task_batch is None:
                continue
            task = self.tasks[name]
            if task.batch_size(task_batch) == 0 and self.device_mesh is None:
                continue  # every sample of this batch was unreadable (left out of every metric); under
                # FSDP2 each rank still runs the forward its peers' all-gathers wait for
            self(task.validation_update, self.model, task_batch)
            for metric_name, metric in task.val_metrics.items():
                self.log(
                    f"val/{name}/{metric_name}",
                    metric,
                    on_step=False,
                    on_epoch=True,
                    prog_bar=metric_name != "loss",
                    batch_size=task.batch_size(task_batch),
                )

    def on_validation_epoch_start(self) -> None:
        # e.g. a diffusion task re-seeds its validation noise, a contrastive one embeds its zero-shot
        # classes (with the EMA weights when kept: callbacks swap them in before this hook)
        for task in self.tasks.values():
            self(task.on_validation_epoch_start, self.model)

    def on_train_epoch_start(self) -> None:
        # A tower or tokenizer frozen whole (a locked pretrained text encoder) runs in eval mode: its
        # dropout would only add noise to features it never learns from. FreezePretrained (a callback,
        # run before this hook) decides what is frozen this epoch.
        for part in [*self.model.towers.values(), *self.model.tokenizers.values()]:
            params = list(part.parameters())
            if params:
                part.train(any(p.requires_grad for p in params))

    def on_train_batch_start(self, batch, batch_idx: int) -> None:
        if self.trainer.global_step != self._forgot_at:  # the first micro-batch of an optimizer step
            forget_step_values(self.trainer)  # a row carries only what its own step logged
            self._forgot_at = self.trainer.global_step
        # a validation that generated text left the backbones' weights in the decode layout (rank 0 only,
        # for the text samples): restore it on every rank before DDP's forward sees the weights
        for m in self.model.modules():
            if isinstance(m, Backbone):
                m.restore_layout()

    def on_train_batch_end(self, outputs, batch, batch_idx: int) -> None:
        for task in self.tasks.values():  # e.g. clip a learned temperature after the update
            task.after_optimizer_step()

    def on_validation_epoch_end(self) -> None:
        # whole-set metrics (retrieval over every held-out pair), already gathered from every rank
        for name, task in self.tasks.items():
            for metric, value in task.epoch_metrics().items():
                # every rank holds the same value; sync_dist averages identical numbers (no warning)
                self.log(
                    f"val/{name}/{metric}", value, prog_bar=metric == task.main_metric[0], sync_dist=True
                )

    def on_before_optimizer_step(self, optimizer) -> None:
        # After backward (and DDP's gradient all-reduce), before clipping and the update.
        params = [p for g in optimizer.param_groups for p in g["params"] if p.grad is not None]
        self._step_norm = None
        # only on the steps whose row Lightning writes (every log_every_n_steps, and when the run stops)
        logged = self.trainer._logger_connector.should_update_logs
        if getattr(self.trainer.precision_plugin, "scaler", None) is not None:
            # 16-mixed: GradScaler skips overflowing steps itself and lowers the scale
            if logged:
                self.log("train/grad_norm", total_grad_norm(params))
            return
        reduce = self.trainer.strategy.reduce if self.trainer.world_size > 1 else None
        norm, finite = checked_grad_norm(params, reduce)
        if not finite:
            self._skip_update(params)
            return
        self.nonfinite_in_a_row = 0
        self._step_norm = (params, norm)  # the clipping that follows needs the same norm
        if logged:
            self.log("train/grad_norm", _local_norm(norm))

    def configure_gradient_clipping(self, optimizer, gradient_clip_val=None, gradient_clip_algorithm=None):
        """Clipping by norm reuses the norm ``on_before_optimizer_step`` just computed (the same
        ``clip_grads_with_norm_`` that ``clip_grad_norm_`` ends with: the same gradients, one pass over
        them fewer) under the default and mixed precision plugins; other cases (clipping by value, a
        value <= 0, a scaler, FSDP1's and DeepSpeed's plugins) are Lightning's."""
        known, self._step_norm = self._step_norm, None
        plugin = type(self.trainer.precision_plugin)
        if (
            known is not None
            and gradient_clip_val is not None
            and gradient_clip_val > 0
            and gradient_clip_algorithm in (None, "norm")
            # precision plugins with their own clipping (FSDP1 refuses it, DeepSpeed clips itself) keep it
            and plugin.clip_grad_by_norm is Precision.clip_grad_by_norm
            and plugin.clip_gradients in (Precision.clip_gradients, MixedPrecision.clip_gradients)
        ):
            params, norm = known
            torch.nn.utils.clip_grads_with_norm_(params, gradient_clip_val, norm)
            return
        super().configure_gradient_clipping(optimizer, gradient_clip_val, gradient_clip_algorithm)

    # ------------------------------------------------------------------ non-finite steps
    def _skip_update(self, params: list[torch.Tensor]) -> None:
        """A NaN / inf loss or gradient: drop every gradient, so AdamW leaves the weights and its moments
        untouched this step (the LR schedule still advances); stop after ``optim.max_nonfinite_steps`` in a
        row."""
        for p in params:
            p.grad = None
        self.nonfinite_steps += 1
        self.nonfinite_in_a_row += 1
        step, tasks = self.trainer.global_step, ", ".join(self.last_tasks)
        self.log("train/nonfinite_steps", float(self.nonfinite_steps))
        limit = self.optim_cfg.max_nonfinite_steps
        if self.nonfinite_in_a_row >= limit:
            raise FloatingPointError(
                f"the loss or its gradients were NaN / inf for {limit} steps in a row (last: step {step}, "
                f"tasks {tasks}); the run stops. Lower optim.lr, check the data of those tasks, use "
                "trainer.precision=32-true, or raise optim.max_nonfinite_steps. " + resume_hint(self.trainer)
            )
        rank_zero_warn(
            f"step {step}: the loss or its gradients are NaN / inf (tasks {tasks}); the update is skipped "
            f"on every rank ({self.nonfinite_in_a_row} in a row, {self.nonfinite_steps} so far)"
        )

    # ------------------------------------------------------------------ optimisation
    def configure_optimizers(self):
        optimizer = build_optimizer(self.model, self.optim_cfg)
        extra = [p for p in self.tasks.parameters() if p.requires_grad]  # e.g. a learned temperature
        if extra:
            optimizer.add_param_group(
                {
                    "params": extra,
                    "weight_decay": 0.0,
                    "name": "task",
                    "lr_scale": 1.0,
                    "lr": self.optim_cfg.lr,
                }
            )
        if getattr(getattr(self.trainer, "precision_plugin", None), "scaler", None) is None:
            # A fused optimizer says it unscales gradients itself (for a GradScaler), so Lightning's mixed
            # precision refuses to clip its gradients; without a scaler (bf16, fp32) nothing is scaled.
            optimizer._step_supports_amp_scaling = False
        total = self.trainer.estimated_stepping_batches
        if total == float("inf"):
            raise ValueError("the run has no finite length: set trainer.max_epochs or trainer.max_steps")
        scheduler = build_scheduler(optimizer, self.optim_cfg, int(total))
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}

    # ------------------------------------------------------------------ checkpoints
    def on_save_checkpoint(self, checkpoint: dict) -> None:
        checkpoint["mmformer"] = {
            "recipe_yaml": self.recipe_yaml,
            "rng": _rng_state(),
            "tokenizers": dict(self.tokenizer_files),
            "pretrained": dict(self.pretrained_configs),
        }

    def on_load_checkpoint(self, checkpoint: dict) -> None:
        dm = self.trainer.datamodule if self._trainer is not None else None
        legacy = checkpoint.get("loops", {}).get("fit_loop", {}).get("state_dict", {}).get("combined_loader")
        if dm is not None and type(dm).__qualname__ not in checkpoint and legacy:
            # written before the datamodule carried the loader's position: Lightning's own copy of it
            dm.load_state_dict({"train": legacy[0]})
        state = checkpoint.get("mmformer", {})
        if "rng" in state:
            _set_rng_state(state["rng"])  # rank 0's streams, which the checkpoint holds
        if self.global_rank > 0:  # other ranks: a distinct stream, reproducible from seed, rank and step
            _seed_all(self.seed + 1_000_003 * self.global_rank + checkpoint.get("global_step", 0))
