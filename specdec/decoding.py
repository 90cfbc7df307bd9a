"""SpeculativeDecoder: the batched draft -> verify -> accept -> commit loop.

One step for the b active requests (rows 0..b-1 of every cache)::

    draft   = drafter.propose(ctx)                                # TokenTree [b, N] (+ q)
    logits  = target.forward(cache, tree.tokens, tree.depths, tree.attention_mask())   # [b, N, V]
    drafter.observe_verify(tree, logits)                          # drafters that learn from the target
    greedy:   accepted, num, out = ops.greedy_verify(tokens, parents, logits)
    sampling: accepted, num, out = ops.rejection_sample(tokens, parents, warp(logits), q, uniforms)
    cache.commit(accepted, num)                                   # ops.kv_commit
    host    = [num | out].tolist()                                # THE host sync of the step
    drafter.accept(accepted, num, host nums)                      # drafter rollback (kv_commit)
    append out[:num + 1] per request, stop on EOS / max_new_tokens, retire finished rows

Requests are ragged: each accepts its own count. A request whose accepted tokens
contain an EOS is truncated right after the first EOS; one that reaches
max_new_tokens is truncated there. Finished requests leave the batch: the last
active row moves into the hole (its committed K/V and length are copied), so the
others are never disturbed and later steps run on fewer rows.

Lengths: every request must satisfy ``len(prompt) + max_new_tokens <= max_len``
(checked up front, before any state changes, with the offending request named).
The caches get ``max_len + max_nodes`` positions so that the last verification tree
always fits.

The loop itself lives in :class:`specdec.Engine` (continuous batching: requests join and leave
at step boundaries); :meth:`SpeculativeDecoder.generate` adds one static batch of requests with
one setting to its engine and steps it until every request is done -- one code path.
"""
from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from typing import Callable, Dict, Iterable, List, Optional, Sequence, Union

import torch

from specdec._check import as_float, check_stop_ids, is_int
from specdec.drafters.base import Drafter
from specdec.engine import Engine, RequestParams
from specdec.metrics import MemoryProbe, MetricsRecorder, empty_metrics, write_trace
from specdec.sampling import SamplingParams, make_generator, mix_seed
from specdec.scheduler import Policy, calibrate

__all__ = ["SpeculativeDecoder", "GenerateOutput"]


@dataclass
class GenerateOutput:
    """``tokens[i]``: the new tokens of request i (EOS included when hit). ``metrics``: see docs/metrics.md."""

    tokens: List[List[int]]
    metrics: Dict[str, object] = field(default_factory=dict)
    trace: Optional[List[dict]] = None  # per-step records (generate(trace=...)); keys in docs/metrics.md


class SpeculativeDecoder:
    """Speculative decoding of a target LM with a drafter (None: plain decoding, same engine).

    Parameters
    ----------
    target : HFCausalLM (or any object with its protocol: ``vocab_size``, ``device``,
        ``new_cache``, ``forward``, ``prefill``)
    drafter : Drafter or None
        :class:`~specdec.DraftModel`, :class:`~specdec.PromptLookup`, ... None decodes one
        token per target pass through the same loop (the fair baseline).
    max_batch : int
        Most requests per generate call.
    max_len : int
        Most tokens per request, prompt + new tokens.
    policy : str or specdec.scheduler.Policy
        How much to draft each step (:mod:`specdec.scheduler`): "goodput" (default: the depth that
        maximises expected tokens per second, per step and request, with fallback to plain
        decoding), "heuristic" (transformers' +2 / -1 schedule) or "fixed" (the drafter's own k).
    calibrate : bool
        Goodput policy: time target forwards once (cached per model / device / dtype / threads
        in ``$SPECDEC_CACHE``, default ~/.cache/specdec) before the first call instead of
        learning every cost online. Off by default.
    kv_cache : "paged", "dense" or None
        The target's KV layout (:class:`~specdec.Engine`): None = paged where the target supports it.
    """

    def __init__(self, target, drafter: Optional[Drafter] = None, max_batch: int = 8, max_len: int = 2048,
                 policy: Union[str, Policy] = "goodput", calibrate: bool = False,
                 kv_cache: Optional[str] = None) -> None:
        #: the continuous-batching engine that runs every generate call (specdec.engine)
        self.engine = Engine(target, drafter, max_batch=max_batch, max_len=max_len, policy=policy,
                             drafter_errors="raise", kv_cache=kv_cache, _name="SpeculativeDecoder")
        self._calibrate = bool(calibrate)

    # the engine's settings and state, read through (one source of truth)
    target = property(lambda self: self.engine.target)
    max_batch = property(lambda self: self.engine.max_batch)
    max_len = property(lambda self: self.engine.max_len)
    policy = property(lambda self: self.engine.policy)
    device = property(lambda self: self.engine.device)
    vocab_size = property(lambda self: self.engine.vocab_size)
    max_nodes = property(lambda self: self.engine.max_nodes)
    cache = property(lambda self: self.engine.cache, doc="the target's KV cache")
    scheduler = property(lambda self: self.engine.scheduler, doc="the step policy; its cost model persists")
    static_memory_bytes = property(lambda self: self.engine.static_memory_bytes,
                                   doc="weights (target + draft model) + KV caches, for the peak-memory metric")

    @property
    def drafter(self) -> Optional[Drafter]:
        return self.engine.drafter

    @drafter.setter
    def drafter(self, d: Optional[Drafter]) -> None:  # the engine's (tests swap in a misbehaving one)
        self.engine.drafter = d

    def __repr__(self) -> str:
        return (f"SpeculativeDecoder(drafter={self.drafter!r}, max_batch={self.max_batch}, "
                f"max_len={self.max_len}, policy={self.policy!r})")

    # ------------------------------------------------------------------ validation
    def _prompts(self, input_ids) -> List[List[int]]:
        if isinstance(input_ids, torch.Tensor):
            if input_ids.dim() != 2:
                raise ValueError(f"generate: input_ids must be a LongTensor [B, T] or a list of token lists, "
                                 f"got a tensor of shape {tuple(input_ids.shape)}")
            if input_ids.dtype.is_floating_point or input_ids.dtype == torch.bool or input_ids.is_complex():
                raise TypeError(f"generate: input_ids must hold integer token ids, got {input_ids.dtype}")
            prompts = input_ids.tolist()
        elif isinstance(input_ids, (list, tuple)):
            prompts = []
            for i, p in enumerate(input_ids):
                if isinstance(p, torch.Tensor):
                    if p.dim() != 1 or p.dtype.is_floating_point:
                        raise TypeError(f"generate: request {i} must be a 1-D integer tensor or a list of ints, "
                                        f"got a {p.dtype} tensor of shape {tuple(p.shape)}")
                    p = p.tolist()
                if is_int(p):
                    raise TypeError("generate: input_ids must be a list of token lists (a batch); "
                                    "wrap a single prompt as [[t0, t1, ...]]")
                if not isinstance(p, (list, tuple)):
                    raise TypeError(f"generate: request {i} must be a list of token ids, got {type(p).__name__}")
                for t in p:
                    if not is_int(t):
                        raise TypeError(f"generate: request {i} holds a non-integer token {t!r}")
                prompts.append(list(p))
        else:
            raise TypeError(f"generate: input_ids must be a LongTensor [B, T] or a list of token lists, "
                            f"got {type(input_ids).__name__}")
        if not prompts:
            raise ValueError("generate: empty batch (no requests)")
        if len(prompts) > self.max_batch:
            raise ValueError(f"generate: batch of {len(prompts)} requests exceeds max_batch={self.max_batch}")
        for i, p in enumerate(prompts):
            if not p:
                raise ValueError(f"generate: request {i} has an empty prompt (at least one token is needed)")
            lo, hi = min(p), max(p)
            if lo < 0 or hi >= self.vocab_size:
                bad = lo if lo < 0 else hi
                raise ValueError(f"generate: request {i} holds token id {bad}, outside the vocabulary "
                                 f"[0, {self.vocab_size})")
        return prompts

    # ------------------------------------------------------------------ generate
    def generate(self, input_ids: Union[torch.Tensor, Sequence[Sequence[int]]], max_new_tokens: int = 128,
                 temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0,
                 eos_token_id: Union[int, Iterable[int], None] = None, seed: Optional[int] = None,
                 callback: Optional[Callable[[int, List[int]], None]] = None,
                 trace: Union[bool, str, "os.PathLike"] = False) -> GenerateOutput:
        """Generate up to ``max_new_tokens`` new tokens for each request.

        ``temperature == 0`` is greedy (output == the target's own greedy decoding);
        otherwise tokens follow the target distribution warped by temperature, top-k
        (0 = off) and top-p (1 = off) exactly as plain sampling would. ``seed`` makes a
        call reproducible (same inputs, same batch, same decoder -> same tokens).
        ``callback(request_index, new_tokens)`` is called as tokens are accepted (streaming).
        ``trace``: True returns the per-step trace in ``GenerateOutput.trace``; a path also
        writes it there as JSON lines (keys: docs/metrics.md).
        """
        if not is_int(max_new_tokens):
            raise TypeError(f"generate: max_new_tokens must be an int, got {type(max_new_tokens).__name__}")
        if max_new_tokens < 0:
            raise ValueError(f"generate: max_new_tokens must be >= 0, got {max_new_tokens}")
        if seed is not None and not is_int(seed):
            raise TypeError(f"generate: seed must be an int or None, got {type(seed).__name__}")
        params = SamplingParams(as_float(temperature), top_k, as_float(top_p))
        eos = check_stop_ids("generate", "eos_token_id", eos_token_id)
        prompts = self._prompts(input_ids)
        too_long = [(i, len(p)) for i, p in enumerate(prompts) if len(p) + max_new_tokens > self.max_len]
        if too_long:
            i, n = too_long[0]
            raise ValueError(f"generate: request {i} has a prompt of {n} tokens; with max_new_tokens="
                             f"{max_new_tokens} it needs {n + max_new_tokens} > max_len={self.max_len} positions"
                             + (f" ({len(too_long)} requests too long)" if len(too_long) > 1 else ""))
        B = len(prompts)
        if max_new_tokens == 0:
            return GenerateOutput([[] for _ in range(B)], empty_metrics(B), [] if trace else None)
        if self._calibrate and self.drafter is not None:
            self._calibrate = False
            nodes = sorted({1, 2, 4, self.max_nodes} | {n for n in (8, 12, 16) if n < self.max_nodes})
            calibrate(self.target, self.cache, self.scheduler.cost, sorted({1, self.max_batch}), nodes)
        out = self._run(prompts, max_new_tokens, params, eos, seed, callback, bool(trace))
        if trace and not isinstance(trace, bool):
            write_trace(out.trace, trace)
        return out

    def _run(self, prompts: List[List[int]], max_new: int, params: SamplingParams, eos: frozenset,
             seed: Optional[int], callback, trace: bool) -> GenerateOutput:
        """One static batch through the engine: add every request, step until all are done."""
        eng = self.engine
        if eng.has_unfinished():
            raise RuntimeError("generate: the decoder's engine holds requests (Engine.step them to completion or "
                               "abort them first)")
        B = len(prompts)
        dev = self.device
        rec = MetricsRecorder(B, dev)
        self.scheduler.begin(B, trace)
        mem = MemoryProbe(dev, self.static_memory_bytes)
        rp = RequestParams(max_new_tokens=max_new, temperature=params.temperature, top_k=params.top_k,
                           top_p=params.top_p, stop_token_ids=tuple(sorted(eos)))
        new: List[List[int]] = [[] for _ in range(B)]
        finish = [""] * B
        t_first = None
        t_start = time.perf_counter()
        with eng.closed_batch(rec, make_generator(None if seed is None else seed + 0x5EED, dev)):
            for i, p in enumerate(prompts):
                # request i of a seeded call draws from the call's seed mixed with i
                gen = None if params.greedy else make_generator(None if seed is None else mix_seed(seed, i), "cpu")
                eng.add_request(i, p, rp, generator=gen)
            while eng.has_unfinished():
                deltas = eng.step()
                if t_first is None:
                    t_first = time.perf_counter()
                for d in deltas:
                    i = d.request_id
                    new[i].extend(d.new_tokens)
                    if d.finished:
                        finish[i] = "eos" if d.finish_reason == "stop" else d.finish_reason
                    if callback is not None and d.new_tokens:
                        callback(i, list(d.new_tokens))
        t_end = time.perf_counter()
        metrics = rec.summary(new, finish, t_start, t_first if t_first is not None else t_end, t_end, mem.peak(),
                              mem.static)
        metrics.update(self.scheduler.summary())
        if self.drafter is None:
            metrics["policy"] = "none"
        return GenerateOutput(new, metrics, self.scheduler.trace)

