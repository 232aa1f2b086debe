"""Audio classification data: audio folders (``root/<split>/<class>/<clip>``, label = sub-folder, as
image folders) and JSONL manifests (``root/<split>.jsonl``, one ``{"audio": path, "label": …,
"text": …}`` per line; relative paths are relative to ``root``).

Samples are decoded, downmixed, resampled and cropped by the tokenizer's data side
(``AudioPreprocess``); batches are padded to their longest clip: ``audio (B, S)`` float32,
``audio_valid (B, S)`` bool (True = real sample), ``label (B,)`` long. Every container libsndfile reads
is a clip (``folders.audio_extensions``: wav, flac, ogg / oga, mp3, aiff, …). An unreadable clip —
one soundfile cannot decode, or one cut short inside its data chunk (``check_complete``), which
libsndfile would read silently as a shorter clip — follows the folder rule (``bad_samples``), as images.
"""

from __future__ import annotations

import re
from pathlib import Path

import torch
from torch.utils.data import Dataset

from ..tokenizers.audio import AudioDecodeError, AudioPreprocess
from .bad_samples import STAND_IN, first_readable
from .datamodule import TaskData
from .folders import audio_extensions, class_files, split_folder
from .jsonl import label_field, read_jsonl, text_field
from .roots import DataError, resolve_root

# libsndfile's log of a chunk longer than the file: "data : 3200 (should be 956)" (WAV), "SSND : …" (AIFF)
_CUT_CHUNK = re.compile(r"^\s*(data|SSND)\s*:\s*(\d+)\s*\(should be (\d+)\)", re.MULTILINE)
# a size streaming writers put in a header they cannot seek back to (0, 0x7ffff000, 0xffffffff): not a cut
_UNKNOWN_SIZE = 0x7FFFF000


def check_complete(source, name: str | None = None) -> None:
    """Raise ``AudioDecodeError`` naming ``name`` (default: the path) when ``source`` (a path, or a seekable
    binary file, left where it was) is cut short inside its data chunk. libsndfile reads such a file
    without an error, as a clip of the samples that are there; its header log still holds the size the
    writer declared."""
    import soundfile

    start = source.tell() if hasattr(source, "read") else None
    try:
        log_text = soundfile.info(source if start is not None else str(source)).extra_info
    except Exception:  # unreadable altogether: decoding names it
        return
    finally:
        if start is not None:
            source.seek(start)
    for chunk, declared, holds in _CUT_CHUNK.findall(log_text):
        if int(holds) < int(declared) < _UNKNOWN_SIZE:
            raise AudioDecodeError(
                f"{name or source}: cut short: its {chunk} chunk declares {declared} bytes, "
                f"the file holds {holds}"
            )


def load_complete(preprocess: AudioPreprocess, source, name: str | None = None) -> torch.Tensor:
    """``preprocess.load(source)`` of a clip that is not cut short (``check_complete``)."""
    check_complete(source, name)
    return preprocess.load(source)


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
        j, wave, bad = first_readable(
            i,
            len(self.samples),
            lambda k: load_complete(self.preprocess, self.samples[k][0]),
            lambda k: self.samples[k][0],
            "audio",
            (AudioDecodeError,),
        )
        path, label = self.samples[j]
        item = {"audio": wave, "label": label, "path": path, "bad_samples": bad}
        if bad:
            item[STAND_IN] = True
        return item


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
    Files of other extensions are counted in one warning. Raises ``FileNotFoundError`` (a missing
    folder) / ``DataError`` (a class outside ``classes``, a class folder without a clip)."""
    return class_files(Path(split_dir), classes, audio_extensions(), "audio")


def manifest_rows(path: Path, label_key: str = "label", transcript: bool = False) -> list[dict]:
    """Rows of a JSONL manifest; each needs ``audio`` (relative paths resolved against the manifest's
    folder) and ``label_key`` (copied to ``label``): a class name, or with ``transcript`` a string.
    Raises ``DataError`` naming ``file:line`` (a null label or transcript included)."""
    if not path.is_file():
        raise FileNotFoundError(f"audio manifest {str(path)!r} does not exist")
    rows = []
    for n, row in read_jsonl(path, ("audio", label_key)):
        audio = row["audio"]
        if not isinstance(audio, str):
            raise DataError(f"{path}:{n}: 'audio' must be a file path, got {audio!r}")
        row["audio"] = str(Path(audio) if Path(audio).is_absolute() else path.parent / audio)
        row["label"] = (text_field if transcript else label_field)(path, n, row, label_key)
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
        train, classes = folder_samples(split_folder(root, cfg, "train_split", "audio"))
        val, _ = folder_samples(split_folder(root, cfg, "val_split", "audio"), classes)
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
