"""Training data for a feature head: the target's own generations (self-distillation) and its hidden states.

The prompt corpus is offline text that ships with Python itself: the docstrings of standard-library
modules and their public functions and classes (:func:`stdlib_prompts`), turned into requests by a
few instruction templates. None of it is a benchmark prompt. The target answers them (greedy, the
Engine in batches) and one prefill per sequence records the features the head reads (the same
:meth:`~specdec.HFCausalLM.capture_hidden` states it reads when drafting).
"""
from __future__ import annotations

import importlib
import inspect
import random
from typing import Callable, Dict, List, Optional, Sequence

import torch

__all__ = ["stdlib_prompts", "generate_sequences", "generate_with_features", "sequence_features", "frequent_tokens"]

STDLIB_MODULES = (
    "abc", "argparse", "ast", "asyncio", "base64", "bisect", "calendar", "collections", "contextlib", "copy",
    "csv", "dataclasses", "datetime", "decimal", "difflib", "email.message", "enum", "fnmatch", "fractions",
    "functools", "glob", "gzip", "hashlib", "heapq", "html", "http.client", "inspect", "io", "ipaddress",
    "itertools", "json", "logging", "math", "mimetypes", "operator", "os", "os.path", "pathlib", "pickle",
    "pprint", "queue", "random", "re", "sched", "secrets", "shlex", "shutil", "socket", "sqlite3", "statistics",
    "string", "struct", "subprocess", "tempfile", "textwrap", "threading", "time", "timeit", "tokenize",
    "traceback", "typing", "unittest", "urllib.parse", "uuid", "warnings", "weakref", "xml.etree.ElementTree",
    "zipfile", "zlib",
)

TEMPLATES = (
    "Explain the following in simple terms:\n\n{doc}",
    "Summarize this documentation in a few sentences:\n\n{doc}",
    "Write a short example that shows how to use {name} in Python. This is its documentation:\n\n{doc}",
    "What is {name} used for? Answer in a short paragraph.",
    "Write a short paragraph for a beginner about {name}.",
    "Rewrite this text so that it is easier to read:\n\n{doc}",
)


def _docs(modules: Sequence[str], max_chars: int = 900) -> List[tuple]:
    """(qualified name, first paragraph of its docstring) for each module and its public callables."""
    out = []
    for mod_name in modules:
        try:
            mod = importlib.import_module(mod_name)
        except Exception:  # noqa: BLE001 - a module missing from this Python build is skipped
            continue
        items = [(mod_name, mod)] + [(f"{mod_name}.{n}", getattr(mod, n, None)) for n in sorted(dir(mod))
                                     if not n.startswith("_")]
        for name, obj in items:
            if obj is None or (obj is not mod and getattr(obj, "__module__", None) not in (mod_name, mod.__name__)):
                continue
            doc = inspect.getdoc(obj) or ""
            para = doc.strip().split("\n\n")[0].strip()
            if 60 <= len(para) <= max_chars:
                out.append((name, para))
    return out


def stdlib_prompts(n: int, seed: int = 0, modules: Sequence[str] = STDLIB_MODULES, max_chars: int = 900
                   ) -> List[str]:
    """``n`` instruction prompts built from standard-library docstrings (first paragraphs of 60 to
    ``max_chars`` characters; seeded choice of docs and templates)."""
    docs = _docs(modules, max_chars)
    if not docs:
        raise RuntimeError("stdlib_prompts: no docstrings found (Python without its docstrings, -OO?)")
    rng = random.Random(seed)
    rng.shuffle(docs)
    return [rng.choice(TEMPLATES).format(name=name, doc=doc) for name, doc in (docs[i % len(docs)] for i in range(n))]


def generate_sequences(target, prompts: Sequence[Sequence[int]], max_new_tokens: int, batch: int = 8,
                       eos_token_id=None, progress: Optional[Callable[[int], None]] = None) -> List[List[int]]:
    """The target's greedy answers to token prompts, in batches through the Engine (plain decoding):
    prompt + answer per request."""
    from specdec.decoding import SpeculativeDecoder

    longest = max(len(p) for p in prompts) + max_new_tokens
    dec = SpeculativeDecoder(target, None, max_batch=batch, max_len=longest, kv_cache="dense")  # rows kept after
    out = []
    for i in range(0, len(prompts), batch):
        chunk = [list(p) for p in prompts[i:i + batch]]
        got = dec.generate(chunk, max_new_tokens=max_new_tokens, eos_token_id=eos_token_id)
        out.extend(p + t for p, t in zip(chunk, got.tokens))
        if progress is not None:
            progress(len(chunk))
    return out


def generate_with_features(target, prompts: Sequence[Sequence[int]], max_new_tokens: int, batch: int = 8,
                           eos_token_id=None, layers: Sequence[int] = (-1,), dtype: torch.dtype = torch.float16,
                           progress: Optional[Callable[[int], None]] = None):
    """The target's greedy answers and its features at every position, at no extra pass: with
    :meth:`~specdec.HFCausalLM.capture_hidden` on, the decoding cache keeps the states of every
    token the target scored. Each batch decodes ``max_new_tokens`` for every request (no early stop,
    so no row moves), then each sequence is cut after its first ``eos_token_id`` in the answer (the
    last generated token, never scored, is dropped). Returns (sequences, features [T, F] each)."""
    from specdec.decoding import SpeculativeDecoder

    target.capture_hidden(layers)
    longest = max(len(p) for p in prompts) + max_new_tokens
    dec = SpeculativeDecoder(target, None, max_batch=batch, max_len=longest, kv_cache="dense")  # rows kept after
    seqs, feats = [], []
    for i in range(0, len(prompts), batch):
        chunk = [list(p) for p in prompts[i:i + batch]]
        got = dec.generate(chunk, max_new_tokens=max_new_tokens)
        hidden = dec.cache.features()
        for r, (p, t) in enumerate(zip(chunk, got.tokens)):
            cut = len(p) + len(t) - 1
            if eos_token_id is not None and eos_token_id in t:
                cut = min(cut, len(p) + t.index(eos_token_id) + 1)
            seqs.append((p + t)[:cut])
            feats.append(hidden[r, :cut].to(dtype).clone())
        if progress is not None:
            progress(len(chunk))
    return seqs, feats


def sequence_features(target, sequences: Sequence[Sequence[int]], layers: Sequence[int] = (-1,),
                      dtype: torch.dtype = torch.float16,
                      progress: Optional[Callable[[int], None]] = None) -> List[torch.Tensor]:
    """The target's features (capture spec ``layers``) at every position of each sequence: [T, F] each,
    stored in ``dtype`` (one prefill per sequence)."""
    target.capture_hidden(layers)
    longest = max(len(s) for s in sequences)
    cache = target.new_cache(1, longest)
    feats = []
    for s in sequences:
        target.prefill(cache, [list(s)])
        feats.append(cache.features()[0, :len(s)].to(dtype).clone())
        if progress is not None:
            progress(1)
    return feats


def frequent_tokens(sequences: Sequence[Sequence[int]], n: int, vocab_size: int,
                    always: Sequence[int] = ()) -> torch.Tensor:
    """The ``n`` most frequent tokens of the sequences (ties: lower id first), ``always`` included; sorted ids."""
    counts: Dict[int, int] = {}
    for s in sequences:
        for t in s:
            counts[t] = counts.get(t, 0) + 1
    keep = list(dict.fromkeys(t for t in always if 0 <= t < vocab_size))
    seen = set(keep)
    ranked = [t for t, _ in sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))]
    for t in ranked + list(range(vocab_size)):  # a small corpus: filled with the lowest unused ids
        if len(keep) >= n:
            break
        if t not in seen:
            keep.append(t)
            seen.add(t)
    return torch.tensor(sorted(keep), dtype=torch.int64)
