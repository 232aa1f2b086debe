"""FSDP2 runs with what used to need DDP (CLI subprocesses, 2 CPU processes): the EMA of the weights
(each rank averages its shard) equals Lightning's EMA under DDP, across a resume; the media callbacks
run the sharded model on every rank and rank 0 logs the samples; the pretrained parts stay frozen for
``optim.freeze_pretrained_epochs`` and train afterwards (unfrozen inside one run or across a resume:
the same weights); a held-out set that splits unevenly over the ranks does not hang the sharded model.
Those launch processes (slow tier); one FSDP2 process, inside the test's own, runs the same code paths
(the strategy, sharded checkpoints, the sharded EMA) in seconds (fast tier)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from mmformer.cli import main
from tests.conftest import TINY_RECIPE, make_image_folder
from tests.training.test_distributed_equivalence import LM, _corpus
from tests.training.test_distributed_equivalence import _run as _train

FSDP2 = ["trainer.devices=2", "trainer.strategy=fsdp2"]
ONE_FSDP2 = ["trainer.devices=1", "trainer.strategy=fsdp2"]  # a process group of one, in this process


def _close(a: dict, b: dict, what: str) -> None:
    assert list(a) == list(b), what
    for k in a:
        scale = a[k].float().abs().max().clamp_min(1e-12)
        assert (a[k].float() - b[k].float()).abs().max() / scale < 1e-4, f"{what}: {k}"


def _train_here(recipe, workdir, name: str, overrides: list[str], monkeypatch) -> Path:
    """``mmformer train`` in this process (as ``_train`` in a subprocess); the path of ``last.ckpt``.
    Lightning leaves its rendezvous variables (``MASTER_PORT``, ``WORLD_SIZE``, …) in the environment:
    they are removed again, or the multi-process tests after this one would inherit a port in use."""
    monkeypatch.setenv("MMFORMER_RUNS", str(workdir / "runs" / name))
    saved = dict(os.environ)
    try:
        assert main(["train", str(recipe), *overrides]) == 0
    finally:
        os.environ.clear()
        os.environ.update(saved)
    return next((workdir / "runs" / name).glob("*/*/checkpoints/last.ckpt"))


def test_one_fsdp2_process_writes_sharded_checkpoints_that_resume_and_merge(workdir, monkeypatch, capsys):
    """``checkpoint.sharded`` with one FSDP2 process: a DCP folder, resumed from, merged into safetensors,
    validated on one device; the weights equal an uninterrupted single-device run's."""
    from safetensors.torch import load_file

    recipe = workdir / "tiny.yaml"
    recipe.write_text(TINY_RECIPE.format(name="tiny", root=make_image_folder(workdir / "images")))
    constant = "optim.schedule=constant"  # resuming with more epochs keeps the same LR
    full = _train_here(recipe, workdir, "full", [constant, "trainer.max_epochs=2"], monkeypatch)
    sharded = [*ONE_FSDP2, constant, "checkpoint.sharded=true"]
    last = _train_here(recipe, workdir, "sharded", [*sharded, "trainer.max_epochs=1"], monkeypatch)
    assert last.is_dir() and (last / ".metadata").is_file() and len(list(last.glob("*.distcp"))) == 1
    assert not list(last.parent.glob(".*.tmp")) and not list(last.parent.glob(".*.old"))
    again = _train_here(
        recipe, workdir, "sharded", [*sharded, "trainer.max_epochs=2", "resume=auto"], monkeypatch
    )
    assert again == last

    out = workdir / "merged.safetensors"
    assert main(["export", str(last), str(out), "--format", "safetensors"]) == 0
    merged = load_file(str(out))
    reference = torch.load(full, map_location="cpu", weights_only=True)["state_dict"]
    assert set(merged) == set(reference)
    for k, v in reference.items():  # sharded + resumed == one device, uninterrupted
        torch.testing.assert_close(merged[k], v, atol=1e-6, rtol=0, msg=k)
    capsys.readouterr()
    assert (
        main(
            ["validate", str(last), "trainer.devices=1", "trainer.strategy=auto", "checkpoint.sharded=false"]
        )
        == 0
    )
    assert "val/toy/acc" in capsys.readouterr().out


def test_one_fsdp2_process_ema_equals_the_single_device_ema(workdir, monkeypatch):
    recipe = workdir / "lm.yaml"
    recipe.write_text(LM.format(name="lm", corpus=_corpus(workdir / "corpus.txt")))
    common = ["optim.ema_decay=0.8", "optim.schedule=constant", "trainer.max_steps=4"]
    common.append("tasks.corpus.data.batch_size=4")
    one = torch.load(_train_here(recipe, workdir, "one", common, monkeypatch), weights_only=True)
    fsdp = torch.load(
        _train_here(recipe, workdir, "fsdp", [*common, *ONE_FSDP2], monkeypatch), weights_only=True
    )
    assert fsdp["global_step"] == one["global_step"] == 4
    _close(one["current_model_state"], fsdp["current_model_state"], "raw weights")
    key = "model.backbone.blocks.0.attn.qkv.weight"
    assert not torch.allclose(one["state_dict"][key], one["current_model_state"][key])  # a real average
    _close(one["state_dict"], fsdp["state_dict"], "EMA weights")


@pytest.mark.slow
def test_sharded_ema_equals_ddp_ema_across_a_resume_and_text_samples_are_logged(workdir):
    from tests.wandb_records import read_records

    recipe = workdir / "lm.yaml"
    recipe.write_text(LM.format(name="lm", corpus=_corpus(workdir / "corpus.txt")))
    # a constant LR: a run stopped by max_steps=2 then resumed to 4 follows the 4-step run exactly.
    # Validation (with text samples: rank 0 decodes, in the CPU decode layout) after every step: DDP
    # fixes its gradient buckets' layout at step 2, so the layout must be back on every rank before it
    common = ["optim.ema_decay=0.8", "optim.schedule=constant", "trainer.val_check_interval=1"]
    common.append("tasks.corpus.data.batch_size=4")
    ddp = torch.load(
        _train(
            recipe,
            workdir,
            "ddp",
            [*common, "trainer.devices=2", "trainer.strategy=ddp", "trainer.max_steps=4"],
        ),
        map_location="cpu",
        weights_only=True,
    )
    first = _train(recipe, workdir, "fsdp", [*common, *FSDP2, "trainer.max_steps=2", "logger.mode=offline"])
    records = read_records(next((workdir / "runs" / "fsdp").glob("*/*/wandb/offline-run-*/*.wandb")))
    keys = {"/".join(i.nested_key) or i.key for r in records if r.HasField("history") for i in r.history.item}
    assert "samples/corpus/_type" in keys  # generated by the sharded model on both ranks, logged by rank 0
    _train(recipe, workdir, "fsdp", [*common, *FSDP2, "trainer.max_steps=4", "resume=auto"])
    fsdp = torch.load(first, map_location="cpu", weights_only=True)
    assert fsdp["global_step"] == ddp["global_step"] == 4
    _close(ddp["current_model_state"], fsdp["current_model_state"], "raw weights")
    _close(ddp["state_dict"], fsdp["state_dict"], "EMA weights")
    key = "model.backbone.blocks.0.attn.qkv.weight"
    assert not torch.allclose(fsdp["state_dict"][key], fsdp["current_model_state"][key])  # a real average
    assert int(fsdp["averaging_state"]["n_averaged"]) == 4


def test_sharded_ema_with_sharded_checkpoints_is_refused(workdir):
    recipe = workdir / "lm.yaml"
    recipe.write_text(LM.format(name="lm", corpus=_corpus(workdir / "corpus.txt")))
    from mmformer.recipe import RecipeError, load_recipe

    with pytest.raises(RecipeError, match="checkpoint.sharded"):
        load_recipe(recipe, ["optim.ema_decay=0.9", *FSDP2, "checkpoint.sharded=true"])


@pytest.mark.slow
def test_pretrained_parts_stay_frozen_under_fsdp2_then_train(workdir, timm_source):
    from safetensors.torch import load_file

    from tests.tasks.test_finetune_timm import RECIPE

    source = load_file(str(timm_source / "model.safetensors"))
    root = make_image_folder(workdir / "imgs", n_per_class=4, size=16)
    recipe = workdir / "ft.yaml"
    recipe.write_text(RECIPE.format(src=timm_source, root=root, epochs=1))
    fsdp2 = [*FSDP2, "optim.schedule=constant"]  # resuming with more epochs keeps the same LR
    ckpt = _train(recipe, workdir, "ft", fsdp2)
    sd = torch.load(ckpt, map_location="cpu", weights_only=True)["state_dict"]
    block = "blocks.1.mlp.fc2.weight"
    assert torch.equal(sd[f"model.backbone.{block}"], source[block])  # frozen in epoch 0
    assert torch.count_nonzero(sd["model.heads.cls.head.weight"]) > 0  # the new head trained
    _train(recipe, workdir, "ft", [*fsdp2, "trainer.max_epochs=2", "resume=auto"])
    sd = torch.load(ckpt, map_location="cpu", weights_only=True)["state_dict"]
    assert not torch.equal(sd[f"model.backbone.{block}"], source[block])  # unfrozen in epoch 1
    # unfrozen inside one run (the sharded parameters start receiving gradients mid-run): the same
    # weights as frozen, stopped and resumed
    whole = _train(recipe, workdir, "ft_whole", [*fsdp2, "trainer.max_epochs=2"])
    _close(torch.load(whole, map_location="cpu", weights_only=True)["state_dict"], sd, "one run vs resumed")


@pytest.mark.slow
def test_uneven_evaluation_shards_do_not_hang_a_sharded_model(workdir):
    """9 held-out documents over 2 ranks with batch 4: 5 and 4 samples, 2 and 1 batches with the plain
    evaluation sampler; every FSDP2 forward gathers weights from both ranks, so the ranks must run the
    same number of evaluation batches (``EvenEvalBatches``) or the first one waits forever."""
    recipe = workdir / "lm.yaml"
    recipe.write_text(LM.format(name="lm", corpus=_corpus(workdir / "corpus.txt")))
    overrides = [*FSDP2, "tasks.corpus.data.val_fraction=0.225", "tasks.corpus.data.batch_size=4"]
    ckpt = _train(recipe, workdir, "uneven", overrides)
    assert torch.load(ckpt, map_location="cpu", weights_only=True)["global_step"] == 1
