"""Build and load the CPU kernels: plain C++ with OpenMP, compiled once per machine.

The kernels take raw pointers and strides (no torch headers), so a build takes
seconds, needs only a C++ compiler, and is cached under
``$DSV41_CACHE_DIR`` (default ``~/.cache/dsv41``) keyed by the source hash and
the compiler flags.  Without a compiler the build fails with a reason the
registry reports, and ops fall back to the next implementation.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform as _py_platform
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path

HERE = Path(__file__).resolve().parent

_lock = threading.Lock()
_libs: dict = {}
_errors: dict = {}
_warned = False
log = logging.getLogger("dsv41")


def _warn_once(reason: str) -> None:
    """The registry falls back to the reference, 100-1000x slower: say so once, loudly."""
    global _warned
    if _warned:
        return
    _warned = True
    log.warning(
        "dsv41: the CPU kernels could not be built, so ops on CPU tensors run the pure-PyTorch "
        "reference (100-1000x slower). Fix: install a C++ compiler with OpenMP (e.g. "
        "`apt-get install g++`) or point CXX at one. Reason: %s", reason.splitlines()[0])


def _compiler() -> str | None:
    for cxx in (os.environ.get("CXX"), "g++", "c++", "clang++"):
        if cxx and shutil.which(cxx):
            return cxx
    return None


def _flags() -> list[str]:
    flags = ["-O3", "-std=c++17", "-fPIC", "-shared", "-fopenmp", "-fno-math-errno"]
    # -ffp-contract=off: the kernels call fma() explicitly where the spec fuses,
    # and nowhere else, so the compiler must not contract on its own.
    flags.append("-ffp-contract=off")
    if os.environ.get("DSV41_CPU_MARCH", "native") != "none" and _py_platform.machine() in ("x86_64", "AMD64", "aarch64", "arm64"):
        flags.append("-march=" + os.environ.get("DSV41_CPU_MARCH", "native"))
    return flags


def cache_dir() -> Path:
    return Path(os.environ.get("DSV41_CACHE_DIR", Path.home() / ".cache" / "dsv41"))


def load(name: str, sources: list[str]) -> ctypes.CDLL:
    """Compile ``sources`` (files next to this one, plus every header here) into lib<name>.so and load it."""
    with _lock:
        if name in _libs:
            return _libs[name]
        if name in _errors:
            raise RuntimeError(_errors[name])
        try:
            lib = _build(name, sources)
        except Exception as exc:
            _errors[name] = f"CPU kernels could not be built: {exc}"
            _warn_once(str(exc))
            raise RuntimeError(_errors[name]) from None
        _libs[name] = lib
        return lib


def load_typed(name: str, sources: list[str], signatures: dict) -> ctypes.CDLL:
    """``load`` plus ctypes argument types (``{function: [argtypes]}``, every function returns int)."""
    lib = load(name, sources)
    with _lock:
        if not getattr(lib, "_dsv41_typed", False):
            for fn_name, argtypes in signatures.items():
                fn = getattr(lib, fn_name)
                fn.argtypes = argtypes
                fn.restype = ctypes.c_int
            lib._dsv41_typed = True
    return lib


def build_error(name: str, sources: list[str]) -> str | None:
    """None if the library builds and loads, else the reason (used by the capability sheet)."""
    try:
        load(name, sources)
    except RuntimeError as exc:
        return str(exc)
    return None


def _build(name: str, sources: list[str]) -> ctypes.CDLL:
    cxx = _compiler()
    if cxx is None:
        raise RuntimeError("no C++ compiler found (set CXX or install g++)")
    paths = [HERE / s for s in sources]
    headers = sorted(HERE.glob("*.h"))
    flags = _flags()
    h = hashlib.sha256()
    for p in paths + headers:
        h.update(p.name.encode())
        h.update(p.read_bytes())
    h.update(" ".join([cxx] + flags).encode())
    out_dir = cache_dir()
    out_dir.mkdir(parents=True, exist_ok=True)
    so = out_dir / f"lib{name}-{h.hexdigest()[:16]}.so"
    if not so.exists():
        with tempfile.TemporaryDirectory(dir=out_dir) as tmp:
            tmp_so = Path(tmp) / so.name
            cmd = [cxx, *flags, "-I", str(HERE), *map(str, paths), "-o", str(tmp_so)]
            proc = subprocess.run(cmd, capture_output=True, text=True)
            if proc.returncode != 0:
                raise RuntimeError(f"{' '.join(cmd)} failed:\n{proc.stderr[-2000:]}")
            os.replace(tmp_so, so)  # atomic: concurrent builders never load a half-written file
    return ctypes.CDLL(str(so))
