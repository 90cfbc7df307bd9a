"""The engine thread behind ``specdec serve``: :class:`EngineLoop` runs an :class:`~specdec.engine.Engine`
in one background thread and hands each request's tokens to its HTTP handler; :class:`Metrics` holds
the Prometheus metrics it keeps up to date."""

import asyncio
import logging
import queue
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Deque, Dict, List, Optional, Tuple

from specdec.engine import Engine, QueueFull, RequestParams
from specdec.serve.openai import APIError

__all__ = ["EngineLoop", "Metrics", "TokenEvent"]

log = logging.getLogger("specdec.server")

_LATENCY_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 1.5, 2.0, 3.0,
                    5.0, 10.0, 30.0)


@dataclass
class _Stream:
    """One request's channel from the engine thread to its handler."""

    loop: asyncio.AbstractEventLoop
    q: asyncio.Queue
    t_submit: float
    t_last: Optional[float] = None
    n_tokens: int = 0


@dataclass
class TokenEvent:
    """What the engine thread sends a handler: new tokens, the end of the request, or an error."""

    tokens: List[int] = field(default_factory=list)
    finished: bool = False
    reason: Optional[str] = None
    error: Optional[str] = None
    status: int = 400          # HTTP status of an error


class Metrics:
    """The server's Prometheus metrics (own registry)."""

    def __init__(self) -> None:
        from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

        r = self.registry = CollectorRegistry()
        self.queue_depth = Gauge("specdec_queue_depth", "requests waiting for a batch row", registry=r)
        self.active = Gauge("specdec_active_requests", "requests in the running batch", registry=r)
        self.tokens_per_second = Gauge("specdec_tokens_per_second", "generated tokens per second over the last "
                                       "10 s", registry=r)
        self.acceptance = Gauge("specdec_acceptance_rate", "accepted / drafted tokens since start", registry=r)
        self.tokens = Counter("specdec_generated_tokens", "generated tokens", registry=r)
        self.drafted = Counter("specdec_drafted_tokens", "drafted tokens", registry=r)
        self.accepted = Counter("specdec_accepted_tokens", "accepted draft tokens", registry=r)
        self.steps = Counter("specdec_engine_steps", "engine steps", registry=r)
        self.drafter_errors = Counter("specdec_drafter_errors", "drafter failures isolated to a plain step",
                                      registry=r)
        self.engine_errors = Counter("specdec_engine_errors", "exceptions inside an engine step", registry=r)
        self.preemptions = Counter("specdec_preemptions", "requests preempted (KV pool full) and recomputed later",
                                   registry=r)
        self.kv_blocks = Gauge("specdec_kv_blocks", "paged KV blocks by state (used: held by requests; free: "
                               "allocatable, cached ones included; cached: holding a reusable prompt prefix)",
                               ["state"], registry=r)
        self.prefix_hit_rate = Gauge("specdec_prefix_cache_hit_rate", "prompt tokens served from cached prefix "
                                     "blocks / prompt tokens admitted", registry=r)
        self.requests = Counter("specdec_requests", "finished requests by outcome", ["outcome"], registry=r)
        self.rejected = Counter("specdec_rejected_requests", "requests refused before admission", ["reason"],
                                registry=r)
        self.ttft = Histogram("specdec_time_to_first_token_seconds", "submission to first token",
                              buckets=_LATENCY_BUCKETS, registry=r)
        self.itl = Histogram("specdec_inter_token_latency_seconds", "time between tokens of a request",
                             buckets=_LATENCY_BUCKETS, registry=r)
        self._window: Deque[Tuple[float, int]] = deque()

    def observe_tokens(self, now: float, n: int) -> None:
        self._window.append((now, n))
        while self._window and self._window[0][0] < now - 10.0:
            self._window.popleft()
        if len(self._window) > 1:
            span = max(1e-9, now - self._window[0][0])
            self.tokens_per_second.set((sum(c for _, c in self._window) - self._window[0][1]) / span)


class EngineLoop:
    """Runs an :class:`Engine` in a background thread; thread-safe ``submit`` / ``abort``."""

    def __init__(self, engine: Engine, max_queue: int = 64, metrics: Optional[Metrics] = None) -> None:
        self.engine = engine
        self.max_queue = int(max_queue)
        self.metrics = metrics or Metrics()
        self._cmds: "queue.Queue[tuple]" = queue.Queue()
        self._streams: Dict[str, _Stream] = {}
        self._lock = threading.Lock()
        self._outstanding = 0          # submitted, not finished (admission control)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="specdec-engine", daemon=True)
        self._last_counters = dict(engine.counters)

    def start(self) -> "EngineLoop":
        self._thread.start()
        return self

    def stop(self, timeout: float = 10.0) -> None:
        self._stop.set()
        self._cmds.put(("wake",))
        self._thread.join(timeout)

    @property
    def outstanding(self) -> int:
        return self._outstanding

    # ---- called from handlers (any thread)
    def submit(self, rid: str, prompt: List[int], params: RequestParams, loop: asyncio.AbstractEventLoop,
               q: asyncio.Queue) -> None:
        with self._lock:
            if self._outstanding >= self.engine.max_batch + self.max_queue:
                self.metrics.rejected.labels("queue_full").inc()
                raise APIError(429, f"the server is at capacity ({self.engine.max_batch} running, {self.max_queue} "
                                    f"queued); retry later", code="queue_full", kind="rate_limit_error")
            self._outstanding += 1
            self._streams[rid] = _Stream(loop, q, time.perf_counter())
        self._cmds.put(("add", rid, prompt, params))

    def abort(self, rid: str, outcome: str = "aborted") -> None:
        """Drop a request (``outcome`` labels it in specdec_requests_total: "aborted", or "stop" for a stop
        string the handler found)."""
        self._cmds.put(("abort", rid, outcome))

    # ---- the engine thread
    def _deliver(self, rid: str, ev: TokenEvent, final: bool) -> None:
        st = self._streams.get(rid)
        if st is None:
            return
        if final:
            with self._lock:
                self._streams.pop(rid, None)
                self._outstanding -= 1
        try:
            st.loop.call_soon_threadsafe(st.q.put_nowait, ev)
        except RuntimeError:  # the handler's loop is closed (server shutting down)
            pass

    def _handle(self, cmd: tuple) -> None:
        eng = self.engine
        if cmd[0] == "add":
            _, rid, prompt, params = cmd
            if rid not in self._streams:   # aborted before it reached the engine
                return
            try:
                eng.add_request(rid, prompt, params)
            except (ValueError, TypeError, QueueFull) as exc:
                self._deliver(rid, TokenEvent(finished=True, reason="error", error=str(exc)), True)
        elif cmd[0] == "abort":
            rid, outcome = cmd[1], cmd[2]
            if rid in self._streams:
                eng.abort(rid)
                self.metrics.requests.labels(outcome).inc()
                self._deliver(rid, TokenEvent(finished=True, reason="abort"), True)

    def _run(self) -> None:
        eng = self.engine
        m = self.metrics
        while not self._stop.is_set():
            try:
                block = not eng.has_unfinished()
                while True:
                    try:
                        cmd = self._cmds.get(block=block, timeout=0.5 if block else None)
                    except queue.Empty:
                        break
                    block = False
                    self._handle(cmd)
                if not eng.has_unfinished():
                    continue
                first = eng.admit()      # first tokens out before the step (time to first token)
                if first:
                    self._dispatch(first)
                self._dispatch(eng.step())
            except Exception:  # noqa: BLE001 -- nothing may stop the engine thread
                log.exception("specdec serve: engine step failed; failing its requests")
                m.engine_errors.inc()
                for rid in list(self._streams):
                    eng.abort(rid)
                    self._deliver(rid, TokenEvent(finished=True, reason="error",
                                              error="internal error in the engine step", status=500), True)
                continue

    def _dispatch(self, deltas) -> None:
        m = self.metrics
        now = time.perf_counter()
        n_new = 0
        for d in deltas:
            st = self._streams.get(d.request_id)
            if st is None:
                continue
            n = len(d.new_tokens)
            n_new += n
            if n:
                if st.t_last is None:
                    m.ttft.observe(now - st.t_submit)
                    if n > 1:
                        for _ in range(n - 1):
                            m.itl.observe(0.0)
                else:
                    per = (now - st.t_last) / n
                    for _ in range(n):
                        m.itl.observe(per)
                st.t_last = now
                st.n_tokens += n
            if d.finished:
                m.requests.labels(d.finish_reason or "stop").inc()
            self._deliver(d.request_id, TokenEvent(list(d.new_tokens), d.finished, d.finish_reason), d.finished)
        self._update_gauges(now, n_new)

    def _update_gauges(self, now: float, n_new: int) -> None:
        eng, m = self.engine, self.metrics
        c = eng.counters
        last = self._last_counters
        m.tokens.inc(c["generated_tokens"] - last["generated_tokens"])
        m.drafted.inc(c["drafted_tokens"] - last["drafted_tokens"])
        m.accepted.inc(c["accepted_tokens"] - last["accepted_tokens"])
        m.steps.inc(c["steps"] - last["steps"])
        m.drafter_errors.inc(c["drafter_errors"] - last["drafter_errors"])
        m.preemptions.inc(c["preemptions"] - last["preemptions"])
        if eng.kv.paged:
            kv = eng.kv.stats()
            for state in ("used", "free", "cached"):
                m.kv_blocks.labels(state).set(kv[f"kv_blocks_{state}"])
            m.prefix_hit_rate.set(kv["prefix_cache_hit_rate"])
        self._last_counters = dict(c)
        m.queue_depth.set(eng.num_waiting + self._cmds.qsize())
        m.active.set(eng.num_active)
        m.acceptance.set(c["accepted_tokens"] / c["drafted_tokens"] if c["drafted_tokens"] else 0.0)
        m.observe_tokens(now, n_new)
