"""What a benchmark record says about where it ran: the commit, the CPU, the load, and paths made
safe to record. ``specdec bench`` and the scripts under benchmarks/ share these."""
from __future__ import annotations

import json
import os
import platform
import subprocess
from pathlib import Path
from typing import Optional

__all__ = ["git_commit", "record_path", "scrub_paths", "cpu_name", "loadavg", "write_record"]

#: the repository root of a source checkout (specdec/bench/record.py -> the folder holding specdec/)
_ROOT = Path(__file__).resolve().parent.parent.parent


def git_commit() -> str:
    """The checkout's commit (``-dirty`` with uncommitted changes to tracked files), or "unknown"."""
    try:
        sha = subprocess.run(["git", "rev-parse", "HEAD"], cwd=_ROOT, capture_output=True, text=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=_ROOT,
                               capture_output=True, text=True).stdout.strip()
        return (sha + ("-dirty" if dirty else "")) or "unknown"
    except OSError:
        return "unknown"


def record_path(path) -> Optional[str]:
    """A path as a result file records it: relative to the repository when inside it, else its name only
    (a record must not carry the paths of the machine it ran on)."""
    if path is None:
        return None
    p = Path(path).resolve()
    try:
        return str(p.relative_to(_ROOT))
    except ValueError:
        return p.name


def scrub_paths(obj):
    """``obj`` (dicts, lists, strings, numbers) with every absolute path string as :func:`record_path` gives it
    (a head's config.json, for one, records the command that made it, output folder included)."""
    if isinstance(obj, dict):
        return {k: scrub_paths(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [scrub_paths(v) for v in obj]
    if isinstance(obj, str) and os.path.isabs(obj) and "\n" not in obj:
        return record_path(obj)
    return obj


def cpu_name() -> str:
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


def loadavg():
    """The 1 / 5 / 15 minute load averages (None where the platform has none)."""
    return list(os.getloadavg()) if hasattr(os, "getloadavg") else None


def write_record(folder, name: str, rec: dict) -> str:
    """Write ``rec`` as ``folder/name.json`` (indented JSON), say so on stdout and return the path."""
    path = os.path.join(folder, name + ".json")
    with open(path, "w") as f:
        json.dump(rec, f, indent=1)
    print("written", path)
    return path
