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
    with pytest.raises(Exception, match="(?i)weights_only|unsupported global"):
        AtomicCheckpointIO().load_checkpoint(tmp_path / "evil.ckpt")
