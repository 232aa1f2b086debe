"""A run's records read back from the files users read: ``metrics.csv`` and the offline W&B log. Media
share the step of the validation they show; a row carries only what its own step logged."""

from __future__ import annotations

import csv
from pathlib import Path

from mmformer.cli import main
from tests.conftest import make_image_folder
from tests.multitask.test_joint_training import JOINT
from tests.tasks.test_audio_classification import RECIPE as TONES
from tests.tasks.test_audio_classification import make_tones
from tests.wandb_records import read_records


def csv_rows(run_dir: Path) -> list[dict[str, str]]:
    """The rows of ``metrics.csv`` with their empty cells dropped."""
    with open(run_dir / "metrics.csv", newline="") as f:
        return [{k: v for k, v in row.items() if v != ""} for row in csv.DictReader(f)]


def wandb_rows(run_dir: Path) -> list[dict]:
    """History rows of every offline W&B segment of a run, in order, each with its ``_step``."""
    import json

    rows = []
    for path in sorted(run_dir.glob("wandb/offline-run-*/*.wandb")):
        for r in read_records(path):
            if r.WhichOneof("record_type") == "history":
                row = {i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in r.history.item}
                rows.append(row | {"_step": r.history.step.num})
    return rows


def test_media_share_the_step_of_the_validation_they_show(workdir):
    # the case: an audio classifier, one epoch of two steps, validated at its end
    make_tones(workdir / "tones", n=8)
    recipe = workdir / "tones.yaml"
    recipe.write_text(TONES.format(root=workdir / "tones").replace("max_epochs: 6", "max_epochs: 1"))
    assert main(["train", str(recipe), "tasks.toy.data.drop_last=true"]) == 0
    run = next((workdir / "runs" / "tones").iterdir())
    rows = wandb_rows(run)
    val = [r["trainer/global_step"] for r in rows if "val/toy/acc" in r]
    tables = [r["trainer/global_step"] for r in rows if "audio/toy/_type" in r]  # a table of clips
    assert val == [1] and tables == val  # 2 optimizer steps: Lightning logs the validation at step 1
    assert [int(r["step"]) for r in csv_rows(run) if "val/toy/acc" in r] == val
    pictures = [r["trainer/global_step"] for r in rows if "predictions/toy/_type" in r]  # spectrograms
    assert pictures == val
    assert sorted(p.name for p in run.glob("predictions/*.png")) == [f"toy-step{val[0]:06d}.png"]


def test_a_task_appears_only_on_the_steps_that_trained_it(workdir):
    images = make_image_folder(workdir / "images")
    docs = [f"Chapter {i}\nAnd the light was good, and the day was {i}.\nAnd it was so." for i in range(40)]
    (workdir / "corpus.txt").write_text("\n\n".join(docs) + "\n")
    recipe = workdir / "joint.yaml"
    recipe.write_text(JOINT.format(images=images, corpus=workdir / "corpus.txt"))
    assert main(["train", str(recipe), "multitask.schedule=sampled", "trainer.max_epochs=2"]) == 0
    run = next((workdir / "runs" / "joint").iterdir())
    steps = [r for r in csv_rows(run) if "train/loss" in r]
    assert len(steps) == len({r["step"] for r in steps}) >= 16  # one row per optimizer step
    trained = [[t for t in ("shapes", "corpus") if f"train/{t}/loss" in r] for r in steps]
    assert all(len(t) == 1 for t in trained), trained  # a sampled schedule trains one task per step
    assert {t[0] for t in trained} == {"shapes", "corpus"}
    modality = {"shapes": "image", "corpus": "text"}
    for row, (task,) in zip(steps, trained):
        other = "corpus" if task == "shapes" else "shapes"
        assert f"train/modality/{modality[task]}/loss" in row
        assert f"train/modality/{modality[other]}/loss" not in row
        assert not any(k.startswith(f"throughput/{other}/") for k in row), row
    assert all("train/grad_norm" in r for r in steps)  # logged on every written row (log_every_n_steps=1)
