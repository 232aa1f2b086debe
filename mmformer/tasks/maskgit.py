"""MaskGIT / Muse: a bidirectional transformer over a frozen VQ codec's token grid, trained to predict
masked code ids and sampled by iterative parallel decoding with classifier-free guidance (Chang et al.
2022, arXiv:2202.04200; Chang et al. 2023, "Muse", arXiv:2301.00704). The schedule, the training mask and
the decoding loop live in ``mmformer.models.maskgit``; the codes' embedding in
``mmformer.tokenizers.codes.MaskedCodeTokenizer``.

**Conditioning is a prefix, not cross-attention.** A class is one token before the codes (as MaskGIT's
class-conditional model); a caption is the frozen all-MiniLM-L6-v2 encoder's token states (a tower of
the caption tokenizer), mapped to the backbone's width by a trained ``projector`` head, before the
codes. Muse cross-attends to its frozen T5 instead; here a prefix keeps the one shared backbone a plain
stack of bidirectional pre-norm blocks — the same blocks every other task of the platform trains, so a
MaskGIT task can share them in a multi-task recipe — and the sequences are short (≤ 24 caption tokens
beside 49 or 64 codes: the prefix adds under 2× attention cost and a cross-attention backbone would add
a projection per block). Every code token attends to every real prefix token and every code.

Batch keys: ``image`` ``(B, C, H, W)`` uint8 or float in [-1, 1] (encoded to ids by the frozen codec);
``label`` ``(B,)`` long for a class-conditional model; ``caption (B, L)`` long with ``caption_valid
(B, L)`` bool (True = real token) for a text-conditional one. Training: a cosine-scheduled fraction of
the codes is replaced by ``[MASK]`` and cross-entropy is taken on the masked positions only (§3.1);
the condition becomes the null one with the tokenizer's ``cond_dropout``. Validation: the same loss (and
masked-token accuracy) on masks drawn from a fixed seed, and ``loss_uncond`` with the condition dropped
on the same masks (what the condition tells the model about held-out images). After each validation a
grid decoded from a fixed seed (``media``: ``samples/<task>``).
"""

from __future__ import annotations

from dataclasses import replace

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torchmetrics import MeanMetric

from ..models.maskgit import decode, guided_logits, training_mask
from ..models.model import MultimodalModel
from ..nn.tokens import Tokens
from ..tokenizers.codes import MaskedCodeTokenizer, prefixed
from ..training.media import Media, MediaContext
from .base import TaskBase
from .sample_grid import class_or_caption_grid

SAMPLERS = ("maskgit",)  # confidence-ranked re-masking with the cosine schedule


class MaskGITTask(TaskBase):
    """Args:
    tokenizer: the ``MaskedCodeTokenizer`` entry (kind ``vq_codes``) of ``model.tokenizers``.
    head: the head predicting code logits (kind ``codes``): hidden ``(B, N, D)`` → ``(B, N, K)``.
    caption_tokenizer: text-conditional: the text tokenizer reading captions (with its own tower: a
        frozen pretrained encoder) and ``projector``, the head mapping its states to the backbone width.
    input_key: the batch key of the images.
    label_smoothing: of the masked-token cross-entropy (0.1 in the MaskGIT reference).
    val_seed: seed of the validation masks.
    sample_cfg_scale, sample_steps, samples_per_class, temperature, choice_temperature: the grid logged
        after each validation (and ``sample``'s defaults for the temperatures).
    conditional: the model has a trained null condition; validation then reports ``loss_uncond``.
    """

    main_metric = ("loss", "min")
    # the grid after each validation: seed, samples when unconditional, held-out captions shown
    sample_seed, unconditional_samples, sample_captions = 0, 64, 8

    def __init__(
        self,
        tokenizer: str,
        head: str,
        caption_tokenizer: str | None = None,
        projector: str | None = None,
        input_key: str = "image",
        label_smoothing: float = 0.1,
        val_seed: int = 0,
        sample_cfg_scale: float = 3.0,
        sample_steps: int = 8,
        samples_per_class: int = 8,
        temperature: float = 1.0,
        choice_temperature: float = 4.5,
        conditional: bool = False,
    ):
        super().__init__()
        self.tokenizer, self.head, self.input_key = tokenizer, head, input_key
        self.caption_tokenizer, self.projector = caption_tokenizer, projector
        self.label_smoothing, self.val_seed = label_smoothing, val_seed
        self.sample_cfg_scale, self.sample_steps = sample_cfg_scale, sample_steps
        self.samples_per_class = samples_per_class
        self.temperature, self.choice_temperature = temperature, choice_temperature
        self.val_metrics = nn.ModuleDict({"loss": MeanMetric(), "acc": MeanMetric()})
        if conditional:
            self.val_metrics["loss_uncond"] = MeanMetric()
        self._val_generator: torch.Generator | None = None

    def batch_size(self, batch: dict) -> int:
        return batch[self.input_key].shape[0]

    def codes(self, model: MultimodalModel) -> MaskedCodeTokenizer:
        return model.tokenizers[self.tokenizer]

    # ------------------------------------------------------------------ the network
    def caption_prefix(self, model: MultimodalModel, ids: Tensor, valid: Tensor) -> Tokens:
        """Captions ``ids (B, L)`` long, ``valid (B, L)`` bool → prefix Tokens ``(B, L, D)``: the caption
        tokenizer's embeddings, its tower (the frozen text encoder) and the projector."""
        tokens = model.tokenizers[self.caption_tokenizer](ids, valid=valid)
        if self.caption_tokenizer in model.towers:
            tokens = replace(tokens, x=model.towers[self.caption_tokenizer](tokens))
        return model.heads[self.projector](tokens.x, tokens)

    def condition(
        self,
        model: MultimodalModel,
        labels: Tensor | None = None,
        captions: tuple[Tensor, Tensor] | None = None,
    ) -> dict:
        """What ``logits`` conditions on, computed once per batch: ``{"labels": (B,)}`` and / or
        ``{"prefix": Tokens (B, L, D)}`` (the projected caption). Raises ``ValueError`` for a condition
        the model lacks or lacks a condition it needs."""
        tok, cond = self.codes(model), {}
        if tok.num_classes:
            if labels is None:
                raise ValueError("this MaskGIT model is class-conditional: give class labels ('label')")
            cond["labels"] = labels
        elif labels is not None:
            raise ValueError("this MaskGIT model is not class-conditional; drop the labels")
        if self.caption_tokenizer is not None:
            if captions is None:
                raise ValueError("this MaskGIT model is text-conditional: give captions ('caption')")
            cond["prefix"] = self.caption_prefix(model, *captions)
        elif captions is not None:
            raise ValueError("this MaskGIT model is not text-conditional; drop the captions")
        return cond

    def logits(
        self, model: MultimodalModel, ids: Tensor, cond: dict, force_drop: Tensor | None = None
    ) -> Tensor:
        """Code logits ``(B, N, K)`` float for ``ids (B, N)`` (``[MASK]`` = ``K``) under ``cond``
        (``condition``); ``force_drop (B,)`` bool replaces the class / caption by the null one."""
        tok = self.codes(model)
        tokens = tok(ids, cond.get("labels"), force_drop)
        if "prefix" in cond:
            tokens = prefixed(tok.text_prefix(cond["prefix"], force_drop), tokens)
        hidden = model.backbone(tokens)
        logits = model.heads[self.head](hidden[:, -ids.shape[1] :], tokens)  # (B, N, K + 1)
        return logits[..., : tok.codebook_size].float()  # never predict [MASK]

    def guided(self, model: MultimodalModel, ids: Tensor, cond: dict, cfg_scale: float) -> Tensor:
        """Classifier-free guided logits ``uncond + s · (cond − uncond)`` (``guided_logits``), the
        conditional and null-condition passes run as one batch of 2B; without a condition, plain logits."""
        if not cond:
            return self.logits(model, ids, cond)
        B = ids.shape[0]
        both = {}
        if "labels" in cond:
            both["labels"] = torch.cat([cond["labels"], cond["labels"]])
        if "prefix" in cond:
            p = cond["prefix"]
            both["prefix"] = Tokens(**{k: torch.cat([getattr(p, k)] * 2) for k in p.__dataclass_fields__})
        drop = torch.arange(2 * B, device=ids.device) >= B
        out = self.logits(model, torch.cat([ids, ids]), both, force_drop=drop)
        return guided_logits(out[:B], out[B:], cfg_scale)

    def _batch_condition(self, model: MultimodalModel, batch: dict) -> dict:
        captions = None
        if self.caption_tokenizer is not None:
            if "caption" not in batch:
                raise ValueError(
                    "a text-conditional MaskGIT model needs 'caption' in its batches (image_caption data)"
                )
            captions = (batch["caption"], batch["caption_valid"])
        if self.codes(model).num_classes and "label" not in batch:
            raise ValueError(
                "a class-conditional MaskGIT model needs 'label' in its batches (an image folder)"
            )
        return self.condition(model, batch.get("label") if self.codes(model).num_classes else None, captions)

    def _loss(self, model, ids: Tensor, mask: Tensor, cond: dict, force_drop=None) -> tuple[Tensor, Tensor]:
        """Per-sample ``(loss (B,), correct fraction (B,))`` of the masked positions only."""
        inputs = ids.masked_fill(mask, self.codes(model).mask_id)
        logits = self.logits(model, inputs, cond, force_drop)  # (B, N, K)
        ce = F.cross_entropy(
            logits.transpose(1, 2), ids, reduction="none", label_smoothing=self.label_smoothing
        )
        m = mask.float()
        n = m.sum(1).clamp_min(1.0)
        correct = (logits.argmax(-1) == ids).float()
        return (ce * m).sum(1) / n, (correct * m).sum(1) / n

    def masked_loss(self, model: MultimodalModel, ids: Tensor, mask: Tensor, cond: dict) -> Tensor:
        """Mean cross-entropy over the masked positions ``mask (B, N)`` bool (True = masked) of the whole
        batch; unmasked positions contribute nothing."""
        inputs = ids.masked_fill(mask, self.codes(model).mask_id)
        logits = self.logits(model, inputs, cond)
        return F.cross_entropy(logits[mask], ids[mask], label_smoothing=self.label_smoothing)

    def training_loss(self, model: MultimodalModel, batch: dict) -> Tensor:
        ids = self.codes(model).encode(batch[self.input_key])
        mask = training_mask(*ids.shape, device=ids.device)
        return self.masked_loss(model, ids, mask, self._batch_condition(model, batch))

    def on_validation_epoch_start(self, model: MultimodalModel) -> None:
        self._val_generator = None  # every validation pass draws the same masks

    def validation_update(self, model: MultimodalModel, batch: dict) -> None:
        ids = self.codes(model).encode(batch[self.input_key])
        if self._val_generator is None or self._val_generator.device != ids.device:
            self._val_generator = torch.Generator(ids.device).manual_seed(self.val_seed)
        mask = training_mask(*ids.shape, generator=self._val_generator, device=ids.device)
        cond = self._batch_condition(model, batch)
        loss, acc = self._loss(model, ids, mask, cond)
        self.val_metrics["loss"].update(loss)
        self.val_metrics["acc"].update(acc)
        if cond and "loss_uncond" in self.val_metrics:
            drop = torch.ones(ids.shape[0], dtype=torch.bool, device=ids.device)
            self.val_metrics["loss_uncond"].update(self._loss(model, ids, mask, cond, drop)[0])

    # ------------------------------------------------------------------ sampling
    @torch.no_grad()
    def sample(
        self,
        model: MultimodalModel,
        labels: Tensor | None = None,
        n: int | None = None,
        cfg_scale: float = 1.0,
        steps: int = 8,
        sampler: str | None = None,
        generator: torch.Generator | None = None,
        captions: tuple[Tensor, Tensor] | Tensor | None = None,
        bar: bool = False,
        temperature: float | None = None,
        choice_temperature: float | None = None,
    ) -> Tensor:
        """Images ``(B, C, H, W)`` float in [-1, 1] decoded by the codec from ``steps`` rounds of parallel
        decoding (``mmformer.models.maskgit.decode``): one per label (class-conditional), per caption
        (``captions = (ids (B, L), valid (B, L))``, or ids alone when none is padding), or ``n``
        unconditional. ``steps``: decoding rounds T (each predicts every masked code; 4–16 in MaskGIT),
        at most the number of codes. ``cfg_scale`` != 1: guidance against the null class / caption.
        ``sampler``: None or ``maskgit`` (the only one). ``temperature`` (token sampling; 0 = argmax) and
        ``choice_temperature`` (Gumbel noise on the confidences, annealed to 0) default to the task's.
        ``bar``: a progress bar over the rounds. Raises ``ValueError`` for another sampler, ``steps``
        outside ``[1, N]``, a missing or unexpected condition, or guidance without a condition."""
        if sampler not in (None, *SAMPLERS):
            raise ValueError(f"sampler {sampler!r} does not fit MaskGIT; choose {' | '.join(SAMPLERS)}")
        tok = self.codes(model)
        device = next(model.parameters()).device
        if isinstance(captions, Tensor):
            captions = (captions, torch.ones_like(captions, dtype=torch.bool))
        was_training = model.training
        model.eval()
        try:
            if captions is not None:
                captions = (captions[0].to(device), captions[1].to(device))
            cond = self.condition(model, labels.to(device) if labels is not None else None, captions)
            if cfg_scale != 1 and not cond:
                raise ValueError("classifier-free guidance (cfg_scale != 1) needs a conditional model")
            B = len(labels) if labels is not None else len(captions[0]) if captions is not None else n
            if B is None:
                raise ValueError("give the number of samples n")
            ids = decode(
                lambda x: self.guided(model, x, cond, cfg_scale),
                B,
                tok.num_codes,
                tok.mask_id,
                steps=steps,
                temperature=self.temperature if temperature is None else temperature,
                choice_temperature=self.choice_temperature
                if choice_temperature is None
                else choice_temperature,
                generator=generator,
                device=device,
                bar=bar,
            )
            return tok.decode(ids)
        finally:
            model.train(was_training)

    def media(self, ctx: MediaContext) -> list[Media]:
        """A grid decoded from a fixed seed (``sample_seed``) with the validation weights (the EMA when
        kept): one row per class (class-conditional) or per held-out caption (the first
        ``sample_captions``), ``samples_per_class`` each, guided with ``sample_cfg_scale`` in
        ``sample_steps`` rounds; ``unconditional_samples`` in rows of 8 when unconditional."""
        return class_or_caption_grid(ctx, self, self.codes(ctx.model).num_classes)
