"""``mmformer info RECIPE [key=value …]``: the resolved recipe, the model's parameters and FLOPs."""

from __future__ import annotations

from ..build import build_model
from ..models import count_flops
from ..models.generate import context_length
from ..recipe import load_recipe, recipe_to_yaml


def cmd_info(args) -> int:

    recipe = load_recipe(args.recipe, args.overrides)
    print("# resolved recipe\n" + recipe_to_yaml(recipe))
    print("\n".join(describe_model(build_model(recipe), recipe)))
    return 0


def _named_parts(recipe):
    m = recipe.model
    yield "backbone", m.backbone
    yield from ((f"towers.{n}", c) for n, c in m.towers.items())
    yield from ((f"tokenizers.{n}", c) for n, c in m.tokenizers.items())
    yield from ((f"heads.{n}", c) for n, c in m.heads.items())


def _parts(recipe):
    return [c for _, c in _named_parts(recipe)]


def describe_model(model, recipe) -> list[str]:
    """Parameter counts per part and FLOPs per sample for each task (``count_flops``: measured with the
    softmax kernels on the eager path, every other kernel as itself)."""
    tables = (
        ("tokenizers", "backbone", "towers", "heads")
        if len(model.towers)
        else ("tokenizers", "backbone", "heads")
    )
    parts = {p: sum(x.numel() for x in getattr(model, p).parameters()) for p in tables}
    total = sum(x.numel() for x in model.parameters())  # shared (tied) tensors counted once
    shared = " — tied weights counted once in the total" if total != sum(parts.values()) else ""
    lines = [f"parameters: {total:,} (" + ", ".join(f"{k} {v:,}" for k, v in parts.items()) + f"{shared})"]
    trainable = sum(x.numel() for x in model.parameters() if x.requires_grad)
    if trainable != total:  # frozen parts or LoRA: say what actually trains
        parts = [(f"tokenizers.{n}", m) for n, m in model.tokenizers.items()]
        parts += [(f"backbone.blocks.{i}", b) for i, b in enumerate(model.backbone.blocks)]
        parts += [(f"towers.{n}", t) for n, t in model.towers.items()]
        parts += [
            ("backbone.norm", model.backbone.norm),
            *((f"heads.{n}", m) for n, m in model.heads.items()),
        ]
        frozen = [
            n
            for n, m in parts
            if any(True for _ in m.parameters()) and not any(p.requires_grad for p in m.parameters())
        ]
        blocks = [n for n in frozen if n.startswith("backbone.blocks.")]
        if len(blocks) > 1:
            frozen = [n for n in frozen if n not in blocks[1:]]
            frozen[frozen.index(blocks[0])] = f"backbone.blocks.0-{blocks[-1].rsplit('.', 1)[1]}"
        what = f"frozen: {', '.join(frozen)}" if frozen else ""
        if recipe.model.lora is not None:
            lora = recipe.model.lora
            what = f"LoRA rank {lora.rank} on {', '.join(lora.targets)}; the pretrained weights are frozen"
        lines.append(f"trainable: {trainable:,} ({100 * trainable / total:.1f} %); {what}")
    for source in sorted({getattr(c, "source", None) for c in _parts(recipe)} - {None}):
        names = [w for w, c in _named_parts(recipe) if getattr(c, "source", None) == source]
        lines.append(f"pretrained {source}: loaded {', '.join(names)}")
    for name, task in recipe.tasks.items():
        tok = model.tokenizers[task.tokenizer]
        head = getattr(task, "head", None)  # a prefix-LM's sequence mixes two tokenizers: not counted yet
        if head is not None and hasattr(tok, "example_input") and task.tokenizer not in model.towers:
            rows = getattr(model.heads[head], "rows_per_sample", 1)  # a pair head reads two sequences
            inputs = tok.example_input(rows)
            fits = context_length(model, task.tokenizer)  # AFT's position biases may hold fewer tokens
            if fits is not None and hasattr(tok, "vocab_size"):
                fits -= getattr(tok, "num_prefix_tokens", 0)
                if inputs.shape[1] > fits:
                    inputs = tok.example_input(rows, length=fits)
            flops = count_flops(model, inputs, task.tokenizer, head)
            length = inputs.shape[1] if hasattr(tok, "vocab_size") else None
            what = (
                "sample"
                if length is None
                else f"pair of sequences of {length} tokens"
                if rows == 2
                else f"sequence of {length} tokens"
            )
            example = (
                "; an example length: the tokenizer sets no max_len"
                if getattr(tok, "max_len", 0) is None
                else ""
            )
            lines.append(
                f"FLOPs per {what} ({name}{example}): forward {flops['forward'] / 1e6:,.1f} M, "
                f"train step (fwd+bwd) {flops['train'] / 1e6:,.1f} M"
            )
    return lines
