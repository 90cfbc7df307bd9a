"""The public import surface and the build's choice of CMake (found when the project was tried as a new user)."""
from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def test_top_level_names_and_subpackages_in_a_fresh_interpreter():
    code = ("import specdec\n"
            "assert callable(specdec.models.load_bundled), 'specdec.models.load_bundled'\n"
            "from specdec.drafters.multi import MultiDraft\n"
            "from specdec.drafters.callable import CallableDrafter\n"
            "assert specdec.MultiDraft is MultiDraft and specdec.CallableDrafter is CallableDrafter\n"
            "assert specdec.drafters.DraftModel is specdec.DraftModel\n"
            "assert 'models' in dir(specdec) and 'MultiDraft' in specdec.__all__\n"
            "try:\n    specdec.no_such_name\nexcept AttributeError as e:\n    assert 'no_such_name' in str(e)\n"
            "else:\n    raise SystemExit('no AttributeError')\n")
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=ROOT)
    assert run.returncode == 0, run.stderr[-2000:]


def _setup_module():
    spec = importlib.util.spec_from_file_location("specdec_setup_under_test", ROOT / "setup.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)  # setup() itself only runs as __main__
    return mod


def _fake_cmake(tmp_path: Path, version: str) -> Path:
    exe = tmp_path / "bin" / "cmake"
    exe.parent.mkdir(parents=True, exist_ok=True)
    exe.write_text(f"#!/bin/sh\necho 'cmake version {version}'\n")
    exe.chmod(0o755)
    return exe


def test_setup_prefers_the_cmake_package_over_an_old_cmake_on_path(tmp_path, monkeypatch):
    setup = _setup_module()
    pytest.importorskip("cmake")
    old = _fake_cmake(tmp_path, "3.25.1")  # Debian's /usr/bin/cmake
    monkeypatch.setenv("PATH", str(old.parent))
    monkeypatch.delenv("SPECDEC_CMAKE", raising=False)
    found = setup.find_cmake()
    assert found != str(old) and setup._cmake_version(found) >= setup.CMAKE_MIN


def test_setup_explains_a_too_old_cmake(tmp_path, monkeypatch):
    setup = _setup_module()
    old = _fake_cmake(tmp_path, "3.25.1")
    monkeypatch.setenv("PATH", str(old.parent))
    monkeypatch.delenv("SPECDEC_CMAKE", raising=False)
    monkeypatch.setitem(sys.modules, "cmake", None)  # the cmake package is not installed
    with pytest.raises(RuntimeError, match=r"needs CMake >= 3\.26 .*3\.25.*pip install 'cmake>=3\.26'"):
        setup.find_cmake()
    monkeypatch.setenv("SPECDEC_CMAKE", str(_fake_cmake(tmp_path / "new", "3.31.0")))
    assert setup.find_cmake().endswith("new/bin/cmake")


def test_cmakelists_states_the_minimum_setup_checks():
    setup = _setup_module()
    text = (ROOT / "CMakeLists.txt").read_text()
    m = re.search(r"cmake_minimum_required\(VERSION (\d+)\.(\d+)\)", text)
    assert m and (int(m.group(1)), int(m.group(2))) == setup.CMAKE_MIN
    assert "CMAKE_CUDA_STANDARD 20" in text
    assert f"cmake>={setup.CMAKE_MIN[0]}.{setup.CMAKE_MIN[1]}" in (ROOT / "pyproject.toml").read_text()
