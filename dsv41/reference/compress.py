"""Pure-PyTorch reference of V4.1 ``fused_compress_quant_cache`` (spec cache_ops.md §8).

* ``fused_save_compress_norm`` — pool each closed group of ``compress_ratio`` rows
  (softmax over the rows, per dim), RMSNorm it into a bf16 latent, and keep the
  ratio-2 ring of the open group's rows (C §8.1).
* ``rope_quant_insert`` — GPT-J RoPE on the last 64 dims, then store the latent in
  the compressed cache: 584 / 528 / 288-byte paged records or plain bf16 / e4m3fn
  rows (C §8.2).

Both follow the kernel contract (docs/kernel_contract.md): arguments are already
validated, outputs are written in place, nothing is returned, and no byte outside
the addressed rows / records (page padding, other rows) is touched.

Numerics follow what vLLM's Triton kernels compute on an H200 (C §0.3,
R §1, upstream_findings.md F2/F3).  The approximate primitives of §8.1
(``ex2.approx``, ``div.full``, ``rsqrt.approx``) are computed as the GPU computes them
(``dsv41.core.gpu_approx``), the norm's sum of squares in vLLM's order; this reproduces the
golden vectors byte for byte.
"""

from __future__ import annotations

import torch

from ..core.gpu_approx import div_full, exp_approx, rsqrt_approx, tl_sum_sq
from ..core import index_checks as _ic
from ..core.codecs import (
    clamp_sym,
    e4m3_encode,
    fma32,
)
from ..core.formats import V4_FP8, V41_MXFP8, V41_NVFP4, CacheLayout, record_for_width
from .k_cache import quantize_nvfp4_groups, quantize_ue8m0_groups

__all__ = ["fused_save_compress_norm", "save_ring_rows", "rope_quant_insert"]

F32 = torch.float32
F64 = torch.float64

HEAD = 512  # latent width
NOPE = 448  # dims 0..447 are NoPE, 448..511 the 64 RoPE dims (32 GPT-J pairs)
ROPE_PAIRS = 32
BF16_NAN = 0x7FFF  # the bf16 NaN every computed NaN becomes on the GPU (F3)


# --------------------------------------------------------------------------------------
# small helpers
# --------------------------------------------------------------------------------------


def _bf16_bits(x: torch.Tensor) -> torch.Tensor:
    """fp32 -> bf16 RNE bits (int16); a computed NaN is the GPU's canonical 0x7FFF (F3)."""
    bits = x.to(torch.bfloat16).view(torch.int16)
    return torch.where(torch.isnan(x), torch.full_like(bits, BF16_NAN), bits)


def _le_bytes16(bits: torch.Tensor) -> torch.Tensor:
    """[..., n] int16 -> [..., 2n] uint8, little-endian (C §0.2)."""
    b = bits.to(torch.int32) & 0xFFFF
    return torch.stack((b & 0xFF, b >> 8), dim=-1).flatten(-2).to(torch.uint8)


def _page_bytes(kv_cache: torch.Tensor) -> torch.Tensor:
    """``[num_blocks, B*W]`` uint8 view of the *used* bytes of every page.

    The page base is ``block * stride(0)`` (C §1.1); the padding past ``B*W`` is not
    part of the view, so it can never be written.
    """
    nb, blk, width = kv_cache.shape
    return torch.as_strided(
        kv_cache, (nb, blk * width), (kv_cache.stride(0), 1), kv_cache.storage_offset()
    )


# --------------------------------------------------------------------------------------
# fused_save_compress_norm (C §8.1)
# --------------------------------------------------------------------------------------


def _pool(older: torch.Tensor, newer: torch.Tensor) -> torch.Tensor:
    """Softmax-weighted sum of two ``[n, 1024]`` kv|score rows, per dim (C §8.1 ``pool``).

    ``m = max``, weights ``e^(s - m) / Σ`` with the GPU's ``tl.exp`` and ``div.full``
    (``dsv41.core.gpu_approx``), then ``pooled = fma(w_older, kv_older, fl32(w_newer · kv_newer))``.
    """
    kva, sa = older[:, :HEAD], older[:, HEAD:]
    kvb, sb = newer[:, :HEAD], newer[:, HEAD:]
    m = torch.maximum(sa, sb)
    ea, eb = exp_approx(sa - m), exp_approx(sb - m)
    den = ea + eb
    wa, wb = div_full(ea, den), div_full(eb, den)
    return fma32(wa, kva, wb * kvb)


def _rmsnorm_bf16_bits(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``bf16(x · rsqrt(Σx²/512 + eps) · w)`` in fp32 (C §8.1 ``rmsnorm``), as int16 bits.

    Σx² in the order of vLLM's ``tl.sum`` over a 512-wide fp32 row with 4 warps (4 contiguous
    elements per thread: ``gpu_approx.tl_sum_sq``), ``/512`` exact, the GPU's
    ``rsqrt.approx.ftz`` (``dsv41.core.gpu_approx``).
    """
    ss = tl_sum_sq(x, warps=4, per_thread=4)
    var = ss / HEAD + torch.tensor(eps, dtype=F32, device=x.device)
    r = rsqrt_approx(var)
    return _bf16_bits((x * r[:, None]) * weight.to(F32))


def fused_save_compress_norm(
    kv_score, positions, state_cache, slot_mapping, query_start_loc, token_to_req_indices,
    rms_norm_weight, rms_norm_eps, compress_ratio, latent_out, prev_rows=None, prev_row_indices=None,
) -> None:
    """C §8.1.  With ``prev_rows`` (CR 2), request r's first token takes its older row
    from ``prev_rows[prev_row_indices[r]]`` where that index is >= 0 (the ring
    otherwise), and the ring is left to ``save_ring_rows``."""
    _ic.enforce("fused_save_compress_norm", [
        kv_score, positions, state_cache, slot_mapping, query_start_loc, token_to_req_indices,
        rms_norm_weight, rms_norm_eps, compress_ratio, latent_out, prev_rows, prev_row_indices])
    T = slot_mapping.numel()
    if T == 0:
        return
    dev = kv_score.device
    slot = slot_mapping.to(dev, torch.int64)
    pos = positions[:T].to(torch.int64)

    if compress_ratio == 1:
        # CR 1: every token with a slot >= 0 is its own group.
        tok = torch.nonzero(slot >= 0).flatten()
        pooled = kv_score[tok, :HEAD]
    else:
        cap = state_cache.shape[1]
        t = torch.arange(T, device=dev)
        qsl = query_start_loc.to(torch.int64)
        req = token_to_req_indices[:T].to(torch.int64)
        first = t == qsl[req]  # first token of its request's chunk
        closes = (pos % 2 == 1) & (slot >= 0)  # group (2j, 2j+1) closes at the odd position
        # Group closed inside the chunk: both rows from the input.
        t_in = torch.nonzero(closes & ~first).flatten()
        # Group closed by the chunk's first token: the older row is the ring row that
        # the previous chunk stored; read here, before the ring update below.
        t_ring = torch.nonzero(closes & first).flatten()
        ring_rows = state_cache[slot[t_ring] // cap, (pos[t_ring] - 1) % cap]
        if prev_rows is not None:
            idx = prev_row_indices.to(dev, torch.int64)[req[t_ring]]
            given = idx >= 0
            ring_rows = torch.where(
                given[:, None], prev_rows[idx.clamp(min=0), : 2 * HEAD].to(F32), ring_rows
            )
        tok = torch.cat((t_in, t_ring))
        older = torch.cat((kv_score[t_in - 1], ring_rows))
        newer = kv_score[tok]
        pooled = _pool(older, newer)

    # Only closing rows are written; every other latent_out row keeps its bytes.
    latent_out.view(torch.int16)[tok] = _rmsnorm_bf16_bits(
        pooled, rms_norm_weight, rms_norm_eps
    )

    if compress_ratio == 2 and prev_rows is None:
        _save_ring(kv_score, state_cache, slot, query_start_loc)


def save_ring_rows(rows, slot_mapping, state_cache) -> None:
    """Copy fp32 ``rows[i]`` to ring row ``(s // C, s % C)`` for each slot ``s >= 0``.

    Rows are stored in order, so of two rows with one slot the later one stays.
    """
    _ic.enforce("save_ring_rows", [rows, slot_mapping, state_cache])
    slot = slot_mapping.to(rows.device, torch.int64)
    u = torch.nonzero(slot >= 0).flatten()
    if u.numel() == 0:
        return
    cap = state_cache.shape[1]
    dst = slot[u]
    uniq, inv = torch.unique(dst, return_inverse=True)
    last = torch.full_like(uniq, -1).scatter_reduce(0, inv, u, "amax")
    u = u[u == last[inv]]
    state_cache[slot[u] // cap, slot[u] % cap] = rows[u, : 2 * HEAD]


def _save_ring(kv_score, state_cache, slot, query_start_loc) -> None:
    """C §8.1 ring update: per request chunk ``[s, e)`` whose first slot is >= 0, copy the
    last ``min(e - s, capacity)`` rows (slot >= 0) verbatim to ``(slot // cap, slot % cap)``."""
    T = slot.numel()
    dev = slot.device
    cap = state_cache.shape[1]
    qsl = query_start_loc.to(dev, torch.int64)
    R = qsl.numel() - 1
    if R <= 0:
        return
    u = torch.arange(T, device=dev)
    # Chunk r holding token u: qsl[r] <= u < qsl[r + 1] (empty chunks are skipped over).
    r = torch.searchsorted(qsl[1:], u, right=True).clamp(max=R - 1)
    s, e = qsl[r], qsl[r + 1]
    in_chunk = (u >= s) & (u < e)
    first_ok = slot[s.clamp(0, T - 1)] >= 0
    write = in_chunk & first_ok & (u >= e - cap) & (slot >= 0)
    u = torch.nonzero(write).flatten()
    if u.numel() == 0:
        return
    blk, row = slot[u] // cap, slot[u] % cap
    # A request program stores its rows in token order: the last writer of a ring row wins.
    dst = blk * cap + row
    uniq, inv = torch.unique(dst, return_inverse=True)
    last = torch.full_like(uniq, -1).scatter_reduce(0, inv, u, "amax")
    keep = u == last[inv]
    u, blk, row = u[keep], blk[keep], row[keep]
    state_cache[blk, row] = kv_score[u, : 2 * HEAD]


# --------------------------------------------------------------------------------------
# rope_quant_insert (C §8.2)
# --------------------------------------------------------------------------------------


def _rope_all_pairs(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """GPT-J RoPE of ``[n, 512]`` fp32 rows over all 256 pairs (R §1.2, F2).

    NoPE pairs 0..223 use ``(cos, sin) = (1, 0)``; like the kernels they still go through
    ``e' = fma(e, c, −fl32(o·s))``, ``o' = fma(o, c, fl32(e·s))``, which flips some zero
    signs and turns a lane with a ±inf/NaN partner into NaN (F2).
    """
    n = x.shape[0]
    c = torch.ones(n, HEAD // 2, dtype=F32, device=x.device)
    s = torch.zeros(n, HEAD // 2, dtype=F32, device=x.device)
    c[:, NOPE // 2 :] = cos
    s[:, NOPE // 2 :] = sin
    e, o = x[:, 0::2], x[:, 1::2]
    e2 = fma32(e, c, -(o * s))
    o2 = fma32(o, c, e * s)
    return torch.stack((e2, o2), dim=-1).flatten(-2)


def rope_quant_insert(
    latent, positions, cos_sin_cache, kv_cache, slot_mapping, compress_ratio, fp8_scale, sanitize_nans,
    interleaved=False,
) -> None:
    _ic.enforce("rope_quant_insert", [latent, positions, cos_sin_cache, kv_cache, slot_mapping, compress_ratio])
    T = slot_mapping.numel()
    if T == 0:
        return
    dev = latent.device
    slot = slot_mapping.to(dev, torch.int64)
    pos = positions[:T].to(dev, torch.int64)
    # Skip slot < 0 and tokens that do not close a group of compress_ratio positions.
    tok = torch.nonzero((slot >= 0) & ((pos + 1) % compress_ratio == 0)).flatten()
    if tok.numel() == 0:
        return
    slot, pos = slot[tok], pos[tok]
    x = latent[tok].to(F32)

    # cos/sin row of the group's first position; fp32 or bf16 cache, widened exactly.
    cs = cos_sin_cache[(pos // compress_ratio) * compress_ratio].to(F32)
    rot = _rope_all_pairs(x, cs[:, :ROPE_PAIRS], cs[:, ROPE_PAIRS : 2 * ROPE_PAIRS])
    if sanitize_nans:  # C §2.5 (b): rotated NaN -> 0 before storing / quantizing
        rot = torch.where(torch.isnan(rot), torch.zeros_like(rot), rot)

    B = kv_cache.shape[1]
    page, row = slot // B, slot % B

    if kv_cache.dtype != torch.uint8:
        _insert_plain(rot, kv_cache, page, row, fp8_scale)
        return

    rec = record_for_width(kv_cache.shape[-1])
    if rec is V4_FP8:
        # 584: NoPE quantized from the *unrotated* bf16 latent (7 groups of 64), pad code 0,
        # RoPE dims stored as bf16 of the rotated values.
        q, codes = quantize_ue8m0_groups(x[:, :NOPE], 64, 448.0, False, sanitize_nans)
        values = torch.cat((q, _le_bytes16(_bf16_bits(rot[:, NOPE:]))), dim=1)
        scales = torch.cat((codes, torch.zeros_like(codes[:, :1])), dim=1)
    elif rec is V41_MXFP8:
        # 528: the rotated fp32 row (not re-rounded) in 16 groups of 32.
        values, scales = quantize_ue8m0_groups(rot, 32, 448.0, False, sanitize_nans)
    else:
        assert rec is V41_NVFP4
        # 288: the rotated fp32 row in 32 e2m1 groups of 16 with e4m3 scales (C §2.3).
        values, scales = quantize_nvfp4_groups(rot)

    layout = CacheLayout(rec, B, kv_cache.stride(0), interleaved=interleaved)
    pages = _page_bytes(kv_cache)
    p, t = page[:, None], row[:, None]
    vbyte = torch.arange(rec.value_bytes, device=dev)
    sbyte = torch.arange(rec.scale_bytes, device=dev)
    pages[p, layout.value_index(t, vbyte)] = values
    pages[p, layout.scale_index(t, sbyte)] = scales


def _insert_plain(rot, kv_cache, page, row, fp8_scale) -> None:
    """Plain FlashInfer rows ``[448 NoPE | 64 RoPE]`` (C §1.5), element ``(page, row, d)``
    at ``page·stride(0) + row·stride(1) + d``."""
    bits = _bf16_bits(rot)
    if kv_cache.dtype == torch.bfloat16:
        kv_cache.view(torch.int16)[page, row] = bits
        return
    # fp8: e4m3(clamp448(fp32(bf16(x')) · fl32(1 / fp8_scale))).  1/scale is IEEE here
    # (the kernel's div.full is within 2 ulp); a NaN product is the GPU's +NaN -> +448 (F3).
    inv = 1.0 / fp8_scale.reshape(1).to(rot.device, F32)
    y = bits.view(torch.bfloat16).to(F32) * inv
    y = torch.where(torch.isnan(y), torch.full_like(y, 448.0), clamp_sym(y, 448.0))
    kv_cache.view(torch.uint8)[page, row] = e4m3_encode(y)
