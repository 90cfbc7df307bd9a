"""Pure-torch reference of ``qlinear_q8act`` (qlinear with quantized activations), ``quantize_q8`` and
``pack_q8act`` (the CPU tiers' weight layout).

The definition, step by step (the kernels compute exactly this; csrc/include/specdec/cpu_q8act.h):

1. Activations per row and block of 32 inputs: ``amax = max|x|``, ``d = amax / 127``,
   ``id = 127 / amax`` (0 where not finite: amax 0 or tiny), codes ``a = clamp(round_half_even(x * id), -127, 127)``;
   every division and product one float32 rounding; ``d`` stays float32. ``R`` = the block's code sum,
   ``s = float(R) * d``.
2. One integer dot per block g and weight row: ``P = sum c * a`` over the block's 32 elements with the
   weight codes ``c`` (Q8_0 ``q``, Q4_0 ``q - 8``, Q4_1 ``q``); exact.
3. One accumulator per output from +0, blocks in ascending order: ``acc = fma(float(P), dw * d, acc)``,
   for Q4_1 then ``acc = fma(mw, s, acc)``; ``y = acc + bias`` (bias 0 without one). Every step one
   float32 rounding; ``fma(a, b, c)`` is ``a * b + c`` rounded once (emulated exactly: :func:`fma32`).

Run on the CPU (torch's CUDA division by a scalar multiplies by a reciprocal): inputs on another
device are computed on the CPU and the result moved back.
"""
from __future__ import annotations

import math
from typing import Optional, Tuple

import torch

__all__ = ["quantize_q8", "qlinear_q8act", "weight_codes", "fma32", "pack_q8act", "unpack_q8act"]


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


def pack_q8act(qweight: torch.Tensor, scales: torch.Tensor, mins: Optional[torch.Tensor], bits: int) -> torch.Tensor:
    """The CPU tiers' packed layout, uint8 [ceil(N / 16), G, bytes] (csrc/include/specdec/cpu_q8act.h): per
    group of 16 rows and block, the code vectors (vector k, bytes 4j..4j+3 = bytes 4k..4k+3 of row j's block;
    Q8_0 codes offset by 128), the 16 float16 scales, Q4_1's 16 float16 mins; rows past N zero."""
    N, G = scales.shape
    T, per = (N + 15) // 16, 32 if bits == 8 else 16
    q = qweight.cpu().contiguous().view(torch.uint8).reshape(N, G, per)
    if bits == 8:
        q = q ^ 0x80
    pad = T * 16 - N
    q = torch.cat((q, torch.full((pad, G, per), 128 if bits == 8 else 0, dtype=torch.uint8)))
    codes = q.reshape(T, 16, G, per // 4, 4).permute(0, 2, 3, 1, 4).reshape(T, G, per * 16)
    parts = [codes]
    for t in (scales, mins) if mins is not None else (scales,):
        h = torch.cat((t.cpu().contiguous(), torch.zeros(pad, G, dtype=torch.float16)))
        parts.append(h.view(torch.uint8).reshape(T, 16, G, 2).permute(0, 2, 1, 3).reshape(T, G, 32))
    return torch.cat(parts, dim=-1).contiguous()


def unpack_q8act(packed: torch.Tensor, n: int, bits: int, has_mins: bool):
    """(qweight, scales, mins or None) of a packed weight with ``n`` rows: the inverse of :func:`pack_q8act`."""
    T, G, _ = packed.shape
    per = 32 if bits == 8 else 16
    p = packed.cpu()
    codes = p[..., : per * 16].reshape(T, G, per // 4, 16, 4).permute(0, 3, 1, 2, 4).reshape(T * 16, G * per)[:n]
    if bits == 8:
        codes = (codes ^ 0x80).view(torch.int8)
    halves = []
    for i in range(2 if has_mins else 1):
        h = p[..., per * 16 + 32 * i: per * 16 + 32 * (i + 1)].reshape(T, G, 16, 2).permute(0, 2, 1, 3)
        halves.append(h.contiguous().view(torch.float16).reshape(T * 16, G)[:n].contiguous())
    return codes.contiguous(), halves[0], (halves[1] if has_mins else None)


def qlinear_q8act(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, mins: Optional[torch.Tensor],
                  bias: Optional[torch.Tensor], bits: int) -> torch.Tensor:
    """The op's output [..., N] in x's dtype (float32 inside), bit-exact with the kernels. ``qweight`` may be
    the usual [N, K] / [N, K / 2] weight or :func:`pack_q8act`'s layout."""
    if qweight.dim() == 3:
        qweight = unpack_q8act(qweight, scales.shape[0], bits, mins is not None)[0]
    K, N = x.shape[-1], qweight.shape[0]
    G, M = K // 32, math.prod(x.shape[:-1])
    b = bias.cpu().float() if bias is not None else torch.zeros(N)
    if M == 0 or N == 0 or K == 0:  # nothing to sum: the bias (0 without one)
        return b.expand(*x.shape[:-1], N).to(device=x.device, dtype=x.dtype).clone()
    a, d = quantize_q8(x.reshape(M, K).cpu())
    a64 = a.to(torch.float64).reshape(M, 1, G, 32)
    c64 = weight_codes(qweight, mins, bits).to(torch.float64).reshape(1, N, G, 32)
    p = (a64 * c64).sum(-1).float()  # [M, N, G]: exact integers (|p| < 2^20)
    dd = scales.cpu().float().unsqueeze(0) * d.unsqueeze(1)  # [M, N, G]: dw * d, one rounding
    acc = torch.zeros(M, N, dtype=torch.float32)
    if mins is not None:
        s = a.reshape(M, G, 32).to(torch.int64).sum(-1).float() * d  # [M, G]: float(R) * d
        mw = mins.cpu().float()
    for g in range(G):
        acc = fma32(p[:, :, g], dd[:, :, g], acc)
        if mins is not None:
            acc = fma32(mw[:, g].unsqueeze(0).expand(M, N), s[:, g:g + 1].expand(M, N), acc)
    y = acc + b
    return y.reshape(*x.shape[:-1], N).to(device=x.device, dtype=x.dtype)
