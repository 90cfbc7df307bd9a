"""Weight-only int8 quantisation of a model's linear layers, run by :func:`specdec.ops.linear`.

Each ``nn.Linear`` becomes an :class:`Int8Linear`: int8 weight with one float32 scale per
output row (symmetric, ``max|W[n]| / 127``), activations and bias stay in the model's dtype,
accumulation in float32. A decode step then streams a quarter of the float32 bytes. Unlike
``torch.ao``'s dynamic quantisation the activations are not quantised, so the copy tracks
the original model closely (a good draft), and it runs on CPU and CUDA.
"""
from __future__ import annotations

import weakref
from typing import Iterable, Optional

import torch

from specdec import ops

__all__ = ["Int8Linear", "quantize_linear_int8", "GroupQuantLinear", "quantize_linear_groups", "replace_module",
           "untie", "set_activation_quant", "set_packed_hugepages", "pack_q8act_cpu"]


class Int8Linear(torch.nn.Module):
    """``y = (x @ qweight.T) * scale + bias`` through :func:`specdec.ops.linear`."""

    def __init__(self, qweight: torch.Tensor, scale: torch.Tensor, bias: Optional[torch.Tensor]) -> None:
        super().__init__()
        self.in_features = int(qweight.shape[1])
        self.out_features = int(qweight.shape[0])
        self.register_buffer("qweight", qweight)
        self.register_buffer("scale", scale)
        self.register_buffer("bias", bias)

    @classmethod
    def from_linear(cls, linear: torch.nn.Linear) -> "Int8Linear":
        q, s = ops.quantize_weight_int8(linear.weight)
        bias = None if linear.bias is None else linear.bias.detach().clone()
        return cls(q, s, bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bias = self.bias if self.bias is None or self.bias.dtype == x.dtype else self.bias.to(x.dtype)
        return ops.linear(x, self.qweight, bias, self.scale)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


def quantize_linear_int8(model: torch.nn.Module, skip: Iterable[str] = ()) -> torch.nn.Module:
    """Replace every plain ``nn.Linear`` of ``model`` (in place) by an :class:`Int8Linear`.

    ``skip``: qualified module names to keep in floating point. A linear layer whose weight
    is tied to another parameter (e.g. lm_head to the embeddings) gets its own int8 copy; the
    embedding stays as it is. Returns the model.
    """
    skip = set(skip)
    targets = [(name, m) for name, m in model.named_modules()
               if type(m) is torch.nn.Linear and name not in skip]
    for name, linear in targets:
        replace_module(model, name, Int8Linear.from_linear(linear))
    untie(model)
    return model


class GroupQuantLinear(torch.nn.Module):
    """``y = x @ W.T + bias`` with W group-quantized (GGUF Q8_0 / Q4_0 / Q4_1 layout), run by
    :func:`specdec.ops.qlinear`. Buffers: ``qweight`` (int8 [N, K] or uint8 [N, K / 2]),
    ``scales`` / ``mins`` (float16 [N, K / 32]), ``bias``; ``bits`` 8 or 4. ``act``: None (float
    activations) or "q8" (activations quantized per block of 32, ``ops.qlinear(..., act="q8")``)."""

    def __init__(self, qweight: torch.Tensor, scales: torch.Tensor, mins: Optional[torch.Tensor],
                 bias: Optional[torch.Tensor], bits: int) -> None:
        super().__init__()
        self.bits = int(bits)
        self.in_features = int(scales.shape[1]) * 32
        self.out_features = int(qweight.shape[0])
        self.register_buffer("qweight", qweight)
        self.register_buffer("scales", scales)
        self.register_buffer("mins", mins)
        self.register_buffer("bias", bias)
        self.act: Optional[str] = None

    @property
    def fmt(self) -> str:
        return "q8_0" if self.bits == 8 else ("q4_1" if self.mins is not None else "q4_0")

    @classmethod
    def from_linear(cls, linear: torch.nn.Linear, fmt: str) -> "GroupQuantLinear":
        qw, d, m = ops.quantize_weight_groups(linear.weight, fmt)
        bias = None if linear.bias is None else linear.bias.detach().clone()
        return cls(qw, d, m, bias, 8 if fmt == "q8_0" else 4)

    def op_weight(self) -> torch.Tensor:
        """The weight operand of this layer's op: with act="q8" on the CPU the packed layout
        (:func:`q8act_weight`), else ``qweight``."""
        if self.act != "q8":
            return self.qweight
        return q8act_weight(self, self.qweight, self.scales, self.mins, self.bits)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bias = self.bias if self.bias is None or self.bias.dtype == x.dtype else self.bias.to(x.dtype)
        return ops.qlinear(x, self.op_weight(), self.scales, self.mins, bias, self.bits, act=self.act)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, fmt={self.fmt}, "
                f"bias={self.bias is not None}" + (f", act={self.act}" if self.act else ""))


# owner module -> {slot: (weak refs to the source tensors, their versions, packed weight)}: kept beside the
# modules, so that pickling, deep copies and state dicts never see it
_Q8ACT_PACKS: "weakref.WeakKeyDictionary[object, dict]" = weakref.WeakKeyDictionary()


def q8act_weight(owner: object, qweight: torch.Tensor, scales: torch.Tensor, mins: Optional[torch.Tensor], bits: int,
                 slot: str = "module") -> torch.Tensor:
    """``qlinear(..., act="q8")``'s fastest weight operand on qweight's device: on the CPU its packed layout
    (:func:`specdec.ops.pack_q8act`, made once and kept for ``owner`` under ``slot`` while these very tensors
    are unchanged: same objects, same in-place version), elsewhere ``qweight`` itself. The packed copy is
    the CPU tiers' working layout beside the module's buffers (state dicts, slicing and device moves keep
    using ``qweight``); it lives as long as ``owner``."""
    if qweight.device.type != "cpu":
        return qweight
    parts = (qweight, scales, mins)
    versions = tuple(None if t is None else t._version for t in parts)
    packs = _Q8ACT_PACKS.setdefault(owner, {})
    cached = packs.get(slot)
    if cached is not None:
        refs, was, packed = cached
        same = all((r is None and t is None) or (r is not None and r() is t) for r, t in zip(refs, parts))
        if same and was == versions:
            return packed
    packed = pack_q8act_cpu(qweight, scales, mins, bits)
    packs[slot] = (tuple(None if t is None else weakref.ref(t) for t in parts), versions, packed)
    return packed


_PACKED_HUGEPAGES = True


def set_packed_hugepages(on: bool) -> bool:
    """Whether :func:`pack_q8act_cpu` (so every packed weight a model or a head makes from now on) copies
    the packed layout into huge pages; returns the previous setting. On by default: a decode step streams
    these layouts, not the modules' buffers (which ``load_bundled`` moved), and on 4 KiB pages the stream
    pays a TLB miss per page. Off: the allocator's pages (the comparison in benchmarks/ab_packed_hugepages.py)."""
    if not isinstance(on, bool):
        raise TypeError(f"set_packed_hugepages: on must be a bool, got {on!r}")
    global _PACKED_HUGEPAGES
    was, _PACKED_HUGEPAGES = _PACKED_HUGEPAGES, on
    return was


def pack_q8act_cpu(qweight: torch.Tensor, scales: torch.Tensor, mins: Optional[torch.Tensor], bits: int
                   ) -> torch.Tensor:
    """:func:`specdec.ops.pack_q8act`, the result in huge pages (:func:`~specdec.models.hugepages.hugepage_copy`)
    unless :func:`set_packed_hugepages` turned that off. The same bytes either way."""
    packed = ops.pack_q8act(qweight, scales, mins, bits)
    if _PACKED_HUGEPAGES:
        from specdec.models.hugepages import hugepage_copy

        packed = hugepage_copy(packed)
    return packed


def q8act_forget(module: torch.nn.Module) -> None:
    """Drop the packed copy :func:`q8act_weight` keeps for ``module`` itself (e.g. once a merged projection
    serves it)."""
    _Q8ACT_PACKS.get(module, {}).pop("module", None)


def q8act_packed(module: torch.nn.Module):
    """The packed weights :func:`q8act_weight` keeps for ``module`` and its submodules (memory accounting)."""
    for m in module.modules():
        for _, _, packed in _Q8ACT_PACKS.get(m, {}).values():
            yield packed


def quantize_linear_groups(model: torch.nn.Module, fmt: str, skip: Iterable[str] = ()) -> torch.nn.Module:
    """Replace every plain ``nn.Linear`` whose input width is a multiple of 32 by a
    :class:`GroupQuantLinear` of format ``fmt`` ("q8_0", "q4_0", "q4_1"), in place. Returns the model."""
    skip = set(skip)
    targets = [(name, m) for name, m in model.named_modules()
               if type(m) is torch.nn.Linear and name not in skip and m.in_features % 32 == 0]
    for name, linear in targets:
        replace_module(model, name, GroupQuantLinear.from_linear(linear, fmt))
    untie(model)
    return model


def set_activation_quant(model: torch.nn.Module, act: Optional[str]) -> torch.nn.Module:
    """Set every :class:`GroupQuantLinear` of ``model`` to ``act`` (None: float activations; "q8":
    activations quantized per block of 32, a different model with its own logits). Build the
    :class:`specdec.HFCausalLM` adapter after this call. Returns the model."""
    if act not in (None, "q8"):
        raise ValueError(f"set_activation_quant: act must be None or 'q8', got {act!r}")
    for m in model.modules():
        if isinstance(m, GroupQuantLinear):
            m.act = act
    return model


def replace_module(model: torch.nn.Module, name: str, module: torch.nn.Module) -> None:
    """Put ``module`` at the qualified name ``name`` of ``model``."""
    parent_name, _, child = name.rpartition(".")
    setattr(model.get_submodule(parent_name) if parent_name else model, child, module)


def untie(model: torch.nn.Module) -> None:
    """A model that ties lm_head to the embeddings would re-tie on save / resize: mark it untied."""
    config = getattr(model, "config", None)
    if config is not None and getattr(config, "tie_word_embeddings", False):
        try:
            config.tie_word_embeddings = False
        except Exception:  # pragma: no cover - read-only configs
            pass
