"""Classification objective: cross-entropy on a head's logits; loss, accuracy and balanced accuracy (mean
per-class recall) on validation.

Batch keys: ``image`` (or ``text`` with ``text_valid``, ``audio`` with ``audio_valid``) and ``label``
``(B,)`` long. After each validation an image or audio classifier shows a grid of held-out inputs
(spectrograms for audio) titled with their true and predicted classes, the misclassified ones first
(``predictions/<task>``, also a PNG in the run folder); an audio classifier also shows held-out
clips with their true and predicted classes and the prediction's probability (a table ``audio/<task>``
of playable clips).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torchmetrics import MeanMetric
from torchmetrics.classification import MulticlassAccuracy

from ..data.audio import collate_audio
from ..models.model import MultimodalModel
from ..training.media import (
    Audio,
    Media,
    MediaContext,
    Table,
    chunked_forward,
    classification_picture,
    spread,
)
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
    media_pool = 64  # held-out inputs classified for the picture, which shows the errors among them first
    media_shown = 16  # cells of the picture

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
        """Image and audio classifiers, with the validation weights: a grid (``predictions``) of
        ``media_shown`` of ``media_pool`` held-out inputs evenly spread over the set (``media.spread``),
        misclassified ones first, titled ``true → predicted probability``; audio classifiers also a
        table (``audio``) of the first
        ``media_clips`` clips, each with its true class, the predicted one and that prediction's
        probability (rounded to 3 decimals). Text classifiers show nothing."""
        if self.input_key not in ("image", "audio"):
            return []
        val = ctx.val
        classes = getattr(val, "classes", None) or [str(i) for i in range(self.num_classes)]
        items = [val[i] for i in spread(len(val), self.media_pool)]
        items = [it for it in items if not it.get("stand_in")]  # an unreadable input's replacement
        if not items:
            return []
        if self.input_key == "audio":
            batch = collate_audio(items)
        else:
            batch = {
                "image": torch.stack([it["image"] for it in items]),
                "label": torch.tensor([it["label"] for it in items]),
            }
        inputs, valid = batch[self.input_key], batch.get(f"{self.input_key}_valid")
        with ctx.validation_weights() as model:
            logits = chunked_forward(
                ctx, self._logits_of, model, inputs.to(ctx.device), _to(valid, ctx.device)
            )
        rate = getattr(ctx.model.tokenizers[self.tokenizer], "sample_rate", 16_000)
        records: list[Media] = [
            classification_picture(
                inputs, batch["label"], logits.cpu(), classes, self.media_shown, valid, rate
            )
        ]
        if self.input_key == "audio":
            prob, pred = logits[: self.media_clips].float().softmax(-1).max(-1)
            rows = [
                [Audio(it["audio"], rate), classes[it["label"]], classes[int(p)], round(float(q), 3)]
                for it, p, q in zip(items, pred, prob)
            ]
            records.insert(0, Table("audio", ["audio", "label", "prediction", "probability"], rows))
        return records

    def _logits_of(self, model: MultimodalModel, inputs: Tensor, valid: Tensor | None) -> Tensor:
        return self.logits(
            model,
            {self.input_key: inputs, **({f"{self.input_key}_valid": valid} if valid is not None else {})},
        )


def _to(x: Tensor | None, device) -> Tensor | None:
    return x.to(device) if x is not None else None
