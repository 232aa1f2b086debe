"""Mask rules give exactly the expected patterns (True = may attend)."""

import torch

from mmformer.models.backbone import modality_spans
from mmformer.nn import MaskSpec


def _grid(spec, n, nk=None):
    return spec.dense(n, nk)[0, 0].int().tolist()


def test_prefix_lm_pattern():
    span = torch.tensor([[1, 1, 0, 0]])
    assert _grid(MaskSpec(causal=True, span=span), 4) == [
        [1, 1, 0, 0],
        [1, 1, 0, 0],
        [1, 1, 1, 0],
        [1, 1, 1, 1],
    ]


def test_modality_span_inside_causal_text():
    span = torch.tensor([[0, 1, 1, 0]])  # text, image, image, text
    assert _grid(MaskSpec(causal=True, span=span), 4) == [
        [1, 0, 0, 0],
        [1, 1, 1, 0],
        [1, 1, 1, 0],
        [1, 1, 1, 1],
    ]


def test_documents_are_block_diagonal_and_causal_inside():
    doc = torch.tensor([[0, 0, 1, 1]])
    assert _grid(MaskSpec(causal=True, document=doc), 4) == [
        [1, 0, 0, 0],
        [1, 1, 0, 0],
        [0, 0, 1, 0],
        [0, 0, 1, 1],
    ]


def test_sliding_window():
    assert _grid(MaskSpec(causal=True, window=2), 4) == [
        [1, 0, 0, 0],
        [1, 1, 0, 0],
        [0, 1, 1, 0],
        [0, 0, 1, 1],
    ]


def test_queries_shorter_than_keys_align_to_the_end():
    # two new tokens after three cached ones: query 0 is key position 3
    assert _grid(MaskSpec(causal=True, q_offset=3), 2, 5) == [
        [1, 1, 1, 1, 0],
        [1, 1, 1, 1, 1],
    ]


def test_fast_paths_are_recognised():
    valid = torch.ones(2, 4, dtype=torch.bool)
    doc = torch.zeros(2, 4, dtype=torch.long)
    assert MaskSpec.from_tokens(valid, doc, causal=False).is_full
    assert MaskSpec.from_tokens(valid, doc, causal=True).is_causal_only
    assert not MaskSpec.from_tokens(valid, doc, causal=True, q_offset=2).is_causal_only
    valid[0, 0] = False
    assert not MaskSpec.from_tokens(valid, doc, causal=False).is_full


def test_modality_spans_number_each_run():
    text, image, audio = 0, 1, 2
    modality = torch.tensor([[text, image, image, text, image, audio, audio, text]])
    spans = modality_spans(modality, (image, audio))
    assert spans[0].tolist() == [0, 1, 1, 0, 2, 3, 3, 0]
    assert modality_spans(modality, ()) is None
