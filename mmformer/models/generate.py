"""Autoregressive text generation with the KV cache: greedy, temperature, top-k and top-p (nucleus,
Holtzman et al. 2020, arXiv:1904.09751) sampling, stopping at ``eos``; batched prompts of different
lengths are left-padded so every row's next token is at the end.

Shape legend: B batch, N tokens, V vocabulary.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from ..nn.attention import Attention
from ..nn.kernels import kernel_rules
from ..nn.kv_cache import KVCache
from ..nn.onednn import faster_here, onednn_routed
from ..nn.packed import packed_linears
from ..progress import progress
from .compiled_decoding import compiled_step
from .model import MultimodalModel
from .prompt_lookup import prompt_lookup_greedy


def sample_next(
    logits: Tensor,
    temperature: float = 0.0,
    top_k: int | None = None,
    top_p: float | None = None,
    generator: torch.Generator | None = None,
) -> Tensor:
    """``logits (B, V)`` → next ids ``(B,)``: argmax when ``temperature == 0``, else a sample from the
    tempered distribution restricted to the ``top_k`` most likely ids and the smallest set whose
    probability reaches ``top_p``."""
    if top_k is not None and top_k < 1:
        raise ValueError(f"top_k must be >= 1, got {top_k}")
    if top_p is not None and not 0.0 < top_p <= 1.0:
        raise ValueError(f"top_p must be in (0, 1], got {top_p}")
    if temperature <= 0.0:
        return logits.argmax(dim=-1)
    logits = logits.float() / temperature
    if top_k is not None and top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p is not None and top_p < 1.0:
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        cum = sorted_logits.softmax(-1).cumsum(-1)
        drop = cum - sorted_logits.softmax(-1) >= top_p  # keep the first token that crosses top_p
        logits = logits.masked_fill(drop.scatter(-1, order, drop), float("-inf"))
    return torch.multinomial(logits.softmax(-1), 1, generator=generator).squeeze(-1)


@torch.no_grad()
def generate(
    model: MultimodalModel,
    tokenizer: str,
    head: str,
    ids: Tensor,
    valid: Tensor,
    max_new_tokens: int,
    eos_id: int | None = None,
    temperature: float = 0.0,
    top_k: int | None = None,
    top_p: float | None = None,
    generator: torch.Generator | None = None,
    compile: bool | str = False,
    bar: bool = False,
    prompt_lookup_num_tokens: int | None = None,
    max_matching_ngram_size: int = 4,
    min_matching_ngram_size: int = 2,
    stats: dict | None = None,
) -> list[list[int]]:
    """Continue left-padded prompts ``ids, valid (B, N)``; returns each row's new ids (without the prompt,
    up to and excluding ``eos``). The prompt is prefilled in one forward, then one token per step; a row
    that samples ``eos`` leaves the batch (``KVCache.reorder``), so later steps compute only the rows still
    decoding (a compiled step keeps every row: its graph is built for the batch size). With sampling, a
    ``generator`` draws for the rows still decoding, so a row's samples depend on when the others ended
    (the same seed, batch and mode give the same text; eager and compiled steps may differ).

    ``compile``: run the blocks of the steps after the prompt as one compiled graph
    (``compiled_decoding``: the same greedy ids up to fused kernels' rounding, faster per token once
    compiled). ``True`` or ``"cached"``: the first call of a process compiles for about a minute, or
    loads the graph from inductor's on-disk cache in seconds; ``"frozen"``: weights as prepacked
    constants, fastest for several rows, compiled in every process. Another value raises ``ValueError``.

    With learned absolute positions (``max_len``) the continuation stops at the end of the context.
    ``bar``: a progress bar over the new tokens (``mmformer.progress``: only on a terminal).

    ``prompt_lookup_num_tokens``: greedy decoding with prompt-lookup drafts of up to this many ids
    (``prompt_lookup``: the same ids as greedy decoding up to the rounding of a forward over several
    positions, in fewer forward passes where the output repeats the prompt or itself; transformers'
    argument of the same name, for any batch size), copied after matches of ``min_matching_ngram_size``
    to ``max_matching_ngram_size`` ids (transformers': 1 to 2; ``1, 2`` drafts as it does). ``stats``,
    when given, receives ``forwards`` (passes after the prompt) and, with prompt lookup, ``drafted`` and
    ``accepted`` draft ids.
    Raises ``ValueError`` for an empty prompt or a prompt that already fills the context, and for prompt
    lookup with sampling (``temperature > 0``) or a draft length below 1.
    """
    if prompt_lookup_num_tokens is not None:
        if temperature > 0:
            raise ValueError("prompt_lookup_num_tokens decodes greedily: set temperature=0")
        if prompt_lookup_num_tokens < 1 or not 1 <= min_matching_ngram_size <= max_matching_ngram_size:
            raise ValueError(
                "need prompt_lookup_num_tokens >= 1 and 1 <= min_matching_ngram_size <= "
                f"max_matching_ngram_size, got {prompt_lookup_num_tokens}, {min_matching_ngram_size}, "
                f"{max_matching_ngram_size}"
            )
    lengths = valid.sum(dim=1)
    if ids.shape[1] == 0 or bool((lengths == 0).any()):
        raise ValueError("every prompt needs at least one token")
    max_len = context_length(model, tokenizer)
    if max_len is not None:
        room = max_len - int(lengths.max())
        if room <= 0:
            raise ValueError(
                f"a prompt of {int(lengths.max())} tokens fills the model's context of {max_len}"
            )
        max_new_tokens = min(max_new_tokens, room)
    without_cache = cacheless_kernels(model.backbone_of(tokenizer))
    if without_cache:
        if compile or prompt_lookup_num_tokens is not None:
            raise ValueError(
                f"compile and prompt_lookup_num_tokens decode from a KV cache, which the "
                f"{', '.join(without_cache)} kernel cannot read: generate without them"
            )
        return _recomputing(model, tokenizer, head, ids, valid, max_new_tokens, eos_id, temperature, top_k,
                            top_p, generator, stats, bar)  # fmt: skip
    model.for_decoding()
    if compile:
        forward = compiled_step(model, tokenizer, "cached" if compile is True else compile)
    else:
        forward = model
    # room for a draft verified at the last step too (its unkept positions are written, then cut): the
    # buffers never grow inside a compiled step, which would recompile it
    cache = KVCache(capacity=ids.shape[1] + max_new_tokens + (prompt_lookup_num_tokens or 0))
    # the prompt's products, many rows: on oneDNN where it is the faster library on this CPU (nn.onednn)
    with onednn_routed([model] if ids.device.type == "cpu" and faster_here() else []):
        hidden, tokens = model.encode(tokenizer, ids, cache=cache, valid=valid)
        logits = model.heads[head](hidden[:, -1:], tokens)[:, -1]  # the prompt's last position only
    if prompt_lookup_num_tokens is not None:
        return _with_prompt_lookup(
            model, forward, tokenizer, head, ids, valid, cache, logits, max_new_tokens, eos_id,
            prompt_lookup_num_tokens, (min_matching_ngram_size, max_matching_ngram_size), compile, stats, bar,
        )  # fmt: skip
    out: list[list[int]] = [[] for _ in range(ids.shape[0])]
    ended = [False] * ids.shape[0]
    rows = list(range(ids.shape[0]))  # the rows the cache holds, in its order
    forwards = 0
    steps = progress(desc="generating", total=max_new_tokens, unit="token", leave=False) if bar else None
    # rows that end leave the batch: the last one's steps take a row-major weight's one-row copy (nn.packed)
    one_row = eos_id is not None and not compile
    with packed_linears(_packed_modules(model, tokenizer, head, ids, compile), ids.shape[0], one_row):
        for step in range(max_new_tokens):
            if steps is not None:
                steps.update(1)
            nxt = sample_next(logits, temperature, top_k, top_p, generator)
            for i, t in zip(rows, nxt.tolist()):
                if ended[i]:
                    continue
                if t == eos_id:
                    ended[i] = True
                else:
                    out[i].append(t)
            going = [j for j, i in enumerate(rows) if not ended[i]]
            if not going or step == max_new_tokens - 1:  # no forward for logits nobody reads
                break
            if len(going) < len(rows) and not compile:  # rows that ended leave (a compiled graph keeps B)
                keep = torch.tensor(going, device=ids.device)
                cache.reorder(keep)
                rows, nxt = [rows[j] for j in going], nxt[keep]
            pos = cache.valid.sum(dim=1, keepdim=True).unsqueeze(-1)  # each row continues from its length
            step_valid = torch.ones_like(nxt[:, None], dtype=torch.bool)
            logits = forward(nxt[:, None], tokenizer, head, cache=cache, valid=step_valid, positions=pos)[
                :, -1
            ]
            forwards += 1
    if steps is not None:
        steps.close()
    if stats is not None:
        stats.update(forwards=forwards)
    return out


def context_length(model, tokenizer: str) -> int | None:
    """The most tokens one sequence of ``tokenizer`` may hold: its learned positions (``max_len``) and the
    position biases of its backbone's kernels (AFT's ``max_len``), the smaller; None when neither
    limits it."""
    limits = [getattr(model.tokenizers[tokenizer], "max_len", None)]
    for m in model.backbone_of(tokenizer).modules():
        if isinstance(m, Attention) and m.kernel_module is not None and m.kernel == m.kernel_module.name:
            limits.append(getattr(m.kernel_module, "max_len", None))
    limits = [n for n in limits if n is not None]
    return min(limits) if limits else None


def cacheless_kernels(backbone: nn.Module) -> list[str]:
    """The attention kernels of ``backbone`` that cannot decode from a KV cache (their mask rules lack
    ``cache``: LSH, AFT, RFA, the Performer), sorted; empty when every layer can."""
    kernels = {m.kernel for m in backbone.modules() if isinstance(m, Attention)}
    return sorted(k for k in kernels if "cache" not in kernel_rules(k))


def _recomputing(
    model, tokenizer, head, ids, valid, max_new_tokens, eos_id, temperature, top_k, top_p, generator, stats,
    bar=False,
) -> list[list[int]]:  # fmt: skip
    """``generate`` for a backbone whose kernel reads no KV cache: each new token runs the whole sequence
    again (what transformers' ``use_cache=False`` does; quadratic in the new tokens, for samples and short
    continuations). The rows are right-padded, so every row's tokens sit at positions 0, 1, … as in
    training (a kernel with absolute position biases, AFT, reads them there), and each row's logits are
    read at its last token. Every row stays in the batch to the last step."""
    rows = [ids[i][valid[i]] for i in range(ids.shape[0])]  # each prompt without its padding
    out: list[list[int]] = [[] for _ in rows]
    ended = [False] * len(rows)
    forwards = 0  # the passes after the prompt's, as generate counts them
    steps = progress(desc="generating", total=max_new_tokens, unit="token", leave=False) if bar else None
    for step in range(max_new_tokens):
        if steps is not None:
            steps.update(1)
        lengths = torch.tensor([len(r) for r in rows], device=ids.device)
        x = torch.zeros(len(rows), int(lengths.max()), dtype=ids.dtype, device=ids.device)
        x_valid = torch.arange(x.shape[1], device=ids.device) < lengths[:, None]
        x[x_valid] = torch.cat(rows)
        hidden, tokens = model.encode(tokenizer, x, valid=x_valid)
        last = hidden[torch.arange(len(rows), device=ids.device), lengths - 1]  # (B, D)
        logits = model.heads[head](last[:, None], tokens)[:, -1]
        forwards += step > 0
        nxt = sample_next(logits, temperature, top_k, top_p, generator)
        for i, t in enumerate(nxt.tolist()):
            if not ended[i] and t == eos_id:
                ended[i] = True
            elif not ended[i]:
                out[i].append(t)
        if all(ended):
            break
        rows = [torch.cat([r, t[None]]) for r, t in zip(rows, nxt)]
    if steps is not None:
        steps.close()
    if stats is not None:
        stats.update(forwards=forwards)
    return out


def _packed_modules(model: MultimodalModel, tokenizer: str, head: str, ids: Tensor, compile) -> list:
    """The modules whose products the steps after the prompt run on packed weights (``nn.packed``):
    eagerly every linear; with the cached compiled blocks the head, which runs after them eagerly, and the
    blocks' own (found at run time by ``nn.packed.packed_linear``) where oneDNN is the faster library on
    this CPU; a frozen graph has its own."""
    if compile == "frozen":
        return []
    if compile and not (ids.device.type == "cpu" and faster_here()):
        return [model.heads[head]]
    return [model.backbone_of(tokenizer), model.heads[head]]


def _with_prompt_lookup(
    model, forward, tokenizer, head, ids, valid, cache, logits, max_new_tokens, eos_id, n_draft, ngrams,
    compile, stats, bar,
) -> list[list[int]]:  # fmt: skip
    """``generate``'s steps after the prompt with prompt-lookup drafts (``prompt_lookup``)."""

    def verify(chunk: Tensor) -> Tensor:
        pos = cache.valid.sum(dim=1, keepdim=True) + torch.arange(chunk.shape[1], device=chunk.device)
        ones = torch.ones_like(chunk, dtype=torch.bool)
        return forward(chunk, tokenizer, head, cache=cache, valid=ones, positions=pos.unsqueeze(-1))

    texts = [row[keep].tolist() for row, keep in zip(ids, valid)]
    steps = progress(desc="generating", total=max_new_tokens, unit="token", leave=False) if bar else None
    # one oneDNN-packed copy serves the one-token steps and the drafted chunks (nn.packed)
    rows = ids.shape[0] * (1 + n_draft)
    try:
        one_row = ids.shape[0] == 1 or (eos_id is not None and not compile)  # rows that end leave the batch
        with packed_linears(_packed_modules(model, tokenizer, head, ids, compile), rows, one_row):
            return prompt_lookup_greedy(
                verify, cache, logits, texts, max_new_tokens, eos_id, n_draft,
                max_ngram=ngrams[1], min_ngram=ngrams[0], stats=stats, bar=steps, drop_ended=not compile,
                fixed_width=bool(compile),
            )  # fmt: skip
    finally:
        if steps is not None:
            steps.close()
