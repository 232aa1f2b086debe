"""Choosing an attention kernel from a recipe: registered kernels (``mmformer.nn.kernels``) take their
options by name, and a kernel that lacks a mask rule or the score bias the recipe needs is refused at
load, naming the kernels that have it."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from mmformer.nn import Attention, MaskSpec
from mmformer.nn.kernels import KERNEL_CLASSES, supporting
from mmformer.recipe import RecipeError, load_recipe, recipe_from_yaml
from tests.multitask.test_joint_training import JOINT

LISTOPS = (
    Path(__file__).resolve().parents[1] / "recipes" / "long_context" / "lra_listops.yaml"
)  # a classifier


def _joint(**kw) -> str:
    return JOINT.format(images="/nonexistent/images", corpus="/nonexistent/corpus.txt", **kw)


def test_a_kernel_without_the_masks_the_recipe_needs_is_refused_at_load():
    # the joint recipe's backbone is causal with images bidirectional: causal + spans
    with pytest.raises(RecipeError) as e:
        recipe_from_yaml(_joint(), ["model.backbone.attn_kernel=lsh"])
    msg = str(e.value)
    assert "'model.backbone.attn_kernel': lsh does not implement documents, spans masks" in msg
    assert "kernels that do: eager, sdpa, flex (tasks.corpus.data: pack: true puts several documents" in msg
    recipe_from_yaml(_joint(), ["model.backbone.attn_kernel=flex"])  # softmax kernels implement every rule


def test_kernel_options_are_checked_by_name():
    text = _joint().replace("causal: true, bidirectional: [image]", "causal: true")
    unpacked = ["tasks.corpus.data.pack=false"]  # each document alone: no documents masks
    ok = recipe_from_yaml(
        text, ["model.backbone.attn_kernel=lsh", "model.backbone.kernel_options={n_buckets: 8}", *unpacked]
    )
    assert dict(ok.model.backbone.kernel_options) == {"n_buckets": 8}
    with pytest.raises(
        RecipeError, match="no option .num_buckets. .it takes [^)]*.. Did you mean .n_buckets."
    ):
        recipe_from_yaml(
            text,
            ["model.backbone.attn_kernel=lsh", "model.backbone.kernel_options={num_buckets: 8}", *unpacked],
        )
    with pytest.raises(RecipeError, match="positions alibi"):
        recipe_from_yaml(
            text, ["model.backbone.attn_kernel=lsh", "model.backbone.positions=alibi", *unpacked]
        )


def test_kernel_option_values_and_needs_are_refused_at_load_naming_the_fix():
    """Values a kernel's constructor refuses, an option that needs a mask the recipe does not use, and
    the papers' names for kernels: one-line recipe errors at load, never a traceback at the first step."""

    def refused(*overrides: str) -> str:
        with pytest.raises(RecipeError) as e:
            load_recipe(LISTOPS, list(overrides))
        return str(e.value)

    assert "n_buckets must be 1 or a positive even number" in refused(
        "model.backbone.attn_kernel=lsh", "model.backbone.kernel_options={n_buckets: 3}"
    )
    assert "kernel 'aft_full' needs the option 'max_len'" in refused("model.backbone.attn_kernel=aft_full")
    gate = ["model.backbone.attn_kernel=rfa", "model.backbone.kernel_options={gate: true}"]
    assert refused(*gate) == (
        "'model.backbone.kernel_options': rfa with {'gate': True} needs causal attention, which this recipe "
        "does not use (set model.backbone.causal: true, or drop the option)"
    )
    load_recipe(LISTOPS, [*gate, "model.backbone.causal=true"])  # RFA-Gate in a causal backbone
    assert "its random feature count is model.backbone.performer_features" in refused(
        "model.backbone.attn_kernel=performer", "model.backbone.kernel_options={n_features: 64}"
    )
    assert "Did you mean 'lsh' (the Reformer's LSH attention" in refused(
        "model.backbone.attn_kernel=Reformer"
    )
    assert "attn_kernel='LSH'. Did you mean 'lsh'?" in refused("model.backbone.attn_kernel=LSH")
    assert "A sliding window is a mask for any kernel that implements it: set window" in refused(
        "model.backbone.attn_kernel=window"
    )
    # an option of another kernel, with the kernel left at auto: which kernels take it
    assert refused("model.backbone.kernel_options={n_buckets: 8}").endswith(
        "kernel 'auto' has no option 'n_buckets' (it takes none). It is an option of lsh: set attn_kernel "
        "to one of them."
    )
    assert refused("model.backbone.attn_kernel=lsh", "model.backbone.kernel_options={n_bucket: 8}").endswith(
        "kernel 'lsh' has no option 'n_bucket' (it takes n_buckets, n_hashes, chunk_size, seed). "
        "Did you mean 'n_buckets'?"
    )
    split = refused("model.backbone.kernel_options={n_buckets:")  # `key={n_buckets: 8}` unquoted in a shell
    assert split.endswith(
        "the shell split it at a space: quote the whole override, 'model.backbone.kernel_options={n_buckets: …'"
    )


def test_every_registered_kernel_declares_what_it_implements():
    assert {"lsh", "aft_full", "aft_local", "aft_simple"} <= set(KERNEL_CLASSES)
    for name, cls in KERNEL_CLASSES.items():
        assert cls.name == name and {"padding"} <= cls.masks, name
    assert supporting(frozenset({"causal", "spans"})) == ["eager", "sdpa", "flex"]


def test_a_kernels_parameters_survive_switching_kernels_and_back():
    attn = Attention(16, 2, kernel="aft_full", kernel_options={"max_len": 8})
    with torch.no_grad():
        attn.kernel_module.pos_bias.normal_()
    x = torch.randn(1, 5, 16)
    before = attn(x, MaskSpec())
    attn.kernel = "eager"  # e.g. FLOP counting
    attn.kernel = "aft_full"
    torch.testing.assert_close(attn(x, MaskSpec()), before, rtol=0, atol=0)


RECIPES = Path(__file__).resolve().parents[1] / "recipes"


def _refused(recipe: Path, *overrides: str) -> str:
    with pytest.raises(RecipeError) as e:
        load_recipe(recipe, list(overrides))
    return str(e.value)


def test_packed_documents_need_a_kernel_with_document_masks():
    gpt = RECIPES / "text" / "gpt_mini_lm_kjv.yaml"  # data.pack: true (several documents per row)
    msg = _refused(gpt, "model.backbone.attn_kernel=lsh")
    assert "lsh does not implement documents masks, which this recipe needs (causal, documents)" in msg
    assert msg.endswith(
        "kernels that do: eager, sdpa, flex (tasks.kjv.data: pack: true puts several documents in a row, "
        "which documents masks keep apart; set pack: false to pad each document alone)"
    )
    for kernel in ("lsh", "rfa", "performer", "aft_simple"):  # each document alone: every causal kernel
        load_recipe(gpt, [f"model.backbone.attn_kernel={kernel}", "tasks.kjv.data.pack=false"])


def test_cross_attention_and_kv_cache_decoding_are_refused_for_kernels_without_them():
    encdec = RECIPES / "multimodal" / "encdec_asr_asterisk.yaml"  # block: cross, a seq2seq task
    assert _refused(encdec, "model.backbone.attn_kernel=lsh") == (
        "'model.backbone.attn_kernel': lsh is self-attention only, and block: cross attends to another "
        "sequence too; kernels that can: eager, sdpa, flex, performer, aft_full, aft_simple, rfa"
    )
    gated = _refused(encdec, "model.backbone.attn_kernel=rfa", "model.backbone.kernel_options={gate: true}")
    assert gated.startswith("'model.backbone.attn_kernel': rfa with gate: true (its gate decays along one")
    assert _refused(encdec, "model.backbone.attn_kernel=performer") == (
        "'model.backbone.attn_kernel': performer does not implement cache masks, which a seq2seq task's "
        "decoder needs: it decodes from a KV cache at every validation; kernels that do: eager, sdpa, flex"
    )
    chameleon = RECIPES / "generation" / "chameleon_mnist5k.yaml"
    assert "which a chameleon task needs: it samples from a KV cache" in _refused(
        chameleon, "model.backbone.attn_kernel=aft_simple"
    )


@pytest.mark.parametrize("kernel", ["lsh", "aft_local"])
def test_kernels_that_refuse_cross_attention_say_so(kernel):
    from mmformer.nn.kernels import attends_across, build_kernel

    options = {"lsh": {"n_buckets": 2, "chunk_size": 4}, "aft_local": {"max_len": 16, "window": 2}}[kernel]
    assert not attends_across(kernel, options)
    q, k = torch.randn(1, 2, 5, 8), torch.randn(1, 2, 9, 8)
    with pytest.raises(ValueError, match="self-attention"):
        build_kernel(kernel, 2, 8, options)(q, k, k, MaskSpec())


def test_option_types_and_settings_no_kernel_reads_are_refused_at_load():
    """A quoted "false" is a string (it would switch RFA-Gate on), ``true`` is no count, and settings a
    kernel or block never reads (attention dropout without softmax weights, ``bigbird_block: 0``,
    ``ff_chunks`` without reversible layers) are refused at load, named, never ignored."""

    def refused(*overrides: str) -> str:
        return _refused(LISTOPS, *overrides)

    rfa = "model.backbone.attn_kernel=rfa"
    assert refused(
        rfa, "model.backbone.causal=true", "model.backbone.kernel_options={gate: 'false'}"
    ).endswith("kernel 'rfa' option 'gate' must be true / false, got 'false' (str)")
    assert refused(rfa, "model.backbone.kernel_options.n_features=2.5").endswith(
        "option 'n_features' must be an integer, got 2.5 (float)"
    )
    assert refused(rfa, "model.backbone.kernel_options.sigma=abc").endswith(
        "'sigma' must be a number, got 'abc' (str)"
    )
    load_recipe(LISTOPS, [rfa, "model.backbone.kernel_options.sigma=2"])  # an integer is a number
    lsh = "model.backbone.attn_kernel=lsh"
    assert refused(lsh, "model.backbone.kernel_options.n_buckets=true").endswith("got True (bool)")
    assert refused(lsh, "model.backbone.kernel_options.seed=abc").endswith("got 'abc' (str)")
    assert "n_buckets must be 1 or a positive even number" in refused(
        lsh, "model.backbone.kernel_options.n_buckets=0"
    )
    aft_local = "model.backbone.attn_kernel=aft_local"
    assert "window=5000 is wider than max_len=4096" in refused(
        aft_local, "model.backbone.kernel_options={max_len: 4096, window: 5000}"
    )
    for kernel in ("lsh", "performer", "flex"):
        assert (
            f"attn_drop drops softmax attention weights, which attn_kernel {kernel} does not form"
            in refused(f"model.backbone.attn_kernel={kernel}", "model.backbone.attn_drop=0.1")
        )
    load_recipe(LISTOPS, ["model.backbone.attn_drop=0.1"])  # auto: sdpa
    assert refused("model.backbone.bigbird_block=0").endswith(
        "bigbird_block must be > 0, got 0 (tokens per block; null turns BigBird off)"
    )
    assert refused("model.backbone.bigbird_random=2").endswith(  # BigBird's options alone turn nothing on
        "bigbird_random set without bigbird_block, which turns BigBird on: set bigbird_block (tokens per block, "
        "e.g. 64) or leave the BigBird options out"
    )
    assert refused("model.backbone.bigbird_block=64", "model.backbone.bigbird_random=-2").endswith(
        "bigbird_random must be >= 0, got -2"
    )
    assert refused("model.backbone.performer_features=0").endswith("performer_features must be > 0, got 0")
    assert "set reversible=True" in refused("model.backbone.ff_chunks=4")
    assert "reversible layers need pre-norm blocks" in refused(
        "model.backbone.reversible=true", "model.backbone.block=post"
    )


def test_aft_position_biases_must_cover_the_tokens_every_data_kind_gives():
    """AFT-full / AFT-local hold position biases for ``max_len`` tokens: a ViT's patches and class token,
    a language model's ``seq_len`` (text, shards, Hub datasets) — refused at load when more, accepted at
    exactly enough (boundary checked by training a step in the CLI: 17 tokens for a 28-pixel image in
    7-pixel patches, 128 for ``seq_len: 128``)."""
    root = Path(__file__).resolve().parents[1] / "recipes"
    vit, gpt = root / "image" / "vit_tiny_classify_mnist5k.yaml", root / "text" / "gpt_mini_lm_kjv.yaml"

    def aft(kernel: str, max_len: int, *extra: str) -> list[str]:
        window = ", window: 4" if kernel == "aft_local" else ""
        return [
            f"model.backbone.attn_kernel={kernel}",
            f"model.backbone.kernel_options={{max_len: {max_len}{window}}}",
            *extra,
        ]

    for kernel in ("aft_full", "aft_local"):
        load_recipe(vit, aft(kernel, 17))
        with pytest.raises(RecipeError) as e:
            load_recipe(vit, aft(kernel, 16))
        assert str(e.value) == (
            "'model.backbone.kernel_options.max_len' is 16, but 'model.tokenizers.image' (28-pixel images in "
            f"7-pixel patches and its class token) gives 17 tokens per sequence: the {kernel} kernel holds "
            "position biases for max_len tokens; set max_len: 17 or more"
        )
    unpacked = "tasks.kjv.data.pack=false"
    load_recipe(gpt, aft("aft_full", 128, unpacked))
    with pytest.raises(
        RecipeError, match="is 127, but 'tasks.kjv.data.seq_len' gives 128 tokens per sequence"
    ):
        load_recipe(gpt, aft("aft_full", 127, unpacked))
    for kind in ("shards", "hf_dataset"):  # documents of seq_len tokens read from shards or the Hub
        data = f"tasks.kjv.data={{kind: {kind}, root: /nonexistent, seq_len: 64}}"
        load_recipe(gpt, aft("aft_local", 64, data))
        with pytest.raises(RecipeError, match="is 63, but 'tasks.kjv.data.seq_len' gives 64 tokens"):
            load_recipe(gpt, aft("aft_local", 63, data))


TOWERS = """\
name: towers
model:
  tokenizers:
    image: {kind: vit_patch, image_size: 28, patch_size: 7, in_chans: 1, mean: [0.5], std: [0.5]}
    text: {kind: bpe, vocab_size: 300}
  backbone: {d_model: 32, n_layers: 2, n_heads: 2, positions: rope, attn_kernel: lsh}
  towers:
    text: {d_model: 32, n_layers: 2, n_heads: 2, causal: true, positions: rope}
  heads: {digits: {kind: classifier, num_classes: 10, pool: mean}, lm: {kind: lm}}
tasks:
  mnist: {kind: classification, tokenizer: image, head: digits, data: {kind: image_folder, root: /nonexistent}}
  corpus: {kind: causal_lm, tokenizer: text, head: lm, data: {kind: text, root: /nonexistent.txt, seq_len: 32}}
optim: {lr: 1e-3}
trainer: {max_steps: 3, accelerator: cpu}
"""


def test_the_mask_rules_a_task_needs_are_asked_of_the_backbone_that_reads_it():
    """A packed causal LM read by a text tower needs documents and causal masks of that tower, not of the
    shared backbone an image task reads (LSH there is fine); an LSH tower is refused for it, and flex in a
    tower is refused for training on the CPU as in the shared backbone."""
    from mmformer.build.trainer import refuse_kernels_untrainable_here

    recipe_from_yaml(TOWERS)  # the shared LSH backbone reads only images
    with pytest.raises(RecipeError) as e:
        recipe_from_yaml(TOWERS, ["model.backbone.attn_kernel=sdpa", "model.towers.text.attn_kernel=lsh"])
    assert str(e.value).startswith(
        "'model.towers.text.attn_kernel': lsh does not implement documents masks, which this recipe needs "
        "(causal, documents)"
    )
    assert "tasks.corpus.data: pack: true" in str(e.value)
    with pytest.raises(
        RecipeError, match="'model.towers.text.attn_kernel': flex has no backward pass on the CPU"
    ):
        refuse_kernels_untrainable_here(recipe_from_yaml(TOWERS, ["model.towers.text.attn_kernel=flex"]))


def test_aft_position_biases_must_cover_an_audio_tokenizers_longest_clip(tmp_path):
    """AST: 2-second clips at 8 kHz, hop 80 → 201 frames, 16-bin patches of 64 mels every 8 frames → 4 × 26
    = 104 tokens (trained a step at exactly 104 in the CLI); Whisper's stem: 5 s → 251 tokens."""
    from tests.test_config import WHISPER_CONV_RECIPE

    ast = Path(__file__).resolve().parents[1] / "recipes" / "audio" / "ast_classify_spoken_words.yaml"
    aft = ["model.backbone.attn_kernel=aft_full"]
    load_recipe(ast, [*aft, "model.backbone.kernel_options={max_len: 104}"])
    with pytest.raises(RecipeError) as e:
        load_recipe(ast, [*aft, "model.backbone.kernel_options={max_len: 103}"])
    assert "but 'model.tokenizers.audio' (2-second clips: 4 × 26 patches) gives 104 tokens" in str(e.value)
    whisper = tmp_path / "conv.yaml"
    whisper.write_text(WHISPER_CONV_RECIPE)
    load_recipe(whisper, [*aft, "model.backbone.kernel_options={max_len: 251}"])
    with pytest.raises(RecipeError, match="one token per 20 ms\\) gives 251 tokens per sequence"):
        load_recipe(whisper, [*aft, "model.backbone.kernel_options={max_len: 250}"])


def test_aft_position_biases_must_cover_a_dits_patches_and_the_captions_a_tower_reads():
    """DiT: 28-pixel images in 4-pixel patches → 49 tokens (no class token); CLIP's captions of
    ``data.max_len: 24`` read alone by a caption tower, from a manifest or from shards (each trained a
    step at exactly enough in the CLI), or ``num_latents`` of a resampler before it."""
    root = Path(__file__).resolve().parents[1] / "recipes"
    dit, clip = root / "diffusion" / "dit_classcond_mnist5k.yaml", root / "multimodal" / "clip_emoji.yaml"
    load_recipe(dit, ["model.backbone.attn_kernel=aft_full", "model.backbone.kernel_options={max_len: 49}"])
    with pytest.raises(
        RecipeError, match="'model.tokenizers.image' \\(28-pixel images in 4-pixel patches\\) gives 49"
    ):
        load_recipe(
            dit, ["model.backbone.attn_kernel=aft_full", "model.backbone.kernel_options={max_len: 48}"]
        )

    def tower(max_len: int) -> str:
        options = f"kernel_options: {{max_len: {max_len}, window: 4}}"
        return f"model.towers.caption={{d_model: 256, n_layers: 1, n_heads: 4, attn_kernel: aft_local, {options}}}"

    for data in ([], ["tasks.emoji.data={kind: shards, root: /nonexistent, max_len: 24}"]):
        load_recipe(clip, [*data, tower(24)])
        with pytest.raises(RecipeError) as e:
            load_recipe(clip, [*data, tower(23)])
        assert str(e.value).startswith(
            "'model.towers.caption.kernel_options.max_len' is 23, but 'tasks.emoji.data.max_len' gives 24 tokens"
        )
    # a resampler hands the tower num_latents tokens, however long the captions
    resampled = "model.resamplers={caption: {num_latents: 8, n_layers: 1, n_heads: 4}}"
    load_recipe(clip, [tower(8), resampled])
    with pytest.raises(RecipeError, match="but 'model.resamplers.caption.num_latents' gives 8 tokens"):
        load_recipe(clip, [tower(7), resampled])
    # a text-conditional DiT pools its captions' embeddings (no backbone reads them): any caption length
    aft = ["model.backbone.attn_kernel=aft_full", "model.backbone.kernel_options={max_len: 64}"]
    load_recipe(root / "diffusion" / "dit_textcond_emoji.yaml", [*aft, "tasks.emoji.data.max_len=80"])
    # a task that refuses the kernel outright says so first, not what its tokenizer would need of it
    with pytest.raises(RecipeError, match="aft_full does not implement cache, documents, spans masks"):
        load_recipe(
            root / "generation" / "transfusion_emoji.yaml",
            [*aft[:1], "model.backbone.kernel_options={max_len: 23}"],
        )


def test_aft_position_biases_must_cover_maskgits_caption_prefix_and_codes():
    """A text-conditional MaskGIT's backbone reads the caption prefix (``data.max_len: 24``) then the
    codec's 8×8 grid of a 32-pixel image: 88 tokens. The grid is the codec's, so the check runs when the
    tokenizer is built (``require_code_biases``); the class-conditional case is checked through the CLI in
    ``tests/tasks/test_maskgit.py``."""
    from mmformer.components.codes import require_code_biases
    from mmformer.tokenizers.codes import MaskedCodeTokenizer
    from mmformer.tokenizers.vq import VQVAE

    recipe_path = Path(__file__).resolve().parents[1] / "recipes" / "generation" / "maskgit_emoji_minilm.yaml"
    codes = MaskedCodeTokenizer(32, VQVAE(image_size=32, in_chans=3, channels=(8, 8)), None, 0.1, True)
    assert codes.grid == (8, 8)
    aft = "model.backbone.attn_kernel=aft_full"
    require_code_biases(
        load_recipe(recipe_path, [aft, "model.backbone.kernel_options={max_len: 88}"]), "image", codes
    )
    recipe = load_recipe(recipe_path, [aft, "model.backbone.kernel_options={max_len: 87}"])
    with pytest.raises(RecipeError) as e:
        require_code_biases(recipe, "image", codes)
    assert "(its codec's 8×8 grid of codes after a caption prefix of up to 24) gives 88 tokens" in str(
        e.value
    )
    both = MaskedCodeTokenizer(32, VQVAE(image_size=32, in_chans=3, channels=(8, 8)), 10, 0.1, True)
    recipe = load_recipe(recipe_path, [aft, "model.backbone.kernel_options={max_len: 88}"])
    with pytest.raises(RecipeError, match="up to 24 and its class token\\) gives 89 tokens"):
        require_code_biases(recipe, "image", both)  # the caption, the class token, then the codes
