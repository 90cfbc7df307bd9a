"""Engine: continuous batching with a step API (the serving building block).

::

    eng = specdec.Engine(target, drafter, max_batch=8, max_len=2048)
    eng.add_request("a", prompt_ids, RequestParams(max_new_tokens=64, temperature=0.7, seed=1))
    while eng.has_unfinished():
        for delta in eng.step():          # RequestOutput per request that moved this step
            print(delta.request_id, delta.new_tokens, delta.finished, delta.finish_reason)

One :meth:`Engine.step` admits waiting requests into free cache rows (prefilled together, their
first token drawn like a plain step), runs one speculative step over every active row (each row
accepting its own count) and retires finished rows: the last active row moves into each hole
(target cache, drafter state). :meth:`abort` does the same between steps. docs/serving.md has more.

Rows of one batch may carry different sampling settings, and a request with a ``seed`` is
seed-coupled (its tokens equal plain seeded sampling whatever the drafter and the batch):
:func:`specdec.sampling.verify_rows` decides every row under its own setting; docs/design.md
explains both.

Failure isolation (:mod:`specdec.drafters.guard`): a drafter that raises, or proposes an invalid
tree, costs the rows concerned one plain step, is logged and counted (``stats()["drafter_errors"]``);
the batch never fails for it.
"""
from __future__ import annotations

import functools
import time
from collections import deque
from contextlib import contextmanager
from typing import Deque, Dict, Hashable, Iterator, List, Optional, Sequence, Tuple, Union

import torch

from specdec import ops
from specdec._check import check_token_ids, is_int
from specdec.drafters.base import Draft, Drafter, StepContext
from specdec.drafters.guard import DraftGuard
from specdec.engine_rows import EngineRows
from specdec.kv_rows import make_rows
from specdec.lazy_verify import LazyGreedyVerify
from specdec.metrics import MetricsRecorder, static_memory_bytes
from specdec.request import QueueFull, Request, RequestOutput, RequestParams
from specdec.sampling import make_generator
from specdec.scheduler import POLICIES, CostModel, Policy, make_policy
from specdec.telemetry import StepRecord, StepTimes
from specdec.tree import TokenTree

__all__ = ["Engine", "RequestParams", "RequestOutput", "QueueFull"]


class Engine(EngineRows):
    """Continuous-batching speculative decoding of ``target`` with ``drafter`` (None: plain decoding).

    Parameters as :class:`~specdec.SpeculativeDecoder` (``max_batch``: most active requests;
    ``max_len``: most tokens per request, prompt + new tokens; ``policy``: "goodput" (default),
    "heuristic", "fixed" or a :class:`specdec.scheduler.Policy`). ``max_waiting`` bounds the queue
    of requests not yet admitted (None: unbounded); :meth:`add_request` raises :class:`QueueFull`
    past it. ``draft_seed`` seeds the drafter's generator (sampled draft models). ``drafter_errors``:
    "fallback" (default: a drafter failure costs its rows one plain step) or "raise" (it propagates).

    KV memory (docs/serving.md): ``kv_cache`` "paged" (the default for targets that support it:
    a pool of ``block_size``-position blocks, admission by free blocks, growth by blocks, automatic
    prefix caching unless ``prefix_caching=False``, the newest request preempted and recomputed
    later when the pool runs out) or "dense" (``max_batch`` rows of ``max_len`` positions reserved
    up front). The pool: ``num_blocks``, or ``kv_memory`` bytes, default the dense footprint.
    """

    def __init__(self, target, drafter: Optional[Drafter] = None, max_batch: int = 8, max_len: int = 2048,
                 policy: Union[str, Policy] = "goodput", max_waiting: Optional[int] = None,
                 draft_seed: Optional[int] = None, drafter_errors: str = "fallback", kv_cache: Optional[str] = None,
                 block_size: int = 16, num_blocks: Optional[int] = None, kv_memory: Optional[float] = None,
                 prefix_caching: bool = True, _name: str = "Engine") -> None:
        self._check_args(name := _name, target, drafter, max_batch, max_len, policy, max_waiting, drafter_errors)
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
        self.max_nodes = drafter.max_nodes if drafter is not None else 1
        # a draft model's K/V goes into the target's pool where both run paged (specdec.draft_pages)
        draft = drafter.paged_draft(block_size) if drafter is not None and not drafter.changes_target and \
            kv_cache != "dense" and getattr(target, "supports_paged", False) else None
        if drafter is not None and draft is None:
            drafter.attach_pages(None)
            drafter.bind(target, max_batch, max_len)  # vocabulary / device checks; may change the target
        reserve = self.max_nodes if draft is None else max(self.max_nodes, draft[1])
        #: the target's KV rows (specdec.kv_rows): dense, or paged with prefix caching
        self.kv = make_rows(target, kv_cache, max_batch, max_len + reserve, reserve, block_size, num_blocks,
                            kv_memory, prefix_caching, name, draft_bytes_per_block=0 if draft is None else draft[0])
        if draft is not None:
            drafter.attach_pages(self.kv.cache if self.kv.paged else None)
            drafter.bind(target, max_batch, max_len)
        self.cache = self.kv.view(max_batch) if self.kv.paged else self.kv.cache
        self._view = self.kv.view
        #: the step policy (specdec.scheduler); its cost model persists for the engine's life
        self.scheduler: Policy = make_policy(policy if drafter is not None else "fixed", drafter, CostModel())
        self.scheduler.begin(0, False)
        #: weights (target + draft model) + KV caches, for the peak-memory metric
        self.static_memory_bytes = static_memory_bytes(target, drafter, [self.cache, getattr(drafter, "cache", None)])
        self.draft_generator = make_generator(draft_seed, self.device)
        self.recorder = MetricsRecorder(0, self.device)
        self._waiting: Deque[Request] = deque()
        self._closed = False                          # inside closed_batch()
        self._rows: List[Request] = []                # active requests in row order
        self._by_id: Dict[Hashable, Request] = {}     # waiting + active
        self._roots = torch.zeros(0, dtype=torch.int64, device=self.device)
        self._uid = 0
        self._auto_recorder = True                    # a fresh MetricsRecorder per busy period
        self._t_prev: Optional[float] = None
        self.counters = dict(requests_added=0, requests_finished=0, requests_aborted=0, steps=0,
                             generated_tokens=0, drafted_tokens=0, accepted_tokens=0, drafter_errors=0, preemptions=0)
        self._guard = DraftGuard(name, drafter_errors, self.vocab_size, self.max_nodes, self.counters)
        #: greedy steps verified with the LM head along the accepted path (where _greedy_rows and its plan allow)
        self.lazy_verify = LazyGreedyVerify()
        self._zeros: Dict[int, Tuple[torch.Tensor, torch.Tensor]] = {}   # _root_only's tensors per batch size

    @staticmethod
    def _check_args(name, target, drafter, max_batch, max_len, policy, max_waiting, drafter_errors) -> None:
        for arg, v in (("max_batch", max_batch), ("max_len", max_len)):
            if not is_int(v):
                raise TypeError(f"{name}: {arg} must be an int, got {type(v).__name__}")
            if v < 1:
                raise ValueError(f"{name}: {arg} must be >= 1, got {v}")
        if max_waiting is not None and (not is_int(max_waiting) or max_waiting < 0):
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

    def __repr__(self) -> str:
        return (f"{self.name}(drafter={self.drafter!r}, max_batch={self.max_batch}, max_len={self.max_len}, "
                f"policy={self.policy!r})")

    # ------------------------------------------------------------------ requests
    def add_request(self, request_id: Hashable, prompt_ids: Sequence[int],
                    params: Optional[RequestParams] = None, generator: Optional[torch.Generator] = None) -> None:
        """Queue a request; it joins the batch at the next step boundary with a free row.

        ``generator``: a CPU torch.Generator the rejection sampler of a sampled request draws from
        (default: a fresh one, or seed coupling when ``params.seed`` is set).

        Raises (nothing changes then): ValueError for a duplicate ``request_id``, an empty prompt,
        out-of-vocabulary ids or ``len(prompt) + max_new_tokens > max_len``; TypeError for non-int
        ids; :class:`QueueFull` when ``max_waiting`` requests already wait."""
        params = RequestParams() if params is None else params
        if not isinstance(params, RequestParams):
            raise TypeError(f"{self.name}.add_request: params must be a specdec.RequestParams, "
                            f"got {type(params).__name__}")
        if request_id in self._by_id:
            raise ValueError(f"{self.name}.add_request: request {request_id!r} is already in the engine")
        prompt = check_token_ids(f"{self.name}.add_request: request {request_id!r}", prompt_ids, self.vocab_size)
        need = len(prompt) + params.max_new_tokens
        if need > self.max_len:
            raise ValueError(f"{self.name}.add_request: request {request_id!r} has a prompt of {len(prompt)} tokens; "
                             f"with max_new_tokens={params.max_new_tokens} it needs {need} > max_len={self.max_len} "
                             f"positions")
        if self.max_waiting is not None and len(self._waiting) >= self.max_waiting:
            raise QueueFull(f"{self.name}.add_request: {len(self._waiting)} requests already wait "
                            f"(max_waiting={self.max_waiting})")
        sampling = params.sampling
        gen = None
        coupled = False
        if not sampling.greedy:
            if generator is None and params.seed is not None:
                coupled = True
            else:
                gen = generator if generator is not None else make_generator(params.seed, "cpu")
        req = Request(request_id, -1, prompt, params, sampling, frozenset(params.stop_token_ids), gen, coupled,
                      seq=list(prompt), t_arrival=time.perf_counter())
        self._waiting.append(req)
        self._by_id[request_id] = req
        self.counters["requests_added"] += 1

    @contextmanager
    def closed_batch(self, recorder: MetricsRecorder, draft_generator: torch.Generator) -> Iterator["Engine"]:
        """A static batch (``SpeculativeDecoder.generate``): nothing joins after the requests added in the
        block, so the policy plans for the slowest row; ``recorder`` collects the metrics, ``draft_generator``
        seeds the drafter; what is unfinished when the block exits is aborted."""
        if self.has_unfinished():
            raise RuntimeError(f"{self.name}.closed_batch: the engine holds requests (step them to completion "
                               f"or abort them first)")
        self.recorder = recorder
        self.draft_generator = draft_generator
        self._auto_recorder = False
        self._closed = True
        try:
            yield self
        finally:
            if self.has_unfinished():
                self.abort_all()
            self._auto_recorder = True
            self._closed = False

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
        out.update(self.kv.stats())
        d = out["drafted_tokens"]
        out["acceptance_rate"] = out["accepted_tokens"] / d if d else 0.0
        return out

    # ------------------------------------------------------------------ the step
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
        self._make_room()
        if self._rows:
            finished = self._spec_step(deltas)
            if finished:
                self._retire(finished)
        if not self._rows:
            self._t_prev = None
        return list(deltas.values())

    def _plan(self, reqs: Sequence[Request], uids: List[int]):
        """The policy's plan for this step (draft budgets per row)."""
        behind = None
        if self.drafter is not None and self.scheduler.uses_catch_up:
            try:  # advisory: a drafter whose report fails (or is malformed) is planned without it
                behind = [max(0, int(x)) for x in self.drafter.pending_catch_up([len(r.seq) for r in reqs])]
                if len(behind) != len(reqs):
                    behind = None
            except Exception:  # noqa: BLE001 - never let an advisory hook take a step (or a server) down
                behind = None
        budgets = [r.params.max_new_tokens - len(r.new) - 1 for r in reqs]
        if self.drafter is not None:
            try:  # advisory: rows the drafter has nothing for are plain steps (no depths weighed for them)
                has = self.drafter.has_proposals(uids, [r.seq for r in reqs])
                if has is not None and len(has) == len(reqs):
                    budgets = [x if h else 0 for x, h in zip(budgets, has)]
            except Exception:  # noqa: BLE001 - never let an advisory hook take a step (or a server) down
                pass
        return self.scheduler.plan(uids, budgets, closed=self._closed and not self._waiting, behind=behind)

    def _step_costs(self, b: int):
        """The cost model's seconds of a step of b rows without drafting, by nodes per row (None until it
        has seen a plain step; a policy's duck-typed cost model may not say)."""
        cost = getattr(self.scheduler, "cost", None)
        knows = getattr(cost, "knows_plain", None)
        if knows is None or not hasattr(cost, "step_seconds") or not knows():
            return None
        return functools.partial(cost.step_seconds, b, 0)

    def _spec_step(self, deltas) -> List[int]:
        """plan -> propose -> verify -> commit -> emit over every active row; returns the finished rows."""
        clock = self.recorder.clock
        clock.begin_step()
        drafter, reqs = self.drafter, self._rows
        b = len(reqs)
        uids = [r.uid for r in reqs]
        cache = self._view(b)
        t_prev = self._t_prev if self._t_prev is not None else time.perf_counter()
        consulted = False
        with clock.phase("draft"):
            plan = self._plan(reqs, uids)
            if drafter is None:
                draft = Draft(TokenTree.root_only(self._roots))
            else:
                ctx = StepContext(roots=self._roots, sequences=[r.seq for r in reqs], request_ids=uids,
                                  budgets=plan.budgets, params=self._step_params(), step_seconds=self._step_costs(b))
                draft, consulted = self._guard.propose(drafter, ctx)
        tree = draft.tree
        with clock.phase("verify"):
            # greedy rows and a target whose head runs on any rows: the lazy walk where its plan expects a saving
            # (trees of <= 64 rows in all), else the head's argmax op (a plain step, or a tree verified whole)
            rows_greedy = self._greedy_rows(reqs, consulted)
            greedy = rows_greedy and tree.size > 1 and getattr(self.target, "lazy_head", False)
            chunk = self.lazy_verify.plan(uids, tree.size) if greedy else None
            argmax = rows_greedy and chunk is None and getattr(self.target, "greedy_head", False)
            plain = argmax and tree.size == 1
            if plain:  # a greedy plain step: the head's argmax op, no logits and no verification op
                out = self.target.forward_argmax(cache, tree.tokens, tree.depths)   # [b, 1]
                accepted = num = None
            elif argmax:  # a greedy tree verified whole: the argmax at every node, walked by the op
                best = self.target.forward_argmax(cache, tree.tokens, tree.depths, tree.attention_mask())
                accepted, num, out = ops.greedy_verify(tree.tokens, tree.parents, best)
            elif chunk is not None:   # greedy: the LM head along the accepted path only
                accepted, num, out = self.lazy_verify(self.target, cache, tree, uids, chunk)
            else:
                logits = self.target.forward(cache, tree.tokens, tree.depths, tree.attention_mask())   # [b, N, V]
                if consulted:
                    drafter.observe_verify(tree, logits)       # before warping (in place); no host sync
                accepted, num, out = self._verify(tree, logits, draft.draft_probs, reqs)
        with clock.phase("commit"):
            if tree.size == 1:  # root only (no drafter, or nothing proposed): nothing moves, each row appends one
                cache.lens += 1
            else:
                cache.commit(accepted, num)                # ops.kv_commit; lens += num + 1
        # THE host sync of the step: accepted counts and tokens, to append them and check stops (on the CPU two
        # host reads: each tensor operation right after the target's forward costs several times its warm price)
        if plain:
            host = [[0, t] for t in out.view(b).tolist()]
        elif out.device.type == "cpu":
            host = [[n] + o for n, o in zip(num.tolist(), out.tolist())]
        else:
            host = torch.cat([num.view(b, 1).to(torch.int64), out], dim=1).tolist()
        clock.synced()
        num_host = [h[0] for h in host]
        if greedy and chunk is None:  # the paths the lazy head's plan learns from
            self.lazy_verify.observe(uids, num_host)
        if consulted:
            if plain:  # nothing was drafted: every row accepted the root alone (zeros kept per batch size)
                accepted, num = self._root_only(b)
            with clock.phase("commit"):
                drafter.accept(accepted, num, num_host)    # drafter rollback (kv_commit)
        if plain:
            self._roots = out.view(b)
        elif out.device.type == "cpu":  # next roots [b], from the host values
            self._roots = torch.tensor([h[1 + h[0]] for h in host], dtype=torch.int64)
        else:
            self._roots = out.gather(1, num.view(b, 1).to(torch.int64)).view(b)
        t_now = time.perf_counter()
        drafted = tree.num_drafted
        emitted, finished = self._emit_step(reqs, host, drafted, deltas)
        phases = clock.step_seconds()
        times = StepTimes(phases.get("draft", 0.0), phases.get("verify", 0.0), phases.get("commit", 0.0),
                          total=t_now - t_prev,
                          catch_up=float(drafter.catch_up_seconds or 0.0) if consulted else 0.0,
                          catch_up_positions=int(drafter.catch_up_positions or 0) if consulted else 0)
        self._observe(StepRecord(uids, plan, tree.size, drafted,
                                 tree.depth_per_request() if drafter is not None else drafted,
                                 num_host, emitted, times))
        self._t_prev = t_now
        return finished

    def _greedy_rows(self, reqs: Sequence[Request], consulted: bool) -> bool:
        """Whether the step's verification needs only the target's argmax at each node: every row greedy and
        uncoupled, and no drafter reading the logits of every node (``observe_verify``). Then
        :class:`~specdec.lazy_verify.LazyGreedyVerify` may run the head along the accepted path
        (``HFCausalLM.lazy_head``), or the head's argmax op every node (``HFCausalLM.greedy_head``)."""
        return not (consulted and self.drafter.reads_verify_logits) and \
            all(r.sampling.greedy and r.coupling is None for r in reqs)

    def _root_only(self, b: int) -> Tuple[torch.Tensor, torch.Tensor]:
        """(accepted [b, 1], num_accepted [b]) int32 zeros of a root-only step, made once per batch size (a
        drafter's accept reads them)."""
        z = self._zeros.get(b)
        if z is None:
            z = self._zeros[b] = (torch.zeros(b, 1, dtype=torch.int32), torch.zeros(b, dtype=torch.int32))
        return z

    def _emit_step(self, reqs: Sequence[Request], host: List[List[int]], drafted: Sequence[int],
                   deltas) -> Tuple[List[int], List[int]]:
        """Append each row's accepted tokens and its drawn token; returns (emitted per row, finished rows)."""
        finished, emitted = [], []
        for r, req in enumerate(reqs):
            a = host[r][0]
            n, done = self._emit(req, host[r][1:a + 2], deltas)
            emitted.append(n)
            req.passes += 1
            req.drafted += drafted[r]
            req.accepted += a
            if done:
                finished.append(r)
        return emitted, finished

    def _observe(self, step: StepRecord) -> None:
        """The step's one record, read by the engine's counters, the metrics recorder and the policy."""
        self.counters["steps"] += 1
        self.counters["drafted_tokens"] += sum(step.drafted)
        self.counters["accepted_tokens"] += sum(step.accepted)
        rec = self.recorder
        rec.observe(step)
        self.scheduler.observe_step(step)
        if self._auto_recorder and rec.target_passes % 4096 == 0:  # a server that never idles: bounded state
            rec.clock.totals()
            del rec.itl[:-65536]
