"""Pure-torch reference of ``qlinear_q8act`` (qlinear with quantized activations) and ``quantize_q8``.

The definition, step by step (the kernels compute exactly this; csrc/include/specdec/cpu_q8act.h):

1. Activations per row and block of 32 inputs: ``amax = max|x|``, ``d = amax / 127``,
   ``id = 127 / amax`` (0 where not finite: amax 0 or tiny), codes ``a = clamp(round_half_even(x * id), -127, 127)``;
   every division and product one float32 rounding; ``d`` stays float32.
2. Integer dots per block g and lane l (elements 4l..4l+3): ``p = sum c * a`` with the weight codes
   ``c`` (Q8_0 ``q``, Q4_0 ``q - 8``, Q4_1 ``q``) and ``r = sum a``; exact integers.
3. Accumulator ``(g % 2) * 8 + l``, in block order: ``acc = fma(float(p), dw * d, acc)``. Q4_1's min
   term per block: ``macc[g % 16] = fma(mw, s, macc[g % 16])`` with ``s = float(R) * d`` (``R`` the
   block's code sum), a second set of 16 accumulators. Each set folds in halves (8, 4, 2, 1);
   ``y = fold(acc) (+ fold(macc) for Q4_1) + bias`` (bias 0 without one). Every step one float32
   rounding; ``fma(a, b, c)`` is ``a * b + c`` rounded once (emulated exactly: :func:`fma32`).

Run on the CPU (torch's CUDA division by a scalar multiplies by a reciprocal): inputs on another
device are computed on the CPU and the result moved back.
"""
from __future__ import annotations

import math
from typing import Optional, Tuple

import torch

__all__ = ["quantize_q8", "qlinear_q8act", "weight_codes", "fma32"]


def quantize_q8(x: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """(codes int8 [..., K], d float32 [..., K / 32]) of step 1."""
    K = x.shape[-1]
    xb = x.detach().cpu().float().reshape(*x.shape[:-1], K // 32, 32)
    amax = xb.abs().amax(-1)
    d = amax / torch.full_like(amax, 127.0)  # tensor / tensor: a correctly rounded float32 division
    inv = torch.full_like(amax, 127.0) / amax
    inv = torch.where(torch.isfinite(inv), inv, torch.zeros_like(inv))  # amax 0 or below 127 / FLT_MAX
    a = torch.round(xb * inv.unsqueeze(-1)).clamp(-127, 127).to(torch.int8)
    return a.reshape(x.shape).to(x.device), d.to(x.device)


def weight_codes(qweight: torch.Tensor, mins: Optional[torch.Tensor], bits: int) -> torch.Tensor:
    """The weight codes c [N, K / 32, 32] as int64 (Q8_0 q, Q4_0 q - 8, Q4_1 q), element order."""
    N, G = qweight.shape[0], qweight.shape[1] * (8 // bits) // 32
    if bits == 8:
        return qweight.cpu().to(torch.int64).reshape(N, G, 32)
    q = qweight.cpu().to(torch.int64).reshape(N, G, 16)
    c = torch.cat((q & 15, q >> 4), dim=-1)
    return c if mins is not None else c - 8


def fma32(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
    """``a * b + c`` rounded once to float32 (a hardware fused multiply-add), for float32 tensors.

    The product of two float32 values is exact in float64 (48 significant bits); the float64 sum
    ``s`` rounds once, and TwoSum gives its exact error ``e``. Rounding ``s`` to float32 is then the
    correct rounding of the exact value unless ``s`` lies exactly halfway between two float32 values
    and ``e != 0``: the exact value is past the midpoint on ``e``'s side, so that neighbour is taken.
    """
    x, c64 = a.double() * b.double(), c.double()
    s = x + c64
    bb = s - x
    e = (x - (s - bb)) + (c64 - bb)
    f = s.float()
    other = torch.nextafter(f, torch.where(s > f.double(), torch.full_like(f, math.inf), torch.full_like(f, -math.inf)))
    tie = (f.double() != s) & ((s - f.double()).abs() == (other.double() - s).abs()) & (e != 0)
    up = torch.maximum(f, other)
    down = torch.minimum(f, other)
    return torch.where(tie, torch.where(e > 0, up, down), f)


def _fold16(acc: torch.Tensor) -> torch.Tensor:
    """The 16 accumulators [..., 16] summed in halves: 8, 4, 2, 1."""
    h = acc[..., :8] + acc[..., 8:]
    h = h[..., :4] + h[..., 4:]
    h = h[..., :2] + h[..., 2:]
    return h[..., 0] + h[..., 1]


def qlinear_q8act(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, mins: Optional[torch.Tensor],
                  bias: Optional[torch.Tensor], bits: int) -> torch.Tensor:
    """The op's output [..., N] in x's dtype (float32 inside), bit-exact with the kernels."""
    K, N = x.shape[-1], qweight.shape[0]
    G, M = K // 32, math.prod(x.shape[:-1])
    b = bias.cpu().float() if bias is not None else torch.zeros(N)
    if M == 0 or N == 0 or K == 0:  # nothing to sum: the bias (0 without one)
        return b.expand(*x.shape[:-1], N).to(device=x.device, dtype=x.dtype).clone()
    a, d = quantize_q8(x.reshape(M, K).cpu())
    a4 = a.to(torch.float64).reshape(M, 1, G, 8, 4)
    c4 = weight_codes(qweight, mins, bits).to(torch.float64).reshape(1, N, G, 8, 4)
    p = (a4 * c4).sum(-1).float()  # [M, N, G, 8]: exact integers (|p| < 2^17)
    dw = scales.cpu().float()  # [N, G], exact widening
    dd = (dw.unsqueeze(0) * d.unsqueeze(1)).unsqueeze(-1).expand(M, N, G, 8)
    acc = torch.zeros(M, N, 16, dtype=torch.float32)
    for g in range(G):
        lanes = slice((g % 2) * 8, (g % 2) * 8 + 8)
        acc[:, :, lanes] = fma32(p[:, :, g], dd[:, :, g], acc[:, :, lanes])
    y = _fold16(acc)
    if mins is not None:
        s = a.reshape(M, G, 32).to(torch.int64).sum(-1).float() * d  # [M, G]: float(R) * d
        mw = mins.cpu().float().unsqueeze(0).expand(M, N, G)
        sv = s.unsqueeze(1).expand(M, N, G)
        macc = torch.zeros(M, N, 16, dtype=torch.float32)
        for g in range(G):
            macc[:, :, g % 16] = fma32(mw[:, :, g], sv[:, :, g], macc[:, :, g % 16])
        y = y + _fold16(macc)
    y = y + b
    return y.reshape(*x.shape[:-1], N).to(device=x.device, dtype=x.dtype)
