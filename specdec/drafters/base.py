"""The drafter protocol: what the decoding loop asks of every drafter.

A step of :class:`specdec.SpeculativeDecoder` calls, for the ``b`` active requests
(rows 0..b-1 of every cache; finished requests leave the batch and the last active
row moves into the hole):

1. ``propose(ctx) -> Draft``: a :class:`~specdec.tree.TokenTree` rooted at each
   request's last emitted token, plus the distribution each draft node was drawn
   from (``draft_probs`` [b, N, V] float32, row 0 unused) or None when every node is
   a deterministic candidate (greedy drafting, prompt lookup);
2. the target verifies the tree; ``observe_verify(tree, logits)`` sees the target's logits
   of every node of that pass (before the sampler warps them; device tensors, no host
   sync expected) -- a no-op unless the drafter learns from the target (TokenRecycling);
3. ``accept(accepted, num_accepted, num_host)``: the verification result (device
   tensors, plus ``num_host``, the per-row accepted counts already copied to the host
   by the loop's single sync of the step) so the drafter rolls its own state back to
   the accepted path;
4. ``retire(moves, active)`` when requests finish: row ``src`` moves into row ``dst``.

``bind`` runs once at decoder construction (validate against the target, allocate
caches); ``start`` once per generate call (prefill).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional, Sequence, Tuple

import torch

from specdec.sampling import SamplingParams
from specdec.tree import TokenTree

__all__ = ["Draft", "StepContext", "Drafter", "CallableDrafter", "move_cache_rows"]


@dataclass
class Draft:
    tree: TokenTree
    draft_probs: Optional[torch.Tensor] = None  # [b, N, V] float32 contiguous (q of node i in row i), or None


@dataclass
class StepContext:
    roots: torch.Tensor            # [b] int64 on the device: each active row's last emitted token
    sequences: List[List[int]]     # host: prompt + emitted tokens of each active row (root = last)
    request_ids: List[int]         # index of each active row's request in the generate call
    budgets: List[int]             # draft tokens worth proposing per row (new tokens still allowed - 1)


class Drafter:
    """Base class; see the module docstring for the call sequence."""

    #: nodes per request a proposal may hold, root included (the decoder sizes its cache with it)
    max_nodes: int = 1

    def bind(self, target, max_batch: int, max_len: int) -> None:
        """Check compatibility with the target and allocate state for max_batch requests."""

    def start(self, prompts: Sequence[Sequence[int]], params: SamplingParams, generator: torch.Generator) -> None:
        """A new generate call: prompts of rows 0..len(prompts)-1."""

    def propose(self, ctx: StepContext) -> Draft:
        raise NotImplementedError

    def observe_verify(self, tree: TokenTree, logits: torch.Tensor) -> None:
        """The target's logits [b, N, V] of every node of the tree just verified (read only, before warping)."""

    def accept(self, accepted: torch.Tensor, num_accepted: torch.Tensor, num_host: Sequence[int]) -> None:
        """Verification result of the last proposal: accepted [b, N] int32, num_accepted [b] int32."""

    def retire(self, moves: Sequence[Tuple[int, int, int]], active: int) -> None:
        """Rows leave the batch: for (src, dst, length) row src moves to row dst; ``active`` rows remain."""


def move_cache_rows(cache, moves: Sequence[Tuple[int, int, int]]) -> None:
    """Copy the first ``length`` positions and the length of row ``src`` into row ``dst`` of a StaticKVCache."""
    for src, dst, length in moves:
        if src == dst:
            continue
        n = min(int(length), cache.capacity)
        for t in cache.k + cache.v:
            t[dst, :, :n].copy_(t[src, :, :n])
        cache.lens[dst] = cache.lens[src]


class CallableDrafter(Drafter):
    """Draft with a user function: ``fn(context) -> list of candidate continuations``.

    ``context`` is the request's prompt + generated tokens (its last token is the root);
    each candidate is a list of token ids that would follow it (e.g. from a retriever).
    Candidates are merged into a trie (equal prefixes share nodes), cut to the tokens
    still worth drafting and to ``max_nodes`` nodes (root included). They are
    deterministic candidates, so the proposal is exact under sampling too.
    """

    def __init__(self, fn, max_nodes: int = 16) -> None:
        if not callable(fn):
            raise TypeError(f"CallableDrafter: fn must be callable, got {type(fn).__name__}")
        if isinstance(max_nodes, bool) or not isinstance(max_nodes, int) or max_nodes < 1:
            raise ValueError(f"CallableDrafter: max_nodes must be an int >= 1, got {max_nodes!r}")
        self.fn = fn
        self.max_nodes = max_nodes
        self.device = torch.device("cpu")
        self.vocab_size = None

    def bind(self, target, max_batch: int, max_len: int) -> None:
        self.device = torch.device(target.device)
        self.vocab_size = int(target.vocab_size)

    def propose(self, ctx: StepContext) -> Draft:
        roots: List[int] = []
        cands: List[List[List[int]]] = []
        for r, (seq, budget) in enumerate(zip(ctx.sequences, ctx.budgets)):
            got = self.fn(list(seq))
            rows = []
            for c in got or []:
                c = [int(t) for t in c][:max(0, budget)]
                for t in c:
                    if not 0 <= t < self.vocab_size:
                        raise ValueError(f"CallableDrafter: request {ctx.request_ids[r]}: candidate token {t} "
                                         f"outside the vocabulary [0, {self.vocab_size})")
                if c:
                    rows.append(c)
            roots.append(seq[-1])
            cands.append(rows)
        tree = TokenTree.from_candidates(roots, cands, merge=True, device=self.device, max_nodes=self.max_nodes)
        return Draft(tree)
