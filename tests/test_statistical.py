"""rejection_sample preserves the target distribution (chain and trees), statistically.

Setting (V = 6). The target generates two tokens: x1 ~ P1, then x2 ~ P2[x1] (a known
table); the joint is P(x1, x2) = P1[x1] * P2[x1, x2]. Drafters propose depth-1 nodes
from Q1 and depth-2 nodes from Q2[token of the parent]; target_probs of every tree
node is the target's true next-token distribution after that node's path (root: P1,
depth-1 node with token y: P2[y], depth-2 node: P3 — it only feeds out_tokens[2]).

"The first two output tokens" are the tokens at depth 1 and 2 of the generated
sequence. When a call emits one token only (num_accepted == 0), the second is produced
the way the decoder's next step would: a second call with the emitted token as the
root and no draft (a leaf draw from P2[x1] with a fresh uniform).

Each configuration draws n = 200,000 independent requests in ONE batched call, counts
the 36 cells of (x1, x2) and applies, with thresholds fixed up front:
* cells with target probability 0 must stay empty (exact);
* Pearson chi-square over the other cells, p-value >= ALPHA = 1e-4 (expected counts
  are >= 2,500 per cell, so the chi-square approximation is sound);
* total variation TV <= 0.5 * sqrt(K / n) + sqrt(ln(1 / ALPHA) / (2 n)): the first term
  bounds E[TV] (Cauchy-Schwarz over the K non-empty cells), the second is McDiarmid's
  deviation at confidence 1 - ALPHA (TV changes by at most 1/n per sample). For n = 200k,
  K <= 36 that is 0.0115.
Seeds are fixed, so the test is deterministic; the family of 6 configurations x 2
criteria has a false-alarm probability below 1.2e-3 under a correct sampler.

Power: the same statistics must REJECT a deliberately wrong sampler (a vectorized
Python mock of the algorithm with one bug: accept every draft; do not subtract the
rejected draft's q from the residual; or (trees) keep the residual's stale mass for the
next sibling's test), which also shows the tables make those bugs visible. The same mock without the bug
passes and matches specdec.reference exactly.
Structural invariants are checked on all 200k rows, and the kernel's rows match the
reference exactly on a subset.
"""
from __future__ import annotations

import math
from typing import Dict, Tuple

import pytest
import torch

from specdec import ops, reference

from conftest import DEVICES, assert_same_outputs, assert_sample_structure, gen

V = 6
N_DRAWS = 200_000
N_POWER = 50_000  # draws for the power check (see test_statistic_has_power)
ALPHA = 1e-4

P1 = torch.tensor([0.30, 0.25, 0.20, 0.15, 0.10, 0.00])  # token 5 impossible at depth 1
P2 = torch.tensor([
    [0.50, 0.20, 0.10, 0.10, 0.10, 0.00],
    [0.05, 0.05, 0.60, 0.00, 0.20, 0.10],
    [0.25, 0.25, 0.25, 0.25, 0.00, 0.00],
    [0.00, 0.10, 0.10, 0.10, 0.10, 0.60],
    [0.15, 0.15, 0.15, 0.15, 0.15, 0.25],
    [1 / 6] * 6,  # unreachable under the target (P1[5] = 0)
])
P3 = torch.full((V,), 1.0 / V)
# drafter A: q(3) = 0 where p(3) > 0 and q(5) > 0 where p(5) = 0; Q2A[2] == P2[2] (p == q)
Q1A = torch.tensor([0.05, 0.10, 0.40, 0.00, 0.15, 0.30])
Q2A = torch.tensor([
    [0.10, 0.10, 0.40, 0.20, 0.00, 0.20],
    [0.30, 0.00, 0.30, 0.30, 0.10, 0.00],
    [0.25, 0.25, 0.25, 0.25, 0.00, 0.00],
    [0.50, 0.00, 0.00, 0.00, 0.50, 0.00],
    [0.00, 0.00, 0.00, 0.00, 0.00, 1.00],
    [0.20, 0.20, 0.20, 0.20, 0.20, 0.00],
])
# drafter B: a different model (different q rows for siblings)
Q1B = torch.tensor([0.40, 0.00, 0.10, 0.30, 0.20, 0.00])
Q2B = torch.tensor([
    [0.60, 0.20, 0.20, 0.00, 0.00, 0.00],
    [0.00, 0.00, 1.00, 0.00, 0.00, 0.00],
    [0.10, 0.10, 0.10, 0.10, 0.30, 0.30],
    [0.00, 0.20, 0.20, 0.20, 0.20, 0.20],
    [0.20, 0.20, 0.20, 0.20, 0.20, 0.00],
    [0.30, 0.30, 0.40, 0.00, 0.00, 0.00],
])
DRAFTERS = {"a": (Q1A, Q2A), "b": (Q1B, Q2B)}
# deterministic depth-2 candidates after token y (duplicates of the parent token included)
DET2 = torch.tensor([[0, 1], [2, 4], [3, 2], [5, 1], [4, 0], [0, 1]])

# Tree layouts: one entry per node after the root, (parent, source). source "a" / "b":
# drawn from that drafter; ("det", t): deterministic candidate t at depth 1, ("det", k):
# the k-th DET2 candidate after the parent's token at depth 2.
LAYOUTS = {
    "chain": [(0, "a"), (1, "a")],
    "tree_sampled": [(0, "a"), (0, "a"), (1, "a"), (1, "a"), (2, "a"), (2, "a")],
    "tree_two_drafters": [(0, "a"), (1, "a"), (0, "b"), (3, "b"), (3, "b")],  # DFS order
    "tree_deterministic": [(0, ("det", 2)), (0, ("det", 2)), (0, ("det", 0)),
                           (1, ("det", 0)), (1, ("det", 1)), (2, ("det", 0)), (3, ("det", 1))],
    "tree_deterministic_cover": [(0, ("det", t)) for t in (4, 3, 2, 1, 0)] + [(i, ("det", 0)) for i in range(1, 6)],
    "ragged": [(0, "a"), (0, "a"), (0, "a"), (1, "a"), (1, "a"), (2, "a"), (2, "a"), (3, "a"), (3, "a")],
}


def joint_target() -> torch.Tensor:
    return (P1[:, None].double() * P2.double()).reshape(-1)  # [V * V]


def _draw_rows(probs: torch.Tensor, g: torch.Generator) -> torch.Tensor:
    return torch.multinomial(probs, 1, replacement=True, generator=g)[:, 0]


def build_batch(layout: str, n: int, g: torch.Generator):
    """tokens [n, N], parents [n, N], target_probs [n, N, V], draft_probs or None, uniforms."""
    nodes = LAYOUTS[layout]
    N = 1 + len(nodes)
    deterministic = any(isinstance(s, tuple) for _, s in nodes)
    tokens = torch.zeros(n, N, dtype=torch.int64)
    tokens[:, 0] = torch.randint(0, V, (n,), generator=g)  # the root's token is irrelevant
    parents = torch.full((n, N), -1, dtype=torch.int32)
    p = torch.zeros(n, N, V)
    q = None if deterministic else torch.zeros(n, N, V)
    p[:, 0] = P1
    depth = [0] * N
    for i, (par, src) in enumerate(nodes, start=1):
        parents[:, i] = par
        depth[i] = depth[par] + 1
        if isinstance(src, tuple):
            tok = (torch.full((n,), src[1], dtype=torch.int64) if depth[i] == 1
                   else DET2[tokens[:, par], src[1]])
        else:
            q1, q2 = DRAFTERS[src]
            row = q1.expand(n, V) if depth[i] == 1 else q2[tokens[:, par]]
            tok = _draw_rows(row, g)
            q[:, i] = row
        tokens[:, i] = tok
        p[:, i] = P2[tok] if depth[i] == 1 else P3
    if layout == "ragged":  # keep k1 in 0..3 depth-1 children, each with k2 in 0..2 children
        keep = torch.ones(n, N, dtype=torch.bool)
        k1 = torch.randint(0, 4, (n,), generator=g)
        for i, (par, _) in enumerate(nodes, start=1):
            if depth[i] == 1:
                keep[:, i] = (i - 1) < k1
        k2 = torch.randint(0, 3, (n, N), generator=g)
        for i, (par, _) in enumerate(nodes, start=1):
            if depth[i] == 2:
                rank = sum(1 for j, (pj, _) in enumerate(nodes[: i - 1], start=1) if pj == par)
                keep[:, i] = keep[:, par] & (rank < k2[:, par])
        tokens, parents, p, q = _compact(tokens, parents, p, q, keep)
    u = torch.rand(n, N, generator=g, dtype=torch.float64)
    return tokens, parents, p.contiguous(), None if q is None else q.contiguous(), u


def _compact(tokens, parents, p, q, keep):
    """Move each request's kept nodes to the front (order kept), padding after them."""
    n, N = tokens.shape
    perm = torch.argsort((~keep).to(torch.int8), dim=1, stable=True)  # new slot -> old node
    inv = torch.argsort(perm, dim=1)  # old node -> new slot
    tokens = torch.gather(tokens, 1, perm)
    old_par = torch.gather(parents.long(), 1, perm)
    parents = torch.where(old_par >= 0, torch.gather(inv, 1, old_par.clamp(min=0)), -1).to(torch.int32)
    kept = torch.gather(keep, 1, perm)
    parents[~kept] = -1
    tokens[~kept] = -1
    idx = perm[:, :, None].expand(n, N, V)
    p = torch.gather(p, 1, idx)
    q = None if q is None else torch.gather(q, 1, idx)
    return tokens, parents, p, q


# --------------------------------------------------------------------------- samplers
def mock_rejection_sample(tokens, parents, p, q, u, bug: str = ""):
    """Vectorized statement of the algorithm (any B), optionally with one bug:
    bug="accept_always": every first child is accepted; bug="no_residual": a rejected
    draft's q is not subtracted (the next test / the final draw still uses p);
    bug="stale_mass": after a rejection the residual's mass Z is not recomputed."""
    B, N = tokens.shape
    accepted = torch.full((B, N), -1, dtype=torch.int32)
    accepted[:, 0] = 0
    out = torch.full((B, N), -1, dtype=torch.int64)
    rows = torch.arange(B)  # requests still walking down their tree
    node = torch.zeros(B, dtype=torch.int64)
    for depth in range(1, N + 1):
        if rows.numel() == 0:
            break
        M = rows.numel()
        par = parents[rows].long()
        tok = tokens[rows].clamp(min=0)
        uu = u[rows]
        p_node = p[rows, node].double()  # [M, V]
        r = p_node.clone()
        Z = r.sum(1)
        chosen = torch.full((M,), -1, dtype=torch.int64)
        searching = torch.ones(M, dtype=torch.bool)
        for c in range(1, N):
            is_child = searching & (par[:, c] == node)
            if not bool(is_child.any()):
                continue
            x = tok[:, c:c + 1]  # [M, 1]
            qc = None if q is None else q[rows, c].double()  # [M, V]
            qx = torch.ones(M, dtype=torch.float64) if qc is None else torch.gather(qc, 1, x)[:, 0]
            if bug == "accept_always":
                ok = is_child
            else:
                ok = is_child & (qx > 0) & (uu[:, c] * qx * Z < torch.gather(r, 1, x)[:, 0])
            chosen = torch.where(ok, c, chosen)
            searching &= ~ok
            rej = (is_child & ~ok)[:, None]
            if bug != "no_residual":
                if qc is None:
                    r = torch.where(rej, r.scatter(1, x, 0.0), r)
                else:
                    r = torch.where(rej, torch.clamp(r - Z[:, None] * qc, min=0.0), r)
                if bug != "stale_mass":
                    Z = torch.where(rej[:, 0], r.sum(1), Z)
        took = chosen >= 0
        stop = ~took
        if bool(stop.any()):
            out[rows[stop], depth - 1] = _mock_draw(r[stop], p_node[stop], uu[stop, 0])
        rows, node, chosen = rows[took], chosen[took], chosen[took]
        if rows.numel():
            accepted[rows, depth] = chosen.to(torch.int32)
            out[rows, depth - 1] = tokens[rows, chosen]
    num = ((accepted >= 0).sum(1) - 1).to(torch.int32)
    return accepted, num, out


def _inverse_cdf(r: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Rows of r [M, V] float64: first index with cumsum > u * sum, else the last index
    with mass; -1 where the row has no mass."""
    Z = r.sum(1)
    idx = (torch.cumsum(r, 1) <= (u * Z)[:, None]).sum(1)
    last_nz = r.shape[1] - 1 - torch.argmax(torch.flip(r > 0, [1]).to(torch.int8), dim=1)
    tok = torch.where(idx < r.shape[1], idx, last_nz)
    return torch.where(Z > 0, tok, -1)


def _mock_draw(r, p_node, u):
    tok = _inverse_cdf(r, u)
    tok = torch.where(tok >= 0, tok, _inverse_cdf(p_node, u))
    return torch.where(tok >= 0, tok, 0)


def kernel_sampler(device: str):
    def run(tokens, parents, p, q, u):
        outs = ops.rejection_sample(tokens.to(device), parents.to(device), p.to(device),
                                    None if q is None else q.to(device), u.to(device))
        return tuple(t.cpu() for t in outs)
    return run


def first_two_tokens(sampler, tokens, parents, p, q, u, g) -> Tuple[torch.Tensor, Tuple]:
    """(x1, x2) of every request: x2 from the same call when a draft was accepted, else
    from the next step's leaf draw from P2[x1] with a fresh uniform."""
    outs = sampler(tokens, parents, p, q, u)
    accepted, num, out = outs
    x1 = out[:, 0].clone()
    x2 = out[:, 1].clone()
    one = num == 0
    m = int(one.sum())
    if m:
        nxt = sampler(x1[one][:, None], torch.full((m, 1), -1, dtype=torch.int32),
                      P2[x1[one]][:, None, :].contiguous(), None,
                      torch.rand(m, 1, generator=g, dtype=torch.float64))
        x2[one] = nxt[2][:, 0]
    return torch.stack([x1, x2], 1), outs


def goodness_of_fit(pairs: torch.Tensor) -> Dict[str, float]:
    n = pairs.shape[0]
    counts = torch.bincount(pairs[:, 0] * V + pairs[:, 1], minlength=V * V).double()
    probs = joint_target()
    support = probs > 0
    expected = probs[support] * n
    chi2 = float(((counts[support] - expected) ** 2 / expected).sum())
    df = int(support.sum()) - 1
    p_value = float(torch.special.gammaincc(torch.tensor(df / 2.0, dtype=torch.float64),
                                            torch.tensor(chi2 / 2.0, dtype=torch.float64)))
    tv = 0.5 * float((counts / n - probs).abs().sum())
    bound = 0.5 * math.sqrt(int(support.sum()) / n) + math.sqrt(math.log(1 / ALPHA) / (2 * n))
    return dict(off_support=float(counts[~support].sum()), chi2=chi2, df=df, p_value=p_value, tv=tv,
                tv_bound=bound)


def _passes(stats) -> bool:
    return stats["off_support"] == 0 and stats["p_value"] >= ALPHA and stats["tv"] <= stats["tv_bound"]


def _check_structure_vectorized(tokens, parents, outs):
    assert_sample_structure(tokens, parents, *outs, V=V)


# --------------------------------------------------------------------------- tests
@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("device", DEVICES)
def test_rejection_sample_preserves_target_distribution(device, layout):
    g = gen(2024 + list(LAYOUTS).index(layout))
    batch = build_batch(layout, N_DRAWS, g)
    pairs, outs = first_two_tokens(kernel_sampler(device), *batch, g)
    tokens, parents, p, q, u = batch
    _check_structure_vectorized(tokens, parents, outs)
    # the kernel's rows are the reference's rows, exactly (a subset: the reference is slow)
    sub = slice(0, 256)
    want = reference.rejection_sample(tokens[sub], parents[sub], p[sub], None if q is None else q[sub], u[sub])
    assert_same_outputs([o[sub] for o in outs], want)
    stats = goodness_of_fit(pairs)
    assert stats["off_support"] == 0, f"emitted (x1, x2) pairs the target gives probability 0: {stats}"
    assert stats["p_value"] >= ALPHA, f"chi-square rejects the target distribution: {stats}"
    assert stats["tv"] <= stats["tv_bound"], f"total variation too large: {stats}"
    assert float((outs[1] >= 1).double().mean()) > 0.2, "too few acceptances to test anything"


@pytest.mark.parametrize("layout", ["chain", "tree_sampled", "tree_two_drafters", "tree_deterministic"])
def test_statistic_has_power(layout):
    """The same statistic on the same kind of inputs: the correct mock passes, each buggy
    one fails. Run at N_POWER = n / 4 draws to keep the suite fast: the bound shrinks like
    1 / sqrt(n) while a bug's distance from the target does not, so a bug flagged at n / 4
    is flagged at n. (stale_mass is harmless in a chain: no sibling follows a rejection.)"""
    g = gen(77 + list(LAYOUTS).index(layout))
    batch = build_batch(layout, N_POWER, g)
    bugs = ("accept_always", "no_residual") + (("stale_mass",) if layout != "chain" else ())
    results = {}
    for bug in ("",) + bugs:
        sampler = lambda *a, bug=bug: mock_rejection_sample(*a, bug=bug)  # noqa: E731
        pairs, _ = first_two_tokens(sampler, *batch, gen(5))
        results[bug or "exact"] = goodness_of_fit(pairs)
    assert _passes(results["exact"]), results["exact"]
    for bug in bugs:
        stats = results[bug]
        assert stats["p_value"] < ALPHA and stats["tv"] > stats["tv_bound"], f"{bug} not detected: {stats}"


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_mock_matches_reference(layout):
    """The power test's mock is the algorithm: equal to specdec.reference on every row."""
    batch = build_batch(layout, 300, gen(99))
    got = mock_rejection_sample(*batch)
    assert_same_outputs(got, reference.rejection_sample(*batch))


def test_layouts_are_valid_trees():
    for layout in LAYOUTS:
        tokens, parents, p, q, u = build_batch(layout, 1000, gen(1))
        N = tokens.shape[1]
        idx = torch.arange(N)
        assert bool((parents[:, 0] == -1).all())
        assert bool(((parents < idx) & (parents >= -1)).all())
        pad = parents[:, 1:] < 0
        assert bool((tokens[:, 1:][pad] == -1).all())
        # padding only after a request's own nodes
        assert torch.equal(pad, torch.cumsum(pad.to(torch.int64), 1) > 0)
