"""The FastAPI application of ``specdec serve`` (:func:`build_app`), and two ways to run it: in this
process until interrupted (:func:`serve`) or in a background thread (:class:`ServerThread`)."""

import asyncio
import json
import os
import socket
import sys
import threading
import time
import uuid
from typing import Any, Dict, List

import uvicorn
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.exceptions import HTTPException as StarletteHTTPException

from specdec.engine import Engine
from specdec.serve.loop import EngineLoop, TokenEvent
from specdec.serve.openai import APIError, ParsedRequest, Replies, RequestParser, find_stop, sse

__all__ = ["Server", "build_app", "serve", "ServerThread"]


def error_response(e: APIError) -> JSONResponse:
    return JSONResponse(e.body(), status_code=e.status)


async def read_json_body(request: Request) -> Dict[str, Any]:
    """The request body as a JSON object, or HTTP 400."""
    raw = await request.body()
    try:
        body = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as exc:
        raise APIError(400, f"the request body is not valid JSON: {exc}") from None
    if not isinstance(body, dict):
        raise APIError(400, "the request body must be a JSON object")
    return body


class Server:
    """The HTTP layer over an :class:`EngineLoop`: the route handlers, and one request's text stream
    (detokenization, stop strings, disconnects)."""

    def __init__(self, loop_: EngineLoop, tokenizer, model_name: str) -> None:
        self.loop = loop_
        self.tok = tokenizer
        self.model_name = model_name
        self.max_len = loop_.engine.max_len
        self.parser = RequestParser(tokenizer, model_name, self.max_len, loop_.engine.vocab_size)

    # ---- running one request
    async def events(self, parsed: ParsedRequest, is_disconnected):
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
                    ev: TokenEvent = await asyncio.wait_for(q.get(), timeout=0.25)
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
                cut = find_stop(text, parsed.stop, len(sent))
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

    # ---- routes
    async def health(self):
        eng = self.loop.engine
        return {"status": "ok", "active": eng.num_active, "waiting": eng.num_waiting,
                "outstanding": self.loop.outstanding}

    async def models(self):
        return {"object": "list", "data": [{"id": self.model_name, "object": "model", "created": 0,
                                            "owned_by": "specdec", "max_model_len": self.max_len}]}

    async def metrics(self):
        return PlainTextResponse(generate_latest(self.loop.metrics.registry).decode(), media_type=CONTENT_TYPE_LATEST)

    async def completions(self, request: Request):
        return await self.run(request, chat=False)

    async def chat_completions(self, request: Request):
        return await self.run(request, chat=True)

    async def run(self, request: Request, chat: bool):
        try:
            body = await read_json_body(request)
            parsed = self.parser.parse_chat(body) if chat else self.parser.parse_completion(body)
        except APIError as e:
            self.loop.metrics.rejected.labels("bad_request").inc()
            return error_response(e)
        replies = Replies(self.model_name, chat, len(parsed.prompt_ids), parsed.continuous_usage)
        gen = self.events(parsed, request.is_disconnected)
        if not parsed.stream:
            return await self.whole(gen, replies)
        # the first event is awaited before the response starts, so errors keep their status
        try:
            first = await gen.__anext__()
        except StopAsyncIteration:
            first = None
        except APIError as e:
            return error_response(e)
        return StreamingResponse(self.stream(gen, first, replies, parsed.include_usage),
                                 media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    async def whole(self, gen, replies: Replies):
        """The non-streaming answer: every delta joined."""
        text, reason, n = "", None, 0
        try:
            async for delta, r, n in gen:
                text += delta
                reason = r
        except APIError as e:
            return error_response(e)
        if reason is None:   # the client disconnected: nobody reads this
            return JSONResponse({}, status_code=499)
        return replies.body(text, reason, n)

    async def stream(self, gen, first, replies: Replies, include_usage: bool):
        """The server-sent events of a streaming answer, from the first (already awaited) event on."""
        n = 0
        try:
            if replies.chat:
                yield replies.chunk(None, None, role=True)
            if first is not None:
                delta, reason, n = first
                yield replies.chunk(delta, reason, n=n)
                if reason is None:
                    async for delta, reason, n in gen:
                        yield replies.chunk(delta, reason, n=n)
            if include_usage:
                yield replies.usage_chunk(n)
            yield "data: [DONE]\n\n"
        except APIError as e:
            yield sse(e.body())
        finally:
            await gen.aclose()   # a disconnect cancels this generator: the request is aborted


# ---- errors raised outside a handler's own try, in OpenAI's error body
async def api_error(request, exc: APIError):
    return error_response(exc)


async def validation_error(request, exc):
    return error_response(APIError(400, f"invalid request: {exc}"))


async def http_error(request, exc):
    kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
    return error_response(APIError(exc.status_code, str(exc.detail), kind=kind))


def build_app(loop_: EngineLoop, tokenizer, model_name: str) -> FastAPI:
    """The FastAPI application (the engine loop must be started by the caller)."""
    srv = Server(loop_, tokenizer, model_name)
    app = FastAPI(title="specdec", docs_url=None, redoc_url=None)
    app.state.server = srv
    app.get("/health")(srv.health)
    app.get("/v1/models")(srv.models)
    app.get("/metrics")(srv.metrics)
    app.post("/v1/completions")(srv.completions)
    app.post("/v1/chat/completions")(srv.chat_completions)
    app.add_exception_handler(APIError, api_error)
    app.add_exception_handler(RequestValidationError, validation_error)
    app.add_exception_handler(StarletteHTTPException, http_error)
    return app


def _switch_interval() -> None:
    """The engine thread and the event loop hand the GIL back and forth every step: 1 ms instead of Python's
    5 ms (``SPECDEC_SWITCH_INTERVAL`` overrides; docs/serving.md says why)."""
    sys.setswitchinterval(float(os.environ.get("SPECDEC_SWITCH_INTERVAL", "0.001")))


class ServerThread:
    """The server in a background thread of this process on 127.0.0.1 and a free port (tests, benchmarks):
    ``with ServerThread(engine, tok, "name") as srv: httpx.get(srv.url + "/health")``."""

    def __init__(self, engine: Engine, tokenizer, model_name: str, max_queue: int = 64,
                 start_timeout: float = 60.0) -> None:
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
    _switch_interval()
    loop_ = EngineLoop(engine, max_queue=max_queue).start()
    app = build_app(loop_, tokenizer, model_name)
    try:
        uvicorn.run(app, host=host, port=port, log_level=log_level, timeout_graceful_shutdown=5)
    finally:
        loop_.stop()
