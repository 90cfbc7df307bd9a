"""specdec.compat.vllm / specdec.compat.flashinfer (chains) against independent pure-Python
implementations of each stack's documented semantics, written here from those semantics.

Exact integer comparisons where the randomness can be shared (greedy rows; FlashInfer's
uniform_samples form; vLLM's acceptance decisions under shared uniforms); statistical exactness
(chi-square) of the sampled forms on small vocabularies; error messages.
SPECDEC_COMPAT_CASES scales the number of random cases (default 2,400 per form).
"""
from __future__ import annotations

import math
import os
from types import SimpleNamespace

import pytest
import torch

from specdec import ops
from specdec.compat import flashinfer as fi
from specdec.compat import vllm

CASES = int(os.environ.get("SPECDEC_COMPAT_CASES", "2400"))


def _gen(seed):
    g = torch.Generator()
    g.manual_seed(seed)
    return g


def _dist(shape, g, sparsity=0.3, sharp=3.0):
    z = torch.randn(*shape, generator=g) * sharp
    keep = (torch.rand(*shape, generator=g) >= sparsity) | (z == z.max(-1, keepdim=True).values)
    p = torch.softmax(z, -1) * keep
    return p / p.sum(-1, keepdim=True)


# =========================================================================== FlashInfer
def fi_reference_uniform(draft_probs, draft_token_ids, uniform_samples, target_probs):
    """FlashInfer chain speculative sampling, per its documentation, one row at a time."""
    B, N, V = draft_probs.shape
    out = torch.full((B, N + 1), -1, dtype=torch.int32)
    acc = torch.zeros(B, dtype=torch.int32)
    emit = torch.zeros(B, dtype=torch.int32)
    for b in range(B):
        q = draft_probs[b].tolist()
        p = target_probs[b].tolist()
        d = draft_token_ids[b].tolist()
        u = uniform_samples[b].tolist()
        pos = N
        for j in range(N):
            if u[j] * q[j][d[j]] < p[j][d[j]]:
                out[b, j] = d[j]
            else:
                pos = j
                break
        n_acc = pos + sum(1 for j in range(pos + 1, N) if u[j] * q[j][d[j]] < p[j][d[j]])
        if pos < N:
            r = [max(a - c, 0.0) for a, c in zip(p[pos], q[pos])]
        else:
            r = list(p[N])
        t = u[min(pos + 1, N)] * sum(r)
        tok, run = max(i for i in range(V) if r[i] > 0), 0.0
        for i in range(V):
            run += r[i]
            if run > t and r[i] > 0:
                tok = i
                break
        out[b, pos] = tok
        acc[b], emit[b] = n_acc, pos
    return out, acc, emit


def fi_case(B, N, V, g):
    q = _dist((B, N, V), g)
    p = _dist((B, N + 1, V), g)
    # make the target follow the draft often, so that long chains are accepted too
    mix = (torch.rand(B, N + 1, 1, generator=g) < 0.5).float()
    p[:, :N] = mix[:, :N] * q + (1 - mix[:, :N]) * p[:, :N]
    d = torch.multinomial(q.reshape(B * N, V), 1, generator=g).reshape(B, N).to(torch.int32)
    u = torch.rand(B, N + 1, generator=g, dtype=torch.float64)
    return q, d, p, u


def test_flashinfer_docstring_example():
    dp = torch.tensor([[[0.1, 0.2, 0.3, 0.4], [0.2, 0.3, 0.4, 0.1]]])
    d = torch.tensor([[2, 1]], dtype=torch.int32)
    tp = torch.tensor([[[0.0, 0.1, 0.6, 0.3], [1.0, 0.0, 0.0, 0.0], [0.7, 0.1, 0.1, 0.1]]])
    out, acc, emit = fi.chain_speculative_sampling(dp, d, tp, seed=0)
    assert out.tolist() == [[2, 0, -1]] and out.dtype == torch.int32
    assert acc.tolist() == [1] and emit.tolist() == [1]


def test_flashinfer_uniform_form_matches_reference():
    g = _gen(1)
    done = 0
    shapes = [(1, 2), (1, 5), (2, 3), (3, 8), (4, 4), (5, 17), (6, 2), (8, 6)]
    i = 0
    while done < CASES:
        N, V = shapes[i % len(shapes)]
        B = 64
        q, d, p, u = fi_case(B, N, V, g)
        want = fi_reference_uniform(q, d, u, p)
        got = fi.chain_speculative_sampling_uniform(q, d, u, p)
        for w, h in zip(want, got):
            assert torch.equal(w, h), (i, N, V)
        assert got[0].dtype == torch.int32 and got[0].shape == (B, N + 1)
        done += B
        i += 1


def test_flashinfer_buffers_accumulate_in_place():
    g = _gen(2)
    q, d, p, u = fi_case(16, 4, 7, g)
    acc0 = torch.arange(16, dtype=torch.int32)
    emit0 = torch.full((16,), 5, dtype=torch.int64)
    acc_buf, emit_buf = acc0.clone(), emit0.clone()
    out, acc, emit = fi.chain_speculative_sampling_uniform(q, d, u, p, acc_buf, emit_buf)
    assert acc is acc_buf and emit is emit_buf and emit.dtype == torch.int64
    _, wa, we = fi_reference_uniform(q, d, u, p)
    assert torch.equal(acc_buf, acc0 + wa) and torch.equal(emit_buf, emit0 + we)
    # the emitted count is the number of non-(-1) tokens minus one, -1 only after them
    n_out = (out != -1).sum(1)
    assert torch.equal(n_out - 1, we.to(n_out.dtype))
    assert bool(((out == -1) == (torch.arange(5)[None, :] >= n_out[:, None])).all())
    # the newer counter name, as a keyword, accumulates the same way
    newer = torch.zeros(16, dtype=torch.int32)
    fi.chain_speculative_sampling_uniform(q, d, u, p, maybe_output_emitted_draft_token_num=newer)
    assert torch.equal(newer, we)


def test_flashinfer_seed_form_structure_and_reproducibility():
    g = _gen(3)
    q, d, p, _ = fi_case(256, 5, 9, g)
    a = fi.chain_speculative_sampling(q, d, p, seed=7, offset=3)
    b = fi.chain_speculative_sampling(q, d, p, seed=7, offset=3)
    for x, y in zip(a, b):
        assert torch.equal(x, y)
    out, acc, emit = a
    e = emit.long()
    pos = torch.arange(6)[None, :]
    assert bool(((out == -1) == (pos > e[:, None])).all())  # -1 exactly after the emitted tokens
    assert bool((out[:, :5] == d)[pos[:, :5] < e[:, None]].all())  # emitted drafts are the drafts
    assert bool((acc >= emit).all()) and bool((acc <= 5).all())
    gen = torch.Generator().manual_seed(5)
    c = fi.chain_speculative_sampling(q, d, p, generator=gen)
    assert c[0].shape == (256, 6)


def _chi2_ok(counts, probs, n):
    """Chi-square goodness of fit at p ~ 1e-7 (Wilson-Hilferty quantile)."""
    keep = probs > 0
    assert int(counts[~keep].sum()) == 0, "a token with zero probability was emitted"
    exp = probs[keep] * n
    stat = float(((counts[keep] - exp) ** 2 / exp).sum())
    df = max(int(keep.sum()) - 1, 1)
    z = 5.2
    crit = df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3
    assert stat < crit, (stat, crit, counts.tolist(), exp.tolist())


def test_flashinfer_sampled_form_is_exact():
    g = _gen(4)
    V, N, T = 5, 2, 60000
    q1 = _dist((N, V), g, sparsity=0.0)
    p1 = _dist((N + 1, V), g, sparsity=0.2)
    q = q1.expand(T, N, V).contiguous()
    p = p1.expand(T, N + 1, V).contiguous()
    d = torch.multinomial(q.reshape(T * N, V), 1, generator=g).reshape(T, N).to(torch.int32)
    out, acc, emit = fi.chain_speculative_sampling(q, d, p, generator=g)
    o = out.long()
    _chi2_ok(torch.bincount(o[:, 0], minlength=V).double(), p1[0].double(), T)
    a1 = o[:, 0] == d[:, 0]
    _chi2_ok(torch.bincount(o[a1, 1], minlength=V).double(), p1[1].double(), int(a1.sum()))
    a2 = a1 & (o[:, 1] == d[:, 1])
    _chi2_ok(torch.bincount(o[a2, 2], minlength=V).double(), p1[2].double(), int(a2.sum()))
    # accepted_num: each draft passes on its own with probability sum_x min(p_j, q_j)
    mean = float(torch.minimum(p1[:N], q1).sum())
    var = sum(float(torch.minimum(p1[j], q1[j]).sum()) * (1 - float(torch.minimum(p1[j], q1[j]).sum()))
              for j in range(N))
    assert abs(float(acc.double().mean()) - mean) < 6 * math.sqrt(var * 2 / T) + 1e-9


def test_flashinfer_errors():
    q = torch.full((2, 3, 4), 0.25)
    d = torch.zeros(2, 3, dtype=torch.int32)
    p = torch.full((2, 4, 4), 0.25)
    u = torch.rand(2, 4, dtype=torch.float64)
    f = fi.chain_speculative_sampling
    with pytest.raises(ValueError, match=r"chain_speculative_sampling: target_probs must be .*\[2, 4, 4\]"):
        f(q, d, torch.full((2, 3, 4), 0.25))
    with pytest.raises(ValueError, match="draft_token_ids must be"):
        f(q, torch.zeros(2, 2, dtype=torch.int32), p)
    with pytest.raises(TypeError, match="draft_token_ids must be torch.int32 or torch.int64, got torch.float32"):
        f(q, d.float(), p)
    with pytest.raises(ValueError, match=r"draft_token_ids must be token ids in \[0, 4\)"):
        f(q, d + 4, p)
    with pytest.raises(ValueError, match="draft_probs must be 3-D"):
        f(q[0], d, p)
    with pytest.raises(ValueError, match="maybe_output_accepted_token_num must be"):
        f(q, d, p, torch.zeros(3, dtype=torch.int32))
    with pytest.raises(TypeError, match="maybe_output_emitted_draft_token_num must be"):
        f(q, d, p, None, torch.zeros(2))
    fu = fi.chain_speculative_sampling_uniform
    with pytest.raises(ValueError, match=r"chain_speculative_sampling_uniform: uniform_samples must be .*\[2, 4\]"):
        fu(q, d, u[:, :3], p)
    with pytest.raises(ValueError, match=r"uniform_samples must be values in \[0, 1\]"):
        fu(q, d, u + 1.5, p)


def test_flashinfer_staged_rows_equal_full_staging():
    """The adapter stages only the draft entries and rows the op reads when the op stops where
    FlashInfer's float32 test does, and stages every row otherwise (and in strict mode): both give
    the same outputs, including where the two tests disagree (a draft with q(d) = 0 passes
    FlashInfer's test, never specdec's) and after the kept workspace holds another call's rows."""
    g = _gen(7)
    for i in range(24):
        B, N, V = [(1, 3, 5), (8, 4, 9), (5, 6, 3), (16, 2, 40)][i % 4]
        q, d, p, u = fi_case(B, N, V, g)
        if i % 3 == 0:  # zero draft mass at some drafted tokens: the float32 test and the op part ways
            hit = torch.rand(B, N, generator=g) < 0.3
            q = q.clone()
            q[hit.nonzero(as_tuple=True) + (d.long()[hit],)] = 0.0
        strict = ops.strict_checks()
        ops.set_strict_checks(False)
        try:
            got = fi.chain_speculative_sampling_uniform(q, d, u, p)
            ops.set_strict_checks(True)  # strict mode: every row staged
            want = fi.chain_speculative_sampling_uniform(q, d, u, p)
        finally:
            ops.set_strict_checks(strict)
        for w, h in zip(want, got):
            assert torch.equal(w, h), i


def test_flashinfer_host_form_equals_tensor_form(monkeypatch):
    """CPU batches take the NumPy host form; its outputs and counters equal the tensor form's (the one
    GPUs take) for float32 / float16 / float64 inputs, strided drafts, counters of either dtype and
    drafts with zero draft mass (where the float32 test and the op part ways)."""
    g = _gen(8)
    for i in range(16):
        B, N, V = [(1, 3, 5), (8, 4, 9), (5, 6, 3), (16, 2, 40)][i % 4]
        q, d, p, u = fi_case(B, N, V, g)
        if i % 3 == 0:
            hit = torch.rand(B, N, generator=g) < 0.3
            q = q.clone()
            q[hit.nonzero(as_tuple=True) + (d.long()[hit],)] = 0.0
        dtype = [torch.float32, torch.float16, torch.float64][i % 3]
        q, p = q.to(dtype), p.to(dtype)
        if i % 4 == 1:
            q = torch.cat([q, q], 2)[:, :, :V]  # strided draft rows
            d = d.long()
        u = u.to([torch.float64, torch.float32][i % 2])
        got, want = [], []
        for host, res in ((True, got), (False, want)):
            monkeypatch.setattr(fi, "HOST_FORM", host)
            acc = torch.arange(B, dtype=[torch.int32, torch.int64][i % 2])
            res.extend(fi.chain_speculative_sampling_uniform(q, d, u, p, acc, None))
            res.extend(fi.chain_speculative_sampling_uniform(q, d, u, p))
        for w, h in zip(want, got):
            assert w.dtype == h.dtype and torch.equal(w, h), i


# =========================================================================== vLLM v1
def vllm_reference(draft_ids, num_draft, draft_probs, target_probs, bonus, temperature, uniforms):
    """vLLM v1's rejection sampler, per its documentation; uniforms[b, j + 1] decides draft j
    (accept iff q > 0 and p / q >= u; q = 1 without draft_probs). The recovered token of a sampled
    row is random (its value is not compared): it is returned as None."""
    B = len(num_draft)
    S = max(num_draft)
    out = [[-1] * (S + 1) for _ in range(B)]
    start = 0
    for b, n in enumerate(num_draft):
        greedy = float(temperature[b]) <= 0
        for j in range(n + 1):
            if j == n:
                out[b][j] = int(bonus[b, 0])
                break
            t = start + j
            x = int(draft_ids[t])
            row = target_probs[t]
            if greedy:
                a = int(torch.argmax(row))
                out[b][j] = a
                if a != x:
                    break
            else:
                qx = 1.0 if draft_probs is None else float(draft_probs[t, x])
                px = float(row[x])
                if qx > 0 and px / qx >= float(uniforms[b, j + 1]):
                    out[b][j] = x
                else:
                    out[b][j] = None
                    break
        start += n
    return out


def vllm_case(B, S, V, g, with_draft, greedy_frac, uniform=False):
    n = [S] * B if uniform else torch.randint(0, S + 1, (B,), generator=g).tolist()
    T = sum(n)
    q = _dist((T, V), g) if with_draft else None
    p = _dist((T, V), g)
    src = q if with_draft else p
    if T:
        mix = (torch.rand(T, 1, generator=g) < 0.5).float()
        p = mix * src + (1 - mix) * p if with_draft else p
        d = torch.multinomial(src, 1, generator=g).flatten()
        follow = torch.rand(T, generator=g) < 0.6  # greedy rows: drafts often equal the argmax
        d = torch.where(follow, p.argmax(-1), d)
    else:
        d = torch.zeros(0, dtype=torch.int64)
    bonus = torch.randint(0, V, (B, 1), generator=g)
    temp = torch.where(torch.rand(B, generator=g) < greedy_frac, torch.zeros(B), torch.full((B,), 0.8))
    u = torch.rand(B, max(n) + 1, generator=g, dtype=torch.float64)
    cu = torch.tensor(n, dtype=torch.int64).cumsum(0).to(torch.int32)
    return d.to(torch.int32), n, cu, q, p, bonus.to(torch.int32), temp, u


@pytest.mark.parametrize("with_draft", [False, True])
def test_vllm_matches_reference(with_draft):
    g = _gen(10 + with_draft)
    done = 0
    i = 0
    while done < CASES:
        S, V = [(1, 3), (3, 5), (4, 11), (6, 4), (2, 32)][i % 5]
        B = 48
        d, n, cu, q, p, bonus, temp, u = vllm_case(B, S, V, g, with_draft, greedy_frac=[0.0, 0.5, 1.0][i % 3],
                                                   uniform=i % 4 == 3)  # every request at S drafts: no staging
        got = vllm.rejection_sample(d, n, max(n), cu, q, p, bonus, temp, uniforms=u)
        assert got.dtype == torch.int32 and got.shape == (B, max(n) + 1)
        want = vllm_reference(d, n, q, p, bonus, temp, u)
        start = 0
        for b in range(B):
            w, h = want[b], got[b].tolist()
            for j, (x, y) in enumerate(zip(w, h)):
                if x is None:  # recovered token: random; it must carry residual mass
                    t = start + j
                    dx = int(d[t])
                    assert y != -1, (b, w, h)
                    if q is None:
                        assert y != dx and float(p[t, y]) > 0
                    else:
                        assert float(p[t, y]) > float(q[t, y])
                else:
                    assert x == y, (i, b, w, h)
            start += n[b]
        done += B
        i += 1


@pytest.mark.parametrize("greedy_frac", [0.0, 1.0])
def test_vllm_uniform_counts_wider_output(greedy_frac):
    """Every request at S drafts, one kind of row, and an output wider than S + 1: the same tokens
    as at width S + 1, then -1."""
    g = _gen(30 + int(greedy_frac))
    for with_draft in (False, True):
        d, n, cu, q, p, bonus, temp, u = vllm_case(12, 4, 7, g, with_draft, greedy_frac, uniform=True)
        narrow = vllm.rejection_sample(d, n, 4, cu, q, p, bonus, temp, uniforms=u)
        wide_u = torch.cat([u, torch.rand(12, 2, generator=g, dtype=torch.float64)], 1)
        wide = vllm.rejection_sample(d, n, 6, cu, q, p, bonus, temp, uniforms=wide_u)
        assert wide.shape == (12, 7) and wide.dtype == torch.int32
        assert torch.equal(wide[:, :5], narrow) and bool((wide[:, 5:] == -1).all())


@pytest.mark.parametrize("width", [0, 2])
def test_vllm_greedy_host_form_equals_tensor_form(width, monkeypatch):
    """Every request at S drafts, all greedy, on the CPU: the NumPy form's rows equal the tensor
    form's (the one GPUs take), drafts and bonus tokens int32 or int64, logits in each dtype."""
    g = _gen(31 + width)
    for i, (B, S, V) in enumerate([(1, 1, 5), (3, 4, 9), (40, 3, 6), (9, 6, 40)]):
        d, n, cu, _, p, bonus, temp, _ = vllm_case(B, S, V, g, False, 1.0, uniform=True)
        if i % 2:
            d, bonus = d.long(), bonus.long()
        p = p.to([torch.float32, torch.float16, torch.bfloat16, torch.float32][i])
        got = vllm.rejection_sample(d, n, S + width, cu, None, p, bonus, temp)
        monkeypatch.setattr(vllm, "HOST_FORM", False)
        want = vllm.rejection_sample(d, n, S + width, cu, None, p, bonus, temp)
        monkeypatch.setattr(vllm, "HOST_FORM", True)
        assert got.dtype == want.dtype == torch.int32 and torch.equal(got, want), (B, S, V)


def test_vllm_greedy_host_call_on_edge_rows(monkeypatch):
    """The all-greedy float32 CPU batch is decided by one C++ call (csrc/host/vllm_host.cpp): rows with ties,
    NaN, +-inf and drafts that are their rows' argmax (long acceptances, bonus tokens) give the tensor
    form's output, with a temperature tensor (0 or vLLM's old -1) or an all_greedy metadata object, with and
    without draft distributions."""
    from specdec import _C

    calls = []
    real = _C.vllm_greedy
    monkeypatch.setattr(vllm._C, "vllm_greedy", lambda *a: calls.append(1) or real(*a), raising=False)
    g = _gen(41)
    for B, S, V in [(1, 1, 3), (8, 4, 70), (33, 5, 17)]:
        d, n, cu, _, p, bonus, _, _ = vllm_case(B, S, V, g, False, 1.0, uniform=True)
        p = p.view(B * S, V).clone()
        r = torch.rand(B * S, generator=g)
        p[r < 0.15] = 0.5                                   # ties everywhere: the first index wins
        p[(r >= 0.15) & (r < 0.25), V // 2] = float("nan")  # NaN counts as the maximum
        p[(r >= 0.25) & (r < 0.3)] = float("-inf")
        p[(r >= 0.3) & (r < 0.35), -1] = float("inf")
        take = torch.rand(B * S, generator=g) < 0.7         # most drafts are their row's argmax
        d = torch.where(take, torch.nan_to_num(p, nan=float("inf")).argmax(-1).to(d.dtype), d)
        d = torch.where(torch.isnan(p).any(-1), p.isnan().to(torch.int8).argmax(-1).to(d.dtype), d)
        for meta in (torch.zeros(B), torch.full((B,), -1.0, dtype=torch.float64),
                     SimpleNamespace(temperature=None, all_greedy=True, all_random=False, generators={})):
            before = len(calls)
            got = vllm.rejection_sample(d, n, S + 1, cu, None, p, bonus, meta)
            assert len(calls) == before + 1
            monkeypatch.setattr(vllm, "HOST_FORM", False)
            want = vllm.rejection_sample(d, n, S + 1, cu, None, p, bonus, meta)
            monkeypatch.setattr(vllm, "HOST_FORM", True)
            assert got.dtype == torch.int32 and torch.equal(got, want), (B, S, V)
        assert bool((got[:, S] != -1).any()) or B == 1     # some requests took their bonus token
        q = torch.rand(B * S, V, generator=g)              # draft distributions: unread by greedy rows
        before = len(calls)
        got = vllm.rejection_sample(d, n, S, cu, q, p, bonus, torch.zeros(B))
        assert len(calls) == before + 1
        monkeypatch.setattr(vllm, "HOST_FORM", False)
        want = vllm.rejection_sample(d, n, S, cu, q, p, bonus, torch.zeros(B))
        monkeypatch.setattr(vllm, "HOST_FORM", True)
        assert torch.equal(got, want)


def test_vllm_greedy_host_call_leaves_bad_input_to_the_checks():
    """Input the C++ call does not decide (bool counts, a token outside the vocabulary, a NaN temperature,
    a count that does not match cu_num_draft_tokens) goes on to the general path: its errors, its rows."""
    g = _gen(42)
    d, n, cu, _, p, bonus, temp, _ = vllm_case(4, 3, 9, g, False, 1.0, uniform=True)
    with pytest.raises(ValueError, match="num_draft_tokens must be non-negative ints"):
        vllm.rejection_sample(d, [True] * 4, 3, cu, None, p, bonus, temp)
    bad = d.clone()
    bad[5] = 9
    with pytest.raises(ValueError, match=r"draft_token_ids must be token ids in \[0, 9\)"):
        vllm.rejection_sample(bad, n, 3, cu, None, p, bonus, temp)
    with pytest.raises(ValueError, match="cu_num_draft_tokens must be the inclusive cumsum"):
        vllm.rejection_sample(d, n, 3, cu + 1, None, p, bonus, temp)
    with pytest.raises(ValueError, match="max_spec_len must be an int >= max"):
        vllm.rejection_sample(d, n, 2, cu, None, p, bonus, temp)
    nan_t = temp.clone()
    nan_t[1] = float("nan")  # not greedy: that row is sampled (no error), the others stay greedy
    out = vllm.rejection_sample(d, n, 3, cu, None, p, bonus, nan_t, generator=torch.Generator().manual_seed(0))
    assert out.shape == (4, 4) and out.dtype == torch.int32


@pytest.mark.parametrize("with_draft", [False, True])
def test_vllm_sampled_host_form_equals_tensor_form(with_draft, monkeypatch):
    """Every request at S drafts, all sampled, on the CPU: the host form's rows equal the tensor
    form's, including the requests that reach d_{S-1} (decided in the second call)."""
    g = _gen(35 + with_draft)
    reached = False
    for i, (B, S, V) in enumerate([(1, 1, 5), (3, 4, 9), (40, 3, 6), (9, 6, 40), (64, 2, 3)]):
        d, n, cu, q, p, bonus, temp, u = vllm_case(B, S, V, g, with_draft, 0.0, uniform=True)
        if i % 2:
            d, bonus = d.long(), bonus.long()
        width = i % 3
        u = torch.cat([u, torch.rand(B, width, generator=g, dtype=torch.float64)], 1)
        got = vllm.rejection_sample(d, n, S + width, cu, q, p, bonus, temp, uniforms=u)
        monkeypatch.setattr(vllm, "HOST_FORM", False)
        want = vllm.rejection_sample(d, n, S + width, cu, q, p, bonus, temp, uniforms=u)
        monkeypatch.setattr(vllm, "HOST_FORM", True)
        assert got.dtype == want.dtype == torch.int32 and torch.equal(got, want), (B, S, V)
        reached |= bool((got[:, S] != -1).any())
    assert reached  # some requests decided d_{S-1} in the second call


def test_vllm_generators_and_structure():
    g = _gen(20)
    d, n, cu, q, p, bonus, temp, _ = vllm_case(40, 4, 6, g, True, 0.3)
    gens = {3: torch.Generator().manual_seed(1), 7: torch.Generator().manual_seed(2)}
    meta = SimpleNamespace(temperature=temp, all_greedy=False, all_random=False, generators=gens)
    a = vllm.rejection_sample(d, n, max(n), cu, q, p, bonus, meta, generator=torch.Generator().manual_seed(9))
    gens = {3: torch.Generator().manual_seed(1), 7: torch.Generator().manual_seed(2)}
    meta = SimpleNamespace(temperature=temp, all_greedy=False, all_random=False, generators=gens)
    b = vllm.rejection_sample(d, n, max(n), cu, q, p, bonus, meta, generator=torch.Generator().manual_seed(9))
    assert torch.equal(a, b)
    L = (a != -1).sum(1)
    pos = torch.arange(a.shape[1])[None, :]
    assert bool(((a == -1) == (pos >= L[:, None])).all())
    assert bool((L >= 1).all()) and bool((L <= torch.tensor(n) + 1).all())
    # zero drafts everywhere: the bonus token alone
    z = vllm.rejection_sample(torch.zeros(0, dtype=torch.int32), [0, 0], 0, torch.zeros(2, dtype=torch.int32), None,
                              torch.zeros(0, 6), torch.tensor([[4], [1]]), torch.tensor([0.0, 1.0]))
    assert z.tolist() == [[4], [1]] and z.dtype == torch.int32
    # a wider max_spec_len pads with -1; all_greedy metadata needs no temperature
    meta = SimpleNamespace(temperature=None, all_greedy=True, all_random=False, generators={})
    w = vllm.rejection_sample(d, n, max(n) + 2, cu, q, p, bonus, meta)
    assert w.shape == (40, max(n) + 3) and bool((w[:, max(n) + 1:] == -1).all())


@pytest.mark.parametrize("with_draft", [False, True])
def test_vllm_sampled_rows_are_exact(with_draft):
    g = _gen(30 + with_draft)
    V, S, B = 5, 2, 50000
    p1 = _dist((S, V), g, sparsity=0.2)
    q1 = _dist((S, V), g, sparsity=0.0)
    n = [S] * B
    p = p1.repeat(B, 1)
    src = q1.repeat(B, 1) if with_draft else p
    d = torch.multinomial(src, 1, generator=g).flatten().to(torch.int32)
    cu = torch.arange(1, B + 1, dtype=torch.int32) * S
    bonus = torch.full((B, 1), 3, dtype=torch.int32)
    out = vllm.rejection_sample(d, n, S, cu, src if with_draft else None, p, bonus, torch.ones(B), generator=g).long()
    dd = d.reshape(B, S).long()
    _chi2_ok(torch.bincount(out[:, 0], minlength=V).double(), p1[0].double(), B)
    a1 = out[:, 0] == dd[:, 0]
    _chi2_ok(torch.bincount(out[a1, 1], minlength=V).double(), p1[1].double(), int(a1.sum()))
    a2 = a1 & (out[:, 1] == dd[:, 1])
    assert bool((out[a2, 2] == 3).all()) and bool((out[~a2, 2] == -1).all())


def test_vllm_errors():
    d = torch.tensor([1, 2, 0], dtype=torch.int32)
    n = [2, 1]
    cu = torch.tensor([2, 3], dtype=torch.int32)
    p = torch.full((3, 4), 0.25)
    bonus = torch.tensor([[1], [2]])
    t = torch.zeros(2)
    f = vllm.rejection_sample
    with pytest.raises(ValueError, match=r"vllm.rejection_sample: cu_num_draft_tokens must be the inclusive cumsum"):
        f(d, n, 2, torch.tensor([1, 3], dtype=torch.int32), None, p, bonus, t)
    with pytest.raises(ValueError, match="num_draft_tokens must be summing to num_tokens = 3"):
        f(d, [2, 2], 2, cu, None, p, bonus, t)
    with pytest.raises(ValueError, match=r"target_probs must be of shape \[3, \*\], got \(4, 4\)"):
        f(d, n, 2, cu, None, torch.full((4, 4), 0.25), bonus, t)
    with pytest.raises(ValueError, match=r"draft_probs must be of shape \[3, 4\]"):
        f(d, n, 2, cu, torch.full((3, 5), 0.2), p, bonus, t)
    with pytest.raises(ValueError, match=r"bonus_token_ids must be 2-D"):
        f(d, n, 2, cu, None, p, bonus.flatten(), t)
    with pytest.raises(TypeError, match="draft_token_ids must be torch.int32 or torch.int64"):
        f(d.float(), n, 2, cu, None, p, bonus, t)
    with pytest.raises(ValueError, match=r"bonus_token_ids must be token ids in \[0, 4\)"):
        f(d, n, 2, cu, None, p, bonus + 5, t)
    with pytest.raises(ValueError, match=r"uniforms must be of shape \[2, 3\]"):
        f(d, n, 2, cu, None, p, bonus, t, uniforms=torch.rand(2, 2, dtype=torch.float64))
    with pytest.raises(ValueError, match=r"temperature must be of shape \[2\]"):
        f(d, n, 2, cu, None, p, bonus, torch.zeros(3))
    with pytest.raises(ValueError, match=r"max_spec_len must be an int >= max\(num_draft_tokens\) = 2"):
        f(d, n, 1, cu, None, p, bonus, t)
    with pytest.raises(TypeError, match="sampling_metadata must be a temperature tensor or an object"):
        f(d, n, 2, cu, None, p, bonus, object())
