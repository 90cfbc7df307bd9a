"""The fuzz harness (tests/fuzz_ops.py) over every op, one subprocess per op and device.

A subprocess, so that a crash (SIGSEGV, SIGFPE, abort) fails this test with the case that
caused it (the last line the harness wrote to stderr) instead of killing the test run.
CI profile: a fixed example count per op (SPECDEC_FUZZ_EXAMPLES, default 300) and a fixed
seed, so the same inputs run every time; the long profile is benchmarks/fuzz_ops.sh.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import DEVICES

HARNESS = Path(__file__).with_name("fuzz_ops.py")
OPS = ("verify_attention", "append_kv", "rejection_sample", "greedy_verify", "kv_commit", "linear", "qlinear",
       "rms_norm", "add_rms_norm", "rope", "silu_mul", "decoder_layer")
EXAMPLES = int(os.environ.get("SPECDEC_FUZZ_EXAMPLES", "300"))


def test_harness_covers_every_registered_op():
    """Every op of torch.ops.specdec joins the harness (new ops included)."""
    import torch
    import specdec  # noqa: F401  (registers the ops)
    sys.path.insert(0, str(HARNESS.parent))
    import fuzz_ops
    registered = {name.split("::", 1)[1] for name in torch._C._dispatch_get_all_op_names()
                  if name.startswith("specdec::")}
    assert "rejection_sample" in registered, registered
    assert registered <= set(fuzz_ops.FUZZERS), f"ops without a fuzzer: {sorted(registered - set(fuzz_ops.FUZZERS))}"
    assert set(OPS) == set(fuzz_ops.FUZZERS)


@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("device", DEVICES)
def test_fuzz_op(op, device):
    proc = subprocess.run([sys.executable, str(HARNESS), "--op", op, "--examples", str(EXAMPLES), "--seed", "0",
                           "--device", device], capture_output=True, text=True, timeout=600)
    if proc.returncode != 0:
        last = [l for l in proc.stderr.splitlines() if l.startswith(op + ":")][-1:]
        how = (f"killed by {signal.Signals(-proc.returncode).name}" if proc.returncode < 0
               else f"exit code {proc.returncode}")
        pytest.fail(f"fuzz harness for {op} on {device}: {how}\nlast case: {last}\n"
                    f"stdout: {proc.stdout[-2000:]}\nstderr tail:\n{proc.stderr[-6000:]}")
    assert f"{EXAMPLES} examples" in proc.stdout, proc.stdout
