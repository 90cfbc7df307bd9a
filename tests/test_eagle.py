"""EagleHead: the feature head drafter (drafting math, exactness, training, checkpoint layouts)."""
import json
import os

import pytest
import torch

transformers = pytest.importorskip("transformers")

from specdec import SpeculativeDecoder  # noqa: E402
from specdec.drafters import EagleHead, HeadConfig, HeadNet  # noqa: E402
from specdec.drafters.eagle import load_head, save_head  # noqa: E402
from specdec.drafters.eagle.data import generate_with_features  # noqa: E402
from specdec.drafters.eagle.lm import HeadLM  # noqa: E402
from specdec.drafters.eagle.net import causal_attention, rope_tables  # noqa: E402
from specdec.drafters.eagle.train import TrainConfig, train_head  # noqa: E402
from specdec.models import HFCausalLM  # noqa: E402
from specdec.models.quant import GroupQuantLinear, quantize_linear_groups  # noqa: E402

V = 97
PROMPTS = [[1, 5, 7, 9, 11, 3], [4, 4, 2], [8, 1, 2, 3, 4, 5, 6, 7, 8, 9]]


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def _tiny_llama(seed=0, vocab=V, hidden=64, layers=2):
    torch.manual_seed(seed)
    cfg = transformers.LlamaConfig(hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
                                   num_attention_heads=4, num_key_value_heads=2, vocab_size=vocab)
    return transformers.LlamaForCausalLM(cfg).eval()


def _head_config(**kw):
    return HeadConfig(**dict(dict(hidden_size=64, num_heads=4, num_kv_heads=2, intermediate_size=128, vocab_size=V),
                             **kw))


@pytest.fixture(scope="module")
def trained():
    """A tiny target and a head trained on its greedy answers (a few seconds): it drafts tokens the target accepts."""
    model = _tiny_llama()
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, V, (6,), generator=g).tolist() for _ in range(24)]
    seqs, feats = generate_with_features(HFCausalLM(model), prompts, 40, batch=8)
    torch.manual_seed(1)
    net = HeadNet(_head_config())
    log = train_head(net, seqs, feats, model.get_input_embeddings().weight, model.get_output_embeddings().weight,
                     TrainConfig(steps=120, lr=3e-3, warmup=10, batch=8, max_len=64))
    return model, net, log, seqs, feats


def _reference_greedy(model, prompts, n):
    return SpeculativeDecoder(HFCausalLM(model), None, max_batch=len(prompts), max_len=64).generate(
        prompts, max_new_tokens=n).tokens


# ------------------------------------------------------------------ the drafting math
def _target_with_states():
    """A tiny target keeping its final states, with a 7-token prompt prefilled: (model, target, cache, prompt)."""
    model = _tiny_llama()
    target = HFCausalLM(model)
    target.capture_hidden((-1,))
    tcache = target.new_cache(1, 40)
    prompt = [3, 14, 15, 92, 65, 35, 89]
    target.prefill(tcache, [prompt])
    return model, target, tcache, prompt


def test_head_prefill_and_forward_last_run_the_lm_head_on_one_row():
    """A prompt prefill and a catch-up need the logits after their last token only: the head's LM head runs on one
    row per request there, with the logits of a full forward's last row, on the lean and the batched path."""
    model, target, tcache, prompt = _target_with_states()
    torch.manual_seed(2)
    net = HeadNet(_head_config())
    for lean in (True, False):
        lm = HeadLM(net, target)
        lm.lean = lean
        lm.attach(tcache)
        rows = []
        logits_fn = net.logits
        net.logits = lambda out, head: (rows.append(out.shape[1]), logits_fn(out, head))[1]
        try:
            a, b = lm.new_cache(1, 40), lm.new_cache(1, 40)
            got = lm.prefill(a, [prompt])                        # [1, V]
            assert rows == [1]
            full = lm.forward(b, torch.tensor([prompt]), torch.arange(len(prompt), dtype=torch.int32).view(1, -1))
            torch.testing.assert_close(got[0], full[0, -1], atol=1e-5, rtol=1e-5)
            rows.clear()
            last = lm.forward_last(b, torch.tensor([[5, 6, 7]]), torch.arange(3, dtype=torch.int32).view(1, 3),
                                   torch.tensor([1]))
            assert rows == [1] and last.shape == (1, V)
        finally:
            net.logits = logits_fn


def test_head_lm_equals_a_full_recompute():
    """HeadLM's cached, tree-shaped drafting gives the logits of a plain causal run of the head over
    (token p, target feature p - 1) for committed positions and (token, parent's head output) for drafted ones."""
    model, target, tcache, prompt = _target_with_states()
    torch.manual_seed(2)
    net = HeadNet(_head_config())
    lm = HeadLM(net, target)
    lm.attach(tcache)
    hcache = lm.new_cache(1, 40)
    root = 42
    lm.prefill(hcache, [prompt])                                  # positions 0..6: committed, target features
    root_logits = lm.forward(hcache, torch.tensor([[root]]), torch.zeros(1, 1, dtype=torch.int32))[0, 0]
    hcache.lens += 1
    # level 1: two children of the root (kv_offset 0, each sees itself); level 2: one child of each
    kids = torch.tensor([[7, 11]])
    eye = torch.eye(2, dtype=torch.bool).view(1, 2, 2)
    l1 = lm.forward(hcache, kids, torch.zeros(1, 2, dtype=torch.int32), eye)
    grand = torch.tensor([[20, 30]])
    m2 = torch.tensor([[[True, False, True, False], [False, True, False, True]]])
    l2 = lm.forward(hcache, grand, torch.ones(1, 2, dtype=torch.int32), m2, kv_offset=2)

    feats = tcache.features()[0, :len(prompt)]
    emb = model.get_input_embeddings().weight

    def run(tokens, feat_in):
        T = len(tokens)
        pos = torch.arange(T).view(1, T)
        cos, sin = rope_tables(pos, 16, net.cfg.rope_theta, torch.float32)
        with torch.no_grad():
            out = net.layer(emb[torch.tensor([tokens])], feat_in.view(1, T, -1), cos, sin, causal_attention(4, 2))
        return out[0], net.logits(out, model.get_output_embeddings())[0]

    base = torch.cat([torch.zeros(1, 64), feats])                # feature input of positions 0..7
    out, logits = run(prompt + [root], base)
    torch.testing.assert_close(root_logits, logits[-1], atol=1e-4, rtol=1e-4)
    for j in range(2):
        o1, lg1 = run(prompt + [root, kids[0, j].item()], torch.cat([base, out[-1:]]))
        torch.testing.assert_close(l1[0, j], lg1[-1], atol=1e-4, rtol=1e-4)
        _, lg2 = run(prompt + [root, kids[0, j].item(), grand[0, j].item()], torch.cat([base, out[-1:], o1[-1:]]))
        torch.testing.assert_close(l2[0, j], lg2[-1], atol=1e-4, rtol=1e-4)
    # a chain step (one node per call, no mask): the drafted node's parent is the root's head output
    chain = lm.new_cache(1, 40)
    lm.prefill(chain, [prompt])
    lm.forward(chain, torch.tensor([[root]]), torch.zeros(1, 1, dtype=torch.int32))
    chain.lens += 1
    c1 = lm.forward(chain, torch.tensor([[7]]), torch.zeros(1, 1, dtype=torch.int32))[0, 0]
    _, lgc = run(prompt + [root, 7], torch.cat([base, out[-1:]]))
    torch.testing.assert_close(c1, lgc[-1], atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("draft_vocab", [0, 40])
def test_lean_one_request_path_equals_the_batched_path(draft_vocab):
    """HeadLM's batch-1 CPU path (_forward_one: host integers and slices) gives the batched gathers' logits and
    cache contents bit for bit, call after call, through a draft step's calls: the root after
    committed text, a drafted node, a catch-up chain, and the cases it leaves to the batched path."""
    model, target, tcache, prompt = _target_with_states()
    torch.manual_seed(3)
    net = HeadNet(_head_config(num_heads=2, num_kv_heads=1, draft_vocab=draft_vocab))  # head_dim 32: rope by table
    lms, caches = [], []
    for lean in (False, True):
        lm = HeadLM(net, target)
        lm.lean = lean
        lm.attach(tcache)
        lms.append(lm)
        caches.append(lm.new_cache(1, 40))
    taken = []
    orig = HeadLM._forward_one

    def spy(self, *a):
        out = orig(self, *a)
        taken.append(out is not None)
        return out

    def call(tokens, depths, mask=None, kv_offset=0):
        outs = []
        for lm, c in zip(lms, caches):
            outs.append(lm.forward(c, torch.tensor([tokens]), torch.tensor([depths], dtype=torch.int32), mask,
                                   kv_offset))
        assert torch.equal(outs[0], outs[1])
        a, b = caches
        assert torch.equal(a.lens, b.lens) and torch.equal(a.hidden, b.hidden)
        assert torch.equal(a.k[0], b.k[0]) and torch.equal(a.v[0], b.v[0])

    HeadLM._forward_one = spy
    try:
        for lm, c in zip(lms, caches):
            lm.prefill(c, [prompt[:-1]])
        assert taken == [False]                     # position 0 has no parent: the batched path
        taken.clear()
        call([prompt[-1]], [0])                     # the root after committed text (parent: the target's state)
        for c in caches:
            c.lens += 1
        call([7], [0])                              # a drafted node: its parent is the head's own last output
        assert taken == [True, True]
        with torch.no_grad():                       # the target verifies and commits root, 7: states at 7, 8
            target.forward(tcache, torch.tensor([[7, 21]]), torch.arange(2, dtype=torch.int32).view(1, 2))
        tcache.lens += 2
        call([21, 30], [0, 1])                      # a catch-up chain over committed text
        for c in caches:
            c.lens += 2
        call([5, 6], [0, 1])                        # two nodes past the committed text: the batched path
        call([5, 6], [1, 2])                        # depths from 1: positions 10, 11, parents past the committed
        eye = torch.eye(2, dtype=torch.bool).view(1, 2, 2)
        call([8, 9], [0, 0], mask=eye)              # a tree level: the batched path
        assert taken == [True, True, True, False, False]
        rope = lms[1].rope  # the head's rope by table (RotaryTable): rope_tables' own bits
        assert rope.enabled and rope._cos is not None
        pos = torch.tensor([[0, 9, 13, 39]])
        want = rope_tables(pos, 32, net.cfg.rope_theta, torch.float32)
        got = rope(torch.zeros(1, 4, 64), pos, 40)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    finally:
        HeadLM._forward_one = orig


class _FullRollbackHead(EagleHead):
    """EagleHead that runs DraftModel's whole rollback before its own in every step (what accept() did
    for chains before it skipped it)."""

    def _keeps_counts(self) -> bool:
        return True


@pytest.mark.parametrize("top_k", [1, 2])
def test_chain_accept_without_the_rollback_keeps_every_step(trained, top_k):
    """A chain / spine head skips DraftModel's rollback in accept() (nothing of it survives the head's own):
    the same drafts, accepted counts and head cache state as with it, step by step."""
    model, net, *_ = trained
    logs = []
    for cls in (EagleHead, _FullRollbackHead):
        head = cls(net, k=3, top_k=top_k)
        dec = SpeculativeDecoder(HFCausalLM(model), head, max_batch=2, max_len=96, policy="fixed")
        steps = []
        orig = head.accept

        def spy(accepted, num, num_host, foreign=None, _orig=orig, _head=head, _steps=steps):
            _steps.append((_head._last.tree.tokens.clone(), list(num_host)))
            _orig(accepted, num, num_host, foreign)
            b = _head._last.b
            _steps.append((_head._view(b).lens.clone(), _head._pend_n[:b].clone(), _head._pend_width))

        head.accept = spy
        out = dec.generate(PROMPTS[:2], max_new_tokens=30)
        logs.append((out.tokens, steps))
    assert logs[0][0] == logs[1][0] == _reference_greedy(model, PROMPTS[:2], 30)
    assert len(logs[0][1]) == len(logs[1][1]) > 10
    for a, b in zip(logs[0][1], logs[1][1]):
        for x, y in zip(a, b):
            assert torch.equal(x, y) if isinstance(x, torch.Tensor) else x == y


def test_reduced_vocabulary_map():
    model = _tiny_llama()
    target = HFCausalLM(model)
    target.capture_hidden((-1,))
    tcache = target.new_cache(1, 16)
    target.prefill(tcache, [[1, 2, 3]])
    net = HeadNet(_head_config(draft_vocab=10))
    ids = torch.tensor([90, 3, 55, 0, 17, 8, 96, 41, 60, 2])
    net.set_vocab(ids)
    assert torch.equal(net.draft_to_target(), ids)
    lm = HeadLM(net, target)
    lm.attach(tcache)
    hc = lm.new_cache(1, 16)
    full = lm.prefill(hc, [[1, 2, 3]])[0]
    assert torch.isinf(full).sum() == V - 10 and torch.isfinite(full[ids]).all()
    # reduced=True: the same logits over the draft vocabulary alone (column i: target token ids[i])
    hc2 = lm.new_cache(1, 16)
    lm.prefill(hc2, [[1, 2, 3]])
    hc3 = lm.new_cache(1, 16)
    lm.prefill(hc3, [[1, 2, 3]])
    step = torch.tensor([[7, 9]])
    depths = torch.arange(2, dtype=torch.int32).view(1, 2)
    both = lm.forward(hc2, step, depths)
    small = lm.forward(hc3, step, depths, reduced=True)
    assert small.shape == (1, 2, 10) and torch.equal(small, both[:, :, ids])
    with pytest.raises(ValueError, match="distinct"):
        net.set_vocab(torch.tensor([1] * 10))


# ------------------------------------------------------------------ exactness
@pytest.mark.parametrize("precision", ["fp32", "q8_0", "q4_1"])
def test_greedy_exact_chain_and_trees(trained, precision):
    model, net, _, _, _ = trained
    if precision != "fp32":
        import copy

        model = quantize_linear_groups(copy.deepcopy(model), precision)
    ref = _reference_greedy(model, PROMPTS, 24)
    shapes = [dict(k=4), dict(k=3, top_k=2), dict(k=3, top_k=2, tree="dynamic"),
              dict(k=3, top_k=2, tree="planned", node_budget=7)]
    for kw in shapes:
        for lazy in ("auto", "always"):  # always: every step's LM head along the accepted path (specdec.lazy_verify)
            dec = SpeculativeDecoder(HFCausalLM(model), EagleHead(net, **kw), max_batch=3, max_len=64, policy="fixed")
            dec.engine.lazy_verify.mode = lazy
            out = dec.generate(PROMPTS, max_new_tokens=24)
            assert out.tokens == ref, (precision, kw, lazy)
            assert out.metrics["accepted_tokens"] > 10, (precision, kw)  # the trained head really drafts
            assert lazy == "auto" or dec.engine.lazy_verify.steps > 0


def test_greedy_exact_q8_head_reduced_vocab_and_hook_path(trained):
    model, net, _, seqs, feats = trained
    ref = _reference_greedy(model, PROMPTS, 20)
    small = HeadNet(_head_config(draft_vocab=48))
    small.load_state_dict({k: v for k, v in net.state_dict().items()}, strict=False)
    counts = torch.bincount(torch.tensor([t for s in seqs for t in s]), minlength=V)
    small.set_vocab(torch.sort(torch.topk(counts, 48).indices).values)
    with torch.no_grad():
        small.lm_head.weight.copy_(model.get_output_embeddings().weight[small.draft_to_target()])
    for head, target in ((EagleHead(net, k=3, precision="q8_0"), HFCausalLM(model)),
                         (EagleHead(net, k=3, top_k=2, tree="dynamic", precision="q8_0", act="q8"), HFCausalLM(model)),
                         (EagleHead(net, k=3, precision="q4_1", act="q8"), HFCausalLM(model)),
                         (EagleHead(small, k=3, top_k=2, tree="dynamic"), HFCausalLM(model)),
                         (EagleHead(net, k=3), HFCausalLM(model, fast_path=False))):
        out = SpeculativeDecoder(target, head, max_batch=3, max_len=64, policy="fixed").generate(
            PROMPTS, max_new_tokens=20)
        assert out.tokens == ref
        assert out.metrics["accepted_tokens"] > 5


@pytest.mark.parametrize("batch", [1, 3])
def test_reduced_vocabulary_drafts_equal_the_full_vocabulary_drafts(trained, batch, monkeypatch):
    """A greedy chain / spine step of a reduced-vocabulary head takes its top tokens from the draft
    vocabulary's logits (no expansion to the target's): the same proposals, step by step, as over the
    expanded logits, and greedy output equal to the target's; one request (its host-integer first forward)
    and a batch."""
    from specdec.drafters.draft_model.model import DraftModel
    from specdec.drafters.eagle.lm import HeadLM

    model, net, _, seqs, _ = trained
    small = HeadNet(_head_config(draft_vocab=48))
    small.load_state_dict({k: v for k, v in net.state_dict().items()}, strict=False)
    counts = torch.bincount(torch.tensor([t for s in seqs for t in s]), minlength=V)
    small.set_vocab(torch.topk(counts, 48).indices)  # unsorted ids: the map, not the order, carries them
    with torch.no_grad():
        small.lm_head.weight.copy_(model.get_output_embeddings().weight[small.draft_to_target()])
    prompts = PROMPTS[:batch]
    ref = _reference_greedy(model, prompts, 20)
    widths = []
    real_logits = HeadLM._logits

    def spy_logits(self, out, reduced=False):
        got = real_logits(self, out, reduced)
        widths.append(got.shape[-1])
        return got

    monkeypatch.setattr(HeadLM, "_logits", spy_logits)
    runs = {}
    for reduced in (True, False):
        if not reduced:
            monkeypatch.setattr(DraftModel, "_reduced", lambda self: False)
        for kw in (dict(k=3), dict(k=1, top_k=2), dict(k=2, top_k=3)):
            head = EagleHead(small, **kw)
            drafts = []
            real_propose = type(head).propose

            def propose(ctx, head=head, drafts=drafts, real_propose=real_propose):
                got = real_propose(head, ctx)
                drafts.append(got.tree.tokens.tolist())
                return got

            head.propose = propose
            widths.clear()
            out = SpeculativeDecoder(HFCausalLM(model), head, max_batch=batch, max_len=64, policy="fixed").generate(
                prompts, max_new_tokens=20)
            assert out.tokens == ref, (reduced, kw)
            assert out.metrics["accepted_tokens"] > 3, (reduced, kw)
            # the steps' forwards ran over the draft vocabulary (only prefills / catch-ups expand to V)
            assert (48 in widths) == reduced and V in widths, (reduced, kw)
            runs[(reduced, tuple(kw.items()))] = drafts
    for key, drafts in runs.items():
        if key[0]:
            assert drafts == runs[(False, key[1])], key


def test_head_on_the_paged_engine_keeps_prefix_caching(trained):
    """The target's states live in the paged cache's blocks: the head drafts on the paged engine (the default
    layout) with the dense engine's output, and a prompt seen before is served from its cached blocks (states
    included: the head's lazy prompt prefill reads them) with the same output."""
    model, net, _, _, _ = trained
    g = torch.Generator().manual_seed(5)
    prompts = [p + torch.randint(0, V, (20,), generator=g).tolist() for p in PROMPTS]  # >= one full 16-block
    ref = _reference_greedy(model, prompts, 16)
    for kv in ("dense", None):
        dec = SpeculativeDecoder(HFCausalLM(model), EagleHead(net, k=3, top_k=2), max_batch=3, max_len=64,
                                 policy="fixed", kv_cache=kv)
        for _ in range(2):
            out = dec.generate(prompts, max_new_tokens=16)
            assert out.tokens == ref, kv
            assert out.metrics["accepted_tokens"] > 5
        if kv is None:
            assert type(dec.engine.kv).__name__ == "PagedRows" and dec.engine.kv.cache.feature_dim == 64
            assert dec.engine.kv.counters["prefix_hit_tokens"] >= 16 * len(prompts)  # the second call's prefixes
        else:
            assert type(dec.engine.kv).__name__ == "DenseRows"


def test_sampled_distribution_is_exact():
    """The statistical harness of tests/test_decoding.py with a head over a tiny HF target."""
    from test_decoding import assert_sampled_exact

    model = _tiny_llama(seed=3, vocab=8, hidden=32)
    torch.manual_seed(4)
    net = HeadNet(HeadConfig(hidden_size=32, num_heads=4, num_kv_heads=2, intermediate_size=64, vocab_size=8))
    from specdec.drafters import MultiDraft, PromptLookup

    for drafter in (EagleHead(net, k=3), EagleHead(net, k=2, top_k=2, tree="dynamic", node_budget=5),
                    MultiDraft([PromptLookup(ngram=2, k=4), EagleHead(net, k=2)])):  # lookup's tokens reach the head
        per_call, calls = 800, 2
        target = HFCausalLM(model)
        with torch.no_grad():  # the harness's oracle: a plain forward over the whole sequence
            target.full_logits = lambda seq: model(input_ids=torch.tensor([list(seq)])).logits[0].float()
        accepted = assert_sampled_exact(target, drafter, [1, 2, 3, 1, 2, 3, 1, 2], 0.8, 0, 1.0,
                                        per_call, calls, 4, 7)
        assert accepted > 0.05 * per_call * calls


# ------------------------------------------------------------------ training
def test_training_loss_falls_and_resume_is_identical(trained, tmp_path):
    model, _, log, seqs, feats = trained
    first = sum(r["loss"] for r in log[:10]) / 10
    last = sum(r["loss"] for r in log[-10:]) / 10
    assert last < 0.8 * first
    assert log[-1]["accuracy"] > log[0]["accuracy"]
    emb, head = model.get_input_embeddings().weight, model.get_output_embeddings().weight
    cfg = TrainConfig(steps=12, lr=3e-3, warmup=2, batch=4, max_len=32, checkpoint_every=5, noise=0.1)

    def fresh():
        torch.manual_seed(5)
        return HeadNet(_head_config())

    a = fresh()
    log_a = train_head(a, seqs[:8], feats[:8], emb, head, cfg)
    ckpt = str(tmp_path / "t.ckpt")

    class Stop(Exception):
        pass

    def interrupt(step, rec):
        if step == 7:  # killed after the checkpoint of step 5 and two more steps
            raise Stop

    with pytest.raises(Stop):
        train_head(fresh(), seqs[:8], feats[:8], emb, head, cfg, checkpoint=ckpt, on_step=interrupt)
    b = fresh()
    log_b = train_head(b, seqs[:8], feats[:8], emb, head, cfg, checkpoint=ckpt)  # resumes after step 5
    assert [r["loss"] for r in log_b] == [r["loss"] for r in log_a]
    for (k, x), (_, y) in zip(a.state_dict().items(), b.state_dict().items()):
        assert torch.equal(x, y), k


def test_train_head_rejects_mismatched_features():
    net = HeadNet(_head_config())
    with pytest.raises(ValueError, match="sequence 0 has 3 tokens"):
        train_head(net, [[1, 2, 3]], [torch.zeros(2, 64)], torch.zeros(V, 64))


# ------------------------------------------------------------------ checkpoint layouts
def _write(folder, conf, sd):
    from safetensors.torch import save_file

    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(conf, f)
    save_file({k: v.contiguous() for k, v in sd.items()}, os.path.join(folder, "model.safetensors"))


def _llama_conf(H=64, **kw):
    return dict(dict(architectures=["LlamaForCausalLM"], hidden_size=H, num_attention_heads=4, num_key_value_heads=2,
                     intermediate_size=2 * H, num_hidden_layers=1, rms_norm_eps=1e-6, rope_theta=10000.0,
                     vocab_size=V, hidden_act="silu"), **kw)


def _layer_keys(pre, H, att_in, g):
    r = lambda *s: torch.randn(*s, generator=g) * 0.05  # noqa: E731
    return {f"{pre}self_attn.q_proj.weight": r(H, att_in), f"{pre}self_attn.k_proj.weight": r(32, att_in),
            f"{pre}self_attn.v_proj.weight": r(32, att_in), f"{pre}self_attn.o_proj.weight": r(H, H),
            f"{pre}mlp.gate_proj.weight": r(2 * H, H), f"{pre}mlp.up_proj.weight": r(2 * H, H),
            f"{pre}mlp.down_proj.weight": r(H, 2 * H), f"{pre}post_attention_layernorm.weight": 1 + r(H)}


def test_load_eagle1_checkpoint(tmp_path):
    g = torch.Generator().manual_seed(0)
    H = 64
    sd = _layer_keys("layers.0.", H, H, g)
    sd.update({"fc.weight": torch.randn(H, 2 * H, generator=g) * 0.05, "fc.bias": torch.randn(H, generator=g) * 0.01})
    folder = str(tmp_path / "eagle1")
    _write(folder, _llama_conf(), sd)
    net = load_head(folder)
    assert net.cfg.style == "eagle" and net.lm_head is None and net.cfg.feature_layers == (-1,)
    assert torch.equal(net.q_proj.weight, sd["layers.0.self_attn.q_proj.weight"])
    assert torch.equal(net.fc.bias, sd["fc.bias"])
    assert torch.equal(net.post_attention_layernorm.data, sd["layers.0.post_attention_layernorm.weight"])
    model = _tiny_llama()
    ref = _reference_greedy(model, PROMPTS, 12)
    out = SpeculativeDecoder(HFCausalLM(model), EagleHead(net, k=3, top_k=2, tree="dynamic"), max_batch=3,
                             max_len=64, policy="fixed").generate(PROMPTS, max_new_tokens=12)
    assert out.tokens == ref
    sd["layers.0.input_layernorm.weight"] = torch.ones(H)  # EAGLE's first layer has none
    _write(folder, _llama_conf(), sd)
    with pytest.raises(ValueError, match="unexpected keys"):
        load_head(folder)


def test_load_eagle3_checkpoint(tmp_path):
    g = torch.Generator().manual_seed(1)
    H, Vd = 64, 32
    model = _tiny_llama(layers=6)
    sd = _layer_keys("midlayer.", H, 2 * H, g)
    ids = torch.sort(torch.randperm(V, generator=g)[:Vd]).values
    t2d = torch.zeros(V, dtype=torch.bool)
    t2d[ids] = True
    sd.update({"fc.weight": torch.randn(H, 3 * H, generator=g) * 0.05, "midlayer.hidden_norm.weight": torch.ones(H),
               "midlayer.input_layernorm.weight": torch.ones(H), "norm.weight": torch.ones(H),
               "lm_head.weight": torch.randn(Vd, H, generator=g) * 0.05, "d2t": ids - torch.arange(Vd), "t2d": t2d,
               "embed_tokens.weight": model.get_input_embeddings().weight.detach().clone()})
    folder = str(tmp_path / "eagle3")
    _write(folder, _llama_conf(draft_vocab_size=Vd, target_hidden_size=H), sd)
    net = load_head(folder)
    assert net.cfg.style == "eagle3" and net.cfg.feature_size == 3 * H and net.cfg.draft_vocab == Vd
    assert torch.equal(net.draft_to_target(), ids)
    assert torch.equal(net.q_proj.weight, sd["midlayer.self_attn.q_proj.weight"])
    drafter = EagleHead(net, k=3)
    ref = _reference_greedy(model, PROMPTS, 12)
    out = SpeculativeDecoder(HFCausalLM(model), drafter, max_batch=3, max_len=64, policy="fixed").generate(
        PROMPTS, max_new_tokens=12)
    assert out.tokens == ref
    assert net.cfg.feature_layers == (2, 3, 3)  # EAGLE-3's low / mid / high layers of a 6-layer target
    bad = dict(sd, t2d=~t2d)
    _write(folder, _llama_conf(draft_vocab_size=Vd, target_hidden_size=H), bad)
    with pytest.raises(ValueError, match="t2d"):
        load_head(folder)


def test_save_load_round_trip(trained, tmp_path):
    _, net, _, _, _ = trained
    save_head(net, str(tmp_path / "h"), dtype=torch.float32)
    back = load_head(str(tmp_path / "h"))
    assert back.cfg.to_dict() == net.cfg.to_dict()
    for (k, x), (_, y) in zip(net.state_dict().items(), back.state_dict().items()):
        assert torch.equal(x, y), k


def test_feature_head_binds_before_the_target_cache():
    """Binding a head turns the target's hidden-state capture on: the engine binds such a drafter
    (Drafter.changes_target) before it builds the target's cache, which then keeps the states -- paged (the
    default: in the blocks) or dense (a HiddenKVCache)."""
    from specdec.models.hidden import HiddenKVCache

    net = HeadNet(_head_config())
    for kv in (None, "dense"):
        target = HFCausalLM(_tiny_llama())
        dec = SpeculativeDecoder(target, EagleHead(net, k=2), max_batch=2, max_len=48, policy="fixed", kv_cache=kv)
        if kv is None:
            assert dec.engine.kv.paged and dec.engine.stats()["kv_cache"] == "paged"
            assert target.feature_cache is dec.engine.kv.cache and target.feature_cache.feature_dim == 64
        else:
            assert not dec.engine.kv.paged and isinstance(target.feature_cache, HiddenKVCache)
        assert len(dec.generate([[1, 2, 3]], max_new_tokens=4).tokens[0]) == 4


def test_bad_binding():
    net = HeadNet(_head_config())
    with pytest.raises(ValueError, match="vocabulary of 97"):
        SpeculativeDecoder(HFCausalLM(_tiny_llama(vocab=50)), EagleHead(net))
    with pytest.raises(TypeError, match="net must be a HeadNet"):
        EagleHead(object())
    with pytest.raises(ValueError, match="act must be None, or 'q8' with a quantized precision"):
        EagleHead(net, act="q8")
    with pytest.raises(ValueError, match=r"precision must be 'fp32' or one of \('q8_0', 'q4_0', 'q4_1'\)"):
        EagleHead(net, precision="int8")
    with pytest.raises(ValueError, match="act must be None"):
        EagleHead(net, precision="q8_0", act="q4")


def test_q8_activation_head_runs_the_integer_kernels():
    """act="q8": every linear layer of the head takes quantized activations, the fused decoder layer
    included (its slots packed for the integer kernels, bits + 32), and its logits stay close to the
    float-activation head's."""
    model = _tiny_llama()
    target = HFCausalLM(model)
    target.capture_hidden((-1,))
    tcache = target.new_cache(1, 24)
    target.prefill(tcache, [[1, 2, 3, 4, 5]])
    torch.manual_seed(3)
    net = HeadNet(_head_config())
    logits = {}
    for act in (None, "q8"):
        head = EagleHead(net, precision="q8_0", act=act)
        assert all(m.act == act for m in head.net.modules() if isinstance(m, GroupQuantLinear))
        lm = HeadLM(head.net, target)
        assert lm.fused is not None and all(b == (40 if act else 8) for b in lm.fused[4])
        # fc (with EAGLE's bias) as one op call: the module's own values, bias included
        assert head.net.fc.bias is not None and lm._fc is not head.net.fc
        x = torch.randn(1, 3, 2 * head.net.cfg.hidden_size)
        assert torch.equal(lm._fc(x), head.net.fc(x))
        lm.attach(tcache)
        logits[act] = lm.prefill(lm.new_cache(1, 24), [[1, 2, 3, 4, 5]])
    assert not torch.equal(logits[None], logits["q8"])
    torch.testing.assert_close(logits["q8"], logits[None], atol=0.05, rtol=0.05)
    head = EagleHead(net, precision="q4_1", act="q8")  # 4-bit weights with mins: bits 4 + 32
    lm = HeadLM(head.net, target)
    assert lm.fused is not None and all(b == 36 for b in lm.fused[4]) and lm.fused[2][0] is not None
    lm.attach(tcache)
    q4 = lm.prefill(lm.new_cache(1, 24), [[1, 2, 3, 4, 5]])
    torch.testing.assert_close(q4, logits[None], atol=0.2, rtol=0.2)


def test_held_out_evaluation(trained):
    """evaluate_head scores answers only when told, counts tokens outside a draft vocabulary as misses, and
    train_head logs it every eval_every steps and at the end without changing the training itself."""
    from specdec.drafters.eagle.train import evaluate_head

    model, net, _, seqs, feats = trained
    emb, head = model.get_input_embeddings().weight, model.get_output_embeddings().weight
    toks = [torch.as_tensor(s) for s in seqs[:6]]
    cfg = TrainConfig(batch=4, max_len=64)
    full = evaluate_head(net, toks, feats[:6], emb, head, cfg)
    ans = evaluate_head(net, toks, feats[:6], emb, head, cfg, answer_from=[6] * 6)
    assert full["val_positions"] == sum(min(len(s), 64) - 1 for s in seqs[:6])
    assert ans["val_positions"] == sum(min(len(s), 64) - 6 for s in seqs[:6])
    assert ans["val_accuracy"] > full["val_accuracy"] > 0.2   # answers are the target's greedy choices
    cfg = TrainConfig(steps=6, lr=3e-3, warmup=2, batch=4, max_len=32, eval_every=4)
    runs = []
    for val in (None, (seqs[8:12], feats[8:12], [6] * 4)):
        torch.manual_seed(3)
        fresh = HeadNet(_head_config())
        runs.append(train_head(fresh, seqs[:8], feats[:8], emb, head, cfg, val=val))
    assert [r["loss"] for r in runs[0]] == [r["loss"] for r in runs[1]]
    assert [r["step"] for r in runs[1] if "val_accuracy" in r] == [4, 6]


def test_bf16_autocast_training_learns_and_repeats(trained):
    """amp="bf16": the products run in bfloat16 (the weights stay float32), the loss falls as in float32
    training, two runs from one seed agree exactly, and evaluation scores the first drafted token whatever
    the unroll (a bad amp name is refused)."""
    from dataclasses import replace

    from specdec.drafters.eagle.train import evaluate_head

    model, net, _, seqs, feats = trained
    emb, head = model.get_input_embeddings().weight, model.get_output_embeddings().weight
    cfg = TrainConfig(steps=60, lr=3e-3, warmup=5, batch=8, max_len=48, unroll=2, amp="bf16")
    logs, nets = [], []
    for _ in range(2):
        torch.manual_seed(1)
        fresh = HeadNet(_head_config())
        logs.append(train_head(fresh, seqs, feats, emb, head, cfg))
        nets.append(fresh)
    assert [r["loss"] for r in logs[0]] == [r["loss"] for r in logs[1]]
    assert all(p.dtype == torch.float32 for p in nets[0].parameters())
    torch.manual_seed(1)
    fp32 = train_head(HeadNet(_head_config()), seqs, feats, emb, head, replace(cfg, steps=3, amp=None))
    assert fp32[0]["loss"] != logs[0][0]["loss"]   # the bf16 products did run
    first = sum(r["loss"] for r in logs[0][:5]) / 5
    last = sum(r["loss"] for r in logs[0][-5:]) / 5
    assert last < 0.8 * first
    toks = [torch.as_tensor(s) for s in seqs[:6]]
    one = evaluate_head(net, toks, feats[:6], emb, head, TrainConfig(batch=4, max_len=64, unroll=1))
    three = evaluate_head(net, toks, feats[:6], emb, head, TrainConfig(batch=4, max_len=64, unroll=3))
    assert one == three
    with pytest.raises(ValueError, match="amp"):
        train_head(HeadNet(_head_config()), seqs[:4], feats[:4], emb, head, TrainConfig(steps=1, amp="fp8"))


def test_unrolled_training_steps_equal_chain_drafting():
    """Training-time test: step s of unrolled_outputs at position p gives the logits HeadLM drafts for the
    s-th chain token after the committed p - s (its own features, cached drafted keys)."""
    from specdec.drafters.eagle.train import unrolled_outputs

    model = _tiny_llama()
    seq = [3, 14, 15, 92, 65, 35, 89, 79, 32, 38, 46]
    target = HFCausalLM(model)
    target.capture_hidden((-1,))
    full = target.new_cache(1, 40)
    target.prefill(full, [seq])
    feats = full.features()[0, :len(seq)]
    torch.manual_seed(5)
    net = HeadNet(_head_config())
    emb = model.get_input_embeddings().weight
    T = len(seq)
    cos, sin = rope_tables(torch.arange(T).view(1, T), 16, net.cfg.rope_theta, torch.float32)
    feat_in = torch.cat([torch.zeros(1, feats.shape[1]), feats[:-1]]).view(1, T, -1)  # position 0: a zero feature
    with torch.no_grad():
        outs = list(unrolled_outputs(net, emb[torch.tensor([seq])], feat_in, cos, sin, 3))
    head = model.get_output_embeddings()
    checked = 0
    for s in range(3):
        for p in range(s + 1, T):
            root = p - s                                     # the committed node the chain starts from
            tgt = HFCausalLM(model)
            tgt.capture_hidden((-1,))
            tc = tgt.new_cache(1, 40)
            tgt.prefill(tc, [seq[:root]])                    # the target has scored positions < root
            lm = HeadLM(net, tgt)
            lm.attach(tc)
            hc = lm.new_cache(1, 40)
            lm.prefill(hc, [seq[:root]])
            zero = torch.zeros(1, 1, dtype=torch.int32)
            for q in range(root, p + 1):                     # the root, then the chain's drafted tokens
                logits = lm.forward(hc, torch.tensor([[seq[q]]]), zero)[0, 0]
                hc.lens += 1
            want = net.logits(outs[s][:, p], head)[0]
            torch.testing.assert_close(logits, want, atol=1e-4, rtol=1e-4)
            checked += 1
    assert checked == 3 * (T - 1) - 3


def test_head_in_a_multidraft_with_prompt_lookup(trained):
    """A feature head as a MultiDraft member: tokens accepted from prompt lookup's subtree reach it as
    foreign tokens (committed: the target has their states) and greedy output stays the target's own."""
    from specdec.drafters import MultiDraft, PromptLookup

    model, net, _, _, _ = trained
    first = _reference_greedy(model, PROMPTS, 16)
    prompts = [p + f + p for p, f in zip(PROMPTS, first)]  # lookup finds the continuation in the prompt
    ref = _reference_greedy(model, prompts, 24)
    seen, gaps = [], []

    class Counting(EagleHead):
        def _take_foreign(self, b, foreign, own):
            if own is not None and foreign:
                seen.extend(len(f) for f in foreign)
            super()._take_foreign(b, foreign, own)

        def accept(self, accepted, num_accepted, num_host, foreign=None):
            super().accept(accepted, num_accepted, num_host, foreign)
            b = accepted.shape[0]
            if self._pend_width:  # the head's text + its pending tokens == what the target committed
                mine = self._view(b).lens.to(torch.int64) + self._pend_n[:b]
                gaps.append(int((mine - self.lm.features.lens[:b].to(torch.int64)).abs().max()))

    for head in (Counting(net, k=3), Counting(net, k=3, top_k=2, tree="dynamic")):
        multi = MultiDraft([PromptLookup(ngram=2, k=6), head])
        dec = SpeculativeDecoder(HFCausalLM(model), multi, max_batch=3, max_len=96, policy="fixed")
        assert dec.generate(prompts, max_new_tokens=24).tokens == ref
    assert sum(seen) > 0   # lookup's tokens were accepted past the head's own path
    assert gaps and max(gaps) == 0


def test_bundled_head_location(tmp_path, monkeypatch):
    """load_bundled(draft="head") reads the head train-head writes by default; a missing one names the command."""
    from specdec.models.bundled import bundled_head_dir, load_bundled_head

    monkeypatch.setenv("SPECDEC_CACHE", str(tmp_path))
    assert bundled_head_dir("smollm2-135m") == tmp_path / "heads" / "smollm2-135m"
    with pytest.raises(FileNotFoundError, match="specdec train-head --model smollm2-135m"):
        load_bundled_head("smollm2-135m")
    torch.manual_seed(0)
    net = HeadNet(_head_config())
    save_head(net, str(bundled_head_dir("smollm2-135m") / "head"))
    got = load_bundled_head("smollm2-135m").state_dict()
    for key, want in net.state_dict().items():   # saved as float16
        torch.testing.assert_close(got[key], want.to(torch.float16).to(want.dtype), atol=0, rtol=0)


def test_train_head_refuses_data_from_another_target(tmp_path):
    """A resumed train-head run reuses OUT/data.pt only when it was generated by the target the run asks
    for (precision and activations): features of another target would teach the head the wrong states."""
    import argparse

    from specdec.drafters.eagle import recipe

    path = str(tmp_path / "data.pt")
    torch.save(dict(sequences=[[1, 2]], features=[torch.zeros(2, 4)], prompt_lengths=[1], precision="q4_1"), path)
    args = argparse.Namespace(precision="q4_1")
    with pytest.raises(SystemExit, match="activations float; this run asks for q4_1 and q8"):
        recipe._data(args, "q8", None, None, None, path)
    assert recipe._data(args, None, None, None, None, path)["sequences"] == [[1, 2]]
