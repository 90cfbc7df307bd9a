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

from collections import OrderedDict
from typing import Dict, Hashable, List, Optional, Tuple

import torch

from specdec import paged_ops
from specdec._check import check_int

__all__ = ["BlockAllocator", "PagedKVCache", "PagedKVView", "OutOfBlocks"]


class OutOfBlocks(RuntimeError):
    """The pool has fewer free blocks than a request asked for (nothing was allocated)."""


class BlockAllocator:
    """Blocks 0..num_blocks-1 of one pool: a free list, per-request block lists, refcounts.

    Prefix caching: a block can carry a *key* (:meth:`register`, what its K/V holds). A keyed
    block whose last reference goes is not freed but parked, least recently used first, and a
    later request can take it again by key (:meth:`lookup`, :meth:`share`). Allocation uses the
    free list first and then evicts the oldest parked block (its key is forgotten). Parked blocks
    count as free (:attr:`num_free`).
    """

    def __init__(self, num_blocks: int) -> None:
        check_int("BlockAllocator", "num_blocks", num_blocks, lo=1)
        self.num_blocks = num_blocks
        # popped from the end: block 0 is handed out first
        self._free: List[int] = list(range(num_blocks - 1, -1, -1))
        self._ref: List[int] = [0] * num_blocks
        self._blocks: Dict[Hashable, List[int]] = {}
        self._key_of: Dict[int, Tuple[Hashable, int]] = {}   # keyed block -> (key, serial)
        self._by_key: Dict[Hashable, int] = {}                # key -> block
        self._parked: "OrderedDict[int, None]" = OrderedDict()  # unreferenced keyed blocks, oldest first
        self._serial = 0
        self.evictions = 0

    # ------------------------------------------------------------------ queries
    @property
    def num_free(self) -> int:
        """Blocks an allocation can take: the free list plus the parked (evictable) cached blocks."""
        return len(self._free) + len(self._parked)

    num_cached = property(lambda self: len(self._key_of), doc="blocks that carry a prefix key (referenced or parked)")
    num_parked = property(lambda self: len(self._parked), doc="unreferenced cached (evictable) blocks")

    def num_blocks_of(self, rid: Hashable) -> int:
        return len(self._owned(rid, "num_blocks_of"))

    def cached_blocks(self) -> List[int]:
        """The blocks that carry a prefix key (referenced or parked), ascending."""
        return sorted(self._key_of)

    @property
    def num_used(self) -> int:
        """Blocks referenced by some request."""
        return self.num_blocks - self.num_free

    def refcount(self, block: int) -> int:
        return self._ref[block]

    def serial_of(self, block: int) -> Optional[int]:
        """The serial of ``block``'s prefix key (unique per keying; gone when the key is evicted), or None."""
        key = self._key_of.get(block)
        return None if key is None else key[1]

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
        if n > self.num_free:
            raise OutOfBlocks(f"BlockAllocator.allocate: request {rid!r} needs {n} blocks, "
                              f"{self.num_free} of {self.num_blocks} are free")
        new = [self._pop_free() for _ in range(n)]
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
        if not self.num_free:
            raise OutOfBlocks(f"BlockAllocator.take: 0 of {self.num_blocks} blocks are free")
        blk = self._pop_free()
        self._ref[blk] = 1
        return blk

    # ------------------------------------------------------------------ prefix caching
    def register(self, block: int, key: Hashable) -> int:
        """Give referenced ``block`` the content key ``key``; returns the key's serial (a number
        never reused, for chaining keys). A key already held by another block keeps that block
        (its serial is returned); a block that already has a key keeps it."""
        check_int("BlockAllocator.register", "block", block, lo=0, hi=self.num_blocks - 1)
        if self._ref[block] < 1:
            raise ValueError(f"BlockAllocator.register: block {block} is not referenced by any request")
        held = self._by_key.get(key)
        if held is not None:
            return self._key_of[held][1]
        if block in self._key_of:
            return self._key_of[block][1]
        self._serial += 1
        self._key_of[block] = (key, self._serial)
        self._by_key[key] = block
        return self._serial

    def lookup(self, key: Hashable) -> Optional[Tuple[int, int]]:
        """(block, serial) of the block holding ``key``, or None."""
        blk = self._by_key.get(key)
        return None if blk is None else (blk, self._key_of[blk][1])

    def share(self, rid: Hashable, blocks: List[int]) -> None:
        """Append existing keyed ``blocks`` to request ``rid``'s list (a reference each; a parked
        block is taken back from the eviction order)."""
        owned = self._owned(rid, "share")
        for blk in blocks:
            if blk not in self._key_of:
                raise ValueError(f"BlockAllocator.share: block {blk} carries no prefix key")
        for blk in blocks:
            if self._ref[blk] == 0:
                del self._parked[blk]
            self._ref[blk] += 1
            owned.append(blk)

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
        if {b: k for k, b in self._by_key.items()} != {b: k for b, (k, _) in self._key_of.items()}:
            raise AssertionError("BlockAllocator: the key -> block and block -> key maps disagree")
        for blk in range(self.num_blocks):
            if counts[blk] != self._ref[blk]:
                raise AssertionError(f"BlockAllocator: block {blk} has refcount {self._ref[blk]} but "
                                     f"{counts[blk]} references")
            unreferenced = counts[blk] == 0
            keyed = blk in self._key_of
            if (blk in free) != (unreferenced and not keyed) or (blk in self._parked) != (unreferenced and keyed):
                raise AssertionError(f"BlockAllocator: block {blk} ({counts[blk]} references, "
                                     f"{'keyed' if keyed else 'unkeyed'}) is {'free' if blk in free else 'not free'} "
                                     f"and {'parked' if blk in self._parked else 'not parked'}")

    # ------------------------------------------------------------------ internals
    def _owned(self, rid: Hashable, what: str) -> List[int]:
        owned = self._blocks.get(rid)
        if owned is None:
            raise KeyError(f"BlockAllocator.{what}: request {rid!r} is not registered")
        return owned

    def _release(self, blk: int) -> None:
        self._ref[blk] -= 1
        if self._ref[blk] == 0:
            if blk in self._key_of:
                self._parked[blk] = None      # newest at the end: evicted last
            else:
                self._free.append(blk)

    def _pop_free(self) -> int:
        if self._free:
            return self._free.pop()
        blk, _ = self._parked.popitem(last=False)  # the least recently used cached block
        key, _ = self._key_of.pop(blk)
        del self._by_key[key]
        self.evictions += 1
        return blk


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
    """

    def __init__(self, num_layers: int, num_kv_heads: int, head_dim: int, num_blocks: int, block_size: int = 16,
                 max_requests: int = 8, max_blocks_per_request: Optional[int] = None,
                 dtype: torch.dtype = torch.float32, device="cpu", scratch_page: bool = False) -> None:
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
        self.pad = num_blocks if scratch_page else -1
        shape = (num_blocks + int(scratch_page), block_size, num_kv_heads, head_dim)
        self.k_pages = [torch.zeros(shape, dtype=dtype, device=self.device) for _ in range(num_layers)]
        self.v_pages = [torch.zeros(shape, dtype=dtype, device=self.device) for _ in range(num_layers)]
        self.allocator = BlockAllocator(num_blocks)
        self.block_tables = torch.full((max_requests, self.max_blocks), self.pad, dtype=torch.int32,
                                       device=self.device)
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
            for pages in self.k_pages + self.v_pages:
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
        self.lens = cache.cache_lens[start:stop]
        self.block_tables = cache.block_tables[start:stop]

    def rows(self, start: int, stop: int) -> "PagedKVView":
        if not 0 <= start < stop <= self.batch:
            raise ValueError(f"PagedKVView.rows: need 0 <= start < stop <= {self.batch}, got [{start}, {stop})")
        return PagedKVView(self.pages, self.start + start, self.start + stop)

    def nbytes(self) -> int:
        return self.pages.nbytes

    def gather(self, layer: int, row: int, length: int):
        """(K, V) of positions [0, length) of ``row`` as dense [Hkv, length, D] copies (tests, debugging)."""
        pages = self.block_tables[row, :-(-length // self.block_size)].long()
        return tuple(t[pages].flatten(0, 1)[:length].transpose(0, 1) for t in (self.k[layer], self.v[layer]))

    def commit(self, accepted: torch.Tensor, num_accepted: torch.Tensor) -> None:
        """Keep each row's accepted tree path (root included); lens += num_accepted + 1."""
        paged_ops.kv_commit_paged(self.k, self.v, self.block_tables, self.lens, accepted, num_accepted)

    def reset(self, rows: Optional[List[int]] = None) -> None:
        """Lengths to 0 (timing passes on rows that hold no request; blocks are untouched)."""
        idx = slice(None) if rows is None else torch.as_tensor(list(rows), dtype=torch.long, device=self.device)
        self.lens[idx] = 0
