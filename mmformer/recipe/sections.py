"""The recipe's sections: ``model`` (the parts, picked by ``kind`` from ``mmformer.registry``),
``optim``, ``trainer``, ``logger``, ``checkpoint``, ``multitask``, and the ``RecipeConfig`` that holds
them. Values are checked in ``__post_init__``; rules across parts in ``mmformer.recipe.checks``."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

from omegaconf import MISSING

from ..errors import did_you_mean, positive, probability
from ..training.optim import SCHEDULES, check_optimizer


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
    """``model.lora``: low-rank adapters on the linear layers of the pretrained backbone and of pretrained
    towers (e.g. Whisper's encoder beside its decoder); every part of kind ``pretrained`` is frozen, the
    adapters and parts built new (e.g. a classifier head) train (Hu et al. 2021)."""

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
    """The optimizer — ``adamw`` (torch's, fused kernel by default) or any of timm's (``sgd``, ``lion``,
    ``lamb``, ``adafactor``, …; ``mmformer.training.optim``) — with linear warmup then cosine (or linear /
    poly / step / constant) decay to ``min_lr``. Norms, biases, position embeddings and class tokens get
    no weight decay, whichever the optimizer. Raises ``ValueError`` naming the key for an unknown name
    (with a did-you-mean) or an option the optimizer does not take."""

    name: str = "adamw"  # adamw | any name timm.optim.list_optimizers() gives (sgd, lion, lamb, …)
    lr: float = 1e-3
    weight_decay: float = 0.05
    # AdamW's; another optimizer with betas keeps its own (Lion 0.9, 0.99; Adan's three) unless these change
    betas: list[float] = field(default_factory=lambda: [0.9, 0.999])
    eps: Optional[float] = None  # None: the optimizer's own (AdamW 1e-8, LAMB 1e-6, …)
    momentum: Optional[float] = None  # SGD, RMSprop, LARS, Muon, …; None: timm's 0.9
    # more keyword arguments of the optimizer's class, checked against its signature, e.g. {nesterov: false}
    opt_args: dict[str, Any] = field(default_factory=dict)
    warmup_steps: int = 0
    schedule: str = "cosine"  # cosine | linear | poly | step | constant
    min_lr: float = 0.0
    power: float = 0.5  # poly: (1 - progress) ** power (timm's default)
    step_size: Optional[int] = None  # step: the LR is multiplied by gamma every step_size steps
    gamma: float = 0.1
    layer_decay: Optional[float] = None  # layer-wise LR decay: block i of L trains at lr · decay^(L - i)
    ema_decay: Optional[float] = None  # keep an EMA of the weights (validation, checkpoints, sampling use it)
    freeze_pretrained_epochs: int = 0  # the parts of kind pretrained train frozen (linear probe) this long
    # a NaN / inf loss or gradient skips the update on every rank; this many in a row stop the run
    max_nonfinite_steps: int = 5
    # AdamW's kernel (torchtitan's optimizer.implementation): fused (one kernel over all tensors, on CPU
    # and CUDA; the default), foreach (multi-tensor), for-loop (torch's per-tensor reference); for timm's
    # optimizers foreach / for-loop set their foreach option, fused leaves their default
    implementation: str = "fused"

    def __post_init__(self) -> None:
        if self.implementation not in ("fused", "foreach", "for-loop"):
            raise ValueError(f"implementation={self.implementation!r}; choose fused | foreach | for-loop")
        if self.ema_decay is not None and not 0.0 < self.ema_decay < 1.0:
            raise ValueError(f"ema_decay must be in (0, 1), got {self.ema_decay}")
        positive(self, "max_nonfinite_steps", "step_size", "power", "gamma")
        if self.freeze_pretrained_epochs < 0:
            raise ValueError(f"freeze_pretrained_epochs must be >= 0, got {self.freeze_pretrained_epochs}")
        if self.schedule not in SCHEDULES:
            hint = did_you_mean(self.schedule, SCHEDULES)
            raise ValueError(f"schedule={self.schedule!r}.{hint} Choose {' | '.join(SCHEDULES)}")
        if self.schedule == "step" and self.step_size is None:
            raise ValueError("schedule=step needs step_size (multiply the LR by gamma every step_size steps)")
        if self.layer_decay is not None and not 0.0 < self.layer_decay <= 1.0:
            raise ValueError(f"layer_decay must be in (0, 1], got {self.layer_decay}")
        check_optimizer(self)  # name, betas, eps, momentum, opt_args against the optimizer's class


@dataclass
class TrainerConfig:
    """Lightning ``Trainer`` arguments: mmformer's own keys (``validate_first``, ``compile``,
    ``activation_checkpointing``, ``onednn_linears``, ``threads``) and the arguments recipes set most are
    typed fields; every other argument of ``lightning.Trainer`` (``fast_dev_run``, ``profiler``, ``overfit_batches``,
    ``detect_anomaly``, ``benchmark``, ``min_epochs`` …) may be set under ``trainer`` too. The loader
    moves those into ``extra`` and writes them back under ``trainer`` (``mmformer.recipe.trainer_args``).

    Raises ``ValueError`` (in ``__post_init__``) for an ``extra`` key that is no ``lightning.Trainer``
    argument (with a did-you-mean), one mmformer sets itself (with the reason), a typed field spelled as
    an extra, or a value of the wrong type for Lightning's annotation.
    """

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
    deterministic: Any = None  # true | false | warn (Lightning: warn where no deterministic kernel exists)
    enable_progress_bar: bool = True
    compile: bool = False  # torch.compile every transformer block (models.parallelize; keys stay clean)
    activation_checkpointing: bool = False  # recompute each block's activations in backward
    # CPU float32 linears multiply on oneDNN, forward and backward (mmformer.nn.onednn: the same values up to
    # rounding; faster than PyTorch's MKL products on some CPUs, slower on others); false: PyTorch's own;
    # null: whichever a 0.3 s measurement at the start finds faster on this CPU (nn.onednn.faster_here).
    # No effect on a GPU
    onednn_linears: Optional[bool] = None
    # intra-op threads per process; null: OMP_NUM_THREADS if set, else cores // processes per node
    # (mmformer.training.threads)
    threads: Optional[int] = None
    # the other lightning.Trainer arguments, passed through as they are (a recipe writes them under trainer)
    extra: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        from .trainer_args import check_extra  # imports Lightning: only when a recipe is checked

        if self.deterministic not in (None, True, False, "warn"):
            raise ValueError(f"deterministic={self.deterministic!r}; choose true | false | warn")
        if self.threads is not None and self.threads < 1:
            raise ValueError(f"threads={self.threads}; need >= 1 (or null: cores // processes per node)")
        check_extra(self.extra)


@dataclass
class LoggerConfig:
    """``logger``: where metrics go besides ``metrics.csv`` (always written). ``kinds`` picks the loggers
    (``wandb``, ``tensorboard``, ``mlflow``; the last needs ``pip install 'mmformer[loggers]'``).

    W&B: ``mode`` ``auto`` = online when credentials exist, offline otherwise; ``log_model`` uploads
    checkpoints as W&B model artifacts: ``false``, ``last`` (``last.ckpt`` when training ends), ``best``
    (the best checkpoint when training ends) or ``all`` (every checkpoint as it is written).
    MLflow: ``mlflow_tracking_uri`` (default: the file store ``<runs folder>/mlruns``).
    """

    kinds: list[str] = field(default_factory=lambda: ["wandb"])  # wandb | tensorboard | mlflow
    mode: str = "auto"  # W&B: auto | online | offline | disabled
    project: str = "mmformer"  # the W&B project and the MLflow experiment
    entity: Optional[str] = None
    group: Optional[str] = None
    tags: list[str] = field(default_factory=list)
    log_model: str = "false"  # W&B: false | last | best | all
    mlflow_tracking_uri: Optional[str] = None

    def __post_init__(self) -> None:
        if self.mode not in ("auto", "online", "offline", "disabled"):
            raise ValueError(f"mode={self.mode!r}; choose auto | online | offline | disabled")
        self.log_model = str(self.log_model).lower()  # YAML's false arrives as the string 'False'
        if self.log_model not in LOG_MODEL:
            hint = did_you_mean(self.log_model, LOG_MODEL)
            raise ValueError(f"log_model={self.log_model!r}.{hint} Choose {' | '.join(LOG_MODEL)}")
        for kind in self.kinds:
            if kind not in LOGGER_KINDS:
                hint = did_you_mean(kind, LOGGER_KINDS)
                choose = ", ".join(LOGGER_KINDS)
                raise ValueError(f"kinds has {kind!r}, not a logger.{hint} Choose from: {choose}")
        if len(set(self.kinds)) != len(self.kinds):
            raise ValueError(f"kinds names a logger twice: {self.kinds}")


LOGGER_KINDS = ("wandb", "tensorboard", "mlflow")  # besides the CSV log, which is always written
LOG_MODEL = ("false", "last", "best", "all")


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
