"""Triton kernels of the RoPE / quantization ops (spec rope_quant_ops.md §1, §2, §4-§6).

Shared by the cuda:triton, rocm and xpu backends.  The source is parametrized by
constexprs instead of being copied per vendor:

* ``FNUZ``   — e4m3 flavour: OCP e4m3fn (max 448) or FNUZ e4m3fnuz (max 224, gfx942).
  NVIDIA Triton has no ``float8e4b8``, so FNUZ is always encoded with integer bit
  operations (``_e4m3_code``); OCP uses the hardware convert where ``CVT_HW``.
* ``CVT_HW`` — use the hardware fp32 -> bf16 / e4m3fn converts (NVIDIA, where they are
  RNE + saturating, verified on the H200).  Off, every conversion is done in integer
  arithmetic with the same results (ROCm / XPU, and the Triton interpreter, whose own
  float conversions are not exact).  NaN handling is pinned explicitly either way.  The
  launcher sets it per launch from ``conversions`` (the one switch of both kernel files).
* RoPE always uses ``tl.fma`` with the product pinned (docs/kernel_contract.md, "RoPE
  contraction"), so every vendor rounds the same way: the indexer Q fuses ``e * s`` into its
  odd lane, ``fma(e, s, RN32(o * c))``, as vLLM's indexer-Q kernels compile on NVIDIA; scale exponents are computed from fp32 bits (no ``log2``): the
  fp32-log2 ceiling "(L)" of §1.5 is reproduced exactly with an integer rule
  (``_ceil_exp_log``), the exact ceiling "(B)" with ``_ceil_exp_bits``.
* NaN never enters an amax (explicitly masked: max.f32 / fmax semantics of §2.7, F3).

Numerics are byte-identical to ``dsv41.reference`` (indexer.py, output_quant.py), which is
the CUDA (Triton, SM90) behaviour; the RMSNorm of ``fused_q_kv_rmsnorm_quant`` sums in the
order of vLLM's kernel and uses the GPU's rsqrt (``_vllm_mean_sq``, ``numerics._rsqrt_approx``).

Launchers follow docs/kernel_contract.md: validated inputs, preallocated outputs written in
place, return None, one kernel launch, no host synchronisation and no allocation (only
dtype views of the given tensors), so they are CUDA-graph capture safe.  Each program
handles a 2-D/3-D tile (several tokens x heads), offsets are int64, masks keep every
store inside the outputs.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from dsv41.core.formats import scale_byte_strides
from dsv41.reference.output_quant import vllm_norm_layout

from . import conversions, launch, tuning
from .bound import bind
from .positions import table_row
from .reductions import _rmax, _row_sum_sq
from .numerics import (  # noqa: F401
    _neg_sign_bit,
    _rn_bf16,
    _bf16_bits_i32,
    _e4m3_code,
    _e4m3_pair,
    _word_halves,
    _ceil_exp_bits,
    _e2m1_code_search,
    _e2m1x2_bf16,
    _ceil_exp_log,
    _pow2_of,
    _inv_pow2_of,
    _rsqrt_approx,
    _div_full,
)

__all__ = [
    "fused_indexer_q_rope_quant",
    "fused_inv_rope_fp8_quant",
    "fused_q_kv_rmsnorm_quant",
    "pad_fused_q_heads",
    "use_hw_convert",
]


def _f32(v: float) -> float:
    """fl32(v) as a Python float (how the constant enters fp32 arithmetic)."""
    return float(torch.tensor(v, dtype=torch.float32))


# Constants the kernels use, as the exact fp32 values they take in fp32 arithmetic.
_INV_448 = tl.constexpr(_f32(1.0 / 448.0))  # RN32(1/448)
_INV_6 = tl.constexpr(_f32(1.0 / 6.0))  # RN32(1/6)
_EPS_Q = tl.constexpr(_f32(1e-4))  # amax floor of the FP8 indexer Q (§2.2)
_EPS_O = tl.constexpr(_f32(1e-10))  # amax floor of the inverse-RoPE quantizer (§4.1)
_MXFP4_FLOOR = tl.constexpr(6.0 * 2.0**-126)  # MXFP4 block amax floor (§1.8), exact in fp32



# Launch-shape overrides per op name, at every size (the sweep and the tests), e.g.
# TUNE["fused_indexer_q_rope_quant"] = {"BLOCK_T": 2, "BLOCK_H": 64, "num_warps": 8}.
# Keys: indexer Q / inverse RoPE: BLOCK_T, BLOCK_H, num_warps; query quant: BLOCK_T,
# num_warps; pad: BLOCK_R, num_warps.  The one override table of ``tuning``; the measured
# shapes are ``tuning.TABLE``.
TUNE: dict = tuning.OVERRIDES


def _launch_shape(op: str, tokens: int, variant: str | None = None) -> dict | None:
    """TUNE[op], else the measured shape for this size (``tuning.TABLE``), else None (the
    heuristics)."""
    return tuning.shape(op if variant is None else f"{op}:{variant}", tokens, override=op)


def use_hw_convert(device: torch.device) -> bool:
    """Hardware float converts for a launch on ``device`` (``conversions.integer_path``)."""
    return not conversions.integer_path(device)


def use_ptx(device: torch.device) -> bool:
    """Inline PTX (the paired e2m1 encoder): NVIDIA GPUs on the hardware path only."""
    return conversions.ptx(device)


def _pow2(n: int) -> int:
    return launch.pow2(n)


# ============================================================= §2 fused_indexer_q_rope_quant


@triton.jit
def _pair_tile(q_ptr, row, P0: tl.constexpr, NP: tl.constexpr, m, WORDS: tl.constexpr):
    """bf16 elements (2i, 2i+1), i = P0 .. P0+NP-1, of the rows at ``row [BT, BH]`` as fp32
    (e, o) ``[BT, BH, NP]`` (0 where ``m`` is off).  WORDS: ``q_ptr`` is an int32 view and
    ``row`` counts words -- one 4-byte load per pair, whose halves are the two values (no
    split of interleaved lanes); else an int16 view with ``row`` in elements."""
    i = tl.arange(0, NP)[None, None, :]
    m3 = m[:, :, None]
    if WORDS:
        w = tl.load(q_ptr + row[:, :, None] + P0 + i, mask=m3, other=0)
    else:
        k = tl.arange(0, 2)[None, None, None, :]
        h = tl.load(q_ptr + row[:, :, None, None] + 2 * (P0 + i[:, :, :, None]) + k,
                    mask=m3[:, :, :, None], other=0).to(tl.int32)
        lo, hi = tl.split(h)
        w = (lo & 0xFFFF) | (hi << 16)
    return _word_halves(w)


@triton.jit
def _mxfp4_blocks(e, o, out_ptr, orow, b_ptr, th_m, PTX: tl.constexpr,
                  BLOCK_T: tl.constexpr, BLOCK_H: tl.constexpr, NP: tl.constexpr,
                  NLIM: tl.constexpr):
    """MXFP4 (§1.8) of pairs ``[BT, BH, NP]``: blocks of 32 elements = 16 pairs, one packed
    byte per pair at ``orow + i`` (element 2k in the low nibble), ue8m0 codes at ``b_ptr``;
    only the first NLIM pairs (NLIM / 16 blocks) are stored."""
    NB: tl.constexpr = NP // 16
    e4 = tl.reshape(e, [BLOCK_T, BLOCK_H, NB, 16])
    o4 = tl.reshape(o, [BLOCK_T, BLOCK_H, NB, 16])
    amax = _rmax(tl.maximum(tl.abs(e4), tl.abs(o4)), axis=3)
    E = _ceil_exp_bits(tl.maximum(amax, _MXFP4_FLOOR) * _INV_6)
    E = tl.minimum(tl.maximum(E, -127), 127)
    inv = _inv_pow2_of(E)[:, :, :, None]
    if PTX:
        # e, o are bf16 values (the input, or the RoPE output after its bf16 round trip)
        # and inv a power of two: the products are bf16 values too
        byte = _e2m1x2_bf16(e4 * inv, o4 * inv)
    else:
        byte = _e2m1_code_search(e4 * inv) | (_e2m1_code_search(o4 * inv) << 4)
    byte = tl.reshape(byte, [BLOCK_T, BLOCK_H, NP]).to(tl.uint8)
    i = tl.arange(0, NP)[None, None, :]
    tl.store(out_ptr + orow[:, :, None] + i, byte, mask=th_m[:, :, None] & (i < NLIM))
    b = tl.arange(0, NB)[None, None, :]
    tl.store(b_ptr + b, (E + 127).to(tl.uint8), mask=th_m[:, :, None] & (b < NLIM // 16))


@triton.jit
def _table_row(p_ptr, mask, rows, IDX: tl.constexpr):
    """The cos/sin row of each position at ``p_ptr`` (``positions.table_row``), as IDX."""
    return table_row(tl.load(p_ptr, mask=mask, other=0).to(tl.int64), rows).to(IDX)


@triton.jit(do_not_specialize=["T", "H"])
def _indexer_q_kernel(
    pos_ptr, s_pos,
    q_ptr, s_q0, s_q1,
    cs_ptr, s_cs, cs_rows,
    w_ptr, s_w0, s_w1,
    out_ptr, s_o0, s_o1,
    sc_ptr, s_sc0, s_sc1,
    wo_ptr, s_wo0, s_wo1,
    T, H, softmax_scale, head_scale,
    D: tl.constexpr, NOPE: tl.constexpr, HALF: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_P: tl.constexpr,
    SPLIT: tl.constexpr, USE_FP4: tl.constexpr, FNUZ: tl.constexpr, CVT_HW: tl.constexpr,
    WO_BF16: tl.constexpr, OFF64: tl.constexpr, WORDS: tl.constexpr, PTX: tl.constexpr,
    PDL: tl.constexpr = False, RELOAD_NOPE: tl.constexpr = False,
):
    launch.pdl_prologue(PDL)
    IDX: tl.constexpr = tl.int64 if OFF64 else tl.int32
    FP8_MAX: tl.constexpr = 224.0 if FNUZ else 448.0
    t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    tm = t < T
    th_m = tm[:, None] & (h < H)[None, :]  # [BT, BH]
    ti = t.to(IDX)
    hi = h.to(IDX)
    qrow = (ti * s_q0)[:, None] + (hi * s_q1)[None, :]
    orow = (ti * s_o0)[:, None] + (hi * s_o1)[None, :]
    pos = _table_row(pos_ptr + ti * s_pos, tm, cs_rows, IDX)
    w = tl.load(w_ptr + (ti * s_w0)[:, None] + (hi * s_w1)[None, :], mask=th_m, other=0.0).to(tl.float32)
    wo_off = (ti * s_wo0)[:, None] + (hi * s_wo1)[None, :]

    if SPLIT and USE_FP4:
        # NOPE and R powers of two (production 64 + 64), MXFP4: both halves are whole
        # blocks of 32; the pairs come as words (``_pair_tile``), only the RoPE half is
        # rotated, every pair writes one byte.
        qrow_p = (ti * s_q0)[:, None] + (hi * s_q1)[None, :]  # in the view's units
        ne, no = _pair_tile(q_ptr, qrow_p, 0, NOPE // 2, th_m, WORDS)
        re, ro = _pair_tile(q_ptr, qrow_p, NOPE // 2, HALF, th_m, WORDS)
        cs_off = pos[:, None, None] * s_cs + tl.arange(0, HALF)[None, None, :]
        c = tl.load(cs_ptr + cs_off, mask=tm[:, None, None], other=1.0).to(tl.float32)
        s = tl.load(cs_ptr + cs_off + HALF, mask=tm[:, None, None], other=0.0).to(tl.float32)
        re2 = _rn_bf16(tl.fma(re, c, _neg_sign_bit(ro * s)), CVT_HW)
        ro2 = _rn_bf16(tl.fma(re, s, ro * c), CVT_HW)
        srow = (ti * s_sc0)[:, None] + (hi * s_sc1)[None, :]
        _mxfp4_blocks(ne, no, out_ptr, orow, sc_ptr + srow[:, :, None], th_m, PTX,
                      BLOCK_T, BLOCK_H, NOPE // 2, NOPE // 2)
        _mxfp4_blocks(re2, ro2, out_ptr, orow + NOPE // 2, sc_ptr + srow[:, :, None] + NOPE // 32,
                      th_m, PTX, BLOCK_T, BLOCK_H, HALF, HALF)
        wo = (w * softmax_scale) * head_scale
    elif SPLIT:
        # NOPE and R powers of two (production 64 + 64), FP8: the NoPE half is quantized
        # as loaded, only the RoPE half is split into (even, odd) pairs and rotated.
        m3 = th_m[:, :, None]
        dn = tl.arange(0, NOPE)[None, None, :]
        dr = tl.arange(0, 2 * HALF)[None, None, :]
        if WORDS:
            # q_ptr an int32 view: the NoPE half held as its bf16 pair words (half the
            # registers of fp32 values), the RoPE pairs read as words
            wn = tl.load(q_ptr + qrow[:, :, None] + tl.arange(0, NOPE // 2)[None, None, :],
                         mask=m3, other=0)
            e, o = _pair_tile(q_ptr, qrow, NOPE // 2, HALF, th_m, True)
        else:
            xn = tl.load(q_ptr + qrow[:, :, None] + dn, mask=m3, other=0.0).to(tl.float32)
            xr = tl.load(q_ptr + qrow[:, :, None] + NOPE + dr, mask=m3, other=0.0).to(tl.float32)
            e, o = tl.split(tl.reshape(xr, [BLOCK_T, BLOCK_H, HALF, 2]))
        cs_off = pos[:, None, None] * s_cs + tl.arange(0, HALF)[None, None, :]
        c = tl.load(cs_ptr + cs_off, mask=tm[:, None, None], other=1.0).to(tl.float32)
        s = tl.load(cs_ptr + cs_off + HALF, mask=tm[:, None, None], other=0.0).to(tl.float32)
        # §1.2 forward RoPE (the indexer-Q contraction) + the bf16 round trip
        ne = _rn_bf16(tl.fma(e, c, _neg_sign_bit(o * s)), CVT_HW)
        no = _rn_bf16(tl.fma(e, s, o * c), CVT_HW)
        # amax: max.f32 (maxnum) drops NaN operands; an all-NaN head gives the floor
        amax_r = _rmax(tl.maximum(tl.abs(ne), tl.abs(no)), axis=2)
        if WORDS:
            # the NoPE magnitudes as bf16 bit patterns, compared as integers (the same order
            # for non-NaN values); a NaN counts as 0, which maxnum's dropping it equals
            a = wn & 0x7FFF7FFF
            lo = a & 0xFFFF
            hi = a >> 16
            lo = tl.where(lo > 0x7F80, 0, lo)
            hi = tl.where(hi > 0x7F80, 0, hi)
            amax_n = (_rmax(tl.maximum(lo, hi), axis=2) << 16).to(tl.float32, bitcast=True)
        else:
            amax_n = _rmax(tl.abs(xn), axis=2)
        amax = tl.maximum(amax_n, amax_r)
        E = _ceil_exp_bits(tl.maximum(amax, _EPS_Q) * (1.0 / FP8_MAX))
        inv = _inv_pow2_of(E)[:, :, None]  # x / 2^E, exact (0 for an infinite scale)
        if RELOAD_NOPE:
            # the NoPE half read again for its codes instead of held through the rotation
            # (the cache modifier keeps the two loads apart; every load precedes every store)
            xn = tl.load(q_ptr + qrow[:, :, None] + dn, mask=m3, other=0.0,
                         cache_modifier=".ca").to(tl.float32)
        if WORDS:
            # out_ptr an int16 view: each pair's two codes stored as one int16 in the words'
            # own layout (joined into byte rows they would cross lanes through shared memory)
            xe, xo = _word_halves(wn)
            cn = _e4m3_pair(xe * inv, xo * inv, FNUZ, CVT_HW, PTX)
            cr = _e4m3_pair(ne * inv, no * inv, FNUZ, CVT_HW, PTX)
            pn = tl.arange(0, NOPE // 2)[None, None, :]
            tl.store(out_ptr + orow[:, :, None] + pn, cn, mask=m3)
            pr = tl.arange(0, HALF)[None, None, :]
            tl.store(out_ptr + orow[:, :, None] + NOPE // 2 + pr, cr, mask=m3)
        else:
            cn = _e4m3_code(xn * inv, FNUZ, CVT_HW, 0x7F).to(tl.uint8)
            tl.store(out_ptr + orow[:, :, None] + dn, cn, mask=m3)
            cr = tl.join(_e4m3_code(ne * inv, FNUZ, CVT_HW, 0x7F), _e4m3_code(no * inv, FNUZ, CVT_HW, 0x7F))
            cr = tl.reshape(cr, [BLOCK_T, BLOCK_H, 2 * HALF]).to(tl.uint8)
            tl.store(out_ptr + orow[:, :, None] + NOPE + dr, cr, mask=m3)
        wo = ((w * _pow2_of(E)) * softmax_scale) * head_scale
    else:
        # General shapes (MXFP4 too where NoPE or RoPE is not a power of two >= 32): the
        # whole head split into pairs, RoPE pairs selected.
        i = tl.arange(0, BLOCK_P)  # pair index: elements 2i, 2i+1
        rope = (i >= NOPE // 2) & (i < D // 2)
        ri = tl.where(rope, i - NOPE // 2, 0)
        cs_off = pos[:, None] * s_cs + ri[None, :]
        cs_m = tm[:, None] & rope[None, :]
        c = tl.load(cs_ptr + cs_off, mask=cs_m, other=1.0).to(tl.float32)[:, None, :]
        s = tl.load(cs_ptr + cs_off + HALF, mask=cs_m, other=0.0).to(tl.float32)[:, None, :]
        d = tl.arange(0, 2 * BLOCK_P)
        d_m = th_m[:, :, None] & (d < D)[None, None, :]
        x = tl.load(q_ptr + qrow[:, :, None] + d[None, None, :], mask=d_m, other=0.0).to(tl.float32)
        e, o = tl.split(tl.reshape(x, [BLOCK_T, BLOCK_H, BLOCK_P, 2]))
        new_e = _rn_bf16(tl.fma(e, c, _neg_sign_bit(o * s)), CVT_HW)
        new_o = _rn_bf16(tl.fma(e, s, o * c), CVT_HW)
        rope3 = rope[None, None, :]
        e = tl.where(rope3, new_e, e)
        o = tl.where(rope3, new_o, o)
        if USE_FP4:
            # §2.3 / §1.8 over the D / 2 pairs of the tile (the plain-Triton encoder: this
            # path is not the production shape the PTX one was checked on)
            srow = (ti * s_sc0)[:, None] + (hi * s_sc1)[None, :]
            _mxfp4_blocks(e, o, out_ptr, orow, sc_ptr + srow[:, :, None], th_m, False,
                          BLOCK_T, BLOCK_H, BLOCK_P, D // 2)
            # weights_out = RN32(RN32(w·S)·Hs): no q scale.
            wo = (w * softmax_scale) * head_scale
        else:
            # §2.2: one scale per head, s = max(amax, 1e-4) / FP8_MAX.
            amax = _rmax(tl.maximum(tl.abs(e), tl.abs(o)), axis=2)
            E = _ceil_exp_bits(tl.maximum(amax, _EPS_Q) * (1.0 / FP8_MAX))
            inv = _inv_pow2_of(E)[:, :, None]
            codes = tl.join(_e4m3_code(e * inv, FNUZ, CVT_HW, 0x7F), _e4m3_code(o * inv, FNUZ, CVT_HW, 0x7F))
            codes = tl.reshape(codes, [BLOCK_T, BLOCK_H, 2 * BLOCK_P]).to(tl.uint8)
            tl.store(out_ptr + orow[:, :, None] + d[None, None, :], codes, mask=d_m)
            # weights_out = RN32(RN32(RN32(w·q_scale)·S)·Hs), left to right.
            wo = ((w * _pow2_of(E)) * softmax_scale) * head_scale
    if WO_BF16:
        tl.store(wo_ptr + wo_off, _bf16_bits_i32(wo, CVT_HW).to(tl.int16), mask=th_m)
    else:
        tl.store(wo_ptr + wo_off, wo, mask=th_m)


_indexer_q_launch = bind(_indexer_q_kernel)


def _tile_th(T: int, H: int, row_elems: int, target: int) -> tuple[int, int]:
    """(BLOCK_T, BLOCK_H) so that a program holds about ``target`` elements."""
    bh = min(_pow2(H), max(1, target // row_elems))
    bt = min(_pow2(T), max(1, target // (bh * row_elems)))
    return bt, bh


def _target(total_elems: int, big: int, big_warps: int) -> tuple[int, int]:
    """(elements per program, num_warps): bigger tiles at prefill sizes, small ones (more
    programs, lower latency) at decode sizes.  Measured on the H200 (tests' tuning sweep,
    65 536 tokens): indexer Q best at 1 token x 64 heads x 128 / 4 warps (0.95 of copy),
    inverse RoPE at 1 token x 8 heads x 512 / 4 warps (0.76); 2048-element tiles at
    1-64 tokens (CUDA-graph replay 1.5-2.2 us)."""
    if total_elems >= 132 * 4 * 8192:
        return big, big_warps
    return 2048, 4


def _is_pow2(n: int) -> bool:
    return n > 0 and (n & (n - 1)) == 0


def fused_indexer_q_rope_quant(
    positions, index_q, cos_sin_cache, index_weights, softmax_scale, head_scale,
    use_fp4, use_fnuz, q_out, q_scale_out, weights_out,
):
    """R §2: RoPE on the last R dims of every head, then FP8 (OCP / FNUZ, scale folded into
    the weights) or MXFP4 (packed e2m1 + per-32 ue8m0 bytes)."""
    T, H, D = index_q.shape
    if T == 0 or H == 0:
        return None
    R = cos_sin_cache.shape[-1]
    nope = D - R
    assert index_q.stride(2) == 1 and q_out.stride(2) == 1 and cos_sin_cache.stride(-1) == 1
    assert nope % 2 == 0 and R % 2 == 0
    use_fp4 = bool(use_fp4)
    block_p, bt, bh, warps, split, grid, regs, nope_mode = tuning.remembered(
        ("q", T, H, D, R, use_fp4), _indexer_q_config, T, H, D, R, use_fp4)
    out = q_out.view(torch.uint8)
    if use_fp4:
        assert D % 32 == 0 and nope % 32 == 0
        # the kernel addresses bytes; int32 words (vLLM's return form) are viewed as them
        sc = q_scale_out if q_scale_out.dtype == torch.uint8 else q_scale_out.view(torch.uint8)
        sc_strides = scale_byte_strides(q_scale_out)
    else:
        sc, sc_strides = out, (0, 0)  # q_scale_out is empty in the FP8 path
    wo_bf16 = weights_out.dtype == torch.bfloat16
    wo = weights_out.view(torch.int16) if wo_bf16 else weights_out
    off64 = launch.span(index_q, out, sc if use_fp4 else None, cos_sin_cache, index_weights, wo,
                        positions) >= launch.I32_SAFE
    q, words = index_q, False
    if (use_fp4 and split) or nope_mode == "words":
        # the MXFP4 split path (and the FP8 one holding NoPE words) reads pairs: as int32
        # words where rows are 4-byte aligned
        # (one test per tensor: the address, and every row start, at a multiple of 4 bytes)
        sq = index_q.stride()
        words = (index_q.data_ptr() | 2 * (sq[0] | sq[1])) % 4 == 0
        if not use_fp4:
            # and writes each pair's codes as one int16: rows of q_out 2-byte aligned too
            so = out.stride()
            words = words and (out.data_ptr() | so[0] | so[1]) % 2 == 0
            if words:
                out = out.view(torch.int16)
        if words:
            q = index_q.view(torch.int32)
        elif use_fp4:
            q = index_q.view(torch.int16)
    pdl = launch.decode_pdl(index_q.device, T)
    ptx = use_ptx(index_q.device)
    _indexer_q_launch(grid,
        positions, positions.stride(0),
        q, q.stride(0), q.stride(1),
        cos_sin_cache, cos_sin_cache.stride(0), cos_sin_cache.shape[0],
        index_weights, index_weights.stride(0), index_weights.stride(1),
        out, out.stride(0), out.stride(1),
        sc, *sc_strides,
        wo, wo.stride(0), wo.stride(1),
        T, H, float(softmax_scale), float(head_scale),
        D=D, NOPE=nope, HALF=R // 2,
        BLOCK_T=bt, BLOCK_H=bh, BLOCK_P=block_p,
        SPLIT=split, USE_FP4=use_fp4, FNUZ=bool(use_fnuz) and not use_fp4,
        CVT_HW=use_hw_convert(index_q.device), WO_BF16=wo_bf16, OFF64=off64, WORDS=words,
        PTX=(use_fp4 or words) and ptx, PDL=pdl, RELOAD_NOPE=nope_mode == "reload", num_warps=warps,
        **launch.pdl_kwargs(pdl), **launch.maxnreg_kwargs(regs, ptx),
    )
    return None


# Register cap (ptxas maxnreg) of the FP8 indexer-Q programs on NVIDIA; None: the compiler's
# choice.  Measured with the NoPE half held as fp32 (Triton 3.6: 86 registers, 5 programs of 4
# warps per SM; the set-C contraction order accounts for ten of them: the other order builds
# with 76): on an H100 the uncapped build was the fastest of none / 72 / 80 / 88 at 65536
# tokens (543.8 us; 80: 551.3) and level with 72 at 4096 (42.6 / 42.4 us; 80: 45.2), although
# 80 gives Triton 3.6 the 76 registers of 9e78256's build (h100-indexer-q-cap-39.txt).  The
# default NoPE mode below needs 64.  The sweep space "fused_indexer_q_rope_quant [FP8] maxnreg"
# times the alternatives on other cards.
INDEXER_Q_FP8_MAXNREG = None
# How the FP8 split path keeps the NoPE half from its load to its codes (the amax needs the
# rotated RoPE half first); the bytes are the same in every mode:
#   "words"   held as its bf16 pair words: q read through an int32 view, the NoPE amax taken on
#             the words' bit patterns, each pair's two codes written as one int16 (on NVIDIA
#             by one cvt.rn.satfinite.e4m3x2), where the rows of q are 4-byte and those of q_out
#             2-byte aligned; else "fp32".  Triton 3.6 for sm_90: 64 registers, 694
#             instructions, 8 programs of 4 warps per SM.  On an H100, against "fp32" in the
#             same sweep: 41.2 against 42.8 us at 4096 tokens, 539.8 against 541.2 at 65536
#             (h100-indexer-q-words-41.txt).
#   "fp32"    held as fp32 values.  Triton 3.6: 86 registers, 1100 instructions, 5 programs.
#   "reload"  loaded a second time for the codes (every load precedes every store).  Triton 3.6:
#             66 registers; on an H100 slower than "fp32": 572.9 against 543.2 us at 65536
#             tokens, 43.9 against 42.6 at 4096 (h100-indexer-q-reload-40.txt).
# The sweep space "fused_indexer_q_rope_quant [FP8] nope" times the three.
INDEXER_Q_FP8_NOPE = "words"
_NOPE_MODES = ("fp32", "reload", "words")


def _indexer_q_config(T: int, H: int, D: int, R: int, use_fp4: bool) -> tuple:
    """(BLOCK_P, BLOCK_T, BLOCK_H, num_warps, SPLIT, grid, register cap, NoPE mode) of an
    indexer-Q launch; a launch-shape override may carry ``maxnreg`` (None: uncapped) and
    ``nope`` (``INDEXER_Q_FP8_NOPE``; "fp32" wherever the FP8 split path does not run)."""
    nope = D - R
    block_p = _pow2(D // 2)
    target, warps = _target(T * H * D, 8192, 4)
    bt, bh = _tile_th(T, H, 2 * block_p, target)
    regs = None if use_fp4 else INDEXER_Q_FP8_MAXNREG
    mode = INDEXER_Q_FP8_NOPE
    cfg = _launch_shape("fused_indexer_q_rope_quant", T, "mxfp4" if use_fp4 else "fp8")
    if cfg:
        bt, bh, warps = cfg["BLOCK_T"], cfg["BLOCK_H"], cfg["num_warps"]
        regs = cfg.get("maxnreg", regs)
        mode = cfg.get("nope", mode)
    if mode not in _NOPE_MODES:
        raise ValueError(f"indexer-Q NoPE mode: expected one of {_NOPE_MODES}, got {mode!r}")
    least = 32 if use_fp4 else 2
    split = _is_pow2(nope) and _is_pow2(R) and nope >= least and R >= least
    if use_fp4 or not split:
        mode = "fp32"  # only the FP8 split path holds the NoPE half
    return block_p, bt, bh, warps, split, (launch.cdiv(T, bt), launch.cdiv(H, bh)), regs, mode


# ============================================================== §4 fused_inv_rope_fp8_quant


@triton.jit(do_not_specialize=["T", "Ta", "NH"])
def _inv_rope_kernel(
    o_ptr, s_o0, s_o1,
    pos_ptr, s_pos,
    cs_ptr, s_cs, cs_rows,
    out_ptr, s_ob0, s_ob1,
    sc_ptr, s_sc0, s_sc1,
    T, Ta, NH,
    HG: tl.constexpr, DH: tl.constexpr, NOPE: tl.constexpr, HALF: tl.constexpr,
    QG: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_P: tl.constexpr,
    QUANT: tl.constexpr, PACKED: tl.constexpr, PERM: tl.constexpr, CVT_HW: tl.constexpr,
    OFF64: tl.constexpr,
    PDL: tl.constexpr = False,
):
    # A program takes BLOCK_T tokens x BLOCK_H heads x one window of 2·BLOCK_P dims (grid
    # axis 2; a whole row unless a decode shape splits it into quant chunks): a window
    # without RoPE dims loads neither the position nor cos/sin, so only the window with the
    # RoPE dims waits for position -> cos/sin, and its arithmetic after that is one chunk's.
    launch.pdl_prologue(PDL)
    IDX: tl.constexpr = tl.int64 if OFF64 else tl.int32
    t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    n = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    w = tl.program_id(2)
    tm = t < T
    nm = n < NH
    th_m = tm[:, None] & nm[None, :]
    ti = t.to(IDX)
    g = (n // HG).to(IDX)
    hg = n % HG

    has_rope = (t * 0 + (w + 1) * BLOCK_P) > NOPE // 2  # [BLOCK_T], all equal
    pos = _table_row(pos_ptr + ti * s_pos, tm & has_rope, cs_rows, IDX)
    i = w * BLOCK_P + tl.arange(0, BLOCK_P)
    rope = (i >= NOPE // 2) & (i < DH // 2)
    ri = tl.where(rope, i - NOPE // 2, 0)
    cs_off = pos[:, None] * s_cs + ri[None, :]
    cs_m = tm[:, None] & rope[None, :]
    c = tl.load(cs_ptr + cs_off, mask=cs_m, other=1.0)[:, None, :]
    s = tl.load(cs_ptr + cs_off + HALF, mask=cs_m, other=0.0)[:, None, :]

    d = w * (2 * BLOCK_P) + tl.arange(0, 2 * BLOCK_P)
    d_m = th_m[:, :, None] & (d < DH)[None, None, :]
    orow = (ti * s_o0)[:, None] + (n.to(IDX) * s_o1)[None, :]
    x = tl.load(o_ptr + orow[:, :, None] + d[None, None, :], mask=d_m, other=0.0).to(tl.float32)
    e, od = tl.split(tl.reshape(x, [BLOCK_T, BLOCK_H, BLOCK_P, 2]))

    # §1.3 inverse RoPE on dims NOPE..DH-1; NoPE dims selected unchanged.
    rope3 = rope[None, None, :]
    e_new = tl.fma(e, c, od * s)
    o_new = tl.fma(od, c, _neg_sign_bit(e * s))
    e = tl.where(rope3, e_new, e)
    od = tl.where(rope3, o_new, od)

    # Row (g, t) of the [G, T, Dg] output.
    row = g[None, :, None] * s_ob0 + (ti * s_ob1)[:, None, None]  # [BT, BH, 1]
    hg3 = hg[None, :, None]
    if PERM:
        col = (d // QG)[None, None, :] * (HG * QG) + hg3 * QG + (d % QG)[None, None, :]
    else:
        col = hg3 * DH + d[None, None, :]

    if not QUANT:
        # §4.6: bf16 of the rotated fp32 values, NaN -> 0x7FFF.
        y = tl.join(_bf16_bits_i32(e, CVT_HW), _bf16_bits_i32(od, CVT_HW))
        y = tl.reshape(y, [BLOCK_T, BLOCK_H, 2 * BLOCK_P]).to(tl.int16)
        tl.store(out_ptr + row + col, y, mask=d_m)
    else:
        # §4.3: per chunk of QG dims, amax (NaN ignored, floor 1e-10), s = amax·RN32(1/448),
        # E = ceil(RN32(log2 s)) (L), codes e4m3(clamp(x / 2^E, ±448)) with NaN -> +448:
        # the saturating encoder with NaN code 0x7E is exactly that clamp.
        CP: tl.constexpr = QG // 2
        NC: tl.constexpr = BLOCK_P // CP
        C: tl.constexpr = DH // QG
        e4 = tl.reshape(e, [BLOCK_T, BLOCK_H, NC, CP])
        o4 = tl.reshape(od, [BLOCK_T, BLOCK_H, NC, CP])
        amax = _rmax(tl.maximum(tl.abs(e4), tl.abs(o4)), axis=3)
        E = _ceil_exp_log(tl.maximum(amax, _EPS_O) * _INV_448)  # [BT, BH, NC]
        inv = _inv_pow2_of(E)[:, :, :, None]
        codes = tl.join(_e4m3_code(e4 * inv, False, CVT_HW, 0x7E),
                        _e4m3_code(o4 * inv, False, CVT_HW, 0x7E))
        codes = tl.reshape(codes, [BLOCK_T, BLOCK_H, 2 * BLOCK_P]).to(tl.uint8)
        tl.store(out_ptr + row + col, codes, mask=d_m)

        # §4.5 / §4.7 scales: element (t, g, k) at [g, k·Ta + t]; rows T <= t < Ta get 0.
        cc = (w * NC + tl.arange(0, NC))[None, None, :]
        if PERM:
            blk = cc * HG + hg3
        else:
            blk = hg3 * C + cc
        s_m = ((t < Ta)[:, None] & nm[None, :])[:, :, None] & (cc < C)
        g3 = g[None, :, None] * s_sc0
        t3 = ti[:, None, None]
        tm3 = tm[:, None, None]
        if PACKED:
            # int32 words of four ue8m0 bytes, block 4w+b in byte b (little endian).
            val = tl.where(tm3, E + 127, 0).to(tl.uint8)
            addr = 4 * (g3 + ((blk // 4).to(IDX) * Ta + t3) * s_sc1) + (blk % 4)
        else:
            val = tl.where(tm3, _pow2_of(E), 0.0)
            addr = g3 + (blk.to(IDX) * Ta + t3) * s_sc1
        tl.store(sc_ptr + addr, val, mask=s_m)


_inv_rope_launch = bind(_inv_rope_kernel)


def _row_window(block_d, dh: int, qg: int) -> int:
    """Dims per program of the inverse RoPE: ``block_d`` (a shape's ``BLOCK_D``) raised to a
    whole quant chunk ``qg`` and capped at the padded row; the whole row when the shape has
    none or the row is not a whole number of such windows (a window must not straddle the
    row's end: the chunk scales are per window)."""
    row = _pow2(dh)
    if not block_d:
        return row
    win = min(max(_pow2(block_d), qg), row)
    return win if dh % win == 0 else row


def fused_inv_rope_fp8_quant(
    o, positions, cos_sin_cache, n_groups, heads_per_group, nope_dim, rope_dim,
    quant_group_size, tma_aligned_scales, quantize, permuted_output, out_buf, scale_buf,
):
    """R §4: inverse RoPE of the attention output + per-``quant_group_size`` FP8 quant
    into the grouped ``[G, T, Dg]`` layout (standard or FlashMLA-permuted), scales fp32 or
    packed ue8m0 in the TMA-aligned MN-major layout."""
    T, NH, Dh = o.shape
    HG, QG = heads_per_group, quant_group_size
    if T == 0 or NH == 0:
        return None
    assert o.stride(2) == 1 and out_buf.stride(2) == 1 and cos_sin_cache.stride(-1) == 1
    assert nope_dim % 2 == 0 and rope_dim % 2 == 0 and Dh == nope_dim + rope_dim
    if quantize:
        assert QG % 2 == 0 and (QG & (QG - 1)) == 0 and Dh % QG == 0, "power-of-two quant groups"
        C = Dh // QG
        S = HG * C
        K = (S + 3) // 4 if tma_aligned_scales else S
        Ta = scale_buf.shape[1] // K
        if tma_aligned_scales:
            assert S % 4 == 0 and scale_buf.stride(1) == 1
            sc = scale_buf.view(torch.uint8)
        else:
            sc = scale_buf
        sc_strides = (scale_buf.stride(0), scale_buf.stride(1))
        out = out_buf.view(torch.uint8)
    else:
        Ta = T
        sc, sc_strides = o, (0, 0)  # nothing is written
        out = out_buf.view(torch.int16)
        assert out_buf.dtype == torch.bfloat16, "quantize=False writes bf16 rows"
    off64 = max(launch.span(o, out_buf, cos_sin_cache, positions),
                4 * launch.span(scale_buf) + 4) >= launch.I32_SAFE
    qg = QG if quantize else 2
    bt, bh, warps, window, grid = tuning.remembered(("inv", T, Ta, NH, Dh, qg), _inv_rope_config, T, Ta, NH, Dh, qg)
    pdl = launch.decode_pdl(o.device, T)
    _inv_rope_launch(grid,
        o, o.stride(0), o.stride(1),
        positions, positions.stride(0),
        cos_sin_cache, cos_sin_cache.stride(0), cos_sin_cache.shape[0],
        out, out_buf.stride(0), out_buf.stride(1),
        sc, *sc_strides,
        T, Ta, NH,
        HG=HG, DH=Dh, NOPE=nope_dim, HALF=rope_dim // 2, QG=qg,
        BLOCK_T=bt, BLOCK_H=bh, BLOCK_P=window // 2,
        QUANT=bool(quantize), PACKED=bool(quantize and tma_aligned_scales),
        PERM=bool(quantize and permuted_output), CVT_HW=use_hw_convert(o.device),
        OFF64=off64, PDL=pdl, num_warps=warps, **launch.pdl_kwargs(pdl),
    )
    return None


def _inv_rope_config(T: int, Ta: int, NH: int, Dh: int, qg: int) -> tuple:
    """(BLOCK_T, BLOCK_H, num_warps, dims per program, grid) of an inverse-RoPE launch."""
    block_p = _pow2(Dh // 2)
    target, warps = _target(T * NH * Dh, 4096, 4)
    bt, bh = _tile_th(Ta, NH, 2 * block_p, target)
    window = 2 * block_p
    cfg = _launch_shape("fused_inv_rope_fp8_quant", T)
    if cfg:
        bt, bh, warps = cfg["BLOCK_T"], cfg["BLOCK_H"], cfg["num_warps"]
        window = _row_window(cfg.get("BLOCK_D"), Dh, qg)
    return bt, bh, warps, window, (launch.cdiv(Ta, bt), launch.cdiv(NH, bh), launch.cdiv(Dh, window))


# ============================================================== §5 fused_q_kv_rmsnorm_quant


@triton.jit
def _vllm_mean_sq(x, size, rc_ptr, VB: tl.constexpr, VW: tl.constexpr, VP: tl.constexpr,
                  HW: tl.constexpr):
    """``Σx²/size`` of each row of the tile ``x [BT, W]`` as vLLM's Q / KV norm computes it:
    ``Σx²`` in its ``tl.sum`` order (``reductions._row_sum_sq``; ``gpu_approx.tl_sum_sq``), the
    mean a ``div.full`` by ``size`` (``div_full``)."""
    ss = _row_sum_sq(x, x.shape[0], x.shape[1], VB, VW, VP)
    return _div_full(ss, tl.full(ss.shape, size, tl.float32), rc_ptr, HW)


@triton.jit
def _q_rows(qr_ptr, s_qr, qw_ptr, eps, qo_ptr, s_qo, qs_ptr, s_qs, r, T, Tp, QS, Gq, Gp, rs_ptr,
            rc_ptr, BLOCK_G: tl.constexpr, Q_BF16: tl.constexpr, CVT_HW: tl.constexpr,
            HW: tl.constexpr, VB: tl.constexpr, VW: tl.constexpr, VP: tl.constexpr):
    """Q rows ``r``: RMSNorm, q.dtype round trip, MXFP8 per 32 + swizzled scale bytes."""
    rm = r < T
    r64 = r.to(tl.int64)
    gi = tl.arange(0, BLOCK_G)
    col = tl.arange(0, BLOCK_G * 32)
    cm = col < QS
    m = rm[:, None] & cm[None, :]
    x = tl.load(qr_ptr + (r64 * s_qr)[:, None] + col[None, :], mask=m, other=0.0).to(tl.float32)
    w = tl.load(qw_ptr + col, mask=cm, other=0.0).to(tl.float32)[None, :]
    rr = _rsqrt_approx(_vllm_mean_sq(x, QS, rc_ptr, VB, VW, VP, HW) + eps, rs_ptr, HW)
    y = (x * rr[:, None]) * w
    if Q_BF16:
        y = _rn_bf16(y, CVT_HW)  # q.dtype round trip
    # MXFP8 per 32: FlashInfer's UE8M0 rule on n = amax·RN32(1/448); amax ignores NaN
    # (maxnum; an all-NaN group gives 0 like the reference).
    y3 = tl.reshape(y, [y.shape[0], BLOCK_G, 32])
    nb = (tl.maximum(_rmax(tl.abs(y3), axis=2), 0.0) * _INV_448).to(tl.int32, bitcast=True)
    ex = (nb >> 23) & 0xFF
    mt = nb & 0x7FFFFF
    bump = (mt != 0) & ((ex != 0) | (mt > 0x400000))
    sf = tl.minimum(ex + bump.to(tl.int32), 254)
    sf = tl.where(nb <= 0, 0, sf)  # n = +0 (n is never negative here)
    inv = tl.where(sf == 0, 0, (254 - sf) << 23).to(tl.float32, bitcast=True)
    codes = _e4m3_code(y3 * inv[:, :, None], False, CVT_HW, 0x7F).to(tl.uint8)
    codes = tl.reshape(codes, [y.shape[0], BLOCK_G * 32])
    tl.store(qo_ptr + (r64 * s_qo)[:, None] + col[None, :], codes, mask=m)
    _q_scale_store(qs_ptr, s_qs, r64, tl.where(rm[:, None] & (gi < Gq)[None, :], sf, 0), Tp, Gp, BLOCK_G)


@triton.jit
def _q_scale_store(qs_ptr, s_qs, r64, sf, Tp, Gp, BLOCK_G: tl.constexpr):
    """Scale bytes ``sf [BT, BLOCK_G]`` of rows ``r64`` in the F8_128x4 swizzle (rows up to
    Tp, groups up to Gp)."""
    g2 = tl.arange(0, BLOCK_G)[None, :]
    r2 = r64[:, None]
    off = ((r2 // 128) * (128 * Gp) + (g2 // 4) * 512 + (r2 % 32) * 16
           + ((r2 % 128) // 32) * 4 + (g2 % 4))
    tl.store(qs_ptr + off * s_qs, sf.to(tl.uint8), mask=(r2 < Tp) & (g2 < Gp))


@triton.jit
def _kv_rows(kv_ptr, s_kv, kvw_ptr, eps, kvo_ptr, s_kvo, r, T, KS, rs_ptr, rc_ptr,
             BLOCK_KV: tl.constexpr, KV_BF16: tl.constexpr, CVT_HW: tl.constexpr,
             HW: tl.constexpr, VB: tl.constexpr, VW: tl.constexpr, VP: tl.constexpr):
    """KV rows ``r``: RMSNorm stored in kv_out's dtype (bf16 RNE, NaN -> 0x7FFF)."""
    rm = r < T
    r64 = r.to(tl.int64)
    col = tl.arange(0, BLOCK_KV)
    cm = col < KS
    m = rm[:, None] & cm[None, :]
    x = tl.load(kv_ptr + (r64 * s_kv)[:, None] + col[None, :], mask=m, other=0.0).to(tl.float32)
    w = tl.load(kvw_ptr + col, mask=cm, other=0.0).to(tl.float32)[None, :]
    rr = _rsqrt_approx(_vllm_mean_sq(x, KS, rc_ptr, VB, VW, VP, HW) + eps, rs_ptr, HW)
    y = (x * rr[:, None]) * w
    off = (r64 * s_kvo)[:, None] + col[None, :]
    if KV_BF16:
        tl.store(kvo_ptr + off, _bf16_bits_i32(y, CVT_HW).to(tl.int16), mask=m)
    else:
        tl.store(kvo_ptr + off, y, mask=m)


@triton.jit(do_not_specialize=["T", "Tp", "n_q_tiles"])
def _q_kv_rmsnorm_kernel(
    qr_ptr, s_qr, kv_ptr, s_kv, qw_ptr, kvw_ptr, eps,
    qo_ptr, s_qo, qs_ptr, s_qs, kvo_ptr, s_kvo,
    T, Tp, QS: tl.constexpr, KS: tl.constexpr, Gq: tl.constexpr, Gp: tl.constexpr, n_q_tiles,
    rs_ptr, rc_ptr,
    BLOCK_T: tl.constexpr, BLOCK_TKV: tl.constexpr, BLOCK_G: tl.constexpr,
    BLOCK_KV: tl.constexpr,
    Q_BF16: tl.constexpr, KV_BF16: tl.constexpr, CVT_HW: tl.constexpr,
    VB: tl.constexpr, VW: tl.constexpr, VPQ: tl.constexpr, VPK: tl.constexpr,
    HW: tl.constexpr = False, PDL: tl.constexpr = False,
):
    launch.pdl_prologue(PDL)
    # 1-D grid: the first n_q_tiles programs take BLOCK_T Q rows each (rows up to Tp, so
    # every scale byte is written), the others BLOCK_TKV KV rows each.
    pid = tl.program_id(0)
    if pid * BLOCK_T >= T and pid < n_q_tiles:
        # a tile of padding rows only (T <= row < Tp): its scale bytes are 0, nothing to read
        r = pid * BLOCK_T + tl.arange(0, BLOCK_T)
        _q_scale_store(qs_ptr, s_qs, r.to(tl.int64), tl.zeros([BLOCK_T, BLOCK_G], tl.int32), Tp, Gp, BLOCK_G)
    elif pid < n_q_tiles:
        _q_rows(qr_ptr, s_qr, qw_ptr, eps, qo_ptr, s_qo, qs_ptr, s_qs,
                pid * BLOCK_T + tl.arange(0, BLOCK_T), T, Tp, QS, Gq, Gp, rs_ptr, rc_ptr,
                BLOCK_G, Q_BF16, CVT_HW, HW, VB, VW, VPQ)
    else:
        _kv_rows(kv_ptr, s_kv, kvw_ptr, eps, kvo_ptr, s_kvo,
                 (pid - n_q_tiles) * BLOCK_TKV + tl.arange(0, BLOCK_TKV), T, KS, rs_ptr, rc_ptr,
                 BLOCK_KV, KV_BF16, CVT_HW, HW, VB, VW, VPK)


_q_kv_rmsnorm_launch = bind(_q_kv_rmsnorm_kernel)


def fused_q_kv_rmsnorm_quant(qr, kv, q_weight, kv_weight, eps, q_out, q_scale_out, kv_out):
    """R §5: RMSNorm of the Q and KV rows; KV stored in kv_out's dtype, Q as MXFP8
    (e4m3fn + FlashInfer UE8M0 scales in the F8_128x4 swizzle, every scale byte written)."""
    T, QS = qr.shape
    KS = kv.shape[1]
    Gq = QS // 32
    Tp = (T + 127) // 128 * 128
    Gp = (Gq + 3) // 4 * 4
    if T == 0:
        return None
    assert QS % 32 == 0 and qr.stride(1) == 1 and kv.stride(1) == 1
    assert q_weight.stride(0) == 1 and kv_weight.stride(0) == 1
    assert qr.dtype in (torch.bfloat16, torch.float32), "q rows: bf16 or fp32"
    assert kv_out.dtype in (torch.bfloat16, torch.float32), "kv rows: bf16 or fp32"
    block_g = max(4, _pow2(Gq))
    block_kv = _pow2(KS)
    # One Q row per program (measured best on the H200: the per-row RMS chain and the
    # swizzled scale bytes make wide tiles slower); KV programs take as many elements.
    bt, warps = 1, 4
    cfg = _launch_shape("fused_q_kv_rmsnorm_quant", T)
    if cfg:
        bt, warps = cfg["BLOCK_T"], cfg["num_warps"]
    bt_kv = max(1, min(_pow2(T), bt * block_g * 32 // block_kv))
    if cfg and "BLOCK_TKV" in cfg:
        bt_kv = cfg["BLOCK_TKV"]
    kv_bf16 = kv_out.dtype == torch.bfloat16
    kvo = kv_out.view(torch.int16) if kv_bf16 else kv_out
    qo = q_out.view(torch.uint8)
    n_q_tiles = launch.cdiv(Tp, bt)
    grid = (n_q_tiles + launch.cdiv(T, bt_kv),)
    dev = qr.device
    vb, vw, vpq = vllm_norm_layout(QS, KS, qr.element_size())
    pdl = launch.decode_pdl(dev, T)
    hw = conversions.approx_hw(dev)
    _q_kv_rmsnorm_launch(grid,
        qr, qr.stride(0), kv, kv.stride(0), q_weight, kv_weight, float(eps),
        qo, qo.stride(0), q_scale_out, q_scale_out.stride(0), kvo, kvo.stride(0),
        T, Tp, QS, KS, Gq, Gp, n_q_tiles, conversions.approx_table(hw, "rsqrt", dev, qr), conversions.approx_table(hw, "rcp", dev, qr),
        BLOCK_T=bt, BLOCK_TKV=bt_kv, BLOCK_G=block_g, BLOCK_KV=block_kv,
        Q_BF16=qr.dtype == torch.bfloat16, KV_BF16=kv_bf16,
        VB=vb, VW=vw, VPQ=vpq, VPK=vllm_norm_layout(QS, KS, kv.element_size())[2],
        CVT_HW=use_hw_convert(dev), HW=hw, PDL=pdl,
        num_warps=warps, **launch.pdl_kwargs(pdl),
    )
    return None


# ===================================================================== §6.3 pad_fused_q_heads


@triton.jit(do_not_specialize=["n_rows", "W_in", "W_out"])
def _pad_q_heads_kernel(
    q_ptr, s_q, out_ptr, s_out, n_rows, W_in, W_out,
    NCH: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_W: tl.constexpr,
    PDL: tl.constexpr = False,
):
    launch.pdl_prologue(PDL)
    # Row r = (token t, chunk c); chunk c of a token is [H, 16] in q and [H_pad, 16] in out.
    r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    rm = r < n_rows
    t = (r // NCH).to(tl.int64)
    c = (r % NCH).to(tl.int64)
    for w0 in range(0, W_out, BLOCK_W):
        w = w0 + tl.arange(0, BLOCK_W)
        m = rm[:, None] & (w < W_out)[None, :]
        src = (t * s_q + c * W_in)[:, None] + w[None, :]
        v = tl.load(q_ptr + src, mask=m & (w < W_in)[None, :], other=0)
        tl.store(out_ptr + (t * s_out + c * W_out)[:, None] + w[None, :], v, mask=m)


_pad_q_heads_launch = bind(_pad_q_heads_kernel)


def pad_fused_q_heads(q, out):
    """R §6.3: fused-layout Q heads zero-padded from H to H_pad (a pure bit copy)."""
    T, H, D = q.shape
    Hp = out.shape[1]
    if T == 0:
        return None
    assert D % 16 == 0 and q.stride(2) == 1 and q.stride(1) == D
    assert out.stride(2) == 1 and out.stride(1) == D
    nch = D // 16
    W_in, W_out = H * 16, Hp * 16
    qi = q.view(torch.int16) if q.element_size() == 2 else q
    oi = out.view(torch.int16) if out.element_size() == 2 else out
    block_w = min(_pow2(W_out), 4096)
    block_r = max(1, min(_pow2(T * nch), 8192 // block_w))
    warps = 4
    cfg = TUNE.get("pad_fused_q_heads")
    if cfg:
        block_r, warps = cfg["BLOCK_R"], cfg["num_warps"]
    n_rows = T * nch
    pdl = launch.decode_pdl(q.device, T)
    _pad_q_heads_launch((launch.cdiv(n_rows, block_r),),
        qi, q.stride(0), oi, out.stride(0), n_rows, W_in, W_out,
        NCH=nch, BLOCK_R=block_r, BLOCK_W=block_w, PDL=pdl, num_warps=warps,
        **launch.pdl_kwargs(pdl),
    )
    return None


# ============================================================================== AOT


def _aot_signature(kernel, pointers: dict, floats=()) -> dict:
    """Triton signature: the given pointer types, "constexpr" for the kernel's constexpr
    parameters (those a spec does not set build with their defaults), fp32 for ``floats``,
    i32 else."""
    from .aot import constexpr_params

    cx = constexpr_params(kernel)
    return {
        a: ("constexpr" if a in cx else "fp32" if a in floats else pointers.get(a, "i32"))
        for a in kernel.arg_names
    }


_CUDA = ("sm90", "sm100")
_ALL = ("sm90", "sm100", "gfx942", "gfx950")


def _register_aot() -> None:
    """Representative variants for ``backends/triton/aot.py``: production shapes, the
    NVIDIA variants with hardware converts (``CVT_HW``) and the integer-encoder variants the
    ROCm / XPU backends use (FNUZ always goes through the integer encoder)."""
    from .aot import AotSpec, register

    # §2 indexer Q: H 64, D 128, R 64.
    p = {"pos_ptr": "*i64", "q_ptr": "*bf16", "cs_ptr": "*fp32", "w_ptr": "*bf16",
         "out_ptr": "*u8", "sc_ptr": "*u8", "wo_ptr": "*fp32"}
    base = {"D": 128, "NOPE": 64, "HALF": 32, "BLOCK_T": 1, "BLOCK_H": 64, "BLOCK_P": 64,
            "OFF64": False}
    # FP8: the default NoPE mode ("words": q an int32 view, q_out an int16 view); NVIDIA builds
    # it with the paired PTX convert.  MXFP4 at production shapes: the split path reading
    # pairs as int32 words.  The NVIDIA variants as launched at decode sizes (PDL prologue).
    words = INDEXER_Q_FP8_NOPE == "words"
    for tag, fp4, fnuz, hw, targets in (("fp8-ocp-hw", False, False, True, _CUDA),
                                        ("fp8-ocp", False, False, False, _ALL),
                                        ("fp8-fnuz", False, True, False, _ALL),
                                        ("mxfp4", True, False, False, _ALL),
                                        ("mxfp4-hw", True, False, True, _CUDA)):
        pairs = fp4 or words
        c = dict(base, USE_FP4=fp4, FNUZ=fnuz, CVT_HW=hw, WO_BF16=fp4, SPLIT=True, WORDS=pairs,
                 PTX=pairs and hw, PDL=hw and targets == _CUDA,
                 RELOAD_NOPE=not fp4 and INDEXER_Q_FP8_NOPE == "reload")
        pp = dict(p, q_ptr="*i32") if pairs else p
        pp = dict(pp, wo_ptr="*i16") if fp4 else dict(pp, out_ptr="*i16") if words else pp
        register(AotSpec(f"rope_kernels._indexer_q_kernel[{tag}]", _indexer_q_kernel,
                         _aot_signature(_indexer_q_kernel, pp, ("softmax_scale", "head_scale")),
                         c, num_warps=4, targets=targets,
                         divisible=("q_ptr", "out_ptr", "s_q0", "s_q1", "s_o0", "s_o1"),
                         maxnreg=INDEXER_Q_FP8_MAXNREG if hw and not fp4 else None))
    # the FP8 NVIDIA builds of the other NoPE modes, for their SASS (and gfx950's hardware
    # converts, held as fp32): held as fp32 values; loaded again for the codes
    c = dict(base, USE_FP4=False, FNUZ=False, CVT_HW=True, WO_BF16=False, SPLIT=True, WORDS=False,
             PTX=False, PDL=True, RELOAD_NOPE=False)
    for tag, reload, targets in (("fp8-ocp-hw-fp32", False, _CUDA + ("gfx950",)),
                                 ("fp8-ocp-hw-reload", True, _CUDA)):
        register(AotSpec(f"rope_kernels._indexer_q_kernel[{tag}]", _indexer_q_kernel,
                         _aot_signature(_indexer_q_kernel, p, ("softmax_scale", "head_scale")),
                         dict(c, RELOAD_NOPE=reload, PDL=targets == _CUDA), num_warps=4, targets=targets,
                         divisible=("q_ptr", "out_ptr", "s_q0", "s_q1", "s_o0", "s_o1")))

    # §4 inverse RoPE: 8 heads per group, Dh 512 = 448 + 64.
    p = {"o_ptr": "*bf16", "pos_ptr": "*i64", "cs_ptr": "*fp32", "out_ptr": "*u8", "sc_ptr": "*fp32"}
    base = {"HG": 8, "DH": 512, "NOPE": 448, "HALF": 32, "BLOCK_T": 1, "BLOCK_H": 8, "BLOCK_P": 256,
            "OFF64": False}
    for tag, qg, quant, packed, perm in (("qgs128-fp32", 128, True, False, False),
                                         ("qgs128-ue8m0", 128, True, True, False),
                                         ("qgs32-perm", 32, True, True, True),
                                         ("noquant", 2, False, False, False)):
        for hw, targets in ((True, _CUDA), (False, _ALL)):
            c = dict(base, QG=qg, QUANT=quant, PACKED=packed, PERM=perm, CVT_HW=hw, PDL=hw)
            pp = dict(p, sc_ptr="*u8" if packed else "*fp32", out_ptr="*u8" if quant else "*i16")
            register(AotSpec(f"rope_kernels._inv_rope_kernel[{tag}{'-hw' if hw else ''}]",
                             _inv_rope_kernel, _aot_signature(_inv_rope_kernel, pp), c,
                             num_warps=4, targets=targets, divisible=("o_ptr", "out_ptr")))

    # §5 query quant: Qs 1536, Ks 512.
    p = {"qr_ptr": "*bf16", "kv_ptr": "*bf16", "qw_ptr": "*bf16", "kvw_ptr": "*bf16",
         "qo_ptr": "*u8", "qs_ptr": "*u8", "kvo_ptr": "*i16", "rs_ptr": "*i32", "rc_ptr": "*i32"}
    for hw, targets in ((True, _CUDA), (False, _ALL)):
        c = {"QS": 1536, "KS": 512, "Gq": 48, "Gp": 48,
             "BLOCK_T": 1, "BLOCK_TKV": 4, "BLOCK_G": 64, "BLOCK_KV": 512, "Q_BF16": True,
             "KV_BF16": True, "CVT_HW": hw, "HW": hw, "PDL": hw, "VB": 2048, "VW": 8, "VPQ": 8, "VPK": 8}
        register(AotSpec(f"rope_kernels._q_kv_rmsnorm_kernel[1536,512{'-hw' if hw else ''}]",
                         _q_kv_rmsnorm_kernel,
                         _aot_signature(_q_kv_rmsnorm_kernel, p, ("eps",)), c,
                         num_warps=4, targets=targets,
                         divisible=("qr_ptr", "qo_ptr", "kv_ptr", "kvo_ptr", "qw_ptr", "kvw_ptr",
                                    "s_qr", "s_qo", "s_kv", "s_kvo")))

    # §6.3 Q head padding: 32 chunks, H_pad 64.
    c = {"NCH": 32, "BLOCK_R": 8, "BLOCK_W": 1024}
    register(AotSpec("rope_kernels._pad_q_heads_kernel[32x1024]", _pad_q_heads_kernel,
                     _aot_signature(_pad_q_heads_kernel, {"q_ptr": "*i16", "out_ptr": "*i16"}),
                     c, num_warps=4, targets=_ALL, divisible=("q_ptr", "out_ptr")))


_register_aot()
