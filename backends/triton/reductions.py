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


@triton.jit
def _fold_halves(u, BT: tl.constexpr, H: tl.constexpr):
    """``[BT, 2H] -> [BT, H]``: lane j plus lane j + H (one step of a warp's xor butterfly; fp
    addition commutes, so every lane of the pair holds this value).  A reduction over an axis
    of two, so the order cannot matter and the compiler keeps whatever layout it has: a warp
    shuffle where the pair sits in two lanes (sm_90 SASS of the Q/KV norm at one warp: 2992
    instructions, 73 SHFL.BFLY, no shared memory; splitting a permuted tile instead took 4096
    with 320 LDS.128 and 1275 FADD, every thread repeating the whole butterfly)."""
    return _rsum(tl.reshape(u, (BT, 2, H)), 1)


@triton.jit
def _lane_sums4(x, BT: tl.constexpr, N: tl.constexpr):
    """``[BT, 4N] -> [BT, N]``: each lane's four contiguous squares added left to right, as a
    thread of Triton's ``tl.sum(v * v)`` accumulates its registers once LLVM contracts the
    multiply-adds: ``fma(e0, e0, fl(e1²))``, then ``fma(e2, e2, ·)``, ``fma(e3, e3, ·)``
    (``dsv41.core.gpu_approx.tl_sum_sq``)."""
    q = tl.reshape(x, (BT, N, 2, 2))
    a, b = tl.split(q)  # a: elements 0, 2 of each lane; b: 1, 3
    e0, e2 = tl.split(a)
    e1, e3 = tl.split(b)
    acc = tl.fma(e0, e0, e1 * e1)
    acc = tl.fma(e2, e2, acc)
    return tl.fma(e3, e3, acc)


@triton.jit
def _warp_sum32(u, BT: tl.constexpr):
    """``[BT, 32] -> [BT]``: the xor butterfly of a warp (distances 16, 8, 4, 2, 1)."""
    u = _fold_halves(u, BT, 16)
    u = _fold_halves(u, BT, 8)
    u = _fold_halves(u, BT, 4)
    u = _fold_halves(u, BT, 2)
    u = _fold_halves(u, BT, 1)
    return tl.reshape(u, (BT,))


@triton.jit
def _norm_sum512(x, BT: tl.constexpr):
    """``[BT, 512] -> [BT]``: Σx² of each row in the order of vLLM's compressor norm
    (``tl.sum(v * v, 0)`` over a 512-wide fp32 row with 4 warps): thread 32w + l holds elements
    128w + 4l .. + 3 (``_lane_sums4``), each warp folds its 32 lanes (``_warp_sum32``), then the
    four warp sums fold as lanes do: (w0 + w2) + (w1 + w3)."""
    lanes = tl.reshape(_lane_sums4(x, BT, 128), (BT * 4, 32))
    w = tl.reshape(_warp_sum32(lanes, BT * 4), (BT, 4))
    w = _fold_halves(w, BT, 2)
    return tl.reshape(_fold_halves(w, BT, 1), (BT,))
