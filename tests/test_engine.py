"""specdec.Engine: continuous batching (join / leave at step boundaries), per-request settings, abort,
drafter failure isolation, admission errors. Toy models (tests/toy_lm.py); ToyLM.greedy is the oracle."""
from __future__ import annotations

import random
from collections import Counter
from typing import Dict, List

import pytest
import torch

from specdec import (DraftModel, Engine, MultiDraft, PromptLookup, QueueFull, RequestParams, SpeculativeDecoder,
                     SuffixDrafter, TokenRecycling)
from specdec.drafters.base import Draft, Drafter
from specdec.tree import TokenTree

from test_decoding import _exact_first3, _tv_bound
from toy_lm import ToyLM

PROMPTS = [[1, 2, 3, 4, 5], [3, 3], [7, 1, 2, 9, 4, 4, 4, 2], [0], [5, 6, 5, 6, 5], [11, 10, 9, 8, 7, 6, 5],
           [2, 2, 2], [4, 8, 4, 8, 4], [9]]


@pytest.fixture(scope="module")
def toy():
    target = ToyLM(vocab=12, seed=0)
    weak = ToyLM(vocab=12, seed=0)
    weak.head = weak.head + 0.6 * torch.randn(weak.head.shape, generator=torch.Generator().manual_seed(9))
    return target, weak


def _drafters(target, weak):
    return {
        "plain": lambda: None,
        "lookup": lambda: PromptLookup(ngram=2, k=4, min_ngram=1),
        "draft-chain": lambda: DraftModel(weak, k=3),
        "draft-dynamic": lambda: DraftModel(weak, k=4, top_k=2, node_budget=8, tree="dynamic"),
        "multi": lambda: MultiDraft([DraftModel(weak, k=3), PromptLookup(ngram=2, k=3, min_ngram=1)]),
        "suffix": lambda: SuffixDrafter(max_spec=6),
        "recycle": lambda: TokenRecycling(max_depth=3),
        "spine-tree": lambda: DraftModel(weak, k=3, top_k=2),
    }


def _drive(eng: Engine, schedule: Dict[int, List[tuple]], max_steps: int = 500):
    """Step the engine; at step i add the requests schedule[i] = [(id, prompt, params)]. Returns
    {id: tokens}, {id: finish reason} and the most rows ever active."""
    out: Dict[object, List[int]] = {}
    reasons: Dict[object, str] = {}
    most = 0
    for i in range(max_steps):
        for rid, prompt, params in schedule.get(i, []):
            eng.add_request(rid, prompt, params)
            out[rid] = []
        if not eng.has_unfinished() and i > max(schedule):
            break
        for d in eng.step():
            out[d.request_id].extend(d.new_tokens)
            assert d.num_generated == len(out[d.request_id])
            if d.finished:
                reasons[d.request_id] = d.finish_reason
        most = max(most, eng.num_active)
        assert eng.num_active <= eng.max_batch
    assert not eng.has_unfinished()
    return out, reasons, most


@pytest.mark.parametrize("name", ["plain", "lookup", "draft-chain", "draft-dynamic", "multi", "suffix", "recycle",
                                  "spine-tree"])
def test_joining_requests_equal_solo_greedy(toy, name):
    target, weak = toy
    drafter = _drafters(target, weak)[name]()
    eng = Engine(target, drafter, max_batch=3, max_len=64, policy="fixed")
    rng = random.Random(5)
    schedule: Dict[int, List[tuple]] = {}
    want = {}
    for j, p in enumerate(PROMPTS):   # 9 requests over 3 rows: they join while others decode
        n = rng.randint(3, 20)
        stops = (7,) if j % 3 == 0 else ()
        schedule.setdefault(j * 2, []).append((f"r{j}", p, RequestParams(max_new_tokens=n, stop_token_ids=stops)))
        want[f"r{j}"] = target.greedy(p, n, eos=7 if stops else None)
    out, reasons, most = _drive(eng, schedule)
    assert out == want
    assert most >= 2  # requests joined while others decoded
    for rid, toks in want.items():
        assert reasons[rid] == ("stop" if toks[-1] == 7 and rid in {"r0", "r3", "r6"} else "length")
    st = eng.stats()
    assert st["requests_finished"] == len(PROMPTS) and st["active"] == 0 and st["free_rows"] == 3
    if drafter is not None and name not in ("lookup", "recycle"):
        assert st["accepted_tokens"] > 0
    # a second busy period on the same engine (ids restart, drafter state restarts) is exact too
    out2, _, _ = _drive(eng, {0: [("again", PROMPTS[2], RequestParams(max_new_tokens=9))],
                              1: [("again2", PROMPTS[0], RequestParams(max_new_tokens=4))]})
    assert out2 == {"again": target.greedy(PROMPTS[2], 9), "again2": target.greedy(PROMPTS[0], 4)}


def test_generate_is_the_engine(toy):
    target, weak = toy
    dec = SpeculativeDecoder(target, DraftModel(weak, k=3), max_batch=4, max_len=64, policy="fixed")
    assert isinstance(dec.engine, Engine) and dec.cache is dec.engine.cache
    out = dec.generate(PROMPTS[:4], max_new_tokens=10)
    assert out.tokens == [target.greedy(p, 10) for p in PROMPTS[:4]]
    # the same decoder's engine serves requests afterwards, and generate again after that
    dec.engine.add_request("x", PROMPTS[5], RequestParams(max_new_tokens=6))
    got = []
    while dec.engine.has_unfinished():
        got += [t for d in dec.engine.step() for t in d.new_tokens]
    assert got == target.greedy(PROMPTS[5], 6)
    assert dec.generate(PROMPTS[4:6], max_new_tokens=5).tokens == [target.greedy(p, 5) for p in PROMPTS[4:6]]
    dec.engine.add_request("busy", PROMPTS[0], RequestParams(max_new_tokens=3))
    with pytest.raises(RuntimeError, match="engine holds requests"):
        dec.generate(PROMPTS[:1], max_new_tokens=2)
    assert dec.engine.abort("busy")


def test_mixed_settings_share_a_batch(toy):
    """Greedy rows next to sampled rows stay token-identical to solo greedy; a seeded (seed-coupled)
    sampled request gives the tokens of plain seeded sampling alone, whatever the drafter, the policy and
    the rest of the batch."""
    target, weak = toy
    sampled = RequestParams(max_new_tokens=12, temperature=0.9, top_k=6, top_p=0.95, seed=1234)

    def run(batch_mates: int, drafter, policy="fixed"):
        eng = Engine(target, drafter, max_batch=4, max_len=64, policy=policy)
        schedule = {0: [("s", PROMPTS[4], sampled)]}
        for j in range(batch_mates):
            schedule.setdefault(j, []).append((f"g{j}", PROMPTS[j], RequestParams(max_new_tokens=9 + j)))
            schedule.setdefault(j + 1, []).append(   # unseeded sampled mates: the rejection sampler
                (f"t{j}", PROMPTS[j + 1], RequestParams(max_new_tokens=8, temperature=1.3)))
        out, _, _ = _drive(eng, schedule)
        for j in range(batch_mates):
            assert out[f"g{j}"] == target.greedy(PROMPTS[j], 9 + j)
        return out["s"]

    plain = run(0, None)
    assert len(plain) == 12 and plain != target.greedy(PROMPTS[4], 12)
    makers = {"lookup": lambda: PromptLookup(ngram=2, k=3, min_ngram=1), "draft": lambda: DraftModel(weak, k=3),
              "dynamic": lambda: DraftModel(weak, k=4, top_k=2, node_budget=8, tree="dynamic")}
    for name, make in makers.items():
        for mates in (0, 3):
            for policy in ("fixed", "goodput"):
                assert run(mates, make(), policy) == plain, (name, mates, policy)
    # another seed gives other tokens (the noise really depends on the seed)
    other = Engine(target, None, max_batch=1, max_len=64)
    other.add_request("o", PROMPTS[4], RequestParams(max_new_tokens=12, temperature=0.9, top_k=6, top_p=0.95,
                                                     seed=99))
    toks = []
    while other.has_unfinished():
        toks += [t for d in other.step() for t in d.new_tokens]
    assert toks != plain


def test_mixed_batch_sampling_is_exact():
    """Rows of two sampled settings and greedy rows in one batch, a draft model drafting: each sampled
    setting's first three tokens follow the target's warped distribution (total variation bound)."""
    target = ToyLM(vocab=8, seed=3, scale=1.0, hidden=16, heads=2, kv_heads=1)
    draft = ToyLM(vocab=8, seed=4, scale=1.0, hidden=16, layers=1, heads=2, kv_heads=1)
    prompt = [1, 2, 3, 1, 2, 3, 1, 2]
    settings = {"a": (0.7, 5, 0.9), "b": (1.2, 0, 1.0)}
    exact = {k: _exact_first3(target, prompt, *v) for k, v in settings.items()}
    per, rounds = 500, 3
    counts = {k: Counter() for k in settings}
    eng = Engine(target, DraftModel(draft, k=3), max_batch=3 * per, max_len=len(prompt) + 6, policy="fixed",
                 draft_seed=7)
    greedy_ref = target.greedy(prompt, 3)
    for rnd in range(rounds):
        for i in range(per):
            for k, (t, tk, tp) in settings.items():
                # setting a: seed-coupled (Gumbel-max on per-position noise); b: the rejection sampler
                seed = rnd * 100003 + i if k == "a" else None
                eng.add_request((rnd, k, i), prompt, RequestParams(max_new_tokens=3, temperature=t, top_k=tk,
                                                                   top_p=tp, seed=seed))
            eng.add_request((rnd, "g", i), prompt, RequestParams(max_new_tokens=3))
        out: Dict[tuple, List[int]] = {}
        while eng.has_unfinished():
            for d in eng.step():
                out.setdefault(d.request_id, []).extend(d.new_tokens)
        for (r, k, i), toks in out.items():
            if k == "g":
                assert toks == greedy_ref
            else:
                counts[k][tuple(toks)] += 1
    n = per * rounds
    for k in settings:
        tv = 0.5 * sum(abs(counts[k][x] / n - p) for x, p in exact[k].items())
        assert set(counts[k]) <= set(exact[k])
        assert tv < _tv_bound(exact[k], n), (k, tv)


def test_abort_frees_rows(toy):
    target, weak = toy
    eng = Engine(target, DraftModel(weak, k=3), max_batch=2, max_len=64, policy="fixed")
    eng.add_request("a", PROMPTS[0], RequestParams(max_new_tokens=30))
    eng.add_request("b", PROMPTS[1], RequestParams(max_new_tokens=30))
    eng.add_request("c", PROMPTS[2], RequestParams(max_new_tokens=6))   # waits: no free row
    eng.step()
    assert eng.num_active == 2 and eng.num_waiting == 1
    assert eng.abort("a")             # active: its row is free at once
    assert eng.num_active == 1
    assert not eng.abort("a") and not eng.abort("never")
    eng.add_request("d", PROMPTS[3], RequestParams(max_new_tokens=5))
    assert eng.abort("d")             # waiting
    out: Dict[str, List[int]] = {"b": [], "c": []}
    aborted = set()
    while eng.has_unfinished():
        for d in eng.step():
            out[d.request_id].extend(d.new_tokens)
        if len(out["b"]) > 8 and "b" not in aborted:
            assert eng.abort("b")         # mid-decode, next to a running request
            aborted.add("b")
    assert out["c"] == target.greedy(PROMPTS[2], 6)
    assert eng.stats()["requests_aborted"] == 3
    # the rows are reused: a full batch afterwards is still exact
    for j in range(2):
        eng.add_request(f"e{j}", PROMPTS[4 + j], RequestParams(max_new_tokens=7))
    got: Dict[str, List[int]] = {"e0": [], "e1": []}
    while eng.has_unfinished():
        for d in eng.step():
            got[d.request_id].extend(d.new_tokens)
    assert got == {f"e{j}": target.greedy(PROMPTS[4 + j], 7) for j in range(2)}
    assert eng.scheduler.requests == {}


class _Flaky(Drafter):
    """Chains of repeated last tokens; raises on some steps, proposes garbage for requests whose prompt
    starts with 11, a wrong root for prompts starting with 9."""

    max_nodes = 3

    def __init__(self) -> None:
        self.steps = 0

    def bind(self, target, max_batch, max_len):
        self.device = torch.device(target.device)

    def propose(self, ctx):
        self.steps += 1
        if self.steps % 4 == 0:
            raise RuntimeError("flaky drafter failed")
        b = len(ctx.request_ids)
        toks, pars = [], []
        for seq in ctx.sequences:
            root = seq[-1]
            if seq[0] == 11:
                toks.append([root, 99, -1])      # out of the vocabulary
            elif seq[0] == 9:
                toks.append([(root + 1) % 12, root, root])  # node 0 is not the root
            else:
                toks.append([root, root, root])
            pars.append([-1, 0, 1])
        t = torch.tensor(toks, dtype=torch.int64)
        p = torch.tensor(pars, dtype=torch.int32)
        d = torch.tensor([[0, 1, 2]] * b, dtype=torch.int32)
        return Draft(TokenTree(t, p, d, [3] * b))


def test_drafter_failures_fall_back_per_request(toy, caplog):
    target, _ = toy
    eng = Engine(target, _Flaky(), max_batch=4, max_len=64, policy="fixed")
    want = {}
    for j, p in enumerate([PROMPTS[0], PROMPTS[5], PROMPTS[8], PROMPTS[6]]):
        eng.add_request(j, p, RequestParams(max_new_tokens=15))
        want[j] = target.greedy(p, 15)
    out: Dict[int, List[int]] = {j: [] for j in want}
    with caplog.at_level("WARNING", logger="specdec.engine"):
        while eng.has_unfinished():
            for d in eng.step():
                out[d.request_id].extend(d.new_tokens)
    assert out == want
    assert eng.stats()["drafter_errors"] >= 3
    assert any("raised RuntimeError" in r.getMessage() for r in caplog.records)
    assert any("outside the vocabulary" in r.getMessage() for r in caplog.records)
    assert any("root token" in r.getMessage() for r in caplog.records)
    # generate keeps raising (errors surface to a library caller)
    dec = SpeculativeDecoder(target, _Flaky(), max_batch=2, max_len=64, policy="fixed")
    with pytest.raises(ValueError, match="outside the vocabulary"):
        dec.generate([PROMPTS[5]], max_new_tokens=5)


def test_add_request_errors(toy):
    target, _ = toy
    eng = Engine(target, None, max_batch=2, max_len=16, max_waiting=2)
    eng.add_request("a", [1, 2], RequestParams(max_new_tokens=4))
    with pytest.raises(ValueError, match="already in the engine"):
        eng.add_request("a", [1, 2])
    with pytest.raises(ValueError, match="empty prompt"):
        eng.add_request("e", [])
    with pytest.raises(ValueError, match="max_len=16"):
        eng.add_request("long", [1] * 10, RequestParams(max_new_tokens=7))
    with pytest.raises(ValueError, match="outside the vocabulary"):
        eng.add_request("v", [1, 12])
    with pytest.raises(TypeError, match="non-integer"):
        eng.add_request("t", [1, "x"])
    with pytest.raises(TypeError, match="RequestParams"):
        eng.add_request("p", [1], {"max_new_tokens": 3})
    eng.add_request("b", [3], RequestParams(max_new_tokens=4))
    with pytest.raises(QueueFull, match="max_waiting=2"):
        eng.add_request("c", [3], RequestParams(max_new_tokens=4))
    for bad, match in ((dict(temperature=-1.0), "temperature"), (dict(top_p=0.0), "top_p"),
                       (dict(max_new_tokens=0), "max_new_tokens"), (dict(top_k=-2), "top_k"),
                       (dict(seed=1.5), "seed"), (dict(stop_token_ids=["x"]), "stop_token_ids")):
        with pytest.raises((TypeError, ValueError), match=match):
            RequestParams(**bad)
    assert eng.num_waiting == 2 and eng.num_active == 0
    while eng.has_unfinished():
        eng.step()
    assert eng.stats()["requests_finished"] == 2
