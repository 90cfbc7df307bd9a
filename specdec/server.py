"""``specdec serve``: an OpenAI-compatible HTTP server over :class:`specdec.Engine`.

Endpoints: ``POST /v1/completions``, ``POST /v1/chat/completions`` (both with ``stream=true`` as
server-sent events, ``data: {chunk}`` ... ``data: [DONE]``), ``GET /v1/models``, ``GET /health``,
``GET /metrics`` (Prometheus text format).

Threads: the engine runs in ONE background thread (:class:`EngineLoop`); HTTP handlers (asyncio)
reach it through a bounded command queue and get tokens back through a per-request asyncio queue
(``loop.call_soon_threadsafe``). The loop drains commands between steps, so requests join at step
boundaries and aborts take effect before the next step.

Admission control: at most ``max_batch`` requests run and ``max_queue`` wait; one more gets HTTP
429. Bad requests get HTTP 400 with an OpenAI-style body ``{"error": {"message", "type",
"param", "code"}}``: malformed JSON, an unknown model, an empty prompt, ``max_tokens`` past
``max_len`` (prompt included), a negative temperature, top_p outside (0, 1], n != 1, unknown
roles, ... A client that disconnects (streaming or not) aborts its request: its cache rows are
free at the next step boundary. A drafter failure costs the requests concerned one plain step
(:mod:`specdec.engine`, counted in ``specdec_drafter_errors_total``). An exception inside a step
(it should not happen) fails the requests of that step with HTTP 500, is logged and counted,
and the engine goes on with an empty batch; nothing stops the server.

Sampling defaults follow OpenAI's API: ``temperature`` 1.0, ``top_p`` 1.0, ``max_tokens`` 16
(completions) / up to ``max_len`` (chat). ``top_k`` (0 = off) and ``seed`` are accepted too.
``stop`` strings end the text before the stop string (finish_reason "stop"); the tokenizer's EOS
always stops. ``stream_options``: ``include_usage`` (OpenAI: a last chunk with the usage) and
``continuous_usage_stats`` (vLLM's extension: the running usage in every chunk, so a client can
tell how many tokens each chunk carries -- a speculative step emits several).
"""

import asyncio
import json
import logging
import queue
import threading
import time
import uuid
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Deque, Dict, List, Optional, Sequence, Tuple

from specdec.engine import Engine, QueueFull, RequestParams

__all__ = ["EngineLoop", "build_app", "serve", "ServerThread"]

log = logging.getLogger("specdec.server")

_LATENCY_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 1.5, 2.0, 3.0,
                    5.0, 10.0, 30.0)


class APIError(Exception):
    def __init__(self, status: int, message: str, param: Optional[str] = None, code: Optional[str] = None,
                 kind: str = "invalid_request_error") -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.kind = status, message, param, code, kind

    def body(self) -> Dict[str, Any]:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}


@dataclass
class _Stream:
    """One request's channel from the engine thread to its handler."""

    loop: asyncio.AbstractEventLoop
    q: asyncio.Queue
    t_submit: float
    t_last: Optional[float] = None
    n_tokens: int = 0


@dataclass
class _Event:
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
    def _deliver(self, rid: str, ev: _Event, final: bool) -> None:
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
                self._deliver(rid, _Event(finished=True, reason="error", error=str(exc)), True)
        elif cmd[0] == "abort":
            rid, outcome = cmd[1], cmd[2]
            if rid in self._streams:
                eng.abort(rid)
                self.metrics.requests.labels(outcome).inc()
                self._deliver(rid, _Event(finished=True, reason="abort"), True)

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
                    self._deliver(rid, _Event(finished=True, reason="error",
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
            self._deliver(d.request_id, _Event(list(d.new_tokens), d.finished, d.finish_reason), d.finished)
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
        self._last_counters = dict(c)
        m.queue_depth.set(eng.num_waiting + self._cmds.qsize())
        m.active.set(eng.num_active)
        m.acceptance.set(c["accepted_tokens"] / c["drafted_tokens"] if c["drafted_tokens"] else 0.0)
        m.observe_tokens(now, n_new)


# ---------------------------------------------------------------------- request parsing
def _number(body: Dict[str, Any], name: str, default, kind, lo=None, hi=None, lo_open=False):
    v = body.get(name, default)
    if v is None:
        v = default
    if isinstance(v, bool) or not isinstance(v, (int, float)) or (kind is int and not isinstance(v, int)):
        raise APIError(400, f"'{name}' must be {'an integer' if kind is int else 'a number'}, got {v!r}", param=name)
    if lo is not None and (v <= lo if lo_open else v < lo):
        raise APIError(400, f"'{name}' must be {'>' if lo_open else '>='} {lo}, got {v}", param=name)
    if hi is not None and v > hi:
        raise APIError(400, f"'{name}' must be <= {hi}, got {v}", param=name)
    return kind(v)


@dataclass
class _Parsed:
    prompt_ids: List[int]
    params: RequestParams
    stop: List[str]
    stream: bool
    include_usage: bool
    continuous_usage: bool = False


class Server:
    """The HTTP layer: tokenization, validation, streaming, disconnects."""

    def __init__(self, loop_: EngineLoop, tokenizer, model_name: str) -> None:
        self.loop = loop_
        self.tok = tokenizer
        self.model_name = model_name
        self.eos = tokenizer.eos_token_id
        self.max_len = loop_.engine.max_len
        self.vocab = loop_.engine.vocab_size

    def _common(self, body: Dict[str, Any], prompt_ids: List[int], chat: bool) -> _Parsed:
        model = body.get("model")
        if model is not None and model != self.model_name:
            raise APIError(400, f"the model '{model}' does not exist; this server serves '{self.model_name}'",
                           param="model", code="model_not_found")
        if not prompt_ids:
            raise APIError(400, "the prompt is empty (it must hold at least one token)", param="prompt")
        if len(prompt_ids) >= self.max_len:
            raise APIError(400, f"the prompt has {len(prompt_ids)} tokens; this server's max_len is {self.max_len} "
                                f"(prompt + completion)", param="messages" if chat else "prompt",
                           code="context_length_exceeded")
        n = body.get("n", 1)
        if n != 1:
            raise APIError(400, f"'n' must be 1 (one completion per request), got {n!r}", param="n")
        room = self.max_len - len(prompt_ids)
        names = ("max_completion_tokens", "max_tokens") if chat else ("max_tokens",)
        given = next((k for k in names if body.get(k) is not None), None)
        if given is None:
            max_tokens = room if chat else min(16, room)
        else:
            max_tokens = _number(body, given, None, int, lo=1)
            if max_tokens > room:
                raise APIError(400, f"'{given}' = {max_tokens} with a prompt of {len(prompt_ids)} tokens needs "
                                    f"{len(prompt_ids) + max_tokens} > max_len = {self.max_len} positions",
                               param=given, code="context_length_exceeded")
        temperature = _number(body, "temperature", 1.0, float, lo=0.0)
        if temperature > 100:
            raise APIError(400, f"'temperature' must be <= 100, got {temperature}", param="temperature")
        top_p = _number(body, "top_p", 1.0, float, lo=0.0, hi=1.0, lo_open=True)
        top_k = _number(body, "top_k", 0, int, lo=0)
        seed = body.get("seed")
        if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
            raise APIError(400, f"'seed' must be an integer, got {seed!r}", param="seed")
        stop = body.get("stop")
        if stop is None:
            stop = []
        elif isinstance(stop, str):
            stop = [stop]
        elif not (isinstance(stop, list) and all(isinstance(s, str) for s in stop)) or len(stop) > 4:
            raise APIError(400, "'stop' must be a string or a list of at most 4 strings", param="stop")
        stop = [s for s in stop if s]
        stream = body.get("stream", False)
        if not isinstance(stream, bool):
            raise APIError(400, f"'stream' must be a boolean, got {stream!r}", param="stream")
        opts = body.get("stream_options") or {}
        if not isinstance(opts, dict):
            raise APIError(400, "'stream_options' must be an object", param="stream_options")
        stops = (self.eos,) if self.eos is not None else ()
        params = RequestParams(max_new_tokens=max_tokens, temperature=temperature, top_k=top_k, top_p=top_p,
                               seed=seed, stop_token_ids=stops)
        return _Parsed(prompt_ids, params, stop, stream, bool(opts.get("include_usage", False)),
                       bool(opts.get("continuous_usage_stats", False)))

    def parse_completion(self, body: Dict[str, Any]) -> _Parsed:
        if "prompt" not in body:
            raise APIError(400, "'prompt' is required", param="prompt")
        p = body["prompt"]
        if isinstance(p, list) and len(p) == 1 and isinstance(p[0], (str, list)):
            p = p[0]   # a batch of one
        if isinstance(p, str):
            ids = list(self.tok(p, add_special_tokens=False)["input_ids"]) if p else []
        elif isinstance(p, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in p):
            bad = [t for t in p if not 0 <= t < self.vocab]
            if bad:
                raise APIError(400, f"prompt token {bad[0]} is outside the vocabulary [0, {self.vocab})",
                               param="prompt")
            ids = list(p)
        else:
            raise APIError(400, "'prompt' must be a string or a list of token ids (one prompt per request)",
                           param="prompt")
        return self._common(body, ids, chat=False)

    def parse_chat(self, body: Dict[str, Any]) -> _Parsed:
        msgs = body.get("messages")
        if not isinstance(msgs, list) or not msgs:
            raise APIError(400, "'messages' must be a non-empty list of {role, content} objects", param="messages")
        conv = []
        for i, mm in enumerate(msgs):
            if not isinstance(mm, dict) or mm.get("role") not in ("system", "user", "assistant", "developer"):
                raise APIError(400, f"messages[{i}] must be an object with a role in system / user / assistant",
                               param="messages")
            content = mm.get("content")
            if isinstance(content, list):  # content parts: text only
                if not all(isinstance(c, dict) and c.get("type") == "text" for c in content):
                    raise APIError(400, f"messages[{i}].content: only text parts are supported", param="messages")
                content = "".join(c.get("text", "") for c in content)
            if not isinstance(content, str):
                raise APIError(400, f"messages[{i}].content must be a string", param="messages")
            role = "system" if mm["role"] == "developer" else mm["role"]
            conv.append({"role": role, "content": content})
        if all(not c["content"] for c in conv):
            raise APIError(400, "the messages hold no text", param="messages")
        ids = self.tok.apply_chat_template(conv, add_generation_prompt=True, tokenize=True)
        if isinstance(ids, dict) or hasattr(ids, "keys"):
            ids = ids["input_ids"]
        return self._common(body, list(ids), chat=True)

    # ---- running one request
    async def events(self, parsed: _Parsed, is_disconnected):
        """Yields (text delta, finish_reason or None, completion token count) until the request ends."""
        rid = uuid.uuid4().hex
        loop = asyncio.get_running_loop()
        q: asyncio.Queue = asyncio.Queue()
        self.loop.submit(rid, parsed.prompt_ids, parsed.params, loop, q)
        ids: List[int] = []
        sent = ""
        done = False
        checked = time.perf_counter()
        try:
            while True:
                try:
                    ev: _Event = await asyncio.wait_for(q.get(), timeout=0.25)
                except asyncio.TimeoutError:
                    ev = None
                now = time.perf_counter()
                if ev is None or now - checked > 0.25:   # poll the client even while tokens flow
                    checked = now
                    if await is_disconnected():
                        return
                    if ev is None:
                        continue
                if ev.error is not None:
                    done = True
                    raise APIError(ev.status, ev.error,
                                   kind="invalid_request_error" if ev.status == 400 else "server_error")
                ids += ev.tokens
                text = self.tok.decode(ids, skip_special_tokens=True)
                reason = None
                if ev.finished:
                    done = True
                    reason = {"stop": "stop", "length": "length"}.get(ev.reason, ev.reason)
                cut = _find_stop(text, parsed.stop, len(sent))
                if cut is not None:
                    text = text[:cut]
                    reason = "stop"
                    if not done:
                        self.loop.abort(rid, outcome="stop")
                        done = True
                if reason is None and text.endswith("\ufffd"):
                    continue   # an incomplete multi-byte character: wait for the rest
                if reason is None and parsed.stop:  # hold back a tail that may start a stop string
                    hold = max(len(s) for s in parsed.stop) - 1
                    safe = max(len(sent), len(text) - hold)
                    delta, sent = text[len(sent):safe], text[:safe]
                else:
                    delta, sent = text[len(sent):], text
                if delta or reason is not None:
                    yield delta, reason, len(ids)
                if reason is not None:
                    return
        finally:
            if not done:
                self.loop.abort(rid)   # the client went away (or the handler was cancelled)


def _find_stop(text: str, stops: Sequence[str], start: int) -> Optional[int]:
    """Index of the earliest stop string in text that ends at or after ``start`` (None: none)."""
    best = None
    for s in stops:
        i = text.find(s, max(0, start - len(s) + 1))
        if i >= 0 and (best is None or i < best):
            best = i
    return best


def build_app(loop_: EngineLoop, tokenizer, model_name: str):
    """The FastAPI application (the engine loop must be started by the caller)."""
    from fastapi import FastAPI, Request
    from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
    from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

    srv = Server(loop_, tokenizer, model_name)
    app = FastAPI(title="specdec", docs_url=None, redoc_url=None)
    app.state.server = srv

    def err(e: APIError):
        return JSONResponse(e.body(), status_code=e.status)

    async def body_of(request: Request) -> Dict[str, Any]:
        raw = await request.body()
        try:
            body = json.loads(raw)
        except (ValueError, UnicodeDecodeError) as exc:
            raise APIError(400, f"the request body is not valid JSON: {exc}") from None
        if not isinstance(body, dict):
            raise APIError(400, "the request body must be a JSON object")
        return body

    @app.get("/health")
    async def health():
        return {"status": "ok", "active": loop_.engine.num_active, "waiting": loop_.engine.num_waiting,
                "outstanding": loop_.outstanding}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": model_name, "object": "model", "created": 0,
                                            "owned_by": "specdec", "max_model_len": srv.max_len}]}

    @app.get("/metrics")
    async def metrics():
        return PlainTextResponse(generate_latest(loop_.metrics.registry).decode(), media_type=CONTENT_TYPE_LATEST)

    async def run(request: Request, chat: bool):
        try:
            body = await body_of(request)
            parsed = srv.parse_chat(body) if chat else srv.parse_completion(body)
        except APIError as e:
            loop_.metrics.rejected.labels("bad_request").inc()
            return err(e)
        cid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]
        created = int(time.time())
        obj = "chat.completion" if chat else "text_completion"
        n_prompt = len(parsed.prompt_ids)

        def usage(n):
            return {"prompt_tokens": n_prompt, "completion_tokens": n, "total_tokens": n_prompt + n}

        gen = srv.events(parsed, request.is_disconnected)
        if not parsed.stream:
            text, reason, n = "", None, 0
            try:
                async for delta, r, n in gen:
                    text += delta
                    reason = r
            except APIError as e:
                return err(e)
            if reason is None:   # the client disconnected: nobody reads this
                return JSONResponse({}, status_code=499)
            choice = ({"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": None,
                       "finish_reason": reason} if chat else
                      {"index": 0, "text": text, "logprobs": None, "finish_reason": reason})
            return {"id": cid, "object": obj, "created": created, "model": model_name, "choices": [choice],
                    "usage": usage(n)}

        # streaming: the first event is awaited before the response starts, so errors keep their status
        try:
            first = await gen.__anext__()
        except StopAsyncIteration:
            first = None
        except APIError as e:
            return err(e)

        def chunk(delta: Optional[str], reason, role: bool = False, n: int = 0):
            if chat:
                d: Dict[str, Any] = {}
                if role:
                    d["role"] = "assistant"
                if delta:
                    d["content"] = delta
                choice = {"index": 0, "delta": d, "logprobs": None, "finish_reason": reason}
            else:
                choice = {"index": 0, "text": delta or "", "logprobs": None, "finish_reason": reason}
            out = {"id": cid, "object": "chat.completion.chunk" if chat else "text_completion", "created": created,
                   "model": model_name, "choices": [choice]}
            if parsed.continuous_usage:  # vLLM's extension: the running token counts in every chunk
                out["usage"] = usage(n)
            return "data: " + json.dumps(out) + "\n\n"

        async def sse():
            n = 0
            try:
                if chat:
                    yield chunk(None, None, role=True)
                if first is not None:
                    delta, reason, n = first
                    yield chunk(delta, reason, n=n)
                    if reason is None:
                        async for delta, reason, n in gen:
                            yield chunk(delta, reason, n=n)
                if parsed.include_usage:
                    u = {"id": cid, "object": "chat.completion.chunk" if chat else "text_completion",
                         "created": created, "model": model_name, "choices": [], "usage": usage(n)}
                    yield "data: " + json.dumps(u) + "\n\n"
                yield "data: [DONE]\n\n"
            except APIError as e:
                yield "data: " + json.dumps(e.body()) + "\n\n"
            finally:
                await gen.aclose()   # a disconnect cancels this generator: the request is aborted

        return StreamingResponse(sse(), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await run(request, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await run(request, chat=True)

    @app.exception_handler(APIError)
    async def api_error(request, exc: APIError):
        return err(exc)

    from fastapi.exceptions import RequestValidationError
    from starlette.exceptions import HTTPException as StarletteHTTPException

    @app.exception_handler(RequestValidationError)
    async def validation_error(request, exc):
        return err(APIError(400, f"invalid request: {exc}"))

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request, exc):
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        return JSONResponse(APIError(exc.status_code, str(exc.detail), kind=kind).body(), status_code=exc.status_code)

    return app


def _switch_interval() -> None:
    """The engine thread and the event loop hand the GIL back and forth every step: 1 ms instead of Python's
    5 ms (``SPECDEC_SWITCH_INTERVAL`` overrides). With it the HTTP path at batch 1 runs at 0.99x the
    in-process engine (1 torch thread, benchmarks/results/serve_overhead_2026-12-01.json)."""
    import os
    import sys

    sys.setswitchinterval(float(os.environ.get("SPECDEC_SWITCH_INTERVAL", "0.001")))


class ServerThread:
    """The server in a background thread of this process on 127.0.0.1 and a free port (tests, benchmarks):
    ``with ServerThread(engine, tok, "name") as srv: httpx.get(srv.url + "/health")``."""

    def __init__(self, engine: Engine, tokenizer, model_name: str, max_queue: int = 64,
                 start_timeout: float = 60.0) -> None:
        import socket

        import uvicorn

        _switch_interval()
        self.loop = EngineLoop(engine, max_queue=max_queue).start()
        app = build_app(self.loop, tokenizer, model_name)
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            self.port = sock.getsockname()[1]
        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, name="specdec-http", daemon=True)
        self.thread.start()
        t0 = time.time()
        while not self.server.started:
            if time.time() - t0 > start_timeout or not self.thread.is_alive():
                self.close()
                raise RuntimeError("specdec.server.ServerThread: the server did not start")
            time.sleep(0.05)
        self.url = f"http://127.0.0.1:{self.port}"

    def close(self) -> None:
        self.server.should_exit = True
        self.thread.join(10)
        self.loop.stop()

    def __enter__(self) -> "ServerThread":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def serve(engine: Engine, tokenizer, model_name: str, host: str = "127.0.0.1", port: int = 8000,
          max_queue: int = 64, log_level: str = "info") -> None:
    """Run the server in this process until interrupted."""
    import uvicorn

    _switch_interval()
    loop_ = EngineLoop(engine, max_queue=max_queue).start()
    app = build_app(loop_, tokenizer, model_name)
    try:
        uvicorn.run(app, host=host, port=port, log_level=log_level, timeout_graceful_shutdown=5)
    finally:
        loop_.stop()
