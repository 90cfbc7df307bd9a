"""The draft cache of a DraftModel: feeding it at the start of a step, catching it up, and rolling it
back to the accepted path.

Invariant (per request, between steps): the draft cache holds every committed token except the root
and, possibly, some *pending* tokens before it -- the last accepted draft node when it has no K/V in
the draft cache (the last spine token, a sibling leaf, a leaf of a dynamic tree) and, inside
:class:`~specdec.MultiDraft`, tokens accepted from other drafters' subtrees. A step feeds
``[pending..., root]`` as one chain in its first forward (:func:`feed_root`), so no forward is spent
on catching up. After steps that drafted nothing (plain steps, a cancelled proposal) and for rows
that joined since (lazy admission), :func:`catch_up` feeds whatever the cache lacks first.

Rollback after verification keeps the root and the accepted nodes that have K/V in the draft cache
(spine trees: identity moves, :func:`spine_in_cache`; dynamic trees: the frontier slots of the
accepted nodes, :func:`tree_moves`); what remains of the accepted path becomes pending.
"""
from __future__ import annotations

import time
from typing import List, Optional, Sequence, Tuple

import torch

__all__ = ["feed_root", "catch_up", "frontier_rows", "tree_moves", "spine_in_cache"]


def feed_root(lm, cache, roots: torch.Tensor, b: int, pend_n: torch.Tensor, pend_tok: torch.Tensor, width: int,
              depths1: torch.Tensor, reduced: bool = False) -> torch.Tensor:
    """First forward of a step: [pending..., root] per row (right-padded to ``width`` pending tokens).
    Returns the logits after the root [b, V] (an LM with ``forward_last`` computes only those); cache.lens
    then counts the pending tokens and the root. ``reduced``: ask the LM for its reduced-vocabulary logits
    (:class:`~specdec.drafters.eagle.lm.HeadLM`, a greedy spine step)."""
    P = width
    kw = {"reduced": True} if reduced else {}
    if P == 0:
        last = lm.forward(cache, roots.view(b, 1), depths1[:b], None, **kw)[:, 0]  # [b, V]
        cache.lens.add_(1)
        return last
    device = pend_n.device
    pn = pend_n[:b]                                                     # [b]
    if b == 1 and device.type == "cpu":  # one request: its chain as it is, no padding (host integers)
        n = int(pn[0])
        x = torch.cat((pend_tok[:1, :n], roots.view(1, 1)), dim=1)
        depths = torch.arange(n + 1, dtype=torch.int32).view(1, n + 1)
        fed = n + 1
    else:
        j = torch.arange(P + 1, device=device).view(1, P + 1)
        x = torch.full((b, P + 1), -1, dtype=torch.int64, device=device)
        x[:, :P] = pend_tok[:b, :P]
        x = torch.where(j < pn.view(b, 1), x, torch.where(j == pn.view(b, 1), roots.view(b, 1), -1))
        depths = j.to(torch.int32).expand(b, P + 1)
        fed = (pn + 1).to(torch.int32)
    if hasattr(lm, "forward_last"):
        last = lm.forward_last(cache, x, depths, pn, **kw)             # [b, V] after the root
    else:
        last = lm.forward(cache, x, depths, None, **kw)[torch.arange(b, device=device), pn]
    cache.lens.add_(fed)
    return last


def catch_up(lm, full, cache, sequences: Sequence[Sequence[int]], have: List[int], b: int, V: int,
             device: torch.device, tokens_per_forward: int, valid_prefix=None) -> Tuple[torch.Tensor, int, float]:
    """Feed every committed token the draft cache lacks, then the root, as one chain per row.

    ``full``: the whole draft cache, ``cache``: its view of the ``b`` active rows, ``have``: their lengths
    (host). Rows that joined since (empty draft rows) get their prompts (all but the root) through the
    LM's own prefill, grouped and chunked as it does for a target, as an eager admission would have.
    The chains are right-padded to the longest and go in chunks of at most ``tokens_per_forward``
    positions per forward (all rows together), sooner when the padding of a row would run past the
    cache's capacity. With an LM that has ``forward_last`` (HFCausalLM) only the logits after each
    row's last fed token are computed. ``valid_prefix(row, limit)``: a draft in the target's pages
    (specdec.draft_pages) starts an empty row after its shared blocks whose draft K/V is valid.
    Returns the draft logits after each row's root [b, V], the positions fed and the seconds spent on
    the prompts of the rows that joined since (their prefill)."""
    fresh = [r for r in range(b) if have[r] == 0 and len(sequences[r]) > 1]
    fed = 0
    prompt_seconds = 0.0
    if fresh:
        t0 = time.perf_counter()
        starts = [valid_prefix(r, len(sequences[r]) - 2) if valid_prefix else 0 for r in fresh]
        prompts = [list(sequences[r][s:-1]) for r, s in zip(fresh, starts)]
        if any(starts):
            lm.prefill(full, prompts, rows=fresh, starts=starts)
        else:  # the plain protocol (a model without cached prefixes need not take starts)
            lm.prefill(full, prompts, rows=fresh)
        have = cache.lens.tolist()
        fed = sum(len(sequences[r]) - 1 - s for r, s in zip(fresh, starts))
        prompt_seconds = time.perf_counter() - t0
    rows = [list(seq[h:]) for seq, h in zip(sequences, have)]   # [pending..., skipped roots..., root]
    positions = sum(len(r) for r in rows) + fed
    last = _feed_chains(lm, cache, rows, have, full.capacity, V, device, max(1, tokens_per_forward // max(1, b)))
    return last, positions, prompt_seconds


def _feed_chains(lm, cache, rows: List[List[int]], have: List[int], cap: int, V: int, device: torch.device,
                 per_forward: int) -> torch.Tensor:
    """Feed ``rows[r]`` after ``have[r]`` cached positions, in chunks; the logits after each row's last token."""
    b = len(rows)
    done = [0] * b                                                   # tokens of each row fed so far
    last = torch.empty(b, V, dtype=torch.float32, device=device)
    forward_last = getattr(lm, "forward_last", None)
    while True:
        left = [len(r) - d for r, d in zip(rows, done)]
        if max(left) <= 0:
            break
        room = min(cap - h - d for h, d in zip(have, done))
        width = max(1, min(max(left), room, per_forward))
        chunk = [r[d:d + width] for r, d in zip(rows, done)]
        x = torch.tensor([c + [-1] * (width - len(c)) for c in chunk], dtype=torch.int64, device=device)
        depths = torch.arange(width, dtype=torch.int32, device=device).expand(b, width).contiguous()
        ends = [r for r in range(b) if chunk[r] and done[r] + len(chunk[r]) == len(rows[r])]
        pos = torch.tensor([max(0, len(c) - 1) for c in chunk], dtype=torch.int64, device=device)
        if forward_last is not None:
            got = forward_last(cache, x, depths, pos)                                   # [b, V]
        else:
            got = lm.forward(cache, x, depths, None)[torch.arange(b, device=device), pos]
        if ends:
            sel = torch.tensor(ends, dtype=torch.int64, device=device)
            last.index_copy_(0, sel, got[sel].float())
        cache.lens.add_(torch.tensor([len(c) for c in chunk], dtype=torch.int32, device=device))
        done = [d + len(c) for d, c in zip(done, chunk)]
    return last


def frontier_rows(anc: torch.Tensor, parent_slots: Optional[torch.Tensor], s0: int, f: int, F: int,
                  eye: torch.Tensor) -> torch.Tensor:
    """Which frontier slots the ``f`` new frontier nodes (slots ``s0 .. s0 + f``) attend to [b, f, F]: their
    parents' ancestors-or-self (``parent_slots`` [b, f]; None at the first forwarded level, whose parent
    is the root) and themselves. Records them in ``anc`` [b, F, F] (ancestor-or-self among the slots)."""
    b = anc.shape[0]
    rows = torch.zeros(b, f, F, dtype=torch.bool, device=anc.device)
    if parent_slots is not None:
        rows = anc[:, :F, :F].gather(1, parent_slots.unsqueeze(2).expand(b, f, F)).clone()
    rows[:, :, s0:s0 + f] |= eye
    anc[:, s0:s0 + f, :F] = rows
    return rows


def tree_moves(slots: torch.Tensor, forwarded: int, path: torch.Tensor, on_path: torch.Tensor
               ) -> Tuple[torch.Tensor, torch.Tensor]:
    """Rollback of a dynamic tree: the accepted nodes with K/V in the draft cache are a prefix of the path
    (a leaf has no children). Returns the kv_commit moves [b, 1 + forwarded] int32 (root, then the kept
    frontier slots) and the kept count per row [b]. ``slots`` [b, N]: 0 root, 1 + frontier slot, -1 none;
    ``path`` [b, N - 1]: accepted node indices, valid where ``on_path``."""
    b, n = path.shape
    slot = slots.gather(1, path.clamp(min=0))
    valid = on_path & (slot >= 1)
    in_cache = valid.sum(dim=1)                                                 # [b]
    W = 1 + forwarded
    moves = torch.full((b, W), -1, dtype=torch.int32, device=path.device)
    moves[:, 0] = 0
    P = min(n, W - 1)
    if P > 0:
        moves[:, 1:1 + P] = torch.where(valid, slot, -1)[:, :P].to(torch.int32)
    return moves, in_cache


def spine_in_cache(num: torch.Tensor, last: torch.Tensor, k: int, w: int) -> torch.Tensor:
    """Rollback of a chain / spine tree: the accepted path is a spine prefix, possibly ended by one sibling
    leaf, and the draft cache holds root, s_1 .. s_{k-1}: the accepted nodes it keeps per row [b]."""
    if w == 1:
        return num.clamp(max=k - 1)
    leaf = (num > 0) & ((last - 1) % w != 0)
    return (num - leaf.to(torch.int64)).clamp(max=k - 1)
