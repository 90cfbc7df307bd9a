"""verify_attention and append_kv against specdec.reference (CPU always, CUDA when present).

Tolerances (decided up front, never tuned to a kernel):

* fp32 inputs: ``atol = rtol = 1e-5`` against the reference. Both compute in fp32 and
  differ only in summation order and exp implementation. The output is a convex
  combination of at most n = prefix + N <= ~540 value rows; a random-walk rounding
  model gives |error| ~ sqrt(n) * eps_fp32 * max|v| ~ 23 * 6e-8 * 4 ~ 6e-6, and the
  score rounding adds ~ sqrt(D) * eps relative on the weights. 1e-5 covers that;
  every indexing / masking / GQA-mapping bug we know of moves outputs by >= 1e-2.
* fp16 / bf16 inputs: the flash-attention criterion. With an fp64 oracle computed from
  the same (upcast) inputs, the kernel's max abs error must be at most 2x the max abs
  error of the same attention computed by torch in the low-precision dtype
  (scores, softmax and P @ V all in fp16 / bf16). The reference itself must pass the
  same criterion (it does fp32 math and rounds once at the end).
* append_kv is a copy: caches must be bitwise equal to the reference's (torch.equal).
"""
from __future__ import annotations

from typing import Optional

import pytest
import torch

from specdec import ops, reference

from conftest import DEVICES, FLOAT_DTYPES, gen, make_trees

FP32_ATOL = 1e-5
FP32_RTOL = 1e-5
LOWP_FACTOR = 2.0

# batch 7 with prefixes 0, 1 and several hundred; N = 13 (odd, not a tile multiple)
LENS_7 = [0, 1, 300, 13, 517, 2, 64]
HEADS = {"gqa3": (6, 2), "mha": (6, 6), "mqa": (6, 1)}


# --------------------------------------------------------------------------- helpers
def attention_in(q, k_cache, v_cache, cache_lens, tree_mask, scale, dtype) -> torch.Tensor:
    """The same attention computed by torch entirely in ``dtype`` (float64 = the oracle).

    Runs on the CPU, one request at a time, only over positions < cache_lens[b] + Nkv.
    """
    q, k_cache, v_cache, cache_lens = q.cpu(), k_cache.cpu(), v_cache.cpu(), cache_lens.cpu()
    B, N, Hq, D = q.shape
    group = Hq // k_cache.shape[1]
    if tree_mask is None:
        tree = torch.ones(N, N, dtype=torch.bool).tril().expand(B, N, N)
    else:
        tree = tree_mask.cpu()
    Nkv = tree.shape[2]  # queries = the last N of Nkv new nodes
    out = torch.zeros(B, N, Hq, D, dtype=dtype)
    for b in range(B):
        L = int(cache_lens[b])
        k = k_cache[b, :, : L + Nkv].to(dtype).repeat_interleave(group, dim=0)  # [Hq, L+Nkv, D]
        v = v_cache[b, :, : L + Nkv].to(dtype).repeat_interleave(group, dim=0)
        qb = q[b].to(dtype).transpose(0, 1)  # [Hq, N, D]
        scores = torch.matmul(qb, k.transpose(1, 2)) * scale  # [Hq, N, L+N]
        visible = torch.cat([torch.ones(N, L, dtype=torch.bool), tree[b]], dim=1)
        probs = torch.softmax(scores.masked_fill(~visible, float("-inf")), dim=-1)
        probs = torch.nan_to_num(probs, nan=0.0)  # a query that sees nothing -> 0
        out[b] = torch.matmul(probs, v).transpose(0, 1)
    return out


def assert_attention_close(out, q, k_cache, v_cache, cache_lens, tree_mask, scale) -> None:
    """The tolerance policy of the module docstring."""
    assert out.shape == q.shape and out.dtype == q.dtype and out.device == q.device
    out = out.cpu()
    args = (q.cpu(), k_cache.cpu(), v_cache.cpu(), cache_lens.cpu(),
            None if tree_mask is None else tree_mask.cpu(), scale)
    ref = reference.verify_attention(*args)
    assert torch.isfinite(out).all(), "non-finite attention output"
    if q.dtype == torch.float32:
        torch.testing.assert_close(out, ref, atol=FP32_ATOL, rtol=FP32_RTOL)
        return
    oracle = attention_in(*args, dtype=torch.float64)
    lowp = attention_in(*args, dtype=q.dtype)
    err_lowp = (lowp.double() - oracle).abs().max().item()
    err_ref = (ref.double() - oracle).abs().max().item()
    err = (out.double() - oracle).abs()
    worst = divmod(int(err.argmax()), err[0].numel())[0]
    assert err_ref <= LOWP_FACTOR * err_lowp, f"reference error {err_ref} vs torch {q.dtype} {err_lowp}"
    assert err.max().item() <= LOWP_FACTOR * err_lowp, (
        f"kernel max error {err.max().item():.3g} (worst in request {worst}) > {LOWP_FACTOR} x "
        f"torch-{q.dtype} error {err_lowp:.3g}; reference error {err_ref:.3g}")


def make_case(B, N, Hq, Hkv, D, lens, dtype, *, seed, tail=100.0, extra=7):
    """q, caches and lens; the cache past cache_lens + N holds `tail`-scaled junk."""
    g = gen(seed)
    S = max(lens) + N + extra
    q = torch.randn(B, N, Hq, D, generator=g).to(dtype)
    k_cache = torch.randn(B, Hkv, S, D, generator=g)
    v_cache = torch.randn(B, Hkv, S, D, generator=g)
    for b, L in enumerate(lens):  # junk past the window: must never be read
        k_cache[b, :, L + N:] *= tail
        v_cache[b, :, L + N:] *= tail
    cache_lens = torch.tensor(lens, dtype=torch.int32)
    return q, k_cache.to(dtype), v_cache.to(dtype), cache_lens


def make_mask(kind: str, B: int, N: int, *, seed: int) -> Optional[torch.Tensor]:
    if kind == "causal":
        return None
    g = gen(seed + 1)
    if kind == "tree":  # ancestor masks of random trees, ragged (padding nodes see themselves)
        _, parents, _ = make_trees(B, N, 5, "mixed", g=g, ragged=True)
        return reference.tree_attention_mask(parents)
    if kind == "random":  # any bool mask, including all-false rows
        m = torch.rand(B, N, N, generator=g) < 0.5
        m[:, N // 2] = False
        return m
    raise ValueError(kind)


def run(device, q, k_cache, v_cache, cache_lens, tree_mask, scale=None):
    dev = lambda t: None if t is None else t.to(device)  # noqa: E731
    return ops.verify_attention(dev(q), dev(k_cache), dev(v_cache), dev(cache_lens), dev(tree_mask), scale)


# --------------------------------------------------------------------------- verify_attention
@pytest.mark.parametrize("mask_kind", ["causal", "tree", "random"])
@pytest.mark.parametrize("D", [64, 80, 128])
@pytest.mark.parametrize("heads", list(HEADS))
@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
@pytest.mark.parametrize("device", DEVICES)
def test_verify_attention_matches_reference(device, dtype, heads, D, mask_kind):
    Hq, Hkv = HEADS[heads]
    B, N = len(LENS_7), 13
    seed = 1000 + D + 7 * Hkv
    q, k, v, lens = make_case(B, N, Hq, Hkv, D, LENS_7, dtype, seed=seed)
    mask = make_mask(mask_kind, B, N, seed=seed)
    out = run(device, q, k, v, lens, mask)
    assert_attention_close(out, q, k, v, lens, mask, D ** -0.5)


@pytest.mark.parametrize("D", [96, 256])
@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
@pytest.mark.parametrize("device", DEVICES)
def test_verify_attention_other_head_dims(device, dtype, D):
    B, N, Hq, Hkv = 3, 13, 4, 2
    lens = [0, 1, 301]
    q, k, v, cl = make_case(B, N, Hq, Hkv, D, lens, dtype, seed=D)
    mask = make_mask("tree", B, N, seed=D)
    assert_attention_close(run(device, q, k, v, cl, mask), q, k, v, cl, mask, D ** -0.5)


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
@pytest.mark.parametrize("device", DEVICES)
def test_verify_attention_long_prefix(device, dtype):
    """Prefixes of thousands (the split-sequence paths), B = 2, GQA 4, N = 16."""
    B, N, Hq, Hkv, D = 2, 16, 8, 2, 128
    lens = [4099, 1500]
    q, k, v, cl = make_case(B, N, Hq, Hkv, D, lens, dtype, seed=7)
    mask = make_mask("tree", B, N, seed=7)
    assert_attention_close(run(device, q, k, v, cl, mask), q, k, v, cl, mask, D ** -0.5)


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
@pytest.mark.parametrize("device", DEVICES)
def test_verify_attention_single_node(device, dtype):
    """N = 1 (a plain decode step through the same op), causal and explicit mask."""
    B, N, Hq, Hkv, D = 7, 1, 6, 2, 64
    q, k, v, cl = make_case(B, N, Hq, Hkv, D, LENS_7, dtype, seed=11)
    for mask in (None, torch.ones(B, 1, 1, dtype=torch.bool)):
        assert_attention_close(run(device, q, k, v, cl, mask), q, k, v, cl, mask, D ** -0.5)


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
@pytest.mark.parametrize("device", DEVICES)
def test_verify_attention_explicit_scale(device, dtype):
    B, N, Hq, Hkv, D = 7, 13, 6, 2, 80
    q, k, v, cl = make_case(B, N, Hq, Hkv, D, LENS_7, dtype, seed=12)
    mask = make_mask("tree", B, N, seed=12)
    for scale in (0.37, 1.0 / 64):
        assert_attention_close(run(device, q, k, v, cl, mask, scale), q, k, v, cl, mask, scale)


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
@pytest.mark.parametrize("device", DEVICES)
def test_verify_attention_query_that_sees_nothing_is_zero(device, dtype):
    """Empty prefix + an all-false mask row: exactly zero output, no NaN (documented)."""
    B, N, Hq, Hkv, D = 2, 5, 4, 2, 64
    q, k, v, cl = make_case(B, N, Hq, Hkv, D, [0, 0], dtype, seed=13)
    mask = reference.tree_attention_mask(torch.tensor([[-1, 0, 1, 1, 2]] * 2, dtype=torch.int32))
    mask[0, 2] = False
    mask[1, :] = False
    out = run(device, q, k, v, cl, mask).cpu()
    assert torch.equal(out[1], torch.zeros_like(out[1]))
    assert torch.equal(out[0, 2], torch.zeros_like(out[0, 2]))
    assert_attention_close(out.to(device), q.to(device), k, v, cl, mask, D ** -0.5)


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
@pytest.mark.parametrize("device", DEVICES)
def test_verify_attention_never_reads_past_the_tree(device, dtype):
    """Positions >= cache_lens[b] + N may hold anything (torch.empty caches): NaN / inf there
    must not reach the output."""
    B, N, Hq, Hkv, D = 7, 13, 6, 2, 64
    q, k, v, cl = make_case(B, N, Hq, Hkv, D, LENS_7, dtype, seed=14)
    for b, L in enumerate(LENS_7):
        k[b, :, L + N:] = float("nan")
        v[b, :, L + N:] = float("inf")
    mask = make_mask("tree", B, N, seed=14)
    assert_attention_close(run(device, q, k, v, cl, mask), q, k, v, cl, mask, D ** -0.5)


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
@pytest.mark.parametrize("device", DEVICES)
def test_verify_attention_noncontiguous_q(device, dtype):
    """q straight out of a [B, Hq, N, D] projection, viewed as [B, N, Hq, D] (no contiguity
    requirement on q in the contract)."""
    B, N, Hq, Hkv, D = 7, 13, 6, 2, 64
    q, k, v, cl = make_case(B, N, Hq, Hkv, D, LENS_7, dtype, seed=15)
    q_t = q.transpose(1, 2).contiguous().transpose(1, 2)
    assert not q_t.is_contiguous() and torch.equal(q_t, q)
    mask = make_mask("tree", B, N, seed=15)
    assert_attention_close(run(device, q_t, k, v, cl, mask), q, k, v, cl, mask, D ** -0.5)


def misaligned(t: torch.Tensor) -> torch.Tensor:
    """A contiguous copy of t whose data pointer is one element past a 16-byte boundary
    (a view into a larger buffer): vectorized loads must fall back, not fault."""
    buf = torch.empty(t.numel() + 1, dtype=t.dtype, device=t.device)
    out = buf[1:].view(t.shape)
    out.copy_(t)
    assert out.is_contiguous() and out.data_ptr() % 16 != 0
    return out


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
@pytest.mark.parametrize("device", DEVICES)
def test_verify_attention_misaligned_inputs(device, dtype):
    B, N, Hq, Hkv, D = 3, 13, 6, 2, 80
    q, k, v, cl = make_case(B, N, Hq, Hkv, D, [0, 1, 300], dtype, seed=18)
    mask = make_mask("tree", B, N, seed=18)
    out = ops.verify_attention(misaligned(q.to(device)), misaligned(k.to(device)), misaligned(v.to(device)),
                               cl.to(device), mask.to(device))
    assert_attention_close(out, q.to(device), k, v, cl, mask, D ** -0.5)


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
@pytest.mark.parametrize("device", DEVICES)
def test_append_kv_misaligned(device, dtype):
    k_cache, v_cache, k_new, v_new, lens = _append_case(dtype, seed=24, B=3, N=13, D=64)
    want_k, want_v = k_cache.clone(), v_cache.clone()
    reference.append_kv(want_k, want_v, k_new, v_new, lens)
    kc, vc = misaligned(k_cache.to(device)), misaligned(v_cache.to(device))
    ops.append_kv(kc, vc, misaligned(k_new.to(device)), misaligned(v_new.to(device)), lens.to(device))
    assert torch.equal(kc.cpu(), want_k) and torch.equal(vc.cpu(), want_v)


@pytest.mark.parametrize("Nq,Nkv", [(1, 5), (4, 13), (3, 70)])
@pytest.mark.parametrize("mask_kind", ["tree", "random"])
@pytest.mark.parametrize("D", [64, 128])
@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
@pytest.mark.parametrize("device", DEVICES)
def test_verify_attention_frontier_queries(device, dtype, D, mask_kind, Nq, Nkv):
    """Queries for the LAST Nq of a step's Nkv new nodes, mask [B, Nq, Nkv] (dynamic draft trees).

    Nkv = 70 needs two mask words per row. The cache past cache_lens + Nkv holds junk."""
    Hq, Hkv = HEADS["gqa3"]
    B = len(LENS_7)
    seed = 3000 + D + Nkv
    q_all, k, v, lens = make_case(B, Nkv, Hq, Hkv, D, LENS_7, dtype, seed=seed)
    full = make_mask(mask_kind, B, Nkv, seed=seed)
    q, mask = q_all[:, Nkv - Nq:].contiguous(), full[:, Nkv - Nq:].contiguous()
    out = run(device, q, k, v, lens, mask)
    assert_attention_close(out, q, k, v, lens, mask, D ** -0.5)
    if dtype == torch.float32:
        # the same rows of the all-nodes call: frontier queries are positioned at the end
        want = run(device, q_all, k, v, lens, full)[:, Nkv - Nq:]
        torch.testing.assert_close(out, want, atol=FP32_ATOL, rtol=FP32_RTOL)


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
@pytest.mark.parametrize("device", DEVICES)
def test_append_kv_at_offset(device, dtype):
    """append_kv(offset=o) writes at cache_lens[b] + o + j; cache_lens unchanged; the rest untouched."""
    k_cache, v_cache, k_new, v_new, _ = _append_case(dtype, seed=25, B=3, N=5, D=64)
    lens = torch.tensor([0, 7, 20], dtype=torch.int32)
    S = k_cache.shape[2]
    for offset in (0, 1, S - 5 - int(lens.max())):
        want_k, want_v = k_cache.clone(), v_cache.clone()
        reference.append_kv(want_k, want_v, k_new, v_new, lens, offset)
        kc, vc, cl = (t.to(device, copy=True) for t in (k_cache, v_cache, lens))
        ops.append_kv(kc, vc, k_new.to(device), v_new.to(device), cl, offset)
        assert torch.equal(kc.cpu(), want_k) and torch.equal(vc.cpu(), want_v)
        assert torch.equal(cl.cpu(), lens)
        b = 1
        start = int(lens[b]) + offset
        assert torch.equal(kc[b, :, start:start + 5].cpu(), k_new[b])


@pytest.mark.parametrize("device", DEVICES)
def test_verify_attention_inputs_unchanged(device):
    B, N, Hq, Hkv, D = 3, 13, 6, 2, 64
    q, k, v, cl = make_case(B, N, Hq, Hkv, D, [0, 1, 300], torch.float16, seed=16)
    mask = make_mask("tree", B, N, seed=16)
    args = [t.to(device) for t in (q, k, v, cl, mask)]
    before = [t.clone() for t in args]
    ops.verify_attention(*args)
    for a, b in zip(args, before):
        assert torch.equal(a, b)


def test_reference_attention_matches_fp64_oracle():
    """Sanity of the oracle itself: the fp32 reference is within the fp32 tolerance of fp64."""
    B, N, Hq, Hkv, D = 7, 13, 6, 2, 80
    q, k, v, cl = make_case(B, N, Hq, Hkv, D, LENS_7, torch.float32, seed=17)
    mask = make_mask("tree", B, N, seed=17)
    ref = reference.verify_attention(q, k, v, cl, mask, D ** -0.5)
    oracle = attention_in(q, k, v, cl, mask, D ** -0.5, torch.float64)
    torch.testing.assert_close(ref.double(), oracle, atol=FP32_ATOL, rtol=FP32_RTOL)


# --------------------------------------------------------------------------- append_kv
def _append_case(dtype, seed, B=7, Hkv=2, N=13, D=80, S=64):
    g = gen(seed)
    k_cache = torch.randn(B, Hkv, S, D, generator=g).to(dtype)
    v_cache = torch.randn(B, Hkv, S, D, generator=g).to(dtype)
    k_new = torch.randn(B, Hkv, N, D, generator=g).to(dtype)
    v_new = torch.randn(B, Hkv, N, D, generator=g).to(dtype)
    lens = torch.tensor([0, 1, S - N, 17, 30, 2, S - N - 1][:B], dtype=torch.int32)
    return k_cache, v_cache, k_new, v_new, lens


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
@pytest.mark.parametrize("device", DEVICES)
def test_append_kv_matches_reference(device, dtype):
    k_cache, v_cache, k_new, v_new, lens = _append_case(dtype, seed=20)
    want_k, want_v = k_cache.clone(), v_cache.clone()
    reference.append_kv(want_k, want_v, k_new, v_new, lens)
    kc, vc, cl = (t.to(device, copy=True) for t in (k_cache, v_cache, lens))
    ops.append_kv(kc, vc, k_new.to(device), v_new.to(device), cl)
    assert torch.equal(kc.cpu(), want_k) and torch.equal(vc.cpu(), want_v)
    assert torch.equal(cl.cpu(), lens), "append_kv must not change cache_lens"


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
@pytest.mark.parametrize("device", DEVICES)
def test_append_kv_noncontiguous_new(device, dtype):
    """k_new / v_new as views of [B, N, Hkv, D] projections (the contract requires
    contiguity of the caches only)."""
    k_cache, v_cache, k_new, v_new, lens = _append_case(dtype, seed=21, B=5, N=13, D=64)
    k_view = k_new.transpose(1, 2).contiguous().transpose(1, 2)
    v_view = v_new.transpose(1, 2).contiguous().transpose(1, 2)
    assert not k_view.is_contiguous()
    want_k, want_v = k_cache.clone(), v_cache.clone()
    reference.append_kv(want_k, want_v, k_new, v_new, lens)
    kc, vc = k_cache.to(device, copy=True), v_cache.to(device, copy=True)
    ops.append_kv(kc, vc, k_view.to(device), v_view.to(device), lens.to(device))
    assert torch.equal(kc.cpu(), want_k) and torch.equal(vc.cpu(), want_v)


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
@pytest.mark.parametrize("device", DEVICES)
def test_append_then_verify(device, dtype):
    """The decode-step usage: append the tree's K/V, then attend over prefix + tree."""
    B, N, Hq, Hkv, D = 7, 13, 6, 2, 128
    q, k, v, cl = make_case(B, N, Hq, Hkv, D, LENS_7, dtype, seed=22)
    g = gen(23)
    k_new = torch.randn(B, Hkv, N, D, generator=g).to(dtype)
    v_new = torch.randn(B, Hkv, N, D, generator=g).to(dtype)
    mask = make_mask("tree", B, N, seed=22)
    want_k, want_v = k.clone(), v.clone()
    reference.append_kv(want_k, want_v, k_new, v_new, cl)
    kc, vc, cld = (t.to(device, copy=True) for t in (k, v, cl))
    ops.append_kv(kc, vc, k_new.to(device), v_new.to(device), cld)
    assert torch.equal(kc.cpu(), want_k) and torch.equal(vc.cpu(), want_v)
    out = ops.verify_attention(q.to(device), kc, vc, cld, mask.to(device))
    assert_attention_close(out, q, want_k, want_v, cl, mask, D ** -0.5)


# --------------------------------------------------------------------------- the review's GPU list
# Places a first GPU run must hit (named by the review of the never-run CUDA kernels); they
# run on the CPU as well, where the same contract applies.
@pytest.mark.parametrize("D", [64, 80, 96, 128, 256])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("device", DEVICES)
def test_review_lowp_head_dims_gqa4_random_trees(device, dtype, D):
    B, N, Hq, Hkv = 3, 11, 8, 2
    q, k, v, cl = make_case(B, N, Hq, Hkv, D, [0, 37, 300], dtype, seed=100 + D)
    mask = make_mask("tree", B, N, seed=100 + D)
    assert_attention_close(run(device, q, k, v, cl, mask), q, k, v, cl, mask, D ** -0.5)


@pytest.mark.parametrize("B", [32, 1], ids=["B32_one_split", "B1_many_splits"])
@pytest.mark.parametrize("device", DEVICES)
def test_review_long_cache_nan_tail(device, B):
    """cache_lens ~ 5000 in S = 8192, everything past cache_lens + N is NaN."""
    N, Hq, Hkv, D, S = 4, 4, 1, 64, 8192
    g = gen(101)
    lens = (4990 + torch.randint(0, 20, (B,), generator=g)).to(torch.int32)
    q = torch.randn(B, N, Hq, D, generator=g).half()
    k = torch.randn(B, Hkv, S, D, generator=g).half()
    v = torch.randn(B, Hkv, S, D, generator=g).half()
    for b in range(B):
        k[b, :, int(lens[b]) + N:] = float("nan")
        v[b, :, int(lens[b]) + N:] = float("nan")
    mask = make_mask("tree", B, N, seed=101)
    assert_attention_close(run(device, q, k, v, lens, mask), q, k, v, lens, mask, D ** -0.5)


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
@pytest.mark.parametrize("device", DEVICES)
def test_review_huge_capacity_empty_prefix(device, dtype):
    """B = 1, Hkv = 1, S = 65536, cache_lens = 0: a row that sees nothing is exactly zero, a
    row that sees only the last node is exactly that node's value, no NaN anywhere."""
    N, Hq, D, S = 3, 4, 64, 65536
    g = gen(102)
    q = torch.randn(1, N, Hq, D, generator=g).to(dtype)
    k = torch.full((1, 1, S, D), float("nan")).to(dtype)
    v = torch.full((1, 1, S, D), float("nan")).to(dtype)
    k[0, 0, :N] = torch.randn(N, D, generator=g).to(dtype)
    v[0, 0, :N] = torch.randn(N, D, generator=g).to(dtype)
    lens = torch.zeros(1, dtype=torch.int32)
    mask = torch.tensor([[[False, False, False], [False, False, True], [True, True, True]]])
    out = run(device, q, k, v, lens, mask).cpu()
    assert torch.isfinite(out.float()).all()
    assert torch.equal(out[0, 0], torch.zeros_like(out[0, 0]))
    assert torch.equal(out[0, 1], v[0, 0, 2].expand(Hq, D))
    assert_attention_close(out.to(device), q.to(device), k, v, lens, mask, D ** -0.5)


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
@pytest.mark.parametrize("device", DEVICES)
def test_review_single_node_no_gqa_short_prefixes(device, dtype):
    """N = 1, G = 1, prefixes around the tile edges."""
    lens = [0, 1, 15, 17, 63, 65]
    q, k, v, cl = make_case(len(lens), 1, 4, 4, 64, lens, dtype, seed=103)
    for mask in (None, torch.ones(len(lens), 1, 1, dtype=torch.bool)):
        assert_attention_close(run(device, q, k, v, cl, mask), q, k, v, cl, mask, 64 ** -0.5)


@pytest.mark.parametrize("device", DEVICES)
def test_review_layouts(device):
    """q as transformers' transposed view and at a storage offset of 1, an fp16 k_cache at a
    storage offset of 8 bytes; append_kv with transposed and odd-offset k_new, bitwise."""
    B, N, Hq, Hkv, D = 3, 7, 4, 1, 64
    dtype = torch.float16
    q, k, v, cl = make_case(B, N, Hq, Hkv, D, [0, 9, 130], dtype, seed=104)
    mask = make_mask("tree", B, N, seed=104)
    q_hf = q.transpose(1, 2).contiguous().to(device).transpose(1, 2)  # [B, H, N, D] -> [B, N, H, D]
    buf = torch.empty(q.numel() + 1, dtype=dtype, device=device)
    q_off = buf[1:].view(q.shape)
    q_off.copy_(q)
    kbuf = torch.empty(k.numel() + 4, dtype=dtype, device=device)  # 4 halves = 8 bytes
    k_off = kbuf[4:].view(k.shape)
    k_off.copy_(k)
    assert k_off.storage_offset() * k_off.element_size() == 8 and k_off.is_contiguous()
    for qq in (q_hf, q_off):
        out = ops.verify_attention(qq, k_off, v.to(device), cl.to(device), mask.to(device))
        assert_attention_close(out, q.to(device), k, v, cl, mask, D ** -0.5)
    # append_kv: transposed and odd-offset k_new / v_new
    kc, vc, kn, vn, lens = _append_case(dtype, seed=105, B=3, N=5, D=64)
    want_k, want_v = kc.clone(), vc.clone()
    reference.append_kv(want_k, want_v, kn, vn, lens)
    kn_t = kn.transpose(-1, -2).contiguous().to(device).transpose(-1, -2)
    nbuf = torch.empty(vn.numel() + 3, dtype=dtype, device=device)
    vn_off = nbuf[3:].view(vn.shape)
    vn_off.copy_(vn)
    kcd, vcd = kc.to(device, copy=True), vc.to(device, copy=True)
    ops.append_kv(kcd, vcd, kn_t, vn_off, lens.to(device))
    assert torch.equal(kcd.cpu(), want_k) and torch.equal(vcd.cpu(), want_v)


@pytest.mark.parametrize("device", DEVICES)
def test_review_wide_tree_mask(device):
    """N = 130 nodes (more than one mask tile) with GQA 3."""
    B, N, Hq, Hkv, D = 2, 130, 6, 2, 64
    q, k, v, cl = make_case(B, N, Hq, Hkv, D, [0, 40], torch.float16, seed=106)
    mask = make_mask("tree", B, N, seed=106)
    assert_attention_close(run(device, q, k, v, cl, mask), q, k, v, cl, mask, D ** -0.5)


@pytest.mark.parametrize("device", DEVICES)
def test_append_kv_strided_cache_lens(device):
    """A strided view of the lengths is valid input (the CPU kernel once read it as if it
    were contiguous: wrong rows, and a crash in kv_commit; found by tests/fuzz_ops.py)."""
    kc, vc, kn, vn, lens = _append_case(torch.float16, seed=107, B=3, N=5, D=64)
    want_k, want_v = kc.clone(), vc.clone()
    reference.append_kv(want_k, want_v, kn, vn, lens)
    buf = torch.full((3 * lens.numel(),), 10 ** 6, dtype=torch.int32, device=device)
    view = buf[::3]
    view.copy_(lens)
    kcd, vcd = kc.to(device, copy=True), vc.to(device, copy=True)
    ops.append_kv(kcd, vcd, kn.to(device), vn.to(device), view)
    assert torch.equal(kcd.cpu(), want_k) and torch.equal(vcd.cpu(), want_v)
    q = torch.randn(3, 5, 4, 64).half()
    out = ops.verify_attention(q.to(device), kcd, vcd, view)
    assert_attention_close(out, q.to(device), want_k, want_v, lens, None, 64 ** -0.5)


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
def test_verify_attention_cpu_same_bits_for_any_thread_count(dtype):
    """The CPU kernel splits a KV head's query rows into chunks when the (request, KV head) tasks do
    not fill the threads; rows never interact, so every thread count (1, 2, 3 and 4 threads split
    the rows differently) gives the same bits, for full trees and for a frontier (Nkv > Nq), and
    a row of a tree pass agrees with the same query run alone as one node over its visible keys."""
    before = torch.get_num_threads()
    try:
        for (Hq, Hkv), B, N, Nkv in [((9, 3), 1, 8, 8), ((9, 3), 1, 32, 32), ((6, 2), 3, 13, 13),
                                     ((6, 1), 1, 5, 11), ((9, 3), 2, 16, 16)]:
            q, k_cache, v_cache, cache_lens = make_case(B, N, Hq, Hkv, 64, [70, 3, 200][:B], dtype,
                                                        seed=Hq + B + N, extra=Nkv)
            g = gen(N + Nkv)
            mask = torch.rand(B, N, Nkv, generator=g) < 0.6
            mask[..., Nkv - N:] |= torch.eye(N, dtype=torch.bool)        # each query sees itself
            outs = []
            for threads in (1, 2, 3, 4):
                torch.set_num_threads(threads)
                outs.append(ops.verify_attention(q, k_cache, v_cache, cache_lens, mask))
            for o in outs[1:]:
                assert torch.equal(o, outs[0]), ((Hq, Hkv), B, N, Nkv)
            assert_attention_close(outs[0], q, k_cache, v_cache, cache_lens, mask, 64 ** -0.5)
            if Nkv == N:  # query i alone: its visible new nodes, moved to a 1-query step over a longer prefix
                torch.set_num_threads(2)
                b, i = B - 1, N - 1
                vis = mask[b, i].nonzero().flatten().tolist()
                L = int(cache_lens[b])
                kc, vc = k_cache[b:b + 1].clone(), v_cache[b:b + 1].clone()
                for j, src in enumerate(vis):   # pack the visible tree nodes after the prefix
                    kc[:, :, L + j] = k_cache[b, :, L + src]
                    vc[:, :, L + j] = v_cache[b, :, L + src]
                lens1 = torch.tensor([L + len(vis) - 1], dtype=torch.int32)
                one = ops.verify_attention(q[b:b + 1, i:i + 1], kc, vc, lens1)
                torch.testing.assert_close(one[0, 0], outs[0][b, i], atol=1e-5 if dtype == torch.float32 else 2e-2,
                                           rtol=1e-5 if dtype == torch.float32 else 2e-2)
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
def test_verify_attention_cpu_causal_prefill_rows_equal_decode_steps(dtype):
    """A causal pass of many queries (a prefill chunk) skips, per row tile, the key blocks past the
    last key any of its rows can see. That is exact: every row equals, bit for bit, the same query
    run as a one-node step over the keys before it (whose tile skips nothing), for prefixes and row
    counts that put tile, head and 64-key block boundaries everywhere, on 1 and 2 threads."""
    before = torch.get_num_threads()
    try:
        for (Hq, Hkv), L, N in [((9, 3), 0, 150), ((9, 3), 37, 131), ((4, 4), 64, 70), ((6, 2), 5, 65)]:
            q, k_cache, v_cache, cache_lens = make_case(1, N, Hq, Hkv, 64, [L], dtype, seed=Hq + L + N)
            for threads in (1, 2):
                torch.set_num_threads(threads)
                whole = ops.verify_attention(q, k_cache, v_cache, cache_lens, None)
                for i in sorted({0, 1, 2, 3, 63, 64, 65, N // 2, N - 2, N - 1} & set(range(N))):
                    one = ops.verify_attention(q[:, i:i + 1], k_cache, v_cache,
                                               torch.tensor([L + i], dtype=torch.int32), None)
                    assert torch.equal(one[0, 0], whole[0, i]), ((Hq, Hkv), L, N, i, threads)
            assert_attention_close(whole, q, k_cache, v_cache, cache_lens, None, 64 ** -0.5)
    finally:
        torch.set_num_threads(before)
