// dsv41 CPU kernels for the paged K caches (spec cache_ops.md §1-§4, §8.2; rope_quant_ops.md §3).
//
//   dsv41_quantize_insert_k      quantize_and_insert_k_cache   (584 / 528, OCP / FNUZ)
//   dsv41_dequant_gather_k       dequantize_and_gather_k_cache (584 / 528 / 288, OCP / FNUZ)
//   dsv41_rope_quant_insert      rope_quant_insert             (584 / 528 / 288 / bf16 rows / fp8 rows)
//   dsv41_indexer_k_store        indexer_k_norm_rope_store     (FP8 / MXFP4, row-major / tiled)
//   dsv41_codec_*                element-wise entry points of common.h, for the tests
//
// Conventions: raw pointers (already offset by the tensor's storage offset), strides in
// elements of the pointed-to type (page strides of uint8 caches in bytes), int64 sizes.
// Every kernel parallelizes over tokens with OpenMP (schedule(static)); the per-token work
// runs over dims in plain loops the compiler vectorizes.  Negative slots are skipped.
// Nothing outside a token's record bytes is touched (page padding stays as it was).

#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "common.h"

// Full-width AVX-512 vectors for the per-dim loops (gcc's default tuning on AVX-512 parts
// is 256-bit).  A tuning option only: results are identical.
#if defined(__AVX512F__) && defined(__GNUC__) && !defined(__clang__)
#pragma GCC target("prefer-vector-width=512")
#endif

using namespace dsv41cpu;

namespace {

constexpr int HEAD = 512;

// ---------------------------------------------------------------------------------------
// UE8M0-scaled FP8 group quantizer (spec cache_ops §2.1, §2.4, §2.5, finding 3)
// ---------------------------------------------------------------------------------------
// x: NG*G fp32 values; q: NG*G e4m3 bytes; codes: NG bytes.
// amax ignores NaN (it is taken on the bit patterns of |x|, NaN bit patterns are dropped;
// for non-negative non-NaN floats the integer order is the numeric order).
template <int G, int NG, bool FNUZ>
static inline void quant_ue8m0(const float* __restrict x, uint8_t* __restrict q,
                               uint8_t* __restrict codes, bool sanitize,
                               const uint32_t* thr) {
    const float M = FNUZ ? 224.0f : 448.0f;
    const float C = FNUZ ? INV_224 : INV_448;
    for (int g = 0; g < NG; ++g) {
        const float* xg = x + g * G;
        float amax = absmax_ignore_nan(xg, G);
        amax = amax > F32_1E_4 ? amax : F32_1E_4;
        float e = ceil_log2(amax * C, thr);
        float s = exp2i(-e);
        uint8_t* qg = q + g * G;
        for (int i = 0; i < G; ++i) qg[i] = e4m3_encode<FNUZ>(clamp_nan_pos(xg[i] * s, M));
        float c = e + 127.0f;
        c = c < 0.0f ? 0.0f : c;
        float hi = sanitize ? 254.0f : 255.0f;
        c = c > hi ? hi : c;
        codes[g] = (uint8_t)(int)c;
    }
}

// NVFP4 groups of 16 (spec cache_ops §2.3).  NaN is ignored in the amax and a NaN element
// encodes as +6 (code 0x7: cvt.rn.satfinite to a format without NaN), as the reference of
// rope_quant_insert (dsv41/reference/compress.py) does.
template <int NG>
static inline void quant_nvfp4(const float* __restrict x, uint8_t* __restrict packed,
                               uint8_t* __restrict scales) {
    for (int g = 0; g < NG; ++g) {
        const float* xg = x + g * 16;
        float sf = absmax_ignore_nan(xg, 16) * INV_6;
        sf = sf < 0x1p-9f ? 0x1p-9f : sf;
        sf = sf > 448.0f ? 448.0f : sf;
        uint8_t sb = e4m3fn_encode(sf);
        float S = e4m3fn_decode(sb);
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

static inline void bf16_row_to_f32(const uint16_t* __restrict src, float* __restrict dst, int n) {
    for (int i = 0; i < n; ++i) dst[i] = bf16_to_f32(src[i]);
}

// ---------------------------------------------------------------------------------------
// quantize_and_insert_k_cache
// ---------------------------------------------------------------------------------------
template <bool FNUZ>
static void quantize_insert_584(const uint16_t* k, int64_t ks0, uint8_t* cache, int64_t ps,
                                const int64_t* slots, int64_t T, int64_t B) {
    const uint32_t* thr = ceil_log2_table().thr;
#pragma omp parallel for schedule(static)
    for (int64_t t = 0; t < T; ++t) {
        int64_t slot = slots[t];
        if (slot < 0) continue;
        int64_t blk = slot / B, o = slot % B;
        uint8_t* page = cache + blk * ps;
        const uint16_t* row = k + t * ks0;
        alignas(64) float x[448];
        bf16_row_to_f32(row, x, 448);
        uint8_t* val = page + o * 576;
        uint8_t* sc = page + B * 576 + o * 8;
        quant_ue8m0<64, 7, FNUZ>(x, val, sc, false, thr);
        sc[7] = 0;
        std::memcpy(val + 448, row + 448, 128);
    }
}

template <bool FNUZ>
static void quantize_insert_528(const uint16_t* k, int64_t ks0, uint8_t* cache, int64_t ps,
                                const int64_t* slots, int64_t T, int64_t B) {
    const uint32_t* thr = ceil_log2_table().thr;
#pragma omp parallel for schedule(static)
    for (int64_t t = 0; t < T; ++t) {
        int64_t slot = slots[t];
        if (slot < 0) continue;
        int64_t blk = slot / B, o = slot % B;
        uint8_t* page = cache + blk * ps;
        alignas(64) float x[HEAD];
        bf16_row_to_f32(k + t * ks0, x, HEAD);
        quant_ue8m0<32, 16, FNUZ>(x, page + o * 512, page + B * 512 + o * 16, false, thr);
    }
}

// ---------------------------------------------------------------------------------------
// Record decoders (spec cache_ops §2.2, §2.3, finding 1) -> bf16 bits
// ---------------------------------------------------------------------------------------
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

static inline void decode_nvfp4(const uint8_t* __restrict v, const uint8_t* __restrict scales,
                                uint16_t* __restrict out, const float* __restrict lut) {
    for (int g = 0; g < 32; ++g) {
        const float S = e4m3fn_decode(scales[g]);
        const uint8_t* vg = v + g * 8;
        uint16_t* og = out + g * 16;
        for (int i = 0; i < 8; ++i) {
            uint8_t b = vg[i];
            og[2 * i] = f32_to_bf16_rne_canon(lut[b & 15] * S);
            og[2 * i + 1] = f32_to_bf16_rne_canon(lut[b >> 4] * S);
        }
    }
}

template <int W, bool FNUZ>
static void gather_impl(uint16_t* out, int64_t os0, int64_t os1, const uint8_t* cache, int64_t ps,
                        const int32_t* seq_lens, const int32_t* gather_lens, int64_t R,
                        const int32_t* bt, int64_t bts0, int64_t bts1, int64_t B,
                        int64_t offset) {
    std::vector<int64_t> first(R + 1);
    first[0] = 0;
    for (int64_t r = 0; r < R; ++r) {
        int64_t n = gather_lens ? gather_lens[r] : seq_lens[r];
        first[r + 1] = first[r] + (n > 0 ? n : 0);
    }
    const int64_t total = first[R];
    if (total == 0) return;
    const float* lut = e2m1_tables().plus_zero;
#pragma omp parallel
    {
        const int nt = omp_get_num_threads(), tid = omp_get_thread_num();
        const int64_t lo = total * tid / nt, hi = total * (tid + 1) / nt;
        if (lo < hi) {
            int64_t r = std::upper_bound(first.begin(), first.end(), lo) - first.begin() - 1;
            for (int64_t idx = lo; idx < hi; ++idx) {
                while (idx >= first[r + 1]) ++r;
                const int64_t i = idx - first[r];
                const int64_t L = seq_lens[r];
                const int64_t n = first[r + 1] - first[r];
                const int64_t p = L - n + i;
                const int64_t blk = bt[r * bts0 + (p / B) * bts1];
                const int64_t o = p % B;
                const uint8_t* page = cache + blk * ps;
                uint16_t* dst = out + r * os0 + (offset + i) * os1;
                if (W == 584) {
                    decode_ue8m0<64, 7, FNUZ>(page + o * 576, page + B * 576 + o * 8, dst);
                    std::memcpy(dst + 448, page + o * 576 + 448, 128);
                } else if (W == 528) {
                    decode_ue8m0<32, 16, FNUZ>(page + o * 512, page + B * 512 + o * 16, dst);
                } else {
                    decode_nvfp4(page + o * 256, page + B * 256 + o * 32, dst, lut);
                }
            }
        }
    }
}

// ---------------------------------------------------------------------------------------
// cos/sin rows (rope_quant_ops §1.1): fp32 or bf16 cache, cols [0, P) cos, [P, 2P) sin.
// ---------------------------------------------------------------------------------------
static inline void load_cos_sin(const void* cs, int32_t cs_bf16, int64_t s0, int64_t s1,
                                int64_t row, int P, float* __restrict c, float* __restrict s) {
    if (cs_bf16) {
        const uint16_t* r = (const uint16_t*)cs + row * s0;
        for (int i = 0; i < P; ++i) {
            c[i] = bf16_to_f32(r[i * s1]);
            s[i] = bf16_to_f32(r[(P + i) * s1]);
        }
    } else {
        const float* r = (const float*)cs + row * s0;
        for (int i = 0; i < P; ++i) {
            c[i] = r[i * s1];
            s[i] = r[(P + i) * s1];
        }
    }
}

// GPT-J RoPE with the canonical contraction (rope_quant_ops §1.2):
// e' = fma(e, c, -fl32(o*s)), o' = fma(o, c, fl32(e*s)), over P pairs starting at x[0].
static inline void rope_pairs(const float* __restrict x, float* __restrict y,
                              const float* __restrict c, const float* __restrict s, int P) {
    for (int i = 0; i < P; ++i) {
        const float e = x[2 * i], o = x[2 * i + 1];
        y[2 * i] = std::fma(e, c[i], -(o * s[i]));
        y[2 * i + 1] = std::fma(o, c[i], e * s[i]);
    }
}

// The NoPE "identity" rotation with (cos, sin) = (1, 0) (finding 2):
// e' = fma(e, 1, -(o*0)) = e + -(o*0), o' = fma(o, 1, e*0) = o + e*0 (fma(a,1,b) == a+b
// exactly).  Flips some zero signs and turns a lane with a ±inf/NaN partner into NaN.
static inline void nope_pairs(const float* __restrict x, float* __restrict y, int P) {
    for (int i = 0; i < P; ++i) {
        const float e = x[2 * i], o = x[2 * i + 1];
        y[2 * i] = e + -(o * 0.0f);
        y[2 * i + 1] = o + e * 0.0f;
    }
}

enum RopeKind { RK_584 = 0, RK_528 = 1, RK_288 = 2, RK_BF16 = 3, RK_FP8 = 4 };

template <int KIND>
static void rope_quant_insert_impl(const uint16_t* latent, int64_t ls0, const int64_t* positions,
                                   const void* cs, int32_t cs_bf16, int64_t cs_s0, int64_t cs_s1,
                                   void* cache, int64_t c_s0, int64_t c_s1, const int64_t* slots,
                                   int64_t T, int64_t B, int64_t CR, float inv_scale,
                                   bool sanitize) {
    const uint32_t* thr = ceil_log2_table().thr;
#pragma omp parallel for schedule(static)
    for (int64_t t = 0; t < T; ++t) {
        const int64_t slot = slots[t];
        if (slot < 0) continue;
        const int64_t pos = positions[t];
        if ((pos + 1) % CR != 0) continue;
        const int64_t page = slot / B, o = slot % B;
        alignas(64) float x[HEAD];
        alignas(64) float rot[HEAD];
        alignas(64) float c[32], s[32];
        bf16_row_to_f32(latent + t * ls0, x, HEAD);
        load_cos_sin(cs, cs_bf16, cs_s0, cs_s1, (pos / CR) * CR, 32, c, s);
        if (KIND != RK_584) nope_pairs(x, rot, 224);
        rope_pairs(x + 448, rot + 448, c, s, 32);
        if (sanitize) {
            const int lo = KIND == RK_584 ? 448 : 0;
            for (int d = lo; d < HEAD; ++d) rot[d] = rot[d] != rot[d] ? 0.0f : rot[d];
        }
        if (KIND == RK_584) {
            uint8_t* pg = (uint8_t*)cache + page * c_s0;
            uint8_t* val = pg + o * 576;
            uint8_t* sc = pg + B * 576 + o * 8;
            quant_ue8m0<64, 7, false>(x, val, sc, sanitize, thr);
            sc[7] = 0;
            alignas(64) uint16_t tail[64];
            for (int d = 0; d < 64; ++d) tail[d] = f32_to_bf16_rne_canon(rot[448 + d]);
            std::memcpy(val + 448, tail, 128);
        } else if (KIND == RK_528) {
            uint8_t* pg = (uint8_t*)cache + page * c_s0;
            quant_ue8m0<32, 16, false>(rot, pg + o * 512, pg + B * 512 + o * 16, sanitize, thr);
        } else if (KIND == RK_288) {
            uint8_t* pg = (uint8_t*)cache + page * c_s0;
            quant_nvfp4<32>(rot, pg + o * 256, pg + B * 256 + o * 32);
        } else if (KIND == RK_BF16) {
            uint16_t* dst = (uint16_t*)cache + page * c_s0 + o * c_s1;
            for (int d = 0; d < HEAD; ++d) dst[d] = f32_to_bf16_rne_canon(rot[d]);
        } else {
            uint8_t* dst = (uint8_t*)cache + page * c_s0 + o * c_s1;
            for (int d = 0; d < HEAD; ++d) {
                const float y = bf16_to_f32(f32_to_bf16_rne_canon(rot[d])) * inv_scale;
                dst[d] = e4m3fn_encode(clamp_nan_pos(y, 448.0f));
            }
        }
    }
}

// ---------------------------------------------------------------------------------------
// indexer_k_norm_rope_store (rope_quant_ops §3)
// ---------------------------------------------------------------------------------------
constexpr int IDX_D = 128;

template <bool FP4, bool TILED>
static void indexer_k_store_impl(const uint16_t* k_pre, int64_t ks0, const int64_t* positions,
                                 const void* cs, int32_t cs_bf16, int64_t cs_s0, int64_t cs_s1,
                                 int rope_dim, const float* w, float eps, uint8_t* cache,
                                 int64_t ps, int64_t B, const int64_t* slots, int64_t T,
                                 int64_t CR, int64_t N) {
    const uint32_t* thr = ceil_log2_table().thr;
    const int nope = IDX_D - rope_dim;
    const int P = rope_dim / 2;
#pragma omp parallel for schedule(static)
    for (int64_t t = 0; t < T; ++t) {
        const int64_t slot = slots[t];
        if (slot < 0) continue;
        const int64_t pos = positions[t];
        if ((pos + 1) % CR != 0) continue;
        const int64_t o = slot % B;
        uint8_t* pg = cache + (slot / B) * ps;
        alignas(64) float k[IDX_D], kn[IDX_D], kr[IDX_D];
        alignas(64) float c[IDX_D / 2], s[IDX_D / 2];
        bf16_row_to_f32(k_pre + t * ks0, k, IDX_D);
        // RMSNorm (§3.3 step 2), as the reference: squares exact in float64, summed in
        // float64 (8 lanes, then pairwise), rounded once; /128 exact; rsqrt = fl32 of the
        // float64 1/sqrt.  Every k_d^2 is exact and the float64 sum is exact unless the
        // squares span more than ~2^37, so the order does not matter in practice.
        double acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
        for (int i = 0; i < IDX_D; i += 8)
            for (int l = 0; l < 8; ++l) acc[l] += (double)k[i + l] * (double)k[i + l];
        const double ss = ((acc[0] + acc[4]) + (acc[2] + acc[6])) + ((acc[1] + acc[5]) + (acc[3] + acc[7]));
        const float var = (float)ss / 128.0f;
        const float v = var + eps;
        const float r = (float)(1.0 / std::sqrt((double)v));
        for (int d = 0; d < IDX_D; ++d) kn[d] = rnbf16_torch((k[d] * r) * w[d]);
        // RoPE at the group's first position; NoPE pairs rotate by (1, 0) (finding 2).
        load_cos_sin(cs, cs_bf16, cs_s0, cs_s1, (pos / CR) * CR, P, c, s);
        nope_pairs(kn, kr, nope / 2);
        rope_pairs(kn + nope, kr + nope, c, s, P);
        for (int d = 0; d < IDX_D; ++d) kr[d] = rnbf16_torch(kr[d]);
        if (!FP4) {
            float amax = absmax_ignore_nan(kr, IDX_D);
            amax = amax > F32_1E_4 ? amax : F32_1E_4;
            const float e = ceil_log2(amax * INV_448, thr);
            const float sc = exp2i(-e);
            alignas(64) uint8_t q[IDX_D];
            for (int i = 0; i < IDX_D; ++i) q[i] = e4m3fn_encode(clamp_sym(kr[i] * sc, 448.0f));
            if (TILED) {  // [B/16][128/16][16][16]
                uint8_t* base = pg + (o / 16) * (16 * IDX_D) + (o % 16) * 16;
                for (int b = 0; b < IDX_D / 16; ++b) std::memcpy(base + b * 256, q + b * 16, 16);
            } else {
                std::memcpy(pg + o * IDX_D, q, IDX_D);
            }
            const float scale = exp2i(e);
            std::memcpy(pg + B * IDX_D + o * 4, &scale, 4);
        } else {
            alignas(64) uint8_t packed[IDX_D / 2];
            uint8_t sb[4];
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
                    packed[b * 16 + i] = (uint8_t)(codes[2 * i] | (codes[2 * i + 1] << 4));
                sb[b] = (uint8_t)(int)(e + 127.0f);
            }
            uint8_t* sbase = pg + B * 64;
            if (TILED) {  // aiter preshuffle, N tokens per tile (rope_quant_ops §3.4)
                const int64_t g = o / N, l = o % N;
                uint8_t* base = pg + g * (N * 64) + l * 16;
                for (int b = 0; b < 4; ++b) std::memcpy(base + b * (N * 16), packed + b * 16, 16);
                const int64_t s_lo = 64 / N, s_hi = 4 / s_lo;
                for (int j = 0; j < 4; ++j)
                    sbase[g * (N * 4) + (j % s_lo) * (N * s_hi) + l * s_hi + j / s_lo] = sb[j];
            } else {
                std::memcpy(pg + o * 64, packed, 64);
                std::memcpy(sbase + o * 4, sb, 4);
            }
        }
    }
}

}  // namespace

extern "C" {

int dsv41_quantize_insert_k(const uint16_t* k, int64_t ks0, uint8_t* cache, int64_t page_stride,
                            const int64_t* slots, int64_t T, int64_t block_size,
                            int32_t use_fnuz, int32_t bytes_per_token) {
    if (T <= 0) return 0;
    if (bytes_per_token == 528) {
        if (use_fnuz) quantize_insert_528<true>(k, ks0, cache, page_stride, slots, T, block_size);
        else quantize_insert_528<false>(k, ks0, cache, page_stride, slots, T, block_size);
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
                           int32_t use_fnuz) {
    if (num_reqs <= 0) return 0;
#define DSV41_G(W, F)                                                                          \
    gather_impl<W, F>(out, os0, os1, cache, page_stride, seq_lens, gather_lens, num_reqs, bt, \
                      bts0, bts1, block_size, offset)
    if (width == 584) {
        if (use_fnuz) DSV41_G(584, true); else DSV41_G(584, false);
    } else if (width == 528) {
        if (use_fnuz) DSV41_G(528, true); else DSV41_G(528, false);
    } else if (width == 288) {
        DSV41_G(288, false);
    } else {
        return -1;
    }
#undef DSV41_G
    return 0;
}

// kind: 0 = 584, 1 = 528, 2 = 288 (uint8 paged records; c_s0 = page bytes),
//       3 = plain bf16 rows, 4 = plain e4m3fn rows (c_s0 / c_s1 in elements).
int dsv41_rope_quant_insert(const uint16_t* latent, int64_t ls0, const int64_t* positions,
                            const void* cs, int32_t cs_bf16, int64_t cs_s0, int64_t cs_s1,
                            void* cache, int32_t kind, int64_t c_s0, int64_t c_s1,
                            const int64_t* slots, int64_t T, int64_t B, int64_t CR,
                            const float* fp8_scale, int32_t sanitize) {
    if (T <= 0) return 0;
    const float inv = fp8_scale ? 1.0f / fp8_scale[0] : 1.0f;
#define DSV41_R(K)                                                                          \
    rope_quant_insert_impl<K>(latent, ls0, positions, cs, cs_bf16, cs_s0, cs_s1, cache, c_s0, \
                              c_s1, slots, T, B, CR, inv, sanitize != 0)
    switch (kind) {
        case RK_584: DSV41_R(RK_584); break;
        case RK_528: DSV41_R(RK_528); break;
        case RK_288: DSV41_R(RK_288); break;
        case RK_BF16: DSV41_R(RK_BF16); break;
        case RK_FP8: DSV41_R(RK_FP8); break;
        default: return -1;
    }
#undef DSV41_R
    return 0;
}

int dsv41_indexer_k_store(const uint16_t* k_pre, int64_t ks0, const int64_t* positions,
                          const void* cs, int32_t cs_bf16, int64_t cs_s0, int64_t cs_s1,
                          int32_t rope_dim, const float* w, float eps, uint8_t* cache,
                          int64_t page_stride, int64_t B, const int64_t* slots, int64_t T,
                          int64_t CR, int32_t use_fp4, int32_t tiled, int64_t n_per_tile) {
    if (T <= 0) return 0;
    if (rope_dim <= 0 || rope_dim > IDX_D || rope_dim % 2) return -1;
#define DSV41_I(F, TL)                                                                        \
    indexer_k_store_impl<F, TL>(k_pre, ks0, positions, cs, cs_bf16, cs_s0, cs_s1, rope_dim, w, \
                                eps, cache, page_stride, B, slots, T, CR, n_per_tile)
    if (use_fp4) {
        if (tiled) {
            if (n_per_tile != 16 && n_per_tile != 32 && n_per_tile != 64) return -2;
            DSV41_I(true, true);
        } else {
            DSV41_I(true, false);
        }
    } else {
        if (tiled) {
            if (B % 16) return -2;
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

}  // extern "C"
