"""MultiDraft escalation: the price check (specdec.drafters.pay_gate) -- the decision rule on its own, and in the
loop a later member that adds nothing stops drafting while one that adds tokens keeps drafting -- and the steps
with one proposing member, verified without a merge. Greedy output exact throughout."""
from __future__ import annotations

import pytest

from specdec import CallableDrafter, MultiDraft, SpeculativeDecoder
from specdec.drafters.multi_merge import merge_drafts
from specdec.drafters.pay_gate import ALONE, BESIDE, PayGate

from test_decoding import TOY_PROMPTS
from toy_lm import ToyLM


def _steps(plain=1.0, per_node=0.1):
    """Seconds of a step without drafting by nodes per row: a plain step, then a linear price per node."""
    return lambda n: plain + per_node * (n - 1)


def test_gate_rule_alone():
    gate = PayGate(2)
    steps = _steps()
    assert gate.allow(7, 1, ALONE, 0, 2, steps)        # nothing measured: the member drafts (that is how it is)
    gate.timed(1, 0.2)
    assert gate.allow(7, 1, ALONE, 0, 2, steps)        # a price but no gain yet
    gate.observe(7, 1, ALONE, True, 0, 0)               # it drafted and added nothing
    # price = (0.2 s + 2 nodes x 0.1 s) / 1 s = 0.4 plain steps > gain 0: skipped, re-probed after 4 skips
    assert [gate.allow(7, 1, ALONE, 0, 2, steps) for _ in range(5)] == [False] * 4 + [True]
    assert gate.skips == 4
    # the next wait is 8 skips, then 16 at most
    assert [gate.allow(7, 1, ALONE, 0, 2, steps) for _ in range(9)] == [False] * 8 + [True]
    assert gate.cost(1, 0, 2, steps) == pytest.approx(0.4)
    assert gate.cost(0, 0, 2, steps) is None            # member 0 never timed
    assert gate.allow(7, 1, ALONE, 0, 2, None)          # no cost model yet: drafts
    assert [gate.allow(7, 1, ALONE, 0, 2, steps) for _ in range(17)] == [False] * 16 + [True]
    assert [gate.allow(7, 1, ALONE, 0, 2, steps) for _ in range(17)] == [False] * 16 + [True]
    # a gain that pays (0.6 > 0.4) resets the wait
    gate.observe(7, 1, ALONE, True, 3, 0)               # average 0.8 x 0 + 0.2 x 3 = 0.6
    assert gate.allow(7, 1, ALONE, 0, 2, steps)
    assert gate.rows[7][1].wait == 4 and gate.rows[7][1].skipped == 0


def test_gate_prices_on_steady_steps():
    """The price is learnt from steady steps (the member drafted for the row the step before); a step after
    one it did not draft (its forward inside the catch-up) is kept apart and prices the member only until a
    steady step is measured. steady_price=False: every step prices it (the caller subtracts the catch-up), the
    gate of before, for A/B runs."""
    gate = PayGate(2)
    steps = _steps()
    assert not gate.behind(4, 1)                         # a new request: steady
    gate.mark(4, 1, False)                               # a step it did not draft: its next one is behind
    assert gate.behind(4, 1)
    gate.timed(1, 0.5, behind=True)
    assert gate.cost(1, 0, 2, steps) == pytest.approx(0.7)   # no steady step yet: the behind price
    gate.timed(1, 0.1)
    assert gate.cost(1, 0, 2, steps) == pytest.approx(0.3)   # steady measured: it prices every row
    gate.timed(1, 0.9, behind=True)
    assert gate.cost(1, 0, 2, steps) == pytest.approx(0.3) and gate.secs_behind[1] == pytest.approx(0.62)
    gate.mark(4, 1, True)
    assert not gate.behind(4, 1)
    old = PayGate(2)
    old.steady_price = False
    old.timed(1, 0.1)
    old.timed(1, 0.2, behind=True)                       # one price over every step
    assert old.secs_behind[1] is None and old.cost(1, 0, 2, steps) == pytest.approx(0.33)


def test_gate_rule_beside_weighs_the_goodput_without_the_member():
    gate = PayGate(2)
    steps = _steps(plain=1.0, per_node=0.1)
    gate.timed(1, 0.1)
    # beside 4 earlier nodes that got 3 tokens per step: without the member a step emits 4 tokens in
    # 1.4 plain steps; with it 4 + gain in 1.4 + 0.3 (0.1 s + 2 nodes x 0.1 s): pays iff gain x 1.4 >= 0.3 x 4
    gate.observe(3, 1, BESIDE, True, 1, 3)
    assert gate.rows[3][1].base == 3 and gate.rows[3][1].gain[BESIDE] == 1
    assert gate.allow(3, 1, BESIDE, 4, 2, steps)        # 1.4 >= 1.2
    # a dip within the average's spread still drafts: gain 0.8 (1.12 < 1.2), but 0.8 + sqrt(0.8 x 0.2 / 1.8)
    # does pay; so does 0.64 (+ 0.27: 1.27); 0.512 (+ 0.24: 1.05 < 1.2) is clearly short: skipped
    gate.observe(3, 1, BESIDE, True, 0, 3)
    assert gate.rows[3][1].gain[BESIDE] == pytest.approx(0.8)
    assert gate.allow(3, 1, BESIDE, 4, 2, steps)
    gate.observe(3, 1, BESIDE, True, 0, 3)
    assert gate.allow(3, 1, BESIDE, 4, 2, steps)
    gate.observe(3, 1, BESIDE, True, 0, 3)
    assert gate.rows[3][1].gain[BESIDE] == pytest.approx(0.512)
    assert not gate.allow(3, 1, BESIDE, 4, 2, steps)
    # the same gain ALONE pays (0.8 >= 0.3): the situations are kept apart
    gate.observe(3, 1, ALONE, True, 0, 0)
    gate.observe(3, 1, ALONE, True, 4, 0)
    assert gate.allow(3, 1, ALONE, 0, 2, steps)
    # a step the member did not draft teaches the base only
    gate.observe(3, 1, BESIDE, False, 0, 8)
    assert gate.rows[3][1].base == pytest.approx(4) and gate.rows[3][1].gain[BESIDE] == pytest.approx(0.512)


def test_gate_new_requests_start_from_the_decoder_wide_record():
    gate = PayGate(2)
    gate.timed(1, 0.5)
    for _ in range(3):
        gate.observe(1, 1, ALONE, True, 0, 0)
    gate.reset()                                        # a new generate call: requests go, the record stays
    assert 1 not in gate.rows
    assert not gate.allow(2, 1, ALONE, 0, 1, _steps())  # a new request starts from the member's record
    gate.keep([5])
    assert list(gate.rows) == [5]


@pytest.fixture(scope="module")
def toy():
    target = ToyLM(vocab=12, seed=0)
    refs = SpeculativeDecoder(target, None, max_batch=4, max_len=64).generate(TOY_PROMPTS[:2],
                                                                               max_new_tokens=32).tokens
    return target, refs


def _drafting_rows(drafter) -> list:
    """Per propose call of ``drafter``: the rows it was asked to draft for (budget > 0)."""
    calls = []
    propose = drafter.propose

    def spy(ctx):
        calls.append(sum(1 for x in ctx.budgets if x > 0))
        return propose(ctx)

    drafter.propose = spy
    return calls


def test_gate_in_the_loop(toy):
    """Behind a first member that never proposes, a junk member (never accepted) drafts on nearly every step
    without the gate and only on its probes with it; an oracle member (the target's own continuation) drafts
    on every step either way. Greedy output equals the target's in every case."""
    target, refs = toy
    prompts = TOY_PROMPTS[:2]
    full = {tuple(p): r for p, r in zip(prompts, refs)}

    def oracle(ctx):
        for p, r in full.items():
            if list(ctx[:len(p)]) == list(p):
                done = len(ctx) - len(p)
                return [r[done:done + 3]] if done < len(r) else []
        return []

    def junk(ctx):  # a token the target never picks after ctx[-1] on these prompts
        seen = {(a, b) for p, r in full.items() for a, b in zip((list(p) + r)[len(p) - 1:], r)}
        return [[next(t for t in range(12) if (ctx[-1], t) not in seen)] * 3]

    counts = {}
    for name, fn in (("junk", junk), ("oracle", oracle)):
        for gate in (True, False):
            member = CallableDrafter(fn, max_nodes=4, name=name)
            rows = _drafting_rows(member)
            multi = MultiDraft([CallableDrafter(lambda ctx: [], max_nodes=4, name="empty"), member], escalate=2.0,
                               gate=gate)
            dec = SpeculativeDecoder(target, multi, max_batch=2, max_len=64, policy="fixed")
            out = dec.generate(prompts, max_new_tokens=32)
            assert out.tokens == refs
            counts[name, gate] = sum(rows)
            if name == "junk":
                assert out.metrics["accepted_tokens"] == 0
    # junk: 32 steps per row, the first two wait for the empty member (trusted once); with the gate the
    # member drafts until it is measured, then only on its re-probes (after 4, 8, 16 skipped steps)
    assert counts["junk", False] >= 2 * 24
    assert counts["junk", True] <= 2 * 7, counts
    # the oracle pays: the gate lets it draft (its chains make the rows finish in fewer steps)
    assert counts["oracle", True] == counts["oracle", False], counts


def test_gate_only_with_escalation():
    def pair():
        return [CallableDrafter(lambda ctx: []), CallableDrafter(lambda ctx: [])]

    assert MultiDraft(pair()).gate is None
    assert MultiDraft(pair(), escalate=1.0, gate=False).gate is None
    assert isinstance(MultiDraft(pair(), escalate=1.0).gate, PayGate)


def test_single_member_steps_skip_the_merge(toy, monkeypatch):
    """With escalation most steps have one proposing member: its draft is verified as it is (no host merge), the
    other members get their empty part and the accepted tokens as foreign; greedy output stays exact, and a step
    where two members propose still merges."""
    target, refs = toy
    prompts = TOY_PROMPTS[:2]
    for first, merges_expected in ((CallableDrafter(lambda ctx: [], max_nodes=4, name="empty"), False),
                                   (CallableDrafter(lambda ctx: [[(ctx[-1] + 5) % 12] * 2], max_nodes=3,
                                                    name="junk"), True)):
        second = CallableDrafter(lambda ctx: [[(ctx[-1] + 1) % 12, (ctx[-1] + 2) % 12]], max_nodes=3, name="next")
        multi = MultiDraft([first, second], escalate=2.0, gate=False)
        merges = []

        def spy(*args, **kwargs):
            merges.append(1)
            return merge_drafts(*args, **kwargs)

        monkeypatch.setattr("specdec.drafters.multi.merge_drafts", spy)
        dec = SpeculativeDecoder(target, multi, max_batch=2, max_len=64, policy="fixed")
        out = dec.generate(prompts, max_new_tokens=24)
        assert out.tokens == [r[:24] for r in refs]
        assert bool(merges) == merges_expected, len(merges)


def test_gate_price_counts_the_catch_up_not_the_prompt(toy, monkeypatch):
    """In the loop, a later member's price is its whole propose (read on pay_gate.clock) less a new request's
    prompt prefill (Drafter.prompt_seconds); with steady_price=False the catch-up is subtracted as before.
    Steps after a step it did not draft are kept apart as behind."""
    from specdec.drafters import pay_gate

    target, refs = toy
    now = [0.0]
    monkeypatch.setattr(pay_gate, "clock", lambda: now[0])

    class Timed(CallableDrafter):
        """Each proposal takes 3 us on the fake clock (cheap beside a real step: the gate lets it draft), 2 us of
        it catch-up, 0.5 us of that a prompt."""

        def propose(self, ctx):
            now[0] += 3e-6
            self.catch_up_seconds, self.prompt_seconds = 2e-6, 0.5e-6
            return super().propose(ctx)

    ref, prompt = refs[0], list(TOY_PROMPTS[0])

    def oracle(ctx):  # the target's own continuation: accepted, so the member drafts step after step
        done = len(ctx) - len(prompt)
        return [ref[done:done + 2]] if done < len(ref) else []

    prices = {}
    for steady_price in (True, False):
        member = Timed(oracle, max_nodes=4, name="timed")
        multi = MultiDraft([CallableDrafter(lambda ctx: [], max_nodes=4, name="empty"), member], escalate=2.0)
        multi.gate.steady_price = steady_price
        dec = SpeculativeDecoder(target, multi, max_batch=1, max_len=64, policy="fixed")
        assert dec.generate(TOY_PROMPTS[:1], max_new_tokens=12).tokens[0] == refs[0][:12]
        prices[steady_price] = multi.gate.secs[1], multi.gate.secs_behind[1]
    # the first two steps wait for the empty member (trusted on a fresh decoder): the member's first draft
    # follows steps it did not draft (behind), the others are steady
    assert prices[True] == (pytest.approx(2.5e-6), pytest.approx(2.5e-6))
    assert prices[False] == (pytest.approx(1e-6), None)


def test_advice_takes_the_gate_decision_before_the_plan(toy):
    """With escalation, the price check and two members, has_proposals answers False for a row whose first member
    has no proposal and whose second the gate skips (that decision taken there, kept for propose): the row is
    planned as a plain step. Under the fixed policy the plan is the budgets, so the member drafts on exactly the
    same rows with the advice as without it, and the output is the target's."""
    from specdec import PromptLookup

    target, refs = toy
    prompts = TOY_PROMPTS[:2]
    full = {tuple(p): r for p, r in zip(prompts, refs)}

    def junk(ctx):  # never what the target picks next
        seen = {(a, b) for p, r in full.items() for a, b in zip((list(p) + r)[len(p) - 1:], r)}
        return [[next(t for t in range(12) if (ctx[-1], t) not in seen)] * 3]

    rows, answers = {}, []
    for advise in (True, False):
        member = CallableDrafter(junk, max_nodes=4, name="junk")
        drafting = _drafting_rows(member)
        multi = MultiDraft([PromptLookup(ngram=4, k=3), member], escalate=2.0)
        multi.advise = advise
        real = multi.has_proposals

        def spy(ids, seqs, real=real):
            got = real(ids, seqs)
            answers.append((advise, got))
            return got

        multi.has_proposals = spy
        dec = SpeculativeDecoder(target, multi, max_batch=2, max_len=64, policy="fixed")
        assert dec.generate(prompts, max_new_tokens=32).tokens == refs
        rows[advise] = sum(drafting)
    assert rows[True] == rows[False], rows
    said = [x for advise, got in answers if advise and got is not None for x in got]
    assert said and not all(said)                        # the advice ran and planned rows plainly
    assert all(got is None for advise, got in answers if not advise)
