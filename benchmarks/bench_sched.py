"""Scheduler evidence (issue: know when speculation pays): the goodput policy vs fixed-k sweeps vs plain.

Runs one interleaved grid through specdec.bench (same process, same prompts, every method
on every unit back to back in rotated order, medians of per-unit ratios against plain):

  grounded prompts: prompt lookup under goodput and fixed k in --lookup-ks
  open prompts:     the w8 draft under goodput and fixed k in --w8-ks; the int8-dynamic draft
                    under goodput and fixed --int8-k; a random-token drafter under goodput and
                    fixed k=8; transformers' plain generate (batch 1) as the outside reference

at batch sizes --batches (default 1, 4, 8), then checks the issue's targets and writes
benchmarks/results/sched_<date>.json (+ .png dashboard). Each target is reported as met or
missed with the measured number.

Targets (CPU): useless drafter: goodput >= 0.90x plain; good drafters (lookup on grounded,
w8 on open): goodput >= 0.95x the best fixed k; int8 draft: goodput >= 0.95x plain; batch 8:
goodput >= 0.95x max(plain, best fixed k).
"""
from __future__ import annotations

import argparse
import datetime as _dt
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from specdec.bench import format_table, run_bench, write_dashboard  # noqa: E402


def check_targets(result) -> list:
    out = []
    summ = result["summary"]

    def tps(w, name):
        r = summ.get(w, {}).get(name)
        return r and r["speedup_vs_plain_median"]

    for w, rows in summ.items():
        s, b = w.split("/b")
        b = int(b)
        for drafter in ("lookup", "w8", "int8", "random"):
            g = [n for n, r in rows.items() if r["drafter"] == drafter and r["policy"] == "goodput"]
            if not g:
                continue
            g_ratio = rows[g[0]]["speedup_vs_plain_median"]
            fixed = {n: r["speedup_vs_plain_median"] for n, r in rows.items()
                     if r["drafter"] == drafter and r["policy"] == "fixed"}
            best_name = max(fixed, key=fixed.get) if fixed else None
            best = fixed[best_name] if fixed else None
            if drafter == "random":
                out.append(dict(target="useless drafter: goodput >= 0.90x plain", workload=w, goodput_vs_plain=g_ratio,
                                fixed_vs_plain=best, met=g_ratio >= 0.90))
            if drafter == "int8":
                out.append(dict(target="int8 draft: goodput >= 0.95x plain", workload=w, goodput_vs_plain=g_ratio,
                                best_fixed=best_name, best_fixed_vs_plain=best, met=g_ratio >= 0.95))
            if (drafter, s) in (("lookup", "grounded"), ("w8", "open")) and best is not None:
                out.append(dict(target="good drafter: goodput >= 0.95x best fixed k", workload=w,
                                goodput_vs_plain=g_ratio, best_fixed=best_name, best_fixed_vs_plain=best,
                                goodput_vs_best_fixed=g_ratio / best, met=g_ratio >= 0.95 * best))
            if b == 8 and drafter != "random" and best is not None:
                ref = max(1.0, best)
                out.append(dict(target="batch 8: goodput >= 0.95x max(plain, best fixed k)", workload=w,
                                drafter=drafter, goodput_vs_plain=g_ratio, best_fixed=best_name,
                                best_fixed_vs_plain=best, goodput_vs_reference=g_ratio / ref,
                                met=g_ratio >= 0.95 * ref))
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batches", default="1,4,8")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--prompts", type=int, default=2, help="prompts per set (units at batch 1)")
    ap.add_argument("--repeats", type=int, default=3,
                    help="at batch > 1 (one unit per round): runs of plain and the goodput methods per round")
    ap.add_argument("--max-new-tokens", type=int, default=40)
    ap.add_argument("--lookup-ks", default="3,6,10")
    ap.add_argument("--w8-ks", default="2,4,8")
    ap.add_argument("--int8-k", type=int, default=6)
    ap.add_argument("--no-hf", action="store_true", help="leave out transformers' generate")
    ap.add_argument("--only", default="", help="comma list of drafters to keep (lookup, w8, int8, random)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    runs = {
        "grounded": ["lookup:10@goodput"] + [f"lookup:{k}@fixed" for k in args.lookup_ks.split(",")],
        "open": (["w8:8@goodput"] + [f"w8:{k}@fixed" for k in args.w8_ks.split(",")]
                 + [f"int8:{args.int8_k}@goodput", f"int8:{args.int8_k}@fixed", "random:8@goodput",
                    "random:8@fixed"] + ([] if args.no_hf else ["hf"])),
    }
    if args.only:
        keep = set(args.only.split(","))
        runs = {s: [m for m in ms if m.split(":")[0].split("@")[0] in keep] for s, ms in runs.items()}
        runs = {s: ms for s, ms in runs.items() if ms}
    result = run_bench(runs, [int(b) for b in args.batches.split(",")], rounds=args.rounds,
                       prompts_per_set=args.prompts, max_new_tokens=args.max_new_tokens, repeats=args.repeats)
    result["targets"] = check_targets(result)
    print(format_table(result))
    print("\ntargets:")
    for t in result["targets"]:
        extra = {k: (round(v, 3) if isinstance(v, float) else v) for k, v in t.items() if k not in ("target", "met")}
        print(f"  {'MET   ' if t['met'] else 'MISSED'} {t['target']}: {extra}")
    out = Path(args.out) if args.out else ROOT / "benchmarks" / "results" / f"sched_{_dt.date.today().isoformat()}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1))
    write_dashboard(result, out.with_suffix(".png"))
    print(f"\nwrote {out} and {out.with_suffix('.png')}  ({result['wall_seconds']:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
