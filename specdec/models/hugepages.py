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
from typing import List

import torch

_ALIGN = 4096


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
