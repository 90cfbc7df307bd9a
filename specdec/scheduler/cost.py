"""The cost model: predicted seconds of a step's phases by batch rows, draft depth and verified nodes.

:class:`CostTable` keeps exponentially weighted seconds keyed by (rows, size), with interpolation and a
least-squares fit for keys not observed yet; :class:`CostModel` holds one table per phase (draft, verify,
commit, the rest of the step) and one for a drafter's catch-up, times a speed factor that follows the
machine's current speed. Both learn online from the decoding loop's own clock. See docs/scheduler.md.
"""
from __future__ import annotations

import bisect
import math
from typing import Dict, List, Optional, Tuple

__all__ = ["CostTable", "CostModel"]


class CostTable:
    """Exponentially weighted seconds keyed by (rows b, size x), with interpolation and a fit for unseen keys."""

    def __init__(self, smoothing: float, zero_at_zero: bool, single: str, monotone: bool = False) -> None:
        self.smoothing = smoothing
        self.zero_at_zero = zero_at_zero  # x == 0 costs nothing until observed (drafting 0 tokens)
        self.single = single              # one distinct b * x observed: "constant" or "proportional"
        #: an observed cell is predicted at most at the mean of any larger size at its b observed at least as
        #: often (a pass over more nodes does not cost less): a cell seen once in a spike and then no more
        #: (the plain step's, while every step speculates) cannot keep its inflated value against sizes the
        #: loop keeps measuring
        self.monotone = monotone
        self.cells: Dict[Tuple[int, int], List[float]] = {}  # (b, x) -> [mean seconds, count]
        self._fit: Optional[Tuple[float, float]] = None
        self._dirty = True
        # per b: the observed (x, mean) cells sorted by x, built once between changes (a step's plan asks
        # for every depth at the same b, so they are sorted once per b instead of once per depth)
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
            if c < 16 and self._fitted() is not None:
                m = (c * m + self._estimate(b, x)) / (c + 1.0)
            if self.monotone:
                for (bb, xx), (m2, c2) in self.cells.items():
                    if bb == b and xx > x and c2 >= c and m2 < m:
                        m = m2
            return m
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
        self.draft = CostTable(smoothing, zero_at_zero=True, single="proportional")   # (b, k)
        # verify, commit, rest: a pass over more nodes does not cost less (CostTable.monotone)
        self.verify = CostTable(smoothing, zero_at_zero=False, single="constant", monotone=True)  # (b, n)
        self.commit = CostTable(smoothing, zero_at_zero=False, single="constant", monotone=True)  # (b, n)
        self.rest = CostTable(smoothing, zero_at_zero=False, single="constant", monotone=True)    # (b, n)
        #: seconds of a drafter's catch-up (its lazy prompt prefill, the tokens of plain steps) by the
        #: positions it feeds, bucketed to powers of two (a few positions cost about one forward, a
        #: prompt prefill much less per position): keyed (1, bucket), interpolated between buckets
        self.catch_up = CostTable(smoothing, zero_at_zero=True, single="proportional")
        #: the machine's current speed factor: every prediction is the tables' value times ``speed``,
        #: and every observation enters the tables divided by it. A shared machine has slow spells that
        #: slow every kind of step alike; the factor absorbs them, so a cell measured during one (a deep
        #: draft, say) does not keep its depth out of reach afterwards (the policy would no longer pick
        #: it, so never measure it again), and a plain-step estimate from before a spell does not make
        #: the speculative steps during it look like a collapse. It follows the ratio of each step's
        #: wall time to its prediction (``speed_rate`` of the log ratio per step, one step's ratio
        #: clipped to [0.5, 2]); the tables keep the shape of the costs. Only the product of the two is
        #: identified, so the factor wanders; it is folded into the tables whenever it leaves [0.25, 4]
        #: and before a state_dict, which leaves every prediction unchanged (the updates are invariant
        #: under that rescaling).
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
