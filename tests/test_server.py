"""specdec serve: the OpenAI-compatible server over the engine, live on 127.0.0.1 (bounded, stops by itself).

The model is a tiny Llama built from a config with a fixed seed and saved as a local Hugging Face
folder with the bundled SmolLM2 tokenizer (so the CLI's --model PATH loading is exercised too)."""
from __future__ import annotations

import contextlib
import json
import socket
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from typing import List

import pytest
import torch

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
pytest.importorskip("prometheus_client")
httpx = pytest.importorskip("httpx")
openai = pytest.importorskip("openai")

from specdec import CallableDrafter, DraftModel, Engine, MultiDraft, PromptLookup, RequestParams  # noqa: E402
from specdec.models.hf import HFCausalLM  # noqa: E402

from test_decoding import _bundled  # noqa: E402

MAX_LEN = 96


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    load_bundled, _ = _bundled()
    from transformers import LlamaConfig, LlamaForCausalLM

    _, tok = load_bundled("smollm2-135m")
    cfg = LlamaConfig(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                      tie_word_embeddings=False, initializer_range=0.1, bos_token_id=1, eos_token_id=2)
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg).eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(10)  # decisive argmaxes (top-2 margins ~1e-2, far above rounding)
    path = tmp_path_factory.mktemp("tiny-llama")
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def tiny(folder):
    from specdec.cli import load_hf_folder

    model, tok = load_hf_folder(str(folder))
    return HFCausalLM(model), tok


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def live_server(engine: Engine, tok, max_queue: int = 16):
    from specdec.server import ServerThread

    with ServerThread(engine, tok, "tiny", max_queue=max_queue, start_timeout=30) as srv:
        yield srv.url, srv.loop


def _solo(target, drafter, prompt_ids, params: RequestParams) -> List[int]:
    eng = Engine(target, drafter, max_batch=1, max_len=MAX_LEN, policy="fixed")
    eng.add_request(0, prompt_ids, params)
    out = []
    while eng.has_unfinished():
        out += [t for d in eng.step() for t in d.new_tokens]
    return out


def _wait(pred, timeout=10.0):
    t0 = time.time()
    while not pred():
        assert time.time() - t0 < timeout
        time.sleep(0.02)


def test_openai_client_completions_and_chat(tiny):
    target, tok = tiny
    eng = Engine(target, PromptLookup(ngram=2, k=4, min_ngram=1), max_batch=4, max_len=MAX_LEN, policy="fixed")
    prompt = "The quick brown fox jumps over the lazy dog. The quick brown"
    ids = tok(prompt, add_special_tokens=False)["input_ids"]
    want = tok.decode(_solo(target, None, ids, RequestParams(max_new_tokens=12, stop_token_ids=(2,))),
                      skip_special_tokens=True)
    msgs = [{"role": "user", "content": "Say something."}]
    chat_ids = tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True)
    chat_ids = chat_ids["input_ids"] if hasattr(chat_ids, "keys") else chat_ids
    want_chat = tok.decode(_solo(target, None, list(chat_ids), RequestParams(max_new_tokens=10, stop_token_ids=(2,))),
                           skip_special_tokens=True)
    with live_server(eng, tok) as (url, _):
        client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=30)
        assert [m.id for m in client.models.list().data] == ["tiny"]
        r = client.completions.create(model="tiny", prompt=prompt, max_tokens=12, temperature=0)
        assert r.choices[0].text == want and r.choices[0].finish_reason in ("length", "stop")
        assert r.usage.prompt_tokens == len(ids) and r.usage.completion_tokens <= 12
        text = "".join(c.choices[0].text for c in client.completions.create(
            model="tiny", prompt=prompt, max_tokens=12, temperature=0, stream=True))
        assert text == want
        r = client.chat.completions.create(model="tiny", messages=msgs, max_tokens=10, temperature=0)
        assert r.choices[0].message.content == want_chat and r.choices[0].message.role == "assistant"
        chunks = list(client.chat.completions.create(model="tiny", messages=msgs, max_tokens=10, temperature=0,
                                                     stream=True, stream_options={"include_usage": True}))
        assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == want_chat
        assert chunks[-1].usage.completion_tokens >= 1
        assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] in ("length", "stop")
        # vLLM's continuous_usage_stats: running token counts in every chunk (how many tokens each carries)
        with httpx.stream("POST", url + "/v1/chat/completions", timeout=30, json=dict(
                model="tiny", messages=msgs, max_tokens=10, temperature=0, stream=True,
                stream_options={"continuous_usage_stats": True})) as s:
            counts = [json.loads(x[6:])["usage"]["completion_tokens"] for x in s.iter_lines()
                      if x.startswith("data: {")]
        assert counts == sorted(counts) and counts[-1] == r.usage.completion_tokens
        # token-id prompts work too, and a stop string ends the text before it
        r = client.completions.create(model="tiny", prompt=ids, max_tokens=12, temperature=0)
        assert r.choices[0].text == want
        if len(want) > 6:
            stop = want[3:6]
            r = client.completions.create(model="tiny", prompt=prompt, max_tokens=12, temperature=0, stop=[stop])
            assert r.choices[0].text == want[:want.find(stop)] and r.choices[0].finish_reason == "stop"


def test_concurrent_requests_equal_solo_runs(tiny):
    target, tok = tiny
    texts = ["one two three one two three one", "alpha beta gamma", "The cat sat on the mat. The cat",
             "0 1 2 3 4 5 6 7", "hello", "Numbers: 1, 2, 3, 1, 2, 3, 1,"]
    settings = [dict(temperature=0), dict(temperature=0.8, seed=11), dict(temperature=0, max_tokens=5),
                dict(temperature=1.1, top_p=0.9, seed=3), dict(temperature=0, max_tokens=20),
                dict(temperature=0.7, top_k=20, seed=5)]
    want = []
    for t, s in zip(texts, settings):
        ids = tok(t, add_special_tokens=False)["input_ids"]
        p = RequestParams(max_new_tokens=s.get("max_tokens", 14), temperature=s["temperature"],
                          top_k=s.get("top_k", 0), top_p=s.get("top_p", 1.0), seed=s.get("seed"), stop_token_ids=(2,))
        want.append(tok.decode(_solo(target, PromptLookup(ngram=2, k=4, min_ngram=1), ids, p),
                               skip_special_tokens=True))
    eng = Engine(target, PromptLookup(ngram=2, k=4, min_ngram=1), max_batch=3, max_len=MAX_LEN, policy="fixed")
    with live_server(eng, tok) as (url, loop_):
        def one(i):
            body = {**dict(model="tiny", prompt=texts[i], max_tokens=14), **settings[i]}
            r = httpx.post(url + "/v1/completions", json=body, timeout=60)
            assert r.status_code == 200, r.text
            return r.json()["choices"][0]["text"]

        with ThreadPoolExecutor(6) as pool:
            got = list(pool.map(one, range(6)))
        assert got == want   # 6 requests over 3 rows: later ones joined while others decoded
        assert eng.num_active == 0 and loop_.outstanding == 0


def test_join_abort_disconnect_and_reuse(tiny):
    target, tok = tiny
    # a draft model (state per row) next to a slow retriever (50 ms per request-step: requests outlive
    # the client's read timeout below)
    slow = CallableDrafter(lambda ctx: time.sleep(0.05) or [], max_nodes=2, name="slow")
    drafter = MultiDraft([DraftModel(HFCausalLM(target.model), k=3), slow])
    eng = Engine(target, drafter, max_batch=2, max_len=MAX_LEN, policy="fixed")
    short_ids = tok("short one", add_special_tokens=False)["input_ids"]
    want_short = tok.decode(_solo(target, None, short_ids, RequestParams(max_new_tokens=4, stop_token_ids=(2,))),
                            skip_special_tokens=True)
    with live_server(eng, tok) as (url, loop_):
        with httpx.Client(timeout=60) as c:
            # a long streaming request; a short one joins while it decodes and finishes first
            with c.stream("POST", url + "/v1/completions", json=dict(model="tiny", prompt="a long story",
                                                                     max_tokens=80, temperature=0, stream=True)) as s:
                lines = s.iter_lines()
                first = next(line for line in lines if line.startswith("data: "))
                assert json.loads(first[6:])["choices"][0]["text"] is not None
                r = c.post(url + "/v1/completions", json=dict(model="tiny", prompt="short one", max_tokens=4,
                                                               temperature=0))
                assert r.json()["choices"][0]["text"] == want_short
                assert eng.num_active == 1   # the long one still decodes
            # leaving the with-block closed the stream mid-way: the request is aborted, its row freed
            _wait(lambda: eng.num_active == 0 and loop_.outstanding == 0)
            # a non-streaming client that disconnects (read timeout) is aborted too
            with pytest.raises(httpx.ReadTimeout):
                c.post(url + "/v1/completions", json=dict(model="tiny", prompt="x", max_tokens=80, temperature=0),
                       timeout=httpx.Timeout(60, read=0.3))
            _wait(lambda: eng.num_active == 0 and loop_.outstanding == 0)
            # the freed rows are reused: two more requests, both exact
            with ThreadPoolExecutor(2) as pool:
                outs = list(pool.map(lambda _: c.post(url + "/v1/completions", json=dict(
                    model="tiny", prompt="short one", max_tokens=4, temperature=0)).json()["choices"][0]["text"],
                    range(2)))
            assert outs == [want_short] * 2
            m = c.get(url + "/metrics").text
            assert 'specdec_requests_total{outcome="aborted"} 2.0' in m


def test_bad_requests_and_full_queue(tiny):
    target, tok = tiny
    slow = CallableDrafter(lambda ctx: time.sleep(0.05) or [], max_nodes=2, name="slow")  # requests last seconds
    eng = Engine(target, slow, max_batch=1, max_len=MAX_LEN)
    with live_server(eng, tok, max_queue=0) as (url, loop_):
        with httpx.Client(timeout=30) as c:
            cases = [
                (dict(model="nope", prompt="hi"), "model"),
                (dict(model="tiny", prompt="hi", max_tokens=MAX_LEN), "max_tokens"),
                (dict(model="tiny", prompt="hi", temperature=-0.5), "temperature"),
                (dict(model="tiny", prompt=""), "prompt"),
                (dict(model="tiny", prompt=[]), "prompt"),
                (dict(model="tiny"), "prompt"),
                (dict(model="tiny", prompt="hi", top_p=0), "top_p"),
                (dict(model="tiny", prompt="hi", n=2), "n"),
                (dict(model="tiny", prompt=[1, 10 ** 9]), "prompt"),
                (dict(model="tiny", prompt="hi", max_tokens="many"), "max_tokens"),
            ]
            for body, param in cases:
                r = c.post(url + "/v1/completions", json=body)
                assert r.status_code == 400, (body, r.text)
                err = r.json()["error"]
                assert err["param"] == param and err["type"] == "invalid_request_error" and err["message"]
            r = c.post(url + "/v1/completions", content=b"{not json", headers={"content-type": "application/json"})
            assert r.status_code == 400 and "JSON" in r.json()["error"]["message"]
            r = c.post(url + "/v1/chat/completions", json=dict(model="tiny", messages=[]))
            assert r.status_code == 400 and r.json()["error"]["param"] == "messages"
            r = c.post(url + "/v1/chat/completions", json=dict(model="tiny", messages=[{"role": "robot",
                                                                                          "content": "x"}]))
            assert r.status_code == 400
            # the one row is busy with a stream: the next request gets 429
            with c.stream("POST", url + "/v1/completions", json=dict(model="tiny", prompt="go", max_tokens=80,
                                                                     temperature=0, stream=True)) as s:
                next(line for line in s.iter_lines() if line.startswith("data: "))
                r = c.post(url + "/v1/completions", json=dict(model="tiny", prompt="hi", max_tokens=2))
                assert r.status_code == 429 and r.json()["error"]["type"] == "rate_limit_error"
            _wait(lambda: loop_.outstanding == 0)
            assert c.get(url + "/health").json()["status"] == "ok"
            r = c.post(url + "/v1/completions", json=dict(model="tiny", prompt="hi", max_tokens=2))
            assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2
            # /metrics is Prometheus text
            from prometheus_client.parser import text_string_to_metric_families

            fams = {f.name: f for f in text_string_to_metric_families(c.get(url + "/metrics").text)}
            for name in ("specdec_queue_depth", "specdec_active_requests", "specdec_tokens_per_second",
                         "specdec_acceptance_rate", "specdec_time_to_first_token_seconds",
                         "specdec_inter_token_latency_seconds", "specdec_rejected_requests",
                         "specdec_drafter_errors", "specdec_kv_blocks", "specdec_prefix_cache_hit_rate",
                         "specdec_preemptions"):
                assert name in fams, name
            blocks = {s.labels["state"]: s.value for s in fams["specdec_kv_blocks"].samples}
            assert eng.kv.paged and blocks["used"] + blocks["free"] == eng.kv.allocator.num_blocks
            rej = {s.labels["reason"]: s.value for s in fams["specdec_rejected_requests"].samples
                   if s.name.endswith("_total")}
            assert rej["queue_full"] == 1 and rej["bad_request"] == len(cases) + 3


def test_cli_serve_and_generate_with_a_model_folder(folder, tiny, capsys):
    from specdec.cli import main

    rc = main(["generate", "hello there", "--model", str(folder), "--draft-model", str(folder), "--raw",
               "--max-new-tokens", "6", "--no-stream", "--policy", "fixed", "--compare"])
    out = capsys.readouterr().out
    assert rc == 0 and "same text" in out and "draft=model" in out
    port = _free_port()
    proc = subprocess.Popen([sys.executable, "-m", "specdec.cli", "serve", "--model", str(folder), "--draft",
                             "lookup", "--port", str(port), "--max-len", "128", "--log-level", "warning"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        t0 = time.time()
        while True:
            assert proc.poll() is None, proc.stdout.read().decode()
            assert time.time() - t0 < 120, "specdec serve did not come up"
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.3)
        models = httpx.get(f"http://127.0.0.1:{port}/v1/models").json()
        assert models["data"][0]["id"] == folder.name
        r = httpx.post(f"http://127.0.0.1:{port}/v1/completions",
                       json=dict(model=folder.name, prompt="hello", max_tokens=3, temperature=0), timeout=30)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] >= 1
    finally:
        proc.terminate()
        proc.wait(20)
