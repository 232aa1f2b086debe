"""Caption shards: `mmformer data shard --modality image_caption|audio_caption` writes the manifests that
data.kind image_caption / audio_caption read; the shards decode into exactly those datasets' items
(caption ids and zero-shot labels included), train contrastive, prefix-LM and encoder–decoder recipes
through the CLI, and a task given the wrong shards, or caption shards with packing, is told what to do."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch

from mmformer.build import build_datamodule
from mmformer.cli import main
from mmformer.data.roots import DataError
from mmformer.data.shards import read_index
from mmformer.recipe import RecipeError, load_recipe
from tests.conftest import make_image_folder

WORDS = ["red", "blue", "round", "square", "small", "big", "dot", "ring"]


def _caption(i: int) -> str:
    return f"a {WORDS[i % 8]} {WORDS[(i * 3 + 1) % 8]} shape"


@pytest.fixture
def image_captions(workdir):
    """``root/{train,val}.jsonl`` with images under ``root/images``, a ``group`` field and its prompts;
    two training rows share a caption (equal caption ids)."""
    from PIL import Image

    root = workdir / "pairs"
    (root / "images").mkdir(parents=True)
    rng = np.random.default_rng(0)
    for split, n in (("train", 16), ("val", 8)):
        rows = []
        for i in range(n):
            name = f"images/{split}{i:02d}.png"
            px = rng.integers(0, 255, (16, 16), dtype=np.uint8)
            Image.fromarray(px, mode="L").save(root / name)
            row = {"image": name, "caption": _caption(i if i != 5 else 4)}
            if i % 4:  # some rows without a class: label -1
                row["group"] = "shapes" if i % 2 else "colours"
            rows.append(json.dumps(row))
        (root / f"{split}.jsonl").write_text("\n".join(rows) + "\n")
    (root / "group.json").write_text(json.dumps({"colours": ["a colour"], "shapes": ["a shape", "a form"]}))
    return root


@pytest.fixture
def audio_captions(workdir):
    """``root/{train,test}.jsonl`` of ``{"audio": clip, "text": transcript}`` (8 kHz clips)."""
    import soundfile

    root = workdir / "speech"
    (root / "clips").mkdir(parents=True)
    rng = np.random.default_rng(1)
    for split, n in (("train", 8), ("test", 4)):
        rows = []
        for i in range(n):
            name = f"clips/{split}{i}.wav"
            soundfile.write(root / name, rng.normal(0, 0.1, 2000 + 400 * i).astype("float32"), 8000)
            rows.append(json.dumps({"audio": name, "text": _caption(i)}))
        (root / f"{split}.jsonl").write_text("\n".join(rows) + "\n")
    return root


@pytest.fixture
def tokenizer_file(workdir):
    from mmformer.tokenizers.text import TextTokenizer

    path = workdir / "tokenizer.json"
    TextTokenizer.train([_caption(i) for i in range(16)], vocab_size=300).save(path)
    return path


def _shard(src, out, modality, per_shard=4) -> dict:
    args = ["data", "shard", str(src), "--out", str(out), "--modality", modality]
    assert main([*args, "--samples-per-shard", str(per_shard)]) == 0
    return read_index(out)


IMAGE = "image: {kind: vit_patch, image_size: 16, patch_size: 8, in_chans: 1, mean: [0.5], std: [0.25]"
AUDIO = (
    "audio: {kind: ast, sample_rate: 8000, n_mels: 16, n_fft: 200, hop_length: 80, patch_size: [16, 8], "
    "patch_stride: [16, 8], max_seconds: 1.0}"
)
RECIPES = {
    "contrastive": f"""\
name: clip_shards
model:
  tokenizers:
    {IMAGE}}}
    caption: {{kind: bpe, path: TOKENIZER, max_len: 16}}
  backbone: {{preset: debug}}
  heads:
    image_embed: {{kind: projection, embed_dim: 8}}
    caption_embed: {{kind: projection, embed_dim: 8, pool: mean}}
tasks:
  pairs:
    kind: contrastive
    tokenizer: image
    head: image_embed
    caption_tokenizer: caption
    caption_head: caption_embed
    data: DATA
""",
    "prefix_lm": f"""\
name: prefix_shards
model:
  tokenizers:
    {IMAGE}, class_token: false}}
    caption: {{kind: bpe, path: TOKENIZER, max_len: 16}}
  backbone: {{preset: debug, causal: true}}
  heads: {{lm: {{kind: lm}}}}
tasks:
  pairs: {{kind: prefix_lm, tokenizer: image, caption_tokenizer: caption, caption_head: lm, max_new_tokens: 6,
          data: DATA}}
""",
    "seq2seq": f"""\
name: asr_shards
model:
  tokenizers:
    {AUDIO}
    caption: {{kind: bpe, path: TOKENIZER, max_len: 16}}
  towers: {{audio: {{d_model: 32, n_layers: 1, n_heads: 2}}}}
  backbone: {{d_model: 32, n_layers: 1, n_heads: 2, block: cross, causal: true}}
  heads: {{lm: {{kind: lm}}}}
tasks:
  pairs: {{kind: seq2seq, tokenizer: audio, caption_tokenizer: caption, caption_head: lm, max_new_tokens: 6,
          data: DATA}}
""",
}
TRAINER = """\
optim: {lr: 1e-3, warmup_steps: 1}
trainer: {max_epochs: 1, accelerator: cpu, devices: 1, log_every_n_steps: 1, enable_progress_bar: false,
          num_sanity_val_steps: 0}
logger: {mode: disabled}
"""


def _recipe(workdir, kind: str, data: str, tokenizer, name: str = "r.yaml"):
    path = workdir / name
    path.write_text(RECIPES[kind].replace("TOKENIZER", str(tokenizer)).replace("DATA", data) + TRAINER)
    return path


def _same(a: dict, b: dict, media: str) -> bool:
    return (
        torch.equal(a[media], b[media])
        and a["ids"] == b["ids"]
        and a["caption"] == b["caption"]
        and a["caption_id"] == b["caption_id"]
        and a.get("label") == b.get("label")
    )


def test_image_caption_shards_decode_like_the_manifest_dataset(image_captions, tokenizer_file, workdir):
    out = workdir / "pair-shards"
    info = _shard(image_captions, out, "image_caption")
    assert info["modality"] == "image_caption" and set(info["splits"]) == {"train", "val"}
    assert [n for _, n in info["splits"]["train"]] == [4, 4, 4, 4]
    assert (out / "group.json").read_text() == (image_captions / "group.json").read_text()
    common = "batch_size: 4, max_len: 16, num_workers: 0, label_key: group"
    shards = _recipe(workdir, "contrastive", f"{{kind: shards, root: {out}, {common}}}", tokenizer_file)
    folder = _recipe(
        workdir,
        "contrastive",
        f"{{kind: image_caption, root: {image_captions}, {common}}}",
        tokenizer_file,
        "f.yaml",
    )
    from_shards = build_datamodule(load_recipe(shards)).data["pairs"]
    from_folder = build_datamodule(load_recipe(folder)).data["pairs"]
    # validation: the same items in the same order (one rank reads the split in file order)
    val = list(from_shards.val)
    assert len(val) == len(from_folder.val) == 8
    assert all(_same(s, from_folder.val[i], "image") for i, s in enumerate(val))
    assert [s["label"] for s in val] == [-1, 1, 0, 1, -1, 1, 0, 1]
    # training: every sample once, shuffled, each equal to the dataset's item of its caption and image
    train = list(from_shards.train)
    assert len(train) == 16
    expected = [from_folder.train[i] for i in range(16)]
    assert all(sum(_same(s, e, "image") for e in expected) == 1 for s in train)
    assert from_folder.train[4]["caption_id"] == from_folder.train[5]["caption_id"]  # a shared caption
    batch = from_shards.collate(train[:4])
    want = from_folder.collate([e for s in train[:4] for e in expected if _same(s, e, "image")])
    assert batch.keys() == want.keys() and batch["bad_samples"] == want["bad_samples"] == []
    assert all(
        torch.equal(batch[k], want[k]) for k in ("image", "caption", "caption_valid", "caption_id", "label")
    )


def test_audio_caption_shards_decode_like_the_manifest_dataset(audio_captions, tokenizer_file, workdir):
    out = workdir / "speech-shards"
    info = _shard(audio_captions, out, "audio_caption")
    assert set(info["splits"]) == {"train", "test"}
    data = "batch_size: 2, max_len: 16, num_workers: 0, val_split: test"
    shards = _recipe(workdir, "seq2seq", f"{{kind: shards, root: {out}, {data}}}", tokenizer_file)
    folder = _recipe(
        workdir,
        "seq2seq",
        f"{{kind: audio_caption, root: {audio_captions}, {data}}}",
        tokenizer_file,
        "f.yaml",
    )
    from_shards = build_datamodule(load_recipe(shards)).data["pairs"]
    from_folder = build_datamodule(load_recipe(folder)).data["pairs"]
    val = list(from_shards.val)
    assert len(val) == len(from_folder.val) == 4
    assert all(_same(s, from_folder.val[i], "audio") for i, s in enumerate(val))
    assert val[0]["path"].endswith(".tar:000000000")  # shard:key names a sample, as a path does
    batch, want = from_shards.collate(val), from_folder.collate([from_folder.val[i] for i in range(4)])
    for key in ("audio", "audio_valid", "caption", "caption_valid", "caption_id"):
        assert torch.equal(batch[key], want[key])
    assert batch["caption_text"] == want["caption_text"]


@pytest.mark.parametrize("kind", ["contrastive", "prefix_lm", "seq2seq"])
def test_caption_tasks_train_from_shards_through_the_cli(
    kind, image_captions, audio_captions, tokenizer_file, workdir, capsys
):
    audio = kind == "seq2seq"
    out = workdir / "shards"
    _shard(audio_captions if audio else image_captions, out, "audio_caption" if audio else "image_caption")
    data = "batch_size: 4, max_len: 16, num_workers: 0" + (", val_split: test" if audio else "")
    if kind == "contrastive":
        data += ", label_key: group"
    recipe = _recipe(workdir, kind, f"{{kind: shards, root: {out}, {data}}}", tokenizer_file)
    assert main(["train", str(recipe), "trainer.max_steps=3"]) == 0
    finals = dict(
        ln.split()[:2] for ln in capsys.readouterr().out.splitlines() if ln.startswith("val/pairs/")
    )
    metric = {"contrastive": "recall@1", "prefix_lm": "exact_match", "seq2seq": "wer"}[kind]
    assert f"val/pairs/{metric}" in finals, finals
    assert all(math.isfinite(float(v)) for v in finals.values())
    if kind == "contrastive":
        assert "val/pairs/zero_shot_acc" in finals, finals  # the classes of group.json, copied over


def test_wrong_shards_or_options_for_a_task_are_named(image_captions, tokenizer_file, workdir):
    folder = make_image_folder(workdir / "classes", n_per_class=4, size=16)
    out = workdir / "class-shards"
    _shard(folder, out, "image")
    recipe = _recipe(workdir, "contrastive", f"{{kind: shards, root: {out}, max_len: 16}}", tokenizer_file)
    with pytest.raises(DataError, match="holds image shards.*reads image_caption.*--modality image_caption"):
        build_datamodule(load_recipe(recipe)).setup()
    assert main(["train", str(recipe)]) == 2  # the CLI says so in one line
    captions = workdir / "caption-shards"
    _shard(image_captions, captions, "image_caption")
    packed = _recipe(
        workdir, "prefix_lm", f"{{kind: shards, root: {captions}, max_len: 16, pack: true}}", tokenizer_file
    )
    with pytest.raises(RecipeError, match="'tasks.pairs.data.pack' packs text shards"):
        build_datamodule(load_recipe(packed)).setup()
    lm = workdir / "lm.yaml"
    lm.write_text(
        f"""\
name: lm
model:
  tokenizers: {{text: {{kind: bpe, path: {tokenizer_file}}}}}
  backbone: {{preset: debug, causal: true}}
  heads: {{lm: {{kind: lm}}}}
tasks:
  corpus: {{kind: causal_lm, tokenizer: text, head: lm, data: {{kind: shards, root: {captions}, seq_len: 16}}}}
trainer: {{max_steps: 1}}
"""
    )
    with pytest.raises(DataError, match="holds image_caption shards; a causal_lm task here reads text"):
        build_datamodule(load_recipe(lm)).setup()
