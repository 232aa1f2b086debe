"""Contrastive learning (CLIP / SigLIP): the losses against their closed forms, the distributed losses on
two CPU processes against one process on the whole batch, the whole-set metrics on hand-checked cases,
per-modality towers, and padding invariance of the caption embeddings."""

from __future__ import annotations

import math

import pytest
import torch
import torch.multiprocessing as mp
import torch.nn.functional as F

from mmformer.models import AttentionConfig, MultimodalModel, ProjectionHead, build_backbone
from mmformer.tasks.contrastive import ContrastiveTask, retrieval_recall, zero_shot_accuracy
from mmformer.tasks.contrastive_loss import clip_loss, siglip_loss
from mmformer.tokenizers import ViTPatchTokenizer
from mmformer.tokenizers.text import TextEmbedding


def _pairs(n: int, e: int = 8, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return F.normalize(torch.randn(n, e, generator=g), dim=-1), F.normalize(
        torch.randn(n, e, generator=g), dim=-1
    )


def test_clip_loss_equals_the_closed_form():
    a, b = _pairs(5)
    scale = torch.tensor(math.log(1 / 0.07))
    s = (a @ b.T) / 0.07
    by_row = [-(s[i, i] - torch.logsumexp(s[i], 0)) for i in range(5)]
    by_col = [-(s[i, i] - torch.logsumexp(s[:, i], 0)) for i in range(5)]
    expected = 0.5 * (sum(by_row) / 5 + sum(by_col) / 5)
    assert clip_loss(a, b, scale).item() == pytest.approx(expected.item(), rel=1e-5)
    # the temperature is clipped at 1/100, as CLIP's
    assert clip_loss(a, b, torch.tensor(10.0)).item() == pytest.approx(
        clip_loss(a, b, torch.tensor(math.log(100.0))).item()
    )


def test_siglip_loss_equals_the_closed_form():
    a, b = _pairs(4)
    t, bias = torch.tensor(math.log(10.0)), torch.tensor(-10.0)
    total = 0.0
    for i in range(4):
        for j in range(4):
            z = 1.0 if i == j else -1.0
            total += -math.log(1 / (1 + math.exp(-z * (10.0 * float(a[i] @ b[j]) - 10.0))))
    assert siglip_loss(a, b, t, bias).item() == pytest.approx(total / 4, rel=1e-5)


def test_pairs_sharing_a_caption_are_neither_positive_nor_negative():
    a, b = _pairs(4)
    ids = torch.tensor([0, 1, 1, 2])  # pairs 1 and 2: two recordings of one transcript
    s = (a @ b.T) / 0.07
    keep = ~((ids[:, None] == ids[None, :]) & ~torch.eye(4, dtype=torch.bool))
    by_row = [-(s[i, i] - torch.logsumexp(s[i][keep[i]], 0)) for i in range(4)]
    by_col = [-(s[i, i] - torch.logsumexp(s[:, i][keep[:, i]], 0)) for i in range(4)]
    expected = 0.5 * (sum(by_row) + sum(by_col)) / 4
    got = clip_loss(a, b, torch.tensor(math.log(1 / 0.07)), ids=ids)
    assert got.item() == pytest.approx(expected.item(), rel=1e-5)
    t, bias = torch.tensor(math.log(10.0)), torch.tensor(-10.0)
    z = 2 * torch.eye(4) - 1
    terms = -F.logsigmoid(z * (10.0 * a @ b.T - 10.0))
    expected = (terms * keep).sum() / 4
    assert siglip_loss(a, b, t, bias, ids=ids).item() == pytest.approx(expected.item(), rel=1e-5)


# ---------------------------------------------------------------------------- two processes
B, W, IN, E = 3, 2, 6, 4


def _encoders(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    enc_a = torch.nn.Linear(IN, E)
    enc_b = torch.nn.Linear(IN, E)
    for p in [*enc_a.parameters(), *enc_b.parameters()]:
        p.data = torch.randn(p.shape, generator=g)
    scale = torch.nn.Parameter(torch.tensor(math.log(1 / 0.07)))
    bias = torch.nn.Parameter(torch.tensor(-1.0))
    return enc_a, enc_b, scale, bias


IDS = torch.tensor([0, 1, 2, 0, 4, 1])  # caption ids: rows 0 and 3, 1 and 5 share a caption, across ranks


def _step(x, y, kind, ids=None):
    """Loss and gradients of every parameter for inputs ``x``, ``y`` (N, IN)."""
    enc_a, enc_b, scale, bias = _encoders()
    a, b = F.normalize(enc_a(x), dim=-1), F.normalize(enc_b(y), dim=-1)
    if kind == "clip":
        loss = clip_loss(a, b, scale, ids=ids)
    else:
        loss = siglip_loss(a, b, scale, bias, ids=ids)
    loss.backward()
    params = [*enc_a.parameters(), *enc_b.parameters(), scale] + ([bias] if kind == "siglip" else [])
    return loss.detach(), [p.grad.clone() for p in params]


def _data():
    g = torch.Generator().manual_seed(1)
    return torch.randn(W * B, IN, generator=g), torch.randn(W * B, IN, generator=g)


def _worker(rank: int, init_file: str, out: str) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=W)
    x, y = _data()
    rows = slice(rank * B, (rank + 1) * B)
    result = {}
    for kind in ("clip", "siglip"):
        for ids in (None, IDS[rows]):
            loss, grads = _step(x[rows], y[rows], kind, ids)
            dist.all_reduce(loss)  # the mean over ranks, as logged with sync_dist
            for g in grads:  # DDP averages gradients over ranks
                dist.all_reduce(g)
            result[kind, ids is not None] = (loss / W, [g / W for g in grads])
    try:  # unequal batches: every rank raises, none hangs
        clip_loss(*_pairs(B + rank), torch.tensor(1.0))
        result["unequal"] = None
    except ValueError as e:
        result["unequal"] = str(e)
    torch.save(result, f"{out}.{rank}")
    dist.destroy_process_group()


@pytest.mark.slow
def test_two_processes_equal_one_process_on_the_whole_batch(tmp_path):
    mp.spawn(_worker, args=(str(tmp_path / "init"), str(tmp_path / "out")), nprocs=W, join=True)
    x, y = _data()
    for rank in range(W):
        result = torch.load(tmp_path / f"out.{rank}", weights_only=False)  # our own test file
        for kind, with_ids in [(k, i) for k in ("clip", "siglip") for i in (False, True)]:
            loss, grads = _step(x, y, kind, IDS if with_ids else None)
            dist_loss, dist_grads = result[kind, with_ids]
            assert dist_loss.item() == pytest.approx(loss.item(), rel=1e-5), kind
            for g_dist, g_one in zip(dist_grads, grads, strict=True):
                torch.testing.assert_close(g_dist, g_one, rtol=1e-5, atol=1e-6)
        assert "same batch size" in result["unequal"]


def test_gathering_without_gradients_would_be_wrong():
    # The reason for gathering with gradients: scoring against other ranks' detached features gives a
    # different gradient, which the test above would catch.
    x, y = _data()
    enc_a, enc_b, scale, _ = _encoders()
    a, b = F.normalize(enc_a(x), dim=-1), F.normalize(enc_b(y), dim=-1)
    full = torch.autograd.grad(clip_loss(a, b, scale), enc_a.weight, retain_graph=True)[0]
    detached = []
    for r in range(W):
        rows = slice(r * B, (r + 1) * B)
        other_b = b.detach().clone()
        other_b[rows] = b[rows]
        other_a = a.detach().clone()
        other_a[rows] = a[rows]
        s = scale.exp()
        lab = torch.arange(B) + r * B
        loss = 0.5 * (
            F.cross_entropy(s * a[rows] @ other_b.T, lab) + F.cross_entropy(s * b[rows] @ other_a.T, lab)
        )
        detached.append(torch.autograd.grad(loss, enc_a.weight, retain_graph=True)[0])
    assert not torch.allclose(sum(detached) / W, full, atol=1e-4)


# ---------------------------------------------------------------------------- metrics
def test_retrieval_recall_on_a_hand_checked_case():
    a = torch.eye(3)
    b = F.normalize(torch.tensor([[1.0, 0.0, 0.0], [0.0, 0.2, 1.0], [0.0, 0.1, 1.0]]), dim=-1)
    # similarities a_i·b_j = b_j[i]: image 1 scores its caption 0.196 (> 0.0995), image 2 0.995 (> 0.981)
    r = retrieval_recall(a, b, ks=(1, 2))
    assert r["a2b_recall@1"] == pytest.approx(1.0)
    # caption 1 scores image 2 (0.981) above its own image 1 (0.196): rank 1; captions 0 and 2 rank 0
    assert r["b2a_recall@1"] == pytest.approx(2 / 3)
    assert r["b2a_recall@2"] == pytest.approx(1.0)


def test_zero_shot_accuracy_counts_only_labelled_items():
    classes = torch.eye(2)
    emb = torch.tensor([[1.0, 0.0], [0.9, 0.1], [0.0, 1.0], [1.0, 0.0]])
    labels = torch.tensor([0, 1, 1, -1])  # item 1 is misclassified, item 3 has no class
    r = zero_shot_accuracy(emb, classes, labels)
    assert r["zero_shot_acc"] == pytest.approx(2 / 3)
    assert r["zero_shot_balanced_acc"] == pytest.approx((1.0 + 0.5) / 2)


# ---------------------------------------------------------------------------- model and task
def _model(towers: bool = False) -> MultimodalModel:
    torch.manual_seed(0)
    image = ViTPatchTokenizer(32, 8, 4, 1, True, (0.5,), (0.25,))
    text_width = 16 if towers else 32
    text = TextEmbedding(50, text_width, 12)
    backbone = build_backbone(32, 2, AttentionConfig(4))
    tower = {"caption": build_backbone(16, 1, AttentionConfig(2))} if towers else None
    heads = {
        "image_embed": ProjectionHead(32, 8, "cls", 1),
        "caption_embed": ProjectionHead(text_width, 8, "mean"),
    }
    return MultimodalModel({"image": image, "caption": text}, backbone, heads, tower)


def _task(prompts=None) -> ContrastiveTask:
    return ContrastiveTask("image", "image_embed", "caption", "caption_embed", prompts=prompts)


def test_captions_embed_the_same_padded_or_alone_and_with_last_token_pooling():
    model, task = _model(), _task()
    ids = torch.tensor([[1, 5, 7, 2, 0, 0], [1, 9, 4, 8, 6, 2]])
    valid = ids != 0
    valid[1] = True
    batch = task.embed_captions(model, ids, valid)
    alone = task.embed_captions(model, ids[:1, :4], valid[:1, :4])
    torch.testing.assert_close(batch[:1], alone, rtol=1e-5, atol=1e-6)
    head = ProjectionHead(32, 8, "last")
    hidden, tokens = model.encode("caption", ids, valid=valid)
    torch.testing.assert_close(head(hidden, tokens)[0], head.proj(hidden[0, 3]))


def test_a_tower_reads_its_tokenizer_and_nothing_else():
    model, task = _model(towers=True), _task()
    assert any(n.startswith("towers.caption.") for n, _ in model.named_parameters())
    images, ids = torch.rand(2, 1, 8, 8), torch.tensor([[1, 5, 7, 2], [1, 9, 4, 2]])
    valid = torch.ones_like(ids, dtype=torch.bool)
    before_img, before_txt = task.embed_inputs(model, images), task.embed_captions(model, ids, valid)
    with torch.no_grad():
        for p in model.towers.parameters():
            p.add_(0.1)
    torch.testing.assert_close(task.embed_inputs(model, images), before_img)  # the shared backbone
    assert not torch.allclose(task.embed_captions(model, ids, valid), before_txt)
    with pytest.raises(ValueError, match="name no tokenizer"):
        MultimodalModel(
            dict(model.tokenizers),
            model.backbone,
            dict(model.heads),
            {"text": build_backbone(16, 1, AttentionConfig(2))},
        )


def test_validation_gathers_the_whole_set_and_classifies_zero_shot():
    model = _model()
    prompts = (
        torch.tensor([[1, 5, 2], [1, 6, 2], [1, 7, 2]]),
        torch.ones(3, 3, dtype=torch.bool),
        torch.tensor([0, 0, 1]),
    )
    task = _task(prompts)
    task.on_validation_epoch_start(model)
    g = torch.Generator().manual_seed(0)
    images = torch.randint(0, 256, (5, 1, 8, 8), generator=g, dtype=torch.uint8)
    ids = torch.randint(3, 50, (5, 4), generator=g)
    valid = torch.ones_like(ids, dtype=torch.bool)
    labels = torch.tensor([0, 1, 1, 0, -1])
    for rows in (slice(0, 2), slice(2, 5)):  # two batches, scored as one set
        task.validation_update(
            model,
            {
                "image": images[rows],
                "caption": ids[rows],
                "caption_valid": valid[rows],
                "label": labels[rows],
            },
        )
    out = task.epoch_metrics()
    with torch.no_grad():
        a, b = task.embed_inputs(model, images), task.embed_captions(model, ids, valid)
        p = task.embed_captions(model, *prompts[:2])
        classes = F.normalize(torch.stack([p[:2].sum(0), p[2]]), dim=-1)
    expected = retrieval_recall(a, b)
    assert out["i2t_recall@1"] == pytest.approx(expected["a2b_recall@1"])
    assert out["t2i_recall@1"] == pytest.approx(expected["b2a_recall@1"])
    assert out["recall@1"] == pytest.approx((expected["a2b_recall@1"] + expected["b2a_recall@1"]) / 2)
    assert out["zero_shot_acc"] == pytest.approx(zero_shot_accuracy(a, classes, labels)["zero_shot_acc"])
    assert task.epoch_metrics() == {}  # the store was reset


def test_the_temperature_trains_without_weight_decay(tmp_path):
    from mmformer.recipe import OptimConfig
    from mmformer.tasks.router import MultiTaskModule

    task = _task()
    module = MultiTaskModule(
        _model(), {"pairs": task}, {"pairs": 1.0}, OptimConfig(weight_decay=0.1, lr=1e-3)
    )
    module.trainer = type("T", (), {"estimated_stepping_batches": 10})()  # what configure_optimizers reads
    opt = module.configure_optimizers()["optimizer"]
    (group,) = [g for g in opt.param_groups if g["name"] == "task"]
    assert group["params"] == [task.logit_scale] and group["weight_decay"] == 0.0


RECIPE = """\
name: pairs
model:
  tokenizers:
    image: {kind: vit_patch, image_size: 8, patch_size: 4, in_chans: 1, mean: [0.5], std: [0.25]}
    caption: {kind: bpe, path: unused.json, max_len: 12}
  backbone: {d_model: 32, n_layers: 1, n_heads: 2}
  towers: TOWERS
  heads:
    image_embed: {kind: projection, embed_dim: 8}
    caption_embed: {kind: projection, embed_dim: EMBED, pool: mean}
tasks:
  pairs:
    kind: contrastive
    tokenizer: image
    head: image_embed
    caption_tokenizer: caption
    caption_head: CAPTION_HEAD
    data: {kind: image_caption, root: unused, max_len: DATA_LEN}
trainer: {max_steps: 1}
"""


@pytest.mark.parametrize(
    "towers, head, embed, data_len, build, message",
    [
        (
            "{captions: {d_model: 16, n_layers: 1, n_heads: 2}}",
            "caption_embed",
            8,
            12,
            0,
            "Did you mean 'caption'",
        ),
        (
            "{}",
            "caption_embd",
            8,
            12,
            0,
            "'tasks.pairs.caption_head' refers to 'caption_embd'.*'caption_embed'",
        ),
        ("{}", "caption_embed", 16, 12, 1, "must share one embed_dim"),
        (
            "{}",
            "caption_embed",
            8,
            32,
            1,
            "data.max_len=32 exceeds the caption tokenizer's learned positions",
        ),
        (
            "{caption: {d_model: 16, n_layers: 1, n_heads: 2}, image: {d_model: 16, n_layers: 1, n_heads: 2}}",
            "caption_embed",
            8,
            12,
            0,
            "every tokenizer has a tower",
        ),
    ],
)
def test_recipe_mistakes_name_the_key(towers, head, embed, data_len, build, message):
    from mmformer.recipe import RecipeError, recipe_from_yaml

    text = RECIPE.replace("TOWERS", towers).replace("CAPTION_HEAD", head).replace("EMBED", str(embed))
    with pytest.raises(RecipeError, match=message):  # every rule runs when the recipe loads
        recipe_from_yaml(text.replace("DATA_LEN", str(data_len)))
