"""The worked example (benchmarks/examples/compat_paged_loop.py): a paged loop calling only
specdec.compat for attention, verification and commit is greedy-identical to specdec.Engine.
A small random Llama keeps it fast; the bundled SmolLM2 run is the example's own main()."""
from __future__ import annotations

import importlib.util
import pathlib

import pytest
import torch

transformers = pytest.importorskip("transformers")

_PATH = pathlib.Path(__file__).resolve().parent.parent / "benchmarks" / "examples" / "compat_paged_loop.py"


def _example():
    spec = importlib.util.spec_from_file_location("compat_paged_loop", _PATH)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_example_loop_equals_engine_greedy():
    ex = _example()
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
    model = transformers.LlamaForCausalLM(cfg).eval()
    g = torch.Generator().manual_seed(1)
    base = torch.randint(0, 96, (6,), generator=g).tolist()
    prompts = [base * 3, torch.randint(0, 96, (9,), generator=g).tolist(), base[:4] + base]
    mine = ex.run_loop(model, prompts, 20, k=4, page_size=4)
    ref = ex.engine_greedy(model, prompts, 20)
    assert mine == ref
