"""One forward of the bundled SmolLM2-135M through HFCausalLM, by adapter configuration.

    python benchmarks/bench_forward.py [--rounds 15] [--threads 2]

Measures the latency of a decode step (N = 1 new token) and a verify step (N = 8 chain
nodes) over a 150-token prefix, for:
  fp32 modules+F.linear   transformers' modules, torch's F.linear (fast_path=False, fast_linear=False)
  fp32 lean unfused       specdec.models.fast_llama + ops.linear, torch's small ops (fused_ops=False)
  fp32 lean fused         + the fused small ops (rms_norm, add_rms_norm, rope, silu_mul), one op call
                          each from Python (fused_layers=False)
  fp32 lean layer         the default: each decoder layer as ONE ops.decoder_layer call (the same
                          kernels called from C++)
  fp32 lean layer 4k pages  the same weights in transformers' own 4 KiB-page allocations
                          (load_bundled(hugepages=False)), not specdec's huge-page arena
  ... layer avx2          on a CPU with AVX-512: each "layer" configuration again with the AVX-512 few-row
                          kernels off (specdec._C.set_cpu_avx512(False): the AVX2 ones, the same bits)
  q8_0 / q4_1 lean fused / layer  the target at group-quantized precision (ops.qlinear; q4_1 = the
                          GGUF's blocks)
  w8 lean unfused / fused / layer the weight-only int8 draft
Configurations are interleaved round by round (medians; the 8-node / 1-node ratio also as the median
of each round's own ratio, both passes measured in the same round). Then, per configuration:
  small-op time  the same forward with every linear layer replaced by a preallocated output of
                 its shape (so the linears cost nothing): what the rest of the step costs
                 (norms, RoPE, attention, residuals, Python). A "layer" configuration runs its
                 linears inside ops.decoder_layer, where they cannot be replaced: its small-op
                 time is derived, forward - (the linear time of its "fused" twin);
  linear GB/s    weight bytes read per forward / (forward - small-op time), against the
                 machine's read bandwidth measured here (a 1 GiB float32 sum, same threads).
Writes benchmarks/results/forward_cpu_<date>.json (load average recorded).
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


def weight_bytes(model: torch.nn.Module) -> int:
    """Bytes of every linear layer's weight data (codes + scales + mins, or the float weight)."""
    from specdec.models.quant import GroupQuantLinear, Int8Linear

    total = 0
    for m in model.modules():
        if type(m) is torch.nn.Linear:
            total += m.weight.numel() * m.weight.element_size()
        elif isinstance(m, (Int8Linear, GroupQuantLinear)):
            total += sum(b.numel() * b.element_size() for b in m.buffers() if b is not None)
    return total


def read_bandwidth_gbs() -> float:
    buf = torch.ones(256 << 20)  # 1 GiB of float32
    ts = []
    for _ in range(15):
        t0 = time.perf_counter()
        buf.sum()
        ts.append(time.perf_counter() - t0)
    return buf.numel() * 4 / statistics.median(ts[2:]) / 1e9


def stub_linears(lm) -> None:
    """Replace every linear of lm's lean runner by a function returning a cached output of its shape."""
    runner = lm._runner
    outs = {}

    def stub(width, dtype):
        def f(x):
            key = (tuple(x.shape[:-1]), width)
            if key not in outs:
                outs[key] = torch.zeros(*x.shape[:-1], width, dtype=dtype)
            return outs[key]
        return f

    cfg = lm.config
    hd = lm.head_dim
    widths = dict(q=cfg.num_attention_heads * hd, k=cfg.num_key_value_heads * hd, v=cfg.num_key_value_heads * hd,
                  o=cfg.hidden_size, gate=cfg.intermediate_size, up=cfg.intermediate_size, down=cfg.hidden_size)
    for L in runner.layers:
        for name, w in widths.items():
            setattr(L, name, stub(w, lm.dtype))
        if L.qkv is not None:  # the merged projections of quantized layers
            L.qkv = stub(widths["q"] + widths["k"] + widths["v"], lm.dtype)
        if L.gate_up is not None:
            L.gate_up = stub(2 * widths["gate"], lm.dtype)
    runner.lm_head = stub(cfg.vocab_size, lm.dtype)


def interleaved_medians(built, rounds: int):
    """({(name, N): median ms} of one forward of N = 1 and 8 nodes, {name: median of the rounds' own
    8 / 1 ratios}), configurations interleaved round by round (2 warm-up rounds). A configuration whose
    name ends in "avx2" runs with the AVX-512 linear off."""
    from specdec import _C

    times = {(name, N): [] for name in built for N in (1, 8)}
    for r in range(rounds + 2):
        for N in (1, 8):
            tok, dep = torch.zeros(1, N, dtype=torch.long), torch.arange(N)[None]
            for name, (lm, cache) in built.items():
                prev = _C.set_cpu_avx512(not name.endswith("avx2"))
                t0 = time.perf_counter()
                lm.forward(cache, tok, dep)
                if r >= 2:
                    times[(name, N)].append(time.perf_counter() - t0)
                _C.set_cpu_avx512(prev)
    med = {k: 1e3 * statistics.median(v) for k, v in times.items()}
    # the 8-node / 1-node ratio of each round (both measured within the same round), its median
    ratio = {name: statistics.median(t8 / t1 for t1, t8 in zip(times[(name, 1)], times[(name, 8)])) for name in built}
    return med, ratio


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    from specdec import HFCausalLM
    from specdec.models import load_bundled

    model, _, w8 = load_bundled("smollm2-135m", draft="w8")
    model_4k = load_bundled("smollm2-135m", hugepages=False)[0]
    q8 = load_bundled("smollm2-135m", precision="q8_0")[0]
    q4 = load_bundled("smollm2-135m", precision="q4_1")[0]
    models = {"fp32": model, "q8_0": q8, "q4_1": q4, "w8": w8, "fp32 4k": model_4k}
    per_op = dict(fused_layers=False)
    configs = {
        "fp32 modules+F.linear": ("fp32", dict(fast_path=False, fast_linear=False)),
        "fp32 lean unfused": ("fp32", dict(fused_ops=False)),
        "fp32 lean fused": ("fp32", per_op),
        "fp32 lean layer": ("fp32", {}),
        "fp32 lean layer 4k pages": ("fp32 4k", {}),
        "q8_0 lean fused": ("q8_0", per_op),
        "q8_0 lean layer": ("q8_0", {}),
        "q4_1 lean fused": ("q4_1", per_op),
        "q4_1 lean layer": ("q4_1", {}),
        "w8 lean unfused": ("w8", dict(fused_ops=False)),
        "w8 lean fused": ("w8", per_op),
        "w8 lean layer": ("w8", {}),
    }
    from specdec import _C

    if _C.build_info().get("cpu_avx512"):  # each default configuration again with the AVX2 few-row kernels
        configs.update({f"{n} avx2": c for n, c in list(configs.items()) if n.endswith("layer")})
    prefix = list(range(1, 151))

    def make(name):
        which, kw = configs[name]
        lm = HFCausalLM(models[which], **kw)
        cache = lm.new_cache(1, 512)
        lm.prefill(cache, [prefix])
        return lm, cache

    median_ms, round_ratio = interleaved_medians({name: make(name) for name in configs}, args.rounds)
    # small-op time: the lean configurations with free linears (fresh adapters; interleaved too)
    lean = [n for n in configs if "lean" in n and "layer" not in n]
    stubbed = {}
    for name in lean:
        lm, cache = make(name)
        stub_linears(lm)
        stubbed[name] = (lm, cache)
    small_ms, _ = interleaved_medians(stubbed, args.rounds)
    bw = read_bandwidth_gbs()

    rows = []
    for name in configs:
        which = configs[name][0]
        wb = weight_bytes(models[which])
        row = dict(config=name, weight_mb=round(wb / 1e6, 1))
        for N in (1, 8):
            row[f"N={N} ms"] = round(median_ms[(name, N)], 2)
            if name in lean:
                so = small_ms[(name, N)]
                row[f"N={N} small-op ms"] = round(so, 2)
                lin = max(median_ms[(name, N)] - so, 1e-6)
                row[f"N={N} linear GB/s"] = round(wb / lin / 1e6, 1)
            elif name.endswith("layer"):  # derived: the same linears as its "fused" twin
                twin = name.replace("layer", "fused")
                lin = median_ms[(twin, N)] - small_ms[(twin, N)]
                row[f"N={N} small-op ms"] = round(median_ms[(name, N)] - lin, 2)
                row["small-op derived"] = True
        row["N=8 / N=1"] = round(median_ms[(name, 8)] / median_ms[(name, 1)], 3)
        row["N=8 / N=1 per round"] = round(round_ratio[name], 3)
        rows.append(row)

    print(f"# HFCausalLM forward, SmolLM2-135M, 150-token prefix, threads {torch.get_num_threads()}, "
          f"median of {args.rounds} interleaved rounds; read bandwidth {bw:.1f} GB/s")
    print(f"{'config':<24} {'MB':>6} {'N=1 ms':>8} {'N=8 ms':>8} {'8/1':>6} {'8/1 rd':>6} {'small1':>7} {'small8':>7} "
          f"{'GB/s@1':>7}")
    for r in rows:
        print(f"{r['config']:<24} {r['weight_mb']:>6.0f} {r['N=1 ms']:>8.2f} {r['N=8 ms']:>8.2f} "
              f"{r['N=8 / N=1']:>6.2f} "
              f"{r['N=8 / N=1 per round']:>6.2f} "
              f"{r.get('N=1 small-op ms', float('nan')):>7.2f} {r.get('N=8 small-op ms', float('nan')):>7.2f} "
              f"{r.get('N=1 linear GB/s', float('nan')):>7.1f}")
    from bench_e2e import git_commit

    commit = git_commit()
    now = _dt.datetime.now()
    out = Path(args.out) if args.out else ROOT / "benchmarks" / "results" / f"forward_cpu_{now:%Y-%m-%d}.json"
    out.write_text(json.dumps(dict(date=now.isoformat(timespec="seconds"), commit=commit,
                                   torch=torch.__version__, threads=torch.get_num_threads(),
                                   loadavg=os.getloadavg() if hasattr(os, "getloadavg") else None,
                                   read_bandwidth_gbs=round(bw, 1), rounds=args.rounds, rows=rows,
                                   keys={"N=k ms": "median forward latency with k new nodes",
                                         "N=k small-op ms": "the same forward with free linear layers (layer "
                                                            "configurations: forward - the linear time of "
                                                            "their fused twin)",
                                         "N=k linear GB/s": "weight bytes / (forward - small-op time)",
                                         "N=8 / N=1 per round": "median over rounds of the round's 8-node / "
                                                                "1-node time (paired within a round)",
                                         "weight_mb": "bytes of the linear layers' weight data per forward"}),
                              indent=2))
    print(f"# wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
