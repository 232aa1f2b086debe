"""The bundled speech datasets keep DATA.md's one fixed split of the real Asterisk recordings."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import soundfile as sf
import torch

from mmformer.data.prepare import BUNDLED
from mmformer.data.speech import (
    _prompt_tts_text,
    asterisk_split,
    asterisk_transcripts,
    build_asterisk_en,
    build_asterisk_prompts,
    build_asterisk_speech,
    prompt_application,
    spoken_word_clips,
)


def _rows(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_prompt_application_and_tts_text():
    assert prompt_application("vm-intro") == "voicemail"
    assert prompt_application("confbridge-join") == prompt_application("conf-onlyperson") == "conference"
    assert prompt_application("dictate/forhelp") == "dictate"
    assert prompt_application("priv-callpending") == prompt_application("privacy-thankyou") == "privacy"
    assert prompt_application("digits/7") is None and prompt_application("activated") is None
    assert _prompt_tts_text("press * to pause, # to exit [beep]") == "press star to pause, pound to exit"


def test_asterisk_split_is_stable():
    # a hash of the name, the same on every machine and run: these values must never change
    assert [asterisk_split(n) for n in ("vm-intro", "agent-pass", "agent-loggedoff", "beep")] == [
        "train",
        "train",
        "test",
        "test",
    ]
    names = [f"prompt-{i}" for i in range(2000)]
    assert 0.67 < sum(asterisk_split(n) == "train" for n in names) / len(names) < 0.73


@pytest.fixture(scope="module")
def asterisk(tmp_path_factory):
    missing = BUNDLED["asterisk-prompts"].missing()
    if missing:
        pytest.skip(missing)
    en, prompts = tmp_path_factory.mktemp("asterisk-en"), tmp_path_factory.mktemp("asterisk-prompts")
    build_asterisk_en(en)
    build_asterisk_prompts(prompts, n_espeak=1, n_flite=1)
    return en, prompts


@pytest.fixture(scope="module")
def speech(asterisk, tmp_path_factory):
    # the same sources as asterisk-prompts (espeak-ng, flite, the recordings): skipped with it
    out = tmp_path_factory.mktemp("asterisk-speech")
    build_asterisk_speech(out, n_espeak=1, n_flite=0)
    return asterisk[0], out


@pytest.mark.slow
def test_asterisk_speech_pairs_follow_the_split_and_render_only_train_transcripts(speech):
    en, out = speech
    en_split = {r["label"]: split for split in ("train", "test") for r in _rows(en / f"{split}.jsonl")}
    train, test = _rows(out / "train.jsonl"), _rows(out / "test.jsonl")
    real_train = [r for r in train if not r["synthetic"]]
    unspoken = {n for n, t in asterisk_transcripts().items() if not _prompt_tts_text(t)}  # stage notes only
    assert {r["name"] for r in real_train} == {n for n, s in en_split.items() if s == "train"} - unspoken
    assert {r["name"] for r in test} <= {n for n, s in en_split.items() if s == "test"}
    assert len(test) >= 220 and not any(r["synthetic"] for r in test)
    synthetic = [r for r in train if r["synthetic"]]
    assert len(synthetic) == len(real_train)  # one rendering each here
    assert sorted(r["name"] for r in synthetic) == sorted(r["name"] for r in real_train)
    assert all((out / r["audio"]).is_file() for r in synthetic)
    assert {sf.info(out / r["audio"]).samplerate for r in synthetic[:8]} == {8000}
    seven = next(r for r in test if r["name"] == "digits/7")
    assert seven["text"].lower().rstrip(".") == "seven"


@pytest.mark.slow
def test_audio_caption_batches_pair_each_clip_with_its_transcript(speech):
    from types import SimpleNamespace

    from mmformer.data.audio_caption import audio_caption_data
    from mmformer.tokenizers.audio import AudioPreprocess
    from mmformer.tokenizers.text import TextTokenizer

    _, out = speech
    texts = [r["text"] for r in _rows(out / "train.jsonl")]
    tok = TextTokenizer.train(texts, vocab_size=300)
    cfg = SimpleNamespace(
        root=str(out),
        train_split="train",
        val_split="test",
        text_key="text",
        max_len=16,
        batch_size=4,
        val_batch_size=None,
        num_workers=0,
        drop_last=True,
    )
    data = audio_caption_data(cfg, (AudioPreprocess(16_000, 4.0), AudioPreprocess(16_000, 4.0)), tok)
    rows = _rows(out / "test.jsonl")
    batch = data.collate([data.val[i] for i in range(3)])
    assert batch["audio"].shape[0] == 3 and batch["audio_valid"].dtype == torch.bool
    assert batch["caption_text"] == [r["text"] for r in rows[:3]]
    assert batch["caption"].shape[1] <= 16 and (batch["caption"][:, 0] == tok.bos_id).all()
    for i in range(3):  # each clip's length is its own, its transcript decodes back
        assert int(batch["audio_valid"][i].sum()) == data.val[i]["audio"].shape[0]
        ids = batch["caption"][i][batch["caption_valid"][i]].tolist()
        assert tok.decode(ids, skip_special=True).strip() == rows[i]["text"] or len(ids) == 16


@pytest.mark.slow
def test_asterisk_en_split(asterisk):
    en, _ = asterisk
    train, test = _rows(en / "train.jsonl"), _rows(en / "test.jsonl")
    assert len(train) + len(test) == 568
    assert {r["label"] for r in train}.isdisjoint(r["label"] for r in test)
    root = Path("/usr/share/asterisk/sounds/en")
    singles = {str(p.relative_to(root).with_suffix("")) for p in spoken_word_clips().values()}
    assert len(singles) == 80 and singles <= {r["label"] for r in test}  # the spoken words: test only
    for r in train:
        assert asterisk_split(r["label"]) == "train" and Path(r["audio"]).is_file()


@pytest.mark.slow
def test_asterisk_prompts_keep_test_prompts_out_of_training(asterisk):
    en, prompts = asterisk
    train, test = _rows(prompts / "train.jsonl"), _rows(prompts / "test.jsonl")
    en_split = {r["label"]: split for split in ("train", "test") for r in _rows(en / f"{split}.jsonl")}
    real_train = [r for r in train if not r["synthetic"]]
    assert len(real_train) == 196 and len(test) == 88
    assert all(en_split[r["name"]] == "train" for r in real_train)
    assert all(en_split[r["name"]] == "test" and not r["synthetic"] for r in test)
    # every synthetic clip renders a train transcript, two per prompt here, and exists
    synthetic = [r for r in train if r["synthetic"]]
    assert len(synthetic) == 2 * len(real_train)
    assert {r["name"] for r in synthetic} == {r["name"] for r in real_train}
    assert all((prompts / r["audio"]).is_file() for r in synthetic)
    assert {sf.info(prompts / r["audio"]).samplerate for r in synthetic[:8]} == {8000}  # as the real clips
    labels = {r["label"] for r in train}
    assert labels == {r["label"] for r in test} and len(labels) == 9
    assert all(r["label"] == prompt_application(r["name"]) for r in train + test)
