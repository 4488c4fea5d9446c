"""CPU kernels of the paged K-cache ops (C++/OpenMP in ``cache_kernels.cpp``, numerics in ``common.h``).

Each function has exactly the kernel-contract signature (docs/kernel_contract.md): the
arguments are already validated, outputs are written in place and ``None`` is returned.
The wrappers only pass pointers and strides to the library; small index/scalar inputs
(slot mappings, positions, lengths, block tables, the norm weight) are converted to the
dtype / layout the C code reads when they are not already in it, and an input whose last
dim is not unit-stride is made contiguous.  A cache or an output is never copied: the C
code addresses it through ``data_ptr()`` (storage offset included) and its strides, so
views (flat page views, padded page strides) are written in place and page padding is
never touched.

Ops: ``quantize_and_insert_k_cache``, ``dequantize_and_gather_k_cache``,
``rope_quant_insert``, ``indexer_k_norm_rope_store``.
"""

from __future__ import annotations

import ctypes

import torch

from . import bounds
from ._build import load_typed
from dsv41.core import gpu_approx

__all__ = [
    "quantize_and_insert_k_cache",
    "dequantize_and_gather_k_cache",
    "rope_quant_insert",
    "indexer_k_norm_rope_store",
    "library",
    "build_error",
    "simd",
]

LIB_NAME = "dsv41_cache_kernels"
SOURCES = ["cache_kernels.cpp"]

_P = ctypes.c_void_p
_I64 = ctypes.c_int64
_I32 = ctypes.c_int32
_F32 = ctypes.c_float

_SIGNATURES = {
    "dsv41_quantize_insert_k": [_P, _I64, _P, _I64, _P, _I64, _I64, _I32, _I32, _I32],
    "dsv41_dequant_gather_k": [_P, _I64, _I64, _P, _I64, _I32, _P, _P, _I64, _P, _I64, _I64, _I64, _I64, _I32, _I32],
    "dsv41_rope_quant_insert": [_P, _I64, _P, _P, _I32, _I64, _I64, _P, _I32, _I64, _I64, _P, _I64, _I64, _I64, _P, _I32, _I32],
    "dsv41_indexer_k_store": [_P, _I64, _P, _P, _I32, _I64, _I64, _I32, _P, _F32, _P, _P, _I64, _I64, _P, _I64, _I64, _I32, _I32, _I64],
    "dsv41_codec_e4m3_encode": [_P, _P, _I64, _I32],
    "dsv41_codec_e4m3_decode": [_P, _P, _I64, _I32, _I32],
    "dsv41_codec_e2m1_encode": [_P, _P, _I64],
    "dsv41_codec_bf16_rne": [_P, _P, _I64, _I32],
    "dsv41_codec_ceil_log2": [_P, _P, _I64, _I32],
    "dsv41_codec_exp2i": [_P, _P, _I64],
    "dsv41_codec_clamp_sym": [_P, _P, _I64, _F32],
    "dsv41_codec_v16_e4m3_encode": [_P, _P, _I64, _I32, ctypes.c_uint32, ctypes.c_uint32],
    "dsv41_codec_v16_e4m3_decode": [_P, _P, _I64, _I32],
    "dsv41_codec_v16_e2m1_encode": [_P, _P, _I64],
    "dsv41_codec_v16_bf16": [_P, _P, _I64, _I32],
    "dsv41_codec_v16_ceil_log2": [_P, _P, _I64],
    "dsv41_cache_kernels_simd": [],
}

_LIB = None


def library() -> ctypes.CDLL:
    """The compiled library with argument types set (built on first use, then cached)."""
    global _LIB
    if _LIB is None:
        _LIB = load_typed(LIB_NAME, SOURCES, _SIGNATURES)
    return _LIB


def build_error() -> str | None:
    """None if the library builds and loads here, else the reason (for the capability sheet)."""
    try:
        library()
    except (RuntimeError, OSError, AttributeError) as exc:
        return str(exc)
    return None


def simd() -> bool:
    """True when the AVX-512 token paths were compiled in (else the portable C++ paths run)."""
    return bool(library().dsv41_cache_kernels_simd())


def _check(rc: int, op: str) -> None:
    if rc != 0:
        raise ValueError(f"{op}: CPU kernel rejected its arguments (code {rc})")


def _ptr(t: torch.Tensor | None):
    return None if t is None else t.data_ptr()


def _i64(t: torch.Tensor, n: int | None = None) -> torch.Tensor:
    """First ``n`` elements of a 1-D index tensor as contiguous int64 (copied only if needed)."""
    t = t.reshape(-1)
    if n is not None:
        t = t[:n]
    if t.dtype != torch.int64:
        t = t.to(torch.int64)
    return t.contiguous()


def _i32(t: torch.Tensor) -> torch.Tensor:
    if t.dtype != torch.int32:
        t = t.to(torch.int32)
    return t


def _unit_last(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 or t.shape[-1] <= 1 else t.contiguous()


def _check_slots_positions(op: str, slots, pos, cache, cos_sin_cache, args: list, slot_arg: str) -> None:
    """Writers of paged records: slots >= 0 inside the cache, their positions inside cos/sin."""
    T = slots.shape[0]
    if (bounds.first_outside(slots, T, 0, cache.shape[0] * cache.shape[1], skip_negative=True) >= 0
            or bounds.first_outside(pos, T, 0, cos_sin_cache.shape[0], mask=slots) >= 0):
        bounds.reject(op, args, slot_arg)


def _cos_sin_args(cos_sin_cache: torch.Tensor):
    cs = cos_sin_cache
    if cs.dtype not in (torch.float32, torch.bfloat16):
        cs = cs.to(torch.float32)
    return cs, int(cs.dtype == torch.bfloat16), cs.stride(0), cs.stride(1)


# --------------------------------------------------------------------------------------
# quantize_and_insert_k_cache (spec cache_ops §3)
# --------------------------------------------------------------------------------------


def quantize_and_insert_k_cache(
    k, k_cache, slot_mapping, block_size, use_fnuz, bytes_per_token, interleaved=False,
) -> None:
    T = slot_mapping.shape[0]
    if T == 0:
        return
    slots = _i64(slot_mapping)
    if bounds.first_outside(slots, T, 0, k_cache.shape[0] * int(block_size), skip_negative=True) >= 0:
        bounds.reject("quantize_and_insert_k_cache", [k, k_cache, slot_mapping, block_size], "slot_mapping")
    k = _unit_last(k)
    rc = library().dsv41_quantize_insert_k(
        k.data_ptr(), k.stride(0), k_cache.data_ptr(), k_cache.stride(0),
        slots.data_ptr(), T, int(block_size), int(bool(use_fnuz)),
        528 if int(bytes_per_token) == 528 else 584, int(bool(interleaved)),
    )
    _check(rc, "quantize_and_insert_k_cache")


# --------------------------------------------------------------------------------------
# dequantize_and_gather_k_cache (spec cache_ops §4)
# --------------------------------------------------------------------------------------


def dequantize_and_gather_k_cache(
    out, k_cache, seq_lens, gather_lens, block_table, block_size, offset, use_fnuz, interleaved=False,
) -> None:
    if out.dtype != torch.bfloat16 or out.stride(-1) != 1:
        # Outside the contract (out is bf16 with a unit last stride): let the reference do it.
        from dsv41.reference.k_cache import dequantize_and_gather_k_cache as ref

        args = (out, k_cache, seq_lens, gather_lens, block_table, block_size, offset, use_fnuz)
        ref(*args, interleaved) if interleaved else ref(*args)
        return
    lens = _i32(seq_lens).reshape(-1).contiguous()
    glens = None if gather_lens is None else _i32(gather_lens).reshape(-1).contiguous()
    num_reqs = lens.shape[0] if glens is None else glens.shape[0]
    if num_reqs == 0:
        return
    bt = _i32(block_table)
    if bounds.gather_first_bad(lens, glens, bt, k_cache.shape[0], int(block_size), int(offset), out.shape[1]) >= 0:
        bounds.reject("dequantize_and_gather_k_cache",
                      [out, k_cache, seq_lens, gather_lens, block_table, block_size, offset], "seq_lens")
    rc = library().dsv41_dequant_gather_k(
        out.data_ptr(), out.stride(0), out.stride(1),
        k_cache.data_ptr(), k_cache.stride(0), int(k_cache.shape[-1]),
        lens.data_ptr(), _ptr(glens), num_reqs,
        bt.data_ptr(), bt.stride(0), bt.stride(1) if bt.dim() > 1 else 1,
        int(block_size), int(offset), int(bool(use_fnuz)), int(bool(interleaved)),
    )
    _check(rc, "dequantize_and_gather_k_cache")


# --------------------------------------------------------------------------------------
# rope_quant_insert (spec cache_ops §8.2)
# --------------------------------------------------------------------------------------

_RECORD_KIND = {584: 0, 528: 1, 288: 2}


def rope_quant_insert(
    latent, positions, cos_sin_cache, kv_cache, slot_mapping, compress_ratio, fp8_scale, sanitize_nans,
    interleaved=False,
) -> None:
    T = slot_mapping.numel()
    if T == 0:
        return
    slots = _i64(slot_mapping)
    pos = _i64(positions, T)
    _check_slots_positions("rope_quant_insert", slots, pos, kv_cache, cos_sin_cache,
                           [latent, positions, cos_sin_cache, kv_cache, slot_mapping, compress_ratio], "slot_mapping")
    latent = _unit_last(latent)
    cs, cs_bf16, cs0, cs1 = _cos_sin_args(cos_sin_cache)
    scale = None
    if kv_cache.dtype == torch.uint8:
        kind = _RECORD_KIND.get(int(kv_cache.shape[-1]))
        if kind is None:
            raise ValueError(f"unsupported paged KV record width {kv_cache.shape[-1]}")
        c0, c1 = kv_cache.stride(0), 0
    else:
        kind = 3 if kv_cache.dtype == torch.bfloat16 else 4
        c0, c1 = kv_cache.stride(0), kv_cache.stride(1)
        if kind == 4:
            scale = fp8_scale.reshape(-1)[:1].to(torch.float32).contiguous()
    rc = library().dsv41_rope_quant_insert(
        latent.data_ptr(), latent.stride(0), pos.data_ptr(),
        cs.data_ptr(), cs_bf16, cs0, cs1,
        kv_cache.data_ptr(), kind, c0, c1,
        slots.data_ptr(), T, int(kv_cache.shape[1]), int(compress_ratio),
        _ptr(scale), int(bool(sanitize_nans)), int(bool(interleaved)),
    )
    _check(rc, "rope_quant_insert")


# --------------------------------------------------------------------------------------
# indexer_k_norm_rope_store (spec rope_quant_ops §3)
# --------------------------------------------------------------------------------------


def indexer_k_norm_rope_store(
    k_pre, positions, cos_sin_cache, rms_norm_weight, rms_norm_eps, k_cache, kv_slot_mapping,
    compress_ratio, use_fp4_cache, mxfp4_n_per_tile, tiled,
) -> None:
    T = kv_slot_mapping.numel()
    if T == 0:
        return
    slots = _i64(kv_slot_mapping)
    pos = _i64(positions, T)
    _check_slots_positions("indexer_k_norm_rope_store", slots, pos, k_cache, cos_sin_cache,
                           [k_pre, positions, cos_sin_cache, rms_norm_weight, rms_norm_eps, k_cache, kv_slot_mapping,
                            compress_ratio], "kv_slot_mapping")
    k_pre = _unit_last(k_pre)
    cs, cs_bf16, cs0, cs1 = _cos_sin_args(cos_sin_cache)
    w = rms_norm_weight.reshape(-1).to(torch.float32).contiguous()
    rc = library().dsv41_indexer_k_store(
        k_pre.data_ptr(), k_pre.stride(0), pos.data_ptr(),
        cs.data_ptr(), cs_bf16, cs0, cs1, int(cos_sin_cache.shape[-1]),
        w.data_ptr(), float(rms_norm_eps), gpu_approx.result_bits("rsqrt", "cpu").data_ptr(),
        k_cache.data_ptr(), k_cache.stride(0), int(k_cache.shape[1]),
        slots.data_ptr(), T, int(compress_ratio),
        int(bool(use_fp4_cache)), int(bool(tiled)), int(mxfp4_n_per_tile),
    )
    _check(rc, "indexer_k_norm_rope_store")
