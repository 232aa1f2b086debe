"""Fine-tuning a timm ViT checkpoint from a recipe: position embeddings resampled to the data's image
size, the patch embedding adapted to grayscale, a new classifier, layer-wise LR decay and a frozen
first epoch; then the fine-tuned model exported back to timm's layout, which timm loads."""

import pytest
import torch

from mmformer.cli import main
from tests.conftest import make_image_folder

timm = pytest.importorskip("timm")

RECIPE = """\
name: timm_ft
model:
  tokenizers: {{image: {{kind: pretrained, source: {src}, image_size: 16, in_chans: 1}}}}
  backbone: {{kind: pretrained, source: {src}}}
  heads: {{cls: {{kind: pretrained, source: {src}, num_classes: 2}}}}
tasks:
  toy:
    kind: classification
    tokenizer: image
    head: cls
    data: {{kind: image_folder, root: {root}, batch_size: 4, num_workers: 0}}
optim: {{lr: 1e-2, warmup_steps: 0, layer_decay: 0.75, freeze_pretrained_epochs: 1}}
trainer: {{max_epochs: {epochs}, accelerator: cpu, devices: 1, log_every_n_steps: 1,
          enable_progress_bar: false, num_sanity_val_steps: 0}}
logger: {{mode: disabled}}
"""


def _train(workdir, src, epochs, capsys):
    root = make_image_folder(workdir / "imgs", n_per_class=4, size=16)
    recipe = workdir / f"ft{epochs}.yaml"
    recipe.write_text(RECIPE.format(src=src, root=root, epochs=epochs))
    assert main(["train", str(recipe)]) == 0
    out = capsys.readouterr().out
    run = out.split("run folder: ")[1].split()[0]
    ckpt = sorted((workdir / run / "checkpoints").glob("last*.ckpt"))[0]
    return ckpt, out


def test_timm_checkpoint_fine_tunes_with_a_frozen_first_epoch_and_exports(workdir, timm_source, capsys):
    from safetensors.torch import load_file

    source = load_file(str(timm_source / "model.safetensors"))
    ckpt, out = _train(workdir, timm_source, 1, capsys)
    assert "resized  pos_embed: [1, 17, 48] → [1, 5, 48]" in out  # 4×4 grid → 2×2 grid, class token kept
    assert "resized  patch_embed.proj.weight: [48, 3, 8, 8] → [48, 1, 8, 8]" in out
    assert "new      head.weight" in out and "ignored  head.weight [5, 48]" in out
    sd = torch.load(ckpt, weights_only=True)["state_dict"]
    block = "blocks.1.mlp.fc2.weight"
    assert torch.equal(sd[f"model.backbone.{block}"], source[block])  # frozen in epoch 0
    assert torch.count_nonzero(sd["model.heads.cls.head.weight"]) > 0  # the new head trained

    ckpt, _ = _train(workdir, timm_source, 2, capsys)
    sd = torch.load(ckpt, weights_only=True)["state_dict"]
    assert not torch.equal(sd[f"model.backbone.{block}"], source[block])  # unfrozen in epoch 1

    export = workdir / "export"
    assert main(["export", str(ckpt), str(export)]) == 0
    assert "local-dir" in capsys.readouterr().out
    ref = timm.create_model(f"local-dir:{export}", pretrained=True).eval()
    assert ref.patch_embed.proj.in_channels == 1 and ref.num_classes == 2
    from mmformer.evaluation import load_checkpoint

    loaded, _ = load_checkpoint(ckpt, "classification")
    pixels = torch.randint(0, 256, (3, 1, 16, 16), dtype=torch.uint8)
    mean, std = ref.pretrained_cfg["mean"][0] * 255, ref.pretrained_cfg["std"][0] * 255
    with torch.no_grad():
        ours = loaded.model(pixels, "image", "cls")
        theirs = ref((pixels.float() - mean) / std)  # timm's own normalisation from its config
    torch.testing.assert_close(ours, theirs, atol=1e-5, rtol=1e-5)


def test_recipe_mistakes_with_pretrained_images_are_named(workdir, timm_source, capsys):
    root = make_image_folder(workdir / "imgs", n_per_class=2, size=16)
    recipe = workdir / "bad.yaml"
    recipe.write_text(
        RECIPE.format(src=timm_source, root=root, epochs=1).replace("image_size: 16", "image_size: 20")
    )
    assert main(["train", str(recipe)]) == 2
    assert "not divisible by" in capsys.readouterr().err


def test_a_gradient_reaching_a_frozen_part_is_dropped_before_the_step():
    """The safeguard of ``FreezePretrained``: torch 2.14's DDP and FSDP2 give frozen parameters no
    gradient (the FSDP2 fine-tune test passes with or without it), but a gradient one still receives is
    dropped before the optimizer step and clipping, so AdamW (which would decay and move it) skips it."""
    from torch import nn

    from mmformer.training.freeze import FreezePretrained

    model = nn.ModuleDict({"backbone": nn.Linear(3, 3), "head": nn.Linear(3, 1)})
    trainer = type("T", (), {"current_epoch": 0})()
    callback = FreezePretrained(1, lambda m: [m["backbone"]])
    callback.on_train_start(trainer, model)
    before = model["backbone"].weight.detach().clone()
    model["backbone"].weight.grad = torch.ones(3, 3)  # as if a strategy had produced one
    model["head"](model["backbone"](torch.randn(4, 3))).sum().backward()
    opt = torch.optim.AdamW(model.parameters(), lr=0.1, weight_decay=0.1)
    callback.on_before_optimizer_step(trainer, model, opt)
    opt.step()
    assert torch.equal(model["backbone"].weight, before) and model["head"].weight.grad is not None
    trainer.current_epoch = 1
    callback.on_train_epoch_start(trainer, model)
    assert model["backbone"].weight.requires_grad


def _build_head(src, num_classes=None):
    """The recipe's ``heads: {cls: {kind: pretrained, source: src, num_classes: …}}`` through its builder,
    and the model the recipe composes from the same source (its tokenizer and backbone, that head)."""
    from mmformer.components.context import BuildContext
    from mmformer.components.heads import PretrainedHeadConfig, build_pretrained_head
    from mmformer.models import MultimodalModel

    ctx = BuildContext(None)
    head = build_pretrained_head(
        PretrainedHeadConfig(source=str(src), num_classes=num_classes), 48, None, ctx
    )
    pretrained = ctx.pretrained(str(src))
    model = MultimodalModel(dict(pretrained.model.tokenizers), pretrained.model.backbone, {"cls": head})
    return model.eval(), pretrained.report


def _randomised(**kwargs):
    from tests.conftest import TINY_VIT

    torch.manual_seed(0)
    ref = timm.create_model("vit_tiny_patch16_224", pretrained=False, **{**TINY_VIT, **kwargs})
    for p in ref.parameters():  # timm zero-inits heads: randomise everything
        torch.nn.init.normal_(p, std=0.05)
    return ref.eval()


def _save(ref, out, rename=lambda k: k, **model_args):
    from safetensors.torch import load_file, save_file

    from tests.conftest import TINY_VIT, save_timm_dir

    src = save_timm_dir(ref, out, {**TINY_VIT, **model_args})
    sd = load_file(str(src / "model.safetensors"))
    save_file({rename(k): v for k, v in sd.items()}, str(src / "model.safetensors"))
    return src


def test_pretrained_head_of_a_head_fc_file_gives_timms_logits(workdir):
    """timm's ``ClassifierHead`` layout (``head.fc.*``; made by renaming a VisionTransformer's ``head.*``:
    no timm ViT builds its head from ClassifierHead) is the classifier to reuse."""
    ref = _randomised(num_classes=5, global_pool="avg")
    to_fc = lambda k: f"head.fc.{k[5:]}" if k.startswith("head.") else k  # noqa: E731
    src = _save(ref, workdir / "head_fc", to_fc, global_pool="avg")
    model, _ = _build_head(src)
    x = torch.randn(3, 3, 32, 32, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.testing.assert_close(model(x, "image", "cls"), ref(x), atol=1e-5, rtol=1e-5)


def test_pretrained_head_of_a_headless_file_is_a_new_zero_classifier(workdir):
    ref = _randomised(num_classes=0, global_pool="avg")  # a feature-extractor export: no head.* keys
    src = _save(ref, workdir / "headless", global_pool="avg")
    model, report = _build_head(src, num_classes=5)
    head = model.heads["cls"]
    assert head.head.weight.shape == (5, 48) and torch.count_nonzero(head.head.weight) == 0
    assert torch.count_nonzero(head.head.bias) == 0
    assert torch.equal(head.fc_norm.weight, ref.fc_norm.weight)  # the file's fc_norm, loaded
    x = torch.randn(3, 3, 32, 32, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert torch.equal(model(x, "image", "cls"), torch.zeros(3, 5))
    printed = str(report)
    assert (
        "new      head.weight" in printed
        and "no classifier: a new zero-initialised one for 5 classes" in printed
    )


def test_pretrained_head_that_cannot_be_found_names_the_keys_seen(workdir):
    from mmformer.errors import RecipeError

    src = _save(_randomised(num_classes=0), workdir / "headless")
    with pytest.raises(
        RecipeError, match=r"no classifier to reuse \(no head\.\* keys in the file\).*num_classes"
    ):
        _build_head(src)
    odd = lambda k: f"head.linear.{k[5:]}" if k.startswith("head.") else k  # noqa: E731
    src = _save(_randomised(num_classes=5), workdir / "odd", odd)
    with pytest.raises(
        RecipeError, match=r"head-like keys in the file: head\.linear\.bias, head\.linear\.weight"
    ):
        _build_head(src)
    model, _ = _build_head(src, num_classes=3)  # a new classifier replaces whatever was there
    assert torch.count_nonzero(model.heads["cls"].head.weight) == 0
