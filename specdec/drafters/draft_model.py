"""DraftModel: a smaller LM (same vocabulary) drafts a chain of k tokens per step.

Cache invariant (per request, between steps): the draft cache holds every committed
token except the root and, when the previous step accepted all k drafts, except the
last draft d_k too ("pending"): d_k was drafted from the cache but never fed to it.
A step then feeds ``[d_k, root]`` as a 2-node chain in its first forward instead of
``[root]`` (rows without a pending token feed ``[root, padding]``), so no extra forward
is ever spent on catching up.

Drafting (chain, top_k=1): k forwards of one node each -- root (or [d_k, root]),
d1, ..., d_{k-1} -- each giving q_i; greedy draws argmax(q_i), sampling draws from
q_i = warp(draft logits) with the same temperature / top-k / top-p as the target and
a seeded generator, and writes q_i into row i of ``draft_probs`` (the distribution
the token was really drawn from, as exact rejection sampling needs).

Rollback after verification: the draft cache wrote root, d1..d_{k-1} at its
``base + pending + i``; ``kv_commit`` keeps the accepted path (root included) of
those, capped at d_{k-1}: ``lens = base + pending + 1 + min(num_accepted, k - 1)``,
and ``pending = (num_accepted == k)``. For a chain every move is the identity.
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
        Draft tokens per step (chain length).
    top_k : int
        1: a chain. >1 (token trees of depth k with top_k children per node) is not
        implemented yet and raises NotImplementedError.
    node_budget : int, optional
        Cap on tree nodes (root included); for a chain, caps k + 1.
    """

    def __init__(self, lm, k: int = 4, top_k: int = 1, node_budget: Optional[int] = None) -> None:
        for name, v in (("k", k), ("top_k", top_k)):
            if isinstance(v, bool) or not isinstance(v, int):
                raise TypeError(f"DraftModel: {name} must be an int, got {type(v).__name__}")
        if k < 1:
            raise ValueError(f"DraftModel: k must be >= 1, got {k}")
        if top_k < 1:
            raise ValueError(f"DraftModel: top_k must be >= 1, got {top_k}")
        if top_k > 1:
            raise NotImplementedError("DraftModel: token trees (top_k > 1) are not implemented yet; use top_k=1")
        if node_budget is not None:
            if node_budget < 2:
                raise ValueError(f"DraftModel: node_budget must be >= 2 (root + 1 draft), got {node_budget}")
            k = min(k, node_budget - 1)
        self.lm = lm
        self.k = k
        self.top_k = top_k
        self.node_budget = node_budget
        self.max_nodes = k + 1
        self.cache = None
        self._views: Dict[int, object] = {}

    def __repr__(self) -> str:
        return f"DraftModel(k={self.k}, top_k={self.top_k})"

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
        self._tokens = torch.zeros(max_batch * (k + 1), dtype=torch.int64, device=dev)  # flat [b, k_step + 1]
        self._probs_flat: Optional[torch.Tensor] = None  # flat [b, k_step + 1, V], allocated on first sampled step
        self._pending = torch.zeros(max_batch, dtype=torch.int64, device=dev)      # 1: d_k awaits feeding
        self._pending_tok = torch.zeros(max_batch, dtype=torch.int64, device=dev)
        self._any_pending = False
        self._depths1 = torch.zeros(max_batch, 1, dtype=torch.int32, device=dev)
        self._depths2 = torch.arange(2, dtype=torch.int32, device=dev).expand(max_batch, 2).contiguous()
        self._chain_consts: Dict[Tuple[int, int], Tuple[torch.Tensor, torch.Tensor]] = {}
        self._k_step = 0
        self._b = 0

    def _view(self, b: int):
        view = self._views.get(b)
        if view is None:
            view = self._views[b] = self.cache.rows(0, b)
        return view

    def _chain(self, b: int, n: int) -> Tuple[torch.Tensor, torch.Tensor]:
        consts = self._chain_consts.get((b, n))
        if consts is None:
            ar = torch.arange(n, device=self.device)
            consts = ((ar - 1).to(torch.int32).expand(b, n).contiguous(), ar.to(torch.int32).expand(b, n).contiguous())
            self._chain_consts[(b, n)] = consts
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
        self._k_step = 0

    # ------------------------------------------------------------------ step
    def propose(self, ctx: StepContext) -> Draft:
        b = len(ctx.request_ids)
        k = min(self.k, max(ctx.budgets))
        self._k_step = k
        self._b = b
        if k <= 0:  # every row needs exactly one more token: nothing worth drafting
            return Draft(TokenTree.root_only(ctx.roots))
        lm = self.lm
        cache = self._view(b)
        sampling = not self.params.greedy
        tokens = self._tokens[: b * (k + 1)].view(b, k + 1)
        tokens[:, 0] = ctx.roots
        probs = None
        if sampling:
            need = b * (k + 1) * self.V
            if self._probs_flat is None or self._probs_flat.numel() < need:
                full = self._tokens.numel() * self.V  # max_batch * (self.k + 1) * V
                self._probs_flat = torch.zeros(full, dtype=torch.float32, device=self.device)
            probs = self._probs_flat[:need].view(b, k + 1, self.V)
        self._base = cache.lens.clone()  # [b] int32: committed draft prefix (pending token excluded)

        # first forward: [root] or, when some row has a pending d_k, [d_k, root] / [root, pad]
        if self._any_pending:
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
        for i in range(1, k + 1):
            if sampling:
                q = probs[:, i]                                            # [b, V] view, written in place
                q.copy_(last)
                warp_(q, self.params)
                d = sample_tokens(q, self.generator)
            else:
                d = last.argmax(dim=-1)
            tokens[:, i] = d
            if i < k:
                last = lm.forward(cache, d.view(b, 1), self._depths1[:b], None)[:, 0]
                cache.lens.add_(1)
        parents, depths = self._chain(b, k + 1)
        tree = TokenTree.chain(tokens, None, parents=parents, depths=depths)
        return Draft(tree, probs)

    def accept(self, accepted: torch.Tensor, num_accepted: torch.Tensor, num_host: Sequence[int]) -> None:
        k = self._k_step
        if k <= 0:
            return  # root-only step: every row finishes with it
        b = self._b
        cache = self._view(b)
        pend = self._pending[:b]
        # back to the start of this step's root, then keep root .. d_min(a, k-1)
        cache.lens.copy_(self._base + pend.to(torch.int32))
        cache.commit(accepted, num_accepted.clamp(max=k - 1))
        self._pending[:b] = (num_accepted == k).to(torch.int64)
        self._pending_tok[:b] = self._tokens[: b * (k + 1)].view(b, k + 1)[:, k]
        self._any_pending = any(int(a) == k for a in num_host)

    def retire(self, moves: Sequence[Tuple[int, int, int]], active: int) -> None:
        move_cache_rows(self.cache, moves)
        for src, dst, _ in moves:
            self._pending[dst] = self._pending[src]
            self._pending_tok[dst] = self._pending_tok[src]
