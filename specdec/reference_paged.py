"""Pure-torch oracles of the paged KV ops (``specdec.paged_ops``).

Layout (NHD): ``k_pages`` / ``v_pages`` [num_pages, page_size, Hkv, D] (any strides: HND pages'
``transpose(1, 2)`` views are read and written in place); ``block_tables``
[B, max_blocks] int32; position ``s`` of request ``b`` sits in page
``block_tables[b, s // page_size]``, slot ``s % page_size``. Each oracle gathers a request's
positions into the dense layout and runs :mod:`specdec.reference` on it, so paged and dense
references agree by construction.
"""
from __future__ import annotations

from types import SimpleNamespace
from typing import Optional, Sequence

import torch

from specdec import reference

__all__ = ["slots", "gather_dense", "verify_attention_paged", "append_kv_paged", "kv_commit_paged"]


def slots(block_tables: torch.Tensor, b: int, positions: torch.Tensor, page_size: int) -> torch.Tensor:
    """Flat slot indices (page * page_size + offset) of ``positions`` of request ``b``."""
    positions = positions.to(torch.long)
    pages = block_tables[b].to(torch.long)[positions // page_size]
    return pages * page_size + positions % page_size


def gather_dense(pages: torch.Tensor, block_tables: torch.Tensor, b: int, length: int) -> torch.Tensor:
    """Positions [0, length) of request ``b`` as a dense [Hkv, length, D] tensor."""
    ps = pages.shape[1]
    idx = slots(block_tables, b, torch.arange(length, device=pages.device), ps)
    return pages[idx // ps, idx % ps].transpose(0, 1)


def verify_attention_paged(q: torch.Tensor, k_pages: torch.Tensor, v_pages: torch.Tensor,
                           block_tables: torch.Tensor, cache_lens: torch.Tensor,
                           tree_mask: Optional[torch.Tensor], scale: float) -> torch.Tensor:
    """:func:`specdec.reference.verify_attention` over a paged cache (same arguments, same result)."""
    B, N = q.shape[:2]
    Nkv = N if tree_mask is None else tree_mask.shape[2]
    outs = []
    for b in range(B):
        T = int(cache_lens[b]) + Nkv
        k = gather_dense(k_pages, block_tables, b, T)[None]
        v = gather_dense(v_pages, block_tables, b, T)[None]
        mask = None if tree_mask is None else tree_mask[b:b + 1]
        outs.append(reference.verify_attention(q[b:b + 1], k, v, cache_lens[b:b + 1], mask, scale))
    return torch.cat(outs, 0)


def append_kv_paged(k_pages: torch.Tensor, v_pages: torch.Tensor, k_new: torch.Tensor, v_new: torch.Tensor,
                    block_tables: torch.Tensor, cache_lens: torch.Tensor, offset: int = 0) -> None:
    """Write k_new / v_new [B, Hkv, N, D] at positions cache_lens[b] + offset + j (in place)."""
    ps = k_pages.shape[1]
    B, _, N, _ = k_new.shape
    for b in range(B):
        pos = int(cache_lens[b]) + int(offset) + torch.arange(N, device=k_pages.device)
        idx = slots(block_tables, b, pos, ps)
        k_pages[idx // ps, idx % ps] = k_new[b].transpose(0, 1)  # index_put_ on the pools' own memory
        v_pages[idx // ps, idx % ps] = v_new[b].transpose(0, 1)


def kv_commit_paged(k_pages: Sequence[torch.Tensor], v_pages: Sequence[torch.Tensor], block_tables: torch.Tensor,
                    cache_lens: torch.Tensor, accepted: torch.Tensor, num_accepted: torch.Tensor) -> None:
    """Compact the accepted path through the block tables, then cache_lens += num_accepted + 1."""
    for b in range(cache_lens.shape[0]):
        L, n = int(cache_lens[b]), int(num_accepted[b])
        for pages in list(k_pages) + list(v_pages):
            ps = pages.shape[1]
            # ascending order is overlap-safe: accepted is increasing and accepted[b, i] >= i
            for i in range(1, n + 1):
                src = int(accepted[b, i])
                if src != i:
                    dst_slot, src_slot = slots(block_tables, b, torch.tensor([L + i, L + src]), ps).tolist()
                    pages[dst_slot // ps, dst_slot % ps] = pages[src_slot // ps, src_slot % ps]
        cache_lens[b] = L + n + 1


def decoder_layer_paged(x, h, weights, scales, mins, biases, bits, post_norm_weight, post_norm_eps,
                        next_norm_weight, next_norm_eps, k_pages, v_pages, block_tables, cache_lens, cos, sin,
                        tree_mask, kv_offset, scale, num_heads, num_kv_heads):
    """specdec.paged_ops.decoder_layer_paged from the reference ops (the dense layer's sequence with the paged
    append / attention)."""
    impl = SimpleNamespace(
        linear=reference.linear, qlinear=reference.qlinear, rope=reference.rope, add_rms_norm=reference.add_rms_norm,
        silu_mul=reference.silu_mul,
        append_kv=lambda kp, vp, k, v, lens, off: append_kv_paged(kp, vp, k, v, block_tables, lens, off),
        verify_attention=lambda q, kp, vp, lens, mask, sc: verify_attention_paged(q, kp, vp, block_tables, lens,
                                                                                  mask, sc))
    return reference.decoder_layer_with(impl, x, h, weights, scales, mins, biases, bits, post_norm_weight,
                                        post_norm_eps, next_norm_weight, next_norm_eps, k_pages, v_pages, cache_lens,
                                        cos, sin, tree_mask, kv_offset, scale, num_heads, num_kv_heads)
