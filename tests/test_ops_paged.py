"""The paged KV ops (specdec.paged_ops) against their dense forms, bit for bit.

Dense caches [B, Hkv, S, D] are scattered into page pools [num_pages, page_size, Hkv, D] through
random block tables (shuffled, non-contiguous pages, spare pages left in the pool, pages of a
common prefix shared between requests, -1 padding past the blocks a call touches). The CPU
kernels and the pure-torch reference (specdec.reference_paged) must return exactly what the
dense CPU kernels and specdec.reference return. CUDA runs the same cases against the reference
within tolerance (its paged attention is its own kernel) and exactly for append / commit.
"""
from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from specdec import ops, paged_ops, reference, reference_paged

from conftest import DEVICES, gen, make_trees

PAGE_SIZES = [1, 16, 64]


def paginate(dense: torch.Tensor, page_size: int, g: torch.Generator, share_prefix: int = 0,
             spare: int = 3):
    """Scatter dense [B, H, S, D] into pages; returns (pages, block_tables [B, M] int32).

    Request b >= 1 shares the pages of request 0's first ``share_prefix // page_size`` full blocks
    (the dense rows must hold the same values there, see ``share``)."""
    B, H, S, D = dense.shape
    M = -(-S // page_size)
    shared = share_prefix // page_size
    num_pages = B * M - (B - 1) * shared + spare
    perm = torch.randperm(num_pages, generator=g).tolist()
    tables = torch.empty(B, M, dtype=torch.int32)
    it = iter(perm)
    for b in range(B):
        for j in range(M):
            tables[b, j] = tables[0, j] if b > 0 and j < shared else next(it)
    pages = torch.randn(num_pages, page_size, H, D, generator=g).to(dense.dtype)  # garbage in unused slots
    scatter(pages, tables, dense)
    return pages, tables


def scatter(pages: torch.Tensor, tables: torch.Tensor, dense: torch.Tensor) -> None:
    """Write dense [B, H, S, D] into pages through tables (position s -> its page's slot)."""
    P, ps, H, D = pages.shape
    flat = pages.view(P * ps, H, D)
    pos = torch.arange(dense.shape[2])
    for b in range(dense.shape[0]):
        flat[tables[b].long()[pos // ps] * ps + pos % ps] = dense[b].transpose(0, 1)


def share(dense: torch.Tensor, n: int) -> None:
    """Make every request's first n positions equal to request 0's (a common prefix)."""
    dense[1:, :, :n] = dense[:1, :, :n]


def pad_tables(tables: torch.Tensor, lens: torch.Tensor, Nkv: int, page_size: int) -> torch.Tensor:
    """-1 in every block past the ones positions < lens[b] + Nkv use (the ops must not read them)."""
    t = tables.clone()
    for b in range(t.shape[0]):
        used = -(-(int(lens[b]) + Nkv) // page_size)
        t[b, used:] = -1
    return t


def gather_all(pages, tables, B, S):
    return torch.stack([reference_paged.gather_dense(pages, tables, b, S) for b in range(B)])


def _case(seed, page_size, dtype, mode, B=3, N=5, Hq=6, Hkv=2, D=64, S=150):
    g = gen(seed)
    k = torch.randn(B, Hkv, S, D, generator=g).to(dtype)
    v = torch.randn(B, Hkv, S, D, generator=g).to(dtype)
    prefix = 40 if page_size <= 16 else 64
    share(k, prefix)
    share(v, prefix)
    Nkv = N + 3 if mode == "frontier" else N
    lens = torch.randint(prefix, S - Nkv + 1, (B,), generator=g, dtype=torch.int32)
    lens[0] = S - Nkv  # one full row, the others ragged
    Nq = N
    q = torch.randn(B, Nq, Hq, D, generator=g).to(dtype)
    mask = None
    if mode != "causal":
        _, parents, _ = make_trees(B, Nkv, 7, "mixed", g=g, ragged=True)
        mask = reference.tree_attention_mask(parents)[:, Nkv - Nq:].contiguous()
    kp, tables = paginate(k, page_size, g, share_prefix=prefix)
    vp = torch.randn(kp.shape, generator=g).to(dtype)  # V through the same tables
    scatter(vp, tables, v)
    return dict(q=q, k=k, v=v, kp=kp, vp=vp, tables=pad_tables(tables, lens, Nkv, page_size), full_tables=tables,
                lens=lens, mask=mask, scale=D ** -0.5)


@pytest.mark.parametrize("page_size", PAGE_SIZES)
@pytest.mark.parametrize("mode", ["causal", "tree", "frontier"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=["fp32", "fp16", "bf16"])
def test_verify_attention_paged_equals_dense(page_size, mode, dtype):
    c = _case(1, page_size, dtype, mode)
    want = ops.verify_attention(c["q"], c["k"], c["v"], c["lens"], c["mask"], c["scale"])
    got = paged_ops.verify_attention_paged(c["q"], c["kp"], c["vp"], c["tables"], c["lens"], c["mask"], c["scale"])
    assert torch.equal(got, want)
    ref_dense = reference.verify_attention(c["q"], c["k"], c["v"], c["lens"], c["mask"], c["scale"])
    ref_paged = reference_paged.verify_attention_paged(c["q"], c["kp"], c["vp"], c["tables"], c["lens"], c["mask"],
                                                       c["scale"])
    assert torch.equal(ref_paged, ref_dense)


@pytest.mark.parametrize("page_size", [8, 16, 20, 64, 100, 128])
@pytest.mark.parametrize("D", [40, 64, 72])
def test_verify_attention_paged_head_dims(page_size, D):
    """Head dims that take the copy path (D % 8 != 0) and the in-place one (D = 72: a tail of 8 dims); pages
    read in place per page (16, 20: runs of 8 keys may cross a page, so K is copied; 100: a page larger than a
    key block but not a multiple of it) or per key block (64, 128)."""
    c = _case(2, page_size, torch.float32, "tree", D=D, S=200)
    want = ops.verify_attention(c["q"], c["k"], c["v"], c["lens"], c["mask"], c["scale"])
    got = paged_ops.verify_attention_paged(c["q"], c["kp"], c["vp"], c["tables"], c["lens"], c["mask"], c["scale"])
    assert torch.equal(got, want)


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 2 ** 16), page_size=st.sampled_from([1, 3, 16, 64]), B=st.integers(1, 4),
       N=st.integers(1, 9), group=st.sampled_from([1, 3]), mode=st.sampled_from(["causal", "tree", "frontier"]))
def test_verify_attention_paged_property(seed, page_size, B, N, group, mode):
    c = _case(seed, page_size, torch.float32, mode, B=B, N=N, Hq=2 * group, Hkv=2, S=90)
    want = ops.verify_attention(c["q"], c["k"], c["v"], c["lens"], c["mask"], c["scale"])
    got = paged_ops.verify_attention_paged(c["q"], c["kp"], c["vp"], c["tables"], c["lens"], c["mask"], c["scale"])
    assert torch.equal(got, want)


@pytest.mark.parametrize("page_size", PAGE_SIZES)
@pytest.mark.parametrize("offset", [0, 3])
def test_append_kv_paged_equals_dense(page_size, offset):
    g = gen(3)
    B, H, S, D, N = 3, 2, 70, 64, 5
    k = torch.randn(B, H, S, D, generator=g)
    v = torch.randn(B, H, S, D, generator=g)
    kp, tables = paginate(k, page_size, g)
    vp = torch.randn(kp.shape, generator=g)
    scatter(vp, tables, v)
    lens = torch.tensor([0, 17, S - N - offset], dtype=torch.int32)
    kn = torch.randn(B, H, N, D, generator=g)
    vn = torch.randn(B, H, N, D, generator=g).transpose(2, 3).contiguous().transpose(2, 3)  # strided input
    ops.append_kv(k, v, kn, vn, lens, offset)
    kp2, vp2 = kp.clone(), vp.clone()
    paged_ops.append_kv_paged(kp, vp, kn, vn, tables, lens, offset)
    reference_paged.append_kv_paged(kp2, vp2, kn, vn, tables, lens, offset)
    assert torch.equal(kp, kp2) and torch.equal(vp, vp2)
    assert torch.equal(gather_all(kp, tables, B, S), k) and torch.equal(gather_all(vp, tables, B, S), v)


def _commit_case(seed, page_size, S=60, N=6):
    g = gen(seed)
    B = 4
    dims = [(2, 64), (1, 40)]  # layers may differ in Hkv and D
    ks = [torch.randn(B, h, S, d, generator=g) for h, d in dims]
    vs = [torch.randn(B, h, S, d, generator=g) for h, d in dims]
    _, tables = paginate(ks[0], page_size, g)
    kps, vps = [], []
    for t, out in [(t, kps) for t in ks] + [(t, vps) for t in vs]:
        p = torch.randn(tables.numel() + 3, page_size, t.shape[1], t.shape[3], generator=g)
        scatter(p, tables, t)
        out.append(p)
    accepted = torch.tensor([[0, 2, 4, -1, -1, -1], [0, -1, -1, -1, -1, -1], [0, 1, 2, 3, 4, 5],
                             [0, 1, 3, 5, -1, -1]], dtype=torch.int32)
    num = torch.tensor([2, 0, 5, 3], dtype=torch.int32)
    lens = torch.randint(0, S - N + 1, (B,), generator=g, dtype=torch.int32)
    return ks, vs, kps, vps, tables, lens, accepted, num


@pytest.mark.parametrize("page_size", PAGE_SIZES)
def test_kv_commit_paged_equals_dense(page_size):
    ks, vs, kps, vps, tables, lens, accepted, num = _commit_case(5, page_size)
    B, S = ks[0].shape[0], ks[0].shape[2]
    lens_d, lens_p, lens_r = lens.clone(), lens.clone(), lens.clone()
    ref_k, ref_v = [p.clone() for p in kps], [p.clone() for p in vps]
    ops.kv_commit(ks, vs, lens_d, accepted, num)
    paged_ops.kv_commit_paged(kps, vps, tables, lens_p, accepted, num)
    reference_paged.kv_commit_paged(ref_k, ref_v, tables, lens_r, accepted, num)
    assert torch.equal(lens_p, lens_d) and torch.equal(lens_r, lens_d)
    for dense, paged, ref in zip(ks + vs, kps + vps, ref_k + ref_v):
        assert torch.equal(paged, ref)
        assert torch.equal(gather_all(paged, tables, B, S), dense)


def test_kv_commit_paged_chain_moves_nothing():
    ks, vs, kps, vps, tables, lens, _, _ = _commit_case(6, 16)
    accepted = torch.arange(6, dtype=torch.int32).repeat(4, 1)
    num = torch.tensor([5, 0, 3, 1], dtype=torch.int32)
    before = [p.clone() for p in kps + vps]
    paged_ops.kv_commit_paged(kps, vps, tables, lens, accepted, num)
    assert all(torch.equal(a, b) for a, b in zip(before, kps + vps))


def test_commit_block_table_page_size_1():
    """Page size 1: rewriting the table gives the reads of the byte-moving commit; no page changes."""
    ks, vs, kps, vps, tables, lens, accepted, num = _commit_case(7, 1)
    B = ks[0].shape[0]
    t2, lens2 = tables.clone(), lens.clone()
    before = [p.clone() for p in kps]
    freed = paged_ops.commit_block_table(t2, lens2, accepted, num)
    ops.kv_commit(ks, vs, lens, accepted, num)
    assert torch.equal(lens2, lens)
    assert all(torch.equal(a, b) for a, b in zip(before, kps))
    for dense, paged in zip(ks, kps):
        for b in range(B):
            n = int(lens[b])
            assert torch.equal(reference_paged.gather_dense(paged, t2, b, n), dense[b, :, :n])
    for b in range(B):
        assert len(freed[b]) == accepted.shape[1] - 1 - int(num[b])
        assert not set(freed[b]) & set(t2[b, :int(lens[b])].tolist())


# --------------------------------------------------------------------------- errors
def _err_args(page_size=16):
    return _case(9, page_size, torch.float32, "tree", B=2)


def test_verify_attention_paged_errors():
    c = _err_args()
    f = paged_ops.verify_attention_paged
    with pytest.raises(RuntimeError, match=r"verify_attention_paged: block_tables must be int32"):
        f(c["q"], c["kp"], c["vp"], c["tables"].long(), c["lens"], c["mask"])
    bad = c["tables"].clone()
    bad[1, 0] = c["kp"].shape[0]
    with pytest.raises(RuntimeError, match=r"verify_attention_paged: block_tables\[1, 0\] = \d+ must name a page"):
        f(c["q"], c["kp"], c["vp"], bad, c["lens"], c["mask"])
    lens = c["lens"].clone()
    lens[0] = c["tables"].shape[1] * 16
    with pytest.raises(RuntimeError, match=r"verify_attention_paged: cache_lens\[0\] = \d+ leaves no room"):
        f(c["q"], c["kp"], c["vp"], c["tables"], lens, c["mask"])
    with pytest.raises(RuntimeError, match=r"verify_attention_paged: k_pages must have its head dim D contiguous"):
        f(c["q"], c["kp"][:1].expand_as(c["kp"]), c["vp"], c["tables"], c["lens"], c["mask"])
    with pytest.raises(RuntimeError, match=r"verify_attention_paged: k_pages must be \[num_pages, page_size, Hkv, D\]"):
        f(c["q"], c["kp"][0], c["vp"][0], c["tables"], c["lens"], c["mask"])
    with pytest.raises(RuntimeError, match=r"verify_attention_paged: q heads Hq = 6 must be a multiple"):
        f(c["q"], c["kp"].repeat(1, 1, 2, 1), c["vp"].repeat(1, 1, 2, 1), c["tables"], c["lens"], c["mask"])


def test_append_and_commit_paged_errors():
    c = _err_args()
    kp, vp, tables, lens = c["kp"], c["vp"], c["tables"], c["lens"]
    kn = torch.randn(2, 2, 3, 64)
    with pytest.raises(RuntimeError, match=r"append_kv_paged: k_pages and v_pages share memory"):
        paged_ops.append_kv_paged(kp, kp, kn, kn, tables, lens)
    with pytest.raises(RuntimeError, match=r"append_kv_paged: k_new must be \[B, Hkv, N, D\]"):
        paged_ops.append_kv_paged(kp, vp, kn[:, :1], kn[:, :1], tables, lens)
    with pytest.raises(RuntimeError, match=r"append_kv_paged: offset must be >= 0"):
        paged_ops.append_kv_paged(kp, vp, kn, kn, tables, lens, -1)
    bad = tables.clone()
    bad[0] = -1
    with pytest.raises(RuntimeError, match=r"append_kv_paged: block_tables\[0, \d+\] = -1 must name a page"):
        paged_ops.append_kv_paged(kp, vp, kn, kn, bad, lens)
    acc = torch.tensor([[0, 2, 1], [0, 1, 2]], dtype=torch.int32)
    num = torch.tensor([2, 1], dtype=torch.int32)
    with pytest.raises(RuntimeError, match=r"kv_commit_paged: accepted\[0, 2\] = 1 must be a node index"):
        paged_ops.kv_commit_paged([kp], [vp], tables, lens.clone(), acc, num)
    with pytest.raises(RuntimeError, match=r"kv_commit_paged: k_pages\[1\] must have \d+ pages of 16 slots"):
        paged_ops.kv_commit_paged([kp, kp[:1]], [vp, vp[:1].clone()], tables, lens.clone(), acc, num)
    with pytest.raises(RuntimeError, match=r"kv_commit_paged: v_pages must hold as many layers"):
        paged_ops.kv_commit_paged([kp], [], tables, lens.clone(), acc, num)
    # nothing was written by any failing call
    assert torch.equal(kp, c["kp"])
    with pytest.raises(TypeError, match=r"commit_block_table: block_tables must be an int32 CPU tensor"):
        paged_ops.commit_block_table(tables.long(), lens.clone(), acc, num)


def test_paged_overlap_errors_name_both_tensors():
    c = _err_args()
    kp, vp, tables, lens = c["kp"], c["vp"], c["tables"], c["lens"]
    kn = torch.randn(2, 2, 3, 64)
    in_v = vp.view(-1)[:kn.numel()].view(kn.shape)  # a k_new that is part of v_pages
    with pytest.raises(RuntimeError, match=r"append_kv_paged: v_pages and k_new share memory"):
        paged_ops.append_kv_paged(kp, vp, in_v, kn, tables, lens)
    acc = torch.tensor([[0, 1, 2], [0, 2, -1]], dtype=torch.int32)
    num = torch.tensor([2, 1], dtype=torch.int32)
    kp2, vp2 = kp.clone(), vp.clone()
    with pytest.raises(RuntimeError, match=r"kv_commit_paged: k_pages\[0\] and v_pages\[1\] share memory"):
        paged_ops.kv_commit_paged([kp, kp2], [vp, kp], tables, lens.clone(), acc, num)
    with pytest.raises(RuntimeError, match=r"kv_commit_paged: v_pages\[1\] and cache_lens share memory"):
        paged_ops.kv_commit_paged([kp, kp2], [vp, vp2], tables, vp2.view(torch.int32).view(-1)[:2], acc, num)
    with pytest.raises(RuntimeError, match=r"kv_commit_paged: cache_lens and accepted share memory"):
        paged_ops.kv_commit_paged([kp, kp2], [vp, vp2], tables, acc[:, 0], acc, num)
    assert torch.equal(kp, c["kp"]) and torch.equal(vp, c["vp"]) and torch.equal(kp2, kp)


# --------------------------------------------------------------------------- CUDA
@pytest.mark.parametrize("device", [p for p in DEVICES if p.id == "cuda"])
@pytest.mark.parametrize("page_size", PAGE_SIZES)
@pytest.mark.parametrize("mode", ["causal", "tree", "frontier"])
def test_paged_ops_cuda(device, page_size, mode):
    c = _case(11, page_size, torch.float32, mode)
    want = reference_paged.verify_attention_paged(c["q"], c["kp"], c["vp"], c["tables"], c["lens"], c["mask"],
                                                  c["scale"])
    cu = {k: (v.to(device) if isinstance(v, torch.Tensor) else v) for k, v in c.items()}
    got = paged_ops.verify_attention_paged(cu["q"], cu["kp"], cu["vp"], cu["tables"], cu["lens"], cu["mask"],
                                           cu["scale"])
    torch.testing.assert_close(got.cpu(), want, atol=2e-5, rtol=2e-5)
    ks, vs, kps, vps, tables, lens, accepted, num = _commit_case(12, page_size)
    ref_k, ref_v, ref_lens = [p.clone() for p in kps], [p.clone() for p in vps], lens.clone()
    reference_paged.kv_commit_paged(ref_k, ref_v, tables, ref_lens, accepted, num)
    dk, dv, dl = [p.to(device) for p in kps], [p.to(device) for p in vps], lens.to(device)
    paged_ops.kv_commit_paged(dk, dv, tables.to(device), dl, accepted.to(device), num.to(device))
    assert torch.equal(dl.cpu(), ref_lens)
    assert all(torch.equal(a.cpu(), b) for a, b in zip(dk + dv, ref_k + ref_v))
    kn = torch.randn(4, 2, 3, 64)
    ref = kps[0].clone(), vps[0].clone()
    reference_paged.append_kv_paged(*ref, kn, kn, tables, ref_lens)
    d = kps[0].to(device), vps[0].to(device)
    paged_ops.append_kv_paged(*d, kn.to(device), kn.to(device), tables.to(device), ref_lens.to(device))
    assert torch.equal(d[0].cpu(), ref[0]) and torch.equal(d[1].cpu(), ref[1])


@pytest.mark.parametrize("page_size", [16, 64])
@pytest.mark.parametrize("mode", ["causal", "tree"])
def test_attention_prefetch_distance_does_not_change_the_bits(page_size, mode):
    """The CPU kernel's software prefetch of K / V blocks ahead (``_C.set_attention_prefetch``) only asks
    for lines earlier: dense and paged outputs are the same bits at every distance, and past the last
    block (a distance longer than the prefix) nothing is read from outside the request's pages (the
    tables hold -1 there)."""
    from specdec import _C
    c = _case(5, page_size, torch.float32, mode, S=300)
    was = _C.set_attention_prefetch(0)
    try:
        want = ops.verify_attention(c["q"], c["k"], c["v"], c["lens"], c["mask"], c["scale"])
        want_paged = paged_ops.verify_attention_paged(c["q"], c["kp"], c["vp"], c["tables"], c["lens"], c["mask"],
                                                      c["scale"])
        assert torch.equal(want_paged, want)
        for blocks in (1, 2, 64):
            _C.set_attention_prefetch(blocks)
            assert torch.equal(ops.verify_attention(c["q"], c["k"], c["v"], c["lens"], c["mask"], c["scale"]),
                               want), blocks
            got = paged_ops.verify_attention_paged(c["q"], c["kp"], c["vp"], c["tables"], c["lens"], c["mask"],
                                                   c["scale"])
            assert torch.equal(got, want), blocks
        with pytest.raises(RuntimeError, match=r"set_attention_prefetch: blocks must be in 0\.\.64, got 65"):
            _C.set_attention_prefetch(65)
        assert _C.set_attention_prefetch(2) == 64
    finally:
        _C.set_attention_prefetch(was)
