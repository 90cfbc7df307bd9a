"""Paged vs dense cost of the three KV ops on the CPU: verify_attention, append_kv, kv_commit.

    python benchmarks/bench_paged_ops.py                 # page size 16, batch 1 and 8
    python benchmarks/bench_paged_ops.py --rounds 5 --page-size 1

Shapes: the bundled target's attention (9 query / 3 KV heads, D = 64, float32), a committed
prefix of --prefix positions, a step of 8 tree nodes (tree mask), kv_commit over 4 layers
with an accepted path that moves 3 of its nodes. The paged pool holds the same keys as the
dense cache, its pages shuffled. Dense and paged calls are interleaved round by round (the
order alternates); each round times a batch of calls of each; the record keeps the per-round
medians, their median, and the median of each round's paged / dense ratio, with the load
average before and after (other processes share these cores).

Writes benchmarks/results/paged_ops_cpu_<date>.json (or --out).
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

from specdec import ops, paged_ops, reference

ROOT = Path(__file__).resolve().parent.parent
HQ, HKV, D, N, LAYERS = 9, 3, 64, 8, 4


def paginate(dense: torch.Tensor, page_size: int, g: torch.Generator):
    """dense [B, H, S, D] -> pages [B * S / page_size, page_size, H, D] in shuffled order, block_tables."""
    B, H, S, Dh = dense.shape
    M = S // page_size
    tables = torch.randperm(B * M, generator=g).view(B, M).to(torch.int32)
    pages = torch.empty(B * M, page_size, H, Dh, dtype=dense.dtype)
    pages[tables.long()] = dense.view(B, H, M, page_size, Dh).permute(0, 2, 3, 1, 4)
    return pages, tables


def tree_mask(B: int, g: torch.Generator) -> torch.Tensor:
    parents = torch.full((B, N), -1, dtype=torch.int32)
    for b in range(B):
        for i in range(1, N):
            parents[b, i] = int(torch.randint(0, i, (1,), generator=g))
    return reference.tree_attention_mask(parents)


def cases(B: int, prefix: int, page_size: int):
    g = torch.Generator().manual_seed(B)
    S = -(-(prefix + N) // page_size) * page_size
    lens = torch.full((B,), prefix, dtype=torch.int32)
    k = torch.randn(B, HKV, S, D, generator=g)
    v = torch.randn(B, HKV, S, D, generator=g)
    kp, tables = paginate(k, page_size, g)
    vp, _ = paginate(v, page_size, torch.Generator().manual_seed(B))
    q = torch.randn(B, N, HQ, D, generator=g)
    mask = tree_mask(B, g)
    kn = torch.randn(B, HKV, N, D, generator=g)
    ks = [k.clone() for _ in range(LAYERS)]
    vs = [v.clone() for _ in range(LAYERS)]
    kps = [kp.clone() for _ in range(LAYERS)]
    vps = [vp.clone() for _ in range(LAYERS)]
    accepted = torch.tensor([[0, 2, 4, 6] + [-1] * (N - 4)] * B, dtype=torch.int32)
    num = torch.full((B,), 3, dtype=torch.int32)
    cl = lens.clone()

    def commit_dense():
        cl.copy_(lens)
        ops.kv_commit(ks, vs, cl, accepted, num)

    def commit_paged():
        cl.copy_(lens)
        paged_ops.kv_commit_paged(kps, vps, tables, cl, accepted, num)

    return {
        "verify_attention": (lambda: ops.verify_attention(q, k, v, lens, mask),
                             lambda: paged_ops.verify_attention_paged(q, kp, vp, tables, lens, mask)),
        "append_kv": (lambda: ops.append_kv(k, v, kn, kn, lens),
                      lambda: paged_ops.append_kv_paged(kp, vp, kn, kn, tables, lens)),
        "kv_commit": (commit_dense, commit_paged),
    }


def time_calls(fn, calls: int) -> float:
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - t0) / calls * 1e6


def git_commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                              check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--prefix", type=int, default=512)
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--calls", type=int, default=20, help="calls per timing")
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    now = _dt.datetime.now()
    meta = dict(date=now.isoformat(timespec="seconds"), git_commit=git_commit(), torch=torch.__version__,
                threads=torch.get_num_threads(), cpu=platform.processor() or platform.machine(),
                page_size=args.page_size, prefix=args.prefix, nodes=N, heads=[HQ, HKV], head_dim=D, layers=LAYERS,
                dtype="float32", rounds=args.rounds, calls=args.calls, loadavg_before=os.getloadavg())
    rows = []
    for B in args.batches:
        for op, (dense, paged) in cases(B, args.prefix, args.page_size).items():
            for fn in (dense, paged):  # warm-up
                time_calls(fn, 3)
            d_us, p_us = [], []
            for r in range(args.rounds):
                order = [(dense, d_us), (paged, p_us)]
                for fn, out in (order if r % 2 == 0 else order[::-1]):
                    out.append(time_calls(fn, args.calls))
            ratios = [p / d for p, d in zip(p_us, d_us)]
            row = dict(op=op, batch=B, dense_us=statistics.median(d_us), paged_us=statistics.median(p_us),
                       ratio_of_medians=statistics.median(p_us) / statistics.median(d_us),
                       median_round_ratio=statistics.median(ratios), dense_rounds_us=d_us, paged_rounds_us=p_us)
            rows.append(row)
            print(f"{op:17s} B={B}  dense {row['dense_us']:9.1f} us  paged {row['paged_us']:9.1f} us  "
                  f"paged/dense {row['ratio_of_medians']:.3f} (per round {row['median_round_ratio']:.3f})")
    meta["loadavg_after"] = os.getloadavg()
    print(f"load average before {meta['loadavg_before'][0]:.1f}, after {meta['loadavg_after'][0]:.1f} "
          f"on {os.cpu_count()} cores")
    out = args.out or ROOT / "benchmarks" / "results" / f"paged_ops_cpu_{now.strftime('%Y-%m-%d')}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(dict(meta=meta, rows=rows), indent=2))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
