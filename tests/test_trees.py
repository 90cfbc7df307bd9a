"""Dynamic draft trees, MultiDraft and the tree loop end to end.

Toy models (tests/toy_lm.py) for structure, cache state and sampling exactness; the bundled
SmolLM2-135M for greedy equality with the target's own greedy output.
"""
from __future__ import annotations

import math
from collections import Counter
from typing import List

import pytest
import torch

import specdec
from specdec import CallableDrafter, DraftModel, MultiDraft, PromptLookup, SpeculativeDecoder
from specdec.drafters.base import Draft, Drafter
from specdec.tree import TokenTree

from test_decoding import SMOL_TEXTS, TOY_PROMPTS, _bundled, _exact_first3, _tv_bound, assert_sampled_exact
from toy_lm import ToyLM


# fp32 K/V of the same text computed incrementally (chunks of 1..N nodes, ops.linear on few rows,
# online softmax over the prefix) vs in one prefill (BLAS GEMM, one softmax): both round in fp32,
# differing only in summation order; |K|, |V| <= ~10 here, so a few ulps of that is ~1e-5. Any
# misplaced or stale row differs by O(1).
CACHE_ATOL = 1e-4


@pytest.fixture(scope="module")
def toy():
    target = ToyLM(vocab=12, seed=0)
    weak = ToyLM(vocab=12, seed=0)  # the target with a perturbed head: agrees on some tokens, not all
    weak.head = weak.head + 0.6 * torch.randn(weak.head.shape, generator=torch.Generator().manual_seed(9))
    # plain decoding through the same loop (itself tested equal to ToyLM.greedy in test_decoding.py)
    refs = SpeculativeDecoder(target, None, max_batch=6, max_len=64).generate(TOY_PROMPTS, max_new_tokens=24).tokens
    assert refs[0][:4] == target.greedy(TOY_PROMPTS[0], 4)
    return target, weak, refs


def _drafters(target, weak):
    return {
        "dyn-k4-w3-n8": lambda: DraftModel(target, k=4, top_k=3, node_budget=8, tree="dynamic"),
        "dyn-k5-w2-n16": lambda: DraftModel(weak, k=5, top_k=2, node_budget=16, tree="dynamic"),
        "dyn-k6-w4-n32": lambda: DraftModel(weak, k=6, top_k=4, node_budget=32, tree="dynamic"),
        "planned-k5-w2-n12": lambda: DraftModel(weak, k=5, top_k=2, node_budget=12, tree="planned"),
        "planned-k4-w3-n24": lambda: DraftModel(weak, k=4, top_k=3, node_budget=24, tree="planned"),
        "multi-dyn-lookup": lambda: MultiDraft([DraftModel(weak, k=4, top_k=2, node_budget=8, tree="dynamic"),
                                                PromptLookup(ngram=2, k=4, min_ngram=1)]),
        "multi-chain-lookup-split": lambda: MultiDraft([DraftModel(target, k=3), PromptLookup(ngram=2, k=4,
                                                                                              min_ngram=1)],
                                                       node_budget=5),
        "multi-two-models": lambda: MultiDraft([DraftModel(weak, k=3), DraftModel(target, k=3, top_k=2,
                                                                                   tree="dynamic")]),
        "multi-lookup-escalate": lambda: MultiDraft([PromptLookup(ngram=2, k=4, min_ngram=1), DraftModel(weak, k=4)],
                                                    escalate=1.0),
    }


# ------------------------------------------------------------------ greedy equality (toy)
@pytest.mark.parametrize("name", list(_drafters(None, None)))
def test_toy_tree_greedy_equals_target_greedy(toy, name):
    target, weak, refs = toy
    dec = SpeculativeDecoder(target, _drafters(target, weak)[name](), max_batch=6, max_len=64, policy="fixed")
    out = dec.generate(TOY_PROMPTS, max_new_tokens=24)
    assert out.tokens == refs
    assert out.metrics["accepted_tokens"] >= 20  # the trees were really used


# ------------------------------------------------------------------ cache state at every step
def _check_caches(dec, drafter, ctx, target_lm, draft_lm, draft_cache, pend_n, behind=False):
    """Target cache == fresh prefill of seq[:-1]; draft cache == fresh prefill of its committed part."""
    b = len(ctx.request_ids)
    lens = dec.cache.lens[:b].tolist()
    for r, seq in enumerate(ctx.sequences):
        assert lens[r] == len(seq) - 1
        fresh = target_lm.new_cache(1, len(seq) + 2)
        target_lm.prefill(fresh, [seq[:-1]])
        for l in range(fresh.num_layers):
            n = lens[r]
            got = dec.cache.gather(l, r, n) if getattr(dec.cache, "paged", False) else \
                (dec.cache.k[l][r, :, :n], dec.cache.v[l][r, :, :n])
            for g, want in zip(got, (fresh.k[l], fresh.v[l])):
                torch.testing.assert_close(g, want[0, :, :n], atol=CACHE_ATOL, rtol=0)
        if draft_cache is None:
            continue
        n = int(draft_cache.lens[r])
        if behind:  # lazy admission / after plain steps: this proposal catches up first
            assert n + int(pend_n[r]) <= len(seq) - 1
        else:
            assert n + int(pend_n[r]) == len(seq) - 1  # committed + pending = everything but the root
        if n == 0:
            continue
        fresh = draft_lm.new_cache(1, len(seq) + 2)
        draft_lm.prefill(fresh, [seq[:n]])
        for l in range(fresh.num_layers):
            got = draft_cache.gather(l, r, n) if getattr(draft_cache, "paged", False) else \
                (draft_cache.k[l][r, :, :n], draft_cache.v[l][r, :, :n])
            for g, want in zip(got, (fresh.k[l], fresh.v[l])):
                torch.testing.assert_close(g, want[0, :, :n], atol=CACHE_ATOL, rtol=0)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
@pytest.mark.parametrize("kind", ["dynamic", "planned", "multi", "chain", "spine", "multi-chain", "multi-escalate"])
def test_toy_caches_equal_fresh_prefill_after_every_commit(toy, kind, temperature):
    target, weak, refs = toy
    dm = {"chain": lambda: DraftModel(weak, k=4), "multi-chain": lambda: DraftModel(weak, k=4),
          "planned": lambda: DraftModel(weak, k=4, top_k=3, node_budget=10, tree="planned"),
          "multi-escalate": lambda: DraftModel(weak, k=4), "spine": lambda: DraftModel(weak, k=3, top_k=2)}.get(
        kind, lambda: DraftModel(weak, k=4, top_k=3, node_budget=10, tree="dynamic"))()
    if kind == "multi-escalate":  # the draft model after a lookup it skips behind (rows fall behind, then catch up)
        drafter = MultiDraft([PromptLookup(ngram=2, k=5, min_ngram=1), dm], escalate=0.5)
    elif kind.startswith("multi"):
        drafter = MultiDraft([dm, PromptLookup(ngram=2, k=5, min_ngram=1)])
    else:
        drafter = dm
    dec = SpeculativeDecoder(target, drafter, max_batch=4, max_len=64, policy="fixed")
    steps = []
    propose = drafter.propose

    def checked(ctx):
        _check_caches(dec, drafter, ctx, target, weak, dm.cache, dm._pend_n, dm._behind)
        steps.append(not dm._behind)
        return propose(ctx)

    drafter.propose = checked
    out = dec.generate(TOY_PROMPTS[:4], max_new_tokens=20, temperature=temperature, seed=3)
    assert sum(steps) >= 4  # steps whose draft cache was up to date (the first one catches up the prompts)
    if temperature == 0.0:
        assert out.tokens == [r[:20] for r in refs[:4]]


def test_dynamic_tree_is_connected_topological_and_ranked(toy):
    target, weak, _ = toy
    dm = DraftModel(weak, k=4, top_k=3, node_budget=9, tree="dynamic")
    dec = SpeculativeDecoder(target, dm, max_batch=3, max_len=64, policy="fixed")
    seen = []
    propose = dm.propose
    dm.propose = lambda ctx: seen.append(propose(ctx)) or seen[-1]
    dec.generate(TOY_PROMPTS[:3], max_new_tokens=8)
    assert seen
    for draft in seen:
        tree = draft.tree
        if tree.size == 1:
            continue
        assert tree.size <= 9 and draft.draft_probs is None
        par = tree.parents.tolist()
        dep = tree.depths.tolist()
        for r in range(tree.batch):
            assert par[r][0] == -1
            n = tree.num_nodes[r]  # rows near their token limit are cut to that depth: padding after n
            assert all(p == -1 for p in par[r][n:])
            for i in range(1, n):
                assert 0 <= par[r][i] < i and dep[r][i] == dep[r][par[r][i]] + 1
            children = {}
            for i in range(1, n):
                children.setdefault(par[r][i], []).append(tree.tokens[r, i].item())
            for p, toks in children.items():
                assert len(set(toks)) == len(toks)  # distinct deterministic siblings
        assert torch.equal(tree.mask(), specdec.reference.tree_attention_mask(tree.parents))


# ------------------------------------------------------------------ sampling exactness (whole loop)
@pytest.mark.parametrize("name", ["dynamic-sampled", "dynamic-topk", "planned-topk", "multi-two-sampled",
                                  "multi-sampled-lookup", "multi-escalate"])
def test_tree_sampled_distribution_is_exact(name):
    temperature, top_k, top_p = 1.0, 0, 1.0
    target = ToyLM(vocab=8, seed=3, scale=1.0, hidden=16, heads=2, kv_heads=1)
    draft = ToyLM(vocab=8, seed=4, scale=1.0, hidden=16, layers=1, heads=2, kv_heads=1)
    draft2 = ToyLM(vocab=8, seed=5, scale=1.5, hidden=16, layers=1, heads=2, kv_heads=1)
    prompt = [1, 2, 3, 1, 2, 3, 1, 2]
    drafter = {
        "dynamic-sampled": lambda: DraftModel(draft, k=3, top_k=2, node_budget=7, tree="dynamic"),
        "dynamic-topk": lambda: DraftModel(draft, k=3, top_k=2, node_budget=6, tree="dynamic",
                                           sampled_children=False),
        # a planned shape under the greedy rule (deterministic top-ranked children) at temperature 1
        "planned-topk": lambda: DraftModel(draft, k=3, top_k=2, node_budget=7, tree="planned",
                                           sampled_children=False),
        # sampled siblings from two different drafters under the same root
        "multi-two-sampled": lambda: MultiDraft([DraftModel(draft, k=2), DraftModel(draft2, k=2)]),
        "multi-sampled-lookup": lambda: MultiDraft([DraftModel(draft, k=3, top_k=2, tree="dynamic"),
                                                    PromptLookup(ngram=2, k=3, min_ngram=1)]),
        # escalation: the sampled draft model runs only where lookup is not trusted
        "multi-escalate": lambda: MultiDraft([PromptLookup(ngram=2, k=3, min_ngram=1), DraftModel(draft, k=3)],
                                             escalate=0.5),
    }[name]()
    per_call, calls = 2000, 4
    n = per_call * calls
    accepted = assert_sampled_exact(target, drafter, prompt, temperature, top_k, top_p, per_call, calls, 4, 11)
    assert accepted > 0.05 * n


def test_tree_sampled_siblings_beyond_a_narrow_warp_are_exact():
    """top_k = 2 sampling leaves 2 tokens, but the tree draws up to 3 children per node without
    replacement: the third repeats a drawn token as a deterministic node. The output stays exact."""
    target = ToyLM(vocab=8, seed=3, scale=1.0, hidden=16, heads=2, kv_heads=1)
    draft = ToyLM(vocab=8, seed=4, scale=1.0, hidden=16, layers=1, heads=2, kv_heads=1)
    drafter = DraftModel(draft, k=2, top_k=3, node_budget=8, tree="dynamic")
    assert max(max(c) for _, c in drafter._sampled_plan(7, 2)) >= 3  # more children than the warp keeps
    accepted = assert_sampled_exact(target, drafter, [1, 2, 3, 1, 2, 3, 1, 2], 1.0, 2, 1.0, 2000, 4, 4, 23)
    assert accepted > 0.05 * 8000


def test_tv_test_detects_a_biased_tree_sampler():
    """The bound above is not vacuous: verifying the drawn children against a q they were not drawn
    from (uniform rows instead of the draft's) skews the output, and the same test catches it."""
    target = ToyLM(vocab=8, seed=3, scale=1.0, hidden=16, heads=2, kv_heads=1)
    draft = ToyLM(vocab=8, seed=4, scale=3.0, hidden=16, layers=1, heads=2, kv_heads=1)
    prompt = [1, 2, 3, 1, 2, 3, 1, 2]

    class Biased(DraftModel):
        def propose(self, ctx):
            d = super().propose(ctx)
            if d.draft_probs is None:  # a root-only step
                return d
            return Draft(d.tree, torch.full_like(d.draft_probs, 1.0 / 8))  # the wrong q rows

    drafter = Biased(draft, k=3, top_k=2, node_budget=7, tree="dynamic")
    exact = _exact_first3(target, prompt, 1.0, 0, 1.0)
    n = 8000
    dec = SpeculativeDecoder(target, drafter, max_batch=n, max_len=len(prompt) + 6, policy="fixed")
    out = dec.generate([prompt] * n, max_new_tokens=4, temperature=1.0, seed=5)
    first: Counter = Counter()
    for x, p in exact.items():  # the first two tokens (the first comes from the prefill, the second from a tree)
        first[x[:2]] += p
    counts = Counter(tuple(t[:2]) for t in out.tokens)
    tv = 0.5 * sum(abs(counts.get(x, 0) / n - p) for x, p in first.items())
    assert tv > _tv_bound(dict(first), n)


# ------------------------------------------------------------------ edge cases
class _Fixed(Drafter):
    """Proposes fixed (tokens, parents) lists for every row (deterministic candidates)."""

    def __init__(self, tokens, parents, max_nodes=None, trusted=False):
        self.rows = (tokens, parents)
        self.max_nodes = max_nodes or len(tokens) + 1
        self.trusted = trusted
        self.accepted: List[List[int]] = []
        self.cancelled = 0

    def propose(self, ctx):  # built without TokenTree's builders, so that bad trees get through to the loop
        toks, pars = self.rows
        b = len(ctx.sequences)
        tokens = torch.tensor([[s[-1]] + list(toks) for s in ctx.sequences], dtype=torch.int64)
        parents = torch.tensor([[-1] + list(pars)] * b, dtype=torch.int32)
        depth = [0]
        for i, p in enumerate(pars, start=1):
            depth.append(depth[p] + 1 if 0 <= p < i else 1)
        depths = torch.tensor([depth] * b, dtype=torch.int32)
        return Draft(TokenTree(tokens, parents, depths, [len(toks) + 1] * b))

    def accept(self, accepted, num_accepted, num_host, foreign=None):
        self.accepted.append(list(num_host))

    def cancel(self):
        self.cancelled += 1


def test_edge_only_path_rejected_at_depth_1(toy):
    target, _, refs = toy
    wrong = (refs[0][0] + 1) % 12
    drafter = _Fixed([wrong, 3, 4], [0, 1, 2])
    dec = SpeculativeDecoder(target, drafter, max_batch=1, max_len=64, policy="fixed")
    out = dec.generate([TOY_PROMPTS[0]], max_new_tokens=6)
    assert out.tokens[0] == refs[0][:6]
    assert drafter.accepted[0] == [0]


def test_edge_all_padding_branches_and_deeper_than_budget(toy):
    target, weak, refs = toy

    def fn(ctx):  # an empty candidate, a long one and one that is all wrong
        return [[], list(range(12))[:10], [(ctx[-1] + 5) % 12]]

    multi = MultiDraft([CallableDrafter(fn, max_nodes=12), DraftModel(target, k=6, top_k=2, tree="dynamic")])
    dec = SpeculativeDecoder(target, multi, max_batch=3, max_len=64, policy="fixed")
    out = dec.generate(TOY_PROMPTS[:3], max_new_tokens=3)  # trees of depth 6 > the 2 tokens left
    assert out.tokens == [r[:3] for r in refs[:3]]
    assert all(n == 3 for n in out.metrics["per_request"]["new_tokens"])


def test_edge_multidraft_member_that_proposes_nothing(toy):
    target, weak, refs = toy
    nothing = CallableDrafter(lambda ctx: [], max_nodes=4)
    multi = MultiDraft([nothing, DraftModel(target, k=3, top_k=2, tree="dynamic"), PromptLookup(ngram=5, k=3)])
    dec = SpeculativeDecoder(target, multi, max_batch=6, max_len=64, policy="fixed")
    out = dec.generate(TOY_PROMPTS, max_new_tokens=16)
    assert out.tokens == [r[:16] for r in refs]


def _record_budgets(drafter) -> list:
    """The per-row budgets of every propose call of ``drafter`` (appended to the returned list)."""
    budgets = []
    propose = drafter.propose

    def spy(ctx):
        budgets.append(list(ctx.budgets))
        return propose(ctx)

    drafter.propose = spy
    return budgets


def test_multidraft_escalation_skips_the_draft_model_behind_a_trusted_member(toy):
    """escalate: a member after a trusted one drafts nothing for that row. An oracle first member (the
    target's own greedy continuation) is trusted after its first accepted proposals, so the draft model
    stops running forwards; a useless first member is never trusted, so the draft model keeps drafting.
    Greedy output equals the target's either way."""
    target, weak, refs = toy
    prompts = TOY_PROMPTS[:3]
    full = {tuple(p): p + r for p, r in zip(prompts, refs[:3])}

    def oracle(ctx):
        for p, seq in full.items():
            if list(ctx[:len(p)]) == list(p):
                return [seq[len(ctx):len(ctx) + 4]] if len(seq) > len(ctx) else []
        return []

    for first, expect_skips in ((CallableDrafter(oracle, max_nodes=5, name="oracle"), True),
                                (CallableDrafter(lambda ctx: [[(ctx[-1] + 5) % 12] * 3], max_nodes=4, name="bad"),
                                 False)):
        dm = DraftModel(weak, k=3)
        budgets = _record_budgets(dm)
        multi = MultiDraft([first, dm], escalate=2.0, gate=False)  # trust alone, no price check
        assert "escalate=2" in repr(multi)
        dec = SpeculativeDecoder(target, multi, max_batch=3, max_len=64, policy="fixed")
        out = dec.generate(prompts, max_new_tokens=24)
        assert out.tokens == [r[:24] for r in refs[:3]]
        drafting = [bs for bs in budgets if max(bs) > 0]
        if expect_skips:
            assert len(drafting) <= 3 < len(budgets)  # after the oracle is trusted: no draft forwards
            assert out.metrics["accepted_tokens"] >= 2 * 24  # the oracle's chains were accepted
        else:
            # failed from its first proposal on (a new request trusts it once): the draft model drafts
            # every step but the first and the last token's
            assert budgets[0] == [0, 0, 0] and len(drafting) >= len(budgets) - 2
    with pytest.raises(ValueError, match=r"MultiDraft: escalate must be a number > 0 .*got 0"):
        MultiDraft([PromptLookup(), DraftModel(weak, k=2)], escalate=0)


def test_multidraft_escalation_starts_new_requests_from_the_decoder_wide_average(toy):
    """A new request starts from each member's decoder-wide record: after a generate call in which the first
    member failed every proposal, the requests of the next call escalate to the draft model from their first
    step (no step spent on the junk proposal), and a first member that proposes nothing is not waited for.
    A fresh MultiDraft still trusts the first member on a request's first step. Greedy output stays exact."""
    target, weak, refs = toy
    prompts = TOY_PROMPTS[:3]
    for first in (CallableDrafter(lambda ctx: [[(ctx[-1] + 5) % 12] * 3], max_nodes=4, name="bad"),
                  CallableDrafter(lambda ctx: [[(ctx[-1] + 5) % 12] * 3] if len(ctx) % 3 else [], max_nodes=4,
                                  name="bad-or-empty")):
        dm = DraftModel(weak, k=3)
        budgets = _record_budgets(dm)
        multi = MultiDraft([first, dm], escalate=2.0, gate=False)  # trust alone, no price check
        dec = SpeculativeDecoder(target, multi, max_batch=3, max_len=64, policy="fixed")
        out = dec.generate(prompts, max_new_tokens=12)
        assert out.tokens == [r[:12] for r in refs[:3]]
        assert budgets[0] == [0, 0, 0]          # a fresh decoder: the first member is trusted once
        budgets.clear()
        out = dec.generate(prompts, max_new_tokens=12)
        assert out.tokens == [r[:12] for r in refs[:3]]
        assert min(budgets[0]) > 0              # new requests: the draft model drafts from their first step
        # ... and on every later step: a zero budget only at a request's last token (one per request)
        assert sum(x == 0 for bs in budgets for x in bs) <= len(prompts), budgets


def test_multidraft_budget_split_follows_acceptance(toy):
    target, weak, _ = toy
    good, bad = DraftModel(target, k=4), CallableDrafter(lambda ctx: [[(ctx[-1] + 7) % 12] * 4], max_nodes=5)
    multi = MultiDraft([good, bad], node_budget=6)
    assert multi.max_nodes == 6 and sum(multi.split()) == 5
    dec = SpeculativeDecoder(target, multi, max_batch=2, max_len=64, policy="fixed")
    dec.generate(TOY_PROMPTS[:2], max_new_tokens=24)
    a_good, a_bad = multi.split()
    assert a_good > a_bad >= 1 and a_good + a_bad == 5
    fixed = MultiDraft([DraftModel(target, k=4), PromptLookup(k=3)], budgets=[2, 3])
    assert fixed.split() == [2, 3] and fixed.max_nodes == 6


def test_multidraft_merges_equal_greedy_candidates(toy):
    target, _, _ = toy
    a = _Fixed([5, 6], [0, 1], trusted=True)
    b = _Fixed([5, 7, 8], [0, 1, 0], trusted=True)
    multi = MultiDraft([a, b])
    multi.bind(target, 2, 32)
    multi.start([[1, 2]], specdec.sampling.SamplingParams(0.0, 0, 1.0), torch.Generator())
    ctx = specdec.drafters.StepContext(roots=torch.tensor([2]), sequences=[[1, 2]], request_ids=[0], budgets=[8])
    draft = multi.propose(ctx)
    assert draft.tree.tokens.tolist() == [[2, 5, 6, 7, 8]]
    assert draft.tree.parents.tolist() == [[-1, 0, 1, 1, 0]]
    # accept root -> 5 -> 7: a's own path is [5] and 7 is foreign to it; b owns the whole path
    multi.accept(torch.tensor([[0, 1, 3, -1, -1]], dtype=torch.int32), torch.tensor([2], dtype=torch.int32), [2])
    assert a.accepted == [[1]] and b.accepted == [[2]]


# ------------------------------------------------------------------ bad input
def test_bad_proposals_name_drafter_and_request_and_change_nothing(toy):
    target, weak, refs = toy
    cases = [
        (_Fixed([4, 5], [0, 2]), "parents must be -1 (padding) or a node index < 2"),
        (_Fixed([4, 5, 6], [0, 1, 2], max_nodes=99),
         "has 4 nodes per request (4 real), more than the 2 the caches reserve"),
        (_Fixed([4, 12], [0, 1]), "node 2 holds token 12, outside the vocabulary [0, 12)"),
    ]
    for bad, message in cases:
        dec = SpeculativeDecoder(target, bad if bad.max_nodes != 99 else _Fixed([4], [0]), max_batch=2, max_len=64,
                                policy="fixed")
        if bad.max_nodes == 99:
            dec.drafter = bad  # a drafter that proposes more nodes than it reserved
        with pytest.raises(ValueError, match="_Fixed: request 0") as info:
            dec.generate([TOY_PROMPTS[0], TOY_PROMPTS[1]], max_new_tokens=6)
        assert message in str(info.value)
        assert bad.cancelled == 1 and not bad.accepted
    # a MultiDraft member: the error names the member and the request; the other members forget the step
    dm = DraftModel(weak, k=3, top_k=2, tree="dynamic")
    for fn, message, exc in ((lambda ctx: [[3, 99]], "candidate token 99 outside the vocabulary", ValueError),
                             (lambda ctx: 5, "fn must return a list of candidate token lists, got int", TypeError),
                             (lambda ctx: [7], "each candidate must be a list of token ids, got int", TypeError)):
        multi = MultiDraft([dm, CallableDrafter(fn, name="retriever")])
        dec = SpeculativeDecoder(target, multi, max_batch=2, max_len=64, policy="fixed")
        with pytest.raises(exc, match=r"MultiDraft member 1 \(retriever\): retriever: request 0: ") as info:
            dec.generate([TOY_PROMPTS[0], TOY_PROMPTS[1]], max_new_tokens=6)
        assert message in str(info.value)
        lens = dm.cache.lens[:2].tolist()
        assert lens == [len(TOY_PROMPTS[0]), len(TOY_PROMPTS[1])]  # the draft cache is back to its prefill
        # and the decoder works afterwards
        ok = SpeculativeDecoder(target, MultiDraft([dm, PromptLookup(ngram=2, k=3)]), max_batch=2, max_len=64,
                                policy="fixed")
        assert ok.generate([TOY_PROMPTS[0]], max_new_tokens=6).tokens[0] == refs[0][:6]


def test_drafter_argument_errors(toy):
    target, weak, _ = toy
    with pytest.raises(ValueError, match="DraftModel: tree must be one of"):
        DraftModel(weak, tree="eagle")
    with pytest.raises(ValueError, match="node_budget must be an int >= 2"):
        DraftModel(weak, k=3, top_k=2, node_budget=1, tree="dynamic")
    with pytest.raises(ValueError, match="stop_threshold applies to chains and spine trees"):
        DraftModel(weak, k=3, top_k=2, tree="dynamic", stop_threshold=0.3)
    with pytest.raises(ValueError, match="stop_threshold applies to chains and spine trees, not tree='planned'"):
        DraftModel(weak, k=3, top_k=2, tree="planned", stop_threshold=0.3)
    with pytest.raises(ValueError, match="node_budget must be an int >= 2"):
        DraftModel(weak, k=3, top_k=2, node_budget=1, tree="planned")
    planned = DraftModel(weak, k=3, top_k=2, node_budget=100, tree="planned")
    assert planned.max_nodes == 100 and "tree='planned', node_budget=100" in repr(planned)
    assert DraftModel(weak, k=3, top_k=2, node_budget=100, tree="dynamic").max_nodes == 1 + 2 + 2 * 4
    with pytest.raises(ValueError, match="MultiDraft: needs at least one drafter"):
        MultiDraft([])
    with pytest.raises(TypeError, match="MultiDraft: drafter 1 must be a specdec Drafter, got str"):
        MultiDraft([PromptLookup(), "lookup"])
    p = PromptLookup()
    with pytest.raises(ValueError, match="appears twice"):
        MultiDraft([p, p])
    with pytest.raises(ValueError, match=r"budgets\[0\] must be an int >= 1"):
        MultiDraft([PromptLookup(), PromptLookup()], budgets=[0, 2])


# ------------------------------------------------------------------ SmolLM2 (real pretrained model)
SMOL_NEW = 16


@pytest.fixture(scope="module")
def smol():
    load_bundled, HFCausalLM = _bundled()
    model, tok, int8 = load_bundled("smollm2-135m", draft="int8")
    _, _, w8 = load_bundled("smollm2-135m", draft="w8")
    target = HFCausalLM(model)
    prompts = [tok(t)["input_ids"] for t in SMOL_TEXTS[:20]]
    eos = tok.eos_token_id
    # the target's own greedy output: plain decoding through the same loop (test_decoding.py checks that
    # path against transformers' generate on these prompts), anchored here on two of them
    plain = SpeculativeDecoder(target, None, max_batch=20, max_len=256)
    refs = plain.generate(prompts, max_new_tokens=SMOL_NEW, eos_token_id=eos).tokens
    with torch.no_grad():
        for p, r in list(zip(prompts, refs))[:2]:
            ids = torch.tensor([p])
            g = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=SMOL_NEW,
                               pad_token_id=eos)
            assert g[0, len(p):].tolist() == r
    return dict(target=target, int8=HFCausalLM(int8), w8=HFCausalLM(w8), prompts=prompts, refs=refs, eos=eos)


@pytest.mark.parametrize("name,rows", [("int8-dyn-k5-w2-n8", slice(0, 10)), ("w8-dyn-k6-w4-n16", slice(10, 20)),
                                       ("w8-dyn-k4-w4-n12", slice(0, 10)), ("multi-w8dyn-lookup", slice(0, 20)),
                                       ("int8-planned-k10-w2-n16", slice(10, 20))])
def test_smollm2_tree_greedy_equals_target_greedy(smol, name, rows):
    """Together >= 20 prompts with dynamic trees of budgets 8 / 12 / 16 and branchings 2 / 4, and all 20
    with MultiDraft(dynamic w8 draft + prompt lookup); ragged batches of 10."""
    make = {
        "int8-dyn-k5-w2-n8": lambda: DraftModel(smol["int8"], k=5, top_k=2, node_budget=8, tree="dynamic"),
        "w8-dyn-k6-w4-n16": lambda: DraftModel(smol["w8"], k=6, top_k=4, node_budget=16, tree="dynamic"),
        "w8-dyn-k4-w4-n12": lambda: DraftModel(smol["w8"], k=4, top_k=4, node_budget=12, tree="dynamic"),
        "int8-planned-k10-w2-n16": lambda: DraftModel(smol["int8"], k=10, top_k=2, node_budget=16, tree="planned"),
        "multi-w8dyn-lookup": lambda: MultiDraft([DraftModel(smol["w8"], k=5, top_k=3, node_budget=12,
                                                             tree="dynamic"), PromptLookup(ngram=3, k=6)]),
    }[name]
    dec = SpeculativeDecoder(smol["target"], make(), max_batch=10, max_len=256, policy="fixed")
    prompts, refs = smol["prompts"][rows], smol["refs"][rows]
    got: List[List[int]] = []
    for i in range(0, len(prompts), 10):
        got += dec.generate(prompts[i:i + 10], max_new_tokens=SMOL_NEW, eos_token_id=smol["eos"]).tokens
    bad = [i for i, (g, r) in enumerate(zip(got, refs)) if g != r]
    assert not bad, f"tree greedy output differs from the target's greedy output on prompts {bad}"


def test_smollm2_tree_ragged_batch_equals_single_runs_and_caches(smol):
    """Ragged batch of 4 == each alone; target AND draft caches == a fresh prefill at every step (w8 draft: the
    int8 dynamic-quantized copy quantizes activations per call, so its K/V legitimately depend on the call)."""
    prompts, refs = smol["prompts"][:4], smol["refs"][:4]
    dm = DraftModel(smol["w8"], k=4, top_k=3, node_budget=12, tree="dynamic")
    multi = MultiDraft([dm, PromptLookup(ngram=3, k=5)])
    dec = SpeculativeDecoder(smol["target"], multi, max_batch=4, max_len=256, policy="fixed")
    checks = []
    propose = multi.propose

    def checked(ctx):
        _check_caches(dec, multi, ctx, smol["target"], smol["w8"], dm.cache, dm._pend_n, dm._behind)
        checks.append(1)
        return propose(ctx)

    multi.propose = checked
    out = dec.generate(prompts, max_new_tokens=SMOL_NEW, eos_token_id=smol["eos"])
    multi.propose = propose
    assert out.tokens == refs and len(checks) >= 4
    alone = [dec.generate([p], max_new_tokens=SMOL_NEW, eos_token_id=smol["eos"]).tokens[0] for p in prompts]
    assert alone == refs


def test_smollm2_forward_kv_offset_checks(smol):
    target = smol["target"]
    cache = target.new_cache(1, 16)
    tokens = torch.tensor([[1, 2]])
    depths = torch.zeros(1, 2, dtype=torch.int32)
    with pytest.raises(ValueError, match="HFCausalLM.forward: kv_offset must be an int >= 0, got -1"):
        target.forward(cache, tokens, depths, None, kv_offset=-1)
    with pytest.raises(ValueError, match=r"tree_mask must be bool \[B, N, kv_offset \+ N\] = \[1, 2, 5\]"):
        target.forward(cache, tokens, depths, torch.ones(1, 2, 2, dtype=torch.bool), kv_offset=3)
    with pytest.raises(ValueError, match="kv_offset \\+ N = 17 nodes exceed the cache capacity 16"):
        target.forward(cache, tokens, depths, None, kv_offset=15)
    # kv_offset=3, mask None: the two nodes continue a chain after 3 earlier new nodes == one 5-node chain
    ids = torch.tensor([[5, 6, 7, 8, 9]])
    full = target.forward(cache, ids, torch.arange(5, dtype=torch.int32).view(1, 5))
    part = target.forward(cache, ids[:, 3:], torch.tensor([[3, 4]], dtype=torch.int32), None, kv_offset=3)
    torch.testing.assert_close(part, full[:, 3:], atol=1e-4, rtol=1e-4)


def _plan_value(plan, acc) -> float:
    """E[T] of a sampled-tree plan: 1 + the sum of its nodes' path probabilities under acc[rank]."""
    level, total = [1.0], 1.0
    for pos, counts in plan:
        nxt = [level[i] * acc[r] for i, c in zip(pos, counts) for r in range(c)]
        total += sum(nxt)
        level = nxt
    return total


@pytest.mark.parametrize("n,k,w", [(15, 6, 3), (7, 5, 2), (31, 8, 4), (15, 15, 3), (3, 2, 2)])
def test_sampled_dynamic_tree_plan(n, k, w):
    """The static shape of a sampled dynamic tree: n nodes, at most k levels, at most w parents per level
    (the draft cache's frontier slots), a spine of first-drawn children; with no limit on the parents per
    level it is the best tree under its priors (the same E[T] as scheduler.plan_tree)."""
    from specdec.drafters.draft_model import SAMPLED_RANK_ACCEPT as acc
    from specdec.scheduler import plan_tree

    lm = ToyLM(vocab=8, seed=4, hidden=16, layers=1, heads=2, kv_heads=1)
    plan = DraftModel(lm, k=k, top_k=w, node_budget=n + 1, tree="dynamic")._sampled_plan(n, k)
    assert sum(sum(c) for _, c in plan) == n and len(plan) <= k
    assert len(plan[0][0]) == 1 and all(len(pos) <= w for pos, _ in plan)
    assert all(pos[0] == 0 and max(c) <= len(acc) for pos, c in plan)  # the first child of the first node
    wide = DraftModel(lm, k=k, top_k=n, node_budget=n + 1, tree="dynamic")._sampled_plan(n, k)
    best = plan_tree(lambda d, r: acc[r] if r < len(acc) else 0.0, n + 1, max_depth=k)[2]
    assert _plan_value(wide, acc) == pytest.approx(best)
    assert _plan_value(plan, acc) <= best + 1e-12
    chain = 1.0 + sum(acc[0] ** d for d in range(1, min(n, k) + 1))
    assert _plan_value(plan, acc) > chain  # a chain of the same depth (the priors make siblings pay)


def test_sampled_dynamic_tree_expands_the_nodes_most_likely_reached():
    """Sampled dynamic trees choose each level's frontier after its draws: the nodes with the largest
    estimated P(reached) (DraftModel._reach: a first child's acceptance grows with its draft probability,
    a later sibling is reached only after the earlier ones are rejected) get the children, the most likely
    the most; every drawn node stays (exactness: test_tree_sampled_distribution_is_exact)."""
    # _reach: two children of one parent, then one child of another
    logq = torch.log(torch.tensor([[0.81, 0.04, 0.0001]]))
    got = DraftModel._reach(logq, [2, 1]).exp()[0]
    a0, a1, a2 = 0.25 + 0.6 * 0.9, 0.1 + 0.45 * 0.2, 0.25 + 0.6 * 0.01
    torch.testing.assert_close(got, torch.tensor([a0, (1 - a0) * a1, a2]))
    # in a real proposal, every expanded level-1 node is one of the level's most likely reached
    target = ToyLM(vocab=8, seed=3, scale=1.0, hidden=16, heads=2, kv_heads=1)
    draft = ToyLM(vocab=8, seed=4, scale=1.0, hidden=16, layers=1, heads=2, kv_heads=1)
    drafter = DraftModel(draft, k=3, top_k=2, node_budget=8, tree="dynamic")
    plan = drafter._sampled_plan(7, 3)
    assert len(plan[1][0]) < plan[0][1][0]  # fewer level-1 nodes expanded than drawn: the choice matters
    seen = []
    orig = drafter._propose_planned

    def spy(ctx, k, b, cache, last, drawn):
        assert drawn
        draft = orig(ctx, k, b, cache, last, drawn=drawn)
        seen.append(draft)
        return draft

    drafter._propose_planned = spy
    dec = SpeculativeDecoder(target, drafter, max_batch=4, max_len=32, policy="fixed")
    dec.generate([[1, 2, 3, 1, 2]] * 4, max_new_tokens=12, temperature=1.0, seed=3)
    assert seen
    checked = 0
    m0 = plan[0][1][0]
    for d in seen:
        tok, par, q = d.tree.tokens, d.tree.parents, d.draft_probs
        if int(d.tree.depths.max()) < len(plan):
            continue  # a step drafting fewer levels (the last tokens): another plan
        for r in range(tok.shape[0]):
            if bool((par[r, 1:] < 0).any()):
                continue  # a row cut to the depth its token limit allows
            # q rows of later siblings are renormalised: P(reached) uses the parent's original q
            q0 = q[r, 1]
            reach = DraftModel._reach(torch.log(q0[tok[r, 1:1 + m0]]).view(1, m0), [m0])[0]
            kids = {}
            for i in range(1 + m0, tok.shape[1]):
                p = int(par[r, i])
                if 1 <= p <= m0:
                    kids[p - 1] = kids.get(p - 1, 0) + 1
            assert len(kids) == len(plan[1][0])
            best = torch.topk(reach, len(kids)).values
            chosen = torch.stack([reach[j] for j in kids])
            torch.testing.assert_close(chosen.sort(descending=True).values, best)
            order = sorted(kids, key=lambda j: -float(reach[j]))
            assert [kids[j] for j in order] == sorted(kids.values(), reverse=True)
            checked += 1
    assert checked >= 4


# ------------------------------------------------------------------ calibrated ranking (greedy rule)
def _spy_steps(dm):
    """Record every step of a DraftModel: its tree, depth k, accepted path and count."""
    steps = []
    propose, accept = dm.propose, dm.accept

    def p(ctx):
        draft = propose(ctx)
        steps.append(dict(tree=draft.tree, k=dm._k_step))   # k: this step's depth (lower near the token limit)
        return draft

    def a(accepted, num, num_host, foreign=None):
        steps[-1].update(accepted=accepted.clone(), num=num.clone())
        return accept(accepted, num, num_host, foreign=foreign)

    dm.propose, dm.accept = p, a
    return steps


def test_calibration_counts_equal_a_recount_of_the_steps(toy):
    """Every node whose parent was accepted (or is the root) counts as reached in its cell (rank among its
    parent's children, floor(-log2 q) bin); accepted ones count as hits; reached q is summed."""
    target, weak, refs = toy
    dm = DraftModel(weak, k=4, top_k=3, node_budget=9, tree="dynamic")
    dec = SpeculativeDecoder(target, dm, max_batch=4, max_len=64, policy="fixed")
    steps = _spy_steps(dm)
    cells = []
    orig = dm._cal_update

    def keep(path, on_path):
        cells.append((dm._tree_cell.clone(), dm._tree_q.clone()))
        return orig(path, on_path)

    dm._cal_update = keep
    out = dec.generate(TOY_PROMPTS[:4], max_new_tokens=16)
    assert out.tokens == [r[:16] for r in refs[:4]]
    want = torch.zeros(3, 3, 10, dtype=torch.float64)
    used = 0
    for st, (cell, q) in zip([s for s in steps if s["tree"].size > 1], cells):
        tree, accepted, num = st["tree"], st["accepted"], st["num"]
        used += 1
        par = tree.parents.tolist()
        for r in range(tree.batch):
            path = {0} | {int(x) for x in accepted[r, 1:1 + int(num[r])].tolist()}
            for i in range(1, tree.size):
                if par[r][i] < 0 or par[r][i] not in path:
                    continue
                rank, b = divmod(int(cell[r, i]), 10)
                # the cell: the node's rank among its parent's top-w children (a likelier sibling ranks
                # lower) and its q's bin
                for j in range(1, tree.size):
                    if par[r][j] == par[r][i] and float(q[r, j]) > float(q[r, i]):
                        assert int(cell[r, j]) // 10 < rank
                assert b == min(9, int(math.floor(-math.log2(float(q[r, i])))))
                want[0, rank, b] += 1
                want[1, rank, b] += i in path
                want[2, rank, b] += float(q[r, i])
    assert used >= 4
    got = dm.calibration
    for j, key in enumerate(("reached", "accepted", "reached_q")):
        torch.testing.assert_close(torch.tensor(got[key], dtype=torch.float64), want[j], atol=1e-4, rtol=1e-5)
    assert want[0].sum() > want[1].sum() > 0


def test_calibrated_ranking_follows_the_measured_acceptance(toy):
    """Counts saying that first children are always accepted and later ones never turn the budget-limited
    dynamic tree into a chain (the deepest spine); counts saying that no child is ever accepted make every
    edge cost the same, and the root gets all its top-w children first (the shallowest tree).
    calibrate=False keeps the draft-probability ranking, which differs from both here."""
    target, weak, _ = toy

    def trees(calibrate, first, later):
        dm = DraftModel(weak, k=4, top_k=3, node_budget=5, tree="dynamic", calibrate=calibrate)
        dec = SpeculativeDecoder(target, dm, max_batch=4, max_len=64, policy="fixed")
        steps = _spy_steps(dm)
        if calibrate:
            cal = dm._cal.view(3, 3, 10)
            cal[0] = 1e6
            cal[2] = 1e6 * torch.pow(2.0, -torch.arange(10.0) - 0.5)
            cal[1, 0] = 1e6 * first
            cal[1, 1:] = 1e6 * later
            dm._cal_update = lambda path, on_path: None   # keep the counts as set
        dec.generate(TOY_PROMPTS[:4], max_new_tokens=12)
        return [s["tree"] for s in steps if s["tree"].size > 1 and s["k"] == 4]  # full depth: a chain fits

    def shapes(ts):
        return [tuple(t.parents[r, :t.num_nodes[r]].tolist()) for t in ts for r in range(t.batch)]

    chain = shapes(trees(True, 1.0, 1e-6))
    assert chain and all(p == tuple(range(-1, len(p) - 1)) for p in chain)
    bushy = shapes(trees(True, 1e-6, 1e-6))
    assert bushy and all(p[:4] == (-1, 0, 0, 0) for p in bushy)
    raw = shapes(trees(False, 0, 0))
    assert raw and any(p != tuple(range(-1, len(p) - 1)) for p in raw)
    assert any(p[:4] != (-1, 0, 0, 0) for p in raw)


def test_calibration_learns_and_keeps_greedy_output(toy):
    """A calibrated tree learns from every step (counts grow, accepted <= reached) and its output is the
    target's greedy output, in a ragged batch and alone; calibrate=False learns nothing."""
    target, weak, refs = toy
    dm = DraftModel(weak, k=5, top_k=2, node_budget=8, tree="dynamic")
    dec = SpeculativeDecoder(target, dm, max_batch=6, max_len=64, policy="fixed")
    assert dec.generate(TOY_PROMPTS, max_new_tokens=24).tokens == refs
    c = dm.calibration
    seen, hit = torch.tensor(c["reached"]), torch.tensor(c["accepted"])
    assert seen.sum() > 20 and bool((hit <= seen).all()) and hit.sum() > 0
    alone = [dec.generate([p], max_new_tokens=24).tokens[0] for p in TOY_PROMPTS[:2]]
    assert alone == refs[:2]
    assert torch.tensor(dm.calibration["reached"]).sum() > seen.sum()   # kept across generate calls
    raw = DraftModel(weak, k=5, top_k=2, node_budget=8, tree="dynamic", calibrate=False)
    SpeculativeDecoder(target, raw, max_batch=6, max_len=64, policy="fixed").generate(TOY_PROMPTS, max_new_tokens=8)
    assert torch.tensor(raw.calibration["reached"]).sum() == 0


def test_planned_tree_children_are_the_top_ranked_tokens_by_plan():
    """A planned tree (greedy rule): its shape is the plan of GREEDY_RANK_ACCEPT, every node's children are
    its parent's most probable draft tokens in rank order (checked against a fresh draft forward over the
    node's path), and the frontier of a level is the nodes the plan expands (estimated P(reached))."""
    from specdec.drafters.draft_model import GREEDY_RANK_ACCEPT

    target = ToyLM(vocab=12, seed=0)
    weak = ToyLM(vocab=12, seed=0)
    weak.head = weak.head + 0.6 * torch.randn(weak.head.shape, generator=torch.Generator().manual_seed(9))
    drafter = DraftModel(weak, k=4, top_k=2, node_budget=10, tree="planned")
    plan = drafter._plan(9, 4, GREEDY_RANK_ACCEPT)
    assert sum(sum(c) for _, c in plan) == 9 and len(plan) <= 4 and all(len(p) <= 2 for p, _ in plan)
    seen = []
    orig = drafter.propose

    def spy(ctx):
        d = orig(ctx)
        seen.append((list(ctx.sequences[0]), d.tree))
        return d

    drafter.propose = spy
    dec = SpeculativeDecoder(target, drafter, max_batch=1, max_len=64, policy="fixed")
    dec.generate([TOY_PROMPTS[0]], max_new_tokens=12)
    assert seen
    checked = 0
    for seq, tree in seen:
        par, tok = tree.parents[0].tolist(), tree.tokens[0].tolist()
        if min(par[1:]) < 0 or len(tok) != 10:
            continue  # a step cut short by the token limit
        for node in range(len(tok)):
            kids = [c for c in range(1, len(tok)) if par[c] == node]
            if not kids:
                continue
            path, x = [], node
            while x > 0:
                path.append(tok[x])
                x = par[x]
            ctx = seq + path[::-1]                 # committed text (root last) + the node's path
            logits = weak.full_logits(ctx)[-1]
            want = torch.topk(logits.float(), len(kids)).indices.tolist()
            assert [tok[c] for c in kids] == want, (node, kids)
            checked += 1
    assert checked >= 3


def test_tree_root_forward_has_no_padding_row_on_cpu(toy):
    """On the CPU the pending width after a tree step is exact (host memory, no sync): a row with nothing
    pending feeds its root alone, so a draft whose activations are quantized per call never sees a padding
    row (the bundled int8 copy ranked differently with one: benchmarks/results/trees_planned_2026-12-03.json)."""
    target, weak, _ = toy
    drafter = DraftModel(weak, k=4, top_k=3, node_budget=10, tree="planned")
    widths = []
    forward = weak.forward
    propose = drafter.propose
    state = {"first": False}

    def mark(ctx):
        state["first"] = True
        return propose(ctx)

    def spy_first(cache, tokens, depths, mask=None, **kw):
        if state["first"]:
            state["first"] = False
            widths.append((int(drafter._pend_n[:1].max()), tokens.shape[1]))
        return forward(cache, tokens, depths, mask, **kw)

    drafter.propose = mark
    weak.forward = spy_first
    try:
        SpeculativeDecoder(target, drafter, max_batch=1, max_len=64, policy="fixed").generate(
            [TOY_PROMPTS[0]], max_new_tokens=20)
    finally:
        del weak.forward
    root_calls = widths[1:]                     # the first proposal catches up on the prompt
    assert root_calls and all(n == pending + 1 for pending, n in root_calls), root_calls
    assert any(p == 0 for p, _ in root_calls) and any(p == 1 for p, _ in root_calls)


def test_planned_tree_learns_its_draft():
    """learn_plan: a planned greedy tree counts, per (depth, sibling rank), reached and accepted children and
    re-plans from them. With the target itself as the draft every rank-0 child is accepted: the learned
    rates move rank 0 towards 1 and the siblings towards 0 at every depth, and the plan turns into a spine
    of the full depth."""
    from specdec.drafters.draft_model import GREEDY_RANK_ACCEPT, PLAN_EVERY as _PLAN_EVERY

    target = ToyLM(vocab=12, seed=0)
    drafter = DraftModel(target, k=4, top_k=2, node_budget=8, tree="planned", learn_plan=True)
    dec = SpeculativeDecoder(target, drafter, max_batch=1, max_len=64, policy="fixed")
    first = drafter._plan(7, 4, GREEDY_RANK_ACCEPT)
    for _ in range(6):
        dec.generate([TOY_PROMPTS[0]], max_new_tokens=40)
    got = drafter.rank_acceptance()
    reached, hit, table = got["reached"], got["accepted"], got["planned"]
    for rd, hd in zip(reached, hit):
        assert all(0 <= a <= r for a, r in zip(hd, rd))
        assert hd[0] == rd[0] and sum(hd[1:]) == 0
    assert reached[0][0] > 2 * _PLAN_EVERY
    assert table[0][0] > 0.85 > GREEDY_RANK_ACCEPT[0] and table[0][1] < GREEDY_RANK_ACCEPT[1]
    plan = drafter._plan(7, 4, tuple(tuple(x) for x in table))
    # a spine of the full depth k, and no sibling next to the first token (rank 1 at depth 1, observed at
    # every step, is learned worthless; deeper, fewer observations keep more of the prior); the prior's
    # plan differed
    assert len(plan) == 4 and plan[0][1] == [1] and plan != first
    out = dec.generate([TOY_PROMPTS[1]], max_new_tokens=21)
    assert out.metrics["per_request"]["target_passes"][0] <= 5   # ~5 tokens per pass: the full depth
    assert drafter.rank_acceptance()["reached"][0][0] > reached[0][0]
    fixed = DraftModel(target, k=4, top_k=2, node_budget=8, tree="planned")   # learn_plan=False: the prior's
    SpeculativeDecoder(target, fixed, max_batch=1, max_len=64, policy="fixed").generate([TOY_PROMPTS[0]], 40)
    assert fixed.rank_acceptance()["planned"] == list(GREEDY_RANK_ACCEPT)


def test_planned_tree_counts_a_weak_draft():
    target, weak = ToyLM(vocab=12, seed=0), ToyLM(vocab=12, seed=0)
    weak.head = weak.head + 0.6 * torch.randn(weak.head.shape, generator=torch.Generator().manual_seed(9))
    drafter = DraftModel(weak, k=4, top_k=3, node_budget=12, tree="planned", learn_plan=True)
    dec = SpeculativeDecoder(target, drafter, max_batch=3, max_len=64, policy="fixed")
    out = dec.generate(TOY_PROMPTS[:3], max_new_tokens=30)
    got = drafter.rank_acceptance()
    reached = [x for row in got["reached"] for x in row]
    hit = [x for row in got["accepted"] for x in row]
    assert all(0 <= a <= r for a, r in zip(hit, reached))
    assert got["accepted"][0][0] < got["reached"][0][0] and sum(sum(row[1:]) for row in got["accepted"]) > 0
    emitted = sum(len(t) for t in out.tokens)
    assert 0 < sum(hit) < emitted
