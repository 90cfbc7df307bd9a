"""The exact form of :func:`specdec.compat.sglang.tree_speculative_sampling_target_only` for
batches on the CPU, computed on the host.

The tensor form (``sglang._exact_inputs``) turns SGLang's coins into specdec's per-child uniforms
with a few dozen small tensor operations. Here the same numbers come from a C++ routine over NumPy
views of the same memory (csrc/host/sglang_host.cpp: no copies, no dispatcher, no per-child Python;
or, with ``NATIVE`` off, NumPy array operations):

* the tree (first child / next sibling links) is walked once per distinct batch of links and kept
  (:func:`specdec.compat.sglang_tree.walk_lists`, a small LRU keyed by the links' bytes);
* each child's uniform is 0.0 where SGLang's test passes (its coin at most the running float32 sum
  of the sibling masses, its own included) and 1.0 where it fails, with the tensor form's
  operations: float32 additions from +0 in sibling order, the coin compared in float64. Only the
  children's own probabilities are read, never a whole row.

Returns False (nothing written) for trees whose numbering is not SGLang's builder order; the
tensor form handles those.
"""
from __future__ import annotations

from collections import OrderedDict
from typing import NamedTuple, Optional

import numpy as np
import torch

from specdec import _C, ops
from specdec.compat.sglang_tree import err, walk_lists

__all__ = ["sample_exact_host", "verify_greedy_host"]


def verify_greedy_host(predicts, accept_index, accept_token_num, candidates, retrive_index, retrive_next_token,
                       retrive_next_sibling, target_predict) -> bool:
    """:func:`specdec.compat.sglang.verify_tree_greedy` in one C++ call (``specdec._C.sglang_greedy``,
    csrc/host/sglang_host.cpp) on NumPy views of the caller's CPU tensors, for the trees SGLang's builder
    emits (links to higher indices, no node reached twice) and int32 / int64 C-contiguous tensors. False,
    with nothing written, for anything else (a CUDA or grad tensor, another dtype or layout, another tree
    numbering, an index out of range): the adapter's general path then checks and decides it."""
    try:
        return bool(_C.sglang_greedy(predicts.numpy(), accept_index.numpy(), accept_token_num.numpy(),
                                     candidates.numpy(), retrive_index.numpy(), retrive_next_token.numpy(),
                                     retrive_next_sibling.numpy(), target_predict.numpy()))
    except (AttributeError, RuntimeError, TypeError):
        return False

NATIVE = True  # the per-child work in C++ (False: NumPy arrays; tests compare both)


class _Tree(NamedTuple):
    par_t: torch.Tensor      # [B, N] int32, the op's parents (callers only read it)
    kb: np.ndarray           # request of each child (row-major order: parents before children)
    ki: np.ndarray           # node of each child
    kflat: np.ndarray        # b * N + node of each child
    pflat: np.ndarray        # b * N + parent of each child
    earlier: np.ndarray      # [children, K] positions of each child's earlier siblings (pad: len(kb))
    roots: np.ndarray        # b * N of each request
    lists: tuple             # (kflat, pflat) as Python lists (the greedy form's walk)


_TREES: "OrderedDict[tuple, Optional[_Tree]]" = OrderedDict()


def _tree(fn: str, next_token: torch.Tensor, next_sibling: torch.Tensor, N: int, depth: int) -> Optional[_Tree]:
    a, b = next_token.numpy(), next_sibling.numpy()
    key = (a.tobytes(), b.tobytes(), a.dtype.str, b.dtype.str, a.shape, depth)
    tree = _TREES.get(key, False)
    if tree is not False:
        return tree
    orders, parents, _ = walk_lists(fn, next_token.tolist(), next_sibling.tolist(), N, depth)
    tree = None
    if all(o == i or o < 0 for row in orders for i, o in enumerate(row)):
        B = a.shape[0]
        par = np.array(parents, dtype=np.int32).reshape(a.shape)
        kb, ki = np.nonzero(par >= 0)
        kp = par[kb, ki].astype(np.int64)
        pos = {}
        groups = []
        for k, (bb, p) in enumerate(zip(kb.tolist(), kp.tolist())):
            g = pos.setdefault((bb, p), [])
            groups.append(list(g))
            g.append(k)
        width = max((len(g) for g in groups), default=0)
        earlier = np.full((len(groups), width), len(groups), dtype=np.int64)
        for k, g in enumerate(groups):
            earlier[k, :len(g)] = g
        roots = np.arange(B, dtype=np.int64) * N
        kflat, pflat = kb * N + ki, kb * N + kp
        tree = _Tree(torch.from_numpy(par), kb, ki, kflat, pflat, earlier, roots, (kflat.tolist(), pflat.tolist()))
    _TREES[key] = tree
    if len(_TREES) > 256:
        _TREES.pop(next(iter(_TREES)))
    return tree


def sample_exact_host(fn, predicts, accept_index, accept_token_num, candidates, ri: list,
                      retrive_next_token, retrive_next_sibling, uniform_samples, uniform_final,
                      target_probs) -> bool:
    """Run the exact form; False (nothing written) when the tree numbering is not the identity.
    ``ri``: ``retrive_index`` as a flat list (read by the range check)."""
    B, N = candidates.shape
    V = target_probs.shape[2]
    S = accept_index.shape[1]
    tree = _tree(fn, retrive_next_token, retrive_next_sibling, N, S - 1)
    if tree is None:
        return False
    probs = target_probs if target_probs.dtype == torch.float32 and target_probs.is_contiguous() \
        else target_probs.to(torch.float32).contiguous()
    final = _unit(uniform_final.numpy().reshape(B).astype(np.float64))
    coins = uniform_samples.numpy().reshape(-1)
    if coins.dtype not in (np.float32, np.float64):
        coins = coins.astype(np.float64)  # float16: exact in float64
    cand = candidates.numpy().reshape(-1)
    tok_t, tok_np, u_t, u_np = _buffers(B, N)
    if NATIVE:
        k = _C.sglang_prepare(cand, coins, probs.numpy(), tree.kflat, tree.pflat, tree.earlier, final, B, N, V,
                              tok_np, u_np)
    else:
        k = _prepare_arrays(tree, cand, coins, probs, final, V, tok_np, u_np)
    if k >= 0:
        k = int(tree.kflat[k])
        raise err(fn, f"candidates[{k // N}, {k % N}]", f"a token in [0, {V})", int(cand[k]))
    accepted, num, out = ops.rejection_sample(tok_t, tree.par_t, probs, None, u_t)
    _write_lists(accepted.tolist(), num.tolist(), out.tolist(), ri, predicts, accept_index, accept_token_num,
                 B, N, S)
    return True


def _prepare_arrays(tree: _Tree, cand, coins, probs: torch.Tensor, final, V: int, tokens, u) -> int:
    """sglang_prepare (csrc/host/sglang_host.cpp) in NumPy arrays: the op's tokens and uniforms into
    ``tokens`` / ``u``; -1, or the position of the first child whose candidate is not a token."""
    tk = cand[tree.kflat].astype(np.int64)
    if tk.size and (tk.min() < 0 or tk.max() >= V):  # padding may hold anything: only the tree's nodes
        return int(np.flatnonzero((tk < 0) | (tk >= V))[0])
    tokens[:] = -1
    tokens[tree.kflat] = tk
    tokens[tree.roots] = np.minimum(np.maximum(cand[tree.roots], 0), V - 1)
    mass = probs.numpy().reshape(-1)[tree.pflat * V + tk]  # float32
    run = np.zeros(len(tk), dtype=np.float32)
    if tree.earlier.shape[1]:
        dup = (np.append(tk, -1)[tree.earlier] == tk[:, None]).any(1)
        mass = np.where(dup, np.float32(0.0), mass)
        padded = np.append(mass, np.float32(0.0))
        for w in range(tree.earlier.shape[1]):  # float32 additions in sibling order
            run = run + padded[tree.earlier[:, w]]
    run = run + mass
    u[:] = 0.0
    with np.errstate(invalid="ignore"):
        u[tree.kflat] = np.where(coins[tree.pflat].astype(np.float64) <= run.astype(np.float64), 0.0, 1.0)
    u[tree.roots] = final
    return -1


def _unit(x: np.ndarray) -> np.ndarray:
    """Clamp to [0, 1], NaN kept (as torch.clamp)."""
    return np.minimum(np.maximum(x, 0.0), 1.0)


_BUFFERS: "OrderedDict[tuple, tuple]" = OrderedDict()


def _buffers(B: int, N: int):
    """Kept CPU tensors for the op's tokens [B, N] int64 and uniforms [B, N] float64, with flat NumPy
    views, per (B, N). Their contents are valid during one call: not for concurrent calls from
    several threads (like :func:`specdec.compat.common.workspace`)."""
    got = _BUFFERS.get((B, N))
    if got is None:
        if len(_BUFFERS) >= 64:
            _BUFFERS.popitem(last=False)
        tok, u = torch.zeros(B, N, dtype=torch.int64), torch.zeros(B, N, dtype=torch.float64)
        got = _BUFFERS[(B, N)] = (tok, tok.numpy().reshape(-1), u, u.numpy().reshape(-1))
    return got


def _write_lists(acc, num, out, ri, predicts, accept_index, accept_token_num, B, N, S) -> None:
    """SGLang's outputs, written through NumPy views of the caller's CPU tensors (int32 / int64): one
    write per output. ``acc`` / ``num`` / ``out``: the op's outputs as lists; ``ri``: flat list."""
    rows, idx, vals = [], [], []
    for b in range(B):
        k = num[b] + 1  # path length (root included), at most min(S, N)
        flat = [ri[b * N + a] for a in acc[b][:k]]
        rows += flat
        rows += [-1] * (S - k)
        idx += flat
        vals += out[b][:k]  # at each path node the token after it: the next draft, then the final draw
    ai = accept_index.numpy()
    if accept_index.is_contiguous():
        ai.reshape(B * S)[:] = rows  # a flat view: one write
    else:
        ai[:] = np.array(rows).reshape(B, S)
    accept_token_num.numpy()[:] = num
    predicts.numpy()[idx] = vals  # repeated indices: the last value, as index_put_ on the CPU
