"""Causal language modelling: next-token cross-entropy, with padding and document boundaries ignored.

Batch keys: ``text`` (B, N) long, ``text_valid`` (B, N) bool, optional ``text_document`` (B, N) long.
Position ``t`` predicts token ``t + 1``; the target is ignored where it is padding or where it
belongs to another packed document (never learn to predict across an ``eos`` into unrelated text).
Validation: token-weighted mean loss and perplexity = exp(that mean), from the same cross-entropy
(finite whenever the loss is; no second ``(B, N, V)`` probability tensor). After each validation the
model continues a few fixed prompts (a table ``samples/<task>``; greedy, so successive tables show how
the model changes).
"""

from __future__ import annotations

from torch import Tensor, nn
from torchmetrics import MeanMetric

from ..models.generate import generate
from ..models.heads import token_cross_entropy
from ..models.model import MultimodalModel
from ..tokenizers.text import TextTokenizer
from ..training.media import Media, MediaContext, Table
from .base import TaskBase

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


class CausalLMTask(TaskBase):
    """Args: ``tokenizer`` (a text embedding entry of ``model.tokenizers``), ``head`` (an LM head)."""

    main_metric = ("ppl", "min")
    # the text samples after each validation: prompts, their length in tokens, tokens generated
    sample_prompts, sample_prompt_tokens, sample_new_tokens = 3, 8, 32

    def __init__(self, tokenizer: str, head: str):
        super().__init__()
        self.tokenizer, self.head = tokenizer, head
        self.val_metrics = nn.ModuleDict({"loss": MeanMetric(), "ppl": Perplexity()})

    def batch_size(self, batch: dict) -> int:
        return batch["text"].shape[0]

    def loss_units(self, batch: dict) -> int:
        """Target tokens in ``batch`` (what the training loss averages over)."""
        return int((next_token_targets(batch) != IGNORE).sum())

    def token_losses(self, model: MultimodalModel, batch: dict, reduction: str) -> Tensor:
        """The next-token cross-entropy (``reduction`` as ``F.cross_entropy``'s, over the counted
        targets); an ``LMHead`` computes it without holding the ``(B, N, V)`` logits
        (``LMHead.cross_entropy``), any other head from its logits."""
        hidden, tokens = model.encode(
            self.tokenizer, batch["text"], valid=batch["text_valid"], document=batch.get("text_document")
        )
        return token_cross_entropy(
            model.heads[self.head], hidden, tokens, next_token_targets(batch), IGNORE, reduction
        )

    def training_loss(self, model: MultimodalModel, batch: dict) -> Tensor:
        return self.token_losses(model, batch, "mean")

    def validation_update(self, model: MultimodalModel, batch: dict) -> None:
        targets = next_token_targets(batch)
        losses = self.token_losses(model, batch, "none").flatten()
        counted = targets.flatten() != IGNORE
        self.val_metrics["loss"].update(losses[counted])  # token-weighted over the whole validation set
        self.val_metrics["ppl"].update(losses[counted])

    def media(self, ctx: MediaContext) -> list[Media]:
        """The first ``sample_prompt_tokens`` real tokens of the first ``sample_prompts`` held-out windows
        (cut at an end of document), each continued greedily by up to ``sample_new_tokens`` tokens: a
        table of (prompt, continuation) texts."""
        tok = TextTokenizer.from_json(ctx.module.tokenizer_files[self.tokenizer])
        val, prompts = ctx.val, []
        for i in range(min(self.sample_prompts, len(val))):
            item = val[i]
            ids = item["text"][item["text_valid"]][: self.sample_prompt_tokens].tolist()
            ids = ids[: ids.index(tok.eos_id)] if tok.eos_id in ids else ids  # stay inside one document
            if ids:
                prompts.append(ids)
        if not prompts:
            return []
        ids, valid = tok.pad_batch(prompts, side="left")  # (n, T) each
        # under FSDP2 every rank must run the same number of forwards: no early stop at eos
        eos = None if ctx.sharded else tok.eos_id
        args = (ids.to(ctx.device), valid.to(ctx.device), self.sample_new_tokens, eos)
        outs = ctx.forward(generate, ctx.model, self.tokenizer, self.head, *args)
        outs = [o[: o.index(tok.eos_id)] if tok.eos_id in o else o for o in outs]
        rows = [[tok.decode(p), tok.decode(o)] for p, o in zip(prompts, outs)]
        return [Table("samples", ["prompt", "continuation"], rows)]
