"""Masked LM: BERT's masking statistics, the loss only on chosen positions, fixed validation masks,
and training through the CLI with a BPE that gains a mask token."""

from __future__ import annotations

import pytest
import torch

from mmformer.cli import main
from mmformer.models import AttentionConfig, build_backbone
from mmformer.models.heads import MLMHead
from mmformer.models.model import MultimodalModel
from mmformer.tasks.language_model import IGNORE
from mmformer.tasks.masked_lm import MaskedLMTask, mask_tokens
from mmformer.tokenizers import TextEmbedding


def test_masking_statistics_follow_bert():
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(10, 1000, (400, 500), generator=g)
    candidates = torch.rand(ids.shape, generator=g) < 0.9
    inputs, targets = mask_tokens(ids, candidates, mask_id=3, vocab_size=1000, generator=g)
    chosen = targets != IGNORE
    assert not (chosen & ~candidates).any()  # never outside the candidates
    assert torch.equal(inputs[~chosen], ids[~chosen])  # unchosen tokens untouched
    assert torch.equal(targets[chosen], ids[chosen])
    assert chosen.sum() / candidates.sum() == pytest.approx(0.15, abs=0.003)
    masked = (inputs == 3) & chosen
    kept = (inputs == ids) & chosen
    replaced = chosen & ~masked & ~kept
    n = chosen.sum()
    assert masked.sum() / n == pytest.approx(0.8, abs=0.01)
    assert replaced.sum() / n == pytest.approx(0.1 * (1 - 1 / 1000), abs=0.006)
    assert kept.sum() / n == pytest.approx(0.1, abs=0.006)


def _model(vocab=60, d=32):
    torch.manual_seed(0)
    emb = TextEmbedding(vocab, d, max_len=32)
    head = MLMHead(d, vocab)
    head.tie_to(emb.embed)
    return MultimodalModel({"text": emb}, build_backbone(d, 2, AttentionConfig(4)), {"mlm": head})


def test_the_loss_reads_only_the_chosen_positions():
    model, task = _model(), MaskedLMTask("text", "mlm", mask_id=3, vocab_size=60, special_ids=[0, 1, 2, 3])
    batch = {"text": torch.randint(4, 60, (4, 20)), "text_valid": torch.ones(4, 20, dtype=torch.bool)}
    batch["text_valid"][2, 12:] = False
    seen = {}
    handle = model.heads["mlm"].register_forward_hook(
        lambda m, i, o: seen.update(logits=o) or o.retain_grad()
    )
    torch.manual_seed(5)
    task.training_loss(model, batch).backward()
    handle.remove()
    grad = seen["logits"].grad.abs().sum(-1)  # (B, N)
    torch.manual_seed(5)
    _, targets = mask_tokens(batch["text"], task.candidates(batch), 3, 60, 0.15)
    chosen = targets != IGNORE
    assert chosen.any() and (grad[chosen] > 0).all() and (grad[~chosen] == 0).all()
    assert not chosen[2, 12:].any()  # padding is never chosen


def test_validation_scores_the_same_masks_every_time():
    model, task = _model().eval(), MaskedLMTask("text", "mlm", 3, 60, [0, 1, 2, 3], seed=7)
    batch = {"text": torch.randint(4, 60, (8, 20)), "text_valid": torch.ones(8, 20, dtype=torch.bool)}
    results = []
    for _ in range(2):
        task.on_validation_epoch_start(model)
        for m in task.val_metrics.values():
            m.reset()
        with torch.no_grad():
            task.validation_update(model, batch)
        results.append({k: float(m.compute()) for k, m in task.val_metrics.items()})
    assert results[0] == results[1] and 0.0 <= results[0]["acc"] <= 1.0


MLM = """\
name: mlm
seed: 0
model:
  tokenizers: {{text: {{kind: bpe, vocab_size: 300, max_len: 32}}}}
  backbone: {{preset: debug}}
  heads: {{mlm: {{kind: mlm}}}}
tasks:
  corpus:
    kind: masked_lm
    tokenizer: text
    head: mlm
    data: {{kind: text, root: {corpus}, seq_len: 32, batch_size: 4, val_fraction: 0.25}}
optim: {{lr: 3e-3, warmup_steps: 2}}
trainer: {{max_steps: 6, accelerator: cpu, devices: 1, log_every_n_steps: 1, enable_progress_bar: false,
          num_sanity_val_steps: 0}}
logger: {{mode: disabled}}
"""


def test_masked_lm_trains_through_the_cli_and_refuses_a_causal_backbone(workdir, capsys):
    docs = [f"Chapter {i}\nAnd the light was good, and the day was {i}.\nAnd it was so." for i in range(40)]
    (workdir / "corpus.txt").write_text("\n\n".join(docs) + "\n")
    recipe = workdir / "mlm.yaml"
    recipe.write_text(MLM.format(corpus=workdir / "corpus.txt"))
    assert main(["train", str(recipe)]) == 0
    out = capsys.readouterr().out
    acc = float(next(ln for ln in out.splitlines() if ln.startswith("val/corpus/acc")).split()[1])
    assert 0.0 <= acc <= 1.0
    assert main(["train", str(recipe), "model.backbone.causal=true"]) == 2
    assert "bidirectional backbone" in capsys.readouterr().err
