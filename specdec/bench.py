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
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

import torch

from specdec.drafters.base import Draft, Drafter, StepContext
from specdec.tree import TokenTree

__all__ = ["RandomDrafter", "PROMPT_SETS", "parse_method", "run_bench", "write_dashboard", "main"]

PASSAGE = (
    "The Great Barrier Reef is the world's largest coral reef system, composed of over 2,900 individual reefs "
    "and 900 islands stretching for over 2,300 kilometres over an area of approximately 344,400 square "
    "kilometres. The reef is located in the Coral Sea, off the coast of Queensland, Australia. It can be seen "
    "from outer space and is the world's biggest single structure made by living organisms. This reef structure "
    "is composed of and built by billions of tiny organisms, known as coral polyps.")

CODE = '''def compute_total(prices, tax_rate):
    total = 0
    for price in prices:
        total = total + price
    total = total * (1 + tax_rate)
    return round(total, 2)


def apply_discount(total, discount):
    if discount > 0.5:
        raise ValueError("discount too large")
    return total * (1 - discount)
'''

EMAIL = ("Hi Sarah,\n\nThank you for your message. I will be out of the office on Monday, so I suggest we meet on "
         "Monday afternoon instead of Monday morning. Please bring the quarterly report and the budget "
         "spreadsheet. Let me know if that works for you.\n\nBest regards,\nTom")

CSV = ("name,age,city\nAlice,34,London\nBob,29,Paris\nCharlie,41,Berlin\nDiana,25,Madrid\nEthan,38,Rome")

#: prompt sets (chat template applied): "grounded" answers copy from the input, "open" ones do not
PROMPT_SETS: Dict[str, List[str]] = {
    "grounded": [
        f"Repeat the following text exactly, word for word:\n\n{PASSAGE}",
        f"Rename the function compute_total to sum_prices in this code and output the full code:\n\n{CODE}",
        f"Here is an email:\n\n{EMAIL}\n\nRewrite the email exactly, but replace every 'Monday' with 'Friday'.",
        f"Convert this CSV data to a markdown table:\n\n{CSV}",
        f"Add a docstring to each function and output the full code:\n\n{CODE}",
        f"Quote the first two sentences of this passage:\n\n{PASSAGE}",
    ],
    "open": [
        "Write a short story about a robot who learns to paint.",
        "Explain how vaccines work in simple terms.",
        "Give me five tips for a successful job interview.",
        "What are the health benefits of regular exercise?",
        "Describe the city of Paris to someone who has never been there.",
        "Write a poem about the sea at night.",
    ],
}

DRAFTERS = ("lookup", "w8", "int8", "bf16", "random")
DEFAULT_K = {"lookup": 10, "w8": 8, "int8": 8, "bf16": 8, "random": 8}
#: policies that decide from what they measure: their ratios to plain sit near 1, so they get the repetitions
_ADAPTIVE = ("goodput", "heuristic")


class RandomDrafter(Drafter):
    """A useless drafter: a chain of k uniformly random tokens per row (seeded), at no drafting cost."""

    def __init__(self, k: int = 8, seed: int = 0) -> None:
        if isinstance(k, bool) or not isinstance(k, int) or k < 1:
            raise ValueError(f"RandomDrafter: k must be an int >= 1, got {k!r}")
        self.k = k
        self.max_nodes = k + 1
        self.seed = seed
        self.device = torch.device("cpu")
        self.vocab_size = 1

    def __repr__(self) -> str:
        return f"RandomDrafter(k={self.k})"

    def bind(self, target, max_batch: int, max_len: int) -> None:
        self.device = torch.device(target.device)
        self.vocab_size = int(target.vocab_size)

    def start(self, prompts, params, generator) -> None:
        self.rng = random.Random(self.seed)

    def propose(self, ctx: StepContext) -> Draft:
        rows = [[seq[-1]] + [self.rng.randrange(self.vocab_size) for _ in range(max(0, min(self.k, b)))]
                for seq, b in zip(ctx.sequences, ctx.budgets)]
        N = max(len(r) for r in rows)
        if N == 1:
            return Draft(TokenTree.root_only(ctx.roots))
        tokens = torch.tensor([r + [-1] * (N - len(r)) for r in rows], dtype=torch.int64, device=self.device)
        return Draft(TokenTree.chain(tokens, [len(r) for r in rows]))


# ============================================================================ methods
def parse_method(spec: str) -> Tuple[str, Optional[int], str]:
    """``drafter[:k][@policy]`` -> (drafter, k or None, policy). ``plain`` and ``hf`` take neither."""
    spec = spec.strip()
    if spec in ("plain", "hf"):
        return spec, None, "none"
    body, _, policy = spec.partition("@")
    name, _, k = body.partition(":")
    policy = policy or "goodput"
    if name not in DRAFTERS:
        raise ValueError(f"specdec bench: method {spec!r}: drafter must be one of plain, hf, {', '.join(DRAFTERS)}; "
                         f"got {name!r}")
    if policy not in ("fixed", "heuristic", "goodput"):
        raise ValueError(f"specdec bench: method {spec!r}: policy must be fixed, heuristic or goodput, got {policy!r}")
    if k:
        try:
            k_val = int(k)
        except ValueError:
            raise ValueError(f"specdec bench: method {spec!r}: k must be an int, got {k!r}") from None
        if k_val < 1:
            raise ValueError(f"specdec bench: method {spec!r}: k must be >= 1, got {k_val}")
        return name, k_val, policy
    return name, None, policy


def method_name(drafter: str, k: Optional[int], policy: str) -> str:
    if drafter in ("plain", "hf"):
        return drafter
    return f"{drafter}:{k if k is not None else DEFAULT_K[drafter]}@{policy}"


def parse_runs(text: str) -> Dict[str, List[str]]:
    """``"set:m1,m2;set2:m3"`` -> {set: [methods]} (methods of a set after its name)."""
    out: Dict[str, List[str]] = {}
    for part in text.split(";"):
        part = part.strip()
        if not part:
            continue
        name, sep, methods = part.partition(":")
        if not sep or name not in PROMPT_SETS:
            raise ValueError(f"specdec bench: --runs entry {part!r} must be 'SET:METHOD,...' with SET one of "
                             f"{sorted(PROMPT_SETS)}")
        out.setdefault(name, []).extend(m.strip() for m in methods.split(",") if m.strip())
    return out


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


def _git_commit() -> str:
    root = Path(__file__).resolve().parent.parent
    try:
        sha = subprocess.run(["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=root,
                               capture_output=True, text=True).stdout.strip()
        return (sha + ("-dirty" if dirty else "")) or "unknown"
    except OSError:
        return "unknown"


def _record_path(path) -> Optional[str]:
    """A path as a result file records it: relative to the repository when inside it, else its name only
    (a record must not carry the paths of the machine it ran on)."""
    if path is None:
        return None
    p = Path(path).resolve()
    try:
        return str(p.relative_to(Path(__file__).resolve().parent.parent))
    except ValueError:
        return p.name


def _cpu_name() -> str:
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


def _loadavg():
    return list(os.getloadavg()) if hasattr(os, "getloadavg") else None


# ============================================================================ the run
def run_bench(runs: Dict[str, List[str]], batches: Sequence[int], rounds: int = 2, prompts_per_set: int = 3,
              max_new_tokens: int = 48, model_name: str = "smollm2-135m", progress: bool = True,
              trace_dir: Optional[str] = None, repeats: int = 1) -> Dict[str, object]:
    """Run the workloads; returns the JSON-ready result (see the module docstring)."""
    from specdec.decoding import SpeculativeDecoder
    from specdec.drafters import DraftModel, PromptLookup
    from specdec.models.bundled import load_bundled
    from specdec.models.hf import HFCausalLM

    if int(repeats) < 1:
        raise ValueError(f"specdec bench: repeats must be an int >= 1, got {repeats!r}")
    load_start = _loadavg()
    t_start = time.perf_counter()
    specs = {s: [parse_method(m) for m in ms] for s, ms in runs.items()}
    wanted = {d for ms in specs.values() for d, _, _ in ms}
    model, tok = load_bundled(model_name)[:2]
    target = HFCausalLM(model)
    drafts = {}
    for kind in ("w8", "int8", "bf16"):
        if kind in wanted:
            drafts[kind] = HFCausalLM(load_bundled(model_name, draft=kind)[2])
    eos = tok.eos_token_id

    def encode(text: str) -> List[int]:
        ids = tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True, tokenize=True)
        if hasattr(ids, "keys"):
            ids = ids["input_ids"]
        return list(ids)

    prompts = {s: [encode(t) for t in PROMPT_SETS[s][:prompts_per_set]] for s in specs}
    max_b = max(batches)
    max_len = max(len(p) for ps in prompts.values() for p in ps) + max_new_tokens + 8

    def make_drafter(d: str, k: Optional[int]):
        k = k or DEFAULT_K[d]
        if d == "lookup":
            return PromptLookup(ngram=3, k=k)
        if d == "random":
            return RandomDrafter(k=k)
        return DraftModel(drafts[d], k=k)

    decoders: Dict[Tuple[str, int], object] = {}

    def decoder(spec, b: int):
        d, k, policy = spec
        key = (method_name(d, k, policy), b)
        if key not in decoders:
            if d == "plain":
                decoders[key] = SpeculativeDecoder(target, None, max_batch=b, max_len=max_len)
            else:
                decoders[key] = SpeculativeDecoder(target, make_drafter(d, k), max_batch=b, max_len=max_len,
                                                   policy=policy)
        return decoders[key]

    def run_one(spec, batch_prompts: List[List[int]], want_trace: bool):
        d = spec[0]
        if d == "hf":
            x = torch.tensor(batch_prompts)
            t = time.perf_counter()
            with torch.no_grad():
                g = model.generate(x, attention_mask=torch.ones_like(x), do_sample=False,
                                   max_new_tokens=max_new_tokens, eos_token_id=eos, pad_token_id=eos)
            secs = time.perf_counter() - t
            toks = [g[0, len(batch_prompts[0]):].tolist()]
            return toks, secs, {}, None
        dec = decoder(spec, len(batch_prompts))
        t = time.perf_counter()
        out = dec.generate(batch_prompts, max_new_tokens=max_new_tokens, eos_token_id=eos, trace=want_trace)
        return out.tokens, time.perf_counter() - t, out.metrics, out.trace

    # workloads: (set, batch) -> units of prompts
    workloads = []
    for s, ms in specs.items():
        methods = [("plain", None, "none")] + [m for m in ms if m[0] != "plain"]
        for b in batches:
            ps = prompts[s]
            if b == 1:
                units = [[p] for p in ps]
            else:
                units = [[ps[i % len(ps)] for i in range(b)]]
            ms_b = [m for m in methods if not (m[0] == "hf" and b != 1)]
            workloads.append((s, b, units, ms_b))
    def reps(b: int) -> int:
        return int(repeats) if b > 1 else 1

    def adaptive(spec) -> bool:  # plain and the policies that decide from what they measure
        return spec[0] == "plain" or spec[2] in _ADAPTIVE

    total = sum(len(u) * (len(m) + (reps(b) - 1) * sum(map(adaptive, m))) for _, b, u, m in workloads) * rounds
    bar = _Progress(total, progress)

    # warm-up: every decoder once on a short input (allocations; the goodput decoders start learning costs)
    warm = encode("Say hello.")
    if progress:
        sys.stderr.write(f"warm-up of {sum(len(m) for *_, m in workloads)} decoders...\n")
    for s, b, units, methods in workloads:
        for spec in methods:
            if spec[0] == "hf":
                run_one(spec, [warm], False)
            else:
                decoder(spec, b).generate([warm] * b, max_new_tokens=4, eos_token_id=eos)

    records: Dict[str, List[dict]] = {}
    traces: Dict[str, List[dict]] = {}
    for r in range(rounds):
        for s, b, units, methods in workloads:
            wkey = f"{s}/b{b}"
            for u, unit in enumerate(units):
                for rep in range(reps(b)):
                    ms_rep = methods if rep == 0 else [m for m in methods if adaptive(m)]
                    shift = (u + r + rep) % len(ms_rep)
                    for spec in ms_rep[shift:] + ms_rep[:shift]:
                        name = method_name(*spec)
                        toks, secs, m, tr = run_one(spec, unit, want_trace=spec[2] in _ADAPTIVE)
                        n_tok = sum(len(t) for t in toks)
                        records.setdefault(wkey, []).append(dict(
                            method=name, unit=u, round=r, rep=rep, new_tokens=n_tok, seconds=secs,
                            tokens_per_second=n_tok / secs if secs > 0 else 0.0, tokens=toks, metrics=m))
                        if tr is not None and (wkey, name) not in traces:
                            traces[(wkey, name)] = tr
                        bar.step(f"{wkey} {name}")
    result = _summarize(records, traces, workloads)
    result.update(
        benchmark="specdec bench", date=_dt.datetime.now().isoformat(timespec="seconds"), git_commit=_git_commit(),
        machine=dict(cpu=_cpu_name(), cores=os.cpu_count(), torch_threads=torch.get_num_threads(),
                     torch=torch.__version__, python=platform.python_version(), loadavg_start=load_start,
                     loadavg_end=_loadavg(),
                     note="shared machine: other processes may run at the same time; see the load averages"),
        settings=dict(model=model_name, max_new_tokens=max_new_tokens, rounds=rounds, repeats=int(repeats),
                      prompts_per_set=prompts_per_set,
                      batches=list(batches), runs=runs, greedy=True, chat_template=True, eos_token_id=eos,
                      lookup=dict(ngram=3, min_ngram=2), default_k=DEFAULT_K),
        prompts={s: PROMPT_SETS[s][:prompts_per_set] for s in specs},
        wall_seconds=time.perf_counter() - t_start,
    )
    if trace_dir:
        Path(trace_dir).mkdir(parents=True, exist_ok=True)
        from specdec.metrics import write_trace
        for (wkey, name), tr in traces.items():
            write_trace(tr, Path(trace_dir) / f"{wkey.replace('/', '_')}_{name.replace(':', 'k').replace('@', '_')}.jsonl")
    return result


def _pair_key(x: dict) -> Tuple[int, int, int]:
    """A run's (unit, round, repetition): its ratio is taken against the plain run of the same key."""
    return x["unit"], x["round"], x.get("rep", 0)


def _summarize(records, traces, workloads) -> Dict[str, object]:
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
            ms = [x["metrics"] for x in mine if x["metrics"]]
            if ms:
                drafted = sum(m["drafted_tokens"] for m in ms)
                accepted = sum(m["accepted_tokens"] for m in ms)
                depth = max(len(m["accepted_per_position"]) for m in ms)
                hist: Dict[str, int] = {}
                for m in ms:
                    for k, v in m.get("chosen_k_histogram", {}).items():
                        hist[k] = hist.get(k, 0) + v
                row.update(
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
            tr = traces.get((wkey, name))
            if tr is not None:
                t = summarize_trace(tr)
                row["trace_k_per_step"] = t["k_per_step"]
            out[name] = row
        summary[wkey] = out
    runs = {w: [{k: v for k, v in x.items() if k not in ("tokens", "metrics")} for x in rows]
            for w, rows in records.items()}
    return dict(summary=summary, runs=runs)


# ============================================================================ table and dashboard
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


def write_dashboard(result: Dict[str, object], path) -> None:
    """PNG dashboard of a bench result (matplotlib, Agg backend)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    summary = result["summary"]
    fig, axes = plt.subplots(2, 3, figsize=(18, 10))
    ax_acc, ax_k, ax_sp, ax_split, ax_trace, ax_txt = axes.flatten()

    # acceptance per position (fixed-k runs: every position is drafted every step)
    for wkey, rows in summary.items():
        for name, r in rows.items():
            app = r.get("accepted_per_position")
            if app and r["policy"] in ("fixed", "goodput") and r["drafter"] != "random":
                ax_acc.plot(range(1, len(app) + 1), app, marker=".", label=f"{wkey} {name}")
    ax_acc.set(title="acceptance per position", xlabel="draft position", ylabel="P(accepted | reached)", ylim=(0, 1))
    ax_acc.legend(fontsize=6)

    # tokens/s vs k (fixed sweeps) with goodput and plain as horizontal lines
    for wkey, rows in summary.items():
        by_drafter: Dict[str, List[Tuple[int, float]]] = {}
        for name, r in rows.items():
            if r["policy"] == "fixed":
                by_drafter.setdefault(r["drafter"], []).append((r["k"], r["tokens_per_second_median"]))
        for d, pts in by_drafter.items():
            pts.sort()
            line, = ax_k.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=f"{wkey} {d} fixed")
            g = [r for r in rows.values() if r["drafter"] == d and r["policy"] == "goodput"]
            if g:
                ax_k.axhline(g[0]["tokens_per_second_median"], color=line.get_color(), ls="--", lw=1,
                             label=f"{wkey} {d} goodput")
        if "plain" in rows:
            ax_k.axhline(rows["plain"]["tokens_per_second_median"], color="k", ls=":", lw=1)
    ax_k.set(title="tokens/s vs k (dotted: plain, dashed: goodput)", xlabel="k", ylabel="tokens/s")
    ax_k.legend(fontsize=6)

    # speedup vs plain (and vs transformers) per configuration
    labels, vals, vals_hf = [], [], []
    for wkey, rows in summary.items():
        for name, r in rows.items():
            if name == "plain":
                continue
            labels.append(f"{wkey} {name}")
            vals.append(r.get("speedup_vs_plain_median") or 0.0)
            vals_hf.append(r.get("speedup_vs_hf_median") or 0.0)
    y = range(len(labels))
    ax_sp.barh(list(y), vals, color=["tab:green" if v >= 1 else "tab:red" for v in vals])
    hf_pts = [(v, i) for i, v in enumerate(vals_hf) if v]
    if hf_pts:
        ax_sp.scatter([p[0] for p in hf_pts], [p[1] for p in hf_pts], marker="x", color="k",
                      label="vs transformers generate", zorder=3)
        ax_sp.legend(fontsize=6)
    ax_sp.axvline(1.0, color="k", lw=1)
    ax_sp.set_yticks(list(y))
    ax_sp.set_yticklabels(labels, fontsize=5)
    ax_sp.set(title="speedup vs plain (median per unit)", xlabel="x plain")

    # time split
    names, parts = [], {"prefill": [], "draft": [], "verify": [], "commit": [], "other": []}
    for wkey, rows in summary.items():
        for name, r in rows.items():
            if "total_seconds" not in r or not r["total_seconds"]:
                continue
            tot = r["total_seconds"]
            names.append(f"{wkey} {name}")
            for key in ("prefill", "draft", "verify", "commit"):
                parts[key].append(r[f"{key}_seconds"] / tot)
            parts["other"].append(max(0.0, 1 - sum(r[f"{key}_seconds"] for key in
                                                   ("prefill", "draft", "verify", "commit")) / tot))
    left = [0.0] * len(names)
    for key, vs in parts.items():
        ax_split.barh(range(len(names)), vs, left=left, label=key)
        left = [a + b for a, b in zip(left, vs)]
    ax_split.set_yticks(range(len(names)))
    ax_split.set_yticklabels(names, fontsize=5)
    ax_split.set(title="time split (fraction of the call)", xlim=(0, 1))
    ax_split.legend(fontsize=6)

    # the goodput policy's chosen k over steps (one traced run per configuration)
    for wkey, rows in summary.items():
        for name, r in rows.items():
            if r.get("trace_k_per_step"):
                ax_trace.step(range(len(r["trace_k_per_step"])), r["trace_k_per_step"], where="post",
                              label=f"{wkey} {name}")
    ax_trace.set(title="goodput policy: chosen k per step (one run)", xlabel="step", ylabel="k")
    ax_trace.legend(fontsize=6)

    m = result.get("machine", {})
    s = result.get("settings", {})
    ax_txt.axis("off")
    ax_txt.text(0, 1, "\n".join([
        f"specdec bench  {result.get('date', '')}",
        f"commit {str(result.get('git_commit', ''))[:12]}",
        f"cpu {m.get('cpu', '')}, {m.get('torch_threads', '')} threads",
        f"load avg start {m.get('loadavg_start')}",
        f"load avg end   {m.get('loadavg_end')}",
        f"model {s.get('model', '')}, {s.get('max_new_tokens', '')} new tokens, greedy",
        f"rounds {s.get('rounds', '')}, batches {s.get('batches', '')}",
    ]), va="top", family="monospace", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


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
