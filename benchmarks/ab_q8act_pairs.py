"""qlinear_q8act's AVX-512 VNNI tier, A/B of a switch in one process: two weight groups or one, block prefetch.

    python benchmarks/ab_q8act_pairs.py [--switch pairs|block_prefetch] [--rounds 25] [--reps 5] [--threads 2]
        [--new 48]

``--switch pairs`` (the default):
``specdec._C.set_q8act_group_pairs(on)`` switches, between calls, whether the AVX-512 VNNI tier runs a pass of
one or two activation rows over Q4 weights on two groups of 16 weight rows at once ("pairs") or one group at a
time ("single"); the bits are the same either way (checked here on every forward). The bundled model at q4_1
with q8 activations (the CLI's default target), a 150-token prefix: per round and side, the mean of --reps
forwards of N = 1, 2, 3, 4 chain nodes (a decode step at N = 1, verify passes above; the same positions
rewritten), then plain greedy decoding of --new tokens on two chat prompts (tokens/s); the sides' order
alternates by round. Reported per case: the medians, the median of per-round ratios (single / pairs) and their
geometric mean with a 95 % interval. ``--switch block_prefetch``: ``set_q8act_block_prefetch`` at 0 ("pairs"
columns: the one-line hint) and 2 ("single" columns: every line of the block two blocks ahead, the default) with
N = 1, 4, 6, 8 (the tiles of many rows take it). The CPU must run the AVX-512 VNNI tier (elsewhere the switches
change nothing). Writes benchmarks/results/q8act_pairs_ab_<date>.json (q8act_block_prefetch_ab_<date>.json).
"""
from __future__ import annotations

import argparse
import datetime as _dt
import math
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from specdec.bench.record import cpu_name, git_commit, loadavg, write_record  # noqa: E402

PROMPTS = ["Explain why the sky is blue in two sentences.", "Write a short story about a robot learning to paint."]
NODES = (1, 2, 3, 4)


def _summary(pairs, single):
    ratios = [s / p for p, s in zip(pairs, single)]
    logs = [math.log(r) for r in ratios]
    mean = statistics.fmean(logs)
    half = 2 * statistics.stdev(logs) / math.sqrt(len(logs)) if len(logs) > 1 else float("nan")
    return {"pairs_median": statistics.median(pairs), "single_median": statistics.median(single),
            "ratio_of_medians": statistics.median(single) / statistics.median(pairs),
            "median_round_ratio": statistics.median(ratios), "geomean_ratio": math.exp(mean),
            "geomean_95": [math.exp(mean - half), math.exp(mean + half)], "pairs_rounds": pairs,
            "single_rounds": single}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--switch", default="pairs", choices=["pairs", "block_prefetch"])
    ap.add_argument("--rounds", type=int, default=25)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--new", type=int, default=48)
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    import specdec
    from specdec import _C
    from specdec.bench.workloads import chat_ids
    from specdec.models import load_bundled
    from specdec.models.quant import set_activation_quant

    if _C.q8act_tier() != "avx512_vnni":
        raise SystemExit(f"ab_q8act_pairs: this CPU runs qlinear_q8act's {_C.q8act_tier()} tier; the switch only "
                         f"changes the avx512_vnni tier")
    model, tok = load_bundled("smollm2-135m", precision="q4_1")
    set_activation_quant(model, "q8")
    lm = specdec.HFCausalLM(model)
    cache = lm.new_cache(1, 512)
    lm.prefill(cache, [list(range(1, 151))])
    prompts = [chat_ids(tok, p) for p in PROMPTS]
    nodes = NODES if a.switch == "pairs" else (1, 4, 6, 8)
    setter = _C.set_q8act_group_pairs if a.switch == "pairs" else \
        (lambda on: _C.set_q8act_block_prefetch(0 if on else 2))
    default = _C.set_q8act_group_pairs(True) if a.switch == "pairs" else _C.set_q8act_block_prefetch(2)
    restore = (lambda: _C.set_q8act_group_pairs(default)) if a.switch == "pairs" else \
        (lambda: _C.set_q8act_block_prefetch(default))
    restore()
    load = [loadavg()]
    step = {(s, n): [] for s in (True, False) for n in nodes}
    gen = {s: [] for s in (True, False)}
    ref, ref_gen = {}, None
    for r in range(a.rounds + 1):  # round 0 warms up
        for side in ((True, False) if r % 2 else (False, True)):
            setter(side)
            for n in nodes:
                tk, dep = torch.zeros(1, n, dtype=torch.long), torch.arange(n)[None]
                t0 = time.perf_counter()
                for _ in range(a.reps):
                    out = lm.forward(cache, tk, dep)
                if r:
                    step[(side, n)].append((time.perf_counter() - t0) / a.reps * 1e3)
                if n not in ref:
                    ref[n] = out.clone()
                elif not torch.equal(ref[n], out):
                    raise SystemExit(f"ab_q8act_pairs: the logits at N = {n} differ between the sides")
            dec = specdec.SpeculativeDecoder(lm, None, max_batch=1, max_len=512)
            t0, toks, outs = time.perf_counter(), 0, []
            for p in prompts:
                res = dec.generate([p], max_new_tokens=a.new)
                outs.append(res.tokens[0])
                toks += len(res.tokens[0])
            if r:
                gen[side].append(toks / (time.perf_counter() - t0))
            if ref_gen is None:
                ref_gen = outs
            elif outs != ref_gen:
                raise SystemExit("ab_q8act_pairs: greedy outputs differ between the sides")
        if r:
            print(f"round {r}: N=1 pairs {step[(True, 1)][-1]:.2f} ms, single {step[(False, 1)][-1]:.2f} ms; "
                  f"greedy {gen[True][-1]:.1f} / {gen[False][-1]:.1f} tokens/s", flush=True)
    restore()
    load.append(loadavg())
    summary = {f"forward N={n} (ms)": _summary(step[(True, n)], step[(False, n)]) for n in nodes}
    g = _summary([1 / x for x in gen[True]], [1 / x for x in gen[False]])  # seconds per token: lower is better
    summary["greedy plain (tokens/s)"] = {"pairs_median": statistics.median(gen[True]),
                                          "single_median": statistics.median(gen[False]),
                                          "single_over_pairs_seconds_per_token": g["geomean_ratio"],
                                          "geomean_95": g["geomean_95"], "pairs_rounds": gen[True],
                                          "single_rounds": gen[False]}
    for k, v in summary.items():
        if "ratio_of_medians" in v:
            print(f"{k}: pairs {v['pairs_median']:.2f}, single {v['single_median']:.2f}, single / pairs "
                  f"{v['ratio_of_medians']:.3f} (per round {v['median_round_ratio']:.3f}, geometric mean "
                  f"{v['geomean_ratio']:.3f}, 95 % {v['geomean_95'][0]:.3f}-{v['geomean_95'][1]:.3f})")
        else:
            print(f"{k}: pairs {v['pairs_median']:.1f}, single {v['single_median']:.1f}; seconds per token single / "
                  f"pairs {v['single_over_pairs_seconds_per_token']:.3f}")
    bench = "q8act_pairs_ab" if a.switch == "pairs" else "q8act_block_prefetch_ab"
    res = {"benchmark": bench, "switch": a.switch,
           "sides": ["pairs: two groups", "single: one group"] if a.switch == "pairs" else
           ["pairs columns: block_prefetch 0 (one-line hint)", "single columns: block_prefetch 2"],
           "date": _dt.date.today().isoformat(), "commit": git_commit(),
           "cpu": cpu_name(), "threads": a.threads, "rounds": a.rounds, "reps": a.reps, "new_tokens": a.new,
           "default": default, "loadavg": load, "summary": summary,
           "notes": "one process, the sides alternating by round; logits and greedy outputs equal between the sides"}
    out = Path(a.out) if a.out else ROOT / "benchmarks" / "results" / f"{bench}_{res['date']}.json"
    write_record(str(out.parent), out.stem, res)


if __name__ == "__main__":
    main()
