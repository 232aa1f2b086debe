"""``data.pairs: true``: sequences stored as two joined by a separator id (``kjv-pairs``) read as pairs —
each half exactly as stored, batches of 2B rows in the order the pair head reads — and a model's logits
for a pair that depend on that pair alone, however its halves are padded."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from mmformer.data.sequence_format import write_meta, write_split

SEP = 9
RECIPE = """\
name: pairs_tiny
seed: 0
model:
  tokenizers: {{ids: {{kind: ids, vocab_size: 10, max_len: {max_len}, class_token: {cls}}}}}
  backbone: {{d_model: 16, n_layers: 1, n_heads: 2}}
  heads: {{same: {{kind: {head}, num_classes: 2, pool: {pool}}}}}
tasks:
  match:
    kind: classification
    tokenizer: ids
    head: same
    data: {{kind: sequences, root: {root}, batch_size: 3, pairs: {pairs}{extra}}}
optim: {{lr: 1e-3}}
trainer: {{max_steps: 2, accelerator: cpu, devices: 1}}
logger: {{mode: disabled}}
"""


def halves(rng, n):
    return [rng.integers(0, SEP, size=int(rng.integers(1, 12))) for _ in range(n)]


@pytest.fixture(scope="module")
def pairs_root(tmp_path_factory):
    """Pairs of id runs (ids 0–8) joined by id 9; label 1 when both halves start with the same id."""
    root = tmp_path_factory.mktemp("pairs")
    rng = np.random.default_rng(0)
    stored = {}
    for split, n in (("train", 12), ("val", 7)):
        a, b = halves(rng, n), halves(rng, n)
        seqs = [np.concatenate([x, [SEP], y]) for x, y in zip(a, b)]
        write_split(root, split, seqs, [int(x[0] == y[0]) for x, y in zip(a, b)])
        stored[split] = (a, b)
    write_meta(
        root, 10, max(len(s) for s in seqs), ["different", "same"], {"train": 12, "val": 7}, separator=SEP
    )
    return root, stored


def recipe(tmp_path, root, head="pair_classifier", pairs="true", max_len=16, extra="", pool="mean"):
    from mmformer.recipe import load_recipe

    path = tmp_path / "pairs_tiny.yaml"
    text = RECIPE.format(
        root=root,
        head=head,
        pairs=pairs,
        max_len=max_len,
        extra=extra,
        pool=pool,
        cls=str(pool == "cls").lower(),
    )
    path.write_text(text)
    return load_recipe(path)


def test_halves_are_read_as_stored_and_batched_first_then_second(pairs_root, tmp_path):
    from mmformer.build import build_datamodule

    root, stored = pairs_root
    data = build_datamodule(recipe(tmp_path, root)).data["match"]
    a, b = stored["val"]
    for i in range(len(a)):
        item = data.val[i]
        assert item["ids"].tolist() == a[i].tolist() and item["ids_b"].tolist() == b[i].tolist()
        assert item["label"] == int(a[i][0] == b[i][0])
    batch = data.collate([data.val[i] for i in (4, 0, 2)])
    n = max(len(h[i]) for h in (a, b) for i in (4, 0, 2))
    assert batch["ids"].shape == (6, n) and batch["label"].shape == (3,)
    for row, part in enumerate([a[4], a[0], a[2], b[4], b[0], b[2]]):
        assert batch["ids_valid"][row].sum() == len(part)
        assert batch["ids"][row, : len(part)].tolist() == part.tolist()
    cut = build_datamodule(recipe(tmp_path, root, extra=", max_len: 3, bucket_by_length: true"))
    cut = cut.data["match"]
    ta, tb = stored["train"]
    assert all(
        cut.train[i]["ids"].tolist() == ta[i][:3].tolist()
        and cut.train[i]["ids_b"].tolist() == tb[i][:3].tolist()
        for i in range(len(ta))
    )
    assert cut.lengths() == [min(3, max(len(x), len(y))) for x, y in zip(ta, tb)]


def test_a_pairs_logits_do_not_depend_on_the_batch_or_its_padding(pairs_root, tmp_path):
    from mmformer.build import build_datamodule, build_model

    root, _ = pairs_root
    r = recipe(tmp_path, root)
    data = build_datamodule(r).data["match"]
    torch.manual_seed(0)
    model = build_model(r).eval()
    head = model.heads["same"]
    items = [data.val[i] for i in range(4)]
    batch = data.collate(items)
    with torch.no_grad():
        together = model(batch["ids"], "ids", "same", valid=batch["ids_valid"])
        for i, it in enumerate(items):  # each half encoded alone, unpadded, then the head's MLP
            u, v = (model.encode("ids", it[k][None])[0].mean(1) for k in ("ids", "ids_b"))
            u, v = head.pooler.fc_norm(u), head.pooler.fc_norm(v)
            alone = head.mlp(torch.cat([u, v, u * v, u - v], -1))
            torch.testing.assert_close(together[i], alone[0], atol=1e-5, rtol=1e-4)


def test_cls_pooling_reads_each_towers_class_token_alone(pairs_root, tmp_path):
    """``pool: cls``: the last block computes the class-token rows only (``reads``), for all 2B rows."""
    from mmformer.build import build_datamodule, build_model

    root, _ = pairs_root
    r = recipe(tmp_path, root, pool="cls", max_len=17)
    data = build_datamodule(r).data["match"]
    torch.manual_seed(0)
    model = build_model(r).eval()
    items = [data.val[i] for i in range(4)]
    batch = data.collate(items)
    with torch.no_grad():
        together = model(batch["ids"], "ids", "same", valid=batch["ids_valid"])
        for i, it in enumerate(items):
            alone = data.collate([it])
            torch.testing.assert_close(
                model(alone["ids"], "ids", "same", valid=alone["ids_valid"])[0],
                together[i],
                atol=1e-5,
                rtol=1e-4,
            )


def test_leak_keys_are_the_halves_the_model_reads(pairs_root, tmp_path):
    from mmformer.build import build_datamodule

    root, stored = pairs_root
    cut = build_datamodule(recipe(tmp_path, root, extra=", max_len: 1")).data["match"]
    a, b = stored["train"]
    keys = cut.train_sources
    for i in range(len(a)):
        for j in range(len(a)):
            same = a[i][0] == a[j][0] and b[i][0] == b[j][0]  # what is left after the cut
            assert (keys[i] == keys[j]) == same


def test_a_recipe_with_pairs_trains(pairs_root, tmp_path, workdir, capsys):
    from mmformer.cli import main

    recipe(tmp_path, pairs_root[0])
    assert main(["train", str(tmp_path / "pairs_tiny.yaml"), "trainer.enable_progress_bar=false"]) == 0
    out = capsys.readouterr().out
    assert "FLOPs per pair of sequences of 16 tokens" in out and "val/match/acc" in out


def test_what_is_refused_and_named(pairs_root, tmp_path):
    from mmformer.build import build_datamodule
    from mmformer.data.roots import DataError
    from mmformer.errors import RecipeError

    root, _ = pairs_root
    with pytest.raises(
        RecipeError, match=r"'tasks.match.data.pairs' is true but head 'same' is 'classifier'"
    ):
        recipe(tmp_path, root, head="classifier")
    with pytest.raises(RecipeError, match="a pair_classifier reads pairs"):
        recipe(tmp_path, root, pairs="false")
    longest = max(len(h) for s in pairs_root[1].values() for side in s for h in side)
    with pytest.raises(
        DataError, match=rf"pairs whose halves have up to {longest} tokens but .*positions for 4 ids"
    ):
        build_datamodule(recipe(tmp_path, root, max_len=4))
    build_datamodule(recipe(tmp_path, root, max_len=4, extra=", max_len: 4"))  # cut to fit: accepted
    bad = tmp_path / "bad"
    bad.mkdir()
    write_split(bad, "train", [[1, 2, SEP, 3], [1, SEP, 2, SEP, 3]], [0, 1])
    write_split(bad, "val", [[1, SEP, 2]], [0])
    write_meta(bad, 10, 5, ["different", "same"], {}, separator=SEP)
    with pytest.raises(DataError, match=r"train.npz: sequence 1 holds the separator id 9 2 times"):
        build_datamodule(recipe(tmp_path, bad))
    with pytest.raises(DataError, match=r"train.npz: sequence 1 holds the separator id 9 2 times"):
        build_datamodule(recipe(tmp_path, bad, extra=", limit_train: 1"))  # named by its index in the file
    write_split(bad, "val", [[1, 2, 3], [4, SEP]], [0, 1])
    with pytest.raises(DataError, match=r"val.npz: sequence 0 holds the separator id 9 0 times"):
        build_datamodule(recipe(tmp_path, bad))
    write_split(bad, "train", [[1, SEP, 2], [4, SEP]], [0, 1])
    write_split(bad, "val", [[1, SEP, 2]], [0])
    with pytest.raises(DataError, match=r"train.npz: sequence 1 has an empty second half"):
        build_datamodule(recipe(tmp_path, bad))
    with pytest.raises(RecipeError, match="mlp_dim=1"):
        recipe(tmp_path, root, extra="", head="pair_classifier, mlp_dim: 1")
    write_meta(bad, 10, 5, ["different", "same"], {}, separator=10)
    with pytest.raises(
        DataError, match=r"separator id 10 is outside the vocabulary \(ids 0-9\); vocab_size counts"
    ):
        build_datamodule(recipe(tmp_path, bad))
    meta = json.loads((bad / "meta.json").read_text())
    del meta["separator"]
    (bad / "meta.json").write_text(json.dumps(meta))
    with pytest.raises(DataError, match="names no 'separator' id"):
        build_datamodule(recipe(tmp_path, bad))


def test_a_pair_head_on_another_kind_of_data_names_what_it_needs():
    from pathlib import Path

    from mmformer.errors import RecipeError
    from mmformer.recipe import load_recipe

    image = Path(__file__).parents[2] / "recipes/image/vit_tiny_classify_mnist5k.yaml"
    with pytest.raises(
        RecipeError, match="must be a classification task with data.kind: sequences and data.pairs"
    ):
        load_recipe(image, ["model.heads.digits={kind: pair_classifier, num_classes: 10}"])
