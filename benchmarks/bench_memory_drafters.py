"""Free drafters that remember: SuffixDrafter (cold / warm global cache), TokenRecycling, DocumentDrafter.

SmolLM2-135M-Instruct on the CPU, greedy, batch 1, chat template, stop at EOS or --max-new-tokens.
Every method runs every prompt once per round, in an order rotated from prompt to prompt
(interleaved: drifts of a shared machine hit all methods alike); ratios are the MEDIAN over
prompts of the per-prompt tokens/s ratio (and the ratio of total tokens/s, reported too).

Methods
  plain        SpeculativeDecoder(target, None)
  lookup       PromptLookup(ngram=3, k=10) (min_ngram 2): the free drafter on main
  suffix_cold  SuffixDrafter, global cache cleared before every request (per-request index only)
  suffix_warm  SuffixDrafter whose global cache has seen the set's warm-up requests (below) and keeps
               every request it serves (a cache, as in serving); it never sees a timed prompt before its run
               (every round starts it afresh from the warm-up requests: the same prompts run every round)
  recycle      TokenRecycling (top_w 4, 12-node template, depth 6); its table is filled by the warm-up
               requests and keeps learning (one table per model)
  docs         DocumentDrafter over a document store (below)
  multi        MultiDraft([SuffixDrafter, TokenRecycling], escalate=1): the free drafters composed, cheapest
               signal first: the suffix drafter (warm global cache, as suffix_warm) drafts where it is trusted,
               token recycling drafts the rows where it is not (its table learns from every verify pass, whoever
               drafted); warmed up and restarted every round like the other stateful drafters

Prompt sets (all built here, see the JSON for the texts)
  grounded     the answer copies from the input (bench_e2e.py's GROUNDED: repeat, rename, rewrite, reformat)
  open         open-ended chat (bench_e2e.py's OPEN)
  repetitive   the same templated tasks asked again with small variations: SQL for a customer table with a
               different city / column, the same function renamed to different names, a status e-mail for a
               different person. The warm-up requests are OTHER variants of the same templates (so the warm
               cache holds related, never identical, requests)

Warm-up: every method first runs the set's first warm-up prompt (first-call allocations); the stateful
drafters (suffix_warm, recycle, multi) run all of the set's warm-up prompts and learn from them as from
live traffic. Document store: the source texts of the grounded prompts,
a reference SQL query and a short style guide (what a user would paste into a retriever).

Drafter overhead: host time spent in propose + observe_verify + accept per target step, against the
time of that step's target forward + verification (the clock of the same run), at batch 1 (the timed
runs) and at batch 8 (one extra call per method on 8 repetitive / grounded prompts).

Writes benchmarks/results/memory_drafters_<date>.json (git commit, machine, load averages, settings,
per-run numbers, greedy equality with plain).
"""
from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Dict, List

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from bench_e2e import GROUNDED, OPEN, cpu_name, encode, git_commit  # noqa: E402
from specdec.bench import CODE, CSV, EMAIL, PASSAGE  # noqa: E402  (the texts live in the package)
from specdec.decoding import SpeculativeDecoder  # noqa: E402
from specdec.drafters import DocumentDrafter, MultiDraft, PromptLookup, SuffixDrafter, TokenRecycling  # noqa: E402
from specdec.models.bundled import load_bundled  # noqa: E402
from specdec.models.hf import HFCausalLM  # noqa: E402

SQL = ("Write a SQL query on the table customers(id, name, email, city, created_at) that returns the {col} of "
       "every customer living in {city}, newest first. Output only the query.")
RENAME = ("Rename the function compute_total to {name} in this code and output the full code:\n\n" + CODE)
STATUS = ("Write a short status e-mail to {who} saying that the quarterly report is finished, the budget "
          "spreadsheet is attached, and the review meeting is on {day} at 10am.")

REPETITIVE = [SQL.format(col="name and email", city="Paris"), RENAME.format(name="sum_prices"),
              STATUS.format(who="Sarah", day="Friday"), SQL.format(col="name", city="Madrid"),
              RENAME.format(name="total_cost"), STATUS.format(who="Tom", day="Tuesday")]
REPETITIVE_WARM = [SQL.format(col="email", city="Berlin"), RENAME.format(name="price_sum"),
                   STATUS.format(who="Anna", day="Monday"), SQL.format(col="name and city", city="Rome")]
GROUNDED_WARM = [f"Repeat the following text exactly:\n\n{EMAIL}", f"Output this code unchanged:\n\n{CODE}"]
OPEN_WARM = ["Write a short poem about autumn leaves.", "What is the difference between weather and climate?",
             "Give me three ideas for a birthday party."]

DOCS = [PASSAGE, CODE, EMAIL, CSV,
        "SELECT name, email FROM customers WHERE city = 'London' ORDER BY created_at DESC;",
        "Style guide: write short sentences. Use the active voice. Put the main point first. "
        "Close every e-mail with 'Best regards,' and your name."]

TEXTS = {"repetitive": REPETITIVE, "grounded": GROUNDED, "open": OPEN}
WARM_TEXTS = {"repetitive": REPETITIVE_WARM, "grounded": GROUNDED_WARM, "open": OPEN_WARM}


def time_drafter(drafter, acc: List[float]) -> None:
    """Add the host seconds of the drafter's propose / observe_verify / accept calls to acc[0]."""
    for meth in ("propose", "observe_verify", "accept"):
        f = getattr(drafter, meth)

        def timed(*a, _f=f, **k):
            t = time.perf_counter()
            try:
                return _f(*a, **k)
            finally:
                acc[0] += time.perf_counter() - t
        setattr(drafter, meth, timed)


def load_workload(sets: List[str], n_prompts: int, max_new_tokens: int):
    """The bundled target (lean forward) and the prompt sets: (target, tokenizer, prompts per set, warm-up
    prompts per set, a max_len that fits them all)."""
    model, tok = load_bundled("smollm2-135m")[:2]
    target = HFCausalLM(model, fast_linear=True)
    prompts = {s: [encode(tok, t) for t in TEXTS[s][:n_prompts]] for s in sets}
    warm = {s: [encode(tok, t) for t in WARM_TEXTS[s]] for s in sets}
    max_len = max(len(p) for ps in list(prompts.values()) + list(warm.values()) for p in ps) + max_new_tokens + 8
    return target, tok, prompts, warm, max_len


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--sets", default="repetitive,grounded,open")
    ap.add_argument("--methods", default="plain,lookup,suffix_cold,suffix_warm,recycle,docs,multi")
    ap.add_argument("--prompts", type=int, default=6, help="prompts per set (at most 6)")
    ap.add_argument("--batch8", action="store_true", help="also measure drafter overhead at batch 8")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    load_start = os.getloadavg()
    t0 = time.perf_counter()
    sets = args.sets.split(",")
    target, tok, prompts, warm, max_len = load_workload(sets, args.prompts, args.max_new_tokens)
    eos = tok.eos_token_id

    def make(name: str):
        return {"plain": lambda: None, "lookup": lambda: PromptLookup(ngram=3, k=10),
                "suffix_cold": SuffixDrafter, "suffix_warm": SuffixDrafter, "recycle": TokenRecycling,
                "docs": lambda: DocumentDrafter(DOCS, tokenizer=tok),
                "multi": lambda: MultiDraft([SuffixDrafter(), TokenRecycling()], escalate=1.0)}[name]()

    names = args.methods.split(",")
    # host time of the drafter's own calls, per decoder (instance attributes, no global patching)
    host_time: Dict[tuple, List[float]] = {}

    def build(n: str, s: str) -> SpeculativeDecoder:
        dec = SpeculativeDecoder(target, make(n), max_batch=8, max_len=max_len)
        if dec.drafter is not None:
            time_drafter(dec.drafter, host_time.setdefault((n, s), [0.0]))
        return dec

    # one decoder per (method, set): the warm state of a set does not leak into another set
    decoders = {(n, s): build(n, s) for n in names for s in sets}

    def run(name: str, s: str, ids: List[int]) -> dict:
        dec = decoders[(name, s)]
        if name == "suffix_cold":
            dec.drafter.clear_cache()
        h0 = host_time.get((name, s), [0.0])[0]
        t = time.perf_counter()
        out = dec.generate([ids], max_new_tokens=args.max_new_tokens, eos_token_id=eos)
        secs = time.perf_counter() - t
        m = out.metrics
        return dict(tokens=out.tokens[0], seconds=secs, drafted=m["drafted_tokens"], accepted=m["accepted_tokens"],
                    passes=m["target_passes"], verify_seconds=m["verify_seconds"],
                    host_seconds=host_time.get((name, s), [0.0])[0] - h0)

    print(f"loaded in {time.perf_counter() - t0:.1f} s; threads {torch.get_num_threads()}; load {load_start}")
    stateful = [n for n in names if n in ("suffix_warm", "recycle", "multi")]

    def warm_up(s: str, methods: List[str], first_only: List[str]) -> None:
        # the stateful drafters learn from the set's warm-up requests; the others only warm up
        for j, ids in enumerate(warm[s]):
            for n in methods:
                if n not in first_only or j == 0:
                    run(n, s, ids)

    for s in sets:
        warm_up(s, names, [n for n in names if n not in stateful])
    print(f"warm-up done ({time.perf_counter() - t0:.0f} s)", flush=True)

    records: Dict[str, Dict[str, List[dict]]] = {s: {n: [] for n in names} for s in sets}
    for r in range(args.rounds):
        if r > 0 and stateful:
            # every round starts the stateful drafters afresh from the warm-up requests alone: a round
            # after the first would otherwise find the very request it serves in the cache (the same
            # prompts run every round). Within a round they keep what they serve, as in serving.
            for s in sets:
                for n in stateful:
                    decoders[(n, s)] = build(n, s)
                warm_up(s, stateful, [])
        for s in sets:
            for i, ids in enumerate(prompts[s]):
                shift = (i + r) % len(names)
                for n in names[shift:] + names[:shift]:
                    x = run(n, s, ids)
                    x.update(prompt=i, round=r)
                    records[s][n].append(x)
                print(f"  [{s} {i + 1}/{len(prompts[s])} round {r + 1}] {time.perf_counter() - t0:.0f} s "
                      f"load {os.getloadavg()[0]:.1f}", flush=True)

    summary: Dict[str, dict] = {}
    for s in sets:
        summary[s] = {}
        ref = {(x["prompt"], x["round"]): x["tokens"] for x in records[s].get("plain", [])}
        for n in names:
            rows = records[s][n]
            ntok = sum(len(x["tokens"]) for x in rows)
            secs = sum(x["seconds"] for x in rows)
            drafted = sum(x["drafted"] for x in rows)
            accepted = sum(x["accepted"] for x in rows)
            passes = sum(x["passes"] for x in rows)
            verify = sum(x["verify_seconds"] for x in rows)
            host = sum(x["host_seconds"] for x in rows)
            summary[s][n] = dict(
                new_tokens=ntok, seconds=secs, tokens_per_second=ntok / secs, acceptance_rate=
                accepted / drafted if drafted else 0.0, mean_accepted_length=(accepted + passes) / passes,
                drafted_per_pass=drafted / passes, target_passes=passes,
                drafter_host_seconds_per_step=host / passes, target_seconds_per_step=verify / passes,
                drafter_overhead_fraction=host / verify if verify else 0.0,
                same_output_as_plain=sum(x["tokens"] == ref[(x["prompt"], x["round"])] for x in rows) if ref else None,
                runs=len(rows))
        per_prompt = {}
        for n in names:
            for x in records[s][n]:
                per_prompt.setdefault((x["prompt"], x["round"]), {})[n] = len(x["tokens"]) / x["seconds"]

        def med(a, b):
            v = [d[a] / d[b] for d in per_prompt.values() if a in d and b in d]
            return statistics.median(v) if v else None
        ratios = {}
        for a in names:
            for b in ("plain", "lookup"):
                if a != b and b in names:
                    ratios[f"{a}/{b}"] = dict(median_per_prompt=med(a, b), total=summary[s][a]["tokens_per_second"] /
                                              summary[s][b]["tokens_per_second"])
        summary[s]["ratios"] = ratios
        print(f"\n== {s}: {len(prompts[s])} prompts x {args.rounds} rounds, <= {args.max_new_tokens} tokens, greedy, "
              f"batch 1")
        print(f"{'method':<12} {'tok/s':>7} {'accept':>7} {'mean len':>8} {'drafts/pass':>11} {'overhead':>8} "
              f"{'vs plain':>8} {'vs lookup':>9} {'same':>5}")
        for n in names:
            row = summary[s][n]
            vp = ratios.get(f"{n}/plain", {}).get("median_per_prompt")
            vl = ratios.get(f"{n}/lookup", {}).get("median_per_prompt")
            print(f"{n:<12} {row['tokens_per_second']:7.2f} {100 * row['acceptance_rate']:6.1f}% "
                  f"{row['mean_accepted_length']:8.2f} {row['drafted_per_pass']:11.2f} "
                  f"{100 * row['drafter_overhead_fraction']:7.2f}% {(f'{vp:.2f}x' if vp else '-'):>8} "
                  f"{(f'{vl:.2f}x' if vl else '-'):>9} {row['same_output_as_plain']}/{row['runs']}")

    batch8 = {}
    if args.batch8:
        b8 = [encode(tok, t) for t in (REPETITIVE + GROUNDED)[:8]]
        for n in names:
            if n == "plain":
                continue
            dec = SpeculativeDecoder(target, make(n), max_batch=8, max_len=max(len(p) for p in b8) +
                                     args.max_new_tokens + 8)
            acc = [0.0]
            time_drafter(dec.drafter, acc)
            dec.generate(b8[:2], max_new_tokens=4, eos_token_id=eos)
            acc[0] = 0.0
            out = dec.generate(b8, max_new_tokens=args.max_new_tokens // 2, eos_token_id=eos)
            m = out.metrics
            batch8[n] = dict(drafter_host_seconds=acc[0], verify_seconds=m["verify_seconds"],
                             steps=max(m["per_request"]["target_passes"]),
                             drafter_overhead_fraction=acc[0] / m["verify_seconds"])
            print(f"batch 8 {n:<12} drafter overhead {100 * batch8[n]['drafter_overhead_fraction']:.2f}% of the "
                  f"target's forward + verify time")

    out = Path(args.out) if args.out else ROOT / "benchmarks" / "results" / \
        f"memory_drafters_{_dt.date.today().isoformat()}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    result = dict(
        benchmark="memory_drafters", date=_dt.datetime.now().isoformat(timespec="seconds"), git_commit=git_commit(),
        machine=dict(cpu=cpu_name(), cores=os.cpu_count(), torch_threads=torch.get_num_threads(),
                     torch=torch.__version__, python=platform.python_version(), loadavg_start=load_start,
                     loadavg_end=os.getloadavg(),
                     note="2 shared cores: other processes ran at the same time; see the load averages"),
        settings=dict(model="smollm2-135m (SmolLM2-135M-Instruct, fp32, fast_linear)", greedy=True, batch=1,
                      max_new_tokens=args.max_new_tokens, rounds=args.rounds,
                      drafters={n: repr(make(n)) for n in names}),
        prompts={s: TEXTS[s][:args.prompts] for s in sets}, warmup_prompts={s: WARM_TEXTS[s] for s in sets},
        documents=DOCS, summary=summary, batch8=batch8,
        runs={s: {n: [{k: v for k, v in x.items() if k != "tokens"} | dict(new_tokens=len(x["tokens"]))
                      for x in records[s][n]] for n in names} for s in sets},
        total_seconds=time.perf_counter() - t0)
    out.write_text(json.dumps(result, indent=1))
    print(f"\nwrote {out} ({time.perf_counter() - t0:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
