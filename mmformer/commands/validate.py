"""``mmformer validate CHECKPOINT [key=value …]``: evaluate a checkpoint on its recipe's validation data."""

from __future__ import annotations

import lightning as L

from ..build import build_datamodule, build_strategy, load_checkpoint
from ..build.trainer import progress_bars


def cmd_validate(args) -> int:

    loaded = load_checkpoint(args.checkpoint, args.overrides)  # a sharded folder is merged here
    module = loaded.module()
    datamodule = build_datamodule(loaded.recipe, loaded.context)  # read with the weights' own tokenizers
    t = loaded.recipe.trainer
    bars = progress_bars(t)  # the bar training draws
    trainer = L.Trainer(
        accelerator=t.accelerator,
        devices=t.devices,
        strategy=build_strategy(t),
        precision=t.precision,
        logger=False,
        enable_checkpointing=False,
        use_distributed_sampler=False,
        limit_val_batches=t.limit_val_batches,
        enable_progress_bar=bool(bars),
        callbacks=bars,
    )
    trainer.validate(module, datamodule=datamodule, verbose=False)
    if trainer.is_global_zero:
        for key, value in sorted(trainer.callback_metrics.items()):
            if key.startswith("val/"):
                print(f"{key} {float(value):.4f}")
    return 0
