"""qlinear_q8act's prefetch distance (AVX2 tier) in whole forwards (CPU).

    python benchmarks/bench_q8act_prefetch.py [--rounds 8] [--reps 8] [--distances 0,8,16,32,64] [--out FILE]

One process, the bundled SmolLM2-135M at q4_1 with q8 activations (the CLI's default), a 150-token
prefix. Per round, thread count (1, then 2) and distance (``specdec._C.set_q8act_prefetch``, the order
reversed every other round): the median of --reps forwards of N = 1 and N = 8 chain nodes (a decode
step, a verify pass). The weights (~100 MB) do not fit the caches, so each forward reads them from
DRAM. Reported: medians over rounds and, per distance, the median of the per-round ratios to the
default (16). The bits do not depend on the distance (tests/test_ops_qlinear_q8act.py); only the AVX2
tier prefetches. Writes benchmarks/results/q8act_prefetch_<date>.json.
"""
from __future__ import annotations

import argparse
import datetime as _dt
import json
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from specdec.bench.record import cpu_name, git_commit, loadavg  # noqa: E402

PREFIX = 150
NODES = (1, 8)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--reps", type=int, default=8)
    ap.add_argument("--distances", default="0,8,16,32,64")
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    import specdec
    from specdec import _C
    from specdec.models import load_bundled
    from specdec.models.quant import set_activation_quant

    dists = [int(d) for d in a.distances.split(",")]
    model, _ = load_bundled("smollm2-135m", precision="q4_1")
    set_activation_quant(model, "q8")
    lm = specdec.HFCausalLM(model)
    cache = lm.new_cache(1, 512)
    lm.prefill(cache, [list(range(1, PREFIX + 1))])
    load = [loadavg()]
    times = {(th, d, n): [] for th in (1, 2) for d in dists for n in NODES}
    was = _C.set_q8act_prefetch(16)
    try:
        for r in range(a.rounds):
            for th in (1, 2):
                torch.set_num_threads(th)
                for d in (dists if r % 2 == 0 else dists[::-1]):
                    _C.set_q8act_prefetch(d)
                    for n in NODES:
                        tok = torch.ones(1, n, dtype=torch.int64)
                        dep = torch.arange(n, dtype=torch.int32).view(1, n)
                        lm.forward(cache, tok, dep)  # the cache's length stays: forward does not commit
                        ts = []
                        for _ in range(a.reps):
                            t0 = time.perf_counter()
                            lm.forward(cache, tok, dep)
                            ts.append(time.perf_counter() - t0)
                        times[(th, d, n)].append(statistics.median(ts))
            print(f"round {r}: " + ", ".join(f"{th}t pf{d} N=1 {times[(th, d, 1)][-1] * 1e3:.2f} ms"
                                             for th in (1, 2) for d in dists), flush=True)
    finally:
        _C.set_q8act_prefetch(was)
    load.append(loadavg())
    summary = {}
    for th in (1, 2):
        for n in NODES:
            base = times[(th, 16, n)] if 16 in dists else times[(th, dists[0], n)]
            row = {}
            for d in dists:
                row[str(d)] = {"ms": round(statistics.median(times[(th, d, n)]) * 1e3, 3),
                               "ratio_to_16": round(statistics.median(
                                   [x / y for x, y in zip(times[(th, d, n)], base)]), 3)}
            summary[f"threads={th} N={n}"] = row
            print(f"threads {th} N={n}: " + "  ".join(f"pf{d} {v['ms']:.2f} ms ({v['ratio_to_16']:.3f})"
                                                        for d, v in row.items()))
    res = {"benchmark": "q8act_prefetch", "date": _dt.date.today().isoformat(), "commit": git_commit(),
           "cpu": cpu_name(), "q8act_tier": _C.q8act_tier(), "loadavg": load, "rounds": a.rounds, "reps": a.reps,
           "prefix": PREFIX, "distances": dists, "summary": summary,
           "rounds_ms": {f"threads={th} pf={d} N={n}": [round(t * 1e3, 3) for t in v]
                         for (th, d, n), v in times.items()},
           "notes": "shared 2-core host (see loadavg); ratios are per round against the default distance 16"}
    out = Path(a.out) if a.out else ROOT / "benchmarks" / "results" / f"q8act_prefetch_{res['date']}.json"
    out.write_text(json.dumps(res, indent=1))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
