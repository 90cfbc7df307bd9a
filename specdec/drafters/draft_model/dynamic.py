"""Dynamic trees (``tree="dynamic"``, EAGLE-2's expand + re-rank) under the greedy rule.

Depth 1 is the top w children of the root. At each further depth ONE draft forward runs over the
current frontier (w nodes per request): they attend to the committed prefix, the root and their
ancestors drafted earlier in this step, which sit past ``cache.lens`` (``forward(..., kv_offset=...)``
with a [b, w, kv_offset + w] mask, verify_attention's frontier form), so no earlier depth is ever
recomputed. Each frontier node gets its top w children, scored by their path's cumulative score; the
best w of all those children form the next frontier. After depth k the whole pool (w + (k - 1) w^2
candidates) is re-ranked to the ``node_budget - 1`` best: a child never scores above its parent and
ties keep pool order (a stable sort; parents are created first), so the best-n set is a connected
subtree, emitted in pool order, which is topological. k draft forwards per step, like a chain.

A path's score sums, per node, log q (EAGLE-2: the draft's probability, warped under sampling), or
with ``calibrate`` the log of the node's estimated acceptance, min(1, q x its calibration cell's
factor) (:class:`~.learners.Calibration`). The children are the deterministic top-w of q either way,
so every ranking is exact.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Optional

import torch

from specdec.drafters.base import StepContext
from specdec.drafters.draft_model.cache import frontier_rows
from specdec.drafters.draft_model.learners import Calibration
from specdec.drafters.draft_model.proposal import Proposal
from specdec.sampling import SamplingParams, warp_
from specdec.tree import TokenTree, ancestor_mask

if TYPE_CHECKING:
    from specdec.drafters.draft_model.model import DraftModel

__all__ = ["scores", "propose_dynamic"]


def scores(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Draft log-probabilities [..., V] that rank candidates (warped under sampling)."""
    if params.greedy:
        return torch.log_softmax(logits.float(), dim=-1)
    return torch.log(warp_(logits.to(torch.float32, copy=True), params))


@dataclass
class _Pool:
    """The candidates of one step [b, M], in creation order (parents before their children)."""

    tok: torch.Tensor                     # token
    par: torch.Tensor                     # pool index of the parent (-1: the root)
    score: torch.Tensor                   # cumulative path score
    depth: torch.Tensor
    slot: torch.Tensor                    # forward slot (-1: a leaf, never forwarded)
    cell: Optional[torch.Tensor] = None   # calibrated: calibration cell of each candidate
    logq: Optional[torch.Tensor] = None   # calibrated: its draft log-probability

    @staticmethod
    def new(b: int, M: int, dev: torch.device, cal: bool) -> "_Pool":
        pool = _Pool(torch.empty(b, M, dtype=torch.int64, device=dev),
                     torch.full((b, M), -1, dtype=torch.int64, device=dev),
                     torch.empty(b, M, dtype=torch.float32, device=dev),
                     torch.empty(b, M, dtype=torch.int32, device=dev),
                     torch.full((b, M), -1, dtype=torch.int64, device=dev))
        if cal:
            pool.cell = torch.empty(b, M, dtype=torch.int64, device=dev)
            pool.logq = torch.empty(b, M, dtype=torch.float32, device=dev)
        return pool

    def node_scores(self, cal: Optional[Calibration], log_ratio: Optional[torch.Tensor], at: int,
                    logq: torch.Tensor) -> torch.Tensor:
        """The per-node scores of new candidates (pool positions ``at`` on) from their draft log q [b, ...]:
        log q itself, or calibrated (their cells and log q recorded for the calibration counts)."""
        if cal is None:
            return logq
        b = logq.shape[0]
        cell = cal.cells(logq)
        m = cell.numel() // b
        self.cell[:, at:at + m] = cell.reshape(b, m)
        self.logq[:, at:at + m] = logq.reshape(b, m)
        return (logq + log_ratio[cell]).clamp_(max=0.0)


def propose_dynamic(dm: "DraftModel", ctx: StepContext, k: int, b: int, cache, last: torch.Tensor) -> Proposal:
    """EAGLE-2-style expand (w frontier nodes per depth, one forward each) + re-rank (see the module docstring)."""
    w = dm.top_k
    F = (k - 1) * w                       # frontier nodes that get forwarded (K/V in the draft cache)
    cal = dm.cal_table if dm.calibrate else None  # the greedy rule: deterministic children, any ranking is exact
    pool = _Pool.new(b, w + (k - 1) * w * w, dm.device, cal is not None)
    log_ratio = cal.log_ratios() if cal is not None else None              # [w * CAL_BUCKETS]
    vals, idx = torch.topk(scores(last, dm.params), w, dim=-1)             # [b, w]
    pool.tok[:, :w] = idx
    pool.score[:, :w] = pool.node_scores(cal, log_ratio, 0, vals)
    pool.depth[:, :w] = 1
    used = _expand(dm, pool, cache, k, F, cal, log_ratio)
    n = min(dm.max_nodes - 1, used)
    if ctx.node_budget is not None:
        n = max(1, min(n, int(ctx.node_budget) - 1))
    return _rerank(ctx, pool, used, n, k, F)


def _expand(dm: "DraftModel", pool: _Pool, cache, k: int, F: int, cal: Optional[Calibration],
            log_ratio: Optional[torch.Tensor]) -> int:
    """Depths 2 .. k: one draft forward over the frontier per depth, w children per frontier node, the
    best w children the next frontier. Returns the candidates in the pool."""
    b = pool.tok.shape[0]
    w = dm.top_k
    dev = dm.device
    frontier = torch.arange(w, device=dev).expand(b, w)                  # [b, w] pool indices
    anc = torch.zeros(b, max(F, 1), max(F, 1), dtype=torch.bool, device=dev)  # ancestor-or-self among slots
    eye = torch.eye(w, dtype=torch.bool, device=dev)
    used = w
    for d in range(1, k):
        s0 = (d - 1) * w                                                 # slots of this frontier: s0 .. s0 + w
        pool.slot.scatter_(1, frontier, torch.arange(s0, s0 + w, device=dev).expand(b, w))
        # parents are the previous frontier (depth 1: the root, no slot)
        pslot = pool.slot.gather(1, pool.par.gather(1, frontier)) if d > 1 else None
        rows = frontier_rows(anc, pslot, s0, w, F, eye)
        toks = pool.tok.gather(1, frontier)                              # [b, w]
        depths = torch.full((b, w), d - 1, dtype=torch.int32, device=dev)  # root is committed: depth d at lens + d - 1
        logits = dm.lm.forward(cache, toks, depths, rows[:, :, :s0 + w].contiguous(), kv_offset=s0)
        cv, ci = torch.topk(scores(logits, dm.params), w, dim=-1)        # [b, w, w]
        cv = pool.node_scores(cal, log_ratio, used, cv)
        cs = (pool.score.gather(1, frontier).unsqueeze(2) + cv).reshape(b, w * w)
        pool.tok[:, used:used + w * w] = ci.reshape(b, w * w)
        pool.par[:, used:used + w * w] = frontier.unsqueeze(2).expand(b, w, w).reshape(b, w * w)
        pool.score[:, used:used + w * w] = cs
        pool.depth[:, used:used + w * w] = d + 1
        if d < k - 1:
            frontier = used + torch.topk(cs, w, dim=-1).indices
        used += w * w
    return used


def _rerank(ctx: StepContext, pool: _Pool, used: int, n: int, k: int, F: int) -> Proposal:
    """The best ``n`` of the ``used`` candidates per row, as a tree in pool order (topological)."""
    b = pool.tok.shape[0]
    dev = pool.tok.device
    # stable descending sort keeps a parent before its equal-scored child -> connected
    best = torch.sort(pool.score[:, :used], dim=1, descending=True, stable=True).indices[:, :n]
    sel = torch.sort(best, dim=1).values                                 # [b, n] pool order = topological
    pos = torch.full((b, used), -1, dtype=torch.int64, device=dev)
    pos.scatter_(1, sel, torch.arange(1, n + 1, device=dev).expand(b, n))
    ppool = pool.par.gather(1, sel)
    par = torch.where(ppool < 0, 0, pos.gather(1, ppool.clamp(min=0)))
    N = n + 1
    tokens = torch.cat([ctx.roots.view(b, 1).to(torch.int64), pool.tok.gather(1, sel)], dim=1)
    parents = torch.cat([torch.full((b, 1), -1, dtype=torch.int64, device=dev), par], dim=1).to(torch.int32)
    depths = torch.cat([torch.zeros(b, 1, dtype=torch.int32, device=dev), pool.depth.gather(1, sel)], dim=1)
    slot = pool.slot.gather(1, sel)
    slots = torch.cat([torch.zeros(b, 1, dtype=torch.int64, device=dev),
                       torch.where(slot >= 0, slot + 1, -1)], dim=1)  # [b, N] 0 root, 1 + slot, -1
    cell = q = None
    if pool.cell is not None:
        cell = torch.cat([torch.full((b, 1), -1, dtype=torch.int64, device=dev),
                          pool.cell.gather(1, sel)], dim=1)                  # [b, N] (root: -1)
        q = torch.cat([torch.zeros(b, 1, dtype=torch.float32, device=dev), pool.logq.gather(1, sel).exp()], dim=1)
    mask = ancestor_mask(parents, max_depth=k)
    tree = TokenTree(tokens.contiguous(), parents.contiguous(), depths.contiguous(), [N] * b, is_chain=False,
                     _mask=mask)
    return Proposal(tree, b=b, k=k, tokens=tokens, slots=slots, forwarded=F, cal_cell=cell, cal_q=q)
