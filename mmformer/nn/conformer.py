"""The Conformer block (Gulati et al. 2020, "Conformer: Convolution-augmented Transformer for Speech
Recognition", §2 and Fig. 1): half-step feed-forward, self-attention, convolution module, half-step
feed-forward, final LayerNorm ("macaron" style). Matches torchaudio's ``ConformerLayer`` (tested with
copied weights) except that padded frames are zeroed before the depthwise convolution, so padding
changes nothing (torchaudio's lets padding leak into the frames next to it).
"""

from __future__ import annotations

from torch import Tensor, nn

from .attention import Attention, AttentionInputs, KVCache


class ConformerFeedForward(nn.Module):
    """LayerNorm → Linear (D → hidden) → SiLU → dropout → Linear (hidden → D) → dropout."""

    def __init__(self, d_model: int, hidden_dim: int, drop: float = 0.0, norm_eps: float = 1e-5):
        super().__init__()
        self.norm = nn.LayerNorm(d_model, eps=norm_eps)
        self.fc1, self.act, self.fc2 = (
            nn.Linear(d_model, hidden_dim),
            nn.SiLU(),
            nn.Linear(hidden_dim, d_model),
        )
        self.drop = nn.Dropout(drop)

    def forward(self, x: Tensor) -> Tensor:
        return self.drop(self.fc2(self.drop(self.act(self.fc1(self.norm(x))))))


class ConvolutionModule(nn.Module):
    """LayerNorm → pointwise conv (D → 2D) → GLU → depthwise conv (``kernel_size``, odd, "same") →
    BatchNorm → SiLU → pointwise conv → dropout, over the sequence axis. ``valid (B, N)``: padded
    frames are zeroed before the depthwise convolution, which alone mixes neighbouring frames.
    Raises ``ValueError`` for an even ``kernel_size``."""

    def __init__(self, d_model: int, kernel_size: int = 31, drop: float = 0.0, norm_eps: float = 1e-5):
        super().__init__()
        if kernel_size % 2 == 0:
            raise ValueError(f"conv_kernel must be odd ('same' padding), got {kernel_size}")
        self.norm = nn.LayerNorm(d_model, eps=norm_eps)
        self.pointwise_in = nn.Conv1d(d_model, 2 * d_model, 1)
        self.glu = nn.GLU(dim=1)
        self.depthwise = nn.Conv1d(
            d_model, d_model, kernel_size, padding=(kernel_size - 1) // 2, groups=d_model
        )
        self.batch_norm = nn.BatchNorm1d(d_model)
        self.act = nn.SiLU()
        self.pointwise_out = nn.Conv1d(d_model, d_model, 1)
        self.drop = nn.Dropout(drop)

    def forward(self, x: Tensor, valid: Tensor | None = None) -> Tensor:
        h = self.glu(self.pointwise_in(self.norm(x).transpose(1, 2)))  # (B, D, N)
        if valid is not None:
            h = h * valid[:, None, :].to(h.dtype)
        h = self.act(self.batch_norm(self.depthwise(h)))
        return self.drop(self.pointwise_out(h).transpose(1, 2))


class ConformerBlock(nn.Module):
    """``x + ½·FF(x)``, ``x + MHSA(LN(x))``, ``x + Conv(x)``, ``x + ½·FF(x)``, ``LN``. The attention is the
    backbone's (its kernels, masks and relative positions: RoPE stands in for the paper's Transformer-XL
    relative encoding). Args: ``d_model``, ``attn``, ``hidden_dim`` (feed-forward width), ``conv_kernel``,
    ``drop``, ``norm_eps``."""

    def __init__(
        self,
        d_model: int,
        attn: Attention,
        hidden_dim: int,
        conv_kernel: int = 31,
        drop: float = 0.0,
        norm_eps: float = 1e-5,
    ):
        super().__init__()
        self.ffn1 = ConformerFeedForward(d_model, hidden_dim, drop, norm_eps)
        self.norm_attn, self.attn, self.drop_attn = (
            nn.LayerNorm(d_model, eps=norm_eps),
            attn,
            nn.Dropout(drop),
        )
        self.conv = ConvolutionModule(d_model, conv_kernel, drop, norm_eps)
        self.ffn2 = ConformerFeedForward(d_model, hidden_dim, drop, norm_eps)
        self.norm_out = nn.LayerNorm(d_model, eps=norm_eps)

    def forward(
        self,
        x: Tensor,
        inputs: AttentionInputs | None = None,
        *,
        context: Tensor | None = None,
        cond: Tensor | None = None,
        cache: KVCache | None = None,
        layer: int = 0,
    ) -> Tensor:
        valid = inputs.mask.valid if inputs is not None else None
        x = x + 0.5 * self.ffn1(x)
        x = x + self.drop_attn(self.attn(self.norm_attn(x), inputs, cache=cache, layer=layer))
        x = x + self.conv(x, valid)
        x = x + 0.5 * self.ffn2(x)
        return self.norm_out(x)
