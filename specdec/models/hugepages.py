"""Model weights in transparent huge pages (Linux): the CPU decode step streams them faster.

A decode step reads every weight once. On the CPU each linear layer's weight is a separate
allocation of 4 KiB pages, and each thread streams a slice of it between two parallel regions, so
the step pays TLB misses on every slice. Copying the weights into one anonymous private mapping
advised ``MADV_HUGEPAGE`` (2 MiB pages) changes no value and no result bit.
``benchmarks/bench_forward.py`` runs the bundled model both ways (its "4k pages" row).
"""
from __future__ import annotations

import mmap
import sys
import threading
from typing import List, Optional

import torch

_ALIGN = 4096
_HUGE = 2 << 20          # a huge page
_CHUNK = 32 << 20        # the arena's mappings: 16 huge pages each (a larger tensor gets a mapping of its own)


def weights_to_hugepages(model: torch.nn.Module, min_bytes: int = 64 << 10) -> int:
    """Move ``model``'s CPU parameters and buffers of at least ``min_bytes`` into one huge-page mapping.

    Each tensor keeps its dtype, shape and values (``param.data`` / the buffer is re-pointed to a
    view of the mapping; tied parameters stay tied); the mapping lives as long as any view of it (the
    views hold it; nothing is attached to the model, which stays deep-copyable: a copy gets ordinary
    allocations). Returns the bytes moved: 0 where the platform has no ``MADV_HUGEPAGE`` (not Linux) or
    when nothing qualifies; a second call moves the weights into a new mapping and frees the old one.
    Call it before wrapping the model (``HFCausalLM`` reads the weights it is given) and before other
    code keeps references to the old tensors, which would keep their memory alive too.
    """
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"weights_to_hugepages: model must be a torch.nn.Module, got {type(model).__name__}")
    if not isinstance(min_bytes, int) or min_bytes < 1:
        raise ValueError(f"weights_to_hugepages: min_bytes must be a positive int, got {min_bytes!r}")
    advice = getattr(mmap, "MADV_HUGEPAGE", None)
    if advice is None or not sys.platform.startswith("linux"):
        return 0
    slots: List[tuple] = []  # (module, name, key, is_param); key = the tensor's (address, dtype, shape) now
    seen = set()
    tensors = []
    for module in model.modules():
        for name, t in list(module._parameters.items()) + list(module._buffers.items()):
            if t is None or t.device.type != "cpu" or t.is_sparse or t.is_quantized or not t.is_contiguous():
                continue
            if t.numel() * t.element_size() < min_bytes:
                continue
            key = (t.data_ptr(), t.dtype, tuple(t.shape))
            slots.append((module, name, key, name in module._parameters))
            if key not in seen:  # a tied parameter is moved once
                seen.add(key)
                tensors.append(t)
    if not tensors:
        return 0
    sizes = [(t.numel() * t.element_size() + _ALIGN - 1) // _ALIGN * _ALIGN for t in tensors]
    mm = mmap.mmap(-1, sum(sizes), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    mm.madvise(advice)
    buf = torch.frombuffer(mm, dtype=torch.uint8)
    moved = {}
    off = 0
    for t, size in zip(tensors, sizes):
        n = t.numel() * t.element_size()
        view = buf[off:off + n].view(t.dtype).view(t.shape)
        view.copy_(t.detach())
        moved[(t.data_ptr(), t.dtype, tuple(t.shape))] = view
        off += size
    total = sum(t.numel() * t.element_size() for t in tensors)
    for module, name, key, is_param in slots:
        view = moved[key]
        if is_param:
            module._parameters[name].data = view
        else:
            module._buffers[name] = view
    return total


class _Arena:
    """Tensors copied into shared huge-page mappings: chunks of ``_CHUNK`` bytes advised MADV_HUGEPAGE,
    handed out in order at 4 KiB-aligned offsets. A chunk lives as long as any tensor in it (each is a
    view of the chunk's buffer); nothing is ever freed inside a chunk."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.buf: Optional[torch.Tensor] = None   # the open chunk's bytes (uint8 over the mapping)
        self.off = 0

    def take(self, nbytes: int) -> Optional[torch.Tensor]:
        advice = getattr(mmap, "MADV_HUGEPAGE", None)
        if advice is None or not sys.platform.startswith("linux"):
            return None
        size = (nbytes + _ALIGN - 1) // _ALIGN * _ALIGN
        with self.lock:
            if size > _CHUNK // 2:  # a large tensor: its own mapping, rounded to whole huge pages
                return self._map((size + _HUGE - 1) // _HUGE * _HUGE, advice)[:nbytes]
            if self.buf is None or self.off + size > self.buf.numel():
                self.buf, self.off = self._map(_CHUNK, advice), 0
            out = self.buf[self.off:self.off + nbytes]
            self.off += size
            return out

    @staticmethod
    def _map(nbytes: int, advice: int) -> torch.Tensor:
        mm = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        mm.madvise(advice)
        return torch.frombuffer(mm, dtype=torch.uint8)


_ARENA = _Arena()


def hugepage_copy(t: torch.Tensor) -> torch.Tensor:
    """A contiguous copy of the CPU tensor ``t`` in huge pages (same dtype, shape and values), for weights
    that code derives after loading (the packed layouts of :func:`specdec.ops.pack_q8act`), which
    :func:`weights_to_hugepages` does not see. Small tensors share 32 MiB mappings; the memory of one
    lives as long as any tensor in its mapping. Returns ``t`` itself where there is nothing to gain or
    no ``MADV_HUGEPAGE`` (not Linux, a non-CPU or non-contiguous tensor, fewer than 64 KiB)."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"hugepage_copy: t must be a torch.Tensor, got {type(t).__name__}")
    n = t.numel() * t.element_size()
    if t.device.type != "cpu" or not t.is_contiguous() or t.is_sparse or t.is_quantized or n < (64 << 10):
        return t
    raw = _ARENA.take(n)
    if raw is None:
        return t
    out = raw.view(t.dtype).view(t.shape)
    out.copy_(t.detach())
    return out
