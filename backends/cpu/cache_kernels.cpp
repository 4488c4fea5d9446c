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
        uint32_t am = 0;
        for (int i = 0; i < G; ++i) {
            uint32_t a = bits(xg[i]) & 0x7FFFFFFFu;
            a = a > 0x7F800000u ? 0u : a;
            am = am > a ? am : a;
        }
        float amax = from_bits(am);
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
        uint32_t am = 0;
        for (int i = 0; i < 16; ++i) {
            uint32_t a = bits(xg[i]) & 0x7FFFFFFFu;
            a = a > 0x7F800000u ? 0u : a;
            am = am > a ? am : a;
        }
        float sf = from_bits(am) * INV_6;
        sf = sf < 0x1p-9f ? 0x1p-9f : sf;
        sf = sf > 448.0f ? 448.0f : sf;
        uint8_t sb = e4m3fn_encode(sf);
        float S = e4m3fn_decode(sb);
        scales[g] = sb;
        uint8_t codes[16];
        for (int i = 0; i < 16; ++i) {
            float y = xg[i] / S;
            codes[i] = y != y ? (uint8_t)7 : e2m1_encode(y);
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
