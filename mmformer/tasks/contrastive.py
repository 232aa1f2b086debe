"""Contrastive objective (CLIP / SigLIP): paired inputs of two modalities (an image and its caption) are
embedded by their own tokenizer → backbone (or tower) → projection head, and pulled together against
every other pair of the global batch (``contrastive_loss``).

Batch keys: ``image`` (or ``audio`` with ``audio_valid``), ``caption (B, L)`` long with ``caption_valid
(B, L)`` bool (True = real token), optionally ``label (B,)`` long (a class per item for zero-shot
classification, -1 = none) and ``caption_id (B,)`` long (equal for equal caption texts, which retrieval
then treats as interchangeable).

Validation reports the in-batch ``loss`` and, over the whole held-out set (embeddings gathered from every
rank), retrieval recall@1 / @5 in both directions — ``i2t`` ranks every held-out caption for each input,
``t2i`` every input for each caption — their mean ``recall@1``, and, when the data has classes with
prompts, zero-shot classification accuracy: each class embedded as the mean of its prompts' normalised
embeddings (CLIP §3.1.4 prompt ensembling), each input assigned its most similar class.

After each validation, a few held-out captions are shown with the top-5 inputs (images, or
spectrograms of audio) they retrieve among held-out ones spread over the set (``predictions/<task>``, also a PNG in
the run folder).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torchmetrics import CatMetric, MeanMetric

from ..data.audio import collate_audio
from ..data.collate import pad_ids
from ..models.model import MultimodalModel
from ..training.media import Media, MediaContext, chunked_forward, retrieval_picture, spread
from .base import TaskBase
from .contrastive_loss import MAX_LOGIT_SCALE, clip_loss, siglip_loss

LOSSES = ("clip", "siglip")


def retrieval_recall(
    a: Tensor, b: Tensor, ks: tuple[int, ...] = (1, 5), same: Tensor | None = None
) -> dict[str, float]:
    """Recall@k of paired rows: ``a`` ``(N, E)`` and ``b`` ``(N, E)`` L2-normalised, row i of each paired
    with row i of the other. ``a2b_recall@k`` is the fraction of rows of ``a`` whose pair is among the k
    most similar rows of ``b`` (ties count against it), likewise ``b2a``.

    ``same``: optional ``(N,)`` long ids; rows with equal ids are interchangeable (two clips with one
    transcript): each counts as a match for the other, and the best-scoring match decides the rank."""
    sim = a.float() @ b.float().T  # (N, N)
    n = sim.shape[0]
    match = torch.eye(n, dtype=torch.bool, device=sim.device)
    if same is not None:
        match = same.unsqueeze(0) == same.unsqueeze(1)
    out = {}
    for name, s in (("a2b", sim), ("b2a", sim.T)):
        best = s.masked_fill(~match, -torch.inf).amax(1, keepdim=True)  # the best-scoring match
        rank = ((s >= best) & ~match).sum(1)  # non-matches scoring at least as high
        for k in ks:
            out[f"{name}_recall@{k}"] = float((rank < k).float().mean())
    return out


def zero_shot_accuracy(emb: Tensor, class_emb: Tensor, labels: Tensor) -> dict[str, float]:
    """``emb (N, E)`` and ``class_emb (K, E)`` L2-normalised, ``labels (N,)`` long (-1 = no class, left
    out): accuracy and balanced accuracy (mean recall over the classes present) of ``argmax emb·class_emb``."""
    keep = labels >= 0
    if not bool(keep.any()):
        return {}
    pred, y = (emb[keep].float() @ class_emb.float().T).argmax(1), labels[keep]
    recalls = [float((pred[y == c] == c).float().mean()) for c in y.unique()]
    return {
        "zero_shot_acc": float((pred == y).float().mean()),
        "zero_shot_balanced_acc": sum(recalls) / len(recalls),
    }


class ContrastiveTask(TaskBase):
    """Args:
    tokenizer, head: the ``model.tokenizers`` / ``model.heads`` entries for the inputs (image or audio).
    caption_tokenizer, caption_head: the entries for the paired text.
    loss: ``clip`` (softmax InfoNCE) or ``siglip`` (sigmoid).
    input_key: the batch key of the inputs (``image`` or ``audio``).
    init_temperature: the initial temperature ``1 / exp(logit_scale)`` — CLIP 0.07, SigLIP 0.1.
    init_bias: SigLIP's initial logit bias (-10).
    learn_temperature: train ``logit_scale`` (and the bias) or keep them fixed.
    gather: score each rank's pairs against every rank's (the global batch) in training.
    prompts: zero-shot classes as ``(ids (P, L) long, valid (P, L) bool, class of each prompt (P,) long)``
        — the class names' prompts, tokenized by the caption tokenizer — or None.

    The temperature and bias are parameters of this task (saved in checkpoints, trained without weight
    decay), not of the model: retrieval and zero-shot use only the normalised embeddings.
    """

    main_metric = ("recall@1", "max")
    media_pool = 64  # held-out inputs the picture's queries retrieve from
    media_queries = 4  # held-out captions shown as queries (distinct texts)
    media_top_k = 5

    def __init__(
        self,
        tokenizer: str,
        head: str,
        caption_tokenizer: str,
        caption_head: str,
        loss: str = "clip",
        input_key: str = "image",
        init_temperature: float | None = None,
        init_bias: float = -10.0,
        learn_temperature: bool = True,
        gather: bool = True,
        prompts: tuple[Tensor, Tensor, Tensor] | None = None,
    ):
        super().__init__()
        if loss not in LOSSES:
            raise ValueError(f"loss must be one of {LOSSES}, got {loss!r}")
        self.tokenizer, self.head, self.input_key = tokenizer, head, input_key
        self.caption_tokenizer, self.caption_head = caption_tokenizer, caption_head
        self.loss_kind, self.gather = loss, gather
        temperature = init_temperature or (0.07 if loss == "clip" else 0.1)
        self.logit_scale = nn.Parameter(torch.tensor(math.log(1.0 / temperature)), learn_temperature)
        self.logit_bias = (
            nn.Parameter(torch.tensor(float(init_bias)), learn_temperature) if loss == "siglip" else None
        )
        if prompts is not None:
            ids, valid, classes = prompts
            self.register_buffer("prompt_ids", ids, persistent=False)
            self.register_buffer("prompt_valid", valid, persistent=False)
            self.register_buffer("prompt_class", classes, persistent=False)
        self.has_prompts = prompts is not None
        self.class_emb: Tensor | None = None
        self.val_metrics = nn.ModuleDict({"loss": MeanMetric()})
        # whole-set embeddings, concatenated over ranks at compute()
        self.held_out = nn.ModuleDict(
            {
                "inputs": CatMetric(),
                "captions": CatMetric(),
                "labels": CatMetric(),
                "caption_ids": CatMetric(),
            }
        )
        self.epoch_metric_names = ["recall@1", "i2t_recall@1", "i2t_recall@5", "t2i_recall@1", "t2i_recall@5"]
        if self.has_prompts:
            self.epoch_metric_names += ["zero_shot_acc", "zero_shot_balanced_acc"]

    def batch_size(self, batch: dict) -> int:
        return batch["caption"].shape[0]

    # ------------------------------------------------------------------ embeddings
    def embed_inputs(self, model: MultimodalModel, inputs: Tensor, valid: Tensor | None = None) -> Tensor:
        """``(B, …)`` images or waves (with ``valid``: ``(B, S)`` bool, True = real sample) → ``(B, E)``
        L2-normalised float embeddings."""
        kwargs = {"valid": valid} if valid is not None else {}
        return F.normalize(model(inputs, self.tokenizer, self.head, **kwargs).float(), dim=-1)

    def embed_captions(self, model: MultimodalModel, ids: Tensor, valid: Tensor) -> Tensor:
        """``ids (B, L)`` long with ``valid (B, L)`` bool → ``(B, E)`` L2-normalised float embeddings."""
        return F.normalize(model(ids, self.caption_tokenizer, self.caption_head, valid=valid).float(), dim=-1)

    def _loss(self, a: Tensor, b: Tensor, gather: bool, ids: Tensor | None) -> Tensor:
        if self.loss_kind == "clip":
            return clip_loss(a, b, self.logit_scale, gather, ids)
        return siglip_loss(a, b, self.logit_scale, self.logit_bias, gather, ids)

    # ------------------------------------------------------------------ objective
    def training_loss(self, model: MultimodalModel, batch: dict) -> Tensor:
        a = self.embed_inputs(model, batch[self.input_key], batch.get(f"{self.input_key}_valid"))
        b = self.embed_captions(model, batch["caption"], batch["caption_valid"])
        return self._loss(a, b, self.gather, batch.get("caption_id"))

    def after_optimizer_step(self) -> None:
        """Clip the learned temperature in place (OpenCLIP): a forward-only clamp would stop its gradient
        for good once an update overshoots."""
        with torch.no_grad():
            self.logit_scale.clamp_(0.0, MAX_LOGIT_SCALE)

    def on_validation_epoch_start(self, model: MultimodalModel) -> None:
        """Embed the zero-shot classes with the validation weights (the EMA ones when kept)."""
        if not self.has_prompts:
            return
        with torch.no_grad():
            emb = self.embed_captions(model, self.prompt_ids, self.prompt_valid)  # (P, E)
            K = int(self.prompt_class.max()) + 1
            sums = torch.zeros(K, emb.shape[1], device=emb.device).index_add_(0, self.prompt_class, emb)
            self.class_emb = F.normalize(sums, dim=-1)

    def validation_update(self, model: MultimodalModel, batch: dict) -> None:
        a = self.embed_inputs(model, batch[self.input_key], batch.get(f"{self.input_key}_valid"))
        b = self.embed_captions(model, batch["caption"], batch["caption_valid"])
        self.val_metrics["loss"].update(
            self._loss(a, b, False, batch.get("caption_id"))
        )  # shards may differ in size
        self.held_out["inputs"].update(a)
        self.held_out["captions"].update(b)
        none = torch.full_like(b[:, 0], -1)
        labels, caption_ids = batch.get("label"), batch.get("caption_id")
        self.held_out["labels"].update(labels if labels is not None else none)
        self.held_out["caption_ids"].update(caption_ids if caption_ids is not None else none)

    def epoch_metrics(self) -> dict[str, float]:
        """The whole-set metrics of this validation (every rank gets the same values); resets the store."""
        if self.held_out["inputs"].update_count == 0:
            return {}
        a, b = self.held_out["inputs"].compute(), self.held_out["captions"].compute()
        labels = self.held_out["labels"].compute().long()
        same = self.held_out["caption_ids"].compute().long()  # equal captions are interchangeable
        for m in self.held_out.values():
            m.reset()
        r = retrieval_recall(a, b, same=same if bool((same >= 0).all()) else None)
        out = {k.replace("a2b", "i2t").replace("b2a", "t2i"): v for k, v in r.items()}
        out["recall@1"] = 0.5 * (out["i2t_recall@1"] + out["t2i_recall@1"])
        if self.has_prompts and self.class_emb is not None:
            out.update(zero_shot_accuracy(a, self.class_emb.to(a.device), labels))
        return out

    # ------------------------------------------------------------------ media
    def media(self, ctx: MediaContext) -> list[Media]:
        """With the validation weights: ``media_pool`` held-out pairs evenly spread over the set
        (``media.spread``); the first ``media_queries`` distinct captions among them, each with the
        ``media_top_k`` inputs most similar to it among the pool's inputs (its
        own pair, and inputs with an equal caption, framed as matches)."""
        val = ctx.val
        items = [val[i] for i in spread(len(val), self.media_pool)]
        items = [it for it in items if not it.get("stand_in")]  # an unreadable input's replacement
        if len(items) < 2 or self.input_key not in ("image", "audio"):
            return []
        if self.input_key == "audio":
            batch = collate_audio(items)
            inputs, valid = batch["audio"], batch["audio_valid"]
        else:
            inputs, valid = torch.stack([it["image"] for it in items]), None
        ids, ids_valid = pad_ids([it["ids"] for it in items], pad_id=0)  # (N, L); padding is masked
        same = torch.tensor([it.get("caption_id", i) for i, it in enumerate(items)])  # (N,)
        first = {int(c): i for i, c in reversed(list(enumerate(same)))}  # caption id → its first item
        queries = sorted(first.values())[: self.media_queries]
        dev = ctx.device
        with ctx.validation_weights() as model:
            a = chunked_forward(
                ctx, self.embed_inputs, model, inputs.to(dev), valid.to(dev) if valid is not None else None
            )  # (N, E)
            b = chunked_forward(
                ctx, self.embed_captions, model, ids[queries].to(dev), ids_valid[queries].to(dev)
            )
        sim = b.float().cpu() @ a.float().cpu().T  # (Q, N)
        match = same[queries].unsqueeze(1) == same.unsqueeze(0)  # (Q, N)
        rate = getattr(ctx.model.tokenizers[self.tokenizer], "sample_rate", 16_000)
        texts = [items[i]["caption"] for i in queries]
        return [retrieval_picture(texts, inputs, sim, match, self.media_top_k, valid, rate)]
