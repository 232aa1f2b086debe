"""Causal LM: targets skip padding and document boundaries; sampling rules; cached generation equals
greedy recomputation; training and `mmformer generate` through the CLI on a tiny real-format corpus."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from mmformer.cli import main
from mmformer.models import AttentionConfig, PositionConfig, build_backbone
from mmformer.models.generate import generate, sample_next
from mmformer.models.heads import LMHead
from mmformer.models.model import MultimodalModel
from mmformer.tasks.language_model import IGNORE, next_token_targets
from mmformer.tokenizers import TextEmbedding


def test_targets_ignore_padding_and_document_boundaries():
    batch = {
        "text": torch.tensor([[5, 6, 7, 8, 9]]),
        "text_valid": torch.tensor([[True, True, True, True, False]]),
        "text_document": torch.tensor([[0, 0, 1, 1, 1]]),
    }
    assert next_token_targets(batch).tolist() == [[6, IGNORE, 8, IGNORE]]


def test_sampling_rules():
    logits = torch.tensor([[0.0, 3.0, 2.0, 1.0]])
    assert sample_next(logits).item() == 1  # greedy
    g = torch.Generator().manual_seed(0)
    draws = {sample_next(logits, 1.0, top_k=2, generator=g).item() for _ in range(200)}
    assert draws == {1, 2}
    # top-p 0.5: the most likely token alone already holds > 50 %
    assert {sample_next(logits, 1.0, top_p=0.5, generator=g).item() for _ in range(50)} == {1}


def _lm(vocab=40, d=32):
    torch.manual_seed(0)
    emb = TextEmbedding(vocab, d)
    head = LMHead(d, vocab)
    head.tie_to(emb.embed)
    model = MultimodalModel(
        {"text": emb},
        build_backbone(d, 2, AttentionConfig(4), positions=PositionConfig("rope"), causal=True),
        {"lm": head},
    )
    return model.eval()


def test_cached_generation_equals_greedy_recomputation():
    model = _lm()
    ids = torch.tensor([[0, 0, 3, 4, 5], [6, 7, 8, 9, 10]])
    valid = torch.tensor([[False, False, True, True, True], [True] * 5])
    out = generate(model, "text", "lm", ids, valid, max_new_tokens=6)
    with torch.no_grad():
        for row in range(2):
            seq = ids[row][valid[row]].tolist()
            for _ in range(6):
                logits = model(torch.tensor([seq]), "text", "lm")[:, -1]
                seq.append(int(logits.argmax()))
            assert out[row] == seq[-6:]


@pytest.mark.parametrize("kernel", ["aft_full", "aft_local", "lsh"])
def test_a_kernel_without_a_kv_cache_generates_by_recomputing_the_sequence(kernel):
    options = {
        "aft_full": {"max_len": 16},
        "aft_local": {"max_len": 16, "window": 3},
        "lsh": {"n_buckets": 2, "chunk_size": 4},
    }[kernel]
    torch.manual_seed(0)
    model = MultimodalModel(
        {"text": TextEmbedding(40, 32)},
        build_backbone(
            32, 2, AttentionConfig(4, kernel=kernel, kernel_options=options), positions=PositionConfig("rope"),
            causal=True,
        ),
        {"lm": LMHead(32, 40)},
    ).eval()  # fmt: skip
    with torch.no_grad():  # AFT's position biases as trained ones are (zero at init: any position fits)
        for name, p in model.named_parameters():
            if name.endswith("pos_bias"):
                p.normal_()
    ids = torch.tensor([[0, 0, 3, 4, 5], [6, 7, 8, 9, 10]])
    valid = ids != 0
    stats = {}
    out = generate(model, "text", "lm", ids, valid, max_new_tokens=6, stats=stats)
    assert stats["forwards"] == 5  # after the prompt's, as the KV-cache path counts them
    with torch.no_grad():  # left padding changes nothing: each row as greedy recomputation alone
        for row in range(2):
            seq = ids[row][valid[row]].tolist()
            for _ in range(6):
                seq.append(int(model(torch.tensor([seq]), "text", "lm")[:, -1].argmax()))
            assert out[row] == seq[-6:]
    eos = out[1][0]  # each row stops before its first eos
    stopped = generate(model, "text", "lm", ids, valid, 6, eos_id=eos)
    assert stopped == [o[: o.index(eos)] if eos in o else o for o in out] and stopped[1] == []
    assert generate(model, "text", "lm", ids, valid, 0, stats=stats) == [[], []] and stats["forwards"] == 0
    if kernel.startswith("aft"):  # its 16 position biases are the context: 5 prompt tokens + 11 new
        assert [len(o) for o in generate(model, "text", "lm", ids, valid, 40)] == [11, 11]
    for refused in ({"compile": True}, {"prompt_lookup_num_tokens": 2}):
        with pytest.raises(ValueError, match=f"the {kernel} kernel cannot read"):
            generate(model, "text", "lm", ids, valid, 4, **refused)


def test_generation_stops_at_eos():
    model = _lm()
    ids, valid = torch.tensor([[3, 4]]), torch.ones(1, 2, dtype=torch.bool)
    first = generate(model, "text", "lm", ids, valid, max_new_tokens=1)[0][0]
    assert generate(model, "text", "lm", ids, valid, max_new_tokens=5, eos_id=first) == [[]]


def test_rows_that_end_leave_the_batch_and_the_others_decode_as_alone():
    torch.manual_seed(0)  # an untied head: continuations that vary (the tied one repeats one id)
    model = MultimodalModel(
        {"text": TextEmbedding(40, 32)},
        build_backbone(32, 2, AttentionConfig(4), positions=PositionConfig("rope"), causal=True),
        {"lm": LMHead(32, 40)},
    ).eval()
    ids = torch.tensor([[0, 0, 3, 4, 5], [6, 7, 8, 9, 10], [0, 11, 12, 13, 14]])
    valid = ids != 0
    free = generate(model, "text", "lm", ids, valid, max_new_tokens=10)
    # an eos that ends the first row early and not the second: the batch goes on without it
    eos = next(t for t in free[0][1:] if t not in free[1])
    rows = []  # the batch size of every forward
    hook = model.register_forward_pre_hook(lambda module, args: rows.append(args[0].shape[0]))
    try:
        out = generate(model, "text", "lm", ids, valid, max_new_tokens=10, eos_id=eos)
    finally:
        hook.remove()
    for row in range(3):
        one = ids[row][valid[row]][None]
        alone = generate(model, "text", "lm", one, torch.ones_like(one, dtype=torch.bool), 10, eos_id=eos)
        assert out[row] == alone[0]
    assert out[0] == free[0][: free[0].index(eos)] and len(out[0]) < 9
    end = [len(r) if len(r) < 10 else 10 for r in out]  # the step that sampled eos (10: none did)
    # after step s's id, a forward for the rows that have not ended (none after the last id)
    assert rows == [sum(s < e for e in end) for s in range(min(max(end), 9))]
    assert rows[0] > rows[-1] >= 1  # rows left during the call, one went on


LM_RECIPE = """\
name: tiny_lm
model:
  tokenizers: {{text: {{kind: bpe, vocab_size: 300, max_len: 32}}}}
  backbone: {{preset: debug, causal: true}}
  heads: {{lm: {{kind: lm}}}}
tasks:
  corpus:
    kind: causal_lm
    tokenizer: text
    head: lm
    data: {{kind: text, root: {root}, seq_len: 32, batch_size: 4, val_fraction: 0.25}}
optim: {{lr: 3e-3, warmup_steps: 2}}
trainer: {{max_steps: 6, val_check_interval: 3, check_val_every_n_epoch: null, accelerator: cpu, devices: 1,
          log_every_n_steps: 1, enable_progress_bar: false, num_sanity_val_steps: 0}}
logger: {{mode: disabled}}
"""


def test_train_and_generate_through_the_cli(workdir, capsys):
    verses = [
        f"Chapter {i}\n1 And the light was good, and the day was {i}.\n2 And it was so." for i in range(40)
    ]
    (workdir / "corpus.txt").write_text("\n\n".join(verses) + "\n")
    recipe = workdir / "lm.yaml"
    recipe.write_text(LM_RECIPE.format(root=workdir / "corpus.txt"))
    assert main(["train", str(recipe), "logger.mode=offline"]) == 0
    out = capsys.readouterr().out
    finals = {ln.split()[0]: float(ln.split()[1]) for ln in out.splitlines() if ln.startswith("val/")}
    assert set(finals) == {"val/corpus/loss", "val/corpus/ppl"}
    assert finals["val/corpus/ppl"] == pytest.approx(
        torch.tensor(finals["val/corpus/loss"]).exp().item(), rel=1e-3
    )
    assert finals["val/corpus/ppl"] < 300  # learned something from a uniform start over 300 ids
    ckpt = next((workdir / "runs" / "tiny_lm").glob("*/checkpoints/last.ckpt"))
    from tests.wandb_records import read_records

    records = read_records(next((workdir / "runs" / "tiny_lm").glob("*/wandb/offline-run-*/*.wandb")))
    keys = {
        "/".join(i.nested_key) or i.key
        for r in records
        if r.WhichOneof("record_type") == "history"
        for i in r.history.item
    }
    assert "samples/corpus/_type" in keys  # a W&B table of generations at each validation
    assert "throughput/tokens_per_sec" in keys and "val/corpus/ppl" in keys
    assert "tokenizers" in torch.load(ckpt, weights_only=True)["mmformer"]
    (workdir / "corpus.txt").unlink()  # the checkpoint stands alone: no corpus needed to generate
    assert main(["generate", str(ckpt), "--prompt", "And the light", "--max-new-tokens", "12"]) == 0
    plain = capsys.readouterr().out
    assert plain.startswith("And the light")
    args = [
        "generate",
        str(ckpt),
        "--prompt",
        "And the light",
        "--max-new-tokens",
        "12",
        "--prompt-lookup",
        "4",
    ]
    assert main(args) == 0
    assert capsys.readouterr().out == plain  # greedy decoding's text, drafts or not


@pytest.mark.parametrize(
    "kernel",
    [
        ["model.backbone.attn_kernel=aft_simple"],
        # position biases for exactly seq_len tokens and no learned positions: the model's FLOPs are
        # counted, its samples drawn and its continuations generated within those 32 tokens
        [
            "model.backbone.attn_kernel=aft_full",
            "model.backbone.kernel_options={max_len: 32}",
            "model.tokenizers.text.max_len=null",
            "model.backbone.positions=rope",
        ],
    ],
    ids=["aft_simple", "aft_full"],
)
def test_a_causal_lm_with_a_kernel_without_a_kv_cache_trains_samples_and_generates(kernel, workdir, capsys):
    (workdir / "corpus.txt").write_text("\n\n".join(f"Chapter {i}\n1 And it was so, {i}." for i in range(30)))
    recipe = workdir / "lm.yaml"
    recipe.write_text(LM_RECIPE.format(root=workdir / "corpus.txt"))
    kernel = [*kernel, "tasks.corpus.data.pack=false", "trainer.max_steps=3"]
    assert main(["train", str(recipe), *kernel, "logger.mode=offline"]) == 0  # samples at the validation
    ckpt = next((workdir / "runs" / "tiny_lm").glob("*/checkpoints/last.ckpt"))
    capsys.readouterr()
    assert main(["generate", str(ckpt), "--prompt", "And it", "--max-new-tokens", "40"]) == 0  # past 32
    assert capsys.readouterr().out.startswith("And it")


def test_generation_respects_the_context_and_refuses_empty_prompts():
    torch.manual_seed(0)
    emb = TextEmbedding(40, 32, max_len=8)
    model = MultimodalModel(
        {"text": emb}, build_backbone(32, 1, AttentionConfig(4), causal=True), {"lm": LMHead(32, 40)}
    ).eval()
    ids, valid = torch.tensor([[3, 4, 5, 6]]), torch.ones(1, 4, dtype=torch.bool)
    assert len(generate(model, "text", "lm", ids, valid, max_new_tokens=50)[0]) == 4  # 4 + 4 = max_len
    with pytest.raises(ValueError, match="fills the model's context of 8"):
        generate(
            model, "text", "lm", torch.ones(1, 8, dtype=torch.long), torch.ones(1, 8, dtype=torch.bool), 3
        )
    with pytest.raises(ValueError, match="at least one token"):
        generate(model, "text", "lm", ids, torch.zeros(1, 4, dtype=torch.bool), 3)
    with pytest.raises(ValueError, match="top_k must be"):
        sample_next(torch.zeros(1, 4), 1.0, top_k=0)


def test_perplexity_is_exp_of_the_token_weighted_loss():
    from mmformer.tasks.language_model import Perplexity

    m = Perplexity()
    m.update(torch.tensor([1.0, 2.0, 3.0]))
    m.update(torch.tensor([4.0]))
    assert m.compute().item() == pytest.approx(torch.tensor(2.5).exp().item())


def test_lm_checkpoint_monitor_direction_and_context_check(workdir):
    from mmformer.build import build_module, default_monitor
    from mmformer.recipe import RecipeError, recipe_from_yaml

    corpus = workdir / "c.txt"
    corpus.write_text("\n\n".join(f"doc {i} and some words" for i in range(8)))
    recipe = recipe_from_yaml(LM_RECIPE.format(root=corpus), ["checkpoint.monitor=val/corpus/ppl"])
    assert default_monitor(recipe, build_module(recipe)) == ("val/corpus/ppl", "min")
    with pytest.raises(RecipeError, match="seq_len' is 64 but tokenizer 'text' has learned positions up to"):
        recipe_from_yaml(LM_RECIPE.format(root=corpus), ["tasks.corpus.data.seq_len=64"])


def test_generate_cli_reports_bad_input_in_one_line(workdir, capsys):
    verses = [f"Chapter {i}\n1 And the light was good, and the day was {i}." for i in range(40)]
    (workdir / "corpus.txt").write_text("\n\n".join(verses) + "\n")
    recipe = workdir / "lm.yaml"
    recipe.write_text(LM_RECIPE.format(root=workdir / "corpus.txt"))
    assert main(["train", str(recipe), "trainer.max_steps=2"]) == 0
    ckpt = str(next((workdir / "runs" / "tiny_lm").glob("*/checkpoints/last.ckpt")))
    capsys.readouterr()
    assert main(["generate", ckpt, "--prompt", ""]) == 2
    assert "every prompt needs at least one token" in capsys.readouterr().err
    assert main(["generate", ckpt, "--prompt", "light " * 40]) == 2
    assert "fills the model's context of 32" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["generate", ckpt, "--prompt", "x", "--top-k", "0"])
    assert "must be >= 1" in capsys.readouterr().err
    assert main(["generate", ckpt, "--prompt", "x", "--prompt-lookup", "4", "--temperature", "0.7"]) == 2
    err = capsys.readouterr().err
    assert "decodes greedily: set temperature=0" in err and len(err.strip().splitlines()) == 1


def _logits_loss(model, batch):
    """The loss as computed from the full logits (the reference the chunked loss must equal)."""
    logits = model(batch["text"], "text", "lm", valid=batch["text_valid"], document=batch["text_document"])
    targets = next_token_targets(batch)
    return torch.nn.functional.cross_entropy(
        logits[:, :-1].flatten(0, 1), targets.flatten(), ignore_index=IGNORE, reduction="none"
    ).view(targets.shape)


@pytest.mark.parametrize("variant", ["tied", "onednn", "lora"])
def test_the_training_loss_never_holds_the_logits_yet_equals_them(variant):
    """An LMHead's loss is chunked (``nn.linear_cross_entropy``): the same loss, gradients (the tied
    embedding's included) and validation perplexity as from the logits; a LoRA head runs the logits."""
    from mmformer.nn.lora import apply_lora
    from mmformer.nn.onednn import use_onednn
    from mmformer.tasks.language_model import CausalLMTask

    model = _lm(vocab=600, d=32).train()
    if variant == "onednn":
        assert use_onednn(model.heads, min_weights=0) == 1
    if variant == "lora":
        assert apply_lora(model, ("head",), rank=2, within="heads") == ["heads.lm.head"]
    model.heads["lm"].chunk_rows = 5  # several chunks, the last one short
    g = torch.Generator().manual_seed(3)
    batch = {
        "text": torch.randint(0, 600, (2, 9), generator=g),
        "text_valid": torch.tensor([[True] * 9, [True] * 6 + [False] * 3]),
        "text_document": torch.tensor([[0] * 4 + [1] * 5, [0] * 9]),
    }
    task = CausalLMTask("text", "lm")
    params = [p for p in model.parameters() if p.requires_grad]
    loss = task.training_loss(model, batch)
    reference = _logits_loss(model, batch)
    want = reference[next_token_targets(batch) != IGNORE].mean()
    torch.testing.assert_close(loss, want, rtol=1e-6, atol=1e-6)
    for a, b in zip(torch.autograd.grad(loss, params), torch.autograd.grad(want, params)):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    with torch.no_grad():
        task.validation_update(model, batch)
    torch.testing.assert_close(task.val_metrics["ppl"].compute(), want.detach().exp(), rtol=1e-5, atol=0)


class _PlainHead(nn.Module):
    """A head that is not an ``LMHead`` (its logits are computed whole): the same linear."""

    def __init__(self, lm: LMHead):
        super().__init__()
        self.head = lm.head

    def forward(self, hidden, tokens):
        return self.head(hidden)


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_token_cross_entropy_scores_the_first_m_positions_either_way(reduction):
    """``heads.token_cross_entropy`` scores the first ``M`` positions of ``hidden``: through the chunked
    loss for an ``LMHead``, from the logits for any other head — the same numbers; bad shapes named."""
    from mmformer.models.heads import token_cross_entropy

    torch.manual_seed(0)
    lm = LMHead(16, 50)
    lm.chunk_rows = 4
    hidden, targets = torch.randn(3, 7, 16), torch.randint(0, 50, (3, 5))
    targets[1, 3:] = IGNORE
    got = token_cross_entropy(lm, hidden, None, targets, IGNORE, reduction)
    want = token_cross_entropy(_PlainHead(lm), hidden, None, targets, IGNORE, reduction)
    ref = F.cross_entropy(
        lm.head(hidden[:, :5]).transpose(1, 2), targets, ignore_index=IGNORE, reduction=reduction
    )
    torch.testing.assert_close(got, ref)
    torch.testing.assert_close(want, ref)
    hook = lm.register_forward_hook(lambda module, args, out: out * 2)  # a hook sees (and changes) the logits
    ref = F.cross_entropy(
        2 * lm.head(hidden[:, :5]).transpose(1, 2), targets, ignore_index=IGNORE, reduction=reduction
    )
    torch.testing.assert_close(token_cross_entropy(lm, hidden, None, targets, IGNORE, reduction), ref)
    hook.remove()
    for bad in (torch.zeros(3, 8, dtype=torch.long), torch.zeros(2, 5, dtype=torch.long), targets.flatten()):
        with pytest.raises(ValueError, match="must be \\(B, M\\) with M <= N"):
            token_cross_entropy(lm, hidden, None, bad)
