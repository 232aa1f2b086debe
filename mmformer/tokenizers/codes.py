"""Images as a grid of VQ code ids with a ``[MASK]`` id, for masked generative transformers (MaskGIT,
Chang et al. 2022, arXiv:2202.04200, §3.1; Muse, Chang et al. 2023, arXiv:2301.00704, §2): the data side
is a frozen VQ codec (``mmformer.tokenizers.vq.VQVAE``: images → ``(B, h·w)`` ids and back), the model
side embeds the ids (``K`` codes + ``[MASK]`` = id ``K``) with learned absolute positions — the
reference ``maskgit/nets/maskgit_transformer.py`` ``Embed`` — and prepends the condition:

- a class token (``LabelEmbedder``, with a null class for classifier-free guidance; MaskGIT §4.1
  class-conditional generation puts the class token in the sequence as well), or
- a caption prefix the task hands over (a frozen text encoder's tokens, projected; ``text_prefix``
  replaces a dropped caption by one learned null token).

The codec is kept frozen and in evaluation mode, and its weights are saved with the model, so a trained
checkpoint decodes its own samples.

Shape legend: B batch, N = h·w code positions (row-major), K codebook size, D width, L caption tokens.
"""

from __future__ import annotations

from dataclasses import replace

import torch
from torch import Tensor, nn

from ..nn.tokens import MODALITY_IDS, Tokens, cat_tokens
from .diffusion import LabelEmbedder


class MaskedCodeTokenizer(nn.Module):
    """VQ code ids (and ``[MASK]``) → Tokens, with an optional class-token prefix.

    Args:
        d_model: token width ``D``.
        codec: a frozen VQ codec with ``encode(images (B, C, H, W) in [-1, 1]) → (B, N) long``,
            ``decode(ids (B, N)) → (B, C, H, W)``, ``grid (h, w)``, ``codebook_size``, ``image_size``,
            ``in_chans`` (``mmformer.tokenizers.vq.VQVAE``).
        num_classes: class-conditional: a class token (a null class ``num_classes`` for guidance)
            precedes the codes; None = no class token.
        cond_dropout: the probability a training class (or caption) becomes the null one.
        text_conditional: a caption prefix from the task (``text_prefix``) with a learned null token.

    ``forward(ids (B, N) long in [0, K], labels (B,) long | None, force_drop (B,) bool | None) → Tokens``
    of ``(B, [1 +] N, D)``, the codes stamped with the image modality. Raises ``ValueError`` for ids of
    the wrong shape or outside ``[0, K]``, or labels given to a model without classes.
    """

    modality = "image"

    def __init__(
        self,
        d_model: int,
        codec: nn.Module,
        num_classes: int | None = None,
        cond_dropout: float = 0.1,
        text_conditional: bool = False,
    ):
        super().__init__()
        self.codec = codec.eval().requires_grad_(False)
        self.codebook_size = int(codec.codebook_size)
        self.grid = tuple(codec.grid)
        self.num_codes = self.grid[0] * self.grid[1]
        self.image_size, self.in_chans = int(codec.image_size), int(codec.in_chans)
        self.cond_dropout = cond_dropout
        self.tok_embed = nn.Embedding(self.codebook_size + 1, d_model)  # + [MASK]
        self.pos_embed = nn.Parameter(torch.zeros(1, self.num_codes, d_model))
        self.y_embedder = LabelEmbedder(num_classes, d_model, cond_dropout) if num_classes else None
        self.null_text = nn.Parameter(torch.zeros(d_model)) if text_conditional else None
        self.init_weights()

    def init_weights(self) -> None:
        """Truncated-normal(0.02) embeddings and positions (MaskGIT reference ``Embed``; BERT)."""
        nn.init.trunc_normal_(self.tok_embed.weight, std=0.02)
        nn.init.trunc_normal_(self.pos_embed, std=0.02)
        if self.null_text is not None:
            nn.init.trunc_normal_(self.null_text, std=0.02)

    def train(self, mode: bool = True) -> MaskedCodeTokenizer:
        super().train(mode)
        self.codec.eval()  # frozen: its norms / codebook statistics never update
        return self

    @property
    def mask_id(self) -> int:
        return self.codebook_size

    @property
    def num_classes(self) -> int | None:
        return self.y_embedder.num_classes if self.y_embedder is not None else None

    @property
    def num_prefix_tokens(self) -> int:
        return 1 if self.y_embedder is not None else 0

    def no_weight_decay(self) -> set[str]:
        return {"pos_embed"}

    def example_input(self, batch_size: int = 1) -> Tensor:
        return torch.full((batch_size, self.num_codes), self.mask_id, dtype=torch.long)

    # ------------------------------------------------------------------ the codec
    @torch.no_grad()
    def encode(self, images: Tensor) -> Tensor:
        """Images ``(B, C, H, W)`` — uint8, or float in [-1, 1] — → code ids ``(B, N)`` long."""
        if images.dtype == torch.uint8:
            images = images.float() / 127.5 - 1.0
        return self.codec.encode(images.float())

    @torch.no_grad()
    def decode(self, ids: Tensor) -> Tensor:
        """Code ids ``(B, N)`` long in [0, K) → images ``(B, C, H, W)`` float in [-1, 1]."""
        return self.codec.decode(ids).float().clamp(-1, 1)

    # ------------------------------------------------------------------ tokens
    def forward(self, ids: Tensor, labels: Tensor | None = None, force_drop: Tensor | None = None) -> Tokens:
        if ids.ndim != 2 or ids.shape[1] != self.num_codes:
            raise ValueError(
                f"expected code ids (B, {self.num_codes}) for a {self.grid[0]}×{self.grid[1]} grid, "
                f"got {tuple(ids.shape)}"
            )
        if ids.device.type == "cpu" and ids.numel() and (ids.min() < 0 or ids.max() > self.mask_id):
            raise ValueError(f"code ids must be in [0, {self.mask_id}] ({self.mask_id} = [MASK])")
        x = self.tok_embed(ids) + self.pos_embed.to(self.tok_embed.weight.dtype)  # (B, N, D)
        codes = Tokens.from_embeddings(x, MODALITY_IDS["image"])
        if self.y_embedder is None:
            if labels is not None:
                raise ValueError(
                    "this code tokenizer is not class-conditional (num_classes is None) but got labels"
                )
            return codes
        if labels is None:  # unconditional use of a conditional model: the null class, explicitly
            labels = torch.full(
                (ids.shape[0],), self.y_embedder.null_class, device=ids.device, dtype=torch.long
            )
        cls = self.y_embedder(labels, force_drop)[:, None]  # (B, 1, D)
        return _consecutive(cat_tokens([Tokens.from_embeddings(cls, MODALITY_IDS["image"]), codes]))

    def text_prefix(self, caption: Tokens, force_drop: Tensor | None = None) -> Tokens:
        """A caption prefix ``(B, L, D)`` with dropped rows — chosen in training with probability
        ``cond_dropout``, and wherever ``force_drop (B,)`` bool is True — replaced by the learned null
        token alone (position 0 real, the rest padding: the null prefix tells nothing, not even the
        caption's length). Raises ``ValueError`` on a model without ``text_conditional``."""
        if self.null_text is None:
            raise ValueError("this code tokenizer is not text-conditional (text_conditional: false)")
        B, L = caption.valid.shape
        drop = torch.zeros(B, dtype=torch.bool, device=caption.x.device)
        if self.training and self.cond_dropout > 0:
            drop = torch.rand(B, device=caption.x.device) < self.cond_dropout
        if force_drop is not None:
            drop = drop | force_drop.to(drop.device)
        first = torch.zeros(L, dtype=torch.bool, device=drop.device)
        first[0] = True
        x = torch.where(
            drop[:, None, None], self.null_text.to(caption.x.dtype).expand_as(caption.x), caption.x
        )
        valid = torch.where(drop[:, None], first[None].expand(B, L), caption.valid)
        return replace(caption, x=x, valid=valid)


def _consecutive(tokens: Tokens) -> Tokens:
    """Positions counting the row's real tokens 0, 1, … over a concatenated sequence."""
    pos = (tokens.valid.long().cumsum(dim=1) - 1).clamp_min(0)
    tokens.positions = pos.unsqueeze(-1).expand(*pos.shape, tokens.positions.shape[-1])
    return tokens


def prefixed(prefix: Tokens, codes: Tokens) -> Tokens:
    """``[prefix | codes]`` with consecutive positions over the real tokens and one document."""
    P = codes.positions.shape[-1]
    prefix = replace(prefix, positions=prefix.positions[..., :1].expand(*prefix.valid.shape, P))
    seq = _consecutive(cat_tokens([prefix, codes]))
    seq.document = torch.zeros_like(seq.document)
    return seq
