"""Real all-MiniLM-L6-v2 (HF BERT directory) imported into mmformer equals transformers' ``BertModel``;
its sentence embedding is the model card's mean pooling + L2 norm."""

import pytest
import torch
import torch.nn.functional as F
import transformers

from mmformer.models.pretrained import load_pretrained, resolve_pretrained  # noqa: E402

TEXTS = [
    "In the beginning God created the heaven and the earth.",
    "A cat sat on the mat.",
    "A kitten is sitting on a rug.",
    "Ünïcode, 中文 and 🙂 with\ttabs   and spaces",
]


@pytest.fixture(scope="module")
def minilm():
    path = resolve_pretrained(
        "all-minilm-l6-v2"
    )  # `make install` installs it; else the error names the command
    p = load_pretrained(path)
    p.model.eval()
    ref = transformers.BertModel.from_pretrained(path, add_pooling_layer=False).eval()
    ref_tok = transformers.AutoTokenizer.from_pretrained(path)
    return p, ref, ref_tok


def _batch(tok, texts):
    return tok.pad_batch(tok.encode_batch(texts, bos=True, eos=True))


@pytest.mark.slow
def test_wordpiece_ids_match_transformers(minilm):
    p, _, ref_tok = minilm
    ids, valid = _batch(p.tokenizer, TEXTS)
    want = ref_tok(TEXTS, padding=True, return_tensors="pt")
    assert torch.equal(ids, want.input_ids)
    assert torch.equal(valid, want.attention_mask.bool())


def test_hidden_states_match_bert_model(minilm):
    p, ref, _ = minilm
    ids, valid = _batch(p.tokenizer, TEXTS)
    types = torch.zeros_like(ids)
    types[:, 5:] = 1  # token types are embedded as BERT does
    with torch.no_grad():
        hidden, _ = p.model.encode("text", ids, valid=valid, token_type=types)
        want = ref(input_ids=ids, attention_mask=valid.long(), token_type_ids=types).last_hidden_state
    assert ((hidden - want).abs() * valid[..., None]).max() <= 1e-5


@pytest.mark.slow
def test_sentence_embedding_matches_mean_pool_l2(minilm):
    p, ref, _ = minilm
    ids, valid = _batch(p.tokenizer, TEXTS)
    with torch.no_grad():
        got = p.model(ids, "text", "embedding", valid=valid)
        h = ref(input_ids=ids, attention_mask=valid.long()).last_hidden_state
    m = valid[..., None].float()
    want = F.normalize((h * m).sum(1) / m.sum(1), dim=-1)  # the model card's recipe
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5)
    sim = got @ got.T
    assert sim[1, 2] > sim[1, 0] + 0.3  # two sentences about a cat on a mat are the nearest pair


@pytest.mark.slow
def test_padding_changes_nothing(minilm):
    p, _, _ = minilm
    ids, valid = _batch(p.tokenizer, TEXTS)
    with torch.no_grad():
        batched = p.model(ids, "text", "embedding", valid=valid)
        for i, t in enumerate(TEXTS):
            one, v = _batch(p.tokenizer, [t])
            torch.testing.assert_close(
                p.model(one, "text", "embedding", valid=v)[0], batched[i], rtol=0, atol=1e-6
            )
