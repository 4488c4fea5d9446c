"""Triton kernel of ``transcode_k_cache`` (OCP <-> FNUZ e4m3 paged K caches).

Shared by the cuda:triton, rocm and xpu backends.  The rules (group modes RESCALE / PASS /
KEEP, byte maps, scale arithmetic) are defined in ``dsv41/transcode.py`` and
``dsv41/reference/transcode.py``; the kernel is pure integer arithmetic on bytes (no float
conversion, no vendor switch), so every vendor — and Triton's interpreter — writes the
reference's bytes.

One program handles ``BT`` tokens of one listed page: it loads their value bytes as a
``[BT, NGP, G]`` tile (token, scale group, byte; the 132 record's tiled layout only changes
the offsets), their scales, decides each group's mode, and stores the transcoded bytes; the
584 record's bf16 tail and pad scale byte are copied.  Every load of a program precedes its
stores and programs own disjoint tokens, so ``src`` may be ``dst``.  A negative page id, or
one past either cache's page count, masks the whole program (no access at all).

Launcher: kernel-contract signature (docs/kernel_contract.md), one launch, no allocation,
no host synchronisation (CUDA-graph capture safe).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from dsv41.core.formats import RECORDS

from . import launch
from .bound import bind

__all__ = ["transcode_k_cache"]

# width -> (VB value bytes, SB scale bytes, NG fp8 groups, G bytes per group, TAIL verbatim
#           value bytes after the groups, FP32 scale), from the records of dsv41.core.formats
_RECORDS = {
    w: (r.value_bytes, r.scale_bytes, r.n_groups, r.group, 2 * r.bf16_dims, r.scale == "fp32")
    for w, r in RECORDS.items() if r.holds_fp8
}
_TILE_ELEMS = 4096  # value bytes (incl. masked group padding) per program


def _pow2(n: int) -> int:
    return launch.pow2(n)


# ------------------------------------------------------------------ byte maps (int32 in/out)


@triton.jit
def _o2f_bits(q):
    """OCP -> FNUZ, same bits: −0 -> 0x00, NaN -> 0x80."""
    out = tl.where(q == 0x80, 0, q)
    return tl.where((q & 0x7F) == 0x7F, 0x80, out)


@triton.jit
def _o2f_value(q):
    """OCP -> FNUZ byte of the same value (saturating at ±240)."""
    sign = q & 0x80
    mag = q & 0x7F
    out = tl.where(mag >= 8, mag + 8, mag << 1)
    out = tl.where(mag >= 0x78, 0x7F, out)
    out = tl.where(mag == 0, 0, sign | out)
    return tl.where(mag == 0x7F, 0x80, out)


@triton.jit
def _f2o_bits(q):
    """FNUZ -> OCP, same bits: NaN -> 0x7F, ±240 -> ±448."""
    out = tl.where((q & 0x7F) == 0x7F, q - 1, q)
    return tl.where(q == 0x80, 0x7F, out)


@triton.jit
def _f2o_value(q):
    """FNUZ -> OCP byte of the same value, round to nearest even (sign kept)."""
    sign = q & 0x80
    mag = q & 0x7F
    h = mag >> 1
    out = sign | tl.where(mag >= 16, mag - 8, h + (mag & h & 1))
    return tl.where(q == 0x80, 0x7F, out)


# ------------------------------------------------------------------ kernel


@triton.jit
def _transcode_kernel(
    src_ptr, s_page, dst_ptr, d_page, ids_ptr, ids_stride, n_blocks, B,
    VB: tl.constexpr, SB: tl.constexpr, SBP: tl.constexpr, NG: tl.constexpr, NGP: tl.constexpr,
    G: tl.constexpr, TAIL: tl.constexpr, FP32: tl.constexpr, TILED: tl.constexpr,
    SAME: tl.constexpr, SRC_FNUZ: tl.constexpr, BT: tl.constexpr,
):
    pid = tl.program_id(0)
    blk = tl.load(ids_ptr + pid.to(tl.int64) * ids_stride).to(tl.int64)
    ok = (blk >= 0) & (blk < n_blocks)
    blk = tl.where(ok, blk, 0)
    sbase = src_ptr + blk * s_page
    dbase = dst_ptr + blk * d_page

    t = tl.program_id(1) * BT + tl.arange(0, BT)  # [BT] tokens of the page
    tmask = t < tl.where(ok, B, 0)  # an invalid page id masks every access
    t64 = t.to(tl.int64)
    t3 = t64[:, None, None]
    g2 = tl.arange(0, NGP)[None, :]  # [1, NGP]
    g3 = g2[:, :, None]
    d3 = g3 * G + tl.arange(0, G)[None, None, :]  # [1, NGP, G] dim index
    if TILED:
        voff = (t3 // 16) * 2048 + (d3 // 16) * 256 + (t3 % 16) * 16 + d3 % 16
    else:
        voff = t3 * VB + d3
    vmask = tmask[:, None, None] & (g3 < NG)
    q = tl.load(sbase + voff, mask=vmask, other=0).to(tl.int32)  # [BT, NGP, G]
    scale_base = B * VB + t64 * SB  # [BT] (int64)

    if FP32:
        k = tl.arange(0, 4)[None, :]
        smask = tmask[:, None] & (k < 4)
        sb = tl.load(sbase + scale_base[:, None] + k, mask=smask, other=0).to(tl.int64)
        bits = tl.sum(sb << (k.to(tl.int64) * 8), axis=1)[:, None]  # [BT, 1] (NGP == 1)
        bits_out = bits
    else:
        smask = tmask[:, None] & (g2 < SB)
        code = tl.load(sbase + scale_base[:, None] + g2, mask=smask, other=0).to(tl.int32)  # [BT, NGP]
        code_out = code

    q_out = q
    if not SAME:
        # Mode per group: 0 RESCALE, 1 PASS, 2 KEEP (dsv41/transcode.py).
        if FP32:
            sign = (bits >> 31) << 31
            mag = bits - sign
            e = mag >> 23
            if SRC_FNUZ:
                has240 = tl.max(((q & 0x7F) == 0x7F).to(tl.int32), axis=2) > 0
                halvable = (e >= 2) | ((bits & 1) == 0)
                passing = e == 255
                keep = (~passing) & (has240 | (~halvable))
                resc = tl.where(e >= 2, bits - (1 << 23), sign | (mag >> 1))
            else:
                passing = e == 255
                keep = e == 254
                resc = tl.where(e >= 1, bits + (1 << 23), sign | (mag << 1))
            bits_out = tl.where(passing | keep, bits, resc)
        else:
            passing = (code == 0) | (code == 255)
            if SRC_FNUZ:
                has240 = tl.max(((q & 0x7F) == 0x7F).to(tl.int32), axis=2) > 0
                keep = (~passing) & (has240 | (code == 1))
                resc = code - 1
            else:
                keep = code == 254
                resc = code + 1
            code_out = tl.where(passing | keep | (g2 >= NG), code, resc)
        keep3 = keep[:, :, None]
        if SRC_FNUZ:
            q_out = tl.where(keep3, _f2o_value(q), _f2o_bits(q))
        else:
            q_out = tl.where(keep3, _o2f_value(q), _o2f_bits(q))

    if TAIL > 0:  # 584: the 64 bf16 RoPE dims, verbatim
        j = tl.arange(0, TAIL)[None, :]
        toff = t64[:, None] * VB + NG * G + j
        tm = tmask[:, None] & (j < TAIL)
        tail = tl.load(sbase + toff, mask=tm, other=0)

    tl.store(dbase + voff, q_out.to(tl.uint8), mask=vmask)
    if TAIL > 0:
        tl.store(dbase + toff, tail, mask=tm)
    if FP32:
        tl.store(dbase + scale_base[:, None] + k, ((bits_out >> (k.to(tl.int64) * 8)) & 0xFF).to(tl.uint8), mask=smask)
    else:
        tl.store(dbase + scale_base[:, None] + g2, code_out.to(tl.uint8), mask=smask)


_transcode_launch = bind(_transcode_kernel)


def _config(width: int, block_size: int) -> dict:
    vb, sb, ng, g, tail, fp32 = _RECORDS[int(width)]
    ngp = _pow2(ng)
    bt = max(1, min(_pow2(block_size), _TILE_ELEMS // (ngp * g)))
    return dict(VB=vb, SB=sb, SBP=_pow2(sb), NG=ng, NGP=ngp, G=g, TAIL=tail, FP32=fp32, BT=bt)


def transcode_k_cache(
    src: torch.Tensor,
    dst: torch.Tensor,
    block_ids: torch.Tensor,
    block_size: int,
    width: int,
    src_fnuz: bool,
    dst_fnuz: bool,
    tiled: bool,
) -> None:
    n = block_ids.shape[0]
    if n == 0:
        return
    B = int(block_size)
    c = _config(width, B)
    grid = (n, launch.cdiv(B, c["BT"]))
    _transcode_launch(grid,
        src, src.stride(0), dst, dst.stride(0), block_ids, block_ids.stride(0),
        min(src.shape[0], dst.shape[0]), B,
        TILED=bool(tiled) and bool(c["FP32"]), SAME=bool(src_fnuz) == bool(dst_fnuz),
        SRC_FNUZ=bool(src_fnuz), num_warps=4, **c,
    )
    return None


# ============================================================================== AOT


def _register_aot() -> None:
    """Representative variants for ``backends/triton/aot.py`` (B = 64; every vendor)."""
    from .aot import AotSpec, register

    targets = ("sm90", "sm100", "gfx942", "gfx950")
    for width, src_fnuz, tiled in ((584, False, False), (584, True, False), (528, False, False),
                                   (528, True, False), (132, False, False), (132, True, True)):
        c = dict(_config(width, 64), TILED=tiled, SAME=False, SRC_FNUZ=src_fnuz)
        sig = {a: ("constexpr" if a in c else "*u8" if a in ("src_ptr", "dst_ptr") else
                   "*i32" if a == "ids_ptr" else "i64" if a in ("s_page", "d_page") else "i32")
               for a in _transcode_kernel.arg_names}
        tag = f"{width}-{'f2o' if src_fnuz else 'o2f'}{'-tiled' if tiled else ''}"
        register(AotSpec(f"transcode_kernel._transcode_kernel[{tag}]", _transcode_kernel, sig, c,
                         num_warps=4, targets=targets, divisible=("src_ptr", "dst_ptr")))


_register_aot()
