"""Pure-torch reference of every specdec op: the executable specification.

Written for clarity, not speed. Every compiled kernel (C++ CPU, CUDA) must agree
with these functions: integer outputs exactly, float outputs within the tolerance
justified in the tests. See docs in ``specdec/ops.py`` for the full contract.

Conventions (docs/design.md):
  * B requests, N tree nodes per request, V vocabulary, Hq / Hkv heads, D head dim,
    S cache capacity.
  * Node 0 is the root (the last committed token). Nodes are topologically
    ordered: ``parents[b, i] < i`` for real nodes, ``parents[b, 0] == -1``.
    Padding nodes have parent -1 and token -1 (they are never anyone's child).
  * Probability arithmetic: the current (residual) distribution is kept
    UNNORMALISED as integer masses ``m`` (fixed point, :func:`quantize_row`) with
    total ``Z = sum(m)``; the normalised distribution is ``m / Z``. Integer sums are
    exact in any order, and the few float64 operations (the acceptance test, the
    scaled draft mass, the draw threshold) are single rounded products, so CPU, CUDA
    and this reference make identical decisions BY CONSTRUCTION, ties included.
"""
from __future__ import annotations

import sys
from typing import List, Optional, Sequence, Tuple

import torch

__all__ = [
    "verify_attention",
    "append_kv",
    "rejection_sample",
    "greedy_verify",
    "kv_commit",
    "linear",
    "qlinear",
    "dequantize_groups",
    "rms_norm",
    "add_rms_norm",
    "rope",
    "silu_mul",
    "decoder_layer",
    "sample_from",
    "quantize_row",
    "draw_threshold",
    "MASS_BITS",
    "MAX_VOCAB",
    "tree_attention_mask",
]


# --------------------------------------------------------------------------- attention
def append_kv(k_cache: torch.Tensor, v_cache: torch.Tensor, k_new: torch.Tensor,
              v_new: torch.Tensor, cache_lens: torch.Tensor, offset: int = 0) -> None:
    """Write k_new/v_new [B, Hkv, N, D] at positions cache_lens[b] + offset + j (in place)."""
    B, _, N, _ = k_new.shape
    for b in range(B):
        start = int(cache_lens[b]) + int(offset)
        k_cache[b, :, start:start + N] = k_new[b]
        v_cache[b, :, start:start + N] = v_new[b]


def verify_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                     cache_lens: torch.Tensor, tree_mask: Optional[torch.Tensor],
                     scale: float) -> torch.Tensor:
    """Attention of the last Nq of a step's Nkv new nodes over the committed prefix plus the new nodes.

    q [B, Nq, Hq, D]; k_cache, v_cache [B, Hkv, S, D]; cache_lens [B] int32;
    tree_mask [B, Nq, Nkv] bool (Nkv >= Nq) or None (causal chain, Nkv = Nq). The step's
    Nkv new nodes sit at cache_lens[b] + j, j < Nkv; query i is new node Nkv - Nq + i.
    Query i of request b sees cache positions < cache_lens[b] and position
    cache_lens[b] + j iff tree_mask[b, i, j]. fp32 math. A query that sees no key gets
    a zero output. Returns [B, Nq, Hq, D] in q's dtype.
    """
    B, Nq, Hq, D = q.shape
    Hkv = k_cache.shape[1]
    group = Hq // Hkv
    out = torch.zeros(B, Nq, Hq, D, dtype=torch.float32, device=q.device)
    if tree_mask is None:
        Nkv = Nq
        tree = torch.ones(Nq, Nq, dtype=torch.bool, device=q.device).tril()
        tree = tree.expand(B, Nq, Nq)
    else:
        Nkv = tree_mask.shape[2]
        tree = tree_mask.to(torch.bool)
    for b in range(B):
        L = int(cache_lens[b])
        k = k_cache[b, :, : L + Nkv].float().repeat_interleave(group, dim=0)  # [Hq, L+Nkv, D]
        v = v_cache[b, :, : L + Nkv].float().repeat_interleave(group, dim=0)
        qb = q[b].float().transpose(0, 1)  # [Hq, Nq, D]
        scores = torch.matmul(qb, k.transpose(1, 2)) * scale  # [Hq, Nq, L+Nkv]
        visible = torch.cat([torch.ones(Nq, L, dtype=torch.bool, device=q.device), tree[b]], dim=1)
        scores = scores.masked_fill(~visible, float("-inf"))
        probs = torch.softmax(scores, dim=-1)
        probs = torch.nan_to_num(probs, nan=0.0)  # rows with no visible key -> 0
        out[b] = torch.matmul(probs, v).transpose(0, 1)
    return out.to(q.dtype)


def tree_attention_mask(parents: torch.Tensor) -> torch.Tensor:
    """[B, N] int32 parents -> [B, N, N] bool: node i sees j iff j is i or an ancestor of i."""
    B, N = parents.shape
    mask = torch.zeros(B, N, N, dtype=torch.bool, device=parents.device)
    for b in range(B):
        for i in range(N):
            j = i
            while j >= 0:
                mask[b, i, j] = True
                parent = int(parents[b, j])
                if parent >= j:  # malformed parent: stop instead of looping
                    break
                j = parent
    return mask


# --------------------------------------------------------------------------- sampling
#: Fixed-point precision of the sampler: a row's entries are integers in units of
#: 2**(e - MASS_BITS), e the binary exponent of the row's largest entry, so every entry
#: is < 2**MASS_BITS units and a row's mass is < V * 2**MASS_BITS <= 2**62.
MASS_BITS = 42
#: Largest vocabulary the sampler takes (keeps the integer mass of a row below 2**62).
MAX_VOCAB = 1 << 20
_MASS_CAP = 1 << 62


def quantize_row(row: torch.Tensor) -> torch.Tensor:
    """The integer mass of a probability row [V] (float32): the sampler's view of it.

    Entries that are NaN, infinite, zero or negative carry no mass. With M the largest
    remaining entry and e its binary exponent (M = f * 2**e, 0.5 <= f < 1), entry x
    becomes floor(x * 2**(MASS_BITS - e)) (exact: a power-of-two scaling, then a floor),
    so scaling a row by a power of two changes nothing and the mass is an exact integer
    sum: every backend gets the same masses, prefix sums and decisions whatever order it
    adds in. Relative resolution 2**-(MASS_BITS - 1) of the largest entry.
    """
    x = row.double()
    x = torch.where(torch.isfinite(x) & (x > 0), x, torch.zeros_like(x))
    M = float(x.max()) if x.numel() else 0.0
    if not M > 0.0:
        return torch.zeros(x.shape, dtype=torch.int64, device=x.device)
    e = int(torch.frexp(torch.tensor(M, dtype=torch.float64)).exponent)
    return torch.floor(x * (2.0 ** (MASS_BITS - e))).to(torch.int64)


def _scaled_mass(Z: int, q_row: torch.Tensor) -> torch.Tensor:
    """floor(double(Z) * q_i) clamped to [0, 2**62] (NaN / non-positive -> 0): the integer
    mass that a rejected draft row q removes from a residual of mass Z."""
    t = float(Z) * q_row.double()
    t = torch.where(t > 0, t, torch.zeros_like(t))  # NaN and negatives -> 0
    t = torch.clamp(t, max=float(_MASS_CAP))
    return torch.floor(t).to(torch.int64)


def _children(parents_b: torch.Tensor, node: int) -> List[int]:
    N = parents_b.shape[0]
    return [c for c in range(node + 1, N) if int(parents_b[c]) == node]


def draw_threshold(Z: int, u: float) -> int:
    """The integer threshold of an inverse-CDF draw with uniform u from mass Z > 0:
    floor(u * double(Z)) clamped to [0, Z - 1] (u <= 0 or NaN -> 0; u >= 1 -> Z - 1)."""
    t = u * float(Z)
    if not t > 0.0:
        return 0
    if t >= float(Z):
        return Z - 1
    return min(int(t), Z - 1)


def sample_from(m: torch.Tensor, u: float) -> int:
    """Inverse-CDF draw from the integer masses ``m`` [V] (see :func:`quantize_row`).

    Returns the first index i whose inclusive prefix sum of m exceeds
    :func:`draw_threshold` (Z, u), Z = sum(m); that index always has m > 0, and u >= 1
    gives the last index with mass. Returns -1 when the mass is zero (callers handle).
    Integer sums: the result does not depend on any summation order.
    """
    Z = int(m.sum())
    if Z <= 0:
        return -1
    thr = draw_threshold(Z, u)
    csum = torch.cumsum(m, dim=0)
    return int(torch.nonzero(csum > thr)[0, 0])


def _draw(m: torch.Tensor, m_node: torch.Tensor, u: float) -> int:
    tok = sample_from(m, u)
    if tok < 0:  # residual mass 0 (rounding): fall back to the node's own target row
        tok = sample_from(m_node, u)
    if tok < 0:  # the target row itself has no mass: documented rule, token 0
        tok = 0
    return tok


def rejection_sample(tokens: torch.Tensor, parents: torch.Tensor, target_probs: torch.Tensor,
                     draft_probs: Optional[torch.Tensor], uniforms: torch.Tensor
                     ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Tree speculative sampling (SpecInfer multi-step), see ops.rejection_sample.

    The current (residual) distribution of a node is kept as integer masses ``m`` (from
    :func:`quantize_row` of the node's target row) with total ``Z``: child c with token x
    is accepted iff q_c(x) > 0 and (u_c * q_c(x)) * double(Z) < double(m[x]) (float64,
    each product rounded); a rejection sets m <- max(0, m - floor(double(Z) * q_c))
    (deterministic candidates: m[x] <- 0).
    """
    B, N = tokens.shape
    dev = tokens.device
    accepted = torch.full((B, N), -1, dtype=torch.int32, device=dev)
    num_accepted = torch.zeros(B, dtype=torch.int32, device=dev)
    out_tokens = torch.full((B, N), -1, dtype=torch.int64, device=dev)
    V = target_probs.shape[2]
    for b in range(B):
        node = 0
        path = [0]
        emitted: List[int] = []
        while True:
            m_node = quantize_row(target_probs[b, node])
            m = m_node.clone()
            Z = int(m.sum())
            chosen = -1
            for c in _children(parents[b], node):
                x = int(tokens[b, c])
                if x < 0 or x >= V:  # unchecked bad token: never accepted, never read
                    continue
                qx = 1.0 if draft_probs is None else float(draft_probs[b, c, x])
                # accept iff u < p(x) / q(x) with p = m / Z, i.e. u * q(x) * Z < m(x)
                if qx > 0.0 and float(uniforms[b, c]) * qx * float(Z) < float(m[x]):
                    chosen = c
                    break
                if draft_probs is None:
                    m[x] = 0
                else:
                    m = torch.clamp(m - _scaled_mass(Z, draft_probs[b, c]), min=0)
                Z = int(m.sum())
            if chosen >= 0:
                path.append(chosen)
                emitted.append(int(tokens[b, chosen]))
                node = chosen
                continue
            emitted.append(_draw(m, m_node, float(uniforms[b, 0])))
            break
        accepted[b, : len(path)] = torch.tensor(path, dtype=torch.int32)
        num_accepted[b] = len(path) - 1
        out_tokens[b, : len(emitted)] = torch.tensor(emitted, dtype=torch.int64)
    return accepted, num_accepted, out_tokens


def _argmax_first(row: torch.Tensor) -> int:
    """First index of the maximum; NaN counts as the maximum (torch.argmax semantics)."""
    row = row.float()
    nan = torch.isnan(row)
    if bool(nan.any()):
        return int(torch.nonzero(nan)[0, 0])
    m = row.max()
    return int(torch.nonzero(row == m)[0, 0])


def greedy_verify(tokens: torch.Tensor, parents: torch.Tensor, target_logits: torch.Tensor
                  ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Greedy tree verification: accept the child whose token is the target argmax (target_logits int64 [B, N]:
    the argmax at each node, already taken)."""
    B, N = tokens.shape
    predicts = target_logits.dtype == torch.int64
    dev = tokens.device
    accepted = torch.full((B, N), -1, dtype=torch.int32, device=dev)
    num_accepted = torch.zeros(B, dtype=torch.int32, device=dev)
    out_tokens = torch.full((B, N), -1, dtype=torch.int64, device=dev)
    for b in range(B):
        node = 0
        path = [0]
        emitted: List[int] = []
        while True:
            best = int(target_logits[b, node]) if predicts else _argmax_first(target_logits[b, node])
            chosen = -1
            for c in _children(parents[b], node):
                if int(tokens[b, c]) == best:
                    chosen = c
                    break
            if chosen < 0:
                emitted.append(best)
                break
            path.append(chosen)
            emitted.append(best)
            node = chosen
        accepted[b, : len(path)] = torch.tensor(path, dtype=torch.int32)
        num_accepted[b] = len(path) - 1
        out_tokens[b, : len(emitted)] = torch.tensor(emitted, dtype=torch.int64)
    return accepted, num_accepted, out_tokens


# --------------------------------------------------------------------------- cache
def kv_commit(k_caches: Sequence[torch.Tensor], v_caches: Sequence[torch.Tensor],
              cache_lens: torch.Tensor, accepted: torch.Tensor,
              num_accepted: torch.Tensor) -> None:
    """Compact the accepted path in place, then cache_lens += num_accepted + 1."""
    B = cache_lens.shape[0]
    for b in range(B):
        L = int(cache_lens[b])
        n = int(num_accepted[b])
        src = [L + int(accepted[b, i]) for i in range(n + 1)]
        for cache in list(k_caches) + list(v_caches):
            # ascending order is overlap-safe: src[i] >= L + i and src is increasing
            for i in range(n + 1):
                if src[i] != L + i:
                    cache[b, :, L + i] = cache[b, :, src[i]]
        cache_lens[b] = L + n + 1


# --------------------------------------------------------------------------- linear
def linear(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None,
           weight_scale: Optional[torch.Tensor] = None) -> torch.Tensor:
    """x [..., K] @ weight[N, K].T (* weight_scale[N] for int8 weights) (+ bias[N]).

    Accumulated in float64 here (the kernels accumulate in float32 in their own order),
    rounded once to x's dtype.
    """
    y = x.double() @ weight.double().T
    if weight_scale is not None:
        y = y * weight_scale.double()
    if bias is not None:
        y = y + bias.double()
    return y.to(x.dtype)


def dequantize_groups(qweight: torch.Tensor, scales: torch.Tensor, mins: Optional[torch.Tensor],
                      bits: int) -> torch.Tensor:
    """The float64 [N, K] weight a group-quantized weight stands for (see ops.qlinear)."""
    N = qweight.shape[0]
    G = scales.shape[1]
    if bits == 8:
        codes = qweight.double().reshape(N, G, 32)
    else:
        b = qweight.to(torch.int64).reshape(N, G, 16)
        codes = torch.cat([b & 15, b >> 4], dim=2).double()
        if mins is None:
            codes = codes - 8.0
    w = codes * scales.double()[..., None]
    if mins is not None:
        w = w + mins.double()[..., None]
    return w.reshape(N, G * 32)


def qlinear(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, mins: Optional[torch.Tensor],
            bias: Optional[torch.Tensor], bits: int, act: Optional[str] = None) -> torch.Tensor:
    """x [..., K] @ dequantize_groups(...).T (+ bias), float64, rounded once to x's dtype; act="q8":
    the quantized-activation definition (specdec.reference_q8act)."""
    if act == "q8":
        from specdec.reference_q8act import qlinear_q8act

        return qlinear_q8act(x, qweight, scales, mins, bias, bits)
    y = x.double() @ dequantize_groups(qweight, scales, mins, bits).T
    if bias is not None:
        y = y + bias.double()
    return y.to(x.dtype)


def linear_argmax(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None,
                  weight_scale: Optional[torch.Tensor] = None) -> torch.Tensor:
    """First index of each row's maximum of :func:`linear` (NaN counts as the maximum), int64 [...]."""
    return _argmax_rows(linear(x, weight, bias, weight_scale))


def qlinear_argmax(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, mins: Optional[torch.Tensor],
                   bias: Optional[torch.Tensor], bits: int, act: Optional[str] = None) -> torch.Tensor:
    """First index of each row's maximum of :func:`qlinear`, int64 [...]."""
    return _argmax_rows(qlinear(x, qweight, scales, mins, bias, bits, act))


def _argmax_rows(y: torch.Tensor) -> torch.Tensor:
    rows = y.reshape(-1, y.shape[-1])
    return torch.tensor([_argmax_first(r) for r in rows], dtype=torch.int64).view(y.shape[:-1])


# --------------------------------------------------------------------------- fused small ops
# The unfused torch expressions of transformers' Llama modules, step by step in the
# tensor's dtype (each op rounds where torch rounds). rope's kernels are bit-identical to
# this; rms_norm (sum of squares) and silu_mul (exp) agree within float32 rounding.
def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``weight * (x32 * rsqrt(mean(x32^2) + eps)).to(dtype)`` over the last dim (LlamaRMSNorm)."""
    x32 = x.float()
    r = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * r.to(x.dtype)


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                 eps: float) -> Tuple[torch.Tensor, torch.Tensor]:
    """``(rms_norm(s), s)`` with ``s = x + residual`` in x's dtype (the residual stream)."""
    s = x + residual
    return rms_norm(s, weight, eps), s


def rope(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """Rotate-half RoPE: ``x * cos + rotate_half(x) * sin`` for q [B, N, Hq, D] and k [B, N, Hkv, D];
    cos / sin [B, N, D] (the model's rotary tables at each node's position), broadcast over heads."""
    c, s = cos.unsqueeze(2), sin.unsqueeze(2)

    def one(x):
        half = x.shape[-1] // 2
        rot = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
        return x * c + rot * s
    return one(q), one(k)


def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` (the SwiGLU MLP's activation), in gate's dtype."""
    return torch.nn.functional.silu(gate) * up


# --------------------------------------------------------------------------- decoder layer
def decoder_layer(x: torch.Tensor, h: torch.Tensor, weights, scales, mins, biases, bits,
                  post_norm_weight: torch.Tensor, post_norm_eps: float, next_norm_weight: torch.Tensor,
                  next_norm_eps: float, k_cache: torch.Tensor, v_cache: torch.Tensor, cache_lens: torch.Tensor,
                  cos: torch.Tensor, sin: torch.Tensor, tree_mask: Optional[torch.Tensor], kv_offset: int,
                  scale: float, num_heads: int, num_kv_heads: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """One Llama-style decoder layer from the reference ops (see specdec.ops.decoder_layer)."""
    return decoder_layer_with(sys.modules[__name__], x, h, weights, scales, mins, biases, bits, post_norm_weight,
                              post_norm_eps, next_norm_weight, next_norm_eps, k_cache, v_cache, cache_lens, cos,
                              sin, tree_mask, kv_offset, scale, num_heads, num_kv_heads)


def decoder_layer_with(impl, x, h, weights, scales, mins, biases, bits, post_norm_weight, post_norm_eps,
                       next_norm_weight, next_norm_eps, k_cache, v_cache, cache_lens, cos, sin, tree_mask,
                       kv_offset, scale, num_heads, num_kv_heads):
    """The decoder layer's sequence of ops taken from ``impl`` (this module, or specdec.ops: the
    separate compiled ops, which ops.decoder_layer must equal bit for bit)."""
    B, N, _ = x.shape
    D = k_cache.shape[-1]
    nq, nkv = num_heads * D, num_kv_heads * D
    seven = len(weights) == 7

    def proj(i, inp):
        if bits[i] == 0:
            return impl.linear(inp, weights[i], biases[i], scales[i])
        q8 = bits[i] & 32  # decoder_layer's flag: the slot quantizes its activations
        return impl.qlinear(inp, weights[i], scales[i], mins[i], biases[i], bits[i] & ~32, act="q8" if q8 else None)

    if seven:
        q, k, v = proj(0, x), proj(1, x), proj(2, x)
    else:
        q, k, v = proj(0, x).split([nq, nkv, nkv], dim=-1)
    q, k = impl.rope(q.reshape(B, N, num_heads, D), k.reshape(B, N, num_kv_heads, D), cos, sin)
    impl.append_kv(k_cache, v_cache, k.transpose(1, 2), v.reshape(B, N, num_kv_heads, D).transpose(1, 2),
                   cache_lens, kv_offset)
    a = impl.verify_attention(q, k_cache, v_cache, cache_lens, tree_mask, scale)
    x, h = impl.add_rms_norm(proj(3 if seven else 1, a.reshape(B, N, nq)), h, post_norm_weight, post_norm_eps)
    if seven:
        g, u = proj(4, x), proj(5, x)
    else:
        g, u = proj(2, x).chunk(2, dim=-1)
    return impl.add_rms_norm(proj(len(weights) - 1, impl.silu_mul(g, u)), h, next_norm_weight, next_norm_eps)
