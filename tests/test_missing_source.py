"""A pretrained ``source`` that does not exist yet (a fine-tune run before the export its recipe's
header describes) is named by the recipe keys that hold it, with the header's steps that create it —
not blamed on the task's data that happened to read it first."""

from pathlib import Path

import pytest

from mmformer.cli import main
from mmformer.errors import SourceNotFoundError
from mmformer.recipe import load_recipe
from mmformer.recipe.loading import header_steps

FINETUNE = Path(__file__).parents[1] / "recipes/image/vit_tiny_finetune_digits.yaml"
KEYS = "'model.backbone.source', 'model.tokenizers.image.source', 'model.heads.digits.source'"
STEPS = (
    "; the recipe's header creates it: run mmformer train recipes/image/vit_tiny_classify_mnist5k.yaml, "
    "then mmformer export runs/vit_tiny_classify_mnist5k/<id>/checkpoints/last.ckpt pretrained/vit_tiny_mnist5k"
)


@pytest.fixture
def no_export(workdir, monkeypatch):
    monkeypatch.chdir(workdir)  # where pretrained/vit_tiny_mnist5k does not exist
    return workdir


@pytest.mark.parametrize("command", ["info", "train"])
def test_cli_names_the_source_keys_and_the_export_step(command, no_export, capsys):
    assert main([command, str(FINETUNE)]) == 2
    err = capsys.readouterr().err
    assert err == f"mmformer: error: {KEYS}: 'pretrained/vit_tiny_mnist5k' does not exist{STEPS}\n"
    assert "tasks.digits.data" not in err


def test_builders_raise_it_naming_the_keys(no_export):
    from mmformer.build import build_datamodule, build_model

    recipe = load_recipe(FINETUNE)
    for build in (build_datamodule, build_model):
        with pytest.raises(SourceNotFoundError) as e:
            build(recipe)
        assert str(e.value) == f"{KEYS}: 'pretrained/vit_tiny_mnist5k' does not exist"
        assert e.value.source == "pretrained/vit_tiny_mnist5k"


def test_header_steps_stop_at_the_one_naming_the_source(tmp_path):
    recipe = tmp_path / "ft.yaml"
    recipe.write_text(
        "# Launch: mmformer train ft.yaml\n"
        "# Source: mmformer train base.yaml\n"
        "#         mmformer export runs/base/<id>/checkpoints/last.ckpt out/base\n"
        "#         mmformer data prepare unrelated\n"
        "name: ft   # mmformer export not/a/header/line\n"
    )
    assert header_steps(recipe, "out/base") == [
        "mmformer train base.yaml",
        "mmformer export runs/base/<id>/checkpoints/last.ckpt out/base",
    ]
    assert header_steps(recipe, "elsewhere/weights") == []
