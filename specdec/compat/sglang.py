"""SGLang (sgl-kernel) call conventions over specdec's tree ops.

SGLang keeps a request's draft tree in first-child / next-sibling form: for local node
``i`` of request ``b`` (node 0 is the root, the last committed token),
``retrive_next_token[b, i]`` is its first child and ``retrive_next_sibling[b, i]`` its
next sibling (int64, -1 = none); ``retrive_index[b, i]`` is the node's flat index into the
batch's ``bs * num_draft_tokens`` candidate buffers (``predicts``, ``target_predict``).
Children are tried in sibling-chain order. specdec uses parent form (``tokens`` /
``parents`` / ``depths`` with ``parents[b, i] < i``, see docs/design.md "The tree layout").

Entry points:

* :func:`sglang_to_parents` / :func:`parents_to_sglang`: the tree conversion, both ways.
* :func:`verify_tree_greedy`: sgl-kernel's greedy tree verification, outputs in place,
  computed by :func:`specdec.ops.greedy_verify`. Integer outputs equal SGLang's exactly.
* :func:`tree_speculative_sampling_target_only`: sgl-kernel's target-only tree sampler
  (deterministic candidates, q one-hot), computed by :func:`specdec.ops.rejection_sample`
  with SGLang's uniforms mapped onto per-child tests (see its docstring). Only the exact
  form (``threshold_single == threshold_acc == 1.0``) maps onto the exact op; SGLang's lossy
  thresholds < 1 follow SGLang's own walk (:mod:`specdec.compat.sglang_lossy`).
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch

from specdec import ops
from specdec.compat.sglang_host import sample_exact_host, verify_greedy_host
from specdec.compat.sglang_lossy import lossy_sample
from specdec.compat.sglang_tree import err as _err
from specdec.compat.sglang_tree import check_2d as _check_2d
from specdec.compat.sglang_tree import tree_tensors, walk_tree

__all__ = ["sglang_to_parents", "parents_to_sglang", "verify_tree_greedy",
           "tree_speculative_sampling_target_only"]


# --------------------------------------------------------------------------- conversion
def sglang_to_parents(retrive_next_token: torch.Tensor, retrive_next_sibling: torch.Tensor,
                      candidates: Optional[torch.Tensor] = None, *, max_depth: Optional[int] = None
                      ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """First-child / next-sibling form -> specdec parent form.

    ``retrive_next_token`` / ``retrive_next_sibling``: [bs, N] integer, -1 = none; node 0 is
    each request's root. ``candidates`` [bs, N]: the local nodes' tokens (optional).
    ``max_depth``: drop nodes deeper than this (SGLang's walk stops after
    ``num_spec_step - 1`` accepted tokens). Nodes not reachable from the root are padding.

    Returns ``(tokens [bs, N] int64, parents [bs, N] int32, depths [bs, N] int32,
    order [bs, N] int64)`` with ``order[b, i]`` the local SGLang node of specdec node i
    (-1 for padding). When the local numbering is already topological with each sibling
    chain in increasing index order (what SGLang's tree builder emits) ``order`` is the
    identity on the reachable nodes; otherwise nodes are renumbered in depth-first
    preorder, which keeps each sibling chain's order. Padding gets token -1, parent -1,
    depth 0. Raises ``ValueError`` for out-of-range links, cycles and nodes reachable twice.
    """
    fn = "sglang_to_parents"
    orders, parents, depths = walk_tree(fn, retrive_next_token, retrive_next_sibling, max_depth)
    dev = retrive_next_token.device
    order = torch.tensor(orders, dtype=torch.int64, device=dev).reshape(retrive_next_token.shape)
    par = torch.tensor(parents, dtype=torch.int32, device=dev).reshape(retrive_next_token.shape)
    dep = torch.tensor(depths, dtype=torch.int32, device=dev).reshape(retrive_next_token.shape)
    if candidates is None:
        tokens = torch.full_like(order, -1)
        tokens[:, 0] = 0
        tokens[order >= 0] = 0
    else:
        _check_2d(fn, "candidates", candidates, tuple(retrive_next_token.shape))
        tokens = torch.gather(candidates.to(torch.int64), 1, order.clamp(min=0))
        tokens[order < 0] = -1
    return tokens, par, dep, order


def parents_to_sglang(tokens: torch.Tensor, parents: torch.Tensor
                      ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """specdec parent form -> SGLang's ``(candidates, retrive_index, retrive_next_token,
    retrive_next_sibling)``, all [bs, N] int64.

    ``parents[b, 0] == -1`` and ``-1 <= parents[b, i] < i``; ``parents[b, i] == -1`` for
    i > 0 marks padding, which gets no links (and is unreachable). Children keep their
    index order as the sibling chain. ``retrive_index[b, i] = b * N + i``; ``candidates``
    are the tokens as given. Raises ``ValueError`` for a malformed tree (a parent out of
    range or not before its child, or a real node hanging under a padding node).
    """
    fn = "parents_to_sglang"
    _check_2d(fn, "tokens", tokens)
    _check_2d(fn, "parents", parents, tuple(tokens.shape))
    B, N = tokens.shape
    pl = parents.tolist()
    nxt = [[-1] * N for _ in range(B)]
    sib = [[-1] * N for _ in range(B)]
    for b in range(B):
        row = pl[b]
        if N and row[0] != -1:
            raise _err(fn, f"parents[{b}, 0]", "-1 (node 0 is the root)", row[0])
        real = [False] * N
        if N:
            real[0] = True
        last_child = [-1] * N
        for i in range(1, N):
            p = row[i]
            if p == -1:
                continue
            if not (0 <= p < i):
                raise _err(fn, f"parents[{b}, {i}]", f"-1 or a node index in [0, {i}) (topological order)", p)
            if not real[p]:
                raise _err(fn, f"parents[{b}, {i}]", "a real node as parent", f"padding node {p}")
            real[i] = True
            if last_child[p] == -1:
                nxt[b][p] = i
            else:
                sib[b][last_child[p]] = i
            last_child[p] = i
    dev = tokens.device
    ri = torch.arange(B * N, dtype=torch.int64, device=dev).reshape(B, N)
    return (tokens.to(torch.int64).clone(), ri, torch.tensor(nxt, dtype=torch.int64, device=dev).reshape(B, N),
            torch.tensor(sib, dtype=torch.int64, device=dev).reshape(B, N))


# --------------------------------------------------------------------------- shared checks
def _check_common(fn, predicts, accept_index, accept_token_num, candidates, retrive_index,
                  retrive_next_token, retrive_next_sibling):
    _check_2d(fn, "candidates", candidates)
    B, N = candidates.shape
    for name, t in (("retrive_index", retrive_index), ("retrive_next_token", retrive_next_token),
                    ("retrive_next_sibling", retrive_next_sibling)):
        _check_2d(fn, name, t, (B, N))
    _check_2d(fn, "accept_index", accept_index)
    if accept_index.shape[0] != B or accept_index.shape[1] < 1:
        raise _err(fn, "accept_index", f"shape [{B}, num_spec_step >= 1]", f"shape {list(accept_index.shape)}")
    for name, t, shape in (("accept_token_num", accept_token_num, (B,)), ("predicts", predicts, (B * N,))):
        if not isinstance(t, torch.Tensor) or tuple(t.shape) != shape:
            got = f"shape {list(t.shape)}" if isinstance(t, torch.Tensor) else type(t).__name__
            raise _err(fn, name, f"a tensor of shape {list(shape)}", got)
        if t.dtype.is_floating_point or t.dtype == torch.bool:
            raise _err(fn, name, "an integer dtype (int32 as SGLang uses)", t.dtype)
    ri = None
    if retrive_index.is_cpu:  # one host read, kept (flat) for the host form
        ri = [x for row in retrive_index.tolist() for x in row]
        lo, hi = (min(ri), max(ri)) if ri else (0, 0)
    elif not retrive_index.numel():
        lo, hi = 0, 0
    else:
        lo, hi = (int(v) for v in torch.aminmax(retrive_index))
    if lo < 0 or hi >= B * N:
        b, i = (int(v) for v in ((retrive_index < 0) | (retrive_index >= B * N)).nonzero()[0])
        raise _err(fn, f"retrive_index[{b}, {i}]", f"a flat index in [0, {B * N})", int(retrive_index[b, i]))
    return B, N, accept_index.shape[1], ri


def _write_outputs(accepted, num_acc, order, retrive_index, accept_index, accept_token_num):
    """accepted (specdec indices, -1 padded) -> flat indices; fills accept_index / accept_token_num."""
    B, N = accepted.shape
    S = accept_index.shape[1]
    acc = accepted.to(torch.int64)
    local = acc.clamp(min=0) if order is None else torch.gather(order, 1, acc.clamp(min=0))  # None: identity
    flat = torch.gather(retrive_index.to(torch.int64), 1, local.clamp(min=0))
    flat = torch.where(acc >= 0, flat, torch.full_like(flat, -1))
    k = min(S, N)
    accept_index.fill_(-1)
    accept_index[:, :k] = flat[:, :k].to(accept_index.dtype)
    accept_token_num.copy_(num_acc.to(accept_token_num.dtype))
    return flat, local


# --------------------------------------------------------------------------- greedy
def verify_tree_greedy(predicts: torch.Tensor, accept_index: torch.Tensor, accept_token_num: torch.Tensor,
                       candidates: torch.Tensor, retrive_index: torch.Tensor, retrive_next_token: torch.Tensor,
                       retrive_next_sibling: torch.Tensor, target_predict: torch.Tensor) -> None:
    """sgl-kernel's ``verify_tree_greedy``, outputs written in place.

    Shapes (bs requests, N = num_draft_tokens, S = num_spec_step):
    ``candidates``, ``retrive_index``, ``retrive_next_token``, ``retrive_next_sibling``
    [bs, N] integer; ``target_predict`` [bs, N] (or [bs * N]) integer, indexed by FLAT index
    (``retrive_index`` values): the target's argmax after that node. Outputs:
    ``accept_index`` [bs, S] (int32): flat indices of the accepted path, root first, -1
    padded; ``accept_token_num`` [bs]: accepted draft tokens (root and bonus excluded),
    at most S - 1; ``predicts`` [bs * N]: at each accepted node's flat index the target's
    token after it (the next accepted draft token, then the bonus); other entries untouched.

    Walk: from the root, take the first child in sibling-chain order whose candidate equals
    ``target_predict`` at the current node's flat index; stop when none does or S - 1
    tokens are accepted. CPU batches of the trees SGLang's builder emits (links to higher
    indices) take that walk in one C++ call (:func:`~specdec.compat.sglang_host.verify_greedy_host`);
    the others are computed by :func:`specdec.ops.greedy_verify` on a two-symbol vocabulary
    (token 0 = "matches the target at the parent", logits argmax 0), which makes the op's
    decisions exactly the ones above.
    """
    fn = "verify_tree_greedy"
    if HOST_FORM and verify_greedy_host(predicts, accept_index, accept_token_num, candidates, retrive_index,
                                        retrive_next_token, retrive_next_sibling, target_predict):
        return
    B, N, S, ri = _check_common(fn, predicts, accept_index, accept_token_num, candidates, retrive_index,
                                retrive_next_token, retrive_next_sibling)
    if not isinstance(target_predict, torch.Tensor) or target_predict.numel() != B * N:
        got = (f"shape {list(target_predict.shape)}" if isinstance(target_predict, torch.Tensor)
               else type(target_predict))
        raise _err(fn, "target_predict", f"a tensor of shape [{B}, {N}] (or [{B * N}])", got)
    order, par, identity = tree_tensors(fn, retrive_next_token, retrive_next_sibling, S - 1)
    dev = candidates.device
    order, par = order.to(dev), par.to(dev)
    ri = retrive_index.to(torch.int64)
    tp = target_predict.reshape(-1).to(torch.int64)
    par_local = par.to(torch.int64).clamp(min=0)
    cand = candidates.to(torch.int64)
    if not identity:  # to SGLang's local numbering and back
        par_local = torch.gather(order, 1, par_local)
        cand = torch.gather(cand, 1, order.clamp(min=0))
    at_parent = tp[torch.gather(ri, 1, par_local.clamp(min=0))]
    tokens = torch.where(cand == at_parent, 0, 1)
    tokens = torch.where(par >= 0, tokens, torch.full_like(tokens, -1))
    tokens[:, 0] = 0
    logits = torch.zeros(B, N, 2, dtype=torch.float32, device=dev)
    logits[:, :, 0] = 1.0
    accepted, num_acc, _ = ops.greedy_verify(tokens.contiguous(), par.contiguous(), logits)
    flat, _ = _write_outputs(accepted, num_acc, None if identity else order, ri, accept_index, accept_token_num)
    on = flat >= 0
    idx = flat[on]
    predicts[idx] = tp[idx].to(predicts.dtype)


# --------------------------------------------------------------------------- sampling
def tree_speculative_sampling_target_only(
        predicts: torch.Tensor, accept_index: torch.Tensor, accept_token_num: torch.Tensor,
        candidates: torch.Tensor, retrive_index: torch.Tensor, retrive_next_token: torch.Tensor,
        retrive_next_sibling: torch.Tensor, uniform_samples: torch.Tensor,
        uniform_samples_for_final_sampling: torch.Tensor, target_probs: torch.Tensor,
        draft_probs: Optional[torch.Tensor] = None, threshold_single: float = 1.0,
        threshold_acc: float = 1.0, deterministic: bool = True) -> None:
    """sgl-kernel's ``tree_speculative_sampling_target_only`` (exact form), in place.

    Inputs as :func:`verify_tree_greedy`, plus ``uniform_samples`` [bs, N] (the coin of
    each LOCAL node, used to choose among its children), ``uniform_samples_for_final_sampling``
    [bs], ``target_probs`` [bs, N, V] (row of LOCAL node i: the target's distribution after
    it) and ``draft_probs`` [bs, N, V] or None. Outputs as :func:`verify_tree_greedy`;
    ``predicts`` gets the next accepted draft token at each accepted node and the final
    draw at the last one.

    SGLang's rule (thresholds 1.0): at the current node with coin ``u`` try the children
    in chain order, accepting child c iff ``u <= P_c`` where ``P_c`` is the running sum of
    the node's target probabilities of the children tried so far, c included; the
    accepted child's coin takes over. When none is accepted (or at a leaf, or after
    S - 1 accepted tokens) one token is drawn by inverse CDF from the node's target row
    with the rejected children's tokens removed, using the final coin. This is
    speculative sampling with deterministic candidates, so it is computed by
    :func:`specdec.ops.rejection_sample` (``draft_probs=None``) with per-child uniforms 0.0
    where SGLang's test passes and 1.0 where it fails, the test made as its kernel makes it
    (``P_c`` a running float32 sum in sibling order, ``u <= P_c``): the op then accepts
    exactly the children SGLang accepts, except that a candidate without mass in the op's
    fixed point (a zero, negative or non-finite probability, or one below 2**-41 of its
    row's largest entry) is never accepted, and the final draw uses the final coin.
    Only the children's own probabilities are read for the test. Deliberate difference:
    a token repeated among siblings is tried once
    (its mass counted once, as exactness requires); SGLang's kernel counts it again.

    ``draft_probs``, when given, is treated as SGLang's zero-initialised scratch buffer:
    like SGLang, the target probability of each rejected candidate is written into it at
    the (local node, token) where it was rejected. ``deterministic`` is accepted and
    ignored (specdec's ops are deterministic). ``threshold_single`` / ``threshold_acc``
    < 1 (SGLang's lossy relaxation, NOT the target's distribution) run SGLang's own walk
    (:mod:`specdec.compat.sglang_lossy`, float32 like the kernel, repeated sibling tokens
    counted again as there).
    """
    fn = "tree_speculative_sampling_target_only"
    B, N, S, ri = _check_common(fn, predicts, accept_index, accept_token_num, candidates, retrive_index,
                                retrive_next_token, retrive_next_sibling)
    if not isinstance(target_probs, torch.Tensor) or target_probs.dim() != 3 or tuple(target_probs.shape[:2]) != (B, N):
        got = f"shape {list(target_probs.shape)}" if isinstance(target_probs, torch.Tensor) else type(target_probs)
        raise _err(fn, "target_probs", f"a float tensor of shape [{B}, {N}, V]", got)
    if not target_probs.dtype.is_floating_point:
        raise _err(fn, "target_probs", "a floating dtype", target_probs.dtype)
    V = target_probs.shape[2]
    _check_2d(fn, "uniform_samples", uniform_samples, (B, N), integer=False)
    if not isinstance(uniform_samples_for_final_sampling, torch.Tensor) or \
            uniform_samples_for_final_sampling.numel() != B:
        raise _err(fn, "uniform_samples_for_final_sampling", f"a tensor of shape [{B}]",
                   getattr(uniform_samples_for_final_sampling, "shape", type(uniform_samples_for_final_sampling)))
    if draft_probs is not None and (not isinstance(draft_probs, torch.Tensor)
                                    or tuple(draft_probs.shape) != tuple(target_probs.shape)):
        raise _err(fn, "draft_probs", f"None or a tensor of shape {list(target_probs.shape)}",
                   getattr(draft_probs, "shape", type(draft_probs)))
    if float(threshold_single) != 1.0 or float(threshold_acc) != 1.0:
        bad = (candidates < 0) | (candidates >= V)
        walk_tree(fn, retrive_next_token, retrive_next_sibling, None)  # the tree checks
        reach = torch.zeros_like(bad)
        for t in (retrive_next_token, retrive_next_sibling):
            hit = t >= 0
            reach[hit.nonzero()[:, 0], t[hit].to(torch.int64)] = True
        if bool((bad & reach).any()):
            b, i = (int(v) for v in (bad & reach).nonzero()[0])
            raise _err(fn, f"candidates[{b}, {i}]", f"a token in [0, {V})", int(candidates[b, i]))
        lossy_sample(predicts, accept_index, accept_token_num, candidates, retrive_index, retrive_next_token,
                     retrive_next_sibling, uniform_samples, uniform_samples_for_final_sampling, target_probs,
                     draft_probs, threshold_single, threshold_acc)
        return
    host = HOST_FORM and ri is not None and draft_probs is None and _on_host(
        (predicts, accept_index, accept_token_num), candidates, retrive_next_token, retrive_next_sibling,
        uniform_samples, uniform_samples_for_final_sampling, target_probs)
    if host and sample_exact_host(fn, predicts, accept_index, accept_token_num, candidates, ri, retrive_next_token,
                                  retrive_next_sibling, uniform_samples, uniform_samples_for_final_sampling,
                                  target_probs):
        return
    order, par, identity = tree_tensors(fn, retrive_next_token, retrive_next_sibling, S - 1)
    dev = candidates.device
    order, par = order.to(dev), par.to(dev)
    tokens, probs, u = _exact_inputs(fn, candidates, order, par, identity, uniform_samples,
                                     uniform_samples_for_final_sampling, target_probs)
    accepted, num_acc, out_tokens = ops.rejection_sample(tokens, par.contiguous(), probs, None, u)
    flat, _ = _write_outputs(accepted, num_acc, None if identity else order, retrive_index, accept_index,
                             accept_token_num)
    on = flat >= 0
    predicts[flat[on]] = out_tokens[on].to(predicts.dtype)
    if draft_probs is not None:
        _write_scratch(draft_probs, target_probs, accepted, on, order, par, tokens)


_NUMPY_FLOATS = (torch.float16, torch.float32, torch.float64)
HOST_FORM = True  # CPU batches of greedy verification and the exact sampler on the host (sglang_host); False: tensors


def _on_host(outputs, candidates, next_token, next_sibling, uniform_samples, uniform_final, target_probs) -> bool:
    """The host form applies: CPU tensors NumPy can view (no autograd, no bfloat16 coins), outputs int32 /
    int64."""
    floats = (uniform_samples, uniform_final, target_probs)  # read through NumPy: no autograd
    return all(t.is_cpu for t in (candidates, next_token, next_sibling, *outputs)) \
        and all(t.is_cpu and not t.requires_grad for t in floats) \
        and uniform_samples.dtype in _NUMPY_FLOATS and uniform_final.dtype in _NUMPY_FLOATS \
        and all(t.dtype in (torch.int32, torch.int64) for t in outputs)


def _exact_inputs(fn, candidates, order, par, identity, uniform_samples, uniform_final, target_probs):
    """(tokens [B, N] int64, target rows [B, N, V] float32, uniforms [B, N] float64) for
    :func:`specdec.ops.rejection_sample` from SGLang's exact-form inputs (see
    :func:`tree_speculative_sampling_target_only`)."""
    B, N, V = target_probs.shape
    dev = candidates.device
    par64 = par.to(torch.int64)
    real_child = par >= 0
    cand = candidates.to(torch.int64)
    if not identity:
        cand = torch.gather(cand, 1, order.clamp(min=0))
    lo, hi = (int(v) for v in torch.aminmax(cand))
    if lo < 0 or hi >= V:  # padding may hold anything: only the tree's nodes must be tokens
        badn = ((cand < 0) | (cand >= V)) & real_child
        if bool(badn.any()):
            b, i = (int(v) for v in badn.nonzero()[0])
            loc = int(order[b, i])
            raise _err(fn, f"candidates[{b}, {loc}]", f"a token in [0, {V})", int(candidates[b, loc]))
    tokens = torch.where(real_child, cand, -1)
    tokens[:, 0] = cand[:, 0].clamp(0, V - 1)
    if identity:  # padding rows are never read: the rows are the stack's own
        probs = target_probs.to(torch.float32).contiguous()
    else:
        probs = torch.gather(target_probs.to(torch.float32), 1,
                             order.clamp(min=0)[:, :, None].expand(B, N, V)).contiguous()
    # mass of each child's token in its parent's row (float32); a token repeated among siblings counts once
    pl = par64.clamp(min=0)
    p_child = probs[torch.arange(B, device=dev)[:, None], pl, tokens.clamp(min=0)]
    # sib_earlier[b, i, j]: j is a real earlier sibling of i (same parent, smaller index)
    earlier = torch.ones(N, N, dtype=torch.bool, device=dev).tril(-1)
    sib_earlier = (par64[:, :, None] == par64[:, None, :]) & earlier & real_child[:, None, :]
    dup = (sib_earlier & (tokens[:, :, None] == tokens[:, None, :])).any(-1) & real_child
    zero = torch.zeros_like(p_child)
    mass = torch.where(real_child & ~dup, p_child, zero)
    run = zero  # SGLang's running float32 sum: additions in sibling order (+0 elsewhere)
    for j in range(N - 1):  # the last node is nobody's earlier sibling
        run = run + torch.where(sib_earlier[:, :, j], mass[:, j:j + 1], zero)
    run = run + mass
    coin_of = pl if identity else torch.gather(order, 1, pl).clamp(min=0)  # the parent's local node
    coin = torch.gather(uniform_samples.to(torch.float64), 1, coin_of)
    u = torch.where(coin <= run.to(torch.float64), 0.0, 1.0).to(torch.float64)
    u = torch.where(real_child, u, torch.zeros_like(u))
    u[:, 0] = uniform_final.reshape(B).to(torch.float64).clamp(0.0, 1.0)
    return tokens.contiguous(), probs, u.contiguous()


def _write_scratch(draft_probs, target_probs, accepted, on, order, par, tokens):
    """SGLang's scratch ``draft_probs``: the target probability of every rejected candidate at
    (its parent's local node, its token)."""
    B, N = accepted.shape
    dev = accepted.device
    par64 = par.to(torch.int64)
    pl = par64.clamp(min=0)
    real_child = par >= 0
    acc = accepted.to(torch.int64)
    on_path = torch.zeros(B, N + 1, dtype=torch.bool, device=dev)  # column N: sink for padding
    on_path.scatter_(1, torch.where(on, acc, torch.full_like(acc, N)), on)
    on_path = on_path[:, :N]
    # accepted child of each path node (N = none)
    nxt = torch.full((B, N + 1), N, dtype=torch.int64, device=dev)  # column N: sink for padding
    kids = acc[:, 1:]
    ok = kids >= 0
    nxt.scatter_(1, torch.where(ok, acc[:, :-1].clamp(min=0), torch.full_like(kids, N)),
                 torch.where(ok, kids, torch.full_like(kids, N)))
    nxt = nxt[:, :N]
    idx = torch.arange(N, device=dev)[None, :]
    rej = real_child & torch.gather(on_path, 1, pl) & (idx < torch.gather(nxt, 1, pl)) & ~on_path
    b_i, n_i = rej.nonzero(as_tuple=True)
    rows = order[b_i, par64[b_i, n_i]]
    toks = tokens[b_i, n_i]
    draft_probs[b_i, rows, toks] = target_probs[b_i, rows, toks].to(draft_probs.dtype)
