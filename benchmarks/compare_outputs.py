"""Compare the tokens every drafter produces at this checkout with those of another commit.

A refactor must not change outputs. This script runs a fixed set of decoding configurations
(every drafter of the project on the bundled SmolLM2-135M-Instruct: chains, spine / dynamic /
planned trees, prompt lookup, suffix, recycling, documents, a callable retriever, MultiDraft
merges and escalation; greedy and seeded rejection sampling (fixed policy) through
``SpeculativeDecoder``, and the ``Engine`` with staggered arrivals, greedy rows beside a
seed-coupled sampled one) once here and once in a temporary worktree of
``--against``, and compares the tokens. The configurations use only the public API, so the
same driver runs on both commits; the other commit runs with this checkout's compiled
extension (the op library is shared, only the Python side is compared).

    python benchmarks/compare_outputs.py --against de65800 --out benchmarks/results/compare_outputs_<date>.json

Exit status 0 when every configuration's tokens are identical.
"""
from __future__ import annotations

import argparse
import datetime
import glob
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

PROMPTS = [
    "Repeat exactly: the quick brown fox jumps over the lazy dog. The quick brown fox jumps over the lazy dog.",
    "Write a short poem about the sea.",
    "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
    "List three facts about the moon, then repeat the first one.",
]
DOCS = ["The moon orbits the earth every 27.3 days. Its surface is covered in craters.",
        "def fibonacci(n):\n    if n < 2:\n        return n\n    return fibonacci(n - 1) + fibonacci(n - 2)\n"]
NEW_TOKENS = 24


def _drafters(specdec, small, tok):
    """name -> zero-argument factory of a fresh drafter (or None for plain decoding)."""
    HF = specdec.HFCausalLM

    def callable_retriever(seq):
        # the continuation of the last 2-gram's previous occurrence in the request's context
        for i in range(len(seq) - 3, 0, -1):
            if seq[i - 1:i + 1] == seq[-2:]:
                return [seq[i + 1:i + 6]]
        return []

    return {
        "plain": lambda: None,
        "lookup": lambda: specdec.PromptLookup(ngram=3, k=10),
        "w8_chain": lambda: specdec.DraftModel(HF(small), k=4),
        "w8_spine_tree": lambda: specdec.DraftModel(HF(small), k=4, top_k=3, node_budget=10),
        "w8_dynamic_tree": lambda: specdec.DraftModel(HF(small), k=4, top_k=3, node_budget=12, tree="dynamic"),
        "w8_planned_tree": lambda: specdec.DraftModel(HF(small), k=4, top_k=3, node_budget=12, tree="planned"),
        "w8_stop_threshold": lambda: specdec.DraftModel(HF(small), k=6, stop_threshold=0.3),
        "suffix": lambda: specdec.SuffixDrafter(),
        "recycling": lambda: specdec.TokenRecycling(),
        "documents": lambda: specdec.DocumentDrafter(DOCS, tokenizer=tok),
        "callable": lambda: specdec.CallableDrafter(callable_retriever, max_nodes=6),
        "multi_merge": lambda: specdec.MultiDraft([specdec.PromptLookup(ngram=3, k=6),
                                                  specdec.DraftModel(HF(small), k=4)]),
        "multi_escalate": lambda: specdec.MultiDraft([specdec.PromptLookup(ngram=3, k=10),
                                                     specdec.DraftModel(HF(small), k=6)], escalate=2.0),
    }


def emit(path: str) -> None:
    """Run every configuration with the specdec importable here and write {config: tokens}."""
    import torch

    import specdec

    torch.manual_seed(0)
    torch.set_num_threads(int(os.environ.get("COMPARE_THREADS", "2")))
    model, tok, small = specdec.load_bundled("smollm2-135m", draft="w8")
    target = specdec.HFCausalLM(model)
    prompts = [tok.encode(p) for p in PROMPTS]
    out = {"specdec_file": os.path.relpath(specdec.__file__, os.path.dirname(os.path.dirname(specdec.__file__)))}
    for name, make in _drafters(specdec, small, tok).items():
        dec = specdec.SpeculativeDecoder(target, make())
        res = dec.generate(prompts[:2], max_new_tokens=NEW_TOKENS)
        out[f"{name}/greedy_b2"] = [list(map(int, t)) for t in res.tokens]
        # rejection-sampled tokens depend on what was drafted, and the goodput policy's depths on measured
        # times: the sampled run uses the fixed policy so that both commits draft the same trees
        fixed = specdec.SpeculativeDecoder(target, make(), policy="fixed")
        res = fixed.generate(prompts[2:], max_new_tokens=NEW_TOKENS, temperature=0.8, top_p=0.95, seed=7)
        out[f"{name}/sampled_b2_seed7"] = [list(map(int, t)) for t in res.tokens]
        eng = specdec.Engine(target, make(), max_batch=3, max_len=512)
        got = {}
        arrivals = list(enumerate(prompts))
        step = 0
        while arrivals or eng.has_unfinished():
            if arrivals and step % 2 == 0:   # a new request every other step
                i, p = arrivals.pop(0)
                params = specdec.RequestParams(max_new_tokens=NEW_TOKENS, temperature=0.7 if i == 3 else 0.0,
                                               seed=11 if i == 3 else None)
                eng.add_request(i, p, params)
            for d in eng.step():
                got.setdefault(d.request_id, []).extend(int(t) for t in d.new_tokens)
            step += 1
        out[f"{name}/engine_staggered"] = [got[i] for i in range(len(prompts))]
        print(f"  {name}", flush=True)
    with open(path, "w") as f:
        json.dump(out, f)


def _git(*args: str, cwd: str = ROOT) -> str:
    return subprocess.check_output(["git", *args], cwd=cwd, text=True).strip()


def _run_emit(tree: str, path: str) -> float:
    env = dict(os.environ, PYTHONPATH=tree)
    t0 = time.time()
    subprocess.check_call([sys.executable, os.path.abspath(__file__), "--emit", path], cwd=tree, env=env)
    return time.time() - t0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--against", help="the commit to compare with (e.g. the one before a refactor)")
    ap.add_argument("--out", help="write the record (JSON) here")
    ap.add_argument("--emit", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.emit:
        emit(args.emit)
        return 0
    if not args.against:
        ap.error("--against REV is required")
    ext = glob.glob(os.path.join(ROOT, "specdec", "_C*.so"))
    if not ext:
        print("compare_outputs: no compiled specdec/_C*.so in this checkout; build it first", file=sys.stderr)
        return 2
    here = _git("rev-parse", "HEAD")
    dirty = bool(_git("status", "--porcelain", "--untracked-files=no"))
    other = _git("rev-parse", args.against)
    tmp = tempfile.mkdtemp(prefix="specdec-compare-")
    wt = os.path.join(tmp, "tree")
    results = {}
    try:
        _git("worktree", "add", "--detach", wt, other)
        shutil.copy(ext[0], os.path.join(wt, "specdec"))
        print(f"{args.against} ({other[:7]}):")
        t_other = _run_emit(wt, os.path.join(tmp, "other.json"))
        print(f"this checkout ({here[:7]}{'-dirty' if dirty else ''}):")
        t_here = _run_emit(ROOT, os.path.join(tmp, "here.json"))
        with open(os.path.join(tmp, "other.json")) as f:
            a = json.load(f)
        with open(os.path.join(tmp, "here.json")) as f:
            b = json.load(f)
    finally:
        subprocess.call(["git", "worktree", "remove", "--force", wt], cwd=ROOT)
        shutil.rmtree(tmp, ignore_errors=True)
    assert a.pop("specdec_file").startswith("specdec") and b.pop("specdec_file").startswith("specdec")
    for key in sorted(set(a) | set(b)):
        results[key] = {"identical": a.get(key) == b.get(key), "tokens": sum(len(t) for t in b.get(key, []))}
    same = all(r["identical"] for r in results.values())
    for key, r in results.items():
        print(f"{'same' if r['identical'] else 'DIFFERENT':9s} {key} ({r['tokens']} tokens)")
    print(f"{sum(r['identical'] for r in results.values())}/{len(results)} configurations identical")
    if args.out:
        record = {"benchmark": "compare_outputs", "date": datetime.date.today().isoformat(),
                  "command": " ".join(["python", "benchmarks/compare_outputs.py", *sys.argv[1:]]),
                  "this_commit": here + ("-dirty" if dirty else ""), "against": other,
                  "new_tokens": NEW_TOKENS, "prompts": PROMPTS, "identical": same,
                  "seconds": {"against": round(t_other, 1), "this": round(t_here, 1)},
                  "load_average": os.getloadavg(), "configurations": results}
        with open(args.out, "w") as f:
            json.dump(record, f, indent=1)
        print("wrote", args.out)
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
