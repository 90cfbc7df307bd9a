"""PromptLookup: draft by copying what followed an earlier occurrence of the last n-gram.

For each request, look for the most recent EARLIER occurrence of its last ``n``
tokens (n = ``ngram`` down to ``min_ngram``) in prompt + generated text and propose
the (up to) ``k`` tokens that followed it, as a chain. Nothing found: a 0-length
draft (just the root). Candidates are deterministic, so ``draft_probs`` is None
(q is one-hot) and the proposal is exact for sampling as well as greedy.

Cost: a dict per n mapping each n-gram to its latest start position, updated
incrementally with the tokens appended since the last step (O(new tokens * ngram)
host work per step, no model call).
"""
from __future__ import annotations

from typing import Dict, List, Sequence

import torch

from specdec.drafters.base import Draft, Drafter, StepContext
from specdec.sampling import SamplingParams
from specdec.tree import TokenTree

__all__ = ["PromptLookup"]


class _NgramIndex:
    """Latest start position of every n-gram of one sequence that has a following token."""

    def __init__(self, ngram: int, min_ngram: int) -> None:
        self.sizes = list(range(ngram, min_ngram - 1, -1))  # longest first
        self.maps: Dict[int, Dict[tuple, int]] = {n: {} for n in self.sizes}
        self.next_start: Dict[int, int] = {n: 0 for n in self.sizes}

    def lookup(self, seq: Sequence[int], k: int) -> List[int]:
        L = len(seq)
        for n in self.sizes:
            m = self.maps[n]
            # index starts i with i + n <= L - 1: a token follows, and it is not the suffix itself
            for i in range(self.next_start[n], L - n):
                m[tuple(seq[i:i + n])] = i
            self.next_start[n] = max(self.next_start[n], L - n)
        if k <= 0:
            return []
        for n in self.sizes:
            if L <= n:
                continue
            i = self.maps[n].get(tuple(seq[L - n:]))
            if i is not None:
                return list(seq[i + n:i + n + k])
        return []


class PromptLookup(Drafter):
    """N-gram prompt-lookup drafter (chain of up to ``k`` tokens).

    Parameters
    ----------
    ngram : int
        Longest n-gram to match (the last ``ngram`` tokens); shorter ones are tried down to ``min_ngram``.
    k : int
        Most tokens proposed per step.
    min_ngram : int
        Shortest n-gram that still counts as a match (1 = any earlier occurrence of the last token).
    """

    def __init__(self, ngram: int = 3, k: int = 5, min_ngram: int = 1) -> None:
        for name, v in (("ngram", ngram), ("k", k), ("min_ngram", min_ngram)):
            if isinstance(v, bool) or not isinstance(v, int):
                raise TypeError(f"PromptLookup: {name} must be an int, got {type(v).__name__}")
        if k < 1:
            raise ValueError(f"PromptLookup: k must be >= 1, got {k}")
        if not 1 <= min_ngram <= ngram:
            raise ValueError(f"PromptLookup: need 1 <= min_ngram <= ngram, got min_ngram={min_ngram}, ngram={ngram}")
        self.ngram = ngram
        self.k = k
        self.min_ngram = min_ngram
        self.max_nodes = k + 1
        self.device = torch.device("cpu")
        self._index: Dict[int, _NgramIndex] = {}

    def __repr__(self) -> str:
        return f"PromptLookup(ngram={self.ngram}, k={self.k}, min_ngram={self.min_ngram})"

    def bind(self, target, max_batch: int, max_len: int) -> None:
        self.device = torch.device(target.device)

    def start(self, prompts: Sequence[Sequence[int]], params: SamplingParams, generator: torch.Generator) -> None:
        self._index = {}

    def propose(self, ctx: StepContext) -> Draft:
        rows: List[List[int]] = []
        for rid, seq, budget in zip(ctx.request_ids, ctx.sequences, ctx.budgets):
            index = self._index.get(rid)
            if index is None:
                index = self._index[rid] = _NgramIndex(self.ngram, self.min_ngram)
            rows.append([seq[-1]] + index.lookup(seq, min(self.k, budget)))
        num_nodes = [len(r) for r in rows]
        N = max(num_nodes)
        if N == 1:
            return Draft(TokenTree.root_only(ctx.roots))
        tokens = torch.tensor([r + [-1] * (N - len(r)) for r in rows], dtype=torch.int64, device=self.device)
        return Draft(TokenTree.chain(tokens, num_nodes))
