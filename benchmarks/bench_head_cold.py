"""Where a feature head's draft forward goes, warm and as decoding runs it (right after the target's pass), CPU.

    python benchmarks/bench_head_cold.py --head HEAD [--rounds 9] [--reps 40] [--precision q8_0] [--act q8]

The bundled target (q4_1, q8 activations) keeps its final hidden states over a 150-token prefix; a trained
head (``specdec train-head --out DIR``: DIR/head) drafts one token after it (``HeadLM.forward``, the batch-1
path a draft step takes). Per round, interleaved: ``warm`` = head forwards back to back (its weights and
code stay in the caches), ``cold`` = each head forward right after a target pass of a 3-node tree (k 1 w 2,
as the decoding loop runs them: the target's ~100 MB have gone through the caches). Each forward's time is
split into its three kernels (``fc``, the decoder layer, the head's LM head, timed around their calls) and
the rest (Python, small tensor operations). Reported: medians over rounds of the per-round medians, ms.
Writes benchmarks/results/head_cold_<date>.json (load average recorded).
"""
from __future__ import annotations

import argparse
import collections
import datetime as _dt
import json
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from specdec.bench.record import cpu_name, git_commit, loadavg, record_path  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--head", required=True)
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--reps", type=int, default=40)
    ap.add_argument("--precision", default="q8_0", help="the head's weights (as EagleHead's precision)")
    ap.add_argument("--act", default="q8", choices=["q8", "none"])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    import specdec
    from specdec import ops
    from specdec.drafters.eagle import EagleHead, load_head
    from specdec.drafters.eagle.lm import HeadLM
    from specdec.models import load_bundled

    model, _ = load_bundled("smollm2-135m", precision="q4_1", act="q8")
    target = specdec.HFCausalLM(model)
    target.capture_hidden((-1,))
    tcache = target.new_cache(1, 512)
    prefix = list(range(1, 151))
    target.prefill(tcache, [prefix])
    net = EagleHead(load_head(a.head), k=1, precision=a.precision, act=None if a.act == "none" else a.act).net
    lm = HeadLM(net, target)
    lm.attach(tcache)
    hcache = lm.new_cache(1, 512)
    lm.prefill(hcache, [prefix])
    one, d1 = torch.tensor([[5]]), torch.zeros(1, 1, dtype=torch.int32)
    tree, dtree = torch.tensor([[5, 6, 7]]), torch.tensor([[0, 1, 1]], dtype=torch.int32)
    mask = torch.tensor([[[1, 0, 0], [1, 1, 0], [1, 0, 1]]], dtype=torch.bool)

    spans = collections.defaultdict(list)

    def timed(fn, label):
        def call(*args, **kw):
            t0 = time.perf_counter()
            out = fn(*args, **kw)
            spans[label].append(time.perf_counter() - t0)
            return out
        return call

    lm._fc = timed(lm._fc, "fc")
    if lm._lm_head is not None:
        lm._lm_head = timed(lm._lm_head, "lm_head")
    layer_op = ops.decoder_layer
    ops.decoder_layer = timed(layer_op, "layer")
    rows = {m: collections.defaultdict(list) for m in ("warm", "cold")}
    load = [loadavg()]
    try:
        for r in range(a.rounds + 1):  # round 0 warms up
            for mode in ("warm", "cold"):
                spans.clear()
                total = []
                for _ in range(a.reps):
                    if mode == "cold":
                        target.forward(tcache, tree, dtree, mask)
                    t0 = time.perf_counter()
                    lm.forward(hcache, one, d1)
                    total.append(time.perf_counter() - t0)
                if r:
                    parts = {k: statistics.median(v) for k, v in spans.items()}
                    parts["total"] = statistics.median(total)
                    parts["rest"] = parts["total"] - sum(v for k, v in parts.items() if k != "total")
                    for k, v in parts.items():
                        rows[mode][k].append(v * 1e3)
    finally:
        ops.decoder_layer = layer_op
    load.append(loadavg())
    ms = {m: {k: round(statistics.median(v), 3) for k, v in d.items()} for m, d in rows.items()}
    for m, d in ms.items():
        print(f"{m}: " + ", ".join(f"{k} {v:.3f} ms" for k, v in d.items()))
    res = {"benchmark": "head_cold", "date": _dt.date.today().isoformat(), "commit": git_commit(), "cpu": cpu_name(),
           "threads": a.threads, "head": record_path(a.head), "precision": a.precision, "act": a.act,
           "rounds": a.rounds, "reps": a.reps, "loadavg": load, "ms": ms,
           "notes": "warm: head forwards back to back; cold: each right after a 3-node target pass; per round the "
                    "median of --reps forwards and of each kernel's call time; rest = total less the kernels"}
    path = Path(a.out) if a.out else ROOT / "benchmarks" / "results" / f"head_cold_{res['date']}.json"
    path.write_text(json.dumps(res, indent=1))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
