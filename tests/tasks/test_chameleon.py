"""The Chameleon-style task: the joint vocabulary, the sequences and their loss, constrained and cached
decoding, classifier-free guidance, the bad-input errors, and a tiny run through the CLI on a random
codec (``mmformer.models.chameleon``, ``mmformer.tasks.chameleon``)."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F
import yaml
from PIL import Image
from torch import nn

from mmformer.cli import main
from mmformer.models import MultimodalModel, build_backbone
from mmformer.models.backbone_config import AttentionConfig, PositionConfig
from mmformer.models.chameleon import (
    IMAGE,
    MARKER,
    TEXT,
    ChameleonLM,
    JointEmbedding,
    JointVocab,
    build_sequences,
    guide,
    next_token_targets,
)
from mmformer.models.heads import LMHead
from mmformer.tasks.chameleon import ChameleonTask
from mmformer.tokenizers.vq import VQVAE
from tests.tasks.lm_loss_parity import assert_same_loss_and_gradients, spy_chunked_loss

V_T, K = 20, 16  # text ids, codes
BOS, EOS, PAD = 0, 1, 2


def codec(seed: int = 0) -> VQVAE:
    torch.manual_seed(seed)
    return VQVAE(
        image_size=8, in_chans=1, channels=(8, 8), d_latent=8, codebook_size=K, code_dim=4
    )  # 2×2 codes


def tiny_model(context: int = 40, seed: int = 0) -> tuple[MultimodalModel, ChameleonLM]:
    vq = codec(seed)
    vocab = JointVocab(V_T, K, vq.grid)
    emb = JointEmbedding(vocab, vq, 32, context=context)
    backbone = build_backbone(32, 2, AttentionConfig(2), causal=True, positions=PositionConfig("rope"))
    head = LMHead(32, vocab.size)
    head.tie_to(emb.embed)
    return MultimodalModel({"tok": emb}, backbone, {"lm": head}).eval(), ChameleonLM("tok", "lm")


class FakeText:
    """What the task reads of the BPE: the special ids and ``decode`` / ``pad_batch``."""

    bos_id, eos_id, pad_id = BOS, EOS, PAD

    def decode(self, ids, skip_special=False):
        return " ".join(map(str, ids))


def task(model, **kw) -> ChameleonTask:
    emb = model.tokenizers["tok"]
    return ChameleonTask(ChameleonLM("tok", "lm"), FakeText(), emb.vocab.image_tokens, emb.context, **kw)


def batch(captions: list[list[int]], seed: int = 0) -> dict:
    """``image_caption`` batch: uint8 images and ``bos … eos`` captions right-padded with ``PAD``."""
    g = torch.Generator().manual_seed(seed)
    rows = [[BOS, *c, EOS] for c in captions]
    n = max(map(len, rows))
    ids = torch.tensor([r + [PAD] * (n - len(r)) for r in rows])
    return {
        "image": torch.randint(0, 256, (len(rows), 1, 8, 8), generator=g, dtype=torch.uint8),
        "caption": ids,
        "caption_valid": ids != PAD,
    }


# ---------------------------------------------------------------------------------------------- vocabulary
def test_vocabulary_offsets_round_trip_and_never_collide():
    vocab = JointVocab(V_T, K, (4, 4))
    codes = torch.arange(K)
    ids = vocab.code_ids(codes)
    assert ids.tolist() == list(range(V_T, V_T + K))  # right after the text ids
    assert torch.equal(vocab.codes(ids), codes)
    assert (vocab.boi_id, vocab.eoi_id, vocab.size, vocab.image_tokens) == (
        V_T + K,
        V_T + K + 1,
        V_T + K + 2,
        16,
    )
    every = torch.arange(vocab.size)
    part = vocab.part(every)
    assert (part == TEXT).sum() == V_T and (part == IMAGE).sum() == K and (part == MARKER).sum() == 2
    assert set(ids.tolist()).isdisjoint(range(V_T))  # no code id is a text id
    with pytest.raises(ValueError, match=r"image codes must lie in \[0, 16\), got \[0, 16\]"):
        vocab.code_ids(torch.tensor([0, 16]))
    with pytest.raises(ValueError, match=r"outside the image-code range \[20, 36\)"):
        vocab.codes(torch.tensor([5]))  # a text id is not an image code


def test_sequences_in_both_orders_with_the_caption_dropped_and_padding():
    vocab = JointVocab(V_T, K, (1, 2))
    codes = torch.tensor([[3, 4], [5, 6], [7, 8]])
    c = lambda *x: [V_T + v for v in x]  # noqa: E731
    boi, eoi = vocab.boi_id, vocab.eoi_id
    seq = build_sequences(
        vocab, [[10, 11], [12], [13]], codes, torch.tensor([False, True, False]),
        torch.tensor([False, True, True]), BOS, EOS, context=20,
    )  # fmt: skip
    rows = [r[v].tolist() for r, v in zip(seq.ids, seq.valid)]
    assert rows == [
        [BOS, 10, 11, boi, *c(3, 4), eoi, EOS],  # caption → image
        [BOS, boi, *c(5, 6), eoi, 12, EOS],  # image → caption (drop applies to caption-first rows only)
        [BOS, boi, *c(7, 8), eoi],  # caption dropped: the unconditional image
    ]
    assert seq.valid.sum(1).tolist() == [8, 7, 5] and seq.ids.shape == (3, 8)
    targets = next_token_targets(seq.ids, seq.valid)
    assert (targets[2, 4:] == -100).all() and (targets[0] != -100).all()


# ---------------------------------------------------------------------------------------------- the loss
def test_loss_covers_text_and_image_tokens_and_ignores_padding(monkeypatch):
    model, lm = tiny_model()
    model.heads["lm"].chunk_rows = 7  # the loss a few rows at a time, the last chunk short
    t = task(model, image_first_prob=0.0, caption_dropout=0.0)  # every row caption → image
    b = batch([[5, 6, 7], [8], [9, 10]])
    calls = spy_chunked_loss(monkeypatch)
    loss = t.training_loss(model, b)
    assert calls  # the chunked path ran
    # reference: every row alone, unpadded, every next token counted (token-weighted mean)
    emb, total, n = model.tokenizers["tok"], 0.0, 0
    codes = emb.encode_images(b["image"])
    for i, text in enumerate([[5, 6, 7], [8], [9, 10]]):
        row = torch.tensor(
            [[BOS, *text, emb.vocab.boi_id, *emb.vocab.code_ids(codes[i]).tolist(), emb.vocab.eoi_id, EOS]]
        )
        logits = model(row, "tok", "lm")[0, :-1]
        total = total + F.cross_entropy(logits, row[0, 1:], reduction="sum")
        n += row.shape[1] - 1
    # the same value and gradients (the tied embedding's included) as the logits' cross-entropy
    assert_same_loss_and_gradients(model, loss, total / n)
    assert t.loss_units(b) == n  # what the accumulation windows weight the batch by
    # the loss reaches the caption, the markers and the codes: each part's logits get a gradient
    seq = build_sequences(
        emb.vocab, [[5, 6, 7]], codes[:1], torch.tensor([False]), torch.tensor([False]), BOS, EOS, emb.context
    )
    logits = lm.logits(model, seq.ids, seq.valid).detach().requires_grad_()
    F.cross_entropy(logits[0, :-1], next_token_targets(seq.ids, seq.valid)[0]).backward()
    parts = emb.vocab.part(seq.ids[0, 1:])
    assert all(logits.grad[0, :-1][parts == p].abs().sum() > 0 for p in (TEXT, IMAGE, MARKER))


def test_validation_reports_text_and_image_parts_with_and_without_the_caption():
    model, _ = tiny_model()
    t = task(model)
    t.validation_update(model, batch([[5, 6], [7]]))
    values = {k: float(m.compute()) for k, m in t.val_metrics.items()}
    for name in ("loss", "text_loss", "image_loss", "image_loss_uncond"):
        assert 0 < values[name] < 10, (name, values)
    assert values["image_loss"] != values["image_loss_uncond"]  # the caption is in the context
    assert values["truncated_captions"] == 0
    assert values["ppl"] == pytest.approx(torch.tensor(values["loss"]).exp().item(), rel=1e-5)


# ---------------------------------------------------------------------------------------------- decoding
class Favour(nn.Module):
    """An LM head that adds ``bias`` to the logits: steers an untrained model toward the ids a test
    wants it to try (a code in text, ``<eoi>`` inside an image, ``<boi>`` everywhere)."""

    def __init__(self, head, bias):
        super().__init__()
        self.head, self.bias = head, bias

    def forward(self, hidden, tokens):
        return self.head(hidden, tokens) + self.bias


def _check_well_formed(ids: list[int], vocab: JointVocab) -> int:
    """Every image in ``ids`` is ``<boi>``, exactly ``C`` codes, ``<eoi>``; no code outside one. Returns
    the number of images."""
    i, images = 0, 0
    while i < len(ids):
        if ids[i] == vocab.boi_id:
            body = ids[i + 1 : i + 1 + vocab.image_tokens]
            assert len(body) == vocab.image_tokens and all(V_T <= t < V_T + K for t in body), ids
            assert ids[i + 1 + vocab.image_tokens] == vocab.eoi_id, ids
            i, images = i + vocab.image_tokens + 2, images + 1
        else:
            assert ids[i] < V_T, ids  # text (no code, no stray <eoi>)
            i += 1
    return images


def test_constrained_decoding_emits_exactly_hw_codes_inside_an_image_and_text_outside():
    model, lm = tiny_model(context=24)
    vocab = model.tokenizers["tok"].vocab
    C = vocab.image_tokens
    bias = torch.zeros(vocab.size)
    bias[[V_T + 3, vocab.eoi_id, vocab.boi_id, EOS]] = torch.tensor([30.0, 40.0, 20.0, -50.0])
    model.heads["lm"] = Favour(model.heads["lm"], bias)
    out = lm.decode(model, [[BOS, 5], [BOS]], max_new_tokens=100, eos_id=EOS, banned=(BOS, PAD))
    for ids, prompt in zip(out, ([BOS, 5], [BOS])):
        # <boi> is favoured in text, so images follow each other while one still fits in the context
        assert _check_well_formed(ids, vocab) == (24 - len(prompt)) // (C + 2)
        assert len(ids) == 24 - 2  # the longer prompt's room: the shorter row stops with it
    # a prompt ending inside an image owes the rest of its codes first
    prompt = [BOS, vocab.boi_id, V_T + 1]
    (ids,) = lm.decode(model, [prompt], max_new_tokens=10, eos_id=EOS, images=False)
    assert ids[: C - 1] == [V_T + 3] * (C - 1)
    assert ids[C - 1] == vocab.eoi_id and all(t < V_T for t in ids[C:])
    # sampled (temperature 1, no bias): every sequence is still well formed
    model.heads["lm"].bias = torch.zeros(vocab.size)
    model.heads["lm"].bias[vocab.boi_id] = 3.0
    g = torch.Generator().manual_seed(0)
    for ids in lm.decode(model, [[BOS]] * 6, 50, EOS, banned=(BOS, PAD), temperature=1.0, generator=g):
        _check_well_formed(ids, vocab)


def _last_logits(model, lm, ids: list[int]):
    """The next-id logits ``(V,)`` after ``ids``, the whole sequence recomputed (no cache)."""
    return lm.logits(model, torch.tensor([ids]), torch.ones(1, len(ids), dtype=torch.bool))[0, -1]


def _recomputed_greedy(model, lm, prompt: list[int], steps: int, vocab) -> list[int]:
    """Greedy decoding with the whole sequence recomputed at every step (no cache), the same rules."""
    ids = list(prompt)
    for _ in range(steps):
        logits = _last_logits(model, lm, ids)
        opened = max((i for i, t in enumerate(ids) if t == vocab.boi_id), default=-1)
        inside = opened >= 0 and vocab.eoi_id not in ids[opened:]
        allowed = torch.zeros(vocab.size, dtype=torch.bool)
        if inside and len(ids) - opened - 1 < vocab.image_tokens:
            allowed[vocab.code_range()] = True
        elif inside:
            allowed[vocab.eoi_id] = True
        else:
            allowed[:V_T] = True
            allowed[vocab.boi_id] = True
        ids.append(int(logits.masked_fill(~allowed, float("-inf")).argmax()))
    return ids[len(prompt) :]


def test_cached_decoding_equals_recomputation():
    model, lm = tiny_model(context=60, seed=1)
    vocab = model.tokenizers["tok"].vocab
    bias = torch.zeros(vocab.size)
    bias[vocab.boi_id] = 4.0  # so the greedy path opens an image
    model.heads["lm"] = Favour(model.heads["lm"], bias)
    prompts = [[BOS, 5, 6, 7], [BOS, 9]]  # different lengths: left padding in the cached batch
    out = lm.decode(model, prompts, max_new_tokens=16, eos_id=None)
    for prompt, ids in zip(prompts, out):
        assert vocab.boi_id in ids
        assert ids == _recomputed_greedy(model, lm, prompt, 16, vocab)


def test_guidance_scale_one_is_the_conditional_logits_and_guided_codes_match_recomputation():
    cond, uncond = torch.randn(3, K), torch.randn(3, K)
    torch.testing.assert_close(guide(cond, uncond, 1.0), cond)
    torch.testing.assert_close(guide(cond, uncond, 0.0), uncond)
    torch.testing.assert_close(guide(cond, uncond, 3.0), 3 * cond - 2 * uncond)
    model, lm = tiny_model(seed=2)
    vocab = model.tokenizers["tok"].vocab
    prompts = [[BOS, 5, 6], [BOS, 7]]
    for scale in (1.0, 3.0):
        codes = lm.sample_codes(model, prompts, BOS, cfg_scale=scale, temperature=0.0)
        for prompt, row in zip(prompts, codes):  # the guided argmax, with every step recomputed
            c_ids, u_ids = [*prompt, vocab.boi_id], [BOS, vocab.boi_id]
            for code in row.tolist():
                c, u = (
                    _last_logits(model, lm, c_ids)[vocab.code_range()],
                    _last_logits(model, lm, u_ids)[vocab.code_range()],
                )
                assert code == int(guide(c, u, scale).argmax())
                c_ids, u_ids = c_ids + [V_T + code], u_ids + [V_T + code]


def test_sample_and_caption_follow_the_sampling_protocol():
    model, _ = tiny_model()
    t = task(model, sample_cfg_scale=2.0)
    captions = batch([[5, 6], [7]])["caption"]
    images = t.sample(model, None, captions=captions, generator=torch.Generator().manual_seed(0))
    assert images.shape == (2, 1, 8, 8) and images.min() >= -1 and images.max() <= 1
    again = t.sample(model, None, captions=captions, generator=torch.Generator().manual_seed(0))
    assert torch.equal(images, again)  # the generator decides the draw
    assert t.sample(model, None, n=3, sampler="greedy").shape == (3, 1, 8, 8)  # unconditional
    with pytest.raises(ValueError, match="choose sample, greedy"):
        t.sample(model, None, captions=captions, sampler="ddim")
    with pytest.raises(ValueError, match="needs captions"):
        t.sample(model, None, n=2, cfg_scale=4.0)
    texts = t.caption(model, images, max_new_tokens=5)
    assert len(texts) == 2 and all(
        len(s) <= 5 and all(i < V_T and i not in (BOS, PAD) for i in s) for s in texts
    )


# ---------------------------------------------------------------------------------------------- bad input
def test_an_image_with_no_room_in_the_context_is_refused_with_the_sizes():
    model, lm = tiny_model(context=12)  # 4 codes + <boi> <eoi> + bos eos = 8 tokens: 4 for text
    vocab = model.tokenizers["tok"].vocab
    with pytest.raises(ValueError, match="8 tokens, but the context holds 6"):
        build_sequences(vocab, [[5]], torch.zeros(1, 4, dtype=torch.long), torch.tensor([False]),
                        torch.tensor([False]), BOS, EOS, context=6)  # fmt: skip
    with pytest.raises(
        ValueError, match="the prompt holds 8 tokens and the image needs 6 more .* context holds 12"
    ):
        lm.sample_codes(model, [[BOS, *range(3, 10)]], BOS)
    opened = [BOS, *range(3, 10), vocab.boi_id]  # an open image that cannot be finished
    with pytest.raises(ValueError, match="the prompt holds 9 tokens and the image needs 5 more"):
        lm.decode(model, [opened], 10, EOS)


def test_a_caption_longer_than_the_context_is_cut_and_counted():
    model, _ = tiny_model(context=12)  # room for 4 caption tokens
    vocab = model.tokenizers["tok"].vocab
    codes = torch.zeros(2, 4, dtype=torch.long)
    seq = build_sequences(vocab, [list(range(3, 10)), [5]], codes, torch.tensor([True, False]),
                          torch.tensor([False, False]), BOS, EOS, context=12)  # fmt: skip
    assert (seq.truncated_captions, seq.truncated_tokens) == (1, 3)
    assert seq.valid.sum(1).tolist() == [12, 9]  # both pairs kept, the long one filling the context
    assert seq.ids[0, -5:].tolist() == [3, 4, 5, 6, EOS]  # image first: the caption's first 4 tokens
    t = task(model, image_first_prob=0.0, caption_dropout=0.0)
    with pytest.warns(
        UserWarning, match=r"1 caption\(s\) .* longer than the 4 tokens .* \(3 tokens dropped\)"
    ):
        t.training_loss(model, batch([list(range(3, 10)), [5]]))
    assert t.truncated == [1, 3]
    t.validation_update(model, batch([list(range(3, 10)), [5]]))
    assert float(t.val_metrics["truncated_captions"].compute()) == 1


# ---------------------------------------------------------------------------------------------- the CLI
RECIPE = """\
name: tinychameleon
model:
  tokenizers:
    tok: {{kind: chameleon, checkpoint: {vq}, image_size: 8, in_chans: 1, codebook_size: {K}, context: 32,
          vocab_size: 300}}
  backbone: {{d_model: 32, n_layers: 2, n_heads: 2, causal: true, positions: rope}}
  heads: {{lm: {{kind: lm}}}}
tasks:
  pairs:
    kind: chameleon
    tokenizer: tok
    head: lm
    samples_per_caption: 2
    sample_captions: 3
    max_new_tokens: 4
    data: {{kind: image_caption, root: {root}, batch_size: 4, num_workers: 0, max_len: 8}}
optim: {{lr: 1e-3, warmup_steps: 1}}
trainer: {{max_steps: 2, accelerator: cpu, devices: 1, log_every_n_steps: 1, enable_progress_bar: false,
          num_sanity_val_steps: 0}}
logger: {{mode: disabled}}
"""


def _codec_checkpoint(path, vq: VQVAE) -> None:
    """A checkpoint as a ``vq`` run writes it (what ``load_vq`` reads): its recipe and the codec's weights."""
    recipe = {
        "model": {"tokenizers": {"img": {"kind": "vq", **vq.config}}},
        "tasks": {"rec": {"kind": "vq", "tokenizer": "img"}},
    }
    state = {f"model.tokenizers.img.vq.{k}": v for k, v in vq.state_dict().items()}
    torch.save({"mmformer": {"recipe_yaml": yaml.safe_dump(recipe)}, "state_dict": state}, path)


def _caption_folder(root):
    root.mkdir()
    names = ["zero", "one", "two", "three"]
    for split, n in (("train", 8), ("val", 4)):
        rows = []
        for i in range(n):
            Image.fromarray((torch.rand(8, 8) * 255).byte().numpy()).save(root / f"{split}{i}.png")
            rows.append({"image": f"{split}{i}.png", "caption": f"the digit {names[i % 4]}"})
        (root / f"{split}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return root


@pytest.mark.slow
def test_trains_writes_grids_and_tables_and_samples_from_the_checkpoint(workdir, capsys):
    _codec_checkpoint(workdir / "vq.ckpt", codec())
    root = _caption_folder(workdir / "pairs")
    (workdir / "bad.yaml").write_text(RECIPE.format(vq=workdir / "vq.ckpt", K=32, root=root))
    assert main(["train", str(workdir / "bad.yaml")]) == 2  # another codebook than the recipe's
    assert "codebook_size=16 (asked: 32)" in capsys.readouterr().err
    (workdir / "c.yaml").write_text(RECIPE.format(vq=workdir / "vq.ckpt", K=K, root=root))
    assert main(["train", str(workdir / "c.yaml")]) == 0
    out = capsys.readouterr().out
    for metric in ("text_loss", "image_loss", "image_loss_uncond", "truncated_captions"):
        assert f"val/pairs/{metric}" in out
    run = next((workdir / "runs" / "tinychameleon").glob("*"))
    grid = sorted((run / "samples").glob("pairs-step*.png"))[-1]
    assert Image.open(grid).size == (2 * 9 + 1, 3 * 9 + 1)  # 2 per caption, 3 captions
    from mmformer.build.checkpoint import load_checkpoint

    loaded = load_checkpoint(run / "checkpoints" / "last.ckpt")
    module = loaded.module()
    t = module.tasks["pairs"]
    ids, valid = t.text.pad_batch([t.text.encode("the digit one", bos=True, eos=True)])
    images = t.sample(module.model, None, captions=(ids, valid), cfg_scale=2.0, generator=torch.Generator())
    assert images.shape == (1, 1, 8, 8)
    (text,) = t.caption(module.model, images, max_new_tokens=4)
    assert len(text) <= 4 and all(i < module.model.tokenizers["tok"].vocab.text_size for i in text)
