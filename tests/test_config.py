"""Recipe loading: strict keys with did-you-mean, types kept, overrides, references, registry."""

from dataclasses import dataclass
from pathlib import Path

import pytest

from mmformer.recipe import RecipeError, load_recipe, recipe_from_yaml, recipe_to_yaml
from mmformer.registry import lookup, register

QUICKSTART = Path(__file__).parents[1] / "recipes/image/vit_tiny_classify_mnist5k.yaml"


def test_quickstart_resolves_with_types():
    r = load_recipe(QUICKSTART)
    assert r.optim.lr == 2e-3 and isinstance(r.optim.lr, float)
    assert r.model.backbone.d_model == 128 and r.model.backbone.head_dim == 32
    assert r.model.tokenizers["image"].num_patches == 16
    assert r.tasks["mnist"].data.root == "mnist5k"


@pytest.mark.parametrize(
    ("override", "expected"),
    [
        ("optim.lrr=1e-3", "Did you mean 'optim.lr'?"),
        ("trainer.max_epoch=3", "Did you mean 'trainer.max_epochs'?"),
        ("model.tokenizers.image.patch_sise=4", "Did you mean 'model.tokenizers.image.patch_size'?"),
        ("tasks.mnist.data.batchsize=8", "Did you mean 'tasks.mnist.data.batch_size'?"),
        ("model.heads.digits.kind=clasifier", "Did you mean 'classifier'?"),
        ("tasks.mnist.head=digit", "Did you mean 'digits'?"),
        ("nme=x", "Did you mean 'name'?"),
    ],
)
def test_typos_name_the_key_and_suggest(override, expected):
    with pytest.raises(RecipeError) as e:
        load_recipe(QUICKSTART, [override])
    assert expected in str(e.value)


def test_typo_in_file_names_nested_key(tmp_path):
    text = QUICKSTART.read_text().replace("warmup_steps", "warmup_step")
    (tmp_path / "r.yaml").write_text(text)
    with pytest.raises(RecipeError, match=r"'optim.warmup_step'.*Did you mean 'optim.warmup_steps'"):
        load_recipe(tmp_path / "r.yaml")


def test_wrong_type_names_key_and_expected_type():
    with pytest.raises(RecipeError, match=r"'trainer.max_epochs' expects int, got 'abc'"):
        load_recipe(QUICKSTART, ["trainer.max_epochs=abc"])
    with pytest.raises(RecipeError, match=r"'optim.lr' expects float"):
        load_recipe(QUICKSTART, ["optim.lr=fast"])


def test_override_values_are_typed():
    r = load_recipe(
        QUICKSTART,
        [
            "optim.lr=3e-4",
            "trainer.max_time=null",
            "model.backbone.qkv_bias=false",
            "optim.betas.1=0.95",
            "trainer.devices=[0,1]",
            "seed=7",
        ],
    )
    assert r.optim.lr == 3e-4 and isinstance(r.optim.lr, float)
    assert r.trainer.max_time is None
    assert r.model.backbone.qkv_bias is False
    assert r.optim.betas == [0.9, 0.95]
    assert r.trainer.devices == [0, 1]
    assert r.seed == 7


def test_derived_values_are_checked():
    with pytest.raises(RecipeError, match="not divisible by n_heads"):
        load_recipe(QUICKSTART, ["model.backbone.n_heads=3"])
    with pytest.raises(RecipeError, match="not divisible by patch_size"):
        load_recipe(QUICKSTART, ["model.tokenizers.image.patch_size=5"])
    with pytest.raises(RecipeError, match="'logger'.*choose auto"):
        load_recipe(QUICKSTART, ["logger.mode=of"])


def test_preset_fills_unset_sizes_only(tmp_path):
    text = QUICKSTART.read_text().replace(
        "{d_model: 128, n_layers: 4, n_heads: 4,", "{preset: small, n_layers: 2,"
    )
    (tmp_path / "r.yaml").write_text(text)
    r = load_recipe(tmp_path / "r.yaml")
    b = r.model.backbone
    assert (b.d_model, b.n_layers, b.n_heads) == (384, 2, 6)


def test_missing_required_value(tmp_path):
    (tmp_path / "r.yaml").write_text(QUICKSTART.read_text().replace("num_classes: 10, ", ""))
    with pytest.raises(RecipeError, match="'model.heads.digits.num_classes'.*missing mandatory value"):
        load_recipe(tmp_path / "r.yaml")


def test_yaml_round_trip_is_identical():
    r = load_recipe(QUICKSTART, ["optim.lr=2e-3"])
    assert recipe_from_yaml(recipe_to_yaml(r)) == r


def test_bad_yaml_and_missing_file(tmp_path):
    (tmp_path / "bad.yaml").write_text("name: [unclosed\n")
    with pytest.raises(RecipeError, match="not valid YAML"):
        load_recipe(tmp_path / "bad.yaml")
    with pytest.raises(FileNotFoundError):
        load_recipe(tmp_path / "nope.yaml")


def test_user_registered_component_is_validated(tmp_path):
    @dataclass
    class WideHeadConfig:
        kind: str = "wide_head_test"
        num_classes: int = 3
        width: int = 8

    @register("head", "wide_head_test", WideHeadConfig)
    def build(cfg, d_model, tokenizer, ctx):
        raise NotImplementedError

    assert lookup("head", "wide_head_test").config is WideHeadConfig
    text = QUICKSTART.read_text().replace(
        "{kind: classifier, num_classes: 10, pool: mean, fc_norm: true}", "{kind: wide_head_test}"
    )
    (tmp_path / "r.yaml").write_text(text)
    r = load_recipe(tmp_path / "r.yaml", ["model.heads.digits.width=16"])
    assert r.model.heads["digits"].width == 16
    with pytest.raises(RecipeError, match="Did you mean 'model.heads.digits.width'"):
        load_recipe(tmp_path / "r.yaml", ["model.heads.digits.widht=16"])


@pytest.mark.parametrize(
    ("override", "expected"),
    [
        ("model.tokenizers.image.patch_size=0", "'model.tokenizers.image': patch_size must be > 0"),
        ("model.backbone.n_heads=0", "'model.backbone': n_heads must be > 0"),
        ("model.tokenizers.image.in_chans=2", "in_chans must be 1 (grayscale) or 3 (RGB)"),
        ("tasks.mnist.data.batch_size=0", "'tasks.mnist.data': batch_size must be > 0"),
        ("model.backbone.drop_path=1.5", "drop_path must be in [0, 1)"),
        ("trainer.max_epochs=null", "set 'trainer.max_epochs' or 'trainer.max_steps'"),
        ("checkpoint.mode=maximum", "choose min or max"),
    ],
)
def test_bad_values_name_their_section(override, expected):
    with pytest.raises(RecipeError) as e:
        load_recipe(QUICKSTART, [override])
    assert expected in str(e.value)


def test_cls_pooling_needs_a_class_token():
    with pytest.raises(RecipeError, match="pool' is 'cls' but tokenizer 'image' has class_token: false"):
        load_recipe(QUICKSTART, ["model.tokenizers.image.class_token=false", "model.heads.digits.pool=cls"])


def test_unused_head_is_an_error():
    with pytest.raises(RecipeError, match="'model.heads.spare' is not used by any task"):
        load_recipe(QUICKSTART, ["model.heads.spare={kind: classifier, num_classes: 3}"])


def test_checkpoint_monitor_typo_is_caught_before_training():
    from mmformer.build import build_module, default_monitor

    r = load_recipe(QUICKSTART, ["checkpoint.monitor=val/mnist/accuracy"])
    with pytest.raises(RecipeError, match="Did you mean 'val/mnist/acc'"):
        default_monitor(r, build_module(r))
    r = load_recipe(QUICKSTART, ["checkpoint.monitor=val/mnist/loss"])
    assert default_monitor(r, build_module(r)) == ("val/mnist/loss", "min")
    assert default_monitor(load_recipe(QUICKSTART), build_module(r)) == ("val/mnist/acc", "max")


WHISPER_CONV_RECIPE = """\
name: conv
model:
  tokenizers: {audio: {kind: whisper_conv, n_mels: 80, max_seconds: 5.0, freq_mask: 12, time_mask: 40}}
  backbone: {d_model: 384, n_layers: 1, n_heads: 6}
  heads: {app: {kind: classifier, num_classes: 9, pool: mean, fc_norm: true}}
tasks:
  prompts: {kind: classification, tokenizer: audio, head: app, data: {kind: audio_manifest, root: asterisk-prompts}}
trainer: {max_epochs: 1}
"""


def test_whisper_conv_tokenizer_is_an_audio_kind_with_thirty_seconds_of_positions(tmp_path):
    from mmformer.build import BuildContext, build_model

    path = tmp_path / "conv.yaml"
    path.write_text(WHISPER_CONV_RECIPE)
    r = load_recipe(path)
    assert BuildContext(r).tokenizer_modality(r.model.tokenizers["audio"]) == "audio"
    assert r.model.tokenizers["audio"].sample_rate == 16_000
    tok = build_model(r).tokenizers["audio"]
    assert tok.n_ctx == 251 and tok.pos_embed.shape == (251, 384)  # 5 s: 500 frames → 250 tokens
    with pytest.raises(RecipeError, match="30 s of positions"):
        load_recipe(path, ["model.tokenizers.audio.max_seconds=31"])
