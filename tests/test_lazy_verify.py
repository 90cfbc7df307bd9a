"""Greedy verification with the LM head along the accepted path (specdec.lazy_verify): the same integers as
ops.greedy_verify on the full logits, for chains, trees, ragged batches, duplicate children and NaN rows, with
and without a chunk history; and in the Engine, greedy output equal to plain greedy decoding with fewer head
rows computed, while sampled rows and drafters that read every node's logits keep the full pass."""
from __future__ import annotations

import random

import pytest
import torch

from specdec import DraftModel, HFCausalLM, MultiDraft, PromptLookup, SpeculativeDecoder, TokenRecycling, ops
from specdec.lazy_verify import LazyGreedyVerify, best_chunk, head_cost
from specdec.drafters.base import Draft, Drafter
from specdec.tree import TokenTree
from conftest import gen, make_trees, tiny_llama

V = 97


class FakeTarget:
    """forward_hidden: fixed hidden states; head_logits: a linear map (rows independent), calls recorded."""

    def __init__(self, hidden: torch.Tensor, w: torch.Tensor, nan_rows=()) -> None:
        self.hidden, self.w, self.nan_rows = hidden, w, set(nan_rows)
        self.calls = []

    def forward_hidden(self, cache, tokens, depths, mask):
        return self.hidden

    def head_logits(self, x):
        self.calls.append(x.shape[0])
        out = x @ self.w.T
        for i in range(x.shape[0]):  # a row whose first feature is NaN gets NaN logits at a few columns
            if torch.isnan(x[i, 0]):
                out[i, 3] = out[i, 7] = float("nan")
        return out

    def head_argmax(self, x):  # the argmax op's answer (greedy_head: an ArgmaxTarget)
        return torch.argmax(self.head_logits(x), dim=-1)

    def full(self):
        b, n, _ = self.hidden.shape
        return torch.stack([torch.stack([self.head_logits(self.hidden[r, v:v + 1])[0] for v in range(n)])
                            for r in range(b)])


class ArgmaxTarget(FakeTarget):
    """A target with the head's argmax op: the verifier walks int64 argmaxes instead of logits rows."""

    greedy_head = True


def _case(seed: int, B: int, N: int, kind: str, ragged: bool, nan: bool = False, argmax: bool = False):
    g = gen(seed)
    tokens, parents, counts = make_trees(B, N, V, kind, g=g, ragged=ragged)
    H = 16
    hidden = torch.randn(B, N, H, generator=g)
    if nan:
        hidden[0, 0, 0] = float("nan")
        hidden[B - 1, N // 2, 0] = float("nan")
    t = (ArgmaxTarget if argmax else FakeTarget)(hidden, torch.randn(V, H, generator=g))
    full = t.full()
    rng = random.Random(seed)
    for r in range(B):  # children take their parent's argmax often (long accepted paths), duplicates included
        for c in range(1, int(counts[r])):
            p = int(parents[r, c])
            if rng.random() < 0.7:
                tokens[r, c] = int(full[r, p].argmax())
    depths = torch.zeros(B, N, dtype=torch.int32)
    for r in range(B):
        for c in range(1, int(counts[r])):
            depths[r, c] = depths[r, int(parents[r, c])] + 1
    tree = TokenTree(tokens, parents, depths, counts.tolist())
    t.calls.clear()
    return t, tree, full


@pytest.mark.parametrize("argmax", [False, True], ids=["logits", "argmax_head"])
@pytest.mark.parametrize("kind", ["chain", "random", "wide", "deep", "mixed"])
def test_equals_greedy_verify_on_full_logits(kind, argmax):
    verifier = LazyGreedyVerify(window=4)
    for seed in range(60):
        B, N = (1 + seed % 4, 2 + seed % 13)
        t, tree, full = _case(seed, B, N, kind, ragged=seed % 2 == 1, nan=seed % 7 == 0, argmax=argmax)
        keys = [f"r{r}" for r in range(B)]  # the same keys every case: the chunk history carries over
        before = [list(verifier._history.get(k, ())) for k in keys]
        got = verifier(t, None, tree, keys)
        want = ops.greedy_verify(tree.tokens, tree.parents, full)
        for a, w, name in zip(got, want, ("accepted", "num_accepted", "out_tokens")):
            assert a.dtype == w.dtype and torch.equal(a, w), f"{kind} seed {seed}: {name} {a} != {w}"
        assert all(c <= 64 for c in t.calls)
        for k, h, n in zip(keys, before, want[1].tolist()):  # each row's path recorded once
            assert list(verifier._history[k]) == (h + [n + 1])[-4:], (kind, seed, k)
    assert verifier.steps == 60 and verifier.rows < verifier.nodes  # the history cut the rows computed


def test_chunks_follow_the_history():
    assert best_chunk([], 9) == 9                       # no history: every node, one call
    assert best_chunk([1, 1, 1, 1], 9) == 3             # paths end at the root: the free rows
    assert best_chunk([9] * 8, 9) == 9                  # whole chains accepted: all in one call
    assert best_chunk([1, 5, 2, 1, 6, 1], 9) in (3, 5, 6)
    assert head_cost(1) == head_cost(3) == 1.0 and head_cost(13) == pytest.approx(2.0)
    t, tree, full = _case(3, 1, 8, "chain", ragged=False)
    path = int(ops.greedy_verify(tree.tokens, tree.parents, full)[1][0]) + 1  # nodes the walk reads
    v = LazyGreedyVerify()
    v(t, None, tree, ["a"])
    assert t.calls == [8] and list(v._history["a"]) == [path]  # no history: the full pass's rows, one call
    v._history["a"].extend([1] * 15)                          # paths that ended at the root
    t.calls.clear()
    v(t, None, tree, ["a"])
    assert t.calls[0] == 3  # the root, padded to the free rows; more calls only while the path goes on
    assert sum(t.calls) <= max(3, path + 3) and len(t.calls) <= 1 + (path - 1) // 3 + 1
    v.forget("a")
    assert "a" not in v._history


def test_errors():
    t, tree, _ = _case(0, 2, 4, "chain", ragged=False)
    with pytest.raises(ValueError, match=r"LazyGreedyVerify: keys must name the tree's 2 rows, got 1"):
        LazyGreedyVerify()(t, None, tree, ["x"])
    with pytest.raises(ValueError, match=r"LazyGreedyVerify: window must be >= 1, got 0"):
        LazyGreedyVerify(window=0)
    t, tree, _ = _case(0, 5, 13, "chain", ragged=False)
    with pytest.raises(ValueError, match=r"exceeds the head's batch-invariant 64 rows"):
        LazyGreedyVerify()(t, None, tree, list(range(5)))


# ----------------------------------------------------------------------------- in the engine
def _llama(seed: int, layers: int = 2, noise: float = 0.0) -> HFCausalLM:
    return tiny_llama(seed, layers, noise, V)


@pytest.fixture(scope="module")
def lms():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield _llama(0), _llama(0, noise=0.02)
    torch.set_num_threads(before)


def _prompts(n: int, seed: int):
    rng = random.Random(seed)
    base = [rng.randrange(V) for _ in range(12)]
    return [base * 2 + [rng.randrange(V) for _ in range(rng.randint(1, 8))] for _ in range(n)]


@pytest.mark.parametrize("kv", ["dense", "paged"])
@pytest.mark.parametrize("make", [lambda d: DraftModel(d, k=4),
                                  lambda d: DraftModel(d, k=3, top_k=2, tree="dynamic", node_budget=8),
                                  lambda d: MultiDraft([PromptLookup(ngram=2, k=5), DraftModel(d, k=3)])],
                         ids=["chain", "dynamic_tree", "lookup_merge"])
def test_engine_greedy_equals_plain_with_fewer_head_rows(lms, make, kv):
    target, weak = lms
    assert target.lazy_head
    prompts = _prompts(3, 1)
    ref = SpeculativeDecoder(target, None, max_batch=3, max_len=160).generate(prompts, max_new_tokens=30).tokens
    dec = SpeculativeDecoder(target, make(weak), max_batch=3, max_len=160, policy="fixed", kv_cache=kv)
    lv = dec.engine.lazy_verify
    lv.mode = "always"   # every greedy step lazily (the default, "auto", only where its plan expects a saving)
    got = dec.generate(prompts, max_new_tokens=30)
    assert got.tokens == ref
    assert lv.steps > 0 and lv.rows < lv.nodes, (lv.steps, lv.rows, lv.nodes)
    target.lazy_verify = False
    try:
        assert not target.lazy_head
        off = SpeculativeDecoder(target, make(weak), max_batch=3, max_len=160, policy="fixed", kv_cache=kv)
        assert off.generate(prompts, max_new_tokens=30).tokens == ref and off.engine.lazy_verify.steps == 0
    finally:
        target.lazy_verify = True


def test_full_pass_where_rows_sample_or_the_drafter_reads_logits(lms):
    target, weak = lms
    prompts = _prompts(2, 2)
    dec = SpeculativeDecoder(target, DraftModel(weak, k=3), max_batch=2, max_len=128, policy="fixed")
    dec.engine.lazy_verify.mode = "always"
    dec.generate(prompts, max_new_tokens=10, temperature=0.8, seed=5)
    assert dec.engine.lazy_verify.steps == 0
    rec = TokenRecycling()
    assert rec.reads_verify_logits and MultiDraft([PromptLookup(), rec]).reads_verify_logits
    assert not DraftModel(weak, k=2).reads_verify_logits
    dec = SpeculativeDecoder(target, MultiDraft([PromptLookup(ngram=2, k=4), rec]), max_batch=2, max_len=128,
                             policy="fixed")
    dec.engine.lazy_verify.mode = "always"
    ref = SpeculativeDecoder(target, None, max_batch=2, max_len=128).generate(prompts, max_new_tokens=20).tokens
    assert dec.generate(prompts, max_new_tokens=20).tokens == ref
    assert dec.engine.lazy_verify.steps == 0


class JunkChain(Drafter):
    """k tokens the target never takes (its greedy token + 1 at each node would need the logits: any fixed
    token off the greedy path does; paths then read the root alone)."""

    def __init__(self, k: int) -> None:
        self.k = k

    @property
    def max_nodes(self) -> int:
        return self.k + 1

    def propose(self, ctx):
        b = ctx.roots.shape[0]
        toks = [[int(r)] + [(int(r) * 7 + j) % V for j in range(1, self.k + 1)] for r in ctx.roots.tolist()]
        return Draft(TokenTree.chain(torch.tensor(toks), [self.k + 1] * b))


def test_auto_runs_lazily_where_it_pays(lms):
    target, _ = lms
    prompts = _prompts(1, 3)
    ref = SpeculativeDecoder(target, None, max_batch=1, max_len=128).generate(prompts, max_new_tokens=16).tokens
    dec = SpeculativeDecoder(target, JunkChain(9), max_batch=1, max_len=128, policy="fixed")
    got = dec.generate(prompts, max_new_tokens=16)
    lv = dec.engine.lazy_verify
    assert got.tokens == ref and lv.mode == "auto"
    # the first step has no history (full pass, observed); then paths of one node: 3 rows of 10 per step
    assert lv.steps >= 10 and lv.rows == 3 * lv.steps and lv.nodes == 10 * lv.steps
    assert lv.plan(["x"], 10) is None                      # no history
    lv.observe(["x"] * 4, [0, 0, 0, 0])
    assert lv.plan(["x"], 10) == 3 and lv.plan(["x"], 3) is None   # a 3-node tree cannot save anything
    lv.observe(["y"] * 8, [9, 0] * 4)                      # half the paths run the whole chain: not worth it
    assert lv.plan(["y"], 10) is None and lv.plan(["x", "x"], 10) == 3
    lv.mode = "never"
    assert lv.plan(["x"], 10) is None
    with pytest.raises(ValueError, match=r"LazyGreedyVerify: mode must be one of \('auto', 'always', 'never'\), "
                                         r"got 'sometimes'"):
        LazyGreedyVerify(mode="sometimes")


def test_forward_hidden_and_head_logits_give_forward_bits(lms):
    target, _ = lms
    prompt = _prompts(1, 4)[0]
    tokens = torch.tensor([[5, 17, 29, 3, 8]])
    depths = torch.tensor([[0, 1, 1, 2, 3]], dtype=torch.int32)
    mask = torch.tensor([[[1, 0, 0, 0, 0], [1, 1, 0, 0, 0], [1, 0, 1, 0, 0], [1, 1, 0, 1, 0], [1, 1, 0, 1, 1]]],
                        dtype=torch.bool)
    cache = target.new_cache(1, 64)
    target.prefill(cache, [prompt])
    full = target.forward(cache, tokens, depths, mask)
    hidden = target.forward_hidden(cache, tokens, depths, mask)
    assert hidden.shape == (1, 5, 64)
    assert torch.equal(target.head_logits(hidden[0]), full[0])
    for rows in ([0], [3], [1, 4], [0, 2, 3]):  # any subset of the rows: the same bits (batch invariance)
        assert torch.equal(target.head_logits(hidden[0, rows]), full[0, rows])
    target.lazy_verify = False
    try:
        with pytest.raises(ValueError, match=r"HFCausalLM.forward_hidden: needs the lean forward on the CPU with a "
                                             r"batch-invariant LM head and lazy_verify on"):
            target.forward_hidden(cache, tokens, depths, mask)
    finally:
        target.lazy_verify = True


# ----------------------------------------------------------------------------- the argmax head of plain steps
class _Counting:
    """Counts a target's forward_argmax calls (the plain steps that took the head's argmax op)."""

    def __init__(self, target):
        self.target, self.calls, self.orig = target, 0, target.forward_argmax

    def __enter__(self):
        def counted(*a, **k):
            self.calls += 1
            return self.orig(*a, **k)
        self.target.forward_argmax = counted
        return self

    def __exit__(self, *exc):
        del self.target.forward_argmax


@pytest.mark.parametrize("kv", ["dense", "paged"])
def test_plain_steps_take_the_argmax_head(lms, kv):
    """Greedy plain steps (no drafter, or one with nothing to propose) take forward_argmax and give the tokens of
    the logits path; sampled rows and drafters that read the step's logits keep the full forward."""
    target, _ = lms
    assert target.greedy_head
    prompts = _prompts(3, 5)
    target.argmax_head = False
    try:
        assert not target.greedy_head
        ref = SpeculativeDecoder(target, None, max_batch=3, max_len=160, kv_cache=kv).generate(
            prompts, max_new_tokens=25).tokens
        sampled_ref = SpeculativeDecoder(target, None, max_batch=3, max_len=160, kv_cache=kv).generate(
            prompts, max_new_tokens=12, temperature=0.9, seed=3).tokens
    finally:
        target.argmax_head = True
    with _Counting(target) as c:
        got = SpeculativeDecoder(target, None, max_batch=3, max_len=160, kv_cache=kv).generate(
            prompts, max_new_tokens=25).tokens
    assert got == ref and c.calls >= 24
    with _Counting(target) as c:  # lookup over random prompts: mostly nothing to propose, so plain steps
        dec = SpeculativeDecoder(target, PromptLookup(ngram=3, k=4), max_batch=3, max_len=160, policy="fixed",
                                 kv_cache=kv)
        assert dec.generate(prompts, max_new_tokens=25).tokens == ref
    assert c.calls > 0
    with _Counting(target) as c:
        sampled = SpeculativeDecoder(target, None, max_batch=3, max_len=160, kv_cache=kv).generate(
            prompts, max_new_tokens=12, temperature=0.9, seed=3).tokens
    assert sampled == sampled_ref and c.calls == 0
    with _Counting(target) as c:  # TokenRecycling learns from every step's logits: never the argmax head
        dec = SpeculativeDecoder(target, TokenRecycling(), max_batch=3, max_len=160, policy="fixed", kv_cache=kv)
        assert dec.generate(prompts, max_new_tokens=25).tokens == ref
    assert c.calls == 0


def test_forward_argmax_equals_argmax_of_forward(lms):
    target, _ = lms
    prompt = _prompts(1, 6)[0]
    tokens = torch.tensor([[5, 17, 29]])
    depths = torch.tensor([[0, 1, 2]], dtype=torch.int32)
    cache = target.new_cache(1, 64)
    target.prefill(cache, [prompt])
    lens = cache.lens.clone()
    full = target.forward(cache, tokens, depths)
    cache.lens.copy_(lens)
    got = target.forward_argmax(cache, tokens, depths)
    assert got.dtype == torch.int64 and got.shape == (1, 3) and torch.equal(got, torch.argmax(full, -1))


@pytest.mark.parametrize("make", [lambda d: DraftModel(d, k=3),
                                  lambda d: DraftModel(d, k=2, top_k=2, tree="dynamic", node_budget=6)],
                         ids=["chain", "dynamic_tree"])
def test_full_greedy_passes_walk_the_argmax_head(lms, make):
    """Greedy trees the lazy plan leaves to a full pass (mode "never") take forward_argmax and ops.greedy_verify
    on its int64 argmaxes: the tokens of plain greedy decoding."""
    target, weak = lms
    prompts = _prompts(2, 7)
    ref = SpeculativeDecoder(target, None, max_batch=2, max_len=160).generate(prompts, max_new_tokens=24).tokens
    dec = SpeculativeDecoder(target, make(weak), max_batch=2, max_len=160, policy="fixed")
    dec.engine.lazy_verify.mode = "never"
    nodes = []
    orig = target.forward_argmax

    def counted(cache, tokens, depths, mask=None):
        nodes.append(tokens.shape[1])
        return orig(cache, tokens, depths, mask)
    target.forward_argmax = counted
    try:
        assert dec.generate(prompts, max_new_tokens=24).tokens == ref
    finally:
        del target.forward_argmax
    assert max(nodes) > 1 and dec.engine.lazy_verify.steps == 0
