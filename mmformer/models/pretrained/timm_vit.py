"""timm ``VisionTransformer`` checkpoints into mmformer and back.

mmformer's ViT (``ViTPatchTokenizer`` → pre-LN ``Backbone`` → ``ClassifierHead``) uses timm's parameter
names, so a timm state dict maps onto it by prefix alone (``patch_embed.``/``cls_token``/``pos_embed``
→ the image tokenizer, ``blocks.``/``norm.`` → the backbone, ``fc_norm.``/``head.`` → the classifier).

Heads: the classifier is ``head.weight``/``head.bias`` (VisionTransformer's Linear) or ``head.fc.*``
(the layout of timm's ``ClassifierHead`` / ``NormMlpClassifierHead``). A file without one — a
feature-extractor export (``num_classes=0``), or a head with more than a projection (a norm or an MLP
before ``head.fc``, which mmformer's classifier does not implement) — loads as timm's ``num_classes=0``
model: head ``cls`` returns the pooled, ``fc_norm``-ed features ``(B, D)``, and asking for classes adds
a new zero-initialised projection. ``LoadReport.head_keys`` names the file's ``head*`` tensors.

Sources (``load_timm_vit``):
  * a directory in timm's Hugging Face layout — ``config.json`` (``architecture``, ``num_classes``,
    ``model_args``, ``pretrained_cfg`` with ``input_size``/``mean``/``std``) beside ``model.safetensors``
    or ``pytorch_model.bin`` — what ``timm.models.push_to_hf_hub``/``save_for_hf`` write and what
    ``timm.create_model("local-dir:…")`` reads;
  * one weights file (``.safetensors``, ``.pth``, ``.pt``, ``.bin``) named after its architecture as
    timm names checkpoints (``vit_small_patch16_224.augreg_in21k.safetensors``), i.e. the file one
    passes to ``timm.create_model(arch, pretrained=True, pretrained_cfg_overlay=dict(file=…))``; a
    ``.pth`` may wrap the state dict in ``state_dict``/``model`` and carry DDP's ``module.`` prefix.

The architecture (heads, pooling, class token, layer scale, …) is read from timm itself: the model is
instantiated on the meta device (no memory, no weights) and its attributes are inspected, so every
``vit_*``/``deit_*`` variant timm knows is described exactly. timm is imported here lazily (importing it
imports W&B), only when a checkpoint is read or written.

Adaptations, each reported (``LoadReport``): position embeddings resampled to a new image size
(timm's ``resample_abs_pos_embed``: bicubic, antialiased, class token excluded; non-square sizes too),
the patch embedding adapted to another number of input channels (timm's ``adapt_input_conv``), and a
new zero-initialised classifier for another number of classes. ``save_timm_vit`` writes timm's layout
back, which timm loads with ``create_model("local-dir:DIR")``.

Checkpoints are read with safetensors or ``torch.load(weights_only=True)``: never arbitrary pickle.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import Tensor, nn

from ...progress import progress
from ...tokenizers.image import ViTPatchTokenizer
from ..backbone import build_backbone
from ..backbone_config import AttentionConfig, BlockConfig, MlpConfig
from ..heads import ClassifierHead
from ..model import MultimodalModel

WEIGHT_FILES = ("model.safetensors", "pytorch_model.bin", "model.pth")
WEIGHT_SUFFIXES = (".safetensors", ".pth", ".pt", ".bin")
TOKENIZER_KEYS = ("patch_embed.", "cls_token", "pos_embed")
HEAD_KEYS = ("fc_norm.", "head.")
CLASSIFIER_PREFIXES = ("head.", "head.fc.")  # VisionTransformer's Linear; timm's ClassifierHead layout


@dataclass
class LoadReport:
    """What a load did to each parameter: ``loaded`` as is, ``resized`` (name, old shape, new shape,
    how), ``new`` (initialised here), ``ignored`` (in the checkpoint, not used); ``head_keys``: the
    file's ``head*`` tensor names as stored (sorted), ``notes``: decisions worth a line (a new classifier
    for a file that has none)."""

    source: str
    loaded: list[str] = field(default_factory=list)
    resized: list[tuple[str, tuple, tuple, str]] = field(default_factory=list)
    new: list[str] = field(default_factory=list)
    ignored: list[str] = field(default_factory=list)
    head_keys: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    def __str__(self) -> str:
        lines = [f"timm ViT {self.source}: {len(self.loaded)} tensors loaded"]
        lines += [f"  resized  {n}: {list(a)} → {list(b)} ({how})" for n, a, b, how in self.resized]
        lines += [f"  new      {n} (initialised here)" for n in self.new]
        lines += [f"  ignored  {n}" for n in self.ignored]
        lines += [f"  note     {n}" for n in self.notes]
        return "\n".join(lines)


# ----------------------------------------------------------------------------------------- reading
def read_state_dict(path: str | Path) -> dict[str, Tensor]:
    """The tensors of a ``.safetensors`` file, or of a torch file loaded with ``weights_only=True``
    (unwrapping ``state_dict``/``model``/``state_dict_ema`` and stripping ``module.``).
    Raises ``ValueError`` when the file holds no state dict."""
    path = Path(path)
    if path.suffix == ".safetensors":
        from safetensors import safe_open

        with safe_open(str(path), framework="pt") as f:
            names = list(f.keys())
            return {k: f.get_tensor(k) for k in progress(names, f"reading {path.name}", unit="tensor")}
    obj = torch.load(path, map_location="cpu", weights_only=True)
    for key in ("state_dict_ema", "state_dict", "model"):
        if isinstance(obj, dict) and isinstance(obj.get(key), dict):
            obj = obj[key]
            break
    if not isinstance(obj, dict) or not all(isinstance(v, Tensor) for v in obj.values()):
        raise ValueError(f"{str(path)!r} does not hold a state dict of tensors")
    return {k.removeprefix("module."): v for k, v in obj.items()}


def is_timm_vit_source(path: str | Path) -> bool:
    """A timm-layout directory (``config.json`` naming an ``architecture``) or a weights file."""
    path = Path(path)
    if path.is_dir():
        cfg = path / "config.json"
        return cfg.is_file() and "architecture" in json.loads(cfg.read_text())
    return path.suffix in WEIGHT_SUFFIXES


IMAGENET_MEAN, IMAGENET_STD = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)  # timm's PretrainedCfg defaults
FILE_NAME = re.compile(r"^([a-z0-9_]+?)(?:\.([\w-]+))?$")  # "vit_small_patch16_224.augreg_in21k"


def _source(path: Path) -> tuple[dict, Path]:
    """``(timm config {architecture, num_classes?, model_args, pretrained_cfg with mean/std}, weights
    file)`` without reading tensors. Normalisation: a directory's ``pretrained_cfg`` (timm's
    ImageNet defaults where it has none, as ``timm.create_model("local-dir:…")``); a file's tag in
    timm's registry, or the architecture's default tag when the name has none (as
    ``timm.create_model(arch, pretrained=True, pretrained_cfg_overlay=dict(file=…))``)."""
    if path.is_dir():
        cfg = json.loads((path / "config.json").read_text())
        if "pretrained_cfg" not in cfg:  # timm's legacy single-dict layout
            cfg = {"architecture": cfg.pop("architecture"), "pretrained_cfg": cfg, **cfg}
        pcfg = cfg["pretrained_cfg"]
        pcfg.setdefault("mean", IMAGENET_MEAN)
        pcfg.setdefault("std", IMAGENET_STD)
        weights = next((path / f for f in WEIGHT_FILES if (path / f).is_file()), None)
        if weights is None:
            raise FileNotFoundError(f"{str(path)!r} has none of {', '.join(WEIGHT_FILES)}")
        return cfg, weights
    from timm.models import get_pretrained_cfg, is_model

    name = FILE_NAME.match(path.stem)
    if name is None or not is_model(name.group(1)):
        raise ValueError(
            f"cannot tell the architecture of {path.name!r}: name the file after it as timm does "
            "(e.g. vit_small_patch16_224.augreg_in21k.safetensors) or put it in a directory with timm's "
            'config.json ({"architecture": "vit_small_patch16_224", "pretrained_cfg": {"mean": …}})'
        )
    try:
        pcfg = get_pretrained_cfg(path.stem)
    except RuntimeError:
        pcfg = None
    if pcfg is None:
        raise ValueError(
            f"timm does not know the tag of {path.name!r}, so its normalisation (mean/std) is unknown: "
            "rename it to its architecture alone or with a timm tag, or put it in a directory with timm's "
            'config.json ({"architecture": …, "pretrained_cfg": {"mean": […], "std": […]}})'
        )
    pcfg = {"mean": tuple(pcfg.mean), "std": tuple(pcfg.std)}
    return {"architecture": name.group(1), "pretrained_cfg": pcfg}, path


def classifier_prefix(keys) -> str | None:
    """Where a timm state dict with tensor names ``keys`` keeps its classifier: ``"head."`` (a
    VisionTransformer's Linear) or ``"head.fc."`` (timm's ``ClassifierHead`` layout), when its ``head.*``
    tensors are exactly that projection's weight (and bias); None otherwise — no head, or one with more
    than a projection (``NormMlpClassifierHead``'s ``head.norm``, ``head.pre_logits``), which loading the
    projection alone would silently change."""
    head = {k for k in keys if k.startswith("head.")}
    for prefix in CLASSIFIER_PREFIXES:
        if f"{prefix}weight" in head and head <= {f"{prefix}weight", f"{prefix}bias"}:
            return prefix
    return None


def _as_vit_head(state: dict[str, Tensor]) -> dict[str, Tensor]:
    """``state`` with a ``head.fc.*`` classifier renamed to VisionTransformer's ``head.*``; a head that is
    not a plain projection is left as is (it loads nowhere: reported as ignored)."""
    if classifier_prefix(state) != "head.fc.":
        return state
    return {(f"head.{k[8:]}" if k.startswith("head.fc.") else k): v for k, v in state.items()}


def _head_classes(weights: Path, state: dict[str, Tensor] | None) -> int:
    """The rows of the classifier's weight (0 when the file has none, see ``classifier_prefix``), from
    the state or the file's header alone."""
    if state is not None:
        prefix = classifier_prefix(state)
        return int(state[f"{prefix}weight"].shape[0]) if prefix else 0
    if weights.suffix == ".safetensors":
        from safetensors import safe_open

        with safe_open(str(weights), "pt") as f:
            prefix = classifier_prefix(f.keys())
            return int(f.get_slice(f"{prefix}weight").get_shape()[0]) if prefix else 0
    return _head_classes(weights, read_state_dict(weights))


def _timm_skeleton(arch: str, model_args: dict, num_classes: int) -> nn.Module:
    """timm's model for ``arch`` on the meta device: its attributes, no weights."""
    try:
        import timm
    except ImportError as e:  # pragma: no cover - timm is a dependency
        raise ImportError("reading timm checkpoints needs timm: pip install timm") from e
    if not timm.is_model(arch):
        raise ValueError(f"timm has no architecture {arch!r}")
    with torch.device("meta"):
        model = timm.create_model(arch, pretrained=False, **{**model_args, "num_classes": num_classes})
    from timm.models.vision_transformer import VisionTransformer

    if not isinstance(model, VisionTransformer):
        raise ValueError(f"{arch!r} is a {type(model).__name__}; mmformer imports timm VisionTransformers")
    return model


def _unsupported(m: nn.Module) -> list[str]:
    """The features of timm ViT ``m`` that mmformer's ViT does not implement (exact classes only: a
    subclass of timm's ``Block`` / ``Attention`` / ``Mlp`` changes the math)."""
    from timm.layers import GELU, LayerNorm, Mlp, PatchEmbed
    from timm.models.vision_transformer import Attention, Block

    blocks = list(m.blocks)
    norms = [n for n in (m.norm, m.fc_norm) if not isinstance(n, nn.Identity)]

    def exact_gelu(act) -> bool:
        return type(act) in (nn.GELU, GELU) and getattr(act, "approximate", "none") == "none"

    checks = {
        "blocks other than timm's pre-norm Block": any(type(b) is not Block for b in blocks),
        "an attention other than timm's Attention (or QK-norm)": any(
            type(b.attn) is not Attention
            or not isinstance(b.attn.q_norm, nn.Identity)
            or not isinstance(getattr(b.attn, "norm", nn.Identity()), nn.Identity)
            for b in blocks
        ),
        "an MLP other than Linear-GELU-Linear": any(
            type(b.mlp) is not Mlp
            or not exact_gelu(b.mlp.act)
            or not isinstance(getattr(b.mlp, "norm", nn.Identity()), nn.Identity)
            for b in blocks
        ),
        "a patch embedding other than one conv": type(m.patch_embed) is not PatchEmbed
        or not isinstance(m.patch_embed.norm, nn.Identity),
        "register tokens": getattr(m, "num_reg_tokens", 0) > 0,
        "no_embed_class": getattr(m, "no_embed_class", False),
        "no position embedding": getattr(m, "pos_embed", None) is None,
        "a pre-norm (CLIP-style norm_pre)": not isinstance(m.norm_pre, nn.Identity),
        f"global_pool={m.global_pool!r}": m.global_pool not in ("token", "avg"),
        "pooling over prefix tokens": getattr(m, "pool_include_prefix", False),
        "a norm other than LayerNorm": any(type(n) not in (nn.LayerNorm, LayerNorm) for n in norms)
        or any(type(n) not in (nn.LayerNorm, LayerNorm) for b in blocks for n in (b.norm1, b.norm2)),
    }
    return [k for k, v in checks.items() if v]


def _describe(timm_cfg: dict, num_classes: int) -> dict:
    arch = timm_cfg["architecture"]
    pcfg = timm_cfg["pretrained_cfg"]
    model_args = {k: v for k, v in timm_cfg.get("model_args", {}).items() if k != "num_classes"}
    m = _timm_skeleton(arch, model_args, num_classes)
    bad = _unsupported(m)
    if bad:
        raise ValueError(f"{arch} has {', '.join(bad)}, which mmformer's ViT does not implement")
    block = m.blocks[0]
    norm = next((n for n in (m.norm, m.fc_norm) if isinstance(n, nn.LayerNorm)), block.norm1)
    in_chans = int(m.patch_embed.proj.in_channels)
    mean, std = list(pcfg["mean"]), list(pcfg["std"])
    if len(mean) != in_chans:  # e.g. a grayscale export of an RGB architecture: the channel mean
        mean, std = [sum(mean) / len(mean)] * in_chans, [sum(std) / len(std)] * in_chans
    return {
        "architecture": arch,
        "model_args": model_args,
        "image_size": list(m.patch_embed.img_size),
        "patch_size": int(m.patch_embed.patch_size[0]),
        "in_chans": in_chans,
        "d_model": int(m.embed_dim),
        "n_layers": len(m.blocks),
        "n_heads": int(block.attn.num_heads),
        "mlp_hidden": int(block.mlp.fc1.out_features),
        "qkv_bias": block.attn.qkv.bias is not None,
        "layer_scale": 1e-5 if hasattr(block.ls1, "gamma") else None,  # any value: the gammas are loaded
        "norm_eps": float(norm.eps),
        "class_token": bool(m.has_class_token),
        "global_pool": m.global_pool,
        "fc_norm": not isinstance(m.fc_norm, nn.Identity),
        "final_norm": not isinstance(m.norm, nn.Identity),
        "num_classes": num_classes,
        "mean": mean,
        "std": std,
    }


def describe_timm_vit(path: str | Path) -> dict:
    """The mmformer description of a timm ViT source (JSON-able: checkpoints carry it), read from its
    config and the file's header (a ``.safetensors`` file's tensors are not read).
    Raises ``ValueError`` for a feature mmformer's ViT does not implement (register tokens, QK-norm,
    pre-norm, other block, attention, MLP or patch-embedding classes, attention pooling, …)."""
    timm_cfg, weights = _source(Path(path))
    return _describe(timm_cfg, _head_classes(weights, None))


# ----------------------------------------------------------------------------------------- building
def _tokenizer(config: dict) -> ViTPatchTokenizer:
    """The image tokenizer a description asks for (random weights)."""
    return ViTPatchTokenizer(
        config["d_model"],
        tuple(config["image_size"]),
        config["patch_size"],
        config["in_chans"],
        config["class_token"],
        tuple(config["mean"]),
        tuple(config["std"]),
    )


def build_timm_vit(config: dict) -> MultimodalModel:
    """An mmformer ViT from :func:`describe_timm_vit`'s description (random weights): tokenizer
    ``image`` and head ``cls`` — the classifier, or for ``num_classes == 0`` timm's feature head (the
    pooled, ``fc_norm``-ed features ``(B, D)``; it carries the file's ``fc_norm``)."""
    tokenizer = _tokenizer(config)
    backbone = build_backbone(
        config["d_model"],
        config["n_layers"],
        AttentionConfig(config["n_heads"], qkv_bias=config["qkv_bias"]),
        mlp=MlpConfig(hidden=config["mlp_hidden"]),
        block=BlockConfig(layer_scale=config["layer_scale"]),
        norm_eps=config["norm_eps"],
        final_norm=config["final_norm"],
    )
    head = ClassifierHead(
        config["d_model"],
        config["num_classes"],
        pool="cls" if config["global_pool"] == "token" else "mean",
        num_prefix_tokens=tokenizer.num_prefix_tokens,
        fc_norm=config["fc_norm"],
        norm_eps=config["norm_eps"],
    )
    return MultimodalModel({"image": tokenizer}, backbone, {"cls": head})


def timm_to_mmformer(state: dict[str, Tensor]) -> dict[str, Tensor]:
    """timm ViT names → mmformer names (prefixes only)."""
    out = {}
    for k, v in state.items():
        if k.startswith(TOKENIZER_KEYS):
            out[f"tokenizers.image.{k}"] = v
        elif k.startswith(HEAD_KEYS):
            out[f"heads.cls.{k}"] = v
        else:
            out[f"backbone.{k}"] = v
    return out


def mmformer_to_timm(model: MultimodalModel, head: str | None = None) -> dict[str, Tensor]:
    """The inverse of :func:`timm_to_mmformer` for a ViT model (image tokenizer ``image`` or the only
    one, classifier ``head`` or the only one), as contiguous tensors."""
    (tok_name,) = [n for n, t in model.tokenizers.items() if isinstance(t, ViTPatchTokenizer)][:1] or [None]
    if tok_name is None:
        raise ValueError("the model has no ViT image tokenizer to export")
    heads = [n for n, h in model.heads.items() if isinstance(h, ClassifierHead)]
    head = head or (heads[0] if len(heads) == 1 else None)
    out = {}
    for k, v in model.state_dict().items():
        if k.startswith(f"tokenizers.{tok_name}."):
            out[k.removeprefix(f"tokenizers.{tok_name}.")] = v
        elif k.startswith("backbone."):
            out[k.removeprefix("backbone.")] = v
        elif head is not None and k.startswith(f"heads.{head}."):
            out[k.removeprefix(f"heads.{head}.")] = v
    return {k: v.detach().contiguous() for k, v in out.items()}


# ----------------------------------------------------------------------------------------- adapting
def _grid(image_size, patch_size: int) -> tuple[int, int]:
    h, w = (image_size, image_size) if isinstance(image_size, int) else image_size
    if h % patch_size or w % patch_size:
        raise ValueError(f"image size {h}×{w} is not divisible by the patch size {patch_size}")
    return h // patch_size, w // patch_size


def adapt_state_dict(
    state: dict[str, Tensor],
    config: dict,
    report: LoadReport,
    image_size: int | tuple[int, int] | None = None,
    in_chans: int | None = None,
    num_classes: int | None = None,
) -> tuple[dict[str, Tensor], dict]:
    """``(state, config)`` for a new image size (position embeddings resampled, non-square allowed),
    input channels (patch embedding adapted) and number of classes (classifier dropped, so the new
    one starts from its initialisation; ``0`` drops the classifier). Unchanged when all are None or
    equal to the checkpoint's. Records every change in ``report``. From 3 channels the weights are
    adapted as timm's ``adapt_input_conv`` (summed for 1); from 1 channel to C they are repeated and
    divided by C, so a gray image replicated C times gives the same tokens."""
    state, config = dict(state), dict(config)
    if image_size is not None:
        new = list(_grid(image_size, config["patch_size"]))
        old = list(_grid(tuple(config["image_size"]), config["patch_size"]))
        if new != old:
            from timm.layers import resample_abs_pos_embed

            prefix = 1 if config["class_token"] else 0
            before = state["pos_embed"]
            state["pos_embed"] = resample_abs_pos_embed(before, new, old, num_prefix_tokens=prefix)
            how = f"bicubic from a {old[0]}×{old[1]} to a {new[0]}×{new[1]} patch grid, class token kept"
            report.resized.append(("pos_embed", tuple(before.shape), tuple(state["pos_embed"].shape), how))
        size = (image_size, image_size) if isinstance(image_size, int) else tuple(image_size)
        config["image_size"] = list(size)
    if in_chans is not None and in_chans != config["in_chans"]:
        before = state["patch_embed.proj.weight"]
        if before.shape[1] == 1:
            state["patch_embed.proj.weight"] = before.repeat(1, in_chans, 1, 1) / in_chans
            how = f"gray repeated over {in_chans} channels and divided by {in_chans}"
        else:
            from timm.models import adapt_input_conv

            state["patch_embed.proj.weight"] = adapt_input_conv(in_chans, before)
            how = (
                "summed over RGB (timm's adapt_input_conv)" if in_chans == 1 else "RGB repeated and rescaled"
            )
        report.resized.append(
            (
                "patch_embed.proj.weight",
                tuple(before.shape),
                tuple(state["patch_embed.proj.weight"].shape),
                how,
            )
        )
        config["in_chans"] = in_chans
        mean, std = config["mean"], config["std"]
        if in_chans == 1:  # grayscale: the channel mean of the RGB statistics
            config["mean"], config["std"] = [sum(mean) / len(mean)], [sum(std) / len(std)]
        else:
            config["mean"] = [mean[i % len(mean)] for i in range(in_chans)]
            config["std"] = [std[i % len(std)] for i in range(in_chans)]
    if num_classes is not None and num_classes != config["num_classes"]:
        for k in ("head.weight", "head.bias"):
            if k in state:
                report.ignored.append(f"{k} {list(state.pop(k).shape)} (replaced: {num_classes} classes)")
        if not config["num_classes"]:
            report.notes.append(_new_head_note(num_classes))
        config["num_classes"] = num_classes
    return state, config


def load_timm_vit(
    path: str | Path,
    dtype: torch.dtype = torch.float32,
    image_size: int | tuple[int, int] | None = None,
    in_chans: int | None = None,
    num_classes: int | None = None,
) -> tuple[MultimodalModel, dict, LoadReport]:
    """``(model, config, report)`` for a timm ViT source (see the module docstring), adapted with
    :func:`adapt_state_dict`. ``model(pixels, "image", "cls")`` equals timm's forward.

    Raises ``FileNotFoundError`` / ``ValueError`` (unknown architecture, unsupported feature, weights
    whose names or shapes do not fit it)."""
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"{str(path)!r} does not exist")
    timm_cfg, weights = _source(path)
    state = read_state_dict(weights)
    config = _describe(timm_cfg, _head_classes(weights, state))
    report = LoadReport(str(path), head_keys=sorted(k for k in state if k.startswith("head")))
    state = _as_vit_head(state)
    state, config = adapt_state_dict(state, config, report, image_size, in_chans, num_classes)
    model = build_timm_vit(config)
    mapped = timm_to_mmformer(state)
    own = model.state_dict()
    usable = {}
    extra = [k for k in mapped if k not in own and not k.startswith("heads.")]
    if extra:  # weights of a part mmformer's ViT lacks: loading without them would change the math
        shown = ", ".join(_timm_name(k) for k in extra[:5])
        raise ValueError(
            f"{path} has weights mmformer's ViT has no place for: {shown}{' …' if len(extra) > 5 else ''}"
        )
    for k, v in mapped.items():
        if k not in own:
            report.ignored.append(_timm_name(k))
        elif own[k].shape != v.shape:
            raise ValueError(
                f"{path}: {k} has shape {list(v.shape)} but {config['architecture']} expects {list(own[k].shape)}"
            )
        else:
            usable[k] = v
    missing = [k for k in own if k not in usable]
    absent = [k for k in missing if not k.startswith("heads.")]
    if absent:
        raise ValueError(f"{path} lacks {', '.join(absent[:5])}{' …' if len(absent) > 5 else ''}")
    model.load_state_dict(usable, strict=False)
    report.loaded = sorted(_timm_name(k) for k in usable)
    report.new = [_timm_name(k) for k in missing]
    return model.to(dtype), config, report


def _timm_name(key: str) -> str:
    """``tokenizers.image.pos_embed`` → ``pos_embed``, ``backbone.blocks.0…`` → ``blocks.0…``."""
    parts = key.split(".")
    return ".".join(parts[2:] if parts[0] in ("tokenizers", "heads") else parts[1:])


def adapt_tokenizer(
    tokenizer: ViTPatchTokenizer,
    config: dict,
    report: LoadReport,
    image_size: int | tuple[int, int] | None = None,
    in_chans: int | None = None,
) -> tuple[ViTPatchTokenizer, dict]:
    """A loaded ViT tokenizer at another image size and/or number of input channels (see
    :func:`adapt_state_dict`), with the updated description; unchanged when neither differs."""
    state, new = adapt_state_dict(tokenizer.state_dict(), config, report, image_size, in_chans)
    if (new["image_size"], new["in_chans"]) == (list(config["image_size"]), config["in_chans"]):
        return tokenizer, config
    out = _tokenizer(new).to(tokenizer.pos_embed.dtype)
    out.load_state_dict(state)
    return out, new


def _new_head_note(num_classes: int) -> str:
    return f"the file has no classifier: a new zero-initialised one for {num_classes} classes"


def adapt_classifier(head: ClassifierHead, num_classes: int, report: LoadReport) -> ClassifierHead:
    """The loaded classifier, or a copy with a new zero-initialised projection for ``num_classes``
    (its pooling and ``fc_norm`` kept); from a feature head (``num_classes == 0``: the file has no
    classifier) the new one is noted in ``report``."""
    old, width = head.num_classes, head.d_model
    if num_classes == old:
        return head
    pool = "cls" if head.pool == "cls" else "mean"
    fc_norm = not isinstance(head.fc_norm, nn.Identity)
    eps = head.fc_norm.eps if fc_norm else 1e-6
    out = ClassifierHead(width, num_classes, pool, head.num_prefix_tokens, fc_norm, norm_eps=eps)
    if fc_norm:
        out.fc_norm.load_state_dict(head.fc_norm.state_dict())
    if old:
        report.ignored.append(f"head.weight [{old}, {width}] (replaced: {num_classes} classes)")
    else:
        report.notes.append(_new_head_note(num_classes))
    report.new += ["head.weight", "head.bias"]
    dtype = next((p.dtype for p in head.parameters()), torch.get_default_dtype())
    return out.to(dtype)
