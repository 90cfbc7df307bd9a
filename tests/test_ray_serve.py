"""Two Ray Serve replicas behind one endpoint (local cluster on loopback, bounded start) answer
concurrent requests of the official openai client exactly as one in-process `specdec serve` does.
Skipped where Ray (the optional `ray` extra) is not installed or cannot start, and unless
SPECDEC_RAY_TESTS=1 (a local cluster takes 1-2 minutes to start here)."""
import argparse
import concurrent.futures as cf
import os
import socket

import pytest

ray = pytest.importorskip("ray", reason="Ray Serve is the optional 'ray' extra (pip install 'specdec[ray]')")
openai = pytest.importorskip("openai")
pytest.importorskip("fastapi")
if os.environ.get("SPECDEC_RAY_TESTS") != "1":
    pytest.skip("starting a Ray cluster takes 1-2 minutes on a small machine; set SPECDEC_RAY_TESTS=1 to run it",
                allow_module_level=True)

from specdec.cli import serve_options  # noqa: E402


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _args(**kw) -> argparse.Namespace:
    """`specdec serve` options as the CLI parses them (every option present with its default)."""
    args = serve_options(["--draft", "lookup", "--policy", "fixed", "--threads", "1", "--port", str(_port()),
                          "--max-batch", "4", "--max-len", "256", "--max-queue", "16", "--log-level", "warning",
                          "--replicas", "2", "--ray"])
    for k, v in kw.items():
        setattr(args, k, v)
    return args


QUESTIONS = ["Name three colors.", "What is 2 + 2?", "Say hello in French.", "List two fruits."]


def _ask(url: str):
    client = openai.OpenAI(base_url=url + "/v1", api_key="none", timeout=120, max_retries=0)

    def one(q):
        r = client.chat.completions.create(model="smollm2-135m", messages=[{"role": "user", "content": q}],
                                           max_tokens=12, temperature=0)
        return r.choices[0].message.content

    with cf.ThreadPoolExecutor(4) as pool:
        return list(pool.map(one, QUESTIONS))


def test_two_replicas_match_one_server():
    pytest.importorskip("specdec.models.bundled").load_bundled  # noqa: B018 - the bundled model must load
    from ray import serve

    from specdec.cli import load_target
    from specdec.distributed.ray_serve import start_replicas
    from specdec.engine import Engine
    from specdec.server import ServerThread

    args = _args()
    try:
        url = start_replicas(args, 2, num_cpus=2, timeout=240)
    except Exception as e:  # noqa: BLE001 - a machine where Ray cannot start skips, saying why
        ray.shutdown()
        pytest.skip(f"Ray Serve could not start a local cluster here: {type(e).__name__}: {e}")
    try:
        got = _ask(url)
        status = serve.status().applications["specdec"].deployments["specdec"].replica_states
        assert status.get("RUNNING", 0) == 2
    finally:
        serve.shutdown()
        ray.shutdown()
    target, drafter, tok, _ = load_target(_args(replicas=1, ray=False))
    with ServerThread(Engine(target, drafter, max_batch=4, max_len=256, policy="fixed"), tok, "smollm2-135m") as srv:
        want = _ask(srv.url)
    assert got == want
