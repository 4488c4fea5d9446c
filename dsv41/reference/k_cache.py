"""Pure-PyTorch reference of the paged K-cache writer and reader.

* ``quantize_and_insert_k_cache``  — spec cache_ops.md §3 (records §1.2 / §1.3),
* ``dequantize_and_gather_k_cache`` — spec cache_ops.md §4 (records §1.2-§1.4, finding 1),
* the group quantizers other reference modules share:
  ``quantize_ue8m0_groups`` (§2.1, §2.4, §2.5, finding 3) and
  ``quantize_nvfp4_groups`` (§2.3).

Both ops follow the kernel contract (docs/kernel_contract.md): arguments are already
validated, outputs are written in place, nothing is allocated for the caller and the
functions return ``None``.  Everything is vectorized over tokens with index tensors and
works on any device (only torch ops; new tensors live on the inputs' device).

Cache addressing (§0.2, §1.1): byte ``b`` of the page of block ``blk`` is
``blk * k_cache.stride(0) + b`` (int64) from the cache's first byte.  Reads and writes
go through a flat uint8 view of exactly the storage span the cache tensor covers, so a
cache that is a view (``[num_blocks, page_bytes]`` or ``[num_blocks, B, W]`` with
``stride(0) > B*W``) works and only the record bytes of a token are touched — never the
page padding.
"""

from __future__ import annotations

import torch

from dsv41.core import index_checks as _ic
from dsv41.core.codecs import (
    F32_1E_4,
    ceil_log2,
    clamp_sym,
    e2m1_decode,
    e2m1_encode,
    e4m3_decode,
    e4m3_encode,
    exp2i,
    inv_const,
    pack_nibbles,
    ue8m0_decode,
    unpack_nibbles,
)
from dsv41.core.formats import (
    V4_FP8,
    V41_MXFP8,
    V41_NVFP4,
    CacheLayout,
    Record,
    flavour_of,
    record_for_width,
)

__all__ = [
    "quantize_and_insert_k_cache",
    "dequantize_and_gather_k_cache",
    "quantize_ue8m0_groups",
    "quantize_nvfp4_groups",
]

F32 = torch.float32
# bf16 bits of the NaN every computed (non-copied) NaN output becomes (finding 3).
_BF16_CANONICAL_NAN = 0x7FFF


# --------------------------------------------------------------------------------------
# Group quantizers
# --------------------------------------------------------------------------------------


def _nan_ignoring_absmax(g: torch.Tensor) -> torch.Tensor:
    """``max |v|`` over the last dim, NaN elements ignored (finding 3; PTX ``max.f32``).

    ``torch.amax`` propagates NaN, so NaNs are zeroed first (|v| >= 0 keeps the max).
    ±inf stays inf.  A group of only NaNs gives 0.
    """
    return torch.where(torch.isnan(g), torch.zeros_like(g), g).abs().amax(dim=-1)


def quantize_ue8m0_groups(
    x: torch.Tensor,
    group: int,
    fp8_max: float,
    fnuz: bool,
    sanitize: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """UE8M0-scaled FP8 quantization of fp32 rows (spec cache_ops §2.1, §2.4, §2.5).

    x: ``[N, group * n_groups]`` (converted to fp32; bf16 converts exactly).
    fp8_max: 448 (OCP) or 224 (FNUZ, §2.4 — the code bias stays 127).
    sanitize: gfx950 ``SANITIZE_CACHE_NANS`` (§2.5 a): the *stored* code is clamped to
        <= 254; the scaling still uses the unclamped exponent, as the kernels do.
        (§2.5 b, zeroing NaN rotated values, is the caller's job.)
    Returns ``(bytes uint8 [N, group*n_groups], codes uint8 [N, n_groups])``.
    """
    lead = x.shape[:-1]
    x = x.to(F32).reshape(-1, x.shape[-1])
    n, width = x.shape
    g = x.reshape(n, width // group, group)

    # §2.1.1: A' = max(A, fl32(1e-4)), NaN ignored in A (finding 3).
    amax = torch.clamp(_nan_ignoring_absmax(g), min=F32_1E_4)
    # §2.1.2: r = fl32(A' * fl32(1/FP8_MAX)) — a single fp32 multiplication.
    c = torch.tensor(inv_const(fp8_max), dtype=F32, device=x.device)
    r = amax * c
    # §2.1.3: e = ceil(fl32(log2 r)); A = inf gives e = +inf.
    e = ceil_log2(r)
    # §2.1.4: v * 2^-e (exact; e = +inf gives 2^-e = 0, so finite -> ±0 and inf -> NaN),
    # then clamp_sym(., FP8_MAX) and e4m3.  Every NaN here went through arithmetic on the
    # GPU (the input's own NaNs too, through the multiplication), so it is the canonical
    # *positive* NaN and clamps to +FP8_MAX (0x7E OCP), not to the NaN's sign (finding 3).
    # The CPU's default NaN is negative, hence the explicit rule.
    scaled = g * exp2i(-e).unsqueeze(-1)
    clamped = torch.where(
        torch.isnan(scaled), torch.full_like(scaled, fp8_max), clamp_sym(scaled, fp8_max)
    )
    q = e4m3_encode(clamped, fnuz=fnuz).reshape(*lead, width)
    # §2.1.5: code = clamp(e + 127, 0, 255) (<= 254 sanitized); e = inf -> 255.
    code = torch.clamp(e + 127.0, 0.0, 254.0 if sanitize else 255.0).to(torch.uint8)
    return q, code.reshape(*lead, width // group)


def quantize_nvfp4_groups(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """NVFP4 quantization of fp32 rows in groups of 16 (spec cache_ops §2.3).

    x: ``[N, 16 * n_groups]`` (fp32).  Returns ``(packed uint8 [N, 8*n_groups]`` with the
    even dim in the low nibble, ``scale bytes uint8 [N, n_groups])`` (e4m3 bits).
    NaN inputs are outside the contract: NaN is ignored in the amax like the UE8M0
    quantizers (finding 3) and a NaN element encodes as +6 (code 0x7), what PTX
    ``cvt.rn.satfinite`` gives for a format without NaN (docs/decisions.md).
    """
    lead = x.shape[:-1]
    x = x.to(F32).reshape(-1, x.shape[-1])
    n, width = x.shape
    g = x.reshape(n, width // 16, 16)
    # §2.3.1-2: s = e4m3(clamp(fl32(A * fl32(1/6)), 2^-9, 448)), A without a floor.
    c = torch.tensor(inv_const(6.0), dtype=F32, device=x.device)
    s_f = torch.clamp(_nan_ignoring_absmax(g) * c, min=2.0**-9, max=448.0)
    s = e4m3_encode(s_f)
    # §2.3.3: x / S with IEEE correctly rounded division (torch's fp32 '/').
    scaled = g / e4m3_decode(s).unsqueeze(-1)
    # §2.3.4-5: e2m1 RNE (saturating), even dim in the low nibble.
    codes = e2m1_encode(scaled)
    codes = torch.where(torch.isnan(scaled), torch.full_like(codes, 0x7), codes)
    packed = pack_nibbles(codes.reshape(n, width))
    return packed.reshape(*lead, width // 2), s.reshape(*lead, width // 16)


# --------------------------------------------------------------------------------------
# Paged addressing helpers
# --------------------------------------------------------------------------------------


def _flat_bytes(cache: torch.Tensor) -> torch.Tensor:
    """1-D uint8 view of the storage span covered by ``cache`` (its first byte is index 0).

    Writing through it writes the cache in place; indexing past the span raises.
    """
    if cache.numel() == 0:
        span = 0
    else:
        span = 1 + sum((s - 1) * st for s, st in zip(cache.shape, cache.stride()))
    return cache.as_strided((span,), (1,), cache.storage_offset())


def _record_indices(
    layout: CacheLayout, blk: torch.Tensor, tok: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Flat byte indices ``[M, value_bytes]`` and ``[M, scale_bytes]`` of tokens (blk, tok).

    Page base = blk * stride(0) in int64 (§1.1); in-page offsets from the layout (§1.2-§1.4).
    """
    rec = layout.record
    dev = blk.device
    base = blk.to(torch.int64).unsqueeze(1) * layout.page_bytes
    tok = tok.to(torch.int64).unsqueeze(1)
    vbyte = torch.arange(rec.value_bytes, dtype=torch.int64, device=dev).unsqueeze(0)
    sbyte = torch.arange(rec.scale_bytes, dtype=torch.int64, device=dev).unsqueeze(0)
    return base + layout.value_index(tok, vbyte), base + layout.scale_index(tok, sbyte)


# --------------------------------------------------------------------------------------
# quantize_and_insert_k_cache (spec §3)
# --------------------------------------------------------------------------------------


def _encode_record(
    k: torch.Tensor, rec: Record, use_fnuz: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """bf16 rows ``[M, 512]`` -> (value bytes ``[M, value_bytes]``, scale bytes
    ``[M, scale_bytes]``) of the 584 / 528 record."""
    fp8_max = flavour_of(use_fnuz).max
    q, codes = quantize_ue8m0_groups(k[:, : rec.quant_dims], rec.group, fp8_max, use_fnuz)
    if rec is V41_MXFP8:
        # §1.3: 512 e4m3 bytes | 16 codes.
        return q, codes
    # §1.2 (584): 448 e4m3 | 64 bf16 copied bit-exactly | 7 codes + pad byte 0x00.
    tail = k[:, rec.quant_dims :].contiguous().view(torch.uint8)
    pad = torch.zeros_like(codes[:, :1])
    return torch.cat((q, tail), dim=1), torch.cat((codes, pad), dim=1)


def quantize_and_insert_k_cache(
    k, k_cache, slot_mapping, block_size, use_fnuz, bytes_per_token, interleaved=False,
) -> None:
    """Quantize ``k[:T]`` (bf16 ``[>=T, 512]``) into the paged ``k_cache`` (spec §3).

    ``bytes_per_token`` 528 selects the V4.1 MXFP8 record; anything else the V4 584
    record (as upstream; the public layer only lets 584/528 through).  ``interleaved``
    places each 528 token's scales right after its values (``dsv41.core.formats``).
    """
    _ic.enforce("quantize_and_insert_k_cache", [k, k_cache, slot_mapping, block_size])
    rec = V41_MXFP8 if bytes_per_token == V41_MXFP8.width else V4_FP8
    T = slot_mapping.shape[0]
    slots = slot_mapping.to(torch.int64)
    # Upstream skips exactly -1 (other negatives are undefined behaviour there, §3); the
    # reference skips every negative slot, which never writes outside the cache.
    keep = slots >= 0
    slots = slots[keep]
    if slots.numel() == 0:
        return
    rows = k[:T][keep]

    layout = CacheLayout(rec, block_size, k_cache.stride(0), flavour_of(use_fnuz), interleaved=interleaved)
    vidx, sidx = _record_indices(layout, slots // block_size, slots % block_size)
    vbytes, sbytes = _encode_record(rows, rec, use_fnuz)

    flat = _flat_bytes(k_cache)
    flat[vidx.reshape(-1)] = vbytes.reshape(-1)
    flat[sidx.reshape(-1)] = sbytes.reshape(-1)


# --------------------------------------------------------------------------------------
# dequantize_and_gather_k_cache (spec §4)
# --------------------------------------------------------------------------------------


def _bf16_bits(v: torch.Tensor) -> torch.Tensor:
    """fp32 -> bf16 (RNE) bits as int16; every NaN becomes 0x7FFF (finding 3)."""
    bits = v.to(torch.bfloat16).view(torch.int16)
    return torch.where(torch.isnan(v), torch.full_like(bits, _BF16_CANONICAL_NAN), bits)


def _decode_record(
    vbytes: torch.Tensor, sbytes: torch.Tensor, rec: Record, use_fnuz: bool
) -> torch.Tensor:
    """Record bytes of M tokens -> bf16 bits ``[M, 512]`` as int16."""
    m = vbytes.shape[0]
    if rec is V41_NVFP4:
        # §2.3 dequant with finding 1: magnitude code 0 gives +0 whatever its sign bit
        # (0 - 0 = +0), so a zero takes the sign of the scale.  use_fnuz is ignored (§4).
        vals = e2m1_decode(unpack_nibbles(vbytes), signed_zero=False)
        scale = e4m3_decode(sbytes)
        out = vals.reshape(m, rec.n_groups, rec.group) * scale.unsqueeze(-1)
        return _bf16_bits(out.reshape(m, rec.quant_dims))
    # §2.2: bf16(e4m3 value * 2^(code-127)), code 0 -> scale 0, 255 -> inf; exact in fp32.
    q = vbytes[:, : rec.quant_dims]
    vals = e4m3_decode(q, fnuz=use_fnuz).reshape(m, rec.n_groups, rec.group)
    scale = ue8m0_decode(sbytes[:, : rec.n_groups])
    bits = _bf16_bits((vals * scale.unsqueeze(-1)).reshape(m, rec.quant_dims))
    if rec.bf16_dims == 0:
        return bits
    # 584: dims 448..511 are the stored bf16 bits verbatim (NaN payloads kept).
    tail = vbytes[:, rec.quant_dims :].contiguous().view(torch.int16)
    return torch.cat((bits, tail), dim=1)


def dequantize_and_gather_k_cache(
    out, k_cache, seq_lens, gather_lens, block_table, block_size, offset, use_fnuz, interleaved=False,
) -> None:
    """Gather and dequantize the last ``n`` tokens of each request into ``out`` (spec §4).

    Request r (L = seq_lens[r], n = gather_lens[r] or L) writes rows
    ``out[r, offset : offset + n]`` from positions ``L - n … L - 1``; no other row is
    touched.  The record is ``k_cache.shape[-1]`` (584 / 528 / 288).
    """
    _ic.enforce("dequantize_and_gather_k_cache", [out, k_cache, seq_lens, gather_lens, block_table, block_size, offset])
    rec = record_for_width(k_cache.shape[-1])
    dev = out.device
    lens = seq_lens.to(torch.int64)
    n = lens if gather_lens is None else gather_lens.to(torch.int64)
    total = int(n.sum())
    if total == 0:
        return

    # One entry per gathered token: request r, index i within the request's n.
    req = torch.repeat_interleave(torch.arange(n.shape[0], device=dev), n)
    first = torch.cumsum(n, 0) - n
    i = torch.arange(total, device=dev) - first[req]
    pos = lens[req] - n[req] + i
    # Advanced indexing honours block_table.stride(0) (§4 "Implement with stride(0)").
    blk = block_table[req, pos // block_size]

    layout = CacheLayout(rec, block_size, k_cache.stride(0), flavour_of(use_fnuz), interleaved=interleaved)
    vidx, sidx = _record_indices(layout, blk, pos % block_size)
    flat = _flat_bytes(k_cache)
    bits = _decode_record(flat[vidx], flat[sidx], rec, use_fnuz)

    out[req, offset + i] = bits.view(torch.bfloat16).to(out.dtype)
