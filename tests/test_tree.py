"""TokenTree builders and masks, warping, and trees through the decoding loop (tiny toy model)."""
from __future__ import annotations

import math
import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))
from toy_lm import ToyLM  # noqa: E402

from specdec import reference  # noqa: E402
from specdec.decoding import SpeculativeDecoder  # noqa: E402
from specdec.drafters import CallableDrafter  # noqa: E402
from specdec.sampling import SamplingParams, warp  # noqa: E402
from specdec.tree import TokenTree, ancestor_mask  # noqa: E402


def random_parents(B: int, N: int, seed: int, ragged: bool = True) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    par = torch.full((B, N), -1, dtype=torch.int32)
    for b in range(B):
        n = int(torch.randint(1, N + 1, (1,), generator=g)) if ragged else N
        for i in range(1, n):
            par[b, i] = int(torch.randint(0, i, (1,), generator=g))
    return par


# ------------------------------------------------------------------ masks
@pytest.mark.parametrize("B,N", [(1, 1), (1, 2), (3, 5), (7, 13), (2, 40), (2, 256), (2, 300)])
def test_ancestor_mask_matches_reference(B, N):
    """Matrix doubling (N <= 256) and the generation walk (larger N) against the reference, on random
    trees and on full chains (the deepest case: depth N - 1), with and without the depth given."""
    parents = random_parents(B, N, seed=B * 100 + N)
    ref = reference.tree_attention_mask(parents)
    assert torch.equal(ancestor_mask(parents), ref)
    depth = ref.sum(-1).max().item() - 1   # ancestors of the deepest node
    assert torch.equal(ancestor_mask(parents, max_depth=depth), ref)
    chain = (torch.arange(N, dtype=torch.int32) - 1).expand(B, N).contiguous()
    assert torch.equal(ancestor_mask(chain), reference.tree_attention_mask(chain))
    assert torch.equal(ancestor_mask(chain, max_depth=N - 1), torch.ones(N, N, dtype=torch.bool).tril().expand(B, N, N))


@pytest.mark.parametrize("N", [1, 5, 31, 32, 33, 70])
def test_packed_mask_round_trip(N):
    parents = random_parents(3, N, seed=N, ragged=False)
    tree = TokenTree(torch.zeros(3, N, dtype=torch.int64), parents, torch.zeros(3, N, dtype=torch.int32), [N] * 3)
    packed = tree.packed_mask()
    W = (N + 31) // 32
    assert packed.shape == (3, N, W) and packed.dtype == torch.int32
    bits = (packed.to(torch.int64).unsqueeze(-1) >> torch.arange(32)) & 1  # [3, N, W, 32]
    unpacked = bits.flatten(-2)[..., :N].bool()
    assert torch.equal(unpacked, tree.mask())


# ------------------------------------------------------------------ builders
def test_chain_with_padding():
    tokens = torch.tensor([[5, 1, 2, 3], [6, 7, 8, 9], [4, 9, 9, 9]])
    tree = TokenTree.chain(tokens, [4, 2, 1])
    assert tree.is_chain and tree.attention_mask() is None
    assert tree.tokens.tolist() == [[5, 1, 2, 3], [6, 7, -1, -1], [4, -1, -1, -1]]
    assert tree.parents.tolist() == [[-1, 0, 1, 2], [-1, 0, -1, -1], [-1, -1, -1, -1]]
    assert tree.depths.tolist() == [[0, 1, 2, 3], [0, 1, 0, 0], [0, 0, 0, 0]]
    assert tree.num_drafted == [3, 1, 0]


def test_from_lists_mask_walks_only_as_deep_as_the_tree():
    """mask() of a from_lists tree walks max_depths generations, not N - 1: the same mask as the full
    walk on random trees of every shape (bushy, deep, ragged with padding)."""
    g = torch.Generator().manual_seed(5)
    for trial in range(40):
        B = 1 + trial % 3
        toks, pars = [], []
        for _ in range(B):
            n = int(torch.randint(1, 30, (1,), generator=g))
            bush = int(torch.randint(1, 6, (1,), generator=g))  # parents among the last `bush` nodes
            ps = [-1] + [max(0, i - int(torch.randint(1, bush + 1, (1,), generator=g))) for i in range(1, n)]
            toks.append(list(range(n)))
            pars.append(ps)
        tree = TokenTree.from_lists(toks, pars)
        assert max(tree.max_depths) == int(tree.depths.max())
        assert torch.equal(tree.mask(), ancestor_mask(tree.parents))


def test_root_only():
    tree = TokenTree.root_only(torch.tensor([3, 4]))
    assert tree.tokens.tolist() == [[3], [4]] and tree.parents.tolist() == [[-1], [-1]] and tree.size == 1


def test_from_lists_validates():
    tree = TokenTree.from_lists([[1, 2, 3, 4], [5]], [[-1, 0, 0, 1], [-1]])
    assert not tree.is_chain
    assert tree.depths.tolist() == [[0, 1, 1, 2], [0, 0, 0, 0]]
    assert TokenTree.from_lists([[1, 2, 3]], [[-1, 0, 1]]).is_chain
    with pytest.raises(ValueError, match=r"request 0 node 2: parent must lie in \[0, 2\), got 2"):
        TokenTree.from_lists([[1, 2, 3]], [[-1, 0, 2]])
    with pytest.raises(ValueError, match=r"node 0 must be the root"):
        TokenTree.from_lists([[1, 2]], [[0, 0]])


def test_from_candidates_trie_merges_prefixes():
    tree = TokenTree.from_candidates([9], [[[1, 2, 3], [1, 2, 4], [5]]], merge=True)
    # breadth-first: 9 | 1 5 | 2 | 3 4
    assert tree.tokens.tolist() == [[9, 1, 5, 2, 3, 4]]
    assert tree.parents.tolist() == [[-1, 0, 0, 1, 3, 3]]
    assert tree.depths.tolist() == [[0, 1, 1, 2, 3, 3]]


def test_from_candidates_without_merge_keeps_equal_siblings():
    tree = TokenTree.from_candidates([9], [[[1, 2], [1, 2]]], merge=False)
    assert tree.tokens.tolist() == [[9, 1, 1, 2, 2]]
    assert tree.parents.tolist() == [[-1, 0, 0, 1, 2]]


def test_from_candidates_ragged_and_budget():
    tree = TokenTree.from_candidates([9, 8], [[[1, 2, 3, 4]], []], max_nodes=3)
    assert tree.tokens.tolist() == [[9, 1, 2], [8, -1, -1]]
    assert tree.num_nodes == [3, 1] and tree.is_chain


def test_top_k_shape():
    levels = TokenTree.top_k_shape(2, 3)
    assert levels == [[0, 0], [1, 1, 2, 2], [3, 3, 4, 4, 5, 5, 6, 6]]
    assert sum(len(lv) for lv in TokenTree.top_k_shape(2, 3, node_budget=6)) == 5


# ------------------------------------------------------------------ warping
def _hf_warp(logits, temperature, top_k, top_p):
    from transformers.generation.logits_process import (TemperatureLogitsWarper, TopKLogitsWarper,
                                                        TopPLogitsWarper)
    x = TemperatureLogitsWarper(temperature)(None, logits.clone())
    if top_k:
        x = TopKLogitsWarper(top_k)(None, x)
    if top_p < 1:
        x = TopPLogitsWarper(top_p)(None, x)
    return torch.softmax(x, -1)


@pytest.mark.parametrize("temperature,top_k,top_p", [(1.0, 0, 1.0), (0.7, 0, 1.0), (0.7, 5, 1.0), (0.7, 0, 0.9),
                                                     (0.7, 5, 0.9), (1.5, 50, 0.5), (0.3, 111, 0.95)])
def test_warp_matches_transformers(temperature, top_k, top_p):
    pytest.importorskip("transformers")
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(7, 111, generator=g) * 3
    got = warp(logits, SamplingParams(temperature, top_k, top_p))
    want = _hf_warp(logits, temperature, top_k, top_p)
    # same support exactly; probabilities within float32 rounding of a softmax
    assert torch.equal(got > 0, want > 0)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(got.sum(-1), torch.ones(7), rtol=0, atol=1e-5)


def test_sampling_params_validation():
    with pytest.raises(ValueError, match="temperature"):
        SamplingParams(-0.1)
    with pytest.raises(ValueError, match="top_k"):
        SamplingParams(1.0, -1)
    with pytest.raises(ValueError, match="top_p"):
        SamplingParams(1.0, 0, 1.5)
    with pytest.raises(ValueError, match="temperature"):
        SamplingParams(math.nan)
    assert SamplingParams(0.0).greedy


# ------------------------------------------------------------------ trees through the loop
def test_tree_drafts_through_the_loop_greedy_exact():
    """Branchy proposals (the right continuation on a later branch) exercise tree masks and KV compaction."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        _tree_through_loop()
    finally:
        torch.set_num_threads(threads)


def _tree_through_loop():
    target = ToyLM(vocab=16, seed=0)
    prompts = [[1, 2, 3, 4, 5], [3, 3], [7, 1, 2, 9, 4, 4, 4, 2]]
    refs = [target.greedy(p, 20) for p in prompts]
    futures = {tuple(p): r for p, r in zip(prompts, refs)}

    def fn(ctx):
        for p, r in futures.items():
            if tuple(ctx[:len(p)]) == p:
                done = len(ctx) - len(p)
                good = r[done:done + 4]
                wrong = [(t + 1) % 16 for t in good]
                # wrong first branch, the right one second, a partial third that shares a prefix
                return [wrong, good[:2] + [(good[2] + 3) % 16] if len(good) > 2 else good, good]
        return []

    dec = SpeculativeDecoder(target, CallableDrafter(fn, max_nodes=12), max_batch=3, max_len=40)
    out = dec.generate(prompts, max_new_tokens=20)
    assert out.tokens == refs
    assert out.metrics["mean_accepted_length"] > 3.0  # the right branch was found and accepted
