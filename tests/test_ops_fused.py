"""The fused small ops (rms_norm, add_rms_norm, rope, silu_mul) against specdec.reference.

rope and add_rms_norm's residual sum round exactly where torch rounds: bit-identical to the
reference on every backend and dtype. rms_norm (float32 sum of squares in the kernel's own
order, rsqrt) and silu_mul (exp) are compared with the float64 value of the same expression:
float32 error 1e-5 relative, plus the roundings to the dtype the expression itself makes
(rms_norm: r and w * r; silu_mul: silu and the product), each at most one unit of the dtype
when float32 noise flips a rounding.
"""
from __future__ import annotations

import re

import pytest
import torch

from specdec import ops, reference

from conftest import DEVICES, FLOAT_DTYPES, HAS_CUDA, gen

UNIT = {torch.float32: 2.0 ** -23, torch.float16: 2.0 ** -10, torch.bfloat16: 2.0 ** -7}
SUBNORMAL = {torch.float32: 2.0 ** -149, torch.float16: 2.0 ** -24, torch.bfloat16: 2.0 ** -133}


def _close(got, exact, dtype, roundings, scale=1.0):
    """scale: the factor after an intermediate rounding (its subnormal spacing is absolute)."""
    tol = (1e-5 + roundings * UNIT[dtype]) * exact.abs() + roundings * SUBNORMAL[dtype] * (1 + scale) + 1e-30
    err = (got.cpu().double() - exact).abs()
    assert got.dtype == dtype and got.shape == exact.shape
    assert bool((err <= tol).all()), f"max err {err.max().item():.3e}, worst ratio {(err / tol).max().item():.2f}"


def _rms_exact(s, w, eps):
    s64 = s.double()
    return w.double() * s64 * torch.rsqrt(s64.pow(2).mean(-1, keepdim=True) + eps)


SHAPES = [(1, 576), (3, 5, 64), (2, 1, 7), (4, 33), (70, 576)]  # odd H, leading dims, > 32K elements


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_rms_norm_matches_reference(device, dtype, shape):
    g = gen(sum(shape))
    x = (torch.randn(*shape, generator=g) * 3).to(dtype)
    w = (torch.rand(shape[-1], generator=g) + 0.5).to(dtype)
    eps = 1e-5
    got = ops.rms_norm(x.to(device), w.to(device), eps)
    _close(got, _rms_exact(x, w, eps), dtype, roundings=2)
    ref = reference.rms_norm(x, w, eps)
    _close(ref, _rms_exact(x, w, eps), dtype, roundings=2)  # the spec is held to the same bound


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_add_rms_norm_matches_reference(device, dtype, shape):
    g = gen(sum(shape) + 1)
    x = torch.randn(*shape, generator=g).to(dtype)
    res = (torch.randn(*shape, generator=g) * 4).to(dtype)
    w = (torch.rand(shape[-1], generator=g) + 0.5).to(dtype)
    out, s = ops.add_rms_norm(x.to(device), res.to(device), w.to(device), 1e-6)
    assert torch.equal(s.cpu(), x + res)  # one rounding of the sum, as torch's add
    _close(out, _rms_exact(x + res, w, 1e-6), dtype, roundings=2)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
@pytest.mark.parametrize("B,N,Hq,Hkv,D", [(1, 1, 9, 3, 64), (2, 5, 4, 2, 8), (3, 100, 2, 1, 6)])
def test_rope_bit_identical_to_reference(device, dtype, B, N, Hq, Hkv, D):
    g = gen(B * N + D)
    q = torch.randn(B, N, Hq, D, generator=g).to(dtype)
    k = torch.randn(B, N, Hkv, D, generator=g).to(dtype)
    ang = torch.rand(B, N, D // 2, generator=g) * 100
    ang = torch.cat([ang, ang], -1)  # the rotary layout: the same angle for i and i + D / 2
    cos, sin = ang.cos().to(dtype), ang.sin().to(dtype)
    gq, gk = ops.rope(*(t.to(device) for t in (q, k, cos, sin)))
    wq, wk = reference.rope(q, k, cos, sin)
    assert gq.dtype == dtype and torch.equal(gq.cpu(), wq)
    assert torch.equal(gk.cpu(), wk)


@pytest.mark.parametrize("device", DEVICES)
def test_rope_noncontiguous_and_model_tables(device):
    """Strided q / k (views of a fused projection, transposed tables) give the contiguous result;
    the tables of a real rotary module (Llama-3 scaling) round-trip through the op."""
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding
    cfg = LlamaConfig(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                      rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                    "high_freq_factor": 4.0, "original_max_position_embeddings": 128})
    rot = LlamaRotaryEmbedding(cfg)
    g = gen(11)
    B, N, D = 2, 6, 16
    pos = torch.randint(0, 500, (B, N), generator=g)
    qkv = torch.randn(B, N, 8 * D, generator=g)
    cos, sin = rot(qkv, pos)
    q = qkv[..., :4 * D].view(B, N, 4, D)          # a strided view
    k = qkv[..., 4 * D:6 * D].view(B, N, 2, D)
    gq, gk = ops.rope(q.to(device), k.to(device), cos.to(device), sin.to(device))
    wq, wk = reference.rope(q.contiguous(), k.contiguous(), cos, sin)
    assert torch.equal(gq.cpu(), wq) and torch.equal(gk.cpu(), wk)


@pytest.mark.parametrize("device", DEVICES)
def test_silu_mul_is_elementwise_and_exact_at_the_extremes(device):
    """Each output depends on its own element only (a verify pass of N rows computes what N decode
    steps would, bit for bit), and the tails of the float range are right: large negative gates
    (where a vector exp underflows), large positive ones, zeros, infinities."""
    g = gen(7)
    gate = torch.cat([torch.randn(29, generator=g) * 6,
                      torch.tensor([-150.0, -100.0, -87.5, -80.5, -79.5, -20.0, -0.0, 0.0, 1e-30, 20.0, 88.0, 200.0])])
    up = torch.randn(gate.numel(), generator=g)
    whole = ops.silu_mul(gate.to(device), up.to(device)).cpu()
    for i in range(gate.numel()):  # alone, and at another offset of a longer row
        alone = ops.silu_mul(gate[i:i + 1].to(device), up[i:i + 1].to(device)).cpu()
        shifted = ops.silu_mul(gate[max(0, i - 3):].to(device), up[max(0, i - 3):].to(device)).cpu()
        assert torch.equal(alone[0], whole[i]) and torch.equal(shifted[i - max(0, i - 3)], whole[i]), i
    g64 = gate.double()
    exact = g64 * torch.sigmoid(g64) * up.double()
    _close(whole, exact, torch.float32, roundings=2, scale=up.double().abs())
    inf = torch.tensor([float("inf"), float("-inf"), float("nan")])
    got = ops.silu_mul(inf.to(device), torch.ones(3, device=device)).cpu()
    want = torch.nn.functional.silu(inf)
    assert torch.equal(got.isnan(), want.isnan()) and got[0] == want[0]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
@pytest.mark.parametrize("shape", [(1, 1536), (3, 7), (5, 2, 11), (40, 1700)], ids=str)
def test_silu_mul_matches_reference(device, dtype, shape):
    g = gen(sum(shape) + 2)
    gate = (torch.randn(*shape, generator=g) * 4).to(dtype)
    up = torch.randn(*shape, generator=g).to(dtype)
    got = ops.silu_mul(gate.to(device), up.to(device))
    g64 = gate.double()
    exact = g64 * torch.sigmoid(g64) * up.double()
    _close(got, exact, dtype, roundings=2, scale=up.double().abs())
    _close(reference.silu_mul(gate, up), exact, dtype, roundings=2, scale=up.double().abs())


@pytest.mark.parametrize("device", DEVICES)
def test_fused_empty(device):
    z = torch.zeros(0, 4, device=device)
    w = torch.ones(4, device=device)
    assert ops.rms_norm(z, w, 1e-5).shape == (0, 4)
    out, s = ops.add_rms_norm(z, z, w, 1e-5)
    assert out.shape == s.shape == (0, 4)
    q = torch.zeros(2, 0, 3, 8, device=device)
    t = torch.zeros(2, 0, 8, device=device)
    a, b = ops.rope(q, torch.zeros(2, 0, 1, 8, device=device), t, t)
    assert a.shape == (2, 0, 3, 8) and b.shape == (2, 0, 1, 8)
    assert ops.silu_mul(z, z).shape == (0, 4)


def _rope_args():
    g = gen(3)
    return dict(q=torch.randn(2, 3, 4, 8, generator=g), k=torch.randn(2, 3, 2, 8, generator=g),
                cos=torch.randn(2, 3, 8, generator=g), sin=torch.randn(2, 3, 8, generator=g))


ERRORS = [
    ("rms_norm", dict(x=torch.randn(2, 6).int(), weight=torch.ones(6), eps=1e-5),
     "rms_norm: x must be float32, float16 or bfloat16, got Int"),
    ("rms_norm", dict(x=torch.tensor(1.0), weight=torch.ones(1), eps=1e-5),
     "rms_norm: x must be [..., H], got a 0-d tensor"),
    ("rms_norm", dict(x=torch.randn(2, 6), weight=torch.ones(5), eps=1e-5),
     "rms_norm: weight must be Float [6] (x's dtype and last size), got Float [5]"),
    ("rms_norm", dict(x=torch.randn(2, 6), weight=torch.ones(6).half(), eps=1e-5),
     "rms_norm: weight must be Float [6] (x's dtype and last size), got Half [6]"),
    ("rms_norm", dict(x=torch.randn(2, 6), weight=torch.ones(6), eps=-1.0),
     "rms_norm: eps must be a finite number >= 0, got -1"),
    ("add_rms_norm", dict(x=torch.randn(2, 6), residual=torch.randn(2, 5), weight=torch.ones(6), eps=1e-5),
     "add_rms_norm: residual must be Float [2, 6] like x, got Float [2, 5]"),
    ("add_rms_norm", dict(x=torch.randn(2, 6), residual=torch.randn(2, 6).bfloat16(), weight=torch.ones(6), eps=1e-5),
     "add_rms_norm: residual must be Float [2, 6] like x, got BFloat16 [2, 6]"),
    ("rope", dict(_rope_args(), q=torch.randn(2, 3, 32)), "rope: q must be [B, N, Hq, D], got [2, 3, 32]"),
    ("rope", dict(_rope_args(), q=torch.randn(2, 3, 4, 7), k=torch.randn(2, 3, 2, 7)),
     "rope: the head dim D must be even (rotate-half pairs), got D = 7"),
    ("rope", dict(_rope_args(), k=torch.randn(2, 4, 2, 8)),
     "rope: k must be Float [B, N, Hkv, D] = [2, 3, Hkv, 8], got Float [2, 4, 2, 8]"),
    ("rope", dict(_rope_args(), cos=torch.randn(3, 8)),
     "rope: cos must be Float [B, N, D] = [2, 3, 8] (the model's rotary table at each position), got Float [3, 8]"),
    ("rope", dict(_rope_args(), sin=torch.randn(2, 3, 8).half()),
     "rope: sin must be Float [B, N, D] = [2, 3, 8] (the model's rotary table at each position), got Half [2, 3, 8]"),
    ("rope", dict(_rope_args(), q=torch.randn(2, 3, 4, 8).long()),
     "rope: q must be float32, float16 or bfloat16, got Long"),
    ("silu_mul", dict(gate=torch.randn(3, 4), up=torch.randn(4, 3)),
     "silu_mul: up must be Float [3, 4] like gate, got Float [4, 3]"),
    ("silu_mul", dict(gate=torch.randn(3, 4).double(), up=torch.randn(3, 4).double()),
     "silu_mul: gate must be float32, float16 or bfloat16, got Double"),
]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("case", range(len(ERRORS)), ids=[f"{e[0]}-{i}" for i, e in enumerate(ERRORS)])
def test_fused_errors(device, case):
    op, args, msg = ERRORS[case]
    args = {k: (v.to(device) if isinstance(v, torch.Tensor) else v) for k, v in args.items()}
    before = {k: v.clone() for k, v in args.items() if isinstance(v, torch.Tensor)}
    with pytest.raises(RuntimeError, match=re.escape(msg)):
        getattr(ops, op)(**args)
    assert all(torch.equal(before[k], args[k]) for k in before)  # functional ops: inputs untouched


@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device (two devices to mismatch)")
@pytest.mark.parametrize("op,name", [("rms_norm", "weight"), ("add_rms_norm", "residual"), ("rope", "k"),
                                     ("rope", "cos"), ("silu_mul", "up")])
def test_fused_device_mismatch(op, name):
    base = {"rms_norm": dict(x=torch.randn(2, 6), weight=torch.ones(6), eps=1e-5),
            "add_rms_norm": dict(x=torch.randn(2, 6), residual=torch.randn(2, 6), weight=torch.ones(6), eps=1e-5),
            "rope": _rope_args(), "silu_mul": dict(gate=torch.randn(3, 4), up=torch.randn(3, 4))}[op]
    args = {k: (v.cuda() if isinstance(v, torch.Tensor) and k != name else v) for k, v in base.items()}
    with pytest.raises(RuntimeError, match=re.escape(f"{op}: {name} must be on cuda:0 like the other inputs, got cpu")):
        getattr(ops, op)(**args)
