"""docker/: the Dockerfile copies only paths that exist, pins what pyproject.toml and the Makefile pin,
runs as a non-root user, and the launch scripts are valid shell."""

from __future__ import annotations

import re
import shlex
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[1]
DOCKER = ROOT / "docker"


def _instructions(path: Path) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with line continuations joined and comments dropped."""
    lines, current = [], ""
    for raw in path.read_text().splitlines():
        line = raw.strip()
        if not current and (not line or line.startswith("#")):
            continue
        if line.endswith("\\"):
            current += line[:-1] + " "
            continue
        current += line
        lines.append(current)
        current = ""
    out = []
    for line in lines:
        word, _, rest = line.partition(" ")
        out.append((word.upper(), rest.strip()))
    return out


@pytest.fixture(scope="module")
def dockerfile():
    return _instructions(DOCKER / "Dockerfile")


def test_every_copied_path_exists(dockerfile):
    copies = [args for op, args in dockerfile if op in ("COPY", "ADD")]
    assert copies
    for args in copies:
        parts = [p for p in shlex.split(args) if not p.startswith("--")]
        for source in parts[:-1]:  # the last one is the destination
            assert (ROOT / source).exists(), f"COPY {source}: no such path in the repository"


def test_pins_agree_with_pyproject_and_makefile(dockerfile):
    args = dict(a.split("=", 1) for op, a in dockerfile if op == "ARG" and "=" in a)
    pins = dict(re.findall(r'"([\w-]+)==([\w.]+)"', (ROOT / "pyproject.toml").read_text()))
    assert args["TORCH_VERSION"] == pins["torch"]
    assert args["TORCHVISION_VERSION"] == pins["torchvision"]
    assert args["TORCHAUDIO_VERSION"] == pins["torchaudio"]
    makefile_pins = set(re.findall(r'"([\w.-]+==[\w.]+)"', (ROOT / "Makefile").read_text()))
    docker_pins = set(re.findall(r'"([\w.-]+==[\w.]+)"', (DOCKER / "Dockerfile").read_text()))
    # the weights and data packages the recipes read (faster-whisper is a test reference only)
    assert docker_pins == makefile_pins - {p for p in makefile_pins if p.startswith("faster-whisper")}


def test_runs_as_a_non_root_user_with_the_cli_as_entrypoint(dockerfile):
    users = [a for op, a in dockerfile if op == "USER"]
    assert users and users[-1] not in ("root", "0")
    assert [a for op, a in dockerfile if op == "ENTRYPOINT"] == ['["mmformer"]']
    assert dockerfile[0][0] in ("ARG", "FROM")


@pytest.mark.parametrize("script", sorted(DOCKER.glob("*.sh")), ids=lambda p: p.name)
def test_launch_scripts_are_valid_shell(script):
    assert subprocess.run(["bash", "-n", str(script)], capture_output=True).returncode == 0
    text = script.read_text()
    assert "mmformer" in text and "trainer.devices" in text
