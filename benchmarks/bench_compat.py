"""Overhead of specdec.compat's adapters over calling specdec's ops directly (CPU).

    python benchmarks/bench_compat.py                    # batch 1, 8 and 64
    python benchmarks/bench_compat.py --batches 8 --rounds 5

For each convention the adapter is called with the stack's own tensors and the native op with the
same work already in specdec's padded tree layout (what a caller that keeps specdec's layout
would pass). Vocabulary 49,152 (the bundled SmolLM2's), float32, 4 drafts per request (chains) or
an 8-node tree (SGLang, vLLM tree; SGLang's sampler maps its coins to per-child uniforms, and the
native call gets the uniforms one adapter call derived, so both take the same path); the paged
attention rows are FlashInfer's metadata on NHD, HND and combined pools (passed as views) vs a
block table on NHD pools (and, for HND, also against the native op on the same HND views, which
separates the layout's cost from the adapter's), 9 / 3 heads, D = 64, prefix 512, page size 16;
FlashInfer's plan / run wrapper per run (the plan made beforehand, as a stack makes it once per
step) and per step (one plan with a tree mask + 30 runs, the bundled model's layers, vs 30 native
calls).
Adapter and native calls are interleaved
call by call: each round makes ``--calls`` pairs, one adapter call and one native call back to back
(the order alternating), so both sides of a pair see the same state of the shared machine. The record
keeps each round's mean per call and every pair's ratio; overhead = adapter / native - 1 as the ratio
of the rounds' medians, the median of per-round ratios and the median of per-pair ratios (the last
is the least sensitive to the machine's phases: a pair spans two calls, a round many), with the load
average before and after (other guests share this host: noisy). One torch thread by default.

    python benchmarks/bench_compat.py --device cuda --quick   # gpu_check.sh's compat stage

Writes benchmarks/results/compat_<cpu|cuda>_<date>.json (or --out).
"""
from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import platform
import statistics
import subprocess
import time
from pathlib import Path

import torch

from specdec import ops, paged_ops
from specdec.compat import flashinfer as fi
from specdec.compat import sglang as sg
from specdec.compat import vllm

ROOT = Path(__file__).resolve().parent.parent
V, K = 49152, 4


def git_commit() -> str:
    try:
        return subprocess.check_output(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, text=True).strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


DEV = torch.device("cpu")  # --device: the cases' tensors are made on the CPU (seeded) and moved here


def mv(*ts):
    return [t.to(DEV) for t in ts]


def sync() -> None:
    if DEV.type == "cuda":
        torch.cuda.synchronize()


def time_calls(fn, calls: int) -> float:
    sync()
    t = time.perf_counter()
    for _ in range(calls):
        fn()
    sync()
    return (time.perf_counter() - t) / calls * 1e6


def _probs(shape, g):
    return torch.softmax(torch.randn(*shape, generator=g) * 3, -1)


def chain_cases(B, g):
    N = K + 1
    q = _probs((B, K, V), g)
    p = _probs((B, N, V), g)
    d = torch.multinomial(q.reshape(-1, V), 1, generator=g).view(B, K).to(torch.int32)
    u = torch.rand(B, N, generator=g, dtype=torch.float64)
    tokens = torch.cat([torch.zeros(B, 1, dtype=torch.int64), d.long()], 1)
    parents = (torch.arange(N, dtype=torch.int32) - 1).expand(B, N).contiguous()
    qn = torch.cat([torch.zeros(B, 1, V), q], 1)
    q, p, d, u, tokens, parents, qn = mv(q, p, d, u, tokens, parents, qn)
    cases = {"flashinfer.chain_speculative_sampling_uniform": (
        lambda: fi.chain_speculative_sampling_uniform(q, d, u, p),
        lambda: ops.rejection_sample(tokens, parents, p, qn, u))}
    # vLLM ragged: same chains; one-hot proposals (draft_probs None) and sampled rows
    n = [K] * B
    cu = (torch.arange(1, B + 1, dtype=torch.int32) * K).to(DEV)
    flat_d = d.flatten()
    tp = p[:, :K].reshape(B * K, V).contiguous()
    bonus, temp = mv(torch.zeros(B, 1, dtype=torch.int32), torch.ones(B))
    tokens_v, parents_v, p_v, _ = vllm.pad_chains(flat_d, n, tp, bonus, None)
    cases["vllm.rejection_sample (draft_probs None)"] = (
        lambda: vllm.rejection_sample(flat_d, n, K, cu, None, tp, bonus, temp, uniforms=u),
        lambda: ops.rejection_sample(tokens_v, parents_v, p_v, None, u))
    greedy = torch.zeros(B, device=DEV)
    cases["vllm.rejection_sample (greedy)"] = (
        lambda: vllm.rejection_sample(flat_d, n, K, cu, None, tp, bonus, greedy),
        lambda: ops.greedy_verify(tokens_v, parents_v, p_v))
    return cases


def tree_cases(B, g):
    N = 8
    par = [-1, 0, 0, 1, 1, 2, 3, 3]  # specdec parents (node 0 = root)
    parents = torch.tensor(par, dtype=torch.int32).expand(B, N).contiguous()
    tokens = torch.randint(0, V, (B, N), generator=g)
    tokens[:, 0] = 0
    p = _probs((B, N, V), g)
    u = torch.rand(B, N, generator=g, dtype=torch.float64)
    cand, ri, nt, ns = sg.parents_to_sglang(tokens, parents)
    predicts = torch.zeros(B * N, dtype=torch.int32)
    ai = torch.zeros(B, 5, dtype=torch.int32)
    an = torch.zeros(B, dtype=torch.int32)
    tpred = p.argmax(-1)
    uf = torch.rand(B, generator=g)
    us = torch.rand(B, N, generator=g)
    parents, tokens, p, u, cand, ri, nt, ns, predicts, ai, an, tpred, uf, us = mv(
        parents, tokens, p, u, cand, ri, nt, ns, predicts, ai, an, tpred, uf, us)
    # SGLang's coins become per-child uniforms inside the adapter; the native call gets those same
    # uniforms (captured from one adapter call), so both take the same decisions and do the same work
    seen = []
    real = ops.rejection_sample

    def spy(*a):
        seen.append(a[4].clone())
        return real(*a)
    ops.rejection_sample = spy
    try:
        sg.tree_speculative_sampling_target_only(predicts, ai, an, cand, ri, nt, ns, us, uf, p)
    finally:
        ops.rejection_sample = real
    u_sg = seen[-1]
    cases = {
        "sglang.verify_tree_greedy": (
            lambda: sg.verify_tree_greedy(predicts, ai, an, cand, ri, nt, ns, tpred),
            lambda: ops.greedy_verify(tokens, parents, p)),
        "sglang.tree_speculative_sampling_target_only": (
            lambda: sg.tree_speculative_sampling_target_only(predicts, ai, an, cand, ri, nt, ns, us, uf, p),
            lambda: ops.rejection_sample(tokens, parents, p, None, u_sg)),
    }
    # vLLM-style ragged tree: drafts = nodes 1..7, local parents = specdec parent - 1
    d = tokens[:, 1:].reshape(-1).to(torch.int32)
    dpar = (parents[:, 1:] - 1).reshape(-1)
    cu = (torch.arange(1, B + 1, dtype=torch.int32) * (N - 1)).to(DEV)
    rows = p.reshape(B * N, V)
    temp = torch.ones(B, device=DEV)
    cases["vllm.tree_rejection_sample"] = (
        lambda: vllm.tree_rejection_sample(d, dpar, [N - 1] * B, N - 1, cu, None, rows, temp, uniforms=u),
        lambda: ops.rejection_sample(tokens, parents, p, None, u))
    return cases


LAYERS = 30  # the bundled SmolLM2's layers: a wrapper's plan serves that many runs per step


def attention_cases(B, g, prefix=512, ps=16, hq=9, hkv=3, D=64, N=8):
    M = (prefix + N + ps - 1) // ps
    P = B * M
    k = torch.randn(P, ps, hkv, D, generator=g)
    v = torch.randn(P, ps, hkv, D, generator=g)
    table = torch.randperm(P, generator=g).view(B, M).to(torch.int32)
    lens = torch.full((B,), prefix, dtype=torch.int32)
    meta = fi.kv_lens_to_metadata(table, lens + N, ps)
    q = torch.randn(B, N, hq, D, generator=g)
    k, v, table, lens, q = mv(k, v, table, lens, q)
    meta = fi.PagedMetadata(*mv(*meta[:3]), meta.page_size)
    qf = q.reshape(B * N, hq, D)
    # the same pools in FlashInfer's HND layout and its combined [pages, 2, ps, Hkv, D] tensor: the
    # adapter passes views (no copy); the native call reads the NHD pools
    kh, vh = k.transpose(1, 2).contiguous(), v.transpose(1, 2).contiguous()
    combined = torch.stack([k, v], 1)
    call = dict(kv_indptr=meta.kv_indptr, kv_indices=meta.kv_indices, kv_last_page_len=meta.kv_last_page_len,
                qo_len=N)
    native = (lambda: paged_ops.verify_attention_paged(q, k, v, table, lens))  # noqa: E731
    # specdec's paged op also takes the HND pools as strided views: that native call does the adapter's
    # reads, so the row below it is the adapter's own cost, the one above it adds the layout's
    native_hnd = (lambda: paged_ops.verify_attention_paged(q, kh.transpose(1, 2), vh.transpose(1, 2), table,  # noqa: E731
                                                           lens))
    # FlashInfer's wrapper: plan once per step (host reads, block table, masks), run once per layer
    qo_indptr = (torch.arange(B + 1, dtype=torch.int32) * N).to(DEV)
    plan = (qo_indptr, meta.kv_indptr, meta.kv_indices, meta.kv_last_page_len, hq, hkv, D, ps)
    tree = torch.zeros(B, N, N, dtype=torch.bool)
    for i in range(N):  # one random tree per request, as an ancestor mask
        if i:
            tree[:, i] = tree[torch.arange(B), torch.randint(0, i, (B,), generator=g)]
        tree[:, i, i] = True
    flat = torch.cat([torch.cat([torch.ones(N, prefix, dtype=torch.bool), tree[b]], 1).flatten() for b in range(B)])
    tree, flat = mv(tree, flat)
    w_causal = fi.BatchPrefillWithPagedKVCacheWrapper(None, "NHD")
    w_causal.plan(*plan, causal=True)
    w_hnd = fi.BatchPrefillWithPagedKVCacheWrapper(None, "HND")
    w_hnd.plan(*plan, causal=True)
    w_tree = fi.BatchPrefillWithPagedKVCacheWrapper(None, "NHD")
    w_tree.plan(*plan, custom_mask=flat)
    native_tree = (lambda: paged_ops.verify_attention_paged(q, k, v, table, lens, tree))  # noqa: E731

    def step_adapter():  # one decode step of the bundled model's 30 layers: one plan, 30 runs
        w_tree.plan(*plan, custom_mask=flat)
        for _ in range(LAYERS):
            w_tree.run(qf, (k, v))

    def step_native():
        for _ in range(LAYERS):
            native_tree()
    return {"flashinfer.verify_attention_paged (NHD, causal)": (
        lambda: fi.verify_attention_paged(qf, (k, v), **call), native),
        "flashinfer.verify_attention_paged (HND, causal)": (
        lambda: fi.verify_attention_paged(qf, (kh, vh), kv_layout="HND", **call), native),
        "flashinfer.verify_attention_paged (HND, native on the same views)": (
        lambda: fi.verify_attention_paged(qf, (kh, vh), kv_layout="HND", **call), native_hnd),
        "flashinfer.verify_attention_paged (combined NHD, causal)": (
        lambda: fi.verify_attention_paged(qf, combined, **call), native),
        "flashinfer wrapper.run (NHD, causal)": (lambda: w_causal.run(qf, (k, v)), native),
        "flashinfer wrapper.run (HND, native on the same views)": (lambda: w_hnd.run(qf, (kh, vh)), native_hnd),
        "flashinfer wrapper.run (NHD, tree mask)": (lambda: w_tree.run(qf, (k, v)), native_tree),
        f"flashinfer wrapper plan + {LAYERS} runs (NHD, tree mask)": (step_adapter, step_native)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8, 64])
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--calls", type=int, default=5, help="adapter / native call pairs per round")
    ap.add_argument("--threads", type=int, default=1, help="torch threads (default 1: on a shared machine torch's "
                    "thread pool turns every small op into a scheduling wait)")
    ap.add_argument("--device", default="cpu", help="cpu (the default) or cuda: on CUDA the adapters take their "
                    "tensor forms and every timing ends with a synchronize")
    ap.add_argument("--quick", action="store_true", help="batch 8 only, 3 rounds of 3 calls (gpu_check's stage)")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)
    global DEV
    DEV = torch.device(args.device)
    if args.quick:
        args.batches, args.rounds, args.calls = [8], 3, 3
    torch.set_num_threads(args.threads)
    now = _dt.datetime.now()
    meta = dict(date=now.isoformat(timespec="seconds"), git_commit=git_commit(), torch=torch.__version__,
                threads=torch.get_num_threads(), cpu=platform.processor() or platform.machine(), device=str(DEV),
                gpu=torch.cuda.get_device_name(DEV) if DEV.type == "cuda" else None, vocab=V,
                drafts=K, rounds=args.rounds, calls=args.calls, loadavg_before=os.getloadavg())
    rows = []
    g = torch.Generator().manual_seed(0)
    for B in args.batches:
        cases = {**chain_cases(B, g), **tree_cases(B, g), **attention_cases(B, g)}
        for name, (adapter, native) in cases.items():
            for fn in (adapter, native):
                time_calls(fn, 2)
            a_us, n_us, pairs = [], [], []
            for r in range(args.rounds):
                a_sum = n_sum = 0.0
                for c in range(args.calls):  # one adapter and one native call back to back, order alternating
                    first_adapter = (r + c) % 2 == 0
                    t1 = time_calls(adapter if first_adapter else native, 1)
                    t2 = time_calls(native if first_adapter else adapter, 1)
                    a, n = (t1, t2) if first_adapter else (t2, t1)
                    a_sum, n_sum = a_sum + a, n_sum + n
                    pairs.append(a / n)
                a_us.append(a_sum / args.calls)
                n_us.append(n_sum / args.calls)
            ratios = [a / n for a, n in zip(a_us, n_us)]
            row = dict(case=name, batch=B, adapter_us=statistics.median(a_us), native_us=statistics.median(n_us),
                       overhead=statistics.median(a_us) / statistics.median(n_us) - 1,
                       overhead_median_round=statistics.median(ratios) - 1,
                       overhead_median_pair=statistics.median(pairs) - 1, adapter_rounds_us=a_us,
                       native_rounds_us=n_us, pair_ratios=pairs)
            rows.append(row)
            print(f"B={B:3d} {name:48s} adapter {row['adapter_us']:10.1f} us  native {row['native_us']:10.1f} us  "
                  f"overhead {100 * row['overhead']:+6.1f}% (per round {100 * row['overhead_median_round']:+6.1f}%, "
                  f"per pair {100 * row['overhead_median_pair']:+6.1f}%)", flush=True)
    meta["loadavg_after"] = os.getloadavg()
    out = args.out or ROOT / "benchmarks" / "results" / f"compat_{DEV.type}_{now.strftime('%Y-%m-%d')}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(dict(meta=meta, rows=rows), indent=2))
    print(f"load average before {meta['loadavg_before'][0]:.1f}, after {meta['loadavg_after'][0]:.1f}; wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
