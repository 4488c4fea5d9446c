"""Shared Triton source of the paged K-cache writers / readers (cuda:triton, rocm, xpu).

One source for every vendor, parametrized by constexprs instead of copied:

* ``FNUZ``       fp8 flavour of the cache: OCP e4m3fn (clamp 448) or FNUZ e4m3fnuz
                 (clamp 224).  FNUZ is always encoded / decoded with integer bit operations
                 (NVIDIA Triton has no ``float8e4b8``), so it builds and runs everywhere.
* ``SOFT``       OCP e4m3 / bf16 conversions with integer bit operations instead of the
                 native casts.  Native on NVIDIA (``cvt.rn.satfinite.e4m3x2``,
                 ``cvt.rn.bf16.f32``, verified against torch), soft elsewhere (ROCm gfx942
                 emulates the OCP cast, XPU unverified).  Both give the same bytes.
* ``EXACT_LOG2`` the scale exponent ``e = ceil(fl32(log2 r))`` (spec cache_ops §2.1.3,
                 rope_quant_ops §1.5 "(L)") from the bits of r: exponent k plus one unless
                 the mantissa j is small enough that fl32(log2 r) rounds onto k (a fixed
                 per-binade threshold, ``_ceil_log2``).  Equal by construction to
                 ``dsv41.core.codecs.ceil_log2`` on every normal r; ``False`` uses
                 ``ceil(tl.log2(r))`` (libdevice on NVIDIA, ``v_log_f32`` on AMD).
* ``SANITIZE``   the gfx950 rule of spec §2.5 (``rope_quant_insert`` only).
* tiled layouts  ROCm's 16x16 FP8 / preshuffled MXFP4 indexer layouts (``TILED``/``NPT``).

The RoPE contraction is pinned with ``tl.fma``: ``e' = fma(e, c, -(o*s))``,
``o' = fma(o, c, e*s)`` exactly as spec rope_quant_ops §1.2 (``-(o*s)`` is a true sign flip,
``x * -1.0``: Triton lowers unary minus to ``0 - x``, which turns -0 into +0 and would break
finding 2).  NoPE pairs go through the same expression with (cos, sin) = (1, 0).  Every
other float operation is a single IEEE operation, so every vendor produces the same bytes.
Where vLLM's kernels use the NVIDIA GPU's approximate primitives -- the RMSNorm ``rsqrt``
(``indexer_k_norm_rope_store``, ``fused_save_compress_norm``), the CR-2 softmax's ``tl.exp``
and ``div.full`` -- these kernels compute the same bits: with the instructions themselves on
SM90 (``conversions.approx_hw``), elsewhere from the tables of ``dsv41.core.gpu_approx``
(``numerics._rsqrt_approx`` and friends); the norms' sums of squares follow vLLM's
``tl.sum`` order (``reductions``).

Launchers have exactly the signatures of docs/kernel_contract.md: they write into the
given tensors, allocate nothing, never synchronize (no ``.item()``), use the current
stream, and launch nothing for an empty batch.  Each program handles ``BLOCK_T`` tokens x
the full record (2-D / 4-D tiles, one load per input byte; where no compress ratio gates
a token, input rows load for every ``t < T`` so the loads do not wait for the slot load,
and rows of skipped tokens are read but never stored); slot -> page / offset in int32 (a
slot of a cache that fits in memory is < 2^31), byte offsets in int64; every store is
masked to the slots given.  An index outside its tensor (slot, block id, length, request
index) skips its token or row and a position is clamped into the cos/sin table, so no input
makes a kernel read or write outside the tensors given (docs/bad_input.md).

Op -> launcher:
  quantize_and_insert_k_cache   -> quantize_and_insert_k_cache
  dequantize_and_gather_k_cache -> dequantize_and_gather_k_cache
  rope_quant_insert             -> rope_quant_insert
  indexer_k_norm_rope_store     -> indexer_k_norm_rope_store
  fused_save_compress_norm      -> fused_save_compress_norm
  save_ring_rows                -> save_ring_rows
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from dsv41.core.formats import RECORDS

from . import conversions, launch, tuning
from .bound import bind
from .positions import table_row
from .aot import AotSpec, register
from .numerics import (  # noqa: F401  (the kernels below call them; tests reach some here)
    _neg,
    _ceil_log2,
    _exp2i,
    _clamp_sym,
    _e4m3_encode,
    _e4m3_decode,
    _bf16_bits,
    _bf16_round,
    _e4m3x2,
    _bf16x2,
    _bf16_word,
    _e2m1_code,
    _e2m1_half,
    _nan_abs,
    _ue8m0_scale,
    _ue8m0_apply,
    _rsqrt_approx,
    _div_full,
    _exp_approx,
    _word_halves,
)
from .reductions import _butterfly, _lane_chain_sq, _row_sum_sq

__all__ = [
    "CONFIG",
    "quantize_and_insert_k_cache",
    "dequantize_and_gather_k_cache",
    "rope_quant_insert",
    "indexer_k_norm_rope_store",
    "fused_save_compress_norm",
    "save_ring_rows",
]

# --------------------------------------------------------------------------------------
# Tunables (launch shapes never change the bytes written).
# --------------------------------------------------------------------------------------

CONFIG = tuning.Settings({
    # None: paired PTX converts (cvt ...x2.f32 by inline asm) wherever the native casts run
    # on an NVIDIA GPU (conversions.ptx); False: off.  The conversion path itself is not a
    # setting here: conversions.integer_path decides it per launch.
    "ptx_pairs": None,
    "exact_log2": True,
    # tokens per program and warps per program, per kernel
    # (from an H200 sweep at 65 536 tokens; run-to-run noise is about +-0.05 of copy)
    "block_t": {
        "insert": 8,
        "gather": 8,
        "rope": 8,
        "indexer": 16,
        "norm1": 4,
        "norm2": 4,
    },
    "num_warps": {
        "insert": 4,
        "gather": 8,
        "rope": 4,
        "indexer": 4,
        "norm1": 4,
        "norm2": 4,
        "ring": 4,
    },
    # 288 record on NVIDIA: the RoPE groups' e2m1 compares on bf16x2 words
    # (_nvfp4_rope_words); False: one fp32 value per compare (_nvfp4_pairs)
    "rope288_words": True,
    # register cap (ptxas maxnreg) of the CR-2 pair programs; None: the compiler's choice.
    # 64: the compiler's 70 registers held an SM to 28 one-warp programs (Nsight Compute:
    # 40 % occupancy, DRAM 80 %); at 64 the 32-block limit binds (H200 sweeps at 65536 tokens,
    # h200-sweep-9-call1.jsonl.xz: median 0.942 of copy against 0.925 uncapped, 0.929 at 56).
    # With prev_rows (H100, h100-sweep-37-cr2-maxnreg.jsonl.xz): 72, 80 and uncapped within 0.01.
    "norm2_maxnreg": 64,
    # CR 2 on SM90+: the ring save (second launch) is a PDL launch at every size and loads
    # its rows while the pooling kernel runs, waiting for it only before its stores; False:
    # PDL at decode sizes only and the wait before any load.  H200 sweep (five interleaved
    # passes at 65536 tokens, h200-sweep-9-call1.jsonl.xz): 0.936-0.960 of copy (median 0.942,
    # ten passes) against 0.902-0.919 for False; CUDA-graph replay at 1 / 8 / 64 tokens
    # 2.37 / 2.44 / 2.55 us against 2.56 / 2.72 / 2.85
    "ring_pdl": True,
    # upper bound on gather programs (grid = requests x workers)
    "gather_programs": 2048,
    # measured per-variant shapes: tuning.TABLE ("<kernel>:<variant>" keys)
})

_MEASURED_SHAPES: dict = {}  # (kernel, variant, size class) -> (BLOCK_T, num_warps) or None


def _shape(kernel: str, variant, tokens: int | None = None) -> tuple[int, int]:
    """(BLOCK_T, num_warps) of one kernel for one record / mode and launch size: the measured
    shape (``tuning``), else the defaults above.  The measured table is fixed, so its answer is
    kept per size class (``launch.size_class``; looked up afresh while a tuning override is in
    force); the defaults are read on every call (the GPU bench test varies them)."""
    if tuning.OVERRIDES:
        hit = tuning.shape(f"{kernel}:{variant}", tokens)
        hit = None if hit is None else (int(hit["BLOCK_T"]), int(hit["num_warps"]))
    else:
        key = (kernel, variant, launch.size_class(tokens))
        hit = _MEASURED_SHAPES.get(key, False)
        if hit is False:
            m = tuning.shape(f"{kernel}:{variant}", tokens)
            hit = _MEASURED_SHAPES[key] = None if m is None else (int(m["BLOCK_T"]), int(m["num_warps"]))
    if hit is not None:
        return hit
    return CONFIG["block_t"][kernel], CONFIG["num_warps"][kernel]


def _soft(t: torch.Tensor) -> bool:
    """The integer conversion path for kernels writing into ``t`` (``conversions``)."""
    return conversions.integer_path(t.device)


def _ptx(t: torch.Tensor) -> bool:
    """Paired PTX converts for kernels writing into ``t`` (see CONFIG["ptx_pairs"])."""
    return CONFIG["ptx_pairs"] is not False and conversions.ptx(t.device)


def _maxnreg(t: torch.Tensor, regs) -> dict:
    """Launch keyword capping registers per thread (NVIDIA builds only; none otherwise)."""
    return launch.maxnreg_kwargs(regs, _ptx(t))


def _exact_log2() -> bool:
    return bool(CONFIG["exact_log2"])


@triton.jit
def _rope(e, o, c, s):
    """GPT-J pair rotation with the canonical contraction (rope_quant_ops §1.2)."""
    e2 = tl.fma(e, c, _neg(o * s))
    o2 = tl.fma(o, c, e * s)
    return e2, o2


# --------------------------------------------------------------------------------------
# Shared tile pieces
# --------------------------------------------------------------------------------------


@triton.jit
def _slot_page(slot_ptr, t, T, block_size, page_stride, capacity):
    """(valid, page byte offset (int64), token in page (int32)) of the tokens ``t``.

    Negative slots skip, and so does a slot past the cache (``capacity`` = pages * page
    size): a bad slot never writes outside the cache (docs/bad_input.md).  A slot of a cache
    that fits in memory is < 2^31, so the page / offset split is done in int32; the byte
    offset of the page in int64 (spec §1.1).
    """
    tmask = t < T
    slot = tl.load(slot_ptr + t, mask=tmask, other=-1).to(tl.int64)
    # one unsigned compare: a negative slot is a huge unsigned value
    valid = tmask & (slot.to(tl.uint64, bitcast=True) < tl.cast(capacity, tl.uint64))  # capacity may be a constexpr 1
    s = tl.where(valid, slot, 0).to(tl.int32)
    blk = s // block_size
    return valid, blk.to(tl.int64) * page_stride, s - blk * block_size


@triton.jit
def _rope_tokens(slot_ptr, pos_ptr, T, block_size, page_stride, capacity, cs_rows, cs_s0,
                 CR: tl.constexpr, BLOCK_T: tl.constexpr):
    """This program's tokens of a writer that rotates and stores one row per token (or per
    group of CR tokens): ``(t, valid, page, tok, rmask, crow)``.

    ``valid``/``page``/``tok`` as :func:`_slot_page`; with CR > 1 only the token that closes a
    group is stored.  ``rmask``: the tokens whose rows are read (CR 1: every token, so the rows
    load without waiting for the slot load; a skipped one is never stored).  ``crow``: offset
    of the cos/sin row of the group's first position, the position clamped into the table
    (``cs_rows >= 1``): a position outside it reads its nearest row, never past the table, as
    in every GPU kernel that reads cos/sin (docs/bad_input.md)."""
    t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    tmask = t < T
    valid, page, tok = _slot_page(slot_ptr, t, T, block_size, page_stride, capacity)
    pos = table_row(tl.load(pos_ptr + t, mask=tmask, other=0).to(tl.int64), cs_rows)
    if CR > 1:
        valid = valid & ((pos + 1) % CR == 0)
        rmask = valid
    else:
        rmask = tmask
    return t, valid, page, tok, rmask, (pos // CR) * CR * cs_s0


@triton.jit
def _value_base(page, tok, VB: tl.constexpr, SB: tl.constexpr, INTERLEAVED: tl.constexpr):
    """Byte offset of token ``tok``'s value bytes in its page.  Paged layout: the page's
    values, then its scales; interleaved (vLLM 0.33's 528 / 288 records): each token's
    scales right after its values."""
    if INTERLEAVED:
        return page + tok * (VB + SB)
    else:
        return page + tok * VB


@triton.jit
def _scale_base(page, tok, block_size, VB: tl.constexpr, SB: tl.constexpr,
                INTERLEAVED: tl.constexpr):
    """Byte offset of token ``tok``'s scale bytes in its page (see ``_value_base``)."""
    if INTERLEAVED:
        return page + tok * (VB + SB) + VB
    else:
        return page + block_size * VB + tok * SB


@triton.jit
def _store_i16(cache_ptr, dst, j, bits, valid, TAIL_I16: tl.constexpr):
    """Store int16 ``bits[BT, n]`` at byte offsets ``dst[BT] + 2 j`` (little-endian)."""
    if TAIL_I16:
        c16 = (cache_ptr + dst).to(tl.pointer_type(tl.int16))
        tl.store(c16[:, None] + j[None, :], bits, mask=valid[:, None])
    else:
        bi = bits.to(tl.int32)
        tl.store(cache_ptr + dst[:, None] + 2 * j[None, :], (bi & 0xFF).to(tl.uint8),
                 mask=valid[:, None])
        tl.store(cache_ptr + dst[:, None] + 2 * j[None, :] + 1, ((bi >> 8) & 0xFF).to(tl.uint8),
                 mask=valid[:, None])


@triton.jit
def _nope_pairs(x4, SANITIZE: tl.constexpr):
    """(e', o') of NoPE pairs given as the last axis (size 2) of ``x4``: ``_nope_rot``."""
    e, o = tl.split(x4)
    return _nope_rot(e, o, SANITIZE)


@triton.jit
def _nope_rot(e, o, SANITIZE: tl.constexpr):
    """NoPE pairs through the rotation with (cos, sin) = (1, 0) (finding 2):
    e' = fma(e, 1, -(o*0)) = e + -(o*0), o' = fma(o, 1, e*0) = o + e*0.
    (Not one ``tl.fma(o, -0.0, e)``: equal in IEEE arithmetic and in the interpreter, but
    compiled for the H200 it wrote +0 where the reference keeps -0 -- 75 conformance cases
    failed there; this two-operation form is the one verified on the GPU.)"""
    e2 = e + _neg(o * 0.0)
    o2 = o + e * 0.0
    if SANITIZE:
        e2 = tl.where(e2 != e2, 0.0, e2)
        o2 = tl.where(o2 != o2, 0.0, o2)
    return e2, o2


@triton.jit
def _latent_words(x_ptr, row, p, m, WORDS: tl.constexpr):
    """The bf16 pairs ``p`` (elements 2p, 2p+1) of the rows at ``row`` as int32 words, element
    2p in the low half (``row`` and ``p`` broadcast together; off ``m`` read as 0).

    WORDS: ``x_ptr`` is an int32 view of the rows and ``row`` counts words, one load per pair.
    Otherwise (rows not 4-byte aligned) ``x_ptr`` is an int16 view, ``row`` counts elements,
    and each word is put together from two element loads."""
    if WORDS:
        w = tl.load(x_ptr + row + p, mask=m, other=0)
    else:
        lo = tl.load(x_ptr + row + 2 * p, mask=m, other=0).to(tl.int32)
        hi = tl.load(x_ptr + row + 2 * p + 1, mask=m, other=0).to(tl.int32)
        w = (lo & 0xFFFF) | (hi << 16)
    return w


@triton.jit
def _bf16_pairs(x_ptr, row, P0: tl.constexpr, NP: tl.constexpr, NLIM: tl.constexpr, rmask,
                WORDS: tl.constexpr):
    """bf16 elements (2i, 2i+1) for pairs i = P0 .. P0+NP-1 of the rows at ``row`` as fp32
    (e, o) ``[BT, NP]``; lanes i >= P0 + NLIM and rows off ``rmask`` read as 0.

    A pair is one 4-byte word (``_latent_words``), element 2i in its low half, and the two
    halves *are* the two values: no split of interleaved lanes (which cost shuffles and moves
    in every writer that pairs elements)."""
    i = tl.arange(0, NP)
    m = rmask[:, None] & (i < NLIM)[None, :]
    return _word_halves(_latent_words(x_ptr, row[:, None], (P0 + i)[None, :], m, WORDS))


@triton.jit
def _store_units(base_ptr, off, i, v, mask, UNIT: tl.constexpr, ALIGNED: tl.constexpr):
    """Store ``v[BT, N]`` (integers of UNIT = 1, 2 or 4 bytes, little-endian) at the byte
    offsets ``off[BT] + UNIT * i``: one store of UNIT-byte integers where the offsets are
    UNIT-aligned (ALIGNED), UNIT byte stores otherwise."""
    if ALIGNED or UNIT == 1:
        if UNIT == 1:
            p = base_ptr + off
        elif UNIT == 2:
            p = (base_ptr + off).to(tl.pointer_type(tl.int16))
        else:
            p = (base_ptr + off).to(tl.pointer_type(tl.int32))
        tl.store(p[:, None] + i[None, :], v, mask=mask)
    else:
        vi = v.to(tl.int32)
        for k in tl.static_range(UNIT):
            tl.store(base_ptr + off[:, None] + UNIT * i[None, :] + k,
                     ((vi >> (8 * k)) & 0xFF).to(tl.uint8), mask=mask)


@triton.jit
def _rope_cs(e, o, cs_ptr, crow, valid, SANITIZE: tl.constexpr):
    """(e, o) ``[BT, 32]`` rotated by the cos / sin rows at ``crow`` (NaN -> 0 if SANITIZE)."""
    i = tl.arange(0, 32)
    c = tl.load(cs_ptr + crow[:, None] + i[None, :], mask=valid[:, None], other=1.0).to(tl.float32)
    s = tl.load(cs_ptr + crow[:, None] + 32 + i[None, :], mask=valid[:, None],
                other=0.0).to(tl.float32)
    e2, o2 = _rope(e, o, c, s)
    if SANITIZE:
        e2 = tl.where(e2 != e2, 0.0, e2)
        o2 = tl.where(o2 != o2, 0.0, o2)
    return e2, o2


@triton.jit
def _ue8m0_pairs(e, o, EXACT_LOG2: tl.constexpr, SANITIZE: tl.constexpr, SOFT: tl.constexpr,
                 PTX: tl.constexpr):
    """OCP UE8M0 groups over the last axis of even/odd halves ``[BT, NG, HG]`` ->
    (the two bytes of each pair as one int16 ``[BT, NG, HG]``, codes ``[BT, NG]``)."""
    amax = tl.maximum(tl.max(_nan_abs(e, SOFT), axis=2), tl.max(_nan_abs(o, SOFT), axis=2))
    mult, code = _ue8m0_scale(amax, 448.0, EXACT_LOG2, SANITIZE)
    m3 = mult[:, :, None]
    return _ue8m0_pair_bytes(e, o, m3, SOFT, PTX), code


@triton.jit
def _ue8m0_pair_bytes(e, o, m, SOFT: tl.constexpr, PTX: tl.constexpr):
    """The OCP e4m3 bytes of e * m and o * m (NaN -> +448, finding 3) as one int16 per pair."""
    if PTX:
        # min.f32 drops NaN (-> +448); the convert saturates the rest
        return _e4m3x2(tl.minimum(e * m, 448.0), tl.minimum(o * m, 448.0))
    else:
        qe = _ue8m0_apply(e, m, 448.0, False, SOFT).to(tl.int32)
        qo = _ue8m0_apply(o, m, 448.0, False, SOFT).to(tl.int32)
        return (qe | (qo << 8)).to(tl.int16)


@triton.jit
def _nvfp4_pairs(e, o, SOFT: tl.constexpr):
    """NVFP4 groups of 16 (spec §2.3) over even/odd halves ``[BT, NG, 8]`` ->
    (packed bytes ``[BT, NG, 8]``, e4m3 scale bytes ``[BT, NG]``)."""
    amax = tl.maximum(tl.max(_nan_abs(e, SOFT), axis=2), tl.max(_nan_abs(o, SOFT), axis=2))
    sf = tl.minimum(tl.maximum(amax * (1.0 / 6.0), 0.001953125), 448.0)
    sb = _e4m3_encode(sf, False, SOFT)
    S = _e4m3_decode(sb, False, SOFT)[:, :, None]
    ce = _e2m1_code_of_quotient(e, S)
    co = _e2m1_code_of_quotient(o, S)
    return (ce | (co << 4)).to(tl.uint8), sb


@triton.jit
def _e2m1_code_of_quotient(x, S):
    """``_e2m1_code(fl32(x / S))`` without the division, for an e4m3 scale S >= 2^-9; NaN -> 7.

    The code's thresholds t (0.25 >, 0.75 >=, 1.25 >, 1.75 >=, 2.5 >, 3.5 >=, 5 >: ties to
    even codes) are compared with |x| as t * S, which is exact (<= 4 + 3 significant bits).
    That is the same test as on the rounded quotient: fp32 values next to t * S are more than
    S * ulp(t) / 2 away from it, so fl(x / S) never rounds onto t.  The thresholds pass
    monotonically, so three compares of a binary search find the magnitude.  The sign of
    x / S is the sign of x (-0 keeps 0x8); NaN gives 7 whatever its sign bit (spec §2.3).
    """
    a = tl.abs(x)
    hi = a >= 1.75 * S
    mid = a >= tl.where(hi, 3.5 * S, 0.75 * S)
    lo = a > tl.where(hi, tl.where(mid, 5.0 * S, 2.5 * S), tl.where(mid, 1.25 * S, 0.25 * S))
    c = hi.to(tl.int32) * 4 + mid.to(tl.int32) * 2 + lo.to(tl.int32)
    c = c | ((x.to(tl.int32, bitcast=True) >> 28) & 8)
    return tl.where(x != x, 7, c)


@triton.jit
def _nope_rot_words(w, SANITIZE: tl.constexpr):
    """``_nope_rot`` on bf16 pair words (NVIDIA PTX): e' = fma(o, -0, e), o' = fma(e, +0, o)
    in one ``fma.rn.bf16x2`` of the half-swapped word -- exact (a zero or NaN product added to
    a bf16 value), the same zero signs and NaNs as ``e + -(o * 0)`` / ``o + e * 0``, NaN as
    the canonical +NaN 0x7FFF.  SANITIZE: NaN halves -> +0 (``set.num`` mask).  The (-0, +0)
    multiplier is an operand (0x8000 in the low half)."""
    k = tl.full(w.shape, 0x00008000, tl.int32)
    if SANITIZE:
        return tl.inline_asm_elementwise(
            """
            {
            .reg .b32 s, r, n;
            prmt.b32 s, $1, 0, 0x1032;
            fma.rn.bf16x2 r, s, $2, $1;
            set.num.u32.bf16x2 n, r, r;
            and.b32 $0, r, n;
            }
            """,
            "=r,r,r", [w, k], dtype=tl.int32, is_pure=True, pack=1)
    else:
        return tl.inline_asm_elementwise(
            """
            {
            .reg .b32 s;
            prmt.b32 s, $1, 0, 0x1032;
            fma.rn.bf16x2 $0, s, $2, $1;
            }
            """,
            "=r,r,r", [w, k], dtype=tl.int32, is_pure=True, pack=1)


@triton.jit
def _max_bf16x2(a, b):
    """Half-wise max of two bf16x2 words; a NaN half loses (``max.bf16x2``, IEEE maxNum)."""
    return tl.inline_asm_elementwise("max.bf16x2 $0, $1, $2;", "=r,r,r", [a, b],
                                     dtype=tl.int32, is_pure=True, pack=1)


@triton.jit
def _e2m1_thresholds_bf16x2(S):
    """t * S for the seven e2m1 thresholds t (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5) as bf16x2
    words (the same value in both halves).  Exact: S (an e4m3 value, >= 2^-9) has <= 4
    significant bits and t <= 3, so t * S fits bf16's 8; fma with a -0 addend is the product."""
    return tl.inline_asm_elementwise(
        """
        {
        .reg .b32 s, z, k;
        cvt.rn.bf16x2.f32 s, $7, $7;
        mov.b32 z, 0x80008000;
        mov.b32 k, 0x3E803E80;
        fma.rn.bf16x2 $0, s, k, z;
        mov.b32 k, 0x3F403F40;
        fma.rn.bf16x2 $1, s, k, z;
        mov.b32 k, 0x3FA03FA0;
        fma.rn.bf16x2 $2, s, k, z;
        mov.b32 k, 0x3FE03FE0;
        fma.rn.bf16x2 $3, s, k, z;
        mov.b32 k, 0x40204020;
        fma.rn.bf16x2 $4, s, k, z;
        mov.b32 k, 0x40604060;
        fma.rn.bf16x2 $5, s, k, z;
        mov.b32 k, 0x40A040A0;
        fma.rn.bf16x2 $6, s, k, z;
        }
        """,
        "=r,=r,=r,=r,=r,=r,=r,f", [S], dtype=(tl.int32,) * 7, is_pure=True, pack=1)


@triton.jit
def _e2m1x2_of_quotient_words(a, au, r, t025, t075, t125, t175, t25, t35, t5):
    """``_e2m1_code_of_quotient`` for both halves of a pair word at once (NVIDIA PTX): ``a``
    the bf16x2 magnitudes for the ``>=`` compares, ``au`` those for the ``>`` compare (the
    same word for bf16 values; see ``_nvfp4_rope_words`` for fp32 values), ``r`` a word
    with the signs in bits 15 / 31, ``t*`` the thresholds t * S as bf16x2
    (``_e2m1_thresholds_bf16x2``) -> each half's code in its top nibble (bits 12-15 / 28-31;
    ``_e2m1x2_bytes`` makes the byte).  Comparing two bf16 values is comparing their fp32
    values, so this is the same three-compare binary search; the unordered compares
    (``geu`` / ``gtu``) pass a NaN through all three: code 7 (the canonical NaN has a clear
    sign bit).  The compare masks select into bits 12-14 and the sign is already bit 15."""
    return tl.inline_asm_elementwise(
        """
        {
        .reg .b32 h, m, l, t, u, v;
        set.geu.u32.bf16x2 h, $1, $7;
        lop3.b32 t, h, $9, $5, 0xCA;
        set.geu.u32.bf16x2 m, $1, t;
        lop3.b32 u, m, $10, $8, 0xCA;
        lop3.b32 v, m, $6, $4, 0xCA;
        lop3.b32 t, h, u, v, 0xCA;
        set.gtu.u32.bf16x2 l, $2, t;
        lop3.b32 t, h, m, 0x40004000, 0xE4;
        lop3.b32 t, t, l, 0x60006000, 0xE4;
        lop3.b32 $0, $3, t, 0x80008000, 0xE4;
        }
        """,
        "=r,r,r,r,r,r,r,r,r,r,r", [a, au, r, t025, t075, t125, t175, t25, t35, t5],
        dtype=tl.int32, is_pure=True, pack=1)


@triton.jit
def _bf16x2_bounds(e, o):
    """fp32 pairs (e, o) as int32 bits -> three words, low half from e: |e|, |o| rounded to
    bf16 toward zero, the same rounded up, and the raw high halves (signs in bits 15 / 31).
    For x >= 0 and a bf16 value t: x >= t iff RZ(x) >= t, and x > t iff RU(x) > t, so the
    e2m1 compares of fp32 values run on these words.  RZ is the high half; RU adds 0xFFFF
    first, after ``min.u32`` with 0x7F800001 so that a NaN (the canonical 0x7FFFFFFF) stays
    a NaN (0x7F81) instead of carrying into the sign bit; Inf and the largest finite value
    give Inf.  (``add.sat.s32`` does the same in one PTX instruction, but in more SASS.)"""
    return tl.inline_asm_elementwise(
        """
        {
        .reg .b32 ae, ao;
        and.b32 ae, $3, 0x7FFFFFFF;
        and.b32 ao, $4, 0x7FFFFFFF;
        prmt.b32 $0, ae, ao, 0x7632;
        min.u32 ae, ae, 0x7F800001;
        min.u32 ao, ao, 0x7F800001;
        add.u32 ae, ae, 0xFFFF;
        add.u32 ao, ao, 0xFFFF;
        prmt.b32 $1, ae, ao, 0x7632;
        prmt.b32 $2, $3, $4, 0x7632;
        }
        """,
        "=r,=r,=r,r,r", [e, o], dtype=(tl.int32, tl.int32, tl.int32), is_pure=True, pack=1)


@triton.jit
def _nvfp4_rope_words(e, o):
    """``_nvfp4_pairs`` for fp32 pairs ``[BT, NG, 8]`` (the rotated RoPE dims; NVIDIA PTX,
    native conversions): amax and scale in fp32 as there, the e2m1 compares on bf16x2 words
    of |x| rounded toward zero (the ``>=`` thresholds) and up (the ``>`` ones), two values
    per instruction (``_bf16x2_bounds``).  A NaN here comes out of the rotation's fma, so it
    is the canonical +NaN: code 7, as in ``_e2m1_code_of_quotient``."""
    amax = tl.maximum(tl.max(tl.abs(e), axis=2), tl.max(tl.abs(o), axis=2))
    sf = tl.minimum(tl.maximum(amax * (1.0 / 6.0), 0.001953125), 448.0)
    sb = _e4m3_encode(sf, False, False)
    t025, t075, t125, t175, t25, t35, t5 = _e2m1_thresholds_bf16x2(_e4m3_decode(sb, False, False))
    z, u, r = _bf16x2_bounds(e.to(tl.int32, bitcast=True), o.to(tl.int32, bitcast=True))
    return _e2m1x2_bytes(_e2m1x2_of_quotient_words(
        z, u, r, tl.broadcast_to(t025[:, :, None], z.shape), tl.broadcast_to(t075[:, :, None], z.shape),
        tl.broadcast_to(t125[:, :, None], z.shape), tl.broadcast_to(t175[:, :, None], z.shape),
        tl.broadcast_to(t25[:, :, None], z.shape), tl.broadcast_to(t35[:, :, None], z.shape),
        tl.broadcast_to(t5[:, :, None], z.shape))), sb


@triton.jit
def _e2m1x2_bytes(c):
    """Packed NVFP4 bytes (low nibble: the low half's code) of words holding the two codes
    in their top nibbles (``_e2m1x2_of_quotient_words``), four words per step: two ``prmt``
    gather the bytes holding the low codes and those holding the high codes, and one
    shift + ``lop3`` merges the nibbles -- 1.5 instructions per byte instead of shifting
    each word and re-packing bytes for the store."""
    return tl.inline_asm_elementwise(
        """
        {
        .reg .b32 x, y, lo, hi;
        prmt.b32 x, $1, $2, 0x7531;
        prmt.b32 y, $3, $4, 0x7531;
        prmt.b32 lo, x, y, 0x6420;
        prmt.b32 hi, x, y, 0x7531;
        shr.b32 lo, lo, 4;
        lop3.b32 $0, lo, hi, 0x0F0F0F0F, 0xE4;
        }
        """,
        "=r,r,r,r,r", [c], dtype=tl.uint8, is_pure=True, pack=4)


@triton.jit
def _nvfp4_words(w, SANITIZE: tl.constexpr):
    """``_nvfp4_pairs`` for the NoPE pairs, from their bf16 words ``[BT, NG, 8]`` (NVIDIA
    PTX): the NoPE values are bf16 values, so rotation, amax and the e2m1 compares all run
    on both halves of a word at once.  -> (packed bytes ``[BT, NG, 8]``, e4m3 scale bytes
    ``[BT, NG]``)."""
    r = _nope_rot_words(w, SANITIZE)
    a = r & 0x7FFF7FFF
    am = tl.reduce(a, 2, _max_bf16x2)
    amax = tl.maximum((am << 16).to(tl.float32, bitcast=True),
                      (am & -65536).to(tl.float32, bitcast=True))
    sf = tl.minimum(tl.maximum(amax * (1.0 / 6.0), 0.001953125), 448.0)
    sb = _e4m3_encode(sf, False, False)
    t025, t075, t125, t175, t25, t35, t5 = _e2m1_thresholds_bf16x2(_e4m3_decode(sb, False, False))
    return _e2m1x2_bytes(_e2m1x2_of_quotient_words(
        a, a, r, tl.broadcast_to(t025[:, :, None], a.shape), tl.broadcast_to(t075[:, :, None], a.shape),
        tl.broadcast_to(t125[:, :, None], a.shape), tl.broadcast_to(t175[:, :, None], a.shape),
        tl.broadcast_to(t25[:, :, None], a.shape), tl.broadcast_to(t35[:, :, None], a.shape),
        tl.broadcast_to(t5[:, :, None], a.shape))), sb


@triton.jit
def _nvfp4_tile_index(G0: tl.constexpr, NG: tl.constexpr):
    """Pair (= packed byte) index ``[NG, 8]`` of the 288 record's groups G0 .. G0+NG-1."""
    return (G0 + tl.arange(0, NG))[:, None] * 8 + tl.arange(0, 8)[None, :]


@triton.jit
def _nvfp4_tile_store(w, cache_ptr, vbase, valid, G0: tl.constexpr, NG: tl.constexpr,
                      SANITIZE: tl.constexpr):
    """288 record, NVIDIA PTX: the NoPE words ``w [BT, NG, 8]`` of groups G0 .. quantized
    by ``_nvfp4_words``; the packed bytes are stored at ``vbase``, the scale bytes returned
    (the caller stores them last: with more than one warp their store goes through shared
    memory and a barrier, which would hold back the loads and stores after it)."""
    pp = _nvfp4_tile_index(G0, NG)
    b, sb = _nvfp4_words(w, SANITIZE)
    tl.store(cache_ptr + vbase[:, None, None] + pp[None, :, :], b, mask=valid[:, None, None])
    return sb


# --------------------------------------------------------------------------------------
# quantize_and_insert_k_cache (spec cache_ops §3)
# --------------------------------------------------------------------------------------


@triton.jit
def _quant_insert_kernel(
    k_ptr, k_stride, cache_ptr, page_stride, slot_ptr, T, capacity, block_size: tl.constexpr,
    NG: tl.constexpr, G: tl.constexpr, NQ: tl.constexpr, VB: tl.constexpr, SB: tl.constexpr,
    HAS_TAIL: tl.constexpr, TAIL_I16: tl.constexpr, FNUZ: tl.constexpr, SOFT: tl.constexpr,
    EXACT_LOG2: tl.constexpr, BLOCK_T: tl.constexpr,
    PDL: tl.constexpr = False, INTERLEAVED: tl.constexpr = False,
):
    launch.pdl_prologue(PDL)
    FP8_MAX: tl.constexpr = 224.0 if FNUZ else 448.0
    W: tl.constexpr = NG * G
    t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    valid, page, tok = _slot_page(slot_ptr, t, T, block_size, page_stride, capacity)
    vbase = _value_base(page, tok, VB, SB, INTERLEAVED)
    sbase = _scale_base(page, tok, block_size, VB, SB, INTERLEAVED)
    krow = t.to(tl.int64) * k_stride

    # rows are loaded for every t < T, so the loads do not wait for the slot load
    # (a skipped row is read, never stored)
    tmask = t < T
    d = tl.arange(0, W)
    qmask = valid[:, None] & (d < NQ * G)[None, :]
    x = tl.load(k_ptr + krow[:, None] + d[None, :],
                mask=tmask[:, None] & (d < NQ * G)[None, :], other=0.0)
    if HAS_TAIL:
        # 584: dims NQ*G.. copied verbatim as bf16 bits; loaded up front, since a load
        # after the stores below could not be moved above them (no alias information)
        j = tl.arange(0, 64)
        k16 = k_ptr.to(tl.pointer_type(tl.int16))
        tail = tl.load(k16 + krow[:, None] + NQ * G + j[None, :], mask=tmask[:, None])
    x3 = tl.reshape(x.to(tl.float32), (BLOCK_T, NG, G))
    mult, code = _ue8m0_scale(tl.max(_nan_abs(x3, SOFT), axis=2), FP8_MAX, EXACT_LOG2, False)
    q = _ue8m0_apply(x3, mult[:, :, None], FP8_MAX, FNUZ, SOFT)
    tl.store(cache_ptr + vbase[:, None] + d[None, :], tl.reshape(q, (BLOCK_T, W)), mask=qmask)
    g = tl.arange(0, NG)
    code = tl.where((g < NQ)[None, :], code, 0)  # V4 record: pad byte 0
    tl.store(cache_ptr + sbase[:, None] + g[None, :], code.to(tl.uint8),
             mask=valid[:, None] & (g < SB)[None, :])
    if HAS_TAIL:
        _store_i16(cache_ptr, vbase + NQ * G, j, tail, valid, TAIL_I16)


_quant_insert_launch = bind(_quant_insert_kernel)


@functools.lru_cache(maxsize=None)
def _geometry(width: int) -> dict:
    """Constexpr geometry of a paged KV record, read from ``dsv41.core.formats``: NQ quantized
    groups of G dims (NG: the power of two the group axis is padded to), VB value bytes and
    SB scale bytes per token.  Shared between calls: read it, never change it."""
    rec = RECORDS[int(width)]
    return dict(NG=launch.pow2(rec.n_groups), G=rec.group, NQ=rec.n_groups,
                VB=rec.value_bytes, SB=rec.scale_bytes)


@functools.lru_cache(maxsize=None)
def _record_bytes(width: int) -> dict:
    """``VB`` / ``SB`` of the rope writer for a record of ``width`` bytes (0 / 0 for rows)."""
    if not width:
        return dict(VB=0, SB=0)
    g = _geometry(width)
    return dict(VB=g["VB"], SB=g["SB"])


def _align(t: torch.Tensor, *strides) -> int:
    """Largest of 4, 2, 1 dividing the tensor's address and the given byte strides (a power
    of two divides them all when it divides their bitwise or; this runs on every launch)."""
    bits = t.data_ptr()
    for s in strides:
        bits |= s
    return 4 if bits % 4 == 0 else 2 if bits % 2 == 0 else 1


def quantize_and_insert_k_cache(k, k_cache, slot_mapping, block_size, use_fnuz, bytes_per_token,
                                interleaved=False):
    T = slot_mapping.shape[0]
    if T == 0:
        return
    v41 = bytes_per_token == 528
    BT, NW = _shape("insert", bytes_per_token, T)
    page_stride = k_cache.stride(0)
    dev = k_cache.device
    pdl = launch.decode_pdl(dev, T)
    _quant_insert_launch((launch.cdiv(T, BT),),
        k, k.stride(0), k_cache, page_stride, slot_mapping, T, k_cache.shape[0] * block_size, block_size,
        **_geometry(bytes_per_token), HAS_TAIL=not v41, TAIL_I16=(k_cache.data_ptr() | page_stride) % 2 == 0,
        FNUZ=bool(use_fnuz), SOFT=conversions.integer_path(dev), EXACT_LOG2=_exact_log2(),
        BLOCK_T=BT, PDL=pdl, INTERLEAVED=bool(interleaved), num_warps=NW, **launch.pdl_kwargs(pdl),
    )


# --------------------------------------------------------------------------------------
# dequantize_and_gather_k_cache (spec cache_ops §4, finding 1)
# --------------------------------------------------------------------------------------


@triton.jit
def _gather_kernel(
    out_ptr, out_s0, out_s1, cache_ptr, page_stride, seq_lens_ptr, gather_lens_ptr,
    bt_ptr, bt_s0, bt_width, num_blocks, block_size: tl.constexpr, offset, out_rows,
    REC: tl.constexpr, NG: tl.constexpr, G: tl.constexpr, NQ: tl.constexpr, VB: tl.constexpr,
    SB: tl.constexpr, HAS_GL: tl.constexpr, TAIL_I16: tl.constexpr, FNUZ: tl.constexpr,
    SOFT: tl.constexpr, BLOCK_T: tl.constexpr,
    PDL: tl.constexpr = False, INTERLEAVED: tl.constexpr = False,
):
    launch.pdl_prologue(PDL)
    r = tl.program_id(0)
    w = tl.program_id(1)
    nw = tl.num_programs(1)
    # Rows [offset, offset + n) of request r get positions L - n ... L - 1.  Out-of-contract
    # values never leave a tensor (docs/bad_input.md): rows past out.shape[1] are not
    # written, and a row whose position is negative, whose logical block is past the table
    # width or whose block id is outside the cache is written as zeros (its loads are masked
    # off and decode to +0).  The per-request terms in int64, so no value wraps around; per
    # row, 32-bit compares only: rows i < first = n - L have a negative position, and a row's
    # position L - n + i is below L < 2^31 once i >= first, so its 32-bit sum is exact.
    # num_blocks is at most 2^31 - 1 (the launcher caps it): a block id of the int32 table is
    # in range when it is below it as an unsigned number (negative ids are >= 2^31 there).
    # The table is read at the logical block clamped into its row and the row guards are
    # applied after the read, not as the read's mask: with them as its mask, Triton 3.6 read
    # the table six times per program instead of three, and the 584 gather at 4096 rows took
    # 3.4 % longer than without guards on an H100, against 1.7 % this way (docs/decisions.md).
    L = tl.load(seq_lens_ptr + r).to(tl.int64)
    if HAS_GL:
        n = tl.load(gather_lens_ptr + r).to(tl.int64)
    else:
        n = L
    n_out = tl.minimum(n, out_rows).to(tl.int32)
    first = tl.minimum(tl.maximum(n - L, 0), out_rows).to(tl.int32)
    start = (L - n).to(tl.int32)  # wraps where L - n < -2^31, which only rows i < first see
    r64 = r.to(tl.int64)
    o16 = out_ptr.to(tl.pointer_type(tl.int16))
    for i0 in range(w * BLOCK_T, n_out, nw * BLOCK_T):
        i = i0 + tl.arange(0, BLOCK_T)
        m = i < n_out
        pm = m & (i >= first)
        # where pm is false (p negative or wrapped), jc still lies in the row, ok is false
        # and every cache load is masked off: the values below are not used.  The position is
        # divided as an unsigned number (a negative one lands past the row, or at -1 for
        # block_size 1): the signed divide costs the 4096-row gather 1.7 % on an H100.
        pu = (start + i).to(tl.uint32, bitcast=True)
        ju = pu // block_size
        j = ju.to(tl.int32, bitcast=True)
        jc = tl.minimum(j, bt_width - 1)  # negative only for an empty table or block_size 1
        blk = tl.load(bt_ptr + r64 * bt_s0 + jc, mask=jc >= 0, other=-1)
        ok = pm & (j < bt_width) & (blk.to(tl.uint32, bitcast=True) < num_blocks)
        tok = (pu - ju * block_size).to(tl.int32, bitcast=True)
        page = blk.to(tl.int64) * page_stride
        orow = r64 * out_s0 + (offset + i).to(tl.int64) * out_s1
        if REC == 288:
            # NVFP4: VB = 256 packed bytes, SB = 32 e4m3 scales (always OCP)
            kb = tl.arange(0, VB)
            pb = tl.load(cache_ptr + _value_base(page, tok, VB, SB, INTERLEAVED)[:, None] + kb[None, :],
                         mask=ok[:, None], other=0).to(tl.int32)
            g = tl.arange(0, SB)
            sc = tl.load(cache_ptr + _scale_base(page, tok, block_size, VB, SB, INTERLEAVED)[:, None]
                         + g[None, :], mask=ok[:, None], other=0)
            S16 = (_e4m3_decode(sc, False, SOFT) * 16384.0)[:, :, None]  # exact: S * 2^14
            pb3 = tl.reshape(pb, (BLOCK_T, SB, VB // SB))
            lo = _e2m1_half(pb3) * S16
            hi = _e2m1_half(pb3 >> 4) * S16
            v = tl.reshape(tl.join(lo, hi), (BLOCK_T, 512))
            d = tl.arange(0, 512)
            tl.store(o16 + orow[:, None] + d[None, :], _bf16_bits(v, SOFT), mask=m[:, None])
        else:
            d = tl.arange(0, NG * G)
            dmask = m[:, None] & (d < NQ * G)[None, :]
            vbase = _value_base(page, tok, VB, SB, INTERLEAVED)
            qb = tl.load(cache_ptr + vbase[:, None] + d[None, :], mask=ok[:, None] & (d < NQ * G)[None, :],
                         other=0)
            g = tl.arange(0, NG)
            code = tl.load(cache_ptr + _scale_base(page, tok, block_size, VB, SB, INTERLEAVED)[:, None]
                           + g[None, :], mask=ok[:, None] & (g < NQ)[None, :], other=0).to(tl.int32)
            S = (code << 23).to(tl.float32, bitcast=True)  # 2^(code-127); 0 -> 0, 255 -> inf
            if REC == 584:
                # the bf16 tail, loaded before any store (a load after a store could not be
                # moved above it: no alias information)
                jt = tl.arange(0, 64)
                src = vbase + NQ * G
                if TAIL_I16:
                    c16 = (cache_ptr + src).to(tl.pointer_type(tl.int16))
                    tail = tl.load(c16[:, None] + jt[None, :], mask=ok[:, None], other=0)
                else:
                    lo = tl.load(cache_ptr + src[:, None] + 2 * jt[None, :], mask=ok[:, None],
                                 other=0).to(tl.int32)
                    hi = tl.load(cache_ptr + src[:, None] + 2 * jt[None, :] + 1, mask=ok[:, None],
                                 other=0).to(tl.int32)
                    tail = (lo | (hi << 8)).to(tl.int16)
            v3 = tl.reshape(_e4m3_decode(qb, FNUZ, SOFT), (BLOCK_T, NG, G)) * S[:, :, None]
            v = tl.reshape(v3, (BLOCK_T, NG * G))
            tl.store(o16 + orow[:, None] + d[None, :], _bf16_bits(v, SOFT), mask=dmask)
            if REC == 584:
                tl.store(o16 + orow[:, None] + NQ * G + jt[None, :], tail, mask=m[:, None])


_gather_launch = bind(_gather_kernel)


def dequantize_and_gather_k_cache(out, k_cache, seq_lens, gather_lens, block_table, block_size,
                                  offset, use_fnuz, interleaved=False):
    R = seq_lens.shape[0]
    rows = out.shape[1] - offset
    if R == 0 or rows <= 0:
        return
    rec = k_cache.shape[-1]
    BT, NW = _shape("gather", rec, rows * R)
    workers = max(1, min(launch.cdiv(rows, BT), launch.cdiv(CONFIG["gather_programs"], R)))
    page_stride = k_cache.stride(0)
    dev = out.device
    pdl = launch.decode_pdl(dev, rows * R)
    _gather_launch((R, workers),
        out, out.stride(0), out.stride(1), k_cache, page_stride, seq_lens,
        gather_lens if gather_lens is not None else seq_lens,
        block_table, block_table.stride(0), min(block_table.shape[1], 2**31 - 1),
        min(k_cache.shape[0], 2**31 - 1), block_size, offset, rows,
        REC=int(rec), **_geometry(rec), HAS_GL=gather_lens is not None,
        TAIL_I16=(k_cache.data_ptr() | page_stride) % 2 == 0,
        FNUZ=bool(use_fnuz), SOFT=conversions.integer_path(dev), BLOCK_T=BT, PDL=pdl,
        INTERLEAVED=bool(interleaved), num_warps=NW, **launch.pdl_kwargs(pdl),
    )


# --------------------------------------------------------------------------------------
# rope_quant_insert (spec cache_ops §8.2, §2.5, findings 2-3)
# --------------------------------------------------------------------------------------

_MODE_584, _MODE_528, _MODE_288, _MODE_BF16, _MODE_FP8 = 0, 1, 2, 3, 4


@triton.jit
def _rope_quant_insert_kernel(
    lat_ptr, lat_s0, pos_ptr, cs_ptr, cs_s0, cs_rows, cache_ptr, page_stride, row_stride, slot_ptr,
    scale_ptr, T, capacity, block_size: tl.constexpr,
    CR: tl.constexpr, MODE: tl.constexpr, SANITIZE: tl.constexpr, WORDS: tl.constexpr,
    ALIGN: tl.constexpr, SOFT: tl.constexpr, PTX: tl.constexpr, EXACT_LOG2: tl.constexpr,
    BLOCK_T: tl.constexpr,
    PDL: tl.constexpr = False, ROPE_WORDS: tl.constexpr = True,
    INTERLEAVED: tl.constexpr = False, VB: tl.constexpr = 0, SB: tl.constexpr = 0,
):
    launch.pdl_prologue(PDL)
    # VB / SB: value and scale bytes per token of the record (MODE 0-2; ``_geometry``).
    # The latent is read as pairs (e, o) = dims (2i, 2i+1), i < 256: pairs 0..223 are NoPE
    # (a 256-lane tile, lanes >= 224 masked off; 288 on NVIDIA reads its own tiles, and the
    # unused loads compile away), 224..255 the RoPE dims.  Every record
    # stores per pair (two e4m3 bytes, one e2m1 byte, two bf16 values), so nothing is ever
    # interleaved back.  Offsets: lat_s0 in words (WORDS) or elements; cache in bytes.
    t, valid, page, tok, rmask, crow = _rope_tokens(
        slot_ptr, pos_ptr, T, block_size, page_stride, capacity, cs_rows, cs_s0, CR, BLOCK_T)
    lrow = t.to(tl.int64) * lat_s0
    p = tl.arange(0, 256)
    pm = valid[:, None] & (p < 224)[None, :]
    wn = _latent_words(lat_ptr, lrow[:, None], p[None, :], rmask[:, None] & (p < 224)[None, :],
                       WORDS)
    ne, no = _word_halves(wn)
    re, ro = _bf16_pairs(lat_ptr, lrow, 224, 32, 32, rmask, WORDS)
    re, ro = _rope_cs(re, ro, cs_ptr, crow, rmask, SANITIZE)
    i = tl.arange(0, 32)
    vm = valid[:, None]

    if MODE == 0:
        # 584: NoPE quantized from the *unrotated* latent (7 groups of 64 = 32 pairs, pad
        # code 0); RoPE dims rotated and stored as bf16 (one word per pair).
        e3 = tl.reshape(ne, (BLOCK_T, 8, 32))
        o3 = tl.reshape(no, (BLOCK_T, 8, 32))
        amax = tl.maximum(tl.max(_nan_abs(e3, SOFT), axis=2), tl.max(_nan_abs(o3, SOFT), axis=2))
        mult, code = _ue8m0_scale(amax, 448.0, EXACT_LOG2, SANITIZE)
        q = _ue8m0_pair_bytes(e3, o3, mult[:, :, None], SOFT, PTX)
        vbase = page + tok * VB
        _store_units(cache_ptr, vbase, p, tl.reshape(q, (BLOCK_T, 256)), pm, 2, ALIGN >= 2)
        g = tl.arange(0, 8)
        code = tl.where((g < 7)[None, :], code, 0)
        tl.store(cache_ptr + (page + block_size * VB + tok * SB)[:, None] + g[None, :],
                 code.to(tl.uint8), mask=vm)
        _store_units(cache_ptr, vbase + 448, i, _bf16_word(re, ro, SOFT, PTX), vm, 4, ALIGN >= 4)
    else:
        if MODE != 2:
            ne, no = _nope_rot(ne, no, SANITIZE)
        if MODE == 1:
            # 528: rotated fp32 row in 16 UE8M0 groups of 32 (14 NoPE groups + 2 RoPE groups)
            qn, cn = _ue8m0_pairs(tl.reshape(ne, (BLOCK_T, 16, 16)), tl.reshape(no, (BLOCK_T, 16, 16)),
                                  EXACT_LOG2, SANITIZE, SOFT, PTX)
            vbase = _value_base(page, tok, VB, SB, INTERLEAVED)
            _store_units(cache_ptr, vbase, p, tl.reshape(qn, (BLOCK_T, 256)), pm, 2, ALIGN >= 2)
            qr, cr = _ue8m0_pairs(tl.reshape(re, (BLOCK_T, 2, 16)), tl.reshape(ro, (BLOCK_T, 2, 16)),
                                  EXACT_LOG2, SANITIZE, SOFT, PTX)
            _store_units(cache_ptr, vbase + 448, i, tl.reshape(qr, (BLOCK_T, 32)), vm, 2, ALIGN >= 2)
            sbase = _scale_base(page, tok, block_size, VB, SB, INTERLEAVED)
            g = tl.arange(0, 16)
            tl.store(cache_ptr + sbase[:, None] + g[None, :], cn.to(tl.uint8),
                     mask=vm & (g < 14)[None, :])
            g2 = tl.arange(0, 2)
            tl.store(cache_ptr + (sbase + 14)[:, None] + g2[None, :], cr.to(tl.uint8), mask=vm)
        elif MODE == 2:
            # 288: NVFP4 groups of 16 = 8 pairs (28 NoPE groups + 4 RoPE groups), one byte per
            # pair, e4m3 scale bytes
            vbase = _value_base(page, tok, VB, SB, INTERLEAVED)
            sbase = _scale_base(page, tok, block_size, VB, SB, INTERLEAVED)
            # RoPE: 4 groups, loaded as [BT, 4, 8] (no reshape of the 2-D pairs)
            pr = _nvfp4_tile_index(28, 4) - 224
            wr = _latent_words(lat_ptr, lrow[:, None, None], 224 + pr[None, :, :],
                               rmask[:, None, None], WORDS)
            c3 = tl.load(cs_ptr + crow[:, None, None] + pr[None, :, :], mask=rmask[:, None, None],
                         other=1.0).to(tl.float32)
            s3 = tl.load(cs_ptr + crow[:, None, None] + 32 + pr[None, :, :],
                         mask=rmask[:, None, None], other=0.0).to(tl.float32)
            if PTX:
                # NoPE in tiles of 16 + 8 + 4 groups (no masked lanes), every load issued
                # before the first store
                m3 = rmask[:, None, None]
                l3 = lrow[:, None, None]
                w0 = _latent_words(lat_ptr, l3, _nvfp4_tile_index(0, 16)[None, :, :], m3, WORDS)
                w1 = _latent_words(lat_ptr, l3, _nvfp4_tile_index(16, 8)[None, :, :], m3, WORDS)
                w2 = _latent_words(lat_ptr, l3, _nvfp4_tile_index(24, 4)[None, :, :], m3, WORDS)
                s0 = _nvfp4_tile_store(w0, cache_ptr, vbase, valid, 0, 16, SANITIZE)
                s1 = _nvfp4_tile_store(w1, cache_ptr, vbase, valid, 16, 8, SANITIZE)
                s2 = _nvfp4_tile_store(w2, cache_ptr, vbase, valid, 24, 4, SANITIZE)
            else:
                ne, no = _nope_rot(ne, no, SANITIZE)
                pn, sn = _nvfp4_pairs(tl.reshape(ne, (BLOCK_T, 32, 8)),
                                      tl.reshape(no, (BLOCK_T, 32, 8)), SOFT)
                _store_units(cache_ptr, vbase, p, tl.reshape(pn, (BLOCK_T, 256)), pm, 1, True)
            re3, ro3 = _word_halves(wr)
            re3, ro3 = _rope(re3, ro3, c3, s3)
            if SANITIZE:
                re3 = tl.where(re3 != re3, 0.0, re3)
                ro3 = tl.where(ro3 != ro3, 0.0, ro3)
            if PTX and ROPE_WORDS:
                br, sr = _nvfp4_rope_words(re3, ro3)
            else:
                br, sr = _nvfp4_pairs(re3, ro3, SOFT)
            tl.store(cache_ptr + (vbase + 224)[:, None, None] + pr[None, :, :], br,
                     mask=valid[:, None, None])
            if PTX:
                g16 = tl.arange(0, 16)
                tl.store(cache_ptr + sbase[:, None] + g16[None, :], s0, mask=vm)
                g8 = tl.arange(0, 8)
                tl.store(cache_ptr + (sbase + 16)[:, None] + g8[None, :], s1, mask=vm)
                g4 = tl.arange(0, 4)
                tl.store(cache_ptr + (sbase + 24)[:, None] + g4[None, :], s2, mask=vm)
            else:
                g = tl.arange(0, 32)
                tl.store(cache_ptr + sbase[:, None] + g[None, :], sn,
                         mask=vm & (g < 28)[None, :])
            g4 = tl.arange(0, 4)
            tl.store(cache_ptr + (sbase + 28)[:, None] + g4[None, :], sr, mask=vm)
        else:
            rbase = page + tok * row_stride
            if MODE == 3:
                # bf16 rows: one word (two bf16) per pair
                _store_units(cache_ptr, rbase, p, _bf16_word(ne, no, SOFT, PTX), pm, 4, ALIGN >= 4)
                _store_units(cache_ptr, rbase + 896, i, _bf16_word(re, ro, SOFT, PTX), vm, 4,
                             ALIGN >= 4)
            else:
                # fp8 rows: e4m3(clamp448(fp32(bf16(x')) * fl32(1 / scale))), two bytes per pair
                inv = tl.math.div_rn(1.0, tl.load(scale_ptr))
                un = _fp8_row_pair(ne, no, inv, SOFT, PTX)
                ur = _fp8_row_pair(re, ro, inv, SOFT, PTX)
                _store_units(cache_ptr, rbase, p, un, pm, 2, ALIGN >= 2)
                _store_units(cache_ptr, rbase + 448, i, ur, vm, 2, ALIGN >= 2)


_rope_quant_insert_launch = bind(_rope_quant_insert_kernel)


@triton.jit
def _fp8_row_pair(e, o, inv, SOFT: tl.constexpr, PTX: tl.constexpr):
    """The two e4m3 bytes of the fp8 row record for pairs (e, o), as one int16 (spec §8.2)."""
    if PTX:
        # min.f32 drops NaN (-> +448), the satfinite convert clamps the rest to +-448
        return _e4m3x2(tl.minimum(_bf16_round(e, SOFT) * inv, 448.0),
                       tl.minimum(_bf16_round(o, SOFT) * inv, 448.0))
    ye = _bf16_round(e, SOFT) * inv
    ye = tl.where(ye != ye, 448.0, tl.minimum(tl.maximum(ye, -448.0), 448.0))
    yo = _bf16_round(o, SOFT) * inv
    yo = tl.where(yo != yo, 448.0, tl.minimum(tl.maximum(yo, -448.0), 448.0))
    ce = _e4m3_encode(ye, False, SOFT).to(tl.int32)
    co = _e4m3_encode(yo, False, SOFT).to(tl.int32)
    return (ce | (co << 8)).to(tl.int16)


# record width -> mode of the rope writer; mode -> its launch-shape variant (``tuning``)
_ROPE_MODES = {584: _MODE_584, 528: _MODE_528, 288: _MODE_288}
_ROPE_VARIANTS = {_MODE_584: 584, _MODE_528: 528, _MODE_288: 288, _MODE_BF16: "bf16", _MODE_FP8: "fp8"}


def rope_quant_insert(latent, positions, cos_sin_cache, kv_cache, slot_mapping, compress_ratio,
                      fp8_scale, sanitize_nans, interleaved=False):
    T = slot_mapping.numel()
    if T == 0:
        return
    B = kv_cache.shape[1]
    if kv_cache.dtype == torch.uint8:
        mode = _ROPE_MODES[kv_cache.shape[-1]]
    elif kv_cache.dtype == torch.bfloat16:
        mode = _MODE_BF16
    else:
        mode = _MODE_FP8
    # byte offsets for every record
    cache = kv_cache if mode <= _MODE_288 else kv_cache.view(torch.uint8)
    page_stride, row_stride = cache.stride(0), cache.stride(1)
    # one 4-byte word per latent pair where the rows are 4-byte aligned (the latent is
    # contiguous, so only an odd storage offset is not)
    words = (latent.data_ptr() % 4 == 0 and latent.stride(0) % 2 == 0
             and latent.storage_offset() % 2 == 0)
    lat = latent.view(torch.int32) if words else latent.view(torch.int16)
    dev = kv_cache.device
    soft, ptx = conversions.paths(dev)
    pdl = launch.decode_pdl(dev, T)
    BT, NW = _shape("rope", _ROPE_VARIANTS[mode], T)
    _rope_quant_insert_launch((launch.cdiv(T, BT),),
        lat, lat.stride(0), positions, cos_sin_cache, cos_sin_cache.stride(0), cos_sin_cache.shape[0],
        cache, page_stride, row_stride, slot_mapping,
        fp8_scale if fp8_scale is not None else slot_mapping, T, kv_cache.shape[0] * B, B,
        CR=int(compress_ratio), MODE=mode, SANITIZE=bool(sanitize_nans), WORDS=words,
        ALIGN=_align(cache, page_stride, row_stride), SOFT=soft,
        PTX=ptx and CONFIG["ptx_pairs"] is not False,
        EXACT_LOG2=_exact_log2(), BLOCK_T=BT, PDL=pdl, ROPE_WORDS=bool(CONFIG["rope288_words"]),
        INTERLEAVED=bool(interleaved), **_record_bytes(kv_cache.shape[-1] if mode <= _MODE_288 else 0),
        num_warps=NW, **launch.pdl_kwargs(pdl),
    )


# --------------------------------------------------------------------------------------
# indexer_k_norm_rope_store (spec rope_quant_ops §3, finding 2)
# --------------------------------------------------------------------------------------


@triton.jit
def _indexer_store_fp4(cache_ptr, page, o1, blk0, packed, code, block_size, valid,
                       TILED: tl.constexpr, NPT: tl.constexpr, BLOCK_T: tl.constexpr):
    """Two MXFP4 blocks (32 packed bytes, 2 ue8m0 codes) of block index ``blk0``, ``blk0+1``."""
    b = blk0 * 16 + tl.arange(0, 32)[None, :]
    if TILED:
        voff = (o1 // NPT) * (NPT * 64) + (b // 16) * (NPT * 16) + (o1 % NPT) * 16 + b % 16
    else:
        voff = o1 * 64 + b
    tl.store(cache_ptr + page[:, None] + voff, tl.reshape(packed, (BLOCK_T, 32)),
             mask=valid[:, None])
    sidx = blk0 + tl.arange(0, 2)[None, :]
    if TILED:
        S_LO: tl.constexpr = 64 // NPT
        S_HI: tl.constexpr = 4 // S_LO
        soff = ((o1 // NPT) * (NPT * 4) + (sidx % S_LO) * (NPT * S_HI) + (o1 % NPT) * S_HI
                + sidx // S_LO)
    else:
        soff = o1 * 4 + sidx
    tl.store(cache_ptr + page[:, None] + block_size * 64 + soff, code.to(tl.uint8),
             mask=valid[:, None])


@triton.jit
def _indexer_store_fp8(cache_ptr, page, o1, d0, q, valid, TILED: tl.constexpr,
                       BLOCK_T: tl.constexpr):
    """64 e4m3 bytes of dims ``[d0, d0+64)`` (row-major or ROCm 16x16 tiles)."""
    dd = d0 + tl.arange(0, 64)[None, :]
    if TILED:
        voff = (o1 // 16) * 2048 + (dd // 16) * 256 + (o1 % 16) * 16 + dd % 16
    else:
        voff = o1 * 128 + dd
    tl.store(cache_ptr + page[:, None] + voff, tl.reshape(q, (BLOCK_T, 64)), mask=valid[:, None])


@triton.jit
def _indexer_k_kernel(
    k_ptr, k_s0, pos_ptr, cs_ptr, cs_s0, cs_rows, w_ptr, eps, cache_ptr, page_stride, slot_ptr, T,
    capacity, rs_ptr, block_size: tl.constexpr,
    CR: tl.constexpr, FP4: tl.constexpr, TILED: tl.constexpr, NPT: tl.constexpr,
    SOFT: tl.constexpr, EXACT_LOG2: tl.constexpr, BLOCK_T: tl.constexpr, HW: tl.constexpr,
    PDL: tl.constexpr = False,
):
    launch.pdl_prologue(PDL)
    t, valid, page, o, rmask, crow = _rope_tokens(
        slot_ptr, pos_ptr, T, block_size, page_stride, capacity, cs_rows, cs_s0, CR, BLOCK_T)
    krow = t.to(tl.int64) * k_s0
    # NoPE dims 0..63 and RoPE dims 64..127, fp32
    j = tl.arange(0, 64)
    xn = tl.load(k_ptr + krow[:, None] + j[None, :], mask=rmask[:, None], other=0.0).to(tl.float32)
    xr = tl.load(k_ptr + krow[:, None] + 64 + j[None, :], mask=rmask[:, None],
                 other=0.0).to(tl.float32)
    wn = tl.load(w_ptr + j).to(tl.float32)
    wr = tl.load(w_ptr + 64 + j).to(tl.float32)
    # RMSNorm as vLLM's one-warp kernel: 32 lanes of 4 contiguous squares (NoPE lanes 0-15,
    # RoPE 16-31), the xor butterfly (its first step adds lane l and l + 16), exact /128, the
    # GPU's rsqrt
    u = (_lane_chain_sq(tl.reshape(xn, (BLOCK_T, 16, 4)), BLOCK_T, 16, 4)
         + _lane_chain_sq(tl.reshape(xr, (BLOCK_T, 16, 4)), BLOCK_T, 16, 4))
    ss = _butterfly(u, BLOCK_T, 16)
    r = _rsqrt_approx(ss * 0.0078125 + eps, rs_ptr, HW)[:, None]
    kn = _bf16_round((xn * r) * wn[None, :], SOFT)
    kr = _bf16_round((xr * r) * wr[None, :], SOFT)
    # NoPE pairs through (1, 0), RoPE pairs at the group's first position; bf16 round trip
    ne, no = _nope_pairs(tl.reshape(kn, (BLOCK_T, 32, 2)), False)
    e, od = tl.split(tl.reshape(kr, (BLOCK_T, 32, 2)))
    i = tl.arange(0, 32)
    c = tl.load(cs_ptr + crow[:, None] + i[None, :], mask=rmask[:, None], other=1.0).to(tl.float32)
    s = tl.load(cs_ptr + crow[:, None] + 32 + i[None, :], mask=rmask[:, None],
                other=0.0).to(tl.float32)
    re, ro = _rope(e, od, c, s)
    ne = tl.reshape(_bf16_round(ne, SOFT), (BLOCK_T, 2, 16))
    no = tl.reshape(_bf16_round(no, SOFT), (BLOCK_T, 2, 16))
    re = tl.reshape(_bf16_round(re, SOFT), (BLOCK_T, 2, 16))
    ro = tl.reshape(_bf16_round(ro, SOFT), (BLOCK_T, 2, 16))
    o1 = o[:, None]
    if FP4:
        # MXFP4: 4 blocks of 32 dims (2 NoPE + 2 RoPE), ue8m0 codes (spec §1.8)
        an = tl.maximum(tl.max(_nan_abs(ne, SOFT), axis=2), tl.max(_nan_abs(no, SOFT), axis=2))
        ar = tl.maximum(tl.max(_nan_abs(re, SOFT), axis=2), tl.max(_nan_abs(ro, SOFT), axis=2))
        xn_ = tl.minimum(tl.maximum(_ceil_log2(tl.maximum(an, 7.052966104933726e-38) * (1.0 / 6.0),
                                               EXACT_LOG2), -127.0), 127.0)
        xr_ = tl.minimum(tl.maximum(_ceil_log2(tl.maximum(ar, 7.052966104933726e-38) * (1.0 / 6.0),
                                               EXACT_LOG2), -127.0), 127.0)
        mn = _exp2i(_neg(xn_))[:, :, None]
        mr = _exp2i(_neg(xr_))[:, :, None]
        pn = (_e2m1_code(ne * mn) | (_e2m1_code(no * mn) << 4)).to(tl.uint8)
        pr = (_e2m1_code(re * mr) | (_e2m1_code(ro * mr) << 4)).to(tl.uint8)
        _indexer_store_fp4(cache_ptr, page, o1, 0, pn, (xn_ + 127.0).to(tl.int32), block_size,
                           valid, TILED, NPT, BLOCK_T)
        _indexer_store_fp4(cache_ptr, page, o1, 2, pr, (xr_ + 127.0).to(tl.int32), block_size,
                           valid, TILED, NPT, BLOCK_T)
    else:
        # FP8: one block of 128, OCP e4m3fn / 448, fp32 scale 2^e (little-endian bytes)
        an = tl.maximum(tl.max(tl.max(_nan_abs(ne, SOFT), axis=2), axis=1),
                        tl.max(tl.max(_nan_abs(no, SOFT), axis=2), axis=1))
        ar = tl.maximum(tl.max(tl.max(_nan_abs(re, SOFT), axis=2), axis=1),
                        tl.max(tl.max(_nan_abs(ro, SOFT), axis=2), axis=1))
        ex = _ceil_log2(tl.maximum(tl.maximum(an, ar), 1e-4) * (1.0 / 448.0), EXACT_LOG2)
        m3 = _exp2i(_neg(ex))[:, None, None]
        qn = tl.join(_e4m3_encode(_clamp_sym(ne * m3, 448.0), False, SOFT),
                     _e4m3_encode(_clamp_sym(no * m3, 448.0), False, SOFT))
        qr = tl.join(_e4m3_encode(_clamp_sym(re * m3, 448.0), False, SOFT),
                     _e4m3_encode(_clamp_sym(ro * m3, 448.0), False, SOFT))
        _indexer_store_fp8(cache_ptr, page, o1, 0, qn, valid, TILED, BLOCK_T)
        _indexer_store_fp8(cache_ptr, page, o1, 64, qr, valid, TILED, BLOCK_T)
        sbits = _exp2i(ex).to(tl.int32, bitcast=True)
        jb = tl.arange(0, 4)[None, :]
        sbytes = ((sbits[:, None] >> (8 * jb)) & 0xFF).to(tl.uint8)
        tl.store(cache_ptr + page[:, None] + block_size * 128 + o1 * 4 + jb, sbytes,
                 mask=valid[:, None])


_indexer_k_launch = bind(_indexer_k_kernel)


def indexer_k_norm_rope_store(k_pre, positions, cos_sin_cache, rms_norm_weight, rms_norm_eps,
                              k_cache, kv_slot_mapping, compress_ratio, use_fp4_cache,
                              mxfp4_n_per_tile, tiled):
    T = kv_slot_mapping.numel()
    if T == 0:
        return
    fp4 = bool(use_fp4_cache)
    BT, NW = _shape("indexer", "mxfp4" if fp4 else "fp8", T)
    dev = k_cache.device
    hw = conversions.approx_hw(dev)
    pdl = launch.decode_pdl(dev, T)
    _indexer_k_launch((launch.cdiv(T, BT),),
        k_pre, k_pre.stride(0), positions, cos_sin_cache, cos_sin_cache.stride(0), cos_sin_cache.shape[0],
        rms_norm_weight, float(rms_norm_eps), k_cache, k_cache.stride(0), kv_slot_mapping, T,
        k_cache.shape[0] * k_cache.shape[1], conversions.approx_table(hw, "rsqrt", dev, k_pre), k_cache.shape[1],
        CR=int(compress_ratio), FP4=fp4, TILED=bool(tiled), HW=hw,
        NPT=int(mxfp4_n_per_tile) if (fp4 and tiled) else 16,
        SOFT=conversions.integer_path(dev), EXACT_LOG2=_exact_log2(), BLOCK_T=BT, PDL=pdl,
        num_warps=NW, **launch.pdl_kwargs(pdl),
    )


# --------------------------------------------------------------------------------------
# fused_save_compress_norm (spec cache_ops §8.1)
# --------------------------------------------------------------------------------------


@triton.jit
def _rmsnorm_store(x, w_ptr, eps, out_ptr, out_s0, t, valid, ap, SOFT: tl.constexpr,
                   HW: tl.constexpr):
    """bf16(x * rsqrt(sum(x^2)/512 + eps) * w): the sum in the order of vLLM's compressor norm
    (``tl.sum(v * v, 0)`` over a 512-wide fp32 row with 4 warps, 4 contiguous elements per
    thread), /512 exact, the GPU's rsqrt (``ap``: the rsqrt table)."""
    d = tl.arange(0, 512)
    ss = _row_sum_sq(x, x.shape[0], 512, 512, 4, 4)
    r = _rsqrt_approx(ss * 0.001953125 + eps, ap, HW)
    w = tl.load(w_ptr + d).to(tl.float32)
    y = (x * r[:, None]) * w[None, :]
    o16 = out_ptr.to(tl.pointer_type(tl.int16))
    tl.store(o16 + (t.to(tl.int64) * out_s0)[:, None] + d[None, :], _bf16_bits(y, SOFT),
             mask=valid[:, None])


@triton.jit
def _compress_norm_kernel(
    kv_ptr, kv_s0, pos_ptr, st_ptr, st_s0, st_s1, cap, slot_ptr, qsl_ptr, t2r_ptr, w_ptr, eps,
    out_ptr, out_s0, T, prev_ptr, prev_s0, pidx_ptr, ring_slots, R, prev_n,
    rs_ptr, rc_ptr, e2_ptr, e2n_ptr,
    CR: tl.constexpr, SOFT: tl.constexpr, BLOCK_T: tl.constexpr, SPEC: tl.constexpr = False,
    HW: tl.constexpr = False, PDL: tl.constexpr = False, HAS_PREV: tl.constexpr = False,
):
    # PDL: the ring save (our own PDL secondary) is scheduled while this kernel runs
    launch.pdl_prologue(PDL)
    # CR 2 beyond decode sizes: program k takes tokens 2k and 2k + 1 (BLOCK_T = 1)
    tl.static_assert(CR == 1 or SPEC or BLOCK_T == 1, "CR-2 pair programs take BLOCK_T = 1")
    t = tl.program_id(0) * (2 * BLOCK_T if CR == 2 and not SPEC else BLOCK_T) + tl.arange(0, BLOCK_T)
    tmask = t < T
    slot = tl.load(slot_ptr + t, mask=tmask, other=-1)
    if CR == 1:
        d = tl.arange(0, 512)
        valid = tmask & (slot >= 0)
        x = tl.load(kv_ptr + (t.to(tl.int64) * kv_s0)[:, None] + d[None, :], mask=tmask[:, None],
                    other=0.0)
        _rmsnorm_store(x, w_ptr, eps, out_ptr, out_s0, t, valid, rs_ptr, SOFT, HW)
    else:
        # first round trip: slot, position and request together.  A ring slot past the
        # state cache, a request index outside [0, R) or a position outside [0, 2^31)
        # skips the token like a negative slot (docs/bad_input.md); unsigned compares, and
        # positions stay int32 (the ring row is an int32 remainder).
        pos = tl.load(pos_ptr + t, mask=tmask, other=0)
        req = tl.load(t2r_ptr + t, mask=tmask, other=0)
        valid = tmask & _pair_closer(slot, pos, req, ring_slots, R)
        if SPEC:
            # Decode sizes (latency): the input rows load with the slot (rows of tokens that
            # turn out not to close a pair are read and dropped, a few KB at these sizes) and
            # the ring row with the chunk start, for every closing token: two dependent round
            # trips.  The ring row of every valid token is inside the state cache (slots
            # past it are not valid, above).
            _pool_pair_store(kv_ptr, kv_s0, st_ptr, st_s0, st_s1, cap, qsl_ptr, w_ptr, eps,
                             out_ptr, out_s0, t, tmask, slot, pos, req, valid, prev_ptr, prev_s0,
                             pidx_ptr, prev_n, rs_ptr, rc_ptr, e2_ptr, e2n_ptr, True, SOFT, HW,
                             HAS_PREV)
        else:
            # Program k takes tokens 2k and 2k + 1 (BLOCK_T = 1): of two consecutive tokens of
            # a request exactly one closes a pair, so a prefill has no program without work
            # (two only across a request boundary, then one after the other).  Their slots,
            # positions and requests load together; rows and chunk starts in the second round
            # trip; the ring row (first token of a chunk only) waits for the chunk start.
            t1 = t + 1
            m1 = t1 < T
            slot1 = tl.load(slot_ptr + t1, mask=m1, other=-1)
            pos1 = tl.load(pos_ptr + t1, mask=m1, other=0)
            req1 = tl.load(t2r_ptr + t1, mask=m1, other=0)
            valid1 = m1 & _pair_closer(slot1, pos1, req1, ring_slots, R)
            if tl.max(valid.to(tl.int32), axis=0) > 0:
                _pool_pair_store(kv_ptr, kv_s0, st_ptr, st_s0, st_s1, cap, qsl_ptr, w_ptr, eps,
                                 out_ptr, out_s0, t, valid, slot, pos, req, valid, prev_ptr,
                                 prev_s0, pidx_ptr, prev_n, rs_ptr, rc_ptr, e2_ptr, e2n_ptr, False,
                                 SOFT, HW, HAS_PREV)
            if tl.max(valid1.to(tl.int32), axis=0) > 0:
                _pool_pair_store(kv_ptr, kv_s0, st_ptr, st_s0, st_s1, cap, qsl_ptr, w_ptr, eps,
                                 out_ptr, out_s0, t1, valid1, slot1, pos1, req1, valid1, prev_ptr,
                                 prev_s0, pidx_ptr, prev_n, rs_ptr, rc_ptr, e2_ptr, e2n_ptr, False,
                                 SOFT, HW, HAS_PREV)


_compress_norm_launch = bind(_compress_norm_kernel)


@triton.jit
def _pair_closer(slot, pos, req, ring_slots, R):
    """CR 2: the tokens that close a pair and whose ring slot, position and request index
    are inside their tensors (0 <= slot < ring_slots, 0 <= pos < 2^31 and odd, 0 <= req < R)."""
    # tl.cast, not .to: Triton passes an integer argument equal to 1 as a constexpr (a Python
    # int), e.g. R for a batch of one request
    s_ok = slot.to(tl.int64).to(tl.uint64, bitcast=True) < tl.cast(ring_slots, tl.uint64)
    p_ok = pos.to(tl.int64).to(tl.uint64, bitcast=True) < 2147483648
    r_ok = req.to(tl.int64).to(tl.uint64, bitcast=True) < tl.cast(R, tl.uint64)
    return s_ok & p_ok & r_ok & ((pos & 1) == 1)


@triton.jit
def _pool_pair_store(kv_ptr, kv_s0, st_ptr, st_s0, st_s1, cap, qsl_ptr, w_ptr, eps, out_ptr,
                     out_s0, t, rows_m, slot, pos, req, valid, prev_ptr, prev_s0, pidx_ptr, prev_n,
                     rs_ptr, rc_ptr, e2_ptr, e2n_ptr,
                     RING_EARLY: tl.constexpr, SOFT: tl.constexpr, HW: tl.constexpr,
                     HAS_PREV: tl.constexpr):
    """CR 2, the closing tokens ``valid``: pool the older row (the previous input row, or
    for the first token of a chunk the ring row the previous chunk stored) with the token's
    own row, RMSNorm, store.  Input rows load under ``rows_m``; the ring row under ``valid``
    (``RING_EARLY``: no wait for the chunk start) or only where the token starts its chunk.
    HAS_PREV: a chunk's first token takes its older row from ``prev_ptr`` row
    ``pidx_ptr[req]`` where that index is in ``[0, prev_n)`` (rows another rank holds), the
    ring row elsewhere; both load under the same mask as the ring row alone."""
    d = tl.arange(0, 512)
    t64 = t.to(tl.int64)
    q0 = tl.load(qsl_ptr + req, mask=valid, other=0)
    if HAS_PREV:
        # with the chunk start, not after it: the older row's address waits for one round
        # trip, as without prev_rows
        pidx = tl.load(pidx_ptr + req, mask=valid, other=-1)
    cur = (t64 * kv_s0)[:, None] + d[None, :]
    prev = cur - kv_s0
    has_prev = (rows_m & (t > 0))[:, None]  # t - 1 is a row of the batch
    kvb = tl.load(kv_ptr + cur, mask=rows_m[:, None], other=0.0)
    sb = tl.load(kv_ptr + cur + 512, mask=rows_m[:, None], other=0.0)
    kvp = tl.load(kv_ptr + prev, mask=has_prev, other=0.0)
    sp = tl.load(kv_ptr + prev + 512, mask=has_prev, other=0.0)
    # older row of a chunk's first token: ring row (slot // cap, (pos - 1) % cap); ring
    # slots and closing positions < 2^31 (int32 arithmetic)
    s32 = tl.where(valid, slot, 0).to(tl.int32)
    older = st_ptr + ((s32 // cap).to(tl.int64) * st_s0
                      + ((pos.to(tl.int32) - 1) % cap).to(tl.int64) * st_s1)
    if RING_EARLY:
        ring_m = valid
    else:
        ring_m = valid & (t == q0)
    if HAS_PREV:
        # one row pointer, then one load pair: loading both rows and selecting would hold
        # both in registers, past the pair programs' register cap (spills)
        use_prev = (pidx >= 0) & (pidx < prev_n)  # past prev_rows: the ring, like -1
        older = tl.where(use_prev, prev_ptr + tl.maximum(pidx, 0).to(tl.int64) * prev_s0, older)
    kvr = tl.load(older[:, None] + d[None, :], mask=ring_m[:, None], other=0.0)
    sr = tl.load(older[:, None] + d[None, :] + 512, mask=ring_m[:, None], other=0.0)
    in_m = (valid & (t != q0))[:, None]
    x = _pool2(tl.where(in_m, kvp, kvr), tl.where(in_m, sp, sr), kvb, sb, rc_ptr, e2_ptr, e2n_ptr, HW)
    _rmsnorm_store(x, w_ptr, eps, out_ptr, out_s0, t, valid, rs_ptr, SOFT, HW)


@triton.jit
def _pool2(kva, sa, kvb, sb, rc_ptr, e2_ptr, e2n_ptr, HW: tl.constexpr):
    """Softmax-weighted pool of the older row a and the newer row b by their scores, as vLLM's
    ``tl.softmax`` over the pair computes it on the GPU: the larger score's weight is exp(0) = 1,
    the other ``small`` = exp(-|sa - sb|) (sb - sa == -(sa - sb) exactly) by the GPU's ``tl.exp``,
    the weights ``div.full`` of 1 and ``small`` by 1 + small; a NaN score makes everything NaN.
    Then ``fma(w_a, kv_a, w_b · kv_b)``."""
    z = _neg(tl.abs(sa - sb))
    small = tl.where(z != z, z, _exp_approx(z, e2_ptr, e2n_ptr, HW))
    den = 1.0 + small
    w1 = _div_full(tl.full(den.shape, 1.0, tl.float32), den, rc_ptr, HW)
    ws = _div_full(small, den, rc_ptr, HW)
    ge = sa >= sb
    wa = tl.where(ge, w1, ws)
    wb = tl.where(ge, ws, w1)
    return tl.fma(wa, kva, wb * kvb)


@triton.jit
def _ring_save_kernel(kv_ptr, kv_s0, st_ptr, st_s0, st_s1, cap, slot_ptr, qsl_ptr, T, ring_slots,
                      PDL: tl.constexpr = False, EARLY: tl.constexpr = True):
    """Program (r, k): row u = e - 1 - k of request chunk [s, e) goes to the ring when it is
    one of the chunk's last min(e - s, cap) rows, inside the batch (u < T), its slot is >= 0
    and the chunk's first slot is >= 0.  No loop: the slots and the row load together once
    s and e are known (two dependent round trips).  With PDL those loads run while the
    pooling kernel still runs (it writes none of them: only latent_out), and the program
    waits for it (every ring read) only before its store (``EARLY``; else before any
    memory access)."""
    if not EARLY:
        launch.pdl_prologue(PDL)
    r = tl.program_id(0)
    k = tl.program_id(1)
    s = tl.load(qsl_ptr + r)
    e = tl.load(qsl_ptr + r + 1)
    c = tl.arange(0, 1024)
    u = tl.full([1024], 0, tl.int32) + (e - 1 - k)  # the row index, one per lane
    take = (u >= tl.maximum(s, e - cap)) & (u < T)
    uc = tl.minimum(tl.maximum(u, 0), T - 1)
    first = tl.load(slot_ptr + tl.minimum(tl.maximum(s, 0), T - 1) + c * 0)  # one address
    sl = tl.load(slot_ptr + uc).to(tl.int64)
    row = tl.load(kv_ptr + uc.to(tl.int64) * kv_s0 + c, mask=take)
    ok = take & (first >= 0) & (sl >= 0) & (sl < ring_slots)  # a slot past the ring: skipped
    if EARLY:
        launch.pdl_prologue(PDL)
    tl.store(st_ptr + (sl // cap) * st_s0 + (sl % cap) * st_s1 + c, row, mask=ok)


_ring_save_launch = bind(_ring_save_kernel)


def fused_save_compress_norm(kv_score, positions, state_cache, slot_mapping, query_start_loc,
                             token_to_req_indices, rms_norm_weight, rms_norm_eps, compress_ratio,
                             latent_out, prev_rows=None, prev_row_indices=None):
    T = slot_mapping.numel()
    if T == 0:
        return
    soft = _soft(latent_out)
    eps = float(rms_norm_eps)
    dev = latent_out.device
    pdl = launch.decode_pdl(dev, T)
    hw = conversions.approx_hw(dev)
    rs = conversions.approx_table(hw, "rsqrt", dev, latent_out)
    if compress_ratio == 1:
        BT, NW = _shape("norm1", None, T)
        _compress_norm_launch((launch.cdiv(T, BT),),
            kv_score, kv_score.stride(0), slot_mapping, kv_score, 0, 0, 1, slot_mapping,
            slot_mapping, slot_mapping, rms_norm_weight, eps, latent_out, latent_out.stride(0), T,
            kv_score, 0, slot_mapping, 0, 0, 0, rs, rs, rs, rs,
            CR=1, SOFT=soft, BLOCK_T=BT, HW=hw, PDL=pdl, num_warps=NW, **launch.pdl_kwargs(pdl),
        )
        return
    cap = state_cache.shape[1]
    BT, NW = _shape("norm2", None, T)
    spec = T <= launch.DECODE_T
    # with prev_rows the caller saves the ring rows itself (save_ring_rows): one launch
    has_prev = prev_rows is not None
    R = query_start_loc.numel() - 1
    ring = R > 0 and cap > 0 and not has_prev
    # the ring save: a PDL launch at every size (its loads overlap the pooling kernel, whose
    # programs then must trigger it: PDL on in the kernel even where its own launch is plain)
    early = bool(CONFIG["ring_pdl"])
    ring_pdl = not has_prev and ((pdl or launch.pdl(latent_out.device)) if early else pdl)
    # decode sizes: BLOCK_T tokens per program; larger launches: two tokens per program
    # (the kernel's pair programs, BLOCK_T = 1)
    BT = BT if spec else 1
    # decode sizes: a PDL launch itself (its launch overlaps the kernel before it)
    _compress_norm_launch((launch.cdiv(T, BT if spec else 2),),
        kv_score, kv_score.stride(0), positions, state_cache, state_cache.stride(0),
        state_cache.stride(1), cap, slot_mapping, query_start_loc, token_to_req_indices,
        rms_norm_weight, eps, latent_out, latent_out.stride(0), T,
        prev_rows if has_prev else kv_score, prev_rows.stride(0) if has_prev else 0,
        prev_row_indices if has_prev else slot_mapping, state_cache.shape[0] * cap, R,
        prev_rows.shape[0] if has_prev else 0,
        rs, conversions.approx_table(hw, "rcp", dev, latent_out), conversions.approx_table(hw, "ex2", dev, latent_out),
        conversions.approx_table(hw, "ex2neg", dev, latent_out),
        CR=2, SOFT=soft, BLOCK_T=BT, SPEC=spec, HW=hw, PDL=pdl or ring_pdl,
        HAS_PREV=has_prev, num_warps=NW, **launch.pdl_kwargs(pdl), **_maxnreg(latent_out, None if spec else CONFIG["norm2_maxnreg"]),
    )
    if ring:
        # after every ring read above (stream order, or the PDL wait), store the chunks'
        # last rows
        _ring_save_launch((R, cap),
            kv_score, kv_score.stride(0), state_cache, state_cache.stride(0),
            state_cache.stride(1), cap, slot_mapping, query_start_loc, T, state_cache.shape[0] * cap,
            PDL=ring_pdl,
            EARLY=early, num_warps=CONFIG["num_warps"]["ring"], **launch.pdl_kwargs(ring_pdl),
        )


# --------------------------------------------------------------------------------------
# save_ring_rows: rows given by the caller into the CR-2 ring (fused_save_compress_norm
# with prev_rows leaves the ring to it)
# --------------------------------------------------------------------------------------


@triton.jit
def _save_ring_rows_kernel(rows_ptr, rows_s0, slot_ptr, st_ptr, st_s0, st_s1, cap, ring_slots,
                           PDL: tl.constexpr = False):
    """Program i: row i to ring row (slot // cap, slot % cap) when its slot is in
    ``[0, ring_slots)`` (a slot past the ring is skipped like a negative one)."""
    launch.pdl_prologue(PDL)
    i = tl.program_id(0)
    c = tl.arange(0, 1024)
    sl = tl.load(slot_ptr + i + c * 0)  # one address
    ok = (sl >= 0) & (sl < ring_slots)
    row = tl.load(rows_ptr + i.to(tl.int64) * rows_s0 + c, mask=ok)
    # ring slots < 2^31: int32 split
    s32 = tl.where(ok, sl, 0).to(tl.int32)
    blk = s32 // cap
    tl.store(st_ptr + blk.to(tl.int64) * st_s0 + (s32 - blk * cap).to(tl.int64) * st_s1 + c, row,
             mask=ok)


_save_ring_rows_launch = bind(_save_ring_rows_kernel)


def save_ring_rows(rows, slot_mapping, state_cache):
    N = slot_mapping.numel()
    if N == 0 or state_cache.shape[1] == 0:  # no ring row: every slot is < 0
        return
    pdl = launch.decode_pdl(state_cache.device, N)
    _save_ring_rows_launch((N,),
        rows, rows.stride(0), slot_mapping, state_cache, state_cache.stride(0),
        state_cache.stride(1), state_cache.shape[1], state_cache.shape[0] * state_cache.shape[1], PDL=pdl,
        num_warps=CONFIG["num_warps"]["ring"], **launch.pdl_kwargs(pdl),
    )


# --------------------------------------------------------------------------------------
# Ahead-of-time build specs (backends/triton/aot.py): the constexpr combinations the
# launchers pick on each vendor (native OCP casts on NVIDIA, integer encoders on AMD;
# FNUZ, tiled layouts and sanitizing where they apply).
# --------------------------------------------------------------------------------------

_CUDA = ("sm90", "sm100")
_HIP = ("gfx942", "gfx950")
# The writers and the gather take the page size as a constexpr (slot -> page / offset by a
# constant: a shift for the usual power of two instead of an integer division per token);
# AOT builds use the V4.1 page size.
AOT_BLOCK_SIZE = 64


def _sig(kernel, types: dict) -> dict:
    return {a: types.get(a, "constexpr") for a in kernel.arg_names}


def _register_aot() -> None:
    mod = __name__.rpartition(".")[2]

    def add(kernel, tag, types, constexprs, targets, num_warps, divisible=()):
        register(AotSpec(
            name=f"{mod}.{kernel.__name__}[{tag}]", kernel=kernel, signature=_sig(kernel, types),
            constexprs=constexprs, num_warps=num_warps, targets=targets, divisible=divisible))

    vendors = ((_CUDA, False, "native"), (_HIP, True, "soft"))
    nw = CONFIG["num_warps"]

    ins_t = {"k_ptr": "*bf16", "k_stride": "i32", "cache_ptr": "*u8", "page_stride": "i32",
             "slot_ptr": "*i64", "T": "i32", "capacity": "i32"}
    # the interleaved layout (vLLM 0.33) of the 528 / 288 records: a ",il" build beside each
    # paged one
    for rec, il in ((584, False), (528, False), (528, True)):
        v41 = rec == 528
        for fnuz in (False, True):
            for targets, soft, flav in vendors:
                add(_quant_insert_kernel, f"{rec},{'fnuz' if fnuz else 'ocp'},{flav}{',il' * il}", ins_t, dict(
                    block_size=AOT_BLOCK_SIZE, **_geometry(rec), HAS_TAIL=not v41, TAIL_I16=True,
                    FNUZ=fnuz, SOFT=soft, EXACT_LOG2=True, BLOCK_T=_shape("insert", rec)[0],
                    INTERLEAVED=il),
                    targets, _shape("insert", rec)[1], ("k_ptr", "k_stride", "cache_ptr", "page_stride"))

    gat_t = {"out_ptr": "*bf16", "out_s0": "i32", "out_s1": "i32", "cache_ptr": "*u8",
             "page_stride": "i32", "seq_lens_ptr": "*i32", "gather_lens_ptr": "*i32",
             "bt_ptr": "*i32", "bt_s0": "i32", "bt_width": "i32", "num_blocks": "i32", "offset": "i32",
             "out_rows": "i32"}
    for rec, flavours, il in ((584, (False, True), False), (528, (False, True), False),
                              (288, (False,), False), (528, (False, True), True), (288, (False,), True)):
        for fnuz in flavours:
            for targets, soft, flav in vendors:
                add(_gather_kernel, f"{rec},{'fnuz' if fnuz else 'ocp'},{flav}{',il' * il}", gat_t, dict(
                    block_size=AOT_BLOCK_SIZE, REC=rec, **_geometry(rec), HAS_GL=True, TAIL_I16=True, FNUZ=fnuz, SOFT=soft,
                    BLOCK_T=_shape("gather", rec)[0], INTERLEAVED=il), targets, _shape("gather", rec)[1],
                    ("out_ptr", "out_s0", "out_s1", "cache_ptr", "page_stride"))

    rope_t = {"lat_ptr": "*i32", "lat_s0": "i32", "pos_ptr": "*i64", "cs_ptr": "*fp32",
              "cs_s0": "i32", "cs_rows": "i32", "cache_ptr": "*u8", "page_stride": "i32", "row_stride": "i32",
              "slot_ptr": "*i64", "scale_ptr": "*fp32", "T": "i32", "capacity": "i32"}
    for mode, name, var, il in ((_MODE_584, "584", 584, False), (_MODE_528, "528", 528, False),
                                (_MODE_288, "288", 288, False), (_MODE_BF16, "bf16rows", "bf16", False),
                                (_MODE_FP8, "fp8rows", "fp8", False), (_MODE_528, "528,il", 528, True),
                                (_MODE_288, "288,il", 288, True)):
        types = rope_t
        for targets, soft, flav in vendors:
            for t in targets:
                # a sanitizing build per writer family (288: its PTX NoPE path masks NaN
                # with set.num, so sm100 builds that variant)
                sanitize = ((t == "gfx950" and mode in (_MODE_584, _MODE_528))
                            or (t == "sm100" and mode == _MODE_288))
                add(_rope_quant_insert_kernel, f"{name},{flav},{t}", types, dict(
                    block_size=AOT_BLOCK_SIZE, CR=1, MODE=mode, SANITIZE=sanitize, WORDS=True, ALIGN=4, SOFT=soft, PTX=not soft, EXACT_LOG2=True,
                    PDL=t == "sm100",  # the decode launch's PDL prologue, built for sm100
                    ROPE_WORDS=bool(CONFIG["rope288_words"]), BLOCK_T=_shape("rope", var)[0],
                    INTERLEAVED=il, **_record_bytes(var if mode <= _MODE_288 else 0)), (t,), _shape("rope", var)[1], ("lat_ptr", "lat_s0", "cs_ptr", "cs_s0", "cache_ptr", "page_stride",
                                                 "row_stride"))

    idx_t = {"k_ptr": "*bf16", "k_s0": "i32", "pos_ptr": "*i64", "cs_ptr": "*fp32",
             "cs_s0": "i32", "cs_rows": "i32", "w_ptr": "*bf16", "eps": "fp32", "cache_ptr": "*u8",
             "page_stride": "i32", "slot_ptr": "*i64", "T": "i32", "capacity": "i32", "rs_ptr": "*i32"}
    layouts = [(_CUDA, False, "native", False, False, 16), (_CUDA, False, "native", True, False, 16)]
    layouts += [(_HIP, True, "soft", fp4, tiled, npt)
                for fp4, tiled, npt in ((False, False, 16), (True, False, 16), (False, True, 16),
                                        (True, True, 16), (True, True, 32), (True, True, 64))]
    for targets, soft, flav, fp4, tiled, npt in layouts:
        tag = f"{'mxfp4' if fp4 else 'fp8'},{'tiled' + str(npt) if tiled else 'rows'},{flav}"
        add(_indexer_k_kernel, tag, idx_t, dict(block_size=AOT_BLOCK_SIZE, CR=2, FP4=fp4, TILED=tiled, NPT=npt, SOFT=soft, HW=not soft,
                                                EXACT_LOG2=True, BLOCK_T=_shape("indexer", "mxfp4" if fp4 else "fp8")[0]),
            targets, _shape("indexer", "mxfp4" if fp4 else "fp8")[1], ("k_ptr", "k_s0", "cs_ptr", "cs_s0", "cache_ptr", "page_stride"))

    norm_t = {"kv_ptr": "*fp32", "kv_s0": "i32", "pos_ptr": "*i64", "st_ptr": "*fp32",
              "st_s0": "i32", "st_s1": "i32", "cap": "i32", "slot_ptr": "*i64",
              "qsl_ptr": "*i32", "t2r_ptr": "*i32", "w_ptr": "*bf16", "eps": "fp32",
              "out_ptr": "*bf16", "out_s0": "i32", "T": "i32", "prev_ptr": "*fp32", "prev_s0": "i32",
              "pidx_ptr": "*i32", "ring_slots": "i32", "R": "i32", "prev_n": "i32",
              "rs_ptr": "*i32", "rc_ptr": "*i32", "e2_ptr": "*i32", "e2n_ptr": "*i32"}
    ring_t = {"kv_ptr": "*fp32", "kv_s0": "i32", "st_ptr": "*fp32", "st_s0": "i32",
              "st_s1": "i32", "cap": "i32", "slot_ptr": "*i64", "qsl_ptr": "*i32", "T": "i32",
              "ring_slots": "i32"}
    rows_t = {"rows_ptr": "*fp32", "rows_s0": "i32", "slot_ptr": "*i64", "st_ptr": "*fp32",
              "st_s0": "i32", "st_s1": "i32", "cap": "i32", "ring_slots": "i32"}
    norm_div = ("kv_ptr", "kv_s0", "out_ptr", "out_s0", "st_ptr", "st_s0", "st_s1")
    for targets, soft, flav in vendors:
        for cr in (1, 2):
            add(_compress_norm_kernel, f"cr{cr},{flav}", norm_t, dict(
                CR=cr, SOFT=soft, HW=not soft, BLOCK_T=_shape(f"norm{cr}", None)[0]), targets,
                _shape(f"norm{cr}", None)[1], norm_div)
        # CR 2 with prev_rows: the decode tiles and the pair programs
        add(_compress_norm_kernel, f"cr2,{flav},decode,prev", norm_t, dict(
            CR=2, SOFT=soft, HW=not soft, BLOCK_T=_shape("norm2", None, 1)[0], SPEC=True,
            HAS_PREV=True), targets, _shape("norm2", None, 1)[1], norm_div + ("prev_ptr", "prev_s0"))
        add(_compress_norm_kernel, f"cr2,{flav},pairs,prev", norm_t, dict(
            CR=2, SOFT=soft, HW=not soft, BLOCK_T=1, HAS_PREV=True), targets,
            _shape("norm2", None)[1], norm_div + ("prev_ptr", "prev_s0"))
        add(_ring_save_kernel, flav, ring_t, {"PDL": False}, targets, nw["ring"],
            ("kv_ptr", "kv_s0", "st_ptr", "st_s0", "st_s1"))
        add(_save_ring_rows_kernel, flav, rows_t, {"PDL": False}, targets, nw["ring"],
            ("rows_ptr", "rows_s0", "st_ptr", "st_s0", "st_s1"))
    # the CR-2 decode pair as launched on SM90+ (speculative loads, PDL)
    add(_compress_norm_kernel, "cr2,native,decode,pdl", norm_t, dict(
        CR=2, SOFT=False, BLOCK_T=_shape("norm2", None, 1)[0], SPEC=True, HW=True, PDL=True), _CUDA,
        _shape("norm2", None, 1)[1], ("kv_ptr", "kv_s0", "out_ptr", "out_s0", "st_ptr", "st_s0",
                                      "st_s1"))
    # the CR-2 pair programs as launched on SM90+ (PDL on: they trigger the ring save)
    add(_compress_norm_kernel, "cr2,native,pairs,pdl", norm_t, dict(
        CR=2, SOFT=False, BLOCK_T=1, HW=True, PDL=True), _CUDA, _shape("norm2", None)[1],
        ("kv_ptr", "kv_s0", "out_ptr", "out_s0", "st_ptr", "st_s0", "st_s1"))
    add(_ring_save_kernel, "native,pdl", ring_t, {"PDL": True}, _CUDA, nw["ring"],
        ("kv_ptr", "kv_s0", "st_ptr", "st_s0", "st_s1"))
    # with prev_rows on SM90+: the decode launch is a PDL launch (no ring save follows)
    add(_compress_norm_kernel, "cr2,native,decode,pdl,prev", norm_t, dict(
        CR=2, SOFT=False, BLOCK_T=_shape("norm2", None, 1)[0], SPEC=True, HW=True, PDL=True,
        HAS_PREV=True), _CUDA, _shape("norm2", None, 1)[1], norm_div + ("prev_ptr", "prev_s0"))
    add(_save_ring_rows_kernel, "native,pdl", rows_t, {"PDL": True}, _CUDA, nw["ring"],
        ("rows_ptr", "rows_s0", "st_ptr", "st_s0", "st_s1"))


_register_aot()
