"""VQ objective: train a VQ-VAE image codec (``mmformer.tokenizers.vq.VQVAE``, the ``vq`` tokenizer's
``vq`` module) to reconstruct the task's images through its discrete codes.

Loss (van den Oord et al. 2017, arXiv:1711.00937, eq. 3): ``MSE(recon, x) + codebook_loss + β ·
commitment_loss`` on images in [-1, 1], β = ``commitment_cost`` (0.25 in the paper). No perceptual or
adversarial term: an LPIPS-style term needs an ImageNet feature network, which is neither offline here
nor meaningful on 28×28 digits (docs/vq.md).

The codec is the tokenizer's own module, called directly: the backbone and heads take no part (a ``vq``
recipe names a minimal backbone because every recipe has one).

Batch keys: ``image`` ``(B, C, H, W)`` uint8 (scaled here to [-1, 1]) or float in [-1, 1]; other keys
(labels, captions) are ignored.

Validation (``val/<task>/…``): ``mse`` — per-pixel MSE of the reconstruction (clamped to [-1, 1], as
``decode`` gives it) on the [0, 1] pixel scale; ``psnr`` — the mean over images of ``10 log10(1 /
mse_image)`` dB (peak 1 on that scale); ``loss`` — the training loss; ``usage`` — the fraction of the K
codes the whole held-out set chooses; ``perplexity`` — ``exp`` of the entropy of the held-out code
frequencies. After each validation: held-out originals above their reconstructions (``media``:
``reconstructions/<task>``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torchmetrics import MeanMetric, Metric
from torchvision.utils import make_grid

from ..models.model import MultimodalModel
from ..tokenizers.vq import VQVAE, code_perplexity, to_unit_range
from ..training.media import Image, Media, MediaContext, spread
from .base import TaskBase


class CodeHistogram(Metric):
    """How often each of ``codebook_size`` codes was chosen over a validation (summed over ranks);
    ``compute()`` gives ``usage`` (fraction of codes chosen at least once) or ``perplexity``."""

    full_state_update = False

    def __init__(self, codebook_size: int, statistic: str):
        super().__init__()
        if statistic not in ("usage", "perplexity"):
            raise ValueError(f"statistic={statistic!r}; choose usage or perplexity")
        self.statistic = statistic
        self.add_state("counts", torch.zeros(codebook_size, dtype=torch.long), dist_reduce_fx="sum")

    def update(self, ids: Tensor) -> None:
        self.counts += torch.bincount(ids.flatten(), minlength=self.counts.numel())

    def compute(self) -> Tensor:
        if self.statistic == "usage":
            return (self.counts > 0).float().mean()
        return code_perplexity(self.counts)


class VQTask(TaskBase):
    """Args:
    tokenizer: the ``vq`` entry of ``model.tokenizers`` whose codec this task trains.
    codebook_size: its codebook size ``K`` (the histogram metrics' length).
    commitment_cost: β of the commitment term.
    input_key: the batch key of the images.
    media_images: held-out images shown with their reconstructions after each validation.
    """

    main_metric = ("mse", "min")

    def __init__(
        self,
        tokenizer: str,
        codebook_size: int,
        commitment_cost: float = 0.25,
        input_key: str = "image",
        media_images: int = 16,
    ):
        super().__init__()
        self.tokenizer, self.commitment_cost, self.input_key = tokenizer, commitment_cost, input_key
        self.media_images = media_images
        self.val_metrics = nn.ModuleDict(
            {
                "mse": MeanMetric(),
                "psnr": MeanMetric(),
                "loss": MeanMetric(),
                "usage": CodeHistogram(codebook_size, "usage"),
                "perplexity": CodeHistogram(codebook_size, "perplexity"),
            }
        )

    def batch_size(self, batch: dict) -> int:
        return batch[self.input_key].shape[0]

    def codec(self, model: MultimodalModel) -> VQVAE:
        return model.tokenizers[self.tokenizer].vq

    def _loss(self, out, x: Tensor) -> Tensor:
        return (
            F.mse_loss(out.recon.float(), x) + out.codebook_loss + self.commitment_cost * out.commitment_loss
        )

    def training_loss(self, model: MultimodalModel, batch: dict) -> Tensor:
        x = to_unit_range(batch[self.input_key])
        return self._loss(self.codec(model)(x), x)

    def validation_update(self, model: MultimodalModel, batch: dict) -> None:
        x = to_unit_range(batch[self.input_key])
        out = self.codec(model)(x)
        self.val_metrics["loss"].update(self._loss(out, x))
        # on the [0, 1] pixel scale: half the [-1, 1] difference, so a quarter of its square
        per_image = ((out.recon.float().clamp(-1, 1) - x) / 2).pow(2).flatten(1).mean(1)  # (B,)
        self.val_metrics["mse"].update(per_image)
        self.val_metrics["psnr"].update(-10 * torch.log10(per_image.clamp_min(1e-10)))
        self.val_metrics["usage"].update(out.ids)
        self.val_metrics["perplexity"].update(out.ids)

    @torch.no_grad()
    def reconstruct(self, model: MultimodalModel, images: Tensor) -> Tensor:
        """Images ``(B, C, H, W)`` (uint8 or float in [-1, 1]) → ``decode(encode(images))``, float in
        [-1, 1]."""
        vq = self.codec(model)
        return vq.decode(vq.encode(images))

    def media(self, ctx: MediaContext) -> list[Media]:
        """``media_images`` held-out images spread over the set (every class of a sorted image folder),
        originals in the top row, their reconstructions (validation weights) below."""
        val = ctx.val
        items = [val[i][self.input_key] for i in spread(len(val), self.media_images)]
        originals = to_unit_range(torch.stack(items)).to(ctx.device)  # (n, C, H, W)
        with ctx.validation_weights() as model:
            recon = ctx.forward(self.reconstruct, model, originals)
        mse = float(((recon.float() - originals) / 2).pow(2).mean())
        both = torch.cat([originals, recon.float()]).cpu()  # (2n, C, H, W)
        grid = make_grid((both + 1) / 2, nrow=len(items), padding=1)
        return [
            Image("reconstructions", grid, f"top: held-out images, bottom: reconstructions (MSE {mse:.4f})")
        ]
