"""The drafter protocol: what the decoding loop asks of every drafter.

A step of :class:`specdec.SpeculativeDecoder` calls, for the ``b`` active requests
(rows 0..b-1 of every cache; finished requests leave the batch and the last active
row moves into the hole):

1. ``propose(ctx) -> Draft``: a :class:`~specdec.tree.TokenTree` rooted at each
   request's last emitted token, plus the distribution each draft node was drawn
   from (``draft_probs`` [b, N, V] float32, row 0 unused) or None when every node is
   a deterministic candidate (greedy drafting, prompt lookup);
2. the target verifies the tree;
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

__all__ = ["Draft", "StepContext", "Drafter", "move_cache_rows"]


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
