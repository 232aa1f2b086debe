"""Dataset kind ``hf_dataset``: a local Hugging Face ``datasets`` folder (``save_to_disk``) or Parquet files,
its columns mapped to the task's fields by name (``mmformer.data.hf_datasets``; needs the optional
``datasets``: ``pip install mmformer[hf]``)."""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from types import SimpleNamespace

from ...data.hf_datasets import FIELDS, hf_data
from ...errors import did_you_mean, positive
from ...registry import register
from ..context import BuildContext
from .base import LoaderConfig
from .shards import require_sample_biases, shard_decoders, shard_reader


@dataclass
class HFDatasetConfig(LoaderConfig):
    """``tasks.<name>.data`` of kind ``hf_dataset``: ``root`` a ``save_to_disk`` folder or a folder of
    ``<split>*.parquet`` files. Read by the tasks that read shards: images or audio with labels
    (classification), documents (causal_lm, masked_lm: one padded document per row), image–caption or
    audio–transcript pairs (contrastive, prefix_lm, seq2seq); items and batches are the shards' own."""

    kind: str = "hf_dataset"
    train_split: str = "train"
    val_split: str = "validation"  # the Hub's usual name; "test" for many sets
    columns: dict[str, str] = field(default_factory=dict)  # field (image/audio/label/text) → column
    seq_len: int = 256  # text: tokens per document (truncated, padded)
    max_len: int = 32  # captions: tokens, BOS/EOS included
    crop_padding: int = 0  # image classification training augmentation
    hflip: bool = False

    def __post_init__(self) -> None:
        super().__post_init__()
        positive(self, "seq_len", "max_len")
        if self.crop_padding < 0:
            raise ValueError(f"crop_padding must be >= 0, got {self.crop_padding}")
        for name in self.columns:
            if name not in FIELDS:
                raise ValueError(
                    f"columns: unknown field {name!r}; fields: {', '.join(FIELDS)}.{did_you_mean(name, FIELDS)}"
                )

    def check(self, recipe, where: str) -> None:
        require_sample_biases(recipe, shard_reader(recipe, where, "hf_dataset data"), self, where)


@register("dataset", "hf_dataset", HFDatasetConfig)
def build_hf_dataset(cfg: HFDatasetConfig, task, ctx: BuildContext):
    # the shard decoders read these settings; hf rows are not packed and have no zero-shot prompts
    settings = SimpleNamespace(
        **{f.name: getattr(cfg, f.name) for f in fields(cfg)}, pack=False, label_key=None
    )
    decoders, _ = shard_decoders(settings, task, ctx)
    (modality, decode), *_ = decoders.items()
    num_classes = ctx.num_classes(task) if task.shards == "labelled" else None
    return hf_data(cfg, modality, decode, num_classes)
