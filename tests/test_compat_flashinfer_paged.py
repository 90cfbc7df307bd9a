"""specdec.compat.flashinfer's paged-KV bridge: FlashInfer metadata (kv_indptr / kv_indices /
kv_last_page_len, NHD and HND pages, flattened custom_mask) onto specdec's paged ops, checked
against the dense ops and the pure-torch paged references on shuffled pages."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from specdec import ops, reference_paged
from specdec.cache import StaticKVCache
from specdec.compat import flashinfer as fi
from specdec.compat import flashinfer_paged as fi_paged


def _setup(ps, g, B=3, H=2, D=8, P=40, prefix=(5, 0, 11), N=3):
    lens = torch.tensor(prefix, dtype=torch.int32)
    k = torch.randn(P, ps, H, D, generator=g)
    v = torch.randn(P, ps, H, D, generator=g)
    perm = torch.randperm(P, generator=g).tolist()
    pages, indptr = [], [0]
    for b in range(B):
        need = (int(lens[b]) + N + ps - 1) // ps
        pages += perm[:need]
        perm = perm[need:]
        indptr.append(len(pages))
    kv_len = lens + N
    last = kv_len - (torch.tensor(indptr[1:]) - torch.tensor(indptr[:-1]) - 1) * ps
    meta = fi.PagedMetadata(torch.tensor(indptr, dtype=torch.int32), torch.tensor(pages, dtype=torch.int32),
                            last.to(torch.int32), ps)
    return k, v, meta, lens


def _tree_mask(B, N, g):
    m = torch.zeros(B, N, N, dtype=torch.bool)
    for b in range(B):
        m[b, 0, 0] = True
        for i in range(1, N):
            par = int(torch.randint(0, i, (1,), generator=g))
            m[b, i] = m[b, par]
            m[b, i, i] = True
    return m


def _packbits_little(flat, indptr):
    """Each request's segment packed 8 per byte, little bit order (NumPy's packbits), and the byte indptr."""
    ip = indptr.tolist()
    segs = [np.packbits(flat[ip[b]:ip[b + 1]].numpy(), bitorder="little") for b in range(len(ip) - 1)]
    out = torch.from_numpy(np.concatenate(segs)) if segs else torch.zeros(0, dtype=torch.uint8)
    return out, torch.tensor([0] + [len(x) for x in segs]).cumsum(0).to(torch.int32)


def test_packed_custom_mask_unpacks_exactly():
    """Random masks of odd sizes (pad bits in the last byte set to 1 to show they are ignored) round-trip."""
    g = torch.Generator().manual_seed(7)
    for trial in range(50):
        B = int(torch.randint(1, 5, (1,), generator=g))
        qo = int(torch.randint(1, 6, (1,), generator=g))
        kv = torch.randint(qo, qo + 13, (B,), generator=g)
        flat = torch.rand(int(qo * kv.sum()), generator=g) < 0.5
        mptr = torch.tensor([0] + (qo * kv).tolist()).cumsum(0)
        packed, pptr = _packbits_little(flat, mptr)
        for b in range(B):  # fill the pad bits of each request's last byte
            n = int(qo * kv[b])
            if n % 8:
                packed[int(pptr[b + 1]) - 1] |= (0xFF << (n % 8)) & 0xFF
        got, gptr = fi.unpack_custom_mask(packed, pptr, qo, kv)
        assert torch.equal(got, flat) and gptr.tolist() == mptr.tolist()
    with pytest.raises(ValueError, match=r"packed_indptr\[0:2\] must be ceil\(qo_len \* kv_len / 8\)"):
        fi.unpack_custom_mask(torch.zeros(8, dtype=torch.uint8), torch.tensor([0, 1]), 2, torch.tensor([5]))
    with pytest.raises(TypeError, match="packed_custom_mask must be torch.uint8"):
        fi.unpack_custom_mask(torch.zeros(8, dtype=torch.bool), torch.tensor([0, 1]), 2, torch.tensor([5]))


@pytest.mark.parametrize("combined", [False, True], ids=["pair", "combined"])
@pytest.mark.parametrize("ps,layout", [(1, "NHD"), (4, "NHD"), (4, "HND"), (16, "HND")])
def test_append_verify_commit_match_references(ps, layout, combined):
    g = torch.Generator().manual_seed(ps)
    B, H, D, N = 3, 2, 8, 3
    k, v, meta, lens = _setup(ps, g, B=B, H=H, D=D, N=N)
    table, kv_lens = fi.to_block_table(meta.kv_indptr, meta.kv_indices, meta.kv_last_page_len, ps)
    assert kv_lens.tolist() == (lens + N).tolist()
    back = fi.kv_lens_to_metadata(table, kv_lens, ps)
    assert all(torch.equal(a, b) for a, b in zip(back[:3], meta[:3]))
    kn, vn = torch.randn(B * N, H, D, generator=g), torch.randn(B * N, H, D, generator=g)
    hnd = layout == "HND"
    cache = (k.transpose(1, 2).contiguous(), v.transpose(1, 2).contiguous()) if hnd else (k.clone(), v.clone())
    if combined:  # FlashInfer's one-tensor form [num_pages, 2, ...]: K and V interleaved page by page
        cache = torch.stack(cache, 1)
    halves = (cache[:, 0], cache[:, 1]) if combined else cache
    kk, vv, copied = fi_paged.nhd_pools("test", cache, layout)  # the pools the ops get
    assert not copied
    for view, pool in zip((kk, vv), halves):
        assert view.data_ptr() == pool.data_ptr()  # the caller's memory, no copy
        assert torch.equal(view, pool.transpose(1, 2) if hnd else pool)
    fi.append_paged_kv_cache(kn, vn, cache, meta.kv_indices, meta.kv_indptr, meta.kv_last_page_len, num_new=N,
                             kv_layout=layout)
    rk, rv = k.clone(), v.clone()
    reference_paged.append_kv_paged(rk, rv, kn.view(B, N, H, D).transpose(1, 2), vn.view(B, N, H, D).transpose(1, 2),
                                    table, lens)
    nhd = (lambda t: t.transpose(1, 2)) if layout == "HND" else (lambda t: t)
    assert torch.equal(nhd(halves[0]), rk) and torch.equal(nhd(halves[1]), rv)
    # verify attention with a tree mask given as FlashInfer's flattened custom mask
    mask = _tree_mask(B, N, g)
    flat = torch.cat([torch.cat([torch.ones(N, int(lens[b]), dtype=torch.bool), mask[b]], 1).flatten()
                      for b in range(B)])
    mptr = torch.tensor([0] + [N * int(x) for x in (lens + N)]).cumsum(0).to(torch.int32)
    q = torch.randn(B * N, 4, D, generator=g)
    got = fi.verify_attention_paged(q, cache, meta.kv_indptr, meta.kv_indices, meta.kv_last_page_len, qo_len=N,
                                    kv_layout=layout, custom_mask=flat, mask_indptr=mptr)
    want = reference_paged.verify_attention_paged(q.view(B, N, 4, D), rk, rv, table, lens, mask, D ** -0.5)
    torch.testing.assert_close(got, want.reshape(B * N, 4, D), rtol=1e-5, atol=1e-5)
    # the same mask bit-packed as FlashInfer's segment_packbits(..., bitorder="little") makes it
    packed, pptr = _packbits_little(flat, mptr)
    got_p = fi.verify_attention_paged(q, cache, meta.kv_indptr, meta.kv_indices, meta.kv_last_page_len, qo_len=N,
                                      kv_layout=layout, packed_custom_mask=packed, mask_indptr=pptr)
    assert torch.equal(got_p, got)
    # commit: node 0 is the root; accept path [0, 2] for request 0, [0, 1, 2] for 1, [0] for 2
    acc = torch.tensor([[0, 2, -1], [0, 1, 2], [0, -1, -1]], dtype=torch.int32)
    num = torch.tensor([1, 2, 0], dtype=torch.int32)
    new = fi.commit_paged_kv([cache], meta.kv_indptr, meta.kv_indices, meta.kv_last_page_len, acc, num, num_new=N,
                             kv_layout=layout)
    rl = lens.clone()
    reference_paged.kv_commit_paged([rk], [rv], table, rl, acc, num)
    assert new.tolist() == rl.tolist()
    assert torch.equal(nhd(halves[0]), rk) and torch.equal(nhd(halves[1]), rv)


def test_dense_cache_as_paged():
    g = torch.Generator().manual_seed(3)
    B, H, S, D, N = 3, 2, 24, 8, 4
    cache = StaticKVCache(1, B, H, D, S)
    cache.k[0].normal_(generator=g)
    cache.v[0].normal_(generator=g)
    cache.lens.copy_(torch.tensor([6, 0, 13], dtype=torch.int32))
    meta, layers = fi.dense_as_paged(cache, num_new=N)
    assert meta.page_size == S and meta.kv_indptr.tolist() == [0, 1, 2, 3]
    assert meta.kv_last_page_len.tolist() == [10, 4, 17]
    q = torch.randn(B, N, 4, D, generator=g)
    got = fi.verify_attention_paged(q.reshape(B * N, 4, D), layers[0], meta.kv_indptr, meta.kv_indices,
                                    meta.kv_last_page_len, qo_len=N, kv_layout="HND")
    want = ops.verify_attention(q, cache.k[0], cache.v[0], cache.lens, None, D ** -0.5)
    assert torch.equal(got, want.reshape(B * N, 4, D))
    empty, _ = fi.dense_as_paged(cache.rows(1, 2))
    assert empty.kv_indptr.tolist() == [0, 0] and empty.kv_last_page_len.tolist() == [0]


def test_paged_errors():
    ip = torch.tensor([0, 2], dtype=torch.int32)
    idx = torch.tensor([3, 1], dtype=torch.int32)
    with pytest.raises(ValueError, match=r"to_block_table: kv_last_page_len\[0\] must be in \[1, 4\]"):
        fi.to_block_table(ip, idx, torch.tensor([5], dtype=torch.int32), 4)
    with pytest.raises(ValueError, match="kv_indptr must be 0-based and non-decreasing"):
        fi.to_block_table(torch.tensor([0, 3], dtype=torch.int32), idx, torch.tensor([1], dtype=torch.int32), 4)
    m = torch.ones(2 * 6, dtype=torch.bool)
    m[0] = False
    with pytest.raises(ValueError, match=r"custom_mask \(request 0\) must be True on every committed-prefix column"):
        fi.tree_mask_from_custom(m, torch.tensor([0, 12]), 2, torch.tensor([6]))
    with pytest.raises(ValueError, match="kv_layout must be 'NHD' or 'HND'"):
        fi.verify_attention_paged(torch.zeros(2, 1, 4), (torch.zeros(4, 4, 1, 4),) * 2, ip, idx,
                                  torch.tensor([2], dtype=torch.int32), qo_len=2, kv_layout="XYZ")
