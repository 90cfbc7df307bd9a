"""``specdec serve``'s public names (the code lives in :mod:`specdec.serve`, whose docstring describes
the server): ``from specdec.server import ServerThread, serve``."""

from specdec.serve.app import Server, ServerThread, build_app, serve
from specdec.serve.loop import EngineLoop, Metrics
from specdec.serve.openai import APIError

__all__ = ["EngineLoop", "build_app", "serve", "ServerThread", "Server", "Metrics", "APIError"]
