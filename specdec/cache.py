"""StaticKVCache: preallocated per-layer K/V plus per-request lengths, all on the device.

Layout per layer: ``k[l], v[l]`` of shape [B, Hkv, S, D] (contiguous), and
``lens`` [B] int32: positions < lens[b] of request b are committed. During a
speculative step the N tree nodes of request b are written at lens[b] + j
(``append_kv``) without moving ``lens``; ``commit`` then compacts the accepted path
in place (``kv_commit``) and advances ``lens``. Nothing here synchronises with the
host except the explicit capacity check helpers, which callers use once per step.
"""
from __future__ import annotations

from typing import Dict, List, Optional, Sequence, Tuple

import torch

from specdec import ops


class StaticKVCache:
    """Per-layer K/V caches [B, Hkv, S, D] and lengths [B] (int32), preallocated once."""

    def __init__(self, num_layers: int, batch: int, num_kv_heads: int, head_dim: int, capacity: int,
                 dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu") -> None:
        for name, value in (("num_layers", num_layers), ("batch", batch), ("num_kv_heads", num_kv_heads),
                            ("head_dim", head_dim), ("capacity", capacity)):
            if int(value) < 1:
                raise ValueError(f"StaticKVCache: {name} must be >= 1, got {value}")
        self.num_layers = int(num_layers)
        self.batch = int(batch)
        self.num_kv_heads = int(num_kv_heads)
        self.head_dim = int(head_dim)
        self.capacity = int(capacity)
        self.dtype = dtype
        self.device = torch.device(device)
        shape = (self.batch, self.num_kv_heads, self.capacity, self.head_dim)
        self.k: List[torch.Tensor] = [torch.zeros(shape, dtype=dtype, device=self.device) for _ in range(num_layers)]
        self.v: List[torch.Tensor] = [torch.zeros(shape, dtype=dtype, device=self.device) for _ in range(num_layers)]
        self.lens = torch.zeros(self.batch, dtype=torch.int32, device=self.device)  # [B]

    def rows(self, start: int, stop: int) -> "StaticKVCache":
        """A cache over requests [start, stop) sharing this cache's storage (views, no copy)."""
        if not 0 <= start < stop <= self.batch:
            raise ValueError(f"StaticKVCache.rows: need 0 <= start < stop <= {self.batch}, got [{start}, {stop})")
        view = StaticKVCache.__new__(StaticKVCache)
        view.__dict__.update(self.__dict__)
        view.batch = stop - start
        view.k = [t[start:stop] for t in self.k]  # slices along dim 0 of contiguous tensors stay contiguous
        view.v = [t[start:stop] for t in self.v]
        view.lens = self.lens[start:stop]
        return view

    # ------------------------------------------------------------------ size
    def nbytes(self) -> int:
        """Bytes held by the K/V tensors."""
        return sum(t.numel() * t.element_size() for t in self.k + self.v)

    def check_room(self, needed: torch.Tensor | Sequence[int] | int, rows: Optional[Sequence[int]] = None) -> None:
        """Raise ValueError naming the request when lens[b] + needed exceeds the capacity.

        ``needed``: new positions each request is about to write (scalar or per row).
        Reads ``lens`` on the host (one sync); callers do this once per step at most.
        """
        lens = self.lens.tolist()
        rows = range(self.batch) if rows is None else rows
        if isinstance(needed, int):
            need = {b: needed for b in rows}
        else:
            vals = needed.tolist() if isinstance(needed, torch.Tensor) else list(needed)
            need = {b: int(vals[i]) for i, b in enumerate(rows)} if len(vals) != self.batch else \
                {b: int(vals[b]) for b in rows}
        for b in rows:
            if lens[b] + need[b] > self.capacity:
                raise ValueError(f"StaticKVCache: request {b} holds {lens[b]} positions and needs {need[b]} more, "
                                 f"past the capacity of {self.capacity}")

    # ------------------------------------------------------------------ updates
    def append(self, layer: int, k_new: torch.Tensor, v_new: torch.Tensor) -> None:
        """Write k_new / v_new [B, Hkv, N, D] of one layer at lens[b] + j (lens unchanged)."""
        ops.append_kv(self.k[layer], self.v[layer], k_new, v_new, self.lens)

    def commit(self, accepted: torch.Tensor, num_accepted: torch.Tensor) -> None:
        """Keep the accepted tree path (root included) of every request; lens += num_accepted + 1."""
        ops.kv_commit(self.k, self.v, self.lens, accepted, num_accepted)

    def rewind(self, lens: torch.Tensor | Sequence[int]) -> None:
        """Truncate: set the committed lengths (only shrinking is allowed)."""
        new = torch.as_tensor(lens, dtype=torch.int32).to(self.device)
        if new.shape != self.lens.shape:
            raise ValueError(f"StaticKVCache.rewind: lens must have shape {tuple(self.lens.shape)}, "
                             f"got {tuple(new.shape)}")
        if bool((new < 0).any()) or bool((new > self.lens).any()):
            raise ValueError(f"StaticKVCache.rewind: new lengths {new.tolist()} must lie in [0, current lengths "
                             f"{self.lens.tolist()}]")
        self.lens.copy_(new)

    def reset(self, rows: Optional[Sequence[int]] = None) -> None:
        """Forget requests (all by default): their lengths go to 0."""
        if rows is None:
            self.lens.zero_()
        else:
            self.lens[torch.as_tensor(list(rows), dtype=torch.long, device=self.device)] = 0


def move_cache_rows(cache, moves: Sequence[Tuple[int, int, int]]) -> None:
    """Copy the first ``length`` positions and the length of row ``src`` into row ``dst`` of a StaticKVCache.
    A cache with its own ``move_rows`` (a tensor-parallel shard: every rank moves its rows) does it itself."""
    own = getattr(cache, "move_rows", None)
    if own is not None:
        own(moves)
        return
    for src, dst, length in moves:
        if src == dst:
            continue
        n = min(int(length), cache.capacity)
        for t in cache.k + cache.v + list(getattr(cache, "extra", ())):  # extra: e.g. HiddenKVCache's states
            t[dst, :, :n].copy_(t[src, :, :n])
        cache.lens[dst] = cache.lens[src]


class RowViews:
    """Memo of the prefix views ``cache.rows(0, b)``: the first b rows of a cache, one view per b.

    The engine and a draft model step on the active rows only; a view shares the cache's storage,
    so building it once per row count keeps the step free of per-step tensor construction."""

    def __init__(self, cache: StaticKVCache) -> None:
        self.cache = cache
        self._views: Dict[int, StaticKVCache] = {}

    def __call__(self, b: int) -> StaticKVCache:
        view = self._views.get(b)
        if view is None:
            view = self._views[b] = self.cache.rows(0, b)
        return view
