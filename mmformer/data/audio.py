"""Audio classification data: audio folders (``root/<split>/<class>/<clip>``, label = sub-folder, as
image folders) and JSONL manifests (``root/<split>.jsonl``, one ``{"audio": path, "label": …,
"text": …}`` per line; relative paths are relative to ``root``).

Samples are decoded, downmixed, resampled and cropped by the tokenizer's data side
(``AudioPreprocess``); batches are padded to their longest clip: ``audio (B, S)`` float32,
``audio_valid (B, S)`` bool (True = real sample), ``label (B,)`` long. An unreadable clip is reported
with its path, replaced by the next readable one and counted (``bad_samples``), as for images.
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch
from torch.utils.data import Dataset

from ..tokenizers.audio import AudioDecodeError, AudioPreprocess
from .datamodule import TaskData
from .jsonl import read_jsonl
from .roots import DataError, resolve_root

log = logging.getLogger("mmformer.data")

AUDIO_EXTENSIONS = (".wav", ".flac", ".ogg", ".mp3", ".opus", ".aiff", ".aif")
MAX_CONSECUTIVE_BAD = 50


class AudioClips(Dataset):
    """``samples``: ``(path, label index)``; ``preprocess``: the tokenizer's data side. Items
    ``{"audio": (S,) float32, "label": int, "path": str, "bad_samples": [path, …]}``."""

    def __init__(
        self, samples: list[tuple[str, int]], preprocess: AudioPreprocess, classes: list[str] | None = None
    ):
        if not samples:
            raise DataError("no audio clips found")
        self.samples, self.preprocess, self.classes = samples, preprocess, classes

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, i: int) -> dict:
        bad: list[str] = []
        for attempt in range(MAX_CONSECUTIVE_BAD):
            j = (i + attempt) % len(self.samples)
            path, label = self.samples[j]
            try:
                wave = self.preprocess.load(path)
            except AudioDecodeError as e:
                log.warning("unreadable audio skipped: %s", e)
                bad.append(path)
                continue
            return {"audio": wave, "label": label, "path": path, "bad_samples": bad}
        raise DataError(f"{MAX_CONSECUTIVE_BAD} consecutive unreadable clips from {self.samples[i][0]} on")


def clip_milliseconds(path: str) -> int:
    """A clip's duration in milliseconds from its header (0 when unreadable: it sorts first and is
    reported when loaded)."""
    import soundfile

    try:
        info = soundfile.info(str(path))
    except Exception:  # unreadable: AudioClips reports it by path when it loads it
        return 0
    return int(1000 * info.frames / max(info.samplerate, 1))


def collate_audio(samples: list[dict]) -> dict:
    """Right-pad the clips with zeros to the longest one; ``label`` when the items carry one."""
    n = max(s["audio"].shape[0] for s in samples)
    audio = torch.zeros(len(samples), n)
    valid = torch.zeros(len(samples), n, dtype=torch.bool)
    for i, s in enumerate(samples):
        audio[i, : s["audio"].shape[0]] = s["audio"]
        valid[i, : s["audio"].shape[0]] = True
    batch = {
        "audio": audio,
        "audio_valid": valid,
        "path": [s["path"] for s in samples],
        "bad_samples": [p for s in samples for p in s["bad_samples"]],
    }
    if "label" in samples[0]:
        batch["label"] = torch.tensor([s["label"] for s in samples], dtype=torch.long)
    return batch


def folder_samples(
    split_dir: Path, classes: list[str] | None = None
) -> tuple[list[tuple[str, int]], list[str]]:
    """``(samples, classes)`` of ``split_dir/<class>/<clip>``; ``classes`` default to the sorted sub-folders.
    Raises ``FileNotFoundError`` / ``DataError`` (missing folder, a class outside ``classes``)."""
    if not split_dir.is_dir():
        raise FileNotFoundError(f"audio folder split {str(split_dir)!r} does not exist")
    found = sorted(p.name for p in split_dir.iterdir() if p.is_dir() and not p.name.startswith("."))
    classes = classes or found
    index = {c: i for i, c in enumerate(classes)}
    samples = []
    for name in found:
        if name not in index:
            raise DataError(f"{split_dir / name}: class {name!r} is not among the training classes")
        files = sorted(p for p in (split_dir / name).rglob("*") if p.suffix.lower() in AUDIO_EXTENSIONS)
        samples += [(str(p), index[name]) for p in files]
    if not samples:
        raise FileNotFoundError(f"no audio files ({', '.join(AUDIO_EXTENSIONS)}) under {split_dir}")
    return samples, classes


def manifest_rows(path: Path, label_key: str = "label") -> list[dict]:
    """Rows of a JSONL manifest; each needs ``audio`` (relative paths resolved against the manifest's
    folder) and ``label_key`` (copied to ``label``). Raises ``DataError`` naming ``file:line``."""
    if not path.is_file():
        raise FileNotFoundError(f"audio manifest {str(path)!r} does not exist")
    rows = []
    for n, row in read_jsonl(path, ("audio", label_key)):
        audio = row["audio"]
        if not isinstance(audio, str):
            raise DataError(f"{path}:{n}: 'audio' must be a file path, got {audio!r}")
        row["audio"] = str(Path(audio) if Path(audio).is_absolute() else path.parent / audio)
        row["label"] = str(row[label_key])
        rows.append(row)
    return rows


def audio_classification_data(
    cfg, preprocess: tuple[AudioPreprocess, AudioPreprocess], num_classes: int | None
):
    """``TaskData`` for ``AudioFolderDataConfig`` / ``AudioManifestDataConfig``; ``preprocess`` is the
    (train, val) data side of the task's tokenizer. Raises ``DataError`` when the classes do not match
    the head."""

    root = resolve_root(cfg.root)
    if cfg.kind == "audio_folder":
        train, classes = folder_samples(root / cfg.train_split)
        val, _ = folder_samples(root / cfg.val_split, classes)
    else:
        train_rows = manifest_rows(root / f"{cfg.train_split}.jsonl", cfg.label_key)
        val_rows = manifest_rows(root / f"{cfg.val_split}.jsonl", cfg.label_key)
        classes = sorted({r["label"] for r in train_rows})
        index = {c: i for i, c in enumerate(classes)}
        unknown = sorted({r["label"] for r in val_rows} - set(index))
        if unknown:
            raise DataError(f"{root / cfg.val_split}.jsonl: labels {unknown[:5]} never occur in training")
        train = [(r["audio"], index[r["label"]]) for r in train_rows]
        val = [(r["audio"], index[r["label"]]) for r in val_rows]
    if num_classes is not None and num_classes != len(classes):
        raise DataError(f"{root} has {len(classes)} classes but the head has num_classes={num_classes}")
    lengths = None
    if getattr(cfg, "bucket_by_length", False):

        def lengths() -> list[int]:  # durations from the file headers, in ms (nothing decoded)
            return [clip_milliseconds(p) for p, _ in train]

    return TaskData(
        train=AudioClips(train, preprocess[0], classes),
        val=AudioClips(val, preprocess[1], classes),
        train_sources=[p for p, _ in train],
        val_sources=[p for p, _ in val],
        collate=collate_audio,
        lengths=lengths,
        batch_size=cfg.batch_size,
        val_batch_size=cfg.val_batch_size or cfg.batch_size,
        num_workers=cfg.num_workers,
        drop_last=cfg.drop_last,
    )
