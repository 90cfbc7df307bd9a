"""The goodput policy: every step, the draft depth that maximises expected emitted tokens per second.

From the cost model and each request's acceptance statistics it picks the batch's depth, moves
requests whose speculation does not pay to plain decoding (fallback) and re-probes them with
exponential backoff. docs/scheduler.md explains the objective and each rule.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Tuple

from specdec.scheduler.acceptance import AcceptanceStats
from specdec.scheduler.cost import CostModel
from specdec.scheduler.policies import CHECK, FALLBACK, PROBE, SPEC, Policy, RequestRecord, StepPlan
from specdec.tree import expected_tokens

__all__ = ["GoodputPolicy"]

_INFORMED = 16  # drafting request-steps after which the decoder-wide statistics judge a catch-up
_YOUNG = 4  # drafting steps before a request's own statistics can make it fall back on prediction


@dataclass
class _Batch:
    """One plan in the making: the rows, their expected-token curves and roles, the depth chosen so far."""

    request_ids: Sequence[int]
    reqs: List[RequestRecord]
    budgets: List[int]         # tokens still worth drafting per row
    costs: List[float]         # predicted step seconds at depth 0 .. k_cap (the step's deepest choice)
    curves: List[List[float]]  # per row: E[T] at depth 0 .. k_cap
    spec: List[bool]           # per row: speculating
    probing: List[bool]        # per row: in fallback, its probe due
    plain_g: float             # goodput of a plain step (rows per second)
    k: int = 0                 # the step's depth
    g: float = 0.0             # its predicted goodput

    def tokens(self, k: int) -> float:
        """Expected tokens of the step at depth k: speculating rows at min(k, budget), the others one."""
        return sum(c[min(k, x)] if s else 1.0 for c, s, x in zip(self.curves, self.spec, self.budgets))

    def goodput(self, k: int) -> float:
        """Expected tokens per second at depth k."""
        return self.tokens(k) / self.costs[k] if self.costs[k] > 0 else self.tokens(k)


class GoodputPolicy(Policy):
    """Maximise expected emitted tokens per second; fall back to plain decoding when speculation does not pay.

    Parameters (besides :class:`Policy`'s; ``decay`` defaults to 0.9 here, about ten steps of
    memory per request): ``collapse_ratio`` (observed goodput ratio below which a request collapses
    to fallback, over ``window`` speculative steps: 8, so that one unlucky deep rejection in a run
    of accepted steps, which costs a step of twice the price for one token, does not read as a
    collapse), ``hysteresis`` (a probe must predict rho >= 1 + hysteresis to resume),
    ``max_backoff`` (most steps between probes), ``probe_alpha`` (the acceptance a paid probe's
    depth is chosen for).
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

    # ---- helpers of the decision
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

    def _back_off(self, req: RequestRecord) -> None:
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
    def _window_ratio(req: RequestRecord, plain: float) -> float:
        """Observed goodput ratio of the request's window: tokens emitted * plain step seconds / seconds."""
        secs = sum(w[1] for w in req.window)
        return sum(w[0] for w in req.window) * plain / secs if secs > 0 else float("inf")

    def _to_fallback(self, rid: int, req: RequestRecord, reason: str, **extra) -> None:
        old = req.state
        req.state = FALLBACK
        if req.stats.observations == 0:  # decided on the decoder-wide statistics: inherit their backoff
            req.backoff = max(req.backoff, self.backoff_hint)
        # a fresh history; its prior (weak: a probe's own acceptance dominates) is the request's last
        # estimate of the first position, capped by the decoder-wide one (see docs/scheduler.md)
        prior = min(req.stats.alpha(0), self.global_stats.alpha(0))
        req.stats = AcceptanceStats(decay=self.decay, prior=prior, prior_weight=req.stats.prior_weight)
        req.window = []
        req.next_probe = self.step_index + req.backoff
        self._event(rid, reason, old, FALLBACK, next_probe_step=req.next_probe, **extra)

    # ---- the decision: the batch's best depth, then the rules, in order
    def _budgets(self, request_ids, reqs, budgets):
        b = len(reqs)
        k_cap = min(self.max_depth, max(budgets, default=0))
        if k_cap <= 0:
            return StepPlan([0] * b, [r.state for r in reqs], [1.0] * b)
        if not self.cost.knows_plain():  # one plain step measures what speculation is compared with
            return StepPlan([0] * b, [r.state for r in reqs], [1.0] * b)
        if all(r.state != SPEC and not (r.state == FALLBACK and self.step_index >= r.next_probe) for r in reqs):
            # nobody speculates and no probe is due: every row decodes plainly whatever the costs say
            # (what _assign gives such rows), so the depths are not weighed (a fallback stretch of a
            # drafter that does not pay then costs no planning time)
            return StepPlan([0] * b, [CHECK if r.state == CHECK else FALLBACK for r in reqs], [1.0] * b)
        costs = self._costs(b, k_cap)
        trusted = self._predicted_fallbacks(request_ids, reqs, costs, k_cap)
        batch = _Batch(request_ids, reqs, budgets, costs,
                       curves=[(self.global_stats if t else req.stats).expected_curve(k_cap)  # fallback rows were reset
                               for req, t in zip(reqs, trusted)],
                       spec=[req.state == SPEC for req in reqs],
                       probing=[req.state == FALLBACK and self.step_index >= req.next_probe for req in reqs],
                       plain_g=b / costs[0] if costs[0] > 0 else float(b))
        self._best_depth(batch)
        if batch.k == 0 and any(batch.probing):
            self._paid_probe(batch)
        if self._closed and b > 1 and batch.k > 0 and not any(batch.probing):
            batch.k = self._closed_batch_k(reqs, batch.curves, batch.spec, budgets, costs, batch.k)
        if batch.k > 0 and self._behind is not None and any(self._behind):
            self._catch_up_rule(batch)
        return self._assign(batch)

    def _predicted_fallbacks(self, request_ids, reqs, costs: List[float], k_cap: int) -> List[bool]:
        """Rule 1 (predicted): a speculating request whose own best goodput ratio is below 1 falls back.

        A young request (fewer than ``_YOUNG`` drafting steps) of a drafter that pays decoder-wide is
        judged by the decoder-wide statistics instead, so that one early rejection does not buy a
        fallback, a probe and the draft's catch-up after it. Returns, per row, whether the row is
        planned with the decoder-wide statistics.
        """
        curves = [req.stats.expected_curve(k_cap) for req in reqs]
        population = None
        trusted = [False] * len(reqs)
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
        return trusted

    def _best_depth(self, batch: _Batch) -> None:
        """The depth that maximises the batch's expected tokens per second (0: a plain step)."""
        best_k, best_g = 0, batch.plain_g
        for k in range(1, len(batch.costs)):
            g = batch.goodput(k)
            if g > best_g * (1.0 + 1e-9):
                best_k, best_g = k, g
        batch.k, batch.g = best_k, best_g

    def _paid_probe(self, batch: _Batch) -> None:
        """Rule 2 (paid probe): nobody else drafts, so a due probe pays the draft's catch-up and drafting.

        Skipped when even a perfect drafter (every token accepted) could not reach the resume
        threshold at these costs. Otherwise the probe drafts at the depth that would pay if the
        drafter were decent (acceptance ``probe_alpha``), at least 2: a probe after fallback steps
        catches up, and only its depths after the first measure the draft cost (see observe).
        """
        costs = batch.costs
        perfect = self._perfect_ratio(costs)
        if perfect < 1.0 + self.hysteresis:
            self._skip_probes(batch.request_ids, batch.reqs, batch.probing, f"a perfect drafter would reach goodput "
                              f"ratio {perfect:.2f} < {1.0 + self.hysteresis:.2f} at these costs", perfect)
            batch.probing = [False] * len(batch.reqs)
            return
        k_cap = len(costs) - 1
        _, best_k = self._rho([expected_tokens(self.probe_alpha, k) for k in range(k_cap + 1)], costs)
        batch.k = max(best_k, min(2, k_cap))
        batch.g = batch.goodput(batch.k)

    def _closed_batch_k(self, reqs, curves, spec, budgets, costs, best_k: int) -> int:
        """Rule 3 (closed batch): the step depth that minimises the batch's predicted remaining wall time.

        A closed batch (a generate call with nothing left in its queue) ends with its slowest row,
        so a depth that emits more tokens per second for the batch as a whole can still lose: rows
        that speculate well finish early while the batch keeps stepping for a row that does not, at
        the higher cost of every speculative step.

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

    def _catch_up_rule(self, batch: _Batch) -> None:
        """Rule 4 (catch-up): the drafter must first feed the positions it is behind (a draft model's
        lazy prompt prefill, the tokens of plain steps), a one-time price that speculating must win
        back over the tokens these rows still have to produce.

        Judged as if the drafter were perfect (every token accepted), so only a catch-up that cannot
        pay whatever the acceptance keeps the step plain (judged at the predicted acceptance, a row
        that declines falls further behind, its price grows, its remaining tokens shrink and it never
        drafts again). One exception: once the decoder-wide statistics have seen ``_INFORMED``
        drafting request-steps, a step predicted to gain less than the probes' margin (goodput ratio
        < 1 + hysteresis) is not worth any catch-up; its speculating rows fall back, so that probes
        (judged as above, after the backoff) can still find out that the drafter pays.
        """
        price = getattr(self.cost, "catch_up_seconds", lambda n: 0.0)(sum(self._behind))
        if not price > 0:  # no catch-up price known (or none to pay)
            return
        costs, plain_g, b = batch.costs, batch.plain_g, len(batch.reqs)
        perfect = self._perfect_ratio(costs)
        g_pred = batch.tokens(batch.k) / costs[batch.k] if costs[batch.k] > 0 else plain_g
        g = plain_g * perfect
        left = float(sum(x + 1 for x in batch.budgets))
        why = f"the drafter's catch-up ({price * 1e3:.1f} ms)"
        if (self.global_stats.observations >= _INFORMED and not any(batch.probing)
                and g_pred < plain_g * (1.0 + self.hysteresis)):
            for rid, req, s_ in zip(batch.request_ids, batch.reqs, batch.spec):
                if s_:
                    self._to_fallback(rid, req, f"{why} is not worth a predicted goodput ratio "
                                      f"{g_pred / plain_g:.2f} < {1.0 + self.hysteresis:.2f}",
                                      goodput_ratio=g_pred / plain_g)
            batch.spec = [False] * b
            batch.k = 0
        elif g <= plain_g or left / g + price >= left / plain_g:
            self._skip_probes(batch.request_ids, batch.reqs, batch.probing, f"{why} would not be won back", perfect)
            batch.probing = [False] * b
            batch.k = 0

    def _assign(self, batch: _Batch) -> StepPlan:
        """Each row's depth and state at the step's depth: speculating rows draft (up to their budget),
        a collapse to confirm takes one plain step, a due probe rides along (free when others
        speculate, paid otherwise), the other rows of a batch decode plainly (the drafter pads them)."""
        states, out, expected = [], [], []
        for req, curve, s, p, x in zip(batch.reqs, batch.curves, batch.spec, batch.probing, batch.budgets):
            k = min(batch.k, x)
            if s:
                states.append(SPEC)
            elif req.state == CHECK:
                states.append(CHECK)
                k = 0
            elif p and batch.k > 0:
                states.append(PROBE)
            else:
                states.append(FALLBACK)
                k = 0
            out.append(k)
            expected.append(curve[k])
        plain_g = batch.plain_g
        return StepPlan(out, states, expected, predicted_ratio=batch.g / plain_g if plain_g > 0 else 1.0)

    # ---- the reaction to a step
    def _after(self, plan, request_ids, depths, accepted, emitted, times) -> None:
        b = len(request_ids)
        costs = None
        for r, rid in enumerate(request_ids):
            req = self.requests[rid]
            state = plan.states[r]
            if state == CHECK and req.state == CHECK:
                self._confirm_collapse(rid, req, depths, times, b)
            elif state == SPEC and len(req.window) >= self.window:
                self._judge_window(req)
            elif state == PROBE and depths[r] > 0 and req.state == FALLBACK:
                if costs is None:
                    costs = self._costs(b, self.max_depth)
                self._judge_probe(rid, req, costs)

    def _confirm_collapse(self, rid: int, req: RequestRecord, depths, times, b: int) -> None:
        """The plain step that confirms (or not) a collapse. A step in which no row drafted measured what a
        plain step costs now; the window is judged again against that (a shared machine's slow spell slows
        plain steps as much as speculative ones, and the cost model's plain estimate dates from before the
        window). Otherwise the cost model's estimate stands."""
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

    def _judge_window(self, req: RequestRecord) -> None:
        """A speculating request's full window: a goodput ratio below ``collapse_ratio`` is the earliest
        sign of a collapse (a plain step confirms it before the request falls back)."""
        ratio = self._window_ratio(req, sum(w[2] for w in req.window) / len(req.window))
        if ratio < self.collapse_ratio:
            req.state = CHECK
        else:  # speculation has paid over a full window: a later fallback starts its backoff afresh
            req.backoff = 4
            req.proven = True
            self.backoff_hint = 4

    def _judge_probe(self, rid: int, req: RequestRecord, costs: List[float]) -> None:
        """A probe that drafted: it resumes speculation when its fresh statistics predict a goodput ratio of
        at least 1 + hysteresis, else it backs off."""
        rho, k = self._rho(req.stats.expected_curve(self.max_depth), costs)
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
