"""Collation into the fixed batch keys (DESIGN.md, Batches)."""

from __future__ import annotations

import torch


def collate_classification(samples: list[dict]) -> dict:
    """``[{"image": (C, H, W), "label": int, "bad_samples": [path, …]}]`` →
    ``{"image": (B, C, H, W) uint8 (or float), "label": (B,) long, "bad_samples": [path, …]}``."""
    return {
        "image": torch.stack([s["image"] for s in samples]),
        "label": torch.tensor([s["label"] for s in samples], dtype=torch.long),
        "bad_samples": [p for s in samples for p in s["bad_samples"]],
    }
