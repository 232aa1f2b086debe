"""Linears on oneDNN (mmformer.nn.onednn): the same values and gradients as F.linear, and F.linear itself
wherever the oneDNN path does not apply."""

import copy
import io

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from mmformer.models import AttentionConfig, MultimodalModel, build_backbone
from mmformer.models.heads import LMHead
from mmformer.nn.lora import LoRALinear
from mmformer.nn.onednn import covered, onednn_linear, onednn_routed, use_onednn, uses_onednn
from mmformer.nn.packed import packed_linears

pytestmark = pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="PyTorch without oneDNN")


def _grads(fn, *leaves):
    out = fn(*leaves)
    g = torch.randn(out.shape, generator=torch.Generator().manual_seed(3))
    return out, torch.autograd.grad(out, [t for t in leaves if t is not None and t.requires_grad], g)


@pytest.mark.parametrize("shape", [(1, 8), (7, 8), (2, 33, 8), (256, 8)])
@pytest.mark.parametrize("bias", [True, False])
def test_values_and_gradients_equal_f_linear(shape, bias):
    torch.manual_seed(0)
    x = torch.randn(shape, requires_grad=True)
    w = torch.randn(5, 8, requires_grad=True)
    b = torch.randn(5, requires_grad=True) if bias else None
    assert covered(x, w, b)
    want, want_g = _grads(F.linear, x, w, b)
    got, got_g = _grads(onednn_linear, x, w, b)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert len(got_g) == len(want_g) == (3 if bias else 2)
    for g, h in zip(got_g, want_g):
        torch.testing.assert_close(g, h, rtol=1e-5, atol=1e-5)


def test_strided_operands_a_transposed_input_and_a_column_major_weight():
    torch.manual_seed(0)
    x = torch.randn(8, 6, requires_grad=True)
    w = torch.randn(8, 5).t().requires_grad_()  # (5, 8) stored column-major (nn.layout's decode layout)
    xt = x.t()  # (6, 8), not contiguous
    want, want_g = _grads(F.linear, xt, w, None)
    got, got_g = _grads(onednn_linear, xt, w, None)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    for g, h in zip(got_g, want_g):
        torch.testing.assert_close(g, h, rtol=1e-5, atol=1e-5)


def test_only_the_gradients_asked_for():
    x = torch.randn(4, 8, requires_grad=True)
    w = torch.randn(5, 8)  # frozen
    b = torch.randn(5, requires_grad=True)
    (gx, gb) = torch.autograd.grad(onednn_linear(x, w, b).sum(), [x, b])
    torch.testing.assert_close(gx, w.sum(0).expand(4, 8), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(gb, torch.full((5,), 4.0))


def test_double_backward_is_refused_not_wrong():
    x = torch.randn(4, 8, requires_grad=True)
    w = torch.randn(5, 8, requires_grad=True)
    (gx,) = torch.autograd.grad(onednn_linear(x, w).pow(2).sum(), [x], create_graph=True)
    with pytest.raises(RuntimeError, match="once_differentiable|twice|double"):
        gx.sum().backward()


@pytest.mark.parametrize(
    "case",
    ["bfloat16", "float64", "autocast", "one_dim", "empty", "meta"],
)
def test_what_it_does_not_cover_runs_f_linear(case):
    x, w, b = torch.randn(4, 8), torch.randn(5, 8), torch.randn(5)
    if case in ("bfloat16", "float64"):
        x, w, b = (t.to(getattr(torch, case)) for t in (x, w, b))
    elif case == "one_dim":
        x = x[0]
    elif case == "empty":
        x = x[:0]
    elif case == "meta":
        x, w, b = (t.to("meta") for t in (x, w, b))
    if case == "autocast":
        with torch.autocast("cpu", dtype=torch.bfloat16):
            assert not covered(x, w, b)
            assert onednn_linear(x, w, b).dtype == torch.bfloat16  # autocast applied, as F.linear
        return
    assert not covered(x, w, b)
    out = onednn_linear(x, w, b)
    assert out.shape == F.linear(x, w, b).shape and out.dtype == x.dtype


def test_a_compiled_graph_sees_f_linear():
    seen = []

    def backend(gm, example_inputs):
        seen.extend(str(n.target) for n in gm.graph.nodes if n.op == "call_function")
        return gm.forward

    x, w = torch.randn(4, 8), torch.randn(5, 8)
    out = torch.compile(onednn_linear, backend=backend, fullgraph=True)(x, w)
    torch.testing.assert_close(out, F.linear(x, w))
    assert any("linear" in t for t in seen) and not any("mkldnn" in t for t in seen)


def _gpt(seed=0):
    """A 2-block causal LM with its head tied to the token embedding (a shared weight's two gradients)."""
    from mmformer.tokenizers import TextEmbedding

    torch.manual_seed(seed)
    emb, head = TextEmbedding(50, 32, max_len=16), LMHead(32, 50)
    head.tie_to(emb.embed)
    return MultimodalModel(
        {"text": emb}, build_backbone(32, 2, AttentionConfig(4), causal=True), {"lm": head}
    )


def test_a_model_routed_through_onednn_trains_as_before():
    plain = _gpt()
    routed = copy.deepcopy(plain)
    assert (
        use_onednn(routed, min_weights=0) == 2 * 4 + 1
    )  # qkv, attention out, fc1, fc2 per block; the LM head
    assert use_onednn(routed, min_weights=0) == 0  # once
    assert routed.state_dict().keys() == plain.state_dict().keys()
    ids = torch.randint(0, 50, (3, 12), generator=torch.Generator().manual_seed(1))
    for model in (plain, routed):
        logits = model(ids, "text", "lm")
        F.cross_entropy(logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten()).backward()
    for (name, p), q in zip(plain.named_parameters(), routed.parameters()):
        torch.testing.assert_close(q.grad, p.grad, rtol=1e-5, atol=1e-6, msg=name)


def test_routing_counts_every_plain_linear_and_skips_subclasses():
    class MyLinear(nn.Linear):
        pass

    model = nn.ModuleDict(
        {"plain": nn.Linear(4, 4), "sub": MyLinear(4, 4), "lora": LoRALinear(nn.Linear(4, 4), rank=2)}
    )
    assert (
        use_onednn(model, min_weights=0) == 4
    )  # plain, and the LoRA's base, A and B (its own forward stays)
    assert uses_onednn(model["plain"]) and not uses_onednn(model["sub"])
    assert uses_onednn(model["lora"].base) and uses_onednn(model["lora"].lora_A)


def test_a_routed_model_copies_and_pickles():
    routed = _gpt()
    use_onednn(routed, min_weights=0)
    head = routed.heads["lm"].head
    twin = copy.deepcopy(routed)
    twin_head = twin.heads["lm"].head
    assert uses_onednn(twin_head) and twin_head.forward.__self__ is twin_head
    buf = io.BytesIO()
    torch.save(routed, buf)
    buf.seek(0)
    loaded = torch.load(buf, weights_only=False)
    assert uses_onednn(head) and not uses_onednn(loaded.heads["lm"].head)  # PyTorch's forward again
    assert use_onednn(loaded, min_weights=0) == use_onednn(_gpt(), min_weights=0)  # and routable again
    ids = torch.randint(0, 50, (2, 7))
    with torch.no_grad():
        torch.testing.assert_close(loaded(ids, "text", "lm"), routed(ids, "text", "lm"), rtol=1e-5, atol=1e-6)


def test_packed_decoding_restores_the_onednn_forward():
    head = nn.Linear(16, 10)
    use_onednn(head, min_weights=0)
    with torch.no_grad(), packed_linears([head], rows=2) as n:
        assert n == 1 and not uses_onednn(head)
        x = torch.randn(2, 5, 16)  # a prefill: not one position per row, so the linear's own forward
        torch.testing.assert_close(head(x), F.linear(x, head.weight, head.bias), rtol=1e-5, atol=1e-5)
    assert uses_onednn(head)


def test_flop_counting_sees_the_linear():
    from torch.utils.flop_counter import FlopCounterMode

    lin = nn.Linear(8, 5)
    use_onednn(lin, min_weights=0)
    x = torch.randn(4, 8, requires_grad=True)
    with FlopCounterMode(display=False) as counter:
        lin(x).sum().backward()
    assert counter.get_total_flops() == 3 * 2 * 4 * 8 * 5  # forward, ∂x and ∂W, as for F.linear


def test_only_linears_large_enough_to_gain_are_routed():
    model = nn.ModuleDict({"small": nn.Linear(256, 1024), "large": nn.Linear(384, 1152)})
    assert use_onednn(model) == 1
    assert uses_onednn(model["large"]) and not uses_onednn(model["small"])


def test_routing_for_a_context_restores_only_what_it_routed():
    model = nn.ModuleDict({"a": nn.Linear(600, 600), "b": nn.Linear(600, 600), "small": nn.Linear(8, 8)})
    use_onednn(model["a"])
    with onednn_routed([model]) as n:
        assert (
            n == 1 and uses_onednn(model["a"]) and uses_onednn(model["b"]) and not uses_onednn(model["small"])
        )
    assert uses_onednn(model["a"]) and not uses_onednn(model["b"]) and "forward" not in model["b"].__dict__
    with pytest.raises(ValueError), onednn_routed([model]):
        raise ValueError
    assert not uses_onednn(model["b"])


@pytest.mark.parametrize("faster", [True, False])
def test_generation_prefills_on_onednn_where_faster_gives_the_same_ids_and_leaves_the_model(
    monkeypatch, faster
):
    import contextlib

    import mmformer.models.generate as gen
    from mmformer.tokenizers import TextEmbedding

    torch.manual_seed(0)
    emb, head = TextEmbedding(100, 512, max_len=64), LMHead(512, 100)
    model = MultimodalModel(
        {"text": emb}, build_backbone(512, 2, AttentionConfig(8), causal=True), {"lm": head}
    )
    ids = torch.randint(0, 100, (2, 12), generator=torch.Generator().manual_seed(1))
    valid = torch.ones_like(ids, dtype=torch.bool)
    routed = []

    @contextlib.contextmanager
    def recording(modules):
        with onednn_routed(modules) as n:
            routed.append(n)
            yield n

    monkeypatch.setattr(gen, "onednn_routed", recording)
    monkeypatch.setattr(gen, "faster_here", lambda: faster)  # what this CPU measures, either way
    with_onednn = gen.generate(model, "text", "lm", ids, valid, max_new_tokens=6)
    # qkv, fc1, fc2 of both blocks; not the 512 × 512 projection nor the head
    assert routed == [2 * 3 if faster else 0]
    assert not any(uses_onednn(m) for m in model.modules())
    monkeypatch.setattr(gen, "onednn_routed", lambda modules: contextlib.nullcontext(0))
    assert with_onednn == gen.generate(model, "text", "lm", ids, valid, max_new_tokens=6)


def test_function_transforms_tracing_and_mismatched_shapes_run_f_linear():
    lin = nn.Linear(8, 5)
    use_onednn(lin, min_weights=0)
    x = torch.randn(3, 8)
    params = dict(lin.named_parameters())
    grads = torch.func.grad(lambda p, x: torch.func.functional_call(lin, p, (x,)).sum())(params, x)
    torch.testing.assert_close(grads["weight"], x.sum(0).expand(5, 8))
    torch.testing.assert_close(
        torch.func.vmap(lambda r: lin(r[None]))(x)[:, 0], F.linear(x, lin.weight, lin.bias)
    )
    traced = torch.jit.trace(lin, x)
    torch.testing.assert_close(traced(x), F.linear(x, lin.weight, lin.bias))
    with pytest.raises(RuntimeError, match="cannot be multiplied"):  # F.linear's message, not oneDNN's
        lin(torch.randn(3, 9))


def test_nested_packed_contexts_restore_the_onednn_forward_at_the_outer_exit():
    head = nn.Linear(16, 10)
    use_onednn(head, min_weights=0)
    with torch.no_grad(), packed_linears([head], rows=2):
        with packed_linears([head], rows=2):
            pass
        assert not uses_onednn(head)  # still packed: the outer context is open
        x = torch.randn(2, 3, 16)  # a prefill inside the outer context: its own (oneDNN) forward
        torch.testing.assert_close(head(x), F.linear(x, head.weight, head.bias), rtol=1e-5, atol=1e-5)
    assert uses_onednn(head)


def test_faster_here_measures_once_per_shape_and_thread_count(monkeypatch):
    import time

    from mmformer.nn import onednn

    first = onednn.faster_here(256, 1024, rows=64, rounds=3)
    assert isinstance(first, bool)
    start = time.perf_counter()
    assert onednn.faster_here(256, 1024, rows=64, rounds=3) is first  # cached: not measured again
    assert time.perf_counter() - start < 1e-3
    with torch.inference_mode():  # as generate may be called: measured all the same
        assert isinstance(onednn.faster_here(128, 512, rows=32, rounds=3), bool)
    monkeypatch.setattr(onednn, "_AVAILABLE", False)
    assert onednn.faster_here(256, 1024, rows=64, rounds=3) is False  # no oneDNN: PyTorch's linears
