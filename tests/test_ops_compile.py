"""torch.library.opcheck on every op, and torch.compile(fullgraph=True) through the ops.

opcheck runs the default test set (test_schema: the schema's alias / mutation
annotations match what the kernel does — append_kv and kv_commit mutate their cache
arguments and kv_commit also cache_lens; test_autograd_registration; test_faketensor:
the fake impls in specdec/ops.py agree with the kernels on shapes / dtypes / devices;
test_aot_dispatch_dynamic: the ops trace under AOTAutograd with dynamic shapes,
mutations functionalized). The compile smoke tests use backend "aot_eager" (traces
through the fake impls and functionalization, no C++ codegen, fast on 2 cores), plus
one tiny inductor graph.
"""
from __future__ import annotations

import pytest
import torch

from specdec import ops, reference

from conftest import DEVICES, gen, make_trees

SD = torch.ops.specdec


def _attention_args(device, dtype, with_mask):
    g = gen(0)
    B, N, Hq, Hkv, D, S = 3, 5, 4, 2, 64, 32
    q = torch.randn(B, N, Hq, D, generator=g).to(dtype)
    k = torch.randn(B, Hkv, S, D, generator=g).to(dtype)
    v = torch.randn(B, Hkv, S, D, generator=g).to(dtype)
    lens = torch.tensor([0, 1, 20], dtype=torch.int32)
    _, parents, _ = make_trees(B, N, 5, "random", g=g)
    mask = reference.tree_attention_mask(parents) if with_mask else None
    return [t if t is None else t.to(device) for t in (q, k, v, lens, mask)] + [D ** -0.5]


def _append_args(device):
    g = gen(1)
    B, Hkv, S, D, N = 3, 2, 32, 64, 5
    args = (torch.randn(B, Hkv, S, D, generator=g), torch.randn(B, Hkv, S, D, generator=g),
            torch.randn(B, Hkv, N, D, generator=g), torch.randn(B, Hkv, N, D, generator=g),
            torch.tensor([0, 3, S - N], dtype=torch.int32))
    return [t.to(device) for t in args]


def _frontier_args(device):
    """Queries for the last 3 of 5 new nodes (mask [B, 3, 5]): the dynamic-draft-tree form."""
    q, k, v, lens, mask, scale = _attention_args(device, torch.float32, True)
    return [q[:, -3:].contiguous(), k, v, lens, mask[:, -3:].contiguous(), scale]


def _append_offset_args(device):
    return _append_args(device)[:4] + [torch.tensor([0, 3, 10], dtype=torch.int32).to(device), 7]


def _tree(g, B=3, N=6, V=11):
    tokens, parents, _ = make_trees(B, N, V, "mixed", g=g, ragged=True)
    return tokens, parents


def _rejection_args(device, with_draft):
    g = gen(2)
    tokens, parents = _tree(g)
    B, N = tokens.shape
    p = torch.softmax(torch.randn(B, N, 11, generator=g), -1)
    q = torch.softmax(torch.randn(B, N, 11, generator=g), -1) if with_draft else None
    u = torch.rand(B, N, generator=g, dtype=torch.float64)
    return [t if t is None else t.to(device) for t in (tokens, parents, p, q, u)]


def _greedy_args(device, dtype):
    g = gen(3)
    tokens, parents = _tree(g)
    logits = torch.randn(*tokens.shape, 11, generator=g).to(dtype)
    return [t.to(device) for t in (tokens, parents, logits)]


def _commit_args(device):
    g = gen(4)
    B, N, S = 3, 6, 32
    _, parents, _ = make_trees(B, N, 5, "chain", g=g)
    accepted = torch.tensor([[0, 1, 2, -1, -1, -1], [0, -1, -1, -1, -1, -1], [0, 1, 2, 3, 4, 5]], dtype=torch.int32)
    accepted[0, 1:3] = torch.tensor([2, 4], dtype=torch.int32)  # a path that skips nodes: real moves
    num = torch.tensor([2, 0, 5], dtype=torch.int32)
    ks = [torch.randn(B, 2, S, 64, generator=g).to(device) for _ in range(2)]
    vs = [torch.randn(B, 2, S, 64, generator=g).to(device) for _ in range(2)]
    return [ks, vs, torch.tensor([0, 7, S - N], dtype=torch.int32).to(device), accepted.to(device), num.to(device)]


def _paged(dense, page_size, g):
    """dense [B, H, S, D] -> (pages [num_pages, page_size, H, D], block_tables [B, S / page_size] int32), shuffled."""
    B, H, S, D = dense.shape
    M = S // page_size
    tables = torch.randperm(B * M + 2, generator=g)[:B * M].view(B, M).to(torch.int32)
    pages = torch.zeros(B * M + 2, page_size, H, D, dtype=dense.dtype)
    pages[tables.long()] = dense.view(B, H, M, page_size, D).permute(0, 2, 3, 1, 4)
    return pages, tables


def _attention_paged_args(device, dtype, with_mask, page_size=16):
    q, k, v, lens, mask, scale = _attention_args("cpu", dtype, with_mask)
    g = gen(8)
    kp, tables = _paged(k, page_size, g)
    vp, _ = _paged(v, page_size, gen(8))
    return [t if t is None else t.to(device) for t in (q, kp, vp, tables, lens, mask)] + [scale]


def _append_paged_args(device, page_size=16):
    k, v, kn, vn, lens = _append_args("cpu")
    kp, tables = _paged(k, page_size, gen(9))
    vp, _ = _paged(v, page_size, gen(9))
    return [t.to(device) for t in (kp, vp, kn, vn, tables, lens)]


def _commit_paged_args(device, page_size=16):
    ks, vs, lens, accepted, num = _commit_args("cpu")
    kps = [_paged(k, page_size, gen(10))[0] for k in ks]
    vps = [_paged(v, page_size, gen(10))[0] for v in vs]
    tables = _paged(ks[0], page_size, gen(10))[1]
    return [[t.to(device) for t in kps], [t.to(device) for t in vps], tables.to(device), lens.to(device),
            accepted.to(device), num.to(device)]


def _linear_args(device, dtype, quantized, M=5):
    g = gen(5)
    x = torch.randn(M, 40, generator=g).to(dtype)
    w = torch.randn(24, 40, generator=g)
    bias = torch.randn(24, generator=g).to(dtype)
    if quantized:
        q, s = ops.quantize_weight_int8(w)
        return [x.to(device), q.to(device), bias.to(device), s.to(device)]
    return [x.to(device), w.to(dtype).to(device), bias.to(device), None]


def _packed_args(args):
    """qlinear_q8act's arguments with the weight in pack_q8act's layout."""
    x, qw, d, m, b, bits = args
    return [x, ops.pack_q8act(qw, d, m, bits), d, m, b, bits]


def _qlinear_args(device, fmt, M=3):
    g = gen(6)
    qw, d, m = ops.quantize_weight_groups(torch.randn(24, 64, generator=g), fmt)
    bias = torch.randn(24, generator=g)
    dev = lambda t: None if t is None else t.to(device)  # noqa: E731
    return [torch.randn(M, 64, generator=g).to(device), qw.to(device), d.to(device), dev(m), bias.to(device),
            8 if fmt == "q8_0" else 4]


def _fused_args(device, op, dtype):
    g = gen(7)
    if op == "rope":
        args = [torch.randn(2, 3, 4, 8, generator=g), torch.randn(2, 3, 2, 8, generator=g),
                torch.randn(2, 3, 8, generator=g), torch.randn(2, 3, 8, generator=g)]
    elif op == "silu_mul":
        args = [torch.randn(3, 40, generator=g), torch.randn(3, 40, generator=g)]
    else:
        args = [torch.randn(2, 3, 40, generator=g)] + ([torch.randn(2, 3, 40, generator=g)] if op == "add_rms_norm"
                                                        else []) + [torch.rand(40, generator=g)]
    return [t.to(dtype).to(device) for t in args] + ([1e-5] if "rms_norm" in op else [])


def _decoder_layer_args(device, layout):
    from test_ops_decoder_layer import _case

    a = _case(device, torch.float32, layout, B=2, N=3, bias=layout == "float7", seed=11)
    return [a["x"], a["h"], a["weights"], a["scales"], a["mins"], a["biases"], a["bits"], a["post_norm_weight"],
            a["post_norm_eps"], a["next_norm_weight"], a["next_norm_eps"], a["k_cache"], a["v_cache"],
            a["cache_lens"], a["cos"], a["sin"], a["tree_mask"], a["kv_offset"], a["scale"], a["num_heads"],
            a["num_kv_heads"]]


def _decoder_layer_paged_args(device, layout):
    from test_ops_decoder_layer import _case
    from test_ops_decoder_layer_paged import _paged

    a = _paged(_case(device, torch.float32, layout, B=2, N=3, bias=layout == "float7", seed=12), 8, seed=3)
    return [a["x"], a["h"], a["weights"], a["scales"], a["mins"], a["biases"], a["bits"], a["post_norm_weight"],
            a["post_norm_eps"], a["next_norm_weight"], a["next_norm_eps"], a["k_pages"], a["v_pages"],
            a["cache_lens"], a["cos"], a["sin"], a["tree_mask"], a["kv_offset"], a["scale"], a["num_heads"],
            a["num_kv_heads"], a["block_tables"]]


OPCHECK_CASES = {
    "verify_attention-fp32-mask": lambda d: (SD.verify_attention.default, _attention_args(d, torch.float32, True)),
    "verify_attention-fp16-causal": lambda d: (SD.verify_attention.default, _attention_args(d, torch.float16, False)),
    "verify_attention-bf16-mask": lambda d: (SD.verify_attention.default, _attention_args(d, torch.bfloat16, True)),
    "verify_attention-frontier": lambda d: (SD.verify_attention.default, _frontier_args(d)),
    "append_kv": lambda d: (SD.append_kv.default, _append_args(d)),
    "append_kv-offset": lambda d: (SD.append_kv.default, _append_offset_args(d)),
    "rejection_sample-q": lambda d: (SD.rejection_sample.default, _rejection_args(d, True)),
    "rejection_sample-q_none": lambda d: (SD.rejection_sample.default, _rejection_args(d, False)),
    "greedy_verify-fp32": lambda d: (SD.greedy_verify.default, _greedy_args(d, torch.float32)),
    "greedy_verify-bf16": lambda d: (SD.greedy_verify.default, _greedy_args(d, torch.bfloat16)),
    "kv_commit": lambda d: (SD.kv_commit.default, _commit_args(d)),
    "verify_attention_paged-fp32-mask": lambda d: (SD.verify_attention_paged.default,
                                                   _attention_paged_args(d, torch.float32, True)),
    "verify_attention_paged-bf16-causal-page1": lambda d: (SD.verify_attention_paged.default,
                                                           _attention_paged_args(d, torch.bfloat16, False, 1)),
    "append_kv_paged": lambda d: (SD.append_kv_paged.default, _append_paged_args(d)),
    "kv_commit_paged": lambda d: (SD.kv_commit_paged.default, _commit_paged_args(d)),
    "linear-fp32": lambda d: (SD.linear.default, _linear_args(d, torch.float32, False)),
    "linear-bf16": lambda d: (SD.linear.default, _linear_args(d, torch.bfloat16, False)),
    "linear-int8-fp32x": lambda d: (SD.linear.default, _linear_args(d, torch.float32, True)),
    "linear-fp32-prefill": lambda d: (SD.linear.default, _linear_args(d, torch.float32, False, M=40)),
    "qlinear-q4_1": lambda d: (SD.qlinear.default, _qlinear_args(d, "q4_1")),
    "qlinear-q8_0": lambda d: (SD.qlinear.default, _qlinear_args(d, "q8_0")),
    "qlinear-q4_0-prefill": lambda d: (SD.qlinear.default, _qlinear_args(d, "q4_0", M=40)),
    "qlinear_q8act-q4_1": lambda d: (SD.qlinear_q8act.default, _qlinear_args(d, "q4_1")),
    "qlinear_q8act-q8_0": lambda d: (SD.qlinear_q8act.default, _qlinear_args(d, "q8_0", M=9)),
    "qlinear_q8act-packed": lambda d: (SD.qlinear_q8act.default, _packed_args(_qlinear_args(d, "q4_1"))),
    "linear_argmax-fp32": lambda d: (SD.linear_argmax.default, _linear_args(d, torch.float32, False)),
    "linear_argmax-int8": lambda d: (SD.linear_argmax.default, _linear_args(d, torch.float32, True)),
    "qlinear_argmax-q4_1": lambda d: (SD.qlinear_argmax.default, _qlinear_args(d, "q4_1") + [False]),
    "qlinear_argmax-q8act": lambda d: (SD.qlinear_argmax.default, _qlinear_args(d, "q8_0", M=9) + [True]),
    "pack_q8act-q4_1": lambda d: (SD.pack_q8act.default, _qlinear_args(d, "q4_1")[1:4] + [4]),
    "pack_q8act-q8_0": lambda d: (SD.pack_q8act.default, _qlinear_args(d, "q8_0")[1:4] + [8]),
    "quantize_q8-fp32": lambda d: (SD.quantize_q8.default, [torch.randn(2, 3, 64, generator=gen(7)).to(d)]),
    "rms_norm-fp32": lambda d: (SD.rms_norm.default, _fused_args(d, "rms_norm", torch.float32)),
    "add_rms_norm-bf16": lambda d: (SD.add_rms_norm.default, _fused_args(d, "add_rms_norm", torch.bfloat16)),
    "rope-fp32": lambda d: (SD.rope.default, _fused_args(d, "rope", torch.float32)),
    "rope-fp16": lambda d: (SD.rope.default, _fused_args(d, "rope", torch.float16)),
    "silu_mul-fp32": lambda d: (SD.silu_mul.default, _fused_args(d, "silu_mul", torch.float32)),
    "decoder_layer-float7": lambda d: (SD.decoder_layer.default, _decoder_layer_args(d, "float7")),
    "decoder_layer-q4_1": lambda d: (SD.decoder_layer.default, _decoder_layer_args(d, "q4_1")),
    "decoder_layer_paged-float7": lambda d: (SD.decoder_layer_paged.default, _decoder_layer_paged_args(d, "float7")),
    "decoder_layer_paged-q4_1": lambda d: (SD.decoder_layer_paged.default, _decoder_layer_paged_args(d, "q4_1")),
}


@pytest.mark.parametrize("case", list(OPCHECK_CASES))
@pytest.mark.parametrize("device", DEVICES)
def test_opcheck(device, case):
    if ("pack" in case) and device != "cpu":
        pytest.skip("pack_q8act's layout is the CPU tiers' (CUDA takes the usual weight)")
    op, args = OPCHECK_CASES[case](device)
    torch.library.opcheck(op, tuple(args))  # default test_utils; raises on any failure


def test_every_op_is_opchecked():
    names = {c.split("-")[0] for c in OPCHECK_CASES}
    registered = {n.split("::", 1)[1] for n in torch._C._dispatch_get_all_op_names() if n.startswith("specdec::")}
    assert "linear" in registered and names == registered, sorted(registered ^ names)


# --------------------------------------------------------------------------- torch.compile
def decode_step(q, k_caches, v_caches, cache_lens, tree_mask, tokens, parents, target_logits):
    """One verification step: attention per layer, greedy acceptance, cache compaction."""
    outs = [ops.verify_attention(q, k, v, cache_lens, tree_mask) for k, v in zip(k_caches, v_caches)]
    accepted, num_accepted, out_tokens = ops.greedy_verify(tokens, parents, target_logits)
    ops.kv_commit(k_caches, v_caches, cache_lens, accepted, num_accepted)
    return torch.stack(outs), accepted, num_accepted, out_tokens


def _step_inputs(device, B=4, seed=5):
    g = gen(seed)
    N, Hq, Hkv, D, S, V, L = 7, 4, 2, 64, 48, 13, 2
    tokens, parents, _ = make_trees(B, N, V, "mixed", g=g, ragged=True)
    logits = torch.randn(B, N, V, generator=g)
    best = logits.argmax(-1)
    tokens = torch.where(parents >= 0, torch.gather(best, 1, parents.clamp(min=0).long()), tokens)
    inputs = dict(q=torch.randn(B, N, Hq, D, generator=g),
                  k_caches=[torch.randn(B, Hkv, S, D, generator=g) for _ in range(L)],
                  v_caches=[torch.randn(B, Hkv, S, D, generator=g) for _ in range(L)],
                  cache_lens=torch.randint(0, S - N + 1, (B,), generator=g, dtype=torch.int32),
                  tree_mask=reference.tree_attention_mask(parents), tokens=tokens, parents=parents,
                  target_logits=logits)
    return {k: ([t.to(device) for t in v] if isinstance(v, list) else v.to(device)) for k, v in inputs.items()}


def _clone(inputs):
    return {k: ([t.clone() for t in v] if isinstance(v, list) else v.clone()) for k, v in inputs.items()}


def _assert_same_step(got_in, got_out, want_in, want_out):
    for a, b in zip(got_out, want_out):
        assert a.dtype == b.dtype and torch.equal(a, b)
    assert torch.equal(got_in["cache_lens"], want_in["cache_lens"])
    for a, b in zip(got_in["k_caches"] + got_in["v_caches"], want_in["k_caches"] + want_in["v_caches"]):
        assert torch.equal(a, b)


@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
@pytest.mark.parametrize("device", DEVICES)
def test_compile_fullgraph_decode_step(device, backend):
    """fullgraph=True: the ops must trace without graph breaks (fake impls, mutation of a
    list of caches and of cache_lens). Same call on a second batch size too (recompile /
    dynamic shapes through the fake impls). Results bitwise equal to eager."""
    torch._dynamo.reset()
    step = torch.compile(decode_step, backend=backend, fullgraph=True)
    for B, seed in ((4, 5), (3, 6)):
        inputs = _step_inputs(device, B, seed)
        eager_in = _clone(inputs)
        want = decode_step(**eager_in)
        got = step(**inputs)
        _assert_same_step(inputs, got, eager_in, want)
        assert int(want[2].max()) >= 1  # the step really moved something


@pytest.mark.parametrize("device", DEVICES)
def test_compile_inductor_sampling_graph(device):
    """One small inductor graph: warping logits to probabilities (generated code) feeding
    rejection_sample (an extern call). The compiled outputs must equal the eager op run on
    the very probabilities the compiled graph produced (returned alongside), and those must
    match eager softmax to fp32 rounding."""
    torch._dynamo.reset()

    def sample(tokens, parents, logits, draft_probs, uniforms, temperature: float):
        p = torch.softmax(logits / temperature, dim=-1)
        return (p,) + tuple(ops.rejection_sample(tokens, parents, p, draft_probs, uniforms))

    tokens, parents, _, q, u = _rejection_args(device, True)
    logits = torch.randn(*tokens.shape, 11, generator=gen(7)).to(device)
    compiled = torch.compile(sample, backend="inductor", fullgraph=True)
    p, *got = compiled(tokens, parents, logits, q, u, 0.7)
    torch.testing.assert_close(p, torch.softmax(logits / 0.7, dim=-1), atol=1e-6, rtol=1e-5)
    want = reference.rejection_sample(tokens.cpu(), parents.cpu(), p.cpu(), q.cpu(), u.cpu())
    for a, b in zip(got, want):
        assert a.dtype == b.dtype and torch.equal(a.cpu(), b)
