"""Every rule across the parts of a recipe, run when it loads (``check_recipe``): references between
tasks and model parts, the run's length, the multi-task schedule, distribution options, and each
component's own cross-part rules (its config's ``check``, ``mmformer.registry.CrossChecked``). Rules
that need what only a build reads (a pretrained file's sizes, a trained tokenizer's vocabulary) stay
with the builders."""

from __future__ import annotations

from ..errors import RecipeError, did_you_mean
from ..registry import CrossChecked


def used_tokenizers(tasks) -> set[str]:
    return {n for t in tasks for n in t.tokenizer_refs().values()}


def used_heads(tasks) -> set[str]:
    return {h for t in tasks for h, _ in t.head_refs().values()}


def keep_only(recipe, names: list[str]) -> None:
    """``multitask.only``: train a subset of a multi-task recipe's tasks (the single-task runs a joint
    run is compared with): the other tasks, and the tokenizers, towers and heads only they use, are
    dropped; the recipe's name gets ``-only-<tasks>``."""
    unknown = [n for n in names if n not in recipe.tasks]
    if unknown:
        raise RecipeError(
            f"'multitask.only' names {unknown[0]!r}, which is not a task ({', '.join(recipe.tasks)})."
            + did_you_mean(unknown[0], recipe.tasks)
        )
    recipe.tasks = {n: t for n, t in recipe.tasks.items() if n in names}
    tokenizers, heads = used_tokenizers(recipe.tasks.values()), used_heads(recipe.tasks.values())
    m = recipe.model
    m.tokenizers = {k: v for k, v in m.tokenizers.items() if k in tokenizers}
    m.towers = {k: v for k, v in m.towers.items() if k in tokenizers}
    m.heads = {k: v for k, v in m.heads.items() if k in heads}
    mt = recipe.multitask
    mt.sample_weights = {k: v for k, v in mt.sample_weights.items() if k in names}
    if len(recipe.tasks) == 1:  # nothing left to sample from
        mt.schedule, mt.sample_weights, mt.steps_per_epoch = "all", {}, None
    monitor = recipe.checkpoint.monitor or ""
    if monitor.count("/") >= 2 and monitor.split("/")[1] not in recipe.tasks:
        recipe.checkpoint.monitor = None  # it named a dropped task: the kept task's main metric instead
    suffix = "-only-" + "-".join(names)
    if not recipe.name.endswith(suffix):
        recipe.name += suffix


def check_recipe(recipe) -> None:
    """Raises ``RecipeError`` naming the key for the first rule the recipe breaks."""
    if not recipe.tasks:
        raise RecipeError("the recipe has no 'tasks'; add at least one (e.g. tasks: {mnist: {kind: ...}})")
    t = recipe.trainer
    if t.max_steps in (None, -1) and t.max_epochs in (None, -1):
        raise RecipeError(
            "set 'trainer.max_epochs' or 'trainer.max_steps': the LR schedule needs the run's length"
        )
    fused = recipe.optim.name == "adamw" and recipe.optim.implementation == "fused"
    if t.precision in ("16-mixed", "16") and fused and t.gradient_clip_val:
        raise RecipeError(
            f"trainer.precision={t.precision!r} scales the loss, and the fused AdamW unscales its gradients "
            "inside its step, after clipping would have run: set optim.implementation=foreach (or "
            "trainer.gradient_clip_val=null, or trainer.precision=bf16-mixed)"
        )
    _check_references(recipe)
    _check_model(recipe)
    _check_multitask(recipe)
    _check_distribution(recipe)
    m = recipe.model
    parts = [
        ("model.backbone", m.backbone),
        *((f"model.towers.{n}", c) for n, c in m.towers.items()),
        *((f"model.heads.{n}", c) for n, c in m.heads.items()),
        *((f"tasks.{n}", c) for n, c in recipe.tasks.items()),
        # after the tasks: what a task refuses outright (a kernel without its mask rules) is said before
        # what a tokenizer would need of the same kernel (AFT's position biases)
        *((f"model.tokenizers.{n}", c) for n, c in m.tokenizers.items()),
        *((f"tasks.{n}.data", c.data) for n, c in recipe.tasks.items()),
    ]
    for where, cfg in parts:
        if isinstance(cfg, CrossChecked):
            cfg.check(recipe, where)


def _check_references(recipe) -> None:
    m = recipe.model
    for name, task in recipe.tasks.items():
        refs = [(key, ref, "tokenizers", m.tokenizers) for key, ref in task.tokenizer_refs().items()]
        refs += [(key, ref, "heads", m.heads) for key, (ref, _) in task.head_refs().items()]
        for key, ref, part, table in refs:
            if ref not in table:
                raise RecipeError(
                    f"'tasks.{name}.{key}' refers to {ref!r}, which is not in model.{part} "
                    f"({', '.join(table) or 'none defined'})." + did_you_mean(ref, table)
                )
        head = m.heads.get(getattr(task, "head", None))
        tok = m.tokenizers.get(task.tokenizer)
        seq_len, max_len = getattr(task.data, "seq_len", None), getattr(tok, "max_len", None)
        if seq_len and max_len and seq_len > max_len:
            raise RecipeError(
                f"'tasks.{name}.data.seq_len' is {seq_len} but tokenizer '{task.tokenizer}' has learned "
                f"positions up to max_len={max_len}; raise max_len or shorten seq_len"
            )
        if getattr(head, "pool", None) == "cls" and getattr(tok, "class_token", True) is False:
            raise RecipeError(
                f"'model.heads.{task.head}.pool' is 'cls' but tokenizer '{task.tokenizer}' has "
                "class_token: false; use pool: mean or enable the class token"
            )
    for part, table, used in (
        ("tokenizer", m.tokenizers, used_tokenizers(recipe.tasks.values())),
        ("head", m.heads, used_heads(recipe.tasks.values())),
    ):
        for name in table:
            if name not in used:  # an unused part would be trained by nobody (and breaks DDP)
                raise RecipeError(
                    f"'model.{part}s.{name}' is not used by any task; remove it or point a task's '{part}' at it"
                )


def _check_model(recipe) -> None:
    m = recipe.model
    for section, what in (("resamplers", ""), ("towers", " (a tower reads one tokenizer's tokens)")):
        for name in getattr(m, section):
            if name not in m.tokenizers:
                raise RecipeError(
                    f"'model.{section}.{name}' names no tokenizer{what}: model.tokenizers has "
                    f"{', '.join(m.tokenizers) or 'none'}." + did_you_mean(name, m.tokenizers)
                )
    if m.lora is not None and m.backbone.kind != "pretrained":
        raise RecipeError("'model.lora' adapts pretrained weights: set model.backbone to kind: pretrained")
    if m.towers:
        if set(m.towers) >= set(m.tokenizers):
            raise RecipeError(
                "every tokenizer has a tower, so the shared 'model.backbone' would read nothing: give one "
                "modality the shared backbone (remove its entry from model.towers)"
            )
        for task in recipe.tasks.values():
            if task.kind == "diffusion":
                for name in task.tokenizer_refs().values():
                    if name in m.towers:
                        raise RecipeError(
                            f"'model.towers.{name}': a diffusion task reads its tokenizers through the shared "
                            "adaLN backbone (captions are pooled embeddings); remove the tower"
                        )


def _check_multitask(recipe) -> None:
    mt = recipe.multitask
    for name in mt.sample_weights:
        if name not in recipe.tasks:
            raise RecipeError(
                f"'multitask.sample_weights.{name}' names no task (tasks: {', '.join(recipe.tasks)})."
                + did_you_mean(name, recipe.tasks)
            )
    missing = [n for n in recipe.tasks if n not in mt.sample_weights]
    if mt.sample_weights and missing:
        raise RecipeError(
            f"'multitask.sample_weights' gives no weight to {', '.join(missing)}: list every task (0 to skip one)"
        )
    if mt.sample_weights and mt.schedule != "sampled":
        raise RecipeError("'multitask.sample_weights' needs multitask.schedule: sampled")
    if mt.steps_per_epoch is not None and mt.schedule != "sampled":
        raise RecipeError("'multitask.steps_per_epoch' needs multitask.schedule: sampled")
    gathering = [n for n, t in recipe.tasks.items() if t.kind == "contrastive"]
    if mt.schedule == "sampled" and not mt.same_task_on_all_ranks and gathering and len(recipe.tasks) > 1:
        raise RecipeError(
            f"'multitask.same_task_on_all_ranks: false' would hang: task {gathering[0]!r} gathers features "
            "from every rank inside its step, so all ranks must run it at the same step (set it to true)"
        )


def _check_distribution(recipe) -> None:
    mt, strategy = recipe.multitask, recipe.trainer.strategy
    if recipe.checkpoint.sharded and strategy != "fsdp2":
        raise RecipeError(
            "'checkpoint.sharded: true' needs trainer.strategy: fsdp2 (to validate a sharded run's "
            "checkpoint with another strategy, add checkpoint.sharded=false)"
        )
    if strategy == "fsdp2":
        if mt.schedule == "sampled" and not mt.same_task_on_all_ranks and len(recipe.tasks) > 1:
            raise RecipeError(
                "'multitask.same_task_on_all_ranks: false' would hang under trainer.strategy: fsdp2: every "
                "rank gathers each block's weights together, so all ranks must run the same task"
            )
        if recipe.optim.freeze_pretrained_epochs and recipe.checkpoint.sharded:
            raise RecipeError(
                "optim.freeze_pretrained_epochs with checkpoint.sharded: true is not supported (a part frozen "
                "since the start has no optimizer state to shard): set checkpoint.sharded=false"
            )
        if recipe.optim.freeze_pretrained_epochs and recipe.optim.name != "adamw":
            raise RecipeError(
                f"optim.freeze_pretrained_epochs with optim.name={recipe.optim.name!r} is not supported under "
                "trainer.strategy: fsdp2 (a part frozen since the start is saved with AdamW's fresh state, "
                "which FSDP2 loads strictly): use optim.name=adamw, or DDP"
            )
        if recipe.optim.ema_decay is not None and recipe.checkpoint.sharded:
            raise RecipeError(
                "optim.ema_decay with checkpoint.sharded: true is not supported (the average is kept per "
                "shard but written only into whole checkpoints): set checkpoint.sharded=false"
            )
    if recipe.optim.freeze_pretrained_epochs:
        m = recipe.model
        pretrained = [c for c in (*m.tokenizers.values(), *m.towers.values()) if c.kind == "pretrained"]
        if not pretrained and m.backbone.kind != "pretrained":
            raise RecipeError(
                "optim.freeze_pretrained_epochs freezes parts of kind pretrained; this model has none"
            )
        if strategy not in ("auto", "ddp", "ddp_find_unused_parameters_true", "fsdp2"):
            raise RecipeError(
                f"optim.freeze_pretrained_epochs works with DDP, FSDP2 or one device, not trainer.strategy="
                f"{strategy!r}"
            )
