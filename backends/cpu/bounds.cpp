// dsv41 CPU backend: index pre-scans (no torch, C++17).
//
// The CPU kernels check every index they would follow before they write anything, always
// (not only under DSV41_VALIDATE): one pass over the index vectors -- never over the data --
// that returns the position of the first index outside its tensor, or -1.  The launchers
// (bounds.py) turn a hit into the typed ValueError of dsv41.core.index_checks, so a bad slot,
// block id, length or position costs a Python exception instead of the process.
//
// Index vectors are int32 or int64 with an element stride; every comparison is done in
// int64, so no value (int32 min, 2^31 - 1, 2^32 + 5) can wrap around.

#include <climits>
#include <cstdint>

#include "common.h"

namespace {

using dsv41cpu::load_index;

template <typename V, typename M>
bool any_outside_t(const V* v, int64_t n, int64_t lo, int64_t hi, bool skip_negative,
                   const M* mask) {
    // x in [lo, hi) <=> (unsigned)x - (unsigned)lo < hi - lo (wrapping, so no signed
    // overflow); integer accumulators (not bool) so the loops vectorize
    const uint64_t span = static_cast<uint64_t>(hi - lo);
    uint64_t bad = 0;
    if (skip_negative && mask) {
        for (int64_t i = 0; i < n; ++i) {
            const int64_t x = v[i];
            bad |= static_cast<uint64_t>((mask[i] >= 0) & (x >= hi));
        }
    } else if (skip_negative) {
        for (int64_t i = 0; i < n; ++i) bad |= static_cast<uint64_t>(static_cast<int64_t>(v[i]) >= hi);
    } else if (mask) {
        for (int64_t i = 0; i < n; ++i) {
            const uint64_t d = static_cast<uint64_t>(static_cast<int64_t>(v[i])) - static_cast<uint64_t>(lo);
            bad |= static_cast<uint64_t>((mask[i] >= 0) & (d >= span));
        }
    } else {
        for (int64_t i = 0; i < n; ++i)
            bad |= static_cast<uint64_t>(
                static_cast<uint64_t>(static_cast<int64_t>(v[i])) - static_cast<uint64_t>(lo) >= span);
    }
    return bad != 0;
}

bool any_outside(const void* v, int32_t v64, int64_t n, int64_t lo, int64_t hi, bool skip_negative,
                 const void* mask, int32_t m64) {
    if (v64) {
        const auto* pv = static_cast<const int64_t*>(v);
        if (!mask) return any_outside_t<int64_t, int64_t>(pv, n, lo, hi, skip_negative, nullptr);
        return m64 ? any_outside_t(pv, n, lo, hi, skip_negative, static_cast<const int64_t*>(mask))
                   : any_outside_t(pv, n, lo, hi, skip_negative, static_cast<const int32_t*>(mask));
    }
    const auto* pv = static_cast<const int32_t*>(v);
    if (!mask) return any_outside_t<int32_t, int32_t>(pv, n, lo, hi, skip_negative, nullptr);
    return m64 ? any_outside_t(pv, n, lo, hi, skip_negative, static_cast<const int64_t*>(mask))
               : any_outside_t(pv, n, lo, hi, skip_negative, static_cast<const int32_t*>(mask));
}

}  // namespace

extern "C" {

// First i in [0, n) with v[i] outside [lo, hi).  skip_negative: v[i] < 0 is allowed (a skip
// value).  mask (nullable): element i is only checked where mask[i] >= 0 (e.g. the positions
// of tokens whose slot writes).
int64_t dsv41_first_outside(const void* v, int32_t v64, int64_t vs, int64_t n, int64_t lo,
                            int64_t hi, int32_t skip_negative, const void* mask, int32_t m64,
                            int64_t ms) {
    // Common case first: unit-stride vectors, every index in range.  A branch-free pass (the
    // compiler vectorizes it) answers "any bad?"; only then does the scalar loop find where.
    const bool flat = vs == 1 && (!mask || ms == 1);
    if (flat && !any_outside(v, v64, n, lo, hi, skip_negative != 0, mask, m64)) return -1;
    for (int64_t i = 0; i < n; ++i) {
        const int64_t x = load_index(v, i, vs, v64);
        if (skip_negative && x < 0) continue;
        if (mask && load_index(mask, i, ms, m64) < 0) continue;
        if (x < lo || x >= hi) return i;
    }
    return -1;
}

// dequantize_and_gather_k_cache: the first request r whose gather would leave a tensor
// (a negative length, gather_lens[r] > seq_lens[r], offset + n > out_rows, a logical block
// past the table width, or a table entry read outside [0, num_blocks)); -1 when all are in.
// Request r reads positions L-n ... L-1 (L = seq_lens[r], n = gather_lens[r] or L).
int64_t dsv41_gather_first_bad(const void* seq, int32_t seq64, int64_t seq_s,
                               const void* glen, int32_t glen64, int64_t glen_s, int64_t R,
                               const void* bt, int32_t bt64, int64_t bt_s0, int64_t bt_s1,
                               int64_t width, int64_t num_blocks, int64_t block_size,
                               int64_t offset, int64_t out_rows) {
    if (block_size <= 0) return R > 0 ? 0 : -1;
    for (int64_t r = 0; r < R; ++r) {
        const int64_t L = load_index(seq, r, seq_s, seq64);
        const int64_t n = glen ? load_index(glen, r, glen_s, glen64) : L;
        if (L < 0 || n < 0 || n > L) return r;
        if (offset < 0 || n > out_rows - offset) return r;
        if (n == 0) continue;
        const int64_t first = (L - n) / block_size, last = (L - 1) / block_size;
        if (last >= width) return r;
        for (int64_t j = first; j <= last; ++j) {
            const int64_t b = load_index(bt, r * bt_s0 + j * bt_s1, 1, bt64);
            if (b < 0 || b >= num_blocks) return r;
        }
    }
    return -1;
}

// fused_save_compress_norm, CR 2: the first token whose indices leave a tensor -- a ring slot
// past the state cache, a request index outside [0, R), a position outside [0, 2^31) -- among
// the tokens with a slot >= 0; T + i for a prev_row_indices[i] >= prev_n (i < R); T + R for a
// query_start_loc entry outside [0, T]; -1 when all are in.  (Consistency between the two --
// a token inside its request's chunk -- is DSV41_VALIDATE's: it moves no index out of bounds.)
int64_t dsv41_save_first_bad(const void* slot, int32_t s64, int64_t s_s, int64_t T,
                             const void* pos, int32_t p64, int64_t p_s,
                             const void* t2r, int32_t r64, int64_t r_s,
                             const void* qsl, int32_t q64, int64_t q_s, int64_t R,
                             int64_t ring_slots,
                             const void* prev_idx, int32_t pi64, int64_t pi_s, int64_t pi_n,
                             int64_t prev_n) {
    for (int64_t i = 0; i <= R; ++i) {
        const int64_t q = load_index(qsl, i, q_s, q64);
        if (q < 0 || q > T) return T + R;
    }
    for (int64_t t = 0; t < T; ++t) {
        const int64_t s = load_index(slot, t, s_s, s64);
        if (s < 0) continue;
        const int64_t req = load_index(t2r, t, r_s, r64);
        const int64_t p = load_index(pos, t, p_s, p64);
        if (s >= ring_slots || req < 0 || req >= R || p < 0 || p > INT32_MAX) return t;
    }
    if (prev_idx)
        for (int64_t i = 0; i < R && i < pi_n; ++i)
            if (load_index(prev_idx, i, pi_s, pi64) >= prev_n) return T + i;
    return -1;
}

}  // extern "C"
