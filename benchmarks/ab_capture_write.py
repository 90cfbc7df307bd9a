"""What keeping the target's hidden states costs a CPU decode step, A/B in one process.

    python benchmarks/ab_capture_write.py [--rounds 41] [--steps 15] [--threads 2] [--prefix 150] [--nodes 1,3]

A feature head (EagleHead) turns on the target's ``capture_hidden``: every forward then writes its nodes'
final states into the cache (``specdec.models.hidden.write_hidden``), right after the forward has streamed
the weights through the caches, where each distinct tensor operation costs several times its warm price.
Three sides: "off" (no capture), "host" (capture; the write as one slice copy per row from host integers,
the default on the CPU for a few rows) and "tensor" (capture; the slot arithmetic and a scatter, the form
before, ``hidden.HOST_FORM = False``). The bundled model at q4_1 with q8 activations, a --prefix-token
cache; each round times --steps forwards of N nodes per side, the sides' order rotating. Reported per N:
medians of the per-forward times and, against "off", the median and geometric mean (95 % interval: two
standard errors of the mean log ratio) of the per-round ratios. The logits of all sides are checked equal.
Also recorded: what one small tensor operation (an int32 [1] tensor's ``.to(torch.int64)``) costs as the first
operation after a forward and as the next one (medians over --rounds forwards of one node), the cost the host
form saves per operation it avoids.
Writes benchmarks/results/capture_write_ab_<date>.json.
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

SIDES = ("off", "host", "tensor")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=41)
    ap.add_argument("--steps", type=int, default=15)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--prefix", type=int, default=150)
    ap.add_argument("--nodes", default="1,3")
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    import specdec
    from specdec.models import hidden, load_bundled

    model, _ = load_bundled("smollm2-135m", precision="q4_1", act="q8")
    lm = specdec.HFCausalLM(model)
    lm.capture_hidden((-1,))
    spec = lm.hidden_spec
    cache = lm.new_cache(1, a.prefix + 64)
    lm.prefill(cache, [list(range(1, a.prefix + 1))])

    def side(name: str) -> None:
        on = name != "off"
        lm.hidden_spec = spec if on else None
        lm._runner.capture = spec if on else None
        hidden.HOST_FORM = name != "tensor"

    load = [loadavg()]
    result = {}
    for N in [int(x) for x in a.nodes.split(",")]:
        tok = torch.full((1, N), 7, dtype=torch.int64)
        dep = torch.arange(N, dtype=torch.int32).view(1, N)
        mask = None if N == 1 else torch.ones(1, N, N, dtype=torch.bool).tril()
        outs = {}
        for name in SIDES:
            side(name)
            outs[name] = lm.forward(cache, tok, dep, mask)
        if not all(torch.equal(outs["off"], o) for o in outs.values()):
            raise SystemExit("ab_capture_write: the sides' logits differ")
        ms = {k: [] for k in SIDES}
        for r in range(a.rounds):
            order = SIDES[r % 3:] + SIDES[:r % 3]
            for name in order:
                side(name)
                lm.forward(cache, tok, dep, mask)
                t0 = time.perf_counter()
                for _ in range(a.steps):
                    lm.forward(cache, tok, dep, mask)
                ms[name].append((time.perf_counter() - t0) / a.steps * 1e3)
        row = {"forward_ms_median": {k: round(statistics.median(v), 4) for k, v in ms.items()},
               "forward_ms_rounds": {k: [round(x, 4) for x in v] for k, v in ms.items()}}
        for name in ("host", "tensor"):
            ratios = [x / o for x, o in zip(ms[name], ms["off"])]
            logs = [math.log(x) for x in ratios]
            mean, se = statistics.mean(logs), statistics.stdev(logs) / math.sqrt(len(logs))
            row[f"{name}_over_off"] = {"median": round(statistics.median(ratios), 4),
                                       "geomean": round(math.exp(mean), 4),
                                       "interval_95": [round(math.exp(mean - 2 * se), 4),
                                                       round(math.exp(mean + 2 * se), 4)]}
            print(f"N={N} {name} / off: median {row[f'{name}_over_off']['median']:.4f}, geomean "
                  f"{row[f'{name}_over_off']['geomean']:.4f} (95 % {row[f'{name}_over_off']['interval_95']})",
                  flush=True)
        result[str(N)] = row
    side("off")
    small = torch.tensor([3], dtype=torch.int32)
    first, second = [], []
    tok, dep = torch.full((1, 1), 7, dtype=torch.int64), torch.zeros(1, 1, dtype=torch.int32)
    for _ in range(a.rounds):
        lm.forward(cache, tok, dep)
        t0 = time.perf_counter()
        small.to(torch.int64)
        t1 = time.perf_counter()
        small.to(torch.int64)
        t2 = time.perf_counter()
        first.append((t1 - t0) * 1e6)
        second.append((t2 - t1) * 1e6)
    small_op = {"first_after_forward_us": round(statistics.median(first), 2),
                "second_us": round(statistics.median(second), 2)}
    print(f"a small op after a forward: {small_op['first_after_forward_us']} us, the next: {small_op['second_us']} us")
    side("host")
    load.append(loadavg())
    res = {"benchmark": "capture_write_ab", "date": _dt.date.today().isoformat(), "commit": git_commit(),
           "cpu": cpu_name(), "threads": a.threads, "prefix": a.prefix, "rounds": a.rounds, "steps": a.steps,
           "loadavg": load, "q8act_tier": specdec._C.q8act_tier(), "logits_equal": True, "nodes": result,
           "small_op": small_op,
           "notes": "one process, sides rotating round by round; shared 2-core host (see loadavg)"}
    path = Path(a.out) if a.out else ROOT / "benchmarks" / "results" / f"capture_write_ab_{res['date']}.json"
    write_record(str(path.parent), path.stem, res)


if __name__ == "__main__":
    main()
