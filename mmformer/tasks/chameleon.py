"""Chameleon-style generation: captions and images as one sequence of tokens of one vocabulary — the
image as the codes of a frozen VQ codec — trained with one next-token loss over everything, causal
throughout (Team Chameleon 2024, arXiv:2405.09818; the model side in ``mmformer.models.chameleon``).

Batch keys (``image_caption`` data): ``image (B, C, H, W)`` uint8 (or float in [-1, 1]), ``caption (B, L)``
long (``bos … eos``, right-padded) and ``caption_valid (B, L)`` bool (True = real token). The frozen codec
turns the images into codes here, on the batch and on the accelerator, not in the data workers: it runs
batched beside the model, its weights travel in the model's checkpoint (so ``sample`` decodes with the
codec the model was trained on), and the data path stays the one DiT and Transfusion read.

Training: each row is caption → image or, with probability ``image_first_prob``, image → caption (both
orders, as the Transfusion paper trains its comparison); a caption → image row drops its caption with
probability ``caption_dropout`` (the unconditional model classifier-free guidance needs; the image →
caption rows train it too: ``bos <boi> codes`` is the same prefix). The loss is the mean cross-entropy
over every target token — caption ids, ``eos``, ``<boi>``, image codes, ``<eoi>`` — padding ignored. A
caption longer than the context leaves beside the image is cut and counted (a warning once, and
``val/<task>/truncated_captions``), never dropped.

Validation, every held-out pair in both orders (the same codes every time: no random draw):
``loss`` and ``ppl`` over every target of both orders; ``text_loss`` — the caption tokens (+ ``eos``)
after the image (image → caption); ``image_loss`` — the image codes after the caption (caption → image);
``image_loss_uncond`` — the image codes with no caption before them. ``image_loss_uncond − image_loss``
is what the caption tells the model about a held-out image. After each validation (``media``): a grid of
images sampled for held-out captions (one row each, guided), and a table of interleaved generations:
caption → generated image, and held-out image → generated caption.
"""

from __future__ import annotations

import warnings

import torch
from torch import Tensor, nn
from torchmetrics import MeanMetric, SumMetric

from ..models.chameleon import (
    IGNORE,
    IMAGE,
    TEXT,
    ChameleonLM,
    build_sequences,
    caption_text,
    next_token_targets,
)
from ..models.model import MultimodalModel
from ..progress import progress
from ..tokenizers.text import TextTokenizer
from ..training.media import Image, Media, MediaContext, Table, captions_picture, display_image, spread
from .base import TaskBase
from .language_model import Perplexity
from .sample_grid import sample_grid

SAMPLERS = ("sample", "greedy")


class ChameleonTask(TaskBase):
    """Args:
    lm: the parts' names (``ChameleonLM``: the joint embedding and the LM head).
    text: the data-side BPE (``bos_id``, ``eos_id``, ``pad_id``, ``decode``) of the captions.
    image_tokens, context: codes per image (``h·w``) and the context in tokens (what ``loss_units``
        counts without the model).
    image_first_prob: probability a training row is image → caption.
    caption_dropout: probability a caption → image row drops its caption.
    sample_cfg_scale, sample_temperature, sample_top_k: the sampler ``sample`` and the grid use.
    samples_per_caption, sample_captions: the grid after each validation (rows × columns).
    max_new_tokens: the longest caption ``caption`` and the table generate.
    """

    main_metric = ("loss", "min")
    sample_seed = 0  # the grid's random stream, the same after every validation

    def __init__(
        self,
        lm: ChameleonLM,
        text: TextTokenizer,
        image_tokens: int,
        context: int,
        image_first_prob: float = 0.5,
        caption_dropout: float = 0.1,
        sample_cfg_scale: float = 3.0,
        sample_temperature: float = 1.0,
        sample_top_k: int | None = None,
        samples_per_caption: int = 8,
        sample_captions: int = 8,
        max_new_tokens: int = 16,
    ):
        super().__init__()
        self.lm, self.text = lm, text
        # what ``mmformer sample`` reads of a sampling task: its tokenizer, and the one whose BPE the
        # checkpoint carries for prompts (the joint tokenizer's)
        self.tokenizer = self.caption_tokenizer = lm.tokenizer
        self.image_tokens, self.context = image_tokens, context
        self.image_first_prob, self.caption_dropout = image_first_prob, caption_dropout
        self.sample_cfg_scale, self.sample_temperature = sample_cfg_scale, sample_temperature
        self.sample_top_k, self.samples_per_caption = sample_top_k, samples_per_caption
        self.sample_captions, self.max_new_tokens = sample_captions, max_new_tokens
        self.val_metrics = nn.ModuleDict(
            {
                "loss": MeanMetric(),
                "ppl": Perplexity(),
                "text_loss": MeanMetric(),
                "image_loss": MeanMetric(),
                "image_loss_uncond": MeanMetric(),
                "truncated_captions": SumMetric(),
            }
        )
        self.truncated = [0, 0]  # training captions cut so far, and their tokens dropped
        self._warned = False

    def batch_size(self, batch: dict) -> int:
        return batch["caption"].shape[0]

    def loss_units(self, batch: dict) -> int:
        """Target tokens of ``batch``'s sequences (caption tokens cut to the context, ``eos``, ``<boi>``,
        the codes, ``<eoi>``), counted as if no caption were dropped: a dropped caption's few tokens are
        a small random share the count does not know in advance."""
        room = max(0, self.context - self.image_tokens - 4)  # caption tokens beside bos <boi> … <eoi> eos
        text = (batch["caption_valid"].sum(1) - 2).clamp(0, room)  # without bos / eos
        return int((text + self.image_tokens + 3).sum())

    # ------------------------------------------------------------------ sequences and losses
    def _sequences(self, model: MultimodalModel, batch: dict, image_first: Tensor, drop: Tensor):
        emb = self.lm.embedding(model)
        codes = emb.encode_images(batch["image"])  # (B, C) codec ids, no gradient
        captions = caption_text(batch["caption"], batch["caption_valid"], self.text.bos_id, self.text.eos_id)
        return build_sequences(
            emb.vocab, captions, codes, image_first, drop, self.text.bos_id, self.text.eos_id, emb.context
        )

    def _token_losses(self, model: MultimodalModel, seq) -> tuple[Tensor, Tensor]:
        """Per-target cross-entropy ``(B, N - 1)`` float and the targets ``(B, N - 1)`` (``IGNORE`` = padding)."""
        targets = next_token_targets(seq.ids, seq.valid)
        return self.lm.cross_entropy(model, seq.ids, seq.valid, targets, "none"), targets

    def training_loss(self, model: MultimodalModel, batch: dict) -> Tensor:
        B, device = self.batch_size(batch), batch["caption"].device
        image_first = torch.rand(B, device=device) < self.image_first_prob
        drop = (torch.rand(B, device=device) < self.caption_dropout) & ~image_first
        seq = self._sequences(model, batch, image_first, drop)
        self._count_truncated(seq)
        # the token-weighted mean over every counted target, the logits never held (an LMHead)
        return self.lm.cross_entropy(model, seq.ids, seq.valid, next_token_targets(seq.ids, seq.valid))

    def _count_truncated(self, seq) -> None:
        if not seq.truncated_captions:
            return
        self.truncated[0] += seq.truncated_captions
        self.truncated[1] += seq.truncated_tokens
        if not self._warned:
            self._warned = True
            room = max(0, self.context - self.image_tokens - 4)
            warnings.warn(
                f"{seq.truncated_captions} caption(s) of this batch are longer than the {room} tokens a "
                f"context of {self.context} leaves beside a {self.image_tokens}-code image: cut to fit "
                f"({seq.truncated_tokens} tokens dropped); the pairs are kept. Held-out captions cut are "
                "counted in val/<task>/truncated_captions; raise the tokenizer's context to keep them whole",
                stacklevel=2,
            )

    def validation_update(self, model: MultimodalModel, batch: dict) -> None:
        B, device = self.batch_size(batch), batch["caption"].device
        no = torch.zeros(B, dtype=torch.bool, device=device)
        for image_first in (False, True):
            seq = self._sequences(model, batch, no | image_first, no)
            losses, targets = self._token_losses(model, seq)
            counted = targets != IGNORE
            part = self.lm.embedding(model).vocab.part(targets.clamp_min(0))
            self.val_metrics["loss"].update(losses[counted])
            self.val_metrics["ppl"].update(losses[counted])
            image = losses[counted & (part == IMAGE)]
            if image_first:
                self.val_metrics["text_loss"].update(losses[counted & (part == TEXT)])
                self.val_metrics["image_loss_uncond"].update(image)
            else:
                self.val_metrics["image_loss"].update(image)
        self.val_metrics["truncated_captions"].update(
            torch.tensor(float(seq.truncated_captions), device=device)
        )

    # ------------------------------------------------------------------ generation (the protocol of `mmformer sample`)
    def _prompts(self, captions) -> list[list[int]]:
        """``captions``: ids ``(N, L)`` long (padding = the BPE's pad id) or ``(ids, valid)`` → ``bos`` +
        caption ids per row."""
        ids, valid = (
            captions if isinstance(captions, (tuple, list)) else (captions, captions != self.text.pad_id)
        )
        return [[self.text.bos_id, *t] for t in caption_text(ids, valid, self.text.bos_id, self.text.eos_id)]

    @torch.no_grad()
    def sample(
        self,
        model: MultimodalModel,
        labels: Tensor | None = None,
        *,
        n: int = 8,
        cfg_scale: float | None = None,
        steps: int | None = None,
        sampler: str | None = None,
        generator: torch.Generator | None = None,
        captions: Tensor | tuple[Tensor, Tensor] | None = None,
        bar: bool = False,
    ) -> Tensor:
        """Images ``(N, C, H, W)`` float in [-1, 1], one per caption (``captions``: ids ``(N, L)`` long
        with ``bos … eos`` right-padded by the pad id, or ``(ids, valid)``), else ``n`` unconditional ones
        (the prompt ``bos``). Each is ``h·w`` codes drawn after ``bos caption <boi>`` with the KV cache
        from the image-code range only, guided with ``cfg_scale`` (default: the recipe's
        ``sample_cfg_scale``; 1 = unguided) against ``bos <boi>``, then decoded by the frozen codec.

        ``sampler``: ``sample`` (default: temperature ``sample_temperature``, ``sample_top_k``) or
        ``greedy`` (the argmax code each step). ``labels`` and ``steps`` do not apply (a caption is the
        condition; an image always takes ``h·w`` steps) and are ignored. ``bar``: a progress bar over
        the codes. Raises ``ValueError`` for an unknown sampler, guidance without captions, or a caption
        that leaves no room for the image in the context (naming the sizes)."""
        if sampler not in (None, *SAMPLERS):
            raise ValueError(
                f"sampler {sampler!r} does not fit a Chameleon model; choose {', '.join(SAMPLERS)}"
            )
        if captions is not None:
            prompts = self._prompts(captions)
            cfg_scale = self.sample_cfg_scale if cfg_scale is None else cfg_scale
        elif cfg_scale not in (None, 1):
            raise ValueError("classifier-free guidance (cfg_scale != 1) needs captions")
        else:
            prompts, cfg_scale = [[self.text.bos_id]] * n, 1.0
        temperature = 0.0 if sampler == "greedy" else self.sample_temperature
        was_training = model.training
        shown = progress(desc="sampling", total=self.image_tokens, unit="code", leave=False) if bar else None
        try:
            codes = self.lm.sample_codes(
                model, prompts, self.text.bos_id, cfg_scale, temperature, self.sample_top_k, generator, shown
            )
            return self.lm.embedding(model).decode_codes(codes)
        finally:
            if shown is not None:
                shown.close()
            model.train(was_training)

    @torch.no_grad()
    def caption(
        self,
        model: MultimodalModel,
        images: Tensor,
        *,
        max_new_tokens: int | None = None,
        generator: torch.Generator | None = None,
        temperature: float = 0.0,
    ) -> list[list[int]]:
        """Text ids for each image (``(N, C, H, W)`` float in [-1, 1] or uint8), without ``bos`` / ``eos``:
        the prompt ``bos <boi> codes <eoi>``, then text ids only (never ``bos`` / ``pad`` / ``<boi>``)
        until ``eos`` or ``max_new_tokens`` (default: the task's). Greedy unless ``temperature > 0``
        (then drawn with ``generator``)."""
        emb = self.lm.embedding(model)
        vocab, device = emb.vocab, next(model.parameters()).device
        codes = emb.encode_images(images.to(device))
        prompts = [
            [self.text.bos_id, vocab.boi_id, *row, vocab.eoi_id] for row in vocab.code_ids(codes).tolist()
        ]
        was_training = model.training
        try:
            return self.lm.decode(
                model,
                prompts,
                max_new_tokens or self.max_new_tokens,
                self.text.eos_id,
                banned=(self.text.bos_id, self.text.pad_id),
                images=False,
                temperature=temperature,
                generator=generator,
                fixed_steps=self.lockstep,
            )
        finally:
            model.train(was_training)

    # ------------------------------------------------------------------ media (item 7)
    def media(self, ctx: MediaContext) -> list[Media]:
        """With the validation weights: a grid ``samples/<task>``, one row per held-out caption
        (``sample_captions`` spread over the set, so sorted sets show every class),
        ``samples_per_caption`` images each, guided with ``sample_cfg_scale`` from a fixed seed; a table
        ``interleaved/<task>`` of text ↔ image generations: the caption, its first generated image and the
        caption the model reads back from that image, the held-out image and the caption the model
        writes for it; and the held-out images beside their real and generated captions as a picture
        ``predictions/<task>`` (in the run folder too)."""
        val = ctx.val
        items = [val[i] for i in spread(len(val), self.sample_captions)]
        if not items:
            return []
        k = self.samples_per_caption
        captions = self.text.pad_batch([it["ids"] for it in items for _ in range(k)])
        real = torch.stack([it["image"] for it in items])
        with ctx.validation_weights() as model:
            images, grid = sample_grid(  # (n·k, C, H, W)
                ctx, self.sample, model, per_row=k, seed=self.sample_seed, captions=captions
            )
            firsts = images[::k]
            said = ctx.forward(self.caption, model, torch.cat([firsts, real.to(ctx.device)]))
        images = (images.float().cpu() + 1) / 2
        texts = [it["caption"] for it in items]
        back, written = (
            [self.text.decode(s) for s in said[: len(items)]],
            [self.text.decode(s) for s in said[len(items) :]],
        )
        rows = [
            [
                text,
                Image("generated", images[i * k]),
                back[i],
                Image("held-out", display_image(real[i])),
                written[i],
            ]
            for i, text in enumerate(texts)
        ]
        columns = [
            "caption",
            "generated image",
            "its caption read back",
            "held-out image",
            "generated caption",
        ]
        return [
            Image("samples", grid, " | ".join(texts)),
            Table("interleaved", columns, rows),
            captions_picture(real, texts, written),
        ]
