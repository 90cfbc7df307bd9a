"""The fuzz harness (tests/fuzz_ops.py) over every op, one subprocess per op and device.

A subprocess, so that a crash (SIGSEGV, SIGFPE, abort) fails this test with the case that
caused it (the last line the harness wrote to stderr) instead of killing the test run.
CI profile: a fixed example count per op (SPECDEC_FUZZ_EXAMPLES, default 300) and a fixed
seed, so the same inputs run every time; the long profile is benchmarks/fuzz_ops.sh.
SPECDEC_FUZZ_JOBS (default 1) runs that many harness subprocesses at once: the first fuzz
test of a device starts every selected op of that device, the others collect their results
(benchmarks/gpu_check.sh uses it on a many-core GPU machine).

The harness's CUDA rule (value checks only in strict mode there) is tested on the CPU below
with a fake op that behaves as a CUDA op does: unchecked values when strict checks are off.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Dict, Tuple

import pytest
import torch

from conftest import DEVICES

HARNESS = Path(__file__).with_name("fuzz_ops.py")
OPS = ("verify_attention", "append_kv", "rejection_sample", "greedy_verify", "kv_commit", "verify_attention_paged",
       "append_kv_paged", "kv_commit_paged", "linear", "qlinear", "qlinear_q8act", "linear_argmax", "qlinear_argmax",
       "quantize_q8", "pack_q8act",
       "rms_norm", "add_rms_norm", "rope", "silu_mul", "decoder_layer", "decoder_layer_paged")
EXAMPLES = int(os.environ.get("SPECDEC_FUZZ_EXAMPLES", "300"))
JOBS = max(1, int(os.environ.get("SPECDEC_FUZZ_JOBS", "1")))


def _harness():
    sys.path.insert(0, str(HARNESS.parent))
    import fuzz_ops
    return fuzz_ops


def test_harness_covers_every_registered_op():
    """Every op of torch.ops.specdec joins the harness (new ops included)."""
    import specdec  # noqa: F401  (registers the ops)
    fuzz_ops = _harness()
    registered = {name.split("::", 1)[1] for name in torch._C._dispatch_get_all_op_names()
                  if name.startswith("specdec::")}
    assert "rejection_sample" in registered, registered
    assert registered <= set(fuzz_ops.FUZZERS), f"ops without a fuzzer: {sorted(registered - set(fuzz_ops.FUZZERS))}"
    assert set(OPS) == set(fuzz_ops.FUZZERS)


def _run(op: str, device: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(HARNESS), "--op", op, "--examples", str(EXAMPLES), "--seed", "0",
                           "--device", device], capture_output=True, text=True, timeout=600)


_POOL = None
_RUNS: Dict[Tuple[str, str], "Future[subprocess.CompletedProcess]"] = {}


def _result(request, op: str, device: str) -> subprocess.CompletedProcess:
    """The harness run of (op, device): now (JOBS = 1), or from the pool that the first fuzz test of
    this device filled with every selected fuzz case of the device (the device is usable: a test of
    it is running)."""
    global _POOL
    if JOBS <= 1:
        return _run(op, device)
    if (op, device) not in _RUNS:
        _POOL = _POOL or ThreadPoolExecutor(max_workers=JOBS, thread_name_prefix="fuzz")
        wanted = [(op, device)]
        for item in request.session.items:
            spec = getattr(item, "callspec", None)
            if getattr(item, "originalname", None) == "test_fuzz_op" and spec and spec.params.get("device") == device:
                wanted.append((spec.params["op"], device))
        for key in wanted:
            if key not in _RUNS:
                _RUNS[key] = _POOL.submit(_run, *key)
    return _RUNS[(op, device)].result()


@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("device", DEVICES)
def test_fuzz_op(op, device, request):
    proc = _result(request, op, device)
    if proc.returncode != 0:
        last = [l for l in proc.stderr.splitlines() if l.startswith(op + ":")][-1:]
        how = (f"killed by {signal.Signals(-proc.returncode).name}" if proc.returncode < 0
               else f"exit code {proc.returncode}")
        pytest.fail(f"fuzz harness for {op} on {device}: {how}\nlast case: {last}\n"
                    f"stdout: {proc.stdout[-2000:]}\nstderr tail:\n{proc.stderr[-6000:]}")
    assert f"{EXAMPLES} examples" in proc.stdout, proc.stdout


# --------------------------------------------------------------------------- the CUDA rule, on the CPU
def test_value_checks_need_strict_mode_off_the_cpu_only():
    fuzz_ops = _harness()
    assert not fuzz_ops.values_checked_only_in_strict("cpu")
    assert fuzz_ops.values_checked_only_in_strict("cuda")
    assert fuzz_ops.values_checked_only_in_strict(torch.device("cuda", 1))


class _CudaLikeOp:
    """An op "fake_op" over (cache [B, S], cache_lens [B], offset) that writes 1.0 at cache[b, lens[b] +
    offset]. Called on the harness's own input tensors (the device run) with strict checks off, it
    does what a CUDA op does: no value check, out-of-range rows skipped (memory-safe). Anywhere else
    (the CPU judge's copies, strict mode) it checks the values as the CPU op does. ``strict_checks``
    = False: a strict mode that forgets the check; ``message`` = the error it raises."""

    def __init__(self, device_lens, strict_checks=True, message="fake_op: cache_lens[{b}] = {v} is out of range",
                 wrong_result=False, touch_lens=False):
        self.device_lens, self.strict_checks, self.message = device_lens, strict_checks, message
        self.wrong_result, self.touch_lens = wrong_result, touch_lens
        self.calls = []

    def __call__(self, cache, cache_lens, offset):
        from specdec import ops
        device_run = cache_lens is self.device_lens and not ops.strict_checks()
        self.calls.append("strict" if ops.strict_checks() else "device" if device_run else "cpu judge")
        S = cache.shape[1]
        if not device_run and (self.strict_checks or not ops.strict_checks()):
            for b, v in enumerate(cache_lens.tolist()):
                if not 0 <= v + offset < S:
                    raise RuntimeError(self.message.format(b=b, v=v))
        for b, v in enumerate(cache_lens.tolist()):
            if 0 <= v + offset < S:
                cache[b, v + offset] = 2.0 if self.wrong_result else 1.0
        if self.touch_lens:
            cache_lens.zero_()


def _reference_check(args):
    def check(out, before):
        want = before["cache"].clone()
        for b, v in enumerate(before["cache_lens"].tolist()):
            want[b, v + before["offset"]] = 1.0  # raises IndexError past the cache (the reference's own error)
        assert torch.equal(args["cache"], want), "cache differs from the reference"
    return check


@pytest.fixture()
def harness(monkeypatch):
    """fuzz_ops with DEVICE = "cuda" (the device parameter mocked: tensors stay on the CPU)."""
    fuzz_ops = _harness()
    monkeypatch.setattr(fuzz_ops, "DEVICE", "cuda")
    monkeypatch.setattr(fuzz_ops, "sync", lambda: None)
    monkeypatch.setitem(fuzz_ops.ARGS, "fake_op", ("cache", "cache_lens", "offset"))
    for k in fuzz_ops.STATS:
        monkeypatch.setitem(fuzz_ops.STATS, k, 0)
    return fuzz_ops


def _args(lens):
    return dict(cache=torch.zeros(len(lens), 6), cache_lens=torch.tensor(lens, dtype=torch.int32), offset=1)


def _run_property(fuzz_ops, op, args):
    fuzz_ops.run_property("fake_op", op, args, _reference_check(args), ["cache_lens"])


def test_cuda_rule_value_corrupted_draw_is_memory_safe_then_strict(harness):
    """D2: a length past the cache on "CUDA": the unchecked run returns (memory-safe), the CPU judge
    rejects the value, the strict rerun raises the clear error: the example passes."""
    args = _args([2, 9])
    op = _CudaLikeOp(args["cache_lens"])
    _run_property(harness, op, args)
    assert op.calls == ["device", "cpu judge", "strict"]
    assert harness.STATS["unchecked"] == 1 and harness.STATS["matched"] == 0


def test_cpu_rule_compares_the_same_draw_with_the_reference(harness, monkeypatch):
    """Without the CUDA rule (the harness before the fix) the same draw is compared with a reference
    that raises: the failure that test_fuzz_op[...-cuda] had on every GPU."""
    monkeypatch.setattr(harness, "values_checked_only_in_strict", lambda device: False)
    args = _args([2, 9])
    with pytest.raises(IndexError):
        _run_property(harness, _CudaLikeOp(args["cache_lens"]), args)


def test_cuda_rule_valid_draw_is_compared_with_the_reference(harness):
    args = _args([2, 0])
    op = _CudaLikeOp(args["cache_lens"])
    _run_property(harness, op, args)
    assert op.calls == ["device", "cpu judge"] and harness.STATS["matched"] == 1
    args = _args([2, 0])  # a wrong result on valid values still fails
    with pytest.raises(AssertionError, match="cache differs from the reference"):
        _run_property(harness, _CudaLikeOp(args["cache_lens"], wrong_result=True), args)


def test_cuda_rule_strict_mode_must_raise_a_clear_error(harness):
    args = _args([2, 9])
    with pytest.raises(AssertionError, match="the CPU rejects these inputs .* but strict checks on cuda accept them"):
        _run_property(harness, _CudaLikeOp(args["cache_lens"], strict_checks=False), args)
    args = _args([2, 9])
    with pytest.raises(AssertionError, match="error message does not name the op"):
        _run_property(harness, _CudaLikeOp(args["cache_lens"], message="index {v} out of range"), args)


def test_cuda_rule_unchecked_run_keeps_read_only_inputs(harness):
    args = _args([2, 9])
    with pytest.raises(AssertionError, match="cache_lens was modified"):
        _run_property(harness, _CudaLikeOp(args["cache_lens"], touch_lens=True), args)


def test_cpu_judge_runs_the_real_op():
    """cpu_rejects on a real op: an invalid length is rejected with the op's message, a valid one not."""
    fuzz_ops = _harness()
    from specdec import ops
    k, v = torch.zeros(1, 1, 4, 8), torch.zeros(1, 1, 4, 8)
    new = torch.ones(1, 1, 2, 8)
    for lens, rejected in ((2, False), (3, True), (-1, True)):
        args = dict(k_cache=k, v_cache=v, k_new=new, v_new=new, cache_lens=torch.tensor([lens], dtype=torch.int32),
                    offset=0)
        msg = fuzz_ops.cpu_rejects(ops.append_kv, args)
        assert (msg is not None) == rejected, (lens, msg)
        if rejected:
            assert msg.startswith("append_kv: cache_lens[0]"), msg
    assert not k.any()  # the judge ran on copies
