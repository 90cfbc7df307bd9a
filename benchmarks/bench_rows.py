"""The few-row CPU linear kernels by row count: what M rows of x cost against one, AVX-512 against AVX2.

    python benchmarks/bench_rows.py [--rounds 9] [--threads 2] [--out PATH]

A verify pass of N nodes runs every linear layer with M = N rows of activations (decode: M = 1). On
the bundled SmolLM2-135M's layer shapes (q / o [576, 576], k / v [192, 576], gate / up [1536, 576],
down [576, 1536]), copies enough layers that the weights stream from DRAM (>= ~190 MB, far past the
L3), then times one pass over all of them at M = 1, 2, 4, 5, 8, 16, 32, per weight type (float32,
int8 with a per-row scale, Q8_0, Q4_1), with the AVX-512 few-row kernels on and off
(specdec._C.set_cpu_avx512; the same bits either way) on a CPU that has them. Every (type, M, kernel)
runs once per round, interleaved; medians over the rounds. Per row: ms per pass, weight GB/s, the
pass's cost relative to M = 1 with the same kernel, and the AVX-512 / AVX2 speedup.
Writes benchmarks/results/rows_cpu_<date>.json (load average and the read bandwidth recorded).
"""
from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))
from bench_e2e import git_commit  # noqa: E402
from bench_forward import read_bandwidth_gbs  # noqa: E402

SHAPES = [(576, 576), (192, 576), (192, 576), (576, 576), (1536, 576), (1536, 576), (576, 1536)]
ROWS = (1, 2, 3, 4, 5, 8, 16, 32)
KINDS = ("fp32", "int8", "q8_0", "q4_1")
MIN_BYTES = 190e6


def make_layers(kind: str, g: torch.Generator):
    """[(fn(x) -> y, K, bytes)] for enough copies of the layer shapes to pass MIN_BYTES."""
    from specdec import ops

    layers, total = [], 0
    while total < MIN_BYTES:
        for n, k in SHAPES:
            w = torch.randn(n, k, generator=g) / 24
            if kind == "fp32":
                fn, nbytes = (lambda x, w=w: ops.linear(x, w)), w.numel() * 4
            elif kind == "int8":
                q, s = ops.quantize_weight_int8(w)
                fn, nbytes = (lambda x, q=q, s=s: ops.linear(x, q, None, s)), q.numel() + s.numel() * 4
            else:
                q, s, mn = ops.quantize_weight_groups(w, kind)
                bits = 4 if kind.startswith("q4") else 8
                fn = lambda x, q=q, s=s, mn=mn, bits=bits: ops.qlinear(x, q, s, mn, None, bits)  # noqa: E731
                nbytes = q.numel() + s.numel() * 2 + (0 if mn is None else mn.numel() * 2)
            layers.append((fn, k, nbytes))
            total += nbytes
    return layers, total


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    from specdec import _C

    avx512 = bool(_C.build_info().get("cpu_avx512"))
    kernels = (True, False) if avx512 else (False,)
    g = torch.Generator().manual_seed(0)
    built = {kind: make_layers(kind, g) for kind in KINDS}
    xs = {(M, K): torch.randn(M, K, generator=g) for M in ROWS for K in (576, 1536)}
    times = {(kind, M, on): [] for kind in KINDS for M in ROWS for on in kernels}
    prev = _C.set_cpu_avx512(True)
    try:
        for r in range(args.rounds + 1):  # round 0 warms up
            for kind, (layers, _) in built.items():
                for M in ROWS:
                    for on in kernels:
                        _C.set_cpu_avx512(on)
                        t0 = time.perf_counter()
                        for fn, K, _ in layers:
                            fn(xs[(M, K)])
                        if r > 0:
                            times[(kind, M, on)].append(time.perf_counter() - t0)
    finally:
        _C.set_cpu_avx512(prev)
    bw = read_bandwidth_gbs()
    med = {k: statistics.median(v) for k, v in times.items()}
    rows = []
    for kind, (_, total) in built.items():
        for M in ROWS:
            row = dict(kind=kind, M=M, weight_mb=round(total / 1e6, 1))
            for on in kernels:
                tag = "avx512" if on else "avx2"
                t = med[(kind, M, on)]
                row[f"{tag} ms"] = round(1e3 * t, 2)
                row[f"{tag} GB/s"] = round(total / t / 1e9, 1)
                row[f"{tag} M / 1 row"] = round(t / med[(kind, 1, on)], 3)
            if avx512:
                row["avx512 speedup"] = round(med[(kind, M, False)] / med[(kind, M, True)], 3)
            rows.append(row)

    print(f"# few-row linears by row count, weights streaming from DRAM, threads {torch.get_num_threads()}, "
          f"median of {args.rounds} interleaved rounds; read bandwidth {bw:.1f} GB/s; AVX-512: {avx512}")
    head = f"{'kind':<6} {'M':>3} {'MB':>6} " + " ".join(
        f"{'avx512' if on else 'avx2':>7} ms {'M/1':>6}" for on in kernels) + ("  speedup" if avx512 else "")
    print(head)
    for row in rows:
        cols = " ".join(f"{row[('avx512' if on else 'avx2') + ' ms']:>10.2f} "
                        f"{row[('avx512' if on else 'avx2') + ' M / 1 row']:>6.3f}"
                        for on in kernels)
        print(f"{row['kind']:<6} {row['M']:>3} {row['weight_mb']:>6.0f} {cols}"
              + (f"  {row['avx512 speedup']:>7.3f}" if avx512 else ""))
    commit = git_commit()
    now = _dt.datetime.now()
    out = Path(args.out) if args.out else ROOT / "benchmarks" / "results" / f"rows_cpu_{now:%Y-%m-%d}.json"
    out.write_text(json.dumps(dict(
        date=now.isoformat(timespec="seconds"), commit=commit, torch=torch.__version__,
        threads=torch.get_num_threads(), loadavg=os.getloadavg() if hasattr(os, "getloadavg") else None,
        read_bandwidth_gbs=round(bw, 1), rounds=args.rounds, cpu_avx512=avx512, shapes=SHAPES, rows=rows,
        keys={"<k> ms": "median time of one pass over all the layers (M rows of x each)",
              "<k> GB/s": "weight bytes / that time",
              "<k> M / 1 row": "the pass at M rows / the pass at 1 row, same kernel",
              "avx512 speedup": "AVX2 time / AVX-512 time at this M (the same bits)"}), indent=1))
    print(f"# wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
