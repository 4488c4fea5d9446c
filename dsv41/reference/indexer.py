"""Pure-PyTorch reference of the two sparse-indexer ops (spec rope_quant_ops.md, "R").

* ``indexer_k_norm_rope_store``  — R §3: RMSNorm -> RoPE at the group's first position ->
  FP8 (one fp32 scale) or MXFP4 -> paged indexer K cache (row-major or ROCm tiled, §3.4),
* ``fused_indexer_q_rope_quant`` — R §2: RoPE -> FP8 (OCP or FNUZ, scale folded into the
  weights, §2.2) or MXFP4 (per-32 ue8m0 scales, §2.3).

Both follow the kernel contract (docs/kernel_contract.md): arguments are validated by the
caller, outputs are preallocated and written in place, nothing is returned.  Everything is
vectorized over tokens / heads and uses only torch ops on the inputs' device.

Numerics are the CUDA (Triton, SM90) ones, bit for bit: fp32 throughout, the RoPE
contraction of vLLM's NVIDIA build (``fma(e, c, -RN32(o*s))`` / ``fma(o, c, RN32(e*s))`` for
the key, ``fma(e, s, RN32(o*c))`` in the query's odd lane; docs/kernel_contract.md), the bf16
round trip (§1.4), power-of-two scales with the fp32-log2 ceiling (§1.5), RNE e4m3 /
e2m1 encoders (§1.6, §1.7, §8), and the Triton kernel's summation order for the RMSNorm
variance.  The one operation the GPU does *approximately*, the RMSNorm ``rsqrt``
(``rsqrt.approx.ftz.f32``, R §3.3), is computed as the GPU computes it
(``dsv41.core.gpu_approx``).
"""

from __future__ import annotations

import torch

from ..core.gpu_approx import rsqrt_approx, tl_sum_sq
from ..core import index_checks as _ic
from ..core.codecs import (
    F32_1E_4,
    ceil_log2,
    clamp_sym,
    e2m1_encode,
    e4m3_encode,
    exp2i,
    fma32,
    inv_const,
    pack_nibbles,
    rnbf16,
)
from ..core.formats import (
    INDEXER_FP8,
    INDEXER_MXFP4,
    MXFP4_BLOCK_SIZE,
    CacheLayout,
    flavour_of,
)

__all__ = ["fused_indexer_q_rope_quant", "indexer_k_norm_rope_store"]

F32 = torch.float32
F64 = torch.float64

# fl32(1/448) and fl32(1/6): the constants the quantizers multiply by (§1.8, §3.3).
_INV_448 = inv_const(448.0)
_INV_6 = inv_const(6.0)
# Floor of every MXFP4 block amax, 6 * 2^-126 (§1.8): gives ue8m0 byte 1 for zero blocks.
_MXFP4_AMAX_FLOOR = 6.0 * 2.0**-126


# --------------------------------------------------------------------------------------
# Shared building blocks (R §1)
# --------------------------------------------------------------------------------------


def _f32(v: float, like: torch.Tensor) -> torch.Tensor:
    """A Python float rounded once to an fp32 scalar tensor (how Triton receives it)."""
    return torch.tensor(v, dtype=F32, device=like.device)


def _cos_sin(cache: torch.Tensor, pos: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows ``pos`` of a cos‖sin cache (fp32 or bf16), widened to fp32 (§1.1)."""
    rows = cache.index_select(0, pos).to(F32)
    half = cache.shape[-1] // 2
    return rows[..., :half], rows[..., half:]


def _rope_pairs(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, *, odd_fuses_sin: bool = False) -> torch.Tensor:
    """Forward GPT-J RoPE (§1.2) on every pair of the last dim of fp32 ``x``.

    ``cos`` / ``sin`` hold one value per pair (broadcast against ``x[..., 0::2]``).
    Canonical contraction: even' = fma(e, c, -RN32(o*s)), odd' = fma(o, c, RN32(e*s)).
    ``odd_fuses_sin``: odd' = fma(e, s, RN32(o*c)) instead — the product vLLM's indexer-Q
    kernels (FP8 and MXFP4) fuse once their ``x_odd * cos + x_even * sin`` is compiled for
    NVIDIA (their PTX; golden set C), where its indexer-K and cache-writer kernels, written the
    same way, fuse the canonical one (docs/kernel_contract.md, "RoPE contraction").
    """
    e, o = x[..., 0::2], x[..., 1::2]
    new_e = fma32(e, cos, -(o * sin))
    new_o = fma32(e, sin, o * cos) if odd_fuses_sin else fma32(o, cos, e * sin)
    return torch.stack((new_e, new_o), dim=-1).flatten(-2)


def _nan_ignoring_absmax(x: torch.Tensor) -> torch.Tensor:
    """``max |x|`` over the last dim; NaN ignored like PTX ``max.f32`` (§2.7, finding 3)."""
    return torch.where(torch.isnan(x), torch.zeros_like(x), x).abs().amax(dim=-1)


def _mxfp4_blocks(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """MXFP4 block quantization (§1.8) of fp32 ``x[..., D]``, D % 32 == 0.

    Returns packed e2m1 bytes ``[..., D/2]`` (element 2k in the low nibble, §1.7) and the
    ue8m0 scale bytes ``[..., D/32]`` (block b = dims 32b … 32b+31).
    """
    blocks = x.unflatten(-1, (-1, MXFP4_BLOCK_SIZE))
    amax = _nan_ignoring_absmax(blocks).clamp_min(_MXFP4_AMAX_FLOOR)
    e = ceil_log2(amax * _INV_6).clamp(-127.0, 127.0)
    codes = e2m1_encode(blocks * exp2i(-e).unsqueeze(-1))  # times an exact power of two
    return pack_nibbles(codes).flatten(-2), (e + 127.0).to(torch.uint8)


def _fp32_le_bytes(v: torch.Tensor) -> torch.Tensor:
    """fp32 ``[...]`` -> its 4 little-endian bytes ``[..., 4]`` (R conventions)."""
    bits = v.to(F32).view(torch.int32).unsqueeze(-1)
    shifts = torch.arange(0, 32, 8, dtype=torch.int32, device=v.device)
    return ((bits >> shifts) & 0xFF).to(torch.uint8)


# --------------------------------------------------------------------------------------
# indexer_k_norm_rope_store (R §3)
# --------------------------------------------------------------------------------------


def _rms_norm(k: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """k_norm of R §3.3 step 2 on fp32 rows ``k[n, 128]``; result bf16-valued fp32.

    * ``var = Σ k_d² / 128`` (fp32 in the order of vLLM's one-warp ``tl.sum``: 32 lanes of 4
      contiguous squares, ``gpu_approx.tl_sum_sq``; ``/128`` exact);
    * ``r = rsqrt(var + eps)``: the GPU's ``rsqrt.approx.ftz.f32`` (``gpu_approx``);
    * ``k_d = RNbf(RN32(RN32(k_d·r)·w_d))`` (left to right, as the kernel multiplies).
    """
    var = tl_sum_sq(k, warps=1, per_thread=4) / 128.0
    v = var + _f32(eps, k)
    r = rsqrt_approx(v)  # var = +inf -> r = 0 (an all-zero key, finding 3)
    return rnbf16((k * r.unsqueeze(-1)) * weight.to(F32))


def _cache_bytes(k_cache: torch.Tensor) -> torch.Tensor:
    """Flat uint8 view of the storage span ``k_cache`` covers (page ``p`` at ``p*stride(0)``)."""
    span = 1 + sum((s - 1) * st for s, st in zip(k_cache.shape, k_cache.stride()))
    return k_cache.as_strided((span,), (1,), k_cache.storage_offset())


def indexer_k_norm_rope_store(
    k_pre, positions, cos_sin_cache, rms_norm_weight, rms_norm_eps, k_cache, kv_slot_mapping,
    compress_ratio, use_fp4_cache, mxfp4_n_per_tile, tiled,
) -> None:
    """Indexer key: RMSNorm -> RoPE -> FP8 / MXFP4 -> paged cache (R §3); writes ``k_cache``."""
    _ic.enforce("indexer_k_norm_rope_store", [
        k_pre, positions, cos_sin_cache, rms_norm_weight, rms_norm_eps, k_cache, kv_slot_mapping, compress_ratio])
    num_tokens = kv_slot_mapping.numel()
    if num_tokens == 0:
        return
    dev = k_cache.device
    slots = kv_slot_mapping.reshape(-1).to(torch.int64)
    pos = positions.reshape(-1)[:num_tokens].to(torch.int64)

    # §3.2: only the last token of each compression group writes (and only to slot >= 0).
    writes = (slots >= 0) & ((pos + 1) % compress_ratio == 0)
    tok = torch.nonzero(writes).squeeze(-1)
    if tok.numel() == 0:
        return
    slot, p = slots[tok], pos[tok]
    group_pos = (p // compress_ratio) * compress_ratio  # RoPE at the group's first position

    # §3.3 steps 1-2: RMSNorm (non-writing rows, possibly NaN poison, are never read).
    k = _rms_norm(k_pre.index_select(0, tok).to(F32), rms_norm_weight, rms_norm_eps)

    # §3.3 step 3: RoPE over all 64 pairs; the 32 NoPE pairs rotate by (cos, sin) = (1, 0),
    # which only changes zero signs (finding 2).  Then the bf16 round trip.
    cos, sin = _cos_sin(cos_sin_cache, group_pos)
    nope_pairs = (k.shape[-1] - cos_sin_cache.shape[-1]) // 2
    cos = torch.cat((torch.ones_like(cos[:, :1]).expand(-1, nope_pairs), cos), dim=-1)
    sin = torch.cat((torch.zeros_like(sin[:, :1]).expand(-1, nope_pairs), sin), dim=-1)
    k = rnbf16(_rope_pairs(k, cos, sin))
    # NaN inputs are outside the contract; the one NaN left is 0 * inf (an all-zero key with
    # eps = 0).  GPU arithmetic gives the canonical +NaN, x86 a negative one, and the sign
    # picks the saturated code (±448 / ±6): the GPU's +NaN is the answer (docs/decisions.md).
    k = torch.where(torch.isnan(k), torch.full_like(k, float("nan")), k)

    # §3.3 step 4: quantize.
    if use_fp4_cache:
        record = INDEXER_MXFP4
        values, scale_bytes = _mxfp4_blocks(k)  # §1.8: [n, 64], [n, 4]
    else:
        # FP8, always OCP e4m3fn / 448, one fp32 scale 2^E per key (zero key -> 2^-22).
        record = INDEXER_FP8
        amax = _nan_ignoring_absmax(k).clamp_min(F32_1E_4)
        e = ceil_log2(amax * _INV_448)
        x = clamp_sym(k * exp2i(-e).unsqueeze(-1), 448.0)
        values = e4m3_encode(x)  # [n, 128]
        scale_bytes = _fp32_le_bytes(exp2i(e))  # [n, 4], little-endian fp32

    # §3.4: segregated page (values of all tokens, then scales; padding never written),
    # row-major or the ROCm tiled / preshuffled order.
    block_size = k_cache.shape[1]
    layout = CacheLayout(
        record,
        block_size=block_size,
        page_bytes=k_cache.stride(0),
        flavour=flavour_of(False),
        tiled=tiled,
        n_per_tile=mxfp4_n_per_tile,
    )
    page_base = (slot // block_size) * k_cache.stride(0)
    o = (slot % block_size).unsqueeze(-1)
    vb = torch.arange(record.value_bytes, dtype=torch.int64, device=dev)
    sb = torch.arange(record.scale_bytes, dtype=torch.int64, device=dev)
    flat = _cache_bytes(k_cache)
    flat[page_base.unsqueeze(-1) + layout.value_index(o, vb)] = values.to(dev)
    flat[page_base.unsqueeze(-1) + layout.scale_index(o, sb)] = scale_bytes.to(dev)


# --------------------------------------------------------------------------------------
# fused_indexer_q_rope_quant (R §2)
# --------------------------------------------------------------------------------------


def fused_indexer_q_rope_quant(
    positions, index_q, cos_sin_cache, index_weights, softmax_scale, head_scale, use_fp4, use_fnuz, q_out,
    q_scale_out, weights_out,
) -> None:
    """Indexer query: RoPE on the last R dims -> FP8 or MXFP4, weight fold (R §2)."""
    _ic.enforce("fused_indexer_q_rope_quant", [positions, index_q, cos_sin_cache])
    num_tokens, _, head_dim = index_q.shape
    if num_tokens == 0:
        return
    rope_dim = cos_sin_cache.shape[-1]
    nope = head_dim - rope_dim

    # §2.2 steps 1-2 / §2.3: NoPE dims stay as loaded (not rotated, so zero signs are
    # kept, finding 2); RoPE dims rotate at positions[t] and take the bf16 round trip.
    x = index_q.to(F32)
    cos, sin = _cos_sin(cos_sin_cache, positions.reshape(-1)[:num_tokens].to(torch.int64))
    rot = rnbf16(_rope_pairs(x[..., nope:], cos.unsqueeze(1), sin.unsqueeze(1), odd_fuses_sin=True))
    x = torch.cat((x[..., :nope], rot), dim=-1)  # [T, H, D]

    w = index_weights.to(F32)
    s_scale, h_scale = _f32(softmax_scale, w), _f32(head_scale, w)

    if use_fp4:
        # §2.3: per-32 blocks (§1.8); weights_out = RN32(RN32(w·S)·Hs), no q scale.
        packed, scales = _mxfp4_blocks(x)
        q_out.copy_(packed)
        if q_scale_out.dtype == torch.uint8:
            q_scale_out.copy_(scales)
        else:  # the same bytes as int32 words (formats.scale_byte_strides)
            q_scale_out.copy_(scales.contiguous().view(q_scale_out.dtype).reshape(q_scale_out.shape))
        weights_out.copy_((w * s_scale) * h_scale)  # a bf16 weights_out rounds RNE
        return

    # §2.2 steps 3-5: one scale per head; s = max(amax, 1e-4) / FP8_MAX with a correctly
    # rounded fp32 division (by a tensor: CUDA turns division by a Python scalar into a
    # reciprocal multiply); values divided by the exact power-of-two scale; no clamp.
    flavour = flavour_of(use_fnuz)  # OCP 448, FNUZ 224 (gfx942)
    amax = _nan_ignoring_absmax(x).clamp_min(F32_1E_4)
    q_scale = exp2i(ceil_log2(amax / torch.full_like(amax, flavour.max)))  # [T, H]
    codes = e4m3_encode(x / q_scale.unsqueeze(-1), fnuz=flavour.fnuz)
    q_out.view(torch.uint8).copy_(codes)
    # §2.2 step 6: weights_out = RN32(RN32(RN32(w·q_scale)·S)·Hs), left to right.
    weights_out.copy_(((w * q_scale) * s_scale) * h_scale)
