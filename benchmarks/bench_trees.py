"""Token trees on the bundled SmolLM2-135M-Instruct: chain vs spine vs dynamic tree, and MultiDraft.

Every configuration runs every group of prompts (a ragged batch of --batch requests, default 4:
on a loaded shared CPU this is what fits the time; mean accepted length does not depend on the
batch, tokens/s is batch throughput), in an order rotated from group to group (interleaved, so
drifts of the machine hit all configurations alike), greedy and temperature 1.0 (fixed seeds). Node budgets
8 / 16 / 32 (root included):

  chain_N      DraftModel(draft, k=N-1)                                   (N nodes, k draft forwards)
  spine_N      DraftModel(draft, k, top_k=w, node_budget=N)               w = 2 / 3 / 3 (spine + sibling leaves)
  dynamic_N    DraftModel(draft, k, top_k=w, node_budget=N, tree="dynamic")  (k, w) = (5, 2) / (10, 2) / (10, 4)
               (16 and 32 nodes: the best of a shape sweep with the int8 draft on the open AND the
               grounded prompts, see README; before 2026-12-03 (6, 3) / (8, 4))
  dynraw_N     the same dynamic tree ranked by draft probability alone (calibrate=False, EAGLE-2)
  deep_N       DraftModel(draft, k, top_k=2, node_budget=N, tree="dynamic"), k = 7 / 12 / 20: a deep
               dynamic tree (the calibrated ranking decides between spine and siblings)
  planned_N    DraftModel(draft, k, top_k=w, node_budget=N, tree="planned"), (k, w) = (10, 2) / (10, 2) / (10, 4):
               a Sequoia-style shape planned from per-rank acceptance, children the draft's top-ranked tokens
  chain_5      DraftModel(draft, k=4): a short chain, for the best-chain tokens/s
for the int8 (dynamic-quantized) and w8 (weight-only int8, specdec.ops.linear) drafts, plus
  lookup       PromptLookup(ngram=3, k=10)
  w8_dynamic_16 + lookup: multi_w8_lookup = MultiDraft([w8 dynamic_16, lookup])
  lookup + w8_chain_5:    multi_lookup_w8_esc = MultiDraft([lookup, w8 chain_5], escalate=2.0)
                          (the w8 chain drafts only for rows where lookup is not trusted)
  plain        no drafter (one target pass per token)

Reported per configuration, mode and prompt set: mean accepted length (tokens emitted per target
pass per request, bonus included: (accepted + request-steps) / request-steps), tokens/s, and the issue's
targets as ratios measured in this run. The JSON
(benchmarks/results/trees_<date>.json) records the git commit, the machine, the load average at
start and end, settings and every number.
"""
from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import sys
import time
from pathlib import Path
from typing import Dict, List

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from bench_e2e import GROUNDED, OPEN, cpu_name, encode, git_commit  # noqa: E402
from specdec.bench import record_path as _record_path  # noqa: E402

from specdec.decoding import SpeculativeDecoder  # noqa: E402
from specdec.drafters import DraftModel, MultiDraft, PromptLookup  # noqa: E402
from specdec.models.bundled import load_bundled  # noqa: E402
from specdec.models.hf import HFCausalLM  # noqa: E402

BUDGETS = (8, 16, 32)
SPINE_W = {8: 2, 16: 3, 32: 3}
DYNAMIC_KW = {8: (5, 2), 16: (10, 2), 32: (10, 4)}
DEEP_K = {8: 7, 16: 12, 32: 20}
PLANNED_KW = {8: (10, 2), 16: (10, 2), 32: (10, 4)}


def make_drafters(drafts: Dict[str, HFCausalLM], only: List[str]) -> Dict[str, object]:
    out: Dict[str, object] = {"plain": None, "lookup": PromptLookup(ngram=3, k=10)}
    for name, lm in drafts.items():
        out[f"{name}_chain_5"] = DraftModel(lm, k=4)
        for n in BUDGETS:
            out[f"{name}_chain_{n}"] = DraftModel(lm, k=n - 1)
            w = SPINE_W[n]
            out[f"{name}_spine_{n}"] = DraftModel(lm, k=(n - 1) // w, top_k=w, node_budget=n)
            k, w = DYNAMIC_KW[n]
            out[f"{name}_dynamic_{n}"] = DraftModel(lm, k=k, top_k=w, node_budget=n, tree="dynamic")
            out[f"{name}_dynraw_{n}"] = DraftModel(lm, k=k, top_k=w, node_budget=n, tree="dynamic", calibrate=False)
            k = DEEP_K[n]
            out[f"{name}_deep_{n}"] = DraftModel(lm, k=k, top_k=2, node_budget=n, tree="dynamic")
            k, w = PLANNED_KW[n]
            out[f"{name}_planned_{n}"] = DraftModel(lm, k=k, top_k=w, node_budget=n, tree="planned")
    k, w = DYNAMIC_KW[16]
    out["multi_w8_lookup"] = MultiDraft([DraftModel(drafts["w8"], k=k, top_k=w, node_budget=16, tree="dynamic"),
                                         PromptLookup(ngram=3, k=10)])
    # cheapest first with escalation: the w8 chain drafts only for rows where lookup is not trusted
    out["multi_lookup_w8_esc"] = MultiDraft([PromptLookup(ngram=3, k=10), DraftModel(drafts["w8"], k=4)],
                                            escalate=2.0)
    if only:
        out = {k: v for k, v in out.items() if k in only}
    return out


def ratio(a: float, b: float) -> float:
    return float("nan") if not b else a / b


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--max-new-tokens", type=int, default=32)
    ap.add_argument("--prompts", type=int, default=4, help="prompts per set (open, grounded)")
    ap.add_argument("--batch", type=int, default=4, help="requests per generate call (ragged batch)")
    ap.add_argument("--modes", default="greedy,sample")
    ap.add_argument("--only", default="", help="comma list of configurations (default all)")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--warmup", type=int, default=1, help="1: one short generate per configuration first")
    ap.add_argument("--seeds", type=int, default=1,
                    help="sampling: generate calls per group, each with its own seed (mean accepted length under "
                         "sampling is noisy: ~150 request-steps per call at --prompts 6 --batch 6)")
    ap.add_argument("--grounded", default="", help="comma list: only these configurations run the grounded set")
    ap.add_argument("--policy", default="fixed", choices=["fixed", "goodput", "heuristic"],
                    help="step policy (default fixed: every step drafts the configuration's full shape)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    if args.seeds < 1:
        ap.error(f"--seeds must be >= 1, got {args.seeds}")
    if args.threads:
        torch.set_num_threads(args.threads)
    load_start = os.getloadavg()
    t_start = time.perf_counter()
    model, tok, int8_model = load_bundled("smollm2-135m", draft="int8")
    _, _, w8_model = load_bundled("smollm2-135m", draft="w8")
    target = HFCausalLM(model)
    drafts = {"int8": HFCausalLM(int8_model), "w8": HFCausalLM(w8_model)}
    eos = tok.eos_token_id
    sets = {"open": [encode(tok, t) for t in OPEN[:args.prompts]],
            "grounded": [encode(tok, t) for t in GROUNDED[:args.prompts]]}
    max_len = max(len(p) for ps in sets.values() for p in ps) + args.max_new_tokens + 8
    drafters = make_drafters(drafts, [x for x in args.only.split(",") if x])
    decoders = {name: SpeculativeDecoder(target, d, max_batch=args.batch, max_len=max_len, policy=args.policy)
                for name, d in drafters.items()}
    names = list(decoders)
    modes = args.modes.split(",")
    temps = {"greedy": 0.0, "sample": 1.0}
    acc: Dict[str, dict] = {}
    mismatch: List[str] = []
    if args.warmup:
        for name in names:  # warm-up (allocations, first-call overheads)
            decoders[name].generate([sets["open"][0]], max_new_tokens=4)
    grounded_only = [x for x in args.grounded.split(",") if x]
    out = Path(args.out) if args.out else ROOT / "benchmarks" / "results" / f"trees_{_dt.date.today()}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    partial = out.with_suffix(".partial.json")  # raw numbers after every group (a killed run keeps them)
    job = 0
    for set_name, prompts in sets.items():
        groups = [prompts[i:i + args.batch] for i in range(0, len(prompts), args.batch)]
        for gi, group in enumerate(groups):
            for mode in modes:
                run = [n for n in names if set_name != "grounded" or not grounded_only or n in grounded_only]
                if not run:  # --grounded names none of the configurations: this set is skipped
                    continue
                order = run[job % len(run):] + run[:job % len(run)]
                job += 1
                for name, si in [(n, si) for n in order for si in range(args.seeds if mode == "sample" else 1)]:
                    t0 = time.perf_counter()
                    gen = decoders[name].generate(group, max_new_tokens=args.max_new_tokens, eos_token_id=eos,
                                                  temperature=temps[mode], seed=1234 + gi + 7919 * si)
                    dt = time.perf_counter() - t0
                    m = gen.metrics
                    key = f"{name}|{mode}|{set_name}"
                    a = acc.setdefault(key, dict(tokens=0, passes=0, request_steps=0, accepted=0, seconds=0.0))
                    a["tokens"] += sum(len(t) for t in gen.tokens)
                    a["passes"] += int(m["target_passes"])
                    a["request_steps"] += int(sum(m["per_request"]["target_passes"]))
                    a["accepted"] += int(m["accepted_tokens"])
                    a["seconds"] += dt
                    if mode == "greedy":
                        a.setdefault("outputs", []).extend(gen.tokens)
                print(f"{set_name} group {gi} {mode}: done ({time.perf_counter() - t_start:.0f} s, "
                      f"load {os.getloadavg()[0]:.1f})", flush=True)
                partial.write_text(json.dumps(dict(load_average_start=load_start, load_average_now=os.getloadavg(),
                                                   settings=dict(vars(args), out=_record_path(args.out)), raw=acc),
                                              default=str))
    # greedy outputs must equal plain decoding's
    for key, a in acc.items():
        name, mode, set_name = key.split("|")
        if mode == "greedy" and "plain|greedy|" + set_name in acc:
            if a["outputs"] != acc["plain|greedy|" + set_name]["outputs"]:
                mismatch.append(key)
    for a in acc.values():
        a.pop("outputs", None)
        a["mean_accepted_length"] = ratio(a["accepted"] + a["request_steps"], a["request_steps"])
        a["tokens_per_second"] = ratio(a["tokens"], a["seconds"])

    def get(name, mode, set_name, field):
        if set_name == "mixed":
            parts = [acc.get(f"{name}|{mode}|{s}") for s in ("open", "grounded")]
            if None in parts:
                return float("nan")
            tot = {f: sum(p[f] for p in parts) for f in ("tokens", "accepted", "request_steps", "seconds")}
            if field == "mean_accepted_length":
                return ratio(tot["accepted"] + tot["request_steps"], tot["request_steps"])
            return ratio(tot["tokens"], tot["seconds"])
        a = acc.get(f"{name}|{mode}|{set_name}")
        return float("nan") if a is None else a[field]

    targets = []

    def target(desc, got, need):
        targets.append(dict(target=desc, measured=round(got, 3), required=need, met=bool(got >= need)))

    L, T = "mean_accepted_length", "tokens_per_second"
    if "sample" in modes:
        target("sampling, int8, open: dynamic_16 / chain_16 mean accepted length",
               ratio(get("int8_dynamic_16", "sample", "open", L), get("int8_chain_16", "sample", "open", L)), 1.2)
    if "greedy" in modes:
        target("greedy, int8, open: dynamic_16 / chain_16 mean accepted length",
               ratio(get("int8_dynamic_16", "greedy", "open", L), get("int8_chain_16", "greedy", "open", L)), 1.05)
        target("greedy, int8, open: dynamic_32 / chain_32 mean accepted length",
               ratio(get("int8_dynamic_32", "greedy", "open", L), get("int8_chain_32", "greedy", "open", L)), 1.15)
        target("greedy, int8, open: planned_16 / chain_16 mean accepted length",
               ratio(get("int8_planned_16", "greedy", "open", L), get("int8_chain_16", "greedy", "open", L)), 1.05)
        target("greedy, int8, open: planned_32 / chain_32 mean accepted length",
               ratio(get("int8_planned_32", "greedy", "open", L), get("int8_chain_32", "greedy", "open", L)), 1.15)
    for mode in modes:
        trees = [n for n in names if any(f"_{t}_" in n for t in ("spine", "dynamic", "dynraw", "deep", "planned"))]
        chains = [n for n in names if "_chain_" in n]
        if trees and chains:
            bt = max(trees, key=lambda n: get(n, mode, "open", T))
            bc = max(chains, key=lambda n: get(n, mode, "open", T))
            target(f"{mode}, open: best tree ({bt}) / best chain ({bc}) tokens/s",
                   ratio(get(bt, mode, "open", T), get(bc, mode, "open", T)), 1.05)
        if "multi_w8_lookup" in names:
            best_member = max(get("w8_dynamic_16", mode, "mixed", T), get("lookup", mode, "mixed", T))
            target(f"{mode}, mixed: MultiDraft(w8 dynamic_16 + lookup) / better member tokens/s",
                   ratio(get("multi_w8_lookup", mode, "mixed", T), best_member), 1.0)
        if "multi_lookup_w8_esc" in names:
            best_member = max(get("w8_chain_5", mode, "mixed", T), get("lookup", mode, "mixed", T))
            target(f"{mode}, mixed: MultiDraft(lookup + w8 chain_5, escalate=2) / better member tokens/s",
                   ratio(get("multi_lookup_w8_esc", mode, "mixed", T), best_member), 1.0)

    print()
    for mode in modes:
        for set_name in ("open", "grounded", "mixed"):
            print(f"== {mode}, {set_name}: mean accepted length / tokens/s")
            for name in names:
                print(f"  {name:20s} {get(name, mode, set_name, L):6.2f}  {get(name, mode, set_name, T):7.2f}")
    print()
    for t in targets:
        print(f"{'MET   ' if t['met'] else 'MISSED'} {t['target']}: {t['measured']} (need >= {t['required']})")
    if mismatch:
        print("GREEDY OUTPUT MISMATCH vs plain:", mismatch)
    result = dict(
        date=_dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"), commit=git_commit(), cpu=cpu_name(),
        cores=os.cpu_count(), torch_threads=torch.get_num_threads(), load_average_start=load_start,
        load_average_end=os.getloadavg(), seconds=time.perf_counter() - t_start,
        settings=dict(vars(args), out=_record_path(args.out), budgets=BUDGETS, spine_w=SPINE_W,
                      dynamic_kw=DYNAMIC_KW, deep_k=DEEP_K, planned_kw=PLANNED_KW),
        results=acc, targets=targets, greedy_mismatch_vs_plain=mismatch)
    out.write_text(json.dumps(result, indent=1))
    partial.unlink(missing_ok=True)
    print(f"wrote {out}")
    return 0 if not mismatch else 1


if __name__ == "__main__":
    raise SystemExit(main())
