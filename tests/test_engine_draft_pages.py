"""A draft model's K/V in the target's paged pool (specdec.draft_pages): one budget for both, the same
blocks and rows, prefix-cached blocks valid for the draft, shared blocks never written by it."""
from __future__ import annotations

import random
from typing import Dict, List

import pytest
import torch

from conftest import tiny_llama
from specdec import DraftModel, Engine, HFCausalLM, MultiDraft, PagedKVCache, PromptLookup, RequestParams
from specdec.cache import StaticKVCache
from specdec.draft_pages import DraftPages, DraftPagesView

V = 97


def _llama(seed: int, layers: int = 2, noise: float = 0.0) -> HFCausalLM:
    return tiny_llama(seed, layers, noise, V)


@pytest.fixture(scope="module")
def lms():
    return _llama(0), _llama(0, noise=0.02)


def _prompts(n: int, seed: int, shared: int) -> List[List[int]]:
    rng = random.Random(seed)
    prefix = [rng.randrange(V) for _ in range(shared)]
    return [prefix + [rng.randrange(V) for _ in range(rng.randint(1, 20))] for _ in range(n)]


def _run(eng: Engine, jobs) -> Dict[object, List[int]]:
    out: Dict[object, List[int]] = {job[0]: [] for job in jobs}
    for job in jobs:
        eng.add_request(*job)
    steps = 0
    while eng.has_unfinished():
        for d in eng.step():
            out[d.request_id].extend(d.new_tokens)
        steps += 1
        assert steps < 2000
    return out


def test_draft_lives_in_the_target_pool(lms):
    target, weak = lms
    dm = DraftModel(weak, k=3)
    eng = Engine(target, dm, max_batch=4, max_len=128)
    assert isinstance(dm.cache, DraftPagesView)
    pages = dm.cache.pages
    assert pages.block_tables is eng.kv.cache.block_tables and pages.allocator is eng.kv.allocator
    assert pages.k_pages[0].shape[0] == eng.kv.cache.k_pages[0].shape[0]     # the same block ids (+ scratch)
    assert len(pages.k_pages) == weak.num_layers
    # one budget: kv_memory covers target + draft blocks
    per_t = PagedKVCache.bytes_per_block(target.num_layers, target.num_kv_heads, target.head_dim, 16, target.dtype)
    per_d = pages.bytes_per_block()
    budget = 64 * (per_t + per_d)
    eng2 = Engine(target, DraftModel(weak, k=3), max_batch=4, max_len=128, kv_memory=budget)
    st = eng2.stats()
    assert st["kv_blocks_total"] == 63 and st["draft_kv_bytes_per_block"] == per_d
    assert st["kv_bytes_per_block"] == per_t
    assert eng2.kv.cache.nbytes + eng2.drafter.cache.nbytes() <= budget
    # a dense engine keeps the draft's own cache; the same drafter object re-binds to it
    eng3 = Engine(target, dm, max_batch=2, max_len=64, kv_cache="dense")
    assert isinstance(dm.cache, StaticKVCache) and eng3.drafter is dm
    with pytest.raises(TypeError, match="DraftPages: pages must be a specdec.PagedKVCache"):
        DraftPages(object(), 1, 2, 16)


@pytest.mark.parametrize("temperature", [0.0, 0.9], ids=["greedy", "sampled"])
def test_prefix_reuse_with_draft_equals_cold_run(lms, temperature):
    """A request served from cached prefix blocks (target AND draft K/V) gives the cold run's tokens and the
    cold run's acceptance: the draft's K/V in the shared blocks is what its own prefill would have written.
    Sampled: the same request and draft generators, so any change in the draft's q would show."""
    target, weak = lms
    prompts = _prompts(2, 2, shared=70)
    params = RequestParams(max_new_tokens=20, temperature=temperature)

    def job(rid, prompt):
        return [(rid, prompt, params, None if temperature == 0 else torch.Generator().manual_seed(11))]

    cold = Engine(target, DraftModel(weak, k=3), max_batch=2, max_len=128, policy="fixed", draft_seed=3)
    want = _run(cold, job("b", prompts[1]))
    cold_acc = cold.stats()["accepted_tokens"]
    warm = Engine(target, DraftModel(weak, k=3), max_batch=2, max_len=128, policy="fixed", draft_seed=3)
    _run(warm, job("a", prompts[0]))
    warm.draft_generator.manual_seed(3)   # the draft samples as in the cold run
    before = warm.stats()["accepted_tokens"]
    assert _run(warm, job("b", prompts[1])) == want
    st = warm.stats()
    assert st["prefix_hit_tokens"] == 64
    assert st["accepted_tokens"] - before == cold_acc
    assert cold_acc > 0  # the comparison says something only if the draft is ever accepted


def test_prefix_from_a_request_that_never_drafted(lms):
    """The first request finishes at its first token (its draft never runs: no draft prefill, its blocks'
    draft K/V never written); a second request sharing its blocks writes their draft part itself and
    gives the cold run's tokens and acceptance (sampled: any change in the draft's q would show); a third
    then reuses the now valid draft blocks."""
    target, weak = lms
    prompts = _prompts(3, 8, shared=70)
    params = RequestParams(max_new_tokens=20, temperature=0.9)

    def eng():
        return Engine(target, DraftModel(weak, k=3), max_batch=2, max_len=128, policy="fixed", draft_seed=3)

    def job(rid, prompt):
        return [(rid, prompt, params, torch.Generator().manual_seed(11))]

    cold = {}
    for rid in ("b", "c"):
        e = eng()
        out = _run(e, job(rid, prompts[1 if rid == "b" else 2]))
        cold[rid] = (out, e.stats()["accepted_tokens"])
    warm = eng()
    _run(warm, [("a", prompts[0], RequestParams(max_new_tokens=1))])
    pages = warm.drafter.cache.pages
    assert all(not k.any() for k in pages.k_pages)       # lazy: the draft wrote nothing
    alloc = warm.kv.allocator
    shared = alloc.cached_blocks()[:4]                    # a's 4 full prompt blocks (70 shared tokens)
    for rid, p in (("b", prompts[1]), ("c", prompts[2])):
        before = warm.stats()["accepted_tokens"]
        warm.draft_generator.manual_seed(3)
        assert _run(warm, job(rid, p)) == cold[rid][0]
        assert warm.stats()["accepted_tokens"] - before == cold[rid][1]
        # from b on, the shared blocks' draft part is valid (c's catch-up starts after them)
        assert all(pages._valid.get(blk) == alloc.serial_of(blk) is not None for blk in shared)
    assert warm.stats()["prefix_hit_tokens"] == 2 * 64


def test_shared_blocks_draft_pages_never_written(lms):
    """Requests drafting with a draft model over shared prefix blocks leave the draft's K/V of those blocks
    bit-identical, and greedy outputs equal the dense engine's."""
    target, weak = lms
    prompts = _prompts(4, 5, shared=48)
    eng = Engine(target, DraftModel(weak, k=4), max_batch=4, max_len=128)
    _run(eng, [(0, prompts[0], RequestParams(max_new_tokens=4))])
    cached = eng.kv.allocator.cached_blocks()
    assert len(cached) >= 3
    pages = eng.drafter.cache.pages
    before = [(k[cached].clone(), v[cached].clone()) for k, v in zip(pages.k_pages, pages.v_pages)]
    jobs = [(i, p, RequestParams(max_new_tokens=30)) for i, p in enumerate(prompts[1:], 1)]
    got = _run(eng, jobs)
    assert eng.stats()["prefix_hit_tokens"] >= 3 * 48
    for (k0, v0), k, v in zip(before, pages.k_pages, pages.v_pages):
        assert torch.equal(k0, k[cached]) and torch.equal(v0, v[cached])
    assert got == _run(Engine(target, DraftModel(weak, k=4), max_batch=4, max_len=128, kv_cache="dense"), jobs)


def test_multidraft_members_share_the_pool(lms):
    """Two draft models and prompt lookup in one MultiDraft: each draft model has pools of its own over the
    target's blocks; outputs equal the dense engine's under preemption in a small pool."""
    target, weak = lms
    weak2 = _llama(2, layers=1)   # a weak one-layer draft

    def make():
        return MultiDraft([DraftModel(weak, k=2), DraftModel(weak2, k=2, top_k=2), PromptLookup(k=3)])

    prompts = _prompts(6, 6, shared=20)
    jobs = [(i, p, RequestParams(max_new_tokens=24)) for i, p in enumerate(prompts)]
    md = make()
    eng = Engine(target, md, max_batch=6, max_len=96, num_blocks=16, block_size=8)
    a, b = md.members[0].cache.pages, md.members[1].cache.pages
    assert a is not b and a.block_tables is b.block_tables is eng.kv.cache.block_tables
    got = _run(eng, jobs)
    assert got == _run(Engine(target, make(), max_batch=6, max_len=96, kv_cache="dense"), jobs)
    st = eng.stats()
    assert st["preemptions"] > 0 and st["kv_blocks_used"] == 0
    assert st["draft_kv_bytes_per_block"] == a.bytes_per_block() + b.bytes_per_block()
    eng.kv.allocator.check()
