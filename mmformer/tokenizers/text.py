"""Text tokenizer: byte-level BPE (Radford et al. 2019, GPT-2 §2.2; Sennrich et al. 2016) with HF
``tokenizers``.

Two halves (DESIGN.md):
  * data side — ``TextTokenizer``: trains a byte-level BPE on a corpus or loads a ``tokenizer.json``;
    encodes strings to ids and decodes them back losslessly (``decode(encode(s)) == s`` for any
    Unicode string: bytes are the base alphabet, nothing is normalised, no prefix space is added).
    Special tokens — ``bos``, ``eos``, ``pad`` and the modality placeholders ``<image>``, ``<audio>`` —
    are single ids, also when they appear inside text. ``pad`` is always its own id, never ``eos``,
    so a loss mask built from ``pad`` never hides a real end of text (a distinct ``<pad>`` is added to
    a user's tokenizer that has none or reuses ``eos``).
  * model side — ``TextEmbedding``: ids ``(B, N)`` → ``Tokens`` (token embedding, optional learned
    absolute positions as GPT-2's ``wpe``, optional BERT token types and embedding LayerNorm), with
    positions counted from each row's first real token.

Shape legend: B batch, N tokens, D model width, V vocabulary size.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from pathlib import Path

import torch
from torch import Tensor, nn

from ..nn.masks import require_bool
from ..nn.tied_embedding import embed
from ..nn.tokens import MODALITY_IDS, Tokens
from ..progress import shows

SPECIAL_TOKENS = {
    "bos": "<|bos|>",
    "eos": "<|eos|>",
    "pad": "<|pad|>",
    "image": "<image>",
    "audio": "<audio>",
}
MASK_TOKEN = "<|mask|>"  # masked language modelling's [MASK], in vocabularies trained for it
# an image's begin / end markers in mixed text–image sequences (Transfusion, Chameleon), in vocabularies
# trained for a task that reads them (its config says ``image_markers = True``)
IMAGE_MARKERS = {"boi": "<boi>", "eoi": "<eoi>"}


class TextTokenizer:
    """Byte-level BPE tokenizer with the special tokens mmformer relies on.

    Build one with ``TextTokenizer.train(texts, vocab_size)`` or ``TextTokenizer.from_file(path)``
    (``mmformer.models.pretrained`` builds them from GGUF vocabularies and HF directories).
    Attributes ``bos_id``, ``eos_id``, ``pad_id``, ``image_id``, ``audio_id``, ``vocab_size`` and
    ``chat_template`` (the Jinja template an instruct model carries, or None); ``mask_id`` (None unless
    the vocabulary has a mask token: trained with ``mask=True``, or BERT's ``[MASK]``); ``prompt`` /
    ``start_ids``: the tokens ``encode(bos=True)`` starts a text with (``[bos_id]`` unless a ``prompt``
    of special tokens is given: Whisper's).
    """

    def __init__(
        self,
        tokenizer,
        special: dict[str, str | None] | None = None,
        chat_template: str | None = None,
        prompt: list[str] | None = None,
    ):
        from tokenizers import AddedToken

        self.tokenizer = tokenizer
        self.chat_template = chat_template
        # the special tokens a text starts with when encoded with ``bos=True`` (default: ``bos`` alone);
        # Whisper's ``<|startoftranscript|> <|notimestamps|>``
        self.prompt = list(prompt) if prompt else None
        tokenizer.no_padding()  # mmformer pads itself (a BERT tokenizer.json may pad every text to 128)
        tokenizer.no_truncation()
        # ``None`` marks a special a pretrained vocabulary lacks: it is not invented (its id would have
        # no embedding row); only ``pad`` is always added, since padded ids are never looked up
        self.special = {**SPECIAL_TOKENS, **(special or {})}
        if self.special.get("pad") in (None, self.special.get("eos")):  # pad must never be eos
            self.special["pad"] = SPECIAL_TOKENS["pad"]
        missing = [t for t in self.special.values() if t is not None and tokenizer.token_to_id(t) is None]
        if missing:
            tokenizer.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in missing])
        self.mask_id = None
        for name, token in self.special.items():
            setattr(self, f"{name}_id", tokenizer.token_to_id(token) if token is not None else None)
        self.start_ids = [self.bos_id]  # what ``bos=True`` puts first
        if self.prompt:
            self.start_ids = [tokenizer.token_to_id(t) for t in self.prompt]
            if None in self.start_ids:
                raise ValueError(f"prompt {self.prompt} has tokens the vocabulary lacks")

    # ------------------------------------------------------------------ construction
    @classmethod
    def train(
        cls, texts: Iterable[str], vocab_size: int = 8192, min_frequency: int = 2, mask: bool = False
    ) -> TextTokenizer:
        """Train a byte-level BPE on ``texts`` (an iterable of documents or lines); ``mask`` adds the
        ``<|mask|>`` special (``mask_id``) that masked language modelling needs.

        ``vocab_size`` counts the 256 byte symbols and the special tokens. Raises ``ValueError`` when it
        is too small to hold them.
        """
        from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

        if vocab_size < 256 + len(SPECIAL_TOKENS):
            raise ValueError(
                f"vocab_size={vocab_size} cannot hold 256 bytes and {len(SPECIAL_TOKENS)} specials"
            )
        tok = Tokenizer(models.BPE())
        # GPT-2 pre-tokenisation on bytes; no prefix space, so encoding adds nothing to the text
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
        tok.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(
            vocab_size=vocab_size,
            min_frequency=min_frequency,
            special_tokens=list(SPECIAL_TOKENS.values()) + ([MASK_TOKEN] if mask else []),
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
            show_progress=shows(),  # HF's own bars (reading, merges); they stay off when not a terminal
        )
        tok.train_from_iterator(_as_iterator(texts), trainer=trainer)
        return cls(tok, {"mask": MASK_TOKEN} if mask else None)

    @classmethod
    def from_file(
        cls, path: str | Path, special: dict[str, str] | None = None, chat_template: str | None = None
    ) -> TextTokenizer:
        """Load a ``tokenizer.json`` (ours, or a user's byte-level BPE with its own special tokens:
        pass ``special={"bos": "<s>", "eos": "</s>", …}``). Raises ``FileNotFoundError``."""
        from tokenizers import Tokenizer

        path = Path(path)
        if not path.is_file():
            raise FileNotFoundError(f"tokenizer file {str(path)!r} does not exist")
        return cls(Tokenizer.from_file(str(path)), special, chat_template)

    def save(self, path: str | Path) -> None:
        self.tokenizer.save(str(path))

    def to_json(self) -> str:
        """The whole tokenizer as JSON text (stored in checkpoints, so they stand alone): the HF
        ``tokenizer.json`` plus mmformer's special-token names and the chat template."""
        import json

        return json.dumps(
            {
                "tokenizer": self.tokenizer.to_str(),
                "special": self.special,
                "chat_template": self.chat_template,
                "prompt": self.prompt,
            }
        )

    @classmethod
    def from_json(cls, text: str, special: dict[str, str] | None = None) -> TextTokenizer:
        """Inverse of ``to_json``; a bare HF ``tokenizer.json`` text is accepted too."""
        import json

        from tokenizers import Tokenizer

        data = json.loads(text)
        if "tokenizer" in data and "model" not in data:
            return cls(
                Tokenizer.from_str(data["tokenizer"]),
                special or data["special"],
                data["chat_template"],
                data.get("prompt"),
            )
        return cls(Tokenizer.from_str(text), special)

    def apply_chat_template(self, messages: list[dict[str, str]], add_generation_prompt: bool = True) -> str:
        """Render ``messages`` (``[{"role": "user", "content": "…"}]``) with the model's Jinja chat
        template, as transformers' ``apply_chat_template(tokenize=False)`` does (sandboxed Jinja,
        ``trim_blocks`` and ``lstrip_blocks``). Raises ``ValueError`` when the tokenizer has none."""
        if not self.chat_template:
            raise ValueError("this tokenizer has no chat template (base models usually have none)")
        from jinja2.exceptions import TemplateError
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        def raise_exception(message):
            raise TemplateError(message)

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        env.globals["raise_exception"] = raise_exception
        return env.from_string(self.chat_template).render(
            messages=messages,
            add_generation_prompt=add_generation_prompt,
            bos_token=self.special.get("bos", ""),
            eos_token=self.special.get("eos", ""),
        )

    # ------------------------------------------------------------------ use
    @property
    def vocab_size(self) -> int:
        return self.tokenizer.get_vocab_size(with_added_tokens=True)

    def _check(self, bos: bool, eos: bool) -> None:
        for name, wanted in (("bos", bos), ("eos", eos)):
            if wanted and getattr(self, f"{name}_id") is None:
                raise ValueError(f"this tokenizer has no {name} token")

    def encode(self, text: str, bos: bool = False, eos: bool = False) -> list[int]:
        """``text`` → ids; special-token strings inside ``text`` become their single ids; ``bos`` puts
        ``start_ids`` (``bos``, or the ``prompt``) first. Raises ``ValueError`` when ``bos`` / ``eos`` is
        asked of a vocabulary without one."""
        self._check(bos, eos)
        ids = self.tokenizer.encode(text, add_special_tokens=False).ids
        return (self.start_ids if bos else []) + ids + ([self.eos_id] if eos else [])

    def encode_batch(self, texts: list[str], bos: bool = False, eos: bool = False) -> list[list[int]]:
        self._check(bos, eos)
        out = self.tokenizer.encode_batch(texts, add_special_tokens=False)
        return [(self.start_ids if bos else []) + e.ids + ([self.eos_id] if eos else []) for e in out]

    def decode(self, ids: Iterable[int], skip_special: bool = False) -> str:
        """ids → text; with ``skip_special`` the bos / eos / pad / placeholder tokens are dropped."""
        return self.tokenizer.decode(list(ids), skip_special_tokens=skip_special)

    def pad_batch(self, seqs: list[list[int]], side: str = "right") -> tuple[Tensor, Tensor]:
        """Pad to the longest sequence: ``ids (B, N)`` long and ``valid (B, N)`` bool (True = real).
        ``side="left"`` for prompts to continue (generation)."""
        n = max((len(s) for s in seqs), default=0)
        ids = torch.full((len(seqs), n), self.pad_id, dtype=torch.long)
        valid = torch.zeros(len(seqs), n, dtype=torch.bool)
        for i, s in enumerate(seqs):
            sl = slice(n - len(s), n) if side == "left" else slice(0, len(s))
            ids[i, sl] = torch.tensor(s, dtype=torch.long)
            valid[i, sl] = True
        return ids, valid


def _as_iterator(texts: Iterable[str]) -> Iterator[str]:
    yield from texts


class TextEmbedding(nn.Module):
    """Token ids → Tokens: ``embed`` lookup, plus learned absolute positions ``pos_embed`` when
    ``max_len`` is given (GPT-2's ``wpe``; leave it None for RoPE / ALiBi models).

    Args:
        vocab_size: ``V``; d_model: ``D``; max_len: longest position with a learned embedding.
        n_pos_axes: position axes ``P`` of the model (the 1-D index is repeated on each).
        type_vocab_size: BERT token types (segments) ``type_embed``; 0 for none.
        norm, norm_eps, drop: LayerNorm and dropout over the summed embeddings (BERT's ``embeddings.LayerNorm``).
        class_token: prepend a learned ``cls_token`` to every row (position 0; the ids take 1..N), as the
            Long Range Arena's encoders do for ``classifier_pool="CLS"`` (``lra_benchmarks/models/
            transformer``): a head with ``pool="cls"`` reads it, mean pooling skips it.

    ``forward(ids (B, N) long, valid (B, N) bool | None) → Tokens`` of ``N`` tokens (``N + 1`` with the
    class token); positions count from each row's first real token (left padding keeps positions). Raises
    ``ValueError`` beyond ``max_len`` (the class token's position counts), or for the class token with
    explicit ``positions`` or packed ``document`` ids.
    """

    modality = "text"

    def __init__(
        self,
        vocab_size: int,
        d_model: int,
        max_len: int | None = None,
        n_pos_axes: int = 1,
        type_vocab_size: int = 0,
        norm: bool = False,
        norm_eps: float = 1e-12,
        drop: float = 0.0,
        class_token: bool = False,
    ):
        super().__init__()
        self.vocab_size, self.max_len, self.n_pos_axes = vocab_size, max_len, n_pos_axes
        self.num_prefix_tokens = int(class_token)
        self.cls_token = nn.Parameter(torch.zeros(1, 1, d_model)) if class_token else None
        self.embed = nn.Embedding(vocab_size, d_model)
        self.pos_embed = nn.Embedding(max_len, d_model) if max_len else None
        self.type_embed = nn.Embedding(type_vocab_size, d_model) if type_vocab_size else None
        self.norm = nn.LayerNorm(d_model, eps=norm_eps) if norm else nn.Identity()
        self.drop = nn.Dropout(drop)
        self.init_weights()

    def init_weights(self) -> None:
        """GPT-2 init: normal(0.02) token, position and token-type embeddings; timm's ``cls_token`` init."""
        for emb in (self.embed, self.pos_embed, self.type_embed):
            if emb is not None:
                nn.init.normal_(emb.weight, std=0.02)
        if self.cls_token is not None:
            nn.init.normal_(self.cls_token, std=1e-6)

    def no_weight_decay(self) -> set[str]:
        return {"pos_embed.weight", "type_embed.weight", "cls_token"}

    def example_input(self, batch_size: int = 1, length: int | None = None) -> Tensor:
        """Zero ids ``(batch_size, length)``, ``length`` defaulting to the most that fit ``max_len`` (one
        fewer with the class token) or 256 (FLOP counting)."""
        longest = self.max_len - self.num_prefix_tokens if self.max_len else 256
        return torch.zeros(batch_size, length or longest, dtype=torch.long)

    def forward(
        self,
        ids: Tensor,
        valid: Tensor | None = None,
        positions: Tensor | None = None,
        document: Tensor | None = None,
        token_type: Tensor | None = None,
    ) -> Tokens:
        """``document (B, N)``: packed-sequence ids; positions then restart at each document.
        ``token_type (B, N)`` long: BERT's segment ids (default 0). Padded ids are never looked up, so a
        pad id outside the embedding (one added to a pretrained vocabulary) is harmless. Raises
        ``TypeError`` for a ``valid`` that is not bool (True = real token)."""
        if valid is not None:
            ids = ids.masked_fill(~require_bool(valid, "valid"), 0)
        x = embed(self.embed, ids)  # (B, N, D); the gradient joins a tied LM head's (nn.tied_embedding)
        if self.cls_token is not None:
            x, valid = self._prepend_class_token(x, valid, positions, document)
        tokens = Tokens.from_embeddings(
            x, MODALITY_IDS["text"], valid=valid, positions=positions, n_pos_axes=self.n_pos_axes
        )
        if document is not None:  # attention stops at each document, and positions restart there
            tokens.document = document
            if positions is None:
                starts = torch.nn.functional.pad(document[:, 1:] != document[:, :-1], (1, 0), value=True)
                idx = torch.arange(ids.shape[1], device=ids.device).expand_as(document)
                first = torch.cummax(torch.where(starts, idx, torch.zeros_like(idx)), dim=1).values
                tokens.positions = (idx - first).unsqueeze(-1).expand(-1, -1, self.n_pos_axes)
        if self.pos_embed is not None:
            pos = tokens.positions[..., 0]
            # positions counted here are below the sequence's length: the shape proves they fit, with no
            # read of the device's data (a host sync on a GPU, a graph break under torch.compile)
            if (positions is not None or x.shape[1] > self.max_len) and int(pos.max()) >= self.max_len:
                raise ValueError(
                    f"position {int(pos.max())} is beyond max_len={self.max_len} of the text embedding"
                )
            x = x + self.pos_embed(pos)
        if self.type_embed is not None:
            x = x + self.type_embed(token_type if token_type is not None else torch.zeros_like(ids))
        tokens.x = self.drop(self.norm(x))
        return tokens

    def _prepend_class_token(
        self, x: Tensor, valid: Tensor | None, positions: Tensor | None, document: Tensor | None
    ) -> tuple[Tensor, Tensor | None]:
        """``(B, N, D)`` embeddings → ``(B, 1 + N, D)`` with ``cls_token`` first, and ``valid`` to match
        (the class token is always valid, so left-padded rows count positions from it)."""
        if positions is not None or document is not None:
            raise ValueError("class_token=True numbers positions itself: pass neither positions nor document")
        B = x.shape[0]
        x = torch.cat([self.cls_token.to(x.dtype).expand(B, -1, -1), x], dim=1)
        if valid is not None:
            valid = torch.cat([valid.new_ones(B, 1), valid], dim=1)
        return x, valid
