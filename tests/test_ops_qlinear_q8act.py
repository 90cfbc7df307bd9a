"""qlinear(..., act="q8") (quantized activations) and quantize_q8 against specdec.reference_q8act.

The op has an exact definition (docs/ops.md), so every form must give the same BITS: the torch
reference, every CPU tier this machine runs (avx512_vnni / avx_vnni / avx2 / scalar) and CUDA;
a row's result must not depend on M. A bound against the float-activation qlinear checks that the
definition is the intended approximation (not only self-consistent).
"""
from __future__ import annotations

import math

import pytest
import torch

from specdec import _C, ops, reference, reference_q8act

from conftest import DEVICES, gen

FMTS = {"q8_0": 8, "q4_0": 4, "q4_1": 4}
TIERS = _C.q8act_tiers().split(",")


@pytest.fixture(params=TIERS)
def tier(request):
    was = _C.set_q8act_tier(request.param)
    yield request.param
    _C.set_q8act_tier(was)


def case(N, K, fmt, seed):
    g = gen(seed)
    w = torch.randn(N, K, generator=g) / math.sqrt(K)
    return ops.quantize_weight_groups(w, fmt)


def activations(M, K, seed):
    """Gaussian rows with an outlier per row, an all-zero block and exact ties (x * id = k + 0.5)."""
    g = gen(seed)
    x = torch.randn(M, K, generator=g)
    x[:, 0] *= 20
    if K >= 64:
        x[0, 32:64] = 0
    if M > 1:
        x[1, :32] = torch.arange(32) - 15.5  # amax 15.5: id = 127 / 15.5, a few products land on .5
        x[1, 0] = 127.0  # amax 127: id = 1, x = k + 0.5 rounds half to even
        x[1, 1:8] = torch.tensor([0.5, 1.5, 2.5, -0.5, -1.5, -2.5, 126.5])
    if M > 2 and K >= 64:
        x[2, 32:64] *= 1e-38  # amax below 127 / FLT_MAX: id is 0, the codes 0
    return x


def put(t, device):
    return None if t is None else t.to(device)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_quantize_q8_matches_reference(device, dtype, tier):
    x = activations(5, 96, seed=1).to(dtype)
    a, d = ops.quantize_q8(x.to(device))
    ra, rd = reference_q8act.quantize_q8(x)
    assert a.dtype == torch.int8 and d.dtype == torch.float32 and a.shape == x.shape and d.shape == (5, 3)
    assert torch.equal(a.cpu(), ra) and torch.equal(d.cpu(), rd)
    if dtype == torch.float32:  # the ties of row 1 (id = 1): half to even
        assert ra[1, :8].tolist() == [127, 0, 2, 2, 0, -2, -2, 126]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("fmt", list(FMTS))
@pytest.mark.parametrize("M", [1, 2, 3, 6, 8, 9])
@pytest.mark.parametrize("K,N", [(32, 5), (96, 13), (544, 9), (576, 70), (1056, 7)])
def test_qlinear_q8act_bit_exact(device, fmt, M, K, N, tier):
    qw, d, m = case(N, K, fmt, seed=M * 7 + K + N)
    if fmt == "q8_0":  # the extreme codes, -128 included (GGUF allows it; the quantizer never makes it)
        qw.view(-1)[:: 7] = -128
        qw.view(-1)[3:: 11] = 127
    x = activations(M, K, seed=M + K)
    bias = torch.randn(N, generator=gen(M)) if M % 2 else None
    y = ops.qlinear(x.to(device), qw.to(device), d.to(device), put(m, device), put(bias, device), FMTS[fmt],
                    act="q8")
    want = reference_q8act.qlinear_q8act(x, qw, d, m, bias, FMTS[fmt])
    assert y.device.type == device and y.dtype == torch.float32 and y.shape == (M, N)
    assert torch.equal(y.cpu(), want), f"max diff {(y.cpu() - want).abs().max().item():.3e}"
    if device == "cpu":  # the packed layout gives the same bits
        packed = ops.pack_q8act(qw, d, m, FMTS[fmt])
        assert torch.equal(ops.qlinear(x, packed, d, m, bias, FMTS[fmt], act="q8"), want)


@pytest.mark.parametrize("fmt", list(FMTS))
@pytest.mark.parametrize("N", [1, 16, 17, 45])
def test_pack_layout(fmt, N):
    """pack_q8act's bytes equal the reference's, every code and scale sits where docs/ops.md says, rows past N
    are zero codes with zero scales, and unpacking gives the weight back."""
    bits = FMTS[fmt]
    qw, d, m = case(N, 96, fmt, seed=N)
    packed = ops.pack_q8act(qw, d, m, bits)
    T, G = (N + 15) // 16, 3
    per = (512 if bits == 8 else 256) + 32 + 32 * (m is not None)
    assert packed.dtype == torch.uint8 and packed.shape == (T, G, per)
    assert torch.equal(packed, reference_q8act.pack_q8act(qw, d, m, bits))
    raw = qw.view(torch.uint8).reshape(N, G, -1)
    for n, g, byte in ((0, 0, 0), (N - 1, G - 1, raw.shape[-1] - 1), (N // 2, 1, 5)):
        t, j, k, i = n // 16, n % 16, byte // 4, byte % 4
        want = int(raw[n, g, byte]) ^ (0x80 if bits == 8 else 0)
        assert int(packed[t, g, 64 * k + 4 * j + i]) == want
        code = 512 if bits == 8 else 256
        assert packed[t, g, code + 2 * j: code + 2 * j + 2].view(torch.float16).item() == d[n, g].item()
        if m is not None:
            assert packed[t, g, code + 32 + 2 * j: code + 34 + 2 * j].view(torch.float16).item() == m[n, g].item()
    if N % 16:
        tail = packed[-1].reshape(G, -1)
        pad = 128 if bits == 8 else 0
        codes = tail[:, : (512 if bits == 8 else 256)].reshape(G, -1, 16, 4)[:, :, N % 16:]
        assert bool((codes == pad).all())
    back = reference_q8act.unpack_q8act(packed, N, bits, m is not None)
    assert torch.equal(back[0], qw) and torch.equal(back[1], d)
    assert (back[2] is None) == (m is None) and (m is None or torch.equal(back[2], m))


@pytest.mark.parametrize("fmt", list(FMTS))
def test_rows_do_not_depend_on_M_nor_on_the_tier(fmt):
    """Row i of an M-row call equals the same row alone (a verify row = a decode step), in every tier."""
    qw, d, m = case(100, 1536, fmt, seed=5)
    x = activations(20, 1536, seed=6)
    outs = []
    was = _C.set_q8act_tier("auto")
    try:
        for t in TIERS:
            _C.set_q8act_tier(t)
            full = ops.qlinear(x, qw, d, m, None, FMTS[fmt], act="q8")
            for M in (1, 2, 4, 7, 8, 16):
                assert torch.equal(ops.qlinear(x[:M], qw, d, m, None, FMTS[fmt], act="q8"), full[:M]), (t, M)
            assert torch.equal(ops.qlinear(x[13:14], qw, d, m, None, FMTS[fmt], act="q8"), full[13:14]), t
            outs.append(full)
    finally:
        _C.set_q8act_tier(was)
    for t, o in zip(TIERS, outs):
        assert torch.equal(o, outs[0]), f"tier {t} differs from {TIERS[0]}"


def test_fma32_is_a_correctly_rounded_fused_multiply_add():
    """The reference's fma32 equals the C library's fmaf: on random values across magnitudes and on
    the cases where rounding a * b + c first to float64 lands exactly between two float32 values."""
    import ctypes
    import ctypes.util

    libm = ctypes.CDLL(ctypes.util.find_library("m"))
    libm.fmaf.restype = ctypes.c_float
    libm.fmaf.argtypes = [ctypes.c_float] * 3
    g = torch.Generator().manual_seed(0)
    a = torch.randn(3000, generator=g) * 2.0 ** torch.randint(-30, 30, (3000,), generator=g).float()
    b = torch.randn(3000, generator=g) * 2.0 ** torch.randint(-30, 30, (3000,), generator=g).float()
    c = torch.randn(3000, generator=g) * 2.0 ** torch.randint(-30, 30, (3000,), generator=g).float()
    u = 2.0 ** -23
    # exact 1 + u + u/2 - 2^-70 (below the midpoint; float64 rounds onto it, ties-to-even would go up)
    # and its mirror above the midpoint, plus exact products (no tie)
    ties = torch.tensor([[1 + u, 2.0 ** -24 * (1 - u), 1 + u], [1 + u, -(2.0 ** -24) * (1 - u), -(1 + u)],
                         [1 + u, 2.0 ** -24 * (1 + u), 1.0], [3.0, 5.0, -15.0]], dtype=torch.float32)
    a, b, c = torch.cat([a, ties[:, 0]]), torch.cat([b, ties[:, 1]]), torch.cat([c, ties[:, 2]])
    want = torch.tensor([libm.fmaf(x, y, z) for x, y, z in zip(a.tolist(), b.tolist(), c.tolist())])
    got = reference_q8act.fma32(a, b, c)
    assert torch.equal(got, want)
    assert got[-4].item() == 1 + u  # float64 then float32 would give 1 + 2u
    naive = (a.double() * b.double() + c.double()).float()
    assert not torch.equal(naive, want)  # the tie case does occur


@pytest.mark.parametrize("fmt", list(FMTS))
def test_close_to_float_activations(fmt):
    """|y_q8 - y| <= sum_g amax_g / 254 * sum_j |w_gj| (+ float rounding): each code is within d / 2."""
    qw, d, m = case(64, 256, fmt, seed=8)
    x = activations(6, 256, seed=9)
    y8 = ops.qlinear(x, qw, d, m, None, FMTS[fmt], act="q8").double()
    y = ops.qlinear(x, qw, d, m, None, FMTS[fmt]).double()
    w = reference.dequantize_groups(qw, d, m, FMTS[fmt]).double()  # [N, K]
    amax = x.double().abs().reshape(6, -1, 32).amax(-1)  # [M, G]
    bound = (amax / 254) @ w.abs().reshape(64, -1, 32).sum(-1).T  # [M, N]
    assert bool(((y8 - y).abs() <= bound * (1 + 1e-4) + 1e-5).all())
    assert (y8 - y).abs().max() > 0  # the variant does round the activations


@pytest.mark.parametrize("device", DEVICES)
def test_layouts_and_dtypes(device):
    """Leading dims, half inputs (converted to float32, output rounded once), qweight at an odd offset."""
    qw, d, m = case(40, 64, "q4_1", seed=3)
    x = activations(6, 64, seed=4).reshape(2, 3, 64)
    y = ops.qlinear(x.to(device), qw.to(device), d.to(device), m.to(device), None, 4, act="q8")
    assert y.shape == (2, 3, 40)
    assert torch.equal(y.cpu(), reference_q8act.qlinear_q8act(x, qw, d, m, None, 4))
    xh = x.half()
    yh = ops.qlinear(xh.to(device), qw.to(device), d.to(device), m.to(device), None, 4, act="q8")
    assert yh.dtype == torch.float16 and torch.equal(yh.cpu(), reference_q8act.qlinear_q8act(xh, qw, d, m, None, 4))
    q8, d8, _ = case(40, 64, "q8_0", seed=5)
    buf = torch.empty(q8.numel() + 1, dtype=torch.int8)
    odd = buf[1:].view(40, 64)
    odd.copy_(q8)
    y = ops.qlinear(x.to(device), odd.to(device), d8.to(device), None, None, 8, act="q8")
    assert torch.equal(y.cpu(), reference_q8act.qlinear_q8act(x, q8, d8, None, None, 8))


def test_errors():
    qw, d, m = case(8, 64, "q4_1", seed=1)
    x = torch.randn(2, 64)
    with pytest.raises(ValueError, match=r"qlinear: act must be None \(float activations\) or 'q8'"):
        ops.qlinear(x, qw, d, m, None, 4, act="q4")
    with pytest.raises(RuntimeError, match=r"qlinear_q8act: bits must be 8"):
        ops.qlinear(x, qw, d, m, None, 5, act="q8")
    with pytest.raises(RuntimeError, match=r"qlinear_q8act: x's K = 48 must be"):
        ops.qlinear(torch.randn(2, 48), qw, d, m, None, 4, act="q8")
    with pytest.raises(RuntimeError, match=r"quantize_q8: x's K = 40 must be a multiple of the block size 32"):
        ops.quantize_q8(torch.randn(3, 40))
    with pytest.raises(RuntimeError, match=r"set_q8act_tier: tier must be one of auto, avx512_vnni"):
        _C.set_q8act_tier("sse")
    empty = ops.qlinear(torch.randn(0, 64), qw, d, m, None, 4, act="q8")
    assert empty.shape == (0, 8)
    packed = ops.pack_q8act(qw, d, m, 4)
    assert torch.equal(ops.qlinear(torch.randn(0, 64), packed, d, m, None, 4, act="q8"), empty)
    with pytest.raises(RuntimeError, match=r"contiguous uint8 \[1, 2, 288\] \(pack_q8act.*got Byte \[1, 2, 320\]"):
        ops.qlinear(x, packed, d, None, None, 4, act="q8")  # packed with mins, called as Q4_0
    with pytest.raises(RuntimeError, match=r"qlinear_q8act: a packed qweight must be contiguous uint8"):
        ops.qlinear(x, packed[:, :1].contiguous(), d, m, None, 4, act="q8")
    with pytest.raises(RuntimeError, match=r"qlinear_q8act: x's K = 96 must be 32 x the 2 blocks"):
        ops.qlinear(torch.randn(2, 96), packed, d, m, None, 4, act="q8")
    with pytest.raises(RuntimeError, match=r"pack_q8act: a 4-bit qweight must be uint8 \[N, K / 2\]"):
        ops.pack_q8act(qw[:, :16].contiguous(), d, m, 4)
    with pytest.raises(RuntimeError, match=r"pack_q8act: mins are only for 4-bit weights"):
        ops.pack_q8act(torch.zeros(8, 64, dtype=torch.int8), d, m, 8)


def _switch_case(fmt, n, rows, weight_seed, x_seed):
    """A weight of n x 576 in ``fmt``, its packed layout, ``rows`` activation rows and the reference's product: the
    setup of the tests that flip a CPU switch and expect the same bits."""
    qw, d, m = case(n, 576, fmt, seed=weight_seed)
    x = activations(rows, 576, seed=x_seed)
    return qw, d, m, ops.pack_q8act(qw, d, m, FMTS[fmt]), x, reference_q8act.qlinear_q8act(x, qw, d, m, None, FMTS[fmt])


@pytest.mark.parametrize("fmt", list(FMTS))
def test_prefetch_distance_does_not_change_the_bits(fmt, tier):
    qw, d, m, packed, x, want = _switch_case(fmt, 70, 6, 3, 5)
    was, level = _C.set_q8act_prefetch(16), _C.set_q8act_prefetch_level(1)
    try:
        for lv in (1, 2):  # the AVX2 / AVX-VNNI tiers' prefetch into L1 or L2
            _C.set_q8act_prefetch_level(lv)
            for blocks in (0, 1, 16, 4096):
                _C.set_q8act_prefetch(blocks)
                assert torch.equal(ops.qlinear(x, packed, d, m, None, FMTS[fmt], act="q8"), want), (lv, blocks)
        with pytest.raises(RuntimeError, match=r"set_q8act_prefetch: blocks must be in 0\.\.4096, got -1"):
            _C.set_q8act_prefetch(-1)
        with pytest.raises(RuntimeError, match=r"set_q8act_prefetch_level: level must be 1 \(L1\) or 2 \(L2\), got 3"):
            _C.set_q8act_prefetch_level(3)
        assert _C.set_q8act_prefetch(16) == 4096
        assert _C.set_q8act_prefetch_level(1) == 2
    finally:
        _C.set_q8act_prefetch(was)
        _C.set_q8act_prefetch_level(level)


@pytest.mark.parametrize("fmt", list(FMTS))
@pytest.mark.parametrize("rows", [1, 2, 3])
def test_group_pairs_do_not_change_the_bits(fmt, rows, tier):
    """One- and two-row passes on two weight groups at once or one at a time (an odd group count: the
    paired loop's remainder) give the reference's bits in every tier."""
    qw, d, m, packed, x, want = _switch_case(fmt, 70, rows, 4, 6)
    was = _C.set_q8act_group_pairs(True)
    try:
        for on in (True, False):
            _C.set_q8act_group_pairs(on)
            assert torch.equal(ops.qlinear(x, packed, d, m, None, FMTS[fmt], act="q8"), want), on
        assert _C.set_q8act_group_pairs(True) is False
    finally:
        _C.set_q8act_group_pairs(was)


@pytest.mark.parametrize("fmt", list(FMTS))
def test_block_prefetch_does_not_change_the_bits(fmt, tier):
    """The many-row tiles' block prefetch (Q8_0 from 4 rows, Q4 from 6; past a group's end into the next group's
    blocks and past the packed weight's end) at any distance: the reference's bits."""
    qw, d, m, packed, x, want = _switch_case(fmt, 70, 9, 7, 8)  # one tile of 8 rows and one of 1
    was = _C.set_q8act_block_prefetch(2)
    try:
        for blocks in (0, 1, 2, 17, 64):
            _C.set_q8act_block_prefetch(blocks)
            for rows in (3, 4, 6, 9):
                assert torch.equal(ops.qlinear(x[:rows], packed, d, m, None, FMTS[fmt], act="q8"), want[:rows]), blocks
        with pytest.raises(RuntimeError, match=r"set_q8act_block_prefetch: blocks must be in 0\.\.64, got 65"):
            _C.set_q8act_block_prefetch(65)
        assert _C.set_q8act_block_prefetch(2) == 64
    finally:
        _C.set_q8act_block_prefetch(was)


@pytest.mark.parametrize("fmt", list(FMTS))
def test_parallel_quantization_does_not_change_the_bits(fmt, tier):
    """Five activation rows or more quantized on all threads inside the products' parallel region, or on the calling
    thread first (set_q8act_parallel_quantize): the reference's bits, on 1 and 3 threads, at row counts that
    split evenly and not."""
    qw, d, m, packed, x, want = _switch_case(fmt, 300, 11, 15, 16)
    was, threads = _C.set_q8act_parallel_quantize(True), torch.get_num_threads()
    try:
        for n in (1, 3):
            torch.set_num_threads(n)
            for on in (True, False):
                _C.set_q8act_parallel_quantize(on)
                for rows in (1, 4, 5, 6, 11):
                    got = ops.qlinear(x[:rows], packed, d, m, None, FMTS[fmt], act="q8")
                    assert torch.equal(got, want[:rows]), (n, on, rows)
        assert _C.set_q8act_parallel_quantize(True) is False
    finally:
        torch.set_num_threads(threads)
        _C.set_q8act_parallel_quantize(was)


@pytest.mark.parametrize("fmt", list(FMTS))
def test_many_rows_threshold_does_not_change_the_bits(fmt, tier):
    """Which tiles take the many-row prefetch (set_q8act_many_rows) changes no bit; the setter checks its range."""
    qw, d, m, packed, x, want = _switch_case(fmt, 70, 9, 13, 14)
    was = _C.set_q8act_many_rows(4, 6)
    try:
        assert was == (4, 6)  # the defaults
        for q8, q4 in ((1, 1), (9, 9), (3, 4)):
            _C.set_q8act_many_rows(q8, q4)
            for rows in range(1, 10):
                got = ops.qlinear(x[:rows], packed, d, m, None, FMTS[fmt], act="q8")
                assert torch.equal(got, want[:rows]), (q8, q4, rows)
        with pytest.raises(RuntimeError, match=r"set_q8act_many_rows: q8_rows and q4_rows must be in 1\.\.9"):
            _C.set_q8act_many_rows(0, 4)
        assert _C.set_q8act_many_rows(4, 6) == (3, 4)
    finally:
        _C.set_q8act_many_rows(*was)


@pytest.mark.parametrize("fmt", list(FMTS))
def test_stream_prefetch_does_not_change_the_bits(fmt, tier):
    """The few-row tiles' stream prefetch (every line of a block ahead, into L2, past a group's end into the next
    group's blocks and past the packed weight's end) at any distance, group pairs on and off: the reference's
    bits."""
    qw, d, m, packed, x, want = _switch_case(fmt, 70, 5, 11, 12)
    was, pairs = _C.set_q8act_stream_prefetch(2), _C.set_q8act_group_pairs(True)
    try:
        for on in (True, False):
            _C.set_q8act_group_pairs(on)
            for blocks in (0, 1, 2, 17, 64):
                _C.set_q8act_stream_prefetch(blocks)
                for rows in (1, 2, 3, 5):
                    got = ops.qlinear(x[:rows], packed, d, m, None, FMTS[fmt], act="q8")
                    assert torch.equal(got, want[:rows]), (on, blocks, rows)
        with pytest.raises(RuntimeError, match=r"set_q8act_stream_prefetch: blocks must be in 0\.\.64, got 65"):
            _C.set_q8act_stream_prefetch(65)
        assert _C.set_q8act_stream_prefetch(2) == 64
    finally:
        _C.set_q8act_stream_prefetch(was)
        _C.set_q8act_group_pairs(pairs)


@pytest.mark.parametrize("fmt", list(FMTS))
def test_amx_path_gives_the_reference_bits(fmt):
    """The AVX-512 VNNI tier's AMX path (set_q8act_amx_rows; off by default) on every format, rows in and past one
    16-row tile, weight groups in threes and their remainders, with and without bias: the reference's bits."""
    if "avx512_vnni" not in TIERS or not _C.q8act_amx():
        pytest.skip("this CPU or OS does not run AMX-INT8")
    was_tier, was = _C.set_q8act_tier("avx512_vnni"), _C.set_q8act_amx_rows(1)
    try:
        for N in (16, 37, 83):
            qw, d, m, packed, x, want = _switch_case(fmt, N, 40, 3, 96)
            bias = torch.randn(N, generator=gen(4))
            want_b = reference_q8act.qlinear_q8act(x, qw, d, m, bias, FMTS[fmt])
            for rows in (1, 2, 5, 8, 15, 16, 17, 33, 40):
                got = ops.qlinear(x[:rows], packed, d, m, None, FMTS[fmt], act="q8")
                assert torch.equal(got, want[:rows]), (N, rows)
                got = ops.qlinear(x[:rows], packed, d, m, bias, FMTS[fmt], act="q8")
                assert torch.equal(got, want_b[:rows]), (N, rows, "bias")
        with pytest.raises(RuntimeError, match=r"set_q8act_amx_rows: rows must be in 0\.\.65"):
            _C.set_q8act_amx_rows(-1)
    finally:
        _C.set_q8act_amx_rows(was)
        _C.set_q8act_tier(was_tier)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("fmt", ["q4_1", "q8_0"])
def test_more_rows_than_a_grid_dimension_holds(device, fmt):
    """70,000 activation rows (a long prefill): more than CUDA's 65,535 blocks in a grid's y dimension, which
    the quantizer's grid once used for rows; every row's codes, scales and outputs are the reference's."""
    M = 70_000
    x = torch.randn(M, 64, generator=gen(9))
    qw, d, m = case(16, 64, fmt, seed=10)
    a, s = ops.quantize_q8(x.to(device))
    ra, rs = reference_q8act.quantize_q8(x)
    assert torch.equal(a.cpu(), ra) and torch.equal(s.cpu(), rs)
    y = ops.qlinear(x.to(device), qw.to(device), d.to(device), put(m, device), None, FMTS[fmt], act="q8")
    assert torch.equal(y.cpu(), reference_q8act.qlinear_q8act(x, qw, d, m, None, FMTS[fmt]))
