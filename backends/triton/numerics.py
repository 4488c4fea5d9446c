"""The number helpers of the Triton kernels (``@triton.jit``, inlined at each call): fp32 <->
bf16 / e4m3 / e2m1 codes, power-of-two scale exponents, exact sign flips.  Every conversion has
an integer-arithmetic form next to the hardware one, chosen by a constexpr (``SOFT`` / ``CVT_HW``
/ ``EXACT``), and each is pinned to the bytes of ``dsv41.core.codecs`` by the conformance tests.

Three helpers come in two forms, one per kernel family, with the same result on every non-NaN
input:

* sign flip: ``_neg`` (``x * -1``, the cache kernels) and ``_neg_sign_bit`` (xor of the sign bit,
  the RoPE / indexer kernels).  On a NaN they may differ in sign and payload (a hardware multiply
  may return its canonical NaN, the xor flips the sign); the NaN paths downstream
  (``_clamp_sym`` reads the sign of a NaN) were verified on the H200 with the form each family
  uses, so each keeps it until the other is verified there.
* bf16 bits: ``_bf16_bits`` (int16, ``SOFT``) and ``_bf16_bits_i32`` (int32, ``CVT_HW``): the
  same bits, in the integer width each family's packing uses.
* e2m1 code: ``_e2m1_code`` (bit arithmetic) and ``_e2m1_code_search`` (a three-compare
  search on |x|): the same codes, NaN included (0 with its sign bit); two instruction sequences,
  each kept by the kernel family that was tuned and verified with it.

The RoPE rotation itself (``_rope``) stays with the cache kernels; the reductions live in
``reductions.py``.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _neg(x):
    """Exact sign flip (-0 <-> +0); unary minus would compile to 0 - x."""
    return x * -1.0


@triton.jit
def _ceil_log2(r, EXACT: tl.constexpr):
    """``ceil(fl32(log2 r))`` as fp32 for normal r > 0 or +inf (-> +inf)."""
    if EXACT:
        bits = r.to(tl.int32, bitcast=True)
        ex = (bits >> 23) & 0xFF
        man = bits & 0x7FFFFF
        k = ex - 127
        ak = tl.where(k < 0, 0 - k, k)
        # fl32(k + log2(1 + j 2^-23)) == k  <=>  j <= floor((2^h - 1) 2^23), h = half an
        # ulp of |k| = 2^(m-24) for 2^m <= |k| < 2^(m+1) (a quarter ulp, i.e. m - 1, below a
        # power of two for negative k = -2^m).  For |k| <= 127 that bound is exactly
        # floor(ln2 * 2^(m-1)) (0, 0, 1, 2, 5, 11, 22 for m = 0..6): m comes from the exponent
        # bits of float(|k|), 2^(m-1) is built from bits, one multiply and a truncation.
        akb = ak.to(tl.float32).to(tl.int32, bitcast=True)
        eb = (akb >> 23) - ((k < 0) & ((akb & 0x7FFFFF) == 0)).to(tl.int32)  # 127 + m (0 for k = 0)
        half = (tl.maximum(eb - 1, 0) << 23).to(tl.float32, bitcast=True)  # 2^(m-1) (tiny -> 0)
        thr = (half * 0.6931471805599453).to(tl.int32)
        e = (k + (man > thr).to(tl.int32)).to(tl.float32)
        return tl.where(ex == 255, r, e)
    else:
        return tl.ceil(tl.log2(r))


@triton.jit
def _exp2i(e):
    """2^e for integer-valued fp32 e (ex2.approx.ftz semantics): e <= -127 -> 0, e >= 128 -> inf."""
    ec = tl.minimum(tl.maximum(e, -127.0), 128.0)
    return ((ec.to(tl.int32) + 127) << 23).to(tl.float32, bitcast=True)


@triton.jit
def _clamp_sym(x, M: tl.constexpr):
    """sign(x) * min(|x|, M); NaN -> +-M by its sign bit (PTX min.xorsign.abs)."""
    mag = tl.where(x != x, M, tl.minimum(tl.abs(x), M))
    sign = (x.to(tl.int32, bitcast=True) >> 31) << 31
    return (mag.to(tl.int32, bitcast=True) | sign).to(tl.float32, bitcast=True)


@triton.jit
def _e4m3_encode(x, FNUZ: tl.constexpr, SOFT: tl.constexpr):
    """fp32 (finite, |x| <= 448 / 240) -> e4m3 byte, RNE; FNUZ has no -0."""
    if FNUZ or SOFT:
        bits = x.to(tl.int32, bitcast=True)
        sign = (bits >> 24) & 0x80
        a = bits & 0x7FFFFFFF
        af = a.to(tl.float32, bitcast=True)
        if FNUZ:
            # bias 8, smallest normal 2^-7, subnormal step 2^-10 (magic 2^13), max 240
            rn = a + 0x7FFFF + ((a >> 20) & 1)
            cn = (rn >> 20) - 952
            cs = (af + 8192.0).to(tl.int32, bitcast=True) - 0x46000000
            c = tl.where(a < 0x3C000000, cs, cn)
            c = tl.minimum(c, 0x7F)
            sign = tl.where(c == 0, 0, sign)
        else:
            # bias 7, smallest normal 2^-6, subnormal step 2^-9 (magic 2^14), max 448
            rn = a + 0x7FFFF + ((a >> 20) & 1)
            cn = (rn >> 20) - 960
            cs = (af + 16384.0).to(tl.int32, bitcast=True) - 0x46800000
            c = tl.where(a < 0x3C800000, cs, cn)
            c = tl.minimum(c, 0x7E)
        return (c | sign).to(tl.uint8)
    else:
        return x.to(tl.float8e4nv).to(tl.uint8, bitcast=True)


@triton.jit
def _e4m3_decode(b, FNUZ: tl.constexpr, SOFT: tl.constexpr):
    """e4m3 byte (any int type) -> exact fp32; NaN bytes -> NaN."""
    if FNUZ or SOFT:
        bi = b.to(tl.int32) & 0xFF
        ex = (bi >> 3) & 0xF
        mb = bi & 7
        if FNUZ:
            sub = (mb.to(tl.float32) * 0.0009765625).to(tl.int32, bitcast=True)
            nrm = ((ex + 119) << 23) | (mb << 20)
            nan = bi == 0x80
        else:
            sub = (mb.to(tl.float32) * 0.001953125).to(tl.int32, bitcast=True)
            nrm = ((ex + 120) << 23) | (mb << 20)
            nan = (bi & 0x7F) == 0x7F
        v = tl.where(ex == 0, sub, nrm) | ((bi & 0x80) << 24)
        v = tl.where(nan, 0x7FC00000, v)
        return v.to(tl.float32, bitcast=True)
    else:
        return b.to(tl.uint8).to(tl.float8e4nv, bitcast=True).to(tl.float32)


@triton.jit
def _bf16_bits(x, SOFT: tl.constexpr):
    """fp32 -> bf16 bits (int16), RNE; every NaN -> 0x7FFF (the GPU's canonical NaN)."""
    if SOFT:
        bits = x.to(tl.int32, bitcast=True)
        r = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
        r = tl.where(x != x, 0x7FFF, r)
        return r.to(tl.int16)
    else:
        # cvt.rn.bf16.f32 already writes every NaN as the canonical 0x7FFF
        return x.to(tl.bfloat16).to(tl.int16, bitcast=True)


@triton.jit
def _bf16_round(x, SOFT: tl.constexpr):
    """fp32 -> bf16 (RNE) -> fp32."""
    b = _bf16_bits(x, SOFT).to(tl.int32) << 16
    return b.to(tl.float32, bitcast=True)


@triton.jit
def _e4m3x2(lo, hi):
    """e4m3(lo) | e4m3(hi) << 8 as int16, both by one ``cvt.rn.satfinite.e4m3x2.f32`` (which
    puts its first source in the upper byte).  NVIDIA only (sm_89+); NaN gives 0x7F, so
    callers clamp NaN away first.  Pairs from two tensors would otherwise be converted two
    by two *within* each tensor and then re-packed byte by byte."""
    return tl.inline_asm_elementwise("cvt.rn.satfinite.e4m3x2.f32 $0, $2, $1;", "=h,f,f",
                                     [lo, hi], dtype=tl.int16, is_pure=True, pack=1)


@triton.jit
def _bf16x2(lo, hi):
    """bf16(lo) | bf16(hi) << 16 as int32 (RNE, NaN -> 0x7FFF) by one ``cvt.rn.bf16x2.f32``."""
    return tl.inline_asm_elementwise("cvt.rn.bf16x2.f32 $0, $2, $1;", "=r,f,f",
                                     [lo, hi], dtype=tl.int32, is_pure=True, pack=1)


@triton.jit
def _bf16_word(lo, hi, SOFT: tl.constexpr, PTX: tl.constexpr):
    """The bf16 pair (lo, hi) as one little-endian int32 word."""
    if PTX:
        return _bf16x2(lo, hi)
    else:
        return (_bf16_bits(lo, SOFT).to(tl.int32) & 0xFFFF) | (_bf16_bits(hi, SOFT).to(tl.int32) << 16)


@triton.jit
def _e2m1_code(x):
    """fp32 -> e2m1 code (int32 0..15): RNE on codes, |x| > 6 -> 6, sign bit kept, NaN -> 0.

    e2m1 is a float with 2 exponent bits (bias 1) and 1 mantissa bit: normal |x| >= 1 round
    the fp32 mantissa to 1 bit (RNE) and rebias, subnormal |x| < 1 round on the 0.5 grid by
    adding 2^22 (exactly the thresholds 0.25/0.75/1.25/1.75/2.5/3.5/5 with ties to even).
    """
    bits = x.to(tl.int32, bitcast=True)
    a = bits & 0x7FFFFFFF
    af = a.to(tl.float32, bitcast=True)
    rn = a + 0x1FFFFF + ((a >> 22) & 1)
    cn = (rn >> 22) - 252
    cs = (af + 4194304.0).to(tl.int32, bitcast=True) - 0x4A800000
    c = tl.minimum(tl.where(a < 0x3F800000, cs, cn), 7)
    c = tl.where(a > 0x7F800000, 0, c)
    return c | ((bits >> 28) & 8)


@triton.jit
def _e2m1_half(b):
    """The e2m1 nibble in bits 0-3 of ``b`` as fp32 times 2^-14, exactly: its three magnitude
    bits placed at an fp16's bits 11-9 (exponent 1..3 -> 2^-14..2^-12 times 1.m, code 1 the
    fp16 subnormal 2^-15), the sign at bit 15 only for a non-zero magnitude (finding 1:
    code 8 decodes to +0), then the exact fp16 -> fp32 conversion.  A few integer operations
    instead of a select chain per code; times ``S * 2^14`` it is the decoded value."""
    mag = (b << 9) & 0x0E00
    sgn = (b << 12) & 0x8000
    h = mag | (sgn & (mag + 0x7E00))  # bit 15 of mag + 0x7E00 is set iff mag != 0
    return h.to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def _nan_abs(x, SOFT: tl.constexpr):
    """|x| for a NaN-ignoring amax.  On NVIDIA (native conversions) the max reductions
    compile to ``max.f32``/FMNMX, which already drop a NaN operand (IEEE maxNum; an all-NaN
    group gives NaN, which every caller's floor ``maximum(amax, c)`` turns into c, as for 0),
    so |x| is enough; elsewhere NaN -> 0 explicitly."""
    if SOFT:
        return tl.where(x != x, 0.0, tl.abs(x))
    else:
        return tl.abs(x)


@triton.jit
def _ue8m0_scale(amax, FP8_MAX: tl.constexpr, EXACT_LOG2: tl.constexpr, SANITIZE: tl.constexpr):
    """amax (NaN-ignored) -> (multiplier 2^-e, code int32) (spec cache_ops §2.1 steps 1-3, 5)."""
    a = tl.maximum(amax, 1e-4)
    r = a * (1.0 / FP8_MAX)
    e = _ceil_log2(r, EXACT_LOG2)
    if SANITIZE:
        code = tl.minimum(tl.maximum(e + 127.0, 0.0), 254.0)
    else:
        code = tl.minimum(tl.maximum(e + 127.0, 0.0), 255.0)
    return _exp2i(_neg(e)), code.to(tl.int32)


@triton.jit
def _ue8m0_apply(x, mult, FP8_MAX: tl.constexpr, FNUZ: tl.constexpr, SOFT: tl.constexpr):
    """x * 2^-e, computed NaN -> +FP8_MAX (finding 3), symmetric clamp, e4m3 byte."""
    y = x * mult
    if FNUZ or SOFT:
        y = tl.where(y != y, FP8_MAX, tl.minimum(tl.maximum(y, -FP8_MAX), FP8_MAX))
    else:
        # the native cast (cvt.rn.satfinite) saturates |y| > 448 and -inf to -448 itself;
        # min.f32 returns the non-NaN operand, so this one min is the NaN -> +448 rule
        y = tl.minimum(y, FP8_MAX)
    return _e4m3_encode(y, FNUZ, SOFT)


@triton.jit
def _neg_sign_bit(x):
    """IEEE negation (sign-bit flip; -(+0) = -0).  Triton lowers unary minus to ``0 - x``
    on some versions (3.6), which turns -(+0) into +0: the RoPE zero signs of §1.2 need the
    true negation that upstream's contracted ``a*b - c*d`` applies."""
    return (x.to(tl.uint32, bitcast=True) ^ 0x80000000).to(tl.float32, bitcast=True)


@triton.jit
def _rn_bf16(x, CVT_HW: tl.constexpr):
    """fp32 -> bf16 (round to nearest even) -> fp32 (the bf16 round trip, §1.4)."""
    if CVT_HW:
        y = x.to(tl.bfloat16).to(tl.float32)
    else:
        u = x.to(tl.uint32, bitcast=True)
        r = ((u + 0x7FFF + ((u >> 16) & 1)) >> 16) << 16
        y = tl.where(x != x, x, r.to(tl.float32, bitcast=True))
    return y


@triton.jit
def _bf16_bits_i32(x, CVT_HW: tl.constexpr):
    """fp32 -> bf16 bits as int32 (RNE); every NaN -> 0x7FFF (the GPU's canonical NaN, F3)."""
    if CVT_HW:
        # cvt.rn.bf16.f32 already writes every NaN as 0x7FFF
        return x.to(tl.bfloat16).to(tl.int16, bitcast=True).to(tl.int32)
    else:
        u = x.to(tl.uint32, bitcast=True)
        b = ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).to(tl.int32)
        return tl.where(x != x, 0x7FFF, b)


@triton.jit
def _e4m3_code(x, FNUZ: tl.constexpr, CVT_HW: tl.constexpr, NAN_CODE: tl.constexpr):
    """fp32 -> e4m3 byte (int32 0..255), round to nearest even, saturating.

    OCP e4m3fn: |x| > 448 and ±inf -> ±448 (``cvt.rn.satfinite``), NaN -> ``NAN_CODE``
    (0x7F as the convert writes it, or 0x7E = +448 where the op clamps NaN to +448 first).
    FNUZ e4m3fnuz: |x| > 240 -> ±240, NaN -> 0x80, zero (and anything rounding to it) ->
    0x00.  Same bytes as ``codecs.e4m3_encode`` (after ``clamp_sym`` for NAN_CODE 0x7E).
    """
    if CVT_HW and not FNUZ:
        code = x.to(tl.float8e4nv).to(tl.uint8, bitcast=True).to(tl.int32)
        code = tl.where(x != x, NAN_CODE, code)
    else:
        BIAS: tl.constexpr = 8 if FNUZ else 7
        MAX_BITS: tl.constexpr = 0x43700000 if FNUZ else 0x43E00000  # 240.0 / 448.0
        MIN_NORMAL_BITS: tl.constexpr = (128 - BIAS) << 23
        SUB_SCALE: tl.constexpr = 2.0 ** (BIAS + 2)  # subnormal step 2^-(BIAS+2) -> 1
        u = x.to(tl.uint32, bitcast=True)
        sign = (u >> 31).to(tl.int32)
        a = (u & 0x7FFFFFFF).to(tl.int32)
        nan = a > 0x7F800000
        a = tl.minimum(a, MAX_BITS)  # saturate (±inf included)
        # normal range: round the fp32 mantissa to 3 bits (RNE) and rebias the exponent
        normal = ((a + 0x7FFFF + ((a >> 20) & 1)) >> 20) - ((127 - BIAS) << 3)
        # subnormal range: RNE(|x| / 2^-(BIAS+2)) with the fp32 2^23 rounding trick
        af = a.to(tl.float32, bitcast=True)
        sub = (af * SUB_SCALE + 8388608.0).to(tl.int32, bitcast=True) - 0x4B000000
        code = tl.where(a < MIN_NORMAL_BITS, sub, normal)
        if FNUZ:
            code = tl.where(code == 0, 0, code | (sign << 7))
            code = tl.where(nan, 0x80, code)
        else:
            code = tl.where(nan, NAN_CODE, code | (sign << 7))
    return code


@triton.jit
def _e4m3_pair(lo, hi, FNUZ: tl.constexpr, CVT_HW: tl.constexpr, PTX: tl.constexpr):
    """``_e4m3_code(lo) | _e4m3_code(hi) << 8`` (NaN -> 0x7F) as int16.  OCP with PTX: one
    ``cvt.rn.satfinite.e4m3x2``, whose NaN is 0x7F.  Two converts joined by shift and or are
    mis-built for sm_90 by ptxas 12.8 (Triton 3.6's): the upper code's byte is taken from the
    stack pointer register (docs/measurements/h100-indexer-q-words-41.txt)."""
    if PTX and not FNUZ:
        return _e4m3x2(lo, hi)
    else:
        code = _e4m3_code(lo, FNUZ, CVT_HW, 0x7F) | (_e4m3_code(hi, FNUZ, CVT_HW, 0x7F) << 8)
        return code.to(tl.int16)


@triton.jit
def _word_halves(w):
    """The two bf16 values of int32 pair words as fp32: (low half, high half)."""
    return (w << 16).to(tl.float32, bitcast=True), (w & -65536).to(tl.float32, bitcast=True)


@triton.jit
def _ceil_exp_bits(s):
    """Exact ``ceil(log2 s)`` for fp32 s > 0 normal or +inf (-> 128), from the bits ("(B)").
    Equal to the fp32-log2 ceiling "(L)" for every s = amax·RN32(1/M) with a bf16-valued
    amax (or the 1e-4 / 6·2^-126 floors) and M in {448, 224, 6} (checked exhaustively in
    the tests), which is all the indexer Q needs."""
    b = s.to(tl.int32, bitcast=True)
    return ((b >> 23) & 0xFF) - 127 + ((b & 0x7FFFFF) != 0).to(tl.int32)


@triton.jit
def _e2m1_code_search(x):
    """fp32 -> e2m1 code 0..15 (RNE on codes, |x| > 6 -> 6, sign bit kept; §1.7)."""
    # the code counts the thresholds passed (0.25 >, 0.75 >=, 1.25 >, 1.75 >=, 2.5 >, 3.5 >=,
    # 5 >); they pass monotonically, so a 3-step binary search finds it (NaN passes none)
    a = tl.abs(x)
    hi = a >= 1.75
    mid = a >= tl.where(hi, 3.5, 0.75)
    lo = a > tl.where(hi, tl.where(mid, 5.0, 2.5), tl.where(mid, 1.25, 0.25))
    code = hi.to(tl.int32) * 4 + mid.to(tl.int32) * 2 + lo.to(tl.int32)
    sign = (x.to(tl.uint32, bitcast=True) >> 31).to(tl.int32)
    return code | (sign << 3)


@triton.jit
def _e2m1x2_bf16(lo, hi):
    """``_e2m1_code_search(lo) | _e2m1_code_search(hi) << 4`` for bf16-valued fp32 (lo, hi), as int32.

    NVIDIA PTX: the pair is packed as bf16x2 (exact: both are bf16 values) and the same
    three-compare binary search as ``_e2m1_code`` runs on both halves at once with the
    bf16x2 ``set`` compares (each half 0xFFFF / 0) and ``lop3`` selects of the packed
    thresholds, about half the instructions per element.  NaN passes no compare (code 0,
    and the bf16x2 convert makes every NaN positive, as the fp32 path sees it on NVIDIA)."""
    return tl.inline_asm_elementwise(
        """
        {
        .reg .b32 w, a, h, t, m, u, v, l, c;
        cvt.rn.bf16x2.f32 w, $2, $1;
        and.b32 a, w, 0x7FFF7FFF;
        mov.b32 t, 0x3FE03FE0;
        set.ge.u32.bf16x2 h, a, t;
        lop3.b32 t, h, 0x40604060, 0x3F403F40, 0xCA;
        set.ge.u32.bf16x2 m, a, t;
        lop3.b32 u, m, 0x40A040A0, 0x40204020, 0xCA;
        lop3.b32 v, m, 0x3FA03FA0, 0x3E803E80, 0xCA;
        lop3.b32 t, h, u, v, 0xCA;
        set.gt.u32.bf16x2 l, a, t;
        and.b32 c, h, 0x00040004;
        lop3.b32 c, m, 0x00020002, c, 0xEA;
        lop3.b32 c, l, 0x00010001, c, 0xEA;
        shr.b32 u, w, 12;
        lop3.b32 c, u, 0x00080008, c, 0xEA;
        shr.b32 u, c, 12;
        or.b32 c, c, u;
        and.b32 $0, c, 0xFF;
        }
        """,
        "=r,f,f", [lo, hi], dtype=tl.int32, is_pure=True, pack=1)


@triton.jit
def _ceil_exp_log(s):
    """``ceil(RN32(log2 s))`` for fp32 s > 0 (normal) or +inf (-> 128), from the bits.

    For s = 2^k (1 + m 2^-23), m > 0, the exact log2 lies in (k, k+1); its fp32 rounding
    falls back onto k iff log2(1 + m 2^-23) is below half an ulp of k (on the side towards
    zero for k < 0), i.e. iff m <= thr(n) with n = k (k > 0) or |k| - 1 (k < 0) and
    thr = floor(ln2 2^(floor(log2 n) - 1)) = 1, 2, 5, 11, 22, 44 for n in [4, 8), [8, 16),
    ..., [128, 256) (0 below 4).  No tie can occur (the log is irrational).
    """
    b = s.to(tl.int32, bitcast=True)
    k = ((b >> 23) & 0xFF) - 127
    m = b & 0x7FFFFF
    n = tl.where(k > 0, k, -k - 1)
    thr = tl.where(n >= 128, 44, tl.where(n >= 64, 22, tl.where(n >= 32, 11, tl.where(
        n >= 16, 5, tl.where(n >= 8, 2, tl.where(n >= 4, 1, 0))))))
    return k + (m > thr).to(tl.int32)


@triton.jit
def _pow2_of(e):
    """2^e as fp32 for integer e in [-126, 128] (128 -> +inf)."""
    return ((e + 127) << 23).to(tl.float32, bitcast=True)


@triton.jit
def _inv_pow2_of(e):
    """2^-e as fp32 for integer e in [-126, 128]; 0 for e >= 127 (``exp2i`` flush)."""
    bits = tl.where(e >= 127, 0, (127 - e) << 23)
    return bits.to(tl.float32, bitcast=True)


# --------------------------------------------------------------------------------------
# The NVIDIA GPU's approximate primitives (dsv41.core.gpu_approx): ``HW`` uses the instruction
# itself (an SM90 GPU, where the tables were measured), otherwise the table, passed as an int32
# pointer of result bits (``gpu_approx.result_bits``), gives the same bits on any device.
# --------------------------------------------------------------------------------------


@triton.jit
def _rsqrt_approx(x, tab_ptr, HW: tl.constexpr):
    """``rsqrt.approx.ftz.f32`` of fp32 ``x`` (``tl.rsqrt`` on NVIDIA)."""
    if HW:
        return tl.rsqrt(x)
    else:
        b = x.to(tl.int32, bitcast=True)
        ef = (b >> 23) & 0xFF
        e = ef - 127
        ok = (ef > 0) & (ef < 255) & (b > 0)
        idx = tl.where(ok, ((e & 1) << 23) | (b & 0x7FFFFF), 0)
        t = tl.load(tab_ptr + idx)
        out = t - ((e >> 1) << 23)
        out = tl.where(ef == 0, tl.where(b < 0, -8388608, 0x7F800000), out)  # +-0 / subnormal: +-inf
        out = tl.where((ef != 0) & (b < 0), 0x7FFFFFFF, out)  # negative, -inf, NaN: canonical NaN
        out = tl.where((ef == 255) & (b > 0), tl.where((b & 0x7FFFFF) == 0, 0, 0x7FFFFFFF), out)
        return out.to(tl.float32, bitcast=True)


@triton.jit
def _rcp_approx_t(x, tab_ptr):
    """``rcp.approx.ftz.f32`` of fp32 ``x`` from its table (any device)."""
    b = x.to(tl.int32, bitcast=True)
    sign = b & -2147483648
    ef = (b >> 23) & 0xFF
    mag = tl.load(tab_ptr + (b & 0x7FFFFF)) - ((ef - 127) << 23)
    mag = tl.where(mag < 8388608, 0, mag)  # subnormal result: flushed
    mag = tl.where(ef == 0, 0x7F800000, mag)
    nan = (ef == 255) & ((b & 0x7FFFFF) != 0)
    mag = tl.where(ef == 255, 0, mag)
    out = tl.where(nan, 0x7FFFFFFF, mag | sign)
    return out.to(tl.float32, bitcast=True)


@triton.jit
def _div_full(a, b, tab_ptr, HW: tl.constexpr):
    """``div.full.f32(a, b)`` (fp32 ``a / b`` in Triton on NVIDIA) = ``fl32(a * rcp(b))``, both
    operands scaled by 2^24 for a subnormal ``b`` and by 1/4 for ``|b| >= 2^126`` first."""
    if HW:
        return a / b
    else:
        mag = tl.abs(b)
        scale = tl.where(mag >= 8.507059173023462e37, 0.25, tl.where(mag < 1.1754943508222875e-38, 16777216.0, 1.0))
        return (a * scale) * _rcp_approx_t(b * scale, tab_ptr)


@triton.jit
def _ex2_approx_t(x, pos_ptr, neg_ptr):
    """``ex2.approx.ftz.f32`` from the two tables: |x| as fixed point with 23 fraction bits,
    truncated; 2^(±(m + f)) = T±[f] · 2^(±m)."""
    b = x.to(tl.int32, bitcast=True)
    neg = b < 0
    mag = tl.minimum(tl.abs(x), 1073741824.0)  # 2^30: far past overflow / underflow
    q = (mag * 8388608.0).to(tl.int64)  # exact product, then truncation (mag >= 0)
    m = (q >> 23).to(tl.int32)
    f = (q & 8388607).to(tl.int32)
    tp = tl.load(pos_ptr + f)
    tn = tl.load(neg_ptr + f)
    m = tl.minimum(m, 255)  # m << 23 stays in int32; from 255 on the result is 0 / inf anyway
    out = tl.where(neg, tn - (m << 23), tp + (m << 23))
    ovf = (~neg) & ((tp.to(tl.int64) + (m.to(tl.int64) << 23)) >= 0x7F800000)
    udf = neg & ((tn.to(tl.int64) - (m.to(tl.int64) << 23)) < 8388608)
    out = tl.where(ovf, 0x7F800000, tl.where(udf, 0, out))
    out = tl.where(x != x, 0x7FFFFFFF, out)
    return out.to(tl.float32, bitcast=True)


@triton.jit
def _exp_approx(z, pos_ptr, neg_ptr, HW: tl.constexpr):
    """``tl.exp`` on NVIDIA: ``ex2.approx.f32(fl32(z · fl32(log2 e)))`` without ftz (a result
    below 2^-126 is the square of the half-argument's ftz result)."""
    if HW:
        return tl.exp(z)
    else:
        arg = z * 1.4426950408889634
        h = _ex2_approx_t(arg * 0.5, pos_ptr, neg_ptr)
        return tl.where(arg < -126.0, h * h, _ex2_approx_t(arg, pos_ptr, neg_ptr))
