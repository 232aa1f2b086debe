"""Attention kernels that are modules of their own: one file per kernel, registered by name, chosen by
``Attention(kernel=NAME, kernel_options={...})`` (recipes: ``model.backbone.attn_kernel`` and
``model.backbone.kernel_options``).

A kernel receives the per-head projections and the layer's mask rule and returns the attended values:
``forward(q, k, v, mask) -> (B, H, Nq, Dh)`` with ``q (B, H, Nq, Dh)``, ``k, v (B, H, Nk, Dh)`` (key/value
heads already repeated to ``H``; padded keys and values zeroed) and ``mask`` a ``MaskSpec`` (True = may
attend). It declares the mask rules it implements in ``masks`` (``MASK_RULES``); ``Attention`` refuses a
mask that uses any other, before running it (``check``), and recipes are refused at load
(``components.backbones``) with the kernels that do support what the recipe needs named. Options are
the subclass's keyword arguments after ``n_heads`` and ``head_dim``; an unknown one is refused with a
did-you-mean (``kernel_class``, ``check_options``). A kernel may own parameters (AFT's position biases,
RFA's gates): they live in the attention layer as ``kernel_module``.

The softmax kernels (``eager``, ``sdpa``, ``flex``) and the Performer stay inside ``nn.attention``: they
share its prepared dense / block masks.
"""

from __future__ import annotations

import difflib
import inspect
import types
import typing
from typing import ClassVar

import torch
from torch import Tensor, nn

from ..masks import MaskSpec

# the rules a MaskSpec can combine (nn.masks): key padding, causal order, packed documents, bidirectional
# spans inside a causal sequence (prefix-LM, images in a causal stream), sliding windows, block-sparse
# layouts, and queries offset behind a KV cache
MASK_RULES = ("padding", "causal", "documents", "spans", "window", "sparse", "cache")

KERNEL_CLASSES: dict[str, type[AttentionKernel]] = {}


def mask_rules(mask: MaskSpec) -> frozenset[str]:
    """The rules ``mask`` uses (``MASK_RULES``)."""
    used = {
        "padding": mask.valid is not None,
        "causal": mask.causal,
        "documents": mask.document is not None,
        "spans": mask.span is not None,
        "window": mask.window is not None,
        "sparse": mask.sparse_layout is not None,
        "cache": bool(mask.q_offset),
    }
    return frozenset(rule for rule, on in used.items() if on)


class AttentionKernel(nn.Module):
    """Base of registered kernels (module docstring). Subclasses set ``name`` and ``masks`` and implement
    ``forward``; ``n_heads`` and ``head_dim`` are the layer's."""

    name: ClassVar[str]
    masks: ClassVar[frozenset[str]] = frozenset({"padding"})

    def __init__(self, n_heads: int, head_dim: int):
        super().__init__()
        self.n_heads, self.head_dim = n_heads, head_dim

    @classmethod
    def needs(cls, options: dict) -> frozenset[str]:
        """Mask rules the kernel built with ``options`` cannot run without (RFA-Gate: ``causal``)."""
        return frozenset()

    @classmethod
    def attends_across(cls, options: dict) -> bool:
        """Whether the kernel built with ``options`` reads keys of another sequence than its queries
        (cross-attention: ``Nq != Nk``, no causal order between them). Self-attention only by default."""
        return False

    def check(self, mask: MaskSpec) -> None:
        """Raises ``ValueError`` when ``mask`` uses a rule this kernel does not implement."""
        missing = mask_rules(mask) - self.masks
        if missing:
            able = supporting(mask_rules(mask))
            raise ValueError(
                f"the {self.name} kernel does not implement {', '.join(sorted(missing))} masks "
                f"(it implements {', '.join(sorted(self.masks))}); kernels that do: {', '.join(able)}"
            )

    def flops(self, batch: int, n_queries: int, n_keys: int, causal: bool) -> int:
        """Forward FLOPs of one call on ``q (batch, H, n_queries, Dh)``, ``k, v (batch, H, n_keys, Dh)``
        with a causal mask or not: the matmuls and einsums the kernel runs, 1 FLOP = one multiply or add
        (a multiply-accumulate is 2), as ``torch.utils.flop_counter.FlopCounterMode`` counts them;
        elementwise ops, sums, softmax, sorting and gathers are not counted. Padding changes nothing
        (padded keys are zeroed or masked, not skipped). By default softmax attention's
        (``softmax_flops``); a kernel overrides it with the products its ``forward`` computes."""
        return softmax_flops(batch, self.n_heads, n_queries, n_keys, self.head_dim)

    def forward(self, q: Tensor, k: Tensor, v: Tensor, mask: MaskSpec) -> Tensor:  # pragma: no cover
        raise NotImplementedError


def softmax_flops(batch: int, n_heads: int, n_queries: int, n_keys: int, head_dim: int) -> int:
    """Softmax attention's matmul FLOPs: ``4 · B · H · Nq · Nk · Dh``, the scores ``q kᵀ`` and the weighted
    sum ``softmax(·) v``, ``2 · Nq · Nk · Dh`` each per head (Vaswani et al. 2017 §3.2.1; Kaplan et al.
    2020 §2.1), over the full ``Nq × Nk`` as the kernels compute it, causal or not."""
    return 4 * batch * n_heads * n_queries * n_keys * head_dim


def register_kernel(cls: type[AttentionKernel]) -> type[AttentionKernel]:
    """Class decorator: makes ``cls`` available as ``kernel=cls.name``."""
    KERNEL_CLASSES[cls.name] = cls
    return cls


SOFTMAX_KERNELS = ("eager", "sdpa", "flex")  # in nn.attention: every mask rule, and score biases
SOFTMAX_RULES = frozenset(MASK_RULES)
PERFORMER_RULES = frozenset({"padding", "causal"})


def supporting(rules: frozenset[str]) -> list[str]:
    """Every kernel name that implements all of ``rules``."""
    names = [k for k in SOFTMAX_KERNELS if rules <= SOFTMAX_RULES]
    names += ["performer"] if rules <= PERFORMER_RULES else []
    return names + [n for n, cls in KERNEL_CLASSES.items() if rules <= cls.masks]


def kernel_rules(name: str) -> frozenset[str]:
    """The mask rules kernel ``name`` implements."""
    if takes_score_bias(name):
        return SOFTMAX_RULES
    if name == "performer":
        return PERFORMER_RULES
    return KERNEL_CLASSES[name].masks


def takes_score_bias(name: str) -> bool:
    """Whether kernel ``name`` adds a score bias (ALiBi, T5 / Toeplitz relative positions): the softmax
    kernels (and ``auto``, which picks one) do; the Performer and the registered kernels do not."""
    return name == "auto" or name in SOFTMAX_KERNELS


def option_names(name: str) -> list[str]:
    """The options kernel ``name`` takes (its constructor's keywords after ``n_heads`` and ``head_dim``);
    none for the kernels inside ``nn.attention``."""
    cls = KERNEL_CLASSES.get(name)
    return [] if cls is None else list(inspect.signature(cls.__init__).parameters)[3:]


def check_options(name: str, options: dict, n_heads: int = 1, head_dim: int = 2) -> None:
    """Raises ``ValueError`` for options kernel ``name`` does not take (with a did-you-mean, or the
    kernels that do take it), any options for a kernel that takes none, and values its constructor
    refuses, so a recipe is refused at load rather than at its first step. The constructor runs on the
    meta device: no parameter is allocated (a kernel's small fixed tensors, LSH's rotations, are)."""
    cls = KERNEL_CLASSES.get(name)
    allowed = option_names(name)
    for key in options:
        if key not in allowed:
            close = difflib.get_close_matches(key, allowed, n=1)
            hint = f" Did you mean '{close[0]}'?" if close else ""
            takers = [n for n in KERNEL_CLASSES if key in option_names(n)]
            if not hint and takers:
                hint = f" It is an option of {' and '.join(takers)}: set attn_kernel to one of them."
            takes = f"it takes {', '.join(allowed)}" if allowed else "it takes none"
            if name == "performer":
                takes += "; its random feature count is model.backbone.performer_features"
            raise ValueError(f"kernel {name!r} has no option {key!r} ({takes}).{hint}")
    if cls is not None:
        hints = typing.get_type_hints(cls.__init__)
        for key, value in options.items():
            _check_type(name, key, value, hints.get(key))
        try:
            with torch.device("meta"):
                cls(n_heads, head_dim, **options)
        except NotImplementedError:  # a constructor that reads tensor values: checked when it is built
            pass


def _check_type(kernel: str, key: str, value, hint) -> None:
    """Raises ``ValueError`` when ``value`` is not of the option's annotated type (``int``, ``float``,
    ``bool``, optionally ``| None``): a YAML ``"false"`` is a string, not a bool; ``true`` is no count."""
    kinds = typing.get_args(hint) if typing.get_origin(hint) in (typing.Union, types.UnionType) else (hint,)
    if value is None and type(None) in kinds:
        return
    for kind in kinds:
        if kind is bool and isinstance(value, bool):
            return
        if kind is int and isinstance(value, int) and not isinstance(value, bool):
            return
        if kind is float and isinstance(value, (int, float)) and not isinstance(value, bool):
            return
    if not any(k in (bool, int, float) for k in kinds):
        return  # an option of another type: its constructor checks it
    names = " or ".join(
        {bool: "true / false", int: "an integer", float: "a number"}[k]
        for k in kinds
        if k in (bool, int, float)
    )
    raise ValueError(
        f"kernel {kernel!r} option {key!r} must be {names}, got {value!r} ({type(value).__name__})"
    )


def position_biases(name: str, options: dict) -> int | None:
    """How many tokens kernel ``name`` holds learned position biases for (its ``max_len`` option: AFT-full,
    AFT-local), else None; such a kernel reads token order by itself and no longer sequence."""
    cls = KERNEL_CLASSES.get(name)
    takes = cls is not None and "max_len" in inspect.signature(cls.__init__).parameters
    return options.get("max_len") if takes else None


def kernel_needs(name: str, options: dict) -> frozenset[str]:
    """Mask rules kernel ``name`` with ``options`` cannot run without (``AttentionKernel.needs``)."""
    cls = KERNEL_CLASSES.get(name)
    return frozenset() if cls is None else cls.needs(options)


def attends_across(name: str, options: dict) -> bool:
    """Whether kernel ``name`` with ``options`` can be a cross-attention layer's (``AttentionKernel.
    attends_across``): the softmax kernels and the Performer can."""
    cls = KERNEL_CLASSES.get(name)
    return True if cls is None else cls.attends_across(options)


def build_kernel(name: str, n_heads: int, head_dim: int, options: dict | None = None) -> AttentionKernel:
    """The registered kernel ``name`` for a layer of ``n_heads`` heads of width ``head_dim``."""
    options = dict(options or {})
    check_options(name, options)
    return KERNEL_CLASSES[name](n_heads, head_dim, **options)


def _load_builtin() -> None:
    import importlib
    import pkgutil

    for info in pkgutil.iter_modules(__path__):
        importlib.import_module(f"{__name__}.{info.name}")


_load_builtin()
