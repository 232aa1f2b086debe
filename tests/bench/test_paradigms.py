"""The pure metrics of the paradigm comparison (``bench/paradigms.py``) on exact small cases, and its
sampling / captioning plumbing on stand-in tasks that follow the sampling protocol."""

from __future__ import annotations

import importlib.util
import math
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from mmformer.tasks.contrastive import retrieval_recall

_spec = importlib.util.spec_from_file_location(
    "bench_paradigms", Path(__file__).resolve().parents[2] / "bench" / "paradigms.py"
)
paradigms = sys.modules["bench_paradigms"] = importlib.util.module_from_spec(_spec)  # bench/ is no package
_spec.loader.exec_module(paradigms)


def test_names_digit_reads_words_and_numerals_and_refuses_ambiguity():
    assert paradigms.names_digit("a handwritten 7", 7) and paradigms.names_digit("Seven, seven.", 7)
    assert paradigms.names_digit("the digit seven", 7) and paradigms.names_digit("7", 7)
    assert not paradigms.names_digit("a handwritten 7", 1)
    assert not paradigms.names_digit("seven or one", 7)  # names another digit too
    assert not paradigms.names_digit("seventeen", 7) and not paradigms.names_digit("17", 7)
    assert not paradigms.names_digit("", 0) and not paradigms.names_digit("none", 1)


def test_caption_accuracy_counts_right_and_digitless_captions():
    texts = ["seven", "a 3", "the digit two", "", "a handwritten 4 or 9"]
    scores = paradigms.caption_accuracy(texts, [7, 3, 5, 1, 4])
    assert scores == {"accuracy": 2 / 5, "no_digit": 1 / 5}
    with pytest.raises(ValueError, match="as many captions as labels"):
        paradigms.caption_accuracy(["seven"], [7, 1])


def test_recall_at_k_on_a_hand_checked_case():
    sim = torch.tensor(
        [
            [0.9, 0.1, 0.0],  # target 0: rank 0
            [0.5, 0.4, 0.6],  # target 1: two candidates above → rank 2
            [0.3, 0.3, 0.3],  # target 2: tied with both others → rank 2 (ties count against)
            [0.2, 0.8, 0.1],  # target 0: one above → rank 1
        ]
    )
    target = torch.tensor([0, 1, 2, 0])
    assert paradigms.recall_at_k(sim, target, ks=(1, 2, 3)) == {1: 0.25, 2: 0.5, 3: 1.0}
    with pytest.raises(ValueError, match="must index the 3 candidates"):
        paradigms.recall_at_k(sim, torch.tensor([0, 1, 2, 3]))
    with pytest.raises(ValueError, match=r"\(Q, C\)"):
        paradigms.recall_at_k(sim, target[:3])


def test_recall_at_k_equals_the_contrastive_task_on_paired_rows():
    g = torch.Generator().manual_seed(0)
    a = torch.nn.functional.normalize(torch.randn(12, 6, generator=g), dim=-1)
    b = torch.nn.functional.normalize(a + 0.8 * torch.randn(12, 6, generator=g), dim=-1)
    ours = paradigms.recall_at_k(a @ b.T, torch.arange(12))
    theirs = retrieval_recall(a, b)
    assert (ours[1], ours[5]) == (theirs["a2b_recall@1"], theirs["a2b_recall@5"])
    assert 0 < ours[1] < ours[5] <= 1


def test_frechet_distance_matches_the_closed_form_and_torchmetrics():
    # 1-D: (μa − μb)² + σa² + σb² − 2 σa σb, sample (unbiased) variances
    a, b = torch.tensor([[0.0], [2.0]]), torch.tensor([[1.0], [5.0], [3.0]])
    va, vb = 2.0, 4.0  # var([0, 2]) = 2, var([1, 5, 3]) = 4
    want = (1.0 - 3.0) ** 2 + va + vb - 2 * math.sqrt(va * vb)
    assert paradigms.frechet_distance(a, b) == pytest.approx(want, rel=1e-12)
    from torchmetrics.image.fid import _compute_fid

    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(200, 5, generator=g), 1.5 * torch.randn(150, 5, generator=g) + 0.3
    x64, y64 = x.double(), y.double()
    ref = _compute_fid(x64.mean(0), torch.cov(x64.T), y64.mean(0), torch.cov(y64.T))
    assert paradigms.frechet_distance(x, y) == pytest.approx(float(ref), rel=1e-9)
    assert paradigms.frechet_distance(x, x) == pytest.approx(0.0, abs=1e-9)
    with pytest.raises(ValueError, match="one width"):
        paradigms.frechet_distance(x, y[:, :4])


def test_markdown_table_marks_missing_and_not_applicable():
    cols = [("model", "model", ""), ("acc", "accuracy", ".3f"), ("fd", "Fréchet", ".2f")]
    rows = [{"model": "dit", "acc": 0.98765, "fd": 1.234}, {"model": "real", "acc": math.nan}]
    assert paradigms.markdown_table(rows, cols) == (
        "| model | accuracy | Fréchet |\n"
        "| --- | --- | --- |\n"
        "| dit | 0.988 | 1.23 |\n"
        "| real | n/a | not measured |"
    )


def test_conditional_losses_take_the_image_part_of_each_kind():
    transfusion = {"loss": 3.0, "image_loss": 0.2, "image_loss_uncond": 0.25, "text_loss": 1.0}
    chameleon = {"loss": 3.0, "image_loss": 4.0, "image_loss_uncond": 4.5, "text_loss": 1.0}
    assert paradigms.conditional_losses(transfusion) == (0.2, 0.25)
    assert paradigms.conditional_losses(chameleon) == (4.0, 4.5)
    assert paradigms.conditional_losses({"loss": 0.15, "loss_uncond": 0.17, "acc": 0.5}) == (0.15, 0.17)
    loss, uncond = paradigms.conditional_losses({"loss": 0.3})  # unconditional: no pair to report
    assert loss == 0.3 and math.isnan(uncond)


class _Task:
    """Stand-in for a task of the sampling protocol: the image is filled with its label (class) or with
    its caption's length (text); captions come back as ids spelling the digit the image shows."""

    def __init__(self, text: bool):
        self.calls = []

    def sample(self, model, labels, *, n, cfg_scale, steps, sampler, generator, captions, bar=False):
        self.calls.append(None if captions is None else captions.shape)
        fill = labels.float() if captions is None else torch.full((n,), float(captions.shape[1]))
        return (fill / 127.5 - 1).view(-1, 1, 1, 1).expand(n, 1, 28, 28)

    def caption(self, model, images, *, max_new_tokens, generator=None):
        assert images.dtype == torch.float32 and images.min() >= -1  # [-1, 1], as the contract says
        return [[int(round((x[0, 0, 0].item() + 1) * 127.5))] for x in images]


class _Text:
    """Stand-in TextTokenizer: one id per word (the id is the word's length), BOS 100, EOS 101."""

    def encode_batch(self, texts, bos=False, eos=False):
        return [([100] if bos else []) + [len(w) for w in t.split()] + ([101] if eos else []) for t in texts]

    def decode(self, ids, skip_special=False):
        return " ".join(str(i) for i in ids)


def _gen(text: bool):
    return paradigms.Generator(
        Path("x.ckpt"),
        SimpleNamespace(module=SimpleNamespace(tasks={"t": _Task(text)}), model=None),
        "t",
        "stand-in",
        0,
        "digits",
        _Text() if text else None,
        32,
    )


def test_generate_keeps_the_order_and_groups_prompts_by_length():
    gen = _gen(text=True)
    prompts = ["seven", "a handwritten 7", "the digit two", "two"]  # 1, 3, 3, 1 words → 3, 5, 5, 3 ids
    images, seconds = paradigms.generate(
        gen, torch.tensor([7, 7, 2, 2]), prompts, cfg_scale=1.0, steps=1, sampler=None, seed=0, batch_size=8
    )
    assert images.dtype == torch.uint8 and images[:, 0, 0, 0].tolist() == [3, 5, 5, 3]
    assert sorted(gen.task.calls) == [(2, 3), (2, 5)] and seconds >= 0  # never padded
    gen = _gen(text=False)
    images, _ = paradigms.generate(
        gen, torch.arange(5), None, cfg_scale=1.0, steps=1, sampler=None, seed=0, batch_size=2
    )
    assert images[:, 0, 0, 0].tolist() == [0, 1, 2, 3, 4] and gen.task.calls == [None] * 3


def test_captions_are_decoded_and_scored():
    gen = _gen(text=True)
    images = torch.tensor([7, 3, 12]).view(-1, 1, 1, 1).expand(3, 1, 28, 28).to(torch.uint8)
    texts = paradigms.caption_texts(gen, images, max_new_tokens=4, batch_size=2)
    assert texts == ["7", "3", "12"]
    assert paradigms.caption_accuracy(texts, [7, 1, 2])["accuracy"] == pytest.approx(1 / 3)
    assert paradigms.caption_texts(_gen(text=False), images, 4, 2) is None  # cannot caption: no text
