"""SuffixDrafter, TokenRecycling, DocumentDrafter and the SuffixIndex under them.

Part 1 (always, fast): the suffix index against a brute-force search on random sequences
(hypothesis), FIFO eviction and its memory bound, the speculation tree's contract, the
recycling table against a reference update, greedy equality and ragged batches on the toy
LM, the global cache carrying over, the exact distribution of sampled tokens, bad input.
Part 2 (SmolLM2, when installed): greedy output == transformers' generate on 20 prompts for
each drafter, ragged batch of 4 == single runs, the global cache on a repeated request.
"""
from __future__ import annotations

import os
import random
import sys
from collections import Counter
from typing import Dict, List, Sequence, Tuple

import pytest
import torch
from hypothesis import given, settings, strategies as st

sys.path.insert(0, os.path.dirname(__file__))
from toy_lm import ToyLM  # noqa: E402
from test_decoding import SMOL_TEXTS, TOY_PROMPTS, _bundled, assert_sampled_exact  # noqa: E402

from specdec import _C  # noqa: E402
from specdec.decoding import SpeculativeDecoder  # noqa: E402
from specdec.drafters import DocumentDrafter, MultiDraft, StepContext, SuffixDrafter, TokenRecycling  # noqa: E402
from specdec.drafters.recycling import recycling_template  # noqa: E402


from conftest import one_thread_unless_smollm2  # noqa: E402


@pytest.fixture(autouse=True)
def _one_thread_for_toys(request):
    yield from one_thread_unless_smollm2(request)


# ============================================================================ the suffix index
def brute_continuations(docs: Sequence[Sequence[int]], ctx: Sequence[int], max_match: int, min_match: int,
                        max_depth: int) -> Tuple[int, List[Tuple[int, int]]]:
    """Longest m (min_match <= m <= min(max_match, max_depth - 1)) with ctx[-m:] followed by a token in a doc."""
    best = (0, [])
    for m in range(max(1, min_match), min(max_match, len(ctx), max_depth - 1) + 1):
        s = list(ctx[-m:])
        c: Counter = Counter()
        for d in docs:
            for j in range(len(d) - m):
                if list(d[j:j + m]) == s:
                    c[d[j + m]] += 1
        if c:
            best = (m, sorted(c.items()))
    return best


@settings(max_examples=60, deadline=None)
@given(st.lists(st.lists(st.integers(0, 3), min_size=0, max_size=40), min_size=1, max_size=6),
       st.lists(st.integers(0, 3), min_size=1, max_size=8), st.integers(2, 7), st.integers(0, 5),
       st.integers(1, 3))
def test_suffix_index_equals_brute_force(docs, ctx, max_depth, n_remove, min_match):
    idx = _C.SuffixIndex(max_depth, 0, 0, 4)
    ids = []
    for d in docs:  # half of each doc added at once, the rest by extend (the per-request path)
        i = idx.add(d[:len(d) // 2])
        idx.extend(i, d[len(d) // 2:])
        ids.append(i)
    kept = list(range(len(docs)))
    for k in random.Random(n_remove).sample(range(len(docs)), min(n_remove, len(docs) - 1)):
        idx.remove(ids[k])
        kept.remove(k)
    live = [docs[k] for k in kept]
    max_match = max_depth - 1
    mm = min(min_match, max_match)
    assert idx.continuations(ctx, max_match, mm) == brute_continuations(live, ctx, max_match, mm, max_depth)
    assert idx.num_tokens == sum(len(d) for d in live)
    assert idx.num_nodes - 1 <= max_depth * idx.num_tokens
    # the trie after removals equals a trie built from the surviving documents only
    fresh = _C.SuffixIndex(max_depth, 0, 0, 4)
    for d in live:
        fresh.add(d)
    assert fresh.num_nodes == idx.num_nodes
    for d in list(idx.doc_ids()):
        idx.remove(d)
    assert idx.num_nodes == 1 and idx.num_tokens == 0


def test_suffix_index_fifo_eviction_bounds_memory():
    rng = random.Random(0)
    budget = 3000
    idx = _C.SuffixIndex(16, budget, 0, 500)
    docs = [[rng.randrange(500) for _ in range(rng.randrange(20, 120))] for _ in range(400)]
    peak_after_fill = None
    for n, d in enumerate(docs):
        idx.add(d)
        assert idx.num_tokens <= budget
        if idx.num_tokens + 120 > budget and peak_after_fill is None:
            peak_after_fill = idx.memory_bytes()
    # the survivors are the newest documents, in order
    kept = [idx.doc_tokens(i) for i in idx.doc_ids()]
    assert kept == docs[len(docs) - len(kept):]
    assert idx.num_tokens == sum(map(len, kept))
    # measured: nodes bounded by depth * tokens, memory does not grow after the cache is full
    assert idx.num_nodes - 1 <= 16 * budget
    assert idx.memory_bytes() <= 1.5 * peak_after_fill, (idx.memory_bytes(), peak_after_fill)
    fresh = _C.SuffixIndex(16, 0, 0, 500)
    for d in kept:
        fresh.add(d)
    assert fresh.num_nodes == idx.num_nodes  # eviction really removed the old strings
    # a document longer than the budget keeps its tail; request budget
    idx.add(list(range(400)) * 10)
    assert idx.num_docs == 1 and idx.num_tokens == budget and idx.doc_tokens(idx.doc_ids()[0])[-1] == 399
    by_req = _C.SuffixIndex(8, 0, 3, 0)
    for d in docs[:10]:
        by_req.add(d)
    assert by_req.num_docs == 3 and [by_req.doc_tokens(i) for i in by_req.doc_ids()] == docs[7:10]


def test_suffix_index_bad_input_leaves_state_unchanged():
    idx = _C.SuffixIndex(8, 100, 0, 10)
    d = idx.add([1, 2, 3, 1, 2])
    before = (idx.num_nodes, idx.num_tokens, idx.continuations([1, 2], 7))
    with pytest.raises(ValueError,
                       match=r"SuffixIndex.add: token 10 at position 2 lies outside the vocabulary \[0, 10\)"):
        idx.add([1, 2, 10])
    with pytest.raises(ValueError, match=r"SuffixIndex.extend: token -1 at position 0"):
        idx.extend(d, [-1])
    with pytest.raises(ValueError, match=r"SuffixIndex.extend: no document 7"):
        idx.extend(7, [1])
    with pytest.raises(ValueError, match=r"SuffixIndex.extend: document 0 would hold 105 tokens > max_tokens = 100"):
        idx.extend(d, [1] * 100)
    with pytest.raises(ValueError, match=r"SuffixIndex.set_vocab_size: document 0 holds token 3 .* \[0, 3\)"):
        idx.set_vocab_size(3)
    assert (idx.num_nodes, idx.num_tokens, idx.continuations([1, 2], 7)) == before
    assert idx.vocab_size == 10
    with pytest.raises(ValueError, match=r"SuffixIndex: max_depth must lie in \[1, 1024\], got 0"):
        _C.SuffixIndex(0, 0, 0, 0)
    with pytest.raises(ValueError, match=r"SuffixIndex: max_tokens must be >= 1 \(or 0 = unbounded\), got -1"):
        _C.SuffixIndex(8, -1, 0, 0)


def test_speculate_tree_contract():
    rng = random.Random(1)
    a = _C.SuffixIndex(12, 0, 0, 0)
    b = _C.SuffixIndex(12, 0, 0, 0)
    for _ in range(30):
        a.add([rng.randrange(6) for _ in range(30)])
        b.add([rng.randrange(6) for _ in range(30)])
    for trial in range(200):
        ctx = [rng.randrange(6) for _ in range(rng.randrange(1, 10))]
        nodes, factor, offset, min_p = rng.randrange(1, 20), rng.choice([0.5, 1.0, 2.0]), rng.choice([0.0, 1.0]), \
            rng.choice([0.0, 0.05, 0.2])
        toks, pars, probs, m = _C.suffix_speculate([a, b], ctx, 8, 1, nodes, 6, factor, offset, min_p)
        assert len(toks) == len(pars) == len(probs) <= nodes
        depth = [0]
        for i, (p, q) in enumerate(zip(pars, probs)):
            assert 0 <= p <= i  # topological: parent is the root or an earlier node
            depth.append(depth[p] + 1)
            assert q >= min_p and (p == 0 or q <= probs[p - 1] + 1e-12)
        ma, _ = a.continuations(ctx, 8, 1)
        mb, _ = b.continuations(ctx, 8, 1)
        assert m == max(ma, mb)
        if toks:
            cap = min(6, int(factor * m + offset))
            assert max(depth) <= cap
        siblings = Counter((p, t) for p, t in zip(pars, toks))
        assert all(v == 1 for v in siblings.values())  # a trie: no duplicate child
        # a single source alone: the root's children are its match's continuations, scored by frequency
        ta, pa, qa, m1 = _C.suffix_speculate([a], ctx, 8, 1, 50, 1, 1.0, 1.0, 0.0)
        if m1:
            _, kids = a.continuations(ctx, 8, 1)
            total = sum(c for _, c in kids)
            assert sorted(zip(ta, qa)) == sorted((t, c / total) for t, c in kids)


# ============================================================================ token recycling table
def reference_table(V: int, w: int, passes) -> torch.Tensor:
    """Plain loop: for each pass, each node in order (padding skipped) overwrites its token's row."""
    table = torch.full((V, w), -1, dtype=torch.int64)
    for tokens, logits in passes:
        for b in range(tokens.shape[0]):
            for i in range(tokens.shape[1]):
                t = int(tokens[b, i])
                if t >= 0:
                    table[t] = torch.argsort(logits[b, i], descending=True, stable=True)[:w]
    return table


def reference_pairs(V: int, w: int, H: int, passes) -> Dict[int, Tuple[int, List[int]]]:
    """Plain loop for the pair table: each node in order with a known previous token (its parent's token,
    or the sequence token before the root) overwrites the row of the pair's hash: row -> (key, top-w)."""
    rows: Dict[int, Tuple[int, List[int]]] = {}
    for tokens, parents, prev_roots, logits in passes:
        for b in range(tokens.shape[0]):
            for i in range(tokens.shape[1]):
                t = int(tokens[b, i])
                p = int(parents[b, i])
                prev = int(prev_roots[b]) if p < 0 else int(tokens[b, p])
                if t < 0 or prev < 0:
                    continue
                key = prev * V + t
                rows[(key * 0x9E3779B1) & (H - 1)] = (key, torch.argsort(logits[b, i], descending=True,
                                                                         stable=True)[:w].tolist())
    return rows


class _Tree:
    def __init__(self, tokens, parents=None):
        self.tokens = tokens
        self.parents = parents if parents is not None else torch.full_like(tokens, -1)


@pytest.mark.parametrize("host_levels", [True, False])   # the C++ update on the CPU, or the torch calls
def test_token_recycling_table_equals_reference(host_levels):
    V, w = 11, 3
    g = torch.Generator().manual_seed(0)
    rec = TokenRecycling(top_w=w, node_budget=8, max_depth=3)
    rec.bind(ToyLM(vocab=V, seed=0), 2, 32)
    rec.host_levels = host_levels
    assert rec.filled_rows() == 0  # starts empty
    passes = []
    for step in range(6):
        tokens = torch.randint(0, V, (2, 5), generator=g)
        tokens[1, 3:] = -1                    # padding
        tokens[0, 4] = tokens[1, 0]           # the same token at two nodes: the later node wins
        logits = torch.randn(2, 5, V, generator=g)
        passes.append((tokens, logits))
        rec.observe_verify(_Tree(tokens), logits)
        assert torch.equal(rec.table[:V], reference_table(V, w, passes)), step
    assert (rec.table[V + 1] == -1).all()


def test_token_recycling_chunked_topk_equals_topk():
    from specdec.drafters.recycling import _topk_indices
    g = torch.Generator().manual_seed(2)
    for V in (11, 300, 2000, 49152, 50257):
        for M in (1, 5, 33):
            x = torch.randn(M, V, generator=g)
            for w in (1, 4, 8):
                assert torch.equal(_topk_indices(x, w), x.topk(w, dim=-1).indices), (V, M, w)
    x = torch.full((2, 5000), float("-inf"))   # no finite value: still token ids of the vocabulary
    x[0, 7] = 1.0
    got = _topk_indices(x, 4)
    assert int(got[0, 0]) == 7 and bool((got >= 0).all() and (got < 5000).all())


@pytest.mark.parametrize("host_levels", [True, False])
@pytest.mark.parametrize("H", [1 << 16, 4])   # 4 rows: pairs collide, the later pair owns the row
def test_token_recycling_pair_table_equals_reference(H, host_levels):
    V, w = 11, 3
    g = torch.Generator().manual_seed(1)
    rec = TokenRecycling(top_w=w, node_budget=8, max_depth=3, pair_rows=H)
    rec.bind(ToyLM(vocab=V, seed=0), 2, 32)
    rec.host_levels = host_levels
    assert rec.filled_pairs() == 0
    passes = []
    for step in range(6):
        tokens = torch.randint(0, V, (2, 5), generator=g)
        parents = torch.tensor([[-1, 0, 0, 1, 2], [-1, 0, 1, -1, -1]])
        tokens[1, 3:] = -1
        tokens[0, 4] = tokens[1, 1]
        prev_roots = torch.tensor([int(torch.randint(0, V, (1,), generator=g)), -1 if step == 2 else 4])
        logits = torch.randn(2, 5, V, generator=g)
        passes.append((tokens, parents, prev_roots, logits))
        rec._prev_roots = prev_roots          # what propose records from the sequences
        rec.observe_verify(_Tree(tokens, parents), logits)
        ref = reference_pairs(V, w, H, passes)
        got = {r: (int(rec.pair_keys[r]), rec.pair_table[r].tolist()) for r in range(H)
               if rec.pair_keys[r] != -(1 << 62)}   # the empty rows' key
        assert got == ref, step
    assert rec.filled_pairs() == len(ref)


class _BigVocab:
    vocab_size = 50257   # not a multiple of the 32-wide blocks: a scalar tail
    device = "cpu"


@pytest.mark.parametrize("context", [1, 2])
def test_token_recycling_host_update_equals_torch_update(context):
    """The C++ update of the CPU path writes exactly what the torch path writes: random trees with padding,
    repeated tokens and repeated pairs, a large vocabulary, logits with planted large values late in the row."""
    g = torch.Generator().manual_seed(5)
    V = _BigVocab.vocab_size
    host, ref = (TokenRecycling(top_w=4, context=context, pair_rows=64) for _ in range(2))
    for rec in (host, ref):
        rec.bind(_BigVocab, 4, 64)
    ref.host_levels = False
    for step in range(8):
        b, N = 1 + step % 4, 1 + (3 * step) % 13
        tokens = torch.randint(0, 40, (b, N), generator=g)     # a small range: tokens and pairs repeat
        parents = torch.full((b, N), -1, dtype=torch.int32)
        for i in range(1, N):
            parents[:, i] = int(torch.randint(0, i, (1,), generator=g))
        if b > 1:
            tokens[-1, N // 2:] = -1
            parents[-1, N // 2:] = -1
        logits = torch.randn(b, N, V, generator=g)
        logits[..., V - 3] += 6.0 * (step % 2)                   # in the tail
        logits[..., 40000 + step] += 5.0
        prev = torch.randint(-1, 40, (b,), generator=g)
        for rec in (host, ref):
            rec._prev_roots = prev.clone()
            rec.observe_verify(_Tree(tokens, parents), logits)
        # every row but the torch path's write sinks (row V of the table, row H of the pair table)
        assert torch.equal(host.table[:V], ref.table[:V]) and torch.equal(host.table[V + 1], ref.table[V + 1]), step
        if context == 2:
            assert torch.equal(host.pair_table[:64], ref.pair_table[:64]), step
            assert torch.equal(host.pair_keys[:64], ref.pair_keys[:64]), step
    assert host.filled_rows() > 10


def test_token_recycling_host_update_rejects_bad_input_unchanged():
    rec = TokenRecycling(top_w=3)
    rec.bind(ToyLM(vocab=11, seed=0), 2, 32)
    tokens = torch.tensor([[1, 2, 11]])                          # 11 is outside the vocabulary
    before = (rec.table.clone(), rec.pair_table.clone(), rec.pair_keys.clone())
    with pytest.raises(ValueError, match="TokenRecycling.observe_verify: .*token 11 outside the vocabulary of 11"):
        rec.observe_verify(_Tree(tokens, torch.tensor([[-1, 0, 1]])), torch.randn(1, 3, 11))
    with pytest.raises(ValueError, match=r"logits must be \[b, N, V\] for tokens \[1, 2\], got \[1, 3, 11\]"):
        rec.observe_verify(_Tree(tokens[:, :2], torch.tensor([[-1, 0]])), torch.randn(1, 3, 11))
    assert all(torch.equal(a, b) for a, b in zip(before, (rec.table, rec.pair_table, rec.pair_keys)))


@pytest.mark.parametrize("host_levels", [True, False])   # numpy views on the CPU, or the torch gathers
def test_token_recycling_drafts_from_the_pair_row(host_levels):
    V = 9
    rec = TokenRecycling(top_w=2, node_budget=4, max_depth=2, rank_prior=[0.6, 0.3])
    rec.bind(ToyLM(vocab=V, seed=0), 2, 32)
    rec.host_levels = host_levels
    ctx = StepContext(roots=torch.tensor([1, 1]), sequences=[[7, 1], [8, 1]], request_ids=[0, 1], budgets=[10, 10])
    rec.table[1] = torch.tensor([3, 4])       # after 1, whatever came before: 3, 4
    rec.table[3] = torch.tensor([5, 6])
    key, row = rec._pair_slot(torch.tensor([7]), torch.tensor([1]))
    rec.pair_keys[row] = key                  # after (7, 1): 2, 0
    rec.pair_table[row] = torch.tensor([2, 0])
    tree = rec.propose(ctx).tree
    kids = [{int(tree.tokens[r, i]) for i in range(1, tree.num_nodes[r]) if int(tree.parents[r, i]) == 0}
            for r in range(2)]
    assert kids == [{2, 0}, {3, 4}]           # row 0 follows its pair, row 1 (after 8, 1) the one-token row
    assert {(int(tree.tokens[1, tree.parents[1, i]]), int(tree.tokens[1, i]))
            for i in range(1, tree.num_nodes[1])} >= {(1, 3), (3, 5)}
    one = TokenRecycling(top_w=2, node_budget=4, max_depth=2, rank_prior=[0.6, 0.3], context=1)
    one.bind(ToyLM(vocab=V, seed=0), 2, 32)
    one.table.copy_(rec.table)
    assert one.pair_table is None and one.memory_bytes() < rec.memory_bytes()
    tree = one.propose(ctx).tree
    assert {int(tree.tokens[0, i]) for i in range(1, tree.num_nodes[0]) if int(tree.parents[0, i]) == 0} == {3, 4}


@pytest.mark.parametrize("host_levels", [True, False])
def test_token_recycling_proposes_from_the_table(host_levels):
    V = 9
    rec = TokenRecycling(top_w=2, node_budget=6, max_depth=3, rank_prior=[0.6, 0.3])
    rec.bind(ToyLM(vocab=V, seed=0), 2, 32)
    rec.host_levels = host_levels
    ctx = StepContext(roots=torch.tensor([1, 2]), sequences=[[0, 1], [0, 2]], request_ids=[0, 1], budgets=[10, 10])
    assert rec.propose(ctx).tree.size == 1      # cold table: root only
    rec.table[1] = torch.tensor([3, 4])
    rec.table[3] = torch.tensor([5, 6])
    tree = rec.propose(ctx).tree
    tpl = recycling_template(6, 3, [0.6, 0.3])
    assert [d for _, _, d in tpl] == sorted(d for _, _, d in tpl)
    # row 0 follows the table from root 1: children 3 (rank 0) and 4 (rank 1), then 3 -> 5, 6; row 1: root only
    got = {(int(tree.tokens[0, tree.parents[0, i]]), int(tree.tokens[0, i])) for i in range(1, tree.num_nodes[0])}
    expect = {(1, 3), (1, 4), (3, 5), (3, 6)} & {(1, 3), (1, 4), (3, 5), (3, 6)}
    assert got <= expect and (1, 3) in got and (3, 5) in got
    assert tree.num_nodes[1] == 1
    ctx.budgets[0] = 1                          # the budget cuts depth
    tree = rec.propose(ctx).tree
    assert int(tree.depths[0].max()) == 1


# ============================================================================ toy LM end to end
@pytest.fixture(scope="module")
def toy():
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    target = ToyLM(vocab=16, seed=0)
    refs = [target.greedy(p, 24) for p in TOY_PROMPTS]
    torch.set_num_threads(n)
    return target, refs


def _toy_drafter(name, refs):
    return {"suffix": lambda: SuffixDrafter(min_match=1, node_budget=8),
            "suffix-nocache": lambda: SuffixDrafter(min_match=1, use_global_cache=False),
            "recycle": lambda: TokenRecycling(top_w=3, node_budget=8, max_depth=4),
            "docs": lambda: DocumentDrafter([r[5:] for r in refs[::2]], min_match=1),
            "multi": lambda: MultiDraft([SuffixDrafter(min_match=1, node_budget=6),
                                         TokenRecycling(top_w=3, node_budget=6, max_depth=4),
                                         DocumentDrafter([r[5:] for r in refs[1::2]], min_match=1, node_budget=6)])
            }[name]()


@pytest.mark.parametrize("name", ["suffix", "suffix-nocache", "recycle", "docs", "multi"])
def test_toy_greedy_equals_plain_and_batch_equals_alone(toy, name):
    target, refs = toy
    dec = SpeculativeDecoder(target, _toy_drafter(name, refs), max_batch=8, max_len=64, policy="fixed")
    for _ in range(2):  # a second call on a warm drafter is still exact
        out = dec.generate(TOY_PROMPTS, max_new_tokens=24)
        assert out.tokens == refs
    eos = refs[1][3]  # ragged: requests finish at different steps
    out = dec.generate(TOY_PROMPTS, max_new_tokens=24, eos_token_id=eos)
    for got, ref in zip(out.tokens, refs):
        assert got == ref[:ref.index(eos) + 1 if eos in ref else len(ref)]
    for p, ref in zip(TOY_PROMPTS[:3], refs[:3]):
        assert dec.generate([p], max_new_tokens=24).tokens == [ref]
    assert out.metrics["drafted_tokens"] > 0


def test_token_recycling_host_and_torch_levels_agree(toy):
    """After real traffic (both tables filled), the numpy and torch level gathers propose the same trees."""
    target, refs = toy
    rec = TokenRecycling(top_w=3, node_budget=10, max_depth=4)
    SpeculativeDecoder(target, rec, max_batch=8, max_len=64, policy="fixed").generate(TOY_PROMPTS, max_new_tokens=24)
    assert rec.filled_pairs() > 0
    seqs = [p + r[:k] for p, r in zip(TOY_PROMPTS, refs) for k in (0, 3, 7)] + [[5]]
    ctx = StepContext(roots=torch.tensor([s[-1] for s in seqs]), sequences=seqs, request_ids=list(range(len(seqs))),
                      budgets=[4] * len(seqs))
    trees = []
    for host in (True, False):
        rec.host_levels = host
        t = rec.propose(ctx).tree
        trees.append((t.tokens.tolist(), t.parents.tolist()))
    assert trees[0] == trees[1] and max(len([x for x in row if x >= 0]) for row in trees[0][0]) > 1


def test_toy_recycling_learns_inside_multidraft(toy):
    """A TokenRecycling member of a MultiDraft sees every verify pass (its table fills and its nodes
    get accepted); the suffix member's global cache carries over as when it drafts alone."""
    target, refs = toy
    rec = TokenRecycling(top_w=3, node_budget=8, max_depth=4)
    suffix = SuffixDrafter(min_match=1, node_budget=8)
    multi = MultiDraft([suffix, rec], budgets=[7, 7])
    dec = SpeculativeDecoder(target, multi, max_batch=8, max_len=64, policy="fixed")
    assert dec.generate(TOY_PROMPTS, max_new_tokens=24).tokens == refs
    assert rec.filled_rows() >= 8   # 16-token vocabulary: the verify passes' nodes filled most rows
    suffix.clear_cache()   # only the recycling member drafts now: its table alone makes it accept
    out = SpeculativeDecoder(target, MultiDraft([rec]), max_batch=8, max_len=64,
                             policy="fixed").generate(TOY_PROMPTS, max_new_tokens=24)
    assert out.tokens == refs and out.metrics["accepted_tokens"] > 0
    assert suffix.stats()["cached_requests"] == 0


def test_toy_global_cache_carries_over(toy):
    target, refs = toy
    drafter = SuffixDrafter(min_match=1)
    dec = SpeculativeDecoder(target, drafter, max_batch=8, max_len=64, policy="fixed")
    first = dec.generate(TOY_PROMPTS, max_new_tokens=24).metrics
    assert drafter.stats()["cached_requests"] == len(TOY_PROMPTS)
    second = dec.generate(TOY_PROMPTS, max_new_tokens=24).metrics
    # per pass it drafts more (and it needs fewer passes), and it accepts more
    assert second["drafted_tokens"] / second["target_passes"] > first["drafted_tokens"] / first["target_passes"]
    assert second["accepted_tokens"] > first["accepted_tokens"]
    assert second["acceptance_rate"] > first["acceptance_rate"]
    assert second["target_passes"] < first["target_passes"]
    # without the global cache the second call is no better than the first
    cold = SuffixDrafter(min_match=1, use_global_cache=False)
    dec = SpeculativeDecoder(target, cold, max_batch=8, max_len=64, policy="fixed")
    a = dec.generate(TOY_PROMPTS, max_new_tokens=24).metrics
    b = dec.generate(TOY_PROMPTS, max_new_tokens=24).metrics
    assert a["accepted_tokens"] == b["accepted_tokens"], (a["accepted_tokens"], b["accepted_tokens"])
    assert b["accepted_tokens"] < second["accepted_tokens"]
    # eviction: a tiny budget holds at most that many tokens across calls
    small = SuffixDrafter(min_match=1, max_cached_tokens=40)
    dec = SpeculativeDecoder(target, small, max_batch=8, max_len=64, policy="fixed")
    for _ in range(3):
        assert dec.generate(TOY_PROMPTS, max_new_tokens=24).tokens == refs
        assert small.stats()["cached_tokens"] <= 40
    assert small.memory_bytes() > 0


@pytest.mark.parametrize("name", ["suffix", "recycle", "docs", "multi"])
def test_sampled_distribution_is_exact(name):
    temperature, top_k, top_p = 0.7, 5, 0.9
    target = ToyLM(vocab=8, seed=3, scale=1.0, hidden=16, heads=2, kv_heads=1)
    prompt = [1, 2, 3, 1, 2, 3, 1, 2]
    drafter = {"suffix": SuffixDrafter(min_match=1, node_budget=8),
               "recycle": TokenRecycling(top_w=3, node_budget=8, max_depth=3),
               "docs": DocumentDrafter([[3, 1, 2, 3, 4], [3, 5, 6, 1, 2, 3, 1]], min_match=1),
               "multi": MultiDraft([SuffixDrafter(min_match=1, node_budget=4),
                                    TokenRecycling(top_w=3, node_budget=5, max_depth=3),
                                    DocumentDrafter([[3, 5, 6, 1, 2, 3, 1]], min_match=1, node_budget=4)])}[name]
    # the MultiDraft merge runs on the host row by row: fewer (still thousands of) samples
    per_call, calls = (1500, 2) if name == "multi" else (4000, 3)
    n = per_call * calls
    # later calls run on a warm cache / table: still exact
    accepted = assert_sampled_exact(target, drafter, prompt, temperature, top_k, top_p, per_call, calls, 6, 7)
    assert accepted > 0.05 * n  # speculation really happened


def test_bad_inputs_name_the_drafter(toy):
    target, refs = toy
    with pytest.raises(ValueError, match=r"SuffixDrafter: max_cached_tokens must be >= 1, got 0"):
        SuffixDrafter(max_cached_tokens=0)
    with pytest.raises(ValueError, match=r"SuffixDrafter: max_cached_requests must be >= 1, got 0"):
        SuffixDrafter(max_cached_requests=0)
    with pytest.raises(ValueError, match=r"SuffixDrafter: node_budget must be >= 2, got 1"):
        SuffixDrafter(node_budget=1)
    with pytest.raises(ValueError, match=r"SuffixDrafter: max_match must be < max_depth"):
        SuffixDrafter(max_match=30, max_depth=28)
    with pytest.raises(ValueError, match=r"SuffixDrafter: min_token_prob must be a number in \[0.0, 1.0\], got 2"):
        SuffixDrafter(min_token_prob=2)
    with pytest.raises(ValueError, match=r"DocumentDrafter: docs must hold at least one document, got none"):
        DocumentDrafter([])
    with pytest.raises(ValueError, match=r"DocumentDrafter: document 1 is empty"):
        DocumentDrafter([[1, 2], []])
    with pytest.raises(TypeError, match=r"DocumentDrafter: document 0 is a string but no tokenizer"):
        DocumentDrafter(["some text"])
    with pytest.raises(TypeError, match=r"DocumentDrafter: docs must be a list of documents"):
        DocumentDrafter([1, 2, 3])
    with pytest.raises(ValueError, match=r"DocumentDrafter: document 0 holds token id -3"):
        DocumentDrafter([[1, -3]])
    # ids outside the target's vocabulary: the decoder is not built
    with pytest.raises(ValueError, match=r"DocumentDrafter: the documents do not fit the target's vocabulary: .*"
                                         r"token 16 .*\[0, 16\)"):
        SpeculativeDecoder(target, DocumentDrafter([[1, 2, 16]]), max_batch=2, max_len=64, policy="fixed")
    docs = DocumentDrafter([refs[0]], min_match=1)
    dec = SpeculativeDecoder(target, docs, max_batch=2, max_len=64, policy="fixed")
    n_docs, n_nodes = docs.index.num_docs, docs.index.num_nodes
    with pytest.raises(ValueError, match=r"DocumentDrafter: document 1 holds token id 99, outside the vocabulary "
                                         r"\[0, 16\)"):
        docs.add_documents([[1, 2], [3, 99]])  # all-or-nothing
    assert (docs.index.num_docs, docs.index.num_nodes) == (n_docs, n_nodes)
    docs.add_documents([refs[1]])             # between calls
    assert dec.generate([TOY_PROMPTS[1]], max_new_tokens=24).tokens == [refs[1]]
    with pytest.raises(ValueError, match=r"TokenRecycling: top_w must be >= 1, got 0"):
        TokenRecycling(top_w=0)
    with pytest.raises(ValueError, match=r"TokenRecycling: node_budget must be >= 2, got 1"):
        TokenRecycling(node_budget=1)
    with pytest.raises(ValueError, match=r"TokenRecycling: context must be 1 \(one-token key\) or 2"):
        TokenRecycling(context=3)
    with pytest.raises(ValueError, match=r"TokenRecycling: pair_rows must be a power of two, got 100"):
        TokenRecycling(pair_rows=100)
    with pytest.raises(ValueError, match=r"TokenRecycling: top_w = 20 exceeds the vocabulary size 16"):
        SpeculativeDecoder(target, TokenRecycling(top_w=20), max_batch=2, max_len=64, policy="fixed")
    rec = TokenRecycling(top_w=2)
    SpeculativeDecoder(target, rec, max_batch=2, max_len=64, policy="fixed")
    with pytest.raises(ValueError, match=r"TokenRecycling: already bound to a target with vocabulary 16"):
        SpeculativeDecoder(ToyLM(vocab=12, seed=0), rec, max_batch=2, max_len=64, policy="fixed")
    suffix = SuffixDrafter()
    SpeculativeDecoder(target, suffix, max_batch=2, max_len=64, policy="fixed")
    with pytest.raises(ValueError, match=r"SuffixDrafter: already bound to a target with vocabulary 16"):
        SpeculativeDecoder(ToyLM(vocab=12, seed=0), suffix, max_batch=2, max_len=64, policy="fixed")


# ============================================================================ SmolLM2
N_PROMPTS = 20
NEW_TOKENS = 20


@pytest.fixture(scope="module")
def smol():
    load_bundled, HFCausalLM = _bundled()
    model, tok = load_bundled("smollm2-135m")[:2]
    prompts = [tok(t)["input_ids"] for t in SMOL_TEXTS[:N_PROMPTS]]
    refs = []
    with torch.no_grad():
        for p in prompts:
            ids = torch.tensor([p])
            g = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                               max_new_tokens=NEW_TOKENS, pad_token_id=tok.eos_token_id)
            refs.append(g[0, len(p):].tolist())
    return dict(model=model, tok=tok, target=HFCausalLM(model), prompts=prompts, refs=refs, eos=tok.eos_token_id)


def _smol_drafter(name, smol):
    if name == "suffix":
        return SuffixDrafter()
    if name == "recycle":
        return TokenRecycling()
    texts = [t + " " + smol["tok"].decode(r) for t, r in zip(SMOL_TEXTS[:N_PROMPTS:2], smol["refs"][::2])]
    docs = DocumentDrafter(texts, tokenizer=smol["tok"])
    if name == "multi":  # the three composed: one merged tree per request
        return MultiDraft([SuffixDrafter(node_budget=8), TokenRecycling(node_budget=6), docs])
    return docs


@pytest.mark.parametrize("name", ["suffix", "recycle", "docs", "multi"])
def test_smollm2_greedy_equals_transformers_generate(smol, name):
    drafter = _smol_drafter(name, smol)
    dec = SpeculativeDecoder(smol["target"], drafter, max_batch=5, max_len=256, policy="fixed")
    prompts, refs = smol["prompts"], smol["refs"]
    got: List[List[int]] = []
    drafted = 0
    for i in range(0, len(prompts), 5):
        out = dec.generate(prompts[i:i + 5], max_new_tokens=NEW_TOKENS, eos_token_id=smol["eos"])
        got += out.tokens
        drafted += out.metrics["drafted_tokens"]
    mismatches = [i for i, (g, r) in enumerate(zip(got, refs)) if g != r]
    assert not mismatches, f"{name}: greedy output differs from transformers' generate on prompts {mismatches}"
    assert drafted > 0
    # ragged batch of 4 == each alone (same decoder, warm state)
    out = dec.generate(prompts[:4], max_new_tokens=NEW_TOKENS, eos_token_id=smol["eos"]).tokens
    alone = [dec.generate([p], max_new_tokens=NEW_TOKENS, eos_token_id=smol["eos"]).tokens[0] for p in prompts[:4]]
    assert out == alone == refs[:4]


def test_smollm2_global_cache_repeated_request(smol):
    tok = smol["tok"]
    text = ("Write a SQL query that selects the name and email of every customer from the table customers "
            "whose city is {}, ordered by name.")
    ids = [tok.apply_chat_template([{"role": "user", "content": text.format(c)}], add_generation_prompt=True,
                                   tokenize=True) for c in ("Paris", "Berlin")]
    ids = [list(x["input_ids"] if hasattr(x, "keys") else x) for x in ids]
    drafter = SuffixDrafter()
    dec = SpeculativeDecoder(smol["target"], drafter, max_batch=1, max_len=512, policy="fixed")
    plain = SpeculativeDecoder(smol["target"], None, max_batch=1, max_len=512, policy="fixed")
    first = dec.generate([ids[0]], max_new_tokens=48, eos_token_id=smol["eos"])
    second = dec.generate([ids[1]], max_new_tokens=48, eos_token_id=smol["eos"])   # related request
    cold = SpeculativeDecoder(smol["target"], SuffixDrafter(), max_batch=1, max_len=512, policy="fixed").generate(
        [ids[1]], max_new_tokens=48, eos_token_id=smol["eos"])
    assert second.tokens == cold.tokens == plain.generate([ids[1]], max_new_tokens=48,
                                                          eos_token_id=smol["eos"]).tokens
    assert second.metrics["accepted_tokens"] > cold.metrics["accepted_tokens"]
    assert second.metrics["target_passes"] < cold.metrics["target_passes"]
    again = dec.generate([ids[0]], max_new_tokens=48, eos_token_id=smol["eos"])     # repeated request
    assert again.tokens == first.tokens
    per_pass = lambda m: m["drafted_tokens"] / m["target_passes"]  # noqa: E731
    assert per_pass(again.metrics) > per_pass(first.metrics)
    assert again.metrics["accepted_tokens"] > first.metrics["accepted_tokens"]


def test_suffix_index_concurrent_reads_during_writes():
    """Readers on several threads (the GIL is released inside) see valid trees while a writer adds documents."""
    import threading
    rng = random.Random(3)
    idx = _C.SuffixIndex(10, 5000, 0, 0)
    for _ in range(20):
        idx.add([rng.randrange(8) for _ in range(50)])
    ctxs = [[rng.randrange(8) for _ in range(6)] for _ in range(50)]
    expect = [_C.suffix_speculate([idx], c, 8, 1, 12, 8, 1.0, 1.0, 0.05) for c in ctxs]
    errors: List[str] = []

    def reader(check_equal: bool) -> None:
        for _ in range(20):
            for c, e in zip(ctxs, expect):
                got = _C.suffix_speculate([idx], c, 8, 1, 12, 8, 1.0, 1.0, 0.05)
                if any(not 0 <= p <= i for i, p in enumerate(got[1])):
                    errors.append(f"invalid tree {got}")
                if check_equal and got != e:
                    errors.append(f"{c}: {got} != {e}")

    threads = [threading.Thread(target=reader, args=(True,)) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors[:3]
    writer_rng = random.Random(4)
    threads = [threading.Thread(target=reader, args=(False,)) for _ in range(2)]
    for t in threads:
        t.start()
    for _ in range(200):  # FIFO eviction keeps running under the readers
        idx.add([writer_rng.randrange(8) for _ in range(50)])
    for t in threads:
        t.join()
    assert not errors, errors[:3]
    assert idx.num_tokens <= 5000
