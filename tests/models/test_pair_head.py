"""The two-tower pair classifier (``mmformer.models.PairClassifierHead``): each pair's logits are LRA's
dual head of its own two pooled sequences, whatever else is in the batch and however they are padded."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from mmformer.models import PairClassifierHead
from mmformer.nn.tokens import Tokens


def tokens(valid: torch.Tensor, d: int = 8) -> Tokens:
    return Tokens.from_embeddings(torch.zeros(*valid.shape, d), 0, valid)


def lra_dual_head(head: PairClassifierHead, u: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """``ClassifierHeadDual`` of lra_benchmarks, written out: NLI interaction, Dense → ReLU → Dense(mlp/2)
    → ReLU → Dense(K)."""
    l1, l2, l3 = (m for m in head.mlp if isinstance(m, torch.nn.Linear))
    x = torch.cat([u, v, u * v, u - v], -1)
    x = F.relu(x @ l1.weight.T + l1.bias)
    x = F.relu(x @ l2.weight.T + l2.bias)
    return x @ l3.weight.T + l3.bias


def test_logits_are_lras_dual_head_of_each_pairs_masked_means():
    torch.manual_seed(0)
    head = PairClassifierHead(8, 3, pool="mean", mlp_dim=16)
    assert [m.out_features for m in head.mlp if isinstance(m, torch.nn.Linear)] == [16, 8, 3]
    lengths = [5, 2, 7, 3]  # rows 0–1: the pairs' first sequences; rows 2–3: their second ones
    hidden = torch.randn(4, 7, 8)
    valid = torch.arange(7) < torch.tensor(lengths)[:, None]
    got = head(hidden, tokens(valid))
    means = torch.stack([hidden[i, :n].mean(0) for i, n in enumerate(lengths)])
    want = lra_dual_head(head, means[:2], means[2:])
    torch.testing.assert_close(got, want)
    hidden[~valid] = 1e6  # padding never read
    torch.testing.assert_close(head(hidden, tokens(valid)), got)


def test_each_pair_alone_equals_the_batch_and_order_matters():
    torch.manual_seed(0)
    head = PairClassifierHead(8, 2, mlp_dim=16)
    hidden = torch.randn(6, 4, 8)
    valid = torch.ones(6, 4, dtype=torch.bool)
    batch = head(hidden, tokens(valid))
    for i in range(3):
        alone = head(hidden[[i, 3 + i]], tokens(valid[[i, 3 + i]]))
        torch.testing.assert_close(alone[0], batch[i])
    swapped = head(hidden[[3, 4, 5, 0, 1, 2]], tokens(valid))  # u − v changes sign: another input
    assert not torch.allclose(swapped, batch)


def test_cls_pooling_concat_interaction_and_what_is_refused():
    torch.manual_seed(0)
    head = PairClassifierHead(8, 2, pool="cls", num_prefix_tokens=1, interaction="concat", mlp_dim=4)
    assert head.reads == slice(0, 1) and head.mlp[0].in_features == 16
    hidden = torch.randn(2, 5, 8)
    got = head(hidden[:, :1], tokens(torch.ones(2, 1, dtype=torch.bool)))  # the rows `reads` asks for
    l1, l2, l3 = (m for m in head.mlp if isinstance(m, torch.nn.Linear))
    x = torch.cat([hidden[0, 0], hidden[1, 0]])[None]
    torch.testing.assert_close(got, l3(F.relu(l2(F.relu(l1(x))))))
    with pytest.raises(ValueError, match="2B rows .* got 3 rows"):
        head(torch.randn(3, 1, 8), tokens(torch.ones(3, 1, dtype=torch.bool)))
    with pytest.raises(ValueError, match="class token"):
        PairClassifierHead(8, 2, pool="cls", num_prefix_tokens=0)
    with pytest.raises(ValueError, match="interaction"):
        PairClassifierHead(8, 2, interaction="dot")
