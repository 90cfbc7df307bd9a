"""PayGate: whether a costly member of a MultiDraft drafts for a request this step (escalation's price check).

Escalation (:class:`specdec.MultiDraft` ``escalate=t``) lets a later, costlier member draft for a row
where no earlier member is trusted. That alone lets a member that costs more than it adds drag the
merge below its best member: a feature head beside prompt lookup on text that copies its input, where
the lookup chain is accepted and the head's siblings add nothing but their forward and their verify
rows. The gate prices each drafting decision with the scheduler's cost model.

For member i and a row, two situations are told apart: ``ALONE`` (no earlier member proposed for the
row this step) and ``BESIDE`` (one did). Per request and situation the gate keeps ``gain``: the
accepted tokens the member ADDED when it drafted (the accepted path's length less the longest part of
it that lay in an earlier member's own tree) as an exponential average (weight 0.8; a new request
starts from the member's decoder-wide average, weight 0.9, kept across generate calls), and, BESIDE,
``base``: the earlier members' own accepted tokens in such steps. Per member it keeps the seconds of
its propose() when it drafted, a new request's prompt prefill excluded (``Drafter.prompt_seconds``: paid
once per request whatever the gate decides). The price is learnt from ``steady`` steps, where every row it
drafted for had drafted the step before. A step after one it did not draft (``behind``) catches up first,
and a feature head does so in the same forward that drafts: such a step's seconds less its catch-up are its
tree builder alone, which once pulled the price toward nothing and let the head draft where it did not pay,
while its whole seconds include tokens that are fed once whenever it drafts again (not a cost of drafting
now rather than later). So behind steps are kept apart (their whole seconds) and price the member only
until a steady step has been measured. With ``step_seconds(n)``
(the cost model's seconds of a step without drafting when each row holds n nodes) the member's price in
plain steps is

    cost = (its seconds + step_seconds(1 + n_before + n_own) - step_seconds(1 + n_before)) / step_seconds(1)

and it drafts unless that clearly does not pay at the goodput the row reaches without it: it skips when
``(gain + spread) * C < cost * E``, with E = 1 + base tokens per step and C = step_seconds(1 + n_before) /
step_seconds(1) plain steps (ALONE: E = C = 1, a plain step), and ``spread`` one standard deviation of the
average for counts of that mean, sqrt(gain * (1 - w) / (1 + w)) for the average's weight w: a step's gain is
0, 1 or 2 tokens, so the average of a member that pays by a margin (docs/benchmarks.md: a head adding 0.43
tokens a step against a price of about 0.2) dips below its price every few steps, and each dip would cost skips
until the next re-probe; a member that adds nothing (gain near 0) is still skipped. A member without a
measured price or gain drafts (that is how they are measured). A row it skips is re-probed after 4 skipped
steps, then 8, at most 16 (the estimate would otherwise never be corrected); a decision that pays resets the wait
to 4.

The decision reads timings and acceptance of earlier steps only, never this step's verification, so
the candidate set stays a function of what is known before verification: sampling stays exact.
"""
from __future__ import annotations

import math
import time
from typing import Callable, Dict, List, Optional, Sequence

__all__ = ["PayGate", "ALONE", "BESIDE"]

ALONE, BESIDE = 0, 1
_OWN = 0.8       # weight of the past in a request's averages (one step's gain is 0, 1 or 2 tokens: noisy)
_GLOBAL = 0.9    # weight of the past in a member's decoder-wide averages (a new request's start)
_SECS = 0.7      # weight of the past in a member's propose seconds
_WAIT0, _WAIT_MAX = 4, 16  # steps a skipped row waits before a re-probe: first, most

clock = time.perf_counter  # the timer of the members' propose() (a module attribute: replaceable)


class _Row:
    """One request's record for one member."""

    __slots__ = ("gain", "base", "skipped", "wait", "behind")

    def __init__(self, gain: List[Optional[float]], base: Optional[float]) -> None:
        self.gain = list(gain)   # per situation: added accepted tokens per drafting step
        self.base = base         # BESIDE: the earlier members' own accepted tokens per step
        self.skipped = 0
        self.wait = _WAIT0
        self.behind = False      # the member did not draft for the row in the last step (its next draft catches up)


class PayGate:
    """The price check of a MultiDraft's later members (see the module docstring)."""

    def __init__(self, members: int) -> None:
        self.members = int(members)
        self.secs: List[Optional[float]] = [None] * self.members         # steady price (seconds)
        self.secs_behind: List[Optional[float]] = [None] * self.members  # after a step without drafting
        #: False: every step prices the member, its catch-up subtracted (the gate of before; kept for A/B runs)
        self.steady_price = True
        self.global_gain: List[List[Optional[float]]] = [[None, None] for _ in range(self.members)]
        self.global_base: List[Optional[float]] = [None] * self.members
        self.rows: Dict[int, List[_Row]] = {}
        self.skips = 0   # rows skipped by the gate (kept across generate calls, for diagnostics)

    def reset(self) -> None:
        """A new generate call: the requests' records go, the decoder-wide ones and the prices stay."""
        self.rows = {}

    def keep(self, request_ids: Sequence[int]) -> None:
        """Forget the records of requests no longer active."""
        self.rows = {rid: self._rows(rid) for rid in request_ids}

    def _rows(self, rid: int) -> List[_Row]:
        rows = self.rows.get(rid)
        if rows is None:
            rows = self.rows[rid] = [_Row(self.global_gain[i], self.global_base[i]) for i in range(self.members)]
        return rows

    def timed(self, i: int, seconds: float, behind: bool = False) -> None:
        """Member i drafted for at least one row in ``seconds`` (a new request's prompt prefill excluded);
        ``behind``: for a row it had not drafted for in the step before (:meth:`behind`)."""
        prices = self.secs_behind if behind and self.steady_price else self.secs
        s = prices[i]
        prices[i] = seconds if s is None else _SECS * s + (1 - _SECS) * seconds

    def mark(self, rid: int, i: int, drafted: bool) -> None:
        """After a proposal: whether member i drafted for request ``rid`` this step."""
        self._rows(rid)[i].behind = not drafted

    def behind(self, rid: int, i: int) -> bool:
        """Whether member i's next draft for request ``rid`` follows a step it did not draft (a catch-up)."""
        rows = self.rows.get(rid)
        return rows is not None and rows[i].behind

    def cost(self, i: int, n_before: int, n_own: int, step_seconds: Callable[[int], float]) -> Optional[float]:
        """Member i's price in plain steps for a row with ``n_before`` earlier nodes, ``n_own`` of its own."""
        secs = self.secs[i] if self.secs[i] is not None else self.secs_behind[i]
        if secs is None:
            return None
        plain = step_seconds(1)
        if not plain > 0:
            return None
        extra = max(0.0, step_seconds(1 + n_before + n_own) - step_seconds(1 + n_before))
        return (secs + extra) / plain

    def allow(self, rid: int, i: int, situation: int, n_before: int, n_own: int,
              step_seconds: Optional[Callable[[int], float]]) -> bool:
        """Whether member i drafts for request ``rid`` this step."""
        row = self._rows(rid)[i]
        gain = row.gain[situation]
        if gain is None or step_seconds is None:
            return True
        cost = self.cost(i, n_before, n_own, step_seconds)
        if cost is None:
            return True
        if situation == ALONE:
            e, c = 1.0, 1.0
        else:
            e = 1.0 + (row.base or 0.0)
            c = step_seconds(1 + n_before) / step_seconds(1)
        spread = math.sqrt(max(0.0, gain) * (1.0 - _OWN) / (1.0 + _OWN))
        if (gain + spread) * c >= cost * e:
            row.skipped, row.wait = 0, _WAIT0
            return True
        if row.skipped >= row.wait:  # a re-probe: the estimate gets corrected if the text changed
            row.skipped, row.wait = 0, min(_WAIT_MAX, 2 * row.wait)
            return True
        row.skipped += 1
        self.skips += 1
        return False

    def observe(self, rid: int, i: int, situation: int, drafted: bool, added: int, base: int) -> None:
        """A verified step: member i ``drafted`` for the row or not; ``added`` accepted tokens it added, ``base``
        the earlier members' longest own accepted part (BESIDE)."""
        row = self._rows(rid)[i]
        if situation == BESIDE:
            row.base = base if row.base is None else _OWN * row.base + (1 - _OWN) * base
            g = self.global_base[i]
            self.global_base[i] = base if g is None else _GLOBAL * g + (1 - _GLOBAL) * base
        if not drafted:
            return
        old = row.gain[situation]
        row.gain[situation] = added if old is None else _OWN * old + (1 - _OWN) * added
        g = self.global_gain[i][situation]
        self.global_gain[i][situation] = added if g is None else _GLOBAL * g + (1 - _GLOBAL) * added
