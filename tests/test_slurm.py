"""Under SLURM, Lightning's SIGUSR1 auto-requeue stays off: mmformer stops on SIGTERM at an agreed step
(``training.preemption``) and the sbatch template requeues the job (docker/train_slurm.sbatch)."""

from __future__ import annotations

import signal

import lightning as L

from mmformer.build.trainer import _slurm

SLURM = dict(
    SLURM_NTASKS="1",
    SLURM_JOB_NAME="train",
    SLURM_JOB_ID="42",
    SLURM_PROCID="0",
    SLURM_LOCALID="0",
    SLURM_NODEID="0",
)


def test_no_sigusr1_requeue_handler_under_slurm(monkeypatch):
    for k, v in SLURM.items():
        monkeypatch.setenv(k, v)
    before = signal.getsignal(signal.SIGUSR1)
    trainer = L.Trainer(plugins=_slurm(), accelerator="cpu", devices=1, logger=False, max_steps=0)
    env = trainer._accelerator_connector.cluster_environment
    assert type(env).__name__ == "SLURMEnvironment" and env.auto_requeue is False
    trainer._signal_connector.register_signal_handlers()
    try:
        assert signal.getsignal(signal.SIGUSR1) == before  # Lightning's requeue handler is not installed
    finally:
        trainer._signal_connector.teardown()


def test_no_cluster_plugin_outside_slurm(monkeypatch):
    for k in SLURM:
        monkeypatch.delenv(k, raising=False)
    assert _slurm() == []
