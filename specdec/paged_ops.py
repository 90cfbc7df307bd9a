"""Typed wrappers of the paged KV ops: ``verify_attention``, ``append_kv`` and ``kv_commit``
over a cache kept in pages, as serving stacks keep it (vLLM's block tables, SGLang's token
pool at page size 1, FlashInfer's NHD page layout).

Layout (NHD)
------------
k_pages, v_pages : [num_pages, page_size, Hkv, D], one dtype (float32 / float16 / bfloat16), D
    contiguous; the other strides are free as long as no two elements share an address, so NHD
    pools, HND pools passed as ``pages.transpose(1, 2)`` and the halves of a combined
    ``[num_pages, 2, page_size, Hkv, D]`` pool are used in place (no copy). K and V of a call share
    one set of strides. One pair per layer; every layer of a model shares the block tables.
block_tables : [B, max_blocks] int32. Position ``s`` of request ``b`` lives in page
    ``block_tables[b, s // page_size]``, slot ``s % page_size``. A row's capacity is
    ``max_blocks * page_size``; entries past the blocks a call touches are never read
    (pad them with anything, -1 included).
cache_lens : [B] int32, the committed prefix length of each request.

The ops compute exactly what their dense forms in :mod:`specdec.ops` compute for the same
keys (the CPU kernels give the dense kernels' bits). Pages may be shared between requests
(a common prefix) as long as no call WRITES a shared page: append_kv_paged writes positions
``cache_lens[b] + offset + j`` and kv_commit_paged positions ``cache_lens[b] + 1 ..
cache_lens[b] + num_accepted[b]``, so the pages holding those positions must belong to
request ``b`` alone. The pure-torch oracles are in :mod:`specdec.reference_paged`; the
block allocator and a paged cache are in :mod:`specdec.paged_cache`.
"""
from __future__ import annotations

from typing import List, Optional, Sequence, Tuple

import torch

from specdec import _C  # noqa: F401  (loads the library that registers torch.ops.specdec)

__all__ = ["verify_attention_paged", "append_kv_paged", "kv_commit_paged", "commit_block_table", "decoder_layer_paged"]

_ops = torch.ops.specdec


def verify_attention_paged(q: torch.Tensor, k_pages: torch.Tensor, v_pages: torch.Tensor,
                           block_tables: torch.Tensor, cache_lens: torch.Tensor,
                           tree_mask: Optional[torch.Tensor] = None, scale: Optional[float] = None) -> torch.Tensor:
    """:func:`specdec.ops.verify_attention` over a paged cache.

    q [B, Nq, Hq, D]; k_pages / v_pages [num_pages, page_size, Hkv, D]; block_tables
    [B, max_blocks] int32; cache_lens [B] int32; tree_mask [B, Nq, Nkv] bool (Nkv >= Nq: the
    queries are the last Nq of the step's Nkv new nodes, the frontier form) or None (causal
    chain, Nkv = Nq). The new nodes' K/V must already sit at positions ``cache_lens[b] + j``,
    j < Nkv (:func:`append_kv_paged`). Requires ``cache_lens[b] + Nkv <= max_blocks *
    page_size`` and every block of positions ``< cache_lens[b] + Nkv`` to name a page.
    scale defaults to ``D ** -0.5``. Returns [B, Nq, Hq, D] in q's dtype.
    """
    if scale is None:
        scale = q.shape[-1] ** -0.5
    return _ops.verify_attention_paged(q, k_pages, v_pages, block_tables, cache_lens, tree_mask, float(scale))


def append_kv_paged(k_pages: torch.Tensor, v_pages: torch.Tensor, k_new: torch.Tensor, v_new: torch.Tensor,
                    block_tables: torch.Tensor, cache_lens: torch.Tensor, offset: int = 0) -> None:
    """:func:`specdec.ops.append_kv` through the block tables, in place.

    k_new, v_new [B, Hkv, N, D] (cache dtype) go to positions ``cache_lens[b] + offset + j``;
    the caller has allocated the pages of those positions. cache_lens is unchanged.
    """
    _ops.append_kv_paged(k_pages, v_pages, k_new, v_new, block_tables, cache_lens, int(offset))


def kv_commit_paged(k_pages: Sequence[torch.Tensor], v_pages: Sequence[torch.Tensor], block_tables: torch.Tensor,
                    cache_lens: torch.Tensor, accepted: torch.Tensor, num_accepted: torch.Tensor) -> None:
    """:func:`specdec.ops.kv_commit` through the block tables, in place.

    For every layer and request, position ``cache_lens[b] + i`` takes the K/V at
    ``cache_lens[b] + accepted[b, i]`` for i = 1..num_accepted[b]; only the nodes NOT already
    in place move (a chain moves no byte), and every move lies among the step's new positions,
    i.e. in the row's last pages. Then ``cache_lens[b] += num_accepted[b] + 1``. The layers may
    differ in Hkv and D but share num_pages, page_size and dtype.

    Page size 1 does the same moves one slot each. A caller that owns its token pool can
    instead rewrite its table with :func:`commit_block_table` (zero KV bytes moved).
    """
    _ops.kv_commit_paged(list(k_pages), list(v_pages), block_tables, cache_lens, accepted, num_accepted)


def commit_block_table(block_tables: torch.Tensor, cache_lens: torch.Tensor, accepted: torch.Tensor,
                       num_accepted: torch.Tensor) -> List[List[int]]:
    """The page-size-1 commit by index rewrite: no K/V byte moves.

    At page size 1 each position is its own page, so the accepted path can be committed by
    pointing ``block_tables[b, cache_lens[b] + i]`` at the page of ``cache_lens[b] +
    accepted[b, i]`` (i = 1..num_accepted[b]). Updates block_tables and cache_lens in place
    (``cache_lens[b] += num_accepted[b] + 1``) and returns, per request, the pages of the step's
    N = accepted.shape[1] new positions that no longer hold a committed node (the caller frees
    them). Host tensors (CPU); the same result as :func:`kv_commit_paged` at page size 1 for
    every later read through the table.
    """
    owner = "commit_block_table"
    for name, t in (("block_tables", block_tables), ("cache_lens", cache_lens), ("accepted", accepted),
                    ("num_accepted", num_accepted)):
        if not isinstance(t, torch.Tensor) or t.dtype != torch.int32 or t.device.type != "cpu":
            got = f"{t.dtype} on {t.device}" if isinstance(t, torch.Tensor) else type(t).__name__
            raise TypeError(f"{owner}: {name} must be an int32 CPU tensor, got {got}")
    B, N = accepted.shape
    if block_tables.dim() != 2 or block_tables.shape[0] != B or cache_lens.shape != (B,) or \
            num_accepted.shape != (B,):
        raise ValueError(f"{owner}: block_tables must be [B, max_blocks], cache_lens and num_accepted [B] with "
                         f"B = {B}, got {tuple(block_tables.shape)}, {tuple(cache_lens.shape)}, "
                         f"{tuple(num_accepted.shape)}")
    freed: List[List[int]] = []
    for b in range(B):
        L, n = int(cache_lens[b]), int(num_accepted[b])
        if not 0 <= n < N or L < 0 or L + N > block_tables.shape[1]:
            raise ValueError(f"{owner}: request {b}: need 0 <= num_accepted < N = {N} and cache_lens + N <= "
                             f"max_blocks = {block_tables.shape[1]}, got num_accepted = {n}, cache_lens = {L}")
        path = [int(accepted[b, i]) for i in range(n + 1)]
        if path[0] != 0 or any(not (path[i - 1] < path[i] < N) for i in range(1, n + 1)):
            raise ValueError(f"{owner}: accepted[{b}] must be an increasing root path of node indices < {N} "
                             f"starting at 0, got {path}")
        step = [int(p) for p in block_tables[b, L:L + N]]
        for i in range(1, n + 1):  # ascending: a destination is never a later source
            block_tables[b, L + i] = step[path[i]]
        kept = {step[p] for p in path}
        freed.append([p for p in step if p not in kept])
        cache_lens[b] = L + n + 1
    return freed


def decoder_layer_paged(x: torch.Tensor, h: torch.Tensor, weights: Sequence[torch.Tensor],
                        scales: Sequence[Optional[torch.Tensor]], mins: Sequence[Optional[torch.Tensor]],
                        biases: Sequence[Optional[torch.Tensor]], bits: Sequence[int], post_norm_weight: torch.Tensor,
                        post_norm_eps: float, next_norm_weight: torch.Tensor, next_norm_eps: float,
                        k_pages: torch.Tensor, v_pages: torch.Tensor, block_tables: torch.Tensor,
                        cache_lens: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                        tree_mask: Optional[torch.Tensor], kv_offset: int, scale: float, num_heads: int,
                        num_kv_heads: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """:func:`specdec.ops.decoder_layer` on a paged cache: the layer's K/V go through ``block_tables``
    (:func:`append_kv_paged`) and its attention reads them there (:func:`verify_attention_paged`);
    everything else as the dense op, and the same bits as the dense op on the same keys. The pages
    of positions ``cache_lens[b] + kv_offset .. + N`` must be the request's own (allocated by the caller)."""
    return _decoder_layer_paged(x, h, weights, scales, mins, biases, bits, post_norm_weight, float(post_norm_eps),
                                next_norm_weight, float(next_norm_eps), k_pages, v_pages, cache_lens, cos, sin,
                                tree_mask, int(kv_offset), float(scale), int(num_heads), int(num_kv_heads),
                                block_tables)


_decoder_layer_paged = _ops.decoder_layer_paged.default


@torch.library.register_fake("specdec::decoder_layer_paged")
def _decoder_layer_paged_fake(x, h, weights, scales, mins, biases, bits, post_norm_weight, post_norm_eps,
                              next_norm_weight, next_norm_eps, k_pages, v_pages, cache_lens, cos, sin, tree_mask,
                              kv_offset, scale, num_heads, num_kv_heads, block_tables):
    return (torch.empty_like(x, memory_format=torch.contiguous_format),
            torch.empty_like(x, memory_format=torch.contiguous_format))


@torch.library.register_fake("specdec::verify_attention_paged")
def _verify_attention_paged_fake(q, k_pages, v_pages, block_tables, cache_lens, tree_mask, scale):
    return torch.empty_like(q, memory_format=torch.contiguous_format)


@torch.library.register_fake("specdec::append_kv_paged")
def _append_kv_paged_fake(k_pages, v_pages, k_new, v_new, block_tables, cache_lens, offset=0):
    return None


@torch.library.register_fake("specdec::kv_commit_paged")
def _kv_commit_paged_fake(k_pages, v_pages, block_tables, cache_lens, accepted, num_accepted):
    return None
