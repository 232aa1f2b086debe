"""``BuildContext``: everything a build reads besides the recipe's own values, as one value handed to
every builder — no module state.

It holds the recipe, what a checkpoint carries (its text tokenizers, and the architectures of its
pretrained sources, so a resumed or re-evaluated run reads data with the tokenizers its weights were
trained with and needs neither the original pretrained files nor their packages), and what this build
has loaded so far: each pretrained source once (so a tokenizer, backbone and head of one source share
tensors and a tied LM head stays tied), each BPE once. One context serves one model build and its data.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from ..data.audio import manifest_rows
from ..data.image_caption import read_captions
from ..data.roots import resolve_root
from ..data.text import corpus_split
from ..errors import RecipeError, SourceNotFoundError
from ..models.pretrained import (
    FAMILY_MODALITY,
    Pretrained,
    build_bert,
    build_llama,
    build_timm_vit,
    load_pretrained,
    load_pretrained_tokenizer,
    pretrained_family,
    resolve_pretrained,
)
from ..models.pretrained.timm_vit import describe_timm_vit
from ..models.pretrained.whisper import build_whisper_source, whisper_tokenizer
from ..tokenizers.text import IMAGE_MARKERS, MASK_TOKEN, TextTokenizer

ARCHITECTURES = {
    "llama": build_llama,
    "bert": build_bert,
    "whisper": build_whisper_source,
    "timm_vit": build_timm_vit,
}


def _model_parts(recipe):
    """``(key, config)`` of every model part: backbone, towers, tokenizers, heads (none without a recipe:
    a context built for one part alone)."""
    if recipe is None:
        return
    m = recipe.model
    yield "model.backbone", m.backbone
    yield from ((f"model.towers.{n}", c) for n, c in m.towers.items())
    yield from ((f"model.tokenizers.{n}", c) for n, c in m.tokenizers.items())
    yield from ((f"model.heads.{n}", c) for n, c in m.heads.items())


class BuildContext:
    """The state of one build. ``text_tokenizers``: name → ``TextTokenizer`` used instead of loading or
    training one; ``pretrained``: ``{source: {"family", "config"}}`` built from their configs without
    reading weights (the checkpoint's state dict supplies them)."""

    def __init__(
        self,
        recipe,
        text_tokenizers: dict[str, TextTokenizer] | None = None,
        pretrained: dict[str, dict] | None = None,
    ):
        self.recipe = recipe
        self.pinned_text = dict(text_tokenizers or {})
        self.pinned_pretrained = dict(pretrained or {})
        self.loaded: dict[str, Pretrained] = {}  # resolved source → what this build loaded from it
        self.d_model: int | None = None  # the shared backbone's width, once it is built
        self._text: dict[str, TextTokenizer] = {}
        self._source_configs: dict[str, dict] = {}

    @classmethod
    def from_checkpoint(cls, recipe, ckpt: dict | None) -> BuildContext:
        """A context that builds what ``ckpt`` (a loaded mmformer checkpoint, or None) was trained with."""
        state = (ckpt or {}).get("mmformer", {})
        tokenizers = {n: TextTokenizer.from_json(j) for n, j in state.get("tokenizers", {}).items()}
        return cls(recipe, tokenizers, state.get("pretrained", {}))

    # ----------------------------------------------------------------------------------- pretrained
    def pretrained(self, source: str) -> Pretrained:
        """The weights of ``source``, loaded once per file however the recipe spells it (or rebuilt
        from a checkpoint's pinned architecture)."""
        pinned = self.pinned_pretrained.get(source)
        key = source if pinned else str(self._resolved(source).resolve())
        if key not in self.loaded:
            if pinned:
                model = ARCHITECTURES[pinned["family"]](pinned["config"])
                self.loaded[key] = Pretrained(model, None, pinned["config"], pinned["family"], source)
            else:
                self.loaded[key] = load_pretrained(source, decoder=self._needs_decoder(source))
                self.loaded[key].source = source
        return self.loaded[key]

    def _needs_decoder(self, source: str) -> bool:
        """Whether the recipe reads an encoder–decoder source's decoder (Whisper's: a part with
        ``part: decoder``, or its LM head), so the whole model is loaded, not the encoder alone."""
        return any(
            getattr(c, "source", None) == source
            and (key.startswith("model.heads.") or getattr(c, "part", None) == "decoder")
            for key, c in _model_parts(self.recipe)
        )

    def _resolved(self, source: str) -> Path:
        """``resolve_pretrained(source)``; raises ``SourceNotFoundError`` naming the recipe keys that
        hold ``source`` (``model.backbone.source`` …), not the part of the build that read it first."""
        try:
            return resolve_pretrained(source)
        except FileNotFoundError as e:
            parts = _model_parts(self.recipe)
            keys = [f"'{k}.source'" for k, c in parts if getattr(c, "source", None) == source]
            what = f"{source!r} does not exist" if "/" in source or source.startswith(".") else e.args[0]
            raise SourceNotFoundError(f"{', '.join(keys) or 'source'}: {what}", source) from None

    def pretrained_configs(self) -> dict[str, dict]:
        """``{source: {"family", "config"}}`` of every source this build used: checkpoints carry it."""
        return {p.source: {"family": p.family, "config": p.config} for p in self.loaded.values()}

    def source_config(self, source: str) -> dict:
        """The description of a pretrained source (pinned, or read from the source once; a timm ViT is
        described from its config and file header alone)."""
        pinned = self.pinned_pretrained.get(source)
        if pinned:
            return pinned["config"]
        key = str(self._resolved(source).resolve())
        if key not in self._source_configs:
            timm = pretrained_family(source) == "timm_vit"
            self._source_configs[key] = describe_timm_vit(key) if timm else self.pretrained(source).config
        return self._source_configs[key]

    def tokenizer_modality(self, cfg) -> str:
        """``text``, ``audio`` or ``image``: what a tokenizer config reads (pretrained ones by their
        family; every other config declares ``modality``, default ``image``)."""
        if cfg.kind == "pretrained":
            pinned = self.pinned_pretrained.get(cfg.source)
            if not pinned:
                self._resolved(cfg.source)
            if getattr(cfg, "part", None) == "decoder":  # an encoder–decoder's text side
                return "text"
            return FAMILY_MODALITY[pinned["family"] if pinned else pretrained_family(cfg.source)]
        return getattr(cfg, "modality", "image")

    def image_spec(self, tok_cfg):
        """What the data side needs of an image tokenizer's config (``image_size``, ``in_chans``): the
        config itself, or for a pretrained image encoder the recipe's overrides, else the checkpoint's."""
        if tok_cfg.kind != "pretrained":
            return tok_cfg
        config = self.source_config(tok_cfg.source)
        h, w = config["image_size"]
        if tok_cfg.image_size is None and h != w:
            raise RecipeError(f"{tok_cfg.source} takes {h}×{w} images; set image_size for square ones")
        return SimpleNamespace(
            image_size=tok_cfg.image_size or h, in_chans=tok_cfg.in_chans or config["in_chans"]
        )

    def num_classes(self, task) -> int | None:
        """The classes a task's data must have: its head's, else its tokenizer's (a class-conditional
        DiT); a pretrained timm classifier has the checkpoint's unless the recipe gives ``num_classes``."""
        m = self.recipe.model
        head = m.heads.get(getattr(task, "head", None))
        tok = m.tokenizers.get(getattr(task, "tokenizer", None))
        n = getattr(head, "num_classes", None) or getattr(tok, "num_classes", None)
        if (
            n is None
            and head is not None
            and head.kind == "pretrained"
            and self.tokenizer_modality(tok) == "image"
        ):
            n = self.source_config(head.source).get("num_classes") or None
        return n

    # ----------------------------------------------------------------------------------- text
    def text_tokenizer(self, name: str) -> TextTokenizer:
        """The data-side BPE of ``model.tokenizers.<name>``: pinned (from a checkpoint), loaded from
        ``path`` or the pretrained source, or trained once on the training documents of the first task
        that reads it (cached as ``<corpus>/.cache/bpe-<vocab>-<hash of those documents>.json``)."""
        if name in self.pinned_text:
            return self.pinned_text[name]
        recipe = self.recipe
        cfg = recipe.model.tokenizers[name]
        if (
            cfg.kind == "pretrained" and cfg.part == "decoder"
        ):  # Whisper's: its prompt needs the model's sizes
            path = self._resolved(cfg.source)
            if pretrained_family(cfg.source) != "whisper":
                raise RecipeError(
                    f"'model.tokenizers.{name}.part' applies to encoder–decoder sources (Whisper)"
                )
            make = lambda: whisper_tokenizer(path, self.source_config(cfg.source))  # noqa: E731
            return self._cached(f"pretrained-decoder:{cfg.source}", make)
        if cfg.kind == "pretrained":
            self._resolved(cfg.source)
            return self._cached(f"pretrained:{cfg.source}", lambda: load_pretrained_tokenizer(cfg.source))
        if cfg.path:
            return self._cached(f"file:{cfg.path}", lambda: TextTokenizer.from_file(cfg.path))
        docs, train, root = self._training_documents(name)
        digest = hashlib.sha256()
        for i in train:  # the exact training documents decide the tokenizer
            digest.update(docs[i].encode("utf-8") + b"\0")
        masked = any(t.kind == "masked_lm" and t.tokenizer == name for t in recipe.tasks.values())
        # <boi> / <eoi> for a task mixing images into its text (``image_markers``: Transfusion)
        marked = any(
            getattr(t, "image_markers", False) and getattr(t, "caption_tokenizer", None) == name
            for t in recipe.tasks.values()
        )
        key = f"bpe-{cfg.vocab_size}-{digest.hexdigest()[:16]}" + ("-mask" if masked else "")
        key += "-boi" if marked else ""
        path = (root if root.is_dir() else root.parent) / ".cache" / f"{key}.json"
        special = {**({"mask": MASK_TOKEN} if masked else {}), **(IMAGE_MARKERS if marked else {})}

        def load_or_train() -> TextTokenizer:
            if path.is_file():
                return TextTokenizer.from_file(path, special or None)
            tok = TextTokenizer.train((docs[i] for i in train), vocab_size=cfg.vocab_size, mask=masked)
            if marked:  # the markers join the vocabulary as special tokens (single ids, never split)
                tok = TextTokenizer(tok.tokenizer, {**tok.special, **IMAGE_MARKERS})
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")  # atomic: ranks may race here
            tok.save(tmp)
            os.replace(tmp, path)
            return tok

        return self._cached(key, load_or_train)

    def _cached(self, key: str, make) -> Any:
        if key not in self._text:
            self._text[key] = make()
        return self._text[key]

    def _training_documents(self, name: str):
        """(documents, indices of the training ones, root) a new BPE for ``name`` is trained on: the
        corpus of a text task that reads it, else the training captions of a caption task."""
        tasks = self.recipe.tasks.values()
        task = next((t for t in tasks if t.tokenizer == name and t.data.kind == "text"), None)
        if task is not None:
            root = resolve_root(task.data.root)
            docs, train, _ = corpus_split(root, task.data.val_fraction, self.recipe.seed)
            return docs, train, root
        captioned = next(
            (
                t
                for t in tasks
                if getattr(t, "caption_tokenizer", None) == name
                and t.data.kind in ("image_caption", "audio_caption")
            ),
            None,
        )
        if captioned is None:
            raise RecipeError(
                f"'model.tokenizers.{name}' has no path and no text task to train it on: set its path "
                "to a tokenizer.json"
            )
        data = captioned.data
        root = resolve_root(data.root)
        manifest = root / f"{data.train_split}.jsonl"
        if data.kind == "image_caption":
            docs = [c for _, c in read_captions(manifest)]
        else:
            docs = [str(r[data.text_key]) for r in manifest_rows(manifest, data.text_key)]
        return docs, range(len(docs)), root
