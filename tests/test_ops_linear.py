"""linear against specdec.reference (CPU always, CUDA when present).

The reference accumulates in float64; the kernels accumulate in float32 in their own
order. Tolerance: a float32 dot product of length K has a relative rounding error of at
most ~K * 2^-24 of sum|x_k w_k| (far less in practice, errors are random); we allow
2e-5 * sqrt(K) * sum|x w| + one rounding of the output dtype (2^-8 relative for bf16,
2^-11 for fp16, 2^-24 for fp32). Shapes are odd on purpose: K not a multiple of 8 (the
vector tail), N not a multiple of 4 (the weight-row tile), M across the 3-row tiles and
the M > 64 switch to the BLAS path (CPU and CUDA).
"""
from __future__ import annotations

import math

import pytest
import torch

from specdec import ops, reference

from conftest import DEVICES, FLOAT_DTYPES, gen

OUT_EPS = {torch.float32: 2.0 ** -24, torch.float16: 2.0 ** -11, torch.bfloat16: 2.0 ** -8}


def check_close(y: torch.Tensor, x, w, bias, scale, dtype):
    ref = reference.linear(x.cpu(), w.cpu(), None if bias is None else bias.cpu(),
                           None if scale is None else scale.cpu())
    exact = x.cpu().double() @ w.cpu().double().T
    if scale is not None:
        exact = exact * scale.cpu().double()
    if bias is not None:
        exact = exact + bias.cpu().double()
    mag = x.cpu().double().abs() @ w.cpu().double().abs().T
    if scale is not None:
        mag = mag * scale.cpu().double()
    K = x.shape[-1]
    tol = 2e-5 * math.sqrt(K) * mag + 2 * OUT_EPS[dtype] * exact.abs() + 1e-30
    assert y.dtype == dtype and y.shape == ref.shape
    err = (y.cpu().double() - exact).abs()
    assert bool((err <= tol).all()), f"max err {err.max().item():.3e}, worst tol ratio {(err / tol).max().item():.2f}"


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
@pytest.mark.parametrize("M", [1, 2, 3, 4, 5, 7, 16, 17, 31, 32, 33, 64, 65, 70])
@pytest.mark.parametrize("K,N", [(77, 13), (576, 130), (40, 4)])
@pytest.mark.parametrize("with_bias", [False, True], ids=["nobias", "bias"])
def test_linear_float(device, dtype, M, K, N, with_bias):
    g = gen(M * 1000 + K + N)
    x = torch.randn(M, K, generator=g).to(dtype)
    w = (torch.randn(N, K, generator=g) / math.sqrt(K)).to(dtype)
    bias = torch.randn(N, generator=g).to(dtype) if with_bias else None
    y = ops.linear(x.to(device), w.to(device), None if bias is None else bias.to(device))
    check_close(y, x, w, bias, None, dtype)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
@pytest.mark.parametrize("M", [1, 3, 8, 17, 33, 70])
@pytest.mark.parametrize("K,N", [(77, 13), (576, 130)])
def test_linear_int8(device, dtype, M, K, N):
    g = gen(7 * M + K)
    x = torch.randn(M, K, generator=g).to(dtype)
    q, s = ops.quantize_weight_int8(torch.randn(N, K, generator=g))
    bias = torch.randn(N, generator=g).to(dtype)
    y = ops.linear(x.to(device), q.to(device), bias.to(device), s.to(device))
    check_close(y, x, q, bias, s, dtype)


@pytest.mark.parametrize("device", DEVICES)
def test_linear_leading_dims_and_strides(device):
    g = gen(11)
    x = torch.randn(2, 3, 5, 64, generator=g)[:, :, 1:4]  # [2, 3, 3, 64], non-contiguous rows
    w = torch.randn(50, 64, generator=g)
    y = ops.linear(x.to(device), w.to(device))
    assert y.shape == (2, 3, 3, 50)
    check_close(y.reshape(-1, 50), x.reshape(-1, 64), w, None, None, torch.float32)
    wt = torch.randn(64, 50, generator=g).T  # non-contiguous weight
    check_close(ops.linear(x.to(device), wt.to(device)).reshape(-1, 50), x.reshape(-1, 64), wt, None, None,
                torch.float32)


@pytest.mark.parametrize("device", DEVICES)
def test_linear_empty_rows(device):
    x = torch.zeros(0, 16, device=device)
    y = ops.linear(x, torch.randn(8, 16, device=device))
    assert y.shape == (0, 8)


def test_linear_matches_torch_on_real_layer_shapes():
    """SmolLM2-135M shapes (K 576 / 1536, N up to 49152) at decode / verify row counts."""
    g = gen(3)
    for K, N in [(576, 1536), (1536, 576), (576, 8192)]:
        w = torch.randn(N, K, generator=g) / math.sqrt(K)
        for M in (1, 8, 16):
            x = torch.randn(M, K, generator=g)
            check_close(ops.linear(x, w), x, w, None, None, torch.float32)


def test_quantize_weight_int8_roundtrip():
    g = gen(5)
    w = torch.randn(33, 70, generator=g)
    w[3] = 0  # an all-zero row keeps scale 1
    q, s = ops.quantize_weight_int8(w)
    assert q.dtype == torch.int8 and s.dtype == torch.float32 and s.shape == (33,)
    assert float(s[3]) == 1.0 and int(q[3].abs().max()) == 0
    assert int(q.abs().max()) == 127
    err = (q.float() * s[:, None] - w).abs()
    assert bool((err <= s[:, None] / 2 + 1e-7).all())  # round to nearest: half a step at most


@pytest.mark.parametrize("device", DEVICES)
def test_linear_errors(device):
    x = torch.randn(3, 16, device=device)
    w = torch.randn(8, 16, device=device)
    x_before, w_before = x.clone(), w.clone()
    cases = [
        (lambda: ops.linear(x, torch.randn(8, 15, device=device)), "K = x.size(-1) = 16"),
        (lambda: ops.linear(x, torch.randn(8, 16, 1, device=device)), "weight must be [N, K]"),
        (lambda: ops.linear(x, w.to(torch.bfloat16)), "weight must have the dtype of x"),
        (lambda: ops.linear(x.to(torch.int32), w), "x must be float32, float16 or bfloat16"),
        (lambda: ops.linear(x, w.to(torch.int8)), "an int8 weight needs weight_scale"),
        (lambda: ops.linear(x, w, None, torch.ones(8, device=device)), "weight_scale is only for int8 weights"),
        (lambda: ops.linear(x, w.to(torch.int8), None, torch.ones(7, device=device)),
         "weight_scale must be float32 [8]"),
        (lambda: ops.linear(x, w, torch.zeros(9, device=device)), "bias must be Float [8]"),
        (lambda: ops.linear(x, w, torch.zeros(8, device=device, dtype=torch.float16)), "bias must be Float [8]"),
    ]
    for fn, msg in cases:
        with pytest.raises(RuntimeError, match="linear: ") as exc:
            fn()
        assert msg in str(exc.value), str(exc.value)
    assert torch.equal(x, x_before) and torch.equal(w, w_before)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
@pytest.mark.parametrize("M", [0, 1, 33])
@pytest.mark.parametrize("wkind", ["float", "int8"])
@pytest.mark.parametrize("with_bias", [False, True], ids=["nobias", "bias"])
def test_linear_empty_reduction(device, dtype, M, wkind, with_bias):
    """K = 0 (an empty sum) once killed the process with SIGFPE (division by K): the
    result is the bias broadcast over [..., N] (zeros without one), as the reference
    gives, on every backend and on both sides of the kernel / BLAS switch."""
    x = torch.zeros(M, 0, dtype=dtype)
    if wkind == "int8":
        w, scale = torch.zeros(3, 0, dtype=torch.int8), torch.rand(3)
    else:
        w, scale = torch.zeros(3, 0, dtype=dtype), None
    bias = torch.randn(3, generator=gen(7)).to(dtype) if with_bias else None
    want = reference.linear(x, w, bias, scale)
    got = ops.linear(x.to(device), w.to(device), None if bias is None else bias.to(device),
                     None if scale is None else scale.to(device))
    assert got.shape == (M, 3) and got.dtype == dtype and got.device.type == device
    assert torch.equal(got.cpu(), want)
    # leading dims with a zero-size reduction, and N = 0
    got = ops.linear(torch.zeros(2, 5, 0, dtype=dtype, device=device), w.to(device), None,
                     None if scale is None else scale.to(device))
    assert got.shape == (2, 5, 3) and not bool(got.any())
    wn = torch.zeros(0, 4, dtype=w.dtype, device=device)
    got = ops.linear(torch.ones(2, 4, dtype=dtype, device=device), wn, None,
                     None if scale is None else torch.zeros(0, device=device))
    assert got.shape == (2, 0)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("wkind", ["fp16", "bf16", "int8"])
def test_review_kernel_blas_switch_long_k(device, wkind):
    """M = 16, 17 (the kernel's 16- and 64-row forms), 64 (the kernel) and 65 (cuBLAS on CUDA, the
    CPU's prefill path) with K = 11008, the Llama MLP down-projection width."""
    K, N = 11008, 40
    dtype = torch.bfloat16 if wkind == "bf16" else torch.float16
    g = gen(70)
    w = torch.randn(N, K, generator=g) / math.sqrt(K)
    scale = None
    if wkind == "int8":
        w, scale = ops.quantize_weight_int8(w)
    else:
        w = w.to(dtype)
    bias = torch.randn(N, generator=g).to(dtype)
    for M in (16, 17, 64, 65):
        x = torch.randn(M, K, generator=g).to(dtype)
        y = ops.linear(x.to(device), w.to(device), bias.to(device), None if scale is None else scale.to(device))
        check_close(y, x, w, bias, scale, dtype)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("kind", ["fp32", "bf16", "int8"])
def test_linear_batch_invariant(device, kind):
    """The kernel's rows do not depend on M (here M <= 16; CUDA up to 64 rows in
    tests/test_batch_invariance.py): a verify pass equals decode steps bit for bit (on the CPU,
    float32 weights take a row-sequential loop for 1-4 rows, 2 x 4 tiles for 6-8 rows and the
    4 x 3 tile otherwise: K with an 8-wide and a scalar tail, and a bias, check that all three
    keep the same arithmetic)."""
    g = gen(12)
    for K, with_bias in ((576, False), (584, True), (43, True)):
        w = torch.randn(70, K, generator=g) / 24
        x = torch.randn(16, K, generator=g)
        b = torch.randn(70, generator=g) if with_bias else None
        if kind == "int8":
            q, s = ops.quantize_weight_int8(w)
            args = (q.to(device), None if b is None else b.to(device), s.to(device))
        else:
            dt = torch.float32 if kind == "fp32" else torch.bfloat16
            x = x.to(dt)
            args = (w.to(dt).to(device), None if b is None else b.to(dt).to(device), None)
        for M in (2, 3, 4, 5, 6, 7, 8, 16):
            whole = ops.linear(x[:M].to(device), *args).cpu()
            rows = torch.cat([ops.linear(x[i:i + 1].to(device), *args).cpu() for i in range(M)])
            assert torch.equal(whole, rows), (kind, K, M)


@pytest.mark.parametrize("kind", ["fp32", "bf16", "int8"])
def test_linear_batch_invariant_up_to_64_rows_on_cpu(kind):
    """On the CPU the kernel takes up to 64 rows (32 per weight pass): a batch-8 verify of 4-8 nodes
    still gives each row what a decode step gives, bit for bit."""
    g = gen(13)
    w = torch.randn(70, 576, generator=g) / 24
    x = torch.randn(64, 576, generator=g)
    if kind == "int8":
        q, s = ops.quantize_weight_int8(w)
        args = (q, None, s)
    else:
        dt = torch.float32 if kind == "fp32" else torch.bfloat16
        x, args = x.to(dt), (w.to(dt), None, None)
    for M in (33, 40, 64):
        whole = ops.linear(x[:M], *args)
        rows = torch.cat([ops.linear(x[i:i + 1], *args) for i in range(M)])
        assert torch.equal(whole, rows), (kind, M)


@pytest.mark.parametrize("kind", ["fp32", "int8", "bf16", "fp16"])
@pytest.mark.parametrize("K", [8, 40, 576, 1536])
@pytest.mark.parametrize("N", [1, 2, 3, 5, 130, 577])
def test_linear_prefill_rows_cpu(kind, K, N):
    """Prefill sizes take the CPU's GEMM tiles (csrc/include/specdec/cpu_gemm.h: 4 weight rows x 3 x rows,
    x in chunks of 96 rows) on an AVX2 CPU: float32 weights at 65-256 rows, int8 / bf16 / fp16 weights
    (widened once per chunk) above 64 rows. Close to the float64 product for row counts across the tile and chunk
    remainders and the float32 switch to the BLAS GEMM above 256 rows, with a bias and with strided rows
    of x; a row's result does not depend on how many rows come with it nor on the thread count (bit for
    bit); set_cpu_gemm(False) gives torch's BLAS GEMM (float, half) and the few-row kernel (int8) back."""
    from specdec import _C

    g = gen(K * 7 + N)
    w = torch.randn(N, K, generator=g) / math.sqrt(K)
    bias = torch.randn(N, generator=g)
    x = torch.randn(300, K, generator=g)
    dt = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(kind, torch.float32)
    if kind == "int8":
        q, s = ops.quantize_weight_int8(w)
        wargs, ref_w, scale = (q, s), q, s
    else:
        w, bias, x = w.to(dt), bias.to(dt), x.to(dt)
        wargs, ref_w, scale = (w, None), w, None

    def lin(xx, b=None):
        return ops.linear(xx, wargs[0], b, wargs[1])

    for M in (65, 66, 67, 97, 100, 193, 256, 257, 300):
        b = bias if M % 2 else None
        check_close(lin(x[:M], b), x[:M], ref_w, b, scale, dt)
    wide = torch.randn(100, 2 * K, generator=g).to(dt)[:, ::2]    # column stride 2 (copied to contiguous rows)
    xs = torch.randn(100, K + 8, generator=g).to(dt)[:, 4:4 + K]  # row stride K + 8, unit column stride
    check_close(lin(xs, bias), xs, ref_w, bias, scale, dt)
    check_close(lin(wide), wide, ref_w, None, scale, dt)
    whole = lin(x[:256], bias)
    for M in (65, 97, 131):
        assert torch.equal(lin(x[256 - M:256], bias), whole[256 - M:]), (M, K, N)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = lin(x[:256], bias)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one, whole)
    _C.set_cpu_gemm(False)
    try:
        off = lin(x[:100], bias)
        few = torch.cat([lin(x[i:i + 1], bias) for i in range(100)])
    finally:
        _C.set_cpu_gemm(True)
    if kind != "int8":
        assert torch.equal(off, torch.nn.functional.linear(x[:100], w, bias))
    else:
        assert torch.equal(off, few)      # the few-row kernel: every row as a decode step


AVX512 = bool(torch.ops.specdec is not None) and __import__("specdec")._C.build_info().get("cpu_avx512", False)


def _avx512_on_off(f):
    """f() with the AVX-512 few-row kernels on, then off (the AVX2 ones)."""
    from specdec import _C

    prev = _C.set_cpu_avx512(True)
    try:
        on = f()
        _C.set_cpu_avx512(False)
        off = f()
    finally:
        _C.set_cpu_avx512(prev)
    return on, off


def _same_bits(a, b):
    return torch.equal(a, b) and torch.equal(torch.signbit(a), torch.signbit(b))


@pytest.mark.skipif(not AVX512, reason="the CPU has no AVX-512 F / DQ / VL")
@pytest.mark.parametrize("kind", ["fp32", "int8", "bf16", "fp16"])
@pytest.mark.parametrize("K", [8, 16, 24, 40, 576, 1536])
def test_linear_avx512_gives_the_avx2_bits(kind, K):
    """4 (float32) or 5 to 32 rows of x (K % 8 == 0) take the AVX-512 tile (csrc/cpu/linear_avx512.cpp), which holds
    two of the AVX2 kernel's accumulators per zmm register (weights widened the same way) and reduces them in the
    same order: its outputs equal the AVX2 kernel's bit for bit, signs of zeros included, at every M (one
    and two weight passes), N (the 4-row blocks and the 1-3-row tail), with and without bias (and the int8
    per-row scale), x rows strided; so a verify row still equals a decode step."""
    g = gen(K)
    for N in (1, 3, 4, 5, 7, 8, 130, 577):
        w = torch.randn(N, K, generator=g) / 24
        b = torch.randn(N, generator=g)
        xs = torch.randn(64, K + 8, generator=g)[:, :K]  # row stride K + 8
        if kind == "int8":
            q, sc = ops.quantize_weight_int8(w)
            f = lambda x, bias: ops.linear(x, q, bias, sc)  # noqa: E731
        elif kind == "fp32":
            f = lambda x, bias: ops.linear(x, w, bias)  # noqa: E731
        else:
            dt = torch.bfloat16 if kind == "bf16" else torch.float16
            wd, bd = w.to(dt), b.to(dt)
            f = lambda x, bias: ops.linear(x.to(dt), wd, None if bias is None else bd)  # noqa: E731
        for M in (*range(1, 18), 24, 31, 32, 33, 40, 64):
            for bias in (None, b):
                on, off = _avx512_on_off(lambda: f(xs[:M], bias))
                assert _same_bits(on, off), (kind, K, N, M, bias is None)
        rows = torch.cat([f(xs[i:i + 1], b) for i in range(8)])
        assert torch.equal(f(xs[:8], b), rows), (kind, K, N)


@pytest.mark.skipif(not AVX512, reason="the CPU has no AVX-512 F / DQ / VL")
def test_avx512_switch():
    from specdec import _C

    assert _C.cpu_avx512()
    assert _C.set_cpu_avx512(False) is True
    try:
        assert not _C.cpu_avx512()
        assert _C.set_cpu_avx512(False) is False
    finally:
        assert _C.set_cpu_avx512(True) is False
    assert _C.cpu_avx512()
