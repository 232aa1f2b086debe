"""timm ViT checkpoints into mmformer and back, checked against timm itself: the same file loaded by
timm (``pretrained_cfg_overlay=dict(file=…)`` / ``local-dir:``) and by mmformer gives the same logits,
including timm's own position-embedding resampling, input-channel adaptation and new heads."""

import pytest
import torch

timm = pytest.importorskip("timm")

from mmformer.models import (  # noqa: E402
    AttentionConfig,
    BlockConfig,
    ClassifierHead,
    MlpConfig,
    MultimodalModel,
    PositionConfig,
    build_backbone,
)
from mmformer.models.pretrained.timm_export import save_timm_vit, vit_config  # noqa: E402
from mmformer.models.pretrained.timm_vit import load_timm_vit  # noqa: E402
from mmformer.tokenizers import ViTPatchTokenizer  # noqa: E402
from tests.conftest import TINY_VIT, save_timm_dir  # noqa: E402


def _randomise(model, seed=0):
    torch.manual_seed(seed)
    for p in model.parameters():  # timm zero-inits heads and layer scales: randomise everything
        torch.nn.init.normal_(p, std=0.05)
    return model.eval()


def _timm_dir(tmp_path, name="vit", **model_args):
    """A checkpoint directory written by timm's own HF exporter (config.json) and safetensors."""
    args = {**TINY_VIT, **model_args}
    ref = _randomise(timm.create_model("vit_tiny_patch16_224", pretrained=False, num_classes=5, **args))
    return ref, save_timm_dir(ref, tmp_path / name, args)


def _pixels(h=32, w=32, c=3, n=3):
    return torch.randn(n, c, h, w, generator=torch.Generator().manual_seed(1))


def _close(ours, ref, x):
    with torch.no_grad():
        torch.testing.assert_close(ours(x, "image", "cls"), ref(x), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize(
    "model_args",
    [
        {},
        {"global_pool": "avg"},
        {"init_values": 0.1, "qkv_bias": False},
        {"class_token": False, "global_pool": "avg"},
    ],
    ids=["token", "avg_fc_norm", "layer_scale_no_qkv_bias", "no_class_token"],
)
def test_timm_directory_loads_with_logit_parity(tmp_path, model_args):
    ref, src = _timm_dir(tmp_path, **model_args)
    ours, config, report = load_timm_vit(src)
    _close(ours, ref, _pixels())
    assert report.new == [] and report.ignored == [] and report.resized == []
    assert config["n_heads"] == 3 and config["num_classes"] == 5
    assert config["mean"] == [0.5, 0.5, 0.5]  # the augreg ViTs' normalisation, from timm's config.json


def test_timm_file_named_after_its_architecture_loads(tmp_path):
    ref = _randomise(timm.create_model("vit_tiny_patch16_224", pretrained=False, num_classes=4))
    wrapped = {"state_dict": {f"module.{k}": v for k, v in ref.state_dict().items()}}  # a DDP training file
    path = tmp_path / "vit_tiny_patch16_224.augreg_in21k_ft_in1k.pth"
    torch.save(wrapped, path)
    ours, config, _ = load_timm_vit(path)
    assert (config["d_model"], config["n_layers"], config["n_heads"]) == (192, 12, 3)
    _close(ours, ref, _pixels(224, 224, n=2))


@pytest.mark.parametrize("size", [48, (32, 48)], ids=["square", "non_square"])
def test_new_image_size_resamples_like_timm(tmp_path, size):
    _, src = _timm_dir(tmp_path)
    ref = timm.create_model(f"local-dir:{src}", pretrained=True, img_size=size).eval()
    ours, _, report = load_timm_vit(src, image_size=size)
    h, w = (size, size) if isinstance(size, int) else size
    _close(ours, ref, _pixels(h, w))
    ((name, old, new, how),) = report.resized
    assert name == "pos_embed" and old == (1, 17, 48) and new == (1, 1 + (h // 8) * (w // 8), 48)
    assert "class token kept" in how and "pos_embed" in str(report)


def test_grayscale_input_adapts_the_patch_embedding_like_timm(tmp_path):
    _, src = _timm_dir(tmp_path)
    ref = timm.create_model(f"local-dir:{src}", pretrained=True, in_chans=1).eval()
    ours, config, report = load_timm_vit(src, in_chans=1)
    _close(ours, ref, _pixels(c=1))
    assert config["in_chans"] == 1 and len(config["mean"]) == 1
    assert report.resized[0][:3] == ("patch_embed.proj.weight", (48, 3, 8, 8), (48, 1, 8, 8))


def test_new_head_is_reported_and_the_rest_matches(tmp_path):
    ref, src = _timm_dir(tmp_path)
    ours, _, report = load_timm_vit(src, num_classes=7)
    assert sorted(report.new) == ["head.bias", "head.weight"]
    assert any(i.startswith("head.weight [5, 48]") for i in report.ignored)
    assert torch.count_nonzero(ours.heads["cls"].head.weight) == 0  # a fresh (zero-initialised) head
    ref.reset_classifier(7)
    with torch.no_grad():
        ours.heads["cls"].head.weight.copy_(ref.head.weight)
        ours.heads["cls"].head.bias.copy_(ref.head.bias)
    _close(ours, ref.eval(), _pixels())


@pytest.mark.parametrize("pool", ["cls", "mean"])
def test_export_to_timm_layout_loads_in_timm(tmp_path, pool):
    torch.manual_seed(0)
    avg = pool == "mean"
    ours = MultimodalModel(
        {"image": ViTPatchTokenizer(48, (32, 24), 8, 1, mean=(0.5,), std=(0.25,))},
        build_backbone(48, 2, AttentionConfig(3), final_norm=not avg),
        {"cls": ClassifierHead(48, 6, pool=pool, fc_norm=avg)},
    )
    _randomise(ours)
    out = save_timm_vit(ours, vit_config(ours), tmp_path / "export")
    ref = timm.create_model(f"local-dir:{out}", pretrained=True).eval()
    _close(ours, ref, _pixels(32, 24, c=1))
    assert tuple(ref.pretrained_cfg["mean"]) == (0.5,) and tuple(ref.pretrained_cfg["std"]) == (0.25,)
    back, _, _ = load_timm_vit(out)
    _close(back, ref, _pixels(32, 24, c=1))


def test_unsupported_checkpoints_are_named(tmp_path):
    with pytest.raises(ValueError, match="name the file after it"):
        (tmp_path / "weights.safetensors").write_bytes(b"")
        load_timm_vit(tmp_path / "weights.safetensors")
    _, src = _timm_dir(tmp_path, reg_tokens=2)
    with pytest.raises(ValueError, match="register tokens"):
        load_timm_vit(src)
    _, src = _timm_dir(tmp_path, name="qk", qk_norm=True)
    with pytest.raises(ValueError, match="QK-norm"):
        load_timm_vit(src)
    with pytest.raises(FileNotFoundError):
        load_timm_vit(tmp_path / "nope")


def test_gray_checkpoint_adapted_to_rgb_sees_a_replicated_gray_image_alike(tmp_path):
    _, src = _timm_dir(tmp_path, in_chans=1)
    gray, _, _ = load_timm_vit(src)
    rgb, config, report = load_timm_vit(src, in_chans=3)
    assert config["in_chans"] == 3 and "repeated" in report.resized[0][3]
    x = _pixels(c=1)
    with torch.no_grad():
        torch.testing.assert_close(rgb(x.repeat(1, 3, 1, 1), "image", "cls"), gray(x, "image", "cls"))


def test_a_file_takes_its_normalisation_from_timm_by_tag(tmp_path):
    ref = _randomise(timm.create_model("vit_small_patch16_224", pretrained=False))
    sd = {k: v.contiguous() for k, v in ref.state_dict().items()}
    from safetensors.torch import save_file

    for name, mean in (("vit_small_patch16_224.dino", 0.485), ("vit_small_patch16_224", 0.5)):
        save_file(sd, str(tmp_path / f"{name}.safetensors"))
        _, config, _ = load_timm_vit(tmp_path / f"{name}.safetensors")
        assert config["mean"][0] == pytest.approx(mean), name  # timm's pretrained_cfg for that tag
    save_file(sd, str(tmp_path / "vit_small_patch16_224.mine.safetensors"))
    with pytest.raises(ValueError, match="normalisation"):
        load_timm_vit(tmp_path / "vit_small_patch16_224.mine.safetensors")


def test_weights_of_parts_mmformer_lacks_are_refused_not_dropped(tmp_path):
    from safetensors.torch import load_file, save_file

    _, src = _timm_dir(tmp_path)
    sd = load_file(str(src / "model.safetensors"))
    sd["blocks.0.attn.norm.weight"] = torch.ones(48)  # e.g. a BEiT-3 style sub-norm
    save_file(sd, str(src / "model.safetensors"))
    with pytest.raises(ValueError, match="no place for: blocks.0.attn.norm.weight"):
        load_timm_vit(src)


def test_export_refuses_what_timm_cannot_express(tmp_path):
    refused = (
        ({"block": BlockConfig("post")}, "pre-norm Block"),
        ({"positions": PositionConfig("rope")}, "positions"),
    )
    for kwargs, message in refused:
        model = MultimodalModel(
            {"image": ViTPatchTokenizer(48, 32, 8, 3)},
            build_backbone(48, 2, AttentionConfig(3), **kwargs),
            {"cls": ClassifierHead(48, 2)},
        )
        with pytest.raises(ValueError, match=message):
            vit_config(model)
    model = MultimodalModel(
        {"image": ViTPatchTokenizer(48, 32, 8, 3)},
        # 115 / 48 is not exact in floating point
        build_backbone(48, 2, AttentionConfig(3), mlp=MlpConfig(hidden=115)),
        {"cls": ClassifierHead(48, 2)},
    )
    _randomise(model)
    out = save_timm_vit(model, vit_config(model), tmp_path / "odd")
    ref = timm.create_model(f"local-dir:{out}", pretrained=True).eval()
    _close(model, ref, _pixels())


def _rename_head_fc(src):
    """``src``'s classifier moved from ``head.*`` to ``head.fc.*``: the layout of timm's ``ClassifierHead``
    / ``NormMlpClassifierHead``. No timm VisionTransformer builds its head from them (``head`` is a plain
    Linear), so this layout (a checkpoint converted from such a model) is made by renaming the file's keys."""
    from safetensors.torch import load_file, save_file

    sd = load_file(str(src / "model.safetensors"))
    sd = {(f"head.fc.{k[5:]}" if k.startswith("head.") else k): v for k, v in sd.items()}
    save_file(sd, str(src / "model.safetensors"))
    return src


@pytest.mark.parametrize("model_args", [{}, {"global_pool": "avg"}], ids=["token", "avg_fc_norm"])
def test_a_head_fc_layout_loads_its_classifier_with_logit_parity(tmp_path, model_args):
    from mmformer.models.pretrained.timm_vit import describe_timm_vit

    ref, src = _timm_dir(tmp_path, **model_args)
    _rename_head_fc(src)
    assert describe_timm_vit(src)["num_classes"] == 5  # from the file's header alone
    ours, config, report = load_timm_vit(src)
    _close(ours, ref, _pixels())
    assert config["num_classes"] == 5 and report.new == [] and report.ignored == []
    assert report.head_keys == ["head.fc.bias", "head.fc.weight"]


def test_a_headless_file_loads_as_timm_features_and_takes_a_new_zero_classifier(tmp_path):
    """A feature-extractor export (``num_classes=0``: no ``head.*``, its ``fc_norm`` kept): mmformer's
    model gives timm's pooled features; asked for 5 classes it adds a zero-initialised classifier after
    the file's own ``fc_norm``."""
    args = {**TINY_VIT, "global_pool": "avg"}
    ref = _randomise(timm.create_model("vit_tiny_patch16_224", pretrained=False, num_classes=0, **args))
    src = save_timm_dir(ref, tmp_path / "headless", args)
    features, config, report = load_timm_vit(src)
    assert config["num_classes"] == 0 and report.ignored == [] and report.head_keys == []
    _close(features, ref, _pixels())  # (B, 48) pooled features, as timm's forward
    ours, config, report = load_timm_vit(src, num_classes=5)
    head = ours.heads["cls"]
    assert config["num_classes"] == 5 and sorted(report.new) == ["head.bias", "head.weight"]
    assert torch.count_nonzero(head.head.weight) == 0 and torch.count_nonzero(head.head.bias) == 0
    assert torch.equal(head.fc_norm.weight, ref.fc_norm.weight)  # the file's, not a fresh LayerNorm
    assert "no classifier: a new zero-initialised one for 5 classes" in str(report)
    with torch.no_grad():
        assert torch.equal(ours(_pixels(), "image", "cls"), torch.zeros(3, 5))


def test_a_head_mmformer_cannot_express_is_not_taken_for_a_classifier(tmp_path):
    """``NormMlpClassifierHead``'s layout (a norm before ``head.fc``): loading ``head.fc`` alone would drop
    the norm and change every logit, so no classifier is loaded and the keys are reported."""
    from safetensors.torch import load_file, save_file

    from mmformer.models.pretrained.timm_vit import describe_timm_vit

    _, src = _timm_dir(tmp_path)
    _rename_head_fc(src)
    sd = load_file(str(src / "model.safetensors"))
    sd["head.norm.weight"], sd["head.norm.bias"] = torch.ones(48), torch.zeros(48)
    save_file(sd, str(src / "model.safetensors"))
    assert describe_timm_vit(src)["num_classes"] == 0
    ours, config, report = load_timm_vit(src)
    assert config["num_classes"] == 0
    assert report.head_keys == ["head.fc.bias", "head.fc.weight", "head.norm.bias", "head.norm.weight"]
    assert sorted(report.ignored) == report.head_keys
