"""FlashInfer's plan / run attention wrapper over specdec's paged verify attention (re-exported by
:mod:`specdec.compat.flashinfer`).

A stack calls FlashInfer's batch attention through a wrapper object: ``plan(...)`` once per step
with the batch's metadata (ragged query lengths ``qo_indptr``, the page metadata, the mask), then
``run(q, paged_kv_cache)`` once per layer. :class:`BatchPrefillWithPagedKVCacheWrapper` keeps that
shape: ``plan`` does every host-side read, check and conversion (block table, committed lengths,
tree masks), so ``run`` is the op call and nothing else. Semantics, as FlashInfer defines them for a
request of ``qo_len`` queries over ``kv_len`` keys (the step's tokens already appended, so the
queries are the last ``qo_len`` positions):

* ``causal=True``: query i sees key j iff ``j <= kv_len - qo_len + i`` (bottom-right aligned);
* ``causal=False`` and no mask: every query sees all ``kv_len`` keys;
* ``custom_mask`` (bool, each request's ``[qo_len, kv_len]`` block row-major, the blocks
  concatenated) or ``packed_custom_mask`` (the same bits packed eight per byte, little bit order,
  each request's block padded to whole bytes): query i sees key j iff the entry is True. specdec's
  verify attention always sees the committed prefix, so every prefix column must be True (a clear
  error otherwise); the last ``qo_len`` columns are the step's tree mask.

Requests may have different ``qo_len``; ``run`` then makes one op call per distinct length (the
rows gathered and scattered back). What specdec does not implement is refused at ``plan`` with an
error naming the argument: position encodings inside attention (``pos_encoding_mode`` other than
``"NONE"``), sliding windows, logit soft-capping, ``head_dim_vo != head_dim_qk``, fp16 QK reduction,
CUDA-graph buffers, and ``return_lse``. The workspace buffer is accepted and unused (the ops
allocate their own), ``q_data_type`` / ``kv_data_type`` / ``o_data_type`` and FlashInfer's
scheduling hints (``non_blocking``, ``fixed_split_size``, ``disable_split_kv``, ...) are accepted;
``run`` takes the tensors' own dtypes and returns q's.
"""
from __future__ import annotations

import itertools
from typing import List, Optional

import torch

from specdec import paged_ops
from specdec.compat.common import INTS, check_tensor, fail
from specdec.compat.flashinfer_paged import (metadata_lens, nhd_pools, pages_table, request_tree_masks,
                                             unpack_mask_bits)

__all__ = ["BatchPrefillWithPagedKVCacheWrapper"]

_CLS = "specdec.compat.flashinfer.BatchPrefillWithPagedKVCacheWrapper"
# plan() arguments of FlashInfer's that only steer its own scheduling or output dtype: accepted, no effect
_HINTS = frozenset({"o_data_type", "non_blocking", "fixed_split_size", "disable_split_kv", "max_token_per_sequence",
                    "max_sequence_kv"})


class _Group:
    """Requests sharing one ``qo_len``: their rows of q (None = all rows, in order), block table,
    committed lengths and tree mask (None = causal)."""
    __slots__ = ("qo_len", "rows", "table", "cache_lens", "mask", "batch")

    def __init__(self, qo_len, rows, table, cache_lens, mask, batch):
        self.qo_len, self.rows, self.table, self.cache_lens, self.mask, self.batch = (
            qo_len, rows, table, cache_lens, mask, batch)


class BatchPrefillWithPagedKVCacheWrapper:
    """FlashInfer's ``BatchPrefillWithPagedKVCacheWrapper(float_workspace_buffer, kv_layout)``:
    ``plan(...)`` per step, ``run(q, paged_kv_cache)`` per layer (see the module docstring)."""

    def __init__(self, float_workspace_buffer: Optional[torch.Tensor] = None, kv_layout: str = "NHD",
                 use_cuda_graph: bool = False, qo_indptr_buf=None, paged_kv_indptr_buf=None,
                 paged_kv_indices_buf=None, paged_kv_last_page_len_buf=None, custom_mask_buf=None,
                 mask_indptr_buf=None, backend: str = "auto", jit_args=None):
        if kv_layout not in ("NHD", "HND"):
            fail(_CLS, "kv_layout", "'NHD' or 'HND'", repr(kv_layout))
        if use_cuda_graph:
            fail(_CLS, "use_cuda_graph", "False (specdec's ops take the tensors of each call; no captured "
                 "buffers)", "True")
        if jit_args is not None:
            fail(_CLS, "jit_args", "None (no JIT variants: specdec's kernels are compiled in)", "a value")
        self._kv_layout = kv_layout
        self._groups: Optional[List[_Group]] = None
        self._total_rows = 0
        self._shape = None  # (num_qo_heads, num_kv_heads, head_dim, page_size)
        self._sm_scale = 1.0

    @property
    def kv_layout(self) -> str:
        return self._kv_layout

    def plan(self, qo_indptr: torch.Tensor, paged_kv_indptr: torch.Tensor, paged_kv_indices: torch.Tensor,
             paged_kv_last_page_len: torch.Tensor, num_qo_heads: int, num_kv_heads: int, head_dim_qk: int,
             page_size: int, head_dim_vo: Optional[int] = None, custom_mask: Optional[torch.Tensor] = None,
             packed_custom_mask: Optional[torch.Tensor] = None, causal: bool = False,
             pos_encoding_mode: str = "NONE", use_fp16_qk_reduction: bool = False,
             sm_scale: Optional[float] = None, window_left: int = -1, logits_soft_cap: Optional[float] = None,
             rope_scale: Optional[float] = None, rope_theta: Optional[float] = None,
             q_data_type="float16", kv_data_type=None, **unsupported) -> None:
        """Check and convert one step's metadata; every later :meth:`run` uses it."""
        fn = _CLS + ".plan"
        unsupported = [k for k in unsupported if k not in _HINTS]
        if unsupported:
            fail(fn, ", ".join(sorted(unsupported)), "absent (not supported by specdec's wrapper)", "given")
        for arg, ok, want, got in (
                ("pos_encoding_mode", pos_encoding_mode == "NONE", "'NONE' (apply RoPE before the call)",
                 repr(pos_encoding_mode)),
                ("window_left", window_left == -1, "-1 (no sliding window)", str(window_left)),
                ("logits_soft_cap", not logits_soft_cap, "None or 0 (no soft-capping)", str(logits_soft_cap)),
                ("use_fp16_qk_reduction", not use_fp16_qk_reduction, "False", str(use_fp16_qk_reduction)),
                ("head_dim_vo", head_dim_vo in (None, head_dim_qk), f"None or head_dim_qk = {head_dim_qk}",
                 str(head_dim_vo))):
            if not ok:
                fail(fn, arg, want, got)
        for arg, x in (("num_qo_heads", num_qo_heads), ("num_kv_heads", num_kv_heads),
                       ("head_dim_qk", head_dim_qk), ("page_size", page_size)):
            if not isinstance(x, int) or isinstance(x, bool) or x < 1:
                fail(fn, arg, "a positive int", repr(x))
        if num_qo_heads % num_kv_heads:
            fail(fn, "num_qo_heads", f"a multiple of num_kv_heads = {num_kv_heads}", str(num_qo_heads))
        if custom_mask is not None and packed_custom_mask is not None:
            fail(fn, "packed_custom_mask", "None when custom_mask is given (one form of the mask)", "both")
        ip, npages, kv_lens = metadata_lens(fn, paged_kv_indptr, paged_kv_indices, paged_kv_last_page_len, page_size)
        B = len(kv_lens)
        check_tensor(fn, "qo_indptr", qo_indptr, 1, INTS, (B + 1,))
        qp = qo_indptr.tolist()
        qo = [b - a for a, b in zip(qp, qp[1:])]
        if B and (qp[0] != 0 or min(qo) < 1):
            fail(fn, "qo_indptr", "0-based and increasing (every request at least one query)", str(qp))
        short = [b for b in range(B) if kv_lens[b] < qo[b]]
        if short:
            b = short[0]
            fail(fn, "paged_kv_last_page_len", f"giving kv_len >= qo_len for every request (the step's tokens "
                 f"appended); request {b} has kv_len {kv_lens[b]} < qo_len {qo[b]}", str(kv_lens))
        dev = paged_kv_indices.device
        table = pages_table(ip, npages, paged_kv_indices, max(max(npages, default=0), 1))
        if table.data_ptr() == paged_kv_indices.data_ptr():  # a view of the caller's indices: keep a copy
            table = table.clone()
        masks = None
        if custom_mask is not None or packed_custom_mask is not None:
            masks = self._masks(fn, custom_mask, packed_custom_mask, qo, kv_lens)
        elif not causal:  # FlashInfer's non-causal attention: every query sees every key
            masks = [torch.ones(n, n, dtype=torch.bool) for n in qo]
        self._groups = self._group(qo, kv_lens, table, masks, dev)
        self._total_rows = qp[-1] if B else 0
        self._shape = (num_qo_heads, num_kv_heads, head_dim_qk, page_size)
        self._sm_scale = float(head_dim_qk ** -0.5 if sm_scale is None else sm_scale)

    @staticmethod
    def _masks(fn, custom_mask, packed_custom_mask, qo, kv_lens) -> List[torch.Tensor]:
        """Each request's ``[qo_len, qo_len]`` tree mask (on the host) from FlashInfer's flat or packed
        mask, whose per-request offsets follow from the lengths as FlashInfer derives them."""
        sizes = [n * L for n, L in zip(qo, kv_lens)]
        entry_ptr = [0, *itertools.accumulate(sizes)]
        if packed_custom_mask is not None:  # each request's block padded to whole bytes
            check_tensor(fn, "packed_custom_mask", packed_custom_mask, 1, (torch.uint8,))
            byte_ptr = [0, *itertools.accumulate((s + 7) // 8 for s in sizes)]
            if byte_ptr[-1] != packed_custom_mask.shape[0]:
                fail(fn, "packed_custom_mask", f"sum of ceil(qo_len * kv_len / 8) = {byte_ptr[-1]} bytes",
                     f"{packed_custom_mask.shape[0]} bytes")
            flat = unpack_mask_bits(fn, packed_custom_mask, byte_ptr, qo, kv_lens)
        else:
            check_tensor(fn, "custom_mask", custom_mask, 1, (torch.bool,))
            flat = custom_mask
            if flat.shape[0] != entry_ptr[-1]:
                fail(fn, "custom_mask", f"sum of qo_len * kv_len = {entry_ptr[-1]} entries (requests' blocks "
                     "concatenated)", f"{flat.shape[0]} entries")
        return [m.cpu() for m in request_tree_masks(fn, flat, entry_ptr, qo, kv_lens)]

    @staticmethod
    def _group(qo, kv_lens, table, masks, dev) -> List[_Group]:
        by_len = {}
        for b, n in enumerate(qo):
            by_len.setdefault(n, []).append(b)
        groups, start = [], [0]
        for n in qo:
            start.append(start[-1] + n)
        for n, reqs in by_len.items():
            whole = len(by_len) == 1
            rows = None if whole else torch.tensor([start[b] + i for b in reqs for i in range(n)], device=dev)
            idx = None if whole else torch.tensor(reqs, device=dev)
            tb = table if whole else table.index_select(0, idx)
            cl = torch.tensor([kv_lens[b] - n for b in reqs], dtype=torch.int32, device=dev)
            mask = None if masks is None else torch.stack([masks[b] for b in reqs]).to(dev)
            groups.append(_Group(n, rows, tb.contiguous(), cl, mask, len(reqs)))
        return groups

    def run(self, q: torch.Tensor, paged_kv_cache, *args, out: Optional[torch.Tensor] = None,
            lse: Optional[torch.Tensor] = None, return_lse: bool = False, **kwargs) -> torch.Tensor:
        """Attention of ``q [qo_indptr[-1], num_qo_heads, head_dim]`` over one layer's pages
        (``(k, v)`` or FlashInfer's combined ``[num_pages, 2, ...]`` tensor, in the wrapper's layout);
        returns ``[qo_indptr[-1], num_qo_heads, head_dim]`` (written into ``out`` when given)."""
        fn = _CLS + ".run"
        if self._groups is None:
            fail(fn, "self", "planned (call plan() first)", "no plan", RuntimeError)
        if args or kwargs or return_lse or lse is not None:
            extra = [k for k in kwargs] + (["return_lse"] if return_lse else []) + (["lse"] if lse is not None else [])
            fail(fn, ", ".join(extra) or "positional arguments after paged_kv_cache",
                 "absent (no log-sum-exp, no scales)", "given")
        Hq, Hkv, D, ps = self._shape
        if not isinstance(q, torch.Tensor) or tuple(q.shape) != (self._total_rows, Hq, D):
            got = f"shape {tuple(q.shape)}" if isinstance(q, torch.Tensor) else type(q).__name__
            fail(fn, "q", f"[{self._total_rows}, {Hq}, {D}] (qo_indptr[-1], num_qo_heads, head_dim_qk)", got)
        k, v, _ = nhd_pools(fn, paged_kv_cache, self._kv_layout)
        if tuple(k.shape[1:]) != (ps, Hkv, D):
            fail(fn, "paged_kv_cache", f"pages of page_size {ps}, {Hkv} kv heads, head_dim {D} as planned "
                 f"({self._kv_layout})", f"NHD view shape {tuple(k.shape)}")
        groups = self._groups
        if len(groups) == 1:
            g = groups[0]
            res = paged_ops.verify_attention_paged(q.view(g.batch, g.qo_len, Hq, D), k, v, g.table, g.cache_lens,
                                                   g.mask, self._sm_scale).view(self._total_rows, Hq, D)
            if out is None:
                return res
            self._check_out(fn, out, q)
            return out.copy_(res)
        if out is None:
            out = torch.empty_like(q)
        else:
            self._check_out(fn, out, q)
        for g in groups:
            part = q.index_select(0, g.rows).view(g.batch, g.qo_len, Hq, D)
            res = paged_ops.verify_attention_paged(part, k, v, g.table, g.cache_lens, g.mask, self._sm_scale)
            out.index_copy_(0, g.rows, res.view(-1, Hq, D))
        return out

    def _check_out(self, fn, out, q) -> None:
        if not isinstance(out, torch.Tensor) or out.shape != q.shape or out.dtype != q.dtype:
            got = f"{tuple(out.shape)} {out.dtype}" if isinstance(out, torch.Tensor) else type(out).__name__
            fail(fn, "out", f"a tensor of q's shape {tuple(q.shape)} and dtype {q.dtype}", got)

    @property
    def num_calls(self) -> int:
        """Op calls per :meth:`run` under the current plan (one per distinct query length)."""
        return 0 if self._groups is None else len(self._groups)
