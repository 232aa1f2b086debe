"""Audio classification end to end through the CLI on a tiny real-format audio folder: low vs high
tones of different lengths and sample rates, one corrupt clip; learns, logs clips to W&B, counts the
bad file."""

import numpy as np
import soundfile as sf

from mmformer.cli import main

RECIPE = """\
name: tones
model:
  tokenizers: {{audio: {{kind: ast, sample_rate: 8000, n_fft: 200, hop_length: 80, n_mels: 32,
                        patch_size: [16, 8], patch_stride: [16, 8], max_seconds: 1.0, freq_mask: 4, time_mask: 4}}}}
  backbone: {{preset: debug}}
  heads: {{tone: {{kind: classifier, num_classes: 2, pool: mean}}}}
tasks:
  toy:
    kind: classification
    tokenizer: audio
    head: tone
    data: {{kind: audio_folder, root: {root}, batch_size: 8, drop_last: false}}
optim: {{lr: 3e-3, warmup_steps: 2}}
trainer: {{max_epochs: 6, accelerator: cpu, devices: 1, log_every_n_steps: 1, enable_progress_bar: false,
          num_sanity_val_steps: 0}}
logger: {{mode: offline}}
"""


def make_tones(root, n=12):
    rng = np.random.default_rng(0)
    for split, count in (("train", n), ("val", 4)):
        for label, freq in (("low", 300.0), ("high", 2500.0)):
            (root / split / label).mkdir(parents=True)
            for i in range(count):
                rate = (8000, 16000, 22050)[i % 3]
                t = np.arange(int(rate * rng.uniform(0.2, 1.5))) / rate  # some longer than max_seconds
                wave = 0.3 * np.sin(2 * np.pi * freq * t) + 0.01 * rng.standard_normal(len(t))
                sf.write(root / split / label / f"{i:02d}.wav", wave.astype(np.float32), rate)
    (root / "train" / "low" / "corrupt.wav").write_bytes(b"RIFF....WAVEfmt nonsense")


def test_audio_classifier_learns_tones_and_logs_clips(workdir, capsys):
    make_tones(workdir / "tones")
    recipe = workdir / "tones.yaml"
    recipe.write_text(RECIPE.format(root=workdir / "tones"))
    assert main(["train", str(recipe)]) == 0
    out = capsys.readouterr()
    finals = dict(ln.split() for ln in out.out.splitlines() if ln.startswith("val/"))
    assert float(finals["val/toy/acc"]) == 1.0, out.out[-1500:]
    assert "corrupt.wav" in out.err  # named when skipped

    from tests.wandb_records import read_records

    records = read_records(next((workdir / "runs" / "tones").glob("*/wandb/offline-run-*/*.wandb")))
    keys = {
        "/".join(i.nested_key) or i.key
        for r in records
        if r.WhichOneof("record_type") == "history"
        for i in r.history.item
    }
    assert "audio/toy/_type" in keys  # a table of clips with their predictions
    assert "data/bad_samples 1" in out.out  # counted once over the run
