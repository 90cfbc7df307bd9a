"""SGLang's tree sampler with thresholds below 1 (its lossy relaxation), as sgl-kernel defines it.

``tree_speculative_sampling_target_only`` with ``threshold_single`` / ``threshold_acc`` < 1 accepts
more than exact speculative sampling would, so its output is NOT the target's distribution; no
exact op computes it. This module walks the trees the way the kernel does, vectorised over the
batch in float32 (the kernel's arithmetic):

* at the current node (local index, row ``target_probs[b, node]``) with coin ``u`` (the node's
  ``uniform_samples`` entry; the root's first) and ``acc = 0``, try the children in sibling-chain
  order: ``acc += p(token)``; accept iff ``u <= acc / max(threshold_acc, 1e-9)`` or
  ``p(token) >= threshold_single``; the accepted child becomes the current node (its coin takes
  over, ``acc`` restarts at 0). A rejected child writes ``p(token)`` into the scratch
  ``draft_probs[b, node, token]``. At most ``num_spec_step - 1`` children are accepted.
* the final token is drawn from ``relu(target_probs[b, node] - draft_probs[b, node])`` (the target
  row alone after ``num_spec_step - 1`` acceptances) with ``uniform_samples_for_final_sampling[b]``
  scaled by the row's sum: the first token whose running sum exceeds it; when none does, the last
  token of positive mass (``V - 1`` when the row is all zero).

Repeated sibling tokens count again in ``acc`` here, as in the kernel.
"""
from __future__ import annotations

import torch

__all__ = ["lossy_tree_walk"]


def lossy_tree_walk(candidates: torch.Tensor, retrive_next_token: torch.Tensor, retrive_next_sibling: torch.Tensor,
                    uniform_samples: torch.Tensor, final_uniforms: torch.Tensor, target_probs: torch.Tensor,
                    scratch: torch.Tensor, num_spec_step: int, threshold_single: float, threshold_acc: float):
    """-> (path [B, num_spec_step] local node indices, -1 padded; num_accepted [B]; final token [B]).

    Inputs already validated ([B, N] int links and candidates, [B, N] coins, [B] final coins,
    [B, N, V] target rows, [B, N, V] float32 scratch, written in place)."""
    B, N = candidates.shape
    V = target_probs.shape[2]
    dev = candidates.device
    rows = torch.arange(B, device=dev)
    p = target_probs.to(torch.float32)
    coins = uniform_samples.to(torch.float32)
    nt, ns = retrive_next_token.to(torch.int64), retrive_next_sibling.to(torch.int64)
    cand = candidates.to(torch.int64)
    t_single = torch.tensor(float(threshold_single), dtype=torch.float32)
    t_acc = torch.tensor(max(float(threshold_acc), 1e-9), dtype=torch.float32)
    cur = torch.zeros(B, dtype=torch.int64, device=dev)
    coin = coins[:, 0].clone()
    path = torch.full((B, num_spec_step), -1, dtype=torch.int64, device=dev)
    path[:, 0] = 0
    num = torch.zeros(B, dtype=torch.int64, device=dev)
    live = torch.ones(B, dtype=torch.bool, device=dev)
    for _ in range(1, num_spec_step):
        c = torch.where(live, nt[rows, cur], torch.full_like(cur, -1))
        acc = torch.zeros(B, dtype=torch.float32, device=dev)
        taken = torch.full((B,), -1, dtype=torch.int64, device=dev)
        trying = c >= 0
        while bool(trying.any()):
            cc = c.clamp(min=0)
            tok = cand[rows, cc]
            ps = p[rows, cur, tok.clamp(0, V - 1)]
            acc = torch.where(trying, acc + ps, acc)
            ok = trying & ((coin <= acc / t_acc) | (ps >= t_single))
            rej = trying & ~ok
            if bool(rej.any()):
                scratch[rows[rej], cur[rej], tok[rej]] = ps[rej]
            taken = torch.where(ok, cc, taken)
            c = torch.where(rej, ns[rows, cc], torch.full_like(c, -1))
            trying = rej & (c >= 0)
        moved = taken >= 0
        num = num + moved.to(torch.int64)
        path[rows[moved], num[moved]] = taken[moved]
        cur = torch.where(moved, taken, cur)
        coin = torch.where(moved, coins[rows, cur], coin)
        live = moved
    row = p[rows, cur]
    resid = torch.where((num == num_spec_step - 1)[:, None], row, (row - scratch[rows, cur]).clamp(min=0))
    total = resid.sum(-1)
    u = final_uniforms.reshape(B).to(torch.float32) * total
    above = (resid.cumsum(-1) > u[:, None]) & (resid > 0)
    idx = torch.arange(V, device=dev)
    first = torch.where(above, idx, torch.full_like(idx, V)).min(-1).values
    last_pos = torch.where(resid > 0, idx, torch.full_like(idx, -1)).max(-1).values
    fallback = torch.where(last_pos >= 0, last_pos, torch.full_like(last_pos, V - 1))
    final = torch.where(first < V, first, fallback)
    return path, num, final


def lossy_sample(predicts, accept_index, accept_token_num, candidates, retrive_index, retrive_next_token,
                 retrive_next_sibling, uniform_samples, final_uniforms, target_probs, draft_probs,
                 threshold_single, threshold_acc) -> None:
    """Run :func:`lossy_tree_walk` and write SGLang's outputs in place (inputs validated by the caller):
    ``accept_index [B, S]`` flat indices of the path (root first, -1 padded), ``accept_token_num``,
    ``predicts`` at each path node's flat index: the next path token, then the final draw."""
    B, N = candidates.shape
    S = accept_index.shape[1]
    V = target_probs.shape[2]
    scratch = (draft_probs.to(torch.float32) if draft_probs is not None
               else torch.zeros(B, N, V, dtype=torch.float32, device=candidates.device))
    path, num, final = lossy_tree_walk(candidates, retrive_next_token, retrive_next_sibling, uniform_samples,
                                       final_uniforms, target_probs, scratch, S, threshold_single, threshold_acc)
    ri = retrive_index.to(torch.int64)
    flat = torch.where(path >= 0, torch.gather(ri, 1, path.clamp(min=0)), torch.full_like(path, -1))
    accept_index.copy_(flat.to(accept_index.dtype))
    accept_token_num.copy_(num.to(accept_token_num.dtype))
    cand = candidates.to(torch.int64)
    nxt_tok = torch.gather(cand, 1, path[:, 1:].clamp(min=0))  # token of the next path node
    for j in range(S):
        on = num > j
        if j + 1 < S and bool(on.any()):
            predicts[flat[on, j]] = nxt_tok[on, j].to(predicts.dtype)
    last = torch.gather(flat, 1, num[:, None])[:, 0]
    predicts[last] = final.to(predicts.dtype)
    if draft_probs is not None and draft_probs.dtype != torch.float32:
        draft_probs.copy_(scratch.to(draft_probs.dtype))
