"""Failure isolation around a drafter's proposal: the engine's step never fails for a drafter.

A drafter that raises is cancelled and the step runs as a plain step for every row; a proposal that
is invalid for some rows (an untrusted drafter's, checked on the host by
:func:`specdec.drafters.validate.draft_errors`) is cut back to the root for those rows only. Both
are logged (logger ``specdec.engine``) and counted; with ``mode="raise"`` (``SpeculativeDecoder``)
the error propagates instead, after the drafter is cancelled.
"""
from __future__ import annotations

import logging
from typing import Dict, Sequence, Tuple

import torch

from specdec.drafters.base import Draft, Drafter, StepContext
from specdec.drafters.validate import check_draft, draft_errors
from specdec.tree import TokenTree

__all__ = ["DraftGuard", "cut_rows"]

log = logging.getLogger("specdec.engine")


class DraftGuard:
    """Calls ``drafter.propose`` for the engine ``owner`` (its name, for the log), counting failures in
    ``counters["drafter_errors"]``. ``mode``: "fallback" (a failure costs its rows one plain step) or
    "raise"."""

    def __init__(self, owner: str, mode: str, vocab_size: int, max_nodes: int, counters: Dict[str, int]) -> None:
        self.owner = owner
        self.mode = mode
        self.vocab_size = vocab_size
        self.max_nodes = max_nodes
        self.counters = counters

    def propose(self, drafter: Drafter, ctx: StepContext) -> Tuple[Draft, bool]:
        """The proposal to verify, and whether it is the drafter's (False: a plain step replaced it,
        so the drafter must not see the verification)."""
        try:
            draft = drafter.propose(ctx)
        except Exception as exc:  # a broken drafter never fails the batch: plain step for every row
            self.counters["drafter_errors"] += 1
            if self.mode == "raise":
                raise
            log.warning("%s: drafter %s raised %s: %s; plain decoding for this step", self.owner,
                        type(drafter).__name__, type(exc).__name__, exc)
            try:
                drafter.cancel()
            except Exception:  # noqa: BLE001 -- a drafter that cannot even cancel stays out of this step
                log.exception("%s: drafter %s failed to cancel", self.owner, type(drafter).__name__)
            return Draft(TokenTree.root_only(ctx.roots)), False
        if drafter.trusted:
            return draft, True
        return self._checked(drafter, draft, ctx)

    def _checked(self, drafter: Drafter, draft: Draft, ctx: StepContext) -> Tuple[Draft, bool]:
        """An untrusted drafter's proposal checked on the host: invalid rows are cut back to their root."""
        name = type(drafter).__name__
        roots = [seq[-1] for seq in ctx.sequences]
        if self.mode == "raise":
            try:
                check_draft(draft, name, ctx.request_ids, self.vocab_size, self.max_nodes, roots)
            except (TypeError, ValueError):
                drafter.cancel()
                raise
            return draft, True
        fatal, bad = draft_errors(draft, name, ctx.request_ids, self.vocab_size, self.max_nodes, roots)
        if fatal is not None:
            self.counters["drafter_errors"] += 1
            log.warning("%s: %s; plain decoding for this step", self.owner, fatal)
            drafter.cancel()
            return Draft(TokenTree.root_only(ctx.roots)), False
        if bad:
            self.counters["drafter_errors"] += len(bad)
            for msg in bad.values():
                log.warning("%s: %s; plain decoding for that request this step", self.owner, msg)
            draft = cut_rows(draft, sorted(bad), len(ctx.request_ids), ctx.roots)
        return draft, True


def cut_rows(draft: Draft, rows: Sequence[int], b: int, roots: torch.Tensor) -> Draft:
    """The proposal with the given rows cut back to their root (padding everywhere else)."""
    tree = draft.tree
    keep = torch.ones(b, dtype=torch.bool, device=tree.tokens.device)
    keep[list(rows)] = False
    node = torch.arange(tree.size, device=tree.tokens.device).view(1, -1)
    real = keep.view(b, 1) | (node == 0)
    parents = torch.where(real, tree.parents, -1).to(torch.int32)
    parents[:, 0] = -1
    cut = set(rows)
    nodes = [1 if r in cut else n for r, n in enumerate(tree.num_nodes)]
    tokens = torch.where(real, tree.tokens, -1)
    tokens[:, 0] = roots
    depths = torch.where(real, tree.depths, 0).to(torch.int32)
    depths[:, 0] = 0
    new = TokenTree(tokens.contiguous(), parents.contiguous(), depths.contiguous(), nodes, is_chain=False)
    return Draft(new, draft.draft_probs)
