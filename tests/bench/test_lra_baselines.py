"""The order-free baselines of the LRA comparison (``bench/lra.py baselines``: what the byte-level Text and
Retrieval data hold) on exact small cases, reading data written in the sequences format."""

from __future__ import annotations

import importlib.util
import sys
from collections import Counter
from pathlib import Path

from mmformer.data.sequence_format import read_meta, write_meta, write_split

_spec = importlib.util.spec_from_file_location(
    "bench_lra", Path(__file__).resolve().parents[2] / "bench" / "lra.py"
)
lra = sys.modules["bench_lra"] = importlib.util.module_from_spec(_spec)  # bench/ is no package
_spec.loader.exec_module(lra)
words = lra.UNITS["words"]


def test_units_count_bytes_four_grams_and_words():
    assert lra.UNITS["bytes"](b"abca") == Counter({97: 2, 98: 1, 99: 1})
    assert lra.UNITS["byte 4-grams"](b"abcab") == Counter({b"abca": 1, b"bcab": 1})
    assert lra.UNITS["byte 4-grams"](b"abc") == Counter()
    assert words(b"And God said, Let there be light: and there was light.") == Counter(
        {b"and": 2, b"god": 1, b"said": 1, b"let": 1, b"there": 2, b"be": 1, b"light": 2, b"was": 1}
    )


def test_passages_split_a_pair_at_its_separator(tmp_path):
    a, b, c = (list(s.encode()) for s in ("In the beginning", "Jesus wept", "Amen"))
    write_split(tmp_path, "train", [[*a, 256, *b], c], [1, 0])
    write_meta(tmp_path, 257, 64, ["different", "same"], {"train": 2}, separator=256)
    pair, single = lra._passages(tmp_path, read_meta(tmp_path), "train", words)
    assert pair == ([words(b"In the beginning"), words(b"Jesus wept")], 1)
    assert single == ([words(b"Amen")], 0)
    meta = read_meta(tmp_path)
    (a1, b1), _ = lra._sequences(tmp_path, meta, "train", max_len=5, pairs=True)[0]
    assert a1.tolist() == a[:5] and b1.tolist() == b[:5]  # each passage cut to max_len
    (whole,), _ = lra._sequences(tmp_path, meta, "train", max_len=None)[0]  # read as one sequence
    assert whole.tolist() == [*a, 256, *b]


def test_naive_bayes_uses_counts_and_the_prior():
    train = [([Counter({"lamb": 2})], 0), ([Counter({"lamb": 1, "lion": 1})], 1), ([Counter({"lion": 2})], 1)]
    # class 0: P(lamb) = 3/4, P(lion) = 1/4; class 1: P(lamb) = 2/6, P(lion) = 4/6 (add-one); prior 1/3, 2/3
    val = [([Counter({"lamb": 1})], 0), ([Counter({"lion": 1})], 1), ([Counter({"lamb": 1, "lion": 1})], 1)]
    # lamb+lion: class 0 1/3 * 3/4 * 1/4 = 0.0625 < class 1 2/3 * 2/6 * 4/6 = 0.148
    assert lra._naive_bayes(train, val) == 1.0
    assert lra._naive_bayes(train, [([Counter({"lamb": 1, "lion": 1})], 0)]) == 0.0


def test_tfidf_pairs_threshold_separates_shared_from_disjoint_words():
    same = lambda w: ([Counter({w: 1, "the": 3}), Counter({w: 2, "the": 1})], 1)  # noqa: E731
    other = lambda w, v: ([Counter({w: 1, "the": 3}), Counter({v: 1, "the": 3})], 0)  # noqa: E731
    train = [same("lamb"), same("lion"), other("lamb", "lion"), other("dove", "ark")]
    val = [same("dove"), other("lion", "ark"), other("ark", "dove")]
    # "the" is in every training passage: idf log(8 / 9) < 0 weighs it, the same for every pair, so the
    # shared rare word decides; the threshold fit on the training pairs sorts every validation pair
    assert lra._tfidf_pairs(train, val) == 1.0
    assert lra._tfidf_pairs(train, [([Counter({"lamb": 1}), Counter({"lamb": 1})], 0)]) == 0.0


def test_tfidf_pairs_thresholds_sit_between_distinct_scores():
    """Pairs of equal score (cosine 0: no shared word) fall on one side of the threshold together, and
    "never same" is a candidate: the fit is the best threshold on the training pairs themselves."""
    disjoint = lambda a, b, y: ([Counter({a: 1}), Counter({b: 1})], y)  # noqa: E731
    shared = lambda a, y=1: ([Counter({a: 1, "x" + a: 1}), Counter({a: 1, "y" + a: 1})], y)  # noqa: E731
    train = [disjoint("a", "b", 0), disjoint("c", "d", 0), disjoint("e", "f", 0), disjoint("g", "h", 1)]
    train += [shared("p"), shared("q"), shared("r")]
    assert lra._tfidf_pairs(train, train) == 6 / 7  # "same" above 0: only the disjoint positive wrong
    negatives = [shared("p", 0), shared("q", 0)]
    assert lra._tfidf_pairs(negatives, negatives) == 1.0  # never "same"


def test_trained_bag_learns_which_bytes_a_class_uses_and_ignores_their_order():
    """Two classes told apart by which bytes they hold, never by order: the bag, trained as the Text
    recipe trains (its optimiser, warmup, clipping) for 60 steps, gets every held-out sequence right,
    and reversing every held-out sequence changes no prediction's correctness."""
    import numpy as np

    from mmformer.recipe import load_recipe

    rng = np.random.default_rng(0)

    def sample(label: int) -> np.ndarray:  # class 0 draws from bytes 10-19, class 1 from 20-29
        return rng.integers(10 + 10 * label, 20 + 10 * label, size=int(rng.integers(8, 40)))

    train = [([sample(y)], y) for y in [0, 1] * 40]
    val = [([sample(y)], y) for y in [0, 1] * 10]
    recipe = load_recipe(
        lra.ROOT / lra.RECIPES["text"], ["trainer.max_steps=60", "optim.warmup_steps=5", "optim.lr=1e-2"]
    )
    assert lra.trained_bag(train, val, recipe) == 1.0
    assert lra.trained_bag(train, [([x[::-1]], y) for (x,), y in val], recipe) == 1.0
    # with a class token, which the bag has not: mean pooling skips its (empty) row
    with_cls = load_recipe(
        lra.ROOT / lra.RECIPES["text"],
        [
            "trainer.max_steps=60",
            "optim.warmup_steps=5",
            "optim.lr=1e-2",
            "model.tokenizers.bytes.class_token=true",
        ],
    )
    assert lra.trained_bag(train, val, with_cls) == 1.0


def test_trained_bag_reads_pairs_with_the_recipes_two_tower_head():
    """Pairs whose passages draw from one of four byte ranges, "same" when both draw from the same one:
    the bag of bytes under the Retrieval recipe's pair head (``[u, v, u·v, u−v]`` and its MLP), trained
    as the recipe trains for 200 steps, tells every held-out pair apart; swapping a pair's passages or
    reversing them keeps it right."""
    import numpy as np

    from mmformer.recipe import load_recipe

    rng = np.random.default_rng(0)

    def passage(source: int) -> np.ndarray:
        return rng.integers(10 * source, 10 * source + 10, size=int(rng.integers(8, 40)))

    def pair(same: int) -> tuple[list[np.ndarray], int]:
        a, b = rng.choice(4, size=2, replace=False)
        return [passage(a), passage(a if same else b)], same

    train, val = [pair(y) for y in [0, 1] * 200], [pair(y) for y in [0, 1] * 20]
    recipe = load_recipe(
        lra.ROOT / lra.RECIPES["retrieval"],
        ["trainer.max_steps=200", "optim.warmup_steps=10", "optim.lr=1e-2"],
    )
    assert lra.trained_bag(train, val, recipe) == 1.0
    assert lra.trained_bag(train, [([b[::-1], a], y) for (a, b), y in val], recipe) == 1.0
