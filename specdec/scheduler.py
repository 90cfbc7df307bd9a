"""Scheduler: how much to speculate, per step and per request, from measured costs and acceptance.

The decoding loop asks its policy for a plan before every step (:meth:`Policy.plan`: the
draft depth ``k`` each active row may use, handed to the drafter as the row's budget) and
reports what happened after the step's host sync (:meth:`Policy.observe`: drafted depth,
accepted tokens, emitted tokens and the phase seconds of the step). Three policies:

``"fixed"``      the drafter's own k every step (the behaviour before the scheduler).
``"heuristic"``  transformers' assisted-generation schedule, per request: start at the
                 drafter's k; +2 after a step whose draft was accepted in full, -1 (not
                 below 1) otherwise.
``"goodput"``    (the default) every step, the k that maximises the expected emitted tokens
                 per second of the batch, from a cost model learned online and per-request
                 acceptance statistics; requests whose speculation does not pay fall back to
                 plain decoding and are re-probed with exponential backoff.

Cost model (:class:`CostModel`, one per decoder, kept across generate calls). A step of
``b`` rows drafting depth ``k`` and verifying ``n`` nodes per row (padded: every row of a
batch verifies ``n`` nodes) costs::

    step(b, k, n) = draft(b, k) + verify(b, n) + commit(b, n) + rest(b, n)

where ``rest`` is the step's wall time not inside the three phases (host sync, appending
tokens). Each term is a table of exponentially weighted means keyed by (b, k) or (b, n),
fed with the loop's own step clock; an unobserved key is interpolated linearly in k / n
between observed keys of the same b, else taken from a least-squares fit
``t = w0 + w1 * b * x`` over all observed keys, scaled by the ratio observed at that b; a key
seen fewer than 16 times is shrunk towards that estimate (weight count / (count + 1)), so one
slow early observation cannot keep its depth out of reach. A drafting step that first caught
up (a draft model's lazy prompt prefill, the tokens of plain steps) records no draft cost for
its k depths, only for the k - 1 after the catch-up forward.
:func:`calibrate` (optional, cached per model / device / dtype / threads) seeds the verify
table with timed target forwards, so the first call need not explore.

Acceptance (:class:`AcceptanceStats`, one per request, seeded from a decoder-wide one):
``alpha[i]`` = P(draft position i + 1 accepted | position i accepted and i + 1 drafted),
exponentially weighted (decay per observation; positions a step did not reach lose weight
too) with a prior of ``prior_weight`` pseudo observations at the decoder-wide estimate (for the
decoder-wide statistics themselves: position i's prior is position i - 1's estimate, so deeper
positions never observed, or not lately, extrapolate the shallower ones instead of sitting at a
fixed prior that would keep deeper drafts from ever being tried). For trees the same statistic
is kept per depth
(positions = depths of the accepted path; it already accounts for the siblings of that
shape) and per (depth, sibling rank) for tree planners (:func:`plan_tree`).

Expected tokens per step of a chain of k drafts (bonus token included)::

    E[T](k) = 1 + sum_{i=1..k} prod_{j<=i} alpha_j      (= (1 - a^(k+1)) / (1 - a) when alpha_j = a)

Goodput decision. For the active rows with expected tokens E_r and the padded step cost
``c(K) = step(b, K, nodes(K))``, the batch speculates at::

    K* = argmax_K  [ sum_{r speculating} E_r(min(K, budget_r)) + #other rows ] / c(K)

``K* = 0`` is a plain step. A closed batch (a generate call with nothing left in its queue: it
ends with its slowest row) instead takes the K that minimises its predicted remaining time: each
row finishes after tokens left / E'_r(K) steps, E'_r = 1 + hit_r (E_r - 1) with hit_r how often
the drafter proposed anything when asked, and between finishes the batch pays c for the rows
still active (see :meth:`GoodputPolicy._closed_batch_k`); for one row this is K* itself.
A request "pays its way" when its own goodput ratio
``rho_r = max_K E_r(K) * c(0) / c(K)`` is >= 1 (its extra tokens cover the extra cost of the
step it shares). Two rules move a request to fallback (trace event, reason given):

* predicted: rho_r < 1 at plan time (acceptance fell, or the measured cost of a speculative
  step at this batch size grew past what the acceptance buys). The request's statistics decay
  by 0.9 per step (about ten steps of memory): at 0.8 a good drafter fell back on noise (the w8
  draft at batch 1, acceptance ~0.9: two early rejections in seven steps put rho_r at 0.997);
* collapse (the earliest observable sign): over the last ``window`` speculative steps of the
  request, observed goodput ratio ``sum(tokens emitted) * c(0) / sum(step seconds)`` below
  ``collapse_ratio``. It fires on measured time, so it also catches what the model does not
  predict (a drafter slower than measured so far). Before the request falls back, one plain step
  (state ``"check"``) re-measures c(0) and the window is judged again against it: a slow spell
  of a shared machine slows plain steps as much as speculative ones, while the cost model's c(0)
  dates from before the window (measured: the w8 draft at batch 1 fell back on such spells;
  event ``"no collapse"`` when the re-measured ratio clears ``collapse_ratio``). In a batch whose
  other rows draft, that step is not plain and the cost model's c(0) is used.

A request in fallback decodes plainly (k = 0). It is re-probed after ``backoff`` steps
(4, doubled after every failed probe and after every collapse that follows a resume before a full
window of speculation has paid, at most ``max_backoff``; a request that falls back on the
decoder-wide statistics alone starts at the backoff recent probes reached; a paid probe that could not pass
even if every drafted token were accepted, at the measured costs, is skipped and backs off the
same way, so a drafter that is too slow for the batch costs no catch-up): the probe step drafts at the
depth that would pay with acceptance ``probe_alpha`` (0.7) under the measured costs (at least 2, so
that the probe measures the draft cost past its catch-up); it succeeds when rho_r >= 1 + ``hysteresis``
with the request's fresh statistics: on entering fallback its history is dropped and its prior
becomes its last estimate of the first position, capped by the decoder-wide one, at
``prior_weight`` pseudo observations, so a probe's own acceptance dominates at once. A request
whose drafter is useless keeps a low prior even when other rows' drafts are accepted; a good
drafter that fell back on noise keeps a prior near its acceptance (a prior of 0 failed its
probe on any rejection and, with the backoff doubling, kept it plain for up to ``max_backoff``
steps). While
other rows speculate, a due probe rides along at the batch's depth (verification is padded
to the same node count, so it costs nothing extra); rows not due stay at k = 0, so the rows
of one batch get different k (the drafter pads them).

Exactness: a plan uses only host statistics of earlier steps (accepted counts, seconds),
never the target's random draws of the current step, so greedy output stays the target's
greedy output and sampled output keeps the target's distribution under every policy.
"""
from __future__ import annotations

import bisect
import json
import math
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

import torch

from specdec.tree import expected_tokens, expected_tokens_chain, expected_tokens_tree, plan_tree  # noqa: F401
__all__ = ["CostModel", "AcceptanceStats", "Policy", "FixedPolicy", "HeuristicPolicy", "GoodputPolicy",
           "StepPlan", "StepTimes", "POLICIES", "make_policy", "expected_tokens", "expected_tokens_chain",
           "expected_tokens_tree", "plan_tree", "calibrate", "calibration_key"]

POLICIES = ("fixed", "heuristic", "goodput")

SPEC, FALLBACK, PROBE, CHECK = "spec", "fallback", "probe", "check"
_INFORMED = 16  # drafting request-steps after which the decoder-wide statistics judge a catch-up
_YOUNG = 4  # drafting steps before a request's own statistics can make it fall back on prediction


# ============================================================================ acceptance statistics
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


# ============================================================================ cost model
class _CostTable:
    """Exponentially weighted seconds keyed by (rows b, size x), with interpolation and a fit for unseen keys."""

    def __init__(self, smoothing: float, zero_at_zero: bool, single: str) -> None:
        self.smoothing = smoothing
        self.zero_at_zero = zero_at_zero  # x == 0 costs nothing until observed (drafting 0 tokens)
        self.single = single              # one distinct b * x observed: "constant" or "proportional"
        self.cells: Dict[Tuple[int, int], List[float]] = {}  # (b, x) -> [mean seconds, count]
        self._fit: Optional[Tuple[float, float]] = None
        self._dirty = True
        # per b: the observed (x, mean) cells sorted by x, built once between changes (a step's plan asks
        # for every depth at the same b: re-sorting the cells for each was most of the plan's time)
        self._same: Dict[int, Tuple[List[Tuple[int, float]], List[int], Dict]] = {}

    def observe(self, b: int, x: int, seconds: float) -> None:
        if not math.isfinite(seconds) or seconds < 0:
            return
        cell = self.cells.get((b, x))
        if cell is None:
            self.cells[(b, x)] = [seconds, 1.0]
        else:
            # a busy machine produces rare spikes: cap one observation's pull at 4x the current mean
            s = min(seconds, 4.0 * cell[0]) if cell[0] > 0 else seconds
            cell[0] += self.smoothing * (s - cell[0])
            cell[1] += 1.0
        self._dirty = True
        self._same.clear()

    def _fitted(self) -> Optional[Tuple[float, float]]:
        """Weighted least squares t = w0 + w1 * (b * x) over the cells; None when under-determined."""
        if not self._dirty:
            return self._fit
        self._dirty = False
        pts = [(b * x, m, min(c, 8.0)) for (b, x), (m, c) in self.cells.items() if not (x == 0 and self.zero_at_zero)]
        xs = set(p[0] for p in pts)
        if len(xs) < 2:
            self._fit = None
            return None
        sw = sum(w for _, _, w in pts)
        mx = sum(w * u for u, _, w in pts) / sw
        my = sum(w * t for _, t, w in pts) / sw
        sxx = sum(w * (u - mx) ** 2 for u, _, w in pts)
        sxy = sum(w * (u - mx) * (t - my) for u, t, w in pts)
        w1 = max(0.0, sxy / sxx) if sxx > 0 else 0.0
        w0 = my - w1 * mx
        if w0 < 0:  # through the origin
            w0 = 0.0
            suu = sum(w * u * u for u, _, w in pts)
            w1 = max(0.0, sum(w * u * t for u, t, w in pts) / suu) if suu > 0 else 0.0
        self._fit = (w0, w1)
        return self._fit

    def predict(self, b: int, x: int) -> float:
        """A cell's mean, shrunk towards what its neighbours and the fit say while it holds few
        observations (weight count / (count + 1)): a cell seen once or twice, early or in a spike,
        and not revisited because it looked slow, must not keep its depth out of reach for good."""
        cell = self.cells.get((b, x))
        if cell is not None:
            m, c = cell
            if x == 0 and self.zero_at_zero:
                return m
            if c >= 16 or self._fitted() is None:
                return m
            est = self._estimate(b, x)
            return (c * m + est) / (c + 1.0)
        return self._estimate(b, x)

    def _estimate(self, b: int, x: int) -> float:
        """Interpolation between the neighbours at the same b, else the fit at the level of b."""
        if x == 0 and self.zero_at_zero:
            return 0.0
        if not self.cells:
            return 0.0
        cached = self._same.get(b)
        if cached is None:
            same = sorted((xx, m) for (bb, xx), (m, _) in self.cells.items()
                          if bb == b and not (xx == 0 and self.zero_at_zero))
            cached = self._same[b] = (same, [xx for xx, _ in same], {})
        same, xs, level = cached
        i, j = bisect.bisect_left(xs, x), bisect.bisect_right(xs, x)
        lo = same[i - 1] if i > 0 else None    # the observed neighbour below x
        hi = same[j] if j < len(same) else None  # and above
        if lo and hi:  # interpolate between the neighbours at the same b
            (x0, t0), (x1, t1) = lo, hi
            return t0 + (t1 - t0) * (x - x0) / (x1 - x0)
        fit = self._fitted()
        if fit is None:
            (bb, xx), (m, _) = min(((k, v) for k, v in self.cells.items() if not (k[1] == 0 and self.zero_at_zero)),
                                   key=lambda kv: (abs(kv[0][0] - b), abs(kv[0][1] - x)),
                                   default=((None, None), (0.0, 0.0)))
            if bb is None:
                return 0.0
            if self.single == "proportional" and bb * xx > 0:
                return m * (b * x) / (bb * xx)
            return m
        w0, w1 = fit
        est = w0 + w1 * b * x
        if same:  # the level observed at this b (per fit: the fit changes only with the cells)
            if fit not in level:
                ratios = [m / (w0 + w1 * b * xx) for xx, m in same if w0 + w1 * b * xx > 0]
                level[fit] = sum(ratios) / len(ratios) if ratios else None
            if level[fit] is not None:
                est *= level[fit]
            if lo:  # cost does not fall with size
                est = max(est, lo[1])
            if hi:
                est = min(est, hi[1])
        return max(est, 0.0)

    def scale(self, factor: float) -> None:
        """Multiply every cell's mean by ``factor`` (counts unchanged)."""
        for cell in self.cells.values():
            cell[0] *= factor
        self._dirty = True
        self._same.clear()

    def observed(self, b: Optional[int] = None, x: Optional[int] = None) -> bool:
        return any((b is None or bb == b) and (x is None or xx == x) for bb, xx in self.cells)

    def state(self) -> Dict[str, List[float]]:
        return {f"{b},{x}": [m, c] for (b, x), (m, c) in self.cells.items()}

    def load(self, state: Dict[str, List[float]]) -> None:
        for key, (m, c) in state.items():
            b, x = (int(v) for v in key.split(","))
            self.cells[(b, x)] = [float(m), float(c)]
        self._dirty = True
        self._same.clear()


class CostModel:
    """Seconds of a step's phases by batch rows, draft depth and verified nodes, learned online."""

    def __init__(self, smoothing: float = 0.25) -> None:
        if not 0.0 < smoothing <= 1.0:
            raise ValueError(f"CostModel: smoothing must lie in (0, 1], got {smoothing}")
        self.smoothing = smoothing
        # one observed draft depth: assume a cost proportional to the depth (a draft model runs one
        # forward per depth; a free drafter measures ~0 at any depth). Catch-ups (a draft model's
        # prefill, the tokens of plain steps) are kept out of these observations (StepTimes.catch_up).
        self.draft = _CostTable(smoothing, zero_at_zero=True, single="proportional")   # (b, k)
        self.verify = _CostTable(smoothing, zero_at_zero=False, single="constant")     # (b, n)
        self.commit = _CostTable(smoothing, zero_at_zero=False, single="constant")     # (b, n)
        self.rest = _CostTable(smoothing, zero_at_zero=False, single="constant")       # (b, n)
        #: seconds of a drafter's catch-up (its lazy prompt prefill, the tokens of plain steps) by the
        #: positions it feeds, bucketed to powers of two (a few positions cost about one forward, a
        #: prompt prefill much less per position): keyed (1, bucket), interpolated between buckets
        self.catch_up = _CostTable(smoothing, zero_at_zero=True, single="proportional")
        #: the machine's current speed factor: every prediction is the tables' value times ``speed``,
        #: and every observation enters the tables divided by it. A shared machine has slow spells
        #: that slow every kind of step alike; without this factor a cell measured in one (a deep
        #: draft, say) keeps its depth out of reach after the spell, because the policy no longer
        #: picks it and never measures it again, and a plain-step estimate from before a spell makes
        #: the speculative steps during it look like a collapse. It follows the ratio of each step's
        #: wall time to its prediction (``speed_rate`` of the log ratio per step, one step's ratio
        #: clipped to [0.5, 2]); the tables keep the shape of the costs. Only the product of the two
        #: is identified (the tables keep learning), so the factor wanders; it is folded into the
        #: tables whenever it leaves [0.25, 4] and before a state_dict, which leaves every prediction
        #: unchanged (the updates are invariant under that rescaling).
        self.speed = 1.0
        self.speed_rate = 0.3
        self.steps = 0

    def _table_step(self, b: int, k: int, n: int) -> float:
        return (self.draft.predict(b, k) + self.verify.predict(b, n) + self.commit.predict(b, n)
                + self.rest.predict(b, n))

    def observe(self, b: int, k: int, n: int, draft: float, verify: float, commit: float,
                total: Optional[float] = None) -> None:
        """One step of b rows, draft depth k, n verified nodes per row, with its phase seconds
        (``total``: the step's wall time; what the phases do not cover goes to ``rest``; a step with
        a total also updates :attr:`speed`). A NaN phase is not observed."""
        if total is not None and math.isfinite(total) and total > 0 and self.verify.observed(b, n):
            pred = self.speed * self._table_step(b, k, n)
            if pred > 0:
                r = min(2.0, max(0.5, total / pred))
                self.speed *= r ** self.speed_rate
                if not 0.25 <= self.speed <= 4.0:
                    self._fold_speed()
        s = self.speed
        self.draft.observe(b, k, draft / s)
        self.verify.observe(b, n, verify / s)
        self.commit.observe(b, n, commit / s)
        if total is not None:
            self.rest.observe(b, n, max(0.0, total - draft - verify - commit) / s)
        self.steps += 1

    def observe_draft(self, b: int, k: int, seconds: float) -> None:
        """Only a draft time: k depths for b rows (the depths after a catch-up forward)."""
        self.draft.observe(b, k, seconds / self.speed)

    @staticmethod
    def _bucket(positions: int) -> int:
        return 1 << max(0, int(round(math.log2(max(1, positions)))))

    def observe_catch_up(self, positions: int, seconds: float) -> None:
        """A catch-up that fed ``positions`` positions in ``seconds`` (recorded at its power-of-two
        bucket, scaled by bucket / positions)."""
        if positions <= 0 or not math.isfinite(seconds) or seconds < 0:
            return
        x = self._bucket(positions)
        self.catch_up.observe(1, x, seconds * x / positions / self.speed)

    def catch_up_seconds(self, positions: int) -> float:
        """Predicted seconds of a catch-up over ``positions`` positions (0 until one is observed)."""
        if positions <= 0 or not self.catch_up.cells:
            return 0.0
        x = self._bucket(positions)
        return self.speed * self.catch_up.predict(1, x) * positions / x

    def step_seconds(self, b: int, k: int, n: int) -> float:
        """Predicted wall seconds of one step (at the current :attr:`speed`)."""
        return self.speed * self._table_step(b, k, n)

    def plain_seconds(self, b: int) -> float:
        """Predicted wall seconds of a plain step (k = 0, one node per row)."""
        return self.step_seconds(b, 0, 1)

    def knows_plain(self) -> bool:
        return self.verify.observed(x=1)

    def _fold_speed(self) -> None:
        """Fold the speed factor into the tables (predictions unchanged) and reset it to 1."""
        for name in ("draft", "verify", "commit", "rest", "catch_up"):
            getattr(self, name).scale(self.speed)
        self.speed = 1.0

    def state_dict(self) -> Dict[str, object]:
        self._fold_speed()  # the tables then hold wall seconds at the current speed
        return {name: getattr(self, name).state() for name in ("draft", "verify", "commit", "rest", "catch_up")}

    def load_state_dict(self, state: Dict[str, object]) -> None:
        for name in ("draft", "verify", "commit", "rest", "catch_up"):
            if name in state:
                getattr(self, name).load(state[name])


# ============================================================================ calibration
def calibration_key(target) -> str:
    """(model, device, dtype, torch threads) of a target, as the calibration cache's key."""
    model = getattr(target, "model", None)
    cfg = getattr(model, "config", None)
    if cfg is not None:
        name = getattr(cfg, "_name_or_path", "") or type(model).__name__
        shape = (getattr(cfg, "hidden_size", None), getattr(cfg, "num_hidden_layers", None),
                 getattr(cfg, "vocab_size", None))
    else:
        name = type(target).__name__
        shape = (getattr(target, "hidden", None), getattr(target, "num_layers", None),
                 getattr(target, "vocab_size", None))
    dtype = getattr(target, "dtype", None)
    return f"{name}|{shape}|{torch.device(target.device)}|{dtype}|threads={torch.get_num_threads()}"


def _calibration_path() -> Path:
    root = os.environ.get("SPECDEC_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "specdec")
    return Path(root) / "calibration.json"


@torch.no_grad()
def calibrate(target, cache, cost: CostModel, batches: Sequence[int], nodes: Sequence[int], repeats: int = 2,
              use_cache: bool = True) -> Dict[str, object]:
    """Time target forwards of b rows x n nodes on ``cache`` (reset afterwards) into ``cost.verify``.

    With ``use_cache`` the timings are read from / written to ``$SPECDEC_CACHE/calibration.json``
    (default ``~/.cache/specdec``), keyed by :func:`calibration_key`. Returns the cells measured.
    """
    key = calibration_key(target)
    path = _calibration_path()
    store: Dict[str, object] = {}
    if use_cache and path.is_file():
        try:
            store = json.loads(path.read_text())
        except (OSError, ValueError):
            store = {}
        if key in store:
            cost.verify.load(store[key])
            return store[key]
    dev = torch.device(target.device)
    cells: Dict[str, List[float]] = {}
    for b in batches:
        view = cache.rows(0, b)
        for n in nodes:
            tokens = torch.zeros(b, n, dtype=torch.int64, device=dev)
            depths = torch.arange(n, dtype=torch.int32, device=dev).expand(b, n).contiguous()
            times = []
            for _ in range(repeats + 1):  # the first run warms up
                view.lens.fill_(16)
                if dev.type == "cuda":
                    torch.cuda.synchronize(dev)
                t = time.perf_counter()
                target.forward(view, tokens, depths, None)
                if dev.type == "cuda":
                    torch.cuda.synchronize(dev)
                times.append(time.perf_counter() - t)
            s = sorted(times[1:])[len(times[1:]) // 2]
            cells[f"{b},{n}"] = [s, 1.0]
    cache.reset()
    cost.verify.load(cells)
    if use_cache:
        store[key] = cells
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_suffix(".tmp")
            tmp.write_text(json.dumps(store, indent=1))
            tmp.replace(path)
        except OSError:
            pass
    return cells


# ============================================================================ policies
_HIT_DECAY = 0.5  # weight of the past in a request's proposal hit rate (closed batches)


@dataclass
class StepPlan:
    """What a policy decided for one step (per active row, in row order)."""

    budgets: List[int]            # draft depth each row may use (handed to the drafter)
    states: List[str]             # "spec" / "probe" / "fallback" / "check" per row
    expected: List[float]         # predicted E[T] per row at its budget (1.0 for k = 0)
    k: int = 0                    # the step's depth (max of budgets)
    predicted_ratio: float = 1.0  # predicted goodput of the step / a plain step's


@dataclass
class StepTimes:
    draft: float
    verify: float
    commit: float
    total: float
    catch_up: float = 0.0  # of draft (and total): the drafter catching up, kept out of the per-step costs
    catch_up_positions: int = 0  # positions that catch-up fed (its per-position price is learned)


@dataclass
class _Request:
    stats: AcceptanceStats
    state: str = SPEC             # SPEC, FALLBACK, or CHECK (its window's goodput looked collapsed: one plain step)
    k: int = 0                    # heuristic policy: current depth
    backoff: int = 4
    next_probe: int = 0
    window: List[Tuple[int, float, float]] = field(default_factory=list)  # (emitted, seconds, plain seconds)
    hit: float = 1.0              # how often the drafter proposed something when asked (exponential average)
    proven: bool = True           # speculation paid over a full window since the last resume from fallback


class Policy:
    """Base policy: per-request acceptance statistics, the cost model, the trace and the summary.

    Subclasses implement :meth:`_budgets`. One policy object belongs to one decoder; ``begin`` starts
    a generate call.
    """

    name = "base"
    uses_catch_up = False  # whether plan() reads ``behind`` (the engine asks the drafter only then)

    def __init__(self, max_depth: int, width: int = 1, max_nodes: Optional[int] = None,
                 cost: Optional[CostModel] = None, decay: float = 0.8, prior: float = 0.5) -> None:
        if max_depth < (0 if type(self) is FixedPolicy else 1):  # FixedPolicy(0): plain decoding
            raise ValueError(f"{type(self).__name__}: max_depth must be >= 1, got {max_depth}")
        self.max_depth = int(max_depth)
        self.width = max(1, int(width))
        self.max_nodes = int(max_nodes) if max_nodes else 1 + self.max_depth * self.width
        self.cost = cost if cost is not None else CostModel()
        self.decay = decay
        self.global_stats = AcceptanceStats(decay=0.9, prior=prior, prior_weight=1.0)
        self.requests: Dict[int, _Request] = {}
        self.step_index = 0
        self.trace: Optional[List[dict]] = None
        self._closed = False
        self._behind: Optional[List[int]] = None
        self._reset_counters()

    def __repr__(self) -> str:
        return f"{type(self).__name__}(max_depth={self.max_depth})"

    def _reset_counters(self) -> None:
        self.events: List[dict] = []
        self.n_steps = 0
        self.request_steps = 0
        self.fallback_request_steps = 0
        self.drafted_request_steps = 0
        self.pred_sum = 0.0
        self.obs_sum = 0.0
        self.k_sum = 0
        self.k_hist: Dict[int, int] = {}
        self.pred_ratio_sum = 0.0

    def nodes(self, k: int) -> int:
        """Nodes per row verified when drafting depth k."""
        return min(self.max_nodes, 1 + k * self.width) if k > 0 else 1

    def begin(self, num_requests: int, trace: bool = False) -> None:
        self.requests = {}
        self.step_index = 0
        self.trace = [] if trace else None
        self._reset_counters()

    def _request(self, rid: int) -> _Request:
        req = self.requests.get(rid)
        if req is None:
            req = self.requests[rid] = _Request(AcceptanceStats(decay=self.decay, parent=self.global_stats),
                                                k=self.max_depth)
        return req

    # ---- the two hooks the loop calls
    def plan(self, request_ids: Sequence[int], budgets: Sequence[int], closed: bool = False,
             behind: Optional[Sequence[int]] = None) -> StepPlan:
        """Per-row draft depth for the next step; ``budgets`` = tokens still worth drafting per row.

        ``closed``: the rows are a closed batch (nothing waits and nothing will join: a generate call
        past its queue), whose wall time is that of its slowest row; ``behind``: per row, the
        positions the drafter would feed before drafting (``Drafter.pending_catch_up``). See
        :class:`GoodputPolicy`.
        """
        reqs = [self._request(rid) for rid in request_ids]
        self._closed = bool(closed)
        self._behind = [int(x) for x in behind] if behind is not None else None
        plan = self._budgets(request_ids, reqs, [max(0, int(x)) for x in budgets])
        plan.k = max(plan.budgets, default=0)
        return plan

    def _budgets(self, request_ids, reqs: List[_Request], budgets: List[int]) -> StepPlan:
        raise NotImplementedError

    def observe(self, plan: StepPlan, request_ids: Sequence[int], nodes: int, depths: Sequence[int],
                drafted: Sequence[int], accepted: Sequence[int], emitted: Sequence[int], times: StepTimes) -> None:
        """The step's outcome: per row its draft depth, drafted nodes, accepted and emitted tokens."""
        b = len(request_ids)
        k_run = max(depths, default=0)
        # A step whose drafter caught up (its lazy prompt prefill, the tokens of plain steps) measures
        # no per-depth draft cost: the catch-up forward also produced the first depth, so neither the
        # whole draft time nor the time less the catch-up is the price of k tokens. Its verify and
        # commit times still count.
        if times.catch_up > 0:
            observe_catch_up = getattr(self.cost, "observe_catch_up", None)
            if observe_catch_up is not None:
                observe_catch_up(times.catch_up_positions, times.catch_up)
            self.cost.observe(b, k_run, nodes, float("nan"), times.verify, times.commit, None)
            # ... but the time after the catch-up is the price of the other k - 1 depths: without it a
            # decoder whose every drafting step catches up (probes after fallback steps) would never
            # learn what drafting costs, and would keep paying for probes that cannot pass
            observe_draft = getattr(self.cost, "observe_draft", None)  # duck-typed cost models may lack it
            if k_run >= 2 and observe_draft is not None:
                observe_draft(b, k_run - 1, max(0.0, times.draft - times.catch_up))
        else:
            self.cost.observe(b, k_run, nodes, times.draft, times.verify, times.commit, times.total)
        plain = self.cost.plain_seconds(b)
        self.n_steps += 1
        self.k_sum += plan.k
        self.k_hist[plan.k] = self.k_hist.get(plan.k, 0) + 1
        self.pred_ratio_sum += plan.predicted_ratio
        for r, rid in enumerate(request_ids):
            req = self.requests[rid]
            d, a = int(depths[r]), int(accepted[r])
            self.request_steps += 1
            if plan.budgets[r] > 0:  # asked to draft: did the drafter propose anything (lookup may not)?
                req.hit = _HIT_DECAY * req.hit + (1.0 - _HIT_DECAY) * (1.0 if d > 0 else 0.0)
            if plan.states[r] == FALLBACK and d == 0:
                self.fallback_request_steps += 1
            if d > 0:
                self.drafted_request_steps += 1
                self.pred_sum += req.stats.expected(d)  # E[T] at the depth really drafted, before this step
                self.obs_sum += a + 1
                req.stats.observe(d, a)
                req.window.append((int(emitted[r]), times.total - times.catch_up, plain))
                del req.window[:-self.window_size()]
            if self.trace is not None:
                self.trace.append(dict(
                    type="step", step=self.step_index, request=rid, row=r, batch=b, state=plan.states[r],
                    k=plan.budgets[r], nodes=nodes, depth=d, drafted=int(drafted[r]), accepted=a,
                    emitted=int(emitted[r]), expected_tokens=plan.expected[r],
                    predicted_goodput_ratio=plan.predicted_ratio, draft_seconds=times.draft,
                    verify_seconds=times.verify, commit_seconds=times.commit, catch_up_seconds=times.catch_up,
                    step_seconds=times.total,
                    plain_seconds_estimate=plain))
        self._after(plan, request_ids, depths, accepted, emitted, times)
        self.step_index += 1

    def window_size(self) -> int:
        return 4

    def _after(self, plan, request_ids, depths, accepted, emitted, times) -> None:
        """Policy-specific reaction to a step (state changes)."""

    def _event(self, rid: int, reason: str, old: str, new: str, **extra) -> None:
        ev = dict(type="event", step=self.step_index, request=rid, reason=reason, old_state=old, new_state=new,
                  **extra)
        self.events.append(ev)
        if self.trace is not None:
            self.trace.append(ev)

    def summary(self) -> Dict[str, object]:
        """Policy keys of the generate call's metrics (see specdec/metrics.py)."""
        n = self.drafted_request_steps
        return {
            "policy": self.name,
            "policy_events": len(self.events),
            "fallback_request_steps": self.fallback_request_steps,
            "mean_chosen_k": self.k_sum / self.n_steps if self.n_steps else 0.0,
            "chosen_k_histogram": {str(k): v for k, v in sorted(self.k_hist.items())},
            "expected_tokens_predicted": self.pred_sum / n if n else 0.0,
            "expected_tokens_observed": self.obs_sum / n if n else 0.0,
            "predicted_goodput_ratio": self.pred_ratio_sum / self.n_steps if self.n_steps else 0.0,
        }


class FixedPolicy(Policy):
    """The drafter's own depth every step."""

    name = "fixed"

    def _budgets(self, request_ids, reqs, budgets):
        out = [min(self.max_depth, x) for x in budgets]
        return StepPlan(out, [SPEC] * len(out), [r.stats.expected(k) for r, k in zip(reqs, out)])


class HeuristicPolicy(Policy):
    """transformers' "heuristic" schedule per request: +2 after a fully accepted draft, else -1 (>= 1)."""

    name = "heuristic"

    def _budgets(self, request_ids, reqs, budgets):
        out = [min(r.k, x) for r, x in zip(reqs, budgets)]
        return StepPlan(out, [SPEC] * len(out), [r.stats.expected(k) for r, k in zip(reqs, out)])

    def _after(self, plan, request_ids, depths, accepted, emitted, times) -> None:
        for rid, d, a in zip(request_ids, depths, accepted):
            if d <= 0:
                continue
            req = self.requests[rid]
            req.k = min(self.max_depth, req.k + 2) if a >= d else max(1, req.k - 1)


class GoodputPolicy(Policy):
    """Maximise expected emitted tokens per second; fall back to plain decoding when speculation does not pay.

    Parameters (besides :class:`Policy`'s; ``decay`` defaults to 0.9 here, about ten steps of
    memory per request: at 0.8 two rejections decided a fallback): ``collapse_ratio`` (observed
    goodput ratio below which a request collapses to fallback, over ``window`` speculative steps:
    8, so that one unlucky deep rejection in a run of accepted steps, which costs a step of twice
    the price for one token, does not read as a collapse), ``hysteresis`` (a probe must predict
    rho >= 1 + hysteresis to resume), ``max_backoff`` (most steps between probes), ``probe_alpha``
    (the acceptance a paid probe's depth is chosen for).
    """

    name = "goodput"
    uses_catch_up = True

    def __init__(self, max_depth: int, width: int = 1, max_nodes: Optional[int] = None,
                 cost: Optional[CostModel] = None, decay: float = 0.9, prior: float = 0.5,
                 collapse_ratio: float = 0.9, window: int = 8, hysteresis: float = 0.05,
                 max_backoff: int = 64, probe_alpha: float = 0.7) -> None:
        super().__init__(max_depth, width, max_nodes, cost, decay, prior)
        self.probe_alpha = probe_alpha
        if not 0.0 < collapse_ratio <= 1.0:
            raise ValueError(f"GoodputPolicy: collapse_ratio must lie in (0, 1], got {collapse_ratio}")
        if window < 1:
            raise ValueError(f"GoodputPolicy: window must be >= 1, got {window}")
        self.collapse_ratio = collapse_ratio
        self.window = window
        self.hysteresis = hysteresis
        self.max_backoff = max_backoff
        # the backoff that recent failed (or skipped) probes reached: a new request that falls back on
        # the decoder-wide evidence alone starts there instead of re-learning it at 4, 8, 16 ...
        self.backoff_hint = 4

    def window_size(self) -> int:
        return self.window

    # ---- the decision
    def _costs(self, b: int, k_max: int) -> List[float]:
        return [self.cost.step_seconds(b, k, self.nodes(k)) for k in range(k_max + 1)]

    @staticmethod
    def _rho(curve: List[float], costs: List[float]) -> Tuple[float, int]:
        """Best own goodput ratio E(K) * c(0) / c(K) over K >= 1, and its K."""
        best, best_k = 0.0, 1
        for k in range(1, len(costs)):
            r = curve[min(k, len(curve) - 1)] * costs[0] / costs[k] if costs[k] > 0 else curve[min(k, len(curve) - 1)]
            if r > best:
                best, best_k = r, k
        return best, best_k

    def _perfect_ratio(self, costs: List[float]) -> float:
        """The best goodput ratio a drafter whose every token is accepted would reach at these costs."""
        return self._rho([float(k + 1) for k in range(len(costs))], costs)[0]

    def _back_off(self, req: _Request) -> None:
        """Double the request's backoff (at most max_backoff) and schedule its next probe."""
        req.backoff = min(self.max_backoff, 2 * req.backoff)
        req.next_probe = self.step_index + req.backoff
        self.backoff_hint = max(self.backoff_hint, req.backoff)

    def _skip_probes(self, request_ids, reqs, probing, why: str, ratio: float) -> None:
        """Due probes that could not pass: each backs off as a failed one would, with an event."""
        for rid, req, p in zip(request_ids, reqs, probing):
            if p:
                self._back_off(req)
                self._event(rid, f"probe skipped: {why}", FALLBACK, FALLBACK, goodput_ratio=ratio,
                            next_probe_step=req.next_probe)

    @staticmethod
    def _window_ratio(req: _Request, plain: float) -> float:
        """Observed goodput ratio of the request's window: tokens emitted * plain step seconds / seconds."""
        secs = sum(w[1] for w in req.window)
        return sum(w[0] for w in req.window) * plain / secs if secs > 0 else float("inf")

    def _to_fallback(self, rid: int, req: _Request, reason: str, **extra) -> None:
        old = req.state
        req.state = FALLBACK
        if req.stats.observations == 0:  # decided on the decoder-wide statistics: inherit their backoff
            req.backoff = max(req.backoff, self.backoff_hint)
        # a fresh history; its prior (weak: a probe's own acceptance dominates) is the request's last
        # estimate of the first position, capped by the decoder-wide one (see the module notes)
        prior = min(req.stats.alpha(0), self.global_stats.alpha(0))
        req.stats = AcceptanceStats(decay=self.decay, prior=prior, prior_weight=req.stats.prior_weight)
        req.window = []
        req.next_probe = self.step_index + req.backoff
        self._event(rid, reason, old, FALLBACK, next_probe_step=req.next_probe, **extra)

    def _budgets(self, request_ids, reqs, budgets):
        b = len(reqs)
        k_cap = min(self.max_depth, max(budgets, default=0))
        if k_cap <= 0:
            return StepPlan([0] * b, [r.state for r in reqs], [1.0] * b)
        if not self.cost.knows_plain():  # one plain step measures what speculation is compared with
            return StepPlan([0] * b, [r.state for r in reqs], [1.0] * b)
        costs = self._costs(b, k_cap)
        curves = [req.stats.expected_curve(k_cap) for req in reqs]
        # predicted rule: a speculating request whose own best ratio is below 1 falls back. A young
        # request (fewer than _YOUNG drafting steps) of a drafter that pays decoder-wide is judged
        # by the decoder-wide statistics instead: one early rejection (a 1-in-10 event at the w8
        # draft's acceptance) made its own estimate fall below 1, and the fallback, the probe and
        # the draft's catch-up after it cost more than the rows' whole speedup.
        population = None
        trusted = [False] * b
        for r, (rid, req, curve) in enumerate(zip(request_ids, reqs, curves)):
            if req.state == SPEC:
                rho, k = self._rho(curve, costs)
                if rho < 1.0:
                    if req.stats.observations < _YOUNG and req.stats.parent is self.global_stats:
                        if population is None:
                            population = self._rho(self.global_stats.expected_curve(k_cap), costs)[0]
                        if population >= 1.0 + self.hysteresis:
                            trusted[r] = True
                            continue
                    self._to_fallback(rid, req, f"predicted goodput ratio {rho:.2f} < 1 at best k={k}",
                                      goodput_ratio=rho)
        curves = [(self.global_stats if t else req.stats).expected_curve(k_cap)  # fallback rows were reset
                  for req, t in zip(reqs, trusted)]
        probing = [req.state == FALLBACK and self.step_index >= req.next_probe for req in reqs]
        spec = [req.state == SPEC for req in reqs]

        def total(k: int) -> float:
            return sum(c[min(k, x)] if s else 1.0 for c, s, x in zip(curves, spec, budgets))

        best_k, best_g = 0, b / costs[0] if costs[0] > 0 else float(b)
        for k in range(1, k_cap + 1):
            g = total(k) / costs[k] if costs[k] > 0 else total(k)
            if g > best_g * (1.0 + 1e-9):
                best_k, best_g = k, g
        plain_g = b / costs[0] if costs[0] > 0 else float(b)
        if best_k == 0 and any(probing):
            # A paid probe (nobody else drafts: the probe pays the draft's catch-up over every row that
            # fell behind, and the drafting). Skipped when even a perfect drafter (every token accepted)
            # could not reach the resume threshold at these costs: no acceptance makes such a probe pass.
            perfect = self._perfect_ratio(costs)
            if perfect < 1.0 + self.hysteresis:
                self._skip_probes(request_ids, reqs, probing, f"a perfect drafter would reach goodput ratio "
                                  f"{perfect:.2f} < {1.0 + self.hysteresis:.2f} at these costs", perfect)
                probing = [False] * b
            else:
                # the depth that would pay if the drafter were decent (alpha = probe_alpha), at least 2:
                # a probe after fallback steps catches up, and only its depths after the first measure
                # the draft cost (see observe)
                _, best_k = self._rho([expected_tokens(self.probe_alpha, k) for k in range(k_cap + 1)], costs)
                best_k = max(best_k, min(2, k_cap))
                best_g = total(best_k) / costs[best_k] if costs[best_k] > 0 else total(best_k)
        if self._closed and b > 1 and best_k > 0 and not any(probing):
            best_k = self._closed_batch_k(reqs, curves, spec, budgets, costs, best_k)
        if best_k > 0 and self._behind is not None and any(self._behind):
            # the drafter must first catch up (a draft model's lazy prompt prefill, the tokens of plain
            # steps): a one-time price that speculating must win back over the tokens these rows
            # still have to produce (measured: the w8 draft at batch 8, whose first drafting step
            # prefills 8 prompts). Judged as if the drafter were perfect (every token accepted), so
            # only a catch-up that cannot pay whatever the acceptance keeps the step plain: judged at
            # the predicted acceptance, a row that declines falls further behind, its price grows,
            # its remaining tokens shrink and it never drafts again, and a decoder whose first
            # requests decline never learns its acceptance. One exception: once the decoder-wide
            # statistics have seen _INFORMED drafting request-steps, a step predicted to gain less
            # than the probes' margin (goodput ratio < 1 + hysteresis) is not worth any catch-up
            # (measured: the int8 draft at batch 4 prefilled 4 prompts, 0.17 s of a 1.3 s generation,
            # for a step predicted at ~1.0x); its speculating rows fall back, so that probes (judged
            # as above, after the backoff) can still find out that the drafter pays.
            price = getattr(self.cost, "catch_up_seconds", lambda n: 0.0)(sum(self._behind))
            if price > 0:
                perfect = self._perfect_ratio(costs)
                g_pred = total(best_k) / costs[best_k] if costs[best_k] > 0 else plain_g
                g = plain_g * perfect
                left = float(sum(x + 1 for x in budgets))
                why = f"the drafter's catch-up ({price * 1e3:.1f} ms)"
                if (self.global_stats.observations >= _INFORMED and not any(probing)
                        and g_pred < plain_g * (1.0 + self.hysteresis)):
                    for rid, req, s_ in zip(request_ids, reqs, spec):
                        if s_:
                            self._to_fallback(rid, req, f"{why} is not worth a predicted goodput ratio "
                                              f"{g_pred / plain_g:.2f} < {1.0 + self.hysteresis:.2f}",
                                              goodput_ratio=g_pred / plain_g)
                    spec = [False] * b
                    best_k = 0
                elif g <= plain_g or left / g + price >= left / plain_g:
                    self._skip_probes(request_ids, reqs, probing, f"{why} would not be won back", perfect)
                    probing = [False] * b
                    best_k = 0
        states, out, expected = [], [], []
        for req, curve, s, p, x in zip(reqs, curves, spec, probing, budgets):
            k = min(best_k, x)
            if s:
                states.append(SPEC)
            elif req.state == CHECK:  # a collapse to confirm: one plain step
                states.append(CHECK)
                k = 0
            elif p and best_k > 0:  # a due probe: free when others speculate, paid otherwise
                states.append(PROBE)
            else:
                states.append(FALLBACK)
                k = 0
            out.append(k)
            expected.append(curve[k])
        return StepPlan(out, states, expected, predicted_ratio=best_g / plain_g if plain_g > 0 else 1.0)

    def _closed_batch_k(self, reqs, curves, spec, budgets, costs, best_k: int) -> int:
        """The step depth of a closed batch: minimise its predicted remaining wall time.

        A closed batch (a generate call with nothing left in its queue) ends with its slowest row,
        so a depth that emits more tokens per second for the batch as a whole can still lose: rows
        that speculate well finish early while the batch keeps stepping for a row that does not, at
        the higher cost of every speculative step (measured: prompt lookup at batch 4 on grounded
        prompts, where one prompt has nothing to copy, 0.87x plain under per-step goodput).

        Predicted remaining time at depth k: each row finishes after tokens left / E_r(k) steps,
        where E_r(k) = 1 + hit_r * (E[T]_r(k) - 1) discounts the row's expected tokens by how often
        its drafter proposes anything at all when asked (prompt lookup without a match proposes
        nothing, and such steps teach the acceptance statistics nothing); between two finishes the
        batch steps with the rows still active, at the cost model's price for that many rows (and
        plain steps once no speculating row is left). Finishing rows early pays only through the
        cheaper steps of the smaller batch that remains. With one row this is the per-step goodput
        choice; depth stays one per step (the verify pass pads to the deepest row anyway).
        """
        left = [x + 1 for x in budgets]
        memo: Dict[Tuple[int, int], float] = {}

        def step_cost(rows: int, k: int) -> float:
            key = (rows, k)
            if key not in memo:
                memo[key] = self.cost.step_seconds(rows, k, self.nodes(k))
            return memo[key]

        best_t, best = None, 0
        for k in range(0, len(costs)):
            finish = []
            for req, c, s_, n in zip(reqs, curves, spec, left):
                e, drafts = 1.0, False
                if s_ and k > 0:
                    e = 1.0 + req.hit * (c[min(k, n - 1, len(c) - 1)] - 1.0)
                    drafts = True
                finish.append((n / max(e, 1e-9), drafts))
            finish.sort()
            t, prev, rows, drafting = 0.0, 0.0, len(finish), sum(d for _, d in finish)
            for at, d in finish:
                if at > prev:
                    t += (at - prev) * step_cost(rows, k if drafting else 0)
                    prev = at
                rows -= 1
                drafting -= d
            if best_t is None or t < best_t * (1.0 - 1e-9):
                best_t, best = t, k
        return best

    def _after(self, plan, request_ids, depths, accepted, emitted, times) -> None:
        b = len(request_ids)
        k_cap = self.max_depth
        costs = None
        for r, rid in enumerate(request_ids):
            req = self.requests[rid]
            state = plan.states[r]
            if state == CHECK and req.state == CHECK:
                # The plain step that confirms (or not) a collapse. A step in which no row drafted measured
                # what a plain step costs now; the window is judged again against that (a shared machine's
                # slow spell slows plain steps as much as speculative ones, and the cost model's plain
                # estimate dates from before the window). Otherwise the cost model's estimate stands.
                fresh = times.total if max(depths, default=0) == 0 else self.cost.plain_seconds(b)
                ratio = self._window_ratio(req, fresh)
                if ratio < self.collapse_ratio:
                    if not req.proven:  # resumed on a probe and collapsed again before paying: probe less often
                        self._back_off(req)
                    self._to_fallback(rid, req, f"collapse: observed goodput ratio {ratio:.2f} < "
                                      f"{self.collapse_ratio} over the last {len(req.window)} speculative steps "
                                      f"(plain step {fresh * 1e3:.1f} ms)", goodput_ratio=ratio, plain_seconds=fresh)
                else:
                    req.state = SPEC
                    req.window = []
                    self._event(rid, f"no collapse: goodput ratio {ratio:.2f} >= {self.collapse_ratio} against a "
                                f"plain step re-measured at {fresh * 1e3:.1f} ms", CHECK, SPEC, goodput_ratio=ratio,
                                plain_seconds=fresh)
            elif state == SPEC and len(req.window) >= self.window:
                ratio = self._window_ratio(req, sum(w[2] for w in req.window) / len(req.window))
                if ratio < self.collapse_ratio:
                    # the earliest sign of a collapse; a plain step confirms it before the request falls back
                    req.state = CHECK
                else:  # speculation has paid over a full window: a later fallback starts its backoff afresh
                    req.backoff = 4
                    req.proven = True
                    self.backoff_hint = 4
            elif state == PROBE and depths[r] > 0 and req.state == FALLBACK:
                if costs is None:
                    costs = self._costs(b, k_cap)
                rho, k = self._rho(req.stats.expected_curve(k_cap), costs)
                if rho >= 1.0 + self.hysteresis:
                    # resume; the backoff is kept until a full window of speculation has paid (a drafter
                    # whose lucky probes are followed by collapses is re-probed ever more rarely)
                    req.state = SPEC
                    req.proven = False
                    req.stats.parent = self.global_stats
                    req.window = []
                    self._event(rid, f"probe: predicted goodput ratio {rho:.2f} >= {1.0 + self.hysteresis:.2f} "
                                f"at k={k}", FALLBACK, SPEC, goodput_ratio=rho)
                else:  # the probe failed: back off
                    self._back_off(req)
                    req.stats.reset()


_CLASSES = {"fixed": FixedPolicy, "heuristic": HeuristicPolicy, "goodput": GoodputPolicy}


def drafter_shape(drafter) -> Tuple[int, int, int]:
    """(max depth, nodes per depth, max nodes) of a drafter's proposals."""
    max_nodes = int(getattr(drafter, "max_nodes", 1))
    k = getattr(drafter, "k", None)
    depth = int(k) if isinstance(k, int) and k > 0 else max(1, max_nodes - 1)
    width = int(getattr(drafter, "top_k", None) or getattr(drafter, "matches", None) or 1)
    return depth, width, max_nodes


def make_policy(policy, drafter, cost: Optional[CostModel] = None, **options) -> Policy:
    """A policy object for ``drafter`` from a name in :data:`POLICIES` (or a :class:`Policy`, returned as is)."""
    if isinstance(policy, Policy):
        return policy
    if not isinstance(policy, str) or policy not in _CLASSES:
        raise ValueError(f"SpeculativeDecoder: policy must be one of {POLICIES} or a specdec.scheduler.Policy, "
                         f"got {policy!r}")
    if drafter is None:  # plain decoding: every step drafts nothing
        return FixedPolicy(0, cost=cost)
    depth, width, max_nodes = drafter_shape(drafter)
    return _CLASSES[policy](depth, width, max_nodes, cost=cost, **options)
