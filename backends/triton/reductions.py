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
    shuffle where the pair sits in two lanes.  For a warp's 32 lanes this is the form to use:
    splitting a permuted tile there had every thread repeat the whole butterfly through shared
    memory (the Q/KV norm at one warp: 4096 sm_90 instructions, 320 LDS.128, against 2992).
    Across warps each step is a shared-memory round trip; ``_butterfly_split`` takes one."""
    return _rsum(tl.reshape(u, (BT, 2, H)), 1)


@triton.jit
def _regs8(v, BT: tl.constexpr, N: tl.constexpr):
    """The eight registers of each lane of ``v [BT, N, 8]``, in order, as ``[BT, N]`` tensors
    (``tl.split`` peels the lowest index bit first: 0 2 4 6 | 1 3 5 7, ...)."""
    ev, od = tl.split(tl.reshape(v, (BT, N, 2, 2, 2)))
    e04, e26 = tl.split(ev)
    e15, e37 = tl.split(od)
    e0, e4 = tl.split(e04)
    e2, e6 = tl.split(e26)
    e1, e5 = tl.split(e15)
    e3, e7 = tl.split(e37)
    return e0, e1, e2, e3, e4, e5, e6, e7


@triton.jit
def _fma_sq6(acc, a, b, c, d, e, f):
    """``acc`` + a² + ... + f², one ``fma`` each, left to right."""
    acc = tl.fma(a, a, acc)
    acc = tl.fma(b, b, acc)
    acc = tl.fma(c, c, acc)
    acc = tl.fma(d, d, acc)
    acc = tl.fma(e, e, acc)
    return tl.fma(f, f, acc)


@triton.jit
def _lane_chain_sq(v, BT: tl.constexpr, N: tl.constexpr, R: tl.constexpr):
    """``[BT, N, R] -> [BT, N]``: each lane's ``R`` registers (R = 1, 2, 4, 8 or 16) squared
    and added in register order, as a thread of ``tl.sum(v * v)`` accumulates them once LLVM
    contracts the multiply-adds: ``fma(e0, e0, fl(e1²))``, then ``fma(ek, ek, ·)``.  The
    registers are taken apart with ``tl.split`` (in-thread moves when a thread holds its R
    elements), never re-read from memory."""
    if R == 1:
        # fma(e, e, +0) = fl(e²): a product the compiler cannot fuse into the butterfly's first
        # addition (a plain e * e there became fma(e, e, other lane's square) on the GPU)
        e = tl.reshape(v, (BT, N))
        acc = tl.fma(e, e, tl.zeros_like(e))
    elif R == 2:
        e0, e1 = tl.split(v)
        acc = tl.fma(e0, e0, e1 * e1)
    elif R == 4:
        ev, od = tl.split(tl.reshape(v, (BT, N, 2, 2)))  # ev: 0, 2; od: 1, 3
        e0, e2 = tl.split(ev)
        e1, e3 = tl.split(od)
        acc = tl.fma(e3, e3, tl.fma(e2, e2, tl.fma(e0, e0, e1 * e1)))
    elif R == 8:
        e0, e1, e2, e3, e4, e5, e6, e7 = _regs8(v, BT, N)
        acc = _fma_sq6(tl.fma(e0, e0, e1 * e1), e2, e3, e4, e5, e6, e7)
    else:
        tl.static_assert(R == 16, "a lane holds 1, 2, 4, 8 or 16 elements")
        lo, hi = tl.split(tl.permute(tl.reshape(v, (BT, N, 2, 8)), (0, 1, 3, 2)))  # 0..7 | 8..15
        e0, e1, e2, e3, e4, e5, e6, e7 = _regs8(lo, BT, N)
        acc = _fma_sq6(tl.fma(e0, e0, e1 * e1), e2, e3, e4, e5, e6, e7)
        e0, e1, e2, e3, e4, e5, e6, e7 = _regs8(hi, BT, N)
        acc = _fma_sq6(tl.fma(e1, e1, tl.fma(e0, e0, acc)), e2, e3, e4, e5, e6, e7)
    return acc


@triton.jit
def _butterfly(u, BT: tl.constexpr, N: tl.constexpr):
    """``[BT, N] -> [BT]`` (N a power of two): the xor butterfly over N values (distances
    N/2, ..., 1), as a warp folds its lanes or the warp sums fold."""
    if N >= 32:
        u = _fold_halves(u, BT, 16)
    if N >= 16:
        u = _fold_halves(u, BT, 8)
    if N >= 8:
        u = _fold_halves(u, BT, 4)
    if N >= 4:
        u = _fold_halves(u, BT, 2)
    if N >= 2:
        u = _fold_halves(u, BT, 1)
    return tl.reshape(u, (BT,))


@triton.jit
def _row_sum_sq(x, BT: tl.constexpr, W: tl.constexpr, VB: tl.constexpr, VW: tl.constexpr,
                VP: tl.constexpr):
    """``Σx²`` of each row of the tile ``x [BT, W]`` (fp32, zero past the row's width; W and VP
    powers of two, ``VP <= W``) in the order of Triton's ``tl.sum(v * v)`` over a ``VB``-wide
    block laid out as vLLM's Q / KV norm lays it (``VW`` warps, ``VP`` contiguous elements per
    load; ``reference.output_quant.vllm_norm_layout``): thread t's element k is column
    ``(k // VP)·32·VW·VP + t·VP + k % VP``, each thread's chain (``_lane_chain_sq``), each warp's
    butterfly, then the warps' butterfly.

    Only the columns of the tile are visited: the block's columns past them are zero, and a
    zero adds nothing anywhere in that order (every partial sum is +0, positive or NaN, and
    a + 0 = a), so the threads and registers that would hold only zeros are left out.  The
    tile's own registers are used, so no element is read twice."""
    VT: tl.constexpr = 32 * VW
    VTX: tl.constexpr = VT if W >= VT * VP else W // VP  # threads that hold tile columns
    KQ: tl.constexpr = W // (VTX * VP)  # their loads of VP elements
    v = tl.reshape(x, (BT, KQ, VTX, VP))
    if KQ > 1:
        v = tl.permute(v, (0, 2, 1, 3))
    acc = _lane_chain_sq(tl.reshape(v, (BT, VTX, KQ * VP)), BT, VTX, KQ * VP)
    L: tl.constexpr = 32 if VTX >= 32 else VTX
    w = _butterfly(tl.reshape(acc, (BT * (VTX // L), L)), BT * (VTX // L), L)
    return _butterfly_split(tl.reshape(w, (BT, VTX // L)), BT, VTX // L)


@triton.jit
def _butterfly_split(u, BT: tl.constexpr, N: tl.constexpr):
    """``[BT, N] -> [BT]`` (N = 1, 2, 4 or 8): the same sums as ``_butterfly`` (distance N/2
    first), each step a ``tl.split`` of the axis it folds.  Where the N values lie in N warps,
    the compiler gathers them once through shared memory and adds them in every thread, one
    barrier in all; ``_fold_halves`` steps take a shared-memory round trip each (sm_90 SASS of
    the Q / KV norm at 8 warps: 1 barrier pair against 3)."""
    if N == 1:
        return tl.reshape(u, (BT,))
    elif N == 2:
        a, b = tl.split(u)
        return a + b
    elif N == 4:
        a, b = tl.split(tl.permute(tl.reshape(u, (BT, 2, 2)), (0, 2, 1)))
        a, b = tl.split(a + b)
        return a + b
    else:
        tl.static_assert(N == 8, "1, 2, 4 or 8 values")
        a, b = tl.split(tl.permute(tl.reshape(u, (BT, 2, 2, 2)), (0, 2, 3, 1)))
        a, b = tl.split(tl.permute(a + b, (0, 2, 1)))
        a, b = tl.split(a + b)
        return a + b
