"""Every recipe rule runs when the recipe loads: ``mmformer info`` and ``mmformer train`` give the same
verdict on the same recipe and overrides, and ``train`` refuses before any data is touched (no dataset
is prepared, no run folder is opened)."""

from __future__ import annotations

from pathlib import Path

import pytest

from mmformer import cli

RECIPES = Path(__file__).resolve().parents[1] / "recipes"
DIT = RECIPES / "diffusion" / "dit_classcond_mnist5k.yaml"
MLM = RECIPES / "text" / "bert_mini_mlm_kjv.yaml"
CLIP = RECIPES / "multimodal" / "clip_emoji.yaml"
CAPTION = RECIPES / "multimodal" / "vit_prefixlm_caption_emoji.yaml"
ENCDEC = RECIPES / "multimodal" / "encdec_asr_asterisk.yaml"
VIT = RECIPES / "image" / "vit_tiny_classify_mnist5k.yaml"
FINETUNE = RECIPES / "image" / "vit_tiny_finetune_digits.yaml"
VIT_DATA = (
    "data: {kind: image_folder, root: mnist5k, batch_size: 128, num_workers: 0, cache: true, crop_padding: 2}"
)

# Each case: a recipe and one change — a ``key=value`` override, or ``OLD -> NEW`` in the recipe's text
# (to swap a whole part: overrides merge into the node they name).
REJECTED = [
    (DIT, "model.backbone.block=pre", "conditions through adaLN: set model.backbone.block: adaln"),
    (DIT, "model.backbone.d_cond=64", "the DiT tokenizer's conditioning has d_model width"),
    (DIT, "tasks.digits.num_timesteps=500", "apply to objective: gaussian, not flow"),
    (DIT, "model.tokenizers.image.class_dropout=0", "classifier-free guidance (sample_cfg_scale != 1)"),
    (
        DIT,
        "model.heads.velocity={kind: classifier, num_classes: 10}",
        "needs a tokenizer and a head of kind dit",
    ),
    (MLM, "model.backbone.causal=true", "a masked_lm task needs a bidirectional backbone"),
    (CLIP, "model.heads.caption_embed.embed_dim=128", "must share one embed_dim"),
    (
        CLIP,
        "tasks.emoji.data.max_len=32",
        "data.max_len=32 exceeds the caption tokenizer's learned positions",
    ),
    (CAPTION, "model.backbone.causal=false", "a prefix_lm task generates text"),
    (
        CAPTION,
        "image: {kind: vit_patch, image_size: 32, patch_size: 4, in_chans: 3, class_token: false}"
        " -> image: {kind: bpe}",
        "cannot be a prefix: a prefix_lm task reads images or audio",
    ),
    (ENCDEC, "model.backbone.block=pre", "set model.backbone.block: cross and causal: true"),
    (ENCDEC, "model.towers.audio.d_model=128", "set model.backbone.d_context: 128"),
    (
        VIT,
        f"{VIT_DATA} -> data: {{kind: shards, root: mnist5k, pack: true}}",
        "'tasks.mnist.data.pack' packs text",
    ),
    (
        VIT,
        "{kind: classifier, num_classes: 10, pool: mean, fc_norm: true} -> {kind: lm}",
        "an 'lm' head needs a task",
    ),
    (VIT, "model.lora={rank: 4}", "'model.lora' adapts pretrained weights"),
    (VIT, "optim.freeze_pretrained_epochs=1", "this model has none"),
    (VIT, "trainer.precision=16-mixed", "set optim.implementation=foreach"),
    (
        FINETUNE,
        "freeze_pretrained_epochs: 2}\ntrainer: {max_epochs: 30, validate_first: true} -> "
        "freeze_pretrained_epochs: 2, name: lion}\ntrainer: {max_epochs: 30, strategy: fsdp2}",
        "optim.freeze_pretrained_epochs with optim.name='lion' is not supported under trainer.strategy: fsdp2",
    ),
    (VIT, f"{VIT_DATA} -> data: {{kind: audio_caption, root: x}}", "read by a task with a caption_tokenizer"),
    (VIT, "tasks.mnist.head=digit", "Did you mean 'digits'"),
    (VIT, "optim.lr_max=1", "unknown recipe key 'optim.lr_max'"),
]


@pytest.mark.parametrize(("recipe", "override", "message"), REJECTED, ids=[o for _, o, _ in REJECTED])
def test_info_and_train_refuse_alike_before_touching_data(recipe, override, message, workdir, capsys):
    if " -> " in override:
        old, new = override.split(" -> ")
        assert old in recipe.read_text()
        edited = workdir / "recipes" / recipe.name
        edited.parent.mkdir(exist_ok=True)
        edited.write_text(recipe.read_text().replace(old, new))
        recipe, overrides = edited, []
    else:
        overrides = [override]
    verdicts = []
    for command in ("info", "train"):
        code = cli.main([command, str(recipe), *overrides, "logger.mode=disabled"])
        verdicts.append((code, capsys.readouterr().err.strip()))
    (info_code, info_err), (train_code, train_err) = verdicts
    assert info_code == train_code == 2
    assert info_err == train_err and info_err.startswith("mmformer: error: ")
    assert message in info_err
    assert not (workdir / "data").exists() and not (workdir / "runs").exists()  # nothing prepared or opened


def test_accepted_recipes_are_accepted_by_both(workdir):
    """The other side of the agreement: a recipe that loads is not refused by a later check."""
    from mmformer.recipe import load_recipe

    for recipe in sorted(RECIPES.glob("*/*.yaml")):
        load_recipe(recipe)  # every rule runs here; nothing raises for the shipped recipes
