"""specdec.graphs.GraphedForward: the target forward captured in CUDA graphs per step shape.

Without a GPU the static-buffer path runs with eager forwards (capture=False): the buckets,
the copies into the static inputs, eviction and the fallbacks are tested here on the CPU. The
capture path runs on the CPU too against a fake of the torch.cuda calls it makes (_FakeCuda: a
current device, and graphs that record the forwards launched on the capturing device and rerun
them at replay): the device context of capture and replay, the eager fallback of a capture that
raises, and the copy of the static logits. The captured replays (equal to eager forwards, no host
sync, the decoding loop unchanged) run when a CUDA device and a CUDA build are present; the
bundled-model decoding checks are in tests/test_cuda_decoding.py.
"""
from __future__ import annotations

import contextlib
import json
import logging

import pytest
import torch

import specdec
from specdec import PromptLookup, SpeculativeDecoder
from specdec import graphs as graphs_module
from specdec.graphs import GraphedForward
from specdec.scheduler.calibrate import calibrate, calibration_key
from specdec.scheduler.cost import CostModel

from conftest import HAS_CUDA, strict_checks
from test_models import _ancestor_mask, _depths, _tiny

PROMPTS = [[5, 17, 29, 5, 17, 29, 5], [7, 8, 9, 10, 7, 8, 9], [3, 4, 3, 4, 3, 4, 3, 4]]


def _outputs(target, drafter=None, batch=3, new=12):
    dec = SpeculativeDecoder(target, drafter, max_batch=batch, max_len=64)
    return dec.generate(PROMPTS[:batch], max_new_tokens=new).tokens


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_static_buffer_path_equals_the_model(arch):
    """capture=False: every call goes through a bucket's static buffers; same logits as lm.forward."""
    lm = specdec.HFCausalLM(_tiny(arch))
    g = GraphedForward(lm, capture=False)
    outs = []
    for m in (lm, g):
        cache = m.new_cache(2, 32)  # served by the wrapped model
        m.prefill(cache, [[5, 17, 29], [7, 8, 9, 10, 11]])
        parents = [[-1, 0, 0, 1, 2], [-1, 0, 1, 2, 3]]
        step = []
        for t in ([[3, 40, 41, 42, 43], [4, 50, 51, 52, 53]], [[6, 1, 2, 3, 4], [9, 8, 7, 6, 5]]):
            step.append(m.forward(cache, torch.tensor(t), _depths(parents), _ancestor_mask(parents)))
        step.append(m.forward(cache, torch.tensor([[3], [4]]), torch.zeros(2, 1, dtype=torch.long)))
        outs.append(step)
    for a, b in zip(*outs):
        assert torch.equal(a, b)
    assert len(g.buckets()) == 2 and g.replays == 0 and g.eager_calls == 3 and g.captures == 0


def test_decoding_through_the_wrapper_is_unchanged():
    lm = specdec.HFCausalLM(_tiny("llama"))
    want = _outputs(lm, PromptLookup(ngram=2, k=3))
    g = GraphedForward(lm, capture=False)
    assert _outputs(g, PromptLookup(ngram=2, k=3)) == want
    assert len(g.buckets()) >= 2  # several step shapes (rows, nodes)


def test_buckets_are_evicted_least_recently_used(caplog):
    lm = specdec.HFCausalLM(_tiny("llama"))
    g = GraphedForward(lm, max_graphs=2, capture=False)
    cache = lm.new_cache(1, 32)
    lm.prefill(cache, [[5, 17, 29]])
    with caplog.at_level(logging.WARNING, logger="specdec.graphs"):
        for n in (1, 2, 1, 3, 4, 2):
            g.forward(cache, torch.zeros(1, n, dtype=torch.long), torch.arange(n)[None])
            if n == 3:
                shapes = [k[4] for k in g.buckets()]
                assert shapes == [(1, 1), (1, 3)], shapes  # (1, 2) was the least recently used
    assert g.evictions == 3 and len(g.buckets()) == 2
    warned = [r for r in caplog.records if r.name == "specdec.graphs"]
    assert len(warned) == 1, [r.getMessage() for r in warned]  # logged once, counted every time
    msg = warned[0].getMessage()
    assert "max_graphs=2" in msg and "tokens [1, 2]" in msg and "evictions" in msg, msg
    g.reset()
    assert not g.buckets()
    assert GraphedForward(lm, capture=False).max_graphs == 16  # the documented default


def test_graphed_and_bare_model_have_distinct_calibration_keys(tmp_path, monkeypatch):
    """R5: GraphedForward(lm) forwards model / device / dtype to lm; its calibration key must still
    differ from lm's (captured replays time unlike eager forwards), and calibrate() keeps both."""
    lm = specdec.HFCausalLM(_tiny("llama"))
    g = GraphedForward(lm, capture=False)
    assert calibration_key(g) != calibration_key(lm)
    assert calibration_key(g).startswith(calibration_key(lm) + "|")
    assert "GraphedForward(capture=False)" in calibration_key(g)
    assert "GraphedForward" not in calibration_key(lm)  # the bare model's key is unchanged
    monkeypatch.setenv("SPECDEC_CACHE", str(tmp_path))
    for target in (lm, g):
        cache = lm.new_cache(2, 32)
        calibrate(target, cache, CostModel(), batches=[1, 2], nodes=[1, 2], repeats=1)
    store = json.loads((tmp_path / "calibration.json").read_text())
    assert set(store) == {calibration_key(lm), calibration_key(g)}


# --------------------------------------------------------------------------- capture path on a fake torch.cuda
class _FakeGraph:
    def __init__(self, fake):
        self.fake, self.kernels = fake, []

    def replay(self):
        self.fake.events.append(("replay", self.fake.current))
        for kernel in self.kernels:
            kernel()


class _FakeCuda:
    """What specdec.graphs calls of torch.cuda, on the CPU. As on a GPU: torch.cuda.graph captures
    the CURRENT device's stream, so a forward is recorded only when its model's device is the
    current one; launched anywhere else it runs at once and the graph stays empty."""

    def __init__(self, current=0):
        self.current, self.capturing, self.events = current, None, []

    def current_device(self):
        return self.current

    @contextlib.contextmanager
    def device(self, d):
        prev, self.current = self.current, torch.device(d).index
        try:
            yield
        finally:
            self.current = prev

    def graph_pool_handle(self):
        return ("pool",)

    def Stream(self, device=None):  # noqa: N802  (torch.cuda's name)
        return self

    def current_stream(self, device=None):
        return self

    def wait_stream(self, other):
        pass

    @contextlib.contextmanager
    def stream(self, s):
        yield

    def set_stream(self, s):
        self.events.append(("set_stream", self.current))

    def synchronize(self, device=None):
        self.events.append(("synchronize", self.current))

    def CUDAGraph(self):  # noqa: N802
        return _FakeGraph(self)

    @contextlib.contextmanager
    def graph(self, g, pool=None):
        self.events.append(("capture", self.current))
        self.capturing = (g, self.current)
        try:
            yield
        finally:
            self.capturing = None


class _FakeCache:
    def __init__(self, B=1, S=16):
        self.k, self.v = [torch.zeros(B, 1, S, 2)], [torch.zeros(B, 1, S, 2)]
        self.lens = torch.zeros(B, dtype=torch.int32)


class _FakeLM:
    """A "model on cuda:1" whose forward launches one kernel: logits from tokens, depths and lens."""
    V = 11

    def __init__(self, fake, index=1, syncs=False):
        self.fake, self.device, self.syncs = fake, torch.device("cuda", index), syncs
        self.calls = []  # (current device, under capture?)

    def logits(self, tokens, depths, lens):
        return (torch.nn.functional.one_hot(tokens % self.V, self.V).float() + depths[..., None]
                + lens[:, None, None].float())

    def forward(self, cache, tokens, depths, tree_mask=None, kv_offset=0):
        f = self.fake
        self.calls.append((f.current, f.capturing is not None))
        if bool((tokens < 0).any()):
            raise ValueError("FakeLM.forward: tokens must be >= 0")
        if f.capturing is not None and self.syncs:  # a host read inside the capture
            raise RuntimeError("CUDA error: operation not permitted when stream is capturing")
        out = torch.empty(*tokens.shape, self.V)

        def kernel():
            out.copy_(self.logits(tokens, depths, cache.lens))

        if f.capturing is not None and f.capturing[1] == self.device.index:
            f.capturing[0].kernels.append(kernel)  # recorded; runs at replay
        else:
            kernel()
        return out


@pytest.fixture()
def fake_cuda(monkeypatch):
    fake = _FakeCuda(current=0)
    monkeypatch.setattr(graphs_module, "_cuda", fake)
    return fake


def _step(g, cache, toks):
    tokens = torch.tensor(toks)
    return g.forward(cache, tokens, torch.arange(tokens.shape[1]).expand_as(tokens).contiguous())


def test_capture_and_replay_run_on_the_models_device(fake_cuda):
    """D3: the model is on cuda:1 while cuda:0 is current. Capture and replay must run with cuda:1
    current, or the graph records nothing and every replay returns the capture-time logits."""
    lm = _FakeLM(fake_cuda, index=1)
    g = GraphedForward(lm)
    assert g.capture
    cache = _FakeCache(B=2)
    outs = []
    for toks in ([[1, 2, 3], [4, 5, 6]], [[7, 8, 9], [1, 1, 1]], [[2, 4, 6], [3, 5, 7]]):
        outs.append(_step(g, cache, toks))
        want = lm.logits(torch.tensor(toks), torch.arange(3).expand(2, 3), cache.lens)
        assert torch.equal(outs[-1], want)  # the replay follows this call's tokens and the lengths
        cache.lens += 1
    assert not torch.equal(outs[0], outs[1])
    assert g.captures == 1 and g.replays == 3 and g.eager_calls == 0
    assert fake_cuda.current == 0  # the caller's current device is restored
    assert {d for d, _ in lm.calls} == {1}  # warm-ups and the capture with the model's device current
    assert [e for e in fake_cuda.events if e[0] in ("capture", "replay")] == \
        [("capture", 1), ("replay", 1), ("replay", 1), ("replay", 1)]


def test_returned_logits_are_a_copy_of_the_static_output(fake_cuda):
    """R6: forward() returns a copy: a later replay (same bucket) leaves an earlier result unchanged."""
    lm = _FakeLM(fake_cuda, index=0)
    g = GraphedForward(lm)
    cache = _FakeCache()
    first = _step(g, cache, [[1, 2]])
    kept = first.clone()
    static = next(iter(g._buckets.values())).logits
    assert first.data_ptr() != static.data_ptr()
    _step(g, cache, [[5, 6]])
    assert torch.equal(first, kept) and not torch.equal(static, kept)


def test_a_capture_that_raises_falls_back_to_eager_once(fake_cuda, caplog):
    """D4: a forward that synchronises with the host raises under capture. The bucket is stored
    without a graph, the reason is logged once, and later calls run eager forwards: no second
    warm-up, no second capture."""
    lm = _FakeLM(fake_cuda, index=0, syncs=True)
    g = GraphedForward(lm, warmup=2)
    cache = _FakeCache()
    with caplog.at_level(logging.WARNING, logger="specdec.graphs"):
        a = _step(g, cache, [[1, 2, 3]])
        assert len(lm.calls) == 2 + 1 + 1  # warm-ups, the failed capture, the eager forward
        b = _step(g, cache, [[4, 5, 6]])
        assert len(lm.calls) == 2 + 1 + 1 + 1  # the second call: one eager forward, nothing retried
        c = _step(g, cache, [[7, 8, 9]])
    assert [under_capture for _, under_capture in lm.calls] == [False, False, True, False, False, False]
    for out, toks in ((a, [[1, 2, 3]]), (b, [[4, 5, 6]]), (c, [[7, 8, 9]])):
        assert torch.equal(out, lm.logits(torch.tensor(toks), torch.arange(3)[None], cache.lens))
    assert g.capture_failures == 1 and g.captures == 0 and g.replays == 0 and g.eager_calls == 3
    assert list(g.buckets().values()) == [False]
    (reason,) = g.failures().values()
    assert reason == "RuntimeError: CUDA error: operation not permitted when stream is capturing"
    warned = [r.getMessage() for r in caplog.records if r.name == "specdec.graphs"]
    assert len(warned) == 1, warned
    assert "tokens [1, 3]" in warned[0] and "operation not permitted when stream is capturing" in warned[0]
    assert ("set_stream", 0) in fake_cuda.events and ("synchronize", 0) in fake_cuda.events
    _step(g, cache, [[1, 2]])  # another shape: its own capture attempt (and its own warning)
    assert g.capture_failures == 2 and len(lm.calls) == 6 + 2 + 1 + 1


def test_a_warm_up_error_propagates_and_stores_no_bucket(fake_cuda):
    lm = _FakeLM(fake_cuda, index=0)
    g = GraphedForward(lm)
    with pytest.raises(ValueError, match="tokens must be >= 0"):  # the forward's own check, in the warm-up
        _step(g, _FakeCache(), [[-1, 2]])
    assert not g.buckets() and g.capture_failures == 0


def test_fallbacks_and_errors():
    lm = specdec.HFCausalLM(_tiny("llama"))
    g = GraphedForward(lm, capture=False)
    cache = lm.new_cache(1, 16)
    lm.prefill(cache, [[5, 17, 29]])
    before = g.eager_calls
    with pytest.raises(ValueError, match="HFCausalLM.forward: tree_mask must be bool"):
        g.forward(cache, torch.zeros(1, 2, dtype=torch.long), torch.arange(2)[None], torch.ones(1, 2, 2))
    assert g.eager_calls == before + 1 and not g.buckets()  # a float mask is no bucket: lm.forward's check
    with pytest.raises(ValueError, match="HFCausalLM.forward: depths must have the shape of tokens"):
        g.forward(cache, torch.zeros(1, 2, dtype=torch.long), torch.arange(3)[None])
    assert not g.buckets()
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="GraphedForward: capture=True needs a model on a CUDA device"):
            GraphedForward(lm, capture=True)
        assert GraphedForward(lm).capture is False  # the default follows the model's device
    for bad in (0, True, 2.5):
        with pytest.raises(ValueError, match="GraphedForward: max_graphs must be an int >= 1"):
            GraphedForward(lm, max_graphs=bad)
    with pytest.raises(ValueError, match="GraphedForward: warmup must be an int >= 1"):
        GraphedForward(lm, warmup=0)
    with pytest.raises(TypeError, match="GraphedForward: lm must have a forward"):
        GraphedForward(object())


# --------------------------------------------------------------------------- CUDA
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device and a CUDA build of specdec")
@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_cuda_captured_replay_equals_eager_without_host_sync(arch):
    lm = specdec.HFCausalLM(_tiny(arch).cuda())
    g = GraphedForward(lm)
    assert g.capture
    parents = [[-1, 0, 0, 1, 2], [-1, 0, 1, 2, 3]]
    depths, mask = _depths(parents).cuda(), _ancestor_mask(parents).cuda()
    outs = []
    for m in (lm, g):
        cache = lm.new_cache(2, 32)
        lm.prefill(cache, [[5, 17, 29], [7, 8, 9, 10, 11]])
        step = []
        for i, t in enumerate(([[3, 40, 41, 42, 43], [4, 50, 51, 52, 53]], [[6, 1, 2, 3, 4], [9, 8, 7, 6, 5]],
                               [[1, 2, 3, 4, 5], [5, 4, 3, 2, 1]])):
            tokens = torch.tensor(t, device="cuda")
            if m is g and i == 2:  # a replay: no host synchronisation inside
                torch.cuda.set_sync_debug_mode("error")
                try:
                    step.append(m.forward(cache, tokens, depths, mask))
                finally:
                    torch.cuda.set_sync_debug_mode("default")
            else:
                step.append(m.forward(cache, tokens, depths, mask))
            cache.lens += 1  # the committed prefix moves between steps: the replay follows it
        outs.append(step)
    for a, b in zip(*outs):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    assert g.captures == 1 and g.replays == 3


@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device and a CUDA build of specdec")
def test_cuda_replays_follow_their_inputs_and_return_copies():
    """Two buckets, replays with new tokens: each replay's logits equal an eager forward's, differ
    from the previous replay's, and are not the graph's output buffer (nor changed by later replays)."""
    lm = specdec.HFCausalLM(_tiny("llama").cuda())
    g = GraphedForward(lm)
    cache = lm.new_cache(1, 32)
    lm.prefill(cache, [[5, 17, 29]])
    got, want = [], []
    for toks in ([[3, 4]], [[9, 8]], [[3]], [[7, 7]], [[11]]):
        tokens = torch.tensor(toks, device="cuda")
        depths = torch.arange(tokens.shape[1], device="cuda")[None]
        want.append(lm.forward(cache, tokens, depths))
        got.append(g.forward(cache, tokens, depths))
    kept = [t.clone() for t in got]
    g.forward(cache, torch.tensor([[1, 2]], device="cuda"), torch.arange(2, device="cuda")[None])
    statics = {b.logits.data_ptr() for b in g._buckets.values()}
    for a, b, k in zip(got, want, kept):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
        assert a.data_ptr() not in statics and a.untyped_storage().data_ptr() not in statics
        assert torch.equal(a, k)  # later replays left the returned tensors alone
    assert not torch.equal(got[0], got[1]) and not torch.equal(got[2], got[4])
    assert g.captures == 2 and g.replays == 6


@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device and a CUDA build of specdec")
def test_cuda_capture_under_strict_checks_falls_back_to_eager(caplog):
    """Strict checks read values on the host: the capture raises, the bucket runs eagerly (logged
    once), and the outputs stay the eager forward's."""
    lm = specdec.HFCausalLM(_tiny("llama").cuda())
    g = GraphedForward(lm)
    cache = lm.new_cache(1, 32)
    lm.prefill(cache, [[5, 17, 29]])
    depths = torch.arange(2, device="cuda")[None]
    with strict_checks(), caplog.at_level(logging.WARNING, logger="specdec.graphs"):
        for toks in ([[3, 4]], [[9, 8]], [[1, 2]]):
            tokens = torch.tensor(toks, device="cuda")
            torch.testing.assert_close(g.forward(cache, tokens, depths), lm.forward(cache, tokens, depths),
                                       rtol=0, atol=0)
    assert g.capture_failures == 1 and g.captures == 0 and g.eager_calls == 3
    assert len([r for r in caplog.records if r.name == "specdec.graphs"]) == 1
    torch.cuda.synchronize()  # the failed capture left no error behind
    g2 = GraphedForward(lm)  # strict checks off again: the same shape captures
    tokens = torch.tensor([[3, 4]], device="cuda")
    torch.testing.assert_close(g2.forward(cache, tokens, depths), lm.forward(cache, tokens, depths), rtol=0, atol=0)
    assert g2.captures == 1


_TWO_GPUS = HAS_CUDA and torch.cuda.device_count() >= 2


@pytest.mark.skipif(not _TWO_GPUS, reason="needs 2 CUDA devices (the model on cuda:1 while cuda:0 is current)")
def test_cuda_model_on_a_non_default_device():
    """D3: the model on cuda:1, cuda:0 current: captured replays equal eager forwards and change
    with their inputs (an empty graph would return the capture-time logits every time)."""
    lm = specdec.HFCausalLM(_tiny("llama").to("cuda:1"))
    torch.cuda.set_device(0)
    g = GraphedForward(lm)
    cache = lm.new_cache(1, 32)
    lm.prefill(cache, [[5, 17, 29]])
    outs = []
    for toks in ([[3, 4]], [[9, 8]], [[1, 2]]):
        tokens = torch.tensor(toks, device="cuda:1")
        depths = torch.arange(2, device="cuda:1")[None]
        want = lm.forward(cache, tokens, depths)
        outs.append(g.forward(cache, tokens, depths))
        torch.testing.assert_close(outs[-1], want, rtol=0, atol=0)
        cache.lens += 1
    assert not torch.equal(outs[0], outs[1]) and not torch.equal(outs[1], outs[2])
    assert g.captures == 1 and g.replays == 3 and torch.cuda.current_device() == 0


@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device and a CUDA build of specdec")
def test_cuda_captured_decoding_equals_eager_decoding():
    lm = specdec.HFCausalLM(_tiny("llama").cuda())
    want = _outputs(lm, PromptLookup(ngram=2, k=3))
    g = GraphedForward(lm)
    assert _outputs(g, PromptLookup(ngram=2, k=3)) == want
    assert g.captures >= 2 and g.replays > g.captures
