"""BERT encoders (BERT, MiniLM, sentence-transformers models) from HF directories into mmformer.

An imported BERT is a ``MultimodalModel``: ``tokenizers.text`` (a ``TextEmbedding`` with learned
positions, token types, and the embedding LayerNorm), a bidirectional post-norm backbone (exact-erf
GELU, LayerNorm with the checkpoint's ε) and ``heads.embedding`` (a ``SentenceEmbeddingHead``: mean
pooling over real tokens, then L2 normalisation, as sentence-transformers' all-MiniLM models).
Name mapping (HF ``BertModel`` → mmformer):

  embeddings.{word,position,token_type}_embeddings → tokenizers.text.{embed,pos_embed,type_embed}
  embeddings.LayerNorm                      → tokenizers.text.norm
  encoder.layer.i.attention.self.{query,key,value} → backbone.blocks.i.attn.qkv  (rows stacked)
  encoder.layer.i.attention.output.dense    → backbone.blocks.i.attn.proj
  encoder.layer.i.attention.output.LayerNorm → backbone.blocks.i.norm1
  encoder.layer.i.intermediate.dense        → backbone.blocks.i.mlp.fc1
  encoder.layer.i.output.dense              → backbone.blocks.i.mlp.fc2
  encoder.layer.i.output.LayerNorm          → backbone.blocks.i.norm2

The pooler (``pooler.dense``, tanh over [CLS]) is not imported: sentence embeddings do not use it.
Reference: transformers' ``BertModel`` (parity test in ``tests/models/test_pretrained_bert.py``).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ...nn.tokens import Tokens
from ...tokenizers.text import TextEmbedding, TextTokenizer
from ..backbone import build_backbone
from ..backbone_config import AttentionConfig, BlockConfig, MlpConfig
from ..model import MultimodalModel
from .llama import _load_into, _read_safetensors_dir

BERT_SPECIAL = {
    "bos": "[CLS]",
    "eos": "[SEP]",
    "pad": "[PAD]",
    "mask": "[MASK]",
    "image": None,
    "audio": None,
}


class SentenceEmbeddingHead(nn.Module):
    """Mean of the hidden states of real tokens, L2-normalised (Reimers & Gurevych 2019, SBERT §3;
    sentence-transformers ``Pooling(mode="mean")`` + ``Normalize``).

    ``forward(hidden (B, N, D), tokens) → (B, D)`` float, unit norm rows.
    """

    def __init__(self, normalize: bool = True):
        super().__init__()
        self.normalize = normalize

    def forward(self, hidden: Tensor, tokens: Tokens) -> Tensor:
        w = tokens.valid.unsqueeze(-1).to(hidden.dtype)  # (B, N, 1)
        x = (hidden * w).sum(1) / w.sum(1).clamp_min(1e-9)
        return F.normalize(x, p=2, dim=-1) if self.normalize else x


def build_bert(config: dict) -> MultimodalModel:
    """An untrained mmformer BERT for an HF ``BertConfig`` dict. Raises ``ValueError`` for relative
    position embeddings or an activation other than GELU."""
    if config.get("position_embedding_type", "absolute") != "absolute":
        raise ValueError(f"position_embedding_type={config['position_embedding_type']!r} is not supported")
    if config.get("hidden_act", "gelu") != "gelu":
        raise ValueError(f"hidden_act={config['hidden_act']!r} is not supported; expected 'gelu'")
    d, eps = config["hidden_size"], config.get("layer_norm_eps", 1e-12)
    drop = config.get("hidden_dropout_prob", 0.1)
    embedding = TextEmbedding(
        config["vocab_size"],
        d,
        max_len=config.get("max_position_embeddings", 512),
        type_vocab_size=config.get("type_vocab_size", 2),
        norm=True,
        norm_eps=eps,
        drop=drop,
    )
    backbone = build_backbone(
        d,
        config["num_hidden_layers"],
        AttentionConfig(
            config["num_attention_heads"],
            attn_drop=config.get("attention_probs_dropout_prob", 0.1),
            proj_drop=drop,
        ),
        mlp=MlpConfig(hidden=config["intermediate_size"], act="gelu", drop=drop),
        block=BlockConfig("post"),
        norm_eps=eps,
    )
    return MultimodalModel({"text": embedding}, backbone, {"embedding": SentenceEmbeddingHead()})


def hf_to_mmformer(sd: dict[str, Tensor], config: dict) -> dict[str, Tensor]:
    """HF ``BertModel`` (or ``BertForX``: the ``bert.`` prefix is dropped) state dict → mmformer names."""
    sd = {k.removeprefix("bert."): v for k, v in sd.items()}
    e = "embeddings."
    out = {
        "tokenizers.text.embed.weight": sd[e + "word_embeddings.weight"],
        "tokenizers.text.pos_embed.weight": sd[e + "position_embeddings.weight"],
        "tokenizers.text.type_embed.weight": sd[e + "token_type_embeddings.weight"],
        "tokenizers.text.norm.weight": sd[e + "LayerNorm.weight"],
        "tokenizers.text.norm.bias": sd[e + "LayerNorm.bias"],
    }
    for i in range(config["num_hidden_layers"]):
        hf, mm = f"encoder.layer.{i}.", f"backbone.blocks.{i}."
        for p in ("weight", "bias"):
            out[mm + f"attn.qkv.{p}"] = torch.cat(
                [sd[hf + f"attention.self.{n}.{p}"] for n in ("query", "key", "value")]
            )
            out[mm + f"attn.proj.{p}"] = sd[hf + f"attention.output.dense.{p}"]
            out[mm + f"norm1.{p}"] = sd[hf + f"attention.output.LayerNorm.{p}"]
            out[mm + f"mlp.fc1.{p}"] = sd[hf + f"intermediate.dense.{p}"]
            out[mm + f"mlp.fc2.{p}"] = sd[hf + f"output.dense.{p}"]
            out[mm + f"norm2.{p}"] = sd[hf + f"output.LayerNorm.{p}"]
    return out


def load_hf_bert(
    path: str | Path, dtype: torch.dtype = torch.float32
) -> tuple[MultimodalModel, TextTokenizer, dict]:
    """An HF BERT directory (``config.json``, ``*.safetensors``, ``tokenizer.json``) →
    ``(model, tokenizer, config)``. The WordPiece tokenizer maps bos/eos/pad to [CLS]/[SEP]/[PAD] (encode
    with ``bos=True, eos=True`` for BERT's input format); its fixed padding and truncation are turned
    off. Raises ``FileNotFoundError`` / ``ValueError`` (not a BERT, weights that do not fit)."""
    path = Path(path)
    config = json.loads((path / "config.json").read_text())
    if config.get("model_type") != "bert":
        raise ValueError(f"{str(path)!r} holds a {config.get('model_type')!r} model, not a BERT")
    model = _load_into(build_bert(config), hf_to_mmformer(_read_safetensors_dir(path), config)).to(dtype)
    tokenizer = TextTokenizer.from_file(path / "tokenizer.json", BERT_SPECIAL)
    return model, tokenizer, config
