"""Calibration: seed a cost model's verify table with timed target forwards, cached per machine.

Optional: without it the goodput policy learns the verify costs from its first steps instead.
"""
from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Dict, List, Sequence

import torch

from specdec.scheduler.cost import CostModel

__all__ = ["calibration_key", "calibration_path", "calibrate"]


def calibration_key(target) -> str:
    """(model, device, dtype, torch threads) of a target, as the calibration cache's key.

    A target that runs its model's forward differently (e.g. :class:`specdec.graphs.GraphedForward`:
    CUDA-graph replays, which time unlike the model's eager forwards) gives its ``calibration_tag``,
    appended to the key, so that the wrapper and the bare model never reuse each other's timings.
    The tag is read from the target's class: attribute forwarding to a wrapped model cannot lend a
    wrapper its model's tag, nor a bare model a wrapper's."""
    model = getattr(target, "model", None)
    cfg = getattr(model, "config", None)
    if cfg is not None:
        name = getattr(cfg, "_name_or_path", "") or type(model).__name__
        shape = (getattr(cfg, "hidden_size", None), getattr(cfg, "num_hidden_layers", None),
                 getattr(cfg, "vocab_size", None))
    else:
        name = type(target).__name__
        shape = (getattr(target, "hidden", None), getattr(target, "num_layers", None),
                 getattr(target, "vocab_size", None))
    dtype = getattr(target, "dtype", None)
    key = f"{name}|{shape}|{torch.device(target.device)}|{dtype}|threads={torch.get_num_threads()}"
    tag = getattr(target, "calibration_tag", None) if hasattr(type(target), "calibration_tag") else None
    return f"{key}|{tag}" if tag else key


def calibration_path() -> Path:
    """Where calibrations are cached: ``$SPECDEC_CACHE/calibration.json`` (default ``~/.cache/specdec``)."""
    root = os.environ.get("SPECDEC_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "specdec")
    return Path(root) / "calibration.json"


@torch.no_grad()
def calibrate(target, cache, cost: CostModel, batches: Sequence[int], nodes: Sequence[int], repeats: int = 2,
              use_cache: bool = True) -> Dict[str, object]:
    """Time target forwards of b rows x n nodes on ``cache`` (reset afterwards) into ``cost.verify``.

    With ``use_cache`` the timings are read from / written to ``$SPECDEC_CACHE/calibration.json``
    (default ``~/.cache/specdec``), keyed by :func:`calibration_key`. Returns the cells measured.
    """
    key = calibration_key(target)
    path = calibration_path()
    store: Dict[str, object] = {}
    if use_cache and path.is_file():
        try:
            store = json.loads(path.read_text())
        except (OSError, ValueError):
            store = {}
        if key in store:
            cost.verify.load(store[key])
            return store[key]
    dev = torch.device(target.device)
    cells: Dict[str, List[float]] = {}
    for b in batches:
        view = cache.rows(0, b)
        for n in nodes:
            tokens = torch.zeros(b, n, dtype=torch.int64, device=dev)
            depths = torch.arange(n, dtype=torch.int32, device=dev).expand(b, n).contiguous()
            times = []
            for _ in range(repeats + 1):  # the first run warms up
                view.lens.fill_(16)
                if dev.type == "cuda":
                    torch.cuda.synchronize(dev)
                t = time.perf_counter()
                target.forward(view, tokens, depths, None)
                if dev.type == "cuda":
                    torch.cuda.synchronize(dev)
                times.append(time.perf_counter() - t)
            s = sorted(times[1:])[len(times[1:]) // 2]
            cells[f"{b},{n}"] = [s, 1.0]
    cache.reset()
    cost.verify.load(cells)
    if use_cache:
        store[key] = cells
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_suffix(".tmp")
            tmp.write_text(json.dumps(store, indent=1))
            tmp.replace(path)
        except OSError:
            pass
    return cells
