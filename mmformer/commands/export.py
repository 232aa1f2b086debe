"""``mmformer export CHECKPOINT --out DIR``: a trained checkpoint in its reference layout (HF Llama,
timm ViT, or one safetensors file)."""

from __future__ import annotations

from pathlib import Path

from ..build import load_checkpoint
from ..errors import RecipeError, UsageError
from ..evaluation import load_checkpoint as load_task_checkpoint
from ..models.pretrained import llama_config, save_hf_llama
from ..models.pretrained.timm_export import save_timm_vit, vit_config
from ..nn.lora import merge_lora
from ..training.sharded import export_safetensors
from .generate import _generation_model


def cmd_export(args) -> int:
    """Write a trained checkpoint in its reference layout: a Llama-layout model (a fine-tuned SmolLM2,
    LoRA merged) as an HF directory, a ViT classifier as a timm directory."""
    if args.format == "safetensors":
        n = export_safetensors(args.checkpoint, args.out)
        print(f"wrote {n} tensors (the training module's state_dict, recipe in the metadata) to {args.out}")
        return 0
    if args.format == "timm" or (args.format == "auto" and _is_vit_checkpoint(args.checkpoint)):
        return _export_timm(args)

    model, tok, _, _ = _generation_model(args.checkpoint)
    merged = merge_lora(model)
    try:
        config = llama_config(model)
    except ValueError as e:
        raise UsageError(f"{args.checkpoint}: {e}") from None
    save_hf_llama(model, config, args.out, tok)
    extra = f" ({merged} LoRA adapters merged)" if merged else ""
    print(f"wrote an HF Llama directory to {args.out}{extra}; load it with LlamaForCausalLM.from_pretrained")
    return 0


def _export_timm(args) -> int:

    loaded, task = load_task_checkpoint(args.checkpoint, "classification")
    head = loaded.module.tasks[task].head
    merge_lora(loaded.model)
    try:
        config = vit_config(loaded.model, head)
    except ValueError as e:
        raise UsageError(f"{args.checkpoint}: {e}") from None
    sources = [c["config"] for c in getattr(loaded.module, "pretrained_configs", {}).values()]
    arch = next((c["architecture"] for c in sources if "architecture" in c), None)
    config["architecture"] = arch or config["architecture"]
    save_timm_vit(loaded.model, config, args.out, head)
    print(
        f"wrote a timm ViT directory to {args.out}; load it with "
        f'timm.create_model("local-dir:{args.out}", pretrained=True)'
    )
    return 0


def _is_vit_checkpoint(path: Path) -> bool:
    """A training checkpoint whose recipe has an image classification task."""
    if not Path(path).is_file() or Path(path).suffix != ".ckpt":
        return False
    try:
        loaded = load_checkpoint(path)
    except RecipeError:
        return False
    modality = loaded.context.tokenizer_modality
    return any(
        t.kind == "classification" and modality(loaded.recipe.model.tokenizers[t.tokenizer]) == "image"
        for t in loaded.recipe.tasks.values()
    )
