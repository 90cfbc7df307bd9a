"""Tensor parallel on this machine: TP 1 vs TP 2 (gloo on loopback, 1 torch thread per rank).

For each drafter (plain, prompt lookup, the w8 draft chain, a w8 tree of 2 candidates per depth) the
12 prompts of specdec.bench.PROMPT_SETS (chat template) are decoded greedily as one batch by the
bundled model at TP 1 (the shard code in this process) and TP 2 (this process + one spawned rank);
TP sizes alternate per round. Recorded: tokens/s, whether TP 2's tokens equal TP 1's per prompt, the
collectives' seconds and share of the target forwards' time and of the whole generate call on
rank 0, bytes moved, and the load average (a shared, noisy machine).

    python benchmarks/bench_tp.py --rounds 2 --max-new-tokens 32 --out benchmarks/results/tp_DATE.json
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from specdec import DraftModel, PromptLookup, SpeculativeDecoder  # noqa: E402
from specdec.bench import PROMPT_SETS, cpu_name, git_commit, loadavg  # noqa: E402
from specdec.distributed import ModelSource, launch_tensor_parallel, local_tensor_parallel  # noqa: E402
from specdec.models.bundled import load_bundled  # noqa: E402
from specdec.models.hf import HFCausalLM  # noqa: E402


def drafters(w8):
    return {"plain": lambda: None, "lookup": lambda: PromptLookup(ngram=3, k=10),
            "w8": lambda: DraftModel(HFCausalLM(w8), k=6), "w8-tree": lambda: DraftModel(HFCausalLM(w8), k=4, top_k=2)}


def run(lm, make, prompts, n):
    dec = SpeculativeDecoder(lm, make(), max_batch=len(prompts), max_len=max(map(len, prompts)) + n,
                             policy="fixed")
    dec.generate([p[:8] for p in prompts[:2]], max_new_tokens=2)  # warm-up
    before = dict(getattr(lm, "totals", {}))
    t0 = time.perf_counter()
    out = dec.generate(prompts, max_new_tokens=n)
    wall = time.perf_counter() - t0
    tot = {k: lm.totals[k] - before.get(k, 0) for k in lm.totals}
    toks = sum(len(t) for t in out.tokens)
    return out.tokens, dict(seconds=wall, tokens=toks, tokens_per_second=toks / wall,
                            forward_seconds=tot["seconds"], comm_seconds=tot["comm_seconds"],
                            comm_bytes=tot["comm_bytes"], forwards=tot["forwards"], messages=tot["messages"],
                            comm_share_of_forward=tot["comm_seconds"] / tot["seconds"] if tot["seconds"] else 0.0,
                            comm_share_of_generate=tot["comm_seconds"] / wall)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--max-new-tokens", type=int, default=32)
    ap.add_argument("--drafters", default="plain,lookup,w8,w8-tree")
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    torch.set_num_threads(1)
    model, tok, w8 = load_bundled(draft="w8", hugepages=False)
    prompts = []
    for texts in PROMPT_SETS.values():
        for t in texts:
            ids = tok.apply_chat_template([{"role": "user", "content": t}], add_generation_prompt=True, tokenize=True)
            prompts.append(list(ids["input_ids"] if hasattr(ids, "keys") else ids))
    tps = {1: local_tensor_parallel(model), 2: launch_tensor_parallel(ModelSource(), 2, threads=1, model=model)}
    makers = drafters(w8)
    rows = []
    for name in a.drafters.split(","):
        runs = {1: [], 2: []}
        same = None
        for r in range(a.rounds):
            for size in ((1, 2) if r % 2 == 0 else (2, 1)):
                tokens, rec = run(tps[size], makers[name], prompts, a.max_new_tokens)
                rec["load"] = loadavg()
                runs[size].append((tokens, rec))
            t1, t2 = runs[1][-1][0], runs[2][-1][0]
            same = [x == y for x, y in zip(t1, t2)] if same is None else [s and x == y for s, x, y in zip(same, t1, t2)]
        med = {s: statistics.median(rec["tokens_per_second"] for _, rec in runs[s]) for s in (1, 2)}
        share = statistics.median(rec["comm_share_of_forward"] for _, rec in runs[2])
        rows.append(dict(drafter=name, tp1_tokens_per_second=med[1], tp2_tokens_per_second=med[2],
                         tp2_over_tp1=med[2] / med[1], tp2_comm_share_of_forward=share,
                         identical_prompts=sum(same), prompts=len(same),
                         rounds={s: [rec for _, rec in runs[s]] for s in (1, 2)}))
        print(f"{name:8s} TP1 {med[1]:6.1f} tok/s  TP2 {med[2]:6.1f} tok/s  ratio {med[2] / med[1]:.2f}  "
              f"collectives {100 * share:.0f}% of TP2 forward time  identical {sum(same)}/{len(same)}", flush=True)
    tps[2].close()
    rec = dict(benchmark="tp", commit=git_commit(), cpu=cpu_name(), args=vars(a), load=loadavg(),
               torch_threads_per_rank=1, rows=rows,
               notes="2 ranks on a 2-core machine shared with other jobs: no speedup is expected; the "
                     "collective's share is dominated by loopback gloo latency and core contention.")
    Path(a.out).write_text(json.dumps(rec, indent=1))


if __name__ == "__main__":
    main()
