"""The decode weight layout (``mmformer.nn.layout``): same values and parameters, same generations,
row-major again for training and in every state dict."""

import torch

from mmformer.models.generate import generate
from mmformer.models.pretrained.llama import build_llama
from tests.conftest import TINY_LLAMA


def _model():
    torch.manual_seed(0)
    model = build_llama(TINY_LLAMA)
    for p in model.parameters():  # an untrained model's logits are nearly flat: make argmaxes decisive
        p.data.normal_(0, 0.3)
    return model


def _block_weights(model):
    return {n: p for n, p in model.backbone.named_parameters() if n.endswith("weight") and p.dim() == 2}


def test_decode_layout_keeps_values_parameters_and_generations():
    model = _model().eval()
    ids = torch.randint(1, 97, (3, 7))
    valid = torch.ones_like(ids, dtype=torch.bool)
    valid[0, :3] = False  # left padding
    before = generate(model, "text", "lm", ids, valid, 12)  # converts on its first call
    weights = _block_weights(model)
    assert weights and all(not p.is_contiguous() and p.t().is_contiguous() for p in weights.values())
    reference = _model().eval()  # same seed, never converted
    ref_weights = _block_weights(reference)
    for n, p in weights.items():
        assert torch.equal(p, ref_weights[n]), n
    assert torch.equal(model.heads.lm.head.weight, model.tokenizers.text.embed.weight)  # tie untouched
    with torch.no_grad():
        torch.testing.assert_close(
            model(ids, "text", "lm", valid=valid), reference(ids, "text", "lm", valid=valid)
        )
    ref_out = generate(reference, "text", "lm", ids, valid, 12)
    assert before == ref_out
    # a converted model generates the same again
    assert generate(model, "text", "lm", ids, valid, 12) == before


def test_a_training_forward_restores_row_major_and_state_dicts_are_row_major():
    model = _model()
    params = {n: p for n, p in model.named_parameters()}
    opt = torch.optim.SGD(model.parameters(), lr=0.1)  # built before any layout change
    model.for_decoding()
    assert any(not p.is_contiguous() for p in model.parameters())
    state = model.state_dict()
    assert all(v.is_contiguous() for v in state.values())
    for n, p in params.items():
        assert torch.equal(state[n], p)
    with torch.no_grad():  # evaluation forwards keep the decode layout
        model(torch.randint(1, 97, (2, 5)), "text", "lm")
    assert any(not p.is_contiguous() for p in model.parameters())
    for m in model.modules():  # as Lightning's loops restore the mode: the flag only, no train() call
        m.training = True
    w = model.backbone.blocks[0].attn.qkv.weight
    before = w.detach().clone()
    model(torch.randint(1, 97, (2, 5)), "text", "lm").sum().backward()
    assert all(p.is_contiguous() for p in model.parameters())
    assert {n: p for n, p in model.named_parameters()} == params  # the same Parameter objects
    assert w.grad.is_contiguous()
    opt.step()
    assert not torch.equal(w, before)
