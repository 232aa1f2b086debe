"""``recipe.model_changes``: what ``resume=auto`` asks of a run folder's recipe — does it describe
another model than the recipe about to train? Real recipes, their saved YAML as runs write it."""

from __future__ import annotations

from pathlib import Path

from mmformer.recipe import load_recipe, recipe_to_yaml
from mmformer.recipe.model_changes import model_changes

LISTOPS = Path(__file__).resolve().parents[1] / "recipes" / "long_context" / "lra_listops.yaml"


def _saved(*overrides: str) -> str:
    return recipe_to_yaml(load_recipe(LISTOPS, list(overrides)))  # what RunFolder writes


def test_the_same_model_with_other_training_settings_is_no_change():
    saved = _saved()
    assert model_changes(saved, load_recipe(LISTOPS)) == []
    assert (
        model_changes(saved, load_recipe(LISTOPS, ["optim.lr=3e-4", "trainer.max_steps=9", "seed=3"])) == []
    )


def test_another_kernel_width_or_kernel_option_is_another_model():
    saved = _saved()
    assert model_changes(saved, load_recipe(LISTOPS, ["model.backbone.attn_kernel=lsh"])) == [
        "model.backbone.attn_kernel: 'auto' → 'lsh'"
    ]
    assert model_changes(saved, load_recipe(LISTOPS, ["model.backbone.d_model=128"])) == [
        "model.backbone.d_model: 64 → 128"
    ]
    rfa = _saved("model.backbone.attn_kernel=rfa")  # kernel_options {} → {n_features: 64}: inside a free map
    assert model_changes(
        rfa,
        load_recipe(
            LISTOPS, ["model.backbone.attn_kernel=rfa", "model.backbone.kernel_options={n_features: 64}"]
        ),
    ) == ["model.backbone.kernel_options.n_features: None → 64"]


def test_runtime_settings_and_the_softmax_kernels_keep_the_model():
    saved = _saved()
    same = ["model.backbone.attn_kernel=sdpa", "model.backbone.sdpa_backend=math", "model.backbone.drop=0.1"]
    assert model_changes(saved, load_recipe(LISTOPS, same)) == []


def test_keys_a_saved_recipe_lacks_compare_at_their_defaults():
    """A run written by an older mmformer lacks the keys added since: they load at their defaults (what
    that version did), and an older schema's key this version cannot load is compared as written."""
    saved = _saved()
    assert "    rel_buckets: 32\n" in saved  # at its default
    assert model_changes(saved.replace("    rel_buckets: 32\n", ""), load_recipe(LISTOPS)) == []
    assert model_changes(saved.replace("    final_norm: false\n", ""), load_recipe(LISTOPS)) == [
        "model.backbone.final_norm: True → False"  # the older run had the default: another model
    ]
    retired = saved.replace("  backbone:\n", "  backbone:\n    retired_key: 3\n", 1)
    assert model_changes(retired, load_recipe(LISTOPS)) == ["model.backbone.retired_key: 3 → None"]
    lacking = retired.replace("    final_norm: false\n", "")  # unloadable: compared on its own keys only
    assert model_changes(lacking, load_recipe(LISTOPS)) == ["model.backbone.retired_key: 3 → None"]
