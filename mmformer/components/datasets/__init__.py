"""Dataset kinds: one file per family of on-disk formats (config, rules, builder, registration)."""

from . import captions, folders, hf, sequences, shards, text  # noqa: F401
