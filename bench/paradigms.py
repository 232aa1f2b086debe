"""Compare the image-generating paradigms over trained checkpoints, on the same data.

For every checkpoint given, the first task whose model-library class has ``sample`` (DiT ``diffusion``,
``maskgit``, ``transfusion``, ``chameleon``: the sampling protocol ``task.sample(model, labels, *, n,
cfg_scale, steps, sampler, generator, captions, bar)`` → ``(N, C, H, W)`` in [-1, 1]) is measured on
the data it was trained on:

* digits (``mnist5k`` / ``mnist5k-captions``): ``per_class`` samples of every digit — from the class
  label (class-conditional) or from the digit's prompts of ``mnist5k-captions/label.json`` ("seven",
  "a handwritten 7", …, cycled; text-conditional) — scored by the quickstart classifier
  (``recipes/image/vit_tiny_classify_mnist5k.yaml``): its accuracy at recognising the requested digit, and
  the Fréchet distance (Heusel et al. 2017) between the samples' and the 500 held-out real digits'
  features in that classifier (as ``mmformer sample --classifier`` reports them for DiT). A task with
  ``caption(model, images, *, max_new_tokens, generator) -> list[list[int]]`` also captions the 500
  held-out digits: image → text accuracy = the caption names the right digit and no other (a word or
  a lone numeral, ``mmformer.data.mnist_captions.digits_named``); the classifier's accuracy on the same
  500 digits is the reference row.
* emoji: one sample per held-out Unicode name (127), embedded by a trained SigLIP checkpoint
  (``recipes/multimodal/siglip_emoji_minilm.yaml``) with the held-out names: recall@1 / @5 of each
  generated image retrieving its own name among them; the real held-out images give the ceiling row.
* every checkpoint: the held-out loss with the condition and with the null one, where the task's
  validation reports both (the image part's ``image_loss`` / ``image_loss_uncond`` for Transfusion and
  Chameleon, else ``loss`` / ``loss_uncond``),
  and the sampling time per image (wall clock, this process's torch threads).

Text prompts are encoded as the training data encodes captions (``encode_captions``: BOS … EOS, cut to
the recipe's ``data.max_len``) and sampled in groups of equal token length, so no prompt is padded; the
DiT task takes them as ``(ids, valid)``, every other task as the contract's ``ids (N, L)``.

Usage (a full install: this script loads training checkpoints, unlike the model-library benches)::

    python bench/paradigms.py CKPT [CKPT …] --classifier CLASSIFIER.ckpt [--siglip SIGLIP.ckpt]
        [--per-class 100] [--steps 50] [--cfg-scale 3] [--sampler NAME] [--seed 0] [--json OUT.json]

It prints markdown tables; a quantity a checkpoint cannot give is "n/a", one not asked for (no
``--siglip``) "not measured". The pure functions (``names_digit``, ``caption_accuracy``, ``recall_at_k``,
``frechet_distance``, ``markdown_table``) are tested in ``tests/bench/test_paradigms.py``.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from anywhere in the checkout

from mmformer.data.mnist_captions import PHRASINGS, digit_captions, digits_named  # noqa: E402

MISSING = "not measured"
NOT_APPLICABLE = "n/a"


# ---------------------------------------------------------------------------------------- pure metrics
def names_digit(text: str, digit: int) -> bool:
    """True when ``text`` names ``digit`` (as a word or a lone numeral, any number of times) and no other
    digit: ``names_digit("a handwritten 7", 7)``; not ``"seven or 1"``, not ``"17"``, not ``""``."""
    named = set(digits_named(text))
    return named == {digit}


def caption_accuracy(texts: Sequence[str], labels: Sequence[int]) -> dict[str, float]:
    """``accuracy``: the fraction of captions that name their label's digit and no other (``names_digit``);
    ``no_digit``: the fraction that name no digit at all. Raises ``ValueError`` on unequal lengths or
    none."""
    if len(texts) != len(labels) or not texts:
        raise ValueError(f"need as many captions as labels (> 0), got {len(texts)} and {len(labels)}")
    right = sum(names_digit(t, int(y)) for t, y in zip(texts, labels))
    none = sum(not digits_named(t) for t in texts)
    return {"accuracy": right / len(texts), "no_digit": none / len(texts)}


def recall_at_k(sim: Tensor, target: Tensor, ks: Sequence[int] = (1, 5)) -> dict[int, float]:
    """Recall@k of ``sim (Q, C)`` (query × candidate similarities) with ``target (Q,)`` long, each
    query's correct candidate: the fraction of queries whose target is among their k most similar
    candidates. A tie with the target counts against it (the rank is the number of other candidates
    scoring at least as high), so constant similarities give recall 0 for k < C. Raises ``ValueError``
    on mismatched shapes or an out-of-range target."""
    if sim.dim() != 2 or target.shape != (sim.shape[0],):
        raise ValueError(
            f"sim must be (Q, C) and target (Q,), got {tuple(sim.shape)} and {tuple(target.shape)}"
        )
    if len(target) and not (0 <= int(target.min()) and int(target.max()) < sim.shape[1]):
        raise ValueError(f"targets must index the {sim.shape[1]} candidates, got {target.tolist()}")
    own = sim.gather(1, target[:, None])  # (Q, 1)
    others = torch.ones_like(sim, dtype=torch.bool).scatter_(1, target[:, None], False)
    rank = ((sim >= own) & others).sum(1)
    return {k: float((rank < k).float().mean()) for k in ks}


def frechet_distance(a: Tensor, b: Tensor) -> float:
    """Fréchet distance between Gaussians fitted to feature sets ``a (N, D)`` and ``b (M, D)`` (Heusel
    et al. 2017, eq. 6): ``|μa − μb|² + Tr(Σa + Σb − 2 (Σa Σb)^½)``, in float64 with unbiased covariances;
    the trace of the root is the sum of the square roots of the eigenvalues of ``Σa Σb`` (torchmetrics'
    ``FrechetInceptionDistance`` computes the same). Raises ``ValueError`` for fewer than 2 rows or
    different widths."""
    if a.dim() != 2 or b.dim() != 2 or a.shape[1] != b.shape[1] or min(len(a), len(b)) < 2:
        raise ValueError(f"need (N ≥ 2, D) features of one width, got {tuple(a.shape)} and {tuple(b.shape)}")
    a, b = a.double(), b.double()
    mu_a, mu_b = a.mean(0), b.mean(0)
    cov_a, cov_b = (
        torch.cov(a.T, correction=1).reshape(a.shape[1], -1),
        torch.cov(b.T).reshape(b.shape[1], -1),
    )
    root_trace = torch.linalg.eigvals(cov_a @ cov_b).sqrt().real.sum()
    return float((mu_a - mu_b).square().sum() + cov_a.trace() + cov_b.trace() - 2 * root_trace)


def _cell(value, fmt: str) -> str:
    if value is None:
        return MISSING
    if isinstance(value, str):
        return value
    if isinstance(value, float) and math.isnan(value):
        return NOT_APPLICABLE
    return format(value, fmt)


def markdown_table(rows: Sequence[dict], columns: Sequence[tuple[str, str, str]]) -> str:
    """A markdown table: one line per row, ``columns`` = ``(key, header, format spec)``. A missing key or
    None prints ``not measured``, NaN ``n/a`` (the paradigm cannot give it), a string as is."""
    lines = ["| " + " | ".join(h for _, h, _ in columns) + " |", "|" + " --- |" * len(columns)]
    for row in rows:
        lines.append("| " + " | ".join(_cell(row.get(k), f) for k, _, f in columns) + " |")
    return "\n".join(lines)


DIGIT_COLUMNS = [
    ("model", "checkpoint (task kind, training steps)", ""),
    ("condition", "condition", ""),
    ("accuracy", "classifier accuracy", ".3f"),
    ("frechet", "Fréchet distance", ".2f"),
    ("caption_accuracy", "image → text accuracy", ".3f"),
    ("loss", "held-out loss", ".4f"),
    ("loss_uncond", "… with the null condition", ".4f"),
    ("seconds_per_image", "s / image", ".4f"),
]
EMOJI_COLUMNS = [
    ("model", "checkpoint (task kind, training steps)", ""),
    ("recall@1", "SigLIP recall@1", ".3f"),
    ("recall@5", "SigLIP recall@5", ".3f"),
    ("loss", "held-out loss", ".4f"),
    ("loss_uncond", "… with the null caption", ".4f"),
    ("seconds_per_image", "s / image", ".4f"),
]


# ---------------------------------------------------------------------------------------- the harness
@dataclass
class Generator:
    """A generating task rebuilt from a checkpoint."""

    path: Path
    loaded: object  # mmformer.evaluation.Loaded
    name: str  # the task's name in the recipe
    kind: str  # its kind (diffusion, maskgit, transfusion, chameleon, …)
    steps: int  # optimizer steps the checkpoint was trained for
    dataset: str  # "digits" or "emoji"
    text: object | None  # the caption TextTokenizer of a text-conditional task
    max_len: int

    @property
    def task(self):
        return self.loaded.module.tasks[self.name]

    @property
    def model(self):
        return self.loaded.model

    @property
    def label(self) -> str:
        return f"{self.loaded.recipe.name} ({self.kind}, {self.steps} steps)"


def load_generator(path: Path) -> Generator:
    """The first task of checkpoint ``path`` that samples images. Raises ``ValueError`` naming the tasks
    when none does, or when its data is neither the mnist5k digits nor emoji."""
    from mmformer.build import load_checkpoint
    from mmformer.evaluation import Loaded

    ckpt = load_checkpoint(path)
    module = ckpt.module().eval()
    name = next((n for n, t in module.tasks.items() if callable(getattr(t, "sample", None))), None)
    if name is None:
        raise ValueError(f"{path}: no task samples images (its tasks: {', '.join(module.tasks)})")
    data = ckpt.recipe.tasks[name].data
    root = str(getattr(data, "root", ""))
    dataset = "digits" if "mnist5k" in root else "emoji" if "emoji" in root else None
    if dataset is None:
        raise ValueError(f"{path}: task {name!r} reads {root!r}; this comparison covers mnist5k and emoji")
    caption_tok = getattr(ckpt.recipe.tasks[name], "caption_tokenizer", None)  # every captioned kind has it
    text = ckpt.context.text_tokenizer(caption_tok) if caption_tok else None
    loaded = Loaded(module, ckpt.recipe, ckpt.context)
    return Generator(
        path,
        loaded,
        name,
        ckpt.recipe.tasks[name].kind,
        int(ckpt.state.get("global_step", 0)),
        dataset,
        text,
        int(getattr(data, "max_len", 32)),
    )


def _caption_argument(gen: Generator, ids: Tensor):
    from mmformer.tasks.diffusion import DiffusionTask

    if isinstance(gen.task, DiffusionTask):  # the DiT task takes (ids, valid)
        return ids, torch.ones_like(ids, dtype=torch.bool)
    return ids


@torch.no_grad()
def generate(
    gen: Generator,
    labels: Tensor,
    prompts: list[str] | None,
    *,
    cfg_scale: float,
    steps: int,
    sampler: str | None,
    seed: int,
    batch_size: int,
) -> tuple[Tensor, float]:
    """``(uint8 images (N, C, H, W), sampling seconds)``: one image per ``labels[i]`` — conditioned on the
    label, or on ``prompts[i]`` for a text-conditional task. Prompts go in groups of equal token length."""
    from mmformer.data.image_caption import encode_captions
    from mmformer.tasks.diffusion import to_uint8

    generator = torch.Generator().manual_seed(seed)
    n = len(labels)
    if gen.text is not None:
        if prompts is None or len(prompts) != n:
            raise ValueError(f"{gen.path} is text-conditional: give one prompt per sample")
        ids = encode_captions(gen.text, prompts, gen.max_len)
        groups: dict[int, list[int]] = {}
        for i, s in enumerate(ids):
            groups.setdefault(len(s), []).append(i)
        batches = [g[j : j + batch_size] for g in groups.values() for j in range(0, len(g), batch_size)]
    else:
        ids = None
        batches = [list(range(j, min(j + batch_size, n))) for j in range(0, n, batch_size)]
    out: list[Tensor | None] = [None] * n
    seconds = 0.0
    for idx in batches:
        captions = None
        if ids is not None:
            captions = _caption_argument(gen, torch.tensor([ids[i] for i in idx], dtype=torch.long))
        start = time.perf_counter()
        images = gen.task.sample(
            gen.model,
            None if ids is not None else labels[idx],
            n=len(idx),
            cfg_scale=cfg_scale,
            steps=steps,
            sampler=sampler,
            generator=generator,
            captions=captions,
            bar=False,
        )
        seconds += time.perf_counter() - start
        for i, image in zip(idx, to_uint8(images)):
            out[i] = image
    return torch.stack(out), seconds


@torch.no_grad()
def caption_texts(gen: Generator, images: Tensor, max_new_tokens: int, batch_size: int) -> list[str] | None:
    """The task's captions of uint8 ``images`` (greedy), decoded; None when the task cannot caption."""
    from mmformer.tasks.diffusion import to_unit_range

    caption = getattr(gen.task, "caption", None)
    if caption is None or gen.text is None:
        return None
    texts = []
    for j in range(0, len(images), batch_size):
        ids = caption(gen.model, to_unit_range(images[j : j + batch_size]), max_new_tokens=max_new_tokens)
        texts += [gen.text.decode(s, skip_special=True) for s in ids]
    return texts


# (with the condition, with the null one): Transfusion's, Chameleon's, DiT's and MaskGIT's names
PAIRS = (("image_loss", "image_loss_uncond"), ("loss", "loss_uncond"))


@torch.no_grad()
def held_out_losses(gen: Generator, limit_batches: int | None) -> tuple[float, float]:
    """``(loss, loss with the null condition)`` of the task's own validation on its held-out data; NaN
    where the task does not report the pair."""
    from torch.utils.data import DataLoader

    from mmformer.build import build_datamodule

    datamodule = build_datamodule(gen.loaded.recipe, gen.loaded.context)
    datamodule.setup("validate")
    data = datamodule.data[gen.name]
    task, model = gen.task, gen.model
    task.on_validation_epoch_start(model)
    loader = DataLoader(data.val, batch_size=data.val_batch_size, collate_fn=data.collate)
    for b, batch in enumerate(loader):
        if limit_batches is not None and b >= limit_batches:
            break
        task.validation_update(model, batch)
    metrics = {k: float(m.compute()) for k, m in task.val_metrics.items() if m.update_count}
    for m in task.val_metrics.values():
        m.reset()
    return conditional_losses(metrics)


def conditional_losses(metrics: dict[str, float]) -> tuple[float, float]:
    """``(loss with the condition, with the null one)`` from a task's validation metrics: the first
    pair of ``PAIRS`` present; else ``(metrics["loss"] or NaN, NaN)``."""
    for with_, without in PAIRS:
        if with_ in metrics and without in metrics:
            return metrics[with_], metrics[without]
    return metrics.get("loss", math.nan), math.nan


def _read_split(root: Path, split: str, size: int, chans: int) -> tuple[Tensor, list[dict]]:
    from PIL import Image

    from mmformer.tokenizers.image import ImagePreprocess

    rows = [json.loads(x) for x in (root / f"{split}.jsonl").read_text().splitlines() if x.strip()]
    pre = ImagePreprocess(size, chans)
    images = []
    for r in rows:
        with Image.open(root / r["image"]) as im:
            images.append(pre.load(im))
    return torch.stack(images), rows


def _resized(images: Tensor, size: int) -> Tensor:
    if images.shape[-1] == size:
        return images
    x = torch.nn.functional.interpolate(images.float(), size=(size, size), mode="bilinear", antialias=True)
    return x.round().clamp(0, 255).to(torch.uint8)


class Classifier:
    """The quickstart MNIST classifier: logits and pooled features of uint8 digits."""

    def __init__(self, path: Path, batch_size: int = 250):
        from mmformer.evaluation import ClassifierFeatures, load_checkpoint

        loaded, name = load_checkpoint(path, "classification")
        self.net, self.batch_size = ClassifierFeatures(loaded, name).eval(), batch_size

    @torch.no_grad()
    def __call__(self, images: Tensor) -> tuple[Tensor, Tensor]:
        """``(predicted digits (N,), features (N, D))``; features are read by the same forward."""
        preds, feats = [], []
        for j in range(0, len(images), self.batch_size):
            x = images[j : j + self.batch_size]
            f = self.net(x)
            feats.append(f)
            preds.append(self.net.logits(x).argmax(-1))
        return torch.cat(preds), torch.cat(feats)


class Siglip:
    """A trained contrastive checkpoint embedding images and captions."""

    def __init__(self, path: Path):
        from mmformer.data.image_caption import encode_captions
        from mmformer.evaluation import load_checkpoint

        self.loaded, name = load_checkpoint(path, "contrastive")
        self.task = self.loaded.module.tasks[name]
        self.text = self.loaded.context.text_tokenizer(self.task.caption_tokenizer)
        self.max_len = int(getattr(self.loaded.recipe.tasks[name].data, "max_len", 32))
        tok = self.loaded.recipe.model.tokenizers[self.task.tokenizer]
        self.image_size, self.in_chans = int(tok.image_size), int(tok.in_chans)
        self._encode = encode_captions

    @torch.no_grad()
    def recall(self, images: Tensor, captions: list[str], names: list[str]) -> dict[int, float]:
        """Recall@1 / @5 of each uint8 image retrieving its ``captions[i]`` among the distinct ``names``."""
        model = self.loaded.model
        ids, valid = self.text.pad_batch(self._encode(self.text, names, self.max_len))
        t = self.task.embed_captions(model, ids, valid)
        i = torch.cat(
            [
                self.task.embed_inputs(model, _resized(images[j : j + 128], self.image_size))
                for j in range(0, len(images), 128)
            ]
        )
        target = torch.tensor([names.index(c) for c in captions])
        return recall_at_k(i @ t.T, target)


def _spread(n: int, limit: int | None) -> list[int]:
    """``limit`` indices spread evenly over ``range(n)`` (the held-out files are sorted by class), or all."""
    if limit is None or limit >= n:
        return list(range(n))
    return torch.linspace(0, n - 1, limit).round().long().tolist()


def _reference(columns, **values) -> dict:
    """A reference row (real images): "—" in every column it has no value for."""
    return {**dict.fromkeys((k for k, _, _ in columns), "—"), **values}


class Comparison:
    """The references every checkpoint is measured against, read once: the classifier and the held-out
    real digits (with their features), the SigLIP checkpoint and the held-out emoji."""

    def __init__(self, args):
        self.args = args
        self.classifier = Classifier(args.classifier) if args.classifier else None
        self.siglip = Siglip(args.siglip) if args.siglip else None
        self.reference: dict[str, list[dict]] = {"digits": [], "emoji": []}
        self._digits = self._emoji = None

    def _sampling(self) -> dict:
        a = self.args
        return dict(
            cfg_scale=a.cfg_scale, steps=a.steps, sampler=a.sampler, seed=a.seed, batch_size=a.batch_size
        )

    def real_digits(self) -> tuple[Tensor, list[int], Tensor | None]:
        """The held-out digits (uint8 ``(N, 1, 28, 28)``), their labels and classifier features; the
        classifier's accuracy on them becomes the reference row."""
        if self._digits is None:
            from mmformer.data.roots import resolve_root

            images, rows = _read_split(resolve_root("mnist5k-captions"), "val", 28, 1)
            keep = _spread(len(rows), self.args.limit_real)
            images, rows = images[keep], [rows[i] for i in keep]
            labels, feats = [int(r["label"]) for r in rows], None
            if self.classifier is not None:
                preds, feats = self.classifier(images)
                accuracy = float((preds == torch.tensor(labels)).float().mean())
                self.reference["digits"].append(
                    _reference(
                        DIGIT_COLUMNS,
                        model=f"real held-out digits ({len(labels)}), the quickstart classifier",
                        caption_accuracy=accuracy,
                    )
                )
            self._digits = images, labels, feats
        return self._digits

    def real_emoji(self) -> tuple[Tensor, list[str]]:
        """The held-out emoji (uint8 ``(N, 3, 64, 64)``) and their names; with ``--siglip`` the real
        images' recall is the ceiling row."""
        if self._emoji is None:
            from mmformer.data.roots import resolve_root

            images, rows = _read_split(resolve_root("emoji"), "val", 64, 3)
            keep = _spread(len(rows), self.args.limit_real)
            images, captions = images[keep], [rows[i]["caption"] for i in keep]
            if self.siglip is not None:
                recall = self.siglip.recall(images, captions, list(dict.fromkeys(captions)))
                ceiling = {"recall@1": recall[1], "recall@5": recall[5]}
                self.reference["emoji"].append(
                    _reference(
                        EMOJI_COLUMNS, model=f"real held-out emoji ({len(captions)}), the ceiling", **ceiling
                    )
                )
            self._emoji = images, captions
        return self._emoji

    def digits(self, gen: Generator, row: dict) -> None:
        """Class- or prompt-conditioned digits: classifier accuracy, Fréchet distance, time; captions."""
        real, real_labels, real_feats = self.real_digits()
        labels = torch.arange(10).repeat_interleave(self.args.per_class)
        prompts = None
        if gen.text is not None:  # the phrasings of each digit in turn
            prompts = [digit_captions(int(y))[i % len(PHRASINGS)] for i, y in enumerate(labels)]
        row["condition"] = "text (digit prompts)" if prompts else "class"
        images, seconds = generate(gen, labels, prompts, **self._sampling())
        if images.shape[1:] != (1, 28, 28):
            raise ValueError(
                f"{gen.path} samples {tuple(images.shape[1:])} images; the digits are (1, 28, 28)"
            )
        row["seconds_per_image"] = seconds / len(images)
        if self.classifier is not None:
            preds, feats = self.classifier(images)
            row["accuracy"] = float((preds == labels).float().mean())
            row["frechet"] = frechet_distance(feats, real_feats)
        texts = caption_texts(gen, real, self.args.caption_tokens, self.args.batch_size)
        row["caption_accuracy"] = (
            math.nan if texts is None else caption_accuracy(texts, real_labels)["accuracy"]
        )
        if texts is not None:
            row["caption_examples"] = texts[:5]

    def emoji(self, gen: Generator, row: dict) -> None:
        """One image per held-out name: SigLIP recall of its own name among them, time."""
        _, captions = self.real_emoji()
        if gen.text is None:
            raise ValueError(f"{gen.path}: an emoji model is text-conditional; this one reads no captions")
        labels = torch.zeros(len(captions), dtype=torch.long)
        images, seconds = generate(gen, labels, captions, **self._sampling())
        row["seconds_per_image"] = seconds / len(images)
        if self.siglip is not None:
            recall = self.siglip.recall(images, captions, list(dict.fromkeys(captions)))
            row["recall@1"], row["recall@5"] = recall[1], recall[5]


def measure(args) -> dict[str, list[dict]]:
    """Every checkpoint's row, after the reference rows, per data set."""
    torch.manual_seed(args.seed)
    comparison = Comparison(args)
    rows: dict[str, list[dict]] = {"digits": [], "emoji": []}
    for path in args.checkpoints:
        gen = load_generator(path)
        print(f"measuring {gen.label} from {path}", file=sys.stderr)
        row: dict = {"model": gen.label, "path": str(path)}
        if args.held_out_loss:
            row["loss"], row["loss_uncond"] = held_out_losses(gen, args.limit_val_batches)
        (comparison.digits if gen.dataset == "digits" else comparison.emoji)(gen, row)
        rows[gen.dataset].append(row)
    return {k: comparison.reference[k] + rows[k] for k in rows}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("checkpoints", nargs="+", type=Path, help="trained generating checkpoints (.ckpt)")
    p.add_argument("--classifier", type=Path, help="the quickstart MNIST classifier's checkpoint")
    p.add_argument("--siglip", type=Path, help="a trained siglip_emoji_minilm checkpoint (emoji retrieval)")
    p.add_argument("--per-class", type=int, default=100, help="digit samples per class (default 100)")
    p.add_argument(
        "--steps", type=int, default=50, help="sampler steps (DiT Euler steps, MaskGIT iterations)"
    )
    p.add_argument("--cfg-scale", type=float, default=3.0, help="classifier-free guidance scale (default 3)")
    p.add_argument("--sampler", default=None, help="the task's sampler (default: its own)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--batch-size", type=int, default=250)
    p.add_argument("--caption-tokens", type=int, default=8, help="max new tokens of an image → text caption")
    p.add_argument("--no-held-out-loss", dest="held_out_loss", action="store_false")
    p.add_argument("--limit-val-batches", type=int, default=None, help="held-out loss on the first N batches")
    p.add_argument(
        "--limit-real", type=int, default=None, help="N held-out images spread over the set (a quick check)"
    )
    p.add_argument("--json", type=Path, help="also write the raw numbers here")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    tables = measure(args)
    print(
        f"torch threads {torch.get_num_threads()}; {args.per_class} digits per class, {args.steps} steps, "
        f"cfg_scale {args.cfg_scale:g}, seed {args.seed}\n"
    )
    for name, columns in (("digits", DIGIT_COLUMNS), ("emoji", EMOJI_COLUMNS)):
        if tables[name]:
            print(f"### {name}\n\n{markdown_table(tables[name], columns)}\n")
    if args.json:
        args.json.write_text(json.dumps(tables, indent=1, default=str) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
