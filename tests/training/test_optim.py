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


# ---------------------------------------------------------------------------- timm's optimizers
def _loss(model: MultimodalModel) -> torch.Tensor:
    torch.manual_seed(1)
    x, y = torch.randn(4, 1, 28, 28), torch.tensor([0, 1, 2, 1])
    return torch.nn.functional.cross_entropy(model(x, "image", "h"), y)


def _reference(name: str, groups: list[dict], lr: float, wd: float) -> torch.optim.Optimizer:
    """timm's optimizer class built directly (timm's registry defaults written out) on ``groups``."""
    import timm.optim

    return {
        "sgd": lambda: torch.optim.SGD(groups, lr=lr, weight_decay=wd, momentum=0.9, nesterov=True),
        "lion": lambda: timm.optim.Lion(groups, lr=lr, weight_decay=wd),
        "lamb": lambda: timm.optim.Lamb(groups, lr=lr, weight_decay=wd),
        "adafactor": lambda: timm.optim.Adafactor(groups, lr=lr, weight_decay=wd),
        "adan": lambda: timm.optim.Adan(groups, lr=lr, weight_decay=wd, no_prox=False),
        "lars": lambda: timm.optim.Lars(groups, lr=lr, weight_decay=wd, momentum=0.9),
        "rmsprop": lambda: torch.optim.RMSprop(groups, lr=lr, weight_decay=wd, momentum=0.9, alpha=0.9),
        "nadamw": lambda: timm.optim.NAdamW(groups, lr=lr, weight_decay=wd),
    }[name]()


@pytest.mark.parametrize("name", ["sgd", "lion", "lamb", "adafactor", "adan", "lars", "rmsprop", "nadamw"])
def test_timm_optimizer_keeps_groups_and_steps_like_timm_on_them(name):
    from mmformer.recipe import OptimConfig
    from mmformer.training.optim import build_optimizer

    cfg = OptimConfig(name=name, lr=1e-2, weight_decay=0.1, layer_decay=0.5)
    model, ref = _vit(), _vit()
    opt = build_optimizer(model, cfg)
    assert type(opt) is type(_reference(name, param_groups(_vit(), 0.1, 0.5), 1e-2, 0.1))
    names = {id(p): n for n, p in model.named_parameters()}
    by_name = {names[id(p)]: g for g in opt.param_groups for p in g["params"]}
    # the no-decay groups: norms, biases, position embedding, class token (layer 0 of L + 1 = 3)
    for n in (
        "backbone.blocks.0.norm1.weight",
        "backbone.blocks.1.attn.qkv.bias",
        "tokenizers.image.cls_token",
    ):
        assert by_name[n]["weight_decay"] == 0.0, n
    assert by_name["backbone.blocks.1.attn.qkv.weight"]["weight_decay"] == 0.1
    # layer decay: heads at the full LR, block 1 at 0.5, block 0 at 0.25, embeddings at 0.125
    assert by_name["heads.h.head.weight"]["lr"] == pytest.approx(1e-2)
    assert by_name["backbone.blocks.1.mlp.fc1.weight"]["lr"] == pytest.approx(5e-3)
    assert by_name["backbone.blocks.0.mlp.fc1.weight"]["lr"] == pytest.approx(2.5e-3)
    assert by_name["tokenizers.image.pos_embed"]["lr"] == pytest.approx(1.25e-3)

    groups = param_groups(ref, 0.1, 0.5)
    for g in groups:
        g["lr"] = 1e-2 * g["lr_scale"]
    ref_opt = _reference(name, groups, 1e-2, 0.1)
    start = [p.detach().clone() for p in model.parameters()]
    for m, o in ((model, opt), (ref, ref_opt)):
        for _ in range(2):
            o.zero_grad()
            _loss(m).backward()
            o.step()
    moved = max((p.detach() - s).abs().max() for p, s in zip(model.parameters(), start))
    assert moved > 1e-4
    for (n, p), q in zip(model.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p, q, rtol=0, atol=0, msg=n)


def test_sgd_and_lion_first_step_closed_form_no_decay_on_norms():
    """SGD (Nesterov, momentum 0.9): the first step moves ``p`` by ``-lr·1.9·(g + wd·p)``; Lion (Chen et al.
    2023, Alg. 2): by ``-lr·(sign(g) + wd·p)``; with ``wd = 0`` on the no-decay group."""
    from mmformer.recipe import OptimConfig
    from mmformer.training.optim import build_optimizer

    lr, wd = 1e-2, 0.5
    for name in ("sgd", "lion"):
        model = _vit()
        opt = build_optimizer(model, OptimConfig(name=name, lr=lr, weight_decay=wd))
        _loss(model).backward()
        before = {n: (p.detach().clone(), p.grad.clone()) for n, p in model.named_parameters()}
        opt.step()
        for n, decay in (("backbone.blocks.0.norm1.weight", 0.0), ("backbone.blocks.0.attn.qkv.weight", wd)):
            p0, g = before[n]
            step = 1.9 * (g + decay * p0) if name == "sgd" else torch.sign(g) + decay * p0
            torch.testing.assert_close(model.get_parameter(n).detach(), p0 - lr * step, msg=f"{name} {n}")


def test_optimizer_options_reach_the_optimizer_and_its_own_defaults_stay():
    from mmformer.recipe import OptimConfig
    from mmformer.training.optim import build_optimizer

    lion = build_optimizer(_vit(), OptimConfig(name="lion"))
    assert lion.defaults["betas"] == (0.9, 0.99)  # Lion's own, not AdamW's (0.9, 0.999)
    lion = build_optimizer(_vit(), OptimConfig(name="lion", betas=[0.95, 0.98], implementation="for-loop"))
    assert lion.defaults["betas"] == (0.95, 0.98) and lion.defaults["foreach"] is False
    sgd = build_optimizer(_vit(), OptimConfig(name="sgd", momentum=0.5, opt_args={"nesterov": False}))
    assert (sgd.defaults["momentum"], sgd.defaults["nesterov"]) == (0.5, False)
    assert build_optimizer(_vit(), OptimConfig(name="sgd")).defaults["momentum"] == 0.9  # timm's default
    lamb = build_optimizer(_vit(), OptimConfig(name="lamb", eps=1e-5, opt_args={"trust_clip": True}))
    assert lamb.defaults["eps"] == 1e-5 and lamb.defaults["trust_clip"] is True
    adamw = build_optimizer(_vit(), OptimConfig())
    assert type(adamw) is torch.optim.AdamW and adamw.defaults["eps"] == 1e-8 and adamw.defaults["fused"]


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"name": "lino"}, r"optim.name='lino' is not an optimizer timm lists. Did you mean 'lion'\?"),
        ({"name": "adafacter"}, r"Did you mean 'adafactor'\?"),
        ({"name": "bnbadamw8bit"}, r"needs bitsandbytes and CUDA"),
        ({"name": "adahessian"}, r"second-order"),
        ({"name": "sgd", "betas": [0.8, 0.9]}, r"optim.betas does not apply to optim.name='sgd'"),
        ({"name": "lion", "eps": 1e-6}, r"optim.eps does not apply to optim.name='lion'"),
        ({"momentum": 0.9}, r"optim.momentum does not apply to optim.name='adamw'"),
        ({"name": "adan", "betas": [0.9, 0.9]}, r"optim.betas needs 3 values for adan"),
        (
            {"name": "sgd", "opt_args": {"nesterv": False}},
            r"opt_args.nesterv .*SGD.*Did you mean 'nesterov'\?",
        ),
        ({"name": "sgd", "opt_args": {"lr": 1.0}}, r"optim.opt_args.lr: set optim.lr instead"),
        ({"name": "adafactor", "implementation": "foreach"}, r"implementation='foreach' does not apply"),
        ({"schedule": "cosin"}, r"Did you mean 'cosine'\?"),
        ({"schedule": "step"}, r"schedule=step needs step_size"),
    ],
)
def test_bad_optimizer_options_name_the_key(kwargs, message):
    from mmformer.recipe import OptimConfig

    with pytest.raises(ValueError, match=message):
        OptimConfig(**kwargs)


def test_unknown_optimizer_in_an_override_is_a_recipe_error(tiny_recipe):
    from mmformer.recipe import RecipeError, load_recipe

    with pytest.raises(RecipeError, match=r"optim.*'lino'.*Did you mean 'lion'\?"):
        load_recipe(tiny_recipe, ["optim.name=lino"])
    recipe = load_recipe(
        tiny_recipe, ["optim.name=sgd", "optim.momentum=0.8", "optim.opt_args={nesterov: false}"]
    )
    assert (recipe.optim.name, recipe.optim.momentum, recipe.optim.opt_args) == (
        "sgd",
        0.8,
        {"nesterov": False},
    )


# ---------------------------------------------------------------------------- timm's schedule shapes
def _timm_lrs(sched_cls, steps: int, **kwargs) -> list[float]:
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    sched = sched_cls(opt, warmup_prefix=True, t_in_epochs=False, **kwargs)
    out = []
    for t in range(steps):
        sched.step_update(t)
        out.append(opt.param_groups[0]["lr"])
    return out


def test_poly_and_step_schedules_match_timm_after_warmup():
    from timm.scheduler import PolyLRScheduler, StepLRScheduler

    total, warm = 50, 5
    poly = _timm_lrs(PolyLRScheduler, total, t_initial=total - warm, power=0.7, lr_min=0.1, warmup_t=warm)
    step = _timm_lrs(StepLRScheduler, total, decay_t=8, decay_rate=0.5, warmup_t=warm)
    for t in range(warm, total):
        assert lr_factor(t, total, warm, "poly", 0.1, power=0.7) == pytest.approx(poly[t]), t
        assert lr_factor(t, total, warm, "step", 0.0, step_size=8, gamma=0.5) == pytest.approx(step[t]), t
    assert lr_factor(4, total, warm, "step", 0.0, step_size=8, gamma=0.5) == pytest.approx(1.0)  # warmup end
    assert lr_factor(warm + 8, total, warm, "step", 0.0, step_size=8, gamma=0.5) == 0.5
    assert lr_factor(warm + 40, total, warm, "step", 0.1, step_size=8, gamma=0.5) == 0.1  # floored at min_lr
    assert lr_factor(total, total, warm, "poly", 0.1, power=0.7) == pytest.approx(0.1)


def test_scheduler_passes_the_shape_keys():
    from mmformer.recipe import OptimConfig

    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=2.0)
    sched = build_scheduler(
        opt, OptimConfig(lr=2.0, schedule="step", step_size=3, gamma=0.25), total_steps=10
    )
    lrs = []
    for _ in range(7):
        lrs.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    assert lrs == [2.0, 2.0, 2.0, 0.5, 0.5, 0.5, 0.125]


# ---------------------------------------------------------------------------- runs with timm's optimizers
def test_cli_trains_with_lion(tiny_recipe, workdir):
    from mmformer.cli import main

    args = ["train", str(tiny_recipe), "optim.name=lion", "trainer.max_steps=2", "trainer.max_epochs=-1"]
    assert main(args) == 0
    (last,) = (workdir / "runs" / "tiny").glob("*/checkpoints/last.ckpt")
    ckpt = torch.load(last, map_location="cpu", weights_only=True)
    assert ckpt["global_step"] == 2 and "name: lion" in ckpt["mmformer"]["recipe_yaml"]
    (state,) = ckpt["optimizer_states"]
    moments = next(iter(state["state"].values()))
    assert set(moments) == {"exp_avg"}  # Lion keeps one moment (AdamW would add exp_avg_sq and step)
    assert {g["name"] for g in state["param_groups"]} >= {"decay", "no_decay"}
    assert state["param_groups"][0]["betas"] == (0.9, 0.99)


def test_bf16_mixed_clips_the_gradients_of_the_fused_adamw(tiny_recipe, workdir):
    """bf16 autocast has no GradScaler: the fused AdamW's "I unscale myself" flag must not make Lightning
    refuse to clip (it did: every bf16-mixed recipe with the default optimizer and clipping stopped)."""
    import lightning as L

    from mmformer.commands.train import train
    from mmformer.recipe import load_recipe

    class SeeClipping(L.Callback):
        def on_before_optimizer_step(self, trainer, pl_module, optimizer):
            self.fused = optimizer.defaults.get("fused")
            self.clipped = trainer.gradient_clip_val

    seen = SeeClipping()
    overrides = ["trainer.precision=bf16-mixed", "trainer.max_steps=2", "trainer.max_epochs=-1"]
    trainer, _ = train(load_recipe(tiny_recipe, overrides), extra_callbacks=[seen])
    assert trainer.global_step == 2 and seen.fused is True and seen.clipped == 1.0


@pytest.mark.parametrize("name", ["lion", "adafactor", "lamb", "sgd"])
def test_optimizer_and_schedule_state_round_trip_exactly(name):
    """4 steps = 2 steps, ``state_dict`` of optimizer and schedule, both loaded into fresh ones on a
    fresh model holding the saved weights, 2 more steps (what a checkpoint resume does)."""
    from mmformer.recipe import OptimConfig
    from mmformer.training.optim import build_optimizer

    cfg = OptimConfig(name=name, lr=1e-2, warmup_steps=1, layer_decay=0.8, schedule="poly", power=0.9)

    def run(model, steps, state=None):
        opt = build_optimizer(model, cfg)
        sched = build_scheduler(opt, cfg, total_steps=5)  # its last LR is not 0
        if state is not None:
            opt.load_state_dict(state[0])
            sched.load_state_dict(state[1])
        for _ in range(steps):
            opt.zero_grad()
            _loss(model).backward()
            opt.step()
            sched.step()
        return opt, sched

    full = _vit()
    run(full, 4)
    part = _vit()
    opt, sched = run(part, 2)
    saved = (opt.state_dict(), sched.state_dict(), {k: v.clone() for k, v in part.state_dict().items()})
    resumed = _vit(seed=5)
    resumed.load_state_dict(saved[2])
    opt, _ = run(resumed, 2, saved)
    assert opt.param_groups[0]["lr"] == pytest.approx(
        1e-2 * 0.8**3 * lr_factor(4, 5, 1, "poly", 0.0, power=0.9)
    )
    for (n, p), q in zip(full.named_parameters(), resumed.parameters()):
        torch.testing.assert_close(q, p, rtol=0, atol=0, msg=n)


@pytest.mark.slow  # three short training runs: ~15-35 s on 2 busy cores
def test_lion_stop_and_resume_equals_uninterrupted(tiny_recipe, workdir):
    """Train N steps = train k, stop (SIGTERM writes last.ckpt), resume, train N - k: Lion's moment, the
    LR schedule and the weights continue exactly."""
    from mmformer.commands.train import train
    from mmformer.recipe import load_recipe
    from mmformer.training.preemption import Preempted
    from tests.training.test_exact_resume import PreemptAtStep, _weights

    base = ["optim.name=lion", "optim.lr=1e-3", "optim.weight_decay=0.1", "optim.layer_decay=0.7"]
    full, _ = train(load_recipe(tiny_recipe, [*base, "name=full"]))
    assert full.global_step == 8  # 2 epochs of 4 batches
    with pytest.raises(Preempted):
        train(load_recipe(tiny_recipe, [*base, "name=part"]), [PreemptAtStep(2)])
    (last,) = (workdir / "runs" / "part").glob("*/checkpoints/last.ckpt")
    assert 2 <= torch.load(last, map_location="cpu", weights_only=True)["global_step"] < 4  # inside epoch 0
    resumed, _ = train(load_recipe(tiny_recipe, [*base, "name=part", "resume=auto"]))
    assert resumed.global_step == 8
    opt_full, opt_resumed = full.optimizers[0], resumed.optimizers[0]
    assert type(opt_resumed).__name__ == "Lion"
    assert [g["lr"] for g in opt_resumed.param_groups] == pytest.approx(
        [g["lr"] for g in opt_full.param_groups]
    )
    w_full, w_resumed = _weights(full), _weights(resumed)
    for k, v in w_full.items():
        torch.testing.assert_close(w_resumed[k], v, atol=1e-6, rtol=0, msg=k)
    moments = [opt_full.state[p]["exp_avg"] for g in opt_full.param_groups for p in g["params"]]
    again = [opt_resumed.state[p]["exp_avg"] for g in opt_resumed.param_groups for p in g["params"]]
    for m, a in zip(moments, again):
        torch.testing.assert_close(a, m, atol=1e-6, rtol=0)


@pytest.mark.slow  # every optimizer timm lists (~85), two steps each: minutes on busy cores
def test_every_listed_optimizer_builds_steps_and_round_trips_its_state():
    from mmformer.recipe import OptimConfig
    from mmformer.training.optim import build_optimizer, optimizer_names

    names = optimizer_names()
    assert {"sgd", "lion", "lamb", "adafactor", "adan", "muon", "kron"} <= set(names)
    assert not any(n.startswith(("bnb", "fused")) or n == "adahessian" for n in names)
    for name in names:
        model = _vit()
        opt = build_optimizer(model, OptimConfig(name=name, lr=1e-3, layer_decay=0.9))
        start = [p.detach().clone() for p in model.parameters()]
        for _ in range(2):  # ADOPT's first step only initialises its second moment (Taniguchi et al. 2024)
            opt.zero_grad()
            _loss(model).backward()
            opt.step()
        opt.load_state_dict(opt.state_dict())
        moved = max((p.detach() - s).abs().max().item() for p, s in zip(model.parameters(), start))
        assert 0 < moved < 1 and all(torch.isfinite(p).all() for p in model.parameters()), name
