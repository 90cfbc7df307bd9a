"""Feature head (EagleHead) vs plain decoding, prompt lookup and the w8 draft on the bundled model.

Greedy, batch 1 (``--batch B``: B requests per call), the target at ``--precision`` (default q4_1, the checkpoint's
own) with ``--act`` activations (auto: q8 at q8_0 / q4_1, as the CLI). Methods run interleaved per prompt (every
method on prompt 1, then on prompt 2, ...), ``--rounds`` times, after one untimed warm-up generation per method;
each run is checked token-identical to plain decoding. Recorded per method: tokens/s (median over runs and the ratio
to plain on the same prompt and round), mean accepted length (tokens per target pass), and the draft cost: the
median seconds of one head / w8 draft forward of one token against one target forward of one token at the same cache
length (a micro-timing in the same process, its weights warm in the caches), and per method the milliseconds per
target pass in the decoding loop (``step_ms``) and of drafting in it (``draft_ms_per_step``, also as a fraction of
plain decoding's step: the drafter as cold as it runs there).

Every method runs on the same KV layout, ``--kv-cache dense`` by default: on the paged layout prefix caching
skips the prefill of a prompt seen before (the warm-up's prompt, every prompt of a later round), and tokens/s count
the prefill. (Before the paged cache kept the target's hidden states, a head ran dense while the other methods
defaulted to paged: those records credit the methods without a head with prefills they did not run.)

    python benchmarks/bench_eagle.py --head DIR [--precision q4_1] [--set open] [--max-new-tokens 96]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from datetime import date

import torch

from specdec import SpeculativeDecoder
from specdec.bench.record import cpu_name, git_commit, record_path, scrub_paths, write_record
from specdec.bench.workloads import PROMPT_SETS, chat_ids
from specdec.drafters import DraftModel, EagleHead, MultiDraft, PromptLookup
from specdec.drafters.eagle import load_head
from specdec.drafters.eagle.lm import HeadLM
from specdec.models import HFCausalLM
from specdec.models.bundled import load_bundled

# run at their own k every step; the others under the goodput policy
FIXED = ("head_chain", "head_tree", "head_k1", "head_k2", "head_k3", "head_k1w2", "head_k1w3", "head_k2w2",
         "head_k1_batched", "head_k1w2_q4")
RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")


def _methods(target_model, draft_model, head_net, head_precision, head_act=None):
    hp = dict(precision=head_precision, act=head_act)
    hq4 = dict(precision="q4_1", act="q8")  # the *_q4 methods: a Q4_1 copy of the head, whatever --head-precision
    return {
        "plain": lambda: None,
        "lookup": lambda: PromptLookup(ngram=3, k=10),
        "w8": lambda: DraftModel(HFCausalLM(draft_model), k=6),
        "head_chain": lambda: EagleHead(head_net, k=5, **hp),
        "head_tree": lambda: EagleHead(head_net, k=5, top_k=4, tree="dynamic", node_budget=12, **hp),
        "head_goodput": lambda: EagleHead(head_net, k=6, **hp),
        # what `specdec generate --draft auto --head PATH` builds: prompt lookup first, the head beside it
        "lookup_head": lambda: MultiDraft([PromptLookup(ngram=3, k=10), EagleHead(head_net, k=5, **hp)],
                                          escalate=2.0),
        # the same with a one-token head (the head's only depth that paid on open prompts at Q4_1)
        "lookup_head_k1": lambda: MultiDraft([PromptLookup(ngram=3, k=10), EagleHead(head_net, k=1, **hp)],
                                             escalate=2.0),
        # the same with the head's one-forward spine tree of two siblings
        "lookup_head_k1w2": lambda: MultiDraft([PromptLookup(ngram=3, k=10), EagleHead(head_net, k=1, top_k=2, **hp)],
                                               escalate=2.0),
        # the same without escalation's price check (MultiDraft gate=False: the head drafts wherever lookup is
        # not trusted)
        "lookup_head_k1w2_nogate": lambda: MultiDraft([PromptLookup(ngram=3, k=10),
                                                       EagleHead(head_net, k=1, top_k=2, **hp)],
                                                      escalate=2.0, gate=False),
        # what `specdec generate --draft auto` builds with an fp32 target (and, before, at every precision)
        "lookup_w8": lambda: MultiDraft([PromptLookup(ngram=3, k=10), DraftModel(HFCausalLM(draft_model), k=6)],
                                        escalate=2.0),
        "lookup_w8_nogate": lambda: MultiDraft([PromptLookup(ngram=3, k=10), DraftModel(HFCausalLM(draft_model), k=6)],
                                               escalate=2.0, gate=False),
        "head_k1": lambda: EagleHead(head_net, k=1, **hp),
        "head_k2": lambda: EagleHead(head_net, k=2, **hp),
        "head_k3": lambda: EagleHead(head_net, k=3, **hp),
        # one head forward, the w most likely tokens as siblings (a spine tree of 1 + k * w nodes)
        # head_k1 with the head's batched path on every call (HeadLM.lean off: the A/B of its batch-1 path)
        "head_k1_batched": lambda: EagleHead(head_net, k=1, **hp),
        "head_k1w2": lambda: EagleHead(head_net, k=1, top_k=2, **hp),
        "head_k1w3": lambda: EagleHead(head_net, k=1, top_k=3, **hp),
        "head_k2w2": lambda: EagleHead(head_net, k=2, top_k=2, **hp),
        # lookup_head_k1w2 with the price check of before 2026-12-07 (every step prices the member, its catch-up
        # subtracted: after a skipped step that left the head's tree builder alone)
        "lookup_head_k1w2_oldgate": lambda: _old_gate(MultiDraft([PromptLookup(ngram=3, k=10),
                                                                  EagleHead(head_net, k=1, top_k=2, **hp)],
                                                                 escalate=2.0)),
        # lookup_head_k1w2 without the advice (MultiDraft.advise False: has_proposals says nothing, every step
        # weighs depths)
        "lookup_head_k1w2_noadvice": lambda: _no_advice(MultiDraft([PromptLookup(ngram=3, k=10),
                                                                    EagleHead(head_net, k=1, top_k=2, **hp)],
                                                                   escalate=2.0)),
        # the same two with a Q4_1 copy of the head (half the bytes a draft forward reads after the target's pass)
        "head_k1w2_q4": lambda: EagleHead(head_net, k=1, top_k=2, **hq4),
        "lookup_head_k1w2_q4": lambda: MultiDraft([PromptLookup(ngram=3, k=10),
                                                   EagleHead(head_net, k=1, top_k=2, **hq4)], escalate=2.0),
    }


def _old_gate(multi):
    multi.gate.steady_price = False
    return multi


def _no_advice(multi):
    multi.advise = False
    return multi


def _step_cost(target_model, draft_model, head_net, head_precision, head_act=None, ctx_len=200, reps=30):
    """Median seconds of one 1-token forward of the target, the w8 draft and the head (at ctx_len cached)."""
    out = {}
    seq = list(range(1000, 1000 + ctx_len))
    target = HFCausalLM(target_model)
    target.capture_hidden((-1,))
    tc = target.new_cache(1, ctx_len + 8)
    target.prefill(tc, [seq])
    one = torch.tensor([[5]])
    d0 = torch.zeros(1, 1, dtype=torch.int32)

    def timed(fn):
        ts = []
        for _ in range(reps):
            t0 = time.perf_counter()
            fn()
            ts.append(time.perf_counter() - t0)
        return statistics.median(ts)

    out["target"] = timed(lambda: target.forward(tc, one, d0))
    w8 = HFCausalLM(draft_model)
    wc = w8.new_cache(1, ctx_len + 8)
    w8.prefill(wc, [seq])
    out["w8"] = timed(lambda: w8.forward(wc, one, d0))
    head = EagleHead(head_net, k=1, precision=head_precision, act=head_act).net
    lm = HeadLM(head, target)
    lm.attach(tc)
    hc = lm.new_cache(1, ctx_len + 8)
    lm.prefill(hc, [seq])
    out["head"] = timed(lambda: lm.forward(hc, one, d0))
    return out


def _per_step(run: dict, key: str, batch: int = 1) -> float:
    """Milliseconds of ``key`` per target pass of one run (batch 1: passes = new tokens / mean accepted length;
    a batch: the decoder's count of target passes)."""
    if batch > 1:
        return run[key] * 1e3 / max(1, run["target_passes"])
    return run[key] * 1e3 * run["mean_accepted_length"] / max(1, run["new_tokens"])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--head", required=True, help="head folder (specdec train-head --out DIR: DIR/head)")
    ap.add_argument("--precision", default="q4_1", choices=["fp32", "q8_0", "q4_1"])
    ap.add_argument("--act", default="auto", choices=["auto", "none", "q8"],
                    help="the target's activations (auto: q8 with q8_0 / q4_1, as specdec generate's default)")
    ap.add_argument("--head-precision", default="q8_0", choices=["fp32", "q8_0", "q4_1", "q4_0"])
    ap.add_argument("--head-act", default="q8", choices=["none", "q8"],
                    help="the head's activations (q8: quantized, the integer kernels; needs a quantized precision)")
    ap.add_argument("--set", default="open", choices=sorted(PROMPT_SETS))
    ap.add_argument("--prompts", type=int, default=6)
    ap.add_argument("--max-new-tokens", type=int, default=96)
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--methods", default="plain,lookup,w8,head_chain,head_tree,head_goodput")
    ap.add_argument("--batch", type=int, default=1,
                    help="requests per generate call: the set's prompts in turn, cycled (call i starts at prompt i, so "
                         "every prompt leads once per round; a set smaller than the batch repeats prompts)")
    ap.add_argument("--kv-cache", default="dense", choices=["dense", "auto"],
                    help="the target's KV layout for every method (auto: paged, with prefix caching, so a "
                         "repeated prompt skips its prefill)")
    ap.add_argument("--name", default=None)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    from specdec.cli import resolve_act

    model, tok, draft = load_bundled(precision=args.precision, draft="w8", act=resolve_act(args.act, args.precision))
    net = load_head(args.head)
    head_act = None if args.head_act == "none" or args.head_precision == "fp32" else args.head_act
    makers = _methods(model, draft, net, args.head_precision, head_act)
    names = args.methods.split(",")
    for n in names:  # NAME_full: method NAME with every verify pass's LM head on all rows (no lazy verification)
        if n.endswith("_full") and n not in makers:
            makers[n] = makers[n[:-len("_full")]]
    texts = PROMPT_SETS[args.set][:args.prompts]
    prompts = [chat_ids(tok, t) for t in texts]
    kv = None if args.kv_cache == "auto" else args.kv_cache
    B = max(1, args.batch)
    groups = [[prompts[(i + j) % len(prompts)] for j in range(B)] for i in range(len(prompts))]
    decoders = {n: SpeculativeDecoder(HFCausalLM(model), makers[n](), max_batch=B, max_len=1024,
                                      policy="fixed" if n.removesuffix("_full") in FIXED else "goodput",
                                      kv_cache=kv) for n in names}
    for n in names:
        if n.endswith("_full"):
            decoders[n].target.lazy_verify = False
        if n.endswith("_batched"):
            decoders[n].drafter.lm.lean = False
        # warm-up (first calls allocate caches, pack weights and fill the allocator): not timed
        decoders[n].generate(groups[0], max_new_tokens=8, eos_token_id=tok.eos_token_id)
    runs = []
    load = [os.getloadavg()]
    for rnd in range(args.rounds):
        for i, p in enumerate(groups):
            ref = None
            for n in names:
                lv = decoders[n].engine.lazy_verify
                before = (lv.rows, lv.nodes, lv.steps)
                out = decoders[n].generate(p, max_new_tokens=args.max_new_tokens, eos_token_id=tok.eos_token_id)
                m = out.metrics
                if n == "plain":
                    ref = out.tokens
                runs.append(dict(method=n, prompt=i, round=rnd, tokens_per_second=m["tokens_per_second"],
                                 mean_accepted_length=m["mean_accepted_length"], new_tokens=m["new_tokens"],
                                 target_passes=m["target_passes"],
                                 draft_seconds=m["draft_seconds"], verify_seconds=m["verify_seconds"],
                                 prefill_seconds=m["prefill_seconds"],
                                 total_seconds=m["total_seconds"], identical=ref is None or out.tokens == ref,
                                 # lazy verification (specdec.lazy_verify): steps, head rows computed, tree nodes
                                 lazy_steps=lv.steps - before[2], head_rows=lv.rows - before[0],
                                 head_nodes=lv.nodes - before[1]))
                print(f"round {rnd} prompt {i} {n:10s} {m['tokens_per_second']:7.2f} tok/s  "
                      f"accepted length {m['mean_accepted_length']:.2f}", flush=True)
        load.append(os.getloadavg())
    cost = _step_cost(model, draft, net, args.head_precision, head_act)
    summary = {}
    for n in names:
        rs = [r for r in runs if r["method"] == n]
        ratios = [r["tokens_per_second"] / q["tokens_per_second"] for r in rs for q in runs
                  if q["method"] == "plain" and q["prompt"] == r["prompt"] and q["round"] == r["round"]]
        summary[n] = dict(median_tokens_per_second=statistics.median(r["tokens_per_second"] for r in rs),
                          median_ratio_to_plain=statistics.median(ratios) if ratios else None,
                          mean_accepted_length=statistics.mean(r["mean_accepted_length"] for r in rs),
                          all_identical=all(r["identical"] for r in rs),
                          # per target pass, in the decoding loop (the drafter's weights as cold as they are there)
                          step_ms=statistics.median(_per_step(r, "total_seconds", B) for r in rs),
                          draft_ms_per_step=statistics.median(_per_step(r, "draft_seconds", B) for r in rs),
                          # the same without the prefill: a decoding step of the loop; and its target pass alone
                          decode_step_ms=statistics.median(
                              _per_step(dict(r, decode_seconds=r["total_seconds"] - r["prefill_seconds"]),
                                        "decode_seconds", B) for r in rs),
                          verify_ms_per_step=statistics.median(_per_step(r, "verify_seconds", B) for r in rs),
                          lazy_steps=sum(r["lazy_steps"] for r in rs),
                          head_rows_per_node=sum(r["head_rows"] for r in rs) / max(1, sum(r["head_nodes"] for r in rs)))
    if "plain" in summary:
        plain = summary["plain"]
        for n in names:
            d = summary[n]["draft_ms_per_step"]
            summary[n]["draft_fraction_of_plain_step"] = d / plain["step_ms"]   # step_ms counts the prefill in
            summary[n]["draft_fraction_of_plain_decode_step"] = d / plain["decode_step_ms"]
            summary[n]["draft_fraction_of_plain_verify"] = d / plain["verify_ms_per_step"]
    summary["draft_cost_fraction"] = dict(head=cost["head"] / cost["target"], w8=cost["w8"] / cost["target"],
                                          seconds=cost)
    with open(os.path.join(args.head, "config.json")) as f:
        head_config = scrub_paths(json.load(f))
    rec = dict(benchmark="eagle", args=dict(vars(args), head=record_path(args.head)), commit=git_commit(),
               cpu=cpu_name(), loadavg=load, torch_threads=args.threads, head_config=head_config, summary=summary,
               runs=runs,
               notes=f"2 shared CPU cores (load average recorded); greedy, batch {B}; the head_k* methods, head_chain "
                     "and head_tree run the fixed policy (their k every step), the others the goodput policy; every "
                     f"method on the {args.kv_cache} KV layout")
    act = resolve_act(args.act, args.precision)
    name = args.name or (f"eagle_{args.set}_{args.precision}{'_q8act' if act else ''}{f'_b{B}' if B > 1 else ''}_"
                         f"{date.today().isoformat()}")
    print(json.dumps(summary, indent=1))
    write_record(RESULTS, name, rec)


if __name__ == "__main__":
    main()
