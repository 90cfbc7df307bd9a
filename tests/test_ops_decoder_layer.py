"""ops.decoder_layer: one Llama-style layer in one call.

It must equal the sequence of the separate compiled ops bit for bit (same kernels, same
order: reference.decoder_layer_with(ops, ...)) on every backend, dtype and projection
layout, write the same K/V into the caches, agree with the pure-torch reference within
float rounding, and reject bad input with an error that names the op and the argument,
before anything is written.
"""
from __future__ import annotations

import pytest
import torch

from specdec import ops, reference

from conftest import DEVICES, FLOAT_DTYPES, gen

H, HQ, HKV, D, I, S = 64, 4, 2, 16, 96, 56


def _layer(layout, dtype, g, bias=False):
    """(weights, scales, mins, biases, bits) of one layer in the given projection layout."""
    shapes7 = [(HQ * D, H), (HKV * D, H), (HKV * D, H), (H, HQ * D), (I, H), (I, H), (H, I)]
    if layout in ("float7", "int8"):
        shapes = shapes7
    else:  # merged q / k / v and gate / up
        shapes = [((HQ + 2 * HKV) * D, H), (H, HQ * D), (2 * I, H), (H, I)]
    weights, scales, mins, biases, bits = [], [], [], [], []
    for n, k in shapes:
        w = torch.randn(n, k, generator=g) * k ** -0.5
        b = (torch.randn(n, generator=g) * 0.1).to(dtype) if bias else None
        if layout == "float7":
            weights.append(w.to(dtype)), scales.append(None), mins.append(None), bits.append(0)
        elif layout == "int8":
            qw, sc = ops.quantize_weight_int8(w)
            weights.append(qw), scales.append(sc), mins.append(None), bits.append(0)
        else:  # "fmt+q8": quantized activations, decoder_layer's bits | 32
            fmt, _, act = layout.partition("+")
            qw, d, m = ops.quantize_weight_groups(w, fmt)
            weights.append(qw), scales.append(d), mins.append(m)
            bits.append((8 if fmt == "q8_0" else 4) | (32 if act else 0))
        biases.append(b)
    return weights, scales, mins, biases, bits


def _case(device, dtype, layout, B=2, N=3, frontier=False, bias=False, seed=0):
    g = gen(seed)
    weights, scales, mins, biases, bits = _layer(layout, dtype, g, bias)
    x = torch.randn(B, N, H, generator=g).to(dtype)
    h = (torch.randn(B, N, H, generator=g) * 2).to(dtype)
    post, nxt = (torch.rand(H, generator=g) + 0.5).to(dtype), (torch.rand(H, generator=g) + 0.5).to(dtype)
    kc = torch.randn(B, HKV, S, D, generator=g).to(dtype)
    vc = torch.randn(B, HKV, S, D, generator=g).to(dtype)
    lens = torch.randint(0, 12, (B,), generator=g, dtype=torch.int32)
    ang = torch.randn(B, N, D // 2, generator=g)
    cos, sin = torch.cat([ang.cos()] * 2, -1).to(dtype), torch.cat([ang.sin()] * 2, -1).to(dtype)
    mask, offset = None, 0
    if frontier:  # the last N of Nkv = N + 2 new nodes query (a dynamic tree's frontier)
        mask = torch.rand(B, N, N + 2, generator=g) < 0.6
        offset = 2
    elif N > 1:
        mask = torch.ones(B, N, N, dtype=torch.bool).tril() & (torch.rand(B, N, N, generator=g) < 0.8)
        mask |= torch.eye(N, dtype=torch.bool)
    dev = lambda t: None if t is None else t.to(device)  # noqa: E731
    return dict(x=dev(x), h=dev(h), weights=[dev(t) for t in weights], scales=[dev(t) for t in scales],
                mins=[dev(t) for t in mins], biases=[dev(t) for t in biases], bits=bits, post_norm_weight=dev(post),
                post_norm_eps=1e-5, next_norm_weight=dev(nxt), next_norm_eps=1e-6, k_cache=dev(kc), v_cache=dev(vc),
                cache_lens=dev(lens), cos=dev(cos), sin=dev(sin), tree_mask=dev(mask), kv_offset=offset,
                scale=D ** -0.5, num_heads=HQ, num_kv_heads=HKV)


def _with_caches(args):
    out = dict(args)
    out["k_cache"], out["v_cache"] = args["k_cache"].clone(), args["v_cache"].clone()
    return out


LAYOUTS = ["float7", "int8", "q4_1", "q8_0", "q4_0", "q4_1+q8", "q8_0+q8"]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("shape", ["decode", "tree", "frontier", "bias-batch3", "prefill"])
def test_decoder_layer_equals_the_separate_ops(device, dtype, layout, shape):
    kw = dict(decode=dict(B=1, N=1), tree=dict(B=2, N=5), frontier=dict(B=2, N=3, frontier=True),
              **{"bias-batch3": dict(B=3, N=2, bias=True), "prefill": dict(B=1, N=36)})[shape]
    args = _case(device, dtype, layout, seed=hash((layout, shape)) % 1000, **kw)
    a, b = _with_caches(args), _with_caches(args)
    got = ops.decoder_layer(**a)
    want = reference.decoder_layer_with(ops, **b)
    for t, w in zip(got, want):
        assert t.dtype == dtype and t.shape == args["x"].shape
        assert torch.equal(t, w), f"max diff {(t.float() - w.float()).abs().max().item():.3e}"
    assert torch.equal(a["k_cache"], b["k_cache"]) and torch.equal(a["v_cache"], b["v_cache"])
    assert not torch.equal(a["k_cache"], args["k_cache"])  # the new K were written


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
@pytest.mark.parametrize("layout", ["q4_1+q8", "q8_0+q8"])
@pytest.mark.parametrize("shape", ["decode", "tree", "prefill"])
def test_decoder_layer_takes_packed_q8act_weights(dtype, layout, shape):
    """On the CPU a q8-activation slot may hold pack_q8act's layout (what the lean forward passes): the same
    bits and caches as the usual weights; a packed weight in a float-activation slot is refused."""
    kw = dict(decode=dict(B=1, N=1), tree=dict(B=2, N=5), prefill=dict(B=1, N=36))[shape]
    args = _case("cpu", dtype, layout, seed=7, bias=True, **kw)
    packed = dict(args)
    packed["weights"] = [ops.pack_q8act(w, d, m, b & ~32) for w, d, m, b in
                         zip(args["weights"], args["scales"], args["mins"], args["bits"])]
    a, b = _with_caches(packed), _with_caches(args)
    for t, w in zip(ops.decoder_layer(**a), ops.decoder_layer(**b)):
        assert torch.equal(t, w)
    assert torch.equal(a["k_cache"], b["k_cache"]) and torch.equal(a["v_cache"], b["v_cache"])
    bad = _with_caches(packed)
    bad["bits"] = [bits & ~32 for bits in args["bits"]]
    with pytest.raises(RuntimeError, match=r"decoder_layer: weights\[0\] \(qkv\) must be a 2-D weight \(or, for a "
                                           r"q8-activation slot on the CPU, pack_q8act's 3-D layout\)"):
        ops.decoder_layer(**bad)
    assert torch.equal(bad["k_cache"], args["k_cache"])  # refused before any cache write


@pytest.mark.skipif(not __import__("specdec")._C.build_info().get("cpu_avx512", False),
                    reason="the CPU has no AVX-512 F / DQ / VL")
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("N", [4, 5, 8, 16])
def test_decoder_layer_avx512_gives_the_avx2_bits(layout, N):
    """A verify-size layer (float32: the q / k / v and gate / up linears in one parallel region) gives the
    same bits with the AVX-512 few-row kernels as with the AVX2 ones, caches included."""
    from specdec import _C

    args = _case("cpu", torch.float32, layout, B=1, N=N, bias=True, seed=N)
    a, b = _with_caches(args), _with_caches(args)
    prev = _C.set_cpu_avx512(True)
    try:
        on = ops.decoder_layer(**a)
        _C.set_cpu_avx512(False)
        off = ops.decoder_layer(**b)
    finally:
        _C.set_cpu_avx512(prev)
    for t, w in zip(on, off):
        assert torch.equal(t, w)
    assert torch.equal(a["k_cache"], b["k_cache"]) and torch.equal(a["v_cache"], b["v_cache"])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("layout", ["float7", "q4_1"])
def test_decoder_layer_matches_reference(device, layout):
    args = _case(device, torch.float32, layout, B=2, N=4, bias=True, seed=3)
    a = _with_caches(args)
    cpu = {k: (v.cpu() if isinstance(v, torch.Tensor) else
               [t if t is None else t.cpu() for t in v] if isinstance(v, list) and k != "bits" else v)
           for k, v in args.items()}
    b = _with_caches(cpu)
    got = ops.decoder_layer(**a)
    want = reference.decoder_layer(**b)
    for t, w in zip(got, want):
        torch.testing.assert_close(t.cpu(), w, rtol=2e-4, atol=2e-4)
    torch.testing.assert_close(a["k_cache"].cpu(), b["k_cache"], rtol=2e-4, atol=2e-4)


def _bad(name):
    """(mutate args, message fragment) of each bad-input case."""
    def weights_len(a):
        a["weights"] = a["weights"][:5]
    def bits(a):
        a["bits"] = [0, 0, 0, 0, 0, 0, 3]
    def wrong_shape(a):
        a["weights"][3] = a["weights"][3][:, :-1]
    def bias_dtype(a):
        a["biases"][1] = torch.zeros(HKV * D, dtype=torch.float64, device=a["x"].device)
    def h_shape(a):
        a["h"] = a["h"][:, :1]
    def heads(a):
        a["num_heads"] = 3
    def lens(a):
        a["cache_lens"] = torch.tensor([S, 0], dtype=torch.int32, device=a["x"].device)
    def mask(a):
        a["tree_mask"] = torch.ones(2, 3, 2, dtype=torch.bool, device=a["x"].device)
    def norm(a):
        a["next_norm_weight"] = a["next_norm_weight"][:-1]
    def cos(a):
        a["cos"] = a["cos"][..., :-2]
    def kv_dtype(a):
        a["v_cache"] = a["v_cache"].double()
    def scales_len(a):
        a["scales"] = a["scales"][:6]
    return {
        "weights_len": (weights_len, "weights must hold 7 projections"),
        "bits": (bits, "bits[6] must be 0"),
        "wrong_shape": (wrong_shape, "weights[3] (o) must map 64 to 64 features"),
        "bias_dtype": (bias_dtype, "projection k (slot 1): linear: bias"),
        "h_shape": (h_shape, "h (the residual stream) must be"),
        "heads": (heads, "num_heads % num_kv_heads"),
        "lens": (lens, "attention inputs: append_kv: cache_lens"),
        "mask": (mask, "attention inputs"),
        "norm": (norm, "next_norm_weight"),
        "cos": (cos, "attention inputs: rope: cos"),
        "kv_dtype": (kv_dtype, "attention inputs"),
        "scales_len": (scales_len, "scales, mins, biases and bits must have one entry per projection"),
    }[name]


BAD = ["weights_len", "bits", "wrong_shape", "bias_dtype", "h_shape", "heads", "lens", "mask", "norm", "cos",
       "kv_dtype", "scales_len"]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("case", BAD)
def test_decoder_layer_errors_change_nothing(device, case):
    args = _case(device, torch.float32, "float7", B=2, N=3, seed=9)
    mutate, fragment = _bad(case)
    mutate(args)
    k0, v0 = args["k_cache"].clone(), args["v_cache"].clone()
    with pytest.raises(RuntimeError) as info:
        ops.decoder_layer(**args)
    msg = str(info.value).splitlines()[0]
    assert msg.startswith("decoder_layer: ") and fragment in msg, msg
    assert torch.equal(args["k_cache"], k0) and torch.equal(args["v_cache"].to(v0.dtype), v0)
