"""SGLang's draft-tree form (first child / next sibling) read into specdec's parent form, for
:mod:`specdec.compat.sglang`: the checked walk over each request's links, and the same result by
tensor ops for the trees SGLang's builder emits (links to higher indices only), which keeps large
batches off the Python loop and, on a GPU, on the device.
"""
from __future__ import annotations

from typing import List, Optional, Tuple

import torch

__all__ = ["err", "check_2d", "walk_tree", "walk_lists", "tree_tensors", "FAST_MIN_BATCH"]


def err(fn: str, arg: str, expected: str, got) -> ValueError:
    return ValueError(f"{fn}: {arg}: expected {expected}, got {got}")


def check_2d(fn: str, name: str, t, shape: Optional[Tuple[int, int]] = None, integer: bool = True) -> None:
    if not isinstance(t, torch.Tensor):
        raise err(fn, name, "a torch.Tensor", type(t).__name__)
    have = t.shape  # read once: each tensor attribute read costs a call
    if len(have) != 2:
        raise err(fn, name, "a 2-D tensor" + (f" of shape {list(shape)}" if shape else ""), f"shape {list(have)}")
    if shape is not None and tuple(have) != tuple(shape):
        raise err(fn, name, f"shape {list(shape)}", f"shape {list(have)}")
    if integer:
        dt = t.dtype
        if dt.is_floating_point or dt.is_complex or dt == torch.bool:
            raise err(fn, name, "an integer dtype (int64 as SGLang uses)", dt)


def walk_tree(fn: str, next_token: torch.Tensor, next_sibling: torch.Tensor,
             max_depth: Optional[int]) -> Tuple[List[List[int]], List[List[int]], List[List[int]]]:
    """Per row: (order, parents, depths) in specdec index space; order[i] = local node or -1."""
    check_2d(fn, "retrive_next_token", next_token)
    check_2d(fn, "retrive_next_sibling", next_sibling, tuple(next_token.shape))
    B, N = next_token.shape
    if N < 1:
        raise err(fn, "retrive_next_token", "at least one node (the root) per request",
                   f"shape {list(next_token.shape)}")
    return walk_lists(fn, next_token.tolist(), next_sibling.tolist(), N, max_depth)


def walk_lists(fn: str, nt: List[List[int]], ns: List[List[int]], N: int,
               max_depth: Optional[int]) -> Tuple[List[List[int]], List[List[int]], List[List[int]]]:
    """:func:`walk_tree` on the links already read as lists (``nt`` / ``ns``: B rows of N ints)."""
    for name, rows in (("retrive_next_token", nt), ("retrive_next_sibling", ns)):
        if rows and (min(map(min, rows)) < -1 or max(map(max, rows)) >= N):
            b, i = next((b, i) for b, row in enumerate(rows) for i, v in enumerate(row) if v < -1 or v >= N)
            raise err(fn, f"{name}[{b}, {i}]", f"-1 or a node index in [0, {N})", rows[b][i])
    orders, parents, depths = [], [], []
    for b in range(len(nt)):
        ftok, fsib = nt[b], ns[b]
        par = [-1] * N
        dep = [0] * N
        seen = [False] * N
        seen[0] = True
        identity = True
        pre = [0]          # DFS preorder (siblings in chain order)
        stack = [0]
        while stack:
            u = stack.pop()
            kids = []
            c = ftok[u]
            while c != -1:
                if seen[c]:
                    what = "the root" if c == 0 else f"node {c}"
                    raise err(fn, f"request {b}", "a tree (every node reachable once from root 0, no cycles)",
                               f"{what} reached again as a child of node {u} (cycle or shared node)")
                seen[c] = True
                par[c] = u
                dep[c] = dep[u] + 1
                if c <= u or (kids and c <= kids[-1]):
                    identity = False
                kids.append(c)
                c = fsib[c]
            if max_depth is not None and dep[u] >= max_depth:
                kids_trunc = []
            else:
                kids_trunc = kids
            stack.extend(reversed(kids_trunc))
            if u != 0:
                pre.append(u)
        keep = [False] * N
        for u in pre:
            keep[u] = True
        if identity:  # specdec's numbering is SGLang's own
            orders.append([i if keep[i] else -1 for i in range(N)])
            parents.append([par[i] if keep[i] else -1 for i in range(N)])
            depths.append([dep[i] if keep[i] else 0 for i in range(N)])
            continue
        order = pre + [-1] * (N - len(pre))
        pos = {loc: i for i, loc in enumerate(order) if loc >= 0}
        parents.append([pos[par[loc]] if loc > 0 else -1 for loc in order])
        depths.append([dep[loc] if loc >= 0 else 0 for loc in order])
        orders.append(order)
    return orders, parents, depths


def tree_tensors(fn: str, next_token: torch.Tensor, next_sibling: torch.Tensor,
                 max_depth: Optional[int]) -> Tuple[torch.Tensor, torch.Tensor, bool]:
    """(order [B, N] int64, parents [B, N] int32) of :func:`walk_tree`, on the links' device, and
    whether the numbering is SGLang's own (``order[b, i]`` is i or -1 everywhere)."""
    if next_token.dim() == 2 and next_token.shape[0] >= FAST_MIN_BATCH:
        got = _fast_tree(next_token, next_sibling, max_depth)
        if got is not None:
            return got[0], got[1], True
    orders, parents, _ = walk_tree(fn, next_token, next_sibling, max_depth)
    dev = next_token.device
    shape = next_token.shape
    identity = all(o == i or o < 0 for row in orders for i, o in enumerate(row))
    return (torch.tensor(orders, dtype=torch.int64, device=dev).reshape(shape),
            torch.tensor(parents, dtype=torch.int32, device=dev).reshape(shape), identity)


FAST_MIN_BATCH = 16  # below this the Python walk costs no more than the tensor ops (CPU)


def _fast_tree(next_token, next_sibling, max_depth):
    """:func:`walk_tree`'s result by tensor ops, for the trees SGLang's builder emits: every link
    -1 or a higher index, every node reached by at most one link. The numbering is then already
    specdec's (the identity case), parents follow from each sibling chain's head (pointer
    jumping) and depths and reachability from the parents (pointer doubling). None for any other
    input (the walk then decides, and names what is wrong)."""
    if not (isinstance(next_token, torch.Tensor) and isinstance(next_sibling, torch.Tensor)) \
            or next_sibling.shape != next_token.shape or next_token.dtype.is_floating_point \
            or next_sibling.dtype.is_floating_point or next_token.dtype == torch.bool \
            or next_sibling.dtype == torch.bool or next_token.shape[1] < 1:
        return None
    B, N = next_token.shape
    dev = next_token.device
    links = torch.stack([next_token, next_sibling]).to(torch.int64)  # [2, B, N]
    idx = torch.arange(N, device=dev)
    if not bool(((links == -1) | ((links > idx) & (links < N))).all()):
        return None
    sink = torch.where(links >= 0, links, N)  # -1 -> column N, dropped
    indeg = torch.zeros(B, N + 1, dtype=torch.int64, device=dev)
    indeg.scatter_add_(1, sink.permute(1, 0, 2).reshape(B, 2 * N), torch.ones(B, 2 * N, dtype=torch.int64,
                                                                                 device=dev))
    if int(indeg[:, :N].max()) > 1:
        return None
    src = idx.expand(B, N)
    via = torch.full((2, B, N + 1), -1, dtype=torch.int64, device=dev)
    via.scatter_(2, sink, src.expand(2, B, N))  # [0]: parent by a first-child link; [1]: previous sibling
    first_par, prev = via[0, :, :N], via[1, :, :N]
    steps = max(N - 1, 1).bit_length()  # 2**steps >= N - 1: the longest chain / deepest path
    head = torch.where(prev >= 0, prev, src)
    for _ in range(steps):
        head = torch.gather(head, 1, head)
    par = torch.gather(first_par, 1, head)  # -1 for the root and for nodes no link reaches
    has = par >= 0
    anc = torch.where(has, par, src)
    dep = has.to(torch.int64)
    for _ in range(steps):
        dep = dep + torch.gather(dep, 1, anc)
        anc = torch.gather(anc, 1, anc)
    keep = anc == 0
    if max_depth is not None:
        keep &= dep <= max_depth
    order = torch.where(keep, src, -1)
    return order, torch.where(keep, par, -1).to(torch.int32)
