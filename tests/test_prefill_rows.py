"""ops.prefill_rows(): prompt prefill on the CPU's GEMM tiles at every row count.

* Inside the scope, a row of linear / qlinear gives the same bits whatever the number of rows
  with it (1 .. 300), for every weight type; outside it, up to 64 rows keep the few-row kernels
  (each row bit-equal to a one-row decode step), as before.
* The switch is per thread, nests, and is restored on exit and on an exception.
* HFCausalLM.prefill runs inside it: a ragged batch of prompts prefilled together gives the
  logits and the cache rows of each prompt prefilled alone, bit for bit (fp32, int8 and Q4_1
  weights), and speculative greedy decoding still equals plain greedy decoding.
"""
from __future__ import annotations

import threading

import pytest
import torch

import specdec
from specdec import _C, ops
from conftest import gen

AVX2 = bool(specdec.build_info().get("cpu_avx2", False))
needs_avx2 = pytest.mark.skipif(not AVX2, reason="the GEMM tiles need an AVX2 / FMA CPU")


def _weights(kind: str, N: int, K: int, g: torch.Generator):
    w = torch.randn(N, K, generator=g) / K ** 0.5
    bias = torch.randn(N, generator=g)
    if kind == "int8":
        q, s = ops.quantize_weight_int8(w)
        return lambda x: ops.linear(x, q, bias, s)
    if kind in ("q4_1", "q8_0"):
        q, s, m = ops.quantize_weight_groups(w, kind)
        return lambda x: ops.qlinear(x, q, s, m, bias, 4 if kind == "q4_1" else 8)
    dt = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(kind, torch.float32)
    wd, bd = w.to(dt), bias.to(dt)
    return lambda x: ops.linear(x.to(dt), wd, bd)


@needs_avx2
@pytest.mark.parametrize("kind", ["fp32", "int8", "bf16", "q4_1", "q8_0"])
@pytest.mark.parametrize("N,K", [(5, 64), (130, 576), (577, 96)])
def test_prefill_rows_do_not_depend_on_the_row_count(kind, N, K):
    g = gen(N * 31 + K)
    lin = _weights(kind, N, K, g)
    x = torch.randn(300, K, generator=g)
    with ops.prefill_rows():
        whole = lin(x[:200])            # > 64 rows: the tiles with or without the scope
        for M in (1, 2, 3, 4, 5, 8, 13, 40, 64):
            assert torch.equal(lin(x[:M]), whole[:M]), (kind, M)
        assert torch.equal(lin(x[7:10]), whole[7:10])
    few = lin(x[:40])                   # outside: the few-row kernel, every row a decode step
    steps = torch.cat([lin(x[i:i + 1]) for i in range(40)])
    assert torch.equal(few, steps)
    torch.testing.assert_close(few.float(), whole[:40].float(), rtol=2e-2 if kind in ("bf16",) else 1e-4,
                               atol=2e-2 if kind in ("bf16",) else 1e-4)


def test_prefill_rows_scope_is_per_thread_nested_and_restored():
    assert _C.cpu_prefill() is False
    seen = []
    with ops.prefill_rows():
        assert _C.cpu_prefill() is True
        t = threading.Thread(target=lambda: seen.append(_C.cpu_prefill()))
        t.start()
        t.join()
        with ops.prefill_rows():
            assert _C.cpu_prefill() is True
        assert _C.cpu_prefill() is True   # the inner scope restores the outer one's value
    assert seen == [False] and _C.cpu_prefill() is False
    with pytest.raises(RuntimeError, match="boom"):
        with ops.prefill_rows():
            raise RuntimeError("boom")
    assert _C.cpu_prefill() is False


def _tiny_llama(fmt: str):
    from transformers import LlamaConfig, LlamaForCausalLM

    from specdec.models.quant import quantize_linear_groups, quantize_linear_int8

    torch.manual_seed(5)
    cfg = LlamaConfig(vocab_size=151, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                      tie_word_embeddings=False)
    model = LlamaForCausalLM(cfg).eval()
    if fmt == "int8":
        quantize_linear_int8(model)
    elif fmt == "q4_1":
        quantize_linear_groups(model, "q4_1")
    return specdec.HFCausalLM(model)


@needs_avx2
@pytest.mark.parametrize("fmt", ["fp32", "int8", "q4_1"])
def test_batched_prefill_equals_prefill_alone_bit_for_bit(fmt):
    """Three ragged prompts prefilled as one group (87 rows: above 64) and each alone (<= 31 rows):
    before the scope the group took the tiles and the single prompts the few-row kernels."""
    lm = _tiny_llama(fmt)
    g = gen(3)
    prompts = [torch.randint(0, 151, (n,), generator=g).tolist() for n in (31, 27, 29)]
    together = lm.new_cache(3, 64)
    logits = lm.prefill(together, prompts)
    assert _C.cpu_prefill() is False
    for i, p in enumerate(prompts):
        alone = lm.new_cache(1, 64)
        one = lm.prefill(alone, [p])
        assert torch.equal(one[0], logits[i]), (fmt, i)
        n = len(p)
        for layer in range(lm.num_layers):
            assert torch.equal(alone.k[layer][0, :, :n], together.k[layer][i, :, :n]), (fmt, i, layer)
            assert torch.equal(alone.v[layer][0, :, :n], together.v[layer][i, :, :n]), (fmt, i, layer)


@pytest.mark.parametrize("fmt", ["fp32", "q4_1"])
def test_speculative_greedy_equals_plain_after_tile_prefill(fmt):
    lm = _tiny_llama(fmt)
    g = gen(9)
    prompts = [torch.randint(0, 151, (n,), generator=g).tolist() for n in (12, 40, 7, 25)]
    prompts[1][20:] = prompts[1][:20]   # something for prompt lookup to find
    plain = specdec.SpeculativeDecoder(lm, None, max_batch=4, max_len=128)
    spec = specdec.SpeculativeDecoder(lm, specdec.PromptLookup(ngram=2, k=6), max_batch=4, max_len=128)
    want = plain.generate(prompts, max_new_tokens=24).tokens
    got = spec.generate(prompts, max_new_tokens=24).tokens
    assert [list(map(int, t)) for t in got] == [list(map(int, t)) for t in want]
