"""A draft model's K/V in the target's pages: one pool budget for target and draft.

A :class:`DraftPages` pairs page pools of the draft model's shape with a target
:class:`~specdec.paged_cache.PagedKVCache`: block ``i`` of the draft pools holds the draft's K/V of
the same positions block ``i`` of the target's pools holds. The two share the block allocator, the
block tables and the request rows (the target's cache admits, grows, moves and frees them); the
draft owns its pools and its lengths (a draft cache lags or leads the target's by a few positions
inside a step). So a block costs target + draft bytes, admission and preemption count one pool,
and a prefix-cached block can carry the draft's K/V of its positions too.

The draft stays lazy (a request it never drafts for costs no draft prefill), so a shared block's
draft K/V is valid only once some request's draft has written it: :meth:`DraftPages.mark_valid`
records, per block, the serial of the prefix key it had when the draft wrote all of its positions
(a serial is never reused, and an evicted key takes its serial with it). A request's first
draft catch-up starts after its leading run of valid shared blocks (:meth:`valid_prefix`) and
prefills the rest. So a block's draft part is read only once valid, and written only while no
request reads it -- except by two requests catching up over the same not-yet-valid block in one
call, which write the same tokens at the same positions (bit for bit on the CPU, whose ops give a
row's result independently of the batch). Every later draft write lies after the row's prompt
blocks, as the target's do (docs/paged.md).
"""
from __future__ import annotations

from typing import Dict, List, Optional, Sequence, Tuple

import torch

from specdec._check import check_int
from specdec.paged_cache import PagedKVCache, PagedKVView

__all__ = ["DraftPages", "DraftPagesView"]


class DraftPages:
    """Page pools of a draft model's shape over the blocks, block tables and rows of ``pages``.

    Only the target's cache changes rows and blocks (``add`` / ``grow`` / ``free`` / ``move_row``);
    :meth:`view` gives the rows as the models read a cache, with the draft's own lengths."""

    paged = True
    feature_dim = 0   # a draft model's pages keep no features (PagedKVCache's extra pools: none)
    extra_k: list = []
    extra_v: list = []

    def __init__(self, pages: PagedKVCache, num_layers: int, num_kv_heads: int, head_dim: int,
                 dtype: torch.dtype = torch.float32) -> None:
        owner = "DraftPages"
        if not isinstance(pages, PagedKVCache):
            raise TypeError(f"{owner}: pages must be a specdec.PagedKVCache, got {type(pages).__name__}")
        for name, v in (("num_layers", num_layers), ("num_kv_heads", num_kv_heads), ("head_dim", head_dim)):
            check_int(owner, name, v, lo=1)
        if dtype not in (torch.float32, torch.float16, torch.bfloat16):
            raise TypeError(f"{owner}: dtype must be torch.float32, float16 or bfloat16, got {dtype}")
        self.target_pages = pages
        self.num_layers, self.num_kv_heads, self.head_dim = num_layers, num_kv_heads, head_dim
        self.block_size, self.max_requests, self.max_blocks = pages.block_size, pages.max_requests, pages.max_blocks
        self.dtype, self.device, self.pad = dtype, pages.device, pages.pad
        # as many pages as the target's pools (its scratch page included): block ids are shared
        shape = (pages.k_pages[0].shape[0], self.block_size, num_kv_heads, head_dim)
        self.k_pages = [torch.zeros(shape, dtype=dtype, device=self.device) for _ in range(num_layers)]
        self.v_pages = [torch.zeros(shape, dtype=dtype, device=self.device) for _ in range(num_layers)]
        self.block_tables = pages.block_tables           # the same tensor: row moves and frees apply to both
        self.cache_lens = torch.zeros(self.max_requests, dtype=torch.int32, device=self.device)
        self._valid: Dict[int, int] = {}   # block -> serial of its prefix key when the draft filled it

    @property
    def allocator(self):
        return self.target_pages.allocator

    @property
    def capacity(self) -> int:
        return self.target_pages.capacity

    @property
    def num_blocks(self) -> int:
        return self.target_pages.num_blocks

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.k_pages + self.v_pages)

    def bytes_per_block(self) -> int:
        return PagedKVCache.bytes_per_block(self.num_layers, self.num_kv_heads, self.head_dim, self.block_size,
                                            self.dtype)

    def _keyed_blocks(self, row: int, length: int) -> List[Tuple[int, Optional[int]]]:
        blocks = self.block_tables[row, :length // self.block_size].tolist()
        return [(b, self.allocator.serial_of(b)) for b in blocks]

    def valid_prefix(self, row: int, limit: int) -> int:
        """Positions (whole blocks, at most ``limit``) at the start of ``row`` whose draft K/V is valid."""
        n = 0
        for blk, serial in self._keyed_blocks(row, max(0, limit)):
            if serial is None or self._valid.get(blk) != serial:
                break
            n += 1
        return n * self.block_size

    def mark_valid(self, row: int, length: int) -> None:
        """The draft K/V of positions [0, length) of ``row`` is written: its keyed full blocks are valid."""
        for blk, serial in self._keyed_blocks(row, length):
            if serial is not None:
                self._valid[blk] = serial

    def view(self, start: int = 0, stop=None) -> "DraftPagesView":
        return DraftPagesView(self, start, self.max_requests if stop is None else stop)


class DraftPagesView(PagedKVView):
    """Rows of a :class:`DraftPages` as the models read a cache (see PagedKVView). ``move_rows`` moves
    the draft's lengths only: the block-table rows are the target's, already moved by its cache."""

    def move_rows(self, moves: Sequence[Tuple[int, int, int]]) -> None:
        for src, dst, _ in moves:
            if src != dst:
                self.lens[dst] = self.lens[src]
