// dsv41 CPU kernels: shared inline numerics (header-only, no torch, C++17).
//
// Every function here is bit-exact with dsv41/codecs.py (the reference) and branch-free
// where it sits in hot loops, so gcc can vectorize loops that call it.  Build flags come
// from _build.py (-O3 -march=native -ffp-contract=off): nothing is contracted unless an
// explicit fmaf() is written.
//
// What it offers (namespace dsv41cpu):
//   bits / from_bits              float <-> uint32 bit casts
//   load_index(p, i, stride, is64) element i of an int32 / int64 index vector, as int64
//   bf16_to_f32(u16)              exact widening
//   f32_to_bf16_rne_nan(f, nanb)  RNE; every NaN -> the bf16 bits nanb
//   f32_to_bf16_rne_canon(f)      RNE; every NaN -> 0x7FFF (the GPU's canonical NaN, finding 3)
//   f32_to_bf16_rne_torch(f)      RNE; every NaN -> 0xFFFF (what torch's CPU float->bf16 cast
//                                 writes, so what codecs.rnbf16 yields on the CPU)
//   rnbf16_torch(f)               fp32 -> bf16 -> fp32 like codecs.rnbf16 on the CPU
//   e4m3fn_encode(f)              OCP e4m3fn, RNE incl. subnormals, |x|>448 and ±inf -> ±448
//                                 (satfinite), NaN -> 0x7F, -0 -> 0x80   (== codecs.e4m3_encode)
//   e4m3fnuz_encode(f)            FNUZ e4m3, RNE incl. subnormals, |x|>240 and ±inf -> ±240,
//                                 NaN -> 0x80, any zero result -> 0x00   (== codecs.e4m3_encode(fnuz))
//   e4m3_encode<FNUZ>(f)          compile-time choice of the two
//   e4m3fn_decode(b), e4m3fnuz_decode(b)   exact fp32, arithmetic (vectorizable, no table)
//   e4m3_tables()                 256-entry fp32 decode tables .ocp[] / .fnuz[] (NaN bytes -> NaN)
//   E2M1_MAG[8]                   e2m1 magnitudes {0,.5,1,1.5,2,3,4,6}
//   e2m1_encode(f)                4-bit code, RNE on codes, |x|>6 -> 6, sign bit kept (-0 -> 0x8),
//                                 NaN -> magnitude 0 with the NaN's sign bit   (== codecs.e2m1_encode)
//   e2m1_tables()                 16-entry fp32 decode tables .signed_zero[] (0x8 -> -0) and
//                                 .plus_zero[] (0x8 -> +0, the NVFP4 gather, finding 1)
//   ceil_log2(r)                  ceil(fl32(log2((double)r))) as float (codecs.ceil_log2), exact
//                                 and libm-free for normal r via a per-exponent threshold table
//   ceil_log2_slow(r)             the same, through libm (any r)
//   exp2i(e)                      2^e for integer-valued float e, flush: e<=-127 -> 0, e>=128 -> inf,
//                                 NaN -> NaN   (== codecs.exp2i)
//   ue8m0_decode(code)            exp2i(code - 127)
//   clamp_sym(x, m)               sign(x)*min(|x|,m); NaN -> ±m by its sign bit (codecs.clamp_sym)
//   clamp_nan_pos(x, m)           min(max(x,-m),m); NaN -> +m (quantizer rule of finding 3)
//   absmax_ignore_nan(x, n)       max |x_i| with NaN elements ignored (PTX max.f32; +0 if all NaN),
//                                 on the bit patterns so the loop vectorizes
//   F32_1E_4, INV_448, INV_224, INV_6   fl32 constants of the quantizers
//   Approx, rsqrt_approx, rcp_approx, div_full, ex2_approx_ftz, exp_approx: the NVIDIA GPU's
//                                 approximate rsqrt / rcp / division / ex2 / tl.exp from the tables
//                                 of dsv41.core.gpu_approx (== those functions)
//
// AVX-512 (F+BW+VL+DQ) 16-lane versions, defined when DSV41_CPU_AVX512 is 1 (compiled with
// -march=native on such a CPU); each is bit-identical to its scalar twin above:
//   v16_bf16_load(p)              16 bf16 -> __m512 (exact)
//   v16_bf16_canon(x)             __m512 -> 16 bf16 bits (__m256i), RNE, NaN -> 0x7FFF
//   v16_bf16_torch(x)             same, NaN -> 0xFFFF (torch's CPU cast)
//   v16_bf16_round(x, nan_bits)   fp32 -> bf16 RNE -> fp32 in place (NaN -> nan_bits << 16)
//   v16_e4m3_encode<FNUZ>(x, sat_bits, nan_code)   16 bytes (__m128i): RNE incl. subnormals,
//                                 |x| saturated to from_bits(sat_bits) (448/240 for the plain
//                                 casts, 448/224 for the quantizers), FNUZ drops the sign of zero.
//                                 NaN: nan_code <= 0xFF -> that byte; V16_NAN_SIGNED_SAT -> ±sat
//                                 by its sign (e4m3(clamp_sym(x, sat))); V16_NAN_POS_SAT -> +sat
//                                 (the quantizers' rule).  (OCP, 0x43E00000, 0x7F) ==
//                                 e4m3fn_encode; (FNUZ, 0x43700000, 0x80) == e4m3fnuz_encode.
//   v16_e4m3_encode_dw<FNUZ>(...) the same, one byte per dword lane (unpacked)
//   v16_pack4_u8(d0, d1, d2, d3)  4 x 16 byte-valued dwords -> 64 bytes in order
//   v16_e4m3_decode<FNUZ>(b)      16 bytes -> __m512 (exact, NaN bytes -> NaN)
//   v16_e2m1_encode(x)            16 codes in the low 4 bits of each dword (== e2m1_encode)
//   v16_abs_bits_nonan(x)         |x| bit patterns with NaN lanes zeroed (for NaN-ignoring amax)
//   v16_hmax16x16_epu32(v[16])    lane g = unsigned max of the 16 lanes of v[g]
//   v16_ceil_log2_pos(r, thr)     ceil_log2 of 16 positive normal r as int32 (thr from
//                                 ceil_log2_table(); lanes with r = +inf must be handled by the
//                                 caller, see the comment at the definition)
//   CompactTables, compact_tables(ap)   the ex2neg / rcp tables in 8 MB (4-bit differences
//                                 from a float64 estimate), checked entry by entry on first use;
//                                 nullptr where they would differ
//   ex2neg_entries(f, ap, c), rcp_entries(m, ap, c)   16 entries of ex2neg / rcp (== the tables;
//                                 from the full tables where c is nullptr)
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <memory>
#include <mutex>
#include <vector>

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && defined(__AVX512DQ__)
#define DSV41_CPU_AVX512 1
#include <immintrin.h>
#else
#define DSV41_CPU_AVX512 0
#endif

namespace dsv41cpu {

// ------------------------------------------------------------------ bit casts
static inline uint32_t bits(float f) {
    uint32_t u;
    std::memcpy(&u, &f, 4);
    return u;
}
static inline float from_bits(uint32_t u) {
    float f;
    std::memcpy(&f, &u, 4);
    return f;
}

// ------------------------------------------------------------------ constants
static const float F32_1E_4 = 0x1.a36e2ep-14f;  // fl32(1e-4)  = 0x38D1B717
static const float INV_448 = 0x1.24924ap-9f;    // fl32(1/448) = 0x3B124925
static const float INV_224 = 0x1.24924ap-8f;    // fl32(1/224) = 0x3B924925
static const float INV_6 = 0x1.555556p-3f;      // fl32(1/6)   = 0x3E2AAAAB

// ------------------------------------------------------------------ bf16
static inline float bf16_to_f32(uint16_t h) { return from_bits((uint32_t)h << 16); }

static inline uint16_t f32_to_bf16_rne_nan(float f, uint16_t nan_bits) {
    uint32_t b = bits(f);
    uint32_t r = (b + 0x7FFFu + ((b >> 16) & 1u)) >> 16;
    bool nan = (b & 0x7FFFFFFFu) > 0x7F800000u;
    return (uint16_t)(nan ? (uint32_t)nan_bits : r);
}

static inline uint16_t f32_to_bf16_rne_canon(float f) { return f32_to_bf16_rne_nan(f, 0x7FFFu); }
static inline uint16_t f32_to_bf16_rne_torch(float f) { return f32_to_bf16_rne_nan(f, 0xFFFFu); }
static inline float rnbf16_torch(float f) { return bf16_to_f32(f32_to_bf16_rne_torch(f)); }

// ------------------------------------------------------------------ e4m3 encode
// RNE, saturating (inf too).  OCP e4m3fn: bias 7, max 448, NaN -> 0x7F, -0 kept.  FNUZ
// e4m3fnuz: bias 8, max 240, NaN -> 0x80, no -0.  The normal range starts at 2^(1-bias)
// (biased fp32 exponent 128 - bias); subnormals are rounded by adding 2^(21-bias), whose ulp
// is the e4m3 subnormal step 2^-(bias+2): the FPU does the RNE.
template <bool FNUZ>
static inline uint8_t e4m3_encode(float f) {
    constexpr uint32_t BIAS = FNUZ ? 8u : 7u;
    constexpr uint32_t MAX_BITS = FNUZ ? 0x43700000u : 0x43E00000u;  // 240 / 448
    constexpr float SUB_MAGIC = FNUZ ? 8192.0f : 16384.0f;           // 2^(21 - bias)
    uint32_t b = bits(f);
    uint32_t sign = (b >> 24) & 0x80u;
    uint32_t a = b & 0x7FFFFFFFu;
    bool nan = a > 0x7F800000u;
    a = a < MAX_BITS ? a : MAX_BITS;
    uint32_t odd = (a >> 20) & 1u;
    uint32_t nrm = (a - ((127u - BIAS) << 23) + 0x7FFFFu + odd) >> 20;
    uint32_t sub = bits(from_bits(a) + SUB_MAGIC) - ((148u - BIAS) << 23);
    uint32_t m = a < ((128u - BIAS) << 23) ? sub : nrm;
    uint32_t r = FNUZ ? (m | (m != 0 ? sign : 0u)) : (m | sign);
    return (uint8_t)(nan ? (FNUZ ? 0x80u : 0x7Fu) : r);
}
static inline uint8_t e4m3fn_encode(float f) { return e4m3_encode<false>(f); }
static inline uint8_t e4m3fnuz_encode(float f) { return e4m3_encode<true>(f); }

// ------------------------------------------------------------------ e4m3 decode
// Arithmetic decode, integer-only and branch-free so loops over it vectorize (a float
// product under a condition would block if-conversion: gcc does not speculate trapping math).
// Subnormal m * 2^-9 (OCP) / m * 2^-10 (FNUZ), m = 1..7, normalized by hand: leading bit
// p = (m >= 2) + (m >= 4).  NaN bytes give a quiet NaN.
static inline uint32_t e4m3_sub_bits_(uint32_t m, uint32_t exp_base) {
    const uint32_t p = (uint32_t)(m >= 2u) + (uint32_t)(m >= 4u);
    const uint32_t r = ((exp_base + p) << 23) | ((m << (23u - p)) & 0x7FFFFFu);
    return m == 0u ? 0u : r;
}

// e4m3 byte -> exact fp32.  OCP: NaN = 0x7F / 0xFF (a quiet NaN of that sign); FNUZ: NaN = 0x80
// (its only NaN, no -0).
template <bool FNUZ>
static inline float e4m3_decode(uint8_t byte) {
    constexpr uint32_t BIAS = FNUZ ? 8u : 7u;
    const uint32_t v = byte;
    const uint32_t em = v & 0x7Fu;
    const uint32_t nrm = (em + ((127u - BIAS) << 3)) << 20;
    // subnormal step 2^-(bias+2) = 2^((125 - bias) - 127)
    const uint32_t sign = (v & 0x80u) << 24;
    const uint32_t r = (em < 8u ? e4m3_sub_bits_(em, 125u - BIAS) : nrm) | sign;
    if (FNUZ) return from_bits(v == 0x80u ? 0x7FC00000u : r);
    return from_bits(em == 0x7Fu ? 0x7FC00000u | sign : r);  // OCP NaN keeps its sign
}
static inline float e4m3fn_decode(uint8_t byte) { return e4m3_decode<false>(byte); }
static inline float e4m3fnuz_decode(uint8_t byte) { return e4m3_decode<true>(byte); }

// torch.searchsorted(bd[0:n], v, right=True) on an int32 / int64 array (the same bisection
// as ATen's cus_upper_bound, so unsorted input behaves identically).
template <typename I>
static inline int64_t upper_bound(const I* bd, int64_t n, I v) {
    int64_t start = 0, end = n;
    while (start < end) {
        const int64_t mid = start + ((end - start) >> 1);
        if (!(bd[mid] > v))
            start = mid + 1;
        else
            end = mid;
    }
    return start;
}

struct E4m3Tables {
    float ocp[256];
    float fnuz[256];
};

static inline const E4m3Tables& e4m3_tables() {
    static const E4m3Tables t = [] {
        E4m3Tables x;
        for (int i = 0; i < 256; ++i) {
            x.ocp[i] = e4m3fn_decode((uint8_t)i);
            x.fnuz[i] = e4m3fnuz_decode((uint8_t)i);
        }
        return x;
    }();
    return t;
}

// ------------------------------------------------------------------ e2m1
static const float E2M1_MAG[8] = {0.0f, 0.5f, 1.0f, 1.5f, 2.0f, 3.0f, 4.0f, 6.0f};

// Ties to the even code: "<=" thresholds where the lower code is even, "<" where it is odd.
static inline uint8_t e2m1_encode(float f) {
    float a = std::fabs(f);
    uint32_t c = (uint32_t)(a > 0.25f) + (uint32_t)(a >= 0.75f) + (uint32_t)(a > 1.25f) +
                 (uint32_t)(a >= 1.75f) + (uint32_t)(a > 2.5f) + (uint32_t)(a >= 3.5f) +
                 (uint32_t)(a > 5.0f);
    return (uint8_t)(c | ((bits(f) >> 28) & 8u));
}

struct E2m1Tables {
    float signed_zero[16];
    float plus_zero[16];
};

static inline const E2m1Tables& e2m1_tables() {
    static const E2m1Tables t = [] {
        E2m1Tables x;
        for (int i = 0; i < 16; ++i) {
            float m = E2M1_MAG[i & 7];
            x.signed_zero[i] = (i & 8) ? -m : m;
            x.plus_zero[i] = (i & 8) ? 0.0f - m : m;
        }
        return x;
    }();
    return t;
}

// ------------------------------------------------------------------ ceil(fl32(log2 r))
static inline float ceil_log2_slow(float r) {
    return std::ceil((float)std::log2((double)r));
}

// thr[E] (E = biased fp32 exponent 1..254): the largest mantissa j for which
// ceil(fl32(log2(2^(E-127) * (1 + j 2^-23)))) is still E-127 (j = 0 always is).
// The result is monotone in j, so one threshold per exponent describes it exactly.
struct CeilLog2Table {
    uint32_t thr[256];
};

static inline const CeilLog2Table& ceil_log2_table() {
    static const CeilLog2Table t = [] {
        CeilLog2Table x;
        for (int E = 0; E < 256; ++E) {
            x.thr[E] = 0;
            if (E == 0 || E == 255) continue;
            const float k = (float)(E - 127);
            uint32_t lo = 0, hi = 0x7FFFFFu;  // invariant: lo gives k
            if (ceil_log2_slow(from_bits(((uint32_t)E << 23) | hi)) == k) {
                lo = hi;
            } else {
                while (hi - lo > 1) {  // hi gives k+1
                    uint32_t mid = lo + (hi - lo) / 2;
                    if (ceil_log2_slow(from_bits(((uint32_t)E << 23) | mid)) == k)
                        lo = mid;
                    else
                        hi = mid;
                }
            }
            x.thr[E] = lo;
        }
        return x;
    }();
    return t;
}

// Fast exact path for normal positive r; anything else (0, subnormal, inf, NaN, negative)
// goes through libm.  thr = ceil_log2_table().thr (fetch it once outside hot loops).
static inline float ceil_log2(float r, const uint32_t* thr) {
    uint32_t b = bits(r);
    uint32_t E = b >> 23;  // includes the sign bit: negatives land in the slow path
    if (E - 1u < 254u) {
        uint32_t j = b & 0x7FFFFFu;
        return (float)((int)E - 127 + (j > thr[E] ? 1 : 0));
    }
    return ceil_log2_slow(r);
}

static inline float ceil_log2(float r) { return ceil_log2(r, ceil_log2_table().thr); }

// ------------------------------------------------------------------ powers of two
// 2^e for integer-valued float e, like ex2.approx.ftz: e <= -127 -> 0, e >= 128 -> inf.
static inline float exp2i(float e) {
    if (e != e) return e;
    if (e <= -127.0f) return 0.0f;
    if (e >= 128.0f) return std::numeric_limits<float>::infinity();
    return from_bits((uint32_t)((int)e + 127) << 23);
}

// 2^(code-127): code 0 -> 0 (flush), 255 -> +inf.
static inline float ue8m0_decode(uint8_t code) {
    uint32_t c = code;
    return from_bits(c == 255u ? 0x7F800000u : (c << 23));
}

// ------------------------------------------------------------------ clamps
// sign(x) * min(|x|, m); NaN -> ±m with the NaN's sign bit (PTX min.xorsign.abs).
static inline float clamp_sym(float x, float m) {
    uint32_t b = bits(x);
    uint32_t a = b & 0x7FFFFFFFu;
    uint32_t mb = bits(m);
    uint32_t mag = a < mb ? a : mb;  // NaN (a > inf bits) -> m
    return from_bits(mag | (b & 0x80000000u));
}

// min(max(x, -m), m) with NaN -> +m: what the quantizers store for every computed NaN
// (the GPU's NaN is positive, finding 3).
static inline float clamp_nan_pos(float x, float m) {
    float y = x > m ? m : x;
    y = y < -m ? -m : y;
    return x != x ? m : y;
}

// ------------------------------------------------------------------ reductions
// max |x_i|, NaN ignored.  Non-negative non-NaN floats order like their bit patterns; NaN
// patterns are masked to 0 (branch-free, so gcc vectorizes the unsigned max reduction).
static inline float absmax_ignore_nan(const float* __restrict x, int n) {
    uint32_t am = 0;
    for (int i = 0; i < n; ++i) {
        uint32_t a = bits(x[i]) & 0x7FFFFFFFu;
        a &= 0u - (uint32_t)(a <= 0x7F800000u);
        am = am > a ? am : a;
    }
    return from_bits(am);
}

// ------------------------------------------------------------------ AVX-512, 16 lanes
#if DSV41_CPU_AVX512
static inline __m512i v16_u32(uint32_t v) { return _mm512_set1_epi32((int)v); }

static inline __m512 v16_bf16_load(const uint16_t* p) {
    const __m256i h = _mm256_loadu_si256((const __m256i*)p);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

static inline __m256i v16_bf16_nan_(__m512 x, uint32_t nan_bits) {
    const __m512i b = _mm512_castps_si512(x);
    const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(b, 16), v16_u32(1));
    __m512i r = _mm512_srli_epi32(_mm512_add_epi32(_mm512_add_epi32(b, v16_u32(0x7FFF)), odd), 16);
    const __mmask16 nan = _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q);
    r = _mm512_mask_mov_epi32(r, nan, v16_u32(nan_bits));
    return _mm512_cvtepi32_epi16(r);
}
static inline __m256i v16_bf16_canon(__m512 x) { return v16_bf16_nan_(x, 0x7FFFu); }
static inline __m256i v16_bf16_torch(__m512 x) { return v16_bf16_nan_(x, 0xFFFFu); }

// fp32 -> bf16 (RNE) -> fp32 without leaving the 32-bit lanes; NaN -> nan_bits << 16.
static inline __m512 v16_bf16_round(__m512 x, uint32_t nan_bits) {
    const __m512i b = _mm512_castps_si512(x);
    const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(b, 16), v16_u32(1));
    __m512i r = _mm512_and_si512(_mm512_add_epi32(_mm512_add_epi32(b, v16_u32(0x7FFF)), odd),
                                 v16_u32(0xFFFF0000u));
    r = _mm512_mask_mov_epi32(r, _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q), v16_u32(nan_bits << 16));
    return _mm512_castsi512_ps(r);
}

// NaN rules of v16_e4m3_encode*: nan_code <= 0xFF: NaN -> that byte; V16_NAN_SIGNED_SAT:
// NaN saturates like any large value, keeping its sign (e4m3(clamp_sym(x, sat))); V16_NAN_POS_SAT:
// NaN -> +sat (the quantizers' rule, finding 3: e4m3(NaN ? +sat : clamp_sym(x, sat))).
static const uint32_t V16_NAN_SIGNED_SAT = 0x100u;
static const uint32_t V16_NAN_POS_SAT = 0x200u;

// 16 encoded bytes, one per dword lane (see v16_e4m3_encode).
template <bool FNUZ>
static inline __m512i v16_e4m3_encode_dw(__m512 x, uint32_t sat_bits, uint32_t nan_code) {
    if (nan_code == V16_NAN_POS_SAT)  // QNaN/SNaN -> +FLT_MAX (then saturated), others kept
        x = _mm512_fixupimm_ps(x, x, _mm512_set1_epi32(0x111111EE), 0);
    const __m512i b = _mm512_castps_si512(x);
    __m512i a = _mm512_and_si512(b, v16_u32(0x7FFFFFFFu));
    const __mmask16 nan = _mm512_cmpgt_epu32_mask(a, v16_u32(0x7F800000u));
    a = _mm512_min_epu32(a, v16_u32(sat_bits));
    const uint32_t nrm_bias = 0x7FFFFu - ((FNUZ ? 119u : 120u) << 23);
    const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(a, 20), v16_u32(1));
    const __m512i nrm = _mm512_srli_epi32(_mm512_add_epi32(_mm512_add_epi32(a, v16_u32(nrm_bias)), odd), 20);
    const __m512 magic = _mm512_set1_ps(FNUZ ? 8192.0f : 16384.0f);
    const __m512i sub = _mm512_sub_epi32(
        _mm512_castps_si512(_mm512_add_ps(_mm512_castsi512_ps(a), magic)),
        v16_u32((FNUZ ? 140u : 141u) << 23));
    const __mmask16 is_sub = _mm512_cmplt_epu32_mask(a, v16_u32((FNUZ ? 120u : 121u) << 23));
    __m512i r = _mm512_mask_mov_epi32(nrm, is_sub, sub);
    __m512i sign = _mm512_srli_epi32(b, 24);
    if (FNUZ) sign = _mm512_maskz_mov_epi32(_mm512_test_epi32_mask(r, r), sign);
    r = _mm512_ternarylogic_epi32(r, sign, v16_u32(0x80u), 0xF8);  // r | (sign & 0x80)
    if (nan_code <= 0xFFu) r = _mm512_mask_mov_epi32(r, nan, v16_u32(nan_code));
    return r;
}

template <bool FNUZ>
static inline __m128i v16_e4m3_encode(__m512 x, uint32_t sat_bits, uint32_t nan_code) {
    return _mm512_cvtepi32_epi8(v16_e4m3_encode_dw<FNUZ>(x, sat_bits, nan_code));
}

// Four vectors of byte-valued dwords -> 64 bytes in order (d0's 16, d1's 16, ...).
static inline __m512i v16_pack4_u8(__m512i d0, __m512i d1, __m512i d2, __m512i d3) {
    const __m512i p = _mm512_packus_epi16(_mm512_packus_epi32(d0, d1), _mm512_packus_epi32(d2, d3));
    const __m512i idx = _mm512_set_epi32(15, 11, 7, 3, 14, 10, 6, 2, 13, 9, 5, 1, 12, 8, 4, 0);
    return _mm512_permutexvar_epi32(idx, p);
}

template <bool FNUZ>
static inline __m512 v16_e4m3_decode(__m128i bytes) {
    const __m512i v = _mm512_cvtepu8_epi32(bytes);
    const __m512i em = _mm512_and_si512(v, v16_u32(0x7Fu));
    const __m512i nrm = _mm512_slli_epi32(_mm512_add_epi32(em, v16_u32((FNUZ ? 119u : 120u) << 3)), 20);
    const __m512 subf = _mm512_mul_ps(_mm512_cvtepi32_ps(em), _mm512_set1_ps(FNUZ ? 0x1p-10f : 0x1p-9f));
    __m512i r = _mm512_mask_mov_epi32(nrm, _mm512_cmplt_epu32_mask(em, v16_u32(8)), _mm512_castps_si512(subf));
    r = _mm512_or_si512(r, _mm512_slli_epi32(_mm512_and_si512(v, v16_u32(0x80u)), 24));
    const __mmask16 nan = FNUZ ? _mm512_cmpeq_epi32_mask(v, v16_u32(0x80u))
                               : _mm512_cmpeq_epi32_mask(em, v16_u32(0x7Fu));
    r = _mm512_mask_mov_epi32(r, nan, v16_u32(0x7FC00000u));
    return _mm512_castsi512_ps(r);
}

// e2m1 like e4m3 with 2 exponent / 1 mantissa bits: |x| >= 1 rounds its fp32 bits at bit 22
// (RNE, carries into the exponent), |x| < 1 is rounded to the 0.5 grid by adding 2^22;
// saturate at 6, NaN -> magnitude 0, sign bit kept.
static inline __m512i v16_e2m1_encode(__m512 x) {
    const __m512i b = _mm512_castps_si512(x);
    __m512i a = _mm512_and_si512(b, v16_u32(0x7FFFFFFFu));
    const __mmask16 nan = _mm512_cmpgt_epu32_mask(a, v16_u32(0x7F800000u));
    a = _mm512_min_epu32(a, v16_u32(0x40C00000u));  // 6.0
    const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(a, 22), v16_u32(1));
    const __m512i nrm = _mm512_srli_epi32(
        _mm512_add_epi32(_mm512_add_epi32(a, v16_u32(0x1FFFFFu - (126u << 23))), odd), 22);
    const __m512i sub = _mm512_sub_epi32(
        _mm512_castps_si512(_mm512_add_ps(_mm512_castsi512_ps(a), _mm512_set1_ps(4194304.0f))),
        v16_u32(0x4A800000u));
    __m512i r = _mm512_mask_mov_epi32(nrm, _mm512_cmplt_epu32_mask(a, v16_u32(0x3F800000u)), sub);
    r = _mm512_maskz_mov_epi32((__mmask16)~nan, r);
    return _mm512_ternarylogic_epi32(r, _mm512_srli_epi32(b, 28), v16_u32(8u), 0xF8);  // r | (s & 8)
}

static inline __m512i v16_abs_bits_nonan(__m512 x) {
    const __m512i a = _mm512_and_si512(_mm512_castps_si512(x), v16_u32(0x7FFFFFFFu));
    return _mm512_maskz_mov_epi32(_mm512_cmple_epu32_mask(a, v16_u32(0x7F800000u)), a);
}

// Transposed horizontal max: lane g of the result = max over the 16 unsigned dwords of v[g]
// (4 shuffle levels, 45 instructions for 16 reductions).
static inline __m512i v16_hmax16x16_epu32(const __m512i* v) {
    __m512i t[8], u[4], w[2];
    for (int i = 0; i < 8; ++i)
        t[i] = _mm512_max_epu32(_mm512_unpacklo_epi32(v[2 * i], v[2 * i + 1]),
                                _mm512_unpackhi_epi32(v[2 * i], v[2 * i + 1]));
    for (int i = 0; i < 4; ++i)
        u[i] = _mm512_max_epu32(_mm512_unpacklo_epi64(t[2 * i], t[2 * i + 1]),
                                _mm512_unpackhi_epi64(t[2 * i], t[2 * i + 1]));
    for (int i = 0; i < 2; ++i)
        w[i] = _mm512_max_epu32(_mm512_shuffle_i32x4(u[2 * i], u[2 * i + 1], 0x88),
                                _mm512_shuffle_i32x4(u[2 * i], u[2 * i + 1], 0xDD));
    return _mm512_max_epu32(_mm512_shuffle_i32x4(w[0], w[1], 0x88), _mm512_shuffle_i32x4(w[0], w[1], 0xDD));
}

// ceil(fl32(log2 r)) for positive r whose biased exponent E is 1..254 (normal), as int32:
// E - 127 + (mantissa > thr[E]).  Lanes with E == 255 (inf) come out as 128 + (..): callers
// that can meet inf must select on E themselves.
static inline __m512i v16_ceil_log2_pos(__m512 r, const uint32_t* thr) {
    const __m512i b = _mm512_castps_si512(r);
    const __m512i E = _mm512_srli_epi32(b, 23);
    const __m512i j = _mm512_and_si512(b, v16_u32(0x7FFFFFu));
    const __m512i t = _mm512_i32gather_epi32(E, (const void*)thr, 4);
    const __m512i e = _mm512_sub_epi32(E, v16_u32(127));
    return _mm512_mask_add_epi32(e, _mm512_cmpgt_epu32_mask(j, t), e, v16_u32(1));
}
#endif  // DSV41_CPU_AVX512

// Element i (element stride ``stride``) of an int32 or int64 index vector, widened to int64.
inline int64_t load_index(const void* p, int64_t i, int64_t stride, bool is64) {
    return is64 ? static_cast<const int64_t*>(p)[i * stride]
                : static_cast<int64_t>(static_cast<const int32_t*>(p)[i * stride]);
}

// The NVIDIA GPU's approximate primitives (dsv41/core/gpu_approx.py), from its tables of int32
// result bits (gpu_approx.result_bits, handed over by the Python wrapper per call).
struct Approx {
    const int32_t* rsqrt;   // [2^24]: x in [1, 4), index (exponent parity) << 23 | mantissa
    const int32_t* rcp;     // [2^23]: x in [1, 2), index mantissa
    const int32_t* ex2;     // [2^23]: 2^(j / 2^23)
    const int32_t* ex2neg;  // [2^23]: 2^(-j / 2^23)
};

// rsqrt.approx.ftz.f32 (tl.rsqrt on NVIDIA)
static inline float rsqrt_approx(float x, const int32_t* tab) {
    const uint32_t b = bits(x);
    const int ef = (int)((b >> 23) & 0xFFu);
    if (ef == 0) return from_bits((b & 0x80000000u) | 0x7F800000u);  // +-0, subnormal: +-inf
    if (b >> 31) return from_bits(0x7FFFFFFFu);                       // negative, NaN
    if (ef == 255) return from_bits((b & 0x7FFFFFu) ? 0x7FFFFFFFu : 0u);
    const int e = ef - 127;
    const int par = e & 1, half = (e - par) / 2;  // floor(e / 2)
    return from_bits((uint32_t)(tab[((uint32_t)par << 23) | (b & 0x7FFFFFu)] - half * (1 << 23)));
}

// rcp.approx.ftz.f32; div.full.f32(a, b) == a * rcp_approx(b)
static inline float rcp_approx(float x, const int32_t* tab) {
    const uint32_t b = bits(x), sign = b & 0x80000000u;
    const int ef = (int)((b >> 23) & 0xFFu);
    if (ef == 0) return from_bits(sign | 0x7F800000u);
    if (ef == 255) return from_bits((b & 0x7FFFFFu) ? 0x7FFFFFFFu : sign);
    const int32_t mag = tab[b & 0x7FFFFFu] - (ef - 127) * (1 << 23);
    return from_bits(sign | (mag < 0x800000 ? 0u : (uint32_t)mag));  // subnormal: flushed
}
// (both operands scaled by 2^24 for a subnormal b, by 1/4 for |b| >= 2^126, as div.full does)
static inline float div_full(float a, float b, const int32_t* rcp_tab) {
    const float m = std::fabs(b);
    const float s = m >= 0x1p126f ? 0.25f : (m < 0x1p-126f ? 0x1p24f : 1.0f);
    return (a * s) * rcp_approx(b * s, rcp_tab);
}

// ex2.approx.ftz.f32: |x| as fixed point with 23 fraction bits (truncated), one table per sign
static inline float ex2_approx_ftz(float x, const Approx& t) {
    if (x != x) return from_bits(0x7FFFFFFFu);
    const bool neg = bits(x) >> 31;
    const float mag = std::fmin(std::fabs(x), 1073741824.0f);  // 2^30
    const int64_t q = (int64_t)(mag * 8388608.0f);               // exact, then truncated
    const int64_t m = q >> 23;
    const int32_t f = (int32_t)(q & 0x7FFFFF);
    if (neg) {
        const int64_t o = (int64_t)t.ex2neg[f] - m * (1 << 23);
        return from_bits(o < 0x800000 ? 0u : (uint32_t)o);
    }
    const int64_t o = (int64_t)t.ex2[f] + m * (1 << 23);
    return from_bits(o >= 0x7F800000 ? 0x7F800000u : (uint32_t)o);
}

// tl.exp on NVIDIA: ex2.approx.f32(fl32(z * fl32(log2 e))), no ftz: below -126 the square of
// the half-argument's result
static inline float exp_approx(float z, const Approx& t) {
    const float arg = z * 1.44269502162933349609375f;  // fl32(log2 e) = 0x3FB8AA3B
    if (arg < -126.0f) {
        const float h = ex2_approx_ftz(arg * 0.5f, t);
        return h * h;
    }
    return ex2_approx_ftz(arg, t);
}

struct CompactTables;

#if DSV41_CPU_AVX512
// The ex2neg and rcp tables in a form that fits the caches (the full ones, 32 MB each, are read
// at random places by the pooling): each entry as a 4-bit difference from a base computed here
// in float64 -- ex2neg[f] from 2^-(f / 2^23) = H[f >> 12] * L[f & 4095], rcp[m] from
// 1 / (1 + m / 2^23) -- rounded to fp32 (8 MB in all).  Built from the full tables on first
// use (compact_tables); where a difference does not fit 4 bits the full tables serve.
struct CompactTables {
    std::vector<double> h, l;         // 2^-(i * 4096 / 2^23), 2^-(k / 2^23)
    std::vector<uint32_t> ex2d, rcpd;  // 8 differences per word, entry i at bits 4 (i & 7)
};

inline float ex2neg_base(const CompactTables& c, uint32_t f) { return (float)(c.h[f >> 12] * c.l[f & 4095]); }
inline float rcp_base(uint32_t m) { return (float)(1.0 / (double)from_bits(0x3F800000u | m)); }

inline bool pack_differences(const int32_t* tab, std::vector<uint32_t>& words, float (*base)(const CompactTables&, uint32_t),
                             const CompactTables& c) {
    words.assign((1u << 23) / 8, 0u);
    for (uint32_t i = 0; i < (1u << 23); ++i) {
        const int64_t d = (int64_t)tab[i] - (int64_t)bits(base(c, i));
        if (d < -8 || d > 7) return false;
        words[i >> 3] |= ((uint32_t)d & 15u) << (4 * (i & 7));
    }
    return true;
}

// 16 entries of a compact table: base bits + the packed 4-bit difference
inline __m512i compact_entry(__m512i base_bits, __m512i i, const uint32_t* words) {
    const __m512i w = _mm512_i32gather_epi32(_mm512_srli_epi32(i, 3), (const int*)words, 4);
    const __m512i nib = _mm512_and_si512(_mm512_srlv_epi32(w, _mm512_slli_epi32(_mm512_and_si512(i, _mm512_set1_epi32(7)), 2)),
                                         _mm512_set1_epi32(15));
    return _mm512_add_epi32(base_bits, _mm512_sub_epi32(_mm512_xor_si512(nib, _mm512_set1_epi32(8)), _mm512_set1_epi32(8)));
}

// two __m512d (lanes 0-7, 8-15) rounded to fp32 into one __m512
inline __m512 to_f32x16(__m512d lo, __m512d hi) {
    return _mm512_insertf32x8(_mm512_castps256_ps512(_mm512_cvtpd_ps(lo)), _mm512_cvtpd_ps(hi), 1);
}

inline __m512i ex2neg_entries(__m512i f, const Approx& ap, const CompactTables* c) {
    if (!c) return _mm512_i32gather_epi32(f, ap.ex2neg, 4);
    const __m512i hi = _mm512_srli_epi32(f, 12), lo = _mm512_and_si512(f, _mm512_set1_epi32(4095));
    const __m512d p0 = _mm512_mul_pd(_mm512_i32gather_pd(_mm512_castsi512_si256(hi), c->h.data(), 8),
                                     _mm512_i32gather_pd(_mm512_castsi512_si256(lo), c->l.data(), 8));
    const __m512d p1 = _mm512_mul_pd(_mm512_i32gather_pd(_mm512_extracti64x4_epi64(hi, 1), c->h.data(), 8),
                                     _mm512_i32gather_pd(_mm512_extracti64x4_epi64(lo, 1), c->l.data(), 8));
    return compact_entry(_mm512_castps_si512(to_f32x16(p0, p1)), f, c->ex2d.data());
}

inline __m512i rcp_entries(__m512i m, const Approx& ap, const CompactTables* c) {
    if (!c) return _mm512_i32gather_epi32(m, ap.rcp, 4);
    const __m512 x = _mm512_castsi512_ps(_mm512_or_si512(m, _mm512_set1_epi32(0x3F800000)));
    const __m512d one = _mm512_set1_pd(1.0);
    const __m512d r0 = _mm512_div_pd(one, _mm512_cvtps_pd(_mm512_castps512_ps256(x)));
    const __m512d r1 = _mm512_div_pd(one, _mm512_cvtps_pd(_mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(x), 1))));
    return compact_entry(_mm512_castps_si512(to_f32x16(r0, r1)), m, c->rcpd.data());
}

// nullptr: none.  Built once per pair of tables (they live as long as the process), then read
// back through the vector code over every entry: any entry that does not come back equal to
// the full table's leaves the full tables in use.
inline const CompactTables* compact_tables(const Approx& ap) {
    static std::mutex mu;
    static const int32_t *key_ex2neg = nullptr, *key_rcp = nullptr;
    static std::unique_ptr<CompactTables> built;
    std::lock_guard<std::mutex> lock(mu);
    if (key_ex2neg != ap.ex2neg || key_rcp != ap.rcp) {
        auto c = std::make_unique<CompactTables>();
        c->h.resize(2048);
        c->l.resize(4096);
        for (int i = 0; i < 2048; ++i) c->h[i] = std::exp2(-(double)(i * 4096) / 8388608.0);
        for (int k = 0; k < 4096; ++k) c->l[k] = std::exp2(-(double)k / 8388608.0);
        bool ok = pack_differences(ap.ex2neg, c->ex2d, ex2neg_base, *c) &&
                  pack_differences(ap.rcp, c->rcpd, [](const CompactTables&, uint32_t m) { return rcp_base(m); }, *c);
        const __m512i iota = _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
        for (int32_t i = 0; ok && i < (1 << 23); i += 16) {
            const __m512i idx = _mm512_add_epi32(iota, _mm512_set1_epi32(i));
            ok = _mm512_cmpneq_epi32_mask(ex2neg_entries(idx, ap, c.get()), _mm512_loadu_si512(ap.ex2neg + i)) == 0 &&
                 _mm512_cmpneq_epi32_mask(rcp_entries(idx, ap, c.get()), _mm512_loadu_si512(ap.rcp + i)) == 0;
        }
        built = ok ? std::move(c) : nullptr;
        key_ex2neg = ap.ex2neg;
        key_rcp = ap.rcp;
    }
    return built.get();
}
#endif  // DSV41_CPU_AVX512

// Thread t's chain over its registers, for every thread at once (threads contiguous in `lane`,
// so the loops over t vectorize; P, the elements per thread, a constant for the strides).
// Threads [0, active) of `threads`; the caller sets the others.
template <int P>
static inline void tl_lane_sums(const float* xp, int threads, int active, int regs, float* lane) {
    const int64_t pass = (int64_t)threads * P;
    if (regs == 1) {
        for (int t = 0; t < active; ++t) lane[t] = xp[(int64_t)t * P] * xp[(int64_t)t * P];
        return;
    }
    const float* e0 = xp;                                 // register 0: (pass 0, element 0)
    const float* e1 = xp + (P > 1 ? 1 : pass);            // register 1: element 1, or pass 1
    for (int t = 0; t < active; ++t)
        lane[t] = std::fmaf(e0[(int64_t)t * P], e0[(int64_t)t * P], e1[(int64_t)t * P] * e1[(int64_t)t * P]);
    for (int k = 2; k < regs; ++k) {
        const float* ek = xp + (int64_t)(k / P) * pass + k % P;
        for (int t = 0; t < active; ++t) lane[t] = std::fmaf(ek[(int64_t)t * P], ek[(int64_t)t * P], lane[t]);
    }
}

// tl.sum(v * v, 0) of one fp32 row x[0..n) as Triton reduces it on an NVIDIA GPU for a blocked
// layout of `per` contiguous elements per thread, `warps` warps over `block` elements (zeros
// past n) -- dsv41.core.gpu_approx.tl_sum_sq: thread t's registers in order (repetition,
// element), fma(e0, e0, e1*e1) then fmaf(ek, ek, acc); the xor butterfly in each warp; the
// warp sums folded the same way.
static inline float tl_sum_sq(const float* x, int64_t n, int block, int warps, int per) {
    const int threads = 32 * warps, reps = block / (threads * per), regs = reps * per;
    alignas(64) float lane[1024];  // threads <= 1024
    // a row narrower than the block reads zeros past its end.  One pass whose row ends at a
    // thread's boundary: the threads past the row hold zeros only and sum to +0 (a square is
    // never -0), so only the others are summed.  Otherwise from a padded copy, so that the
    // loops below have no bounds test.
    thread_local std::vector<float> padded;
    const float* xp = x;
    int active = threads;
    if (n < block && reps == 1 && n % per == 0) {
        active = (int)(std::max<int64_t>(n, 0) / per);
        std::fill(lane + active, lane + threads, 0.0f);
    } else if (n < block) {
        padded.assign((size_t)block, 0.0f);
        std::memcpy(padded.data(), x, (size_t)std::max<int64_t>(n, 0) * sizeof(float));
        xp = padded.data();
    }
    switch (per) {
        case 1: tl_lane_sums<1>(xp, threads, active, regs, lane); break;
        case 2: tl_lane_sums<2>(xp, threads, active, regs, lane); break;
        case 4: tl_lane_sums<4>(xp, threads, active, regs, lane); break;
        case 8: tl_lane_sums<8>(xp, threads, active, regs, lane); break;
        case 16: tl_lane_sums<16>(xp, threads, active, regs, lane); break;
        default:
            for (int t = 0; t < active; ++t) {
                float acc = 0.0f, first = 0.0f;
                for (int k = 0; k < regs; ++k) {
                    const float e = xp[(int64_t)(k / per) * threads * per + (int64_t)t * per + k % per];
                    if (k == 0)
                        first = e;
                    else if (k == 1)
                        acc = std::fmaf(first, first, e * e);
                    else
                        acc = std::fmaf(e, e, acc);
                }
                lane[t] = regs == 1 ? first * first : acc;
            }
    }
    for (int g = 0; g < warps; ++g) {
        float* L = lane + 32 * g;
        for (int dist = 16; dist >= 1; dist >>= 1)
            for (int l = 0; l < dist; ++l) L[l] = L[l] + L[l + dist];
    }
    for (int dist = warps / 2; dist >= 1; dist >>= 1)
        for (int g = 0; g < dist; ++g) lane[32 * g] = lane[32 * g] + lane[32 * (g + dist)];
    return lane[0];
}

}  // namespace dsv41cpu
