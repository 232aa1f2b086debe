"""Classification objective: cross-entropy on a head's logits; loss, accuracy and balanced accuracy (mean
per-class recall) on validation.

Batch keys: ``image`` (or ``text`` with ``text_valid``, ``audio`` with ``audio_valid``) and ``label``
``(B,)`` long. An audio classifier shows, after each validation, its first held-out clips with their
true and predicted classes and the prediction's probability (a table ``audio/<task>`` of playable clips).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torchmetrics import MeanMetric
from torchmetrics.classification import MulticlassAccuracy

from ..data.audio import collate_audio
from ..models.model import MultimodalModel
from ..training.media import Audio, Media, MediaContext, Table
from .base import TaskBase


class ClassificationTask(TaskBase):
    """Args:
    tokenizer: the ``model.tokenizers`` entry that reads this task's inputs.
    head: the ``model.heads`` entry that produces logits.
    num_classes: number of classes ``K``.
    input_key: the batch key holding the inputs (``image`` or ``text``; ``<key>_valid``, when the batch
        has it, is passed on as the padding mask).
    label_smoothing: cross-entropy label smoothing (training loss only).
    """

    main_metric = ("acc", "max")  # what the best checkpoint monitors by default
    media_clips = 8  # held-out clips an audio classifier shows after each validation

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
        logits = self.logits(model, batch)  # also for zero rows: a sharded model's ranks forward in step
        if logits.shape[0] == 0:  # every sample of the batch was unreadable: left out, counted as skipped
            return
        loss = F.cross_entropy(logits.float(), batch["label"], reduction="none")
        self.val_metrics["loss"].update(loss)
        self.val_metrics["acc"].update(logits, batch["label"])
        self.val_metrics["balanced_acc"].update(logits, batch["label"])

    def media(self, ctx: MediaContext) -> list[Media]:
        """Audio classifiers: the first ``media_clips`` held-out clips, each with its true class, the
        predicted one and that prediction's probability (rounded to 3 decimals)."""
        if self.input_key != "audio":
            return []
        val = ctx.val
        classes = getattr(val, "classes", None) or [str(i) for i in range(self.num_classes)]
        items = [val[i] for i in range(min(self.media_clips, len(val)))]
        items = [it for it in items if not it.get("stand_in")]  # an unreadable clip's replacement
        if not items:
            return []
        batch = {k: v.to(ctx.device) if torch.is_tensor(v) else v for k, v in collate_audio(items).items()}
        logits = ctx.forward(self.logits, ctx.model, batch)  # (n, K)
        prob, pred = logits.float().softmax(-1).max(-1)
        rate = getattr(ctx.model.tokenizers[self.tokenizer], "sample_rate", 16_000)
        rows = [
            [Audio(it["audio"], rate), classes[it["label"]], classes[int(p)], round(float(q), 3)]
            for it, p, q in zip(items, pred, prob)
        ]
        return [Table("audio", ["audio", "label", "prediction", "probability"], rows)]
