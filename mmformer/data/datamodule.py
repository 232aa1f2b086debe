"""One LightningDataModule for every recipe: each task contributes a ``TaskData`` (train / val
datasets and loader settings) and every step receives ``{task_name: batch}`` (DESIGN.md).

Training loaders shard and shuffle with torch's ``DistributedSampler`` (seeded by ``(seed, epoch)``, so
the order is reproducible; ``ResumableShardSampler`` lets a run resumed mid-epoch start where its
checkpoint was taken, read from the stateful ``AccumulationWindows``); evaluation
loaders shard without padding (``EvalShardSampler``) so synchronised metrics count each sample once, and
drop the rows that stand in for an unreadable sample (``bad_samples.DropStandIns``): evaluation never
scores a replacement, where training keeps it so its batch shapes stay fixed.
Training samples are prepared inside per-sample random streams (``SeededSamples``): augmentation is a
function of ``(seed, epoch, sample)``, whatever rank, worker or resume point prepares it.
With ``multitask.schedule: sampled`` a training step holds one task's batch (``SampledTasks``).
Training steps come in gradient-accumulation windows whose totals are known up front
(``AccumulationWindows``), so losses are weighted by their tokens over the whole window.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass

import lightning as L
from lightning.pytorch.utilities import CombinedLoader
from torch.utils.data import DataLoader, Dataset, IterableDataset

from .bad_samples import DropStandIns
from .roots import DataError
from .samplers import (
    EvalShardSampler,
    EvenEvalBatches,
    LengthBuckets,
    ResumableShardSampler,
    set_epoch,
    start_part_way,
)
from .seeding import SeededSamples
from .task_schedule import SampledTasks
from .windows import AccumulationWindows


class EveryTask:
    """``{task: batch}`` steps holding a batch of every task; shorter tasks cycle until the longest is done
    (Lightning's ``max_size_cycle``), each further pass freshly shuffled and augmented (its samplers and
    dataset set to ``pass_epoch(epoch, pass)``). ``iter_from(step)`` starts at a
    given step of the epoch, reading only the samples from there on. ``epoch()``: the epoch about to start."""

    def __init__(self, loaders: dict[str, DataLoader], epoch: Callable[[], int] = lambda: 0):
        self.loaders, self.epoch = loaders, epoch

    def __len__(self) -> int:
        return max(len(dl) for dl in self.loaders.values())

    def __iter__(self):
        return self.iter_from(0)

    def iter_from(self, start: int):
        epoch, iterators = self.epoch(), {}
        for step in range(start, len(self)):
            batch = {}
            for name, dl in self.loaders.items():
                n_pass, at = divmod(step, len(dl))
                if name not in iterators or at == 0:  # this task's first batch here, or its next pass
                    set_epoch(dl, pass_epoch(epoch, n_pass))
                    iterators[name] = start_part_way(dl, at)
                batch[name] = next(iterators[name])
            yield batch


def pass_epoch(epoch: int, n_pass: int) -> int:
    """The sampler epoch of pass ``n_pass`` of a task inside trainer epoch ``epoch``: the epoch itself for
    the first pass, then numbers no first pass of any epoch (below a million) takes."""
    return epoch if n_pass == 0 else (epoch + 1) * 1_000_000 + n_pass


@dataclass
class TaskData:
    train: Dataset
    val: Dataset
    collate: Callable
    batch_size: int
    val_batch_size: int
    num_workers: int = 0
    drop_last: bool = True
    # what each split's samples are, for the cross-task leak check (``data.leaks``): file paths or
    # ``text_source(text)``; None = not checked
    train_sources: list[str] | None = None
    val_sources: list[str] | None = None
    # length bucketing: returns the length of every training sample (tokens, audio samples)
    lengths: Callable[[], list[int]] | None = None


class MultiTaskDataModule(L.LightningDataModule):
    """Args:
    factories: task name → zero-argument function building that task's ``TaskData`` (called in
        ``setup``, in every process).
    seed: shuffling seed shared by all ranks.
    multitask: the recipe's ``MultiTaskConfig`` (None: every step holds a batch of every task).

    The training steps come in windows of the trainer's ``accumulate_grad_batches``; the number of loss
    units (tokens, samples) of a task's batch is the LightningModule's ``loss_units(task, batch)`` (1 per
    batch without one: micro-batches weighted equally).

    Checkpoints carry the training loader's position (``state_dict``: the epoch and the steps of it
    trained), and a resumed run's loader starts there (``load_state_dict``), reading only the samples
    that epoch had not reached — Lightning's public datamodule state, which it restores whenever the
    loader is built (ours is built before the checkpoint's loop state is restored, to count the steps
    of the LR schedule).
    """

    def __init__(self, factories: dict[str, Callable[[], TaskData]], seed: int = 0, multitask=None):
        super().__init__()
        self.factories, self.seed, self.multitask = factories, seed, multitask
        self.data: dict[str, TaskData] = {}
        self._train: AccumulationWindows | None = None  # the training loader last built
        self._train_state: dict | None = None  # a checkpoint's loader position, until a loader takes it

    def setup(self, stage: str | None = None) -> None:
        if not self.data:
            self.data = {name: make() for name, make in self.factories.items()}

    def _world(self) -> tuple[int, int]:
        trainer = self.trainer
        return (trainer.world_size, trainer.global_rank) if trainer is not None else (1, 0)

    def _lockstep(self) -> bool:
        """The model is sharded over several processes (FSDP2): every evaluation forward gathers weights
        from all of them, so each must run the same number of batches."""
        trainer = self.trainer
        if trainer is None or trainer.world_size < 2:
            return False
        from lightning.pytorch.strategies import ModelParallelStrategy

        return isinstance(trainer.strategy, ModelParallelStrategy)

    def _loader(self, name: str, d: TaskData, dataset: Dataset, train: bool) -> DataLoader:
        world, rank = self._world()
        collate = d.collate if train else DropStandIns(d.collate)
        if isinstance(dataset, IterableDataset):  # shards: the dataset splits itself by rank and worker
            dataset.place(world, rank, d.num_workers)
            if not train and self._lockstep() and hasattr(dataset, "eval_batches"):
                counts = {dataset.eval_batches(r, d.num_workers) for r in range(world)}
                if len(counts) > 1:  # a rank with a batch more would wait forever in its weight gather
                    raise DataError(
                        f"under FSDP2 every rank must run the same number of evaluation batches, but the "
                        f"{dataset.root} evaluation shards give {sorted(counts)} batches per rank: choose a "
                        "val_batch_size / num_workers / process count that evens them out, or reshard"
                    )
            return DataLoader(
                dataset,
                batch_size=d.batch_size if train else d.val_batch_size,
                num_workers=d.num_workers,
                collate_fn=collate,
                persistent_workers=d.num_workers > 0 and not train,
            )
        if train:
            dataset = SeededSamples(dataset, self.seed, name)  # augmentation: a draw per (epoch, sample)
            sampler = ResumableShardSampler(
                dataset, num_replicas=world, rank=rank, shuffle=True, seed=self.seed, drop_last=d.drop_last
            )
        else:
            if len(dataset) < world:  # a rank without samples would never join the metric sync
                raise DataError(
                    f"the validation set has {len(dataset)} samples, fewer than the {world} "
                    "processes that share it"
                )
            if self._lockstep():  # a sharded model: the same number of evaluation forwards on every rank
                try:
                    batches = EvenEvalBatches(len(dataset), world, rank, d.val_batch_size)
                except ValueError as e:
                    raise DataError(f"{e}: raise val_batch_size or use fewer processes") from None
                return DataLoader(
                    dataset, batch_sampler=batches, num_workers=d.num_workers, collate_fn=collate
                )
            sampler = EvalShardSampler(len(dataset), world, rank)
        if train and d.lengths is not None:  # length bucketing: the loader takes whole batches
            return DataLoader(
                dataset,
                batch_sampler=LengthBuckets(sampler, d.lengths(), d.batch_size, d.drop_last),
                num_workers=d.num_workers,
                collate_fn=collate,
                generator=sampler.generator,
            )
        return DataLoader(
            dataset,
            batch_size=d.batch_size if train else d.val_batch_size,
            sampler=sampler,
            num_workers=d.num_workers,
            collate_fn=collate,
            drop_last=d.drop_last and train,
            # training workers start afresh each epoch (base seed from (seed, rank, epoch), by the sampler)
            persistent_workers=d.num_workers > 0 and not train,
            generator=sampler.generator if train else None,
        )

    def train_dataloader(self) -> AccumulationWindows:
        self.setup()
        loaders = {n: self._loader(n, d, d.train, True) for n, d in self.data.items()}
        trainer = self.trainer
        count = getattr(trainer.lightning_module, "loss_units", None) if trainer is not None else None
        units = {n: functools.partial(count, n) if count else (lambda batch: 1) for n in loaders}
        accumulate, limit = 1, None
        if trainer is not None:
            accumulate, limit = trainer.accumulate_grad_batches, trainer.limit_train_batches

        def epoch() -> int:  # overfit_batches: the same batches every epoch (Lightning's own meaning)
            if trainer is None or getattr(trainer, "overfit_batches", 0):
                return 0
            return trainer.current_epoch

        steps = self._train_steps(loaders, epoch)
        if isinstance(limit, float):
            limit = int(len(steps) * limit) if limit < 1.0 else None

        def progress() -> tuple[int, int]:  # the trainer's epoch and the steps of it already trained
            if trainer is None:
                return 0, 0
            return trainer.current_epoch, trainer.fit_loop.epoch_loop.batch_progress.current.processed

        self._train = AccumulationWindows(steps, accumulate, units, limit, progress)
        if self._train_state is not None:
            self._train.load_state_dict(self._train_state)
            self._train_state = None
        return self._train

    def state_dict(self) -> dict:
        """``{"train": {"epoch", "steps"}}``: the training loader's position (empty before it is built)."""
        return {"train": self._train.state_dict()} if self._train is not None else {}

    def load_state_dict(self, state: dict) -> None:
        """Start the training loader where the checkpoint's was (the one already built, or the next)."""
        if "train" not in state:
            return
        if self._train is not None:
            self._train.load_state_dict(state["train"])
        else:
            self._train_state = dict(state["train"])

    def teardown(self, stage: str) -> None:
        self._train_state = None  # a checkpoint validated (``trainer.validate``) is no position to train from

    def _train_steps(
        self, loaders: dict[str, DataLoader], epoch: Callable[[], int]
    ) -> EveryTask | SampledTasks:
        mt = self.multitask
        if mt is None or mt.schedule == "all":
            return EveryTask(loaders, epoch)
        return SampledTasks(
            loaders,
            weights=dict(mt.sample_weights) or None,
            steps=mt.steps_per_epoch,
            seed=self.seed,
            rank=self._world()[1],
            same_on_all_ranks=mt.same_task_on_all_ranks,
            epoch=epoch,
        )

    def val_dataloader(self) -> CombinedLoader:
        self.setup()
        return CombinedLoader({n: self._loader(n, d, d.val, False) for n, d in self.data.items()}, "max_size")
