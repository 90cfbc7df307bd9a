"""``quantize_q8`` and the fake (meta) impls of the quantized-activation ops (``qlinear_q8act``,
``quantize_q8``); re-exported by :mod:`specdec.ops`, whose ``qlinear(..., act="q8")`` runs them."""
from __future__ import annotations

from typing import Optional, Tuple

import torch

__all__ = ["quantize_q8", "pack_q8act"]

_ops = torch.ops.specdec


def quantize_q8(x: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """``qlinear(..., act="q8")``'s activations: (codes int8 [..., K], d float32 [..., K / 32]), x ~ d * codes,
    per row and block of 32 (the exact rounding: docs/ops.md)."""
    return _ops.quantize_q8(x)


def pack_q8act(qweight: torch.Tensor, scales: torch.Tensor, mins: Optional[torch.Tensor], bits: int) -> torch.Tensor:
    """The CPU tiers' packed layout of a group-quantized weight for ``qlinear(..., act="q8")``: uint8
    [ceil(N / 16), K / 32, bytes] (16 rows' codes interleaved per block, their scales / mins beside them;
    docs/ops.md). Made once per model; pass it in place of ``qweight`` (with the same scales / mins / bits)
    on the CPU. A CPU-only layout: CUDA takes the usual weight."""
    return _ops.pack_q8act(qweight, scales, mins, int(bits))


@torch.library.register_fake("specdec::qlinear_q8act")
def _qlinear_q8act_fake(x, qweight, scales, mins, bias, bits):
    return x.new_empty((*x.shape[:-1], scales.shape[0]))


@torch.library.register_fake("specdec::pack_q8act")
def _pack_q8act_fake(qweight, scales, mins, bits):
    n, g = scales.shape
    return qweight.new_empty(((n + 15) // 16, g, (512 if bits == 8 else 256) + 32 + (32 if mins is not None else 0)),
                             dtype=torch.uint8)


@torch.library.register_fake("specdec::quantize_q8")
def _quantize_q8_fake(x):
    return (x.new_empty(x.shape, dtype=torch.int8),
            x.new_empty((*x.shape[:-1], x.shape[-1] // 32), dtype=torch.float32))
