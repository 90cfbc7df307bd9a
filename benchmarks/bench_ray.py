"""Ray Serve replicas: saturation throughput of 2 replicas vs 1 (1 torch thread each) on this machine.

For each replica count the bundled model is served by `specdec serve --replicas N --ray` machinery
(start_replicas, a local Ray cluster on loopback, prompt lookup, greedy) and a closed loop of
``--concurrency`` clients (the official openai client) sends ``--requests`` chat requests; recorded:
output tokens per second, request latency, and whether every reply equals the 1-replica reply to
the same question. The load average is recorded: on a machine whose cores are shared with other
work, replicas cannot get a core each and the ratio says so.

    python benchmarks/bench_ray.py --requests 16 --concurrency 8 --out benchmarks/results/ray_DATE.json
"""
from __future__ import annotations

import argparse
import concurrent.futures as cf
import json
import os
import socket
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from specdec.bench import PROMPT_SETS, cpu_name, git_commit, loadavg  # noqa: E402


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def serve_args(replicas: int, max_batch: int) -> argparse.Namespace:
    from specdec.cli import serve_options

    return serve_options(["--model", "smollm2-135m", "--draft", "lookup", "--policy", "fixed", "--threads", "1",
                          "--port", str(_port()), "--max-batch", str(max_batch), "--max-len", "1024",
                          "--log-level", "warning", "--replicas", str(replicas), "--ray"])


def load(url: str, questions, concurrency: int, max_tokens: int):
    import openai

    client = openai.OpenAI(base_url=url + "/v1", api_key="none", timeout=600, max_retries=0)

    def one(q):
        t0 = time.perf_counter()
        r = client.chat.completions.create(model="smollm2-135m", messages=[{"role": "user", "content": q}],
                                           max_tokens=max_tokens, temperature=0)
        return r.choices[0].message.content, r.usage.completion_tokens, time.perf_counter() - t0

    t0 = time.perf_counter()
    with cf.ThreadPoolExecutor(concurrency) as pool:
        out = list(pool.map(one, questions))
    return out, time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--max-batch", type=int, default=4)
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    import ray
    from ray import serve

    from specdec.distributed.ray_serve import start_replicas

    texts = [t for ts in PROMPT_SETS.values() for t in ts]
    questions = [texts[i % len(texts)] for i in range(a.requests)]
    ray.init(num_cpus=os.cpu_count(), include_dashboard=False)
    rows, replies = [], {}
    port = _port()  # Serve's proxy keeps its first port
    for replicas in (1, 2):
        t_start = time.perf_counter()
        args = serve_args(replicas, a.max_batch)
        args.port = port
        url = start_replicas(args, replicas, timeout=600)
        started = time.perf_counter() - t_start
        load(url, questions[:2], 2, 4)  # warm-up
        out, wall = load(url, questions, a.concurrency, a.max_tokens)
        toks = sum(o[1] for o in out)
        replies[replicas] = [o[0] for o in out]
        rows.append(dict(replicas=replicas, seconds=wall, completion_tokens=toks, tokens_per_second=toks / wall,
                         latency_median=sorted(o[2] for o in out)[len(out) // 2], start_seconds=started,
                         load=loadavg()))
        print(f"{replicas} replica(s): {toks / wall:.1f} tok/s over {a.requests} requests (load {loadavg()})",
              flush=True)
        serve.delete("specdec")
    serve.shutdown()
    ray.shutdown()
    same = sum(x == y for x, y in zip(replies[1], replies[2]))
    ratio = rows[1]["tokens_per_second"] / rows[0]["tokens_per_second"]
    print(f"2 / 1 replicas: {ratio:.2f}x, identical replies {same}/{len(questions)}")
    rec = dict(benchmark="ray_replicas", commit=git_commit(), cpu=cpu_name(), cpus=os.cpu_count(), args=vars(a),
               rows=rows, ratio_2_over_1=ratio, identical_replies=same, requests=len(questions), target_ratio=1.6,
               notes="one torch thread per replica; the machine's 2 cores are shared with other jobs (see load)")
    Path(a.out).write_text(json.dumps(rec, indent=1))


if __name__ == "__main__":
    main()
