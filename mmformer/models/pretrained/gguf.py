"""GGUF files (llama.cpp's single-file format, https://github.com/ggml-org/ggml/blob/master/docs/gguf.md):
metadata, dequantized tensors, and the byte-level BPE vocabulary they carry.

Reads with the ``gguf`` package (llama.cpp's own Python reader; quantized blocks such as Q4_1 and Q8_0
are dequantized to float32 by ``gguf.quants.dequantize``). Tensors keep llama.cpp's names
(``blk.0.attn_q.weight``); ``llama.py`` maps them to the usual Llama layout.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor

from ...progress import progress
from ...tokenizers.text import TextTokenizer

# llama.cpp token types (llama.h ``llama_token_type``): 3 control, 4 user-defined → special tokens
_SPECIAL_TYPES = (3, 4)


@dataclass
class GGUFFile:
    """``metadata``: key → Python value (strings, numbers, lists); ``path``: the file."""

    path: Path
    metadata: dict
    _reader: object

    def tensors(self) -> dict[str, Tensor]:
        """All tensors as float32 torch tensors in PyTorch's ``(out, in)`` order, names as in the file."""
        from gguf.quants import dequantize

        out = {}
        for t in progress(self._reader.tensors, f"reading {self.path.name}", unit="tensor"):
            shape = tuple(int(d) for d in reversed(t.shape))  # GGML lists dimensions fastest-first
            arr = dequantize(t.data, t.tensor_type).reshape(shape)
            out[t.name] = torch.from_numpy(arr.astype("float32", copy=False).copy())
        return out


def read_gguf(path: str | Path) -> GGUFFile:
    """Open a GGUF file. Raises ``FileNotFoundError``, or ``ValueError`` when it is not GGUF."""
    from gguf import GGUFReader

    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"GGUF file {str(path)!r} does not exist")
    try:
        reader = GGUFReader(str(path))
    except Exception as e:  # the reader raises ValueError / struct errors on a foreign file
        raise ValueError(f"{str(path)!r} is not a readable GGUF file: {e}") from e
    metadata = {}
    for key, field in reader.fields.items():
        if key.startswith("GGUF."):
            continue
        metadata[key] = field.contents()
    return GGUFFile(path, metadata, reader)


def _pre_tokenizer(kind: str):
    """llama.cpp's pre-tokenizer ``kind`` (``tokenizer.ggml.pre``) as HF ``tokenizers`` pre-tokenizers:
    ``gpt2`` / ``default`` use GPT-2's byte-level regex; ``smollm`` first splits digits one by one, as
    its original ``tokenizer.json`` does. Raises ``ValueError`` for others (Llama-3's, Qwen's regexes
    differ: tokenizing them with GPT-2's would silently change the ids)."""
    from tokenizers import pre_tokenizers

    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if kind in ("gpt2", "default"):
        return byte_level
    if kind == "smollm":
        return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
    raise ValueError(f"GGUF pre-tokenizer {kind!r} is not supported (supported: gpt2, default, smollm)")


def tokenizer_from_gguf(metadata: dict) -> TextTokenizer:
    """The byte-level BPE stored in a GGUF file's ``tokenizer.ggml.*`` metadata, with its control
    tokens as single-id special tokens, ``bos`` / ``eos`` from the metadata and the chat template.

    Raises ``ValueError`` for a non-BPE vocabulary (SentencePiece ``llama`` vocabularies are not supported).
    """
    from tokenizers import AddedToken, Tokenizer, decoders, models

    kind = metadata.get("tokenizer.ggml.model")
    if kind != "gpt2":
        raise ValueError(f"only byte-level BPE ('gpt2') GGUF vocabularies are supported, not {kind!r}")
    tokens = list(metadata["tokenizer.ggml.tokens"])
    types = list(metadata.get("tokenizer.ggml.token_type", [1] * len(tokens)))
    merges = [tuple(m.split(" ", 1)) for m in metadata["tokenizer.ggml.merges"]]
    tok = Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=merges))
    tok.pre_tokenizer = _pre_tokenizer(metadata.get("tokenizer.ggml.pre", "gpt2"))
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(
        [
            AddedToken(t, special=True, normalized=False)
            for t, ty in zip(tokens, types)
            if ty in _SPECIAL_TYPES
        ]
    )
    special: dict[str, str | None] = {"image": None, "audio": None}  # not in the vocabulary: not invented
    for name in ("bos", "eos", "pad"):
        i = metadata.get(f"tokenizer.ggml.{name}_token_id")
        special[name] = tokens[int(i)] if i is not None else None
    return TextTokenizer(tok, special, metadata.get("tokenizer.chat_template"))
