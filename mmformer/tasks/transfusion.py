"""Transfusion objective: the LM loss on the text and the diffusion (or flow) loss on the images of mixed
caption–image sequences through the shared causal backbone (Zhou et al. 2024, arXiv:2408.11039; layout,
masks and generation in ``mmformer.models.transfusion``, the noising math in ``mmformer.models.diffusion``).

Batch keys (``image_caption`` data): ``image (B, C, H, W)`` uint8 (scaled here to [-1, 1]), ``caption
(B, L)`` long ``bos … eos`` right-padded, ``caption_valid (B, L)`` bool (True = real token).

Training (§3.4, §4): each pair is laid out caption first with probability ``caption_first`` (0.8 in the
paper, §4.1: 80 % of the pairs condition the image on the caption), else image first; the caption of a
caption-first pair is dropped with probability ``caption_dropout`` (classifier-free guidance needs the
unconditional ``bos <boi> image <eoi> eos``). Every image gets its own timestep and noise (nothing else in
the sequence is noised); in the image-first order the noise is capped at ``image_first_max_t`` of the
schedule (§4.3, "Image noising": t ≤ 500 of 1,000 for the 20 % image-first pairs, which helps captioning
and changes the other benchmarks by < 1 %). Loss = ``L_LM + λ · L_image``: ``L_LM`` the mean cross-entropy
over the text targets of the batch, ``L_image`` the mean per-image diffusion loss, ``λ = image_weight``
(5 in the paper, §4.1: the value that balances the two losses' scales there; pixel-space losses here are
of the same order, so the recipes keep it). A caption too long for ``context`` beside its image is cut
(its ``eos`` kept) and counted: a warning with the running count, and ``captions_cut`` in validation.

Validation, with noise and timesteps from a fixed seed: ``loss`` (caption first, no dropout:
``L_LM + λ · L_image``), ``image_loss`` / ``image_loss_uncond`` (the image's diffusion loss after its
caption / after ``bos <boi>`` alone, same noise and timestep: what the caption tells the image),
``text_loss`` / ``text_loss_uncond`` (cross-entropy per caption token, markers and ``eos`` excluded,
after the clean image / with no image before it: what the image tells the caption). After each validation
(``media``): a sample grid for the first held-out captions, and a table of interleaved generations
(caption prompt → text, image, text) and of captions decoded from held-out images.
"""

from __future__ import annotations

import warnings
from dataclasses import replace

import torch
from torch import Tensor, nn
from torchmetrics import MeanMetric, SumMetric

from ..data.collate import pad_ids
from ..models.diffusion import RectifiedFlow
from ..models.model import MultimodalModel
from ..models.transfusion import (
    FLOW_TIME_SCALE,
    IGNORE,
    SAMPLERS,
    Transfusion,
    build_layout,
    pack,
    pair_document,
)
from ..training.media import Image, Media, MediaContext, Table, captions_picture
from .base import TaskBase
from .diffusion import to_unit_range
from .sample_grid import sample_grid


class TransfusionTask(TaskBase):
    """Args:
    parts: the model's parts and sizes (``Transfusion``).
    process: ``GaussianDiffusion`` (the paper's: ε-prediction, cosine schedule) or ``RectifiedFlow``.
    text: the data-side ``TextTokenizer`` (``decode``).
    image_weight: λ of ``L_LM + λ · L_image``.
    caption_first, caption_dropout: probabilities (training only); image_first_max_t: the noise cap of
        the image-first order, a fraction of the schedule.
    pack: several pairs per row (document masks), else one pair per row.
    min_snr_gamma: min-SNR-γ weighting of the Gaussian loss (None: plain MSE).
    sample_cfg_scale, sample_steps, sampler, samples_per_caption, sample_captions, max_new_tokens: the
        media after each validation (and the defaults of ``sample`` / ``caption``).
    """

    main_metric = ("loss", "min")

    def __init__(
        self,
        parts: Transfusion,
        process,
        text,
        image_weight: float = 5.0,
        caption_first: float = 0.8,
        image_first_max_t: float = 0.5,
        caption_dropout: float = 0.1,
        pack: bool = False,
        min_snr_gamma: float | None = None,
        val_seed: int = 0,
        sample_cfg_scale: float = 3.0,
        sample_steps: int = 25,
        sampler: str | None = None,
        samples_per_caption: int = 8,
        sample_captions: int = 8,
        max_new_tokens: int = 24,
    ):
        super().__init__()
        self.parts, self.process, self.text = parts, process, text
        # the parts `mmformer sample` reads (``evaluation.conditioning``): text-conditional, no classes
        self.tokenizer, self.caption_tokenizer = parts.image_tokenizer, parts.text_tokenizer
        self.image_weight, self.caption_first, self.caption_dropout = (
            image_weight,
            caption_first,
            caption_dropout,
        )
        self.image_first_max_t, self.pack, self.min_snr_gamma = image_first_max_t, pack, min_snr_gamma
        self.val_seed = val_seed
        self.sample_cfg_scale, self.sample_steps = sample_cfg_scale, sample_steps
        self.sampler = sampler or SAMPLERS[self.kind][0]
        self.samples_per_caption, self.sample_captions = samples_per_caption, sample_captions
        self.max_new_tokens = max_new_tokens
        names = ("loss", "image_loss", "image_loss_uncond", "text_loss", "text_loss_uncond")
        self.val_metrics = nn.ModuleDict({n: MeanMetric() for n in names})
        self.val_metrics["captions_cut"] = SumMetric()
        self.captions_cut = 0  # training captions cut to fit the context, so far
        self._val_generator: torch.Generator | None = None

    @property
    def kind(self) -> str:
        return "flow" if isinstance(self.process, RectifiedFlow) else "gaussian"

    def batch_size(self, batch: dict) -> int:
        return batch["image"].shape[0]

    # ------------------------------------------------------------------ sequences and losses
    def _draw(self, x0: Tensor, cap: Tensor, generator) -> tuple[Tensor, Tensor]:
        """``(noise like x0, t (M,))`` in the process's units; an image with ``cap[m] < 1`` gets its t
        scaled into ``[0, cap · T)`` (the image-first noise cap)."""
        noise = torch.randn(x0.shape, generator=generator, device=x0.device)
        M = x0.shape[0]
        if self.kind == "flow":
            return noise, self.process.sample_t(M, generator=generator, device=x0.device) * cap
        u = torch.rand(M, generator=generator, device=x0.device)
        return noise, (u * cap * self.process.num_timesteps).long().clamp_max(self.process.num_timesteps - 1)

    def _noisy(self, x0: Tensor, noise: Tensor, t: Tensor) -> tuple[Tensor, Tensor]:
        """``(x_t, t in the timestep embedder's units)``."""
        if self.kind == "flow":
            return self.process.interpolate(x0, noise, t), t * FLOW_TIME_SCALE
        return self.process.q_sample(x0, t, noise), t.float()

    def _image_loss(self, pred: Tensor, x0: Tensor, noise: Tensor, t: Tensor) -> Tensor:
        """Per-image loss ``(M,)``."""
        if self.kind == "flow":
            return self.process.loss(pred, x0, noise)
        return self.process.loss(pred, x0, noise, t, self.min_snr_gamma)

    def _captions(self, batch: dict) -> list[list[int]]:
        ids, valid = batch["caption"], batch["caption_valid"]
        return [row[v].tolist() for row, v in zip(ids.cpu(), valid.cpu())]

    def _run(
        self,
        model: MultimodalModel,
        captions: list[list[int]],
        x0: Tensor,
        caption_first: list[bool],
        noise: Tensor,
        t: Tensor,
        packed: bool,
        reduction: str = "mean",
    ) -> tuple[Tensor, Tensor, Tensor, int]:
        """Lay the pairs out, run them; returns ``(the text's cross-entropy (reduction as
        F.cross_entropy's; "none": (B', N), 0 where ignored), targets (B', N), per-image loss (M,),
        captions cut)``."""
        P, p = self.parts.patches(model), self.parts
        docs, cut = [], 0
        for m, (caption, first) in enumerate(zip(captions, caption_first)):
            doc, n = pair_document(caption, m, first, p.boi_id, p.eoi_id, P, p.context)
            docs.append(doc)
            cut += n > 0
        rows = pack(docs, P, p.context) if packed else [[d] for d in docs]
        layout = build_layout(rows, P, p.pad_id).to(x0.device)
        x_t, t_model = self._noisy(x0, noise, t)
        text, pred = p.losses(model, layout, x_t, t_model, reduction)
        return text, layout.targets, self._image_loss(pred, x0, noise, t), cut

    def _drop_captions(self, captions: list[list[int]], drop: list[bool]) -> list[list[int]]:
        return [[c[0], c[-1]] if d else c for c, d in zip(captions, drop)]

    def training_loss(self, model: MultimodalModel, batch: dict) -> Tensor:
        x0 = to_unit_range(batch["image"])
        captions = self._captions(batch)
        B = len(captions)
        first = (torch.rand(B) < self.caption_first).tolist()
        drop = [f and d for f, d in zip(first, (torch.rand(B) < self.caption_dropout).tolist())]
        captions = self._drop_captions(captions, drop)
        cap = torch.tensor([1.0 if f else self.image_first_max_t for f in first], device=x0.device)
        noise, t = self._draw(x0, cap, None)
        lm, _, image_loss, cut = self._run(model, captions, x0, first, noise, t, self.pack)
        if cut:
            self.captions_cut += cut
            warnings.warn(
                f"{cut} caption(s) of this batch cut to fit the {self.parts.context}-token context beside "
                f"their image ({self.captions_cut} so far)",
                stacklevel=2,
            )
        return lm + self.image_weight * image_loss.mean()

    def on_validation_epoch_start(self, model: MultimodalModel) -> None:
        self._val_generator = None  # every validation pass draws the same noise
        self.examples: list[dict] = []

    def _caption_token_losses(self, losses: Tensor, targets: Tensor) -> Tensor:
        """The per-target cross-entropies ``losses`` of every target that is a caption token (markers,
        bos, eos excluded)."""
        p = self.parts
        special = torch.tensor([p.boi_id, p.eoi_id, p.bos_id, p.eos_id, IGNORE], device=targets.device)
        return losses[~torch.isin(targets, special)]

    def validation_update(self, model: MultimodalModel, batch: dict) -> None:
        x0 = to_unit_range(batch["image"])
        if self._val_generator is None or self._val_generator.device != x0.device:
            self._val_generator = torch.Generator(x0.device).manual_seed(self.val_seed)
        captions = self._captions(batch)
        B = len(captions)
        noise, t = self._draw(x0, torch.ones(B, device=x0.device), self._val_generator)
        m = self.val_metrics
        losses, targets, image_loss, cut = self._run(model, captions, x0, [True] * B, noise, t, False, "none")
        lm = losses[targets != IGNORE].mean()
        m["loss"].update(lm + self.image_weight * image_loss.mean(), weight=B)
        m["image_loss"].update(image_loss)
        m["text_loss_uncond"].update(self._caption_token_losses(losses, targets))
        m["captions_cut"].update(cut)
        dropped = self._drop_captions(captions, [True] * B)
        _, _, uncond, _ = self._run(model, dropped, x0, [True] * B, noise, t, False)
        m["image_loss_uncond"].update(uncond)
        clean = torch.zeros_like(t)  # image first, clean: the caption given the image
        losses, targets, _, _ = self._run(
            model, captions, x0, [False] * B, torch.zeros_like(x0), clean, False, "none"
        )
        m["text_loss"].update(self._caption_token_losses(losses, targets))
        if not self.examples:  # the first held-out pairs, for the media
            self.examples = [
                {
                    "image": batch["image"][i].detach().cpu(),
                    "ids": captions[i],
                    "text": batch["caption_text"][i],
                }
                for i in range(min(B, self.sample_captions))
            ]

    # ------------------------------------------------------------------ generation (mmformer sample)
    def _as_lists(self, captions) -> list[list[int]]:
        """Captions as id lists: ``(ids (N, L), valid (N, L))``, or ``ids (N, L)`` padded with the pad id."""
        if isinstance(captions, (tuple, list)) and len(captions) == 2 and torch.is_tensor(captions[1]):
            ids, valid = captions
        else:
            ids = captions
            valid = ids != self.parts.pad_id
        return [row[v].tolist() for row, v in zip(ids.cpu(), valid.cpu().bool())]

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
        captions=None,
        bar: bool = False,
        use_cache: bool = True,
    ) -> Tensor:
        """Caption → image (the sampling protocol of ``mmformer sample``): one image per caption
        (``captions``: ids ``(N, L)`` padded with the pad id, or ``(ids, valid)``; each ``bos … eos``), or
        ``n`` caption-free images (prompt ``bos <boi>``) without captions. ``cfg_scale`` (default the
        task's) guides against ``bos <boi>``; ``steps``, ``sampler`` (``ddim``/``ddpm`` for Gaussian
        diffusion, ``euler``/``heun`` for flow; default the task's). ``labels`` and ``bar`` do not apply
        (a Transfusion model is conditioned by its text); ``labels`` raise ``ValueError``.
        Returns ``(N, C, H, W)`` float in [-1, 1]."""
        if labels is not None and captions is None:
            raise ValueError(
                "a transfusion model is conditioned on text: give captions (prompts), not labels"
            )
        p = self.parts
        lists = self._as_lists(captions) if captions is not None else [[p.bos_id, p.eos_id]] * n
        cut = sum(p.cut_prompt(c, model)[1] > 0 for c in lists)
        if cut:
            warnings.warn(
                f"{cut} prompt(s) cut to leave room for the image in the {p.context}-token context",
                stacklevel=2,
            )
        was_training = model.training
        model.eval()
        try:
            return p.sample_images(
                model,
                lists,
                self.process,
                sampler or self.sampler,
                steps or self.sample_steps,
                self.sample_cfg_scale if cfg_scale is None else cfg_scale,
                generator,
                use_cache,
            )
        finally:
            model.train(was_training)

    @torch.no_grad()
    def caption(
        self, model: MultimodalModel, images: Tensor, *, max_new_tokens: int | None = None, generator=None
    ) -> list[list[int]]:
        """Image → text ids (greedy; ``generator`` does not apply): ``images (N, C, H, W)`` in [-1, 1]
        (uint8 pixels are scaled). The new ids per image, ``eos`` left out."""
        was_training = model.training
        model.eval()
        try:
            device = next(model.parameters()).device
            x = to_unit_range(images).to(device)
            return self.parts.caption_images(model, x, max_new_tokens or self.max_new_tokens)
        finally:
            model.train(was_training)

    def media(self, ctx: MediaContext) -> list[Media]:
        """A grid sampled from fixed noise for the first held-out captions (one row each,
        ``samples_per_caption`` images, guided with ``sample_cfg_scale``); a table ``generations``: for
        each of those captions as a text prompt, the interleaved generation (text, image, text), and the
        caption decoded from its held-out image."""
        if not getattr(self, "examples", None):
            return []
        p, k = self.parts, self.samples_per_caption
        shown = [e["text"] for e in self.examples]
        ids, valid = pad_ids([e["ids"] for e in self.examples for _ in range(k)], p.pad_id)
        with ctx.validation_weights() as model:
            _, grid = sample_grid(ctx, self.sample, model, per_row=k, seed=0, captions=(ids, valid))
            rows = []
            for e in self.examples[:4]:
                prompt = [i for i in e["ids"] if i != p.eos_id]  # bos + caption: the model goes on
                gen = torch.Generator(ctx.device).manual_seed(0)
                segments = ctx.forward(
                    p.generate, model, prompt, self.process, self.sampler, self.sample_steps,
                    self.max_new_tokens, self.sample_cfg_scale, gen,
                )  # fmt: skip
                decoded = ctx.forward(self.caption, model, e["image"][None])[0]
                rows.append([e["text"], *self._segments(segments), Image("input", _unit(e["image"])),
                             self.text.decode(decoded, skip_special=True)])  # fmt: skip
        columns = ["prompt", "text", "image", "text after", "held-out image", "decoded caption"]
        # the run folder keeps pictures, not tables: the generated images beside prompt and generated text
        made = [r for r in rows if isinstance(r[2], Image)]
        picture = []
        if made:
            pics = torch.stack([r[2].image for r in made]) * 2 - 1
            text = [f"{r[1]} <image> {r[3]}" for r in made]
            picture = [replace(captions_picture(pics, [r[0] for r in made], text), name="generations")]
        return [Image("samples", grid, " | ".join(shown)), Table("generations", columns, rows), *picture]

    def _segments(self, segments: list) -> list:
        """Interleaved segments → (text before, image cell or "", text after)."""
        texts = [s for s in segments if isinstance(s, list)]
        images = [s for s in segments if torch.is_tensor(s)]
        before = self.text.decode(texts[0], skip_special=False) if texts else ""
        after = self.text.decode(texts[1], skip_special=False) if len(texts) > 1 else ""
        cell = Image("generated", (images[0].float().cpu() + 1) / 2) if images else ""
        return [before, cell, after]


def _unit(image: Tensor) -> Tensor:
    return to_unit_range(image).float().add(1).div(2)
