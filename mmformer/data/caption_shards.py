"""Caption shards: image–caption and audio–transcript pairs as WebDataset tar shards
(``mmformer data shard SRC --modality image_caption|audio_caption``), read by the contrastive, prefix-LM
and encoder–decoder tasks through ``data: {kind: shards}``.

Written from the layout ``data.kind: image_caption`` / ``audio_caption`` read: ``SRC/<split>.jsonl``
manifests (every one found is a split, so the split is the manifest's, as there), rows
``{"image": path, "caption": text, …}`` or ``{"audio": path, "<text_key>": transcript, …}`` (relative
paths resolved against ``SRC``). One sample per row, in row order:

- the original media bytes (``.png`` / ``.jpg`` / … or ``.wav`` / ``.flac`` / …);
- ``.txt``: the caption (transcript);
- ``.cid``: the caption id (shards without one — other people's — use ``text_id``: a hash of the text)
  (``collate.caption_ids`` over the split's caption texts: equal texts, equal
  ids). The folder datasets number equal *token ids after cutting to max_len* instead, so the two
  agree unless two different captions become equal only after a tokenizer's normalisation or the cut;
- ``.json`` (image captions): the row's other fields, e.g. emoji's ``group``; a field ``F`` with a
  class-prompt file ``SRC/F.json`` (``{class: [prompt, …]}``) has that file copied next to
  ``index.json``, so ``data.label_key: F`` gives zero-shot classes as ``image_caption`` does.

Decoded items are the folder datasets' own (``ImageCaptions`` / ``AudioCaptions``) and batches come from
their collate functions; images are not augmented (as ``image_caption``), audio goes through the audio
tokenizer's train / val data side (as ``audio_caption``).
"""

from __future__ import annotations

import hashlib
import io
import json
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path

from .audio import load_complete
from .collate import caption_ids
from .image_caption import encode_captions
from .jsonl import read_jsonl, text_field
from .roots import DataError
from .shards import FORMAT, INDEX, media_bytes, write_shards

CAPTION_MODALITIES = ("image_caption", "audio_caption")


def _manifests(src: Path) -> dict[str, Path]:
    found = {p.stem: p for p in sorted(Path(src).glob("*.jsonl"))}
    if "train" not in found:
        raise DataError(
            f"{src} has no train.jsonl (caption shards are written from SRC/<split>.jsonl manifests)"
        )
    return found


def _caption_rows(path: Path, media: str, text_key: str) -> list[dict]:
    """Rows with ``media`` resolved against the manifest's folder; raises ``DataError`` naming ``file:line``."""
    rows = []
    for n, row in read_jsonl(path, (media, text_key)):
        if not isinstance(row[media], str):
            raise DataError(f"{path}:{n}: {media!r} must be a file path, got {row[media]!r}")
        p = Path(row[media])
        text = text_field(path, n, row, text_key)
        rows.append({**row, media: str(p if p.is_absolute() else path.parent / p), text_key: text})
    return rows


def _samples(rows: list[dict], media: str, text_key: str, meta: bool) -> Iterator[dict]:
    ids = caption_ids([(r[text_key],) for r in rows])
    for row, cid in zip(rows, ids):
        path = Path(row[media])
        sample = {path.suffix.lower().lstrip("."): path.read_bytes(), "txt": row[text_key], "cid": str(cid)}
        if meta:
            sample["json"] = json.dumps({k: v for k, v in row.items() if k not in (media, text_key)})
        yield sample


def shard_captions(
    src: Path, out: Path, modality: str, text_key: str | None = None, samples_per_shard: int = 1000
) -> dict:
    """Shard ``SRC/<split>.jsonl`` image–caption or audio–transcript manifests (every split found).
    ``text_key``: the caption field (default ``caption`` for images, ``text`` for audio). Returns the
    index written to ``out/index.json``. Raises ``DataError`` for a missing ``train.jsonl`` or a bad row,
    ``FileNotFoundError`` for a missing media file."""
    if modality not in CAPTION_MODALITIES:
        raise DataError(f"caption shards are {' or '.join(CAPTION_MODALITIES)}, not {modality!r}")
    media = "image" if modality == "image_caption" else "audio"
    text_key = text_key or ("caption" if media == "image" else "text")
    info = {"format": FORMAT, "modality": modality, "classes": [], "splits": {}}
    fields: set[str] = set()
    for split, manifest in _manifests(src).items():
        rows = _caption_rows(manifest, media, text_key)
        fields.update(k for r in rows for k in r if k not in (media, text_key))
        samples = _samples(rows, media, text_key, meta=media == "image")
        info["splits"][split] = write_shards(samples, out, split, samples_per_shard, len(rows))
    for field in sorted(fields):  # zero-shot class prompts (image_caption's label_key)
        if (Path(src) / f"{field}.json").is_file() and field != Path(INDEX).stem:
            shutil.copyfile(Path(src) / f"{field}.json", out / f"{field}.json")
    (out / INDEX).write_text(json.dumps(info, indent=1))
    return info


# --------------------------------------------------------------------------- decoding
def _caption(raw: dict, tokenizer, max_len: int) -> dict:
    text = raw["txt"].decode("utf-8") if isinstance(raw["txt"], bytes) else str(raw["txt"])
    return {
        "ids": encode_captions(tokenizer, [text], max_len)[0],
        "caption": text,
        "caption_id": int(raw["cid"]) if "cid" in raw else text_id(text),
    }


def text_id(text: str) -> int:
    """A caption id for shards written without ``.cid`` (other people's): 62 bits of the text's SHA-256,
    equal for equal texts (exact-text equality; ``.cid`` numbers equal token ids after the cut)."""
    return int.from_bytes(hashlib.sha256(text.encode("utf-8")).digest()[:8], "big") >> 2


def image_caption_decoder(
    preprocess, tokenizer, max_len: int, label_key: str | None = None, classes: dict[str, int] | None = None
) -> Callable[[dict], dict]:
    """Raw sample → ``ImageCaptions``' item ``{"image": (C, H, W) uint8, "ids", "caption", "caption_id"}``
    (+ ``"label"``: the index in ``classes`` of the row's ``label_key`` field, -1 without one)."""

    def decode(raw: dict) -> dict:
        from PIL import Image

        with Image.open(io.BytesIO(media_bytes(raw, "image"))) as im:
            im.load()
            pixels = preprocess.load(im)
        item = {"image": preprocess.augment(pixels), **_caption(raw, tokenizer, max_len)}
        if label_key:
            row = json.loads(raw["json"]) if "json" in raw else {}
            item["label"] = (classes or {}).get(row.get(label_key), -1)
        return item

    return decode


def audio_caption_decoder(preprocess, tokenizer, max_len: int) -> Callable[[dict], dict]:
    """Raw sample → ``AudioCaptions``' item ``{"audio": (S,) float32, "path", "ids", "caption",
    "caption_id"}`` (``path`` = ``shard:key``) through the audio tokenizer's data side."""

    def decode(raw: dict) -> dict:
        where = f"{raw['__url__']}:{raw['__key__']}"
        wave = load_complete(preprocess, io.BytesIO(media_bytes(raw, "audio")), where)
        return {
            "audio": wave,
            "path": where,
            **_caption(raw, tokenizer, max_len),
        }

    return decode
