"""kv_commit against specdec.reference (CPU always, CUDA when present).

kv_commit only moves bytes, so the caches after it must be BITWISE equal to the
reference's (whole caches compared, every layer, K and V), and cache_lens exactly
lens + num_accepted + 1. Cache contents are random (all rows distinct), so any wrong
source, wrong order of overlapping moves, or stray write shows up.
"""
from __future__ import annotations

from typing import List, Tuple

import pytest
import torch

from specdec import ops, reference

from conftest import DEVICES, FLOAT_DTYPES, children_of, gen, make_trees

B7, N13 = 7, 13


def random_paths(parents: torch.Tensor, *, g: torch.Generator, p_stop: float = 0.15,
                 force: str = "") -> Tuple[torch.Tensor, torch.Tensor]:
    """A random root path per request (what a verifier could accept), -1 padded."""
    B, N = parents.shape
    accepted = torch.full((B, N), -1, dtype=torch.int32)
    num = torch.zeros(B, dtype=torch.int32)
    for b in range(B):
        node, path = 0, [0]
        while force != "zero":
            kids = children_of(parents[b].tolist(), node)
            if not kids or (force != "full" and float(torch.rand(1, generator=g)) < p_stop):
                break
            node = kids[int(torch.randint(0, len(kids), (1,), generator=g))]
            path.append(node)
        accepted[b, : len(path)] = torch.tensor(path, dtype=torch.int32)
        num[b] = len(path) - 1
    return accepted, num


def make_caches(L, B, Hkv, S, D, dtype, *, g) -> Tuple[List[torch.Tensor], List[torch.Tensor]]:
    ks = [torch.randn(B, Hkv, S, D, generator=g).to(dtype) for _ in range(L)]
    vs = [torch.randn(B, Hkv, S, D, generator=g).to(dtype) for _ in range(L)]
    return ks, vs


def check_commit(device, k_caches, v_caches, lens, accepted, num) -> None:
    """Run the kernel and the reference on copies; compare everything."""
    want_k = [c.clone() for c in k_caches]
    want_v = [c.clone() for c in v_caches]
    want_lens = lens.clone()
    reference.kv_commit(want_k, want_v, want_lens, accepted, num)
    ks = [c.to(device, copy=True) for c in k_caches]  # copy: .to("cpu") would alias the originals
    vs = [c.to(device, copy=True) for c in v_caches]
    cl = lens.to(device, copy=True)
    ops.kv_commit(ks, vs, cl, accepted.to(device), num.to(device))
    assert torch.equal(cl.cpu(), lens + num + 1)
    assert torch.equal(cl.cpu(), want_lens)
    N = accepted.shape[1]
    for name, got_l, want_l, orig_l in (("k", ks, want_k, k_caches), ("v", vs, want_v, v_caches)):
        for layer, (got, want, orig) in enumerate(zip(got_l, want_l, orig_l)):
            got = got.cpu()
            for b in range(lens.shape[0]):
                L, n = int(lens[b]), int(num[b])
                # the accepted path, root included, is now contiguous at L .. L + n
                src = (L + accepted[b, : n + 1].long()).tolist()
                assert torch.equal(got[b, :, L: L + n + 1], orig[b, :, src]), \
                    f"{name}_caches[{layer}] request {b}: accepted path not compacted"
                # nothing outside the verified window [L, L + N) is touched
                assert torch.equal(got[b, :, :L], orig[b, :, :L]), f"{name}_caches[{layer}][{b}] prefix touched"
                assert torch.equal(got[b, :, L + N:], orig[b, :, L + N:]), \
                    f"{name}_caches[{layer}][{b}] past the window touched"
            # whole cache, bitwise, as the reference leaves it (the stale tail L+n+1 .. L+N too)
            assert torch.equal(got, want), f"{name}_caches[{layer}] differs from the reference"


def _lens(B, S, N, g):
    lens = torch.randint(0, S - N + 1, (B,), generator=g, dtype=torch.int32)
    lens[0], lens[1] = 0, S - N
    if B > 2:
        lens[2] = 1
    return lens


@pytest.mark.parametrize("path", ["chain", "chain_full", "tree", "tree_deep", "zero"])
@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
@pytest.mark.parametrize("device", DEVICES)
def test_kv_commit_matches_reference(device, dtype, path):
    g = gen(40 + len(path))
    L, Hkv, D, S = 3, 2, 80, 48
    kind = {"chain": "chain", "chain_full": "chain", "tree": "random", "tree_deep": "deep", "zero": "mixed"}[path]
    _, parents, _ = make_trees(B7, N13, 5, kind, g=g, ragged=False)
    force = {"chain_full": "full", "tree_deep": "full", "zero": "zero"}.get(path, "")
    accepted, num = random_paths(parents, g=g, force=force)
    if path == "zero":
        assert int(num.max()) == 0
    if path.startswith("tree"):
        skips = (accepted[:, 1:] > accepted[:, :-1] + 1) & (accepted[:, 1:] >= 0)
        assert bool(skips.any()), "the tree paths must skip nodes (real moves)"
    k, v = make_caches(L, B7, Hkv, S, D, dtype, g=g)
    check_commit(device, k, v, _lens(B7, S, N13, g), accepted, num)


@pytest.mark.parametrize("device", DEVICES)
def test_kv_commit_overlapping_moves(device):
    """Paths whose moves overlap (dest i <- src i + 1, ...): a copy order that overwrites a
    source before reading it (e.g. descending, or unordered parallel copies within a
    request) fails here."""
    g = gen(41)
    N, S = 8, 24
    accepted = torch.tensor([[0, 2, 3, 4, 5, 6, 7, -1],    # shift by one
                             [0, 1, 3, 4, -1, -1, -1, -1],  # identity then shift
                             [0, 7, -1, -1, -1, -1, -1, -1],
                             [0, 1, 2, 3, 4, 5, 6, 7],      # full chain: identity
                             [0, 3, 5, 6, 7, -1, -1, -1]], dtype=torch.int32)
    num = (accepted >= 0).sum(1).to(torch.int32) - 1
    B = accepted.shape[0]
    k, v = make_caches(2, B, 3, S, 64, torch.float32, g=g)
    lens = torch.tensor([0, 5, S - N, 3, 16], dtype=torch.int32)
    check_commit(device, k, v, lens, accepted, num)


@pytest.mark.parametrize("device", DEVICES)
def test_kv_commit_from_verifier_outputs(device):
    """The real producer: greedy_verify's (accepted, num_accepted) on random trees."""
    g = gen(42)
    B, N, V, S = B7, N13, 17, 40
    tokens, parents, _ = make_trees(B, N, V, "mixed", g=g, ragged=True)
    logits = torch.randn(B, N, V, generator=g)
    best = logits.argmax(-1)
    tokens = torch.where(parents >= 0, torch.gather(best, 1, parents.clamp(min=0).long()), tokens)
    accepted, num, _ = ops.greedy_verify(tokens.to(device), parents.to(device), logits.to(device))
    accepted, num = accepted.cpu(), num.cpu()
    assert int(num.max()) >= 2
    k, v = make_caches(4, B, 2, S, 64, torch.bfloat16, g=g)
    check_commit(device, k, v, _lens(B, S, N, g), accepted, num)


@pytest.mark.parametrize("device", DEVICES)
def test_kv_commit_heterogeneous_layers(device):
    """Layers only have to share B, S and dtype (csrc/checks.cpp): KV heads and head dims may
    differ per layer and between K and V (e.g. MLA-style caches)."""
    g = gen(43)
    B, N, S = 5, 9, 32
    _, parents, _ = make_trees(B, N, 5, "random", g=g, ragged=True)
    accepted, num = random_paths(parents, g=g)
    shapes_k = [(2, 64), (1, 128), (4, 80)]
    shapes_v = [(2, 96), (1, 128), (4, 16)]
    k = [torch.randn(B, h, S, d, generator=g).half() for h, d in shapes_k]
    v = [torch.randn(B, h, S, d, generator=g).half() for h, d in shapes_v]
    check_commit(device, k, v, _lens(B, S, N, g), accepted, num)


@pytest.mark.parametrize("device", DEVICES)
def test_kv_commit_many_layers(device):
    """70 layers = 140 caches: more than one launch's worth on CUDA (64 layers per launch)."""
    g = gen(47)
    B, N, S = 3, 6, 20
    _, parents, _ = make_trees(B, N, 5, "random", g=g)
    accepted, num = random_paths(parents, g=g, force="full")
    k, v = make_caches(70, B, 1, S, 64, torch.bfloat16, g=g)
    check_commit(device, k, v, _lens(B, S, N, g), accepted, num)


@pytest.mark.parametrize("device", DEVICES)
def test_kv_commit_misaligned_caches(device):
    """Contiguous caches whose data pointer is not 16-byte aligned (views into a buffer)."""
    from test_ops_attention import misaligned

    g = gen(48)
    _, parents, _ = make_trees(B7, N13, 5, "random", g=g)
    accepted, num = random_paths(parents, g=g, force="full")
    k, v = make_caches(2, B7, 2, 40, 80, torch.float16, g=g)
    want_k, want_v, want_l = [c.clone() for c in k], [c.clone() for c in v], _lens(B7, 40, N13, g)
    lens = want_l.clone()
    reference.kv_commit(want_k, want_v, want_l, accepted, num)
    ks = [misaligned(c.to(device)) for c in k]
    vs = [misaligned(c.to(device)) for c in v]
    cl = lens.to(device, copy=True)
    ops.kv_commit(ks, vs, cl, accepted.to(device), num.to(device))
    assert torch.equal(cl.cpu(), want_l)
    for a, b in zip(ks + vs, want_k + want_v):
        assert torch.equal(a.cpu(), b)


@pytest.mark.parametrize("device", DEVICES)
def test_kv_commit_single_layer_single_request(device):
    g = gen(44)
    k, v = make_caches(1, 1, 1, 16, 64, torch.float32, g=g)
    accepted = torch.tensor([[0, 2, 3, -1]], dtype=torch.int32)
    check_commit(device, k, v, torch.tensor([7], dtype=torch.int32), accepted, torch.tensor([2], dtype=torch.int32))


@pytest.mark.parametrize("device", DEVICES)
def test_kv_commit_does_not_modify_accepted_or_num(device):
    g = gen(45)
    _, parents, _ = make_trees(B7, N13, 5, "random", g=g)
    accepted, num = random_paths(parents, g=g)
    k, v = make_caches(2, B7, 2, 40, 64, torch.float16, g=g)
    a, n = accepted.to(device), num.to(device)
    ops.kv_commit([c.to(device) for c in k], [c.to(device) for c in v], _lens(B7, 40, N13, g).to(device), a, n)
    assert torch.equal(a.cpu(), accepted) and torch.equal(n.cpu(), num)


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
@pytest.mark.parametrize("device", DEVICES)
def test_two_decode_steps_pipeline(device, dtype):
    """append_kv -> verify_attention -> greedy_verify -> kv_commit, twice, against the same
    pipeline run on the reference ops: caches and lengths bitwise equal after each step,
    and the second step's attention (over the compacted prefix) within the attention
    tolerance (see test_ops_attention.py)."""
    from test_ops_attention import assert_attention_close

    g = gen(46)
    B, N, Hq, Hkv, D, V, S, L = 5, 9, 4, 2, 64, 23, 64, 2
    lens0 = torch.tensor([0, 1, 20, 7, 40], dtype=torch.int32)
    k, v = make_caches(L, B, Hkv, S, D, dtype, g=g)
    ref_state = ([c.clone() for c in k], [c.clone() for c in v], lens0.clone())
    dev_state = ([c.to(device, copy=True) for c in k], [c.to(device, copy=True) for c in v],
                 lens0.to(device, copy=True))
    for step in range(2):
        tokens, parents, _ = make_trees(B, N, V, "mixed", g=g, ragged=True)
        logits = torch.randn(B, N, V, generator=g)
        best = logits.argmax(-1)
        tokens = torch.where(parents >= 0, torch.gather(best, 1, parents.clamp(min=0).long()), tokens)
        mask = reference.tree_attention_mask(parents)
        q = torch.randn(B, N, Hq, D, generator=g).to(dtype)
        new = [(torch.randn(B, Hkv, N, D, generator=g).to(dtype), torch.randn(B, Hkv, N, D, generator=g).to(dtype))
               for _ in range(L)]
        rk, rv, rl = ref_state
        dk, dv, dl = dev_state
        for layer in range(L):
            reference.append_kv(rk[layer], rv[layer], new[layer][0], new[layer][1], rl)
            ops.append_kv(dk[layer], dv[layer], new[layer][0].to(device), new[layer][1].to(device), dl)
            out = ops.verify_attention(q.to(device), dk[layer], dv[layer], dl, mask.to(device))
            assert_attention_close(out, q.to(device), rk[layer], rv[layer], rl, mask, D ** -0.5)
        r_acc, r_num, r_out = reference.greedy_verify(tokens, parents, logits)
        d_acc, d_num, d_out = ops.greedy_verify(tokens.to(device), parents.to(device), logits.to(device))
        assert torch.equal(d_acc.cpu(), r_acc) and torch.equal(d_num.cpu(), r_num) and torch.equal(d_out.cpu(), r_out)
        reference.kv_commit(rk, rv, rl, r_acc, r_num)
        ops.kv_commit(dk, dv, dl, d_acc, d_num)
        assert torch.equal(dl.cpu(), rl)
        for a, b in zip(dk + dv, rk + rv):
            assert torch.equal(a.cpu(), b)


@pytest.mark.parametrize("device", DEVICES)
def test_review_65_layers_odd_rows_strided_lens(device):
    """65 layers (two CUDA launches), rows of D * sizeof = 6 bytes (not a multiple of 16), and
    cache_lens a strided view (updated in place through its stride)."""
    g = gen(80)
    B, N, S = 3, 6, 20
    _, parents, _ = make_trees(B, N, 5, "random", g=g)
    accepted, num = random_paths(parents, g=g, force="full")
    k, v = make_caches(65, B, 2, S, 3, torch.float16, g=g)
    lens = _lens(B, S, N, g)
    want_k, want_v, want_lens = [c.clone() for c in k], [c.clone() for c in v], lens.clone()
    reference.kv_commit(want_k, want_v, want_lens, accepted, num)
    ks = [c.to(device, copy=True) for c in k]
    vs = [c.to(device, copy=True) for c in v]
    lens_buf = torch.zeros(2 * B, dtype=torch.int32, device=device)
    lens_view = lens_buf[::2]
    lens_view.copy_(lens)
    ops.kv_commit(ks, vs, lens_view, accepted.to(device), num.to(device))
    assert torch.equal(lens_view.cpu(), want_lens)
    assert not bool(lens_buf[1::2].any()), "kv_commit wrote between the strided lengths"
    for got, want in zip(ks + vs, want_k + want_v):
        assert torch.equal(got.cpu(), want)
