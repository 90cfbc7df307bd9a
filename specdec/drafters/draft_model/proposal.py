"""The record of one DraftModel proposal: the draft, plus what ``accept()`` needs to roll the draft
cache back to the accepted path and what the learners count."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import torch

from specdec.drafters.base import Draft
from specdec.tree import TokenTree, ancestor_mask

__all__ = ["Proposal", "limit_depths", "child_counts"]


@dataclass
class Proposal(Draft):
    """A :class:`~specdec.drafters.base.Draft` (``tree``, ``draft_probs``) and the step it came from.

    Each tree builder returns one; :meth:`DraftModel.propose` completes it (``base``, and after a
    depth limit the learners' views of the emitted tree) and keeps the last one for ``accept()`` and
    ``cancel()``. ``tree`` is None only while the step is being built."""

    b: int = 0                                   # active rows
    k: int = 0                                   # levels drafted (0: a root-only step, nothing to roll back)
    base: Optional[torch.Tensor] = None          # [b] int32: each row's committed draft prefix (pending excluded)
    tokens: Optional[torch.Tensor] = None        # [b, N] the step's node tokens (the last accepted one may pend)
    # dynamic and planned trees: the draft cache holds the K/V of the forwarded frontier nodes
    slots: Optional[torch.Tensor] = None         # [b, N] 0: root, 1 + frontier slot, -1: no K/V (a leaf)
    forwarded: int = 0                           # frontier slots written past the root
    # calibrated greedy-rule dynamic trees (Calibration.update)
    cal_cell: Optional[torch.Tensor] = None      # [b, N] int64 calibration cell of each node (root: -1)
    cal_q: Optional[torch.Tensor] = None         # [b, N] float32 its draft probability (root: 0)
    cal_parents: Optional[torch.Tensor] = None   # [b, N] int64 parents of the emitted tree (padding: -1)
    # greedy planned trees (RankAcceptance.update)
    node_rank: Optional[torch.Tensor] = None     # [N] int64 sibling rank of each node (root: -1)
    node_depth: Optional[torch.Tensor] = None    # [N] int64 depth of each node
    kids: Optional[torch.Tensor] = None          # [b, N] int64 children per node of the emitted tree


def limit_depths(tree: TokenTree, limits: Sequence[int], k: int) -> TokenTree:
    """Pad a dynamic tree's nodes deeper than each row's limit (the scheduler's per-row depth). Nodes are
    in non-decreasing depth order, so the padding is a suffix of every row and the rest stays connected."""
    b = tree.tokens.shape[0]
    lim = torch.tensor(list(limits), dtype=torch.int32, device=tree.tokens.device).view(b, 1)
    real = tree.depths <= lim                                            # [b, N]
    depths = torch.where(real, tree.depths, 0)
    sizes, deepest = torch.stack([real.sum(dim=1), depths.amax(dim=1).to(torch.int64)]).tolist()
    parents = torch.where(real, tree.parents, -1)
    return TokenTree(torch.where(real, tree.tokens, -1), parents, depths, sizes, is_chain=False,
                     _mask=ancestor_mask(parents, max_depth=k), max_depths=deepest)


def child_counts(parents: torch.Tensor) -> torch.Tensor:
    """Children per node [b, N] int64 of a tree's parents [b, N] (padding, -1, excluded)."""
    par = parents.to(torch.int64)
    b, n = par.shape
    kids = torch.zeros(b, n + 1, dtype=torch.int64, device=par.device)
    kids.scatter_add_(1, torch.where(par >= 0, par, n), torch.ones_like(par))
    return kids[:, :n]
