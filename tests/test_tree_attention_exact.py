"""A tree node's attention equals its decode step's, bit for bit, on the CPU.

In a tree pass a node sees the prefix and its ancestors, which sit among its siblings' slots; a decode
step (or a chain) sees the same keys at consecutive positions. verify_attention (dense and paged) lays a
node's visible keys out in the decode step's order and blocks, so both give the same bits -- what keeps
greedy tree speculation token-exact, most visibly with quantized activations, where an activation one
rounding step off can move a code and the logits by far more. Checked here for random trees, prefix
lengths around the 64-key block, trees past one key block, GQA / MQA / MHA, head dims over 64, every
float dtype, the frontier form (Nkv > N) and paged caches.
"""
from __future__ import annotations

import pytest
import torch

from specdec import ops, paged_ops

from conftest import gen


def random_tree(N: int, g: torch.Generator):
    """Parents of a topological tree (node 0 the root), and its ancestor mask [N, N] (self included)."""
    parents = [-1] + [int(torch.randint(0, i, (1,), generator=g)) for i in range(1, N)]
    mask = torch.zeros(N, N, dtype=torch.bool)
    for n in range(N):
        a = n
        while a >= 0:
            mask[n, a] = True
            a = parents[a]
    return parents, mask


def decode_step(q_node, k_cache, v_cache, L, path_k, path_v, scale):
    """The node's attention as a decode step: its ancestors and itself at L, L + 1, ... (no mask)."""
    kc, vc = k_cache.clone(), v_cache.clone()
    m = path_k.shape[2]
    kc[:, :, L:L + m], vc[:, :, L:L + m] = path_k, path_v
    lens = torch.tensor([L + m - 1], dtype=torch.int32)
    return ops.verify_attention(q_node, kc, vc, lens, None, scale)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("heads", [(9, 3), (4, 4), (8, 1)])
@pytest.mark.parametrize("D", [64, 96])
def test_tree_nodes_equal_their_decode_steps(dtype, heads, D):
    Hq, Hkv = heads
    g = gen(Hq * 7 + D + {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}[dtype])
    S = 320
    bad = []
    for L, N in ((0, 5), (1, 12), (60, 12), (63, 7), (64, 12), (100, 70), (127, 30), (190, 12)):
        kc = torch.randn(1, Hkv, S, D, generator=g).to(dtype)
        vc = torch.randn(1, Hkv, S, D, generator=g).to(dtype)
        parents, mask = random_tree(N, g)
        q = torch.randn(1, N, Hq, D, generator=g).to(dtype)
        kn = torch.randn(1, Hkv, N, D, generator=g).to(dtype)
        vn = torch.randn(1, Hkv, N, D, generator=g).to(dtype)
        k2, v2 = kc.clone(), vc.clone()
        k2[:, :, L:L + N], v2[:, :, L:L + N] = kn, vn
        lens = torch.tensor([L], dtype=torch.int32)
        tree = ops.verify_attention(q, k2, v2, lens, mask[None], 0.125)
        for n in range(N):
            path = [j for j in range(N) if mask[n, j]]  # ancestors in slot (= depth) order, then n
            one = decode_step(q[:, n:n + 1], kc, vc, L, kn[:, :, path], vn[:, :, path], 0.125)
            if not torch.equal(tree[:, n:n + 1], one):
                bad.append((L, N, n))
    assert not bad, f"tree rows differ from their decode steps at (L, N, node): {bad[:8]}"


def test_the_frontier_form():
    """A frontier (the last N of Nkv new nodes query) gives each node its decode step's bits."""
    g = gen(11)
    Hq, Hkv, D, S, L, Nkv, N = 6, 2, 64, 256, 70, 20, 8
    kc = torch.randn(1, Hkv, S, D, generator=g)
    vc = torch.randn(1, Hkv, S, D, generator=g)
    parents, full = random_tree(Nkv, g)
    q = torch.randn(1, N, Hq, D, generator=g)
    kn, vn = torch.randn(1, Hkv, Nkv, D, generator=g), torch.randn(1, Hkv, Nkv, D, generator=g)
    k2, v2 = kc.clone(), vc.clone()
    k2[:, :, L:L + Nkv], v2[:, :, L:L + Nkv] = kn, vn
    lens = torch.tensor([L], dtype=torch.int32)
    out = ops.verify_attention(q, k2, v2, lens, full[None, Nkv - N:], 0.125)
    for i in range(N):
        n = Nkv - N + i
        path = [j for j in range(Nkv) if full[n, j]]
        one = decode_step(q[:, i:i + 1], kc, vc, L, kn[:, :, path], vn[:, :, path], 0.125)
        assert torch.equal(out[:, i:i + 1], one), i


@pytest.mark.parametrize("page_size", [1, 16, 64])
def test_paged_tree_nodes_equal_their_decode_steps(page_size):
    g = gen(page_size)
    Hq, Hkv, D, L, N = 9, 3, 64, 61, 12
    pages = (L + N + page_size - 1) // page_size + 2
    kp = torch.randn(pages, page_size, Hkv, D, generator=g)
    vp = torch.randn(pages, page_size, Hkv, D, generator=g)
    table = torch.randperm(pages, generator=g)[None, : (L + N + page_size - 1) // page_size].to(torch.int32)
    parents, mask = random_tree(N, g)
    q = torch.randn(1, N, Hq, D, generator=g)
    lens = torch.tensor([L], dtype=torch.int32)
    tree = paged_ops.verify_attention_paged(q, kp, vp, table, lens, mask[None], 0.125)
    # the same keys as a dense cache [1, Hkv, S, D]
    pos = torch.arange(L + N)
    phys = table[0, pos // page_size].long() * page_size + pos % page_size
    kd = kp.reshape(-1, Hkv, D)[phys].permute(1, 0, 2)[None]
    vd = vp.reshape(-1, Hkv, D)[phys].permute(1, 0, 2)[None]
    pad = torch.zeros(1, Hkv, N + 8, D)
    kc, vc = torch.cat((kd[:, :, :L], pad), 2), torch.cat((vd[:, :, :L], pad), 2)
    for n in range(N):
        path = [L + j for j in range(N) if mask[n, j]]
        one = decode_step(q[:, n:n + 1], kc, vc, L, kd[:, :, path], vd[:, :, path], 0.125)
        assert torch.equal(tree[:, n:n + 1], one), n
