"""Whisper tiny.en fine-tuned whole (``recipes/multimodal/whisper_tiny_finetune_asr_asterisk.yaml``): the
recipe builds the whole pretrained model part by part (encoder tower, cross-attention decoder as the
backbone, Whisper's text tokenizer with its prompt, tied LM head) with exactly ``load_whisper``'s
weights; its seq2seq task transcribes a real recording token for token as ``load_whisper`` + the bench's
decoding path (``bench/whisper_asr.py``); its training targets are the transcript after Whisper's prompt
plus ``<|endoftext|>``; a training step moves encoder and decoder (LoRA: the adapters alone); recipe
mistakes name the key to fix."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from mmformer.build import build_model, build_module
from mmformer.components import BuildContext
from mmformer.errors import RecipeError
from mmformer.models.pretrained import resolve_pretrained
from mmformer.models.pretrained.whisper import WHISPER, load_whisper, whisper_prompt
from mmformer.recipe import load_recipe
from mmformer.tasks.language_model import IGNORE
from mmformer.tasks.prefix_lm import caption_targets
from mmformer.tokenizers.audio import AudioPreprocess
from mmformer.tokenizers.text import TextTokenizer

ROOT = Path(__file__).parents[2]
RECIPE = ROOT / "recipes/multimodal/whisper_tiny_finetune_asr_asterisk.yaml"
LORA = ROOT / "recipes/multimodal/whisper_tiny_lora_asr_asterisk.yaml"
CLIPS = ["/usr/share/asterisk/sounds/en/agent-loggedoff.wav", "/usr/share/asterisk/sounds/en/digits/7.wav"]


@pytest.fixture(scope="module")
def whisper_dir():
    try:
        return resolve_pretrained("whisper-tiny.en")
    except FileNotFoundError as e:  # `make install` installs it; the error names the command
        pytest.skip(str(e))


@pytest.fixture(scope="module")
def built(whisper_dir):
    """(recipe, build context, model, seq2seq task) of the fine-tuning recipe, fp32, eval mode."""
    recipe = load_recipe(RECIPE)
    ctx = BuildContext(recipe)
    model = build_model(recipe, ctx)
    module = build_module(recipe, model, ctx)
    return recipe, ctx, model.eval(), module.tasks["asr"]


@pytest.fixture(scope="module")
def reference(whisper_dir):
    model, tok, config = load_whisper(whisper_dir)
    return model.eval(), tok, config


def _clips():
    if not all(os.path.isfile(c) for c in CLIPS):
        pytest.skip("needs the Asterisk recordings (apt-get install asterisk-core-sounds-en-wav)")
    waves = [AudioPreprocess(16_000, 30.0).load(c) for c in CLIPS]  # the task's data side (val)
    audio = torch.zeros(len(waves), max(len(w) for w in waves))
    valid = torch.zeros(audio.shape, dtype=torch.bool)
    for i, w in enumerate(waves):
        audio[i, : len(w)], valid[i, : len(w)] = w, True
    return audio, valid


@pytest.mark.slow  # builds the whole pretrained model (~12 s on 2 cores)
def test_recipe_builds_whole_whisper_with_load_whispers_weights(built, reference):
    _, ctx, model, _ = built
    ref, tok, config = reference
    ours, theirs = model.state_dict(), ref.state_dict()
    assert sorted(ours) == sorted(theirs) and len(ours) == 140
    assert all(torch.equal(ours[k], theirs[k]) for k in theirs)
    assert model.heads["lm"].head.weight is model.tokenizers["text"].embed.weight  # tied, as Whisper
    assert len(model.towers["audio"].blocks) == 4 and not model.towers["audio"].causal  # the encoder
    assert len(model.backbone.blocks) == 4 and model.backbone.causal  # the decoder
    assert model.tokenizers["audio"].pad_to == 480_000  # 30 s at 16 kHz
    assert sum(p.numel() for p in model.parameters() if p.requires_grad) == 37_188_864
    assert ctx.text_tokenizer("text").start_ids == whisper_prompt(tok, config) == [50257, 50362]


@pytest.mark.slow  # builds the whole pretrained model (~12 s on 2 cores)
def test_task_decodes_with_whispers_prompt_and_suppression(built, reference):
    _, _, _, task = built
    _, _, config = reference
    assert task.start_ids == [50257, 50362] and task.prompt_len == 2
    assert task.suppress == config["suppress_ids"] and len(task.suppress) == 90
    assert task.suppress_begin == [220, 50256] and task.max_new_tokens == 64


@pytest.mark.slow  # builds the whole pretrained model (~12 s on 2 cores)
def test_task_transcript_equals_load_whisper_and_the_bench_path_token_for_token(built, reference):
    _, _, model, task = built
    ref, tok, config = reference
    audio, valid = _clips()
    # the bench's path (bench/whisper_asr.py): load_whisper, clips zero-padded to 30 s, WHISPER.generate
    waves = torch.zeros(len(CLIPS), 480_000)
    waves[:, : audio.shape[1]] = audio * valid
    want = WHISPER.generate(
        ref,
        waves,
        whisper_prompt(tok, config),
        tok.eos_id,
        64,
        suppress=config["suppress_ids"],
        suppress_begin=config["suppress_ids_begin"],
    )
    # the task's: the recipe's model on the clips as the data side gives them (padded to the longest)
    got = task.parts.generate(
        model, audio, task.start_ids, task.text.eos_id, task.max_new_tokens, 1, 1.0, valid,
        task.suppress, task.suppress_begin,
    )  # fmt: skip
    assert got == want
    assert tok.decode(want[0], skip_special=True).strip() == "Agent-log-dov."  # pretrained: one of its errors
    texts = task.transcribe(model, audio, valid)
    assert [t.strip() for t in texts] == [tok.decode(w, skip_special=True).strip() for w in want]


@pytest.mark.slow  # builds the whole pretrained model (~12 s on 2 cores)
def test_training_targets_are_the_transcript_after_the_prompt_and_end_of_text(built):
    _, ctx, _, task = built
    tok = ctx.text_tokenizer("text")
    ids = tok.encode("Agent logged off.", bos=True, eos=True)
    text = tok.tokenizer.encode(" Agent logged off.", add_special_tokens=False).ids  # Whisper's leading space
    assert ids == [50257, 50362, *text, 50256]
    caption = torch.tensor([ids])
    targets = caption_targets(caption, torch.ones_like(caption, dtype=torch.bool), task.prompt_len)
    assert targets[0, 0].item() == IGNORE and targets[0, 1:].tolist() == [*text, 50256]
    again = TextTokenizer.from_json(tok.to_json())  # a checkpoint keeps the prompt and the leading space
    assert again.encode("Agent logged off.", bos=True, eos=True) == ids


def _batch(ctx):
    audio, valid = _clips()
    tok = ctx.text_tokenizer("text")
    ids, ids_valid = tok.pad_batch(tok.encode_batch(["Agent logged off.", "Seven."], bos=True, eos=True))
    return {"audio": audio, "audio_valid": valid, "caption": ids, "caption_valid": ids_valid}


def _step(model, task, batch, lr):
    model.train()
    trainable = {n: p for n, p in model.named_parameters() if p.requires_grad}
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    opt = torch.optim.AdamW(trainable.values(), lr=lr)
    loss = task.training_loss(model, batch)
    loss.backward()
    opt.step()
    moved = {n for n, p in model.named_parameters() if not torch.equal(p, before[n])}
    return float(loss.detach()), moved


@pytest.mark.slow
def test_one_training_step_moves_encoder_and_decoder(whisper_dir):
    recipe = load_recipe(RECIPE)
    ctx = BuildContext(recipe)
    model = build_model(recipe, ctx)
    task = build_module(recipe, model, ctx).tasks["asr"]
    loss, moved = _step(model, task, _batch(ctx), 1e-5)
    assert 0.05 < loss < 2.0  # the pretrained model already transcribes these clips
    assert any(n.startswith("towers.audio.blocks.") for n in moved)  # the encoder
    assert any(n.startswith("tokenizers.audio.conv") for n in moved)  # its conv stem
    assert any(".cross_attn." in n for n in moved) and "tokenizers.text.embed.weight" in moved  # decoder


@pytest.mark.slow
def test_lora_recipe_adapts_encoder_and_decoder_only(whisper_dir):
    recipe = load_recipe(LORA)
    ctx = BuildContext(recipe)
    model = build_model(recipe, ctx)
    task = build_module(recipe, model, ctx).tasks["asr"]
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    assert trainable and all(".lora_" in n for n in trainable)
    assert sum(p.numel() for n, p in model.named_parameters() if p.requires_grad) == 958_464
    for stack in (
        "towers.audio.blocks.0.attn.qkv",
        "backbone.blocks.0.cross_attn.q",
        "backbone.blocks.3.mlp.fc2",
    ):
        assert f"{stack}.lora_A.weight" in trainable
    _, moved = _step(model, task, _batch(ctx), 1e-3)
    assert moved and all(".lora_" in n for n in moved)


def test_seq2seq_with_a_pretrained_backbone_needs_its_decoder(whisper_dir):
    with pytest.raises(RecipeError, match="part: decoder"):
        load_recipe(RECIPE, ["model.backbone.part=null"])
    with pytest.raises(RecipeError, match="choose encoder or decoder"):
        load_recipe(RECIPE, ["model.backbone.part=middle"])


@pytest.mark.slow  # builds the whole pretrained model (~12 s on 2 cores)
def test_a_checkpoints_pinned_parts_rebuild_the_whole_whisper_without_its_files(built, reference):
    recipe, ctx, model, _ = built
    _, _, config = reference
    text = TextTokenizer.from_json(ctx.text_tokenizer("text").to_json())  # as a checkpoint carries them
    pinned = BuildContext(recipe, {"text": text}, ctx.pretrained_configs())
    assert (
        pinned.pretrained_configs() == {} and ctx.pretrained_configs()["whisper-tiny.en"]["config"] == config
    )
    rebuilt = build_model(recipe, pinned)
    task = build_module(recipe, rebuilt, pinned).tasks["asr"]
    shapes = {k: v.shape for k, v in model.state_dict().items()}
    assert {k: v.shape for k, v in rebuilt.state_dict().items()} == shapes
    assert task.start_ids == [50257, 50362] and task.suppress == config["suppress_ids"]
