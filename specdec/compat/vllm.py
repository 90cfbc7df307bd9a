"""vLLM v1's rejection-sampler call convention over specdec's ops (chains).

vLLM v1 keeps the drafts of a step RAGGED: request b proposed ``num_draft_tokens[b]`` tokens, laid
out back to back in ``draft_token_ids [num_tokens]``; ``cu_num_draft_tokens [B]`` is the inclusive
cumulative sum of those counts. Target (and draft) distributions come one row per draft token. The
sampler returns ``[B, max_spec_len + 1]`` int32: the accepted drafts of each request, then one more
token (the recovered token drawn from the residual at the first rejection, or, when every draft
passed, the bonus token the caller sampled from the target at the position after the last draft),
then ``PLACEHOLDER_TOKEN_ID`` (-1).

:func:`rejection_sample` pads the chains into a ``[B, max_spec_len + 1]`` specdec tree batch
(node 0 = root, node j + 1 = draft j, each node's parent the one before it, padding nodes parent
-1) and runs :func:`specdec.ops.greedy_verify` for the greedy rows and
:func:`specdec.ops.rejection_sample` for the sampled rows. The target row after the last draft is
a one-hot row on the bonus token, so the op's final draw after a fully accepted chain IS the bonus
token, as in vLLM.

Semantics (vLLM v1, per request with drafts d_0 .. d_{n-1}):

* greedy (temperature 0): draft j is accepted iff it equals ``argmax target_probs[j]`` (first
  maximal index) and every earlier draft was accepted; at the first mismatch the argmax is emitted
  and the row ends; after n accepted drafts the bonus token is emitted.
* random: draft j is accepted with probability ``min(1, p_j(d_j) / q_j(d_j))`` (q one-hot on d_j
  when ``draft_probs`` is None); at the first rejection a token is drawn from
  ``max(p_j - q_j, 0)`` normalised (``p_j`` with ``d_j`` removed when ``draft_probs`` is None),
  which makes the emitted sequence exactly distributed as the target's; after n accepted drafts
  the bonus token is emitted. Draws here come from specdec's inverse-CDF rule with float64
  uniforms (vLLM draws its recovered tokens with exponential noise): the same distribution,
  not the same random stream.
"""
from __future__ import annotations

from typing import Optional, Sequence

import numpy as np
import torch
import torch.nn.functional as F

from specdec import _C, ops
from specdec.compat.common import (FLOATS, INTS, chain_parents, check_tensor, check_token_range, draw_uniforms,
                                   fail, ragged_drafts, resolve_sampling, workspace)

__all__ = ["PLACEHOLDER_TOKEN_ID", "rejection_sample", "pad_chains", "tree_rejection_sample",
           "TreeSampleOutput", "commit_accepted_kv", "commit_accepted_kv_slots"]

PLACEHOLDER_TOKEN_ID = -1
HOST_FORM = True  # CPU batches: all-greedy equal-count ones in one C++ call (_greedy_host), sampled ones assembled
#                   in NumPy (_sampled_uniform_host); False: tensor form
_LOGIT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)  # what greedy_verify reads in place

_FN = "specdec.compat.vllm.rejection_sample"


def pad_chains(draft_token_ids: torch.Tensor, num_draft_tokens: Sequence[int], target_probs: torch.Tensor,
               bonus_token_ids: torch.Tensor, draft_probs: Optional[torch.Tensor] = None):
    """Ragged chains -> a padded specdec tree batch ``(tokens [B, N] int64, parents [B, N] int32,
    p [B, N, V] float32, q [B, N, V] float32 or None)`` with N = max(num_draft_tokens) + 1.

    Node 0 is the root (token 0, never checked), node j + 1 is draft j with parent j, padding nodes
    have parent -1. ``p[b, j]`` = target row of draft j for j < n_b, ``p[b, n_b]`` = one-hot on the
    bonus token, padding rows zero; ``q[b, j + 1]`` = draft row of draft j, other rows zero.
    """
    dev = target_probs.device
    n = torch.tensor([int(x) for x in num_draft_tokens], dtype=torch.int64, device=dev)
    B = n.numel()
    S = int(n.max().item()) if B else 0
    N = S + 1
    V = target_probs.shape[1]
    pos = torch.arange(S, device=dev)
    valid = pos[None, :] < n[:, None]  # [B, S]; row-major order matches the ragged layout
    tokens = torch.zeros(B, N, dtype=torch.int64, device=dev)
    tokens[:, 1:][valid] = draft_token_ids.to(torch.int64)
    node = torch.arange(N, dtype=torch.int32, device=dev)
    parents = torch.where(node[None, :] <= n[:, None].to(torch.int32), node - 1, torch.full_like(node, -1)[None, :])
    parents = parents.to(torch.int32).contiguous()
    p = torch.zeros(B, N, V, dtype=torch.float32, device=dev)
    p[:, :S][valid] = target_probs.to(torch.float32)
    rows = torch.arange(B, device=dev)
    p[rows, n, bonus_token_ids.reshape(B).to(torch.int64)] = 1.0
    q = None
    if draft_probs is not None:
        q = torch.zeros(B, N, V, dtype=torch.float32, device=dev)
        q[:, 1:][valid] = draft_probs.to(torch.float32)
    return tokens, parents, p, q


def rejection_sample(draft_token_ids: torch.Tensor, num_draft_tokens: Sequence[int], max_spec_len: int,
                     cu_num_draft_tokens: torch.Tensor, draft_probs: Optional[torch.Tensor],
                     target_probs: torch.Tensor, bonus_token_ids: torch.Tensor, sampling_metadata,
                     *, generator: Optional[torch.Generator] = None,
                     uniforms: Optional[torch.Tensor] = None) -> torch.Tensor:
    """vLLM v1 ``rejection_sample`` (same positional arguments) -> ``[B, max_spec_len + 1]`` int32.

    Parameters
    ----------
    draft_token_ids : Tensor [num_tokens], int32 / int64 — all requests' drafts, back to back.
    num_draft_tokens : list[int] [B] — drafts per request (0 allowed).
    max_spec_len : int — the output has ``max_spec_len + 1`` columns; at least max(num_draft_tokens).
    cu_num_draft_tokens : Tensor [B], int32 / int64 — inclusive cumsum of ``num_draft_tokens``.
    draft_probs : Tensor [num_tokens, V] float or None — the distribution each draft was drawn from;
        None = one-hot proposals (n-gram, EAGLE greedy drafts).
    target_probs : Tensor [num_tokens, V] float — the target's (warped) distribution at each draft.
    bonus_token_ids : Tensor [B, 1] int — the target's sample after the last draft; emitted when
        every draft of the request is accepted.
    sampling_metadata : vLLM's ``SamplingMetadata`` (read: ``temperature``, ``all_greedy``,
        ``all_random``, ``generators``) or a [B] temperature tensor. Temperature <= 0 = greedy row
        (vLLM's ``GREEDY_TEMPERATURE`` is -1 in older v1 releases, 0 in newer ones).
    generator : torch.Generator, optional — draws the uniforms of the sampled rows without their own
        generator (vLLM uses torch's default generator there).
    uniforms : Tensor [B, max_spec_len + 1] float64 in [0, 1], optional — the randomness given
        explicitly, in specdec's layout: ``uniforms[b, j + 1]`` decides draft j, ``uniforms[b, 0]``
        drives the recovered-token draw. Overrides ``generator`` and the per-request generators.

    Returns
    -------
    Tensor [B, max_spec_len + 1] int32: accepted drafts, then the recovered or bonus token, then -1.
    """
    if HOST_FORM and uniforms is None and type(num_draft_tokens) is list:
        got = _greedy_host(draft_token_ids, num_draft_tokens, max_spec_len, cu_num_draft_tokens, draft_probs,
                           target_probs, bonus_token_ids, sampling_metadata)
        if got is not None:
            return got
    T, n, B, S, W = ragged_drafts(_FN, draft_token_ids, num_draft_tokens, cu_num_draft_tokens, max_spec_len)
    check_tensor(_FN, "target_probs", target_probs, 2, FLOATS, (T, None))
    V = target_probs.shape[1]
    if V < 1:
        fail(_FN, "target_probs", "of vocabulary size >= 1", f"shape {tuple(target_probs.shape)}")
    if draft_probs is not None:
        check_tensor(_FN, "draft_probs", draft_probs, 2, FLOATS, (T, V))
    check_tensor(_FN, "bonus_token_ids", bonus_token_ids, 2, INTS, (B, 1))
    d_host = check_token_range(_FN, "draft_token_ids", draft_token_ids, V)
    bonus_host = check_token_range(_FN, "bonus_token_ids", bonus_token_ids, V)
    dev = target_probs.device
    greedy, generators, n_greedy = resolve_sampling(_FN, sampling_metadata, B, dev)
    if uniforms is not None:
        check_tensor(_FN, "uniforms", uniforms, 2, (torch.float64,), (B, W))
    if B == 0:
        return torch.full((B, W), PLACEHOLDER_TOKEN_ID, dtype=torch.int32, device=dev)
    N = S + 1
    uniform = S > 0 and min(n) == S  # every request at S drafts: the stack's rows are already [B, S, V]
    if uniform and n_greedy == B and target_probs.dtype in _LOGIT_DTYPES:
        return _greedy_uniform(draft_token_ids, B, S, W, target_probs, bonus_token_ids)
    if uniform and n_greedy == 0 and target_probs.dtype == torch.float32:
        u = (draw_uniforms(B, N, n, dev, generator, generators) if uniforms is None
             else uniforms[:, :N].to(dev))
        if HOST_FORM and d_host is not None and bonus_host is not None and u.is_cpu and not u.requires_grad:
            return _sampled_uniform_host(d_host, bonus_host, B, S, W, target_probs, draft_probs, u)
        return _sampled_uniform(draft_token_ids, B, S, W, target_probs, draft_probs, bonus_token_ids, u)
    out = torch.full((B, W), PLACEHOLDER_TOKEN_ID, dtype=torch.int32, device=dev)
    g_idx = greedy.nonzero().flatten()
    r_idx = (~greedy).nonzero().flatten()
    if g_idx.numel():
        out[g_idx, :N] = _greedy_rows(draft_token_ids, n, target_probs, bonus_token_ids)[g_idx]
    if r_idx.numel():
        u = (draw_uniforms(B, N, n, dev, generator, generators) if uniforms is None
             else uniforms[:, :N].to(dev))
        tokens, parents, p, q = _stage_chains(draft_token_ids, n, target_probs, bonus_token_ids, draft_probs)
        if r_idx.numel() == B:
            _, _, o = ops.rejection_sample(tokens, parents, p, q, u.contiguous())
        else:
            _, _, o = ops.rejection_sample(tokens[r_idx], parents[r_idx], p[r_idx],
                                           None if q is None else q[r_idx], u[r_idx].contiguous())
        out[r_idx, :N] = o.to(torch.int32)
    return out



def _layout(n: Sequence[int], dev: torch.device):
    nt = torch.tensor(list(n), dtype=torch.int64, device=dev)
    S = max(n)
    N = S + 1
    valid = torch.arange(S, device=dev)[None, :] < nt[:, None]
    node = torch.arange(N, dtype=torch.int32, device=dev)
    parents = torch.where(node[None, :] <= nt[:, None].to(torch.int32), node - 1,
                          torch.full_like(node, -1)[None, :]).to(torch.int32).contiguous()
    return nt, valid, parents


def _greedy_rows(draft_token_ids, n, target_probs, bonus_token_ids) -> torch.Tensor:
    """Greedy decisions without staging the probabilities: each draft becomes symbol 0 ("equals the
    argmax of its row") or 1, and :func:`specdec.ops.greedy_verify` walks the chains on that
    two-symbol vocabulary; the emitted tokens are then the accepted drafts, then the row's argmax at
    the first mismatch or the bonus token. [B, max(n) + 1] int32."""
    dev = target_probs.device
    B, S = len(n), max(n)
    N = S + 1
    nt, valid, parents = _layout(n, dev)
    if S > 0 and min(n) == S and target_probs.dtype in _LOGIT_DTYPES:
        return _greedy_uniform(draft_token_ids, B, S, N, target_probs, bonus_token_ids)
    T = target_probs.shape[0]
    am = torch.zeros(0, dtype=torch.int64, device=dev)
    if T:  # each row's argmax by the op itself: T one-node trees over the stack's rows, no copy
        rows_in = target_probs if target_probs.dtype in (torch.float32, torch.float16, torch.bfloat16) \
            else target_probs.to(torch.float32)
        root = torch.zeros(T, 1, dtype=torch.int64, device=dev)
        _, _, first = ops.greedy_verify(root, torch.full((T, 1), -1, dtype=torch.int32, device=dev),
                                        rows_in.contiguous().view(T, 1, -1))
        am = first[:, 0].to(torch.int64)
    d = draft_token_ids.to(dev, torch.int64)
    sym = torch.ones(B, N, dtype=torch.int64, device=dev)
    sym[:, 0] = 0
    sym[:, 1:][valid] = (d != am).to(torch.int64)
    tok = torch.zeros(B, N, dtype=torch.int64, device=dev)   # the drafts, then the bonus at column n_b
    tok[:, :S][valid] = d
    arg = torch.zeros(B, N, dtype=torch.int64, device=dev)   # the argmax of each draft's row
    arg[:, :S][valid] = am
    rows = torch.arange(B, device=dev)
    two = torch.zeros(B, N, 2, dtype=torch.float32, device=dev)
    two[:, :, 0] = 1.0
    _, num, _ = ops.greedy_verify(sym, parents, two)
    k = num.to(torch.int64)
    out = torch.where(torch.arange(N, device=dev)[None, :] < k[:, None], tok,
                      torch.full_like(tok, PLACEHOLDER_TOKEN_ID))
    last = torch.where(k < nt, arg[rows, k.clamp(max=S)], bonus_token_ids.reshape(B).to(dev, torch.int64))
    out[rows, k] = last
    return out.to(torch.int32)


def _greedy_uniform(draft_token_ids, B, S, W, target_probs, bonus_token_ids) -> torch.Tensor:
    """Every request at S drafts: the stack's rows are already [B, S, V] (row j checks draft j), so
    :func:`specdec.ops.greedy_verify` walks them in place (reading only the rows on the path) as the
    tree root -> d_0 -> ... -> d_{S-2}; its final token is the argmax of the row that checks d_{S-1},
    so d_{S-1} is accepted, and the bonus token follows, exactly when that token equals it (the
    op's out tokens are -1 past the walk, never a draft). [B, W] int32, -1 padded."""
    dev = target_probs.device
    d = _on(draft_token_ids, dev).view(B, S)
    tokens = F.pad(d[:, :S - 1], (1, 0)).to(torch.int64)  # the root (token unchecked), d_0 .. d_{S-2}
    _, _, o = ops.greedy_verify(tokens, chain_parents(B, S, dev), target_probs.contiguous().view(B, S, -1))
    last = torch.where(o[:, S - 1:] == d[:, S - 1:], _on(bonus_token_ids, dev).reshape(B, 1), PLACEHOLDER_TOKEN_ID)
    parts = [o, last]
    if W > S + 1:
        parts.append(torch.full((B, W - S - 1), PLACEHOLDER_TOKEN_ID, dtype=torch.int64, device=dev))
    return torch.cat(parts, 1).to(torch.int32)


def _greedy_host(draft_token_ids, num_draft_tokens, max_spec_len, cu_num_draft_tokens, draft_probs, target_probs,
                 bonus_token_ids, sampling_metadata) -> Optional[torch.Tensor]:
    """An all-greedy CPU batch of equal draft counts and float32 rows in one C++ call
    (``specdec._C.vllm_greedy``, csrc/host/vllm_host.cpp: the checks, each row's argmax as
    :func:`specdec.ops.greedy_verify` takes it, the -1 padded output), or None: any other batch, or an
    argument the general path must check (and name in its error), goes on to it."""
    if isinstance(sampling_metadata, torch.Tensor):
        temperature = sampling_metadata
    elif getattr(sampling_metadata, "all_greedy", False) is True and hasattr(sampling_metadata, "temperature") \
            and hasattr(sampling_metadata, "all_random"):
        temperature = None
    else:
        return None
    if type(max_spec_len) is not int:
        return None
    try:  # NumPy views: CPU tensors without grad (anything else raises here and takes the general path)
        out = _C.vllm_greedy(draft_token_ids.numpy(), num_draft_tokens, cu_num_draft_tokens.numpy(),
                             target_probs.numpy(), bonus_token_ids.numpy(),
                             None if temperature is None else temperature.numpy(), max_spec_len,
                             None if draft_probs is None else draft_probs.numpy())
    except (AttributeError, RuntimeError, TypeError):
        return None
    return None if out is None else torch.from_numpy(out)


_CPU = torch.device("cpu")
_TOKENS: dict = {}


def _token_buffer(B: int, S: int):
    """A kept [B, S] int64 CPU tensor and a flat NumPy view of it, first entry 0 (the root's token of
    row 0). Its contents are only valid during one call: not for concurrent calls from several
    threads (like :func:`specdec.compat.common.workspace`)."""
    got = _TOKENS.get((B, S))
    if got is None:
        if len(_TOKENS) >= 64:
            _TOKENS.clear()
        t = torch.zeros(B, S, dtype=torch.int64)
        got = _TOKENS[(B, S)] = (t, t.numpy().reshape(-1))
    return got


def _on(t: torch.Tensor, dev: torch.device) -> torch.Tensor:
    return t if t.device == dev else t.to(dev)


def _sampled_uniform(draft_token_ids, B, S, W, target_probs, draft_probs, bonus_token_ids, u) -> torch.Tensor:
    """Every request sampled at S drafts, without staging the target rows: the op decides d_0 ..
    d_{S-2} on the stack's own [B, S, V] rows (tree root -> d_0 -> ... -> d_{S-2}); the requests
    that accepted all of them then decide d_{S-1} in a second call on two rows each (row S-1 and the
    one-hot bonus row), where a full acceptance emits the bonus token. ``u[:, 0]`` drives exactly one
    emitted draw per request (the first call's final draw is kept only where it ended early).
    [B, W] int32, -1 padded."""
    dev = target_probs.device
    V = target_probs.shape[1]
    d = draft_token_ids.to(dev).view(B, S)
    rows_p = target_probs.contiguous().view(B, S, V)
    tokens = torch.empty(B, S, dtype=torch.int64, device=dev)
    tokens[:, 0] = 0
    tokens[:, 1:] = d[:, :S - 1]
    q = None
    if draft_probs is not None:
        q = workspace("vllm.draft", (B, S, V), torch.float32, dev)
        q[:, 0] = 0.0
        q[:, 1:].copy_(draft_probs.view(B, S, V)[:, :S - 1])
    _, _, o = ops.rejection_sample(tokens, chain_parents(B, S, dev), rows_p, q, u[:, :S].contiguous())
    out = torch.empty(B, W, dtype=torch.int32, device=dev)
    out[:, :S] = o
    out[:, S:] = PLACEHOLDER_TOKEN_ID
    reached = o[:, S - 1] >= 0  # out token S - 1 is set exactly when d_0 .. d_{S-2} were all accepted
    if int(reached.sum()):
        full = reached.nonzero().flatten()
        out[full, S - 1:S + 1] = _last_draft(full, d[full, S - 1].to(torch.int64),
                                             bonus_token_ids.reshape(B)[full].to(dev, torch.int64), rows_p,
                                             draft_probs, u, S).to(torch.int32)
    return out


def _sampled_uniform_host(d: list, bonus: list, B, S, W, target_probs, draft_probs, u) -> torch.Tensor:
    """:func:`_sampled_uniform` on the CPU, with the drafts ``d`` [B * S] and bonus tokens [B] as the
    lists the range checks read: the op's tokens (the drafts shifted right by one: row b is
    (d_{b-1, S-1}, d_{b,0} .. d_{b,S-2}), its first entry the root's token, which the op never reads) and
    uniforms go into kept buffers, and the result is assembled in Python."""
    V = target_probs.shape[1]
    rows_p = (target_probs if target_probs.is_contiguous() else target_probs.contiguous()).view(B, S, V)
    tokens, flat = _token_buffer(B, S)
    flat[1:] = d[:-1]
    u_t, u_np = _uniform_buffer(B, S)
    u_np[:] = u.numpy()[:, :S]
    q = None
    if draft_probs is not None:
        q = workspace("vllm.draft", (B, S, V), torch.float32, _CPU)
        q[:, 0] = 0.0
        q[:, 1:].copy_(draft_probs.view(B, S, V)[:, :S - 1])
    _, _, o = ops.rejection_sample(tokens, chain_parents(B, S, _CPU), rows_p, q, u_t)
    out = o.tolist()
    pad = [PLACEHOLDER_TOKEN_ID] * (W - S)
    full = []
    for b, row in enumerate(out):
        if row[S - 1] >= 0:  # d_0 .. d_{S-2} all accepted: d_{S-1} is decided below
            full.append(b)
        row += pad
    if full:
        last = _last_draft(torch.tensor(full), torch.tensor([d[b * S + S - 1] for b in full]),
                           torch.tensor([bonus[b] for b in full]), rows_p, draft_probs, u, S)
        for b, pair in zip(full, last.tolist()):
            out[b][S - 1:S + 1] = pair
    return torch.from_numpy(np.array(out, dtype=np.int32))


def _last_draft(full, d_last, bonus_full, rows_p, draft_probs, u, S) -> torch.Tensor:
    """The requests ``full`` that accepted d_0 .. d_{S-2} decide d_{S-1} (int64 ``d_last``) on two
    rows each: row S - 1 and a one-hot row on the bonus token (``bonus_full``), so that a full
    acceptance emits the bonus token; ``u[:, 0]`` drives the draw, ``u[:, S]`` decides. [n, 2]."""
    B, _, V = rows_p.shape
    dev = rows_p.device
    n_full = full.numel()
    p2 = workspace("vllm.last", (n_full, 2, V), torch.float32, dev)
    p2[:, 0].copy_(rows_p[full, S - 1])
    p2[:, 1] = 0.0
    p2[torch.arange(n_full, device=dev), 1, bonus_full] = 1.0
    q2 = None
    if draft_probs is not None:
        q2 = workspace("vllm.last_draft", (n_full, 2, V), torch.float32, dev)
        q2[:, 0] = 0.0
        q2[:, 1].copy_(draft_probs.view(B, S, V)[full, S - 1])
    t2 = torch.stack([torch.zeros_like(full), d_last], 1)
    u2 = torch.stack([u[full, 0], u[full, S]], 1).contiguous()
    _, _, o2 = ops.rejection_sample(t2, chain_parents(n_full, 2, dev), p2, q2, u2)
    return o2


_UNIFORMS: dict = {}


def _uniform_buffer(B: int, S: int):
    """A kept [B, S] float64 CPU tensor and a NumPy view of it (as :func:`_token_buffer`)."""
    got = _UNIFORMS.get((B, S))
    if got is None:
        if len(_UNIFORMS) >= 64:
            _UNIFORMS.clear()
        t = torch.zeros(B, S, dtype=torch.float64)
        got = _UNIFORMS[(B, S)] = (t, t.numpy())
    return got


def _stage_chains(draft_token_ids, n, target_probs, bonus_token_ids, draft_probs):
    """:func:`pad_chains` into kept workspaces (no per-call allocation of the [B, N, V] rows)."""
    dev = target_probs.device
    B, S, V = len(n), max(n), target_probs.shape[1]
    N = S + 1
    nt, valid, parents = _layout(n, dev)
    tokens = torch.zeros(B, N, dtype=torch.int64, device=dev)
    tokens[:, 1:][valid] = draft_token_ids.to(dev, torch.int64)
    rows = torch.arange(B, device=dev)
    pad = torch.arange(N, device=dev)[None, :] > nt[:, None]
    p = workspace("vllm.target", (B, N, V), torch.float32, dev)
    if bool(valid.all()):
        p[:, :S].copy_(target_probs.view(B, S, V))
    else:
        p[:, :S][valid] = target_probs.to(torch.float32)
    p[pad] = 0.0
    p[rows, nt] = 0.0
    p[rows, nt, bonus_token_ids.reshape(B).to(dev, torch.int64)] = 1.0
    q = None
    if draft_probs is not None:
        q = workspace("vllm.draft", (B, N, V), torch.float32, dev)
        q[:, 0] = 0.0
        if bool(valid.all()):
            q[:, 1:].copy_(draft_probs.view(B, S, V))
        else:
            q[:, 1:][valid] = draft_probs.to(torch.float32)
            q[:, 1:][~valid] = 0.0
    return tokens, parents, p, q


from specdec.compat.vllm_tree import (TreeSampleOutput, commit_accepted_kv,  # noqa: E402  (re-exported)
                                      commit_accepted_kv_slots, tree_rejection_sample)
