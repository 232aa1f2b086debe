"""Task kind ``contrastive``: CLIP (softmax InfoNCE) or SigLIP (sigmoid) between inputs and their captions,
held-out retrieval recall and zero-shot classification (``mmformer.tasks.contrastive``)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar, Optional

import torch
from omegaconf import MISSING

from ...data.image_caption import encode_captions, read_class_prompts
from ...data.roots import resolve_root
from ...errors import RecipeError, non_negative_weight, positive
from ...registry import register
from ...tasks.contrastive import ContrastiveTask
from ..context import BuildContext
from ..tokenizers import modality_at_load
from .base import CaptionedTaskParts, check_captions


@dataclass
class ContrastiveTaskConfig(CaptionedTaskParts):
    """``tasks.<name>`` of kind ``contrastive``: CLIP (softmax InfoNCE) or SigLIP (sigmoid) between the
    inputs (``tokenizer`` → ``head``) and their captions (``caption_tokenizer`` → ``caption_head``);
    held-out retrieval recall and zero-shot classification (``mmformer.tasks.contrastive``)."""

    zero_shot: ClassVar[bool] = True  # reads data.label_key's class prompts
    captions_alone: ClassVar[bool] = True  # the text side: captions (and prompts) through a backbone
    kind: str = "contrastive"
    weight: float = 1.0
    tokenizer: str = MISSING  # image (or audio) tokenizer
    head: str = MISSING  # its projection head
    caption_tokenizer: str = MISSING  # text tokenizer
    caption_head: str = MISSING  # its projection head
    loss: str = "clip"  # clip | siglip
    init_temperature: Optional[float] = None  # default: CLIP 0.07, SigLIP 0.1
    init_bias: float = -10.0  # SigLIP's logit bias
    learn_temperature: bool = True
    gather: bool = True  # score against every rank's pairs (features gathered with gradients)
    data: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.loss not in ("clip", "siglip"):
            raise ValueError(f"loss={self.loss!r}; choose clip or siglip")
        positive(self, "init_temperature")
        non_negative_weight(self)

    def head_refs(self) -> dict[str, tuple[str, str]]:
        return {
            "head": (self.head, self.tokenizer),
            "caption_head": (self.caption_head, self.caption_tokenizer),
        }

    def check(self, recipe, where: str) -> None:
        m = recipe.model
        check_captions(self, recipe, where)
        if modality_at_load(m.tokenizers[self.tokenizer]) == "text":
            raise RecipeError(
                f"'{where}.tokenizer' {self.tokenizer!r} reads text; a contrastive task pairs images or audio with text"
            )
        for key, head in (("head", self.head), ("caption_head", self.caption_head)):
            if m.heads[head].kind != "projection":
                raise RecipeError(
                    f"'{where}.{key}' {head!r} is of kind {m.heads[head].kind}; a contrastive task needs "
                    "kind: projection heads"
                )
        widths = {m.heads[h].embed_dim for h in (self.head, self.caption_head)}
        if len(widths) > 1:
            raise RecipeError(
                f"heads {self.head!r} and {self.caption_head!r} must share one embed_dim, got {sorted(widths)}"
            )


@register("task", "contrastive", ContrastiveTaskConfig)
def build_contrastive(cfg: ContrastiveTaskConfig, ctx: BuildContext) -> ContrastiveTask:
    modality = ctx.tokenizer_modality(ctx.recipe.model.tokenizers[cfg.tokenizer])
    if modality == "text":  # a pretrained source the recipe alone could not tell
        raise RecipeError(
            f"tokenizer {cfg.tokenizer!r} reads text; a contrastive task pairs images or audio with text"
        )
    prompts = None
    label_key = getattr(cfg.data, "label_key", None)
    if label_key:
        classes = read_class_prompts(resolve_root(cfg.data.root), label_key)
        texts = [(i, p) for i, ps in enumerate(classes.values()) for p in ps]
        tok = ctx.text_tokenizer(cfg.caption_tokenizer)
        ids, valid = tok.pad_batch(encode_captions(tok, [p for _, p in texts], cfg.data.max_len))
        prompts = (ids, valid, torch.tensor([i for i, _ in texts]))
    return ContrastiveTask(
        cfg.tokenizer,
        cfg.head,
        cfg.caption_tokenizer,
        cfg.caption_head,
        cfg.loss,
        modality,
        cfg.init_temperature,
        cfg.init_bias,
        cfg.learn_temperature,
        cfg.gather,
        prompts,
    )
