"""Decode-step cost with quantized activations (qlinear act="q8") vs float activations (CPU).

    python benchmarks/bench_q8act.py [--rounds 7] [--reps 5] [--threads 2] [--new 32]

Targets, one process, every configuration interleaved round by round: fp32, q8_0, q8_0 + q8
activations, q4_1 (the GGUF's own blocks + Q8_0 head), q4_1 + q8 activations (the q8_0 / q4_1 pairs
share one model: two HFCausalLM adapters). Per round and configuration: the mean time of --reps
forwards of N = 1, 2, 4, 8, 16 chain nodes over a 150-token prefix (a decode step at N = 1, a verify
pass above), and a read-bandwidth probe (torch.sum over a 256 MiB float32 buffer, the same threads)
between rounds. Reported: medians over rounds of ms per step, the N-node / 1-node ratios, the bytes a
step reads (linear weights + LM head + the prefix's K/V) over the measured bandwidth (the roofline
time) and the fraction of it achieved; then each quantized configuration alone ("one model": warm
consecutive steps as decoding runs them, and cold steps after a 1 GiB read that evicts its weights,
against a DRAM read probe on that 1 GiB buffer); then greedy generation tokens/s (plain decoding,
--new tokens on 4 prompts, interleaved across configurations and one configuration at a time).
llama.cpp is not run here (bench_precision.py holds that anchor).
Writes benchmarks/results/q8act_cpu_<date>.json (load average recorded: the machine is shared).
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
NODES = (1, 2, 4, 8, 16)
PREFIX = 150


def weight_bytes(model: torch.nn.Module) -> int:
    """Bytes of the linear layers' weights in ``model`` (any module) a forward streams (each tensor once; the
    head included for a whole model). The CPU's packed q8 layout holds exactly these bytes."""
    from specdec.models.quant import GroupQuantLinear

    seen, total = set(), 0
    for m in model.modules():
        if isinstance(m, GroupQuantLinear):
            ts = [m.qweight, m.scales, m.mins, m.bias]
        elif isinstance(m, torch.nn.Linear):
            ts = [m.weight, m.bias]
        else:
            continue
        for t in ts:
            if t is not None and t.data_ptr() not in seen:
                seen.add(t.data_ptr())
                total += t.numel() * t.element_size()
    return total


def bandwidth_gbs(buf: torch.Tensor):
    """(wall-clock GB/s, CPU-time GB/s) of one read of buf."""
    t0, c0 = time.perf_counter(), time.process_time()
    buf.sum()
    nbytes = buf.numel() * buf.element_size()
    return nbytes / (time.perf_counter() - t0) / 1e9, nbytes / max(time.process_time() - c0, 1e-9) / 1e9 * (
        torch.get_num_threads())


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--new", type=int, default=32)
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    import specdec
    from specdec import _C
    from specdec.models import load_bundled
    from specdec.models.quant import set_activation_quant

    fp32, tok = load_bundled("smollm2-135m")
    configs, models = {"fp32": specdec.HFCausalLM(fp32)}, {"fp32": fp32}
    for prec in ("q8_0", "q4_1"):
        m, _ = load_bundled("smollm2-135m", precision=prec)
        configs[prec] = specdec.HFCausalLM(m)
        set_activation_quant(m, "q8")
        configs[f"{prec}+q8act"] = specdec.HFCausalLM(m)  # built after the switch: its layers run act="q8"
        models[prec] = models[f"{prec}+q8act"] = m
    cfg = fp32.config
    kv_bytes = cfg.num_hidden_layers * 2 * PREFIX * cfg.num_key_value_heads * (
        cfg.hidden_size // cfg.num_attention_heads) * 4
    step_bytes = {c: weight_bytes(models[c]) + kv_bytes for c in configs}

    prefix = list(range(1, PREFIX + 1))
    caches = {c: lm.new_cache(1, 512) for c, lm in configs.items()}
    for c, lm in configs.items():
        lm.prefill(caches[c], [prefix])
    buf = torch.ones(64 << 20)
    # wall-clock and CPU time (process_time: what the step computed while it was scheduled; on an
    # oversubscribed machine the wall clock mostly measures the other processes)
    times = {(c, n): [] for c in configs for n in NODES}
    cpu = {(c, n): [] for c in configs for n in NODES}
    bws, bws_cpu = [], []
    for r in range(a.rounds + 1):  # round 0 warms up
        bw = [bandwidth_gbs(buf) for _ in range(3)]
        for n in NODES:
            tk, dep = torch.zeros(1, n, dtype=torch.long), torch.arange(n)[None]
            for c, lm in configs.items():
                t0, c0 = time.perf_counter(), time.process_time()
                for _ in range(a.reps):
                    lm.forward(caches[c], tk, dep)
                if r:
                    times[(c, n)].append((time.perf_counter() - t0) / a.reps)
                    cpu[(c, n)].append((time.process_time() - c0) / a.reps)
        if r:
            bws.append(max(b[0] for b in bw))
            bws_cpu.append(max(b[1] for b in bw))
        print(f"round {r}: " + ", ".join(f"{c} {cpu[(c, 1)][-1] * 1e3:.2f} ms cpu" for c in configs if r), flush=True)
    bandwidth, bandwidth_cpu = statistics.median(bws), statistics.median(bws_cpu)

    def med_ms(d):
        return {c: {n: round(statistics.median(d[(c, n)]) * 1e3, 3) for n in NODES} for c in configs}

    def ratios(d):
        return {c: {n: round(statistics.median(x / y for x, y in zip(d[(c, n)], d[(c, 1)])), 3) for n in NODES}
                for c in configs}

    step_ms, step_cpu_ms, ratio, ratio_cpu = med_ms(times), med_ms(cpu), ratios(times), ratios(cpu)
    threads = torch.get_num_threads()
    roofline = {c: {"bytes_per_step": step_bytes[c], "roofline_ms": round(step_bytes[c] / bandwidth / 1e6, 3),
                    "fraction_of_roofline": round(step_bytes[c] / bandwidth / 1e6 / step_ms[c][1], 3),
                    "roofline_cpu_ms": round(step_bytes[c] / bandwidth_cpu / 1e6, 3),
                    "fraction_of_roofline_cpu_time": round(
                        step_bytes[c] / bandwidth_cpu / 1e6 / (step_cpu_ms[c][1] / threads), 3)}
                for c in configs}

    # ---------------------------------------------------------------- one model at a time
    # The rounds above interleave five models (fp32 alone is 540 MB), so each step starts with its
    # weights evicted from the caches. Decoding runs one model: its weights (about 100 MB at q4_1)
    # stay in this CPU's 300 MB L3 between steps. Here each quantized configuration runs alone:
    # "warm" = consecutive steps (as decoding runs them), "cold" = each step after reading a 1 GiB
    # buffer (its weights come from DRAM); the DRAM read bandwidth is probed on that 1 GiB buffer
    # (larger than the L3, unlike the 256 MiB probe above).
    big = torch.ones(256 << 20)
    dram = [bandwidth_gbs(big)[0] for _ in range(3)]
    dram_bw = max(dram)
    single = {}
    for c in [c for c in configs if c != "fp32"]:
        lm = configs[c]
        row = {}
        for n in (1, 8):
            tk, dep = torch.zeros(1, n, dtype=torch.long), torch.arange(n)[None]
            warm, cold = [], []
            for _ in range(a.rounds):
                lm.forward(caches[c], tk, dep)  # warm-up of this round
                t0 = time.perf_counter()
                for _ in range(a.reps):
                    lm.forward(caches[c], tk, dep)
                warm.append((time.perf_counter() - t0) / a.reps)
                for _ in range(a.reps):
                    big.sum()
                    t0 = time.perf_counter()
                    lm.forward(caches[c], tk, dep)
                    cold.append(time.perf_counter() - t0)
            row[n] = {"warm_ms": round(statistics.median(warm) * 1e3, 3),
                      "cold_ms": round(statistics.median(cold) * 1e3, 3)}
        row["verify_8_vs_1_warm"] = round(row[8]["warm_ms"] / row[1]["warm_ms"], 3)
        row["dram_roofline_ms"] = round(step_bytes[c] / dram_bw / 1e6, 3)
        row["fraction_of_dram_roofline_cold"] = round(row["dram_roofline_ms"] / row[1]["cold_ms"], 3)
        single[c] = row
        print(f"{c} alone: N=1 warm {row[1]['warm_ms']} ms, cold {row[1]['cold_ms']} ms; N=8 warm "
              f"{row[8]['warm_ms']} ms; DRAM roofline {row['dram_roofline_ms']} ms", flush=True)

    # ---------------------------------------------------------------- greedy generation, plain decoding
    def chat(t):
        r = tok.apply_chat_template([{"role": "user", "content": t}], add_generation_prompt=True, tokenize=True)
        return list(r["input_ids"] if hasattr(r, "keys") else r)

    prompts = [chat(t) for t in PROMPTS]
    decoders = {c: specdec.SpeculativeDecoder(lm, None, max_batch=1, max_len=512) for c, lm in configs.items()}
    tps = {c: [] for c in configs}
    for ids in prompts:
        for c, dec in decoders.items():
            t0 = time.perf_counter()
            out = dec.generate([ids], max_new_tokens=a.new, eos_token_id=tok.eos_token_id)
            tps[c].append(len(out.tokens[0]) / (time.perf_counter() - t0))
    tokens_per_s = {c: round(statistics.median(v), 2) for c, v in tps.items()}
    tps_alone = {}  # each configuration's prompts back to back (its weights stay cached between them)
    for c, dec in decoders.items():
        dec.generate([prompts[0]], max_new_tokens=4, eos_token_id=tok.eos_token_id)
        v = []
        for ids in prompts:
            t0 = time.perf_counter()
            out = dec.generate([ids], max_new_tokens=a.new, eos_token_id=tok.eos_token_id)
            v.append(len(out.tokens[0]) / (time.perf_counter() - t0))
        tps_alone[c] = round(statistics.median(v), 2)
    q = "q4_1+q8act"
    targets = {
        "q4_1+q8act step <= 5 ms": {"wall_ms": step_ms[q][1], "cpu_ms_per_thread": step_cpu_ms[q][1] / threads,
                                    "met": step_ms[q][1] <= 5.0},
        "q4_1+q8act >= 65 % of the read roofline": {
            "wall": roofline[q]["fraction_of_roofline"], "cpu_time": roofline[q]["fraction_of_roofline_cpu_time"],
            "met": roofline[q]["fraction_of_roofline"] >= 0.65},
        "q4_1+q8act 8-node verify <= 1.15x a 1-node pass": {"wall": ratio[q][8], "cpu_time": ratio_cpu[q][8],
                                                            "met": ratio[q][8] <= 1.15},
        "q4_1+q8act step <= 5 ms, one model (warm)": {"wall_ms": single[q][1]["warm_ms"],
                                                      "met": single[q][1]["warm_ms"] <= 5.0},
        "q4_1+q8act >= 65 % of the DRAM read roofline, one model, caches flushed (cold)": {
            "fraction": single[q]["fraction_of_dram_roofline_cold"],
            "met": single[q]["fraction_of_dram_roofline_cold"] >= 0.65},
        "q4_1+q8act 8-node verify <= 1.15x a 1-node pass, one model (warm)": {
            "ratio": single[q]["verify_8_vs_1_warm"], "met": single[q]["verify_8_vs_1_warm"] <= 1.15},
    }
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                            cwd=ROOT).stdout.strip()
    from specdec.bench.record import cpu_name

    res = {"date": _dt.date.today().isoformat(), "commit": commit, "cpu": cpu_name(),
           "threads": torch.get_num_threads(), "loadavg": os.getloadavg(),
           "rounds": a.rounds, "reps": a.reps, "prefix": PREFIX,
           "q8act_tier": _C.q8act_tier(), "read_bandwidth_gbs": round(bandwidth, 2),
           "read_bandwidth_cpu_time_gbs": round(bandwidth_cpu, 2),
           "read_bandwidth_rounds_gbs": [round(b, 2) for b in bws], "step_ms_median": step_ms,
           "step_cpu_ms_median": step_cpu_ms, "verify_ratio_vs_1_node": ratio,
           "verify_ratio_vs_1_node_cpu_time": ratio_cpu, "roofline": roofline, "tokens_per_s_plain": tokens_per_s,
           "tokens_per_s_per_prompt": tps, "one_model": single, "dram_read_bandwidth_gbs": round(dram_bw, 2),
           "dram_read_bandwidth_rounds_gbs": [round(x, 2) for x in dram], "tokens_per_s_plain_one_model": tps_alone,
           "targets": targets,
           "step_ms_rounds": {f"{c} N={n}": [round(t * 1e3, 3) for t in v] for (c, n), v in times.items()},
           "step_cpu_ms_rounds": {f"{c} N={n}": [round(t * 1e3, 3) for t in v] for (c, n), v in cpu.items()},
           "notes": "2 shared CPU cores: other processes ran during the measurement (see loadavg); the CPU-time "
                    "columns (process_time, per thread) are what the steps computed while scheduled; "
                    "llama.cpp not run in this record"}
    out = Path(a.out) if a.out else ROOT / "benchmarks" / "results" / f"q8act_cpu_{res['date']}.json"
    out.write_text(json.dumps(res, indent=1))
    print(json.dumps({k: res[k] for k in ("loadavg", "read_bandwidth_gbs", "read_bandwidth_cpu_time_gbs",
                                          "step_ms_median", "step_cpu_ms_median", "verify_ratio_vs_1_node",
                                          "verify_ratio_vs_1_node_cpu_time", "roofline", "tokens_per_s_plain",
                                          "one_model", "dram_read_bandwidth_gbs", "tokens_per_s_plain_one_model",
                                          "targets")}, indent=1))
    print("wrote", out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
