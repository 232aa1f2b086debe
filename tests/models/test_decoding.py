"""``fixed_steps`` decoding (what a sharded model needs: every rank runs the same forwards): the same
text as stopping early, with every step's forward run."""

import torch

from mmformer.models.decoding import beam_search, greedy
from mmformer.nn.attention import KVCache

V, EOS = 6, 0


def _step(calls: list[int], generator: torch.Generator):
    def step(ids: torch.Tensor, t: int) -> torch.Tensor:
        calls.append(t)
        logits = torch.randn(ids.shape[0], V, generator=generator)
        logits[:, EOS] += 3.0 * t  # every row ends within a few steps
        return logits

    return step


def test_fixed_steps_run_every_forward_and_change_no_text():
    first = torch.randn(3, V, generator=torch.Generator().manual_seed(0))
    for decode in ("greedy", "beam"):
        outs, counts = [], []
        for fixed in (False, True):
            calls: list[int] = []
            step = _step(calls, torch.Generator().manual_seed(1))
            if decode == "greedy":
                out = greedy(step, first.clone(), EOS, 12, fixed_steps=fixed)
            else:
                cache = KVCache()
                cache.valid = torch.ones(3, 1, dtype=torch.bool)
                out = beam_search(step, cache, first.clone(), EOS, 12, beam_size=2, fixed_steps=fixed)
            outs.append(out)
            counts.append(len(calls))
        assert outs[0] == outs[1], decode
        assert counts[1] == 11 and counts[0] < 11, (decode, counts)  # rows ended early without fixed_steps
