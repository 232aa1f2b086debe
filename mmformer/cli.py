"""``mmformer train | validate | generate | sample | export | info | data``: argument parsing and
dispatch. Each command lives with the workflow it runs, in ``mmformer.commands.<command>``.

mmformer train RECIPE.yaml [key=value ...]     e.g. optim.lr=3e-4 trainer.devices=2 resume=auto
mmformer validate CHECKPOINT.ckpt [key=value ...]
mmformer info RECIPE.yaml [key=value ...]
mmformer tune lr|batch-size RECIPE.yaml [key=value ...]   Lightning's LR / batch-size finder
mmformer data prepare NAME [--force] | mmformer data list | mmformer data shard SRC --out DIR
"""

from __future__ import annotations

import argparse
import atexit
import faulthandler
import importlib
import logging
import os
import sys
import warnings
from pathlib import Path

from .data.roots import DataError, DataNotFoundError
from .errors import RecipeError, SourceNotFoundError, UsageError

log = logging.getLogger("mmformer")


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
    t = sub.add_parser(
        "train",
        help="train a recipe",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Train a recipe: defaults <- RECIPE <- key=value overrides, checked before any data is "
        "read.\nPrints what differs from the defaults, the model's size and FLOPs, then trains with a "
        "progress bar;\nwrites runs/<name>/<run id>/ (recipe.yaml: the whole recipe; run.json; "
        "checkpoints/; metrics.csv)\nand ends with the final validation metrics and the run folder.",
        epilog="""examples:
  mmformer train recipes/image/vit_tiny_classify_mnist5k.yaml
  mmformer train recipes/text/gpt_mini_lm_kjv.yaml optim.lr=3e-4 trainer.max_epochs=5
  mmformer train recipes/text/gpt_mini_lm_kjv.yaml resume=auto        # continue its last run
  mmformer train RECIPE.yaml trainer.accelerator=cpu trainer.devices=2 trainer.strategy=ddp
  mmformer train RECIPE.yaml logger.mode=offline trainer.max_steps=200
  mmformer train RECIPE.yaml trainer.fast_dev_run=true                 # one batch each: a smoke test
  mmformer info RECIPE.yaml [key=value ...]                            # the whole resolved recipe

environment: MMFORMER_RUNS (runs folder, default runs/), MMFORMER_DATA (data root, default data/),
  MMFORMER_PROGRESS=0 (no progress bars) or 1 (bars into a log file too; by default the bars of data
  preparation, sharding, weight import and sampling show on a terminal only)""",
    )
    t.add_argument("recipe", type=Path, help="a recipe YAML file (recipes/<area>/*.yaml)")
    t.add_argument("overrides", nargs="*", help="key=value recipe overrides, e.g. optim.lr=3e-4 resume=auto")
    t.set_defaults(command_fn="train")
    v = sub.add_parser("validate", help="evaluate a checkpoint on its recipe's validation data")
    v.add_argument(
        "checkpoint", type=Path, help="a .ckpt written by mmformer train (its recipe travels inside)"
    )
    v.add_argument("overrides", nargs="*", help="key=value recipe overrides, e.g. trainer.devices=1")
    v.set_defaults(command_fn="validate")
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
        help="decode with the blocks as one compiled graph (torch.compile), faster per token for one prompt: "
        "about a minute to compile the first time, seconds once inductor's on-disk cache holds it (for "
        "several prompts on the CPU, eager decoding on packed weights is faster; or --compile-mode frozen)",
    )
    g.add_argument(
        "--compile-mode",
        choices=["cached", "frozen"],
        default=None,
        help="with --compile (implies it): cached (the default), or frozen — weights prepacked as constants, "
        "fastest for several prompts, compiled anew in every process",
    )
    g.add_argument(
        "--prompt-lookup",
        type=_positive_int,
        default=None,
        metavar="N",
        help="greedy decoding with drafts of up to N ids copied from the prompt and the text so far "
        "(prompt-lookup decoding: the same ids in fewer forward passes where the output repeats its input)",
    )
    g.set_defaults(command_fn="generate")
    e = sub.add_parser(
        "export",
        help="write a checkpoint in its reference layout: HF Llama (LoRA merged), HF BERT, timm ViT, or "
        "one safetensors file (sharded checkpoints merged), with a model card (README.md) beside it",
        description="A Llama-layout model becomes an HF directory (config.json, model.safetensors, "
        "tokenizer.json, tokenizer_config.json with the chat template) that transformers' "
        "LlamaForCausalLM.from_pretrained loads; a ViT image classifier becomes a timm directory "
        "(config.json, model.safetensors) that timm.create_model('local-dir:OUT', pretrained=True) loads; "
        "a BERT-layout encoder becomes an HF directory BertModel.from_pretrained loads; "
        "--format safetensors writes any checkpoint's weights, a sharded checkpoint folder merged, to "
        "the file OUT. Every export gets a Hub model card: OUT/README.md (OUT.md beside a file).",
    )
    e.add_argument(
        "checkpoint",
        type=Path,
        help="a .ckpt (file or sharded folder) written by mmformer train, or pretrained weights",
    )
    e.add_argument("out", type=Path, help="output directory (a file for --format safetensors)")
    e.add_argument(
        "--format",
        choices=("auto", "llama", "bert", "timm", "safetensors"),
        default="auto",
        help="auto: timm for an image classifier, else llama or bert by the model's layout",
    )
    e.add_argument(
        "--license", default="other", help="the Hub license id the model card declares (default: other)"
    )
    e.add_argument("--repo-id", default=None, help="the Hub repository (user/name) the card's snippets load")
    e.set_defaults(command_fn="export")
    sp = sub.add_parser(
        "sample",
        help="sample images from a checkpoint of a generating task (diffusion, maskgit, …; a PNG grid); "
        "--classifier also measures them",
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
        default=None,
        help="sampling steps, as the task counts them: DDIM / Euler / Heun steps (diffusion; DDPM uses all "
        "T), parallel-decoding rounds (maskgit, at most the number of codes); default: the recipe's sample_steps",
    )
    sp.add_argument(
        "--sampler",
        default=None,
        help="the task's sampler: ddim | ddpm (gaussian diffusion), euler | heun (flow), maskgit (maskgit)",
    )
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
    sp.set_defaults(command_fn="sample")

    tu = sub.add_parser(
        "tune",
        help="Lightning's LR finder (lr) or batch-size finder (batch-size) on a recipe; prints the override",
        description="lr: the LR range test (Tuner.lr_find); writes its plot (PNG) and curve (CSV) to "
        "runs/<name>/tune/ and prints optim.lr=<suggestion>. batch-size: Tuner.scale_batch_size on a task's "
        "training batch size; prints tasks.<task>.data.batch_size=<n>. Both run on one device.",
    )
    tu.add_argument("what", choices=["lr", "batch-size"])
    tu.add_argument("recipe", type=Path)
    tu.add_argument("overrides", nargs="*", help="key=value recipe overrides")
    tu.add_argument("--min-lr", type=float, default=1e-8, help="lr: the sweep's first learning rate")
    tu.add_argument("--max-lr", type=float, default=1.0, help="lr: the sweep's last learning rate")
    tu.add_argument(
        "--num-training", type=_positive_int, default=100, help="lr: steps (learning rates tried)"
    )
    tu.add_argument(
        "--mode",
        choices=["exponential", "linear", "power", "binsearch"],
        default=None,
        help="lr: exponential (default) | linear; batch-size: power (default) | binsearch",
    )
    tu.add_argument(
        "--task", default=None, help="batch-size: the task whose batch size (default: the only one)"
    )
    tu.add_argument("--init-val", type=_positive_int, default=2, help="batch-size: the first size tried")
    tu.add_argument("--max-trials", type=_positive_int, default=25, help="batch-size: most sizes tried")
    tu.add_argument("--steps-per-trial", type=_positive_int, default=3, help="batch-size: steps per size")
    tu.add_argument("--max-val", type=_positive_int, default=8192, help="batch-size: the largest size tried")
    tu.set_defaults(command_fn="tune")
    i = sub.add_parser("info", help="print the resolved recipe, parameter count and FLOPs per sample")
    i.add_argument("recipe", type=Path)
    i.add_argument("overrides", nargs="*", help="key=value recipe overrides")
    i.set_defaults(command_fn="info")
    pl = sub.add_parser(
        "plot",
        help="PNG training curves of a run from its metrics.csv (loss and main metric per task, lr, "
        "throughput, gradient norm)",
    )
    pl.add_argument(
        "run", type=Path, help="a run folder, its metrics.csv, or a recipe's folder of runs (its newest run)"
    )
    pl.add_argument("--out", type=Path, default=None, help="folder for the PNGs (default: RUN/plots)")
    pl.set_defaults(command_fn="plot")
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
    d.set_defaults(command_fn="data")
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
    # Known-harmless deprecation noise from Lightning's use of torch.utils._pytree on torch 2.14.
    warnings.filterwarnings("ignore", message=r".*LeafSpec.*")
    # A resumed run continues in its own checkpoint folder: that it is not empty is expected.
    warnings.filterwarnings("ignore", message=r"Checkpoint directory .* exists and is not empty")
    logging.getLogger("lightning.pytorch.utilities.rank_zero").addFilter(_drop_advertising)
    _setup_logging()
    args = _parser().parse_args(argv)
    had_group = _process_group_initialized()
    # each command's module is imported when it runs: `--help` and argument errors need no torch or Lightning
    command = getattr(
        importlib.import_module(f"mmformer.commands.{args.command_fn}"), f"cmd_{args.command_fn}"
    )
    try:
        rc = command(args)
    except (RecipeError, DataError, DataNotFoundError, FileNotFoundError, UsageError) as e:
        msg = e.args[0] if e.args else str(e)
        print(f"mmformer: error: {msg}{_source_steps(e, args)}", file=sys.stderr)
        return 2
    if not had_group and _process_group_initialized():
        _close_process_group()
        global _ended_a_distributed_run
        _ended_a_distributed_run = True
    return rc


_ended_a_distributed_run = False  # set by main when the command's run created (and closed) a process group


def run() -> None:
    """The ``mmformer`` console script and ``python -m mmformer.cli``: :func:`main`, then exit with its code.

    After a distributed run the process ends without interpreter finalization: gloo's worker threads can
    still hold a finished work's tensors while the interpreter tears down, and a thread that then needs
    the GIL is ended by a forced unwind that ``std::terminate``s the process ("terminate called without
    an active exception", exit -6) after a run that succeeded — pytorch/pytorch#179291 describes the
    race; CI hit it on FSDP2 runs even after ``destroy_process_group``. The exit handlers (logging, W&B,
    multiprocessing, ``weakref.finalize``) run first, while everything is alive, and the streams are
    flushed; nothing else is left to finalize. ``main`` itself never exits: tests and notebooks call it.
    """
    faulthandler.enable()  # a fatal signal prints every thread's Python stack, not only the C++ message
    rc = main()
    if not _ended_a_distributed_run:
        sys.exit(rc)
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a closed pipe: nothing more can be written anyway
            pass
    os._exit(rc if isinstance(rc, int) else 0)


def _source_steps(e: Exception, args) -> str:
    """For a pretrained source that does not exist: the steps of the recipe's header that create it
    (``# Source: mmformer train …`` then ``mmformer export …``), or ``""``."""
    if not isinstance(e, SourceNotFoundError) or getattr(args, "recipe", None) is None:
        return ""
    from .recipe.loading import header_steps

    steps = header_steps(args.recipe, e.source)
    return f"; the recipe's header creates it: run {', then '.join(steps)}" if steps else ""


def _process_group_initialized() -> bool:
    if "torch" not in sys.modules:  # a command that never imported torch started no process group
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
    run()
