"""The bundled SmolLM2-135M at the checkpoint's own precision vs float32, end to end (CPU).

    python benchmarks/bench_precision.py [--rounds 3] [--new 48] [--threads 2] [--llama-python PY]

Targets: fp32 (the dequantized weights, 538 MB per forward), q8_0 (group-quantized 8-bit),
q4_1 (the GGUF's own Q4_1 layers + Q8_0 head, ~98 MB) and q4_1+q8act (the same with activations
quantized per block of 32, ``qlinear(act="q8")``: a different model; --no-q8act leaves it out).
For each: the latency of one forward of 1 and 8 new nodes over a 150-token prefix (medians), and
greedy generation tokens/s with
plain decoding and with prompt lookup on grounded and open prompts — every configuration
interleaved prompt by prompt, medians of per-prompt ratios against fp32 plain. Each
quantized configuration's speculative output is checked equal to its own plain greedy output.

The anchor: with --llama-python (or $SPECDEC_LLAMA_PYTHON) naming an interpreter that has
llama-cpp-python (built from source in a separate venv), llama.cpp runs the same GGUF (Q4_1 as
shipped, and its float32 copy), plain and with its prompt lookup, on the same prompt tokens and
thread count, interleaved with specdec's configurations (benchmarks/llamacpp_worker.py, one
subprocess). Without it the llama.cpp rows are skipped and the JSON says so.
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


class LlamaWorker:
    """benchmarks/llamacpp_worker.py in the given interpreter, spoken to over JSON lines."""

    def __init__(self, python: str, threads: int) -> None:
        from specdec.models.bundled import _BUNDLED, _package_gguf, bundled_cache_dir

        gguf = _package_gguf(_BUNDLED["smollm2-135m"])
        f32 = bundled_cache_dir() / (gguf.stem.rsplit(".", 1)[0] + ".F32.gguf")
        self.proc = subprocess.Popen(
            [python, str(ROOT / "benchmarks" / "llamacpp_worker.py"), "--gguf", str(gguf), "--f32-gguf", str(f32),
             "--threads", str(threads)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        hello = json.loads(self.proc.stdout.readline())
        self.configs = hello["ready"]
        self.version = hello["version"]

    def generate(self, config: str, ids, max_tokens: int, eos: int):
        self.proc.stdin.write(json.dumps(dict(config=config, ids=list(ids), max_tokens=max_tokens, eos=eos)) + "\n")
        self.proc.stdin.flush()
        r = json.loads(self.proc.stdout.readline())
        return r["tokens"], r["seconds"]

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait(timeout=60)


def start_llama(python, threads):
    if not python:
        return None, "skipped: no --llama-python / SPECDEC_LLAMA_PYTHON (an interpreter with llama-cpp-python)"
    try:
        w = LlamaWorker(python, threads)
    except Exception as e:  # the anchor is optional: say why it is missing
        return None, f"skipped: the llama.cpp worker did not start ({type(e).__name__}: {e})"
    return w, f"llama-cpp-python {w.version}, threads {threads}"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--new", type=int, default=48)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--out", default=None)
    ap.add_argument("--no-q8act", action="store_true",
                    help="leave out q4_1+q8act (the GGUF's Q4_1 with quantized activations, qlinear act='q8')")
    ap.add_argument("--llama-python", default=os.environ.get("SPECDEC_LLAMA_PYTHON"),
                    help="a Python with llama-cpp-python: adds llama.cpp rows on the same GGUF")
    a = ap.parse_args()
    if a.threads:
        torch.set_num_threads(a.threads)
    import specdec
    from specdec.models import load_bundled

    models = {}
    tok = None
    for prec in ("fp32", "q8_0", "q4_1") + (() if a.no_q8act else ("q4_1+q8act",)):
        base, _, act = prec.partition("+")
        m, tok = load_bundled("smollm2-135m", precision=base, act="q8" if act else None)
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

    llama, llama_note = start_llama(a.llama_python, torch.get_num_threads())
    print("llama.cpp:", llama_note, flush=True)

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
                for name in (llama.configs if llama else ()):
                    toks, dt = llama.generate(name, ids, a.new, tok.eos_token_id)
                    outs[name] = toks
                    row[name] = len(toks) / dt
                if llama:
                    strip = lambda t: t[:-1] if t and t[-1] == tok.eos_token_id else t  # noqa: E731
                    for p in ("fp32", "q4_1"):
                        row[f"llama.cpp {p} plain == specdec {p} plain"] = (
                            outs[f"llama.cpp {p} plain"] == strip(outs[f"{p} plain"]))
                for p in models:
                    row[f"{p} lookup == plain"] = outs[f"{p} lookup"] == outs[f"{p} plain"]
                records.append(row)
                print(set_name, i, {k: (round(v, 1) if isinstance(v, float) else v) for k, v in row.items()
                                    if k not in ("set", "prompt", "round")}, flush=True)
    summary = {}
    names = list(methods) + (llama.configs if llama else [])
    for set_name in sets:
        rows = [x for x in records if x["set"] == set_name]
        summary[set_name] = {}
        for m in names:
            e = {"tokens_per_second": round(statistics.median(x[m] for x in rows), 2),
                 "vs_fp32_plain": round(statistics.median(x[m] / x["fp32 plain"] for x in rows), 3)}
            if llama:
                for ref in ("llama.cpp q4_1 plain", "llama.cpp fp32 plain"):
                    e[f"vs {ref}"] = round(statistics.median(x[m] / x[ref] for x in rows), 3)
            summary[set_name][m] = e
    if llama:
        llama.close()
    equal = all(x[f"{p} lookup == plain"] for x in records for p in models)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                            cwd=ROOT).stdout.strip()
    from specdec.bench.record import cpu_name

    res = {"date": _dt.date.today().isoformat(), "commit": commit, "cpu": cpu_name(),
           "threads": torch.get_num_threads(), "loadavg": os.getloadavg(), "max_new_tokens": a.new, "rounds": a.rounds,
           "llama_cpp": llama_note, "forward_ms_median": forward, "summary": summary,
           "speculative_equals_plain": equal, "records": records}
    out = Path(a.out) if a.out else ROOT / "benchmarks" / "results" / f"precision_{res['date']}.json"
    out.write_text(json.dumps(res, indent=1))
    print(json.dumps({"forward_ms_median": forward, "summary": summary, "equal": equal, "loadavg": res["loadavg"]},
                     indent=1))
    print("wrote", out)
    return 0 if equal else 1


if __name__ == "__main__":
    sys.exit(main())
