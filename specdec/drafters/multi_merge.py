"""The host side of a MultiDraft step: the members' trees merged into one, the step whose draft is one member's
own tree, and each member's part of the accepted path.

Merging rules (what keeps the output exact):

* greedy: equal tokens under the same parent become one node (greedy verification only
  compares tokens with the target's argmax, so a duplicate is pure waste);
* sampling: a node DRAWN from a distribution q keeps its own q row in ``draft_probs`` and is
  never merged with anything (verifying it against another drafter's q, or folding two
  independent draws into one, changes the acceptance probabilities and breaks exactness);
  equal siblings from different draws stay separate nodes, which the SpecInfer multi-step
  sampler handles exactly (after a rejection the residual is norm(max(0, p - q_c)); a second
  copy of a rejected deterministic token meets a residual with zero mass on it and is simply
  rejected -- wasted, never wrong). DETERMINISTIC candidates (prompt lookup, callables,
  dynamic trees: one-hot q) of different members are merged like in greedy mode: a
  deterministic candidate set is a function of the context, and the sampler is exact for any
  such set of distinct tokens. Sibling order is member order then each member's node order,
  fixed before any verification draw.

Escalation makes most steps one member's (:func:`single_member`): then that member's draft is verified as it
is, and the other members get an empty part and the accepted tokens as foreign ones.
"""
from __future__ import annotations

from typing import Dict, List, Optional, Sequence, Tuple

import torch

from specdec.drafters.base import Draft
from specdec.tree import TokenTree

__all__ = ["merge_drafts", "single_member", "member_part"]


def merge_drafts(drafts: Sequence[Draft], host, alloc: Sequence[int], roots: Sequence[int], sampling: bool,
                 proposed: Optional[Sequence[Sequence[int]]], vocab_size: int, device
                 ) -> Tuple[Draft, List[List[Dict[int, int]]], List[List[int]]]:
    """The members' drafts (``host``: their (tokens, parents) lists per row) merged member by member within
    their shares ``alloc``; ``proposed`` (escalation): per member and row the nodes it proposed (0: skipped).
    Returns the merged draft, per member and row the map merged node -> member node, and the merged tokens."""
    b = len(roots)
    all_tok: List[List[int]] = []
    all_par: List[List[int]] = []
    sources: List[List[Optional[Tuple[int, int]]]] = []   # per row, per merged node: (member, node) of q
    maps: List[List[Dict[int, int]]] = [[{} for _ in range(b)] for _ in drafts]  # merged -> member node
    for r in range(b):
        tok, par, src = [roots[r]], [-1], [None]
        by_key: Dict[Tuple[int, int], int] = {}
        for i, d in enumerate(drafts):
            mtok, mpar = host[i][0][r], host[i][1][r]
            drawn = sampling and d.draft_probs is not None
            local = {0: 0}
            maps[i][r][0] = 0
            kept = 0
            skip = proposed is not None and proposed[i][r] == 0
            for j in range(1, 0 if skip else len(mtok)):
                p = mpar[j]
                if p < 0 or p not in local:
                    continue  # padding, or below a node cut by the budget
                if kept >= alloc[i]:
                    break
                kept += 1
                P, t = local[p], int(mtok[j])
                key = (P, t)
                if not drawn and key in by_key:
                    m = by_key[key]
                else:
                    m = len(tok)
                    tok.append(t)
                    par.append(P)
                    src.append((i, j) if drawn else None)
                    if not drawn:
                        by_key[key] = m
                local[j] = m
                maps[i][r][m] = j
        all_tok.append(tok)
        all_par.append(par)
        sources.append(src)
    tree = TokenTree.from_lists(all_tok, all_par, device=device)
    q = None
    if sampling and any(d.draft_probs is not None for d in drafts):
        N = tree.size
        q = torch.zeros(b, N, vocab_size, dtype=torch.float32, device=device)
        det_r, det_m, det_t = [], [], []
        for r in range(b):
            for m in range(1, len(all_tok[r])):
                s = sources[r][m]
                if s is None:
                    det_r.append(r)
                    det_m.append(m)
                    det_t.append(all_tok[r][m])
                else:
                    q[r, m] = drafts[s[0]].draft_probs[r, s[1]]
        if det_r:
            idx = [torch.tensor(x, dtype=torch.long, device=device) for x in (det_r, det_m, det_t)]
            q.index_put_(tuple(idx), torch.ones(len(det_r), dtype=torch.float32, device=device))
    return Draft(tree, q), maps, all_tok


def single_member(host, proposed: Sequence[Sequence[int]], alloc: Sequence[int]) -> Optional[int]:
    """The member whose draft is the step's merged tree as it stands (-1: nobody proposed), or None (a merge is
    needed): only that member proposed for any row, every node of its tree is a real proposal (no node for a
    skipped row) and its rows fit its share."""
    live = [i for i, n in enumerate(proposed) if any(n)]
    if not live:
        return -1
    if len(live) > 1:
        return None
    i = live[0]
    for n, par in zip(proposed[i], host[i][1]):
        real = sum(1 for x in par[1:] if x >= 0)
        if real != n or n > alloc[i]:
            return None
    return i


def member_part(paths: Sequence[Sequence[int]], maps: Optional[Sequence[Dict[int, int]]],
                tokens: Optional[Sequence[Sequence[int]]], size: int, foreign):
    """A member's part of each row's accepted path (merged node indices, root excluded) through its node map
    (None: another member's tree was verified alone, so none), padded to its tree ``size``, its accepted counts,
    and the accepted tokens after its part (then the outer ``foreign`` ones). Returns (rows, nums, extra)."""
    rows, nums, extra = [], [], []
    for r, path in enumerate(paths):
        own = [0]
        if maps is not None:
            for node in path:
                j = maps[r].get(node)
                if j is None:
                    break
                own.append(j)
        n_own = len(own) - 1
        f = [tokens[r][node] for node in path[n_own:]]
        if foreign is not None:
            f += list(foreign[r])
        rows.append(own + [-1] * (size - len(own)))
        nums.append(n_own)
        extra.append(f)
    return rows, nums, extra
