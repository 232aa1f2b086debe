"""Captioning and speech recognition as a prefix-LM (``mmformer.models.prefix_lm``): the image or audio
tokens are a bidirectional prefix, the caption or transcript is generated causally after it, one
sequence through the shared backbone (or, with a tower and a projector, a pretrained encoder bridged
into a language model).

Batch keys: ``image`` (or ``audio`` with ``audio_valid``), ``caption (B, L)`` long (``bos … eos``,
right-padded) with ``caption_valid (B, L)`` bool (True = real token) and ``caption_text`` (the reference
strings). Training: next-token cross-entropy on the caption tokens only (the prefix predicts nothing;
the token after ``bos`` onwards, ``eos`` included). Validation: the same loss and perplexity
(token-weighted), and the held-out text decoded (greedy, or beam search with ``beam_size > 1``) and
scored against the references after ``normalize_text``: word error rate ``wer`` and character error
rate ``cer`` (``torchmetrics.text``, edit operations summed over the whole set, then divided by the
reference length) and ``exact_match`` (fraction of items decoded exactly). After each validation the
first batch's references and decoded texts are shown as a table ``decoded/<task>``.
"""

from __future__ import annotations

import re
import unicodedata

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torchmetrics import MeanMetric
from torchmetrics.text import CharErrorRate, WordErrorRate

from ..models.encoder_decoder import EncoderDecoder
from ..models.model import MultimodalModel
from ..models.prefix_lm import PrefixLM
from ..training.media import Media, MediaContext, Table
from .base import TaskBase
from .language_model import IGNORE, Perplexity

_NOT_WORD = re.compile(r"[^\w']+")


def normalize_text(text: str) -> str:
    """The form hypotheses and references are compared in: Unicode NFKC, lower case, every run of
    characters other than letters, digits and apostrophes (punctuation, ``_``) → one space, trimmed.
    ``"Flag: United States"`` → ``"flag united states"``."""
    text = unicodedata.normalize("NFKC", text).lower().replace("_", " ")
    return _NOT_WORD.sub(" ", text).strip()


def caption_targets(ids: Tensor, valid: Tensor) -> Tensor:
    """``(B, L - 1)``: the token each text position predicts (``ids[:, 1:]``), ``IGNORE`` after the end."""
    return ids[:, 1:].masked_fill(~(valid[:, 1:] & valid[:, :-1]), IGNORE)


class PrefixLMTask(TaskBase):
    """Args:
    parts: the parts' names (``PrefixLM``; an ``EncoderDecoder`` for ``Seq2SeqTask``, same interface).
    input_key: the batch key of the prefix inputs (``image`` or ``audio``).
    text: the data-side ``TextTokenizer`` of the captions (``bos_id``, ``eos_id``, ``decode``).
    max_new_tokens: longest decoded text (tokens, ``eos`` excluded).
    beam_size: 1 = greedy decoding; more = beam search.
    length_penalty: beam search's length normalisation exponent.
    main_metric: ``("wer", "min")`` (speech) or ``("exact_match", "max")`` (captions).
    """

    def __init__(
        self,
        parts: PrefixLM | EncoderDecoder,
        input_key: str,
        text,
        max_new_tokens: int,
        beam_size: int = 1,
        length_penalty: float = 1.0,
        main_metric: tuple[str, str] = ("wer", "min"),
    ):
        super().__init__()
        self.parts, self.input_key, self.text = parts, input_key, text
        self.max_new_tokens, self.beam_size, self.length_penalty = max_new_tokens, beam_size, length_penalty
        self.main_metric = main_metric
        self.val_metrics = nn.ModuleDict(
            {
                "loss": MeanMetric(),
                "ppl": Perplexity(),
                "wer": WordErrorRate(),
                "cer": CharErrorRate(),
                "exact_match": MeanMetric(),
            }
        )
        self.examples: list[
            tuple[str, str]
        ] = []  # (reference, hypothesis) of the last validation's first batch

    def batch_size(self, batch: dict) -> int:
        return batch["caption"].shape[0]

    def loss_units(self, batch: dict) -> int:
        """Caption target tokens in ``batch`` (what the training loss averages over)."""
        return int((caption_targets(batch["caption"], batch["caption_valid"]) != IGNORE).sum())

    def _losses(self, model: MultimodalModel, batch: dict) -> tuple[Tensor, Tensor]:
        logits = self.parts.logits(
            model,
            batch[self.input_key],
            batch["caption"],
            batch["caption_valid"],
            batch.get(f"{self.input_key}_valid"),
        )[:, :-1]
        targets = caption_targets(batch["caption"], batch["caption_valid"])
        return logits.float().flatten(0, 1), targets.flatten()

    def training_loss(self, model: MultimodalModel, batch: dict) -> Tensor:
        logits, targets = self._losses(model, batch)
        return F.cross_entropy(logits, targets, ignore_index=IGNORE)

    def transcribe(
        self, model: MultimodalModel, inputs: Tensor, prefix_valid: Tensor | None = None
    ) -> list[str]:
        """Decoded text for each input (``beam_size`` and ``length_penalty`` of this task); ``prefix_valid``
        ``(B, S)`` bool marks the real samples of padded waves."""
        # under FSDP2 (``lockstep``, set by MultiTaskModule.configure_model) every rank decodes
        # max_new_tokens steps: each decoder forward gathers weights from all ranks, and their batches
        # would end at different steps
        ids = self.parts.generate(
            model,
            inputs,
            self.text.bos_id,
            self.text.eos_id,
            self.max_new_tokens,
            self.beam_size,
            self.length_penalty,
            prefix_valid,
            fixed_steps=self.lockstep,
        )
        return [self.text.decode(x, skip_special=True) for x in ids]

    def validation_update(self, model: MultimodalModel, batch: dict) -> None:
        logits, targets = self._losses(model, batch)
        losses = F.cross_entropy(logits, targets, ignore_index=IGNORE, reduction="none")
        counted = targets != IGNORE
        self.val_metrics["loss"].update(losses[counted])
        self.val_metrics["ppl"].update(losses[counted])
        hyps = [
            normalize_text(h)
            for h in self.transcribe(model, batch[self.input_key], batch.get(f"{self.input_key}_valid"))
        ]
        refs = [normalize_text(r) for r in batch["caption_text"]]
        self.val_metrics["wer"].update(hyps, refs)
        self.val_metrics["cer"].update(hyps, refs)
        self.val_metrics["exact_match"].update(
            torch.tensor([float(h == r) for h, r in zip(hyps, refs)], device=logits.device)
        )
        if not self.examples:
            self.examples = list(zip(refs, hyps))[:8]

    def on_validation_epoch_start(self, model: MultimodalModel) -> None:
        self.examples = []

    def media(self, ctx: MediaContext) -> list[Media]:
        """The (reference, decoded) texts of the last validation's first batch, normalised; runs no model."""
        if not self.examples:
            return []
        return [Table("decoded", ["reference", "decoded"], [list(r) for r in self.examples])]
