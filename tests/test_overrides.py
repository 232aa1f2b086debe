"""``key=value`` overrides typed by the recipe's schema (a string keeps the text typed), the spellings of
"no resume", and every unknown key of a recipe and its overrides named in one error."""

from pathlib import Path

import pytest

from mmformer.recipe import RecipeError, load_recipe
from mmformer.training.runs import open_run

QUICKSTART = Path(__file__).parents[1] / "recipes/image/vit_tiny_classify_mnist5k.yaml"


def test_string_keys_keep_the_text_typed():
    r = load_recipe(QUICKSTART, ["name=no", "logger.group=1.10", "logger.tags=[1e5, no, 0123]"])
    assert r.name == "no"
    assert r.logger.group == "1.10"
    assert r.logger.tags == ["1e5", "no", "0123"]


def test_component_string_key_keeps_the_text_typed():
    # tasks.mnist.data is typed by its kind's config (image_folder: root is a str), not as YAML's octal 83
    r = load_recipe(QUICKSTART, ["tasks.mnist.data.root=0123"])
    assert r.tasks["mnist"].data.root == "0123"


def test_whole_component_override_is_typed_by_its_kind():
    r = load_recipe(QUICKSTART, ["tasks.mnist.data={kind: image_folder, root: 0123, batch_size: 16}"])
    assert r.tasks["mnist"].data.root == "0123"
    assert r.tasks["mnist"].data.batch_size == 16


def test_a_mapping_of_another_kind_drops_the_old_kinds_options_at_any_depth(caplog):
    retrieval = Path(__file__).parents[1] / "recipes/long_context/lra_retrieval_kjv.yaml"
    plain = "model.heads.same={kind: classifier, num_classes: 2, drop: 0.1}"
    with caplog.at_level("WARNING", logger="mmformer"):
        r = load_recipe(retrieval, [plain, "tasks.retrieval.data.pairs=false"])
    head = r.model.heads["same"]
    assert (head.kind, head.drop, head.pool, head.fc_norm) == ("classifier", 0.1, "mean", True)  # shared kept
    (said,) = [rec.getMessage() for rec in caplog.records if "changes kind" in rec.getMessage()]
    assert said.endswith(
        "'model.heads.same' changes kind pair_classifier → classifier; dropped the pair_classifier options "
        "interaction, mlp_dim (the others are kept)"
    )
    nested = "model.heads={same: {kind: classifier, num_classes: 2}}"  # a kind change inside a parent mapping
    assert (
        load_recipe(retrieval, [nested, "tasks.retrieval.data.pairs=false"]).model.heads["same"].kind
        == "classifier"
    )
    r = load_recipe(retrieval, ["model.heads.same={kind: pair_classifier, mlp_dim: 64}"])
    assert (r.model.heads["same"].mlp_dim, r.model.heads["same"].interaction) == (
        64,
        "nli",
    )  # same kind: merged
    with pytest.raises(RecipeError, match="unknown recipe key 'model.heads.same.mlp_dim'"):
        load_recipe(retrieval, ["model.heads.same={kind: classifier, num_classes: 2, mlp_dim: 3}"])
    joint = Path(__file__).parents[1] / "recipes/multimodal/joint_text_image_audio.yaml"
    before = load_recipe(joint).tasks["words"].data
    after = (
        load_recipe(joint, ["tasks.words.data={kind: audio_manifest, root: spoken-words}"])
        .tasks["words"]
        .data
    )
    assert after.kind == "audio_manifest" and after.batch_size == before.batch_size  # loader options kept
    # a backbone that names no kind is the default transformer: a pretrained one drops its sizes
    quick = load_recipe(QUICKSTART, ["model.backbone={kind: pretrained, source: smollm2-135m-instruct}"])
    assert quick.model.backbone.kind == "pretrained"


def test_another_attn_kernel_drops_the_kernel_options_it_does_not_take(caplog, tmp_path):
    listops = Path(__file__).parents[1] / "recipes/long_context/lra_listops.yaml"
    aft_local = [
        "model.backbone.attn_kernel=aft_local",
        "model.backbone.kernel_options={max_len: 4096, window: 64}",
    ]
    recipe = tmp_path / "aft_local.yaml"  # a recipe written for one kernel, run with another
    recipe.write_text(
        listops.read_text().replace(
            "  backbone: {",
            "  backbone: {attn_kernel: aft_local, kernel_options: {max_len: 4096, window: 64}, ",
        )
    )
    with caplog.at_level("WARNING", logger="mmformer"):
        r = load_recipe(recipe, ["model.backbone.attn_kernel=sdpa"])
    assert (r.model.backbone.attn_kernel, dict(r.model.backbone.kernel_options)) == ("sdpa", {})
    (said,) = [rec.getMessage() for rec in caplog.records if "changes aft_local" in rec.getMessage()]
    assert said.endswith(
        "'model.backbone.attn_kernel' changes aft_local → sdpa; dropped the kernel_options max_len, window, "
        "which sdpa does not take"
    )
    assert dict(
        load_recipe(recipe, ["model.backbone.attn_kernel=aft_full"]).model.backbone.kernel_options
    ) == {"max_len": 4096}  # shared options kept
    lsh = load_recipe(
        listops, [*aft_local, "model.backbone={attn_kernel: lsh, kernel_options: {n_buckets: 8}}"]
    )
    assert dict(lsh.model.backbone.kernel_options) == {"n_buckets": 8}
    same = load_recipe(listops, [*aft_local, "model.backbone.attn_kernel=aft_local"])
    assert dict(same.model.backbone.kernel_options) == {"max_len": 4096, "window": 64}


def test_a_kind_change_never_reaches_through_an_alias(tmp_path):
    """A head that is an interpolation of another: the override replaces the alias, the other is untouched."""
    retrieval = (Path(__file__).parents[1] / "recipes/long_context/lra_retrieval_kjv.yaml").read_text()
    text = retrieval.replace("interaction: nli, mlp_dim: 128}", "interaction: concat, mlp_dim: 32}")
    text = text.replace("heads: {same: ", "heads: {same2: '${model.heads.same}', same: ")
    text = text.replace(
        "tasks:\n",
        "tasks:\n  plain: {kind: classification, tokenizer: bytes, head: same2, data: {kind: sequences, "
        "root: kjv-pairs, batch_size: 4}}\n",
    )
    path = tmp_path / "aliased.yaml"
    path.write_text(text)
    r = load_recipe(path, ["model.heads.same2={kind: classifier, num_classes: 2, pool: mean}"])
    assert (r.model.heads["same"].interaction, r.model.heads["same"].mlp_dim) == ("concat", 32)
    assert r.model.heads["same2"].kind == "classifier"


def test_quotes_and_null_on_string_keys():
    r = load_recipe(QUICKSTART, ["name='yes'", "logger.group=null"])
    assert r.name == "yes"
    assert r.logger.group is None


def test_numbers_and_booleans_where_the_schema_expects_them():
    r = load_recipe(
        QUICKSTART,
        [
            "optim.lr=3e-4",
            "trainer.max_steps=5",
            "trainer.compile=true",
            "optim.betas=[0.8, 1e-1]",
            "seed=0123",
        ],
    )
    assert r.optim.lr == 3e-4 and isinstance(r.optim.lr, float)
    assert r.trainer.max_steps == 5 and isinstance(r.trainer.max_steps, int)
    assert r.trainer.compile is True
    assert r.optim.betas == [0.8, 0.1]
    assert r.seed == 123  # decimal, as typed (YAML 1.1 would read octal 83)


def test_free_form_keys_keep_yaml_typing():
    r = load_recipe(QUICKSTART, ["trainer.devices=2", "trainer.limit_train_batches=0.5"])
    assert r.trainer.devices == 2
    assert r.trainer.limit_train_batches == 0.5


def test_wrong_type_still_names_the_key():
    with pytest.raises(RecipeError) as e:
        load_recipe(QUICKSTART, ["trainer.max_steps=five"])
    assert str(e.value) == "'trainer.max_steps' expects int, got 'five' (str)"


@pytest.mark.parametrize("spelling", ["false", "False", "no", "none", "None", "null", "off"])
def test_resume_spellings_of_no_resume_start_a_new_run(spelling, workdir):
    recipe = load_recipe(QUICKSTART, [f"resume={spelling}"])
    assert recipe.resume is None
    run = open_run(recipe.name, recipe.resume)  # what `mmformer train` does with it
    assert run.resume_from is None
    assert run.dir.parent == workdir / "runs" / recipe.name


def test_resume_no_in_the_recipe_file_is_no_resume(tmp_path):
    (tmp_path / "r.yaml").write_text(QUICKSTART.read_text() + "resume: no\n")
    assert load_recipe(tmp_path / "r.yaml").resume is None


def test_resume_auto_and_a_path_are_kept(workdir):
    assert load_recipe(QUICKSTART, ["resume=auto"]).resume == "auto"
    missing = workdir / "nope" / "last.ckpt"
    recipe = load_recipe(QUICKSTART, [f"resume={missing}"])
    assert recipe.resume == str(missing)
    with pytest.raises(FileNotFoundError, match=f"resume checkpoint '{missing}' does not exist"):
        open_run(recipe.name, recipe.resume)


FOREIGN_KEYS = """\
epochs: 300
model_ema: true
optim: {lr: 1e-3, lrr: 5e-4}
trainer: {max_epochs: 70, precison: bf16-mixed}
"""


def test_every_unknown_key_of_the_file_in_one_error(tmp_path):
    text = QUICKSTART.read_text().replace("optim: {lr: 2e-3, weight_decay: 0.05, warmup_steps: 100}\n", "")
    text = text.replace("trainer: {max_epochs: 70, precision: 32-true}\n", "")
    text = text.replace("pool: mean,", "pool: mean, fc_nrom: true,")
    (tmp_path / "r.yaml").write_text(text + FOREIGN_KEYS)
    with pytest.raises(RecipeError) as e:
        load_recipe(tmp_path / "r.yaml")
    assert str(e.value) == (
        "5 unknown recipe keys: 'model.heads.digits.fc_nrom' (did you mean 'model.heads.digits.fc_norm'?), "
        "'epochs', 'model_ema' (did you mean 'model'?), 'optim.lrr' (did you mean 'optim.lr'?), "
        "'trainer.precison' (did you mean 'trainer.precision'?)"
    )


def test_unknown_keys_of_file_and_overrides_together(tmp_path):
    (tmp_path / "r.yaml").write_text(QUICKSTART.read_text() + "epochs: 300\n")
    with pytest.raises(RecipeError) as e:
        load_recipe(
            tmp_path / "r.yaml", ["optim.lrr=1e-3", "trainer.max_steps=5", "tasks.mnist.data.batchsize=8"]
        )
    assert str(e.value) == (
        "3 unknown recipe keys: 'epochs', 'optim.lrr' (did you mean 'optim.lr'?), "
        "'tasks.mnist.data.batchsize' (did you mean 'tasks.mnist.data.batch_size'?)"
    )


def test_a_lone_unknown_key_lists_the_valid_ones():
    with pytest.raises(RecipeError) as e:
        load_recipe(QUICKSTART, ["logger.projet=x"])
    assert str(e.value) == (
        "unknown recipe key 'logger.projet'. Did you mean 'logger.project'? "
        "Valid keys here: kinds, mode, project, entity, group, tags, log_model, mlflow_tracking_uri."
    )
