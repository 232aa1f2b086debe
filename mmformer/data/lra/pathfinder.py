"""Pathfinder (Linsley et al. 2018, arXiv:1805.08315; Kim, Linsley et al. 2020) at the Long Range Arena's
32×32 (Tay et al. 2021, arXiv:2011.04006 §3.4: 1,024 pixels read as a sequence, 2 classes): are the two
circle markers joined by one path?

The generation rules follow the reference generator (github.com/drewlinsley/pathfinder ``snakes2.py``,
``snakes.py``) with LRA's 32×32 settings (``lra_benchmarks/data/pathfinder.py``: contour_length 14,
distractor_length 14 // 3 = 4, num_distractor_snakes 20 // 4 = 5, seed_distance 7, marker_radius 1.5,
continuity 1.0, padding 1):

* two target snakes of 14 segments grow, alternately, from two seeds ``SEED_DISTANCE`` apart near the
  centre; each step turns by Δθ drawn with weight cos²(min(|Δθ|·continuity, 90°)) (bounded curvature:
  under 90° per segment, mostly straight), never leaving the padded frame nor touching another snake;
* up to 5 distractor snakes of 4 segments are placed wherever they fit (none when no room is left);
* a positive marks both ends of one target snake; a negative marks the start of one and the end of
  the other (so marker distances match across the classes); markers are discs of radius 1.5 px.

Differences, chosen so the label is exactly pixel connectivity: segments are solid 1-px strokes of
``SEGMENT_LENGTH`` px drawn end to end (the reference draws antialiased dashes with 1-px gaps), and every
snake keeps one empty pixel between itself and any other snake or marker (8-neighbourhood). So in a
positive the markers are joined through foreground pixels (8-connected), and in a negative they are
not; the generator checks both by flood fill and redraws an image that fails. Images are binary
(0 background, 255 path and markers).
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np

from ...progress import progress
from ..sequence_format import write_meta, write_split

IMAGE_SIZE = 32  # pixels per side (LRA pathfinder32)
PADDING = 1  # empty border, in pixels
CONTOUR_LENGTH = 14  # segments per target snake (LRA's "hard" setting, curv_contour_length_14)
DISTRACTOR_LENGTH = CONTOUR_LENGTH // 3  # segments per distractor snake
NUM_DISTRACTORS = 20 // DISTRACTOR_LENGTH
SEGMENT_LENGTH = 3.0  # pixels per segment: the reference's paddle (2 px) plus its gap (1 px)
SEED_DISTANCE = 7  # pixels between the two target snakes' first points
CONTINUITY = 1.0  # turn weight cos²(min(|Δθ|·continuity, π/2)): larger = straighter
DIRECTIONS = 72  # headings in steps of 5°
TURNS = np.arange(-17, 18)  # turns per segment, in 5° steps: under 90°
TURN_WEIGHTS = np.cos(np.minimum(np.abs(np.deg2rad(TURNS * 5.0)) * CONTINUITY, np.pi / 2)) ** 2
MAX_TRIALS = 20  # placements tried per distractor snake before it is left out
FOREGROUND = 255
MARGIN = 4  # the canvas is padded by this many always-blocked pixels, so a segment never leaves it
SIDE = IMAGE_SIZE + 2 * MARGIN


def _line(y0: float, x0: float, y1: float, x1: float) -> list[tuple[int, int]]:
    """The pixels of a stroke, 8-connected, starting at the pixel of (y0, x0)."""
    n = int(math.ceil(2 * max(abs(y1 - y0), abs(x1 - x0)))) + 1  # steps of ≤ 0.5 px: 8-connected
    out: list[tuple[int, int]] = []
    for t in np.linspace(0.0, 1.0, n + 1):
        p = (int(round(y0 + t * (y1 - y0))), int(round(x0 + t * (x1 - x0))))
        if not out or out[-1] != p:
            out.append(p)
    return out


def _strokes() -> np.ndarray:
    """(DIRECTIONS, K) flat canvas offsets of a segment's pixels from its start pixel (the start left
    out; the last entry is its end; a shorter stroke repeats its first pixel in front)."""
    lines = []
    for d in range(DIRECTIONS):
        a = math.radians(5.0 * d)
        line = _line(0.0, 0.0, SEGMENT_LENGTH * math.sin(a), SEGMENT_LENGTH * math.cos(a))[1:]
        lines.append([y * SIDE + x for y, x in line])
    k = max(len(line) for line in lines)
    return np.array([[line[0]] * (k - len(line)) + line for line in lines], dtype=np.int64)


STROKES = _strokes()
NEIGHBOURS = np.array([dy * SIDE + dx for dy in (-1, 0, 1) for dx in (-1, 0, 1)])  # 3×3, flat
_frame = np.ones((SIDE, SIDE), dtype=bool)  # True outside the padded frame
_frame[MARGIN + PADDING : SIDE - MARGIN - PADDING, MARGIN + PADDING : SIDE - MARGIN - PADDING] = False
FRAME = _frame.reshape(-1)


def _flat(y: int, x: int) -> int:
    """Image pixel (y, x) → canvas index."""
    return (y + MARGIN) * SIDE + x + MARGIN


def _pixel(i: int) -> tuple[int, int]:
    """Canvas index → image pixel (y, x)."""
    return i // SIDE - MARGIN, i % SIDE - MARGIN


def _disc(i: int) -> np.ndarray:
    """A marker of radius 1.5 px centred on canvas pixel ``i``: its 3×3 neighbourhood."""
    return i + NEIGHBOURS


class _Canvas:
    """The snakes drawn so far, on the flat padded canvas: ``owner`` -1 = empty, else the snake's index;
    ``near[i]``: snake i's pixels and their 8-neighbours, where no other snake may go."""

    def __init__(self):
        self.owner = np.full(SIDE * SIDE, -1, dtype=np.int64)
        self.near: list[np.ndarray] = []

    def others(self, snake: int) -> np.ndarray:
        """Where ``snake`` may not go because of the other snakes or the frame."""
        blocked = FRAME.copy()
        for i, near in enumerate(self.near):
            if i != snake:
                blocked |= near
        return blocked

    def add(self, snake: int, pixels: np.ndarray) -> None:
        self.owner[pixels] = snake
        self.near[snake][(pixels[:, None] + NEIGHBOURS).reshape(-1)] = True

    def pop(self) -> None:
        """Remove the last snake."""
        self.owner[self.owner == len(self.near) - 1] = -1
        self.near.pop()

    def image(self) -> np.ndarray:
        full = np.where(self.owner >= 0, FOREGROUND, 0).astype(np.uint8).reshape(SIDE, SIDE)
        return full[MARGIN : SIDE - MARGIN, MARGIN : SIDE - MARGIN].copy()


class _Snake:
    """One growing snake: its tip (a canvas index) and heading (a ``DIRECTIONS`` index); the pixels of its
    last segment (the next one may touch them) and ``own_old``, the neighbourhood of the older ones (it
    may not). A target snake starts inside its marker's disc, which is reserved from the start."""

    def __init__(self, canvas: _Canvas, tip: int, heading: int, marker: bool):
        self.canvas, self.index = canvas, len(canvas.near)
        canvas.near.append(np.zeros(SIDE * SIDE, dtype=bool))
        self.start, self.tip, self.heading = tip, tip, heading
        self.last = _disc(tip) if marker else np.array([tip])
        self.own_old = np.zeros(SIDE * SIDE, dtype=bool)
        self.stroke = np.zeros(SIDE * SIDE, dtype=bool)  # the path itself, without marker discs
        self.stroke[tip] = True

    def place_start(self) -> bool:
        """Draw the first pixel (and disc) if it fits; False otherwise."""
        if self.canvas.others(self.index)[self.last].any():
            return False
        self.canvas.add(self.index, self.last)
        return True

    def extend(self, rng: np.random.Generator, first: bool = False) -> bool:
        """Add one segment, its turn drawn with the continuity weights among those that fit (the first
        segment keeps the initial heading); False when none fits."""
        turns, weights = (TURNS[17:18], TURN_WEIGHTS[17:18]) if first else (TURNS, TURN_WEIGHTS)
        headings = (self.heading + turns) % DIRECTIONS
        pixels = self.tip + STROKES[headings]  # (T, K)
        blocked = self.canvas.others(self.index) | self.own_old
        blocked[self.last] = False  # the segment before may be touched
        w = weights * ~blocked[pixels].any(axis=1)
        total = w.sum()
        if total <= 0:
            return False
        k = int(np.searchsorted(np.cumsum(w), rng.random() * total, side="right"))
        self.own_old[(self.last[:, None] + NEIGHBOURS).reshape(-1)] = True
        self.canvas.add(self.index, pixels[k])
        self.stroke[pixels[k]] = True
        self.last = np.concatenate([[self.tip], pixels[k]])
        self.tip, self.heading = int(pixels[k, -1]), int(headings[k])
        return True


def _two_targets(rng: np.random.Generator) -> tuple[_Canvas, list[_Snake]] | None:
    """Two target snakes of ``CONTOUR_LENGTH`` segments, marker discs reserved at all four ends; None
    when they do not fit (the caller draws again)."""
    canvas = _Canvas()
    lo, hi = 2 * SEED_DISTANCE, IMAGE_SIZE - 2 * SEED_DISTANCE  # the first seed: near the centre
    y0, x0 = (int(v) for v in rng.integers(lo, hi, size=2))
    a = rng.uniform(-math.pi, math.pi)
    y1, x1 = round(y0 + SEED_DISTANCE * math.sin(a)), round(x0 + SEED_DISTANCE * math.cos(a))
    if not (0 <= y1 < IMAGE_SIZE and 0 <= x1 < IMAGE_SIZE):
        return None
    snakes = [
        _Snake(canvas, _flat(y, x), int(rng.integers(DIRECTIONS)), marker=True)
        for y, x in ((y0, x0), (y1, x1))
    ]
    if not all(s.place_start() for s in snakes):
        return None
    for step in range(CONTOUR_LENGTH):
        for s in snakes:
            if not s.extend(rng, first=step == 0):
                return None
    for s in snakes:  # the end discs: inside the frame, away from the other snake
        disc = _disc(s.tip)
        if canvas.others(s.index)[disc].any():
            return None
        canvas.add(s.index, disc)
    return canvas, snakes


def _distractor(canvas: _Canvas, rng: np.random.Generator) -> None:
    """One distractor snake of ``DISTRACTOR_LENGTH`` segments where it fits, else none."""
    for _ in range(MAX_TRIALS):
        free = np.flatnonzero(~canvas.others(-1))
        if len(free) == 0:
            return
        snake = _Snake(
            canvas, int(free[rng.integers(len(free))]), int(rng.integers(DIRECTIONS)), marker=False
        )
        if snake.place_start() and all(snake.extend(rng, first=i == 0) for i in range(DISTRACTOR_LENGTH)):
            return
        canvas.pop()


def connected(image: np.ndarray, a: tuple[int, int], b: tuple[int, int]) -> bool:
    """Flood fill over foreground pixels (8-neighbourhood) from ``a``: does it reach ``b``?"""
    fg = image > 0
    reach = np.zeros_like(fg)
    reach[a] = fg[a]
    while not reach[b]:
        grown = reach.copy()
        grown[1:] |= reach[:-1]
        grown[:-1] |= reach[1:]
        rows = grown.copy()
        grown[:, 1:] |= rows[:, :-1]
        grown[:, :-1] |= rows[:, 1:]
        grown &= fg
        if (grown == reach).all():
            return False
        reach = grown
    return True


def sample(rng: np.random.Generator, label: int) -> tuple[np.ndarray, tuple[int, int], tuple[int, int]]:
    """One image ``(32, 32)`` uint8 of class ``label`` (1 = the markers are joined) and its two marker
    centres (y, x)."""
    while True:
        drawn = _two_targets(rng)
        if drawn is None:
            continue
        canvas, targets = drawn
        for _ in range(NUM_DISTRACTORS):
            _distractor(canvas, rng)
        first = int(rng.integers(2))  # the snake whose start is marked
        s0, s1 = targets[first], targets[1 - first]
        a, b = s0.start, (s0 if label == 1 else s1).tip
        for s in targets:  # the reserved discs of the unmarked ends stay empty
            for end in (s.start, s.tip):
                if end not in (a, b):
                    disc = _disc(end)
                    canvas.owner[disc[~s.stroke[disc]]] = -1
        image = canvas.image()
        if connected(image, _pixel(a), _pixel(b)) == bool(label):
            return image, _pixel(a), _pixel(b)


SPLITS = ("train", "val", "test")  # build_pathfinder's splits, in the order of their numbers
CHUNK = 5_000  # images drawn from one seeded generator; a larger split is drawn in parallel chunks


def _chunk(
    seed: int, split: int, chunk: int, n: int, bar: bool = False
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``n`` balanced images ``(n, 1024)`` uint8, labels ``(n,)``, marker centres ``(n, 2, 2)``, from the
    generator seeded by (seed, split, chunk): the same whichever process draws them; ``bar``: a progress
    bar over the images (drawn in this process)."""
    rng = np.random.default_rng([seed, split, chunk])
    labels = rng.permutation(np.arange(n) % 2)
    images, markers = (
        np.zeros((n, IMAGE_SIZE * IMAGE_SIZE), dtype=np.uint8),
        np.zeros((n, 2, 2), dtype=np.int64),
    )
    for i, label in enumerate(
        progress(labels, f"pathfinder: {SPLITS[split]}", unit="img") if bar else labels
    ):
        image, a, b = sample(rng, int(label))
        images[i], markers[i] = image.reshape(-1), (a, b)
    return images, labels, markers


def build_pathfinder(
    out: Path, n_train: int = 2_000, n_val: int = 500, n_test: int = 500, seed: int = 0
) -> None:
    """Balanced ``train`` / ``val`` / ``test`` splits of pixel sequences (row-major, 1,024 ids in 0–255;
    ``mmformer.data.sequences`` format), the marker centres in ``<split>-markers.npy`` (n, 2, 2) and the
    first images of each split as ``<split>-sample.png``. Splits of more than ``CHUNK`` images are drawn
    in chunks on every CPU (fresh processes)."""
    import os
    from concurrent.futures import ProcessPoolExecutor
    from multiprocessing import get_context

    from PIL import Image

    splits = {"train": n_train, "val": n_val, "test": n_test}
    jobs = [
        (seed, s, c, min(CHUNK, n - c * CHUNK))
        for s, n in enumerate(splits.values())
        for c in range(-(-n // CHUNK))
    ]
    if len(jobs) > len(splits) and (os.cpu_count() or 1) > 1:
        with ProcessPoolExecutor(
            min(os.cpu_count() or 1, len(jobs)), mp_context=get_context("spawn")
        ) as pool:
            drawn = pool.map(_chunk, *zip(*jobs))
            chunks = list(progress(drawn, f"pathfinder: {CHUNK:,}-image chunks", len(jobs), unit="chunk"))
    else:
        chunks = [_chunk(*job, bar=True) for job in jobs]
    for s, split in enumerate(splits):
        mine = [c for job, c in zip(jobs, chunks) if job[1] == s]
        images, labels, markers = (np.concatenate(parts) for parts in zip(*mine))
        write_split(out, split, images, labels)
        np.save(out / f"{split}-markers.npy", markers)
        grid = np.concatenate([im.reshape(IMAGE_SIZE, IMAGE_SIZE) for im in images[:8]], 1)
        Image.fromarray(grid, mode="L").save(out / f"{split}-sample.png")
    write_meta(
        out,
        256,
        IMAGE_SIZE * IMAGE_SIZE,
        ["disconnected", "connected"],
        splits,
        seed=seed,
        image_size=[IMAGE_SIZE, IMAGE_SIZE],
        source="generated: Pathfinder snakes (mmformer/data/lra/pathfinder.py), LRA 32×32 settings",
    )
    (out / "README.md").write_text(
        "Pathfinder at 32×32 (mmformer/data/lra/pathfinder.py): 1,024 pixel intensities per image, row-major; "
        "class 1 (connected) when one snake joins the two markers, 0 (disconnected) otherwise; balanced. "
        f"numpy seed {seed}; {n_train:,} train / {n_val:,} val / {n_test:,} test "
        "(LRA: 160,000 / 20,000 / 20,000: `mmformer data prepare pathfinder-full`). "
        "<split>-markers.npy holds the two marker centres (y, x) of every image.\n"
    )
