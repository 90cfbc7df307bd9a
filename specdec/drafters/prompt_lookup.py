"""PromptLookup: draft by copying what followed an earlier occurrence of the last n-gram.

For each request, look for the most recent EARLIER occurrence of its last ``n``
tokens (n = ``ngram`` down to ``min_ngram``) in prompt + generated text and propose
the (up to) ``k`` tokens that followed it, as a chain (with ``matches > 1``: the
continuations of several latest occurrences merged into a token tree). Nothing found:
a 0-length draft (just the root). Candidates are deterministic, so ``draft_probs`` is None
(q is one-hot) and the proposal is exact for sampling as well as greedy.

Cost: a dict per n mapping each n-gram to its latest start position(s), updated
incrementally with the tokens appended since the last step (O(new tokens * ngram)
host work per step, no model call).
"""
from __future__ import annotations

from typing import Dict, List, Optional, Sequence

import torch

from specdec._check import check_int, require_int
from specdec.drafters.base import Draft, Drafter, StepContext
from specdec.sampling import SamplingParams
from specdec.tree import TokenTree

__all__ = ["PromptLookup"]


class _NgramIndex:
    """Latest start position of every n-gram of one sequence that has a following token."""

    def __init__(self, ngram: int, min_ngram: int, keep: int = 1) -> None:
        self.sizes = list(range(ngram, min_ngram - 1, -1))  # longest first
        self.keep = keep                                      # latest start positions kept per n-gram
        self.maps: Dict[int, Dict[tuple, List[int]]] = {n: {} for n in self.sizes}
        self.next_start: Dict[int, int] = {n: 0 for n in self.sizes}

    def lookup(self, seq: Sequence[int], k: int) -> List[List[int]]:
        """Continuations (most recent occurrence first, distinct) after the longest matching n-gram."""
        L = len(seq)
        for n in self.sizes:
            m = self.maps[n]
            # index starts i with i + n <= L - 1: a token follows, and it is not the suffix itself
            for i in range(self.next_start[n], L - n):
                starts = m.setdefault(tuple(seq[i:i + n]), [])
                starts.append(i)
                if len(starts) > self.keep:
                    del starts[0]
            self.next_start[n] = max(self.next_start[n], L - n)
        if k <= 0:
            return []
        for n in self.sizes:
            if L <= n:
                continue
            starts = self.maps[n].get(tuple(seq[L - n:]))
            if starts:
                out: List[List[int]] = []
                for i in reversed(starts):
                    cont = list(seq[i + n:i + n + k])
                    if cont and cont not in out:
                        out.append(cont)
                return out
        return []


class PromptLookup(Drafter):
    """N-gram prompt-lookup drafter (chain of up to ``k`` tokens).

    A step's ``ctx.node_budget`` (MultiDraft's share) caps the proposal at that many nodes.

    Parameters
    ----------
    ngram : int
        Longest n-gram to match (the last ``ngram`` tokens); shorter ones are tried down to ``min_ngram``.
    k : int
        Most tokens proposed per step.
    min_ngram : int
        Shortest n-gram that still counts as a match (1 = any earlier occurrence of the last token;
        default min(2, ngram)).
    matches : int
        Continuations from up to this many latest occurrences of the matched n-gram, merged into
        a token tree (1 = a chain from the latest occurrence).

    Defaults (k=10, min_ngram=2): on a CPU target a pass over 2..16 nodes costs about the same,
    so long proposals are cheap once any is made, while 1-token matches are mostly noise and make
    open-ended text slower (docs/drafters.md).
    """

    def __init__(self, ngram: int = 3, k: int = 10, min_ngram: Optional[int] = None, matches: int = 1) -> None:
        if min_ngram is None:
            min_ngram = min(2, ngram) if isinstance(ngram, int) else 2
        for name, v in (("ngram", ngram), ("k", k), ("min_ngram", min_ngram)):
            require_int("PromptLookup", name, v)
        if k < 1:
            raise ValueError(f"PromptLookup: k must be >= 1, got {k}")
        if not 1 <= min_ngram <= ngram:
            raise ValueError(f"PromptLookup: need 1 <= min_ngram <= ngram, got min_ngram={min_ngram}, ngram={ngram}")
        check_int("PromptLookup", "matches", matches, lo=1, type_error=False)
        self.ngram = ngram
        self.k = k
        self.min_ngram = min_ngram
        self.matches = matches
        self.max_nodes = 1 + k * matches
        self.device = torch.device("cpu")
        self._index: Dict[int, _NgramIndex] = {}

    trusted = True

    def __repr__(self) -> str:
        extra = f", matches={self.matches}" if self.matches > 1 else ""
        return f"PromptLookup(ngram={self.ngram}, k={self.k}, min_ngram={self.min_ngram}{extra})"

    def bind(self, target, max_batch: int, max_len: int) -> None:
        self.device = torch.device(target.device)

    def start(self, prompts: Sequence[Sequence[int]], params: SamplingParams, generator: torch.Generator) -> None:
        self._index = {}

    def has_proposals(self, request_ids: Sequence[int], sequences: Sequence[Sequence[int]]) -> List[bool]:
        """Whether each row's latest n-gram occurs earlier with a continuation (the index is brought up to
        date as propose() would; propose() then finds the same continuation)."""
        return [bool(self._row_index(rid).lookup(seq, 1)) for rid, seq in zip(request_ids, sequences)]

    def _row_index(self, rid: int) -> _NgramIndex:
        index = self._index.get(rid)
        if index is None:
            index = self._index[rid] = _NgramIndex(self.ngram, self.min_ngram, self.matches)
        return index

    def propose(self, ctx: StepContext) -> Draft:
        conts: List[List[List[int]]] = []
        cap = self.max_nodes if ctx.node_budget is None else max(1, min(self.max_nodes, int(ctx.node_budget)))
        k = min(self.k, cap - 1)
        for rid, seq, budget in zip(ctx.request_ids, ctx.sequences, ctx.budgets):
            conts.append(self._row_index(rid).lookup(seq, min(k, budget)))
        if len(self._index) > 2 * len(ctx.request_ids) + 16:  # requests that left (a long-running engine)
            live = set(ctx.request_ids)
            self._index = {rid: x for rid, x in self._index.items() if rid in live}
        if all(len(c) <= 1 for c in conts):  # chains (the common case): no trie to build
            rows = [[seq[-1]] + (c[0] if c else []) for seq, c in zip(ctx.sequences, conts)]
            num_nodes = [len(r) for r in rows]
            N = max(num_nodes)
            if N == 1:
                return Draft(TokenTree.root_only(ctx.roots))
            tokens = torch.tensor([r + [-1] * (N - len(r)) for r in rows], dtype=torch.int64, device=self.device)
            return Draft(TokenTree.chain(tokens, num_nodes))
        # several distinct continuations: a trie (deterministic candidates, merging is exact)
        roots = [seq[-1] for seq in ctx.sequences]
        return Draft(TokenTree.from_candidates(roots, conts, merge=True, device=self.device,
                                               max_nodes=cap))
