"""Batch invariance of the CUDA verification path (docs/gpu.md, "Batch invariance").

A verify pass over N nodes of B requests must give each row the bits of the decode step that
would produce it, so that greedy speculation on a GPU is token-identical to plain greedy decoding
on the same GPU. CUDA `linear` / `qlinear` keep a row's sums independent of the row count up to
64 rows; `verify_attention` keeps them independent of B, N and the query heads per KV head up to
B * N = 64 rows, for chain-shaped visibility (each node sees the prefix and the nodes before it).

On the CPU: the launch plans the CUDA launchers use (specdec/cuda_plan.h, the same code, exposed
as specdec._C.cuda_plan on every build) depend on the row's dtype, head dim and the cache's
capacity only. On a GPU: the bits themselves, at many shapes (the bundled-model decoding check is
tests/test_cuda_decoding.py, the gpu_check.sh decoding stage).
"""
from __future__ import annotations

import pytest
import torch

from conftest import HAS_CUDA, gen
from specdec import _C, ops

needs_cuda = pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device and a CUDA build of specdec "
                                "(batch invariance of the CUDA kernels; the launch plans are checked on the CPU)")

HEAD_DIMS = (64, 80, 96, 128, 256)
CAPACITIES = (1, 17, 128, 129, 300, 4096, 8192, 8193, 16384, 70000)


# --------------------------------------------------------------------------- plans (CPU)
@pytest.mark.parametrize("dtype_bytes", [2, 4], ids=["16bit", "fp32"])
@pytest.mark.parametrize("head_dim", HEAD_DIMS)
def test_attention_plan_depends_on_capacity_only(dtype_bytes, head_dim):
    """Up to 64 rows (B * N) the numbers that order a row's sums (chunk, splits, key warps, key
    block and step) are the same for every B * N and every G * N query rows per KV head; the rest
    only partitions the rows. Above 64 rows: the occupancy plan (flagged, not invariant)."""
    for cap in CAPACITIES:
        plans = [_C.cuda_plan(dtype_bytes, head_dim, cap, G * N, B * N)["attention"]
                 for G in (1, 2, 3, 4, 8, 16) for N in range(1, 65) for B in range(1, 64 // N + 1)]
        fixed = {(p["chunk"], p["splits"], p["key_warps"], p["key_block"], p["key_step"], p["invariant"])
                 for p in plans}
        assert len(fixed) == 1 and next(iter(fixed))[-1], (cap, sorted(fixed))
        for rows in range(1, 1025):
            p = _C.cuda_plan(dtype_bytes, head_dim, cap, rows, 1)["attention"]
            assert p["row_warps"] * p["key_warps"] <= 4 and p["row_warps"] >= 1
            assert p["rows_per_tile"] * p["row_tiles"] >= rows > p["rows_per_tile"] * (p["row_tiles"] - 1)
        big = _C.cuda_plan(dtype_bytes, head_dim, cap, 16, 65)["attention"]
        assert not big["invariant"] and big["chunk"] == 0 and big["min_chunk"] % big["key_block"] == 0


@pytest.mark.parametrize("dtype_bytes", [2, 4], ids=["16bit", "fp32"])
@pytest.mark.parametrize("head_dim", HEAD_DIMS)
def test_attention_plan_chunks(dtype_bytes, head_dim):
    """Chunks of whole key blocks at fixed positions: 128 keys while 64 splits cover the capacity,
    then the smallest doubling that does; every key warp takes the same steps of a stage."""
    for cap in CAPACITIES:
        p = _C.cuda_plan(dtype_bytes, head_dim, cap, 16, 16)["attention"]
        chunk, splits = p["chunk"], p["splits"]
        assert chunk % p["key_block"] == 0 and p["key_block"] % (p["key_step"] * p["key_warps"]) == 0
        assert chunk >= 128 and (chunk // 128) & (chunk // 128 - 1) == 0  # 128 * 2^k
        assert splits <= 64 and splits * chunk >= cap and (splits - 1) * chunk < cap
        if chunk > 128:
            assert (chunk // 2) * 64 < cap  # the smallest chunk that fits
        assert (splits == 1) == (cap <= chunk)
    # 16-bit inputs: 4 key warps at D <= 128 (tensor cores, 64-key stages of 16-key steps), 2 at 256
    want = {2: 4 if head_dim <= 128 else 2, 4: 1}[dtype_bytes]
    assert _C.cuda_plan(dtype_bytes, head_dim, 4096, 1, 1)["attention"]["key_warps"] == want


def test_linear_plan_threshold():
    """Own kernel (1, 4, 16 or 64 accumulators per lane) up to 64 rows, cuBLAS (0) above."""
    blocks = {m: _C.cuda_plan(2, 64, 1, 1, m)["linear_row_block"] for m in range(1, 200)}
    assert all(blocks[m] >= m for m in range(1, 65)) and all(blocks[m] == 0 for m in range(65, 200))
    assert {blocks[m] for m in range(1, 65)} == {1, 4, 16, 64}
    assert _C.cuda_plan(2, 64, 1, 1, 1)["linear_invariant_rows"] == 64


def test_plan_bad_arguments():
    with pytest.raises(RuntimeError, match="cuda_plan: dtype_bytes must be 2 or 4, got 8"):
        _C.cuda_plan(8, 64, 10, 1, 1)
    with pytest.raises(RuntimeError, match="cuda_plan: head_dim must be a multiple of 16"):
        _C.cuda_plan(2, 70, 10, 1, 1)


# --------------------------------------------------------------------------- linear / qlinear (GPU)
ROW_COUNTS = (1, 2, 3, 4, 5, 8, 15, 16, 17, 31, 32, 33, 48, 63, 64)
SHAPES_BN = ((1, 64), (2, 32), (4, 16), (8, 8), (16, 4), (64, 1), (3, 7), (5, 12))


def _rows_invariant(fn, x: torch.Tensor, what: str) -> None:
    """fn on every prefix of x's 64 rows, on [B, N, K] views of them and on a misaligned copy gives
    each row the bits fn gives it alone."""
    single = torch.cat([fn(x[i:i + 1]) for i in range(x.shape[0])])
    for M in ROW_COUNTS:
        assert torch.equal(fn(x[:M]), single[:M]), f"{what}: rows differ at M = {M}"
    for B, N in SHAPES_BN:
        got = fn(x[:B * N].reshape(B, N, -1)).reshape(B * N, -1)
        assert torch.equal(got, single[:B * N]), f"{what}: rows differ at B = {B}, N = {N}"
    buf = torch.empty(x.numel() + 1, dtype=x.dtype, device=x.device)
    xs = buf[1:].view_as(x)  # 2 / 4 bytes past an aligned base: not 16-byte aligned
    xs.copy_(x)
    assert torch.equal(fn(xs[:33]), single[:33]), f"{what}: a misaligned x changes the bits"


@needs_cuda
@pytest.mark.parametrize("kind", ["fp32", "fp16", "bf16", "int8", "int8-bf16x"])
@pytest.mark.parametrize("K", [576, 584, 43, 2048])
def test_cuda_linear_rows_bit_invariant(kind, K):
    g = gen(7100 + K)
    Nout = 200
    w = torch.randn(Nout, K, generator=g) / K ** 0.5
    b = torch.randn(Nout, generator=g)
    x = torch.randn(64, K, generator=g)
    if kind.startswith("int8"):
        q, s = ops.quantize_weight_int8(w)
        dt = torch.bfloat16 if kind == "int8-bf16x" else torch.float32
        args = (q.cuda(), b.to(dt).cuda(), s.cuda())
    else:
        dt = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}[kind]
        args = (w.to(dt).cuda(), b.to(dt).cuda(), None)
    _rows_invariant(lambda t: ops.linear(t, *args), x.to(dt).cuda(), f"linear {kind} K={K}")


@needs_cuda
@pytest.mark.parametrize("fmt", ["q8_0", "q4_0", "q4_1"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_cuda_qlinear_rows_bit_invariant(fmt, dtype):
    g = gen(7200)
    K, Nout = 1024, 160
    w = torch.randn(Nout, K, generator=g) / 32
    qw, d, m = ops.quantize_weight_groups(w, fmt)
    bits = 8 if fmt == "q8_0" else 4
    b = torch.randn(Nout, generator=g).to(dtype).cuda()
    args = (qw.cuda(), d.cuda(), None if m is None else m.cuda(), b, bits)
    x = torch.randn(64, K, generator=g).to(dtype).cuda()
    _rows_invariant(lambda t: ops.qlinear(t, *args), x, f"qlinear {fmt} {dtype}")


@needs_cuda
def test_cuda_linear_above_threshold_still_matches():
    """Above 64 rows (cuBLAS, not batch-invariant) the result is still the float32-accumulated one."""
    g = gen(7300)
    w = torch.randn(96, 512, generator=g) / 24
    x = torch.randn(80, 512, generator=g)
    y = ops.linear(x.cuda(), w.cuda(), None).cpu()
    torch.testing.assert_close(y, x.double().matmul(w.double().T).float(), rtol=1e-5, atol=1e-5)


# --------------------------------------------------------------------------- verify_attention (GPU)
def _attention_case(seed, dtype, B, Hkv, G, D, S, N):
    """Random q for N nodes and K / V for every position of a [B, Hkv, S, D] cache (made on the GPU)."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    q = torch.randn(B, N, Hkv * G, D, generator=g, device="cuda").to(dtype)
    k = torch.randn(B, Hkv, S, D, generator=g, device="cuda").to(dtype)
    v = torch.randn(B, Hkv, S, D, generator=g, device="cuda").to(dtype)
    return q, k, v


def _decode_rows(q, k, v, lens, scale):
    """Node i of request b as the decode step that produced it: one query, cache_lens + i committed."""
    B, N = q.shape[:2]
    out = torch.empty_like(q)
    for i in range(N):
        out[:, i:i + 1] = ops.verify_attention(q[:, i:i + 1].contiguous(), k, v, lens + i, None, scale)
    return out


@needs_cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=["fp32", "fp16", "bf16"])
@pytest.mark.parametrize("D", [64, 128, 256])
@pytest.mark.parametrize("G", [1, 3, 4])
@pytest.mark.parametrize("S", [120, 700, 9000])
def test_cuda_verify_attention_chain_equals_decode_steps(dtype, D, G, S):
    """A chain verify pass (N = 1 .. 21 nodes, B = 1 .. 3 requests, explicit mask or none) gives
    every node the bits of its decode step, and a request the same bits alone or in a batch.
    S = 120: one split; 700: 6 splits of 128 keys; 9000: 36 splits of 256 keys -- lengths that
    put a row's keys across split, stage and warp-step boundaries."""
    Hkv, scale = 2, D ** -0.5
    q_all, k, v = _attention_case(7400 + D + G + S, dtype, 3, Hkv, G, D, S, 24)
    lens = torch.tensor([S - 30, 1, 127 % (S - 30)], dtype=torch.int32, device="cuda")
    for N in (1, 2, 5, 16, 21):  # B * N <= 63: the invariant plan
        q = q_all[:, :N].contiguous()
        want = _decode_rows(q, k, v, lens, scale)
        got = ops.verify_attention(q, k, v, lens, None, scale)
        assert torch.equal(got, want), f"N = {N}: a verify row differs from its decode step"
        chain = torch.ones(N, N, dtype=torch.bool, device="cuda").tril().expand(3, N, N).contiguous()
        assert torch.equal(ops.verify_attention(q, k, v, lens, chain, scale), want), f"N = {N}: explicit chain mask"
        for b in range(3):  # the request alone (B = 1)
            alone = ops.verify_attention(q[b:b + 1], k[b:b + 1], v[b:b + 1], lens[b:b + 1], None, scale)
            assert torch.equal(alone, got[b:b + 1]), f"N = {N}: request {b} differs alone and in the batch"
        if N >= 4:  # the first nodes as a shorter verify (the same prefix of the chain)
            part = ops.verify_attention(q[:, :N // 2].contiguous(), k, v, lens, None, scale)
            assert torch.equal(part, got[:, :N // 2]), f"N = {N}: the first {N // 2} nodes differ as a shorter pass"


# --------------------------------------------------------------------------- a model (CPU and GPU)
_CPU_MODEL_CASES = (("fp32", "decoder_layer", 1000), ("bf16", "separate_ops", 64))  # the CPU has its own tests
MODEL_CASES = [pytest.param(dev, dt, layers, cap, id=f"{dev}-{name}-{layers}-{cap}",
                            marks=[needs_cuda] if dev == "cuda" else [])
               for dev in ("cpu", "cuda") for dt, name in ((torch.float32, "fp32"), (torch.bfloat16, "bf16"))
               for layers in ("decoder_layer", "separate_ops") for cap in (64, 1000)
               if dev == "cuda" or (name, layers, cap) in _CPU_MODEL_CASES]


@pytest.mark.parametrize("device,dtype,layers,capacity", MODEL_CASES)
def test_model_verify_equals_decode_steps(device, dtype, layers, capacity):
    """The whole forward on the device (linears, norms, RoPE, append_kv, verify_attention; each layer
    as one ops.decoder_layer call or as separate ops): the logits of a 16-node chain verify of 3
    requests (48 rows) are the bits of 16 one-token decode steps, and a request's logits are the
    same alone. capacity 1000: 8 splits of 128 keys, prompts that cross them."""
    from specdec import HFCausalLM
    from test_models import _tiny

    lm = HFCausalLM(_tiny("llama").to(dtype).to(device), fused_layers=layers == "decoder_layer")
    g = gen(7500 + capacity)
    lens = (5, 9, 2) if capacity == 64 else (130, 300, 5)
    prompts = [torch.randint(0, 151, (n,), generator=g).tolist() for n in lens]
    B, N = len(prompts), 16
    toks = torch.randint(0, 151, (B, N), generator=g).to(device)
    depths = torch.arange(N, device=device).expand(B, N)
    batch = lm.new_cache(B, capacity)
    lm.prefill(batch, prompts)
    verify = lm.forward(batch, toks, depths)
    cache = lm.new_cache(B, capacity)
    lm.prefill(cache, prompts)
    for i in range(N):
        step = lm.forward(cache, toks[:, i:i + 1], torch.zeros(B, 1, dtype=torch.long, device=device))
        assert torch.equal(step[:, 0], verify[:, i]), f"node {i}: verify logits differ from the decode step"
        cache.lens += 1
    alone = lm.new_cache(1, capacity)  # request 1's prefix as the batch prefilled it (prefill rows > 64
    for src, dst in zip(batch.k + batch.v, alone.k + alone.v):  # are cuBLAS's: not batch-invariant)
        dst.copy_(src[1:2])
    alone.lens.copy_(batch.lens[1:2])
    assert torch.equal(lm.forward(alone, toks[1:2], depths[:1]), verify[1:2]), "request 1 differs alone"
