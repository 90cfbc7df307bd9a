"""The draft model's two online learners: both count, after every verification and on the device
(scatters, no host read), how the candidates of the last tree fared, and feed that back into how
the next trees are built.

* :class:`Calibration` (greedy-rule dynamic trees, ``calibrate=True``): per cell -- a candidate's
  rank among its parent's top-w children and its draft probability q in halving bins -- the
  candidates whose parent was accepted ("reached"), the accepted ones and their summed q. A
  candidate's estimated acceptance is ``min(1, q * factor)`` with the cell's factor ``accepted / sum q``
  shrunk towards 1; the dynamic tree ranks its candidates by the sum of the logs of these estimates.
* :class:`RankAcceptance` (greedy planned trees): per (depth, sibling rank) the children whose
  parent was accepted and the accepted ones; with ``learn_plan`` the planned shape is re-planned
  from these rates every :data:`PLAN_EVERY` planned steps.
"""
from __future__ import annotations

import math
from typing import Dict, List, Tuple

import torch

__all__ = ["CAL_BUCKETS", "CAL_PRIOR", "GREEDY_RANK_ACCEPT", "PLAN_EVERY", "PLAN_PRIOR", "Calibration",
           "RankAcceptance"]

#: Calibration cells: draft probability q in CAL_BUCKETS halving bins ([1/2, 1], [1/4, 1/2), ..., the
#: last holding everything below 2^-(CAL_BUCKETS - 1)), per sibling rank.
CAL_BUCKETS = 10
#: A cell's correction factor starts at 1, worth CAL_PRIOR observations at the bin's middle probability.
CAL_PRIOR = 4.0

#: Prior P(a node's r-th child is accepted | the node is accepted) that plans the shape of a greedy
#: planned tree (``tree="planned"``). The children are the draft's top-ranked tokens and the r-th is
#: accepted when it IS the target's argmax, so the values are marginal (the siblings exclude each other).
#: Fitted to the bundled int8 draft (docs/drafters.md); ``learn_plan`` replaces it by measured rates.
GREEDY_RANK_ACCEPT = (0.73, 0.119, 0.056, 0.032, 0.015)

#: With learn_plan, a greedy planned tree re-plans every PLAN_EVERY planned steps, each (depth, rank)
#: rate (accepted + PLAN_PRIOR x prior) / (reached + PLAN_PRIOR), rounded to 0.01 (so that plans,
#: cached per table, are few).
PLAN_EVERY = 16
PLAN_PRIOR = 32.0


class Calibration:
    """Calibration counts of one binding (a draft against a target), ``top_k`` ranks x CAL_BUCKETS bins.

    ``counts`` [3, top_k * CAL_BUCKETS] float32: reached candidates, accepted ones, reached sum of q."""

    def __init__(self, top_k: int, device: torch.device) -> None:
        self.top_k = top_k
        self.counts = torch.zeros(3, top_k * CAL_BUCKETS, dtype=torch.float32, device=device)
        mid = torch.pow(2.0, -torch.arange(CAL_BUCKETS, dtype=torch.float32, device=device) - 0.5)  # bin middles
        self.pseudo = CAL_PRIOR * mid.repeat(top_k)        # prior: CAL_PRIOR observations at factor 1
        self.rank_cell = torch.arange(top_k, device=device) * CAL_BUCKETS   # first cell of each sibling rank

    @staticmethod
    def bucket(logq: torch.Tensor) -> torch.Tensor:
        """The probability bin of draft log-probabilities: floor(-log2 q), at most CAL_BUCKETS - 1."""
        return (logq * (-1.0 / math.log(2.0))).clamp_(0.0, CAL_BUCKETS - 1).to(torch.int64)

    def cells(self, logq: torch.Tensor) -> torch.Tensor:
        """The cell of each candidate of ``logq`` [..., top_k] (the last dimension: sibling rank)."""
        return self.rank_cell + self.bucket(logq)

    def log_ratios(self) -> torch.Tensor:
        """log of each cell's correction factor [top_k * CAL_BUCKETS]: a candidate of the cell is estimated
        to be accepted (given its parent is) with probability min(1, q * factor), factor = accepted / (sum
        of q) over the cell's reached candidates, shrunk towards 1. A calibrated draft keeps EAGLE-2's
        ranking (factor 1); a draft whose argmax is right more often than its q says (a quantized copy of
        the target) gets deep spines instead of unlikely siblings."""
        return ((self.counts[1] + self.pseudo) / (self.counts[2] + self.pseudo)).log_()

    def report(self) -> Dict[str, List[List[float]]]:
        """The counts per rank (rows) and bin (columns): reached, accepted, reached sum of q."""
        seen, hit, mass = self.counts.view(3, self.top_k, CAL_BUCKETS).tolist()
        return {"reached": seen, "accepted": hit, "reached_q": mass}

    def update(self, parents: torch.Tensor, cell: torch.Tensor, q: torch.Tensor, path: torch.Tensor,
               on_path: torch.Tensor) -> None:
        """Count, for every node of a calibrated tree whose parent lies on the accepted path (or is the
        root), whether it was accepted. ``parents`` [b, N] int64 (-1: root / padding), ``cell`` [b, N]
        (root: -1) and ``q`` [b, N] of the tree's nodes; ``path`` [b, P]: accepted node indices, valid
        where ``on_path``."""
        b, N = parents.shape
        on = torch.zeros(b, N + 1, dtype=torch.bool, device=self.counts.device)
        on[:, 0] = True
        on.scatter_(1, torch.where(on_path & (path < N), path, N), True)
        on = on[:, :N]
        reached = (parents >= 0) & (cell >= 0) & on.gather(1, parents.clamp(min=0))
        flat = cell.clamp(min=0).view(-1)
        self.counts[0].scatter_add_(0, flat, reached.view(-1).to(torch.float32))
        self.counts[1].scatter_add_(0, flat, (reached & on).view(-1).to(torch.float32))
        self.counts[2].scatter_add_(0, flat, torch.where(reached, q, 0.0).view(-1))


class RankAcceptance:
    """Per (depth, sibling rank) counts of greedy planned trees, and the acceptance table their plans use.

    ``counts`` [2, k, len(GREEDY_RANK_ACCEPT)] float32: reached (an accepted parent had a child of that
    rank at that depth), accepted. ``table``: GREEDY_RANK_ACCEPT (per rank) until learned, then per
    (depth, rank)."""

    def __init__(self, k: int, device: torch.device) -> None:
        self.counts = torch.zeros(2, k, len(GREEDY_RANK_ACCEPT), dtype=torch.float32, device=device)
        self.table: Tuple = GREEDY_RANK_ACCEPT
        self.steps = 0

    def next_table(self, learn: bool) -> Tuple:
        """The table that plans the next greedy planned tree: with ``learn``, every PLAN_EVERY calls the
        measured rates per (depth, rank), each shrunk towards the prior (one host read of the counts)."""
        self.steps += 1
        if learn and self.steps % PLAN_EVERY == 0:
            reached, hit = self.counts.tolist()
            prior = GREEDY_RANK_ACCEPT
            self.table = tuple(
                tuple(round(min(0.999, max(0.001, (a + PLAN_PRIOR * p) / (r + PLAN_PRIOR))), 2)
                      for r, a, p in zip(rd, hd, prior)) for rd, hd in zip(reached, hit))
        return self.table

    def report(self) -> Dict[str, list]:
        """``reached`` and ``accepted`` per depth (rows) and sibling rank (columns), and ``planned``, the
        table the plans now use (per rank, or per depth and rank once learned)."""
        reached, hit = self.counts.tolist()
        return {"reached": reached, "accepted": hit, "planned": [list(x) if isinstance(x, tuple) else x
                                                                 for x in self.table]}

    def update(self, kids: torch.Tensor, node_rank: torch.Tensor, node_depth: torch.Tensor, path: torch.Tensor,
               on_path: torch.Tensor) -> None:
        """Count a planned tree's outcome: the root and every accepted node are reached parents, each child
        rank they had was reached at the children's depth, the accepted child's (depth, rank) was accepted.
        ``kids`` [b, N]: children per node; ``node_rank`` / ``node_depth`` [N]: each node's sibling rank
        (root: -1) and depth; ``path`` [b, P]: accepted node indices, valid where ``on_path``."""
        b = path.shape[0]
        D, R = self.counts.shape[1:]
        node = path.clamp(min=0)
        kids = kids[:b]
        pk = torch.cat([kids[:, :1], torch.where(on_path, kids.gather(1, node), 0)], dim=1)        # [b, 1 + P]
        pd = torch.cat([torch.zeros_like(node[:, :1]), node_depth.gather(0, node.view(-1)).view(b, -1)], 1)
        ranks = torch.arange(R, device=path.device).view(1, 1, R)
        seen = (pk.unsqueeze(2) > ranks) & (pd < D).unsqueeze(2)                                    # [b, 1 + P, R]
        cell = pd.clamp(max=D - 1).unsqueeze(2) * R + ranks
        self.counts[0].view(-1).scatter_add_(0, cell.reshape(-1), seen.reshape(-1).to(torch.float32))
        rank = node_rank.gather(0, node.view(-1)).view(b, -1)
        depth = node_depth.gather(0, node.view(-1)).view(b, -1)
        hit = on_path & (rank >= 0) & (rank < R) & (depth >= 1) & (depth <= D)
        cell = (depth - 1).clamp(0, D - 1) * R + rank.clamp(0, R - 1)
        self.counts[1].view(-1).scatter_add_(0, cell.view(-1), hit.view(-1).to(torch.float32))
