"""Head kind ``pair_classifier``: a two-tower pair classifier (``mmformer.models.PairClassifierHead``,
the Long Range Arena's dual encoder for Retrieval), read by a ``classification`` task whose data gives
pairs (``data.pairs: true``)."""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial

from omegaconf import MISSING

from ..errors import RecipeError, positive
from ..models import PairClassifierHead
from ..models.pair_head import INTERACTIONS
from ..registry import register
from .context import BuildContext


@dataclass
class PairClassifierHeadConfig:
    """``model.heads.<name>`` of kind ``pair_classifier``: each sequence of a pair pooled apart, the two
    vectors classified together (``interaction: nli`` = ``[u, v, u·v, u−v]``) by an MLP of ``mlp_dim``."""

    kind: str = "pair_classifier"
    num_classes: int = MISSING
    pool: str = "mean"  # mean | cls
    interaction: str = "nli"  # nli | concat
    mlp_dim: int = 128
    fc_norm: bool = False

    def __post_init__(self) -> None:
        if self.pool not in ("cls", "mean"):
            raise ValueError(f"pool={self.pool!r}; choose 'mean' or 'cls'")
        if self.interaction not in INTERACTIONS:
            raise ValueError(f"interaction={self.interaction!r}; choose one of {', '.join(INTERACTIONS)}")
        positive(self, "num_classes")
        if self.mlp_dim < 2:  # the MLP's second layer is mlp_dim // 2 wide
            raise ValueError(
                f"mlp_dim={self.mlp_dim}; it must be at least 2 (the second layer is mlp_dim // 2)"
            )

    def check(self, recipe, where: str) -> None:
        name = where.rsplit(".", 1)[-1]
        for task_name, task in recipe.tasks.items():
            if getattr(task, "head", None) != name:
                continue
            data = task.data
            get = data.get if isinstance(data, dict) else partial(getattr, data)
            if task.kind != "classification" or get("kind", None) != "sequences":
                raise RecipeError(
                    f"'{where}': a pair_classifier reads pairs of sequences: task {task_name!r} must be a "
                    f"classification task with data.kind: sequences and data.pairs: true (it is a "
                    f"{task.kind} task with data.kind: {get('kind', None)}); for one input per sample use "
                    "kind: classifier"
                )
            if not get("pairs", False):
                raise RecipeError(
                    f"'{where}': a pair_classifier reads pairs (2B rows per batch of B); set "
                    f"tasks.{task_name}.data.pairs: true (sequences stored as two joined by meta.json's "
                    "separator id), or use kind: classifier"
                )


@register("head", "pair_classifier", PairClassifierHeadConfig)
def build_pair_classifier(cfg: PairClassifierHeadConfig, d_model: int, tokenizer, ctx: BuildContext):
    return PairClassifierHead(
        d_model,
        cfg.num_classes,
        cfg.pool,
        getattr(tokenizer, "num_prefix_tokens", 0),
        cfg.interaction,
        cfg.mlp_dim,
        cfg.fc_norm,
    )
