"""Prefill on the CPU: specdec's GEMM tiles (csrc/include/specdec/cpu_gemm.h) against what they replace.

    python benchmarks/bench_prefill.py [--rounds 7] [--threads 2] [--out FILE]

Float32 linears of 65-256 rows (prefill sizes; fewer rows are decode / verify sizes and take the
few-row kernel, more take the BLAS GEMM) and group-quantized (qlinear), int8 and float16 / bfloat16 ones of
more than 64 rows run
on specdec's GEMM tiles on an AVX2 CPU (quantized weights decoded once per 96-row chunk);
``specdec._C.set_cpu_gemm(False)`` sends them back to torch's BLAS GEMM (MKL in the x86 wheels) and
to the few-row quantized kernel (32 rows per pass; int8 weights too) respectively, so both run in ONE process,
interleaved round by round (medians):

  layers   the bundled SmolLM2-135M target's four projection shapes of a layer (qkv 960 x 576,
           o 576 x 576, gate_up 3072 x 576, down 576 x 1536) at M = 65, 72, 100, 144, 200, 256 rows:
           ms per layer, G multiply-adds / s, tiles / BLAS speed-up;
  prefill  HFCausalLM.prefill of the bundled target (the lean forward) at float32, bfloat16, Q4_1
           (the GGUF's own blocks) and Q8_0, and of its weight-only int8 draft (w8, which prefills the prompt
           too when it drafts), for prompts of 72, 143, 256 and 512 tokens (TTFT without the first
           sampling step): ms, speed-up.

The greedy next token of each prompt must be the same both ways (recorded with the largest logit
difference). Writes benchmarks/results/prefill_cpu_<date>.json with the commit, the CPU and the
load average at start and end.
"""
from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)]   # (N, K): qkv, o, gate_up, down
ROWS = (65, 72, 100, 144, 200, 256)
PROMPTS = (72, 143, 256, 512)
PRECISIONS = ("fp32", "bf16", "q4_1", "q8_0", "w8")   # w8: the weight-only int8 draft


def timed(f) -> float:
    t0 = time.perf_counter()
    f()
    return time.perf_counter() - t0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    from bench_e2e import cpu_name, git_commit
    from specdec import HFCausalLM, _C, ops
    from specdec.bench import record_path as _record_path
    from specdec.models import load_bundled

    if not _C.cpu_gemm():
        raise SystemExit("bench_prefill: specdec._C.cpu_gemm() is off at start")
    load_start = os.getloadavg()
    modes = {"tiles": True, "off": False}
    g = torch.Generator().manual_seed(0)

    # ---- layers
    data = {M: [(torch.randn(M, K, generator=g), torch.randn(N, K, generator=g) / K ** 0.5) for N, K in SHAPES]
            for M in ROWS}
    lt = {(M, m): [] for M in ROWS for m in modes}
    for r in range(args.rounds + 1):
        for M in ROWS:
            for m, on in modes.items():
                _C.set_cpu_gemm(on)
                t = sum(timed(lambda: ops.linear(x, w)) for x, w in data[M])
                if r:
                    lt[(M, m)].append(t)
    _C.set_cpu_gemm(True)
    layers = []
    for M in ROWS:
        mac = M * sum(N * K for N, K in SHAPES)
        row = dict(rows=M)
        for m in modes:
            t = statistics.median(lt[(M, m)])
            row[f"{m} ms"] = round(1e3 * t, 3)
            row[f"{m} GMAC/s"] = round(mac / t / 1e9, 1)
        row["tiles / blas speed-up"] = round(row["off ms"] / row["tiles ms"], 3)
        layers.append(row)
        print(f"layer M={M}: tiles {row['tiles ms']:.2f} ms ({row['tiles GMAC/s']} GMAC/s), "
              f"blas {row['off ms']:.2f} ms ({row['off GMAC/s']} GMAC/s): {row['tiles / blas speed-up']:.3f}x",
              flush=True)

    # ---- whole prefill of the bundled target
    def load(p):
        if p == "w8":
            return load_bundled("smollm2-135m", draft="w8")[2]
        if p == "bf16":
            return load_bundled("smollm2-135m", dtype=torch.bfloat16)[0]
        return load_bundled("smollm2-135m", precision=p)[0]

    lms = {p: HFCausalLM(load(p)) for p in PRECISIONS}
    caches = {p: lm.new_cache(1, max(PROMPTS) + 8) for p, lm in lms.items()}
    vocab = lms["fp32"].vocab_size
    prompts = {n: torch.randint(0, vocab, (n,), generator=g).tolist() for n in PROMPTS}
    pt = {(p, n, m): [] for p in PRECISIONS for n in PROMPTS for m in modes}
    logits = {}
    for r in range(args.rounds + 1):
        for p, lm in lms.items():
            for n in PROMPTS:
                for m, on in modes.items():
                    _C.set_cpu_gemm(on)
                    caches[p].lens.zero_()
                    t0 = time.perf_counter()
                    out = lm.prefill(caches[p], [prompts[n]], rows=[0])
                    if r:
                        pt[(p, n, m)].append(time.perf_counter() - t0)
                    logits[(p, n, m)] = out
    _C.set_cpu_gemm(True)
    prefill = []
    for p in PRECISIONS:
        for n in PROMPTS:
            row = dict(precision=p, prompt_tokens=n)
            for m in modes:
                row[f"{m} ms"] = round(1e3 * statistics.median(pt[(p, n, m)]), 2)
            row["tiles / off speed-up"] = round(row["off ms"] / row["tiles ms"], 3)
            a, b = logits[(p, n, "tiles")], logits[(p, n, "off")]
            row["same argmax"] = bool(torch.equal(a.argmax(-1), b.argmax(-1)))
            row["max |logit diff|"] = float((a - b).abs().max())
            prefill.append(row)
            print(f"prefill {p} {n} tokens: tiles {row['tiles ms']} ms, off {row['off ms']} ms: "
                  f"{row['tiles / off speed-up']:.3f}x (max |logit diff| {row['max |logit diff|']:.2e})", flush=True)

    now = _dt.datetime.now()
    out = Path(args.out) if args.out else ROOT / "benchmarks" / "results" / f"prefill_cpu_{now:%Y-%m-%d}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(dict(
        benchmark="prefill_cpu", date=now.isoformat(timespec="seconds"), commit=git_commit(), cpu=cpu_name(),
        torch=torch.__version__, threads=torch.get_num_threads(), rounds=args.rounds,
        load_average_start=load_start, load_average_end=os.getloadavg(), out=_record_path(out),
        keys={"tiles": "specdec's GEMM tiles (cpu_gemm.h), the default",
              "off": "set_cpu_gemm(False): torch's BLAS GEMM (float32 layers), the few-row kernel (quantized)",
              "GMAC/s": "multiply-adds per second over the four projections of one layer"},
        layers=layers, prefill=prefill), indent=1))
    print(f"wrote {_record_path(out)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
