// dsv41 CPU kernels: shared inline numerics (header-only, no torch, C++17).
//
// Every function here is bit-exact with dsv41/codecs.py (the reference) and branch-free
// where it sits in hot loops, so gcc can vectorize loops that call it.  Build flags come
// from _build.py (-O3 -march=native -ffp-contract=off): nothing is contracted unless an
// explicit fmaf() is written.
//
// What it offers (namespace dsv41cpu):
//   bits / from_bits              float <-> uint32 bit casts
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
//   F32_1E_4, INV_448, INV_224, INV_6   fl32 constants of the quantizers
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>

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
// OCP e4m3fn (bias 7).  Normal range starts at 2^-6 (biased fp32 exponent 121); subnormals are
// rounded by adding 2^14, whose ulp is 2^-9 (the e4m3 subnormal step): the FPU does the RNE.
static inline uint8_t e4m3fn_encode(float f) {
    uint32_t b = bits(f);
    uint32_t sign = (b >> 24) & 0x80u;
    uint32_t a = b & 0x7FFFFFFFu;
    bool nan = a > 0x7F800000u;
    a = a < 0x43E00000u ? a : 0x43E00000u;  // satfinite to 448 (inf too)
    uint32_t odd = (a >> 20) & 1u;
    uint32_t nrm = (a - (120u << 23) + 0x7FFFFu + odd) >> 20;
    uint32_t sub = bits(from_bits(a) + 16384.0f) - (141u << 23);
    uint32_t r = (a < (121u << 23) ? sub : nrm) | sign;
    return (uint8_t)(nan ? 0x7Fu : r);
}

// FNUZ e4m3 (bias 8, 0x80 = NaN, no -0).  Normal range starts at 2^-7 (exponent 120);
// subnormal step 2^-10 (add 2^13).
static inline uint8_t e4m3fnuz_encode(float f) {
    uint32_t b = bits(f);
    uint32_t sign = (b >> 24) & 0x80u;
    uint32_t a = b & 0x7FFFFFFFu;
    bool nan = a > 0x7F800000u;
    a = a < 0x43700000u ? a : 0x43700000u;  // satfinite to 240 (inf too)
    uint32_t odd = (a >> 20) & 1u;
    uint32_t nrm = (a - (119u << 23) + 0x7FFFFu + odd) >> 20;
    uint32_t sub = bits(from_bits(a) + 8192.0f) - (140u << 23);
    uint32_t m = (a < (120u << 23) ? sub : nrm);
    uint32_t r = m | (m != 0 ? sign : 0u);
    return (uint8_t)(nan ? 0x80u : r);
}

template <bool FNUZ>
static inline uint8_t e4m3_encode(float f) {
    return FNUZ ? e4m3fnuz_encode(f) : e4m3fn_encode(f);
}

// ------------------------------------------------------------------ e4m3 decode
// Arithmetic decode (vectorizes, exact).  Subnormals: m * 2^-9 (OCP) / m * 2^-10 (FNUZ).
static inline float e4m3fn_decode(uint8_t byte) {
    uint32_t v = byte;
    uint32_t sign = (v & 0x80u) << 24;
    uint32_t em = v & 0x7Fu;
    uint32_t e = em >> 3;
    float nrm = from_bits(sign | ((em + (120u << 3)) << 20));
    float sub = from_bits(sign | bits((float)(int)(em & 7u) * (1.0f / 512.0f)));
    float r = e == 0 ? sub : nrm;
    return em == 0x7Fu ? std::numeric_limits<float>::quiet_NaN() : r;
}

static inline float e4m3fnuz_decode(uint8_t byte) {
    uint32_t v = byte;
    uint32_t sign = (v & 0x80u) << 24;
    uint32_t em = v & 0x7Fu;
    uint32_t e = em >> 3;
    float nrm = from_bits(sign | ((em + (119u << 3)) << 20));
    float sub = from_bits(sign | bits((float)(int)(em & 7u) * (1.0f / 1024.0f)));
    float r = e == 0 ? sub : nrm;
    return v == 0x80u ? std::numeric_limits<float>::quiet_NaN() : r;
}

template <bool FNUZ>
static inline float e4m3_decode(uint8_t b) {
    return FNUZ ? e4m3fnuz_decode(b) : e4m3fn_decode(b);
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

}  // namespace dsv41cpu
