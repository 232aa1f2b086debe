"""The Long Range Arena sets (mmformer/data/lra): every ListOps label is its expression's value (by an
evaluator written here, on the text), lengths and tree shapes are LRA's; every Pathfinder positive joins
its markers by a path and no negative does (flood fill here, in pure Python); KJV passages are verbatim
text of the book they are labelled with (and of no other chosen book), from the split's own chapters;
fixed seeds reproduce every set. Then the ``sequences`` data kind and ``ids`` tokenizer: batches, the
padding invariant, and the rules a recipe must keep."""

from __future__ import annotations

import json
import logging
import statistics
from collections import deque
from pathlib import Path

import numpy as np
import pytest
import torch

from mmformer.data.lra import build_kjv_books, build_kjv_pairs, build_listops, build_pathfinder
from mmformer.data.prepare import BUNDLED
from mmformer.data.sequence_format import read_meta, read_split

SPLITS = ("train", "val", "test")


def load(root: Path) -> tuple[dict, dict[str, list[tuple[np.ndarray, int]]]]:
    meta = read_meta(root)
    out = {}
    for split in SPLITS:
        tokens, offsets, labels = read_split(root, split, meta)
        out[split] = [(tokens[offsets[i] : offsets[i + 1]], int(labels[i])) for i in range(len(labels))]
    return meta, out


# ----------------------------------------------------------------------------------------------- ListOps
def value_of(tokens: list[str]) -> tuple[int, int, int]:
    """Evaluate a ListOps expression from its text tokens by recursive descent: (value, operator depth,
    most arguments of one operator). Raises on anything malformed."""
    pos = 0

    def node() -> tuple[int, int, int]:
        nonlocal pos
        tok = tokens[pos]
        pos += 1
        if tok.isdigit():
            return int(tok), 0, 0
        assert tok in ("[MAX", "[MIN", "[MED", "[SM"), tok
        args, depth, width = [], 0, 0
        while tokens[pos] != "]":
            v, d, w = node()
            args.append(v)
            depth, width = max(depth, d), max(width, w)
        pos += 1
        value = {
            "[MAX": max,
            "[MIN": min,
            "[MED": lambda a: int(statistics.median(a)),  # LRA: int(np.median), the mean of the middle two
            "[SM": lambda a: sum(a) % 10,
        }[tok](args)
        return value, depth + 1, max(width, len(args))

    result = node()
    assert pos == len(tokens), "tokens after the expression"
    return result


@pytest.fixture(scope="module")
def listops(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("listops")
    build_listops(out, n_train=150, n_val=40, n_test=40, seed=0)
    return out


def test_listops_labels_are_the_values_of_lra_shaped_expressions(listops):
    meta, splits = load(listops)
    vocab = meta["vocabulary"]
    assert meta["classes"] == [str(d) for d in range(10)] and meta["vocab_size"] == len(vocab) == 15
    seen, values = set(), []
    for split, rows in splits.items():
        assert len(rows) == meta["splits"][split]
        for ids, label in rows:
            value, depth, width = value_of([vocab[i] for i in ids])
            assert value == label
            assert 500 < len(ids) < 2000 and len(ids) <= meta["max_len"]  # LRA's kept lengths
            assert 1 <= depth <= 9 and 2 <= width <= 10  # digits at depth ≤ 10: operators nest ≤ 9 deep
            seen.add(tuple(ids))
            values.append(value)
    assert len(seen) == sum(len(r) for r in splits.values())  # distinct expressions, across splits too
    assert len(set(values)) == 10


def test_listops_is_reproducible_from_its_seed(listops, tmp_path):
    again, other = tmp_path / "again", tmp_path / "other"
    again.mkdir(), other.mkdir()
    build_listops(again, n_train=150, n_val=40, n_test=40, seed=0)
    build_listops(other, n_train=150, n_val=40, n_test=40, seed=1)
    for split in SPLITS:
        a, b, c = (np.load(r / f"{split}.npz") for r in (listops, again, other))
        assert all(np.array_equal(a[k], b[k]) for k in ("tokens", "offsets", "labels"))
        assert not np.array_equal(a["offsets"], c["offsets"])


# -------------------------------------------------------------------------------------------- Pathfinder
def component(image: np.ndarray, start: tuple[int, int]) -> set[tuple[int, int]]:
    """The foreground pixels 8-connected to ``start`` (breadth-first flood fill)."""
    h, w = image.shape
    seen, todo = {start}, deque([start])
    while todo:
        y, x = todo.popleft()
        for dy in (-1, 0, 1):
            for dx in (-1, 0, 1):
                p = (y + dy, x + dx)
                if 0 <= p[0] < h and 0 <= p[1] < w and p not in seen and image[p] > 0:
                    seen.add(p)
                    todo.append(p)
    return seen


@pytest.fixture(scope="module")
def pathfinder(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("pathfinder")
    build_pathfinder(out, n_train=60, n_val=20, n_test=20, seed=0)
    return out


def test_pathfinder_markers_are_joined_exactly_in_the_positives(pathfinder):
    meta, splits = load(pathfinder)
    assert meta["classes"] == ["disconnected", "connected"] and meta["max_len"] == 1024
    for split, rows in splits.items():
        markers = np.load(pathfinder / f"{split}-markers.npy")
        labels = [label for _, label in rows]
        assert labels.count(0) == labels.count(1) == len(rows) // 2  # balanced
        for (ids, label), (a, b) in zip(rows, markers):
            assert len(ids) == 1024 and set(np.unique(ids)) <= {0, 255}
            image = ids.reshape(32, 32)
            a, b = tuple(int(v) for v in a), tuple(int(v) for v in b)
            for m in (a, b):  # a disc of radius 1.5 at each marker, on the end of a long path
                assert (image[m[0] - 1 : m[0] + 2, m[1] - 1 : m[1] + 2] == 255).all()
                assert len(component(image, m)) >= 9 + 20
            assert (b in component(image, a)) == bool(label), (split, label)
            assert (
                not image[0].any()
                and not image[-1].any()
                and not image[:, 0].any()
                and not image[:, -1].any()
            )


def test_pathfinder_is_reproducible_from_its_seed(pathfinder, tmp_path):
    build_pathfinder(tmp_path, n_train=60, n_val=20, n_test=20, seed=0)
    for split in SPLITS:
        a, b = np.load(pathfinder / f"{split}.npz"), np.load(tmp_path / f"{split}.npz")
        assert np.array_equal(a["tokens"], b["tokens"]) and np.array_equal(a["labels"], b["labels"])


# ------------------------------------------------------------------------------------------------ KJV
@pytest.fixture(scope="module")
def kjv_root(tmp_path_factory):
    """A data root with the real KJV prepared (the text sets read it from there)."""
    missing = BUNDLED["kjv"].missing()
    if missing:
        pytest.skip(missing)
    from mmformer.data.prepare import prepare

    root = tmp_path_factory.mktemp("kjv-data")
    mp = pytest.MonkeyPatch()
    mp.setenv("MMFORMER_DATA", str(root))
    prepare("kjv")
    yield root
    mp.undo()


def book_texts(root: Path) -> dict[str, str]:
    """Each book's verses (numbers dropped) joined by spaces, read here from kjv.txt."""
    books: dict[str, list[str]] = {}
    for doc in (root / "kjv" / "kjv.txt").read_text().strip().split("\n\n"):
        lines = doc.split("\n")
        books.setdefault(lines[0].rsplit(" ", 1)[0], []).extend(v.split(" ", 1)[1] for v in lines[1:])
    return {b: " ".join(v) for b, v in books.items()}


def test_kjv_books_passages_are_verbatim_text_of_their_book(kjv_root, tmp_path, monkeypatch):
    monkeypatch.setenv("MMFORMER_DATA", str(kjv_root))
    build_kjv_books(tmp_path, {"train": 6, "val": 3, "test": 3})
    meta, splits = load(tmp_path)
    books = book_texts(kjv_root)
    classes = meta["classes"]
    assert len(classes) == 10 and meta["max_len"] == 4096
    texts = {}
    for split, rows in splits.items():
        counts = np.bincount([label for _, label in rows], minlength=10)
        assert (counts == counts[0]).all()  # balanced
        for ids, label in rows:
            text = bytes(ids.astype(np.uint8)).decode("utf-8")
            assert 2048 <= len(ids) <= 4096
            assert text in books[classes[label]]
            assert not any(text in books[b] for b in classes if b != classes[label])
            texts.setdefault(split, []).append(text)
    for held in ("val", "test"):  # held-out passages come from chapters no training passage touches
        for text in texts[held]:
            first_verse = text[:200]
            assert not any(first_verse in t for t in texts["train"])


def test_kjv_pairs_are_labelled_by_their_books(kjv_root, tmp_path, monkeypatch):
    monkeypatch.setenv("MMFORMER_DATA", str(kjv_root))
    build_kjv_pairs(tmp_path, {"train": 20, "val": 10, "test": 10})
    meta, splits = load(tmp_path)
    books = book_texts(kjv_root)
    names = meta["books"]
    for split, rows in splits.items():
        pair_books = np.load(tmp_path / f"{split}-books.npy")
        assert sum(label for _, label in rows) == len(rows) // 2
        for (ids, label), (a, b) in zip(rows, pair_books):
            (sep,) = np.flatnonzero(ids == 256)
            first, second = (
                bytes(part.astype(np.uint8)).decode("utf-8") for part in (ids[:sep], ids[sep + 1 :])
            )
            assert 1024 <= len(first) <= 2047 and 1024 <= len(second) <= 2047
            assert first in books[names[a]] and second in books[names[b]]
            assert label == int(a == b)
            if label:
                assert first not in second and second not in first
        shown = [json.loads(line) for line in (tmp_path / f"{split}-sample.jsonl").read_text().splitlines()]
        assert len(shown) == min(20, len(rows))  # the first pairs, as stored, with their books
        for row, (ids, label), (a, b) in zip(shown, rows, pair_books):
            assert row["books"] == [names[a], names[b]] and row["label"] == ["different", "same"][label]
            assert list(ids) == [*row["a"].encode(), 256, *row["b"].encode()]


def test_kjv_sets_are_reproducible(kjv_root, tmp_path, monkeypatch):
    monkeypatch.setenv("MMFORMER_DATA", str(kjv_root))
    for n in ("a", "b"):
        (tmp_path / n).mkdir()
        build_kjv_books(tmp_path / n, {"train": 2, "val": 1, "test": 1})
    assert np.array_equal(
        np.load(tmp_path / "a/val.npz")["tokens"], np.load(tmp_path / "b/val.npz")["tokens"]
    )


# ---------------------------------------------------------------------------- data kind and tokenizer
RECIPE = """\
name: lra_tiny
seed: 0
model:
  tokenizers: {{ids: {{kind: ids, vocab_size: {vocab}, max_len: {max_len}, class_token: {class_token}}}}}
  backbone: {{d_model: 32, n_layers: 1, n_heads: 2, attn_kernel: {kernel}}}
  heads: {{cls: {{kind: classifier, num_classes: {classes}, pool: {pool}}}}}
tasks:
  toy:
    kind: classification
    tokenizer: ids
    head: cls
    data: {{kind: {data_kind}, root: {root}, batch_size: 4}}
optim: {{lr: 1e-3}}
trainer: {{max_steps: 2, accelerator: cpu, devices: 1}}
logger: {{mode: disabled}}
"""


def tiny_recipe(tmp_path, **kw):
    from mmformer.recipe import load_recipe

    values = dict(
        vocab=15,
        max_len=2000,
        kernel="sdpa",
        classes=10,
        pool="mean",
        data_kind="sequences",
        class_token=False,
    )
    path = tmp_path / "lra_tiny.yaml"
    path.write_text(RECIPE.format(**{**values, **kw}))
    return load_recipe(path)


@pytest.mark.parametrize("kernel,pool", [("sdpa", "mean"), ("performer", "mean"), ("sdpa", "cls")])
def test_batches_and_padding_change_nothing(listops, tmp_path, kernel, pool):
    from mmformer.build import build_datamodule, build_model

    recipe = tiny_recipe(tmp_path, root=listops, kernel=kernel, pool=pool, class_token=pool == "cls")
    data = build_datamodule(recipe).data["toy"]
    items = [data.val[i] for i in range(3)]
    batch = data.collate(items)
    lengths = [len(it["ids"]) for it in items]
    assert batch["ids"].shape == (3, max(lengths)) and batch["ids_valid"].sum(1).tolist() == lengths
    assert batch["label"].tolist() == [it["label"] for it in items]
    torch.manual_seed(0)
    model = build_model(recipe).eval()
    with torch.no_grad():
        together = model(batch["ids"], "ids", "cls", valid=batch["ids_valid"])
        for i, it in enumerate(items):
            alone = model(it["ids"][None], "ids", "cls", valid=torch.ones(1, lengths[i], dtype=torch.bool))
            torch.testing.assert_close(together[i], alone[0], atol=1e-5, rtol=1e-4)


def test_a_model_without_any_position_is_warned_about(tmp_path, caplog):
    """max_len null with positions none: the ids are a set to the model (legal for a bag-of-ids
    baseline, a silent failure for ListOps), so loading says so, naming both keys."""
    with caplog.at_level(logging.WARNING, logger="mmformer"):
        tiny_recipe(tmp_path, root="listops", max_len="null")
    (line,) = [r.getMessage() for r in caplog.records if "sees no position" in r.getMessage()]
    assert line.startswith("'model.tokenizers.ids.max_len' is null and 'model.backbone.positions' is none")
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="mmformer"):
        tiny_recipe(tmp_path, root="listops", max_len=64)
    assert not [r for r in caplog.records if "sees no position" in r.getMessage()]


def test_recipe_rules(listops, tmp_path):
    from mmformer.build import build_datamodule
    from mmformer.data.roots import DataError
    from mmformer.errors import RecipeError

    with pytest.raises(RecipeError, match="class_token"):
        tiny_recipe(tmp_path, root=listops, pool="cls")
    with pytest.raises(RecipeError, match="data.kind: sequences"):
        tiny_recipe(tmp_path, root=listops, data_kind="text_classification")
    with pytest.raises(DataError, match="vocab_size=8"):
        build_datamodule(tiny_recipe(tmp_path, root=listops, vocab=8))
    longest = json.loads((listops / "meta.json").read_text())["max_len"]
    with pytest.raises(DataError, match=r"positions for 1000 ids \(its max_len\)"):
        build_datamodule(tiny_recipe(tmp_path, root=listops, max_len=1000))
    build_datamodule(tiny_recipe(tmp_path, root=listops, max_len=longest))  # fits exactly
    with pytest.raises(
        DataError,
        match=rf"positions for {longest - 1} ids \(max_len={longest} less one for its class token\)",
    ):
        build_datamodule(tiny_recipe(tmp_path, root=listops, max_len=longest, class_token=True))
    with pytest.raises(DataError) as e:  # an AFT kernel's position biases are a limit too, named
        build_datamodule(
            tiny_recipe(tmp_path, root=listops, kernel="aft_full, kernel_options: {max_len: 100}")
        )
    assert str(e.value).endswith(
        f"has sequences of up to {longest} tokens but the aft_full kernel holds position biases for 100 tokens "
        "(model.backbone.kernel_options.max_len): raise it, or cut the sequences with data.max_len"
    )
    with pytest.raises(DataError, match="num_classes=3"):
        build_datamodule(tiny_recipe(tmp_path, root=listops, classes=3))
    meta = json.loads((listops / "meta.json").read_text())
    assert meta["splits"] == {"train": 150, "val": 40, "test": 40}


def test_limit_train_and_length_buckets(listops, tmp_path):
    from mmformer.build import build_datamodule
    from mmformer.recipe import load_recipe

    tiny_recipe(tmp_path, root=listops)  # writes the file
    recipe = load_recipe(
        tmp_path / "lra_tiny.yaml",
        [
            "tasks.toy.data.limit_train=20",
            "tasks.toy.data.bucket_by_length=true",
            "tasks.toy.data.max_len=600",
        ],
    )
    data = build_datamodule(recipe).data["toy"]
    full = build_datamodule(tiny_recipe(tmp_path, root=listops)).data["toy"]
    assert len(data.train) == 20 and len(data.val) == 40
    lengths = data.lengths()
    assert (
        len(lengths) == 20
        and max(lengths) == 600
        and all(len(data.train[i]["ids"]) == n for i, n in enumerate(lengths))
    )
    kept = {tuple(data.train[i]["ids"].tolist()) for i in range(20)}  # a subset of the training set, cut
    assert kept <= {tuple(full.train[i]["ids"][:600].tolist()) for i in range(len(full.train))}


def test_bundled_names_and_their_sources():
    for name in (
        "listops",
        "listops-full",
        "pathfinder",
        "pathfinder-full",
        "kjv-books",
        "kjv-pairs",
        "mnist5k-pixels",
    ):
        assert name in BUNDLED
    assert BUNDLED["kjv-books"].needs == BUNDLED["kjv-pairs"].needs == ("bible",)


def test_mnist5k_pixels_are_the_mnist5k_digits_row_major(tmp_path, monkeypatch):
    """Every sequence is one mnist5k image's grey levels, row-major, with its class; the sample PNG is
    the first stored images side by side."""
    from PIL import Image

    from mmformer.data.lra import build_mnist5k_pixels
    from mmformer.data.prepare import prepare

    monkeypatch.setenv("MMFORMER_DATA", str(tmp_path / "data"))
    digits = prepare("mnist5k")
    (tmp_path / "px").mkdir()
    build_mnist5k_pixels(tmp_path / "px")
    meta = read_meta(tmp_path / "px")
    assert meta["max_len"] == 784 and meta["splits"] == {"train": 4500, "val": 500}
    tokens, offsets, labels = read_split(tmp_path / "px", "val", meta)
    rows = [(tokens[offsets[i] : offsets[i + 1]], int(labels[i])) for i in range(len(labels))]
    images = {}
    for path in (digits / "val").glob("*/*.png"):
        images.setdefault(np.asarray(Image.open(path).convert("L"), np.uint8).tobytes(), set()).add(
            path.parent.name
        )
    for ids, label in rows:
        assert meta["classes"][label] in images[ids.astype(np.uint8).tobytes()]  # a real digit, its class
    assert len({ids.astype(np.uint8).tobytes() for ids, _ in rows}) == len(images) == 500
    grid = np.asarray(Image.open(tmp_path / "px" / "val-sample.png"))
    assert grid.shape == (28, 8 * 28)
    assert np.array_equal(grid[:, :28].reshape(-1), rows[0][0])
