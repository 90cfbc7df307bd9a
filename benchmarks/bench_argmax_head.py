"""The LM head's argmax op (``ops.qlinear_argmax`` / ``ops.linear_argmax``) against the logits and the
verification op, CPU: the op alone and greedy plain decoding end to end.

    python benchmarks/bench_argmax_head.py [--rounds 7] [--new 160] [--threads 2] [--precision q4_1]

1. The head of the bundled model (q4_1 with q8 activations: the Q8_0 head in the CPU's packed layout; or the
   --precision asked for), on M = 1 / 3 / 8 rows of real final hidden states: the head's logits then
   ``ops.greedy_verify`` of a root-only tree (what a greedy plain step ran before) against the argmax op; warm,
   interleaved, medians of per-round medians; the tokens equal.
2. Greedy plain decoding in the Engine (one request of a 150-token prompt per round), two engines over the
   same model, the target's ``argmax_head`` on and off, stepping in turn (each step follows the other engine's
   pass, as cold as decoding runs it): per round the median step; the ratio on / off per round, its median;
   the generated tokens equal.
Writes benchmarks/results/argmax_head_<date>.json (load average recorded).
"""
from __future__ import annotations

import argparse
import datetime as _dt
import json
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from specdec.bench.record import cpu_name, git_commit, loadavg  # noqa: E402


def _op_part(lm, rounds: int, reps: int) -> dict:
    from specdec import ops

    runner = lm._runner
    cache = lm.new_cache(1, 256)
    prompt = [1 + (i * 37) % 4000 for i in range(150)]
    lm.prefill(cache, [prompt])
    toks = torch.tensor([prompt[-8:]])
    hidden = lm.forward_hidden(cache, toks, torch.arange(8, dtype=torch.int32).view(1, 8))[0]   # [8, H]
    out = {}
    for m in (1, 3, 8):
        x = hidden[:m].contiguous()
        tokens = torch.zeros(m, 1, dtype=torch.int64)
        parents = torch.full((m, 1), -1, dtype=torch.int32)

        def logits_verify(x=x, tokens=tokens, parents=parents, m=m):
            return ops.greedy_verify(tokens, parents, runner.lm_head(x).float().view(m, 1, -1))[2][:, 0]

        def argmax(x=x):
            return runner.head_argmax(x)
        assert torch.equal(logits_verify(), argmax()), m
        times = {"logits_verify": [], "argmax": []}
        for r in range(rounds + 1):
            for name, fn in (("logits_verify", logits_verify), ("argmax", argmax))[:: 1 if r % 2 else -1]:
                t0 = time.perf_counter()
                for _ in range(reps):
                    fn()
                if r:
                    times[name].append((time.perf_counter() - t0) / reps * 1e3)
        row = {k: round(statistics.median(v), 4) for k, v in times.items()}
        row["ratio"] = round(statistics.median(a / b for a, b in zip(times["argmax"], times["logits_verify"])), 4)
        out[f"M{m}"] = row
        print(f"head, {m} rows: logits + greedy_verify {row['logits_verify']:.4f} ms, argmax {row['argmax']:.4f} ms, "
              f"ratio {row['ratio']:.3f}")
    return out


def _engine_part(model, rounds: int, new: int, prompts=None) -> dict:
    import specdec
    from specdec import Engine, PromptLookup, RequestParams

    engines, lms = {}, {}
    for name, on in (("argmax", True), ("logits", False)):
        lm = lms[name] = specdec.HFCausalLM(model)
        lm.argmax_head = on
        # prompts given: prompt lookup (k 10, fixed policy: both engines draft alike), its greedy chains verified
        # by the argmax head + greedy_verify on the argmaxes, or by the logits (or the lazy head where it plans so)
        engines[name] = Engine(lm, PromptLookup(ngram=3, k=10) if prompts else None, max_batch=1, max_len=1024,
                               policy="fixed" if prompts else "goodput")
    assert lms["argmax"].greedy_head and not lms["logits"].greedy_head
    steps = {k: [] for k in engines}
    outputs = {k: [] for k in engines}
    for r in range(rounds + 1):  # round 0 warms up
        order = list(engines) if r % 2 == 0 else list(engines)[::-1]
        per, toks = {k: [] for k in order}, {k: [] for k in order}
        for name in order:
            prompt = prompts[r % len(prompts)] if prompts else [1 + (i * 37 + r) % 4000 for i in range(150)]
            engines[name].add_request(f"{name}{r}", prompt, RequestParams(max_new_tokens=new))
            engines[name].step()  # admission and prefill
        while any(e.has_unfinished() for e in engines.values()):
            for name in order:  # the two engines step by step in turn: each step follows the other's pass
                eng = engines[name]
                if not eng.has_unfinished():
                    continue
                t0 = time.perf_counter()
                got = eng.step()
                per[name].append(time.perf_counter() - t0)
                for o in got:
                    toks[name] += list(o.new_tokens)
        if r:
            for name in order:
                steps[name].append(statistics.median(per[name]) * 1e3)
                outputs[name].append(toks[name])
    same = outputs["argmax"] == outputs["logits"]
    ratio = statistics.median(a / b for a, b in zip(steps["argmax"], steps["logits"]))
    res = {"step_ms": {k: round(statistics.median(v), 4) for k, v in steps.items()}, "ratio_argmax_to_logits":
           round(ratio, 4), "rounds_ms": steps, "tokens_equal": same}
    what = "lookup, grounded" if prompts else "plain decoding"
    print(f"{what}: step {res['step_ms']['argmax']:.3f} ms with the argmax head, "
          f"{res['step_ms']['logits']:.3f} ms with the logits; ratio {ratio:.4f}; tokens equal: {same}")
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--new", type=int, default=160)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--precision", default="q4_1", choices=["q4_1", "q8_0", "fp32"])
    ap.add_argument("--act", default="q8", choices=["q8", "none"])
    ap.add_argument("--lookup", action="store_true",
                    help="the Engine part with prompt lookup on the grounded prompts (speculative greedy steps)")
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    import specdec
    from specdec.models import load_bundled

    act = None if a.act == "none" or a.precision == "fp32" else a.act
    model, tok = load_bundled("smollm2-135m", precision=a.precision, act=act)
    prompts = None
    if a.lookup:
        from specdec.bench.workloads import PROMPT_SETS, chat_ids

        prompts = [chat_ids(tok, t) for t in PROMPT_SETS["grounded"]]
    load = [loadavg()]
    op = _op_part(specdec.HFCausalLM(model), a.rounds, a.reps)
    engine = _engine_part(model, a.rounds, a.new, prompts)
    load.append(loadavg())
    res = {"benchmark": "argmax_head", "date": _dt.date.today().isoformat(), "commit": git_commit(),
           "cpu": cpu_name(), "threads": a.threads, "precision": a.precision, "act": act, "rounds": a.rounds,
           "new_tokens": a.new, "loadavg": load, "head": op,
           ("lookup_grounded" if a.lookup else "plain_decoding"): engine,
           "notes": "head: warm calls on real final hidden states, interleaved, medians of per-round medians; "
                    "plain decoding: two Engines, no drafter, greedy, one 150-token prompt per round each, "
                    "argmax_head on / off stepping in turn; ratio = median over rounds of (step with the argmax op "
                    "/ step with logits)"}
    suffix = "" if (a.precision, act) == ("q4_1", "q8") else f"_{a.precision}" + ("_floatact" if act is None and
                                                                                  a.precision != "fp32" else "")
    suffix += "_lookup" if a.lookup else ""
    path = Path(a.out) if a.out else ROOT / "benchmarks" / "results" / f"argmax_head{suffix}_{res['date']}.json"
    path.write_text(json.dumps(res, indent=1))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
