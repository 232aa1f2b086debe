"""Causal language modelling: next-token cross-entropy, with padding and document boundaries ignored.

Batch keys: ``text`` (B, N) long, ``text_valid`` (B, N) bool, optional ``text_document`` (B, N) long.
Position ``t`` predicts token ``t + 1``; the target is ignored where it is padding or where it
belongs to another packed document (never learn to predict across an ``eos`` into unrelated text).
Validation: token-weighted mean loss and perplexity = exp(that mean), from the same cross-entropy
(finite whenever the loss is; no second ``(B, N, V)`` probability tensor).
"""

from __future__ import annotations

import torch.nn.functional as F
from torch import Tensor, nn
from torchmetrics import MeanMetric

from ..models.model import MultimodalModel

IGNORE = -100


def next_token_targets(batch: dict) -> Tensor:
    """``(B, N - 1)`` targets for positions ``0 … N-2``, ``IGNORE`` where no real same-document token follows."""
    ids, valid = batch["text"], batch["text_valid"]
    keep = valid[:, 1:] & valid[:, :-1]
    if "text_document" in batch:
        doc = batch["text_document"]
        keep = keep & (doc[:, 1:] == doc[:, :-1])
    return ids[:, 1:].masked_fill(~keep, IGNORE)


class Perplexity(MeanMetric):
    """``exp`` of the mean of the per-token cross-entropies it is updated with."""

    def compute(self):
        return super().compute().exp()


class CausalLMTask(nn.Module):
    """Args: ``tokenizer`` (a text embedding entry of ``model.tokenizers``), ``head`` (an LM head)."""

    main_metric = ("ppl", "min")

    def __init__(self, tokenizer: str, head: str):
        super().__init__()
        self.tokenizer, self.head = tokenizer, head
        self.val_metrics = nn.ModuleDict({"loss": MeanMetric(), "ppl": Perplexity()})

    def batch_size(self, batch: dict) -> int:
        return batch["text"].shape[0]

    def loss_units(self, batch: dict) -> int:
        """Target tokens in ``batch`` (what the training loss averages over)."""
        return int((next_token_targets(batch) != IGNORE).sum())

    def logits(self, model: MultimodalModel, batch: dict) -> Tensor:
        return model(
            batch["text"],
            self.tokenizer,
            self.head,
            valid=batch["text_valid"],
            document=batch.get("text_document"),
        )  # (B, N, V)

    def training_loss(self, model: MultimodalModel, batch: dict) -> Tensor:
        logits = self.logits(model, batch)[:, :-1]
        return F.cross_entropy(
            logits.float().flatten(0, 1), next_token_targets(batch).flatten(), ignore_index=IGNORE
        )

    def validation_update(self, model: MultimodalModel, batch: dict) -> None:
        logits = self.logits(model, batch)[:, :-1].float()
        targets = next_token_targets(batch)
        losses = F.cross_entropy(
            logits.flatten(0, 1), targets.flatten(), ignore_index=IGNORE, reduction="none"
        )
        counted = targets.flatten() != IGNORE
        self.val_metrics["loss"].update(losses[counted])  # token-weighted over the whole validation set
        self.val_metrics["ppl"].update(losses[counted])
