"""A feature head with prefix caching: requests that share a long context, one after another, batch 1, greedy.

The paged engine keeps the target's hidden states in its blocks, so a request whose prompt starts with a cached
prefix skips the target's prefill of it AND finds there the states the head's own prompt prefill reads. Against
the dense engine (every prompt prefilled whole), with plain decoding on both layouts beside. The context is the
four texts of the benchmark workloads (a passage, code, an e-mail, a table) followed by a different instruction
per request (no request repeats an earlier one, so only the shared context can hit). Methods run interleaved per
request after an untimed warm-up on an unrelated prompt; each output is checked token-identical to plain decoding
on the dense layout. Recorded per method: time to first token (median), tokens/s over the request (prefill
included), mean accepted length, and on the paged layout the prompt tokens served from the cache.

    python benchmarks/bench_head_prefix.py --head DIR [--requests 12] [--max-new-tokens 64]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
from datetime import date

import torch

from specdec import SpeculativeDecoder
from specdec.bench.record import cpu_name, git_commit, loadavg, record_path, write_record
from specdec.bench.workloads import CODE, CSV, EMAIL, PASSAGE, chat_ids
from specdec.drafters import EagleHead
from specdec.drafters.eagle import load_head
from specdec.models import HFCausalLM
from specdec.models.bundled import load_bundled

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
CONTEXT = "\n\n".join((PASSAGE, CODE, EMAIL, CSV))
INSTRUCTIONS = [
    "Summarise the passage about the reef above in two sentences.",
    "What does the function apply_discount above do? Answer briefly.",
    "Who wrote the e-mail above, and what does it propose?",
    "Which person in the table above is the oldest?",
    "List three facts from the passage above.",
    "Rewrite the function compute_total above with a docstring.",
    "Reply to the e-mail above, accepting the proposal.",
    "Convert the table above to a bulleted list.",
    "Which city appears in the table above for Bob?",
    "Explain the error the code above raises and when.",
    "Give the passage above a title.",
    "Translate the first sentence of the e-mail above into French.",
]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--head", required=True, help="head folder (specdec train-head --out DIR: DIR/head)")
    ap.add_argument("--requests", type=int, default=12)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--name", default=None)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    model, tok = load_bundled(precision="q4_1", act="q8")
    net = load_head(args.head)
    prompts = [chat_ids(tok, f"{CONTEXT}\n\n{q}") for q in INSTRUCTIONS[:args.requests]]
    shared = next(i for i, (a, b) in enumerate(zip(prompts[0], prompts[1])) if a != b)

    def head():
        return EagleHead(net, k=1, top_k=2, precision="q8_0", act="q8")   # the CLI's default head shape

    methods = {"plain_dense": (None, "dense"), "plain_paged": (None, "paged"),
               "head_dense": (head, "dense"), "head_paged": (head, "paged")}
    decoders = {n: SpeculativeDecoder(HFCausalLM(model), make() if make else None, max_batch=1, max_len=1024,
                                      policy="fixed", kv_cache=kv) for n, (make, kv) in methods.items()}
    warm = chat_ids(tok, "Name three colours.")
    for dec in decoders.values():
        dec.generate([warm], max_new_tokens=8, eos_token_id=tok.eos_token_id)
    runs = []
    load = [loadavg()]
    for i, p in enumerate(prompts):
        ref = None
        for n, dec in decoders.items():
            kv = dec.engine.kv
            hits0 = kv.counters["prefix_hit_tokens"] if kv.paged else 0
            out = dec.generate([p], max_new_tokens=args.max_new_tokens, eos_token_id=tok.eos_token_id)
            m = out.metrics
            if ref is None:
                ref = out.tokens
            runs.append(dict(method=n, request=i, prompt_tokens=len(p), ttft_seconds=m["ttft_seconds"],
                             tokens_per_second=m["tokens_per_second"], new_tokens=m["new_tokens"],
                             mean_accepted_length=m["mean_accepted_length"],
                             prefix_hit_tokens=(kv.counters["prefix_hit_tokens"] - hits0) if kv.paged else 0,
                             identical=out.tokens == ref))
            print(f"request {i} {n:12s} ttft {m['ttft_seconds'] * 1e3:7.1f} ms  {m['tokens_per_second']:7.2f} tok/s  "
                  f"cached {runs[-1]['prefix_hit_tokens']}/{len(p)}", flush=True)
    load.append(loadavg())
    summary = {}
    for n in methods:
        rs = [r for r in runs if r["method"] == n]
        summary[n] = dict(median_ttft_ms=statistics.median(r["ttft_seconds"] for r in rs) * 1e3,
                          median_tokens_per_second=statistics.median(r["tokens_per_second"] for r in rs),
                          mean_accepted_length=statistics.mean(r["mean_accepted_length"] for r in rs),
                          prompt_tokens_cached=sum(r["prefix_hit_tokens"] for r in rs) / sum(r["prompt_tokens"]
                                                                                              for r in rs),
                          all_identical=all(r["identical"] for r in rs))

    def ratio(a, b, key):
        xs = [x[key] / y[key] for x in runs for y in runs if x["method"] == a and y["method"] == b and
              x["request"] == y["request"]]
        return statistics.median(xs)

    summary["ratios"] = {f"{a}/{b} {key}": ratio(a, b, key)
                         for a, b in (("head_paged", "head_dense"), ("plain_paged", "plain_dense"),
                                      ("head_paged", "plain_paged"), ("head_dense", "plain_dense"))
                         for key in ("ttft_seconds", "tokens_per_second")}
    rec = dict(benchmark="head_prefix", args=dict(vars(args), head=record_path(args.head)), commit=git_commit(),
               cpu=cpu_name(), loadavg=load, torch_threads=args.threads, shared_prefix_tokens=shared,
               summary=summary, runs=runs,
               notes="2 shared CPU cores (load average recorded); greedy, batch 1, requests one after another; the "
                     "target at q4_1 with q8 activations, the head q8_0 with q8 activations (k 1, two siblings), "
                     "fixed policy; medians over the requests; ratios per request, then their median")
    print(json.dumps(summary, indent=1))
    write_record(RESULTS, args.name or f"head_prefix_{date.today().isoformat()}", rec)


if __name__ == "__main__":
    main()
