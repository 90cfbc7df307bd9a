"""specdec.compat.vllm's tree sampler and KV commits, against independent pure-Python readings
of the documented semantics (module docstring of specdec.compat.vllm_tree): greedy walks exactly,
sampled trees statistically (chi-square on the emitted path), commits byte-exactly, errors."""
from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

from specdec.compat import vllm


def _gen(seed):
    return torch.Generator().manual_seed(seed)


def random_trees(B, S, V, g, n=None):
    n = n or [int(x) for x in torch.randint(0, S + 1, (B,), generator=g)]
    d, par = [], []
    for k in n:
        for j in range(k):
            par.append(int(torch.randint(-1, j, (1,), generator=g)) if j else -1)
            d.append(int(torch.randint(0, V, (1,), generator=g)))
    T = sum(n)
    p = torch.softmax(torch.randn(T + B, V, generator=g) * 3, -1)
    # make the target agree with drafts often so that deep paths get accepted
    start = 0
    for b, k in enumerate(n):
        for j in range(k):
            if torch.rand(1, generator=g) < 0.7:
                row = start + b + (par[start + j] + 1)  # the parent's row in the request's block
                p[row] = 0.02 / V
                p[row, d[start + j]] = 1.0
        start += k
    cu = torch.tensor(n, dtype=torch.int64).cumsum(0).to(torch.int32)
    return (torch.tensor(d, dtype=torch.int32), torch.tensor(par, dtype=torch.int32), n, cu, p)


def greedy_reference(d, par, n, p):
    """First child (index order) whose token is the argmax of the current row; then the argmax."""
    outs, paths = [], []
    start = 0
    for b, k in enumerate(n):
        rows = p[start + b:start + b + k + 1]
        toks = d[start:start + k].tolist()
        pr = par[start:start + k].tolist()
        cur, path, out = -1, [0], []
        while True:
            best = int(torch.argmax(rows[cur + 1]))
            nxt = next((j for j in range(k) if pr[j] == cur and toks[j] == best), None)
            out.append(best)
            if nxt is None:
                break
            path.append(nxt + 1)
            cur = nxt
        outs.append(out)
        paths.append(path)
        start += k
    return outs, paths


def test_tree_greedy_matches_reference():
    g = _gen(1)
    for i in range(30):
        S, V, B = [(1, 3), (4, 5), (7, 4), (3, 20)][i % 4] + (16,)
        d, par, n, cu, p = random_trees(B, S, V, g)
        temp = torch.where(torch.rand(B, generator=g) < 0.5, torch.zeros(B), -torch.ones(B))
        res = vllm.tree_rejection_sample(d, par, n, S + 1, cu, None, p, temp)
        outs, paths = greedy_reference(d, par, n, p)
        assert res.output_token_ids.dtype == torch.int32 and res.output_token_ids.shape == (B, S + 2)
        for b in range(B):
            k = len(outs[b])
            assert res.output_token_ids[b].tolist() == outs[b] + [-1] * (S + 2 - k)
            assert res.accepted[b].tolist() == paths[b] + [-1] * (S + 2 - len(paths[b]))
            assert int(res.num_accepted[b]) == len(paths[b]) - 1


def test_tree_chain_equals_chain_sampler():
    """A chain written as a tree (parents j - 1) gives the chain sampler's output under the same uniforms."""
    g = _gen(2)
    B, S, V = 32, 4, 6
    n = [int(x) for x in torch.randint(0, S + 1, (B,), generator=g)]
    T = sum(n)
    d = torch.randint(0, V, (T,), generator=g, dtype=torch.int32)
    par = torch.cat([torch.arange(k, dtype=torch.int32) - 1 for k in n])
    q = torch.softmax(torch.randn(T, V, generator=g), -1)
    p_all = torch.softmax(torch.randn(T + B, V, generator=g), -1)
    cu = torch.tensor(n).cumsum(0).to(torch.int32)
    u = torch.rand(B, S + 1, generator=g, dtype=torch.float64)
    temp = torch.ones(B)
    tree = vllm.tree_rejection_sample(d, par, n, S, cu, q, p_all, temp, uniforms=u)
    # chain form: target rows = the first k rows of each block; the bonus row is drawn with u[:, 0]
    starts = [0] + cu.tolist()[:-1]
    idx = torch.cat([torch.arange(s + b, s + b + k) for b, (s, k) in enumerate(zip(starts, n))]).long()
    bonus_rows = torch.tensor([s + b + k for b, (s, k) in enumerate(zip(starts, n))])
    cdf = p_all[bonus_rows].double().cumsum(-1)
    bonus = torch.searchsorted(cdf, (u[:, 0] * cdf[:, -1])[:, None], right=True).clamp(max=V - 1).to(torch.int32)
    chain = vllm.rejection_sample(d, n, S, cu, q, p_all[idx], bonus, temp, uniforms=u)
    full = tree.num_accepted == torch.tensor(n, dtype=torch.int32)
    assert torch.equal(tree.output_token_ids[~full], chain[~full])
    assert torch.equal(tree.output_token_ids[full][:, :-1].clamp(min=-1), chain[full][:, :-1])


def _chi2_ok(counts, probs, n):
    keep = probs > 0
    assert int(counts[~keep].sum()) == 0
    exp = probs[keep] * n
    stat = float(((counts[keep] - exp) ** 2 / exp).sum())
    df = max(int(keep.sum()) - 1, 1)
    crit = df * (1 - 2 / (9 * df) + 5.2 * math.sqrt(2 / (9 * df))) ** 3
    assert stat < crit, (stat, crit)


@pytest.mark.parametrize("with_draft", [False, True])
def test_tree_sampled_is_exact(with_draft):
    """Three root children and a grandchild under the first: the emitted first token follows the
    root's target row, the second the row after the first. Without draft_probs the drafts are
    fixed (one a duplicate); with them, the children are drawn i.i.d. from q_root, the grandchild
    from q_child."""
    g = _gen(3 + with_draft)
    V, B, T = 4, 40000, 4
    p_root = torch.tensor([0.1, 0.4, 0.3, 0.2])
    p_after = torch.tensor([[0.25, 0.25, 0.25, 0.25], [0.5, 0.0, 0.25, 0.25],
                            [0.2, 0.2, 0.2, 0.4], [0.0, 0.6, 0.4, 0.0]])
    par = torch.tensor([-1, -1, -1, 0], dtype=torch.int32).repeat(B)
    if with_draft:
        q_root, q_child = torch.tensor([0.4, 0.1, 0.2, 0.3]), torch.tensor([0.3, 0.3, 0.2, 0.2])
        d = torch.cat([torch.multinomial(q_root, 3 * B, replacement=True, generator=g).view(B, 3),
                       torch.multinomial(q_child, B, replacement=True, generator=g).view(B, 1)], 1)
        q = torch.stack([q_root, q_root, q_root, q_child]).repeat(B, 1)
    else:
        d = torch.tensor([1, 2, 1, 3]).repeat(B, 1)
        q = None
    rows = torch.cat([p_root[None, None].expand(B, 1, V), p_after[d]], 1).reshape(B * (T + 1), V)
    out = vllm.tree_rejection_sample(d.flatten().to(torch.int32), par, [T] * B, T, torch.arange(1, B + 1) * T, q,
                                     rows, torch.ones(B), generator=g).output_token_ids.long()
    _chi2_ok(torch.bincount(out[:, 0], minlength=V).double(), p_root.double(), B)
    for t in range(V):
        sel = (out[:, 0] == t) & (out[:, 1] >= 0)
        if int(sel.sum()) > 500:
            _chi2_ok(torch.bincount(out[sel, 1], minlength=V).double(), p_after[t].double(), int(sel.sum()))


def _pools(L, P, ps, H, D, g):
    return [torch.randn(2, P, ps, H, D, generator=g) for _ in range(L)]


@pytest.mark.parametrize("ps", [1, 4])
def test_commit_block_table_and_slots(ps):
    g = _gen(5)
    L, P, H, D, B, S = 2, 64, 2, 3, 4, 5
    kv = _pools(L, P, ps, H, D, g)
    perm = torch.randperm(P, generator=g).to(torch.int32)
    max_blocks = 32 // ps + 2
    table = torch.full((6, max_blocks), -1, dtype=torch.int32)
    rows = torch.tensor([4, 0, 2, 5])
    lens = torch.tensor([3, 0, 7, 9], dtype=torch.int32)
    used = 0
    for b in range(B):
        need = (int(lens[b]) + S + 1 + ps - 1) // ps
        table[rows[b], :need] = perm[used:used + need]
        used += need
    d, par, n, cu, p = random_trees(B, S, 5, g)
    res = vllm.tree_rejection_sample(d, par, n, S, cu, None, p, torch.zeros(B))
    # reference: flat slot moves, one request at a time
    want = [c.clone() for c in kv]
    slots = []
    for b in range(B):
        pos = int(lens[b]) + torch.arange(n[b] + 1)
        sl = table[rows[b]].long()[pos // ps] * ps + pos % ps
        slots.append(sl)
        for c in want:
            flat = c.view(2, P * ps, H, D)
            for i in range(1, int(res.num_accepted[b]) + 1):
                flat[:, sl[i]] = flat[:, sl[int(res.accepted[b, i])]]
    got = [c.clone() for c in kv]
    new = vllm.commit_accepted_kv(got, table, rows, lens, res.accepted, res.num_accepted)
    assert new.tolist() == (lens + res.num_accepted + 1).tolist()
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    got2 = [(c[0].clone(), c[1].clone()) for c in kv]
    qsl = torch.tensor([0] + [k + 1 for k in n]).cumsum(0).to(torch.int32)
    vllm.commit_accepted_kv_slots(got2, torch.cat(slots), qsl, res.accepted, res.num_accepted)
    assert all(torch.equal(torch.stack(a), b) for a, b in zip(got2, want))
    # vLLM's FlashInfer layout [num_blocks, 2, block_size, H, D] (K, V interleaved per block) and HND
    # blocks: the block-table form commits them in place, through strided views
    for hnd in (False, True):
        pools = [c.transpose(0, 1).clone(memory_format=torch.contiguous_format) for c in kv]  # [P, 2, ps, H, D]
        if hnd:
            pools = [c.transpose(2, 3).clone(memory_format=torch.contiguous_format).transpose(2, 3) for c in pools]
        ptrs = [c.data_ptr() for c in pools]
        vllm.commit_accepted_kv([(c[:, 0], c[:, 1]) for c in pools], table, rows, lens, res.accepted,
                                res.num_accepted)
        assert [c.data_ptr() for c in pools] == ptrs
        assert all(torch.equal(c.transpose(0, 1), w) for c, w in zip(pools, want))
        if ps > 1:  # blocks and offsets of these pools make no flat slot index: refused, nothing written
            before = [c.clone() for c in pools]
            with pytest.raises(ValueError, match=r"commit_accepted_kv_slots: kv_caches must be pools whose blocks"):
                vllm.commit_accepted_kv_slots([(c[:, 0], c[:, 1]) for c in pools], torch.cat(slots), qsl,
                                              res.accepted, res.num_accepted)
            assert all(torch.equal(a, b) for a, b in zip(pools, before))


@pytest.mark.parametrize("uniform", [False, True])
def test_tree_host_form_equals_tensor_form(uniform, monkeypatch):
    """CPU batches check parents as a list and stage full batches in kept buffers; outputs and errors
    equal the tensor form's (the one GPUs take), greedy and sampled, parents int32 or int64."""
    from specdec.compat import vllm_tree
    g = _gen(40 + uniform)
    for i in range(6):
        B, S, V = [(3, 4, 6), (8, 7, 11), (1, 2, 5)][i % 3]
        d, par, n, cu, p = random_trees(B, S, V, g, [S] * B if uniform else None)  # uniform: full-batch staging
        if i % 2:
            par = par.long()
        temp = torch.where(torch.rand(B, generator=g) < 0.5, torch.zeros(B), torch.ones(B)) if i % 3 \
            else torch.zeros(B)
        u = torch.rand(B, S + 1, generator=g, dtype=torch.float64)
        outs = []
        for host in (True, False):
            monkeypatch.setattr(vllm_tree, "HOST_FORM", host)
            outs.append(vllm.tree_rejection_sample(d, par, n, S, cu, None, p, temp, uniforms=u))
        for w, h in zip(*outs):
            assert w.dtype == h.dtype and torch.equal(w, h), i
    bad = torch.tensor([-1, 0, 2, -1, 0], dtype=torch.int32)  # draft 2 of request 0 is its own parent
    d = torch.tensor([1, 2, 0, 3, 1], dtype=torch.int32)
    for host in (True, False):
        monkeypatch.setattr(vllm_tree, "HOST_FORM", host)
        with pytest.raises(ValueError, match=r"draft_parents\[2\] must be -1 or a local draft index in \[0, 2\)"):
            vllm.tree_rejection_sample(d, bad, [3, 2], 3, torch.tensor([3, 5]), None, torch.full((7, 4), 0.25),
                                       torch.zeros(2))


def test_tree_errors():
    d = torch.tensor([1, 2, 0], dtype=torch.int32)
    cu = torch.tensor([2, 3], dtype=torch.int32)
    p = torch.full((5, 4), 0.25)
    t = torch.zeros(2)
    f = vllm.tree_rejection_sample
    with pytest.raises(ValueError, match=r"draft_parents\[1\] must be -1 or a local draft index in \[0, 1\)"):
        f(d, torch.tensor([-1, 1, -1]), [2, 1], 2, cu, None, p, t)
    with pytest.raises(ValueError, match=r"target_probs must be of shape \[5, \*\]"):
        f(d, torch.tensor([-1, 0, -1]), [2, 1], 2, cu, None, p[:3], t)
    meta = SimpleNamespace(temperature=t, all_greedy=False, all_random=False, generators={7: _gen(0)})
    with pytest.raises(ValueError, match=r"generators must be keyed by batch indices in \[0, 2\)"):
        f(d, torch.tensor([-1, 0, -1]), [2, 1], 2, cu, None, p, meta)
    kv = [torch.zeros(2, 4, 1, 1, 2)]
    with pytest.raises(ValueError, match=r"commit_accepted_kv_slots: slot_mapping must be slots in \[0, 4\)"):
        vllm.commit_accepted_kv_slots(kv, torch.tensor([0, 9]), torch.tensor([0, 2]), torch.tensor([[0, 1]]),
                                      torch.tensor([1]))
    with pytest.raises(ValueError, match="accepted must be node indices below"):
        vllm.commit_accepted_kv_slots(kv, torch.tensor([0, 1, 2]), torch.tensor([0, 3]), torch.tensor([[0, 1, 3]]),
                                      torch.tensor([2]))
    with pytest.raises(ValueError, match=r"kv_caches\[0\] must be \[2, num_blocks"):
        vllm.commit_accepted_kv([torch.zeros(3, 4, 1, 1, 2)], torch.zeros(1, 2, dtype=torch.int32),
                                torch.tensor([0]), torch.tensor([0]), torch.tensor([[0]]), torch.tensor([0]))
