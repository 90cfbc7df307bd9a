"""Metrics of a generate call: per-step recording, the summary dict, traces and memory.

Every key of ``GenerateOutput.metrics`` and of a trace record is documented in docs/metrics.md.
The recorder reads one :class:`specdec.telemetry.StepRecord` per step.
"""
from __future__ import annotations

import math
import os
from typing import Dict, List, Sequence

import torch

from specdec.telemetry import PhaseClock, StepRecord

__all__ = ["MetricsRecorder", "PhaseClock", "MemoryProbe", "static_memory_bytes", "state_bytes", "percentile",
           "empty_metrics", "write_trace", "read_trace", "summarize_trace", "expected_tokens_from_acceptance",
           "TRACE_STEP_KEYS", "TRACE_EVENT_KEYS", "POLICY_KEYS"]

#: keys of a type="step" trace record
TRACE_STEP_KEYS = ("type", "step", "request", "row", "batch", "state", "k", "nodes", "depth", "drafted", "accepted",
                   "emitted", "expected_tokens", "predicted_goodput_ratio", "draft_seconds", "verify_seconds",
                   "commit_seconds", "catch_up_seconds", "step_seconds", "plain_seconds_estimate")
#: keys every type="event" trace record has (entering fallback adds next_probe_step)
TRACE_EVENT_KEYS = ("type", "step", "request", "reason", "old_state", "new_state", "goodput_ratio")
#: policy keys of the summary
POLICY_KEYS = ("policy", "policy_events", "fallback_request_steps", "mean_chosen_k", "chosen_k_histogram",
               "expected_tokens_predicted", "expected_tokens_observed", "expected_tokens_from_acceptance",
               "predicted_goodput_ratio")


class MetricsRecorder:
    """Host-side counters of one generate call (updated once per step with host values)."""

    def __init__(self, batch: int, device: torch.device) -> None:
        self.passes = [0] * batch
        self.drafted = [0] * batch
        self.accepted = [0] * batch
        self.pos_drafted: List[int] = []
        self.pos_accepted: List[int] = []
        self.itl: List[float] = []
        self.target_passes = 0
        self.clock = PhaseClock(device)

    def step(self, request_ids: Sequence[int], drafted: Sequence[int], depths: Sequence[int],
             accepted: Sequence[int], emitted: Sequence[int], seconds: float) -> None:
        """One verification pass: per active row its request id, draft nodes, draft depth, accepted
        draft nodes and tokens emitted (after truncation), and the step's wall time."""
        self.target_passes += 1
        grow = max(depths, default=0) - len(self.pos_drafted)
        if grow > 0:
            self.pos_drafted += [0] * grow
            self.pos_accepted += [0] * grow
        grow = max(request_ids, default=-1) + 1 - len(self.passes)
        if grow > 0:  # requests that joined a running batch (specdec.Engine)
            self.passes += [0] * grow
            self.drafted += [0] * grow
            self.accepted += [0] * grow
        for rid, d, depth, a, n in zip(request_ids, drafted, depths, accepted, emitted):
            self.passes[rid] += 1
            self.drafted[rid] += d
            self.accepted[rid] += a
            for i in range(depth):
                self.pos_drafted[i] += 1
            for i in range(a):
                self.pos_accepted[i] += 1
            if n:
                self.itl += [seconds / n] * n

    def observe(self, step: StepRecord) -> None:
        """One engine step's record (the step's wall time splits evenly over each row's emitted tokens)."""
        self.step(step.request_ids, step.drafted, step.depths, step.accepted, step.emitted, step.times.total)

    def summary(self, new: Sequence[Sequence[int]], finish: Sequence[str], t_start: float, t_first: float,
                t_end: float, peak: int, static: int) -> Dict[str, object]:
        times = self.clock.totals()
        drafted = sum(self.drafted)
        accepted = sum(self.accepted)
        request_steps = sum(self.passes)
        new_tokens = sum(len(t) for t in new)
        itl = sorted(self.itl)
        drafted_steps = sum(self.pos_drafted[:1])  # request-steps with a draft of depth >= 1
        mean_depth = sum(self.pos_drafted) / drafted_steps if drafted_steps else 0.0
        return {
            "target_passes": self.target_passes,
            "drafted_tokens": drafted,
            "accepted_tokens": accepted,
            "acceptance_rate": accepted / drafted if drafted else 0.0,
            "expected_tokens_from_acceptance": expected_tokens_from_acceptance(
                accepted / drafted if drafted else 0.0, mean_depth),
            "mean_accepted_length": (accepted + request_steps) / request_steps if request_steps else 0.0,
            "accepted_per_position": [a / d if d else 0.0 for a, d in zip(self.pos_accepted, self.pos_drafted)],
            "draft_seconds": times.get("draft", 0.0) + times.get("draft_prefill", 0.0),
            "verify_seconds": times.get("verify", 0.0),
            "commit_seconds": times.get("commit", 0.0),
            "prefill_seconds": times.get("prefill", 0.0),
            "ttft_seconds": t_first - t_start,
            "itl_p50_seconds": percentile(itl, 50),
            "itl_p99_seconds": percentile(itl, 99),
            "tokens_per_second": new_tokens / (t_end - t_start) if t_end > t_start else 0.0,
            "total_seconds": t_end - t_start,
            "new_tokens": new_tokens,
            "peak_memory_bytes": int(peak),
            "static_memory_bytes": int(static),
            "per_request": {
                "new_tokens": [len(t) for t in new],
                "target_passes": list(self.passes),
                "drafted_tokens": list(self.drafted),
                "accepted_tokens": list(self.accepted),
                "mean_accepted_length": [(a + p) / p if p else 0.0 for a, p in zip(self.accepted, self.passes)],
                "finish_reason": list(finish),
            },
        }


def empty_metrics(batch: int) -> Dict[str, object]:
    """The summary of a call that generated nothing (max_new_tokens=0)."""
    rec = MetricsRecorder(batch, torch.device("cpu"))
    out = rec.summary([[] for _ in range(batch)], ["length"] * batch, 0.0, 0.0, 0.0, 0, 0)
    out.update(policy="none", policy_events=0, fallback_request_steps=0, mean_chosen_k=0.0, chosen_k_histogram={},
               expected_tokens_predicted=0.0, expected_tokens_observed=0.0, predicted_goodput_ratio=0.0)
    return out


def expected_tokens_from_acceptance(alpha: float, depth: float) -> float:
    """E[T] = (1 - alpha^(k+1)) / (1 - alpha) for a chain of (possibly fractional, mean) depth k; 1 without drafts."""
    if depth <= 0:
        return 1.0
    if alpha >= 1.0:
        return depth + 1.0
    return (1.0 - alpha ** (depth + 1.0)) / (1.0 - alpha)


def write_trace(trace, path) -> None:
    """Write trace records as JSON lines (one object per line)."""
    import json

    with open(path, "w") as f:
        for rec in trace or []:
            f.write(json.dumps(rec) + "\n")


def summarize_trace(trace: Sequence[dict]) -> Dict[str, object]:
    """Aggregates of a per-step trace (the dashboard's inputs).

    steps / request_steps: step records' distinct steps / records; tokens, drafted, accepted: sums;
    seconds: {draft, verify, commit, step} summed once per step (rows of a step share them);
    goodput_tokens_per_second: tokens / seconds["step"]; k_per_step: the step's chosen depth (max
    over its rows); accepted_per_position: as the summary key (among request-steps whose draft
    reached depth i + 1, the fraction whose accepted path did); state_steps: request-steps per
    state; per_request: {request: {tokens, drafted, accepted, fallback_steps, probe_steps}};
    events: the event records.
    """
    steps: Dict[int, dict] = {}
    per_request: Dict[int, Dict[str, int]] = {}
    state_steps: Dict[str, int] = {}
    pos_d: List[int] = []
    pos_a: List[int] = []
    events = []
    n_records = 0
    for rec in trace:
        if rec.get("type") == "event":
            events.append(rec)
            continue
        n_records += 1
        st = steps.setdefault(rec["step"], dict(k=0, draft=rec["draft_seconds"], verify=rec["verify_seconds"],
                                                commit=rec["commit_seconds"], step=rec["step_seconds"]))
        st["k"] = max(st["k"], rec["k"])
        r = per_request.setdefault(rec["request"], dict(tokens=0, drafted=0, accepted=0, fallback_steps=0,
                                                        probe_steps=0))
        r["tokens"] += rec["emitted"]
        r["drafted"] += rec["drafted"]
        r["accepted"] += rec["accepted"]
        r["fallback_steps"] += rec["state"] == "fallback"
        r["probe_steps"] += rec["state"] == "probe"
        state_steps[rec["state"]] = state_steps.get(rec["state"], 0) + 1
        depth = rec["depth"]
        while len(pos_d) < depth:
            pos_d.append(0)
            pos_a.append(0)
        for i in range(depth):
            pos_d[i] += 1
        for i in range(min(rec["accepted"], depth)):
            pos_a[i] += 1
    order = sorted(steps)
    seconds = {key: sum(steps[s][key] for s in order) for key in ("draft", "verify", "commit", "step")}
    tokens = sum(r["tokens"] for r in per_request.values())
    return {
        "steps": len(order),
        "request_steps": n_records,
        "tokens": tokens,
        "drafted": sum(r["drafted"] for r in per_request.values()),
        "accepted": sum(r["accepted"] for r in per_request.values()),
        "seconds": seconds,
        "goodput_tokens_per_second": tokens / seconds["step"] if seconds["step"] > 0 else 0.0,
        "k_per_step": [steps[s]["k"] for s in order],
        "accepted_per_position": [a / d if d else 0.0 for a, d in zip(pos_a, pos_d)],
        "state_steps": state_steps,
        "per_request": per_request,
        "events": events,
    }


def read_trace(path) -> List[dict]:
    """Read a JSON-lines trace written by :func:`write_trace`."""
    import json

    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def percentile(sorted_vals: List[float], q: float) -> float:
    if not sorted_vals:
        return 0.0
    pos = (len(sorted_vals) - 1) * q / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(sorted_vals) - 1)
    return sorted_vals[lo] + (sorted_vals[hi] - sorted_vals[lo]) * (pos - lo)


def static_memory_bytes(target, drafter, caches: Sequence) -> int:
    """Weights of the target and of a draft model (a drafter's ``lm``), plus the given KV caches."""
    total = state_bytes(target) + sum(c.nbytes() for c in caches if c is not None)
    lm = getattr(drafter, "lm", None)
    if lm is not None:
        total += state_bytes(lm)
    return total


def state_bytes(lm) -> int:
    """Bytes of a model's weights (parameters, buffers and packed quantized weights, the CPU's packed copies of
    q8-activation weights included), each storage once."""
    module = getattr(lm, "model", lm)
    if not isinstance(module, torch.nn.Module):
        return 0
    seen = set()
    total = 0

    def visit(v) -> None:
        nonlocal total
        if isinstance(v, torch.Tensor):
            try:
                key = (v.untyped_storage().data_ptr(), v.device)
                size = v.untyped_storage().nbytes()
            except (RuntimeError, NotImplementedError):  # quantized / opaque tensors
                key, size = (id(v), v.device), v.numel() * v.element_size()
            if key not in seen:
                seen.add(key)
                total += size
        elif isinstance(v, (tuple, list)):
            for x in v:
                visit(x)

    for v in module.state_dict(keep_vars=True).values():
        visit(v)
    from specdec.models.quant import q8act_packed

    for v in q8act_packed(module):  # the CPU's packed copies of q8-activation weights: their own bytes (in
        key = (v.data_ptr(), v.device)  # huge pages, several share one mapping: hugepage_copy)
        if key not in seen:
            seen.add(key)
            total += v.numel() * v.element_size()
    return total


class MemoryProbe:
    """Peak memory of a generate call.

    CUDA: ``torch.cuda.max_memory_allocated`` (reset at the start of the call; it counts
    weights and caches since they live in the caching allocator).
    CPU: tracemalloc does not see torch's allocations, so the figure is weights (target +
    draft) + KV caches (their ``nbytes``) + the growth of the process's peak resident set
    during the call (``VmHWM`` after ``malloc_trim(0)`` and a reset through
    ``/proc/self/clear_refs``; when the reset is not permitted, the RSS sampled at the end of
    the call). Resetting VmHWM affects anyone else reading it in this process.
    """

    def __init__(self, device: torch.device, static: int) -> None:
        self.device = torch.device(device)
        self.cuda = self.device.type == "cuda"
        self.static = int(static)
        if self.cuda:
            torch.cuda.reset_peak_memory_stats(self.device)
            return
        _malloc_trim()  # hand freed heap pages back first, so that reusing them shows up as growth
        self.hwm_reset = False
        try:  # reset the process' peak RSS (VmHWM) to its current RSS
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")
            self.hwm_reset = True
        except OSError:
            pass
        self.rss0 = _proc_status("VmRSS")

    def peak(self) -> int:
        if self.cuda:
            return int(torch.cuda.max_memory_allocated(self.device))
        end = _proc_status("VmHWM") if self.hwm_reset else _proc_status("VmRSS")
        return int(self.static + max(0, end - self.rss0))


def _malloc_trim() -> None:
    """glibc's malloc_trim(0): return free heap memory to the OS (no-op elsewhere)."""
    global _LIBC
    if _LIBC is None:
        try:
            import ctypes
            _LIBC = ctypes.CDLL("libc.so.6")
        except OSError:
            _LIBC = False
    if _LIBC:
        try:
            _LIBC.malloc_trim(0)
        except AttributeError:
            pass


_LIBC = None


def _proc_status(key: str) -> int:
    try:
        with open(f"/proc/{os.getpid()}/status") as f:
            for line in f:
                if line.startswith(key + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0
