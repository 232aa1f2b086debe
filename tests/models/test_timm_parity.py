"""Our ViT (tokenizer + backbone + classifier head) equals timm's VisionTransformer when timm's
state dict is mapped onto it by prefixes alone — the names and the math are timm's."""

import pytest
import torch

from mmformer.models import AttentionConfig, ClassifierHead, MultimodalModel, build_backbone
from mmformer.models.pretrained.timm_vit import timm_to_mmformer
from mmformer.tokenizers import ViTPatchTokenizer
from tests.conftest import TINY_VIT


@pytest.mark.parametrize("pool", ["token", "avg"])
def test_vit_matches_timm(pool):
    pytest.importorskip("timm")
    from timm.models.vision_transformer import VisionTransformer

    torch.manual_seed(0)
    ref = VisionTransformer(**TINY_VIT, in_chans=3, num_classes=5, global_pool=pool).eval()
    for p in ref.parameters():  # timm zero-inits nothing we would miss: randomise everything
        torch.nn.init.normal_(p, std=0.05)
    avg = pool == "avg"
    ours = MultimodalModel(
        {"image": ViTPatchTokenizer(48, 32, 8, 3)},
        build_backbone(48, 2, AttentionConfig(3), final_norm=not avg),
        {"cls": ClassifierHead(48, 5, pool="mean" if avg else "cls", fc_norm=avg)},
    ).eval()
    missing, unexpected = ours.load_state_dict(timm_to_mmformer(ref.state_dict()), strict=True)
    assert not missing and not unexpected
    x = torch.randn(4, 3, 32, 32)
    with torch.no_grad():
        torch.testing.assert_close(ours(x, "image", "cls"), ref(x), atol=1e-5, rtol=1e-5)
