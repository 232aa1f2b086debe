"""``mmformer generate CHECKPOINT|PRETRAINED --prompt …``: continue prompts with a language model."""

from __future__ import annotations

from pathlib import Path

import torch

from ..build import build_model, load_checkpoint
from ..errors import RecipeError, UsageError
from ..models.generate import generate
from ..models.pretrained import load_pretrained


def _generation_model(source: Path):
    """``(model, text tokenizer, tokenizer name, head name)`` from an mmformer checkpoint (its recipe and
    BPE travel inside) or from pretrained weights (a known name, a .gguf file, an HF Llama directory)."""
    if not source.is_file() or source.suffix == ".gguf":
        pretrained = load_pretrained(source)
        if "lm" not in pretrained.model.heads:
            raise UsageError(f"{source} is a {pretrained.family} encoder; generation needs a language model")
        return pretrained.model, pretrained.tokenizer, "text", "lm"
    loaded = load_checkpoint(source)
    text = loaded.context.pinned_text
    task = next((t for t in loaded.recipe.tasks.values() if t.kind == "causal_lm"), None)
    if task is None or task.tokenizer not in text:
        raise RecipeError(f"{source} has no causal language-model task to generate with")
    model = build_model(loaded.recipe, loaded.context)
    state = loaded.state["state_dict"]
    model.load_state_dict({k.removeprefix("model."): v for k, v in state.items() if k.startswith("model.")})
    return model, text[task.tokenizer], task.tokenizer, task.head


def cmd_generate(args) -> int:
    """Continue ``--prompt`` texts with a trained text model or pretrained weights; ``--chat`` wraps each
    prompt as a user message in the model's chat template."""

    model, tok, tokenizer_name, head = _generation_model(args.checkpoint)
    prompts = list(args.prompt)
    if args.chat:
        if not tok.chat_template:
            raise UsageError(f"{args.checkpoint} carries no chat template; drop --chat")
        system = [{"role": "system", "content": args.system}] if args.system else []
        prompts = [tok.apply_chat_template([*system, {"role": "user", "content": p}]) for p in prompts]
    ids, valid = tok.pad_batch([tok.encode(p) for p in prompts], side="left")
    gen = torch.Generator().manual_seed(args.seed)
    try:
        outs = generate(
            model,
            tokenizer_name,
            head,
            ids,
            valid,
            args.max_new_tokens,
            tok.eos_id,
            args.temperature,
            args.top_k,
            args.top_p,
            gen,
            compile=args.compile_mode or args.compile,
            bar=True,
            prompt_lookup_num_tokens=args.prompt_lookup,
        )
    except ValueError as e:  # an empty or over-long prompt: the user's input, not a bug
        raise UsageError(str(e)) from None
    for prompt, out in zip(args.prompt, outs):
        print(tok.decode(out, skip_special=True) if args.chat else prompt + tok.decode(out))
        print("---")
    return 0
