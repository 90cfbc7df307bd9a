"""Regression tests of issue 30's CUDA review findings D1, D5, R3 and R4.

D1  append_kv (dense and paged) and kv_commit with cache_lens near 2^31 - 1 and strict value checks
    OFF (the default): on the CPU the value checks always run (in int64) and refuse the call before
    anything is written; on CUDA (values unchecked) the kernels must not write outside the cache --
    every byte outside the rows the valid requests write, guard bands around the cache included,
    stays bit-identical -- and kv_commit's length update must not wrap negative. With strict checks
    on, CUDA refuses like the CPU.
D5  linear with int8 weights above the CUDA kernel's 64 rows (cuBLAS): float32 operands and ONE rounding
    to x's dtype (dequantizing the weight to float16 / bfloat16 first rounds twice: ~40 % of the
    outputs then differ from the correctly rounded value; one rounding leaves < 0.1 %). The float32
    GEMM of the large-M paths must not take TF32 even when torch allows it.
R3  float16 / bfloat16 weights above 64 rows: float32 accumulation and one rounding even with torch's
    reduced-precision reductions (and float16 accumulation) allowed -- cuBLAS with a float32 compute
    type and a float32 output, not torch's linear.
R4  verify_attention launched from several host threads with shared memory sizes that differ
    (tree sizes with more mask words): every launch succeeds and gives the single-thread bits.

Every test runs on the CPU as well where the criterion applies there (the CPU kernels meet the same
contract), so the criteria themselves are exercised without a GPU; the CUDA cases skip with the
reason when there is no GPU or the build lacks the CUDA kernels.
"""
from __future__ import annotations

import contextlib
import re
import threading
from typing import Iterator

import pytest
import torch

from conftest import DEVICES, HAS_CUDA, gen, strict_checks
from specdec import ops, paged_ops

INT32_MAX = 2 ** 31 - 1
GUARD = 64  # elements of guard band before and after a cache (a multiple of 16 bytes for every dtype)
# (cache_lens of the bad request, offset): cache_lens + offset wraps in int32 except the last pair
BAD_LENS = [(INT32_MAX, 1), (INT32_MAX, 11), (INT32_MAX - 2, 7), (INT32_MAX - 3, 2)]
S, N = 16, 3  # cache capacity and new nodes: request 0 (cache_lens 2) fits for every offset above
LEN0 = 2


def _guarded(shape, dtype, device, g: torch.Generator):
    """(buffer, view): a contiguous cache of ``shape`` inside a 1-D buffer with GUARD random elements
    on each side. An out-of-bounds write near the cache lands in a guard band and is caught."""
    numel = 1
    for s in shape:
        numel *= s
    buf = torch.randn(numel + 2 * GUARD, generator=g).to(dtype).to(device)
    return buf, buf[GUARD:GUARD + numel].view(shape)


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def _expect_refusal(message: str):
    """The op's value check refuses the call (CPU: always, strict or not; CUDA: in strict mode)."""
    return pytest.raises(RuntimeError, match=re.escape(message))


# --------------------------------------------------------------------------- D1: append_kv
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype, D", [(torch.float16, 64), (torch.float16, 63), (torch.float32, 32)],
                         ids=["fp16-vec16", "fp16-elementwise", "fp32-vec16"])
@pytest.mark.parametrize("bad_len, offset", BAD_LENS)
def test_append_kv_length_near_int32_max(device, dtype, D, bad_len, offset):
    B, H = 2, 2
    g = gen(3001)
    kbuf, k_cache = _guarded((B, H, S, D), dtype, device, g)
    vbuf, v_cache = _guarded((B, H, S, D), dtype, device, g)
    k_new = torch.randn(B, H, N, D, generator=g).to(dtype).to(device)
    v_new = torch.randn(B, H, N, D, generator=g).to(dtype).to(device)
    len0 = LEN0
    lens = torch.tensor([len0, bad_len], dtype=torch.int32, device=device)
    k_before, v_before = kbuf.clone(), vbuf.clone()
    message = f"append_kv: cache_lens[1] = {bad_len} leaves no room"

    if device == "cpu":  # strict checks are off (conftest): the CPU refuses anyway, before writing
        with _expect_refusal(message):
            ops.append_kv(k_cache, v_cache, k_new, v_new, lens, offset)
        assert _same_bits(kbuf, k_before) and _same_bits(vbuf, v_before)
        return

    with strict_checks(), _expect_refusal(message):
        ops.append_kv(k_cache, v_cache, k_new, v_new, lens, offset)
    _sync(device)
    assert _same_bits(kbuf, k_before) and _same_bits(vbuf, v_before)

    # Unchecked: request 0 is written, request 1 (whose rows do not fit) writes nothing.
    ops.append_kv(k_cache, v_cache, k_new, v_new, lens, offset)
    _sync(device)
    k_want, v_want = k_before.clone(), v_before.clone()
    k_want[GUARD:GUARD + k_cache.numel()].view(k_cache.shape)[0, :, len0 + offset:len0 + offset + N] = k_new[0]
    v_want[GUARD:GUARD + v_cache.numel()].view(v_cache.shape)[0, :, len0 + offset:len0 + offset + N] = v_new[0]
    assert _same_bits(kbuf, k_want), "append_kv wrote outside request 0's new rows"
    assert _same_bits(vbuf, v_want), "append_kv wrote outside request 0's new rows"
    assert lens.tolist() == [len0, bad_len]


# --------------------------------------------------------------------------- D1: append_kv_paged
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("bad_len, offset", BAD_LENS)
def test_append_kv_paged_length_near_int32_max(device, bad_len, offset):
    B, H, D, ps = 2, 2, 64, 4
    M = S // ps  # blocks per request: capacity M * ps = S
    dtype = torch.float16
    g = gen(3002)
    kbuf, k_pages = _guarded((B * M, ps, H, D), dtype, device, g)
    vbuf, v_pages = _guarded((B * M, ps, H, D), dtype, device, g)
    tables = torch.arange(B * M, dtype=torch.int32).flip(0).reshape(B, M).to(device)  # request 0: pages 7..4
    k_new = torch.randn(B, H, N, D, generator=g).to(dtype).to(device)
    v_new = torch.randn(B, H, N, D, generator=g).to(dtype).to(device)
    len0 = LEN0
    lens = torch.tensor([len0, bad_len], dtype=torch.int32, device=device)
    k_before, v_before = kbuf.clone(), vbuf.clone()
    message = f"append_kv_paged: cache_lens[1] = {bad_len} leaves no room"

    if device == "cpu":
        with _expect_refusal(message):
            paged_ops.append_kv_paged(k_pages, v_pages, k_new, v_new, tables, lens, offset)
        assert _same_bits(kbuf, k_before) and _same_bits(vbuf, v_before)
        return

    with strict_checks(), _expect_refusal(message):
        paged_ops.append_kv_paged(k_pages, v_pages, k_new, v_new, tables, lens, offset)
    _sync(device)
    assert _same_bits(kbuf, k_before) and _same_bits(vbuf, v_before)

    paged_ops.append_kv_paged(k_pages, v_pages, k_new, v_new, tables, lens, offset)
    _sync(device)
    k_want, v_want = k_before.clone(), v_before.clone()
    kw = k_want[GUARD:GUARD + k_pages.numel()].view(k_pages.shape)
    vw = v_want[GUARD:GUARD + v_pages.numel()].view(v_pages.shape)
    t0 = tables[0].cpu()
    for j in range(N):
        s = len0 + offset + j
        kw[int(t0[s // ps]), s % ps] = k_new[0, :, j]
        vw[int(t0[s // ps]), s % ps] = v_new[0, :, j]
    assert _same_bits(kbuf, k_want), "append_kv_paged wrote outside request 0's new slots"
    assert _same_bits(vbuf, v_want), "append_kv_paged wrote outside request 0's new slots"


# --------------------------------------------------------------------------- D1: kv_commit
def _commit_inputs(device: str, bad_len: int):
    accepted = torch.tensor([[0, 2, 3, -1], [0, 1, 3, -1]], dtype=torch.int32, device=device)
    num = torch.tensor([2, 2], dtype=torch.int32, device=device)
    lens = torch.tensor([5, bad_len], dtype=torch.int32, device=device)
    return accepted, num, lens


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("bad_len", [INT32_MAX, INT32_MAX - 2, INT32_MAX - 4])
def test_kv_commit_length_near_int32_max(device, bad_len):
    B, H, D, L = 2, 2, 64, 2
    g = gen(3003)
    caches = [_guarded((B, H, S, D), torch.bfloat16, device, g) for _ in range(2 * L)]
    bufs = [c[0] for c in caches]
    ks, vs = [c[1] for c in caches[:L]], [c[1] for c in caches[L:]]
    accepted, num, lens = _commit_inputs(device, bad_len)
    before = [b.clone() for b in bufs]
    message = f"kv_commit: cache_lens[1] = {bad_len} + accepted node 3 lies past the cache capacity S = {S}"

    if device == "cpu":
        with _expect_refusal(message):
            ops.kv_commit(ks, vs, lens, accepted, num)
        assert all(_same_bits(b, w) for b, w in zip(bufs, before))
        assert lens.tolist() == [5, bad_len]
        return

    with strict_checks(), _expect_refusal(message):
        ops.kv_commit(ks, vs, lens, accepted, num)
    _sync(device)
    assert all(_same_bits(b, w) for b, w in zip(bufs, before))
    assert lens.tolist() == [5, bad_len]

    ops.kv_commit(ks, vs, lens, accepted, num)
    _sync(device)
    for buf, want, cache in zip(bufs, before, ks + vs):
        w = want.clone()
        wc = w[GUARD:GUARD + cache.numel()].view(cache.shape)
        wc[0, :, 6] = wc[0, :, 7].clone()  # request 0: positions 5 + 1, 5 + 2 take nodes 2, 3
        wc[0, :, 7] = wc[0, :, 8].clone()
        assert _same_bits(buf, w), "kv_commit moved rows outside request 0's path"
    # The length update is int64 arithmetic saturated to int32: never a wrap to a negative length.
    assert lens.tolist() == [8, min(bad_len + 3, INT32_MAX)]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("bad_len", [INT32_MAX, INT32_MAX - 2])
def test_kv_commit_paged_length_near_int32_max(device, bad_len):
    B, H, D, ps, L = 2, 2, 64, 4, 1
    M = S // ps
    g = gen(3004)
    caches = [_guarded((B * M, ps, H, D), torch.float16, device, g) for _ in range(2 * L)]
    bufs = [c[0] for c in caches]
    kps, vps = [caches[0][1]], [caches[1][1]]
    tables = torch.arange(B * M, dtype=torch.int32).reshape(B, M).to(device)
    accepted, num, lens = _commit_inputs(device, bad_len)
    before = [b.clone() for b in bufs]
    message = f"kv_commit_paged: cache_lens[1] = {bad_len} leaves no room"

    if device == "cpu":
        with _expect_refusal(message):
            paged_ops.kv_commit_paged(kps, vps, tables, lens, accepted, num)
        assert all(_same_bits(b, w) for b, w in zip(bufs, before))
        assert lens.tolist() == [5, bad_len]
        return

    with strict_checks(), _expect_refusal(message):
        paged_ops.kv_commit_paged(kps, vps, tables, lens, accepted, num)
    _sync(device)
    assert all(_same_bits(b, w) for b, w in zip(bufs, before))
    assert lens.tolist() == [5, bad_len]

    paged_ops.kv_commit_paged(kps, vps, tables, lens, accepted, num)
    _sync(device)
    for buf, want, pages in zip(bufs, before, kps + vps):
        w = want.clone()
        wp = w[GUARD:GUARD + pages.numel()].view(pages.shape)
        for dst, src in ((6, 7), (7, 8)):  # request 0 (pages 0..3 in order)
            wp[dst // ps, dst % ps] = wp[src // ps, src % ps].clone()
        assert _same_bits(buf, w), "kv_commit_paged moved slots outside request 0's path"
    assert lens.tolist() == [8, min(bad_len + 3, INT32_MAX)]


# --------------------------------------------------------------------------- D5: one rounding above 64 rows
@contextlib.contextmanager
def tf32_allowed() -> Iterator[None]:
    """torch's float32 matmuls may use TF32 inside the block (the setting a user may have on)."""
    m = torch.backends.cuda.matmul
    if hasattr(m, "fp32_precision"):  # the new API; mixing it with allow_tf32 is an error in torch
        before = m.fp32_precision
        m.fp32_precision = "tf32"
        try:
            yield
        finally:
            m.fp32_precision = before
    else:
        before = m.allow_tf32
        m.allow_tf32 = True
        try:
            yield
        finally:
            m.allow_tf32 = before


def _ulp(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """float64 spacing of ``dtype`` at |x| (its subnormal spacing below the normal range)."""
    fi = torch.finfo(dtype)
    mant = {torch.float16: 10, torch.bfloat16: 7, torch.float32: 23}[dtype]
    e = torch.floor(torch.log2(x.abs().double().clamp_min(fi.tiny)))
    return torch.exp2(e - mant)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [pytest.param(torch.float16, id="fp16"), pytest.param(torch.bfloat16, id="bf16")])
@pytest.mark.parametrize("M", [48, 80])
def test_linear_int8_above_16_rows_rounds_once(device, dtype, M):
    """Above its kernel's rows (16 then, 64 now: M = 80 is cuBLAS, 48 the kernel) CUDA used to
    dequantize int8 weights to x's dtype before cuBLAS: every weight rounded, then the output.
    With float32 operands the result is the float64 value rounded once except where float32
    accumulation straddles a rounding boundary (emulated: ~0.01 %, vs ~42 % for the double
    rounding)."""
    K, Nout = 1024, 384
    g = gen(3005)
    x = torch.randn(M, K, generator=g).to(dtype)
    w = torch.randint(-127, 128, (Nout, K), generator=g).to(torch.int8)
    scale = torch.rand(Nout, generator=g) * 0.02 + 1e-3  # fp32: w * scale is not a 16-bit number
    bias = torch.randn(Nout, generator=g).to(dtype)
    ref = (x.double() @ w.double().T) * scale.double() + bias.double()
    want = ref.to(dtype)
    with tf32_allowed():
        got = ops.linear(x.to(device), w.to(device), bias.to(device), scale.to(device)).cpu()
    assert got.dtype == dtype and got.shape == (M, Nout)
    mismatch = (got != want).double().mean().item()
    assert mismatch <= 0.01, f"{mismatch:.2%} of the outputs are not the correctly rounded value"
    # And no entry farther than one ulp (+ the float32 accumulation's share) from the exact value.
    terms = (x.double().abs() @ w.double().abs().T) * scale.double()
    err = (got.double() - ref).abs()
    assert bool((err <= _ulp(ref, dtype) + 2.0 ** -20 * terms).all()), float((err / _ulp(ref, dtype)).max())


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("kind", ["fp32", "int8", "q8_0", "q4_1"])
def test_large_m_float32_gemm_takes_no_tf32(device, kind):
    """float32 x above 64 rows (CUDA: cuBLAS): float32 weights, int8 weights and qlinear's dequantized weights go
    through a float32 GEMM that stays float32 even when torch allows TF32 (TF32 keeps 10 mantissa
    bits: a relative error ~4e-4 here; float32 at most ~1e-6)."""
    M, K, Nout = 80, 1024, 256
    g = gen(3006)
    x = torch.randn(M, K, generator=g)
    wf = torch.randn(Nout, K, generator=g) * 0.05
    bias = torch.randn(Nout, generator=g)
    dev = lambda t: None if t is None else t.to(device)  # noqa: E731
    if kind == "fp32":
        ref = x.double() @ wf.double().T + bias.double()
        call = lambda: ops.linear(dev(x), dev(wf), dev(bias))  # noqa: E731
    elif kind == "int8":
        q, s = ops.quantize_weight_int8(wf)
        ref = (x.double() @ q.double().T) * s.double() + bias.double()
        call = lambda: ops.linear(dev(x), dev(q), dev(bias), dev(s))  # noqa: E731
    else:
        qw, sc, mn = ops.quantize_weight_groups(wf, kind)
        bits = 8 if kind == "q8_0" else 4
        from specdec import reference
        ref = x.double() @ reference.dequantize_groups(qw, sc, mn, bits).T + bias.double()
        call = lambda: ops.qlinear(dev(x), dev(qw), dev(sc), dev(mn), dev(bias), bits)  # noqa: E731
    with tf32_allowed():
        got = call().cpu()
    rel = ((got.double() - ref).norm() / ref.norm()).item()
    assert rel <= 2e-5, f"relative error {rel:.2e}: not float32 arithmetic (TF32?)"


@contextlib.contextmanager
def reduced_precision_allowed() -> Iterator[None]:
    """torch's float16 / bfloat16 GEMMs may reduce in the 16-bit type inside the block (split-K
    partial sums rounded to float16 / bfloat16), and -- where torch has the flag -- accumulate in
    float16 altogether."""
    m = torch.backends.cuda.matmul
    names = ["allow_fp16_reduced_precision_reduction", "allow_bf16_reduced_precision_reduction"]
    if hasattr(m, "allow_fp16_accumulation"):
        names.append("allow_fp16_accumulation")
    before = {n: getattr(m, n) for n in names}
    try:
        for n in names:
            setattr(m, n, True)
        yield
    finally:
        for n, v in before.items():
            setattr(m, n, v)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [pytest.param(torch.float16, id="fp16"), pytest.param(torch.bfloat16, id="bf16")])
@pytest.mark.parametrize("M", [17, 48, 80])
def test_linear_16bit_above_16_rows_accumulates_in_float32(device, dtype, M):
    """float16 / bfloat16 weights above 16 rows (CUDA: the kernel up to 64, cuBLAS at 80) with torch's reduced-precision
    reductions (and float16 accumulation, where torch has it) allowed: the result is the float32
    accumulated x @ w.T + bias rounded ONCE to x's dtype -- every entry within 1 ulp of x's dtype of
    that reference (plus the share by which two float32 summation orders may differ), and at most
    1 % of the entries not equal to it (emulated with float32 partial sums in another order: ~0.25 %
    for float16, ~0.02 % for bfloat16; with split-K partial sums rounded to the 16-bit type ~39 %
    differ and ~11 % are beyond the bound). M = 80 also covers the CPU's GEMM tiles (M > 64)."""
    K, Nout = 2048, 256
    g = gen(3007)
    x = torch.randn(M, K, generator=g).to(dtype)
    w = (torch.randn(Nout, K, generator=g) * 0.05).to(dtype)
    bias = torch.randn(Nout, generator=g).to(dtype)
    want = (x.float() @ w.float().T + bias.float()).to(dtype)  # float32 accumulation (CPU), one rounding
    with reduced_precision_allowed():
        got = ops.linear(x.to(device), w.to(device), bias.to(device)).cpu()
    assert got.dtype == dtype and got.shape == (M, Nout)
    mismatch = (got != want).double().mean().item()
    assert mismatch <= 0.01, f"{mismatch:.2%} of the outputs differ from the float32-accumulated value rounded once"
    terms = x.double().abs() @ w.double().abs().T
    err = (got.double() - want.double()).abs()
    ulp = _ulp(want.double(), dtype)
    assert bool((err <= ulp + 2.0 ** -20 * terms).all()), f"{float((err / ulp).max()):.1f} ulp from the reference"


# --------------------------------------------------------------------------- R4: launches from many threads
@pytest.mark.skipif(not HAS_CUDA, reason="R4 is about CUDA launch attributes: needs a CUDA device and a "
                    "specdec._C built with the CUDA kernels")
def test_verify_attention_threads_with_different_shared_memory_sizes():
    """Launch sizes that need different dynamic shared memory (16 nodes without a mask; 64 queries
    over 4096 masked nodes: 64 mask words per row) from 4 host threads at once. The kernel's shared
    memory limit is set once per (instantiation, device); a per-launch setting that followed the size
    could be lowered by one thread between another thread's setting and launch, failing that launch."""
    g = gen(3007)
    dtype, Hq, Hkv, D, prefix = torch.bfloat16, 4, 2, 128, 40
    cases = []
    for n_q, n_kv in ((16, None), (64, 4096), (8, 1024)):
        nodes = n_kv or n_q
        cap = prefix + nodes + 8
        k = torch.randn(1, Hkv, cap, D, generator=g).to(dtype).cuda()
        v = torch.randn(1, Hkv, cap, D, generator=g).to(dtype).cuda()
        q = torch.randn(1, n_q, Hq, D, generator=g).to(dtype).cuda()
        lens = torch.tensor([prefix], dtype=torch.int32).cuda()
        mask = None if n_kv is None else (torch.rand(1, n_q, n_kv, generator=g) < 0.3).cuda()
        cases.append((q, k, v, lens, mask))
    want = [ops.verify_attention(*c) for c in cases]
    torch.cuda.synchronize()
    errors, mismatches = [], []

    def worker(t: int) -> None:
        try:
            for it in range(30):
                i = (t + it) % len(cases)
                out = ops.verify_attention(*cases[i])
                torch.cuda.current_stream().synchronize()
                if not torch.equal(out, want[i]):
                    mismatches.append((t, it, i))
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(repr(e))

    threads = [threading.Thread(target=worker, args=(t,)) for t in range(4)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    torch.cuda.synchronize()
    assert not errors, errors[:3]
    assert not mismatches, mismatches[:5]
