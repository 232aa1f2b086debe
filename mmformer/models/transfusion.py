"""Transfusion: one causal transformer over sequences that mix BPE text with continuous image patches, the
LM loss on the text and a diffusion (or flow) loss on the images (Zhou et al. 2024, "Transfusion: Predict
the Next Token and Diffuse Images with One Multi-Modal Model", arXiv:2408.11039, §3).

Sequence layout (``document``: one caption–image pair; several may be packed in a row)::

    caption → image   bos  c_1 … c_n  <boi>  p_1 … p_P  <eoi>  eos
    image → caption   bos  <boi>  p_1 … p_P  <eoi>  c_1 … c_n  eos

Mask (§3.3, their fig. 4; ``mmformer.nn.masks``): causal over the whole sequence, the ``P`` patches of one
image see each other both ways (each image its own ``span`` id), documents never see each other, padding
is never attended. Positions: each token's index in its document (the backbone's RoPE); patches also carry
the DiT tokenizer's fixed 2-D sin-cos embedding of their place in the grid.

Image tokens (§3.2, "linear" patch encoder): the DiT tokenizer (``mmformer.tokenizers.diffusion``) embeds
the noisy image ``x_t`` patch by patch, and the embedding of the image's own timestep ``t`` is added to
every patch (one ``t`` per image: images of one sequence are noised independently). The DiT final layer
(adaLN-modulated by the same ``t`` embedding, then unpatchify) reads the patches' hidden states back into
the network's prediction (ε / v, or the flow velocity). Text: the text tokenizer's embeddings, the LM head.

Generation (§3.5): text token by token over the KV cache until ``<boi>``; then ``P`` noise patches are
appended and denoised by the sampler, each step reading the cached text and dropping its own keys
(``KVCache.truncate``), the image chunk of the next step taking their place; the finished image is cached
clean (``t = 0``) with ``<eoi>`` and text decoding goes on.

Shape legend: B rows, N tokens, M images, P patches per image, D width, V vocabulary, C×H×W an image.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from ..nn.kv_cache import KVCache
from ..nn.tokens import MODALITY_IDS, Tokens
from .diffusion import GaussianDiffusion, RectifiedFlow, ddim_sample, ddpm_sample
from .heads import token_cross_entropy
from .model import MultimodalModel

IGNORE = -100  # a position with no next-token target (``F.cross_entropy``'s ignore_index)
SAMPLERS = {"gaussian": ("ddim", "ddpm"), "flow": ("euler", "heun")}
FLOW_TIME_SCALE = 1000.0  # flow t ∈ [0, 1] → the timestep embedder's DDPM-like range (as the DiT task)


@dataclass(frozen=True)
class ImageSlot:
    """An image in a document's item list: ``index`` into the batch's images ``(M, C, H, W)``."""

    index: int


Item = int | ImageSlot  # a text id, or an image (P patches)
Document = list[Item]


def pair_document(
    caption: Sequence[int], image: int, caption_first: bool, boi: int, eoi: int, patches: int, context: int
) -> tuple[Document, int]:
    """One caption–image pair as a document (the layouts above).

    Args:
        caption: the caption's ids ``bos … eos`` (what ``image_caption`` data gives).
        image: its index among the batch's images; caption_first: the order.
        boi, eoi: the marker ids; patches: ``P``; context: the longest document in tokens.

    Returns ``(document, cut)``: a caption that does not fit beside its image is cut (its ``eos`` kept),
    ``cut`` = the caption tokens dropped (0 when it fits). Raises ``ValueError`` when not even
    ``bos <boi> image <eoi> eos`` fits in ``context``.
    """
    fixed = patches + 4  # bos, <boi>, <eoi>, eos around the image
    if fixed > context:
        raise ValueError(
            f"an image of {patches} patches needs {fixed} tokens with bos/<boi>/<eoi>/eos; the context is {context}"
        )
    bos, body, eos = caption[0], list(caption[1:-1]), caption[-1]
    keep = context - fixed
    cut = max(0, len(body) - keep)
    body = body[:keep]
    img = [boi, ImageSlot(image), eoi]
    return ([bos, *body, *img, eos] if caption_first else [bos, *img, *body, eos]), cut


def document_length(doc: Document, patches: int) -> int:
    return sum(patches if isinstance(i, ImageSlot) else 1 for i in doc)


def pack(docs: list[Document], patches: int, context: int) -> list[list[Document]]:
    """Documents into rows of at most ``context`` tokens, in order, a new row when the next does not fit
    (first fit on the last row: the order of the pairs is kept)."""
    rows: list[list[Document]] = []
    used = context + 1
    for doc in docs:
        n = document_length(doc, patches)
        if used + n > context:
            rows.append([])
            used = 0
        rows[-1].append(doc)
        used += n
    return rows


@dataclass
class Layout:
    """Where every token of a batch of mixed sequences comes from.

    Attributes:
        ids: ``(B, N)`` long, the text ids (``pad_id`` at patches and padding).
        is_text, is_image: ``(B, N)`` bool (neither: padding).
        slot: ``(B, N)`` long, a patch's row in the flattened patches ``(M·P, D)``: ``image · P + patch``.
        document: ``(B, N)`` long packed-document ids (-1 at padding).
        positions: ``(B, N)`` long, each token's index in its document (plus the row's ``start``).
        span: ``(B, N)`` long, the bidirectional span id of each patch (1, 2, … per image in a row), 0 else.
        targets: ``(B, N)`` long, the next text id a text position predicts; ``IGNORE`` where the next
            token is a patch, at the document's end, at patches and at padding.
    """

    ids: Tensor
    is_text: Tensor
    is_image: Tensor
    slot: Tensor
    document: Tensor
    positions: Tensor
    span: Tensor
    targets: Tensor

    @property
    def valid(self) -> Tensor:
        return self.is_text | self.is_image

    def to(self, device) -> Layout:
        return Layout(**{k: v.to(device) for k, v in vars(self).items()})


def build_layout(
    rows: list[list[Document]],
    patches: int,
    pad_id: int,
    left: bool = False,
    start: Sequence[int] | None = None,
) -> Layout:
    """The ``Layout`` of ``rows`` (each a list of documents), right-padded (``left``: left-padded, for
    prompts that decoding continues); ``start[b]``: the row's first position (the tokens already cached)."""
    seqs = []
    for b, docs in enumerate(rows):
        seq = []  # (id, slot, document, position, span, target) per token
        n_images = 0
        for d, doc in enumerate(docs):
            pos = start[b] if start is not None and d == 0 else 0
            for k, item in enumerate(doc):
                if isinstance(item, ImageSlot):
                    n_images += 1
                    for p in range(patches):
                        seq.append((pad_id, item.index * patches + p, d, pos, n_images, IGNORE, True))
                        pos += 1
                    continue
                nxt = doc[k + 1] if k + 1 < len(doc) else None
                target = nxt if isinstance(nxt, int) else IGNORE
                seq.append((item, 0, d, pos, 0, target, False))
                pos += 1
        seqs.append(seq)
    B, N = len(seqs), max((len(s) for s in seqs), default=0)
    ids = torch.full((B, N), pad_id, dtype=torch.long)
    slot, span = torch.zeros(B, N, dtype=torch.long), torch.zeros(B, N, dtype=torch.long)
    document, positions = torch.full((B, N), -1, dtype=torch.long), torch.zeros(B, N, dtype=torch.long)
    targets = torch.full((B, N), IGNORE, dtype=torch.long)
    is_text, is_image = torch.zeros(B, N, dtype=torch.bool), torch.zeros(B, N, dtype=torch.bool)
    for b, seq in enumerate(seqs):
        if not seq:
            continue
        cols = slice(N - len(seq), N) if left else slice(0, len(seq))
        i, s, d, p, sp, t, img = (torch.tensor(c) for c in zip(*seq))
        ids[b, cols], slot[b, cols], document[b, cols], positions[b, cols] = i, s, d, p
        span[b, cols], targets[b, cols], is_image[b, cols], is_text[b, cols] = sp, t, img, ~img
        if left:  # padding before a row repeats its first position (never attended)
            positions[b, : N - len(seq)] = positions[b, N - len(seq)]
    return Layout(ids, is_text, is_image, slot, document, positions, span, targets)


@dataclass(frozen=True)
class Transfusion:
    """The names of a Transfusion model's parts in a ``MultimodalModel``, and the sequences' sizes.

    Attributes:
        image_tokenizer: a ``DiTTokenizer`` (unconditional): patch embedding + 2-D sin-cos positions, and
            the timestep embedder whose output is added to every patch of an image.
        text_tokenizer: a ``TextEmbedding``; lm_head: its LM head; image_head: a ``DiTFinalLayer``.
        boi_id, eoi_id, bos_id, eos_id, pad_id: the text tokenizer's ids.
        context: the longest document, in tokens (text + patches).
    """

    image_tokenizer: str
    text_tokenizer: str
    lm_head: str
    image_head: str
    boi_id: int
    eoi_id: int
    bos_id: int
    eos_id: int
    pad_id: int
    context: int

    def patches(self, model: MultimodalModel) -> int:
        Gh, Gw = model.tokenizers[self.image_tokenizer].grid_size
        return Gh * Gw

    def image_shape(self, model: MultimodalModel) -> tuple[int, int, int]:
        tok = model.tokenizers[self.image_tokenizer]
        return tok.in_chans, tok.image_size, tok.image_size

    # ------------------------------------------------------------------ the network
    def embed(self, model: MultimodalModel, layout: Layout, x_t: Tensor | None, t: Tensor | None):
        """``Tokens (B, N, D)`` of a layout whose patches come from the images ``x_t (M, C, H, W)`` at
        model timesteps ``t (M,)`` (DDPM steps, or 1000 · flow t); also the images' ``(patch tokens,
        t embedding (M, D))`` (None without images)."""
        text = model.tokenizers[self.text_tokenizer]
        rope = model.backbone.rope
        n_axes = rope.n_axes if rope is not None else 1
        positions = layout.positions.unsqueeze(-1).expand(*layout.positions.shape, n_axes)
        tokens = text(layout.ids, valid=layout.is_text, positions=positions)
        images = None
        if x_t is not None and x_t.shape[0]:
            img = model.tokenizers[self.image_tokenizer](x_t, t)  # ConditionedTokens (M, P, D), cond (M, D)
            patches = (img.x + img.cond.unsqueeze(1)).flatten(0, 1)  # (M·P, D): t added to every patch
            x = torch.where(layout.is_image.unsqueeze(-1), patches[layout.slot].to(tokens.x.dtype), tokens.x)
            images = (img, img.cond)
        else:
            x = tokens.x
        modality = torch.where(layout.is_image, MODALITY_IDS["diffusion"], MODALITY_IDS["text"])
        return Tokens(x, layout.valid, positions, layout.document, modality), images

    def forward(
        self,
        model: MultimodalModel,
        layout: Layout,
        x_t: Tensor | None,
        t: Tensor | None,
        cache: KVCache | None = None,
    ) -> tuple[Tensor, Tensor, Tensor | None]:
        """Run a layout through the backbone (appending to ``cache`` when given).

        Returns ``(hidden (B, N, D), text logits (B, N, V), image predictions (M, C_out, H, W) or None)``;
        the logits at position ``i`` predict the text token ``i + 1`` (``layout.targets``).
        """
        hidden, seq, pred = self.run(model, layout, x_t, t, cache)
        return hidden, model.heads[self.lm_head](hidden, seq), pred

    def losses(
        self, model: MultimodalModel, layout: Layout, x_t: Tensor, t: Tensor, reduction: str = "mean"
    ) -> tuple[Tensor, Tensor]:
        """Run a layout (no cache): the text's next-token cross-entropy against ``layout.targets``
        (``reduction`` as ``F.cross_entropy``'s over the counted targets; ``"none"`` → ``(B, N)`` float32,
        0 where ignored) without the ``(B, N, V)`` logits for an ``LMHead`` (``heads.token_cross_entropy``),
        and the image predictions ``(M, C_out, H, W)``."""
        hidden, seq, pred = self.run(model, layout, x_t, t)
        head = model.heads[self.lm_head]
        return token_cross_entropy(head, hidden, seq, layout.targets, IGNORE, reduction), pred

    def run(
        self,
        model: MultimodalModel,
        layout: Layout,
        x_t: Tensor | None,
        t: Tensor | None,
        cache: KVCache | None = None,
    ) -> tuple[Tensor, Tokens, Tensor | None]:
        """``forward`` without the text head: ``(hidden (B, N, D), the embedded sequence, image
        predictions (M, C_out, H, W) or None)``."""
        seq, images = self.embed(model, layout, x_t, t)
        hidden = model.backbone(seq, cache=cache, span=layout.span)
        pred = None
        if images is not None:
            img, cond = images
            M, P, D = img.x.shape
            flat = hidden.new_zeros(M * P, D)
            flat[layout.slot[layout.is_image]] = hidden[layout.is_image]
            pred = model.heads[self.image_head](flat.view(M, P, D), img, cond).float()
        return hidden, seq, pred

    # ------------------------------------------------------------------ generation
    def _prefill(self, model: MultimodalModel, prompts: list[Document], images: Tensor | None) -> KVCache:
        """A cache holding ``prompts`` (left-padded rows; their images clean, ``t = 0``)."""
        layout = build_layout([[p] for p in prompts], self.patches(model), self.pad_id, left=True)
        device = next(model.parameters()).device
        cache = KVCache()
        t = torch.zeros(images.shape[0], device=device) if images is not None else None
        self.forward(model, layout.to(device), images, t, cache)
        return cache

    def _image_step(self, model: MultimodalModel, cache: KVCache, x_t: Tensor, t: Tensor) -> Tensor:
        """The prediction for ``x_t (B, C, H, W)`` at model timesteps ``t (B,)`` after the cached rows; the
        image's keys are dropped from the cache afterwards."""
        B, P = x_t.shape[0], self.patches(model)
        start = cache.valid.sum(dim=1).tolist()
        layout = build_layout([[[ImageSlot(b)]] for b in range(B)], P, self.pad_id, start=start)
        length = cache.length
        _, _, pred = self.forward(model, layout.to(x_t.device), x_t, t, cache)
        cache.truncate(length)
        return pred

    def _recomputed_step(self, model: MultimodalModel, prompts: list[Document], images: Tensor | None):
        """The same prediction as ``_image_step`` with no cache: each row's prompt and the noisy image
        run as one sequence (the reference the cached path is tested against)."""

        def fn(x_t: Tensor, t: Tensor) -> Tensor:
            P = self.patches(model)
            m = images.shape[0] if images is not None else 0
            rows = [[[*p, ImageSlot(m + b)]] for b, p in enumerate(prompts)]
            layout = build_layout(rows, P, self.pad_id, left=True).to(x_t.device)
            zeros = torch.zeros(m, device=x_t.device)
            all_x = torch.cat([images, x_t]) if images is not None else x_t
            _, _, pred = self.forward(model, layout, all_x, torch.cat([zeros, t.to(zeros.dtype)]))
            return pred[m:]

        return fn

    def denoiser(
        self,
        model: MultimodalModel,
        prompts: list[Document],
        images: Tensor | None,
        time_scale: float,
        use_cache: bool = True,
    ) -> Callable[[Tensor, Tensor], Tensor]:
        """``fn(x_t (B, C, H, W), t (B,)) → prediction`` for an image after each row's ``prompt`` (ending in
        ``<boi>``; ``images``: the prompts' own images, clean). ``t`` in the process's units (flow t is
        multiplied by ``time_scale``). With ``use_cache`` the prompts run once; else every call recomputes."""
        if use_cache:
            cache = self._prefill(model, prompts, images)
            step = lambda x, t: self._image_step(model, cache, x, t)  # noqa: E731
        else:
            step = self._recomputed_step(model, prompts, images)
        return lambda x, t: step(x, t * time_scale)

    @torch.no_grad()
    def sample_images(
        self,
        model: MultimodalModel,
        captions: list[list[int]],
        process: GaussianDiffusion | RectifiedFlow,
        sampler: str,
        steps: int,
        cfg_scale: float = 1.0,
        generator: torch.Generator | None = None,
        use_cache: bool = True,
        eta: float = 0.0,
    ) -> Tensor:
        """Caption → image: ``bos caption <boi>`` then the image by the sampler. ``captions``: each one's
        ids (``bos … eos``; the ``eos`` is left out). Classifier-free guidance with ``cfg_scale != 1``
        against the caption-free prompt ``bos <boi>`` (a second cache). Returns ``(N, C, H, W)`` float,
        clamped to [-1, 1]. Captions too long to leave room for the image are cut (``cut_prompt``)."""
        prompts = [self.cut_prompt(c, model)[0] for c in captions]
        return self._sample(
            model, prompts, None, process, sampler, steps, cfg_scale, generator, use_cache, eta
        )

    def cut_prompt(self, caption: Sequence[int], model: MultimodalModel) -> tuple[Document, int]:
        """``bos c_1 … c_k <boi>`` of a caption ``bos … eos``, cut so the image and ``<eoi>`` still fit in
        ``context``; returns it and the tokens cut."""
        body = [i for i in caption[1:] if i != self.eos_id]
        room = self.context - self.patches(model) - 3  # bos, <boi>, <eoi>
        cut = max(0, len(body) - max(room, 0))
        return [self.bos_id, *body[: max(room, 0)], self.boi_id], cut

    def _sample(self, model, prompts, images, process, sampler, steps, cfg_scale, generator, use_cache, eta):
        device = next(model.parameters()).device
        kind = "flow" if isinstance(process, RectifiedFlow) else "gaussian"
        if sampler not in SAMPLERS[kind]:
            raise ValueError(f"sampler {sampler!r} does not fit {kind} diffusion; choose {SAMPLERS[kind]}")
        scale = FLOW_TIME_SCALE if kind == "flow" else 1.0
        fn = self.denoiser(model, prompts, images, scale, use_cache)
        if cfg_scale != 1:
            null = self.denoiser(model, [[self.bos_id, self.boi_id]] * len(prompts), None, scale, use_cache)
            cond = fn
            fn = lambda x, t: (lambda u: u + cfg_scale * (cond(x, t) - u))(null(x, t))  # noqa: E731
        shape = (len(prompts), *self.image_shape(model))
        if kind == "flow":
            run = process.euler_sample if sampler == "euler" else process.heun_sample
            out = run(fn, shape, steps=steps, generator=generator, device=device)
        elif sampler == "ddpm":
            out = ddpm_sample(process, fn, shape, generator=generator, device=device)
        else:
            out = ddim_sample(process, fn, shape, steps=steps, eta=eta, generator=generator, device=device)
        return out.clamp(-1, 1)

    @torch.no_grad()
    def caption_images(self, model: MultimodalModel, images: Tensor, max_new_tokens: int) -> list[list[int]]:
        """Image → text: ``bos <boi> image <eoi>`` (the image clean, ``t = 0``), then greedy decoding over the
        cache until ``eos``. Returns the new ids per image (``eos`` left out)."""
        prompts = [[self.bos_id, self.boi_id, ImageSlot(b), self.eoi_id] for b in range(images.shape[0])]
        return [
            [i for i in out if isinstance(i, int)]
            for out in self.continue_text(model, prompts, images, max_new_tokens, stop_at_boi=False)
        ]

    def continue_text(
        self,
        model: MultimodalModel,
        prompts: list[Document],
        images: Tensor | None,
        max_new_tokens: int,
        stop_at_boi: bool = True,
        use_cache: bool = True,
    ) -> list[list[int]]:
        """Greedy text after each prompt (its images clean), until ``eos``, ``<boi>`` (kept, when
        ``stop_at_boi``: an image comes next) or ``max_new_tokens``; ``<boi>`` is never emitted where the
        image would not fit (``stop_at_boi=False``: never at all). ``use_cache=False`` recomputes the
        whole sequence for every token (the reference the cached path is tested against)."""
        device = next(model.parameters()).device
        P = self.patches(model)
        images = images.to(device) if images is not None else None
        docs = [list(p) for p in prompts]
        out: list[list[int]] = [[] for _ in prompts]
        done = [False] * len(prompts)
        cache = KVCache() if use_cache else None
        layout = build_layout([[d] for d in docs], P, self.pad_id, left=True).to(device)
        t0 = torch.zeros(images.shape[0], device=device) if images is not None else None
        _, logits, _ = self.forward(model, layout, images, t0, cache)
        last = logits[:, -1].float()  # (B, V)
        for _ in range(max_new_tokens):
            used = [document_length(d, P) for d in docs]
            room = torch.tensor([u + P + 1 < self.context for u in used], device=device)
            if not stop_at_boi:
                room = torch.zeros_like(room)
            last[:, self.boi_id] = torch.where(room, last[:, self.boi_id], float("-inf"))
            nxt = last.argmax(dim=-1).tolist()
            for b, tok in enumerate(nxt):
                if not done[b]:
                    out[b].append(tok)
                    done[b] = tok in (self.eos_id, self.boi_id) or used[b] + 1 >= self.context
            if all(done):
                break
            step_ids = [[tok] for tok in nxt]
            for d, tok in zip(docs, nxt):
                d.append(tok)
            if use_cache:
                start = cache.valid.sum(dim=1).tolist()
                layout = build_layout([[s] for s in step_ids], P, self.pad_id, start=start).to(device)
                _, logits, _ = self.forward(model, layout, None, None, cache)
            else:
                layout = build_layout([[d] for d in docs], P, self.pad_id, left=True).to(device)
                _, logits, _ = self.forward(model, layout, images, t0)
            last = logits[:, -1].float()
        return [o[:-1] if o and o[-1] == self.eos_id else o for o in out]

    @torch.no_grad()
    def generate(
        self,
        model: MultimodalModel,
        prompt: Sequence[int],
        process: GaussianDiffusion | RectifiedFlow,
        sampler: str,
        steps: int,
        max_new_tokens: int,
        cfg_scale: float = 1.0,
        generator: torch.Generator | None = None,
        max_images: int = 1,
    ) -> list[list[int] | Tensor]:
        """Interleaved generation from one text ``prompt`` (ids, ``bos`` first): greedy text until the model
        emits ``<boi>``, then an image by the sampler (the text stays cached), then ``<eoi>`` and text again,
        until ``eos``, ``max_new_tokens`` text tokens, or the context is full. At most ``max_images``
        images; after that ``<boi>`` is not drawn.

        Returns the segments in order: ``list[int]`` text ids, ``Tensor (C, H, W)`` images in [-1, 1].
        Raises ``ValueError`` when the prompt itself ends in ``<boi>`` with no room left in the context
        for the image (``P`` patches + ``<eoi>``), naming the sizes.
        """
        P = self.patches(model)
        doc: Document = list(prompt)
        images: list[Tensor] = []
        segments: list[list[int] | Tensor] = []
        budget = max_new_tokens
        while True:
            if doc and doc[-1] == self.boi_id:
                used = document_length(doc, P)
                if used + P + 1 > self.context:
                    raise ValueError(
                        f"<boi> at token {used} of a {self.context}-token context: the image needs {P} "
                        f"patches + <eoi> = {P + 1} tokens, {self.context - used} are left"
                    )
                stack = torch.stack(images) if images else None
                img = self._sample(
                    model, [doc], stack, process, sampler, steps, cfg_scale, generator, True, 0.0
                )
                images.append(img[0])
                segments.append(img[0])
                doc += [ImageSlot(len(images) - 1), self.eoi_id]
            if budget <= 0 or document_length(doc, P) >= self.context:
                break
            stack = torch.stack(images) if images else None
            new = self.continue_text(model, [doc], stack, budget, stop_at_boi=len(images) < max_images)[0]
            budget -= len(new)
            segments.append(new)
            doc += new
            if not new or new[-1] != self.boi_id:
                break
        return segments
