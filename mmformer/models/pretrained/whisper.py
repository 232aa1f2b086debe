"""Whisper (Radford et al. 2022, arXiv:2212.04356) from CTranslate2 files into mmformer: the audio
encoder alone (``load_whisper_encoder``, the tower / tokenizer recipes reuse) or the whole
encoder–decoder with its tokenizer (``load_whisper``, speech recognition).

An imported encoder is a ``MultimodalModel`` with ``tokenizers.audio`` (a ``WhisperConvTokenizer``:
Whisper's log-mel, its two-conv stem and fixed sinusoidal positions), a bidirectional pre-norm
backbone (LayerNorm ε 1e-5, exact GELU, fused qkv) with Whisper's final ``ln_post``, and no heads.
Name mapping (CTranslate2 ``WhisperSpec`` → mmformer):

  encoder/conv{1,2}                          → tokenizers.audio.conv{1,2}
  encoder/position_encodings/encodings       → tokenizers.audio.pos_embed
  encoder/layer_i/self_attention/layer_norm  → backbone.blocks.i.norm1
  encoder/layer_i/self_attention/linear_0    → backbone.blocks.i.attn.qkv   (already fused q; k; v)
  encoder/layer_i/self_attention/linear_1    → backbone.blocks.i.attn.proj
  encoder/layer_i/ffn/layer_norm             → backbone.blocks.i.norm2
  encoder/layer_i/ffn/linear_{0,1}           → backbone.blocks.i.mlp.fc{1,2}
  encoder/layer_norm                         → backbone.norm

The full model (``load_whisper``) is an ``EncoderDecoder("audio", "text", "lm")``: the encoder above
becomes ``towers.audio``; the decoder is the shared backbone (causal ``CrossAttentionBlock``s):

  decoder/embeddings                          → tokenizers.text.embed (the LM head is tied to it)
  decoder/position_encodings/encodings        → tokenizers.text.pos_embed   (learned, 448 positions)
  decoder/layer_i/self_attention/{layer_norm, linear_0, linear_1} → backbone.blocks.i.{norm1, attn.qkv, attn.proj}
  decoder/layer_i/attention/layer_norm        → backbone.blocks.i.norm_cross
  decoder/layer_i/attention/linear_{0,1,2}    → backbone.blocks.i.cross_attn.{q, kv, proj}  (kv fused k; v)
  decoder/layer_i/ffn/…                       → backbone.blocks.i.{norm2, mlp.fc1, mlp.fc2}
  decoder/layer_norm                          → backbone.norm

(Whisper's key projection has no bias; CTranslate2 stores zeros there, and a key bias cannot change
softmax attention, so the fused bias is exact.) Reference: the CTranslate2 encoder itself
(``ctranslate2.models.Whisper.encode``; parity test in ``tests/models/test_pretrained_whisper.py``).
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import torch
from torch import Tensor

from ...tokenizers.audio import WhisperConvTokenizer
from ...tokenizers.text import TextEmbedding, TextTokenizer
from ..backbone import build_backbone
from ..backbone_config import AttentionConfig, BlockConfig, MlpConfig
from ..encoder_decoder import EncoderDecoder
from ..heads import LMHead
from ..model import MultimodalModel
from .ctranslate2 import read_ctranslate2


def whisper_encoder_config(variables: dict[str, Tensor]) -> dict:
    """Sizes of the encoder from its tensors: ``d_model``, ``n_layers``, ``n_heads``, ``n_mels``, ``n_ctx``."""
    n_layers = len({k.split("/")[1] for k in variables if re.match(r"encoder/layer_\d+/", k)})
    d_model, n_mels, _ = variables["encoder/conv1/weight"].shape
    return {
        "d_model": int(d_model),
        "n_layers": n_layers,
        "n_heads": int(variables["encoder/num_heads"]),
        "n_mels": int(n_mels),
        "n_ctx": int(variables["encoder/position_encodings/encodings"].shape[0]),
        "mlp_hidden": int(variables["encoder/layer_0/ffn/linear_0/weight"].shape[0]),
    }


def build_whisper_encoder(config: dict) -> MultimodalModel:
    """An untrained Whisper encoder of ``whisper_encoder_config``'s sizes."""
    d = config["d_model"]
    tokenizer = WhisperConvTokenizer(d, config["n_mels"], config["n_ctx"])
    backbone = build_backbone(
        d,
        config["n_layers"],
        AttentionConfig(config["n_heads"]),
        mlp=MlpConfig(hidden=config["mlp_hidden"], act="gelu"),
        norm_eps=1e-5,
    )
    return MultimodalModel({"audio": tokenizer}, backbone, {})


def ct2_to_mmformer(variables: dict[str, Tensor], config: dict) -> dict[str, Tensor]:
    v = variables
    out = {
        "tokenizers.audio.pos_embed": v["encoder/position_encodings/encodings"],
        "backbone.norm.weight": v["encoder/layer_norm/gamma"],
        "backbone.norm.bias": v["encoder/layer_norm/beta"],
    }
    for c in ("conv1", "conv2"):
        out[f"tokenizers.audio.{c}.weight"] = v[f"encoder/{c}/weight"]
        out[f"tokenizers.audio.{c}.bias"] = v[f"encoder/{c}/bias"]
    for i in range(config["n_layers"]):
        _map_block(
            out,
            v,
            f"encoder/layer_{i}/",
            f"backbone.blocks.{i}.",
            {"self_attention/layer_norm": "norm1", "ffn/layer_norm": "norm2"},
            {
                "self_attention/linear_0": "attn.qkv",
                "self_attention/linear_1": "attn.proj",
                "ffn/linear_0": "mlp.fc1",
                "ffn/linear_1": "mlp.fc2",
            },
        )
    return out


def _map_block(out: dict, v: dict, ct: str, mm: str, norms: dict[str, str], linears: dict[str, str]) -> None:
    """Copy one block's LayerNorms (CTranslate2 ``gamma``/``beta`` → ``weight``/``bias``) and linear
    layers from CTranslate2 prefix ``ct`` to mmformer prefix ``mm``."""
    for ct_name, mm_name in norms.items():
        out[mm + mm_name + ".weight"] = v[ct + ct_name + "/gamma"]
        out[mm + mm_name + ".bias"] = v[ct + ct_name + "/beta"]
    for ct_name, mm_name in linears.items():
        out[mm + mm_name + ".weight"] = v[ct + ct_name + "/weight"]
        out[mm + mm_name + ".bias"] = v[ct + ct_name + "/bias"]


def is_whisper_ct2(path: Path) -> bool:
    """A CTranslate2 Whisper directory: ``model.bin`` beside a ``config.json`` with Whisper's fields."""
    if not (path / "model.bin").is_file() or not (path / "config.json").is_file():
        return False
    return "suppress_ids" in json.loads((path / "config.json").read_text())


def load_whisper_encoder(
    path: str | Path, dtype: torch.dtype = torch.float32
) -> tuple[MultimodalModel, dict]:
    """A CTranslate2 Whisper directory (or its ``model.bin``) → ``(encoder model, sizes)``. Float16
    weights are widened to float32, then cast to ``dtype``. Raises ``FileNotFoundError`` / ``ValueError``."""
    path = Path(path)
    spec, variables = read_ctranslate2(path / "model.bin" if path.is_dir() else path)
    if spec != "WhisperSpec":
        raise ValueError(f"{str(path)!r} holds a CTranslate2 {spec or 'model'}, not Whisper")
    quantized = [
        k
        for k, v in variables.items()
        if k.startswith("encoder/") and k.endswith("weight") and not v.is_floating_point()
    ]
    if quantized:
        raise ValueError(
            f"{str(path)!r} holds quantized (int8) weights ({quantized[0]}, …); convert the model with "
            "--quantization float16 or float32"
        )
    config = whisper_encoder_config(variables)
    model = build_whisper_encoder(config)
    missing, unexpected = model.load_state_dict(ct2_to_mmformer(variables, config), strict=False)
    if missing or unexpected:
        raise ValueError(f"Whisper weights do not fit: missing {missing[:5]}, unexpected {unexpected[:5]}")
    return model.to(dtype), config


# --------------------------------------------------------------------------- the whole model
WHISPER = EncoderDecoder("audio", "text", "lm")  # the parts' names in a model from ``load_whisper``
WHISPER_SPECIAL = {"bos": "<|startoftranscript|>", "eos": "<|endoftext|>", "image": None, "audio": None}


def whisper_config(variables: dict[str, Tensor], ct2_config: dict | None = None) -> dict:
    """``whisper_encoder_config`` plus the decoder's sizes (``n_text_layers``, ``n_text_ctx``,
    ``n_vocab``) and CTranslate2's decoding rules (``suppress_ids``, ``suppress_ids_begin``)."""
    config = whisper_encoder_config(variables)
    n_vocab, _ = variables["decoder/embeddings/weight"].shape
    config.update(
        n_text_layers=len({k.split("/")[1] for k in variables if re.match(r"decoder/layer_\d+/", k)}),
        n_text_heads=int(variables["decoder/num_heads"]),
        n_text_ctx=int(variables["decoder/position_encodings/encodings"].shape[0]),
        n_vocab=int(n_vocab),
        suppress_ids=list((ct2_config or {}).get("suppress_ids", [])),
        suppress_ids_begin=list((ct2_config or {}).get("suppress_ids_begin", [])),
    )
    return config


def build_whisper(config: dict) -> MultimodalModel:
    """An untrained Whisper encoder–decoder of ``whisper_config``'s sizes (parts named as ``WHISPER``)."""
    d = config["d_model"]
    encoder = build_whisper_encoder(config)
    decoder = build_backbone(
        d,
        config["n_text_layers"],
        AttentionConfig(config["n_text_heads"]),
        mlp=MlpConfig(hidden=config["mlp_hidden"], act="gelu"),
        block=BlockConfig("cross"),
        norm_eps=1e-5,
        causal=True,
    )
    text = TextEmbedding(config["n_vocab"], d, max_len=config["n_text_ctx"])
    lm = LMHead(d, config["n_vocab"])
    lm.tie_to(text.embed)
    return MultimodalModel(
        {"audio": encoder.tokenizers["audio"], "text": text}, decoder, {"lm": lm}, {"audio": encoder.backbone}
    )


def ct2_decoder_to_mmformer(variables: dict[str, Tensor], config: dict) -> dict[str, Tensor]:
    v = variables
    out = {
        "tokenizers.text.embed.weight": v["decoder/embeddings/weight"],
        "tokenizers.text.pos_embed.weight": v["decoder/position_encodings/encodings"],
        "backbone.norm.weight": v["decoder/layer_norm/gamma"],
        "backbone.norm.bias": v["decoder/layer_norm/beta"],
    }
    for i in range(config["n_text_layers"]):
        _map_block(
            out,
            v,
            f"decoder/layer_{i}/",
            f"backbone.blocks.{i}.",
            {
                "self_attention/layer_norm": "norm1",
                "attention/layer_norm": "norm_cross",
                "ffn/layer_norm": "norm2",
            },
            {
                "self_attention/linear_0": "attn.qkv",
                "self_attention/linear_1": "attn.proj",
                "attention/linear_0": "cross_attn.q",
                "attention/linear_1": "cross_attn.kv",
                "attention/linear_2": "cross_attn.proj",
                "ffn/linear_0": "mlp.fc1",
                "ffn/linear_1": "mlp.fc2",
            },
        )
    return out


def whisper_prompt(tokenizer: TextTokenizer, config: dict, language: str = "en") -> list[int]:
    """The decoder prompt for transcription without timestamps: ``<|startoftranscript|>
    <|notimestamps|>`` (English-only models), with ``<|language|> <|transcribe|>`` between them for
    multilingual ones. Raises ``ValueError`` for a language or special token the vocabulary lacks."""
    tok = tokenizer.tokenizer
    ids = [tokenizer.bos_id]
    if config["n_vocab"] >= 51865:  # multilingual vocabularies add the language tokens
        lang = tok.token_to_id(f"<|{language}|>")
        if lang is None:
            raise ValueError(f"Whisper has no language token <|{language}|>")
        ids += [lang, tok.token_to_id("<|transcribe|>")]
    no_timestamps = tok.token_to_id("<|notimestamps|>")
    if no_timestamps is None or None in ids:
        raise ValueError("this tokenizer lacks Whisper's special tokens (<|notimestamps|>, <|transcribe|>)")
    return ids + [no_timestamps]


def whisper_tokenizer(path: str | Path, config: dict) -> TextTokenizer:
    """Whisper's text tokenizer (``tokenizer.json`` in a CTranslate2 directory), as Whisper reads and
    writes transcripts: a leading space before the text (its transcripts start " Hello"), and
    ``encode(bos=True)`` starting with ``whisper_prompt`` — so a training target is the prompt, the
    transcript's tokens and ``<|endoftext|>``. Raises ``FileNotFoundError`` / ``ValueError``."""
    from tokenizers import pre_tokenizers

    tok = TextTokenizer.from_file(Path(path) / "tokenizer.json", WHISPER_SPECIAL)
    tok.tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=True, use_regex=True)
    prompt = [tok.tokenizer.id_to_token(i) for i in whisper_prompt(tok, config)]
    return TextTokenizer(tok.tokenizer, WHISPER_SPECIAL, prompt=prompt)


def build_whisper_source(config: dict) -> MultimodalModel:
    """An untrained model of a pretrained source's pinned ``config``: the whole encoder–decoder
    (``build_whisper``) when it has the decoder's sizes, else the encoder alone (``build_whisper_encoder``)."""
    return build_whisper(config) if "n_text_layers" in config else build_whisper_encoder(config)


def load_whisper(
    path: str | Path, dtype: torch.dtype = torch.float32
) -> tuple[MultimodalModel, TextTokenizer, dict]:
    """A CTranslate2 Whisper directory → ``(encoder–decoder model, its text tokenizer, config)``; the
    model's parts are named as ``WHISPER``, ``config`` holds the sizes and the decoding rules
    (``whisper_prompt`` makes the prompt, which the tokenizer's ``start_ids`` hold too). Raises
    ``FileNotFoundError`` / ``ValueError``."""
    path = Path(path)
    if not path.is_dir() or not (path / "tokenizer.json").is_file():
        raise FileNotFoundError(f"{str(path)!r} is not a CTranslate2 Whisper directory with a tokenizer.json")
    spec, variables = read_ctranslate2(path / "model.bin")
    if spec != "WhisperSpec":
        raise ValueError(f"{str(path)!r} holds a CTranslate2 {spec or 'model'}, not Whisper")
    quantized = [k for k, t in variables.items() if k.endswith("weight") and not t.is_floating_point()]
    if quantized:
        raise ValueError(
            f"{str(path)!r} holds quantized (int8) weights ({quantized[0]}, …); convert the model with "
            "--quantization float16 or float32"
        )
    ct2_config = json.loads((path / "config.json").read_text()) if (path / "config.json").is_file() else {}
    config = whisper_config(variables, ct2_config)
    projection = variables.get("decoder/projection/weight")
    if projection is not None and not torch.equal(projection, variables["decoder/embeddings/weight"]):
        raise ValueError("this Whisper's output projection is not tied to its embeddings; mmformer ties them")
    model = build_whisper(config)
    state = {
        k.replace("backbone.", "towers.audio.", 1) if k.startswith("backbone.") else k: t
        for k, t in ct2_to_mmformer(variables, config).items()
    }
    state.update(ct2_decoder_to_mmformer(variables, config))
    state["heads.lm.head.weight"] = state["tokenizers.text.embed.weight"]
    missing, unexpected = model.load_state_dict(state, strict=False)
    if missing or unexpected:
        raise ValueError(f"Whisper weights do not fit: missing {missing[:5]}, unexpected {unexpected[:5]}")
    return model.to(dtype), whisper_tokenizer(path, config), config
