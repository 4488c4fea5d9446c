"""Pure-PyTorch reference of ``transcode_k_cache``: OCP <-> FNUZ e4m3 paged K caches.

The rules (modes, byte maps, scale arithmetic) are defined and justified in the module
docstring of ``dsv41.transcode``; this file is their executable definition.  Every
backend must write exactly these bytes.

Kernel contract (docs/kernel_contract.md): arguments are validated by the public function,
nothing is allocated for the caller, ``dst`` is written in place and ``None`` is returned.
Only the record bytes (value region + scale region, ``block_size * width`` bytes) of the
listed pages of ``dst`` are written; page padding and unlisted pages are never touched.
All reads happen before any write, so ``src`` may be ``dst`` (in-place).

Everything is integer arithmetic on bytes, vectorized over (token, group); it runs on any
device.
"""

from __future__ import annotations

import torch

from dsv41.core.formats import INDEXER_FP8, CacheLayout, Record, record_for_width

__all__ = [
    "transcode_k_cache",
    "transcode_records",
    "ocp_to_fnuz_same_bits",
    "ocp_to_fnuz_same_value",
    "fnuz_to_ocp_same_bits",
    "fnuz_to_ocp_same_value",
    "RESCALE",
    "PASS",
    "KEEP",
]

I32 = torch.int32
I64 = torch.int64

# Group modes (see dsv41.transcode):
RESCALE = 0  # scale x2 (OCP->FNUZ) or /2 (FNUZ->OCP), value bytes keep their bits
PASS = 1  # scale kept, value bytes keep their bits (specials mapped): decode-identical
KEEP = 2  # scale kept, each value byte re-encoded to the same value in the other flavour


# --------------------------------------------------------------------------------------
# Byte maps (int32 tensors holding 0..255 in, 0..255 out)
# --------------------------------------------------------------------------------------


def ocp_to_fnuz_same_bits(b: torch.Tensor) -> torch.Tensor:
    """OCP byte -> FNUZ byte with the same bits (the FNUZ value is half): −0 (0x80) -> 0x00,
    NaN (0x7F / 0xFF) -> 0x80, every other byte unchanged."""
    nan = (b & 0x7F) == 0x7F
    out = torch.where(b == 0x80, torch.zeros_like(b), b)
    return torch.where(nan, torch.full_like(b, 0x80), out)


def ocp_to_fnuz_same_value(b: torch.Tensor) -> torch.Tensor:
    """OCP byte -> the FNUZ byte of the same value: exact for |x| <= 240, |x| >= 256 saturates
    to ±240 (0x7F / 0xFF), ±0 -> 0x00, NaN -> 0x80.

    Normals (mag >= 8) move one exponent step up (mag + 8); subnormals m·2^-9 become
    2m·2^-10 (mag * 2, which is also right when 2m >= 8 lands in FNUZ's first binade).
    """
    sign = b & 0x80
    mag = b & 0x7F
    out = torch.where(mag >= 8, mag + 8, mag << 1)
    out = torch.where(mag >= 0x78, torch.full_like(b, 0x7F), out)
    out = torch.where(mag == 0, torch.zeros_like(b), sign | out)
    return torch.where(mag == 0x7F, torch.full_like(b, 0x80), out)


def fnuz_to_ocp_same_bits(b: torch.Tensor) -> torch.Tensor:
    """FNUZ byte -> OCP byte with the same bits (the OCP value is double): NaN (0x80) -> 0x7F,
    ±240 (0x7F / 0xFF, NaN bit patterns in OCP) -> ±448 (0x7E / 0xFE), others unchanged.

    (In RESCALE mode ±240 never occurs; in PASS mode the scale is 0 or inf, where ±240 and
    ±448 decode alike.)"""
    out = torch.where((b & 0x7F) == 0x7F, b - 1, b)
    return torch.where(b == 0x80, torch.full_like(b, 0x7F), out)


def fnuz_to_ocp_same_value(b: torch.Tensor) -> torch.Tensor:
    """FNUZ byte -> the OCP byte of the same value, round to nearest even: exact for
    |x| >= 2^-6 and for even multiples of 2^-10 below; NaN -> 0x7F; sign kept (a negative that
    rounds to zero becomes −0, 0x80).

    Normals with FNUZ exponent >= 2 (mag >= 16) move one exponent step down (mag − 8); below,
    the FNUZ value is mag·2^-10 and the OCP one q·2^-9 with q = RNE(mag / 2).
    """
    sign = b & 0x80
    mag = b & 0x7F
    q = mag >> 1
    small = q + (mag & q & 1)
    out = sign | torch.where(mag >= 16, mag - 8, small)
    return torch.where(b == 0x80, torch.full_like(b, 0x7F), out)


# --------------------------------------------------------------------------------------
# Group transcoding
# --------------------------------------------------------------------------------------


def _fp32_bits(sbytes: torch.Tensor) -> torch.Tensor:
    """[M, 4] little-endian bytes -> [M, 1] int64 bit patterns (0 .. 2^32-1)."""
    s = sbytes.to(I64)
    return (s[:, 0] | (s[:, 1] << 8) | (s[:, 2] << 16) | (s[:, 3] << 24)).unsqueeze(1)


def _fp32_bytes(bits: torch.Tensor) -> torch.Tensor:
    """[M, 1] int64 bit patterns -> [M, 4] little-endian bytes (uint8)."""
    shifts = torch.tensor([0, 8, 16, 24], dtype=I64, device=bits.device)
    return ((bits >> shifts) & 0xFF).to(torch.uint8)


def group_modes(
    q: torch.Tensor, scale: torch.Tensor, fp32_scale: bool, src_fnuz: bool
) -> torch.Tensor:
    """Mode of each group.  q: [M, NG, G] int32 source bytes; scale: [M, NG] ue8m0 codes
    (int32) or [M, 1] fp32 bit patterns (int64)."""
    e = (scale >> 23) & 0xFF if fp32_scale else scale
    mode = torch.full(scale.shape, RESCALE, dtype=I32, device=q.device)
    if not src_fnuz:  # OCP -> FNUZ: the scale doubles
        if fp32_scale:
            keep = e == 254  # 2s would overflow to inf
            passing = e == 255  # inf / NaN scale
        else:
            keep = e == 254  # code 255 is the infinite scale
            passing = (e == 0) | (e == 255)  # zero / infinite scale (code 0 -> 1 would not be exact)
    else:  # FNUZ -> OCP: the scale halves
        has_240 = ((q & 0x7F) == 0x7F).any(dim=-1)
        if fp32_scale:
            passing = e == 255
            halvable = (e >= 2) | ((scale & 1) == 0)  # s/2 exact (normal result or even mantissa)
            keep = ~passing & (has_240 | ~halvable)
        else:
            passing = (e == 0) | (e == 255)
            keep = ~passing & (has_240 | (e == 1))  # code 1 -> 0 would flush the scale to 0
    mode = torch.where(keep, torch.full_like(mode, KEEP), mode)
    return torch.where(passing, torch.full_like(mode, PASS), mode)


def _rescale(scale: torch.Tensor, fp32_scale: bool, src_fnuz: bool) -> torch.Tensor:
    if not fp32_scale:
        return scale - 1 if src_fnuz else scale + 1
    sign = scale & 0x80000000
    mag = scale & 0x7FFFFFFF
    e = mag >> 23
    if not src_fnuz:  # x2: exponent + 1, or a subnormal's mantissa shifted up
        return torch.where(e >= 1, scale + (1 << 23), sign | (mag << 1))
    # /2: exponent − 1, or (result subnormal) the significand shifted down (exact: checked)
    return torch.where(e >= 2, scale - (1 << 23), sign | (mag >> 1))


def transcode_records(
    vbytes: torch.Tensor, sbytes: torch.Tensor, rec: Record, src_fnuz: bool, dst_fnuz: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """Value bytes ``[M, value_bytes]`` and scale bytes ``[M, scale_bytes]`` (uint8, one row
    per token, value bytes in dim order) -> the transcoded rows (new tensors)."""
    if src_fnuz == dst_fnuz:
        return vbytes.clone(), sbytes.clone()
    m = vbytes.shape[0]
    fp32_scale = rec.scale == "fp32"
    q = vbytes[:, : rec.quant_dims].to(I32).reshape(m, rec.n_groups, rec.group)
    if fp32_scale:
        scale = _fp32_bits(sbytes)
    else:
        scale = sbytes[:, : rec.n_groups].to(I32)
    mode = group_modes(q, scale, fp32_scale, src_fnuz)

    if src_fnuz:
        same_bits, same_value = fnuz_to_ocp_same_bits(q), fnuz_to_ocp_same_value(q)
    else:
        same_bits, same_value = ocp_to_fnuz_same_bits(q), ocp_to_fnuz_same_value(q)
    keep = (mode == KEEP).unsqueeze(-1)
    q_out = torch.where(keep, same_value, same_bits)
    s_out = torch.where(mode == RESCALE, _rescale(scale, fp32_scale, src_fnuz), scale)

    v_new = vbytes.clone()
    s_new = sbytes.clone()  # the 584 pad byte stays as it was
    v_new[:, : rec.quant_dims] = q_out.reshape(m, rec.quant_dims).to(torch.uint8)
    if fp32_scale:
        s_new[:, :4] = _fp32_bytes(s_out)
    else:
        s_new[:, : rec.n_groups] = s_out.to(torch.uint8)
    return v_new, s_new


# --------------------------------------------------------------------------------------
# Paged op
# --------------------------------------------------------------------------------------


def _flat_bytes(cache: torch.Tensor) -> torch.Tensor:
    """1-D uint8 view of the storage span covered by ``cache`` (its first byte is index 0)."""
    if cache.numel() == 0:
        span = 0
    else:
        span = 1 + sum((s - 1) * st for s, st in zip(cache.shape, cache.stride()))
    return cache.as_strided((span,), (1,), cache.storage_offset())


def _page_indices(layout: CacheLayout, blk: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Flat byte indices ``[P*B, value_bytes]`` / ``[P*B, scale_bytes]`` of every token of pages ``blk``."""
    rec = layout.record
    dev = blk.device
    B = layout.block_size
    tok = torch.arange(B, dtype=I64, device=dev).repeat(blk.shape[0]).unsqueeze(1)
    base = (blk.to(I64) * layout.page_bytes).repeat_interleave(B).unsqueeze(1)
    vbyte = torch.arange(rec.value_bytes, dtype=I64, device=dev).unsqueeze(0)
    sbyte = torch.arange(rec.scale_bytes, dtype=I64, device=dev).unsqueeze(0)
    return base + layout.value_index(tok, vbyte), base + layout.scale_index(tok, sbyte)


def transcode_k_cache(src, dst, block_ids, block_size, width, src_fnuz, dst_fnuz, tiled) -> None:
    """Transcode pages ``block_ids`` of ``src`` into the same pages of ``dst``.

    A negative id, or one past either cache's page count, skips (never an out-of-bounds
    access).  Ids should be distinct; with duplicates the page is written with the same
    bytes several times (in-place: it is converted once here, but backends may race).
    """
    rec = record_for_width(width)
    n_ok = min(src.shape[0], dst.shape[0])
    ids = block_ids.to(I64)
    ids = ids[(ids >= 0) & (ids < n_ok)]
    if ids.numel() == 0:
        return
    tiled = bool(tiled) and rec is INDEXER_FP8
    lay_s = CacheLayout(rec, int(block_size), src.stride(0), tiled=tiled)
    lay_d = CacheLayout(rec, int(block_size), dst.stride(0), tiled=tiled)
    vs, ss = _page_indices(lay_s, ids)
    vd, sd = _page_indices(lay_d, ids)
    flat_s = _flat_bytes(src)
    vbytes, sbytes = flat_s[vs], flat_s[ss]  # gathered copies: every read precedes every write
    v_new, s_new = transcode_records(vbytes, sbytes, rec, bool(src_fnuz), bool(dst_fnuz))
    flat_d = _flat_bytes(dst)
    flat_d[vd.reshape(-1)] = v_new.reshape(-1)
    flat_d[sd.reshape(-1)] = s_new.reshape(-1)

