"""specdec.compat.sglang against an independent implementation of SGLang's documented semantics.

The references below follow sgl-kernel's description of verify_tree_greedy and
tree_speculative_sampling_target_only (first-child / next-sibling walk, in-place outputs,
-1 padding, accept_token_num excluding the bonus), written here in plain Python.
"""
from __future__ import annotations

import os
import random
import re

import numpy as np
import pytest
import torch

from specdec import ops
from specdec.compat import sglang as sg
from specdec.compat import sglang_host, sglang_tree

NUM_GREEDY = int(os.environ.get("SPECDEC_SGLANG_CASES", "2000"))


# --------------------------------------------------------------------------- random SGLang trees
def random_tree(rng: random.Random, N: int, kind: str):
    """One request's tree: (next_token, next_sibling, order_ok) as lists of length N.

    kind: chain / bushy / mixed. Some nodes stay unreachable (-1 padding); the local
    numbering is sometimes shuffled (non-topological) and sibling chains sometimes run in
    decreasing index order, as SGLang's builder emits them.
    """
    n_real = rng.randint(1, N)
    par = [-1]
    for i in range(1, n_real):
        if kind == "chain":
            par.append(i - 1)
        elif kind == "bushy":
            par.append(rng.randrange(0, min(i, 2)))
        else:
            par.append(rng.randrange(0, i))
    perm = list(range(1, N))
    if rng.random() < 0.3:
        rng.shuffle(perm)
    loc = [0] + perm[: n_real - 1]              # specdec-order node j -> local node loc[j]
    kids = {j: [c for c in range(1, n_real) if par[c] == j] for j in range(n_real)}
    nt, ns = [-1] * N, [-1] * N
    for j in range(n_real):
        ch = [loc[c] for c in kids[j]]
        r = rng.random()
        if r < 0.3:
            ch.sort(reverse=True)
        elif r < 0.5:
            rng.shuffle(ch)
        if ch:
            nt[loc[j]] = ch[0]
            for a, b in zip(ch, ch[1:]):
                ns[a] = b
    return nt, ns


def random_batch(rng: random.Random, B: int, N: int, V: int, kind: str, *, match_rate=0.6):
    nts, nss = [], []
    for _ in range(B):
        k = kind if kind != "any" else rng.choice(["chain", "bushy", "mixed"])
        nt, ns = random_tree(rng, N, k)
        nts.append(nt)
        nss.append(ns)
    nt = torch.tensor(nts, dtype=torch.int64)
    ns = torch.tensor(nss, dtype=torch.int64)
    cand = torch.tensor([[rng.randrange(V) for _ in range(N)] for _ in range(B)], dtype=torch.int64)
    flat = list(range(B * N))
    if rng.random() < 0.5:
        rng.shuffle(flat)
    ri = torch.tensor(flat, dtype=torch.int64).reshape(B, N)
    # target_predict (flat-indexed): often equal to one of the node's children's candidates
    tp = torch.tensor([rng.randrange(V) for _ in range(B * N)], dtype=torch.int64)
    for b in range(B):
        for i in range(N):
            kids = []
            c = nts[b][i]
            while c != -1:
                kids.append(c)
                c = nss[b][c]
            if kids and rng.random() < match_rate:
                tp[int(ri[b, i])] = cand[b, rng.choice(kids)]
    return cand, ri, nt, ns, tp


# --------------------------------------------------------------------------- references
def ref_greedy(cand, ri, nt, ns, tp, S):
    B, N = cand.shape
    predicts = [-7] * (B * N)
    acc_idx = [[-1] * S for _ in range(B)]
    acc_num = [0] * B
    c_, r_, t_, s_, p_ = cand.tolist(), ri.tolist(), nt.tolist(), ns.tolist(), tp.tolist()
    for b in range(B):
        last = r_[b][0]
        acc_idx[b][0] = last
        n = 0
        cur = 0
        for _ in range(1, S):
            cur = t_[b][cur]
            while cur != -1:
                if c_[b][cur] == p_[last]:
                    predicts[last] = p_[last]
                    n += 1
                    acc_idx[b][n] = r_[b][cur]
                    last = r_[b][cur]
                    break
                cur = s_[b][cur]
            if cur == -1:
                break
        acc_num[b] = n
        predicts[last] = p_[last]
    return predicts, acc_idx, acc_num


def _final_draw(probs, removed, u: float, default=None) -> int:
    """SGLang's last draw: inverse CDF at u x (the row's mass) over the row without the rejected tokens."""
    row = [0.0 if v in removed else max(p, 0.0) for v, p in enumerate(probs)]
    x = u * sum(row)
    run = 0.0
    for v, p in enumerate(row):
        run += p
        if p > 0 and run > x:
            return v
    live = [v for v, p in enumerate(row) if p > 0]
    return max(live) if live or default is None else default


def ref_sampling(cand, ri, nt, ns, us, uf, probs, S):
    """SGLang's exact (threshold 1) target-only sampler (its running sum in float32, as its kernel
    accumulates; the final draw in float64); distinct sibling tokens assumed."""
    B, N = cand.shape
    predicts = [-7] * (B * N)
    acc_idx = [[-1] * S for _ in range(B)]
    acc_num = [0] * B
    P = probs.to(torch.float64).tolist()
    c_, r_, t_, s_, u_ = cand.tolist(), ri.tolist(), nt.tolist(), ns.tolist(), us.tolist()
    for b in range(B):
        last = r_[b][0]
        acc_idx[b][0] = last
        node, coin, n, cur = 0, u_[b][0], 0, 0
        removed = set()
        for _ in range(1, S):
            cur = t_[b][cur]
            acc_p = np.float32(0.0)
            removed = set()
            while cur != -1:
                tok = c_[b][cur]
                acc_p = np.float32(acc_p + np.float32(P[b][node][tok]))
                if coin <= float(acc_p):  # the coin as given (float32 in SGLang)
                    predicts[last] = tok
                    n += 1
                    acc_idx[b][n] = r_[b][cur]
                    last = r_[b][cur]
                    node, coin = cur, u_[b][cur]
                    break
                removed.add(tok)
                cur = s_[b][cur]
            if cur == -1:
                break
        if n == S - 1:
            removed = set()
        pick = _final_draw(P[b][node], removed, float(uf[b]))
        acc_num[b] = n
        predicts[last] = pick
    return predicts, acc_idx, acc_num


def run_greedy(cand, ri, nt, ns, tp, S):
    B, N = cand.shape
    predicts = torch.full((B * N,), -7, dtype=torch.int32)
    ai = torch.full((B, S), 99, dtype=torch.int32)
    an = torch.full((B,), 99, dtype=torch.int32)
    sg.verify_tree_greedy(predicts, ai, an, cand, ri, nt, ns, tp)
    return predicts, ai, an


# --------------------------------------------------------------------------- greedy
@pytest.mark.parametrize("kind", ["chain", "bushy", "mixed", "any"])
def test_greedy_matches_sglang_semantics(kind):
    rng = random.Random(sum(map(ord, kind)))
    done = 0
    while done < NUM_GREEDY // 4:
        B, N = rng.randint(1, 24), rng.randint(1, 12)
        S = rng.randint(1, N + 2)
        V = rng.choice([2, 3, 50, 32000])
        cand, ri, nt, ns, tp = random_batch(rng, B, N, V, kind)
        predicts, ai, an = run_greedy(cand, ri, nt, ns, tp, S)
        rp, rai, ran = ref_greedy(cand, ri, nt, ns, tp, S)
        assert predicts.tolist() == rp
        assert ai.tolist() == rai and ai.dtype == torch.int32
        assert an.tolist() == ran
        done += B


def test_greedy_host_form_equals_tensor_form(monkeypatch):
    """CPU batches take the host form (trees in SGLang's builder order); its outputs equal the tensor
    form's, int32 and int64 target tokens, S above and below the tree depth."""
    rng = random.Random(5)
    for t in range(40):
        B, N = rng.randint(1, 24), rng.randint(1, 12)
        S = rng.randint(1, N + 2)
        cand, ri, nt, ns, tp = random_batch(rng, B, N, rng.choice([2, 50]), ["chain", "bushy", "mixed"][t % 3])
        if t % 2:
            tp = tp.to(torch.int32)
        got = [x.tolist() for x in run_greedy(cand, ri, nt, ns, tp, S)]
        monkeypatch.setattr(sg, "HOST_FORM", False)
        want = [x.tolist() for x in run_greedy(cand, ri, nt, ns, tp, S)]
        monkeypatch.setattr(sg, "HOST_FORM", True)
        assert got == want, t


def test_greedy_host_call_taken_and_edge_cases(monkeypatch):
    """Builder-order CPU batches are decided by one C++ call (sglang_host.verify_greedy_host); with int64
    outputs, repeated flat indices in retrive_index, and predicts sharing target_predict's storage, its
    outputs equal the tensor form's; a tree the builder would not emit (a link to a lower index) and a
    flat index out of range go on to the general path (its walk, its error)."""
    from specdec.compat import sglang_host

    calls = []
    real = sglang_host._C.sglang_greedy
    monkeypatch.setattr(sglang_host._C, "sglang_greedy", lambda *a: calls.append(real(*a)) or calls[-1],
                        raising=False)
    rng = random.Random(9)
    taken = 0

    def both(run):
        got = [x.tolist() for x in run()]
        monkeypatch.setattr(sg, "HOST_FORM", False)
        want = [x.tolist() for x in run()]
        monkeypatch.setattr(sg, "HOST_FORM", True)
        return got, want

    for t in range(30):
        B, N = rng.randint(1, 10), rng.randint(1, 9)
        S = rng.randint(1, N + 2)
        cand, ri, nt, ns, tp = random_batch(rng, B, N, rng.choice([2, 30]), "any")
        if t % 3 == 1:
            ri = torch.tensor([rng.randrange(B * N) for _ in range(B * N)]).reshape(B, N)  # repeats

        def run64():
            predicts = torch.full((B * N,), -7, dtype=torch.int64)
            ai, an = torch.full((B, S), 99), torch.full((B,), 99)
            sg.verify_tree_greedy(predicts, ai, an, cand, ri, nt, ns, tp)
            return predicts, ai, an

        def run_shared():
            shared = tp.clone().reshape(-1)  # predicts IS target_predict
            ai, an = torch.full((B, S), 99, dtype=torch.int32), torch.full((B,), 99, dtype=torch.int32)
            sg.verify_tree_greedy(shared, ai, an, cand, ri, nt, ns, shared)
            return shared, ai, an

        links = [row_t + row_s for row_t, row_s in zip(nt.tolist(), ns.tolist())]
        builder = all(all(j == -1 or i % N < j < N for i, j in enumerate(row)) and
                      len([j for j in row if j >= 0]) == len({j for j in row if j >= 0}) for row in links)
        for run in (run64, run_shared):
            before = len(calls)
            got, want = both(run)
            assert calls[before:] == [builder] and got == want, t
        taken += builder
    assert taken >= 10
    nt = torch.tensor([[2, -1, -1]])
    ns = torch.tensor([[-1, -1, 1]])  # node 2's sibling is node 1: a lower index
    cand, tp, ri = torch.tensor([[0, 4, 5]]), torch.tensor([5, 4, 9]), torch.arange(3).view(1, 3)
    before = len(calls)
    got, want = both(lambda: run_greedy(cand, ri, nt, ns, tp, 3))
    assert calls[before:] == [False] and got == want and got[1] == [[0, 2, -1]]
    with pytest.raises(ValueError, match=r"retrive_index\[0, 1\]"):
        run_greedy(cand, torch.tensor([[0, 3, 2]]), nt, ns, tp, 3)


def test_greedy_small_example():
    # root 0 -> [1 -> 3, 2]; target after root = 7 (node 2's token), after node 2 = 1
    nt = torch.tensor([[1, 3, -1, -1]])
    ns = torch.tensor([[-1, 2, -1, -1]])
    cand = torch.tensor([[5, 6, 7, 8]])
    tp = torch.tensor([[7, 8, 1, 9]])
    predicts, ai, an = run_greedy(cand, torch.arange(4)[None], nt, ns, tp, 3)
    assert ai.tolist() == [[0, 2, -1]] and an.tolist() == [1]
    assert predicts.tolist() == [7, -7, 1, -7]


def test_greedy_step_limit():
    # a full chain that the target agrees with, cut by num_spec_step
    N = 6
    nt = torch.tensor([[1, 2, 3, 4, 5, -1]])
    ns = torch.full((1, N), -1)
    cand = torch.tensor([[0, 10, 11, 12, 13, 14]])
    tp = torch.tensor([[10, 11, 12, 13, 14, 15]])
    predicts, ai, an = run_greedy(cand, torch.arange(N)[None], nt, ns, tp, 3)
    assert ai.tolist() == [[0, 1, 2]] and an.tolist() == [2]
    assert predicts.tolist() == [10, 11, 12, -7, -7, -7]


# --------------------------------------------------------------------------- conversion
def test_round_trip_parents_sglang_parents():
    rng = random.Random(5)
    for _ in range(300):
        B, N = rng.randint(1, 6), rng.randint(1, 10)
        parents, tokens = [], []
        for _ in range(B):
            n = rng.randint(1, N)
            row = [-1] + [rng.randrange(0, i) for i in range(1, n)] + [-1] * (N - n)
            parents.append(row)
            tokens.append([rng.randrange(100) for _ in range(n)] + [-1] * (N - n))
        par = torch.tensor(parents, dtype=torch.int32)
        tok = torch.tensor(tokens, dtype=torch.int64)
        cand, ri, nt, ns = sg.parents_to_sglang(tok, par)
        assert ri.tolist() == [[b * N + i for i in range(N)] for b in range(B)]
        for t in (cand, ri, nt, ns):
            assert t.dtype == torch.int64 and tuple(t.shape) == (B, N)
        tok2, par2, dep2, order = sg.sglang_to_parents(nt, ns, cand)
        assert torch.equal(tok2, tok) and torch.equal(par2, par)
        assert par2.dtype == torch.int32 and dep2.dtype == torch.int32
        real = par >= 0
        real[:, 0] = True
        assert order.tolist() == torch.where(real, torch.arange(N), -1).tolist()
        for b in range(B):
            for i in range(1, N):
                p = parents[b][i]
                assert int(dep2[b, i]) == (int(dep2[b, p]) + 1 if p >= 0 else 0)
        # and back again
        _, _, nt2, ns2 = sg.parents_to_sglang(tok2, par2)
        assert torch.equal(nt2, nt) and torch.equal(ns2, ns)


def test_sglang_to_parents_reorders_and_keeps_sibling_order():
    rng = random.Random(9)
    for _ in range(300):
        N = rng.randint(1, 10)
        nt, ns = random_tree(rng, N, "mixed")
        cand = torch.tensor([list(range(100, 100 + N))])
        tok, par, dep, order = sg.sglang_to_parents(torch.tensor([nt]), torch.tensor([ns]), cand)
        p, o = par[0].tolist(), order[0].tolist()
        for i in range(1, N):
            assert p[i] < i
            if p[i] >= 0:
                assert o[i] >= 0 and int(tok[0, i]) == 100 + o[i]
        # children of each node, in specdec index order, equal the SGLang sibling chain
        for j in range(N):
            if o[j] < 0:
                continue
            chain, c = [], nt[o[j]]
            while c != -1:
                chain.append(c)
                c = ns[c]
            assert [o[i] for i in range(N) if p[i] == j and i > 0] == chain


def test_tree_conversion_by_tensor_ops_equals_the_walk():
    """At batch >= FAST_MIN_BATCH builder-style trees (links to higher indices only) convert by
    tensor ops; the result equals the checked walk's, and every other input (renumbered trees,
    shared nodes, out-of-range links) goes to the walk, which raises its own errors."""
    rng = random.Random(21)
    B = sglang_tree.FAST_MIN_BATCH
    for t in range(60):
        N = rng.randint(1, 9)
        if t % 2:
            rows = [random_tree(rng, N, ["chain", "bushy", "mixed"][t % 3]) for _ in range(B)]
            nt = torch.tensor([r[0] for r in rows])
            ns = torch.tensor([r[1] for r in rows])
        else:  # as SGLang's builder numbers them: parents first, siblings in index order
            par = []
            for _ in range(B):
                row = [-1]
                for i in range(1, N):
                    real = [j for j in range(i) if j == 0 or row[j] >= 0]
                    row.append(-1 if rng.random() < 0.2 else rng.choice(real))
                par.append(row)
            par = torch.tensor(par, dtype=torch.int32)
            _, _, nt, ns = sg.parents_to_sglang(torch.zeros(B, N, dtype=torch.int64), par)
        if t % 5 == 4:  # one bad link: a shared node, a back link or an out-of-range index
            which = nt if t % 2 else ns
            which[rng.randrange(B), rng.randrange(N)] = rng.choice([-2, 0, N, rng.randrange(N)])
        for max_depth in (None, 0, 2):
            try:
                orders, parents, _ = sglang_tree.walk_tree("f", nt, ns, max_depth)
            except ValueError as e:
                with pytest.raises(ValueError, match=re.escape(str(e))):
                    sglang_tree.tree_tensors("f", nt, ns, max_depth)
                continue
            order, par, identity = sglang_tree.tree_tensors("f", nt, ns, max_depth)
            assert order.tolist() == orders and par.tolist() == parents
            assert identity == all(o in (i, -1) for row in orders for i, o in enumerate(row))
            assert order.dtype == torch.int64 and par.dtype == torch.int32
    # builder-style trees take the tensor path: the walk is not called
    nt = torch.tensor([[1, 3, -1, -1]] * B)
    ns = torch.tensor([[-1, 2, -1, -1]] * B)
    walk, sglang_tree.walk_tree = sglang_tree.walk_tree, None
    try:
        order, par, identity = sglang_tree.tree_tensors("f", nt, ns, None)
    finally:
        sglang_tree.walk_tree = walk
    assert par.tolist() == [[-1, 0, 0, 1]] * B and order.tolist() == [[0, 1, 2, 3]] * B and identity


@pytest.mark.parametrize("nt,ns,msg", [
    ([[1, 2, 1]], [[-1, -1, -1]], "reached again"),          # cycle via first-child
    ([[1, -1, -1]], [[-1, 2, 1]], "reached again"),          # cycle in a sibling chain
    ([[1, 2, -1]], [[-1, 2, -1]], "reached again"),          # node 2 reachable twice
    ([[1, 0, -1]], [[-1, -1, -1]], "the root"),              # root as a child
    ([[1, 5, -1]], [[-1, -1, -1]], "retrive_next_token[0, 1]"),
    ([[1, -1, -1]], [[-1, -2, -1]], "retrive_next_sibling[0, 1]"),
])
def test_malformed_sglang_trees(nt, ns, msg):
    with pytest.raises(ValueError, match="sglang_to_parents") as e:
        sg.sglang_to_parents(torch.tensor(nt), torch.tensor(ns))
    assert msg in str(e.value) and "expected" in str(e.value) and "got" in str(e.value)
    # the adapter ops reject them with their own name
    B, N = 1, 3
    with pytest.raises(ValueError, match="verify_tree_greedy"):
        run_greedy(torch.zeros(B, N, dtype=torch.int64), torch.arange(N)[None], torch.tensor(nt),
                   torch.tensor(ns), torch.zeros(B * N, dtype=torch.int64), 3)


def test_malformed_parents_and_shapes():
    tok = torch.zeros(1, 4, dtype=torch.int64)
    for par, msg in [([[0, 0, 1, 2]], "parents[0, 0]"), ([[-1, 0, 2, 1]], "parents[0, 2]"),
                     ([[-1, 0, 7, -1]], "parents[0, 2]"), ([[-1, -1, 1, -1]], "padding node 1")]:
        with pytest.raises(ValueError, match="parents_to_sglang") as e:
            sg.parents_to_sglang(tok, torch.tensor(par, dtype=torch.int32))
        assert msg in str(e.value)
    nt = torch.tensor([[1, -1]])
    ns = torch.tensor([[-1, -1]])
    with pytest.raises(ValueError, match="sglang_to_parents: retrive_next_sibling"):
        sg.sglang_to_parents(nt, torch.tensor([[-1, -1, -1]]))
    with pytest.raises(ValueError, match="verify_tree_greedy: accept_token_num"):
        sg.verify_tree_greedy(torch.zeros(2, dtype=torch.int32), torch.zeros(1, 2, dtype=torch.int32),
                              torch.zeros(2, dtype=torch.int32), torch.zeros(1, 2, dtype=torch.int64),
                              torch.arange(2)[None], nt, ns, torch.zeros(2, dtype=torch.int64))
    with pytest.raises(ValueError, match=r"verify_tree_greedy: retrive_index\[0, 1\]"):
        run_greedy(torch.zeros(1, 2, dtype=torch.int64), torch.tensor([[0, 2]]), nt, ns,
                   torch.zeros(2, dtype=torch.int64), 2)
    with pytest.raises(ValueError, match="verify_tree_greedy: target_predict"):
        run_greedy(torch.zeros(1, 2, dtype=torch.int64), torch.arange(2)[None], nt, ns,
                   torch.zeros(3, dtype=torch.int64), 2)


# --------------------------------------------------------------------------- sampling
def sample_case(rng: random.Random, g: torch.Generator, B, N, V, kind):
    cand, ri, nt, ns, _ = random_batch(rng, B, N, V, kind)
    # distinct tokens among siblings (SGLang's kernel double-counts repeats; see the adapter's doc)
    for b in range(B):
        for i in range(N):
            c, used = int(nt[b, i]), set()
            while c != -1:
                while int(cand[b, c]) in used:
                    cand[b, c] = (int(cand[b, c]) + 1) % V
                used.add(int(cand[b, c]))
                c = int(ns[b, c])
    z = torch.randn(B, N, V, generator=g) * 2
    probs = torch.softmax(z, -1)
    probs = probs * (torch.rand(B, N, V, generator=g) > 0.2)
    probs = probs / probs.sum(-1, keepdim=True).clamp(min=1e-30)
    probs[probs.sum(-1) == 0] = 1.0 / V
    us = torch.rand(B, N, generator=g, dtype=torch.float64)
    uf = torch.rand(B, generator=g, dtype=torch.float64)
    return cand, ri, nt, ns, us, uf, probs.to(torch.float32)


def run_sampling(cand, ri, nt, ns, us, uf, probs, S, draft_probs=None):
    B, N = cand.shape
    predicts = torch.full((B * N,), -7, dtype=torch.int32)
    ai = torch.full((B, S), 99, dtype=torch.int32)
    an = torch.full((B,), 99, dtype=torch.int32)
    sg.tree_speculative_sampling_target_only(predicts, ai, an, cand, ri, nt, ns, us, uf, probs, draft_probs)
    return predicts, ai, an


@pytest.mark.parametrize("kind", ["chain", "bushy", "mixed"])
def test_sampling_matches_sglang_semantics(kind):
    rng = random.Random(11 + len(kind))
    g = torch.Generator().manual_seed(3 + len(kind))
    for _ in range(25):
        B, N, V = rng.randint(1, 12), rng.randint(1, 9), rng.choice([10, 17, 40])
        S = rng.randint(1, N + 1)
        case = sample_case(rng, g, B, N, V, kind)
        predicts, ai, an = run_sampling(*case, S)
        rp, rai, ran = ref_sampling(*case, S)
        assert ai.tolist() == rai and an.tolist() == ran
        assert predicts.tolist() == rp


def _both_forms(case, S, monkeypatch):
    """The exact sampler's outputs from the host form (CPU default) and from the tensor form."""
    got = run_sampling(*case, S)
    monkeypatch.setattr(sg, "HOST_FORM", False)
    want = run_sampling(*case, S)
    monkeypatch.setattr(sg, "HOST_FORM", True)
    return [t.tolist() for t in got], [t.tolist() for t in want]


@pytest.mark.parametrize("native", [True, False])
@pytest.mark.parametrize("rows", ["normalised", "unnormalised", "negative", "infinite", "nan"])
def test_sampling_host_form_equals_tensor_form(rows, native, monkeypatch):
    """The host form's integers equal the tensor form's on any rows: trees with three or more
    siblings (the sibling masses summed by torch), rows that break its reachability guess (an
    infinite or negative entry changes a row's sum; the walk then reaches a row it did not sum and
    the op runs again) and rows with NaN; with the per-child work in C++ and in NumPy arrays."""
    monkeypatch.setattr(sglang_host, "NATIVE", native)
    rng = random.Random(len(rows))
    g = torch.Generator().manual_seed(40 + len(rows))
    for t in range(30):
        B, N, V = rng.randint(1, 20), rng.randint(1, 9), rng.choice([6, 17, 40])
        S = rng.randint(1, N + 1)
        cand, ri, nt, ns, us, uf, probs = sample_case(rng, g, B, N, V, ["chain", "bushy", "mixed"][t % 3])
        if rows == "unnormalised":
            probs = probs * rng.choice([0.3, 2.5])
        elif rows == "negative":
            probs = probs - 0.2 * torch.rand(B, N, V, generator=g)
        elif rows in ("infinite", "nan"):
            hit = torch.rand(B, N, V, generator=g) < 0.03
            probs = probs.masked_fill(hit, float("inf") if rows == "infinite" else float("nan"))
        if t % 2:
            us = us * 0.05  # small coins: many children accepted, deeper walks
        if t % 5 == 4:
            us = us.float()
        got, want = _both_forms((cand, ri, nt, ns, us, uf, probs), S, monkeypatch)
        assert got == want, (rows, t)


@pytest.mark.parametrize("host", [True, False])
def test_sampling_reads_only_the_children_masses(host, monkeypatch):
    """SGLang's test reads a child's own probability and its earlier siblings', nothing else of the
    row: an infinite or NaN entry elsewhere in the root row changes no decision (coin 0.99 rejects
    the child of mass 1/6 whatever the row's sum), and the op is called once."""
    monkeypatch.setattr(sg, "HOST_FORM", host)
    V = 6
    nt, ns = torch.tensor([[1, 2, -1]]), torch.tensor([[-1, -1, -1]])
    cand, ri = torch.tensor([[0, 1, 2]]), torch.arange(3)[None]
    us = torch.tensor([[0.99, 0.5, 0.5]], dtype=torch.float64)
    uf = torch.tensor([0.3], dtype=torch.float64)
    calls = []
    op = ops.rejection_sample
    monkeypatch.setattr(ops, "rejection_sample", lambda *a: calls.append(1) or op(*a))
    for bad in (float("inf"), float("nan"), 1e30):
        probs = torch.full((1, 3, V), 1.0 / V)
        probs[0, 0, 5] = bad
        got = [t.tolist() for t in run_sampling(cand, ri, nt, ns, us, uf, probs, 3)]
        assert got[2] == [0] and got[1] == [[0, -1, -1]], bad  # the child rejected at the root
    assert len(calls) == 3


@pytest.mark.parametrize("host", [True, False])
def test_sampling_running_sum_is_float32_like_the_kernel(host, monkeypatch):
    """Two siblings whose float32 running sum rounds above the exact sum of their float32 masses:
    a coin equal to that float32 sum passes SGLang's test at the second child (its kernel adds in
    float32), though it exceeds the exact sum."""
    monkeypatch.setattr(sg, "HOST_FORM", host)
    rng = np.random.default_rng(0)
    while True:
        a, b = rng.random(2, dtype=np.float32) * np.float32(0.4)
        run = np.float32(a + b)
        if float(run) > float(a) + float(b):
            break
    V = 4
    nt, ns = torch.tensor([[1, -1, -1]]), torch.tensor([[-1, 2, -1]])
    cand, ri = torch.tensor([[0, 1, 2]]), torch.arange(3)[None]
    probs = torch.zeros(1, 3, V)
    probs[0, 0, 1], probs[0, 0, 2], probs[0, 0, 3] = float(a), float(b), 1.0 - float(run)
    probs[0, 1:] = 0.25
    for dtype in (torch.float32, torch.float64):
        us = torch.tensor([[float(run), 0.5, 0.5]], dtype=dtype)
        got = [t.tolist() for t in run_sampling(cand, ri, nt, ns, us, torch.tensor([0.3]), probs, 3)]
        assert got[1] == [[0, 2, -1]] and got[2] == [1], dtype  # child 2 (token 2) accepted
        us = torch.tensor([[float(np.nextafter(run, np.float32(1)))] + [0.5, 0.5]], dtype=dtype)
        got = [t.tolist() for t in run_sampling(cand, ri, nt, ns, us, torch.tensor([0.3]), probs, 3)]
        assert got[2] == [0], dtype  # just above: both rejected


def test_sampling_draft_probs_scratch_like_sglang():
    # root -> children tokens 1, 2, 3; coin 0.95 rejects 1 and 2 under p_root = [.1,.2,.3,.4]... then 3
    nt = torch.tensor([[1, -1, -1, -1]])
    ns = torch.tensor([[-1, 2, 3, -1]])
    cand = torch.tensor([[0, 1, 2, 3]])
    probs = torch.tensor([[[0.1, 0.2, 0.3, 0.4]] * 4])
    us = torch.tensor([[0.55, 0.5, 0.5, 0.5]], dtype=torch.float64)
    dp = torch.zeros_like(probs)
    predicts, ai, an = run_sampling(cand, torch.arange(4)[None], nt, ns, us, torch.tensor([0.5], dtype=torch.float64),
                                    probs, 3, dp)
    # 0.55 > 0.2 (reject token 1), > 0.5 (reject token 2), <= 0.9: accept node 3 (token 3)
    assert ai.tolist() == [[0, 3, -1]] and an.tolist() == [1]
    assert dp[0, 0].tolist() == pytest.approx([0.0, 0.2, 0.3, 0.0]) and float(dp[0, 1:].abs().sum()) == 0
    assert predicts.tolist()[0] == 3


def ref_lossy(cand, ri, nt, ns, us, uf, probs, S, t_single, t_acc):
    """SGLang's walk with thresholds (lossy), read from sgl-kernel: repeated sibling tokens count again."""
    B, N = cand.shape
    predicts = [-7] * (B * N)
    acc_idx = [[-1] * S for _ in range(B)]
    acc_num = [0] * B
    P = probs.to(torch.float64).tolist()
    c_, r_, t_, s_, u_ = cand.tolist(), ri.tolist(), nt.tolist(), ns.tolist(), us.tolist()
    for b in range(B):
        last = r_[b][0]
        acc_idx[b][0] = last
        node, coin, n, cur = 0, u_[b][0], 0, 0
        removed = set()
        for _ in range(1, S):
            cur = t_[b][cur]
            acc_p = 0.0
            while cur != -1:
                tok = c_[b][cur]
                acc_p += P[b][node][tok]
                if coin <= acc_p / max(t_acc, 1e-9) or P[b][node][tok] >= t_single:
                    predicts[last] = tok
                    n += 1
                    acc_idx[b][n] = r_[b][cur]
                    last = r_[b][cur]
                    node, coin = cur, u_[b][cur]
                    removed = set()
                    break
                removed.add(tok)
                cur = s_[b][cur]
            if cur == -1:
                break
        if n == S - 1:
            removed = set()
        pick = _final_draw(P[b][node], removed, float(uf[b]), default=len(P[b][node]) - 1)
        acc_num[b] = n
        predicts[last] = pick
    return predicts, acc_idx, acc_num


@pytest.mark.parametrize("t_single,t_acc", [(0.5, 1.0), (1.0, 0.6), (0.3, 0.4)])
def test_sampling_lossy_thresholds_match_reference(t_single, t_acc):
    rng = random.Random(int(t_single * 10 + t_acc * 100))
    g = torch.Generator().manual_seed(int(t_acc * 100))
    for _ in range(25):
        B, N, V = rng.randint(1, 12), rng.randint(1, 9), rng.choice([10, 17, 40])
        S = rng.randint(1, N + 1)
        cand, ri, nt, ns, _ = random_batch(rng, B, N, V, "any")  # repeated sibling tokens allowed
        probs = torch.softmax(torch.randn(B, N, V, generator=g) * 2, -1)
        us = torch.rand(B, N, generator=g)
        uf = torch.rand(B, generator=g)
        predicts = torch.full((B * N,), -7, dtype=torch.int32)
        ai = torch.full((B, S), 99, dtype=torch.int32)
        an = torch.full((B,), 99, dtype=torch.int32)
        sg.tree_speculative_sampling_target_only(predicts, ai, an, cand, ri, nt, ns, us, uf, probs, None,
                                                 threshold_single=t_single, threshold_acc=t_acc)
        rp, rai, ran = ref_lossy(cand, ri, nt, ns, us, uf, probs, S, t_single, t_acc)
        assert ai.tolist() == rai and an.tolist() == ran
        assert predicts.tolist() == rp



def _chi2_pvalue(counts: torch.Tensor, probs: torch.Tensor):
    n = float(counts.sum())
    sup = probs > 0
    assert float(counts[~sup].sum()) == 0, "mass outside the target's support"
    exp = probs[sup] * n
    chi2 = float(((counts[sup] - exp) ** 2 / exp).sum())
    df = int(sup.sum()) - 1
    p = float(torch.special.gammaincc(torch.tensor(df / 2.0, dtype=torch.float64),
                                      torch.tensor(chi2 / 2.0, dtype=torch.float64)))
    tv = 0.5 * float((counts / n - probs).abs().sum())
    return p, tv


def test_sampled_tokens_follow_target_distribution():
    """Small tree, many independent draws: first emitted token ~ p_root; second token after
    the first child's token ~ that child's target row."""
    V, M = 5, 40000
    # root -> [1 (tok 0) -> [3 (tok 2), 4 (tok 4)], 2 (tok 3)]
    nt = torch.tensor([[1, 3, -1, -1, -1]]).expand(M, 5).contiguous()
    ns = torch.tensor([[-1, 2, -1, 4, -1]]).expand(M, 5).contiguous()
    cand = torch.tensor([[1, 0, 3, 2, 4]]).expand(M, 5).contiguous()
    rows = torch.tensor([[0.30, 0.15, 0.05, 0.20, 0.30],
                         [0.10, 0.40, 0.25, 0.00, 0.25],
                         [0.2, 0.2, 0.2, 0.2, 0.2],
                         [0.5, 0.1, 0.1, 0.1, 0.2],
                         [0.2, 0.2, 0.2, 0.2, 0.2]])
    probs = rows[None].expand(M, 5, V).contiguous()
    g = torch.Generator().manual_seed(1234)
    us = torch.rand(M, 5, generator=g, dtype=torch.float64)
    uf = torch.rand(M, generator=g, dtype=torch.float64)
    ri = torch.arange(M * 5).reshape(M, 5)
    predicts, ai, an = run_sampling(cand, ri, nt, ns, us, uf, probs, 4)
    first = predicts.reshape(M, 5)[:, 0].long()
    p1, tv1 = _chi2_pvalue(torch.bincount(first, minlength=V).double(), rows[0].double())
    assert p1 >= 1e-4 and tv1 < 0.01, (p1, tv1)
    # draws whose first token is node 1's token (0): the next token is emitted at node 1
    sel = first == 0
    assert bool((ai[sel, 1] == ri[sel, 1]).all())
    second = predicts.reshape(M, 5)[sel, 1].long()
    p2, tv2 = _chi2_pvalue(torch.bincount(second, minlength=V).double(), rows[1].double())
    assert p2 >= 1e-4 and tv2 < 0.02, (p2, tv2)
    # and the statistic has power: a wrong row is rejected
    p_bad, _ = _chi2_pvalue(torch.bincount(second, minlength=V).double(),
                            torch.tensor([0.15, 0.35, 0.25, 0.0, 0.25], dtype=torch.float64))
    assert p_bad < 1e-4
