"""Reductions shared by the Triton kernel files.

``tl.sum``/``tl.max`` are written through ``tl.reduce`` so that a private interpreted copy of
a kernel module (``tests/triton_interp.load_interpreted``) never calls a compiled-mode
``triton.language.standard`` wrapper; Triton's own combine functions are used where they exist
(the interpreter recognises them and reduces with numpy).
"""

import triton
import triton.language as tl


@triton.jit
def _add(a, b):
    return a + b


@triton.jit
def _maxnum(a, b):
    return tl.maximum(a, b)


_SUM_COMBINE = getattr(tl.standard, "_sum_combine", None) or _add
_MAX_COMBINE = getattr(tl.standard, "_elementwise_max", None) or _maxnum


@triton.jit
def _rsum(x, axis: tl.constexpr):
    """``tl.sum`` through ``tl.reduce``."""
    return tl.reduce(x, axis, _SUM_COMBINE)


@triton.jit
def _rmax(x, axis: tl.constexpr):
    """``tl.max`` (max.f32 / maxnum: a NaN operand loses) through ``tl.reduce``."""
    return tl.reduce(x, axis, _MAX_COMBINE)


@triton.jit
def _rcumsum(x, axis: tl.constexpr):
    """Inclusive ``tl.cumsum`` through ``tl.associative_scan`` (see the module docstring)."""
    return tl.associative_scan(x, axis, _SUM_COMBINE)
