"""bfloat16 on a CPU without oneDNN's bfloat16 kernels runs PyTorch's slow fallback: ``mmformer train``
says so at the start of a ``bf16`` run there (``training/cpu_bf16.py``), and leaves the precision as the
recipe set it."""

from __future__ import annotations

import pytest
import torch

from mmformer.cli import main
from mmformer.training import cpu_bf16
from mmformer.training.cpu_bf16 import bf16_hint, onednn_bf16


def test_the_hint_names_the_precision_the_cpu_and_the_float32_setting():
    hint = bf16_hint("bf16-mixed", "cpu", supported=False)
    assert hint.startswith("trainer.precision=bf16-mixed on a CPU without oneDNN's bfloat16 kernels")
    assert torch.backends.cpu.get_cpu_capability() in hint and "trainer.precision=32-true" in hint
    assert "bf16-true" in bf16_hint("bf16-true", "cpu", supported=False)
    assert bf16_hint("bf16-mixed", "cpu", supported=True) == ""  # oneDNN computes them: nothing to say
    assert bf16_hint("32-true", "cpu", supported=False) == ""
    assert bf16_hint("16-mixed", "cpu", supported=False) == ""
    assert bf16_hint("bf16-mixed", "accelerator", supported=False) == ""  # a GPU has its own bfloat16
    assert bf16_hint("bf16-mixed", "cpu") == bf16_hint("bf16-mixed", "cpu", supported=onednn_bf16())


@pytest.mark.parametrize("supported", [False, True])
def test_a_bf16_run_on_such_a_cpu_says_so_and_trains_in_bf16(
    tiny_recipe, workdir, capsys, monkeypatch, supported
):
    import lightning as L

    from mmformer.commands.train import train
    from mmformer.recipe import load_recipe

    monkeypatch.setattr(cpu_bf16, "onednn_bf16", lambda: supported)  # both answers, whatever this CPU has

    class SeeAutocast(L.Callback):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            with trainer.precision_plugin.forward_context():
                self.dtype = torch.get_autocast_dtype("cpu") if torch.is_autocast_enabled("cpu") else None

    seen = SeeAutocast()
    overrides = [
        "trainer.precision=bf16-mixed",
        "trainer.max_steps=1",
        "trainer.max_epochs=-1",
        "logger.mode=disabled",
    ]
    trainer, _ = train(load_recipe(tiny_recipe, overrides), extra_callbacks=[seen], verbose=True)
    out = capsys.readouterr().out
    assert trainer.global_step == 1 and seen.dtype == torch.bfloat16  # the recipe's precision, unchanged
    assert ("without oneDNN's bfloat16 kernels" in out) is not supported
    assert (
        main(
            [
                "train",
                str(tiny_recipe),
                "trainer.max_steps=1",
                "trainer.max_epochs=-1",
                "logger.mode=disabled",
            ]
        )
        == 0
    )
    assert "bfloat16" not in capsys.readouterr().out  # float32 (the tiny recipe's default): no hint
