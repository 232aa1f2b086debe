"""The recipe's sections: ``model`` (the parts, picked by ``kind`` from ``mmformer.registry``),
``optim``, ``trainer``, ``logger``, ``checkpoint``, ``multitask``, and the ``RecipeConfig`` that holds
them. Values are checked in ``__post_init__``; rules across parts in ``mmformer.recipe.checks``."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

from omegaconf import MISSING

from ..errors import positive, probability


@dataclass
class ResamplerConfig:
    """``model.resamplers.<tokenizer>``: a Perceiver resampler after that tokenizer — its tokens, however
    many, reach the backbone as ``num_latents`` tokens (``mmformer.models.resampler``)."""

    num_latents: int = 64
    n_layers: int = 2
    n_heads: int = 8
    mlp_ratio: float = 4.0

    def __post_init__(self) -> None:
        positive(self, "num_latents", "n_layers", "n_heads")


@dataclass
class LoRAConfig:
    """``model.lora``: low-rank adapters on the (pretrained) backbone's linear layers; every part of kind
    ``pretrained`` is frozen, the adapters and parts built new (e.g. a classifier head) train
    (Hu et al. 2021)."""

    rank: int = 8
    alpha: float = 16.0
    dropout: float = 0.0
    targets: list[str] = field(default_factory=lambda: ["qkv", "proj", "fc1", "fc2"])

    def __post_init__(self) -> None:
        positive(self, "rank")
        probability(self, "dropout")
        allowed = {"qkv", "proj", "fc1", "fc2", "q", "kv"}
        bad = [t for t in self.targets if t not in allowed]
        if bad or not self.targets:
            raise ValueError(f"targets {self.targets} must be a non-empty subset of {sorted(allowed)}")


@dataclass
class ModelConfig:
    tokenizers: dict[str, Any] = field(default_factory=dict)
    backbone: dict[str, Any] = field(default_factory=dict)
    towers: dict[str, Any] = field(default_factory=dict)  # tokenizer name → its own backbone
    resamplers: dict[str, ResamplerConfig] = field(default_factory=dict)  # tokenizer name → a resampler
    heads: dict[str, Any] = field(default_factory=dict)
    lora: Optional[LoRAConfig] = None


@dataclass
class OptimConfig:
    """AdamW with linear warmup then cosine (or linear / constant) decay to ``min_lr``.
    Norms, biases, position embeddings and class tokens get no weight decay."""

    name: str = "adamw"
    lr: float = 1e-3
    weight_decay: float = 0.05
    betas: list[float] = field(default_factory=lambda: [0.9, 0.999])
    eps: float = 1e-8
    warmup_steps: int = 0
    schedule: str = "cosine"  # cosine | linear | constant
    min_lr: float = 0.0
    layer_decay: Optional[float] = None  # layer-wise LR decay: block i of L trains at lr · decay^(L - i)
    ema_decay: Optional[float] = None  # keep an EMA of the weights (validation, checkpoints, sampling use it)
    freeze_pretrained_epochs: int = 0  # the parts of kind pretrained train frozen (linear probe) this long
    # a NaN / inf loss or gradient skips the update on every rank; this many in a row stop the run
    max_nonfinite_steps: int = 5
    # AdamW's kernel (torchtitan's optimizer.implementation): fused (one kernel over all tensors, on CPU
    # and CUDA; the default), foreach (multi-tensor), for-loop (torch's per-tensor reference)
    implementation: str = "fused"

    def __post_init__(self) -> None:
        if self.implementation not in ("fused", "foreach", "for-loop"):
            raise ValueError(f"implementation={self.implementation!r}; choose fused | foreach | for-loop")
        if self.ema_decay is not None and not 0.0 < self.ema_decay < 1.0:
            raise ValueError(f"ema_decay must be in (0, 1), got {self.ema_decay}")
        if self.name != "adamw":
            raise ValueError(f"optim.name={self.name!r}; only 'adamw' is available")
        positive(self, "max_nonfinite_steps")
        if self.freeze_pretrained_epochs < 0:
            raise ValueError(f"freeze_pretrained_epochs must be >= 0, got {self.freeze_pretrained_epochs}")
        if self.schedule not in ("cosine", "linear", "constant"):
            raise ValueError(f"schedule={self.schedule!r}; choose cosine | linear | constant")
        if len(self.betas) != 2:
            raise ValueError(f"betas needs 2 values, got {self.betas}")
        if self.layer_decay is not None and not 0.0 < self.layer_decay <= 1.0:
            raise ValueError(f"layer_decay must be in (0, 1], got {self.layer_decay}")


@dataclass
class TrainerConfig:
    """Lightning ``Trainer`` arguments (the subset recipes may set)."""

    accelerator: str = "auto"
    devices: Any = "auto"  # int | "auto" | list of ids
    strategy: str = "auto"  # auto | ddp | fsdp2 (any device, CPU too) | fsdp (GPU) | any Lightning name
    num_nodes: int = 1
    precision: str = "32-true"
    max_epochs: Optional[int] = None
    max_steps: int = -1
    max_time: Optional[str] = None  # "DD:HH:MM:SS"
    gradient_clip_val: Optional[float] = 1.0
    gradient_clip_algorithm: str = "norm"
    accumulate_grad_batches: int = 1
    log_every_n_steps: int = 10
    val_check_interval: Optional[Any] = None
    check_val_every_n_epoch: Optional[int] = 1
    limit_train_batches: Optional[Any] = None
    limit_val_batches: Optional[Any] = None
    num_sanity_val_steps: int = 2
    validate_first: bool = False  # validate once before training (a fine-tune's "before" numbers)
    deterministic: Optional[bool] = None
    enable_progress_bar: bool = True
    compile: bool = False  # torch.compile every transformer block (models.parallelize; keys stay clean)
    activation_checkpointing: bool = False  # recompute each block's activations in backward


@dataclass
class LoggerConfig:
    """W&B: ``auto`` = online when credentials exist, offline otherwise. A CSV log is always written."""

    mode: str = "auto"  # auto | online | offline | disabled
    project: str = "mmformer"
    entity: Optional[str] = None
    group: Optional[str] = None
    tags: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        if self.mode not in ("auto", "online", "offline", "disabled"):
            raise ValueError(f"mode={self.mode!r}; choose auto | online | offline | disabled")


@dataclass
class CheckpointConfig:
    monitor: Optional[str] = None  # default: the first task's main validation metric
    mode: Optional[str] = None  # min | max; default: the monitored metric's own direction
    save_top_k: int = 1
    every_n_train_steps: Optional[int] = None  # also refresh last.ckpt every N optimizer steps
    save_last: bool = True
    # trainer.strategy fsdp2: every rank writes its own shard (a folder) instead of rank 0 the whole
    # state; `mmformer export CKPT --format safetensors` merges one into a single file
    sharded: bool = False

    def __post_init__(self) -> None:
        if self.mode not in (None, "min", "max"):
            raise ValueError(f"mode={self.mode!r}; choose min or max")
        positive(self, "every_n_train_steps")


@dataclass
class MultiTaskConfig:
    """``multitask``: how a recipe with several tasks mixes them in training.

    ``schedule: all`` — every step holds one batch of every task and the loss is the sum of the tasks'
    losses times their ``weight`` (each task's data cycles until the longest is done).
    ``schedule: sampled`` — every step holds one task's batch, drawn with probability proportional to
    ``sample_weights`` (default: each task's number of training batches, so an epoch visits every task's
    data once in expectation), the same task on every rank by default: PolyViT's task sampling
    (Likhosherstov et al. 2021, §3.2). ``steps_per_epoch`` defaults to the sum of the tasks' batches.
    ``check_leaks`` refuses a recipe where one task's validation samples are another task's training
    samples (files compared by content, corpus documents and texts to classify by text).
    ``only: [task, …]`` trains a subset of the tasks (dropping the model parts only the others use):
    the single-task runs to compare a joint run with, from the same recipe.
    """

    schedule: str = "all"  # all | sampled
    sample_weights: dict[str, float] = field(default_factory=dict)
    steps_per_epoch: Optional[int] = None
    same_task_on_all_ranks: bool = True
    check_leaks: bool = True
    only: list[str] = field(default_factory=list)  # train just these tasks (single-task comparisons)

    def __post_init__(self) -> None:
        if self.schedule not in ("all", "sampled"):
            raise ValueError(f"schedule={self.schedule!r}; choose all | sampled")
        positive(self, "steps_per_epoch")
        for name, w in self.sample_weights.items():
            if not w >= 0:
                raise ValueError(f"sample_weights.{name} must be >= 0, got {w}")
        if self.sample_weights and not sum(self.sample_weights.values()) > 0:
            raise ValueError("sample_weights are all zero: no task would ever train")


@dataclass
class RecipeConfig:
    name: str = MISSING
    seed: int = 0
    model: ModelConfig = field(default_factory=ModelConfig)
    tasks: dict[str, Any] = field(default_factory=dict)
    optim: OptimConfig = field(default_factory=OptimConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    logger: LoggerConfig = field(default_factory=LoggerConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    multitask: MultiTaskConfig = field(default_factory=MultiTaskConfig)
    resume: Optional[str] = None  # auto | PATH to a .ckpt
