"""Load benchmark of `specdec serve`: the live server on 127.0.0.1 under bounded Poisson arrivals.

For each mode (plain decoding, prompt lookup) and each load (one request in flight, Poisson
arrivals at the given rates, a saturating closed loop that keeps max_batch requests in flight)
and prompt mix (grounded / open, from specdec.bench.PROMPT_SETS with the chat template), it sends
a fixed number of streaming chat requests (greedy) through the official OpenAI-compatible API
with httpx and measures, per request, TTFT (send -> first content chunk) and the inter-token
latencies (chunk gaps divided by the tokens they carry), plus request throughput, output tokens/s
and failures. Every completion is compared with the same request run alone on an in-process
engine (greedy: must be token-identical). The in-process engine at batch 1 is also timed, for
the HTTP overhead. Modes run interleaved per load (plain, spec, spec, plain, ...), the load
average is recorded. Output: JSON and a PNG (latency vs load, spec vs plain).

    python benchmarks/bench_serve.py --requests 12 --rates 0.5,1.5 --out benchmarks/results/serve_DATE.json

Soak (not in CI): ``--soak 500`` sends 500 requests with random aborts (streams closed early) and
bad requests mixed in at up to max_batch in flight; every good request must be answered
completely and correctly, no rows may leak, and resident memory must stay within +-5 % after
warm-up.
"""
from __future__ import annotations

import argparse
import asyncio
import datetime as _dt
import json
import os
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Dict, List, Optional

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from specdec.bench import PROMPT_SETS, cpu_name as _cpu_name, git_commit as _git_commit, loadavg as _loadavg  # noqa: E402
from specdec.engine import Engine, RequestParams  # noqa: E402


def pct(xs: List[float], q: float) -> Optional[float]:
    if not xs:
        return None
    xs = sorted(xs)
    i = min(len(xs) - 1, max(0, int(round(q / 100 * (len(xs) - 1)))))
    return xs[i]


def rss_bytes(pid: Optional[int] = None) -> int:
    with open(f"/proc/{pid or 'self'}/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ProcLive:
    """``specdec serve`` in its own process (the deployment shape: no GIL shared with the load generator)."""

    def __init__(self, draft: str, policy: str, max_batch: int, threads: Optional[int], max_queue: int = 256) -> None:
        import subprocess

        import httpx

        self.port = _free_port()
        cmd = [sys.executable, "-m", "specdec.cli", "serve", "--model", "smollm2-135m", "--draft", draft,
               "--policy", policy, "--max-batch", str(max_batch), "--max-len", "2048", "--max-queue", str(max_queue),
               "--port", str(self.port), "--log-level", "warning"]
        if draft == "lookup":
            cmd += ["--k", "10", "--ngram", "3"]
        if threads:
            cmd += ["--threads", str(threads)]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        self.url = f"http://127.0.0.1:{self.port}"
        t0 = time.time()
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError("bench_serve: specdec serve exited: " + self.proc.stderr.read().decode()[-2000:])
            if time.time() - t0 > 300:
                raise RuntimeError("bench_serve: specdec serve did not come up")
            try:
                if httpx.get(self.url + "/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.3)

    def health(self) -> dict:
        import httpx

        return httpx.get(self.url + "/health", timeout=10).json()

    def rss(self) -> int:
        return rss_bytes(self.proc.pid)

    def close(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(20)
        except Exception:  # noqa: BLE001
            self.proc.kill()


def Live(engine: Engine, tok, max_queue: int = 256):
    """The server in a thread of this process (``--server thread``)."""
    from specdec.server import ServerThread

    return ServerThread(engine, tok, "smollm2-135m", max_queue=max_queue)


async def one_request(client, url: str, text: str, max_tokens: int, abort_after: Optional[int] = None) -> dict:
    import httpx

    body = dict(model="smollm2-135m", messages=[{"role": "user", "content": text}], max_tokens=max_tokens,
                temperature=0, stream=True, stream_options={"include_usage": True, "continuous_usage_stats": True})
    t0 = time.perf_counter()
    rec = dict(ok=False, ttft=None, itl=[], text="", tokens=0, status=None, error=None)
    last = None
    prev_tokens = 0
    try:
        async with client.stream("POST", url + "/v1/chat/completions", json=body, timeout=600) as r:
            rec["status"] = r.status_code
            if r.status_code != 200:
                rec["error"] = (await r.aread()).decode()[:200]
                return rec
            chunks = 0
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                ev = json.loads(line[6:])
                if "error" in ev:
                    rec["error"] = ev["error"]["message"]
                    return rec
                n_now = ev["usage"]["completion_tokens"] if ev.get("usage") else prev_tokens
                if ev.get("usage"):
                    rec["tokens"] = n_now
                if not ev.get("choices"):
                    continue
                delta = ev["choices"][0]["delta"].get("content")
                if delta or n_now > prev_tokens:
                    now = time.perf_counter()
                    rec["text"] += delta or ""
                    chunks += 1
                    if last is None:
                        rec["ttft"] = now - t0
                    elif n_now > prev_tokens:  # the gap, spread over the tokens this chunk carries
                        rec["itl"] += [(now - last) / (n_now - prev_tokens)] * (n_now - prev_tokens)
                    last = now
                    prev_tokens = n_now
                    if abort_after is not None and chunks >= abort_after:
                        rec["aborted"] = True
                        return rec
        rec["ok"] = True
        rec["seconds"] = time.perf_counter() - t0
    except (httpx.HTTPError, json.JSONDecodeError) as exc:
        rec["error"] = f"{type(exc).__name__}: {exc}"
    return rec


async def run_load(url: str, prompts: List[str], n: int, max_tokens: int, rate: Optional[float], concurrency: int,
                   seed: int, time_limit: float) -> dict:
    """rate None: closed loop with ``concurrency`` in flight; else Poisson arrivals (at most ``concurrency`` in
    flight: bounded)."""
    import httpx

    rng = random.Random(seed)
    order = [prompts[i % len(prompts)] for i in range(n)]
    results: List[dict] = []
    sem = asyncio.Semaphore(concurrency)
    t_start = time.perf_counter()
    async with httpx.AsyncClient(limits=httpx.Limits(max_connections=concurrency + 4)) as client:
        async def go(text):
            async with sem:
                if time.perf_counter() - t_start > time_limit:
                    results.append(dict(ok=False, error="time limit", text="", itl=[], ttft=None))
                    return
                r = await one_request(client, url, text, max_tokens)
                r["prompt"] = text
                results.append(r)

        tasks = []
        for text in order:
            tasks.append(asyncio.create_task(go(text)))
            if rate is not None:
                await asyncio.sleep(rng.expovariate(rate))
        await asyncio.gather(*tasks)
    wall = time.perf_counter() - t_start
    ok = [r for r in results if r["ok"]]
    ttft = [r["ttft"] for r in ok if r["ttft"] is not None]
    itl = [x for r in ok for x in r["itl"]]
    toks = sum(r.get("tokens", 0) for r in ok)
    return dict(requests=n, ok=len(ok), failures=n - len(ok), wall_seconds=wall,
                request_throughput=len(ok) / wall, output_tokens_per_second=toks / wall,
                ttft_p50=pct(ttft, 50), ttft_p99=pct(ttft, 99), itl_p50=pct(itl, 50), itl_p99=pct(itl, 99),
                output_tokens=toks, texts={r["prompt"]: r["text"] for r in ok},
                errors=[r.get("error") for r in results if not r["ok"]][:5])


def solo_texts(target, tok, drafter, prompts: List[str], max_tokens: int) -> Dict[str, str]:
    eng = Engine(target, drafter, max_batch=1, max_len=2048, policy="fixed")
    out = {}
    for text in prompts:
        ids = tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True, tokenize=True)
        ids = list(ids["input_ids"] if hasattr(ids, "keys") else ids)
        eng.add_request(0, ids, RequestParams(max_new_tokens=max_tokens, stop_token_ids=(tok.eos_token_id,)))
        toks = []
        while eng.has_unfinished():
            toks += [t for d in eng.step() for t in d.new_tokens]
        out[text] = tok.decode(toks, skip_special_tokens=True)
    return out


def inprocess_tps(target, tok, drafter, prompts: List[str], max_tokens: int, policy: str) -> float:
    """Tokens/s of the engine alone at batch 1 (no HTTP), same prompts one after another."""
    eng = Engine(target, drafter, max_batch=8, max_len=2048, policy=policy)
    n = 0
    t0 = time.perf_counter()
    for text in prompts:
        ids = tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True, tokenize=True)
        ids = list(ids["input_ids"] if hasattr(ids, "keys") else ids)
        eng.add_request(0, ids, RequestParams(max_new_tokens=max_tokens, stop_token_ids=(tok.eos_token_id,)))
        while eng.has_unfinished():
            n += sum(len(d.new_tokens) for d in eng.step())
    return n / (time.perf_counter() - t0)


def soak(target, tok, n: int, max_batch: int, seed: int, threads: Optional[int]) -> dict:
    """n requests, random aborts and bad requests mixed in; checks completeness, correctness, rows, RSS."""
    import httpx

    prompts = PROMPT_SETS["grounded"][:3] + PROMPT_SETS["open"][:3]
    max_tokens = 12
    want = solo_texts(target, tok, None, prompts, max_tokens)
    live = ProcLive("lookup", "goodput", max_batch, threads)
    rng = random.Random(seed)
    stats = dict(good=0, good_ok=0, wrong=0, aborted=0, bad=0, bad_400=0, other_errors=[])
    rss: List[int] = []

    async def main():
        sem = asyncio.Semaphore(max_batch)
        async with httpx.AsyncClient(limits=httpx.Limits(max_connections=max_batch + 8)) as client:
            async def go(i):
                async with sem:
                    kind = rng.random()
                    text = prompts[i % len(prompts)]
                    if kind < 0.1:   # bad request
                        stats["bad"] += 1
                        body = rng.choice([dict(model="smollm2-135m", messages=[]),
                                           dict(model="nope", messages=[{"role": "user", "content": "x"}]),
                                           dict(model="smollm2-135m", messages=[{"role": "user", "content": "x"}],
                                                temperature=-1)])
                        r = await client.post(live.url + "/v1/chat/completions", json=body, timeout=60)
                        stats["bad_400"] += r.status_code == 400
                    elif kind < 0.25:  # abort after a couple of chunks
                        stats["aborted"] += 1
                        await one_request(client, live.url, text, max_tokens, abort_after=rng.randint(1, 3))
                    else:
                        stats["good"] += 1
                        r = await one_request(client, live.url, text, max_tokens)
                        if r["ok"] and r["text"] == want[text]:
                            stats["good_ok"] += 1
                        elif r["ok"]:
                            stats["wrong"] += 1
                        else:
                            stats["other_errors"].append(r.get("error"))
                    if i % 25 == 0:
                        rss.append(live.rss())

            await asyncio.gather(*(go(i) for i in range(n)))

    t0 = time.perf_counter()
    asyncio.run(main())
    wall = time.perf_counter() - t0
    time.sleep(1.0)
    h = live.health()
    leaked = dict(active=h["active"], waiting=h["waiting"], outstanding=h["outstanding"])
    live.close()
    warm = rss[len(rss) // 4:] or rss
    drift = (max(warm) - min(warm)) / min(warm) if warm else 0.0
    stats["other_errors"] = stats["other_errors"][:5]
    return dict(requests=n, wall_seconds=wall, **stats, leaked=leaked, rss_samples=rss,
                rss_drift_after_warmup=drift,
                passed=stats["good_ok"] == stats["good"] and not any(leaked.values()) and drift <= 0.05
                and stats["bad_400"] == stats["bad"])


def overhead(target, tok, rounds: int, max_tokens: int) -> dict:
    """The HTTP path at batch 1 against the in-process engine, plain decoding, 1 and 2 torch threads,
    interleaved rounds (medians). The load generator shares the machine with the server."""
    prompts = PROMPT_SETS["open"][:3]
    out = {}
    for th in (1, 2):
        torch.set_num_threads(th)
        live = ProcLive("none", "fixed", 8, th)
        ip, hp = [], []
        try:
            for _ in range(rounds):
                ip.append(inprocess_tps(target, tok, None, prompts, max_tokens, "fixed"))
                hp.append(asyncio.run(run_load(live.url, prompts, len(prompts), max_tokens, None, 1, 0, 300))
                          ["output_tokens_per_second"])
        finally:
            live.close()
        out[f"threads_{th}"] = dict(inprocess_tokens_per_second=ip, http_tokens_per_second=hp,
                                    ratio_of_medians=statistics.median(hp) / statistics.median(ip))
        print(f"threads {th}: in-process {statistics.median(ip):.1f} tok/s, HTTP {statistics.median(hp):.1f} tok/s, "
              f"ratio {out[f'threads_{th}']['ratio_of_medians']:.3f}", flush=True)
    return out


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    for mix, style in (("grounded", "-"), ("open", "--")):
        for mode, color in (("plain", "tab:gray"), ("lookup", "tab:blue")):
            rows = [r for r in result["runs"] if r["mix"] == mix and r["mode"] == mode]
            x = list(range(len(rows)))
            labels = [r["load"] for r in rows]
            axes[0].plot(x, [r["itl_p50"] * 1e3 if r["itl_p50"] else None for r in rows], style, color=color,
                         marker="o", label=f"{mode} {mix}")
            axes[1].plot(x, [r["ttft_p50"] * 1e3 if r["ttft_p50"] else None for r in rows], style, color=color,
                         marker="o", label=f"{mode} {mix}")
            axes[2].plot(x, [r["output_tokens_per_second"] for r in rows], style, color=color, marker="o",
                         label=f"{mode} {mix}")
    for ax, title in zip(axes, ("ITL p50 (ms)", "TTFT p50 (ms)", "output tokens/s")):
        ax.set_xticks(range(len(labels)))
        ax.set_xticklabels(labels, rotation=20)
        ax.set_title(title)
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8)
    fig.suptitle(f"specdec serve, SmolLM2-135M, CPU ({result['machine']['cores']} cores), "
                 f"load avg {result['machine']['loadavg_start']}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--requests", type=int, default=12, help="requests per (mode, load, mix)")
    ap.add_argument("--rates", default="0.5,1.5", help="Poisson arrival rates (requests/s)")
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--max-batch", type=int, default=8)
    ap.add_argument("--policy", default="goodput", choices=["goodput", "fixed", "heuristic"])
    ap.add_argument("--time-limit", type=float, default=300.0, help="seconds per (mode, load, mix) at most")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--mixes", default="grounded,open")
    ap.add_argument("--server", default="process", choices=["process", "thread"],
                    help="process: `specdec serve` subprocesses (default); thread: in this process")
    ap.add_argument("--soak", type=int, default=0, help="run the soak test with this many requests instead")
    ap.add_argument("--overhead", type=int, default=0,
                    help="only measure the HTTP overhead at batch 1 (1 and 2 torch threads), this many rounds")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    from specdec import PromptLookup
    from specdec.models.bundled import load_bundled
    from specdec.models.hf import HFCausalLM

    model, tok = load_bundled("smollm2-135m")
    target = HFCausalLM(model)
    date = _dt.date.today().isoformat()
    machine = dict(cpu=_cpu_name(), cores=os.cpu_count(), torch_threads=torch.get_num_threads(),
                   loadavg_start=_loadavg())
    if args.overhead:
        res = dict(benchmark="bench_serve overhead", date=date, git_commit=_git_commit(),
                   settings=dict(max_tokens=args.max_tokens, rounds=args.overhead, prompts="open[:3]", greedy=True),
                   results=overhead(target, tok, args.overhead, args.max_tokens))
        res["machine"] = dict(machine, loadavg_end=_loadavg())
        out = Path(args.out or f"benchmarks/results/serve_overhead_{date}.json")
        out.write_text(json.dumps(res, indent=1))
        print(f"wrote {out}")
        return 0
    if args.soak:
        res = soak(target, tok, args.soak, args.max_batch, seed=1, threads=args.threads)
        res.update(benchmark="bench_serve soak", date=date, git_commit=_git_commit(),
                   machine=dict(machine, loadavg_end=_loadavg()))
        out = Path(args.out or f"benchmarks/results/serve_soak_{date}.json")
        out.write_text(json.dumps(res, indent=1))
        print(json.dumps({k: v for k, v in res.items() if k != "rss_samples"}, indent=1))
        return 0 if res["passed"] else 1

    rates = [float(x) for x in args.rates.split(",") if x]
    loads = [("light", None, 1)] + [(f"poisson {r}/s", r, args.max_batch) for r in rates] + \
            [("saturating", None, args.max_batch)]
    mixes = [m for m in args.mixes.split(",") if m]
    modes = {"plain": lambda: None, "lookup": lambda: PromptLookup(ngram=3, k=10, min_ngram=2)}
    runs = []
    exact_total = exact_ok = 0
    refs = {}
    for mix in mixes:
        prompts = PROMPT_SETS[mix]
        refs[mix] = solo_texts(target, tok, None, prompts, args.max_tokens)
    # the HTTP overhead at batch 1: in-process engine vs the light-load HTTP run, same prompts (grounded)
    inproc = {m: inprocess_tps(target, tok, mk(), PROMPT_SETS[mixes[0]], args.max_tokens, args.policy)
              for m, mk in modes.items()}
    if args.server == "process":
        lives = {m: ProcLive("none" if m == "plain" else m, args.policy, args.max_batch, args.threads) for m in modes}
    else:
        lives = {m: Live(Engine(target, mk(), max_batch=args.max_batch, max_len=2048, policy=args.policy), tok)
                 for m, mk in modes.items()}
    try:
        for li, (load, rate, conc) in enumerate(loads):
            for mix in mixes:
                order = list(modes) if li % 2 == 0 else list(modes)[::-1]   # interleaved
                for mode in order:
                    r = asyncio.run(run_load(lives[mode].url, PROMPT_SETS[mix], args.requests, args.max_tokens, rate,
                                             conc, seed=li, time_limit=args.time_limit))
                    texts = r.pop("texts")
                    same = sum(texts[p] == refs[mix][p] for p in texts)
                    exact_total += len(texts)
                    exact_ok += same
                    r.update(mode=mode, load=load, rate=rate, concurrency=conc, mix=mix, identical_to_solo=same,
                             loadavg=_loadavg())
                    runs.append(r)
                    print(f"{mix:8s} {load:14s} {mode:6s} ok {r['ok']}/{r['requests']} tok/s "
                          f"{r['output_tokens_per_second']:6.1f} ITL p50 {1e3 * (r['itl_p50'] or 0):6.1f} ms "
                          f"p99 {1e3 * (r['itl_p99'] or 0):6.1f} TTFT p50 {1e3 * (r['ttft_p50'] or 0):6.0f} ms "
                          f"identical {same}/{len(texts)}", flush=True)
    finally:
        for lv in lives.values():
            lv.close()

    def get(mode, load, mix, key):
        return next(r[key] for r in runs if r["mode"] == mode and r["load"] == load and r["mix"] == mix)

    def ratio(a, b):
        return a / b if a and b else None

    m0 = mixes[0]
    targets = dict(
        greedy_identical_fraction=exact_ok / exact_total if exact_total else None,
        light_grounded_itl_p50_ratio=ratio(get("lookup", "light", m0, "itl_p50"), get("plain", "light", m0, "itl_p50")),
        light_grounded_ttft_p50_ratio=ratio(get("lookup", "light", m0, "ttft_p50"),
                                            get("plain", "light", m0, "ttft_p50")),
        saturating_tokens_per_second_ratio={mix: ratio(get("lookup", "saturating", mix, "output_tokens_per_second"),
                                                       get("plain", "saturating", mix, "output_tokens_per_second"))
                                            for mix in mixes},
        http_vs_inprocess_batch1={m: ratio(get(m, "light", m0, "output_tokens_per_second"), inproc[m]) for m in modes},
        goals=dict(greedy_identical_fraction=1.0, light_grounded_itl_p50_ratio="<= 0.6",
                   light_grounded_ttft_p50_ratio="<= 1.1", saturating_tokens_per_second_ratio=">= 0.95",
                   http_vs_inprocess_batch1=">= 0.95"))
    result = dict(benchmark="bench_serve", date=date, git_commit=_git_commit(),
                  machine=dict(machine, loadavg_end=_loadavg(),
                               note="shared machine; compare ratios measured in this run"),
                  settings=dict(server=args.server, requests=args.requests, rates=rates, max_tokens=args.max_tokens,
                                max_batch=args.max_batch, policy=args.policy, greedy=True, chat_template=True,
                                lookup=dict(ngram=3, k=10, min_ngram=2)),
                  inprocess_tokens_per_second_batch1=inproc, runs=runs, targets=targets)
    out = Path(args.out or f"benchmarks/results/serve_{date}.json")
    out.write_text(json.dumps(result, indent=1))
    plot(result, out.with_suffix(".png"))
    print(json.dumps(targets, indent=1))
    print(f"wrote {out} and {out.with_suffix('.png')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
