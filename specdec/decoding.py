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
"""
from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from typing import Callable, Dict, Iterable, List, Optional, Sequence, Tuple, Union

import torch

from specdec import ops
from specdec.drafters.base import Draft, Drafter, StepContext, check_draft, move_cache_rows
from specdec.metrics import MemoryProbe, MetricsRecorder, empty_metrics, static_memory_bytes, write_trace
from specdec.sampling import SamplingParams, draw_uniforms, make_generator, warp_
from specdec.scheduler import POLICIES, CostModel, Policy, StepTimes, calibrate, make_policy
from specdec.tree import TokenTree

__all__ = ["SpeculativeDecoder", "GenerateOutput"]


@dataclass
class GenerateOutput:
    """``tokens[i]``: the new tokens of request i (EOS included when hit). ``metrics``: see DESIGN.md."""

    tokens: List[List[int]]
    metrics: Dict[str, object] = field(default_factory=dict)
    trace: Optional[List[dict]] = None  # per-step records (generate(trace=...)); keys in specdec/metrics.py


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
        How much to draft each step (specdec/scheduler.py): "goodput" (default: the depth that
        maximises expected tokens per second, per step and request, with fallback to plain
        decoding), "heuristic" (transformers' +2 / -1 schedule) or "fixed" (the drafter's own k).
    calibrate : bool
        Goodput policy: time target forwards once (cached per model / device / dtype / threads
        in ``$SPECDEC_CACHE``, default ~/.cache/specdec) before the first call instead of
        learning every cost online. Off by default.
    """

    def __init__(self, target, drafter: Optional[Drafter] = None, max_batch: int = 8, max_len: int = 2048,
                 policy: Union[str, Policy] = "goodput", calibrate: bool = False) -> None:
        for name, v in (("max_batch", max_batch), ("max_len", max_len)):
            if isinstance(v, bool) or not isinstance(v, int):
                raise TypeError(f"SpeculativeDecoder: {name} must be an int, got {type(v).__name__}")
            if v < 1:
                raise ValueError(f"SpeculativeDecoder: {name} must be >= 1, got {v}")
        if not isinstance(policy, Policy) and policy not in POLICIES:
            raise ValueError(f"SpeculativeDecoder: policy must be one of {POLICIES} or a specdec.scheduler.Policy, "
                             f"got {policy!r}")
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
        self.policy = policy if isinstance(policy, str) else policy.name
        self.device = torch.device(target.device)
        self.vocab_size = int(target.vocab_size)
        if drafter is not None:
            drafter.bind(target, max_batch, max_len)  # vocabulary / device checks happen here
        self.max_nodes = drafter.max_nodes if drafter is not None else 1
        self.cache = target.new_cache(max_batch, max_len + self.max_nodes)
        self._views: Dict[int, object] = {}
        #: the step policy (specdec/scheduler.py); its cost model persists across generate calls
        self.scheduler: Policy = make_policy(policy if drafter is not None else "fixed", drafter, CostModel())
        self._calibrate = bool(calibrate)
        #: weights (target + draft model) + KV caches, for the peak-memory metric
        self.static_memory_bytes = static_memory_bytes(target, drafter, [self.cache, getattr(drafter, "cache", None)])

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
                 callback: Optional[Callable[[int, List[int]], None]] = None,
                 trace: Union[bool, str, "os.PathLike"] = False) -> GenerateOutput:
        """Generate up to ``max_new_tokens`` new tokens for each request.

        ``temperature == 0`` is greedy (output == the target's own greedy decoding);
        otherwise tokens follow the target distribution warped by temperature, top-k
        (0 = off) and top-p (1 = off) exactly as plain sampling would. ``seed`` makes a
        call reproducible (same inputs, same batch, same decoder -> same tokens).
        ``callback(request_index, new_tokens)`` is called as tokens are accepted (streaming).
        ``trace``: True returns the per-step trace in ``GenerateOutput.trace``; a path also
        writes it there as JSON lines (keys: specdec/metrics.py).
        """
        if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int):
            raise TypeError(f"generate: max_new_tokens must be an int, got {type(max_new_tokens).__name__}")
        if max_new_tokens < 0:
            raise ValueError(f"generate: max_new_tokens must be >= 0, got {max_new_tokens}")
        if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
            raise TypeError(f"generate: seed must be an int or None, got {type(seed).__name__}")
        params = SamplingParams(_int_to_float(temperature), top_k, _int_to_float(top_p))
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
            return GenerateOutput([[] for _ in range(B)], empty_metrics(B), [] if trace else None)
        if self._calibrate and self.drafter is not None:
            self._calibrate = False
            nodes = sorted({1, 2, 4, self.max_nodes} | {n for n in (8, 12, 16) if n < self.max_nodes})
            calibrate(self.target, self.cache, self.scheduler.cost, sorted({1, self.max_batch}), nodes)
        out = _Run(self, prompts, max_new_tokens, params, eos, seed, callback, bool(trace)).run()
        if trace and not isinstance(trace, bool):
            write_trace(out.trace, trace)
        return out


class _Run:
    """State of one generate call."""

    def __init__(self, dec: SpeculativeDecoder, prompts: List[List[int]], max_new: int, params: SamplingParams,
                 eos: frozenset, seed: Optional[int], callback, trace: bool = False) -> None:
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
        self.rec = MetricsRecorder(B, dev)
        self.sched = dec.scheduler
        self.sched.begin(B, trace)

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
            if dec.drafter is not None:
                dec.drafter.retire([], 0)   # the last rows leave too (drafters that keep per-request state)
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
        dec, params, rec = self.dec, self.params, self.rec
        clock = rec.clock
        target, drafter = dec.target, dec.drafter
        B = self.B
        mem = MemoryProbe(dec.device, dec.static_memory_bytes)
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
            plan = self.sched.plan(self.rows, [self.max_new - len(self.new[rid]) - 1 for rid in self.rows])
            if drafter is None:
                draft = Draft(TokenTree.root_only(roots))
            else:
                ctx = StepContext(roots=roots, sequences=[self.seqs[rid] for rid in self.rows],
                                  request_ids=list(self.rows), budgets=plan.budgets)
                draft = drafter.propose(ctx)
                if not drafter.trusted:
                    _check_proposal(drafter, draft, ctx, dec)
            tree = draft.tree
            c1 = clock.mark()
            logits = target.forward(cache, tree.tokens, tree.depths, tree.attention_mask())   # [b, N, V]
            if drafter is not None:
                drafter.observe_verify(tree, logits)       # before warp_ (in place); no host sync
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

            t_now = time.perf_counter()
            finished_rows = []
            emitted = []
            for r, rid in enumerate(self.rows):
                a = num_host[r]
                n, done = self._emit(rid, host[r][1:a + 2])
                emitted.append(n)
                if done:
                    finished_rows.append(r)
            depths = tree.depth_per_request() if drafter is not None else tree.num_drafted
            rec.step(self.rows, tree.num_drafted, depths, num_host, emitted, t_now - t_prev)
            self.sched.observe(plan, self.rows, tree.size, depths, tree.num_drafted, num_host, emitted,
                               StepTimes(*clock.split(c0, c1, c2, c3, c4, c5), total=t_now - t_prev))
            t_prev = t_now
            if finished_rows:
                roots = self._retire(finished_rows, roots)

        t_end = time.perf_counter()
        metrics = rec.summary(self.new, self.finish, t_start, t_first, t_end, mem.peak(), mem.static)
        metrics.update(self.sched.summary())
        if drafter is None:
            metrics["policy"] = "none"
        return GenerateOutput(self.new, metrics, self.sched.trace)


def _check_proposal(drafter: Drafter, draft, ctx: StepContext, dec: SpeculativeDecoder) -> None:
    """Host validation of an untrusted drafter's proposal before the target runs; the drafter forgets it on error."""
    try:
        check_draft(draft, type(drafter).__name__, ctx.request_ids, dec.vocab_size, dec.max_nodes)
    except (TypeError, ValueError):
        drafter.cancel()
        raise


def _int_to_float(x):
    """Accept ints for float parameters (temperature=1), leave everything else to SamplingParams' checks."""
    return float(x) if isinstance(x, int) and not isinstance(x, bool) else x


