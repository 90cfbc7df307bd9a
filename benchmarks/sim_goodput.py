"""The goodput policy against fixed k and plain decoding on a simulated decoder (no model, seconds).

A decoder at batch 1 serves ``--requests`` requests of ``--tokens`` tokens each, one after the
other (as ``specdec bench`` does: the policy keeps its decoder-wide statistics and cost model
across requests), for ``--seeds`` independent runs. Each step's phases take simulated seconds
with log-normal noise (``--noise``, per phase and step: a shared machine), and acceptance is drawn
per draft position (position i accepted with probability alpha(i), given position i - 1 was):

  verify(n nodes) = verify_ms + per_node_ms * (n - 1)
  draft(k)        = draft_ms * k      (+ a catch-up forward after plain steps and at a request's
                                       start: the draft model's lazy prompt prefill)

The defaults are the costs the goodput traces of ``specdec bench`` measure for the w8 draft of the
bundled SmolLM2-135M at batch 1 on 2 CPU cores (target step ~21.5 ms, draft token ~11.5 ms, ~1.3 ms
per extra verified node). Profiles (acceptance by position, draft price):

  a0.9 / a0.8 / a0.7  flat acceptance 0.9 / 0.8 / 0.7 (a good draft model)
  decaying            0.95 * 0.93^i
  int8                the int8-dynamic draft's measured acceptance by position, 30 ms a token
  random              acceptance 0 at 0.3 ms a token (a useless, free drafter)
  cheap0.6            acceptance 0.6 at 2 ms a token (a cheap, mediocre drafter)

Reported per profile: tokens/s of plain decoding, fixed k = 1..4 and goodput (total tokens over
total simulated seconds), goodput / the best of them, and goodput's share of fallback steps and
mean k. The real decoder's numbers are in benchmarks/results/sched_<date>.json; this isolates the
policy's decisions from a machine's noise (same seeds for every method).

    python benchmarks/sim_goodput.py [--seeds 30] [--out benchmarks/results/sim_goodput_<date>.json]
"""
from __future__ import annotations

import argparse
import datetime as _dt
import json
import math
import random
import sys
from pathlib import Path
from typing import Callable, Dict

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from specdec import scheduler as S  # noqa: E402
from specdec.bench import git_commit as _git_commit, record_path as _record_path  # noqa: E402

INT8 = [0.5, 0.43, 0.3, 0.25, 0.12, 0.1, 0.1, 0.1]
PROFILES: Dict[str, tuple] = {
    "a0.9": (lambda i: 0.9, {}),
    "a0.8": (lambda i: 0.8, {}),
    "a0.7": (lambda i: 0.7, {}),
    "decaying": (lambda i: 0.95 * 0.93 ** i, {}),
    "int8": (lambda i: INT8[min(i, len(INT8) - 1)], dict(draft_ms=30.0)),
    "random": (lambda i: 0.0, dict(draft_ms=0.3)),
    "cheap0.6": (lambda i: 0.6, dict(draft_ms=2.0)),
}


def simulate(make: Callable[[], S.Policy], alpha: Callable[[int], float], seeds: int, requests: int, tokens: int,
             draft_ms: float = 11.5, verify_ms: float = 21.5, per_node_ms: float = 1.3, noise: float = 0.1,
             prompt: int = 30) -> Dict[str, float]:
    """Run the policy; returns tokens/s, the share of fallback steps and the mean k."""
    seconds = emitted = 0.0
    steps = fallback = k_sum = 0
    for seed in range(seeds):
        rng = random.Random(seed)
        pol = make()
        for _ in range(requests):
            pol.begin(1)
            left, behind = tokens, prompt  # the draft model has not seen the prompt yet
            while left > 0:
                plan = pol.plan([0], [left - 1], closed=True, behind=[behind])
                k = plan.budgets[0]
                n = pol.nodes(k)

                def f() -> float:
                    return math.exp(rng.gauss(0.0, noise))
                verify = (verify_ms + per_node_ms * (n - 1)) * f() / 1e3
                draft = catch_up = 0.0
                fed, acc = 0, 0
                if k > 0:
                    draft = draft_ms * k * f() / 1e3
                    if behind:  # one forward over the positions behind (it also yields the first depth)
                        catch_up = draft_ms * (1 + 0.05 * behind) * f() / 1e3
                        draft += catch_up - draft_ms / 1e3
                        fed, behind = behind, 0
                    while acc < k and rng.random() < alpha(acc):
                        acc += 1
                else:
                    behind += 1
                out = min(acc + 1, left)
                total = draft + verify + 3e-4
                pol.observe(plan, [0], n, [k], [k], [acc], [out],
                            S.StepTimes(draft, verify, 3e-4, total, catch_up, fed))
                left -= out
                seconds += total
                emitted += out
                steps += 1
                k_sum += k
                fallback += plan.states[0] == S.FALLBACK
    return dict(tokens_per_second=emitted / seconds, fallback_share=fallback / steps, mean_k=k_sum / steps)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seeds", type=int, default=30)
    ap.add_argument("--requests", type=int, default=30)
    ap.add_argument("--tokens", type=int, default=40)
    ap.add_argument("--max-k", type=int, default=8, help="the drafter's largest depth (goodput picks below it)")
    ap.add_argument("--profiles", default=",".join(PROFILES))
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    for name, v in (("seeds", args.seeds), ("requests", args.requests), ("tokens", args.tokens), ("max-k", args.max_k)):
        if v < 1:
            ap.error(f"--{name} must be >= 1, got {v}")
    unknown = [p for p in args.profiles.split(",") if p not in PROFILES]
    if unknown:
        ap.error(f"--profiles: unknown {unknown}; known: {sorted(PROFILES)}")
    kw = dict(seeds=args.seeds, requests=args.requests, tokens=args.tokens)
    results = {}
    print(f"{'profile':<10} {'plain':>6} {'k=1':>6} {'k=2':>6} {'k=3':>6} {'k=4':>6} {'goodput':>8} "
          f"{'vs best':>8} {'fallback':>8} {'mean k':>6}")
    for name in args.profiles.split(","):
        alpha, cost = PROFILES[name]
        row = {"plain": simulate(lambda: S.make_policy("fixed", None), alpha, **kw, **cost)}
        for k in (1, 2, 3, 4):
            row[f"fixed{k}"] = simulate(lambda k=k: S.FixedPolicy(k), alpha, **kw, **cost)
        row["goodput"] = simulate(lambda: S.GoodputPolicy(args.max_k), alpha, **kw, **cost)
        best = max(v["tokens_per_second"] for m, v in row.items() if m != "goodput")
        g = row["goodput"]
        results[name] = dict(methods=row, goodput_vs_best=g["tokens_per_second"] / best,
                             goodput_vs_plain=g["tokens_per_second"] / row["plain"]["tokens_per_second"])
        print(f"{name:<10} " + " ".join(f"{row[m]['tokens_per_second']:6.1f}" for m in
                                        ("plain", "fixed1", "fixed2", "fixed3", "fixed4"))
              + f" {g['tokens_per_second']:8.1f} {results[name]['goodput_vs_best']:7.3f}x "
              f"{100 * g['fallback_share']:7.1f}% {g['mean_k']:6.2f}", flush=True)
    out = Path(args.out) if args.out else ROOT / "benchmarks" / "results" / \
        f"sim_goodput_{_dt.date.today().isoformat()}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    record = dict(benchmark="sim_goodput", date=_dt.datetime.now().isoformat(timespec="seconds"),
                  git_commit=_git_commit(), settings=dict(vars(args), out=_record_path(out)), profiles=results)
    out.write_text(json.dumps(record, indent=1))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
