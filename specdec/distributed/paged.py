"""The tensor-parallel target on a paged KV cache.

Rank 0 keeps the block allocator, the block tables and the lengths (the Engine's paged rows drive
them exactly as for a single-process target: admission, growth, prefix sharing, preemption, row
moves); every rank keeps page pools of its own KV heads under the same block ids. Each control
message carries the current block tables and lengths, so growth, frees, shared prefixes and row
moves (which change only tables and lengths) need no message of their own. A commit moves K/V
inside the pools: it is journaled with the block-table rows and lengths it saw and replayed on
every rank before the next call, as the dense shard's commits are (:mod:`.target`).
"""
from __future__ import annotations

from typing import Optional

import torch

from specdec import paged_ops
from specdec.paged_cache import PagedKVCache, PagedKVView

__all__ = ["ShardPagedCache", "ShardPagedView", "replay_commit", "lens_of"]


class ShardPagedCache(PagedKVCache):
    """Rank 0's part of a tensor-parallel paged cache: its pools (its KV heads), the allocator, the
    block tables and the lengths every rank uses. Made by ``TensorParallelLM.new_paged_cache``."""

    _tp = None
    _cid = -1

    @property
    def lens(self) -> torch.Tensor:
        return self.cache_lens

    def view(self, start: int = 0, stop: Optional[int] = None) -> "ShardPagedView":
        return ShardPagedView(self, start, self.max_requests if stop is None else stop)

    def fork(self, parent, child) -> int:
        raise NotImplementedError("ShardPagedCache.fork: copying a partial block is not replayed on the other "
                                  "ranks of a tensor-parallel target; share full blocks (prefix caching) instead")


class ShardPagedView(PagedKVView):
    """Rows of a :class:`ShardPagedCache` as the models read a cache; ``commit`` is journaled for the
    other ranks."""

    def __init__(self, cache: ShardPagedCache, start: int, stop: int) -> None:
        super().__init__(cache, start, stop)
        self._tp, self._cid, self._row0 = cache._tp, cache._cid, start

    def commit(self, accepted: torch.Tensor, num_accepted: torch.Tensor) -> None:
        if self._tp is not None and self._tp.world_size > 1:
            seen = (self.block_tables.cpu().clone(), self.lens.cpu().clone(), accepted.cpu().clone(),
                    num_accepted.cpu().clone())
            self._tp._journal.append(("pcommit", self._cid, self._row0, self.batch, None, seen))
        super().commit(accepted, num_accepted)


def replay_commit(cache: PagedKVCache, seen) -> None:
    """Another rank: a journaled commit on its own pools, with the tables and lengths rank 0 saw."""
    tables, lens, accepted, num = (t.to(cache.device) for t in seen)
    paged_ops.kv_commit_paged(cache.k_pages, cache.v_pages, tables, lens.clone(), accepted, num)


def lens_of(cache) -> torch.Tensor:
    """The lengths tensor of a dense shard (``lens``) or of a paged one (``cache_lens``)."""
    return cache.cache_lens if isinstance(cache, PagedKVCache) else cache.lens
