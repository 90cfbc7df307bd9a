"""Where a decode step's time goes: the layer stack, the LM head and the rest of the lean forward (CPU).

    python benchmarks/bench_step_parts.py [--rounds 7] [--reps 10] [--threads 2] [--precision q4_1] [--act q8]

One process, the bundled SmolLM2-135M (default: q4_1 with q8 activations, the CLI's default), a
150-token prefix. The lean forward's two big calls are timed inside each forward (thin wrappers around
``runner.stack.forward``, the DecoderStack call running every layer, and ``runner.lm_head``): per round
and N = 1, 8 chain nodes, the medians over --reps forwards of the forward, the stack and the head, the
rest being the difference (embedding, rotary tables, dispatch). Between rounds, a read-bandwidth probe
(torch.sum over a 256 MiB float32 buffer, the same threads). Reported: medians over rounds, each part's
bytes (the layers' weights with the prefix's K/V, the head's weight) over its time as GB/s and as a
fraction of the probe. Writes benchmarks/results/step_parts_<date>.json.
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

from bench_q8act import weight_bytes  # noqa: E402  (benchmarks/ is on the path when run as a script)
from specdec.bench.record import cpu_name, git_commit, loadavg  # noqa: E402

PREFIX = 150
NODES = (1, 8)


class _Timed:
    """Calls ``fn`` and appends its wall time to ``sink``."""

    def __init__(self, fn, sink: list) -> None:
        self.fn, self.sink = fn, sink

    def __call__(self, *args):
        t0 = time.perf_counter()
        out = self.fn(*args)
        self.sink.append(time.perf_counter() - t0)
        return out

    forward = __call__


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--precision", default="q4_1")
    ap.add_argument("--act", default="q8", choices=["q8", "none"])
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    import specdec
    from specdec.models import load_bundled
    from specdec.models.quant import set_activation_quant

    model, _ = load_bundled("smollm2-135m", precision=a.precision)
    if a.act == "q8":
        set_activation_quant(model, "q8")
    lm = specdec.HFCausalLM(model)
    runner = getattr(lm, "_runner", None)
    if runner is None or runner.stack is None:
        raise SystemExit("bench_step_parts: this model does not run the lean forward's DecoderStack")
    cache = lm.new_cache(1, 512)
    lm.prefill(cache, [list(range(1, PREFIX + 1))])
    cfg = model.config
    kv = cfg.num_hidden_layers * 2 * PREFIX * cfg.num_key_value_heads * (cfg.hidden_size // cfg.num_attention_heads) * 4
    head_bytes = weight_bytes(model.lm_head)  # the usual layout's bytes: the packed one holds exactly these
    layer_bytes = weight_bytes(model.model.layers) + kv
    sinks = {"stack": [], "head": []}
    runner.stack = _Timed(runner.stack.forward, sinks["stack"])
    runner.lm_head = _Timed(runner.lm_head, sinks["head"])
    buf = torch.ones(64 << 20)
    load = [loadavg()]
    per = {(n, part): [] for n in NODES for part in ("forward", "stack", "head", "rest")}
    probes = []
    for r in range(a.rounds):
        for n in NODES:
            tok = torch.ones(1, n, dtype=torch.int64)
            dep = torch.arange(n, dtype=torch.int32).view(1, n)
            lm.forward(cache, tok, dep)
            for s in sinks.values():
                s.clear()
            fwd = []
            for _ in range(a.reps):
                t0 = time.perf_counter()
                lm.forward(cache, tok, dep)
                fwd.append(time.perf_counter() - t0)
            rest = [f - s - h for f, s, h in zip(fwd, sinks["stack"], sinks["head"])]
            for part, v in (("forward", fwd), ("stack", sinks["stack"]), ("head", sinks["head"]), ("rest", rest)):
                per[(n, part)].append(statistics.median(v))
        t0 = time.perf_counter()
        buf.sum()
        probes.append(buf.numel() * 4 / (time.perf_counter() - t0) / 1e9)
        print(f"round {r}: N=1 forward {per[(1, 'forward')][-1] * 1e3:.2f} ms (stack {per[(1, 'stack')][-1] * 1e3:.2f},"
              f" head {per[(1, 'head')][-1] * 1e3:.2f}), probe {probes[-1]:.1f} GB/s", flush=True)
    load.append(loadavg())
    bw = statistics.median(probes)
    summary = {}
    for n in NODES:
        row = {part: {"ms": round(statistics.median(per[(n, part)]) * 1e3, 3)} for part in ("forward", "stack", "head",
                                                                                          "rest")}
        for part, nbytes in (("stack", layer_bytes), ("head", head_bytes)):
            gbs = nbytes / (row[part]["ms"] / 1e3) / 1e9
            row[part].update(bytes=nbytes, gb_per_s=round(gbs, 2), fraction_of_probe=round(gbs / bw, 3))
        for part in ("stack", "head", "rest"):
            row[part]["share_of_forward"] = round(row[part]["ms"] / row["forward"]["ms"], 3)
        summary[f"N={n}"] = row
        print(f"N={n}: " + ", ".join(f"{p} {v['ms']:.2f} ms" + (f" ({v['fraction_of_probe'] * 100:.0f} % of the probe)"
                                                                if "fraction_of_probe" in v else "")
                                     for p, v in row.items()))
    res = {"benchmark": "step_parts", "date": _dt.date.today().isoformat(), "commit": git_commit(), "cpu": cpu_name(),
           "threads": a.threads, "precision": a.precision, "act": a.act, "loadavg": load, "rounds": a.rounds,
           "reps": a.reps, "prefix": PREFIX, "read_bandwidth_gbs": round(bw, 2),
           "read_bandwidth_rounds_gbs": [round(p, 2) for p in probes], "summary": summary,
           "rounds_ms": {f"N={n} {part}": [round(t * 1e3, 3) for t in v] for (n, part), v in per.items()},
           "notes": "shared 2-core host (see loadavg); the parts are timed inside the same forwards"}
    name = f"step_parts_{res['date']}.json"
    out = Path(a.out) if a.out else ROOT / "benchmarks" / "results" / name
    out.write_text(json.dumps(res, indent=1))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
