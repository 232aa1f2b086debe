"""Prediction pictures drawn after a validation, where a person would rather look than read: an image (or
spectrogram) grid with true and predicted classes, errors first; text queries with their top-k retrieved
inputs; inputs beside their reference and generated text. ``mmformer.training.media`` picks what each
task kind shows and turns it into records; this module only draws.

Drawn with matplotlib's object API (a ``Figure`` on an Agg canvas, no ``pyplot``: no global figure
state, nothing opens a window) and returned as ``(3, H, W)`` float tensors in [0, 1], what
``media.Image`` carries to the run folder (PNG) and W&B.

Pictures, the inputs of every function here: ``(C, H, W)`` float images in [0, 1] (C = 1 grey, 3 RGB)
or ``(F, T)`` float spectrograms (mel bins × frames, any scale: drawn low frequencies at the bottom
with a colour map).

Layout (what tests measure): a grid cell is ``CELL`` pixels wide and ``CELL + TITLE`` high; every
picture gets a frame of colour ``RIGHT`` (correct / a match), ``WRONG`` (an error) or ``NEUTRAL``.
"""

from __future__ import annotations

import math
import textwrap
from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np
import torch
from torch import Tensor

if TYPE_CHECKING:
    from matplotlib.figure import Figure

DPI = 100
CELL = 120  # pixels: the side of one picture cell
TITLE = 24  # pixels above each picture for its caption
PAD = 6  # pixels between a cell's edge and its picture
FRAME = 3.0  # points: the width of a picture's coloured frame
RIGHT, WRONG, NEUTRAL = "#1a7f37", "#cf222e", "#8c959f"
TEXT_CELLS = 3  # a text column is this many cells wide


def errors_first(labels: Tensor, preds: Tensor, probs: Tensor | None = None) -> Tensor:
    """The order to show classified samples in: the misclassified ones first — the most confident
    mistakes first when ``probs`` (the predicted class's probability) is given, else in their own order —
    then the correct ones in their own order.

    ``labels``, ``preds``: ``(N,)`` long; ``probs``: ``(N,)`` float or None. Returns ``(N,)`` long indices.
    Raises ``ValueError`` when the shapes differ."""
    if (
        labels.shape != preds.shape
        or labels.dim() != 1
        or (probs is not None and probs.shape != labels.shape)
    ):
        raise ValueError(
            f"labels, preds (and probs) must be (N,) alike, got {tuple(labels.shape)}, {tuple(preds.shape)}"
            + (f", {tuple(probs.shape)}" if probs is not None else "")
        )
    wrong = (labels != preds).cpu()
    errors, correct = wrong.nonzero().flatten(), (~wrong).nonzero().flatten()
    if probs is not None and len(errors):
        errors = errors[torch.sort(-probs.detach().float().cpu()[errors], stable=True).indices]
    return torch.cat([errors, correct])


def render(fig: Figure) -> Tensor:
    """The figure's pixels: ``(3, H, W)`` float in [0, 1] (H, W = its size in inches × its dpi)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg  # imported on first draw, not with the tasks

    canvas = FigureCanvasAgg(fig)
    canvas.draw()
    rgba = np.asarray(canvas.buffer_rgba())  # (H, W, 4) uint8
    return torch.from_numpy(rgba[..., :3].copy()).permute(2, 0, 1).float() / 255  # (3, H, W)


def _figure(width_px: int, height_px: int) -> Figure:
    from matplotlib.figure import Figure

    return Figure(figsize=(width_px / DPI, height_px / DPI), dpi=DPI, facecolor="white")


def _axes(fig: Figure, x: int, y: int, w: int, h: int):
    """Axes at pixel box (x, y) — from the top left — of size (w, h)."""
    W, H = fig.get_size_inches() * DPI
    return fig.add_axes((x / W, 1 - (y + h) / H, w / W, h / H))


def _show(ax, picture: Tensor, frame: str) -> None:
    """Draw one picture (an image ``(C, H, W)`` in [0, 1] or a spectrogram ``(F, T)``) framed in colour."""
    p = picture.detach().float().cpu()
    if p.dim() == 2:  # (F, T): low frequencies at the bottom, stretched to the cell
        ax.imshow(p.numpy(), origin="lower", aspect="auto", cmap="magma", interpolation="nearest")
    elif p.dim() == 3 and p.shape[0] in (1, 3):
        p = p.clamp(0, 1)
        if p.shape[0] == 1:
            ax.imshow(p[0].numpy(), cmap="gray", vmin=0, vmax=1, interpolation="nearest")
        else:
            ax.imshow(p.permute(1, 2, 0).numpy(), interpolation="nearest")  # (H, W, 3)
    else:
        raise ValueError(f"a picture is (C, H, W) with C 1 or 3, or (F, T); got {tuple(p.shape)}")
    if p.dim() == 3:  # keep the picture's aspect inside a fixed frame (blank margins, not a shrunk frame)
        ax.set_aspect("equal", adjustable="datalim")
    ax.set_xticks([])
    ax.set_yticks([])
    for spine in ax.spines.values():
        spine.set_color(frame)
        spine.set_linewidth(FRAME)


def picture_box(col: float, row: int) -> tuple[int, int, int, int]:
    """The pixel box ``(x0, y0, x1, y1)`` (from the top left) of the picture — its frame's centre line —
    in grid cell ``(col, row)``; its title sits in the ``TITLE`` pixels above ``y0``."""
    x, y = int(col * CELL), row * (CELL + TITLE)
    return x + PAD, y + TITLE, x + CELL - PAD, y + TITLE + CELL - PAD


def _short(name: str, n: int = 9) -> str:
    return name if len(name) <= n else name[: n - 1] + "…"


def _picture_cell(fig: Figure, col: float, row: int, picture: Tensor, title: str, colour: str) -> None:
    x0, y0, x1, y1 = picture_box(col, row)
    _show(_axes(fig, x0, y0, x1 - x0, y1 - y0), picture, colour)
    fig.text(
        (x0 + x1) / 2 / fig.bbox.width,
        1 - (y0 - 4) / fig.bbox.height,
        title,
        ha="center",
        va="bottom",
        fontsize=7.5,
        color=colour,
    )


def _text_cell(fig: Figure, col: float, row: int, lines: list[tuple[str, str]], cells: int) -> None:
    """Wrapped lines of text, each in its colour, in a box ``cells`` cells wide at (col, row)."""
    x, y = int(col * CELL), row * (CELL + TITLE)
    chars = max(10, int((cells * CELL - 2 * PAD) / 7))  # ~6.7 px per monospace character at 8 pt
    wrapped: list[tuple[str, str]] = []
    for text, colour in lines:
        wrapped += [
            (part, colour) for part in textwrap.wrap(text, chars, max_lines=3, placeholder=" …") or [""]
        ]
    for i, (part, colour) in enumerate(wrapped[:8]):
        fig.text(
            (x + PAD) / fig.bbox.width,
            1 - (y + TITLE + 4 + 14 * i) / fig.bbox.height,
            part,
            ha="left",
            va="top",
            fontsize=8,
            color=colour,
            family="monospace",
        )


def classification_grid(
    pictures: Sequence[Tensor],
    labels: Sequence[str],
    preds: Sequence[str],
    probs: Sequence[float] | None = None,
    ncols: int = 4,
) -> Tensor:
    """A grid of ``len(pictures)`` cells, ``ncols`` wide, filled row by row in the given order: each
    picture framed green (``RIGHT``) when ``preds[i] == labels[i]``, red (``WRONG``) otherwise, and titled
    ``label → prediction`` (names past 9 characters cut; with the prediction's probability when ``probs``
    is given). Cell ``i`` is at column ``i % ncols``, row ``i // ncols`` (``picture_box``).

    Returns ``(3, rows · (CELL + TITLE), ncols · CELL)`` float in [0, 1], ``rows = ceil(n / ncols)``.
    Raises ``ValueError`` when there is no picture or the lengths differ."""
    n = len(pictures)
    if n == 0 or len(labels) != n or len(preds) != n or (probs is not None and len(probs) != n):
        raise ValueError(f"need as many labels and predictions as pictures (>= 1), got {n}")
    ncols = max(1, min(ncols, n))
    rows = math.ceil(n / ncols)
    fig = _figure(ncols * CELL, rows * (CELL + TITLE))
    for i, (picture, y, p) in enumerate(zip(pictures, labels, preds)):
        title = f"{_short(y)} → {_short(p)}" + (f" {probs[i]:.2f}" if probs is not None else "")
        _picture_cell(fig, i % ncols, i // ncols, picture, title, RIGHT if y == p else WRONG)
    return render(fig)


def retrieval_rows(
    queries: Sequence[str],
    gallery: Sequence[Tensor],
    top: Tensor,
    scores: Tensor,
    match: Tensor,
) -> Tensor:
    """Text queries with their top-k retrieved pictures: one row per query, the query's text on the left
    (``TEXT_CELLS`` cells wide), then its k retrievals best first, each titled ``#rank similarity`` and
    framed green when it is the query's own pair (``match``), grey otherwise.

    ``gallery``: the pictures retrieved from; ``top``, ``scores``: ``(Q, k)`` long indices into
    ``gallery`` and their float similarities; ``match``: ``(Q, k)`` bool. Returns
    ``(3, Q · (CELL + TITLE), (TEXT_CELLS + k) · CELL)`` float in [0, 1]. Raises ``ValueError`` on shapes
    that disagree."""
    q, k = top.shape if top.dim() == 2 else (0, 0)
    if q == 0 or k == 0 or len(queries) != q or scores.shape != top.shape or match.shape != top.shape:
        raise ValueError(
            f"need (Q, k) top, scores and match for Q = {len(queries)} queries, got {tuple(top.shape)}, "
            f"{tuple(scores.shape)}, {tuple(match.shape)}"
        )
    fig = _figure((TEXT_CELLS + k) * CELL, q * (CELL + TITLE))
    for r, text in enumerate(queries):
        found = bool(match[r].any())
        _text_cell(fig, 0, r, [(f"query {r + 1}:", "black"), (text, RIGHT if found else WRONG)], TEXT_CELLS)
        for j in range(k):
            hit = bool(match[r, j])
            title = f"#{j + 1} {float(scores[r, j]):.2f}"
            _picture_cell(fig, TEXT_CELLS + j, r, gallery[int(top[r, j])], title, RIGHT if hit else NEUTRAL)
    return render(fig)


def captioned_rows(pictures: Sequence[Tensor], references: Sequence[str], generated: Sequence[str]) -> Tensor:
    """Inputs beside their texts: one row per input, the picture (an image or a spectrogram) on the left,
    then the reference and the generated text (``TEXT_CELLS`` cells wide); the picture's frame and the
    generated text are green when the two texts are equal, red otherwise (compare normalised texts).

    Returns ``(3, n · (CELL + TITLE), (1 + TEXT_CELLS) · CELL)`` float in [0, 1]. Raises ``ValueError``
    when there is no picture or the lengths differ."""
    n = len(pictures)
    if n == 0 or len(references) != n or len(generated) != n:
        raise ValueError(f"need a reference and a generated text per picture (>= 1), got {n}")
    fig = _figure((1 + TEXT_CELLS) * CELL, n * (CELL + TITLE))
    for r, (picture, ref, hyp) in enumerate(zip(pictures, references, generated)):
        colour = RIGHT if ref == hyp else WRONG
        _picture_cell(fig, 0, r, picture, f"sample {r + 1}", colour)
        _text_cell(
            fig,
            1,
            r,
            [("reference:", "black"), (ref, "black"), ("generated:", "black"), (hyp, colour)],
            TEXT_CELLS,
        )
    return render(fig)
