"""Optimizer groups and the LR schedule, exact values."""

import math

import pytest
import torch

from mmformer.models import AttentionConfig, ClassifierHead, MultimodalModel, build_backbone
from mmformer.tokenizers import ViTPatchTokenizer
from mmformer.training.optim import build_scheduler, lr_factor, param_groups


def test_no_decay_on_norms_biases_pos_embed_and_cls_token():
    model = MultimodalModel(
        {"image": ViTPatchTokenizer(32, 28, 7, 1)},
        build_backbone(32, 2, AttentionConfig(2)),
        {"h": ClassifierHead(32, 3)},
    )
    decay, no_decay = param_groups(model, 0.05)
    names = {id(p): n for n, p in model.named_parameters()}
    no_decay_names = {names[id(p)] for p in no_decay["params"]}
    decay_names = {names[id(p)] for p in decay["params"]}
    assert {
        "tokenizers.image.pos_embed",
        "tokenizers.image.cls_token",
        "backbone.norm.weight",
        "backbone.blocks.0.norm1.weight",
        "backbone.blocks.0.attn.qkv.bias",
    } <= no_decay_names
    assert {
        "backbone.blocks.0.attn.qkv.weight",
        "tokenizers.image.patch_embed.proj.weight",
        "heads.h.head.weight",
    } <= decay_names
    assert decay["weight_decay"] == 0.05 and no_decay["weight_decay"] == 0.0
    assert len(decay_names) + len(no_decay_names) == len(list(model.parameters()))


def test_warmup_then_cosine_exact():
    assert lr_factor(0, 100, 10, "cosine", 0.0) == pytest.approx(0.1)
    assert lr_factor(9, 100, 10, "cosine", 0.0) == pytest.approx(1.0)
    assert lr_factor(10, 100, 10, "cosine", 0.0) == pytest.approx(1.0)
    assert lr_factor(55, 100, 10, "cosine", 0.0) == pytest.approx(0.5)
    assert lr_factor(100, 100, 10, "cosine", 0.1) == pytest.approx(0.1)
    assert lr_factor(40, 100, 10, "cosine", 0.0) == pytest.approx(0.5 * (1 + math.cos(math.pi * 30 / 90)))
    assert lr_factor(55, 100, 10, "linear", 0.0) == pytest.approx(0.5)
    assert lr_factor(99, 100, 0, "constant", 0.0) == 1.0


def test_scheduler_drives_optimizer_lr():
    from mmformer.recipe import OptimConfig

    p = torch.nn.Parameter(torch.zeros(2, 2))
    cfg = OptimConfig(lr=1e-2, warmup_steps=4, min_lr=1e-3)
    opt = torch.optim.AdamW([p], lr=cfg.lr)
    sched = build_scheduler(opt, cfg, total_steps=20)
    lrs = []
    for _ in range(20):
        lrs.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    assert lrs[0] == pytest.approx(2.5e-3) and lrs[3] == pytest.approx(1e-2)
    assert lrs[-1] > 1e-3 and opt.param_groups[0]["lr"] == pytest.approx(1e-3)


def test_layer_decay_scales_lr_by_depth_and_skips_frozen_parameters():
    from mmformer.models.pretrained.llama import build_llama
    from mmformer.training.optim import build_optimizer

    model = build_llama(
        dict(hidden_size=16, num_hidden_layers=3, num_attention_heads=2, intermediate_size=32, vocab_size=20)
    )
    model.backbone.blocks[0].requires_grad_(False)

    class Cfg:
        lr, weight_decay, betas, eps, layer_decay = 1.0, 0.1, (0.9, 0.99), 1e-8, 0.5

    opt = build_optimizer(model, Cfg)
    lr_of = {id(p): g["lr"] for g in opt.param_groups for p in g["params"]}
    assert lr_of[id(model.tokenizers.text.embed.weight)] == 0.5**4  # embeddings: depth 0 of L + 1 = 4
    assert id(model.backbone.blocks[0].attn.qkv.weight) not in lr_of  # frozen: not optimised at all
    assert lr_of[id(model.backbone.blocks[1].attn.qkv.weight)] == 0.5**2
    assert lr_of[id(model.backbone.blocks[2].mlp.fc1.weight)] == 0.5
    assert lr_of[id(model.backbone.norm.weight)] == 1.0
    decay = {id(p) for g in opt.param_groups if g["weight_decay"] > 0 for p in g["params"]}
    assert (
        id(model.backbone.norm.weight) not in decay and id(model.backbone.blocks[2].mlp.fc1.weight) in decay
    )


def _vit(seed: int = 0) -> MultimodalModel:
    torch.manual_seed(seed)
    return MultimodalModel(
        {"image": ViTPatchTokenizer(32, 28, 7, 1)},
        build_backbone(32, 2, AttentionConfig(2)),
        {"h": ClassifierHead(32, 3)},
    )


def test_fused_adamw_is_the_default_and_updates_as_the_reference_loop():
    from mmformer.recipe import OptimConfig
    from mmformer.training.optim import build_optimizer

    x, y = torch.randn(4, 1, 28, 28), torch.tensor([0, 1, 2, 1])
    finals = {}
    for impl in ("fused", "foreach", "for-loop"):
        model = _vit()
        cfg = OptimConfig(lr=1e-2, implementation=impl)
        opt = build_optimizer(model, cfg)
        assert opt.defaults["fused"] is (True if impl == "fused" else None)
        assert opt.defaults["foreach"] is {"fused": None, "foreach": True, "for-loop": False}[impl]
        for _ in range(3):
            opt.zero_grad()
            torch.nn.functional.cross_entropy(model(x, "image", "h"), y).backward()
            opt.step()
        finals[impl] = torch.cat([p.detach().flatten() for p in model.parameters()])
    assert OptimConfig().implementation == "fused"
    moved = (finals["for-loop"] - torch.cat([p.flatten() for p in _vit().parameters()])).abs().max()
    assert moved > 1e-3  # the steps did change the weights
    for impl in ("fused", "foreach"):
        # the same AdamW: entries agree to float rounding, except where a gradient is ~eps-sized and the
        # rounding of m / (√v + eps) shows (a step moves an entry by at most ~LR, so never more than that)
        diff = (finals[impl] - finals["for-loop"]).abs()
        assert diff.max() < 1e-2 and diff.median() < 1e-7 and (diff > 1e-6).float().mean() < 0.01
    with pytest.raises(ValueError, match=r"apex.*choose fused \| foreach \| for-loop"):
        OptimConfig(implementation="apex")
