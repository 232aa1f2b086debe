"""Diffusion objective: denoise images with a DiT (``DiTTokenizer`` → ``AdaLNBlock`` backbone →
``DiTFinalLayer``), under either Gaussian diffusion (DDPM, ε- or v-prediction, optional learned
variance and min-SNR weighting) or rectified flow; the process lives in ``mmformer.models.diffusion``.

Batch keys: ``image`` ``(B, C, H, W)`` uint8 (scaled here to [-1, 1]) or float already in [-1, 1];
``label`` ``(B,)`` long for class-conditional models; ``caption`` ``(B, L)`` long and ``caption_valid``
``(B, L)`` bool for text-conditional ones. Validation reports the same loss on noise and
timesteps drawn from a fixed seed, so epochs compare like with like; a conditional model also reports
``loss_uncond``, the same loss (same noise, same timesteps) with the condition replaced by the null one.
``loss_uncond - loss`` is what the class or caption tells the network about held-out images: 0 when
the condition is ignored, larger as conditioning is learnt. After each validation the task samples a
grid from fixed noise with the validation weights (``media``: ``samples/<task>``).
"""

from __future__ import annotations

import torch
from torch import Tensor, nn
from torchmetrics import MeanMetric

from ..models.diffusion import GaussianDiffusion, RectifiedFlow, ddim_sample, ddpm_sample, guided
from ..models.model import MultimodalModel
from ..training.media import Media, MediaContext
from .base import TaskBase
from .sample_grid import class_or_caption_grid

SAMPLERS = {"gaussian": ("ddim", "ddpm"), "flow": ("euler", "heun")}
FLOW_TIME_SCALE = 1000.0


def to_unit_range(images: Tensor) -> Tensor:
    """uint8 pixels → float in [-1, 1]; float input is returned as is."""
    return images.float() / 127.5 - 1.0 if images.dtype == torch.uint8 else images


def to_uint8(images: Tensor) -> Tensor:
    """[-1, 1] floats → uint8 pixels (clamped)."""
    return ((images.float().clamp(-1, 1) + 1) * 127.5).round().to(torch.uint8)


class DiffusionTask(TaskBase):
    """Args:
    tokenizer: the ``DiTTokenizer`` entry of ``model.tokenizers``.
    head: the ``DiTFinalLayer`` entry of ``model.heads``.
    process: ``GaussianDiffusion`` (integer timesteps) or ``RectifiedFlow`` (t in [0, 1]).
    min_snr_gamma: min-SNR-γ loss weighting (Gaussian diffusion only; None = plain MSE).
    input_key: the batch key of the images.
    val_seed: seed of the validation noise and timesteps.
    sample_cfg_scale, sample_steps, samples_per_class: the sample grid logged after each validation.
    caption_tokenizer: the text tokenizer entry whose embeddings, mean-pooled over a caption's tokens,
        condition a text-conditional DiT (batches then carry ``caption`` and ``caption_valid``).
    conditional: the DiT is class- or text-conditional with a trained null condition (dropout > 0);
        validation then also reports ``loss_uncond``.

    Rectified-flow times t ∈ [0, 1] reach the timestep embedding as ``t · FLOW_TIME_SCALE`` (1000), so
    they spread over the same sinusoid frequencies as the 1,000 integer DDPM steps.
    """

    main_metric = ("loss", "min")
    # the grid after each validation: seed of its noise, samples when unconditional, captions shown
    sample_seed, unconditional_samples, sample_captions = 0, 64, 8

    def __init__(
        self,
        tokenizer: str,
        head: str,
        process: GaussianDiffusion | RectifiedFlow,
        min_snr_gamma: float | None = None,
        input_key: str = "image",
        val_seed: int = 0,
        sample_cfg_scale: float = 4.0,
        sample_steps: int = 50,
        samples_per_class: int = 8,
        caption_tokenizer: str | None = None,
        conditional: bool = False,
    ):
        super().__init__()
        self.tokenizer, self.head, self.input_key = tokenizer, head, input_key
        self.process, self.min_snr_gamma, self.val_seed = process, min_snr_gamma, val_seed
        # the grid ``media`` draws after each validation
        self.sample_cfg_scale, self.sample_steps = sample_cfg_scale, sample_steps
        self.samples_per_class = samples_per_class
        self.caption_tokenizer = caption_tokenizer
        self.val_metrics = nn.ModuleDict({"loss": MeanMetric()})
        if conditional:
            self.val_metrics["loss_uncond"] = MeanMetric()
        self._val_generator: torch.Generator | None = None

    @property
    def kind(self) -> str:
        return "flow" if isinstance(self.process, RectifiedFlow) else "gaussian"

    def batch_size(self, batch: dict) -> int:
        return batch[self.input_key].shape[0]

    # ------------------------------------------------------------------ the network
    def denoise(
        self,
        model: MultimodalModel,
        x_t: Tensor,
        t: Tensor,
        labels: Tensor | None = None,
        text: Tensor | None = None,
        force_drop: Tensor | None = None,
    ) -> Tensor:
        """The network's prediction ``(B, C_out, H, W)`` for noisy images ``x_t`` at timesteps ``t``,
        given class ``labels (B,)`` and/or pooled captions ``text (B, D)``; ``force_drop (B,)`` bool
        replaces them with the null condition."""
        if self.kind == "flow":
            t = t * FLOW_TIME_SCALE
        kwargs = {"labels": labels, "force_drop": force_drop}
        if text is not None:
            kwargs["text"] = text
        return model(x_t, self.tokenizer, self.head, t=t, **kwargs).float()

    def pooled_caption(self, model: MultimodalModel, ids: Tensor, valid: Tensor) -> Tensor:
        """Captions ``ids (B, L)`` with ``valid (B, L)`` → the mean of their real tokens' embeddings from
        the caption tokenizer, ``(B, D)``."""
        x = model.tokenizers[self.caption_tokenizer](ids, valid=valid).x
        w = valid.unsqueeze(-1).to(x.dtype)
        return (x * w).sum(1) / w.sum(1).clamp_min(1.0)

    def _condition(self, model: MultimodalModel, batch: dict) -> dict:
        tok = model.tokenizers[self.tokenizer]
        cond = {}
        if tok.num_classes:
            if "label" not in batch:
                raise ValueError(
                    "a class-conditional diffusion model needs 'label' in its batches (an image folder)"
                )
            cond["labels"] = batch["label"]
        if self.caption_tokenizer is not None:
            if "caption" not in batch:
                raise ValueError(
                    "a text-conditional diffusion model needs 'caption' in its batches (image_caption data)"
                )
            cond["text"] = self.pooled_caption(model, batch["caption"], batch["caption_valid"])
        return cond

    def _draw(self, x0: Tensor, generator) -> tuple[Tensor, Tensor]:
        """``(noise like x0, t (B,))``: integer steps for Gaussian diffusion, t in [0, 1] for flow."""
        noise = torch.randn(x0.shape, generator=generator, device=x0.device)
        B = x0.shape[0]
        if self.kind == "flow":
            return noise, self.process.sample_t(B, generator=generator, device=x0.device)
        return noise, torch.randint(
            0, self.process.num_timesteps, (B,), generator=generator, device=x0.device
        )

    def _loss(self, model: MultimodalModel, x0: Tensor, cond: dict, noise: Tensor, t: Tensor) -> Tensor:
        """Per-sample loss ``(B,)`` at the given noise and timesteps."""
        if self.kind == "flow":
            out = self.denoise(model, self.process.interpolate(x0, noise, t), t, **cond)
            return self.process.loss(out, x0, noise)
        out = self.denoise(model, self.process.q_sample(x0, t, noise), t, **cond)
        return self.process.loss(out, x0, noise, t, self.min_snr_gamma)

    def training_loss(self, model: MultimodalModel, batch: dict) -> Tensor:
        x0 = to_unit_range(batch[self.input_key])
        return self._loss(model, x0, self._condition(model, batch), *self._draw(x0, None)).mean()

    def on_validation_epoch_start(self, model: MultimodalModel) -> None:
        self._val_generator = None  # every validation pass draws the same noise

    def validation_update(self, model: MultimodalModel, batch: dict) -> None:
        x0 = to_unit_range(batch[self.input_key])
        if self._val_generator is None or self._val_generator.device != x0.device:
            self._val_generator = torch.Generator(x0.device).manual_seed(self.val_seed)
        cond = self._condition(model, batch)
        noise, t = self._draw(x0, self._val_generator)
        self.val_metrics["loss"].update(self._loss(model, x0, cond, noise, t))
        if cond:
            dropped = torch.ones(x0.shape[0], dtype=torch.bool, device=x0.device)
            self.val_metrics["loss_uncond"].update(
                self._loss(model, x0, {**cond, "force_drop": dropped}, noise, t)
            )

    # ------------------------------------------------------------------ sampling
    @torch.no_grad()
    def sample(
        self,
        model: MultimodalModel,
        labels: Tensor | None = None,
        n: int | None = None,
        cfg_scale: float = 1.0,
        steps: int = 50,
        sampler: str | None = None,
        eta: float = 0.0,
        generator: torch.Generator | None = None,
        captions: tuple[Tensor, Tensor] | None = None,
        bar: bool = False,
    ) -> Tensor:
        """Images ``(B, C, H, W)`` float, clamped to [-1, 1]: one per label (class-conditional), per
        caption (``captions = (ids (B, L), valid (B, L))``, text-conditional), or ``n`` unconditional;
        ``bar``: a progress bar over the sampler's steps (``mmformer.progress``).

        ``sampler``: ``ddim`` (default) or ``ddpm`` (all T steps) for Gaussian diffusion, ``euler``
        (default) or ``heun`` for rectified flow. ``cfg_scale`` != 1 applies classifier-free guidance
        against the null class / null caption. Raises ``ValueError`` for an unknown sampler, a missing
        condition, or guidance without one."""
        tok = model.tokenizers[self.tokenizer]
        device = next(model.parameters()).device
        sampler = sampler or SAMPLERS[self.kind][0]
        if sampler not in SAMPLERS[self.kind]:
            raise ValueError(
                f"sampler {sampler!r} does not fit {self.kind} diffusion; choose {SAMPLERS[self.kind]}"
            )
        cond: dict[str, Tensor] = {}
        if labels is not None:
            cond["labels"] = labels.to(device)
        was_training = model.training
        model.eval()
        try:
            if captions is not None:
                if self.caption_tokenizer is None:
                    raise ValueError("this diffusion model is not text-conditional; drop the prompt")
                cond["text"] = self.pooled_caption(model, captions[0].to(device), captions[1].to(device))
            elif self.caption_tokenizer is not None:
                raise ValueError("this diffusion model is text-conditional: give a prompt")
            if tok.num_classes and labels is None:
                raise ValueError("this diffusion model is class-conditional: give class labels")
            B = len(next(iter(cond.values()))) if cond else n
            if B is None:
                raise ValueError("give the number of samples n")
            if cfg_scale != 1 and not cond:
                raise ValueError("classifier-free guidance (cfg_scale != 1) needs a conditional model")
            shape = (B, tok.in_chans, tok.image_size, tok.image_size)
            if cond:
                # guidance pairs each sample with its null-condition twin: index i, or -1 for "dropped"
                index = torch.arange(B, device=device)

                def with_cond(x: Tensor, t: Tensor, i: Tensor) -> Tensor:
                    picked = {k: v[i.clamp_min(0)] for k, v in cond.items()}
                    return self.denoise(model, x, t, force_drop=i < 0, **picked)

                fn = guided(with_cond, index, torch.full_like(index, -1), cfg_scale)
            else:
                fn = lambda x, t: self.denoise(model, x, t)  # noqa: E731
            if self.kind == "flow":
                run = self.process.euler_sample if sampler == "euler" else self.process.heun_sample
                images = run(fn, shape, steps=steps, generator=generator, device=device, bar=bar)
            elif sampler == "ddpm":  # ancestral: all T steps, `steps` does not apply
                images = ddpm_sample(
                    self.process, fn, shape, generator=generator, device=device, progress=bar
                )
            else:
                images = ddim_sample(
                    self.process,
                    fn,
                    shape,
                    steps=steps,
                    eta=eta,
                    generator=generator,
                    device=device,
                    progress=bar,
                )
            return images.clamp(-1, 1)
        finally:
            model.train(was_training)

    def media(self, ctx: MediaContext) -> list[Media]:
        """A grid sampled from fixed noise (``sample_seed``) with the validation weights (the EMA when
        kept): one row per class (class-conditional) or per held-out caption (the first
        ``sample_captions``; text-conditional), ``samples_per_class`` each, guided with
        ``sample_cfg_scale``; ``unconditional_samples`` in rows of 8 when unconditional."""
        return class_or_caption_grid(ctx, self, ctx.model.tokenizers[self.tokenizer].num_classes)
