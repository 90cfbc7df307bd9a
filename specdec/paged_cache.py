"""A block allocator and a paged KV cache for the paged ops (:mod:`specdec.paged_ops`).

:class:`BlockAllocator` hands out blocks (pages) of a fixed pool: a free list, the block list
of every request, and a reference count per block so that requests can share blocks (a
forked request, a common prefix). A block returns to the free list when its last reference
goes.

:class:`PagedKVCache` holds the per-layer page pools ``k_pages[l]`` / ``v_pages[l]``
[num_blocks, block_size, Hkv, D] of one model, a row of the block table and a length per
live request, and grows, frees and forks requests through the allocator. Its
``block_tables`` / ``cache_lens`` rows are what the paged ops take.
"""
from __future__ import annotations

from typing import Dict, Hashable, List, Optional

import torch

from specdec._check import check_int

__all__ = ["BlockAllocator", "PagedKVCache", "OutOfBlocks"]


class OutOfBlocks(RuntimeError):
    """The pool has fewer free blocks than a request asked for (nothing was allocated)."""


class BlockAllocator:
    """Blocks 0..num_blocks-1 of one pool: a free list, per-request block lists, refcounts."""

    def __init__(self, num_blocks: int) -> None:
        check_int("BlockAllocator", "num_blocks", num_blocks, lo=1)
        self.num_blocks = num_blocks
        # popped from the end: block 0 is handed out first
        self._free: List[int] = list(range(num_blocks - 1, -1, -1))
        self._ref: List[int] = [0] * num_blocks
        self._blocks: Dict[Hashable, List[int]] = {}

    # ------------------------------------------------------------------ queries
    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_blocks - len(self._free)

    def refcount(self, block: int) -> int:
        return self._ref[block]

    def blocks(self, rid: Hashable) -> List[int]:
        """The blocks of request ``rid`` in position order (a copy)."""
        return list(self._owned(rid, "blocks"))

    def __contains__(self, rid: Hashable) -> bool:
        return rid in self._blocks

    def requests(self) -> List[Hashable]:
        return list(self._blocks)

    # ------------------------------------------------------------------ changes
    def add(self, rid: Hashable) -> None:
        """Register request ``rid`` with no blocks."""
        if rid in self._blocks:
            raise ValueError(f"BlockAllocator.add: request {rid!r} is already registered")
        self._blocks[rid] = []

    def allocate(self, rid: Hashable, n: int) -> List[int]:
        """Append ``n`` fresh blocks (refcount 1) to request ``rid``; all or nothing."""
        owned = self._owned(rid, "allocate")
        check_int("BlockAllocator.allocate", "n", n, lo=0)
        if n > len(self._free):
            raise OutOfBlocks(f"BlockAllocator.allocate: request {rid!r} needs {n} blocks, "
                              f"{len(self._free)} of {self.num_blocks} are free")
        new = [self._free.pop() for _ in range(n)]
        for blk in new:
            self._ref[blk] = 1
        owned.extend(new)
        return new

    def fork(self, parent: Hashable, child: Hashable, num_blocks: Optional[int] = None) -> List[int]:
        """Register ``child`` sharing the first ``num_blocks`` (default: all) blocks of ``parent``."""
        owned = self._owned(parent, "fork")
        n = len(owned) if num_blocks is None else check_int("BlockAllocator.fork", "num_blocks", num_blocks,
                                                             lo=0, hi=len(owned))
        self.add(child)
        shared = owned[:n]
        for blk in shared:
            self._ref[blk] += 1
        self._blocks[child].extend(shared)
        return list(shared)

    def replace(self, rid: Hashable, index: int, block: int) -> None:
        """Put ``block`` (refcount taken by the caller via :meth:`take`) at ``index`` of ``rid``'s
        list, dropping the reference to the block that was there."""
        owned = self._owned(rid, "replace")
        old = owned[index]
        owned[index] = block
        self._release(old)

    def take(self) -> int:
        """One fresh block (refcount 1) owned by no request yet (for :meth:`replace`)."""
        if not self._free:
            raise OutOfBlocks(f"BlockAllocator.take: 0 of {self.num_blocks} blocks are free")
        blk = self._free.pop()
        self._ref[blk] = 1
        return blk

    def truncate(self, rid: Hashable, num_blocks: int) -> List[int]:
        """Keep the first ``num_blocks`` blocks of ``rid``; drop the references to the rest (returned)."""
        owned = self._owned(rid, "truncate")
        check_int("BlockAllocator.truncate", "num_blocks", num_blocks, lo=0, hi=len(owned))
        dropped = owned[num_blocks:]
        del owned[num_blocks:]
        for blk in reversed(dropped):
            self._release(blk)
        return dropped

    def free(self, rid: Hashable) -> None:
        """Forget request ``rid`` (finished or aborted): every reference it held is dropped."""
        owned = self._owned(rid, "free")
        for blk in reversed(owned):
            self._release(blk)
        del self._blocks[rid]

    def check(self) -> None:
        """Assert the invariants: a block is free iff nothing references it, free blocks are
        listed once, and every refcount equals the number of request lists that hold the block."""
        counts = [0] * self.num_blocks
        for owned in self._blocks.values():
            for blk in owned:
                counts[blk] += 1
        free = set(self._free)
        if len(free) != len(self._free):
            raise AssertionError("BlockAllocator: a block is in the free list twice")
        for blk in range(self.num_blocks):
            if counts[blk] != self._ref[blk]:
                raise AssertionError(f"BlockAllocator: block {blk} has refcount {self._ref[blk]} but "
                                     f"{counts[blk]} references")
            if (blk in free) != (counts[blk] == 0):
                raise AssertionError(f"BlockAllocator: block {blk} is {'free' if blk in free else 'not free'} "
                                     f"with {counts[blk]} references")

    # ------------------------------------------------------------------ internals
    def _owned(self, rid: Hashable, what: str) -> List[int]:
        owned = self._blocks.get(rid)
        if owned is None:
            raise KeyError(f"BlockAllocator.{what}: request {rid!r} is not registered")
        return owned

    def _release(self, blk: int) -> None:
        self._ref[blk] -= 1
        if self._ref[blk] == 0:
            self._free.append(blk)


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
    """

    def __init__(self, num_layers: int, num_kv_heads: int, head_dim: int, num_blocks: int, block_size: int = 16,
                 max_requests: int = 8, max_blocks_per_request: Optional[int] = None,
                 dtype: torch.dtype = torch.float32, device="cpu") -> None:
        owner = "PagedKVCache"
        for name, v in (("num_layers", num_layers), ("num_kv_heads", num_kv_heads), ("head_dim", head_dim),
                        ("num_blocks", num_blocks), ("block_size", block_size), ("max_requests", max_requests)):
            check_int(owner, name, v, lo=1)
        check_int(owner, "max_blocks_per_request", max_blocks_per_request, lo=1, allow_none=True)
        if dtype not in (torch.float32, torch.float16, torch.bfloat16):
            raise TypeError(f"{owner}: dtype must be torch.float32, float16 or bfloat16, got {dtype}")
        self.num_layers, self.num_kv_heads, self.head_dim = num_layers, num_kv_heads, head_dim
        self.block_size, self.max_requests = block_size, max_requests
        self.max_blocks = max_blocks_per_request or num_blocks
        self.dtype, self.device = dtype, torch.device(device)
        shape = (num_blocks, block_size, num_kv_heads, head_dim)
        self.k_pages = [torch.zeros(shape, dtype=dtype, device=self.device) for _ in range(num_layers)]
        self.v_pages = [torch.zeros(shape, dtype=dtype, device=self.device) for _ in range(num_layers)]
        self.allocator = BlockAllocator(num_blocks)
        self.block_tables = torch.full((max_requests, self.max_blocks), -1, dtype=torch.int32, device=self.device)
        self.cache_lens = torch.zeros(max_requests, dtype=torch.int32, device=self.device)
        self._row: Dict[Hashable, int] = {}
        self._free_rows: List[int] = list(range(max_requests - 1, -1, -1))

    # ------------------------------------------------------------------ memory
    @staticmethod
    def bytes_per_block(num_layers: int, num_kv_heads: int, head_dim: int, block_size: int,
                        dtype: torch.dtype = torch.float32) -> int:
        """K and V bytes of one block over every layer."""
        return 2 * num_layers * block_size * num_kv_heads * head_dim * torch.empty((), dtype=dtype).element_size()

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.k_pages + self.v_pages)

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
        have = 0 if rid is None else len(self.allocator.blocks(rid))
        return max(0, -(-length // self.block_size) - have)

    def add(self, rid: Hashable, length: int = 0) -> int:
        """Admit request ``rid`` with room for ``length`` positions (cache_lens starts at 0); returns its row."""
        if rid in self._row:
            raise ValueError(f"PagedKVCache.add: request {rid!r} is already in the cache")
        if not self._free_rows:
            raise OutOfBlocks(f"PagedKVCache.add: all {self.max_requests} rows are in use")
        self.allocator.add(rid)
        r = self._free_rows.pop()
        self._row[rid] = r
        self.cache_lens[r] = 0
        self.block_tables[r].fill_(-1)
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
        have = len(self.allocator.blocks(rid))
        new = self.allocator.allocate(rid, self.blocks_needed(rid, length))
        if new:
            self.block_tables[r, have:have + len(new)] = torch.tensor(new, dtype=torch.int32)
        return new

    def free(self, rid: Hashable) -> None:
        """Release request ``rid`` (finished, aborted or preempted)."""
        r = self.row(rid)
        self.allocator.free(rid)
        del self._row[rid]
        self.block_tables[r].fill_(-1)
        self.cache_lens[r] = 0
        self._free_rows.append(r)

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
        self.block_tables[r].fill_(-1)
        if shared:
            self.block_tables[r, :full] = torch.tensor(shared, dtype=torch.int32)
        if partial:
            src = self.allocator.blocks(parent)[full]
            (dst,) = self.allocator.allocate(child, 1)
            for pages in self.k_pages + self.v_pages:
                pages[dst].copy_(pages[src])
            self.block_tables[r, full] = dst
        self.cache_lens[r] = n
        return r

    def rows(self, rids) -> torch.Tensor:
        """Row indices of ``rids`` (int64, for indexing :attr:`block_tables` / :attr:`cache_lens`)."""
        return torch.tensor([self.row(rid) for rid in rids], dtype=torch.long, device=self.device)
