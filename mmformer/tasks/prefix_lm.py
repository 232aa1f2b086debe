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
first batch's references and decoded texts are shown as a table ``decoded/<task>``, and beside their
inputs (images, or spectrograms of audio) as a picture ``predictions/<task>`` (also a PNG in the run
folder).
"""

from __future__ import annotations

import re
import unicodedata

import torch
from torch import Tensor, nn
from torchmetrics import MeanMetric
from torchmetrics.text import CharErrorRate, WordErrorRate

from ..models.encoder_decoder import EncoderDecoder
from ..models.model import MultimodalModel
from ..models.prefix_lm import PrefixLM
from ..training.media import Media, MediaContext, Table, captions_picture, input_cells
from .base import TaskBase
from .language_model import IGNORE, Perplexity

_NOT_WORD = re.compile(r"[^\w']+")


def normalize_text(text: str) -> str:
    """The form hypotheses and references are compared in: Unicode NFKC, lower case, every run of
    characters other than letters, digits and apostrophes (punctuation, ``_``) → one space, trimmed.
    ``"Flag: United States"`` → ``"flag united states"``."""
    text = unicodedata.normalize("NFKC", text).lower().replace("_", " ")
    return _NOT_WORD.sub(" ", text).strip()


def caption_targets(ids: Tensor, valid: Tensor, prompt_len: int = 1) -> Tensor:
    """``(B, L - 1)``: the token each text position predicts (``ids[:, 1:]``), ``IGNORE`` after the end
    and inside a prompt of ``prompt_len`` tokens (Whisper's ``<|startoftranscript|> <|notimestamps|>``:
    only the text after it is a target)."""
    targets = ids[:, 1:].masked_fill(~(valid[:, 1:] & valid[:, :-1]), IGNORE)
    targets[:, : prompt_len - 1] = IGNORE
    return targets


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
        self.prompt_len = 1  # tokens a caption starts with (bos; Seq2SeqTask: a prompt): targets follow them
        self.val_metrics = nn.ModuleDict(
            {
                "loss": MeanMetric(),
                "ppl": Perplexity(),
                "wer": WordErrorRate(),
                "cer": CharErrorRate(),
                "exact_match": MeanMetric(),
            }
        )
        # (reference, hypothesis) of the last validation's first batch, and its inputs (with their mask)
        self.examples: list[tuple[str, str]] = []
        self.example_inputs: tuple[Tensor, Tensor | None] | None = None

    def batch_size(self, batch: dict) -> int:
        return batch["caption"].shape[0]

    def loss_units(self, batch: dict) -> int:
        """Caption target tokens in ``batch`` (what the training loss averages over)."""
        targets = caption_targets(batch["caption"], batch["caption_valid"], self.prompt_len)
        return int((targets != IGNORE).sum())

    def _losses(self, model: MultimodalModel, batch: dict, reduction: str) -> tuple[Tensor, Tensor]:
        """The caption's teacher-forced cross-entropy (``reduction`` as ``F.cross_entropy``'s; ``"none"``
        → ``(B, L - 1)``) and its targets ``(B, L - 1)``; an ``LMHead`` never holds the logits."""
        targets = caption_targets(batch["caption"], batch["caption_valid"], self.prompt_len)
        losses = self.parts.cross_entropy(
            model,
            batch[self.input_key],
            batch["caption"],
            batch["caption_valid"],
            targets,
            reduction,
            batch.get(f"{self.input_key}_valid"),
        )
        return losses, targets

    def training_loss(self, model: MultimodalModel, batch: dict) -> Tensor:
        return self._losses(model, batch, "mean")[0]

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
        losses, targets = self._losses(model, batch, "none")
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
            torch.tensor([float(h == r) for h, r in zip(hyps, refs)], device=losses.device)
        )
        if not self.examples:
            self.examples = list(zip(refs, hyps))[:8]
            valid = batch.get(f"{self.input_key}_valid")
            n = len(self.examples)
            self.example_inputs = (
                batch[self.input_key][:n].detach().cpu(),
                valid[:n].detach().cpu() if valid is not None else None,
            )

    def on_validation_epoch_start(self, model: MultimodalModel) -> None:
        self.examples, self.example_inputs = [], None

    def media(self, ctx: MediaContext) -> list[Media]:
        """The (reference, decoded) texts of the last validation's first batch, normalised, as a table and,
        when its inputs were kept, beside them as a picture; runs no model."""
        if not self.examples:
            return []
        rows = [list(r) for r in self.examples]
        if self.example_inputs is None or self.example_inputs[0].dim() not in (2, 4):  # not waves or images
            return [Table("decoded", ["reference", "decoded"], rows)]
        inputs, valid = self.example_inputs
        rate = 16_000
        if inputs.dim() == 2:
            rate = getattr(ctx.model.tokenizers[self.parts.tokenizer], "sample_rate", rate)
        cells = input_cells(inputs, valid, rate)  # the clip or image, beside its texts
        table = Table("decoded", ["input", "reference", "decoded"], [[c, *r] for c, r in zip(cells, rows)])
        refs, hyps = [r for r, _ in self.examples], [h for _, h in self.examples]
        return [table, captions_picture(inputs, refs, hyps, valid, rate)]
