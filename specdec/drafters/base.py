"""The drafter protocol: what the decoding loop asks of every drafter.

A step of :class:`specdec.SpeculativeDecoder` calls, for the ``b`` active requests
(rows 0..b-1 of every cache; finished requests leave the batch and the last active
row moves into the hole):

1. ``propose(ctx) -> Draft``: a :class:`~specdec.tree.TokenTree` rooted at each
   request's last emitted token, plus the distribution each draft node was drawn
   from (``draft_probs`` [b, N, V] float32, row 0 unused) or None when every node is
   a deterministic candidate (greedy drafting, prompt lookup);
2. the target verifies the tree; ``observe_verify(tree, logits)`` sees the target's logits
   of every node of that pass (before the sampler warps them; device tensors, no host
   sync expected) -- a no-op unless the drafter learns from the target (TokenRecycling);
3. ``accept(accepted, num_accepted, num_host)``: the verification result (device
   tensors, plus ``num_host``, the per-row accepted counts already copied to the host
   by the loop's single sync of the step) so the drafter rolls its own state back to
   the accepted path. A composite drafter (:class:`~specdec.MultiDraft`) calls its
   members with the part of the accepted path that lies in each member's own tree and
   ``foreign=[tokens per row]``: the accepted tokens after that part, which came from
   other members (the member must account for them; stateless drafters ignore them);
4. ``retire(moves, active)`` when requests finish: row ``src`` moves into row ``dst``.

``bind`` runs once at decoder construction (validate against the target, allocate
caches); ``start`` once per generate call (prefill). ``cancel()`` forgets a proposal that
will not be verified (a composite drafter found another member's proposal invalid), so
that no state changes.

Proposals of drafters that are not ``trusted`` (user subclasses) are validated on the host
by the loop (:func:`check_draft`) before the target runs: shapes, node count against the
reserved ``max_nodes``, topological parents, vocabulary range; errors name the drafter and
the request.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, List, Optional, Sequence, Tuple

import torch

from specdec.sampling import SamplingParams
from specdec.tree import TokenTree

__all__ = ["Draft", "StepContext", "Drafter"]


@dataclass
class Draft:
    tree: TokenTree
    draft_probs: Optional[torch.Tensor] = None  # [b, N, V] float32 contiguous (q of node i in row i), or None


@dataclass
class StepContext:
    roots: torch.Tensor            # [b] int64 on the device: each active row's last emitted token
    sequences: List[List[int]]     # host: prompt + emitted tokens of each active row (root = last)
    request_ids: List[int]         # index of each active row's request in the generate call
    budgets: List[int]             # draft tokens worth proposing per row (new tokens still allowed - 1)
    node_budget: Optional[int] = None  # most nodes per row (root included) for this step, None: max_nodes
    #: the step's sampling setting for drafting (rows of an Engine batch may differ: then greedy, whose
    #: deterministic candidates are exact under every setting); None: the one given to start()
    params: Optional[SamplingParams] = None
    #: the scheduler's predicted seconds of this step without drafting (target pass, commit, the rest) when
    #: every row holds n nodes, root included: ``step_seconds(1)`` is a plain step. None until the cost model
    #: has seen a plain step (or outside a decoder). A composite drafter weighs a costly member's price by it.
    step_seconds: Optional[Callable[[int], float]] = None


class Drafter:
    """Base class; see the module docstring for the call sequence."""

    #: nodes per request a proposal may hold, root included (the decoder sizes its cache with it)
    max_nodes: int = 1
    #: proposals are valid by construction (built-in drafters); others are checked by check_draft
    trusted: bool = False
    #: bind() changes the target (a feature head turns on its hidden-state capture): the engine binds such
    #: a drafter before it chooses and sizes the target's KV cache
    changes_target: bool = False
    #: host seconds the last propose() spent bringing the drafter's own state up to date (a draft
    #: model feeding the tokens of plain steps or a new prompt): a one-time cost the scheduler keeps
    #: out of its per-step cost model. 0 for drafters without such state.
    catch_up_seconds: float = 0.0
    #: positions (tokens over all rows) that catch-up fed in the last propose()
    catch_up_positions: int = 0
    #: the part of ``catch_up_seconds`` spent on the prompts of rows the drafter had not seen (a lazy
    #: admission's prefill): a once-per-request cost, unlike the tokens of steps it did not draft
    prompt_seconds: float = 0.0

    def pending_catch_up(self, lengths: Sequence[int]) -> List[int]:
        """Per active row (``lengths``: its prompt + emitted tokens), the positions the next proposal
        that drafts would feed before drafting (a lazy prompt prefill, the tokens of plain steps).
        The scheduler weighs this one-time cost against what speculating would gain. Host values
        only; 0 for drafters without such state."""
        return [0] * len(lengths)

    def has_proposals(self, request_ids: Sequence[int], sequences: Sequence[Sequence[int]]) -> Optional[List[bool]]:
        """Advisory, asked before a step is planned: per row, whether the next propose() could draft
        anything (False: it would return the root alone), or None when the drafter cannot tell cheaply.
        Rows marked False are planned as plain steps (budget 0) without weighing depths. Host values
        only; must not change what propose() returns."""
        return None

    def bind(self, target, max_batch: int, max_len: int) -> None:
        """Check compatibility with the target and allocate state for max_batch requests."""

    def paged_draft(self, block_size: int) -> Optional[Tuple[int, int]]:
        """A drafter whose own K/V cache can live in the target's pages (a draft model on the lean forward):
        (bytes of K/V per block of ``block_size`` positions, positions past a request's committed ones
        that one step writes, root included). None (the default): no such cache."""
        return None

    def attach_pages(self, pages) -> None:
        """Before bind: keep the drafter's K/V in pages paired with ``pages`` (the target's
        :class:`~specdec.PagedKVCache`: same blocks, block tables and rows; see specdec.draft_pages),
        or in a cache of its own when ``pages`` is None. Only drafters with :meth:`paged_draft` use it."""

    def start(self, prompts: Sequence[Sequence[int]], params: SamplingParams, generator: torch.Generator) -> None:
        """A new generate call: prompts of rows 0..len(prompts)-1."""

    def admit(self, rows: Sequence[int], prompts: Sequence[Sequence[int]]) -> None:
        """Requests join a running batch (continuous batching, :class:`specdec.Engine`): ``prompts[i]``
        now occupies the free row ``rows[i]`` (rows past the active ones, consecutive). Drafters with
        per-row state (a draft model's cache) set it up here; the default keeps nothing."""

    def propose(self, ctx: StepContext) -> Draft:
        raise NotImplementedError

    def observe_verify(self, tree: TokenTree, logits: torch.Tensor) -> None:
        """The target's logits [b, N, V] of every node of the tree just verified (read only, before warping)."""

    @property
    def reads_verify_logits(self) -> bool:
        """Whether :meth:`observe_verify` reads the logits (it is overridden): then every step computes all of them,
        and a greedy step cannot run the LM head along the accepted path only (specdec.lazy_verify)."""
        return type(self).observe_verify is not Drafter.observe_verify

    def accept(self, accepted: torch.Tensor, num_accepted: torch.Tensor, num_host: Sequence[int],
               foreign: Optional[Sequence[Sequence[int]]] = None) -> None:
        """Verification result of the last proposal: accepted [b, N] int32, num_accepted [b] int32.

        ``foreign[r]``: tokens accepted after row r's own accepted path that this drafter did not
        propose (another member of a MultiDraft did); the next root follows them."""

    def cancel(self) -> None:
        """Forget the last proposal; it will not be verified (state as before propose)."""

    def reserve_foreign(self, n: int) -> None:
        """Before bind: accept() may pass up to ``n`` foreign tokens per row (MultiDraft members)."""

    def retire(self, moves: Sequence[Tuple[int, int, int]], active: int) -> None:
        """Rows leave the batch: for (src, dst, length) row src moves to row dst; ``active`` rows remain."""
