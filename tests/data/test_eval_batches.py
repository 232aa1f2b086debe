"""``EvenEvalBatches``: the same number of evaluation batches on every rank (a sharded model's ranks
must run the same forwards), every sample exactly once over the ranks, no batch above the size."""

import pytest

from mmformer.data.samplers import EvalShardSampler, EvenEvalBatches


@pytest.mark.parametrize(
    ("length", "world", "batch"), [(9, 2, 4), (8, 2, 4), (10, 3, 4), (101, 4, 7), (5, 1, 2)]
)
def test_every_rank_gets_the_same_batch_count_and_every_sample_once(length, world, batch):
    ranks = [list(EvenEvalBatches(length, world, r, batch)) for r in range(world)]
    counts = {len(batches) for batches in ranks}
    assert len(counts) == 1 and counts == {len(EvenEvalBatches(length, world, 0, batch))}
    assert all(0 < len(b) <= batch for batches in ranks for b in batches)
    assert sorted(i for batches in ranks for b in batches for i in b) == list(range(length))
    for r, batches in enumerate(ranks):  # each rank keeps its plain shard, in order
        assert [i for b in batches for i in b] == list(EvalShardSampler(length, world, r))


def test_a_set_too_small_for_equal_batches_is_refused():
    with pytest.raises(ValueError, match="cannot give every process"):
        EvenEvalBatches(3, 2, 1, 1)
