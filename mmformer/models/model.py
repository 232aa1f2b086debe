"""The composed multimodal model: ``tokenizers: dict + backbone + heads: dict`` (torchtune's
early-fusion model), optionally with per-modality ``towers`` (CLIP's separate image and text encoders).
Parameter names: ``tokenizers.<name>.*``, ``backbone.*``, ``towers.<tokenizer name>.*``, ``heads.<name>.*``.

Shape legend: B batch, N tokens, D model width.
"""

from __future__ import annotations

import inspect

import torch
from torch import Tensor, nn

from ..nn.kv_cache import KVCache
from ..nn.masks import require_bool
from ..nn.tokens import ConditionedTokens, Tokens
from ..tokenizers import Tokenizer
from .backbone import Backbone


class MultimodalModel(nn.Module):
    """Modality tokenizers feeding one shared backbone, read out by named heads.

    Args:
        tokenizers: name → model-side tokenizer (``mmformer.tokenizers.Tokenizer``: returns ``Tokens`` of
            its backbone's width; ``ConditionedTokens`` for a conditioning one, DiT).
        backbone: the shared ``Backbone``.
        heads: name → head module ``(hidden (B, N, D), tokens) → output``.
        towers: tokenizer name → a ``Backbone`` of its own that reads that tokenizer's tokens instead of
            the shared one (per-modality towers, e.g. a pretrained text encoder beside an image ViT).

    Raises ``TypeError`` for a tokenizer that does not satisfy ``Tokenizer``, ``ValueError`` for a tower
    that names no tokenizer.
    """

    def __init__(
        self,
        tokenizers: dict[str, Tokenizer],
        backbone: Backbone,
        heads: dict[str, nn.Module],
        towers: dict[str, Backbone] | None = None,
    ):
        super().__init__()
        for name, tok in tokenizers.items():
            if not isinstance(tok, Tokenizer):
                raise TypeError(
                    f"tokenizer {name!r} ({type(tok).__name__}) does not satisfy mmformer.tokenizers.Tokenizer "
                    "(modality, num_prefix_tokens, forward → Tokens, example_input)"
                )
        unknown = set(towers or {}) - set(tokenizers)
        if unknown:
            raise ValueError(f"towers {sorted(unknown)} name no tokenizer; tokenizers: {list(tokenizers)}")
        self.tokenizers = nn.ModuleDict(tokenizers)
        self.backbone = backbone
        self.towers = nn.ModuleDict(towers or {})
        self.heads = nn.ModuleDict(heads)
        self.register_state_dict_post_hook(_row_major_state)  # checkpoints never see the decode layout

    def backbone_of(self, tokenizer: str) -> Backbone:
        """The backbone that reads ``tokenizer``'s tokens: its tower, else the shared one."""
        return self.towers[tokenizer] if tokenizer in self.towers else self.backbone

    def encode(self, tokenizer: str, inputs: Tensor, cache=None, **tokenizer_kwargs) -> tuple[Tensor, Tokens]:
        """Tokenize ``inputs`` with ``tokenizers[tokenizer]`` (extra keyword arguments such as a text
        ``valid`` mask go to it) and run the backbone, appending to ``cache`` when given.

        ``valid`` is a bool mask, True = real token / sample. With a non-empty ``cache`` and no
        ``positions``, a tokenizer that takes positions (text) gets ``cache.next_positions(valid)``: each
        row continues from its cached real tokens, as HF's ``cache_position`` defaults to the past length
        (so ``model(ids[:, -1:], …, cache=c)`` after a prefill equals the full forward's last position).

        Returns ``(hidden (B, N, D), tokens)``. Raises ``KeyError`` naming the known tokenizers,
        ``TypeError`` for a ``valid`` that is not bool, ``ValueError`` for ``document`` ids with a
        non-empty cache and no ``positions`` (where each document restarts is the caller's to say), and
        the backbone's ``ValueError`` for a cached step whose positions restart.
        """
        hidden, tokens, _ = self._run(tokenizer, inputs, cache, tokenizer_kwargs)
        return hidden, tokens

    def _run(
        self, tokenizer: str, inputs: Tensor, cache, kwargs: dict, rows: slice | None = None
    ) -> tuple[Tensor, Tokens, Tensor | None]:
        if tokenizer not in self.tokenizers:
            raise KeyError(f"no tokenizer {tokenizer!r}; model has {list(self.tokenizers)}")
        if kwargs.get("valid") is not None:
            require_bool(kwargs["valid"], "valid")
        if cache is not None and cache.length and kwargs.get("positions") is None:
            kwargs = _continuing(self.tokenizers[tokenizer], inputs, cache, kwargs)
        tokens = self.tokenizers[tokenizer](inputs, **kwargs)
        cond = tokens.cond if isinstance(tokens, ConditionedTokens) else None  # DiT: (B, Dc)
        hidden = self.backbone_of(tokenizer)(
            tokens, cache=cache, rows=rows, **({"cond": cond} if cond is not None else {})
        )
        return hidden, tokens, cond

    def forward(self, inputs: Tensor, tokenizer: str, head: str, cache=None, **tokenizer_kwargs) -> Tensor:
        """``heads[head](backbone(tokenizers[tokenizer](inputs)))``. A conditioning tokenizer (DiT) returns
        ``ConditionedTokens``: their ``cond (B, Dc)`` then reaches the backbone's adaLN blocks and the head.
        ``cache``, ``valid`` and positions, and what is raised: as ``encode``.

        A head whose ``reads`` is a slice of the token axis (``ClassifierHead(pool="cls")``: the class
        token) gets only those rows, ``hidden (B, len(reads), D)``, and the backbone computes only them in
        its last block where it can (``Backbone.forward(rows=…)``); without a cache only."""
        rows = getattr(self.heads[head], "reads", None) if cache is None else None
        hidden, tokens, cond = self._run(tokenizer, inputs, cache, tokenizer_kwargs, rows)
        if cond is not None:
            return self.heads[head](hidden, tokens, cond)
        return self.heads[head](hidden, tokens)

    def for_decoding(self) -> MultimodalModel:
        """Evaluation mode with the shared backbone's CPU linear weights stored column-major, the layout
        the CPU's matrix kernels are fastest with for the few rows of KV-cache decoding (values
        unchanged; ``Backbone.for_decoding``). Called by every generation loop."""
        self.eval()
        self.backbone.for_decoding()
        return self

    def no_weight_decay(self) -> set[str]:
        """Full names of parameters exempt from weight decay besides norms and biases
        (position embeddings, class tokens), collected from sub-modules' ``no_weight_decay()``."""
        names: set[str] = set()
        for prefix, module in self.named_modules():
            if module is not self and hasattr(module, "no_weight_decay"):
                names |= {f"{prefix}.{n}" for n in module.no_weight_decay()}
        return names


def _continuing(tok: nn.Module, inputs: Tensor, cache: KVCache, kwargs: dict) -> dict:
    """``kwargs`` with ``positions`` that continue each row after ``cache`` (``KVCache.next_positions``)
    for a tokenizer whose ``forward`` takes ``positions`` (``inputs``: ids ``(B, N)``); unchanged for
    one that places its tokens itself (an image grid: the backbone checks those continue)."""
    if "positions" not in inspect.signature(tok.forward).parameters:
        return kwargs
    if kwargs.get("document") is not None:
        raise ValueError(
            "document ids with a non-empty KV cache: pass positions too (where each document restarts "
            "its positions after the cached tokens is the caller's to say)"
        )
    valid = kwargs.get("valid")
    if valid is None:
        valid = torch.ones(inputs.shape[:2], dtype=torch.bool, device=inputs.device)
    return {**kwargs, "positions": cache.next_positions(valid)}


def _row_major_state(module: nn.Module, state_dict: dict, prefix: str, local_metadata: dict) -> None:
    """State-dict hook: weights in the decode layout (``for_decoding``) are written row-major, so
    checkpoints and exports (safetensors needs contiguous tensors) never depend on a decode having run."""
    for k, v in state_dict.items():
        if k.startswith(prefix) and type(v) in (torch.Tensor, nn.Parameter) and not v.is_contiguous():
            state_dict[k] = v.contiguous()
