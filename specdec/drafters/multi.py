"""MultiDraft: several drafters' proposals merged into ONE token tree per request (SpecInfer).

Each step every member proposes its own tree (rooted at the same root) within its share of
the node budget; the trees are merged on the host, member by member in order, and the
target verifies the union in one pass.

The merge and the mapping of the accepted path back to each member run on the host
(:mod:`specdec.drafters.multi_merge`, which states the merging rules that keep the output exact).

Node budget: ``budgets=[n_0, n_1, ...]`` gives each member a fixed number of draft nodes;
otherwise ``node_budget`` (root included; default: the sum of the members' own sizes) is split
every step in proportion to each member's recent acceptance (an exponential average of the
accepted tokens that lay in its own subtree), at least one node each so that every member
keeps being measured. A member learns its share through ``StepContext.node_budget`` (DraftModel
dynamic trees re-rank to it, prompt lookup shortens its chain) and its proposal is cut to it
(a prefix in index order, which is a connected subtree).

Escalation (``escalate=t``, off by default): members go cheapest first, and a member after the
first drafts only for the rows where no member before it is trusted this step. A member is
trusted for a request when it proposed something for that row and its recent accepted tokens
per proposing step for that request (an exponential average, weight 1/2, that starts at ``t``:
a new request starts from the member's decoder-wide average over every earlier request of this
decoder, ``t`` for the first) reach ``t``; a trusted member with nothing to propose is forgiven
two steps in a row (the row decodes plainly) before the next member drafts, and the next member
keeps drafting while it stays empty. The decoder-wide start matters on mixed traffic: where the
free member rarely pays (prompt lookup on open chat, or under sampling), a new request no longer
spends its first steps plainly or on a junk proposal before the draft model drafts; where it
pays, a new request trusts it from its first step and the draft model runs no forward. On a CPU this is what makes
``MultiDraft([PromptLookup(), DraftModel(w8)])`` pay everywhere: on text that copies its
input the free lookup chain is trusted and the draft model runs no forward at all (it catches up
when it is next needed); on open text lookup proposes little or is not trusted and the draft
model drafts. The decision reads only the members' proposals of this step and acceptance of
earlier steps -- never this step's verification draws -- so the candidate set stays a function
of what is known before verification and sampling stays exact.

Price check (``gate=True``, the default with escalation): a later member that may draft for a row
still skips it when, by the scheduler's cost model, what it has recently ADDED to the accepted path
(alone, or beside an earlier member's proposal) does not pay for its measured forward and its verify
rows at the goodput the row reaches without it (:class:`specdec.drafters.pay_gate.PayGate`; skipped
rows are re-probed with a doubling wait). This is what keeps a feature head from dragging prompt lookup
down on text that copies its input, while it keeps drafting on open text where lookup has nothing.

Rollback: after verification every member gets the part of the accepted path that lies in its
own tree (``accept(accepted, num, num_host, foreign=...)``) and the accepted tokens after that
part (``foreign``), so a draft model feeds them with its next root instead of running a
catch-up forward. The merge and this mapping run on the host: MultiDraft reads the accepted
path once per step (free on CPU; one more device sync per step on CUDA).
"""
from __future__ import annotations

from typing import Dict, List, Optional, Sequence, Tuple

import torch

from specdec._check import check_int, is_int, is_number
from specdec.drafters import pay_gate
from specdec.drafters.base import Draft, Drafter, StepContext
from specdec.drafters.multi_merge import member_part, merge_drafts, single_member
from specdec.drafters.pay_gate import ALONE, BESIDE, PayGate
from specdec.drafters.validate import check_draft
from specdec.sampling import SamplingParams
from specdec.tree import TokenTree

__all__ = ["MultiDraft"]

_EMA = 0.8  # weight of the past in the acceptance average that splits the node budget
_TRUST = 0.5  # weight of the past in a member's per-request acceptance average (escalation)
_PATIENCE = 2  # escalation: steps in a row a trusted member may propose nothing before the next member drafts
_GLOBAL = 0.9  # weight of the past in a member's decoder-wide acceptance average (a new request's prior)


class MultiDraft(Drafter):
    """SpecInfer-style merge of several drafters' trees into one tree per request.

    Parameters
    ----------
    drafters : sequence of Drafter
        Members (DraftModel, PromptLookup, CallableDrafter, another MultiDraft, ...), distinct objects.
    budgets : sequence of int, optional
        Fixed draft nodes per member per step (root excluded), each >= 1.
    node_budget : int, optional
        Total nodes per request (root included) split across members by recent acceptance when
        ``budgets`` is None. Default: 1 + the sum of the members' own ``max_nodes - 1``.
    escalate : float, optional
        Cheapest member first: a later member skips the rows where an earlier member proposed
        something and has recently averaged at least ``escalate`` accepted tokens per proposing
        step for that request (see the module docstring). None (default): every member drafts
        for every row.
    gate : bool
        With ``escalate``: a later member also skips the rows where its recent contribution does not pay
        for its cost (see the module docstring). Default True; ignored without ``escalate``.
    """

    trusted = True

    def __init__(self, drafters: Sequence[Drafter], budgets: Optional[Sequence[int]] = None,
                 node_budget: Optional[int] = None, escalate: Optional[float] = None, gate: bool = True) -> None:
        if isinstance(drafters, Drafter) or not isinstance(drafters, (list, tuple)):
            raise TypeError(f"MultiDraft: drafters must be a list of specdec drafters, got {type(drafters).__name__}")
        if not drafters:
            raise ValueError("MultiDraft: needs at least one drafter, got an empty list")
        for i, d in enumerate(drafters):
            if not isinstance(d, Drafter):
                raise TypeError(f"MultiDraft: drafter {i} must be a specdec Drafter, got {type(d).__name__}")
        if len({id(d) for d in drafters}) != len(drafters):
            raise ValueError("MultiDraft: the same drafter object appears twice (each member keeps its own state)")
        self.members = list(drafters)
        self.changes_target = any(d.changes_target for d in self.members)
        if escalate is not None:
            if not is_number(escalate) or not escalate > 0:
                raise ValueError(f"MultiDraft: escalate must be a number > 0 (accepted tokens per step) or None, "
                                 f"got {escalate!r}")
            escalate = float(escalate)
        self.escalate = escalate
        #: the price check of the later members (escalation only)
        self.gate: Optional[PayGate] = PayGate(len(self.members)) if escalate is not None and gate else None
        self._trust: Dict[int, List[float]] = {}  # request id -> per member: recent accepted tokens when it proposed
        self._empty: Dict[int, List[int]] = {}    # request id -> per member: asked steps in a row it proposed nothing
        # per member: accepted tokens per proposing step over every request of this decoder (kept across
        # generate calls): the trust a new request starts from
        self._global: List[float] = [escalate or 0.0] * len(self.members)
        caps = [max(0, int(d.max_nodes) - 1) for d in self.members]
        self._caps = caps
        if budgets is not None:
            if node_budget is not None:
                raise ValueError("MultiDraft: give budgets (per member) or node_budget (total), not both")
            budgets = list(budgets)
            if len(budgets) != len(self.members):
                raise ValueError(f"MultiDraft: budgets must hold one int per drafter ({len(self.members)}), "
                                 f"got {len(budgets)}")
            for i, n in enumerate(budgets):
                check_int("MultiDraft", f"budgets[{i}]", n, lo=1, type_error=False)
            self.budgets: Optional[List[int]] = [min(n, c) if c > 0 else 0 for n, c in zip(budgets, caps)]
            total = sum(self.budgets)
        else:
            self.budgets = None
            total = sum(caps)
            if node_budget is not None:
                if not is_int(node_budget) or node_budget < 1 + len(self.members):
                    raise ValueError(f"MultiDraft: node_budget must be an int >= 1 + {len(self.members)} (root + one "
                                     f"node per drafter), got {node_budget!r}")
                total = min(total, node_budget - 1)
        self.max_nodes = 1 + total
        self._outer_foreign = 0
        self._ema = [1.0] * len(self.members)
        self.device = torch.device("cpu")
        self.vocab_size = None
        self.params: Optional[SamplingParams] = None
        self._step: Optional[dict] = None
        #: has_proposals takes the price check's decision for a row whose first member has nothing (False: never)
        self.advise = True
        self._advice: Dict[int, bool] = {}   # request id -> the gate's decision for member 1 this step
        self._costs = None                   # (rows, step_seconds) of the last step: the advice's prices

    def __repr__(self) -> str:
        inner = ", ".join(repr(d) for d in self.members)
        extra = f", budgets={self.budgets}" if self.budgets is not None else f", node_budget={self.max_nodes}"
        if self.escalate is not None:
            extra += f", escalate={self.escalate:g}"
        return f"MultiDraft([{inner}]{extra})"

    def _name(self, i: int) -> str:
        return f"MultiDraft member {i} ({self.members[i]!r})"

    # ------------------------------------------------------------------ setup
    def reserve_foreign(self, n: int) -> None:
        self._outer_foreign = max(self._outer_foreign, int(n))

    def paged_draft(self, block_size: int) -> Optional[Tuple[int, int]]:
        if self.changes_target:   # bound before the target's cache is chosen: no shared pool
            return None
        specs = []
        for d in self.members:
            d.reserve_foreign(self.max_nodes - 1 + self._outer_foreign)
            specs.append(d.paged_draft(block_size))
        specs = [s for s in specs if s is not None]
        return (sum(s[0] for s in specs), max(s[1] for s in specs)) if specs else None

    def attach_pages(self, pages) -> None:
        for d in self.members:
            d.attach_pages(pages)

    def bind(self, target, max_batch: int, max_len: int) -> None:
        self.device = torch.device(target.device)
        self.vocab_size = int(target.vocab_size)
        for d in self.members:
            d.reserve_foreign(self.max_nodes - 1 + self._outer_foreign)
            d.bind(target, max_batch, max_len)

    def start(self, prompts: Sequence[Sequence[int]], params: SamplingParams, generator: torch.Generator) -> None:
        self.params = params
        self._ema = [1.0] * len(self.members)
        self._trust, self._empty = {}, {}
        self._advice.clear()
        if self.gate is not None:
            self.gate.reset()
        self._step = None
        for d in self.members:
            d.start(prompts, params, generator)

    def admit(self, rows: Sequence[int], prompts: Sequence[Sequence[int]]) -> None:
        for d in self.members:
            d.admit(rows, prompts)

    # ------------------------------------------------------------------ budget
    def split(self) -> List[int]:
        """Draft nodes per member for the next step (fixed budgets, or by recent acceptance)."""
        if self.budgets is not None:
            return list(self.budgets)
        caps = self._caps
        total = self.max_nodes - 1
        if total >= sum(caps):
            return list(caps)
        live = [i for i, c in enumerate(caps) if c > 0]
        alloc = [0] * len(caps)
        for i in live:  # one node each: every member keeps being measured
            alloc[i] = 1
        left = total - len(live)
        weights = {i: self._ema[i] + 0.05 for i in live}
        while left > 0:
            open_ = [i for i in live if alloc[i] < caps[i]]
            if not open_:
                break
            wsum = sum(weights[i] for i in open_)
            shares = {i: left * weights[i] / wsum for i in open_}
            give = {i: min(caps[i] - alloc[i], int(shares[i])) for i in open_}
            if sum(give.values()) == 0:  # hand out the remainder by largest share
                i = max(open_, key=lambda j: (shares[j], -j))
                give[i] = 1
            for i, g in give.items():
                alloc[i] += g
                left -= g
        return alloc

    # ------------------------------------------------------------------ step
    def cancel(self) -> None:
        for d in self.members:
            d.cancel()
        self._step = None

    def has_proposals(self, request_ids: Sequence[int], sequences: Sequence[Sequence[int]]) -> Optional[List[bool]]:
        """Advisory (asked before the step is planned): with escalation, the price check and two members, a row
        has nothing to draft when the first member has no proposal for it, is not forgiven for that, and the
        gate skips the second one: the gate's decision is taken here (its skip counted, or its re-probe), kept
        for this step's propose(), and the row is planned as a plain step without weighing depths. None
        elsewhere (and when the first member cannot tell, or before a step has handed over its costs)."""
        gate, esc = self.gate, self.escalate
        if not self.advise or gate is None or len(self.members) != 2 or self._costs is None or \
                self._costs[0] != len(request_ids):
            return None
        first = self.members[0].has_proposals(request_ids, sequences)
        if first is None or len(first) != len(request_ids):
            return None
        out, n_own = [], self.split()[1]
        for rid, has in zip(request_ids, first):
            if not has:
                trust, empty = self._trust.get(rid, self._global)[0], self._empty.get(rid, [0, 0])[0]
                if not (empty < _PATIENCE and trust >= esc):  # not forgiven: the gate decides for member 1
                    has = self._advice[rid] = gate.allow(rid, 1, ALONE, 0, n_own, self._costs[1])
            out.append(bool(has))
        return out

    def pending_catch_up(self, lengths: Sequence[int]) -> List[int]:
        out = [0] * len(lengths)
        for d in self.members:
            out = [a + b for a, b in zip(out, d.pending_catch_up(lengths))]
        return out

    def propose(self, ctx: StepContext) -> Draft:
        alloc = self.split()
        if ctx.node_budget is not None:  # an outer MultiDraft's share: shrink ours proportionally
            scale = max(0, int(ctx.node_budget) - 1) / max(1, sum(alloc))
            if scale < 1:
                alloc = [max(1 if a else 0, int(a * scale)) for a in alloc]
        if ctx.params is not None:
            self.params = ctx.params
        b = len(ctx.request_ids)
        if ctx.step_seconds is not None:  # the next step's advice (has_proposals) prices with these
            self._costs = (b, ctx.step_seconds)
        drafts: List[Draft] = []
        self.catch_up_seconds = 0.0
        self.catch_up_positions = 0
        self.prompt_seconds = 0.0
        esc = self.escalate
        if esc is not None:
            # a new request starts from each member's decoder-wide record (every member is trusted on a
            # fresh decoder): a trusted free member's first proposal spares a draft model its first forward
            # (and the prompt prefill that its lazy admission would run)
            m = len(self.members)
            self._trust = {rid: self._trust.get(rid, list(self._global)) for rid in ctx.request_ids}
            self._empty = {rid: self._empty.get(rid, [0] * m) for rid in ctx.request_ids}
            trusted = [False] * b      # a member before the current one is trusted for the row this step
            if self.gate is not None:
                self.gate.keep(ctx.request_ids)
        gate = self.gate
        situations: List[List[Optional[int]]] = []  # per member, per row: the gate's situation where it decided
        proposed: List[List[int]] = []  # per member, per row: real nodes proposed
        host: List[Tuple[List[List[int]], List[List[int]]]] = []  # per member: (tokens, parents) on the host
        try:
            for i, d in enumerate(self.members):
                budgets = ctx.budgets
                skip = trusted if esc is not None else None
                if esc is not None and i > 0:
                    budgets = [0 if t else x for t, x in zip(trusted, ctx.budgets)]
                    if gate is not None:
                        sit: List[Optional[int]] = [None] * b
                        for r, rid in enumerate(ctx.request_ids):
                            if budgets[r] > 0:
                                before = sum(p[r] for p in proposed)
                                sit[r] = BESIDE if before else ALONE
                                advised = self._advice.pop(rid, None) if sit[r] == ALONE else None
                                if not (advised if advised is not None else
                                        gate.allow(rid, i, sit[r], before, alloc[i], ctx.step_seconds)):
                                    budgets[r] = 0
                        skip = [t or (s_ is not None and x == 0) for t, s_, x in zip(trusted, sit, budgets)]
                        situations.append(sit)
                sub = StepContext(roots=ctx.roots, sequences=ctx.sequences, request_ids=ctx.request_ids,
                                  budgets=budgets, node_budget=1 + alloc[i], params=ctx.params)
                t0 = pay_gate.clock()
                try:
                    draft = d.propose(sub)
                except (ValueError, TypeError) as exc:
                    raise type(exc)(f"{self._name(i)}: {exc}") from exc
                if gate is not None and i > 0 and max(budgets, default=0) > 0:
                    # the member's price (PayGate: learnt from steady steps; a step after one it did not draft,
                    # whose forward runs inside its catch-up, is kept apart), a new request's prompt prefill
                    # excluded (once per request, whatever the gate)
                    behind = any(budgets[r] > 0 and gate.behind(rid, i) for r, rid in enumerate(ctx.request_ids))
                    spent = pay_gate.clock() - t0 - float(getattr(d, "prompt_seconds", 0.0))
                    if not gate.steady_price:
                        spent -= float(getattr(d, "catch_up_seconds", 0.0)) - float(getattr(d, "prompt_seconds", 0.0))
                    gate.timed(i, spent, behind)
                drafts.append(draft)
                self.catch_up_seconds += float(getattr(d, "catch_up_seconds", 0.0))
                self.catch_up_positions += int(getattr(d, "catch_up_positions", 0))
                self.prompt_seconds += float(getattr(d, "prompt_seconds", 0.0))
                if not d.trusted:
                    check_draft(draft, self._name(i), ctx.request_ids, self.vocab_size, int(d.max_nodes))
                host.append((draft.tree.tokens.tolist(), draft.tree.parents.tolist()))  # the merge runs on the host
                if esc is not None:
                    n = [sum(1 for x in par[1:] if x >= 0) for par in host[-1][1]]
                    if i > 0:  # a skipped row proposes nothing, whatever the member did with a zero budget
                        n = [0 if t else x for t, x in zip(skip, n)]
                        if gate is not None:
                            for r, rid in enumerate(ctx.request_ids):
                                gate.mark(rid, i, n[r] > 0)
                    proposed.append(n)
                    for r, rid in enumerate(ctx.request_ids):
                        if trusted[r] or budgets[r] <= 0:
                            continue
                        empty = self._empty[rid]
                        if n[r] > 0:
                            trusted[r] = self._trust[rid][i] >= esc
                            empty[i] = 0
                        else:  # nothing to propose: a trusted member is forgiven _PATIENCE times in a row
                            trusted[r] = empty[i] < _PATIENCE and i < m - 1 and self._trust[rid][i] >= esc
                            empty[i] += 1
            step = dict(drafts=drafts, b=b, proposed=proposed if esc is not None else None, situations=situations,
                        request_ids=list(ctx.request_ids), single=None, maps=None)
            single = single_member(host, proposed, alloc) if esc is not None else None
            if single is not None:  # one member (or none) proposed: its draft as it is, no host merge
                step.update(single=single, tokens=host[single][0] if single >= 0 else None)
                draft = drafts[single] if single >= 0 else Draft(TokenTree.root_only(ctx.roots))
            else:
                draft, step["maps"], step["tokens"] = merge_drafts(
                    drafts, host, alloc, [int(seq[-1]) for seq in ctx.sequences], not self.params.greedy,
                    step["proposed"], self.vocab_size, self.device)
            self._step = step
            self._advice.clear()
            return draft
        except Exception:
            self._advice.clear()
            for d in self.members[:len(drafts)]:
                d.cancel()
            self._step = None
            raise

    @property
    def reads_verify_logits(self) -> bool:
        return any(d.reads_verify_logits for d in self.members)

    def observe_verify(self, tree: TokenTree, logits: torch.Tensor) -> None:
        """Every member sees the target's logits over the MERGED tree just verified (a member that
        learns from the target, such as TokenRecycling, learns from every node, whoever proposed it)."""
        for i, d in enumerate(self.members):
            try:
                d.observe_verify(tree, logits)
            except (ValueError, TypeError) as exc:
                raise type(exc)(f"{self._name(i)}: {exc}") from exc

    def accept(self, accepted: torch.Tensor, num_accepted: torch.Tensor, num_host: Sequence[int],
               foreign: Optional[Sequence[Sequence[int]]] = None) -> None:
        step = self._step
        if step is None:
            raise RuntimeError("MultiDraft.accept: no proposal to accept (propose first)")
        b = step["b"]
        single = step["single"]
        acc = accepted.tolist()   # host read: the member mapping runs on the host
        paths = [acc[r][1:int(num_host[r]) + 1] for r in range(b)]
        own_counts: List[List[int]] = []
        for i, d in enumerate(self.members):
            if single is not None and i == single:  # its own tree was verified: the result as it came
                nums = [int(x) for x in num_host]
                d.accept(accepted, num_accepted, nums,
                         foreign=[list(foreign[r]) if foreign is not None else [] for r in range(b)])
                own_counts.append(nums)
            else:
                nums = self._accept_member(i, d, step, paths, foreign)
                own_counts.append(nums)
            self._ema[i] = _EMA * self._ema[i] + (1 - _EMA) * (sum(nums) / max(1, b))
            if step["proposed"] is not None:
                for r, rid in enumerate(step["request_ids"]):
                    if step["proposed"][i][r] > 0:
                        tr = self._trust[rid]
                        tr[i] = _TRUST * tr[i] + (1 - _TRUST) * nums[r]
                        self._global[i] = _GLOBAL * self._global[i] + (1 - _GLOBAL) * nums[r]
        if step["situations"]:
            self._observe_gate(step, own_counts, num_host)
        self._step = None

    def _accept_member(self, i: int, d: Drafter, step: dict, paths: List[List[int]], foreign) -> List[int]:
        """Member i's part of the accepted paths and the tokens after it (:func:`member_part`); returns its
        accepted counts per row."""
        maps = step["maps"]
        rows, nums, extra = member_part(paths, None if maps is None else maps[i], step["tokens"],
                                        step["drafts"][i].tree.size, foreign)
        d.accept(torch.tensor(rows, dtype=torch.int32, device=self.device),
                 torch.tensor(nums, dtype=torch.int32, device=self.device), nums, foreign=extra)
        return nums

    def _observe_gate(self, step: dict, own_counts: List[List[int]], num_host: Sequence[int]) -> None:
        """The gate learns, per later member and row it decided for, what the member added to the accepted path
        (its length less the longest part in an earlier member's own tree) and what the earlier ones got."""
        proposed = step["proposed"]
        for i, sit in enumerate(step["situations"], start=1):
            for r, rid in enumerate(step["request_ids"]):
                if sit[r] is None:
                    continue
                base = max((own_counts[j][r] for j in range(i) if proposed[j][r] > 0), default=0)
                drafted = proposed[i][r] > 0
                self.gate.observe(rid, i, sit[r], drafted, int(num_host[r]) - base if drafted else 0, base)

    def retire(self, moves: Sequence[Tuple[int, int, int]], active: int) -> None:
        for d in self.members:
            d.retire(moves, active)
