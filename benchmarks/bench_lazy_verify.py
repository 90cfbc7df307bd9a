"""The cost of a verify pass when the LM head runs along the accepted path only (specdec.lazy_verify), CPU.

    python benchmarks/bench_lazy_verify.py [--rounds 9] [--reps 10] [--threads 2] [--precision q4_1] [--act q8]

The bundled model over a 150-token prefix, one process, every configuration interleaved round by round:

* ``full N``: ``HFCausalLM.forward`` of N chain nodes (the head on all N rows; N = 1 is a decode step);
* ``hidden N + head c``: ``forward_hidden`` of N nodes, then ``head_logits`` on c of its rows (what a
  greedy verification computes when its walk reads c rows in one head call: c = 3 when at most two drafted
  tokens are accepted, the padding's free rows; c = N when the whole chain is);
* ``argmax N``: ``forward_argmax`` of N nodes (the head's argmax op on every row: no logits) and
  ``ops.greedy_verify`` on its int64 argmaxes: a greedy full pass as the Engine runs it where the lazy plan
  declines (``argmax 1``: a greedy decode step);
* ``lazy N, a accepted``: the whole verification by LazyGreedyVerify on a chain whose first ``a`` drafted
  tokens are the target's own greedy tokens (so exactly a are accepted), the verifier's chunk history
  primed with paths of a + 1 nodes (as it would be after steps like this one): the pass, the head calls
  and the walk.

Reported: medians over rounds of ms per pass and of the per-round ratios to the 1-node decode step
(``full 1``). Writes benchmarks/results/lazy_verify_<date>.json (load average recorded).
"""
from __future__ import annotations

import argparse
import datetime as _dt
import json
import statistics
import sys
import time
from collections import deque
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from specdec.bench.record import cpu_name, git_commit, loadavg  # noqa: E402

PREFIX = 150


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--precision", default="q4_1")
    ap.add_argument("--act", default="q8", choices=["q8", "none"])
    ap.add_argument("--nodes", default="2,4,8,16")
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    import specdec
    from specdec import ops
    from specdec.lazy_verify import LazyGreedyVerify
    from specdec.models import load_bundled
    from specdec.tree import TokenTree

    model, _ = load_bundled("smollm2-135m", precision=a.precision, act=None if a.act == "none" else a.act)
    lm = specdec.HFCausalLM(model)
    assert lm.lazy_head, "the lean forward with a batch-invariant head is needed"
    cache = lm.new_cache(1, 512)
    prefix = list(range(1, PREFIX + 1))
    lm.prefill(cache, [prefix])
    # the target's own greedy continuation of the prefix: a chain drafted from it is accepted as far as it copies
    greedy, c2 = [], lm.new_cache(1, 512)
    logits = lm.prefill(c2, [prefix])
    for _ in range(17):
        t = int(logits[0].argmax())
        greedy.append(t)
        logits = lm.forward(c2, torch.tensor([[t]]), torch.zeros(1, 1, dtype=torch.int32))[0]
        c2.lens += 1
    nodes = [int(x) for x in a.nodes.split(",")]
    cases = {"full 1": ("full", 1, 0), "argmax 1": ("argmax", 1, 0)}
    for n in nodes:
        cases[f"full {n}"] = ("full", n, 0)
        cases[f"argmax {n}"] = ("argmax", n, 0)
        for c in sorted({3, n} if n > 3 else {n}):
            cases[f"hidden {n} + head {c}"] = ("hidden", n, c)
        for acc in sorted({0, min(2, n - 1), n - 1}):
            cases[f"lazy {n}, {acc} accepted"] = ("lazy", n, acc)

    def chain(n: int, acc: int) -> TokenTree:
        # root = the prefix's next token (greedy[0]); node j >= 1 drafts greedy[j] while j <= acc, then a miss
        toks = [greedy[0]] + [greedy[j] if j <= acc else (greedy[j] + 1) % lm.vocab_size for j in range(1, n)]
        return TokenTree(torch.tensor([toks]), torch.arange(-1, n - 1, dtype=torch.int32)[None],
                         torch.arange(n, dtype=torch.int32)[None], [n], is_chain=True)

    trees = {k: chain(n, acc) for k, (kind, n, acc) in cases.items() if kind == "lazy"}
    verifiers = {k: LazyGreedyVerify() for k in trees}
    for k, (kind, n, acc) in cases.items():
        if kind == "lazy":
            verifiers[k]._history["r"] = deque([acc + 1] * 16, maxlen=16)
            got = verifiers[k](lm, cache, trees[k], ["r"])[1]
            assert int(got[0]) == acc, (k, int(got[0]))

    parents_of = {n: torch.arange(-1, n - 1, dtype=torch.int32)[None] for n in [1] + nodes}

    def run(key):
        kind, n, c = cases[key]
        tk, dep = torch.zeros(1, n, dtype=torch.long), torch.arange(n, dtype=torch.int32)[None]
        if kind == "full":
            lm.forward(cache, tk, dep)
        elif kind == "argmax":
            ops.greedy_verify(tk, parents_of[n], lm.forward_argmax(cache, tk, dep))
        elif kind == "hidden":
            h = lm.forward_hidden(cache, tk, dep)
            lm.head_logits(h[0, :c])
        else:
            v = verifiers[key]
            v._history["r"] = deque([c + 1] * 16, maxlen=16)
            v(lm, cache, trees[key], ["r"])

    times = {k: [] for k in cases}
    load = [loadavg()]
    for r in range(a.rounds + 1):  # round 0 warms up
        for k in cases:
            t0 = time.perf_counter()
            for _ in range(a.reps):
                run(k)
            if r:
                times[k].append((time.perf_counter() - t0) / a.reps)
        if r:
            print(f"round {r}: " + ", ".join(f"{k} {times[k][-1] * 1e3:.2f}" for k in cases), flush=True)
    load.append(loadavg())
    ms = {k: round(statistics.median(v) * 1e3, 3) for k, v in times.items()}
    ratio = {k: round(statistics.median(x / y for x, y in zip(v, times["full 1"])), 3) for k, v in times.items()}
    for k in cases:
        print(f"{k:28s} {ms[k]:7.3f} ms  {ratio[k]:.3f}x the decode step")
    rows = {k: verifiers[k].rows / max(1, verifiers[k].steps) for k in verifiers}
    res = {"benchmark": "lazy_verify", "date": _dt.date.today().isoformat(), "commit": git_commit(),
           "cpu": cpu_name(), "threads": a.threads, "precision": a.precision, "act": a.act, "prefix": PREFIX,
           "rounds": a.rounds, "reps": a.reps, "loadavg": load, "ms": ms, "ratio_to_decode_step": ratio,
           "head_rows_per_lazy_pass": rows,
           "notes": "full N: forward of N chain nodes (head on every row); hidden N + head c: forward_hidden then "
                    "the head on c rows; lazy N, a accepted: LazyGreedyVerify on a chain whose first a drafts are "
                    "the target's greedy tokens, its history primed with paths of a + 1 nodes; ratios: medians "
                    "of per-round ratios to full 1 (the decode step), all interleaved in one process"}
    path = Path(a.out) if a.out else ROOT / "benchmarks" / "results" / f"lazy_verify_{res['date']}.json"
    path.write_text(json.dumps(res, indent=1))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
