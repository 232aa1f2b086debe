"""Collation into the fixed batch keys (DESIGN.md, Batches)."""

from __future__ import annotations

import torch


def pad_ids(seqs: list[list[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-pad token id lists to the longest: ``ids (B, L)`` long and ``valid (B, L)`` bool (True = real)."""
    n = max((len(s) for s in seqs), default=0)
    ids = torch.full((len(seqs), n), pad_id, dtype=torch.long)
    valid = torch.zeros(len(seqs), n, dtype=torch.bool)
    for i, s in enumerate(seqs):
        ids[i, : len(s)] = torch.tensor(s, dtype=torch.long)
        valid[i, : len(s)] = True
    return ids, valid


def caption_ids(ids: list[list[int]]) -> list[int]:
    """One id per distinct token sequence (after cutting), in order of first appearance: equal captions
    get equal ids."""
    distinct: dict[tuple[int, ...], int] = {}
    return [distinct.setdefault(tuple(x), len(distinct)) for x in ids]


def collate_classification(samples: list[dict]) -> dict:
    """``[{"image": (C, H, W), "label": int, "bad_samples": [path, …]}]`` →
    ``{"image": (B, C, H, W) uint8 (or float), "label": (B,) long, "bad_samples": [path, …]}``."""
    return {
        "image": torch.stack([s["image"] for s in samples]),
        "label": torch.tensor([s["label"] for s in samples], dtype=torch.long),
        "bad_samples": [p for s in samples for p in s["bad_samples"]],
    }
