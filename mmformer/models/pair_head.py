"""A two-tower pair classifier: both sequences of a pair go through the same tokenizer and backbone
separately, each is pooled to one vector, and the two vectors are classified together — the Long Range
Arena's dual encoder for document matching (Tay et al. 2021, arXiv:2011.04006 §3.5; the reference's
``ClassifierHeadDual``, ``lra_benchmarks/models/layers/common_layers.py``), as sentence-pair models
combine them (InferSent, Conneau et al. 2017 §3.3: ``[u, v, u·v, u−v]``).

Shape legend: B pairs, N tokens, D model width, K classes.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from ..nn.tokens import Tokens
from .heads import ClassifierHead

INTERACTIONS = ("nli", "concat")


class PairClassifierHead(nn.Module):
    """Classify pairs from their two towers' hidden states, given as one batch of ``2B`` rows: the first
    sequences of the ``B`` pairs, then their second sequences in the same order (what
    ``mmformer.data.sequences.collate_pairs`` builds; both halves padded to one length, the mask telling
    padding apart).

    Args:
        d_model: hidden width ``D``.
        num_classes: ``K``.
        pool: ``"mean"`` averages each sequence's valid non-prefix tokens; ``"cls"`` takes its first token
            (the tokenizer's class token).
        num_prefix_tokens: tokens (class token) excluded from mean pooling; the builder takes it from the
            tokenizer.
        interaction: ``"nli"`` classifies ``[u, v, u·v, u−v]`` (``4D`` features; LRA's Retrieval setting),
            ``"concat"`` ``[u, v]`` (``2D``).
        mlp_dim: width of the MLP: ``features → mlp_dim → mlp_dim // 2 → K`` with ReLU between (LRA's
            dual head).
        fc_norm: LayerNorm of each pooled vector before the interaction.
        norm_eps: LayerNorm epsilon of ``fc_norm``.

    The head cannot tell pairs from any other batch of ``2B`` rows: the data must give pairs (a recipe
    with this head and without ``data.pairs: true`` is refused at load).

    ``forward(hidden (2B, N, D), tokens) → logits (B, K)`` in the hidden dtype. The order of the two
    sequences matters for ``u − v`` (and for ``concat``): a pair and its swap are different inputs.
    ``rows_per_sample``: 2. ``reads``: ``slice(0, 1)`` for ``pool="cls"`` (the backbone's last block
    then computes that row only), else None.

    Raises ``ValueError`` at construction for an unknown ``pool`` / ``interaction``, ``pool="cls"``
    without a prefix token, or sizes below 1; at ``forward`` for an odd number of rows (not pairs).
    """

    rows_per_sample = 2  # what FLOP counts per sample feed it (``mmformer info``)

    def __init__(
        self,
        d_model: int,
        num_classes: int,
        pool: str = "mean",
        num_prefix_tokens: int = 0,
        interaction: str = "nli",
        mlp_dim: int = 128,
        fc_norm: bool = False,
        norm_eps: float = 1e-6,
    ):
        super().__init__()
        if interaction not in INTERACTIONS:
            raise ValueError(f"interaction must be one of {INTERACTIONS}, got {interaction!r}")
        if num_classes < 1 or mlp_dim < 2:
            raise ValueError(f"num_classes must be >= 1 and mlp_dim >= 2, got {num_classes}, {mlp_dim}")
        self.interaction = interaction
        # each sequence's vector: a classifier head without its projection (pooled, fc_norm-ed features)
        self.pooler = ClassifierHead(d_model, 0, pool, num_prefix_tokens, fc_norm, norm_eps=norm_eps)
        features = (4 if interaction == "nli" else 2) * d_model
        self.mlp = nn.Sequential(
            nn.Linear(features, mlp_dim),
            nn.ReLU(),
            nn.Linear(mlp_dim, mlp_dim // 2),
            nn.ReLU(),
            nn.Linear(mlp_dim // 2, num_classes),
        )

    @property
    def reads(self) -> slice | None:
        return self.pooler.reads

    def forward(self, hidden: Tensor, tokens: Tokens) -> Tensor:
        rows = hidden.shape[0]
        if rows % 2:
            raise ValueError(
                f"a pair classifier reads 2B rows (first sequences, then second ones), got {rows} rows"
            )
        u, v = self.pooler(hidden, tokens).chunk(2)  # (B, D) each
        x = torch.cat([u, v, u * v, u - v] if self.interaction == "nli" else [u, v], -1)
        return self.mlp(x)
