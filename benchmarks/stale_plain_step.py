"""One slow plain step at the start, and a drafter whose forwards cost more than the target's (CPU).

    python benchmarks/stale_plain_step.py [--hiccup-ms 40] [--name NAME]

The bundled model at Q4_1 + q8 activations drafts with its int8 copy (the `w8` draft, k 6) under the goodput
policy on the code prompt set. At this precision a w8 forward costs more than a target forward, so no
acceptance pays for drafting and the policy should decode plainly. The first plain step of the decoder is
delayed by ``--hiccup-ms`` (what a shared machine does now and then); then every prompt runs once. Two
decoders, one with the cost model's monotone cap on the plain step's verify / commit / rest keys
(``CostTable.monotone``, the default) and one without it: without it the slow step's keys, never measured
again while every step speculates, price plain decoding for good and the draft keeps drafting. Writes
benchmarks/results/stale_plain_step_<date>.json (accepted lengths and tokens/s per prompt, the final
plain-step estimate, every output compared with plain greedy decoding).
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from datetime import date

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from specdec import HFCausalLM, SpeculativeDecoder  # noqa: E402
from specdec.bench.record import cpu_name, git_commit, loadavg, write_record  # noqa: E402
from specdec.bench.workloads import PROMPT_SETS, chat_ids  # noqa: E402
from specdec.drafters import DraftModel  # noqa: E402
from specdec.models.bundled import load_bundled  # noqa: E402

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")


def _run(model, draft, prompts, tok, monotone: bool, hiccup: float, max_new: int, refs) -> dict:
    target = HFCausalLM(model)
    dec = SpeculativeDecoder(target, DraftModel(HFCausalLM(draft), k=6), max_batch=1, max_len=1024, policy="goodput",
                             kv_cache="dense")
    cost = dec.scheduler.cost
    for table in (cost.verify, cost.commit, cost.rest):
        table.monotone = monotone
    forward = target.forward
    slow = [True]

    def delayed(cache, tokens, *args, **kwargs):  # the decoder's first plain step (one node) runs late once
        if slow[0] and tokens.shape[1] == 1:
            slow[0] = False
            time.sleep(hiccup)
        return forward(cache, tokens, *args, **kwargs)

    target.forward = delayed
    dec.generate([prompts[0]], max_new_tokens=8, eos_token_id=tok.eos_token_id)  # warm-up: the slow step is here
    runs = []
    for i, p in enumerate(prompts):
        out = dec.generate([p], max_new_tokens=max_new, eos_token_id=tok.eos_token_id)
        m = out.metrics
        runs.append(dict(prompt=i, tokens_per_second=m["tokens_per_second"],
                         mean_accepted_length=m["mean_accepted_length"], identical=out.tokens == refs[i]))
    return dict(monotone=monotone, runs=runs, plain_seconds_estimate=cost.plain_seconds(1))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--hiccup-ms", type=float, default=40.0)
    ap.add_argument("--max-new-tokens", type=int, default=96)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--name", default=None)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    model, tok, draft = load_bundled(precision="q4_1", draft="w8", act="q8")
    prompts = [chat_ids(tok, t) for t in PROMPT_SETS["code"]]
    plain = SpeculativeDecoder(HFCausalLM(model), None, max_batch=1, max_len=1024, kv_cache="dense")
    refs = [plain.generate([p], max_new_tokens=args.max_new_tokens, eos_token_id=tok.eos_token_id).tokens
            for p in prompts]
    load = [loadavg()]
    sides = []
    for monotone in (False, True):
        sides.append(_run(model, draft, prompts, tok, monotone, args.hiccup_ms / 1e3, args.max_new_tokens, refs))
        load.append(loadavg())
    for s in sides:
        print(f"monotone cap {s['monotone']!s:5s} accepted "
              f"{[round(r['mean_accepted_length'], 2) for r in s['runs']]} tok/s "
              f"{[round(r['tokens_per_second'], 1) for r in s['runs']]} plain estimate "
              f"{s['plain_seconds_estimate'] * 1e3:.2f} ms")
    rec = dict(benchmark="stale_plain_step", args=vars(args), commit=git_commit(), cpu=cpu_name(), loadavg=load,
               sides=sides, notes="2 shared CPU cores; greedy, batch 1; the w8 draft (k 6) under the goodput policy on "
                                  "the code prompt set at Q4_1 + q8 act, the decoder's first plain step delayed once")
    write_record(RESULTS, args.name or f"stale_plain_step_{date.today().isoformat()}", rec)


if __name__ == "__main__":
    main()
