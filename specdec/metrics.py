"""Metrics of a generate call: per-step recording and the summary dict (DESIGN.md keys).

Keys of ``GenerateOutput.metrics`` (one summary per generate call):

target_passes          batched target verification forwards (the prefill not counted)
drafted_tokens         draft nodes proposed, root excluded, summed over requests and steps
                       (a tree counts every node, so trees have lower acceptance_rate by construction)
accepted_tokens        draft nodes accepted by verification (before EOS / max_new_tokens truncation)
acceptance_rate        accepted_tokens / drafted_tokens (0 without drafts)
mean_accepted_length   tokens emitted per target pass per request, bonus included:
                       (accepted_tokens + request-steps) / request-steps (1.0 for plain decoding)
accepted_per_position  [i]: among request-steps whose draft reached depth i + 1, the fraction whose
                       accepted path reached depth i + 1
draft_seconds          drafter time (its prefill included)
verify_seconds         target forward over the tree + verification op (+ warping when sampling)
commit_seconds         target kv_commit + drafter rollback
prefill_seconds        target prefill + first-token draw
ttft_seconds           call start -> first token of every request known on the host
itl_p50/p99_seconds    inter-token latency: each step's wall time split evenly over the tokens it
                       emitted for a request (one sample per emitted token after the first)
tokens_per_second      new tokens of all requests / wall time of the call
total_seconds, new_tokens
peak_memory_bytes      CUDA: torch.cuda.max_memory_allocated during the call. CPU: weights + KV
                       caches (static_memory_bytes) + the growth of the process' peak RSS during the
                       call (tracemalloc does not see torch's allocations)
static_memory_bytes    weights (target + draft model) + KV caches (target + draft)
per_request            lists per request: new_tokens, target_passes, drafted_tokens,
                       accepted_tokens, mean_accepted_length, finish_reason ("eos" / "length")

Timing: host wall clock on CPU (every op is synchronous there); CUDA events on CUDA, read
once at the end of the call (no synchronisation inside the loop).
"""
from __future__ import annotations

import math
import os
import time
from typing import Dict, List, Sequence, Tuple

import torch

__all__ = ["MetricsRecorder", "PhaseClock", "MemoryProbe", "static_memory_bytes", "state_bytes", "percentile",
           "empty_metrics"]


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

    def summary(self, new: Sequence[Sequence[int]], finish: Sequence[str], t_start: float, t_first: float,
                t_end: float, peak: int, static: int) -> Dict[str, object]:
        times = self.clock.totals()
        drafted = sum(self.drafted)
        accepted = sum(self.accepted)
        request_steps = sum(self.passes)
        new_tokens = sum(len(t) for t in new)
        itl = sorted(self.itl)
        return {
            "target_passes": self.target_passes,
            "drafted_tokens": drafted,
            "accepted_tokens": accepted,
            "acceptance_rate": accepted / drafted if drafted else 0.0,
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
    return rec.summary([[] for _ in range(batch)], ["length"] * batch, 0.0, 0.0, 0.0, 0, 0)


def percentile(sorted_vals: List[float], q: float) -> float:
    if not sorted_vals:
        return 0.0
    pos = (len(sorted_vals) - 1) * q / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(sorted_vals) - 1)
    return sorted_vals[lo] + (sorted_vals[hi] - sorted_vals[lo]) * (pos - lo)


class PhaseClock:
    """Phase timers: host wall clock on CPU (ops are synchronous); CUDA events on CUDA, read once at the end."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self._totals: Dict[str, float] = {}
        self._events: List[Tuple[str, object, object]] = []

    def mark(self):
        if self.cuda:
            e = torch.cuda.Event(enable_timing=True)
            e.record()
            return e
        return time.perf_counter()

    def add(self, name: str, start, end) -> None:
        if self.cuda:
            self._events.append((name, start, end))
        else:
            self._totals[name] = self._totals.get(name, 0.0) + (end - start)

    def totals(self) -> Dict[str, float]:
        if self.cuda and self._events:
            torch.cuda.synchronize()
            for name, s, e in self._events:
                self._totals[name] = self._totals.get(name, 0.0) + s.elapsed_time(e) / 1000.0
            self._events = []
        return self._totals


def static_memory_bytes(target, drafter, caches: Sequence) -> int:
    """Weights of the target and of a draft model (a drafter's ``lm``), plus the given KV caches."""
    total = state_bytes(target) + sum(c.nbytes() for c in caches if c is not None)
    lm = getattr(drafter, "lm", None)
    if lm is not None:
        total += state_bytes(lm)
    return total


def state_bytes(lm) -> int:
    """Bytes of a model's weights (parameters, buffers and packed quantized weights), each storage once."""
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
