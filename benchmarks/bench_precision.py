"""The bundled SmolLM2-135M at the checkpoint's own precision vs float32, end to end (CPU).

    python benchmarks/bench_precision.py [--rounds 3] [--new 48] [--threads 2]

Targets: fp32 (the dequantized weights, 538 MB per forward), q8_0 (group-quantized 8-bit) and
q4_1 (the GGUF's own Q4_1 layers + Q8_0 head, ~98 MB). For each: the latency of one forward
of 1 and 8 new nodes over a 150-token prefix (medians), and greedy generation tokens/s with
plain decoding and with prompt lookup on grounded and open prompts — every configuration
interleaved prompt by prompt, medians of per-prompt ratios against fp32 plain. Each
quantized configuration's speculative output is checked equal to its own plain greedy output.
Writes benchmarks/results/precision_<date>.json (load average recorded).
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

GROUNDED = [
    "Rewrite the following code with type hints:\n\ndef add(a, b):\n    return a + b\n\ndef scale(xs, f):\n"
    "    return [x * f for x in xs]\n\nAnswer:\n",
    "Copy this list exactly: alpha, bravo, charlie, delta, echo, foxtrot, golf, hotel, india, juliet.\nCopy:",
    "Text: The committee met on Monday and approved the budget for the new library, which will open in May.\n"
    "Repeat the text word for word: The committee",
    "Fix the typo and return the sentence: The quick brown fox jumsp over the lazy dog near the river bank.\n"
    "Fixed:",
]
OPEN = [
    "Explain why the sky is blue in two sentences.",
    "Write a short story about a robot learning to paint.",
    "What are three tips for staying productive while working from home?",
    "Describe the water cycle for a ten-year-old.",
]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--new", type=int, default=48)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    if a.threads:
        torch.set_num_threads(a.threads)
    import specdec
    from specdec.models import load_bundled

    models = {}
    tok = None
    for prec in ("fp32", "q8_0", "q4_1"):
        m, tok = load_bundled("smollm2-135m", precision=prec)
        models[prec] = specdec.HFCausalLM(m)

    # ---------------------------------------------------------------- forward latency
    prefix = list(range(1, 151))
    caches = {p: lm.new_cache(1, 512) for p, lm in models.items()}
    for p, lm in models.items():
        lm.prefill(caches[p], [prefix])
    fwd = {(p, N): [] for p in models for N in (1, 8)}
    for r in range(12):
        for N in (1, 8):
            tk, dep = torch.zeros(1, N, dtype=torch.long), torch.arange(N)[None]
            for p, lm in models.items():
                t0 = time.perf_counter()
                lm.forward(caches[p], tk, dep)
                if r >= 2:
                    fwd[(p, N)].append(time.perf_counter() - t0)
    forward = {f"{p} N={N}": round(statistics.median(v) * 1e3, 2) for (p, N), v in fwd.items()}
    print("forward ms (median):", forward, flush=True)

    # ---------------------------------------------------------------- generation
    def chat(t):
        r = tok.apply_chat_template([{"role": "user", "content": t}], add_generation_prompt=True, tokenize=True)
        return list(r["input_ids"] if hasattr(r, "keys") else r)

    sets = {"grounded": [chat(t) for t in GROUNDED], "open": [chat(t) for t in OPEN]}
    methods = {}
    for p, lm in models.items():
        methods[f"{p} plain"] = specdec.SpeculativeDecoder(lm, None, max_batch=1, max_len=512)
        methods[f"{p} lookup"] = specdec.SpeculativeDecoder(lm, specdec.PromptLookup(ngram=3, k=10), max_batch=1,
                                                            max_len=512)
    records = []
    for r in range(a.rounds):
        for set_name, prompts in sets.items():
            for i, ids in enumerate(prompts):
                row = {"set": set_name, "prompt": i, "round": r}
                outs = {}
                for name, dec in methods.items():
                    t0 = time.perf_counter()
                    out = dec.generate([ids], max_new_tokens=a.new, eos_token_id=tok.eos_token_id)
                    dt = time.perf_counter() - t0
                    outs[name] = out.tokens[0]
                    row[name] = len(out.tokens[0]) / dt
                for p in models:
                    row[f"{p} lookup == plain"] = outs[f"{p} lookup"] == outs[f"{p} plain"]
                records.append(row)
                print(set_name, i, {k: (round(v, 1) if isinstance(v, float) else v) for k, v in row.items()
                                    if k not in ("set", "prompt", "round")}, flush=True)
    summary = {}
    for set_name in sets:
        rows = [x for x in records if x["set"] == set_name]
        summary[set_name] = {m: {"tokens_per_second": round(statistics.median(x[m] for x in rows), 2),
                                 "vs_fp32_plain": round(statistics.median(x[m] / x["fp32 plain"] for x in rows), 3)}
                             for m in methods}
    equal = all(x[f"{p} lookup == plain"] for x in records for p in models)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=ROOT).stdout.strip()
    res = {"date": _dt.date.today().isoformat(), "commit": commit, "threads": torch.get_num_threads(),
           "loadavg": os.getloadavg(), "max_new_tokens": a.new, "rounds": a.rounds,
           "forward_ms_median": forward, "summary": summary, "speculative_equals_plain": equal, "records": records}
    out = Path(a.out) if a.out else ROOT / "benchmarks" / "results" / f"precision_{res['date']}.json"
    out.write_text(json.dumps(res, indent=1))
    print(json.dumps({"forward_ms_median": forward, "summary": summary, "equal": equal, "loadavg": res["loadavg"]},
                     indent=1))
    print("wrote", out)
    return 0 if equal else 1


if __name__ == "__main__":
    sys.exit(main())
