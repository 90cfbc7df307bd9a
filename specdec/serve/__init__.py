"""``specdec serve``: an OpenAI-compatible HTTP server over :class:`specdec.Engine`.

Endpoints: ``POST /v1/completions``, ``POST /v1/chat/completions`` (both with ``stream=true`` as
server-sent events, ``data: {chunk}`` ... ``data: [DONE]``), ``GET /v1/models``, ``GET /health``,
``GET /metrics`` (Prometheus text format).

Threads: the engine runs in ONE background thread (:class:`~specdec.serve.loop.EngineLoop`); HTTP handlers (asyncio)
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

Modules: :mod:`specdec.serve.loop` (the engine thread and the metrics), :mod:`specdec.serve.openai`
(request parsing and response bodies), :mod:`specdec.serve.app` (the routes, :func:`serve`,
:class:`ServerThread`; it needs the ``serve`` extra). The public names are re-exported by
:mod:`specdec.server`.
"""
