"""The lean forward's layers as one DecoderStack call vs the per-layer Python loop (CPU).

    python benchmarks/bench_stack.py [--rounds 9] [--reps 10] [--threads 2] [--new 32]

One process, the bundled SmolLM2-135M at q4_1 + q8 activations, q4_1, q8_0 + q8 activations and
q8_0 (one model per precision, each with one HFCausalLM adapter whose runner switches between
``runner.stack`` (the default: every fused layer in one torch.classes.specdec.DecoderStack call) and
None (one ops.decoder_layer call per layer from Python)). Per round and form (alternating order):
the mean of --reps forwards of N = 1 and N = 8 chain nodes over a 150-token prefix (a decode step
and a verify pass), one precision after the other (its weights stay in the caches between its
steps, as when decoding with one model; interleaving four models would evict them); then greedy
generation tokens/s of each precision and form (plain decoding, --new tokens on 4 chat prompts, the
two forms interleaved prompt by prompt, one precision after the other). Before timing, each
precision's logits of the two forms are checked equal (bit for bit). Reported: medians, and stack /
loop ratios (medians of the per-round ratios). Writes benchmarks/results/stack_cpu_<date>.json
(load average recorded).
"""
from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

PROMPTS = ["Explain why the sky is blue in two sentences.", "Write a short story about a robot learning to paint.",
           "Copy this list exactly: alpha, bravo, charlie, delta, echo, foxtrot, golf, hotel.\nCopy:",
           "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\""]
PREFIX = 150


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--new", type=int, default=32)
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    import specdec
    from specdec.models import load_bundled
    from specdec.models.quant import set_activation_quant

    lms, caches, stacks = {}, {}, {}
    for prec in ("q4_1+q8act", "q4_1", "q8_0+q8act", "q8_0"):
        m, tok = load_bundled("smollm2-135m", precision=prec.split("+")[0])
        if prec.endswith("q8act"):
            set_activation_quant(m, "q8")
        lm = specdec.HFCausalLM(m)
        assert lm._runner is not None and lm._runner.stack is not None, prec
        lms[prec], stacks[prec] = lm, lm._runner.stack
        caches[prec] = lm.new_cache(1, 512)
        lm.prefill(caches[prec], [list(range(1, PREFIX + 1))])

    def use(prec, form):
        lms[prec]._runner.stack = stacks[prec] if form == "stack" else None

    forms = ("stack", "loop")
    for prec, lm in lms.items():  # the two forms give the same bits
        tk, dep = torch.zeros(1, 8, dtype=torch.long), torch.arange(8)[None]
        out = []
        for form in forms:
            use(prec, form)
            out.append(lm.forward(caches[prec], tk, dep))
        assert torch.equal(out[0], out[1]), f"{prec}: the stack's logits differ from the loop's"
    times = {(p, f, n): [] for p in lms for f in forms for n in (1, 8)}
    for prec, lm in lms.items():  # one precision at a time (its weights stay cached, as in decoding)
        for r in range(a.rounds + 1):  # round 0 warms up
            for n in (1, 8):
                tk, dep = torch.zeros(1, n, dtype=torch.long), torch.arange(n)[None]
                for form in (forms if r % 2 else forms[::-1]):
                    use(prec, form)
                    lm.forward(caches[prec], tk, dep)
                    t0 = time.perf_counter()
                    for _ in range(a.reps):
                        lm.forward(caches[prec], tk, dep)
                    if r:
                        times[(prec, form, n)].append((time.perf_counter() - t0) / a.reps)
    step_ms = {f"{p} {f} N={n}": round(statistics.median(v) * 1e3, 3) for (p, f, n), v in times.items()}
    ratio = {f"{p} N={n}": round(statistics.median(s / l for s, l in zip(times[(p, "stack", n)],
                                                                         times[(p, "loop", n)])), 3)
             for p in lms for n in (1, 8)}

    def chat(t):
        r = tok.apply_chat_template([{"role": "user", "content": t}], add_generation_prompt=True, tokenize=True)
        return list(r["input_ids"] if hasattr(r, "keys") else r)

    prompts = [chat(t) for t in PROMPTS]
    decoders = {p: specdec.SpeculativeDecoder(lm, None, max_batch=1, max_len=512) for p, lm in lms.items()}
    tps = {f"{p} {f}": [] for p in lms for f in forms}
    same = True
    for prec, dec in decoders.items():
        for i, ids in enumerate(prompts):
            outs = []
            for form in (forms if i % 2 else forms[::-1]):
                use(prec, form)
                t0 = time.perf_counter()
                out = dec.generate([ids], max_new_tokens=a.new, eos_token_id=tok.eos_token_id)
                tps[f"{prec} {form}"].append(len(out.tokens[0]) / (time.perf_counter() - t0))
                outs.append(out.tokens[0])
            same = same and outs[0] == outs[1]
    for prec in lms:
        use(prec, "stack")
    tokens_per_s = {k: round(statistics.median(v), 2) for k, v in tps.items()}
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                            cwd=ROOT).stdout.strip()
    res = {"date": _dt.date.today().isoformat(), "commit": commit, "threads": torch.get_num_threads(),
           "loadavg": os.getloadavg(), "rounds": a.rounds, "reps": a.reps, "prefix": PREFIX, "new": a.new,
           "step_ms_median": step_ms, "stack_over_loop_per_round": ratio, "tokens_per_s_plain": tokens_per_s,
           "tokens_per_s_per_prompt": {k: [round(x, 2) for x in v] for k, v in tps.items()},
           "generations_equal": same,
           "step_ms_rounds": {f"{p} {f} N={n}": [round(t * 1e3, 3) for t in v] for (p, f, n), v in times.items()},
           "notes": "2 shared CPU cores (load average recorded); the stack and the loop run the same decoder_layer "
                    "calls (checked: equal logits and equal generations)"}
    out = Path(a.out) if a.out else ROOT / "benchmarks" / "results" / f"stack_cpu_{res['date']}.json"
    out.write_text(json.dumps(res, indent=1))
    print(json.dumps({k: res[k] for k in ("loadavg", "step_ms_median", "stack_over_loop_per_round",
                                          "tokens_per_s_plain", "generations_equal")}, indent=1))
    print("wrote", out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
