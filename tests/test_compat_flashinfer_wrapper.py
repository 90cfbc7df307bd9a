"""specdec.compat.flashinfer.BatchPrefillWithPagedKVCacheWrapper (plan once, run per layer) against
an independent pure-torch implementation of FlashInfer's documented batch prefill semantics: ragged
query lengths, pages gathered through kv_indptr / kv_indices / kv_last_page_len, causal (bottom-right
aligned), non-causal and custom masks (flat and bit-packed), NHD / HND / combined pools, GQA."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from specdec.compat import flashinfer as fi

from test_compat_flashinfer_paged import _tree_mask


def _fi_semantics(q, k_nhd, v_nhd, qp, ip, idx, kv_lens, ps, mode, flat_mask, scale):
    """FlashInfer's batch prefill over NHD pages, written from its docs: request b's queries
    q[qp[b]:qp[b+1]] are the last qo_len of its kv_len positions; position t sits at page
    idx[ip[b] + t // ps], slot t % ps."""
    Hq, Hkv = q.shape[1], k_nhd.shape[2]
    out = torch.empty_like(q)
    at = 0
    for b in range(len(kv_lens)):
        n, L = qp[b + 1] - qp[b], kv_lens[b]
        pos = torch.arange(L)
        pages = torch.tensor(idx[ip[b]:ip[b + 1]], dtype=torch.long)[pos // ps]
        K = k_nhd[pages, pos % ps].repeat_interleave(Hq // Hkv, dim=1)  # [L, Hq, D]
        V = v_nhd[pages, pos % ps].repeat_interleave(Hq // Hkv, dim=1)
        if mode == "causal":
            allow = pos[None, :] <= (L - n + torch.arange(n))[:, None]
        elif mode == "none":
            allow = torch.ones(n, L, dtype=torch.bool)
        else:
            allow = flat_mask[at:at + n * L].view(n, L)
        at += n * L
        s = torch.einsum("ihd,jhd->hij", q[qp[b]:qp[b + 1]].double(), K.double()) * scale
        s = s.masked_fill(~allow[None], float("-inf"))
        out[qp[b]:qp[b + 1]] = torch.einsum("hij,jhd->ihd", torch.softmax(s, -1), V.double()).to(q.dtype)
    return out


def _batch(g, ps, qo, prefix, Hkv, D, spare=5):
    """Pages for each request's prefix + qo_len positions, handed out from a shuffled pool."""
    kv_lens = [p + n for p, n in zip(prefix, qo)]
    need = [(L + ps - 1) // ps for L in kv_lens]
    P = sum(need) + spare
    perm = torch.randperm(P, generator=g).tolist()
    idx, ip = [], [0]
    for n in need:
        idx += perm[:n]
        perm = perm[n:]
        ip.append(len(idx))
    last = [L - (n - 1) * ps for L, n in zip(kv_lens, need)]
    k = torch.randn(P, ps, Hkv, D, generator=g)
    v = torch.randn(P, ps, Hkv, D, generator=g)
    return k, v, ip, idx, last, kv_lens


def _tree_block(g, n, L):
    """A [n, L] FlashInfer mask: the prefix all True, the last n columns a random tree."""
    return torch.cat([torch.ones(n, L - n, dtype=torch.bool), _tree_mask(1, n, g)[0]], 1)


@pytest.mark.parametrize("layout,combined", [("NHD", False), ("HND", False), ("NHD", True), ("HND", True)])
def test_wrapper_matches_flashinfer_semantics(layout, combined):
    g = torch.Generator().manual_seed(11 + 2 * combined + (layout == "HND"))
    I32 = dict(dtype=torch.int32)
    for trial in range(12):
        ps = [1, 4, 16][trial % 3]
        B = int(torch.randint(1, 5, (1,), generator=g))
        ragged = trial % 2 == 1
        qo = torch.randint(1, 6, (B,), generator=g).tolist() if ragged else [int(torch.randint(1, 6, (1,),
                                                                                        generator=g))] * B
        prefix = torch.randint(0, 30, (B,), generator=g).tolist()
        Hkv, D = [(1, 8), (2, 16), (3, 8)][trial % 3]
        Hq = Hkv * [1, 2, 3][(trial // 3) % 3]
        k, v, ip, idx, last, kv_lens = _batch(g, ps, qo, prefix, Hkv, D)
        qp = [0] + np.cumsum(qo).tolist()
        pools = (k, v) if layout == "NHD" else (k.transpose(1, 2).contiguous(), v.transpose(1, 2).contiguous())
        cache = torch.stack(pools, 1) if combined else pools
        q = torch.randn(qp[-1], Hq, D, generator=g)
        flat = torch.cat([_tree_block(g, n, L).flatten() for n, L in zip(qo, kv_lens)])
        packed = torch.from_numpy(np.concatenate([np.packbits(_seg.numpy(), bitorder="little") for _seg in
                                                  torch.split(flat, [n * L for n, L in zip(qo, kv_lens)])]))
        w = fi.BatchPrefillWithPagedKVCacheWrapper(torch.empty(16, dtype=torch.uint8), layout)
        args = (torch.tensor(qp, **I32), torch.tensor(ip, **I32), torch.tensor(idx, **I32), torch.tensor(last, **I32),
                Hq, Hkv, D, ps)
        scale = 0.3 if trial % 4 == 0 else None
        for mode, kw in (("causal", dict(causal=True)), ("none", {}), ("custom", dict(custom_mask=flat)),
                         ("custom", dict(packed_custom_mask=packed, causal=True))):
            w.plan(*args, sm_scale=scale, q_data_type=torch.float32, **kw)
            assert w.num_calls == len(set(qo))
            got = w.run(q, cache)
            want = _fi_semantics(q, k, v, qp, ip, idx, kv_lens, ps, mode, flat, D ** -0.5 if scale is None else scale)
            torch.testing.assert_close(got, want, rtol=2e-5, atol=2e-5)
            buf = torch.full_like(q, float("nan"))
            assert w.run(q, cache, out=buf) is buf and torch.equal(buf, got)


def test_one_plan_serves_every_layer():
    """plan once, run over two layers' pools: each layer's result is its own, and equals a fresh plan's."""
    g = torch.Generator().manual_seed(5)
    ps, qo, prefix, Hkv, D = 4, [3, 3], [7, 0], 2, 8
    layers = [_batch(torch.Generator().manual_seed(s), ps, qo, prefix, Hkv, D) for s in (1, 1)]
    k2 = torch.randn_like(layers[1][0])
    v2 = torch.randn_like(layers[1][1])
    k, v, ip, idx, last, kv_lens = layers[0]
    args = (torch.tensor([0, 3, 6]), torch.tensor(ip), torch.tensor(idx), torch.tensor(last), 4, Hkv, D, ps)
    w = fi.BatchPrefillWithPagedKVCacheWrapper(None, "NHD")
    w.plan(*args, causal=True)
    q = torch.randn(6, 4, D, generator=g)
    a, b = w.run(q, (k, v)), w.run(q, (k2, v2))
    w2 = fi.BatchPrefillWithPagedKVCacheWrapper(None, "NHD")
    w2.plan(*args, causal=True)
    assert torch.equal(a, w2.run(q, (k, v))) and torch.equal(b, w2.run(q, (k2, v2))) and not torch.equal(a, b)
    # the plan keeps its own copy of the page list: the caller may reuse its index buffer
    args[2].fill_(0)
    assert torch.equal(w.run(q, (k, v)), a)


def test_wrapper_errors():
    I32 = dict(dtype=torch.int32)
    qp, ip, idx, last = (torch.tensor(x, **I32) for x in ([0, 2], [0, 2], [3, 1], [2]))
    W = fi.BatchPrefillWithPagedKVCacheWrapper
    with pytest.raises(ValueError, match="BatchPrefillWithPagedKVCacheWrapper: kv_layout must be 'NHD' or 'HND'"):
        W(None, "XYZ")
    with pytest.raises(ValueError, match="use_cuda_graph must be False"):
        W(None, "NHD", use_cuda_graph=True)
    w = W(None, "NHD")
    with pytest.raises(RuntimeError, match=r"run: self must be planned \(call plan\(\) first\)"):
        w.run(torch.zeros(2, 2, 4), (torch.zeros(4, 4, 1, 4),) * 2)
    with pytest.raises(ValueError, match="plan: pos_encoding_mode must be 'NONE'"):
        w.plan(qp, ip, idx, last, 2, 1, 4, 4, pos_encoding_mode="ROPE_LLAMA")
    with pytest.raises(ValueError, match="plan: window_left must be -1"):
        w.plan(qp, ip, idx, last, 2, 1, 4, 4, window_left=16)
    with pytest.raises(ValueError, match="plan: prefix_len_ptr must be absent"):
        w.plan(qp, ip, idx, last, 2, 1, 4, 4, prefix_len_ptr=torch.zeros(1))
    with pytest.raises(ValueError, match="plan: num_qo_heads must be a multiple of num_kv_heads = 2"):
        w.plan(qp, ip, idx, last, 3, 2, 4, 4)
    with pytest.raises(ValueError, match=r"plan: paged_kv_last_page_len must be giving kv_len >= qo_len .* "
                       r"request 0 has kv_len 6 < qo_len 8"):
        w.plan(torch.tensor([0, 8], **I32), ip, idx, last, 2, 1, 4, 4)
    with pytest.raises(ValueError, match=r"plan: qo_indptr must be 0-based and increasing"):
        w.plan(torch.tensor([0, 0], **I32), ip, idx, last, 2, 1, 4, 4)
    bad = torch.ones(2 * 6, dtype=torch.bool)
    bad[1] = False
    with pytest.raises(ValueError, match=r"custom_mask \(request 0\) must be True on every committed-prefix column"):
        w.plan(qp, ip, idx, last, 2, 1, 4, 4, custom_mask=bad)
    with pytest.raises(ValueError, match="custom_mask must be sum of qo_len \\* kv_len = 12 entries"):
        w.plan(qp, ip, idx, last, 2, 1, 4, 4, custom_mask=torch.ones(11, dtype=torch.bool))
    with pytest.raises(ValueError, match="packed_custom_mask must be sum of ceil"):
        w.plan(qp, ip, idx, last, 2, 1, 4, 4, packed_custom_mask=torch.zeros(3, dtype=torch.uint8))
    w.plan(qp, ip, idx, last, 2, 1, 4, 4, causal=True, non_blocking=True)
    pool = (torch.zeros(4, 4, 1, 4),) * 2
    with pytest.raises(ValueError, match=r"run: q must be \[2, 2, 4\]"):
        w.run(torch.zeros(3, 2, 4), pool)
    with pytest.raises(ValueError, match="run: paged_kv_cache must be pages of page_size 4, 1 kv heads, head_dim 4"):
        w.run(torch.zeros(2, 2, 4), (torch.zeros(4, 8, 1, 4),) * 2)
    with pytest.raises(ValueError, match="run: return_lse must be absent"):
        w.run(torch.zeros(2, 2, 4), pool, return_lse=True)
    with pytest.raises(ValueError, match=r"run: out must be a tensor of q's shape"):
        w.run(torch.zeros(2, 2, 4), pool, out=torch.zeros(2, 2, 5))
