"""SpeculativeDecoder: the batched draft -> verify -> accept -> commit loop.

One step for the b active requests (rows 0..b-1 of every cache)::

    draft   = drafter.propose(ctx)                                # TokenTree [b, N] (+ q)
    logits  = target.forward(cache, tree.tokens, tree.depths, tree.attention_mask())   # [b, N, V]
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
"""
from __future__ import annotations

import math
import os
import time
from dataclasses import dataclass, field
from typing import Callable, Dict, Iterable, List, Optional, Sequence, Tuple, Union

import torch

from specdec import ops
from specdec.drafters.base import Draft, Drafter, StepContext, move_cache_rows
from specdec.sampling import SamplingParams, draw_uniforms, make_generator, warp_
from specdec.tree import TokenTree

__all__ = ["SpeculativeDecoder", "GenerateOutput"]

_POLICIES = ("fixed", "heuristic", "goodput")


@dataclass
class GenerateOutput:
    """``tokens[i]``: the new tokens of request i (EOS included when hit). ``metrics``: see DESIGN.md."""

    tokens: List[List[int]]
    metrics: Dict[str, object] = field(default_factory=dict)


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
    policy : str
        "fixed": the drafter's own k every step. ("heuristic" and "goodput" belong to the
        scheduler, which is not implemented yet.)
    """

    def __init__(self, target, drafter: Optional[Drafter] = None, max_batch: int = 8, max_len: int = 2048,
                 policy: str = "fixed") -> None:
        for name, v in (("max_batch", max_batch), ("max_len", max_len)):
            if isinstance(v, bool) or not isinstance(v, int):
                raise TypeError(f"SpeculativeDecoder: {name} must be an int, got {type(v).__name__}")
            if v < 1:
                raise ValueError(f"SpeculativeDecoder: {name} must be >= 1, got {v}")
        if policy not in _POLICIES:
            raise ValueError(f"SpeculativeDecoder: policy must be one of {_POLICIES}, got {policy!r}")
        if policy != "fixed":
            raise NotImplementedError(f"SpeculativeDecoder: policy {policy!r} needs specdec.scheduler, "
                                      "which is not implemented yet; use policy='fixed'")
        if drafter is not None and not isinstance(drafter, Drafter):
            raise TypeError(f"SpeculativeDecoder: drafter must be a specdec Drafter (DraftModel, PromptLookup, ...) "
                            f"or None, got {type(drafter).__name__}")
        for attr in ("vocab_size", "device", "new_cache", "forward", "prefill"):
            if not hasattr(target, attr):
                raise TypeError(f"SpeculativeDecoder: target lacks {attr!r}; wrap a transformers model with "
                                f"specdec.HFCausalLM(model)")
        self.target = target
        self.drafter = drafter
        self.max_batch = max_batch
        self.max_len = max_len
        self.policy = policy
        self.device = torch.device(target.device)
        self.vocab_size = int(target.vocab_size)
        if drafter is not None:
            drafter.bind(target, max_batch, max_len)  # vocabulary / device checks happen here
        self.max_nodes = drafter.max_nodes if drafter is not None else 1
        self.cache = target.new_cache(max_batch, max_len + self.max_nodes)
        self._views: Dict[int, object] = {}

    def __repr__(self) -> str:
        return (f"SpeculativeDecoder(drafter={self.drafter!r}, max_batch={self.max_batch}, "
                f"max_len={self.max_len}, policy={self.policy!r})")

    def _view(self, b: int):
        view = self._views.get(b)
        if view is None:
            view = self._views[b] = self.cache.rows(0, b)
        return view

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
                if isinstance(p, (int,)) and not isinstance(p, bool):
                    raise TypeError("generate: input_ids must be a list of token lists (a batch); "
                                    "wrap a single prompt as [[t0, t1, ...]]")
                if not isinstance(p, (list, tuple)):
                    raise TypeError(f"generate: request {i} must be a list of token ids, got {type(p).__name__}")
                for t in p:
                    if isinstance(t, bool) or not isinstance(t, int):
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

    @staticmethod
    def _eos_set(eos_token_id) -> frozenset:
        if eos_token_id is None:
            return frozenset()
        if isinstance(eos_token_id, torch.Tensor):
            eos_token_id = eos_token_id.flatten().tolist()
        if isinstance(eos_token_id, int) and not isinstance(eos_token_id, bool):
            return frozenset([eos_token_id])
        try:
            ids = list(eos_token_id)
        except TypeError:
            raise TypeError(f"generate: eos_token_id must be an int, a list of ints or None, "
                            f"got {type(eos_token_id).__name__}") from None
        if not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
            raise TypeError(f"generate: eos_token_id must hold ints, got {ids!r}")
        return frozenset(ids)

    # ------------------------------------------------------------------ verification
    def _verify(self, tree: TokenTree, logits: torch.Tensor, q: Optional[torch.Tensor], params: SamplingParams,
                generator: torch.Generator):
        if params.greedy:
            return ops.greedy_verify(tree.tokens, tree.parents, logits)
        p = warp_(logits, params)  # [b, N, V], in place on the logits the forward returned
        u = draw_uniforms(tree.batch, tree.size, generator, self.device)  # [b, N] float64
        return ops.rejection_sample(tree.tokens, tree.parents, p, q, u)

    # ------------------------------------------------------------------ generate
    def generate(self, input_ids: Union[torch.Tensor, Sequence[Sequence[int]]], max_new_tokens: int = 128,
                 temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0,
                 eos_token_id: Union[int, Iterable[int], None] = None, seed: Optional[int] = None,
                 callback: Optional[Callable[[int, List[int]], None]] = None) -> GenerateOutput:
        """Generate up to ``max_new_tokens`` new tokens for each request.

        ``temperature == 0`` is greedy (output == the target's own greedy decoding);
        otherwise tokens follow the target distribution warped by temperature, top-k
        (0 = off) and top-p (1 = off) exactly as plain sampling would. ``seed`` makes a
        call reproducible (same inputs, same batch, same decoder -> same tokens).
        ``callback(request_index, new_tokens)`` is called as tokens are accepted (streaming).
        """
        if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int):
            raise TypeError(f"generate: max_new_tokens must be an int, got {type(max_new_tokens).__name__}")
        if max_new_tokens < 0:
            raise ValueError(f"generate: max_new_tokens must be >= 0, got {max_new_tokens}")
        if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
            raise TypeError(f"generate: seed must be an int or None, got {type(seed).__name__}")
        params = SamplingParams(float(temperature) if isinstance(temperature, int) and not isinstance(temperature, bool)
                                else temperature, top_k, float(top_p) if isinstance(top_p, int)
                                and not isinstance(top_p, bool) else top_p)
        eos = self._eos_set(eos_token_id)
        prompts = self._prompts(input_ids)
        too_long = [(i, len(p)) for i, p in enumerate(prompts) if len(p) + max_new_tokens > self.max_len]
        if too_long:
            i, n = too_long[0]
            raise ValueError(f"generate: request {i} has a prompt of {n} tokens; with max_new_tokens="
                             f"{max_new_tokens} it needs {n + max_new_tokens} > max_len={self.max_len} positions"
                             + (f" ({len(too_long)} requests too long)" if len(too_long) > 1 else ""))
        B = len(prompts)
        if max_new_tokens == 0:
            return GenerateOutput([[] for _ in range(B)], _empty_metrics(B))
        return _Run(self, prompts, max_new_tokens, params, eos, seed, callback).run()


class _Run:
    """State of one generate call."""

    def __init__(self, dec: SpeculativeDecoder, prompts: List[List[int]], max_new: int, params: SamplingParams,
                 eos: frozenset, seed: Optional[int], callback) -> None:
        self.dec = dec
        self.prompts = prompts
        self.max_new = max_new
        self.params = params
        self.eos = eos
        self.callback = callback
        dev = dec.device
        self.generator = make_generator(seed, dev)
        self.draft_generator = make_generator(None if seed is None else seed + 0x5EED, dev)
        B = len(prompts)
        self.B = B
        self.seqs = [list(p) for p in prompts]           # prompt + new tokens, per request
        self.new: List[List[int]] = [[] for _ in range(B)]
        self.finish = [""] * B
        self.rows = list(range(B))                       # row -> request id (active rows only)
        # metrics
        self.passes = [0] * B
        self.drafted = [0] * B
        self.accepted = [0] * B
        self.pos_drafted: List[int] = []
        self.pos_accepted: List[int] = []
        self.itl: List[float] = []
        self.target_passes = 0
        self.clock = _Clock(dev)

    # ------------------------------------------------------------------ bookkeeping
    def _emit(self, rid: int, toks: Sequence[int]) -> Tuple[int, bool]:
        """Append tokens to request rid up to EOS / max_new; returns (count appended, finished)."""
        out = self.new[rid]
        seq = self.seqs[rid]
        n = 0
        done = False
        for t in toks:
            out.append(t)
            seq.append(t)
            n += 1
            if t in self.eos:
                self.finish[rid] = "eos"
                done = True
                break
            if len(out) >= self.max_new:
                self.finish[rid] = "length"
                done = True
                break
        if n and self.callback is not None:
            self.callback(rid, out[len(out) - n:])
        return n, done

    def _retire(self, finished_rows: List[int], roots: torch.Tensor) -> torch.Tensor:
        """Drop finished rows: the last active rows move into the holes. Returns the new roots [b']."""
        dec = self.dec
        b = len(self.rows)
        gone = set(finished_rows)
        keep = [r for r in range(b) if r not in gone]
        b_new = len(keep)
        if b_new == 0:
            self.rows = []
            return roots[:0]
        holes = [r for r in range(b_new) if r in gone]
        tail = [r for r in range(b_new, b) if r not in gone]
        moves = [(src, dst, len(self.seqs[self.rows[src]])) for src, dst in zip(tail, holes)]
        perm = list(range(b_new))
        for src, dst, _ in moves:
            perm[dst] = src
            self.rows[dst] = self.rows[src]
        self.rows = self.rows[:b_new]
        move_cache_rows(dec.cache, moves)
        if dec.drafter is not None:
            dec.drafter.retire(moves, b_new)
        if not moves:
            return roots[:b_new]
        return roots.index_select(0, torch.tensor(perm, dtype=torch.int64, device=roots.device))

    # ------------------------------------------------------------------ the loop
    def run(self) -> GenerateOutput:
        dec, params, clock = self.dec, self.params, self.clock
        target, drafter = dec.target, dec.drafter
        B = self.B
        mem = _MemoryProbe(dec)
        t_start = time.perf_counter()

        # ---- prefill the target; the first token is drawn exactly like a plain step
        dec.cache.reset()
        c0 = clock.mark()
        logits0 = target.prefill(dec.cache, self.prompts, rows=list(range(B)))   # [B, V]
        root_tree = TokenTree.root_only(torch.zeros(B, dtype=torch.int64, device=dec.device))
        _, _, out0 = dec._verify(root_tree, logits0.float().view(B, 1, -1), None, params, self.generator)
        clock.add("prefill", c0, clock.mark())
        first = out0[:, 0].tolist()                        # host sync: the first token of each request
        t_first = time.perf_counter()
        roots = out0[:, 0].contiguous()                    # [B] int64 on the device
        finished_rows = []
        for r, t in enumerate(first):
            _, done = self._emit(r, [t])
            if done:
                finished_rows.append(r)

        if drafter is not None:
            c0 = clock.mark()
            drafter.start(self.prompts, params, self.draft_generator)
            clock.add("draft_prefill", c0, clock.mark())
        if finished_rows:
            roots = self._retire(finished_rows, roots)
        t_prev = time.perf_counter()

        # ---- speculative steps
        while self.rows:
            b = len(self.rows)
            cache = dec._view(b)
            c0 = clock.mark()
            if drafter is None:
                draft = Draft(TokenTree.root_only(roots))
            else:
                ctx = StepContext(roots=roots, sequences=[self.seqs[rid] for rid in self.rows],
                                  request_ids=list(self.rows),
                                  budgets=[self.max_new - len(self.new[rid]) - 1 for rid in self.rows])
                draft = drafter.propose(ctx)
            tree = draft.tree
            c1 = clock.mark()
            logits = target.forward(cache, tree.tokens, tree.depths, tree.attention_mask())   # [b, N, V]
            accepted, num, out = dec._verify(tree, logits, draft.draft_probs, params, self.generator)
            c2 = clock.mark()
            cache.commit(accepted, num)                    # ops.kv_commit; lens += num + 1
            c3 = clock.mark()
            # THE host sync of the step: accepted counts and tokens, to append them and check EOS
            host = torch.cat([num.view(b, 1).to(torch.int64), out], dim=1).tolist()
            num_host = [h[0] for h in host]
            c4 = clock.mark()
            if drafter is not None:
                drafter.accept(accepted, num, num_host)    # drafter rollback (kv_commit)
            c5 = clock.mark()
            roots = out.gather(1, num.view(b, 1).to(torch.int64)).view(b)   # next roots [b]
            clock.add("draft", c0, c1)
            clock.add("verify", c1, c2)
            clock.add("commit", c2, c3)
            clock.add("commit", c4, c5)
            self.target_passes += 1

            t_now = time.perf_counter()
            finished_rows = []
            drafted_host = tree.num_drafted
            for r, rid in enumerate(self.rows):
                a = num_host[r]
                d = drafted_host[r]
                self.passes[rid] += 1
                self.drafted[rid] += d
                self.accepted[rid] += a
                if d > len(self.pos_drafted):
                    self.pos_drafted += [0] * (d - len(self.pos_drafted))
                    self.pos_accepted += [0] * (d - len(self.pos_accepted))
                for i in range(d):
                    self.pos_drafted[i] += 1
                for i in range(a):
                    self.pos_accepted[i] += 1
                n, done = self._emit(rid, host[r][1:a + 2])
                if n:
                    self.itl += [(t_now - t_prev) / n] * n
                if done:
                    finished_rows.append(r)
            t_prev = t_now
            if finished_rows:
                roots = self._retire(finished_rows, roots)

        t_end = time.perf_counter()
        self.static_bytes = mem.static
        return GenerateOutput(self.new, self._metrics(t_start, t_first, t_end, mem.peak()))

    def _metrics(self, t_start: float, t_first: float, t_end: float, peak: int) -> Dict[str, object]:
        times = self.clock.totals()
        drafted = sum(self.drafted)
        accepted = sum(self.accepted)
        request_steps = sum(self.passes)
        new_tokens = sum(len(t) for t in self.new)
        itl = sorted(self.itl)
        return {
            "target_passes": self.target_passes,
            "drafted_tokens": drafted,
            "accepted_tokens": accepted,
            "acceptance_rate": accepted / drafted if drafted else 0.0,
            "mean_accepted_length": (accepted + request_steps) / request_steps if request_steps else 0.0,
            "accepted_per_position": [a / d if d else 0.0 for a, d in zip(self.pos_accepted, self.pos_drafted)],
            "draft_seconds": times.get("draft", 0.0) + times.get("draft_prefill", 0.0),
            "verify_seconds": times.get("verify", 0.0),
            "commit_seconds": times.get("commit", 0.0),
            "prefill_seconds": times.get("prefill", 0.0),
            "ttft_seconds": t_first - t_start,
            "itl_p50_seconds": _percentile(itl, 50),
            "itl_p99_seconds": _percentile(itl, 99),
            "tokens_per_second": new_tokens / (t_end - t_start) if t_end > t_start else 0.0,
            "total_seconds": t_end - t_start,
            "new_tokens": new_tokens,
            "peak_memory_bytes": peak,
            "static_memory_bytes": self.static_bytes,
            "per_request": {
                "new_tokens": [len(t) for t in self.new],
                "target_passes": list(self.passes),
                "drafted_tokens": list(self.drafted),
                "accepted_tokens": list(self.accepted),
                "mean_accepted_length": [(a + p) / p if p else 0.0 for a, p in zip(self.accepted, self.passes)],
                "finish_reason": list(self.finish),
            },
        }


def _empty_metrics(B: int) -> Dict[str, object]:
    return {"target_passes": 0, "drafted_tokens": 0, "accepted_tokens": 0, "acceptance_rate": 0.0,
            "mean_accepted_length": 0.0, "accepted_per_position": [], "draft_seconds": 0.0, "verify_seconds": 0.0,
            "commit_seconds": 0.0, "prefill_seconds": 0.0, "ttft_seconds": 0.0, "itl_p50_seconds": 0.0,
            "itl_p99_seconds": 0.0, "tokens_per_second": 0.0, "total_seconds": 0.0, "new_tokens": 0,
            "peak_memory_bytes": 0, "static_memory_bytes": 0,
            "per_request": {"new_tokens": [0] * B, "target_passes": [0] * B, "drafted_tokens": [0] * B,
                            "accepted_tokens": [0] * B, "mean_accepted_length": [0.0] * B,
                            "finish_reason": ["length"] * B}}


def _percentile(sorted_vals: List[float], q: float) -> float:
    if not sorted_vals:
        return 0.0
    pos = (len(sorted_vals) - 1) * q / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(sorted_vals) - 1)
    return sorted_vals[lo] + (sorted_vals[hi] - sorted_vals[lo]) * (pos - lo)


class _Clock:
    """Phase timers: host wall clock on CPU (ops are synchronous); CUDA events on CUDA, read once at the end."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self._totals: Dict[str, float] = {}
        self._events: List[Tuple[str, object, object]] = []

    def mark(self):
        if self.cuda:
            e = torch.cuda.Event(enable_timing=True)
            e.record()
            return e
        return time.perf_counter()

    def add(self, name: str, start, end) -> None:
        if self.cuda:
            self._events.append((name, start, end))
        else:
            self._totals[name] = self._totals.get(name, 0.0) + (end - start)

    def totals(self) -> Dict[str, float]:
        if self.cuda and self._events:
            torch.cuda.synchronize()
            for name, s, e in self._events:
                self._totals[name] = self._totals.get(name, 0.0) + s.elapsed_time(e) / 1000.0
            self._events = []
        return self._totals


def _state_bytes(lm) -> int:
    """Bytes of a model's weights (parameters, buffers and packed quantized weights), each storage once."""
    module = getattr(lm, "model", lm)
    if not isinstance(module, torch.nn.Module):
        return 0
    seen = set()
    total = 0

    def visit(v) -> None:
        nonlocal total
        if isinstance(v, torch.Tensor):
            try:
                key = (v.untyped_storage().data_ptr(), v.device)
                size = v.untyped_storage().nbytes()
            except (RuntimeError, NotImplementedError):  # quantized / opaque tensors
                key, size = (id(v), v.device), v.numel() * v.element_size()
            if key not in seen:
                seen.add(key)
                total += size
        elif isinstance(v, (tuple, list)):
            for x in v:
                visit(x)

    for v in module.state_dict(keep_vars=True).values():
        visit(v)
    return total


class _MemoryProbe:
    """Peak memory of a generate call.

    CUDA: ``torch.cuda.max_memory_allocated`` (reset at the start of the call; it counts
    weights and caches since they live in the caching allocator).
    CPU: tracemalloc does not see torch's allocations, so the figure is weights (target +
    draft) + KV caches (their ``nbytes``) + the growth of the process's peak resident set
    during the call (``VmHWM`` after resetting it through ``/proc/self/clear_refs``; when the
    reset is not permitted, the RSS sampled at the end of the call).
    """

    def __init__(self, dec: SpeculativeDecoder) -> None:
        self.dec = dec
        self.cuda = dec.device.type == "cuda"
        self.static = _state_bytes(dec.target) + dec.cache.nbytes()
        drafter = dec.drafter
        lm = getattr(drafter, "lm", None)
        if lm is not None:
            self.static += _state_bytes(lm)
            cache = getattr(drafter, "cache", None)
            if cache is not None:
                self.static += cache.nbytes()
        if self.cuda:
            torch.cuda.reset_peak_memory_stats(dec.device)
            return
        self.hwm_reset = False
        try:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")
            self.hwm_reset = True
        except OSError:
            pass
        self.rss0 = _proc_status("VmRSS")

    def peak(self) -> int:
        if self.cuda:
            return int(torch.cuda.max_memory_allocated(self.dec.device))
        end = _proc_status("VmHWM") if self.hwm_reset else _proc_status("VmRSS")
        return int(self.static + max(0, end - self.rss0))


def _proc_status(key: str) -> int:
    try:
        with open(f"/proc/{os.getpid()}/status") as f:
            for line in f:
                if line.startswith(key + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0
