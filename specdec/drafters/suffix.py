"""SuffixDrafter and DocumentDrafter: free drafts from suffix indexes (SuffixDecoding, SpecInfer's retriever).

Both draft from :class:`specdec._C.SuffixIndex` (C++, csrc/include/specdec/suffix_index.h):
a depth-bounded suffix trie over token documents whose nodes count occurrences. A step
finds, in each index, the longest suffix of the request's context (at most ``max_match``
tokens, at least ``min_match``) that occurs with a continuation, and grows a token tree
below it best-first by path probability (the product of ``count(s + a) / child_sum(s)``
along the path, SuffixDecoding's frequency score), keeping nodes whose path probability
is >= ``min_token_prob``, at most ``spec_depth = min(max_spec, floor(spec_factor *
match_len + spec_offset))`` deep and at most ``node_budget - 1`` nodes. With several
indexes a node's score is the best over them and the top nodes of the merged trie are
proposed (equal prefixes share nodes). Candidates are deterministic (``draft_probs`` is
None, q is one-hot), so the proposal is exact for greedy and for sampling alike.

* :class:`SuffixDrafter`: one index per request over its prompt + output (updated with the
  tokens appended since the last step: O(new tokens * max_depth), never O(context)), plus
  a GLOBAL cache shared by every request of the drafter's decoder and kept across generate
  calls: each finished request's output (with the last ``max_depth`` prompt tokens, or the
  whole prompt with ``cache_prompts=True``) becomes a document; a token / request budget
  evicts the oldest documents first (real removal: their counts are decremented and empty
  nodes recycled, ``memory_bytes()`` reports what is held).
* :class:`DocumentDrafter`: one index over user documents (token lists, or strings with a
  tokenizer); continuations of the longest context suffix found in the documents.
  ``add_documents`` works between generate calls.

Host cost per step and request: one C++ call to extend the request's index and one to
speculate (a few microseconds each), plus building the TokenTree.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Tuple

import torch

from specdec import _C
from specdec._check import is_int, is_number, non_int_index, out_of_vocab, require_int
from specdec.drafters.base import Draft, Drafter, StepContext
from specdec.sampling import SamplingParams
from specdec.tree import TokenTree

__all__ = ["SuffixDrafter", "DocumentDrafter"]


def _check_float(owner: str, name: str, v, lo: float, hi: float) -> float:
    """A number in [lo, hi] (NaN is not), as a float."""
    if not is_number(v) or not lo <= float(v) <= hi:
        raise ValueError(f"{owner}: {name} must be a number in [{lo}, {hi}], got {v!r}")
    return float(v)


class _SuffixProposer(Drafter):
    """Shared settings and the tree building of the two suffix drafters."""

    _name = "suffix drafter"

    def _init_speculation(self, max_depth: int, max_match: int, min_match: int, max_spec: int, spec_factor: float,
                          spec_offset: float, min_token_prob: float, node_budget: int) -> None:
        n = self._name
        require_int(n, "max_depth", max_depth, 2)
        require_int(n, "max_match", max_match, 1)
        require_int(n, "min_match", min_match, 1)
        require_int(n, "max_spec", max_spec, 1)
        require_int(n, "node_budget", node_budget, 2)
        if max_depth > 1024:
            raise ValueError(f"{n}: max_depth must be <= 1024, got {max_depth}")
        if max_match >= max_depth:
            raise ValueError(f"{n}: max_match must be < max_depth (a match needs room for a continuation), "
                             f"got max_match={max_match}, max_depth={max_depth}")
        if min_match > max_match:
            raise ValueError(f"{n}: need min_match <= max_match, got min_match={min_match}, max_match={max_match}")
        self.max_depth = max_depth
        self.max_match = max_match
        self.min_match = min_match
        self.max_spec = max_spec
        self.spec_factor = _check_float(n, "spec_factor", spec_factor, 0.0, 1e6)
        self.spec_offset = _check_float(n, "spec_offset", spec_offset, -1e6, 1e6)
        self.min_token_prob = _check_float(n, "min_token_prob", min_token_prob, 0.0, 1.0)
        self.node_budget = node_budget
        self.max_nodes = node_budget
        self.device = torch.device("cpu")
        self.vocab_size: Optional[int] = None

    def _speculate(self, sources, seq: Sequence[int], budget: int) -> Tuple[List[int], List[int], int]:
        depth = min(self.max_spec, budget)
        if depth <= 0:
            return [], [], 0
        ctx = list(seq[-self.max_match:])
        sources = [s for s in sources if s is not None]
        toks, pars, _probs, m = _C.suffix_speculate(sources, ctx, self.max_match, self.min_match,
                                                    self.node_budget - 1, depth, self.spec_factor,
                                                    self.spec_offset, self.min_token_prob)
        return toks, pars, m

    def _tree(self, ctx: StepContext, rows: List[Tuple[List[int], List[int]]]) -> Draft:
        if all(not t for t, _ in rows):
            return Draft(TokenTree.root_only(ctx.roots))
        tokens = [[seq[-1]] + t for seq, (t, _) in zip(ctx.sequences, rows)]
        parents = [[-1] + p for _, p in rows]
        return Draft(TokenTree.from_lists(tokens, parents, device=self.device))


@dataclass
class _Live:
    index: object      # _C.SuffixIndex over this request's prompt + output
    doc: int
    known: int         # tokens of seq already in the index
    prompt_len: int
    seq: Optional[list] = None  # the decoder's live list of prompt + output (final tokens included at retire)


class SuffixDrafter(_SuffixProposer):
    """Suffix decoding: a per-request suffix index plus a global cache of earlier requests.

    Parameters
    ----------
    node_budget : int
        Nodes per proposal, root included (the target verifies at most this many per request).
    max_spec, spec_factor, spec_offset : draft depth ``min(max_spec, floor(spec_factor * match_len + spec_offset))``.
    min_token_prob : float
        Keep a node when its path probability (frequency score) is >= this.
    max_match, min_match : int
        Longest / shortest context suffix that is matched.
    max_depth : int
        Longest string the indexes hold (memory: at most ``max_depth`` trie nodes per stored token).
    max_cached_tokens, max_cached_requests : int or None
        Budget of the global cache (FIFO eviction); None = no bound of that kind. ``max_cached_tokens=0``
        is rejected; pass ``use_global_cache=False`` to switch the cache off.
    cache_prompts : bool
        Cache each finished request's whole prompt with its output (default: only the last
        ``max_depth`` prompt tokens, so that a later request's first tokens can be matched).

    Defaults: ``node_budget=16`` because a target pass over 2..16 nodes costs about the same on
    a CPU target, and ``min_match=2`` for the reason PromptLookup gives (docs/drafters.md).
    """

    _name = "SuffixDrafter"

    def __init__(self, node_budget: int = 16, max_spec: int = 16, spec_factor: float = 1.0,
                 spec_offset: float = 1.0, min_token_prob: float = 0.1, max_match: int = 12, min_match: int = 2,
                 max_depth: int = 28, max_cached_tokens: Optional[int] = 65536,
                 max_cached_requests: Optional[int] = None, cache_prompts: bool = False,
                 use_global_cache: bool = True) -> None:
        self._init_speculation(max_depth, max_match, min_match, max_spec, spec_factor, spec_offset, min_token_prob,
                               node_budget)
        require_int(self._name, "max_cached_tokens", max_cached_tokens, 1, allow_none=True)
        require_int(self._name, "max_cached_requests", max_cached_requests, 1, allow_none=True)
        self.cache_prompts = bool(cache_prompts)
        self.use_global_cache = bool(use_global_cache)
        self.max_cached_tokens = max_cached_tokens
        self.max_cached_requests = max_cached_requests
        self.global_index = _C.SuffixIndex(max_depth, max_cached_tokens or 0, max_cached_requests or 0, 0)
        self._live: Dict[int, _Live] = {}
        self._rows: List[int] = []

    def __repr__(self) -> str:
        return (f"SuffixDrafter(node_budget={self.node_budget}, max_spec={self.max_spec}, "
                f"spec_factor={self.spec_factor}, spec_offset={self.spec_offset}, "
                f"min_token_prob={self.min_token_prob}, global_cache={self.use_global_cache})")

    # ------------------------------------------------------------------ state
    def bind(self, target, max_batch: int, max_len: int) -> None:
        V = int(target.vocab_size)
        if self.vocab_size is not None and self.vocab_size != V:
            raise ValueError(f"SuffixDrafter: already bound to a target with vocabulary {self.vocab_size}; its global "
                             f"cache cannot serve a target with vocabulary {V}")
        self.global_index.set_vocab_size(V)
        self.vocab_size = V
        self.device = torch.device(target.device)

    def start(self, prompts: Sequence[Sequence[int]], params: SamplingParams, generator: torch.Generator) -> None:
        for rid in list(self._live):   # a previous call that ended early (an exception): keep what it produced
            self._finish(rid)
        V = self.vocab_size or 0
        self._live = {}
        for rid, p in enumerate(prompts):
            index = _C.SuffixIndex(self.max_depth, 0, 0, V)
            self._live[rid] = _Live(index, index.add(list(p)), len(p), len(p))
        self._rows = list(range(len(prompts)))

    def _finish(self, rid: int) -> None:
        live = self._live.pop(rid, None)
        if live is None or live.seq is None or not self.use_global_cache:
            return
        seq = live.seq
        out_len = len(seq) - live.prompt_len
        if out_len <= 0:
            return
        first = 0 if self.cache_prompts else max(0, live.prompt_len - self.max_depth)
        self.global_index.add(list(seq[first:]))

    def clear_cache(self) -> None:
        """Forget every cached request (the global cache is empty afterwards)."""
        self.global_index.clear()

    def memory_bytes(self) -> int:
        """Host bytes held by the global cache and the live per-request indexes."""
        return self.global_index.memory_bytes() + sum(x.index.memory_bytes() for x in self._live.values())

    def stats(self) -> Dict[str, int]:
        g = self.global_index
        return dict(cached_tokens=g.num_tokens, cached_requests=g.num_docs, cached_nodes=g.num_nodes,
                    cache_memory_bytes=g.memory_bytes(), live_requests=len(self._live),
                    live_memory_bytes=sum(x.index.memory_bytes() for x in self._live.values()))

    # ------------------------------------------------------------------ steps
    def propose(self, ctx: StepContext) -> Draft:
        rows = []
        sources_global = self.global_index if self.use_global_cache and self.global_index.num_docs else None
        for rid, seq, budget in zip(ctx.request_ids, ctx.sequences, ctx.budgets):
            live = self._live.get(rid)
            if live is None:  # a request this drafter was not started with (e.g. joined later)
                index = _C.SuffixIndex(self.max_depth, 0, 0, self.vocab_size or 0)
                live = self._live[rid] = _Live(index, index.add(list(seq)), len(seq), len(seq))
            elif len(seq) > live.known:
                live.index.extend(live.doc, list(seq[live.known:]))
                live.known = len(seq)
            live.seq = seq
            toks, pars, _ = self._speculate([live.index, sources_global], seq, budget)
            rows.append((toks, pars))
        self._rows = list(ctx.request_ids)
        return self._tree(ctx, rows)

    def admit(self, rows: Sequence[int], prompts: Sequence[Sequence[int]]) -> None:
        """Joining requests get their index at their first proposal; until then their rows hold None."""
        need = max(rows) + 1 - len(self._rows) if rows else 0
        if need > 0:
            self._rows = list(self._rows) + [None] * need

    def retire(self, moves: Sequence[Tuple[int, int, int]], active: int) -> None:
        rows = list(self._rows)
        if moves:
            need = max(max(src, dst) for src, dst, _ in moves) + 1 - len(rows)
            if need > 0:
                rows += [None] * need
        for src, dst, _ in moves:
            rows[dst] = rows[src]
        rows = rows[:active]
        for rid in set(self._rows) - set(rows):
            self._finish(rid)
        self._rows = rows


class DocumentDrafter(_SuffixProposer):
    """Draft continuations of the longest context suffix found in a user document store.

    Parameters
    ----------
    docs : sequence of str or of token lists
        The documents (at least one, none empty). Strings need ``tokenizer``.
    tokenizer : optional
        A Hugging Face tokenizer (``encode(text, add_special_tokens=False)``) or any callable
        ``text -> list[int]``.
    Other parameters as :class:`SuffixDrafter` (``max_depth`` bounds the index: at most
    ``max_depth`` nodes per document token).
    """

    _name = "DocumentDrafter"

    def __init__(self, docs, tokenizer=None, node_budget: int = 16, max_spec: int = 16, spec_factor: float = 1.0,
                 spec_offset: float = 1.0, min_token_prob: float = 0.1, max_match: int = 12, min_match: int = 2,
                 max_depth: int = 28) -> None:
        self._init_speculation(max_depth, max_match, min_match, max_spec, spec_factor, spec_offset, min_token_prob,
                               node_budget)
        self.tokenizer = tokenizer
        self.index = _C.SuffixIndex(max_depth, 0, 0, 0)
        self.add_documents(docs)

    def __repr__(self) -> str:
        return (f"DocumentDrafter({self.index.num_docs} documents, {self.index.num_tokens} tokens, "
                f"node_budget={self.node_budget})")

    def _encode(self, i: int, doc) -> List[int]:
        if isinstance(doc, str):
            if self.tokenizer is None:
                raise TypeError(f"DocumentDrafter: document {i} is a string but no tokenizer was given "
                                "(pass tokenizer=..., or token lists)")
            enc = getattr(self.tokenizer, "encode", None)
            ids = enc(doc, add_special_tokens=False) if enc is not None else self.tokenizer(doc)
            if hasattr(ids, "keys"):
                ids = ids["input_ids"]
        elif isinstance(doc, torch.Tensor):
            if doc.dim() != 1 or doc.dtype.is_floating_point or doc.dtype == torch.bool:
                raise TypeError(f"DocumentDrafter: document {i} must be a 1-D integer tensor, got {doc.dtype} "
                                f"{tuple(doc.shape)}")
            ids = doc.tolist()
        elif isinstance(doc, (list, tuple)):
            ids = doc
        else:
            raise TypeError(f"DocumentDrafter: document {i} must be a string or a list of token ids, "
                            f"got {type(doc).__name__}")
        ids = list(ids)
        j = non_int_index(ids)
        if j is not None:
            raise TypeError(f"DocumentDrafter: document {i} holds a non-integer token {ids[j]!r} at position {j}")
        if not ids:
            raise ValueError(f"DocumentDrafter: document {i} is empty (no tokens)")
        limit = self.vocab_size
        bad = out_of_vocab(ids, limit)
        if bad is not None:
            raise ValueError(f"DocumentDrafter: document {i} holds token id {bad}, outside the vocabulary "
                             f"[0, {limit if limit is not None else 'V'})")
        return ids

    def add_documents(self, docs) -> List[int]:
        """Add documents (validated all together first: on an error nothing is added). Returns their ids."""
        if isinstance(docs, (str, torch.Tensor)) or (isinstance(docs, (list, tuple)) and docs and
                                                     is_int(docs[0])):
            raise TypeError("DocumentDrafter: docs must be a list of documents (strings or token lists); "
                            "wrap a single document as [doc]")
        try:
            docs = list(docs)
        except TypeError:
            raise TypeError(f"DocumentDrafter: docs must be a list of documents, got {type(docs).__name__}") from None
        if not docs:
            raise ValueError("DocumentDrafter: docs must hold at least one document, got none")
        encoded = [self._encode(i, d) for i, d in enumerate(docs)]
        return [self.index.add(ids) for ids in encoded]

    def bind(self, target, max_batch: int, max_len: int) -> None:
        V = int(target.vocab_size)
        try:
            self.index.set_vocab_size(V)
        except ValueError as e:
            raise ValueError(f"DocumentDrafter: the documents do not fit the target's vocabulary: {e}") from None
        self.vocab_size = V
        self.device = torch.device(target.device)

    def memory_bytes(self) -> int:
        return self.index.memory_bytes()

    def propose(self, ctx: StepContext) -> Draft:
        sources = [self.index]
        rows = []
        for seq, budget in zip(ctx.sequences, ctx.budgets):
            toks, pars, _ = self._speculate(sources, seq, budget)
            rows.append((toks, pars))
        return self._tree(ctx, rows)
