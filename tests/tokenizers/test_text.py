"""Byte-level BPE: lossless round trips for any Unicode, special tokens as single ids, pad never eos;
the text embedding's positions and limits."""

import pytest
import torch

from mmformer.tokenizers import SPECIAL_TOKENS, TextEmbedding, TextTokenizer

CORPUS = [
    "In the beginning God created the heaven and the earth.",
    "And the earth was without form, and void; and darkness was upon the face of the deep.",
    "And God said, Let there be light: and there was light.",
] * 20


@pytest.fixture(scope="module")
def tok():
    return TextTokenizer.train(CORPUS, vocab_size=400, min_frequency=2)


@pytest.mark.parametrize(
    "text",
    [
        "",
        " ",
        "a  b   c    d",
        "          ten spaces",
        "trailing spaces   ",
        "tabs\tand\t\tnewlines\n\n\nend\r\n",
        "emoji 😀🙏🏽👩‍👩‍👧 and flags 🇫🇷",
        "中文字符和日本語のテキスト",
        "accents: café naïve Ångström Ωmega",
        "mixed <image> placeholders <audio> in text",
        "<image><image>",
        "unknown-to-training bytes: \x00\x01 \u200b zero width",
        "Let there be light",
    ],
)
def test_decode_encode_is_lossless(tok, text):
    assert tok.decode(tok.encode(text)) == text


def test_special_tokens_are_single_ids(tok):
    ids = tok.encode("a <image> b <audio> c", bos=True, eos=True)
    assert ids[0] == tok.bos_id and ids[-1] == tok.eos_id
    assert ids.count(tok.image_id) == 1 and ids.count(tok.audio_id) == 1
    assert len({tok.bos_id, tok.eos_id, tok.pad_id, tok.image_id, tok.audio_id}) == 5
    assert tok.decode(tok.encode("x <image> y"), skip_special=True) == "x  y"


def test_training_learns_merges(tok):
    assert 300 < tok.vocab_size <= 400
    assert len(tok.encode("And God said, Let there be light")) < len("And God said, Let there be light") / 2


def test_pad_is_never_eos_even_when_the_user_tokenizer_says_so(tok, tmp_path):
    path = tmp_path / "tokenizer.json"
    tok.save(path)
    user = TextTokenizer.from_file(path, special={"pad": SPECIAL_TOKENS["eos"]})
    assert user.pad_id != user.eos_id
    assert user.decode(user.encode("same <image> text")) == "same <image> text"
    again = TextTokenizer.from_json(user.to_json())
    assert again.encode("light") == tok.encode("light")


def test_missing_tokenizer_file(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        TextTokenizer.from_file(tmp_path / "nope.json")


def test_pad_batch_left_and_right(tok):
    seqs = [tok.encode("light"), tok.encode("And God said")]
    ids, valid = tok.pad_batch(seqs, side="left")
    n = ids.shape[1]
    assert valid[0].tolist() == [False] * (n - len(seqs[0])) + [True] * len(seqs[0])
    assert ids[0, 0] == tok.pad_id and ids[0, -len(seqs[0]) :].tolist() == seqs[0]
    ids, valid = tok.pad_batch(seqs)
    assert ids[0, : len(seqs[0])].tolist() == seqs[0] and not valid[0, -1]


def test_text_embedding_positions_count_from_the_first_real_token():
    emb = TextEmbedding(50, 8, max_len=16)
    ids = torch.tensor([[0, 0, 5, 6], [5, 6, 7, 8]])
    valid = torch.tensor([[False, False, True, True], [True] * 4])
    t = emb(ids, valid)
    assert t.positions[0, 2:, 0].tolist() == [0, 1] and t.positions[1, :, 0].tolist() == [0, 1, 2, 3]
    torch.testing.assert_close(t.x[0, 2], emb.embed.weight[5] + emb.pos_embed.weight[0])
    assert (t.modality == 0).all()
    with pytest.raises(ValueError, match="beyond max_len=16"):
        emb(torch.zeros(1, 17, dtype=torch.long))
    padded = torch.zeros(2, 17, dtype=torch.long), torch.arange(17).expand(2, -1) > 0  # 16 real ids
    assert emb(*padded).positions[..., 0].max() == 15  # a batch longer than max_len whose ids fit
    with pytest.raises(ValueError, match="position 16 is beyond max_len=16"):
        emb(torch.zeros(1, 4, dtype=torch.long), positions=torch.tensor([[[0], [1], [2], [16]]]))


def test_text_embedding_reads_no_device_data_when_the_length_proves_positions_fit():
    """No host sync per step on a GPU: with positions it counts itself and a sequence no longer than
    max_len, the forward traces whole (dynamo's fullgraph fails on any read of a tensor's value)."""
    emb = TextEmbedding(50, 8, max_len=16)
    ids, valid = (
        torch.tensor([[0, 0, 5, 6], [5, 6, 7, 8]]),
        torch.tensor([[False, False, True, True], [True] * 4]),
    )
    traced = torch.compile(lambda i, v: emb(i, v).x, backend="eager", fullgraph=True)
    torch.testing.assert_close(traced(ids, valid), emb(ids, valid).x)


def test_class_token_comes_first_at_position_zero_and_padding_changes_nothing():
    emb = TextEmbedding(50, 8, max_len=5, class_token=True)
    assert emb.num_prefix_tokens == 1 and "cls_token" in emb.no_weight_decay()
    ids = torch.tensor([[0, 0, 5, 6], [5, 6, 7, 8]])
    valid = torch.tensor([[False, False, True, True], [True] * 4])
    t = emb(ids, valid)  # (2, 5): the class token, then the ids
    assert (
        t.x.shape == (2, 5, 8)
        and t.valid[:, 0].all()
        and t.valid[0].tolist() == [True, False, False, True, True]
    )
    assert t.positions[0, [0, 3, 4], 0].tolist() == [0, 1, 2]
    assert t.positions[1, :, 0].tolist() == [0, 1, 2, 3, 4]
    torch.testing.assert_close(t.x[:, 0], (emb.cls_token[0, 0] + emb.pos_embed.weight[0]).expand(2, -1))
    alone = emb(torch.tensor([[5, 6]]))  # the left-padded row without its padding: the same tokens
    torch.testing.assert_close(t.x[0, [0, 3, 4]], alone.x[0])
    assert emb.example_input().shape == (1, 4)  # the most ids that fit max_len with the class token
    with pytest.raises(ValueError, match="beyond max_len=5"):
        emb(torch.zeros(1, 5, dtype=torch.long))
    with pytest.raises(ValueError, match="neither positions nor document"):
        emb(ids, positions=torch.zeros(2, 4, 1, dtype=torch.long))
