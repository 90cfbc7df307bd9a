"""SmolLM2-135M decoding on a GPU: eager forwards vs CUDA-graph replays (specdec.graphs).

    python benchmarks/bench_graphs.py [--new 64] [--rounds 3] [--out FILE]

Needs a CUDA device and a CUDA build of specdec (exits 2 otherwise). Loads the bundled target
(fp32) on the GPU and measures, interleaved round by round:
  * one forward of N = 1 and N = 8 nodes over a 150-token prefix: eager vs replay (CUDA events,
    median of 50 after warm-up), and whether a replay synchronises with the host
    (torch.cuda.set_sync_debug_mode("error") around it);
  * greedy generation (plain and prompt lookup, batch 1, --new tokens) through
    SpeculativeDecoder(lm) and SpeculativeDecoder(GraphedForward(lm)): tokens/s, and the outputs
    must be equal.
Target (issue: forward passes at the roofline): decode >= 5x faster captured than eager.
Writes JSON (default benchmarks/results/graphs_<date>.json).
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

PROMPTS = [
    "Explain why the sky is blue in two sentences.",
    "Copy this list exactly: alpha, bravo, charlie, delta, echo, foxtrot, golf, hotel, india, juliet.\nCopy:",
    "Write a short story about a robot learning to paint.",
]


def forward_ms(fn, reps: int = 50) -> float:
    for _ in range(5):
        fn()
    torch.cuda.synchronize()
    ts = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        ts.append(a.elapsed_time(b))
    return statistics.median(ts)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--new", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    import specdec

    if not (torch.cuda.is_available() and specdec.build_info().get("cuda")):
        print("needs a CUDA device and a CUDA build of specdec", file=sys.stderr)
        return 2
    from specdec import HFCausalLM, PromptLookup, SpeculativeDecoder
    from specdec.bench import git_commit as _git_commit, record_path as _record_path
    from specdec.graphs import GraphedForward
    from specdec.models import load_bundled

    model, tok = load_bundled("smollm2-135m")[:2]
    lm = HFCausalLM(model.cuda())
    graphed = GraphedForward(lm)

    # ---- one forward
    fwd = {}
    for N in (1, 8):
        cache = lm.new_cache(1, 512)
        lm.prefill(cache, [list(range(1, 151))])
        tokens = torch.zeros(1, N, dtype=torch.long, device="cuda")
        depths = torch.arange(N, device="cuda")[None]
        fwd[f"eager N={N} ms"] = round(forward_ms(lambda: lm.forward(cache, tokens, depths)), 4)
        fwd[f"replay N={N} ms"] = round(forward_ms(lambda: graphed.forward(cache, tokens, depths)), 4)
        torch.cuda.set_sync_debug_mode("error")
        try:
            graphed.forward(cache, tokens, depths)
            fwd[f"replay N={N} host sync"] = False
        except RuntimeError as e:
            fwd[f"replay N={N} host sync"] = str(e).splitlines()[0]
        finally:
            torch.cuda.set_sync_debug_mode("default")
        fwd[f"speedup N={N}"] = round(fwd[f"eager N={N} ms"] / fwd[f"replay N={N} ms"], 2)

    # ---- generation
    def chat(t):
        ids = tok.apply_chat_template([{"role": "user", "content": t}], add_generation_prompt=True)
        return list(ids["input_ids"] if hasattr(ids, "keys") else ids)

    prompts = [chat(p) for p in PROMPTS]
    methods = {
        "eager plain": SpeculativeDecoder(lm, None, max_batch=1, max_len=512),
        "graphs plain": SpeculativeDecoder(graphed, None, max_batch=1, max_len=512),
        "eager lookup": SpeculativeDecoder(lm, PromptLookup(ngram=3, k=10), max_batch=1, max_len=512),
        "graphs lookup": SpeculativeDecoder(graphed, PromptLookup(ngram=3, k=10), max_batch=1, max_len=512),
    }
    rates = {m: [] for m in methods}
    outputs = {}
    for r in range(a.rounds + 1):  # round 0 warms up (and captures the buckets)
        for i, ids in enumerate(prompts):
            for name, dec in methods.items():
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                out = dec.generate([ids], max_new_tokens=a.new, eos_token_id=tok.eos_token_id)
                torch.cuda.synchronize()
                dt = time.perf_counter() - t0
                outputs[(name, i)] = out.tokens[0]
                if r:
                    rates[name].append(len(out.tokens[0]) / dt)
    equal = all(outputs[(f"graphs {m}", i)] == outputs[(f"eager {m}", i)] for m in ("plain", "lookup")
                for i in range(len(prompts)))
    gen = {name: round(statistics.median(v), 1) for name, v in rates.items()}
    gen["graphs / eager plain"] = round(gen["graphs plain"] / gen["eager plain"], 2)
    gen["graphs / eager lookup"] = round(gen["graphs lookup"] / gen["eager lookup"], 2)

    print(f"# SmolLM2-135M fp32 on {torch.cuda.get_device_name(0)}: forward (150-token prefix) and greedy "
          f"generation, batch 1, {a.new} new tokens")
    for k, v in {**fwd, **gen}.items():
        print(f"{k:<28} {v}")
    print(f"outputs equal (graphs == eager): {equal}; captures {graphed.captures}, replays {graphed.replays}")
    commit = _git_commit()
    now = _dt.datetime.now()
    out = Path(a.out) if a.out else ROOT / "benchmarks" / "results" / f"graphs_{now:%Y-%m-%d}.json"
    out.write_text(json.dumps(dict(date=now.isoformat(timespec="seconds"), commit=commit, torch=torch.__version__,
                                   device=torch.cuda.get_device_name(0), new_tokens=a.new, rounds=a.rounds,
                                   forward=fwd, tokens_per_second=gen, outputs_equal=equal,
                                   captures=graphed.captures, replays=graphed.replays, out=_record_path(out)),
                              indent=2))
    print(f"# wrote {_record_path(out)}")
    return 0 if equal else 1


if __name__ == "__main__":
    sys.exit(main())
