"""Masked language modelling (BERT, Devlin et al. 2019, §3.1 "Task #1: Masked LM").

Batch keys as the causal LM's: ``text`` (B, N) long, ``text_valid`` (B, N) bool, optional
``text_document``. Of the real, non-special tokens, each is chosen with probability ``mask_prob``
(0.15); a chosen token is replaced by ``[MASK]`` 80 % of the time, by a random token 10 % and left
as is 10 %; the loss is the cross-entropy on the chosen positions only (HF transformers'
``DataCollatorForLanguageModeling``, done here on the device). Validation draws its masks from a
generator reseeded every validation, so every evaluation scores the same masked positions: loss,
perplexity and masked-token accuracy.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torchmetrics import MeanMetric

from ..models.model import MultimodalModel
from .base import TaskBase
from .language_model import IGNORE, Perplexity


def mask_tokens(
    ids: Tensor,
    candidates: Tensor,
    mask_id: int,
    vocab_size: int,
    mask_prob: float = 0.15,
    generator: torch.Generator | None = None,
) -> tuple[Tensor, Tensor]:
    """BERT's 80/10/10 corruption.

    Args:
        ids: ``(B, N)`` long token ids; ``candidates``: ``(B, N)`` bool, the positions that may be chosen
            (real, non-special tokens).
        mask_id: the ``[MASK]`` id; random replacements are uniform over ``vocab_size``.

    Returns ``(inputs, targets)``: the corrupted ids, and the original id at chosen positions, ``IGNORE``
    (-100) elsewhere.
    """
    draw = lambda: torch.rand(ids.shape, generator=generator, device=ids.device)  # noqa: E731
    chosen = candidates & (draw() < mask_prob)
    targets = ids.masked_fill(~chosen, IGNORE)
    action = draw()
    inputs = ids.masked_fill(chosen & (action < 0.8), mask_id)
    randomize = chosen & (action >= 0.8) & (action < 0.9)
    random_ids = torch.randint(vocab_size, ids.shape, generator=generator, device=ids.device)
    return torch.where(randomize, random_ids, inputs), targets


class MaskedLMTask(TaskBase):
    """Args: ``tokenizer`` (a text entry of ``model.tokenizers``), ``head`` (an ``mlm`` or ``lm`` head over
    the vocabulary), ``mask_id``, ``vocab_size``, ``special_ids`` (never chosen: bos / eos / pad / mask),
    ``mask_prob``, ``seed`` (validation masks)."""

    main_metric = ("acc", "max")

    def __init__(
        self,
        tokenizer: str,
        head: str,
        mask_id: int,
        vocab_size: int,
        special_ids: list[int],
        mask_prob: float = 0.15,
        seed: int = 0,
    ):
        super().__init__()
        self.tokenizer, self.head, self.mask_id, self.vocab_size = tokenizer, head, mask_id, vocab_size
        self.mask_prob, self.seed = mask_prob, seed
        self.register_buffer("special_ids", torch.tensor(sorted(set(special_ids)), dtype=torch.long), False)
        self.val_metrics = nn.ModuleDict({"loss": MeanMetric(), "ppl": Perplexity(), "acc": MeanMetric()})
        self._val_generator: torch.Generator | None = None

    def batch_size(self, batch: dict) -> int:
        return batch["text"].shape[0]

    def candidates(self, batch: dict) -> Tensor:
        return batch["text_valid"] & ~torch.isin(batch["text"], self.special_ids.to(batch["text"].device))

    def loss_units(self, batch: dict) -> int:
        """Expected masked tokens (the loss averages over the chosen positions)."""
        return max(1, round(self.mask_prob * int(self.candidates(batch).sum())))

    def _logits_targets(self, model: MultimodalModel, batch: dict, generator=None) -> tuple[Tensor, Tensor]:
        inputs, targets = mask_tokens(
            batch["text"], self.candidates(batch), self.mask_id, self.vocab_size, self.mask_prob, generator
        )
        logits = model(
            inputs, self.tokenizer, self.head, valid=batch["text_valid"], document=batch.get("text_document")
        )
        return logits.float().flatten(0, 1), targets.flatten()

    def training_loss(self, model: MultimodalModel, batch: dict) -> Tensor:
        logits, targets = self._logits_targets(model, batch)
        if not (targets != IGNORE).any():  # nothing chosen (a tiny batch): no signal, but keep the graph
            return logits.sum() * 0.0
        return F.cross_entropy(logits, targets, ignore_index=IGNORE)

    def on_validation_epoch_start(self, model: MultimodalModel) -> None:
        self._val_generator = None  # reseeded on the first batch, on its device

    def validation_update(self, model: MultimodalModel, batch: dict) -> None:
        device = batch["text"].device
        if self._val_generator is None or self._val_generator.device != device:
            self._val_generator = torch.Generator(device).manual_seed(self.seed)
        logits, targets = self._logits_targets(model, batch, self._val_generator)
        chosen = targets != IGNORE
        if not chosen.any():
            return
        losses = F.cross_entropy(logits[chosen], targets[chosen], reduction="none")
        self.val_metrics["loss"].update(losses)
        self.val_metrics["ppl"].update(losses)
        self.val_metrics["acc"].update((logits[chosen].argmax(-1) == targets[chosen]).float())
