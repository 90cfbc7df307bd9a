"""Tensor-parallel target over gloo on loopback: 2 ranks (this process + one spawned), against the
same shard code at size 1 and against HFCausalLM. The ranks are started once for the module; the
dying-rank test runs last (it kills the spawned rank). Every wait is bounded (timeout=60 s)."""
import os
import signal
import time

import pytest
import torch

from specdec import DraftModel, Engine, PromptLookup, RequestParams, SpeculativeDecoder
from specdec.distributed import (ModelSource, TensorParallelError, launch_tensor_parallel,
                                 local_tensor_parallel)
from specdec.distributed.shard import split_sizes
from specdec.models.hf import HFCausalLM
from specdec.scheduler import CostModel, calibrate, make_policy

bundled = pytest.importorskip("specdec.models.bundled")

PROMPTS = [[1, 9690, 314, 1345, 28, 13410, 6726, 314, 1345, 28, 13410],
           [1, 504, 3458, 282, 4649, 314, 504, 3458, 282],
           [1, 2683, 1789, 253, 1165]]


@pytest.fixture(scope="module")
def models():
    try:
        model, tok, w8 = bundled.load_bundled(draft="w8", hugepages=False)
    except ModuleNotFoundError as e:
        pytest.skip(f"the bundled model is not installed: {e}")
    torch.set_num_threads(1)
    tp2 = launch_tensor_parallel(ModelSource(), 2, threads=1, timeout=60, model=model)
    yield model, w8, local_tensor_parallel(model), tp2, tok
    tp2.close()


def _drafters(w8):
    return {"plain": lambda: None, "lookup": lambda: PromptLookup(ngram=2, k=4, min_ngram=1),
            "w8": lambda: DraftModel(HFCausalLM(w8), k=4), "w8-tree": lambda: DraftModel(HFCausalLM(w8), k=3, top_k=2)}


def test_split_sizes():
    assert split_sizes(3, 2) == [2, 1]
    assert split_sizes(1536, 2, 32) == [768, 768]
    assert split_sizes(96, 2, 32) == [64, 32]
    with pytest.raises(ValueError, match="cannot be split"):
        split_sizes(1, 2)


def test_logits_match_single_process(models):
    model, _, tp1, tp2 = models[:4]
    ref = HFCausalLM(model)
    caches = [lm.new_cache(3, 64) for lm in (ref, tp1, tp2)]
    pre = [lm.prefill(c, PROMPTS) for lm, c in zip((ref, tp1, tp2), caches)]
    toks = torch.tensor([[11, 12, 13]] * 3)
    depths = torch.tensor([[0, 1, 1]] * 3)
    mask = torch.tensor([[1, 0, 0], [1, 1, 0], [1, 0, 1]], dtype=torch.bool).expand(3, 3, 3)
    fwd = [lm.forward(c, toks, depths, mask) for lm, c in zip((ref, tp1, tp2), caches)]
    for got in pre[1:]:
        torch.testing.assert_close(got, pre[0], atol=2e-3, rtol=1e-4)
    for got in fwd[1:]:
        torch.testing.assert_close(got, fwd[0], atol=2e-3, rtol=1e-4)
    assert tp2.last_comm.calls == 2 * model.config.num_hidden_layers + 1  # two all-reduces per layer + the gather
    last = tp2.forward_last(caches[2], toks, depths.new_tensor([[0, 1, 2]] * 3), torch.tensor([2, 0, 1]))
    assert last.shape == (3, model.config.vocab_size)


@pytest.mark.parametrize("drafter", ["plain", "lookup", "w8", "w8-tree"])
def test_greedy_tp2_equals_tp1(models, drafter):
    _, w8, tp1, tp2 = models[:4]
    make = _drafters(w8)[drafter]
    outs = [SpeculativeDecoder(lm, make(), max_batch=3, max_len=48, policy="fixed").generate(
        PROMPTS, max_new_tokens=12).tokens for lm in (tp1, tp2)]
    assert outs[0] == outs[1]


def test_seed_coupled_sampling_identical(models):
    _, w8, tp1, tp2 = models[:4]
    outs = [SpeculativeDecoder(lm, DraftModel(HFCausalLM(w8), k=3), max_batch=3, max_len=48,
                               policy="fixed").generate(PROMPTS, max_new_tokens=10, temperature=0.8, seed=7).tokens
            for lm in (tp1, tp2)]
    assert outs[0] == outs[1]


def test_engine_rows_move_on_every_rank(models):
    """Requests of different lengths through 2 rows: finished rows are refilled and moved (the journal)."""
    _, _, tp1, tp2 = models[:4]
    lens = [3, 9, 5, 7]
    outs = []
    for lm in (tp1, tp2):
        eng = Engine(lm, PromptLookup(ngram=2, k=3, min_ngram=1), max_batch=2, max_len=48, policy="fixed")
        for i, n in enumerate(lens):
            eng.add_request(i, PROMPTS[i % 3], RequestParams(max_new_tokens=n))
        got = {i: [] for i in range(len(lens))}
        while eng.has_unfinished():
            for d in eng.step():
                got[d.request_id] += d.new_tokens
        outs.append(got)
    assert outs[0] == outs[1]
    assert [len(outs[1][i]) for i in range(len(lens))] == lens


def test_paged_engine_prefix_preemption_and_draft(models):
    """TP 2 on the paged cache (the default): shared prefixes hit the cache, a tiny pool preempts, the w8 draft
    keeps its K/V in the same blocks (rank 0), and every output equals TP 1 on the dense cache."""
    _, w8, tp1, tp2 = models[:4]
    prompts = [PROMPTS[0] * 3 + [7 + i] for i in range(4)]   # 33 shared tokens: 4 full blocks of 8
    outs, stats = [], []
    for lm, kv in ((tp1, "dense"), (tp2, None)):
        eng = Engine(lm, DraftModel(HFCausalLM(w8), k=3, top_k=2), max_batch=4, max_len=64, policy="fixed", kv_cache=kv,
                     num_blocks=10, block_size=8)
        got = {i: [] for i in range(len(prompts))}
        for i, p in enumerate(prompts):
            eng.add_request(i, p, RequestParams(max_new_tokens=20))
        while eng.has_unfinished():
            for d in eng.step():
                got[d.request_id] += d.new_tokens
        outs.append(got)
        stats.append(eng.stats())
    assert outs[0] == outs[1]
    st = stats[1]
    assert st["kv_cache"] == "paged" and st["prefix_hit_tokens"] > 0 and st["preemptions"] > 0
    assert st["kv_blocks_used"] == 0 and st["draft_kv_bytes_per_block"] > 0


def test_slow_collective_shrinks_the_goodput_budget(models):
    """The verify cost the goodput scheduler plans with is the TP forward's wall time on rank 0,
    collectives included: with a link whose collectives cost about 120 ms per verified row
    (bandwidth-bound, as a large model's activations over a slow link) the plan drafts fewer tokens
    than with the real loopback collective. The verify table is measured with timed TP forwards
    (specdec.scheduler.calibrate); the plan is the policy's first for a new request."""
    _, _, _, tp2 = models[:4]
    cache = tp2.new_cache(1, 32)

    def first_budget(delay):
        tp2.comm.delay = delay
        try:
            policy = make_policy("goodput", PromptLookup(ngram=2, k=8, min_ngram=1), CostModel())
            calibrate(tp2, cache, policy.cost, [1], [1, 3, 5, 9], repeats=1, use_cache=False)
            policy.begin(1)
            return policy.plan([0], [64]).budgets[0]
        finally:
            tp2.comm.delay = None

    fast, slow = first_budget(None), first_budget((0.0, 5e-7))
    assert slow < fast, (slow, fast)


def test_dying_rank_is_reported(models):
    """A killed rank: the target names it at the next call, the server answers that step's request with
    HTTP 500 (no hang) and stays up; the target refuses later calls."""
    pytest.importorskip("fastapi")
    import httpx

    from specdec.server import ServerThread

    _, _, _, tp2 = models[:4]
    engine = Engine(tp2, None, max_batch=1, max_len=64, policy="fixed")
    with ServerThread(engine, models[4], "smollm2-135m", start_timeout=30) as srv:
        body = {"model": "smollm2-135m", "prompt": "Hello", "max_tokens": 3, "temperature": 0}
        assert httpx.post(srv.url + "/v1/completions", json=body, timeout=60).status_code == 200
        os.kill(tp2.procs[0].pid, signal.SIGKILL)
        tp2.procs[0].join(timeout=10)
        t0 = time.perf_counter()
        r = httpx.post(srv.url + "/v1/completions", json=body, timeout=60)
        assert r.status_code == 500
        assert time.perf_counter() - t0 < 30
        assert httpx.get(srv.url + "/health", timeout=10).status_code == 200
    with pytest.raises(TensorParallelError, match="rank 1"):
        tp2.new_cache(1, 8)


def test_cli_replicas_need_ray(capsys):
    pytest.importorskip("fastapi")
    from specdec.cli import main

    assert main(["serve", "--replicas", "2"]) == 2
    assert "--replicas needs --ray" in capsys.readouterr().err


def test_replica_builds_from_serve_options():
    """A Ray replica builds its target and engine from `specdec serve` options (specdec.cli.serve_options,
    make_engine): every option it reads exists with the CLI's default, and the KV pool options apply.
    The Ray-free half of tests/test_ray_serve.py (which needs SPECDEC_RAY_TESTS=1)."""
    from specdec.cli import load_target, make_engine, serve_options

    args = serve_options(["--draft", "lookup", "--max-batch", "2", "--max-len", "128", "--kv-blocks", "20",
                          "--block-size", "8", "--replicas", "2", "--ray"])
    target, drafter, tok, _ = load_target(args)
    eng = make_engine(args, target, drafter)
    st = eng.stats()
    assert st["kv_cache"] == "paged" and st["kv_blocks_total"] == 20 and st["block_size"] == 8
    assert eng.max_batch == 2 and eng.max_len == 128 and tok is not None
