"""Test-only helpers that make Triton's CPU interpreter (``TRITON_INTERPRET=1``) bit-exact.

Out of the box the interpreter of Triton 3.8-3.9 is not bit-exact (guide README):
float32/bf16 -> fp8 casts round wrongly (a carry bug, no saturation, no NaN), float32 ->
bf16 truncates instead of rounding to nearest-even, ``tl.dot`` on bf16 multiplies raw bit
patterns, and ``log2`` on float32 goes through numpy's float32 routine.
``enable_exact_interpreter()`` patches private interpreter internals:

* ``triton.runtime.interpreter._convert_float`` -> conversions through torch casts for
  every float type torch knows, with the GPU's conversion rules where torch differs:
  fp32 -> e4m3fn saturates (|x| > 448 and +-inf -> +-448, NaN -> 0x7F, PTX
  ``cvt.rn.satfinite``), fp32 -> e4m3fnuz saturates to +-240 (NaN -> 0x80), fp32 -> e5m2
  saturates to +-57344, fp32 -> bf16 is RNE with every NaN -> 0x7FFF (``cvt.rn.bf16.f32``);
  upcasts are exact.  Explicit round-toward-zero requests keep Triton's own routine.
* ``InterpreterBuilder.create_fma`` -> one rounding for float32 (float64 product, sum
  rounded to odd, then float64 -> float32; the same construction as ``dsv41.core.codecs.fma32``).
* ``InterpreterBuilder.create_log2`` -> float32 log2 evaluated in float64, rounded once
  (``ceil(log2 x)`` in the kernels then equals ``dsv41.core.codecs.ceil_log2``).
* ``InterpreterBuilder.create_dot`` -> bf16 operands are widened to float32 first.
* ``JITFunction.__call__`` -> while an interpreted kernel runs, a compiled-mode
  ``@triton.jit`` function it calls (Triton's own ``tl.max``/``tl.sum``/... when triton was
  imported without ``TRITON_INTERPRET=1``, or a helper in another module) runs through
  the interpreter too, instead of raising "Cannot call @triton.jit'd outside of the
  scope of a kernel".  Outside interpreted kernels the original (raising) call is kept.
  With this, the interpreter works whether or not ``TRITON_INTERPRET`` was set before
  triton was imported.

It is private API: the patch is pinned to the Triton versions it was verified with
(``VERIFIED_TRITON``), raises if a hook point moved, and self-checks after patching.

``load_interpreted(module)`` imports a *private* copy of a kernel module with
``TRITON_INTERPRET=1`` set only for that import, so its ``@triton.jit`` functions are
interpreter functions while the process (and ``sys.modules``) keeps the normal ones.
Kernel modules loaded this way must keep every ``@triton.jit`` helper they call in the
same file (or list the helper modules in ``also``).
"""

from __future__ import annotations

import contextlib
import importlib
import os
import sys

import numpy as np
import torch

__all__ = [
    "VERIFIED_TRITON",
    "interpreter_unsupported_reason",
    "enable_exact_interpreter",
    "exact_interpreter_enabled",
    "load_interpreted",
    "interpreter_available",
]

# Triton versions whose interpreter internals this module was checked against: with these the
# patched interpreter reproduces the reference bit for bit.  Triton 3.3-3.7 have the same hook
# points, but with them the patched interpreter still wrote the e4m3 NaN code where the GPU
# saturates to 448 (seen with 3.3.1 and 3.6.0), so the interpreter tests are skipped there
# rather than reporting mismatches that are the interpreter's.
VERIFIED_TRITON = ("3.8.", "3.9.")

_ENABLED = False


def interpreter_available() -> bool:
    """True when triton imports (the interpreter needs nothing else)."""
    try:
        import triton  # noqa: F401
    except Exception:
        return False
    return True


def interpreter_unsupported_reason() -> str | None:
    """None when the exact interpreter can run here, else one line saying why not."""
    try:
        import triton
    except Exception as exc:
        return f"Triton is not importable ({type(exc).__name__}: {exc}); pip install 'triton>=3.8' to run them"
    if not triton.__version__.startswith(VERIFIED_TRITON):
        return (f"Triton {triton.__version__} is not one the exact-interpreter patch was verified with "
                f"({', '.join(v.rstrip('.') for v in VERIFIED_TRITON)})")
    return None


def _check_version(triton) -> None:
    v = triton.__version__
    if not v.startswith(VERIFIED_TRITON):
        raise RuntimeError(
            f"tests/triton_interp.py patches private Triton interpreter internals and was "
            f"verified with Triton {VERIFIED_TRITON}, not {v}. Re-verify the hook points "
            f"(_convert_float, InterpreterBuilder.create_fma/create_log2/create_dot) and "
            f"extend VERIFIED_TRITON."
        )


# --------------------------------------------------------------------------------------
# float conversion through torch
# --------------------------------------------------------------------------------------


def _torch_dtype(tl, dt):
    table = {
        tl.float16: torch.float16,
        tl.bfloat16: torch.bfloat16,
        tl.float32: torch.float32,
        tl.float64: torch.float64,
        tl.float8e4nv: torch.float8_e4m3fn,
        tl.float8e4b8: torch.float8_e4m3fnuz,
        tl.float8e5: torch.float8_e5m2,
        tl.float8e5b16: torch.float8_e5m2fnuz,
    }
    return table.get(dt)


_UINT = {8: np.uint8, 16: np.uint16, 32: np.uint32, 64: np.uint64}
_TORCH_UINT = {8: torch.uint8, 16: torch.int16, 32: torch.int32, 64: torch.int64}


def _make_convert(tl, ir, original):
    def _convert_float(input, input_dtype, output_dtype, rounding_mode):
        src = _torch_dtype(tl, input_dtype)
        dst = _torch_dtype(tl, output_dtype)
        rtz = rounding_mode is not None and rounding_mode != ir.ROUNDING_MODE.RTNE
        if src is None or dst is None or rtz:
            return original(input, input_dtype, output_dtype, rounding_mode)
        in_bits = input_dtype.primitive_bitwidth
        out_bits = output_dtype.primitive_bitwidth
        raw = np.ascontiguousarray(input).view(_UINT[in_bits]).reshape(-1)
        t = torch.from_numpy(raw.copy()).view(_TORCH_UINT[in_bits]).view(src)
        if dst in (torch.float8_e4m3fn, torch.float8_e4m3fnuz, torch.float8_e5m2,
                   torch.float8_e5m2fnuz) and out_bits < in_bits:
            nan = torch.isnan(t)
            m = torch.finfo(dst).max
            y = torch.where(nan, torch.zeros_like(t), t.clamp(-m, m))
            out = y.to(dst).view(torch.uint8)
            nan_byte = 0x7F if dst in (torch.float8_e4m3fn, torch.float8_e5m2) else 0x80
            out = torch.where(nan, torch.full_like(out, nan_byte), out)
        elif dst == torch.bfloat16 and out_bits < in_bits:
            x = t
            bits = x.to(torch.bfloat16).view(torch.int16)
            out = torch.where(torch.isnan(x), torch.full_like(bits, 0x7FFF), bits)
        else:
            out = t.to(dst).view(_TORCH_UINT[out_bits])
        res = out.numpy().view(_UINT[out_bits]).reshape(np.shape(input))
        return res

    return _convert_float


# --------------------------------------------------------------------------------------
# single-rounding fma, float64-evaluated log2, bf16 dot
# --------------------------------------------------------------------------------------


def _fma_f32(x, y, z):
    """fl32(x*y + z) with one rounding (float64 product is exact; sum rounded to odd)."""
    x, y, z = np.broadcast_arrays(
        np.asarray(x, np.float32), np.asarray(y, np.float32), np.asarray(z, np.float32)
    )
    with np.errstate(all="ignore"):
        p = x.astype(np.float64) * y.astype(np.float64)
        c = z.astype(np.float64)
        s = p + c
        bv = s - p
        err = (p - (s - bv)) + (c - bv)
        inexact = (err != 0) & np.isfinite(s)
        even = (s.view(np.int64) & 1) == 0
        toward = np.where(err > 0, np.inf, -np.inf)
        s = np.where(inexact & even, np.nextafter(s, toward), s)
        return s.astype(np.float32)


def _install(interp, tl, ir):
    B = interp.InterpreterBuilder
    original_convert = interp._convert_float
    TensorHandle = interp.TensorHandle

    def create_fma(self, x, y, z):
        if z.data.dtype == np.float32:
            return TensorHandle(_fma_f32(x.data, y.data, z.data), z.dtype.scalar)
        return B._dsv41_orig_fma(self, x, y, z)

    def create_log2(self, arg):
        if arg.data.dtype == np.float32:
            with np.errstate(all="ignore"):
                out = np.log2(arg.data.astype(np.float64)).astype(np.float32)
            return TensorHandle(out, arg.dtype.scalar)
        return B._dsv41_orig_log2(self, arg)

    def create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        def widen(h):
            if h.dtype.scalar == tl.bfloat16:
                f = (h.data.astype(np.uint32) << np.uint32(16)).view(np.float32)
                return TensorHandle(f, tl.float32)
            return h

        return B._dsv41_orig_dot(self, widen(a), widen(b), d, input_precision,
                                 max_num_imprecise_acc)

    _install_jit_dispatch(interp)

    B._dsv41_orig_fma = B.create_fma
    B._dsv41_orig_log2 = B.create_log2
    B._dsv41_orig_dot = B.create_dot
    B.create_fma = create_fma
    B.create_log2 = create_log2
    B.create_dot = create_dot
    interp._dsv41_orig_convert_float = original_convert
    interp._convert_float = _make_convert(tl, ir, original_convert)


def _install_jit_dispatch(interp) -> None:
    import threading

    from triton.runtime.jit import JITFunction

    GE = interp.GridExecutor
    depth = threading.local()
    orig_ge_call = GE.__call__
    orig_jit_call = JITFunction.__call__

    def ge_call(self, *args, **kwargs):
        depth.n = getattr(depth, "n", 0) + 1
        try:
            return orig_ge_call(self, *args, **kwargs)
        finally:
            depth.n -= 1

    def jit_call(self, *args, **kwargs):
        if getattr(depth, "n", 0) <= 0:
            return orig_jit_call(self, *args, **kwargs)
        f = self.__dict__.get("_dsv41_interpreted")
        if f is None:
            f = interp.InterpretedFunction(self.fn)
            self.__dict__["_dsv41_interpreted"] = f
        return f(*args, **kwargs)

    GE.__call__ = ge_call
    JITFunction.__call__ = jit_call


def _self_check(interp, tl) -> None:
    """A few conversions and one fma through the patched hooks, against torch / exact math."""
    xs = np.array([124.29, 448.0, 470.0, -1e9, np.inf, -np.inf, np.nan, 1e-3, -0.0, 0.0078125,
                   2.0**-10, 3.0e-3, -3.0e-3, 1.0 + 2**-8 + 2**-20], dtype=np.float32)
    got = interp._convert_float(xs, tl.float32, tl.float8e4nv, None)
    t = torch.from_numpy(xs.copy())
    exp = torch.where(torch.isnan(t), 0.0, t.clamp(-448, 448)).to(torch.float8_e4m3fn).view(torch.uint8)
    exp = torch.where(torch.isnan(t), torch.full_like(exp, 0x7F), exp).numpy()
    if not np.array_equal(got.astype(np.uint8), exp):
        raise RuntimeError(f"patched fp32->e4m3fn conversion is wrong: {got} vs {exp}")
    got = interp._convert_float(xs, tl.float32, tl.bfloat16, None)
    exp = t.to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16).copy()
    exp[np.isnan(xs)] = 0x7FFF
    if not np.array_equal(got.astype(np.uint16), exp):
        raise RuntimeError("patched fp32->bf16 conversion is wrong")
    a = np.array([1 + 2**-23], np.float32)
    b = np.array([1 - 2**-23], np.float32)
    c = np.array([-1.0], np.float32)
    if float(_fma_f32(a, b, c)[0]) != -(2.0**-46):
        raise RuntimeError("single-rounding fma self-check failed")


def enable_exact_interpreter() -> None:
    """Patch Triton's interpreter for bit-exact conversions, fma and log2 (idempotent).

    Affects only code that runs under the interpreter.  Raises RuntimeError on an
    unverified Triton version or when a hook point is missing.
    """
    global _ENABLED
    if _ENABLED:
        return
    import triton
    import triton.language as tl

    _check_version(triton)
    try:
        from triton.runtime import interpreter as interp
        from triton._C.libtriton import ir
    except Exception as exc:  # pragma: no cover - depends on the Triton build
        raise RuntimeError(f"Triton interpreter hook points moved: {exc!r}") from exc
    missing = [
        name
        for name, ok in (
            ("_convert_float", callable(getattr(interp, "_convert_float", None))),
            ("TensorHandle", hasattr(interp, "TensorHandle")),
            ("InterpreterBuilder", hasattr(interp, "InterpreterBuilder")),
            ("InterpreterBuilder.create_fma", hasattr(getattr(interp, "InterpreterBuilder", None), "create_fma")),
            ("InterpreterBuilder.create_log2", hasattr(getattr(interp, "InterpreterBuilder", None), "create_log2")),
            ("InterpreterBuilder.create_dot", hasattr(getattr(interp, "InterpreterBuilder", None), "create_dot")),
            ("ir.ROUNDING_MODE", hasattr(ir, "ROUNDING_MODE")),
            ("GridExecutor", hasattr(interp, "GridExecutor")),
            ("InterpretedFunction", hasattr(interp, "InterpretedFunction")),
        )
        if not ok
    ]
    if missing:
        raise RuntimeError(f"Triton interpreter hook points moved (missing: {missing})")
    import inspect

    params = list(inspect.signature(interp._convert_float).parameters)
    if params != ["input", "input_dtype", "output_dtype", "rounding_mode"]:
        raise RuntimeError(f"Triton interpreter _convert_float signature changed: {params}")
    from triton.runtime.jit import JITFunction

    if not getattr(interp, "_dsv41_patched", False):
        src = inspect.getsource(JITFunction.__call__)
        if "outside of the scope of a kernel" not in src:
            raise RuntimeError("Triton JITFunction.__call__ changed; re-verify the jit dispatch hook")
        _install(interp, tl, ir)
        interp._dsv41_patched = True
    _self_check(interp, tl)
    _ENABLED = True


def exact_interpreter_enabled() -> bool:
    return _ENABLED


@contextlib.contextmanager
def _env(key: str, value: str):
    old = os.environ.get(key)
    os.environ[key] = value
    try:
        yield
    finally:
        if old is None:
            del os.environ[key]
        else:
            os.environ[key] = old


def load_interpreted(module: str, also: tuple = ()):
    """Import a private copy of ``module`` whose ``@triton.jit`` functions run in the interpreter.

    ``TRITON_INTERPRET=1`` is set only while the copy is imported (Triton reads it when a
    function is decorated); ``sys.modules`` is restored afterwards, so the rest of the
    process keeps the compiled-mode module.  ``also`` names further modules (e.g. ones
    holding shared ``@triton.jit`` helpers) to re-import fresh for the copy.
    """
    names = (module,) + tuple(also)
    saved = {n: sys.modules.pop(n) for n in names if n in sys.modules}
    # importing a submodule also sets it as an attribute of its parent package
    parents = {}
    for n in names:
        pkg, _, child = n.rpartition(".")
        if pkg and pkg in sys.modules:
            parents[n] = (sys.modules[pkg], child, getattr(sys.modules[pkg], child, _MISSING))
    try:
        with _env("TRITON_INTERPRET", "1"):
            for n in reversed(names):
                importlib.import_module(n)
            mod = sys.modules[module]
    finally:
        for n in names:
            sys.modules.pop(n, None)
        sys.modules.update(saved)
        for pkg_mod, child, old in parents.values():
            if old is _MISSING:
                if hasattr(pkg_mod, child):
                    delattr(pkg_mod, child)
            else:
                setattr(pkg_mod, child, old)
    return mod


_MISSING = object()
