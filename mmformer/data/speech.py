"""Bundled speech datasets (DATA.md, Audio): real recordings of Asterisk's English prompts and synthetic
renderings of the same words with two TTS engines.

* ``spoken-words``: every single-word Asterisk recording that TTS can also say — the numbers 0–20 and
  the tens (``digits/``), the letters (``letters/``) and the NATO alphabet (``phonetic/``): 80 words.
  ``train/<word>/*.wav`` are **synthetic** (espeak-ng and flite, many voices, speeds and pitches);
  ``test/<word>/<name>.wav`` are the 80 **real human recordings** (one speaker, 8 kHz telephone audio).
* ``asterisk-speech``: real recordings with transcripts in that split, the train part joined by TTS
  renderings of its transcripts (audio–text pairs).
* ``asterisk-en``: all 568 real recordings with their transcripts, as JSONL manifests under DATA.md's
  one fixed split: the single-word clips above are test-only; every other clip goes to ``train`` or
  ``test`` by a stable hash of its name (70 % / 30 %). Every task uses this split, so no task's test
  clip reaches any task's training data.
"""

from __future__ import annotations

import gzip
import hashlib
import json
import random
import re
import shutil
import subprocess
from pathlib import Path

from ..progress import progress
from .roots import DataError

ASTERISK_DIR = Path("/usr/share/asterisk/sounds/en")
ASTERISK_TRANSCRIPTS = Path("/usr/share/doc/asterisk-core-sounds-en/core-sounds-en.txt.gz")
ASTERISK_INSTALL = "apt-get install asterisk-core-sounds-en-wav asterisk-core-sounds-en"

# letter names as TTS should say them (a single "a" is read as the article)
LETTER_NAMES = dict(
    zip(
        "abcdefghijklmnopqrstuvwxyz",
        "ay bee see dee ee eff gee aitch eye jay kay el em en oh pee cue are ess tee you vee "
        "double-you ex why zee".split(),
    )
)
ESPEAK_VOICES = (
    "en-us",
    "en-gb",
    "en-gb-scotland",
    "en-gb-x-gbclan",
    "en-gb-x-rp",
    "en-gb-x-gbcwmd",
    "en-029",
)
ESPEAK_VARIANTS = (
    "",
    *(f"+m{i}" for i in range(1, 8)),
    *(f"+f{i}" for i in range(1, 6)),
    "+klatt",
    "+klatt2",
)
FLITE_VOICES = ("kal", "kal16", "awb", "rms", "slt")


def asterisk_transcripts(path: Path = ASTERISK_TRANSCRIPTS) -> dict[str, str]:
    """``name → transcript`` (``digits/7 → seven``) from the package's ``core-sounds-en.txt.gz``."""
    if not path.is_file():
        raise DataError(f"Asterisk transcripts are missing ({path}); install them with: {ASTERISK_INSTALL}")
    out = {}
    for line in gzip.open(path, "rt", encoding="utf-8", errors="replace"):
        if line.startswith(";") or ":" not in line:
            continue
        name, text = line.split(":", 1)
        out[name.strip()] = text.strip()
    return out


def spoken_word_clips(root: Path = ASTERISK_DIR) -> dict[str, Path]:
    """The 80 single-word recordings: ``word → path`` (``seven → digits/7.wav``, ``b → letters/b.wav``,
    ``bravo → phonetic/b_p.wav``)."""
    names = [f"digits/{n}" for n in [*range(21), *range(30, 100, 10)]]
    names += [f"letters/{c}" for c in LETTER_NAMES] + [f"phonetic/{c}_p" for c in LETTER_NAMES]
    transcripts = asterisk_transcripts()
    clips = {}
    for name in names:
        path = root / f"{name}.wav"
        if not path.is_file():
            raise DataError(f"Asterisk recording {path} is missing; install it with: {ASTERISK_INSTALL}")
        clips[transcripts[name].lower().rstrip(".")] = path
    return clips


TTS_SPELLING = {"xray": "x-ray"}


def _tts_text(word: str) -> str:
    return TTS_SPELLING.get(word, LETTER_NAMES.get(word, word)).replace("-", " ")


def _espeak(text: str, out: Path, voice: str, speed: int, pitch: int) -> None:
    subprocess.run(
        ["espeak-ng", "-w", str(out), "-v", voice, "-s", str(speed), "-p", str(pitch), text], check=True
    )


def _flite(text: str, out: Path, voice: str, stretch: float, f0: int) -> None:
    cmd = [
        "flite",
        "-voice",
        voice,
        "--setf",
        f"duration_stretch={stretch}",
        "--setf",
        f"int_f0_target_mean={f0}",
    ]
    subprocess.run([*cmd, "-t", text, "-o", str(out)], check=True)


def build_spoken_words(out: Path, n_espeak: int = 48, n_flite: int = 16, seed: int = 0) -> None:
    """Synthetic training clips (``n_espeak`` espeak-ng + ``n_flite`` flite renderings per word, voices,
    speeds and pitches drawn with ``seed``) and the 80 real recordings as the test split."""
    for tool, pkg in (("espeak-ng", "espeak-ng"), ("flite", "flite")):
        if shutil.which(tool) is None:
            raise DataError(f"the {tool!r} TTS program is missing; install it with: apt-get install {pkg}")
    clips = spoken_word_clips()
    rng = random.Random(seed)
    for word, real in progress(clips.items(), "spoken-words: synthesizing", len(clips), unit="word"):
        train, test = out / "train" / word, out / "test" / word
        train.mkdir(parents=True), test.mkdir(parents=True)
        shutil.copyfile(real, test / f"asterisk-{real.parent.name}-{real.name}")
        text = _tts_text(word)
        for i in range(n_espeak):
            voice = rng.choice(ESPEAK_VOICES) + rng.choice(ESPEAK_VARIANTS)
            _espeak(text, train / f"espeak-{i:03d}.wav", voice, rng.randint(110, 210), rng.randint(20, 80))
        for i in range(n_flite):
            voice = FLITE_VOICES[i % len(FLITE_VOICES)]
            _flite(
                text,
                train / f"flite-{i:03d}.wav",
                voice,
                round(rng.uniform(0.8, 1.4), 2),
                rng.randint(80, 200),
            )
    (out / "README.md").write_text(
        f"spoken-words: {len(clips)} words (numbers 0-20 and tens, letters, NATO alphabet).\n"
        f"train/ is SYNTHETIC speech: {n_espeak} espeak-ng + {n_flite} flite renderings per word "
        f"(random voices, variants, speeds, pitches; seed {seed}).\n"
        "test/ holds the REAL human recordings from Asterisk's English prompts (one speaker, 8 kHz), "
        "one per word.\n"
    )


def asterisk_split(name: str) -> str:
    """DATA.md's fixed split of the non-single-word clips: ``train`` or ``test`` by a stable hash (70/30)."""
    return "train" if int(hashlib.sha256(name.encode()).hexdigest()[:8], 16) % 100 < 70 else "test"


def build_asterisk_en(out: Path, root: Path = ASTERISK_DIR) -> None:
    """All real recordings with transcripts → ``train.jsonl`` / ``test.jsonl`` of
    ``{"audio": absolute path, "text": transcript, "label": name, "group": folder}``."""
    transcripts = asterisk_transcripts()
    single = {str(p.relative_to(root).with_suffix("")) for p in spoken_word_clips(root).values()}
    rows = {"train": [], "test": []}
    for path in sorted(root.rglob("*.wav")):
        name = str(path.relative_to(root).with_suffix(""))
        if name not in transcripts:
            continue  # silence/ files have no transcript
        split = "test" if name in single else asterisk_split(name)
        group = name.split("/")[0] if "/" in name else "prompts"
        rows[split].append(
            json.dumps({"audio": str(path), "text": transcripts[name], "label": name, "group": group})
        )
    for split, lines in rows.items():
        (out / f"{split}.jsonl").write_text("\n".join(lines) + "\n")
    (out / "README.md").write_text(
        f"asterisk-en: {sum(map(len, rows.values()))} REAL recordings (one speaker, 8 kHz) with transcripts. "
        f"train {len(rows['train'])} / test {len(rows['test'])}: the 80 single-word clips are test-only; the "
        "others are split 70/30 by a hash of their name (the one split every task uses).\n"
    )


# Asterisk application each prompt belongs to, by file-name prefix (``vm-intro`` → voicemail). Only
# applications with real clips on both sides of the fixed split are classes; other prompts are left out.
PROMPT_APPLICATIONS = {
    "vm-": "voicemail",
    "conf-": "conference",
    "confbridge-": "conference",
    "spy-": "chanspy",
    "dir-": "directory",
    "queue-": "queue",
    "dictate/": "dictate",
    "demo-": "demo",
    "priv-": "privacy",
    "privacy-": "privacy",
    "agent-": "agent",
}


def prompt_application(name: str) -> str | None:
    """The Asterisk application a prompt belongs to (``confbridge-join`` → ``conference``), or None."""
    return next((app for prefix, app in PROMPT_APPLICATIONS.items() if name.startswith(prefix)), None)


def _prompt_tts_text(text: str) -> str:
    """A transcript as the recording's speaker reads it: keypad symbols spoken, stage notes dropped."""
    text = re.sub(r"\[[^\]]*\]", " ", text).replace("*", " star ").replace("#", " pound ")
    return " ".join(text.split())


TELEPHONE_RATE = 8_000  # Hz, the Asterisk recordings' rate


def _to_telephone_rate(path: Path) -> None:
    """Rewrite a TTS clip at the real recordings' 8 kHz (16-bit PCM): without this, synthetic speech keeps
    4–11 kHz content that no test clip has, which a 16 kHz model learns to rely on."""
    import soundfile as sf
    import torch
    import torchaudio.functional as AF

    wave, rate = sf.read(path, dtype="float32", always_2d=True)
    wave = AF.resample(torch.from_numpy(wave.mean(1)), rate, TELEPHONE_RATE)
    sf.write(path, wave.clamp(-1, 1).numpy(), TELEPHONE_RATE, subtype="PCM_16")


def _render_transcripts(
    rows: list[dict], out: Path, folder_of, n_espeak: int, n_flite: int, seed: int
) -> list[dict]:
    """``n_espeak`` espeak-ng and ``n_flite`` flite renderings of each row's transcript (voices, speeds and
    pitches drawn with ``seed``), resampled to 8 kHz, under ``out/tts/<folder_of(row)>/``; returns their
    rows (the source row with the new ``audio`` path, relative to ``out``, and ``"synthetic": true``)."""
    rng = random.Random(seed)
    synthetic = []
    for row in progress(rows, "synthesizing transcripts", unit="transcript"):
        folder = out / "tts" / folder_of(row)
        folder.mkdir(parents=True, exist_ok=True)
        text, stem = _prompt_tts_text(row["text"]), row["name"].replace("/", "-")
        for i in range(n_espeak + n_flite):
            wav = folder / f"{stem}-{'espeak' if i < n_espeak else 'flite'}-{i:02d}.wav"
            if i < n_espeak:
                voice = rng.choice(ESPEAK_VOICES) + rng.choice(ESPEAK_VARIANTS)
                _espeak(text, wav, voice, rng.randint(120, 200), rng.randint(20, 80))
            else:
                voice = FLITE_VOICES[rng.randrange(len(FLITE_VOICES))]
                _flite(text, wav, voice, round(rng.uniform(0.85, 1.25), 2), rng.randint(80, 200))
            _to_telephone_rate(wav)
            synthetic.append({**row, "audio": str(wav.relative_to(out)), "synthetic": True})
    return synthetic


def _need_tts() -> None:
    for tool in ("espeak-ng", "flite"):
        if shutil.which(tool) is None:
            raise DataError(f"the {tool!r} TTS program is missing; install it with: apt-get install {tool}")


def build_asterisk_speech(out: Path, n_espeak: int = 4, n_flite: int = 2, seed: int = 0) -> None:
    """Speech ↔ transcript pairs in the fixed split (audio–text contrastive learning, speech recognition).

    ``test.jsonl``: every REAL recording of the split's test part (the 80 single words and the other test
    prompts). ``train.jsonl``: the REAL recordings of its train part plus ``n_espeak`` espeak-ng and
    ``n_flite`` flite renderings of each of their transcripts (``tts/``, 8 kHz like the real clips). No
    test transcript is rendered. Rows: ``{"audio", "text" (the transcript as spoken: stage notes
    dropped, keypad symbols as words), "name", "synthetic"}``."""
    _need_tts()
    transcripts = asterisk_transcripts()
    single = {str(p.relative_to(ASTERISK_DIR).with_suffix("")) for p in spoken_word_clips().values()}
    rows: dict[str, list[dict]] = {"train": [], "test": []}
    for name, text in sorted(transcripts.items()):
        path, spoken = ASTERISK_DIR / f"{name}.wav", _prompt_tts_text(text)
        if not path.is_file() or not spoken:
            continue
        split = "test" if name in single else asterisk_split(name)
        rows[split].append({"audio": str(path), "text": spoken, "name": name, "synthetic": False})
    synthetic = _render_transcripts(rows["train"], out, lambda r: "", n_espeak, n_flite, seed)
    n_real = len(rows["train"])
    rows["train"] += synthetic
    for split, split_rows in rows.items():
        (out / f"{split}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in split_rows))
    (out / "README.md").write_text(
        "asterisk-speech: spoken English prompts with their transcripts, in the fixed asterisk-en split.\n"
        f"train.jsonl: {n_real} REAL recordings + {len(synthetic)} SYNTHETIC renderings of their transcripts "
        f"({n_espeak} espeak-ng + {n_flite} flite each, seed {seed}, 8 kHz) under tts/.\n"
        f"test.jsonl: {len(rows['test'])} REAL recordings (single words and prompts); no test transcript is "
        "rendered.\n"
    )


def build_asterisk_prompts(out: Path, n_espeak: int = 6, n_flite: int = 2, seed: int = 0) -> None:
    """Spoken prompt → Asterisk application (voicemail, conference, queue, …: 9 classes).

    ``test.jsonl``: the REAL recordings of the fixed split's test part. ``train.jsonl``: the REAL
    recordings of its train part, plus ``n_espeak`` espeak-ng and ``n_flite`` flite renderings of each of
    those train transcripts (``tts/<application>/*.wav``, ``"synthetic": true``), resampled to the real
    clips' 8 kHz telephone rate. No test transcript is
    rendered, so no test prompt's words reach training. Rows: ``{"audio", "text", "label", "name",
    "synthetic"}``."""
    _need_tts()
    rows: dict[str, list[dict]] = {"train": [], "test": []}
    single = {str(p.relative_to(ASTERISK_DIR).with_suffix("")) for p in spoken_word_clips().values()}
    for name, text in sorted(asterisk_transcripts().items()):
        app, path = prompt_application(name), ASTERISK_DIR / f"{name}.wav"
        if app is None or name in single or not path.is_file():
            continue
        split = asterisk_split(name)
        rows[split].append({"audio": str(path), "text": text, "label": app, "name": name, "synthetic": False})
    synthetic = _render_transcripts(rows["train"], out, lambda r: r["label"], n_espeak, n_flite, seed)
    rows["train"] += synthetic
    for split, split_rows in rows.items():
        (out / f"{split}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in split_rows))
    n_real = len(rows["train"]) - len(synthetic)
    (out / "README.md").write_text(
        "asterisk-prompts: which Asterisk application (voicemail, conference, chanspy, directory, queue, "
        "dictate, demo, privacy, agent) a spoken prompt belongs to, from its file name.\n"
        f"train.jsonl: {n_real} REAL recordings (the train part of the fixed asterisk-en split) + "
        f"{len(synthetic)} SYNTHETIC renderings of their transcripts ({n_espeak} espeak-ng + {n_flite} flite "
        f"each, seed {seed}, resampled to 8 kHz like the real clips) under tts/.\n"
        f"test.jsonl: {len(rows['test'])} REAL recordings (the test part of the split); no test transcript is "
        "rendered.\n"
    )
