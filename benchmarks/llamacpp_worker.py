"""llama.cpp (llama-cpp-python) as a subprocess of benchmarks/bench_precision.py: the anchor.

Runs in its own interpreter (a venv with llama-cpp-python built from source; no torch).
Loads the bundled GGUF as it ships (Q4_1) and as float32 (converted once with llama.cpp's own
quantizer, ftype ALL_F32: the dequantized weights specdec's fp32 target holds), each plain and
with llama.cpp's prompt lookup (LlamaPromptLookupDecoding), then answers JSON lines on stdin:

    {"config": "llama.cpp q4_1 plain", "ids": [...], "max_tokens": 48, "eos": 2}
 -> {"tokens": [...], "seconds": 0.41}

Greedy (top_k 1, temperature 0, no repeat penalty); the context is reset before each request
(no prefix reuse across requests); seconds = the generation call alone (prefill included).
"""
from __future__ import annotations

import argparse
import ctypes
import json
import os
import sys
import time


def f32_copy(src: str, dst: str) -> str:
    import llama_cpp

    if not os.path.exists(dst):
        params = llama_cpp.llama_model_quantize_default_params()
        params.ftype = llama_cpp.LLAMA_FTYPE_ALL_F32
        params.allow_requantize = True
        tmp = dst + ".tmp"
        rc = llama_cpp.llama_model_quantize(src.encode(), tmp.encode(), ctypes.byref(params))
        if rc != 0:
            raise RuntimeError(f"llama_model_quantize to F32 failed with {rc}")
        os.replace(tmp, dst)
    return dst


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--gguf", required=True)
    ap.add_argument("--f32-gguf", required=True, help="where the float32 copy is (or is written once)")
    ap.add_argument("--threads", type=int, required=True)
    ap.add_argument("--lookup-k", type=int, default=10)
    a = ap.parse_args()
    from llama_cpp import Llama
    from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

    paths = {"q4_1": a.gguf, "fp32": f32_copy(a.gguf, a.f32_gguf)}
    models = {}
    for prec, path in paths.items():
        for mode in ("plain", "lookup"):
            draft = LlamaPromptLookupDecoding(num_pred_tokens=a.lookup_k) if mode == "lookup" else None
            models[f"llama.cpp {prec} {mode}"] = Llama(model_path=path, n_ctx=1024, n_threads=a.threads,
                                                       n_threads_batch=a.threads, n_batch=512, draft_model=draft,
                                                       verbose=False)
    import llama_cpp

    print(json.dumps({"ready": sorted(models), "version": getattr(llama_cpp, "__version__", "?")}), flush=True)
    for line in sys.stdin:
        req = json.loads(line)
        llm = models[req["config"]]
        llm.reset()
        out = []
        t0 = time.perf_counter()
        for t in llm.generate(req["ids"], top_k=1, top_p=1.0, min_p=0.0, temp=0.0, repeat_penalty=1.0, reset=True):
            if t == req.get("eos"):
                break
            out.append(int(t))
            if len(out) >= req["max_tokens"]:
                break
        dt = time.perf_counter() - t0
        print(json.dumps({"tokens": out, "seconds": dt}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
