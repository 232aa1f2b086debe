"""mmformer against its peers on CPU: same-run paired timings at identical configurations.

    python bench/peers.py                       # all five, full sizes (a few minutes each)
    python bench/peers.py --quick               # tiny sizes, ~1 minute: checks the script works
    python bench/peers.py --only vit,dit        # some of: vit, gpt2, llama, generate, dit
    python bench/peers.py --only generate --new-tokens 256   # longer generations
    python bench/peers.py --only generate --compile-decoding # mmformer's compiled decoding step (cached)
    python bench/peers.py --only generate --compile-decoding frozen  # the frozen-weights step
    python bench/peers.py --only generate --compile-decoding --peer-compile  # + HF static cache + compile
    python bench/peers.py --only gpt2 --optimizer fused     # one AdamW kernel (both sides) instead of two
    python bench/peers.py --only gpt2 --compile             # regional torch.compile, both sides
    python bench/peers.py --optimizer platform              # each platform's default AdamW (secondary)
    python bench/peers.py --only gpt2 --linears both        # + mmformer on PyTorch's own linears, a column

Benchmarks (fp32, ``torch.set_num_threads(2)`` unless ``--threads``):
  vit       ViT-S/16 training step vs timm ``vit_small_patch16_224``            images/s
  gpt2      GPT-2 small training step vs transformers ``GPT2LMHeadModel`` (sdpa)   tokens/s
  llama     SmolLM2-135M training step vs transformers ``LlamaForCausalLM`` (sdpa) tokens/s
  generate  greedy KV-cache decoding of the real SmolLM2-135M-Instruct, batch 1 and 4 (left-padded),
            ``mmformer.models.generate.generate`` vs ``LlamaForCausalLM.generate``  new tokens/s
            (and the time to the first token: the prompt's forward + one token)   first tokens/s
  dit       DiT-S/2 training step vs the DiT paper's model (facebookresearch/DiT ``models.py``, rebuilt
            below from timm's ``PatchEmbed`` / ``Attention`` / ``Mlp``)              samples/s

Each benchmark builds both models at one configuration, copies the weights across (or loads the same
checkpoint into both) and checks they compute the same thing (forward outputs, the first step's loss,
greedy ids) before timing. A training step is forward, the loss, backward and an AdamW step with the
same settings on both sides.

AdamW (``--optimizer``): the headline is the same kernel on both sides. ``same`` (the default) runs
every training benchmark twice — ``fused`` vs ``fused``, then ``loop`` vs ``loop`` (the per-tensor
for-loop, ``foreach=False``, torch's default on CPU) — and the summary prints that "same optimizer"
table first. ``fused`` / ``loop`` / ``foreach`` / ``default`` (torch's own choice) run one kernel on
both sides. ``platform`` (secondary, labelled so) compares out-of-the-box defaults: mmformer's recipes
train with the fused kernel, a plain ``torch.optim.AdamW`` / timm's ``create_optimizer_v2`` use the loop
— but a peer user gets the fused kernel with one flag (``fused=True``; transformers' Trainer defaults to
``adamw_torch_fused``), so that ratio measures defaults, not implementations. Generation has no
optimizer and runs once.

``--linears``: by default (``auto``) mmformer's training steps multiply as ``mmformer train`` chooses
(``trainer.onednn_linears: null``): on oneDNN (``mmformer.nn.onednn.use_onednn``: forward and both backward
products) where ``nn.onednn.faster_here()`` measures it faster on this CPU, else on PyTorch's (MKL), which
the peer always keeps; ``onednn`` forces oneDNN. ``aten``: mmformer on PyTorch's linears too (the same kernels on
both sides); ``both``: oneDNN, with a copy of mmformer on PyTorch's linears as one more column, so the
gain from the linears alone is measured in the same rounds.

``--compile``: mmformer's blocks are compiled as ``trainer.compile: true`` does
(``mmformer.models.parallelize.compile_blocks``: regional, one ``torch.compile`` per block) and timed
against the eager peer and against a copy of the peer whose blocks are compiled the same regional way
(GPT-2 ``transformer.h``, Llama ``model.layers``, timm / DiT ``blocks``). The first-step losses are
checked (1e-4 relative); compile time (the first steps minus as many ordinary steps) is printed apart.

After warm-up the sides run alternately in this process (mmformer, peer, [compiled peer,] mmformer, …),
so all see the same machine state (``--block K``: K calls of a side in a row, the first untimed —
the first step after the other model's evicts caches, and MKL's first products after oneDNN's run
~10 % slower); printed: each side's median time and throughput, and the median and
interquartile range of the per-round ratios peer time / mmformer time (> 1: mmformer is faster).
Uses only the model library (``mmformer.nn``, ``mmformer.models``, ``mmformer.tokenizers``) besides
the peers themselves (timm, transformers).
"""

from __future__ import annotations

import argparse
import gc
import math
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from functools import partial

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

BENCHMARKS = ("vit", "gpt2", "llama", "generate", "dit")


# ---------------------------------------------------------------------------------------- harness
@dataclass
class Settings:
    quick: bool
    pairs: int
    warmup: int
    optimizer: (
        str  # one AdamW kernel per run: fused | loop | foreach | default | platform ("same" → fused, loop)
    )
    new_tokens: int = 64  # generate: tokens decoded per call
    compile_decoding: bool | str = (
        False  # generate: mmformer decodes with generate(compile="cached" / "frozen")
    )
    peer_compile: bool = False  # generate, with compile_decoding: also transformers' static cache + compile
    compile: bool = False  # training: regional per-block torch.compile (mmformer; and the peer, a 2nd column)
    linears: str = "onednn"  # training: mmformer's CPU linears — onednn, aten, both (--linears auto: chosen)
    block: int = 1  # calls of one side in a row per round; > 1: the first is untimed (the switch's cost)


OPTIMIZERS = ("same", "fused", "loop", "foreach", "default", "platform")


@dataclass
class Result:
    name: str
    peer: str
    unit: str
    units: float  # per call
    mm_s: float
    peer_s: float
    ratio: float
    q1: float
    q3: float
    pairs: int
    optimizer: str = "-"  # the AdamW kernel (training); "-" for generation
    mode: str = "eager"  # eager | compiled (mmformer compiled, the peer as its label says)
    compile_s: tuple[float, float] | None = None  # (mmformer, peer) one-off compile seconds, when compiled

    def lines(self) -> list[str]:
        return [
            f"  {self.peer} / mmformer time: median {self.ratio:.3f}, IQR {self.q1:.3f}–{self.q3:.3f} "
            f"over {self.pairs} pairs (> 1: mmformer faster)",
        ]


def quartiles(xs: list[float]) -> tuple[float, float, float]:
    q1, q2, q3 = statistics.quantiles(xs, n=4, method="inclusive") if len(xs) > 1 else (xs[0],) * 3
    return q1, q2, q3


def paired_multi(
    name: str,
    mm_call: Callable[[], object],
    peer_calls: list[tuple[str, Callable[[], object]]],
    units: float,
    unit: str,
    s: Settings,
    mm_label: str = "mmformer",
    **extra,
) -> tuple[list[Result], list[list[float]]]:
    """Warm up all, then time them round-robin ``s.pairs`` times (mmformer, peer 1, peer 2, …); one
    ``Result`` per peer, ratios per round. Also returns each side's warm-up times (mmformer first)."""
    calls = [(mm_label, mm_call), *peer_calls]
    warm: list[list[float]] = [[] for _ in calls]
    for _ in range(s.warmup):
        for i, (_, call) in enumerate(calls):
            t0 = time.perf_counter()
            call()
            warm[i].append(time.perf_counter() - t0)
    gc.collect()
    gc.disable()  # no collector pauses inside a timed call (all sides alike)
    times: list[list[float]] = [[] for _ in calls]
    try:
        for _ in range(s.pairs):
            for i, (_, call) in enumerate(calls):
                runs = []
                for _ in range(s.block):
                    t0 = time.perf_counter()
                    call()
                    runs.append(time.perf_counter() - t0)
                times[i].append(statistics.median(runs[1:]) if s.block > 1 else runs[0])
    finally:
        gc.enable()
    med = [statistics.median(t) for t in times]
    for (label, _), m in zip(calls, med):
        print(f"  {label:14} {m * 1e3:9.1f} ms   {units / m:9.1f} {unit}", flush=True)
    results = []
    for i, (label, _) in enumerate(peer_calls, 1):
        q1, r, q3 = quartiles([b / a for a, b in zip(times[0], times[i])])
        res = Result(name, label, unit, units, med[0], med[i], r, q1, q3, s.pairs, **extra)
        for line in res.lines():
            print(line, flush=True)
        results.append(res)
    return results, [[*w, m] for w, m in zip(warm, med)]


def paired(
    name: str,
    peer: str,
    mm_call: Callable[[], object],
    peer_call: Callable[[], object],
    units: float,
    unit: str,
    s: Settings,
    **extra,
) -> Result:
    """Warm up both, then time them alternately ``s.pairs`` times; ratios are per pair."""
    return paired_multi(name, mm_call, [(peer, peer_call)], units, unit, s, **extra)[0][0]


def check_close(what: str, got: torch.Tensor, want: torch.Tensor, rel: float = 1e-4) -> None:
    """``max |got - want| <= rel · max |want|``; prints the difference, raises ``AssertionError``."""
    got, want = got.detach().float(), want.detach().float()
    if got.shape != want.shape:
        raise AssertionError(f"{what}: shapes differ, {tuple(got.shape)} vs {tuple(want.shape)}")
    diff, scale = (got - want).abs().max().item(), want.abs().max().item()
    print(f"  check {what}: max |Δ| = {diff:.2e} (max |ref| = {scale:.2e})", flush=True)
    if not diff <= rel * max(scale, 1e-12):
        raise AssertionError(f"{what}: mmformer and the peer differ by {diff:.3e} (> {rel} × {scale:.3e})")


def adamw(model: nn.Module, s: Settings, ours: bool) -> torch.optim.Optimizer:
    """AdamW as ``s.optimizer`` says: the same kernel on both sides — ``fused``, ``loop`` (the per-tensor
    for-loop, ``foreach=False``: torch's default on CPU), ``foreach`` (multi-tensor), ``default`` (torch's
    own choice) — or ``platform``: each side as its platform trains out of the box — mmformer's recipes
    use the fused kernel (``optim.implementation``, ``mmformer.training.optim.adamw_kernel``), the peer
    torch's default (what timm's ``create_optimizer_v2`` and a plain ``torch.optim.AdamW`` give; a peer
    user can switch on ``fused=True`` too, so this compares defaults, not implementations)."""
    if s.optimizer == "platform":
        kw = {}
        if ours:
            from mmformer.training.optim import adamw_kernel  # torch only, like the model library

            kw = adamw_kernel([{"params": list(model.parameters())}], "fused")
    else:
        kw = {
            "foreach": {"foreach": True},
            "fused": {"fused": True},
            "loop": {"foreach": False},
            "default": {},
        }[s.optimizer]
    return torch.optim.AdamW(model.parameters(), lr=1e-5, weight_decay=0.05, **kw)


def train_step(model: nn.Module, loss_fn: Callable[[], torch.Tensor], s: Settings, ours: bool = False):
    """A closure doing one training step (zero grads, loss, backward, AdamW step); returns the loss.
    ``ours``: the mmformer side (for ``--optimizer platform``)."""
    opt = adamw(model, s, ours)
    model.train()

    def step() -> float:
        opt.zero_grad(set_to_none=True)
        loss = loss_fn()
        loss.backward()
        opt.step()
        return loss.detach()

    return step


def first_losses_match(mm_step, peer_step, rel: float = 1e-4) -> None:
    """Run the first step of each (same weights, same batch): their losses must agree."""
    a, b = mm_step(), peer_step()
    check_close("first-step loss", a, b, rel)


def _warm_inductor() -> None:
    """Compile a tiny forward and backward once, so the compiler's start-up (imports, C++ toolchain
    checks, worker pools) lands in neither side's compile time."""
    import torch._inductor.config

    torch._inductor.config.force_disable_caches = True  # cold compiles: no graph cache from an earlier run
    lin = nn.Linear(8, 8)
    f = torch.compile(lambda x: F.gelu(lin(x)).sum())
    f(torch.randn(2, 8, requires_grad=True)).backward()


def compare_training(
    name: str,
    peer: str,
    ours: nn.Module,
    ref: nn.Module,
    ours_loss: Callable[[nn.Module], torch.Tensor],
    ref_loss: Callable[[nn.Module], torch.Tensor],
    ref_blocks: Callable[[nn.Module], list[nn.Module]],
    units: float,
    unit: str,
    s: Settings,
    check_loss: bool = True,
) -> list[Result]:
    """Time mmformer's training step against the peer's (same weights, same batch, ``s.optimizer``).

    ``s.compile``: mmformer's blocks compiled as ``trainer.compile: true`` does
    (``mmformer.models.parallelize.compile_blocks``, regional per-block ``torch.compile``), timed
    round-robin against the eager peer and against a copy of the peer whose blocks (``ref_blocks``)
    are compiled the same regional way. Compile time: the first steps' time (the loss check and the
    warm-up) minus as many timed steps' median."""
    import copy

    from mmformer.nn.onednn import use_onednn

    extra = {"optimizer": s.optimizer}
    aten = copy.deepcopy(ours) if s.linears == "both" and not s.compile else None  # before any step
    if s.linears != "aten":
        print(f"  mmformer linears on oneDNN: {use_onednn(ours)} (as mmformer train)", flush=True)
    if not s.compile:
        mm = train_step(ours, lambda: ours_loss(ours), s, ours=True)
        peer_step = train_step(ref, lambda: ref_loss(ref), s)
        if check_loss:
            first_losses_match(mm, peer_step)
        label = "mmformer" if s.linears == "aten" else "mmformer+onednn"
        calls = [(peer, peer_step)]
        if aten is not None:
            calls.append(("mmformer-aten", train_step(aten, lambda: ours_loss(aten), s, ours=True)))
        return paired_multi(name, mm, calls, units, unit, s, mm_label=label, **extra)[0]

    from mmformer.models.parallelize import compile_blocks

    _warm_inductor()  # the process's one-off compiler start-up is nobody's compile time
    ref_c = copy.deepcopy(ref)  # before any step: the same weights as `ref` and `ours`
    n_mm = compile_blocks(ours)
    n_ref = 0
    for block in ref_blocks(ref_c):
        block.compile()
        n_ref += 1
    print(f"  regional torch.compile: mmformer {n_mm} blocks, {peer} {n_ref} blocks", flush=True)
    mm = train_step(ours, lambda: ours_loss(ours), s, ours=True)
    peer_step = train_step(ref, lambda: ref_loss(ref), s)
    peer_c = train_step(ref_c, lambda: ref_loss(ref_c), s)

    def timed(step):
        t0 = time.perf_counter()
        out = step()
        return out, time.perf_counter() - t0

    (a, t_mm), (c, t_pc), (b, _) = timed(mm), timed(peer_c), timed(peer_step)  # compiles here
    if check_loss:  # compiled kernels reorder float sums: ~1e-4 relative
        check_close("first-step loss, compiled mmformer vs eager peer", a, b, 1e-4)
        check_close("first-step loss, compiled peer vs eager peer", c, b, 1e-4)
    (r_eager, r_comp), warm = paired_multi(
        name,
        mm,
        [(peer, peer_step), (f"{peer}+compile", peer_c)],
        units,
        unit,
        s,
        mm_label="mmformer+compile",
        mode="compiled",
        **extra,
    )
    # warm[i] = [warm-up times…, median]; compile ≈ first steps − as many ordinary steps
    c_mm = t_mm + sum(warm[0][:-1]) - (1 + s.warmup) * warm[0][-1]
    c_pc = t_pc + sum(warm[2][:-1]) - (1 + s.warmup) * warm[2][-1]
    print(
        f"  compile time (first {1 + s.warmup} steps minus as many timed): mmformer {c_mm:.1f} s, "
        f"{peer}+compile {c_pc:.1f} s",
        flush=True,
    )
    r_eager.compile_s = (c_mm, 0.0)
    r_comp.compile_s = (c_mm, c_pc)
    return [r_eager, r_comp]


def lm_loss(logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Next-token cross-entropy of the peer's logits (what transformers' ``ForCausalLMLoss`` computes)."""
    return F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), ids[:, 1:].flatten())


def mm_lm_loss(model: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    """The same function on mmformer's side, computed as ``mmformer train`` computes it
    (``CausalLMTask.training_loss``: the LM head's chunked cross-entropy, ``LMHead.cross_entropy``, which
    never holds the logits); written with the model library alone (the tasks import Lightning)."""
    hidden, _ = model.encode("text", ids)
    return model.heads["lm"].cross_entropy(hidden[:, :-1], ids[:, 1:])


# ---------------------------------------------------------------------------------------- (a) ViT
def bench_vit(s: Settings) -> list[Result]:
    import timm

    from mmformer.models import AttentionConfig, ClassifierHead, MlpConfig, MultimodalModel, build_backbone
    from mmformer.models.pretrained.timm_vit import timm_to_mmformer
    from mmformer.tokenizers import ViTPatchTokenizer

    if s.quick:
        cfg = dict(img_size=32, patch_size=8, embed_dim=48, depth=2, num_heads=3, num_classes=10)
        batch = 4
    else:
        cfg = dict(img_size=224, patch_size=16, embed_dim=384, depth=12, num_heads=6, num_classes=1000)
        batch = 8
    print(
        f"\n[vit] ViT-S/16-style training step: {cfg}, batch {batch}, vs timm vit_small_patch16_224",
        flush=True,
    )
    torch.manual_seed(0)
    ref = timm.create_model(
        "vit_small_patch16_224",
        pretrained=False,
        **cfg,
        qkv_bias=True,
        class_token=True,
        global_pool="token",
        drop_rate=0.0,
        proj_drop_rate=0.0,
        attn_drop_rate=0.0,
        drop_path_rate=0.0,
    )
    with torch.no_grad():  # a non-zero head, so the logits check means something
        nn.init.trunc_normal_(ref.head.weight, std=0.02)
    d = cfg["embed_dim"]
    ours = MultimodalModel(
        {"image": ViTPatchTokenizer(d, cfg["img_size"], cfg["patch_size"], 3)},
        build_backbone(
            d,
            cfg["depth"],
            AttentionConfig(cfg["num_heads"], qkv_bias=True),
            mlp=MlpConfig(act="gelu"),
            norm_eps=1e-6,
        ),
        {"cls": ClassifierHead(d, cfg["num_classes"], pool="cls")},
    )
    missing, unexpected = ours.load_state_dict(timm_to_mmformer(ref.state_dict()), strict=True)
    assert not missing and not unexpected
    g = torch.Generator().manual_seed(1)
    x = torch.randn(batch, 3, cfg["img_size"], cfg["img_size"], generator=g)
    y = torch.randint(0, cfg["num_classes"], (batch,), generator=g)
    with torch.no_grad():
        check_close("logits (eval)", ours.eval()(x, "image", "cls"), ref.eval()(x), 1e-4)
    return compare_training(
        "vit",
        "timm",
        ours,
        ref,
        lambda m: F.cross_entropy(m(x, "image", "cls"), y),
        lambda m: F.cross_entropy(m(x), y),
        lambda m: m.blocks,
        batch,
        "images/s",
        s,
    )


# ---------------------------------------------------------------------------------------- (b) GPT-2
def gpt2_to_mmformer(sd: dict[str, torch.Tensor], n_layers: int) -> dict[str, torch.Tensor]:
    """HF ``GPT2LMHeadModel`` names → mmformer; GPT-2's ``Conv1D`` stores ``(in, out)``: transposed."""
    out = {
        "tokenizers.text.embed.weight": sd["transformer.wte.weight"],
        "tokenizers.text.pos_embed.weight": sd["transformer.wpe.weight"],
        "backbone.norm.weight": sd["transformer.ln_f.weight"],
        "backbone.norm.bias": sd["transformer.ln_f.bias"],
        "heads.lm.head.weight": sd["transformer.wte.weight"],
    }
    names = {
        "ln_1": ("norm1", False),
        "ln_2": ("norm2", False),
        "attn.c_attn": ("attn.qkv", True),
        "attn.c_proj": ("attn.proj", True),
        "mlp.c_fc": ("mlp.fc1", True),
        "mlp.c_proj": ("mlp.fc2", True),
    }
    for i in range(n_layers):
        for hf, (mm, conv1d) in names.items():
            w = sd[f"transformer.h.{i}.{hf}.weight"]
            out[f"backbone.blocks.{i}.{mm}.weight"] = w.t() if conv1d else w
            out[f"backbone.blocks.{i}.{mm}.bias"] = sd[f"transformer.h.{i}.{hf}.bias"]
    return out


def bench_gpt2(s: Settings) -> list[Result]:
    from transformers import GPT2Config, GPT2LMHeadModel

    from mmformer.models import AttentionConfig, MlpConfig, MultimodalModel, build_backbone
    from mmformer.models.heads import LMHead
    from mmformer.tokenizers import TextEmbedding

    if s.quick:
        d, layers, heads, vocab, ctx, batch, seq = 64, 2, 4, 1000, 128, 2, 32
    else:
        d, layers, heads, vocab, ctx, batch, seq = 768, 12, 12, 50257, 1024, 1, 256
    print(
        f"\n[gpt2] GPT-2 training step: d_model {d}, {layers} layers, {heads} heads, vocab {vocab}, "
        f"batch {batch} × {seq} tokens, vs transformers GPT2LMHeadModel (sdpa)",
        flush=True,
    )
    torch.manual_seed(0)
    # GPT-2's GELU is the tanh approximation: transformers' "gelu_pytorch_tanh" is torch's fused kernel
    # (its default "gelu_new" is the same formula written in Python ops, slower), mmformer's "gelu_tanh"
    config = GPT2Config(
        vocab_size=vocab,
        n_positions=ctx,
        n_embd=d,
        n_layer=layers,
        n_head=heads,
        activation_function="gelu_pytorch_tanh",
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        layer_norm_epsilon=1e-5,
        tie_word_embeddings=True,
        bos_token_id=vocab - 1,
        eos_token_id=vocab - 1,
        attn_implementation="sdpa",
    )
    ref = GPT2LMHeadModel(config)
    assert ref.config._attn_implementation == "sdpa"
    emb = TextEmbedding(vocab, d, max_len=ctx)
    head = LMHead(d, vocab)
    head.tie_to(emb.embed)
    ours = MultimodalModel(
        {"text": emb},
        build_backbone(
            d, layers, AttentionConfig(heads), mlp=MlpConfig(act="gelu_tanh"), norm_eps=1e-5, causal=True
        ),
        {"lm": head},
    )
    missing, unexpected = ours.load_state_dict(gpt2_to_mmformer(ref.state_dict(), layers), strict=True)
    assert not missing and not unexpected
    ids = torch.randint(0, vocab, (batch, seq), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        check_close("logits (eval)", ours.eval()(ids, "text", "lm"), ref.eval()(ids).logits, 1e-4)
    return compare_training(
        "gpt2",
        "HF",
        ours,
        ref,
        lambda m: mm_lm_loss(m, ids),
        lambda m: lm_loss(m(ids, use_cache=False).logits, ids),  # training: no KV cache
        lambda m: m.transformer.h,
        batch * seq,
        "tokens/s",
        s,
    )


# ---------------------------------------------------------------------------------------- (c) Llama
_SMOLLM2: dict = {}


def smollm2():
    """The real SmolLM2-135M-Instruct (GGUF) loaded by mmformer and, independently, by transformers
    (as ``tests/models/test_pretrained_llama.py``); loaded once per process."""
    if not _SMOLLM2:
        import transformers

        from mmformer.models.pretrained import load_pretrained, resolve_pretrained

        t = time.perf_counter()
        path = resolve_pretrained("smollm2-135m-instruct")
        p = load_pretrained("smollm2-135m-instruct")
        ref = transformers.LlamaForCausalLM.from_pretrained(
            path.parent, gguf_file=path.name, dtype=torch.float32, attn_implementation="sdpa"
        )
        print(f"  loaded SmolLM2-135M-Instruct into both in {time.perf_counter() - t:.0f} s", flush=True)
        _SMOLLM2.update(ours=p.model, tokenizer=p.tokenizer, config=p.config, ref=ref)
    return _SMOLLM2


def tiny_llama():
    """A random 2-layer Llama (GQA, tied) in transformers, copied into mmformer (``--quick``)."""
    import transformers

    from mmformer.models.pretrained.llama import build_llama, hf_to_mmformer

    config = dict(
        vocab_size=512,
        hidden_size=64,
        intermediate_size=160,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        rope_theta=100_000.0,
        rms_norm_eps=1e-5,
        tie_word_embeddings=True,
    )
    torch.manual_seed(0)
    ref = transformers.LlamaForCausalLM(transformers.LlamaConfig(**config, attn_implementation="sdpa"))
    assert ref.config._attn_implementation == "sdpa"
    ours = build_llama(config)
    missing, unexpected = ours.load_state_dict(hf_to_mmformer(ref.state_dict(), config), strict=False)
    assert not missing and not unexpected, (missing, unexpected)
    return ours, ref, config


def bench_llama(s: Settings) -> list[Result]:
    if s.quick:
        ours, ref, config = tiny_llama()
        batch, seq, what = 2, 32, "tiny random Llama"
    else:
        m = smollm2()
        ours, ref, config = m["ours"], m["ref"], m["config"]
        batch, seq, what = 1, 256, "SmolLM2-135M (real weights)"
    print(
        f"\n[llama] Llama training step: {what}, d_model {config['hidden_size']}, "
        f"{config['num_hidden_layers']} layers, {config['num_attention_heads']}/"
        f"{config['num_key_value_heads']} heads, batch {batch} × {seq} tokens, vs transformers "
        f"LlamaForCausalLM (sdpa)",
        flush=True,
    )
    vocab = config["vocab_size"]
    ids = torch.randint(0, vocab, (batch, seq), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        check_close("logits (eval)", ours.eval()(ids, "text", "lm"), ref.eval()(ids).logits, 1e-4)
    # train copies: the generation benchmark reads the loaded weights afterwards
    import copy

    ours, ref = copy.deepcopy(ours), copy.deepcopy(ref)
    return compare_training(
        "llama",
        "HF",
        ours,
        ref,
        lambda m: mm_lm_loss(m, ids),
        lambda m: lm_loss(m(ids, use_cache=False).logits, ids),  # training: no KV cache
        lambda m: m.model.layers,
        batch * seq,
        "tokens/s",
        s,
    )


# ---------------------------------------------------------------------------------------- (d) generation
PROMPTS = [
    "In the beginning God created the heaven and the earth. And the earth was without form, and void",
    "The capital of France is",
    "<|im_start|>user\nWrite a short poem about the sea.<|im_end|>\n<|im_start|>assistant\n",
    "def fibonacci(n):\n    ",
]


def config_with(cfg, **changes):
    """A copy of the generation config ``cfg`` with ``changes``."""
    out = cfg.__class__.from_dict(cfg.to_dict())
    out.update(**changes)
    return out


def static_compiled(cfg):
    """A copy of the generation config ``cfg`` on transformers' documented fast decoding path: a static KV
    cache and the automatic ``torch.compile`` of the forward that comes with it (``cache_implementation=
    "static"`` + ``CompileConfig``; on the CPU transformers compiles only when asked, ``_compile_all_devices``,
    which ``to_dict`` drops: build it from the plain config, not from a copy of a static one)."""
    from transformers import CompileConfig

    compile_config = CompileConfig()
    compile_config._compile_all_devices = True
    return config_with(cfg, cache_implementation="static", compile_config=compile_config)


def bench_generate(s: Settings) -> list[Result]:
    from mmformer.models.generate import generate

    m = smollm2()
    ours, ref, tok = m["ours"].eval(), m["ref"].eval(), m["tokenizer"]
    new = 8 if s.quick else s.new_tokens
    # exactly `new` tokens on both sides, whatever they are: no stop at eos. transformers fills a None
    # eos_token_id from the model's own generation config, so it is cleared there too.
    ref.generation_config.eos_token_id = None
    gen_cfg = config_with(
        ref.generation_config, do_sample=False, max_new_tokens=new, min_new_tokens=0, eos_token_id=None
    )
    gen_cfg.pad_token_id = m["config"]["eos_token_id"]  # transformers pads with eos; masked anyway
    results = []
    for batch in (1, 4):
        seqs = [tok.encode(p) for p in PROMPTS[:batch]]
        ids, valid = tok.pad_batch(seqs, side="left")  # mmformer pads with its own <|pad|> id
        hf_ids = ids.masked_fill(~valid, gen_cfg.pad_token_id)
        print(
            f"\n[generate] greedy KV-cache decoding, SmolLM2-135M-Instruct, batch {batch} (prompts of "
            f"{[len(q) for q in seqs]} tokens, left-padded), {new} new tokens"
            f"{f' (mmformer compiled, {s.compile_decoding})' if s.compile_decoding else ''}, vs "
            f"LlamaForCausalLM.generate(do_sample=False)",
            flush=True,
        )

        def mm_call(ids=ids, valid=valid, new=new):
            return generate(ours, "text", "lm", ids, valid, new, compile=s.compile_decoding)

        def peer_call(hf_ids=hf_ids, valid=valid, cfg=gen_cfg):
            with torch.no_grad():
                return ref.generate(input_ids=hf_ids, attention_mask=valid.long(), generation_config=cfg)

        variants = [("HF", lambda cfg: cfg)]  # label, the config of the peer's calls from the plain one
        compile_s = [0.0, 0.0]
        if s.compile_decoding:
            t = time.perf_counter()
            mm_call()
            compile_s[0] = time.perf_counter() - t
            print(f"  compiled mmformer's decoding step in {compile_s[0]:.0f} s (untimed)", flush=True)
        if s.compile_decoding and s.peer_compile:
            t = time.perf_counter()
            peer_call(hf_ids, valid, static_compiled(gen_cfg))
            compile_s[1] = time.perf_counter() - t
            print(
                f"  compiled transformers' static-cache forward in {compile_s[1]:.0f} s (untimed)", flush=True
            )
            variants.append(("HF static+compile", static_compiled))
        one_cfg = config_with(gen_cfg, max_new_tokens=1)
        peers = [(label, partial(peer_call, hf_ids, valid, make(gen_cfg))) for label, make in variants]
        first = [(label, partial(peer_call, hf_ids, valid, make(one_cfg))) for label, make in variants]
        got = mm_call()
        for label, call in peers:
            want = call()[:, ids.shape[1] :].tolist()
            assert [len(g) for g in got] == [len(w) for w in want] == [new] * batch, f"{label} stopped early"
            same = sum(a == b for a, b in zip(got, want))
            agree = [
                next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
                for a, b in zip(got, want)
            ]
            print(
                f"  check greedy ids vs {label}: {same}/{batch} rows identical (first difference at {agree})",
                flush=True,
            )
            if same != batch:
                raise AssertionError(
                    f"greedy ids differ from {label}'s: rows agree for {agree} tokens of {new}"
                )
        mode = "compiled" if s.compile_decoding else "eager"
        rs, _ = paired_multi(
            f"generate b{batch}",
            mm_call,
            peers,
            batch * new,
            "new tokens/s",
            s,
            mode=mode,
            compile_s=tuple(compile_s),
        )
        results += rs
        # time to first token: the prompt's forward and its one sampled token (calls for a single new token)
        print(f"  time to first token, batch {batch}:", flush=True)
        rs, _ = paired_multi(
            f"first token b{batch}",
            partial(mm_call, ids, valid, 1),
            first,
            batch,
            "first tokens/s",
            s,
            mode=mode,
        )
        results += rs
    return results


# ---------------------------------------------------------------------------------------- (e) DiT
# The reference model: facebookresearch/DiT models.py (Peebles & Xie 2023), as written there.
def dit_modulate(x, shift, scale):
    return x * (1 + scale.unsqueeze(1)) + shift.unsqueeze(1)


class RefTimestepEmbedder(nn.Module):
    def __init__(self, hidden_size, frequency_embedding_size=256):
        super().__init__()
        self.mlp = nn.Sequential(
            nn.Linear(frequency_embedding_size, hidden_size, bias=True),
            nn.SiLU(),
            nn.Linear(hidden_size, hidden_size, bias=True),
        )
        self.frequency_embedding_size = frequency_embedding_size

    @staticmethod
    def timestep_embedding(t, dim, max_period=10000):
        half = dim // 2
        freqs = torch.exp(
            -math.log(max_period) * torch.arange(start=0, end=half, dtype=torch.float32) / half
        ).to(device=t.device)
        args = t[:, None].float() * freqs[None]
        embedding = torch.cat([torch.cos(args), torch.sin(args)], dim=-1)
        if dim % 2:
            embedding = torch.cat([embedding, torch.zeros_like(embedding[:, :1])], dim=-1)
        return embedding

    def forward(self, t):
        return self.mlp(self.timestep_embedding(t, self.frequency_embedding_size))


class RefLabelEmbedder(nn.Module):
    def __init__(self, num_classes, hidden_size, dropout_prob):
        super().__init__()
        use_cfg_embedding = dropout_prob > 0
        self.embedding_table = nn.Embedding(num_classes + use_cfg_embedding, hidden_size)
        self.num_classes = num_classes
        self.dropout_prob = dropout_prob

    def token_drop(self, labels, force_drop_ids=None):
        if force_drop_ids is None:
            drop_ids = torch.rand(labels.shape[0], device=labels.device) < self.dropout_prob
        else:
            drop_ids = force_drop_ids == 1
        return torch.where(drop_ids, self.num_classes, labels)

    def forward(self, labels, train, force_drop_ids=None):
        use_dropout = self.dropout_prob > 0
        if (train and use_dropout) or (force_drop_ids is not None):
            labels = self.token_drop(labels, force_drop_ids)
        return self.embedding_table(labels)


class RefDiTBlock(nn.Module):
    def __init__(self, hidden_size, num_heads, mlp_ratio=4.0, **block_kwargs):
        from timm.models.vision_transformer import Attention, Mlp

        super().__init__()
        self.norm1 = nn.LayerNorm(hidden_size, elementwise_affine=False, eps=1e-6)
        self.attn = Attention(hidden_size, num_heads=num_heads, qkv_bias=True, **block_kwargs)
        self.norm2 = nn.LayerNorm(hidden_size, elementwise_affine=False, eps=1e-6)
        mlp_hidden_dim = int(hidden_size * mlp_ratio)
        approx_gelu = lambda: nn.GELU(approximate="tanh")  # noqa: E731
        self.mlp = Mlp(in_features=hidden_size, hidden_features=mlp_hidden_dim, act_layer=approx_gelu, drop=0)
        self.adaLN_modulation = nn.Sequential(nn.SiLU(), nn.Linear(hidden_size, 6 * hidden_size, bias=True))

    def forward(self, x, c):
        shift_msa, scale_msa, gate_msa, shift_mlp, scale_mlp, gate_mlp = self.adaLN_modulation(c).chunk(
            6, dim=1
        )
        x = x + gate_msa.unsqueeze(1) * self.attn(dit_modulate(self.norm1(x), shift_msa, scale_msa))
        x = x + gate_mlp.unsqueeze(1) * self.mlp(dit_modulate(self.norm2(x), shift_mlp, scale_mlp))
        return x


class RefFinalLayer(nn.Module):
    def __init__(self, hidden_size, patch_size, out_channels):
        super().__init__()
        self.norm_final = nn.LayerNorm(hidden_size, elementwise_affine=False, eps=1e-6)
        self.linear = nn.Linear(hidden_size, patch_size * patch_size * out_channels, bias=True)
        self.adaLN_modulation = nn.Sequential(nn.SiLU(), nn.Linear(hidden_size, 2 * hidden_size, bias=True))

    def forward(self, x, c):
        shift, scale = self.adaLN_modulation(c).chunk(2, dim=1)
        x = dit_modulate(self.norm_final(x), shift, scale)
        return self.linear(x)


def get_2d_sincos_pos_embed(embed_dim, grid_size):
    grid_h = np.arange(grid_size, dtype=np.float32)
    grid_w = np.arange(grid_size, dtype=np.float32)
    grid = np.meshgrid(grid_w, grid_h)
    grid = np.stack(grid, axis=0).reshape([2, 1, grid_size, grid_size])
    emb_h = get_1d_sincos_pos_embed_from_grid(embed_dim // 2, grid[0])
    emb_w = get_1d_sincos_pos_embed_from_grid(embed_dim // 2, grid[1])
    return np.concatenate([emb_h, emb_w], axis=1)


def get_1d_sincos_pos_embed_from_grid(embed_dim, pos):
    omega = np.arange(embed_dim // 2, dtype=np.float64)
    omega /= embed_dim / 2.0
    omega = 1.0 / 10000**omega
    out = np.einsum("m,d->md", pos.reshape(-1), omega)
    return np.concatenate([np.sin(out), np.cos(out)], axis=1)


class RefDiT(nn.Module):
    def __init__(
        self,
        input_size=32,
        patch_size=2,
        in_channels=4,
        hidden_size=1152,
        depth=28,
        num_heads=16,
        mlp_ratio=4.0,
        class_dropout_prob=0.1,
        num_classes=1000,
        learn_sigma=True,
    ):
        from timm.models.vision_transformer import PatchEmbed

        super().__init__()
        self.learn_sigma = learn_sigma
        self.in_channels = in_channels
        self.out_channels = in_channels * 2 if learn_sigma else in_channels
        self.patch_size = patch_size
        self.num_heads = num_heads
        self.x_embedder = PatchEmbed(input_size, patch_size, in_channels, hidden_size, bias=True)
        self.t_embedder = RefTimestepEmbedder(hidden_size)
        self.y_embedder = RefLabelEmbedder(num_classes, hidden_size, class_dropout_prob)
        num_patches = self.x_embedder.num_patches
        self.pos_embed = nn.Parameter(torch.zeros(1, num_patches, hidden_size), requires_grad=False)
        self.blocks = nn.ModuleList(
            [RefDiTBlock(hidden_size, num_heads, mlp_ratio=mlp_ratio) for _ in range(depth)]
        )
        self.final_layer = RefFinalLayer(hidden_size, patch_size, self.out_channels)
        pos_embed = get_2d_sincos_pos_embed(self.pos_embed.shape[-1], int(self.x_embedder.num_patches**0.5))
        self.pos_embed.data.copy_(torch.from_numpy(pos_embed).float().unsqueeze(0))

    def unpatchify(self, x):
        c = self.out_channels
        p = self.x_embedder.patch_size[0]
        h = w = int(x.shape[1] ** 0.5)
        assert h * w == x.shape[1]
        x = x.reshape(shape=(x.shape[0], h, w, p, p, c))
        x = torch.einsum("nhwpqc->nchpwq", x)
        return x.reshape(shape=(x.shape[0], c, h * p, h * p))

    def forward(self, x, t, y):
        x = self.x_embedder(x) + self.pos_embed
        t = self.t_embedder(t)
        y = self.y_embedder(y, self.training)
        c = t + y
        for block in self.blocks:
            x = block(x, c)
        x = self.final_layer(x, c)
        return self.unpatchify(x)


def dit_to_mmformer(sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    out = {}
    for k, v in sd.items():
        if k == "pos_embed":
            continue  # a fixed buffer in mmformer (the same sin-cos values; checked below)
        if k.startswith(("x_embedder.", "t_embedder.", "y_embedder.")):
            out[f"tokenizers.x.{k}"] = v
        elif k.startswith("blocks."):
            out[f"backbone.{k}"] = v
        else:
            out[f"heads.eps.{k.removeprefix('final_layer.')}"] = v
    return out


def bench_dit(s: Settings) -> list[Result]:
    from mmformer.models import AttentionConfig, BlockConfig, MlpConfig, MultimodalModel, build_backbone
    from mmformer.models.heads import DiTFinalLayer
    from mmformer.tokenizers.diffusion import DiTTokenizer

    if s.quick:
        size, p, d, depth, heads, classes, batch = 8, 2, 64, 2, 4, 10, 4
    else:
        size, p, d, depth, heads, classes, batch = 32, 2, 384, 12, 6, 1000, 4
    c_in = 4
    print(
        f"\n[dit] DiT-S/2-style training step: latent {size}×{size}×{c_in}, patch {p}, d_model {d}, "
        f"{depth} layers, {heads} heads, {classes} classes, learned sigma, batch {batch}, vs the DiT "
        f"reference (timm blocks)",
        flush=True,
    )
    torch.manual_seed(0)
    ref = RefDiT(size, p, c_in, d, depth, heads, 4.0, 0.1, classes, learn_sigma=True)
    with torch.no_grad():  # random everywhere (adaLN-Zero would make every block the identity)
        for n, w in ref.named_parameters():
            if n != "pos_embed":
                w.normal_(0, 0.02)
    tok = DiTTokenizer(d, size, p, c_in, num_classes=classes, class_dropout=0.1)
    backbone = build_backbone(
        d,
        depth,
        AttentionConfig(heads),
        mlp=MlpConfig(act="gelu_tanh"),
        block=BlockConfig("adaln"),
        final_norm=False,
    )
    ours = MultimodalModel({"x": tok}, backbone, {"eps": DiTFinalLayer(d, p, tok.grid_size, 2 * c_in)})
    missing, unexpected = ours.load_state_dict(dit_to_mmformer(ref.state_dict()), strict=True)
    assert not missing and not unexpected
    check_close("sin-cos positions", tok.pos_embed, ref.pos_embed, 1e-6)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(batch, c_in, size, size, generator=g)
    t = torch.randint(0, 1000, (batch,), generator=g)
    y = torch.randint(0, classes, (batch,), generator=g)
    target = torch.randn(batch, 2 * c_in, size, size, generator=g)
    with torch.no_grad():
        check_close("output (eval)", ours.eval()(x, "x", "eps", t=t, labels=y), ref.eval()(x, t, y), 1e-4)
    # the first step's loss is not compared: label dropout draws differently on the two sides
    return compare_training(
        "dit",
        "DiT ref",
        ours,
        ref,
        lambda m: F.mse_loss(m(x, "x", "eps", t=t, labels=y), target),
        lambda m: F.mse_loss(m(x, t, y), target),
        lambda m: m.blocks,
        batch,
        "samples/s",
        s,
        check_loss=False,
    )


# ---------------------------------------------------------------------------------------- main
def summary_table(title: str, results: list[Result]) -> None:
    if not results:
        return
    print(f"\n{title}")
    print(
        f"{'benchmark':14} | {'AdamW':8} | {'mmformer':>10} | {'peer':>10} | {'peer / mm':>9} | {'IQR':>13} | "
        "throughput mm / peer"
    )
    for r in results:
        mm = "mmformer+c" if r.mode == "compiled" else "mmformer"
        print(
            f"{r.name:14} | {r.optimizer:8} | {r.mm_s * 1e3:8.1f}ms | {r.peer_s * 1e3:8.1f}ms | {r.ratio:9.3f} | "
            f"{r.q1:.3f}–{r.q3:.3f} | {r.units / r.mm_s:.1f} / {r.units / r.peer_s:.1f} {r.unit} ({mm} vs {r.peer})"
        )


def _linears(choice: str) -> str:
    """``--linears auto`` → what ``mmformer train`` picks by default here (``trainer.onednn_linears: null``),
    at the thread count already set."""
    if choice != "auto":
        return choice
    from mmformer.nn.onednn import faster_here

    picked = "onednn" if faster_here() else "aten"
    print(f"--linears auto: {picked} (nn.onednn.faster_here() at {torch.get_num_threads()} thread(s))")
    return picked


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="tiny sizes, few pairs: checks the script works")
    p.add_argument("--only", default=",".join(BENCHMARKS), help=f"comma-separated subset of {BENCHMARKS}")
    p.add_argument("--pairs", type=int, default=None, help="timed pairs (default 12; 3 with --quick)")
    p.add_argument("--warmup", type=int, default=None, help="untimed pairs first (default 2; 1 with --quick)")
    p.add_argument(
        "--optimizer",
        choices=OPTIMIZERS,
        default="same",
        help="AdamW kernel of the training steps. same (default): each training benchmark twice, the same "
        "kernel on both sides — fused, then loop (the per-tensor for-loop, foreach=False, torch's CPU "
        "default). fused / loop / foreach / default (torch's choice): that one kernel on both sides. "
        "platform (secondary): each platform's out-of-the-box kernel — mmformer fused, the peer torch's "
        "default loop",
    )
    p.add_argument(
        "--compile",
        action="store_true",
        help="training: compile mmformer's blocks as trainer.compile: true does (regional per-block "
        "torch.compile) and time it against the eager peer and against the peer with its blocks compiled "
        "the same way; compile time is printed separately",
    )
    p.add_argument(
        "--linears",
        choices=("auto", "onednn", "aten", "both"),
        default="auto",
        help="training: mmformer's CPU linears as mmformer train chooses them by default (auto: on oneDNN "
        "where nn.onednn.faster_here() measures it faster on this CPU, else PyTorch's), on oneDNN, or on "
        "PyTorch's own (aten); both: oneDNN, plus a copy on PyTorch's as one more column (the gain from "
        "the linears alone, in the same rounds)",
    )
    p.add_argument(
        "--block",
        type=int,
        default=1,
        help="calls of one side in a row per round (default 1: strictly alternating); > 1 times the median "
        "of all but the first, so the cost of switching models (caches, the other library's buffers) is "
        "nobody's",
    )
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--new-tokens", type=int, default=64, help="generate: new tokens per call (default 64)")
    p.add_argument(
        "--compile-decoding",
        nargs="?",
        const="cached",
        default=False,
        choices=["cached", "frozen"],
        help="generate: mmformer decodes with a compiled graph (generate(compile=MODE), default cached; "
        "compiled before timing)",
    )
    p.add_argument(
        "--peer-compile",
        action="store_true",
        help="generate, with --compile-decoding: time transformers' documented fast path too (static KV "
        "cache + its automatic torch.compile), compiled before timing",
    )
    a = p.parse_args()
    if a.peer_compile and not a.compile_decoding:
        p.error("--peer-compile times transformers' compiled path beside mmformer's: add --compile-decoding")
    only = [b.strip() for b in a.only.split(",") if b.strip()]
    unknown = set(only) - set(BENCHMARKS)
    if unknown:
        p.error(f"unknown benchmarks {sorted(unknown)}; choose from {BENCHMARKS}")
    torch.set_num_threads(a.threads)
    s = Settings(
        quick=a.quick,
        pairs=a.pairs or (3 if a.quick else 12),
        warmup=a.warmup if a.warmup is not None else (1 if a.quick else 2),
        optimizer=a.optimizer,
        new_tokens=a.new_tokens,
        compile_decoding=a.compile_decoding,
        peer_compile=a.peer_compile,
        compile=a.compile,
        linears=_linears(a.linears),
        block=a.block,
    )
    optimizers = ("fused", "loop") if s.optimizer == "same" else (s.optimizer,)
    print(
        f"torch {torch.__version__}, {torch.get_num_threads()} threads, fp32, AdamW "
        f"{' then '.join(optimizers)}{' (same kernel on both sides)' if s.optimizer != 'platform' else ''}"
        f"{', mmformer blocks compiled' if s.compile else ''}, mmformer linears {s.linears}, "
        f"{s.pairs} pairs after {s.warmup} warm-up{f', {s.block} calls per side per round' if s.block > 1 else ''}",
        flush=True,
    )
    start = time.perf_counter()
    results: list[Result] = []
    fns = {
        "vit": bench_vit,
        "gpt2": bench_gpt2,
        "llama": bench_llama,
        "generate": bench_generate,
        "dit": bench_dit,
    }
    for name in BENCHMARKS:
        if name not in only:
            continue
        for opt in optimizers if name != "generate" else ("-",):  # decoding has no optimizer: once
            torch.manual_seed(0)
            results += fns[name](replace(s, optimizer=opt) if opt != "-" else s)
            gc.collect()
    print(f"\nsummary ({time.perf_counter() - start:.0f} s); peer / mm > 1: mmformer faster")
    train = [r for r in results if r.optimizer != "-"]
    summary_table(
        "same optimizer (headline): the same AdamW kernel on both sides, eager",
        [r for r in train if r.optimizer != "platform" and r.mode == "eager"],
    )
    compiled = [r for r in train if r.mode == "compiled"]
    summary_table(
        "compiled: mmformer's blocks torch.compiled (regional, as trainer.compile: true) vs the peer eager "
        "and vs the peer's blocks compiled the same way",
        compiled,
    )
    for r in compiled:
        if r.peer.endswith("+compile"):
            print(
                f"  {r.name} [{r.optimizer}] compile time (untimed, one-off): mmformer {r.compile_s[0]:.1f} s, "
                f"{r.peer} {r.compile_s[1]:.1f} s"
            )
    summary_table(
        "platform defaults (secondary): mmformer's fused AdamW vs the peer's torch default (per-tensor loop) — "
        "a peer user can switch on fused=True too",
        [r for r in train if r.optimizer == "platform"],
    )
    summary_table("generation (no optimizer)", [r for r in results if r.optimizer == "-"])


if __name__ == "__main__":
    main()
