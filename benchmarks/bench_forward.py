"""One forward of the bundled SmolLM2-135M through HFCausalLM, by adapter configuration.

Measures the latency of a decode step (N = 1 new token) and a verify step (N = 8 chain
nodes) over a 150-token prefix, for:
  modules+F.linear   transformers' modules, torch's F.linear (fast_path=False, fast_linear=False)
  modules+ops.linear transformers' modules, specdec.ops.linear   (fast_path=False)
  lean+ops.linear    specdec.models.fast_llama + ops.linear     (the default)
on the fp32 target and on the w8 draft (weight-only int8: always ops.linear). Configurations
are interleaved round by round (medians), and for the default configuration a profiler
split gives the time inside specdec::linear versus everything else.
Writes benchmarks/results/forward_cpu_<date>.json.
"""
from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    from specdec import HFCausalLM
    from specdec.models import load_bundled

    model, _, w8 = load_bundled("smollm2-135m", draft="w8")
    configs = {
        "fp32 modules+F.linear": HFCausalLM(model, fast_path=False, fast_linear=False),
        "fp32 modules+ops.linear": HFCausalLM(model, fast_path=False),
        "fp32 lean+ops.linear": HFCausalLM(model),
        "w8 modules": HFCausalLM(w8, fast_path=False),
        "w8 lean": HFCausalLM(w8),
    }
    prefix = list(range(1, 151))
    caches = {}
    for name, lm in configs.items():
        caches[name] = lm.new_cache(1, 512)
        lm.prefill(caches[name], [prefix])
    times = {(name, N): [] for name in configs for N in (1, 8)}
    for r in range(args.rounds + 2):  # 2 warm-up rounds
        for N in (1, 8):
            tok = torch.zeros(1, N, dtype=torch.long)
            dep = torch.arange(N)[None]
            for name, lm in configs.items():
                t0 = time.perf_counter()
                lm.forward(caches[name], tok, dep)
                if r >= 2:
                    times[(name, N)].append(time.perf_counter() - t0)
    rows = []
    for (name, N), ts in times.items():
        rows.append(dict(config=name, N=N, median_ms=1e3 * statistics.median(ts)))

    split = {}
    for name in ("fp32 lean+ops.linear", "w8 lean"):
        lm, cache = configs[name], caches[name]
        for N in (1, 8):
            tok, dep = torch.zeros(1, N, dtype=torch.long), torch.arange(N)[None]
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
                for _ in range(5):
                    lm.forward(cache, tok, dep)
            ev = {e.key: e for e in prof.key_averages()}
            total = sum(e.self_cpu_time_total for e in ev.values()) / 5e3
            lin = (ev["specdec::linear"].self_cpu_time_total / 5e3) if "specdec::linear" in ev else 0.0
            split[f"{name} N={N}"] = dict(total_ms=total, linear_ms=lin, other_ms=total - lin)

    print(f"# HFCausalLM forward, SmolLM2-135M, 150-token prefix, threads {torch.get_num_threads()}, "
          f"median of {args.rounds} interleaved rounds")
    print(f"{'config':<26} {'N=1 ms':>8} {'N=8 ms':>8}")
    for name in configs:
        a = next(r["median_ms"] for r in rows if r["config"] == name and r["N"] == 1)
        b = next(r["median_ms"] for r in rows if r["config"] == name and r["N"] == 8)
        print(f"{name:<26} {a:>8.1f} {b:>8.1f}")
    print("# profiler split (self CPU time per forward, profiler overhead included)")
    for k, v in split.items():
        print(f"{k:<28} total {v['total_ms']:.1f} ms, specdec::linear {v['linear_ms']:.1f} ms, "
              f"other ops {v['other_ms']:.1f} ms")
    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                                text=True).stdout.strip()
    except OSError:
        commit = "unknown"
    now = _dt.datetime.now()
    out = Path(args.out) if args.out else ROOT / "benchmarks" / "results" / f"forward_cpu_{now:%Y-%m-%d}.json"
    out.write_text(json.dumps(dict(date=now.isoformat(timespec="seconds"), commit=commit,
                                   torch=torch.__version__, threads=torch.get_num_threads(),
                                   loadavg=os.getloadavg() if hasattr(os, "getloadavg") else None,
                                   rows=rows, profiler_split=split), indent=2))
    print(f"# wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
