"""Hub-ready exports: each exported directory loads with the reference library's own loader (timm's
``local-dir:``, transformers' ``from_pretrained``) and gives mmformer's outputs; timm exports go through
timm's ``save_for_hf``; the inverse key maps come from the importers' maps; a model card (README.md)
with Hub front matter and the run's measured metrics is written beside every export."""

from __future__ import annotations

import csv
import json

import pytest
import timm
import torch
import transformers  # the parity reference: the dev extra, which make test installs
import yaml

from mmformer.cli import main
from mmformer.model_card import ExportInfo, checkpoint_facts, render_card
from mmformer.models import AttentionConfig, ClassifierHead, MultimodalModel, build_backbone
from mmformer.models.backbone_config import BlockConfig, MlpConfig
from mmformer.models.pretrained import llama
from mmformer.models.pretrained.bert import build_bert, load_hf_bert
from mmformer.models.pretrained.hf_export import (
    bert_config,
    invert_key_map,
    save_hf_bert,
)
from mmformer.models.pretrained.timm_export import save_timm_vit, vit_config
from mmformer.tokenizers import ViTPatchTokenizer
from mmformer.tokenizers.text import TextEmbedding, TextTokenizer
from tests.conftest import TINY_LLAMA

TINY_BERT = dict(
    vocab_size=61,
    hidden_size=32,
    num_hidden_layers=2,
    num_attention_heads=4,
    intermediate_size=48,
    max_position_embeddings=16,
    type_vocab_size=2,
    layer_norm_eps=1e-12,
)


def _randomise(model, seed=0):
    """Every parameter moved off its (often zero / one) initial value, so a swapped tensor shows."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.2)
    return model.eval()


def _front_matter(readme) -> dict:
    text = readme.read_text()
    assert text.startswith("---\n")
    return yaml.safe_load(text.split("---\n")[1])


def _ids(vocab, lengths=(9, 6)):
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(3, vocab, (len(lengths), max(lengths)), generator=g)
    valid = torch.arange(max(lengths))[None] < torch.tensor(lengths)[:, None]  # right padding, as BERT
    return ids, valid


# ------------------------------------------------------------------------------------------- timm
def _vit(in_chans=3):
    torch.manual_seed(0)
    return _randomise(
        MultimodalModel(
            {"image": ViTPatchTokenizer(48, 32, 8, in_chans, mean=(0.5,) * in_chans, std=(0.25,) * in_chans)},
            build_backbone(48, 2, AttentionConfig(3)),
            {"cls": ClassifierHead(48, 6)},
        )
    )


def test_timm_export_goes_through_save_for_hf_and_timm_loads_it_with_equal_logits(tmp_path, monkeypatch):
    calls = []
    real = timm.models.save_for_hf
    monkeypatch.setattr(timm.models, "save_for_hf", lambda *a, **k: calls.append(k) or real(*a, **k))
    ours = _vit()
    out = save_timm_vit(ours, vit_config(ours), tmp_path / "vit")
    assert len(calls) == 1 and calls[0]["safe_serialization"] is True
    cfg = json.loads((out / "config.json").read_text())
    # timm's exporter's marks; none of the registered name's own weights' facts (tag, license)
    assert cfg["pretrained_cfg"]["custom_load"] is False
    assert not {"tag", "license", "hf_hub_id"} & set(cfg["pretrained_cfg"])
    assert cfg["pretrained_cfg"]["mean"] == [0.5] * 3 and cfg["num_classes"] == 6
    ref = timm.create_model(f"local-dir:{out}", pretrained=True).eval()
    x = torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():  # float pixels are taken as normalised, by both
        torch.testing.assert_close(ours(x, "image", "cls"), ref(x), rtol=0, atol=1e-5)
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors"]
    # push_to_hf_hub(model loaded from the export) runs save_for_hf into the folder it uploads: the same
    # config and tensors come out again
    real(ref, tmp_path / "pushed", safe_serialization=True)
    pushed = json.loads((tmp_path / "pushed" / "config.json").read_text())
    pc = pushed.pop("pretrained_cfg")
    assert pushed == {k: v for k, v in cfg.items() if k != "pretrained_cfg"}
    assert {k: v for k, v in pc.items() if v is not None} == cfg["pretrained_cfg"]  # + pool_size: null
    from safetensors.torch import load_file

    again, first = load_file(tmp_path / "pushed" / "model.safetensors"), load_file(out / "model.safetensors")
    assert sorted(again) == sorted(first) and all(torch.equal(again[k], first[k]) for k in first)


# ------------------------------------------------------------------------------------------- BERT
def _bert_without_token_types():
    """A BERT-layout encoder as a recipe trains one from scratch (``block: post``, learned positions, an
    embedding LayerNorm) but without token types: the export adds BERT's one all-zero type row."""
    torch.manual_seed(0)
    return MultimodalModel(
        {"text": TextEmbedding(61, 32, max_len=16, norm=True, norm_eps=1e-12)},
        build_backbone(
            32,
            2,
            AttentionConfig(4),
            mlp=MlpConfig(hidden=48, act="gelu"),
            block=BlockConfig("post"),
            norm_eps=1e-12,
            final_norm=False,
        ),
        {},
    )


@pytest.mark.parametrize("variant", ["imported_bert", "no_token_types"])
def test_bert_export_loads_in_transformers_with_equal_hidden_states(tmp_path, variant):
    ours = build_bert(TINY_BERT) if variant == "imported_bert" else _bert_without_token_types()
    _randomise(ours)
    config = bert_config(ours)
    out = save_hf_bert(ours, config, tmp_path / "bert")
    ref = transformers.BertModel.from_pretrained(out, add_pooling_layer=False).eval()
    ids, valid = _ids(61)
    types = torch.zeros_like(ids)
    if variant == "imported_bert":
        types[:, 4:] = 1
    with torch.no_grad():
        kwargs = {"token_type": types} if variant == "imported_bert" else {}
        hidden, _ = ours.encode("text", ids, valid=valid, **kwargs)
        want = ref(input_ids=ids, attention_mask=valid.long(), token_type_ids=types).last_hidden_state
    assert ((hidden - want).abs() * valid[..., None]).max() <= 1e-5
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors"]  # no tokenizer given


def test_bert_export_reimports_with_its_tokenizer(tmp_path):
    tok = TextTokenizer.train(["in the beginning was the word"] * 40, vocab_size=280)
    ours = _randomise(build_bert({**TINY_BERT, "vocab_size": tok.vocab_size}))
    out = save_hf_bert(ours, bert_config(ours), tmp_path / "bert", tok)
    back, back_tok, _ = load_hf_bert(out)
    assert back_tok.encode("the word") == tok.encode("the word")
    for (k, a), (k2, b) in zip(ours.state_dict().items(), back.state_dict().items(), strict=True):
        assert k == k2 and torch.equal(a, b), k
    tc = json.loads((out / "tokenizer_config.json").read_text())
    assert (tc["cls_token"], tc["sep_token"], tc["pad_token"]) == ("<|bos|>", "<|eos|>", "<|pad|>")


def test_bert_export_names_what_bert_cannot_express():
    pre_norm = MultimodalModel(
        {"text": TextEmbedding(61, 32, max_len=16, norm=True)}, build_backbone(32, 2, AttentionConfig(4)), {}
    )
    with pytest.raises(ValueError, match="post-norm blocks"):
        bert_config(pre_norm)
    with pytest.raises(ValueError, match="not BERT-shaped"):
        bert_config(llama.build_llama(TINY_LLAMA))


# ------------------------------------------------------------------------------ one source of truth
def test_inverting_the_llama_import_map_gives_the_llama_export():
    """The generic inversion of ``llama.hf_to_mmformer`` writes exactly what the Llama exporter writes:
    the importers' maps are the one table of names."""
    config = {**TINY_LLAMA, "tie_word_embeddings": False}
    ours = _randomise(llama.build_llama(config))
    with torch.device("meta"):
        ref = transformers.LlamaForCausalLM(transformers.LlamaConfig(**config))
    shapes = {k: tuple(v.shape) for k, v in ref.state_dict().items()}
    got, unread = invert_key_map(llama.hf_to_mmformer, shapes, config, ours.state_dict())
    want = llama.mmformer_to_hf(ours, config)
    assert unread == [] and sorted(got) == sorted(want)
    for k in want:
        assert torch.equal(got[k], want[k]), k


def test_inversion_refuses_a_map_that_does_more_than_move_rows():
    square = {"a": (3, 3)}
    with pytest.raises(ValueError, match="more than rename"):  # a transpose of a square matrix
        invert_key_map(lambda sd, c: {"w": sd["a"].T}, square, {}, {"w": torch.randn(3, 3)})
    for arithmetic in (lambda sd, c: {"w": sd["a"] * 2}, lambda sd, c: {"w": sd["a"] * 0}):
        with pytest.raises(ValueError, match="more than rename|in part|round-trip"):
            invert_key_map(arithmetic, {**square, "b": (3, 3)}, {}, {"w": torch.randn(3, 3)})
    flip = lambda sd, c: {"w": sd["a"].flip(0)}  # noqa: E731  a row permutation is a move
    got, unread = invert_key_map(flip, {**square, "b": (2,)}, {}, {"w": torch.eye(3)})
    assert torch.equal(got["a"], torch.eye(3).flip(0)) and unread == ["b"]
    with pytest.raises(ValueError, match="has no 'w'"):
        invert_key_map(lambda sd, c: {"w": sd["a"]}, {"a": (2,)}, {}, {})


# ------------------------------------------------------------------------------------- model cards
def _run_folder(tmp_path, rows, global_step, monitor="val/toy/acc"):
    """A run folder as training leaves it: metrics.csv (train rows and validation rows) and a
    checkpoint's state (recipe YAML, step, ModelCheckpoint's state keyed by its mode)."""
    run = tmp_path / "runs" / "tiny" / "20260101-000000-abcd"
    (run / "checkpoints").mkdir(parents=True)
    names = ["epoch", "step", "train/loss", "val/toy/acc", "val/toy/loss"]
    with open(run / "metrics.csv", "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(names)
        for step, acc, loss in rows:
            w.writerow([0, step, 0.5, "", ""])
            w.writerow([0, step, "", acc, loss])
    recipe = {
        "name": "tiny",
        "seed": 0,
        "model": {
            "tokenizers": {"image": {"kind": "vit_patch", "image_size": 28}},
            "backbone": {"d_model": 32, "n_layers": 2, "n_heads": 2},
            "heads": {"cls": {"kind": "classifier", "num_classes": 2}},
        },
        "tasks": {"toy": {"kind": "classification", "data": {"kind": "image_folder", "root": "mnist5k"}}},
        "optim": {"lr": 0.003},
        "trainer": {"max_epochs": 2},
    }
    state = {
        "global_step": global_step,
        "epoch": 0,
        "mmformer": {"recipe_yaml": yaml.safe_dump(recipe), "pretrained": {}},
        "callbacks": {
            f"ModelCheckpoint{{'monitor': '{monitor}', 'mode': 'max'}}": {"monitor": monitor},
        },
    }
    return run / "checkpoints" / f"best-step{global_step:06d}.ckpt", state


def test_card_front_matter_parses_and_names_the_metrics_measured_for_these_weights(tmp_path):
    rows = [(3, 0.75, 0.61), (7, 0.875, 0.42), (11, 0.8125, 0.40)]
    path, state = _run_folder(tmp_path, rows, global_step=8)  # the checkpoint of the step-7 validation
    facts = checkpoint_facts(path, state, {"toy": "image"})
    info = ExportInfo("timm", "image-classification", "the ViT", "import timm", 1234, "apache-2.0")
    readme = tmp_path / "README.md"
    readme.write_text(render_card(facts, info))
    meta = _front_matter(readme)
    assert (meta["library_name"], meta["license"], meta["datasets"]) == ("timm", "apache-2.0", ["mnist5k"])
    assert {"mmformer", "timm", "classification"} <= set(meta["tags"])
    assert meta["metrics"] == ["accuracy", "loss"]
    (result,) = meta["model-index"][0]["results"]
    assert result["task"] == {"type": "image-classification", "name": "toy"}
    assert {m["name"]: m["value"] for m in result["metrics"]} == {"val/toy/acc": 0.875, "val/toy/loss": 0.42}
    text = readme.read_text()
    assert "| metric | these weights (step 7) | best (step 7) | last (step 11) |" in text
    assert "| `val/toy/loss` | 0.42 | 0.42 | 0.4 |" in text
    assert "5,000 real MNIST digits" in text  # the bundled dataset's description
    assert "## Intended use and limitations" in text and "1,234" in text


def test_card_without_a_metrics_file_uses_the_checkpoint_callbacks_score(tmp_path):
    path, state = _run_folder(tmp_path, [(3, 0.5, 0.7)], global_step=4)
    (path.parent.parent / "metrics.csv").unlink()
    key = next(iter(state["callbacks"]))
    state["callbacks"][key]["current_score"] = torch.tensor(0.625)
    facts = checkpoint_facts(path, state)
    assert facts.metrics.this == {"val/toy/acc": 0.625} and facts.metrics.this_step == 4
    meta = yaml.safe_load(render_card(facts, ExportInfo("safetensors", None, "x", "y")).split("---\n")[1])
    assert "library_name" not in meta and meta["license"] == "other"
    assert meta["model-index"][0]["results"][0]["metrics"][0]["value"] == 0.625


# ------------------------------------------------------------------------- the export command (CLI)
def _tiny_llama_dir(tmp_path):
    tok = TextTokenizer.train(["in the beginning was the word"] * 40, vocab_size=280)
    config = {**TINY_LLAMA, "vocab_size": tok.vocab_size}
    ours = _randomise(llama.build_llama(config))
    return llama.save_hf_llama(ours, llama.llama_config(ours), tmp_path / "src_llama", tok), ours


def test_cli_exports_an_hf_llama_with_a_card_that_transformers_loads(tmp_path, capsys):
    src, ours = _tiny_llama_dir(tmp_path)
    out = tmp_path / "llama"
    assert main(["export", str(src), str(out), "--license", "apache-2.0", "--repo-id", "me/tiny"]) == 0
    ref = transformers.LlamaForCausalLM.from_pretrained(out).eval()
    ids, valid = _ids(ours.tokenizers["text"].embed.num_embeddings, lengths=(9, 9))
    with torch.no_grad():
        want = ref(input_ids=ids).logits
        got = ours(ids, "text", "lm", valid=valid)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5)
    meta = _front_matter(out / "README.md")
    assert (meta["library_name"], meta["pipeline_tag"], meta["license"]) == (
        "transformers",
        "text-generation",
        "apache-2.0",
    )
    card = (out / "README.md").read_text()
    assert 'AutoModelForCausalLM.from_pretrained("me/tiny")' in card
    assert "No validation metrics were recorded" in card  # pretrained weights: no run, no numbers
    assert "wrote the model card" in capsys.readouterr().out


def test_cli_auto_exports_a_bert_directory_as_bert_with_a_card(tmp_path):
    tok = TextTokenizer.train(["in the beginning was the word"] * 40, vocab_size=280)
    ours = _randomise(build_bert({**TINY_BERT, "vocab_size": tok.vocab_size}))
    src = save_hf_bert(ours, bert_config(ours), tmp_path / "src_bert", tok)
    out = tmp_path / "bert"
    assert main(["export", str(src), str(out)]) == 0  # auto: not Llama-shaped, BERT-shaped
    ref = transformers.BertModel.from_pretrained(out, add_pooling_layer=False).eval()
    ids, valid = _ids(tok.vocab_size)
    with torch.no_grad():
        hidden, _ = ours.encode("text", ids, valid=valid)
        want = ref(input_ids=ids, attention_mask=valid.long()).last_hidden_state
    assert ((hidden - want).abs() * valid[..., None]).max() <= 1e-5
    meta = _front_matter(out / "README.md")
    assert (meta["library_name"], meta["pipeline_tag"]) == ("transformers", "feature-extraction")
    card = (out / "README.md").read_text()
    assert "not exported: the heads `embedding`" in card and "add_pooling_layer=False" in card
    assert "F.normalize" not in card and "normalize((hidden * mask)" in card  # the mean-pool recipe


def test_cli_refuses_llama_format_for_a_bert(tmp_path, capsys):
    tok = TextTokenizer.train(["a b c"] * 20, vocab_size=270)
    ours = _randomise(build_bert({**TINY_BERT, "vocab_size": tok.vocab_size}))
    src = save_hf_bert(ours, bert_config(ours), tmp_path / "src_bert", tok)
    assert main(["export", str(src), str(tmp_path / "x"), "--format", "llama"]) != 0
    assert "not Llama-shaped" in capsys.readouterr().err


@pytest.mark.slow
def test_a_trained_run_exports_to_timm_with_its_measured_metrics_in_the_card(tiny_recipe, workdir, capsys):
    """Train the tiny recipe, export its best checkpoint (auto: timm) and its last one (safetensors):
    timm loads the directory with mmformer's logits; the cards carry the run's metrics.csv values."""
    from mmformer.evaluation import load_checkpoint

    assert main(["train", str(tiny_recipe)]) == 0
    ckpts = workdir / "runs" / "tiny"
    (run,) = list(ckpts.iterdir())
    best = next((run / "checkpoints").glob("best-*.ckpt"))
    out = workdir / "export"
    assert main(["export", str(best), str(out)]) == 0
    loaded, task = load_checkpoint(best, "classification")
    ref = timm.create_model(f"local-dir:{out}", pretrained=True).eval()
    x = torch.randn(3, 1, 28, 28, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(loaded.model(x, "image", "cls"), ref(x), rtol=0, atol=1e-5)

    step = torch.load(best, weights_only=True, map_location="cpu")["global_step"]
    with open(run / "metrics.csv", newline="") as f:
        val = [r for r in csv.DictReader(f) if r.get("val/toy/acc") and int(r["step"]) < step][-1]
    meta = _front_matter(out / "README.md")
    values = {m["name"]: m["value"] for m in meta["model-index"][0]["results"][0]["metrics"]}
    assert values["val/toy/acc"] == pytest.approx(float(val["val/toy/acc"]))
    assert values["val/toy/loss"] == pytest.approx(float(val["val/toy/loss"]))
    assert meta["library_name"] == "timm" and "accuracy" in meta["metrics"]

    flat = workdir / "weights.safetensors"
    assert main(["export", str(run / "checkpoints" / "last.ckpt"), str(flat), "--format", "safetensors"]) == 0
    assert _front_matter(workdir / "weights.md")["model-index"][0]["name"] == "tiny"
