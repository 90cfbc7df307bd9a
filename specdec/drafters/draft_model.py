"""DraftModel: a smaller LM (same vocabulary) drafts per step, as a chain, a spine tree or a dynamic tree.

Chains and spine trees (``tree="spine"``): k forwards of ONE node each -- the root (see
"pending" below), then the spine tokens s_1 .. s_{k-1} -- each giving the draft distribution
after the spine so far. Greedy takes its argmax as the next spine token; sampling draws it
from q = warp(draft logits) (the target's temperature / top-k / top-p, a seeded generator)
and writes q into that node's row of ``draft_probs`` (the distribution the token was
really drawn from, as exact rejection sampling needs).

``top_k = w > 1`` with ``tree="spine"`` adds, at every depth, w - 1 sibling LEAVES next to
the spine token (greedy: the next most likely draft tokens; sampling: further independent
draws from the same q, kept as separate nodes even when equal -- SpecInfer's condition for
exactness). The drafting cost is unchanged (still k one-node forwards: only the spine is
expanded), the target verifies 1 + k * w nodes. Node (depth d, slot s) has index
1 + (d - 1) * w + s; slot 0 is the spine.

Dynamic trees (``tree="dynamic"``, EAGLE-2's expand + re-rank): depth 1 is the top w
children of the root; at each further depth ONE draft forward runs over the current frontier
(w nodes per request) -- they attend to the committed prefix, the root and their ancestors
drafted earlier in this step, which sit past ``cache.lens`` (``forward(..., kv_offset=...)``
and a [b, w, kv_offset + w] mask: verify_attention's frontier form), so no earlier depth is
ever recomputed. Each frontier node gets its top w children, scored by cumulative draft
log-probability (sum of log q along the path); the best w of all those children form the next
frontier. After depth k the whole pool (w + (k - 1) w^2 candidates) is re-ranked to the
``node_budget - 1`` best nodes: a child never scores above its parent and ties keep pool
order (a stable sort; parents are created first), so the best-n set is a connected subtree;
it is emitted in pool order, which is topological. k draft forwards per step, like a chain.

Calibrated ranking (greedy rule, ``calibrate=True``, the default). EAGLE-2 ranks by cumulative
draft probability, which assumes the draft is calibrated: a child with draft probability q is
accepted with probability q. Under greedy verification a child is accepted when it IS the
target's argmax, and a draft close to the target (the bundled w8 draft, a weight-quantized copy)
has its argmax right far more often than its q says (an exploratory run, 6 open prompts: first
children with q in [1/4, 1/2) accepted 112 times of 120 against a q sum of 43). Ranked by q, its
8-node tree cuts the spine for unlikely siblings.
So every candidate falls in a cell (its rank among its parent's top-w children, its q in halving
bins) and the drafter counts, after each verification, the cell's candidates whose parent was
accepted (reached), the accepted ones among them, and their summed q (device scatters, no host
read). A candidate's estimated acceptance is min(1, q * accepted / sum q) of its cell, shrunk
towards factor 1 with _CAL_PRIOR pseudo-observations; path scores sum the logs of these
estimates (each <= 0, so a child never outranks its parent and the best-n set stays connected).
The within-bin order still follows q, and a calibrated draft keeps EAGLE-2's ranking. Recorded
in benchmarks/results/trees_calibrated_2026-12-02.json (6 open prompts, 64 tokens, greedy, batch 1,
fixed policy), mean accepted length, calibrated vs ranked by q: w8 draft, 8 nodes (k 5, w 2) 5.32
vs 4.40 (chain of 8: 6.52; k 7, w 2: 6.30); int8 draft, 16 nodes 3.53 vs 3.44 (chain: 3.50), 32
nodes 4.06 vs 4.06. Exactness does not depend on the ranking: the children are still the
deterministic top-w of q, and the tree's shape is a function of earlier steps only.

Sampling exactness of dynamic trees. The rejection sampler (SpecInfer multi-step,
``rejection_sample``) tries a node's children in index order against the current residual p'
(accept x with probability min(1, p'(x) / q_c(x)); after a rejection p' <- norm(max(0, p' - q_c)),
q_c one-hot for a deterministic candidate). It emits exactly one token distributed as p if every
child, at the moment it is tested, is either DETERMINISTIC given everything decided before it or
DRAWN from its declared q_c independently of everything after it -- and is never dropped or
reordered because of its own drawn value (that would skew the drawn value away from q_c). Given a
rejection, the rest of the sibling list sees the residual whatever it holds, so the list may be
built adaptively from earlier siblings' values. Two rules satisfy this:

* greedy rule (greedy decoding, and sampling with ``sampled_children=False``): all children are
  deterministic (the top-w tokens of q, a function of the context with fixed tie-breaking), so
  re-ranking and pruning by score are harmless; ``draft_probs`` is None.
* sampled rule (sampling, default): the tree's level sizes are fixed before any draw: a static
  plan per (node budget, depth) that maximises the expected accepted length under prior per-rank
  acceptances (``SAMPLED_RANK_ACCEPT``), at most w nodes expanded per depth
  (:meth:`DraftModel._sampled_plan`) with their child counts: a spine of first-drawn children,
  with siblings where their path probability is highest. WHICH nodes of a level are expanded is
  chosen after that level is drawn (EAGLE-2's frontier: the f nodes most likely to be reached,
  estimated from each drawn token's draft probability and its rank among its siblings,
  :meth:`DraftModel._reach`; the most likely gets the most children). That choice reads drawn
  values of the level, but it only decides which nodes get CHILDREN: a node's existence depends
  on its ancestors and their siblings, all drawn before it, never on its own value, and no
  drawn node is ever dropped. An expanded node's children are DRAWN from q without
  replacement: child i from q renormalised over the tokens its earlier siblings drew, which is
  its row of ``draft_probs`` (drawn from its declared q given everything before it, as the rule
  above asks). Nothing is pruned. The drawn first child is accepted with probability
  sum(min(p, q)), which a deterministic top-1 child cannot reach at temperature 1; a later
  sibling, tested against the residual, with sum(min(p', q_i)). The earlier shape spread the
  nodes evenly over the depths and expanded the best-scored by draft probability, which cut the
  spine of drawn tokens, and made the siblings deterministic. Measured with the bundled int8
  draft at temperature 1 (6 open prompts, 64 tokens, the same 7 seeds for both): mean accepted
  length at 16 nodes 2.52 -> 2.73 (the two seed sets: 2.59 -> 2.67 and 2.46 -> 2.77). Against a
  chain of 16 nodes, which runs 15 draft forwards to the tree's 6: 1.00x on those seeds, 0.90x on
  7 others (benchmarks/results/trees_sampled_2026-12-02.json); runs of this size vary by ~10 %.

The draft's scores use the warped distribution (temperature / top-k / top-p) under sampling
and the raw softmax under greedy.

Cache invariant (per request, between steps): the draft cache holds every committed
token except the root and, possibly, some "pending" tokens before it: the last accepted
draft node when it has no K/V in the draft cache (s_k, a sibling leaf, a leaf of a dynamic
tree), and -- inside :class:`~specdec.MultiDraft` -- tokens accepted from other drafters'
subtrees (``accept(..., foreign=...)``). A step feeds ``[pending..., root]`` as one chain in
its first forward instead of ``[root]`` (rows with fewer pending tokens are right-padded),
so no forward is ever spent on catching up.

Rollback after verification: ``kv_commit`` keeps the root and the accepted path's nodes that
have K/V in the draft cache (spine: identity moves; dynamic: the frontier slots of the
accepted nodes, general moves); what remains of the accepted path becomes pending.

Confidence stop (``stop_threshold``, off by default, spine/chain only): a row stops drafting
after a spine token whose draft probability is below the threshold (the token itself is still
proposed: dropping it would bias the sampled distribution), and the step stops when
every row has stopped. Rows that stopped early get padding nodes. Deciding to stop
reads the confidences on the host once per draft forward (free on CPU; on CUDA a
synchronisation per draft token -- keep it off there unless drafts are long).
"""
from __future__ import annotations

import functools
import math
import time

from typing import Dict, List, Optional, Sequence, Tuple

import torch

from specdec.cache import move_cache_rows
from specdec.drafters.base import Draft, Drafter, StepContext
from specdec.sampling import SamplingParams, sample_tokens, warp_
from specdec.tree import TokenTree, ancestor_mask, plan_tree

__all__ = ["DraftModel"]

_TREES = ("spine", "dynamic", "planned")

#: Prior P(a node's r-th child is accepted | the node is accepted) that plans the shape of a sampled
#: dynamic tree (:meth:`DraftModel._sampled_plan`; children drawn from q without replacement). The
#: bundled int8 draft at temperature 1: the first child ~0.6 (a chain's first position, 0.59 in the
#: loop), a later sibling ~0.2 of the remaining probability (P(accepted | the siblings before it
#: were rejected): 0.22 measured offline from the two models' distributions). At most
#: len(SAMPLED_RANK_ACCEPT) children per node.
SAMPLED_RANK_ACCEPT = (0.6, 0.08, 0.05, 0.03)

#: Prior P(a node's r-th child is accepted | the node is accepted) that plans the shape of a greedy
#: planned tree (``tree="planned"``, :meth:`DraftModel._plan`; children are the draft's top-ranked
#: tokens, and the r-th is accepted when it IS the target's argmax, so the values are marginal: the
#: siblings exclude each other). Measured on the bundled int8 draft along the target's greedy text of
#: 12 open prompts (an exploratory run: the 6 of benchmarks/bench_e2e.OPEN and 6 more): the draft's top
#: token is the target's 0.73 of the time; given that the ranks before it were not, rank 1 is 0.44,
#: rank 2 0.37, rank 3 0.34, rank 4 0.23 -- so P(rank r) = 0.73, 0.27 x 0.44, ...
#: (`python benchmarks/tree_ceiling.py --mode greedy` on the 6 OPEN prompts alone,
#: results/tree_ceiling_greedy_2026-12-03.json: 0.727, 0.448, 0.293, 0.317.) An exact replay of the
#: draft's ranks along those 12 texts (the same texts, not held out) put the 16 / 32-node plans at
#: 1.09-1.10x / 1.30-1.31x a chain on either half; in the loop, results/trees_planned_2026-12-03b.json.
GREEDY_RANK_ACCEPT = (0.73, 0.119, 0.056, 0.032, 0.015)

#: Planned greedy trees count, after every verification and per (depth, sibling rank), the children
#: whose parent was accepted (reached) and the accepted ones (device adds, no host read;
#: DraftModel.rank_acceptance()). With learn_plan=True they re-plan every _PLAN_EVERY planned steps
#: with (accepted + _PLAN_PRIOR x prior) / (reached + _PLAN_PRIOR) per cell, rounded to 0.01 (one host
#: read of the 2 x k x len(GREEDY_RANK_ACCEPT) counts; plans are cached per rounded table). A draft
#: whose argmax is nearly always the target's learns a spine; a weaker one keeps more siblings.
_PLAN_EVERY = 16
_PLAN_PRIOR = 32.0

#: Calibrated ranking of greedy-rule dynamic trees: candidates fall in cells (rank among their parent's
#: top-w children, draft probability q in _CAL_BUCKETS halving bins: [1/2, 1], [1/4, 1/2), ..., below
#: 2^-(_CAL_BUCKETS - 1)); a cell's correction factor (accepted / sum of q over its reached candidates)
#: starts at 1, worth _CAL_PRIOR observations at the bin's middle probability.
_CAL_BUCKETS = 10
_CAL_PRIOR = 4.0


@functools.lru_cache(maxsize=64)
def _sibling_consts(counts: Tuple[int, ...], device: str) -> Tuple[torch.Tensor, torch.Tensor]:
    """For children grouped by parent (``counts`` per parent): [c] bool, the first child of its parent; and
    [c, c] float32 E with E[j, i] = 1 when j is an earlier sibling of i (so x @ E sums x over earlier siblings).
    Built once per plan level (the plans are fixed), not per step."""
    grp = torch.tensor([j for j, n in enumerate(counts) for _ in range(n)])
    first = torch.tensor([i == 0 for n in counts for i in range(n)])
    idx = torch.arange(len(grp))
    earlier = (grp.view(-1, 1) == grp.view(1, -1)) & (idx.view(-1, 1) < idx.view(1, -1))
    return first.to(device), earlier.to(torch.float32).to(device)


@functools.lru_cache(maxsize=256)
def _top_consts(counts: Tuple[int, ...], cmax: int, acc: Tuple[float, ...], device: str
                ) -> Tuple[Tuple[int, ...], torch.Tensor, torch.Tensor]:
    """For the greedy children of a planned level (``counts`` per parent, at most cmax of each parent's
    top-cmax): the parent index of each child, its index into the flattened [f * cmax] top-k, and log of
    its rank's planned acceptance. Built once per (level shape, table), not per step."""
    par = tuple(j for j, c in enumerate(counts) for _ in range(c))
    sib = [i for c in counts for i in range(c)]
    flat = torch.tensor([j * cmax + i for j, i in zip(par, sib)], dtype=torch.int64, device=device)
    prior = torch.tensor([math.log(max(acc[i], 1e-4)) if i < len(acc) else math.log(1e-4) for i in sib],
                         dtype=torch.float32, device=device)
    return par, flat, prior


def _limit_depths(draft: Draft, limits: Sequence[int], k: int) -> Draft:
    """Pad a dynamic tree's nodes deeper than each row's limit (the scheduler's per-row depth). Nodes are
    in non-decreasing depth order, so the padding is a suffix of every row and the rest stays connected."""
    tree = draft.tree
    b = tree.tokens.shape[0]
    lim = torch.tensor(list(limits), dtype=torch.int32, device=tree.tokens.device).view(b, 1)
    real = tree.depths <= lim                                            # [b, N]
    depths = torch.where(real, tree.depths, 0)
    sizes, deepest = torch.stack([real.sum(dim=1), depths.amax(dim=1).to(torch.int64)]).tolist()
    parents = torch.where(real, tree.parents, -1)
    new = TokenTree(torch.where(real, tree.tokens, -1), parents, depths, sizes, is_chain=False,
                    _mask=ancestor_mask(parents, max_depth=k), max_depths=deepest)
    return Draft(new, draft.draft_probs)


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
        token plus w - 1 sibling leaves per depth) or a dynamic tree (w frontier nodes expanded
        per depth, w children each).
    node_budget : int, optional
        Spine: cap on tree nodes (root included), k is lowered to (node_budget - 1) // top_k.
        Dynamic: the tree is re-ranked to this many nodes (root included; default 1 + k * top_k,
        at most the 1 + top_k + (k - 1) * top_k^2 candidates a step produces).
    stop_threshold : float, optional
        Chains / spine trees: stop a row's chain after a drafted token whose draft probability is
        below this (greedy: the draft's softmax probability of its argmax; sampling: q of the
        drawn token). None: always draft k tokens.
    tree : "spine" or "dynamic"
        The tree shape for top_k > 1 (see the module docstring). Default "spine".
    sampled_children : bool
        Dynamic trees under sampling: True (default) draws the first child of every expanded node
        from q and fixes the tree's shape before any draw (no pruning); False uses the greedy rule
        (deterministic top-k children + re-rank) under sampling too. Both are exact.
    calibrate : bool
        Dynamic trees under the greedy rule: rank candidates by their MEASURED acceptance (default True;
        see "Calibrated ranking" in the module docstring) instead of their draft probability (False:
        EAGLE-2's cumulative log q).
    learn_plan : bool
        ``tree="planned"`` under the greedy rule: re-plan the shape from this drafter's own measured
        acceptance per (depth, sibling rank) every _PLAN_EVERY steps (default False: the shape of
        GREEDY_RANK_ACCEPT, fitted to the bundled int8 draft; see ``rank_acceptance()``).
    """

    trusted = True

    def __init__(self, lm, k: int = 4, top_k: int = 1, node_budget: Optional[int] = None,
                 stop_threshold: Optional[float] = None, tree: str = "spine", sampled_children: bool = True,
                 calibrate: bool = True, learn_plan: bool = False) -> None:
        for name, v in (("k", k), ("top_k", top_k)):
            if isinstance(v, bool) or not isinstance(v, int):
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
            if isinstance(node_budget, bool) or not isinstance(node_budget, int) or node_budget < 2:
                raise ValueError(f"DraftModel: node_budget must be an int >= 2 (root + one node), got {node_budget!r}")
            self.max_nodes = 1 + min(node_budget - 1, pool)
        else:
            if node_budget is not None:
                if isinstance(node_budget, bool) or not isinstance(node_budget, int) or node_budget < 1 + top_k:
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
        self._cal = None          # [3, top_k * _CAL_BUCKETS] float32: reached, accepted, reached sum of q
        self._cal_step = False    # the last proposal was a calibrated greedy-rule dynamic tree
        self._plans: Dict[Tuple, List[Tuple[List[int], List[int]]]] = {}
        self.cache = None
        self._views: Dict[int, object] = {}
        self._foreign = 0  # tokens from other drafters' subtrees that accept() may pass per row
        self.catch_up_tokens = 512  # positions (rows x width) per catch-up forward: bounds its activations
        # host copy of cache.lens while the drafter is behind and nothing moves them (plain steps): the
        # scheduler asks for the pending catch-up every such step, one device read serves them all
        self._lens_host: Optional[List[int]] = None

    def __repr__(self) -> str:
        stop = "" if self.stop_threshold is None else f", stop_threshold={self.stop_threshold}"
        shape = f", tree={self.tree!r}, node_budget={self.max_nodes}" if self.dynamic else ""
        return f"DraftModel(k={self.k}, top_k={self.top_k}{shape}{stop})"

    # ------------------------------------------------------------------ setup
    def reserve_foreign(self, n: int) -> None:
        self._foreign = max(self._foreign, int(n))

    def bind(self, target, max_batch: int, max_len: int) -> None:
        if int(self.lm.vocab_size) != int(target.vocab_size):
            raise ValueError(f"DraftModel: draft vocabulary size {self.lm.vocab_size} != target vocabulary size "
                             f"{target.vocab_size}; the draft must share the target's tokenizer")
        if torch.device(self.lm.device) != torch.device(target.device):
            raise ValueError(f"DraftModel: draft model on {self.lm.device} but target on {target.device}")
        dev = torch.device(self.lm.device)
        k, w = self.k, self.top_k
        V = int(self.lm.vocab_size)
        self._slots = (k - 1) * w if self.dynamic else k  # step nodes written past the root
        self._pend_cap = 1 + self._foreign                # most pending tokens per row
        # committed text (<= max_len) plus one step's writes: padded first forward, then the step's nodes
        self.cache = self.lm.new_cache(max_batch, max_len + self._pend_cap + self._slots + 2)
        self._views = {}
        self.device = dev
        self.V = V
        self._tokens = torch.zeros(max_batch * self.max_nodes, dtype=torch.int64, device=dev)  # flat [b, N]
        self._probs_flat: Optional[torch.Tensor] = None  # flat [b, N, V], allocated on the first sampled step
        self._pend_n = torch.zeros(max_batch, dtype=torch.int64, device=dev)                  # pending per row
        self._pend_tok = torch.zeros(max_batch, self._pend_cap, dtype=torch.int64, device=dev)
        self._pend_width = 0   # host: upper bound of _pend_n over the active rows
        self._depths1 = torch.zeros(max_batch, 1, dtype=torch.int32, device=dev)
        self._identity = torch.arange(k + 1, dtype=torch.int32, device=dev).expand(max_batch, k + 1).contiguous()
        self._shapes: Dict[Tuple[int, int], Tuple[torch.Tensor, ...]] = {}
        self._k_step = 0
        self._b = 0
        self._behind = False
        # calibration counts learn this draft against this target: a new binding starts them afresh
        self._cal = torch.zeros(3, w * _CAL_BUCKETS, dtype=torch.float32, device=dev)
        self._cal_step = False
        mid = torch.pow(2.0, -torch.arange(_CAL_BUCKETS, dtype=torch.float32, device=dev) - 0.5)  # bin middles
        self._cal_pseudo = _CAL_PRIOR * mid.repeat(w)       # prior: _CAL_PRIOR observations at factor 1
        self._cal_rank = torch.arange(w, device=dev) * _CAL_BUCKETS   # first cell of each sibling rank
        # planned greedy trees: per (depth, sibling rank), [reached (the parent was accepted and had a
        # child of that rank), accepted]; a new binding starts them afresh, like the calibration counts
        self._rank_counts = torch.zeros(2, k, len(GREEDY_RANK_ACCEPT), dtype=torch.float32, device=dev)
        self._rank_acc = GREEDY_RANK_ACCEPT
        self._plan_steps = 0
        self._plan_step = False

    def _view(self, b: int):
        view = self._views.get(b)
        if view is None:
            view = self._views[b] = self.cache.rows(0, b)
        return view

    def _shape(self, b: int, depth: int) -> Tuple[torch.Tensor, ...]:
        """Constant structure of a spine tree of ``depth`` levels: parents, depths [b, N], mask [b, N, N] or None."""
        key = (b, depth)
        consts = self._shapes.get(key)
        if consts is None:
            w = self.top_k
            N = 1 + depth * w
            parents = [-1] + [0 if d == 1 else 1 + (d - 2) * w for d in range(1, depth + 1) for _ in range(w)]
            depths = [0] + [d for d in range(1, depth + 1) for _ in range(w)]
            par = torch.tensor(parents, dtype=torch.int32, device=self.device)
            dep = torch.tensor(depths, dtype=torch.int32, device=self.device)
            mask = None
            if w > 1:
                mask = ancestor_mask(par.view(1, N)).expand(b, N, N).contiguous()
            consts = (par.expand(b, N).contiguous(), dep.expand(b, N).contiguous(), mask)
            self._shapes[key] = consts
        return consts

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
        self._k_step = 0

    # ------------------------------------------------------------------ step
    def _feed_root(self, roots: torch.Tensor, b: int, cache) -> torch.Tensor:
        """First forward of a step: [pending..., root] per row (right-padded). Returns the logits after
        the root [b, V]; cache.lens then counts the pending tokens and the root."""
        P = self._pend_width
        if P == 0:
            last = self.lm.forward(cache, roots.view(b, 1), self._depths1[:b], None)[:, 0]  # [b, V]
            cache.lens.add_(1)
            return last
        pn = self._pend_n[:b]                                               # [b]
        j = torch.arange(P + 1, device=self.device).view(1, P + 1)
        x = torch.full((b, P + 1), -1, dtype=torch.int64, device=self.device)
        x[:, :P] = self._pend_tok[:b, :P]
        x = torch.where(j < pn.view(b, 1), x, torch.where(j == pn.view(b, 1), roots.view(b, 1), -1))
        depths = j.to(torch.int32).expand(b, P + 1)
        logits = self.lm.forward(cache, x, depths, None)                    # [b, P + 1, V]
        cache.lens.add_((pn + 1).to(torch.int32))
        return logits[torch.arange(b, device=self.device), pn]              # [b, V] after the root

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
        if self._k_step > 0 and self.cache is not None:
            self._view(self._b).lens.copy_(self._base)
            self._lens_host = None
        self._k_step = 0
        self._behind = True

    def _host_lens(self) -> List[int]:
        if self._lens_host is None:
            self._lens_host = self.cache.lens.tolist()
        return self._lens_host

    def pending_catch_up(self, lengths: Sequence[int]) -> List[int]:
        if not self._behind or self.cache is None:
            return [0] * len(lengths)
        return [max(0, int(n) - h) for n, h in zip(lengths, self._host_lens())]

    def propose(self, ctx: StepContext) -> Draft:
        b = len(ctx.request_ids)
        self.catch_up_seconds = 0.0
        self.catch_up_positions = 0
        if ctx.params is not None:
            self.params = ctx.params
        k = min(self.k, max(ctx.budgets))
        self._b = b
        self._k_step = k
        self._cal_step = False
        self._plan_step = False
        if k <= 0:  # nothing worth drafting (last token, or the scheduler chose a plain step)
            self._behind = True  # this step's root is not fed: the next draft catches up first
            return Draft(TokenTree.root_only(ctx.roots))
        limits = [max(0, min(k, int(x))) for x in ctx.budgets]  # per-row depth (the scheduler's choice)
        cache = self._view(b)
        if self._behind:
            t0 = time.perf_counter()
            last = self._catch_up(cache, ctx)
            self.catch_up_seconds = time.perf_counter() - t0
        else:
            self._base = cache.lens.clone()  # [b] int32: committed draft prefix (pending tokens excluded)
            last = self._feed_root(ctx.roots, b, cache)
        if self.dynamic:
            if not self.params.greedy and self.sampled_children:
                draft = self._propose_planned(ctx, k, b, cache, last, drawn=True)
            elif self.planned:
                draft = self._propose_planned(ctx, k, b, cache, last, drawn=False)
                self._plan_step = True
            else:
                draft = self._propose_dynamic(ctx, k, b, cache, last)
            if min(limits) < k:
                draft = _limit_depths(draft, limits, k)
            if self._cal_step:   # the emitted tree's parents (padding: -1), for the calibration counts
                self._tree_parents = draft.tree.parents.to(torch.int64)
            if self._plan_step:  # children per node of the emitted tree (padding excluded), for the rank counts
                par = draft.tree.parents.to(torch.int64)
                n = par.shape[1]
                kids = torch.zeros(b, n + 1, dtype=torch.int64, device=par.device)
                kids.scatter_add_(1, torch.where(par >= 0, par, n), torch.ones_like(par))
                self._node_kids = kids[:, :n]
            return draft
        return self._propose_spine(ctx, k, b, cache, last, limits)

    def _catch_up(self, cache, ctx: StepContext) -> torch.Tensor:
        """After steps that drafted nothing (plain steps, a cancelled proposal) and for rows that joined
        since (their prompts: admission is lazy): feed every committed token the draft cache lacks,
        then the root, as one chain per row (reads the draft lengths on the host once). Returns the
        draft logits after each row's root [b, V]. Rows are right-padded to the longest; the chains go
        in chunks of at most ``catch_up_tokens`` positions per forward (all rows together), and
        sooner when the padding of a row would run past the cache's capacity. With an LM that has
        ``forward_last`` (HFCausalLM) only the logits after each row's last fed token are computed."""
        b = len(ctx.request_ids)
        have = self._host_lens()[:b]
        self._lens_host = None  # the catch-up moves them
        # rows that joined since (empty draft rows): their prompts (all but the root) go through the LM's
        # own prefill, grouped and chunked as it does for a target, as an eager admission would have
        fresh = [r for r in range(b) if have[r] == 0 and len(ctx.sequences[r]) > 1]
        if fresh:
            self.lm.prefill(self.cache, [list(ctx.sequences[r][:-1]) for r in fresh], rows=fresh)
            have = cache.lens.tolist()
        rows = [list(seq[h:]) for seq, h in zip(ctx.sequences, have)]   # [pending..., skipped roots..., root]
        self.catch_up_positions = sum(len(r) for r in rows) + sum(len(ctx.sequences[r]) - 1 for r in fresh)
        cap = self.cache.capacity
        done = [0] * b                                                   # tokens of each row fed so far
        last = torch.empty(b, self.V, dtype=torch.float32, device=self.device)
        forward_last = getattr(self.lm, "forward_last", None)
        per_forward = max(1, self.catch_up_tokens // max(1, b))
        while True:
            left = [len(r) - d for r, d in zip(rows, done)]
            if max(left) <= 0:
                break
            room = min(cap - h - d for h, d in zip(have, done))
            width = max(1, min(max(left), room, per_forward))
            chunk = [r[d:d + width] for r, d in zip(rows, done)]
            x = torch.tensor([c + [-1] * (width - len(c)) for c in chunk], dtype=torch.int64, device=self.device)
            depths = torch.arange(width, dtype=torch.int32, device=self.device).expand(b, width).contiguous()
            ends = [r for r in range(b) if chunk[r] and done[r] + len(chunk[r]) == len(rows[r])]
            pos = torch.tensor([max(0, len(c) - 1) for c in chunk], dtype=torch.int64, device=self.device)
            if forward_last is not None:
                got = forward_last(cache, x, depths, pos)                                   # [b, V]
            else:
                got = self.lm.forward(cache, x, depths, None)[torch.arange(b, device=self.device), pos]
            if ends:
                sel = torch.tensor(ends, dtype=torch.int64, device=self.device)
                last.index_copy_(0, sel, got[sel].float())
            cache.lens.add_(torch.tensor([len(c) for c in chunk], dtype=torch.int32, device=self.device))
            done = [d + len(c) for d, c in zip(done, chunk)]
        self._base = torch.tensor([len(s) - 1 for s in ctx.sequences], dtype=torch.int32, device=self.device)
        cache.lens.copy_(self._base + 1)
        self._pend_n[:b] = 0
        self._pend_width = 0
        self._behind = False
        return last

    def _propose_spine(self, ctx: StepContext, k: int, b: int, cache, last: torch.Tensor,
                       limits: Sequence[int]) -> Draft:
        lm = self.lm
        w = self.top_k
        sampling = not self.params.greedy
        N = 1 + k * w
        tokens = self._tokens[: b * N].view(b, N)       # node (d, s) at 1 + (d - 1) * w + s; spine: s = 0
        tokens[:, 0] = ctx.roots
        probs = None
        if sampling:
            need = b * N * self.V
            if self._probs_flat is None or self._probs_flat.numel() < need:
                self._probs_flat = torch.zeros(self._tokens.numel() * self.V, dtype=torch.float32,
                                               device=self.device)
            probs = self._probs_flat[:need].view(b, N, self.V)
        stop = self.stop_threshold
        if stop is not None:
            alive = torch.ones(b, dtype=torch.bool, device=self.device)      # [b] still drafting
            lengths = torch.zeros(b, dtype=torch.int64, device=self.device)  # [b] spine tokens per row
        limited = min(limits) < k
        k_run = k
        for i in range(1, k + 1):
            first = 1 + (i - 1) * w                                        # node index of spine token i
            if sampling:
                q = probs[:, first]                                        # [b, V] view, written in place
                q.copy_(last)
                warp_(q, self.params)
                if w == 1:
                    d = sample_tokens(q, self.generator)
                    tokens[:, first] = d
                else:  # siblings: independent draws from the same q (kept separate even when equal)
                    probs[:, first + 1:first + w] = q.unsqueeze(1)
                    draws = torch.multinomial(q, w, replacement=True, generator=self.generator)  # [b, w]
                    tokens[:, first:first + w] = draws
                    d = draws[:, 0]
            else:
                if w == 1:
                    d = last.argmax(dim=-1)
                    tokens[:, first] = d
                else:  # the w most likely tokens; the argmax continues the spine
                    top = torch.topk(last, w, dim=-1).indices                 # [b, w]
                    tokens[:, first:first + w] = top
                    d = top[:, 0]
            if stop is not None:
                if sampling:
                    conf = q.gather(1, d.view(b, 1)).view(b)
                else:  # softmax probability of the argmax: exp(max - logsumexp)
                    conf = torch.exp(last.gather(1, d.view(b, 1)).view(b) - torch.logsumexp(last, dim=-1))
                lengths += alive
                alive &= conf >= stop
                if i < k and not bool(alive.any()):  # host read: every row has stopped
                    k_run = i
                    break
            if i < k:
                last = lm.forward(cache, d.view(b, 1), self._depths1[:b], None)[:, 0]
                cache.lens.add_(1)
        self._k_step = k_run
        self._step_tokens = tokens
        n = 1 + k_run * w
        parents, depths, mask = self._shape(b, k_run)
        if stop is None and not limited:
            tree = TokenTree(tokens, parents, depths, [N] * b, is_chain=w == 1, _mask=mask, max_depths=[k] * b)
            return Draft(tree, probs)
        if stop is None:
            spine = [min(x, k_run) for x in limits]
            lengths = torch.tensor(spine, dtype=torch.int64, device=self.device)
        else:
            if limited:
                lengths = torch.minimum(lengths, torch.tensor(limits, dtype=torch.int64, device=self.device))
            spine = lengths.tolist()
        real = depths <= lengths.view(b, 1)  # [b, n]: nodes within the row's spine
        tree = TokenTree(torch.where(real, tokens[:, :n], -1), torch.where(real, parents, -1),
                         torch.where(real, depths, 0), [1 + x * w for x in spine],
                         is_chain=w == 1, _mask=mask, max_depths=spine)
        return Draft(tree, None if probs is None else probs[:, :n].contiguous())

    def _scores(self, logits: torch.Tensor) -> torch.Tensor:
        """Draft log-probabilities [..., V] that rank candidates (warped under sampling)."""
        if self.params.greedy:
            return torch.log_softmax(logits.float(), dim=-1)
        return torch.log(warp_(logits.to(torch.float32, copy=True), self.params))

    @staticmethod
    def _cal_bucket(logq: torch.Tensor) -> torch.Tensor:
        """The probability bin of draft log-probabilities: floor(-log2 q), at most _CAL_BUCKETS - 1."""
        return (logq * (-1.0 / math.log(2.0))).clamp_(0.0, _CAL_BUCKETS - 1).to(torch.int64)

    def _cal_log_ratios(self) -> torch.Tensor:
        """log of each calibration cell's correction factor [top_k * _CAL_BUCKETS]: a candidate of the cell
        is estimated to be accepted (given its parent is) with probability min(1, q * factor), factor =
        accepted / (sum of q) over the cell's reached candidates, shrunk towards 1 (_CAL_PRIOR observations
        at the bin's middle probability). A calibrated draft keeps EAGLE-2's ranking (factor 1); a draft
        whose argmax is right more often than its q says (a quantized copy of the target) gets deep
        spines instead of unlikely siblings."""
        return ((self._cal[1] + self._cal_pseudo) / (self._cal[2] + self._cal_pseudo)).log_()

    @property
    def calibration(self) -> Dict[str, List[List[float]]]:
        """The calibration counts, per rank (rows) and draft-probability bin (columns): candidates whose
        parent was accepted ("reached"), the accepted ones among them, and the sum of their q."""
        seen, hit, mass = self._cal.view(3, self.top_k, _CAL_BUCKETS).tolist()
        return {"reached": seen, "accepted": hit, "reached_q": mass}

    def _cal_update(self, path: torch.Tensor, on_path: torch.Tensor) -> None:
        """Count, for every node of the last calibrated tree whose parent lies on the accepted path (or is
        the root), whether it was accepted. ``path`` [b, P]: accepted node indices, valid where ``on_path``.
        Device-side scatters only (no host read)."""
        tree_par = self._tree_parents                                       # [b, N] int64, -1: root / padding
        b, N = tree_par.shape
        on = torch.zeros(b, N + 1, dtype=torch.bool, device=self.device)
        on[:, 0] = True
        on.scatter_(1, torch.where(on_path & (path < N), path, N), True)
        on = on[:, :N]
        cell = self._tree_cell
        reached = (tree_par >= 0) & (cell >= 0) & on.gather(1, tree_par.clamp(min=0))
        flat = cell.clamp(min=0).view(-1)
        self._cal[0].scatter_add_(0, flat, reached.view(-1).to(torch.float32))
        self._cal[1].scatter_add_(0, flat, (reached & on).view(-1).to(torch.float32))
        self._cal[2].scatter_add_(0, flat, torch.where(reached, self._tree_q, 0.0).view(-1))

    def _propose_dynamic(self, ctx: StepContext, k: int, b: int, cache, last: torch.Tensor) -> Draft:
        """EAGLE-2-style expand (w frontier nodes per depth, one forward each) + re-rank (see module docstring)."""
        w = self.top_k
        dev = self.device
        F = (k - 1) * w                       # frontier nodes that get forwarded (K/V in the draft cache)
        M = w + (k - 1) * w * w               # candidate pool
        pool_tok = torch.empty(b, M, dtype=torch.int64, device=dev)
        pool_par = torch.full((b, M), -1, dtype=torch.int64, device=dev)     # pool index of the parent (-1: root)
        pool_score = torch.empty(b, M, dtype=torch.float32, device=dev)      # cumulative draft log-prob
        pool_depth = torch.empty(b, M, dtype=torch.int32, device=dev)
        pool_slot = torch.full((b, M), -1, dtype=torch.int64, device=dev)    # forward slot (-1: a leaf)
        cal = self.calibrate  # the greedy rule: deterministic children, any ranking is exact
        self._cal_step = cal
        if cal:
            pool_cell = torch.empty(b, M, dtype=torch.int64, device=dev)  # calibration cell of each candidate
            pool_logq = torch.empty(b, M, dtype=torch.float32, device=dev)  # its draft log-probability
            log_ratio = self._cal_log_ratios()                               # [w * _CAL_BUCKETS]
            rank = self._cal_rank                                            # [w]
        vals, idx = torch.topk(self._scores(last), w, dim=-1)               # [b, w]
        pool_tok[:, :w] = idx
        if cal:
            cell = rank + self._cal_bucket(vals)
            pool_cell[:, :w] = cell
            pool_logq[:, :w] = vals
            vals = (vals + log_ratio[cell]).clamp_(max=0.0)
        pool_score[:, :w] = vals
        pool_depth[:, :w] = 1
        frontier = torch.arange(w, device=dev).expand(b, w)                  # [b, w] pool indices
        anc = torch.zeros(b, max(F, 1), max(F, 1), dtype=torch.bool, device=dev)  # ancestor-or-self among slots
        eye = torch.eye(w, dtype=torch.bool, device=dev)
        used = w
        for d in range(1, k):
            s0 = (d - 1) * w                                                 # slots of this frontier: s0 .. s0 + w
            pool_slot.scatter_(1, frontier, torch.arange(s0, s0 + w, device=dev).expand(b, w))
            rows = torch.zeros(b, w, F, dtype=torch.bool, device=dev)
            if d > 1:
                pslot = pool_slot.gather(1, pool_par.gather(1, frontier))    # parents are the previous frontier
                rows = anc[:, :F, :F].gather(1, pslot.unsqueeze(2).expand(b, w, F)).clone()
            rows[:, :, s0:s0 + w] |= eye
            anc[:, s0:s0 + w, :F] = rows
            toks = pool_tok.gather(1, frontier)                              # [b, w]
            depths = torch.full((b, w), d - 1, dtype=torch.int32, device=dev)  # root is committed: depth d at lens + d - 1
            logits = self.lm.forward(cache, toks, depths, rows[:, :, :s0 + w].contiguous(), kv_offset=s0)
            cv, ci = torch.topk(self._scores(logits), w, dim=-1)            # [b, w, w]
            if cal:
                cell = rank + self._cal_bucket(cv)
                pool_cell[:, used:used + w * w] = cell.reshape(b, w * w)
                pool_logq[:, used:used + w * w] = cv.reshape(b, w * w)
                cv = (cv + log_ratio[cell]).clamp_(max=0.0)
            cs = (pool_score.gather(1, frontier).unsqueeze(2) + cv).reshape(b, w * w)
            pool_tok[:, used:used + w * w] = ci.reshape(b, w * w)
            pool_par[:, used:used + w * w] = frontier.unsqueeze(2).expand(b, w, w).reshape(b, w * w)
            pool_score[:, used:used + w * w] = cs
            pool_depth[:, used:used + w * w] = d + 1
            if d < k - 1:
                frontier = used + torch.topk(cs, w, dim=-1).indices
            used += w * w
        n = min(self.max_nodes - 1, used)
        if ctx.node_budget is not None:
            n = max(1, min(n, int(ctx.node_budget) - 1))
        # re-rank: stable descending sort keeps a parent before its equal-scored child -> connected
        best = torch.sort(pool_score[:, :used], dim=1, descending=True, stable=True).indices[:, :n]
        sel = torch.sort(best, dim=1).values                                 # [b, n] pool order = topological
        pos = torch.full((b, used), -1, dtype=torch.int64, device=dev)
        pos.scatter_(1, sel, torch.arange(1, n + 1, device=dev).expand(b, n))
        ppool = pool_par.gather(1, sel)
        par = torch.where(ppool < 0, 0, pos.gather(1, ppool.clamp(min=0)))
        N = n + 1
        tokens = torch.cat([ctx.roots.view(b, 1).to(torch.int64), pool_tok.gather(1, sel)], dim=1)
        parents = torch.cat([torch.full((b, 1), -1, dtype=torch.int64, device=dev), par], dim=1).to(torch.int32)
        depths = torch.cat([torch.zeros(b, 1, dtype=torch.int32, device=dev), pool_depth.gather(1, sel)], dim=1)
        slot = pool_slot.gather(1, sel)
        self._tree_slot = torch.cat([torch.zeros(b, 1, dtype=torch.int64, device=dev),
                                     torch.where(slot >= 0, slot + 1, -1)], dim=1)  # [b, N] 0 root, 1 + slot, -1
        self._step_tokens = tokens
        self._F = F
        if cal:
            self._tree_cell = torch.cat([torch.full((b, 1), -1, dtype=torch.int64, device=dev),
                                         pool_cell.gather(1, sel)], dim=1)       # [b, N] (root: -1)
            self._tree_q = torch.cat([torch.zeros(b, 1, dtype=torch.float32, device=dev),
                                      pool_logq.gather(1, sel).exp()], dim=1)
        mask = ancestor_mask(parents, max_depth=k)
        tree = TokenTree(tokens.contiguous(), parents.contiguous(), depths.contiguous(), [N] * b, is_chain=False,
                         _mask=mask)
        return Draft(tree)

    def _sampled_plan(self, n: int, k: int) -> List[Tuple[List[int], List[int]]]:
        return self._plan(n, k, SAMPLED_RANK_ACCEPT)

    def _plan(self, n: int, k: int, acc: Tuple) -> List[Tuple[List[int], List[int]]]:
        """The shape of a sampled dynamic tree of n draft nodes, at most k deep (fixed before any draw).

        Per level d = 1, 2, ...: (positions in level d - 1 of the nodes expanded, their child
        counts); children are grouped by parent in that order and drawn without replacement. The
        shape maximises the tree's expected accepted length under the per-rank acceptance of
        :data:`SAMPLED_RANK_ACCEPT` (:func:`specdec.tree.plan_tree`), with at
        most ``top_k`` nodes expanded per level (one draft forward per level runs over them, and
        the draft cache holds ``top_k`` frontier slots per level): a spine of first-drawn children
        with siblings where their path probability is highest. Spreading the nodes evenly over the
        levels and expanding the best-scored by draft probability (the earlier shape) cut the
        spine: a drawn token of low draft probability lost its subtree to its siblings'.
        """
        key = (n, k, acc)
        plan = self._plans.get(key)
        if plan is not None:
            return plan
        per_depth = bool(acc) and isinstance(acc[0], tuple)   # acc[d - 1][r] (a learned table) or acc[r]

        def rate(d: int, r: int) -> float:
            row = acc[min(d, len(acc)) - 1] if per_depth else acc
            return row[r] if r < len(row) else 0.0

        parents, slots, _ = plan_tree(rate, n + 1, max_depth=k, max_parents_per_depth=self.top_k)
        kids: Dict[int, List[int]] = {}
        for c in range(1, len(parents)):
            kids.setdefault(parents[c], []).append(c)  # in the order of their ranks
        # levels: the nodes of depth d grouped by parent (in the parent level's order), by rank
        levels, plan = [[0]], []
        while True:
            prev = levels[-1]
            pos = [i for i, x in enumerate(prev) if x in kids]
            if not pos:
                break
            plan.append((pos, [len(kids[prev[i]]) for i in pos]))
            levels.append([c for i in pos for c in kids[prev[i]]])
        self._plans[key] = plan
        return plan

    def _children(self, q: torch.Tensor, counts: List[int], dist: torch.Tensor
                  ) -> Tuple[torch.Tensor, torch.Tensor, List[int]]:
        """Children of f parents [b, f, V] (q rows, warped): parent j gets counts[j] (<= V) children DRAWN
        from q_j without replacement, child i from q_j renormalised over the tokens drawn before it.
        Writes each child's draw distribution into ``dist`` [b, c, V] (its rows of ``draft_probs``);
        returns tokens [b, c], log q [b, c] and the parent rank of each child (host list), children
        grouped by parent."""
        b, f, V = q.shape
        cmax = max(counts)
        first = [sum(counts[:j]) for j in range(f)]                  # each parent's first child
        toks = torch.empty(b, dist.shape[1], dtype=torch.int64, device=q.device)
        rest = q
        for i in range(cmax):
            if i:  # without replacement: the tokens drawn so far leave the distribution
                last = drawn.unsqueeze(2)
                rest = rest.scatter(2, last, 0.0)
                mass = rest.sum(dim=2, keepdim=True)
                # a warp (top-k / top-p) may leave fewer tokens than children: such a child repeats the
                # last token as a deterministic node (one-hot row; already rejected, it cannot be accepted)
                one_hot = torch.zeros_like(rest).scatter_(2, last, 1.0)
                rest = torch.where(mass > 0, rest / mass.clamp_min(1e-30), one_hot)
            drawn = torch.multinomial(rest.reshape(b * f, V), 1, generator=self.generator).view(b, f)
            js = [j for j in range(f) if counts[j] > i]
            at = torch.tensor([first[j] + i for j in js], dtype=torch.int64, device=q.device)
            src = torch.tensor(js, dtype=torch.int64, device=q.device)
            toks[:, at] = drawn.index_select(1, src)
            dist[:, at] = rest.index_select(1, src)
        rank = [j for j, c in enumerate(counts) for _ in range(c)]
        par = torch.tensor(rank, dtype=torch.int64, device=q.device)
        logq = torch.log(q.reshape(b, f * V).gather(1, par * V + toks))                 # log q_parent(token)
        return toks, logq, rank

    @staticmethod
    def _reach(logq: torch.Tensor, counts: List[int]) -> torch.Tensor:
        """log P(child accepted | parent accepted) estimated per drawn child [b, c] (children grouped by parent,
        ``counts`` per parent, in draw order): its earlier siblings all rejected, then it accepted. A drawn
        token's acceptance is estimated from its draft probability q(x): a = 0.25 + 0.6 sqrt(q) for a first
        child, 0.1 + 0.45 sqrt(q) for a later sibling given the earlier ones were rejected -- curves fitted
        offline to the bundled int8 draft against the target at temperature 1 (P(accept) of a first child
        0.25 at q < 0.02 up to 0.86 at q > 0.9; of a second one 0.11 up to ~0.4), with the draft run over
        whole texts, which understates its acceptance in the loop (benchmarks/tree_ceiling.py): their
        level is low, their order (rising with q, a sibling below a first child) is what is used. They
        only rank the nodes that get children; exactness does not depend on them."""
        first, earlier = _sibling_consts(tuple(counts), str(logq.device))
        s = logq.exp().sqrt()
        a = torch.where(first, 0.25 + 0.6 * s, 0.1 + 0.45 * s).clamp(0.01, 0.97)
        return a.log() + torch.log1p(-a) @ earlier

    def _propose_planned(self, ctx: StepContext, k: int, b: int, cache, last: torch.Tensor, drawn: bool) -> Draft:
        """A tree of planned shape: per level, the counts of children of its expanded nodes are fixed
        (:meth:`_plan`); which nodes of the level get them is chosen by their estimated P(reached).
        drawn=True (sampling, ``sampled_children``): children drawn from q, every node existing before
        it is drawn (see the module docstring). drawn=False (``tree="planned"`` under the greedy rule):
        children are the parent's top-ranked draft tokens (deterministic), planned with
        :data:`GREEDY_RANK_ACCEPT`, then with the acceptances this drafter measured (:meth:`_rank_table`);
        a node's estimated P(reached) is the product of those per-rank acceptances along its path (draft
        log-probability breaks ties)."""
        dev = self.device
        n = self.max_nodes - 1
        if ctx.node_budget is not None:
            n = max(1, min(n, int(ctx.node_budget) - 1))
        plan = self._plan(n, k, SAMPLED_RANK_ACCEPT if drawn else self._rank_table())
        F = sum(len(pos) for pos, _ in plan[1:])                      # forwarded frontier nodes
        toks_l, score_l, par_l, slot_l, depth_l = [], [], [], [], []  # per-level [b, m]; score: log P(reached)
        N = 1 + sum(sum(c) for _, c in plan)
        # drawn: each node's row holds the distribution it was drawn from (the root's row is unused)
        probs = torch.zeros(b, N, self.V, dtype=torch.float32, device=dev) if drawn else None
        if drawn:
            q0 = warp_(last.to(torch.float32, copy=True), self.params).unsqueeze(1)     # [b, 1, V]
            t, lq, _ = self._children(q0, plan[0][1], probs[:, 1:1 + sum(plan[0][1])])
            score_l.append(self._reach(lq, plan[0][1]))
        else:
            t, lq, _, reach = self._top_children(last.unsqueeze(1), plan[0][1], 1)
            score_l.append(reach)
        toks_l.append(t)
        par_l.append(torch.full_like(t, -1))
        depth_l.append(1)
        start = [0]                                                   # pool index of each level's first node
        slot_of = torch.full((b, n), -1, dtype=torch.int64, device=dev)
        anc = torch.zeros(b, max(F, 1), max(F, 1), dtype=torch.bool, device=dev)
        s0 = 0
        for d in range(1, len(plan)):
            prev = score_l[-1]                                        # [b, m_prev] log P(reached), estimated
            pos, counts = plan[d]
            f = len(pos)
            # the frontier: the f nodes of the level most likely reached (chosen after their draws: it decides
            # only who gets children), the most likely first, with the most children
            rank_idx = torch.topk(prev, f, dim=1).indices
            counts = sorted(counts, reverse=True)
            frontier = start[-1] + rank_idx                           # pool indices
            slot_of.scatter_(1, frontier, torch.arange(s0, s0 + f, device=dev).expand(b, f))
            rows = torch.zeros(b, f, F, dtype=torch.bool, device=dev)
            if d > 1:
                ppool = par_l[-1].gather(1, rank_idx)                 # parents of the frontier (pool indices)
                rows = anc[:, :F, :F].gather(1, slot_of.gather(1, ppool).unsqueeze(2).expand(b, f, F)).clone()
            rows[:, :, s0:s0 + f] |= torch.eye(f, dtype=torch.bool, device=dev)
            anc[:, s0:s0 + f, :F] = rows
            ftok = toks_l[-1].gather(1, rank_idx)
            depths = torch.full((b, f), d - 1, dtype=torch.int32, device=dev)
            logits = self.lm.forward(cache, ftok, depths, rows[:, :, :s0 + f].contiguous(), kv_offset=s0)
            first = start[-1] + prev.shape[1]
            if drawn:
                q = warp_(logits.to(torch.float32), self.params)          # [b, f, V]
                t, lq, rank = self._children(q, counts, probs[:, 1 + first:1 + first + sum(counts)])
                reach = self._reach(lq, counts)
            else:
                t, lq, rank, reach = self._top_children(logits, counts, d + 1)
            ranks = torch.tensor(rank, dtype=torch.int64, device=dev)
            toks_l.append(t)
            score_l.append(prev.gather(1, rank_idx).index_select(1, ranks) + reach)
            par_l.append(frontier.index_select(1, ranks))
            depth_l.append(d + 1)
            start.append(first)
            s0 += f
        tokens = torch.cat([ctx.roots.view(b, 1).to(torch.int64)] + toks_l, dim=1)        # [b, N]
        ppool = torch.cat(par_l, dim=1)
        parents = torch.cat([torch.full((b, 1), -1, dtype=torch.int64, device=dev), ppool + 1], dim=1)
        parents[:, 1:] = torch.where(ppool < 0, 0, ppool + 1)
        depth_list = [0] + [dl for dl, tl in zip(depth_l, toks_l) for _ in range(tl.shape[1])]
        depths = torch.tensor(depth_list, dtype=torch.int32, device=dev).expand(b, N).contiguous()
        parents = parents.to(torch.int32).contiguous()
        slot = slot_of[:, :N - 1]
        self._tree_slot = torch.cat([torch.zeros(b, 1, dtype=torch.int64, device=dev),
                                     torch.where(slot >= 0, slot + 1, -1)], dim=1)
        self._step_tokens = tokens
        self._F = F
        if not drawn:   # for the rank counts: each node's sibling rank (children grouped as drafted above)
            self._node_rank = torch.tensor([-1] + [i for _, c in plan for cnt in sorted(c, reverse=True)
                                                   for i in range(cnt)], dtype=torch.int64, device=dev)
            self._node_depth = torch.tensor(depth_list, dtype=torch.int64, device=dev)
        tree = TokenTree(tokens, parents, depths, [N] * b, is_chain=False,
                         _mask=ancestor_mask(parents, max_depth=len(plan)), max_depths=[len(plan)] * b)
        return Draft(tree, probs)

    def _rank_table(self) -> Tuple:
        """The acceptance that plans greedy planned trees: GREEDY_RANK_ACCEPT (per rank), or with
        ``learn_plan`` after every _PLAN_EVERY planned steps the measured rates per (depth, rank), each
        shrunk towards the prior with _PLAN_PRIOR pseudo-observations (see _PLAN_EVERY)."""
        self._plan_steps += 1
        if self.learn_plan and self._plan_steps % _PLAN_EVERY == 0:
            reached, hit = self._rank_counts.tolist()
            prior = GREEDY_RANK_ACCEPT
            self._rank_acc = tuple(
                tuple(round(min(0.999, max(0.001, (a + _PLAN_PRIOR * p) / (r + _PLAN_PRIOR))), 2)
                      for r, a, p in zip(rd, hd, prior)) for rd, hd in zip(reached, hit))
        return self._rank_acc

    def rank_acceptance(self) -> Dict[str, list]:
        """What a planned greedy tree has measured, per depth (rows) and sibling rank (columns):
        ``reached`` (an accepted parent had a child of that rank), ``accepted``, and the table its plans
        now use (``planned``: per rank, or per depth and rank once learned)."""
        reached, hit = self._rank_counts.tolist()
        return {"reached": reached, "accepted": hit, "planned": [list(x) if isinstance(x, tuple) else x
                                                                 for x in self._rank_acc]}

    def _rank_update(self, path: torch.Tensor, on_path: torch.Tensor) -> None:
        """Count the last planned tree's outcome (see _PLAN_EVERY): the root and every accepted node are
        reached parents, each child rank they had was reached at the children's depth, the accepted
        child's (depth, rank) was accepted."""
        b = path.shape[0]
        D, R = self._rank_counts.shape[1:]
        node = path.clamp(min=0)
        kids = self._node_kids[:b]
        pk = torch.cat([kids[:, :1], torch.where(on_path, kids.gather(1, node), 0)], dim=1)        # [b, 1 + P]
        pd = torch.cat([torch.zeros_like(node[:, :1]), self._node_depth.gather(0, node.view(-1)).view(b, -1)], 1)
        ranks = torch.arange(R, device=path.device).view(1, 1, R)
        seen = (pk.unsqueeze(2) > ranks) & (pd < D).unsqueeze(2)                                    # [b, 1 + P, R]
        cell = pd.clamp(max=D - 1).unsqueeze(2) * R + ranks
        self._rank_counts[0].view(-1).scatter_add_(0, cell.reshape(-1), seen.reshape(-1).to(torch.float32))
        rank = self._node_rank.gather(0, node.view(-1)).view(b, -1)
        depth = self._node_depth.gather(0, node.view(-1)).view(b, -1)
        hit = on_path & (rank >= 0) & (rank < R) & (depth >= 1) & (depth <= D)
        cell = (depth - 1).clamp(0, D - 1) * R + rank.clamp(0, R - 1)
        self._rank_counts[1].view(-1).scatter_add_(0, cell.view(-1), hit.view(-1).to(torch.float32))

    def _top_children(self, logits: torch.Tensor, counts: List[int], depth: int
                      ) -> Tuple[torch.Tensor, torch.Tensor, List[int], torch.Tensor]:
        """Children of f parents [b, f, V] (raw draft logits) under the greedy rule: parent j gets its
        counts[j] most probable tokens (torch.topk's order, a function of the logits alone). Returns
        tokens [b, c], log q [b, c], the parent index of each child (host list; children grouped by
        parent) and log of each child's planned acceptance given its parent's (GREEDY_RANK_ACCEPT by
        its rank among its siblings) + 1e-3 log q (ties between equal ranks go to the likelier)."""
        b, f, V = logits.shape
        cmax = min(max(counts), V)
        vals, idx = torch.topk(logits.float(), cmax, dim=2)                        # [b, f, cmax]
        lse = torch.logsumexp(logits.float(), dim=2, keepdim=True)
        acc = self._rank_acc
        if acc and isinstance(acc[0], tuple):
            acc = acc[min(depth, len(acc)) - 1]
        par, flat, prior = _top_consts(tuple(counts), cmax, tuple(acc), str(logits.device))
        toks = idx.reshape(b, f * cmax).index_select(1, flat)
        logq = (vals - lse).reshape(b, f * cmax).index_select(1, flat)
        return toks, logq, list(par), prior + 1e-3 * logq

    def accept(self, accepted: torch.Tensor, num_accepted: torch.Tensor, num_host: Sequence[int],
               foreign: Optional[Sequence[Sequence[int]]] = None) -> None:
        k = self._k_step
        b = self._b
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
            if self._cal_step:
                self._cal_update(path, on_path)
            if self._plan_step:
                self._rank_update(path, on_path)
            # the accepted nodes with K/V in the draft cache: a prefix of the path (a leaf has no children)
            slots = self._tree_slot.gather(1, path.clamp(min=0))
            valid = on_path & (slots >= 1)
            in_cache = valid.sum(dim=1)                                                 # [b]
            W = 1 + self._F
            moves = torch.full((b, W), -1, dtype=torch.int32, device=self.device)
            moves[:, 0] = 0
            P = min(N - 1, W - 1)
            if P > 0:
                moves[:, 1:1 + P] = torch.where(valid, slots, -1)[:, :P].to(torch.int32)
        else:
            # the accepted path is a spine prefix, possibly ended by one sibling leaf; the draft cache holds
            # root, s_1 .. s_{k-1}: keep the accepted part of that, the rest of the path becomes pending
            if w == 1:
                in_cache = num.clamp(max=k - 1)
            else:
                leaf = (num > 0) & ((last - 1) % w != 0)
                in_cache = (num - leaf.to(torch.int64)).clamp(max=k - 1)
            moves = self._identity[:b, :k + 1]
        cache.lens.copy_(self._base + self._pend_n[:b].to(torch.int32))   # back to the root's position
        cache.commit(moves, in_cache.to(torch.int32))                      # lens += in_cache + 1
        own = (num > in_cache).to(torch.int64)
        self._pend_n[:b] = own
        self._pend_tok[:b, 0] = self._step_tokens.gather(1, last.view(b, 1)).view(b)
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
