"""``specdec serve``'s public names (the code lives in :mod:`specdec.serve`, whose docstring describes
the server): ``from specdec.server import ServerThread, serve``.

The engine loop and the request parser import without the ``serve`` extra; the HTTP names
(``build_app``, ``serve``, ``ServerThread``, ``Server``) load FastAPI on first use."""

import importlib

from specdec.serve.loop import EngineLoop, Metrics
from specdec.serve.openai import APIError

_APP_NAMES = ("build_app", "serve", "ServerThread", "Server")

__all__ = ["EngineLoop", "Metrics", "APIError", *_APP_NAMES]


def __getattr__(name: str):
    if name in _APP_NAMES:
        value = getattr(importlib.import_module("specdec.serve.app"), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'specdec.server' has no attribute {name!r}")
