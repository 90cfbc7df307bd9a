"""FlashInfer's paged-KV metadata onto specdec's paged ops (re-exported by
:mod:`specdec.compat.flashinfer`).

FlashInfer describes a batch's KV by ``kv_indptr [B + 1]``, ``kv_indices [kv_indptr[-1]]`` and
``kv_last_page_len [B]`` (int32): request b owns pages ``kv_indices[kv_indptr[b]:kv_indptr[b + 1]]``
in position order and holds ``kv_len[b] = (num_pages_b - 1) * page_size + kv_last_page_len[b]``
tokens (0 when it owns no page). Pages are NHD ``[num_pages, page_size, Hkv, D]`` or HND
``[num_pages, Hkv, page_size, D]``, one (k, v) pair per layer. Attention runs AFTER the step's
tokens are appended, so ``kv_len`` counts them. A tree mask is FlashInfer's ``custom_mask``: per
request a bool ``[qo_len, kv_len]`` matrix, flattened and concatenated, request b starting at
``mask_indptr[b]``.

specdec's paged ops take NHD pages, a block table and the committed length; this module converts:
row b of the block table is request b's page list (padded with -1), ``cache_lens = kv_len -
num_new``. Every pool is used in place, whatever its layout: NHD pages as they are, HND pages as
their ``transpose(1, 2)`` view, a combined ``[num_pages, 2, ...]`` pool as its two halves (specdec's
paged ops take any strides with D contiguous; only a pool whose D is strided is copied, and written
back after a write). A dense
:class:`specdec.cache.StaticKVCache` ``[B, Hkv, S, D]`` is exactly HND with one page of S slots per
row (:func:`dense_as_paged`).
"""
from __future__ import annotations

import itertools
from typing import List, NamedTuple, Optional, Sequence, Tuple

import torch

from specdec import paged_ops
from specdec.compat.common import INTS, check_tensor, fail

__all__ = ["PagedMetadata", "dense_as_paged", "to_block_table", "kv_lens_to_metadata", "tree_mask_from_custom",
           "unpack_custom_mask",
           "verify_attention_paged", "append_paged_kv_cache", "commit_paged_kv"]


class PagedMetadata(NamedTuple):
    """FlashInfer's page metadata: ``kv_indptr [B + 1]``, ``kv_indices``, ``kv_last_page_len [B]``
    (int32) and the page size."""
    kv_indptr: torch.Tensor
    kv_indices: torch.Tensor
    kv_last_page_len: torch.Tensor
    page_size: int


def dense_as_paged(cache, num_new: int = 0) -> Tuple[PagedMetadata, List[Tuple[torch.Tensor, torch.Tensor]]]:
    """A dense ``StaticKVCache`` as FlashInfer paged metadata (HND, page size = capacity S).

    Row b is page b; ``kv_len[b] = cache.lens[b] + num_new`` (the step's appended tokens counted,
    as FlashInfer's attention expects). Returns ``(metadata, [(k[l], v[l]) per layer])``: the
    pools are the cache's own tensors (``[B, Hkv, S, D]`` = HND pages), no copy.
    """
    fn = "specdec.compat.flashinfer.dense_as_paged"
    lens = cache.lens.to(torch.int64) + int(num_new)
    S = int(cache.capacity)
    if bool((lens > S).any()):
        fail(fn, "num_new", f"such that cache.lens + num_new <= capacity {S}", str(int(num_new)))
    has = lens > 0
    indptr = torch.zeros(cache.batch + 1, dtype=torch.int32, device=lens.device)
    indptr[1:] = has.to(torch.int32).cumsum(0)
    indices = torch.arange(cache.batch, dtype=torch.int32, device=lens.device)[has]
    meta = PagedMetadata(indptr, indices, lens.to(torch.int32), S)
    return meta, list(zip(cache.k, cache.v))


def metadata_lens(fn, kv_indptr, kv_indices, kv_last_page_len, page_size):
    """The metadata checked on the host (one read of each small tensor): (indptr, pages per
    request, kv_len per request) as lists of ints."""
    check_tensor(fn, "kv_indptr", kv_indptr, 1, INTS)
    B = kv_indptr.shape[0] - 1
    if B < 0:
        fail(fn, "kv_indptr", "[B + 1] with B >= 0", "an empty tensor")
    check_tensor(fn, "kv_indices", kv_indices, 1, INTS)
    check_tensor(fn, "kv_last_page_len", kv_last_page_len, 1, INTS, (B,))
    ip = kv_indptr.tolist()
    npages = [b - a for a, b in zip(ip, ip[1:])]
    if B and (ip[0] != 0 or min(npages) < 0 or ip[-1] > kv_indices.shape[0]):
        fail(fn, "kv_indptr", f"0-based and non-decreasing, ending <= len(kv_indices) = {kv_indices.shape[0]}",
             str(ip))
    last = kv_last_page_len.tolist()
    for b, (n, x) in enumerate(zip(npages, last)):
        if (n > 0 and not 1 <= x <= page_size) or (n == 0 and x != 0):
            fail(fn, f"kv_last_page_len[{b}]", f"in [1, {page_size}] (0 for a request without pages)", str(x))
    return ip, npages, [(n - 1) * page_size + x if n > 0 else 0 for n, x in zip(npages, last)]


def pages_table(ip, npages, kv_indices, width):
    """[B, width] int32 block table on kv_indices' device, -1 past each request's pages (a view of
    kv_indices when every request holds ``width`` pages back to back)."""
    B = len(npages)
    dev = kv_indices.device
    if B and width == npages[0] and min(npages) == width and ip == list(range(0, (B + 1) * width, width)):
        return kv_indices[:B * width].view(B, width).to(torch.int32).contiguous()  # every request at `width` pages
    if not kv_indices.numel():
        return torch.full((B, width), -1, dtype=torch.int32, device=dev)
    col = torch.arange(width, device=dev)[None, :]
    start = torch.tensor(ip[:-1], dtype=torch.int64, device=dev)[:, None]
    count = torch.tensor(npages, dtype=torch.int64, device=dev)[:, None]
    vals = kv_indices[(start + col).clamp(max=kv_indices.shape[0] - 1)]
    return torch.where(col < count, vals, -1).to(torch.int32)


def to_block_table(kv_indptr: torch.Tensor, kv_indices: torch.Tensor, kv_last_page_len: torch.Tensor,
                   page_size: int, min_blocks: int = 1) -> Tuple[torch.Tensor, torch.Tensor]:
    """FlashInfer metadata -> ``(block_tables [B, max(pages, min_blocks)] int32 padded with -1,
    kv_lens [B] int32)`` on kv_indices' device."""
    fn = "specdec.compat.flashinfer.to_block_table"
    ip, npages, kv_lens = metadata_lens(fn, kv_indptr, kv_indices, kv_last_page_len, page_size)
    W = max(max(npages, default=0), int(min_blocks), 1)
    table = pages_table(ip, npages, kv_indices, W)
    if table.data_ptr() == kv_indices.data_ptr():  # a view of the caller's indices: hand out a copy
        table = table.clone()
    return (table,
            torch.tensor(kv_lens, dtype=torch.int32, device=kv_indices.device))


def kv_lens_to_metadata(block_tables: torch.Tensor, kv_lens: torch.Tensor, page_size: int) -> PagedMetadata:
    """The reverse: a block table and token counts -> FlashInfer metadata (pages in use only)."""
    lens = kv_lens.to(torch.int64).cpu()
    npages = (lens + page_size - 1) // page_size
    if lens.numel() and int(npages.max()) > block_tables.shape[1]:
        fail("specdec.compat.flashinfer.kv_lens_to_metadata", "kv_lens", f"at most {block_tables.shape[1]} pages "
             f"of {page_size} per row (the block table's width)", str(lens.tolist()))
    indptr = torch.zeros(lens.shape[0] + 1, dtype=torch.int32)
    indptr[1:] = npages.cumsum(0).to(torch.int32)
    used = torch.arange(block_tables.shape[1])[None, :] < npages[:, None]
    indices = block_tables.cpu()[used].to(torch.int32)
    last = torch.where(npages > 0, lens - (npages - 1) * page_size, torch.zeros_like(lens)).to(torch.int32)
    dev = block_tables.device
    return PagedMetadata(indptr.to(dev), indices.to(dev), last.to(dev), int(page_size))


def request_tree_masks(fn: str, flat: torch.Tensor, entry_ptr: Sequence[int], qo_lens: Sequence[int],
                       kv_lens: Sequence[int], ptr_name: str = "mask_indptr") -> List[torch.Tensor]:
    """Each request's ``[qo_len, qo_len]`` tree mask from a FlashInfer flat bool mask whose request b
    block ``flat[entry_ptr[b]:entry_ptr[b + 1]]`` is ``[qo_len[b], kv_len[b]]`` row-major: its last
    qo_len columns (the step's nodes); every earlier column (the committed prefix) must be True, since
    specdec's verify attention always sees the prefix."""
    out = []
    for b, (n, L) in enumerate(zip(qo_lens, kv_lens)):
        size = entry_ptr[b + 1] - entry_ptr[b]
        if size != n * L or L < n:
            fail(fn, f"{ptr_name}[{b}:{b + 2}]", f"a block of qo_len * kv_len = {n} * {L} entries "
                 f"(kv_len >= qo_len)", f"{size} entries")
        blk = flat[entry_ptr[b]:entry_ptr[b + 1]].view(n, L)
        if not bool(blk[:, :L - n].all()):
            fail(fn, f"custom_mask (request {b})", "True on every committed-prefix column",
                 "a masked prefix position (specdec's verify attention always sees the prefix)")
        out.append(blk[:, L - n:])
    return out


def unpack_mask_bits(fn: str, packed: torch.Tensor, byte_ptr: Sequence[int], qo_lens: Sequence[int],
                     kv_lens: Sequence[int], ptr_name: str = "packed_indptr") -> torch.Tensor:
    """FlashInfer's bit-packed mask -> the flat bool mask: request b's ``qo_len[b] * kv_len[b]``
    entries in bytes ``byte_ptr[b] : byte_ptr[b + 1]`` (little bit order, pad bits of its last byte
    ignored)."""
    if byte_ptr and (byte_ptr[0] != 0 or byte_ptr[-1] > packed.numel()):
        fail(fn, ptr_name, f"from 0 to at most the {packed.numel()} bytes given", f"{byte_ptr[0]} .. {byte_ptr[-1]}")
    bits = torch.arange(8, dtype=torch.uint8, device=packed.device)
    parts = []
    for b, (q, L) in enumerate(zip(qo_lens, kv_lens)):
        n, nbytes = q * L, byte_ptr[b + 1] - byte_ptr[b]
        if nbytes != (n + 7) // 8:
            fail(fn, f"{ptr_name}[{b}:{b + 2}]", f"ceil(qo_len * kv_len / 8) = {(n + 7) // 8} bytes "
                 f"(qo_len {q}, kv_len {L})", f"{nbytes} bytes")
        seg = packed[byte_ptr[b]:byte_ptr[b + 1]]
        parts.append(((seg.unsqueeze(1) >> bits) & 1).to(torch.bool).reshape(-1)[:n])
    return torch.cat(parts) if parts else torch.zeros(0, dtype=torch.bool, device=packed.device)


def tree_mask_from_custom(custom_mask: torch.Tensor, mask_indptr: torch.Tensor, qo_len: int,
                          kv_lens: torch.Tensor) -> torch.Tensor:
    """FlashInfer's flattened ``custom_mask`` -> specdec's tree mask ``[B, qo_len, qo_len]`` bool.

    Request b's block ``custom_mask[mask_indptr[b]:mask_indptr[b + 1]]`` is ``[qo_len, kv_len[b]]``
    row-major. Its last qo_len columns (the step's nodes) are the tree mask; every earlier column
    (the committed prefix) must be True, since specdec's verify attention always sees the prefix.
    """
    fn = "specdec.compat.flashinfer.tree_mask_from_custom"
    check_tensor(fn, "custom_mask", custom_mask, 1, (torch.bool,))
    check_tensor(fn, "mask_indptr", mask_indptr, 1, INTS, (kv_lens.shape[0] + 1,))
    lens = kv_lens.to(torch.int64).cpu().tolist()
    out = request_tree_masks(fn, custom_mask, mask_indptr.to(torch.int64).cpu().tolist(), [qo_len] * len(lens), lens)
    if not out:
        return torch.zeros(0, qo_len, qo_len, dtype=torch.bool, device=custom_mask.device)
    return torch.stack(out).contiguous()


def unpack_custom_mask(packed_custom_mask: torch.Tensor, packed_indptr: torch.Tensor, qo_len: int,
                       kv_lens: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """FlashInfer's bit-packed mask -> ``(custom_mask bool [sum qo_len * kv_len], mask_indptr [B + 1])``.

    ``packed_custom_mask`` is uint8: request b's ``qo_len * kv_len[b]`` entries (row-major) packed
    eight per byte with the little bit order (entry i is bit ``i % 8`` of byte ``i // 8``, as
    FlashInfer's ``segment_packbits(..., bitorder="little")`` makes them), in bytes
    ``packed_indptr[b] : packed_indptr[b + 1]`` (``ceil(qo_len * kv_len[b] / 8)`` bytes each; the
    pad bits of a request's last byte are ignored)."""
    fn = "specdec.compat.flashinfer.unpack_custom_mask"
    check_tensor(fn, "packed_custom_mask", packed_custom_mask, 1, (torch.uint8,))
    check_tensor(fn, "packed_indptr", packed_indptr, 1, INTS, (kv_lens.shape[0] + 1,))
    lens = kv_lens.to(torch.int64).cpu().tolist()
    mask = unpack_mask_bits(fn, packed_custom_mask, packed_indptr.to(torch.int64).cpu().tolist(),
                            [qo_len] * len(lens), lens)
    indptr = torch.tensor([0] + list(itertools.accumulate(qo_len * L for L in lens)), dtype=torch.int64)
    return mask, indptr


def nhd_pools(fn, paged_kv_cache, kv_layout):
    """Per-layer (k, v) -> NHD views of the caller's pools (no copy), and whether they are copies
    (only when D is not contiguous: the ops need it)."""
    if kv_layout not in ("NHD", "HND"):
        fail(fn, "kv_layout", "'NHD' or 'HND'", repr(kv_layout))
    if isinstance(paged_kv_cache, torch.Tensor):
        if paged_kv_cache.dim() != 5 or paged_kv_cache.shape[1] != 2:
            fail(fn, "paged_kv_cache", "a (k, v) pair or [num_pages, 2, ...] tensor",
                 f"shape {tuple(paged_kv_cache.shape)}")
        k, v = paged_kv_cache[:, 0], paged_kv_cache[:, 1]
    else:
        k, v = paged_kv_cache
    for name, t in (("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor) or t.dim() != 4:
            got = f"shape {tuple(t.shape)}" if isinstance(t, torch.Tensor) else type(t).__name__
            fail(fn, f"paged_kv_cache ({name})", f"a 4-D {kv_layout} page tensor", got)
    if kv_layout == "HND":
        k, v = k.transpose(1, 2), v.transpose(1, 2)
    if k.stride(-1) == 1 and v.stride(-1) == 1 and k.stride() == v.stride():
        return k, v, False
    return k.contiguous(), v.contiguous(), True


def verify_attention_paged(q: torch.Tensor, paged_kv_cache, kv_indptr: torch.Tensor, kv_indices: torch.Tensor,
                           kv_last_page_len: torch.Tensor, *, qo_len: int, kv_layout: str = "NHD",
                           custom_mask: Optional[torch.Tensor] = None, mask_indptr: Optional[torch.Tensor] = None,
                           sm_scale: Optional[float] = None,
                           packed_custom_mask: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Tree / chain verification attention with FlashInfer's inputs, by
    :func:`specdec.paged_ops.verify_attention_paged`.

    q [B * qo_len, Hq, D] (FlashInfer's ragged layout with every request at ``qo_len`` queries: the
    step's nodes, already appended, so ``kv_len >= qo_len``); ``custom_mask`` / ``mask_indptr`` as
    FlashInfer's (None = causal), or its bit-packed form ``packed_custom_mask`` (uint8, little bit
    order) with ``mask_indptr`` in bytes (:func:`unpack_custom_mask`). Returns [B * qo_len, Hq, D].
    """
    fn = "specdec.compat.flashinfer.verify_attention_paged"
    k, v, _ = nhd_pools(fn, paged_kv_cache, kv_layout)
    ip, npages, lens = metadata_lens(fn, kv_indptr, kv_indices, kv_last_page_len, k.shape[1])
    B = len(lens)
    if not isinstance(q, torch.Tensor) or q.dim() != 3 or q.shape[0] != B * qo_len:
        got = f"shape {tuple(q.shape)}" if isinstance(q, torch.Tensor) else type(q).__name__
        fail(fn, "q", f"[B * qo_len = {B * qo_len}, Hq, D]", got)
    if B and min(lens) < qo_len:
        fail(fn, "kv_last_page_len", f"giving kv_len >= qo_len = {qo_len} (the step's tokens appended)", str(lens))
    dev = kv_indices.device
    table = pages_table(ip, npages, kv_indices, max(max(npages, default=0), 1))
    mask = None
    if custom_mask is not None and packed_custom_mask is not None:
        fail(fn, "packed_custom_mask", "None when custom_mask is given (one form of the mask)", "both")
    if custom_mask is not None or packed_custom_mask is not None:
        if mask_indptr is None:
            fail(fn, "mask_indptr", "given with custom_mask / packed_custom_mask", "None")
        kv = torch.tensor(lens, dtype=torch.int32, device=dev)
        if packed_custom_mask is not None:
            custom_mask, mask_indptr = unpack_custom_mask(packed_custom_mask, mask_indptr, qo_len, kv)
        mask = tree_mask_from_custom(custom_mask, mask_indptr, qo_len, kv).to(q.device)
    cache_lens = torch.tensor([x - qo_len for x in lens], dtype=torch.int32, device=dev)
    out = paged_ops.verify_attention_paged(q.view(B, qo_len, q.shape[1], q.shape[2]), k, v, table, cache_lens,
                                           mask, sm_scale)
    return out.reshape(B * qo_len, q.shape[1], q.shape[2])


def _write_back(paged_kv_cache, kv_layout, k, v):
    dst = (paged_kv_cache[:, 0], paged_kv_cache[:, 1]) if isinstance(paged_kv_cache, torch.Tensor) else paged_kv_cache
    for d, s in zip(dst, (k, v)):
        d.copy_(s.transpose(1, 2) if kv_layout == "HND" else s)


def append_paged_kv_cache(append_key: torch.Tensor, append_value: torch.Tensor, paged_kv_cache,
                          kv_indices: torch.Tensor, kv_indptr: torch.Tensor, kv_last_page_len: torch.Tensor,
                          *, num_new: int, kv_layout: str = "NHD") -> None:
    """Write the step's ``num_new`` tokens per request (``append_key`` / ``append_value``
    [B * num_new, Hkv, D], request-major) at positions ``kv_len[b] - num_new + j``, by
    :func:`specdec.paged_ops.append_kv_paged`. The metadata already counts the new tokens (their
    pages allocated), as FlashInfer's ``append_paged_kv_cache`` expects.
    """
    fn = "specdec.compat.flashinfer.append_paged_kv_cache"
    k, v, copied = nhd_pools(fn, paged_kv_cache, kv_layout)
    table, kv_lens = to_block_table(kv_indptr, kv_indices, kv_last_page_len, k.shape[1])
    B = kv_lens.shape[0]
    for name, t in (("append_key", append_key), ("append_value", append_value)):
        if not isinstance(t, torch.Tensor) or t.dim() != 3 or t.shape[0] != B * num_new:
            fail(fn, name, f"[B * num_new = {B * num_new}, Hkv, D]", f"shape {tuple(t.shape)}")
    if bool((kv_lens < num_new).any()):
        fail(fn, "kv_last_page_len", f"giving kv_len >= num_new = {num_new}", str(kv_lens.tolist()))
    kn = append_key.view(B, num_new, *append_key.shape[1:]).transpose(1, 2).to(k.dtype)
    vn = append_value.view(B, num_new, *append_value.shape[1:]).transpose(1, 2).to(v.dtype)
    paged_ops.append_kv_paged(k, v, kn, vn, table, (kv_lens - num_new).to(torch.int32))
    if copied:
        _write_back(paged_kv_cache, kv_layout, k, v)


def commit_paged_kv(paged_kv_caches: Sequence, kv_indptr: torch.Tensor, kv_indices: torch.Tensor,
                    kv_last_page_len: torch.Tensor, accepted: torch.Tensor, num_accepted: torch.Tensor,
                    *, num_new: int, kv_layout: str = "NHD") -> torch.Tensor:
    """Compact every layer's accepted path (:func:`specdec.paged_ops.kv_commit_paged`): position
    ``kv_len[b] - num_new + i`` takes the K/V of node ``accepted[b, i]``. Returns the committed
    lengths ``kv_len - num_new + num_accepted + 1`` (int32); rebuild the metadata from them
    (:func:`kv_lens_to_metadata`) and free the pages past them."""
    fn = "specdec.compat.flashinfer.commit_paged_kv"
    pairs = [nhd_pools(fn, c, kv_layout) for c in paged_kv_caches]
    if not pairs:
        fail(fn, "paged_kv_caches", "at least one layer", "none")
    table, kv_lens = to_block_table(kv_indptr, kv_indices, kv_last_page_len, pairs[0][0].shape[1])
    check_tensor(fn, "accepted", accepted, 2, INTS, (kv_lens.shape[0], num_new))
    check_tensor(fn, "num_accepted", num_accepted, 1, INTS, (kv_lens.shape[0],))
    lens = (kv_lens - num_new).to(torch.int32)
    paged_ops.kv_commit_paged([p[0] for p in pairs], [p[1] for p in pairs], table, lens,
                              accepted.to(torch.int32).contiguous(), num_accepted.to(torch.int32).contiguous())
    for c, (k, v, copied) in zip(paged_kv_caches, pairs):
        if copied:
            _write_back(c, kv_layout, k, v)
    return lens
