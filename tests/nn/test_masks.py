"""Mask rules give exactly the expected patterns (True = may attend)."""

import pytest
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


@pytest.mark.parametrize("dtype", [torch.long, torch.int32, torch.uint8, torch.float32])
def test_masks_that_are_not_bool_are_refused_with_the_convention(dtype):
    """``~`` of an integer 0/1 mask is a bitwise not (``[-2, -1]``), not a logical one: every mask helper
    refuses a non-bool mask instead of inverting it."""
    from mmformer.nn.masks import to_additive, to_ignore

    mask = torch.tensor([[1, 0]], dtype=dtype)
    doc = torch.zeros(1, 2, dtype=torch.long)
    calls = {
        "to_ignore": lambda: to_ignore(mask),
        "to_additive": lambda: to_additive(mask, torch.float32),
        "MaskSpec": lambda: MaskSpec(valid=mask),
        "from_tokens": lambda: MaskSpec.from_tokens(mask, doc, causal=True),
        "sparse_layout": lambda: MaskSpec(sparse_layout=mask, sparse_block=1),
    }
    for name, call in calls.items():
        with pytest.raises(TypeError, match=r"bool.*True = .*\.bool\(\)"):
            call()
            pytest.fail(name)
    assert to_ignore(mask.bool()).tolist() == [[False, True]]


@pytest.mark.parametrize("dtype", [torch.long, torch.float32])
def test_a_model_refuses_a_valid_mask_that_is_not_bool(dtype):
    from mmformer.models import AttentionConfig, MultimodalModel, build_backbone
    from mmformer.models.heads import LMHead
    from mmformer.tokenizers.text import TextEmbedding

    model = MultimodalModel(
        {"text": TextEmbedding(20, 16)}, build_backbone(16, 1, AttentionConfig(2)), {"lm": LMHead(16, 20)}
    )
    ids = torch.ones(1, 3, dtype=torch.long)
    with pytest.raises(TypeError, match=r"valid must be a bool mask.*valid\.bool\(\)"):
        model(ids, "text", "lm", valid=torch.tensor([[0, 1, 1]], dtype=dtype))


def test_the_kernels_and_the_text_embedding_refuse_masks_that_are_not_bool():
    # public functions users call directly: an int 0/1 mask would be bit-inverted to -1 / -2 by `~`
    from mmformer.nn.attention import eager_attention
    from mmformer.nn.linear_attention import favor_attention, orthogonal_features
    from mmformer.tokenizers.text import TextEmbedding

    q = k = v = torch.randn(1, 2, 3, 4)
    ones = torch.ones(1, 3, dtype=torch.long)
    with pytest.raises(TypeError, match=r"mask must be a bool mask.*mask\.bool\(\)"):
        eager_attention(q, k, v, ones[:, None, None, :])
    with pytest.raises(TypeError, match=r"key_valid must be a bool mask"):
        favor_attention(q, k, v, orthogonal_features(8, 4), key_valid=ones)
    with pytest.raises(TypeError, match=r"valid must be a bool mask"):
        TextEmbedding(20, 16)(ones, valid=ones)
    torch.testing.assert_close(  # a bool mask of all True is no mask
        eager_attention(q, k, v, ones[:, None, None, :].bool()), eager_attention(q, k, v, None)
    )
