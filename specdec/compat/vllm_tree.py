"""What vLLM v1 lacks, in its own ragged style: a TREE rejection sampler and the KV commit of the
accepted branch through a vLLM block table or slot mapping (re-exported by
:mod:`specdec.compat.vllm`).

Tree drafts, ragged as vLLM keeps chains: request b proposed ``num_draft_tokens[b]`` nodes, laid
out back to back in ``draft_token_ids [num_tokens]``; ``draft_parents [num_tokens]`` gives each
node's parent as a LOCAL index into the request's own drafts (-1 = the request's last committed
token, the root), always smaller than the node's own local index (topological order). Siblings
are tried in index order. ``target_probs [num_tokens + B, V]`` holds ``n_b + 1`` rows per request,
as vLLM's logits do for a chain (the drafts' rows then the bonus row): row 0 is the target after
the committed prefix (it checks the root's children), row j + 1 the target after draft j (it
checks j's children and gives the bonus token when j is the last accepted node). The bonus token
is drawn here, from the accepted leaf's row, because in a tree it depends on the branch.

Greedy rows (temperature <= 0): from the root, accept the first child whose token is the argmax
of the current row; the argmax at the last accepted node is the final token. Sampled rows:
SpecInfer's multi-draft rejection sampling (:func:`specdec.ops.rejection_sample`): exactly the
target's distribution; draft_probs None = one-hot proposals.

The step's query tokens of request b are [root, draft 0, ..., draft n_b - 1] at positions
``num_computed_tokens[b] + i``: node i sits at local index i. The commit moves the accepted path
to the front: position ``num_computed_tokens[b] + i`` takes the K/V of node ``accepted[b, i]``.
"""
from __future__ import annotations

from typing import NamedTuple, Optional, Sequence

import numpy as np
import torch

from specdec import ops, paged_ops
from specdec.compat.common import (FLOATS, HOST_MAX, INTS, check_tensor, check_token_range, draw_uniforms, fail,
                                   ragged_drafts, resolve_sampling, workspace)

__all__ = ["TreeSampleOutput", "tree_rejection_sample", "commit_accepted_kv", "commit_accepted_kv_slots"]

PLACEHOLDER_TOKEN_ID = -1
HOST_FORM = True  # CPU: parents checked as a list, full batches staged in kept buffers; False: tensor form


class TreeSampleOutput(NamedTuple):
    """``output_token_ids [B, max_spec_len + 1]`` int32: the accepted path's drafts, then the
    recovered / bonus token, then -1 (vLLM's output convention). ``accepted [B, max_spec_len + 1]``
    int32: the path as node indices (0 = root, j + 1 = the request's draft j), -1 padded.
    ``num_accepted [B]`` int32: accepted drafts (root and final token excluded)."""
    output_token_ids: torch.Tensor
    accepted: torch.Tensor
    num_accepted: torch.Tensor


def _pad_tree(draft_token_ids, draft_parents, n, target_probs, draft_probs):
    dev = target_probs.device
    B, S = len(n), max(n)
    N, V = S + 1, target_probs.shape[1]
    full = min(n) == S  # every request at S drafts: the ragged tensors are already [B, S] / [B, N, V]
    if full and HOST_FORM and dev.type == "cpu" and draft_token_ids.is_cpu and draft_parents.is_cpu:
        tokens, parents = _tree_buffers(B, N)  # through NumPy views: no tensor operation
        tokens.numpy()[:, 1:] = draft_token_ids.numpy().reshape(B, S)
        np.add(draft_parents.numpy().reshape(B, S), 1, out=parents.numpy()[:, 1:], casting="unsafe")
    elif full:
        tokens = torch.empty(B, N, dtype=torch.int64, device=dev)
        tokens[:, 0] = 0
        tokens[:, 1:] = draft_token_ids.reshape(B, S)
        parents = torch.empty(B, N, dtype=torch.int32, device=dev)
        parents[:, 0] = -1
        parents[:, 1:] = draft_parents.reshape(B, S) + 1
    else:
        nt = torch.tensor(n, dtype=torch.int64, device=dev)
        valid = torch.arange(S, device=dev)[None, :] < nt[:, None]
        tokens = torch.zeros(B, N, dtype=torch.int64, device=dev)
        tokens[:, 1:][valid] = draft_token_ids.to(torch.int64)
        parents = torch.full((B, N), -1, dtype=torch.int32, device=dev)
        parents[:, 1:][valid] = (draft_parents.to(torch.int32) + 1)
        rows = torch.arange(N, device=dev)[None, :] <= nt[:, None]
    if full and target_probs.dtype == torch.float32 and target_probs.is_contiguous():
        p = target_probs.view(B, N, V)  # the rows are already [B, N, V]
    else:
        p = workspace("vllm_tree.target", (B, N, V), torch.float32, dev)
        if full:
            p.copy_(target_probs.view(B, N, V))
        else:
            p[rows] = target_probs.to(torch.float32)
            p[~rows] = 0.0
    q = None
    if draft_probs is not None:
        q = workspace("vllm_tree.draft", (B, N, V), torch.float32, dev)
        q[:, 0] = 0.0
        if full:
            q[:, 1:].copy_(draft_probs.view(B, S, V))
        else:
            q[:, 1:][valid] = draft_probs.to(torch.float32)
            q[:, 1:][~valid] = 0.0
    return tokens, parents, p, q


_TREE_BUFFERS: dict = {}


def _tree_buffers(B: int, N: int):
    """Kept CPU tensors for the op's tokens [B, N] int64 (column 0, the root, 0) and parents [B, N]
    int32 (column 0 -1), per (B, N). The op only reads them; their contents are valid during one
    call: not for concurrent calls from several threads (like :func:`specdec.compat.common.workspace`)."""
    got = _TREE_BUFFERS.get((B, N))
    if got is None:
        if len(_TREE_BUFFERS) >= 64:
            _TREE_BUFFERS.clear()
        got = _TREE_BUFFERS[(B, N)] = (torch.zeros(B, N, dtype=torch.int64),
                                       torch.full((B, N), -1, dtype=torch.int32))
    return got


def _check_parents(fn, draft_parents, n, T):
    """Every draft's local parent is -1 or an earlier draft of the same request."""
    if HOST_FORM and draft_parents.is_cpu and T <= HOST_MAX:  # one host read and a bytecode loop
        dp, t = draft_parents.tolist(), 0
        for count in n:
            for i in range(count):
                if not -1 <= dp[t] < i:
                    fail(fn, f"draft_parents[{t}]", f"-1 or a local draft index in [0, {i}) "
                         "(parents come before their children)", str(dp[t]))
                t += 1
        return
    B, S = len(n), max(n)
    dev = draft_parents.device
    if min(n) == S:
        local = torch.arange(S, dtype=torch.int64, device=dev).repeat(B)
    else:
        counts = torch.tensor(n, dtype=torch.int64, device=dev)
        starts = torch.cumsum(counts, 0) - counts
        local = torch.arange(T, dtype=torch.int64, device=dev) - torch.repeat_interleave(starts, counts)
    if int((draft_parents - local).max()) >= 0 or int(draft_parents.min()) < -1:
        bad = (draft_parents < -1) | (draft_parents.to(torch.int64) >= local)
        t = int(bad.nonzero()[0])
        fail(fn, f"draft_parents[{t}]", f"-1 or a local draft index in [0, {int(local[t])}) "
             "(parents come before their children)", str(int(draft_parents[t])))


def tree_rejection_sample(draft_token_ids: torch.Tensor, draft_parents: torch.Tensor,
                          num_draft_tokens: Sequence[int], max_spec_len: int, cu_num_draft_tokens: torch.Tensor,
                          draft_probs: Optional[torch.Tensor], target_probs: torch.Tensor, sampling_metadata,
                          *, generator: Optional[torch.Generator] = None,
                          uniforms: Optional[torch.Tensor] = None) -> TreeSampleOutput:
    """Tree rejection sampling of ragged draft trees (module docstring for the layout).

    draft_token_ids [T] int; draft_parents [T] int (local parent index, -1 = root);
    num_draft_tokens list[int] [B]; max_spec_len >= max(num_draft_tokens) (output width - 1);
    cu_num_draft_tokens [B] int (inclusive cumsum); draft_probs [T, V] float or None;
    target_probs [T + B, V] float; sampling_metadata as in :func:`specdec.compat.vllm.rejection_sample`;
    uniforms [B, max_spec_len + 1] float64, optional (``uniforms[b, i]`` decides node i, column 0
    the final draw). Returns a :class:`TreeSampleOutput`.
    """
    fn = "specdec.compat.vllm.tree_rejection_sample"
    T, n, B, S, W = ragged_drafts(fn, draft_token_ids, num_draft_tokens, cu_num_draft_tokens, max_spec_len)
    check_tensor(fn, "draft_parents", draft_parents, 1, INTS, (T,))
    check_tensor(fn, "target_probs", target_probs, 2, FLOATS, (T + B, None))
    V = target_probs.shape[1]
    if draft_probs is not None:
        check_tensor(fn, "draft_probs", draft_probs, 2, FLOATS, (T, V))
    check_token_range(fn, "draft_token_ids", draft_token_ids, V)
    if T:
        _check_parents(fn, draft_parents, n, T)
    dev = target_probs.device
    greedy, generators, n_greedy = resolve_sampling(fn, sampling_metadata, B, dev)
    if uniforms is not None:
        check_tensor(fn, "uniforms", uniforms, 2, (torch.float64,), (B, W))
    if B == 0:
        return TreeSampleOutput(torch.full((B, W), PLACEHOLDER_TOKEN_ID, dtype=torch.int32, device=dev),
                                torch.full((B, W), -1, dtype=torch.int32, device=dev),
                                torch.zeros(B, dtype=torch.int32, device=dev))
    N = S + 1
    tokens, parents, p, q = _pad_tree(draft_token_ids, draft_parents, n, target_probs, draft_probs)
    if n_greedy in (0, B):  # one kind of row: the op's outputs are the result, padded to W columns
        a, k, o = _run_rows(n_greedy == B, tokens, parents, p, q, B, N, n, dev, generator, generators, uniforms)
        if W == N:
            return TreeSampleOutput(o.to(torch.int32), a, k)
        out = torch.full((B, W), PLACEHOLDER_TOKEN_ID, dtype=torch.int32, device=dev)
        acc = torch.full((B, W), -1, dtype=torch.int32, device=dev)
        out[:, :N] = o
        acc[:, :N] = a
        return TreeSampleOutput(out, acc, k)
    out = torch.full((B, W), PLACEHOLDER_TOKEN_ID, dtype=torch.int32, device=dev)
    acc = torch.full((B, W), -1, dtype=torch.int32, device=dev)
    num = torch.zeros(B, dtype=torch.int32, device=dev)
    for idx, is_greedy in ((greedy.nonzero().flatten(), True), ((~greedy).nonzero().flatten(), False)):
        a, k, o = _run_rows(is_greedy, tokens[idx], parents[idx], p[idx], None if q is None else q[idx], B, N, n,
                            dev, generator, generators, uniforms, idx)
        acc[idx, :N] = a.to(torch.int32)
        num[idx] = k.to(torch.int32)
        out[idx, :N] = o.to(torch.int32)
    return TreeSampleOutput(out, acc, num)


def _run_rows(is_greedy, tokens, parents, p, q, B, N, n, dev, generator, generators, uniforms, idx=None):
    """The op on the given rows (all B when ``idx`` is None); sampled rows draw (or take) their uniforms."""
    if is_greedy:
        return ops.greedy_verify(tokens, parents, p)
    if uniforms is None:
        u = draw_uniforms(B, N, n, dev, generator, generators)
    else:
        u = uniforms if uniforms.shape[1] == N and uniforms.device == dev else uniforms[:, :N].to(dev)
    if idx is not None:
        u = u[idx]
    return ops.rejection_sample(tokens, parents, p, q, u if u.is_contiguous() else u.contiguous())


def _kv_pairs(fn: str, kv_caches):
    """vLLM per-layer caches -> (k pages list, v pages list), each [num_blocks, block_size, H, D].

    Each entry: a [2, num_blocks, block_size, H, D] tensor (vLLM's FlashAttention layout, K = [0],
    V = [1]) or a (k, v) pair of [num_blocks, block_size, H, D] tensors: NHD, or views with other
    strides and D contiguous (the halves of FlashInfer's [num_blocks, 2, ...] layout, HND pages'
    ``transpose(1, 2)``), used in place.
    """
    ks, vs = [], []
    for i, c in enumerate(kv_caches):
        if isinstance(c, torch.Tensor):
            if c.dim() != 5 or c.shape[0] != 2:
                fail(fn, f"kv_caches[{i}]", "[2, num_blocks, block_size, Hkv, D] or a (k, v) pair",
                     f"shape {tuple(c.shape)}")
            k, v = c[0], c[1]
        else:
            k, v = c
        for name, t in (("k", k), ("v", v)):
            if not isinstance(t, torch.Tensor) or t.dim() != 4 or (t.shape[3] > 1 and t.stride(3) != 1):
                got = (f"shape {tuple(t.shape)}, strides {t.stride()}" if isinstance(t, torch.Tensor)
                       else type(t).__name__)
                fail(fn, f"kv_caches[{i}] ({name})", "a [num_blocks, block_size, Hkv, D] tensor with D contiguous", got)
        ks.append(k)
        vs.append(v)
    if not ks:
        fail(fn, "kv_caches", "at least one layer", "none")
    return ks, vs


def _check_path(fn, accepted, num_accepted, B):
    check_tensor(fn, "accepted", accepted, 2, INTS, (B, None))
    check_tensor(fn, "num_accepted", num_accepted, 1, INTS, (B,))
    return accepted.to(torch.int32).contiguous(), num_accepted.to(torch.int32).contiguous()


def commit_accepted_kv(kv_caches, block_table: torch.Tensor, req_indices: torch.Tensor,
                       num_computed_tokens: torch.Tensor, accepted: torch.Tensor,
                       num_accepted: torch.Tensor) -> torch.Tensor:
    """Compact the accepted branch through vLLM's block table, in place; returns the new lengths.

    kv_caches: per layer [2, num_blocks, block_size, Hkv, D] or (k, v) pairs (NHD pages);
    block_table [max_reqs, max_blocks] int32 (vLLM's ``InputBatch.block_table``);
    req_indices [B] int: the block-table row of each request of the step;
    num_computed_tokens [B] int: the position of each request's root (its committed length);
    accepted [B, >= max(num_accepted) + 1] int and num_accepted [B] int, as
    :func:`tree_rejection_sample` returns them. Position ``num_computed_tokens[b] + i`` takes the
    K/V of node ``accepted[b, i]`` (i = 1..num_accepted[b]) via
    :func:`specdec.paged_ops.kv_commit_paged`; returns ``num_computed_tokens + num_accepted + 1``
    (int32). Only the accepted nodes not already in place move, all within the step's positions.
    """
    fn = "specdec.compat.vllm.commit_accepted_kv"
    ks, vs = _kv_pairs(fn, kv_caches)
    check_tensor(fn, "block_table", block_table, 2, (torch.int32,))
    check_tensor(fn, "req_indices", req_indices, 1, INTS)
    B = req_indices.shape[0]
    check_tensor(fn, "num_computed_tokens", num_computed_tokens, 1, INTS, (B,))
    acc, num = _check_path(fn, accepted, num_accepted, B)
    if B and (int(req_indices.min()) < 0 or int(req_indices.max()) >= block_table.shape[0]):
        fail(fn, "req_indices", f"rows of block_table in [0, {block_table.shape[0]})", str(req_indices.tolist()))
    bt = block_table.index_select(0, req_indices.to(block_table.device, torch.int64)).contiguous()
    lens = num_computed_tokens.to(device=bt.device, dtype=torch.int32).clone()
    paged_ops.kv_commit_paged(ks, vs, bt, lens, acc.to(bt.device), num.to(bt.device))
    return lens


def commit_accepted_kv_slots(kv_caches, slot_mapping: torch.Tensor, query_start_loc: torch.Tensor,
                             accepted: torch.Tensor, num_accepted: torch.Tensor) -> None:
    """Compact the accepted branch through the step's slot mapping, in place.

    slot_mapping [num_query_tokens] int (vLLM's flat slots: ``block * block_size + offset``) and
    query_start_loc [B + 1] int: request b's query tokens are ``query_start_loc[b] ..
    query_start_loc[b + 1] - 1``, node i at ``query_start_loc[b] + i``. The slot of node i takes
    the K/V of node ``accepted[b, i]`` (i = 1..num_accepted[b]). Runs
    :func:`specdec.paged_ops.kv_commit_paged` on a page-size-1 view of the pools with the slot
    mapping as its block table, so it needs no block table and moves the same bytes.
    """
    fn = "specdec.compat.vllm.commit_accepted_kv_slots"
    ks, vs = _kv_pairs(fn, kv_caches)
    check_tensor(fn, "slot_mapping", slot_mapping, 1, INTS)
    check_tensor(fn, "query_start_loc", query_start_loc, 1, INTS)
    B = query_start_loc.shape[0] - 1
    if B < 0:
        fail(fn, "query_start_loc", "[B + 1] with B >= 0", "an empty tensor")
    acc, num = _check_path(fn, accepted, num_accepted, B)
    starts = query_start_loc.to(torch.int64).cpu()
    counts = starts[1:] - starts[:-1]
    if B and (int(starts[0]) != 0 or bool((counts < 1).any()) or int(starts[-1]) > slot_mapping.shape[0]):
        fail(fn, "query_start_loc", f"0-based, increasing by >= 1, ending <= {slot_mapping.shape[0]}",
             str(starts.tolist()))
    if B and bool((num.cpu().to(torch.int64) >= counts).any()):
        fail(fn, "num_accepted", "less than each request's query-token count", str(num.tolist()))
    P, ps = ks[0].shape[0], ks[0].shape[1]
    total = P * ps
    if slot_mapping.numel() and (int(slot_mapping.min()) < 0 or int(slot_mapping.max()) >= total):
        fail(fn, "slot_mapping", f"slots in [0, {total})", f"values in [{int(slot_mapping.min())}, "
             f"{int(slot_mapping.max())}]")
    N = acc.shape[1]
    path = torch.arange(N)[None, :] <= num.cpu().to(torch.int64)[:, None]
    if B and bool((path & (acc.cpu().to(torch.int64) >= counts[:, None])).any()):
        fail(fn, "accepted", "node indices below each request's query-token count", str(acc.tolist()))
    dev = ks[0].device
    width = max(N, int(counts.max()) if B else 1)
    pos = torch.arange(width)[None, :]
    idx = starts[:-1, None] + torch.minimum(pos, counts[:, None] - 1)  # pad with the last query token
    table = slot_mapping.to(torch.int64).cpu()[idx].to(torch.int32).to(dev).contiguous()
    try:
        k1 = [k.view(total, 1, k.shape[2], k.shape[3]) for k in ks]
        v1 = [v.view(total, 1, v.shape[2], v.shape[3]) for v in vs]
    except RuntimeError:  # the pool's (block, offset) do not merge into one slot index (HND, interleaved K / V)
        fail(fn, "kv_caches", "pools whose blocks and offsets form one flat slot index (NHD blocks; else call "
             "commit_accepted_kv with the block table)", f"strides {ks[0].stride()}")
    lens = torch.zeros(B, dtype=torch.int32, device=dev)
    paged_ops.kv_commit_paged(k1, v1, table, lens, acc.to(dev), num.to(dev))
