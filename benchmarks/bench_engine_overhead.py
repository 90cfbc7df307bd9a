"""What an Engine step costs beyond the target's forward, plain decoding, CPU.

    python benchmarks/bench_engine_overhead.py [--rounds 5] [--new 160] [--threads 2]

The bundled model (q4_1, q8 activations), no drafter, one request of a 150-token prompt at a time, dense and
paged KV interleaved round by round. Per step: the wall time of ``Engine.step()`` and of the target's forward
inside it (``HFCausalLM.forward``, or ``forward_argmax`` where a greedy plain step takes the head's argmax op,
timed around the call); their difference is the engine's own work (plan,
verification, commit, the host read, emission, metrics and the scheduler's record). Reported: medians over
rounds of the per-round medians, ms, and the overhead as a fraction of the step. Writes
benchmarks/results/engine_overhead_<date>.json (load average recorded).
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


def _timed(inner, spent):
    def timed(*args, **kw):
        t0 = time.perf_counter()
        out = inner(*args, **kw)
        spent.append(time.perf_counter() - t0)
        return out
    return timed


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--new", type=int, default=160)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    import specdec
    from specdec import Engine, RequestParams
    from specdec.models import load_bundled

    model, _ = load_bundled("smollm2-135m", precision="q4_1", act="q8")
    layouts = ("dense", "paged")
    engines, forwards = {}, {}
    for kv in layouts:
        lm = specdec.HFCausalLM(model)
        spent = forwards[kv] = []
        for name in ("forward", "forward_argmax"):  # greedy plain steps take forward_argmax where the head allows
            setattr(lm, name, _timed(getattr(lm, name), spent))
        engines[kv] = Engine(lm, None, max_batch=1, max_len=1024, kv_cache=kv)
    rows = {kv: {"step": [], "forward": [], "overhead": []} for kv in layouts}
    load = [loadavg()]
    for r in range(a.rounds + 1):  # round 0 warms up
        for kv in (layouts if r % 2 == 0 else layouts[::-1]):
            eng = engines[kv]
            eng.add_request(f"{kv}{r}", [1 + i % 4000 for i in range(150)], RequestParams(max_new_tokens=a.new))
            eng.step()  # admission and prefill
            forwards[kv].clear()
            steps = []
            while eng.has_unfinished():
                t0 = time.perf_counter()
                eng.step()
                steps.append(time.perf_counter() - t0)
            if r:
                s, f = statistics.median(steps), statistics.median(forwards[kv])
                rows[kv]["step"].append(s * 1e3)
                rows[kv]["forward"].append(f * 1e3)
                rows[kv]["overhead"].append((s - f) * 1e3)
    load.append(loadavg())
    summary = {}
    for kv, d in rows.items():
        m = {k: round(statistics.median(v), 4) for k, v in d.items()}
        m["overhead_fraction"] = round(statistics.median(o / s for o, s in zip(d["overhead"], d["step"])), 4)
        summary[kv] = m
        print(f"{kv}: step {m['step']:.3f} ms, forward {m['forward']:.3f} ms, engine {m['overhead']:.3f} ms "
              f"({100 * m['overhead_fraction']:.1f} %)")
    res = {"benchmark": "engine_overhead", "date": _dt.date.today().isoformat(), "commit": git_commit(),
           "cpu": cpu_name(), "threads": a.threads, "rounds": a.rounds, "new_tokens": a.new, "loadavg": load,
           "summary": summary, "rounds_ms": rows,
           "notes": "plain decoding (no drafter), one request at a time, q4_1 + q8 activations; per round the median "
                    "step and the median target forward; engine = step - forward"}
    path = Path(a.out) if a.out else ROOT / "benchmarks" / "results" / f"engine_overhead_{res['date']}.json"
    path.write_text(json.dumps(res, indent=1))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
