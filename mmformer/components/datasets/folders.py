"""Dataset kinds read from folders of files: ``image_folder`` (``root/<split>/<class>/*.png|jpg``),
``cifar10`` (torchvision's python format), ``audio_folder`` (``root/<split>/<class>/<clip>``) and
``audio_manifest`` (``root/<split>.jsonl``) — ``mmformer.data.image``, ``mmformer.data.audio``."""

from __future__ import annotations

from dataclasses import dataclass

from ...data.audio import audio_classification_data
from ...data.image import cifar10_data, image_folder_data
from ...registry import register
from ..context import BuildContext
from ..tokenizers import audio_preprocess
from .base import LoaderConfig


@dataclass
class ImageFolderDataConfig(LoaderConfig):
    """``tasks.<name>.data`` of kind ``image_folder``: ``root/<split>/<class>/*.png|jpg|…``.

    ``root`` is a path, or a bundled dataset name (``mmformer data list``) under the data root.
    """

    kind: str = "image_folder"
    train_split: str = "train"
    val_split: str = "val"
    batch_size: int = 64
    num_workers: int = 2
    cache: bool = False  # keep decoded images in memory (small datasets)
    crop_padding: int = 0  # training augmentation: RandomCrop(image_size, padding) (data.crop_flip)
    hflip: bool = False  # training augmentation: horizontal flips

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.crop_padding < 0:
            raise ValueError(f"crop_padding must be >= 0, got {self.crop_padding}")


@dataclass
class CIFAR10DataConfig(LoaderConfig):
    """``tasks.<name>.data`` of kind ``cifar10``: CIFAR-10's python format (torchvision)."""

    kind: str = "cifar10"
    root: str = "cifar10"
    download: bool = False  # fetch from the official URL (needs internet)
    batch_size: int = 128
    num_workers: int = 2
    crop_padding: int = 4
    hflip: bool = True


@dataclass
class AudioFolderDataConfig(LoaderConfig):
    """``tasks.<name>.data`` of kind ``audio_folder``: ``root/<split>/<class>/<clip>`` (wav, flac, ogg, …);
    ``root`` is a path or a bundled name (``spoken-words``)."""

    kind: str = "audio_folder"
    train_split: str = "train"
    val_split: str = "val"
    bucket_by_length: bool = False  # batches of clips of similar duration (less padding)

    def __post_init__(self) -> None:
        super().__post_init__()


@dataclass
class AudioManifestDataConfig(AudioFolderDataConfig):
    """``tasks.<name>.data`` of kind ``audio_manifest``: ``root/<split>.jsonl`` with one
    ``{"audio": path, "label": …, "text": …}`` per line (``asterisk-en``)."""

    kind: str = "audio_manifest"
    label_key: str = "label"  # the manifest field that is the class (asterisk-en also has "group")


@register("dataset", "image_folder", ImageFolderDataConfig)
def build_image_folder(cfg: ImageFolderDataConfig, task, ctx: BuildContext):
    return image_folder_data(
        cfg, ctx.image_spec(ctx.recipe.model.tokenizers[task.tokenizer]), ctx.num_classes(task)
    )


@register("dataset", "cifar10", CIFAR10DataConfig)
def build_cifar10(cfg: CIFAR10DataConfig, task, ctx: BuildContext):
    return cifar10_data(
        cfg, ctx.image_spec(ctx.recipe.model.tokenizers[task.tokenizer]), ctx.num_classes(task)
    )


@register("dataset", "audio_folder", AudioFolderDataConfig)
def build_audio_folder(cfg: AudioFolderDataConfig, task, ctx: BuildContext):
    tok = ctx.recipe.model.tokenizers[task.tokenizer]
    return audio_classification_data(cfg, audio_preprocess(tok), ctx.num_classes(task))


@register("dataset", "audio_manifest", AudioManifestDataConfig)
def build_audio_manifest(cfg: AudioManifestDataConfig, task, ctx: BuildContext):
    tok = ctx.recipe.model.tokenizers[task.tokenizer]
    return audio_classification_data(cfg, audio_preprocess(tok), ctx.num_classes(task))
