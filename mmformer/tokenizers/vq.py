"""VQ image tokenizer: a convolutional VQ-VAE that turns an image into a grid of discrete codes and back.

* VQ-VAE (van den Oord et al. 2017, arXiv:1711.00937, §3.1–3.2): encoder → nearest codebook entry →
  decoder; the straight-through estimator copies the decoder's gradient to the encoder output; the loss
  is reconstruction + codebook term ``‖sg[z] − q‖²`` + β · commitment term ``‖z − sg[q]‖²`` (β = 0.25).
* Factorised, L2-normalised codes (ViT-VQGAN, Yu et al. 2022, arXiv:2110.04627, §3.2): the encoder
  output is projected to a low-dimensional space (``code_dim``, e.g. 8), both it and the codebook are
  L2-normalised, and the lookup is the nearest code by cosine similarity (= Euclidean distance between
  unit vectors); the chosen code is projected back up for the decoder. The paper reports that this
  keeps most codes in use and improves reconstructions.
* Dead-code restarts (Jukebox, Dhariwal et al. 2020, arXiv:2005.00341, §3.2 "random restarts"; the
  restart-from-batch form of Zeghidour et al. 2021 SoundStream §3.3): a code no batch has chosen for
  ``restart_after`` training steps is replaced by a (normalised) encoder output of the current batch.
  Under ``torch.distributed`` the code counts are summed over ranks and the replacements broadcast from
  rank 0, so every replica keeps the same codebook.

Encoder / decoder: the residual conv stacks of taming-transformers' VQGAN (Esser et al. 2021), small:
``len(channels)`` stride-2 levels, so 28×28 → 7×7 (mnist5k) and 32×32 → 8×8 (emoji) with two levels.

Two modules here: ``VQVAE`` (the codec: ``encode`` / ``decode`` / ``forward``; trained by the ``vq``
task, ``mmformer.tasks.vq``) and ``VQTokenizer`` (the model-side tokenizer: a frozen or trained codec
whose code ids are embedded into ``Tokens`` for a backbone). ``load_vq`` reads the codec of a trained
``vq`` run's checkpoint.

Images everywhere are float in [-1, 1] (as the DiT task's); ``uint8`` pixels (0–255, what the data
side gives) are scaled here. Code ids are row-major over the ``h × w`` grid.

Shape legend: B batch, C image channels, H×W pixels, h×w code grid, N = h·w codes, d latent width
(``d_latent``), c code width (``code_dim``), K codebook size, D token width.
"""

from __future__ import annotations

import inspect
import math
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
import yaml
from torch import Tensor, nn

from ..nn.tokens import MODALITY_IDS, Tokens


def to_unit_range(images: Tensor) -> Tensor:
    """``uint8`` pixels → float in [-1, 1]; float input is returned as is."""
    return images.float() / 127.5 - 1.0 if images.dtype == torch.uint8 else images


def _groups(channels: int) -> int:
    return math.gcd(channels, 8)  # GroupNorm groups: 8 where the width allows it


class ResBlock(nn.Module):
    """``x + conv(SiLU(GN(conv(SiLU(GN(x))))))`` (VQGAN's ``ResnetBlock``, without dropout); a 1×1
    ``skip`` conv when the width changes. ``(B, c_in, H, W)`` → ``(B, c_out, H, W)``."""

    def __init__(self, c_in: int, c_out: int):
        super().__init__()
        self.norm1, self.conv1 = nn.GroupNorm(_groups(c_in), c_in), nn.Conv2d(c_in, c_out, 3, padding=1)
        self.norm2, self.conv2 = nn.GroupNorm(_groups(c_out), c_out), nn.Conv2d(c_out, c_out, 3, padding=1)
        self.skip = nn.Conv2d(c_in, c_out, 1) if c_in != c_out else nn.Identity()

    def forward(self, x: Tensor) -> Tensor:
        h = self.conv1(F.silu(self.norm1(x)))
        return self.skip(x) + self.conv2(F.silu(self.norm2(h)))


class Encoder(nn.Module):
    """``(B, C, H, W)`` → ``(B, d, H / 2^L, W / 2^L)``, ``L = len(channels)`` stride-2 levels."""

    def __init__(self, in_chans: int, channels: tuple[int, ...], num_res_blocks: int, d_latent: int):
        super().__init__()
        self.conv_in = nn.Conv2d(in_chans, channels[0], 3, padding=1)
        layers, c = [], channels[0]
        for width in channels:
            for _ in range(num_res_blocks):
                layers.append(ResBlock(c, width))
                c = width
            layers.append(nn.Conv2d(c, c, 3, stride=2, padding=1))  # halves H and W
        self.down = nn.Sequential(*layers)
        self.mid = ResBlock(c, c)
        self.norm_out = nn.GroupNorm(_groups(c), c)
        self.conv_out = nn.Conv2d(c, d_latent, 1)

    def forward(self, x: Tensor) -> Tensor:
        h = self.mid(self.down(self.conv_in(x)))
        return self.conv_out(F.silu(self.norm_out(h)))


class Decoder(nn.Module):
    """``(B, d, h, w)`` → ``(B, C, h · 2^L, w · 2^L)``: the encoder mirrored, nearest-neighbour ×2
    upsampling followed by a 3×3 conv at each level (VQGAN's ``Upsample``)."""

    def __init__(self, in_chans: int, channels: tuple[int, ...], num_res_blocks: int, d_latent: int):
        super().__init__()
        c = channels[-1]
        self.conv_in = nn.Conv2d(d_latent, c, 3, padding=1)
        self.mid = ResBlock(c, c)
        layers = []
        for width in reversed(channels):
            layers += [nn.Upsample(scale_factor=2, mode="nearest"), nn.Conv2d(c, c, 3, padding=1)]
            for _ in range(num_res_blocks):
                layers.append(ResBlock(c, width))
                c = width
        self.up = nn.Sequential(*layers)
        self.norm_out = nn.GroupNorm(_groups(c), c)
        self.conv_out = nn.Conv2d(c, in_chans, 3, padding=1)

    def forward(self, z: Tensor) -> Tensor:
        h = self.up(self.mid(self.conv_in(z)))
        return self.conv_out(F.silu(self.norm_out(h)))


@dataclass
class Quantized:
    """What ``FactorizedQuantizer`` returns: ``z_q (B, d, h, w)`` — the chosen codes projected back up,
    carrying the straight-through gradient to the encoder; ``ids (B, N)`` long; ``codebook_loss`` and
    ``commitment_loss`` — scalar MSEs between the normalised encoder outputs and their codes; ``counts
    (K,)`` — how often each code was chosen in this batch."""

    z_q: Tensor
    ids: Tensor
    codebook_loss: Tensor
    commitment_loss: Tensor
    counts: Tensor


class FactorizedQuantizer(nn.Module):
    """Nearest-code lookup in a low-dimensional, L2-normalised space (ViT-VQGAN §3.2).

    Args:
        d_latent: width ``d`` of the encoder output and decoder input.
        codebook_size: number of codes ``K``.
        code_dim: width ``c`` of the lookup space (``in_proj``: d → c, ``out_proj``: c → d).
        restart_after: training steps a code may go unchosen before it is restarted from the current
            batch's encoder outputs; 0 = never.

    ``codebook (K, c)`` is stored unnormalised and normalised at every use. Buffer ``unused_steps (K,)``
    counts the training steps since each code was last chosen (saved with the weights, so a resumed run
    continues it). Restarts happen only in training mode with gradients enabled (a frozen codec never
    changes: its codebook does not require grad).
    """

    def __init__(self, d_latent: int, codebook_size: int, code_dim: int, restart_after: int = 100):
        super().__init__()
        self.codebook_size, self.code_dim, self.restart_after = codebook_size, code_dim, restart_after
        self.in_proj = nn.Linear(d_latent, code_dim)
        self.out_proj = nn.Linear(code_dim, d_latent)
        self.codebook = nn.Parameter(torch.randn(codebook_size, code_dim))
        self.register_buffer("unused_steps", torch.zeros(codebook_size, dtype=torch.long))

    def normalized_codebook(self) -> Tensor:
        """``(K, c)`` unit vectors."""
        return F.normalize(self.codebook, dim=-1)

    def project(self, z: Tensor) -> Tensor:
        """Encoder output ``(B, d, h, w)`` → unit vectors in the lookup space ``(B, N, c)``."""
        return F.normalize(self.in_proj(z.flatten(2).transpose(1, 2)), dim=-1)  # (B, h·w, c)

    def nearest(self, z: Tensor) -> Tensor:
        """Unit vectors ``(..., c)`` → the id of the nearest normalised code ``(...)`` long (the largest
        cosine similarity, i.e. the smallest Euclidean distance between unit vectors; ties → lowest id)."""
        return (z @ self.normalized_codebook().t()).argmax(-1)

    def lookup(self, ids: Tensor, grid: tuple[int, int]) -> Tensor:
        """Code ids ``(B, N)`` → decoder input ``(B, d, h, w)`` (the normalised codes projected up)."""
        q = self.normalized_codebook()[ids]  # (B, N, c)
        return self._up(q, grid)

    def _up(self, q: Tensor, grid: tuple[int, int]) -> Tensor:
        B, N, _ = q.shape
        return self.out_proj(q).transpose(1, 2).reshape(B, -1, *grid)  # (B, d, h, w)

    def forward(self, z: Tensor) -> Quantized:
        grid = tuple(z.shape[-2:])
        z_c = self.project(z)  # (B, N, c), unit vectors
        ids = self.nearest(z_c.detach())  # (B, N)
        q = self.normalized_codebook()[ids]  # (B, N, c)
        codebook_loss = F.mse_loss(q, z_c.detach())  # moves the codes to the encoder outputs
        commitment_loss = F.mse_loss(z_c, q.detach())  # keeps the encoder near its codes
        z_st = z_c + (q - z_c).detach()  # straight-through: value q, gradient of z_c
        counts = torch.bincount(ids.flatten(), minlength=self.codebook_size)
        if (
            self.training
            and self.restart_after > 0
            and torch.is_grad_enabled()
            and self.codebook.requires_grad
        ):
            counts = self._restart_dead(z_c.detach(), counts)
        return Quantized(self._up(z_st, grid), ids, codebook_loss, commitment_loss, counts)

    @torch.no_grad()
    def _restart_dead(self, z_c: Tensor, counts: Tensor) -> Tensor:
        """Count this step's use of every code (summed over ranks) and move the codes unused for
        ``restart_after`` steps onto random encoder outputs of this batch (rank 0's under DDP). Returns
        the summed counts."""
        distributed = torch.distributed.is_available() and torch.distributed.is_initialized()
        if distributed:
            torch.distributed.all_reduce(counts)
        self.unused_steps.add_(1).masked_fill_(counts > 0, 0)
        dead = self.unused_steps >= self.restart_after  # (K,), the same on every rank
        n = int(dead.sum())
        if n:
            flat = z_c.reshape(-1, z_c.shape[-1])  # (B·N, c)
            pick = torch.randint(0, flat.shape[0], (n,), device=flat.device)
            # a little noise, so two codes restarted on the same vector do not tie forever
            new = F.normalize(flat[pick] + 0.01 * torch.randn_like(flat[pick]), dim=-1)
            if distributed:
                torch.distributed.broadcast(new, src=0)
            self.codebook.data[dead] = new.to(self.codebook.dtype)
            self.unused_steps[dead] = 0
        return counts


@dataclass
class VQOutput:
    """``VQVAE.forward``'s result.

    Attributes:
        recon: ``(B, C, H, W)`` float, the decoder output (not clamped: the loss sees it raw).
        ids: ``(B, N)`` long code ids, row-major.
        codebook_loss, commitment_loss: scalar MSEs in the normalised code space (van den Oord §3.2).
        perplexity: scalar, ``exp(H(p))`` of this batch's code frequencies ``p`` (K when uniform, 1 when
            one code is used everywhere).
        usage: scalar, the fraction of the K codes this batch chose at least once.
        counts: ``(K,)`` long, how often each code was chosen (summed over ranks in DDP training).
    """

    recon: Tensor
    ids: Tensor
    codebook_loss: Tensor
    commitment_loss: Tensor
    perplexity: Tensor
    usage: Tensor
    counts: Tensor


def code_perplexity(counts: Tensor) -> Tensor:
    """``exp(−Σ p log p)`` of code counts ``(K,)`` (``p = counts / Σ counts``); 0 · log 0 = 0."""
    p = counts.float() / counts.sum().clamp_min(1)
    return torch.exp(-(p * torch.log(p.clamp_min(1e-12))).sum())


class VQVAE(nn.Module):
    """Image ↔ ``h × w`` grid of code ids.

    Args:
        image_size: square side ``H = W`` in pixels; divisible by ``2 ** len(channels)``.
        in_chans: image channels ``C`` (1 grayscale, 3 RGB).
        channels: widths of the encoder's stride-2 levels (the decoder mirrors them).
        num_res_blocks: residual blocks per level.
        d_latent: width of the encoder output / decoder input.
        codebook_size: number of codes ``K``.
        code_dim: width of the normalised lookup space (ViT-VQGAN uses 8–32).
        restart_after: training steps before an unchosen code is restarted (0 = never).

    Attributes ``image_size``, ``in_chans``, ``grid = (h, w)``, ``codebook_size``; ``config`` holds the
    arguments (what ``load_vq`` rebuilds from).

    Raises ``ValueError`` for an ``image_size`` the levels do not divide, or sizes below 1.
    """

    def __init__(
        self,
        image_size: int = 28,
        in_chans: int = 1,
        channels: tuple[int, ...] = (32, 64),
        num_res_blocks: int = 1,
        d_latent: int = 32,
        codebook_size: int = 512,
        code_dim: int = 8,
        restart_after: int = 100,
    ):
        super().__init__()
        channels = tuple(int(c) for c in channels)
        sizes = dict(image_size=image_size, in_chans=in_chans, d_latent=d_latent, codebook_size=codebook_size)
        sizes.update(code_dim=code_dim, num_res_blocks=num_res_blocks)
        bad = {k: v for k, v in sizes.items() if v < 1}
        if bad or not channels or min(channels) < 1 or restart_after < 0:
            raise ValueError(f"VQVAE sizes must be positive (restart_after >= 0): {bad or channels}")
        factor = 2 ** len(channels)
        if image_size % factor:
            raise ValueError(
                f"image_size={image_size} is not divisible by 2**len(channels)={factor} "
                f"({len(channels)} stride-2 levels)"
            )
        self.image_size, self.in_chans, self.codebook_size = image_size, in_chans, codebook_size
        self.grid = (image_size // factor, image_size // factor)
        self.config = dict(sizes, channels=list(channels), restart_after=restart_after)
        self.encoder = Encoder(in_chans, channels, num_res_blocks, d_latent)
        self.quantizer = FactorizedQuantizer(d_latent, codebook_size, code_dim, restart_after)
        self.decoder = Decoder(in_chans, channels, num_res_blocks, d_latent)

    @property
    def num_codes(self) -> int:
        """Codes per image, ``N = h · w``."""
        return self.grid[0] * self.grid[1]

    def _check(self, images: Tensor) -> Tensor:
        shape = (self.in_chans, self.image_size, self.image_size)
        if images.dim() != 4 or tuple(images.shape[1:]) != shape:
            raise ValueError(
                f"VQVAE expects images (B, {', '.join(map(str, shape))}), got {tuple(images.shape)}"
            )
        return to_unit_range(images).to(self.quantizer.codebook.dtype)

    def encode(self, images: Tensor) -> Tensor:
        """Images ``(B, C, H, W)`` float in [-1, 1] (or ``uint8`` 0–255) → code ids ``(B, h·w)`` long,
        row-major. Raises ``ValueError`` on a wrong shape."""
        z = self.encoder(self._check(images))
        return self.quantizer.nearest(self.quantizer.project(z))

    def decode(self, ids: Tensor) -> Tensor:
        """Code ids ``(B, h·w)`` long → images ``(B, C, H, W)`` float, clamped to [-1, 1]. Raises
        ``ValueError`` for a wrong shape or ids outside ``[0, K)``."""
        if ids.dim() != 2 or ids.shape[1] != self.num_codes:
            raise ValueError(f"VQVAE.decode expects ids (B, {self.num_codes}), got {tuple(ids.shape)}")
        if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= self.codebook_size):
            raise ValueError(
                f"code ids must be in [0, {self.codebook_size}), got [{int(ids.min())}, {int(ids.max())}]"
            )
        return self.decoder(self.quantizer.lookup(ids, self.grid)).clamp(-1, 1)

    def forward(self, images: Tensor) -> VQOutput:
        """Encode, quantise (straight-through), decode. ``decode(encode(x))`` equals ``forward(x).recon``
        clamped to [-1, 1] (the straight-through value is the code itself), up to float rounding."""
        z = self.encoder(self._check(images))
        q = self.quantizer(z)
        recon = self.decoder(q.z_q)
        perplexity = code_perplexity(q.counts)
        usage = (q.counts > 0).float().mean()
        return VQOutput(recon, q.ids, q.codebook_loss, q.commitment_loss, perplexity, usage, q.counts)


class VQTokenizer(nn.Module):
    """The model side of the VQ image tokenizer: images → code ids (the codec) → ``Tokens``.

    Args:
        vq: the codec (trained by a ``vq`` task in the same recipe, or loaded frozen with ``load_vq``).
        d_model: token width ``D``.

    ``forward(inputs) → Tokens``: ``inputs`` are images ``(B, C, H, W)`` (``uint8`` or float in [-1, 1])
    or code ids ``(B, N)`` long. ``x (B, N, D)`` = code embedding + learned position embedding;
    positions ``(B, N, 2)``: (row, column) of each code. The ids carry no gradient to the codec.
    Raises ``ValueError`` on a wrong input shape.
    """

    modality = "image"
    num_prefix_tokens = 0

    def __init__(self, vq: VQVAE, d_model: int):
        super().__init__()
        self.vq = vq
        self.image_size, self.in_chans = vq.image_size, vq.in_chans
        self.embed = nn.Embedding(vq.codebook_size, d_model)
        self.pos_embed = nn.Parameter(torch.zeros(1, vq.num_codes, d_model))
        h, w = vq.grid
        rows, cols = torch.meshgrid(torch.arange(h), torch.arange(w), indexing="ij")
        self.register_buffer(
            "grid_positions", torch.stack([rows.flatten(), cols.flatten()], -1), persistent=False
        )  # (N, 2)
        self.init_weights()

    def init_weights(self) -> None:
        """trunc-normal(0.02) code and position embeddings (timm ViT's position embedding init)."""
        nn.init.trunc_normal_(self.embed.weight, std=0.02)
        nn.init.trunc_normal_(self.pos_embed, std=0.02)

    def no_weight_decay(self) -> set[str]:
        return {"pos_embed"}

    def example_input(self, batch_size: int = 1) -> Tensor:
        """Zeros of the expected image shape ``(batch_size, C, H, W)``."""
        return torch.zeros(batch_size, self.in_chans, self.image_size, self.image_size)

    def forward(self, inputs: Tensor) -> Tokens:
        if inputs.dim() == 2 and not inputs.is_floating_point():
            ids = inputs
            if ids.shape[1] != self.vq.num_codes:
                raise ValueError(f"VQTokenizer expects ids (B, {self.vq.num_codes}), got {tuple(ids.shape)}")
        else:
            with torch.no_grad():
                ids = self.vq.encode(inputs)  # (B, N)
        x = self.embed(ids) + self.pos_embed  # (B, N, D)
        positions = self.grid_positions.unsqueeze(0).expand(x.shape[0], -1, -1)  # (B, N, 2)
        return Tokens.from_embeddings(x, MODALITY_IDS["image"], positions=positions)


# --------------------------------------------------------------------------------------- loading
VQ_ARGS = tuple(inspect.signature(VQVAE.__init__).parameters)[1:]


def vq_from_checkpoint(state: dict, where: str = "checkpoint") -> tuple[VQVAE, dict[str, Tensor]]:
    """``(codec built from the checkpoint's recipe, its weights)`` from a loaded mmformer training
    checkpoint (``torch.load`` of a ``.ckpt``): the ``vq`` tokenizer read by the first task of kind
    ``vq``. Raises ``ValueError`` when the checkpoint holds no trained codec."""
    own = state.get("mmformer") if isinstance(state, dict) else None
    if not isinstance(own, dict) or "recipe_yaml" not in own:
        raise ValueError(f"{where} is not an mmformer training checkpoint (it carries no recipe)")
    recipe = yaml.safe_load(own["recipe_yaml"])
    tasks = recipe.get("tasks") or {}
    task = next((t for t in tasks.values() if t.get("kind") == "vq"), None)
    if task is None:
        kinds = sorted({str(t.get("kind")) for t in tasks.values()})
        raise ValueError(
            f"{where} holds no trained VQ codec: it has no vq task (its tasks: {', '.join(kinds)})"
        )
    name = task["tokenizer"]
    cfg = recipe["model"]["tokenizers"][name]
    vq = VQVAE(**{k: cfg[k] for k in VQ_ARGS if cfg.get(k) is not None})
    prefix = f"model.tokenizers.{name}.vq."
    weights = {k[len(prefix) :]: v for k, v in state["state_dict"].items() if k.startswith(prefix)}
    return vq, weights


def check_sizes(vq: VQVAE, where: str, **asked) -> None:
    """Raise ``ValueError`` naming both values when the codec's ``image_size`` / ``in_chans`` /
    ``codebook_size`` differ from what a consumer asks (None: anything)."""
    wrong = [
        f"{k}={getattr(vq, k)} (asked: {v})"
        for k, v in asked.items()
        if v is not None and getattr(vq, k) != v
    ]
    if wrong:
        raise ValueError(
            f"the VQ codec in {where} has {', '.join(wrong)}; train a codec of those sizes or change the "
            "recipe to the codec's"
        )


def load_vq(
    path: str | Path,
    *,
    image_size: int | None = None,
    in_chans: int | None = None,
    codebook_size: int | None = None,
) -> VQVAE:
    """The codec of a trained ``vq`` run, frozen (``requires_grad=False``) and in eval mode.

    ``path``: the ``.ckpt`` that ``mmformer train`` wrote for a recipe with a ``vq`` task (its recipe
    gives the architecture, its state dict the weights, on CPU). A sharded (FSDP) checkpoint folder is
    not read here (``mmformer export`` it first).

    Raises:
        FileNotFoundError: a missing file.
        ValueError: not an mmformer checkpoint, no ``vq`` task in it, or a codec whose ``image_size``,
            ``in_chans`` or ``codebook_size`` differs from a given one (the message names both).
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"VQ checkpoint {str(path)!r} does not exist")
    state = torch.load(path, map_location="cpu", weights_only=True)
    vq, weights = vq_from_checkpoint(state, str(path))
    check_sizes(vq, str(path), image_size=image_size, in_chans=in_chans, codebook_size=codebook_size)
    vq.load_state_dict(weights)
    return vq.eval().requires_grad_(False)
