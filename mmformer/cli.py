"""``mmformer train | validate | generate | export | info | data`` — a thin layer over ``config`` and ``build``.

mmformer train RECIPE.yaml [key=value ...]     e.g. optim.lr=3e-4 trainer.devices=2 resume=auto
mmformer validate CHECKPOINT.ckpt [key=value ...]
mmformer info RECIPE.yaml [key=value ...]
mmformer data prepare NAME [--force] | mmformer data list | mmformer data shard SRC --out DIR
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import warnings
from pathlib import Path

log = logging.getLogger("mmformer")


def _is_rank_zero() -> bool:
    return all(os.environ.get(v, "0") == "0" for v in ("RANK", "LOCAL_RANK", "NODE_RANK", "SLURM_PROCID"))


def _say(msg: str) -> None:
    if _is_rank_zero():
        print(msg, flush=True)


def cmd_train(args) -> int:
    from lightning.pytorch.utilities.exceptions import SIGTERMException

    from .config import load_recipe
    from .training.preemption import Preempted

    recipe = load_recipe(args.recipe, args.overrides)
    kept = [o for o in args.overrides if not o.startswith("resume=")]
    again = " ".join(["mmformer train", str(args.recipe), *kept, "resume=auto"])
    try:
        trainer, run = train(recipe, verbose=True)
    except Preempted as e:  # every rank stopped at the same step; exit as the signal's default would
        saved = (
            f"saved {e.checkpoint}" if e.checkpoint else "no checkpoint saved (checkpoint.save_last=false)"
        )
        _say(f"stopped by {signal.Signals(e.signum).name} at step {e.step}; {saved}\ncontinue with: {again}")
        return e.exit_code
    except SIGTERMException:  # Lightning's own handler (a signal before the run's handler was installed)
        _say(f"stopped by SIGTERM before training started; continue with: {again}")
        return 143
    if not trainer.is_global_zero:
        return 0
    if trainer.interrupted:
        print(f"interrupted at step {trainer.global_step}; run folder: {run.dir}\ncontinue with: {again}")
        return 130
    _report(trainer, run)
    return 0


def train(recipe, extra_callbacks=(), verbose: bool = False):
    """Train a resolved recipe (what ``mmformer train`` does); returns ``(trainer, run)``.

    Ends with a validation of the final weights when the last step was not already validated.
    ``verbose`` prints the resolved recipe, the model's size and FLOPs, and what is resumed.
    """
    import lightning as L

    from .build import build_datamodule, build_module, build_trainer, pin_checkpoint
    from .config import recipe_to_yaml
    from .training.callbacks import LastValidationStep
    from .training.loggers import finish_loggers
    from .training.runs import RESUME_ENV, RUN_ID_ENV, describe_resume, open_run
    from .training.sharded import read_meta

    L.seed_everything(recipe.seed, workers=True, verbose=False)
    run = open_run(recipe.name, recipe.resume)
    trainer = None
    resumed = None if run.resume_from is None else read_meta(run.resume_from)  # recipe, tokenizers, step
    try:
        pin_checkpoint(resumed)  # a resumed run reads data with the checkpoint's own tokenizers
        datamodule = build_datamodule(recipe)  # fails here, before anything long, on bad data paths
        module = build_module(recipe)
        if verbose:
            _say("# resolved recipe\n" + recipe_to_yaml(recipe))
            _say("\n".join(describe_model(module.model, recipe)))
        tracker = LastValidationStep()
        trainer = build_trainer(recipe, run, module, extra_callbacks=[tracker, *extra_callbacks])
        if run.resume_from is not None and verbose:
            _say(describe_resume(run, recipe_to_yaml(recipe), resumed))
        if recipe.trainer.validate_first and run.resume_from is None:  # the "before" numbers, at step 0
            trainer.validate(module, datamodule=datamodule, verbose=False)
            if verbose:
                _say("before training: " + _val_metrics(trainer))
        trainer.fit(
            module, datamodule=datamodule, ckpt_path=str(run.resume_from) if run.resume_from else None
        )
        if not trainer.interrupted and tracker.step != trainer.global_step:  # final weights not validated yet
            trainer.validate(module, datamodule=datamodule, verbose=False)
    finally:
        pin_checkpoint(None)
        if trainer is not None:
            finish_loggers(trainer.loggers)
        os.environ.pop(RUN_ID_ENV, None)
        os.environ.pop(RESUME_ENV, None)
    return trainer, run


def _val_metrics(trainer) -> str:
    metrics = {k: float(v) for k, v in trainer.callback_metrics.items() if k.startswith("val/")}
    return ", ".join(f"{k} {metrics[k]:.4f}" for k in sorted(metrics))


def _named_parts(recipe):
    m = recipe.model
    yield "backbone", m.backbone
    yield from ((f"towers.{n}", c) for n, c in m.towers.items())
    yield from ((f"tokenizers.{n}", c) for n, c in m.tokenizers.items())
    yield from ((f"heads.{n}", c) for n, c in m.heads.items())


def _parts(recipe):
    return [c for _, c in _named_parts(recipe)]


def describe_model(model, recipe) -> list[str]:
    """Parameter counts per part and FLOPs per sample for each task (counted on the eager path)."""
    from .models import count_flops

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
            flops = count_flops(model, tok.example_input(1), task.tokenizer, head)
            what = (
                "sample"
                if not hasattr(tok, "vocab_size")
                else f"sequence of {tok.example_input(1).shape[1]} tokens"
            )
            lines.append(
                f"FLOPs per {what} ({name}): forward {flops['forward'] / 1e6:,.1f} M, "
                f"train step (fwd+bwd) {flops['train'] / 1e6:,.1f} M"
            )
    return lines


def _report(trainer, run) -> None:
    metrics = {k: float(v) for k, v in trainer.callback_metrics.items() if k.startswith("val/")}
    for key in sorted(metrics):
        print(f"{key} {metrics[key]:.4f}")
    print(f"run folder: {run.dir}")
    print(f"checkpoints: {run.checkpoints}")
    wandb_dir = run.dir / "wandb"
    if wandb_dir.exists():
        offline = sorted(wandb_dir.glob("offline-run-*"))
        if offline:
            print(f"W&B (offline): {offline[-1]}  — upload with: wandb sync {offline[-1]}")
        else:
            print(f"W&B: {wandb_dir}")


def cmd_validate(args) -> int:
    import lightning as L

    from .build import build_datamodule, build_module, build_strategy, pin_checkpoint
    from .config import RecipeError, recipe_from_yaml
    from .training.sharded import is_sharded, read_checkpoint

    if not (args.checkpoint.is_file() or is_sharded(args.checkpoint)):
        raise FileNotFoundError(f"checkpoint {str(args.checkpoint)!r} does not exist")
    ckpt = read_checkpoint(args.checkpoint)  # a sharded folder is merged here
    if "recipe_yaml" not in ckpt.get("mmformer", {}):
        raise RecipeError(f"{args.checkpoint} is not an mmformer training checkpoint (it carries no recipe)")
    recipe = recipe_from_yaml(ckpt["mmformer"]["recipe_yaml"], args.overrides)
    pin_checkpoint(ckpt)  # read the data with the tokenizer the weights were trained with
    try:
        module = build_module(recipe)
        datamodule = build_datamodule(recipe)
    finally:
        pin_checkpoint(None)
    module.load_state_dict(ckpt["state_dict"])
    t = recipe.trainer
    trainer = L.Trainer(
        accelerator=t.accelerator,
        devices=t.devices,
        strategy=build_strategy(t),
        precision=t.precision,
        logger=False,
        enable_checkpointing=False,
        use_distributed_sampler=False,
        limit_val_batches=t.limit_val_batches,
        enable_progress_bar=t.enable_progress_bar,
    )
    trainer.validate(module, datamodule=datamodule, verbose=False)
    if trainer.is_global_zero:
        for key, value in sorted(trainer.callback_metrics.items()):
            if key.startswith("val/"):
                print(f"{key} {float(value):.4f}")
    return 0


class UsageError(Exception):
    """Bad command-line input; printed as one ``mmformer: error:`` line."""


def _generation_model(source: Path):
    """``(model, text tokenizer, tokenizer name, head name)`` from an mmformer checkpoint (its recipe and
    BPE travel inside) or from pretrained weights (a known name, a .gguf file, an HF Llama directory)."""
    import torch

    from .build import build_model, pin_checkpoint
    from .config import RecipeError, recipe_from_yaml
    from .tokenizers.text import TextTokenizer

    if not source.is_file() or source.suffix == ".gguf":
        from .models.pretrained import load_pretrained

        pretrained = load_pretrained(source)
        if "lm" not in pretrained.model.heads:
            raise UsageError(f"{source} is a {pretrained.family} encoder; generation needs a language model")
        return pretrained.model, pretrained.tokenizer, "text", "lm"
    ckpt = torch.load(source, map_location="cpu", weights_only=True)
    state = ckpt.get("mmformer", {})
    if "recipe_yaml" not in state:
        raise RecipeError(f"{source} is not an mmformer training checkpoint (it carries no recipe)")
    recipe = recipe_from_yaml(state["recipe_yaml"])
    text = {n: TextTokenizer.from_json(j) for n, j in state.get("tokenizers", {}).items()}
    task = next((t for t in recipe.tasks.values() if t.kind == "causal_lm"), None)
    if task is None or task.tokenizer not in text:
        raise RecipeError(f"{source} has no causal language-model task to generate with")
    pin_checkpoint(ckpt)
    try:
        model = build_model(recipe, text)
    finally:
        pin_checkpoint(None)
    model.load_state_dict(
        {k.removeprefix("model."): v for k, v in ckpt["state_dict"].items() if k.startswith("model.")}
    )
    return model, text[task.tokenizer], task.tokenizer, task.head


def cmd_generate(args) -> int:
    """Continue ``--prompt`` texts with a trained text model or pretrained weights; ``--chat`` wraps each
    prompt as a user message in the model's chat template."""
    import torch

    from .models.generate import generate

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
            compile=args.compile,
        )
    except ValueError as e:  # an empty or over-long prompt: the user's input, not a bug
        raise UsageError(str(e)) from None
    for prompt, out in zip(args.prompt, outs):
        print(tok.decode(out, skip_special=True) if args.chat else prompt + tok.decode(out))
        print("---")
    return 0


def cmd_sample(args) -> int:
    """Sample images from a diffusion checkpoint into a PNG grid; with ``--classifier`` also measure
    class-conditional samples (classifier accuracy and Fréchet distance to the real validation images)."""
    import torch
    from torchvision.utils import make_grid, save_image

    from .evaluation import ClassifierFeatures, evaluate_class_conditional, load_checkpoint, real_images

    if args.out is None and args.classifier is None:
        raise UsageError("say what to do: --out GRID.png (samples) and/or --classifier CKPT (measure them)")
    loaded, name = load_checkpoint(args.checkpoint, "diffusion")
    task = loaded.module.tasks[name]
    k = loaded.model.tokenizers[task.tokenizer].num_classes
    if args.class_ is not None and not k:
        raise UsageError(f"{args.checkpoint} is not class-conditional; drop --class")
    if args.prompt and task.caption_tokenizer is None:
        raise UsageError(f"{args.checkpoint} is not text-conditional; drop --prompt")
    if task.caption_tokenizer is not None and not args.prompt:
        raise UsageError(f"{args.checkpoint} is text-conditional: give --prompt TEXT (repeat for more rows)")
    if args.class_ is not None and not 0 <= args.class_ < k:
        raise UsageError(f"--class {args.class_} is outside the model's classes 0…{k - 1}")
    if args.classifier is not None:
        classifier, cls_task = load_checkpoint(args.classifier, "classification")
        features = ClassifierFeatures(classifier, cls_task)
        real = real_images(loaded, name)
        scales = args.cfg_scale_list or [args.cfg_scale]
        if min(scales) < 0:
            raise UsageError(f"guidance scales must be >= 0, got {scales}")
        for scale, scores in zip(
            scales,
            evaluate_class_conditional(
                loaded, name, features, real, args.per_class, scales, args.steps, args.sampler, args.seed
            ),
        ):
            print(
                f"cfg_scale {scale:g} steps {args.steps} sampler {args.sampler or 'default'}: "
                f"classifier accuracy {scores['accuracy']:.4f}, Fréchet distance {scores['frechet_distance']:.3f} "
                f"({int(scores['samples'])} samples vs {len(real)} real)"
            )
    if args.out is not None:
        captions = None
        if args.prompt:  # one row of --n samples per prompt
            from .data.image_caption import encode_captions
            from .tokenizers.text import TextTokenizer

            text = TextTokenizer.from_json(loaded.module.tokenizer_files[task.caption_tokenizer])
            ids = [s for s in encode_captions(text, list(args.prompt), 64) for _ in range(args.n)]
            captions = text.pad_batch(ids)
            labels = None
        elif args.class_ is not None:
            labels = torch.full((args.n,), args.class_, dtype=torch.long)
        elif k:  # one row of --n samples per class
            labels = torch.arange(k).repeat_interleave(args.n)
        else:
            labels = None
        try:
            images = task.sample(
                loaded.model,
                labels,
                n=args.n,
                cfg_scale=args.cfg_scale if labels is not None or captions is not None else 1.0,
                steps=args.steps,
                sampler=args.sampler,
                generator=torch.Generator().manual_seed(args.seed),
                captions=captions,
            )
        except ValueError as e:
            raise UsageError(str(e)) from None
        nrow = args.n if (k and args.class_ is None) or args.prompt else 8
        args.out.parent.mkdir(parents=True, exist_ok=True)
        save_image(make_grid((images + 1) / 2, nrow=nrow, padding=1), args.out)
        print(f"wrote {len(images)} samples to {args.out}")
    return 0


def _export_timm(args) -> int:
    from .evaluation import load_checkpoint
    from .models.pretrained.timm_vit import save_timm_vit, vit_config
    from .nn.lora import merge_lora

    loaded, task = load_checkpoint(args.checkpoint, "classification")
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


def cmd_export(args) -> int:
    """Write a trained checkpoint in its reference layout: a Llama-layout model (a fine-tuned SmolLM2,
    LoRA merged) as an HF directory, a ViT classifier as a timm directory."""
    from .models.pretrained import llama_config, save_hf_llama

    if args.format == "safetensors":
        from .training.sharded import export_safetensors

        n = export_safetensors(args.checkpoint, args.out)
        print(f"wrote {n} tensors (the training module's state_dict, recipe in the metadata) to {args.out}")
        return 0
    if args.format == "timm" or (args.format == "auto" and _is_vit_checkpoint(args.checkpoint)):
        return _export_timm(args)
    from .nn.lora import merge_lora

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


def _is_vit_checkpoint(path: Path) -> bool:
    """A training checkpoint whose recipe has an image classification task."""
    import torch

    from .build import pin_checkpoint, tokenizer_modality
    from .config import recipe_from_yaml

    if not Path(path).is_file() or Path(path).suffix != ".ckpt":
        return False
    ckpt = torch.load(path, map_location="cpu", weights_only=True)
    if "recipe_yaml" not in ckpt.get("mmformer", {}):
        return False
    pin_checkpoint(ckpt)
    try:
        recipe = recipe_from_yaml(ckpt["mmformer"]["recipe_yaml"])
        return any(
            t.kind == "classification" and tokenizer_modality(recipe.model.tokenizers[t.tokenizer]) == "image"
            for t in recipe.tasks.values()
        )
    finally:
        pin_checkpoint(None)


def cmd_info(args) -> int:
    from .build import build_model
    from .config import load_recipe, recipe_to_yaml

    recipe = load_recipe(args.recipe, args.overrides)
    print("# resolved recipe\n" + recipe_to_yaml(recipe))
    print("\n".join(describe_model(build_model(recipe), recipe)))
    return 0


def cmd_data(args) -> int:
    from .data.prepare import BUNDLED, prepare
    from .data.roots import data_root

    if args.action == "list":
        width = max(len(n) for n in BUNDLED)
        for name, b in BUNDLED.items():
            state = "prepared" if b.is_prepared(data_root() / name) else "not prepared"
            print(f"{name:{width}s} {state:13s} {b.description}")
        return 0
    if args.action == "shard":
        return _shard(args)
    if not args.name:
        raise SystemExit("usage: mmformer data prepare NAME  (see: mmformer data list)")
    prepare(args.name, force=args.force)  # logs where the dataset is
    return 0


def _shard(args) -> int:
    from .data.caption_shards import CAPTION_MODALITIES, shard_captions
    from .data.roots import resolve_root
    from .data.shards import shard_folder, shard_text

    if not args.name or args.out is None:
        modalities = "image|audio|text|image_caption|audio_caption"
        raise UsageError(f"usage: mmformer data shard SOURCE --out DIR --modality {modalities}")
    if args.tokenizer is not None and args.modality != "text":
        raise UsageError("--tokenizer counts the tokens of text shards (--modality text) for packing")
    src = resolve_root(args.name)
    if args.modality == "text":
        tokenizer = None
        if args.tokenizer is not None:
            from .tokenizers.text import TextTokenizer

            tokenizer = TextTokenizer.from_file(args.tokenizer)
        info = shard_text(src, args.out, args.val_fraction, args.seed, args.samples_per_shard, tokenizer)
    elif args.modality in CAPTION_MODALITIES:
        info = shard_captions(src, args.out, args.modality, args.text_key, args.samples_per_shard)
    else:
        info = shard_folder(src, args.out, args.modality, args.samples_per_shard)
    for split, shards in info["splits"].items():
        print(f"{split}: {sum(n for _, n in shards)} samples in {len(shards)} shards")
    print(f"wrote {args.out}/index.json; read it with data: {{kind: shards, root: {args.out}}}")
    return 0


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def _non_negative_float(text: str) -> float:
    value = float(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {value}")
    return value


def _probability(text: str) -> float:
    value = float(text)
    if not 0.0 < value <= 1.0:
        raise argparse.ArgumentTypeError(f"must be in (0, 1], got {value}")
    return value


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="mmformer", description="Multimodal transformer training platform.")
    sub = p.add_subparsers(dest="command", required=True)
    t = sub.add_parser("train", help="train a recipe")
    t.add_argument("recipe", type=Path)
    t.add_argument("overrides", nargs="*", help="key=value recipe overrides, e.g. optim.lr=3e-4 resume=auto")
    t.set_defaults(fn=cmd_train)
    v = sub.add_parser("validate", help="evaluate a checkpoint on its recipe's validation data")
    v.add_argument(
        "checkpoint", type=Path, help="a .ckpt written by mmformer train (its recipe travels inside)"
    )
    v.add_argument("overrides", nargs="*", help="key=value recipe overrides, e.g. trainer.devices=1")
    v.set_defaults(fn=cmd_validate)
    g = sub.add_parser(
        "generate",
        help="continue a text prompt with a trained or pretrained language model",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
        description="Continue prompts; stops at eos or at the end of the model's context (max_len of learned "
        "positions).",
    )
    g.add_argument(
        "checkpoint",
        type=Path,
        help="a .ckpt of a recipe with a causal_lm task, or pretrained weights: a known name "
        "(smollm2-135m-instruct), a .gguf file or an HF Llama directory",
    )
    g.add_argument("--prompt", action="append", required=True, help="a prompt (repeat for a batch)")
    g.add_argument("--max-new-tokens", type=_positive_int, default=64)
    g.add_argument("--temperature", type=_non_negative_float, default=0.0, help="0 = greedy")
    g.add_argument("--top-k", type=_positive_int, default=None, help="sample among the k most likely tokens")
    g.add_argument("--top-p", type=_probability, default=None, help="nucleus sampling mass, in (0, 1]")
    g.add_argument("--seed", type=int, default=0, help="sampling is seeded: the same seed repeats the output")
    g.add_argument("--chat", action="store_true", help="wrap each prompt in the model's chat template")
    g.add_argument("--system", default=None, help="system message for --chat (default: the template's)")
    g.add_argument(
        "--compile",
        action="store_true",
        help="decode with a compiled graph (torch.compile, frozen weights): ~1.4x faster per token, after a "
        "compile of a few minutes — worth it for thousands of new tokens, not for a short answer",
    )
    g.set_defaults(fn=cmd_generate)
    e = sub.add_parser(
        "export",
        help="write a checkpoint in its reference layout: HF Llama (LoRA merged), timm ViT, or one "
        "safetensors file (sharded checkpoints merged)",
        description="A Llama-layout model becomes an HF directory (config.json, model.safetensors, "
        "tokenizer.json, tokenizer_config.json with the chat template) that transformers' "
        "LlamaForCausalLM.from_pretrained loads; a ViT image classifier becomes a timm directory "
        "(config.json, model.safetensors) that timm.create_model('local-dir:OUT', pretrained=True) loads; "
        "--format safetensors writes any checkpoint's weights, a sharded checkpoint folder merged, to "
        "the file OUT.",
    )
    e.add_argument(
        "checkpoint",
        type=Path,
        help="a .ckpt (file or sharded folder) written by mmformer train, or pretrained weights",
    )
    e.add_argument("out", type=Path, help="output directory (a file for --format safetensors)")
    e.add_argument(
        "--format",
        choices=("auto", "llama", "timm", "safetensors"),
        default="auto",
        help="auto: timm for an image classifier",
    )
    e.set_defaults(fn=cmd_export)
    sp = sub.add_parser(
        "sample",
        help="sample images from a diffusion checkpoint (a PNG grid); --classifier also measures them",
    )
    sp.add_argument("checkpoint", type=Path)
    sp.add_argument("--class", dest="class_", type=int, default=None, help="class id (default: every class)")
    sp.add_argument(
        "--prompt", action="append", default=None, help="caption for a text-conditional model (repeatable)"
    )
    sp.add_argument(
        "--n",
        type=_positive_int,
        default=8,
        help="samples of --class, or per class (one row each) without it",
    )
    sp.add_argument(
        "--cfg-scale", type=_non_negative_float, default=1.0, help="classifier-free guidance; 1 = off"
    )
    sp.add_argument(
        "--steps",
        type=_positive_int,
        default=50,
        help="sampling steps (DDIM / Euler / Heun; DDPM uses all T)",
    )
    sp.add_argument("--sampler", choices=["ddim", "ddpm", "euler", "heun"], default=None)
    sp.add_argument("--seed", type=int, default=0)
    sp.add_argument("--out", type=Path, default=None, help="PNG grid to write")
    sp.add_argument(
        "--classifier", type=Path, default=None, help="a classifier checkpoint trained on the real images"
    )
    sp.add_argument("--per-class", type=_positive_int, default=100, help="samples per class to measure")
    sp.add_argument(
        "--cfg-scales",
        dest="cfg_scale_list",
        type=float,
        nargs="+",
        default=None,
        help="measure at several guidance scales, e.g. --cfg-scales 1 3",
    )
    sp.set_defaults(fn=cmd_sample)

    i = sub.add_parser("info", help="print the resolved recipe, parameter count and FLOPs per sample")
    i.add_argument("recipe", type=Path)
    i.add_argument("overrides", nargs="*", help="key=value recipe overrides")
    i.set_defaults(fn=cmd_info)
    d = sub.add_parser(
        "data",
        help="bundled datasets; WebDataset shards",
        description="prepare NAME: build a bundled dataset; list: the bundled datasets; shard SOURCE --out DIR "
        "--modality image|audio|text|image_caption|audio_caption: write WebDataset tar shards of a class "
        "folder (SOURCE/<split>/<class>/<file>), a text corpus or caption manifests (SOURCE/<split>.jsonl, "
        "as data.kind image_caption / audio_caption read), with an index.json that data.kind: shards reads.",
    )
    d.add_argument("action", choices=["prepare", "list", "shard"])
    d.add_argument("name", nargs="?", help="a bundled dataset name, or (shard) a source path or bundled name")
    d.add_argument("--force", action="store_true", help="rebuild even if already prepared")
    d.add_argument("--out", type=Path, help="shard: the output folder")
    d.add_argument(
        "--modality",
        choices=["image", "audio", "text", "image_caption", "audio_caption"],
        default="image",
        help="shard: what SOURCE holds",
    )
    d.add_argument(
        "--samples-per-shard", type=_positive_int, default=1000, help="shard: samples per tar file"
    )
    d.add_argument(
        "--val-fraction", type=float, default=0.05, help="shard text: documents held out (as data.kind text)"
    )
    d.add_argument("--seed", type=int, default=0, help="shard text: the split's seed (the recipe's seed)")
    d.add_argument(
        "--tokenizer",
        type=Path,
        default=None,
        help="shard text: a tokenizer.json (the recipe's); each shard's token count is stored for data.pack",
    )
    d.add_argument(
        "--text-key", default=None, help="shard captions: the manifest field of the caption (caption / text)"
    )
    d.set_defaults(fn=cmd_data)
    return p


def _drop_advertising(record: logging.LogRecord) -> bool:
    return "litlogger" not in record.getMessage()


def _setup_logging() -> None:
    """mmformer's own messages (data preparation, skipped samples) go to stderr, once."""
    for h in list(log.handlers):
        if getattr(h, "_mmformer", False):
            log.removeHandler(h)
    handler = logging.StreamHandler()  # bound to the current sys.stderr
    handler.setFormatter(logging.Formatter("%(message)s"))
    handler._mmformer = True
    log.addHandler(handler)
    log.setLevel(logging.INFO)
    log.propagate = False


def main(argv: list[str] | None = None) -> int:
    from .config import RecipeError
    from .data.roots import DataError, DataNotFoundError

    # Known-harmless deprecation noise from Lightning's use of torch.utils._pytree on torch 2.14.
    warnings.filterwarnings("ignore", message=r".*LeafSpec.*")
    # A resumed run continues in its own checkpoint folder: that it is not empty is expected.
    warnings.filterwarnings("ignore", message=r"Checkpoint directory .* exists and is not empty")
    logging.getLogger("lightning.pytorch.utilities.rank_zero").addFilter(_drop_advertising)
    _setup_logging()
    args = _parser().parse_args(argv)
    had_group = _process_group_initialized()
    try:
        rc = args.fn(args)
    except (RecipeError, DataError, DataNotFoundError, FileNotFoundError, UsageError) as e:
        msg = e.args[0] if e.args else str(e)
        print(f"mmformer: error: {msg}", file=sys.stderr)
        return 2
    if not had_group and _process_group_initialized():
        _close_process_group()
    return rc


def _process_group_initialized() -> bool:
    if "torch" not in sys.modules:  # ``data list`` and friends never import torch
        return False
    import torch.distributed as dist

    return dist.is_available() and dist.is_initialized()


def _close_process_group() -> None:
    """Destroy the distributed process group the command's run created (Lightning leaves it behind).

    Left to the interpreter's exit, gloo's worker threads can be torn down while still joinable and the
    process aborts ("terminate called without an active exception", exit -6) after a successful run;
    ``torch.distributed.destroy_process_group`` docs ask for this call at the end of main. Only after a
    normal return: a rank that failed must not wait on the others here (torchtitan does the same). A
    group the caller had before ``main`` is left alone; a failure here is logged, the run's result stands.
    """
    import torch.distributed as dist

    try:
        dist.destroy_process_group()
    except Exception as e:  # teardown must not turn a finished run into a failure
        log.warning("could not destroy the distributed process group: %s", e)


if __name__ == "__main__":
    sys.exit(main())
