"""A paged KV cache for the paged ops (:mod:`specdec.paged_ops`).

:class:`PagedKVCache` holds the per-layer page pools ``k_pages[l]`` / ``v_pages[l]``
[num_blocks, block_size, Hkv, D] of one model, a row of the block table and a length per
live request, and grows, frees and forks requests through its
:class:`~specdec.block_allocator.BlockAllocator`. Its ``block_tables`` / ``cache_lens`` rows are
what the paged ops take.
"""
from __future__ import annotations

from typing import Dict, Hashable, List, Optional

import torch

from specdec import paged_ops
from specdec._check import check_int
from specdec.block_allocator import BlockAllocator, OutOfBlocks

__all__ = ["BlockAllocator", "PagedKVCache", "PagedKVView", "OutOfBlocks"]


class PagedKVCache:
    """Per-layer page pools [num_blocks, block_size, Hkv, D], a block table row and a length per request.

    Parameters
    ----------
    num_layers, num_kv_heads, head_dim : the model's KV shape.
    num_blocks : pages in the pool (shared by every request and layer: block ``i`` is page
        ``i`` of every layer's pool).
    block_size : positions per page (16 is vLLM's default; 1 is SGLang's token pool).
    max_requests : rows of :attr:`block_tables` / :attr:`cache_lens`.
    max_blocks_per_request : columns of :attr:`block_tables` (a request's capacity is
        ``max_blocks_per_request * block_size`` positions); default: the whole pool.
    scratch_page : add one page past the pool (index ``num_blocks``, never allocated) and point
        every unused block-table entry at it instead of -1: writes past a request's blocks (the
        padding of a ragged prefill group or of a batch's tree) land there and are never read as
        committed positions. The engine's caches use it; :attr:`pad` is the fill value.
    feature_dim : with > 0, one more pool ``hidden_pages`` [num_blocks, block_size, 1, feature_dim]
        holds a feature vector per position (the target's hidden states that a feature drafter reads,
        :meth:`specdec.HFCausalLM.capture_hidden`), in the same blocks as the K/V: shared by a cached
        prefix, copied by a fork, moved by every commit with them.
    """

    def __init__(self, num_layers: int, num_kv_heads: int, head_dim: int, num_blocks: int, block_size: int = 16,
                 max_requests: int = 8, max_blocks_per_request: Optional[int] = None,
                 dtype: torch.dtype = torch.float32, device="cpu", scratch_page: bool = False,
                 feature_dim: int = 0) -> None:
        owner = "PagedKVCache"
        for name, v in (("num_layers", num_layers), ("num_kv_heads", num_kv_heads), ("head_dim", head_dim),
                        ("num_blocks", num_blocks), ("block_size", block_size), ("max_requests", max_requests)):
            check_int(owner, name, v, lo=1)
        check_int(owner, "max_blocks_per_request", max_blocks_per_request, lo=1, allow_none=True)
        check_int(owner, "feature_dim", feature_dim, lo=0)
        if dtype not in (torch.float32, torch.float16, torch.bfloat16):
            raise TypeError(f"{owner}: dtype must be torch.float32, float16 or bfloat16, got {dtype}")
        self.num_layers, self.num_kv_heads, self.head_dim = num_layers, num_kv_heads, head_dim
        self.block_size, self.max_requests = block_size, max_requests
        self.max_blocks = max_blocks_per_request or num_blocks
        self.dtype, self.device = dtype, torch.device(device)
        self.pad = num_blocks if scratch_page else -1
        shape = (num_blocks + int(scratch_page), block_size, num_kv_heads, head_dim)
        self.k_pages = [torch.zeros(shape, dtype=dtype, device=self.device) for _ in range(num_layers)]
        self.v_pages = [torch.zeros(shape, dtype=dtype, device=self.device) for _ in range(num_layers)]
        self.feature_dim = int(feature_dim)
        # the features ride every page move as one more (K, V) pair: K = the features, V = a 16-byte-wide
        # pool that nothing reads (the paged kv_commit takes pairs whose heads and widths may differ)
        self.extra_k: List[torch.Tensor] = []
        self.extra_v: List[torch.Tensor] = []
        if feature_dim:
            self.extra_k = [torch.zeros(shape[:2] + (1, feature_dim), dtype=dtype, device=self.device)]
            self.extra_v = [torch.zeros(shape[:2] + (1, 16 // self.k_pages[0].element_size()), dtype=dtype,
                                        device=self.device)]
        self.allocator = BlockAllocator(num_blocks)
        self.block_tables = torch.full((max_requests, self.max_blocks), self.pad, dtype=torch.int32,
                                       device=self.device)
        self.cache_lens = torch.zeros(max_requests, dtype=torch.int32, device=self.device)
        self._row: Dict[Hashable, int] = {}
        self._free_rows: List[int] = list(range(max_requests - 1, -1, -1))

    # ------------------------------------------------------------------ memory
    @staticmethod
    def bytes_per_block(num_layers: int, num_kv_heads: int, head_dim: int, block_size: int,
                        dtype: torch.dtype = torch.float32, feature_dim: int = 0) -> int:
        """K and V bytes of one block over every layer (and its features with ``feature_dim``)."""
        size = torch.empty((), dtype=dtype).element_size()
        extra = block_size * (feature_dim * size + 16) if feature_dim else 0
        return 2 * num_layers * block_size * num_kv_heads * head_dim * size + extra

    @property
    def hidden_pages(self) -> Optional[torch.Tensor]:
        """The feature pool [pages, block_size, 1, feature_dim], or None without features."""
        return self.extra_k[0] if self.extra_k else None

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.k_pages + self.v_pages + self.extra_k + self.extra_v)

    def feature_slots(self, rows: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Flat indices into ``hidden_pages.view(-1, feature_dim)`` of (row, position) pairs: rows [B] or [B, 1],
        positions [B, N] (int64). A position past the capacity maps to the scratch page (or page 0 without
        one): written there, it is never read as a committed position."""
        bs, cap = self.block_size, self.capacity
        pos = positions.to(torch.int64)
        inside = pos < cap
        blk = (pos.clamp(min=0, max=cap - 1) // bs)
        pages = self.block_tables[rows.to(torch.int64).view(-1, 1), blk].to(torch.int64)
        pages = torch.where(inside & (pages >= 0), pages, max(self.pad, 0))
        return pages * bs + pos.clamp(min=0) % bs

    @property
    def num_blocks(self) -> int:
        return self.allocator.num_blocks

    @property
    def capacity(self) -> int:
        """Positions one request can hold."""
        return self.max_blocks * self.block_size

    # ------------------------------------------------------------------ requests
    def row(self, rid: Hashable) -> int:
        """The block-table row of request ``rid``."""
        r = self._row.get(rid)
        if r is None:
            raise KeyError(f"PagedKVCache: request {rid!r} is not in the cache")
        return r

    def length(self, rid: Hashable) -> int:
        return int(self.cache_lens[self.row(rid)])

    def blocks_needed(self, rid: Optional[Hashable], length: int) -> int:
        """Blocks to allocate so that ``rid`` (None: a new request) covers ``length`` positions."""
        have = 0 if rid is None else self.allocator.num_blocks_of(rid)
        return max(0, -(-length // self.block_size) - have)

    def add(self, rid: Hashable, length: int = 0, row: Optional[int] = None) -> int:
        """Admit request ``rid`` with room for ``length`` positions (cache_lens starts at 0); returns its row
        (``row``: that free row, default any)."""
        if rid in self._row:
            raise ValueError(f"PagedKVCache.add: request {rid!r} is already in the cache")
        if not self._free_rows:
            raise OutOfBlocks(f"PagedKVCache.add: all {self.max_requests} rows are in use")
        if row is not None and row not in self._free_rows:
            raise ValueError(f"PagedKVCache.add: row {row} is not a free row of the cache")
        self.allocator.add(rid)
        r = self._free_rows.pop() if row is None else row
        if row is not None:
            self._free_rows.remove(row)
        self._row[rid] = r
        self.cache_lens[r] = 0
        self.block_tables[r].fill_(self.pad)
        try:
            self.grow(rid, length)
        except Exception:
            self.free(rid)
            raise
        return r

    def grow(self, rid: Hashable, length: int) -> List[int]:
        """Make ``rid`` cover positions [0, length) (``length`` <= :attr:`capacity`); returns the new blocks."""
        r = self.row(rid)
        check_int("PagedKVCache.grow", "length", length, lo=0, hi=self.capacity)
        have = self.allocator.num_blocks_of(rid)
        new = self.allocator.allocate(rid, self.blocks_needed(rid, length))
        if new:
            self.block_tables[r, have:have + len(new)] = torch.tensor(new, dtype=torch.int32)
        return new

    def free(self, rid: Hashable) -> None:
        """Release request ``rid`` (finished, aborted or preempted)."""
        r = self.row(rid)
        self.allocator.free(rid)
        del self._row[rid]
        self.block_tables[r].fill_(self.pad)
        self.cache_lens[r] = 0
        self._free_rows.append(r)

    def move_row(self, rid: Hashable, row: int) -> None:
        """Put request ``rid`` (its block-table row and length) into free row ``row``; its old row is freed."""
        src = self.row(rid)
        if row == src:
            return
        if row not in self._free_rows:
            raise ValueError(f"PagedKVCache.move_row: row {row} is not a free row of the cache")
        self._free_rows.remove(row)
        self.block_tables[row].copy_(self.block_tables[src])
        self.cache_lens[row] = self.cache_lens[src]
        self.block_tables[src].fill_(self.pad)
        self.cache_lens[src] = 0
        self._free_rows.append(src)
        self._row[rid] = row

    def fork(self, parent: Hashable, child: Hashable) -> int:
        """Admit ``child`` with ``parent``'s committed positions: the full blocks are shared (refcount),
        a partial last block is copied into a block of the child's own (every layer), so that
        neither request ever writes a block the other reads. Returns the child's row."""
        self.row(parent)  # raises for an unknown parent
        n = self.length(parent)
        full = n // self.block_size
        partial = n % self.block_size != 0
        if child in self._row:
            raise ValueError(f"PagedKVCache.fork: request {child!r} is already in the cache")
        if not self._free_rows:
            raise OutOfBlocks(f"PagedKVCache.fork: all {self.max_requests} rows are in use")
        if partial and self.allocator.num_free < 1:
            raise OutOfBlocks(f"PagedKVCache.fork: request {child!r} needs 1 block for the partial last block, "
                              f"0 of {self.allocator.num_blocks} are free")
        shared = self.allocator.fork(parent, child, full)
        r = self._free_rows.pop()
        self._row[child] = r
        self.block_tables[r].fill_(self.pad)
        if shared:
            self.block_tables[r, :full] = torch.tensor(shared, dtype=torch.int32)
        if partial:
            src = self.allocator.blocks(parent)[full]
            (dst,) = self.allocator.allocate(child, 1)
            for pages in self.k_pages + self.v_pages + self.extra_k + self.extra_v:
                pages[dst].copy_(pages[src])
            self.block_tables[r, full] = dst
        self.cache_lens[r] = n
        return r

    def rows(self, rids) -> torch.Tensor:
        """Row indices of ``rids`` (int64, for indexing :attr:`block_tables` / :attr:`cache_lens`)."""
        return torch.tensor([self.row(rid) for rid in rids], dtype=torch.long, device=self.device)

    def view(self, start: int = 0, stop: Optional[int] = None) -> "PagedKVView":
        """Rows [start, stop) (default all) as the models read a cache (see :class:`PagedKVView`)."""
        return PagedKVView(self, start, self.max_requests if stop is None else stop)


class PagedKVView:
    """Rows [start, stop) of a :class:`PagedKVCache` as the models take a StaticKVCache: ``k[l]`` /
    ``v[l]`` the page pools, ``lens`` / ``block_tables`` the rows' slices (views), ``commit`` =
    :func:`~specdec.paged_ops.kv_commit_paged`. A view never allocates: the caller grows blocks first."""

    paged = True

    def __init__(self, cache: PagedKVCache, start: int, stop: int) -> None:
        if not 0 <= start < stop <= cache.max_requests:
            raise ValueError(f"PagedKVView: need 0 <= start < stop <= {cache.max_requests}, got [{start}, {stop})")
        self.pages, self.start = cache, start
        self.num_layers, self.num_kv_heads, self.head_dim = cache.num_layers, cache.num_kv_heads, cache.head_dim
        self.dtype, self.device, self.block_size = cache.dtype, cache.device, cache.block_size
        self.batch = stop - start
        self.capacity = cache.capacity
        self.k, self.v = cache.k_pages, cache.v_pages
        self.feature_dim = cache.feature_dim
        self.lens = cache.cache_lens[start:stop]
        self.block_tables = cache.block_tables[start:stop]

    def rows(self, start: int, stop: int) -> "PagedKVView":
        if not 0 <= start < stop <= self.batch:
            raise ValueError(f"{type(self).__name__}.rows: need 0 <= start < stop <= {self.batch}, "
                             f"got [{start}, {stop})")
        return type(self)(self.pages, self.start + start, self.start + stop)   # a subclass keeps its kind

    def nbytes(self) -> int:
        return self.pages.nbytes

    def gather(self, layer: int, row: int, length: int):
        """(K, V) of positions [0, length) of ``row`` as dense [Hkv, length, D] copies (tests, debugging)."""
        pages = self.block_tables[row, :-(-length // self.block_size)].long()
        return tuple(t[pages].flatten(0, 1)[:length].transpose(0, 1) for t in (self.k[layer], self.v[layer]))

    def commit(self, accepted: torch.Tensor, num_accepted: torch.Tensor) -> None:
        """Keep each row's accepted tree path (root included); lens += num_accepted + 1."""
        pages = self.pages
        paged_ops.kv_commit_paged(self.k + pages.extra_k, self.v + pages.extra_v, self.block_tables, self.lens,
                                  accepted, num_accepted)

    def reset(self, rows: Optional[List[int]] = None) -> None:
        """Lengths to 0 (timing passes on rows that hold no request; blocks are untouched)."""
        idx = slice(None) if rows is None else torch.as_tensor(list(rows), dtype=torch.long, device=self.device)
        self.lens[idx] = 0
