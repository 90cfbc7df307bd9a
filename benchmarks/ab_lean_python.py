"""The lean forward's Python work around the layer stack, A/B in one process (CPU decode steps).

    python benchmarks/ab_lean_python.py [--rounds 41] [--steps 20] [--threads 2] [--prefix 150]

"new": the rotary cos / sin from the RotaryTable and the embedding as one F.embedding call (the
defaults); "old": the model's rotary module and embedding module called each step, as before them
(the positions' two dtype conversions, removed with them, are not switched).
Both give the same logits (checked on the first step). The bundled model at q4_1 with q8 activations;
each round times --steps greedy decode steps (N = 1 at a fixed position) on each side back to back,
the order alternating. Reported: medians of the per-step times, the median of per-round ratios, and
the geometric mean of the ratios with a 95 % interval (two standard errors of the mean log ratio).
Writes benchmarks/results/lean_python_ab_<date>.json.
"""
from __future__ import annotations

import argparse
import datetime as _dt
import json
import math
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from specdec.bench.record import cpu_name, git_commit, loadavg  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=41)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--prefix", type=int, default=150)
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    import specdec
    from specdec.models import load_bundled
    from specdec.models.quant import set_activation_quant

    model, _ = load_bundled("smollm2-135m", precision="q4_1")
    set_activation_quant(model, "q8")
    lm = specdec.HFCausalLM(model)
    runner = lm._runner
    if runner is None:
        raise SystemExit("ab_lean_python: the bundled model did not take the lean forward")
    cache = lm.new_cache(1, 512)
    lm.prefill(cache, [list(range(1, a.prefix + 1))])
    tok = torch.ones(1, 1, dtype=torch.int64)
    dep = torch.zeros(1, 1, dtype=torch.int32)
    new_embed = runner.embed_fn

    def side(name: str) -> None:
        runner.rope.enabled = name == "new"
        runner.embed_fn = new_embed if name == "new" else runner.embed

    outs = {}
    for name in ("old", "new"):
        side(name)
        outs[name] = lm.forward(cache, tok, dep)
    if not torch.equal(outs["old"], outs["new"]):
        raise SystemExit("ab_lean_python: the two sides' logits differ")

    def timed() -> float:
        t0 = time.perf_counter()
        for _ in range(a.steps):
            lm.forward(cache, tok, dep)
        return (time.perf_counter() - t0) / a.steps * 1e3

    load = [loadavg()]
    ms = {"old": [], "new": []}
    for r in range(a.rounds):
        for name in (("old", "new") if r % 2 == 0 else ("new", "old")):
            side(name)
            lm.forward(cache, tok, dep)
            ms[name].append(timed())
    side("new")
    load.append(loadavg())
    ratios = [n / o for n, o in zip(ms["new"], ms["old"])]
    logs = [math.log(x) for x in ratios]
    mean, se = statistics.mean(logs), statistics.stdev(logs) / math.sqrt(len(logs))
    res = {"benchmark": "lean_python_ab", "date": _dt.date.today().isoformat(), "commit": git_commit(),
           "cpu": cpu_name(), "threads": a.threads, "prefix": a.prefix, "rounds": a.rounds, "steps": a.steps,
           "loadavg": load, "q8act_tier": specdec._C.q8act_tier(), "logits_equal": True,
           "step_ms_median": {k: round(statistics.median(v), 4) for k, v in ms.items()},
           "ratio_new_over_old_median": round(statistics.median(ratios), 4),
           "ratio_new_over_old_geomean": round(math.exp(mean), 4),
           "ratio_95_interval": [round(math.exp(mean - 2 * se), 4), round(math.exp(mean + 2 * se), 4)],
           "step_ms_rounds": {k: [round(x, 4) for x in v] for k, v in ms.items()},
           "notes": "one process, sides alternating round by round; shared 2-core host (see loadavg)"}
    print(f"old {res['step_ms_median']['old']:.3f} ms, new {res['step_ms_median']['new']:.3f} ms a step; new / old "
          f"median {res['ratio_new_over_old_median']:.4f}, geomean {res['ratio_new_over_old_geomean']:.4f} "
          f"(95 % {res['ratio_95_interval'][0]:.4f}-{res['ratio_95_interval'][1]:.4f})")
    path = Path(a.out) if a.out else ROOT / "benchmarks" / "results" / f"lean_python_ab_{res['date']}.json"
    path.write_text(json.dumps(res, indent=1))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
