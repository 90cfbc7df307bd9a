"""Quality of quantized activations: perplexity on offline text and greedy agreement (CPU).

    python benchmarks/quality_q8act.py [--tokens 4096] [--window 512] [--new 32] [--threads 2]

The bundled SmolLM2 at q4_1 (the GGUF's own blocks) with float activations vs the same weights with
q8 activations (qlinear act="q8"); q8_0 weights the same way. Text: the docstrings of a fixed list of
Python standard-library modules and their public members (offline, deterministic), tokenized and cut
into --window-token windows (no overlap; the first token of each window is not scored) up to --tokens
tokens. Perplexity = exp(mean negative log-likelihood) from the models' own forward (transformers
modules, the specdec qlinear kernels inside). Greedy agreement: --new greedy tokens for each of the
benchmark prompts (tests/test_quantized_models.py's 12 texts) with both models: identical sequences and
the mean length of the common prefix. Target: the q8-activation perplexity within 1 % of the float one.
Writes benchmarks/results/q8act_quality_<date>.json.
"""
from __future__ import annotations

import argparse
import datetime as _dt
import importlib
import inspect
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

MODULES = ["json", "collections", "functools", "itertools", "pathlib", "argparse", "textwrap", "string", "random",
           "statistics", "heapq", "bisect", "fractions", "decimal", "datetime", "csv", "shutil", "subprocess",
           "threading", "queue", "contextlib", "dataclasses", "enum", "typing", "logging", "re", "difflib", "email"]
TEXTS = [
    "The capital of France is", "def fibonacci(n):", "Once upon a time, in a small village,",
    "Question: What is 12 times 7?\nAnswer:", "Repeat after me: the cat sat on the mat. The cat sat",
    "SELECT name, age FROM users WHERE", "for i in range(10):\n    print(", "The speed of light is approximately",
    "Summarize: The meeting was moved from Monday to Tuesday because the room was booked. Summary: The meeting",
    "Translate to French: Good morning, how are you?", "List three fruits: apple,", "The mitochondria is",
]


def stdlib_text() -> str:
    parts = []
    for name in MODULES:
        mod = importlib.import_module(name)
        if mod.__doc__:
            parts.append(inspect.cleandoc(mod.__doc__))
        for attr in sorted(getattr(mod, "__all__", None) or [n for n in dir(mod) if not n.startswith("_")]):
            obj = getattr(mod, attr, None)
            if (inspect.isfunction(obj) or inspect.isclass(obj)) and obj.__doc__:
                parts.append(inspect.cleandoc(obj.__doc__))
    return "\n\n".join(parts)


@torch.no_grad()
def perplexity(model, ids: torch.Tensor, window: int) -> float:
    nll, count = 0.0, 0
    for s in range(0, ids.numel() - 1, window):
        chunk = ids[s:s + window][None]
        if chunk.shape[1] < 2:
            break
        logp = torch.log_softmax(model(chunk).logits[0, :-1].double(), -1)
        nll -= logp.gather(1, chunk[0, 1:, None]).sum().item()
        count += chunk.shape[1] - 1
    return math.exp(nll / count)


def greedy(lm, tok, prompts, new):
    import specdec

    dec = specdec.SpeculativeDecoder(lm, None, max_batch=4, max_len=256)
    out = []
    for i in range(0, len(prompts), 4):
        out += dec.generate(prompts[i:i + 4], max_new_tokens=new, eos_token_id=tok.eos_token_id).tokens
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--window", type=int, default=512)
    ap.add_argument("--new", type=int, default=32)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    import specdec
    from specdec.models import load_bundled
    from specdec.models.quant import set_activation_quant

    text = stdlib_text()
    results = {}
    tok = None
    prompts = None
    for prec in ("q4_1", "q8_0"):
        model, tok = load_bundled("smollm2-135m", precision=prec)
        if prompts is None:
            ids = torch.tensor(tok(text)["input_ids"][:a.tokens])
            prompts = [tok(t)["input_ids"] for t in TEXTS]
        row = {}
        gen = {}
        for act in (None, "q8"):
            set_activation_quant(model, act)
            row[f"ppl act={act}"] = round(perplexity(model, ids, a.window), 4)
            gen[act] = greedy(specdec.HFCausalLM(model), tok, prompts, a.new)
            print(prec, act, row, flush=True)
        ratio = row["ppl act=q8"] / row["ppl act=None"]
        common = []
        for x, y in zip(gen[None], gen["q8"]):
            k = 0
            while k < min(len(x), len(y)) and x[k] == y[k]:
                k += 1
            common.append(k)
        row.update({"ppl_ratio_q8_over_float": round(ratio, 5), "within_1_percent": abs(ratio - 1) <= 0.01,
                    "greedy_identical_sequences": sum(x == y for x, y in zip(gen[None], gen["q8"])),
                    "greedy_prompts": len(prompts), "greedy_mean_common_prefix": round(sum(common) / len(common), 2),
                    "greedy_common_prefix_per_prompt": common})
        results[prec] = row
        del model
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                            cwd=ROOT).stdout.strip()
    res = {"date": _dt.date.today().isoformat(), "commit": commit, "threads": torch.get_num_threads(),
           "loadavg": os.getloadavg(), "text": f"docstrings of {len(MODULES)} stdlib modules, Python "
           f"{sys.version.split()[0]}", "tokens": int(ids.numel()), "window": a.window, "new": a.new,
           "results": results}
    out = Path(a.out) if a.out else ROOT / "benchmarks" / "results" / f"q8act_quality_{res['date']}.json"
    out.write_text(json.dumps(res, indent=1))
    print(json.dumps(res, indent=1))
    print("wrote", out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
