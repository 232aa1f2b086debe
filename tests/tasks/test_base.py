"""Every objective satisfies the ``Task`` protocol the router calls; the router refuses one that does
not, and takes its builder-set values as keyword arguments (still settable afterwards)."""

from __future__ import annotations

import pytest
import torch

from mmformer.models import AttentionConfig, MultimodalModel, build_backbone
from mmformer.models.diffusion import GaussianDiffusion
from mmformer.models.encoder_decoder import EncoderDecoder
from mmformer.models.heads import LMHead
from mmformer.models.prefix_lm import PrefixLM
from mmformer.tasks.base import Task, TaskBase
from mmformer.tasks.classification import ClassificationTask
from mmformer.tasks.contrastive import ContrastiveTask
from mmformer.tasks.diffusion import DiffusionTask
from mmformer.tasks.language_model import CausalLMTask
from mmformer.tasks.masked_lm import MaskedLMTask
from mmformer.tasks.prefix_lm import PrefixLMTask
from mmformer.tasks.router import MultiTaskModule
from mmformer.tasks.seq2seq import Seq2SeqTask
from mmformer.tokenizers.text import TextEmbedding

TASKS = {
    "classification": lambda: ClassificationTask("image", "cls", num_classes=3),
    "causal_lm": lambda: CausalLMTask("text", "lm"),
    "masked_lm": lambda: MaskedLMTask("text", "mlm", mask_id=4, vocab_size=5, special_ids=[0, 4]),
    "contrastive": lambda: ContrastiveTask("image", "img", "text", "txt", loss="siglip"),
    "diffusion": lambda: DiffusionTask("x", "eps", GaussianDiffusion(torch.linspace(1e-4, 0.02, 10))),
    "prefix_lm": lambda: PrefixLMTask(PrefixLM("image", "text", "lm"), "image", None, max_new_tokens=3),
    "seq2seq": lambda: Seq2SeqTask(EncoderDecoder("audio", "text", "lm"), "audio", None, max_new_tokens=3),
}


@pytest.mark.parametrize("kind", list(TASKS))
def test_every_task_satisfies_the_protocol(kind):
    task = TASKS[kind]()
    assert isinstance(task, Task) and isinstance(task, TaskBase)
    assert task.main_metric[0] in [*task.val_metrics, *task.epoch_metric_names]
    assert task.epoch_metrics() == {}  # nothing validated yet


def _model():
    return MultimodalModel(
        {"text": TextEmbedding(5, 16)},
        build_backbone(16, 1, AttentionConfig(2), causal=True),
        {"lm": LMHead(16, 5)},
    )


def test_the_router_refuses_a_task_without_the_protocol():
    with pytest.raises(TypeError, match="'lm' .*does not satisfy"):
        MultiTaskModule(_model(), {"lm": torch.nn.Linear(2, 2)}, {"lm": 1.0}, optim=None)


def test_the_router_takes_builder_values_as_arguments_and_keeps_none_on_the_class():
    files = {"text": "{}"}
    a = MultiTaskModule(
        _model(),
        {"lm": CausalLMTask("text", "lm")},
        {"lm": 1.0},
        optim=None,
        compile_blocks=True,
        task_modalities={"lm": "text"},
        tokenizer_files=files,
    )
    b = MultiTaskModule(_model(), {"lm": CausalLMTask("text", "lm")}, {"lm": 1.0}, optim=None)
    assert a.compile_blocks and not a.checkpoint_blocks and a.task_modalities == {"lm": "text"}
    assert a.tokenizer_files == files and a.tokenizer_files is not files and a.pretrained_configs == {}
    assert not b.compile_blocks and b.tokenizer_files == {} and b.task_modalities == {}
    b.checkpoint_blocks, b.pretrained_configs = True, {"src": {}}  # what the builder did until now
    assert b.checkpoint_blocks and not a.checkpoint_blocks and a.pretrained_configs == {}
    ckpt: dict = {}
    a.on_save_checkpoint(ckpt)
    assert ckpt["mmformer"]["tokenizers"] == files and ckpt["mmformer"]["pretrained"] == {}
