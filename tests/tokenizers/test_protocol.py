"""Every model-side tokenizer satisfies the ``Tokenizer`` protocol and returns ``Tokens`` (a DiT's carry
its conditioning vector: ``ConditionedTokens``), on a tiny input of the shape it asks for."""

from __future__ import annotations

import pytest
import torch

from mmformer.models.resampler import PerceiverResampler, ResampledTokenizer
from mmformer.nn.tokens import MODALITY_IDS, ConditionedTokens, Tokens
from mmformer.tokenizers import TextEmbedding, Tokenizer, ViTPatchTokenizer
from mmformer.tokenizers.audio import ASTPatchTokenizer, LogMel, WhisperConvTokenizer
from mmformer.tokenizers.diffusion import DiTTokenizer

D = 16


def _vit():
    return ViTPatchTokenizer(D, image_size=8, patch_size=4, in_chans=1, mean=(0.5,), std=(0.5,))


def _dit():
    return DiTTokenizer(D, image_size=8, patch_size=4, in_chans=1, num_classes=3)


# every tokenizer a recipe can build (pretrained sources build these same classes)
BUILT_IN = {
    "vit_patch": _vit,
    "bpe": lambda: TextEmbedding(50, D, max_len=32),
    "ast": lambda: ASTPatchTokenizer(D, LogMel(8000, 200, 80, 32), (16, 16), (16, 8), max_frames=31),
    "whisper_conv": lambda: WhisperConvTokenizer(D, n_mels=16, n_ctx=1500),
    "dit": _dit,
    "resampled": lambda: ResampledTokenizer(_vit(), PerceiverResampler(D, num_latents=3, n_heads=2)),
    "resampled_dit": lambda: ResampledTokenizer(_dit(), PerceiverResampler(D, num_latents=3, n_heads=2)),
}


@pytest.mark.parametrize("kind", list(BUILT_IN))
def test_tokenizer_satisfies_the_protocol_and_returns_tokens(kind):
    tok = BUILT_IN[kind]().eval()
    assert isinstance(tok, Tokenizer)
    with torch.no_grad():
        out = tok(tok.example_input(2))
    assert isinstance(out, Tokens) and out.x.shape[0] == 2 and out.x.shape[-1] == D
    assert bool((out.modality == MODALITY_IDS[tok.modality]).all())
    conditioned = kind in ("dit", "resampled_dit")
    assert isinstance(out, ConditionedTokens) == conditioned
    if conditioned:
        assert out.cond.shape == (2, D)


def test_a_module_without_the_members_is_not_a_tokenizer_and_the_model_refuses_it():
    from mmformer.models import AttentionConfig, MultimodalModel, build_backbone

    assert not isinstance(torch.nn.Linear(2, 2), Tokenizer)
    with pytest.raises(TypeError, match="'lin' .*does not satisfy"):
        MultimodalModel(
            {"vit": _vit(), "lin": torch.nn.Linear(2, 2)}, build_backbone(D, 1, AttentionConfig(2)), {}
        )


def test_conditioned_tokens_check_their_cond_and_refuse_concatenation():
    from mmformer.nn.tokens import cat_tokens

    tokens = Tokens.from_embeddings(torch.zeros(2, 3, D), MODALITY_IDS["diffusion"])
    with pytest.raises(ValueError, match="cond must have shape"):
        ConditionedTokens.of(tokens, torch.zeros(3, D))
    with pytest.raises(ValueError, match="not concatenable"):
        cat_tokens([ConditionedTokens.of(tokens, torch.zeros(2, D)), tokens])
