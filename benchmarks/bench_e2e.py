"""End-to-end decoding speed on the bundled SmolLM2-135M-Instruct: specdec vs transformers.

Same model, same prompts, same process, interleaved (for every prompt every method runs
once, in an order rotated from prompt to prompt, so drifts of the machine hit all
methods alike). Greedy decoding, batch 1, stop at EOS or --max-new-tokens.

Methods (the drafters' settings are command-line options; defaults = the best measured here)
  specdec_plain             SpeculativeDecoder(target, None): one target pass per token (the fair baseline)
  specdec_int8              DraftModel(int8 dynamic-quantized copy, k=6, top_k=4, stop_threshold=0.3)
  specdec_bf16              DraftModel(bfloat16 copy, k=8)
  specdec_w8                DraftModel(weight-only int8 copy run by specdec.ops.linear, k=6)
  specdec_lookup            PromptLookup(ngram=3, k=10) (min_ngram 2)
  hf_plain                  model.generate(do_sample=False)
  hf_assisted_int8          generate(assistant_model=int8 copy), constant --hf-k-int8 (4) tokens, no confidence stop
  hf_assisted_bf16          the same with the bf16 copy (constant --hf-k-bf16 = 8 tokens)
  hf_assisted_w8            the same with the weight-only int8 copy (constant --hf-k-w8 = 6 tokens; its
                            Int8Linear layers run specdec.ops.linear inside transformers too)
  hf_assisted_*_default     (--hf-defaults) transformers' default assisted settings: 20 tokens,
                            assistant_confidence_threshold 0.4 (about 3x slower than the tuned variant here)
  hf_lookup                 generate(prompt_lookup_num_tokens=10, max_matching_ngram_size=3): the same k and n-gram

Ratios against transformers use its BEST variant for that drafter on that prompt set. Besides
the ratio of total tokens/s, the median over prompts of the per-prompt ratio is reported (robust
to load changes of a shared machine: the methods of one prompt run back to back).

Prompt sets (chat template applied): "grounded" -- the answer copies from the input
(repeat a passage, edit code, rename, reformat: where prompt lookup shines) -- and
"open" -- open-ended questions.

Prints one table per set (tokens/s, acceptance, mean accepted length, ratios) and writes
benchmarks/results/e2e_<date>.json (git commit, machine, settings, per-method numbers,
whether every method's greedy output equals hf_plain's).
"""
from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import platform
import sys
import time
from pathlib import Path
from typing import Callable, Dict, List, Tuple

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from specdec.decoding import SpeculativeDecoder  # noqa: E402
from specdec.drafters import DraftModel, PromptLookup  # noqa: E402
from specdec.models.bundled import load_bundled  # noqa: E402
from specdec.models.hf import HFCausalLM  # noqa: E402

from specdec.bench import PROMPT_SETS, cpu_name as _cpu_name, git_commit as _git_commit  # noqa: E402  (the prompt sets live in the package; `specdec bench`)

GROUNDED = PROMPT_SETS["grounded"]
OPEN = PROMPT_SETS["open"]


def git_commit() -> str:
    return _git_commit()


def cpu_name() -> str:
    return _cpu_name()


def encode(tok, text: str) -> List[int]:
    ids = tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True, tokenize=True)
    if hasattr(ids, "keys"):
        ids = ids["input_ids"]
    return list(ids)


RunResult = Tuple[List[int], float, Dict]  # new tokens, seconds, specdec metrics (or {})


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--max-new-tokens", type=int, default=48)
    ap.add_argument("--k-int8", type=int, default=6, help="specdec int8 draft depth")
    ap.add_argument("--tree-int8", type=int, default=4, help="specdec int8 candidates per depth (top_k)")
    ap.add_argument("--stop-int8", type=float, default=0.3, help="specdec int8 confidence stop (0 = off)")
    ap.add_argument("--k-bf16", type=int, default=8, help="specdec bf16 draft depth")
    ap.add_argument("--tree-bf16", type=int, default=1)
    ap.add_argument("--stop-bf16", type=float, default=0.0)
    ap.add_argument("--k-w8", type=int, default=6, help="specdec w8 draft depth")
    ap.add_argument("--tree-w8", type=int, default=1)
    ap.add_argument("--stop-w8", type=float, default=0.0)
    ap.add_argument("--hf-k-w8", type=int, default=6, help="transformers' constant num_assistant_tokens (w8)")
    ap.add_argument("--no-fast-linear", action="store_true",
                    help="specdec runs the models' nn.Linear with torch's F.linear (engine overhead only)")
    ap.add_argument("--hf-k-int8", type=int, default=4, help="transformers' constant num_assistant_tokens (int8)")
    ap.add_argument("--hf-k-bf16", type=int, default=8, help="transformers' constant num_assistant_tokens (bf16)")
    ap.add_argument("--k-lookup", type=int, default=10, help="prompt-lookup tokens per step (both)")
    ap.add_argument("--ngram", type=int, default=3, help="prompt-lookup n-gram size (both)")
    ap.add_argument("--rounds", type=int, default=1, help="passes over the prompts")
    ap.add_argument("--sets", default="grounded,open")
    ap.add_argument("--methods", default="all", help="comma list (default all)")
    ap.add_argument("--skip", default="", help="comma list of methods to leave out")
    ap.add_argument("--hf-defaults", action="store_true",
                    help="also run transformers' assisted generation with its default settings")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--quick", action="store_true", help="2 prompts per set, 24 tokens (smoke test)")
    ap.add_argument("--out", default=None, help="JSON path (default benchmarks/results/e2e_<date>.json)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.quick:
        args.max_new_tokens = min(args.max_new_tokens, 24)

    load_start = os.getloadavg() if hasattr(os, "getloadavg") else None
    t0 = time.perf_counter()
    model, tok, int8_model = load_bundled("smollm2-135m", draft="int8")
    _, _, bf16_model = load_bundled("smollm2-135m", draft="bf16")
    _, _, w8_model = load_bundled("smollm2-135m", draft="w8")
    fast = not args.no_fast_linear
    print(f"loaded models in {time.perf_counter() - t0:.1f} s; torch threads {torch.get_num_threads()}")
    eos = tok.eos_token_id
    target = HFCausalLM(model, fast_linear=fast)

    sets = {"grounded": GROUNDED, "open": OPEN}
    sets = {name: sets[name] for name in args.sets.split(",")}
    if args.quick:
        sets = {k: v[:2] for k, v in sets.items()}
    prompts = {name: [encode(tok, t) for t in texts] for name, texts in sets.items()}
    max_len = max(len(p) for ps in prompts.values() for p in ps) + args.max_new_tokens + 8

    decoders = {
        "specdec_plain": SpeculativeDecoder(target, None, max_batch=1, max_len=max_len),
        "specdec_int8": SpeculativeDecoder(
            target, DraftModel(HFCausalLM(int8_model, fast_linear=fast), k=args.k_int8, top_k=args.tree_int8,
                               stop_threshold=args.stop_int8 or None), max_batch=1, max_len=max_len),
        "specdec_bf16": SpeculativeDecoder(
            target, DraftModel(HFCausalLM(bf16_model, fast_linear=fast), k=args.k_bf16, top_k=args.tree_bf16,
                               stop_threshold=args.stop_bf16 or None), max_batch=1, max_len=max_len),
        "specdec_w8": SpeculativeDecoder(
            target, DraftModel(HFCausalLM(w8_model, fast_linear=fast), k=args.k_w8, top_k=args.tree_w8,
                               stop_threshold=args.stop_w8 or None), max_batch=1, max_len=max_len),
        "specdec_lookup": SpeculativeDecoder(target, PromptLookup(ngram=args.ngram, k=args.k_lookup), max_batch=1,
                                             max_len=max_len),
    }

    def run_specdec(name: str) -> Callable[[List[int]], RunResult]:
        dec = decoders[name]

        def run(ids: List[int]) -> RunResult:
            t = time.perf_counter()
            out = dec.generate([ids], max_new_tokens=args.max_new_tokens, eos_token_id=eos)
            return out.tokens[0], time.perf_counter() - t, out.metrics
        return run

    def run_hf(assistant=None, k=None, **extra) -> Callable[[List[int]], RunResult]:
        def run(ids: List[int]) -> RunResult:
            if assistant is not None:  # the assistant's generation_config drives transformers' drafting
                gc = assistant.generation_config
                gc.num_assistant_tokens = 20 if k is None else k
                gc.num_assistant_tokens_schedule = "constant"
                gc.assistant_confidence_threshold = 0.4 if k is None else 0.0
                extra["assistant_model"] = assistant
            x = torch.tensor([ids])
            t = time.perf_counter()
            with torch.no_grad():
                g = model.generate(x, attention_mask=torch.ones_like(x), do_sample=False,
                                   max_new_tokens=args.max_new_tokens, eos_token_id=eos, pad_token_id=eos, **extra)
            return g[0, len(ids):].tolist(), time.perf_counter() - t, {}
        return run

    methods: Dict[str, Callable[[List[int]], RunResult]] = {
        "specdec_plain": run_specdec("specdec_plain"),
        "specdec_int8": run_specdec("specdec_int8"),
        "specdec_bf16": run_specdec("specdec_bf16"),
        "specdec_w8": run_specdec("specdec_w8"),
        "specdec_lookup": run_specdec("specdec_lookup"),
        "hf_plain": run_hf(),
        "hf_assisted_int8": run_hf(int8_model, args.hf_k_int8),
        "hf_assisted_bf16": run_hf(bf16_model, args.hf_k_bf16),
        "hf_assisted_w8": run_hf(w8_model, args.hf_k_w8),
        "hf_lookup": run_hf(prompt_lookup_num_tokens=args.k_lookup, max_matching_ngram_size=args.ngram),
    }
    if args.hf_defaults:
        methods["hf_assisted_int8_default"] = run_hf(int8_model, None)
        methods["hf_assisted_bf16_default"] = run_hf(bf16_model, None)
    if args.methods != "all":
        methods = {k: methods[k] for k in args.methods.split(",")}
    methods = {k: v for k, v in methods.items() if k not in set(args.skip.split(","))}
    names = list(methods)

    # warm-up: every method once on a short prompt (first-call allocations, lazy inits)
    warm = encode(tok, "Say hello.")
    for name in names:
        methods[name](warm)

    records: Dict[str, Dict[str, List[dict]]] = {s: {n: [] for n in names} for s in prompts}
    for r in range(args.rounds):
        for s, plist in prompts.items():
            for i, ids in enumerate(plist):
                shift = (i + r) % len(names)
                for name in names[shift:] + names[:shift]:
                    toks, secs, m = methods[name](ids)
                    records[s][name].append(dict(prompt=i, round=r, tokens=toks, seconds=secs, metrics=m))
                print(f"  [{s} {i + 1}/{len(plist)} round {r + 1}] done ({time.perf_counter() - t0:.0f} s)",
                      flush=True)

    # ------------------------------------------------------------------ summary
    summary: Dict[str, Dict[str, dict]] = {}
    for s in prompts:
        summary[s] = {}
        ref = {(x["prompt"], x["round"]): x["tokens"] for x in records[s].get("hf_plain", [])}
        for name in names:
            rows = records[s][name]
            n_tok = sum(len(x["tokens"]) for x in rows)
            secs = sum(x["seconds"] for x in rows)
            row = dict(new_tokens=n_tok, seconds=secs, tokens_per_second=n_tok / secs if secs else 0.0)
            if ref:
                row["same_output_as_hf_plain"] = sum(x["tokens"] == ref[(x["prompt"], x["round"])] for x in rows)
                row["runs"] = len(rows)
            ms = [x["metrics"] for x in rows if x["metrics"]]
            if ms:
                drafted = sum(m["drafted_tokens"] for m in ms)
                accepted = sum(m["accepted_tokens"] for m in ms)
                passes = sum(sum(m["per_request"]["target_passes"]) for m in ms)
                depth = max(len(m["accepted_per_position"]) for m in ms)
                row.update(
                    acceptance_rate=accepted / drafted if drafted else 0.0,
                    mean_accepted_length=(accepted + passes) / passes if passes else 0.0,
                    target_passes=passes,
                    accepted_per_position=[
                        sum(m["accepted_per_position"][i] for m in ms if len(m["accepted_per_position"]) > i) /
                        max(1, sum(1 for m in ms if len(m["accepted_per_position"]) > i)) for i in range(depth)],
                    draft_seconds=sum(m["draft_seconds"] for m in ms),
                    verify_seconds=sum(m["verify_seconds"] for m in ms),
                    commit_seconds=sum(m["commit_seconds"] for m in ms),
                    ttft_seconds_mean=sum(m["ttft_seconds"] for m in ms) / len(ms),
                    peak_memory_bytes=max(m["peak_memory_bytes"] for m in ms),
                    static_memory_bytes=max(m["static_memory_bytes"] for m in ms),
                )
                row["peak_over_static"] = row["peak_memory_bytes"] / row["static_memory_bytes"] - 1.0
            summary[s][name] = row
        tps = {n: summary[s][n]["tokens_per_second"] for n in names}

        def ratio(a: str, b: str):
            return tps[a] / tps[b] if a in tps and b in tps and tps[b] else None

        def best(*names_):
            got = [n for n in names_ if n in tps]
            return max(got, key=lambda n: tps[n]) if got else None

        hf_int8 = best("hf_assisted_int8", "hf_assisted_int8_default")
        hf_bf16 = best("hf_assisted_bf16", "hf_assisted_bf16_default")
        per_prompt = {}
        for n in names:
            for x in records[s][n]:
                per_prompt.setdefault((x["prompt"], x["round"]), {})[n] = len(x["tokens"]) / x["seconds"]

        def median_ratio(a: str, b):
            vals = sorted(v[a] / v[b] for v in per_prompt.values() if a in v and b in v and v[b] > 0)
            if not vals:
                return None
            mid = len(vals) // 2
            return vals[mid] if len(vals) % 2 else 0.5 * (vals[mid - 1] + vals[mid])

        summary[s]["median_prompt_ratios"] = {k: v for k, v in {
            "specdec_lookup/specdec_plain": median_ratio("specdec_lookup", "specdec_plain"),
            "specdec_int8/specdec_plain": median_ratio("specdec_int8", "specdec_plain"),
            "specdec_bf16/specdec_plain": median_ratio("specdec_bf16", "specdec_plain"),
            "specdec_plain/hf_plain": median_ratio("specdec_plain", "hf_plain"),
            "specdec_int8/hf_assisted_int8": median_ratio("specdec_int8", "hf_assisted_int8"),
            "specdec_bf16/hf_assisted_bf16": median_ratio("specdec_bf16", "hf_assisted_bf16"),
            "specdec_w8/specdec_plain": median_ratio("specdec_w8", "specdec_plain"),
            "specdec_w8/hf_assisted_w8": median_ratio("specdec_w8", "hf_assisted_w8"),
            "specdec_lookup/hf_lookup": median_ratio("specdec_lookup", "hf_lookup"),
        }.items() if v is not None}
        summary[s]["ratios"] = {k: v for k, v in {
            "specdec_lookup/specdec_plain": ratio("specdec_lookup", "specdec_plain"),
            "specdec_int8/specdec_plain": ratio("specdec_int8", "specdec_plain"),
            "specdec_bf16/specdec_plain": ratio("specdec_bf16", "specdec_plain"),
            "specdec_plain/hf_plain": ratio("specdec_plain", "hf_plain"),
            f"specdec_int8/{hf_int8} (best transformers int8)": ratio("specdec_int8", hf_int8) if hf_int8 else None,
            f"specdec_bf16/{hf_bf16} (best transformers bf16)": ratio("specdec_bf16", hf_bf16) if hf_bf16 else None,
            "specdec_w8/specdec_plain": ratio("specdec_w8", "specdec_plain"),
            "specdec_w8/hf_assisted_w8": ratio("specdec_w8", "hf_assisted_w8"),
            "specdec_lookup/hf_lookup": ratio("specdec_lookup", "hf_lookup"),
            "hf_assisted_w8/hf_plain": ratio("hf_assisted_w8", "hf_plain"),
            "hf_lookup/hf_plain": ratio("hf_lookup", "hf_plain"),
            "hf_assisted_int8/hf_plain": ratio("hf_assisted_int8", "hf_plain"),
            "hf_assisted_int8_default/hf_plain": ratio("hf_assisted_int8_default", "hf_plain"),
            "hf_assisted_bf16/hf_plain": ratio("hf_assisted_bf16", "hf_plain"),
            "hf_assisted_bf16_default/hf_plain": ratio("hf_assisted_bf16_default", "hf_plain"),
        }.items() if v is not None}

        print(f"\n== {s} ({len(prompts[s])} prompts x {args.rounds} rounds, up to {args.max_new_tokens} new tokens, "
              f"greedy, batch 1)")
        print(f"{'method':<25} {'tok/s':>7} {'tokens':>7} {'accept':>7} {'mean len':>8} {'vs plain':>8} "
              f"{'same out':>8}")
        for name in names:
            row = summary[s][name]
            acc = f"{100 * row['acceptance_rate']:.1f}%" if "acceptance_rate" in row else "-"
            ml = f"{row['mean_accepted_length']:.2f}" if "mean_accepted_length" in row else "-"
            base = "specdec_plain" if name.startswith("specdec") else "hf_plain"
            vs = ratio(name, base)
            same = f"{row.get('same_output_as_hf_plain', '-')}/{row.get('runs', '-')}"
            print(f"{name:<25} {row['tokens_per_second']:7.1f} {row['new_tokens']:7d} {acc:>7} {ml:>8} "
                  f"{(f'{vs:.2f}x' if vs else '-'):>8} {same:>8}")
        for k, v in summary[s]["ratios"].items():
            med = summary[s]["median_prompt_ratios"].get(k.split(" ")[0].replace("_default", ""))
            print(f"  {k:<60} {v:.2f}x" + (f"   (median per prompt {med:.2f}x)" if med else ""))

    out = Path(args.out) if args.out else ROOT / "benchmarks" / "results" / f"e2e_{_dt.date.today().isoformat()}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    result = dict(
        benchmark="e2e", date=_dt.datetime.now().isoformat(timespec="seconds"), git_commit=git_commit(),
        machine=dict(cpu=cpu_name(), cores=os.cpu_count(), torch_threads=torch.get_num_threads(),
                     torch=torch.__version__, python=platform.python_version(),
                     transformers=__import__("transformers").__version__,
                     loadavg_start=load_start, loadavg_end=os.getloadavg() if hasattr(os, "getloadavg") else None,
                     note="2 shared cores: other processes may run at the same time; see loadavg"),
        settings=dict(model="smollm2-135m (SmolLM2-135M-Instruct, fp32)", max_new_tokens=args.max_new_tokens,
                      specdec_int8=dict(k=args.k_int8, top_k=args.tree_int8, stop_threshold=args.stop_int8),
                      specdec_bf16=dict(k=args.k_bf16, top_k=args.tree_bf16, stop_threshold=args.stop_bf16),
                      specdec_w8=dict(k=args.k_w8, top_k=args.tree_w8, stop_threshold=args.stop_w8),
                      fast_linear=fast, hf_assisted_w8_k=args.hf_k_w8,
                      specdec_lookup=dict(ngram=args.ngram, k=args.k_lookup, min_ngram=min(2, args.ngram)),
                      hf_assisted=dict(int8_k=args.hf_k_int8, bf16_k=args.hf_k_bf16, schedule="constant",
                                       assistant_confidence_threshold=0.0),
                      hf_assisted_default=dict(num_assistant_tokens=20, schedule="constant",
                                               assistant_confidence_threshold=0.4),
                      hf_lookup=dict(prompt_lookup_num_tokens=args.k_lookup, max_matching_ngram_size=args.ngram),
                      rounds=args.rounds, greedy=True, batch=1, chat_template=True, eos_token_id=eos),
        prompts={s: sets[s] for s in sets},
        summary=summary,
        runs={s: {n: [dict(prompt=x["prompt"], round=x["round"], new_tokens=len(x["tokens"]), seconds=x["seconds"])
                      for x in records[s][n]] for n in names} for s in prompts},
    )
    out.write_text(json.dumps(result, indent=1))
    print(f"\nwrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
