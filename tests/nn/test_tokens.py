"""Tokens: defaults, shape checks, concatenation of every field."""

import pytest
import torch

from mmformer.nn import MODALITY_IDS, Tokens, cat_tokens


def test_defaults_fill_every_field():
    t = Tokens.from_embeddings(torch.zeros(2, 3, 8), MODALITY_IDS["image"], n_pos_axes=2)
    assert t.valid.all() and t.valid.dtype == torch.bool
    assert t.positions.shape == (2, 3, 2) and t.positions[0, :, 0].tolist() == [0, 1, 2]
    assert t.document.eq(0).all() and t.modality.eq(MODALITY_IDS["image"]).all()


def test_cat_concatenates_every_field():
    a = Tokens.from_embeddings(torch.zeros(2, 3, 8), 1)
    b = Tokens.from_embeddings(torch.ones(2, 4, 8), 0, valid=torch.tensor([[1, 1, 0, 0]] * 2).bool())
    c = cat_tokens([a, b])
    assert c.x.shape == (2, 7, 8) and c.modality[0].tolist() == [1, 1, 1, 0, 0, 0, 0]
    assert c.valid[0].tolist() == [True] * 5 + [False] * 2


def test_shape_errors():
    with pytest.raises(ValueError, match="valid"):
        Tokens(
            torch.zeros(2, 3, 8),
            torch.ones(2, 4, dtype=torch.bool),
            torch.zeros(2, 3, 1).long(),
            torch.zeros(2, 3).long(),
            torch.zeros(2, 3).long(),
        )
    with pytest.raises(ValueError, match="batch size"):
        cat_tokens(
            [Tokens.from_embeddings(torch.zeros(2, 3, 8), 1), Tokens.from_embeddings(torch.zeros(3, 3, 8), 1)]
        )


def test_left_padded_rows_count_positions_from_their_first_real_token():
    valid = torch.tensor([[False, False, True, True, True], [True, True, True, True, True]])
    t = Tokens.from_embeddings(torch.zeros(2, 5, 8), 0, valid=valid)
    assert t.positions[0, :, 0].tolist() == [0, 0, 0, 1, 2]
    assert t.positions[1, :, 0].tolist() == [0, 1, 2, 3, 4]
