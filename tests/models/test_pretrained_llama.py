"""Real SmolLM2-135M-Instruct (GGUF, Q4_1) imported into mmformer equals transformers'
``LlamaForCausalLM`` loaded from the same file (slow tier: the file takes ~40 s to load); so does a tiny
random Llama written here as a GGUF file (fast tier); HF Llama directories import and export losslessly."""

import pytest
import torch
import transformers

from mmformer.models.generate import generate  # noqa: E402
from mmformer.models.pretrained import load_pretrained, resolve_pretrained  # noqa: E402
from mmformer.models.pretrained.llama import build_llama, load_hf_llama, save_hf_llama  # noqa: E402
from tests.conftest import TINY_LLAMA

PROMPT = "In the beginning God created the heaven and the earth. And the earth was without form, and void"
TEXTS = [
    PROMPT,
    "  two spaces,\ttab,\n\nnewlines, émoji 🙂, 中文, numbers 1611 and 3.14",
    "<|im_start|>user\nHi<|im_end|>",
]


def _smollm2_path():
    return resolve_pretrained(
        "smollm2-135m-instruct"
    )  # `make install` installs it; else the error names the command


@pytest.fixture(scope="module")
def ours():
    _smollm2_path()
    p = load_pretrained("smollm2-135m-instruct")
    p.model.eval()
    return p


@pytest.fixture(scope="module")
def reference():
    path = _smollm2_path()
    tok = transformers.AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    model = transformers.LlamaForCausalLM.from_pretrained(
        path.parent, gguf_file=path.name, dtype=torch.float32
    )
    return tok, model.eval()


@pytest.mark.slow
def test_gguf_tokenizer_matches_transformers(ours, reference):
    ref_tok, _ = reference
    for text in TEXTS:
        ids = ours.tokenizer.encode(text)
        assert ids == ref_tok(text, add_special_tokens=False).input_ids
        assert ours.tokenizer.decode(ids) == text
    assert (ours.tokenizer.bos_id, ours.tokenizer.eos_id) == (ref_tok.bos_token_id, ref_tok.eos_token_id)
    assert ours.tokenizer.pad_id != ours.tokenizer.eos_id  # the file sets pad = eos; ours never is


@pytest.mark.slow
def test_chat_template_matches_transformers(ours, reference):
    ref_tok, _ = reference
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    for gen in (True, False):
        assert ours.tokenizer.apply_chat_template(messages, gen) == ref_tok.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=gen
        )


@pytest.mark.slow
def test_smollm2_logits_match_transformers(ours, reference):
    _, ref = reference
    ids = torch.tensor([ours.tokenizer.encode(PROMPT)])
    with torch.no_grad():
        got = ours.model(ids, "text", "lm")
        want = ref(ids).logits
    assert got.shape == want.shape == (1, ids.shape[1], 49152)
    assert (got - want).abs().max() <= 1e-4 * want.abs().max()


@pytest.mark.slow
def test_smollm2_greedy_continuation_matches_transformers(ours, reference):
    _, ref = reference
    tok = ours.tokenizer
    prompt = tok.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}])
    ids = torch.tensor([tok.encode(prompt)])
    got = generate(
        ours.model, "text", "lm", ids, torch.ones_like(ids, dtype=torch.bool), 24, eos_id=tok.eos_id
    )[0]
    want = ref.generate(ids, max_new_tokens=24, do_sample=False, eos_token_id=tok.eos_id)[0, ids.shape[1] :]
    want = want.tolist()
    assert got == (want[: want.index(tok.eos_id)] if tok.eos_id in want else want)
    assert "Paris" in tok.decode(got)


@pytest.mark.slow
def test_batched_left_padded_generation_equals_one_at_a_time(ours):
    tok = ours.tokenizer
    prompts = [PROMPT, "The capital of France is"]
    seqs = [tok.encode(p) for p in prompts]
    ids, valid = tok.pad_batch(seqs, side="left")
    batched = generate(ours.model, "text", "lm", ids, valid, 8)
    for s, b in zip(seqs, batched):
        one = torch.tensor([s])
        assert generate(ours.model, "text", "lm", one, torch.ones_like(one, dtype=torch.bool), 8)[0] == b


@pytest.mark.slow
def test_smollm2_prompt_lookup_gives_its_greedy_ids_in_fewer_forwards(ours):
    """A chat answer that copies its prompt (fixing the spelling of a passage), one prompt and two
    left-padded: prompt-lookup decoding gives greedy decoding's ids, with drafts kept."""
    tok = ours.tokenizer
    passage = "In the begining God created the heaven and the earth. And the earth was without form."
    texts = [f"Fix the spelling mistakes in this text and return the corrected text:\n\n{passage}", PROMPT]
    seqs = [tok.encode(tok.apply_chat_template([{"role": "user", "content": t}])) for t in texts]
    for rows in (seqs[:1], seqs):
        ids, valid = tok.pad_batch(rows, side="left")
        want = generate(ours.model, "text", "lm", ids, valid, 40, eos_id=tok.eos_id)
        stats: dict = {}
        got = generate(
            ours.model,
            "text",
            "lm",
            ids,
            valid,
            40,
            eos_id=tok.eos_id,
            prompt_lookup_num_tokens=10,
            stats=stats,
        )
        assert got == want and stats["accepted"] > 0 and stats["forwards"] < max(map(len, want)) - 1


@pytest.mark.slow
def test_smollm2_exports_to_a_directory_transformers_loads(ours, tmp_path):
    save_hf_llama(ours.model, ours.config, tmp_path, ours.tokenizer)
    ref = transformers.LlamaForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    ids = torch.tensor([ours.tokenizer.encode(PROMPT)])
    with torch.no_grad():
        torch.testing.assert_close(ref(ids).logits, ours.model(ids, "text", "lm"), rtol=0, atol=1e-4)
    hf_tok = transformers.AutoTokenizer.from_pretrained(tmp_path)
    assert hf_tok.pad_token_id < 49152  # our own <|pad|> has no embedding row: the export pads with eos
    batch = hf_tok([PROMPT, "Hi"], padding=True, return_tensors="pt")
    with torch.no_grad():
        assert torch.isfinite(ref(**batch).logits).all()
    again, tok, _ = load_hf_llama(tmp_path)
    assert tok.encode(TEXTS[1]) == ours.tokenizer.encode(TEXTS[1])
    assert tok.chat_template == ours.tokenizer.chat_template
    for (k, a), (_, b) in zip(again.state_dict().items(), ours.model.state_dict().items()):
        assert torch.equal(a, b), k


@pytest.mark.parametrize("tied", [False, True])
def test_hf_llama_directory_round_trip(tmp_path, tied):
    cfg = transformers.LlamaConfig(
        **{**TINY_LLAMA, "vocab_size": 101, "rope_theta": 500_000.0, "tie_word_embeddings": tied}
    )
    torch.manual_seed(0)
    ref = transformers.LlamaForCausalLM(cfg).eval()
    ref.save_pretrained(tmp_path / "hf")
    model, tok, config = load_hf_llama(tmp_path / "hf")
    assert tok is None
    ids = torch.randint(0, 101, (2, 9))
    with torch.no_grad():
        want = ref(ids).logits
        torch.testing.assert_close(model(ids, "text", "lm"), want, rtol=0, atol=1e-5)
    save_hf_llama(model, config, tmp_path / "out")
    back = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "out", dtype=torch.float32).eval()
    with torch.no_grad():
        torch.testing.assert_close(back(ids).logits, want, rtol=0, atol=1e-6)
    assert back.config.tie_word_embeddings == tied


# llama.cpp's tensor names for HF Llama's (convert_hf_to_gguf.py), and its q / k row order for RoPE
GGUF_PARTS = {
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
}


def _llama_cpp_permute(w, n_heads):
    return w.reshape(n_heads, 2, w.shape[0] // n_heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _write_gguf(path, ref, config, tokens, types, merges):
    """``ref`` (an HF ``LlamaForCausalLM``) as llama.cpp's converter writes it: float32 tensors, ``llama.*``
    sizes and a byte-level BPE vocabulary in ``tokenizer.ggml.*``."""
    gguf = pytest.importorskip("gguf")

    w = gguf.GGUFWriter(str(path), "llama")
    w.add_context_length(64)
    w.add_embedding_length(config["hidden_size"])
    w.add_block_count(config["num_hidden_layers"])
    w.add_feed_forward_length(config["intermediate_size"])
    w.add_head_count(config["num_attention_heads"])
    w.add_head_count_kv(config["num_key_value_heads"])
    w.add_layer_norm_rms_eps(config["rms_norm_eps"])
    w.add_rope_freq_base(config["rope_theta"])
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("smollm")
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(merges)
    w.add_bos_token_id(tokens.index("<|im_start|>"))
    w.add_eos_token_id(tokens.index("<|im_end|>"))
    w.add_chat_template("{% for m in messages %}<|im_start|>{{ m['content'] }}<|im_end|>{% endfor %}")
    for name, t in ref.state_dict().items():
        if name == "model.embed_tokens.weight":
            name = "token_embd.weight"
        elif name == "model.norm.weight":
            name = "output_norm.weight"
        elif name == "lm_head.weight":
            if config["tie_word_embeddings"]:
                continue  # a tied model has no output.weight
            name = "output.weight"
        else:
            _, _, i, *part, kind = name.split(".")
            part = ".".join(part)
            if part in ("self_attn.q_proj", "self_attn.k_proj"):
                heads = config["num_attention_heads" if part.endswith("q_proj") else "num_key_value_heads"]
                t = _llama_cpp_permute(t, heads)
            name = f"blk.{i}.{GGUF_PARTS[part]}.{kind}"
        w.add_tensor(name, t.contiguous().numpy())
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.mark.parametrize("tied", [False, True])
def test_tiny_gguf_file_loads_like_transformers(tmp_path, tied):
    """The GGUF path (``read_gguf``, ``gguf_config``, q / k un-permuting, ``tokenizer_from_gguf``) on a
    tiny random Llama, against transformers reading the same file: same ids, same logits."""
    from tokenizers.pre_tokenizers import ByteLevel

    merges = ["Ġ t", "h e", "Ġt he", "i n", "Ġ a", "e r"]
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    tokens = sorted(ByteLevel.alphabet()) + [m.replace(" ", "") for m in merges] + specials
    types = [1] * (len(tokens) - len(specials)) + [3] * len(specials)  # 3: control tokens
    config = {**TINY_LLAMA, "vocab_size": len(tokens), "tie_word_embeddings": tied}
    torch.manual_seed(0)
    ref = transformers.LlamaForCausalLM(transformers.LlamaConfig(**config)).eval()
    _write_gguf(tmp_path / "tiny.gguf", ref, config, tokens, types, merges)

    ours = load_pretrained(tmp_path / "tiny.gguf")
    ref_tok = transformers.AutoTokenizer.from_pretrained(tmp_path, gguf_file="tiny.gguf")
    text = "the other 12 in there<|im_end|> and é 🙂"
    ids = ours.tokenizer.encode(text)
    assert ids == ref_tok(text, add_special_tokens=False).input_ids and ours.tokenizer.decode(ids) == text
    assert ids[:2] == [tokens.index("t"), tokens.index("he")] and tokens.index("<|im_end|>") in ids
    assert (ours.tokenizer.bos_id, ours.tokenizer.eos_id) == (ref_tok.bos_token_id, ref_tok.eos_token_id)
    assert ours.tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], False) == (
        "<|im_start|>hi<|im_end|>"
    )
    assert ours.config["tie_word_embeddings"] == tied and ours.config["rope_theta"] == config["rope_theta"]
    hf = transformers.LlamaForCausalLM.from_pretrained(tmp_path, gguf_file="tiny.gguf", dtype=torch.float32)
    x = torch.tensor([ids])
    with torch.no_grad():
        want = ref(x).logits
        torch.testing.assert_close(hf.eval()(x).logits, want, rtol=0, atol=1e-6)  # the file is right
        torch.testing.assert_close(ours.model.eval()(x, "text", "lm"), want, rtol=0, atol=1e-5)


def test_unsupported_llama_options_are_refused():
    base = dict(
        hidden_size=64, num_hidden_layers=1, num_attention_heads=4, intermediate_size=96, vocab_size=10
    )
    with pytest.raises(ValueError, match="RoPE scaling"):
        build_llama({**base, "rope_scaling": {"rope_type": "yarn", "factor": 4.0}})
    with pytest.raises(ValueError, match="head_dim"):
        build_llama({**base, "head_dim": 32})


def test_unknown_pretrained_name_lists_the_known_ones():
    with pytest.raises(FileNotFoundError, match="smollm2-135m-instruct"):
        load_pretrained("no-such-model")
