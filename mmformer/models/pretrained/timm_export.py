"""mmformer ViTs out to timm: :func:`vit_config` describes a plain mmformer ViT the way
:func:`~mmformer.models.pretrained.timm_vit.describe_timm_vit` describes a timm checkpoint, and
:func:`save_timm_vit` writes it in timm's Hugging Face layout (``model.safetensors`` + ``config.json``
whose ``model_args`` rebuild exactly this architecture), which ``timm.create_model("local-dir:OUT")``
loads. timm itself is not imported here."""

from __future__ import annotations

import json
import math
from pathlib import Path

from torch import nn

from ...nn.blocks import Block
from ...tokenizers.image import ViTPatchTokenizer
from ..heads import ClassifierHead
from ..model import MultimodalModel
from .timm_vit import mmformer_to_timm


def save_timm_vit(model: MultimodalModel, config: dict, out_dir: str | Path, head: str | None = None) -> Path:
    """Write ``model`` in timm's Hugging Face layout (``model.safetensors`` + ``config.json`` whose
    ``model_args`` rebuild exactly this architecture): ``timm.create_model("local-dir:OUT")`` loads it.
    ``config`` is :func:`describe_timm_vit`'s description (or :func:`vit_config` of an mmformer model)."""
    from safetensors.torch import save_file

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    state = mmformer_to_timm(model, head)
    num_classes = int(state["head.weight"].shape[0]) if "head.weight" in state else 0
    h, w = config["image_size"]
    if config["final_norm"] and config["fc_norm"]:
        raise ValueError("timm's ViT has a final norm or an fc_norm, not both")
    if abs(config["norm_eps"] - 1e-6) > 1e-12:
        raise ValueError(f"timm's ViT uses LayerNorm eps 1e-6; this model uses {config['norm_eps']}")
    d, hidden = config["d_model"], config["mlp_hidden"]
    mlp_ratio = hidden / d
    while int(d * mlp_ratio) < hidden:  # timm builds int(d · ratio) hidden units: never one short
        mlp_ratio = math.nextafter(mlp_ratio, math.inf)
    model_args = {
        **config.get("model_args", {}),
        "img_size": [h, w] if h != w else h,
        "patch_size": config["patch_size"],
        "in_chans": config["in_chans"],
        "embed_dim": config["d_model"],
        "depth": config["n_layers"],
        "num_heads": config["n_heads"],
        "mlp_ratio": mlp_ratio,
        "qkv_bias": config["qkv_bias"],
        "class_token": config["class_token"],
        "global_pool": config["global_pool"],
        "fc_norm": config["fc_norm"],
        "final_norm": config["final_norm"] or config["fc_norm"],  # timm: which norm follows the blocks
    }
    if config.get("layer_scale") is not None:
        model_args["init_values"] = config["layer_scale"]
    arch = config.get("architecture") or "vit_base_patch16_224"
    timm_cfg = {
        "architecture": arch,
        "num_classes": num_classes,
        "num_features": config["d_model"],
        "global_pool": config["global_pool"],
        "model_args": model_args,
        "pretrained_cfg": {
            "input_size": [config["in_chans"], h, w],
            "fixed_input_size": True,
            "interpolation": "bicubic",
            "mean": list(config["mean"]),
            "std": list(config["std"]),
            "num_classes": num_classes,
            "first_conv": "patch_embed.proj",
            "classifier": "head",
        },
    }
    save_file(state, str(out / "model.safetensors"))
    (out / "config.json").write_text(json.dumps(timm_cfg, indent=2) + "\n")
    return out


def vit_config(model: MultimodalModel, head: str | None = None) -> dict:
    """The :func:`describe_timm_vit`-style description of an mmformer ViT (e.g. one trained from scratch),
    for :func:`save_timm_vit`. Raises ``ValueError`` for a model that is not a plain ViT."""
    toks = [t for t in model.tokenizers.values() if isinstance(t, ViTPatchTokenizer)]
    if len(toks) != 1:
        raise ValueError("export to timm needs exactly one ViT image tokenizer")

    tok, bb = toks[0], model.backbone
    block = bb.blocks[0]
    mlp_act = getattr(block.mlp, "act", None)
    checks = {
        "blocks other than the pre-norm Block": any(type(b) is not Block for b in bb.blocks),
        "positions other than learned absolute ones": bb.positions.kind != "none",
        "causal or windowed attention": bb.causal or bb.long_context.window is not None,
        "BigBird block-sparse attention": bb.long_context.bigbird is not None,
        "norms other than LayerNorm": type(block.norm1) is not nn.LayerNorm,
        "an MLP other than Linear-GELU(erf)-Linear": not isinstance(mlp_act, nn.GELU)
        or mlp_act.approximate != "none",
        "QK-norm or grouped key/value heads": not isinstance(block.attn.q_norm, nn.Identity)
        or block.attn.n_kv_heads != block.attn.n_heads,
        "unmerged LoRA adapters": type(block.attn.qkv) is not nn.Linear,
    }
    bad = [k for k, v in checks.items() if v]
    if bad:
        raise ValueError(f"timm's ViT has no {', '.join(bad)}")
    heads = [
        h for n, h in model.heads.items() if isinstance(h, ClassifierHead) and (head is None or n == head)
    ]
    cls = heads[0] if len(heads) == 1 else None
    norm = bb.norm if isinstance(bb.norm, nn.LayerNorm) else (cls.fc_norm if cls is not None else None)
    ls = getattr(block, "ls1", None)
    return {
        "architecture": "vit_base_patch16_224",
        "model_args": {},
        "image_size": list(tok.patch_embed.image_size),
        "patch_size": tok.patch_embed.patch_size,
        "in_chans": tok.in_chans,
        "d_model": bb.d_model,
        "n_layers": len(bb.blocks),
        "n_heads": block.attn.n_heads,
        "mlp_hidden": block.mlp.fc1.out_features,
        "qkv_bias": block.attn.qkv.bias is not None,
        "layer_scale": float(ls.gamma.detach().mean()) if hasattr(ls, "gamma") else None,
        "norm_eps": norm.eps if norm is not None else 1e-6,
        "class_token": tok.cls_token is not None,
        "global_pool": "token" if cls is None or cls.pool == "cls" else "avg",
        "fc_norm": cls is not None and not isinstance(cls.fc_norm, nn.Identity),
        "final_norm": not isinstance(bb.norm, nn.Identity),
        "num_classes": cls.head.out_features if cls is not None else 0,
        "mean": list(tok.mean),
        "std": list(tok.std),
    }
