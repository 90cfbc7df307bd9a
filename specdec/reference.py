"""Pure-torch reference of every specdec op: the executable specification.

Written for clarity, not speed. Every compiled kernel (C++ CPU, CUDA) must agree
with these functions: integer outputs exactly, float outputs within the tolerance
justified in the tests. See docs in ``specdec/ops.py`` for the full contract.

Conventions (DESIGN.md):
  * B requests, N tree nodes per request, V vocabulary, Hq / Hkv heads, D head dim,
    S cache capacity.
  * Node 0 is the root (the last committed token). Nodes are topologically
    ordered: ``parents[b, i] < i`` for real nodes, ``parents[b, 0] == -1``.
    Padding nodes have parent -1 and token -1 (they are never anyone's child).
  * Probability arithmetic: the current (residual) distribution is kept
    UNNORMALISED as ``r`` in float64 with mass ``Z = sum(r)``; the normalised
    distribution is ``r / Z``. Sums and the inverse-CDF scan run in float64 so that
    the summation order of a backend changes results only on exact ties
    (measure-zero events), which is what makes CPU and CUDA integer outputs agree.
"""
from __future__ import annotations

from typing import List, Optional, Sequence, Tuple

import torch

__all__ = [
    "verify_attention",
    "append_kv",
    "rejection_sample",
    "greedy_verify",
    "kv_commit",
    "linear",
    "sample_from",
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
def _children(parents_b: torch.Tensor, node: int) -> List[int]:
    N = parents_b.shape[0]
    return [c for c in range(node + 1, N) if int(parents_b[c]) == node]


def sample_from(r: torch.Tensor, u: float) -> int:
    """Inverse-CDF draw from the unnormalised float64 distribution ``r`` [V].

    Returns the first index i with cumsum(r)[i] > u * sum(r). When rounding leaves
    the threshold at or above the last partial sum (u very close to 1), the last
    index with r > 0 is returned. Returns -1 when the mass is zero (callers handle).
    """
    Z = float(r.sum())
    if not Z > 0.0:
        return -1
    threshold = u * Z
    csum = torch.cumsum(r, dim=0)
    hit = torch.nonzero(csum > threshold)
    if hit.numel() > 0:
        idx = int(hit[0, 0])
        # csum is strictly increasing only over r > 0; the first crossing is always at r > 0.
        return idx
    nz = torch.nonzero(r > 0)
    return int(nz[-1, 0])


def _draw(r: torch.Tensor, p_node: torch.Tensor, u: float) -> int:
    tok = sample_from(r, u)
    if tok < 0:  # residual mass 0 (rounding): fall back to the node's own target p
        tok = sample_from(p_node, u)
    if tok < 0:  # the target row itself has no mass: documented rule, token 0
        tok = 0
    return tok


def rejection_sample(tokens: torch.Tensor, parents: torch.Tensor, target_probs: torch.Tensor,
                     draft_probs: Optional[torch.Tensor], uniforms: torch.Tensor
                     ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Tree speculative sampling (SpecInfer multi-step), see ops.rejection_sample."""
    B, N = tokens.shape
    dev = tokens.device
    accepted = torch.full((B, N), -1, dtype=torch.int32, device=dev)
    num_accepted = torch.zeros(B, dtype=torch.int32, device=dev)
    out_tokens = torch.full((B, N), -1, dtype=torch.int64, device=dev)
    for b in range(B):
        node = 0
        path = [0]
        emitted: List[int] = []
        while True:
            p_node = target_probs[b, node].double()
            r = p_node.clone()
            Z = float(r.sum())
            chosen = -1
            for c in _children(parents[b], node):
                x = int(tokens[b, c])
                if draft_probs is None:
                    qx = 1.0
                else:
                    qx = float(draft_probs[b, c, x])
                # accept iff u < p(x) / q(x) with p = r / Z, i.e. u * q(x) * Z < r(x)
                if qx > 0.0 and float(uniforms[b, c]) * qx * Z < float(r[x]):
                    chosen = c
                    break
                # reject: r <- max(0, r - Z * q_c)   (still unnormalised)
                if draft_probs is None:
                    r[x] = 0.0
                else:
                    r = torch.clamp(r - Z * draft_probs[b, c].double(), min=0.0)
                Z = float(r.sum())
            if chosen >= 0:
                path.append(chosen)
                emitted.append(int(tokens[b, chosen]))
                node = chosen
                continue
            emitted.append(_draw(r, p_node, float(uniforms[b, 0])))
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
    """Greedy tree verification: accept the child whose token is the target argmax."""
    B, N = tokens.shape
    dev = tokens.device
    accepted = torch.full((B, N), -1, dtype=torch.int32, device=dev)
    num_accepted = torch.zeros(B, dtype=torch.int32, device=dev)
    out_tokens = torch.full((B, N), -1, dtype=torch.int64, device=dev)
    for b in range(B):
        node = 0
        path = [0]
        emitted: List[int] = []
        while True:
            best = _argmax_first(target_logits[b, node])
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
