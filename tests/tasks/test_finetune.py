"""Fine-tuning pretrained weights from a recipe: a tiny Llama written as an HF directory stands in for
SmolLM2 (same code path as the real GGUF, which tests/models covers), trained full and with LoRA,
then exported back to HF and generated from."""

import json

import pytest
import torch

from mmformer.cli import main
from mmformer.models.pretrained.llama import build_llama, save_hf_llama
from mmformer.tokenizers.text import TextTokenizer
from tests.conftest import TINY_LLAMA

VERSES = [
    f"And the {w} said unto the {v}, Let there be light: and there was light." for w in "ab" for v in "cdef"
]

RECIPE = """\
name: tiny_ft
model:
  tokenizers: {{text: {{kind: pretrained, source: {src}, freeze: {freeze}}}}}
  backbone: {{kind: pretrained, source: {src}, freeze_layers: {freeze_layers}}}
  heads: {{lm: {{kind: pretrained, source: {src}}}}}
{lora}
tasks:
  corpus:
    kind: causal_lm
    tokenizer: text
    head: lm
    data: {{kind: text, root: {root}, seq_len: 16, batch_size: 2, val_fraction: 0.25}}
optim: {{lr: 1e-2, warmup_steps: 0, weight_decay: 0.0}}
trainer: {{max_steps: 3, accelerator: cpu, devices: 1, log_every_n_steps: 1, enable_progress_bar: false,
          num_sanity_val_steps: 0, validate_first: true, limit_val_batches: 2}}
logger: {{mode: disabled}}
"""


@pytest.fixture
def pretrained_dir(workdir):
    tok = TextTokenizer.train(VERSES * 4, vocab_size=300)
    tok.chat_template = "{% for m in messages %}<|bos|>{{ m['content'] }}<|eos|>{% endfor %}"
    config = {**TINY_LLAMA, "vocab_size": tok.vocab_size}
    torch.manual_seed(0)
    return save_hf_llama(build_llama(config), config, workdir / "tiny-llama", tok)


def _train(workdir, src, capsys, lora="", freeze="false", freeze_layers=0):
    (workdir / "corpus.txt").write_text("\n\n".join(VERSES) + "\n")
    recipe = workdir / "ft.yaml"
    recipe.write_text(
        RECIPE.format(
            src=src, root=workdir / "corpus.txt", lora=lora, freeze=freeze, freeze_layers=freeze_layers
        )
    )
    assert main(["train", str(recipe)]) == 0
    out = capsys.readouterr()
    assert "before training: val/corpus/loss" in out.out + out.err
    run = out.out.split("run folder: ")[1].split()[0]
    return sorted((workdir / run / "checkpoints").glob("last*.ckpt"))[0]


def _weights(ckpt):
    return {k.removeprefix("model."): v for k, v in torch.load(ckpt, weights_only=True)["state_dict"].items()}


def test_lora_recipe_trains_only_adapters_and_exports_merged(workdir, pretrained_dir, capsys):
    from safetensors.torch import load_file

    ckpt = _train(workdir, pretrained_dir, capsys, lora="  lora: {rank: 4, alpha: 8}")
    sd = _weights(ckpt)
    base = load_file(str(pretrained_dir / "model.safetensors"))
    # the pretrained weights are untouched; the adapters moved
    assert torch.equal(
        sd["backbone.blocks.0.attn.qkv.base.weight"][:32], base["model.layers.0.self_attn.q_proj.weight"]
    )
    assert torch.equal(sd["tokenizers.text.embed.weight"], base["model.embed_tokens.weight"])
    assert sd["backbone.blocks.1.mlp.fc2.lora_B.weight"].abs().sum() > 0

    import transformers

    out = workdir / "exported"
    assert main(["export", str(ckpt), str(out)]) == 0
    assert json.loads((out / "config.json").read_text())["architectures"] == ["LlamaForCausalLM"]
    hf = transformers.LlamaForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    from mmformer.commands.generate import _generation_model

    model, tok, _, _ = _generation_model(ckpt)  # the unmerged adapter model
    ids = torch.tensor([tok.encode(VERSES[0])])
    with torch.no_grad():
        torch.testing.assert_close(hf(ids).logits, model(ids, "text", "lm"), rtol=1e-5, atol=1e-5)


def test_full_finetune_with_frozen_embeddings_and_first_block(workdir, pretrained_dir, capsys):
    from safetensors.torch import load_file

    ckpt = _train(workdir, pretrained_dir, capsys, freeze="true", freeze_layers=1)
    sd, base = _weights(ckpt), load_file(str(pretrained_dir / "model.safetensors"))
    assert torch.equal(sd["tokenizers.text.embed.weight"], base["model.embed_tokens.weight"])
    assert torch.equal(sd["backbone.blocks.0.mlp.fc2.weight"], base["model.layers.0.mlp.down_proj.weight"])
    assert not torch.equal(
        sd["backbone.blocks.1.mlp.fc2.weight"], base["model.layers.1.mlp.down_proj.weight"]
    )

    import shutil

    shutil.rmtree(pretrained_dir)  # the checkpoint stands alone: architecture and tokenizer travel inside
    assert main(["generate", str(ckpt), "--prompt", "And the", "--max-new-tokens", "4"]) == 0
    assert main(["generate", str(ckpt), "--chat", "--prompt", "light", "--max-new-tokens", "4"]) == 0
    assert capsys.readouterr().out.count("---") == 2


def test_lora_needs_a_pretrained_backbone_and_a_pretrained_head_needs_its_tokenizer(workdir, pretrained_dir):
    from mmformer.build import build_model
    from mmformer.recipe import RecipeError, recipe_from_yaml

    (workdir / "corpus.txt").write_text("\n\n".join(VERSES) + "\n")
    text = RECIPE.format(
        src=pretrained_dir, root=workdir / "corpus.txt", lora="", freeze="false", freeze_layers=0
    )
    mixed = text.replace(
        f"{{text: {{kind: pretrained, source: {pretrained_dir}, freeze: false}}}}",
        "{text: {kind: bpe, vocab_size: 300}}",
    )
    with pytest.raises(RecipeError, match="its own vocabulary"):
        build_model(recipe_from_yaml(mixed))
    spelled = text.replace(
        f"source: {pretrained_dir}, freeze_layers", f"source: {pretrained_dir}/, freeze_layers"
    )
    model = build_model(recipe_from_yaml(spelled))  # the same files spelled twice: loaded once, still tied
    assert model.heads["lm"].head.weight is model.tokenizers["text"].embed.weight


def test_generate_refuses_chat_without_a_template(workdir, pretrained_dir, capsys):
    (pretrained_dir / "tokenizer_config.json").write_text(
        json.dumps({"bos_token": "<|bos|>", "eos_token": "<|eos|>"})
    )
    assert main(["generate", str(pretrained_dir), "--chat", "--prompt", "hi"]) == 2
    assert "no chat template" in capsys.readouterr().err
