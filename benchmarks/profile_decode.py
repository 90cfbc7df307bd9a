"""Where each thread of a CPU decode step spends its time: a sampling profile (Linux perf) of greedy
decode steps of the bundled model, per thread and category.

    python benchmarks/profile_decode.py [--seconds 10] [--threads 2] [--precision q4_1] [--act q8] [--nodes 1]

One process decodes one request (a 150-token prefix, then N = 1 steps; ``--nodes N``: verify passes of N chain
nodes) while ``perf record`` samples it
for --seconds after a warm-up. Samples are grouped per thread (the main thread: Python, the serial parts
of each layer and its share of every parallel region; the others: OpenMP workers) into the q8act /
linear product tiles, attention, OpenMP waiting (libgomp: a thread spinning for work or at a region's
end), other specdec C++ (norms, RoPE, activation quantization, bookkeeping) and everything else
(Python, torch dispatch, libc). Symbol names need an unstripped extension: build it with
``SPECDEC_BUILD_TYPE=RelWithDebInfo`` (the same -O3 code with debug information; the default Release
build is stripped, and its kernels then count as "specdec, unnamed"). Needs ``perf`` and
``kernel.perf_event_paranoid <= 2``. Writes benchmarks/results/decode_profile_<date>.json.
"""
from __future__ import annotations

import argparse
import collections
import datetime as _dt
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from specdec.bench.record import cpu_name, git_commit, loadavg  # noqa: E402

CATEGORIES = (("tiles", ("tile<", "group_tile", "q8act_rows", "linear_rows", "qlinear_rows", "gemm")),
              ("attention", ("attention",)),
              ("openmp wait", ("libgomp",)),
              ("specdec other", ("specdec::", "_C.cpython")))


def category(sym: str, dso: str) -> str:
    text = f"{sym} {dso}"
    for name, keys in CATEGORIES:
        if any(k in text for k in keys):
            if name == "specdec other" and "_C.cpython" in dso and sym in ("[unknown]", ""):
                return "specdec, unnamed"
            return name
    return "python / torch / libc"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seconds", type=float, default=10.0)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--precision", default="q4_1")
    ap.add_argument("--act", default="q8", choices=["q8", "none"])
    ap.add_argument("--nodes", type=int, default=1, help="chain nodes per forward (1: decode steps; more: verify "
                    "passes)")
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    perf = shutil.which("perf")
    if perf is None:
        raise SystemExit("profile_decode: needs Linux perf on PATH")
    torch.set_num_threads(a.threads)
    import specdec
    from specdec.models import load_bundled
    from specdec.models.quant import set_activation_quant

    model, _ = load_bundled("smollm2-135m", precision=a.precision)
    if a.act == "q8":
        set_activation_quant(model, "q8")
    lm = specdec.HFCausalLM(model)
    cache = lm.new_cache(1, 512)
    lm.prefill(cache, [list(range(1, 151))])
    tok = torch.ones(1, a.nodes, dtype=torch.int64)
    dep = torch.arange(a.nodes, dtype=torch.int32).view(1, a.nodes)
    for _ in range(20):
        lm.forward(cache, tok, dep)
    load = [loadavg()]
    steps = 0
    with tempfile.TemporaryDirectory() as tmp:
        data = os.path.join(tmp, "perf.data")
        # perf attaches to this process for --seconds while this (main) thread decodes, as a server's would
        rec = subprocess.Popen([perf, "record", "-q", "-p", str(os.getpid()), "-o", data, "--", "sleep",
                                str(a.seconds)], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        t0 = time.perf_counter()
        while rec.poll() is None:
            lm.forward(cache, tok, dep)  # forward does not advance cache.lens: every step at the same position
            steps += 1
        wall = time.perf_counter() - t0
        if rec.returncode != 0:
            raise SystemExit(f"profile_decode: perf record failed: {rec.stderr.read().decode()[-300:]}")
        out = subprocess.run([perf, "script", "-i", data, "-F", "tid,ip,sym,dso", "-G"], check=True,
                             capture_output=True, text=True).stdout
    load.append(loadavg())
    per = collections.defaultdict(collections.Counter)
    syms = collections.defaultdict(collections.Counter)
    for line in out.splitlines():
        parts = line.split(None, 1)
        if len(parts) < 2 or not parts[0].isdigit():
            continue
        rest = parts[1].split(None, 1)[1] if len(parts[1].split(None, 1)) == 2 else ""  # past the address
        dso = rest[rest.rfind("(") + 1:rest.rfind(")")] if "(" in rest else ""
        sym = rest[:rest.rfind("(")].strip() if "(" in rest else rest.strip()
        per[int(parts[0])][category(sym, dso)] += 1
        syms[int(parts[0])][f"{sym} ({os.path.basename(dso)})"] += 1
    # the decoding thread holds the most non-OpenMP samples; the rest are the OpenMP workers
    busy = {tid: sum(c.values()) - c["openmp wait"] for tid, c in per.items()}
    main_tid = max(busy, key=busy.get) if busy else None
    threads = {}
    for tid, c in sorted(per.items(), key=lambda kv: -sum(kv[1].values())):
        total = sum(c.values())
        if total < 50:
            continue
        role = "decoding thread" if tid == main_tid else "worker"
        threads[f"{role} {tid}"] = {"samples": total,
                                    "share": {k: round(v / total, 4) for k, v in c.most_common()},
                                    "top_symbols": {k: round(v / total, 4) for k, v in syms[tid].most_common(12)}}
    res = {"benchmark": "decode_profile", "date": _dt.date.today().isoformat(), "commit": git_commit(),
           "cpu": cpu_name(), "threads": a.threads, "precision": a.precision, "act": a.act, "prefix": 150,
           "nodes": a.nodes, "seconds": a.seconds, "steps": steps, "ms_per_step": round(wall / max(steps, 1) * 1e3, 3),
           "loadavg": load, "q8act_tier": specdec._C.q8act_tier(), "per_thread": threads,
           "notes": "perf record -p PID (cycles, default frequency) during decode steps; shares of each thread's "
                    "samples (and its 12 most sampled symbols); a spinning OpenMP worker is sampled while it waits"}
    for name, t in threads.items():
        print(f"{name}: " + ", ".join(f"{k} {100 * v:.1f} %" for k, v in t["share"].items()))
    path = Path(a.out) if a.out else ROOT / "benchmarks" / "results" / f"decode_profile_{res['date']}.json"
    path.write_text(json.dumps(res, indent=1))
    print(f"{res['ms_per_step']} ms per step over {steps} steps (perf attached); wrote {path}")


if __name__ == "__main__":
    main()
