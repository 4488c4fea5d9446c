// dsv41 CPU kernels: RoPE / quantization ops and the V4.1 compressor pooling.
//
//   fused_save_compress_norm    cache_ops.md §8.1      (reference: dsv41/reference/compress.py)
//   save_ring_rows              (same reference)
//   fused_indexer_q_rope_quant  rope_quant_ops.md §2   (reference: dsv41/reference/indexer.py)
//   fused_inv_rope_fp8_quant    rope_quant_ops.md §4   (reference: dsv41/reference/output_quant.py)
//   fused_q_kv_rmsnorm_quant    rope_quant_ops.md §5   (same)
//   pad_fused_q_heads           rope_quant_ops.md §6.3 (same)
//
// Every output byte equals the reference's.  fp32 arithmetic is written out operation by
// operation (the build uses -ffp-contract=off; fmaf() appears exactly where the spec fuses).
// Where vLLM's GPU kernels differ from correctly rounded arithmetic, so does this code:
//   * sums of squares in the fp32 order of vLLM's tl.sum: the compressor norm's layout
//     (sum_sq512_vllm), the Q / KV norm's layout for its row widths (common.h tl_sum_sq);
//   * rsqrt, the compressor softmax's exp and division: the NVIDIA GPU's approximate
//     primitives from the tables of dsv41.core.gpu_approx (common.h rsqrt_approx, exp_approx,
//     div_full), as vLLM's kernels compute them.  Each is a lookup in a 32-64 MB table, at a
//     random place for random scores; the CR-2 pooling, two lookups per element, reads a
//     compact form of its two tables on AVX-512 hosts (common.h CompactTables).
// Where the reference rounds fp32 -> bf16 with torch (codecs.rnbf16, copy_ into bf16), a NaN
// becomes 0xFFFF as torch's CPU cast writes it; where it stores a computed bf16 result it is the
// GPU's canonical 0x7FFF (finding 3).
// Parallelism: OpenMP over tokens / rows (static schedule, results independent of the thread
// count); the inner loops are branch-free and vectorize (checked with -fopt-info-vec).

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <utility>
#include <vector>

#include "common.h"

using namespace dsv41cpu;

// Functions between RK_WIDE_BEGIN / RK_WIDE_END prefer 512-bit vectors (GCC, AVX-512 hosts;
// a no-op elsewhere).  Only the function's own vectorization changes, never a result.
#if defined(__GNUC__) && !defined(__clang__)
#define RK_WIDE_BEGIN _Pragma("GCC push_options") _Pragma("GCC target(\"prefer-vector-width=512\")")
#define RK_WIDE_END _Pragma("GCC pop_options")
#else
#define RK_WIDE_BEGIN
#define RK_WIDE_END
#endif

namespace {

constexpr int64_t kParallelMinBytes = 1 << 16;  // below this much work: one thread

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

// max |x| with NaN ignored, as a max over the bits of |x| (NaN -> 0); signed ints so that
// gcc vectorizes the reduction.
inline float amax_nonan(const float* __restrict x, int64_t n) {
    int32_t m = 0;
    for (int64_t i = 0; i < n; ++i) {
        const int32_t a = (int32_t)(bits(x[i]) & 0x7FFFFFFFu);
        const int32_t v = a > 0x7F800000 ? 0 : a;
        m = v > m ? v : m;
    }
    return from_bits((uint32_t)m);
}

// 2^-E for an integer-valued scale exponent E (as float), such that x * inv == x / exp2i(E)
// for every x: both are the correctly rounded x * 2^-E while 2^-E is representable
// (-126 <= E <= 127), exp2i(E) = inf (E >= 128, inf) pairs with 0 (x/inf == x*0 incl. NaN),
// and exp2i(E) = 0 (E <= -127) with inf (x/0 == x*inf incl. NaN).
inline float inv_pow2(float E) {
    if (E != E) return E;
    if (E >= 128.0f) return 0.0f;
    if (E <= -127.0f) return from_bits(0x7F800000u);  // exp2i(E) flushes to 0: x / 0 == x * inf
    const int e = (int)E;
    if (e <= 126) return from_bits((uint32_t)(127 - e) << 23);
    return from_bits(0x00800000u >> (e - 126));  // 2^-127: subnormal
}


// sum x_i^2 of a 512-wide fp32 row in vLLM's order (gpu_approx.tl_sum_sq, 4 warps, 4 per
// thread): thread 32w + l accumulates dims 128w + 4l .. +3 as fma(e0, e0, e1*e1), then fmaf
// of e2, e3; each warp folds its 32 lanes (xor 16 .. 1; lane 0's value), then
// (w0 + w2) + (w1 + w3).
inline float sum_sq512_vllm(const float* x) {
    float lane[128];
    for (int t = 0; t < 128; ++t) {
        const float* e = x + 4 * t;
        float acc = std::fmaf(e[0], e[0], e[1] * e[1]);
        acc = std::fmaf(e[2], e[2], acc);
        lane[t] = std::fmaf(e[3], e[3], acc);
    }
    float w[4];
    for (int g = 0; g < 4; ++g) {
        float* L = lane + 32 * g;
        for (int dist = 16; dist >= 1; dist >>= 1)
            for (int l = 0; l < dist; ++l) L[l] = L[l] + L[l + dist];
        w[g] = L[0];
    }
    return (w[0] + w[2]) + (w[1] + w[3]);
}

// vLLM's Q / KV norm layout (reference output_quant.vllm_norm_layout): tl.sum order of the rows
struct NormLayout {
    int block, warps, per;
};

// Σx²/n of a bf16 row in that order, the mean a div.full by n (rcp table); x: n floats of
// the caller's scratch (one per thread, not one allocation per row)
inline float norm_mean(const uint16_t* src, int64_t n, const NormLayout& lay, const int32_t* rcp_tab, float* x) {
    for (int64_t i = 0; i < n; ++i) x[i] = bf16_to_f32(src[i]);
    return div_full(tl_sum_sq(x, n, lay.block, lay.warps, lay.per), (float)n, rcp_tab);
}

inline int64_t floor_mod(int64_t a, int64_t b) {
    int64_t r = a % b;
    return (r != 0 && ((r < 0) != (b < 0))) ? r + b : r;
}

constexpr int HEAD = 512;

RK_WIDE_BEGIN
// latent = bf16(x * rsqrt(sum x^2 / 512 + eps) * w), canonical NaN (C §8.1), the GPU's rsqrt.
inline void rmsnorm512_store(const float* x, const float* w, float eps, const int32_t* rtab, uint16_t* dst) {
    const float ss = sum_sq512_vllm(x);
    const float var = ss / 512.0f + eps;
    const float r = rsqrt_approx(var, rtab);
    for (int d = 0; d < HEAD; ++d) dst[d] = rk_bf16_canon((x[d] * r) * w[d]);
}

// Softmax-pool of two kv|score rows (older a, newer b), dim d (C §8.1 pool):
// m = max(sa, sb) (NaN propagates), ea = exp(sa - m), eb = exp(sb - m), w = e / (ea + eb)
// with the GPU's tl.exp and div.full (exp_approx, div_full), pooled = fma(wa, kva, fl32(wb * kvb)).  One of sa - m, sb - m is zero (exp = 1 exactly)
// unless a NaN / inf is involved, so one exp per dim is evaluated; the non-finite cases
// (both differences non-zero: one of them is then NaN, the other NaN or -inf) are resolved
// exactly as the two-exp formula does.
inline float pool_dim(const float* __restrict a, const float* __restrict b, int d, const Approx& ap) {
    const float sa = a[HEAD + d], sb = b[HEAD + d];
    float m = sa > sb ? sa : sb;
    m = (sa != sa) ? sa : m;  // torch.maximum propagates NaN
    m = (sb != sb) ? sb : m;
    const float za = sa - m, zb = sb - m;
    const bool a0 = za == 0.0f, b0 = zb == 0.0f;
    const float E = exp_approx(a0 ? zb : za, ap);
    const float ea = a0 ? 1.0f : E;
    const float eb_other = (zb != zb) ? zb : 0.0f;  // exp(NaN) = NaN, exp(-inf) = 0
    const float eb = b0 ? 1.0f : (a0 ? E : eb_other);
    const float den = ea + eb;
    const float wa = div_full(ea, den, ap.rcp), wb = div_full(eb, den, ap.rcp);
    return std::fmaf(wa, a[d], wb * b[d]);
}

#if DSV41_CPU_AVX512
// pool_dim for dims d0 .. d0 + 15 at once where every one is ordinary: finite scores whose
// exp argument lies in [-126, 0] (then one of the two differences is 0, the other's exp is the
// ex2neg table's, and the denominator lies in [1, 2], so div_full's scaling is 1).  The 16
// table reads of each step are issued together (gathers), from the compact tables `ct` where
// there are some.  False, nothing written: a lane is not ordinary.
inline bool pool16_avx512(const float* __restrict a, const float* __restrict b, float* __restrict out,
                          int d0, const Approx& ap, const CompactTables* ct) {
    const __m512 zero = _mm512_setzero_ps();
    const __m512 sa = _mm512_loadu_ps(a + HEAD + d0), sb = _mm512_loadu_ps(b + HEAD + d0);
    const __m512 m = _mm512_mask_blend_ps(_mm512_cmp_ps_mask(sa, sb, _CMP_GT_OQ), sb, sa);
    const __m512 za = _mm512_sub_ps(sa, m), zb = _mm512_sub_ps(sb, m);
    const __mmask16 a0 = _mm512_cmp_ps_mask(za, zero, _CMP_EQ_OQ);
    const __mmask16 b0 = _mm512_cmp_ps_mask(zb, zero, _CMP_EQ_OQ);
    const __m512 arg = _mm512_mul_ps(_mm512_mask_blend_ps(a0, za, zb), _mm512_set1_ps(1.44269502162933349609375f));
    const __mmask16 ok = _mm512_cmp_ps_mask(arg, _mm512_set1_ps(-126.0f), _CMP_GE_OQ) &
                         _mm512_cmp_ps_mask(arg, zero, _CMP_LE_OQ);
    if (ok != 0xFFFF) return false;
    // ex2_approx_ftz: |arg| as fixed point with 23 fraction bits, truncated (exact: |arg| <= 126)
    const __m512i q = _mm512_cvttps_epi32(_mm512_mul_ps(_mm512_abs_ps(arg), _mm512_set1_ps(8388608.0f)));
    const __m512i f = _mm512_and_si512(q, _mm512_set1_epi32(0x7FFFFF));
    const __m512i o = _mm512_sub_epi32(ex2neg_entries(f, ap, ct), _mm512_slli_epi32(_mm512_srli_epi32(q, 23), 23));
    // (an argument of 0 has both differences 0: E is not used there)
    const __m512 E = _mm512_castsi512_ps(
        _mm512_maskz_mov_epi32(_mm512_cmp_epi32_mask(o, _mm512_set1_epi32(0x800000), _MM_CMPINT_NLT), o));
    const __m512 one = _mm512_set1_ps(1.0f);
    const __m512 ea = _mm512_mask_blend_ps(a0, E, one);
    const __m512 eb = _mm512_mask_blend_ps(b0, E, one);
    const __m512 den = _mm512_add_ps(ea, eb);
    // rcp_approx of den in [1, 2]: the table at its mantissa, scaled by its exponent
    const __m512i db = _mm512_castps_si512(den);
    const __m512i r = _mm512_sub_epi32(
        rcp_entries(_mm512_and_si512(db, _mm512_set1_epi32(0x7FFFFF)), ap, ct),
        _mm512_slli_epi32(_mm512_sub_epi32(_mm512_srli_epi32(db, 23), _mm512_set1_epi32(127)), 23));
    const __m512 rc = _mm512_castsi512_ps(r);
    const __m512 wa = _mm512_mul_ps(ea, rc), wb = _mm512_mul_ps(eb, rc);
    _mm512_storeu_ps(out + d0, _mm512_fmadd_ps(wa, _mm512_loadu_ps(a + d0), _mm512_mul_ps(wb, _mm512_loadu_ps(b + d0))));
    return true;
}
#endif

// Softmax-pool of two kv|score rows (older a, newer b), every dim (pool_dim).
inline void pool_rows(const float* __restrict a, const float* __restrict b, float* __restrict out,
                      const Approx& ap, const CompactTables* ct) {
#if DSV41_CPU_AVX512
    for (int d0 = 0; d0 < HEAD; d0 += 16)
        if (!pool16_avx512(a, b, out, d0, ap, ct))
            for (int d = d0; d < d0 + 16; ++d) out[d] = pool_dim(a, b, d, ap);
#else
    (void)ct;
    for (int d = 0; d < HEAD; ++d) out[d] = pool_dim(a, b, d, ap);
#endif
}

RK_WIDE_END

}  // namespace

extern "C" {

// ======================================================================= C §8.1
RK_WIDE_BEGIN
void dsv41_fused_save_compress_norm(
    const float* kv, int64_t rows, int64_t kv_s0,
    const void* positions, int64_t pos_is64, int64_t pos_s0,
    float* state, int64_t st_blocks, int64_t cap, int64_t st_s0, int64_t st_s1,
    const void* slot, int64_t slot_is64, int64_t slot_s0, int64_t T,
    const void* qsl, int64_t qsl_is64, int64_t qsl_n, int64_t qsl_s0,
    const void* t2r, int64_t t2r_is64, int64_t t2r_s0,
    const void* weight, int64_t w_is_bf16, int64_t w_s0,
    double eps_d, int64_t cr,
    uint16_t* latent, int64_t lat_s0,
    const int32_t* rsqrt_tab, const int32_t* rcp_tab, const int32_t* ex2_tab, const int32_t* ex2neg_tab,
    const float* prev_rows, int64_t prev_n, int64_t prev_s0,
    const void* prev_idx, int64_t prev_idx_is64, int64_t prev_idx_n, int64_t prev_idx_s0) {
    if (T <= 0) return;
    const float eps = (float)eps_d;
    const Approx ap{rsqrt_tab, rcp_tab, ex2_tab, ex2neg_tab};
    float w[HEAD];
    for (int d = 0; d < HEAD; ++d) w[d] = load_float(weight, d * w_s0, w_is_bf16 != 0);
    const bool par = T * (int64_t)HEAD * 4 * cr >= kParallelMinBytes && T > 1;

    if (cr == 1) {
#pragma omp parallel for schedule(static) if (par)
        for (int64_t t = 0; t < T; ++t) {
            if (load_index(slot, t, slot_s0, slot_is64) < 0) continue;
            rmsnorm512_store(kv + t * kv_s0, w, eps, ap.rsqrt, latent + t * lat_s0);
        }
        return;
    }

    // ---- CR 2: pooled latents of the closing tokens (the ring is read before it is updated)
#if DSV41_CPU_AVX512
    const CompactTables* compact = compact_tables(ap);
#else
    const CompactTables* compact = nullptr;
#endif
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
            // A chunk's first token takes its predecessor from prev_rows where the caller
            // gathered one (prev_idx[req] >= 0), else from the ring.
            const bool has_prev = first && prev_rows && req < prev_idx_n;
            const int64_t pi = has_prev ? load_index(prev_idx, req, prev_idx_s0, prev_idx_is64 != 0) : -1;
            if (pi >= 0) {
                if (pi >= prev_n) continue;  // outside prev_rows: rejected by the pre-scan (bounds.cpp) first
                older = prev_rows + pi * prev_s0;
            } else if (first) {
                const int64_t blk = s / cap;
                if (blk >= st_blocks) continue;  // outside the ring: rejected by the pre-scan first
                older = state + blk * st_s0 + floor_mod(p - 1, cap) * st_s1;
            } else {
                const int64_t prev = t - 1 >= 0 ? t - 1 : rows - 1;  // torch's index -1
                older = kv + prev * kv_s0;
            }
            pool_rows(older, kv + t * kv_s0, pooled, ap, compact);
            rmsnorm512_store(pooled, w, eps, ap.rsqrt, latent + t * lat_s0);
        }
    }

    // ---- ring update: per chunk [s, e) whose first slot is >= 0, its last min(e-s, cap)
    // rows with slot >= 0 go verbatim to (slot // cap, slot % cap); last writer wins.
    // With prev_rows the caller stores the ring itself (save_ring_rows).
    const int64_t R = qsl_n - 1;
    if (R <= 0 || prev_rows) return;
    std::vector<std::pair<int64_t, int64_t>> writes;  // (ring row, token)
    for (int64_t u = 0; u < T; ++u) {
        int64_t r = upper_bound(q.data() + 1, R, u);
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
RK_WIDE_END

// save_ring_rows: rows[i] (1024 fp32) -> state[s / cap, s % cap] for s = slot[i] >= 0.  Slots
// outside the ring are skipped, so a bad slot never writes outside it.  Rows go in parallel
// once there are many, so duplicate slots (unspecified by the contract) may land in any order.
void dsv41_save_ring_rows(
    const float* rows, int64_t n, int64_t rows_s0,
    const void* slot, int64_t slot_is64, int64_t slot_s0,
    float* state, int64_t st_blocks, int64_t cap, int64_t st_s0, int64_t st_s1) {
    if (n <= 0 || cap <= 0) return;
    const int64_t limit = st_blocks * cap;
#pragma omp parallel for schedule(static) if (n * 4096 >= kParallelMinBytes && n > 1)
    for (int64_t i = 0; i < n; ++i) {
        const int64_t s = load_index(slot, i, slot_s0, slot_is64 != 0);
        if (s < 0 || s >= limit) continue;
        std::memcpy(state + (s / cap) * st_s0 + (s % cap) * st_s1, rows + i * rows_s0,
                    sizeof(float) * 2 * HEAD);
    }
}

}  // extern "C"

// ======================================================================= R §2
// Per (token, head): the head is kept as bf16 bits (every value is bf16-exact: NoPE as
// loaded, RoPE after the bf16 round trip), so the amax is an integer max and the RoPE pairs
// are read / written as uint32 words (even dim in the low half).  Needs an even NoPE width
// (D - R); an odd one takes the scalar path below.
namespace {

// max |x| over bf16 bits with NaN ignored, returned as bf16 bits of the magnitude
inline uint32_t bf16_amax_bits(const uint16_t* __restrict h, int64_t n) {
    int16_t m = 0;
    for (int64_t i = 0; i < n; ++i) {
        const int16_t a = (int16_t)(h[i] & 0x7FFFu);
        const int16_t v = a > (int16_t)0x7F80 ? (int16_t)0 : a;
        m = v > m ? v : m;
    }
    return (uint32_t)(uint16_t)m;
}

template <bool CBF16>
inline void load_cos_sin(const void* cache, int64_t row, int64_t half, float* c, float* s) {
    if (CBF16) {
        const uint16_t* p = (const uint16_t*)cache + row;
        for (int64_t i = 0; i < half; ++i) c[i] = bf16_to_f32(p[i]);
        for (int64_t i = 0; i < half; ++i) s[i] = bf16_to_f32(p[half + i]);
    } else {
        const float* p = (const float*)cache + row;
        for (int64_t i = 0; i < half; ++i) c[i] = p[i];
        for (int64_t i = 0; i < half; ++i) s[i] = p[half + i];
    }
}

// forward RoPE (R §1.2) of `half` pairs of bf16 (read as 32-bit words: even dim in the low
// half), then the bf16 round trip (torch's rounding); out gets the 2*half bf16 results.
// The indexer-Q contraction: e' = fma(e, c, -RN(o*s)), o' = fma(e, s, RN(o*c))
// (docs/kernel_contract.md, "RoPE contraction").
inline void rope_pairs_bf16(const uint16_t* __restrict in, const float* __restrict c, const float* __restrict s,
                            uint16_t* __restrict out, int64_t half) {
    for (int64_t i = 0; i < half; ++i) {
        uint32_t w;
        std::memcpy(&w, in + 2 * i, 4);
        const float e = from_bits(w << 16), o = from_bits(w & 0xFFFF0000u);
        const float os = o * s[i], oc = o * c[i];
        const uint32_t ne = rk_bf16_torch(std::fmaf(e, c[i], -os));
        const uint32_t no = rk_bf16_torch(std::fmaf(e, s[i], oc));
        const uint32_t r = ne | (no << 16);
        std::memcpy(out + 2 * i, &r, 4);
    }
}

template <bool FNUZ>
inline void encode_fp8_bf16(const uint16_t* __restrict h, float inv, uint8_t* __restrict dst, int64_t n) {
    for (int64_t d = 0; d < n; ++d) {
        const float x = from_bits((uint32_t)h[d] << 16) * inv;
        dst[d] = FNUZ ? e4m3fnuz_encode(x) : e4m3fn_encode(x);
    }
}

// e2m1 code of an fp32 (R §1.7): RNE on codes, |x| > 6 -> 6, sign kept, NaN -> magnitude 0
// (== common.h e2m1_encode / codecs.e2m1_encode for all 2^32 inputs), computed like an fp32 ->
// 4-bit float conversion: normals (|x| >= 1) by integer RNE on the fp32 bits, subnormals
// (step 0.5) by the FPU's RNE when adding 2^22.  Branch-free and cheaper than 7 compares.
inline uint32_t rk_e2m1(float f) {
    const uint32_t b = bits(f);
    uint32_t a = b & 0x7FFFFFFFu;
    const bool nan = a > 0x7F800000u;
    a = a < 0x40C00000u ? a : 0x40C00000u;  // saturate to 6 (inf too)
    const uint32_t nrm = (a - (126u << 23) + 0x1FFFFFu + ((a >> 22) & 1u)) >> 22;
    const uint32_t sub = bits(from_bits(a) + 4194304.0f) - 0x4A800000u;  // round(|x| / 0.5)
    const uint32_t code = a < 0x3F800000u ? sub : nrm;
    return (nan ? 0u : code) | ((b >> 28) & 8u);
}

// MXFP4 scale of one block of 32 bf16 values (R §1.8): returns the multiplier 2^-E and
// stores the ue8m0 byte E + 127
inline float mxfp4_scale_bf16(const uint16_t* __restrict h, const uint32_t* thr, uint8_t* __restrict sdst) {
    float amax = from_bits(bf16_amax_bits(h, 32) << 16);
    const float floor_ = 0x1.8p-124f;  // 6 * 2^-126
    amax = amax < floor_ ? floor_ : amax;
    float e = ceil_log2(amax * INV_6, thr);
    e = e < -127.0f ? -127.0f : (e > 127.0f ? 127.0f : e);
    *sdst = (uint8_t)(int)(e + 127.0f);
    return exp2i(-e);
}

// packed e2m1 bytes of n_words pairs of bf16 (even dim in the low nibble), word k scaled by mul[k]
inline void mxfp4_pack_bf16(const uint16_t* __restrict h, const float* __restrict mul, uint8_t* __restrict dst,
                            int64_t n_words) {
    for (int64_t k = 0; k < n_words; ++k) {
        uint32_t w;
        std::memcpy(&w, h + 2 * k, 4);
        const uint32_t lo = rk_e2m1(from_bits(w << 16) * mul[k]);
        const uint32_t hi = rk_e2m1(from_bits(w & 0xFFFF0000u) * mul[k]);
        dst[k] = (uint8_t)(lo | (hi << 4));
    }
}

// Everything one (token, head) item needs; scratch buffers are per thread.
struct IdxArgs {
    const void* positions;
    bool pos_is64;
    int64_t pos_s0;
    const uint16_t* q;
    int64_t H, D, q_s0, q_s1;
    const void* cache;
    bool cbf;
    int64_t max_pos, R, cache_s0;
    const void* w;
    bool w_is_bf16;
    int64_t w_s0, w_s1;
    float S, Hs, fp8_max;
    bool use_fnuz;
    uint8_t* q_out;
    int64_t qo_s0, qo_s1;
    uint8_t* qs_out;
    int64_t qs_s0, qs_s1;
    void* w_out;
    bool wo_is_bf16;
    int64_t wo_s0, wo_s1;
    int64_t half, nope;
    bool even;
    const uint32_t* thr;
};

struct IdxScratch {
    std::vector<uint16_t> hb_, rb_;
    std::vector<float> cs_, xb_, mw_;
    uint16_t *hb, *rb;
    float *cc, *ss, *x, *mulw;
    int64_t cur_t = -1;
    explicit IdxScratch(const IdxArgs& A)
        : hb_(A.D + 2), rb_(A.R + 2), cs_(2 * A.half + 2), xb_(A.D + 1), mw_(A.D / 2 + 1) {
        hb = hb_.data();
        rb = rb_.data();
        cc = cs_.data();
        ss = cc + A.half + 1;
        x = xb_.data();
        mulw = mw_.data();
    }
};

template <bool FP4>
static inline __attribute__((always_inline)) void indexer_item(const IdxArgs& A, IdxScratch& B, int64_t it) {
    const auto positions = A.positions;
    const bool pos_is64 = A.pos_is64;
    const int64_t pos_s0 = A.pos_s0, H = A.H, D = A.D, q_s0 = A.q_s0, q_s1 = A.q_s1;
    const uint16_t* q = A.q;
    const auto cache = A.cache;
    const bool cbf = A.cbf, w_is_bf16 = A.w_is_bf16, use_fnuz = A.use_fnuz, wo_is_bf16 = A.wo_is_bf16;
    const bool even = A.even;
    const int64_t max_pos = A.max_pos, R = A.R, cache_s0 = A.cache_s0, w_s0 = A.w_s0, w_s1 = A.w_s1;
    const auto w = A.w;
    const float S = A.S, Hs = A.Hs, fp8_max = A.fp8_max;
    uint8_t* q_out = A.q_out;
    uint8_t* qs_out = A.qs_out;
    void* w_out = A.w_out;
    const int64_t qo_s0 = A.qo_s0, qo_s1 = A.qo_s1, qs_s0 = A.qs_s0, qs_s1 = A.qs_s1;
    const int64_t wo_s0 = A.wo_s0, wo_s1 = A.wo_s1, half = A.half, nope = A.nope;
    const uint32_t* thr = A.thr;
    uint16_t* hb = B.hb;
    uint16_t* rb = B.rb;
    float* cc = B.cc;
    float* ss = B.ss;
    float* x = B.x;
    float* mulw = B.mulw;
    int64_t& cur_t = B.cur_t;
    const int64_t t = it / H, h = it % H;
    if (t != cur_t) {
        int64_t p = load_index(positions, t, pos_s0, pos_is64 != 0);
        p = std::min(std::max<int64_t>(p, 0), max_pos - 1);  // never read outside the cache
        if (cbf)
            load_cos_sin<true>(cache, p * cache_s0, half, cc, ss);
        else
            load_cos_sin<false>(cache, p * cache_s0, half, cc, ss);
        cur_t = t;
    }
    const uint16_t* src = q + t * q_s0 + h * q_s1;
    // the head = [src[0:nope] | rb[0:R]] (NoPE as loaded, RoPE rotated + bf16 round
    // trip); `contig` says whether it was assembled in hb instead
    bool contig = false;
    if (even) {
        rope_pairs_bf16(src + nope, cc, ss, rb, half);
    } else {
        for (int64_t d = 0; d < D; ++d) x[d] = bf16_to_f32(src[d]);
        for (int64_t i = 0; i < half; ++i) {
            const float e = x[nope + 2 * i], o = x[nope + 2 * i + 1];
            const float os = o * ss[i], oc = o * cc[i];
            x[nope + 2 * i] = rn_bf16(std::fmaf(e, cc[i], -os));
            x[nope + 2 * i + 1] = rn_bf16(std::fmaf(e, ss[i], oc));
        }
        for (int64_t d = 0; d < D; ++d) hb[d] = (uint16_t)(bits(x[d]) >> 16);  // bf16-exact
        contig = true;
    }
    const float wv = load_float(w, t * w_s0 + h * w_s1, w_is_bf16 != 0);
    float wres;
    uint8_t* dst = q_out + t * qo_s0 + h * qo_s1;
    const uint16_t* p0 = contig ? hb : src;          // dims [0, nope)
    const uint16_t* p1 = contig ? hb + nope : rb;    // dims [nope, D)
    if (!FP4) {
        // R §2.2: one scale per head, s = max(amax, 1e-4) / FP8_MAX (IEEE division)
        const uint32_t a0 = bf16_amax_bits(p0, nope), a1 = bf16_amax_bits(p1, R);
        float amax = from_bits((a0 > a1 ? a0 : a1) << 16);
        amax = amax < F32_1E_4 ? F32_1E_4 : amax;
        const float E = ceil_log2(amax / fp8_max, thr);
        const float qscale = exp2i(E);
        const float inv = inv_pow2(E);
        if (use_fnuz) {
            encode_fp8_bf16<true>(p0, inv, dst, nope);
            encode_fp8_bf16<true>(p1, inv, dst + nope, R);
        } else {
            encode_fp8_bf16<false>(p0, inv, dst, nope);
            encode_fp8_bf16<false>(p1, inv, dst + nope, R);
        }
        wres = ((wv * qscale) * S) * Hs;
    } else {
        // R §2.3 / §1.8: blocks of 32, ue8m0 scale bytes, packed e2m1
        uint8_t* sdst = qs_out + t * qs_s0 + h * qs_s1;
        if (!contig && nope % 32 != 0) {  // a block straddles NoPE and RoPE
            for (int64_t d = 0; d < nope; ++d) hb[d] = src[d];
            for (int64_t d = 0; d < R; ++d) hb[nope + d] = rb[d];
            contig = true;
        }
        for (int64_t b = 0; b < D / 32; ++b) {
            const int64_t d0 = 32 * b;
            const uint16_t* hp = contig ? hb + d0 : (d0 < nope ? src + d0 : rb + (d0 - nope));
            const float m = mxfp4_scale_bf16(hp, thr, sdst + b);
            for (int k = 0; k < 16; ++k) mulw[16 * b + k] = m;
        }
        if (contig) {
            mxfp4_pack_bf16(hb, mulw, dst, D / 2);
        } else {  // nope % 32 == 0 here
            mxfp4_pack_bf16(src, mulw, dst, nope / 2);
            mxfp4_pack_bf16(rb, mulw + nope / 2, dst + nope / 2, R / 2);
        }
        wres = (wv * S) * Hs;
    }
    if (wo_is_bf16)
        ((uint16_t*)w_out)[t * wo_s0 + h * wo_s1] = rk_bf16_torch(wres);
    else
        ((float*)w_out)[t * wo_s0 + h * wo_s1] = wres;
}

// The FP8 path is compiled for 512-bit vectors where the target has them (measured ~20 %
// faster on AVX-512 hosts); the MXFP4 path's 16- and 32-element loops prefer 256-bit ones.
RK_WIDE_BEGIN
static void indexer_run_fp8(const IdxArgs& A, int64_t n_items, bool par) {
#pragma omp parallel if (par)
    {
        IdxScratch B(A);
#pragma omp for schedule(static)
        for (int64_t it = 0; it < n_items; ++it) indexer_item<false>(A, B, it);
    }
}
RK_WIDE_END

static void indexer_run_fp4(const IdxArgs& A, int64_t n_items, bool par) {
#pragma omp parallel if (par)
    {
        IdxScratch B(A);
#pragma omp for schedule(static)
        for (int64_t it = 0; it < n_items; ++it) indexer_item<true>(A, B, it);
    }
}

}  // namespace

extern "C" {

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
    IdxArgs A;
    A.positions = positions;
    A.pos_is64 = pos_is64 != 0;
    A.pos_s0 = pos_s0;
    A.q = q;
    A.H = H;
    A.D = D;
    A.q_s0 = q_s0;
    A.q_s1 = q_s1;
    A.cache = cache;
    A.cbf = cache_is_bf16 != 0;
    A.max_pos = max_pos;
    A.R = R;
    A.cache_s0 = cache_s0;
    A.w = w;
    A.w_is_bf16 = w_is_bf16 != 0;
    A.w_s0 = w_s0;
    A.w_s1 = w_s1;
    A.S = (float)softmax_scale;
    A.Hs = (float)head_scale;
    A.fp8_max = use_fnuz ? 224.0f : 448.0f;
    A.use_fnuz = use_fnuz != 0;
    A.q_out = q_out;
    A.qo_s0 = qo_s0;
    A.qo_s1 = qo_s1;
    A.qs_out = qs_out;
    A.qs_s0 = qs_s0;
    A.qs_s1 = qs_s1;
    A.w_out = w_out;
    A.wo_is_bf16 = wo_is_bf16 != 0;
    A.wo_s0 = wo_s0;
    A.wo_s1 = wo_s1;
    A.half = R / 2;
    A.nope = D - R;
    A.even = ((D - R) & 1) == 0;
    A.thr = ceil_log2_table().thr;
    const int64_t n_items = T * H;
    const bool par = n_items * D * 2 >= kParallelMinBytes && n_items > 1;
    if (use_fp4)
        indexer_run_fp4(A, n_items, par);
    else
        indexer_run_fp8(A, n_items, par);
}

}  // extern "C"

extern "C" {

// ======================================================================= R §4
RK_WIDE_BEGIN
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
        std::vector<float> yb(Dh > 0 ? Dh : 1), sb(S > 0 ? S : 1), eb(half + 1), ob(half + 1), mb(Dh > 0 ? Dh : 1);
        std::vector<uint8_t> cbv(Dh > 0 ? Dh : 1);
        float* mul = mb.data();
        uint8_t* cb = cbv.data();
        std::vector<uint32_t> pb(half + 1);
        float* y = yb.data();
        float* sc = sb.data();
        float* ye = eb.data();
        float* yo = ob.data();
        uint32_t* pin = pb.data();
#pragma omp for schedule(static)
        for (int64_t it = 0; it < n_rows; ++it) {
            const int64_t t = it / G, g = it % G;
            int64_t p = load_index(positions, t, pos_s0, pos_is64 != 0);
            p = std::min(std::max<int64_t>(p, 0), max_pos - 1);
            const float* crow = cache + p * cache_s0;
            for (int64_t hg = 0; hg < HG; ++hg) {
                const uint16_t* src = o + t * o_s0 + (g * HG + hg) * o_s1;
                // NoPE dims as loaded; inverse RoPE (R §1.3) on the pairs (nope + 2i, nope + 2i + 1)
                // (nope and R are even: the wrapper guarantees it, the reference needs it)
                for (int64_t d = 0; d < nope; ++d) y[d] = bf16_to_f32(src[d]);
                std::memcpy(pin, src + nope, sizeof(uint16_t) * R);
                for (int64_t i = 0; i < half; ++i) {
                    const uint32_t w = pin[i];
                    const float e = from_bits(w << 16), od = from_bits(w & 0xFFFF0000u);
                    const float c = crow[i], s = crow[half + i];
                    const float os = od * s, es = e * s;
                    ye[i] = std::fmaf(e, c, os);
                    yo[i] = std::fmaf(od, c, -es);
                }
                for (int64_t i = 0; i < half; ++i) {
                    y[nope + 2 * i] = ye[i];
                    y[nope + 2 * i + 1] = yo[i];
                }
                if (!quantize) {
                    uint16_t* dst = (uint16_t*)out + g * out_s0 + t * out_s1 + hg * Dh;
                    for (int64_t d = 0; d < Dh; ++d) dst[d] = rk_bf16_canon(y[d]);
                    continue;
                }
                // per chunk: amax (floor 1e-10), E = ceil(fl32(log2(amax * fl32(1/448)))) (L), and
                // the multiplier 2^-E of its elements; then one pass over the head's dims
                for (int64_t c = 0; c < C; ++c) {
                    const float* yc = y + c * QG;
                    float amax = amax_nonan(yc, QG);
                    amax = amax < kEps ? kEps : amax;
                    const float E = ceil_log2(amax * INV_448, thr);
                    const float inv = inv_pow2(E);
                    for (int64_t j = 0; j < QG; ++j) mul[c * QG + j] = inv;
                    sc[permuted ? (c * HG + hg) : (hg * C + c)] = exp2i(E);
                }
                uint8_t* row = (uint8_t*)out + g * out_s0 + t * out_s1;
                uint8_t* codes = permuted ? cb : row + hg * Dh;
                for (int64_t d = 0; d < Dh; ++d) {
                    const float v = y[d] * mul[d];
                    codes[d] = v != v ? (uint8_t)0x7E : e4m3fn_encode(v);  // NaN -> +448 (F3)
                }
                if (permuted)
                    for (int64_t c = 0; c < C; ++c) std::memcpy(row + (c * HG + hg) * QG, cb + c * QG, (size_t)QG);
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
RK_WIDE_END

#if DSV41_CPU_AVX512
namespace {
// One row of R §5 (Qs % 32 == 0, Ks % 16 == 0): bit-identical to the scalar loop below.
inline void qkv_row_avx512(const uint16_t* __restrict qsrc, int64_t Qs, const uint16_t* __restrict ksrc, int64_t Ks,
                           const float* __restrict WQ, const float* __restrict WK, float eps,
                           const int32_t* rtab, const int32_t* rcp_tab, const NormLayout& lay,
                           uint8_t* __restrict qdst, uint8_t* __restrict sbase,
                           int64_t Gp, uint16_t* __restrict kdst, bool nt, float* scratch) {
    // nt: large output, stream the 64-byte-aligned code/KV stores past the cache (no RFO)
    const bool ntq = nt && ((uintptr_t)qdst & 63) == 0;
    const bool ntk = nt && ((uintptr_t)kdst & 31) == 0;
    {
        const float ms = norm_mean(ksrc, Ks, lay, rcp_tab, scratch) + eps;
        const __m512 rr = _mm512_set1_ps(rsqrt_approx(ms, rtab));
        for (int64_t i = 0; i < Ks; i += 16) {
            const __m512 y = _mm512_mul_ps(_mm512_mul_ps(v16_bf16_load(ksrc + i), rr), _mm512_loadu_ps(WK + i));
            if (ntk)
                _mm256_stream_si256((__m256i*)(kdst + i), v16_bf16_canon(y));
            else
                _mm256_storeu_si256((__m256i*)(kdst + i), v16_bf16_canon(y));
        }
    }
    const float ms = norm_mean(qsrc, Qs, lay, rcp_tab, scratch) + eps;
    const __m512 rr = _mm512_set1_ps(rsqrt_approx(ms, rtab));
    const int64_t Gq = Qs / 32;
    int64_t j0 = 0;
    {
        // blocks of 16 groups: amax of the 16 groups through one 16x16 horizontal max, the
        // UE8M0 rule vectorized over the groups (n >= 0 always: n <= 0 <=> bits 0 <=> sf 0)
        alignas(64) float yb[16 * 32];
        alignas(64) float invb[16];
        alignas(64) uint32_t sfb[16];
        const __m512 c448 = _mm512_set1_ps(INV_448);
        for (; j0 + 16 <= Gq; j0 += 16) {
            __m512i am[16];
            for (int g = 0; g < 16; ++g) {
                const int64_t i = 32 * (j0 + g);
                // v16_bf16_round(.., 0xFFFF) and v16_abs_bits_nonan sharing one NaN mask
                const __m512 p0 = _mm512_mul_ps(_mm512_mul_ps(v16_bf16_load(qsrc + i), rr), _mm512_loadu_ps(WQ + i));
                const __m512 p1 =
                    _mm512_mul_ps(_mm512_mul_ps(v16_bf16_load(qsrc + i + 16), rr), _mm512_loadu_ps(WQ + i + 16));
                const __mmask16 n0 = _mm512_cmp_ps_mask(p0, p0, _CMP_UNORD_Q);
                const __mmask16 n1 = _mm512_cmp_ps_mask(p1, p1, _CMP_UNORD_Q);
                const __m512i b0 = _mm512_castps_si512(p0), b1 = _mm512_castps_si512(p1);
                const __m512i r0 = _mm512_and_si512(
                    _mm512_add_epi32(_mm512_add_epi32(b0, v16_u32(0x7FFF)),
                                     _mm512_and_si512(_mm512_srli_epi32(b0, 16), v16_u32(1))),
                    v16_u32(0xFFFF0000u));
                const __m512i r1 = _mm512_and_si512(
                    _mm512_add_epi32(_mm512_add_epi32(b1, v16_u32(0x7FFF)),
                                     _mm512_and_si512(_mm512_srli_epi32(b1, 16), v16_u32(1))),
                    v16_u32(0xFFFF0000u));
                _mm512_store_si512((__m512i*)(yb + 32 * g), _mm512_mask_mov_epi32(r0, n0, v16_u32(0xFFFF0000u)));
                _mm512_store_si512((__m512i*)(yb + 32 * g + 16), _mm512_mask_mov_epi32(r1, n1, v16_u32(0xFFFF0000u)));
                am[g] = _mm512_max_epu32(_mm512_maskz_and_epi32((__mmask16)~n0, r0, v16_u32(0x7FFFFFFFu)),
                                         _mm512_maskz_and_epi32((__mmask16)~n1, r1, v16_u32(0x7FFFFFFFu)));
            }
            const __m512i amx = v16_hmax16x16_epu32(am);
            const __m512i nb = _mm512_castps_si512(_mm512_mul_ps(_mm512_castsi512_ps(amx), c448));
            const __m512i e = _mm512_and_si512(_mm512_srli_epi32(nb, 23), v16_u32(0xFFu));
            const __m512i m = _mm512_and_si512(nb, v16_u32(0x7FFFFFu));
            const __mmask16 mnz = _mm512_test_epi32_mask(m, m);
            const __mmask16 small =
                _mm512_cmpeq_epi32_mask(e, _mm512_setzero_si512()) & _mm512_cmple_epu32_mask(m, v16_u32(0x400000u));
            const __mmask16 bump = mnz & (__mmask16)~small;
            __m512i sf = _mm512_mask_add_epi32(e, bump, e, v16_u32(1u));
            sf = _mm512_min_epu32(sf, v16_u32(254u));
            const __m512i ib = _mm512_slli_epi32(_mm512_sub_epi32(v16_u32(254u), sf), 23);
            const __m512i inv = _mm512_maskz_mov_epi32(_mm512_test_epi32_mask(sf, sf), ib);
            _mm512_store_si512((__m512i*)invb, inv);
            _mm512_store_si512((__m512i*)sfb, sf);
            for (int g = 0; g < 16; g += 2) {
                const __m512 iv0 = _mm512_set1_ps(invb[g]), iv1 = _mm512_set1_ps(invb[g + 1]);
                const float* yg = yb + 32 * g;
                const __m512i d0 = v16_e4m3_encode_dw<false>(_mm512_mul_ps(_mm512_load_ps(yg), iv0), 0x43E00000u, 0x7Fu);
                const __m512i d1 = v16_e4m3_encode_dw<false>(_mm512_mul_ps(_mm512_load_ps(yg + 16), iv0), 0x43E00000u, 0x7Fu);
                const __m512i d2 = v16_e4m3_encode_dw<false>(_mm512_mul_ps(_mm512_load_ps(yg + 32), iv1), 0x43E00000u, 0x7Fu);
                const __m512i d3 = v16_e4m3_encode_dw<false>(_mm512_mul_ps(_mm512_load_ps(yg + 48), iv1), 0x43E00000u, 0x7Fu);
                const __m512i pk = v16_pack4_u8(d0, d1, d2, d3);
                if (ntq)
                    _mm512_stream_si512((__m512i*)(qdst + 32 * (j0 + g)), pk);
                else
                    _mm512_storeu_si512((__m512i*)(qdst + 32 * (j0 + g)), pk);
            }
            for (int g = 0; g < 16; ++g) {
                const int64_t j = j0 + g;
                sbase[(j / 4) * 512 + (j % 4)] = (uint8_t)sfb[g];
            }
        }
    }
    for (int64_t j = j0; j < Gq; ++j) {
        const int64_t i = 32 * j;
        const __m512 y0 = v16_bf16_round(
            _mm512_mul_ps(_mm512_mul_ps(v16_bf16_load(qsrc + i), rr), _mm512_loadu_ps(WQ + i)), 0xFFFFu);
        const __m512 y1 = v16_bf16_round(
            _mm512_mul_ps(_mm512_mul_ps(v16_bf16_load(qsrc + i + 16), rr), _mm512_loadu_ps(WQ + i + 16)), 0xFFFFu);
        const uint32_t am = _mm512_reduce_max_epu32(_mm512_max_epu32(v16_abs_bits_nonan(y0), v16_abs_bits_nonan(y1)));
        const float n = from_bits(am) * INV_448;
        const uint32_t nb = bits(n);
        const uint32_t e = (nb >> 23) & 0xFFu, m = nb & 0x7FFFFFu;
        const bool bump = m != 0 && !(e == 0 && m <= 0x400000u);
        uint32_t sf = std::min<uint32_t>(e + (bump ? 1u : 0u), 254u);
        sf = n <= 0.0f ? 0u : sf;
        const __m512 inv = _mm512_set1_ps(sf == 0 ? 0.0f : from_bits((254u - sf) << 23));
        const __m128i c0 = v16_e4m3_encode<false>(_mm512_mul_ps(y0, inv), 0x43E00000u, 0x7Fu);
        const __m128i c1 = v16_e4m3_encode<false>(_mm512_mul_ps(y1, inv), 0x43E00000u, 0x7Fu);
        _mm_storeu_si128((__m128i*)(qdst + i), c0);
        _mm_storeu_si128((__m128i*)(qdst + i + 16), c1);
        sbase[(j / 4) * 512 + (j % 4)] = (uint8_t)sf;
    }
    for (int64_t j = Gq; j < Gp; ++j) sbase[(j / 4) * 512 + (j % 4)] = 0;
}
}  // namespace
#endif

// ======================================================================= R §5
void dsv41_fused_q_kv_rmsnorm_quant(
    const uint16_t* qr, int64_t T, int64_t Qs, int64_t qr_s0,
    const uint16_t* kv, int64_t Ks, int64_t kv_s0,
    const void* qw, int64_t qw_is_bf16, const void* kvw, int64_t kvw_is_bf16,
    double eps_d,
    uint8_t* q_out, int64_t qo_s0,
    uint8_t* q_scale, int64_t Tp, int64_t Gp,
    uint16_t* kv_out, int64_t kvo_s0, const int32_t* rsqrt_tab, const int32_t* rcp_tab,
    int64_t norm_block, int64_t norm_warps, int64_t norm_per) {
    const float eps = (float)eps_d;
    const NormLayout lay{(int)norm_block, (int)norm_warps, (int)norm_per};
    const int64_t Gq = Qs / 32;
    std::vector<float> wq(Qs > 0 ? Qs : 1), wk(Ks > 0 ? Ks : 1);
    for (int64_t i = 0; i < Qs; ++i) wq[i] = load_float(qw, i, qw_is_bf16 != 0);
    for (int64_t i = 0; i < Ks; ++i) wk[i] = load_float(kvw, i, kvw_is_bf16 != 0);
    const float* WQ = wq.data();
    const float* WK = wk.data();
    const bool par = Tp * (Qs + Ks) * 2 >= kParallelMinBytes && Tp > 1;
#if DSV41_CPU_AVX512
    const bool vec = Qs % 32 == 0 && Ks % 16 == 0;
    const bool nt = T * (Qs + 2 * Ks) >= (int64_t)(32 << 20);  // outputs well past the caches
    constexpr int64_t kPfRows = 2;
#endif

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
#if DSV41_CPU_AVX512
            if (vec) {
                if (r + kPfRows < T) {  // software prefetch a few rows ahead (latency-bound first pass)
                    const char* pq = (const char*)(qr + (r + kPfRows) * qr_s0);
                    const char* pk = (const char*)(kv + (r + kPfRows) * kv_s0);
                    for (int64_t b = 0; b < 2 * Qs; b += 64) _mm_prefetch(pq + b, _MM_HINT_T0);
                    for (int64_t b = 0; b < 2 * Ks; b += 64) _mm_prefetch(pk + b, _MM_HINT_T0);
                }
                qkv_row_avx512(qr + r * qr_s0, Qs, kv + r * kv_s0, Ks, WQ, WK, eps, rsqrt_tab, rcp_tab, lay, q_out + r * qo_s0, sbase, Gp,
                               kv_out + r * kvo_s0, nt, x);
                continue;
            }
#endif
            // KV row: RMSNorm, stored as bf16 (canonical NaN)
            {
                const uint16_t* src = kv + r * kv_s0;
                for (int64_t i = 0; i < Ks; ++i) x[i] = bf16_to_f32(src[i]);
                const float ms = div_full(tl_sum_sq(x, Ks, lay.block, lay.warps, lay.per), (float)Ks, rcp_tab) + eps;
                const float rr = rsqrt_approx(ms, rsqrt_tab);
                uint16_t* dst = kv_out + r * kvo_s0;
                for (int64_t i = 0; i < Ks; ++i) dst[i] = rk_bf16_canon((x[i] * rr) * WK[i]);
            }
            // Q row: RMSNorm, bf16 round trip, MXFP8 with FlashInfer's UE8M0 rule
            {
                const uint16_t* src = qr + r * qr_s0;
                for (int64_t i = 0; i < Qs; ++i) x[i] = bf16_to_f32(src[i]);
                const float ms = div_full(tl_sum_sq(x, Qs, lay.block, lay.warps, lay.per), (float)Qs, rcp_tab) + eps;
                const float rr = rsqrt_approx(ms, rsqrt_tab);
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
#if DSV41_CPU_AVX512
        if (vec && nt) _mm_sfence();  // order this thread's streaming stores before the join
#endif
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
