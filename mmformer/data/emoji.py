"""``emoji``: an image–caption set rendered from Debian's Noto Color Emoji font (DATA.md, Image + caption):
every single-code-point emoji the font draws, its Unicode name as the caption (``grinning face``).

``images/<codepoint>.png`` are RGB on white, ``size``×``size``; ``train.jsonl`` / ``val.jsonl`` hold
``{"image": "images/1F600.png", "caption": "grinning face", "codepoint": "1F600", "group": "smileys and
emotion", "subgroup": "face smiling"}``, split 90 / 10 by a stable hash of the code point, so every task
that uses the set holds out the same emoji. Group and subgroup are Unicode's emoji taxonomy
(``emoji-test.txt`` of Debian's ``unicode-data``; absent for the few pictographs outside it);
``group.json`` maps each group to its zero-shot prompts: the group's name and its subgroups' names.
"""

from __future__ import annotations

import hashlib
import json
import unicodedata
from pathlib import Path

from ..progress import progress
from .roots import DataError

EMOJI_FONT = Path("/usr/share/fonts/truetype/noto/NotoColorEmoji.ttf")
EMOJI_TEST = Path("/usr/share/unicode/emoji/emoji-test.txt")
EMOJI_INSTALL = "apt-get install fonts-noto-color-emoji unicode-data"
FONT_SIZE = 109  # the only size of the font's bitmap strikes (Pillow refuses others)
CANDIDATES = (range(0x2000, 0x2C00), range(0x3000, 0x3300), range(0x1F000, 0x1FB00))
# drawn by the font but not pictures on their own: skin-tone modifiers, flag letters, tag letters
EXCLUDED = (range(0x1F3FB, 0x1F400), range(0x1F1E6, 0x1F200))


def emoji_split(codepoint: int) -> str:
    """``train`` or ``val`` (90 / 10) by a stable hash of the code point."""
    return "val" if int(hashlib.sha256(f"{codepoint:X}".encode()).hexdigest()[:8], 16) % 10 == 0 else "train"


def _name(label: str) -> str:
    return label.lower().replace(" & ", " and ").replace("-", " ")


def emoji_groups(path: Path = EMOJI_TEST) -> dict[int, tuple[str, str]]:
    """Code point → ``(group, subgroup)`` of each single-code-point emoji in Unicode's ``emoji-test.txt``
    (bare or with the emoji presentation selector U+FE0F), names lower-cased (``&`` → ``and``, ``-`` → space)."""
    out: dict[int, tuple[str, str]] = {}
    group = subgroup = ""
    for line in path.read_text(encoding="utf-8").splitlines():
        if line.startswith("# group:"):
            group = _name(line.split(":", 1)[1].strip())
        elif line.startswith("# subgroup:"):
            subgroup = _name(line.split(":", 1)[1].strip())
        elif line.strip() and not line.startswith("#"):
            cps = line.split(";")[0].split()
            if len(cps) == 1 or (len(cps) == 2 and cps[1] == "FE0F"):
                out.setdefault(int(cps[0], 16), (group, subgroup))
    return out


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

    for needed in (EMOJI_FONT, EMOJI_TEST):
        if not needed.is_file():
            raise DataError(f"{needed} is missing; install it with: {EMOJI_INSTALL}")
    groups = emoji_groups()
    present: set[tuple[str, str]] = set()
    # one code point at a time needs no shaping; the basic layout also takes separators and controls
    font = ImageFont.truetype(str(EMOJI_FONT), FONT_SIZE, layout_engine=ImageFont.Layout.BASIC)
    (out / "images").mkdir(parents=True)
    rows: dict[str, list[str]] = {"train": [], "val": []}
    codepoints = [c for r in CANDIDATES for c in r]
    for cp in progress(codepoints, "emoji: rendering", unit="code point"):
        name = unicodedata.name(chr(cp), "")
        if not name or any(cp in r for r in EXCLUDED):
            continue  # unnamed in this Python's Unicode tables, or not a picture
        image = render_emoji(font, chr(cp), size)
        if image is None:
            continue
        rel = f"images/{cp:X}.png"
        image.save(out / rel)
        row = {"image": rel, "caption": name.lower(), "codepoint": f"{cp:X}"}
        if cp in groups:
            row["group"], row["subgroup"] = groups[cp]
            present.add(groups[cp])
        rows[emoji_split(cp)].append(json.dumps(row))
    for split, lines in rows.items():
        (out / f"{split}.jsonl").write_text("\n".join(lines) + "\n")
    prompts: dict[str, list[str]] = {}  # in the taxonomy's order
    for group, subgroup in dict.fromkeys(groups.values()):
        if (group, subgroup) in present:
            prompts.setdefault(group, [group]).append(subgroup)
    (out / "group.json").write_text(json.dumps(prompts, indent=1) + "\n")
    total = sum(map(len, rows.values()))
    (out / "README.md").write_text(
        f"emoji: {total} single-code-point emoji rendered from Noto Color Emoji ({size}x{size} RGB on white), "
        f"captions = Unicode names. train {len(rows['train'])} / val {len(rows['val'])} by a hash of the "
        "code point. group / subgroup: Unicode's emoji-test.txt; group.json: each group's zero-shot prompts.\n"
    )
