"""The emoji image–caption set: rendered from the real font, named by Unicode, split stably."""

from __future__ import annotations

import json

import numpy as np
import pytest
from PIL import Image

from mmformer.data.emoji import build_emoji, emoji_split
from mmformer.data.prepare import BUNDLED


def test_split_is_a_fixed_hash_of_the_code_point():
    assert [emoji_split(c) for c in (0x1F600, 0x203C, 0x2199, 0x1F431)] == ["train", "val", "val", "train"]


def test_build_renders_captioned_emoji(tmp_path):
    missing = BUNDLED["emoji"].missing()
    if missing:
        pytest.skip(missing)
    build_emoji(tmp_path, size=32)
    rows = {
        s: [json.loads(x) for x in (tmp_path / f"{s}.jsonl").read_text().splitlines()]
        for s in ("train", "val")
    }
    assert (
        len(rows["train"]) + len(rows["val"]) > 1300 and 0.05 < len(rows["val"]) / len(rows["train"]) < 0.15
    )
    assert {r["codepoint"] for r in rows["train"]}.isdisjoint(r["codepoint"] for r in rows["val"])
    grin = next(r for r in rows["train"] if r["codepoint"] == "1F600")
    assert grin["caption"] == "grinning face"
    # Unicode's emoji taxonomy, and each group's zero-shot prompts: its name, then its subgroups'
    assert (grin["group"], grin["subgroup"]) == ("smileys and emotion", "face smiling")
    cat = next(r for s in rows.values() for r in s if r["codepoint"] == "1F431")  # cat face
    assert (cat["group"], cat["subgroup"]) == ("animals and nature", "animal mammal")
    prompts = json.loads((tmp_path / "group.json").read_text())
    assert prompts["smileys and emotion"][:2] == ["smileys and emotion", "face smiling"]
    assert "animal mammal" in prompts["animals and nature"] and "food fruit" in prompts["food and drink"]
    assert {r["group"] for s in rows.values() for r in s if "group" in r} == set(prompts)
    assert sum("group" not in r for s in rows.values() for r in s) < 10  # a few pictographs are not emoji
    pixels = np.asarray(Image.open(tmp_path / grin["image"]))
    assert pixels.shape == (32, 32, 3) and (pixels[0, 0] == 255).all()  # white background
    assert pixels[16, 16].tolist() != [255, 255, 255]  # a face in the middle
    assert not any(
        0x1F3FB <= int(r["codepoint"], 16) < 0x1F400 for r in rows["train"]
    )  # no skin-tone swatches
