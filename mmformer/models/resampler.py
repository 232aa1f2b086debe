"""A Perceiver-style latent resampler between a tokenizer and the backbone: a fixed number of learned
latents cross-attend to any number of input tokens, so long inputs (minutes of audio, many image
patches) reach the backbone as a fixed token budget.

Flamingo's Perceiver Resampler (Alayrac et al. 2022, §2.1 and App. A.1.1, after Jaegle et al. 2021):
per layer, the latents attend to the concatenation of the (normalised) inputs and the latents
themselves, then pass an MLP; a final LayerNorm. Input padding (``valid`` False) is never read.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from ..nn.attention import Attention, AttentionInputs
from ..nn.masks import MaskSpec
from ..nn.mlp import Mlp
from ..nn.tokens import ConditionedTokens, Tokens


class PerceiverResampler(nn.Module):
    """Args:
        d_model: width ``D`` of the inputs and the latents.
        num_latents: ``L``, the number of output tokens.
        n_layers, n_heads, mlp_ratio, norm_eps: the layers' sizes.

    ``forward(x (B, N, D), valid (B, N) bool | None) → (B, L, D)``.
    """

    def __init__(
        self,
        d_model: int,
        num_latents: int = 64,
        n_layers: int = 2,
        n_heads: int = 8,
        mlp_ratio: float = 4.0,
        norm_eps: float = 1e-6,
    ):
        super().__init__()
        self.latents = nn.Parameter(torch.randn(num_latents, d_model) * 0.02)
        self.layers = nn.ModuleList(
            nn.ModuleDict(
                {
                    "norm_x": nn.LayerNorm(d_model, eps=norm_eps),
                    "norm_latents": nn.LayerNorm(d_model, eps=norm_eps),
                    "attn": Attention(d_model, n_heads, cross=True, qkv_bias=False, proj_bias=False),
                    "norm_mlp": nn.LayerNorm(d_model, eps=norm_eps),
                    "mlp": Mlp(d_model, int(d_model * mlp_ratio), bias=False),
                }
            )
            for _ in range(n_layers)
        )
        self.norm = nn.LayerNorm(d_model, eps=norm_eps)

    def no_weight_decay(self) -> set[str]:
        return {"latents"}

    def forward(self, x: Tensor, valid: Tensor | None = None) -> Tensor:
        B, L = x.shape[0], self.latents.shape[0]
        latents = self.latents.to(x.dtype)[None].repeat(
            B, 1, 1
        )  # a copy: a no-grad view would still "require grad"
        keys_valid = None
        if valid is not None:
            keys_valid = torch.cat([valid, valid.new_ones(B, L)], dim=1)
        inputs = AttentionInputs(context_mask=MaskSpec(valid=keys_valid))
        for layer in self.layers:
            q = layer["norm_latents"](latents)
            context = torch.cat([layer["norm_x"](x), q], dim=1)  # inputs and latents, as Flamingo
            latents = latents + layer["attn"](q, inputs, context=context)
            latents = latents + layer["mlp"](layer["norm_mlp"](latents))
        return self.norm(latents)


class ResampledTokenizer(nn.Module):
    """A tokenizer whose Tokens are compressed by a ``PerceiverResampler``: whatever the input length,
    ``L`` tokens come out, all valid, at positions ``0 … L-1`` (every position axis), one document, the
    tokenizer's modality. A conditioning tokenizer's ``ConditionedTokens`` keep their ``cond``."""

    num_prefix_tokens = 0  # no class token survives the resampling: heads pool over all latents

    def __init__(self, tokenizer: nn.Module, resampler: PerceiverResampler):
        super().__init__()
        self.tokenizer, self.resampler = tokenizer, resampler

    def __getattr__(self, name: str):
        try:
            return super().__getattr__(name)
        except AttributeError:  # example_input, sample_rate, num_classes, … of the wrapped tokenizer
            return getattr(super().__getattr__("tokenizer"), name)

    def forward(self, *args, **kwargs) -> Tokens:
        tokens = self.tokenizer(*args, **kwargs)
        x = self.resampler(tokens.x, None if bool(tokens.valid.all()) else tokens.valid)
        B, L = x.shape[:2]
        P = tokens.positions.shape[-1]
        positions = torch.arange(L, device=x.device).view(1, L, 1).expand(B, L, P)
        resampled = Tokens(
            x=x,
            valid=torch.ones(B, L, dtype=torch.bool, device=x.device),
            positions=positions,
            document=torch.zeros(B, L, dtype=torch.long, device=x.device),
            modality=tokens.modality[:, :1].expand(B, L),
        )
        return (
            ConditionedTokens.of(resampled, tokens.cond)
            if isinstance(tokens, ConditionedTokens)
            else resampled
        )
