"""``mmformer.progress``: bars on a terminal, none into a pipe or a log, ``MMFORMER_PROGRESS`` forces them
on or off, and only the first process of a multi-process run draws; ``data prepare`` uses them."""

from __future__ import annotations

import io
import os
import subprocess
import sys

import pytest

from mmformer.progress import ENV, progress, shows

SCRIPT = "from mmformer.progress import progress\nfor _ in progress(range(7), 'counting', unit='x'): pass\n"


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def _stderr_of_a_piped_process(**env: str) -> str:
    clean = {k: v for k, v in os.environ.items() if k not in (ENV, "RANK", "LOCAL_RANK", "SLURM_PROCID")}
    done = subprocess.run(
        [sys.executable, "-c", SCRIPT], env={**clean, **env}, capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    return done.stderr


def test_a_pipe_gets_no_bar_unless_forced():
    assert _stderr_of_a_piped_process() == ""
    forced = _stderr_of_a_piped_process(MMFORMER_PROGRESS="1")
    assert "counting: 100%" in forced and "7/7" in forced
    assert _stderr_of_a_piped_process(MMFORMER_PROGRESS="1", RANK="1") == ""  # not the first process


@pytest.fixture
def no_setting(monkeypatch):
    for var in (ENV, "RANK", "LOCAL_RANK", "SLURM_PROCID"):
        monkeypatch.delenv(var, raising=False)
    return monkeypatch


def test_a_terminal_gets_a_bar_unless_turned_off(no_setting):
    term = _Terminal()
    assert list(progress(range(5), "drawing", file=term)) == list(range(5))
    assert "drawing: 100%" in term.getvalue() and "5/5" in term.getvalue()
    no_setting.setenv(ENV, "0")
    term = _Terminal()
    list(progress(range(5), "drawing", file=term))
    assert term.getvalue() == ""


def test_manual_updates_and_captured_stderr(no_setting, capsys):
    with progress(desc="bytes", total=10, unit="B") as bar:  # captured stderr is no terminal
        bar.update(4), bar.update(6)
    assert capsys.readouterr().err == "" and not shows()
    no_setting.setenv(ENV, "on")
    with progress(desc="bytes", total=10, unit="B") as bar:
        bar.update(10)
    assert "bytes: 100%" in capsys.readouterr().err and shows()


def test_data_prepare_draws_a_bar_when_forced(workdir, monkeypatch, capsys):
    from mmformer.cli import main  # the digits ship inside scikit-learn, which every make target installs

    monkeypatch.delenv(ENV, raising=False)
    assert main(["data", "prepare", "digits"]) == 0
    assert "writing PNGs" not in capsys.readouterr().err  # not a terminal: quiet
    monkeypatch.setenv(ENV, "1")
    assert main(["data", "prepare", "digits", "--force"]) == 0
    err = capsys.readouterr().err
    assert "digits: writing PNGs: 100%" in err and "1797/1797" in err
    assert len(list((workdir / "data" / "digits").rglob("*.png"))) == 1797


def test_generation_counts_its_tokens_and_generates_the_same(monkeypatch, capsys):
    import torch

    from mmformer.models.generate import generate
    from mmformer.models.pretrained.llama import build_llama
    from tests.conftest import TINY_LLAMA

    torch.manual_seed(0)
    model = build_llama(TINY_LLAMA).eval()
    ids = torch.randint(1, 97, (2, 5))
    valid = torch.ones_like(ids, dtype=torch.bool)
    plain = generate(model, "text", "lm", ids, valid, 6)
    assert capsys.readouterr().err == ""
    monkeypatch.setenv(ENV, "1")
    assert generate(model, "text", "lm", ids, valid, 6, bar=True) == plain
    err = capsys.readouterr().err
    assert "generating:" in err and "/6 [" in err  # a bar over the 6 new tokens


def test_generation_without_a_kv_cache_counts_its_tokens_too(monkeypatch, capsys):
    import torch

    from mmformer.models import AttentionConfig, PositionConfig, build_backbone
    from mmformer.models.generate import generate
    from mmformer.models.heads import LMHead
    from mmformer.models.model import MultimodalModel
    from mmformer.tokenizers import TextEmbedding

    torch.manual_seed(0)
    attention = AttentionConfig(4, kernel="lsh", kernel_options={"n_buckets": 2, "chunk_size": 4})
    backbone = build_backbone(32, 1, attention, positions=PositionConfig("rope"), causal=True)
    model = MultimodalModel({"text": TextEmbedding(40, 32)}, backbone, {"lm": LMHead(32, 40)}).eval()
    ids = torch.randint(1, 40, (2, 5))
    valid = torch.ones_like(ids, dtype=torch.bool)
    plain = generate(model, "text", "lm", ids, valid, 6)
    monkeypatch.setenv(ENV, "1")
    assert generate(model, "text", "lm", ids, valid, 6, bar=True) == plain
    err = capsys.readouterr().err
    assert "generating:" in err and "/6 [" in err
