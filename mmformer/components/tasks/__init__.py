"""Task kinds: one file each (its config, its cross-part rules, its builder and registration)."""

from . import (  # noqa: F401
    chameleon,
    classification,
    contrastive,
    diffusion,
    language,
    maskgit,
    prefix_lm,
    seq2seq,
    transfusion,
    vq,
)
