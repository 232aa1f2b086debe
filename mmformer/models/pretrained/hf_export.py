"""mmformer models out to Hugging Face layouts by inverting the importers' key maps.

An importer's ``hf_to_mmformer(sd, config)`` (``bert.py``, ``llama.py``) is the one table of names: it
renames HF tensors and stacks some of them row-wise (BERT's query / key / value into one ``qkv``). So
that no second, hand-written table can drift from it, :func:`invert_key_map` runs the importer on
*probes* — for each tensor of the reference layout a 1-D tensor of unique row ids — and reads off,
for every mmformer tensor, which rows of which HF tensor it was built from. Writing those rows back
gives the HF state dict. It handles renames, row-wise concatenation and splitting (``torch.cat`` /
``split`` / ``chunk`` along dim 0) and repeated reads (a tied embedding); anything else (a transpose,
arithmetic) raises ``ValueError``: the result is imported again and must give the model back.

BERT (:func:`save_hf_bert`): ``BertModel.from_pretrained(OUT)`` loads the encoder (embeddings and
layers; the pooler, which mmformer does not model, is left to transformers' initialisation, and the
``last_hidden_state`` equals mmformer's hidden states). The reference layout's tensor shapes come from
transformers' own ``BertModel`` built on the meta device (no memory, no weights). Reference:
transformers' ``modeling_bert.py``; parity test in ``tests/models/test_hub_export.py``.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import torch
from torch import Tensor, nn

from ...nn.blocks import PostNormBlock
from ...nn.mlp import Mlp
from ...tokenizers.text import TextEmbedding, TextTokenizer
from ..model import MultimodalModel
from .bert import hf_to_mmformer as bert_hf_to_mmformer
from .export_files import save_safetensors

KeyMap = Callable[[dict[str, Tensor], dict], dict[str, Tensor]]


def invert_key_map(
    to_mmformer: KeyMap, reference: dict[str, tuple[int, ...]], config: dict, state: dict[str, Tensor]
) -> tuple[dict[str, Tensor], list[str]]:
    """``state`` (mmformer names) in the layout ``to_mmformer`` imports from.

    Args:
        to_mmformer: an importer's key map, ``(HF state dict, config) → mmformer state dict``.
        reference: ``{HF name: shape}`` of the full reference layout.
        config: passed to ``to_mmformer``.
        state: the mmformer tensors (a ``state_dict``).

    Returns ``(HF state dict, HF names the importer never reads)`` — the second are not exported.
    Raises ``ValueError`` when ``state`` lacks a tensor the map fills, when the map does more than move
    whole rows (a ``(rows, 1, …)`` probe comes out transposed, or not as long row ids), when an HF tensor
    would be only partly written, or when importing the result does not give ``state`` back exactly.
    """
    names = list(reference)
    rows = [shape[0] if shape else 1 for shape in reference.values()]
    starts = torch.tensor([0, *rows]).cumsum(0)
    probes = {}
    for i, k in enumerate(
        names
    ):  # (rows, 1, …): a transpose changes the shape, so it cannot pass for a rename
        ids = torch.arange(int(starts[i]), int(starts[i + 1]))
        probes[k] = ids.reshape(rows[i], *[1] * (len(reference[k]) - 1)) if reference[k] else ids[0]
    traced = to_mmformer(probes, config)
    out: dict[str, Tensor] = {}
    seen: dict[str, Tensor] = {}
    for mm_key, ids in traced.items():
        if mm_key not in state:
            raise ValueError(f"the model has no {mm_key!r}, which the key map fills")
        value = state[mm_key].detach()
        if ids.dim() == 0 and value.dim() == 0:
            ids, value = ids.reshape(1), value.reshape(1)
        moved = ids.dim() == value.dim() and ids.shape[:1] == value.shape[:1] and set(ids.shape[1:]) <= {1}
        if ids.dtype != torch.long or not moved:
            raise ValueError(f"{mm_key!r}: the key map does more than rename and stack rows")
        ids = ids.reshape(-1)
        if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= int(starts[-1])):
            raise ValueError(f"{mm_key!r}: the key map does more than rename and stack rows")
        owner = torch.searchsorted(starts, ids, right=True) - 1  # which HF tensor each row came from
        for i in owner.unique().tolist():
            key, sel = names[i], owner == i
            if key not in out:
                out[key] = value.new_empty((rows[i], *value.shape[1:]))
                seen[key] = torch.zeros(rows[i], dtype=torch.bool)
            local = ids[sel] - starts[i]
            out[key][local] = value[sel]
            seen[key][local] = True
    for key, tensor in list(out.items()):
        shape = reference[key]
        if not bool(seen[key].all()):
            raise ValueError(f"{key!r} would be written only in part by the inverted key map")
        if tensor.numel() != torch.Size(shape).numel():
            raise ValueError(f"{key!r}: the model's tensor has shape {tuple(tensor.shape)}, HF's {shape}")
        out[key] = tensor.reshape(shape).contiguous()
    try:  # the importer reads the export back: it must give these very tensors
        back = to_mmformer(out, config)
    except KeyError as e:
        raise ValueError(
            f"the inverted key map does not round-trip: the importer reads {e}, not written"
        ) from None
    wrong = [k for k, v in back.items() if k not in state or not torch.equal(v, state[k].detach())]
    if wrong:
        raise ValueError(f"the inverted key map does not round-trip: {wrong[:5]} differ when imported again")
    return out, [k for k in names if k not in out]


# --------------------------------------------------------------------------------------------- BERT
def bert_config(model: MultimodalModel) -> dict:
    """The HF ``BertConfig`` dict of an mmformer BERT-shaped encoder (imported with ``load_hf_bert`` or
    trained with ``block: post``, learned positions and an embedding LayerNorm).

    Raises ``ValueError`` naming what BERT's layout cannot express."""
    emb = model.tokenizers["text"] if "text" in model.tokenizers else None
    bb = model.backbone
    block = bb.blocks[0]
    attn = getattr(block, "attn", None)
    act = getattr(getattr(block, "mlp", None), "act", None)
    problems = [
        (not isinstance(emb, TextEmbedding), "a 'text' tokenizer that is a TextEmbedding"),
        (isinstance(emb, TextEmbedding) and emb.pos_embed is None, "learned absolute positions"),
        (
            isinstance(emb, TextEmbedding) and not isinstance(emb.norm, nn.LayerNorm),
            "an embedding LayerNorm",
        ),
        (any(type(b) is not PostNormBlock for b in bb.blocks), "post-norm blocks"),
        (not isinstance(bb.norm, nn.Identity), "no final norm"),
        (bb.causal or bb.positions.kind != "none", "bidirectional attention without relative positions"),
        (
            not isinstance(block.mlp, Mlp) or not isinstance(act, nn.GELU) or act.approximate != "none",
            "an exact-GELU MLP",
        ),
        (
            attn is not None
            and (attn.n_kv_heads != attn.n_heads or not isinstance(attn.q_norm, nn.Identity)),
            "plain multi-head attention",
        ),
        (attn is not None and (attn.qkv.bias is None or attn.proj.bias is None), "biases"),
        (any(type(m).__name__ == "LoRALinear" for m in model.modules()), "merged LoRA adapters"),
    ]
    for bad, what in problems:
        if bad:
            raise ValueError(f"the model is not BERT-shaped: BERT's layout needs {what}")
    eps = {float(emb.norm.eps), float(block.norm1.eps), float(block.norm2.eps)}
    if len(eps) != 1:
        raise ValueError(f"BERT has one LayerNorm eps; this model uses {sorted(eps)}")
    return {
        "model_type": "bert",
        "architectures": ["BertModel"],
        "vocab_size": emb.embed.num_embeddings,
        "hidden_size": bb.d_model,
        "num_hidden_layers": len(bb.blocks),
        "num_attention_heads": attn.n_heads,
        "intermediate_size": block.mlp.fc1.out_features,
        "hidden_act": "gelu",
        "max_position_embeddings": emb.pos_embed.num_embeddings,
        "type_vocab_size": emb.type_embed.num_embeddings if emb.type_embed is not None else 1,
        "layer_norm_eps": eps.pop(),
        "position_embedding_type": "absolute",
        "hidden_dropout_prob": float(emb.drop.p),
        "attention_probs_dropout_prob": 0.1,
        "torch_dtype": "float32",
    }


def bert_reference_shapes(config: dict) -> dict[str, tuple[int, ...]]:
    """``{name: shape}`` of transformers' ``BertModel`` (no pooler) for ``config``, built on the meta
    device. transformers is imported here: the model library stands without it, only this export
    needs its layout."""
    import transformers

    with torch.device("meta"):
        ref = transformers.BertModel(transformers.BertConfig(**config), add_pooling_layer=False)
    return {k: tuple(v.shape) for k, v in ref.state_dict().items()}


def save_hf_bert(
    model: MultimodalModel, config: dict, path: str | Path, tokenizer: TextTokenizer | None = None
) -> Path:
    """Write ``model``'s encoder as an HF BERT directory that ``BertModel.from_pretrained`` loads:
    ``config.json``, ``model.safetensors`` and, with a tokenizer, ``tokenizer.json`` and
    ``tokenizer_config.json`` (bos/eos as BERT's ``[CLS]``/``[SEP]``, pad, mask). A model without token
    types gets one all-zero token-type row (BERT always adds one: zero changes nothing). Heads are not
    exported. Raises ``ValueError`` as :func:`invert_key_map`."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    state = {k: v.detach() for k, v in model.state_dict().items()}
    type_key = "tokenizers.text.type_embed.weight"
    if type_key not in state:
        state[type_key] = torch.zeros(1, config["hidden_size"])
    reference = bert_reference_shapes(config)
    tensors, _unread = invert_key_map(bert_hf_to_mmformer, reference, config, state)
    config = dict(config)
    if tokenizer is not None and tokenizer.pad_id is not None and tokenizer.pad_id < config["vocab_size"]:
        config["pad_token_id"] = tokenizer.pad_id
    (path / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    save_safetensors(tensors, path / "model.safetensors", metadata={"format": "pt"})
    if tokenizer is not None:
        tokenizer.save(path / "tokenizer.json")
        names = {"bos": "cls_token", "eos": "sep_token", "pad": "pad_token", "mask": "mask_token"}
        tc = {hf: tokenizer.special[n] for n, hf in names.items() if tokenizer.special.get(n) is not None}
        tc.update(
            tokenizer_class="PreTrainedTokenizerFast", model_max_length=config["max_position_embeddings"]
        )
        (path / "tokenizer_config.json").write_text(json.dumps(tc, indent=2) + "\n")
    return path
