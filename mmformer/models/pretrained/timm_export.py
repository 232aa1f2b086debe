"""mmformer ViTs out to timm: :func:`vit_config` describes a plain mmformer ViT the way
:func:`~mmformer.models.pretrained.timm_vit.describe_timm_vit` describes a timm checkpoint, and
:func:`save_timm_vit` writes it in timm's Hugging Face layout (``model.safetensors`` + ``config.json``
whose ``model_args`` rebuild exactly this architecture) with timm's own ``save_for_hf``, which
``timm.create_model("local-dir:OUT")`` loads and ``timm.models.push_to_hf_hub`` uploads. timm is
imported inside :func:`save_timm_vit` only.

``config.json``'s ``architecture`` must be a name timm registers (its loader builds that model with the
``model_args`` as overrides), so it is the plain timm ViT (Dosovitskiy et al. 2020, arXiv:2010.11929,
Table 1; DeiT's tiny, arXiv:2012.12877) whose sizes the model has when there is one, else the one of
the nearest width: :func:`timm_architecture`."""

from __future__ import annotations

import math
import os
from pathlib import Path

import torch
from torch import nn

from ...nn.blocks import Block
from ...tokenizers.image import ViTPatchTokenizer
from ..heads import ClassifierHead
from ..model import MultimodalModel
from .export_files import umask
from .timm_vit import mmformer_to_timm

# timm's plain ViT families: (width, depth, heads, MLP hidden units), and the (patch, image) sizes timm
# registers each at as ``vit_<family>_patch<P>_<S>`` (tests hold this table against timm itself).
VIT_FAMILIES = {
    "tiny": (192, 12, 3, 768),
    "small": (384, 12, 6, 1536),
    "base": (768, 12, 12, 3072),
    "large": (1024, 24, 16, 4096),
    "huge": (1280, 32, 16, 5120),
    "giant": (1408, 40, 16, 6144),
    "gigantic": (1664, 48, 16, 8192),
}
VIT_SIZES = {
    "tiny": ((16, 224), (16, 384)),
    "small": ((8, 224), (16, 224), (16, 384), (32, 224), (32, 384)),
    "base": ((8, 224), (16, 224), (16, 384), (32, 224), (32, 384)),
    "large": ((14, 224), (16, 224), (16, 384), (32, 224), (32, 384)),
    "huge": ((14, 224),),
    "giant": ((14, 224),),
    "gigantic": ((14, 224),),
}


def save_timm_vit(model: MultimodalModel, config: dict, out_dir: str | Path, head: str | None = None) -> Path:
    """Write ``model`` through timm's own Hugging Face exporter, ``timm.models.save_for_hf`` (the
    directory ``timm.models.push_to_hf_hub`` uploads): ``model.safetensors`` + ``config.json`` whose
    ``model_args`` rebuild exactly this architecture, so ``timm.create_model("local-dir:OUT")`` loads it.
    The timm model is built on the meta device and takes mmformer's tensors as its own (strict: every
    timm tensor filled, no mmformer tensor left over). ``config`` is :func:`describe_timm_vit`'s
    description (or :func:`vit_config` of an mmformer model); without an ``architecture`` there,
    :func:`timm_architecture` names it. Both files get a normal file's permissions. Raises
    ``ValueError`` for what timm's ViT cannot express."""
    import timm  # imported here: `import timm` imports wandb when it is installed (DESIGN.md)
    from timm.models import save_for_hf

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    state = mmformer_to_timm(model, head)
    num_classes = int(state["head.weight"].shape[0]) if "head.weight" in state else 0
    model_args = timm_model_args(config)
    arch = config.get("architecture") or timm_architecture(config)
    with torch.device("meta"):
        ref = timm.create_model(arch, pretrained=False, num_classes=num_classes, **model_args)
    missing, unexpected = ref.load_state_dict(state, strict=False, assign=True)
    if missing or unexpected:
        raise ValueError(
            f"timm's {arch} does not fit the model: missing {missing[:5]}, unexpected {unexpected[:5]}"
        )
    h, w = config["image_size"]
    data_config = {
        "input_size": (config["in_chans"], h, w),
        "interpolation": "bicubic",
        "crop_pct": 1.0,
        "mean": tuple(config["mean"]),
        "std": tuple(config["std"]),
    }
    # the registered name's own pretrained_cfg describes timm's weights (tag, license, hub id): not these
    ref.pretrained_cfg = {
        "architecture": arch,
        **data_config,
        "num_classes": num_classes,
        "first_conv": "patch_embed.proj",
        "classifier": "head",
    }
    save_for_hf(ref, out, model_args=model_args, safe_serialization=True, data_config=data_config)
    os.chmod(out / "model.safetensors", 0o666 & ~umask())  # safetensors writes a private (0600) file
    return out


def timm_model_args(config: dict) -> dict:
    """The ``timm.create_model`` keyword arguments that build the ViT ``config`` describes
    (:func:`vit_config`'s keys). Raises ``ValueError`` for what timm's ViT cannot express."""
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
    return model_args


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
    config = {
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
    return {"architecture": timm_architecture(config), **config}


def timm_architecture(config: dict) -> str:
    """The timm model name for ``config`` (:func:`vit_config`'s keys): the plain timm ViT of the nearest
    width, then the same patch size, then the nearest image size — so exactly the timm ViT whose width,
    depth, heads, MLP, patch and image sizes these are when there is one (``vit_tiny_patch16_224``).
    timm's loader needs a registered name; ``model_args`` carry the real sizes, which timm builds."""
    d, p, (h, w) = config["d_model"], config["patch_size"], config["image_size"]
    family = min(VIT_FAMILIES, key=lambda f: abs(math.log(VIT_FAMILIES[f][0] / d)))
    patch, image = min(VIT_SIZES[family], key=lambda s: (s[0] != p, abs(s[1] - max(h, w))))
    return f"vit_{family}_patch{patch}_{image}"


def timm_vit_names() -> dict[str, tuple[str, int, int]]:
    """``{timm name: (family, patch size, image size)}`` of the plain timm ViTs in :data:`VIT_SIZES`."""
    return {
        f"vit_{family}_patch{patch}_{image}": (family, patch, image)
        for family, sizes in VIT_SIZES.items()
        for patch, image in sizes
    }
