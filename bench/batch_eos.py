"""Batch greedy decoding where the rows end (eos) at different steps: mmformer's ``generate``, whose
ended rows leave the batch, against transformers' greedy ``generate``, which computes every row to the
longest one's end — on the real SmolLM2-135M-Instruct.

    python bench/batch_eos.py --threads 1            # 4 chat prompts, up to 128 new tokens, 3 rounds
    python bench/batch_eos.py --prompt-lookup 10     # mmformer's side with prompt-lookup drafts
    python bench/batch_eos.py --quick                # 16 new tokens, 1 round: checks the script

Both sides' ids are checked equal first. Ratios are transformers' time / mmformer's (> 1: mmformer
faster), median and IQR over paired rounds (``peers.paired_multi``). Numbers go to ``bench/README.md``;
nothing here is a test.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # peers.py beside this file
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
from peers import Settings, paired_multi, smollm2  # noqa: E402
from prompt_lookup import chat_ids, hf_generate  # noqa: E402

from mmformer.models.generate import generate  # noqa: E402

PROMPTS = (  # answers of a few words, a sentence or two, a paragraph, a poem
    "What is the capital of France?",
    "Name three primary colors.",
    "Write a short poem about the sea.",
    "Explain in a few sentences what a transformer neural network is.",
)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--pairs", type=int, default=3, help="timed rounds")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--prompt-lookup", type=int, default=None, help="mmformer's prompt_lookup_num_tokens")
    p.add_argument("--quick", action="store_true")
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    new, pairs = (16, 1) if a.quick else (a.new_tokens, a.pairs)
    m = smollm2()
    ours, ref, tok = m["ours"].eval(), m["ref"].eval(), m["tokenizer"]
    eos = tok.eos_id
    ids, valid = tok.pad_batch([chat_ids(tok, q) for q in PROMPTS], side="left")

    def mm():
        return generate(
            ours, "text", "lm", ids, valid, new, eos_id=eos, prompt_lookup_num_tokens=a.prompt_lookup
        )

    def hf():
        return hf_generate(ref, ids, valid, new, eos)

    got = mm()
    lengths = [len(r) for r in got]
    print(
        f"torch {torch.__version__}, {torch.get_num_threads()} thread(s), fp32, batch {len(PROMPTS)}, up to "
        f"{new} new tokens, mmformer's prompt lookup {a.prompt_lookup}; answers of {lengths} tokens; "
        f"ids identical to transformers': {got == hf()}",
        flush=True,
    )
    s = Settings(quick=a.quick, pairs=pairs, warmup=1, optimizer="-", block=2)
    results, _ = paired_multi("batch eos", mm, [("HF greedy", hf)], sum(lengths), "new tokens/s", s)
    for r in results:
        print(f"{r.peer} / mmformer: {r.ratio:.2f} (IQR {r.q1:.2f}–{r.q3:.2f}); mmformer {r.mm_s:.2f} s")


if __name__ == "__main__":
    main()
