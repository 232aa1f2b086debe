"""Transfusion (``mmformer.models.transfusion``, ``mmformer.tasks.transfusion``): the mask of mixed
sequences, which positions each loss reads, packing, cached generation against recomputation, bad input."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from mmformer.models import MultimodalModel
from mmformer.models.backbone import build_backbone
from mmformer.models.backbone_config import AttentionConfig, PositionConfig
from mmformer.models.diffusion import GaussianDiffusion, RectifiedFlow, beta_schedule
from mmformer.models.heads import DiTFinalLayer, LMHead
from mmformer.models.transfusion import IGNORE, ImageSlot, Transfusion, build_layout, pack, pair_document
from mmformer.nn.kv_cache import KVCache
from mmformer.nn.masks import MaskSpec
from mmformer.tasks.transfusion import TransfusionTask
from mmformer.tokenizers.diffusion import DiTTokenizer
from mmformer.tokenizers.text import TextEmbedding
from tests.tasks.lm_loss_parity import assert_same_loss_and_gradients, spy_chunked_loss

V, D, P = 24, 32, 4  # vocabulary, width, patches per 8×8 image in 4×4 patches
BOS, EOS, PAD, BOI, EOI = 1, 2, 0, 3, 4


def tiny_model(seed: int = 0) -> MultimodalModel:
    torch.manual_seed(seed)
    model = MultimodalModel(
        {"image": DiTTokenizer(D, 8, 4, 1), "text": TextEmbedding(V, D)},
        build_backbone(
            D, 2, AttentionConfig(4, kernel="sdpa"), positions=PositionConfig("rope"), causal=True
        ),
        {"lm": LMHead(D, V), "noise": DiTFinalLayer(D, 4, (2, 2), 1)},
    )
    for p in model.heads["noise"].parameters():  # zero-initialised: random, so outputs depend on inputs
        nn.init.normal_(p, std=0.2)
    return model.eval()


def favour(model: MultimodalModel, token: int) -> None:
    """An LM head whose logit for ``token`` is raised by 50 everywhere (a bias the LM head lacks)."""
    old = model.heads["lm"].head
    new = nn.Linear(D, V)
    with torch.no_grad():
        new.weight.copy_(old.weight)
        new.bias.zero_()
        new.bias[token] = 50.0
    model.heads["lm"].head = new


def parts(context: int = 32) -> Transfusion:
    return Transfusion("image", "text", "lm", "noise", BOI, EOI, BOS, EOS, PAD, context)


def test_pair_documents_in_both_orders():
    cap = [BOS, 10, 11, EOS]
    first, cut = pair_document(cap, 0, True, BOI, EOI, P, 32)
    assert first == [BOS, 10, 11, BOI, ImageSlot(0), EOI, EOS] and cut == 0
    second, _ = pair_document(cap, 5, False, BOI, EOI, P, 32)
    assert second == [BOS, BOI, ImageSlot(5), EOI, 10, 11, EOS]


def test_layout_targets_only_text_after_text():
    layout = build_layout([[pair_document([BOS, 10, 11, EOS], 0, True, BOI, EOI, P, 32)[0]]], P, PAD)
    # bos 10 11 <boi> p p p p <eoi> eos
    assert layout.targets[0].tolist() == [10, 11, BOI, IGNORE, *[IGNORE] * P, EOS, IGNORE]
    assert layout.is_image[0].tolist() == [False] * 4 + [True] * P + [False] * 2
    assert layout.span[0].tolist() == [0] * 4 + [1] * P + [0] * 2
    assert layout.positions[0].tolist() == list(range(10))


def test_mask_causal_text_bidirectional_image_never_a_later_image():
    # one row: bos a <boi> img0 <eoi> b <boi> img1 <eoi> eos
    doc = [BOS, 10, BOI, ImageSlot(0), EOI, 11, BOI, ImageSlot(1), EOI, EOS]
    layout = build_layout([[doc]], P, PAD)
    mask = MaskSpec(causal=True, valid=layout.valid, document=layout.document, span=layout.span).dense(
        layout.ids.shape[1]
    )[0, 0]
    n = mask.shape[0]
    text = layout.is_text[0].nonzero().flatten().tolist()
    img0 = (layout.span[0] == 1).nonzero().flatten().tolist()
    img1 = (layout.span[0] == 2).nonzero().flatten().tolist()
    for i in text:  # text tokens never attend to later positions, and see everything before
        assert not mask[i, i + 1 :].any() and mask[i, : i + 1].all()
    for img, other, later in ((img0, img1, True), (img1, img0, False)):
        for i in img:
            assert mask[i, img].all()  # the whole image, later patches included
            assert mask[i, : img[0]].all()  # the text (and earlier images) before it
            assert not mask[i, img[-1] + 1 :].any()  # nothing after the image
            assert mask[i, other].any() != later  # a later image never, an earlier one wholly
    assert n == len(text) + 2 * P


def test_losses_read_only_their_positions():
    """Changing a patch moves no text logit before it and no LM target; changing a text id after the
    image moves no image prediction (the image sees only what precedes it), and targets never point at
    patches."""
    model, tf = tiny_model(), parts()
    doc = pair_document([BOS, 10, 11, EOS], 0, True, BOI, EOI, P, 32)[0]
    layout = build_layout([[doc]], P, PAD)
    x = torch.randn(1, 1, 8, 8)
    t = torch.tensor([300.0])
    _, logits, pred = tf.forward(model, layout, x, t)
    _, logits2, _ = tf.forward(model, layout, x + torch.randn_like(x), t)
    before = slice(0, 4)  # bos 10 11 <boi>: the LM targets 10, 11, <boi> are read here
    torch.testing.assert_close(logits[:, before], logits2[:, before])
    assert (layout.targets[layout.is_image] == IGNORE).all()
    assert set(layout.targets[layout.targets != IGNORE].tolist()) == {10, 11, BOI, EOS}
    later = build_layout([[[BOS, 10, 11, BOI, ImageSlot(0), EOI, 7]]], P, PAD)
    _, _, pred2 = tf.forward(model, later, x, t)
    torch.testing.assert_close(pred, pred2)
    # the diffusion loss reads the image predictions only: a different caption token after the image
    # changes the LM loss, not the prediction


def test_packed_equals_one_at_a_time():
    model, tf = tiny_model(), parts(context=64)
    caps = [[BOS, 10, 11, EOS], [BOS, 12, EOS], [BOS, 13, 14, 15, EOS]]
    docs = [pair_document(c, m, m != 1, BOI, EOI, P, 32)[0] for m, c in enumerate(caps)]
    rows = pack(docs, P, 64)
    assert len(rows) == 1 and len(rows[0]) == 3  # all three in one row
    x, t = torch.randn(3, 1, 8, 8), torch.tensor([100.0, 500.0, 900.0])
    packed = build_layout(rows, P, PAD)
    _, logits, pred = tf.forward(model, packed, x, t)
    for m, doc in enumerate(docs):
        alone = build_layout([[[ImageSlot(0) if isinstance(i, ImageSlot) else i for i in doc]]], P, PAD)
        _, lg, pr = tf.forward(model, alone, x[m : m + 1], t[m : m + 1])
        sel = packed.document[0] == m
        torch.testing.assert_close(logits[0, sel], lg[0], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(pred[m], pr[0], atol=1e-5, rtol=1e-5)


def test_eager_equals_sdpa_on_packed_rows():
    model, tf = tiny_model(), parts(context=64)
    docs = [pair_document([BOS, 10 + m, EOS], m, m % 2 == 0, BOI, EOI, P, 32)[0] for m in range(3)]
    layout = build_layout([[docs[0], docs[1]], [docs[2]]], P, PAD)  # right padding on the second row
    x, t = torch.randn(3, 1, 8, 8), torch.tensor([10.0, 20.0, 30.0])
    _, a, pa = tf.forward(model, layout, x, t)
    model.backbone.set_attn_kernel("eager")
    _, b, pb = tf.forward(model, layout, x, t)
    v = layout.valid
    torch.testing.assert_close(a[v], b[v], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(pa, pb, atol=1e-5, rtol=1e-5)


def test_cached_text_generation_equals_recomputation():
    model, tf = tiny_model(), parts(context=40)
    img = torch.randn(2, 1, 8, 8)
    prompts = [[BOS, BOI, ImageSlot(0), EOI], [BOS, 9, BOI, ImageSlot(1), EOI]]  # left padding on row 0
    cached = tf.continue_text(model, prompts, img, 6, stop_at_boi=False)
    recomputed = tf.continue_text(model, prompts, img, 6, stop_at_boi=False, use_cache=False)
    assert cached == recomputed and all(len(c) > 0 for c in cached)
    # and the full teacher-forced forward over prompt + generated text gives the same argmaxes
    doc = [BOS, 9, BOI, ImageSlot(0), EOI] + cached[1]
    layout = build_layout([[doc]], P, PAD)
    _, logits, _ = tf.forward(model, layout, img[1:], torch.zeros(1))
    n = len(cached[1])
    assert logits[0, -n - 1 : -1].argmax(-1).tolist() == cached[1]


@pytest.mark.parametrize("objective", ["flow", "gaussian"])
def test_image_after_cached_prefix_equals_recomputed(objective):
    model, tf = tiny_model(), parts(context=40)
    if objective == "flow":
        process, sampler = RectifiedFlow(), "euler"
    else:
        process, sampler = GaussianDiffusion(beta_schedule("cosine", 100)), "ddim"
    caps = [[BOS, 10, 11, EOS], [BOS, 12, EOS]]
    out = {}
    for cache in (True, False):
        g = torch.Generator().manual_seed(0)
        out[cache] = tf.sample_images(model, caps, process, sampler, 4, 2.0, g, use_cache=cache)
    assert out[True].shape == (2, 1, 8, 8)
    torch.testing.assert_close(out[True], out[False], atol=1e-5, rtol=1e-5)
    assert not torch.allclose(out[True][0], out[True][1])  # the caption matters


def test_interleaved_generation_text_image_text():
    model, tf = tiny_model(), parts(context=40)
    favour(model, BOI)  # <boi> first after the prompt; after the image <boi> is not drawn again
    segments = tf.generate(model, [BOS, 10], RectifiedFlow(), "euler", 2, 5, generator=torch.Generator())
    assert segments[0][-1] == BOI and torch.is_tensor(segments[1]) and segments[1].shape == (1, 8, 8)
    assert all(i != BOI for i in segments[2]) if len(segments) > 2 else True  # at most one image


def test_boi_without_room_is_refused_with_sizes():
    model, tf = tiny_model(), parts(context=8)
    with pytest.raises(ValueError, match=r"<boi> at token 6 of a 8-token context.*4 patches.*2 are left"):
        tf.generate(model, [BOS, 10, 11, 12, 13, BOI], RectifiedFlow(), "euler", 2, 4)
    with pytest.raises(ValueError, match="needs 8 tokens.*context is 7"):
        pair_document([BOS, 10, EOS], 0, True, BOI, EOI, P, 7)


def test_decoding_never_emits_boi_without_room():
    model, tf = tiny_model(), parts(context=10)
    favour(model, BOI)  # <boi> would win everywhere
    out = tf.continue_text(model, [[BOS, 10, 11, 12, 13]], None, 3)
    assert BOI not in out[0]  # 5 used + 4 patches + <eoi> does not fit in 10 after a <boi>


def test_long_caption_is_cut_and_counted():
    doc, cut = pair_document([BOS, *range(5, 20), EOS], 0, True, BOI, EOI, P, 12)
    assert cut == 11 and len(doc) == 12 - P + 1 and doc[-1] == EOS  # 4 caption tokens kept
    task = _task(context=12)
    batch = {
        "image": torch.zeros(2, 1, 8, 8, dtype=torch.uint8),
        "caption": torch.tensor([[BOS, *range(5, 20), EOS], [BOS, 5, EOS] + [PAD] * 14]),
    }
    batch["caption_valid"] = batch["caption"] != PAD
    batch["caption_valid"][0] = True
    with pytest.warns(UserWarning, match=r"1 caption\(s\) of this batch cut .* \(1 so far\)"):
        loss = task.training_loss(tiny_model(), batch)
    assert torch.isfinite(loss) and task.captions_cut == 1


def _task(context: int = 32, **kw) -> TransfusionTask:
    class Text:
        def decode(self, ids, skip_special=False):
            return " ".join(map(str, ids))

    return TransfusionTask(parts(context), RectifiedFlow(), Text(), **kw)


def test_training_loss_is_lm_plus_lambda_image(monkeypatch):
    """With every pair caption first and no dropout, the loss is the LM cross-entropy over the text
    targets plus λ times the mean per-image flow loss, recomputed here from the model's outputs."""
    model = tiny_model()
    model.heads["lm"].chunk_rows = 5  # the text loss a few rows at a time, the last chunk short
    task = _task(caption_first=1.0 - 1e-9, caption_dropout=0.0, image_weight=5.0)
    batch = {
        "image": torch.randint(0, 255, (2, 1, 8, 8), dtype=torch.uint8),
        "caption": torch.tensor([[BOS, 10, 11, EOS], [BOS, 12, EOS, PAD]]),
    }
    batch["caption_valid"] = batch["caption"] != PAD
    torch.manual_seed(3)
    calls = spy_chunked_loss(monkeypatch)
    loss = task.training_loss(model, batch)
    assert calls  # the chunked path ran
    torch.manual_seed(3)
    torch.rand(2), torch.rand(2)  # the order and dropout draws
    x0 = batch["image"].float() / 127.5 - 1
    noise, t = torch.randn(x0.shape), torch.rand(2)
    tf = task.parts
    docs = [
        pair_document(c, m, True, BOI, EOI, P, 32)[0]
        for m, c in enumerate([[BOS, 10, 11, EOS], [BOS, 12, EOS]])
    ]
    layout = build_layout([[d] for d in docs], P, PAD)
    _, logits, pred = tf.forward(
        model, layout, (1 - t.view(-1, 1, 1, 1)) * x0 + t.view(-1, 1, 1, 1) * noise, t * 1000
    )
    lm = F.cross_entropy(logits.flatten(0, 1), layout.targets.flatten(), ignore_index=IGNORE)
    image = ((pred - (noise - x0)) ** 2).flatten(1).mean(1).mean()
    assert_same_loss_and_gradients(model, loss, lm + 5.0 * image)


def test_image_first_noise_is_capped():
    task = _task(image_first_max_t=0.5)
    task.process = GaussianDiffusion(beta_schedule("cosine", 1000))
    _, t = task._draw(torch.zeros(2000, 1, 2, 2), torch.full((2000,), 0.5), torch.Generator().manual_seed(0))
    assert t.max() < 500 and t.min() >= 0 and t.float().mean() > 200


def test_sample_and_caption_protocol():
    model, task = tiny_model(), _task(context=40)
    ids = torch.tensor([[BOS, 10, EOS, PAD], [BOS, 11, 12, EOS]])
    images = task.sample(model, None, cfg_scale=1.0, steps=2, captions=ids, generator=torch.Generator())
    assert images.shape == (2, 1, 8, 8) and images.abs().max() <= 1
    with pytest.raises(ValueError, match="conditioned on text"):
        task.sample(model, torch.tensor([1, 2]), steps=2)
    texts = task.caption(model, images, max_new_tokens=3)
    assert len(texts) == 2 and all(len(t) <= 3 and BOI not in t for t in texts)


def test_kv_cache_truncate():
    cache = KVCache()
    k = torch.randn(1, 2, 5, 4)
    cache.update(0, k, k)
    cache.extend(
        torch.ones(1, 5, dtype=torch.bool),
        torch.zeros(1, 5, dtype=torch.long),
        torch.zeros(1, 5, 1, dtype=torch.long),
    )
    cache.truncate(3)
    assert cache.length == 3 and cache.keys[0].shape[2] == 3
    keys, _ = cache.update(0, k[:, :, :1] * 0, k[:, :, :1] * 0)
    assert keys.shape[2] == 4 and keys[:, :, 3].abs().sum() == 0
    with pytest.raises(ValueError, match="cannot truncate a cache of 3"):
        cache.truncate(4)


@pytest.mark.slow
def test_flex_block_mask_equals_dense_on_packed_rows():
    """The flex path (a ``BlockMask`` from the same rules; forward only on CPU) gives what sdpa's dense
    mask gives on packed, padded rows."""
    model, tf = tiny_model(), parts(context=64)
    docs = [pair_document([BOS, 10 + m, EOS], m, m % 2 == 0, BOI, EOI, P, 32)[0] for m in range(3)]
    layout = build_layout([[docs[0], docs[1]], [docs[2]]], P, PAD)
    x, t = torch.randn(3, 1, 8, 8), torch.tensor([10.0, 20.0, 30.0])
    with torch.no_grad():
        _, a, pa = tf.forward(model, layout, x, t)
        model.backbone.set_attn_kernel("flex")
        _, b, pb = tf.forward(model, layout, x, t)
    v = layout.valid
    torch.testing.assert_close(a[v], b[v], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(pa, pb, atol=1e-4, rtol=1e-4)
