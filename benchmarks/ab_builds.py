"""Two builds of the extension, A/B by alternating processes (CPU): for kernel changes without a runtime switch.

    python benchmarks/ab_builds.py --old SO --new SO [--rounds 8] [--reps 20] [--prefix 150] [--nodes 1,2,4,8,16]
        [--threads 2] [--name NAME]

``--old`` / ``--new``: two builds of ``specdec/_C*.so`` (for example the one of an earlier commit, built with
its sources checked out, and the current one). Each round runs one short process per side, the order
alternating: the process puts its build in a private copy of the package, loads the bundled SmolLM2-135M
at q4_1 with q8 activations, prefills a --prefix-token cache and times --reps forwards (after 3 untimed)
of N chain nodes per node count (N = 1: a decode step; more: verify passes, which leave the cache's
length as it was). It reports the medians and the logits of its first forward per node count.
Reported here: per node count the medians
over rounds, the median of per-round ratios new / old and their geometric mean with a 95 % interval (two
standard errors of the mean log ratio), the new / old ratio of N-node to 1-node passes, and whether both
builds gave the same logits. The two processes never run at once. Writes benchmarks/results/<name>_<date>.json
(default name builds_ab).
"""
from __future__ import annotations

import argparse
import datetime as _dt
import json
import math
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from specdec.bench.record import cpu_name, git_commit, loadavg, write_record  # noqa: E402

CHILD = r"""
import json, statistics, sys, time
import torch
args = json.loads(sys.argv[1])
torch.set_num_threads(args["threads"])
import specdec
from specdec.models import load_bundled
from specdec.models.quant import set_activation_quant
model, _ = load_bundled("smollm2-135m", precision="q4_1")
set_activation_quant(model, "q8")
lm = specdec.HFCausalLM(model)
prefix = args["prefix"]
cache = lm.new_cache(1, prefix + max(args["nodes"]) + 1)
lm.prefill(cache, [[1 + i % 4000 for i in range(prefix)]])
out = {"package": specdec.__file__, "ms": {}, "logits": {}}
for n in args["nodes"]:
    tok = torch.ones(1, n, dtype=torch.int64)
    dep = torch.arange(n, dtype=torch.int32).view(1, n)
    first = lm.forward(cache, tok, dep)
    first = first[0] if isinstance(first, tuple) else first
    out["logits"][str(n)] = first.flatten()[:4096].tolist()
    for _ in range(3):  # warm-up, untimed
        lm.forward(cache, tok, dep)
    ts = []
    for _ in range(args["reps"]):
        t0 = time.perf_counter()
        lm.forward(cache, tok, dep)
        ts.append(time.perf_counter() - t0)
    out["ms"][str(n)] = statistics.median(ts) * 1e3
print("RESULT " + json.dumps(out))
"""


def package_with(so: Path, into: Path) -> Path:
    """A copy of the specdec package whose extension is ``so``."""
    pkg = into / "specdec"
    shutil.copytree(ROOT / "specdec", pkg, ignore=shutil.ignore_patterns("_C*.so", "__pycache__"))
    shutil.copy2(so, pkg / so.name)
    return into


def run_side(path: Path, a, nodes) -> dict:
    env = dict(os.environ, PYTHONPATH=str(path))
    args = json.dumps({"threads": a.threads, "prefix": a.prefix, "nodes": nodes, "reps": a.reps})
    proc = subprocess.run([sys.executable, "-c", CHILD, args], env=env, capture_output=True, text=True, cwd=path)
    line = [x for x in proc.stdout.splitlines() if x.startswith("RESULT ")]
    if proc.returncode != 0 or not line:
        raise SystemExit(f"ab_builds: a side failed ({path}):\n{proc.stderr[-2000:]}")
    res = json.loads(line[-1][len("RESULT "):])
    if not res["package"].startswith(str(path)):
        raise SystemExit(f"ab_builds: the side imported {res['package']}, not its copy under {path}")
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--old", required=True, type=Path, help="the baseline build of specdec/_C*.so")
    ap.add_argument("--new", required=True, type=Path, help="the build under test")
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--prefix", type=int, default=150)
    ap.add_argument("--nodes", default="1,2,4,8,16")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--name", default="builds_ab")
    ap.add_argument("--note", default="", help="what the two builds are (kept in the record)")
    a = ap.parse_args()
    nodes = [int(n) for n in a.nodes.split(",")]
    for so in (a.old, a.new):
        if not so.is_file() or not so.name.startswith("_C"):
            raise SystemExit(f"ab_builds: expected a built extension file _C*.so, got {so}")
    load = [loadavg()]
    per = {"old": [], "new": []}
    same = True
    with tempfile.TemporaryDirectory() as tmp:
        paths = {"old": package_with(a.old, Path(tmp) / "old"), "new": package_with(a.new, Path(tmp) / "new")}
        for r in range(a.rounds):
            logits = {}
            for side in (("old", "new") if r % 2 == 0 else ("new", "old")):
                res = run_side(paths[side], a, nodes)
                per[side].append(res["ms"])
                logits[side] = res["logits"]
            same &= logits["old"] == logits["new"]
            print(f"round {r}: " + ", ".join(f"N={n} {per['new'][-1][str(n)] / per['old'][-1][str(n)]:.3f}"
                                            for n in nodes) + " (new / old)", flush=True)
    load.append(loadavg())
    summary = {}
    for n in nodes:
        k = str(n)
        old = [x[k] for x in per["old"]]
        new = [x[k] for x in per["new"]]
        logs = [math.log(y / x) for x, y in zip(old, new)]
        mean = statistics.mean(logs)
        half = 2 * statistics.stdev(logs) / math.sqrt(len(logs)) if len(logs) > 1 else float("nan")
        row = {"old_ms": round(statistics.median(old), 3), "new_ms": round(statistics.median(new), 3),
               "ratio_median": round(statistics.median(y / x for x, y in zip(old, new)), 4),
               "ratio_geomean": round(math.exp(mean), 4),
               "ratio_95": [round(math.exp(mean - half), 4), round(math.exp(mean + half), 4)]}
        if n != nodes[0]:
            row["old_over_first"] = round(statistics.median(x[k] / x[str(nodes[0])] for x in per["old"]), 3)
            row["new_over_first"] = round(statistics.median(x[k] / x[str(nodes[0])] for x in per["new"]), 3)
        summary[f"N={n}"] = row
        print(f"N={n}: old {row['old_ms']:.2f} ms, new {row['new_ms']:.2f} ms, new / old {row['ratio_median']:.3f} "
              f"(geomean {row['ratio_geomean']:.3f}, 95 % {row['ratio_95'][0]:.3f}-{row['ratio_95'][1]:.3f})"
              + (f", N / N={nodes[0]}: {row['old_over_first']:.3f} -> {row['new_over_first']:.3f}"
                 if "old_over_first" in row else ""))
    print(f"logits equal: {same}")
    rec = {"benchmark": "builds_ab", "note": a.note, "date": _dt.date.today().isoformat(), "commit": git_commit(),
           "cpu": cpu_name(), "threads": a.threads, "precision": "q4_1", "act": "q8", "prefix": a.prefix,
           "nodes": nodes, "rounds": a.rounds, "reps": a.reps, "loadavg": load, "logits_equal": bool(same),
           "summary": summary, "rounds_ms": per}
    write_record(ROOT / "benchmarks" / "results", f"{a.name}_{rec['date']}", rec)


if __name__ == "__main__":
    main()
