"""CPU vs CUDA agreement sweep of rejection_sample / greedy_verify at scale (benchmark profile).

    python benchmarks/sweep_sampling.py                       # 100000 requests, V = 128256, N = 16
    python benchmarks/sweep_sampling.py --requests 2000 --out benchmarks/results/sweep.json

Bushy random trees (with and without draft rows, drafted tokens drawn from q or from the
parent's target row), realistic peaked rows with zeroed tails; every request's integer
outputs must be identical on both backends (the contract: decisions identical by
construction). Prints and saves the mismatch counts; exit status 1 on any mismatch.
Needs a CUDA device.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from specdec import ops  # noqa: E402


def bushy_parents(B: int, N: int, g: torch.Generator) -> torch.Tensor:
    par = torch.full((B, N), -1, dtype=torch.int32)
    for i in range(1, N):  # each node picks a parent among the last few: wide, moderately deep
        lo = max(0, i - 4)
        par[:, i] = torch.randint(lo, i, (B,), generator=g, dtype=torch.int32)
    pad = torch.rand(B, N, generator=g) < 0.1
    pad[:, 0] = False
    # padding must not be anyone's parent: pad only leaves
    is_parent = torch.zeros(B, N, dtype=torch.bool)
    for i in range(1, N):
        is_parent[torch.arange(B), par[:, i].long()] = True
    pad &= ~is_parent
    par[pad] = -1
    return par


def batch(B: int, N: int, V: int, with_q: bool, g: torch.Generator):
    z = torch.randn(B, N, V, generator=g) * 4
    p = torch.softmax(z, -1)
    p = p * (torch.rand(B, N, V, generator=g) > 0.3)
    parents = bushy_parents(B, N, g)
    src = torch.gather(p, 1, parents.clamp(min=0).long()[:, :, None].expand(B, N, V))
    q = None
    if with_q:
        q = torch.softmax(torch.gather(z, 1, parents.clamp(min=0).long()[:, :, None].expand(B, N, V))
                          + torch.randn(B, N, V, generator=g), -1)
        src = q
    tokens = torch.multinomial(src.reshape(B * N, V) + 1e-30, 1, generator=g).reshape(B, N)
    tokens[parents < 0] = -1
    tokens[:, 0] = 0
    u = torch.rand(B, N, generator=g, dtype=torch.float64)
    u[torch.rand(B, N, generator=g) < 0.02] = 1.0
    return tokens, parents, p, q, u, z


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=100_000)
    ap.add_argument("--vocab", type=int, default=128256)
    ap.add_argument("--nodes", type=int, default=16)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    if not torch.cuda.is_available():
        print("sweep_sampling: needs a CUDA device")
        return 2
    g = torch.Generator().manual_seed(a.seed)
    counts = {"rejection_q": [0, 0], "rejection_q_none": [0, 0], "greedy": [0, 0]}  # [requests, mismatches]
    t0 = time.time()
    done = 0
    while done < a.requests:
        B = min(a.batch, a.requests - done)
        for with_q in (True, False):
            tokens, parents, p, q, u, z = batch(B, a.nodes, a.vocab, with_q, g)
            cpu = ops.rejection_sample(tokens, parents, p, q, u)
            gpu = ops.rejection_sample(tokens.cuda(), parents.cuda(), p.cuda(), None if q is None else q.cuda(),
                                       u.cuda())
            bad = torch.zeros(B, dtype=torch.bool)
            for x, y in zip(cpu, gpu):
                d = x != y.cpu()
                bad |= d.reshape(B, -1).any(1)
            key = "rejection_q" if with_q else "rejection_q_none"
            counts[key][0] += B
            counts[key][1] += int(bad.sum())
            if with_q:
                logits = z.to(torch.bfloat16)
                cpu = ops.greedy_verify(tokens, parents, logits)
                gpu = ops.greedy_verify(tokens.cuda(), parents.cuda(), logits.cuda())
                bad = torch.zeros(B, dtype=torch.bool)
                for x, y in zip(cpu, gpu):
                    bad |= (x != y.cpu()).reshape(B, -1).any(1)
                counts["greedy"][0] += B
                counts["greedy"][1] += int(bad.sum())
        done += B
        if done % (a.batch * 50) == 0:
            print(f"  {done} requests, {time.time() - t0:.0f} s, mismatches {({k: v[1] for k, v in counts.items()})}",
                  flush=True)
    res = {"requests": a.requests, "vocab": a.vocab, "nodes": a.nodes, "seconds": round(time.time() - t0, 1),
           "device": torch.cuda.get_device_name(0),
           "results": {k: {"requests": v[0], "mismatches": v[1]} for k, v in counts.items()}}
    print(json.dumps(res, indent=1))
    if a.out:
        with open(a.out, "w") as f:
            json.dump(res, f, indent=1)
    return 1 if any(v[1] for v in counts.values()) else 0


if __name__ == "__main__":
    sys.exit(main())
