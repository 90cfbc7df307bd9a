"""Greedy verification that runs the target's LM head only along the accepted path.

A greedy verification reads the target's argmax at the nodes of the accepted path and at the node
after it, nothing else: from the root, the first child (index order) whose token equals the argmax at
the current node is accepted, and the argmax at the last accepted node is the step's new token
(:func:`specdec.ops.greedy_verify`). On a CPU the LM head is a large part of a verify pass (49,152 x
576 for the bundled model: a fifth of an 8-node pass), and most rows of a tree or a long chain are
never read. :class:`LazyGreedyVerify` runs the target without its head
(:meth:`~specdec.HFCausalLM.forward_hidden`), then the head on short chunks of rows as the walk needs
them: each chunk is a first-child path from the node where the walk stopped, every chunk of a step's
rows in one head call. Because the head is batch invariant (a row's logits are the same bits in any
call of up to 64 rows) the argmax at every node read is the one the full pass gives: the outputs equal
``ops.greedy_verify`` on the full logits, integer for integer (tests/test_lazy_verify.py).

The chunk length follows each request's recent accepted paths: the length that minimises the expected
head cost over its last ``window`` path lengths, a head call of m rows costing
``1 + 0.1 * max(0, m - 3)`` calls of one row (its weight is read once per call; up to 3 rows cost what
one does on the CPU's integer tiles) and each further round one more call. A request without history
takes every node (the full pass's cost, in one call). Short calls are padded with further unread
nodes (index order) up to 3 rows, which cost nothing extra and often hold a tree's other children.
"""
from __future__ import annotations

from collections import deque
from typing import Deque, Dict, Hashable, List, Sequence, Tuple

import torch

__all__ = ["LazyGreedyVerify", "head_cost"]

MAX_ROWS = 64     # the head's batch-invariance bound (rows per call)
FREE_ROWS = 3     # rows a head call takes for the price of one (the weight read dominates)


def head_cost(rows: int) -> float:
    """The cost model's price of one head call of ``rows`` rows, in one-row calls."""
    return 1.0 + 0.1 * max(0, rows - FREE_ROWS)


def best_chunk(history: Sequence[int], nodes: int) -> int:
    """The first chunk's length (nodes along the first-child path) for a request whose last accepted paths read
    ``history`` nodes each (accepted + 1), in a tree of ``nodes`` nodes: the minimiser of the expected head cost
    (one call of the chunk, plus one call of the rest for each path longer than it); ``nodes`` without history."""
    if not history:
        return nodes
    best, best_c = None, nodes
    for c in range(1, nodes + 1):
        cost = head_cost(c) + sum(head_cost(n - c) for n in history if n > c) / len(history)
        if best is None or cost < best - 1e-9:
            best, best_c = cost, c
    return best_c


class LazyGreedyVerify:
    """Greedy verification of a step's tree with the LM head along the accepted path (see the module docstring).

    ``verifier(target, cache, tree, keys)`` runs ``target.forward_hidden`` on the tree and returns
    ``(accepted [b, N] int32, num_accepted [b] int32, out_tokens [b, N] int64)`` as ``ops.greedy_verify``;
    ``keys[r]`` names row r's request (its chunk history); :meth:`forget` drops one. Counters: ``steps``,
    ``rounds`` (head calls), ``rows`` (head rows computed), ``nodes`` (rows a full pass would have computed).
    """

    def __init__(self, window: int = 16) -> None:
        if int(window) < 1:
            raise ValueError(f"LazyGreedyVerify: window must be >= 1, got {window}")
        self.window = int(window)
        self._history: Dict[Hashable, Deque[int]] = {}
        self.steps = self.rounds = self.rows = self.nodes = 0

    def forget(self, key: Hashable) -> None:
        self._history.pop(key, None)

    def __call__(self, target, cache, tree, keys: Sequence[Hashable]
                 ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        tokens, parents = tree.tokens, tree.parents
        b, n = tokens.shape
        if len(keys) != b:
            raise ValueError(f"LazyGreedyVerify: keys must name the tree's {b} rows, got {len(keys)}")
        if b * n > MAX_ROWS:
            raise ValueError(f"LazyGreedyVerify: a tree of {b} x {n} nodes exceeds the head's batch-invariant "
                             f"{MAX_ROWS} rows")
        hidden = target.forward_hidden(cache, tokens, tree.depths, tree.attention_mask())   # [b, N, H]
        toks, pars = tokens.tolist(), parents.tolist()
        kids: List[List[List[int]]] = []
        for r in range(b):
            ch: List[List[int]] = [[] for _ in range(n)]
            for c in range(1, n):
                p = pars[r][c]
                if 0 <= p < n and toks[r][c] >= 0:
                    ch[p].append(c)
            kids.append(ch)
        real = [{c for ch in k for c in ch} for k in kids]          # the nodes that are not padding
        best: List[Dict[int, int]] = [{} for _ in range(b)]       # node -> the head's argmax there
        path = [[0] for _ in range(b)]
        emitted: List[List[int]] = [[] for _ in range(b)]
        want = [self._chunk(kids[r], 0, best_chunk(self._history.get(keys[r], ()), n)) for r in range(b)]
        while any(want):
            self._pad(want, real, best)
            rows = [(r, v) for r in range(b) for v in want[r]]
            ri = torch.tensor([r for r, _ in rows], dtype=torch.int64)
            vi = torch.tensor([v for _, v in rows], dtype=torch.int64)
            arg = target.head_logits(hidden[ri, vi]).argmax(dim=-1).tolist()
            self.rounds += 1
            self.rows += len(rows)
            for (r, v), t in zip(rows, arg):
                best[r][v] = int(t)
            for r in range(b):
                want[r] = [] if not want[r] else self._walk(r, kids[r], toks[r], best[r], path[r], emitted[r],
                                                            keys[r], n)
        self.steps += 1
        self.nodes += b * n
        accepted = torch.full((b, n), -1, dtype=torch.int32)
        num = torch.tensor([len(p) - 1 for p in path], dtype=torch.int32)
        out = torch.full((b, n), -1, dtype=torch.int64)
        for r in range(b):
            accepted[r, :len(path[r])] = torch.tensor(path[r], dtype=torch.int32)
            out[r, :len(emitted[r])] = torch.tensor(emitted[r], dtype=torch.int64)
        dev = tokens.device
        return accepted.to(dev), num.to(dev), out.to(dev)

    # ------------------------------------------------------------------ the walk
    @staticmethod
    def _chunk(kids: List[List[int]], start: int, length: int) -> List[int]:
        """Up to ``length`` nodes from ``start`` down its first children."""
        out = [start]
        while len(out) < length and kids[out[-1]]:
            out.append(kids[out[-1]][0])
        return out

    @staticmethod
    def _pad(want: List[List[int]], real: List[set], best: List[Dict[int, int]]) -> None:
        """Fill a head call of fewer than FREE_ROWS rows with unread nodes of its rows (index order; free)."""
        total = sum(len(w) for w in want)
        for r, w in enumerate(want):
            if not w:
                continue
            for v in sorted(real[r]):
                if total >= FREE_ROWS:
                    return
                if v not in best[r] and v not in w:
                    w.append(v)
                    total += 1

    def _walk(self, r: int, kids: List[List[int]], toks: List[int], best: Dict[int, int], path: List[int],
              emitted: List[int], key: Hashable, n: int) -> List[int]:
        """Advance row r's accepted path over the nodes read so far; the next chunk to read, or [] when done."""
        v = path[-1]
        while v in best:
            t = best[v]
            nxt = next((c for c in kids[v] if toks[c] == t), -1)
            emitted.append(t)
            if nxt < 0:  # no child holds the argmax: t is the step's new token
                hist = self._history.setdefault(key, deque(maxlen=self.window))
                hist.append(len(path))
                return []
            path.append(nxt)
            v = nxt
        return self._chunk(kids, v, best_chunk(self._history.get(key, ()), n - len(path) + 1))
