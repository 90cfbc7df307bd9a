"""The policy interface the decoding loop drives, and the two simple policies.

:class:`Policy` keeps per-request acceptance statistics, the cost model, the trace and the summary;
the loop calls :meth:`Policy.plan` before every step and :meth:`Policy.observe` after its host sync.
:class:`FixedPolicy` drafts the drafter's own depth every step, :class:`HeuristicPolicy` follows
transformers' assisted-generation schedule; the goodput policy lives in
:mod:`specdec.scheduler.goodput`. :func:`make_policy` builds one from its name.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence, Tuple

from specdec.scheduler.acceptance import AcceptanceStats
from specdec.scheduler.cost import CostModel
from specdec.telemetry import StepRecord, StepTimes

__all__ = ["POLICIES", "SPEC", "FALLBACK", "PROBE", "CHECK", "StepPlan", "StepTimes", "RequestRecord", "Policy",
           "FixedPolicy", "HeuristicPolicy", "drafter_shape", "make_policy"]

POLICIES = ("fixed", "heuristic", "goodput")

#: a request's state: speculating, decoding plainly, probing from fallback, or one plain step that
#: confirms a suspected collapse
SPEC, FALLBACK, PROBE, CHECK = "spec", "fallback", "probe", "check"
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
class RequestRecord:
    """A policy's record of one request: its acceptance statistics and where it stands."""

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
        self.requests: Dict[int, RequestRecord] = {}
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
        """Start a generate call: forget the requests and counters (the cost model and the decoder-wide
        statistics stay); ``trace`` keeps a per-step trace in :attr:`trace`."""
        self.requests = {}
        self.step_index = 0
        self.trace = [] if trace else None
        self._reset_counters()

    def _request(self, rid: int) -> RequestRecord:
        req = self.requests.get(rid)
        if req is None:
            req = self.requests[rid] = RequestRecord(AcceptanceStats(decay=self.decay, parent=self.global_stats),
                                                     k=self.max_depth)
        return req

    # ---- the two hooks the loop calls
    def plan(self, request_ids: Sequence[int], budgets: Sequence[int], closed: bool = False,
             behind: Optional[Sequence[int]] = None) -> StepPlan:
        """Per-row draft depth for the next step; ``budgets`` = tokens still worth drafting per row.

        ``closed``: the rows are a closed batch (nothing waits and nothing will join: a generate call
        past its queue), whose wall time is that of its slowest row; ``behind``: per row, the
        positions the drafter would feed before drafting (``Drafter.pending_catch_up``). See
        :class:`specdec.scheduler.goodput.GoodputPolicy`.
        """
        reqs = [self._request(rid) for rid in request_ids]
        self._closed = bool(closed)
        self._behind = [int(x) for x in behind] if behind is not None else None
        plan = self._budgets(request_ids, reqs, [max(0, int(x)) for x in budgets])
        plan.k = max(plan.budgets, default=0)
        return plan

    def _budgets(self, request_ids, reqs: List[RequestRecord], budgets: List[int]) -> StepPlan:
        raise NotImplementedError

    def observe_step(self, step: StepRecord) -> None:
        """The engine's record of the step (see :mod:`specdec.telemetry`): :meth:`observe` with its fields."""
        self.observe(step.plan, step.request_ids, step.nodes, step.depths, step.drafted, step.accepted,
                     step.emitted, step.times)

    def observe(self, plan: StepPlan, request_ids: Sequence[int], nodes: int, depths: Sequence[int],
                drafted: Sequence[int], accepted: Sequence[int], emitted: Sequence[int], times: StepTimes) -> None:
        """The step's outcome: per row its draft depth, drafted nodes, accepted and emitted tokens."""
        b = len(request_ids)
        self._observe_costs(b, max(depths, default=0), nodes, times)
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

    def _observe_costs(self, b: int, k_run: int, nodes: int, times: StepTimes) -> None:
        """Feed the step's phase seconds to the cost model (a step of b rows drafting depth k_run)."""
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


def drafter_shape(drafter) -> Tuple[int, int, int]:
    """(max depth, nodes per depth, max nodes) of a drafter's proposals."""
    max_nodes = int(getattr(drafter, "max_nodes", 1))
    k = getattr(drafter, "k", None)
    depth = int(k) if isinstance(k, int) and k > 0 else max(1, max_nodes - 1)
    width = int(getattr(drafter, "top_k", None) or getattr(drafter, "matches", None) or 1)
    return depth, width, max_nodes


def make_policy(policy, drafter, cost: Optional[CostModel] = None, **options) -> Policy:
    """A policy object for ``drafter`` from a name in :data:`POLICIES` (or a :class:`Policy`, returned as is)."""
    from specdec.scheduler.goodput import GoodputPolicy  # goodput.py builds on this module

    classes = {"fixed": FixedPolicy, "heuristic": HeuristicPolicy, "goodput": GoodputPolicy}
    if isinstance(policy, Policy):
        return policy
    if not isinstance(policy, str) or policy not in classes:
        raise ValueError(f"SpeculativeDecoder: policy must be one of {POLICIES} or a specdec.scheduler.Policy, "
                         f"got {policy!r}")
    if drafter is None:  # plain decoding: every step drafts nothing
        return FixedPolicy(0, cost=cost)
    depth, width, max_nodes = drafter_shape(drafter)
    return classes[policy](depth, width, max_nodes, cost=cost, **options)
