"""BlockAllocator and PagedKVCache: refcounts, no leaks, fork semantics, the ops through the cache."""
from __future__ import annotations

import random

import pytest
import torch

from specdec import ops, paged_ops
from specdec.paged_cache import BlockAllocator, OutOfBlocks, PagedKVCache

from conftest import gen


def test_allocator_no_leak_random_sequences():
    """1,000 random add / grow / abort / finish / fork / truncate sequences: invariants after every
    step, and every block back in the free list at the end."""
    rng = random.Random(0)
    for seq in range(1000):
        a = BlockAllocator(rng.randint(1, 24))
        live, next_id = [], 0
        for _ in range(rng.randint(1, 30)):
            op = rng.random()
            if op < 0.3 or not live:
                a.add(next_id)
                live.append(next_id)
                next_id += 1
                try:
                    a.allocate(live[-1], rng.randint(0, 6))
                except OutOfBlocks:
                    pass
            elif op < 0.5:
                rid = rng.choice(live)
                free_before = a.num_free
                n = rng.randint(0, 4)
                try:
                    a.allocate(rid, n)
                except OutOfBlocks:
                    assert a.num_free == free_before and n > free_before  # all or nothing
            elif op < 0.65:
                parent = rng.choice(live)
                a.fork(parent, next_id, rng.randint(0, len(a.blocks(parent))))
                live.append(next_id)
                next_id += 1
            elif op < 0.75:
                rid = rng.choice(live)
                a.truncate(rid, rng.randint(0, len(a.blocks(rid))))
            else:  # finish or abort: the same release
                rid = live.pop(rng.randrange(len(live)))
                a.free(rid)
            a.check()
        for rid in live:
            a.free(rid)
        a.check()
        assert a.num_free == a.num_blocks and a.requests() == [], seq


def test_allocator_refcounts_and_errors():
    a = BlockAllocator(4)
    a.add("x")
    assert a.allocate("x", 3) == [0, 1, 2]
    a.fork("x", "y", 2)
    assert [a.refcount(b) for b in range(4)] == [2, 2, 1, 0]
    a.free("x")
    assert a.num_free == 2 and a.blocks("y") == [0, 1]
    with pytest.raises(OutOfBlocks, match=r"BlockAllocator.allocate: request 'y' needs 3 blocks, 2 of 4 are free"):
        a.allocate("y", 3)
    with pytest.raises(KeyError, match=r"BlockAllocator.free: request 'x' is not registered"):
        a.free("x")
    with pytest.raises(ValueError, match=r"BlockAllocator.add: request 'y' is already registered"):
        a.add("y")
    with pytest.raises(ValueError, match=r"BlockAllocator: num_blocks must be an int >= 1, got 0"):
        BlockAllocator(0)
    a.free("y")
    a.check()
    assert a.num_free == 4


def test_paged_cache_grow_free_fork():
    c = PagedKVCache(2, 2, 64, num_blocks=10, block_size=4, max_requests=3, max_blocks_per_request=5)
    r0 = c.add("a", 6)
    assert c.allocator.blocks("a") == [0, 1] and c.block_tables[r0, :2].tolist() == [0, 1]
    c.cache_lens[r0] = 6
    for p in c.k_pages + c.v_pages:
        p[1].fill_(7.0)
    r1 = c.fork("a", "b")
    # block 0 (full) shared, block 1 (partial: positions 4, 5) copied into the child's own block
    assert c.allocator.refcount(0) == 2 and c.block_tables[r1, 0] == 0 and c.block_tables[r1, 1] != 1
    assert c.length("b") == 6 and torch.equal(c.k_pages[1][int(c.block_tables[r1, 1])], c.k_pages[1][1])
    c.grow("b", 20)
    assert len(c.allocator.blocks("b")) == 5
    with pytest.raises(ValueError, match=r"PagedKVCache.grow: length must be an int in \[0, 20\], got 21"):
        c.grow("b", 21)
    with pytest.raises(OutOfBlocks):
        c.add("c", 20)  # 10 - 2 - 4 = 4 free blocks, 5 needed: nothing kept
    assert "c" not in c.allocator and c.allocator.num_free == 4
    c.free("a")
    c.free("b")
    c.allocator.check()
    assert c.allocator.num_free == 10 and (c.block_tables == -1).all()
    assert PagedKVCache.bytes_per_block(2, 2, 64, 4) * 10 == c.nbytes


def test_paged_cache_runs_the_ops():
    """A decode step through PagedKVCache (append, verify, commit) matches the dense cache."""
    g = gen(21)
    L, H, D, B, N, S = 2, 2, 64, 2, 4, 64
    c = PagedKVCache(L, H, D, num_blocks=24, block_size=16, max_requests=B + 1, max_blocks_per_request=4)
    dk = [torch.zeros(B, H, S, D) for _ in range(L)]
    dv = [torch.zeros(B, H, S, D) for _ in range(L)]
    dlens = torch.tensor([9, 30], dtype=torch.int32)
    c.add("other", 16)  # interleave another request's block so the rows are not contiguous
    for b, n in enumerate(dlens.tolist()):
        c.add(b, 30 + N)
    c.free("other")
    rows = c.rows([0, 1])
    c.cache_lens[rows] = dlens
    tables, lens = c.block_tables[rows], c.cache_lens[rows].clone()
    prompt = [torch.randn(B, H, 30, D, generator=g) for _ in range(2 * L)]
    zero = torch.zeros(B, dtype=torch.int32)
    for layer in range(L):
        for b in range(B):  # prefix K/V
            n = int(dlens[b])
            dk[layer][b, :, :n] = prompt[2 * layer][b, :, :n]
            dv[layer][b, :, :n] = prompt[2 * layer + 1][b, :, :n]
        paged_ops.append_kv_paged(c.k_pages[layer], c.v_pages[layer], dk[layer][:, :, :30].contiguous(),
                                  dv[layer][:, :, :30].contiguous(), tables, zero)
    kn = torch.randn(B, H, N, D, generator=g)
    q = torch.randn(B, N, 2 * H, D, generator=g)
    for layer in range(L):
        ops.append_kv(dk[layer], dv[layer], kn, kn, dlens)
        paged_ops.append_kv_paged(c.k_pages[layer], c.v_pages[layer], kn, kn, tables, lens)
        want = ops.verify_attention(q, dk[layer], dv[layer], dlens)
        got = paged_ops.verify_attention_paged(q, c.k_pages[layer], c.v_pages[layer], tables, lens)
        assert torch.equal(got, want)
    accepted = torch.tensor([[0, 2, 3, -1], [0, 1, -1, -1]], dtype=torch.int32)
    num = torch.tensor([2, 1], dtype=torch.int32)
    ops.kv_commit(dk, dv, dlens, accepted, num)
    paged_ops.kv_commit_paged(c.k_pages, c.v_pages, tables, lens, accepted, num)
    assert torch.equal(lens, dlens)
    q1 = torch.randn(B, 1, 2 * H, D, generator=g)
    for layer in range(L):
        want = ops.verify_attention(q1, dk[layer], dv[layer], dlens - 1)
        got = paged_ops.verify_attention_paged(q1, c.k_pages[layer], c.v_pages[layer], tables, lens - 1)
        assert torch.equal(got, want)


def test_allocator_prefix_keys_park_share_and_evict():
    a = BlockAllocator(4)
    a.add("x")
    b0, b1 = a.allocate("x", 2)
    s0 = a.register(b0, (0, (1, 2)))
    s1 = a.register(b1, (s0, (3, 4)))
    assert a.register(b1, "other") == s1          # a keyed block keeps its key
    assert a.lookup((0, (1, 2))) == (b0, s0) and a.lookup((s0, (3, 4))) == (b1, s1)
    a.free("x")                                   # keyed blocks are parked, not freed, and count as free
    assert a.num_free == 4 and a.num_parked == 2 and a.num_used == 0 and a.cached_blocks() == sorted([b0, b1])
    a.check()
    a.add("y")
    a.share("y", [b0])                            # taken back from the parked set
    assert a.refcount(b0) == 1 and a.num_parked == 1
    a.allocate("y", 2)                            # the two never-used blocks first: nothing evicted
    assert a.evictions == 0 and a.lookup((s0, (3, 4))) is not None
    a.allocate("y", 1)                            # then the least recently parked block is evicted
    assert a.evictions == 1 and a.lookup((s0, (3, 4))) is None and a.blocks("y")[-1] == b1
    with pytest.raises(OutOfBlocks):
        a.allocate("y", 1)
    with pytest.raises(ValueError, match="carries no prefix key"):
        a.share("y", [a.blocks("y")[1]])
    a.check()
    a.free("y")
    assert a.num_free == 4 and a.num_cached == 1
    a.check()


def test_allocator_prefix_random_sequences_keep_invariants():
    """Random allocate / register / share / free sequences: invariants after every change; at the end every
    block is free or parked, and a key always names a block that holds it."""
    rng = random.Random(1)
    for seq in range(300):
        a = BlockAllocator(rng.randint(2, 12))
        live, next_id, keys = [], 0, []
        for _ in range(rng.randint(1, 40)):
            op = rng.random()
            if op < 0.3 or not live:
                a.add(next_id)
                live.append(next_id)
                next_id += 1
                hits = [a.lookup(k)[0] for k in rng.sample(keys, min(len(keys), 2)) if a.lookup(k) is not None]
                a.share(live[-1], list(dict.fromkeys(hits)))
            elif op < 0.55:
                try:
                    a.allocate(rng.choice(live), rng.randint(0, 3))
                except OutOfBlocks:
                    pass
            elif op < 0.75:
                rid = rng.choice(live)
                if a.blocks(rid):
                    key = (rng.randint(0, 3), rng.randint(0, 3))
                    blk = rng.choice(a.blocks(rid))
                    a.register(blk, key)
                    keys.append(key)
            else:
                a.free(live.pop(rng.randrange(len(live))))
            a.check()
            for k in keys:
                found = a.lookup(k)
                assert found is None or found[0] in a.cached_blocks()
        for rid in live:
            a.free(rid)
        a.check()
        assert a.num_used == 0 and a.num_free == a.num_blocks, seq
