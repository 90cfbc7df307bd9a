"""Engine: continuous batching with a step API (the serving building block).

::

    eng = specdec.Engine(target, drafter, max_batch=8, max_len=2048)
    eng.add_request("a", prompt_ids, RequestParams(max_new_tokens=64, temperature=0.7, seed=1))
    while eng.has_unfinished():
        for delta in eng.step():          # RequestOutput per request that moved this step
            print(delta.request_id, delta.new_tokens, delta.finished, delta.finish_reason)

One :meth:`Engine.step`:

1. admission: waiting requests take free cache rows (FIFO, up to ``max_batch`` active), are
   prefilled together into those rows (the target's, then the drafter's ``admit``), and draw
   their first token exactly like a plain step;
2. one speculative step over every active row (draft -> verify -> commit, the loop of
   :mod:`specdec.decoding`), each row accepting its own count;
3. requests that hit a stop token or their ``max_new_tokens`` leave at once: the last active
   row moves into the hole (target cache, drafter caches and state), so rows are reused by
   the next admissions. :meth:`abort` does the same between steps.

Rows of one batch may carry different sampling settings. Verification groups them: when every
row shares one setting the op of that setting runs (``greedy_verify``, or ``warp_`` +
``rejection_sample``); otherwise each sampled setting's rows are warped with their own
temperature / top-k / top-p and greedy rows get the one-hot distribution of their argmax, and
one ``rejection_sample`` decides all rows (on a one-hot target row it accepts exactly the
argmax child and draws the argmax: the same decisions as ``greedy_verify``). The drafter is
told the step's common setting (``StepContext.params``), or greedy when the rows disagree:
deterministic candidates are exact under every setting.

Randomness. A request added with a ``seed`` is *seed-coupled*: the token at sequence position t
is the Gumbel-max draw argmax_x(log p_t(x) + G(seed, t)(x)), with noise G a function of the
seed and the position only (i.i.d. Gumbel over the vocabulary, independent across positions:
exact sampling from p_t). Verification then accepts a draft token iff it equals that draw (every
node's warped p becomes the one-hot row of its position's draw and the rejection sampler accepts
exactly the matching child), so the output equals plain seeded sampling token for token, whatever
the drafter, the policy and the rest of the batch. Its acceptance is sum_x q(x) p(x) for sampled
drafts (p(argmax q) for greedy ones) instead of sum_x min(p, q): reproducibility costs some
speculation. Each step draws one V-vector of noise per request and depth on the host. Requests
without a seed use the SpecInfer rejection sampler (``rejection_sample``) with a fresh generator
of their own; :meth:`SpeculativeDecoder.generate` (``seed=`` per call) uses that sampler with
per-request generators seeded from the call's seed (reproducible for the same call).

Failure isolation: a drafter that raises is cancelled and the step runs as a plain step for
every row; a proposal that is invalid for some rows (untrusted drafters: the host check of
:func:`specdec.drafters.base.draft_errors`) is cut back to the root for those rows only. Both
are logged (logger ``specdec.engine``) and counted (``stats()["drafter_errors"]``); the batch
never fails for them.
"""
from __future__ import annotations

import logging
import math
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Deque, Dict, Hashable, Iterable, List, Optional, Sequence, Tuple, Union

import torch

from specdec import ops
from specdec.cache import move_cache_rows
from specdec.drafters.base import Draft, Drafter, StepContext
from specdec.drafters.validate import check_draft, draft_errors
from specdec.metrics import MetricsRecorder, static_memory_bytes
from specdec.sampling import SamplingParams, make_generator, mix_seed, warp_
from specdec.scheduler import POLICIES, CostModel, Policy, StepTimes, make_policy
from specdec.tree import TokenTree

__all__ = ["Engine", "RequestParams", "RequestOutput"]

log = logging.getLogger("specdec.engine")


@dataclass(frozen=True)
class RequestParams:
    """Per-request settings. ``temperature == 0`` is greedy (top_k / top_p ignored). ``seed``: a sampled
    request becomes seed-coupled (the module docstring): its tokens equal plain seeded sampling
    whatever the drafter and the batch; None: the rejection sampler with a fresh generator.
    ``stop_token_ids``: the request finishes right after emitting any of them."""

    max_new_tokens: int = 128
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: Optional[int] = None
    stop_token_ids: Tuple[int, ...] = ()

    def __post_init__(self) -> None:
        m = self.max_new_tokens
        if isinstance(m, bool) or not isinstance(m, int):
            raise TypeError(f"RequestParams: max_new_tokens must be an int, got {type(m).__name__}")
        if m < 1:
            raise ValueError(f"RequestParams: max_new_tokens must be >= 1, got {m}")
        if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(self.seed, int)):
            raise TypeError(f"RequestParams: seed must be an int or None, got {type(self.seed).__name__}")
        try:
            SamplingParams(_as_float(self.temperature), self.top_k, _as_float(self.top_p))
        except (TypeError, ValueError) as exc:
            raise type(exc)(f"RequestParams: {exc}") from None
        stops = self.stop_token_ids
        if isinstance(stops, int) and not isinstance(stops, bool):
            stops = (stops,)
        try:
            stops = tuple(stops)
        except TypeError:
            raise TypeError(f"RequestParams: stop_token_ids must be a list of ints, got {type(stops).__name__}") \
                from None
        if not all(isinstance(t, int) and not isinstance(t, bool) for t in stops):
            raise TypeError(f"RequestParams: stop_token_ids must hold ints, got {list(stops)!r}")
        object.__setattr__(self, "stop_token_ids", stops)

    @property
    def sampling(self) -> SamplingParams:
        return SamplingParams(_as_float(self.temperature), self.top_k, _as_float(self.top_p))


@dataclass
class RequestOutput:
    """What one step did for one request: the tokens it emitted (in order), and whether it is done."""

    request_id: Hashable
    new_tokens: List[int]
    finished: bool = False
    finish_reason: Optional[str] = None   # "stop" (a stop token), "length" (max_new_tokens), "abort"
    num_generated: int = 0                # tokens generated so far, these included


@dataclass
class _Req:
    rid: Hashable
    uid: int                        # engine-internal id, given at admission (drafters, scheduler, metrics
                                    # key on it): 0, 1, ... in admission order from the start of a busy period
    prompt: List[int]
    params: RequestParams
    sampling: SamplingParams
    stops: frozenset
    generator: Optional[torch.Generator]   # CPU; None for greedy and seed-coupled requests
    coupled: bool = False                   # seeded engine request: Gumbel-max on (seed, position) noise
    seq: List[int] = field(default_factory=list)
    new: List[int] = field(default_factory=list)
    finish: Optional[str] = None
    t_arrival: float = 0.0
    t_first: Optional[float] = None
    drafted: int = 0
    accepted: int = 0
    passes: int = 0


def _as_float(x):
    return float(x) if isinstance(x, int) and not isinstance(x, bool) else x


class Engine:
    """Continuous-batching speculative decoding of ``target`` with ``drafter`` (None: plain decoding).

    Parameters as :class:`~specdec.SpeculativeDecoder` (``max_batch``: most active requests;
    ``max_len``: most tokens per request, prompt + new tokens; ``policy``: "goodput" (default),
    "heuristic", "fixed" or a :class:`specdec.scheduler.Policy`). ``max_waiting`` bounds the queue
    of requests not yet admitted (None: unbounded); :meth:`add_request` raises :class:`QueueFull`
    past it. ``draft_seed`` seeds the drafter's generator (sampled draft models). ``drafter_errors``:
    "fallback" (default: a drafter failure costs its rows one plain step, see the module docstring)
    or "raise" (the error propagates, as :meth:`SpeculativeDecoder.generate` wants).
    """

    def __init__(self, target, drafter: Optional[Drafter] = None, max_batch: int = 8, max_len: int = 2048,
                 policy: Union[str, Policy] = "goodput", max_waiting: Optional[int] = None,
                 draft_seed: Optional[int] = None, drafter_errors: str = "fallback", _name: str = "Engine") -> None:
        name = _name
        for arg, v in (("max_batch", max_batch), ("max_len", max_len)):
            if isinstance(v, bool) or not isinstance(v, int):
                raise TypeError(f"{name}: {arg} must be an int, got {type(v).__name__}")
            if v < 1:
                raise ValueError(f"{name}: {arg} must be >= 1, got {v}")
        if max_waiting is not None and (isinstance(max_waiting, bool) or not isinstance(max_waiting, int)
                                        or max_waiting < 0):
            raise ValueError(f"{name}: max_waiting must be an int >= 0 or None, got {max_waiting!r}")
        if drafter_errors not in ("fallback", "raise"):
            raise ValueError(f"{name}: drafter_errors must be 'fallback' or 'raise', got {drafter_errors!r}")
        if not isinstance(policy, Policy) and policy not in POLICIES:
            raise ValueError(f"{name}: policy must be one of {POLICIES} or a specdec.scheduler.Policy, "
                             f"got {policy!r}")
        if drafter is not None and not isinstance(drafter, Drafter):
            raise TypeError(f"{name}: drafter must be a specdec Drafter (DraftModel, PromptLookup, ...) "
                            f"or None, got {type(drafter).__name__}")
        for attr in ("vocab_size", "device", "new_cache", "forward", "prefill"):
            if not hasattr(target, attr):
                raise TypeError(f"{name}: target lacks {attr!r}; wrap a transformers model with "
                                f"specdec.HFCausalLM(model)")
        self.name = name
        self.target = target
        self.drafter = drafter
        self.max_batch = max_batch
        self.max_len = max_len
        self.max_waiting = max_waiting
        self.drafter_errors = drafter_errors
        self.policy = policy if isinstance(policy, str) else policy.name
        self.device = torch.device(target.device)
        self.vocab_size = int(target.vocab_size)
        if drafter is not None:
            drafter.bind(target, max_batch, max_len)  # vocabulary / device checks happen here
        self.max_nodes = drafter.max_nodes if drafter is not None else 1
        self.cache = target.new_cache(max_batch, max_len + self.max_nodes)
        self._views: Dict[int, object] = {}
        #: the step policy (specdec/scheduler.py); its cost model persists for the engine's life
        self.scheduler: Policy = make_policy(policy if drafter is not None else "fixed", drafter, CostModel())
        self.scheduler.begin(0, False)
        #: weights (target + draft model) + KV caches, for the peak-memory metric
        self.static_memory_bytes = static_memory_bytes(target, drafter, [self.cache, getattr(drafter, "cache", None)])
        self.draft_generator = make_generator(draft_seed, self.device)
        self.recorder = MetricsRecorder(0, self.device)
        self._waiting: Deque[_Req] = deque()
        # a closed batch (SpeculativeDecoder.generate: every request is queued up front, none joins
        # later): once nothing waits, the call ends with its slowest row and the policy plans for that
        self._closed = False
        self._rows: List[_Req] = []                   # active requests in row order
        self._by_id: Dict[Hashable, _Req] = {}        # waiting + active
        self._roots = torch.zeros(0, dtype=torch.int64, device=self.device)
        self._uid = 0
        self._auto_recorder = True                    # a fresh MetricsRecorder per busy period (generate sets its own)
        self._t_prev: Optional[float] = None
        self.counters = dict(requests_added=0, requests_finished=0, requests_aborted=0, steps=0,
                             generated_tokens=0, drafted_tokens=0, accepted_tokens=0, drafter_errors=0)

    def __repr__(self) -> str:
        return (f"{self.name}(drafter={self.drafter!r}, max_batch={self.max_batch}, max_len={self.max_len}, "
                f"policy={self.policy!r})")

    # ------------------------------------------------------------------ requests
    def add_request(self, request_id: Hashable, prompt_ids: Sequence[int],
                    params: Optional[RequestParams] = None) -> None:
        """Queue a request; it joins the batch at the next step boundary with a free row.

        Raises (nothing changes then): ValueError for a duplicate ``request_id``, an empty prompt,
        out-of-vocabulary ids or ``len(prompt) + max_new_tokens > max_len``; TypeError for non-int
        ids; :class:`QueueFull` when ``max_waiting`` requests already wait."""
        params = RequestParams() if params is None else params
        if not isinstance(params, RequestParams):
            raise TypeError(f"{self.name}.add_request: params must be a specdec.RequestParams, "
                            f"got {type(params).__name__}")
        if request_id in self._by_id:
            raise ValueError(f"{self.name}.add_request: request {request_id!r} is already in the engine")
        prompt = self._check_prompt(request_id, prompt_ids)
        need = len(prompt) + params.max_new_tokens
        if need > self.max_len:
            raise ValueError(f"{self.name}.add_request: request {request_id!r} has a prompt of {len(prompt)} tokens; "
                             f"with max_new_tokens={params.max_new_tokens} it needs {need} > max_len={self.max_len} "
                             f"positions")
        if self.max_waiting is not None and len(self._waiting) >= self.max_waiting:
            raise QueueFull(f"{self.name}.add_request: {len(self._waiting)} requests already wait "
                            f"(max_waiting={self.max_waiting})")
        self._enqueue(request_id, prompt, params, None)

    def _enqueue(self, request_id, prompt: List[int], params: RequestParams, generator) -> _Req:
        sampling = params.sampling
        gen = None
        coupled = False
        if not sampling.greedy:
            if generator is None and params.seed is not None:
                coupled = True
            else:
                gen = generator if generator is not None else make_generator(params.seed, "cpu")
        req = _Req(request_id, -1, prompt, params, sampling, frozenset(params.stop_token_ids), gen, coupled,
                   seq=list(prompt), t_arrival=time.perf_counter())
        self._waiting.append(req)
        self._by_id[request_id] = req
        self.counters["requests_added"] += 1
        return req

    def _check_prompt(self, rid, prompt_ids) -> List[int]:
        where = f"{self.name}.add_request: request {rid!r}"
        if isinstance(prompt_ids, torch.Tensor):
            if prompt_ids.dim() != 1 or prompt_ids.dtype.is_floating_point or prompt_ids.dtype == torch.bool:
                raise TypeError(f"{where}: prompt_ids must be a 1-D integer tensor or a list of ints, got a "
                                f"{prompt_ids.dtype} tensor of shape {tuple(prompt_ids.shape)}")
            prompt_ids = prompt_ids.tolist()
        if isinstance(prompt_ids, (str, bytes)) or not isinstance(prompt_ids, (list, tuple)):
            raise TypeError(f"{where}: prompt_ids must be a list of token ids, got {type(prompt_ids).__name__}")
        for t in prompt_ids:
            if isinstance(t, bool) or not isinstance(t, int):
                raise TypeError(f"{where}: holds a non-integer token {t!r}")
        if not prompt_ids:
            raise ValueError(f"{where}: empty prompt (at least one token is needed)")
        lo, hi = min(prompt_ids), max(prompt_ids)
        if lo < 0 or hi >= self.vocab_size:
            bad = lo if lo < 0 else hi
            raise ValueError(f"{where}: holds token id {bad}, outside the vocabulary [0, {self.vocab_size})")
        return list(prompt_ids)

    def abort(self, request_id: Hashable) -> bool:
        """Drop a request now (waiting or active); its rows are free for the next admission.
        Returns False when the engine does not hold it (already finished, or never added)."""
        req = self._by_id.get(request_id)
        if req is None:
            return False
        if req in self._waiting:
            self._waiting.remove(req)
            self._forget(req)
        else:
            row = next(r for r, x in enumerate(self._rows) if x is req)
            req.finish = "abort"
            self._retire([row])
        self.counters["requests_aborted"] += 1
        return True

    def abort_all(self) -> int:
        """Drop every request (waiting and active) at once; returns how many."""
        n = len(self._waiting) + len(self._rows)
        for req in list(self._waiting):
            self._forget(req)
        self._waiting.clear()
        for req in self._rows:
            req.finish = "abort"
        if self._rows:
            self._retire(list(range(len(self._rows))))
        self.counters["requests_aborted"] += n
        return n

    def has_unfinished(self) -> bool:
        return bool(self._rows or self._waiting)

    @property
    def num_active(self) -> int:
        return len(self._rows)

    @property
    def num_waiting(self) -> int:
        return len(self._waiting)

    def stats(self) -> Dict[str, object]:
        """Counters since construction plus the current queue state (for /metrics)."""
        out = dict(self.counters)
        out.update(active=len(self._rows), waiting=len(self._waiting), free_rows=self.max_batch - len(self._rows))
        d = out["drafted_tokens"]
        out["acceptance_rate"] = out["accepted_tokens"] / d if d else 0.0
        return out

    # ------------------------------------------------------------------ the step
    def _view(self, b: int):
        view = self._views.get(b)
        if view is None:
            view = self._views[b] = self.cache.rows(0, b)
        return view

    def admit(self) -> List[RequestOutput]:
        """Only the admission part of :meth:`step`: waiting requests that fit are prefilled and get their
        first token (returned), nothing else advances. A server calls it before ``step()`` to deliver
        first tokens one step earlier (lower time to first token)."""
        deltas: Dict[int, RequestOutput] = {}
        finished: List[int] = []
        self._admit(deltas, finished)
        if finished:
            self._retire(finished)
        return list(deltas.values())

    def step(self) -> List[RequestOutput]:
        """Admit waiting requests, run one speculative step over every active request, retire the
        finished ones. Returns one :class:`RequestOutput` per request that emitted or finished."""
        deltas: Dict[int, RequestOutput] = {}
        finished: List[int] = []
        self._admit(deltas, finished)
        if finished:
            self._retire(finished)
        if self._rows:
            finished = self._spec_step(deltas)
            if finished:
                self._retire(finished)
        if not self._rows:
            self._t_prev = None
        return list(deltas.values())

    def _emit(self, req: _Req, toks: Sequence[int], deltas: Dict[int, RequestOutput]) -> Tuple[int, bool]:
        """Append tokens up to a stop token / max_new_tokens; returns (count appended, finished)."""
        n = 0
        done = False
        limit = req.params.max_new_tokens
        for t in toks:
            req.new.append(t)
            req.seq.append(t)
            n += 1
            if t in req.stops:
                req.finish = "stop"
                done = True
                break
            if len(req.new) >= limit:
                req.finish = "length"
                done = True
                break
        if n:
            d = deltas.get(req.uid)
            if d is None:
                d = deltas[req.uid] = RequestOutput(req.rid, [])
            d.new_tokens.extend(req.new[len(req.new) - n:])
            d.num_generated = len(req.new)
            if done:
                d.finished = True
                d.finish_reason = req.finish
            self.counters["generated_tokens"] += n
        return n, done

    def _verify(self, tree: TokenTree, logits: torch.Tensor, q: Optional[torch.Tensor], reqs: Sequence[_Req]):
        """Accept per row under each row's own setting (see the module docstring)."""
        b, N = tree.batch, tree.size
        first = reqs[0].sampling
        same = all(r.sampling == first for r in reqs) and not any(r.coupled for r in reqs)
        if same and first.greedy:
            return ops.greedy_verify(tree.tokens, tree.parents, logits)
        if same:
            p = warp_(logits, first)  # [b, N, V], in place on the logits the forward returned
        else:
            p = logits
            groups: Dict[Tuple[SamplingParams, bool], List[int]] = {}
            for r, req in enumerate(reqs):
                groups.setdefault((req.sampling, req.coupled), []).append(r)
            for (sp, coupled), rows in groups.items():
                idx = torch.tensor(rows, dtype=torch.int64, device=self.device)
                part = p.index_select(0, idx)
                if coupled:  # the Gumbel-max draw of every node's position, as a one-hot row
                    warp_(part, sp)
                    part = part.log_().add_(self._gumbel([reqs[r] for r in rows], tree, rows))
                if sp.greedy or coupled:  # one-hot at the argmax (first max; NaN counts as max, like greedy_verify)
                    arg = part.argmax(dim=-1, keepdim=True)
                    part = torch.zeros_like(part).scatter_(-1, arg, 1.0)
                else:
                    warp_(part, sp)
                p.index_copy_(0, idx, part)
        u = self._uniforms(reqs, N)
        return ops.rejection_sample(tree.tokens, tree.parents, p, q, u)

    def _gumbel(self, reqs: Sequence[_Req], tree: TokenTree, rows: Sequence[int]) -> torch.Tensor:
        """[len(rows), N, V] float32 Gumbel noise: node i of a request gets the noise of the sequence position
        it predicts (len(seq) + depth_i), a function of (seed, position) only."""
        N = tree.size
        V = self.vocab_size
        depths = tree.depths.index_select(0, torch.tensor(list(rows), dtype=torch.int64,
                                                          device=tree.depths.device)).tolist()
        out = torch.empty(len(rows), N, V, dtype=torch.float32)
        g = torch.Generator()
        for j, req in enumerate(reqs):
            base = len(req.seq)
            seen: Dict[int, torch.Tensor] = {}
            for i, d in enumerate(depths[j]):
                noise = seen.get(d)
                if noise is None:
                    g.manual_seed(mix_seed(req.params.seed, base + d))
                    u = torch.rand(V, dtype=torch.float64, generator=g).clamp_(min=1e-300)
                    noise = seen[d] = (-torch.log(-torch.log(u))).to(torch.float32)
                out[j, i] = noise
        return out.to(self.device)

    def _uniforms(self, reqs: Sequence[_Req], N: int) -> torch.Tensor:
        """[b, N] float64: each sampled request draws max_nodes uniforms per step from its own generator."""
        M = max(self.max_nodes, N)
        rows = [torch.rand(M, dtype=torch.float64, generator=r.generator) if r.generator is not None
                else torch.zeros(M, dtype=torch.float64) for r in reqs]
        return torch.stack(rows)[:, :N].to(self.device)

    def _step_params(self) -> SamplingParams:
        first = self._rows[0].sampling
        return first if all(r.sampling == first for r in self._rows) else SamplingParams()

    def _admit(self, deltas, finished: List[int]) -> None:
        free = self.max_batch - len(self._rows)
        if free <= 0 or not self._waiting:
            return
        new = [self._waiting.popleft() for _ in range(min(free, len(self._waiting)))]
        b0 = len(self._rows)
        if b0 == 0:  # a busy period starts: ids from 0 (the request index of a generate call), fresh metrics
            self._uid = 0
            if self._auto_recorder:
                self.recorder = MetricsRecorder(0, self.device)
        for req in new:
            req.uid = self._uid
            self._uid += 1
        rows = list(range(b0, b0 + len(new)))
        clock = self.recorder.clock
        c0 = clock.mark()
        try:
            logits0 = self.target.prefill(self.cache, [r.prompt for r in new], rows=rows)   # [n, V]
        except Exception:
            for r in reversed(new):
                self._waiting.appendleft(r)
            raise
        root_tree = TokenTree.root_only(torch.zeros(len(new), dtype=torch.int64, device=self.device))
        _, _, out0 = self._verify(root_tree, logits0.float().view(len(new), 1, -1), None, new)
        clock.add("prefill", c0, clock.mark())
        first = out0[:, 0].tolist()                        # host sync: the first token of each request
        now = time.perf_counter()
        self._rows.extend(new)
        self._roots = torch.cat([self._roots, out0[:, 0].contiguous()])
        for r, req, t in zip(rows, new, first):
            req.t_first = now
            _, done = self._emit(req, [t], deltas)
            if done:
                finished.append(r)
        drafter = self.drafter
        if drafter is not None:
            c0 = clock.mark()
            params = self._step_params()
            if b0 == 0:
                drafter.start([req.prompt for req in self._rows], params, self.draft_generator)
            else:
                drafter.admit(rows, [req.prompt for req in new])
            clock.add("draft_prefill", c0, clock.mark())

    def _propose(self, ctx: StepContext) -> Draft:
        """The drafter's proposal, with failures isolated (see the module docstring)."""
        drafter = self.drafter
        b = len(ctx.request_ids)
        try:
            draft = drafter.propose(ctx)
        except Exception as exc:  # a broken drafter never fails the batch: plain step for every row
            self.counters["drafter_errors"] += 1
            if self.drafter_errors == "raise":
                raise
            log.warning("%s: drafter %s raised %s: %s; plain decoding for this step", self.name,
                        type(drafter).__name__, type(exc).__name__, exc)
            try:
                drafter.cancel()
            except Exception:  # noqa: BLE001 -- a drafter that cannot even cancel stays out of this step
                log.exception("%s: drafter %s failed to cancel", self.name, type(drafter).__name__)
            return Draft(TokenTree.root_only(ctx.roots)), False
        if drafter.trusted:
            return draft, True
        roots = [seq[-1] for seq in ctx.sequences]
        if self.drafter_errors == "raise":
            try:
                check_draft(draft, type(drafter).__name__, ctx.request_ids, self.vocab_size, self.max_nodes, roots)
            except (TypeError, ValueError):
                drafter.cancel()
                raise
            return draft, True
        fatal, bad = draft_errors(draft, type(drafter).__name__, ctx.request_ids, self.vocab_size, self.max_nodes,
                                  roots)
        if fatal is not None:
            self.counters["drafter_errors"] += 1
            log.warning("%s: %s; plain decoding for this step", self.name, fatal)
            drafter.cancel()
            return Draft(TokenTree.root_only(ctx.roots)), False
        if bad:
            self.counters["drafter_errors"] += len(bad)
            for msg in bad.values():
                log.warning("%s: %s; plain decoding for that request this step", self.name, msg)
            draft = _cut_rows(draft, sorted(bad), b, ctx.roots)
        return draft, True

    def _spec_step(self, deltas) -> List[int]:
        rec = self.recorder
        clock = rec.clock
        target, drafter = self.target, self.drafter
        reqs = self._rows
        b = len(reqs)
        uids = [r.uid for r in reqs]
        roots = self._roots
        cache = self._view(b)
        t_prev = self._t_prev if self._t_prev is not None else time.perf_counter()
        c0 = clock.mark()
        behind = None
        pending = getattr(drafter, "pending_catch_up", None) if getattr(self.scheduler, "uses_catch_up", False) else None
        if pending is not None:
            try:  # advisory: a drafter whose report fails (or is malformed) is planned without it
                behind = [max(0, int(x)) for x in pending([len(r.seq) for r in reqs])]
                if len(behind) != b:
                    behind = None
            except Exception:  # noqa: BLE001 - never let an advisory hook take a step (or a server) down
                behind = None
        plan = self.scheduler.plan(uids, [r.params.max_new_tokens - len(r.new) - 1 for r in reqs],
                                   closed=self._closed and not self._waiting, behind=behind)
        consulted = False
        if drafter is None:
            draft = Draft(TokenTree.root_only(roots))
        else:
            ctx = StepContext(roots=roots, sequences=[r.seq for r in reqs], request_ids=uids,
                              budgets=plan.budgets, params=self._step_params())
            draft, consulted = self._propose(ctx)
        catch_up = float(getattr(drafter, "catch_up_seconds", 0.0) or 0.0) if consulted else 0.0
        catch_up_pos = int(getattr(drafter, "catch_up_positions", 0) or 0) if consulted else 0
        tree = draft.tree
        c1 = clock.mark()
        logits = target.forward(cache, tree.tokens, tree.depths, tree.attention_mask())   # [b, N, V]
        if consulted:
            drafter.observe_verify(tree, logits)       # before warp_ (in place); no host sync
        accepted, num, out = self._verify(tree, logits, draft.draft_probs, reqs)
        c2 = clock.mark()
        if tree.size == 1:  # root only (no drafter, or nothing proposed): nothing moves, each row appends one
            cache.lens += 1
        else:
            cache.commit(accepted, num)                # ops.kv_commit; lens += num + 1
        c3 = clock.mark()
        # THE host sync of the step: accepted counts and tokens, to append them and check stops
        host = torch.cat([num.view(b, 1).to(torch.int64), out], dim=1).tolist()
        num_host = [h[0] for h in host]
        c4 = clock.mark()
        if consulted:
            drafter.accept(accepted, num, num_host)    # drafter rollback (kv_commit)
        c5 = clock.mark()
        self._roots = out.gather(1, num.view(b, 1).to(torch.int64)).view(b)   # next roots [b]
        clock.add("draft", c0, c1)
        clock.add("verify", c1, c2)
        clock.add("commit", c2, c3)
        clock.add("commit", c4, c5)

        t_now = time.perf_counter()
        finished = []
        emitted = []
        drafted = tree.num_drafted
        for r, req in enumerate(reqs):
            a = num_host[r]
            n, done = self._emit(req, host[r][1:a + 2], deltas)
            emitted.append(n)
            req.passes += 1
            req.drafted += drafted[r]
            req.accepted += a
            if done:
                finished.append(r)
        self.counters["steps"] += 1
        self.counters["drafted_tokens"] += sum(drafted)
        self.counters["accepted_tokens"] += sum(num_host)
        depths = tree.depth_per_request() if drafter is not None else drafted
        rec.step(uids, drafted, depths, num_host, emitted, t_now - t_prev)
        self.scheduler.observe(plan, uids, tree.size, depths, drafted, num_host, emitted,
                               StepTimes(*clock.split(c0, c1, c2, c3, c4, c5), total=t_now - t_prev,
                                         catch_up=catch_up, catch_up_positions=catch_up_pos))
        self._t_prev = t_now
        if self._auto_recorder and rec.target_passes % 4096 == 0:  # a server that never idles: bounded state
            clock.totals()
            del rec.itl[:-65536]
        return finished

    # ------------------------------------------------------------------ rows
    def _forget(self, req: _Req) -> None:
        self._by_id.pop(req.rid, None)
        if req.uid >= 0:
            self.scheduler.requests.pop(req.uid, None)
        if req.finish != "abort":
            self.counters["requests_finished"] += 1

    def _retire(self, gone_rows: List[int]) -> None:
        """Drop rows: the last active rows move into the holes (target cache, drafter state, roots)."""
        b = len(self._rows)
        gone = set(gone_rows)
        for r in gone:
            self._forget(self._rows[r])
        keep = [r for r in range(b) if r not in gone]
        b_new = len(keep)
        holes = [r for r in range(b_new) if r in gone]
        tail = [r for r in range(b_new, b) if r not in gone]
        moves = [(src, dst, len(self._rows[src].seq)) for src, dst in zip(tail, holes)]
        perm = list(range(b_new))
        rows = list(self._rows)
        for src, dst, _ in moves:
            perm[dst] = src
            rows[dst] = rows[src]
        self._rows = rows[:b_new]
        move_cache_rows(self.cache, moves)
        if self.drafter is not None:
            self.drafter.retire(moves, b_new)
        if b_new == 0:
            self._roots = self._roots[:0]
        elif moves:
            self._roots = self._roots.index_select(0, torch.tensor(perm, dtype=torch.int64, device=self.device))
        else:
            self._roots = self._roots[:b_new]


class QueueFull(RuntimeError):
    """:meth:`Engine.add_request` past ``max_waiting`` waiting requests (a server answers 429)."""


def _cut_rows(draft: Draft, rows: Sequence[int], b: int, roots: torch.Tensor) -> Draft:
    """The proposal with the given rows cut back to their root (padding everywhere else)."""
    tree = draft.tree
    keep = torch.ones(b, dtype=torch.bool, device=tree.tokens.device)
    keep[list(rows)] = False
    node = torch.arange(tree.size, device=tree.tokens.device).view(1, -1)
    real = keep.view(b, 1) | (node == 0)
    parents = torch.where(real, tree.parents, -1).to(torch.int32)
    parents[:, 0] = -1
    cut = set(rows)
    nodes = [1 if r in cut else n for r, n in enumerate(tree.num_nodes)]
    tokens = torch.where(real, tree.tokens, -1)
    tokens[:, 0] = roots
    depths = torch.where(real, tree.depths, 0).to(torch.int32)
    depths[:, 0] = 0
    new = TokenTree(tokens.contiguous(), parents.contiguous(), depths.contiguous(), nodes, is_chain=False)
    return Draft(new, draft.draft_probs)
