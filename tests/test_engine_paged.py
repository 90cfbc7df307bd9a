"""The Engine on a paged KV cache: outputs equal the dense engine's, prefix caching, preemption,
no leaked blocks, shared blocks never written. Small Llama models built from a config (seeded)."""
from __future__ import annotations

import random
from typing import Dict, List

import pytest
import torch
import transformers

from specdec import DraftModel, Engine, HFCausalLM, PromptLookup, RequestParams

from toy_lm import ToyLM

V = 97


def _llama(seed: int) -> HFCausalLM:
    torch.manual_seed(seed)
    cfg = transformers.LlamaConfig(vocab_size=V, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024)
    return HFCausalLM(transformers.LlamaForCausalLM(cfg).eval())


@pytest.fixture(scope="module")
def lms():
    return _llama(0), _llama(1)


def _prompts(n: int, seed: int, shared: int = 40) -> List[List[int]]:
    rng = random.Random(seed)
    prefix = [rng.randrange(V) for _ in range(shared)]
    return [prefix + [rng.randrange(V) for _ in range(rng.randint(1, 30))] for _ in range(n)]


def _run(eng: Engine, jobs, arrive_every: int = 1) -> Dict[object, List[int]]:
    """Add jobs [(id, prompt, params)] one every ``arrive_every`` steps; step to the end."""
    out: Dict[object, List[int]] = {rid: [] for rid, _, _ in jobs}
    pending = list(jobs)
    step = 0
    while pending or eng.has_unfinished():
        if pending and step % arrive_every == 0:
            eng.add_request(*pending.pop(0))
        for d in eng.step():
            out[d.request_id].extend(d.new_tokens)
        step += 1
        assert step < 2000
    return out


def _drafter(name: str, weak: HFCausalLM):
    return {"plain": None, "lookup": PromptLookup(ngram=2, k=4, min_ngram=1),
            "draft-tree": DraftModel(weak, k=3, top_k=2)}[name]


@pytest.mark.parametrize("name", ["plain", "lookup", "draft-tree"])
def test_paged_engine_equals_dense(lms, name):
    """Staggered arrivals, shared prefixes (cache hits), greedy: token-identical to the dense engine."""
    target, weak = lms
    jobs = [(i, p, RequestParams(max_new_tokens=24)) for i, p in enumerate(_prompts(7, 1))]
    dense = _run(Engine(target, _drafter(name, weak), max_batch=4, max_len=128, kv_cache="dense"), jobs, 2)
    eng = Engine(target, _drafter(name, weak), max_batch=4, max_len=128)
    assert eng.kv.paged  # the default for a target that supports it
    assert _run(eng, jobs, 2) == dense
    st = eng.stats()
    assert st["prefix_hit_tokens"] > 0 and st["kv_blocks_used"] == 0
    eng.kv.allocator.check()


def test_prefix_reuse_equals_cold_run(lms):
    """A request served from cached prefix blocks gives the cold run's tokens: greedy and seed-coupled sampling."""
    target, _ = lms
    prompts = _prompts(2, 2, shared=70)
    for params in (RequestParams(max_new_tokens=20), RequestParams(max_new_tokens=20, temperature=0.9, seed=5)):
        cold = Engine(target, PromptLookup(), max_batch=2, max_len=128)
        want = _run(cold, [("b", prompts[1], params)])
        assert cold.stats()["prefix_hit_tokens"] == 0
        warm = Engine(target, PromptLookup(), max_batch=2, max_len=128)
        _run(warm, [("a", prompts[0], params)])
        got = _run(warm, [("b", prompts[1], params)])
        assert got == want
        assert warm.stats()["prefix_hit_tokens"] == 64  # 4 full blocks of the 70 shared tokens


def test_preemption_tiny_pool_equals_solo(lms):
    """A pool far too small for the batch: requests are preempted and recomputed; every request completes
    with the tokens it gets alone (greedy and seed-coupled)."""
    target, weak = lms
    prompts = _prompts(8, 3, shared=10)
    params = [RequestParams(max_new_tokens=40) if i % 2 else RequestParams(max_new_tokens=40, temperature=0.8,
                                                                             seed=i) for i in range(8)]
    solo = {}
    for i, (p, sp) in enumerate(zip(prompts, params)):
        solo.update(_run(Engine(target, DraftModel(weak, k=3), max_batch=1, max_len=96, kv_cache="dense"),
                         [(i, p, sp)]))
    eng = Engine(target, DraftModel(weak, k=3), max_batch=8, max_len=96, num_blocks=14, block_size=8)
    got = _run(eng, [(i, p, sp) for i, (p, sp) in enumerate(zip(prompts, params))], arrive_every=1)
    assert got == solo
    st = eng.stats()
    assert st["preemptions"] > 0 and st["requests_finished"] == 8 and st["kv_blocks_used"] == 0
    eng.kv.allocator.check()


def test_soak_aborts_and_preemption_leak_nothing(lms):
    """Random arrivals, aborts (waiting, active, preempted) and finishes under a tiny pool: no lost request,
    and every block back (free or cached) at the end."""
    target, _ = lms
    rng = random.Random(7)
    eng = Engine(target, PromptLookup(ngram=2, k=3, min_ngram=1), max_batch=6, max_len=80, num_blocks=12,
                 block_size=8)
    prompts = _prompts(60, 4, shared=12)
    live, done, aborted = set(), {}, set()
    for i, p in enumerate(prompts):
        eng.add_request(i, p[: rng.randint(12, len(p))], RequestParams(max_new_tokens=rng.randint(1, 30)))
        live.add(i)
        for _ in range(rng.randint(0, 2)):
            for d in eng.step():
                if d.finished:
                    done[d.request_id] = d.finish_reason
                    live.discard(d.request_id)
        if live and rng.random() < 0.25:
            victim = rng.choice(sorted(live))
            assert eng.abort(victim)
            live.discard(victim)
            aborted.add(victim)
        eng.kv.allocator.check()
    while eng.has_unfinished():
        for d in eng.step():
            if d.finished:
                done[d.request_id] = d.finish_reason
                live.discard(d.request_id)
    assert not live and set(done) | aborted == set(range(60)) and not set(done) & aborted
    st = eng.stats()
    assert st["kv_blocks_used"] == 0 and st["kv_blocks_free"] == 12 and st["preemptions"] > 0
    eng.kv.allocator.check()


def test_shared_prefix_blocks_are_never_written(lms):
    """Speculating requests that share cached prefix blocks leave those blocks' K/V bit-identical."""
    target, _ = lms
    prompts = _prompts(4, 5, shared=48)
    eng = Engine(target, PromptLookup(ngram=1, k=6, min_ngram=1), max_batch=4, max_len=128)
    _run(eng, [(0, prompts[0], RequestParams(max_new_tokens=4))])
    alloc, cache = eng.kv.allocator, eng.kv.cache
    cached = alloc.cached_blocks()
    assert len(cached) >= 3
    before = [(k[cached].clone(), v[cached].clone()) for k, v in zip(cache.k_pages, cache.v_pages)]
    _run(eng, [(i, p, RequestParams(max_new_tokens=30)) for i, p in enumerate(prompts[1:], 1)], arrive_every=1)
    assert eng.stats()["prefix_hit_tokens"] >= 3 * 48 // 16 * 16
    for (k0, v0), k, v in zip(before, cache.k_pages, cache.v_pages):
        assert torch.equal(k0, k[cached]) and torch.equal(v0, v[cached])


def test_feature_head_on_the_paged_engine_under_preemption():
    """A feature head (its target keeping hidden states in the blocks) with staggered arrivals, shared prefixes
    and a pool too small for the batch: every request gets plain greedy's tokens, the dense engine's too; the
    cached prefixes are hit, requests are preempted and recomputed, and every block comes back."""
    from specdec.drafters import EagleHead, HeadConfig, HeadNet

    torch.manual_seed(3)
    net = HeadNet(HeadConfig(hidden_size=64, num_heads=4, num_kv_heads=2, intermediate_size=128, vocab_size=V))
    jobs = [(i, p, RequestParams(max_new_tokens=24)) for i, p in enumerate(_prompts(7, 6))]
    plain = _run(Engine(_llama(0), None, max_batch=4, max_len=128, kv_cache="dense"), jobs, 2)
    dense = _run(Engine(_llama(0), EagleHead(net, k=2, top_k=2), max_batch=4, max_len=128, kv_cache="dense"), jobs,
                 2)
    eng = Engine(_llama(0), EagleHead(net, k=2, top_k=2), max_batch=4, max_len=128, num_blocks=24, block_size=8)
    assert eng.kv.paged and eng.kv.cache.feature_dim == 64
    assert _run(eng, jobs, 2) == dense == plain
    st = eng.stats()
    assert st["prefix_hit_tokens"] > 0 and st["preemptions"] > 0 and st["kv_blocks_used"] == 0
    eng.kv.allocator.check()


def test_paged_engine_errors(lms):
    target, _ = lms
    with pytest.raises(ValueError, match="kv_cache='paged' needs a target"):
        Engine(ToyLM(vocab=12, seed=0), None, kv_cache="paged")
    with pytest.raises(ValueError, match="cannot hold one request"):
        Engine(target, None, max_len=128, num_blocks=4, block_size=16)
    with pytest.raises(ValueError, match="kv_cache must be"):
        Engine(target, None, kv_cache="pages")
    assert not Engine(ToyLM(vocab=12, seed=0), None).kv.paged  # no paged support: dense, silently
