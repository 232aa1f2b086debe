"""The sample grid the image-generating tasks log after each validation (``media``: ``samples/<task>``):
images drawn by the task's ``sample`` from a fixed seed with the validation weights, laid out in rows.

``sample_grid`` is the draw and the layout every such task shares (diffusion, MaskGIT, Transfusion,
Chameleon); ``class_or_caption_grid`` is the whole ``media`` of the tasks whose condition is a class or
a held-out caption, or none (diffusion, MaskGIT)."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor
from torchvision.utils import make_grid

from ..data.collate import pad_ids
from ..training.media import Image, Media, MediaContext

UNCONDITIONAL_ROW = 8  # images per row of an unconditional grid


def sample_grid(
    ctx: MediaContext, sample: Callable[..., Tensor], model, *, per_row: int, seed: int, **kwargs
) -> tuple[Tensor, Tensor]:
    """``sample(model, generator=…, **kwargs)`` through ``ctx.forward`` with a generator on
    ``ctx.device`` seeded ``seed`` (the same images after every validation), and their grid.

    ``model``: the model to sample (the validation weights: call inside ``ctx.validation_weights()``).
    Returns ``(images, grid)``: ``images (N, C, H, W)`` as ``sample`` returns them (float in [-1, 1], on
    the model's device) and ``grid (C, H', W')`` float in [0, 1] on the CPU, ``per_row`` images a row,
    1-pixel padding (``torchvision.utils.make_grid``)."""
    generator = torch.Generator(ctx.device).manual_seed(seed)
    images = ctx.forward(sample, model, generator=generator, **kwargs)
    return images, make_grid((images.float().cpu() + 1) / 2, nrow=per_row, padding=1)


def class_or_caption_grid(ctx: MediaContext, task, num_classes: int | None) -> list[Media]:
    """The ``samples`` grid of a task conditioned on a class, a caption, or nothing: one row per held-out
    caption (the first ``task.sample_captions`` of ``ctx.val``, when ``task.caption_tokenizer`` is set;
    they are the image's caption), else one row per class (``num_classes``), ``task.samples_per_class``
    images each, guided with ``task.sample_cfg_scale``; else ``task.unconditional_samples`` unguided in
    rows of 8. Sampled with ``task.sample(model, labels, n=, cfg_scale=, steps=task.sample_steps,
    generator=, captions=)`` from the seed ``task.sample_seed``."""
    per_class, labels, captions, shown = task.samples_per_class, None, None, []
    if task.caption_tokenizer is not None:  # the first validation captions, one row each
        val = ctx.val
        items = [val[i] for i in range(min(task.sample_captions, len(val)))]
        shown = [it["caption"] for it in items]
        captions = pad_ids([it["ids"] for it in items for _ in range(per_class)], pad_id=0)
    elif num_classes:
        labels = torch.arange(num_classes).repeat_interleave(per_class)  # (k · per_class,)
    conditional = labels is not None or captions is not None
    with ctx.validation_weights() as model:
        _, grid = sample_grid(
            ctx,
            task.sample,
            model,
            per_row=per_class if conditional else UNCONDITIONAL_ROW,
            seed=task.sample_seed,
            labels=labels,
            n=task.unconditional_samples,
            cfg_scale=task.sample_cfg_scale if conditional else 1.0,
            steps=task.sample_steps,
            captions=captions,
        )
    return [Image("samples", grid, " | ".join(shown) if shown else None)]
