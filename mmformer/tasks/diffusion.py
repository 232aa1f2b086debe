"""Diffusion objective: denoise images with a DiT (``DiTTokenizer`` → ``AdaLNBlock`` backbone →
``DiTFinalLayer``), under either Gaussian diffusion (DDPM, ε- or v-prediction, optional learned
variance and min-SNR weighting) or rectified flow; the process lives in ``mmformer.models.diffusion``.

Batch keys: ``image`` ``(B, C, H, W)`` uint8 (scaled here to [-1, 1]) or float already in [-1, 1], and
``label`` ``(B,)`` long for class-conditional models. Validation reports the same loss on noise and
timesteps drawn from a fixed seed, so epochs compare like with like.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn
from torchmetrics import MeanMetric

from ..models.diffusion import GaussianDiffusion, RectifiedFlow, ddim_sample, ddpm_sample, guided
from ..models.model import MultimodalModel

SAMPLERS = {"gaussian": ("ddim", "ddpm"), "flow": ("euler", "heun")}
FLOW_TIME_SCALE = 1000.0


def to_unit_range(images: Tensor) -> Tensor:
    """uint8 pixels → float in [-1, 1]; float input is returned as is."""
    return images.float() / 127.5 - 1.0 if images.dtype == torch.uint8 else images


def to_uint8(images: Tensor) -> Tensor:
    """[-1, 1] floats → uint8 pixels (clamped)."""
    return ((images.float().clamp(-1, 1) + 1) * 127.5).round().to(torch.uint8)


class DiffusionTask(nn.Module):
    """Args:
    tokenizer: the ``DiTTokenizer`` entry of ``model.tokenizers``.
    head: the ``DiTFinalLayer`` entry of ``model.heads``.
    process: ``GaussianDiffusion`` (integer timesteps) or ``RectifiedFlow`` (t in [0, 1]).
    min_snr_gamma: min-SNR-γ loss weighting (Gaussian diffusion only; None = plain MSE).
    input_key: the batch key of the images.
    val_seed: seed of the validation noise and timesteps.
    sample_cfg_scale, sample_steps, samples_per_class: the sample grid logged after each validation.

    Rectified-flow times t ∈ [0, 1] reach the timestep embedding as ``t · FLOW_TIME_SCALE`` (1000), so
    they spread over the same sinusoid frequencies as the 1,000 integer DDPM steps.
    """

    main_metric = ("loss", "min")

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
    ):
        super().__init__()
        self.tokenizer, self.head, self.input_key = tokenizer, head, input_key
        self.process, self.min_snr_gamma, self.val_seed = process, min_snr_gamma, val_seed
        # the grid DiffusionSamples draws after each validation
        self.sample_cfg_scale, self.sample_steps = sample_cfg_scale, sample_steps
        self.samples_per_class = samples_per_class
        self.val_metrics = nn.ModuleDict({"loss": MeanMetric()})
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
        force_drop: Tensor | None = None,
    ) -> Tensor:
        """The network's prediction ``(B, C_out, H, W)`` for noisy images ``x_t`` at timesteps ``t``."""
        if self.kind == "flow":
            t = t * FLOW_TIME_SCALE
        return model(x_t, self.tokenizer, self.head, t=t, labels=labels, force_drop=force_drop).float()

    def _labels(self, model: MultimodalModel, batch: dict) -> Tensor | None:
        if not model.tokenizers[self.tokenizer].num_classes:
            return None
        if "label" not in batch:
            raise ValueError(
                "a class-conditional diffusion model needs 'label' in its batches (an image folder)"
            )
        return batch["label"]

    def _loss(self, model: MultimodalModel, x0: Tensor, labels: Tensor | None, generator) -> Tensor:
        noise = torch.randn(x0.shape, generator=generator, device=x0.device)
        B = x0.shape[0]
        if self.kind == "flow":
            t = self.process.sample_t(B, generator=generator, device=x0.device)
            out = self.denoise(model, self.process.interpolate(x0, noise, t), t, labels)
            return self.process.loss(out, x0, noise)
        t = torch.randint(0, self.process.num_timesteps, (B,), generator=generator, device=x0.device)
        out = self.denoise(model, self.process.q_sample(x0, t, noise), t, labels)
        return self.process.loss(out, x0, noise, t, self.min_snr_gamma)

    def training_loss(self, model: MultimodalModel, batch: dict) -> Tensor:
        x0 = to_unit_range(batch[self.input_key])
        return self._loss(model, x0, self._labels(model, batch), None).mean()

    def on_validation_epoch_start(self) -> None:
        self._val_generator = None  # every validation pass draws the same noise

    def validation_update(self, model: MultimodalModel, batch: dict) -> None:
        x0 = to_unit_range(batch[self.input_key])
        if self._val_generator is None or self._val_generator.device != x0.device:
            self._val_generator = torch.Generator(x0.device).manual_seed(self.val_seed)
        self.val_metrics["loss"].update(
            self._loss(model, x0, self._labels(model, batch), self._val_generator)
        )

    # ------------------------------------------------------------------ sampling
    @torch.no_grad()
    def sample(
        self,
        model: MultimodalModel,
        labels: Tensor | None,
        n: int | None = None,
        cfg_scale: float = 1.0,
        steps: int = 50,
        sampler: str | None = None,
        eta: float = 0.0,
        generator: torch.Generator | None = None,
    ) -> Tensor:
        """Images ``(B, C, H, W)`` float, clamped to [-1, 1]: ``B = len(labels)`` (class-conditional) or ``n``.

        ``sampler``: ``ddim`` (default) or ``ddpm`` (all T steps) for Gaussian diffusion, ``euler``
        (default) or ``heun`` for rectified flow. ``cfg_scale`` > 1 applies classifier-free guidance
        (class-conditional models only). Raises ``ValueError`` for an unknown sampler or guidance
        without a condition."""
        tok = model.tokenizers[self.tokenizer]
        device = next(model.parameters()).device
        sampler = sampler or SAMPLERS[self.kind][0]
        if sampler not in SAMPLERS[self.kind]:
            raise ValueError(
                f"sampler {sampler!r} does not fit {self.kind} diffusion; choose {SAMPLERS[self.kind]}"
            )
        if labels is not None:
            labels = labels.to(device)
        B = len(labels) if labels is not None else n
        if B is None:
            raise ValueError("give class labels or the number of samples n")
        if cfg_scale != 1 and (labels is None or not tok.num_classes):
            raise ValueError(
                "classifier-free guidance (cfg_scale != 1) needs a class-conditional model and labels"
            )
        shape = (B, tok.in_chans, tok.image_size, tok.image_size)
        was_training = model.training
        model.eval()
        try:
            if labels is not None:
                null = torch.full_like(labels, tok.num_classes)
                fn = guided(lambda x, t, y: self.denoise(model, x, t, y), labels, null, cfg_scale)
            else:
                fn = lambda x, t: self.denoise(model, x, t)  # noqa: E731
            if self.kind == "flow":
                run = self.process.euler_sample if sampler == "euler" else self.process.heun_sample
                images = run(fn, shape, steps=steps, generator=generator, device=device)
            elif sampler == "ddpm":  # ancestral: all T steps, `steps` does not apply
                images = ddpm_sample(self.process, fn, shape, generator=generator, device=device)
            else:
                images = ddim_sample(
                    self.process, fn, shape, steps=steps, eta=eta, generator=generator, device=device
                )
            return images.clamp(-1, 1)
        finally:
            model.train(was_training)
