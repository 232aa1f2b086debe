"""A freezing schedule for fine-tuning: the pretrained parts first train frozen (the new head learns on
fixed features, a linear probe), then everything trains — the two-stage recipe of LP-FT (Kumar et al.
2022, arXiv:2202.10054), which keeps a random head from distorting the pretrained features."""

from __future__ import annotations

import logging

import lightning as L
from torch import nn

log = logging.getLogger("mmformer")


class FreezePretrained(L.Callback):
    """Freeze ``modules(pl_module)`` for the first ``epochs`` epochs, then unfreeze them.

    The optimizer is built with every parameter (they are frozen only when training starts), so
    unfreezing needs no new parameter group and the LR schedule runs unchanged; a frozen parameter has
    no gradient, which AdamW skips (no update, no weight decay). Parameters that were frozen already
    (LoRA, ``freeze_layers``) stay frozen. A run resumed inside the frozen stage freezes again.
    Under DDP, use ``trainer.strategy: ddp_find_unused_parameters_true`` (the builder insists).
    """

    def __init__(self, epochs: int, modules):
        self.epochs, self.modules = epochs, modules
        self._frozen: list[nn.Parameter] = []

    def on_train_start(self, trainer, pl_module) -> None:
        if trainer.current_epoch < self.epochs:
            self._frozen = [p for m in self.modules(pl_module) for p in m.parameters() if p.requires_grad]
            for p in self._frozen:
                p.requires_grad_(False)
            log.info("pretrained parts frozen until epoch %d (%d tensors)", self.epochs, len(self._frozen))

    def on_train_epoch_start(self, trainer, pl_module) -> None:
        if self._frozen and trainer.current_epoch >= self.epochs:
            for p in self._frozen:
                p.requires_grad_(True)
            log.info("epoch %d: pretrained parts unfrozen", trainer.current_epoch)
            self._frozen = []

    @property
    def frozen(self) -> bool:
        return bool(self._frozen)
