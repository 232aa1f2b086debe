"""``mmformer sample CHECKPOINT``: sample images from any checkpoint whose task samples (diffusion, maskgit,
…: ``mmformer.evaluation``), and measure them.

``--steps`` (default: the recipe's ``sample_steps``) means what the task's sampler counts: DDIM / Euler /
Heun steps for a DiT (DDPM always runs all T), parallel-decoding rounds T for MaskGIT (each predicts every
masked code; at most the number of codes). ``--sampler`` is the task's to check (a DiT's ``ddim | ddpm |
euler | heun``; MaskGIT has one, ``maskgit``)."""

from __future__ import annotations

import torch
from torchvision.utils import make_grid, save_image

from ..data.image_caption import encode_captions
from ..errors import UsageError
from ..evaluation import (
    ClassifierFeatures,
    conditioning,
    evaluate_class_conditional,
    load_checkpoint,
    real_images,
)
from ..tokenizers.text import TextTokenizer


def cmd_sample(args) -> int:
    """Sample images from a checkpoint of a sampling task into a PNG grid; with ``--classifier`` also
    measure class-conditional samples (classifier accuracy, Fréchet distance to the real validation
    images, and samples per second)."""

    if args.out is None and args.classifier is None:
        raise UsageError("say what to do: --out GRID.png (samples) and/or --classifier CKPT (measure them)")
    loaded, name = load_checkpoint(args.checkpoint, "sample")
    task = loaded.module.tasks[name]
    steps = args.steps or getattr(task, "sample_steps", 50)  # default: the recipe's grid steps
    k, caption_tokenizer = conditioning(loaded, name)
    if args.class_ is not None and not k:
        raise UsageError(f"{args.checkpoint} is not class-conditional; drop --class")
    if args.prompt and caption_tokenizer is None:
        raise UsageError(f"{args.checkpoint} is not text-conditional; drop --prompt")
    if caption_tokenizer is not None and not args.prompt:
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
        try:
            results = evaluate_class_conditional(
                loaded, name, features, real, args.per_class, scales, steps, args.sampler, args.seed
            )
        except ValueError as e:
            raise UsageError(str(e)) from None
        for scale, scores in zip(scales, results):
            print(
                f"cfg_scale {scale:g} steps {steps} sampler {args.sampler or 'default'}: "
                f"classifier accuracy {scores['accuracy']:.4f}, Fréchet distance {scores['frechet_distance']:.3f} "
                f"({int(scores['samples'])} samples vs {len(real)} real; "
                f"{scores['samples_per_second']:.1f} samples/s)"
            )
    if args.out is not None:
        captions = None
        if args.prompt:  # one row of --n samples per prompt
            text = TextTokenizer.from_json(loaded.module.tokenizer_files[caption_tokenizer])
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
                steps=steps,
                sampler=args.sampler,
                generator=torch.Generator().manual_seed(args.seed),
                captions=captions,
                bar=True,  # on a terminal
            )
        except ValueError as e:
            raise UsageError(str(e)) from None
        nrow = args.n if (k and args.class_ is None) or args.prompt else 8
        args.out.parent.mkdir(parents=True, exist_ok=True)
        save_image(make_grid((images + 1) / 2, nrow=nrow, padding=1), args.out)
        print(f"wrote {len(images)} samples to {args.out}")
    return 0
