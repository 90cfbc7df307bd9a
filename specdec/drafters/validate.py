"""Host-side validation of proposals from drafters that are not ``trusted`` (user subclasses).

The engine calls :func:`draft_errors` before the target runs, so a bad proposal never reaches a
cache: shapes, node count against the reserved ``max_nodes``, topological parents, vocabulary
range; every message names the drafter and the request.
"""
from __future__ import annotations

from typing import Optional, Sequence

import torch

from specdec.drafters.base import Draft
from specdec.tree import TokenTree

__all__ = ["check_draft", "draft_errors"]


def check_draft(draft, name: str, request_ids: Sequence[int], vocab_size: int, max_nodes: int,
                roots: Optional[Sequence[int]] = None) -> None:
    """Validate a proposal on the host; raise naming the drafter ``name`` and the request.

    Checks: a :class:`Draft` holding a :class:`TokenTree` of [b, N] int64 tokens / int32 parents,
    N <= ``max_nodes`` (what the caches reserve), node 0 the root (parent -1; its token
    ``roots[r]`` when given), every other parent -1 (padding) or < its index (topological), real
    nodes' tokens in [0, vocab_size), depths = parent's depth + 1, draft_probs float32 [b, N, V]
    when given. Reads the tree on the host.
    """
    fatal, bad = draft_errors(draft, name, request_ids, vocab_size, max_nodes, roots)
    if fatal is not None:
        raise fatal
    if bad:
        raise ValueError(bad[min(bad)])


def draft_errors(draft, name: str, request_ids: Sequence[int], vocab_size: int, max_nodes: int,
                 roots: Optional[Sequence[int]] = None):
    """The checks of :func:`check_draft` without raising: (an exception for a proposal that is unusable
    as a whole, or None; {row: message} for the rows whose tree is invalid)."""
    try:
        return None, _draft_rows(draft, name, request_ids, vocab_size, max_nodes, roots)
    except (TypeError, ValueError) as exc:
        return exc, {}


def _draft_rows(draft, name, request_ids, vocab_size, max_nodes, roots):
    b = len(request_ids)
    if not isinstance(draft, Draft) or not isinstance(getattr(draft, "tree", None), TokenTree):
        raise TypeError(f"{name}: propose must return a specdec Draft holding a TokenTree, got {type(draft).__name__}")
    tree = draft.tree
    tok, par, dep = tree.tokens, tree.parents, tree.depths
    if tok.dim() != 2 or tok.shape[0] != b or tok.dtype != torch.int64:
        raise ValueError(f"{name}: tree tokens must be int64 [b, N] with b = {b} active requests, got "
                         f"{tok.dtype} {tuple(tok.shape)}")
    N = tok.shape[1]
    if par.shape != tok.shape or par.dtype != torch.int32 or dep.shape != tok.shape:
        raise ValueError(f"{name}: tree parents must be int32 and depths [b, N] = {tuple(tok.shape)}, got parents "
                         f"{par.dtype} {tuple(par.shape)}, depths {tuple(dep.shape)}")
    if draft.draft_probs is not None:
        q = draft.draft_probs
        if q.dim() != 3 or tuple(q.shape[:2]) != (b, N) or q.shape[2] != vocab_size or q.dtype != torch.float32:
            raise ValueError(f"{name}: draft_probs must be float32 [b, N, V] = [{b}, {N}, {vocab_size}], got "
                             f"{q.dtype} {tuple(q.shape)}")
    rows = list(zip(tok.tolist(), par.tolist(), dep.tolist()))
    if N > max_nodes:
        real = [1 + sum(p >= 0 for p in ps[1:]) for _, ps, _ in rows]
        r = max(range(b), key=lambda i: real[i])
        raise ValueError(f"{name}: request {request_ids[r]}: the proposal has {N} nodes per request ({real[r]} real), "
                         f"more than the {max_nodes} the caches reserve (the drafter's max_nodes)")
    bad = {}
    for r, (ts, ps, ds) in enumerate(rows):
        msg = _row_error(ts, ps, ds, N, vocab_size, None if roots is None else roots[r])
        if msg is not None:
            bad[r] = f"{name}: request {request_ids[r]}: {msg}"
    return bad


def _row_error(ts, ps, ds, N, vocab_size, root) -> Optional[str]:
    if ps[0] != -1:
        return f"node 0 must be the root (parent -1), got parent {ps[0]}"
    if root is not None and ts[0] != root:
        return f"node 0 must hold the root token {root} (the last emitted token), got {ts[0]}"
    for i in range(1, N):
        p = ps[i]
        if p == -1:
            continue  # padding
        if not 0 <= p < i:
            return f"node {i} has parent {p}; parents must be -1 (padding) or a node index < {i} (topological order)"
        if not 0 <= ts[i] < vocab_size:
            return f"node {i} holds token {ts[i]}, outside the vocabulary [0, {vocab_size})"
        if ds[i] != ds[p] + 1:
            return f"node {i} has depth {ds[i]} but its parent {p} has depth {ds[p]}"
    return None
