"""Class folders ``<root>/<split>/<class>/<file>`` (image and audio folders): the split, its classes and
the files of each class that the decoder can read.

What counts as readable is what the decoder opens: every extension Pillow registers a reader for
(``image_extensions``), every container libsndfile reads (``audio_extensions``, from
``soundfile.available_formats()``). Other files are left out and counted in one warning per split
(hidden files, ``.DS_Store`` and the like, silently); a class folder without one readable file is
refused, naming it — training on it would silently drop the class.
"""

from __future__ import annotations

import functools
import logging
from collections import Counter
from pathlib import Path

from .roots import DataError

log = logging.getLogger("mmformer.data")

# libsndfile's major formats → the file extensions they are written with (RAW, header-less, is not
# readable without being told its rate and encoding, so it has none)
SOUNDFILE_EXTENSIONS = {
    "WAV": (".wav",),
    "WAVEX": (".wav",),
    "RF64": (".rf64", ".wav"),
    "W64": (".w64",),
    "AIFF": (".aiff", ".aif", ".aifc"),
    "AU": (".au", ".snd"),
    "FLAC": (".flac",),
    "OGG": (".ogg", ".oga"),
    "MP3": (".mp3",),
    "CAF": (".caf",),
    "IRCAM": (".sf",),
    "VOC": (".voc",),
    "NIST": (".nist", ".sph"),
    "SVX": (".8svx", ".svx"),
    "PAF": (".paf",),
    "MAT4": (".mat",),
    "MAT5": (".mat",),
    "PVF": (".pvf",),
    "XI": (".xi",),
    "HTK": (".htk",),
    "SDS": (".sds",),
    "AVR": (".avr",),
    "WVE": (".wve",),
    "MPC2K": (".mpc",),
    "SD2": (".sd2",),
}


@functools.cache
def image_extensions() -> tuple[str, ...]:
    """Lower-case extensions (``.png``) of the image formats Pillow can open (``Image.OPEN``), without its
    stub formats (HDF5, GRIB, WMF…: registered, but decoded only by a handler installed separately)."""
    from PIL import Image, ImageFile

    Image.init()

    def readable(fmt: str) -> bool:
        factory = Image.OPEN.get(fmt, (None,))[0]
        return factory is not None and not (
            isinstance(factory, type) and issubclass(factory, ImageFile.StubImageFile)
        )

    return tuple(sorted(ext for ext, fmt in Image.registered_extensions().items() if readable(fmt)))


@functools.cache
def audio_extensions() -> tuple[str, ...]:
    """Lower-case extensions (``.wav``, ``.oga``) of the containers this libsndfile reads
    (``soundfile.available_formats()``; ``.opus`` when its Ogg reader has the Opus codec)."""
    import soundfile

    formats = soundfile.available_formats()
    exts = {ext for fmt in formats for ext in SOUNDFILE_EXTENSIONS.get(fmt, ())}
    if "OGG" in formats and "OPUS" in soundfile.available_subtypes("OGG"):
        exts.add(".opus")
    return tuple(sorted(exts))


def split_folder(root: Path, cfg, key: str, kind: str) -> Path:
    """``root / cfg.<key>`` (``key``: ``train_split`` or ``val_split``); raises ``DataError`` when it is
    missing, showing the layout a ``<kind>_folder`` root has (``kind``: ``image`` or ``audio``), the key
    that names the folder and the folders ``root`` holds."""
    path = Path(root) / getattr(cfg, key)
    if path.is_dir():
        return path
    found = sorted(p.name for p in Path(root).glob("*") if p.is_dir() and not p.name.startswith("."))
    holds = f"{root} holds: {', '.join(found[:12])}" if found else f"{root} holds no folder"
    role = "training" if key == "train_split" else "validation"
    raise DataError(
        f"{path} does not exist: an {kind}_folder root holds {root}/{cfg.train_split}/<class>/<{kind} file> "
        f"and {root}/{cfg.val_split}/<class>/<{kind} file>; set data.{key} to the name of its {role} "
        f"folder ({holds})"
    )


def find_classes(split_dir: Path) -> list[str]:
    """Sorted sub-folder names of ``split_dir``. Raises ``FileNotFoundError`` when there are none."""
    if not split_dir.is_dir():
        raise FileNotFoundError(f"class folder split {str(split_dir)!r} does not exist")
    classes = sorted(p.name for p in split_dir.iterdir() if p.is_dir() and not p.name.startswith("."))
    if not classes:
        raise FileNotFoundError(f"{split_dir} has no class sub-folders (expected <split>/<class>/<file>)")
    return classes


def class_files(
    split_dir: Path, classes: list[str] | None, extensions: tuple[str, ...], what: str
) -> tuple[list[tuple[str, int]], list[str]]:
    """``(samples, classes)`` of ``split_dir/<class>/…``: ``(path, class index)`` of every file (searched
    recursively, sorted) whose extension is in ``extensions``; ``classes`` default to the sorted
    sub-folders. Files of other extensions are counted in one warning.

    Raises:
        FileNotFoundError: a missing split folder, or one without class folders.
        DataError: a class folder outside ``classes``, or one without a readable ``what`` file.
    """
    found = find_classes(split_dir)
    classes = classes or found
    index = {c: i for i, c in enumerate(classes)}
    samples: list[tuple[str, int]] = []
    skipped: Counter[str] = Counter()
    for name in found:
        folder = split_dir / name
        if name not in index:
            raise DataError(f"{folder}: class {name!r} is not among the training classes {classes}")
        files = sorted(p for p in folder.rglob("*") if p.is_file() and not p.name.startswith("."))
        usable = [p for p in files if p.suffix.lower() in extensions]
        skipped.update(
            p.suffix.lower() or "(no extension)" for p in files if p.suffix.lower() not in extensions
        )
        if not usable:
            others = f"; it holds {len(files)} other files" if files else " (it is empty)"
            raise DataError(
                f"{folder}: class folder {name!r} has no {what} file that can be read{others}. "
                f"Readable: {', '.join(extensions[:12])}, … ({len(extensions)} extensions). Add files or "
                "remove the folder"
            )
        samples += [(str(p), index[name]) for p in usable]
    if skipped:
        counts = ", ".join(
            f"{ext}: {n}" for ext, n in sorted(skipped.items(), key=lambda kv: (-kv[1], kv[0]))
        )
        log.warning(
            "skipped %d files with unsupported extensions (%s) under %s",
            sum(skipped.values()),
            counts,
            split_dir,
        )
    return samples, classes
