"""linear_argmax / qlinear_argmax: the argmax of linear / qlinear's result without its logits (CPU: vocabulary
slabs through the op's own kernel; CUDA: the product, then one block per row).

The integers must equal torch.argmax of the same device's op output exactly (every weight type and format,
every q8 tier, slab boundaries, ties, NaN, rounding to x's dtype), and the reference's on data whose logits the
float32 kernels and the float64 reference order alike.
"""
from __future__ import annotations

import math

import pytest
import torch

from specdec import _C, ops, reference

from conftest import DEVICES, gen, maybe

ROWS = [1, 2, 3, 5, 8, 17, 33, 64, 65, 80]
TIERS = _C.q8act_tiers().split(",")


def weight(N, K, seed, dtype=torch.float32):
    return (torch.randn(N, K, generator=gen(seed)) / math.sqrt(K)).to(dtype)


def xs(M, K, seed, dtype=torch.float32):
    return torch.randn(M, K, generator=gen(seed + 1000)).to(dtype)


@pytest.fixture(params=TIERS)
def tier(request):
    was = _C.set_q8act_tier(request.param)
    yield request.param
    _C.set_q8act_tier(was)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("wkind", ["float32", "float16", "bfloat16", "int8"])
def test_linear_argmax_equals_argmax_of_linear(device, wkind):
    K, N = 96, 2 * 1024 + 37  # three slabs, the last one partial
    for i, M in enumerate(ROWS):
        dtype = torch.float32 if wkind == "int8" else getattr(torch, wkind)
        x = xs(M, K, i, dtype).to(device)
        if wkind == "int8":
            w, s = ops.quantize_weight_int8(weight(N, K, i))
            w, s = w.to(device), s.to(device)
        else:
            w, s = weight(N, K, i, dtype).to(device), None
        b = maybe(torch.randn(N, generator=gen(i)).to(dtype) if i % 2 else None, device)
        got = ops.linear_argmax(x, w, b, s)
        want = torch.argmax(ops.linear(x, w, b, s), dim=-1)
        assert got.dtype == torch.int64 and got.shape == (M,)
        assert torch.equal(got, want), (wkind, M)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("fmt", ["q8_0", "q4_0", "q4_1"])
@pytest.mark.parametrize("act", [None, "q8"])
def test_qlinear_argmax_equals_argmax_of_qlinear(device, fmt, act):
    K, N = 64, 1024 + 1024 // 2 + 9
    bits = 8 if fmt == "q8_0" else 4
    for i, M in enumerate(ROWS):
        q, d, m = ops.quantize_weight_groups(weight(N, K, 10 + i), fmt)
        x = xs(M, K, i).to(device)
        b = maybe(torch.randn(N, generator=gen(i)) if i % 2 else None, device)
        q, d, m = q.to(device), d.to(device), maybe(m, device)
        got = ops.qlinear_argmax(x, q, d, m, b, bits, act=act)
        want = torch.argmax(ops.qlinear(x, q, d, m, b, bits, act=act), dim=-1)
        assert torch.equal(got, want), (fmt, act, M)


@pytest.mark.parametrize("fmt", ["q8_0", "q4_1"])
def test_qlinear_argmax_q8_packed_every_tier_and_reference(fmt, tier):
    """The CPU's packed layout takes the slabs; the q8 definition is exact, so the reference agrees too."""
    K, N = 96, 2 * 1024 + 21
    bits = 8 if fmt == "q8_0" else 4
    q, d, m = ops.quantize_weight_groups(weight(N, K, 3), fmt)
    packed = ops.pack_q8act(q, d, m, bits)
    for i, M in enumerate([1, 2, 4, 6, 9, 64, 70]):
        x = xs(M, K, 50 + i)
        got = ops.qlinear_argmax(x, packed, d, m, None, bits, act="q8")
        assert torch.equal(got, torch.argmax(ops.qlinear(x, packed, d, m, None, bits, act="q8"), dim=-1))
        assert torch.equal(got, reference.qlinear_argmax(x, q, d, m, None, bits, act="q8")), (tier, M)


def test_float_forms_agree_with_reference():
    """Random data: the float32 kernels and the float64 reference pick the same maxima (no near ties here)."""
    K, N = 64, 3000
    x = xs(6, K, 7)
    w = weight(N, K, 7)
    assert torch.equal(ops.linear_argmax(x, w), reference.linear_argmax(x, w))
    q, d, m = ops.quantize_weight_groups(w, "q4_1")
    assert torch.equal(ops.qlinear_argmax(x, q, d, m, None, 4), reference.qlinear_argmax(x, q, d, m, None, 4))


@pytest.mark.parametrize("device", DEVICES)
def test_ties_nan_and_leading_shape(device):
    K, N = 32, 3 * 1024 + 5
    w = torch.zeros(N, K)
    for col in (4000 - 1024, 1500, 7):  # equal maxima in three slabs: the first column wins
        w[col] = 1.0
    x = torch.ones(2, 3, K)
    got = ops.linear_argmax(x.to(device), w.to(device))
    assert got.shape == (2, 3) and bool((got == 7).all())
    bias = torch.zeros(N)
    bias[2500], bias[3000] = float("nan"), float("nan")  # NaN beats every value; the first NaN wins
    got = ops.linear_argmax(x.to(device), w.to(device), bias.to(device))
    assert bool((got == 2500).all())
    zero = ops.linear_argmax(torch.zeros(1, K, device=device), -w.to(device))  # -0 and +0 are equal: index 0
    assert zero.tolist() == [0]
    one = ops.linear_argmax(torch.ones(K, device=device), w.to(device))  # a 1-D x: a 0-d answer
    assert one.dim() == 0 and int(one) == 7


@pytest.mark.parametrize("device", DEVICES)
def test_rounding_to_x_dtype_decides(device):
    """float16: column 2000's float32 logit 1 + 2^-11 rounds to 1.0 (ties to even), equal to column 10's, so
    column 10 wins, as torch.argmax of linear's float16 result says."""
    K, N = 32, 2048 + 3
    w = torch.zeros(N, K, dtype=torch.float16)
    w[10] = 1.0 / 32
    w[2000] = 1.0 / 32
    w[2000, 0] = 1.0 / 32 + 2.0 ** -11
    x = torch.ones(1, K, dtype=torch.float16)
    assert int(torch.argmax(ops.linear(x.float(), w.float()), -1)) == 2000
    got = ops.linear_argmax(x.to(device), w.to(device))
    assert got.tolist() == [10] == torch.argmax(ops.linear(x.to(device), w.to(device)), -1).tolist()


def test_errors_name_the_op():
    x = torch.randn(2, 64)
    with pytest.raises(RuntimeError, match=r"^linear_argmax: .*N >= 1"):
        ops.linear_argmax(x, torch.randn(0, 64))
    with pytest.raises(RuntimeError, match=r"^linear_argmax: weight must be \[N, K\]"):
        ops.linear_argmax(x, torch.randn(5, 32))
    q, d, m = ops.quantize_weight_groups(torch.randn(40, 64), "q4_1")
    with pytest.raises(RuntimeError, match=r"^qlinear_argmax: bits must be"):
        ops.qlinear_argmax(x, q, d, m, None, 5)
    with pytest.raises(RuntimeError, match=r"^qlinear_argmax: "):
        ops.qlinear_argmax(torch.randn(2, 48), q, d, m, None, 4, act="q8")
    with pytest.raises(ValueError, match=r"^qlinear_argmax: act must be"):
        ops.qlinear_argmax(x, q, d, m, None, 4, act="q4")
    assert ops.linear_argmax(torch.randn(0, 64), torch.randn(5, 64)).shape == (0,)
