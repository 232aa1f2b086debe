"""What an export says about itself is true: the timm ``config.json`` names the timm architecture whose
sizes the model has (never ``vit_base_patch16_224`` for a 0.8 M-parameter ViT), its ``model_args`` carry
the real sizes timm rebuilds it from, and every exported file has a normal file's permissions."""

from __future__ import annotations

import json
import os

import pytest
import torch

timm = pytest.importorskip("timm")

from mmformer.models import AttentionConfig, ClassifierHead, MultimodalModel, build_backbone  # noqa: E402
from mmformer.models.pretrained.timm_export import (  # noqa: E402
    VIT_FAMILIES,
    save_timm_vit,
    timm_vit_names,
    vit_config,
)
from mmformer.tokenizers import ViTPatchTokenizer  # noqa: E402


def _vit(d=48, depth=2, heads=3, image=32, patch=8):
    torch.manual_seed(0)
    return MultimodalModel(
        {"image": ViTPatchTokenizer(d, image, patch, 3)},
        build_backbone(d, depth, AttentionConfig(heads)),
        {"cls": ClassifierHead(d, 6)},
    ).eval()


def _params(module) -> int:
    return sum(p.numel() for p in module.parameters())


def test_a_tiny_vit_is_not_called_a_base_vit_and_timm_rebuilds_its_sizes(tmp_path):
    ours = _vit()
    out = save_timm_vit(ours, vit_config(ours), tmp_path / "export")
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["architecture"] == "vit_tiny_patch16_224"  # the nearest timm ViT; model_args resize it
    args = cfg["model_args"]
    assert (args["embed_dim"], args["depth"], args["num_heads"], args["patch_size"]) == (48, 2, 3, 8)
    assert args["img_size"] == [32, 32]  # timm's save_for_hf records the current (H, W)
    ref = timm.create_model(f"local-dir:{out}", pretrained=True)
    assert _params(ref) == _params(ours) < 100_000
    assert (ref.embed_dim, len(ref.blocks), ref.blocks[0].attn.num_heads) == (48, 2, 3)


def test_a_vit_of_a_timm_size_is_named_after_it(tmp_path):
    ours = _vit(d=192, depth=12, heads=3, image=224, patch=16)
    out = save_timm_vit(ours, vit_config(ours), tmp_path / "export")
    assert json.loads((out / "config.json").read_text())["architecture"] == "vit_tiny_patch16_224"
    assert _params(timm.create_model(f"local-dir:{out}", pretrained=True)) == _params(ours)


def test_a_vit_of_a_timm_family_at_another_patch_size_is_named_by_its_family(tmp_path):
    ours = _vit(d=384, depth=1, heads=6, image=64, patch=32)
    out = save_timm_vit(ours, vit_config(ours), tmp_path / "export")
    assert json.loads((out / "config.json").read_text())["architecture"] == "vit_small_patch32_224"


def test_the_named_sizes_are_timms_own():
    """Each timm name the exporter may write, built by timm (on the meta device): the sizes it claims."""
    for name, (family, patch, image) in timm_vit_names().items():
        with torch.device("meta"):
            m = timm.create_model(name)
        width, depth, heads, hidden = VIT_FAMILIES[family]
        got = (m.embed_dim, len(m.blocks), m.blocks[0].attn.num_heads, m.blocks[0].mlp.fc1.out_features)
        assert got == (width, depth, heads, hidden), name
        assert (m.patch_embed.patch_size, m.patch_embed.img_size) == ((patch, patch), (image, image)), name


@pytest.fixture(params=[0o022, 0o027])
def umask(request):
    old = os.umask(request.param)
    yield request.param
    os.umask(old)


def test_exported_files_have_a_normal_files_permissions(tmp_path, umask):
    from mmformer.models.pretrained.llama import build_llama, save_hf_llama
    from tests.conftest import TINY_LLAMA

    want = 0o666 & ~umask
    ours = _vit()
    out = save_timm_vit(ours, vit_config(ours), tmp_path / "timm")
    llama = save_hf_llama(build_llama(TINY_LLAMA), dict(TINY_LLAMA), tmp_path / "llama")
    for path in (
        out / "model.safetensors",
        out / "config.json",
        llama / "model.safetensors",
        llama / "config.json",
    ):
        assert oct(path.stat().st_mode & 0o777) == oct(want), path


def test_a_safetensors_export_has_a_normal_files_permissions(tmp_path, umask):
    from mmformer.training.sharded import export_safetensors

    torch.save(
        {"state_dict": {"model.w": torch.ones(3)}, "mmformer": {"recipe_yaml": "name: x\n"}},
        tmp_path / "c.ckpt",
    )
    assert export_safetensors(tmp_path / "c.ckpt", tmp_path / "out.safetensors") == 1
    assert oct((tmp_path / "out.safetensors").stat().st_mode & 0o777) == oct(0o666 & ~umask)
