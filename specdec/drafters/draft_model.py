"""DraftModel: a smaller LM (same vocabulary) drafts k tokens per step, as a chain or a spine tree.

Drafting: k forwards of ONE node each -- the root (see "pending" below), then the
spine tokens s_1 .. s_{k-1} -- each giving the draft distribution after the spine so
far. Greedy takes its argmax as the next spine token; sampling draws it from
q = warp(draft logits) (the target's temperature / top-k / top-p, a seeded generator)
and writes q into that node's row of ``draft_probs`` (the distribution the token was
really drawn from, as exact rejection sampling needs).

``top_k = w > 1`` adds, at every depth, w - 1 sibling LEAVES next to the spine token
(greedy: the next most likely draft tokens; sampling: further independent draws from
the same q, kept as separate nodes even when equal -- SpecInfer's condition for
exactness). The drafting cost is unchanged (still k one-node forwards: only the spine
is expanded), the target verifies 1 + k * w nodes, and a rejected spine token gets a
second chance. This is the "top-k tree" restricted to expanding the best node of each
level: expanding several nodes per level would need the draft's forward to attend to
earlier tree nodes that sit past ``cache.lens`` (not in the adapter protocol) or to
recompute them. Node (depth d, slot s) has index 1 + (d - 1) * w + s; slot 0 is the spine.

Cache invariant (per request, between steps): the draft cache holds every committed
token except the root and, possibly, ONE "pending" token before it: the last accepted
draft node when it has no K/V in the draft cache (s_k, which is drafted but never fed,
or a sibling leaf). A step then feeds ``[pending, root]`` as a 2-node chain in its first
forward instead of ``[root]`` (rows without a pending token feed ``[root, padding]``),
so no forward is ever spent on catching up.

Rollback after verification: this step wrote root, s_1 .. s_{k-1} at the draft cache's
``base + pending + i``; ``kv_commit`` (identity moves) keeps root and the accepted spine
prefix capped at s_{k-1}; what remains of the accepted path becomes the pending token.

Confidence stop (``stop_threshold``, off by default): a row stops drafting after a spine
token whose draft probability is below the threshold (the token itself is still
proposed: dropping it would bias the sampled distribution), and the step stops when
every row has stopped. Rows that stopped early get padding nodes. Deciding to stop
reads the confidences on the host once per draft forward (free on CPU; on CUDA a
synchronisation per draft token -- keep it off there unless drafts are long).
"""
from __future__ import annotations

from typing import Dict, Optional, Sequence, Tuple

import torch

from specdec.drafters.base import Draft, Drafter, StepContext, move_cache_rows
from specdec.sampling import SamplingParams, sample_tokens, warp_
from specdec.tree import TokenTree

__all__ = ["DraftModel"]


class DraftModel(Drafter):
    """Draft with a smaller causal LM wrapped like the target (``HFCausalLM`` protocol).

    Parameters
    ----------
    lm : HFCausalLM (or any object with the same protocol)
        The draft model. Its vocabulary must equal the target's (checked when a
        :class:`~specdec.SpeculativeDecoder` is built).
    k : int
        Draft depth: spine tokens per step (= forwards of the draft model per step).
    top_k : int
        Candidates per depth: 1 = a chain; w > 1 = the spine token plus w - 1 sibling
        leaves at every depth (1 + k * w nodes verified).
    node_budget : int, optional
        Cap on tree nodes (root included): k is lowered to (node_budget - 1) // top_k.
    stop_threshold : float, optional
        Stop a row's chain after a drafted token whose draft probability is below this
        (greedy: the draft's softmax probability of its argmax; sampling: q of the drawn
        token). None: always draft k tokens.
    """

    def __init__(self, lm, k: int = 4, top_k: int = 1, node_budget: Optional[int] = None,
                 stop_threshold: Optional[float] = None) -> None:
        for name, v in (("k", k), ("top_k", top_k)):
            if isinstance(v, bool) or not isinstance(v, int):
                raise TypeError(f"DraftModel: {name} must be an int, got {type(v).__name__}")
        if k < 1:
            raise ValueError(f"DraftModel: k must be >= 1, got {k}")
        if top_k < 1:
            raise ValueError(f"DraftModel: top_k must be >= 1, got {top_k}")
        if node_budget is not None:
            if isinstance(node_budget, bool) or not isinstance(node_budget, int) or node_budget < 1 + top_k:
                raise ValueError(f"DraftModel: node_budget must be an int >= 1 + top_k = {1 + top_k} "
                                 f"(root + one level), got {node_budget}")
            k = min(k, (node_budget - 1) // top_k)  # whole levels only
        if stop_threshold is not None and not 0.0 <= float(stop_threshold) <= 1.0:
            raise ValueError(f"DraftModel: stop_threshold must lie in [0, 1] or be None, got {stop_threshold}")
        self.stop_threshold = None if stop_threshold is None else float(stop_threshold)
        self.lm = lm
        self.k = k
        self.top_k = top_k
        self.node_budget = node_budget
        self.max_nodes = 1 + k * top_k
        self.cache = None
        self._views: Dict[int, object] = {}

    def __repr__(self) -> str:
        stop = "" if self.stop_threshold is None else f", stop_threshold={self.stop_threshold}"
        return f"DraftModel(k={self.k}, top_k={self.top_k}{stop})"

    # ------------------------------------------------------------------ setup
    def bind(self, target, max_batch: int, max_len: int) -> None:
        if int(self.lm.vocab_size) != int(target.vocab_size):
            raise ValueError(f"DraftModel: draft vocabulary size {self.lm.vocab_size} != target vocabulary size "
                             f"{target.vocab_size}; the draft must share the target's tokenizer")
        if torch.device(self.lm.device) != torch.device(target.device):
            raise ValueError(f"DraftModel: draft model on {self.lm.device} but target on {target.device}")
        dev = torch.device(self.lm.device)
        k = self.k
        V = int(self.lm.vocab_size)
        # room for prompt + generated (<= max_len) plus the tokens fed during one step
        self.cache = self.lm.new_cache(max_batch, max_len + k + 2)
        self._views = {}
        self.device = dev
        self.V = V
        self._tokens = torch.zeros(max_batch * self.max_nodes, dtype=torch.int64, device=dev)  # flat [b, N]
        self._probs_flat: Optional[torch.Tensor] = None  # flat [b, N, V], allocated on the first sampled step
        self._pending = torch.zeros(max_batch, dtype=torch.int64, device=dev)      # 1: a token awaits feeding
        self._pending_tok = torch.zeros(max_batch, dtype=torch.int64, device=dev)
        self._any_pending = False
        self._depths1 = torch.zeros(max_batch, 1, dtype=torch.int32, device=dev)
        self._depths2 = torch.arange(2, dtype=torch.int32, device=dev).expand(max_batch, 2).contiguous()
        self._identity = torch.arange(k + 1, dtype=torch.int32, device=dev).expand(max_batch, k + 1).contiguous()
        self._shapes: Dict[Tuple[int, int], Tuple[torch.Tensor, ...]] = {}
        self._k_step = 0
        self._b = 0
        self._behind = False

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
                from specdec.tree import ancestor_mask
                mask = ancestor_mask(par.view(1, N)).expand(b, N, N).contiguous()
            consts = (par.expand(b, N).contiguous(), dep.expand(b, N).contiguous(), mask)
            self._shapes[key] = consts
        return consts

    def start(self, prompts: Sequence[Sequence[int]], params: SamplingParams, generator: torch.Generator) -> None:
        if self.cache is None:
            raise RuntimeError("DraftModel: not bound to a decoder (SpeculativeDecoder(target, drafter) binds it)")
        self.params = params
        self.generator = generator
        self.cache.reset()
        self.lm.prefill(self.cache, [list(p) for p in prompts], rows=list(range(len(prompts))))
        self._pending.zero_()
        self._any_pending = False
        self._behind = False
        self._k_step = 0

    # ------------------------------------------------------------------ step
    def propose(self, ctx: StepContext) -> Draft:
        b = len(ctx.request_ids)
        k = min(self.k, max(ctx.budgets))
        w = self.top_k
        self._k_step = k
        self._b = b
        if k <= 0:  # nothing worth drafting (last token, or the scheduler chose a plain step)
            self._behind = True  # this step's root is not fed: the next draft catches up first
            return Draft(TokenTree.root_only(ctx.roots))
        limits = [max(0, min(k, x)) for x in ctx.budgets]  # per-row depth (the scheduler's choice)
        lm = self.lm
        cache = self._view(b)
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
        self._base = cache.lens.clone()  # [b] int32: committed draft prefix (pending token excluded)

        # first forward: [root] or, when some row may hold a pending token, [pending, root] / [root, pad]
        if self._behind:
            last = self._catch_up(cache, ctx)
        elif self._any_pending:
            pend = self._pending[:b]                                       # [b] 0/1
            has = pend.bool()
            x = torch.stack([torch.where(has, self._pending_tok[:b], ctx.roots),
                             torch.where(has, ctx.roots, -1)], dim=1)      # [b, 2]
            logits = lm.forward(cache, x, self._depths2[:b], None)         # [b, 2, V]
            last = logits[torch.arange(b, device=self.device), pend]       # [b, V] after the root
            cache.lens.add_((pend + 1).to(torch.int32))
        else:
            last = lm.forward(cache, ctx.roots.view(b, 1), self._depths1[:b], None)[:, 0]  # [b, V]
            cache.lens.add_(1)
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

    def _catch_up(self, cache, ctx: StepContext) -> torch.Tensor:
        """After steps that drafted nothing: feed every committed token the draft cache lacks, then the
        root, as one chain per row (reads the draft lengths on the host once). Returns the draft logits
        after each row's root [b, V]. The rows of a batch skip the same steps, so they lag by the same
        count give or take the pending token, and the padding stays within the cache's spare room."""
        b = len(ctx.request_ids)
        have = cache.lens.tolist()
        rows = [seq[h:] for seq, h in zip(ctx.sequences, have)]   # [pending?, skipped roots..., root]
        width = max(len(r) for r in rows)
        x = torch.tensor([r + [-1] * (width - len(r)) for r in rows], dtype=torch.int64, device=self.device)
        depths = torch.arange(width, dtype=torch.int32, device=self.device).expand(b, width).contiguous()
        logits = self.lm.forward(cache, x, depths, None)                       # [b, width, V]
        idx = torch.tensor([len(r) - 1 for r in rows], dtype=torch.int64, device=self.device)
        last = logits[torch.arange(b, device=self.device), idx]                # [b, V] after the root
        self._base = torch.tensor([len(s) - 1 for s in ctx.sequences], dtype=torch.int32, device=self.device)
        cache.lens.copy_(self._base + 1)
        self._pending[:b] = 0
        self._any_pending = False
        self._behind = False
        return last

    def accept(self, accepted: torch.Tensor, num_accepted: torch.Tensor, num_host: Sequence[int]) -> None:
        k = self._k_step
        if k <= 0:
            return  # root-only step: every row finishes with it
        b = self._b
        w = self.top_k
        cache = self._view(b)
        pend = self._pending[:b]
        num = num_accepted.to(torch.int64)
        last = accepted.gather(1, num.view(b, 1)).view(b).to(torch.int64)   # last accepted node (0: none)
        # the accepted path is a spine prefix, possibly ended by one sibling leaf; the draft cache holds
        # root, s_1 .. s_{k-1}: keep the accepted part of that, the rest of the path becomes pending
        if w == 1:
            in_cache = num.clamp(max=k - 1)
        else:
            leaf = (num > 0) & ((last - 1) % w != 0)
            in_cache = (num - leaf.to(torch.int64)).clamp(max=k - 1)
        cache.lens.copy_(self._base + pend.to(torch.int32))
        cache.commit(self._identity[:b, :k + 1], in_cache.to(torch.int32))   # identity moves: lens += in_cache + 1
        self._pending[:b] = (num > in_cache).to(torch.int64)
        self._pending_tok[:b] = self._step_tokens.gather(1, last.view(b, 1)).view(b)
        # chains: pending iff all k accepted (known on the host); trees: assume it may be
        self._any_pending = any(int(a) == k for a in num_host) if w == 1 else True

    def retire(self, moves: Sequence[Tuple[int, int, int]], active: int) -> None:
        move_cache_rows(self.cache, moves)
        for src, dst, _ in moves:
            self._pending[dst] = self._pending[src]
            self._pending_tok[dst] = self._pending_tok[src]
