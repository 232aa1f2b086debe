"""Packed text shards (`data: {kind: shards, pack: true}`): windows are exactly `data.kind: text`'s packed
windows of the documents in the order the stream read them; every token of an epoch is in one window
except a tail shorter than one batch of windows; documents never attend across their boundary; every
rank takes the same number of full windows, sized from token counts stored at shard time (or counted
once and cached); a resumed epoch continues with the windows it had not trained; and a packed causal
LM trains through the CLI, in one process and as 2-process DDP with loader workers."""

from __future__ import annotations

import math
import os
import subprocess
import sys

import numpy as np
import pytest
import torch

from mmformer.cli import main
from mmformer.data.packed_shards import PackedShardStream, packed_text_stream, token_counts
from mmformer.data.roots import DataError
from mmformer.data.shards import read_index
from mmformer.data.text import PackedText, TokenCache, corpus_split
from mmformer.nn.masks import MaskSpec
from mmformer.tokenizers.text import TextTokenizer

SEQ, BATCH = 16, 2


@pytest.fixture
def corpus(workdir):
    """40 distinct documents of 1 to ~40 tokens, a tokenizer trained on them, and shards of 5 documents
    written with that tokenizer (token counts in the index)."""
    rng = np.random.default_rng(0)
    words = ["alpha", "beta", "gamma", "delta", "omega", "kappa"]
    docs = [f"Doc {i}: " + " ".join(rng.choice(words, int(rng.integers(0, 20)))) for i in range(40)]
    (workdir / "corpus.txt").write_text("\n\n".join(docs) + "\n")
    tok = TextTokenizer.train(docs, vocab_size=300)
    tok.save(workdir / "tok.json")
    out = workdir / "text-shards"
    args = ["data", "shard", str(workdir / "corpus.txt"), "--out", str(out), "--modality", "text"]
    assert (
        main(
            [
                *args,
                "--samples-per-shard",
                "5",
                "--val-fraction",
                "0.1",
                "--tokenizer",
                str(workdir / "tok.json"),
            ]
        )
        == 0
    )
    return workdir, tok, out


def _stream(out, tok, world=1, rank=0, epoch=0, workers=0) -> PackedShardStream:
    s = packed_text_stream(out, read_index(out), "train", tok, SEQ, BATCH, seed=0, shuffle_buffer=4)
    s.place(world, rank, workers)
    s.set_epoch(epoch)
    return s


def _windows(stream, workers=0) -> list[dict]:
    loader = torch.utils.data.DataLoader(stream, batch_size=BATCH, num_workers=workers)
    return [
        {k: v[i] for k, v in batch.items() if k != "bad_samples"} for batch in loader for i in range(BATCH)
    ]


def _worker_streams(windows: list[dict], workers: int) -> list[list[int]]:
    """Each loader worker's tokens in the order it packed them: the loader takes batches from the workers
    in turn, and every worker delivers as many."""
    n = max(1, workers)
    batches = [windows[i : i + BATCH] for i in range(0, len(windows), BATCH)]
    return [[t for b in batches[w::n] for x in b for t in x["text"].tolist()] for w in range(n)]


def _encoded(tok, docs) -> list[list[int]]:
    return [[*tok.encode(d), tok.eos_id] for d in docs]


def test_index_token_counts_equal_a_count_of_the_shards(corpus):
    workdir, tok, out = corpus
    info = read_index(out)
    docs, train, _ = corpus_split(workdir / "corpus.txt", 0.1, 0)
    stored = info["tokens"]["splits"]["train"]
    assert sum(stored) == sum(len(x) for x in _encoded(tok, [docs[i] for i in train]))
    del info["tokens"]  # shards written without --tokenizer: counted once, then read from the cache
    assert token_counts(out, info, "train", tok) == stored
    assert len(list((out / ".cache").glob("tokens-*-train.json"))) == 1
    assert token_counts(out, info, "train", tok) == stored


def test_windows_are_the_text_datasets_packed_windows_and_hold_every_token_once(corpus):
    workdir, tok, out = corpus
    docs, train, _ = corpus_split(workdir / "corpus.txt", 0.1, 0)
    encoded = {tuple(x): i for i, x in zip(train, _encoded(tok, [docs[i] for i in train]))}
    total = sum(len(x) for x in encoded)
    stream = _stream(out, tok)
    windows = _windows(stream)
    assert len(windows) == len(stream) == (total // SEQ) // BATCH * BATCH
    assert all(w["text"].shape == (SEQ,) and bool(w["text_valid"].all()) for w in windows)  # full windows
    # the stream cut into its documents: each training document at most once, in the order read
    flat = torch.cat([w["text"] for w in windows]).tolist()
    order, start = [], 0
    for end in [i + 1 for i, t in enumerate(flat) if t == tok.eos_id]:
        order.append(encoded.pop(tuple(flat[start:end])))  # KeyError: a document read twice or changed
        start = end
    tail = flat[start:]  # the document cut by the end of the epoch: a prefix of an unread one
    order.append(next(i for x, i in encoded.items() if list(x[: len(tail)]) == tail))
    left_out = total - len(flat)
    assert left_out < BATCH * SEQ  # the documented remainder: under one batch of windows
    # exactly data.kind: text's packed windows of the documents in that order (ids and document ids)
    packed = PackedText(TokenCache(docs, tok, workdir / "cache"), np.array(order), SEQ, tok.eos_id)
    for i, w in enumerate(windows):
        ref = packed[i]
        assert all(torch.equal(w[k], ref[k]) for k in ("text", "text_valid", "text_document")), i


def test_documents_never_attend_across_their_boundary(corpus):
    _, tok, out = corpus
    for w in _windows(_stream(out, tok)):
        text, doc = w["text"], w["text_document"]
        assert doc[0] == 0
        # a new document starts right after each eos, and nowhere else
        starts = (doc[1:] - doc[:-1]).tolist()
        assert starts == (text[:-1] == tok.eos_id).long().tolist()
        mask = MaskSpec(causal=True, document=doc[None]).dense(SEQ)[0, 0]
        same = doc[:, None] == doc[None, :]
        assert not bool((mask & ~same).any()) and bool(mask[same.tril()].all())


@pytest.mark.parametrize("workers", [0, 2])
def test_every_rank_takes_the_same_number_of_full_windows_and_no_token_twice(corpus, workers):
    workdir, tok, out = corpus
    per_rank = [_windows(_stream(out, tok, world=2, rank=r, workers=workers), workers) for r in (0, 1)]
    stream = _stream(out, tok, world=2, rank=0, workers=workers)
    tokens = read_index(out)["tokens"]["splits"]["train"]
    groups = [sum(tokens[s] for s in g) for g in stream.groups]
    assert len(stream.groups) == 2 * max(1, workers) and sorted(sum(stream.groups, [])) == list(range(8))
    assert len(per_rank[0]) == len(per_rank[1]) == min(groups) // SEQ // BATCH * BATCH * max(1, workers) > 0
    assert all(bool(w["text_valid"].all()) and w["text"].shape == (SEQ,) for r in per_rank for w in r)
    # each worker's stream is whole training documents, then the start of one more: none read twice
    docs, train, _ = corpus_split(workdir / "corpus.txt", 0.1, 0)
    encoded = _encoded(tok, [docs[i] for i in train])
    read = []
    for stream in (s for r in per_rank for s in _worker_streams(r, workers)):
        cuts = [i + 1 for i, t in enumerate(stream) if t == tok.eos_id]
        read += [stream[a:b] for a, b in zip([0, *cuts], cuts)]
        tail = stream[cuts[-1] if cuts else 0 :]
        assert any(e[: len(tail)] == tail for e in encoded)
    assert all(d in encoded for d in read) and len({tuple(d) for d in read}) == len(read)
    # the next epoch deals and shuffles differently
    again = _windows(_stream(out, tok, world=2, rank=0, epoch=1, workers=workers), workers)
    assert len(again) == len(per_rank[0])
    assert [w["text"].tolist() for w in again] != [w["text"].tolist() for w in per_rank[0]]


def test_too_few_shards_for_the_workers_are_refused(corpus):
    _, tok, out = corpus
    with pytest.raises(DataError, match="a shard per worker"):
        _stream(out, tok, world=3, rank=0, workers=3)  # 8 shards for 9 workers


@pytest.mark.parametrize("workers", [0, 2])
def test_a_resumed_epoch_continues_with_the_windows_not_yet_trained(corpus, workers):
    _, tok, out = corpus
    whole = [w["text"].tolist() for w in _windows(_stream(out, tok, workers=workers), workers)]
    for done in (2, 3):  # after 3 batches the interrupted epoch's next batch was worker 1's
        stream = _stream(out, tok, workers=workers)
        stream.skip(done * BATCH)
        rest = [w["text"].tolist() for w in _windows(stream, workers)]
        assert rest == whole[done * BATCH :]


@pytest.mark.slow
def test_a_packed_causal_lm_trains_from_shards_through_the_cli(corpus, capsys):
    workdir, tok, out = corpus
    recipe = workdir / "lm.yaml"
    recipe.write_text(
        f"""\
name: packed_lm
model:
  tokenizers: {{text: {{kind: bpe, path: {workdir / "tok.json"}}}}}
  backbone: {{preset: debug, causal: true}}
  heads: {{lm: {{kind: lm}}}}
tasks:
  corpus:
    kind: causal_lm
    tokenizer: text
    head: lm
    data: {{kind: shards, root: {out}, seq_len: {SEQ}, pack: true, batch_size: {BATCH}, num_workers: 0}}
optim: {{lr: 1e-3, warmup_steps: 1}}
trainer: {{max_steps: 3, accelerator: cpu, devices: 1, enable_progress_bar: false, num_sanity_val_steps: 0}}
logger: {{mode: disabled}}
"""
    )
    assert main(["train", str(recipe)]) == 0
    finals = [ln.split() for ln in capsys.readouterr().out.splitlines() if ln.startswith("val/corpus/")]
    assert finals and all(math.isfinite(float(v)) for _, v, *_ in finals)

    # 2-process DDP, 2 loader workers each, one whole epoch: both ranks take the same number of steps (a
    # rank with fewer would hang the other in its gradient all-reduce), the epoch's size from the index
    overrides = ["name=packed_ddp", "trainer.max_steps=-1", "trainer.max_epochs=1", "trainer.devices=2",
                 "trainer.strategy=ddp", "tasks.corpus.data.num_workers=2"]  # fmt: skip
    res = subprocess.run(
        [sys.executable, "-m", "mmformer.cli", "train", str(recipe), *overrides],
        capture_output=True,
        text=True,
        env=dict(os.environ, PYTHONUNBUFFERED="1"),
        timeout=300,
    )
    assert res.returncode == 0, res.stderr[-3000:]
    (last,) = (workdir / "runs" / "packed_ddp").glob("*/checkpoints/last.ckpt")
    steps = torch.load(last, map_location="cpu", weights_only=True)["global_step"]
    assert steps == len(_stream(out, tok, world=2, rank=0, workers=2)) // BATCH > 0
