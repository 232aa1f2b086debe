"""The bundled speech datasets keep DATA.md's one fixed split of the real Asterisk recordings."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import soundfile as sf

from mmformer.data.prepare import BUNDLED
from mmformer.data.speech import (
    _prompt_tts_text,
    asterisk_split,
    build_asterisk_en,
    build_asterisk_prompts,
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
