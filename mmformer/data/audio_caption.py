"""Audio–caption data: JSONL manifests ``root/<split>.jsonl`` of ``{"audio": path, "text": transcript}``
(relative paths resolved against ``root``), e.g. the bundled ``asterisk-speech`` set.

Batches: ``audio (B, S)`` float32 and ``audio_valid (B, S)`` bool (right-padded clips, True = real
sample, as audio classification), ``caption (B, L)`` long (BOS … EOS, right-padded with the pad id),
``caption_valid (B, L)`` bool, ``caption_text`` (the strings), ``caption_id (B,)`` long (equal for
transcripts with equal token ids within the split). A null transcript is refused naming its line; an
unreadable clip follows the folder rule (``bad_samples``), as for audio classification.
"""

from __future__ import annotations

import functools

import torch

from .audio import AudioClips, collate_audio, manifest_rows
from .collate import caption_ids, pad_ids
from .datamodule import TaskData
from .image_caption import encode_captions
from .roots import resolve_root


class AudioCaptions(AudioClips):
    """Clips with their transcripts: items ``{"audio": (S,) float32, "ids": [token ids], "caption": str,
    "caption_id": int, "path", "bad_samples"}``."""

    def __init__(self, rows: list[dict], ids: list[list[int]], preprocess, text_key: str = "text"):
        super().__init__([(r["audio"], i) for i, r in enumerate(rows)], preprocess)
        self.captions, self.ids = [str(r[text_key]) for r in rows], ids
        self.caption_ids = caption_ids(ids)

    def __getitem__(self, i: int) -> dict:
        item = super().__getitem__(i)
        j = item.pop("label")  # the row actually read (an unreadable clip is replaced by the next)
        return {**item, "ids": self.ids[j], "caption": self.captions[j], "caption_id": self.caption_ids[j]}


def collate_audio_captions(samples: list[dict], pad_id: int) -> dict:
    batch = collate_audio(samples)
    ids, valid = pad_ids([s["ids"] for s in samples], pad_id)
    batch.update(
        caption=ids,
        caption_valid=valid,
        caption_text=[s["caption"] for s in samples],
        caption_id=torch.tensor([s["caption_id"] for s in samples], dtype=torch.long),
    )
    return batch


def audio_caption_data(cfg, preprocess, tokenizer):
    """``TaskData`` for an ``AudioCaptionDataConfig``; ``preprocess`` is the (train, val) data side of the
    audio tokenizer, ``tokenizer`` (a ``TextTokenizer``) encodes the transcripts."""

    root = resolve_root(cfg.root)

    def make(split: str, side) -> AudioCaptions:
        rows = manifest_rows(root / f"{split}.jsonl", cfg.text_key, transcript=True)
        rows = [r for r in rows if getattr(cfg, "synthetic", True) or not r.get("synthetic")]
        ids = encode_captions(tokenizer, [r[cfg.text_key] for r in rows], cfg.max_len)
        return AudioCaptions(rows, ids, side, cfg.text_key)

    train, val = make(cfg.train_split, preprocess[0]), make(cfg.val_split, preprocess[1])

    def sources(ds: AudioCaptions) -> list[str]:  # the clips (one sentence may be read in many)
        return [p for p, _ in ds.samples]

    return TaskData(
        train=train,
        val=val,
        train_sources=sources(train),
        val_sources=sources(val),
        collate=functools.partial(collate_audio_captions, pad_id=tokenizer.pad_id),
        batch_size=cfg.batch_size,
        val_batch_size=cfg.val_batch_size or cfg.batch_size,
        num_workers=cfg.num_workers,
        drop_last=cfg.drop_last,
    )
