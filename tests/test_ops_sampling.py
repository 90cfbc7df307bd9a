"""rejection_sample and greedy_verify against specdec.reference (CPU always, CUDA when present).

Every output of these ops is an integer: the kernels must agree with the reference
EXACTLY (torch.equal) on every input, including the adversarial ones below. Each
adversarial test also asserts the property it is named after directly, so a wrong
reference would be caught too.
"""
from __future__ import annotations

import pytest
import torch

from specdec import ops, reference

from conftest import (DEVICES, FLOAT_DTYPES, TREE_KINDS, assert_same_outputs, assert_sample_structure,
                      children_of, gen, make_trees, maybe)

B7, N13, V111 = 7, 13, 111


# --------------------------------------------------------------------------- inputs
def sampling_case(B, N, V, kind, *, seed, ragged, with_draft, sharp=4.0, sparsity=0.25):
    """A tree batch whose draft tokens are drawn the way a drafter would draw them.

    p (target rows): softmax of random logits, with a random 25 % of entries zeroed (a
    top-k-like support; the argmax kept so no row is empty) and each row scaled by a
    random factor in [0.5, 2) (rows need not be normalised). q (draft rows): a noisy
    copy of the parent's target logits with its own zeros, normalised; node c's token is
    drawn from q_c. Without draft_probs the candidates are drawn from the parent's p
    (deterministic candidates: q is one-hot on them).
    """
    g = gen(seed)
    tokens, parents, _ = make_trees(B, N, V, kind, g=g, ragged=ragged)
    z = torch.randn(B, N, V, generator=g) * sharp
    p = torch.softmax(z, dim=-1)
    keep = (torch.rand(B, N, V, generator=g) >= sparsity) | (z == z.max(-1, keepdim=True).values)
    p = p * keep * (0.5 + 1.5 * torch.rand(B, N, 1, generator=g))
    q = None
    if with_draft:
        zp = torch.gather(z, 1, parents.clamp(min=0).long()[:, :, None].expand(B, N, V))
        q = torch.softmax(zp + 0.7 * torch.randn(B, N, V, generator=g), dim=-1)
        q = q * ((torch.rand(B, N, V, generator=g) >= sparsity) | (q == q.max(-1, keepdim=True).values))
        q = q / q.sum(-1, keepdim=True)
        src = q
    else:
        src = torch.gather(p, 1, parents.clamp(min=0).long()[:, :, None].expand(B, N, V))
    drawn = torch.multinomial(src.reshape(B * N, V), 1, generator=g).reshape(B, N)
    real = parents >= 0
    real[:, 0] = True
    tokens = torch.where(parents >= 0, drawn, tokens)
    tokens[~real] = -1
    u = torch.rand(B, N, generator=g, dtype=torch.float64)
    return tokens, parents, p.contiguous(), q, u


def run_rejection(device, tokens, parents, p, q, u):
    want = reference.rejection_sample(tokens, parents, p, q, u)
    got = ops.rejection_sample(tokens.to(device), parents.to(device), p.to(device), maybe(q, device),
                               u.to(device))
    for t in got:
        assert t.device.type == device
    assert_sample_structure(tokens, parents, *got, V=p.shape[-1])
    assert_same_outputs(got, want)
    return [t.cpu() for t in got]


def greedy_case(B, N, V, kind, dtype, *, seed, ragged, p_follow=0.75):
    """Random logits; each child's token is its parent's argmax with probability p_follow."""
    g = gen(seed)
    tokens, parents, _ = make_trees(B, N, V, kind, g=g, ragged=ragged)
    logits = (torch.randn(B, N, V, generator=g) * 3).to(dtype)
    best = logits.float().argmax(-1)  # [B, N] first max
    follow = torch.rand(B, N, generator=g) < p_follow
    par = parents.clamp(min=0).long()
    tokens = torch.where((parents >= 0) & follow, torch.gather(best, 1, par), tokens)
    return tokens, parents, logits


def run_greedy(device, tokens, parents, logits):
    want = reference.greedy_verify(tokens, parents, logits)
    got = ops.greedy_verify(tokens.to(device), parents.to(device), logits.to(device))
    assert_sample_structure(tokens, parents, *got, V=logits.shape[-1])
    assert_same_outputs(got, want)
    return [t.cpu() for t in got]


def dyadic_rows(n_rows, V, *, g, zero_frac=0.3, denom=64):
    """Probability rows whose entries are multiples of 1/denom summing to exactly 1: every
    float32 / float64 sum and product in the sampler is exact, so boundary cases
    (u = 1, p == q) have one right answer whatever the summation order."""
    rows = torch.zeros(n_rows, V, dtype=torch.float64)
    for r in range(n_rows):
        support = torch.rand(V, generator=g) >= zero_frac
        support[int(torch.randint(0, V, (1,), generator=g))] = True
        idx = support.nonzero().flatten()
        # split denom units among the support, each at least 1
        w = torch.ones(len(idx), dtype=torch.int64)
        extra = torch.multinomial(torch.ones(len(idx)), denom - len(idx), replacement=True, generator=g) \
            if denom > len(idx) else torch.empty(0, dtype=torch.int64)
        w += torch.bincount(extra, minlength=len(idx))
        rows[r, idx] = w.double() / denom
    return rows.float()


def inverse_cdf(row: torch.Tensor, u: float) -> int:
    """Independent statement of the final draw: first index whose float64 running sum
    exceeds u * sum; if none (u ~ 1), the last index with mass; no mass -> -1."""
    r = row.double()
    Z = float(r.sum())
    if not Z > 0:
        return -1
    csum = torch.cumsum(r, 0)
    hit = (csum > u * Z).nonzero()
    return int(hit[0, 0]) if len(hit) else int((r > 0).nonzero()[-1, 0])


# --------------------------------------------------------------------------- rejection_sample
@pytest.mark.parametrize("with_draft", [True, False], ids=["q", "q_none"])
@pytest.mark.parametrize("ragged", [False, True], ids=["full", "ragged"])
@pytest.mark.parametrize("kind", TREE_KINDS)
@pytest.mark.parametrize("device", DEVICES)
def test_rejection_sample_matches_reference(device, kind, ragged, with_draft):
    seed = 100 + 10 * TREE_KINDS.index(kind) + 2 * ragged + with_draft
    case = sampling_case(B7, N13, V111, kind, seed=seed, ragged=ragged, with_draft=with_draft)
    _, num, _ = run_rejection(device, *case)
    if not ragged and kind == "chain":
        # the grid is only worth something if it reaches past the first level
        assert int(num.max()) >= 2


@pytest.mark.parametrize("with_draft", [True, False], ids=["q", "q_none"])
@pytest.mark.parametrize("device", DEVICES)
def test_rejection_sample_large_vocab(device, with_draft):
    """V = 4097: vector / block tails of a realistic vocabulary loop."""
    case = sampling_case(3, 6, 4097, "random", seed=7, ragged=False, with_draft=with_draft, sharp=6.0)
    run_rejection(device, *case)


@pytest.mark.parametrize("with_draft", [True, False], ids=["q", "q_none"])
@pytest.mark.parametrize("device", DEVICES)
def test_rejection_sample_root_only(device, with_draft):
    """N = 1: no draft at all, one token drawn from the root's row."""
    tokens, parents, p, q, u = sampling_case(B7, 1, V111, "chain", seed=8, ragged=False, with_draft=with_draft)
    acc, num, out = run_rejection(device, tokens, parents, p, q, u)
    assert torch.equal(num, torch.zeros(B7, dtype=torch.int32))
    for b in range(B7):
        assert int(out[b, 0]) == inverse_cdf(p[b, 0], float(u[b, 0]))


@pytest.mark.parametrize("device", DEVICES)
def test_rejection_sample_duplicate_sibling_tokens(device):
    """Sampled siblings that drew the same token are separate nodes with their own q."""
    g = gen(9)
    B, V = 64, 7
    tokens = torch.tensor([[0, 3, 3, 3, 1]] * B)
    parents = torch.tensor([[-1, 0, 0, 0, 1]] * B, dtype=torch.int32)
    p = torch.softmax(torch.randn(B, 5, V, generator=g), -1)
    q = torch.softmax(torch.randn(B, 5, V, generator=g) * 2, -1)
    u = torch.rand(B, 5, generator=g, dtype=torch.float64)
    _, num, out = run_rejection(device, tokens, parents, p, q, u)
    assert int((num > 0).sum()) > 0


@pytest.mark.parametrize("with_draft", [True, False], ids=["q", "q_none"])
@pytest.mark.parametrize("device", DEVICES)
def test_p_equals_q_accepts_surely(device, with_draft):
    """p == q (and, deterministic, p one-hot on the candidate): every draft accepted for
    every u in [0, 1), including u = 0 and the largest double below 1."""
    g = gen(10)
    B, N, V = 64, 6, 8
    tokens = torch.zeros(B, N, dtype=torch.int64)
    parents = torch.arange(-1, N - 1, dtype=torch.int32).expand(B, N).contiguous()  # chains
    p = dyadic_rows(B * N, V, g=g).reshape(B, N, V)
    q = torch.zeros_like(p)
    q[:, 1:] = p[:, :-1]  # node c was drawn from its parent's target row
    tokens[:, 1:] = torch.multinomial(q[:, 1:].reshape(-1, V), 1, generator=g).reshape(B, N - 1)
    if not with_draft:
        q = None
        p[:, :-1] = torch.nn.functional.one_hot(tokens[:, 1:], V).float()
    u = torch.rand(B, N, generator=g, dtype=torch.float64)
    u[0] = 0.0
    u[1] = 1.0 - 2.0 ** -53
    acc, num, out = run_rejection(device, tokens, parents, p, q, u)
    assert torch.equal(num, torch.full((B,), N - 1, dtype=torch.int32))
    assert torch.equal(out[:, : N - 1], tokens[:, 1:])


@pytest.mark.parametrize("device", DEVICES)
def test_q_zero_rejects(device):
    """q_c(x) == 0 while p(x) > 0: rejected even with u = 0; the residual keeps x's mass."""
    g = gen(11)
    B, V = 32, 9
    tokens = torch.tensor([[0, 4, 4]] * B)
    parents = torch.tensor([[-1, 0, 0]] * B, dtype=torch.int32)
    p = torch.softmax(torch.randn(B, 3, V, generator=g), -1)  # p > 0 everywhere
    q = torch.softmax(torch.randn(B, 3, V, generator=g), -1)
    q[:, 1, 4] = 0.0
    q[:, 2] = 0.0
    q[:, 2, 4] = 1.0  # second sibling: q one-hot on x = 4, p(4) > 0 -> may be accepted
    u = torch.rand(B, 3, generator=g, dtype=torch.float64)
    u[:, 1] = 0.0
    acc, num, out = run_rejection(device, tokens, parents, p, q, u)
    assert bool((acc[:, 1] != 1).all()), "a child with q(x) == 0 was accepted"


@pytest.mark.parametrize("with_draft", [True, False], ids=["q", "q_none"])
@pytest.mark.parametrize("device", DEVICES)
def test_p_zero_rejects_and_is_never_emitted(device, with_draft):
    """p(x) == 0 while q(x) > 0: rejected for every u (u = 0 included), and the residual
    draw never emits x."""
    g = gen(12)
    B, V, x = 256, 10, 6
    tokens = torch.tensor([[0, x, x]] * B)
    parents = torch.tensor([[-1, 0, 0]] * B, dtype=torch.int32)
    p = torch.softmax(torch.randn(B, 3, V, generator=g), -1)
    p[:, 0, x] = 0.0
    q = torch.softmax(torch.randn(B, 3, V, generator=g), -1) if with_draft else None
    u = torch.rand(B, 3, generator=g, dtype=torch.float64)
    u[: B // 4] = 0.0
    u[B // 4: B // 2, 0] = 1.0
    acc, num, out = run_rejection(device, tokens, parents, p, q, u)
    assert torch.equal(num, torch.zeros(B, dtype=torch.int32))
    assert bool((out[:, 0] != x).all())


@pytest.mark.parametrize("with_draft", [True, False], ids=["q", "q_none"])
@pytest.mark.parametrize("device", DEVICES)
def test_one_hot_p_always_emits_its_token(device, with_draft):
    """p one-hot on y: the first emitted token is y whatever the candidates and u."""
    g = gen(13)
    B, V, y = 128, 7, 5
    tokens = torch.tensor([[0, 2, 5, 1, 5]] * B)
    parents = torch.tensor([[-1, 0, 0, 0, 2]] * B, dtype=torch.int32)
    p = torch.softmax(torch.randn(B, 5, V, generator=g), -1)
    p[:, 0] = 0.0
    p[:, 0, y] = 1.0
    q = torch.softmax(torch.randn(B, 5, V, generator=g), -1) if with_draft else None
    if with_draft:
        q[: B // 4, 2] = torch.nn.functional.one_hot(torch.tensor(y), V).float()  # q(y) = 1
    u = torch.rand(B, 5, generator=g, dtype=torch.float64)
    u[B // 2:, 2] = 1.0
    u[: B // 8, 2] = 1.0  # q(y) = 1 and u = 1: rejected, zero residual, fallback to p -> y
    acc, num, out = run_rejection(device, tokens, parents, p, q, u)
    assert bool((out[:, 0] == y).all())


@pytest.mark.parametrize("device", DEVICES)
def test_zero_residual_falls_back_to_the_node_target_row(device):
    """Deterministic siblings covering p's whole support, all rejected (u = 1): each
    rejection zeroes r[x], the residual has no mass, the documented fallback draws from
    the node's own target row with uniforms[b, 0]. Same with draft rows q == p."""
    g = gen(14)
    B, V = 32, 8
    p_root = dyadic_rows(B, V, g=g, zero_frac=0.0)
    p_root[:, [0, 2, 3, 5, 6]] = 0.0  # support {1, 4, 7}
    p_root = p_root / p_root.sum(-1, keepdim=True)
    tokens = torch.tensor([[0, 7, 1, 4]] * B)
    parents = torch.tensor([[-1, 0, 0, 0]] * B, dtype=torch.int32)
    p = torch.softmax(torch.randn(B, 4, V, generator=g), -1)
    p[:, 0] = p_root
    u = torch.ones(B, 4, dtype=torch.float64)
    u[:, 0] = torch.rand(B, generator=g, dtype=torch.float64)
    acc, num, out = run_rejection(device, tokens, parents, p, None, u)
    assert torch.equal(num, torch.zeros(B, dtype=torch.int32))
    for b in range(B):
        assert int(out[b, 0]) == inverse_cdf(p[b, 0], float(u[b, 0]))
    # with draft rows: one child drawn from q == p (dyadic: exact), u = 1 rejects, residual 0
    p2 = p.clone()
    p2[:, 0] = dyadic_rows(B, V, g=g)
    q2 = torch.zeros_like(p2)
    q2[:, 1] = p2[:, 0]
    tokens2 = tokens.clone()
    tokens2[:, 1] = torch.multinomial(p2[:, 0], 1, generator=g)[:, 0]
    parents2 = torch.tensor([[-1, 0, -1, -1]] * B, dtype=torch.int32)
    tokens2[:, 2:] = -1
    acc, num, out = run_rejection(device, tokens2, parents2, p2, q2, u)
    assert torch.equal(num, torch.zeros(B, dtype=torch.int32))
    for b in range(B):
        assert int(out[b, 0]) == inverse_cdf(p2[b, 0], float(u[b, 0]))


@pytest.mark.parametrize("with_draft", [True, False], ids=["q", "q_none"])
@pytest.mark.parametrize("device", DEVICES)
def test_all_zero_target_row_draws_token_zero(device, with_draft):
    """No mass anywhere: every candidate rejected and the documented rule emits token 0."""
    B, V = 4, 5
    tokens = torch.tensor([[3, 2, 4]] * B)
    parents = torch.tensor([[-1, 0, 0], [-1, 0, 0], [-1, -1, -1], [-1, 0, 1]], dtype=torch.int32)
    p = torch.zeros(B, 3, V)
    q = torch.full((B, 3, V), 1.0 / V) if with_draft else None
    u = torch.tensor([[0.5, 0.0, 0.0], [1.0, 1.0, 1.0], [0.0, 0.3, 0.3], [0.9, 0.1, 0.1]], dtype=torch.float64)
    acc, num, out = run_rejection(device, tokens, parents, p, q, u)
    assert torch.equal(num, torch.zeros(B, dtype=torch.int32))
    assert torch.equal(out[:, 0], torch.zeros(B, dtype=torch.int64))


@pytest.mark.parametrize("device", DEVICES)
def test_u_zero_accepts_iff_p_positive(device):
    """u = 0 everywhere, deterministic candidates: the first child with p(x) > 0 is accepted
    at every level; the final draw returns the first index with mass."""
    g = gen(15)
    B, N, V = 48, 9, 12
    tokens, parents, _ = make_trees(B, N, V, "mixed", g=g, ragged=True)
    p = torch.rand(B, N, V, generator=g) * (torch.rand(B, N, V, generator=g) < 0.5)
    p[:, :, 0] = 0.0
    u = torch.zeros(B, N, dtype=torch.float64)
    acc, num, out = run_rejection(device, tokens, parents, p, None, u)
    for b in range(B):
        node, path = 0, [0]
        while True:
            kids = [c for c in children_of(parents[b].tolist(), node) if p[b, node, tokens[b, c]] > 0]
            if not kids:
                break
            node = kids[0]
            path.append(node)
        assert acc[b, : len(path)].tolist() == path
        nz = (p[b, node] > 0).nonzero()
        assert int(out[b, len(path) - 1]) == (int(nz[0, 0]) if len(nz) else 0)


@pytest.mark.parametrize("with_draft", [True, False], ids=["q", "q_none"])
@pytest.mark.parametrize("device", DEVICES)
def test_u_zero_with_draft_rows(device, with_draft):
    case = list(sampling_case(B7, N13, V111, "mixed", seed=16, ragged=True, with_draft=with_draft))
    case[-1] = torch.zeros(B7, N13, dtype=torch.float64)
    run_rejection(device, *case)


@pytest.mark.parametrize("with_draft", [True, False], ids=["q", "q_none"])
@pytest.mark.parametrize("device", DEVICES)
def test_u_one(device, with_draft):
    """u = 1: the final draw is guarded and returns the LAST index with mass (dyadic rows:
    the running sum reaches u * sum exactly and never exceeds it); a child is accepted
    only where p(x) / q(x) > 1."""
    g = gen(17)
    B, V = 40, 16
    p = dyadic_rows(B, V, g=g)[:, None, :]  # root only
    tokens = torch.zeros(B, 1, dtype=torch.int64)
    parents = torch.full((B, 1), -1, dtype=torch.int32)
    u = torch.ones(B, 1, dtype=torch.float64)
    acc, num, out = run_rejection(device, tokens, parents, p, None, u)
    for b in range(B):
        assert int(out[b, 0]) == int((p[b, 0] > 0).nonzero()[-1, 0])
    case = list(sampling_case(B7, N13, V111, "mixed", seed=18, ragged=True, with_draft=with_draft))
    case[-1] = torch.ones(B7, N13, dtype=torch.float64)
    run_rejection(device, *case)


@pytest.mark.parametrize("with_draft", [True, False], ids=["q", "q_none"])
@pytest.mark.parametrize("device", DEVICES)
def test_unnormalised_rows_power_of_two_scaling(device, with_draft):
    """Rows need not be normalised: scaling target rows by powers of two (exact in binary
    floating point) must not change any output."""
    tokens, parents, p, q, u = sampling_case(B7, N13, V111, "mixed", seed=19, ragged=True,
                                             with_draft=with_draft)
    scale = 2.0 ** torch.randint(-20, 21, (B7, N13, 1), generator=gen(20)).float()
    base = run_rejection(device, tokens, parents, p, q, u)
    scaled = run_rejection(device, tokens, parents, p * scale, q, u)
    assert_same_outputs(scaled, base)


@pytest.mark.parametrize("device", DEVICES)
def test_unused_rows_are_never_read(device):
    """draft row 0 is unused and padding nodes are ignored: NaN there changes nothing
    (strict checks off, their default)."""
    tokens, parents, p, q, u = sampling_case(B7, N13, V111, "mixed", seed=21, ragged=True, with_draft=True)
    base = run_rejection(device, tokens, parents, p, q, u)
    pad = (parents < 0)
    pad[:, 0] = False
    p2, q2 = p.clone(), q.clone()
    q2[:, 0] = float("nan")
    p2[pad] = float("nan")
    q2[pad] = float("nan")
    got = ops.rejection_sample(tokens.to(device), parents.to(device), p2.to(device), q2.to(device), u.to(device))
    assert_same_outputs(got, base)


@pytest.mark.parametrize("with_draft", [True, False], ids=["q", "q_none"])
@pytest.mark.parametrize("device", DEVICES)
def test_rejection_sample_inputs_unchanged(device, with_draft):
    case = sampling_case(B7, N13, V111, "random", seed=22, ragged=True, with_draft=with_draft)
    dev = [maybe(t, device) for t in case]
    before = [None if t is None else t.clone() for t in dev]
    ops.rejection_sample(*dev)
    for a, b in zip(dev, before):
        assert (a is None and b is None) or torch.equal(a, b)


# --------------------------------------------------------------------------- greedy_verify
@pytest.mark.parametrize("ragged", [False, True], ids=["full", "ragged"])
@pytest.mark.parametrize("kind", TREE_KINDS)
@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
@pytest.mark.parametrize("device", DEVICES)
def test_greedy_verify_matches_reference(device, dtype, kind, ragged):
    seed = 300 + 10 * TREE_KINDS.index(kind) + ragged
    tokens, parents, logits = greedy_case(B7, N13, V111, kind, dtype, seed=seed, ragged=ragged)
    _, num, _ = run_greedy(device, tokens, parents, logits)
    if not ragged and kind == "chain":
        assert int(num.max()) >= 2


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
@pytest.mark.parametrize("device", DEVICES)
def test_greedy_verify_large_vocab(device, dtype):
    run_greedy(device, *greedy_case(3, 6, 4097, "random", dtype, seed=31, ragged=False))


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
@pytest.mark.parametrize("device", DEVICES)
def test_greedy_verify_ties_first_max_wins(device, dtype):
    """Logits with many exact ties (small integers): only the FIRST maximal index counts;
    a child holding a later maximal index is rejected even when it comes first."""
    g = gen(32)
    B, N, V = 7, 13, 111
    tokens, parents, _ = make_trees(B, N, V, "mixed", g=g, ragged=True)
    logits = torch.randint(0, 3, (B, N, V), generator=g).to(dtype)
    for b in range(B):
        for node in range(N):
            kids = children_of(parents[b].tolist(), node)
            maxima = (logits[b, node] == logits[b, node].max()).nonzero().flatten().tolist()
            later = maxima[1:] or maxima
            for j, c in enumerate(kids):
                if j < len(kids) - 1:  # earlier siblings hold later maxima: must be rejected
                    tokens[b, c] = later[j % len(later)]
                else:  # the last sibling mostly holds the first maximum
                    tokens[b, c] = maxima[0] if (b + node) % 3 else later[0]
    acc, num, out = run_greedy(device, tokens, parents, logits)
    for b in range(B):
        for i in range(int(num[b]) + 1):
            node = int(acc[b, i])
            assert int(out[b, i]) == int(logits[b, node].float().argmax())
    assert int(num.max()) >= 1


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
@pytest.mark.parametrize("device", DEVICES)
def test_greedy_verify_nan_and_inf(device, dtype):
    """NaN counts as maximal (the first NaN wins, like torch.argmax); +inf beats finite
    values, ties between infs go to the first; -inf rows are handled."""
    g = gen(33)
    B, N, V = 7, 13, 111
    tokens, parents, logits = greedy_case(B, N, V, "mixed", dtype, seed=33, ragged=True)
    logits = logits.float()
    r = torch.rand(B, N, generator=g)
    for b in range(B):
        for n in range(N):
            pos = torch.randperm(V, generator=g)[:3]
            if r[b, n] < 0.3:
                logits[b, n, pos[:2]] = float("nan")
            elif r[b, n] < 0.5:
                logits[b, n, pos] = float("inf")
            elif r[b, n] < 0.6:
                logits[b, n] = float("-inf")
            elif r[b, n] < 0.7:
                logits[b, n, pos[0]] = float("nan")
                logits[b, n, pos[1:]] = float("inf")
    logits = logits.to(dtype)
    best = torch.tensor([[reference._argmax_first(logits[b, n]) for n in range(N)] for b in range(B)])
    for b in range(B):  # make the children follow the (NaN-aware) argmax most of the time
        for c in range(1, N):
            if parents[b, c] >= 0 and r[b, c] < 0.8:
                tokens[b, c] = best[b, parents[b, c]]
    acc, num, out = run_greedy(device, tokens, parents, logits)
    for b in range(B):
        assert int(out[b, int(num[b])]) == int(torch.argmax(logits[b, int(acc[b, int(num[b])])].float()))
    assert int(num.max()) >= 2


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
@pytest.mark.parametrize("device", DEVICES)
def test_greedy_verify_root_only_and_tiny_vocab(device, dtype):
    g = gen(34)
    run_greedy(device, torch.zeros(5, 1, dtype=torch.int64), torch.full((5, 1), -1, dtype=torch.int32),
               torch.randn(5, 1, 9, generator=g).to(dtype))
    tokens = torch.zeros(3, 4, dtype=torch.int64)  # V = 1: every token is 0, every child accepted
    parents = torch.tensor([[-1, 0, 1, 2], [-1, 0, 0, 2], [-1, -1, -1, -1]], dtype=torch.int32)
    _, num, _ = run_greedy(device, tokens, parents, torch.randn(3, 4, 1, generator=g).to(dtype))
    assert num.tolist() == [3, 1, 0]  # row 1: node 1 (first child) wins, it is a leaf


@pytest.mark.parametrize("device", DEVICES)
def test_greedy_verify_inputs_unchanged(device):
    tokens, parents, logits = greedy_case(B7, N13, V111, "random", torch.float16, seed=35, ragged=True)
    dev = [t.to(device) for t in (tokens, parents, logits)]
    before = [t.clone() for t in dev]
    ops.greedy_verify(*dev)
    for a, b in zip(dev, before):
        assert torch.equal(a, b)


# --------------------------------------------------------------------------- by construction
ONE_MINUS = 1.0 - 2.0 ** -53  # the largest double below 1


@pytest.mark.parametrize("u", [1.0, ONE_MINUS], ids=["u1", "u_below_1"])
@pytest.mark.parametrize("with_draft", [True, False], ids=["q", "q_none"])
@pytest.mark.parametrize("device", DEVICES)
def test_peaked_rows_at_u_one(device, u, with_draft):
    """Once the three implementations summed a row in three orders and, with u * Z in the
    last ulps of a tail too small to move a float sum, stopped the inverse-CDF walk at
    different tokens (3 of 40 rows at u = 1, softmax(25 randn), V = 3000). With integer
    masses they agree on every row, and u = 1 takes the last token with positive mass."""
    g = gen(40)
    B, V = 40, 3000
    p = torch.softmax(25 * torch.randn(B, 1, V, generator=g), -1)
    tokens = torch.zeros(B, 1, dtype=torch.int64)
    parents = torch.full((B, 1), -1, dtype=torch.int32)
    uu = torch.full((B, 1), u, dtype=torch.float64)
    q = torch.softmax(torch.randn(B, 1, V, generator=g), -1) if with_draft else None
    acc, num, out = run_rejection(device, tokens, parents, p, q, uu)
    if u == 1.0:
        for b in range(B):
            last = int((reference.quantize_row(p[b, 0]) > 0).nonzero()[-1, 0])
            assert int(out[b, 0]) == last
    # the same with a rejected chain child in front (a residual row, not the target row)
    tokens2 = torch.zeros(B, 2, dtype=torch.int64)
    tokens2[:, 1] = p[:, 0].argmin(-1)
    parents2 = torch.tensor([[-1, 0]] * B, dtype=torch.int32)
    p2 = torch.cat([p, torch.softmax(torch.randn(B, 1, V, generator=g), -1)], 1)
    q2 = None if q is None else torch.cat([q, q], 1)
    run_rejection(device, tokens2, parents2, p2, q2, torch.full((B, 2), u, dtype=torch.float64))


@pytest.mark.parametrize("device", DEVICES)
def test_threshold_on_prefix_boundaries(device):
    """u chosen so that floor(u * Z) lands exactly on, one below and one above a prefix sum
    of the masses: the draw is the first index whose prefix EXCEEDS the threshold, and
    every backend agrees (integer prefix sums: no order can move the boundary)."""
    g = gen(41)
    V = 257
    rows, us = [], []
    for r in range(12):
        p = torch.softmax(3 * torch.randn(V, generator=g), -1) * (torch.rand(V, generator=g) < 0.6)
        p[int(torch.randint(0, V, (1,), generator=g))] = 0.3
        m = reference.quantize_row(p)
        csum = torch.cumsum(m, 0)
        Z = int(m.sum())
        for j in torch.randint(0, V, (4,), generator=g).tolist():
            for delta in (-1, 0, 1):
                rows.append(p)
                us.append(min(max((int(csum[j]) + delta) / Z, 0.0), 1.0))
    B = len(rows)
    p = torch.stack(rows)[:, None, :].contiguous()
    u = torch.tensor(us, dtype=torch.float64)[:, None]
    acc, num, out = run_rejection(device, torch.zeros(B, 1, dtype=torch.int64),
                                  torch.full((B, 1), -1, dtype=torch.int32), p, None, u)
    for b in range(B):  # an independent statement with Python integers
        m = reference.quantize_row(p[b, 0]).tolist()
        Z = sum(m)
        thr = min(max(int(us[b] * float(Z)), 0), Z - 1)
        run = 0
        for i, mi in enumerate(m):
            run += mi
            if run > thr:
                break
        assert int(out[b, 0]) == i and m[i] > 0


def test_quantize_row_rules():
    """The fixed-point view of a row: NaN / inf / zero / negative carry no mass, the largest
    entry has 2**41 <= m < 2**42 units, power-of-two scaling changes nothing."""
    row = torch.tensor([0.25, float("nan"), float("inf"), -1.0, 0.0, 0.125, 1e-30, 0.75])
    m = reference.quantize_row(row)
    assert m.tolist()[1:5] == [0, 0, 0, 0]
    assert 2 ** 41 <= int(m.max()) < 2 ** 42 and int(m[7]) == int(m.max())
    assert int(m[0]) == 2 ** 40 and int(m[5]) == 2 ** 39 and int(m[6]) == 0  # max 0.75: e = 0
    assert torch.equal(reference.quantize_row(row * 2.0 ** 30), m)
    assert not bool(reference.quantize_row(torch.zeros(5)).any())


@pytest.mark.parametrize("with_draft", [True, False], ids=["q", "q_none"])
@pytest.mark.parametrize("device", DEVICES)
def test_review_many_rejected_siblings_offset_slice(device, with_draft):
    """Three and more rejected siblings at one node (the level-2 scratch residual of the CUDA
    kernel) with V = 49153 (odd: scalar tails) and target_probs an offset slice of a larger
    buffer (misaligned rows), against the reference."""
    g = gen(60)
    B, N, V = 6, 7, 49153
    p = torch.softmax(2 * torch.randn(B, N, V, generator=g), -1)
    parents = torch.tensor([[-1, 0, 0, 0, 0, 0, 1]] * B, dtype=torch.int32)
    low = p[:, 0].topk(5, largest=False).indices  # tokens the target finds unlikely
    tokens = torch.zeros(B, N, dtype=torch.int64)
    tokens[:, 1:6] = low
    tokens[:, 6] = 3
    tokens[B // 2:, 5] = p[B // 2:, 0].argmax(-1)  # half the requests accept the last sibling
    q = None
    if with_draft:
        q = torch.softmax(torch.randn(B, N, V, generator=g), -1)
        for c in range(1, 6):  # each sibling's q puts most of its mass on its own token
            q[torch.arange(B), c, tokens[:, c]] += 5.0
        q = q / q.sum(-1, keepdim=True)
    u = torch.full((B, N), 0.999, dtype=torch.float64)
    u[:, 0] = torch.rand(B, generator=g, dtype=torch.float64)
    u[B // 2:, 5] = 0.0
    buf = torch.empty(p.numel() + 1)
    p_off = buf[1:].view(p.shape)
    p_off.copy_(p)
    acc, num, out = run_rejection(device, tokens, parents, p_off, q, u)
    assert bool((num[: B // 2] == 0).all())  # four+ rejections, a draw from the residual


@pytest.mark.parametrize("device", DEVICES)
def test_greedy_offset_slice_odd_vocab(device):
    tokens, parents, logits = greedy_case(5, 9, 49153, "mixed", torch.bfloat16, seed=62, ragged=True)
    buf = torch.empty(logits.numel() + 1, dtype=logits.dtype)
    off = buf[1:].view(logits.shape)
    off.copy_(logits)
    run_greedy(device, tokens, parents, off)


@pytest.mark.parametrize("device", DEVICES)
def test_greedy_verify_argmax_of_edge_rows(device):
    """The argmax at a root (float32 rows: the CPU's vectorized form where it has AVX2) on rows built to
    catch a two-pass search: the maximum or a NaN in the tail past the last full vector, ties (the
    first wins, +0 and -0 equal), NaN after the maximum, all -inf, +inf, one element; every width from
    1 to 70 and a vocabulary-sized one."""
    g = gen(71)
    for V in list(range(1, 71)) + [4099]:
        B = 24
        rows = torch.randn(B, V, generator=g)
        for b in range(B):
            kind, j = b % 8, int(torch.randint(0, V, (1,), generator=g))
            if kind == 1:
                rows[b, V - 1] = 100.0                      # the maximum last (in the scalar tail)
            elif kind == 2:
                rows[b] = torch.randint(0, 2, (V,), generator=g).float()  # ties: the first 1 wins
            elif kind == 3:
                rows[b, j] = float("nan")                   # NaN anywhere, also after the maximum
                rows[b, 0] = 50.0
            elif kind == 4:
                rows[b] = float("-inf")
            elif kind == 5:
                rows[b] = 0.0
                rows[b, : j + 1] = -0.0                     # -0 first: equal to +0, index 0 wins
            elif kind == 6:
                rows[b, j:] = float("inf")
            elif kind == 7:
                rows[b, V - 1] = float("nan")
        tokens = torch.zeros(B, 1, dtype=torch.int64)
        parents = torch.full((B, 1), -1, dtype=torch.int32)
        _, _, out = ops.greedy_verify(tokens.to(device), parents.to(device), rows.view(B, 1, V).to(device))
        want = [reference._argmax_first(rows[b]) for b in range(B)]
        assert out[:, 0].cpu().tolist() == want, V
        assert want == torch.argmax(rows, dim=1).tolist()


@pytest.mark.parametrize("kind", TREE_KINDS)
@pytest.mark.parametrize("device", DEVICES)
def test_greedy_verify_on_argmax_equals_on_logits(device, kind):
    """int64 target_logits [B, N] (the argmax at each node, e.g. from ops.qlinear_argmax): the same integers as
    the logits they come from, NaN rows included, and the reference's."""
    for seed in range(6):
        tokens, parents, logits = greedy_case(B7, N13, V111, kind, torch.float32, seed=700 + seed, ragged=seed % 2 == 1)
        if seed % 3 == 2:
            logits[0, 1, 5] = float("nan")
        predicts = torch.argmax(logits, dim=-1)
        want = ops.greedy_verify(tokens.to(device), parents.to(device), logits.to(device))
        got = ops.greedy_verify(tokens.to(device), parents.to(device), predicts.to(device))
        assert_same_outputs(got, want)
        assert_same_outputs([t.cpu() for t in got], reference.greedy_verify(tokens, parents, predicts))


def test_greedy_verify_on_argmax_errors():
    tokens = torch.tensor([[3, 4, 5]])
    parents = torch.tensor([[-1, 0, 0]], dtype=torch.int32)
    with pytest.raises(RuntimeError, match=r"^greedy_verify: int64 target_logits \(the argmax at each node\) must "
                                           r"be \[B, N\]"):
        ops.greedy_verify(tokens, parents, torch.zeros(1, 2, dtype=torch.int64))
    with pytest.raises(RuntimeError, match=r"^greedy_verify: target_logits must be float32, float16 or bfloat16 "
                                           r"\(or int64"):
        ops.greedy_verify(tokens, parents, torch.zeros(1, 3, 7, dtype=torch.int32))
