"""Chameleon-style early fusion: text and images as tokens of ONE vocabulary, one causal transformer, one
next-token loss over everything (Team Chameleon 2024, "Chameleon: Mixed-Modal Early-Fusion Foundation
Models", arXiv:2405.09818, §2.1–2.2; the image tokenizer is a frozen VQ codec, Make-A-Scene's / Gafni et
al. 2022 in the paper, ``mmformer.tokenizers.vq.VQVAE`` here). It is the baseline the Transfusion paper
compares against (Zhou et al. 2024, arXiv:2408.11039, §4.2).

The joint vocabulary (``JointVocab``), ids in this order::

    [0, V_t)                text ids of the BPE (its specials bos / eos / pad included)
    [V_t, V_t + K)          image codes 0 … K-1 of the codec, shifted by ``code_offset = V_t``
    V_t + K                 <boi>  (begin of image)
    V_t + K + 1             <eoi>  (end of image)

Sequences (``build_sequences``), one document per row, right-padded; ``C = h·w`` codes per image::

    caption → image   bos  t_1 … t_n  <boi>  c_1 … c_C  <eoi>  eos
    image → caption   bos  <boi>  c_1 … c_C  <eoi>  t_1 … t_n  eos
    caption dropped   bos  <boi>  c_1 … c_C  <eoi>                  (classifier-free guidance)

Attention is causal throughout (no bidirectional image spans: that is the difference from Transfusion).
The caption-dropped row is the image-first row cut after ``<eoi>``: the unconditional image model that
guidance needs is ``p(codes | bos <boi>)``, which image-first rows train as well.

Decoding (``ChameleonLM``) runs over the KV cache (``mmformer.nn.kv_cache``) with the constraints that
keep sequences well formed: after ``<boi>`` exactly ``C`` tokens are drawn, from the image-code range
only, then ``<eoi>`` is forced; outside an image only text ids (and ``<boi>``, where images are allowed
and an image still fits in the context) can be drawn. Classifier-free guidance for caption → image
follows Make-A-Scene (Gafni et al. 2022, §3.3) and Chameleon: ``logits = uncond + s · (cond − uncond)``
over the code logits, ``uncond`` from the twin prompt ``bos <boi>``.

Shape legend: B batch, N sequence tokens, L caption tokens, C = h·w image codes, V joint vocabulary,
K codebook size, D model width.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor, nn

from ..nn.kv_cache import KVCache
from ..tokenizers.text import TextEmbedding
from .generate import sample_next
from .heads import token_cross_entropy
from .model import MultimodalModel

IGNORE = -100
TEXT, IMAGE, MARKER = 0, 1, 2  # what an id is (``JointVocab.part``): text, image code, <boi> / <eoi>


@dataclass(frozen=True)
class JointVocab:
    """The one vocabulary of text ids, image codes and the ``<boi>`` / ``<eoi>`` markers.

    Attributes:
        text_size: ``V_t``, the BPE's vocabulary (its special tokens included).
        codebook_size: ``K``, the codec's codes.
        grid: ``(h, w)`` of the codec's code grid; an image is ``h·w`` codes, row-major.

    Raises ``ValueError`` for a size < 1.
    """

    text_size: int
    codebook_size: int
    grid: tuple[int, int]

    def __post_init__(self) -> None:
        if min(self.text_size, self.codebook_size, *self.grid) < 1:
            raise ValueError(
                f"text_size, codebook_size and grid must be >= 1, got {self.text_size}, "
                f"{self.codebook_size}, {self.grid}"
            )

    @property
    def code_offset(self) -> int:
        return self.text_size

    @property
    def boi_id(self) -> int:
        return self.text_size + self.codebook_size

    @property
    def eoi_id(self) -> int:
        return self.boi_id + 1

    @property
    def size(self) -> int:
        """``V = V_t + K + 2``."""
        return self.text_size + self.codebook_size + 2

    @property
    def image_tokens(self) -> int:
        """``C = h·w``: codes per image."""
        return self.grid[0] * self.grid[1]

    def code_ids(self, codes: Tensor) -> Tensor:
        """Codec codes (any shape, long, in ``[0, K)``) → joint ids. Raises ``ValueError`` outside."""
        if codes.numel() and (int(codes.min()) < 0 or int(codes.max()) >= self.codebook_size):
            raise ValueError(
                f"image codes must lie in [0, {self.codebook_size}), got [{int(codes.min())}, {int(codes.max())}]"
            )
        return codes + self.code_offset

    def codes(self, ids: Tensor) -> Tensor:
        """Joint ids of image codes → codec codes. Raises ``ValueError`` for an id outside the code range."""
        codes = ids - self.code_offset
        if codes.numel() and (int(codes.min()) < 0 or int(codes.max()) >= self.codebook_size):
            raise ValueError(
                f"ids outside the image-code range [{self.code_offset}, {self.boi_id}) cannot be decoded "
                "as an image"
            )
        return codes

    def part(self, ids: Tensor) -> Tensor:
        """``TEXT`` / ``IMAGE`` / ``MARKER`` per id (same shape, long)."""
        part = torch.full_like(ids, TEXT)
        part[(ids >= self.code_offset) & (ids < self.boi_id)] = IMAGE
        part[ids >= self.boi_id] = MARKER
        return part

    def code_range(self) -> slice:
        return slice(self.code_offset, self.boi_id)


class JointEmbedding(TextEmbedding):
    """The Chameleon model's token embedding: one table over the ``JointVocab`` (a ``TextEmbedding`` of
    ``V`` rows, so the ``lm`` head ties to it and text decoding reuses it), and the frozen image codec
    that turns images into codes and back.

    Args:
        vocab: the joint vocabulary.
        codec: the VQ codec (``mmformer.tokenizers.vq.VQVAE`` or any module with ``image_size``,
            ``in_chans``, ``grid``, ``codebook_size``, ``encode(images (B, C, H, W) in [-1, 1]) → (B, h·w)``
            long and ``decode(codes) → images``): frozen, kept in evaluation mode, saved with the model.
        d_model: ``D``.
        context: the longest sequence, in tokens (the context every sequence and decode must fit).
        learned_positions: GPT-2's learned absolute positions up to ``context`` (leave False with RoPE).

    Raises ``ValueError`` when the codec's grid or codebook differs from ``vocab``'s.
    """

    def __init__(
        self,
        vocab: JointVocab,
        codec: nn.Module,
        d_model: int,
        context: int,
        learned_positions: bool = False,
        n_pos_axes: int = 1,
    ):
        if tuple(codec.grid) != tuple(vocab.grid) or codec.codebook_size != vocab.codebook_size:
            raise ValueError(
                f"the codec has a {tuple(codec.grid)} grid of {codec.codebook_size} codes, the vocabulary "
                f"{tuple(vocab.grid)} of {vocab.codebook_size}"
            )
        super().__init__(vocab.size, d_model, context if learned_positions else None, n_pos_axes)
        self.vocab, self.context = vocab, context
        self.codec = codec.eval().requires_grad_(False)

    def train(self, mode: bool = True) -> JointEmbedding:
        super().train(mode)
        self.codec.eval()  # frozen: its batch statistics and dropout never change
        return self

    def example_input(self, batch_size: int = 1, length: int | None = None) -> Tensor:
        """Zero ids ``(batch_size, length)``, ``length`` defaulting to the context (FLOP counting)."""
        return torch.zeros(batch_size, length or self.context, dtype=torch.long)

    @torch.no_grad()
    def encode_images(self, images: Tensor) -> Tensor:
        """``images (B, C, H, W)``, uint8 pixels or float in [-1, 1] → codes ``(B, h·w)`` long (codec ids,
        not joint ids)."""
        if images.dtype == torch.uint8:
            images = images.float() / 127.5 - 1.0
        return self.codec.encode(images)

    @torch.no_grad()
    def decode_codes(self, codes: Tensor) -> Tensor:
        """Codes ``(B, h·w)`` → images ``(B, C, H, W)`` float clamped to [-1, 1]."""
        return self.codec.decode(codes).float().clamp(-1, 1)


# ---------------------------------------------------------------------------------------- sequences
@dataclass
class Sequences:
    """Joint-vocabulary sequences: ``ids (B, N)`` long (padding = 0), ``valid (B, N)`` bool (True = real,
    right-padded), and what ``build_sequences`` cut: ``truncated_captions`` rows whose caption lost
    ``truncated_tokens`` tokens in all to fit the context."""

    ids: Tensor
    valid: Tensor
    truncated_captions: int = 0
    truncated_tokens: int = 0


def caption_text(ids: Tensor, valid: Tensor, bos_id: int | None, eos_id: int | None) -> list[list[int]]:
    """The caption tokens of each row of ``ids, valid (B, L)`` (right-padded ``bos … eos``, as
    ``image_caption`` data gives them), without ``bos`` and ``eos``."""
    out = []
    for row, keep in zip(ids.tolist(), valid.tolist()):
        text = [t for t, k in zip(row, keep) if k]
        if text and text[0] == bos_id:
            text = text[1:]
        if text and text[-1] == eos_id:
            text = text[:-1]
        out.append(text)
    return out


def text_room(vocab: JointVocab, context: int) -> int:
    """Caption tokens a sequence of ``context`` tokens leaves beside one image and ``bos``, ``<boi>``,
    ``<eoi>``, ``eos``. Raises ``ValueError`` naming the sizes when the image itself does not fit."""
    room = context - vocab.image_tokens - 4
    if room < 0:
        raise ValueError(
            f"an image takes <boi> + {vocab.image_tokens} codes + <eoi>, and a sequence bos and eos: "
            f"{vocab.image_tokens + 4} tokens, but the context holds {context}"
        )
    return room


def build_sequences(
    vocab: JointVocab,
    captions: list[list[int]],
    codes: Tensor,
    image_first: Tensor,
    drop_caption: Tensor,
    bos_id: int,
    eos_id: int,
    context: int,
) -> Sequences:
    """The training sequences (module docstring): ``captions`` (B lists of caption ids, no bos / eos),
    ``codes (B, C)`` long codec codes, ``image_first (B,)`` bool (image → caption order), ``drop_caption
    (B,)`` bool (caption → image with the caption dropped; ignored for image-first rows). A caption longer
    than the context leaves (``text_room``) is cut to fit and counted, never dropped.

    Raises ``ValueError`` naming the sizes when an image does not fit in ``context``, or when the batch
    sizes differ."""
    B, C = codes.shape
    if (
        C != vocab.image_tokens
        or len(captions) != B
        or image_first.shape != (B,)
        or drop_caption.shape != (B,)
    ):
        raise ValueError(
            f"need {vocab.image_tokens} codes per image and one caption and order per image: got codes "
            f"{tuple(codes.shape)}, {len(captions)} captions, image_first {tuple(image_first.shape)}, "
            f"drop_caption {tuple(drop_caption.shape)}"
        )
    room = text_room(vocab, context)
    image = [[vocab.boi_id, *row, vocab.eoi_id] for row in vocab.code_ids(codes).tolist()]
    rows, cut_rows, cut_tokens = [], 0, 0
    for text, img, first, drop in zip(captions, image, image_first.tolist(), drop_caption.tolist()):
        if len(text) > room:
            cut_rows, cut_tokens = cut_rows + 1, cut_tokens + len(text) - room
            text = text[:room]
        if first:
            rows.append([bos_id, *img, *text, eos_id])
        elif drop:
            rows.append([bos_id, *img])
        else:
            rows.append([bos_id, *text, *img, eos_id])
    N = max(len(r) for r in rows)
    ids = torch.zeros(B, N, dtype=torch.long)
    valid = torch.zeros(B, N, dtype=torch.bool)
    for i, r in enumerate(rows):
        ids[i, : len(r)], valid[i, : len(r)] = torch.tensor(r), True
    return Sequences(ids.to(codes.device), valid.to(codes.device), cut_rows, cut_tokens)


def next_token_targets(ids: Tensor, valid: Tensor) -> Tensor:
    """``(B, N - 1)``: the id each position predicts (``ids[:, 1:]``), ``IGNORE`` where it is padding."""
    return ids[:, 1:].masked_fill(~(valid[:, 1:] & valid[:, :-1]), IGNORE)


def guide(cond: Tensor, uncond: Tensor, scale: float) -> Tensor:
    """Classifier-free guidance on logits: ``uncond + scale · (cond − uncond)`` (Ho & Salimans 2022;
    Make-A-Scene §3.3 for token logits). ``scale = 1`` is the conditional logits, 0 the unconditional."""
    return uncond + scale * (cond - uncond)


def left_pad(rows: list[list[int]], pad_id: int = 0) -> tuple[Tensor, Tensor]:
    """Prompts of different lengths → ``ids (B, N)`` long and ``valid (B, N)`` bool, left-padded so every
    row's next token comes at the end."""
    n = max(len(r) for r in rows)
    ids = torch.full((len(rows), n), pad_id, dtype=torch.long)
    valid = torch.zeros(len(rows), n, dtype=torch.bool)
    for i, r in enumerate(rows):
        if r:
            ids[i, n - len(r) :], valid[i, n - len(r) :] = torch.tensor(r), True
    return ids, valid


# ---------------------------------------------------------------------------------------- decoding
@dataclass(frozen=True)
class ChameleonLM:
    """The names of a Chameleon model's parts in a ``MultimodalModel``, and its decoding.

    Attributes:
        tokenizer: the ``JointEmbedding`` entry of ``model.tokenizers``.
        head: the LM head over the joint vocabulary (``model.heads``).
    """

    tokenizer: str
    head: str

    def embedding(self, model: MultimodalModel) -> JointEmbedding:
        return model.tokenizers[self.tokenizer]

    def logits(self, model: MultimodalModel, ids: Tensor, valid: Tensor) -> Tensor:
        """Teacher-forced logits ``(B, N, V)``: position ``t`` predicts id ``t + 1``."""
        return model(ids, self.tokenizer, self.head, valid=valid)

    def cross_entropy(
        self, model: MultimodalModel, ids: Tensor, valid: Tensor, targets: Tensor, reduction: str = "mean"
    ) -> Tensor:
        """The teacher-forced cross-entropy of ``logits`` against ``targets (B, N - 1)`` (``-100`` = not
        counted; ``reduction`` as ``F.cross_entropy``'s, ``"none"`` → ``(B, N - 1)`` float32), without
        the ``(B, N, V)`` logits over the joint vocabulary for an ``LMHead``
        (``heads.token_cross_entropy``)."""
        hidden, tokens = model.encode(self.tokenizer, ids, valid=valid)
        return token_cross_entropy(model.heads[self.head], hidden, tokens, targets, IGNORE, reduction)

    def _prefill(
        self, model: MultimodalModel, ids: Tensor, valid: Tensor, new: int
    ) -> tuple[KVCache, Tensor]:
        """Run left-padded prompts ``ids, valid (B, N)`` into a new cache; the next-id logits ``(B, V)``."""
        cache = KVCache(capacity=ids.shape[1] + new)
        hidden, tokens = model.encode(self.tokenizer, ids, cache=cache, valid=valid)
        return cache, model.heads[self.head](hidden[:, -1:], tokens)[:, -1].float()

    def _step(self, model: MultimodalModel, cache: KVCache, ids: Tensor) -> Tensor:
        """Feed ``ids (B,)`` (one per row) after the cached tokens; the next-id logits ``(B, V)``."""
        pos = cache.valid.sum(dim=1, keepdim=True).unsqueeze(-1)  # (B, 1, 1): each row's next position
        step_valid = torch.ones_like(ids[:, None], dtype=torch.bool)
        out = model(ids[:, None], self.tokenizer, self.head, cache=cache, valid=step_valid, positions=pos)
        return out[:, -1].float()

    def _check_room(self, model: MultimodalModel, prompt_len: int, needed: int) -> None:
        context = self.embedding(model).context
        if prompt_len + needed > context:
            raise ValueError(
                f"no room for an image: the prompt holds {prompt_len} tokens and the image needs {needed} "
                f"more (<boi> or its codes, and <eoi>), but the context holds {context}"
            )

    @torch.no_grad()
    def sample_codes(
        self,
        model: MultimodalModel,
        prompts: list[list[int]],
        bos_id: int,
        cfg_scale: float = 1.0,
        temperature: float = 1.0,
        top_k: int | None = None,
        generator: torch.Generator | None = None,
        bar=None,
    ) -> Tensor:
        """Images as codes ``(B, C)`` long (codec ids), one per text prompt (``bos`` + caption ids; ``<boi>``
        is appended here), drawn with the KV cache: ``C`` steps, each over the image-code logits only,
        guided with ``cfg_scale`` against the twin prompt ``bos <boi>`` (no twin pass when it is 1);
        ``temperature = 0`` takes the argmax. ``bar``: a progress bar to update per code.

        Raises ``ValueError`` naming the sizes when a prompt leaves no room for ``<boi>`` + ``C`` codes +
        ``<eoi>`` in the context, and for a prompt that does not start with ``bos``."""
        vocab = self.embedding(model).vocab
        C, codes_at = vocab.image_tokens, vocab.code_range()
        if any(not p or p[0] != bos_id for p in prompts):
            raise ValueError("every prompt starts with bos (the caption's encoding with bos=True)")
        self._check_room(model, max(len(p) for p in prompts), C + 2)
        model.for_decoding()
        rows = [[*p, vocab.boi_id] for p in prompts]
        guided = cfg_scale != 1
        if guided:
            rows += [[bos_id, vocab.boi_id]] * len(prompts)  # the unconditional twins
        device = next(model.parameters()).device
        ids, valid = (t.to(device) for t in left_pad(rows))
        cache, logits = self._prefill(model, ids, valid, C)
        B = len(prompts)
        codes = torch.empty(B, C, dtype=torch.long, device=device)
        for i in range(C):
            code_logits = logits[:, codes_at]  # (B or 2B, K): only image codes can follow <boi>
            if guided:
                code_logits = guide(code_logits[:B], code_logits[B:], cfg_scale)
            codes[:, i] = sample_next(code_logits, temperature, top_k, generator=generator)
            if bar is not None:
                bar.update(1)
            if i < C - 1:  # no forward for logits nobody reads
                nxt = codes[:, i] + vocab.code_offset
                logits = self._step(model, cache, torch.cat([nxt, nxt]) if guided else nxt)
        return codes

    def allowed(
        self, vocab: JointVocab, remaining: Tensor, room: Tensor, images: bool, banned: Tensor
    ) -> Tensor:
        """``(B, V)`` bool: the ids each row may draw next. ``remaining (B,)`` long: codes still owed to an
        open image (``C`` … 1), 0 when its ``<eoi>`` is due (``-1`` marks text); ``room (B,)`` long: tokens
        left in the context. Inside an image only codes, then ``<eoi>``; in text the text ids but
        ``banned`` (``(V,)`` bool: bos, pad), and ``<boi>`` when ``images`` and ``room >= C + 2``."""
        B, V = remaining.shape[0], vocab.size
        device = remaining.device
        is_code = torch.zeros(V, dtype=torch.bool, device=device)
        is_code[vocab.code_range()] = True
        is_text = torch.zeros(V, dtype=torch.bool, device=device)
        is_text[: vocab.text_size] = True
        is_text &= ~banned
        eoi = torch.zeros(V, dtype=torch.bool, device=device)
        eoi[vocab.eoi_id] = True
        text = is_text.expand(B, V).clone()
        if images:
            text[:, vocab.boi_id] = room >= vocab.image_tokens + 2
        out = torch.where((remaining > 0)[:, None], is_code, text)
        return torch.where((remaining == 0)[:, None], eoi.expand(B, V), out)

    @torch.no_grad()
    def decode(
        self,
        model: MultimodalModel,
        prompts: list[list[int]],
        max_new_tokens: int,
        eos_id: int | None,
        banned: tuple[int, ...] = (),
        images: bool = True,
        temperature: float = 0.0,
        top_k: int | None = None,
        generator: torch.Generator | None = None,
        fixed_steps: bool = False,
    ) -> list[list[int]]:
        """Continue joint-vocabulary ``prompts`` (lists of ids; a prompt may end inside an image, after
        ``<boi>`` and some codes) with the KV cache, under the constraints of the module docstring; each
        row's new ids up to and excluding ``eos`` (``<boi>``, codes and ``<eoi>`` included). ``images``:
        whether the model may open an image (False: text only — captioning); ``banned``: text ids never
        drawn (``bos``, ``pad``). Stops at ``eos``, after ``max_new_tokens`` or at the end of the context.
        ``fixed_steps``: no early stop (FSDP2: every rank runs the same forwards).

        Raises ``ValueError`` for ``max_new_tokens < 1``, a prompt that fills the context, and (naming
        the sizes) a prompt whose open image cannot be finished in the context."""
        if max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
        vocab, context = self.embedding(model).vocab, self.embedding(model).context
        C = vocab.image_tokens
        remaining = []
        for p in prompts:  # an open image owes its remaining codes and <eoi>
            opened = max((i for i, t in enumerate(p) if t == vocab.boi_id), default=-1)
            open_image = opened >= 0 and vocab.eoi_id not in p[opened:]
            remaining.append(C - (len(p) - opened - 1) if open_image else -1)
            if open_image:
                self._check_room(model, len(p), remaining[-1] + 1)
        longest = max(len(p) for p in prompts)
        if longest >= context:
            raise ValueError(f"a prompt of {longest} tokens fills the context of {context}")
        max_new_tokens = min(max_new_tokens, context - longest)
        model.for_decoding()
        device = next(model.parameters()).device
        ids, valid = (t.to(device) for t in left_pad(prompts))
        cache, logits = self._prefill(model, ids, valid, max_new_tokens)
        remaining_t = torch.tensor(remaining, dtype=torch.long, device=device)
        length = valid.sum(1)
        ban = torch.zeros(vocab.size, dtype=torch.bool, device=device)
        ban[[b for b in banned if b is not None and 0 <= b < vocab.text_size]] = True
        out: list[list[int]] = [[] for _ in prompts]
        done = torch.zeros(len(prompts), dtype=torch.bool, device=device)
        for step in range(max_new_tokens):
            mask = self.allowed(vocab, remaining_t, context - length, images, ban)
            nxt = sample_next(
                logits.masked_fill(~mask, float("-inf")), temperature, top_k, generator=generator
            )
            for i, (t, ended) in enumerate(zip(nxt.tolist(), done.tolist())):
                if not ended and t != eos_id:
                    out[i].append(t)
            if eos_id is not None:
                done |= nxt == eos_id
            # the image state: <boi> opens C codes, each code counts down, <eoi> closes
            remaining_t = torch.where(
                nxt == vocab.boi_id,
                torch.full_like(remaining_t, C),
                torch.where(remaining_t >= 0, remaining_t - 1, remaining_t),
            )
            length = length + 1
            if (bool(done.all()) and not fixed_steps) or step == max_new_tokens - 1:
                break
            logits = self._step(model, cache, nxt)
        return out
