"""Llama-family decoders (Llama 2/3, SmolLM, …): HF checkpoints and GGUF files into mmformer, and back.

An imported Llama is an ordinary ``MultimodalModel``: ``tokenizers.text`` (a ``TextEmbedding`` without
absolute positions), a causal pre-norm backbone (RMSNorm, SwiGLU, RoPE with the model's θ, grouped-query
attention, no biases) and ``heads.lm`` (an ``LMHead``, tied to the embedding when the checkpoint ties
them). Name mapping (HF ``LlamaForCausalLM`` → mmformer):

  model.embed_tokens                    → tokenizers.text.embed
  model.layers.i.input_layernorm        → backbone.blocks.i.norm1
  model.layers.i.self_attn.{q,k,v}_proj → backbone.blocks.i.attn.qkv   (rows stacked q; k; v)
  model.layers.i.self_attn.o_proj       → backbone.blocks.i.attn.proj
  model.layers.i.post_attention_layernorm → backbone.blocks.i.norm2
  model.layers.i.mlp.{gate,up}_proj     → backbone.blocks.i.mlp.fc1      (rows stacked gate; up)
  model.layers.i.mlp.down_proj          → backbone.blocks.i.mlp.fc2
  model.norm                            → backbone.norm
  lm_head                               → heads.lm.head

GGUF files use llama.cpp's names and store q / k rows permuted for its interleaved RoPE
(``convert_hf_to_gguf.py``'s ``LlamaModel.permute``); ``gguf_to_hf`` undoes it, so both sources meet
in the HF layout. Reference: transformers' ``LlamaForCausalLM`` (parity tests in
``tests/models/test_pretrained_llama.py``).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from torch import Tensor

from ...nn.blocks import Block
from ...nn.lora import LoRALinear
from ...nn.mlp import SwiGLU
from ...progress import progress
from ...tokenizers.text import TextEmbedding, TextTokenizer
from ..backbone import build_backbone
from ..backbone_config import AttentionConfig, MlpConfig, PositionConfig
from ..heads import LMHead
from ..model import MultimodalModel
from .gguf import read_gguf, tokenizer_from_gguf


def _rope_theta(config: dict) -> float:
    params = config.get("rope_parameters") or {}
    return float(params.get("rope_theta", config.get("rope_theta", 10_000.0)))


def _check_supported(config: dict) -> None:
    d, h = config["hidden_size"], config["num_attention_heads"]
    if config.get("head_dim", d // h) != d // h:
        raise ValueError(
            f"head_dim={config['head_dim']} ≠ hidden_size / num_attention_heads is not supported"
        )
    rope = config.get("rope_scaling") or config.get("rope_parameters") or {}
    if rope.get("rope_type", rope.get("type", "default")) not in ("default", None):
        raise ValueError(f"RoPE scaling {rope!r} is not supported; only the default RoPE")
    if config.get("hidden_act", "silu") != "silu":
        raise ValueError(f"hidden_act={config['hidden_act']!r} is not a Llama SwiGLU; expected 'silu'")


def build_llama(config: dict) -> MultimodalModel:
    """An untrained mmformer Llama for an HF ``LlamaConfig`` dict (``config.json``).

    Raises ``ValueError`` for options mmformer does not model (RoPE scaling, a head_dim other than
    ``hidden_size / num_attention_heads``, an activation other than SiLU).
    """
    _check_supported(config)
    d, vocab = config["hidden_size"], config["vocab_size"]
    bias = bool(config.get("attention_bias", False))
    backbone = build_backbone(
        d,
        config["num_hidden_layers"],
        AttentionConfig(
            config["num_attention_heads"],
            n_kv_heads=config.get("num_key_value_heads"),
            qkv_bias=bias,
            proj_bias=bias,
        ),
        mlp=MlpConfig(
            hidden=config["intermediate_size"], act="swiglu", bias=bool(config.get("mlp_bias", False))
        ),
        positions=PositionConfig("rope", rope_base=_rope_theta(config)),
        norm="rmsnorm",
        norm_eps=config.get("rms_norm_eps", 1e-6),
        causal=True,
    )
    embedding = TextEmbedding(vocab, d)
    head = LMHead(d, vocab)
    if config.get("tie_word_embeddings", False):
        head.tie_to(embedding.embed)
    return MultimodalModel({"text": embedding}, backbone, {"lm": head})


def hf_to_mmformer(sd: dict[str, Tensor], config: dict) -> dict[str, Tensor]:
    """HF ``LlamaForCausalLM`` state dict → mmformer names (see the module docstring)."""
    out = {
        "tokenizers.text.embed.weight": sd["model.embed_tokens.weight"],
        "backbone.norm.weight": sd["model.norm.weight"],
    }
    out["heads.lm.head.weight"] = sd.get("lm_head.weight", sd["model.embed_tokens.weight"])
    for i in range(config["num_hidden_layers"]):
        hf, mm = f"model.layers.{i}.", f"backbone.blocks.{i}."
        out[mm + "norm1.weight"] = sd[hf + "input_layernorm.weight"]
        out[mm + "norm2.weight"] = sd[hf + "post_attention_layernorm.weight"]
        for p in ("weight", "bias"):
            if hf + f"self_attn.q_proj.{p}" in sd:
                out[mm + f"attn.qkv.{p}"] = torch.cat([sd[hf + f"self_attn.{n}_proj.{p}"] for n in "qkv"])
            if hf + f"self_attn.o_proj.{p}" in sd:
                out[mm + f"attn.proj.{p}"] = sd[hf + f"self_attn.o_proj.{p}"]
            if hf + f"mlp.gate_proj.{p}" in sd:
                out[mm + f"mlp.fc1.{p}"] = torch.cat([sd[hf + f"mlp.{n}_proj.{p}"] for n in ("gate", "up")])
            if hf + f"mlp.down_proj.{p}" in sd:
                out[mm + f"mlp.fc2.{p}"] = sd[hf + f"mlp.down_proj.{p}"]
    return out


def mmformer_to_hf(model: MultimodalModel, config: dict) -> dict[str, Tensor]:
    """Inverse of ``hf_to_mmformer``: an mmformer Llama's weights under HF ``LlamaForCausalLM`` names
    (``lm_head.weight`` only when not tied)."""
    sd = {k: v.detach() for k, v in model.state_dict().items()}
    H, Hkv = config["num_attention_heads"], config.get("num_key_value_heads") or config["num_attention_heads"]
    dh = config["hidden_size"] // H
    out = {
        "model.embed_tokens.weight": sd["tokenizers.text.embed.weight"],
        "model.norm.weight": sd["backbone.norm.weight"],
    }
    if not config.get("tie_word_embeddings", False):
        out["lm_head.weight"] = sd["heads.lm.head.weight"]
    for i in range(config["num_hidden_layers"]):
        hf, mm = f"model.layers.{i}.", f"backbone.blocks.{i}."
        out[hf + "input_layernorm.weight"] = sd[mm + "norm1.weight"]
        out[hf + "post_attention_layernorm.weight"] = sd[mm + "norm2.weight"]
        for p in ("weight", "bias"):
            if mm + f"attn.qkv.{p}" in sd:
                q, k, v = sd[mm + f"attn.qkv.{p}"].split([H * dh, Hkv * dh, Hkv * dh])
                out.update({hf + f"self_attn.{n}_proj.{p}": t for n, t in zip("qkv", (q, k, v))})
            if mm + f"attn.proj.{p}" in sd:
                out[hf + f"self_attn.o_proj.{p}"] = sd[mm + f"attn.proj.{p}"]
            if mm + f"mlp.fc1.{p}" in sd:
                gate, up = sd[mm + f"mlp.fc1.{p}"].chunk(2)
                out[hf + f"mlp.gate_proj.{p}"], out[hf + f"mlp.up_proj.{p}"] = gate, up
            if mm + f"mlp.fc2.{p}" in sd:
                out[hf + f"mlp.down_proj.{p}"] = sd[mm + f"mlp.fc2.{p}"]
    return {k: v.contiguous() for k, v in out.items()}


def llama_config(model: MultimodalModel) -> dict:
    """The HF ``LlamaConfig`` dict of an mmformer model with the Llama layout (imported, fine-tuned, or
    trained from scratch with rmsnorm + swiglu + rope + causal and no absolute positions).

    Raises ``ValueError`` naming the first part that is not Llama-shaped.
    """

    bb, emb = model.backbone, model.tokenizers["text"] if "text" in model.tokenizers else None
    head = model.heads["lm"] if "lm" in model.heads else None
    block = bb.blocks[0]
    problems = [
        (emb is None or head is None, "a 'text' tokenizer and an 'lm' head"),
        (not isinstance(block, Block), "pre-norm blocks"),
        (not isinstance(bb.norm, torch.nn.RMSNorm), "RMSNorm"),
        (not isinstance(block.mlp, SwiGLU), "a SwiGLU MLP"),
        (bb.positions.kind != "rope" or not bb.causal, "causal attention with RoPE"),
        (
            emb is not None and (emb.pos_embed is not None or emb.type_embed is not None),
            "no absolute positions",
        ),
        (any(isinstance(m, LoRALinear) for m in model.modules()), "merged LoRA adapters (merge_lora first)"),
    ]
    for bad, what in problems:
        if bad:
            raise ValueError(f"the model is not Llama-shaped: the Llama layout needs {what}")
    attn = block.attn
    return {
        "model_type": "llama",
        "architectures": ["LlamaForCausalLM"],
        "hidden_size": bb.d_model,
        "num_hidden_layers": bb.n_layers,
        "num_attention_heads": attn.n_heads,
        "num_key_value_heads": attn.n_kv_heads,
        "intermediate_size": block.mlp.fc2.in_features,
        "rms_norm_eps": float(bb.norm.eps),
        "rope_theta": float(bb.rope.base),
        "vocab_size": emb.embed.num_embeddings,
        "hidden_act": "silu",
        "attention_bias": attn.qkv.bias is not None,
        "mlp_bias": block.mlp.fc1.bias is not None,
        "tie_word_embeddings": head.head.weight is emb.embed.weight,
        "torch_dtype": "float32",
    }


def _load_into(model: MultimodalModel, sd: dict[str, Tensor]) -> MultimodalModel:
    missing, unexpected = model.load_state_dict(sd, strict=False)
    if missing or unexpected:
        raise ValueError(
            f"checkpoint does not fit the model: missing {missing[:5]}, unexpected {unexpected[:5]}"
        )
    return model


# --------------------------------------------------------------------------- HF directories
def _read_safetensors_dir(path: Path) -> dict[str, Tensor]:
    from safetensors import safe_open

    files = _read_index(path) or sorted(path.glob("*.safetensors"))  # the index names the shards
    if not files:
        raise FileNotFoundError(f"no *.safetensors weights in {str(path)!r}")
    sd: dict[str, Tensor] = {}
    for f in files:  # single file or shards (model-00001-of-0000N.safetensors)
        with safe_open(str(f), "pt") as weights:  # tensor by tensor, as load_file reads them
            for name in progress(weights.keys(), f"reading {f.name}", unit="tensor"):
                sd[name] = weights.get_tensor(name)
    return sd


def hf_tokenizer(path: Path) -> TextTokenizer:
    """``tokenizer.json`` + ``tokenizer_config.json`` (special tokens as strings or ``{"content": …}``
    objects, the chat template) of an HF directory; ids in ``config.json`` fill specials the tokenizer
    config leaves out. Specials the vocabulary lacks stay absent (``None``), never invented."""
    from tokenizers import Tokenizer

    read = lambda name: json.loads((path / name).read_text()) if (path / name).is_file() else {}  # noqa: E731
    tc, config = read("tokenizer_config.json"), read("config.json")
    tok = Tokenizer.from_file(str(path / "tokenizer.json"))
    special: dict[str, str | None] = {"image": None, "audio": None}
    for name in ("bos", "eos", "pad"):
        value = tc.get(f"{name}_token")
        value = value.get("content") if isinstance(value, dict) else value
        token_id = config.get(f"{name}_token_id")
        if value is None and isinstance(token_id, int):
            value = tok.id_to_token(token_id)
        special[name] = value if isinstance(value, str) and tok.token_to_id(value) is not None else None
    return TextTokenizer(tok, special, tc.get("chat_template"))


def _read_index(path: Path) -> list[Path] | None:
    index = path / "model.safetensors.index.json"
    if not index.is_file():
        return None
    return sorted({path / f for f in json.loads(index.read_text())["weight_map"].values()})


def load_hf_llama(
    path: str | Path, dtype: torch.dtype = torch.float32
) -> tuple[MultimodalModel, TextTokenizer | None, dict]:
    """An HF Llama directory (``config.json``, ``*.safetensors``, optional ``tokenizer.json`` /
    ``tokenizer_config.json`` with the chat template) → ``(model, tokenizer or None, config)``.

    Raises ``FileNotFoundError`` for missing files, ``ValueError`` for a non-Llama config or weights
    that do not fit it.
    """
    path = Path(path)
    config = json.loads((path / "config.json").read_text())
    if config.get("model_type") not in ("llama", "mistral"):
        raise ValueError(f"{str(path)!r} holds a {config.get('model_type')!r} model, not a Llama")
    if config.get("sliding_window") is not None:
        raise ValueError(
            f"sliding_window={config['sliding_window']} (Mistral-style local attention) is not supported"
        )
    model = _load_into(build_llama(config), hf_to_mmformer(_read_safetensors_dir(path), config)).to(dtype)
    tokenizer = hf_tokenizer(path) if (path / "tokenizer.json").is_file() else None
    return model, tokenizer, config


def save_hf_llama(
    model: MultimodalModel, config: dict, path: str | Path, tokenizer: TextTokenizer | None = None
) -> Path:
    """Write ``model`` as an HF Llama directory that ``LlamaForCausalLM.from_pretrained`` loads:
    ``config.json``, ``model.safetensors`` and, with a tokenizer, ``tokenizer.json`` and
    ``tokenizer_config.json`` (special tokens, chat template)."""
    from .export_files import save_safetensors

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    config = {**config, "architectures": ["LlamaForCausalLM"], "model_type": "llama"}
    config.pop("quantization_config", None)
    specials: dict[str, str] = {}
    if tokenizer is not None:  # only specials with an embedding row; pad falls back to eos (HF's habit)
        vocab = config["vocab_size"]
        for name in ("bos", "eos", "pad"):
            token_id = getattr(tokenizer, f"{name}_id")
            if token_id is not None and token_id < vocab:
                specials[name] = tokenizer.special[name]
                config[f"{name}_token_id"] = token_id
        if "pad" not in specials and "eos" in specials:
            specials["pad"], config["pad_token_id"] = specials["eos"], config["eos_token_id"]
    (path / "config.json").write_text(json.dumps(config, indent=2))
    save_safetensors(mmformer_to_hf(model, config), path / "model.safetensors", metadata={"format": "pt"})
    if tokenizer is not None:
        tokenizer.save(path / "tokenizer.json")
        tc = {f"{n}_token": t for n, t in specials.items()}
        tc.update(tokenizer_class="PreTrainedTokenizerFast", chat_template=tokenizer.chat_template)
        (path / "tokenizer_config.json").write_text(json.dumps(tc, indent=2))
    return path


# --------------------------------------------------------------------------- GGUF
def _unpermute(w: Tensor, n_heads: int) -> Tensor:
    """Undo llama.cpp's q/k row permutation (``convert_hf_to_gguf.py``: ``LlamaModel.permute``)."""
    return w.reshape(n_heads, w.shape[0] // n_heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


GGUF_NAMES = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}


def gguf_config(metadata: dict) -> dict:
    """The HF ``LlamaConfig`` dict equivalent to a GGUF file's ``llama.*`` metadata."""
    arch = metadata.get("general.architecture")
    if arch != "llama":
        raise ValueError(f"GGUF architecture {arch!r} is not supported; only 'llama'")
    m = lambda k, default=None: metadata.get(f"llama.{k}", default)  # noqa: E731
    scaling = [
        k for k in metadata if k.startswith("llama.rope.scaling.") and metadata[k] not in ("none", 1.0)
    ]
    if scaling:
        raise ValueError(f"RoPE scaling ({', '.join(scaling)}) is not supported; only the default RoPE")
    head_dim = int(m("embedding_length")) // int(m("attention.head_count"))
    if (
        int(m("rope.dimension_count", head_dim)) != head_dim
        or int(m("attention.key_length", head_dim)) != head_dim
    ):
        raise ValueError("partial RoPE or a head size other than d_model / n_heads is not supported")
    n_vocab = m("vocab_size") or len(metadata["tokenizer.ggml.tokens"])
    return {
        "model_type": "llama",
        "architectures": ["LlamaForCausalLM"],
        "hidden_size": int(m("embedding_length")),
        "num_hidden_layers": int(m("block_count")),
        "num_attention_heads": int(m("attention.head_count")),
        "num_key_value_heads": int(m("attention.head_count_kv", m("attention.head_count"))),
        "intermediate_size": int(m("feed_forward_length")),
        "rms_norm_eps": float(m("attention.layer_norm_rms_epsilon", 1e-5)),
        "rope_theta": float(m("rope.freq_base", 10_000.0)),
        "max_position_embeddings": int(m("context_length", 2048)),
        "vocab_size": int(n_vocab),
        "hidden_act": "silu",
        "attention_bias": False,
        "mlp_bias": False,
        "bos_token_id": metadata.get("tokenizer.ggml.bos_token_id"),
        "eos_token_id": metadata.get("tokenizer.ggml.eos_token_id"),
        "tie_word_embeddings": None,  # set from the tensors: tied when there is no output.weight
    }


def gguf_to_hf(tensors: dict[str, Tensor], config: dict) -> dict[str, Tensor]:
    """llama.cpp tensor names → HF Llama names, q / k rows un-permuted."""
    out = {}
    for name, t in tensors.items():
        if name == "token_embd.weight":
            out["model.embed_tokens.weight"] = t
        elif name == "output_norm.weight":
            out["model.norm.weight"] = t
        elif name == "output.weight":
            out["lm_head.weight"] = t
        elif name.startswith("blk."):
            _, i, part, kind = name.split(".")
            if part == "attn_q":
                t = _unpermute(t, config["num_attention_heads"])
            elif part == "attn_k":
                t = _unpermute(t, config["num_key_value_heads"])
            out[f"model.layers.{i}.{GGUF_NAMES[part]}.{kind}"] = t
        elif name == "rope_freqs.weight":
            raise ValueError(
                "this GGUF file scales RoPE (rope_freqs, Llama 3.1 style); that is not supported"
            )
        else:
            raise ValueError(f"unexpected GGUF tensor {name!r}")
    return out


def load_gguf_llama(
    path: str | Path, dtype: torch.dtype = torch.float32
) -> tuple[MultimodalModel, TextTokenizer, dict]:
    """A Llama GGUF file → ``(model, tokenizer, config)``; quantized weights are dequantized to float32
    (then cast to ``dtype``). Raises ``FileNotFoundError`` / ``ValueError`` (not GGUF, not Llama)."""
    gguf = read_gguf(path)
    config = gguf_config(gguf.metadata)
    sd = gguf_to_hf(gguf.tensors(), config)
    config["tie_word_embeddings"] = "lm_head.weight" not in sd
    model = _load_into(build_llama(config), hf_to_mmformer(sd, config)).to(dtype)
    return model, tokenizer_from_gguf(gguf.metadata), config
