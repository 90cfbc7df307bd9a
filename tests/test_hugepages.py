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


def _tiny(seed=0, tie=True, hidden=64, inter=160):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=300, hidden_size=hidden, intermediate_size=inter, num_hidden_layers=2,
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


def _mapped_huge(t: torch.Tensor) -> bool:
    """Whether the mapping holding t's first byte is advised MADV_HUGEPAGE ("hg" in its VmFlags)."""
    addr = t.data_ptr()
    lines = open("/proc/self/smaps").read().splitlines()
    for i, line in enumerate(lines):
        head = line.split()[0]
        if "-" in head and all(c in "0123456789abcdef-" for c in head):
            lo, hi = (int(x, 16) for x in head.split("-"))
            if lo <= addr < hi:
                flags = next(x for x in lines[i + 1:] if x.startswith("VmFlags:"))
                return " hg" in flags
    return False


def test_hugepage_copy():
    from specdec.models.hugepages import hugepage_copy

    torch.manual_seed(0)
    for shape, dtype in [((300, 18, 320), torch.uint8), ((257, 129), torch.float32), ((9000, 8), torch.int16)]:
        t = (torch.rand(shape) * 100).to(dtype)
        c = hugepage_copy(t)
        assert c.dtype == t.dtype and c.shape == t.shape and c.is_contiguous() and torch.equal(c, t)
        assert c.data_ptr() != t.data_ptr() and c.data_ptr() % 4096 == 0 and _mapped_huge(c)
    big = torch.ones(20 << 20, dtype=torch.uint8)  # more than half a chunk: a mapping of its own
    c = hugepage_copy(big)
    assert torch.equal(c, big) and _mapped_huge(c)
    small = torch.ones(100)
    assert hugepage_copy(small) is small  # under 64 KiB: nothing to gain
    strided = torch.ones(300, 300).t()
    assert hugepage_copy(strided) is strided
    copies = [hugepage_copy(torch.full((70000,), float(i))) for i in range(40)]  # several chunks, all kept
    gc.collect()
    assert all(bool((x == i).all()) for i, x in enumerate(copies))
    with pytest.raises(TypeError, match="hugepage_copy: t must be a torch.Tensor"):
        hugepage_copy([1, 2])


def test_packed_weights_in_hugepages_same_logits():
    """q8-activation layers stream pack_q8act's layout: it lands in huge pages (the default), the logits
    are those of the allocator's pages."""
    from specdec.models.quant import (q8act_packed, quantize_linear_groups, set_activation_quant,
                                      set_packed_hugepages)

    outs, packed = [], []
    for on in (False, True):
        was = set_packed_hugepages(on)
        try:
            model = _tiny(seed=7, tie=False, hidden=256, inter=512)
            model = set_activation_quant(quantize_linear_groups(model, "q4_1"), "q8")
            lm = HFCausalLM(model)
            cache = lm.new_cache(1, 32)
            outs.append(lm.prefill(cache, [[1, 2, 3, 4, 5]]))
            outs.append(lm.forward(cache, torch.tensor([[7, 8]]), torch.arange(2, dtype=torch.int32)[None]))
            packed.append(list(q8act_packed(model)))
        finally:
            set_packed_hugepages(was)
    assert torch.equal(outs[0], outs[2]) and torch.equal(outs[1], outs[3])
    big = [p for p in packed[1] if p.numel() >= (64 << 10)]
    assert big and all(_mapped_huge(p) for p in big)
    assert not any(_mapped_huge(p) for p in packed[0])
    with pytest.raises(TypeError, match="set_packed_hugepages: on must be a bool"):
        set_packed_hugepages(1)
