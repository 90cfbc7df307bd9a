"""The OpenAI wire format: request bodies in (validated into :class:`ParsedRequest`), response
bodies and server-sent-event chunks out, and :class:`APIError` with its OpenAI-style body."""

import json
import time
import uuid
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Sequence

from specdec._check import is_int, is_number
from specdec.engine import RequestParams

__all__ = ["APIError", "ParsedRequest", "RequestParser", "Replies", "find_stop", "sse"]


class APIError(Exception):
    """An HTTP error with the body OpenAI's API gives: ``{"error": {"message", "type", "param", "code"}}``."""

    def __init__(self, status: int, message: str, param: Optional[str] = None, code: Optional[str] = None,
                 kind: str = "invalid_request_error") -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.kind = status, message, param, code, kind

    def body(self) -> Dict[str, Any]:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}


def _number(body: Dict[str, Any], name: str, default, kind, lo=None, hi=None, lo_open=False):
    """``body[name]`` (``default`` when absent or null) as ``kind`` (int or float) within the bounds, or HTTP 400."""
    v = body.get(name, default)
    if v is None:
        v = default
    if not (is_int(v) if kind is int else is_number(v)):
        raise APIError(400, f"'{name}' must be {'an integer' if kind is int else 'a number'}, got {v!r}", param=name)
    if lo is not None and (v <= lo if lo_open else v < lo):
        raise APIError(400, f"'{name}' must be {'>' if lo_open else '>='} {lo}, got {v}", param=name)
    if hi is not None and v > hi:
        raise APIError(400, f"'{name}' must be <= {hi}, got {v}", param=name)
    return kind(v)


@dataclass
class ParsedRequest:
    """A validated completion or chat request: what the engine runs and how the answer is sent."""

    prompt_ids: List[int]
    params: RequestParams
    stop: List[str]
    stream: bool
    include_usage: bool
    continuous_usage: bool = False


class RequestParser:
    """Validates and tokenizes request bodies of ``/v1/completions`` and ``/v1/chat/completions``."""

    def __init__(self, tokenizer, model_name: str, max_len: int, vocab_size: int) -> None:
        self.tok = tokenizer
        self.model_name = model_name
        self.eos = tokenizer.eos_token_id
        self.max_len = max_len
        self.vocab = vocab_size

    def parse_completion(self, body: Dict[str, Any]) -> ParsedRequest:
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

    def parse_chat(self, body: Dict[str, Any]) -> ParsedRequest:
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

    # ---- the fields both endpoints share, checked in this order (the first bad one is reported)
    def _common(self, body: Dict[str, Any], prompt_ids: List[int], chat: bool) -> ParsedRequest:
        max_tokens = self._max_tokens(body, prompt_ids, chat)
        temperature = _number(body, "temperature", 1.0, float, lo=0.0)
        if temperature > 100:
            raise APIError(400, f"'temperature' must be <= 100, got {temperature}", param="temperature")
        top_p = _number(body, "top_p", 1.0, float, lo=0.0, hi=1.0, lo_open=True)
        top_k = _number(body, "top_k", 0, int, lo=0)
        seed = body.get("seed")
        if seed is not None and not is_int(seed):
            raise APIError(400, f"'seed' must be an integer, got {seed!r}", param="seed")
        stop = _stop_strings(body)
        stream = body.get("stream", False)
        if not isinstance(stream, bool):
            raise APIError(400, f"'stream' must be a boolean, got {stream!r}", param="stream")
        opts = body.get("stream_options") or {}
        if not isinstance(opts, dict):
            raise APIError(400, "'stream_options' must be an object", param="stream_options")
        stops = (self.eos,) if self.eos is not None else ()
        params = RequestParams(max_new_tokens=max_tokens, temperature=temperature, top_k=top_k, top_p=top_p,
                               seed=seed, stop_token_ids=stops)
        return ParsedRequest(prompt_ids, params, stop, stream, bool(opts.get("include_usage", False)),
                             bool(opts.get("continuous_usage_stats", False)))

    def _max_tokens(self, body: Dict[str, Any], prompt_ids: List[int], chat: bool) -> int:
        """The model, the prompt's length, ``n`` and the completion budget (default: 16 for completions, the
        rest of ``max_len`` for chat)."""
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
            return room if chat else min(16, room)
        max_tokens = _number(body, given, None, int, lo=1)
        if max_tokens > room:
            raise APIError(400, f"'{given}' = {max_tokens} with a prompt of {len(prompt_ids)} tokens needs "
                                f"{len(prompt_ids) + max_tokens} > max_len = {self.max_len} positions",
                           param=given, code="context_length_exceeded")
        return max_tokens


def _stop_strings(body: Dict[str, Any]) -> List[str]:
    """``stop``: null, a string or a list of at most 4 strings; empty strings are dropped."""
    stop = body.get("stop")
    if stop is None:
        stop = []
    elif isinstance(stop, str):
        stop = [stop]
    elif not (isinstance(stop, list) and all(isinstance(s, str) for s in stop)) or len(stop) > 4:
        raise APIError(400, "'stop' must be a string or a list of at most 4 strings", param="stop")
    return [s for s in stop if s]


def find_stop(text: str, stops: Sequence[str], start: int) -> Optional[int]:
    """Index of the earliest stop string in text that ends at or after ``start`` (None: none)."""
    best = None
    for s in stops:
        i = text.find(s, max(0, start - len(s) + 1))
        if i >= 0 and (best is None or i < best):
            best = i
    return best


def sse(obj: Dict[str, Any]) -> str:
    """One server-sent event carrying ``obj`` as JSON."""
    return "data: " + json.dumps(obj) + "\n\n"


class Replies:
    """The response objects of one request: the whole body, or its stream of chunks."""

    def __init__(self, model_name: str, chat: bool, n_prompt: int, continuous_usage: bool) -> None:
        self.id = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]
        self.created = int(time.time())
        self.model_name = model_name
        self.chat = chat
        self.n_prompt = n_prompt
        self.continuous_usage = continuous_usage

    def usage(self, n: int) -> Dict[str, int]:
        return {"prompt_tokens": self.n_prompt, "completion_tokens": n, "total_tokens": self.n_prompt + n}

    def body(self, text: str, reason: str, n: int) -> Dict[str, Any]:
        """The non-streaming answer."""
        choice = ({"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": None,
                   "finish_reason": reason} if self.chat else
                  {"index": 0, "text": text, "logprobs": None, "finish_reason": reason})
        return {"id": self.id, "object": "chat.completion" if self.chat else "text_completion",
                "created": self.created, "model": self.model_name, "choices": [choice], "usage": self.usage(n)}

    def _chunk_head(self) -> Dict[str, Any]:
        return {"id": self.id, "object": "chat.completion.chunk" if self.chat else "text_completion",
                "created": self.created, "model": self.model_name}

    def chunk(self, delta: Optional[str], reason, role: bool = False, n: int = 0) -> str:
        """One streamed chunk (an SSE line): a text delta, the role (chat's first chunk) or the finish reason."""
        if self.chat:
            d: Dict[str, Any] = {}
            if role:
                d["role"] = "assistant"
            if delta:
                d["content"] = delta
            choice = {"index": 0, "delta": d, "logprobs": None, "finish_reason": reason}
        else:
            choice = {"index": 0, "text": delta or "", "logprobs": None, "finish_reason": reason}
        out = self._chunk_head()
        out["choices"] = [choice]
        if self.continuous_usage:  # vLLM's extension: the running token counts in every chunk
            out["usage"] = self.usage(n)
        return sse(out)

    def usage_chunk(self, n: int) -> str:
        """The last chunk of ``stream_options.include_usage``: no choices, the usage."""
        out = self._chunk_head()
        out["choices"] = []
        out["usage"] = self.usage(n)
        return sse(out)
