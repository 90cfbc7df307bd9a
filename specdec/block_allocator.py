"""The block allocator of a paged KV cache (:class:`specdec.paged_cache.PagedKVCache`).

:class:`BlockAllocator` hands out blocks (pages) of a fixed pool: a free list, the block list
of every request, and a reference count per block so that requests can share blocks (a
forked request, a common prefix). A block returns to the free list when its last reference
goes; a block that carries a prefix key is parked instead and evicted least recently used.
"""
from __future__ import annotations

from collections import OrderedDict
from typing import Dict, Hashable, List, Optional, Tuple

from specdec._check import check_int

__all__ = ["BlockAllocator", "OutOfBlocks"]


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
