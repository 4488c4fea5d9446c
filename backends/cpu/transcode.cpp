// dsv41 CPU kernel of transcode_k_cache: OCP <-> FNUZ e4m3 paged K caches.
//
//   dsv41_transcode_k_cache   records 584 / 528 (ue8m0 groups) and 132 (fp32 scale, row-major
//                             or ROCm 16x16 tiled)
//
// The rules (group modes RESCALE / PASS / KEEP, byte maps, scale arithmetic) are defined in
// dsv41/transcode.py and dsv41/reference/transcode.py; this is a byte-for-byte port: integer
// operations only.  OpenMP over (page, token); each token's record is read into a local
// buffer before anything is written, so src == dst (in place) is safe.  Only the record
// bytes of a listed page are written (value region + scale region), never page padding.

#include <omp.h>

#include <cstdint>
#include <cstring>

#include "record_geometry.h"  // generated from dsv41.core.formats at build time (_build.py)

namespace {

enum Mode { RESCALE = 0, PASS = 1, KEEP = 2 };

// OCP byte -> FNUZ byte with the same bits (value halves): −0 -> 0, NaN -> 0x80.
static inline uint8_t o2f_bits(uint8_t b) {
    if ((b & 0x7F) == 0x7F) return 0x80;
    return b == 0x80 ? 0 : b;
}

// OCP byte -> FNUZ byte of the same value (saturating at ±240; ±0 -> 0; NaN -> 0x80).
static inline uint8_t o2f_value(uint8_t b) {
    const int sign = b & 0x80, mag = b & 0x7F;
    if (mag == 0x7F) return 0x80;
    if (mag == 0) return 0;
    int out = mag >= 0x78 ? 0x7F : (mag >= 8 ? mag + 8 : mag << 1);
    return (uint8_t)(sign | out);
}

// FNUZ byte -> OCP byte with the same bits (value doubles): NaN -> 0x7F, ±240 -> ±448.
static inline uint8_t f2o_bits(uint8_t b) {
    if (b == 0x80) return 0x7F;
    return (b & 0x7F) == 0x7F ? (uint8_t)(b - 1) : b;
}

// FNUZ byte -> OCP byte of the same value, RNE (NaN -> 0x7F; sign kept).
static inline uint8_t f2o_value(uint8_t b) {
    if (b == 0x80) return 0x7F;
    const int sign = b & 0x80, mag = b & 0x7F;
    int out;
    if (mag >= 16) {
        out = mag - 8;
    } else {
        const int q = mag >> 1;
        out = q + (mag & q & 1);
    }
    return (uint8_t)(sign | out);
}

static inline void map_group(const uint8_t* in, uint8_t* out, int n, bool to_fnuz, bool keep) {
    if (to_fnuz) {
        if (keep) for (int i = 0; i < n; ++i) out[i] = o2f_value(in[i]);
        else      for (int i = 0; i < n; ++i) out[i] = o2f_bits(in[i]);
    } else {
        if (keep) for (int i = 0; i < n; ++i) out[i] = f2o_value(in[i]);
        else      for (int i = 0; i < n; ++i) out[i] = f2o_bits(in[i]);
    }
}

static inline bool has_240(const uint8_t* q, int n) {
    int any = 0;
    for (int i = 0; i < n; ++i) any |= (q[i] & 0x7F) == 0x7F;
    return any != 0;
}

// ue8m0 code: returns the mode and updates *code for RESCALE.
static inline int ue8m0_mode(const uint8_t* q, int n, bool src_fnuz, uint8_t* code) {
    const int c = *code;
    if (c == 0 || c == 255) return PASS;
    if (!src_fnuz) {
        if (c == 254) return KEEP;
        *code = (uint8_t)(c + 1);
        return RESCALE;
    }
    if (c == 1 || has_240(q, n)) return KEEP;
    *code = (uint8_t)(c - 1);
    return RESCALE;
}

// fp32 scale bits: returns the mode and updates *bits for RESCALE.
static inline int fp32_mode(const uint8_t* q, int n, bool src_fnuz, uint32_t* bits) {
    const uint32_t s = *bits, sign = s & 0x80000000u, mag = s & 0x7FFFFFFFu, e = mag >> 23;
    if (e == 255) return PASS;
    if (!src_fnuz) {
        if (e == 254) return KEEP;
        *bits = e >= 1 ? s + (1u << 23) : (sign | (mag << 1));
        return RESCALE;
    }
    const bool halvable = e >= 2 || (s & 1u) == 0;
    if (!halvable || has_240(q, n)) return KEEP;
    *bits = e >= 2 ? s - (1u << 23) : (sign | (mag >> 1));
    return RESCALE;
}

}  // namespace

extern "C" {

// src/dst: first byte of the caches; s_page/d_page: their stride(0) in bytes.
// ids: n_ids int64 page indices (negative or >= n_blocks: skipped).
// width: 584, 528 or 132; tiled: 132 record in ROCm 16x16 tiles (block_size % 16 == 0).
// Returns 0, or 1 for arguments outside the contract (nothing written).
int dsv41_transcode_k_cache(const uint8_t* src, int64_t s_page, uint8_t* dst, int64_t d_page,
                            const int64_t* ids, int64_t n_ids, int64_t n_blocks, int64_t block_size,
                            int32_t width, int32_t src_fnuz, int32_t dst_fnuz, int32_t tiled) {
    rec::Geometry geo;
    if ((width != 584 && width != 528 && width != 132) || !rec::lookup(width, geo)) return 1;
    const int VB = geo.value_bytes, SB = geo.scale_bytes, NG = geo.n_groups, G = geo.group;
    const bool fp32 = width == 132;  // one fp32 scale per token (the ue8m0 records: code bytes)
    const int64_t B = block_size;
    if (B < 1 || (tiled && (width != 132 || B % 16 != 0))) return 1;
    const bool same = (src_fnuz != 0) == (dst_fnuz != 0);
    const bool to_fnuz = dst_fnuz != 0;
    const int64_t total = n_ids * B;

#pragma omp parallel for schedule(static)
    for (int64_t it = 0; it < total; ++it) {
        const int64_t blk = ids[it / B];
        const int64_t t = it % B;
        if (blk < 0 || blk >= n_blocks) continue;
        const uint8_t* sp = src + blk * s_page;
        uint8_t* dp = dst + blk * d_page;
        // value byte d of token t lives at voff(d); scales at B*VB + t*SB (never tiled here)
        auto voff = [&](int d) -> int64_t {
            if (!tiled) return t * VB + d;
            // ROCm 16 x 16 tiles of the 132 record's 128 value bytes
            return (t / 16) * (16 * VB) + (d / 16) * 256 + (t % 16) * 16 + (d % 16);
        };
        // the largest record handled: 584 (value bytes) and 528 (scale bytes)
        uint8_t v[rec::Record<584>::value_bytes], s[rec::Record<528>::scale_bytes];
        uint8_t vo[sizeof v], so[sizeof s];
        if (!tiled) {
            std::memcpy(v, sp + t * VB, VB);
        } else {
            for (int d = 0; d < VB; d += 16) std::memcpy(v + d, sp + voff(d), 16);
        }
        std::memcpy(s, sp + B * VB + t * SB, SB);
        std::memcpy(vo, v, VB);  // bf16 tail (584) verbatim
        std::memcpy(so, s, SB);  // pad scale byte (584) verbatim
        if (!same) {
            for (int g = 0; g < NG; ++g) {
                const uint8_t* q = v + g * G;
                int mode;
                if (fp32) {
                    uint32_t bits = (uint32_t)s[0] | ((uint32_t)s[1] << 8) | ((uint32_t)s[2] << 16) |
                                    ((uint32_t)s[3] << 24);
                    mode = fp32_mode(q, G, src_fnuz != 0, &bits);
                    for (int k = 0; k < 4; ++k) so[k] = (uint8_t)(bits >> (8 * k));
                } else {
                    uint8_t code = s[g];
                    mode = ue8m0_mode(q, G, src_fnuz != 0, &code);
                    so[g] = code;
                }
                map_group(q, vo + g * G, G, to_fnuz, mode == KEEP);
            }
        }
        if (!tiled) {
            std::memcpy(dp + t * VB, vo, VB);
        } else {
            for (int d = 0; d < VB; d += 16) std::memcpy(dp + voff(d), vo + d, 16);
        }
        std::memcpy(dp + B * VB + t * SB, so, SB);
    }
    return 0;
}

}  // extern "C"
