"""How many tokens per target pass can TokenRecycling accept at all on a prompt set, whatever its tree?

The drafters issue asks TokenRecycling for >= 1.2x plain tokens/s on open-ended chat. A target
pass over a tree never costs less than a plain pass, so that needs >= 1.2 tokens per pass from
the drafter's trees alone (more, since a tree pass costs more on the CPU). This script runs the
real loop (SmolLM2-135M-Instruct, fp32, greedy, batch 1, policy fixed: every step drafts) with
TokenRecycling templates from the default (12 nodes, depth 6) up to FULL top-w trees (every
node of a w-ary tree down to depth d: 1 + w + w^2 + ... nodes), after the same warm-up requests
as bench_memory_drafters.py, and reports the mean accepted length per target pass and the
acceptance per drafted token. A full w-ary tree accepts a superset of what any template of the
same table width and depth accepts at the same step, so its mean accepted length bounds every
template's (the states the runs reach differ slightly: every run still emits the target's own
greedy text, checked against plain decoding). Tokens/s is recorded too (the big trees are slow
on the CPU, as expected: the bound is about acceptance, not speed).

Writes benchmarks/results/recycling_ceiling_<date>.json.
Run: python benchmarks/recycling_ceiling.py [--sets open,repetitive] [--max-new-tokens 64]
"""
from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from bench_e2e import cpu_name, git_commit  # noqa: E402
from bench_memory_drafters import load_workload  # noqa: E402
from specdec.decoding import SpeculativeDecoder  # noqa: E402
from specdec.drafters import TokenRecycling  # noqa: E402

# (name, top_w, node_budget, max_depth); node_budget = 1 + w + ... + w^d makes the full tree
TEMPLATES = [("default_12", 4, 12, 6), ("full_w2_d6", 2, 127, 6), ("full_w4_d3", 4, 85, 3),
             ("full_w4_d4", 4, 341, 4), ("full_w8_d2", 8, 73, 2)]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sets", default="open,repetitive")
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--templates", default=",".join(t[0] for t in TEMPLATES))
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    load_start = os.getloadavg()
    t0 = time.perf_counter()
    sets = args.sets.split(",")
    target, tok, prompt_sets, warm_sets, max_len = load_workload(sets, 6, args.max_new_tokens)
    eos = tok.eos_token_id
    chosen = [t for t in TEMPLATES if t[0] in args.templates.split(",")]
    results = {}
    for s in sets:
        prompts, warm = prompt_sets[s], warm_sets[s]
        plain = SpeculativeDecoder(target, None, max_batch=1, max_len=max_len)
        refs = [plain.generate([p], max_new_tokens=args.max_new_tokens, eos_token_id=eos).tokens[0] for p in prompts]
        results[s] = {}
        for name, w, n, d in chosen:
            rec = TokenRecycling(top_w=w, node_budget=n, max_depth=d)
            dec = SpeculativeDecoder(target, rec, max_batch=1, max_len=max_len, policy="fixed")
            for p in warm:   # the table learns from the warm-up requests, as in bench_memory_drafters.py
                dec.generate([p], max_new_tokens=args.max_new_tokens, eos_token_id=eos)
            tokens = passes = drafted = accepted = 0
            secs = 0.0
            same = 0
            for p, ref in zip(prompts, refs):
                t = time.perf_counter()
                out = dec.generate([p], max_new_tokens=args.max_new_tokens, eos_token_id=eos)
                secs += time.perf_counter() - t
                m = out.metrics
                tokens += len(out.tokens[0])
                passes += m["target_passes"]
                drafted += m["drafted_tokens"]
                accepted += m["accepted_tokens"]
                same += out.tokens[0] == ref
            results[s][name] = dict(top_w=w, node_budget=rec.max_nodes, max_depth=d, new_tokens=tokens,
                                    target_passes=passes, mean_accepted_length=(accepted + passes) / passes,
                                    accepted_per_pass=accepted / passes, acceptance_rate=accepted / max(1, drafted),
                                    drafted_per_pass=drafted / passes, tokens_per_second=tokens / secs,
                                    same_output_as_plain=same, runs=len(prompts))
            r = results[s][name]
            print(f"{s:<11} {name:<11} nodes {rec.max_nodes:>3}  mean accepted length {r['mean_accepted_length']:.3f}  "
                  f"accept {100 * r['acceptance_rate']:5.1f}%  drafted/pass {r['drafted_per_pass']:6.1f}  "
                  f"{r['tokens_per_second']:6.1f} tok/s  same {same}/{len(prompts)}  "
                  f"({time.perf_counter() - t0:.0f} s)", flush=True)
    out = Path(args.out) if args.out else ROOT / "benchmarks" / "results" / \
        f"recycling_ceiling_{_dt.date.today().isoformat()}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(dict(
        benchmark="recycling_ceiling", date=_dt.datetime.now().isoformat(timespec="seconds"), git_commit=git_commit(),
        machine=dict(cpu=cpu_name(), cores=os.cpu_count(), torch_threads=torch.get_num_threads(),
                     loadavg_start=load_start, loadavg_end=os.getloadavg()),
        settings=dict(model="smollm2-135m (SmolLM2-135M-Instruct, fp32)", greedy=True, batch=1, policy="fixed",
                      max_new_tokens=args.max_new_tokens, templates=chosen,
                      warmup="the set's warm-up requests of bench_memory_drafters.py"),
        results=results, total_seconds=time.perf_counter() - t0), indent=1))
    print(f"wrote {out} ({time.perf_counter() - t0:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
