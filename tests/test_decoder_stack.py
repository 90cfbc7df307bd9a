"""torch.classes.specdec.DecoderStack: the lean forward's layers in one call from C++.

The stack runs exactly the per-layer decoder_layer / decoder_layer_paged calls, so a forward through
it must give the per-layer Python loop's logits, caches and captured hidden states bit for bit:
float32, int8 and group-quantized weights (with and without q8 activations), chains, trees and the
frontier form, dense and paged caches. Bad arguments get the layer op's errors, named.
"""
from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

from specdec.models import HFCausalLM  # noqa: E402
from specdec.models.quant import quantize_linear_groups, quantize_linear_int8, set_activation_quant  # noqa: E402

V = 97


def _model(precision: str, seed: int = 0):
    torch.manual_seed(seed)
    cfg = transformers.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
                                   num_key_value_heads=2, vocab_size=V)
    m = transformers.LlamaForCausalLM(cfg).eval()
    if precision == "int8":
        quantize_linear_int8(m)
    elif precision != "fp32":
        fmt, _, act = precision.partition("+")
        quantize_linear_groups(m, fmt)
        if act:
            set_activation_quant(m, "q8")
    return m


def _tree_mask(B, N, g):
    parents = [-1] + [int(torch.randint(0, i, (1,), generator=g)) for i in range(1, N)]
    anc = torch.zeros(N, N, dtype=torch.bool)
    for i, p in enumerate(parents):
        anc[i, i] = True
        while p >= 0:
            anc[i, p] = True
            p = parents[p]
    return anc.expand(B, N, N).contiguous()


@pytest.mark.parametrize("precision", ["fp32", "int8", "q4_1", "q8_0+q8", "q4_1+q8"])
@pytest.mark.parametrize("shape", ["decode", "chain", "tree"])
def test_stack_equals_the_per_layer_loop(precision, shape):
    torch.set_num_threads(1)
    lm = HFCausalLM(_model(precision))
    runner = lm._runner
    assert runner is not None and runner.stack is not None and runner.stack.num_layers() == 3
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, V, (n,), generator=g).tolist() for n in (9, 4)]
    N = dict(decode=1, chain=4, tree=6)[shape]
    tokens = torch.randint(0, V, (2, N), generator=g)
    depths = torch.arange(N)[None].expand(2, N).contiguous()
    mask = _tree_mask(2, N, g) if shape == "tree" else None
    if mask is not None:
        depths = mask.sum(-1).to(torch.int32) - 1
    out = {}
    for mode in ("stack", "loop"):
        runner.stack = runner._make_stack() if mode == "stack" else None
        cache = lm.new_cache(2, 40)
        lm.prefill(cache, prompts)
        logits = lm.forward(cache, tokens, depths, mask)
        out[mode] = (logits, [t.clone() for t in cache.k + cache.v])
    assert torch.equal(out["stack"][0], out["loop"][0])
    assert all(torch.equal(a, b) for a, b in zip(out["stack"][1], out["loop"][1]))


def test_stack_keeps_the_hidden_states_the_loop_keeps():
    torch.set_num_threads(1)
    lm = HFCausalLM(_model("q4_1+q8"))
    runner = lm._runner
    g = torch.Generator().manual_seed(5)
    tokens = torch.randint(0, V, (1, 3), generator=g)
    kept = {}
    for mode in ("stack", "loop"):
        runner.stack = runner._make_stack() if mode == "stack" else None
        runner.capture = (0, 2, -1)
        cache = lm.new_cache(1, 32)
        lm.prefill(cache, [[1, 2, 3, 4]])
        lm.forward(cache, tokens, torch.arange(3)[None])
        kept[mode] = runner.captured
        runner.capture = None
    assert len(kept["stack"]) == 3 and all(torch.equal(a, b) for a, b in zip(kept["stack"], kept["loop"]))


def test_stack_on_a_paged_cache_equals_the_loop():
    from specdec.paged_cache import PagedKVCache
    torch.set_num_threads(1)
    lm = HFCausalLM(_model("q4_1+q8"))
    runner = lm._runner
    g = torch.Generator().manual_seed(9)
    prompt = torch.randint(0, V, (11,), generator=g).tolist()
    tokens = torch.randint(0, V, (1, 4), generator=g)
    res = {}
    for mode in ("stack", "loop"):
        runner.stack = runner._make_stack() if mode == "stack" else None
        pc = PagedKVCache(3, 2, 16, num_blocks=16, block_size=4, max_requests=1)
        pc.add("r", len(prompt) + 4)
        view = pc.view()
        lm.prefill(view, [prompt])
        logits = lm.forward(view, tokens, torch.arange(4)[None])
        res[mode] = (logits, [t.clone() for t in pc.k_pages + pc.v_pages])
    assert torch.equal(res["stack"][0], res["loop"][0])
    assert all(torch.equal(a, b) for a, b in zip(res["stack"][1], res["loop"][1]))


def test_stack_errors_name_the_argument():
    lm = HFCausalLM(_model("q4_1"))
    st = lm._runner.stack
    cache = lm.new_cache(1, 16)
    x = torch.zeros(1, 1, 64)
    cos = sin = torch.zeros(1, 1, 16)
    with pytest.raises(RuntimeError, match=r"DecoderStack.forward: k_caches and v_caches must hold one cache per "
                                           r"layer \(3\), got 2 and 3"):
        st.forward(x, x, cache.k[:2], cache.v, cache.lens, cos, sin, None, 0, [], None)
    with pytest.raises(RuntimeError, match=r"DecoderStack.forward: capture must name layers in \[0, 3\), got 3"):
        st.forward(x, x, cache.k, cache.v, cache.lens, cos, sin, None, 0, [3], None)
    before = [t.clone() for t in cache.k]
    with pytest.raises(RuntimeError, match=r"decoder_layer: "):
        st.forward(x, x, cache.k, cache.v, cache.lens, torch.zeros(1, 1, 8), sin, None, 0, [], None)
    assert all(torch.equal(a, b) for a, b in zip(before, cache.k))


def test_stack_checks_later_layers_caches_after_the_first_forward():
    """Once a forward has passed every layer's checks, later layers are compared with layer 0 (no probes): a
    cache of another shape, dtype or layout is still refused, by name, before any layer writes."""
    lm = HFCausalLM(_model("q4_1"))
    st = lm._runner.stack
    cache = lm.new_cache(1, 16)
    H = int(lm.model.config.hidden_size)
    D = cache.head_dim
    x = torch.zeros(1, 1, H)
    cos, sin = torch.ones(1, 1, D), torch.zeros(1, 1, D)
    st.forward(x, x, cache.k, cache.v, cache.lens, cos, sin, None, 0, [], None)  # trusted from here on
    before = [t.clone() for t in cache.k + cache.v]
    bad = [("a narrower cache", cache.k[:2] + [cache.k[2][..., :8].contiguous()], r"k_caches\[2\] must be"),
           ("another dtype", cache.k[:1] + [cache.k[1].double()] + cache.k[2:],
            r"k_caches\[1\] must be Float .* got Double"),
           ("a transposed view", cache.k[:2] + [cache.k[2].transpose(2, 3).contiguous().transpose(2, 3)],
            r"k_caches\[2\] must be .* with strides")]
    for what, ks, msg in bad:
        with pytest.raises(RuntimeError, match=r"DecoderStack.forward: " + msg):
            st.forward(x, x, ks, cache.v, cache.lens, cos, sin, None, 0, [], None)
    with pytest.raises(RuntimeError, match=r"DecoderStack.forward: k_caches\[1\] and v_caches\[1\] must be distinct"):
        st.forward(x, x, cache.k, cache.v[:1] + [cache.k[1]] + cache.v[2:], cache.lens, cos, sin, None, 0, [], None)
    assert all(torch.equal(a, b) for a, b in zip(before, cache.k + cache.v))
    # and the trusted forward still gives the checked one's bits
    fresh = HFCausalLM(_model("q4_1"))._runner.stack
    c2 = lm.new_cache(1, 16)
    a = st.forward(x, x, cache.k, cache.v, cache.lens, cos, sin, None, 0, [], None)
    b = fresh.forward(x, x, c2.k, c2.v, c2.lens, cos, sin, None, 0, [], None)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])


def test_stack_output_buffers_are_new_to_each_forward():
    """The float32 CPU layers alternate two output pairs made per forward (specdec._C.set_stack_buffers): a
    forward's results stay intact through the next forward, and the switch changes no bit."""
    from specdec import _C

    torch.set_num_threads(1)
    lm = HFCausalLM(_model("q4_1+q8"))
    g = torch.Generator().manual_seed(5)
    prompt = torch.randint(0, V, (7,), generator=g).tolist()
    tokens = torch.randint(0, V, (1, 3), generator=g)
    depths = torch.arange(3)[None]
    results = {}
    for on in (True, False):
        was = _C.set_stack_buffers(on)
        try:
            cache = lm.new_cache(1, 40)
            lm.prefill(cache, [prompt])
            first = lm.forward_hidden(cache, tokens, depths)
            kept = first.clone()
            cache.lens += 3
            second = lm.forward_hidden(cache, tokens, depths)  # the next positions: other values
            assert torch.equal(first, kept) and not torch.equal(first, second)
            assert first.untyped_storage().data_ptr() != second.untyped_storage().data_ptr()
            results[on] = (kept, second)
        finally:
            _C.set_stack_buffers(was)
    assert all(torch.equal(a, b) for a, b in zip(results[True], results[False]))
