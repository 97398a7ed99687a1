"""Builds the C++ kernels with the host's compiler on first use and registers them with XLA:CPU.

The shared library goes to ``build_dir`` under a name hashed from the sources, the compiler,
jaxlib's FFI headers and the CPU (it is built with -march=native), so a changed kernel, a new
jaxlib or another machine's cache gets a new file; a temporary directory when ``build_dir`` is
None. Several processes may build at once: each writes its own file and renames it in place.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile

import jax

logger = logging.getLogger(__name__)

_HERE = os.path.dirname(os.path.abspath(__file__))
_SOURCES = tuple(os.path.join(_HERE, name) for name in ("paged_decode.cc", "gguf_matmul.cc"))
# Included by the sources: hashed with them, so a change rebuilds.
_HEADERS = tuple(os.path.join(_HERE, name) for name in (
    "paged_decode_fp8.h", "paged_decode_fp8_avx2.h", "paged_decode_fp8_avx512.h", "gguf_kquants.h",
    "gguf_matmul_lanes.h", "gguf_matmul_il.h", "gguf_matmul_kil.h", "gguf_matmul_f32.h", "thread_split.h"))
# (XLA custom-call target, symbol the sources export)
TARGETS = (("jaxlm_paged_decode", "JaxlmPagedDecode"), ("jaxlm_gguf_matmul", "JaxlmGgufMatmul"))
# -ffast-math for the compile only (vectorized expf, reassociated sums): linked with it, GCC adds
# crtfastmath.o, whose constructor turns on flush-to-zero for the whole process when the library
# loads (subnormals read as 0 everywhere: numpy, XLA, hypothesis noticed).
_COMPILE = ["-O3", "-march=native", "-ffast-math", "-std=c++17", "-fPIC", "-fopenmp-simd"]
_LINK = ["-shared", "-fPIC"]


class KernelBuildError(RuntimeError):
    """The C++ kernels could not be built or loaded here (no compiler, or it failed)."""


def _compiler() -> str:
    cxx = os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++") or shutil.which("clang++")
    if not cxx:
        raise KernelBuildError("no C++ compiler found (set $CXX, or install g++)")
    return cxx


def _cpu_id() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next((line for line in f if line.startswith(("model name", "flags"))), "")
    except OSError:
        return platform.processor()


def _library_path(build_dir: str, cxx: str) -> str:
    h = hashlib.sha256()
    for source in _SOURCES + _HEADERS:
        with open(source, "rb") as f:
            h.update(f.read())
    h.update(repr((cxx, _COMPILE, _LINK, jax.ffi.include_dir(), jax.__version__, platform.machine(), _cpu_id())).encode())
    return os.path.join(build_dir, f"jaxlm_cpu_kernels-{h.hexdigest()[:16]}.so")


def _run(cmd: list[str], cxx: str) -> None:
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise KernelBuildError(f"{cxx} failed to run: {e}") from e
    if done.returncode != 0:
        raise KernelBuildError(f"{cxx} failed ({done.returncode}):\n{done.stderr[-4000:]}")


def _build(path: str, cxx: str) -> None:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with tempfile.TemporaryDirectory(dir=os.path.dirname(path)) as tmp:
        lib = os.path.join(tmp, "kernels.so")
        logger.info("Building the CPU kernels with %s into %s", cxx, path)
        objs = []
        for source in _SOURCES:
            objs.append(os.path.join(tmp, os.path.basename(source) + ".o"))
            _run([cxx, *_COMPILE, "-I", jax.ffi.include_dir(), "-c", source, "-o", objs[-1]], cxx)
        _run([cxx, *_LINK, *objs, "-o", lib], cxx)
        os.replace(lib, path)


@functools.lru_cache(maxsize=None)
def load_cpu_kernels(build_dir: str | None = None) -> str:
    """Builds (once per build_dir and source) and registers the kernels; returns the library's
    path. Raises KernelBuildError when that is not possible on this machine."""
    cxx = _compiler()
    path = _library_path(build_dir or tempfile.mkdtemp(prefix="jaxlm_kernels_"), cxx)
    if not os.path.exists(path):
        _build(path, cxx)
    try:
        lib = ctypes.cdll.LoadLibrary(path)
    except OSError as e:
        raise KernelBuildError(f"cannot load {path}: {e}") from e
    for target, symbol in TARGETS:
        try:
            jax.ffi.register_ffi_target(target, jax.ffi.pycapsule(getattr(lib, symbol)), platform="cpu")
        except jax.errors.JaxRuntimeError as e:
            # Registered already in this process from another build directory: the same source
            # (its hash names the file), so the first registration serves.
            if "Duplicate FFI handler" not in str(e):
                raise
    return path
