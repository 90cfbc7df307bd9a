"""specdec.models.weights_to_hugepages: the weights move into one huge-page mapping, nothing else changes."""
from __future__ import annotations

import copy
import gc
import sys

import pytest
import torch

from specdec import HFCausalLM
from specdec.models import weights_to_hugepages


pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="huge pages: Linux only")


def _tiny(seed=0, tie=True):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=300, hidden_size=64, intermediate_size=160, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=tie)
    return LlamaForCausalLM(cfg).eval()


@pytest.mark.parametrize("tie", [True, False])
def test_weights_move_and_nothing_changes(tie):
    model = _tiny(tie=tie)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    x = torch.tensor([[1, 5, 9, 42, 7]])
    with torch.no_grad():
        want = model(x).logits
    small = model.model.norm.weight.data_ptr()
    moved = weights_to_hugepages(model, min_bytes=4096)
    assert moved > 0
    after = model.state_dict()
    assert before.keys() == after.keys()
    for k in before:
        assert torch.equal(before[k], after[k]) and before[k].dtype == after[k].dtype, k
    # every qualifying weight lives in the one mapping (one span of `moved` bytes plus page padding);
    # the small norm weight did not move
    big = [p for p in model.parameters() if p.numel() * p.element_size() >= 4096]
    lo = min(p.data_ptr() for p in big)
    hi = max(p.data_ptr() + p.numel() * p.element_size() for p in big)
    assert hi - lo < moved + 4096 * len(big)
    assert model.model.norm.weight.data_ptr() == small
    if tie:
        assert model.lm_head.weight is model.model.embed_tokens.weight
    with torch.no_grad():
        assert torch.equal(model(x).logits, want)
    assert weights_to_hugepages(model, min_bytes=4096) == moved  # again: a new mapping, the same values
    with torch.no_grad():
        assert torch.equal(model(x).logits, want)
    clone = copy.deepcopy(model)  # the model stays deep-copyable
    with torch.no_grad():
        assert torch.equal(clone(x).logits, want)


def test_mapping_outlives_the_call():
    model = _tiny(seed=5)
    x = torch.tensor([[3, 1, 4, 1, 5]])
    with torch.no_grad():
        want = model(x).logits
    weights_to_hugepages(model, min_bytes=4096)
    gc.collect()
    with torch.no_grad():
        assert torch.equal(model(x).logits, want)


def test_decoding_is_unchanged():
    a, b = _tiny(seed=3), _tiny(seed=3)
    weights_to_hugepages(b, min_bytes=4096)
    outs = []
    for m in (a, b):
        lm = HFCausalLM(m)
        cache = lm.new_cache(1, 64)
        logits = lm.prefill(cache, [[1, 2, 3, 4]])
        outs.append(logits)
        tok = torch.tensor([[int(logits[0].argmax())]])
        outs.append(lm.forward(cache, tok, torch.arange(1)[None]))
    assert torch.equal(outs[0], outs[2]) and torch.equal(outs[1], outs[3])


def test_errors():
    with pytest.raises(TypeError, match="weights_to_hugepages: model must be a torch.nn.Module"):
        weights_to_hugepages("model")
    with pytest.raises(ValueError, match="min_bytes must be a positive int"):
        weights_to_hugepages(_tiny(), min_bytes=0)
