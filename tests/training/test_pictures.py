"""Prediction pictures after a validation: the order classified samples are shown in (errors first, the
most confident mistakes first), and the pictures each task kind makes from small real tensors —
classification grids (images and spectrograms), contrastive queries with their top-5 retrievals,
captioning inputs beside their texts — measured on their pixels: size, cells, frame colours."""

from __future__ import annotations

from contextlib import nullcontext
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from PIL import Image as PILImage
from torch import nn

from mmformer.models.prefix_lm import PrefixLM
from mmformer.tasks.classification import ClassificationTask
from mmformer.tasks.contrastive import ContrastiveTask
from mmformer.tasks.prefix_lm import PrefixLMTask
from mmformer.training import pictures as P
from mmformer.training.media import (
    PREDICTIONS,
    Image,
    Table,
    captions_picture,
    classification_picture,
    retrieval_picture,
)


def _rgb(hex_colour: str) -> torch.Tensor:
    return torch.tensor([int(hex_colour[i : i + 2], 16) / 255 for i in (1, 3, 5)])


def frame_colour(img: torch.Tensor, col: float, row: int) -> str:
    """'right', 'wrong', 'neutral' or 'none': the colour of the left side of the frame in cell (col, row)."""
    x0, y0, _, y1 = P.picture_box(col, row)
    strip = img[:, y0 + 10 : y1 - 10, x0 - 1 : x0 + 2].reshape(3, -1)  # (3, n) pixels on the frame line
    colour = strip.median(dim=1).values
    for name, ref in (("right", P.RIGHT), ("wrong", P.WRONG), ("neutral", P.NEUTRAL)):
        if (colour - _rgb(ref)).abs().max() < 0.1:
            return name
    return "none"


def grid_frames(img: torch.Tensor, ncols: int, col_offset: int = 0) -> list[str]:
    rows = img.shape[1] // (P.CELL + P.TITLE)
    return [frame_colour(img, col_offset + c, r) for r in range(rows) for c in range(ncols)]


# ------------------------------------------------------------------------------------------ ordering
def test_errors_come_first_the_most_confident_first_then_the_correct_in_order():
    labels = torch.tensor([0, 1, 2, 3, 4, 5])
    preds = torch.tensor([0, 2, 2, 0, 4, 1])  # wrong: 1, 3, 5
    probs = torch.tensor([0.9, 0.6, 0.8, 0.95, 0.5, 0.7])
    assert P.errors_first(labels, preds, probs).tolist() == [3, 5, 1, 0, 2, 4]
    assert P.errors_first(labels, preds).tolist() == [1, 3, 5, 0, 2, 4]  # without probabilities: stable
    assert P.errors_first(labels, labels).tolist() == [0, 1, 2, 3, 4, 5]
    with pytest.raises(ValueError, match="alike"):
        P.errors_first(labels, preds[:3])


# -------------------------------------------------------------------------------------- classification
def test_a_grid_has_one_framed_cell_per_picture_in_the_given_order():
    pics = [torch.full((1, 28, 28), v) for v in (0.1, 0.3, 0.5, 0.7, 0.9, 0.2)]
    labels, preds = ["a", "b", "a", "b", "a", "b"], ["b", "b", "a", "a", "a", "b"]
    img = P.classification_grid(pics, labels, preds, [0.9, 0.8, 0.7, 0.6, 0.5, 0.4], ncols=4)
    assert img.shape == (3, 2 * (P.CELL + P.TITLE), 4 * P.CELL)
    assert 0 <= img.min() and img.max() <= 1 and img.std() > 0.05
    # 6 framed cells, red where the prediction is wrong, the last two cells of the second row empty
    assert grid_frames(img, 4) == ["wrong", "right", "right", "wrong", "right", "right", "none", "none"]
    with pytest.raises(ValueError, match="as many labels"):
        P.classification_grid(pics, labels[:2], preds)


def test_the_classification_picture_shows_errors_first_and_counts_them():
    images = torch.stack([torch.full((1, 8, 8), 40 * i, dtype=torch.uint8) for i in range(6)])
    labels = torch.tensor([0, 1, 2, 0, 1, 2])
    logits = torch.eye(3)[[0, 2, 2, 0, 0, 2]] * 4  # wrong: 1 (→ 2) and 4 (→ 0)
    record = classification_picture(images, labels, logits, ["zero", "one", "two"], shown=5)
    assert isinstance(record, Image) and record.name == PREDICTIONS
    assert record.caption == "2 of 6 held-out samples misclassified (errors first)"
    assert record.image.shape == (3, 2 * (P.CELL + P.TITLE), 4 * P.CELL)  # 5 cells: 4 + 1
    assert grid_frames(record.image, 4) == [
        "wrong",
        "wrong",
        "right",
        "right",
        "right",
        "none",
        "none",
        "none",
    ]


class _Stub(nn.Module):
    """A composed model's interface, ``model(inputs, tokenizer, head, valid=…)``: returns ``fn(inputs)``."""

    def __init__(self, fns: dict, sample_rate: int = 8000):
        super().__init__()
        self.fns = fns
        self.tokenizers = {name: SimpleNamespace(sample_rate=sample_rate) for name in fns}

    def forward(self, inputs, tokenizer, head, valid=None):
        return self.fns[tokenizer](inputs)


def _ctx(val, model):
    """What a task's media hook uses of ``MediaContext``, with the model called directly."""
    return SimpleNamespace(
        val=val,
        model=model,
        device=torch.device("cpu"),
        validation_weights=lambda: nullcontext(model),
        forward=lambda fn, *args: fn(*args),
    )


def test_an_image_classifier_shows_its_held_out_images_errors_first():
    task = ClassificationTask("image", "cls", num_classes=2)
    # class 1 = bright; the stub predicts "bright" when the mean pixel passes 100 (two of them wrongly)
    val = [{"image": torch.full((1, 8, 8), v, dtype=torch.uint8), "label": y} for v, y in
           [(200, 1), (30, 0), (120, 0), (220, 1), (90, 1), (10, 0)]]  # fmt: skip
    val_ds = type("Val", (list,), {"classes": ["dark", "bright"]})(val)
    model = _Stub(
        {
            "image": lambda x: torch.stack(
                [100 - x.float().mean((1, 2, 3)), x.float().mean((1, 2, 3)) - 100], 1
            )
        }
    )
    (record,) = task.media(_ctx(val_ds, model))
    assert record.name == PREDICTIONS and record.caption.startswith("2 of 6")
    assert grid_frames(record.image, 4) == [
        "wrong",
        "wrong",
        "right",
        "right",
        "right",
        "right",
        "none",
        "none",
    ]
    assert (
        task.media(_ctx(val_ds, model))
        and ClassificationTask("t", "c", 2, input_key="text").media(None) == []
    )


def test_an_audio_classifier_shows_spectrograms_and_its_table_of_clips():
    task = ClassificationTask("audio", "cls", num_classes=2, input_key="audio")
    t = torch.arange(8000) / 8000
    val = [
        {"audio": torch.sin(2 * torch.pi * f * t[: n]), "label": y, "path": f"{i}.wav", "bad_samples": []}
        for i, (f, n, y) in enumerate([(300, 8000, 0), (2000, 4000, 1), (2500, 6000, 0)])
    ]  # fmt: skip
    # predicts "high" (1) for a high spectral centroid: clip 2 is high but labelled 0
    high = lambda w: torch.stack([-w.diff(dim=1).abs().mean(1), w.diff(dim=1).abs().mean(1) - 0.5], 1)  # noqa: E731
    table, picture = task.media(_ctx(val, _Stub({"audio": high})))
    assert isinstance(table, Table) and table.name == "audio" and len(table.rows) == 3
    assert [r[1:3] for r in table.rows] == [["0", "0"], ["1", "1"], ["0", "1"]]
    assert picture.caption.startswith("1 of 3") and picture.image.shape == (3, P.CELL + P.TITLE, 3 * P.CELL)
    assert grid_frames(picture.image, 3) == ["wrong", "right", "right"]


# ------------------------------------------------------------------------------------------ contrastive
def test_retrieval_rows_frame_the_pairs_the_queries_find():
    images = torch.rand(6, 3, 16, 16) * 0.2 + 0.4  # grey-ish: no frame colour inside a picture
    sim = torch.tensor([[0.9, 0.1, 0.2, 0.3, 0.0, 0.05], [0.8, 0.1, 0.7, 0.6, 0.5, 0.4]])
    match = torch.zeros(2, 6, dtype=torch.bool)
    match[0, 0] = match[1, 1] = True  # query 1's pair ranks last
    record = retrieval_picture(["a red square", "a blue circle"], images, sim, match, k=5)
    assert record.caption == "1 of 2 queries find their pair in the top 5"
    assert record.image.shape == (3, 2 * (P.CELL + P.TITLE), (P.TEXT_CELLS + 5) * P.CELL)
    frames = grid_frames(record.image, 5, col_offset=P.TEXT_CELLS)
    assert frames == ["right"] + ["neutral"] * 4 + ["neutral"] * 5


def test_a_contrastive_task_shows_distinct_caption_queries_with_their_top_retrievals():
    task = ContrastiveTask("image", "img", "text", "txt")
    # image i and caption i embed to the same one-hot direction; items 2 and 3 share a caption
    E = 8
    ids = [0, 1, 2, 2, 3, 4]
    val = [
        {"image": torch.nn.functional.one_hot(torch.tensor(c), E).float().view(1, 1, E) * 255, "ids": [c + 1],
         "caption": f"caption {c}", "caption_id": c}
        for c in ids
    ]  # fmt: skip
    model = _Stub({"image": lambda x: x.flatten(1), "text": lambda ids: torch.eye(E)[ids[:, 0] - 1]})
    (record,) = task.media(_ctx(val, model))
    # 4 queries (distinct captions 0, 1, 2, 3): each finds its pair first; caption 2 finds both its images
    assert record.name == PREDICTIONS and record.caption == "4 of 4 queries find their pair in the top 5"
    frames = grid_frames(record.image, 5, col_offset=P.TEXT_CELLS)
    rows = [frames[i : i + 5] for i in range(0, 20, 5)]
    assert rows[0][0] == rows[1][0] == rows[3][0] == "right" and rows[2][:2] == ["right", "right"]
    assert sum(f == "right" for f in frames) == 5


# ------------------------------------------------------------------------------------ captioning / ASR
def test_captioned_rows_put_inputs_beside_their_texts():
    waves = torch.randn(2, 4000) * 0.1
    valid = torch.ones(2, 4000, dtype=torch.bool)
    valid[1, 2000:] = False
    record = captions_picture(
        waves, ["hello world", "good night"], ["hello world", "good knight"], valid, 8000
    )
    assert record.caption == "1 of 2 generated exactly"
    assert record.image.shape == (3, 2 * (P.CELL + P.TITLE), (1 + P.TEXT_CELLS) * P.CELL)
    assert [frame_colour(record.image, 0, r) for r in range(2)] == ["right", "wrong"]
    text_area = record.image[:, :, P.CELL :]
    assert (text_area < 0.5).any(), "the texts are drawn"


def test_a_captioning_task_shows_the_inputs_of_its_first_validation_batch():
    task = PrefixLMTask(PrefixLM("image", "text", "lm"), "image", text=None, max_new_tokens=3)
    task.examples = [("a cat", "a cat"), ("a dog", "a cow"), ("sun", "moon")]
    task.example_inputs = (torch.randint(0, 255, (3, 3, 12, 12), dtype=torch.uint8), None)
    table, picture = task.media(_ctx(None, None))
    assert table.name == "decoded" and picture.name == PREDICTIONS
    assert [frame_colour(picture.image, 0, r) for r in range(3)] == ["right", "wrong", "wrong"]


def test_a_written_picture_decodes_to_the_same_pixels(tmp_path):
    from torchvision.utils import save_image

    img = P.classification_grid([torch.rand(1, 10, 10)] * 3, ["a"] * 3, ["a", "b", "a"])
    save_image(img, tmp_path / "grid.png")  # as MediaSamples writes it
    png = PILImage.open(tmp_path / "grid.png")
    assert png.size == (3 * P.CELL, P.CELL + P.TITLE) and png.mode == "RGB"
    back = torch.from_numpy(np.array(png)).permute(2, 0, 1).float() / 255
    assert (back - img).abs().max() < 1 / 255 + 1e-6
    assert grid_frames(back, 3) == ["right", "wrong", "right"]


def test_the_shown_pool_is_spread_over_the_held_out_set():
    from mmformer.training.media import spread

    assert spread(500, 5) == [0, 125, 250, 374, 499]  # a set sorted by class shows every class
    assert spread(3, 64) == [0, 1, 2] and spread(10, 1) == [0] and spread(10, 0) == []
