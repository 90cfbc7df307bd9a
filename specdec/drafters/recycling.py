"""TokenRecycling: draft from the target's own top-w next tokens seen in earlier verify passes.

Token Recycling (Luo et al. 2024, arXiv:2408.08696): keep an adjacency table ``table[x]``
= the target's top-w next tokens after token x, as seen the last time x was a node of a
verify pass, and draft a token tree by following the table from the root along a static
template (node = (parent, rank): its token is ``table[token(parent), rank]``).

* The table is [V + 2, w] int64 on the target's device, initialised EMPTY (-1: nothing
  seen yet); row V is a write sink, row V + 1 stays -1 (the row read for an invalid parent).
* ``observe_verify(tree, logits)`` runs after every verify forward, BEFORE the sampler warps
  the logits in place: ``topk(logits, w)`` of EVERY node (accepted or not, padding
  excluded) is written into the rows of the nodes' tokens with one ``index_copy_``; when a
  token appears at several nodes of the pass, the last node (highest flat index b * N + i)
  wins, so the update is deterministic; no host synchronisation. On a CPU target the same
  update is one C++ call (``specdec._C.recycling_observe`` on numpy views of the tables: one
  pass over the logits with a vectorised threshold test instead of a dozen torch dispatches);
  the tests check that both paths write the same rows.
* ``propose`` fills the template level by level with gathers on the device; one host copy
  of the [b, T] tokens then drops the nodes whose table entry is empty (and their
  subtrees) and those deeper than the request's budget. On a CPU target that copy is free;
  on CUDA it is the one synchronisation of the proposal.

Context (``context=2``, the default): a second table keyed by the PAIR (previous token, token)
holds the top-w next tokens seen after that pair (hashed rows [H, w] with the exact pair
stored beside each row, so a collision is a miss, never a wrong row); a node whose (parent
token, token) pair has a row drafts from it, otherwise from the one-token row. Both tables
are written from every node of every verify pass (a root's previous token is the last token
before it in its sequence). A one-token key mixes the continuations of every context a token
was seen in; the pair key keeps them apart, which is why it is the default (docs/drafters.md).
``context=1`` is the paper's table alone.

The template: the ``node_budget - 1`` best (parent, rank) nodes under a rank prior
(``rank_prior[r]`` ~ how often the rank-r token is accepted; a node's score is the product
over its path), up to ``max_depth`` deep. Candidates are deterministic (q one-hot,
``draft_probs`` None): exact for greedy and sampling. All requests of the decoder share one
table (it describes the model, not a request) and it persists across generate calls.
"""
from __future__ import annotations

import heapq

import numpy as np
from typing import List, Optional, Sequence, Tuple

import torch

from specdec import _C
from specdec._check import require_int
from specdec.drafters.base import Draft, Drafter, StepContext
from specdec.tree import TokenTree

__all__ = ["TokenRecycling"]

_EMPTY_KEY = -(1 << 62)
_HASH = 0x9E3779B1


def _topk_indices(x: torch.Tensor, w: int, chunk: int = 256) -> torch.Tensor:
    """``x.topk(w, dim=-1).indices`` for [M, V] logits with a large V, in two cheap passes: the w chunks
    (of ``chunk`` columns) with the largest maxima hold the w largest values (a value outside them has
    w larger chunk maxima above it), so one vectorised max per chunk and two small topk calls replace a
    topk over the whole row, which on the CPU costs more at a large V. Ties may order differently
    from torch.topk (the table only steers drafts, which are verified)."""
    M, V = x.shape
    C = -(-V // chunk)
    if C <= 2 * w:
        return x.topk(w, dim=-1).indices
    if C * chunk != V:
        x = torch.nn.functional.pad(x, (0, C * chunk - V), value=float("-inf"))
    xc = x.reshape(M, C, chunk)
    best = xc.amax(dim=2).topk(w, dim=1).indices                         # [M, w] chunks
    cand = xc.gather(1, best.unsqueeze(2).expand(M, w, chunk)).reshape(M, w * chunk)
    top = cand.topk(w, dim=1).indices                                    # [M, w] in the candidates
    # a row of (almost) all -inf could pick padding: clamp into the vocabulary (still a valid token)
    return (best.gather(1, top // chunk) * chunk + top % chunk).clamp_(max=V - 1)


def recycling_template(node_budget: int, max_depth: int, rank_prior: Sequence[float]) -> List[Tuple[int, int, int]]:
    """Static tree: [(parent, rank, depth)] of the node_budget - 1 best nodes, breadth-first (root = node 0)."""
    w = len(rank_prior)
    chosen: List[Tuple[float, int, int, Tuple[int, ...]]] = []
    heap = [(-rank_prior[r], 0, r, (r,)) for r in range(w)]  # (-score, tie, rank, path of ranks)
    heapq.heapify(heap)
    tie = 0
    while heap and len(chosen) < node_budget - 1:
        neg, _, r, path = heapq.heappop(heap)
        chosen.append((-neg, len(path), r, path))
        if len(path) < max_depth:
            for r2 in range(w):
                tie += 1
                heapq.heappush(heap, (neg * rank_prior[r2], tie, r2, path + (r2,)))
    chosen.sort(key=lambda c: (len(c[3]), c[3]))  # breadth-first, parents before children
    index = {(): 0}
    out = []
    for i, (_, depth, r, path) in enumerate(chosen):
        index[path] = i + 1
        out.append((index[path[:-1]], r, depth))
    return out


class TokenRecycling(Drafter):
    """Draft trees from a [V, w] table of the target's top-w next tokens (updated from every verify pass).

    Parameters
    ----------
    top_w : int
        Next tokens kept per token (table width).
    node_budget : int
        Template nodes, root included (the most a proposal verifies per request).
    max_depth : int
        Deepest template node.
    rank_prior : sequence of float, optional
        Score of each rank when the template is chosen (length top_w, decreasing); default
        0.6, 0.15, 0.08, ... (top-1 continuations dominate on a small model).
    context : int
        2 (default): draft from the (previous token, token) pair's row when the pair was seen,
        else from the token's row; 1: the token's row only (the paper's table).
    pair_rows : int
        Rows of the hashed pair table (a power of two; memory ``pair_rows * (top_w + 1) * 8`` bytes).
    """

    def __init__(self, top_w: int = 4, node_budget: int = 12, max_depth: int = 6,
                 rank_prior: Optional[Sequence[float]] = None, context: int = 2, pair_rows: int = 1 << 16) -> None:
        for name, v, lo in (("top_w", top_w, 1), ("node_budget", node_budget, 2), ("max_depth", max_depth, 1),
                            ("context", context, 1), ("pair_rows", pair_rows, 1)):
            require_int("TokenRecycling", name, v, lo)
        if rank_prior is None:
            rank_prior = [0.6, 0.15, 0.08, 0.05, 0.03, 0.02, 0.01, 0.01][:top_w] + [0.005] * max(0, top_w - 8)
        if context > 2:
            raise ValueError(f"TokenRecycling: context must be 1 (one-token key) or 2 (token pairs), got {context}")
        if pair_rows & (pair_rows - 1):
            raise ValueError(f"TokenRecycling: pair_rows must be a power of two, got {pair_rows}")
        rank_prior = [float(x) for x in rank_prior]
        if len(rank_prior) != top_w or not all(0.0 < x < 1.0 for x in rank_prior):
            raise ValueError(f"TokenRecycling: rank_prior must hold top_w = {top_w} numbers in (0, 1), "
                             f"got {rank_prior}")
        self.top_w = top_w
        self.node_budget = node_budget
        self.max_depth = max_depth
        self.rank_prior = rank_prior
        self.template = recycling_template(node_budget, max_depth, rank_prior)
        self.max_nodes = 1 + len(self.template)
        self.context = context
        self.pair_rows = pair_rows
        self.table: Optional[torch.Tensor] = None
        self.pair_table: Optional[torch.Tensor] = None   # [pair_rows + 1, w]; row pair_rows is the write sink
        self.pair_keys: Optional[torch.Tensor] = None  # [pair_rows + 1] pair key per row (_EMPTY_KEY: none)
        self._prev_roots: Optional[torch.Tensor] = None  # [b] the token before each root of the last proposal
        self.vocab_size: Optional[int] = None
        self.device = torch.device("cpu")
        self.host_levels = True   # on a CPU target: the level gathers on numpy views (same results)
        # levels of the template: (node indices, parent indices, ranks) per depth
        levels = {}
        for i, (p, r, d) in enumerate(self.template):
            levels.setdefault(d, []).append((i + 1, p, r))
        self._levels = [levels[d] for d in sorted(levels)]
        self._depth_of = [0] + [d for _, _, d in self.template]
        self._parent_of = [-1] + [p for p, _, _ in self.template]
        # per template node: its parent's parent (-1: the parent is the root, whose previous token is
        # the sequence's second-to-last)
        self._grand_of = [-1] + [self._parent_of[p] if p > 0 else -1 for p, _, _ in self.template]

    def __repr__(self) -> str:
        return (f"TokenRecycling(top_w={self.top_w}, node_budget={self.node_budget}, max_depth={self.max_depth}, "
                f"context={self.context})")

    def bind(self, target, max_batch: int, max_len: int) -> None:
        V = int(target.vocab_size)
        dev = torch.device(target.device)
        if self.table is not None and (self.vocab_size != V or self.table.device != dev):
            raise ValueError(f"TokenRecycling: already bound to a target with vocabulary {self.vocab_size} on "
                             f"{self.table.device}; got vocabulary {V} on {dev} (use one TokenRecycling per model)")
        if self.top_w > V:
            raise ValueError(f"TokenRecycling: top_w = {self.top_w} exceeds the vocabulary size {V}")
        self.vocab_size = V
        self.device = dev
        if self.table is None:
            self.reset()
        # per level: node, parent, rank and grandparent indices into the proposal's token row, whose last
        # column (index max_nodes) holds the token before the root
        T = self.max_nodes
        self._lv_np = [tuple(np.asarray(col, dtype=np.int64) for col in zip(
            *((n, p, r, T if self._grand_of[n] < 0 else self._grand_of[n]) for n, p, r in lv)))
            for lv in self._levels]
        self._lv = [tuple(torch.from_numpy(col).to(dev) for col in lv) for lv in self._lv_np]

    def reset(self) -> None:
        """Empty the table (as after construction)."""
        if self.vocab_size is None:
            raise ValueError("TokenRecycling: reset before bind (no target vocabulary yet)")
        self.table = torch.full((self.vocab_size + 2, self.top_w), -1, dtype=torch.int64, device=self.device)
        if self.context == 2:
            self.pair_table = torch.full((self.pair_rows + 1, self.top_w), -1, dtype=torch.int64, device=self.device)
            # empty rows hold a key below any that propose computes (>= -V - 1, for missing tokens)
            self.pair_keys = torch.full((self.pair_rows + 1,), _EMPTY_KEY, dtype=torch.int64, device=self.device)

    @property
    def _np_tables(self):
        """numpy views (shared memory) of the CPU tables."""
        return tuple(None if t is None else t.numpy() for t in (self.table, self.pair_table, self.pair_keys))

    def filled_rows(self) -> int:
        """Tokens whose row holds an entry (host sync: for reports and tests, not the step loop)."""
        return int((self.table[:self.vocab_size, 0] >= 0).sum())

    def filled_pairs(self) -> int:
        """Pair rows that hold an entry (host sync: for reports and tests)."""
        return 0 if self.pair_keys is None else int((self.pair_keys[:self.pair_rows] >= 0).sum())

    def memory_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.table, self.pair_table, self.pair_keys)
                   if t is not None)

    def _pair_slot(self, prev: torch.Tensor, tok: torch.Tensor):
        """(key, row) of the pairs (prev, tok); key -1 where prev or tok is not a token."""
        valid = (prev >= 0) & (tok >= 0)
        key = torch.where(valid, prev * self.vocab_size + tok, -1)
        # multiplicative hashing (int64 arithmetic wraps); the stored key tells a collision from a hit
        row = (key * _HASH) & (self.pair_rows - 1)
        return key, row

    # ------------------------------------------------------------------ the table
    def observe_verify(self, tree: TokenTree, logits: torch.Tensor) -> None:
        """Write the top-w next tokens of every node of a verify pass into its token's row."""
        if self.device.type == "cpu" and self.host_levels and logits.dtype == torch.float32:
            # one C++ call on numpy views of the tables instead of the torch calls below
            b = tree.tokens.shape[0]
            prev = self._prev_roots if self.context == 2 else None
            if prev is not None and prev.shape[0] != b:
                prev = None
            table, pair_table, pair_keys = self._np_tables
            try:   # every argument is checked before the first write: bad input leaves the tables as they were
                _C.recycling_observe(table, pair_table, pair_keys, tree.tokens.to(torch.int64).contiguous().numpy(),
                                     tree.parents.to(torch.int32).contiguous().numpy(),
                                     None if prev is None else prev.numpy(), logits.detach().contiguous().numpy())
            except ValueError as exc:
                raise ValueError(f"TokenRecycling.observe_verify: {exc}") from None
            return
        self._observe_torch(tree, logits)

    def _observe_torch(self, tree: TokenTree, logits: torch.Tensor) -> None:
        """The update with torch calls only (the device path; the host path's reference in the tests)."""
        V, w = self.vocab_size, self.top_w
        b, N = tree.tokens.shape
        M = b * N
        tok = tree.tokens.reshape(M)                                   # [M] int64, -1 = padding
        top = _topk_indices(logits.reshape(M, logits.shape[-1]), w)   # [M, w]
        # the last occurrence of a token wins: earlier ones are sent to the sink row V
        later_same = (tok.unsqueeze(1) == tok.unsqueeze(0)).triu_(diagonal=1).any(dim=1)   # [M]
        dest = torch.where((tok < 0) | later_same, V, tok)
        self.table.index_copy_(0, dest, top)
        if self.context == 2:
            parents = tree.parents                                     # [b, N], -1 at the root and padding
            prev = tree.tokens.gather(1, parents.clamp(min=0))
            roots_prev = self._prev_roots
            if roots_prev is None or roots_prev.shape[0] != b:
                roots_prev = torch.full((b,), -1, dtype=torch.int64, device=tok.device)
            prev = torch.where(parents < 0, roots_prev.view(b, 1), prev).reshape(M)
            key, row = self._pair_slot(prev, tok)
            row = torch.where(key < 0, -1, row)    # no pair: never the "later node" of a real pair's row
            later_row = (row.unsqueeze(1) == row.unsqueeze(0)).triu_(diagonal=1).any(dim=1)
            pdest = torch.where((key < 0) | later_row, self.pair_rows, row)
            self.pair_table.index_copy_(0, pdest, top)
            self.pair_keys.index_copy_(0, pdest, key)

    # ------------------------------------------------------------------ steps
    def propose(self, ctx: StepContext) -> Draft:
        b = ctx.roots.shape[0]
        T = self.max_nodes
        V = self.vocab_size
        pairs = self.context == 2
        if pairs:
            prev_roots = [seq[-2] if len(seq) >= 2 else -1 for seq in ctx.sequences]
        if self.device.type == "cpu" and self.host_levels:
            # the same gathers on numpy views of the tables (they share the tensors' memory): a numpy
            # call costs a fraction of a torch call's dispatch, and a template takes a dozen calls per level
            ext = np.full((b, T + 1), -1, dtype=np.int64)
            ext[:, 0] = ctx.roots.numpy()
            if pairs:
                ext[:, T] = prev_roots
                self._prev_roots = torch.tensor(prev_roots, dtype=torch.int64)
            levels, where = self._lv_np, np.where
            tables = self._np_tables
        else:
            ext = torch.full((b, T + 1), -1, dtype=torch.int64, device=self.device)   # + the token before the root
            ext[:, 0] = ctx.roots
            if pairs:
                self._prev_roots = ext[:, T] = torch.tensor(prev_roots, dtype=torch.int64, device=self.device)
            levels, where = self._lv, torch.where
            tables = (self.table, self.pair_table, self.pair_keys)
        table, pair_table, pair_keys = tables
        Vw = V + 2
        H1 = self.pair_rows - 1
        for nodes, parents, ranks, grands in levels:
            ptok = ext[:, parents]                                       # [b, L]
            nxt = table[ptok % Vw, ranks]                                # token -1 -> row V + 1 (empty)
            if pairs:
                # a missing token makes a negative key: never a stored pair, never the empty rows' key
                key = ext[:, grands] * V + ptok
                prow = (key * _HASH) & H1
                nxt = where(pair_keys[prow] == key, pair_table[prow, ranks], nxt)
            ext[:, nodes] = nxt
        toks = ext[:, :T]
        host = toks.tolist()   # the proposal's one host copy (free on CPU)
        all_tokens, all_parents = [], []
        depth_of, parent_of = self._depth_of, self._parent_of
        for r in range(b):
            budget = ctx.budgets[r]
            row = host[r]
            new_index = {0: 0}
            t_out, p_out = [row[0]], [-1]
            for i in range(1, T):
                p = parent_of[i]
                if row[i] < 0 or depth_of[i] > budget or p not in new_index:
                    continue
                new_index[i] = len(t_out)
                t_out.append(row[i])
                p_out.append(new_index[p])
            all_tokens.append(t_out)
            all_parents.append(p_out)
        if all(len(t) == 1 for t in all_tokens):
            return Draft(TokenTree.root_only(ctx.roots))
        return Draft(TokenTree.from_lists(all_tokens, all_parents, device=self.device))
