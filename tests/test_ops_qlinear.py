"""qlinear (group-quantized weights: Q8_0 / Q4_0 / Q4_1) against specdec.reference.

Tolerance as tests/test_ops_linear.py: float32 accumulation in the kernel's own order vs the
float64 reference, 2e-5 * sqrt(K) * sum|x w| + two roundings of the output dtype.
"""
from __future__ import annotations

import math
import re

import pytest
import torch

from specdec import ops, reference

from conftest import DEVICES, FLOAT_DTYPES, gen

OUT_EPS = {torch.float32: 2.0 ** -24, torch.float16: 2.0 ** -11, torch.bfloat16: 2.0 ** -8}
FMTS = {"q8_0": 8, "q4_0": 4, "q4_1": 4}


def check_close(y, x, qw, d, m, bias, bits):
    w = reference.dequantize_groups(qw.cpu(), d.cpu(), None if m is None else m.cpu(), bits)
    xd = x.cpu().double()
    exact = xd @ w.T + (0 if bias is None else bias.cpu().double())
    mag = xd.abs() @ w.abs().T
    tol = 2e-5 * math.sqrt(max(x.shape[-1], 1)) * mag + 2 * OUT_EPS[x.dtype] * exact.abs() + 1e-30
    assert y.dtype == x.dtype and y.shape == exact.shape
    err = (y.cpu().double() - exact).abs()
    assert bool((err <= tol).all()), f"max err {err.max().item():.3e}, worst ratio {(err / tol).max().item():.2f}"


def case(N, K, fmt, seed):
    g = gen(seed)
    w = torch.randn(N, K, generator=g) / math.sqrt(K)
    return ops.quantize_weight_groups(w, fmt), w


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
@pytest.mark.parametrize("fmt", list(FMTS))
@pytest.mark.parametrize("M", [1, 3, 5, 17, 33])
@pytest.mark.parametrize("K,N", [(32, 5), (96, 13), (576, 130)])
def test_qlinear_matches_reference(device, dtype, fmt, M, K, N):
    (qw, d, m), _ = case(N, K, fmt, seed=M * 7 + K + N)
    g = gen(M)
    x = torch.randn(M, K, generator=g).to(dtype)
    bias = torch.randn(N, generator=g).to(dtype) if M % 2 else None
    dev = lambda t: None if t is None else t.to(device)  # noqa: E731
    y = ops.qlinear(x.to(device), qw.to(device), d.to(device), dev(m), dev(bias), FMTS[fmt])
    assert y.device.type == device
    check_close(y, x, qw, d, m, bias, FMTS[fmt])


@pytest.mark.parametrize("device", DEVICES)
def test_qlinear_layouts(device):
    """Leading dims, a non-contiguous x, a qweight at an odd storage offset (scalar loads)."""
    (qw, d, m), _ = case(40, 64, "q4_1", seed=3)
    x = torch.randn(2, 3, 64, generator=gen(4))
    x_nc = x.transpose(0, 1).contiguous().transpose(0, 1)
    buf = torch.empty(qw.numel() + 1, dtype=qw.dtype)
    qw_off = buf[1:].view(qw.shape)
    qw_off.copy_(qw)
    y = ops.qlinear(x_nc.to(device), qw_off.to(device) if device == "cpu" else qw_off.to(device), d.to(device),
                    m.to(device), None, 4)
    assert y.shape == (2, 3, 40)
    check_close(y.reshape(6, 40), x.reshape(6, 64), qw, d, m, None, 4)


def test_quantize_weight_groups_roundtrip_and_gguf_order():
    """Every format reproduces w within half a step per group (q4_0: one); the 4-bit packing puts element
    j in the low nibble and j + 16 in the high nibble of byte j (GGUF order)."""
    g = gen(5)
    w = torch.randn(8, 64, generator=g)
    for fmt, bits in FMTS.items():
        qw, d, m = ops.quantize_weight_groups(w, fmt)
        deq = reference.dequantize_groups(qw, d, m, bits).float().reshape(8, 2, 32)
        step = d.float()[..., None].abs()
        # q4_0 is asymmetric (codes -8..7 around the signed absmax): one step at the far end
        within = (1.0 if fmt == "q4_0" else 0.5) * step + 1e-3 * w.abs().amax()
        assert bool(((deq - w.reshape(8, 2, 32)).abs() <= within).all()), fmt
    w2 = torch.zeros(1, 32)
    w2[0, 0], w2[0, 16] = 1.0, 15.0  # q4_1: m = 0, d = 1: codes 1 and 15
    qw, d, m = ops.quantize_weight_groups(w2, "q4_1")
    assert int(qw[0, 0]) == (1 | (15 << 4)) and float(d[0, 0]) == 1.0 and float(m[0, 0]) == 0.0


@pytest.mark.parametrize("device", DEVICES)
def test_qlinear_empty(device):
    y = ops.qlinear(torch.zeros(0, 64, device=device), *[t.to(device) for t in case(3, 64, "q8_0", 1)[0][:2]],
                    None, None, 8)
    assert y.shape == (0, 3)
    b = torch.randn(3)
    y = ops.qlinear(torch.zeros(2, 0, device=device), torch.zeros(3, 0, dtype=torch.int8, device=device),
                    torch.zeros(3, 0, dtype=torch.float16, device=device), None, b.to(device), 8)
    assert torch.equal(y.cpu(), b.expand(2, 3))


@pytest.mark.parametrize("device", DEVICES)
def test_qlinear_errors(device):
    (qw, d, m), _ = case(4, 64, "q4_1", seed=6)
    x = torch.randn(2, 64)
    bad = [
        (dict(x=torch.randn(2, 48)), "qlinear: x's K = 48 must be a multiple of the group size 32"),
        (dict(bits=5), "qlinear: bits must be 8 (Q8_0) or 4 (Q4_0 / Q4_1), got 5"),
        (dict(qweight=qw.to(torch.int8)), "qlinear: a 4-bit qweight must be uint8 [N, K / 2] with K = 64"),
        (dict(scales=d.float()), "qlinear: scales must be float16 [N, K / 32] = [4, 2], got Float"),
        (dict(mins=m[:, :1]), "qlinear: mins must be float16 [N, K / 32] = [4, 2], got Half [4, 1]"),
        (dict(bias=torch.randn(5)), "qlinear: bias must be Float [4], got Float [5]"),
        (dict(qweight=torch.zeros(4, 64, dtype=torch.int8), bits=8), "qlinear: mins are only for 4-bit weights"),
        (dict(x=torch.randn(2, 64).int()), "qlinear: x must be float32, float16 or bfloat16, got Int"),
    ]
    for change, msg in bad:
        args = dict(x=x, qweight=qw, scales=d, mins=m, bias=None, bits=4)
        args.update(change)
        args = {k: (v.to(device) if isinstance(v, torch.Tensor) else v) for k, v in args.items()}
        with pytest.raises(RuntimeError, match=re.escape(msg)):
            ops.qlinear(**args)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("fmt", list(FMTS))
def test_qlinear_batch_invariant(device, fmt):
    """Each output row is computed by the same sequence of operations whatever M is: a verify pass
    over N nodes gives bit for bit the logits N decode steps would (so greedy speculation on a
    quantized model is token-exact, not only close)."""
    (qw, d, m), _ = case(70, 576, fmt, seed=9)
    g = gen(10)
    x = torch.randn(16, 576, generator=g)
    dev = lambda t: None if t is None else t.to(device)  # noqa: E731
    args = (dev(qw), dev(d), dev(m), None, FMTS[fmt])
    for M in range(2, 17):   # every schedule: 2 x 4 tiles, one weight row against 5-8 rows, two tile passes
        whole = ops.qlinear(x[:M].to(device), *args).cpu()
        rows = torch.cat([ops.qlinear(x[i:i + 1].to(device), *args).cpu() for i in range(M)])
        assert torch.equal(whole, rows), (fmt, M)


@pytest.mark.parametrize("fmt", list(FMTS))
@pytest.mark.parametrize("K,N", [(32, 1), (96, 3), (576, 130), (1536, 6)])
def test_qlinear_prefill_rows_cpu(fmt, K, N):
    """More than 64 rows (prefill sizes) take the GEMM tiles over weight quads decoded once per 96-row
    chunk (csrc/include/specdec/cpu_gemm.h) on an AVX2 CPU: close to the float64 product of the
    dequantized weight across the tile and chunk remainders; a row's result depends neither on how many
    rows come with it nor on the thread count (bit for bit); up to 64 rows the few-row kernel keeps
    every row equal to a decode step's."""
    (qw, d, m), _ = case(N, K, fmt, seed=K + N)
    g = gen(K * 3 + N)
    x = torch.randn(200, K, generator=g)
    bias = torch.randn(N, generator=g)
    bits = FMTS[fmt]
    for M in (65, 67, 97, 193, 200):
        b = bias if M % 2 else None
        check_close(ops.qlinear(x[:M], qw, d, m, b, bits), x[:M], qw, d, m, b, bits)
    whole = ops.qlinear(x, qw, d, m, bias, bits)
    for M in (65, 100, 131):
        assert torch.equal(ops.qlinear(x[200 - M:], qw, d, m, bias, bits), whole[200 - M:]), (fmt, M)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = ops.qlinear(x, qw, d, m, bias, bits)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one, whole)
    for M in (33, 64):
        rows = torch.cat([ops.qlinear(x[i:i + 1], qw, d, m, None, bits) for i in range(M)])
        assert torch.equal(ops.qlinear(x[:M], qw, d, m, None, bits), rows), (fmt, M)


@pytest.mark.skipif(not __import__("specdec")._C.build_info().get("cpu_avx512", False),
                    reason="the CPU has no AVX-512 F / DQ / VL")
@pytest.mark.parametrize("fmt", ["q4_1", "q8_0", "q4_0"])
@pytest.mark.parametrize("K", [32, 288, 576])
def test_qlinear_avx512_gives_the_avx2_bits(fmt, K):
    """5-32 rows of x take the AVX-512 tile (csrc/cpu/linear_avx512.cpp: 4 weight rows x 8 x rows, codes
    widened to d * q (+ m) as pairs of rows, the AVX2 tile's FMA order and horizontal sum): the AVX2
    kernel's outputs bit for bit (signs of zeros included) at every M, N tail, with and without bias."""
    from specdec import _C

    g = gen(K + len(fmt))
    bits = 4 if fmt.startswith("q4") else 8
    for N in (1, 3, 4, 5, 13, 130):
        q, s, mn = ops.quantize_weight_groups(torch.randn(N, K, generator=g) / 24, fmt)
        b = torch.randn(N, generator=g)
        x = torch.randn(40, K, generator=g)
        for M in (*range(1, 18), 24, 32, 33, 40):
            for bias in (None, b):
                prev = _C.set_cpu_avx512(True)
                try:
                    on = ops.qlinear(x[:M], q, s, mn, bias, bits)
                    _C.set_cpu_avx512(False)
                    off = ops.qlinear(x[:M], q, s, mn, bias, bits)
                finally:
                    _C.set_cpu_avx512(prev)
                assert torch.equal(on, off) and torch.equal(torch.signbit(on), torch.signbit(off)), (fmt, K, N, M)
        rows = torch.cat([ops.qlinear(x[i:i + 1], q, s, mn, b, bits) for i in range(8)])
        assert torch.equal(ops.qlinear(x[:8], q, s, mn, b, bits), rows), (fmt, K, N)
