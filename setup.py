"""Build specdec._C with CMake (the vLLM pattern): configure, build, copy the module.

Switches (environment):
  SPECDEC_BUILD_CUDA=0/1   force a CPU-only build / require the CUDA kernels
                           (default: build them when torch is a CUDA build and a CUDA
                           toolkit is found; otherwise CPU-only with a notice)
  TORCH_CUDA_ARCH_LIST     CUDA archs, default "8.0;9.0"
  SPECDEC_CUDA_HOME / CUDA_HOME   the toolkit, when it cannot be found on its own
  MAX_JOBS                 parallel compile jobs
  SPECDEC_CMAKE            the cmake binary (default: the `cmake` Python package's, >= 3.26)
"""
from __future__ import annotations

import glob
import os
import re
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

ROOT = Path(__file__).resolve().parent


def _is_toolkit(path: Path) -> bool:
    return (path / "bin" / "nvcc").is_file() and (path / "include" / "cuda_runtime.h").is_file()


def find_cuda_toolkit(cuda_version: str | None) -> Path | None:
    """Locate the CUDA toolkit without trusting `nvcc` on PATH to sit inside it."""
    candidates = [os.environ.get("SPECDEC_CUDA_HOME"), os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH")]
    nvcc = shutil.which("nvcc")
    if nvcc:
        # nvcc on PATH may be a wrapper script: ask nvcc itself where its toolkit is.
        try:
            dry = subprocess.run([nvcc, "--dryrun", "-c", "-x", "cu", os.devnull, "-o", os.devnull],
                                 capture_output=True, text=True, timeout=60)
            m = re.search(r"TOP=(\S+)", dry.stdout + dry.stderr)
            if m:
                candidates.append(m.group(1))
        except (OSError, subprocess.SubprocessError):
            pass
        candidates.append(str(Path(nvcc).resolve().parent.parent))
    if cuda_version:
        candidates.append(f"/usr/local/cuda-{cuda_version}")
    candidates.append("/usr/local/cuda")
    for c in candidates:
        if c and _is_toolkit(Path(c).resolve()):
            return Path(c).resolve()
    return None


def cuda_library_includes() -> list[str]:
    """Headers of the CUDA libraries (cusparse.h, cublas_v2.h...) that torch's wheels ship."""
    found = []
    for base in sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]:
        for inc in sorted(glob.glob(os.path.join(base, "nvidia", "*", "include"))) + sorted(
                glob.glob(os.path.join(base, "nvidia", "*", "*", "include"))):
            if inc not in found and os.path.isdir(inc):
                found.append(inc)
    return found


def arch_list() -> str:
    raw = os.environ.get("TORCH_CUDA_ARCH_LIST", "8.0;9.0")
    archs = []
    for a in re.split(r"[;\s,]+", raw.strip()):
        if not a:
            continue
        a = a.replace("+PTX", "")
        archs.append(a.replace(".", ""))
    return ";".join(archs)


CMAKE_MIN = (3, 26)  # the CUDA 20 dialect (CMAKE_CUDA_STANDARD 20); keep in step with CMakeLists.txt


def _cmake_version(exe: str) -> tuple[int, ...] | None:
    try:
        out = subprocess.run([exe, "--version"], capture_output=True, text=True, timeout=60).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    m = re.search(r"cmake version (\d+)\.(\d+)", out)
    return (int(m.group(1)), int(m.group(2))) if m else None


def find_cmake() -> str:
    """The cmake to run: the `cmake` Python package's own binary (a build requirement), found through the
    package rather than PATH -- `/path/to/venv/bin/pip install .` does not put the venv's bin on PATH, and
    Debian's /usr/bin/cmake (3.25) lacks the CUDA 20 dialect. SPECDEC_CMAKE overrides; a cmake on PATH
    is used only when it is new enough; otherwise a clear error says what to install."""
    tried = []
    candidates = []
    if os.environ.get("SPECDEC_CMAKE"):
        candidates.append(os.environ["SPECDEC_CMAKE"])
    try:
        import cmake as cmake_pkg  # the PyPI `cmake` package

        candidates.append(os.path.join(cmake_pkg.CMAKE_BIN_DIR, "cmake"))
    except (ImportError, AttributeError):
        pass
    on_path = shutil.which("cmake")
    if on_path:
        candidates.append(on_path)
    for exe in candidates:
        version = _cmake_version(exe)
        tried.append(f"{exe} ({'.'.join(map(str, version)) if version else 'not runnable'})")
        if version is not None and version >= CMAKE_MIN:
            return exe
    need = ".".join(map(str, CMAKE_MIN))
    raise RuntimeError(f"specdec needs CMake >= {need} (CUDA 20 dialect); found: {', '.join(tried) or 'none'}. "
                       f"Install it into this interpreter with `{sys.executable} -m pip install 'cmake>={need}'` "
                       f"or point SPECDEC_CMAKE at a cmake >= {need}.")


class CMakeExtension(Extension):
    def __init__(self, name: str) -> None:
        super().__init__(name, sources=[])


class CMakeBuild(build_ext):
    def build_extension(self, ext: Extension) -> None:
        import pybind11
        import torch

        torch_dir = Path(torch.__file__).resolve().parent
        want = os.environ.get("SPECDEC_BUILD_CUDA", "").strip()
        with_cuda = False
        toolkit = None
        if want != "0":
            if torch.version.cuda is None:
                if want == "1":
                    raise RuntimeError("SPECDEC_BUILD_CUDA=1 but the installed torch is a CPU-only build")
            else:
                toolkit = find_cuda_toolkit(torch.version.cuda)
                if toolkit is None:
                    msg = ("specdec: torch is a CUDA build but no CUDA toolkit (bin/nvcc + include/cuda_runtime.h) "
                           "was found; set SPECDEC_CUDA_HOME, or SPECDEC_BUILD_CUDA=0 for a CPU-only build")
                    if want == "1":
                        raise RuntimeError(msg)
                    print(msg + " -- building CPU-only", file=sys.stderr)
                else:
                    with_cuda = True
        build_dir = Path(self.build_temp).resolve() / ("cuda" if with_cuda else "cpu")
        build_dir.mkdir(parents=True, exist_ok=True)
        out_path = Path(self.get_ext_fullpath(ext.name)).resolve()
        includes = [str(torch_dir / "include"), str(torch_dir / "include" / "torch" / "csrc" / "api" / "include")]
        args = [
            f"-DCMAKE_BUILD_TYPE={os.environ.get('SPECDEC_BUILD_TYPE', 'Release')}",
            f"-DPython_EXECUTABLE={sys.executable}",
            f"-Dpybind11_DIR={pybind11.get_cmake_dir()}",
            f"-DTORCH_INCLUDE_DIRS={';'.join(includes)}",
            f"-DTORCH_LIB_DIR={torch_dir / 'lib'}",
            f"-DTORCH_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}",
            f"-DSPECDEC_TORCH_VERSION={torch.__version__}",
            f"-DSPECDEC_WITH_CUDA={'ON' if with_cuda else 'OFF'}",
        ]
        if with_cuda:
            args += [
                f"-DCMAKE_CUDA_COMPILER={toolkit / 'bin' / 'nvcc'}",
                f"-DCUDAToolkit_ROOT={toolkit}",
                f"-DCMAKE_CUDA_ARCHITECTURES={arch_list()}",
                f"-DSPECDEC_EXTRA_INCLUDE_DIRS={';'.join(cuda_library_includes())}",
            ]
        if shutil.which("ninja"):
            args.append("-GNinja")
        else:
            try:
                import ninja  # noqa: F401
                args += ["-GNinja", f"-DCMAKE_MAKE_PROGRAM={ninja.BIN_DIR}/ninja"]
            except ImportError:
                pass
        jobs = os.environ.get("MAX_JOBS", str(os.cpu_count() or 1))
        cmake = find_cmake()
        subprocess.run([cmake, str(ROOT)] + args, cwd=build_dir, check=True)
        subprocess.run([cmake, "--build", ".", "-j", jobs], cwd=build_dir, check=True)
        built = next(build_dir.glob("_C*.so"))
        out_path.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(built, out_path)


if __name__ == "__main__":
    setup(
        ext_modules=[CMakeExtension("specdec._C")],
        cmdclass={"build_ext": CMakeBuild},
    )
