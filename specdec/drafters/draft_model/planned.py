"""Trees of planned shape: sampled dynamic trees (sampling, ``sampled_children=True``) and greedy
planned trees (``tree="planned"``).

The tree's level sizes are fixed before any draft forward: a plan per (node budget, depth, acceptance
table) that maximises the expected accepted length under per-rank acceptance priors
(:func:`specdec.tree.plan_tree`), with at most ``top_k`` nodes expanded per level (one draft forward per
level runs over them, and the draft cache holds ``top_k`` frontier slots per level) and their child
counts: a spine of first children, with siblings where their path probability is highest. WHICH nodes
of a level are expanded is chosen after that level exists: the f nodes most likely to be reached
(EAGLE-2's frontier), the most likely getting the most children.

Sampling exactness. The rejection sampler (SpecInfer multi-step) tries a node's children in index
order against the current residual p' (accept x with probability min(1, p'(x) / q_c(x)); after a
rejection p' <- norm(max(0, p' - q_c)), q_c one-hot for a deterministic candidate). It emits exactly
one token distributed as p if every child, when it is tested, is either DETERMINISTIC given everything
decided before it or DRAWN from its declared q_c independently of everything after it -- and is never
dropped or reordered because of its own drawn value. Given a rejection, the rest of the sibling list
sees the residual whatever it holds, so the list may be built adaptively from earlier siblings'
values. Two rules satisfy this:

* greedy rule (greedy decoding; sampling with ``sampled_children=False``): every child is
  deterministic (the parent's top-ranked draft tokens, fixed tie-breaking), so ranking and pruning
  by score are harmless and ``draft_probs`` is None. Greedy planned trees are planned with
  :data:`~.learners.GREEDY_RANK_ACCEPT` or the rates :class:`~.learners.RankAcceptance` measured, and
  estimate a node's P(reached) as the product of those per-rank rates along its path (draft
  log-probability breaks ties).
* sampled rule: an expanded node's children are DRAWN from q without replacement, child i from q
  renormalised over the tokens its earlier siblings drew, which is its row of ``draft_probs``. The
  frontier choice reads the drawn values of a level, but it only decides which nodes get CHILDREN: a
  node's existence depends on its ancestors and their siblings, all drawn before it, never on its own
  value, and no drawn node is ever dropped. The drawn first child is accepted with probability
  sum(min(p, q)), which a deterministic top-1 child cannot reach at temperature 1. P(reached) is
  estimated from each drawn token's draft probability and its rank among its siblings
  (:func:`estimated_reach`).
"""
from __future__ import annotations

import functools
import math
from typing import TYPE_CHECKING, Dict, List, Optional, Tuple

import torch

from specdec.drafters.base import StepContext
from specdec.drafters.draft_model.cache import frontier_rows
from specdec.drafters.draft_model.proposal import Proposal
from specdec.sampling import warp_
from specdec.tree import TokenTree, ancestor_mask, plan_tree

if TYPE_CHECKING:
    from specdec.drafters.draft_model.model import DraftModel

__all__ = ["SAMPLED_RANK_ACCEPT", "plan_levels", "draw_children", "estimated_reach", "top_children",
           "propose_planned"]

#: Prior P(a node's r-th child is accepted | the node is accepted) that plans the shape of a sampled
#: dynamic tree (children drawn from q without replacement): the first child about as often as a chain's
#: first token, a later sibling (given the earlier ones were rejected) far less. Fitted to the bundled
#: int8 draft at temperature 1 (docs/drafters.md). At most len(SAMPLED_RANK_ACCEPT) children per node.
SAMPLED_RANK_ACCEPT = (0.6, 0.08, 0.05, 0.03)

Plan = List[Tuple[List[int], List[int]]]


def plan_levels(n: int, k: int, acc: Tuple, max_parents: int) -> Plan:
    """The shape of a planned tree of n draft nodes, at most k deep, fixed before any draw.

    Per level d = 1, 2, ...: (positions in level d - 1 of the nodes expanded, their child counts);
    children are grouped by parent in that order. The shape maximises the tree's expected accepted
    length under ``acc`` (``acc[r]`` per sibling rank, or ``acc[d - 1][r]`` per depth and rank: a learned
    table) with at most ``max_parents`` nodes expanded per level."""
    per_depth = bool(acc) and isinstance(acc[0], tuple)

    def rate(d: int, r: int) -> float:
        row = acc[min(d, len(acc)) - 1] if per_depth else acc
        return row[r] if r < len(row) else 0.0

    parents, slots, _ = plan_tree(rate, n + 1, max_depth=k, max_parents_per_depth=max_parents)
    kids: Dict[int, List[int]] = {}
    for c in range(1, len(parents)):
        kids.setdefault(parents[c], []).append(c)  # in the order of their ranks
    # levels: the nodes of depth d grouped by parent (in the parent level's order), by rank
    levels, plan = [[0]], []
    while True:
        prev = levels[-1]
        pos = [i for i, x in enumerate(prev) if x in kids]
        if not pos:
            break
        plan.append((pos, [len(kids[prev[i]]) for i in pos]))
        levels.append([c for i in pos for c in kids[prev[i]]])
    return plan


@functools.lru_cache(maxsize=64)
def _sibling_consts(counts: Tuple[int, ...], device: str) -> Tuple[torch.Tensor, torch.Tensor]:
    """For children grouped by parent (``counts`` per parent): [c] bool, the first child of its parent; and
    [c, c] float32 E with E[j, i] = 1 when j is an earlier sibling of i (so x @ E sums x over earlier siblings).
    Built once per plan level (the plans are fixed), not per step."""
    grp = torch.tensor([j for j, n in enumerate(counts) for _ in range(n)])
    first = torch.tensor([i == 0 for n in counts for i in range(n)])
    idx = torch.arange(len(grp))
    earlier = (grp.view(-1, 1) == grp.view(1, -1)) & (idx.view(-1, 1) < idx.view(1, -1))
    return first.to(device), earlier.to(torch.float32).to(device)


@functools.lru_cache(maxsize=256)
def _top_consts(counts: Tuple[int, ...], cmax: int, acc: Tuple[float, ...], device: str
                ) -> Tuple[Tuple[int, ...], torch.Tensor, torch.Tensor]:
    """For the greedy children of a planned level (``counts`` per parent, at most cmax of each parent's
    top-cmax): the parent index of each child, its index into the flattened [f * cmax] top-k, and log of
    its rank's planned acceptance. Built once per (level shape, table), not per step."""
    par = tuple(j for j, c in enumerate(counts) for _ in range(c))
    sib = [i for c in counts for i in range(c)]
    flat = torch.tensor([j * cmax + i for j, i in zip(par, sib)], dtype=torch.int64, device=device)
    prior = torch.tensor([math.log(max(acc[i], 1e-4)) if i < len(acc) else math.log(1e-4) for i in sib],
                         dtype=torch.float32, device=device)
    return par, flat, prior


def draw_children(q: torch.Tensor, counts: List[int], dist: torch.Tensor, generator: torch.Generator
                  ) -> Tuple[torch.Tensor, torch.Tensor, List[int]]:
    """Children of f parents [b, f, V] (q rows, warped): parent j gets counts[j] (<= V) children DRAWN
    from q_j without replacement, child i from q_j renormalised over the tokens drawn before it.
    Writes each child's draw distribution into ``dist`` [b, c, V] (its rows of ``draft_probs``);
    returns tokens [b, c], log q [b, c] and the parent rank of each child (host list), children
    grouped by parent."""
    b, f, V = q.shape
    cmax = max(counts)
    first = [sum(counts[:j]) for j in range(f)]                  # each parent's first child
    toks = torch.empty(b, dist.shape[1], dtype=torch.int64, device=q.device)
    rest = q
    drawn = None                                                 # the tokens drawn in the previous round
    for i in range(cmax):
        if i:  # without replacement: the tokens drawn so far leave the distribution
            last = drawn.unsqueeze(2)
            rest = rest.scatter(2, last, 0.0)
            mass = rest.sum(dim=2, keepdim=True)
            # a warp (top-k / top-p) may leave fewer tokens than children: such a child repeats the
            # last token as a deterministic node (one-hot row; already rejected, it cannot be accepted)
            one_hot = torch.zeros_like(rest).scatter_(2, last, 1.0)
            rest = torch.where(mass > 0, rest / mass.clamp_min(1e-30), one_hot)
        drawn = torch.multinomial(rest.reshape(b * f, V), 1, generator=generator).view(b, f)
        js = [j for j in range(f) if counts[j] > i]
        at = torch.tensor([first[j] + i for j in js], dtype=torch.int64, device=q.device)
        src = torch.tensor(js, dtype=torch.int64, device=q.device)
        toks[:, at] = drawn.index_select(1, src)
        dist[:, at] = rest.index_select(1, src)
    rank = [j for j, c in enumerate(counts) for _ in range(c)]
    par = torch.tensor(rank, dtype=torch.int64, device=q.device)
    logq = torch.log(q.reshape(b, f * V).gather(1, par * V + toks))                 # log q_parent(token)
    return toks, logq, rank


def estimated_reach(logq: torch.Tensor, counts: List[int]) -> torch.Tensor:
    """log P(child accepted | parent accepted) estimated per drawn child [b, c] (children grouped by parent,
    ``counts`` per parent, in draw order): its earlier siblings all rejected, then it accepted. A drawn
    token's acceptance is estimated from its draft probability q(x): a = 0.25 + 0.6 sqrt(q) for a first
    child, 0.1 + 0.45 sqrt(q) for a later sibling given the earlier ones were rejected (curves fitted
    offline to the bundled int8 draft, see docs/drafters.md). Their order -- rising with q, a sibling
    below a first child -- is what matters: they only rank the nodes that get children, and exactness
    does not depend on them."""
    first, earlier = _sibling_consts(tuple(counts), str(logq.device))
    s = logq.exp().sqrt()
    a = torch.where(first, 0.25 + 0.6 * s, 0.1 + 0.45 * s).clamp(0.01, 0.97)
    return a.log() + torch.log1p(-a) @ earlier


def top_children(logits: torch.Tensor, counts: List[int], depth: int, acc: Tuple
                 ) -> Tuple[torch.Tensor, torch.Tensor, List[int], torch.Tensor]:
    """Children of f parents [b, f, V] (raw draft logits) under the greedy rule: parent j gets its
    counts[j] most probable tokens (torch.topk's order, a function of the logits alone). Returns
    tokens [b, c], log q [b, c], the parent index of each child (host list; children grouped by
    parent) and log of each child's planned acceptance given its parent's (``acc``, the plan's table,
    by its rank among its siblings) + 1e-3 log q (ties between equal ranks go to the likelier)."""
    b, f, V = logits.shape
    cmax = min(max(counts), V)
    vals, idx = torch.topk(logits.float(), cmax, dim=2)                        # [b, f, cmax]
    lse = torch.logsumexp(logits.float(), dim=2, keepdim=True)
    if acc and isinstance(acc[0], tuple):
        acc = acc[min(depth, len(acc)) - 1]
    par, flat, prior = _top_consts(tuple(counts), cmax, tuple(acc), str(logits.device))
    toks = idx.reshape(b, f * cmax).index_select(1, flat)
    logq = (vals - lse).reshape(b, f * cmax).index_select(1, flat)
    return toks, logq, list(par), prior + 1e-3 * logq


def propose_planned(dm: "DraftModel", ctx: StepContext, plan: Plan, acc: Tuple, n: int, k: int, b: int, cache,
                    last: torch.Tensor, drawn: bool) -> Proposal:
    """A tree of the planned shape ``plan`` (of at most ``n`` nodes) from ``last``, the draft logits after
    each row's root: children drawn from q (``drawn``, the sampled rule) or the top-ranked tokens (the
    greedy rule, planned with ``acc``). See the module docstring."""
    step = _PlannedStep(dm, cache, b, n, plan, drawn, acc)
    step.first_level(last, plan[0][1])
    for d in range(1, len(plan)):
        step.next_level(d, *plan[d])
    return step.proposal(ctx, k)


class _PlannedStep:
    """The levels of one planned step built so far, per level [b, m]: tokens, estimated log P(reached),
    parent pool index (pool: the draft nodes in level order), depth and first pool index; the forwarded
    frontier's slots in the draft cache (``slot_of`` [b, n] per pool index, ``anc`` their ancestry)."""

    def __init__(self, dm: "DraftModel", cache, b: int, n: int, plan: Plan, drawn: bool, acc: Tuple) -> None:
        self.dm, self.cache, self.b, self.plan, self.drawn, self.acc = dm, cache, b, plan, drawn, acc
        dev = dm.device
        self.F = sum(len(pos) for pos, _ in plan[1:])                # forwarded frontier nodes
        self.N = 1 + sum(sum(c) for _, c in plan)
        # drawn: each node's row holds the distribution it was drawn from (the root's row is unused)
        self.probs = torch.zeros(b, self.N, dm.V, dtype=torch.float32, device=dev) if drawn else None
        self.toks: List[torch.Tensor] = []
        self.score: List[torch.Tensor] = []
        self.par: List[torch.Tensor] = []
        self.depth: List[int] = []
        self.start = [0]
        self.slot_of = torch.full((b, n), -1, dtype=torch.int64, device=dev)
        self.anc = torch.zeros(b, max(self.F, 1), max(self.F, 1), dtype=torch.bool, device=dev)
        self.s0 = 0

    def first_level(self, last: torch.Tensor, counts: List[int]) -> None:
        """The root's children from the draft logits after the root [b, V]."""
        dm = self.dm
        if self.drawn:
            q0 = warp_(last.to(torch.float32, copy=True), dm.params).unsqueeze(1)     # [b, 1, V]
            t, lq, _ = draw_children(q0, counts, self.probs[:, 1:1 + sum(counts)], dm.generator)
            self.score.append(estimated_reach(lq, counts))
        else:
            t, lq, _, reach = top_children(last.unsqueeze(1), counts, 1, self.acc)
            self.score.append(reach)
        self.toks.append(t)
        self.par.append(torch.full_like(t, -1))
        self.depth.append(1)

    def next_level(self, d: int, pos: List[int], counts: List[int]) -> None:
        """Level d + 1: one draft forward over the f nodes of level d most likely reached (chosen after
        they exist: it decides only who gets children), the most likely first, with the most children."""
        dm, b, dev, s0 = self.dm, self.b, self.dm.device, self.s0
        prev = self.score[-1]                                        # [b, m_prev] log P(reached), estimated
        f = len(pos)
        rank_idx = torch.topk(prev, f, dim=1).indices
        counts = sorted(counts, reverse=True)
        frontier = self.start[-1] + rank_idx                         # pool indices
        self.slot_of.scatter_(1, frontier, torch.arange(s0, s0 + f, device=dev).expand(b, f))
        pslot = None
        if d > 1:                                                    # the frontier's parents' slots
            pslot = self.slot_of.gather(1, self.par[-1].gather(1, rank_idx))
        rows = frontier_rows(self.anc, pslot, s0, f, self.F, torch.eye(f, dtype=torch.bool, device=dev))
        ftok = self.toks[-1].gather(1, rank_idx)
        depths = torch.full((b, f), d - 1, dtype=torch.int32, device=dev)
        logits = dm.lm.forward(self.cache, ftok, depths, rows[:, :, :s0 + f].contiguous(), kv_offset=s0)
        first = self.start[-1] + prev.shape[1]
        if self.drawn:
            q = warp_(logits.to(torch.float32), dm.params)          # [b, f, V]
            t, lq, rank = draw_children(q, counts, self.probs[:, 1 + first:1 + first + sum(counts)], dm.generator)
            reach = estimated_reach(lq, counts)
        else:
            t, lq, rank, reach = top_children(logits, counts, d + 1, self.acc)
        ranks = torch.tensor(rank, dtype=torch.int64, device=dev)
        self.toks.append(t)
        self.score.append(prev.gather(1, rank_idx).index_select(1, ranks) + reach)
        self.par.append(frontier.index_select(1, ranks))
        self.depth.append(d + 1)
        self.start.append(first)
        self.s0 += f

    def proposal(self, ctx: StepContext, k: int) -> Proposal:
        """The tree of the levels built (pool order, topological) and its record."""
        b, N, dev, plan = self.b, self.N, self.dm.device, self.plan
        tokens = torch.cat([ctx.roots.view(b, 1).to(torch.int64)] + self.toks, dim=1)        # [b, N]
        ppool = torch.cat(self.par, dim=1)
        parents = torch.cat([torch.full((b, 1), -1, dtype=torch.int64, device=dev), ppool + 1], dim=1)
        parents[:, 1:] = torch.where(ppool < 0, 0, ppool + 1)
        depth_list = [0] + [dl for dl, tl in zip(self.depth, self.toks) for _ in range(tl.shape[1])]
        depths = torch.tensor(depth_list, dtype=torch.int32, device=dev).expand(b, N).contiguous()
        parents = parents.to(torch.int32).contiguous()
        slot = self.slot_of[:, :N - 1]
        slots = torch.cat([torch.zeros(b, 1, dtype=torch.int64, device=dev),
                           torch.where(slot >= 0, slot + 1, -1)], dim=1)
        node_rank: Optional[torch.Tensor] = None
        node_depth: Optional[torch.Tensor] = None
        if not self.drawn:   # for the rank counts: each node's sibling rank (children grouped as drafted)
            node_rank = torch.tensor([-1] + [i for _, c in plan for cnt in sorted(c, reverse=True)
                                             for i in range(cnt)], dtype=torch.int64, device=dev)
            node_depth = torch.tensor(depth_list, dtype=torch.int64, device=dev)
        tree = TokenTree(tokens, parents, depths, [N] * b, is_chain=False,
                         _mask=ancestor_mask(parents, max_depth=len(plan)), max_depths=[len(plan)] * b)
        return Proposal(tree, self.probs, b=b, k=k, tokens=tokens, slots=slots, forwarded=self.F,
                        node_rank=node_rank, node_depth=node_depth)
