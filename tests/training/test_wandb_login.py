"""W&B online without an API key: one ``mmformer: error:`` line naming what is missing and the two ways
on, before any W&B run (or data) is touched — not wandb's traceback."""

import os
import subprocess
import sys

import pytest

from mmformer.errors import UsageError
from mmformer.recipe import LoggerConfig
from mmformer.training.loggers import build_loggers, check_wandb_login

NO_KEY = (
    "W&B is set to log online but no W&B API key was found (WANDB_API_KEY is unset, no {netrc} entry for "
    "api.wandb.ai): run `wandb login`, or log offline with logger.mode=offline"
)


@pytest.fixture
def no_credentials(tmp_path, monkeypatch):
    """An empty home, no key in the environment, and a netrc file that does not exist."""
    home = tmp_path / "home"
    home.mkdir()
    netrc = tmp_path / "no-netrc"
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.setenv("NETRC", str(netrc))
    for name in ("WANDB_API_KEY", "WANDB_IDENTITY_TOKEN_FILE", "WANDB_MODE", "WANDB_BASE_URL"):
        monkeypatch.delenv(name, raising=False)
    return netrc


def test_online_without_a_key_is_refused_before_the_logger_exists(no_credentials, tmp_path):
    with pytest.raises(UsageError) as e:
        build_loggers(LoggerConfig(mode="online"), tmp_path / "run", "tiny/1", "1", {})
    assert str(e.value) == NO_KEY.format(netrc=no_credentials)
    assert not (tmp_path / "run").exists()


def test_offline_disabled_and_auto_need_no_key(no_credentials):
    for mode in ("offline", "disabled", "auto"):  # auto falls back to offline
        check_wandb_login(mode)


def test_a_key_in_the_environment_or_the_netrc_file_is_enough(no_credentials, monkeypatch):
    monkeypatch.setenv("WANDB_API_KEY", "x" * 40)
    check_wandb_login("online")
    monkeypatch.delenv("WANDB_API_KEY")
    no_credentials.write_text(f"machine api.wandb.ai\n  login user\n  password {'a' * 40}\n")
    no_credentials.chmod(0o600)
    check_wandb_login("online")


def test_train_prints_one_line_and_exits_non_zero(no_credentials, tiny_recipe, workdir):
    env = {k: v for k, v in os.environ.items() if k not in ("WANDB_API_KEY", "WANDB_MODE")}
    cmd = [sys.executable, "-m", "mmformer.cli", "train", str(tiny_recipe), "logger.mode=online"]
    out = subprocess.run(
        [*cmd, "trainer.max_steps=1"], env=env, cwd=workdir, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 2
    assert "Traceback" not in out.stderr
    assert out.stderr.strip().splitlines() == ["mmformer: error: " + NO_KEY.format(netrc=no_credentials)]
    assert not (workdir / "runs").exists()  # refused before the run folder or the data
