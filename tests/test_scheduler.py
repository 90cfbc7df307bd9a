"""specdec.scheduler: E[T] math, the cost model, acceptance statistics and the policies' decisions.

Part 1: pure functions and the policies driven with synthetic costs and acceptance (no
model, no timing: every decision depends only on the synthetic inputs).
Part 2: the decoding loop on the toy LM with a synthetic cost model: greedy output under
every policy equals the model's own greedy decoding, the goodput policy falls back with a
useless drafter and re-probes with backoff, resumes when the drafter becomes useful, gives
rows of one batch different k; the trace and summary keys; metrics arithmetic on a
hand-made trace.
"""
from __future__ import annotations

import itertools
import json
import os
import random
import sys
from typing import Callable, List, Sequence

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))
from toy_lm import ToyLM  # noqa: E402

from specdec.decoding import SpeculativeDecoder  # noqa: E402
from specdec.drafters import Draft, Drafter, DraftModel, PromptLookup, StepContext  # noqa: E402
from specdec.metrics import (POLICY_KEYS, TRACE_EVENT_KEYS, TRACE_STEP_KEYS, expected_tokens_from_acceptance,  # noqa: E402
                             read_trace, summarize_trace)
from specdec.scheduler import (AcceptanceStats, CostModel, FixedPolicy, GoodputPolicy, HeuristicPolicy,  # noqa: E402
                               Policy, StepPlan, StepTimes, expected_tokens, expected_tokens_chain,
                               expected_tokens_tree, make_policy, plan_tree)
from specdec.tree import TokenTree  # noqa: E402


@pytest.fixture(autouse=True)
def _one_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


# ============================================================================ synthetic inputs
class SyntheticCost:
    """A cost model with given formulas that ignores the measured seconds (decisions stay deterministic)."""

    def __init__(self, verify: Callable[[int, int], float], draft: Callable[[int, int], float] = lambda b, k: 0.0):
        self.verify_fn = verify
        self.draft_fn = draft
        self.observed = 0

    def observe(self, *args, **kwargs) -> None:
        self.observed += 1

    def step_seconds(self, b: int, k: int, n: int) -> float:
        return self.draft_fn(b, k) + self.verify_fn(b, n)

    def plain_seconds(self, b: int) -> float:
        return self.step_seconds(b, 0, 1)

    def knows_plain(self) -> bool:
        return True


def flat_cost() -> SyntheticCost:
    """A verify pass of n nodes costs one decode step + 5 % per extra node; a draft token 3 % of a step."""
    return SyntheticCost(lambda b, n: 1.0 + 0.05 * (n - 1), lambda b, k: 0.03 * k)


class FixedAlpha(AcceptanceStats):
    """Acceptance statistics pinned to one alpha per position (observations ignored)."""

    def __init__(self, alpha: float) -> None:
        super().__init__()
        self.a = alpha

    def alphas(self, k: int) -> List[float]:
        return [self.a] * k

    def observe(self, depth: int, accepted: int) -> None:
        pass

    def reset(self) -> None:
        pass


def times() -> StepTimes:
    return StepTimes(0.0, 0.0, 0.0, 1.0)


def run_steps(pol: Policy, rids: List[int], budget: int, accept: Callable[[int, int, int], int], steps: int):
    """Drive a policy without a model: accept(step, rid, k) -> accepted tokens. Returns the plans."""
    plans = []
    for s in range(steps):
        plan = pol.plan(rids, [budget] * len(rids))
        acc = [min(k, accept(s, rid, k)) for rid, k in zip(rids, plan.budgets)]
        pol.observe(plan, rids, pol.nodes(plan.k), plan.budgets, plan.budgets, acc, [a + 1 for a in acc], times())
        plans.append(plan)
    return plans


# ============================================================================ E[T]
def test_expected_tokens_closed_form_equals_positional_sum():
    for alpha in (0.0, 0.3, 0.8, 0.95):
        for k in range(0, 9):
            want = 1.0 + sum(alpha ** i for i in range(1, k + 1))
            assert expected_tokens(alpha, k) == pytest.approx(want, rel=1e-12)
            assert expected_tokens_chain([alpha] * k, k) == pytest.approx(want, rel=1e-12)
    assert expected_tokens(1.0, 5) == 6.0
    assert expected_tokens_chain([0.5, 0.5, 0.0, 1.0], 4) == pytest.approx(1 + 0.5 + 0.25)
    assert expected_tokens_from_acceptance(0.5, 3) == pytest.approx(1 + 0.5 + 0.25 + 0.125)
    assert expected_tokens_from_acceptance(0.7, 0) == 1.0


def test_expected_tokens_tree_by_hand():
    # root -> a (0.6) -> c (0.5); root -> b (0.3): E = 1 + 0.6 + 0.3 + 0.6 * 0.5
    assert expected_tokens_tree([-1, 0, 0, 1], [1.0, 0.6, 0.3, 0.5]) == pytest.approx(2.2)
    chain = expected_tokens_tree([-1, 0, 1, 2], [1.0, 0.7, 0.7, 0.7])
    assert chain == pytest.approx(expected_tokens(0.7, 3))
    with pytest.raises(ValueError, match=r"parents\[2\] must lie in \[0, 2\), got 2"):
        expected_tokens_tree([-1, 0, 2], [1.0, 0.5, 0.5])


def _tree_value(parents: Sequence[int], acc) -> float:
    depth, rank, nchild = [0] * len(parents), [0] * len(parents), [0] * len(parents)
    probs = [1.0]
    for i in range(1, len(parents)):
        p = parents[i]
        depth[i] = depth[p] + 1
        rank[i] = nchild[p]
        nchild[p] += 1
        probs.append(acc(depth[i], rank[i]))
    return expected_tokens_tree(parents, probs)


@pytest.mark.parametrize("budget", [1, 2, 3, 4, 5, 6])
def test_plan_tree_is_optimal_for_small_budgets(budget):
    def acc(d, r):  # decreasing in depth and rank
        return 0.8 * 0.9 ** (d - 1) * 0.45 ** r

    parents, slots, value = plan_tree(acc, budget)
    assert len(parents) == budget
    assert value == pytest.approx(_tree_value(parents, acc))
    best = max(_tree_value([-1] + list(ps), acc)
               for ps in itertools.product(*[range(i) for i in range(1, budget)])) if budget > 1 else 1.0
    assert value == pytest.approx(best)
    assert slots[0] == (0, 0) and all(d >= 1 for d, _ in slots[1:])


# ============================================================================ acceptance statistics
def test_acceptance_stats_positions_prior_and_decay():
    st = AcceptanceStats(decay=1.0, prior=0.5, prior_weight=1.0)
    assert st.alpha(0) == 0.5 and st.expected(2) == pytest.approx(1.75)
    st.observe(depth=4, accepted=2)   # positions 1, 2 accepted, 3 rejected, 4 not reached
    assert st.trials == [1.0, 1.0, 1.0] and st.hits == [1.0, 1.0, 0.0]
    # position 0's prior is `prior`, deeper positions' the estimate of the position before
    assert st.alpha(0) == pytest.approx(0.75) and st.alpha(1) == pytest.approx((1.0 + 0.75) / 2.0)
    assert st.alpha(2) == pytest.approx((0.0 + 0.875) / 2.0)
    assert st.alpha(5) == pytest.approx(st.alpha(2))  # deeper than observed: the deepest estimate
    assert st.alphas(6) == pytest.approx([st.alpha(i) for i in range(6)])
    st.observe(depth=3, accepted=3)
    assert st.hits == [2.0, 2.0, 1.0] and st.trials == [2.0, 2.0, 2.0]
    decayed = AcceptanceStats(decay=0.5, prior=0.5, prior_weight=1.0)
    for a in (0, 0, 0, 3):
        decayed.observe(3, a)
    # after three misses then a hit at position 1: hits 1, trials 0.5^3 + 0.5^2 + 0.5 + 1 = 1.875
    assert decayed.alpha(0) == pytest.approx((1.0 + 0.5) / (1.875 + 1.0))
    child = AcceptanceStats(parent=st)
    assert child.alpha(0) == pytest.approx(st.alpha(0))
    child.observe(2, 0)
    assert st.trials[0] == 3.0  # observations reach the parent too


def test_acceptance_stats_stale_positions_recover():
    """One early rejection at a deep position must not keep deeper drafts looking bad once the
    policy stops drafting that deep: unreached positions lose weight, and their prior is the
    estimate of the position before (a trap seen with the w8 draft: k stuck at 2-3 after the
    first step's k = 8 draft was rejected at position 4)."""
    st = AcceptanceStats(decay=0.8, prior=0.5, prior_weight=0.5)
    st.observe(depth=8, accepted=3)           # position 4 rejected once
    assert st.alpha(3) < 0.35
    for _ in range(12):                       # then only depth-3 drafts, all accepted
        st.observe(depth=3, accepted=3)
    assert st.alpha(2) > 0.9
    assert st.alpha(3) > 0.8 and st.alpha(6) == pytest.approx(st.alpha(3))
    child = AcceptanceStats(parent=st)
    child.observe(depth=2, accepted=2)
    # deeper than the child observed: its deepest estimate, capped where the parent has evidence
    assert child.alpha(3) == pytest.approx(min(child.alpha(1), st.alpha(3)))
    assert not st._observed(7) and child.alpha(7) == pytest.approx(child.alpha(1))  # the parent never saw it


def test_acceptance_stats_tree_depth_rank():
    st = AcceptanceStats(decay=1.0, prior=0.5, prior_weight=1.0)
    # root -> {1, 2}; 1 -> {3, 4}; accepted path 0 -> 2: trials (1,0), (1,1); hit (1,1); node 3, 4 unseen
    st.observe_tree([-1, 0, 0, 1, 1], [0, 2, -1])
    assert st.tree_trials == {(1, 0): 1.0, (1, 1): 1.0} and st.tree_hits == {(1, 0): 0.0, (1, 1): 1.0}
    assert st.tree_alpha(1, 1) == pytest.approx((1.0 + 0.25) / 2.0)  # prior for rank 1: 0.5 * 0.5
    assert st.tree_alpha(2, 0) == 0.5


# ============================================================================ cost model
def test_cost_model_cells_interpolation_and_fit():
    cm = CostModel(smoothing=0.5)

    def truth(b, n):
        return 0.050 + 0.002 * b * n

    for b, n in ((1, 1), (1, 9), (4, 1), (8, 1), (8, 5)):
        cm.observe(b, 0, n, 0.0, truth(b, n), 0.001, None)
    assert cm.verify.predict(1, 5) == pytest.approx(truth(1, 5))      # interpolation at b = 1
    assert cm.verify.predict(4, 7) == pytest.approx(truth(4, 7))      # linear fit, level of b = 4
    assert cm.verify.predict(2, 3) == pytest.approx(truth(2, 3))      # unseen b: the fit
    assert cm.commit.predict(3, 3) == pytest.approx(0.001)
    assert cm.plain_seconds(8) == pytest.approx(truth(8, 1) + 0.001)
    # smoothing and spikes: 0.1 then 0.2 -> 0.15; a spike of 100 s pulls at most 4x the mean
    cm2 = CostModel(smoothing=0.5)
    cm2.observe(1, 0, 1, 0.0, 0.1, 0.0, None)
    cm2.observe(1, 0, 1, 0.0, 0.2, 0.0, None)
    assert cm2.verify.predict(1, 1) == pytest.approx(0.15)
    cm2.observe(1, 0, 1, 0.0, 100.0, 0.0, None)
    assert cm2.verify.predict(1, 1) == pytest.approx(0.15 + 0.5 * (0.6 - 0.15))
    # drafting: k = 0 costs nothing until seen; one observed depth scales with the depth (one draft
    # forward per depth), two give the slope
    cm3 = CostModel()
    cm3.observe(2, 4, 5, 0.040, 0.1, 0.0, 0.2)
    assert cm3.draft.predict(2, 0) == 0.0 and cm3.draft.predict(2, 2) == pytest.approx(0.020)
    cm3.observe(2, 8, 9, 0.070, 0.1, 0.0, 0.2)
    assert cm3.draft.predict(2, 6) == pytest.approx(0.055) and cm3.draft.predict(2, 10) == pytest.approx(0.085)
    assert cm3.rest.cells[(2, 5)][0] == pytest.approx(0.060)  # total - phases
    # a cell seen once (a spike, or an early step) is shrunk towards its neighbours / the fit, by
    # weight count / (count + 1), until it holds 16 observations; then it is its own mean
    cm5 = CostModel(smoothing=0.5)
    for k in (1, 2, 4):
        for _ in range(20):
            cm5.observe(1, k, k + 1, 0.010 * k, 0.1, 0.0, None)
    cm5.observe(1, 3, 4, 0.090, 0.1, 0.0, None)   # depth 3 once, 3x its true cost
    assert cm5.draft.predict(1, 3) == pytest.approx((0.090 + 0.030) / 2.0)
    for _ in range(15):
        cm5.observe(1, 3, 4, 0.090, 0.1, 0.0, None)
    assert cm5.draft.predict(1, 3) == pytest.approx(0.090)
    state = cm.state_dict()
    cm4 = CostModel()
    cm4.load_state_dict(json.loads(json.dumps(state)))
    assert cm4.verify.predict(4, 7) == pytest.approx(cm.verify.predict(4, 7))
    with pytest.raises(ValueError, match=r"CostModel: smoothing must lie in \(0, 1\], got 0"):
        CostModel(smoothing=0)


def test_a_plain_step_seen_once_in_a_spike_does_not_price_every_later_step():
    """While every step speculates the plain step's cells are not measured again: one plain step slowed by
    the machine at the start must not stand for plain decoding's cost for good (a drafter whose forwards
    cost more than the target's would then look as if it paid). A pass over more nodes does not cost
    less: the verify / commit / rest cells of a plain step are predicted at most at a larger size's
    observed as often."""
    cm = CostModel()
    cm.observe(1, 0, 1, 0.0, 0.050, 0.0001, 0.0512)        # the plain step, 10x slow once
    for _ in range(30):                                     # k = 6, seven nodes: 18 ms of drafting, 5.4 verify
        cm.observe(1, 6, 7, 0.018, 0.0054, 0.0002, 0.0240)
    plain = cm.plain_seconds(1)
    assert plain <= 0.0054 + 0.0002 + 0.0004 + 1e-9
    # three tokens a step at 24 ms against one per plain step: speculation does not pay
    assert 3.0 / cm.step_seconds(1, 6, 7) < 1.0 / plain
    # a larger size observed fewer times than the cell does not cap it (it may be the stale one)
    cm2 = CostModel()
    for _ in range(5):
        cm2.observe(1, 0, 1, 0.0, 0.005, 0.0, None)
    cm2.observe(1, 2, 3, 0.001, 0.002, 0.0, None)          # one fast observation of a larger pass
    assert cm2.verify.predict(1, 1) > 0.004


# ============================================================================ policy decisions
def _best_k(alpha: float, cost: SyntheticCost, b: int, k_max: int) -> int:
    g = [b * expected_tokens(alpha, k) / cost.step_seconds(b, k, 1 + k) for k in range(k_max + 1)]
    return max(range(k_max + 1), key=lambda k: (g[k], -k))


def test_cost_model_speed_factor_follows_slow_spells():
    """A slow spell of a shared machine slows every kind of step: the speed factor carries it to the
    cells not measured during the spell (the plain step's estimate rises with the speculative steps,
    and falls back with the steps measured after it)."""
    cm = CostModel()

    def step(k, seconds):  # verify is the whole step: draft and commit free
        cm.observe(1, k, k + 1, 0.0, seconds, 0.0, seconds)

    for _ in range(20):
        step(0, 1.0)
        step(2, 2.0)
        step(4, 3.0)
    assert cm.speed == pytest.approx(1.0) and cm.step_seconds(1, 2, 3) == pytest.approx(2.0)
    for _ in range(6):  # a spell at half speed, drafting at k = 2 only
        step(2, 4.0)
    assert cm.plain_seconds(1) > 1.4 and cm.step_seconds(1, 4, 5) > 4.2
    for _ in range(6):  # the spell ends; k = 2 and plain steps are measured again, k = 4 is not
        step(2, 2.0)
        step(0, 1.0)
    assert cm.plain_seconds(1) == pytest.approx(1.0, rel=0.1)
    assert cm.step_seconds(1, 4, 5) == pytest.approx(3.0, rel=0.15)
    cm2 = CostModel()
    cm2.observe(1, 0, 1, 0.0, 1.0, 0.0, 1.0)
    assert cm2.speed == 1.0  # the first observation of a cell has no prediction to compare with
    # only the product of speed and tables is identified: the factor is folded into the tables (when
    # it wanders out of [0.25, 4], and for a state_dict) without changing a prediction
    assert cm.speed != 1.0
    want = [cm.step_seconds(b, k, k + 1) for b, k in ((1, 0), (1, 2), (1, 4))]
    state = json.loads(json.dumps(cm.state_dict()))
    assert cm.speed == 1.0 and ([cm.step_seconds(b, k, k + 1) for b, k in ((1, 0), (1, 2), (1, 4))]
                                == pytest.approx(want))
    cm3 = CostModel()
    cm3.load_state_dict(state)
    assert [cm3.step_seconds(b, k, k + 1) for b, k in ((1, 0), (1, 2), (1, 4))] == pytest.approx(want)
    for i in range(400):  # a machine that keeps slowing down
        step(2, 2.0 * 1.01 ** i)
        assert 0.25 <= cm.speed <= 4.0
    assert cm.step_seconds(1, 2, 3) == pytest.approx(2.0 * 1.01 ** 400, rel=0.1)


@pytest.mark.parametrize("alpha", [0.5, 0.7, 0.85, 0.95])
def test_goodput_picks_the_k_that_maximises_goodput(alpha):
    cost = SyntheticCost(lambda b, n: 1.0 + 0.08 * b * (n - 1), lambda b, k: 0.03 * k)
    pol = GoodputPolicy(max_depth=12, cost=cost)
    pol.begin(2)
    for rid in (0, 1):
        pol._request(rid).stats = FixedAlpha(alpha)
    plan = pol.plan([0, 1], [50, 50])
    want = _best_k(alpha, cost, 2, 12)
    assert plan.budgets == [want, want]
    assert want > 0  # the synthetic numbers make speculation pay at every alpha here
    ratio = expected_tokens(alpha, want) * cost.plain_seconds(2) / cost.step_seconds(2, want, want + 1)
    assert plan.predicted_ratio == pytest.approx(ratio)


def test_goodput_smaller_k_at_larger_batch():
    cost = SyntheticCost(lambda b, n: 1.0 + 0.06 * b * (n - 1))  # verify cost grows with rows x nodes
    ks = {}
    for b in (1, 2, 4, 8, 16):
        pol = GoodputPolicy(max_depth=10, cost=cost)
        pol.begin(b)
        for rid in range(b):
            pol._request(rid).stats = FixedAlpha(0.8)
        ks[b] = pol.plan(list(range(b)), [50] * b).k
        assert ks[b] == _best_k(0.8, cost, b, 10)
    assert ks[1] > ks[4] > ks[16]
    assert ks[16] == 0  # speculation does not pay at 16 rows: plain steps


def test_goodput_falls_back_with_useless_drafter_and_backs_off():
    pol = GoodputPolicy(max_depth=8, cost=flat_cost(), max_backoff=16)
    pol.begin(1)
    plans = run_steps(pol, [0], 100, lambda s, rid, k: 0, 60)
    drafted = [s for s, p in enumerate(plans) if p.k > 0]
    assert plans[-1].states == ["fallback"] and plans[-1].k == 0
    falls = [e for e in pol.events if e["new_state"] == "fallback"]
    assert falls and falls[0]["old_state"] == "spec" and "goodput ratio" in falls[0]["reason"]
    # after the first fallback, probes only: intervals double (4, 8, 16) and stop growing at max_backoff
    probes = [s for s in drafted if s > falls[0]["step"]]
    gaps = [b - a for a, b in zip(probes, probes[1:])]
    assert gaps[:3] == [8, 16, 16] and all(g == 16 for g in gaps[2:])
    assert len(drafted) <= 8  # a useless drafter is drafted on few of 60 steps
    assert pol.summary()["fallback_request_steps"] == 60 - len(drafted)


def test_goodput_fallback_steps_between_probes_plan_no_depths():
    """While every row is in fallback with no probe due, the plan is plain without weighing depths (no cost
    model query), and the same plain plan as weighing them gives."""
    cost = flat_cost()
    pol = GoodputPolicy(max_depth=8, cost=cost, max_backoff=16)
    pol.begin(1)
    run_steps(pol, [0], 100, lambda s, rid, k: 0, 40)
    req = pol._request(0)
    assert req.state == "fallback" and req.next_probe > pol.step_index
    calls = []
    real = cost.step_seconds
    cost.step_seconds = lambda *a: calls.append(a) or real(*a)
    plan = pol.plan([0], [100])
    assert plan.budgets == [0] and plan.states == ["fallback"] and plan.predicted_ratio == 1.0 and not calls
    pol.step_index = req.next_probe  # a due probe: the depths are weighed again
    assert pol.plan([0], [100]).budgets[0] > 0 and calls


def test_goodput_skips_probes_that_cannot_pay():
    """Each drafted token costs a whole plain step (a same-size draft at a large batch): even perfect
    acceptance gives a goodput ratio below 1, so after the fallback no probe is paid for (the draft
    would first have to catch up every row), the skips back off, and nothing is drafted."""
    cost = SyntheticCost(lambda b, n: 1.0 + 0.05 * (n - 1), lambda b, k: 1.0 * k)
    pol = GoodputPolicy(max_depth=8, cost=cost, max_backoff=16)
    pol.begin(2)
    plans = run_steps(pol, [0, 1], 100, lambda s, rid, k: k, 60)  # the drafter would be perfect
    assert all(p.k == 0 for p in plans)
    skips = [e for e in pol.events if e["reason"].startswith("probe skipped")]
    assert skips and all(e["old_state"] == e["new_state"] == "fallback" for e in skips)
    gaps = [b["step"] - a["step"] for a, b in zip(skips[::2], skips[2::2])]  # two rows skip together
    assert gaps[:3] == [8, 16, 16]
    # with cheap drafting the same perfect drafter is probed and resumes
    pol = GoodputPolicy(max_depth=8, cost=flat_cost(), max_backoff=16)
    pol.begin(1)
    plans = run_steps(pol, [0], 100, lambda s, rid, k: k, 30)
    assert plans[-1].states == ["spec"] and plans[-1].k > 0


def test_goodput_resumes_when_the_drafter_becomes_useful():
    pol = GoodputPolicy(max_depth=6, cost=flat_cost())
    pol.begin(1)
    plans = run_steps(pol, [0], 100, lambda s, rid, k: 0 if s < 20 else k, 50)
    assert any(p.states == ["fallback"] for p in plans[:20])
    back = [e for e in pol.events if e["new_state"] == "spec"]
    assert back and back[0]["step"] >= 20 and back[0]["old_state"] == "fallback"
    assert all(p.states == ["spec"] for p in plans[back[0]["step"] + 1:])
    assert all(p.k == 6 for p in plans[-5:])


def test_goodput_closed_batch_plans_for_its_slowest_row():
    """A closed batch ends with its slowest row. Row 1's drafter never proposes anything (prompt
    lookup without a match): per-step goodput still speculates for row 0, which only makes the
    batch's steps dearer while row 1 needs as many steps as ever; the closed-batch choice drafts
    nothing once row 1's hit rate has shown it. Open batches (a server) keep the per-step choice,
    and one row is the per-step choice either way."""
    cost = SyntheticCost(lambda b, n: 1.0 + 0.15 * b * (n - 1))

    def drive(closed: bool, rows: List[int]) -> List[StepPlan]:
        pol = GoodputPolicy(max_depth=8, cost=cost)
        pol.begin(len(rows))
        for rid in rows:
            pol._request(rid).stats = FixedAlpha(0.9)
        plans = []
        for _ in range(6):
            plan = pol.plan(rows, [40] * len(rows), closed=closed)
            depths = [k if rid == 0 else 0 for rid, k in zip(rows, plan.budgets)]  # row 1: never a proposal
            pol.observe(plan, rows, pol.nodes(plan.k), depths, depths, depths, [d + 1 for d in depths], times())
            plans.append(plan)
        return plans

    open_ = drive(False, [0, 1])
    assert all(p.k > 0 for p in open_)
    closed = drive(True, [0, 1])
    assert closed[0].k > 0       # hit rates start at 1: the first step cannot know
    assert all(p.k == 0 for p in closed[3:])
    assert [p.k for p in drive(True, [0])] == [p.k for p in drive(False, [0])]


def _drive_high_acceptance(steps: int, spec_seconds: float, plain_seconds: float, stop_at_event: bool):
    """A request at alpha 0.9 on the flat synthetic costs, one token accepted per speculative step,
    each step timed at spec_seconds (drafting) or plain_seconds (k = 0). Returns (policy, states)."""
    pol = GoodputPolicy(max_depth=4, cost=flat_cost(), window=3)
    pol.begin(1)
    pol._request(0).stats = FixedAlpha(0.9)
    states = []
    for _ in range(steps):
        plan = pol.plan([0], [100])
        k = plan.k
        states.append(plan.states[0])
        pol.observe(plan, [0], pol.nodes(k), [k], [k], [1 if k else 0], [2 if k else 1],
                    StepTimes(0.0, 0.0, 0.0, spec_seconds if k else plain_seconds))
        if stop_at_event and pol.events:
            break
    return pol, states


def test_goodput_collapse_on_observed_goodput():
    """Acceptance stays high but speculative steps take 3x what the cost model says while plain steps
    take what it says: the observed window fires, one plain step re-measures plain, and the
    request falls back."""
    pol, states = _drive_high_acceptance(8, 3.0, 1.0, stop_at_event=True)
    assert states == ["spec", "spec", "spec", "check"]  # the window of 3 fires, then one plain step
    ev = pol.events[0]
    assert ev["reason"].startswith("collapse: observed goodput ratio") and ev["new_state"] == "fallback"
    assert ev["old_state"] == "check" and ev["step"] == 3 and ev["plain_seconds"] == 1.0
    assert ev["goodput_ratio"] == pytest.approx(2 * 3 * 1.0 / 9.0)


def test_goodput_slow_spell_is_not_a_collapse():
    """Every step, plain ones included, takes 3x what the cost model says (a slow spell of a shared
    machine): the window looks collapsed against the stale plain estimate, but the plain step that
    re-measures plain clears it and the request keeps speculating."""
    pol, states = _drive_high_acceptance(12, 3.0, 3.0, stop_at_event=False)
    assert states[:4] == ["spec", "spec", "spec", "check"] and states[4:8] == ["spec", "spec", "spec", "check"]
    assert [e["new_state"] for e in pol.events] == ["spec"] * 3
    ev = pol.events[0]
    assert ev["reason"].startswith("no collapse") and ev["old_state"] == "check" and ev["step"] == 3
    assert ev["goodput_ratio"] == pytest.approx(2 * 3 * 3.0 / 9.0) and ev["plain_seconds"] == 3.0
    assert pol.summary()["fallback_request_steps"] == 0


def test_goodput_young_request_judged_by_the_decoder_wide_statistics():
    """One early rejection of a request whose drafter pays decoder-wide does not make it fall back:
    until it has drafted _YOUNG times it is planned with the decoder-wide statistics. A drafter that
    does not pay decoder-wide falls back at once, and so does the young request that keeps failing."""
    def policy(global_accepted):
        cost = SyntheticCost(lambda b, n: 1.0 + 0.05 * (n - 1), lambda b, k: 0.5 * k)  # a costly draft
        pol = GoodputPolicy(max_depth=6, cost=cost)
        pol.begin(1)
        for _ in range(20):
            pol.global_stats.observe(4, global_accepted)
        pol._request(0).stats.observe(4, 0)  # the request's first draft: rejected at position 1
        return pol

    pol = policy(4)
    plan = pol.plan([0], [100])
    assert plan.states == ["spec"] and plan.k > 0 and not pol.events
    plans = run_steps(pol, [0], 100, lambda s, rid, k: 0, 6)  # it keeps failing
    falls = [e for e in pol.events if e["new_state"] == "fallback"]
    assert len(falls) == 1 and "predicted goodput ratio" in falls[0]["reason"]
    assert pol.requests[0].stats.observations == 0  # reset on fallback, after 4 of its own (scheduler._YOUNG)
    assert sum(p.k > 0 for p in plans) == 3
    pol = policy(0)
    plan = pol.plan([0], [100])
    assert plan.states == ["fallback"] and plan.k == 0 and pol.events[0]["new_state"] == "fallback"


def test_goodput_probe_that_accepts_resumes_a_drafter_that_pays():
    """A draft token costs 60 % of a target step (a draft model), so the prior (0.5) predicts a loss
    and the first step falls back; every drafted token is then accepted. The first probe must resume
    speculation for good: with a prior of 0 after the fallback, a probe's full acceptance (2 of 2)
    read as alpha 0.67, below what pays at that draft price, and the request never drafted again."""
    cost = SyntheticCost(lambda b, n: 1.0 + 0.05 * (n - 1), lambda b, k: 0.6 * k)
    pol = GoodputPolicy(max_depth=4, cost=cost)
    pol.begin(1)
    plans = run_steps(pol, [0], 100, lambda s, rid, k: k, 30)
    assert plans[0].states == ["fallback"]
    first = next(i for i, p in enumerate(plans) if p.states == ["probe"])
    assert first <= 4 and all(p.states == ["spec"] for p in plans[first + 1:])
    assert plans[-1].k == 4
    # a useless drafter next to it in a batch keeps its low prior: its probes, which ride along at
    # no cost, do not make it speculate for good (the good row's acceptance is not its evidence)
    pol.begin(2)
    plans = run_steps(pol, [1, 2], 100, lambda s, rid, k: k if rid == 1 else 0, 40)
    assert sum(p.states[1] == "fallback" for p in plans) >= 25
    assert all(p.states[0] == "spec" for p in plans[1:])


def test_goodput_lucky_probes_followed_by_collapses_back_off():
    """Every probe is accepted in full, but speculative steps then take 3x what the cost model says
    (a draft as slow as the target): the request collapses after each resume. The backoff must keep
    growing across these cycles (it is reset only after a full window of speculation that paid)."""
    pol = GoodputPolicy(max_depth=4, cost=flat_cost(), window=3, max_backoff=64)
    pol.begin(1)
    for _ in range(300):
        plan = pol.plan([0], [1000])
        k = plan.k
        slow = plan.states[0] == "spec"
        pol.observe(plan, [0], pol.nodes(k), [k], [k], [k], [k + 1], StepTimes(0.0, 0.0, 0.0, 9.0 if slow else 1.0))
    falls = [e["step"] for e in pol.events if e["new_state"] == "fallback"]
    resumes = [e["step"] for e in pol.events if e["new_state"] == "spec"]
    assert len(falls) >= 3 and len(resumes) >= 2
    gaps = [r - f for f, r in zip(falls, resumes)]
    assert gaps == sorted(gaps) and gaps[-1] >= 4 * gaps[0]
    assert len(falls) <= 8  # with a backoff reset at every resume: one cycle every ~8 steps (35+)


def test_goodput_weighs_the_drafters_catch_up():
    """A drafter that must first catch up (a lazy prompt prefill) speculates only if the rows' remaining
    tokens win that price back; the price per position is learned from observed catch-ups."""
    class PricedCatchUp(SyntheticCost):
        def catch_up_seconds(self, positions):
            return 0.01 * positions

    cost = PricedCatchUp(lambda b, n: 1.0 + 0.05 * (n - 1), lambda b, k: 0.03 * k)

    def k_for(behind, budget):
        pol = GoodputPolicy(max_depth=6, cost=cost)
        pol.begin(2)
        for rid in (0, 1):
            pol._request(rid).stats = FixedAlpha(0.9)
        return pol.plan([0, 1], [budget] * 2, behind=behind).k

    assert k_for(None, 10) > 0 and k_for([0, 0], 10) > 0
    assert k_for([500, 500], 10) == 0      # 10 s of catch-up for 22 tokens: stays plain
    assert k_for([5, 5], 400) > 0          # 0.1 s won back over 800 tokens
    cm = CostModel(smoothing=0.5)
    assert cm.catch_up_seconds(100) == 0.0
    cm.observe_catch_up(2, 0.010)     # a short catch-up costs about one forward
    cm.observe_catch_up(128, 0.100)   # a prompt prefill much less per position
    assert cm.catch_up_seconds(2) == pytest.approx(0.010)
    assert cm.catch_up_seconds(128) == pytest.approx(0.100)
    assert cm.catch_up_seconds(64) == pytest.approx(0.010 + 0.090 * (64 - 2) / (128 - 2))  # between buckets
    cm2 = CostModel()
    cm2.load_state_dict(json.loads(json.dumps(cm.state_dict())))
    assert cm2.catch_up_seconds(10) == pytest.approx(cm.catch_up_seconds(10))


def test_goodput_marginal_step_pays_no_catch_up_once_informed():
    """Once the decoder-wide statistics have seen enough drafting, a step predicted to gain less than
    the probes' margin pays no catch-up: its rows fall back (probes, judged as if the drafter were
    perfect, can still pick it up). Before that, or with a clear predicted gain, only a catch-up
    that even a perfect drafter could not win back keeps the step plain."""
    class PricedCatchUp(SyntheticCost):
        def catch_up_seconds(self, positions):
            return 0.01 * positions

    def plan_for(observations, draft_cost):
        cost = PricedCatchUp(lambda b, n: 1.0 + 0.05 * (n - 1), lambda b, k: draft_cost * k)
        pol = GoodputPolicy(max_depth=6, cost=cost)
        pol.begin(2)
        pol.global_stats.observations = observations
        for rid in (0, 1):
            pol._request(rid).stats = FixedAlpha(0.6)
        return pol, pol.plan([0, 1], [40] * 2, behind=[40, 40])

    pol, plan = plan_for(0, 0.5)  # a slow draft: predicted ~1.02x per step
    assert plan.k > 0 and plan.states == ["spec", "spec"] and 1.0 < plan.predicted_ratio < 1.05
    pol, plan = plan_for(16, 0.5)
    assert plan.k == 0 and plan.states == ["fallback", "fallback"]
    assert [e["new_state"] for e in pol.events] == ["fallback", "fallback"]
    assert "catch-up" in pol.events[0]["reason"] and "predicted goodput ratio 1.0" in pol.events[0]["reason"]
    pol, plan = plan_for(16, 0.1)  # a fast draft: a clear predicted gain pays the catch-up
    assert plan.k > 0 and plan.predicted_ratio > 1.2 and not pol.events


def test_draft_model_reports_its_pending_catch_up(toy):
    target, draft, _ = toy
    dm = DraftModel(draft, k=3)
    dec = SpeculativeDecoder(target, dm, max_batch=2, max_len=64, policy="fixed")
    seen = []
    propose = dm.propose

    def spy(ctx):
        seen.append((dm.pending_catch_up([len(q) for q in ctx.sequences]), [len(q) for q in ctx.sequences]))
        out = propose(ctx)
        seen[-1] += (dm.catch_up_positions,)
        return out

    dm.propose = spy
    dec.generate(PROMPTS[:2], max_new_tokens=6)
    (pending, lengths, fed), later = seen[0], seen[1:]
    assert pending == lengths and fed == sum(lengths)   # lazy admission: the whole prompts
    assert later and all(not any(p) and f == 0 for p, _, f in later)


def test_draft_cost_is_learned_from_steps_that_catch_up():
    """A drafting step that caught up first measures its other k - 1 depths (time after the catch-up)."""
    pol = GoodputPolicy(max_depth=4, cost=CostModel())
    pol.begin(1)
    plan = pol.plan([0], [100])
    plan.budgets, plan.k = [3], 3
    pol.observe(plan, [0], 4, [3], [3], [3], [4], StepTimes(0.050, 0.020, 0.001, 0.080, catch_up=0.020))
    assert pol.cost.draft.cells[(1, 2)][0] == pytest.approx(0.030)
    assert (1, 3) not in pol.cost.draft.cells


def test_goodput_rows_of_one_batch_get_different_k():
    pol = GoodputPolicy(max_depth=5, cost=flat_cost())
    pol.begin(2)
    plans = run_steps(pol, [0, 1], 100, lambda s, rid, k: k if rid == 0 else 0, 30)
    mixed = [p for p in plans if p.budgets[0] == 5 and p.budgets[1] == 0]
    assert len(mixed) >= 20
    assert any(p.states == ["spec", "probe"] and p.budgets == [5, 5] for p in plans)  # a free probe rides along


def test_heuristic_rule_and_fixed():
    pol = HeuristicPolicy(max_depth=10, cost=flat_cost())
    pol.begin(1)
    pol._request(0).k = 4
    ks = []
    for accept_all in (True, True, False, False, True):
        plan = pol.plan([0], [100])
        ks.append(plan.k)
        a = plan.k if accept_all else 0
        pol.observe(plan, [0], plan.k + 1, [plan.k], [plan.k], [a], [a + 1], times())
    assert ks == [4, 6, 8, 7, 6]
    assert pol.plan([0], [100]).k == 8 and pol.plan([0], [3]).k == 3  # budget caps it
    fixed = FixedPolicy(max_depth=7, cost=flat_cost())
    fixed.begin(2)
    assert fixed.plan([0, 1], [100, 2]).budgets == [7, 2]


def test_make_policy_errors():
    with pytest.raises(ValueError, match=r"policy must be one of \('fixed', 'heuristic', 'goodput'\).*got 'fast'"):
        make_policy("fast", None)
    with pytest.raises(ValueError, match=r"got 3"):
        make_policy(3, None)
    with pytest.raises(ValueError, match=r"GoodputPolicy: collapse_ratio must lie in \(0, 1\], got 1.5"):
        GoodputPolicy(4, collapse_ratio=1.5)
    with pytest.raises(ValueError, match=r"GoodputPolicy: max_depth must be >= 1, got 0"):
        GoodputPolicy(0)
    with pytest.raises(ValueError, match=r"AcceptanceStats: decay must lie in \(0, 1\], got 0"):
        AcceptanceStats(decay=0.0)


# ============================================================================ the loop (toy LM)
class ChainDrafter(Drafter):
    """Chains from ``fn(step, request, sequence, budget) -> tokens`` (at most budget of them)."""

    def __init__(self, fn, k: int) -> None:
        self.fn = fn
        self.k = k
        self.max_nodes = k + 1
        self.calls = 0
        self.budgets: List[List[int]] = []

    def start(self, prompts, params, generator) -> None:
        self.prompts = [list(p) for p in prompts]

    def propose(self, ctx: StepContext) -> Draft:
        self.budgets.append(list(ctx.budgets))
        rows = []
        for rid, seq, budget in zip(ctx.request_ids, ctx.sequences, ctx.budgets):
            toks = list(self.fn(self.calls, rid, seq, budget))[:max(0, min(budget, self.k))]
            rows.append([seq[-1]] + toks)
        self.calls += 1
        N = max(len(r) for r in rows)
        tokens = torch.tensor([r + [-1] * (N - len(r)) for r in rows])
        return Draft(TokenTree.chain(tokens, [len(r) for r in rows]))


PROMPTS = [[1, 2, 3, 4, 5], [3, 3], [7, 1, 2, 9, 4, 4, 4, 2], [0]]
NEW = 40


@pytest.fixture(scope="module")
def toy():
    torch.set_num_threads(1)
    target = ToyLM(vocab=16, seed=0)
    draft = ToyLM(vocab=16, seed=1, hidden=16, layers=1, heads=2, kv_heads=1)
    refs = [target.greedy(p, NEW) for p in PROMPTS]
    return target, draft, refs


def oracle(refs, prompts):
    def future(rid, seq, budget):
        done = len(seq) - len(prompts[rid])
        return refs[rid][done:done + budget]
    return future


def useless(seed: int = 0):
    rng = random.Random(seed)
    return lambda *a: [rng.randrange(16) for _ in range(16)]


class Schedule(Policy):
    """Test policy: a fixed per-step schedule of depths (0 = plain step), per row."""

    name = "schedule"

    def __init__(self, depths: Callable[[int, int], int], max_depth: int) -> None:
        super().__init__(max_depth)
        self.depths = depths

    def _budgets(self, request_ids, reqs, budgets):
        out = [min(self.depths(self.step_index, r), x) for r, x in enumerate(budgets)]
        return StepPlan(out, ["spec"] * len(out), [1.0] * len(out))


@pytest.mark.parametrize("policy", ["fixed", "heuristic", "goodput", "goodput-flat"])
@pytest.mark.parametrize("name", ["small-draft", "draft-tree", "draft-stop", "lookup", "useless"])
def test_greedy_equals_target_greedy_under_every_policy(toy, policy, name):
    target, draft, refs = toy
    drafter = {"small-draft": lambda: DraftModel(draft, k=3), "draft-tree": lambda: DraftModel(draft, k=3, top_k=2),
               "draft-stop": lambda: DraftModel(draft, k=4, stop_threshold=0.5),
               "lookup": lambda: PromptLookup(ngram=2, k=4),
               "useless": lambda: ChainDrafter(lambda s, rid, seq, b: useless(s)(), k=6)}[name]()
    pol = GoodputPolicy(drafter.k, cost=flat_cost()) if policy == "goodput-flat" else policy
    dec = SpeculativeDecoder(target, drafter, max_batch=4, max_len=64, policy=pol)
    for _ in range(2):  # the second call starts from the first call's statistics
        out = dec.generate(PROMPTS, max_new_tokens=NEW)
        assert out.tokens == refs
    assert out.metrics["policy"] == (policy if policy != "goodput-flat" else "goodput")


@pytest.mark.parametrize("tree", [1, 2])
def test_draft_model_per_row_depths_and_catch_up_after_plain_steps(toy, tree):
    """A schedule of plain steps (the draft model is not run) and per-row depths: output stays exact."""
    target, draft, refs = toy

    def depths(step, row):
        if step % 7 in (1, 2, 3):  # three plain steps in a row: the draft cache falls 3 tokens behind
            return 0
        return (step + row) % 4   # rows of one step get different depths, some 0

    for drafter in (DraftModel(draft, k=3, top_k=tree), DraftModel(target, k=3, top_k=tree)):
        dec = SpeculativeDecoder(target, drafter, max_batch=4, max_len=64, policy=Schedule(depths, 3))
        out = dec.generate(PROMPTS, max_new_tokens=NEW, trace=True)
        assert out.tokens == refs
        recs = [r for r in out.trace if r["type"] == "step"]
        assert any(r["k"] != s["k"] and r["step"] == s["step"] and r["k"] and s["k"] for r in recs for s in recs)
        for r in recs:
            assert r["depth"] <= r["k"]
        if drafter.lm is target:  # a draft equal to the target: every allowed token is accepted
            assert all(r["accepted"] == min(r["k"], NEW - 1) or r["emitted"] < r["accepted"] + 1 for r in recs)


def test_goodput_falls_back_on_useless_drafter_in_the_loop(toy):
    target, _, refs = toy
    drafter = ChainDrafter(lambda s, rid, seq, b: useless(s)(), k=8)
    dec = SpeculativeDecoder(target, drafter, max_batch=4, max_len=64, policy=GoodputPolicy(8, cost=flat_cost()))
    out = dec.generate(PROMPTS, max_new_tokens=NEW, trace=True)
    assert out.tokens == refs
    m = out.metrics
    steps = m["target_passes"]
    assert m["fallback_request_steps"] > 0.7 * sum(m["per_request"]["target_passes"])
    assert m["drafted_tokens"] < 0.25 * 8 * sum(m["per_request"]["target_passes"])
    summ = summarize_trace(out.trace)
    assert summ["state_steps"].get("probe", 0) >= 1 and summ["steps"] == steps
    fixed = SpeculativeDecoder(target, ChainDrafter(lambda s, rid, seq, b: useless(s)(), k=8), max_batch=4,
                               max_len=64, policy="fixed").generate(PROMPTS, max_new_tokens=NEW)
    assert fixed.tokens == refs and fixed.metrics["drafted_tokens"] > 4 * m["drafted_tokens"]


def test_goodput_picks_speculation_back_up_in_the_loop(toy):
    target, _, refs = toy
    fut = oracle(refs, PROMPTS)
    drafter = ChainDrafter(lambda s, rid, seq, b: useless(s)() if s < 8 else fut(rid, seq, b), k=5)
    dec = SpeculativeDecoder(target, drafter, max_batch=4, max_len=80, policy=GoodputPolicy(5, cost=flat_cost()))
    out = dec.generate(PROMPTS, max_new_tokens=NEW, trace=True)
    assert out.tokens == refs
    ev = [e for e in out.trace if e["type"] == "event"]
    assert any(e["new_state"] == "fallback" for e in ev)
    back = [e["step"] for e in ev if e["new_state"] == "spec" and e["old_state"] == "fallback"]
    assert back and min(back) >= 8  # the drafter turns useful at its 9th call
    late = [r for r in out.trace if r["type"] == "step" and r["step"] > max(back)]
    assert late and all(r["state"] == "spec" for r in late)
    assert sum(r["accepted"] for r in late) > 0.8 * sum(r["k"] for r in late)


def test_rows_of_one_batch_get_different_k_in_the_loop(toy):
    target, _, refs = toy
    fut = oracle(refs, PROMPTS)
    drafter = ChainDrafter(lambda s, rid, seq, b: fut(rid, seq, b) if rid < 2 else useless(s)(), k=4)
    # steps cost more with more rows (as on a CPU), so that in this closed batch (a generate call) rows
    # 0 and 1 finishing early pays through the cheaper steps of the two rows left
    cost = SyntheticCost(lambda b, n: 0.5 + 0.25 * b + 0.02 * b * (n - 1), lambda b, k: 0.03 * k)
    dec = SpeculativeDecoder(target, drafter, max_batch=4, max_len=64, policy=GoodputPolicy(4, cost=cost))
    out = dec.generate(PROMPTS, max_new_tokens=NEW, trace=True)
    assert out.tokens == refs
    mixed = [b for b in drafter.budgets if len(b) == 4 and b[0] == 4 and b[1] == 4 and b[2] == 0 and b[3] == 0]
    assert len(mixed) >= 3


def test_trace_and_summary_schema(toy, tmp_path):
    target, draft, refs = toy
    dec = SpeculativeDecoder(target, DraftModel(draft, k=3), max_batch=4, max_len=64)
    path = tmp_path / "trace.jsonl"
    out = dec.generate(PROMPTS, max_new_tokens=12, trace=str(path))
    assert out.tokens == [r[:12] for r in refs]
    assert read_trace(path) == json.loads(json.dumps(out.trace))
    steps = [r for r in out.trace if r["type"] == "step"]
    assert steps and all(tuple(r) == TRACE_STEP_KEYS for r in steps)
    for r in out.trace:
        if r["type"] == "event":
            assert set(TRACE_EVENT_KEYS) <= set(r)
    for key in POLICY_KEYS:
        assert key in out.metrics, key
    assert out.metrics["policy"] == "goodput"
    assert sum(r["emitted"] for r in steps) == 4 * 12 - 4  # the first token of each request comes from prefill
    assert dec.generate(PROMPTS[:1], max_new_tokens=3).trace is None
    plain = SpeculativeDecoder(target, None, max_batch=4, max_len=64).generate(PROMPTS, max_new_tokens=5, trace=True)
    assert plain.metrics["policy"] == "none" and all(r["k"] == 0 for r in plain.trace)


def test_summarize_trace_arithmetic_on_a_hand_made_trace():
    def step(s, rid, state, k, depth, acc, emitted, secs):
        return dict(type="step", step=s, request=rid, row=rid, batch=2, state=state, k=k, nodes=k + 1, depth=depth,
                    drafted=depth, accepted=acc, emitted=emitted, expected_tokens=1.0, predicted_goodput_ratio=1.0,
                    draft_seconds=secs[0], verify_seconds=secs[1], commit_seconds=secs[2], step_seconds=secs[3],
                    plain_seconds_estimate=0.1)
    trace = [
        step(0, 0, "spec", 3, 3, 2, 3, (0.1, 0.2, 0.01, 0.4)), step(0, 1, "spec", 3, 3, 0, 1, (0.1, 0.2, 0.01, 0.4)),
        dict(type="event", step=0, request=1, reason="collapse", old_state="spec", new_state="fallback",
             goodput_ratio=0.5),
        step(1, 0, "spec", 2, 2, 2, 3, (0.05, 0.2, 0.01, 0.3)), step(1, 1, "fallback", 0, 0, 0, 1,
                                                                       (0.05, 0.2, 0.01, 0.3)),
    ]
    s = summarize_trace(trace)
    assert s["steps"] == 2 and s["request_steps"] == 4 and s["tokens"] == 8
    assert s["seconds"] == pytest.approx(dict(draft=0.15, verify=0.4, commit=0.02, step=0.7))
    assert s["goodput_tokens_per_second"] == pytest.approx(8 / 0.7)
    assert s["k_per_step"] == [3, 2]
    assert s["accepted_per_position"] == pytest.approx([2 / 3, 2 / 3, 0.0])
    assert s["state_steps"] == {"spec": 3, "fallback": 1}
    assert s["per_request"][1] == dict(tokens=2, drafted=3, accepted=0, fallback_steps=1, probe_steps=0)
    assert len(s["events"]) == 1


def test_decoder_policy_errors(toy):
    target, draft, _ = toy
    with pytest.raises(ValueError, match=r"SpeculativeDecoder: policy must be one of .*got 'fastest'"):
        SpeculativeDecoder(target, DraftModel(draft, k=2), policy="fastest")
    with pytest.raises(ValueError, match=r"policy must be one of"):
        SpeculativeDecoder(target, None, policy=None)


def test_calibration_is_cached(toy, tmp_path, monkeypatch):
    target, draft, refs = toy
    monkeypatch.setenv("SPECDEC_CACHE", str(tmp_path))
    dec = SpeculativeDecoder(target, DraftModel(draft, k=3), max_batch=2, max_len=64, calibrate=True)
    out = dec.generate(PROMPTS[:2], max_new_tokens=10)
    assert out.tokens == [r[:10] for r in refs[:2]]
    store = json.loads((tmp_path / "calibration.json").read_text())
    (key, cells), = store.items()
    assert "ToyLM" in key and "threads=1" in key
    assert {"1,1", "2,1", "1,4", "2,4"} <= set(cells)
    # a second decoder loads the cells instead of timing again (the file is not rewritten)
    mtime = (tmp_path / "calibration.json").stat().st_mtime_ns
    dec2 = SpeculativeDecoder(target, DraftModel(draft, k=3), max_batch=2, max_len=64, calibrate=True)
    dec2.generate(PROMPTS[:1], max_new_tokens=2)
    assert (tmp_path / "calibration.json").stat().st_mtime_ns == mtime
    assert dec2.scheduler.cost.verify.observed(b=2, x=4)


# ============================================================================ sampling stays exact
@pytest.mark.parametrize("name", ["draft-goodput", "lookup-goodput", "draft-heuristic", "draft-schedule",
                                  "tree-schedule"])
def test_sampled_distribution_is_exact_under_policies(name):
    """The first three sampled tokens follow the target's warped distribution (TV bound as in
    tests/test_decoding.py) while the policy changes k from step to step and row to row."""
    from test_decoding import _exact_first3, _tv_bound
    from collections import Counter

    temperature, top_k, top_p = 0.7, 5, 0.9
    target = ToyLM(vocab=8, seed=3, scale=1.0, hidden=16, heads=2, kv_heads=1)
    draft = ToyLM(vocab=8, seed=4, scale=1.0, hidden=16, layers=1, heads=2, kv_heads=1)
    prompt = [1, 2, 3, 1, 2, 3, 1, 2]
    kind, pol = name.split("-")
    drafter = {"draft": lambda: DraftModel(draft, k=3), "lookup": lambda: PromptLookup(ngram=2, k=3, min_ngram=1),
               "tree": lambda: DraftModel(draft, k=3, top_k=2)}[kind]()
    # rows differ (row parity) and steps alternate plain / speculative: the draft cache catches up
    schedule = Schedule(lambda step, row: 0 if step % 3 == 1 else 1 + (row + step) % 3, 3)
    policy = {"goodput": lambda: GoodputPolicy(3, cost=flat_cost()), "heuristic": lambda: "heuristic",
              "schedule": lambda: schedule}[pol]()
    exact = _exact_first3(target, prompt, temperature, top_k, top_p)
    per_call, calls = 4000, 4
    n = per_call * calls
    dec = SpeculativeDecoder(target, drafter, max_batch=per_call, max_len=len(prompt) + 6, policy=policy)
    counts: Counter = Counter()
    ks = set()
    for seed in range(calls):
        out = dec.generate([prompt] * per_call, max_new_tokens=6, temperature=temperature, top_k=top_k,
                           top_p=top_p, seed=1000 * seed + 7)
        counts.update(tuple(t[:3]) for t in out.tokens)
        ks.update(int(k) for k in out.metrics["chosen_k_histogram"])
    assert set(counts) <= set(exact), "sampled a sequence outside the warped support"
    tv = 0.5 * sum(abs(counts.get(x, 0) / n - p) for x, p in exact.items())
    bound = _tv_bound(exact, n)
    assert tv < bound, f"TV {tv:.4f} >= bound {bound:.4f} with {n} samples over {len(exact)} outcomes"
    assert len(ks) >= 2 and max(ks) > 0, f"the policy never varied k: {ks}"


# ============================================================================ specdec bench (no model)
def test_bench_method_parsing_and_errors():
    from specdec.bench import parse_method, parse_runs

    assert parse_method("lookup:4@fixed") == ("lookup", 4, "fixed")
    assert parse_method("w8") == ("w8", None, "goodput")
    assert parse_method("plain") == ("plain", None, "none")
    assert parse_runs("grounded:lookup@goodput, lookup:4@fixed;open:random:8@fixed") == {
        "grounded": ["lookup@goodput", "lookup:4@fixed"], "open": ["random:8@fixed"]}
    with pytest.raises(ValueError, match=r"method 'medusa:4': drafter must be one of .*got 'medusa'"):
        parse_method("medusa:4")
    with pytest.raises(ValueError, match=r"method 'w8:x': k must be an int, got 'x'"):
        parse_method("w8:x")
    with pytest.raises(ValueError, match=r"policy must be fixed, heuristic or goodput, got 'best'"):
        parse_method("w8:4@best")
    with pytest.raises(ValueError, match=r"--runs entry 'poems:w8' must be 'SET:METHOD,...'"):
        parse_runs("poems:w8")


def test_random_drafter_is_useless_but_exact(toy):
    from specdec.bench import RandomDrafter

    target, _, refs = toy
    dec = SpeculativeDecoder(target, RandomDrafter(k=6), max_batch=4, max_len=64, policy="fixed")
    out = dec.generate(PROMPTS, max_new_tokens=NEW)
    assert out.tokens == refs
    assert out.metrics["drafted_tokens"] > 0 and out.metrics["acceptance_rate"] < 0.3


def test_bench_dashboard_and_table_from_a_result(tmp_path):
    pytest.importorskip("matplotlib")  # in requirements.txt; the optional extra "bench" of the package
    from specdec.bench import format_table, write_dashboard

    def row(drafter, k, policy, tps, ratio, trace=None):
        r = dict(drafter=drafter, k=k, policy=policy, runs=2, tokens_per_second_median=tps,
                 speedup_vs_plain_median=ratio, speedup_vs_hf_median=None, same_output_as_plain="2/2",
                 acceptance_rate=0.6, mean_accepted_length=2.0, accepted_per_position=[0.8, 0.6, 0.5],
                 draft_seconds=0.1, verify_seconds=0.5, commit_seconds=0.01, prefill_seconds=0.05,
                 total_seconds=0.8, chosen_k_histogram={"3": 4}, mean_chosen_k=3.0, fallback_request_steps=1,
                 policy_events=1, expected_tokens_predicted=2.0, expected_tokens_observed=2.1)
        if trace:
            r["trace_k_per_step"] = trace
        return r

    result = dict(summary={"open/b1": {
        "plain": dict(drafter="plain", k=None, policy="none", runs=2, tokens_per_second_median=10.0,
                      speedup_vs_plain_median=1.0, speedup_vs_hf_median=None, same_output_as_plain="2/2"),
        "w8:3@fixed": row("w8", 3, "fixed", 12.0, 1.2), "w8:6@fixed": row("w8", 6, "fixed", 11.0, 1.1),
        "w8:8@goodput": row("w8", 8, "goodput", 12.5, 1.25, trace=[0, 8, 3, 3, 0, 4])}},
        machine=dict(cpu="test", torch_threads=1, loadavg_start=[1, 1, 1], loadavg_end=[1, 1, 1]),
        settings=dict(model="toy", max_new_tokens=8, rounds=2, batches=[1]), date="today", git_commit="abc")
    path = tmp_path / "dash.png"
    write_dashboard(result, path)
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 20_000
    table = format_table(result)
    assert "w8:8@goodput" in table and "1.25x" in table


def test_bench_ratios_pair_each_repetition_with_its_own_plain_run():
    from specdec.bench import summarize as _summarize

    def rec(method, rep, tps, r=0):
        return dict(method=method, unit=0, round=r, rep=rep, new_tokens=8, seconds=8 / tps, tokens_per_second=tps,
                    tokens=[[1, 2]], metrics={})

    # a slow spell hits repetitions 1 and 2 of round 0: plain and goodput alike
    rows = [rec("plain", 0, 10.0), rec("w8:8@goodput", 0, 9.0), rec("w8:4@fixed", 0, 5.0),
            rec("plain", 1, 5.0), rec("w8:8@goodput", 1, 4.5),
            rec("plain", 2, 5.0), rec("w8:8@goodput", 2, 4.5)]
    methods = [("plain", None, "none"), ("w8", 8, "goodput"), ("w8", 4, "fixed")]
    out = _summarize({"open/b4": rows}, {}, [("open", 4, [[[1]]], methods)])["summary"]["open/b4"]
    assert out["w8:8@goodput"]["runs"] == 3
    assert out["w8:8@goodput"]["speedup_vs_plain_median"] == pytest.approx(0.9)
    assert out["w8:4@fixed"]["speedup_vs_plain_median"] == pytest.approx(0.5)   # against repetition 0 only
    assert out["plain"]["runs"] == 3 and out["w8:4@fixed"]["same_output_as_plain"] == "1/1"


@pytest.mark.parametrize("argv, message", [
    (["--repeats", "0"], "repeats must be an int >= 1, got 0"),
    (["--batches", "0"], "batches must be ints >= 1"),
    (["--runs", "nosuchset:plain"], "--runs entry 'nosuchset:plain' must be 'SET:METHOD,...'"),
], ids=["repeats", "batches", "set"])
def test_bench_cli_rejects_bad_arguments_before_loading_a_model(argv, message, capsys):
    from specdec.bench import main

    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: specdec bench: ") and message in err


def test_cost_table_memo_follows_every_change():
    """_CostTable memoises each b's sorted cells and level between changes: after every observe /
    scale / load its predictions equal those of a fresh table holding the same cells (no memo)."""
    from specdec.scheduler import CostTable as _CostTable

    rng = random.Random(3)
    for trial in range(40):
        kw = dict(smoothing=0.25, zero_at_zero=trial % 2 == 0, single=("constant", "proportional")[trial % 3 == 0])
        t = _CostTable(**kw)
        for _ in range(25):
            change = rng.random()
            if change < 0.8:
                t.observe(rng.randint(1, 4), rng.randint(0, 16), rng.random() * 0.05)
            elif change < 0.9:
                t.scale(0.5 + rng.random())
            else:
                t.load({"2,3": [rng.random() * 0.05, 2.0]})
            fresh = _CostTable(**kw)
            fresh.load(t.state())
            for _ in range(8):
                b, x = rng.randint(1, 5), rng.randint(0, 20)
                assert t.predict(b, x) == fresh.predict(b, x), (trial, b, x)


def test_records_carry_no_machine_paths():
    """A record names paths inside the repository relative to it and any other absolute path by its last part
    (a head's config.json records the command that made it, output folder included)."""
    import os

    from specdec.bench.record import record_path, scrub_paths

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    inside = os.path.join(root, "specdec", "ops.py")
    assert record_path(inside) == os.path.join("specdec", "ops.py")
    got = scrub_paths({"command": ["specdec", "train-head", "--out", "/somewhere/else/run1", "--steps", 3],
                       "file": inside, "note": "a relative/path stays", "n": 1.5})
    assert got == {"command": ["specdec", "train-head", "--out", "run1", "--steps", 3],
                   "file": os.path.join("specdec", "ops.py"), "note": "a relative/path stays", "n": 1.5}
