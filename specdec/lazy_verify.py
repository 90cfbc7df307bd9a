"""Greedy verification that runs the target's LM head only along the accepted path.

A greedy verification reads the target's argmax at the nodes of the accepted path and at the node
after it, nothing else: from the root, the first child (index order) whose token equals the argmax at
the current node is accepted, and the argmax at the last accepted node is the step's new token
(:func:`specdec.ops.greedy_verify`). On a CPU the LM head is a large part of a verify pass (49,152 x
576 for the bundled model: a fifth of an 8-node pass in ``step_parts_2026-12-07``), and most rows of a
tree or a long chain are never read. :class:`LazyGreedyVerify` runs the target without its head
(:meth:`~specdec.HFCausalLM.forward_hidden`), then the head on as few rows as the walk needs:

* first the first c nodes of every row (index order: a chain's first-child path, a tree's top levels;
  parents precede their children, so they form a tree of their own), on whose logits alone
  ``ops.greedy_verify`` walks; a row is decided unless its path ends at a node with a later child that
  holds the argmax there (the op checked the earlier children first, as the whole tree's walk does);
* then, for such rows only, chunks down the first children from the node where the walk left, written
  into a logits buffer on which the op walks again (each path is right up to its first node not computed
  yet; the next chunk starts there), until every path is read.

Because the head is batch invariant (a row's logits are the same bits in any call of up to 64 rows),
the argmax at every node read is the one the full pass gives: the outputs equal ``ops.greedy_verify``
on the full logits, integer for integer (tests/test_lazy_verify.py). Where the target has the head's argmax op
(``HFCausalLM.greedy_head``) the head calls return each row's argmax (int64) instead of its logits, and the op
walks those.

The chunk length follows each request's recent accepted paths: the length that minimises the expected
head cost over its last ``window`` path lengths, a head call of m rows costing
``1 + 0.1 * max(0, m - 3)`` calls of one row (its weight is read once per call; up to 3 rows cost what
one does on the CPU's integer tiles; 0.1 a row rounds up ``lazy_verify_2026-12-07``: rows 3 -> 8 added 0.41 ms
and 3 -> 16 1.57 ms against a one-row head of 1.56 ms in ``step_parts_2026-12-07``) and each further round
one more call; the first call takes the
longest chunk a row asks for and at least 3 rows. Later calls of fewer than 3 rows are padded with
further unread nodes (index order), which cost nothing extra. The Engine runs a step lazily only where
that expected cost, plus the lazy path's own overhead (0.2 calls: a margin over the 0.04 ms a lazy 8-node
pass cost beyond its head calls in ``lazy_verify_2026-12-07``), is below the full pass's head
(:meth:`LazyGreedyVerify.plan`): never for trees of 3 nodes or fewer, nor for requests without history
or whose paths often run long; the full pass's paths feed the history too.
"""
from __future__ import annotations

import functools
from collections import deque
from typing import Deque, Dict, Hashable, List, Optional, Sequence, Tuple

import torch

from specdec import ops

__all__ = ["LazyGreedyVerify", "head_cost"]

MAX_ROWS = 64     # the head's batch-invariance bound (rows per call)
FREE_ROWS = 3     # rows a head call takes for the price of one (the weight read dominates)


def head_cost(rows: int) -> float:
    """The cost model's price of one head call of ``rows`` rows, in one-row calls."""
    return 1.0 + 0.1 * max(0, rows - FREE_ROWS)


OVERHEAD = 0.2    # the lazy path's own price per step (its extra op calls and host reads), in head calls


@functools.lru_cache(maxsize=4096)
def _plan(history: Tuple[int, ...], nodes: int) -> Tuple[int, float]:
    best, best_c = None, nodes
    for c in sorted({min(nodes, FREE_ROWS), nodes} | {n for n in history if FREE_ROWS < n < nodes}):
        cost = head_cost(c) + sum(head_cost(n - c) for n in history if n > c) / len(history)
        if best is None or cost < best - 1e-9:
            best, best_c = cost, c
    return best_c, best


def best_chunk(history: Sequence[int], nodes: int) -> int:
    """The first chunk's length (nodes along the first-child path) for a request whose last accepted paths read
    ``history`` nodes each (accepted + 1), in a tree of ``nodes`` nodes: the minimiser of the expected head cost
    (one call of the chunk, plus one call of the rest for each path longer than it; the optimum lies at the free
    rows, a path length or ``nodes``); ``nodes`` without history."""
    return _plan(tuple(history), nodes)[0] if history else nodes


class LazyGreedyVerify:
    """Greedy verification of a step's tree with the LM head along the accepted path (see the module docstring).

    ``verifier(target, cache, tree, keys)`` runs ``target.forward_hidden`` on the tree and returns
    ``(accepted [b, N] int32, num_accepted [b] int32, out_tokens [b, N] int64)`` as ``ops.greedy_verify``;
    ``keys[r]`` names row r's request (its chunk history: paths of this verifier's steps and those
    :meth:`observe` records); :meth:`plan` says whether a step should run lazily, with which first chunk;
    :meth:`forget` drops a request. Counters: ``steps``,
    ``rounds`` (head calls), ``rows`` (head rows computed), ``nodes`` (rows a full pass would have computed).
    """

    MODES = ("auto", "always", "never")

    def __init__(self, window: int = 16, mode: str = "auto") -> None:
        if int(window) < 1:
            raise ValueError(f"LazyGreedyVerify: window must be >= 1, got {window}")
        if mode not in self.MODES:
            raise ValueError(f"LazyGreedyVerify: mode must be one of {self.MODES}, got {mode!r}")
        self.window = int(window)
        #: "auto": :meth:`plan` runs the lazy path where the cost model expects a saving; "always": on every
        #: eligible step; "never": the full pass always
        self.mode = mode
        self._history: Dict[Hashable, Deque[int]] = {}
        self.steps = self.rounds = self.rows = self.nodes = 0
        self._buf = None
        self._pbuf = None

    def forget(self, key: Hashable) -> None:
        self._history.pop(key, None)

    def observe(self, keys: Sequence[Hashable], num_accepted: Sequence[int]) -> None:
        """Record the paths of a greedy step (num_accepted + 1 nodes read per row); the lazy path records its own."""
        for k, a in zip(keys, num_accepted):
            self._history.setdefault(k, deque(maxlen=self.window)).append(int(a) + 1)

    def plan(self, keys: Sequence[Hashable], nodes: int) -> Optional[int]:
        """The first head call's chunk for rows ``keys`` of ``nodes`` nodes each when the lazy path is expected to
        cost less than the full pass's head (by the cost model, its own OVERHEAD included), else None: a row
        without history, or paths that run past the chunk often enough that the further calls eat the saving."""
        b = len(keys)
        if self.mode == "never" or b == 0 or b * nodes > MAX_ROWS:
            return None
        if self.mode == "always":
            return max(best_chunk(self._history.get(k, ()), nodes) for k in keys)
        if nodes <= FREE_ROWS:
            return None
        hists = [self._history.get(k) for k in keys]
        if any(not h for h in hists):
            return None
        c = max(_plan(tuple(h), nodes)[0] for h in hists)
        further = min(1.0, sum(sum(1 for n in h if n > c) / len(h) for h in hists))  # P(another head call)
        lazy = head_cost(b * c) + further * head_cost(b * (nodes - c)) + OVERHEAD
        return c if lazy < head_cost(b * nodes) else None

    def __call__(self, target, cache, tree, keys: Sequence[Hashable], chunk: Optional[int] = None
                 ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        tokens, parents = tree.tokens, tree.parents
        b, n = tokens.shape
        if len(keys) != b:
            raise ValueError(f"LazyGreedyVerify: keys must name the tree's {b} rows, got {len(keys)}")
        if b * n > MAX_ROWS:
            raise ValueError(f"LazyGreedyVerify: a tree of {b} x {n} nodes exceeds the head's batch-invariant "
                             f"{MAX_ROWS} rows")
        hidden = target.forward_hidden(cache, tokens, tree.depths, tree.attention_mask())   # [b, N, H]
        # the first head call: the first c nodes of every row (index order: a chain's first-child path; a tree's
        # top levels), c the longest chunk the rows' histories ask for, at least the free rows. Parents precede
        # their children, so those nodes are a tree of their own, which the op walks on these logits alone
        if chunk is None:
            chunk = max(best_chunk(self._history.get(k, ()), n) for k in keys)
        c = min(n, max(FREE_ROWS, int(chunk)))
        # the head's argmax op where the target has one (int64 argmaxes, which the op walks as it walks logits)
        head = target.head_argmax if getattr(target, "greedy_head", False) else target.head_logits
        lg = head(hidden[:, :c].reshape(b * c, hidden.shape[-1]))
        lg = lg.view(b, c) if lg.dtype == torch.int64 else lg.view(b, c, -1)
        self.rounds += 1
        self.rows += b * c
        accepted, num, out = ops.greedy_verify(tokens[:, :c], parents[:, :c], lg)
        toks, pars = tokens.tolist(), parents.tolist()
        acc, nums, outs = accepted.tolist(), num.tolist(), out.tolist()
        # a path that ends at a node with a child past the c nodes holding the argmax there goes on (the op
        # checked the children among the c nodes first, as the whole tree's walk does: index order)
        ends = [(acc[r][nums[r]], outs[r][nums[r]]) for r in range(b)]   # (last accepted node, argmax there)
        goes_on = [next((v for v in range(c, n) if pars[r][v] == ends[r][0] and toks[r][v] == ends[r][1]), -1)
                   for r in range(b)]
        if all(v < 0 for v in goes_on):
            self.observe(keys, nums)
            self.steps += 1
            self.nodes += b * n
            if c < n:
                accepted = torch.cat([accepted, accepted.new_full((b, n - c), -1)], dim=1)
                out = torch.cat([out, out.new_full((b, n - c), -1)], dim=1)
            return accepted, num, out
        logits = self._logits(b, n, None if lg.dtype == torch.int64 else lg.shape[-1])
        logits[:, :c] = lg
        return self._go_on(head, tree, keys, hidden, logits, c, toks, pars, acc, nums, goes_on)

    def _go_on(self, head, tree, keys, hidden, logits, c, toks, pars, acc, nums, goes_on):
        """Further head calls for the rows whose walk left the first c nodes: each from the node where it left,
        down its first children (chunk lengths from the history), until every row's path is read."""
        tokens, parents = tree.tokens, tree.parents
        b, n = tokens.shape
        kids: List[List[List[int]]] = []
        for r in range(b):
            ch: List[List[int]] = [[] for _ in range(n)]
            for v in range(1, n):
                p = pars[r][v]
                if 0 <= p < n and toks[r][v] >= 0:
                    ch[p].append(v)
            kids.append(ch)
        real = [{v for ch in k for v in ch} for k in kids]          # the nodes that are not padding
        read: List[set] = [set(range(c)) for _ in range(b)]          # nodes whose logits are in the buffer
        pending = {r for r in range(b) if goes_on[r] >= 0}
        done = [r for r in range(b) if r not in pending]  # decided by the first call
        self.observe([keys[r] for r in done], [nums[r] for r in done])
        want = [self._chunk(kids[r], goes_on[r], best_chunk(self._history.get(keys[r], ()), n - nums[r] - 1))
                if r in pending else [] for r in range(b)]
        while True:
            self._pad(want, real, read)
            rows = [(r, v) for r in range(b) for v in want[r]]
            ri = torch.tensor([r for r, _ in rows], dtype=torch.int64, device=hidden.device)
            vi = torch.tensor([v for _, v in rows], dtype=torch.int64, device=hidden.device)
            logits[ri, vi] = head(hidden[ri, vi])
            self.rounds += 1
            self.rows += len(rows)
            for r, v in rows:
                read[r].add(v)
            # the op walks every row on the rows read so far (and stale rows beyond): each row's path is right up
            # to its first node not read yet, whose row the next call computes
            accepted, num, out = ops.greedy_verify(tokens, parents, logits)
            acc, nums = accepted.tolist(), num.tolist()
            want = [[] for _ in range(b)]
            for r in sorted(pending):
                path = acc[r][:nums[r] + 1]
                stop = next((i for i, v in enumerate(path) if v not in read[r]), -1)
                if stop < 0:   # the whole path read: row r is decided (its history gets this path once)
                    self.observe([keys[r]], [nums[r]])
                    pending.discard(r)
                else:
                    want[r] = self._chunk(kids[r], path[stop], best_chunk(self._history.get(keys[r], ()), n - stop))
            if not pending:
                break
        self.steps += 1
        self.nodes += b * n
        return accepted, num, out

    def _logits(self, b: int, n: int, vocab: Optional[int]) -> torch.Tensor:
        """The [b, n, vocab] float32 buffer of a step's logits rows, or (vocab None: the head's argmax op) the
        [b, n] int64 buffer of its argmaxes (one allocation each, kept across steps; rows not computed this step
        hold earlier values: a walk that reaches one is cut there and continued)."""
        need = b * n * (vocab or 1)
        dtype = torch.float32 if vocab else torch.int64
        buf = self._buf if vocab else self._pbuf
        if buf is None or buf.numel() < need:
            buf = torch.zeros(need, dtype=dtype)
            if vocab:
                self._buf = buf
            else:
                self._pbuf = buf
        return buf[:need].view(b, n, vocab) if vocab else buf[:need].view(b, n)

    # ------------------------------------------------------------------ chunks
    @staticmethod
    def _chunk(kids: List[List[int]], start: int, length: int) -> List[int]:
        """Up to ``length`` nodes from ``start`` down its first children."""
        out = [start]
        while len(out) < length and kids[out[-1]]:
            out.append(kids[out[-1]][0])
        return out

    @staticmethod
    def _pad(want: List[List[int]], real: List[set], read: List[set]) -> None:
        """Fill a head call of fewer than FREE_ROWS rows with unread nodes of its rows (index order; free)."""
        total = sum(len(w) for w in want)
        for r, w in enumerate(want):
            if not w:
                continue
            for v in sorted(real[r]):
                if total >= FREE_ROWS:
                    return
                if v not in read[r] and v not in w:
                    w.append(v)
                    total += 1
