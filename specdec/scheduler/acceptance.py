"""Acceptance statistics: how likely each draft position (and each tree depth / sibling rank) is accepted.

One :class:`AcceptanceStats` per request, seeded from a decoder-wide one; the policies turn them into
expected tokens per step (E[T]) for every draft depth. See docs/scheduler.md.
"""
from __future__ import annotations

from typing import Dict, List, Optional, Sequence, Tuple

from specdec.tree import expected_tokens_chain

__all__ = ["AcceptanceStats"]


class AcceptanceStats:
    """Exponentially weighted acceptance by draft position (and by tree depth / sibling rank).

    ``alpha(i)`` (i = 0 for the first draft position) = (hits_i + w * prior_i) / (trials_i + w),
    where hits / trials decay by ``decay`` at every observation (of every position: a position the
    step did not reach keeps its ratio but loses weight) and prior_i is the parent statistics'
    estimate (a decoder-wide :class:`AcceptanceStats`), or for a root ``prior`` at position 0 and
    the estimate of position i - 1 deeper (see :meth:`alphas`).
    """

    def __init__(self, decay: float = 0.8, prior: float = 0.5, prior_weight: float = 0.5,
                 parent: Optional["AcceptanceStats"] = None) -> None:
        if not 0.0 < decay <= 1.0:
            raise ValueError(f"AcceptanceStats: decay must lie in (0, 1], got {decay}")
        if not 0.0 <= prior <= 1.0:
            raise ValueError(f"AcceptanceStats: prior must lie in [0, 1], got {prior}")
        self.decay = decay
        self.prior = prior
        self.prior_weight = prior_weight
        self.parent = parent
        self.hits: List[float] = []
        self.trials: List[float] = []
        self.tree_hits: Dict[Tuple[int, int], float] = {}
        self.tree_trials: Dict[Tuple[int, int], float] = {}
        self.observations = 0

    def reset(self) -> None:
        """Forget this request's history (its estimates fall back to the prior)."""
        self.hits, self.trials = [], []
        self.tree_hits, self.tree_trials = {}, {}
        self.observations = 0

    def alphas(self, k: int) -> List[float]:
        """[alpha(0), ..., alpha(k - 1)]: P(draft position i + 1 accepted | position i accepted).

        alpha(i) = (hits_i + w * prior_i) / (trials_i + w). The prior of position 0 is the parent's
        estimate (a decoder-wide :class:`AcceptanceStats`) or ``prior``; deeper positions of a root
        statistics take the estimate of the position before as their prior (acceptance by position
        is roughly flat), so a position never observed, or observed long ago (its evidence decays
        while it is not observed, see :meth:`observe`), extrapolates the shallower ones. Capping
        such positions at a fixed prior would be a trap: a policy that drafts k = 2 never observes
        position 4 again, so one early rejection there would keep every deeper draft looking bad.
        A request's statistics with a parent use the parent's estimate of each position as its
        prior; deeper than the request has observed, its deepest estimate, capped by the parent's
        where the parent has evidence there (other requests drafted that deep).
        """
        w = self.prior_weight
        pa = self.parent.alphas(k) if self.parent is not None else None
        n = len(self.trials)
        out: List[float] = []
        for i in range(k):
            if pa is not None:
                prior = pa[i]
            else:
                prior = out[-1] if out else self.prior
            if i < n:
                a = (self.hits[i] + w * prior) / (self.trials[i] + w)
            elif pa is None or n == 0:
                a = prior
            else:
                own = out[n - 1]
                a = min(own, prior) if self.parent._observed(i) else own
            out.append(a)
        return out

    def alpha(self, i: int) -> float:
        """P(draft position i + 1 accepted | position i accepted), 0-based i (see :meth:`alphas`)."""
        return self.alphas(i + 1)[i]

    def _observed(self, i: int) -> bool:
        return i < len(self.trials) and self.trials[i] > 1e-3

    def expected(self, k: int) -> float:
        """E[T] of a depth-k draft with these statistics."""
        return expected_tokens_chain(self.alphas(k), k)

    def expected_curve(self, k_max: int) -> List[float]:
        """[E[T](0), E[T](1), ..., E[T](k_max)]."""
        out, total, run = [1.0], 1.0, 1.0
        for a in self.alphas(k_max):
            run *= a
            total += run
            out.append(total)
        return out

    def observe(self, depth: int, accepted: int) -> None:
        """A step drafted ``depth`` positions (a chain, or a tree of that depth) and accepted a path of
        ``accepted`` of them: positions 1..accepted were accepted, position accepted + 1 rejected."""
        if depth <= 0:
            return
        seen = min(accepted + 1, depth)
        while len(self.trials) < seen:
            self.hits.append(0.0)
            self.trials.append(0.0)
        d = self.decay
        for i in range(seen):
            self.hits[i] = d * self.hits[i] + (1.0 if i < accepted else 0.0)
            self.trials[i] = d * self.trials[i] + 1.0
        for i in range(seen, len(self.trials)):  # not reached this time: older evidence weighs less
            self.hits[i] *= d
            self.trials[i] *= d
        self.observations += 1
        if self.parent is not None:
            self.parent.observe(depth, accepted)

    # ---- trees: by (depth, sibling rank)
    def observe_tree(self, parents: Sequence[int], accepted_path: Sequence[int]) -> None:
        """One verified tree (host ``parents``, topological) and its accepted node indices (root first).

        Every child of an accepted node is a trial at (its depth, its rank among its siblings); a hit
        when it is on the accepted path.
        """
        on_path = set(int(x) for x in accepted_path if int(x) >= 0)
        depth = [0] * len(parents)
        rank = [0] * len(parents)
        nchild = [0] * len(parents)
        d = self.decay
        for i in range(1, len(parents)):
            p = int(parents[i])
            if p < 0:
                continue  # padding
            depth[i] = depth[p] + 1
            rank[i] = nchild[p]
            nchild[p] += 1
            if p in on_path:
                key = (depth[i], rank[i])
                self.tree_hits[key] = d * self.tree_hits.get(key, 0.0) + (1.0 if i in on_path else 0.0)
                self.tree_trials[key] = d * self.tree_trials.get(key, 0.0) + 1.0
        if self.parent is not None:
            self.parent.observe_tree(parents, accepted_path)

    def tree_alpha(self, depth: int, rank: int) -> float:
        """P(the rank-th child at ``depth`` is accepted | its parent accepted) (1-based depth, 0-based rank)."""
        key = (depth, rank)
        prior = self.parent.tree_alpha(depth, rank) if self.parent is not None else \
            (self.prior if rank == 0 else self.prior * 0.5 ** rank)
        t = self.tree_trials.get(key)
        if t is None:
            return prior
        return (self.tree_hits[key] + self.prior_weight * prior) / (t + self.prior_weight)
