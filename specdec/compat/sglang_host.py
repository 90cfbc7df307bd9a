"""The exact form of :func:`specdec.compat.sglang.tree_speculative_sampling_target_only` for
batches on the CPU, computed on the host.

The tensor form (``sglang._exact_inputs``) turns SGLang's coins into specdec's per-child uniforms
with a few dozen small tensor operations and a float32 sum of every row that has children. Here
the same numbers come from a C++ routine over NumPy views of the same memory
(csrc/host/sglang_host.cpp: no copies, no dispatcher, no per-child Python; or, with ``NATIVE`` off
and where it declines, NumPy array operations), and only the rows the walk can reach are summed:

* the tree (first child / next sibling links) is walked once per distinct batch of links and kept
  (:func:`specdec.compat.sglang_tree.walk_lists`, a small LRU keyed by the links' bytes);
* each child's uniform is ``(u - P_prev) / (S_row - P_prev)`` with the same float64 operations as
  the tensor form. ``P_prev`` (the earlier siblings' mass) is a sum of at most two nonzero terms
  here, whose value does not depend on the order; with three or more earlier siblings, or a mass
  that is not finite, torch's own reduction over the same [B, N, N] masks computes it, as there;
* a row sum (float32, one row or one node column at a time: torch gives a row the same value
  inside any batch) is computed only for the roots and for nodes whose coin does not clearly
  reject them. The op reads a node's uniform only when it stands at the node's parent, so a
  skipped row cannot change the result unless the walk reaches it; when it does (rows with
  negative or infinite entries can defeat the guess), the remaining sums are computed and the op
  runs again. The integers are therefore those of the tensor form in every case.

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

_SLACK = 1e-3  # relative margin of the reachability guess (only speed depends on it)
NATIVE = True  # the per-child work in C++ (False: NumPy arrays; tests compare both)


class _Tree(NamedTuple):
    par_t: torch.Tensor      # [B, N] int32, the op's parents (callers only read it)
    kb: np.ndarray           # request of each child (row-major order: parents before children)
    ki: np.ndarray           # node of each child
    kflat: np.ndarray        # b * N + node of each child
    pflat: np.ndarray        # b * N + parent of each child
    earlier: np.ndarray      # [children, K] positions of each child's earlier siblings (pad: len(kb))
    has_kids: np.ndarray     # [B * N] bool
    roots: np.ndarray        # b * N of each request
    root_rows: np.ndarray    # [B * N] bool: the roots that have children (read only)
    mask: list               # [B, N, N] float64 sibling masks of the tensor form, made when first needed
    lists: tuple             # (kflat, pflat, has_kids) as Python lists (the greedy form's walk, the missing-row check)


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
        has_kids = np.zeros(B * N, dtype=bool)
        has_kids[kb * N + kp] = True
        roots = np.arange(B, dtype=np.int64) * N
        root_rows = np.zeros(B * N, dtype=bool)
        root_rows[roots] = True
        kflat, pflat = kb * N + ki, kb * N + kp
        tree = _Tree(torch.from_numpy(par), kb, ki, kflat, pflat, earlier, has_kids, roots, root_rows & has_kids,
                     [], (kflat.tolist(), pflat.tolist(), has_kids.tolist()))
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
    if NATIVE and _sample_native(fn, tree, predicts, accept_index, accept_token_num, candidates, ri, uniform_samples,
                      uniform_final, probs, B, N, V, S):
        return True
    cand = candidates.numpy().reshape(-1)
    tk = cand[tree.kflat].astype(np.int64)
    if tk.size and (tk.min() < 0 or tk.max() >= V):  # padding may hold anything: only the tree's nodes
        k = int(np.flatnonzero((tk < 0) | (tk >= V))[0])
        raise err(fn, f"candidates[{tree.kb[k]}, {tree.ki[k]}]", f"a token in [0, {V})", int(tk[k]))
    tokens = np.full(B * N, -1, dtype=np.int64)
    tokens[tree.kflat] = tk
    tokens[tree.roots] = np.minimum(np.maximum(cand[tree.roots], 0), V - 1)
    p_child = probs.numpy().reshape(-1)[tree.pflat * V + tk].astype(np.float64)  # float32 values, exactly
    coin = uniform_samples.numpy().reshape(-1)[tree.pflat].astype(np.float64)
    if tree.earlier.shape[1]:
        dup = (np.append(tk, -1)[tree.earlier] == tk[:, None]).any(1)
        mass = np.where(dup, 0.0, p_child)
    else:
        mass = p_child
    p_prev = _earlier_mass(tree, mass, B, N)
    sums = np.full(B * N, np.nan)
    known = np.zeros(B * N, dtype=bool)
    _row_sums(probs, _reachable(tree, coin, p_prev, p_child, B, N), sums, known, N)
    final = _unit(uniform_final.numpy().reshape(B).astype(np.float64))
    tok_t = torch.from_numpy(tokens).view(B, N)
    while True:
        u = _uniforms(tree, coin, p_prev, sums, known, final, B, N)
        accepted, num, out = ops.rejection_sample(tok_t, tree.par_t, probs, None, torch.from_numpy(u).view(B, N))
        acc = accepted.numpy()
        on = acc >= 0
        node = (np.where(on, acc, 0) + tree.roots[:, None]).reshape(-1)
        on = on.reshape(-1)
        if num.numpy().max() == 0 and not (tree.root_rows & ~known).any():
            break  # every walk ended at its root, whose sum is known
        if not (on & tree.has_kids[node] & ~known[node]).any():
            break  # every row the walks stood on was summed
        _row_sums(probs, tree.has_kids & ~known, sums, known, N)  # now u is the tensor form's everywhere
    flat = np.where(on, np.array(ri)[node], -1).reshape(B, N)
    w = min(S, N)
    ai = np.full((B, S), -1, dtype=np.int64)
    ai[:, :w] = flat[:, :w]
    accept_index.copy_(torch.from_numpy(ai))
    accept_token_num.copy_(num)
    sel = flat >= 0
    vals = torch.from_numpy(out.numpy()[sel])
    predicts[torch.from_numpy(flat[sel])] = vals if predicts.dtype == vals.dtype else vals.to(predicts.dtype)
    return True


def verify_greedy_host(fn, predicts, accept_index, accept_token_num, candidates, ri: list, retrive_next_token,
                       retrive_next_sibling, target_predict) -> bool:
    """:func:`specdec.compat.sglang.verify_tree_greedy` on the host (CPU tensors, int32 / int64
    outputs): the walked tree kept per distinct batch of links, each child's symbol (0: its
    candidate equals the target's token at its parent) in Python, the op on kept buffers, the
    outputs written with one NumPy assignment each. False (nothing written) for trees whose
    numbering is not SGLang's builder order. ``ri``: ``retrive_index`` as a flat list."""
    B, N = candidates.shape
    S = accept_index.shape[1]
    tree = _tree(fn, retrive_next_token, retrive_next_sibling, N, S - 1)
    if tree is None:
        return False
    kflat, pflat = tree.lists[0], tree.lists[1]
    cand = [x for row in candidates.tolist() for x in row]
    tp = target_predict.tolist() if target_predict.dim() == 1 else target_predict.reshape(-1).tolist()
    tokens = [-1] * (B * N)
    tokens[::N] = [0] * B
    for k, p in zip(kflat, pflat):
        tokens[k] = 0 if cand[k] == tp[ri[p]] else 1
    tok_t, tok_np, _, _ = _buffers(B, N)
    tok_np[:] = tokens
    accepted, num, _ = ops.greedy_verify(tok_t, tree.par_t, _two_symbol_logits(B, N))
    acc, nums = accepted.tolist(), num.tolist()
    out = [[tp[ri[b * N + a]] for a in acc[b][:nums[b] + 1]] for b in range(B)]  # predicts: the target's token
    _write_lists(acc, nums, out, ri, predicts, accept_index, accept_token_num, B, N, S)
    return True


_LOGITS: dict = {}


def _two_symbol_logits(B: int, N: int) -> torch.Tensor:
    """A kept [B, N, 2] float32 tensor whose argmax is symbol 0 everywhere (the op only reads it)."""
    t = _LOGITS.get((B, N))
    if t is None:
        if len(_LOGITS) >= 64:
            _LOGITS.clear()
        t = _LOGITS[(B, N)] = torch.zeros(B, N, 2)
        t[:, :, 0] = 1.0
    return t


def _unit(x: np.ndarray) -> np.ndarray:
    """Clamp to [0, 1], NaN kept (as torch.clamp)."""
    return np.minimum(np.maximum(x, 0.0), 1.0)


def _earlier_mass(tree: _Tree, mass: np.ndarray, B: int, N: int) -> np.ndarray:
    """Each child's earlier siblings' mass (float64), as the tensor form computes it."""
    if np.isfinite(mass).all():  # else 0 * inf = NaN reaches every node of the request there
        if tree.earlier.shape[1] == 0:
            return np.zeros(mass.shape)
        if tree.earlier.shape[1] <= 2:  # at most two terms: any order, same sum
            return np.append(mass, 0.0)[tree.earlier].sum(1)
    if not tree.mask:
        par = tree.par_t.numpy().astype(np.int64)
        same = (par[:, :, None] == par[:, None, :]) & np.tri(N, k=-1, dtype=bool)[None] & (par >= 0)[:, None, :]
        tree.mask.append(torch.from_numpy(same.astype(np.float64)))
    m = np.zeros(B * N)
    m[tree.kflat] = mass
    full = (tree.mask[0] * torch.from_numpy(m).view(B, 1, N)).sum(-1).numpy().reshape(-1)
    return full[tree.kflat]


def _reachable(tree: _Tree, coin, p_prev, p_child, B: int, N: int) -> np.ndarray:
    """[B * N] bool: the rows with children the walk is likely to stand on (the roots, and children
    whose coin does not clearly reject them, below such a node)."""
    with np.errstate(all="ignore"):
        maybe = np.flatnonzero(~(coin - p_prev > p_child * (1.0 + _SLACK) + 1e-300))  # NaN: maybe
    if not maybe.size:
        return tree.root_rows
    likely = tree.root_rows.copy()
    for k in maybe.tolist():  # parents come before their children
        if likely[tree.pflat[k]]:
            likely[tree.kflat[k]] = True
    return likely & tree.has_kids


def _row_sums(probs: torch.Tensor, rows: np.ndarray, sums: np.ndarray, known: np.ndarray, N: int) -> None:
    """float32 sums of the flat [B * N] ``rows`` (as float64) into ``sums``: a node needed by every
    request in one call over its column, the others one row at a time."""
    B = probs.shape[0]
    need = (rows & ~known).reshape(B, N)
    for r in np.flatnonzero(need.any(0)).tolist():
        bs = np.flatnonzero(need[:, r])
        if bs.size == B:
            sums[r::N] = probs[:, r].sum(-1).numpy()
        else:
            for b in bs.tolist():
                sums[b * N + r] = float(probs[b, r].sum())
    known |= need.reshape(-1)


def _uniforms(tree: _Tree, coin, p_prev, sums, known, final, B: int, N: int) -> np.ndarray:
    """[B * N] float64 uniforms: the tensor form's per-child mapping (1.0 where the parent's row was
    not summed: never read unless the walk gets there, which the caller checks)."""
    with np.errstate(all="ignore"):
        denom = sums[tree.pflat] - p_prev
        pos = denom > 0
        x = _unit(np.where(pos, (coin - p_prev) / np.where(pos, denom, 1.0), 1.0))
    u = np.zeros(B * N)
    u[tree.kflat] = np.where(known[tree.pflat], x, 1.0)
    u[tree.roots] = final
    return u


def _sample_native(fn, tree: _Tree, predicts, accept_index, accept_token_num, candidates, ri: list, uniform_samples,
                   uniform_final, probs, B: int, N: int, V: int, S: int) -> bool:
    """The host form's per-child work in C++ (csrc/host/sglang_host.cpp: the same float64 operations
    in the same order) on NumPy views of the inputs. False (nothing written) when an earlier-sibling
    mass has three or more nonzero terms or a mass is not finite: the array form lets torch reduce
    those. ``ri``: ``retrive_index`` as a flat list."""
    cand = candidates.numpy().reshape(-1)
    coins = uniform_samples.numpy().reshape(-1)
    if coins.dtype not in (np.float32, np.float64):
        coins = coins.astype(np.float64)  # float16: exact in float64
    tok_t, tok_np, u_t, u_np = _buffers(B, N)
    K = len(tree.kflat)
    p_prev, likely = np.empty(K), np.empty(B * N, dtype=bool)
    status = _C.sglang_prepare(cand, coins, probs.numpy(), tree.kflat, tree.pflat, tree.earlier, B, N, V, _SLACK,
                               tok_np, p_prev, likely)
    if status == -2:
        return False
    if status >= 0:
        k = int(tree.kflat[status])
        raise err(fn, f"candidates[{k // N}, {k % N}]", f"a token in [0, {V})", int(cand[k]))
    sums, known = np.full(B * N, np.nan), np.zeros(B * N, dtype=bool)
    _row_sums(probs, likely & tree.has_kids, sums, known, N)
    final = _unit(uniform_final.numpy().reshape(B).astype(np.float64))
    has_kids = tree.lists[2]
    while True:
        _C.sglang_uniforms(tree.kflat, tree.pflat, coins, p_prev, sums, known, final, B, N, u_np)
        accepted, num, out = ops.rejection_sample(tok_t, tree.par_t, probs, None, u_t)
        acc, nums = accepted.tolist(), num.tolist()
        seen = known.tolist()
        if all(seen[r] or not has_kids[r] for r in (b * N + a for b in range(B) for a in acc[b][:nums[b] + 1])):
            break  # every row the walks stood on was summed
        _row_sums(probs, tree.has_kids & ~known, sums, known, N)  # now u is the tensor form's everywhere
    _write_lists(acc, nums, out.tolist(), ri, predicts, accept_index, accept_token_num, B, N, S)
    return True


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
