"""Packed q8-activation weights in huge pages or on the allocator's pages, A/B in one process (CPU).

    python benchmarks/ab_packed_hugepages.py [--rounds 31] [--steps 20] [--threads 2] [--prefix 150] [--nodes 1,8]

With activations quantized (``act="q8"``) a CPU forward streams the packed layouts of
:func:`specdec.ops.pack_q8act`, made after loading (:func:`specdec.models.quant.q8act_weight`), not the
modules' buffers that ``load_bundled`` moves into huge pages. "new": the packed layouts copied into
huge pages (:func:`specdec.models.quant.set_packed_hugepages`, the default); "old": left where the
allocator put them (4 KiB pages). Two copies of the bundled model at q4_1 with q8 activations, one per
side, each with its own cache at the same position; both give the same logits (checked). Each round
times --steps forwards of each side back to back per node count (N = 1: a decode step; N > 1: a chain
verify pass, kv_offset 0 and rolled back), the order alternating. Reported per node count: medians,
the median of per-round ratios and their geometric mean with a 95 % interval (two standard errors of
the mean log ratio), and the huge pages the process holds (AnonHugePages) after each side's packing.
Writes benchmarks/results/packed_hugepages_ab_<date>.json.
"""
from __future__ import annotations

import argparse
import datetime as _dt
import json
import math
import re
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from specdec.bench.record import cpu_name, git_commit, loadavg  # noqa: E402


def anon_huge_kib() -> int:
    """The process's AnonHugePages (KiB; -1 where /proc/self/smaps_rollup is not there)."""
    try:
        text = Path("/proc/self/smaps_rollup").read_text()
    except OSError:
        return -1
    m = re.search(r"AnonHugePages:\s+(\d+) kB", text)
    return int(m.group(1)) if m else -1


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=31)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--prefix", type=int, default=150)
    ap.add_argument("--nodes", default="1,8")
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    import specdec
    from specdec.models import load_bundled
    from specdec.models.quant import set_packed_hugepages

    nodes = [int(x) for x in a.nodes.split(",")]
    sides, huge = {}, {}
    for name in ("old", "new"):
        set_packed_hugepages(name == "new")
        model, _ = load_bundled("smollm2-135m", precision="q4_1", act="q8")
        lm = specdec.HFCausalLM(model)
        cache = lm.new_cache(1, a.prefix + max(nodes) + 8)
        lm.prefill(cache, [list(range(1, a.prefix + 1))])
        sides[name] = (lm, cache)
        huge[name] = anon_huge_kib()
    set_packed_hugepages(True)

    def call(name: str, n: int) -> torch.Tensor:
        lm, cache = sides[name]
        tok = torch.arange(1, n + 1, dtype=torch.int64).view(1, n)
        dep = torch.arange(n, dtype=torch.int32).view(1, n)
        out = lm.forward(cache, tok, dep)  # appends K/V after lens; lens does not move: the next call overwrites
        return out

    for n in nodes:
        if not torch.equal(call("old", n), call("new", n)):
            raise SystemExit(f"ab_packed_hugepages: the two sides' logits differ at {n} nodes")

    def timed(name: str, n: int) -> float:
        t0 = time.perf_counter()
        for _ in range(a.steps):
            call(name, n)
        return (time.perf_counter() - t0) / a.steps * 1e3

    load = [loadavg()]
    ms = {n: {"old": [], "new": []} for n in nodes}
    for r in range(a.rounds):
        for n in nodes:
            for name in (("old", "new") if r % 2 == 0 else ("new", "old")):
                call(name, n)
                ms[n][name].append(timed(name, n))
    load.append(loadavg())
    per = {}
    for n in nodes:
        ratios = [x / y for x, y in zip(ms[n]["new"], ms[n]["old"])]
        logs = [math.log(x) for x in ratios]
        mean, se = statistics.mean(logs), statistics.stdev(logs) / math.sqrt(len(logs))
        per[str(n)] = {"step_ms_median": {k: round(statistics.median(v), 4) for k, v in ms[n].items()},
                       "ratio_new_over_old_median": round(statistics.median(ratios), 4),
                       "ratio_new_over_old_geomean": round(math.exp(mean), 4),
                       "ratio_95_interval": [round(math.exp(mean - 2 * se), 4), round(math.exp(mean + 2 * se), 4)],
                       "step_ms_rounds": {k: [round(x, 4) for x in v] for k, v in ms[n].items()}}
        p = per[str(n)]
        print(f"{n} node(s): old {p['step_ms_median']['old']:.3f} ms, new {p['step_ms_median']['new']:.3f} ms; "
              f"new / old median {p['ratio_new_over_old_median']:.4f}, geomean {p['ratio_new_over_old_geomean']:.4f} "
              f"(95 % {p['ratio_95_interval'][0]:.4f}-{p['ratio_95_interval'][1]:.4f})")
    res = {"benchmark": "packed_hugepages_ab", "date": _dt.date.today().isoformat(), "commit": git_commit(),
           "cpu": cpu_name(), "threads": a.threads, "prefix": a.prefix, "rounds": a.rounds, "steps": a.steps,
           "loadavg": load, "q8act_tier": specdec._C.q8act_tier(), "logits_equal": True,
           "anon_huge_pages_kib_after_packing": huge, "nodes": per,
           "notes": "one process, two copies of the model, sides alternating round by round; shared 2-core host "
                    "(see loadavg)"}
    print(f"AnonHugePages after packing (KiB): {huge}")
    path = Path(a.out) if a.out else ROOT / "benchmarks" / "results" / f"packed_hugepages_ab_{res['date']}.json"
    path.write_text(json.dumps(res, indent=1))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
