"""``mmformer export CHECKPOINT OUT``: a trained checkpoint in its reference layout (HF Llama, HF BERT,
timm ViT through timm's own ``save_for_hf``, or one safetensors file), each with a model card beside it
(``OUT/README.md``; ``OUT.md`` beside a safetensors file) that the Hugging Face Hub shows. The
directories are what ``huggingface-cli upload`` / ``timm.models.push_to_hf_hub`` /
``model.push_to_hub`` upload (docs/pretrained.md); nothing here touches the network."""

from __future__ import annotations

import math
from pathlib import Path

from ..build import build_model, load_checkpoint
from ..errors import RecipeError, UsageError
from ..evaluation import load_checkpoint as load_task_checkpoint
from ..model_card import CardFacts, ExportInfo, checkpoint_facts, write_card
from ..models.pretrained import llama_config, load_pretrained, save_hf_llama
from ..models.pretrained.bert import SentenceEmbeddingHead
from ..models.pretrained.hf_export import bert_config, save_hf_bert
from ..models.pretrained.timm_export import save_timm_vit, vit_config
from ..nn.lora import merge_lora
from ..training.sharded import export_safetensors


def cmd_export(args) -> int:
    """Write a trained checkpoint in its reference layout and its model card: a Llama-layout model (a
    fine-tuned SmolLM2, LoRA merged) or a BERT-layout encoder as an HF directory, a ViT classifier as a
    timm directory, any checkpoint as one safetensors file."""
    if args.format == "safetensors":
        n = export_safetensors(args.checkpoint, args.out)
        card = Path(args.out).with_suffix(".md")
        write_card(card, _facts(args.checkpoint), _safetensors_info(args, n))
        print(f"wrote {n} tensors (the training module's state_dict, recipe in the metadata) to {args.out}")
        print(f"wrote the model card {card}")
        return 0
    if args.format == "timm" or (args.format == "auto" and _is_vit_checkpoint(args.checkpoint)):
        return _export_timm(args)
    return _export_hf(args)


def _export_hf(args) -> int:
    """An HF Llama directory (``--format llama``, or ``auto`` for a Llama-shaped model) or an HF BERT
    directory (``--format bert``, or ``auto`` for a BERT-shaped encoder)."""
    model, tok, facts = _text_model(args.checkpoint)
    merged = merge_lora(model)
    extra = f" ({merged} LoRA adapters merged)" if merged else ""
    reasons = []
    if args.format in ("auto", "llama"):
        try:
            config = llama_config(model)
        except ValueError as e:
            if args.format == "llama":
                raise UsageError(f"{args.checkpoint}: {e}") from None
            reasons.append(str(e))
        else:
            save_hf_llama(model, config, args.out, tok)
            _card(args, facts, _llama_info(args, model, tok, extra))
            print(
                f"wrote an HF Llama directory to {args.out}{extra}; "
                "load it with LlamaForCausalLM.from_pretrained"
            )
            return 0
    try:
        config = bert_config(model)
    except ValueError as e:
        raise UsageError(f"{args.checkpoint}: {'; '.join([*reasons, str(e)])}") from None
    save_hf_bert(model, config, args.out, tok)
    _card(args, facts, _bert_info(args, model, extra))
    print(f"wrote an HF BERT directory to {args.out}{extra}; load it with BertModel.from_pretrained")
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
    try:
        save_timm_vit(loaded.model, config, args.out, head)
    except ValueError as e:
        raise UsageError(f"{args.checkpoint}: {e}") from None
    _card(args, _facts(args.checkpoint), _timm_info(args, config, head))
    print(
        f"wrote a timm ViT directory to {args.out} (timm's save_for_hf); load it with "
        f'timm.create_model("local-dir:{args.out}", pretrained=True)'
    )
    return 0


# ---------------------------------------------------------------------------------- loading
def _text_model(source: Path):
    """``(model, text tokenizer or None, card facts)`` of an mmformer checkpoint (its recipe and
    tokenizer travel inside) or of pretrained weights (a known name, a .gguf file, an HF directory)."""
    source = Path(source)
    if not source.is_file() or source.suffix == ".gguf":
        pretrained = load_pretrained(source)
        return pretrained.model, pretrained.tokenizer, CardFacts(name=source.name, source=str(source))
    loaded = load_checkpoint(source)
    model = build_model(loaded.recipe, loaded.context)
    state = loaded.state["state_dict"]
    model.load_state_dict({k.removeprefix("model."): v for k, v in state.items() if k.startswith("model.")})
    text = loaded.context.pinned_text
    tok = text.get("text") or next(iter(text.values()), None)
    return model.eval(), tok, checkpoint_facts(source, loaded.state, _modalities(loaded))


def _facts(path: Path) -> CardFacts:
    """Card facts of a training checkpoint, or of pretrained weights (no recipe, no metrics)."""
    path = Path(path)
    try:
        loaded = load_checkpoint(path)
    except RecipeError:
        return CardFacts(name=path.stem, source=str(path))
    return checkpoint_facts(path, loaded.state, _modalities(loaded))


def _modalities(loaded) -> dict[str, str]:
    modality = loaded.context.tokenizer_modality
    return {n: modality(loaded.recipe.model.tokenizers[t.tokenizer]) for n, t in loaded.recipe.tasks.items()}


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


# ---------------------------------------------------------------------------------- model cards
def _card(args, facts: CardFacts, info: ExportInfo) -> None:
    path = write_card(Path(args.out) / "README.md", facts, info)
    print(f"wrote the model card {path}")


def _repo(args, facts_name: str) -> str:
    return getattr(args, "repo_id", None) or f"<user>/{facts_name}"


def _n_params(files: list[Path]) -> int:
    """Scalars in the exported safetensors files (read from their headers)."""
    from safetensors import safe_open

    n = 0
    for f in files:
        with safe_open(str(f), framework="pt") as st:
            for k in st.keys():
                shape = st.get_slice(k).get_shape()
                n += math.prod(shape)
    return n


def _info(args, **kw) -> ExportInfo:
    return ExportInfo(
        license=getattr(args, "license", None) or "other", repo_id=getattr(args, "repo_id", None), **kw
    )


def _timm_info(args, config: dict, head: str) -> ExportInfo:
    repo = _repo(args, Path(args.out).name)
    c, (h, w) = config["in_chans"], config["image_size"]
    classes = config.get("num_classes", 0)
    usage = f"""import timm, torch

model = timm.create_model("hf-hub:{repo}", pretrained=True).eval()  # or "local-dir:{args.out}"
data = timm.data.resolve_data_config({{}}, model=model)  # {h}x{w}, {c} channel(s), the run's mean / std
transform = timm.data.create_transform(**data)
logits = model(transform(image).unsqueeze(0))  # image: a PIL image"""
    return _info(
        args,
        fmt="timm",
        pipeline_tag="image-classification" if classes else "image-feature-extraction",
        parts=f"the ViT (patch embedding, blocks, norm) and the classifier head `{head}` ({classes} classes), "
        "written by timm's `save_for_hf`",
        usage=usage,
        n_params=_n_params([Path(args.out) / "model.safetensors"]),
        limitations=[
            f"Inputs are {h}×{w} images with {c} channel(s), normalised with mean {list(config['mean'])} and "
            f"std {list(config['std'])}; other sizes need timm's position-embedding resampling.",
            "Class ids are the indices mmformer gave the training labels (image folders: sorted sub-folder "
            "names); the export carries no label names.",
        ],
    )


def _llama_info(args, model, tok, extra: str) -> ExportInfo:
    repo = _repo(args, Path(args.out).name)
    usage = f"""from transformers import AutoModelForCausalLM, AutoTokenizer

tokenizer = AutoTokenizer.from_pretrained("{repo}")  # or the local directory {args.out}
model = AutoModelForCausalLM.from_pretrained("{repo}")
ids = tokenizer("In the beginning", return_tensors="pt").input_ids
print(tokenizer.decode(model.generate(ids, max_new_tokens=32)[0]))"""
    return _info(
        args,
        fmt="transformers",
        pipeline_tag="text-generation",
        parts=f"the decoder and its LM head as `LlamaForCausalLM`{extra}"
        + (", the tokenizer (chat template included)" if tok is not None else ", no tokenizer"),
        usage=usage,
        n_params=_n_params([Path(args.out) / "model.safetensors"]),
        limitations=[
            "A language model continues text; it can state falsehoods and repeat its training data."
        ],
    )


def _bert_info(args, model, extra: str) -> ExportInfo:
    repo = _repo(args, Path(args.out).name)
    dropped = [n for n in model.heads]
    mean_pool = any(isinstance(h, SentenceEmbeddingHead) for h in model.heads.values())
    pool = (
        "\nmask = batch.attention_mask[..., None]\n"
        "embedding = torch.nn.functional.normalize((hidden * mask).sum(1) / mask.sum(1), dim=-1)"
        if mean_pool
        else ""
    )
    usage = f"""import torch
from transformers import AutoTokenizer, BertModel

tokenizer = AutoTokenizer.from_pretrained("{repo}")  # or the local directory {args.out}
model = BertModel.from_pretrained("{repo}", add_pooling_layer=False).eval()
batch = tokenizer(["a sentence"], return_tensors="pt", padding=True)
hidden = model(**batch).last_hidden_state{pool}"""
    return _info(
        args,
        fmt="transformers",
        pipeline_tag="feature-extraction",
        parts=f"the encoder (embeddings and layers) as `BertModel`{extra}; not exported: the heads "
        f"{', '.join(f'`{n}`' for n in dropped) or '(none)'} and BERT's pooler, which mmformer has not",
        usage=usage,
        n_params=_n_params([Path(args.out) / "model.safetensors"]),
        limitations=[
            "Use `last_hidden_state`: BERT's pooler is not part of the export (load with "
            "`add_pooling_layer=False`; otherwise transformers initialises it at random)."
        ],
    )


def _safetensors_info(args, n: int) -> ExportInfo:
    usage = f"""from safetensors import safe_open
from safetensors.torch import load_file

state = load_file("{args.out}")  # the training module's state_dict: model.…, task parts
with safe_open("{args.out}", framework="pt") as f:
    recipe_yaml = f.metadata()["mmformer_recipe"]  # rebuild the model with mmformer from this recipe"""
    return _info(
        args,
        fmt="safetensors",
        pipeline_tag=None,
        parts=f"{n} tensors: the training module's full state_dict, with the recipe in the file's metadata",
        usage=usage,
        n_params=_n_params([Path(args.out)]),
    )
