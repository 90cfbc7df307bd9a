"""The CPU kernels' software prefetch distances (and other switches of theirs) in whole forwards.

    python benchmarks/bench_prefetch.py
        [--knob attention|q8act|q8act_stream|q8act_block|q8act_many|q8act_pquant|q8act_level|fused_rows|q8act_amx]
        [--tier TIER]
        [--rounds 8] [--reps 30] [--prefixes 150,600,1500] [--nodes 1,8] [--distances 0,1,2,4] [--baseline B]
        [--threads 2] [--out FILE]

One process, the bundled SmolLM2-135M at q4_1 with q8 activations (the CLI's default). The knob:
``attention`` (``specdec._C.set_attention_prefetch``: key blocks of 64 keys of K / V requested ahead of
the one computed; a decode step reads the layers' fp32 K / V, 1.5 KiB per key and layer, after ~100 MB
of weights went through the caches), ``q8act`` (``specdec._C.set_q8act_prefetch``: packed weight blocks
the AVX2 / AVX-VNNI tiers request ahead; 16 the baseline), ``q8act_stream``
(``specdec._C.set_q8act_stream_prefetch``: packed weight blocks the AVX-512 VNNI tiles of few activation
rows request ahead, every line into L2; 0 = the one-line hint two blocks ahead), ``q8act_block``
(``specdec._C.set_q8act_block_prefetch``: the same for the tiles of many rows, every line into L1; 0 = the
hint), ``q8act_many`` (``specdec._C.set_q8act_many_rows``: from how many activation rows those tiles count as
many, two digits per value, Q8_0's then Q4's: 46 = from 4 / from 6, the default and baseline), ``q8act_pquant``
(``specdec._C.set_q8act_parallel_quantize``: 0 the activations quantized on the calling thread, the baseline; 1
on all threads), ``fused_rows`` (``specdec._C.set_fused_row_elems``: elements per task of the CPU RMSNorm /
RoPE, rows of H = 576 elements; 32768 the baseline: up to 56 rows on the calling thread) or ``q8act_level``
(``specdec._C.set_q8act_prefetch_level``: the cache level, 1 or 2, the AVX2 / AVX-VNNI tiers prefetch
into; --distances are then levels, 1 the baseline). --tier forces qlinear_q8act's tier (e.g. avx2).
Per prefix length, round and value (the order reversed every other round): the median of --reps
forwards of N chain nodes (N = 1: a decode step; more: verify passes) over a prefilled cache. Reported:
medians over rounds and, per value, the median of the per-round ratios to the baseline (0; 16 for
q8act; level 1; 46 for q8act_many; --baseline sets another). The logits of every value are compared bit
for bit with the baseline's. Writes benchmarks/results/<knob>_prefetch_<date>.json.
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

KNOBS = {"attention": ("set_attention_prefetch", 0), "q8act": ("set_q8act_prefetch", 16),
         "q8act_stream": ("set_q8act_stream_prefetch", 0), "q8act_block": ("set_q8act_block_prefetch", 0),
         "q8act_level": ("set_q8act_prefetch_level", 1), "q8act_many": ("set_q8act_many_rows", 46),
         "q8act_pquant": ("set_q8act_parallel_quantize", 0), "fused_rows": ("set_fused_row_elems", 32768),
         "q8act_amx": ("set_q8act_amx_rows", 0)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--knob", default="attention", choices=sorted(KNOBS))
    ap.add_argument("--tier", default="auto", help="qlinear_q8act's CPU tier (specdec._C.set_q8act_tier)")
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--prefixes", default="150,600,1500")
    ap.add_argument("--nodes", default="1,8")
    ap.add_argument("--distances", default="0,1,2,4")
    ap.add_argument("--baseline", type=int, default=None, help="the value the ratios are taken to (default: the "
                    "knob's own, above)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    import specdec
    from specdec import _C
    from specdec.models import load_bundled
    from specdec.models.quant import set_activation_quant

    prefixes = [int(p) for p in a.prefixes.split(",")]
    nodes = [int(n) for n in a.nodes.split(",")]
    setter, base_value = getattr(_C, KNOBS[a.knob][0]), KNOBS[a.knob][1]
    if a.knob == "q8act_many":  # two digits: the Q8_0 and the Q4 threshold
        pair = setter

        def setter(v):
            q8, q4 = pair(int(v) // 10, int(v) % 10)
            return 10 * q8 + q4
    if a.baseline is not None:
        base_value = a.baseline
    dists = [int(d) for d in a.distances.split(",")]
    if base_value not in dists:
        raise SystemExit(f"bench_prefetch: --distances must include {base_value} (the baseline)")
    tier_was = _C.set_q8act_tier(a.tier)
    model, _ = load_bundled("smollm2-135m", precision="q4_1")
    set_activation_quant(model, "q8")
    lm = specdec.HFCausalLM(model)
    load = [loadavg()]
    was = setter(base_value)
    per = {}
    same_bits = True
    try:
        for prefix in prefixes:
            cache = lm.new_cache(1, prefix + 16)
            lm.prefill(cache, [[1 + i % 4000 for i in range(prefix)]])
            for r in range(a.rounds):
                for d in (dists if r % 2 == 0 else dists[::-1]):
                    setter(d)
                    for n in nodes:
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
                print(f"prefix {prefix} round {r}: N={nodes[0]} " + ", ".join(
                    f"d{d} {per[(prefix, nodes[0], d)][-1]:.2f}" for d in dists) + " ms", flush=True)
            for n in nodes:
                logits = per.pop((prefix, n, "logits"))
                same_bits &= all(torch.equal(logits[d], logits[base_value]) for d in dists)
        tier = _C.q8act_tier()
    finally:
        setter(was)
        _C.set_q8act_tier(tier_was)
    load.append(loadavg())
    summary = {}
    for prefix in prefixes:
        for n in nodes:
            base = per[(prefix, n, base_value)]
            row = {}
            for d in dists:
                v = per[(prefix, n, d)]
                row[f"d{d}"] = {"ms": round(statistics.median(v), 3),
                                "ratio_to_baseline": round(statistics.median([x / b for x, b in zip(v, base)]), 4)}
            summary[f"prefix={prefix} N={n}"] = row
            print(f"prefix {prefix} N={n}: " + ", ".join(f"d{d} {v['ms']:.2f} ms ({v['ratio_to_baseline']:.3f}x)"
                                                          for d, v in zip(dists, row.values())))
    print(f"logits equal to the baseline's: {same_bits}")
    res = {"benchmark": f"{a.knob}_prefetch", "knob": KNOBS[a.knob][0], "baseline": base_value, "nodes": nodes,
           "q8act_tier": tier,
           "date": _dt.date.today().isoformat(), "commit": git_commit(),
           "cpu": cpu_name(), "threads": a.threads, "precision": "q4_1", "act": "q8", "loadavg": load,
           "rounds": a.rounds, "reps": a.reps, "prefixes": prefixes, "distances": dists,
           "logits_equal_to_the_baseline": bool(same_bits), "summary": summary,
           "rounds_ms": {f"prefix={p} N={n} d{d}": [round(x, 3) for x in per[(p, n, d)]]
                         for p in prefixes for n in nodes for d in dists},
           "notes": "shared 2-core host (see loadavg); ratios are medians of per-round ratios, one process"}
    out = Path(a.out) if a.out else ROOT / "benchmarks" / "results" / f"{a.knob}_prefetch_{res['date']}.json"
    out.write_text(json.dumps(res, indent=1))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
