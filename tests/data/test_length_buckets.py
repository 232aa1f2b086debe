"""Length bucketing: every sample once per epoch, equal batch counts on every rank, much less padding
than random batches, a new order each epoch, resumable; trimmed text batches give the same loss."""

from __future__ import annotations

import numpy as np
import pytest
import soundfile
import torch
from torch.utils.data import default_collate

from mmformer.data.audio import clip_milliseconds
from mmformer.data.samplers import LengthBuckets, ResumableShardSampler
from mmformer.data.text import collate_trimmed


def _buckets(lengths, rank=0, world=2, batch=4, epoch=0, drop_last=True):
    sampler = ResumableShardSampler(
        list(range(len(lengths))), num_replicas=world, rank=rank, seed=0, drop_last=True
    )
    b = LengthBuckets(sampler, lengths, batch, drop_last=drop_last, chunk=5)
    b.set_epoch(epoch)
    return b


def _padding(batches, lengths) -> float:
    return float(np.mean([max(lengths[i] for i in b) - np.mean([lengths[i] for i in b]) for b in batches]))


def test_buckets_cover_the_epoch_with_less_padding_and_a_new_order_each_epoch():
    rng = np.random.default_rng(0)
    lengths = rng.integers(3, 400, size=403).tolist()
    per_rank = [list(_buckets(lengths, rank=r, drop_last=False)) for r in (0, 1)]
    assert len(per_rank[0]) == len(per_rank[1]) == len(_buckets(lengths, drop_last=False))
    seen = [i for batches in per_rank for b in batches for i in b]
    assert len(seen) == len(set(seen)) == 402  # each once; DistributedSampler's drop_last evens 403 to 402
    full = list(_buckets(lengths))
    assert all(len(b) == 4 for b in full) and len(full) == 201 // 4
    random_batches = [list(range(k, k + 4)) for k in range(0, 400, 4)]
    assert _padding(full, lengths) < 0.25 * _padding(random_batches, lengths)
    assert list(_buckets(lengths, epoch=1)) != full
    resumed = _buckets(lengths)
    resumed.skip(7)
    assert list(resumed) == full[7:] and list(resumed) == full


def test_trimmed_text_batches_keep_the_loss():
    from mmformer.models import AttentionConfig, PositionConfig, build_backbone
    from mmformer.models.heads import LMHead
    from mmformer.models.model import MultimodalModel
    from mmformer.tasks.language_model import CausalLMTask
    from mmformer.tokenizers import TextEmbedding

    torch.manual_seed(0)
    model = MultimodalModel(
        {"text": TextEmbedding(50, 32)},
        build_backbone(32, 2, AttentionConfig(4), positions=PositionConfig("rope"), causal=True),
        {"lm": LMHead(32, 50)},
    ).eval()
    samples = []
    for n in (5, 9, 3):
        ids = torch.zeros(16, dtype=torch.long)
        ids[:n] = torch.randint(1, 50, (n,))
        valid = torch.arange(16) < n
        samples.append({"text": ids, "text_valid": valid, "text_document": torch.zeros(16, dtype=torch.long)})
    full, trimmed = default_collate(samples), collate_trimmed(samples)
    assert trimmed["text"].shape == (3, 9)
    task = CausalLMTask("text", "lm")
    with torch.no_grad():
        torch.testing.assert_close(task.training_loss(model, trimmed), task.training_loss(model, full))


def test_clip_durations_come_from_the_header(tmp_path):
    soundfile.write(tmp_path / "a.wav", np.zeros(24000, dtype="float32"), 16000)
    (tmp_path / "bad.wav").write_bytes(b"not audio")
    assert clip_milliseconds(tmp_path / "a.wav") == 1500
    assert clip_milliseconds(tmp_path / "bad.wav") == 0


@pytest.mark.slow
def test_a_bucketed_language_model_trains_and_resumes_through_the_cli(workdir, capsys):
    from mmformer.cli import main
    from tests.training.test_distributed_equivalence import LM, _corpus

    corpus = _corpus(workdir / "corpus.txt")
    recipe = workdir / "lm.yaml"
    recipe.write_text(
        LM.format(name="lm", corpus=corpus).replace("pack: false,", "pack: false, bucket_by_length: true,")
    )
    args = ["train", str(recipe), "tasks.corpus.data.batch_size=4", "trainer.max_steps=-1"]
    assert main([*args, "trainer.max_epochs=1"]) == 0
    assert main([*args, "trainer.max_epochs=2", "resume=auto"]) == 0
    assert "val/corpus/ppl" in capsys.readouterr().out
