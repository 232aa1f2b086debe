"""Classification objective: cross-entropy on a head's logits; loss, accuracy and balanced accuracy (mean
per-class recall) on validation.

Batch keys: ``image`` (or ``text`` with ``text_valid``) and ``label`` ``(B,)`` long.
"""

from __future__ import annotations

import torch.nn.functional as F
from torch import Tensor, nn
from torchmetrics import MeanMetric
from torchmetrics.classification import MulticlassAccuracy

from ..models.model import MultimodalModel


class ClassificationTask(nn.Module):
    """Args:
    tokenizer: the ``model.tokenizers`` entry that reads this task's inputs.
    head: the ``model.heads`` entry that produces logits.
    num_classes: number of classes ``K``.
    input_key: the batch key holding the inputs (``image`` or ``text``; ``<key>_valid``, when the batch
        has it, is passed on as the padding mask).
    label_smoothing: cross-entropy label smoothing (training loss only).
    """

    main_metric = ("acc", "max")  # what the best checkpoint monitors by default

    def __init__(
        self,
        tokenizer: str,
        head: str,
        num_classes: int,
        input_key: str = "image",
        label_smoothing: float = 0.0,
    ):
        super().__init__()
        self.tokenizer, self.head, self.input_key = tokenizer, head, input_key
        self.num_classes = num_classes
        self.label_smoothing = label_smoothing
        # Metric states are summed over ranks at compute(): every validation sample counts once.
        self.val_metrics = nn.ModuleDict(
            {
                "loss": MeanMetric(),
                "acc": MulticlassAccuracy(num_classes=num_classes, average="micro"),
                # mean per-class recall: what accuracy hides on imbalanced sets (classes absent from
                # validation and never predicted are left out of the mean)
                "balanced_acc": MulticlassAccuracy(num_classes=num_classes, average="macro"),
            }
        )

    def batch_size(self, batch: dict) -> int:
        return batch["label"].shape[0]

    def logits(self, model: MultimodalModel, batch: dict) -> Tensor:
        valid = batch.get(f"{self.input_key}_valid")  # text batches carry their padding mask
        kwargs = {"valid": valid} if valid is not None else {}
        return model(batch[self.input_key], self.tokenizer, self.head, **kwargs)  # (B, K)

    def training_loss(self, model: MultimodalModel, batch: dict) -> Tensor:
        return F.cross_entropy(
            self.logits(model, batch).float(), batch["label"], label_smoothing=self.label_smoothing
        )

    def validation_update(self, model: MultimodalModel, batch: dict) -> None:
        logits = self.logits(model, batch)
        loss = F.cross_entropy(logits.float(), batch["label"], reduction="none")
        self.val_metrics["loss"].update(loss)
        self.val_metrics["acc"].update(logits, batch["label"])
        self.val_metrics["balanced_acc"].update(logits, batch["label"])
