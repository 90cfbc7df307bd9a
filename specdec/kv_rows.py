"""The Engine's KV rows: a dense :class:`~specdec.cache.StaticKVCache`, or a paged cache with
automatic prefix caching (:class:`PagedRows`).

Both keep the Engine's row discipline: the active requests sit in rows 0..b-1, a step runs on
``view(b)``, a retired row's hole is filled by moving the last row into it (``move``).

Paged (the default when the target supports it, see ``HFCausalLM.supports_paged``):

* memory is a pool of blocks of ``block_size`` positions shared by every row; a request holds
  the blocks its committed positions plus the next step's tree (``reserve`` positions, the
  drafter's ``max_nodes``) need, and grows by blocks as it decodes (:meth:`PagedRows.reserve`);
* admission is by free blocks (:meth:`PagedRows.admit`), not by worst-case rows;
* prefix caching: once a request is prefilled, the full blocks of its prefilled tokens carry an
  exact key (the previous block's key serial + the block's tokens); a later request whose
  tokens start with the same blocks shares them (reference counts) and prefills only the rest.
  Unreferenced cached blocks stay in the pool and are evicted least recently used first when
  blocks run out. Only FULL blocks below the request's first written position are shared, and
  every write of a step (its tree nodes, the commit) lies at or after that position, so no
  request ever writes a block another one reads (no copy-on-write is needed);
* moving a row moves its block-table row, not its K/V.
"""
from __future__ import annotations

from typing import Dict, Hashable, List, Optional, Sequence, Tuple

from specdec.cache import RowViews, StaticKVCache, move_cache_rows
from specdec.paged_cache import OutOfBlocks, PagedKVCache, PagedKVView

__all__ = ["DenseRows", "PagedRows", "make_rows"]


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def _block_bytes(target, block_size: int) -> int:
    """The target's K/V bytes of one block over every layer (and the hidden states it keeps for a feature head)."""
    width = getattr(target, "hidden_width", 0) if getattr(target, "hidden_spec", None) is not None else 0
    return PagedKVCache.bytes_per_block(target.num_layers, target.num_kv_heads, target.head_dim, block_size,
                                        target.dtype, feature_dim=width)


class DenseRows:
    """Rows of a StaticKVCache of ``max_batch`` x ``capacity`` positions (every row reserved up front)."""

    paged = False

    def __init__(self, target, max_batch: int, capacity: int) -> None:
        self.cache: StaticKVCache = target.new_cache(max_batch, capacity)
        self._view = RowViews(self.cache)

    def view(self, b: int):
        return self._view(b)

    def admit(self, rid: Hashable, row: int, tokens: Sequence[int], active: int) -> Optional[int]:
        return 0  # every row has its positions already

    def register(self, rid: Hashable, tokens: Sequence[int]) -> None:
        pass

    def reserve(self, rows: Sequence[Tuple[Hashable, int]]) -> bool:
        return True

    def release(self, rid: Hashable) -> None:
        pass

    def move(self, moves: Sequence[Tuple[int, int, int]], rids: Sequence[Hashable]) -> None:
        move_cache_rows(self.cache, moves)

    def fits(self, positions: int) -> bool:
        return positions <= self.cache.capacity

    def stats(self) -> Dict[str, object]:
        return {"kv_cache": "dense"}


class PagedRows:
    """Rows of a paged cache: a pool of ``num_blocks`` blocks of ``block_size`` positions.

    ``capacity``: the most positions one request can hold (max_len + the tree's scratch nodes);
    ``reserve``: positions beyond the committed ones each row keeps allocated for the next
    step's tree nodes; ``prefix_caching``: share full prompt blocks between requests.
    """

    paged = True

    def __init__(self, target, max_batch: int, capacity: int, num_blocks: int, block_size: int, reserve: int,
                 prefix_caching: bool = True, draft_bytes_per_block: int = 0) -> None:
        self.block_size = block_size
        self.max_blocks = _ceil_div(capacity, block_size)
        if num_blocks < self.max_blocks:
            raise ValueError(f"Engine: the KV pool of {num_blocks} blocks of {block_size} positions cannot hold one "
                             f"request of {capacity} positions ({self.max_blocks} blocks); raise num_blocks / "
                             f"kv_memory or lower max_len")
        self.cache = target.new_paged_cache(num_blocks, block_size, max_requests=max_batch,
                                            max_blocks_per_request=self.max_blocks)
        self.capacity = self.max_blocks * block_size
        self.bytes_per_block = _block_bytes(target, block_size)
        self.draft_bytes_per_block = int(draft_bytes_per_block)   # a draft model's K/V in the same blocks
        self.reserve_positions = reserve
        self.prefix_caching = prefix_caching
        self._views: Dict[int, PagedKVView] = {}
        self.counters = dict(prefix_queried_tokens=0, prefix_hit_tokens=0)

    @property
    def allocator(self):
        return self.cache.allocator

    def view(self, b: int) -> PagedKVView:
        v = self._views.get(b)
        if v is None:
            v = self._views[b] = self.cache.view(0, b)
        return v

    def fits(self, positions: int) -> bool:
        return positions <= self.capacity

    def _blocks_for(self, positions: int) -> int:
        return _ceil_div(min(positions, self.capacity), self.block_size)

    # ------------------------------------------------------------------ prefix keys
    def _match(self, tokens: Sequence[int]) -> List[int]:
        """Cached blocks holding the longest prefix of full blocks of ``tokens``, at most those wholly
        before the last token (the last token is always computed: its logits are needed)."""
        if not self.prefix_caching:
            return []
        bs, serial, hits = self.block_size, 0, []
        for i in range((len(tokens) - 1) // bs):
            found = self.allocator.lookup((serial, tuple(tokens[i * bs:(i + 1) * bs])))
            if found is None:
                break
            hits.append(found[0])
            serial = found[1]
        return hits

    def register(self, rid: Hashable, tokens: Sequence[int]) -> None:
        """Key the full blocks of ``tokens`` (just prefilled into request ``rid``) for later requests."""
        if not self.prefix_caching:
            return
        bs, serial = self.block_size, 0
        blocks = self.allocator.blocks(rid)
        for i in range(min(len(tokens) // bs, len(blocks))):
            serial = self.allocator.register(blocks[i], (serial, tuple(tokens[i * bs:(i + 1) * bs])))

    # ------------------------------------------------------------------ admission and growth
    def admit(self, rid: Hashable, row: int, tokens: Sequence[int], active: int) -> Optional[int]:
        """Give request ``rid`` row ``row`` with its cached prefix and blocks for ``tokens`` plus the
        reserve; returns the number of cached positions (prefill starts there), or None (nothing
        changed) when the pool lacks the blocks. ``active``: rows already decoding; each keeps one
        step's growth of headroom so that admitting does not force an immediate preemption."""
        hits = self._match(tokens)
        need_total = self._blocks_for(len(tokens) + self.reserve_positions)
        parked = sum(1 for blk in hits if self.allocator.refcount(blk) == 0)
        headroom = active * _ceil_div(self.reserve_positions + 1, self.block_size)
        if need_total - len(hits) + parked + headroom > self.allocator.num_free:
            return None
        self.cache.add(rid, 0, row=row)
        if hits:
            self.allocator.share(rid, hits)
            self.cache.block_tables[row, :len(hits)] = self.cache.block_tables.new_tensor(hits)
        start = len(hits) * self.block_size
        self.cache.cache_lens[row] = start
        self.cache.grow(rid, min(len(tokens) + self.reserve_positions, self.capacity))
        self.counters["prefix_queried_tokens"] += len(tokens)
        self.counters["prefix_hit_tokens"] += start
        return start

    def reserve(self, rows: Sequence[Tuple[Hashable, int]]) -> bool:
        """Grow every (request, committed length) to cover the length plus the reserve: all or nothing;
        False when the pool lacks the blocks (the caller preempts and retries)."""
        need = [(rid, self._blocks_for(n + self.reserve_positions)) for rid, n in rows]
        short = sum(max(0, want - self.allocator.num_blocks_of(rid)) for rid, want in need)
        if short > self.allocator.num_free:
            return False
        for rid, n in rows:
            try:
                self.cache.grow(rid, min(n + self.reserve_positions, self.capacity))
            except OutOfBlocks:  # pragma: no cover - counted above
                return False
        return True

    def release(self, rid: Hashable) -> None:
        self.cache.free(rid)

    def move(self, moves: Sequence[Tuple[int, int, int]], rids: Sequence[Hashable]) -> None:
        """Rows: ``moves`` (src, dst, length) of requests ``rids`` (one per move); the holes are free rows."""
        for (_, dst, _), rid in zip(moves, rids):
            self.cache.move_row(rid, dst)

    def stats(self) -> Dict[str, object]:
        a = self.allocator
        q = self.counters["prefix_queried_tokens"]
        return dict(kv_cache="paged", block_size=self.block_size, kv_blocks_total=a.num_blocks,
                    kv_bytes_per_block=self.bytes_per_block, draft_kv_bytes_per_block=self.draft_bytes_per_block,
                    kv_blocks_used=a.num_used, kv_blocks_free=a.num_free, kv_blocks_cached=a.num_cached,
                    prefix_cache_hit_rate=self.counters["prefix_hit_tokens"] / q if q else 0.0,
                    prefix_cache_evictions=a.evictions, **self.counters)


def make_rows(target, kv_cache: Optional[str], max_batch: int, capacity: int, reserve: int, block_size: int,
              num_blocks: Optional[int], kv_memory: Optional[float], prefix_caching: bool, owner: str = "Engine",
              draft_bytes_per_block: int = 0):
    """The rows an Engine uses: ``kv_cache`` "paged" / "dense" / None (paged when the target supports it).

    Paged pool size: ``num_blocks``, else ``kv_memory`` bytes, else the dense cache's footprint
    (``max_batch`` x ``capacity`` positions). ``draft_bytes_per_block``: a draft model's K/V kept in the
    same blocks (specdec.draft_pages); ``kv_memory`` then covers both."""
    if kv_cache not in (None, "paged", "dense"):
        raise ValueError(f"{owner}: kv_cache must be 'paged', 'dense' or None, got {kv_cache!r}")
    supports = bool(getattr(target, "supports_paged", False))
    if kv_cache == "paged" and not supports:
        raise ValueError(f"{owner}: kv_cache='paged' needs a target with new_paged_cache (HFCausalLM on the lean or "
                         f"hooked path without sliding-window layers); {type(target).__name__} has none")
    if kv_cache == "dense" or not supports:
        return DenseRows(target, max_batch, capacity)
    if block_size < 1:
        raise ValueError(f"{owner}: block_size must be >= 1, got {block_size}")
    if num_blocks is None:
        if kv_memory is not None:
            per = _block_bytes(target, block_size) + int(draft_bytes_per_block)
            num_blocks = int(kv_memory // per) - 1   # the scratch page is one more block of the same size
        else:
            num_blocks = max_batch * _ceil_div(capacity, block_size)
    return PagedRows(target, max_batch, capacity, int(num_blocks), block_size, reserve, prefix_caching,
                     draft_bytes_per_block)
