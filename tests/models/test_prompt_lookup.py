"""Prompt-lookup decoding: drafts as transformers' prompt lookup finds them; generation with drafts gives
greedy decoding's ids (batched and left-padded, with eos, at the end of the context) in fewer forwards,
rejected drafts included; the draft length is the one at which the slowest row advances fastest, with
forward costs learned from the call and kept runs scored against what was generated; bad arguments are
refused."""

import random

import pytest
import torch

from mmformer.models import AttentionConfig, PositionConfig, build_backbone, prompt_lookup
from mmformer.models import generate as generate_module
from mmformer.models.generate import generate
from mmformer.models.heads import LMHead
from mmformer.models.model import MultimodalModel
from mmformer.models.prompt_lookup import ForwardCost, draft, draft_length, kept_run
from mmformer.nn.kv_cache import KVCache
from mmformer.tokenizers import TextEmbedding


def test_draft_copies_what_followed_the_earliest_occurrence_of_the_longest_matching_ngram():
    text = [3, 9, 7, 1, 2, 3, 4, 8, 2, 3]
    assert draft(text, 3, max_ngram=2) == [4, 8, 2]  # "2 3" first occurs at 4
    assert draft(text, 3, max_ngram=1) == [9, 7, 1]  # "3" alone first occurs at 0
    assert draft(text, 10, max_ngram=2) == [4, 8, 2, 3]  # to the end of the text
    assert draft([1, 2, 3, 4], 3, max_ngram=2) == []  # nothing recurs
    assert draft([4, 1, 2, 4], 2, max_ngram=3, min_ngram=2) == []  # only a 1-gram recurs
    assert draft([4, 1, 2, 4], 2, max_ngram=3, min_ngram=1) == [1, 2]
    assert draft([7], 2) == [] and draft([7, 7], 2, min_ngram=1) == [7]
    for bad in (
        {"n_draft": 0},
        {"n_draft": 2, "min_ngram": 0},
        {"n_draft": 2, "max_ngram": 1, "min_ngram": 2},
    ):
        with pytest.raises(ValueError, match="n_draft"):
            draft(text, **bad)


def test_draft_equals_transformers_prompt_lookup():
    candidates = pytest.importorskip("transformers.generation.candidate_generator")
    g = torch.Generator().manual_seed(0)
    for trial in range(200):
        ids = torch.randint(0, 6, (1, int(torch.randint(2, 40, (1,), generator=g))), generator=g)
        n_draft, max_ngram = 1 + trial % 5, 1 + trial % 3
        ref = candidates.PromptLookupCandidateGenerator(
            num_output_tokens=n_draft, max_matching_ngram_size=max_ngram, max_length=10_000
        )
        want = ref.get_candidates(ids)[0][0, ids.shape[1] :].tolist()
        assert draft(ids[0].tolist(), n_draft, max_ngram, min_ngram=1) == want


def _lm(seed: int, vocab: int = 24, d: int = 32, max_len: int | None = None) -> MultimodalModel:
    """A random 2-layer causal LM whose greedy continuations repeat in part (drafts are kept and
    rejected)."""
    torch.manual_seed(seed)
    positions = PositionConfig("rope") if max_len is None else PositionConfig()
    model = MultimodalModel(
        {"text": TextEmbedding(vocab, d, max_len=max_len)},
        build_backbone(d, 2, AttentionConfig(4), positions=positions, causal=True),
        {"lm": LMHead(d, vocab)},
    )
    return model.eval()


def _prompts(seed: int, vocab: int = 24):
    ids = torch.randint(0, vocab, (3, 12), generator=torch.Generator().manual_seed(seed))
    valid = torch.ones_like(ids, dtype=torch.bool)
    valid[0, :3] = valid[2, :7] = False  # left-padded rows of 9, 12 and 5 tokens
    return ids, valid


@pytest.mark.parametrize("seed", [0, 1, 3])
@pytest.mark.parametrize(("n_draft", "ngrams"), [(1, (1, 2)), (4, (1, 2)), (10, (2, 4)), (3, (3, 3))])
def test_generation_with_drafts_gives_the_greedy_ids_in_fewer_forwards(seed, n_draft, ngrams, monkeypatch):
    """Rows of the batch keep runs of different lengths: each advances by its own (the others' rejected
    positions become padding of the KV cache, ``KVCache.pad_tail``). Every draft is verified whole here
    (the length policy, timed, is tested below), so the verification meets kept and rejected ids."""
    padded = []
    real = KVCache.pad_tail
    monkeypatch.setattr(KVCache, "pad_tail", lambda self, *a: padded.append(1) or real(self, *a))
    monkeypatch.setattr(
        prompt_lookup, "draft_length", lambda kept_if, cost, max_k: max(map(len, kept_if)) - 1
    )
    model = _lm(seed)
    ids, valid = _prompts(seed)
    plain, drafted = {}, {}
    want = generate(model, "text", "lm", ids, valid, 30, stats=plain)
    got = generate(
        model, "text", "lm", ids, valid, 30, stats=drafted, prompt_lookup_num_tokens=n_draft,
        min_matching_ngram_size=ngrams[0], max_matching_ngram_size=ngrams[1],
    )  # fmt: skip
    assert got == want
    assert plain["forwards"] == 29
    assert 0 < drafted["accepted"] < drafted["drafted"]  # drafts were kept and drafts were rejected
    assert drafted["forwards"] < plain["forwards"]
    assert padded  # rows advanced by different runs
    for row, (ids_row, keep) in enumerate(zip(ids, valid)):  # one row at a time: the same ids
        one = ids_row[keep][None]
        alone = generate(
            model,
            "text",
            "lm",
            one,
            torch.ones_like(one, dtype=torch.bool),
            30,
            prompt_lookup_num_tokens=n_draft,
        )
        assert alone == [want[row]]


@pytest.mark.parametrize("seed", [0, 1, 3])
def test_the_timed_draft_length_gives_the_greedy_ids(seed):
    model = _lm(seed)
    ids, valid = _prompts(seed)
    want = generate(model, "text", "lm", ids, valid, 40)
    for n_draft in (3, 10):
        assert generate(model, "text", "lm", ids, valid, 40, prompt_lookup_num_tokens=n_draft) == want
        for row, (ids_row, keep) in enumerate(zip(ids, valid)):
            one = ids_row[keep][None]
            alone = generate(model, "text", "lm", one, torch.ones_like(one, dtype=torch.bool), 40,
                             prompt_lookup_num_tokens=n_draft)  # fmt: skip
            assert alone == [want[row]]


@pytest.mark.parametrize("seed", [0, 1, 3])
def test_a_fixed_width_verifies_any_draft_length_over_one_plus_n_draft_positions(seed, monkeypatch):
    """What a compiled step runs (``generate(compile=True)`` sets ``fixed_width``): whatever draft lengths
    are chosen (random here), every forward is over 1 or 1 + n_draft positions, and the ids are greedy's."""
    rng = random.Random(seed)
    widths = set()
    real = generate_module.prompt_lookup_greedy

    def fixed(verify, *args, **kwargs):
        def recorded(chunk):
            widths.add(chunk.shape[1])
            return verify(chunk)

        return real(recorded, *args, **{**kwargs, "fixed_width": True})

    monkeypatch.setattr(generate_module, "prompt_lookup_greedy", fixed)
    monkeypatch.setattr(
        prompt_lookup, "draft_length", lambda kept_if, cost, max_k: rng.randint(0, max(map(len, kept_if)) - 1)
    )
    model = _lm(seed)
    ids, valid = _prompts(seed)
    want = generate(model, "text", "lm", ids, valid, 40)
    stats: dict = {}
    assert generate(model, "text", "lm", ids, valid, 40, stats=stats, prompt_lookup_num_tokens=6) == want
    assert widths == {1, 7}
    assert 0 < stats["accepted"] < stats["drafted"]


class _LinearCost(ForwardCost):
    """A forward over w positions per row costs 1 + 0.1 (w - 1), whatever the clock says."""

    def observe(self, width: int, seconds: float) -> None:
        pass

    def __call__(self, width: int) -> float:
        return 1 + 0.1 * (width - 1)


@pytest.mark.parametrize("seed", [0, 1, 3])
def test_the_length_policy_drafts_where_copying_pays_and_keeps_the_greedy_ids(seed, monkeypatch):
    monkeypatch.setattr(prompt_lookup, "ForwardCost", _LinearCost)
    model = _lm(seed)
    ids, valid = _prompts(seed)
    want = generate(model, "text", "lm", ids, valid, 30)
    for row, (ids_row, keep) in enumerate(zip(ids, valid)):
        one = ids_row[keep][None]
        stats = {}
        got = generate(model, "text", "lm", one, torch.ones_like(one, dtype=torch.bool), 30, stats=stats,
                       prompt_lookup_num_tokens=10)  # fmt: skip
        assert got == [want[row]]
        assert stats["accepted"] > 0 and stats["forwards"] < 29


def test_draft_length_is_where_the_slowest_row_advances_fastest():
    row = [0, 0.9, 1.7, 2.0, 2.1]  # ids expected kept of the draft cut to 0..4 ids
    # ids per unit of time at K = 0..4: 1, 1.9 / 1.25, 2.7 / 1.5, 3.0 / 1.75, 3.1 / 2
    assert draft_length([row], lambda w: 1 + 0.25 * (w - 1), max_k=10) == 2
    assert draft_length([row], lambda w: 1.0, max_k=10) == 4  # free positions: the whole draft
    assert draft_length([row], lambda w: 1.0, max_k=2) == 2  # no longer than max_k
    assert draft_length([row], lambda w: float(w), max_k=10) == 0  # a position costs a forward
    assert draft_length([[0, 1, 2, 3]], lambda w: float(w), max_k=10) == 0  # a tie goes to the shorter
    # a row without a draft carries the others' positions and gains nothing: on a CPU no draft pays
    assert draft_length([row, [0]], lambda w: 1 + 0.1 * (w - 1), max_k=10) == 0
    assert draft_length([row, [0, 0.5]], lambda w: 1 + 0.25 * (w - 1), max_k=10) == 1  # 1.5 / 1.25
    # nearly free positions (a GPU; or nothing timed yet): the slowest row loses under NEAR, the sum decides
    assert prompt_lookup.NEAR < 1 / 1.005**4
    assert draft_length([row, [0]], lambda w: 1 + 0.005 * (w - 1), max_k=10) == 4
    assert draft_length([row, [0]], lambda w: 1.0, max_k=10) == 4
    assert draft_length([[0], [0]], lambda w: 1.0, max_k=10) == 0
    assert draft_length([[0, 1.0]], lambda w: 0.0, max_k=10) == 1  # a zero cost does not divide by zero


def test_forward_cost_learns_a_line_through_each_widths_median_without_its_first_forward():
    cost = ForwardCost()
    assert cost(1) == cost(11) == 1.0  # nothing timed: every width alike, so drafts get tried
    cost.observe(1, 30.0)  # a width's first forward (a compile, new primitives) is not counted
    assert cost(1) == 1.0
    for t in (1.0, 1.2, 0.9):
        cost.observe(1, t)
    assert cost(1) == cost(9) == 1.0  # one width known: the others cost as much as it until timed
    cost.observe(3, 50.0)
    for t in (2.0, 2.0, 9.0):
        cost.observe(3, t)
    assert cost(1) == pytest.approx(1.0) and cost(3) == pytest.approx(2.0)  # medians
    assert cost(5) == pytest.approx(3.0) and cost(11) == pytest.approx(6.0)  # the line through them
    for t in (0.5, 0.5, 0.5, 0.5, 0.5):  # only the last five forwards of a width count
        cost.observe(3, t)
    assert cost(1) == cost(11) == pytest.approx(0.75)  # a line falling with width: flat, the medians' mean


def test_a_drafts_kept_run_is_scored_against_what_was_generated():
    text = [5, 6, 7, 8]
    assert kept_run(text, 2, [7, 8]) == 2
    assert kept_run(text, 2, [7, 9, 9]) == 1
    assert kept_run(text, 2, [9]) == 0
    assert kept_run(text, 2, [7, 8, 1]) is None  # not generated that far yet
    assert kept_run(text, 4, [1, 2]) is None


def test_rows_stop_at_eos_and_the_context_end_as_greedy_decoding():
    model = _lm(3)
    ids, valid = _prompts(3)
    plain = generate(model, "text", "lm", ids, valid, 30)
    stop = next(i for i, t in enumerate(plain[0]) if i >= 4 and t not in plain[0][:i])
    eos = plain[0][stop]  # ends row 0 after `stop` ids; the others where (if) they produce it
    want = generate(model, "text", "lm", ids, valid, 30, eos_id=eos)
    assert len(want[0]) == stop < min(map(len, want[1:]))
    rows = []  # the rows of every verification forward: row 0 leaves the batch once it ended
    hook = model.register_forward_pre_hook(lambda module, args: rows.append(args[0].shape[0]))
    try:
        assert generate(model, "text", "lm", ids, valid, 30, eos_id=eos, prompt_lookup_num_tokens=6) == want
    finally:
        hook.remove()
    assert rows[0] == 3 and rows[-1] < 3
    first = plain[1][0]  # row 1 ends at its first id: no verification forward carries it
    assert first not in (plain[0][0], plain[2][0])
    rows.clear()
    hook = model.register_forward_pre_hook(lambda module, args: rows.append(args[0].shape[0]))
    try:
        got = generate(model, "text", "lm", ids, valid, 30, eos_id=first, prompt_lookup_num_tokens=6)
    finally:
        hook.remove()
    assert got == generate(model, "text", "lm", ids, valid, 30, eos_id=first) and got[1] == []
    assert rows[0] == 2
    for new in (1, 2, 3):  # budgets shorter than a draft
        assert generate(model, "text", "lm", ids, valid, new, prompt_lookup_num_tokens=6) == [
            r[:new] for r in plain
        ]
    short = _lm(1, max_len=16)  # learned positions: 16 - 12 = 4 new ids for the longest row
    want = generate(short, "text", "lm", ids, valid, 30)
    assert [len(r) for r in want] == [4] * 3
    assert generate(short, "text", "lm", ids, valid, 30, prompt_lookup_num_tokens=10) == want


def test_prompt_lookup_refuses_sampling_and_bad_sizes():
    model = _lm(0)
    ids, valid = _prompts(0)
    with pytest.raises(ValueError, match="greedily"):
        generate(model, "text", "lm", ids, valid, 4, temperature=0.7, prompt_lookup_num_tokens=4)
    with pytest.raises(ValueError, match="prompt_lookup_num_tokens >= 1"):
        generate(model, "text", "lm", ids, valid, 4, prompt_lookup_num_tokens=0)
    with pytest.raises(ValueError, match="min_matching_ngram_size"):
        generate(model, "text", "lm", ids, valid, 4, prompt_lookup_num_tokens=4, min_matching_ngram_size=5)


def test_pad_tail_turns_a_rows_rejected_positions_into_padding():
    cache = KVCache()
    k = torch.randn(2, 1, 5, 4)
    cache.update(0, k, k + 1)
    cache.extend(
        torch.ones(2, 5, dtype=torch.bool), torch.zeros(2, 5, dtype=torch.long), torch.zeros(2, 5, 1)
    )
    cache.pad_tail(2, torch.tensor([3, 1]))  # row 0 keeps positions 2-4, row 1 only position 2
    assert cache.valid.tolist() == [[True] * 5, [True, True, True, False, False]]
    assert torch.equal(cache.keys[0][0], k[0]) and torch.equal(cache.values[0][0], k[0] + 1)
    assert cache.keys[0][1, :, 3:].abs().sum() == 0 and cache.values[0][1, :, 3:].abs().sum() == 0
    assert torch.equal(cache.keys[0][1, :, :3], k[1, :, :3])
    assert cache.next_positions(torch.ones(2, 1, dtype=torch.bool))[:, 0, 0].tolist() == [5, 3]
    with pytest.raises(ValueError, match="cannot pad from position 6"):
        cache.pad_tail(6, torch.tensor([0, 0]))
