"""Tokenizer kind ``ids``: sequences that already are integer ids — bytes, pixel grey levels, ListOps
symbols (the Long Range Arena tasks, docs/long_context.md) — embedded as they are: a learned embedding of
``vocab_size`` ids plus learned absolute positions up to ``max_len`` (``mmformer.tokenizers.TextEmbedding``,
GPT-2's ``wte`` + ``wpe``), optionally after a learned class token (LRA's ``classifier_pool="CLS"``).
Its modality is ``ids``: a task reads the batch's ``ids`` / ``ids_valid`` (``data.kind: sequences``,
``mmformer.data.sequences``); there is no text tokenizer to train or store."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import ClassVar, Optional

from omegaconf import MISSING

from ..errors import RecipeError, positive
from ..nn.kernels import position_biases
from ..registry import register
from ..tokenizers.text import TextEmbedding
from .context import BuildContext

log = logging.getLogger("mmformer")


@dataclass
class TokenIdsConfig:
    """``model.tokenizers.<name>`` of kind ``ids``: ids in ``[0, vocab_size)`` → embeddings, with learned
    absolute positions up to ``max_len`` (None: none, for a backbone with ``positions: rope`` etc.; the
    class token takes position 0, so sequences of up to ``max_len - 1`` ids fit with it)."""

    modality: ClassVar[str] = "ids"
    kind: str = "ids"
    vocab_size: int = MISSING  # bytes and pixels: 256; see the dataset's meta.json
    max_len: Optional[int] = None
    class_token: bool = False  # a learned token first, read by a head with ``pool: cls``

    def __post_init__(self) -> None:
        positive(self, "vocab_size", "max_len")

    def check(self, recipe, where: str) -> None:
        """Refuses data other than token sequences; warns when the model gets no position information
        (no ``max_len`` here, ``positions: none`` in a bidirectional backbone without AFT's position
        biases): the ids are then a set, their order lost — right for a bag-of-ids baseline, a silent
        failure for ListOps or Pathfinder."""
        name = where.rsplit(".", 1)[-1]
        backbone = recipe.model.backbone
        order_free = getattr(backbone, "causal", True) or (  # causal attention and AFT's biases tell order
            position_biases(backbone.attn_kernel, dict(backbone.kernel_options)) is not None
        )
        if self.max_len is None and getattr(backbone, "positions", None) == "none" and not order_free:
            log.warning(
                f"'{where}.max_len' is null and 'model.backbone.positions' is none: the model sees no "
                "position, so the order of the ids is lost; set max_len (learned positions) or "
                "model.backbone.positions (rope, alibi, …)"
            )
        for task_name, task in recipe.tasks.items():
            if task.tokenizer == name and task.data.kind != "sequences":
                raise RecipeError(
                    f"'tasks.{task_name}.data': an ids tokenizer reads token sequences (data.kind: sequences), "
                    f"not {task.data.kind!r} data"
                )


@register("tokenizer", "ids", TokenIdsConfig)
def build_token_ids(cfg: TokenIdsConfig, d_model: int, ctx: BuildContext, name: str) -> TextEmbedding:
    return TextEmbedding(cfg.vocab_size, d_model, cfg.max_len, class_token=cfg.class_token)
