"""The paged ops on page pools that are not contiguous NHD tensors, in place.

Serving stacks keep their pools in their own layouts: FlashInfer's HND ``[num_pages, Hkv,
page_size, D]`` (passed as ``pages.transpose(1, 2)``), its combined ``[num_pages, 2, page_size,
Hkv, D]`` pool (K = ``[:, 0]``, V = ``[:, 1]``, interleaved views of one buffer) or both at once.
Every op must read and write such views where they lie (no copy) and give, bit for bit, what it
gives on contiguous NHD pools holding the same values; the pure-torch reference must too. Views
that would put two elements at one address, or K / V of one call in two layouts, are refused.
"""
from __future__ import annotations

import pytest
import torch

from specdec import paged_ops, reference_paged

from conftest import DEVICES, gen
from test_ops_decoder_layer import _case as layer_case
from test_ops_paged import _case, _commit_case

LAYOUTS = ["hnd", "combined_nhd", "combined_hnd"]


def in_layout(k: torch.Tensor, v: torch.Tensor, layout: str):
    """NHD pools k, v [P, ps, H, D] -> views (k', v') of a fresh buffer in ``layout`` with the same
    values, and the buffer itself (to check that the writes land in it)."""
    if layout == "hnd":
        kb = k.transpose(1, 2).clone(memory_format=torch.contiguous_format)  # always a copy (contiguous() may not be)
        vb = v.transpose(1, 2).clone(memory_format=torch.contiguous_format)
        return kb.transpose(1, 2), vb.transpose(1, 2), (kb, vb)
    pool = torch.stack([k, v], 1)  # [P, 2, ps, H, D]
    if layout == "combined_hnd":
        pool = pool.transpose(2, 3).clone(memory_format=torch.contiguous_format)  # [P, 2, H, ps, D]
        return pool[:, 0].transpose(1, 2), pool[:, 1].transpose(1, 2), (pool,)
    return pool[:, 0], pool[:, 1], (pool,)


def _strided(t: torch.Tensor) -> bool:
    return not t.is_contiguous()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("page_size", [1, 16, 64])
@pytest.mark.parametrize("mode", ["causal", "tree", "frontier"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_verify_attention_on_strided_pools(device, layout, page_size, mode, dtype):
    c = {k: (v.to(device) if isinstance(v, torch.Tensor) else v) for k, v in _case(5, page_size, dtype, mode).items()}
    ks, vs, _ = in_layout(c["kp"], c["vp"], layout)
    assert (_strided(ks) and _strided(vs)) or (layout == "hnd" and page_size == 1)  # HND at one slot a page is NHD
    want = paged_ops.verify_attention_paged(c["q"], c["kp"], c["vp"], c["tables"], c["lens"], c["mask"], c["scale"])
    got = paged_ops.verify_attention_paged(c["q"], ks, vs, c["tables"], c["lens"], c["mask"], c["scale"])
    assert torch.equal(got, want), f"max diff {(got.float() - want.float()).abs().max().item():.3e}"
    ref = reference_paged.verify_attention_paged(c["q"], ks, vs, c["tables"], c["lens"], c["mask"], c["scale"])
    ref_nhd = reference_paged.verify_attention_paged(c["q"], c["kp"], c["vp"], c["tables"], c["lens"], c["mask"],
                                                     c["scale"])
    assert torch.equal(ref, ref_nhd)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("page_size", [1, 16, 64])
def test_append_and_commit_write_strided_pools_in_place(device, layout, page_size):
    _, _, kps, vps, tables, lens, accepted, num = _commit_case(12, page_size)
    kps, vps = [p.to(device) for p in kps], [p.to(device) for p in vps]
    tables, lens, accepted, num = (t.to(device) for t in (tables, lens, accepted, num))
    views = [in_layout(k, v, layout) for k, v in zip(kps, vps)]
    buffers = [b.data_ptr() for _, _, bufs in views for b in bufs]
    kn, vn = torch.randn(2, 4, kps[0].shape[2], 3, kps[0].shape[3], generator=gen(3)).to(device)
    kn = kn.transpose(2, 3).contiguous().transpose(2, 3)  # a strided input too
    want_k, want_v = [p.clone() for p in kps], [p.clone() for p in vps]
    paged_ops.append_kv_paged(want_k[0], want_v[0], kn, vn, tables, lens)
    paged_ops.append_kv_paged(views[0][0], views[0][1], kn, vn, tables, lens)
    ref_k, ref_v = kps[0].clone(), vps[0].clone()
    rk, rv, _ = in_layout(ref_k, ref_v, layout)
    reference_paged.append_kv_paged(rk, rv, kn, vn, tables, lens)
    assert torch.equal(views[0][0], want_k[0]) and torch.equal(views[0][1], want_v[0])
    assert torch.equal(rk, want_k[0]) and torch.equal(rv, want_v[0])
    lw, lg = lens.clone(), lens.clone()
    paged_ops.kv_commit_paged(want_k, want_v, tables, lw, accepted, num)
    paged_ops.kv_commit_paged([v[0] for v in views], [v[1] for v in views], tables, lg, accepted, num)
    assert torch.equal(lg, lw)
    for (k, v, _), wk, wv in zip(views, want_k, want_v):
        assert torch.equal(k, wk) and torch.equal(v, wv)
    assert [b.data_ptr() for _, _, bufs in views for b in bufs] == buffers  # the same memory, written in place
    # the reference commit on strided views of the same appended state
    pre_k, pre_v = [p.clone() for p in kps], [p.clone() for p in vps]
    paged_ops.append_kv_paged(pre_k[0], pre_v[0], kn, vn, tables, lens)
    rv_l = [in_layout(k, v, layout)[:2] for k, v in zip(pre_k, pre_v)]
    lr = lens.clone()
    reference_paged.kv_commit_paged([p[0] for p in rv_l], [p[1] for p in rv_l], tables, lr, accepted, num)
    assert torch.equal(lr, lw)
    for (k, v), wk, wv in zip(rv_l, want_k, want_v):
        assert torch.equal(k, wk) and torch.equal(v, wv)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("shape", ["decode", "tree"])
def test_decoder_layer_paged_on_strided_pools(device, layout, shape):
    from test_ops_decoder_layer_paged import _paged
    kw = dict(decode=dict(B=1, N=1), tree=dict(B=2, N=5))[shape]
    args = layer_case(device, torch.float32, "q4_1+q8", seed=7, **kw)
    paged = _paged(args, 8, seed=2)
    ks, vs, _ = in_layout(paged["k_pages"], paged["v_pages"], layout)
    want = paged_ops.decoder_layer_paged(**dict(paged, k_pages=paged["k_pages"].clone(),
                                                v_pages=paged["v_pages"].clone()))
    strided = dict(paged, k_pages=ks, v_pages=vs)
    got = paged_ops.decoder_layer_paged(**strided)
    for t, w in zip(got, want):
        assert torch.equal(t, w)
    nhd = dict(paged)
    paged_ops.decoder_layer_paged(**nhd)
    assert torch.equal(ks, nhd["k_pages"]) and torch.equal(vs, nhd["v_pages"])


def test_strided_pools_that_alias_or_mix_layouts_are_refused():
    c = _case(5, 16, torch.float32, "causal")
    kp, vp, q, tables, lens = c["kp"], c["vp"], c["q"], c["tables"], c["lens"]
    f = paged_ops.verify_attention_paged
    with pytest.raises(RuntimeError, match=r"verify_attention_paged: k_pages must have its head dim D contiguous"):
        f(q, kp[:1].expand_as(kp), vp, tables, lens)
    with pytest.raises(RuntimeError, match=r"verify_attention_paged: k_pages must have its head dim D contiguous"):
        f(q, kp.transpose(2, 3).contiguous().transpose(2, 3), vp, tables, lens)
    hk, _, _ = in_layout(kp, vp, "hnd")
    with pytest.raises(RuntimeError, match=r"verify_attention_paged: v_pages must have the strides of k_pages"):
        f(q, hk, vp, tables, lens)
    kn = torch.randn(q.shape[0], kp.shape[2], 2, kp.shape[3])
    with pytest.raises(RuntimeError, match=r"append_kv_paged: v_pages must have the strides of k_pages"):
        paged_ops.append_kv_paged(hk, vp, kn, kn, tables, lens)
    # interleaved halves of one pool are disjoint; the same half twice, or a half shifted by one slot, is not
    pool = torch.stack([kp, vp], 1).contiguous()
    k0, v0 = pool[:, 0], pool[:, 1]
    paged_ops.append_kv_paged(k0, v0, kn, kn, tables, lens)
    shifted = pool.as_strided(k0.shape, k0.stride(), k0.storage_offset() + k0.stride(1))
    before = pool.clone()
    for other in (k0, shifted):
        with pytest.raises(RuntimeError, match=r"append_kv_paged: k_pages and v_pages share memory"):
            paged_ops.append_kv_paged(k0, other, kn, kn, tables, lens)
    with pytest.raises(RuntimeError, match=r"kv_commit_paged: .* share memory"):
        paged_ops.kv_commit_paged([k0], [shifted], tables, lens.clone(), torch.zeros(q.shape[0], 2, dtype=torch.int32),
                                  torch.zeros(q.shape[0], dtype=torch.int32))
    assert torch.equal(pool, before)
