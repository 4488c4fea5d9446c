"""Reference (pure PyTorch) for the attention-output / query quantizers.

* ``fused_inv_rope_fp8_quant``  — inverse RoPE + per-block FP8 quant for the grouped O-projection
  (spec rope_quant_ops.md §4),
* ``fused_q_kv_rmsnorm_quant``  — V4.1 Q/KV RMSNorm, MXFP8 quant of Q with FlashInfer's UE8M0 rule
  and F8_128x4 scale swizzle (§5),
* ``pad_fused_q_heads``         — zero-padding of fused-layout Q heads (§6.3).

Kernel contract (docs/kernel_contract.md): arguments are already validated, every output is
preallocated and written in place, the functions return None.  Everything is vectorized and
device-agnostic; fp32 arithmetic follows the H200 bit for bit (codecs.fma32 for the contraction of
§1.3, codecs.ceil_log2 for the scale exponent of §1.5 (L)).
"""

from __future__ import annotations

import functools

import torch

from dsv41.core import index_checks as _ic
from dsv41.core.codecs import ceil_log2, clamp_sym, e4m3_encode, exp2i, fma32, inv_const
from dsv41.core.gpu_approx import div_full, rsqrt_approx, tl_sum_sq
from dsv41.fused_layout import o_fused_chunk_permutation, o_fused_permutation

__all__ = ["fused_inv_rope_fp8_quant", "fused_q_kv_rmsnorm_quant", "pad_fused_q_heads"]

F32 = torch.float32
F64 = torch.float64

FP8_MAX = 448.0
INV_FP8_MAX = inv_const(FP8_MAX)  # RN32(1/448), multiplied instead of dividing (§4.3, §5)
INV_ROPE_EPS = float(torch.tensor(1e-10, dtype=F32))  # §4.1 amax floor, as the fp32 constant
BF16_CANONICAL_NAN = 0x7FFF  # F3: a NaN computed on the GPU and stored as bf16


# --------------------------------------------------------------------------- helpers


def _abs_ignore_nan(x: torch.Tensor) -> torch.Tensor:
    """|x| with NaN -> 0: the GPU max reduction returns the non-NaN operand (F3)."""
    a = x.abs()
    return torch.where(torch.isnan(a), torch.zeros_like(a), a)


def _canonical_nan(x: torch.Tensor) -> torch.Tensor:
    """fp32 x with every NaN replaced by the GPU's canonical, positive NaN 0x7FFFFFFF (F3)."""
    nan = torch.full_like(x.view(torch.int32), 0x7FFFFFFF).view(F32)
    return torch.where(torch.isnan(x), nan, x)


def _store_float(out: torch.Tensor, y: torch.Tensor) -> None:
    """``out[...] = y`` rounded to out.dtype (RNE); a NaN stored as bf16 is 0x7FFF (F3)."""
    v = y.to(out.dtype)
    if out.dtype == torch.bfloat16:
        bits = v.view(torch.int16)
        bits = torch.where(torch.isnan(y), torch.full_like(bits, BF16_CANONICAL_NAN), bits)
        v = bits.view(torch.bfloat16)
    out.copy_(v)


def _e4m3_bits(q: torch.Tensor) -> torch.Tensor:
    """Clamp to ±448 (NaN by its sign bit, made positive first: F3) and encode e4m3fn (§1.6)."""
    return e4m3_encode(clamp_sym(_canonical_nan(q), FP8_MAX))


# --------------------------------------------------------------------------- §4


def fused_inv_rope_fp8_quant(
    o, positions, cos_sin_cache, n_groups, heads_per_group, nope_dim, rope_dim, quant_group_size,
    tma_aligned_scales, quantize, permuted_output, out_buf, scale_buf,
) -> None:
    """R §4: inverse RoPE of the attention output, then per-``quant_group_size`` FP8 quant.

    ``out_buf`` is the backing ``[G, T, Dg]`` buffer (e4m3fn, or o.dtype when not quantizing);
    ``scale_buf`` is ``[G, K·Ta]`` with element (t, g, k) at ``[g, k·Ta + t]`` (fp32 ``2^E``, or
    int32 words of four ue8m0 bytes when ``tma_aligned_scales``); rows ``T ≤ t < Ta`` are 0.
    """
    _ic.enforce("fused_inv_rope_fp8_quant", [o, positions, cos_sin_cache])
    T, NH, Dh = o.shape
    G, HG, QG = n_groups, heads_per_group, quant_group_size
    Dg = HG * Dh
    C = Dh // QG  # scale blocks (chunks) per head
    S = HG * C  # scale blocks per group row

    # §4.3.1-2: x = fp32(o); inverse RoPE (§1.3) on dims nope_dim..Dh-1, pairs (d, d^1),
    # cos/sin column (d - nope_dim) >> 1 of cache[positions[t]]; no bf16 round trip.
    x = o.to(F32)
    d = torch.arange(nope_dim, Dh, device=o.device)
    i = (d - nope_dim) >> 1
    row = cos_sin_cache[positions.long()].to(F32)  # [T, R]
    cos = row[:, i].unsqueeze(1)  # [T, 1, R]
    sin = row[:, rope_dim // 2 + i].unsqueeze(1)
    v = x[:, :, d]  # [T, NH, R]
    partner = x[:, :, d ^ 1]
    ps = partner * sin  # RN32(partner·sin)
    even = (d & 1) == 0
    # even lane: fma(e, c, RN32(o·s)); odd lane: fma(o, c, -RN32(e·s))
    rot = fma32(v, cos, torch.where(even, ps, -ps))
    x = torch.cat((x[:, :, :nope_dim], rot), dim=-1)  # NoPE dims selected unchanged (F2 n/a)

    # Group rows: head n = g·HG + hg -> row (g, t), columns hg·Dh + d (§4.4).
    x = x.view(T, G, HG, C, QG)

    if not quantize:
        # §4.6: RNbf(rotated x) in o.dtype, standard order (permuted_output needs quantize).
        _store_float(out_buf, x.reshape(T, G, Dg).transpose(0, 1))
        return

    # §4.3.3: per chunk amax (floor 1e-10), s = amax·RN32(1/448), E = ceil(RN32(log2 s)) (L).
    amax = _abs_ignore_nan(x).amax(dim=-1).clamp_min(INV_ROPE_EPS)  # [T, G, HG, C]
    e = ceil_log2(amax * INV_FP8_MAX)
    scale = exp2i(e)  # 2^E, exact
    codes = _e4m3_bits(x / scale.unsqueeze(-1))  # power-of-two divisor: exact quotient
    codes = codes.view(T, G, Dg)
    scale = scale.view(T, G, S)  # standard block k = hg·C + c

    if permuted_output:
        # §4.7 = §6.2: chunk (hg, c) moves to chunk position c·HG + hg, values and scales alike.
        codes = codes[:, :, o_fused_permutation(HG, Dh, QG, device=o.device)]
        scale = scale[:, :, o_fused_chunk_permutation(HG, Dh, QG, device=o.device)]

    out_buf.view(torch.uint8).copy_(codes.transpose(0, 1))  # backing [G, T, Dg]

    # §4.5: scale element (t, g, k) at [g, k·Ta + t]; padding rows T ≤ t < Ta are 0.
    if tma_aligned_scales:
        # ue8m0 byte = biased exponent of 2^E; four blocks per int32, block 4k+b in bits 8b..8b+7.
        K = (S + 3) // 4
        ue8m0 = ((scale.view(torch.int32) >> 23) & 0xFF).to(torch.uint8)
        ue8m0 = torch.nn.functional.pad(ue8m0, (0, 4 * K - S))  # (never needed when C % 4 == 0)
        words = ue8m0.view(T, G, K, 4).contiguous().view(torch.int32).view(T, G, K)
    else:
        K = S
        words = scale
    Ta = scale_buf.shape[1] // K
    sv = scale_buf.view(G, K, Ta)
    sv[:, :, :T] = words.permute(1, 2, 0)
    sv[:, :, T:] = 0


# --------------------------------------------------------------------------- §5


def _flashinfer_ue8m0(n: torch.Tensor) -> torch.Tensor:
    """§5: FlashInfer's UE8M0 code of n = amax·RN32(1/448) (fp32, n ≥ 0), as int32.

    bump = mantissa ≠ 0 and not (exponent field 0 and mantissa ≤ 0x400000);
    sf = min(e + bump, 254); sf = 0 when n ≤ 0.
    """
    bits = n.to(F32).view(torch.int32)
    e = (bits >> 23) & 0xFF
    m = bits & 0x7FFFFF
    bump = (m != 0) & ~((e == 0) & (m <= 0x400000))
    sf = (e + bump.to(torch.int32)).clamp_max(254)
    return torch.where(n <= 0, torch.zeros_like(sf), sf)


def _flashinfer_inv_scale(sf: torch.Tensor) -> torch.Tensor:
    """§5: 0 when sf == 0, else the fp32 with bits (254 − sf) << 23 (sf = 254 gives 0 too)."""
    inv = ((254 - sf) << 23).view(F32)
    return torch.where(sf == 0, torch.zeros_like(inv), inv)


def _f8_128x4_offsets(Tp: int, Gp: int, device) -> torch.Tensor:
    """§5 F8_128x4 swizzle: [Tp, Gp] byte offsets of scale (row r, group j)."""
    r = torch.arange(Tp, device=device).view(-1, 1)
    j = torch.arange(Gp, device=device).view(1, -1)
    return (
        (r // 128) * (128 * Gp)
        + (j // 4) * 512
        + (r % 32) * 16
        + ((r % 128) // 32) * 4
        + (j % 4)
    )


@functools.lru_cache(maxsize=64)  # launchers ask on every call; a model has few widths
def vllm_norm_layout(qs: int, ks: int, element_size: int) -> tuple[int, int, int]:
    """``(block, warps, per_thread)`` of vLLM's Q/KV norm kernel for row widths ``qs`` / ``ks``:
    one block of ``next_pow2(max(qs, ks))`` for both rows, 8 warps from 2048 on (else 4), rows
    loaded in 16-byte vectors (8 bf16 / 4 fp32 per thread; fewer where the block is narrower).
    Measured for bf16 rows of 1536 and 512 (``tools/approx_dump.py`` rowsum); fp32 rows follow
    the same layout rule, not measured."""
    block = 1 << (max(qs, ks, 1) - 1).bit_length()
    warps = 8 if block >= 2048 else 4
    per = max(1, min(16 // element_size, block // (32 * warps)))
    # a block narrower than the threads: one element per lane, only the warps it fills (a
    # partial warp's missing lanes add zeros); unmeasured, like every width but 1536 / 512
    warps = max(1, min(warps, block // (32 * per)))
    return max(block, 32 * per), warps, per


def _rmsnorm(x: torch.Tensor, w: torch.Tensor, eps: float, layout: tuple[int, int, int]) -> torch.Tensor:
    """§5: y = RN32(RN32(x·rrms)·w), rrms = rsqrt(Σx²/SIZE + eps), per row, in fp32, as vLLM's
    kernel computes it on an SM90 GPU: Σx² in ``tl.sum``'s order for the kernel's layout
    (``vllm_norm_layout``, ``gpu_approx.tl_sum_sq``), ``/ SIZE`` a ``div.full`` by the constant
    (``x · rcp(SIZE)``), the GPU's ``rsqrt.approx``.
    """
    xf = x.to(F32)
    block, warps, per = layout
    ss = tl_sum_sq(xf, warps=warps, per_thread=per, block=block)
    ms = div_full(ss, torch.full_like(ss, float(x.shape[-1])))
    ms = ms + float(torch.tensor(eps, dtype=F32))  # fp32 add of the fp32 eps
    rrms = rsqrt_approx(ms).unsqueeze(-1)
    return (xf * rrms) * w.to(F32)


def fused_q_kv_rmsnorm_quant(qr, kv, q_weight, kv_weight, eps, q_out, q_scale_out, kv_out) -> None:
    """R §5: RMSNorm of Q and KV rows; KV stored as kv.dtype, Q as MXFP8 (e4m3fn + swizzled ue8m0)."""
    T, Qs = qr.shape
    Gq = Qs // 32

    # KV: RMSNorm, stored RNE as kv_out.dtype.
    widths = (qr.shape[-1], kv.shape[-1])
    _store_float(kv_out, _rmsnorm(kv, kv_weight, eps, vllm_norm_layout(*widths, kv.element_size())))

    # Q: RMSNorm, q.dtype round trip, then per-32 MXFP8 with FlashInfer's UE8M0 rule.
    y = _rmsnorm(qr, q_weight, eps, vllm_norm_layout(*widths, qr.element_size())).to(qr.dtype).to(F32).view(T, Gq, 32)
    amax = _abs_ignore_nan(y).amax(dim=-1)
    sf = _flashinfer_ue8m0(amax * INV_FP8_MAX)  # [T, Gq]
    inv = _flashinfer_inv_scale(sf)
    q = _canonical_nan(y * inv.unsqueeze(-1))
    q_out.view(torch.uint8).copy_(e4m3_encode(q).view(T, Qs))  # RNE, saturating (§1.6)

    # Scale bytes in the F8_128x4 swizzle; rows >= T and groups >= Gq are 0.
    Tp = (T + 127) // 128 * 128
    Gp = (Gq + 3) // 4 * 4
    padded = torch.zeros(Tp, Gp, dtype=torch.uint8, device=qr.device)
    padded[:T, :Gq] = sf.to(torch.uint8)
    q_scale_out[_f8_128x4_offsets(Tp, Gp, qr.device).reshape(-1)] = padded.reshape(-1)


# --------------------------------------------------------------------------- §6.3


def pad_fused_q_heads(q, out) -> None:
    """R §6.3: per token, chunk c (32 of them), head h, lane j:
    ``out[t, c·(Hp·16) + h·16 + j] = q[t, c·(H·16) + h·16 + j]`` for h < H, else 0 (pure copy)."""
    T, H, D = q.shape
    Hp = out.shape[1]
    n_chunks = D // 16
    src = q.reshape(T, H * D).view(T, n_chunks, H, 16)
    dst = out.view(T, n_chunks, Hp, 16)
    dst[:, :, :H] = src
    dst[:, :, H:] = 0
