"""TokenTree: the candidate tokens of one speculative step, for a batch of requests.

Layout (docs/design.md): B requests, N nodes each, node 0 = the ROOT (the last emitted
token, whose K/V is not in the cache yet). Nodes are in topological order
(``parents[b, i] < i``, ``parents[b, 0] == -1``). Requests with fewer nodes are
padded: padding nodes have token -1, parent -1, depth 0 and sit after every real node.

* ``tokens``  [B, N] int64
* ``parents`` [B, N] int32
* ``depths``  [B, N] int32, depth below the root (root 0): the target places node i
  at position ``cache_lens[b] + depths[b, i]``.
* ``num_nodes``: host list, real nodes per request (root included).
* ``is_chain``: every request is a chain (node i's parent is i - 1) followed by
  padding, so the causal mask (``tree_mask=None``) is exact: padding nodes are
  never anyone's child and are never accepted, whatever they attend to.

Builders: :meth:`TokenTree.chain` (device tensors, no host work),
:meth:`TokenTree.from_lists` (host lists of tokens + parents),
:meth:`TokenTree.from_candidates` (trie of candidate continuations),
:meth:`TokenTree.top_k_shape` (the static shape of a top-k tree).
"""
from __future__ import annotations

import heapq
import math
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence, Tuple

import torch

__all__ = ["TokenTree", "ancestor_mask", "expected_tokens", "expected_tokens_chain", "expected_tokens_tree",
           "plan_tree"]

_ROOT_ONLY: Dict[Tuple[int, torch.device], Tuple[torch.Tensor, torch.Tensor]] = {}  # root_only's parents, depths


@dataclass
class TokenTree:
    tokens: torch.Tensor   # [B, N] int64, -1 = padding
    parents: torch.Tensor  # [B, N] int32, -1 = root / padding
    depths: torch.Tensor   # [B, N] int32
    num_nodes: List[int]   # real nodes per request, root included
    is_chain: bool = False
    _mask: Optional[torch.Tensor] = field(default=None, repr=False)
    max_depths: Optional[List[int]] = None  # host: deepest node per request (known to most builders)

    # ------------------------------------------------------------------ shape
    @property
    def batch(self) -> int:
        return self.tokens.shape[0]

    @property
    def size(self) -> int:
        """N: nodes per request including the root and padding."""
        return self.tokens.shape[1]

    @property
    def num_drafted(self) -> List[int]:
        """Draft nodes per request (root excluded)."""
        return [n - 1 for n in self.num_nodes]

    def depth_per_request(self) -> List[int]:
        """Deepest node of each request (= drafted tokens for a chain). Host values; reads the device only
        when the builder did not record them."""
        if self.max_depths is not None:
            return list(self.max_depths)
        if self.is_chain:
            return self.num_drafted
        return self.depths.amax(dim=1).tolist()

    # ------------------------------------------------------------------ masks
    def mask(self) -> torch.Tensor:
        """[B, N, N] bool: node i sees node j iff j is i or an ancestor of i (padding: itself only)."""
        if self._mask is None:  # the walk takes one step per generation: as many as the deepest node's depth
            deepest = max(self.max_depths) if self.max_depths else None
            self._mask = ancestor_mask(self.parents, deepest)
        return self._mask

    def attention_mask(self) -> Optional[torch.Tensor]:
        """What the target's forward takes: None (causal chain) when the tree is a chain, else :meth:`mask`."""
        return None if self.is_chain else self.mask()

    def packed_mask(self) -> torch.Tensor:
        """[B, N, ceil(N / 32)] int32 bit-packed :meth:`mask`: bit (j % 32) of word j // 32 is mask[..., j]."""
        m = self.mask()
        B, N, _ = m.shape
        W = (N + 31) // 32
        padded = torch.zeros(B, N, W * 32, dtype=torch.int64, device=m.device)
        padded[..., :N] = m.to(torch.int64)
        weights = torch.bitwise_left_shift(torch.ones(32, dtype=torch.int64, device=m.device),
                                           torch.arange(32, device=m.device))
        words = (padded.view(B, N, W, 32) * weights).sum(-1)  # [B, N, W] in [0, 2^32)
        words = torch.where(words >= 2 ** 31, words - 2 ** 32, words)
        return words.to(torch.int32)

    # ------------------------------------------------------------------ builders
    @staticmethod
    def root_only(roots: torch.Tensor) -> "TokenTree":
        """A 0-length draft: [B, 1] holding the roots (plain decoding step)."""
        B = roots.shape[0]
        tokens = roots.view(B, 1) if roots.dtype == torch.int64 and roots.is_contiguous() \
            else roots.reshape(B, 1).to(torch.int64)
        key = (B, roots.device)
        consts = _ROOT_ONLY.get(key)
        if consts is None:  # read-only constants, made once per batch size (a plain step runs many)
            consts = _ROOT_ONLY[key] = (torch.full((B, 1), -1, dtype=torch.int32, device=roots.device),
                                        torch.zeros((B, 1), dtype=torch.int32, device=roots.device))
        return TokenTree(tokens, consts[0], consts[1], [1] * B, is_chain=True)

    @staticmethod
    def chain(tokens: torch.Tensor, num_nodes: Optional[Sequence[int]] = None,
              parents: Optional[torch.Tensor] = None, depths: Optional[torch.Tensor] = None) -> "TokenTree":
        """Chains: tokens [B, N] = root then drafts; request b uses its first ``num_nodes[b]`` nodes.

        Nodes past ``num_nodes[b]`` become padding (token -1, parent -1, depth 0). ``parents`` /
        ``depths`` may be passed precomputed (a full chain's [B, N] constants) to skip building them.
        """
        B, N = tokens.shape
        dev = tokens.device
        if num_nodes is None:
            num_nodes = [N] * B
        full = all(n == N for n in num_nodes)
        if parents is None or depths is None or not full:
            ar = torch.arange(N, device=dev)
            parents = (ar - 1).to(torch.int32).expand(B, N)
            depths = ar.to(torch.int32).expand(B, N)
            if not full:
                real = ar.unsqueeze(0) < torch.tensor(list(num_nodes), device=dev).unsqueeze(1)  # [B, N]
                tokens = torch.where(real, tokens, -1)
                parents = torch.where(real, parents, -1)
                depths = torch.where(real, depths, 0)
            parents = parents.contiguous()
            depths = depths.contiguous()
        return TokenTree(tokens.contiguous(), parents, depths, list(num_nodes), is_chain=True)

    @staticmethod
    def from_lists(tokens: Sequence[Sequence[int]], parents: Sequence[Sequence[int]],
                   device: torch.device | str = "cpu", size: Optional[int] = None) -> "TokenTree":
        """Host lists (one per request, root first, topologically ordered) -> padded TokenTree."""
        if len(tokens) != len(parents):
            raise ValueError(f"TokenTree.from_lists: {len(tokens)} token lists but {len(parents)} parent lists")
        B = len(tokens)
        N = max([len(t) for t in tokens] + [size or 1])
        tok = [[-1] * N for _ in range(B)]
        par = [[-1] * N for _ in range(B)]
        dep = [[0] * N for _ in range(B)]
        chain = True
        for b, (ts, ps) in enumerate(zip(tokens, parents)):
            if len(ts) != len(ps) or len(ts) < 1:
                raise ValueError(f"TokenTree.from_lists: request {b} has {len(ts)} tokens and {len(ps)} parents "
                                 "(need the same number, >= 1)")
            if ps[0] != -1:
                raise ValueError(f"TokenTree.from_lists: request {b}: node 0 must be the root (parent -1), got {ps[0]}")
            for i, (t, p) in enumerate(zip(ts, ps)):
                if i > 0 and not 0 <= p < i:
                    raise ValueError(f"TokenTree.from_lists: request {b} node {i}: parent must lie in [0, {i}), "
                                     f"got {p}")
                tok[b][i] = int(t)
                par[b][i] = int(p)
                dep[b][i] = 0 if i == 0 else dep[b][p] + 1
                chain = chain and (i == 0 or p == i - 1)
        return TokenTree(torch.tensor(tok, dtype=torch.int64, device=device),
                         torch.tensor(par, dtype=torch.int32, device=device),
                         torch.tensor(dep, dtype=torch.int32, device=device),
                         [len(t) for t in tokens], is_chain=chain, max_depths=[max(d) for d in dep])

    @staticmethod
    def from_candidates(roots: Sequence[int], candidates: Sequence[Sequence[Sequence[int]]], merge: bool = True,
                        device: torch.device | str = "cpu", max_nodes: Optional[int] = None) -> "TokenTree":
        """One tree per request from candidate continuations of its root.

        ``candidates[b]`` is a list of token lists (continuations after ``roots[b]``).
        ``merge=True`` builds a trie: equal prefixes share nodes (right for deterministic
        candidates and for greedy verification). ``merge=False`` keeps every candidate as
        its own branch under the root, so equal tokens drawn by different samples stay
        separate siblings (required for exact sampling with sampled drafts). Nodes are
        numbered breadth-first (topological). ``max_nodes`` caps nodes per request
        (root included), dropping the deepest nodes first.
        """
        if len(roots) != len(candidates):
            raise ValueError(f"TokenTree.from_candidates: {len(roots)} roots but {len(candidates)} candidate lists")
        all_tokens: List[List[int]] = []
        all_parents: List[List[int]] = []
        for root, cands in zip(roots, candidates):
            # build the trie as (token, parent) nodes; node 0 = root
            nodes_tok = [int(root)]
            nodes_par = [-1]
            nodes_dep = [0]
            child_of = {}  # (parent, token) -> node (merge mode)
            for cand in cands:
                parent = 0
                for t in cand:
                    t = int(t)
                    key = (parent, t)
                    if merge and key in child_of:
                        parent = child_of[key]
                        continue
                    nodes_tok.append(t)
                    nodes_par.append(parent)
                    nodes_dep.append(nodes_dep[parent] + 1)
                    child_of[key] = len(nodes_tok) - 1
                    parent = len(nodes_tok) - 1
            # breadth-first renumbering (stable: by depth, then creation order)
            order = sorted(range(len(nodes_tok)), key=lambda i: (nodes_dep[i], i))
            if max_nodes is not None:
                order = order[:max(1, int(max_nodes))]
            new_index = {old: new for new, old in enumerate(order)}
            all_tokens.append([nodes_tok[i] for i in order])
            all_parents.append([-1 if nodes_par[i] < 0 else new_index[nodes_par[i]] for i in order])
        return TokenTree.from_lists(all_tokens, all_parents, device=device)

    @staticmethod
    def top_k_shape(top_k: int, depth: int, node_budget: Optional[int] = None) -> List[List[int]]:
        """Parent lists per level of a top-k tree of the given depth (root excluded).

        Level d holds ``top_k ** d`` nodes (each node of level d - 1 gets top_k children),
        truncated so that the total stays within ``node_budget - 1`` draft nodes. Returns
        ``levels[d] = list of parent indices`` (global node indices, root = 0).
        """
        levels: List[List[int]] = []
        budget = None if node_budget is None else max(0, int(node_budget) - 1)
        frontier = [0]
        next_index = 1
        for _ in range(depth):
            level = []
            for p in frontier:
                for _c in range(top_k):
                    if budget is not None and next_index - 1 >= budget:
                        break
                    level.append(p)
                    next_index += 1
            if not level:
                break
            levels.append(level)
            frontier = list(range(next_index - len(level), next_index))
        return levels


_DOUBLING_MAX_N = 256  # ancestor_mask: matrix doubling up to this many nodes per request


def ancestor_mask(parents: torch.Tensor, max_depth: Optional[int] = None) -> torch.Tensor:
    """[B, N] int32 parents -> [B, N, N] bool ancestor-or-self mask, vectorised (no host sync).

    Up to _DOUBLING_MAX_N nodes: A = self + parent edges as a 0/1 matrix, squared ceil(log2(depth))
    times (A^(2^k) reaches every ancestor up to 2^k generations up; entries are clamped to 1, so every
    product is a small exact integer): a handful of [B, N, N] matmuls, cheaper on the CPU than
    walking one generation per step at draft-tree sizes. Larger trees walk, one generation per
    iteration. ``max_depth``: the deepest node's depth when the caller knows it (a draft
    tree of depth k), else N - 1.
    """
    B, N = parents.shape
    dev = parents.device
    par = parents.to(torch.int64)
    steps = N - 1 if max_depth is None else min(N - 1, int(max_depth))
    if N <= _DOUBLING_MAX_N:
        a = torch.zeros(B, N, N + 1, dtype=torch.float32, device=dev)
        a.scatter_(2, torch.where(par >= 0, par, N).unsqueeze(-1), 1.0)   # column N: no parent (dropped)
        a = a[..., :N] + torch.eye(N, dtype=torch.float32, device=dev)
        for _ in range(math.ceil(math.log2(steps)) if steps > 1 else 0):
            a = torch.bmm(a, a).clamp_(max=1.0)
        return a > 0
    mask = torch.eye(N, dtype=torch.bool, device=dev).expand(B, N, N).clone()
    self_index = torch.arange(N, device=dev).expand(B, N)
    cur = par  # [B, N]: current ancestor of each node (-1: none left)
    for _ in range(steps):
        valid = cur >= 0
        # mark the ancestor; nodes without one re-mark themselves (already True)
        mask.scatter_(2, torch.where(valid, cur, self_index).unsqueeze(-1), True)
        cur = torch.where(valid, torch.gather(par, 1, cur.clamp(min=0)), -1)
    return mask


# ---------------------------------------------------------------------- expected accepted length
def expected_tokens(alpha: float, k: int) -> float:
    """E[T] = (1 - alpha^(k+1)) / (1 - alpha): tokens per step of a k-chain with i.i.d. acceptance alpha."""
    if k <= 0:
        return 1.0
    if alpha >= 1.0:
        return float(k + 1)
    return (1.0 - alpha ** (k + 1)) / (1.0 - alpha)


def expected_tokens_chain(alphas: Sequence[float], k: int) -> float:
    """E[T] = 1 + sum_{i=1..k} prod_{j<=i} alphas[j-1] (positional acceptance; the last alpha repeats)."""
    total, run = 1.0, 1.0
    for i in range(k):
        a = alphas[i] if i < len(alphas) else (alphas[-1] if alphas else 0.0)
        run *= a
        total += run
    return total


def expected_tokens_tree(parents: Sequence[int], accept: Sequence[float]) -> float:
    """E[T] of a token tree: 1 + sum over draft nodes of P(the path root -> node is accepted).

    ``parents[i]`` (topological, ``parents[0] == -1``); ``accept[i]`` = P(node i accepted | its
    parent accepted). Siblings are mutually exclusive (at most one child is accepted), so the
    expected accepted path length is the sum of the nodes' path probabilities.
    """
    path = [1.0] * len(parents)
    total = 1.0
    for i in range(1, len(parents)):
        p = parents[i]
        if not 0 <= p < i:
            raise ValueError(f"expected_tokens_tree: parents[{i}] must lie in [0, {i}), got {p}")
        path[i] = path[p] * accept[i]
        total += path[i]
    return total


def plan_tree(accept_by_rank, max_nodes: int, max_depth: int = 64, max_parents_per_depth: Optional[int] = None
              ) -> Tuple[List[int], List[Tuple[int, int]], float]:
    """The tree of at most ``max_nodes`` nodes (root included) with the largest E[T] (Sequoia-style).

    ``accept_by_rank(depth, rank) -> float``: P(the rank-th child (0-based) of an accepted node at
    ``depth - 1`` is accepted), e.g. :meth:`AcceptanceStats.tree_alpha`. Best-first: the frontier
    holds, for every node, its next child slot (next rank) and, for the newest child, its first
    grandchild slot; the node with the largest path probability is added next. With acceptance
    that does not grow with depth or rank this yields the optimal tree for every budget.
    ``max_parents_per_depth``: at most that many nodes of one depth get children (a drafter that
    runs one forward per depth over a frontier of fixed width); a slot whose parent would exceed
    it is dropped and the best-first order goes on.
    Returns (parents, [(depth, rank)] per node, E[T]).
    """
    if max_nodes < 1:
        raise ValueError(f"plan_tree: max_nodes must be >= 1, got {max_nodes}")
    parents, slots, path = [-1], [(0, 0)], [1.0]
    children = [0]
    expanded: Dict[int, int] = {}  # depth -> nodes of that depth with children
    heap: List[Tuple[float, int, int]] = []  # (-path prob, parent node, rank)

    def push(node: int) -> None:
        d = slots[node][0] + 1
        r = children[node]
        if d <= max_depth:
            heapq.heappush(heap, (-path[node] * accept_by_rank(d, r), node, r))

    push(0)
    while len(parents) < max_nodes and heap:
        negp, par, rank = heapq.heappop(heap)
        if -negp <= 0.0:
            break
        if children[par] == 0:
            d = slots[par][0]
            if max_parents_per_depth is not None and expanded.get(d, 0) >= max_parents_per_depth:
                continue
            expanded[d] = expanded.get(d, 0) + 1
        node = len(parents)
        parents.append(par)
        slots.append((slots[par][0] + 1, rank))
        path.append(-negp)
        children.append(0)
        children[par] += 1
        push(par)   # the parent's next sibling slot
        push(node)  # the new node's first child
    return parents, slots, 1.0 + sum(path[1:])
