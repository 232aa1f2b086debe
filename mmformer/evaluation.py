"""Sampling from image-generating checkpoints and measuring the samples with a trained classifier.

Any task whose model-library class has ``sample`` generates images here (``mmformer sample``): the
protocol is ``sample(model, labels (N,) long | None, *, n, cfg_scale, steps, sampler, generator,
captions, bar) → (N, C, H, W) float in [-1, 1]`` (``captions``: ``(ids (N, L), valid (N, L))``), each
task ignoring (and documenting) the arguments that do not apply to it. What a sampling task is
conditioned on is read from it: ``num_classes`` of its ``tokenizer`` (or its own ``num_classes``) for
classes, its ``caption_tokenizer`` (a text tokenizer of the model, whose files the checkpoint carries)
for captions (:func:`conditioning`).

Quality is measured, not eyeballed (the metrics of DiT §5 and of class-conditional generation in
general): the accuracy of a classifier trained on real images at recognising the requested class of
each sample, and the Fréchet distance (Heusel et al. 2017) between generated and real validation
images in that classifier's pooled feature space — torchmetrics' ``FrechetInceptionDistance`` with
the classifier in place of Inception (the 28×28 digits are not ImageNet images).
"""

from __future__ import annotations

import time
import typing
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor, nn

from .build import build_datamodule
from .build import load_checkpoint as load_training_checkpoint
from .errors import RecipeError
from .progress import progress
from .registry import kinds, lookup
from .tasks.diffusion import to_uint8


@dataclass
class Loaded:
    """A model rebuilt from a training checkpoint, with its recipe and objectives."""

    module: nn.Module  # the MultiTaskModule
    recipe: object
    context: object  # the BuildContext that rebuilt it (the checkpoint's tokenizers)

    @property
    def model(self):
        return self.module.model


def load_checkpoint(path: Path, task_kind: str) -> tuple[Loaded, str]:
    """``(loaded, task name)`` for the first task of kind ``task_kind`` in an mmformer checkpoint (the
    weights it holds: EMA weights when the run kept them); ``task_kind="sample"``: the first task of a
    kind that samples images (:func:`sampling_kinds`). Raises ``FileNotFoundError``/``RecipeError`` (for
    ``"sample"``, naming the checkpoint's task kinds and the kinds that sample)."""
    checkpoint = load_training_checkpoint(path)
    if task_kind == "sample":
        sampling = sampling_kinds()
        name = next((n for n, t in checkpoint.recipe.tasks.items() if t.kind in sampling), None)
        if name is None:
            have = sorted({t.kind for t in checkpoint.recipe.tasks.values()})
            raise RecipeError(
                f"{path} has no task that samples images (its tasks are {', '.join(have)}); the kinds that "
                f"sample: {', '.join(sampling)}"
            )
    else:
        name = checkpoint.task(task_kind)
    return Loaded(checkpoint.module().eval(), checkpoint.recipe, checkpoint.context), name


def sampling_kinds() -> list[str]:
    """The registered task kinds whose task class has ``sample`` (read from each builder's return
    annotation, without building anything)."""
    out = []
    for kind in kinds("task"):
        try:
            cls = typing.get_type_hints(lookup("task", kind).builder).get("return")
        except Exception:  # an unresolvable annotation (a user's kind): not listed
            continue
        if callable(getattr(cls, "sample", None)):
            out.append(kind)
    return out


def conditioning(loaded: Loaded, task_name: str) -> tuple[int | None, str | None]:
    """``(number of classes | None, caption tokenizer name | None)`` of a sampling task: its own
    ``num_classes`` or its ``tokenizer``'s, and its ``caption_tokenizer``."""
    task = loaded.module.tasks[task_name]
    k = getattr(task, "num_classes", None)
    if k is None and getattr(task, "tokenizer", None) in loaded.model.tokenizers:
        k = getattr(loaded.model.tokenizers[task.tokenizer], "num_classes", None)
    return (k or None), getattr(task, "caption_tokenizer", None)


class ClassifierFeatures(nn.Module):
    """A trained image classifier as a feature extractor: ``uint8 (B, C, H, W)`` → the pooled (and
    ``fc_norm``-ed) features its head projects, ``(B, D)`` float; ``logits(images)`` → ``(B, K)``."""

    def __init__(self, loaded: Loaded, task_name: str):
        super().__init__()
        task = loaded.module.tasks[task_name]
        self.model, self.tokenizer, self.head = loaded.model, task.tokenizer, task.head
        self.num_features = self.model.backbone.d_model

    def forward(self, images: Tensor) -> Tensor:
        captured = []
        linear = self.model.heads[self.head].head
        handle = linear.register_forward_pre_hook(lambda _m, args: captured.append(args[0]))
        try:
            self.model(images, self.tokenizer, self.head)
        finally:
            handle.remove()
        return captured[0].float()

    def logits(self, images: Tensor) -> Tensor:
        return self.model(images, self.tokenizer, self.head).float()


@torch.no_grad()
def evaluate_class_conditional(
    generator_model: Loaded,
    task_name: str,
    classifier: ClassifierFeatures,
    real: Tensor,
    per_class: int = 100,
    cfg_scales: tuple[float, ...] = (1.0,),
    steps: int = 50,
    sampler: str | None = None,
    seed: int = 0,
    batch_size: int = 250,
) -> list[dict[str, float]]:
    """For each guidance scale, sample ``per_class`` images of every class (the same seed, so the same
    initial noise) with the task's ``sample`` and return ``{"accuracy", "frechet_distance", "samples",
    "samples_per_second"}``: the classifier's accuracy on the requested classes, the Fréchet distance
    between the samples' and the ``real`` images' (uint8 ``(N, C, H, W)``) classifier features (the real
    features are computed once), and the sampler's throughput (wall time of ``sample`` alone, in
    batches of ``batch_size``, on this process's threads)."""
    from torchmetrics.image.fid import FrechetInceptionDistance

    task = generator_model.module.tasks[task_name]
    k, _ = conditioning(generator_model, task_name)
    if not k:
        raise RecipeError("class-conditional evaluation needs a class-conditional model")
    fid = FrechetInceptionDistance(feature=classifier, normalize=False, reset_real_features=False)
    for i in progress(range(0, len(real), batch_size), "features of the real images", unit="batch"):
        fid.update(real[i : i + batch_size], real=True)
    labels = torch.arange(k).repeat_interleave(per_class)
    results = []
    for scale in cfg_scales:
        fid.reset()  # the generated features only
        generator = torch.Generator().manual_seed(seed)
        correct, seconds = 0, 0.0
        batches = range(0, len(labels), batch_size)
        for i in progress(batches, f"sampling at cfg_scale {scale:g}", unit="batch"):
            y = labels[i : i + batch_size]
            start = time.perf_counter()
            images = task.sample(
                generator_model.model, y, cfg_scale=scale, steps=steps, sampler=sampler, generator=generator
            )
            seconds += time.perf_counter() - start
            images = to_uint8(images)
            correct += int((classifier.logits(images).argmax(-1) == y).sum())
            fid.update(images, real=False)
        results.append(
            {
                "accuracy": correct / len(labels),
                "frechet_distance": float(fid.compute()),
                "samples": float(len(labels)),
                "samples_per_second": len(labels) / max(seconds, 1e-9),
            }
        )
    return results


def real_images(loaded: Loaded, task_name: str, limit: int | None = None) -> Tensor:
    """The validation images of a task's data, uint8 ``(N, C, H, W)``."""
    datamodule = build_datamodule(loaded.recipe, loaded.context)
    datamodule.setup("validate")
    data = datamodule.data[task_name].val
    n = len(data) if limit is None else min(limit, len(data))
    return torch.stack([data[i]["image"] for i in range(n)])
