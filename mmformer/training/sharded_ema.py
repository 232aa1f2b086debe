"""EMA of the weights under FSDP2 (``optim.ema_decay`` with ``trainer.strategy: fsdp2``).

Lightning's ``WeightAveraging`` (``callbacks.EMAWeights``) deep-copies the whole LightningModule before it
is sharded, so every rank would hold a full copy and update it from a model it only holds a shard of.
Here every rank keeps the average of *its own shard*: the shadow of a sharded parameter is a DTensor
with the same placement, updated locally after each optimizer step (no communication: the EMA of a
shard is the shard of the EMA). The behaviour is ``EMAWeights``'s, so runs read the same either way:

- decay warmed up as ``min(decay, (1 + n) / (10 + n))`` after ``n`` updates, the first update copying
  (``torch.optim.swa_utils.AveragedModel`` with our ``multi_avg_fn``); floating-point buffers averaged too;
- validation and the diffusion sample grids run with the average (swapped in around the validation
  epoch, and around the sampling), training continues from the raw weights;
- checkpoints: ``state_dict`` = the average, ``current_model_state`` = the raw weights,
  ``averaging_state = {"n_averaged": …}`` — the layout Lightning's ``WeightAveraging`` writes, so a
  checkpoint resumes under FSDP2, DDP or one device alike; both states are gathered whole
  (``get_model_state_dict(full_state_dict=True)``), a collective every rank joins;
- when training ends the model holds the average (as ``WeightAveraging``) and ``last.ckpt`` still
  resumes from the raw weights.

Sharded (DCP) checkpoints with an EMA are refused by the recipe check.
"""

from __future__ import annotations

from contextlib import contextmanager

import lightning as L
import torch
from torch import Tensor


def warmed_up_decay(decay: float, n_averaged: int) -> float:
    """The EMA decay after ``n_averaged`` updates: ``min(decay, (1 + n) / (10 + n))`` (diffusers'
    ``EMAModel``, timm's ``ModelEmaV3``), so short runs do not carry the initial weights."""
    n = float(n_averaged)
    return min(decay, (1 + n) / (10 + n))


def _local(t: Tensor) -> Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


class ShardedEMAWeights(L.Callback):
    """Args: ``decay`` in (0, 1), the EMA decay (``optim.ema_decay``)."""

    def __init__(self, decay: float):
        self.decay = decay
        self.n_averaged = 0
        self._latest_update_step = 0
        self._shadow: list[Tensor] | None = None  # one per averaged tensor, local shards
        self._raw: list[Tensor] | None = None  # after training: the raw weights' shards

    # ------------------------------------------------------------------ tensors
    @staticmethod
    def _tensors(pl_module) -> list[Tensor]:
        """Parameters, then floating-point buffers (as ``AveragedModel(use_buffers=True)``), with every
        FSDP unit resharded first (after an evaluation forward the root keeps its weights gathered)."""
        from torch.distributed.fsdp import FSDPModule

        for m in pl_module.modules():
            if isinstance(m, FSDPModule):
                m.reshard()
        return [p.data for p in pl_module.parameters()] + [
            b for b in pl_module.buffers() if b.is_floating_point()
        ]

    def _ensure(self, pl_module) -> list[Tensor]:
        if self._shadow is None:
            self._shadow = [_local(t).detach().clone() for t in self._tensors(pl_module)]
        return self._shadow

    def _swap(self, pl_module) -> None:
        for s, t in zip(self._ensure(pl_module), self._tensors(pl_module)):
            tmp = s.clone()
            s.copy_(_local(t))
            _local(t).copy_(tmp)

    @contextmanager
    def averaged(self, pl_module):
        """The average in the model for the duration (every rank must enter: it reshards), e.g. to sample
        from it after validation; nothing to do once training ended (the model holds it then)."""
        if self._raw is not None:
            yield
            return
        self._swap(pl_module)
        try:
            yield
        finally:
            self._swap(pl_module)

    # ------------------------------------------------------------------ training
    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if trainer.global_step <= self._latest_update_step:  # inside an accumulation window
            return
        shadow, current = self._ensure(pl_module), [_local(t) for t in self._tensors(pl_module)]
        with torch.no_grad():
            if self.n_averaged == 0:
                torch._foreach_copy_(shadow, current)
            else:
                torch._foreach_lerp_(shadow, current, 1 - warmed_up_decay(self.decay, self.n_averaged))
        self.n_averaged += 1
        self._latest_update_step = trainer.global_step

    def on_validation_epoch_start(self, trainer, pl_module) -> None:
        if trainer.state.fn == "fit" and self._raw is None:
            self._swap(pl_module)

    def on_validation_epoch_end(self, trainer, pl_module) -> None:
        if trainer.state.fn == "fit" and self._raw is None:
            self._swap(pl_module)

    def on_fit_start(self, trainer, pl_module) -> None:
        self._raw = None  # a new fit with this callback: training weights in the model again

    def on_train_end(self, trainer, pl_module) -> None:
        """The model takes the average; the raw shards are kept for the last checkpoint."""
        tensors = self._tensors(pl_module)
        self._raw = [_local(t).clone() for t in tensors]
        for s, t in zip(self._ensure(pl_module), tensors):
            _local(t).copy_(s)

    # ------------------------------------------------------------------ checkpoints
    def state_dict(self) -> dict:
        return {"latest_update_step": self._latest_update_step}

    def load_state_dict(self, state_dict: dict) -> None:
        self._latest_update_step = state_dict["latest_update_step"]

    def on_save_checkpoint(self, trainer, pl_module, checkpoint: dict) -> None:
        tensors = self._tensors(pl_module)
        if self._raw is not None:  # training ended: the model holds the average, ``_raw`` the weights
            current = [_local(t).clone() for t in tensors]
            for r, t in zip(self._raw, tensors):
                _local(t).copy_(r)
            checkpoint["current_model_state"] = _owned(trainer.strategy.lightning_module_state_dict())
            for c, t in zip(current, tensors):
                _local(t).copy_(c)
        else:
            checkpoint["current_model_state"] = _owned(checkpoint["state_dict"])
            self._swap(pl_module)
            checkpoint["state_dict"] = _owned(trainer.strategy.lightning_module_state_dict())
            self._swap(pl_module)
        checkpoint["averaging_state"] = {"n_averaged": torch.tensor(self.n_averaged, dtype=torch.long)}

    def on_load_checkpoint(self, trainer, pl_module, checkpoint: dict) -> None:
        """The strategy has loaded ``state_dict`` (the average) into the model: keep it as the shadow and
        load the raw weights from ``current_model_state``."""
        if "current_model_state" not in checkpoint or trainer.state.fn != "fit":
            return
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

        self._shadow = [_local(t).detach().clone() for t in self._tensors(pl_module)]
        set_model_state_dict(
            pl_module, checkpoint["current_model_state"], options=StateDictOptions(full_state_dict=True)
        )
        self.n_averaged = int(checkpoint.get("averaging_state", {}).get("n_averaged", 1))


def _owned(state: dict) -> dict:
    """``state`` with tensors that own their memory: with one process the full state dict holds views of
    the parameters themselves (no gather copies them), which the swap back to the raw weights would
    overwrite."""
    return {k: v.detach().clone() if isinstance(v, torch.Tensor) else v for k, v in state.items()}
