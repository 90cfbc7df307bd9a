"""The CPU attention's software prefetch of K / V blocks in whole forwards.

    python benchmarks/bench_attention_prefetch.py [--rounds 8] [--reps 30] [--prefixes 150,600,1500]
        [--distances 0,1,2,4] [--threads 2] [--out FILE]

One process, the bundled SmolLM2-135M at q4_1 with q8 activations (the CLI's default). Per prefix
length, round and distance (``specdec._C.set_attention_prefetch``: key blocks of 64 keys requested
ahead of the one computed; the order reversed every other round): the median of --reps forwards of
N = 1 and N = 8 chain nodes (a decode step, a verify pass) over a prefilled cache. A decode step reads
the layers' K / V (fp32, 3 KV heads of 64: 1.5 KiB per key and layer) after ~100 MB of weights went
through the caches, so they come from DRAM. Reported: medians over rounds and, per distance, the
median of the per-round ratios to no prefetch (0). The logits of every distance are compared bit for
bit with distance 0's. Writes benchmarks/results/attention_prefetch_<date>.json.
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

NODES = (1, 8)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--prefixes", default="150,600,1500")
    ap.add_argument("--distances", default="0,1,2,4")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    import specdec
    from specdec import _C
    from specdec.models import load_bundled
    from specdec.models.quant import set_activation_quant

    prefixes = [int(p) for p in a.prefixes.split(",")]
    dists = [int(d) for d in a.distances.split(",")]
    if 0 not in dists:
        raise SystemExit("bench_attention_prefetch: --distances must include 0 (the baseline)")
    model, _ = load_bundled("smollm2-135m", precision="q4_1")
    set_activation_quant(model, "q8")
    lm = specdec.HFCausalLM(model)
    load = [loadavg()]
    was = _C.set_attention_prefetch(0)
    per = {}
    same_bits = True
    try:
        for prefix in prefixes:
            cache = lm.new_cache(1, prefix + 16)
            lm.prefill(cache, [[1 + i % 4000 for i in range(prefix)]])
            for r in range(a.rounds):
                for d in (dists if r % 2 == 0 else dists[::-1]):
                    _C.set_attention_prefetch(d)
                    for n in NODES:
                        tok = torch.ones(1, n, dtype=torch.int64)
                        dep = torch.arange(n, dtype=torch.int32).view(1, n)
                        out = lm.forward(cache, tok, dep)
                        if r == 0:
                            per.setdefault((prefix, n, "logits"), {})[d] = out[0] if isinstance(out, tuple) else out
                        ts = []
                        for _ in range(a.reps):
                            t0 = time.perf_counter()
                            lm.forward(cache, tok, dep)
                            ts.append(time.perf_counter() - t0)
                        per.setdefault((prefix, n, d), []).append(statistics.median(ts) * 1e3)
                print(f"prefix {prefix} round {r}: N=1 " + ", ".join(
                    f"d{d} {per[(prefix, 1, d)][-1]:.2f}" for d in dists) + " ms", flush=True)
            for n in NODES:
                logits = per.pop((prefix, n, "logits"))
                same_bits &= all(torch.equal(logits[d], logits[0]) for d in dists)
    finally:
        _C.set_attention_prefetch(was)
    load.append(loadavg())
    summary = {}
    for prefix in prefixes:
        for n in NODES:
            base = per[(prefix, n, 0)]
            row = {}
            for d in dists:
                v = per[(prefix, n, d)]
                row[f"d{d}"] = {"ms": round(statistics.median(v), 3),
                                "ratio_to_none": round(statistics.median([x / b for x, b in zip(v, base)]), 4)}
            summary[f"prefix={prefix} N={n}"] = row
            print(f"prefix {prefix} N={n}: " + ", ".join(f"d{d} {v['ms']:.2f} ms ({v['ratio_to_none']:.3f}x)"
                                                          for d, v in zip(dists, row.values())))
    print(f"logits equal at every distance: {same_bits}")
    res = {"benchmark": "attention_prefetch", "date": _dt.date.today().isoformat(), "commit": git_commit(),
           "cpu": cpu_name(), "threads": a.threads, "precision": "q4_1", "act": "q8", "loadavg": load,
           "rounds": a.rounds, "reps": a.reps, "prefixes": prefixes, "distances": dists,
           "logits_equal_at_every_distance": bool(same_bits), "summary": summary,
           "rounds_ms": {f"prefix={p} N={n} d{d}": [round(x, 3) for x in per[(p, n, d)]]
                         for p in prefixes for n in NODES for d in dists},
           "notes": "shared 2-core host (see loadavg); ratios are medians of per-round ratios, one process"}
    out = Path(a.out) if a.out else ROOT / "benchmarks" / "results" / f"attention_prefetch_{res['date']}.json"
    out.write_text(json.dumps(res, indent=1))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
