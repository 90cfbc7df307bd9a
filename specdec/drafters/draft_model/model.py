"""DraftModel: a smaller LM (same vocabulary) drafts per step, as a chain, a spine tree, a dynamic
tree or a planned tree. The class holds the binding, the draft cache and its pending tokens, and the
learners; the tree builders live in :mod:`.spine`, :mod:`.dynamic` and :mod:`.planned`, the draft
cache's feeding and rollback in :mod:`.cache`. docs/drafters.md explains the design."""
from __future__ import annotations

import time
from typing import Dict, List, Optional, Sequence, Tuple

import torch

from specdec._check import is_int
from specdec.cache import RowViews, move_cache_rows
from specdec.drafters.base import Draft, Drafter, StepContext
from specdec.drafters.draft_model.cache import catch_up, feed_root, spine_in_cache, tree_moves
from specdec.drafters.draft_model.dynamic import propose_dynamic
from specdec.drafters.draft_model.learners import Calibration, RankAcceptance
from specdec.drafters.draft_model.planned import (SAMPLED_RANK_ACCEPT, Plan, estimated_reach, plan_levels,
                                                  propose_planned)
from specdec.drafters.draft_model.proposal import Proposal, child_counts, limit_depths
from specdec.drafters.draft_model.spine import SpineBuffers, propose_spine
from specdec.draft_pages import DraftPages, DraftPagesView
from specdec.paged_cache import PagedKVCache
from specdec.sampling import SamplingParams
from specdec.tree import TokenTree

__all__ = ["DraftModel"]

_TREES = ("spine", "dynamic", "planned")


class DraftModel(Drafter):
    """Draft with a smaller causal LM wrapped like the target (``HFCausalLM`` protocol).

    Parameters
    ----------
    lm : HFCausalLM (or any object with the same protocol)
        The draft model. Its vocabulary must equal the target's (checked when a
        :class:`~specdec.SpeculativeDecoder` is built).
    k : int
        Draft depth (= forwards of the draft model per step).
    top_k : int
        Branching: 1 = a chain (``tree`` is then irrelevant); w > 1 = a spine tree (the spine
        token plus w - 1 sibling leaves per depth), a dynamic tree (w frontier nodes expanded
        per depth, w children each) or a planned tree (at most w nodes expanded per depth).
    node_budget : int, optional
        Spine: cap on tree nodes (root included), k is lowered to (node_budget - 1) // top_k.
        Dynamic: the tree is re-ranked to this many nodes (root included; default 1 + k * top_k,
        at most the 1 + top_k + (k - 1) * top_k^2 candidates a step produces).
    stop_threshold : float, optional
        Chains / spine trees: stop a row's chain after a drafted token whose draft probability is
        below this (greedy: the draft's softmax probability of its argmax; sampling: q of the
        drawn token). None: always draft k tokens.
    tree : "spine", "dynamic" or "planned"
        The tree shape for top_k > 1 (see docs/drafters.md). Default "spine".
    sampled_children : bool
        Dynamic and planned trees under sampling: True (default) draws the children of every
        expanded node from q and fixes the tree's shape before any draw (no pruning); False uses
        the greedy rule (deterministic top-k children + re-rank) under sampling too. Both are exact.
    calibrate : bool
        Dynamic trees under the greedy rule: rank candidates by their MEASURED acceptance (default True,
        :class:`~specdec.drafters.draft_model.learners.Calibration`) instead of their draft probability
        (False: EAGLE-2's cumulative log q).
    learn_plan : bool
        ``tree="planned"`` under the greedy rule: re-plan the shape from this drafter's own measured
        acceptance per (depth, sibling rank) every PLAN_EVERY steps (default False: the shape of
        GREEDY_RANK_ACCEPT, fitted to the bundled int8 draft; see ``rank_acceptance()``).
    """

    trusted = True

    def __init__(self, lm, k: int = 4, top_k: int = 1, node_budget: Optional[int] = None,
                 stop_threshold: Optional[float] = None, tree: str = "spine", sampled_children: bool = True,
                 calibrate: bool = True, learn_plan: bool = False) -> None:
        for name, v in (("k", k), ("top_k", top_k)):
            if not is_int(v):
                raise TypeError(f"DraftModel: {name} must be an int, got {type(v).__name__}")
        if k < 1:
            raise ValueError(f"DraftModel: k must be >= 1, got {k}")
        if top_k < 1:
            raise ValueError(f"DraftModel: top_k must be >= 1, got {top_k}")
        if tree not in _TREES:
            raise ValueError(f"DraftModel: tree must be one of {_TREES}, got {tree!r}")
        if stop_threshold is not None and not 0.0 <= float(stop_threshold) <= 1.0:
            raise ValueError(f"DraftModel: stop_threshold must lie in [0, 1] or be None, got {stop_threshold}")
        if tree in ("dynamic", "planned"):
            if stop_threshold is not None:
                raise ValueError(f"DraftModel: stop_threshold applies to chains and spine trees, not tree={tree!r} "
                                 "(the node budget already drops unlikely nodes)")
            # candidates one step produces (a planned tree gives any of its <= top_k parents per level
            # as many children as its plan says)
            pool = top_k + (k - 1) * top_k * top_k if tree == "dynamic" else 1 << 30
            if node_budget is None:
                node_budget = 1 + k * top_k
            if not is_int(node_budget) or node_budget < 2:
                raise ValueError(f"DraftModel: node_budget must be an int >= 2 (root + one node), got {node_budget!r}")
            self.max_nodes = 1 + min(node_budget - 1, pool)
        else:
            if node_budget is not None:
                if not is_int(node_budget) or node_budget < 1 + top_k:
                    raise ValueError(f"DraftModel: node_budget must be an int >= 1 + top_k = {1 + top_k} "
                                     f"(root + one level), got {node_budget}")
                k = min(k, (node_budget - 1) // top_k)  # whole levels only
            self.max_nodes = 1 + k * top_k
        self.stop_threshold = None if stop_threshold is None else float(stop_threshold)
        self.lm = lm
        self.k = k
        self.top_k = top_k
        self.node_budget = node_budget
        self.tree = tree
        self.dynamic = tree in ("dynamic", "planned") and top_k > 1
        self.planned = tree == "planned" and top_k > 1
        self.sampled_children = bool(sampled_children)
        self.calibrate = bool(calibrate)
        self.learn_plan = bool(learn_plan)
        self.cal_table: Optional[Calibration] = None       # learners: a new binding starts them afresh
        self.rank_table: Optional[RankAcceptance] = None
        self._plans: Dict[Tuple, Plan] = {}
        self.cache = None
        self._pages = None     # the target's PagedKVCache when the engine keeps this draft's K/V in its pool
        self._views: Optional[RowViews] = None
        self._foreign = 0  # tokens from other drafters' subtrees that accept() may pass per row
        self.catch_up_tokens = 512  # positions (rows x width) per catch-up forward: bounds its activations
        # host copy of cache.lens while the drafter is behind and nothing moves them (plain steps): the
        # scheduler asks for the pending catch-up every such step, one device read serves them all
        self._lens_host: Optional[List[int]] = None
        self._last: Optional[Proposal] = None   # the last proposal, for accept() / cancel()

    def __repr__(self) -> str:
        stop = "" if self.stop_threshold is None else f", stop_threshold={self.stop_threshold}"
        shape = f", tree={self.tree!r}, node_budget={self.max_nodes}" if self.dynamic else ""
        return f"DraftModel(k={self.k}, top_k={self.top_k}{shape}{stop})"

    # ------------------------------------------------------------------ setup
    def reserve_foreign(self, n: int) -> None:
        self._foreign = max(self._foreign, int(n))

    def _slots(self) -> int:
        """Step nodes the draft writes past the root."""
        return (self.k - 1) * self.top_k if self.dynamic else self.k

    def paged_draft(self, block_size: int) -> Optional[Tuple[int, int]]:
        lm = self.lm
        if not getattr(lm, "supports_paged", False):
            return None
        per = PagedKVCache.bytes_per_block(lm.num_layers, lm.num_kv_heads, lm.head_dim, block_size, lm.dtype)
        # a step writes [pending..., root] right-padded to 1 + foreign pending tokens (a row with none
        # writes up to 1 + foreign positions past its root), then its nodes after the root
        return per, max(1 + self._slots(), 2 + self._foreign)

    def attach_pages(self, pages) -> None:
        self._pages = pages

    def bind(self, target, max_batch: int, max_len: int) -> None:
        if int(self.lm.vocab_size) != int(target.vocab_size):
            raise ValueError(f"DraftModel: draft vocabulary size {self.lm.vocab_size} != target vocabulary size "
                             f"{target.vocab_size}; the draft must share the target's tokenizer")
        if torch.device(self.lm.device) != torch.device(target.device):
            raise ValueError(f"DraftModel: draft model on {self.lm.device} but target on {target.device}")
        dev = torch.device(self.lm.device)
        k, w = self.k, self.top_k
        slots = self._slots()
        self._pend_cap = 1 + self._foreign           # most pending tokens per row
        if self._pages is not None:  # in the target's pool (the engine reserved the step's writes per row)
            lm = self.lm
            if max_batch > self._pages.max_requests:
                raise ValueError(f"DraftModel: {max_batch} rows but the attached pages have "
                                 f"{self._pages.max_requests}")
            self.cache = DraftPages(self._pages, lm.num_layers, lm.num_kv_heads, lm.head_dim, lm.dtype).view()
        else:
            # committed text (<= max_len) plus one step's writes: padded first forward, then the step's nodes
            self.cache = self.lm.new_cache(max_batch, max_len + self._pend_cap + slots + 2)
        self._views = RowViews(self.cache)
        self.device = dev
        self.V = int(self.lm.vocab_size)
        #: target id of each column of the LM's reduced-vocabulary logits (None: the LM has none)
        self.draft_ids = getattr(self.lm, "draft_ids", None)
        self.spine_buffers = SpineBuffers(w, k, max_batch, self.max_nodes, dev)
        self._pend_n = torch.zeros(max_batch, dtype=torch.int64, device=dev)                  # pending per row
        self._pend_tok = torch.zeros(max_batch, self._pend_cap, dtype=torch.int64, device=dev)
        self._pend_width = 0   # host: upper bound of _pend_n over the active rows
        self._last = None
        self._behind = False
        # the learners learn this draft against this target: a new binding starts them afresh
        self.cal_table = Calibration(w, dev)
        self.rank_table = RankAcceptance(k, dev)

    def _view(self, b: int):
        return self._views(b)

    def _reduced(self) -> bool:
        """Whether this step's draft forwards may return logits over the LM's reduced vocabulary
        (``lm.draft_ids``, a feature head's draft vocabulary): greedy chains and spine trees without a stop
        threshold need only each level's top tokens, mapped to target ids (spine._draw_level)."""
        ids = self.draft_ids
        return ids is not None and self.params.greedy and not self.dynamic and self.stop_threshold is None \
            and self.top_k <= int(ids.numel()) < self.V  # (a map over the whole vocabulary: the expanded logits)

    def start(self, prompts: Sequence[Sequence[int]], params: SamplingParams, generator: torch.Generator) -> None:
        if self.cache is None:
            raise RuntimeError("DraftModel: not bound to a decoder (SpeculativeDecoder(target, drafter) binds it)")
        self.params = params
        self.generator = generator
        self.cache.reset()  # lazy: the first proposal that drafts feeds the prompts (see _catch_up)
        self._lens_host = None
        self._pend_n.zero_()
        self._pend_width = 0
        self._behind = True
        self._last = None

    def admit(self, rows: Sequence[int], prompts: Sequence[Sequence[int]]) -> None:
        """Requests join the batch. Lazy: their draft cache rows are emptied and the first proposal
        that drafts feeds the prompts (:meth:`_catch_up`), so a request the scheduler never drafts
        for (plain decoding, a drafter too slow for the batch) costs no draft prefill."""
        if self.cache is None:
            raise RuntimeError("DraftModel: not bound to a decoder (SpeculativeDecoder(target, drafter) binds it)")
        rows = [int(r) for r in rows]
        self.cache.reset(rows)
        self._lens_host = None
        idx = torch.tensor(rows, dtype=torch.int64, device=self.device)
        self._pend_n.index_fill_(0, idx, 0)
        self._behind = True

    def cancel(self) -> None:
        """Forget the last proposal (it will not be verified: a composite drafter rejected the step, or the
        engine runs a plain step instead). The next proposal catches up on whatever was emitted meanwhile."""
        rec = self._last
        if rec is not None and rec.k > 0 and rec.base is not None and self.cache is not None:
            self._view(rec.b).lens.copy_(rec.base)
            self._lens_host = None
        self._last = None
        self._behind = True

    def _host_lens(self) -> List[int]:
        if self._lens_host is None:
            self._lens_host = self.cache.lens.tolist()
        return self._lens_host

    def pending_catch_up(self, lengths: Sequence[int]) -> List[int]:
        if not self._behind or self.cache is None:
            return [0] * len(lengths)
        return [max(0, int(n) - h) for n, h in zip(lengths, self._host_lens())]

    # ------------------------------------------------------------------ step
    def propose(self, ctx: StepContext) -> Draft:
        b = len(ctx.request_ids)
        self.catch_up_seconds = 0.0
        self.catch_up_positions = 0
        self.prompt_seconds = 0.0
        if ctx.params is not None:
            self.params = ctx.params
        k = min(self.k, max(ctx.budgets))
        # the step's record so far: if drafting fails, cancel() rewinds the draft cache to its base
        step = self._last = Proposal(None, b=b, k=k)
        if k <= 0:  # nothing worth drafting (last token, or the scheduler chose a plain step)
            self._behind = True  # this step's root is not fed: the next draft catches up first
            step.tree = TokenTree.root_only(ctx.roots)
            return step
        limits = [max(0, min(k, int(x))) for x in ctx.budgets]  # per-row depth (the scheduler's choice)
        reduced = self._reduced()
        cache = self._view(b)
        if self._behind:
            t0 = time.perf_counter()
            last = self._catch_up(cache, ctx, step)
            self.catch_up_seconds = time.perf_counter() - t0
        else:
            step.base = cache.lens.clone()  # [b] int32: committed draft prefix (pending tokens excluded)
            last = feed_root(self.lm, cache, ctx.roots, b, self._pend_n, self._pend_tok, self._pend_width,
                             self.spine_buffers.depths1, reduced)
        if not self.dynamic:
            rec = propose_spine(self, ctx, k, b, cache, last, limits, reduced)
        elif not self.params.greedy and self.sampled_children:
            rec = self._propose_planned(ctx, k, b, cache, last, drawn=True)
        elif self.planned:
            rec = self._propose_planned(ctx, k, b, cache, last, drawn=False)
        else:
            rec = propose_dynamic(self, ctx, k, b, cache, last)
        rec.base = step.base
        if self.dynamic:
            if min(limits) < k:
                rec.tree = limit_depths(rec.tree, limits, k)
            if rec.cal_cell is not None:   # the emitted tree's parents (padding: -1), for the calibration counts
                rec.cal_parents = rec.tree.parents.to(torch.int64)
            if rec.node_rank is not None:  # children per node of the emitted tree, for the rank counts
                rec.kids = child_counts(rec.tree.parents)
        self._last = rec
        return rec

    def _catch_up(self, cache, ctx: StepContext, step: Proposal) -> torch.Tensor:
        """After steps that drafted nothing (plain steps, a cancelled proposal) and for rows that joined
        since (their prompts: admission is lazy): feed every committed token the draft cache lacks, then
        the root (:func:`~.cache.catch_up`; reads the draft lengths on the host once). Returns the draft
        logits after each row's root [b, V] and sets the step's base."""
        b = len(ctx.request_ids)
        have = self._host_lens()[:b]
        self._lens_host = None  # the catch-up moves them
        pages = self.cache.pages if isinstance(self.cache, DraftPagesView) else None
        last, self.catch_up_positions, self.prompt_seconds = catch_up(
            self.lm, self.cache, cache, ctx.sequences, have, b, self.V, self.device, self.catch_up_tokens,
            None if pages is None else pages.valid_prefix)
        if pages is not None:  # rows that just got their prompts: their keyed blocks now hold valid draft K/V
            for r in range(b):
                if have[r] == 0:
                    pages.mark_valid(r, len(ctx.sequences[r]) - 1)
        step.base = torch.tensor([len(s) - 1 for s in ctx.sequences], dtype=torch.int32, device=self.device)
        cache.lens.copy_(step.base + 1)
        self._pend_n[:b] = 0
        self._pend_width = 0
        self._behind = False
        return last

    def _propose_planned(self, ctx: StepContext, k: int, b: int, cache, last: torch.Tensor, drawn: bool
                         ) -> Proposal:
        """A planned tree (:mod:`.planned`): sampled (``drawn``, planned with SAMPLED_RANK_ACCEPT) or greedy
        (planned with the rank-acceptance table)."""
        n = self.max_nodes - 1
        if ctx.node_budget is not None:
            n = max(1, min(n, int(ctx.node_budget) - 1))
        acc = SAMPLED_RANK_ACCEPT if drawn else self.rank_table.next_table(self.learn_plan)
        return propose_planned(self, ctx, self._plan(n, k, acc), acc, n, k, b, cache, last, drawn)

    def _plan(self, n: int, k: int, acc: Tuple) -> Plan:
        """The planned shape of n draft nodes, at most k deep, under ``acc`` (:func:`~.planned.plan_levels`,
        at most ``top_k`` nodes expanded per level), cached."""
        key = (n, k, acc)
        plan = self._plans.get(key)
        if plan is None:
            plan = self._plans[key] = plan_levels(n, k, acc, self.top_k)
        return plan

    def _sampled_plan(self, n: int, k: int) -> Plan:
        return self._plan(n, k, SAMPLED_RANK_ACCEPT)

    _reach = staticmethod(estimated_reach)

    # ------------------------------------------------------------------ learners
    @property
    def calibration(self) -> Dict[str, List[List[float]]]:
        """The calibration counts, per rank (rows) and draft-probability bin (columns): candidates whose
        parent was accepted ("reached"), the accepted ones among them, and the sum of their q."""
        return self.cal_table.report()

    def rank_acceptance(self) -> Dict[str, list]:
        """What a planned greedy tree has measured, per depth (rows) and sibling rank (columns):
        ``reached`` (an accepted parent had a child of that rank), ``accepted``, and the table its plans
        now use (``planned``: per rank, or per depth and rank once learned)."""
        return self.rank_table.report()

    def _cal_update(self, path: torch.Tensor, on_path: torch.Tensor) -> None:
        rec = self._last
        self.cal_table.update(rec.cal_parents, rec.cal_cell, rec.cal_q, path, on_path)

    # views of the last proposal's record and of the learners' counts (introspection and tests)
    @property
    def _k_step(self) -> int:
        return 0 if self._last is None else self._last.k

    @property
    def _tree_cell(self) -> Optional[torch.Tensor]:
        return self._last.cal_cell

    @property
    def _tree_q(self) -> Optional[torch.Tensor]:
        return self._last.cal_q

    @property
    def _cal(self) -> torch.Tensor:
        return self.cal_table.counts

    # ------------------------------------------------------------------ verification result
    def accept(self, accepted: torch.Tensor, num_accepted: torch.Tensor, num_host: Sequence[int],
               foreign: Optional[Sequence[Sequence[int]]] = None) -> None:
        rec = self._last
        k = 0 if rec is None else rec.k
        b = 0 if rec is None else rec.b
        if k <= 0:
            self._take_foreign(b, foreign, own=None)
            return  # root-only step: every row finishes with it
        w = self.top_k
        cache = self._view(b)
        num = num_accepted.to(torch.int64)
        last = accepted.gather(1, num.view(b, 1)).view(b).to(torch.int64)   # last accepted node (0: none)
        if self.dynamic:
            N = accepted.shape[1]
            path = accepted[:, 1:].to(torch.int64)                                      # [b, N - 1]
            steps = torch.arange(N - 1, device=self.device).view(1, N - 1)
            on_path = (steps < num.view(b, 1)) & (path >= 0)                           # the accepted nodes
            if rec.cal_cell is not None:
                self._cal_update(path, on_path)
            if rec.node_rank is not None:
                self.rank_table.update(rec.kids, rec.node_rank, rec.node_depth, path, on_path)
            moves, in_cache = tree_moves(rec.slots, rec.forwarded, path, on_path)
        else:
            in_cache = spine_in_cache(num, last, k, w)
            moves = self.spine_buffers.identity[:b, :k + 1]
        cache.lens.copy_(rec.base + self._pend_n[:b].to(torch.int32))   # back to the root's position
        cache.commit(moves, in_cache.to(torch.int32))                      # lens += in_cache + 1
        own = (num > in_cache).to(torch.int64)
        self._pend_n[:b] = own
        self._pend_tok[:b, 0] = rec.tokens.gather(1, last.view(b, 1)).view(b)
        # host bound on pending tokens: chains know it exactly (all k accepted); trees assume one if any accepted
        if w == 1 and not self.dynamic:
            width = 1 if any(int(a) == k for a in num_host) else 0
        else:
            width = 1 if any(int(a) > 0 for a in num_host) else 0
        if own.device.type == "cpu":
            # host memory: the exact width costs no sync. The bound would feed [root, padding] to rows
            # with nothing pending: wasted work, and a draft that quantizes its activations per call
            # (the bundled int8 copy) would see the padding row in its scales
            width = int(own.max()) if b else 0
        self._pend_width = width
        self._take_foreign(b, foreign, own=own)

    def _take_foreign(self, b: int, foreign: Optional[Sequence[Sequence[int]]], own) -> None:
        """Append tokens accepted from other drafters' subtrees to the pending tokens of each row."""
        if own is None:  # root-only step: every row finishes with it, nothing to keep
            self._pend_width = 0
            return
        if not foreign or not any(len(f) for f in foreign):
            return
        if len(foreign) != b:
            raise ValueError(f"DraftModel.accept: foreign must hold one token list per active row ({b}), "
                             f"got {len(foreign)}")
        most = max(len(f) for f in foreign)
        if 1 + most > self._pend_cap:
            raise ValueError(f"DraftModel.accept: {most} foreign tokens for one row exceed the {self._pend_cap - 1} "
                             f"reserved (reserve_foreign before bind)")
        for r, f in enumerate(foreign):
            if not f:
                continue
            start = self._pend_n[r]
            idx = start + torch.arange(len(f), device=self.device)
            self._pend_tok[r].scatter_(0, idx, torch.tensor(list(f), dtype=torch.int64, device=self.device))
            self._pend_n[r] += len(f)
        self._pend_width = min(self._pend_cap, self._pend_width + most)

    def retire(self, moves: Sequence[Tuple[int, int, int]], active: int) -> None:
        move_cache_rows(self.cache, moves)
        self._lens_host = None
        for src, dst, _ in moves:
            self._pend_n[dst] = self._pend_n[src]
            self._pend_tok[dst] = self._pend_tok[src]
