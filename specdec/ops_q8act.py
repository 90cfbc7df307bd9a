"""``quantize_q8`` and the fake (meta) impls of the quantized-activation ops (``qlinear_q8act``,
``quantize_q8``); re-exported by :mod:`specdec.ops`, whose ``qlinear(..., act="q8")`` runs them."""
from __future__ import annotations

from typing import Tuple

import torch

__all__ = ["quantize_q8"]

_ops = torch.ops.specdec


def quantize_q8(x: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """``qlinear(..., act="q8")``'s activations: (codes int8 [..., K], d float32 [..., K / 32]), x ~ d * codes,
    per row and block of 32 (the exact rounding: docs/ops.md)."""
    return _ops.quantize_q8(x)


@torch.library.register_fake("specdec::qlinear_q8act")
def _qlinear_q8act_fake(x, qweight, scales, mins, bias, bits):
    return x.new_empty((*x.shape[:-1], qweight.shape[0]))


@torch.library.register_fake("specdec::quantize_q8")
def _quantize_q8_fake(x):
    return (x.new_empty(x.shape, dtype=torch.int8),
            x.new_empty((*x.shape[:-1], x.shape[-1] // 32), dtype=torch.float32))
