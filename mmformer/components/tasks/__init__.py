"""Task kinds: one file each (its config, its cross-part rules, its builder and registration)."""

from . import classification, contrastive, diffusion, language, prefix_lm, seq2seq  # noqa: F401
