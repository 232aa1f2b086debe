"""Every bundled recipe validates and trains a few steps (litgpt's test_config_hub). Bundled datasets
are prepared on demand, as `mmformer train` does for a new user, into one data root the recipe tests
share: the first recipe that needs a dataset prepares it (and says so), the later ones read it (the
synthesised speech sets take over a minute each to prepare)."""

from __future__ import annotations

import csv
import math
import shutil
from pathlib import Path

import pytest

from mmformer.cli import main
from mmformer.data.prepare import BUNDLED
from mmformer.recipe import load_recipe
from mmformer.training.cpu_bf16 import bf16_hint

ROOT = Path(__file__).parents[1]
RECIPES = sorted((ROOT / "recipes").rglob("*.yaml"))
# Pretrained sources a recipe's comment says how to produce from another recipe: made here with that
# recipe's architecture (random weights), in timm's layout, so the fine-tuning path runs end to end.
PRODUCED = {"pretrained/vit_tiny_mnist5k": "recipes/image/vit_tiny_classify_mnist5k.yaml"}
# VQ codecs a recipe's header says to train first (`# Source: mmformer train recipes/image/vq_*.yaml`):
# trained here for real, one step, once per test session, then copied where the recipe reads them.
TRAINED = {
    "pretrained/vq_mnist5k.ckpt": "recipes/image/vq_mnist5k.yaml",
    "pretrained/vq_emoji.ckpt": "recipes/image/vq_emoji.yaml",
}


def _produce_sources(recipe, where: Path) -> None:
    from mmformer.build import build_model
    from mmformer.models.pretrained.timm_export import save_timm_vit, vit_config

    parts = [*recipe.model.tokenizers.values(), recipe.model.backbone, *recipe.model.heads.values()]
    for source in {c.source for c in parts if c.kind == "pretrained"} & set(PRODUCED):
        if not (where / source).exists():
            model = build_model(load_recipe(ROOT / PRODUCED[source]))
            save_timm_vit(model, vit_config(model), where / source)


def test_recipes_exist():
    assert RECIPES


@pytest.mark.parametrize("path", RECIPES, ids=lambda p: p.stem)
def test_recipe_opens_with_launch_comment_and_name_matches(path):
    text = path.read_text()
    assert text.startswith("#") and "Launch:" in text.split("\n\n")[0]
    assert load_recipe(path).name == path.stem


@pytest.fixture(scope="module")
def shared_data(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("recipe-data")


def _train_sources(recipe, where: Path, cache: Path, overrides: list[str], capsys) -> None:
    """The codecs in ``TRAINED`` that the recipe reads (a tokenizer's ``checkpoint``), trained by their
    own recipe into ``cache`` when missing there and copied to ``where``."""
    wanted = {getattr(c, "checkpoint", None) for c in recipe.model.tokenizers.values()} & set(TRAINED)
    for source in sorted(wanted):
        cached = cache / source
        if not cached.is_file():
            runs = cache / "runs"
            codec = load_recipe(ROOT / TRAINED[source])
            own = [f"tasks.{name}.data.num_workers=0" for name in codec.tasks]
            with pytest.MonkeyPatch.context() as mp:
                mp.setenv("MMFORMER_RUNS", str(runs))
                assert main(["train", str(ROOT / TRAINED[source]), *overrides, *own]) == 0
            capsys.readouterr()  # the codec run's report is not the recipe's
            (last,) = runs.glob(f"{Path(TRAINED[source]).stem}/*/checkpoints/last.ckpt")
            cached.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(last, cached)
        (where / source).parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(cached, where / source)


@pytest.fixture(scope="module")
def trained_sources(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("recipe-sources")


@pytest.mark.slow
@pytest.mark.parametrize("path", RECIPES, ids=lambda p: p.stem)
def test_recipe_trains_a_few_steps(path, workdir, shared_data, trained_sources, capsys, monkeypatch):
    monkeypatch.chdir(workdir)  # relative pretrained sources resolve here
    monkeypatch.setenv("MMFORMER_DATA", str(shared_data))
    recipe = load_recipe(path)
    prepared = {t.data.root for t in recipe.tasks.values() if (shared_data / str(t.data.root)).exists()}
    _produce_sources(recipe, workdir)
    for task in recipe.tasks.values():  # a bundled source this machine cannot provide → skip, saying why
        missing = BUNDLED[task.data.root].missing() if task.data.root in BUNDLED else None
        if missing:
            pytest.skip(missing)
    overrides = [
        "trainer.max_steps=3",
        "trainer.log_every_n_steps=1",
        "trainer.limit_val_batches=2",
        "trainer.num_sanity_val_steps=0",
        "trainer.enable_progress_bar=false",
        "logger.mode=disabled",
        "trainer.accelerator=cpu",
        "trainer.devices=1",
        "checkpoint.save_top_k=0",  # last.ckpt is still written; a second 1.6 GB copy (SmolLM2) is not
    ]
    if bf16_hint(recipe.trainer.precision, "cpu"):
        # bfloat16 without oneDNN's kernels is PyTorch's slow fallback (the Whisper recipes: 10-12 minutes
        # each for 3 steps, 0.05 samples/s, on an AVX2 CPU); the bf16-mixed path of `mmformer train` and
        # its hint are tested on the tiny recipe (tests/training/test_cpu_bf16.py, test_optim.py)
        overrides.append("trainer.precision=32-true")
    _train_sources(recipe, workdir, trained_sources, overrides, capsys)  # may prepare the data itself
    prepared |= {t.data.root for t in recipe.tasks.values() if (shared_data / str(t.data.root)).exists()}
    overrides += [f"tasks.{name}.data.num_workers=0" for name in recipe.tasks]
    for name, task in recipe.tasks.items():  # the sample grid after validation: small and few steps
        if task.kind in ("diffusion", "maskgit"):
            overrides += [f"tasks.{name}.sample_steps=2", f"tasks.{name}.samples_per_class=1"]
        elif task.kind in ("transfusion", "chameleon"):
            overrides += [f"tasks.{name}.samples_per_caption=1", f"tasks.{name}.sample_captions=2"]
            overrides += [f"tasks.{name}.sample_steps=2"] if task.kind == "transfusion" else []
    assert main(["train", str(path), *overrides]) == 0
    captured = capsys.readouterr()
    out = captured.out
    for task in recipe.tasks.values():  # a missing bundled dataset is prepared, saying so
        if task.data.root in BUNDLED and task.data.root not in prepared:
            assert f"bundled dataset '{task.data.root}' is missing" in captured.err
    finals = [ln for ln in out.splitlines() if ln.startswith("val/")]
    assert finals, out[-2000:]
    for line in finals:
        assert math.isfinite(float(line.split()[1])), line
    run = Path(out.split("run folder: ")[1].split()[0])
    losses = [
        float(r["train/loss"]) for r in csv.DictReader(open(run / "metrics.csv")) if r.get("train/loss")
    ]
    assert len(losses) >= 1 and all(math.isfinite(v) for v in losses)
