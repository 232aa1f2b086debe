"""Checkpoint writes are atomic: a save that dies midway leaves the previous file intact."""

import pytest
import torch

from mmformer.training.checkpoint_io import AtomicCheckpointIO


def test_failed_save_keeps_previous_checkpoint(tmp_path, monkeypatch):
    io = AtomicCheckpointIO()
    path = tmp_path / "last.ckpt"
    io.save_checkpoint({"step": torch.tensor(1)}, path)

    def dying_save(obj, f, *a, **k):
        f.write(b"partial bytes")
        raise KeyboardInterrupt  # killed mid-write

    monkeypatch.setattr(torch, "save", dying_save)
    with pytest.raises(KeyboardInterrupt):
        io.save_checkpoint({"step": torch.tensor(2)}, path)
    monkeypatch.undo()
    assert io.load_checkpoint(path)["step"] == 1
    assert [p.name for p in tmp_path.iterdir()] == ["last.ckpt"]  # no temporary left behind


class Evil:  # any class outside torch's safe list, as a malicious checkpoint would carry
    pass


def test_load_refuses_arbitrary_pickles(tmp_path):
    torch.save({"obj": Evil()}, tmp_path / "evil.ckpt")
    with pytest.raises(Exception, match="(?i)weights[-_]only|unsupported global"):
        AtomicCheckpointIO().load_checkpoint(tmp_path / "evil.ckpt")


SAVER = """
import itertools, sys, torch
from mmformer.training.checkpoint_io import AtomicCheckpointIO
io = AtomicCheckpointIO()
for i in itertools.count():
    io.save_checkpoint({"step": i, "w": torch.full((2_000_000,), float(i))}, sys.argv[1])
"""


@pytest.mark.slow
def test_a_kill_during_a_save_never_leaves_a_broken_checkpoint(tmp_path):
    """SIGKILL a process that keeps rewriting ``last.ckpt`` (8 MB each) at random moments: the file
    always loads, whole, with one consistent step; a later save removes the dead writers' temp files."""
    import random
    import signal
    import subprocess
    import sys
    import time

    path = tmp_path / "last.ckpt"
    rng = random.Random(0)
    steps = []
    for _ in range(4):
        proc = subprocess.Popen([sys.executable, "-c", SAVER, str(path)])
        t0 = time.time()
        while not path.exists() and time.time() - t0 < 60:
            time.sleep(0.01)
        time.sleep(rng.uniform(0.1, 0.6))
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        state = torch.load(path, weights_only=True)
        assert torch.equal(state["w"], torch.full((2_000_000,), float(state["step"])))
        steps.append(state["step"])
    assert max(steps) > 0
    AtomicCheckpointIO().save_checkpoint({"step": -1}, path)
    assert not list(tmp_path.glob(".*.tmp"))
