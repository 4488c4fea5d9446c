// dsv41 CPU kernels: the sparse-attention index builders (spec cache_ops.md §5-§7).
//
// Byte-exact with dsv41/reference/sparse_indices.py:
//   * index arithmetic is int32 and wraps like the Triton kernels / torch int32 tensors
//     (done here in uint32, so there is no signed-overflow UB);
//   * a block table is read only where the reference reads it: the entry must be wanted and
//     inside the table's logical shape, otherwise the slot is the sentinel -1;
//   * per-request arrays are read with the request index clamped into range (_per_request).
//
// Layout assumptions (checked by the Python wrappers, which fall back to the reference
// otherwise): index / output matrices have a unit last stride; block tables and 1-D tensors
// pass all their strides (sliced, transposed, column-strided tables are read in place).
// Parallelism: OpenMP over rows (tokens); every row is independent.
// (Integer work only: nothing from common.h is needed, so it is not included.)

#include <algorithm>
#include <cstdint>
#include <vector>

#include "common.h"

#if defined(__AVX512F__)
#include <immintrin.h>
#define DSV41_IDX_AVX512 1
#else
#define DSV41_IDX_AVX512 0
#endif

namespace {

inline int32_t wadd(int32_t a, int32_t b) { return (int32_t)((uint32_t)a + (uint32_t)b); }
inline int32_t wsub(int32_t a, int32_t b) { return (int32_t)((uint32_t)a - (uint32_t)b); }
inline int32_t wmul(int32_t a, int32_t b) { return (int32_t)((uint32_t)a * (uint32_t)b); }
inline int32_t i32(int64_t v) { return (int32_t)(uint32_t)(uint64_t)v; }  // torch's int32 wrap

// Rows per OpenMP chunk; below this many elements in total the loop runs single-threaded.
constexpr int64_t kParallelMin = 1 << 14;

// Unsigned x // d and x % d for 0 <= x < 2^31, d >= 1 (all the callers' operands).
// Power-of-two block sizes (the production case) use shifts; other sizes a correctly
// rounded double division, whose truncation is exact for these ranges (the gap from x/d to
// the next integer, >= 1/d, exceeds one ulp of the quotient), and which vectorizes.
struct Divider {
    uint32_t d;
    bool pow2;
    uint32_t shift, mask;
    double dd;
    explicit Divider(int64_t v) : d((uint32_t)v), pow2(v > 0 && (v & (v - 1)) == 0), shift(0), mask(0), dd((double)v) {
        if (pow2) {
            while ((1ull << shift) < (uint64_t)v) ++shift;
            mask = d - 1;
        }
    }
};

inline uint32_t udiv(uint32_t x, const Divider& D) {
    return D.pow2 ? (x >> D.shift) : (uint32_t)(int64_t)((double)x / D.dd);
}

// §7 span remap: -1 if v < 0 else (v // bs) * span + v % bs (int32 wrap).
inline int32_t remap(int32_t v, const Divider& bs, int32_t span) {
    const uint32_t u = (uint32_t)v;
    const uint32_t q = udiv(u, bs);
    const uint32_t r = u - q * bs.d;
    return v < 0 ? -1 : (int32_t)(q * (uint32_t)span + r);
}

// One table row lookup: slot of local index x (>= 0 wanted), or -1.  `trow` is the table
// row of the request (nullptr when the request index is outside the table).
inline int32_t table_slot(const int32_t* trow, int64_t cs, uint32_t ncols, int32_t x, const Divider& B) {
    if (x < 0 || trow == nullptr) return -1;
    const uint32_t u = (uint32_t)x;
    const uint32_t col = udiv(u, B);
    if (col >= ncols) return -1;
    return (int32_t)((uint32_t)trow[(int64_t)col * cs] * B.d + (u - col * B.d));
}

// One §5 row: dst[j] = slot of src[j] where valid (x >= 0, logical block < ncols; the
// request row is known to exist), else -1; `count` = number of valid entries.  COMPACT
// writes the valid slots to the front in their order and -1 after them.  The plain loop is
// branch-free so that it vectorizes; the compacting one has a data-dependent store address.
template <bool POW2, bool UNIT, bool COMPACT>
inline void translate_row(const int32_t* __restrict src, int32_t* __restrict dst, int64_t K,
                          const int32_t* __restrict trow, int64_t cs, uint32_t ncols, const Divider& B,
                          int32_t& count) {
    int32_t cnt = 0;
    const uint32_t d = B.d, sh = B.shift, mask = B.mask;
    const double dd = B.dd;
    for (int64_t j = 0; j < K; ++j) {
        const int32_t x = src[j];
        const uint32_t u = (uint32_t)x;
        const bool pres = x >= 0;
        uint32_t col, off;
        if (POW2) {
            col = u >> sh;
            off = u & mask;
        } else {
            col = pres ? (uint32_t)(int64_t)((double)x / dd) : 0u;
            off = u - col * d;
        }
        const bool ok = pres && col < ncols;
        const uint32_t cc = ok ? col : 0u;
        const int32_t bid = UNIT ? trow[cc] : trow[(int64_t)cc * cs];
        const int32_t slot = (int32_t)((uint32_t)bid * d + off);
        if (COMPACT) {
            if (ok) dst[cnt] = slot;
        } else {
            dst[j] = ok ? slot : -1;
        }
        cnt += ok ? 1 : 0;
    }
    if (COMPACT)
        for (int64_t j = cnt; j < K; ++j) dst[j] = -1;
    count = cnt;
}

template <bool COMPACT>
inline void translate_row_any(const int32_t* src, int32_t* dst, int64_t K, const int32_t* trow, int64_t cs,
                              uint32_t ncols, const Divider& B, int32_t& count) {
    if (cs == 1) {
        if (B.pow2)
            translate_row<true, true, COMPACT>(src, dst, K, trow, 1, ncols, B, count);
        else
            translate_row<false, true, COMPACT>(src, dst, K, trow, 1, ncols, B, count);
    } else {
        if (B.pow2)
            translate_row<true, false, COMPACT>(src, dst, K, trow, cs, ncols, B, count);
        else
            translate_row<false, false, COMPACT>(src, dst, K, trow, cs, ncols, B, count);
    }
}

// §7 fused "table lookup then span remap" for a power-of-two block size (the same size for
// both steps, as in every caller), unit-stride table row with ncols >= 1 entries:
//   slot = x >= 0 && x/bs < ncols ? trow[x/bs]*bs + x%bs : -1      (table_slot)
//   out  = slot >= 0 ? (slot/bs)*span + slot%bs : -1                (remap)
// Branch-free, one element; the vector versions below compute exactly the same thing.
inline int32_t slot_remap_pow2(int32_t x, const int32_t* __restrict trow, uint32_t ncols, uint32_t sh,
                               uint32_t mask, uint32_t span) {
    const uint32_t u = (uint32_t)x;
    const uint32_t col = u >> sh;
    const bool ok = x >= 0 && col < ncols;
    const uint32_t bid = (uint32_t)trow[ok ? col : 0u];
    const uint32_t slot = (bid << sh) + (u & mask);
    const uint32_t rm = (slot >> sh) * span + (slot & mask);
    return (ok && (int32_t)slot >= 0) ? (int32_t)rm : -1;
}

#if DSV41_IDX_AVX512
inline __m512i slot_remap_pow2_v(__m512i x, const int32_t* __restrict trow, __m512i ncols, __m128i sh,
                                 __m512i mask, __m512i span) {
    const __m512i col = _mm512_srl_epi32(x, sh);
    const __mmask16 ok = _mm512_cmpge_epi32_mask(x, _mm512_setzero_si512()) & _mm512_cmplt_epu32_mask(col, ncols);
    const __m512i bid = _mm512_mask_i32gather_epi32(_mm512_setzero_si512(), ok, col, trow, 4);
    const __m512i slot = _mm512_add_epi32(_mm512_sll_epi32(bid, sh), _mm512_and_si512(x, mask));
    const __mmask16 good = ok & _mm512_cmpge_epi32_mask(slot, _mm512_setzero_si512());
    const __m512i rm = _mm512_add_epi32(_mm512_mullo_epi32(_mm512_srl_epi32(slot, sh), span), _mm512_and_si512(slot, mask));
    return _mm512_mask_mov_epi32(_mm512_set1_epi32(-1), good, rm);
}
#endif

// dst[j] = slot_remap_pow2(src[j]) for j < n (src == nullptr: src[j] = start + j, int32 wrap).
inline void slot_remap_row_pow2(const int32_t* __restrict src, int32_t start, int32_t* __restrict dst, int64_t n,
                                const int32_t* __restrict trow, uint32_t ncols, uint32_t sh, uint32_t mask,
                                uint32_t span) {
    int64_t j = 0;
#if DSV41_IDX_AVX512
    const __m512i vn = _mm512_set1_epi32((int)ncols), vm = _mm512_set1_epi32((int)mask),
                  vs = _mm512_set1_epi32((int)span);
    const __m128i vsh = _mm_cvtsi32_si128((int)sh);
    const __m512i iota = _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
    for (; j + 16 <= n; j += 16) {
        const __m512i x = src ? _mm512_loadu_si512((const void*)(src + j))
                              : _mm512_add_epi32(_mm512_set1_epi32((int)wadd(start, (int32_t)j)), iota);
        _mm512_storeu_si512((void*)(dst + j), slot_remap_pow2_v(x, trow, vn, vsh, vm, vs));
    }
#endif
    if (src)
        for (; j < n; ++j) dst[j] = slot_remap_pow2(src[j], trow, ncols, sh, mask, span);
    else
        for (; j < n; ++j) dst[j] = slot_remap_pow2(wadd(start, (int32_t)j), trow, ncols, sh, mask, span);
}

inline void fill_m1(int32_t* __restrict dst, int64_t n) {
    for (int64_t j = 0; j < n; ++j) dst[j] = -1;
}

}  // namespace

extern "C" {

// §5 with the bounds-checked variant's rules: an entry whose request index is not a table
// row or whose logical block is past the table width is -1 and not counted, like x < 0.
void dsv41_compute_global_topk_indices_and_lens(
    const int32_t* topk, int64_t n_tok, int64_t K, int64_t topk_s0,
    const int32_t* t2r, int64_t t2r_s0,
    const int32_t* table, int64_t n_rows, int64_t n_cols, int64_t table_s0, int64_t table_s1,
    int64_t block_size,
    const uint8_t* valid, int64_t valid_s0,
    int32_t* out, int64_t out_s0,
    int32_t* lens, int64_t lens_s0,
    int64_t compact) {
    if (n_tok <= 0) return;
    const Divider B(block_size);
    const uint32_t ncols = (uint32_t)n_cols;
    const bool par = n_tok * std::max<int64_t>(K, 1) >= kParallelMin && n_tok > 1;
#pragma omp parallel for schedule(static) if (par)
    for (int64_t n = 0; n < n_tok; ++n) {
        const int32_t r = t2r[n * t2r_s0];
        const int32_t* src = topk + n * topk_s0;
        int32_t* dst = out + n * out_s0;
        int32_t cnt = 0;
        if (r < 0 || r >= n_rows || n_cols <= 0) {
            fill_m1(dst, K);  // no entry of the row is valid
        } else {
            const int32_t* trow = table + (int64_t)r * table_s0;
            if (compact)
                translate_row_any<true>(src, dst, K, trow, table_s1, ncols, B, cnt);
            else
                translate_row_any<false>(src, dst, K, trow, table_s1, ncols, B, cnt);
        }
        lens[n * lens_s0] = valid[n * valid_s0] ? cnt : 0;
    }
}

// §6 (token-parallel version).  qsl has R+1 entries (stride qsl_s0).
void dsv41_combine_topk_swa_indices(
    const int32_t* topk, int64_t T, int64_t K, int64_t topk_s0,
    const int32_t* qsl, int64_t qsl_s0,
    const int32_t* seq_lens, int64_t seq_n, int64_t seq_s0,
    const int32_t* gather_lens, int64_t gath_n, int64_t gath_s0,
    int64_t R,
    int64_t window_size, int64_t compress_ratio, int64_t topk_k, int64_t M, int64_t N,
    int32_t* out, int64_t W_out, int64_t out_s0,
    int32_t* lens, int64_t lens_s0) {
    if (T <= 0) return;
    if (R <= 0) {
        for (int64_t t = 0; t < T; ++t) {
            int32_t* dst = out + t * out_s0;
            for (int64_t j = 0; j < W_out; ++j) dst[j] = -1;
            lens[t * lens_s0] = 0;
        }
        return;
    }
    // Rebased request offsets (int32 wrap), contiguous for the bisection, and the
    // per-request values (clamped reads as in _per_request).
    std::vector<int32_t> rb(R + 1), Lv(R), gv(R);
    const int32_t base0 = qsl[0];
    for (int64_t i = 0; i <= R; ++i) rb[i] = wsub(qsl[i * qsl_s0], base0);
    for (int64_t b = 0; b < R; ++b) {
        Lv[b] = seq_n > 0 ? seq_lens[std::min<int64_t>(b, seq_n - 1) * seq_s0] : 0;
        gv[b] = gath_n > 0 ? gather_lens[std::min<int64_t>(b, gath_n - 1) * gath_s0] : 0;
    }
    const int32_t qend = rb[R];
    const int32_t Mi = i32(M), Ni = i32(N), win = i32(window_size);
    const int64_t kcols = std::min<int64_t>(K, W_out);
    const bool par = T * std::max<int64_t>(W_out, 1) >= kParallelMin && T > 1;
#pragma omp parallel for schedule(static) if (par)
    for (int64_t t = 0; t < T; ++t) {
        const int32_t ti = (int32_t)t;
        int64_t b = dsv41cpu::upper_bound(rb.data(), R, ti) - 1;
        b = std::min<int64_t>(std::max<int64_t>(b, 0), R - 1);
        const bool owned = ti < qend;
        const int32_t qs = rb[b], qe = rb[b + 1];
        const int32_t L = Lv[b], g = gv[b];
        const int32_t pos = wadd(wsub(L, wsub(qe, qs)), wsub(ti, qs));
        const int32_t gstart = wsub(L, g);
        int32_t k_len = 0;
        if (compress_ratio > 0) {
            int64_t q = (int64_t)wadd(pos, 1) / compress_ratio;  // C truncation
            q = std::max<int64_t>(q, 0);
            q = std::min<int64_t>(q, topk_k);
            k_len = (int32_t)q;
        }
        int32_t swa_start = wadd(wsub(pos, win), 1);
        swa_start = std::max(swa_start, 0);
        swa_start = std::max(swa_start, gstart);
        int32_t swa_len = std::max(wadd(wsub(pos, swa_start), 1), 0);
        if (!owned) {
            k_len = 0;
            swa_len = 0;
        }
        const int32_t base = wmul(Mi, (int32_t)b);
        const int64_t N64 = N;
        int32_t* dst = out + t * out_s0;
        const int32_t* src = topk + t * topk_s0;
        // top-k columns j < k_len (values of columns >= K are -1)
        const int64_t ktop = std::min<int64_t>(k_len, W_out);
        const int64_t kt_src = std::min<int64_t>(ktop, kcols);
        int64_t j = 0;
        for (; j < kt_src; ++j) {
            const int32_t v = src[j];
            dst[j] = (v >= 0 && (int64_t)v < N64) ? wadd(v, base) : -1;
        }
        for (; j < ktop; ++j) dst[j] = -1;
        // SWA columns k_len <= j < k_len + swa_len (int32 wrap of the bound)
        const int32_t e_swa = wadd(k_len, swa_len);
        const int64_t hi = std::min<int64_t>(e_swa, W_out);
        // value = base + N + (swa_start + (j - k_len) - gstart)
        const int32_t v0 = wadd(wadd(base, Ni), wsub(wsub(swa_start, k_len), gstart));
        for (j = std::max<int64_t>(k_len, 0); j < hi; ++j) dst[j] = wadd(v0, (int32_t)j);
        for (j = std::max<int64_t>(std::max<int64_t>(hi, ktop), 0); j < W_out; ++j) dst[j] = -1;
        lens[t * lens_s0] = e_swa;
    }
}

// §7.  Optional tensors come as nullptr.  sparse rows are W_swa + PT wide.
void dsv41_build_flashinfer_mixed_sparse_indices(
    const int32_t* dswa, int64_t D, int64_t W_swa, int64_t dswa_s0,
    const int32_t* dci, int64_t K_dec, int64_t dci_s0,
    const int32_t* dclens, int64_t dclens_s0,
    const int32_t* pti, int64_t P, int64_t K_pre, int64_t pti_s0,
    const int32_t* qsl, int64_t qsl_n, int64_t qsl_s0,
    const int32_t* seq_lens, int64_t R, int64_t seq_s0,
    const int32_t* t2r, int64_t t2r_s0,
    const int32_t* swa_table, int64_t swa_rows, int64_t swa_cols, int64_t swa_s0, int64_t swa_s1,
    int64_t swa_block_size,
    const int32_t* comp_table, int64_t comp_rows, int64_t comp_cols, int64_t comp_s0, int64_t comp_s1,
    int64_t comp_block_size,
    int64_t window_size, int64_t compress_ratio, int64_t topk_k,
    int64_t are_local,
    const uint8_t* dvalid, int64_t dvalid_s0,
    int64_t swa_span, int64_t comp_span,
    const int32_t* replay, int64_t replay_n, int64_t replay_s0,
    int32_t* out, int64_t out_w, int64_t out_s0,
    int32_t* lens, int64_t lens_s0) {
    if (D + P <= 0) return;
    const int64_t PT = out_w - W_swa;
    const Divider sbs(swa_block_size), cbs(comp_block_size);
    const int32_t sspan = i32(swa_span), cspan = i32(comp_span);
    const int32_t wswa = i32(W_swa);
    const int32_t win = i32(window_size);
    const bool par = (D + P) * std::max<int64_t>(out_w, 1) >= kParallelMin && (D + P) > 1;
    // Fast prefill paths: power-of-two block size, unit-stride table with at least one column
    // (0 <= cols < 2^31, so the uint32 column compare is the reference's bound check).
    const bool fast_swa = sbs.pow2 && sbs.shift < 31 && swa_s1 == 1 && swa_cols > 0 && swa_cols <= INT32_MAX;
    const bool fast_comp = cbs.pow2 && cbs.shift < 31 && comp_s1 == 1 && comp_cols > 0 && comp_cols <= INT32_MAX;

#pragma omp parallel for schedule(static) if (par)
    for (int64_t n = 0; n < D + P; ++n) {
        int32_t* dst = out + n * out_s0;
        int32_t* cdst = dst + W_swa;
        if (n < D) {
            // ---------------- decode row
            const int32_t* s = dswa + n * dswa_s0;
            for (int64_t j = 0; j < W_swa; ++j) dst[j] = remap(s[j], sbs, sspan);
            const int64_t kd = dci ? std::min<int64_t>(K_dec, PT) : 0;
            int32_t c_len = 0;
            if (dci == nullptr || K_dec == 0) {
                for (int64_t j = 0; j < PT; ++j) cdst[j] = -1;
                c_len = 0;
            } else if (are_local) {
                const int32_t r = t2r[n * t2r_s0];
                const int32_t* trow = (r >= 0 && r < comp_rows) ? comp_table + (int64_t)r * comp_s0 : nullptr;
                const int32_t* c = dci + n * dci_s0;
                int32_t cnt = 0;
                int64_t j = 0;
                for (; j < kd; ++j) {
                    const int32_t v = c[j];
                    cnt += v >= 0 ? 1 : 0;
                    cdst[j] = remap(table_slot(trow, comp_s1, (uint32_t)comp_cols, v, cbs), cbs, cspan);
                }
                for (; j < PT; ++j) cdst[j] = -1;
                const bool ok = dvalid == nullptr || dvalid[n * dvalid_s0] != 0;
                c_len = ok ? cnt : 0;
            } else {
                const int32_t* c = dci + n * dci_s0;
                int64_t j = 0;
                for (; j < kd; ++j) cdst[j] = remap(c[j], cbs, cspan);
                for (; j < PT; ++j) cdst[j] = -1;
                c_len = dclens ? dclens[n * dclens_s0] : i32(K_dec);
            }
            lens[n * lens_s0] = wadd(wswa, c_len);
        } else {
            // ---------------- prefill row
            const int64_t p = n - D;
            const int32_t req = t2r[n * t2r_s0];
            int32_t qs = 0, qe = 0, L = 0, rs = 0;
            // _per_request reads: query_start_loc[:R], query_start_loc[1:R+1] and seq_lens, each
            // with the request index clamped into its own length
            const int64_t qs_n = std::min<int64_t>(R, qsl_n), qe_n = std::min<int64_t>(R, qsl_n - 1);
            const int64_t rq = std::max<int64_t>(req, 0);
            if (qs_n > 0) qs = qsl[std::min<int64_t>(rq, qs_n - 1) * qsl_s0];
            if (qe_n > 0) qe = qsl[(1 + std::min<int64_t>(rq, qe_n - 1)) * qsl_s0];
            if (R > 0) L = seq_lens[std::min<int64_t>(rq, R - 1) * seq_s0];
            if (replay_n > 0) rs = replay[std::min<int64_t>(std::max<int64_t>(req, 0), replay_n - 1) * replay_s0];
            const int32_t ni = (int32_t)n;
            const int32_t pos = wadd(wsub(L, wsub(qe, qs)), wsub(ni, qs));
            int32_t swa_start = std::max(wadd(wsub(pos, win), 1), 0);
            swa_start = std::max(swa_start, rs);
            const int32_t swa_len = wadd(wsub(pos, swa_start), 1);
            int32_t k_len = 0;
            if (compress_ratio > 0) {
                const int64_t q = (int64_t)wadd(pos, 1) / compress_ratio;
                k_len = (int32_t)std::min<int64_t>(q, (int64_t)i32(topk_k));
            }
            // SWA columns
            const int32_t* strow = (req >= 0 && req < swa_rows) ? swa_table + (int64_t)req * swa_s0 : nullptr;
            const int64_t nswa = std::min<int64_t>(std::max<int32_t>(swa_len, 0), W_swa);
            int64_t j = 0;
            if (fast_swa && strow != nullptr) {
                slot_remap_row_pow2(nullptr, swa_start, dst, nswa, strow, (uint32_t)swa_cols, sbs.shift, sbs.mask,
                                    (uint32_t)sspan);
                j = nswa;
            } else if (strow == nullptr) {
                fill_m1(dst, nswa);
                j = nswa;
            }
            for (; j < nswa; ++j) {
                const int32_t q = wadd(swa_start, (int32_t)j);
                dst[j] = remap(table_slot(strow, swa_s1, (uint32_t)swa_cols, q, sbs), sbs, sspan);
            }
            fill_m1(dst + j, W_swa - j);
            // compressed columns
            const int32_t* ctrow = (req >= 0 && req < comp_rows) ? comp_table + (int64_t)req * comp_s0 : nullptr;
            const int64_t nc = std::min<int64_t>(std::min<int64_t>(std::max<int32_t>(k_len, 0), K_pre), PT);
            const int32_t* x = pti + p * pti_s0;
            j = 0;
            if (fast_comp && ctrow != nullptr) {
                slot_remap_row_pow2(x, 0, cdst, nc, ctrow, (uint32_t)comp_cols, cbs.shift, cbs.mask, (uint32_t)cspan);
                j = nc;
            } else if (ctrow == nullptr) {
                fill_m1(cdst, nc);
                j = nc;
            }
            for (; j < nc; ++j) cdst[j] = remap(table_slot(ctrow, comp_s1, (uint32_t)comp_cols, x[j], cbs), cbs, cspan);
            fill_m1(cdst + j, PT - j);
            lens[n * lens_s0] = wadd(wswa, k_len);
        }
    }
}

}  // extern "C"
