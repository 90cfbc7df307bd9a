"""``specdec bench``: end-to-end workloads on the bundled model, a table, JSON and a PNG dashboard.

A run is a grid of *methods* (drafter x k x policy, plus plain decoding and, optionally,
transformers' own ``generate``) over *workloads* (a prompt set at a batch size). For every
workload the methods run on the same prompt batches, interleaved: each round visits every
unit (a prompt at batch 1, a batch of b prompts otherwise) and runs every method on it back
to back, in an order rotated from unit to unit, so that drifts of a shared machine hit all
methods alike. Ratios are medians of per-unit ratios against the plain run of the same unit
and round.

Adaptive methods decide from what they measure, so their ratio to plain decoding sits near 1
exactly where a shared machine's noise (about +-10 % per run) is largest; at batch > 1 a round
has one unit, so ``repeats`` (``--repeats``) runs plain and the adaptive methods (goodput,
heuristic) that many times per unit and round, each repetition a fresh rotated pair set, and
their ratios are taken per repetition against the plain run of the same repetition. Fixed-k
methods run once per unit and round (their ratios against the first repetition's plain run).

Methods are written ``drafter[:k][@policy]``: ``plain``, ``lookup:10@fixed``, ``w8@goodput``
(k = the drafter's largest depth, the policy picks below it), ``random:8@fixed``, ``hf`` (the
transformers model's ``generate``, batch 1 only). Drafters: ``lookup`` (PromptLookup),
``w8`` / ``int8`` / ``bf16`` (DraftModel over the bundled model's draft copies), ``random``
(k uniformly random tokens: a useless drafter). ``--runs`` (or the ``runs`` key of a JSON
``--config`` file) says which methods run on which prompt set::

    specdec bench --runs "grounded:lookup@goodput,lookup:4@fixed,lookup:10@fixed" --batches 1,8

Every workload also runs ``plain``. The goodput decoders keep what they learned during the
warm-up and earlier units (the cost model lives as long as the decoder, as in a server).

Outputs: a table on stdout; ``--out`` JSON (machine, load average before / after, settings,
per-workload per-method medians, ratios, acceptance per position, time split, chosen-k
histogram, per-run numbers); ``--dashboard`` PNG (matplotlib): acceptance per position,
tokens/s vs k, speedup vs plain (and vs transformers), the draft / verify / commit split and
the goodput policy's chosen k over the steps of one run.
"""
from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

import torch

from specdec.bench.dashboard import write_dashboard
from specdec.bench.record import cpu_name, git_commit, loadavg
from specdec.bench.workloads import (ADAPTIVE, DEFAULT_K, PROMPT_SETS, RandomDrafter, Spec, build_workloads,
                                     chat_ids, is_adaptive, method_name, parse_method, parse_runs)

__all__ = ["run_bench", "summarize", "format_table", "build_parser", "main"]


class _Progress:
    def __init__(self, total: int, enabled: bool) -> None:
        self.total, self.done, self.enabled, self.t0 = total, 0, enabled, time.perf_counter()

    def step(self, label: str) -> None:
        self.done += 1
        if not self.enabled:
            return
        width = 30
        fill = int(width * self.done / max(1, self.total))
        el = time.perf_counter() - self.t0
        eta = el / self.done * (self.total - self.done)
        sys.stderr.write(f"\r[{'#' * fill}{'.' * (width - fill)}] {self.done}/{self.total} {el:5.0f}s "
                         f"eta {eta:4.0f}s {label[:40]:<40}")
        if self.done == self.total:
            sys.stderr.write("\n")
        sys.stderr.flush()


def _median(xs: Sequence[float]) -> Optional[float]:
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None


# ============================================================================ the run
class _Runner:
    """The model, the draft models and the decoders of one run; times one method on one unit."""

    def __init__(self, model_name: str, wanted, max_new_tokens: int) -> None:
        from specdec.models.bundled import load_bundled
        from specdec.models.hf import HFCausalLM

        self.model, self.tok = load_bundled(model_name)[:2]
        self.target = HFCausalLM(self.model)
        self.drafts = {}
        for kind in ("w8", "int8", "bf16"):
            if kind in wanted:
                self.drafts[kind] = HFCausalLM(load_bundled(model_name, draft=kind)[2])
        self.eos = self.tok.eos_token_id
        self.max_new_tokens = max_new_tokens
        self.max_len = 0   # set once the prompts are known
        self.decoders: Dict[Tuple[str, int], object] = {}

    def encode(self, text: str) -> List[int]:
        return chat_ids(self.tok, text)

    def make_drafter(self, d: str, k: Optional[int]):
        from specdec.drafters import DraftModel, PromptLookup

        k = k or DEFAULT_K[d]
        if d == "lookup":
            return PromptLookup(ngram=3, k=k)
        if d == "random":
            return RandomDrafter(k=k)
        return DraftModel(self.drafts[d], k=k)

    def decoder(self, spec: Spec, b: int):
        """The decoder of a method at batch b, made on first use and kept (the goodput cost model learns)."""
        from specdec.decoding import SpeculativeDecoder

        d, k, policy = spec
        key = (method_name(d, k, policy), b)
        if key not in self.decoders:
            if d == "plain":
                self.decoders[key] = SpeculativeDecoder(self.target, None, max_batch=b, max_len=self.max_len)
            else:
                self.decoders[key] = SpeculativeDecoder(self.target, self.make_drafter(d, k), max_batch=b,
                                                        max_len=self.max_len, policy=policy)
        return self.decoders[key]

    def run_one(self, spec: Spec, batch_prompts: List[List[int]], want_trace: bool):
        """(tokens, seconds, metrics, trace) of one method on one unit."""
        eos = self.eos
        if spec[0] == "hf":
            x = torch.tensor(batch_prompts)
            t = time.perf_counter()
            with torch.no_grad():
                g = self.model.generate(x, attention_mask=torch.ones_like(x), do_sample=False,
                                        max_new_tokens=self.max_new_tokens, eos_token_id=eos, pad_token_id=eos)
            secs = time.perf_counter() - t
            toks = [g[0, len(batch_prompts[0]):].tolist()]
            return toks, secs, {}, None
        dec = self.decoder(spec, len(batch_prompts))
        t = time.perf_counter()
        out = dec.generate(batch_prompts, max_new_tokens=self.max_new_tokens, eos_token_id=eos, trace=want_trace)
        return out.tokens, time.perf_counter() - t, out.metrics, out.trace

    def warm_up(self, workloads, progress: bool) -> None:
        """Every decoder once on a short input (allocations; the goodput decoders start learning costs)."""
        warm = self.encode("Say hello.")
        if progress:
            sys.stderr.write(f"warm-up of {sum(len(m) for *_, m in workloads)} decoders...\n")
        for s, b, units, methods in workloads:
            for spec in methods:
                if spec[0] == "hf":
                    self.run_one(spec, [warm], False)
                else:
                    self.decoder(spec, b).generate([warm] * b, max_new_tokens=4, eos_token_id=self.eos)

    def run_rounds(self, workloads, rounds: int, repeats: int, bar: _Progress):
        """Every round visits every unit and runs its methods back to back, in an order rotated from unit to
        unit; at batch > 1 plain and the adaptive methods repeat ``repeats`` times. Returns (records, traces)."""
        records: Dict[str, List[dict]] = {}
        traces: Dict[Tuple[str, str], List[dict]] = {}
        for r in range(rounds):
            for s, b, units, methods in workloads:
                wkey = f"{s}/b{b}"
                for u, unit in enumerate(units):
                    for rep in range(_reps(b, repeats)):
                        ms_rep = methods if rep == 0 else [m for m in methods if is_adaptive(m)]
                        shift = (u + r + rep) % len(ms_rep)
                        for spec in ms_rep[shift:] + ms_rep[:shift]:
                            name = method_name(*spec)
                            toks, secs, m, tr = self.run_one(spec, unit, want_trace=spec[2] in ADAPTIVE)
                            n_tok = sum(len(t) for t in toks)
                            records.setdefault(wkey, []).append(dict(
                                method=name, unit=u, round=r, rep=rep, new_tokens=n_tok, seconds=secs,
                                tokens_per_second=n_tok / secs if secs > 0 else 0.0, tokens=toks, metrics=m))
                            if tr is not None and (wkey, name) not in traces:
                                traces[(wkey, name)] = tr
                            bar.step(f"{wkey} {name}")
        return records, traces


def _reps(b: int, repeats: int) -> int:
    return repeats if b > 1 else 1


def run_bench(runs: Dict[str, List[str]], batches: Sequence[int], rounds: int = 2, prompts_per_set: int = 3,
              max_new_tokens: int = 48, model_name: str = "smollm2-135m", progress: bool = True,
              trace_dir: Optional[str] = None, repeats: int = 1) -> Dict[str, object]:
    """Run the workloads; returns the JSON-ready result (see the module docstring)."""
    if int(repeats) < 1:
        raise ValueError(f"specdec bench: repeats must be an int >= 1, got {repeats!r}")
    load_start = loadavg()
    t_start = time.perf_counter()
    specs = {s: [parse_method(m) for m in ms] for s, ms in runs.items()}
    runner = _Runner(model_name, {d for ms in specs.values() for d, _, _ in ms}, max_new_tokens)
    prompts = {s: [runner.encode(t) for t in PROMPT_SETS[s][:prompts_per_set]] for s in specs}
    runner.max_len = max(len(p) for ps in prompts.values() for p in ps) + max_new_tokens + 8
    workloads = build_workloads(specs, prompts, batches)
    n_rep = int(repeats)
    total = sum(len(u) * (len(m) + (_reps(b, n_rep) - 1) * sum(map(is_adaptive, m)))
                for _, b, u, m in workloads) * rounds
    bar = _Progress(total, progress)
    runner.warm_up(workloads, progress)
    records, traces = runner.run_rounds(workloads, rounds, n_rep, bar)
    result = summarize(records, traces, workloads)
    result.update(
        benchmark="specdec bench", date=_dt.datetime.now().isoformat(timespec="seconds"), git_commit=git_commit(),
        machine=dict(cpu=cpu_name(), cores=os.cpu_count(), torch_threads=torch.get_num_threads(),
                     torch=torch.__version__, python=platform.python_version(), loadavg_start=load_start,
                     loadavg_end=loadavg(),
                     note="shared machine: other processes may run at the same time; see the load averages"),
        settings=dict(model=model_name, max_new_tokens=max_new_tokens, rounds=rounds, repeats=n_rep,
                      prompts_per_set=prompts_per_set,
                      batches=list(batches), runs=runs, greedy=True, chat_template=True, eos_token_id=runner.eos,
                      lookup=dict(ngram=3, min_ngram=2), default_k=DEFAULT_K),
        prompts={s: PROMPT_SETS[s][:prompts_per_set] for s in specs},
        wall_seconds=time.perf_counter() - t_start,
    )
    if trace_dir:
        _write_traces(traces, trace_dir)
    return result


def _write_traces(traces, trace_dir) -> None:
    """One JSON-lines file per traced (workload, method)."""
    from specdec.metrics import write_trace

    Path(trace_dir).mkdir(parents=True, exist_ok=True)
    for (wkey, name), tr in traces.items():
        write_trace(tr, Path(trace_dir) / f"{wkey.replace('/', '_')}_{name.replace(':', 'k').replace('@', '_')}.jsonl")


# ============================================================================ summary and table
def _pair_key(x: dict) -> Tuple[int, int, int]:
    """A run's (unit, round, repetition): its ratio is taken against the plain run of the same key."""
    return x["unit"], x["round"], x.get("rep", 0)


def summarize(records, traces, workloads) -> Dict[str, object]:
    """Per workload and method: medians, ratios against the paired plain (and hf) runs, the metrics' totals."""
    from specdec.metrics import summarize_trace

    summary: Dict[str, Dict[str, dict]] = {}
    for s, b, units, methods in workloads:
        wkey = f"{s}/b{b}"
        rows = records.get(wkey, [])
        plain = {_pair_key(x): x for x in rows if x["method"] == "plain"}
        hf = {_pair_key(x): x for x in rows if x["method"] == "hf"}
        out: Dict[str, dict] = {}
        for spec in methods:
            name = method_name(*spec)
            mine = [x for x in rows if x["method"] == name]
            if not mine:
                continue
            paired = [(x, plain[_pair_key(x)]) for x in mine if _pair_key(x) in plain]
            ratios = [x["tokens_per_second"] / p["tokens_per_second"] for x, p in paired]
            ratios_hf = [x["tokens_per_second"] / hf[_pair_key(x)]["tokens_per_second"] for x in mine
                         if _pair_key(x) in hf]
            same = [x["tokens"] == p["tokens"] for x, p in paired]
            row = dict(drafter=spec[0], k=spec[1] if spec[1] is not None else DEFAULT_K.get(spec[0]), policy=spec[2],
                       runs=len(mine), tokens_per_second_median=_median([x["tokens_per_second"] for x in mine]),
                       speedup_vs_plain_median=_median(ratios), speedup_vs_hf_median=_median(ratios_hf),
                       same_output_as_plain=f"{sum(same)}/{len(same)}")
            row.update(_metrics_totals([x["metrics"] for x in mine if x["metrics"]]))
            tr = traces.get((wkey, name))
            if tr is not None:
                t = summarize_trace(tr)
                row["trace_k_per_step"] = t["k_per_step"]
            out[name] = row
        summary[wkey] = out
    runs = {w: [{k: v for k, v in x.items() if k not in ("tokens", "metrics")} for x in rows]
            for w, rows in records.items()}
    return dict(summary=summary, runs=runs)


def _metrics_totals(ms: List[dict]) -> Dict[str, object]:
    """The decoders' metrics of a method's runs, summed or as medians (none: no speculative runs)."""
    if not ms:
        return {}
    drafted = sum(m["drafted_tokens"] for m in ms)
    accepted = sum(m["accepted_tokens"] for m in ms)
    depth = max(len(m["accepted_per_position"]) for m in ms)
    hist: Dict[str, int] = {}
    for m in ms:
        for k, v in m.get("chosen_k_histogram", {}).items():
            hist[k] = hist.get(k, 0) + v
    return dict(
        acceptance_rate=accepted / drafted if drafted else 0.0,
        mean_accepted_length=_median([m["mean_accepted_length"] for m in ms]),
        accepted_per_position=[_median([m["accepted_per_position"][i] for m in ms
                                        if len(m["accepted_per_position"]) > i]) for i in range(depth)],
        draft_seconds=sum(m["draft_seconds"] for m in ms),
        verify_seconds=sum(m["verify_seconds"] for m in ms),
        commit_seconds=sum(m["commit_seconds"] for m in ms),
        prefill_seconds=sum(m["prefill_seconds"] for m in ms),
        total_seconds=sum(m["total_seconds"] for m in ms),
        chosen_k_histogram=hist,
        mean_chosen_k=_median([m.get("mean_chosen_k", 0.0) for m in ms]),
        fallback_request_steps=sum(m.get("fallback_request_steps", 0) for m in ms),
        policy_events=sum(m.get("policy_events", 0) for m in ms),
        expected_tokens_predicted=_median([m.get("expected_tokens_predicted", 0.0) for m in ms]),
        expected_tokens_observed=_median([m.get("expected_tokens_observed", 0.0) for m in ms]),
    )


def format_table(result: Dict[str, object]) -> str:
    lines = []
    for wkey, rows in result["summary"].items():
        lines.append(f"\n== {wkey}")
        lines.append(f"{'method':<22} {'tok/s':>7} {'vs plain':>8} {'vs hf':>6} {'accept':>7} {'mean k':>6} "
                     f"{'fallback':>8} {'same':>6}")
        for name, r in rows.items():
            acc = f"{100 * r['acceptance_rate']:.0f}%" if "acceptance_rate" in r else "-"
            vs = f"{r['speedup_vs_plain_median']:.2f}x" if r.get("speedup_vs_plain_median") else "-"
            vh = f"{r['speedup_vs_hf_median']:.2f}x" if r.get("speedup_vs_hf_median") else "-"
            mk = f"{r['mean_chosen_k']:.1f}" if "mean_chosen_k" in r else "-"
            fb = str(r.get("fallback_request_steps", "-"))
            lines.append(f"{name:<22} {r['tokens_per_second_median']:7.1f} {vs:>8} {vh:>6} {acc:>7} {mk:>6} "
                         f"{fb:>8} {r['same_output_as_plain']:>6}")
    return "\n".join(lines)


# ============================================================================ CLI
def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="specdec bench", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", default="grounded:lookup@goodput,lookup:4@fixed,lookup:10@fixed;"
                                      "open:w8@goodput,w8:4@fixed,w8:8@fixed,random:8@goodput,random:8@fixed",
                    help="'SET:METHOD,...;SET:...' (METHOD = drafter[:k][@policy], plain, hf)")
    ap.add_argument("--config", default=None, help="JSON file with any of: runs (as --runs or {set: [methods]}), "
                                                   "batches, rounds, repeats, prompts, max_new_tokens")
    ap.add_argument("--batches", default="1", help="comma list of batch sizes (default 1)")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=1,
                    help="at batch > 1: runs of plain and the adaptive methods per unit and round (default 1)")
    ap.add_argument("--prompts", type=int, default=3, help="prompts per set (default 3, at most 6)")
    ap.add_argument("--max-new-tokens", type=int, default=48)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--out", default=None, help="JSON path (default specdec_bench_<date>.json)")
    ap.add_argument("--dashboard", default=None, help="PNG path (default: the JSON path with .png)")
    ap.add_argument("--traces", default=None, help="folder for one JSON-lines trace per goodput configuration")
    ap.add_argument("--no-progress", action="store_true")
    return ap


def main(argv: Optional[List[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    cfg = {}
    if args.config:
        cfg = json.loads(Path(args.config).read_text())
    try:
        runs = cfg.get("runs", args.runs)
        runs = parse_runs(runs) if isinstance(runs, str) else {k: list(v) for k, v in runs.items()}
        for s, ms in runs.items():
            if s not in PROMPT_SETS:
                raise ValueError(f"specdec bench: unknown prompt set {s!r}; sets: {sorted(PROMPT_SETS)}")
            for m in ms:
                parse_method(m)
        if int(cfg.get("repeats", args.repeats)) < 1:
            raise ValueError(f"specdec bench: repeats must be an int >= 1, got {cfg.get('repeats', args.repeats)!r}")
        batches = cfg.get("batches", [int(x) for x in str(args.batches).split(",") if x.strip()])
        if not batches or any(int(b) < 1 for b in batches):
            raise ValueError(f"specdec bench: batches must be ints >= 1, got {batches}")
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)  # the messages name the component
        return 2
    result = run_bench(runs, [int(b) for b in batches], rounds=int(cfg.get("rounds", args.rounds)),
                       prompts_per_set=int(cfg.get("prompts", args.prompts)),
                       max_new_tokens=int(cfg.get("max_new_tokens", args.max_new_tokens)), model_name=args.model,
                       progress=not args.no_progress, trace_dir=args.traces,
                       repeats=int(cfg.get("repeats", args.repeats)))
    print(format_table(result))
    out = Path(args.out or f"specdec_bench_{_dt.date.today().isoformat()}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1))
    png = Path(args.dashboard) if args.dashboard else out.with_suffix(".png")
    write_dashboard(result, png)
    print(f"\nwrote {out} and {png}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
