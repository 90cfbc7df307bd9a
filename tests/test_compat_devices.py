"""The compat adapters on CUDA tensors: every form's integers equal its CPU result.

On the CPU most adapters take host forms (NumPy views, lists, C++ helpers); CUDA tensors take the
tensor forms, which the CPU tests only reach through the ``HOST_FORM`` switches. Here the same
random cases run on the CPU (host forms) and on the GPU (tensor forms, the CUDA ops), and the
outputs must be equal: tokens, counts and indices exactly, attention within float rounding, page
writes exactly. The samplers also run on a "cpu-tensor-forms" target (the CPU with the host forms
switched off: the GPU's code path, checked on every machine); the GPU cases are skipped without a
GPU build (benchmarks/gpu_check.sh runs them in its ops stage).
"""
from __future__ import annotations

import contextlib
import random

import pytest
import torch

from specdec.compat import flashinfer as fi
from specdec.compat import sglang as sg
from specdec.compat import vllm

from conftest import DEVICES
from test_compat_chains import fi_case, vllm_case
from test_compat_sglang import random_batch, run_greedy, run_sampling, sample_case
from test_compat_vllm_tree import random_trees

# "cpu-tensor-forms": the CPU with every host form switched off, i.e. the code path CUDA tensors take,
# run here on every machine; "cuda": the GPU (skipped without one)
GPU = [p for p in DEVICES if p.id == "cuda"]
TARGETS = [pytest.param("cpu-tensor-forms", id="cpu_tensor_forms")] + GPU


@contextlib.contextmanager
def forms(device):
    """Inside: the adapters' tensor forms when ``device`` is "cpu-tensor-forms" (CUDA takes them anyway)."""
    from specdec.compat import sglang_host, vllm_tree
    mods = [(m, "HOST_FORM") for m in (fi, vllm, vllm_tree, sg)] + [(sglang_host, "NATIVE")]
    saved = [getattr(m, a) for m, a in mods]
    if device == "cpu-tensor-forms":
        for m, a in mods:
            setattr(m, a, False)
    try:
        yield
    finally:
        for (m, a), v in zip(mods, saved):
            setattr(m, a, v)


def _to(dev, *ts):
    dev = "cpu" if dev == "cpu-tensor-forms" else dev
    return [t.to(dev, copy=True) if isinstance(t, torch.Tensor) else t for t in ts]


def _same(cpu, gpu, what):
    for i, (a, b) in enumerate(zip(cpu, gpu)):
        assert torch.equal(a, b.cpu()), f"{what}: output {i} differs between CPU and CUDA"


@pytest.mark.parametrize("device", TARGETS)
@pytest.mark.parametrize("B", [1, 8, 33])
def test_flashinfer_chain_sampler_on_cuda(device, B):
    g = torch.Generator().manual_seed(B)
    for _ in range(5):
        q, d, p, u = fi_case(B, 4, 37, g)
        acc0 = torch.arange(B, dtype=torch.int32)  # the maybe_* buffers are added to in place
        got = fi.chain_speculative_sampling_uniform(q, d, u, p, acc0.clone(), acc0.clone())
        dq, dd, dp, du, da, de = _to(device, q, d, p, u, acc0.clone(), acc0.clone())
        with forms(device):
            got_d = fi.chain_speculative_sampling_uniform(dq, dd, du, dp, da, de)
        _same(got, got_d, "chain_speculative_sampling_uniform")
        assert torch.equal(da.cpu(), got[1]) and torch.equal(de.cpu(), got[2])
    # the generator form: the same structure on the GPU (its draws come from the device's generator)
    q, d, p, _ = fi_case(B, 4, 37, g)
    with forms(device):
        out, acc, emit = fi.chain_speculative_sampling(*_to(device, q, d, p), seed=3, offset=0)
    assert out.device == _to(device, p)[0].device and out.dtype == torch.int32 and out.shape == (B, 5)
    assert bool(((out >= -1) & (out < 37)).all()) and bool((emit <= 4).all()) and bool((acc <= 4).all())


@pytest.mark.parametrize("device", TARGETS)
@pytest.mark.parametrize("with_draft", [False, True])
@pytest.mark.parametrize("B", [1, 8, 33])
def test_vllm_chain_sampler_on_cuda(device, with_draft, B):
    g = torch.Generator().manual_seed(10 * B + with_draft)
    for greedy_frac in (0.0, 0.5, 1.0):
        d, n, cu, q, p, bonus, temp, u = vllm_case(B, 5, 41, g, with_draft, greedy_frac)
        want = vllm.rejection_sample(d, n, max(n), cu, q, p, bonus, temp, uniforms=u)
        dd, dcu, dq, dp, db, dt, du = _to(device, d, cu, q, p, bonus, temp, u)
        with forms(device):
            got = vllm.rejection_sample(dd, n, max(n), dcu, dq, dp, db, dt, uniforms=du)
        _same([want], [got], f"vllm.rejection_sample greedy_frac={greedy_frac}")


@pytest.mark.parametrize("device", TARGETS)
@pytest.mark.parametrize("B", [1, 8, 33])
def test_vllm_tree_sampler_on_cuda(device, B):
    g = torch.Generator().manual_seed(20 + B)
    for greedy in (True, False):
        d, par, n, cu, p = random_trees(B, 6, 23, g)
        temp = torch.zeros(B) if greedy else torch.ones(B)
        u = torch.rand(B, 7, generator=g, dtype=torch.float64)
        want = vllm.tree_rejection_sample(d, par, n, 6, cu, None, p, temp, uniforms=u)
        with forms(device):
            got = vllm.tree_rejection_sample(*_to(device, d, par), n, 6, *_to(device, cu), None,
                                             *_to(device, p, temp), uniforms=_to(device, u)[0])
        _same(list(want), list(got), f"vllm.tree_rejection_sample greedy={greedy}")


@pytest.mark.parametrize("device", TARGETS)
@pytest.mark.parametrize("B", [1, 8, 33])
def test_sglang_forms_on_cuda(device, B):
    rng = random.Random(B)
    g = torch.Generator().manual_seed(30 + B)
    for kind in ("chain", "bushy", "mixed"):
        N, V = 7, 29
        S = rng.randint(2, N + 1)
        cand, ri, nt, ns, tp = random_batch(rng, B, N, V, kind)
        want = run_greedy(cand, ri, nt, ns, tp, S)
        with forms(device):
            got = run_greedy(*_to(device, cand, ri, nt, ns, tp), S)
        _same(want, got, f"sglang.verify_tree_greedy {kind}")
        cand, ri, nt, ns, us, uf, probs = sample_case(rng, g, B, N, V, kind)
        want = run_sampling(cand, ri, nt, ns, us, uf, probs, S)
        with forms(device):
            got = run_sampling(*_to(device, cand, ri, nt, ns, us, uf, probs), S)
        _same(want, got, f"sglang.tree_speculative_sampling_target_only {kind}")


@pytest.mark.parametrize("device", GPU)
@pytest.mark.parametrize("layout", ["NHD", "HND"])
@pytest.mark.parametrize("ps", [1, 16])
def test_flashinfer_paged_kv_on_cuda(device, layout, ps):
    g = torch.Generator().manual_seed(ps)
    B, H, D, N = 3, 2, 64, 4
    lens = torch.tensor([5, 0, 33], dtype=torch.int32)
    pages_per = [-(-(int(x) + N) // ps) for x in lens]
    P = sum(pages_per) + 3  # spare pages stay untouched
    perm = torch.randperm(P, generator=g)
    table = torch.full((B, max(pages_per)), -1, dtype=torch.int32)
    used = 0
    for b, k in enumerate(pages_per):
        table[b, :k] = perm[used:used + k].to(torch.int32)
        used += k
    meta = fi.kv_lens_to_metadata(table, lens + N, ps)
    shape = (P, ps, H, D) if layout == "NHD" else (P, H, ps, D)
    pool = torch.randn(P, 2, *shape[1:], generator=g)  # the combined form: K = [:, 0], V = [:, 1]
    kn, vn = torch.randn(B * N, H, D, generator=g), torch.randn(B * N, H, D, generator=g)
    q = torch.randn(B * N, 6, D, generator=g)
    acc = torch.tensor([[0, 2, 3, -1], [0, -1, -1, -1], [0, 1, 3, -1]], dtype=torch.int32)
    num = torch.tensor([2, 0, 2], dtype=torch.int32)
    outs = {}
    for dev in ("cpu", device):
        pl = pool.to(dev, copy=True)
        m = [t.to(dev) for t in meta[:3]]
        fi.append_paged_kv_cache(kn.to(dev), vn.to(dev), pl, m[1], m[0], m[2], num_new=N, kv_layout=layout)
        o = fi.verify_attention_paged(q.to(dev), pl, m[0], m[1], m[2], qo_len=N, kv_layout=layout)
        new = fi.commit_paged_kv([pl], m[0], m[1], m[2], acc.to(dev), num.to(dev), num_new=N, kv_layout=layout)
        outs[dev] = (pl.cpu(), o.cpu(), new.cpu())
    (pc, oc, nc), (pg, og, ng) = outs["cpu"], outs[device]
    assert torch.equal(pc, pg) and torch.equal(nc, ng)
    torch.testing.assert_close(og, oc, atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("device", GPU)
@pytest.mark.parametrize("layout", ["NHD", "HND"])
def test_flashinfer_wrapper_on_cuda(device, layout):
    """plan / run with ragged query lengths and a custom tree mask: CUDA tensors give the CPU's result."""
    from test_compat_flashinfer_wrapper import _batch, _tree_block
    g = torch.Generator().manual_seed(9)
    ps, qo, prefix, Hkv, D = 16, [4, 1, 4], [20, 3, 40], 2, 64
    k, v, ip, idx, last, kv_lens = _batch(g, ps, qo, prefix, Hkv, D)
    pools = (k, v) if layout == "NHD" else (k.transpose(1, 2).contiguous(), v.transpose(1, 2).contiguous())
    flat = torch.cat([_tree_block(g, n, L).flatten() for n, L in zip(qo, kv_lens)])
    q = torch.randn(sum(qo), 6, D, generator=g)
    outs = {}
    for dev in ("cpu", device):
        w = fi.BatchPrefillWithPagedKVCacheWrapper(None, layout)
        meta = [torch.tensor(x, dtype=torch.int32, device=dev) for x in ([0, 4, 5, 9], ip, idx, last)]
        w.plan(*meta, 6, Hkv, D, ps, custom_mask=flat.to(dev))
        outs[dev] = w.run(q.to(dev), tuple(t.to(dev) for t in pools)).cpu()
    torch.testing.assert_close(outs[device], outs["cpu"], atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("device", GPU)
def test_vllm_commit_on_cuda(device):
    g = torch.Generator().manual_seed(7)
    B, S, P, ps, H, D = 4, 5, 64, 4, 2, 8
    d, par, n, cu, p = random_trees(B, S, 5, g)
    res = vllm.tree_rejection_sample(d, par, n, S, cu, None, p, torch.zeros(B))
    table = torch.randperm(P, generator=g)[:6 * 8].view(6, 8).to(torch.int32)
    rows = torch.tensor([4, 0, 2, 5])
    lens = torch.tensor([3, 0, 7, 9], dtype=torch.int32)
    kv = [torch.randn(2, P, ps, H, D, generator=g) for _ in range(2)]
    outs = {}
    for dev in ("cpu", device):
        c = [t.to(dev, copy=True) for t in kv]
        new = vllm.commit_accepted_kv(c, table.to(dev), rows.to(dev), lens.to(dev), res.accepted.to(dev),
                                      res.num_accepted.to(dev))
        outs[dev] = [t.cpu() for t in c] + [new.cpu()]
    _same(outs["cpu"], outs[device], "vllm.commit_accepted_kv")
