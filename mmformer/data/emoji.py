"""``emoji``: an image–caption set rendered from Debian's Noto Color Emoji font (DATA.md, Image + caption):
every single-code-point emoji the font draws, its Unicode name as the caption (``grinning face``).

``images/<codepoint>.png`` are RGB on white, ``size``×``size``; ``train.jsonl`` / ``val.jsonl`` hold
``{"image": "images/1F600.png", "caption": "grinning face", "codepoint": "1F600"}``, split 90 / 10 by a
stable hash of the code point, so every task that uses the set holds out the same emoji.
"""

from __future__ import annotations

import hashlib
import json
import unicodedata
from pathlib import Path

from .roots import DataError

EMOJI_FONT = Path("/usr/share/fonts/truetype/noto/NotoColorEmoji.ttf")
EMOJI_INSTALL = "apt-get install fonts-noto-color-emoji"
FONT_SIZE = 109  # the only size of the font's bitmap strikes (Pillow refuses others)
CANDIDATES = (range(0x2000, 0x2C00), range(0x3000, 0x3300), range(0x1F000, 0x1FB00))
# drawn by the font but not pictures on their own: skin-tone modifiers, flag letters, tag letters
EXCLUDED = (range(0x1F3FB, 0x1F400), range(0x1F1E6, 0x1F200))


def emoji_split(codepoint: int) -> str:
    """``train`` or ``val`` (90 / 10) by a stable hash of the code point."""
    return "val" if int(hashlib.sha256(f"{codepoint:X}".encode()).hexdigest()[:8], 16) % 10 == 0 else "train"


def render_emoji(font, char: str, size: int):
    """One emoji as an RGB ``size``×``size`` PIL image on white, or None when the font has no glyph."""
    from PIL import Image, ImageDraw

    canvas = Image.new("RGBA", (136, 136), (255, 255, 255, 0))
    ImageDraw.Draw(canvas).text((0, 4), char, font=font, embedded_color=True)
    if canvas.getchannel("A").getbbox() is None:
        return None
    white = Image.new("RGBA", canvas.size, (255, 255, 255, 255))
    return Image.alpha_composite(white, canvas).convert("RGB").resize((size, size), Image.Resampling.LANCZOS)


def build_emoji(out: Path, size: int = 64) -> None:
    """Render every named single-code-point emoji of Noto Color Emoji (see the module docstring)."""
    from PIL import ImageFont

    if not EMOJI_FONT.is_file():
        raise DataError(f"the emoji font {EMOJI_FONT} is missing; install it with: {EMOJI_INSTALL}")
    # one code point at a time needs no shaping; the basic layout also takes separators and controls
    font = ImageFont.truetype(str(EMOJI_FONT), FONT_SIZE, layout_engine=ImageFont.Layout.BASIC)
    (out / "images").mkdir(parents=True)
    rows: dict[str, list[str]] = {"train": [], "val": []}
    for cp in (c for r in CANDIDATES for c in r):
        name = unicodedata.name(chr(cp), "")
        if not name or any(cp in r for r in EXCLUDED):
            continue  # unnamed in this Python's Unicode tables, or not a picture
        image = render_emoji(font, chr(cp), size)
        if image is None:
            continue
        rel = f"images/{cp:X}.png"
        image.save(out / rel)
        row = {"image": rel, "caption": name.lower(), "codepoint": f"{cp:X}"}
        rows[emoji_split(cp)].append(json.dumps(row))
    for split, lines in rows.items():
        (out / f"{split}.jsonl").write_text("\n".join(lines) + "\n")
    total = sum(map(len, rows.values()))
    (out / "README.md").write_text(
        f"emoji: {total} single-code-point emoji rendered from Noto Color Emoji ({size}x{size} RGB on white), "
        f"captions = Unicode names. train {len(rows['train'])} / val {len(rows['val'])} by a hash of the "
        "code point.\n"
    )
