"""``specdec serve`` replicas behind one Ray Serve endpoint (the ``ray`` extra: ``pip install 'specdec[ray]'``).

Each replica is a Ray actor holding its own :class:`~specdec.engine.Engine` (its own target, drafter
and KV cache; tensor-parallel inside when the options say ``--tensor-parallel N``) and the same
OpenAI-compatible routes as ``specdec serve`` (:func:`specdec.serve.app.build_app`), attached with
Serve's late-bound ingress; Serve's HTTP proxy spreads the requests over the replicas. Requests are
independent, so each reply equals what a single ``specdec serve`` with the same options returns
(greedy: token-identical; seeded sampling: the same tokens).

Local cluster: ``specdec serve --replicas 2 --ray --threads 1`` (starts Ray in this process; each
replica asks for ``--threads`` CPUs). Many machines: ``ray start --head --port 6379`` on one,
``ray start --address HEAD:6379`` on the others, then ``specdec serve --replicas 8 --ray --ray-address
HEAD:6379`` anywhere in the cluster (docs/distributed.md).
"""
from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import Optional

__all__ = ["replica_app", "start_replicas", "serve_replicas"]


def _require_ray():
    try:
        import ray
        from ray import serve
    except ModuleNotFoundError as e:
        raise ModuleNotFoundError(f"--ray needs the ray extra (pip install 'specdec[ray]'): {e}") from None
    return ray, serve


def _model_name(args: argparse.Namespace) -> str:
    from specdec.models.bundled import BUNDLED

    return args.served_model_name or (args.model if args.model in BUNDLED else Path(args.model).name)


class SpecdecReplica:
    """One replica: its engine thread and the OpenAI-compatible app (built after the constructor)."""

    def __init__(self, args: argparse.Namespace) -> None:
        import torch

        from specdec.cli import load_target, make_engine
        from specdec.serve.loop import EngineLoop

        if args.threads:
            torch.set_num_threads(args.threads)
        target, drafter, tok, _ = load_target(args)
        engine = make_engine(args, target, drafter)   # the KV pool options as in a single server
        self.loop = EngineLoop(engine, max_queue=args.max_queue).start()
        self.tokenizer = tok
        self.name = _model_name(args)

    def __serve_build_asgi_app__(self):
        from specdec.serve.app import build_app

        return build_app(self.loop, self.tokenizer, self.name)

    def __del__(self) -> None:
        loop = getattr(self, "loop", None)
        if loop is not None:
            loop.stop()


def replica_app(args: argparse.Namespace, replicas: int):
    """The Serve application: ``replicas`` copies of :class:`SpecdecReplica` for the serve options ``args``."""
    _, serve = _require_ray()
    cpus = float(args.threads or 1) * max(1, int(getattr(args, "tensor_parallel", 1) or 1))
    deployment = serve.deployment(num_replicas=int(replicas), ray_actor_options={"num_cpus": cpus},
                                  max_ongoing_requests=args.max_batch + args.max_queue,
                                  name="specdec")(serve.ingress()(SpecdecReplica))
    return deployment.bind(args)


def start_replicas(args: argparse.Namespace, replicas: int, address: Optional[str] = None,
                   num_cpus: Optional[int] = None, timeout: float = 300.0) -> str:
    """Start Ray (or join ``address``), deploy the replicas on ``args.host:args.port``; returns the URL
    once the endpoint answers and ``replicas`` replicas run (bounded by ``timeout``). Serve's HTTP proxy
    keeps the host / port of its first start: redeploying in the same cluster must use the same port."""
    ray, serve = _require_ray()
    if not ray.is_initialized():
        if address:
            ray.init(address=address)
        else:
            ray.init(num_cpus=num_cpus, include_dashboard=False)
    # Serve keeps the HTTP options of its first start in this cluster: a second deployment reuses its port
    serve.start(http_options={"host": args.host, "port": args.port})
    t0 = time.time()
    serve.run(replica_app(args, replicas), name="specdec", route_prefix="/", blocking=False)
    url = f"http://{'127.0.0.1' if args.host in ('0.0.0.0', '') else args.host}:{args.port}"
    import httpx

    while True:
        try:
            running = serve.status().applications["specdec"].deployments["specdec"].replica_states.get("RUNNING", 0)
            if running == replicas and httpx.get(url + "/health", timeout=5).status_code == 200:
                return url
        except (httpx.HTTPError, KeyError):
            pass
        if time.time() - t0 > timeout:
            serve.shutdown()
            raise RuntimeError(f"Ray Serve: the replicas did not answer on {url} within {timeout:.0f} s")
        time.sleep(0.5)


def serve_replicas(args: argparse.Namespace) -> int:
    """``specdec serve --replicas N --ray``: serve until interrupted."""
    ray, serve = _require_ray()
    url = start_replicas(args, args.replicas, address=args.ray_address)
    print(f"[specdec] serving {_model_name(args)} on {url} with {args.replicas} Ray Serve replicas", flush=True)
    try:
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        pass
    finally:
        serve.shutdown()
        ray.shutdown()
    return 0
