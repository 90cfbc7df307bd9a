"""Agreement of specdec.compat's adapters with independent readings of each stack's semantics, on
>= 10,000 random requests per form (the issue's target: every integer output equal).

    python benchmarks/compat_agreement.py                 # 10,000 requests per form
    python benchmarks/compat_agreement.py --cases 2000

The references are the pure-Python ones of the tests (tests/test_compat_*.py, written from the
stacks' documentation and kernels, not from the adapters). Forms and what is compared:

* flashinfer.chain_speculative_sampling (uniform_samples form): output_token_ids, accepted and
  emitted counts, exactly;
* vllm.rejection_sample (draft_probs given / None, greedy and sampled rows mixed): every greedy
  token and every accept / reject decision exactly; a recovered token only for carrying residual
  mass (its draw is random in vLLM);
* vllm.tree_rejection_sample (greedy rows): tokens, accepted path, counts, exactly;
* sglang.verify_tree_greedy; sglang.tree_speculative_sampling_target_only at threshold 1 and at
  lossy thresholds (0.5, 0.6): accept_index, accept_token_num and predicts, exactly.

Writes benchmarks/results/compat_agreement_<date>.json (or --out).
"""
from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import random
import subprocess
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

import test_compat_chains as tc  # noqa: E402
import test_compat_sglang as ts  # noqa: E402
import test_compat_vllm_tree as tv  # noqa: E402

from specdec.compat import flashinfer as fi  # noqa: E402
from specdec.compat import sglang as sg  # noqa: E402
from specdec.compat import vllm  # noqa: E402


def flashinfer_uniform(cases, g):
    done = bad = 0
    shapes = [(1, 3), (3, 5), (4, 11), (6, 4), (2, 32), (8, 7)]
    i = 0
    while done < cases:
        N, V = shapes[i % len(shapes)]
        q, d, p, u = tc.fi_case(50, N, V, g)
        got = fi.chain_speculative_sampling_uniform(q, d, u, p)
        want = tc.fi_reference_uniform(q, d, u, p)
        rows_ok = (got[0] == want[0]).all(1) & (got[1] == want[1]) & (got[2] == want[2])
        bad += int((~rows_ok).sum())
        done += 50
        i += 1
    return done, bad


def vllm_chains(cases, g, with_draft):
    done = bad = 0
    i = 0
    while done < cases:
        S, V = [(1, 3), (3, 5), (4, 11), (6, 4), (2, 32)][i % 5]
        B = 50
        # every third batch all greedy; those and every fourth batch sometimes with equal counts (the CPU's
        # one-call path for all-greedy batches, taken without explicit uniforms, which greedy rows do not read)
        all_greedy = i % 3 == 2
        d, n, cu, q, p, bonus, temp, u = tc.vllm_case(B, S, V, g, with_draft, greedy_frac=[0.0, 0.5, 1.0][i % 3],
                                                      uniform=i % 4 == 3 or i % 6 == 2)
        got = vllm.rejection_sample(d, n, max(n), cu, q, p, bonus, temp,
                                    uniforms=None if all_greedy else u).tolist()
        want = tc.vllm_reference(d, n, q, p, bonus, temp, u)
        start = 0
        for b in range(B):
            ok = True
            for j, (x, y) in enumerate(zip(want[b], got[b])):
                if x is None:
                    t = start + j
                    ok &= y != -1 and (float(p[t, y]) > 0 and y != int(d[t]) if q is None
                                       else float(p[t, y]) > float(q[t, y]))
                else:
                    ok &= x == y
            bad += not ok
            start += n[b]
        done += B
        i += 1
    return done, bad


def vllm_tree_greedy(cases, g):
    done = bad = 0
    i = 0
    while done < cases:
        S, V = [(1, 3), (4, 5), (7, 4), (3, 20)][i % 4]
        B = 50
        d, par, n, cu, p = tv.random_trees(B, S, V, g)
        res = vllm.tree_rejection_sample(d, par, n, S, cu, None, p, torch.zeros(B))
        outs, paths = tv.greedy_reference(d, par, n, p)
        for b in range(B):
            W = S + 1
            ok = (res.output_token_ids[b].tolist() == outs[b] + [-1] * (W - len(outs[b]))
                  and res.accepted[b].tolist() == paths[b] + [-1] * (W - len(paths[b]))
                  and int(res.num_accepted[b]) == len(paths[b]) - 1)
            bad += not ok
        done += B
        i += 1
    return done, bad


def _rows_equal(B, N, got, want):
    (gp, gai, gan), (wp, wai, wan) = got, want
    gp = gp.tolist()
    return sum(not (gai[b].tolist() == wai[b] and int(gan[b]) == wan[b]
                    and gp[b * N:(b + 1) * N] == wp[b * N:(b + 1) * N]) for b in range(B))


def sglang_forms(cases, rng, g, form):
    done = bad = 0
    while done < cases:
        B, N, V = rng.randint(4, 12), rng.randint(1, 9), rng.choice([10, 17, 40])
        S = rng.randint(1, N + 1)
        kind = rng.choice(["chain", "bushy", "mixed"])
        if form == "greedy":
            cand, ri, nt, ns, tp = ts.random_batch(rng, B, N, V, kind)
            bad += _rows_equal(B, N, ts.run_greedy(cand, ri, nt, ns, tp, S), ts.ref_greedy(cand, ri, nt, ns, tp, S))
        elif form == "sampling":
            case = ts.sample_case(rng, g, B, N, V, kind)
            bad += _rows_equal(B, N, ts.run_sampling(*case, S), ts.ref_sampling(*case, S))
        else:
            t_single, t_acc = 0.5, 0.6
            cand, ri, nt, ns, _ = ts.random_batch(rng, B, N, V, kind)
            probs = torch.softmax(torch.randn(B, N, V, generator=g) * 2, -1)
            us, uf = torch.rand(B, N, generator=g), torch.rand(B, generator=g)
            predicts = torch.full((B * N,), -7, dtype=torch.int32)
            ai = torch.full((B, S), 99, dtype=torch.int32)
            an = torch.full((B,), 99, dtype=torch.int32)
            sg.tree_speculative_sampling_target_only(predicts, ai, an, cand, ri, nt, ns, us, uf, probs, None,
                                                     threshold_single=t_single, threshold_acc=t_acc)
            bad += _rows_equal(B, N, (predicts, ai, an),
                               ts.ref_lossy(cand, ri, nt, ns, us, uf, probs, S, t_single, t_acc))
        done += B
    return done, bad


def git_commit() -> str:
    try:
        return subprocess.check_output(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, text=True).strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cases", type=int, default=10000, help="random requests per form")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    now = _dt.datetime.now()
    g = torch.Generator().manual_seed(2026)
    rng = random.Random(2026)
    forms = {
        "flashinfer.chain_speculative_sampling_uniform": lambda: flashinfer_uniform(args.cases, g),
        "vllm.rejection_sample (draft_probs given)": lambda: vllm_chains(args.cases, g, True),
        "vllm.rejection_sample (draft_probs None)": lambda: vllm_chains(args.cases, g, False),
        "vllm.tree_rejection_sample (greedy)": lambda: vllm_tree_greedy(args.cases, g),
        "sglang.verify_tree_greedy": lambda: sglang_forms(args.cases, rng, g, "greedy"),
        "sglang.tree_speculative_sampling_target_only (threshold 1)": lambda: sglang_forms(args.cases, rng, g,
                                                                                           "sampling"),
        "sglang.tree_speculative_sampling_target_only (thresholds 0.5 / 0.6)": lambda: sglang_forms(
            args.cases, rng, g, "lossy"),
    }
    rows = []
    for name, run in forms.items():
        t = time.perf_counter()
        n, bad = run()
        rows.append(dict(form=name, requests=n, mismatches=bad, seconds=round(time.perf_counter() - t, 1)))
        print(f"{name:70s} {n:6d} requests  {bad} mismatches", flush=True)
    meta = dict(date=now.isoformat(timespec="seconds"), git_commit=git_commit(), torch=torch.__version__,
                cases_per_form=args.cases, loadavg=os.getloadavg())
    out = args.out or ROOT / "benchmarks" / "results" / f"compat_agreement_{now.strftime('%Y-%m-%d')}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(dict(meta=meta, rows=rows), indent=2))
    print(f"wrote {out}")
    return 0 if all(r["mismatches"] == 0 for r in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
