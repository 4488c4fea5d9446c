// dsv41 CPU kernels for the paged K caches (spec cache_ops.md §1-§4, §8.2; rope_quant_ops.md §3).
//
//   dsv41_quantize_insert_k      quantize_and_insert_k_cache   (584 / 528, OCP / FNUZ)
//   dsv41_dequant_gather_k       dequantize_and_gather_k_cache (584 / 528 / 288, OCP / FNUZ)
//   dsv41_rope_quant_insert      rope_quant_insert             (584 / 528 / 288 / bf16 rows / fp8 rows)
//   dsv41_indexer_k_store        indexer_k_norm_rope_store     (FP8 / MXFP4, row-major / tiled)
//   dsv41_codec_*                element-wise entry points of common.h, for the tests
//   dsv41_cache_kernels_simd     1 when the AVX-512 token paths were compiled in, else 0
//
// Conventions: raw pointers (already offset by the tensor's storage offset), strides in
// elements of the pointed-to type (page strides of uint8 caches in bytes), int64 sizes.
// Every kernel parallelizes over tokens with OpenMP (dynamic chunks of 32 tokens, serial
// below 128 tokens).  The per-token work
// is written twice with identical results: `port` (plain loops, auto-vectorized, any CPU)
// and `simd` (AVX-512 intrinsics, 16 fp32 lanes); `tok` names the one compiled in.
// 528 / 288 records come paged or interleaved (a trailing `interleaved` flag, see RecLayout).
// Negative slots are skipped.  Nothing outside a token's record bytes is touched (page
// padding stays as it was).

#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

#include "record_geometry.h"  // generated from dsv41.core.formats at build time (_build.py)

#include "common.h"

// Full-width AVX-512 vectors for the auto-vectorized loops (gcc's default tuning on AVX-512
// parts is 256-bit).  A tuning option only: results are identical.
#if defined(__AVX512F__) && defined(__GNUC__) && !defined(__clang__)
#pragma GCC target("prefer-vector-width=512")
#endif

using namespace dsv41cpu;

namespace {

using R584 = rec::Record<584>;  // V4: 448 e4m3 NoPE dims in 7 groups + 64 bf16 RoPE dims
using R528 = rec::Record<528>;  // V4.1 MXFP8: 16 groups of 32
using R288 = rec::Record<288>;  // V4.1 NVFP4: 32 groups of 16
using RIDX8 = rec::Record<132>;  // indexer FP8 key
using RIDX4 = rec::Record<68>;   // indexer MXFP4 key
constexpr int HEAD = R528::head_dim;    // latent / K width (512)
constexpr int NOPE = R584::quant_dims;  // dims [0, 448) NoPE, [448, 512) the 32 RoPE pairs
constexpr int IDX_D = RIDX8::head_dim;  // indexer key width (128)
static_assert(R584::head_dim == HEAD && R288::head_dim == HEAD && R584::quant_dims + R584::bf16_dims == HEAD,
              "records of one latent width");
// The NVFP4 token paths (and their AVX-512 forms, one 16-lane vector per group) are written
// for groups of 16 dims, 8 packed bytes; the scale row of 32 codes loads as two vectors.
static_assert(RIDX4::scale_bytes == RIDX8::scale_bytes, "indexer keys: 4 scale bytes per token");
static_assert(R288::group == 16 && R288::n_groups == 32 && R288::value_bytes == R288::n_groups * 8,
              "NVFP4 record geometry");

// =======================================================================================
// port: per-token building blocks in plain C++ (the reference semantics, any CPU)
// =======================================================================================
namespace port {

static inline void bf16_to_f32(const uint16_t* __restrict src, float* __restrict dst, int n) {
    for (int i = 0; i < n; ++i) dst[i] = dsv41cpu::bf16_to_f32(src[i]);
}

static inline void store_bf16_canon(const float* __restrict x, uint16_t* __restrict dst, int n) {
    for (int i = 0; i < n; ++i) dst[i] = f32_to_bf16_rne_canon(x[i]);
}

// UE8M0-scaled FP8 groups (spec cache_ops §2.1, §2.4, §2.5 a, finding 3).
// x: NG*G fp32; q: NG*G e4m3 bytes; codes: NG bytes.  NaN is ignored in the amax and every
// NaN reaching the clamp (inputs, inf*0) is stored as +FP8_MAX.
template <int G, int NG, bool FNUZ>
static inline void quant_ue8m0(const float* __restrict x, uint8_t* __restrict q,
                               uint8_t* __restrict codes, bool sanitize, const uint32_t* thr) {
    const float M = FNUZ ? 224.0f : 448.0f;
    const float C = FNUZ ? INV_224 : INV_448;
    for (int g = 0; g < NG; ++g) {
        const float* xg = x + g * G;
        float amax = absmax_ignore_nan(xg, G);
        amax = amax > F32_1E_4 ? amax : F32_1E_4;
        const float e = ceil_log2(amax * C, thr);
        const float s = exp2i(-e);
        uint8_t* qg = q + g * G;
        for (int i = 0; i < G; ++i) qg[i] = e4m3_encode<FNUZ>(clamp_nan_pos(xg[i] * s, M));
        float c = e + 127.0f;
        c = c < 0.0f ? 0.0f : c;
        const float hi = sanitize ? 254.0f : 255.0f;
        c = c > hi ? hi : c;
        codes[g] = (uint8_t)(int)c;
    }
}

// NVFP4 groups of 16 (spec cache_ops §2.3).  NaN is ignored in the amax and a NaN element
// encodes as +6 (code 0x7), as the reference of rope_quant_insert does.
template <int NG>
static inline void quant_nvfp4(const float* __restrict x, uint8_t* __restrict packed,
                               uint8_t* __restrict scales) {
    for (int g = 0; g < NG; ++g) {
        const float* xg = x + g * 16;
        float sf = absmax_ignore_nan(xg, 16) * INV_6;
        sf = sf < 0x1p-9f ? 0x1p-9f : sf;
        sf = sf > 448.0f ? 448.0f : sf;
        const uint8_t sb = e4m3fn_encode(sf);
        const float S = e4m3fn_decode(sb);
        scales[g] = sb;
        uint8_t codes[16];
        for (int i = 0; i < 16; ++i) {
            const float y = xg[i] / S;
            const uint32_t c = e2m1_encode(y);
            const uint32_t nanm = 0u - (uint32_t)(y != y);
            codes[i] = (uint8_t)((c & ~nanm) | (7u & nanm));
        }
        for (int i = 0; i < 8; ++i)
            packed[g * 8 + i] = (uint8_t)(codes[2 * i] | (codes[2 * i + 1] << 4));
    }
}

// UE8M0 FP8 record decode (spec cache_ops §2.2): bf16(e4m3 * 2^(code-127)), NaN -> 0x7FFF.
template <int G, int NG, bool FNUZ>
static inline void decode_ue8m0(const uint8_t* __restrict v, const uint8_t* __restrict codes,
                                uint16_t* __restrict out) {
    for (int g = 0; g < NG; ++g) {
        const float S = ue8m0_decode(codes[g]);
        const uint8_t* vg = v + g * G;
        uint16_t* og = out + g * G;
        for (int i = 0; i < G; ++i) og[i] = f32_to_bf16_rne_canon(e4m3_decode<FNUZ>(vg[i]) * S);
    }
}

// NVFP4 record decode (spec cache_ops §2.3, finding 1: code 0x8 is +0, the zero takes the
// sign of the scale).  Always OCP scales.
static inline void decode_nvfp4(const uint8_t* __restrict v, const uint8_t* __restrict scales,
                                uint16_t* __restrict out) {
    const float* lut = e2m1_tables().plus_zero;
    for (int g = 0; g < R288::n_groups; ++g) {
        const float S = e4m3fn_decode(scales[g]);
        const uint8_t* vg = v + g * 8;
        uint16_t* og = out + g * 16;
        for (int i = 0; i < 8; ++i) {
            const uint8_t b = vg[i];
            og[2 * i] = f32_to_bf16_rne_canon(lut[b & 15] * S);
            og[2 * i + 1] = f32_to_bf16_rne_canon(lut[b >> 4] * S);
        }
    }
}

// cos/sin row (rope_quant_ops §1.1): fp32 or bf16, cols [0, P) cos, [P, 2P) sin.
static inline void load_cos_sin(const void* cs, int32_t cs_bf16, int64_t s0, int64_t s1,
                                int64_t row, int P, float* __restrict c, float* __restrict s) {
    if (cs_bf16) {
        const uint16_t* r = (const uint16_t*)cs + row * s0;
        for (int i = 0; i < P; ++i) {
            c[i] = dsv41cpu::bf16_to_f32(r[i * s1]);
            s[i] = dsv41cpu::bf16_to_f32(r[(P + i) * s1]);
        }
    } else {
        const float* r = (const float*)cs + row * s0;
        for (int i = 0; i < P; ++i) {
            c[i] = r[i * s1];
            s[i] = r[(P + i) * s1];
        }
    }
}

// GPT-J RoPE, canonical contraction (rope_quant_ops §1.2), P pairs from x[0]:
// e' = fma(e, c, -fl32(o*s)), o' = fma(o, c, fl32(e*s)).
static inline void rope_pairs(const float* __restrict x, float* __restrict y,
                              const float* __restrict c, const float* __restrict s, int P) {
    for (int i = 0; i < P; ++i) {
        const float e = x[2 * i], o = x[2 * i + 1];
        y[2 * i] = std::fma(e, c[i], -(o * s[i]));
        y[2 * i + 1] = std::fma(o, c[i], e * s[i]);
    }
}

// The NoPE "identity" rotation by (cos, sin) = (1, 0) (finding 2): e' = fma(e, 1, -(o*0))
// = e + -(o*0), o' = fma(o, 1, e*0) = o + e*0 (fma(a, 1, b) == a + b exactly).  Flips some
// zero signs and turns a lane with a ±inf/NaN partner into NaN.
static inline void nope_pairs(const float* __restrict x, float* __restrict y, int P) {
    for (int i = 0; i < P; ++i) {
        const float e = x[2 * i], o = x[2 * i + 1];
        y[2 * i] = e + -(o * 0.0f);
        y[2 * i + 1] = o + e * 0.0f;
    }
}

// rot[lo, 448) = NoPE rotation of x (lo = 0 or 448: the 584 record needs no NoPE rotation),
// rot[448, 512) = RoPE with the group's cos/sin row; sanitize: NaN -> 0 (spec §2.5 b).
static inline void rotate_latent(const float* __restrict x, float* __restrict rot,
                                 const void* cs, int32_t cs_bf16, int64_t cs_s0, int64_t cs_s1,
                                 int64_t row, bool with_nope, bool sanitize) {
    alignas(64) float c[32], s[32];
    load_cos_sin(cs, cs_bf16, cs_s0, cs_s1, row, 32, c, s);
    if (with_nope) nope_pairs(x, rot, NOPE / 2);
    rope_pairs(x + NOPE, rot + NOPE, c, s, 32);
    if (sanitize) {
        const int lo = with_nope ? 0 : NOPE;
        for (int d = lo; d < HEAD; ++d) rot[d] = rot[d] != rot[d] ? 0.0f : rot[d];
    }
}

// Plain e4m3fn rows: e4m3(clamp448(fp32(bf16(x')) * inv)), a NaN -> +448 (spec §8.2, F3).
static inline void store_fp8_row(const float* __restrict rot, uint8_t* __restrict dst, float inv) {
    for (int d = 0; d < HEAD; ++d) {
        const float y = dsv41cpu::bf16_to_f32(f32_to_bf16_rne_canon(rot[d])) * inv;
        dst[d] = e4m3fn_encode(clamp_nan_pos(y, 448.0f));
    }
}

// Indexer key (rope_quant_ops §3.3) -> q (FP8: 128 e4m3 bytes; MXFP4: 64 packed bytes) and
// 4 scale bytes (FP8: the fp32 2^E, little-endian; MXFP4: 4 ue8m0 codes).
template <bool FP4>
static inline void indexer_token(const uint16_t* __restrict krow, const void* cs, int32_t cs_bf16,
                                 int64_t cs_s0, int64_t cs_s1, int64_t row, int rope_dim,
                                 const float* __restrict w, float eps, const int32_t* rtab, const uint32_t* thr,
                                 uint8_t* __restrict q, uint8_t* __restrict sb) {
    alignas(64) float k[IDX_D], kn[IDX_D], kr[IDX_D];
    alignas(64) float c[IDX_D / 2], s[IDX_D / 2];
    bf16_to_f32(krow, k, IDX_D);
    // RMSNorm, as the reference (_sum_sq_128): fp32 squares; 32 lanes each add their 4
    // contiguous squares left to right, then a butterfly over lanes with xor distances
    // 16, 8, 4, 2, 1 (lane 0's value); /128 exact; the GPU's rsqrt (rsqrt_approx).
    float acc[32];
    for (int l = 0; l < 32; ++l) {
        const float* kk = k + 4 * l;
        acc[l] = ((kk[0] * kk[0] + kk[1] * kk[1]) + kk[2] * kk[2]) + kk[3] * kk[3];
    }
    for (int dist = 16; dist >= 1; dist >>= 1)
        for (int l = 0; l < dist; ++l) acc[l] = acc[l] + acc[l + dist];
    const float ss = acc[0];
    const float r = rsqrt_approx(ss / 128.0f + eps, rtab);
    for (int d = 0; d < IDX_D; ++d) kn[d] = rnbf16_torch((k[d] * r) * w[d]);
    // RoPE at the group's first position; NoPE pairs rotate by (1, 0) (finding 2); bf16.
    const int nope = IDX_D - rope_dim, P = rope_dim / 2;
    load_cos_sin(cs, cs_bf16, cs_s0, cs_s1, row, P, c, s);
    nope_pairs(kn, kr, nope / 2);
    rope_pairs(kn + nope, kr + nope, c, s, P);
    // 0 * inf (zero key, eps 0) is the only NaN: the GPUs' canonical +NaN, as the reference
    for (int d = 0; d < IDX_D; ++d) {
        const float y = rnbf16_torch(kr[d]);
        kr[d] = y != y ? std::numeric_limits<float>::quiet_NaN() : y;
    }
    if (!FP4) {
        float amax = absmax_ignore_nan(kr, IDX_D);
        amax = amax > F32_1E_4 ? amax : F32_1E_4;
        const float e = ceil_log2(amax * INV_448, thr);
        const float sc = exp2i(-e);
        for (int i = 0; i < IDX_D; ++i) q[i] = e4m3fn_encode(clamp_sym(kr[i] * sc, 448.0f));
        const float scale = exp2i(e);
        std::memcpy(sb, &scale, 4);
    } else {
        for (int b = 0; b < 4; ++b) {
            const float* xb = kr + b * 32;
            float amax = absmax_ignore_nan(xb, 32);
            const float floor_ = 0x1.8p-124f;  // 6 * 2^-126
            amax = amax > floor_ ? amax : floor_;
            float e = ceil_log2(amax * INV_6, thr);
            e = e < -127.0f ? -127.0f : (e > 127.0f ? 127.0f : e);
            const float sc = exp2i(-e);
            uint8_t codes[32];
            for (int i = 0; i < 32; ++i) codes[i] = e2m1_encode(xb[i] * sc);
            for (int i = 0; i < 16; ++i)
                q[b * 16 + i] = (uint8_t)(codes[2 * i] | (codes[2 * i + 1] << 4));
            sb[b] = (uint8_t)(int)(e + 127.0f);
        }
    }
}

template <bool FP4, int NT>
static inline void indexer_tokens(const uint16_t* const* krow, const int64_t* row, const void* cs,
                                  int32_t cs_bf16, int64_t cs_s0, int64_t cs_s1, int rope_dim,
                                  const float* __restrict w, float eps, const int32_t* rtab, const uint32_t* thr,
                                  uint8_t* const* q, uint8_t (*sb)[4]) {
    for (int u = 0; u < NT; ++u)
        indexer_token<FP4>(krow[u], cs, cs_bf16, cs_s0, cs_s1, row[u], rope_dim, w, eps, rtab, thr, q[u], sb[u]);
}

}  // namespace port

// =======================================================================================
// simd: the same building blocks with AVX-512 intrinsics (bit-identical to port)
// =======================================================================================
#if DSV41_CPU_AVX512
namespace simd {

using port::load_cos_sin;

static inline __m512i idx16(int a0, int a1, int a2, int a3, int a4, int a5, int a6, int a7,
                            int a8, int a9, int a10, int a11, int a12, int a13, int a14, int a15) {
    return _mm512_set_epi32(a15, a14, a13, a12, a11, a10, a9, a8, a7, a6, a5, a4, a3, a2, a1, a0);
}
// sign bit on the even lanes (the "-(o*s)" of the even RoPE lane)
static inline __m512 even_sign() {
    const int m = (int)0x80000000u;
    return _mm512_castsi512_ps(idx16(m, 0, m, 0, m, 0, m, 0, m, 0, m, 0, m, 0, m, 0));
}
// lanes [2i, 2i+1] <- pair i (of 8 pairs starting at `first`) of a 16-value vector
static inline __m512 dup_pairs(__m512 v, int first) {
    const __m512i lo = idx16(0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5, 6, 6, 7, 7);
    return _mm512_permutexvar_ps(_mm512_add_epi32(lo, _mm512_set1_epi32(first)), v);
}

static inline __m512 nope16(__m512 v, __m512 es) {
    const __m512 p = _mm512_xor_ps(_mm512_mul_ps(_mm512_permute_ps(v, 0xB1), _mm512_setzero_ps()), es);
    return _mm512_add_ps(v, p);
}
static inline __m512 rope16(__m512 v, __m512 c, __m512 s, __m512 es) {
    const __m512 p = _mm512_xor_ps(_mm512_mul_ps(_mm512_permute_ps(v, 0xB1), s), es);
    return _mm512_fmadd_ps(v, c, p);
}
static inline __m512 zero_nan(__m512 v) {
    return _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(v, v, _CMP_ORD_Q), v);
}
// 16 e2m1 codes (one per dword) -> 8 bytes, even element in the low nibble
static inline void store_nibbles(__m512i c, uint8_t* dst) {
    const __m512i q = _mm512_or_si512(c, _mm512_srli_epi64(c, 28));
    _mm_storel_epi64((__m128i*)dst, _mm512_cvtepi64_epi8(q));
}
// 16 consecutive cos/sin-cache values starting at column col (unit column stride)
static inline __m512 load_cs16(const void* rowp, int32_t cs_bf16, int col) {
    return cs_bf16 ? v16_bf16_load((const uint16_t*)rowp + col)
                   : _mm512_loadu_ps((const float*)rowp + col);
}

static inline void bf16_to_f32(const uint16_t* __restrict src, float* __restrict dst, int n) {
    for (int i = 0; i < n; i += 16) _mm512_storeu_ps(dst + i, v16_bf16_load(src + i));
}

static inline void store_bf16_canon(const float* __restrict x, uint16_t* __restrict dst, int n) {
    for (int i = 0; i < n; i += 16)
        _mm256_storeu_si256((__m256i*)(dst + i), v16_bf16_canon(_mm512_loadu_ps(x + i)));
}

template <int G, int NG, bool FNUZ>
static inline void quant_ue8m0(const float* __restrict x, uint8_t* __restrict q,
                               uint8_t* __restrict codes, bool sanitize, const uint32_t* thr) {
    static_assert(G % 16 == 0 && NG <= 16, "group layout");
    __m512i m[16];
    for (int g = 0; g < 16; ++g) {
        if (g >= NG) {
            m[g] = _mm512_setzero_si512();
            continue;
        }
        m[g] = v16_abs_bits_nonan(_mm512_loadu_ps(x + g * G));
        for (int k = 1; k < G / 16; ++k)
            m[g] = _mm512_max_epu32(m[g], v16_abs_bits_nonan(_mm512_loadu_ps(x + g * G + 16 * k)));
    }
    // A' = max(A, 1e-4); r = A' * fl32(1/M); e = ceil(fl32(log2 r)); s = 2^-e (0 for e >= 127
    // or A = inf); code = clamp(e + 127, 0, 255 | 254).
    const __m512i a = _mm512_max_epu32(v16_hmax16x16_epu32(m), v16_u32(bits(F32_1E_4)));
    const __m512 r = _mm512_mul_ps(_mm512_castsi512_ps(a), _mm512_set1_ps(FNUZ ? INV_224 : INV_448));
    const __m512i e = v16_ceil_log2_pos(r, thr);
    const __mmask16 inf = _mm512_cmpeq_epi32_mask(_mm512_srli_epi32(_mm512_castps_si512(r), 23), v16_u32(255));
    const __mmask16 live = _mm512_cmplt_epi32_mask(e, v16_u32(127)) & (__mmask16)~inf;
    const __m512i sbits = _mm512_maskz_mov_epi32(live, _mm512_slli_epi32(_mm512_sub_epi32(v16_u32(127), e), 23));
    __m512i code = _mm512_max_epi32(_mm512_add_epi32(e, v16_u32(127)), _mm512_setzero_si512());
    code = _mm512_mask_mov_epi32(_mm512_min_epi32(code, v16_u32(255)), inf, v16_u32(255));
    if (sanitize) code = _mm512_min_epi32(code, v16_u32(254));
    alignas(64) float sv[16];
    _mm512_storeu_si512(sv, sbits);
    _mm_mask_storeu_epi8(codes, (__mmask16)((1u << NG) - 1u), _mm512_cvtepi32_epi8(code));
    const uint32_t msat = FNUZ ? 0x43600000u : 0x43E00000u;  // 224 / 448
    static_assert(NG * G % 64 == 0, "64-byte chunks");
    for (int c = 0; c < NG * G / 64; ++c) {
        __m512i d[4];
        for (int j = 0; j < 4; ++j) {
            const int z = 4 * c + j;  // 16-value vector z belongs to group 16 z / G
            const __m512 y = _mm512_mul_ps(_mm512_loadu_ps(x + 16 * z), _mm512_set1_ps(sv[16 * z / G]));
            d[j] = v16_e4m3_encode_dw<FNUZ>(y, msat, V16_NAN_POS_SAT);
        }
        _mm512_storeu_si512(q + 64 * c, v16_pack4_u8(d[0], d[1], d[2], d[3]));
    }
}

template <int NG>
static inline void quant_nvfp4(const float* __restrict x, uint8_t* __restrict packed,
                               uint8_t* __restrict scales) {
    static_assert(NG % 16 == 0, "group layout");
    alignas(64) float S[NG];
    for (int h = 0; h < NG; h += 16) {
        __m512i m[16];
        for (int g = 0; g < 16; ++g) m[g] = v16_abs_bits_nonan(_mm512_loadu_ps(x + 16 * (h + g)));
        const __m512 sf = _mm512_mul_ps(_mm512_castsi512_ps(v16_hmax16x16_epu32(m)), _mm512_set1_ps(INV_6));
        __m512i sfb = _mm512_max_epu32(_mm512_castps_si512(sf), v16_u32(0x3B000000u));  // 2^-9
        sfb = _mm512_min_epu32(sfb, v16_u32(0x43E00000u));                              // 448
        const __m128i sb = v16_e4m3_encode<false>(_mm512_castsi512_ps(sfb), 0x43E00000u, 0x7Fu);
        _mm_storeu_si128((__m128i*)(scales + h), sb);
        _mm512_storeu_ps(S + h, v16_e4m3_decode<false>(sb));
    }
    for (int g = 0; g < NG; ++g) {
        const __m512 y = _mm512_div_ps(_mm512_loadu_ps(x + 16 * g), _mm512_set1_ps(S[g]));
        __m512i c = v16_e2m1_encode(y);
        c = _mm512_mask_mov_epi32(c, _mm512_cmp_ps_mask(y, y, _CMP_UNORD_Q), v16_u32(7));
        store_nibbles(c, packed + 8 * g);
    }
}

// UE8M0 FP8 decode, 32 values per step in 16-bit lanes.  For codes whose products are all
// normal, finite bf16 (OCP 10..246, FNUZ 11..247) bf16(e4m3 * 2^(code-127)) is exact and
// is built from bits: normal e4m3 -> (em << 4) + ((code - bias) << 7); subnormal e4m3 m*2^-9
// (m*2^-10) from a per-code 8-entry table; zero keeps its sign; NaN -> 0x7FFF.  Other codes
// (0, 255, extreme scales) take the fp32 path (same result as port::decode_ue8m0).
template <bool FNUZ>
static inline __m512i dec_subtab_base() {
    // entry m (1..7): ((p - off) << 7) | ((m << (7 - p)) & 0x7F), p = (m >= 2) + (m >= 4)
    alignas(64) int16_t t[32] = {0};
    const int off = FNUZ ? 10 : 9;
    for (int m = 1; m < 8; ++m) {
        const int p = (m >= 2) + (m >= 4);
        t[m] = (int16_t)(((p - off) * 128) | ((m << (7 - p)) & 0x7F));
    }
    return _mm512_load_si512(t);
}

template <int G, int NG, bool FNUZ>
static inline void decode_ue8m0(const uint8_t* __restrict v, const uint8_t* __restrict codes,
                                uint16_t* __restrict out) {
    static_assert(G % 32 == 0, "group layout");
    static const __m512i base = dec_subtab_base<FNUZ>();
    const int lo = FNUZ ? 11 : 10, hi = FNUZ ? 247 : 246;
    const __m512i m7f = _mm512_set1_epi16(0x7F), m80 = _mm512_set1_epi16(0x80);
    for (int g = 0; g < NG; ++g) {
        const int code = codes[g];
        if (code < lo || code > hi) {
            const __m512 S = _mm512_set1_ps(ue8m0_decode((uint8_t)code));
            for (int k = 0; k < G / 16; ++k) {
                const __m512 f = v16_e4m3_decode<FNUZ>(_mm_loadu_si128((const __m128i*)(v + g * G + 16 * k)));
                _mm256_storeu_si256((__m256i*)(out + g * G + 16 * k), v16_bf16_canon(_mm512_mul_ps(f, S)));
            }
            continue;
        }
        const __m512i add = _mm512_set1_epi16((int16_t)((code - (FNUZ ? 8 : 7)) * 128));
        const __m512i sub = _mm512_maskz_add_epi16(0xFFFFFFFEu, base, _mm512_set1_epi16((int16_t)(code * 128)));
        for (int k = 0; k < G / 32; ++k) {
            const __m512i b = _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i*)(v + g * G + 32 * k)));
            const __m512i em = _mm512_and_si512(b, m7f);
            __m512i r = _mm512_add_epi16(_mm512_slli_epi16(em, 4), add);
            r = _mm512_mask_mov_epi16(r, _mm512_cmplt_epu16_mask(em, _mm512_set1_epi16(8)), _mm512_permutexvar_epi16(em, sub));
            r = _mm512_or_si512(r, _mm512_slli_epi16(_mm512_and_si512(b, m80), 8));
            const __mmask32 nan = FNUZ ? _mm512_cmpeq_epi16_mask(b, m80) : _mm512_cmpeq_epi16_mask(em, m7f);
            r = _mm512_mask_mov_epi16(r, nan, _mm512_set1_epi16(0x7FFF));
            _mm512_storeu_si512(out + g * G + 32 * k, r);
        }
    }
}

static inline void decode_nvfp4(const uint8_t* __restrict v, const uint8_t* __restrict scales,
                                uint16_t* __restrict out) {
    const __m512 lut = _mm512_loadu_ps(e2m1_tables().plus_zero);
    const __m512i shifts = idx16(0, 4, 0, 4, 0, 4, 0, 4, 0, 4, 0, 4, 0, 4, 0, 4);
    alignas(64) float S[32];
    _mm512_storeu_ps(S, v16_e4m3_decode<false>(_mm_loadu_si128((const __m128i*)scales)));
    _mm512_storeu_ps(S + 16, v16_e4m3_decode<false>(_mm_loadu_si128((const __m128i*)(scales + 16))));
    for (int g = 0; g < R288::n_groups; ++g) {
        const __m128i b8 = _mm_loadl_epi64((const __m128i*)(v + 8 * g));
        const __m512i idx = _mm512_srlv_epi32(_mm512_cvtepu8_epi32(_mm_unpacklo_epi8(b8, b8)), shifts);
        // e2m1 value (<= 2 significant bits) times an e4m3 scale (<= 4 bits, >= 2^-9): the
        // product is an exact bf16 (or NaN): its top 16 bits, NaN -> 0x7FFF.
        const __m512 y = _mm512_mul_ps(_mm512_permutexvar_ps(idx, lut), _mm512_set1_ps(S[g]));
        __m512i r = _mm512_srli_epi32(_mm512_castps_si512(y), 16);
        r = _mm512_mask_mov_epi32(r, _mm512_cmp_ps_mask(y, y, _CMP_UNORD_Q), v16_u32(0x7FFFu));
        _mm256_storeu_si256((__m256i*)(out + 16 * g), _mm512_cvtepi32_epi16(r));
    }
}

static inline void rotate_latent(const float* __restrict x, float* __restrict rot,
                                 const void* cs, int32_t cs_bf16, int64_t cs_s0, int64_t cs_s1,
                                 int64_t row, bool with_nope, bool sanitize) {
    const __m512 es = even_sign();
    __m512 c0, c1, s0, s1;
    if (cs_s1 == 1) {
        const void* rp = cs_bf16 ? (const void*)((const uint16_t*)cs + row * cs_s0)
                                 : (const void*)((const float*)cs + row * cs_s0);
        c0 = load_cs16(rp, cs_bf16, 0), c1 = load_cs16(rp, cs_bf16, 16);
        s0 = load_cs16(rp, cs_bf16, 32), s1 = load_cs16(rp, cs_bf16, 48);
    } else {
        alignas(64) float c[32], s[32];
        load_cos_sin(cs, cs_bf16, cs_s0, cs_s1, row, 32, c, s);
        c0 = _mm512_loadu_ps(c), c1 = _mm512_loadu_ps(c + 16);
        s0 = _mm512_loadu_ps(s), s1 = _mm512_loadu_ps(s + 16);
    }
    if (with_nope) {
        for (int d = 0; d < NOPE; d += 16) {
            __m512 y = nope16(_mm512_loadu_ps(x + d), es);
            if (sanitize) y = zero_nan(y);
            _mm512_storeu_ps(rot + d, y);
        }
    }
    const __m512 cc[2] = {c0, c1}, ss[2] = {s0, s1};
    for (int k = 0; k < 4; ++k) {
        const __m512 c = dup_pairs(cc[k >> 1], 8 * (k & 1)), s = dup_pairs(ss[k >> 1], 8 * (k & 1));
        __m512 y = rope16(_mm512_loadu_ps(x + NOPE + 16 * k), c, s, es);
        if (sanitize) y = zero_nan(y);
        _mm512_storeu_ps(rot + NOPE + 16 * k, y);
    }
}

static inline void store_fp8_row(const float* __restrict rot, uint8_t* __restrict dst, float inv) {
    const __m512 iv = _mm512_set1_ps(inv);
    for (int c = 0; c < HEAD; c += 64) {
        __m512i e[4];
        for (int j = 0; j < 4; ++j) {
            const __m512 y = _mm512_mul_ps(v16_bf16_round(_mm512_loadu_ps(rot + c + 16 * j), 0x7FFFu), iv);
            e[j] = v16_e4m3_encode_dw<false>(y, 0x43E00000u, V16_NAN_POS_SAT);
        }
        _mm512_storeu_si512(dst + c, v16_pack4_u8(e[0], e[1], e[2], e[3]));
    }
}

static inline __m512 bf16_round_torch(__m512 x) { return v16_bf16_round(x, 0xFFFFu); }

// Σ k_d² of one indexer key in the reference's order (see port::indexer_token): for a pair
// of chunks P, Q (16 dims = 4 lanes each), Triton lanes at positions 0 (P) and 2 (Q) of
// every 128-bit lane; then the butterfly 16, 8 (whole vectors), 4, 2, 1 (in-vector).
static inline float indexer_sumsq(const __m512* k) {
    __m512 R[4];
#pragma GCC unroll 4
    for (int j = 0; j < 4; ++j) {
        const __m512 P = _mm512_mul_ps(k[2 * j], k[2 * j]);
        const __m512 Q = _mm512_mul_ps(k[2 * j + 1], k[2 * j + 1]);
        const __m512 A = _mm512_shuffle_ps(P, Q, 0x44);  // P0 P1 Q0 Q1
        const __m512 B = _mm512_shuffle_ps(P, Q, 0xEE);  // P2 P3 Q2 Q3
        __m512 t = _mm512_add_ps(A, _mm512_permute_ps(A, 0xB1));
        t = _mm512_add_ps(t, B);
        R[j] = _mm512_add_ps(t, _mm512_permute_ps(B, 0xB1));
    }
    const __m512 C = _mm512_add_ps(_mm512_add_ps(R[0], R[2]), _mm512_add_ps(R[1], R[3]));
    const __m512 D = _mm512_add_ps(C, _mm512_permute_ps(C, 0x4E));
    const __m512 E = _mm512_add_ps(D, _mm512_shuffle_f32x4(D, D, 0x4E));
    const __m512 F = _mm512_add_ps(E, _mm512_shuffle_f32x4(E, E, 0xB1));
    return _mm512_cvtss_f32(F);
}
static inline float indexer_rsqrt(float ss, float eps, const int32_t* rtab) {
    return rsqrt_approx(ss / 128.0f + eps, rtab);
}
// rs[i] of n keys (== indexer_rsqrt key by key)
static inline void indexer_rsqrt_n(const float* ss, float* rs, int n, float eps, const int32_t* rtab) {
    for (int i = 0; i < n; ++i) rs[i] = indexer_rsqrt(ss[i], eps, rtab);
}

// NT tokens at once, phase by phase, so the out-of-order core overlaps their latency chains
// (sum of squares -> sqrt/div -> norm -> RoPE -> amax -> scale -> encode).
template <bool FP4, int NT>
static inline void indexer_tokens(const uint16_t* const* krow, const int64_t* row, const void* cs,
                                  int32_t cs_bf16, int64_t cs_s0, int64_t cs_s1, int rope_dim,
                                  const float* __restrict w, float eps, const int32_t* rtab, const uint32_t* thr,
                                  uint8_t* const* q, uint8_t (*sb)[4], const float* rs_in = nullptr) {
    if (rope_dim != 64) {  // the AVX-512 path is laid out for 64 NoPE + 64 RoPE dims
        for (int u = 0; u < NT; ++u)
            port::indexer_token<FP4>(krow[u], cs, cs_bf16, cs_s0, cs_s1, row[u], rope_dim, w, eps, rtab,
                                     thr, q[u], sb[u]);
        return;
    }
    const __m512 es = even_sign();
    __m512 k[NT][8];
    float rs[NT];
    // RMSNorm sum of squares in the reference's order (see port::indexer_token): for a pair
    // of chunks P, Q (16 dims = 4 lanes each), Triton lanes at positions 0 (P) and 2 (Q) of
    // every 128-bit lane; then the butterfly 16, 8 (whole vectors), 4, 2, 1 (in-vector).
#pragma GCC unroll 4
    for (int u = 0; u < NT; ++u) {
#pragma GCC unroll 8
        for (int i = 0; i < 8; ++i) k[u][i] = v16_bf16_load(krow[u] + 16 * i);
        if (rs_in) {
            rs[u] = rs_in[u];
            continue;
        }
        rs[u] = indexer_rsqrt(indexer_sumsq(k[u]), eps, rtab);
    }
    __m512 cc[NT][2], sn[NT][2];
#pragma GCC unroll 8
    for (int u = 0; u < NT; ++u) {
        if (cs_s1 == 1) {
            const void* rp = cs_bf16 ? (const void*)((const uint16_t*)cs + row[u] * cs_s0)
                                     : (const void*)((const float*)cs + row[u] * cs_s0);
            cc[u][0] = load_cs16(rp, cs_bf16, 0), cc[u][1] = load_cs16(rp, cs_bf16, 16);
            sn[u][0] = load_cs16(rp, cs_bf16, 32), sn[u][1] = load_cs16(rp, cs_bf16, 48);
        } else {
            alignas(64) float c[32], s[32];
            load_cos_sin(cs, cs_bf16, cs_s0, cs_s1, row[u], 32, c, s);
            cc[u][0] = _mm512_loadu_ps(c), cc[u][1] = _mm512_loadu_ps(c + 16);
            sn[u][0] = _mm512_loadu_ps(s), sn[u][1] = _mm512_loadu_ps(s + 16);
        }
    }
    __m512i am[NT][4];
#pragma GCC unroll 8
    for (int u = 0; u < NT; ++u) {
        const __m512 r = _mm512_set1_ps(rs[u]);
#pragma GCC unroll 8
        for (int i = 0; i < 8; ++i) {
            const __m512 kn = bf16_round_torch(_mm512_mul_ps(_mm512_mul_ps(k[u][i], r), _mm512_loadu_ps(w + 16 * i)));
            __m512 y;
            if (i < 4) {
                y = nope16(kn, es);
            } else {
                const int j = i - 4;
                y = rope16(kn, dup_pairs(cc[u][j >> 1], 8 * (j & 1)), dup_pairs(sn[u][j >> 1], 8 * (j & 1)), es);
            }
            // the only NaN (0 * inf: zero key, eps 0) as the GPUs' canonical +NaN (port::indexer_token)
            const __m512 yb = bf16_round_torch(y);
            k[u][i] = _mm512_mask_mov_ps(yb, _mm512_cmp_ps_mask(yb, yb, _CMP_UNORD_Q),
                                         _mm512_set1_ps(std::numeric_limits<float>::quiet_NaN()));
            const __m512i a = v16_abs_bits_nonan(k[u][i]);
            am[u][i >> 1] = (i & 1) ? _mm512_max_epu32(am[u][i >> 1], a) : a;
        }
    }
    if (!FP4) {
        float sc[NT];
#pragma GCC unroll 8
        for (int u = 0; u < NT; ++u) {
            const __m512i m = _mm512_max_epu32(_mm512_max_epu32(am[u][0], am[u][1]), _mm512_max_epu32(am[u][2], am[u][3]));
            float amax = from_bits(_mm512_reduce_max_epu32(m));
            amax = amax > F32_1E_4 ? amax : F32_1E_4;
            const float e = ceil_log2(amax * INV_448, thr);
            sc[u] = exp2i(-e);
            const float scale = exp2i(e);
            std::memcpy(sb[u], &scale, 4);
        }
#pragma GCC unroll 8
        for (int u = 0; u < NT; ++u) {
            const __m512 scv = _mm512_set1_ps(sc[u]);
#pragma GCC unroll 8
            for (int h = 0; h < 2; ++h) {
                // e4m3(clamp_sym(y, 448)): the encoder's saturation with the NaN sign kept.
                __m512i e[4];
#pragma GCC unroll 8
                for (int j = 0; j < 4; ++j)
                    e[j] = v16_e4m3_encode_dw<false>(_mm512_mul_ps(k[u][4 * h + j], scv), 0x43E00000u, V16_NAN_SIGNED_SAT);
                _mm512_storeu_si512(q[u] + 64 * h, v16_pack4_u8(e[0], e[1], e[2], e[3]));
            }
        }
    } else {
        float sc[NT][4];
#pragma GCC unroll 8
        for (int u = 0; u < NT; ++u) {
#pragma GCC unroll 8
            for (int b = 0; b < 4; ++b) {
                float amax = from_bits(_mm512_reduce_max_epu32(am[u][b]));
                const float floor_ = 0x1.8p-124f;  // 6 * 2^-126
                amax = amax > floor_ ? amax : floor_;
                float e = ceil_log2(amax * INV_6, thr);
                e = e < -127.0f ? -127.0f : (e > 127.0f ? 127.0f : e);
                sc[u][b] = exp2i(-e);
                sb[u][b] = (uint8_t)(int)(e + 127.0f);
            }
        }
#pragma GCC unroll 8
        for (int u = 0; u < NT; ++u) {
#pragma GCC unroll 8
            for (int i = 0; i < 8; ++i) {
                const __m512 y = _mm512_mul_ps(k[u][i], _mm512_set1_ps(sc[u][i >> 1]));
                store_nibbles(v16_e2m1_encode(y), q[u] + 8 * i);
            }
        }
    }
}

template <bool FP4>
static inline void indexer_token(const uint16_t* __restrict krow, const void* cs, int32_t cs_bf16,
                                 int64_t cs_s0, int64_t cs_s1, int64_t row, int rope_dim,
                                 const float* __restrict w, float eps, const int32_t* rtab, const uint32_t* thr,
                                 uint8_t* __restrict q, uint8_t* __restrict sb) {
    uint8_t sbs[1][4];
    const uint16_t* kr[1] = {krow};
    uint8_t* qp[1] = {q};
    indexer_tokens<FP4, 1>(kr, &row, cs, cs_bf16, cs_s0, cs_s1, rope_dim, w, eps, rtab, thr, qp, sbs);
    std::memcpy(sb, sbs[0], 4);
}

}  // namespace simd
namespace tok = simd;
#else
namespace tok = port;
#endif

// Software prefetch of the lines a token PF iterations ahead will touch (random cache
// records, random cos/sin rows): hides most of the miss latency of the scattered accesses.
constexpr int64_t PF = 8;
// Below this many tokens a kernel runs on the calling thread only: waking the OpenMP team
// costs more than the work (and a busy machine can delay a woken thread by a time slice).
constexpr int64_t PAR_MIN = 128;
// Tokens per scheduling chunk: dynamic chunks keep both threads busy when the machine is
// loaded and one of them is descheduled for a while (static halves would wait for it).
constexpr int64_t CHUNK = 32;
static inline void prefetch_lines(const void* p, int64_t bytes, bool write) {
    const char* c = (const char*)p;
    for (int64_t i = 0; i < bytes; i += 64) {
        if (write) __builtin_prefetch(c + i, 1, 3);
        else __builtin_prefetch(c + i, 0, 3);
    }
    if (bytes > 0) {
        if (write) __builtin_prefetch(c + bytes - 1, 1, 3);
        else __builtin_prefetch(c + bytes - 1, 0, 3);
    }
}
// Where token o's bytes sit in its page: values at o * vs, scales at s0 + o * ss.  Paged
// records keep the page's values first and its scales after them; interleaved records (528 /
// 288 as vLLM 0.33 writes them) keep each token's values and scales together.  Computed once
// per call, so both layouts run the same loops.
struct RecLayout {
    int64_t vs, s0, ss;
};
static inline RecLayout rec_layout(int64_t B, int64_t vb, int64_t sb, bool interleaved) {
    return interleaved ? RecLayout{vb + sb, vb, vb + sb} : RecLayout{vb, B * vb, sb};
}
// the value and scale bytes of slot `slot` (row-major layouts)
static inline void prefetch_record(uint8_t* cache, int64_t ps, int64_t B, int64_t slot,
                                   const RecLayout& L, int64_t vb, int64_t sb, bool write) {
    if (slot < 0) return;
    uint8_t* pg = cache + (slot / B) * ps;
    const int64_t o = slot % B;
    prefetch_lines(pg + o * L.vs, vb, write);
    prefetch_lines(pg + L.s0 + o * L.ss, sb, write);
}
static inline void prefetch_record(uint8_t* cache, int64_t ps, int64_t B, int64_t slot, int64_t vb,
                                   int64_t sb, bool write) {
    prefetch_record(cache, ps, B, slot, rec_layout(B, vb, sb, false), vb, sb, write);
}
static inline void prefetch_cs_row(const void* cs, int32_t cs_bf16, int64_t s0, int64_t s1, int64_t row) {
    const int64_t esz = cs_bf16 ? 2 : 4;
    prefetch_lines((const char*)cs + row * s0 * esz, 64 * s1 * esz, false);
}

// =======================================================================================
// kernels
// =======================================================================================

// body(t, page, o) for every token t with a slot >= 0 (o: the slot's row in `page`), tokens
// shared out over threads, each token's record prefetched PF tokens ahead: the walk both
// insert layouts take.
template <class Body>
static inline void for_each_slot(uint8_t* cache, int64_t ps, const int64_t* slots, int64_t T, int64_t B,
                                 const RecLayout& L, int64_t vb, int64_t sb, const Body& body) {
#pragma omp parallel for schedule(dynamic, CHUNK) if (T >= PAR_MIN)
    for (int64_t t = 0; t < T; ++t) {
        if (t + PF < T) prefetch_record(cache, ps, B, slots[t + PF], L, vb, sb, true);
        const int64_t slot = slots[t];
        if (slot < 0) continue;
        body(t, cache + (slot / B) * ps, slot % B);
    }
}

// quantize_and_insert_k_cache (spec cache_ops §3)
template <bool FNUZ>
static void quantize_insert_584(const uint16_t* k, int64_t ks0, uint8_t* cache, int64_t ps,
                                const int64_t* slots, int64_t T, int64_t B) {
    const uint32_t* thr = ceil_log2_table().thr;
    constexpr int64_t VB = R584::value_bytes, SB = R584::scale_bytes;
    const RecLayout L = rec_layout(B, VB, SB, false);
    for_each_slot(cache, ps, slots, T, B, L, VB, SB, [&](int64_t t, uint8_t* page, int64_t o) {
        const uint16_t* row = k + t * ks0;
        alignas(64) float x[NOPE];
        tok::bf16_to_f32(row, x, NOPE);
        uint8_t* val = page + o * L.vs;
        uint8_t* sc = page + L.s0 + o * L.ss;
        tok::quant_ue8m0<R584::group, R584::n_groups, FNUZ>(x, val, sc, false, thr);
        sc[R584::n_groups] = 0;  // the pad byte after the scale codes
        std::memcpy(val + NOPE, row + NOPE, 2 * R584::bf16_dims);  // RoPE dims: the bf16 bits verbatim
    });
}

template <bool FNUZ>
static void quantize_insert_528(const uint16_t* k, int64_t ks0, uint8_t* cache, int64_t ps,
                                const int64_t* slots, int64_t T, int64_t B, bool interleaved) {
    const uint32_t* thr = ceil_log2_table().thr;
    constexpr int64_t VB = R528::value_bytes, SB = R528::scale_bytes;
    const RecLayout L = rec_layout(B, VB, SB, interleaved);
    for_each_slot(cache, ps, slots, T, B, L, VB, SB, [&](int64_t t, uint8_t* page, int64_t o) {
        alignas(64) float x[HEAD];
        tok::bf16_to_f32(k + t * ks0, x, HEAD);
        tok::quant_ue8m0<R528::group, R528::n_groups, FNUZ>(x, page + o * L.vs, page + L.s0 + o * L.ss, false, thr);
    });
}

// dequantize_and_gather_k_cache (spec cache_ops §4).  Tokens are the concatenation of the
// requests' gathered ranges, processed in chunks of CHUNK consecutive tokens.
template <int W, bool FNUZ>
static void gather_impl(uint16_t* out, int64_t os0, int64_t os1, const uint8_t* cache, int64_t ps,
                        const int32_t* seq_lens, const int32_t* gather_lens, int64_t R,
                        const int32_t* bt, int64_t bts0, int64_t bts1, int64_t B,
                        int64_t offset, bool interleaved) {
    constexpr int64_t VB = rec::Record<W>::value_bytes;
    constexpr int64_t SB = rec::Record<W>::scale_bytes;
    const RecLayout L = rec_layout(B, VB, SB, interleaved);
    std::vector<int64_t> first(R + 1);
    first[0] = 0;
    for (int64_t r = 0; r < R; ++r) {
        const int64_t n = gather_lens ? gather_lens[r] : seq_lens[r];
        first[r + 1] = first[r] + (n > 0 ? n : 0);
    }
    const int64_t total = first[R];
    if (total == 0) return;
    const int64_t nchunks = (total + CHUNK - 1) / CHUNK;
#pragma omp parallel for schedule(dynamic, 1) if (total >= PAR_MIN)
    for (int64_t c = 0; c < nchunks; ++c) {
        const int64_t lo = c * CHUNK, hi = std::min(total, lo + CHUNK);
        {
            int64_t r = std::upper_bound(first.begin(), first.end(), lo) - first.begin() - 1;
            int64_t rp = r;  // request of the token PF ahead
            for (int64_t idx = lo; idx < hi; ++idx) {
                if (idx + PF < hi) {
                    const int64_t j = idx + PF;
                    while (j >= first[rp + 1]) ++rp;
                    const int64_t pj = (int64_t)seq_lens[rp] - (first[rp + 1] - first[rp]) + (j - first[rp]);
                    const int64_t bj = bt[rp * bts0 + (pj / B) * bts1];
                    prefetch_record(const_cast<uint8_t*>(cache), ps, B, bj * B + pj % B, L, VB, SB, false);
                }
                while (idx >= first[r + 1]) ++r;
                const int64_t i = idx - first[r];
                const int64_t n = first[r + 1] - first[r];
                const int64_t p = (int64_t)seq_lens[r] - n + i;
                const int64_t blk = bt[r * bts0 + (p / B) * bts1];
                const int64_t o = p % B;
                const uint8_t* page = cache + blk * ps;
                uint16_t* dst = out + r * os0 + (offset + i) * os1;
                if (W == 584) {
                    tok::decode_ue8m0<R584::group, R584::n_groups, FNUZ>(page + o * VB, page + B * VB + o * SB, dst);
                    std::memcpy(dst + NOPE, page + o * VB + NOPE, 2 * R584::bf16_dims);
                } else if (W == 528) {
                    tok::decode_ue8m0<R528::group, R528::n_groups, FNUZ>(page + o * L.vs, page + L.s0 + o * L.ss, dst);
                } else {
                    tok::decode_nvfp4(page + o * L.vs, page + L.s0 + o * L.ss, dst);
                }
            }
        }
    }
}

// rope_quant_insert (spec cache_ops §8.2)
enum RopeKind { RK_584 = 0, RK_528 = 1, RK_288 = 2, RK_BF16 = 3, RK_FP8 = 4 };

template <int KIND>
static void rope_quant_insert_impl(const uint16_t* latent, int64_t ls0, const int64_t* positions,
                                   const void* cs, int32_t cs_bf16, int64_t cs_s0, int64_t cs_s1,
                                   void* cache, int64_t c_s0, int64_t c_s1, const int64_t* slots,
                                   int64_t T, int64_t B, int64_t CR, float inv_scale,
                                   bool sanitize, bool interleaved) {
    const uint32_t* thr = ceil_log2_table().thr;
    using R = rec::Record<KIND == RK_584 ? 584 : KIND == RK_528 ? 528 : 288>;  // unused for rows
    const int64_t vb = R::value_bytes, sb = R::scale_bytes;
    const RecLayout L = rec_layout(B, vb, sb, interleaved);
    const int64_t esz = KIND == RK_BF16 ? 2 : 1;
#pragma omp parallel for schedule(dynamic, CHUNK) if (T >= PAR_MIN)
    for (int64_t t = 0; t < T; ++t) {
        if (t + PF < T) {
            const int64_t sp = slots[t + PF], pp = positions[t + PF];
            if (sp >= 0 && (pp + 1) % CR == 0) {
                prefetch_cs_row(cs, cs_bf16, cs_s0, cs_s1, (pp / CR) * CR);
                prefetch_lines(latent + (t + PF) * ls0, HEAD * 2, false);
                if (KIND <= RK_288)
                    prefetch_record((uint8_t*)cache, c_s0, B, sp, L, vb, sb, true);
                else
                    prefetch_lines((uint8_t*)cache + ((sp / B) * c_s0 + (sp % B) * c_s1) * esz, HEAD * esz, true);
            }
        }
        const int64_t slot = slots[t];
        if (slot < 0) continue;
        const int64_t pos = positions[t];
        if ((pos + 1) % CR != 0) continue;
        const int64_t page = slot / B, o = slot % B;
        alignas(64) float x[HEAD];
        alignas(64) float rot[HEAD];
        tok::bf16_to_f32(latent + t * ls0, x, HEAD);
        tok::rotate_latent(x, rot, cs, cs_bf16, cs_s0, cs_s1, (pos / CR) * CR, KIND != RK_584, sanitize);
        if (KIND == RK_584) {
            // NoPE quantized from the unrotated latent; RoPE dims stored as bf16(x').
            uint8_t* pg = (uint8_t*)cache + page * c_s0;
            uint8_t* val = pg + o * vb;
            uint8_t* sc = pg + B * vb + o * sb;
            tok::quant_ue8m0<R584::group, R584::n_groups, false>(x, val, sc, sanitize, thr);
            sc[R584::n_groups] = 0;  // the pad byte after the scale codes
            alignas(64) uint16_t tail[R584::bf16_dims];
            tok::store_bf16_canon(rot + NOPE, tail, R584::bf16_dims);
            std::memcpy(val + NOPE, tail, 2 * R584::bf16_dims);
        } else if (KIND == RK_528) {
            uint8_t* pg = (uint8_t*)cache + page * c_s0;
            tok::quant_ue8m0<R528::group, R528::n_groups, false>(rot, pg + o * L.vs, pg + L.s0 + o * L.ss, sanitize, thr);
        } else if (KIND == RK_288) {
            uint8_t* pg = (uint8_t*)cache + page * c_s0;
            tok::quant_nvfp4<R288::n_groups>(rot, pg + o * L.vs, pg + L.s0 + o * L.ss);
        } else if (KIND == RK_BF16) {
            tok::store_bf16_canon(rot, (uint16_t*)cache + page * c_s0 + o * c_s1, HEAD);
        } else {
            tok::store_fp8_row(rot, (uint8_t*)cache + page * c_s0 + o * c_s1, inv_scale);
        }
    }
}

// indexer_k_norm_rope_store (rope_quant_ops §3; page layouts §3.4).  Chunks of CHUNK tokens;
// the writing tokens of a chunk run two at a time (tok::indexer_tokens).
template <bool FP4, bool TILED>
static inline void indexer_store_token(const uint8_t* q, const uint8_t* sb, uint8_t* pg, int64_t o,
                                       int64_t B, int64_t N) {
    if (!FP4) {
        if (TILED) {  // values [B/16][128/16][16 tokens][16 bytes]; scales not tiled
            uint8_t* base = pg + (o / 16) * (16 * IDX_D) + (o % 16) * 16;
            for (int b = 0; b < IDX_D / 16; ++b) std::memcpy(base + b * 256, q + b * 16, 16);
        } else {
            std::memcpy(pg + o * IDX_D, q, IDX_D);
        }
        std::memcpy(pg + B * RIDX8::value_bytes + o * RIDX8::scale_bytes, sb, RIDX8::scale_bytes);
    } else {
        uint8_t* sbase = pg + B * RIDX4::value_bytes;
        if (TILED) {  // aiter preshuffle, N tokens per tile
            const int64_t g = o / N, l = o % N;
            uint8_t* base = pg + g * (N * 64) + l * 16;
            for (int b = 0; b < 4; ++b) std::memcpy(base + b * (N * 16), q + b * 16, 16);
            const int64_t s_lo = 64 / N, s_hi = 4 / s_lo;
            for (int j = 0; j < 4; ++j)
                sbase[g * (N * 4) + (j % s_lo) * (N * s_hi) + l * s_hi + j / s_lo] = sb[j];
        } else {
            std::memcpy(pg + o * RIDX4::value_bytes, q, RIDX4::value_bytes);
            std::memcpy(sbase + o * RIDX4::scale_bytes, sb, RIDX4::scale_bytes);
        }
    }
}

template <bool FP4, bool TILED>
static void indexer_k_store_impl(const uint16_t* k_pre, int64_t ks0, const int64_t* positions,
                                 const void* cs, int32_t cs_bf16, int64_t cs_s0, int64_t cs_s1,
                                 int rope_dim, const float* w, float eps, const int32_t* rtab,
                                 uint8_t* cache, int64_t ps, int64_t B, const int64_t* slots,
                                 int64_t T, int64_t CR, int64_t N) {
    const uint32_t* thr = ceil_log2_table().thr;
    const int64_t nchunks = (T + CHUNK - 1) / CHUNK;
#pragma omp parallel for schedule(dynamic, 1) if (T >= PAR_MIN)
    for (int64_t c = 0; c < nchunks; ++c) {
        const int64_t lo = c * CHUNK, hi = std::min(T, lo + CHUNK);
        alignas(64) uint8_t qbuf[2][IDX_D];
        uint8_t sb[2][4];
        uint8_t* qp[2] = {qbuf[0], qbuf[1]};
        const uint16_t* kr[2];
        int64_t row[2], slot[2];
        int np = 0;
#if DSV41_CPU_AVX512
        if (rope_dim == 64) {
            // Phase 1: the writing tokens of the chunk and their RMSNorm factors (the float64
            // sqrt / div of 16 keys at once instead of one latency chain per key).
            const uint16_t* kk[CHUNK];
            int64_t rr[CHUNK], sl_[CHUNK];
            alignas(64) float ss[CHUNK], rs[CHUNK];
            int n = 0;
            for (int64_t t = lo; t < hi; ++t) {
                const int64_t sl = slots[t];
                if (sl < 0) continue;
                const int64_t pos = positions[t];
                if ((pos + 1) % CR != 0) continue;
                kk[n] = k_pre + t * ks0;
                rr[n] = (pos / CR) * CR;
                sl_[n] = sl;
                ++n;
            }
            for (int i = 0; i < n; ++i) {
                __m512 kv[8];
#pragma GCC unroll 8
                for (int j = 0; j < 8; ++j) kv[j] = v16_bf16_load(kk[i] + 16 * j);
                ss[i] = simd::indexer_sumsq(kv);
            }
            simd::indexer_rsqrt_n(ss, rs, n, eps, rtab);
            // Phase 2: two keys at a time, prefetching the cos/sin rows and records ahead.
            for (int i = 0; i < n; i += 2) {
                for (int j = i + PF; j < i + PF + 2 && j < n; ++j) {
                    prefetch_cs_row(cs, cs_bf16, cs_s0, cs_s1, rr[j]);
                    if (!TILED) prefetch_record(cache, ps, B, sl_[j], FP4 ? RIDX4::value_bytes : RIDX8::value_bytes, RIDX8::scale_bytes, true);
                }
                const int m = n - i >= 2 ? 2 : 1;
                if (m == 2)
                    simd::indexer_tokens<FP4, 2>(kk + i, rr + i, cs, cs_bf16, cs_s0, cs_s1, rope_dim, w, eps, rtab, thr, qp, sb, rs + i);
                else
                    simd::indexer_tokens<FP4, 1>(kk + i, rr + i, cs, cs_bf16, cs_s0, cs_s1, rope_dim, w, eps, rtab, thr, qp, sb, rs + i);
                for (int u = 0; u < m; ++u)
                    indexer_store_token<FP4, TILED>(qbuf[u], sb[u], cache + (sl_[i + u] / B) * ps, sl_[i + u] % B, B, N);
            }
            continue;
        }
#endif
        auto flush = [&](int n) {
            if (n == 2)
                tok::indexer_tokens<FP4, 2>(kr, row, cs, cs_bf16, cs_s0, cs_s1, rope_dim, w, eps, rtab, thr, qp, sb);
            else
                tok::indexer_tokens<FP4, 1>(kr, row, cs, cs_bf16, cs_s0, cs_s1, rope_dim, w, eps, rtab, thr, qp, sb);
            for (int u = 0; u < n; ++u)
                indexer_store_token<FP4, TILED>(qbuf[u], sb[u], cache + (slot[u] / B) * ps, slot[u] % B, B, N);
        };
        for (int64_t t = lo; t < hi; ++t) {
            if (t + PF < hi) {
                const int64_t sp = slots[t + PF], pp = positions[t + PF];
                if (sp >= 0 && (pp + 1) % CR == 0) {
                    prefetch_cs_row(cs, cs_bf16, cs_s0, cs_s1, (pp / CR) * CR);
                    if (!TILED) {
                        prefetch_record(cache, ps, B, sp, FP4 ? RIDX4::value_bytes : RIDX8::value_bytes, RIDX8::scale_bytes, true);
                    } else {
                        uint8_t* pg = cache + (sp / B) * ps;
                        const int64_t o = sp % B;
                        if (!FP4) {
                            uint8_t* base = pg + (o / 16) * (16 * IDX_D) + (o % 16) * 16;
                            for (int b = 0; b < IDX_D / 16; ++b) __builtin_prefetch(base + b * 256, 1, 3);
                            __builtin_prefetch(pg + B * IDX_D + o * 4, 1, 3);
                        } else {
                            uint8_t* base = pg + (o / N) * (N * 64) + (o % N) * 16;
                            for (int b = 0; b < 4; ++b) __builtin_prefetch(base + b * (N * 16), 1, 3);
                            prefetch_lines(pg + B * 64 + (o / N) * (N * 4), N * 4, true);
                        }
                    }
                }
            }
            const int64_t sl = slots[t];
            if (sl < 0) continue;
            const int64_t pos = positions[t];
            if ((pos + 1) % CR != 0) continue;
            kr[np] = k_pre + t * ks0;
            row[np] = (pos / CR) * CR;
            slot[np] = sl;
            if (++np == 2) {
                flush(2);
                np = 0;
            }
        }
        if (np) flush(np);
    }
}

}  // namespace

extern "C" {

int dsv41_cache_kernels_simd(void) { return DSV41_CPU_AVX512; }

int dsv41_quantize_insert_k(const uint16_t* k, int64_t ks0, uint8_t* cache, int64_t page_stride,
                            const int64_t* slots, int64_t T, int64_t block_size,
                            int32_t use_fnuz, int32_t bytes_per_token, int32_t interleaved) {
    if (T <= 0) return 0;
    if (block_size <= 0) return -1;
    if (bytes_per_token == 528) {
        const bool il = interleaved != 0;
        if (use_fnuz) quantize_insert_528<true>(k, ks0, cache, page_stride, slots, T, block_size, il);
        else quantize_insert_528<false>(k, ks0, cache, page_stride, slots, T, block_size, il);
    } else if (interleaved) {
        return -2;  // the 584 record has no interleaved layout
    } else {
        if (use_fnuz) quantize_insert_584<true>(k, ks0, cache, page_stride, slots, T, block_size);
        else quantize_insert_584<false>(k, ks0, cache, page_stride, slots, T, block_size);
    }
    return 0;
}

int dsv41_dequant_gather_k(uint16_t* out, int64_t os0, int64_t os1, const uint8_t* cache,
                           int64_t page_stride, int32_t width, const int32_t* seq_lens,
                           const int32_t* gather_lens, int64_t num_reqs, const int32_t* bt,
                           int64_t bts0, int64_t bts1, int64_t block_size, int64_t offset,
                           int32_t use_fnuz, int32_t interleaved) {
    if (num_reqs <= 0) return 0;
    if (block_size <= 0) return -1;
#define DSV41_G(W, F)                                                                          \
    gather_impl<W, F>(out, os0, os1, cache, page_stride, seq_lens, gather_lens, num_reqs, bt, \
                      bts0, bts1, block_size, offset, interleaved != 0)
    if (width == 584) {
        if (interleaved) return -2;  // the 584 record has no interleaved layout
        if (use_fnuz) DSV41_G(584, true); else DSV41_G(584, false);
    } else if (width == 528) {
        if (use_fnuz) DSV41_G(528, true); else DSV41_G(528, false);
    } else if (width == 288) {
        DSV41_G(288, false);
    } else {
        return -2;
    }
#undef DSV41_G
    return 0;
}

// kind: 0 = 584, 1 = 528, 2 = 288 (uint8 paged records; c_s0 = page bytes),
//       3 = plain bf16 rows, 4 = plain e4m3fn rows (c_s0 / c_s1 in elements).
// fp8_scale: the 1-element fp32 per-tensor scale of kind 4 (inv = 1/scale, IEEE fp32).
// interleaved: kinds 1 / 2 only, each token's scales right after its values (RecLayout).
int dsv41_rope_quant_insert(const uint16_t* latent, int64_t ls0, const int64_t* positions,
                            const void* cs, int32_t cs_bf16, int64_t cs_s0, int64_t cs_s1,
                            void* cache, int32_t kind, int64_t c_s0, int64_t c_s1,
                            const int64_t* slots, int64_t T, int64_t B, int64_t CR,
                            const float* fp8_scale, int32_t sanitize, int32_t interleaved) {
    if (T <= 0) return 0;
    if (B <= 0 || CR <= 0) return -1;
    if (interleaved && kind != RK_528 && kind != RK_288) return -2;  // only 528 / 288 interleave
    const float inv = fp8_scale ? 1.0f / fp8_scale[0] : 1.0f;
#define DSV41_R(K)                                                                          \
    rope_quant_insert_impl<K>(latent, ls0, positions, cs, cs_bf16, cs_s0, cs_s1, cache, c_s0, \
                              c_s1, slots, T, B, CR, inv, sanitize != 0, interleaved != 0)
    switch (kind) {
        case RK_584: DSV41_R(RK_584); break;
        case RK_528: DSV41_R(RK_528); break;
        case RK_288: DSV41_R(RK_288); break;
        case RK_BF16: DSV41_R(RK_BF16); break;
        case RK_FP8: DSV41_R(RK_FP8); break;
        default: return -2;
    }
#undef DSV41_R
    return 0;
}

int dsv41_indexer_k_store(const uint16_t* k_pre, int64_t ks0, const int64_t* positions,
                          const void* cs, int32_t cs_bf16, int64_t cs_s0, int64_t cs_s1,
                          int32_t rope_dim, const float* w, float eps, const int32_t* rtab,
                          uint8_t* cache, int64_t page_stride, int64_t B, const int64_t* slots,
                          int64_t T, int64_t CR, int32_t use_fp4, int32_t tiled, int64_t n_per_tile) {
    if (T <= 0) return 0;
    if (B <= 0 || CR <= 0) return -1;
    if (rope_dim <= 0 || rope_dim > IDX_D || rope_dim % 2 || (IDX_D - rope_dim) % 2) return -2;
#define DSV41_I(F, TL)                                                                        \
    indexer_k_store_impl<F, TL>(k_pre, ks0, positions, cs, cs_bf16, cs_s0, cs_s1, rope_dim, w, \
                                eps, rtab, cache, page_stride, B, slots, T, CR, n_per_tile)
    if (use_fp4) {
        if (tiled) {
            if ((n_per_tile != 16 && n_per_tile != 32 && n_per_tile != 64) || B % n_per_tile) return -3;
            DSV41_I(true, true);
        } else {
            DSV41_I(true, false);
        }
    } else {
        if (tiled) {
            if (B % 16) return -3;
            DSV41_I(false, true);
        } else {
            DSV41_I(false, false);
        }
    }
#undef DSV41_I
    return 0;
}

// ----------------------------------------------------------- codec entry points (tests)
void dsv41_codec_e4m3_encode(const float* x, uint8_t* out, int64_t n, int32_t fnuz) {
    if (fnuz) for (int64_t i = 0; i < n; ++i) out[i] = e4m3fnuz_encode(x[i]);
    else for (int64_t i = 0; i < n; ++i) out[i] = e4m3fn_encode(x[i]);
}
void dsv41_codec_e4m3_decode(const uint8_t* b, float* out, int64_t n, int32_t fnuz,
                             int32_t use_table) {
    const E4m3Tables& t = e4m3_tables();
    for (int64_t i = 0; i < n; ++i) {
        if (use_table) out[i] = fnuz ? t.fnuz[b[i]] : t.ocp[b[i]];
        else out[i] = fnuz ? e4m3fnuz_decode(b[i]) : e4m3fn_decode(b[i]);
    }
}
void dsv41_codec_e2m1_encode(const float* x, uint8_t* out, int64_t n) {
    for (int64_t i = 0; i < n; ++i) out[i] = e2m1_encode(x[i]);
}
void dsv41_codec_bf16_rne(const float* x, uint16_t* out, int64_t n, int32_t nan_bits) {
    for (int64_t i = 0; i < n; ++i) out[i] = f32_to_bf16_rne_nan(x[i], (uint16_t)nan_bits);
}
void dsv41_codec_ceil_log2(const float* x, float* out, int64_t n, int32_t slow) {
    const uint32_t* thr = ceil_log2_table().thr;
    for (int64_t i = 0; i < n; ++i) out[i] = slow ? ceil_log2_slow(x[i]) : ceil_log2(x[i], thr);
}
void dsv41_codec_exp2i(const float* x, float* out, int64_t n) {
    for (int64_t i = 0; i < n; ++i) out[i] = exp2i(x[i]);
}
void dsv41_codec_clamp_sym(const float* x, float* out, int64_t n, float m) {
    for (int64_t i = 0; i < n; ++i) out[i] = clamp_sym(x[i], m);
}

// AVX-512 twins (n a multiple of 16); return -1 when they were not compiled in.
int dsv41_codec_v16_e4m3_encode(const float* x, uint8_t* out, int64_t n, int32_t fnuz,
                                uint32_t sat_bits, uint32_t nan_code) {
#if DSV41_CPU_AVX512
    for (int64_t i = 0; i + 16 <= n; i += 16) {
        const __m512 v = _mm512_loadu_ps(x + i);
        const __m128i r = fnuz ? v16_e4m3_encode<true>(v, sat_bits, nan_code)
                               : v16_e4m3_encode<false>(v, sat_bits, nan_code);
        _mm_storeu_si128((__m128i*)(out + i), r);
    }
    return 0;
#else
    (void)x, (void)out, (void)n, (void)fnuz, (void)sat_bits, (void)nan_code;
    return -1;
#endif
}
int dsv41_codec_v16_e4m3_decode(const uint8_t* b, float* out, int64_t n, int32_t fnuz) {
#if DSV41_CPU_AVX512
    for (int64_t i = 0; i + 16 <= n; i += 16) {
        const __m128i v = _mm_loadu_si128((const __m128i*)(b + i));
        _mm512_storeu_ps(out + i, fnuz ? v16_e4m3_decode<true>(v) : v16_e4m3_decode<false>(v));
    }
    return 0;
#else
    (void)b, (void)out, (void)n, (void)fnuz;
    return -1;
#endif
}
int dsv41_codec_v16_e2m1_encode(const float* x, uint8_t* out, int64_t n) {
#if DSV41_CPU_AVX512
    for (int64_t i = 0; i + 16 <= n; i += 16)
        _mm_storeu_si128((__m128i*)(out + i), _mm512_cvtepi32_epi8(v16_e2m1_encode(_mm512_loadu_ps(x + i))));
    return 0;
#else
    (void)x, (void)out, (void)n;
    return -1;
#endif
}
int dsv41_codec_v16_bf16(const float* x, uint16_t* out, int64_t n, int32_t torch_nan) {
#if DSV41_CPU_AVX512
    for (int64_t i = 0; i + 16 <= n; i += 16) {
        const __m512 v = _mm512_loadu_ps(x + i);
        _mm256_storeu_si256((__m256i*)(out + i), torch_nan ? v16_bf16_torch(v) : v16_bf16_canon(v));
    }
    return 0;
#else
    (void)x, (void)out, (void)n, (void)torch_nan;
    return -1;
#endif
}
int dsv41_codec_v16_ceil_log2(const float* x, int32_t* out, int64_t n) {
#if DSV41_CPU_AVX512
    const uint32_t* thr = ceil_log2_table().thr;
    for (int64_t i = 0; i + 16 <= n; i += 16)
        _mm512_storeu_si512(out + i, v16_ceil_log2_pos(_mm512_loadu_ps(x + i), thr));
    return 0;
#else
    (void)x, (void)out, (void)n;
    return -1;
#endif
}

}  // extern "C"
