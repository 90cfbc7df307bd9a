"""specdec.graphs.GraphedForward: the target forward captured in CUDA graphs per step shape.

Without a GPU the static-buffer path runs with eager forwards (capture=False): the buckets,
the copies into the static inputs, eviction and the fallbacks are tested here on the CPU; the
captured replays (equal to eager forwards, no host sync, the decoding loop unchanged) run when
a CUDA device and a CUDA build are present.
"""
from __future__ import annotations

import pytest
import torch

import specdec
from specdec import PromptLookup, SpeculativeDecoder
from specdec.graphs import GraphedForward

from conftest import HAS_CUDA
from test_models import _ancestor_mask, _depths, _tiny

PROMPTS = [[5, 17, 29, 5, 17, 29, 5], [7, 8, 9, 10, 7, 8, 9], [3, 4, 3, 4, 3, 4, 3, 4]]


def _outputs(target, drafter=None, batch=3, new=12):
    dec = SpeculativeDecoder(target, drafter, max_batch=batch, max_len=64)
    return dec.generate(PROMPTS[:batch], max_new_tokens=new).tokens


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_static_buffer_path_equals_the_model(arch):
    """capture=False: every call goes through a bucket's static buffers; same logits as lm.forward."""
    lm = specdec.HFCausalLM(_tiny(arch))
    g = GraphedForward(lm, capture=False)
    outs = []
    for m in (lm, g):
        cache = m.new_cache(2, 32)  # served by the wrapped model
        m.prefill(cache, [[5, 17, 29], [7, 8, 9, 10, 11]])
        parents = [[-1, 0, 0, 1, 2], [-1, 0, 1, 2, 3]]
        step = []
        for t in ([[3, 40, 41, 42, 43], [4, 50, 51, 52, 53]], [[6, 1, 2, 3, 4], [9, 8, 7, 6, 5]]):
            step.append(m.forward(cache, torch.tensor(t), _depths(parents), _ancestor_mask(parents)))
        step.append(m.forward(cache, torch.tensor([[3], [4]]), torch.zeros(2, 1, dtype=torch.long)))
        outs.append(step)
    for a, b in zip(*outs):
        assert torch.equal(a, b)
    assert len(g.buckets()) == 2 and g.replays == 0 and g.eager_calls == 3 and g.captures == 0


def test_decoding_through_the_wrapper_is_unchanged():
    lm = specdec.HFCausalLM(_tiny("llama"))
    want = _outputs(lm, PromptLookup(ngram=2, k=3))
    g = GraphedForward(lm, capture=False)
    assert _outputs(g, PromptLookup(ngram=2, k=3)) == want
    assert len(g.buckets()) >= 2  # several step shapes (rows, nodes)


def test_buckets_are_evicted_least_recently_used():
    lm = specdec.HFCausalLM(_tiny("llama"))
    g = GraphedForward(lm, max_graphs=2, capture=False)
    cache = lm.new_cache(1, 32)
    lm.prefill(cache, [[5, 17, 29]])
    for n in (1, 2, 1, 3):
        g.forward(cache, torch.zeros(1, n, dtype=torch.long), torch.arange(n)[None])
    shapes = [k[3] for k in g.buckets()]
    assert shapes == [(1, 1), (1, 3)], shapes  # (1, 2) was the least recently used
    g.reset()
    assert not g.buckets()


def test_fallbacks_and_errors():
    lm = specdec.HFCausalLM(_tiny("llama"))
    g = GraphedForward(lm, capture=False)
    cache = lm.new_cache(1, 16)
    lm.prefill(cache, [[5, 17, 29]])
    before = g.eager_calls
    with pytest.raises(ValueError, match="HFCausalLM.forward: tree_mask must be bool"):
        g.forward(cache, torch.zeros(1, 2, dtype=torch.long), torch.arange(2)[None], torch.ones(1, 2, 2))
    assert g.eager_calls == before + 1 and not g.buckets()  # a float mask is no bucket: lm.forward's check
    with pytest.raises(ValueError, match="HFCausalLM.forward: depths must have the shape of tokens"):
        g.forward(cache, torch.zeros(1, 2, dtype=torch.long), torch.arange(3)[None])
    assert not g.buckets()
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="GraphedForward: capture=True needs a model on a CUDA device"):
            GraphedForward(lm, capture=True)
        assert GraphedForward(lm).capture is False  # the default follows the model's device
    for bad in (0, True, 2.5):
        with pytest.raises(ValueError, match="GraphedForward: max_graphs must be an int >= 1"):
            GraphedForward(lm, max_graphs=bad)
    with pytest.raises(ValueError, match="GraphedForward: warmup must be an int >= 1"):
        GraphedForward(lm, warmup=0)
    with pytest.raises(TypeError, match="GraphedForward: lm must have a forward"):
        GraphedForward(object())


# --------------------------------------------------------------------------- CUDA
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device and a CUDA build of specdec")
@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_cuda_captured_replay_equals_eager_without_host_sync(arch):
    lm = specdec.HFCausalLM(_tiny(arch).cuda())
    g = GraphedForward(lm)
    assert g.capture
    parents = [[-1, 0, 0, 1, 2], [-1, 0, 1, 2, 3]]
    depths, mask = _depths(parents).cuda(), _ancestor_mask(parents).cuda()
    outs = []
    for m in (lm, g):
        cache = lm.new_cache(2, 32)
        lm.prefill(cache, [[5, 17, 29], [7, 8, 9, 10, 11]])
        step = []
        for i, t in enumerate(([[3, 40, 41, 42, 43], [4, 50, 51, 52, 53]], [[6, 1, 2, 3, 4], [9, 8, 7, 6, 5]],
                               [[1, 2, 3, 4, 5], [5, 4, 3, 2, 1]])):
            tokens = torch.tensor(t, device="cuda")
            if m is g and i == 2:  # a replay: no host synchronisation inside
                torch.cuda.set_sync_debug_mode("error")
                try:
                    step.append(m.forward(cache, tokens, depths, mask))
                finally:
                    torch.cuda.set_sync_debug_mode("default")
            else:
                step.append(m.forward(cache, tokens, depths, mask))
            cache.lens += 1  # the committed prefix moves between steps: the replay follows it
        outs.append(step)
    for a, b in zip(*outs):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    assert g.captures == 1 and g.replays == 3


@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device and a CUDA build of specdec")
def test_cuda_captured_decoding_equals_eager_decoding():
    lm = specdec.HFCausalLM(_tiny("llama").cuda())
    want = _outputs(lm, PromptLookup(ngram=2, k=3))
    g = GraphedForward(lm)
    assert _outputs(g, PromptLookup(ngram=2, k=3)) == want
    assert g.captures >= 2 and g.replays > g.captures
