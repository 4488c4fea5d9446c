// dsv41 CPU kernels: RoPE / quantization ops and the V4.1 compressor pooling.
//
//   fused_save_compress_norm    cache_ops.md §8.1      (reference: dsv41/reference/compress.py)
//   fused_indexer_q_rope_quant  rope_quant_ops.md §2   (reference: dsv41/reference/indexer.py)
//   fused_inv_rope_fp8_quant    rope_quant_ops.md §4   (reference: dsv41/reference/output_quant.py)
//   fused_q_kv_rmsnorm_quant    rope_quant_ops.md §5   (same)
//   pad_fused_q_heads           rope_quant_ops.md §6.3 (same)
//
// Every output byte equals the reference's.  fp32 arithmetic is written out operation by
// operation (the build uses -ffp-contract=off; fmaf() appears exactly where the spec fuses).
// The reference's float64 steps are done in double here as well:
//   * sums of squares: float64 accumulation rounded once to fp32 (the summation order differs
//     from torch's, which can only matter when the exact sum lies within ~2^-45 (relative) of an
//     fp32 rounding boundary);
//   * rsqrt: fl32(1 / sqrt(double)), the very expression torch evaluates;
//   * exp (compressor softmax): fl32(2^y) with y = fl32(z * fl32(log2 e)); 2^y is evaluated in
//     double by a degree-13 polynomial (error of a few double ulps, like libm / SLEEF), then
//     rounded once to fp32.
// Parallelism: OpenMP over tokens / rows; the inner loops are branch-free and vectorize.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <utility>
#include <vector>

#include "common.h"

using namespace dsv41cpu;

namespace {

constexpr int64_t kParallelMinBytes = 1 << 16;  // below this much work: one thread

inline int64_t load_index(const void* p, int64_t i, int64_t stride, bool is64) {
    return is64 ? ((const int64_t*)p)[i * stride] : (int64_t)((const int32_t*)p)[i * stride];
}

inline float load_float(const void* p, int64_t i, bool is_bf16) {
    return is_bf16 ? bf16_to_f32(((const uint16_t*)p)[i]) : ((const float*)p)[i];
}

// fp32 -> bf16 bits, round to nearest even; every NaN -> nan_bits.  0x7FFF is the GPU's
// canonical NaN (what the reference stores, finding 3); 0xFFFF is what torch's CPU cast
// writes (so what a reference copy_ into a bf16 tensor / codecs.rnbf16 yields).
inline uint16_t rk_bf16(float f, uint32_t nan_bits) {
    const uint32_t b = bits(f);
    const uint32_t r = (b + 0x7FFFu + ((b >> 16) & 1u)) >> 16;
    return (uint16_t)((b & 0x7FFFFFFFu) > 0x7F800000u ? nan_bits : r);
}
inline uint16_t rk_bf16_canon(float f) { return rk_bf16(f, 0x7FFFu); }
inline uint16_t rk_bf16_torch(float f) { return rk_bf16(f, 0xFFFFu); }
inline float rn_bf16(float f) { return bf16_to_f32(rk_bf16_torch(f)); }

// bits of |x| with NaN -> 0: a max over these (integer compare) is the NaN-ignoring amax.
inline uint32_t abs_bits_nonan(float x) {
    const uint32_t a = bits(x) & 0x7FFFFFFFu;
    return a > 0x7F800000u ? 0u : a;
}

inline float amax_nonan(const float* x, int64_t n) {
    uint32_t m = 0;
    for (int64_t i = 0; i < n; ++i) {
        const uint32_t a = abs_bits_nonan(x[i]);
        m = a > m ? a : m;
    }
    return from_bits(m);
}

// 2^-E for an integer-valued scale exponent E (as float), such that x * inv == x / exp2i(E)
// for every x: both are the correctly rounded x * 2^-E while 2^-E is representable
// (-149 <= -E), and exp2i(E) = inf (E >= 128, inf) pairs with 0 (x/inf == x*0 incl. NaN).
inline float inv_pow2(float E) {
    if (E != E) return E;
    if (E >= 128.0f) return 0.0f;
    return std::ldexp(1.0f, -(int)E);
}

// ---------------------------------------------------------------- exp for the compressor
// fl32(2^y) for fp32 y, evaluated in double: y = n + f (n = rint(y), |f| <= 1/2),
// 2^f by its Taylor series in f·ln2 to degree 13 (truncation < 5e-18 relative), Horner with
// fma, then an exact scaling by 2^n and one rounding to fp32.
struct Exp2Poly {
    double c[14];
    constexpr Exp2Poly() : c() {
        const double ln2 = 0.693147180559945309417232121458176568;
        double t = 1.0;
        for (int k = 0; k < 14; ++k) {
            c[k] = t;
            t = t * ln2 / (double)(k + 1);
        }
    }
};
constexpr Exp2Poly kExp2{};

inline float exp2_f32(float y) {
    const double yd = (double)y;
    const bool nan = y != y;
    double yc = yd < -200.0 ? -200.0 : yd;  // 2^-200 rounds to fp32 +0, 2^200 to +inf
    yc = yc > 200.0 ? 200.0 : yc;
    yc = nan ? 0.0 : yc;
    const double n = std::rint(yc);
    const double f = yc - n;  // exact
    double p = kExp2.c[13];
    for (int k = 12; k >= 0; --k) p = std::fma(p, f, kExp2.c[k]);
    const int64_t ni = (int64_t)n;
    double scale;
    const uint64_t sb = (uint64_t)(ni + 1023) << 52;
    std::memcpy(&scale, &sb, 8);
    const float r = (float)(p * scale);
    return nan ? y : r;
}

constexpr float kLog2eF32 = 0x1.715476p+0f;  // fl32(log2 e) = 0x3FB8AA3B

// fl32(sum x_i^2) with the squares and the sum in double (8 independent partial sums).
inline float sum_sq_f32(const float* x, int64_t n) {
    double acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
    int64_t i = 0;
    for (; i + 8 <= n; i += 8)
        for (int k = 0; k < 8; ++k) {
            const double v = (double)x[i + k];
            acc[k] += v * v;
        }
    for (; i < n; ++i) {
        const double v = (double)x[i];
        acc[0] += v * v;
    }
    return (float)(((acc[0] + acc[4]) + (acc[1] + acc[5])) + ((acc[2] + acc[6]) + (acc[3] + acc[7])));
}

inline double sum_sq_f64(const float* x, int64_t n) {
    double acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
    int64_t i = 0;
    for (; i + 8 <= n; i += 8)
        for (int k = 0; k < 8; ++k) {
            const double v = (double)x[i + k];
            acc[k] += v * v;
        }
    for (; i < n; ++i) {
        const double v = (double)x[i];
        acc[0] += v * v;
    }
    return ((acc[0] + acc[4]) + (acc[1] + acc[5])) + ((acc[2] + acc[6]) + (acc[3] + acc[7]));
}

// torch.searchsorted(bd[0:n], v, right=True) on an int64 array (ATen's bisection).
inline int64_t upper_bound_i64(const int64_t* bd, int64_t n, int64_t v) {
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

inline int64_t floor_mod(int64_t a, int64_t b) {
    int64_t r = a % b;
    return (r != 0 && ((r < 0) != (b < 0))) ? r + b : r;
}

constexpr int HEAD = 512;

// latent = bf16(x * rsqrt(sum x^2 / 512 + eps) * w), canonical NaN (C §8.1).
inline void rmsnorm512_store(const float* x, const float* w, float eps, uint16_t* dst) {
    const float ss = sum_sq_f32(x, HEAD);
    const float var = ss / 512.0f + eps;
    const float r = (float)(1.0 / std::sqrt((double)var));
    for (int d = 0; d < HEAD; ++d) dst[d] = rk_bf16_canon((x[d] * r) * w[d]);
}

// Softmax-pool of two kv|score rows (older a, newer b), per dim (C §8.1 pool).
inline void pool_rows(const float* __restrict a, const float* __restrict b, float* __restrict out) {
    for (int d = 0; d < HEAD; ++d) {
        const float sa = a[HEAD + d], sb = b[HEAD + d];
        float m = sa > sb ? sa : sb;
        m = (sa != sa) ? sa : m;  // torch.maximum propagates NaN
        m = (sb != sb) ? sb : m;
        const float ea = exp2_f32((sa - m) * kLog2eF32);
        const float eb = exp2_f32((sb - m) * kLog2eF32);
        const float den = ea + eb;
        const float wa = ea / den, wb = eb / den;
        out[d] = std::fmaf(wa, a[d], wb * b[d]);
    }
}

}  // namespace

extern "C" {

// ======================================================================= C §8.1
void dsv41_fused_save_compress_norm(
    const float* kv, int64_t rows, int64_t kv_s0,
    const void* positions, int64_t pos_is64, int64_t pos_s0,
    float* state, int64_t st_blocks, int64_t cap, int64_t st_s0, int64_t st_s1,
    const void* slot, int64_t slot_is64, int64_t slot_s0, int64_t T,
    const void* qsl, int64_t qsl_is64, int64_t qsl_n, int64_t qsl_s0,
    const void* t2r, int64_t t2r_is64, int64_t t2r_s0,
    const void* weight, int64_t w_is_bf16, int64_t w_s0,
    double eps_d, int64_t cr,
    uint16_t* latent, int64_t lat_s0) {
    if (T <= 0) return;
    const float eps = (float)eps_d;
    float w[HEAD];
    for (int d = 0; d < HEAD; ++d) w[d] = load_float(weight, d * w_s0, w_is_bf16 != 0);
    const bool par = T * (int64_t)HEAD * 4 * cr >= kParallelMinBytes && T > 1;

    if (cr == 1) {
#pragma omp parallel for schedule(static) if (par)
        for (int64_t t = 0; t < T; ++t) {
            if (load_index(slot, t, slot_s0, slot_is64) < 0) continue;
            rmsnorm512_store(kv + t * kv_s0, w, eps, latent + t * lat_s0);
        }
        return;
    }

    // ---- CR 2: pooled latents of the closing tokens (the ring is read before it is updated)
    std::vector<int64_t> q(std::max<int64_t>(qsl_n, 1));
    for (int64_t i = 0; i < qsl_n; ++i) q[i] = load_index(qsl, i, qsl_s0, qsl_is64);
#pragma omp parallel if (par)
    {
        float pooled[HEAD];
#pragma omp for schedule(static)
        for (int64_t t = 0; t < T; ++t) {
            const int64_t s = load_index(slot, t, slot_s0, slot_is64);
            const int64_t p = load_index(positions, t, pos_s0, pos_is64);
            if (s < 0 || (p & 1) == 0) continue;  // closes at odd positions (floor mod)
            int64_t req = load_index(t2r, t, t2r_s0, t2r_is64);
            req = req < 0 ? req + qsl_n : req;  // torch indexing of qsl[req]
            const bool first = req >= 0 && req < qsl_n && q[req] == t;
            const float* older;
            if (first) {
                const int64_t blk = s / cap;
                if (blk >= st_blocks) continue;  // outside the ring (out of contract)
                older = state + blk * st_s0 + floor_mod(p - 1, cap) * st_s1;
            } else {
                const int64_t prev = t - 1 >= 0 ? t - 1 : rows - 1;  // torch's index -1
                older = kv + prev * kv_s0;
            }
            pool_rows(older, kv + t * kv_s0, pooled);
            rmsnorm512_store(pooled, w, eps, latent + t * lat_s0);
        }
    }

    // ---- ring update: per chunk [s, e) whose first slot is >= 0, its last min(e-s, cap)
    // rows with slot >= 0 go verbatim to (slot // cap, slot % cap); last writer wins.
    const int64_t R = qsl_n - 1;
    if (R <= 0) return;
    std::vector<std::pair<int64_t, int64_t>> writes;  // (ring row, token)
    for (int64_t u = 0; u < T; ++u) {
        int64_t r = upper_bound_i64(q.data() + 1, R, u);
        r = std::min(r, R - 1);
        const int64_t s = q[r], e = q[r + 1];
        if (!(u >= s && u < e)) continue;
        const int64_t s_cl = std::min(std::max<int64_t>(s, 0), T - 1);
        if (load_index(slot, s_cl, slot_s0, slot_is64) < 0) continue;
        if (u < e - cap) continue;
        const int64_t sl = load_index(slot, u, slot_s0, slot_is64);
        if (sl < 0) continue;
        const int64_t blk = sl / cap, row = sl % cap;
        if (blk >= st_blocks) continue;
        writes.emplace_back(blk * cap + row, u);
    }
    std::stable_sort(writes.begin(), writes.end());
    std::vector<std::pair<int64_t, int64_t>> last;
    last.reserve(writes.size());
    for (size_t i = 0; i < writes.size(); ++i)
        if (i + 1 == writes.size() || writes[i + 1].first != writes[i].first) last.push_back(writes[i]);
    const int64_t nw = (int64_t)last.size();
#pragma omp parallel for schedule(static) if (nw * 4096 >= kParallelMinBytes && nw > 1)
    for (int64_t i = 0; i < nw; ++i) {
        const int64_t dst = last[i].first, u = last[i].second;
        float* d = state + (dst / cap) * st_s0 + (dst % cap) * st_s1;
        std::memcpy(d, kv + u * kv_s0, sizeof(float) * 2 * HEAD);
    }
}

// ======================================================================= R §2
void dsv41_fused_indexer_q_rope_quant(
    const void* positions, int64_t pos_is64, int64_t pos_s0,
    const uint16_t* q, int64_t T, int64_t H, int64_t D, int64_t q_s0, int64_t q_s1,
    const void* cache, int64_t cache_is_bf16, int64_t max_pos, int64_t R, int64_t cache_s0,
    const void* w, int64_t w_is_bf16, int64_t w_s0, int64_t w_s1,
    double softmax_scale, double head_scale, int64_t use_fp4, int64_t use_fnuz,
    uint8_t* q_out, int64_t qo_s0, int64_t qo_s1,
    uint8_t* qs_out, int64_t qs_s0, int64_t qs_s1,
    void* w_out, int64_t wo_is_bf16, int64_t wo_s0, int64_t wo_s1) {
    if (T <= 0 || H <= 0) return;
    const int64_t half = R / 2, nope = D - R;
    const float S = (float)softmax_scale, Hs = (float)head_scale;
    const float fp8_max = use_fnuz ? 224.0f : 448.0f;
    const uint32_t* thr = ceil_log2_table().thr;
    const int64_t n_items = T * H;
    const bool par = n_items * D * 2 >= kParallelMinBytes && n_items > 1;
    const bool cbf = cache_is_bf16 != 0;

#pragma omp parallel if (par)
    {
        std::vector<float> xb(D > 0 ? D : 1);
        float* x = xb.data();
#pragma omp for schedule(static)
        for (int64_t it = 0; it < n_items; ++it) {
            const int64_t t = it / H, h = it % H;
            int64_t p = load_index(positions, t, pos_s0, pos_is64 != 0);
            p = std::min(std::max<int64_t>(p, 0), max_pos - 1);  // never read outside the cache
            const uint16_t* src = q + t * q_s0 + h * q_s1;
            for (int64_t d = 0; d < D; ++d) x[d] = bf16_to_f32(src[d]);
            // RoPE on the last R dims (R §1.2), then the bf16 round trip
            const int64_t crow = p * cache_s0;
            for (int64_t i = 0; i < half; ++i) {
                const float c = load_float(cache, crow + i, cbf);
                const float s = load_float(cache, crow + half + i, cbf);
                const float e = x[nope + 2 * i], o = x[nope + 2 * i + 1];
                const float os = o * s, es = e * s;
                x[nope + 2 * i] = rn_bf16(std::fmaf(e, c, -os));
                x[nope + 2 * i + 1] = rn_bf16(std::fmaf(o, c, es));
            }
            const float wv = load_float(w, t * w_s0 + h * w_s1, w_is_bf16 != 0);
            float wres;
            if (!use_fp4) {
                // R §2.2: one scale per head, s = max(amax, 1e-4) / FP8_MAX (IEEE division)
                float amax = amax_nonan(x, D);
                amax = amax < F32_1E_4 ? F32_1E_4 : amax;
                const float E = ceil_log2(amax / fp8_max, thr);
                const float qscale = exp2i(E);
                const float inv = inv_pow2(E);
                uint8_t* dst = q_out + t * qo_s0 + h * qo_s1;
                if (use_fnuz)
                    for (int64_t d = 0; d < D; ++d) dst[d] = e4m3fnuz_encode(x[d] * inv);
                else
                    for (int64_t d = 0; d < D; ++d) dst[d] = e4m3fn_encode(x[d] * inv);
                wres = ((wv * qscale) * S) * Hs;
            } else {
                // R §2.3 / §1.8: blocks of 32, ue8m0 scale bytes, packed e2m1
                uint8_t* dst = q_out + t * qo_s0 + h * qo_s1;
                uint8_t* sdst = qs_out + t * qs_s0 + h * qs_s1;
                for (int64_t b = 0; b < D / 32; ++b) {
                    const float* xb32 = x + 32 * b;
                    float amax = amax_nonan(xb32, 32);
                    const float floor_ = 0x1.8p-124f;  // 6 * 2^-126
                    amax = amax < floor_ ? floor_ : amax;
                    float e = ceil_log2(amax * INV_6, thr);
                    e = e < -127.0f ? -127.0f : (e > 127.0f ? 127.0f : e);
                    const float m = exp2i(-e);
                    for (int k = 0; k < 16; ++k) {
                        const uint8_t lo = e2m1_encode(xb32[2 * k] * m);
                        const uint8_t hi = e2m1_encode(xb32[2 * k + 1] * m);
                        dst[16 * b + k] = (uint8_t)(lo | (hi << 4));
                    }
                    sdst[b] = (uint8_t)(int)(e + 127.0f);
                }
                wres = (wv * S) * Hs;
            }
            if (wo_is_bf16)
                ((uint16_t*)w_out)[t * wo_s0 + h * wo_s1] = rk_bf16_torch(wres);
            else
                ((float*)w_out)[t * wo_s0 + h * wo_s1] = wres;
        }
    }
}

// ======================================================================= R §4
void dsv41_fused_inv_rope_fp8_quant(
    const uint16_t* o, int64_t T, int64_t NH, int64_t Dh, int64_t o_s0, int64_t o_s1,
    const void* positions, int64_t pos_is64, int64_t pos_s0,
    const float* cache, int64_t max_pos, int64_t cache_s0,
    int64_t G, int64_t HG, int64_t nope, int64_t R, int64_t QG,
    int64_t tma, int64_t quantize, int64_t permuted,
    void* out, int64_t out_s0, int64_t out_s1,
    void* scale, int64_t sc_s0, int64_t Ta, int64_t K) {
    (void)NH;
    const int64_t Dg = HG * Dh;
    const int64_t C = QG > 0 ? Dh / QG : 0;
    const int64_t S = HG * C;
    const int64_t half = R / 2;
    const uint32_t* thr = ceil_log2_table().thr;
    const float kEps = 0x1.b7cdfep-34f;  // fl32(1e-10)
    const int64_t n_rows = T * G;
    const bool par = n_rows * Dg * 2 >= kParallelMinBytes && n_rows > 1;

#pragma omp parallel if (par)
    {
        std::vector<float> xb(Dh > 0 ? Dh : 1), yb(Dh > 0 ? Dh : 1), sb(S > 0 ? S : 1);
        float* x = xb.data();
        float* y = yb.data();
        float* sc = sb.data();
#pragma omp for schedule(static)
        for (int64_t it = 0; it < n_rows; ++it) {
            const int64_t t = it / G, g = it % G;
            int64_t p = load_index(positions, t, pos_s0, pos_is64 != 0);
            p = std::min(std::max<int64_t>(p, 0), max_pos - 1);
            const float* crow = cache + p * cache_s0;
            for (int64_t hg = 0; hg < HG; ++hg) {
                const uint16_t* src = o + t * o_s0 + (g * HG + hg) * o_s1;
                for (int64_t d = 0; d < Dh; ++d) x[d] = bf16_to_f32(src[d]);
                for (int64_t d = 0; d < nope; ++d) y[d] = x[d];
                // inverse RoPE (R §1.3) on dims nope..Dh-1, pairs (d, d^1)
                for (int64_t d = nope; d < Dh; ++d) {
                    const int64_t i = (d - nope) >> 1;
                    const float c = crow[i], s = crow[half + i];
                    const float ps = x[d ^ 1] * s;
                    y[d] = std::fmaf(x[d], c, (d & 1) == 0 ? ps : -ps);
                }
                if (!quantize) {
                    uint16_t* dst = (uint16_t*)out + g * out_s0 + t * out_s1 + hg * Dh;
                    for (int64_t d = 0; d < Dh; ++d) dst[d] = rk_bf16_canon(y[d]);
                    continue;
                }
                for (int64_t c = 0; c < C; ++c) {
                    const float* yc = y + c * QG;
                    float amax = amax_nonan(yc, QG);
                    amax = amax < kEps ? kEps : amax;
                    const float E = ceil_log2(amax * INV_448, thr);
                    const float inv = inv_pow2(E);
                    const int64_t pos_chunk = permuted ? (c * HG + hg) : (hg * C + c);
                    uint8_t* dst = (uint8_t*)out + g * out_s0 + t * out_s1 + pos_chunk * QG;
                    for (int64_t j = 0; j < QG; ++j) {
                        const float v = yc[j] * inv;
                        dst[j] = v != v ? (uint8_t)0x7E : e4m3fn_encode(v);  // NaN -> +448 (F3)
                    }
                    sc[pos_chunk] = exp2i(E);
                }
            }
            if (!quantize) continue;
            if (tma) {
                int32_t* sw = (int32_t*)scale + g * sc_s0 + t;
                for (int64_t k = 0; k < K; ++k) {
                    uint32_t word = 0;
                    for (int b = 0; b < 4; ++b) {
                        const int64_t blk = 4 * k + b;
                        const uint32_t byte = blk < S ? ((bits(sc[blk]) >> 23) & 0xFFu) : 0u;
                        word |= byte << (8 * b);
                    }
                    sw[k * Ta] = (int32_t)word;
                }
            } else {
                float* sf = (float*)scale + g * sc_s0 + t;
                for (int64_t k = 0; k < K; ++k) sf[k * Ta] = k < S ? sc[k] : 0.0f;
            }
        }
    }
    // padding rows T <= t < Ta of every scale column: 0
    if (quantize) {
        for (int64_t g = 0; g < G; ++g)
            for (int64_t k = 0; k < K; ++k) {
                int32_t* sw = (int32_t*)scale + g * sc_s0 + k * Ta;
                for (int64_t t = T; t < Ta; ++t) sw[t] = 0;  // fp32 0.0 and int32 0 share bits
            }
    }
}

// ======================================================================= R §5
void dsv41_fused_q_kv_rmsnorm_quant(
    const uint16_t* qr, int64_t T, int64_t Qs, int64_t qr_s0,
    const uint16_t* kv, int64_t Ks, int64_t kv_s0,
    const void* qw, int64_t qw_is_bf16, const void* kvw, int64_t kvw_is_bf16,
    double eps_d,
    uint8_t* q_out, int64_t qo_s0,
    uint8_t* q_scale, int64_t Tp, int64_t Gp,
    uint16_t* kv_out, int64_t kvo_s0) {
    const float eps = (float)eps_d;
    const int64_t Gq = Qs / 32;
    std::vector<float> wq(Qs > 0 ? Qs : 1), wk(Ks > 0 ? Ks : 1);
    for (int64_t i = 0; i < Qs; ++i) wq[i] = load_float(qw, i, qw_is_bf16 != 0);
    for (int64_t i = 0; i < Ks; ++i) wk[i] = load_float(kvw, i, kvw_is_bf16 != 0);
    const float* WQ = wq.data();
    const float* WK = wk.data();
    const bool par = Tp * (Qs + Ks) * 2 >= kParallelMinBytes && Tp > 1;

#pragma omp parallel if (par)
    {
        std::vector<float> xb(std::max<int64_t>(std::max(Qs, Ks), 1));
        float* x = xb.data();
#pragma omp for schedule(static)
        for (int64_t r = 0; r < Tp; ++r) {
            uint8_t* sbase = q_scale + (r / 128) * (128 * Gp) + (r % 32) * 16 + ((r % 128) / 32) * 4;
            if (r >= T) {
                for (int64_t j = 0; j < Gp; ++j) sbase[(j / 4) * 512 + (j % 4)] = 0;
                continue;
            }
            // KV row: RMSNorm, stored as bf16 (canonical NaN)
            {
                const uint16_t* src = kv + r * kv_s0;
                for (int64_t i = 0; i < Ks; ++i) x[i] = bf16_to_f32(src[i]);
                const float ms = (float)(sum_sq_f64(x, Ks) / (double)Ks) + eps;
                const float rr = (float)(1.0 / std::sqrt((double)ms));
                uint16_t* dst = kv_out + r * kvo_s0;
                for (int64_t i = 0; i < Ks; ++i) dst[i] = rk_bf16_canon((x[i] * rr) * WK[i]);
            }
            // Q row: RMSNorm, bf16 round trip, MXFP8 with FlashInfer's UE8M0 rule
            {
                const uint16_t* src = qr + r * qr_s0;
                for (int64_t i = 0; i < Qs; ++i) x[i] = bf16_to_f32(src[i]);
                const float ms = (float)(sum_sq_f64(x, Qs) / (double)Qs) + eps;
                const float rr = (float)(1.0 / std::sqrt((double)ms));
                for (int64_t i = 0; i < Qs; ++i) x[i] = rn_bf16((x[i] * rr) * WQ[i]);
                uint8_t* dst = q_out + r * qo_s0;
                for (int64_t j = 0; j < Gp; ++j) {
                    uint8_t sfb = 0;
                    if (j < Gq) {
                        const float* g = x + 32 * j;
                        const float n = amax_nonan(g, 32) * INV_448;
                        const uint32_t nb = bits(n);
                        const uint32_t e = (nb >> 23) & 0xFFu, m = nb & 0x7FFFFFu;
                        const bool bump = m != 0 && !(e == 0 && m <= 0x400000u);
                        uint32_t sf = std::min<uint32_t>(e + (bump ? 1u : 0u), 254u);
                        sf = n <= 0.0f ? 0u : sf;
                        const float inv = sf == 0 ? 0.0f : from_bits((254u - sf) << 23);
                        for (int k = 0; k < 32; ++k) dst[32 * j + k] = e4m3fn_encode(g[k] * inv);
                        sfb = (uint8_t)sf;
                    }
                    sbase[(j / 4) * 512 + (j % 4)] = sfb;
                }
            }
        }
    }
}

// ======================================================================= R §6.3
// Byte copy of fused-layout Q heads into a zero-padded [T, Hp, D] buffer.  q rows: stride
// q_s0 bytes, heads contiguous (stride D elements); out rows: stride out_s0 bytes.
void dsv41_pad_fused_q_heads(const uint8_t* q, int64_t T, int64_t H, int64_t D, int64_t q_s0,
                             uint8_t* out, int64_t Hp, int64_t out_s0, int64_t elem) {
    const int64_t n_chunks = D / 16;
    const int64_t src_chunk = H * 16 * elem, dst_chunk = Hp * 16 * elem;
    const bool par = T * Hp * D * elem >= kParallelMinBytes && T > 1;
#pragma omp parallel for schedule(static) if (par)
    for (int64_t t = 0; t < T; ++t) {
        const uint8_t* s = q + t * q_s0;
        uint8_t* d = out + t * out_s0;
        for (int64_t c = 0; c < n_chunks; ++c) {
            std::memcpy(d + c * dst_chunk, s + c * src_chunk, (size_t)src_chunk);
            std::memset(d + c * dst_chunk + src_chunk, 0, (size_t)(dst_chunk - src_chunk));
        }
    }
}

}  // extern "C"
