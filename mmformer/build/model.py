"""The model side of the composition root: the composed model and the LightningModule from a loaded
recipe, each part built by the builder registered for its ``kind`` with one ``BuildContext``."""

from __future__ import annotations

from ..components import BuildContext
from ..components.backbones import freeze
from ..errors import RecipeError
from ..models import MultimodalModel
from ..models.resampler import PerceiverResampler, ResampledTokenizer
from ..nn.lora import apply_lora
from ..recipe import recipe_to_yaml
from ..registry import lookup
from ..tasks import MultiTaskModule


def build_model(recipe, ctx: BuildContext | None = None) -> MultimodalModel:
    """The composed model (``tokenizers + backbone + heads``, and towers). ``ctx`` carries what a
    checkpoint pins (its text tokenizers, its pretrained architectures); pretrained parts load their
    weights here, each source once. ``model.lora`` then wraps the linear layers of the backbone and of
    the pretrained towers, and freezes the pretrained parts. One context builds one model (its
    pretrained parts share tensors)."""
    ctx = ctx or BuildContext(recipe)
    m = recipe.model
    backbone = lookup("backbone", m.backbone.kind).builder(m.backbone, ctx)
    ctx.d_model = backbone.d_model
    towers = {n: lookup("backbone", c.kind).builder(c, ctx) for n, c in m.towers.items()}
    width = {n: (towers[n] if n in towers else backbone).d_model for n in m.tokenizers}
    tokenizers = {
        n: lookup("tokenizer", c.kind).builder(c, width[n], ctx, n) for n, c in m.tokenizers.items()
    }
    for n, r in m.resamplers.items():  # a fixed token budget for this tokenizer's inputs
        resampler = PerceiverResampler(width[n], r.num_latents, r.n_layers, r.n_heads, r.mlp_ratio)
        tokenizers[n] = ResampledTokenizer(tokenizers[n], resampler)
    reader: dict[str, str] = {}  # head → the tokenizer whose tokens reach it (the first task's)
    for t in recipe.tasks.values():
        for head, tok in t.head_refs().values():
            reader.setdefault(head, tok)
    heads = {}
    for name, cfg in m.heads.items():  # each reads the tokens of the tokenizer a task feeds it
        tok = reader.get(name)
        d = width[tok] if tok is not None else backbone.d_model
        heads[name] = lookup("head", cfg.kind).builder(cfg, d, tokenizers.get(tok), ctx)
    for p in ctx.loaded.values():
        if p.report is not None and p.report.loaded:  # read from the source (not rebuilt from a checkpoint)
            print(p.report)
    model = MultimodalModel(tokenizers, backbone, heads, towers)
    model.pretrained_configs = ctx.pretrained_configs()  # checkpoints carry them, so they stand alone
    if m.lora is not None:  # the pretrained parts freeze; adapters and new parts train
        freeze(model.backbone)
        for table, parts in (("tokenizers", m.tokenizers), ("heads", m.heads), ("towers", m.towers)):
            for name, c in parts.items():
                if c.kind == "pretrained":
                    freeze(getattr(model, table)[name])
        # adapters on the backbone and on every pretrained tower (an encoder–decoder's encoder)
        stacks = ["backbone"] + [f"towers.{n}" for n, c in m.towers.items() if c.kind == "pretrained"]
        try:
            for stack in stacks:
                apply_lora(model, tuple(m.lora.targets), m.lora.rank, m.lora.alpha, m.lora.dropout, stack)
        except ValueError as e:
            raise RecipeError(f"'model.lora.targets': {e}") from None
    return model


def build_module(
    recipe, model: MultimodalModel | None = None, ctx: BuildContext | None = None
) -> MultiTaskModule:
    """The LightningModule; checkpoints will carry the text tokenizers' JSON so they stand alone."""
    ctx = ctx or BuildContext(recipe)
    model = model or build_model(recipe, ctx)
    tasks = {n: lookup("task", t.kind).builder(t, ctx) for n, t in recipe.tasks.items()}
    weights = {n: t.weight for n, t in recipe.tasks.items()}
    modality = ctx.tokenizer_modality
    return MultiTaskModule(
        model,
        tasks,
        weights,
        recipe.optim,
        recipe_to_yaml(recipe),
        recipe.seed,
        task_modalities={n: modality(recipe.model.tokenizers[t.tokenizer]) for n, t in recipe.tasks.items()},
        tokenizer_files={
            n: ctx.text_tokenizer(n).to_json()
            for n, c in recipe.model.tokenizers.items()
            if modality(c) == "text"
        },
        pretrained_configs=dict(getattr(model, "pretrained_configs", {})),
    )
