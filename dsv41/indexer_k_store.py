"""Indexer K production for DeepSeek V4.1 kv-source layers (seed module ``indexer_k_store``;
spec rope_quant_ops.md §3)."""

from __future__ import annotations

import torch

from .core import _calls
from .core import index_checks as _ic
from .core import platform as _platform
from .core._validate import INT_INDEX, Check
from .core.accepted_layouts import AcceptedLayouts
from .core.formats import TILE

__all__ = ["indexer_k_norm_rope_store"]

_ops = _calls.ops
_accepted = {"indexer_k": AcceptedLayouts()}


def _default_tiled(block_size: int) -> bool:
    """vLLM's choice: the tiled layout on ROCm platforms for pages of more than one token."""
    return _platform.probe().is_rocm and block_size > 1


def indexer_k_norm_rope_store(
    k_pre: torch.Tensor,
    positions: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    rms_norm_weight: torch.Tensor,
    rms_norm_eps: float,
    k_cache: torch.Tensor,
    kv_slot_mapping: torch.Tensor,
    compress_ratio: int,
    use_fp4_cache: bool,
    mxfp4_n_per_tile: int = 0,
    *,
    tiled: bool | None = None,
) -> None:
    """k_norm -> RoPE -> quant -> paged store for indexer keys.

    Token t writes iff ``kv_slot_mapping[t] >= 0`` and it closes a compression
    group.  FP8 cache: 128 e4m3fn bytes + an fp32 power-of-two scale per token
    (132 B); MXFP4 cache: 64 packed bytes + 4 ue8m0 bytes (68 B).  ``tiled``
    (keyword-only) selects ROCm's tiled value layout (16x16 tiles for FP8,
    aiter's preshuffle with ``mxfp4_n_per_tile`` tokens for MXFP4); by default
    it follows vLLM: on for ROCm platforms with ``block_size > 1``.
    """
    new = _accepted["indexer_k"].new((
        k_pre, positions, cos_sin_cache, rms_norm_weight, rms_norm_eps, k_cache, kv_slot_mapping,
        compress_ratio, use_fp4_cache, mxfp4_n_per_tile, tiled,
    ))
    if new is not None:
        c = Check("indexer_k_norm_rope_store")
        c.tensor("k_pre", k_pre, dtype=torch.bfloat16, ndim=2)
        c.size("k_pre", k_pre, 1, expected=128)
        c.stride("k_pre", k_pre, 1, expected=1)
        c.tensor("positions", positions, dtype=INT_INDEX, ndim=1)
        c.cos_sin("cos_sin_cache", cos_sin_cache, rope_dim=64)
        c.tensor("rms_norm_weight", rms_norm_weight, dtype=(torch.bfloat16, torch.float32), ndim=1)
        c.size("rms_norm_weight", rms_norm_weight, 0, expected=128)
        c.contiguous("rms_norm_weight", rms_norm_weight)
        c.number("rms_norm_eps", rms_norm_eps)
        c.tensor("kv_slot_mapping", kv_slot_mapping, dtype=INT_INDEX, ndim=1)
        t = kv_slot_mapping.shape[0]
        c.size("k_pre", k_pre, 0, at_least=t)
        c.size("positions", positions, 0, at_least=t)
        c.integer("compress_ratio", compress_ratio, choices=(1, 2))
        c.flag("use_fp4_cache", use_fp4_cache)
        c.integer("mxfp4_n_per_tile", mxfp4_n_per_tile, min_value=0)
        c.tensor("k_cache", k_cache, dtype=torch.uint8, ndim=3)
        block_size = k_cache.shape[1]
        token_bytes = 68 if use_fp4_cache else 132
        if k_cache.shape[0] > 1 and k_cache.stride(0) < block_size * token_bytes:
            c.fail("k_cache", f"page stride >= block_size*{token_bytes} bytes", f"strides {k_cache.stride()}")
        if tiled is not None:
            c.flag("tiled", tiled)
        tiled = _default_tiled(block_size) if tiled is None else tiled
        if tiled and not use_fp4_cache and block_size % TILE != 0:
            c.fail("k_cache", f"block_size % {TILE} == 0 for the tiled ROCm layout", f"block_size {block_size}")
        if tiled and use_fp4_cache:
            if mxfp4_n_per_tile not in (16, 32, 64) or block_size % mxfp4_n_per_tile != 0:
                c.fail(
                    "mxfp4_n_per_tile",
                    f"16, 32 or 64 dividing block_size ({block_size}) for the tiled MXFP4 layout",
                    mxfp4_n_per_tile,
                )
        _accepted["indexer_k"].add(new)
    t = kv_slot_mapping.shape[0]
    if tiled is None:
        tiled = _default_tiled(k_cache.shape[1])
    if t == 0:
        return
    _ic.check_indexer_k_norm_rope_store(positions, cos_sin_cache, k_cache, kv_slot_mapping, compress_ratio)
    _ops.indexer_k_norm_rope_store(
        k_pre, positions, cos_sin_cache, rms_norm_weight, float(rms_norm_eps), k_cache, kv_slot_mapping,
        compress_ratio, use_fp4_cache, mxfp4_n_per_tile, tiled,
    )
