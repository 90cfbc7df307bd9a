"""The Engine on a paged KV cache vs the dense one (bundled SmolLM2-135M, CPU).

    python benchmarks/bench_paged_engine.py                  # all three parts, Q4_1
    python benchmarks/bench_paged_engine.py --parts prefix --rounds 3

Parts (each interleaves its configurations round by round; medians and per-round ratios):

* ``capacity``: the same KV memory as a dense engine of ``max_batch = 4, max_len = 2048``
  (positions x bytes per position); the paged engine gets that many bytes (``kv_memory``) and
  ``max_batch = 32``. The serving benchmark's prompt mix (specdec.bench.PROMPT_SETS, grounded +
  open, chat template), ``--requests`` of them submitted at once, ``--max-new`` tokens each,
  greedy, plain decoding: most requests held at once, output tokens/s over the run, outputs
  identical between the two.
* ``draft``: ``capacity`` with the w8 draft model (a k = 4 chain): the dense engine's target and draft
  caches (``max_batch = 4, max_len = 2048`` each) against one paged pool of the same bytes holding
  both models' K/V (``max_batch = 32``).
* ``prefix``: a shared system prompt of ~1,000 tokens (the text of Python's ``this``, ``json``
  and ``textwrap`` module docs, tokenized and cut) + a short question: time to first token of a
  request whose prefix blocks are cached (a first request with the same system prompt ran
  before) vs the same request on a cold engine; outputs identical.
* ``step``: one decode step of the target (forward + commit) at batch 1 and 8 on the dense
  cache vs the paged view (block size 16, shuffled blocks), 512 committed positions.
* ``soak``: ``--soak`` requests (random prompts sharing prefixes, 1-32 new tokens, greedy and
  seed-coupled sampling, prompt lookup) arriving over time into a pool of 14 blocks of 16
  positions with ``max_batch = 8``, a quarter of them aborted at random moments (waiting,
  running or preempted): lost requests, leaked blocks (allocator invariants after every step),
  preemptions, and the outputs of every finished request compared with its solo run.

Writes benchmarks/results/paged_engine_<date>.json (or --out).
"""
from __future__ import annotations

import argparse
import datetime as _dt
import json
import statistics
import time
from pathlib import Path

import torch

import specdec
from specdec import Engine, HFCausalLM, RequestParams
from specdec.bench.record import cpu_name, git_commit, loadavg
from specdec.bench.workloads import PROMPT_SETS

ROOT = Path(__file__).resolve().parent.parent


def chat_ids(tok, text: str):
    ids = tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True, tokenize=True)
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)


def drive(eng: Engine, jobs):
    """Submit every job at once, step to the end; (outputs, seconds, most active, tokens)."""
    for rid, ids, params in jobs:
        eng.add_request(rid, ids, params)
    out = {rid: [] for rid, _, _ in jobs}
    most, t0 = 0, time.perf_counter()
    while eng.has_unfinished():
        for d in eng.step():
            out[d.request_id].extend(d.new_tokens)
        most = max(most, eng.num_active)
    dt = time.perf_counter() - t0
    return out, dt, most, sum(len(v) for v in out.values())


def serving_jobs(tok, args):
    """``--requests`` chat prompts of the serving mix (grounded + open), ``--max-new`` greedy tokens each."""
    texts = PROMPT_SETS["grounded"] + PROMPT_SETS["open"]
    return [(i, chat_ids(tok, texts[i % len(texts)]), RequestParams(max_new_tokens=args.max_new))
            for i in range(args.requests)]


def compare_engines(make, jobs, args, label: str, extra) -> dict:
    """Dense vs paged engines (``make[name]()``) over ``jobs``, interleaved round by round; ``extra(eng)``: the
    round's fields beyond time, concurrency and tokens. Medians, per-round ratios, output identity."""
    rounds = {k: [] for k in make}
    outs = {}
    for r in range(args.rounds):
        for name in (list(make) if r % 2 == 0 else list(make)[::-1]):
            eng = make[name]()
            out, dt, most, ntok = drive(eng, jobs)
            outs[name] = out
            rounds[name].append(dict(seconds=dt, most_active=most, tokens=ntok, tokens_per_second=ntok / dt,
                                     **extra(eng)))
            print(f"{label} round {r} {name}: {rounds[name][-1]}", flush=True)
    med = {k: statistics.median(x["tokens_per_second"] for x in v) for k, v in rounds.items()}
    ratios = [p["tokens_per_second"] / d["tokens_per_second"] for d, p in zip(rounds["dense"], rounds["paged"])]
    return dict(rounds=rounds, median_tokens_per_second=med, median_round_ratio=statistics.median(ratios),
                most_active=dict(dense=max(x["most_active"] for x in rounds["dense"]),
                                 paged=max(x["most_active"] for x in rounds["paged"])),
                outputs_identical=outs["dense"] == outs["paged"])


def _kv_bytes(eng) -> int:
    return eng.kv.cache.nbytes if eng.kv.paged else eng.cache.nbytes()


def part_capacity(lm, tok, args) -> dict:
    jobs = serving_jobs(tok, args)
    dense_positions = 4 * (2048 + 1)
    per_position = 2 * lm.num_layers * lm.num_kv_heads * lm.head_dim * torch.empty((), dtype=lm.dtype).element_size()
    budget = dense_positions * per_position
    make = dict(dense=lambda: Engine(lm, None, max_batch=4, max_len=2048, kv_cache="dense", policy="fixed"),
                paged=lambda: Engine(lm, None, max_batch=32, max_len=2048, kv_memory=budget, policy="fixed"))
    res = compare_engines(make, jobs, args, "capacity",
                          lambda eng: dict(preemptions=eng.stats()["preemptions"], kv_bytes=_kv_bytes(eng)))
    return dict(kv_budget_bytes=budget, prompt_tokens=[len(j[1]) for j in jobs], **res)


def part_draft(lm, tok, args) -> dict:
    """The capacity comparison with the w8 draft model: dense = the target's and the draft's dense caches of
    ``max_batch = 4, max_len = 2048``; paged = those bytes as ONE pool holding both models' K/V."""
    _, _, small = specdec.load_bundled("smollm2-135m", precision=args.precision, draft="w8")
    dlm = HFCausalLM(small)

    def draft():
        return specdec.DraftModel(dlm, k=4)

    dense0 = Engine(lm, draft(), max_batch=4, max_len=2048, kv_cache="dense", policy="fixed")
    budget = dense0.cache.nbytes() + dense0.drafter.cache.nbytes()
    del dense0
    make = dict(dense=lambda: Engine(lm, draft(), max_batch=4, max_len=2048, kv_cache="dense", policy="fixed"),
                paged=lambda: Engine(lm, draft(), max_batch=32, max_len=2048, kv_memory=budget, policy="fixed"))

    def extra(eng):
        st = eng.stats()
        return dict(preemptions=st["preemptions"],
                    kv_bytes_target_and_draft=_kv_bytes(eng) + eng.drafter.cache.nbytes(),
                    accepted_tokens=st["accepted_tokens"], drafted_tokens=st["drafted_tokens"],
                    kv_blocks_total=st.get("kv_blocks_total"),
                    draft_kv_bytes_per_block=st.get("draft_kv_bytes_per_block"))

    res = compare_engines(make, serving_jobs(tok, args), args, "draft", extra)
    return dict(kv_budget_bytes=budget, drafter="DraftModel(w8 copy, k=4), policy fixed", **res)


def system_prompt(tok, n: int):
    import json as _json
    import textwrap
    import this  # noqa: F401  (prints the Zen once; its text is the rot13 source)
    text = "".join(this.d.get(c, c) for c in this.s) + "\n" + (_json.__doc__ or "") + "\n" + (textwrap.__doc__ or "")
    while len(tok.encode(text)) < n:
        text += "\n" + (_json.dumps.__doc__ or "") + (textwrap.wrap.__doc__ or "")
    return tok.encode(text)[:n]


def part_prefix(lm, tok, args) -> dict:
    sys_ids = system_prompt(tok, args.prefix_tokens)
    q1, q2 = tok.encode("\nQuestion: what is this text about?"), tok.encode("\nQuestion: summarise it in one line.")
    params = RequestParams(max_new_tokens=16)

    def ttft(eng, rid, ids):
        eng.add_request(rid, ids, params)
        t0 = time.perf_counter()
        first = eng.admit()
        dt = time.perf_counter() - t0
        out = list(first[0].new_tokens)
        while eng.has_unfinished():
            for d in eng.step():
                out.extend(d.new_tokens)
        return dt, out

    rounds = dict(cold=[], cached=[])
    outs = {}
    for r in range(args.rounds):
        for name in (("cold", "cached") if r % 2 == 0 else ("cached", "cold")):
            eng = Engine(lm, None, max_batch=2, max_len=2048, policy="fixed")
            if name == "cached":
                ttft(eng, "warm-up", sys_ids + q1)
            dt, out = ttft(eng, "q", sys_ids + q2)
            outs[name] = out
            rounds[name].append(dict(ttft_seconds=dt, prefix_hit_tokens=eng.stats()["prefix_hit_tokens"]))
            print(f"prefix round {r} {name}: {rounds[name][-1]}", flush=True)
    med = {k: statistics.median(x["ttft_seconds"] for x in v) for k, v in rounds.items()}
    ratios = [c["ttft_seconds"] / d["ttft_seconds"] for d, c in zip(rounds["cold"], rounds["cached"])]
    return dict(prefix_tokens=len(sys_ids), prompt_tokens=len(sys_ids + q2), rounds=rounds, median_ttft=med,
                median_round_ratio=statistics.median(ratios), outputs_identical=outs["cold"] == outs["cached"])


def part_step(lm, args) -> dict:
    g = torch.Generator().manual_seed(0)
    res = {}
    for B in (1, 8):
        dense = lm.new_cache(B, 1024)
        bs, per_row = 16, 1024 // 16
        pc = lm.new_paged_cache(B * per_row, bs, max_requests=B, max_blocks_per_request=per_row)
        perm = torch.randperm(B * per_row, generator=g)
        for b in range(B):
            pc.add(b, 0, row=b)
        pc.block_tables.copy_(perm.view(B, per_row).to(torch.int32))
        paged = pc.view(0, B)
        prompt = torch.randint(0, lm.vocab_size, (B, 512), generator=g).tolist()
        lm.prefill(dense, prompt)
        lm.prefill(paged, prompt)
        tokens = torch.randint(0, lm.vocab_size, (B, 1), generator=g)
        depths = torch.zeros(B, 1, dtype=torch.long)
        acc = torch.zeros(B, 1, dtype=torch.int32)
        num = torch.zeros(B, dtype=torch.int32)
        times = dict(dense=[], paged=[])
        for r in range(args.step_rounds):
            for name, cache in ((("dense", dense), ("paged", paged)) if r % 2 == 0 else
                                (("paged", paged), ("dense", dense))):
                t0 = time.perf_counter()
                for _ in range(5):
                    lm.forward(cache, tokens, depths)
                    cache.commit(acc, num)
                times[name].append((time.perf_counter() - t0) / 5)
                cache.lens.sub_(5)
        med = {k: statistics.median(v) for k, v in times.items()}
        ratios = [p / d for d, p in zip(times["dense"], times["paged"])]
        res[f"batch{B}"] = dict(seconds=times, median_seconds=med, median_round_ratio=statistics.median(ratios))
        print(f"step batch {B}: {med} ratio {statistics.median(ratios):.3f}", flush=True)
    return res


def part_soak(lm, args) -> dict:
    import random

    from specdec import PromptLookup

    rng = random.Random(0)
    V = lm.vocab_size
    prefixes = [[rng.randrange(V) for _ in range(rng.randint(16, 48))] for _ in range(6)]
    jobs = []
    for i in range(args.soak):
        prompt = rng.choice(prefixes) + [rng.randrange(V) for _ in range(rng.randint(1, 24))]
        params = RequestParams(max_new_tokens=rng.randint(1, 32), **(dict(temperature=0.8, seed=i) if i % 3 == 0
                                                                      else {}))
        jobs.append((i, prompt, params))
    eng = Engine(lm, PromptLookup(ngram=2, k=4, min_ngram=1), max_batch=8, max_len=160, num_blocks=14,
                 block_size=16, policy="fixed")
    out = {i: [] for i, _, _ in jobs}
    done, aborted, live = {}, set(), set()
    t0 = time.perf_counter()
    pending = list(jobs)
    steps = 0
    while pending or eng.has_unfinished():
        for _ in range(rng.randint(0, 2)):
            if pending:
                rid, prompt, params = pending.pop(0)
                eng.add_request(rid, prompt, params)
                live.add(rid)
        for d in eng.step():
            out[d.request_id].extend(d.new_tokens)
            if d.finished:
                done[d.request_id] = d.finish_reason
                live.discard(d.request_id)
        steps += 1
        eng.kv.allocator.check()
        if live and rng.random() < 0.12:
            victim = rng.choice(sorted(live))
            if eng.abort(victim):
                aborted.add(victim)
                live.discard(victim)
    dt = time.perf_counter() - t0
    st = eng.stats()
    finished = sorted(done)
    check = finished[:: max(1, len(finished) // args.soak_check)]
    mismatched = []
    for rid in check:
        _, prompt, params = jobs[rid]
        solo = Engine(lm, None, max_batch=1, max_len=160, kv_cache="dense", policy="fixed")
        solo.add_request(rid, prompt, params)
        toks = []
        while solo.has_unfinished():
            for d in solo.step():
                toks.extend(d.new_tokens)
        if toks != out[rid]:
            mismatched.append(rid)
    res = dict(requests=args.soak, finished=len(done), aborted=len(aborted),
               lost=args.soak - len(done) - len(aborted), steps=steps, seconds=dt,
               preemptions=st["preemptions"], kv_blocks_used_at_end=st["kv_blocks_used"],
               kv_blocks_free_at_end=st["kv_blocks_free"], kv_blocks_total=st["kv_blocks_total"],
               prefix_cache_hit_rate=st["prefix_cache_hit_rate"], evictions=st["prefix_cache_evictions"],
               checked_against_solo=len(check), mismatched=mismatched)
    print(f"soak: {res}", flush=True)
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--precision", default="q4_1")
    ap.add_argument("--parts", default="capacity,draft,prefix,step,soak")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--step-rounds", type=int, default=7)
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--max-new", type=int, default=48)
    ap.add_argument("--prefix-tokens", type=int, default=1000)
    ap.add_argument("--soak", type=int, default=500)
    ap.add_argument("--soak-check", type=int, default=60, help="finished soak requests compared with solo runs")
    ap.add_argument("--threads", type=int, default=None,
                    help="torch threads (1 keeps OpenMP barriers out of the timings on a shared, loaded machine)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    model, tok = specdec.load_bundled("smollm2-135m", precision=args.precision)
    lm = HFCausalLM(model)
    rec = dict(benchmark="paged_engine", date=_dt.date.today().isoformat(), commit=git_commit(), cpu=cpu_name(),
               torch_threads=torch.get_num_threads(), precision=args.precision, args=vars(args),
               loadavg_before=loadavg())
    parts = args.parts.split(",")
    if "step" in parts:
        rec["step"] = part_step(lm, args)
    if "prefix" in parts:
        rec["prefix"] = part_prefix(lm, tok, args)
    if "soak" in parts:
        rec["soak"] = part_soak(lm, args)
    if "capacity" in parts:
        rec["capacity"] = part_capacity(lm, tok, args)
    if "draft" in parts:
        rec["draft"] = part_draft(lm, tok, args)
    rec["loadavg_after"] = loadavg()
    out = Path(args.out) if args.out else ROOT / "benchmarks" / "results" / f"paged_engine_{rec['date']}.json"
    out.write_text(json.dumps(rec, indent=1))
    print(f"wrote {out.relative_to(ROOT) if out.is_relative_to(ROOT) else out.name}")


if __name__ == "__main__":
    main()
