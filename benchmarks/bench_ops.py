"""Kernel microbenchmarks of the specdec ops: time, bytes moved, achieved bandwidth.

    python benchmarks/bench_ops.py                      # CPU, full shapes
    python benchmarks/bench_ops.py --device cuda        # GPU
    python benchmarks/bench_ops.py --quick              # CI-sized shapes, few repetitions

One row per (op, shape): median time, the fewest bytes the op must move (napkin math of
docs/DESIGN.md), achieved GB/s and its fraction of the copy bandwidth measured in the
same run. On CPU each op is also timed against specdec.reference (python loops, so on
few repetitions) and verify_attention against torch SDPA given the equivalent explicit
mask (prefix visible + tree mask); the issue's CPU targets are checked and printed. On
CUDA, SDPA runs on the same shapes, times come from CUDA events around batches of calls
on rotating input sets larger than L2 (so every call reads from HBM), after warm-up.

Prints one table and writes JSON to benchmarks/results/ops_<device>_<date>.json (or --out).
"""
from __future__ import annotations

import argparse
import datetime as _dt
import json
import math
import os
import platform
import statistics
import subprocess
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable, Dict, List, Optional

import torch
import torch.nn.functional as F
from torch.utils import benchmark as tbench

import specdec
from specdec import ops, reference

ROOT = Path(__file__).resolve().parent.parent


# --------------------------------------------------------------------------- rows
@dataclass
class Row:
    op: str
    shape: str
    dtype: str
    median_us: float
    bytes: int
    gbps: float
    frac_copy_bw: Optional[float] = None
    ref_us: Optional[float] = None  # specdec.reference (CPU)
    speedup_vs_ref: Optional[float] = None
    sdpa_us: Optional[float] = None  # torch SDPA, explicit mask
    speedup_vs_sdpa: Optional[float] = None
    target: Optional[str] = None  # "PASS ..." / "FAIL ..." for the issue's CPU targets
    notes: str = ""
    extra: Dict = field(default_factory=dict)


# --------------------------------------------------------------------------- timing
class Timer:
    """Median seconds of fn() on the device: torch.utils.benchmark on CPU, CUDA events on GPU."""

    def __init__(self, device: str, quick: bool):
        self.device = device
        self.quick = quick

    def cpu(self, fn: Callable[[], object], min_run_time: Optional[float] = None) -> float:
        t = tbench.Timer(stmt="fn()", globals={"fn": fn}, num_threads=torch.get_num_threads())
        return t.blocked_autorange(min_run_time=min_run_time or (0.1 if self.quick else 0.5)).median

    def cpu_few(self, fn: Callable[[], object], reps: int) -> float:
        """The slow reference: `reps` single runs (one warm-up), median."""
        fn()
        t = tbench.Timer(stmt="fn()", globals={"fn": fn}, num_threads=torch.get_num_threads())
        return statistics.median(t.timeit(number=1).median for _ in range(reps))

    def cuda(self, fns: List[Callable[[], object]], reset: Optional[Callable[[], object]] = None,
             batch: int = 20, rounds: Optional[int] = None) -> float:
        """fns: one closure per rotating input set (together larger than L2). Each round
        times `batch` consecutive calls cycling through the sets between two events (after
        `reset()`, outside the timed region); the median per-call time over rounds."""
        rounds = rounds or (5 if self.quick else 25)
        for f in fns * 2:  # warm-up
            if reset:
                reset()
            f()
        torch.cuda.synchronize()
        times = []
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        for r in range(rounds):
            if reset:
                reset()
            start.record()
            for i in range(batch):
                fns[(r * batch + i) % len(fns)]()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) * 1e-3 / batch)
        return statistics.median(times)


def copy_bandwidth(device: str, timer: Timer) -> float:
    """Measured copy bandwidth in bytes/s, counting read + write (as DESIGN.md does)."""
    n = (1 << 30 if device == "cuda" else 1 << 28) // (4 if timer.quick else 1)  # bytes, >> any cache
    src = torch.empty(n // 4, dtype=torch.float32, device=device).uniform_()
    dst = torch.empty_like(src)
    if device == "cuda":
        t = timer.cuda([lambda: dst.copy_(src)], batch=5)
    else:
        t = timer.cpu(lambda: dst.copy_(src))
    return 2 * n / t


def rotating_sets(make: Callable[[int], object], one_set_bytes: int, device: str, min_sets: int = 2) -> List:
    """Enough independent input sets that cycling through them never hits L2 (GPU).
    one_set_bytes: the bytes one call touches (not the allocation): keep allocations
    small where the op touches a small window (append_kv, kv_commit)."""
    if device != "cuda":
        return [make(0)]
    l2 = getattr(torch.cuda.get_device_properties(0), "L2_cache_size", 64 << 20)
    k = max(min_sets, math.ceil(3 * l2 / max(one_set_bytes, 1)))  # the sets' touched bytes: 3x L2
    return [make(i) for i in range(min(k, 256))]


# --------------------------------------------------------------------------- inputs
def random_tree(B: int, N: int, g: torch.Generator) -> torch.Tensor:
    """Random parents (each node's parent uniform among earlier nodes, biased to the
    previous one: trees a few levels deep, like a top-k draft tree)."""
    parents = torch.empty(B, N, dtype=torch.int32)
    parents[:, 0] = -1
    for i in range(1, N):
        deep = torch.rand(B, generator=g) < 0.6
        parents[:, i] = torch.where(deep, torch.full((B,), i - 1), torch.randint(0, i, (B,), generator=g)).int()
    return parents


def sampling_inputs(B, N, V, device, *, seed, with_draft, logits_dtype=torch.float32):
    """A realistic verification: q ~ p (a noisy copy), sampled candidates drawn from q
    (deterministic ones: q's argmax), so that the walk accepts a few levels and visits
    several rows. The big tensors are generated on the device itself."""
    g = torch.Generator().manual_seed(seed)
    parents = random_tree(B, N, g).to(device)
    gd = torch.Generator(device=device).manual_seed(seed)
    z = torch.randn(B, N, V, generator=gd, device=device) * 3
    p = torch.softmax(z, -1)
    par = parents.clamp(min=0).long()
    zq = torch.gather(z, 1, par[:, :, None].expand(B, N, V))
    zq += 0.5 * torch.randn(B, N, V, generator=gd, device=device)
    q = torch.softmax(zq, -1)
    del zq
    if with_draft:
        tokens = torch.multinomial(q.reshape(-1, V), 1, generator=gd).reshape(B, N)
    else:
        tokens = q.argmax(-1)
        q = None
    u = torch.rand(B, N, generator=gd, dtype=torch.float64, device=device)
    return dict(tokens=tokens, parents=parents, target_probs=p, draft_probs=q, uniforms=u,
                target_logits=z.to(logits_dtype))


def tree_mask_of(parents: torch.Tensor) -> torch.Tensor:
    """Ancestor mask [B, N, N] (vectorized: node i sees j iff j is i or an ancestor)."""
    B, N = parents.shape
    m = torch.eye(N, dtype=torch.bool).expand(B, N, N).clone()
    for i in range(1, N):
        par = parents[:, i].long()
        has = par >= 0
        m[has, i] |= m[has, par[has]]
    return m


# --------------------------------------------------------------------------- benchmarks
def bench_attention(device, timer, copy_bw, *, B, L, N, Hq, Hkv, D, dtype, ref_reps) -> Row:
    S = L + N + 8
    es = torch.finfo(dtype).bits // 8
    g = torch.Generator().manual_seed(0)
    parents = random_tree(B, N, g)
    mask = tree_mask_of(parents).to(device)
    lens = torch.full((B,), L, dtype=torch.int32, device=device)
    set_bytes = 2 * B * Hkv * S * D * es

    def make(i):
        q = torch.randn(B, N, Hq, D, device=device, dtype=dtype)
        k = torch.randn(B, Hkv, S, D, device=device, dtype=dtype)
        v = torch.randn(B, Hkv, S, D, device=device, dtype=dtype)
        return q, k, v

    sets = rotating_sets(make, set_bytes, device)
    nbytes = B * Hkv * (L + N) * D * 2 * es + 2 * B * N * Hq * D * es + B * N * N
    shape = f"B={B} L={L} N={N} Hq={Hq} Hkv={Hkv} D={D}"
    fns = [lambda s=s: ops.verify_attention(s[0], s[1], s[2], lens, mask) for s in sets]

    # SDPA on the same problem: q [B, Hq, N, D], K/V = the cache's first L + N rows (views),
    # explicit bool mask [B, 1, N, L + N] = prefix visible + tree mask (built once, untimed).
    full_mask = torch.cat([torch.ones(B, N, L, dtype=torch.bool, device=device), mask], -1)[:, None]
    sdpa_sets = [(s[0].transpose(1, 2).contiguous(), s[1][:, :, : L + N], s[2][:, :, : L + N]) for s in sets]

    def sdpa(s):
        try:
            return F.scaled_dot_product_attention(s[0], s[1], s[2], attn_mask=full_mask, enable_gqa=True)
        except TypeError:  # torch < 2.5: expand the KV heads
            rep = Hq // Hkv
            return F.scaled_dot_product_attention(s[0], s[1].repeat_interleave(rep, 1),
                                                  s[2].repeat_interleave(rep, 1), attn_mask=full_mask)

    sdpa_fns = [lambda s=s: sdpa(s) for s in sdpa_sets]
    if device == "cuda":
        t = timer.cuda(fns)
        t_sdpa = timer.cuda(sdpa_fns)
        t_ref = None
    else:
        t = timer.cpu(fns[0])
        t_sdpa = timer.cpu(sdpa_fns[0])
        s = sets[0]
        t_ref = timer.cpu_few(lambda: reference.verify_attention(s[0], s[1], s[2], lens, mask, D ** -0.5), ref_reps)
    row = Row("verify_attention", shape, str(dtype).replace("torch.", ""), t * 1e6, nbytes, nbytes / t / 1e9,
              nbytes / t / copy_bw, sdpa_us=t_sdpa * 1e6, speedup_vs_sdpa=t_sdpa / t)
    if t_ref is not None:
        row.ref_us, row.speedup_vs_ref = t_ref * 1e6, t_ref / t
    return row


def bench_append(device, timer, copy_bw, *, B, Hkv, N, D, S, dtype, ref_reps) -> Row:
    es = torch.finfo(dtype).bits // 8
    lens = torch.full((B,), S // 2, dtype=torch.int32, device=device)

    def make(i):
        return (torch.randn(B, Hkv, S, D, device=device, dtype=dtype),
                torch.randn(B, Hkv, S, D, device=device, dtype=dtype),
                torch.randn(B, Hkv, N, D, device=device, dtype=dtype),
                torch.randn(B, Hkv, N, D, device=device, dtype=dtype))

    nbytes = 2 * 2 * B * Hkv * N * D * es
    sets = rotating_sets(make, nbytes, device)  # touched: new K/V read + cache rows written
    fns = [lambda s=s: ops.append_kv(s[0], s[1], s[2], s[3], lens) for s in sets]
    row = Row("append_kv", f"B={B} Hkv={Hkv} N={N} D={D} S={S}", str(dtype).replace("torch.", ""), 0, nbytes, 0)
    if device == "cuda":
        t = timer.cuda(fns)
    else:
        t = timer.cpu(fns[0])
        s = sets[0]
        t_ref = timer.cpu_few(lambda: reference.append_kv(s[0], s[1], s[2], s[3], lens), ref_reps)
        row.ref_us, row.speedup_vs_ref = t_ref * 1e6, t_ref / t
    row.median_us, row.gbps, row.frac_copy_bw = t * 1e6, nbytes / t / 1e9, nbytes / t / copy_bw
    return row


def bench_rejection(device, timer, copy_bw, *, B, N, V, with_draft, ref_reps) -> Row:
    def make(i):
        return sampling_inputs(B, N, V, device, seed=i, with_draft=with_draft)

    nbytes = B * N * V * 4 * (2 if with_draft else 1)
    sets = rotating_sets(make, nbytes, device)
    fns = [lambda s=s: ops.rejection_sample(s["tokens"], s["parents"], s["target_probs"], s["draft_probs"],
                                            s["uniforms"])
           for s in sets]
    acc = float(fns[0]()[1].float().mean())
    row = Row("rejection_sample", f"B={B} N={N} V={V} {'q' if with_draft else 'q=None'}", "float32", 0, nbytes, 0,
              notes=f"mean accepted {acc:.2f}")
    if device == "cuda":
        t = timer.cuda(fns)
    else:
        t = timer.cpu(fns[0])
        s = sets[0]
        t_ref = timer.cpu_few(lambda: reference.rejection_sample(s["tokens"], s["parents"], s["target_probs"],
                                                                 s["draft_probs"], s["uniforms"]), ref_reps)
        row.ref_us, row.speedup_vs_ref = t_ref * 1e6, t_ref / t
    row.median_us, row.gbps, row.frac_copy_bw = t * 1e6, nbytes / t / 1e9, nbytes / t / copy_bw
    return row


def bench_greedy(device, timer, copy_bw, *, B, N, V, dtype, ref_reps) -> Row:
    es = torch.finfo(dtype).bits // 8

    def make(i):
        s = sampling_inputs(B, N, V, device, seed=i, with_draft=False, logits_dtype=dtype)
        best = s["target_logits"].float().argmax(-1)  # children follow the argmax 70 % of the time
        follow = torch.rand(B, N, device=device) < 0.7
        par = s["parents"].clamp(min=0).long()
        s["tokens"] = torch.where(follow, torch.gather(best, 1, par), s["tokens"])
        return s

    nbytes = B * N * V * es
    sets = rotating_sets(make, nbytes, device)
    fns = [lambda s=s: ops.greedy_verify(s["tokens"], s["parents"], s["target_logits"]) for s in sets]
    acc = float(fns[0]()[1].float().mean())
    row = Row("greedy_verify", f"B={B} N={N} V={V}", str(dtype).replace("torch.", ""), 0, nbytes, 0,
              notes=f"mean accepted {acc:.2f}")
    if device == "cuda":
        t = timer.cuda(fns)
    else:
        t = timer.cpu(fns[0])
        s = sets[0]
        t_ref = timer.cpu_few(lambda: reference.greedy_verify(s["tokens"], s["parents"], s["target_logits"]), ref_reps)
        row.ref_us, row.speedup_vs_ref = t_ref * 1e6, t_ref / t
    row.median_us, row.gbps, row.frac_copy_bw = t * 1e6, nbytes / t / 1e9, nbytes / t / copy_bw
    return row


def bench_commit(device, timer, copy_bw, *, L, B, Hkv, D, S, N, dtype, path, ref_reps) -> Row:
    """path "tree": accepted = 0 then nodes skipping ahead (real moves); "chain": identity."""
    es = torch.finfo(dtype).bits // 8
    g = torch.Generator().manual_seed(1)
    accepted = torch.full((B, N), -1, dtype=torch.int32)
    num = torch.zeros(B, dtype=torch.int32)
    for b in range(B):
        n = int(torch.randint(2, min(6, N), (1,), generator=g))
        if path == "chain":
            nodes = list(range(n + 1))
        else:
            nodes = [0] + sorted(torch.randperm(N - 1, generator=g)[:n].add(1).tolist())
        accepted[b, : n + 1] = torch.tensor(nodes, dtype=torch.int32)
        num[b] = n
    moved = int(sum(int((accepted[b, 1: int(num[b]) + 1] != torch.arange(1, int(num[b]) + 1)).sum()) for b in range(B)))
    lens0 = torch.full((B,), S - N - 1, dtype=torch.int32, device=device)
    accepted, num = accepted.to(device), num.to(device)

    def make(i):
        return ([torch.randn(B, Hkv, S, D, device=device, dtype=dtype) for _ in range(L)],
                [torch.randn(B, Hkv, S, D, device=device, dtype=dtype) for _ in range(L)])

    nbytes = 2 * L * Hkv * D * es * moved * 2  # K and V, read + write
    sets = rotating_sets(make, 2 * L * B * Hkv * N * D * es, device)
    batch = 20
    lens_pool = lens0.repeat(batch * len(sets), 1)  # one fresh cache_lens per timed call
    counter = [0]

    def reset():
        lens_pool.copy_(lens0.expand_as(lens_pool))
        counter[0] = 0

    def call(s):
        i = counter[0]
        counter[0] += 1
        ops.kv_commit(s[0], s[1], lens_pool[i % lens_pool.shape[0]], accepted, num)

    fns = [lambda s=s: call(s) for s in sets]
    row = Row("kv_commit", f"L={L} B={B} Hkv={Hkv} D={D} N={N} {path} moved={moved}",
              str(dtype).replace("torch.", ""), 0, nbytes, 0)
    if device == "cuda":
        t = timer.cuda(fns, reset=reset, batch=batch)
    else:
        s = sets[0]
        lens = lens0.clone()
        t_reset = timer.cpu(lambda: lens.copy_(lens0))
        t = timer.cpu(lambda: (lens.copy_(lens0), ops.kv_commit(s[0], s[1], lens, accepted, num))) - t_reset
        t_ref = timer.cpu_few(lambda: (lens.copy_(lens0), reference.kv_commit(s[0], s[1], lens, accepted, num)),
                              ref_reps) - t_reset
        row.ref_us, row.speedup_vs_ref = t_ref * 1e6, t_ref / t
        row.notes = "cache_lens reset per call, its cost subtracted"
    row.median_us = t * 1e6
    row.gbps = nbytes / t / 1e9
    row.frac_copy_bw = nbytes / t / copy_bw if nbytes else 0.0
    return row


def bench_linear(device, timer, copy_bw, *, M, N, K, count, wdtype, ref_reps) -> Row:
    """`count` weights [N, K] (together larger than the last-level cache) run back to back,
    as the layers of one forward; bytes = the weights (x and y are tiny). Compared with
    torch's F.linear (BLAS / cuBLAS) on the same weights; for int8 rows torch runs the
    float32 (CPU) / bfloat16 (CUDA) originals: the bytes a float model streams."""
    g = torch.Generator().manual_seed(M * 7 + N)
    xdt = torch.float32 if (wdtype == torch.int8 and device == "cpu") else (
        torch.bfloat16 if wdtype == torch.int8 else wdtype)
    ws, ss, wt = [], [], []
    for _ in range(count):
        w = torch.randn(N, K, generator=g) / math.sqrt(K)
        if wdtype == torch.int8:
            q, sc = ops.quantize_weight_int8(w)
            ws.append(q.to(device))
            ss.append(sc.to(device))
            wt.append(w.to(xdt).to(device))
        else:
            ws.append(w.to(wdtype).to(device))
            ss.append(None)
            wt.append(ws[-1])
    x = torch.randn(M, K, generator=g).to(xdt).to(device)
    es = 1 if wdtype == torch.int8 else torch.finfo(wdtype).bits // 8
    nbytes = count * N * K * es

    def ours():
        for w, sc in zip(ws, ss):
            ops.linear(x, w, None, sc)

    def theirs():
        for w in wt:
            F.linear(x, w)

    row = Row("linear", f"M={M} N={N} K={K} x{count}", str(wdtype).replace("torch.", ""), 0, nbytes, 0)
    t = timer.cuda([ours], batch=3) if device == "cuda" else timer.cpu(ours)
    t_torch = timer.cuda([theirs], batch=3) if device == "cuda" else timer.cpu(theirs)
    row.median_us, row.gbps, row.frac_copy_bw = t * 1e6, nbytes / t / 1e9, nbytes / t / copy_bw
    row.ref_us, row.speedup_vs_ref = t_torch * 1e6, t_torch / t
    row.notes = "ref = torch F.linear" + (" on the float weights" if wdtype == torch.int8 else "")
    return row


# --------------------------------------------------------------------------- plans
def cpu_plan(quick: bool):
    V = 4096 if quick else 49152
    L = 256 if quick else 2048
    r = 2 if quick else 5  # reference repetitions (python loops: slow)
    plan = [
        (bench_attention, dict(B=1, L=L, N=16, Hq=32, Hkv=8, D=64, dtype=torch.float32, ref_reps=r)),
        (bench_attention, dict(B=4, L=L, N=16, Hq=32, Hkv=8, D=64, dtype=torch.float32, ref_reps=r)),
        (bench_attention, dict(B=4, L=L, N=16, Hq=32, Hkv=8, D=64, dtype=torch.bfloat16, ref_reps=r)),
        (bench_append, dict(B=8, Hkv=8, N=16, D=64, S=L + 64, dtype=torch.float32, ref_reps=r)),
        (bench_rejection, dict(B=8, N=16, V=V, with_draft=True, ref_reps=r)),
        (bench_rejection, dict(B=8, N=16, V=V, with_draft=False, ref_reps=r)),
        (bench_greedy, dict(B=8, N=16, V=V, dtype=torch.float32, ref_reps=r)),
        (bench_greedy, dict(B=8, N=16, V=V, dtype=torch.bfloat16, ref_reps=r)),
        (bench_commit, dict(L=4 if quick else 30, B=8, Hkv=3, D=64, S=L + 64, N=16, dtype=torch.float32, path="tree",
                            ref_reps=r)),
        (bench_commit, dict(L=4 if quick else 30, B=8, Hkv=3, D=64, S=L + 64, N=16, dtype=torch.float32, path="chain",
                            ref_reps=r)),
    ]
    # SmolLM2-135M shapes: its lm_head (N 49152, K 576) and 16 MLP-like projections (1536 x 576)
    for wd in (torch.float32, torch.bfloat16, torch.int8):
        for M in (1, 8, 16):
            plan.append((bench_linear, dict(M=M, N=49152 if not quick else 8192, K=576, count=1, wdtype=wd,
                                            ref_reps=0)))
            plan.append((bench_linear, dict(M=M, N=1536, K=576, count=16 if not quick else 4, wdtype=wd, ref_reps=0)))
    return plan


def cuda_plan(quick: bool):
    big = not quick
    plan = [
        (bench_attention, dict(B=1, L=4096, N=16, Hq=32, Hkv=8, D=128, dtype=torch.bfloat16, ref_reps=0)),
        (bench_attention, dict(B=8, L=4096, N=16, Hq=32, Hkv=8, D=128, dtype=torch.bfloat16, ref_reps=0)),
        (bench_attention, dict(B=8, L=4096, N=64, Hq=32, Hkv=8, D=128, dtype=torch.float16, ref_reps=0)),
        (bench_attention, dict(B=4, L=4096, N=16, Hq=32, Hkv=8, D=64, dtype=torch.float16, ref_reps=0)),
    ]
    if big:
        plan += [
            (bench_attention, dict(B=1, L=32768, N=16, Hq=32, Hkv=8, D=128, dtype=torch.bfloat16, ref_reps=0)),
            (bench_attention, dict(B=32, L=8192, N=16, Hq=32, Hkv=8, D=128, dtype=torch.bfloat16, ref_reps=0)),
        ]
    plan += [
        (bench_append, dict(B=8, Hkv=8, N=16, D=128, S=96, dtype=torch.bfloat16, ref_reps=0)),
        (bench_rejection, dict(B=8, N=16, V=49152, with_draft=True, ref_reps=0)),
        (bench_rejection, dict(B=8, N=16, V=49152, with_draft=False, ref_reps=0)),
        (bench_greedy, dict(B=8, N=16, V=49152, dtype=torch.bfloat16, ref_reps=0)),
        (bench_greedy, dict(B=8, N=16, V=49152, dtype=torch.float32, ref_reps=0)),
        # S small: the op touches only the N-row window; small caches let many sets rotate
        (bench_commit, dict(L=32, B=8, Hkv=8, D=128, S=64, N=16, dtype=torch.bfloat16, path="tree", ref_reps=0)),
        (bench_commit, dict(L=32, B=8, Hkv=8, D=128, S=64, N=16, dtype=torch.bfloat16, path="chain", ref_reps=0)),
    ]
    # Llama-3-8B MLP / lm_head shapes, decode and verify row counts
    for wd in (torch.bfloat16, torch.int8):
        for M in (1, 8, 16):
            plan.append((bench_linear, dict(M=M, N=14336, K=4096, count=2, wdtype=wd, ref_reps=0)))
    plan.append((bench_linear, dict(M=8, N=128256, K=4096, count=1, wdtype=torch.bfloat16, ref_reps=0)))
    if big:
        plan += [
            (bench_rejection, dict(B=32, N=32, V=128256, with_draft=True, ref_reps=0)),
            (bench_greedy, dict(B=32, N=32, V=128256, dtype=torch.bfloat16, ref_reps=0)),
        ]
    return plan


def check_cpu_targets(rows: List[Row], quick: bool) -> None:
    """The issue's CPU targets (at B=8, N=16, V=49152 and prefix 2048, N=16, GQA)."""
    size_note = " (quick shapes: indicative only)" if quick else ""
    for r in rows:
        if r.op in ("rejection_sample", "greedy_verify") or (r.op == "kv_commit" and "tree" in r.shape):
            if r.speedup_vs_ref is not None:
                ok = r.speedup_vs_ref >= 2.0
                r.target = f"{'PASS' if ok else 'FAIL'} >= 2x ref{size_note}"
        if r.op == "linear" and r.speedup_vs_ref is not None:
            ok = r.speedup_vs_ref >= 1.0
            r.target = f"{'PASS' if ok else 'FAIL'} <= torch F.linear time{size_note}"
        if r.op == "verify_attention" and r.speedup_vs_sdpa is not None:
            ok = r.speedup_vs_sdpa >= 1.0
            r.target = f"{'PASS' if ok else 'FAIL'} <= SDPA time{size_note}"


# --------------------------------------------------------------------------- output
def fmt(x, spec):
    return "-" if x is None else format(x, spec)


def print_table(rows: List[Row], meta: Dict) -> None:
    print(f"# specdec kernel benchmarks — {meta['device_name']} — {meta['date']} — commit {meta['commit']}")
    print(f"# torch {meta['torch']}, threads {meta['threads']}, "
          f"copy bandwidth {meta['copy_bw_gbps']:.1f} GB/s (read+write)"
          + (f", load average {meta['loadavg_before'][0]:.1f} (other processes share these cores)"
             if meta.get("loadavg_before") and meta["loadavg_before"][0] > 0.5 * (os.cpu_count() or 1) else ""))
    head = (f"{'op':<17} {'shape':<44} {'dtype':<8} {'median us':>10} {'MB moved':>9} {'GB/s':>7} {'%copy':>6} "
            f"{'ref us':>10} {'x ref':>7} {'SDPA us':>9} {'x SDPA':>7}  target / notes")
    print(head)
    print("-" * len(head))
    for r in rows:
        frac = None if r.frac_copy_bw is None else 100 * r.frac_copy_bw
        print(f"{r.op:<17} {r.shape:<44} {r.dtype:<8} {r.median_us:>10.1f} {r.bytes / 1e6:>9.2f} {r.gbps:>7.1f} "
              f"{fmt(frac, '6.1f')} {fmt(r.ref_us, '10.1f')} {fmt(r.speedup_vs_ref, '7.1f')} "
              f"{fmt(r.sdpa_us, '9.1f')} {fmt(r.speedup_vs_sdpa, '7.2f')}  {r.target or ''} {r.notes}")


def git_commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                              timeout=10).stdout.strip() or "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    ap.add_argument("--quick", action="store_true", help="CI-sized shapes and few repetitions")
    ap.add_argument("--ops", nargs="*", default=None,
                    help="only these ops (verify_attention append_kv rejection_sample greedy_verify kv_commit linear)")
    ap.add_argument("--out", type=Path, default=None,
                    help="JSON path (default benchmarks/results/ops_<device>_<date>.json)")
    ap.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (CPU)")
    args = ap.parse_args(argv)

    if args.device == "cuda":
        if not (torch.cuda.is_available() and specdec.build_info().get("cuda")):
            print("CUDA requested but unavailable (no GPU, or specdec built without CUDA)", file=sys.stderr)
            return 2
        torch.backends.cuda.matmul.allow_tf32 = False
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    timer = Timer(args.device, args.quick)
    copy_bw = copy_bandwidth(args.device, timer)
    now = _dt.datetime.now()
    device_name = (torch.cuda.get_device_name(0) if args.device == "cuda"
                   else (platform.processor() or platform.machine()))
    meta = dict(device=args.device, device_name=device_name, date=now.strftime("%Y-%m-%d %H:%M:%S"),
                commit=git_commit(),
                torch=torch.__version__, build_info=specdec.build_info(), threads=torch.get_num_threads(),
                quick=args.quick, copy_bw_gbps=copy_bw / 1e9, python=platform.python_version(),
                bytes_convention="fewest bytes the op must read + write (docs/DESIGN.md napkin math)",
                loadavg_before=os.getloadavg() if hasattr(os, "getloadavg") else None)
    plan = cpu_plan(args.quick) if args.device == "cpu" else cuda_plan(args.quick)
    names = {bench_attention: "verify_attention", bench_append: "append_kv", bench_rejection: "rejection_sample",
             bench_greedy: "greedy_verify", bench_commit: "kv_commit", bench_linear: "linear"}
    rows: List[Row] = []
    for fn, kw in plan:
        if args.ops and names[fn] not in args.ops:
            continue
        try:
            rows.append(fn(args.device, timer, copy_bw, **kw))
        except Exception as e:  # one failing row must not hide the others
            rows.append(Row(names[fn], " ".join(f"{k}={v}" for k, v in kw.items() if k != "ref_reps"), "-",
                            float("nan"), 0, float("nan"), notes=f"ERROR {type(e).__name__}: {e}"[:200]))
        if args.device == "cuda":
            torch.cuda.empty_cache()
    if args.device == "cpu":
        check_cpu_targets(rows, args.quick)
    print_table(rows, meta)
    out = args.out or ROOT / "benchmarks" / "results" / f"ops_{args.device}_{now.strftime('%Y-%m-%d')}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(dict(meta=meta, rows=[asdict(r) for r in rows]), indent=2, default=str))
    print(f"# wrote {out}")
    return 1 if any("ERROR" in r.notes for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
