"""Chains and spine trees (``tree="spine"``): k forwards of ONE node each.

The first forward is the root's (after any pending tokens, see :mod:`.cache`), then one per spine
token s_1 .. s_{k-1}; each gives the draft distribution after the spine so far. Greedy takes its
argmax as the next spine token; sampling draws it from q = warp(draft logits) (the target's
temperature / top-k / top-p, the drafter's seeded generator) and writes q into that node's row of
``draft_probs`` (the distribution the token was really drawn from, as exact rejection sampling needs).

``top_k = w > 1`` adds, at every depth, w - 1 sibling LEAVES next to the spine token (greedy: the
next most likely draft tokens; sampling: further independent draws from the same q, kept as separate
nodes even when equal -- SpecInfer's condition for exactness). The drafting cost is unchanged (only
the spine is expanded); the target verifies 1 + k * w nodes. Node (depth d, slot s) has index
1 + (d - 1) * w + s; slot 0 is the spine.

Confidence stop (``stop_threshold``): a row stops drafting after a spine token whose draft
probability is below the threshold (the token itself is still proposed: dropping it would bias the
sampled distribution), and the step stops when every row has stopped; rows that stopped early get
padding nodes. Deciding to stop reads the confidences on the host once per draft forward (free on
CPU; on CUDA a synchronisation per draft token).
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Dict, Optional, Sequence, Tuple

import torch

from specdec.drafters.base import StepContext
from specdec.drafters.draft_model.proposal import Proposal
from specdec.sampling import sample_tokens, warp_
from specdec.tree import TokenTree, ancestor_mask

if TYPE_CHECKING:
    from specdec.drafters.draft_model.model import DraftModel

__all__ = ["SpineBuffers", "propose_spine"]


class SpineBuffers:
    """What spine steps reuse for one binding: the node tokens (flat [b, N]), the draw distributions
    (flat [b, N, V], allocated on the first sampled step), a [max_batch, 1] depth-0 column, the identity
    moves of a spine rollback and the constant structure of a spine tree per (rows, depth)."""

    def __init__(self, top_k: int, k: int, max_batch: int, max_nodes: int, device: torch.device) -> None:
        self.top_k = top_k
        self.device = device
        self.tokens = torch.zeros(max_batch * max_nodes, dtype=torch.int64, device=device)
        self.probs_flat: Optional[torch.Tensor] = None
        self.depths1 = torch.zeros(max_batch, 1, dtype=torch.int32, device=device)
        self.identity = torch.arange(k + 1, dtype=torch.int32, device=device).expand(max_batch, k + 1).contiguous()
        self.shapes: Dict[Tuple[int, int], Tuple[torch.Tensor, ...]] = {}

    def probs(self, b: int, N: int, V: int) -> torch.Tensor:
        """[b, N, V] float32 rows for the draw distributions (the flat buffer grows to max_batch x max_nodes)."""
        need = b * N * V
        if self.probs_flat is None or self.probs_flat.numel() < need:
            self.probs_flat = torch.zeros(self.tokens.numel() * V, dtype=torch.float32, device=self.device)
        return self.probs_flat[:need].view(b, N, V)

    def shape(self, b: int, depth: int) -> Tuple[torch.Tensor, ...]:
        """Constant structure of a spine tree of ``depth`` levels: parents, depths [b, N], mask [b, N, N] or None."""
        key = (b, depth)
        consts = self.shapes.get(key)
        if consts is None:
            w = self.top_k
            N = 1 + depth * w
            parents = [-1] + [0 if d == 1 else 1 + (d - 2) * w for d in range(1, depth + 1) for _ in range(w)]
            depths = [0] + [d for d in range(1, depth + 1) for _ in range(w)]
            par = torch.tensor(parents, dtype=torch.int32, device=self.device)
            dep = torch.tensor(depths, dtype=torch.int32, device=self.device)
            mask = None
            if w > 1:
                mask = ancestor_mask(par.view(1, N)).expand(b, N, N).contiguous()
            consts = (par.expand(b, N).contiguous(), dep.expand(b, N).contiguous(), mask)
            self.shapes[key] = consts
        return consts


def propose_spine(dm: "DraftModel", ctx: StepContext, k: int, b: int, cache, last: torch.Tensor,
                  limits: Sequence[int], reduced: bool = False) -> Proposal:
    """A chain (top_k 1) or spine tree of k levels from ``last``, the draft logits after each row's root;
    rows deeper than their ``limits`` (and, with a stop threshold, after their stop) are padded.
    ``reduced``: the draft forwards return logits over ``dm.draft_ids`` only (greedy, no stop threshold)."""
    kw = {"reduced": True} if reduced else {}
    buf = dm.spine_buffers
    w = dm.top_k
    sampling = not dm.params.greedy
    N = 1 + k * w
    tokens = buf.tokens[: b * N].view(b, N)       # node (d, s) at 1 + (d - 1) * w + s; spine: s = 0
    tokens[:, 0] = ctx.roots
    probs = buf.probs(b, N, dm.V) if sampling else None
    stop = dm.stop_threshold
    if stop is not None:
        alive = torch.ones(b, dtype=torch.bool, device=dm.device)      # [b] still drafting
        lengths = torch.zeros(b, dtype=torch.int64, device=dm.device)  # [b] spine tokens per row
    k_run = k
    for i in range(1, k + 1):
        d, q = _draw_level(dm, tokens, probs, last, 1 + (i - 1) * w)
        if stop is not None:
            if sampling:
                conf = q.gather(1, d.view(b, 1)).view(b)
            else:  # softmax probability of the argmax: exp(max - logsumexp)
                conf = torch.exp(last.gather(1, d.view(b, 1)).view(b) - torch.logsumexp(last, dim=-1))
            lengths += alive
            alive &= conf >= stop
            if i < k and not bool(alive.any()):  # host read: every row has stopped
                k_run = i
                break
        if i < k:
            last = dm.lm.forward(cache, d.view(b, 1), buf.depths1[:b], None, **kw)[:, 0]
            cache.lens.add_(1)
    tree, probs = _spine_tree(dm, tokens, probs, k, k_run, limits, lengths if stop is not None else None)
    return Proposal(tree, probs, b=b, k=k_run, tokens=tokens)


def _draw_level(dm: "DraftModel", tokens: torch.Tensor, probs: Optional[torch.Tensor], last: torch.Tensor,
                first: int) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    """The nodes of one level (spine token at node ``first``, then its siblings) from the draft logits
    ``last`` [b, V]: written into ``tokens`` (and their q into ``probs`` when sampling). Returns the spine
    tokens [b] and, when sampling, q [b, V] (a view into ``probs``). Greedy ``last`` may also be logits over
    the LM's reduced vocabulary [b, len(dm.draft_ids)]: the tokens are then mapped to target ids."""
    w = dm.top_k
    if probs is not None:
        q = probs[:, first]                                        # [b, V] view, written in place
        q.copy_(last)
        warp_(q, dm.params)
        if w == 1:
            d = sample_tokens(q, dm.generator)
            tokens[:, first] = d
        else:  # siblings: independent draws from the same q (kept separate even when equal)
            probs[:, first + 1:first + w] = q.unsqueeze(1)
            draws = torch.multinomial(q, w, replacement=True, generator=dm.generator)  # [b, w]
            tokens[:, first:first + w] = draws
            d = draws[:, 0]
        return d, q
    ids = dm.draft_ids if last.shape[-1] != dm.V else None
    if w == 1:
        d = last.argmax(dim=-1)
        if ids is not None:
            d = ids[d]
        tokens[:, first] = d
    else:  # the w most likely tokens; the argmax continues the spine
        top = torch.topk(last, w, dim=-1).indices                 # [b, w]
        if ids is not None:
            top = ids[top]
        tokens[:, first:first + w] = top
        d = top[:, 0]
    return d, None


def _spine_tree(dm: "DraftModel", tokens: torch.Tensor, probs: Optional[torch.Tensor], k: int, k_run: int,
                limits: Sequence[int], lengths: Optional[torch.Tensor]) -> Tuple[TokenTree, Optional[torch.Tensor]]:
    """The tree of a spine step that ran ``k_run`` of its ``k`` levels, and its draft_probs. ``lengths`` [b]:
    spine tokens per row under a stop threshold (None: no threshold); ``limits``: per-row depths."""
    b, N = tokens.shape
    w = dm.top_k
    n = 1 + k_run * w
    parents, depths, mask = dm.spine_buffers.shape(b, k_run)
    limited = min(limits) < k
    if lengths is None and not limited:
        tree = TokenTree(tokens, parents, depths, [N] * b, is_chain=w == 1, _mask=mask, max_depths=[k] * b)
        return tree, probs
    if lengths is None:
        spine = [min(x, k_run) for x in limits]
        lengths = torch.tensor(spine, dtype=torch.int64, device=dm.device)
    else:
        if limited:
            lengths = torch.minimum(lengths, torch.tensor(limits, dtype=torch.int64, device=dm.device))
        spine = lengths.tolist()
    real = depths <= lengths.view(b, 1)  # [b, n]: nodes within the row's spine
    tree = TokenTree(torch.where(real, tokens[:, :n], -1), torch.where(real, parents, -1),
                     torch.where(real, depths, 0), [1 + x * w for x in spine],
                     is_chain=w == 1, _mask=mask, max_depths=spine)
    return tree, None if probs is None else probs[:, :n].contiguous()
