"""CallableDrafter: candidates from a user function (a retriever, a cache of answers, a grammar)."""
from __future__ import annotations

from typing import List, Optional

import torch

from specdec._check import check_int, is_int
from specdec.drafters.base import Draft, Drafter, StepContext
from specdec.tree import TokenTree

__all__ = ["CallableDrafter"]


class CallableDrafter(Drafter):
    """Draft with a user function: ``fn(context) -> list of candidate continuations``.

    ``context`` is the request's prompt + generated tokens (its last token is the root);
    each candidate is a list of token ids that would follow it (e.g. from a retriever).
    Candidates are merged into a trie (equal prefixes share nodes), cut to the tokens
    still worth drafting and to ``max_nodes`` nodes (root included). They are
    deterministic candidates, so the proposal is exact under sampling too. The function's
    output is checked (a list of lists of in-vocabulary ints) before anything is proposed;
    errors name the drafter and the request.
    """

    trusted = True  # validates fn's output itself

    def __init__(self, fn, max_nodes: int = 16, name: Optional[str] = None) -> None:
        if not callable(fn):
            raise TypeError(f"CallableDrafter: fn must be callable, got {type(fn).__name__}")
        check_int("CallableDrafter", "max_nodes", max_nodes, lo=1, type_error=False)
        self.fn = fn
        self.max_nodes = max_nodes
        self.name = name or f"CallableDrafter({getattr(fn, '__name__', type(fn).__name__)})"
        self.device = torch.device("cpu")
        self.vocab_size = None

    def __repr__(self) -> str:
        return self.name

    def bind(self, target, max_batch: int, max_len: int) -> None:
        self.device = torch.device(target.device)
        self.vocab_size = int(target.vocab_size)

    def _candidates(self, rid: int, seq: List[int], budget: int) -> List[List[int]]:
        got = self.fn(list(seq))
        if got is None:
            return []
        if not isinstance(got, (list, tuple)):
            raise TypeError(f"{self.name}: request {rid}: fn must return a list of candidate token lists, "
                            f"got {type(got).__name__}")
        rows = []
        for c in got:
            if isinstance(c, torch.Tensor):
                c = c.tolist()
            if not isinstance(c, (list, tuple)):
                raise TypeError(f"{self.name}: request {rid}: each candidate must be a list of token ids, "
                                f"got {type(c).__name__}")
            for t in c:
                if not is_int(t):
                    raise TypeError(f"{self.name}: request {rid}: candidate token {t!r} is not an int")
                if not 0 <= t < self.vocab_size:
                    raise ValueError(f"{self.name}: request {rid}: candidate token {t} outside the vocabulary "
                                     f"[0, {self.vocab_size})")
            c = [int(t) for t in c][:max(0, budget)]
            if c:
                rows.append(c)
        return rows

    def propose(self, ctx: StepContext) -> Draft:
        roots: List[int] = []
        cands: List[List[List[int]]] = []
        for rid, seq, budget in zip(ctx.request_ids, ctx.sequences, ctx.budgets):
            cands.append(self._candidates(rid, seq, budget))  # raises before any state changes
            roots.append(seq[-1])
        cap = self.max_nodes if ctx.node_budget is None else max(1, min(self.max_nodes, int(ctx.node_budget)))
        tree = TokenTree.from_candidates(roots, cands, merge=True, device=self.device, max_nodes=cap)
        return Draft(tree)
