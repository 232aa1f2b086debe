"""Named backbone sizes (DiT's S/B/L/XL, torchtitan's ``debugmodel``).

ViT sizes follow Dosovitskiy et al. 2020 (arXiv:2010.11929) Table 1 and DeiT (Touvron et al. 2020)
for tiny/small; GPT-2 sizes follow Radford et al. 2019. A preset fixes only the sizes: the family
(causal, norms, activations, positions) is set beside it in the recipe. ``debug`` is for CPU tests.
"""

from __future__ import annotations

PRESETS: dict[str, dict[str, int]] = {
    "debug": {"d_model": 32, "n_layers": 2, "n_heads": 2},
    "tiny": {"d_model": 192, "n_layers": 12, "n_heads": 3},  # ViT-Ti / DeiT-Ti
    "small": {"d_model": 384, "n_layers": 12, "n_heads": 6},  # ViT-S / DeiT-S
    "base": {"d_model": 768, "n_layers": 12, "n_heads": 12},  # ViT-B, GPT-2 small
    "large": {"d_model": 1024, "n_layers": 24, "n_heads": 16},  # ViT-L, GPT-2 medium
    "huge": {"d_model": 1280, "n_layers": 32, "n_heads": 16},  # ViT-H (head width 80)
    # GPT-2 names (Radford et al. 2019, Table 2), with 64-wide heads
    "gpt2": {"d_model": 768, "n_layers": 12, "n_heads": 12},
    "gpt2-medium": {"d_model": 1024, "n_layers": 24, "n_heads": 16},
    "gpt2-large": {"d_model": 1280, "n_layers": 36, "n_heads": 20},
    "gpt2-xl": {"d_model": 1600, "n_layers": 48, "n_heads": 25},
}


def preset(name: str) -> dict[str, int]:
    """The backbone sizes of preset ``name``. Raises ``KeyError`` naming the known presets."""
    if name not in PRESETS:
        raise KeyError(f"unknown preset {name!r}; known presets: {', '.join(PRESETS)}")
    return dict(PRESETS[name])
