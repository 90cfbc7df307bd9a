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
from typing import List, Optional, Sequence, Tuple

import torch

from specdec.sampling import SamplingParams
from specdec.tree import TokenTree

__all__ = ["Draft", "StepContext", "Drafter", "CallableDrafter", "move_cache_rows", "check_draft", "draft_errors"]


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


class Drafter:
    """Base class; see the module docstring for the call sequence."""

    #: nodes per request a proposal may hold, root included (the decoder sizes its cache with it)
    max_nodes: int = 1
    #: proposals are valid by construction (built-in drafters); others are checked by check_draft
    trusted: bool = False
    #: host seconds the last propose() spent bringing the drafter's own state up to date (a draft
    #: model feeding the tokens of plain steps or a new prompt): a one-time cost the scheduler keeps
    #: out of its per-step cost model. 0 for drafters without such state.
    catch_up_seconds: float = 0.0
    #: positions (tokens over all rows) that catch-up fed in the last propose()
    catch_up_positions: int = 0

    def pending_catch_up(self, lengths: Sequence[int]) -> List[int]:
        """Per active row (``lengths``: its prompt + emitted tokens), the positions the next proposal
        that drafts would feed before drafting (a lazy prompt prefill, the tokens of plain steps).
        The scheduler weighs this one-time cost against what speculating would gain. Host values
        only; 0 for drafters without such state."""
        return [0] * len(lengths)

    def bind(self, target, max_batch: int, max_len: int) -> None:
        """Check compatibility with the target and allocate state for max_batch requests."""

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


def check_draft(draft, name: str, request_ids: Sequence[int], vocab_size: int, max_nodes: int,
                roots: Optional[Sequence[int]] = None) -> None:
    """Validate a proposal on the host; raise naming the drafter ``name`` and the request.

    Checks: a :class:`Draft` holding a :class:`TokenTree` of [b, N] int64 tokens / int32 parents,
    N <= ``max_nodes`` (what the caches reserve), node 0 the root (parent -1; its token
    ``roots[r]`` when given), every other parent -1 (padding) or < its index (topological), real
    nodes' tokens in [0, vocab_size), depths = parent's depth + 1, draft_probs float32 [b, N, V]
    when given. Reads the tree on the host.
    """
    fatal, bad = draft_errors(draft, name, request_ids, vocab_size, max_nodes, roots)
    if fatal is not None:
        raise fatal
    if bad:
        raise ValueError(bad[min(bad)])


def draft_errors(draft, name: str, request_ids: Sequence[int], vocab_size: int, max_nodes: int,
                 roots: Optional[Sequence[int]] = None):
    """The checks of :func:`check_draft` without raising: (an exception for a proposal that is unusable
    as a whole, or None; {row: message} for the rows whose tree is invalid)."""
    try:
        return None, _draft_rows(draft, name, request_ids, vocab_size, max_nodes, roots)
    except (TypeError, ValueError) as exc:
        return exc, {}


def _draft_rows(draft, name, request_ids, vocab_size, max_nodes, roots):
    b = len(request_ids)
    if not isinstance(draft, Draft) or not isinstance(getattr(draft, "tree", None), TokenTree):
        raise TypeError(f"{name}: propose must return a specdec Draft holding a TokenTree, got {type(draft).__name__}")
    tree = draft.tree
    tok, par, dep = tree.tokens, tree.parents, tree.depths
    if tok.dim() != 2 or tok.shape[0] != b or tok.dtype != torch.int64:
        raise ValueError(f"{name}: tree tokens must be int64 [b, N] with b = {b} active requests, got "
                         f"{tok.dtype} {tuple(tok.shape)}")
    N = tok.shape[1]
    if par.shape != tok.shape or par.dtype != torch.int32 or dep.shape != tok.shape:
        raise ValueError(f"{name}: tree parents must be int32 and depths [b, N] = {tuple(tok.shape)}, got parents "
                         f"{par.dtype} {tuple(par.shape)}, depths {tuple(dep.shape)}")
    if draft.draft_probs is not None:
        q = draft.draft_probs
        if q.dim() != 3 or tuple(q.shape[:2]) != (b, N) or q.shape[2] != vocab_size or q.dtype != torch.float32:
            raise ValueError(f"{name}: draft_probs must be float32 [b, N, V] = [{b}, {N}, {vocab_size}], got "
                             f"{q.dtype} {tuple(q.shape)}")
    rows = list(zip(tok.tolist(), par.tolist(), dep.tolist()))
    if N > max_nodes:
        real = [1 + sum(p >= 0 for p in ps[1:]) for _, ps, _ in rows]
        r = max(range(b), key=lambda i: real[i])
        raise ValueError(f"{name}: request {request_ids[r]}: the proposal has {N} nodes per request ({real[r]} real), "
                         f"more than the {max_nodes} the caches reserve (the drafter's max_nodes)")
    bad = {}
    for r, (ts, ps, ds) in enumerate(rows):
        msg = _row_error(ts, ps, ds, N, vocab_size, None if roots is None else roots[r])
        if msg is not None:
            bad[r] = f"{name}: request {request_ids[r]}: {msg}"
    return bad


def _row_error(ts, ps, ds, N, vocab_size, root) -> Optional[str]:
    if ps[0] != -1:
        return f"node 0 must be the root (parent -1), got parent {ps[0]}"
    if root is not None and ts[0] != root:
        return f"node 0 must hold the root token {root} (the last emitted token), got {ts[0]}"
    for i in range(1, N):
        p = ps[i]
        if p == -1:
            continue  # padding
        if not 0 <= p < i:
            return f"node {i} has parent {p}; parents must be -1 (padding) or a node index < {i} (topological order)"
        if not 0 <= ts[i] < vocab_size:
            return f"node {i} holds token {ts[i]}, outside the vocabulary [0, {vocab_size})"
        if ds[i] != ds[p] + 1:
            return f"node {i} has depth {ds[i]} but its parent {p} has depth {ds[p]}"
    return None


def move_cache_rows(cache, moves: Sequence[Tuple[int, int, int]]) -> None:
    """Copy the first ``length`` positions and the length of row ``src`` into row ``dst`` of a StaticKVCache."""
    for src, dst, length in moves:
        if src == dst:
            continue
        n = min(int(length), cache.capacity)
        for t in cache.k + cache.v:
            t[dst, :, :n].copy_(t[src, :, :n])
        cache.lens[dst] = cache.lens[src]


class CallableDrafter(Drafter):
    """Draft with a user function: ``fn(context) -> list of candidate continuations``.

    ``context`` is the request's prompt + generated tokens (its last token is the root);
    each candidate is a list of token ids that would follow it (e.g. from a retriever).
    Candidates are merged into a trie (equal prefixes share nodes), cut to the tokens
    still worth drafting and to ``max_nodes`` nodes (root included). They are
    deterministic candidates, so the proposal is exact under sampling too. The function's
    output is checked (a list of lists of in-vocabulary ints) before anything is proposed;
    errors name the drafter and the request.
    """

    trusted = True  # validates fn's output itself

    def __init__(self, fn, max_nodes: int = 16, name: Optional[str] = None) -> None:
        if not callable(fn):
            raise TypeError(f"CallableDrafter: fn must be callable, got {type(fn).__name__}")
        if isinstance(max_nodes, bool) or not isinstance(max_nodes, int) or max_nodes < 1:
            raise ValueError(f"CallableDrafter: max_nodes must be an int >= 1, got {max_nodes!r}")
        self.fn = fn
        self.max_nodes = max_nodes
        self.name = name or f"CallableDrafter({getattr(fn, '__name__', type(fn).__name__)})"
        self.device = torch.device("cpu")
        self.vocab_size = None

    def __repr__(self) -> str:
        return self.name

    def bind(self, target, max_batch: int, max_len: int) -> None:
        self.device = torch.device(target.device)
        self.vocab_size = int(target.vocab_size)

    def _candidates(self, rid: int, seq: List[int], budget: int) -> List[List[int]]:
        got = self.fn(list(seq))
        if got is None:
            return []
        if not isinstance(got, (list, tuple)):
            raise TypeError(f"{self.name}: request {rid}: fn must return a list of candidate token lists, "
                            f"got {type(got).__name__}")
        rows = []
        for c in got:
            if isinstance(c, torch.Tensor):
                c = c.tolist()
            if not isinstance(c, (list, tuple)):
                raise TypeError(f"{self.name}: request {rid}: each candidate must be a list of token ids, "
                                f"got {type(c).__name__}")
            for t in c:
                if isinstance(t, bool) or not isinstance(t, int):
                    raise TypeError(f"{self.name}: request {rid}: candidate token {t!r} is not an int")
                if not 0 <= t < self.vocab_size:
                    raise ValueError(f"{self.name}: request {rid}: candidate token {t} outside the vocabulary "
                                     f"[0, {self.vocab_size})")
            c = [int(t) for t in c][:max(0, budget)]
            if c:
                rows.append(c)
        return rows

    def propose(self, ctx: StepContext) -> Draft:
        roots: List[int] = []
        cands: List[List[List[int]]] = []
        for rid, seq, budget in zip(ctx.request_ids, ctx.sequences, ctx.budgets):
            cands.append(self._candidates(rid, seq, budget))  # raises before any state changes
            roots.append(seq[-1])
        cap = self.max_nodes if ctx.node_budget is None else max(1, min(self.max_nodes, int(ctx.node_budget)))
        tree = TokenTree.from_candidates(roots, cands, merge=True, device=self.device, max_nodes=cap)
        return Draft(tree)
