"""Fused RoPE + quantization of the sparse indexer's query (spec rope_quant_ops.md §2)."""

from __future__ import annotations

import torch

from .core import _calls
from .core import index_checks as _ic
from .core import platform as _platform
from .core._validate import INT_INDEX, Check
from .core.accepted_layouts import AcceptedLayouts
from .core.formats import MXFP4_BLOCK_SIZE

__all__ = ["fused_indexer_q_rope_quant"]

_ops = _calls.ops
_accepted = {"indexer_q": AcceptedLayouts()}
_FP8 = (torch.float8_e4m3fn, torch.float8_e4m3fnuz)


def fused_indexer_q_rope_quant(
    positions: torch.Tensor,
    index_q: torch.Tensor,
    index_q_cos_sin_cache: torch.Tensor,
    index_weights: torch.Tensor,
    index_weights_softmax_scale: float,
    index_weights_head_scale: float,
    use_fp4: bool = False,
    weights_out_dtype: torch.dtype = torch.float32,
    *,
    fp8_dtype: torch.dtype | None = None,
):
    """Fused RoPE + quantize Q for the sparse indexer.

    FP8 (``use_fp4=False``): returns ``(q_fp8 [T,H,D], weights_out [T,H] fp32)``;
    one power-of-two scale per (token, head) is folded into ``weights_out =
    weights * q_scale * softmax_scale * head_scale``.  ``fp8_dtype``
    (keyword-only) picks e4m3fn (clamp 448) or e4m3fnuz (clamp 224); default:
    the platform's native flavour (e4m3fnuz on gfx942, e4m3fn elsewhere).

    MXFP4 (``use_fp4=True``): returns ``((q_packed [T,H,D/2] uint8, q_scale
    [T,H] int32 = 4 ue8m0 bytes, first block lowest), weights_out)`` with
    ``weights_out = weights * softmax_scale * head_scale`` in
    ``weights_out_dtype`` (fp32 or bf16).
    """
    new = _accepted["indexer_q"].new((
        positions, index_q, index_q_cos_sin_cache, index_weights, index_weights_softmax_scale,
        index_weights_head_scale, use_fp4, weights_out_dtype, fp8_dtype,
    ))
    if new is not None:
        c = Check("fused_indexer_q_rope_quant")
        c.tensor("positions", positions, dtype=INT_INDEX, ndim=1)
        c.tensor("index_q", index_q, dtype=torch.bfloat16, ndim=3)
        c.stride("index_q", index_q, 2, expected=1)
        t, h, d = index_q.shape
        c.size("positions", positions, 0, expected=t)
        c.cos_sin("index_q_cos_sin_cache", index_q_cos_sin_cache)
        r = index_q_cos_sin_cache.shape[1]
        if r % 2 != 0 or r > d:
            c.fail("index_q_cos_sin_cache", f"an even rope width <= head_dim ({d})", f"shape {tuple(index_q_cos_sin_cache.shape)}")
        c.tensor("index_weights", index_weights, dtype=(torch.bfloat16, torch.float32), ndim=2)
        c.size("index_weights", index_weights, 0, expected=t)
        c.size("index_weights", index_weights, 1, expected=h)
        c.stride("index_weights", index_weights, 1, expected=1)
        c.number("index_weights_softmax_scale", index_weights_softmax_scale)
        c.number("index_weights_head_scale", index_weights_head_scale)
        c.flag("use_fp4", use_fp4)
        if not isinstance(weights_out_dtype, torch.dtype):
            c.fail("weights_out_dtype", "a torch.dtype", type(weights_out_dtype).__name__, TypeError)
        if use_fp4:
            if weights_out_dtype not in (torch.float32, torch.bfloat16):
                c.fail("weights_out_dtype", "float32 or bfloat16", weights_out_dtype, TypeError)
            if d % (4 * MXFP4_BLOCK_SIZE) != 0 or (d - r) % MXFP4_BLOCK_SIZE != 0:
                c.fail("index_q", "head_dim a multiple of 128 and a NoPE width a multiple of 32 for MXFP4",
                       f"head_dim {d}, rope {r}")
        else:
            if weights_out_dtype != torch.float32:
                c.fail("weights_out_dtype", "float32 on the FP8 path", weights_out_dtype, TypeError)
            if fp8_dtype is not None and fp8_dtype not in _FP8:
                c.fail("fp8_dtype", "torch.float8_e4m3fn or torch.float8_e4m3fnuz", fp8_dtype, TypeError)
        _accepted["indexer_q"].add(new)
    _ic.check_fused_indexer_q_rope_quant(positions, index_q, index_q_cos_sin_cache)
    t, h, d = index_q.shape
    ss = float(index_weights_softmax_scale)
    hs = float(index_weights_head_scale)
    dev = index_q.device
    if use_fp4:
        q = torch.empty(t, h, d // 2, dtype=torch.uint8, device=dev)
        # the scale bytes as the int32 words vLLM's API returns, [T, H] for D = 128: the kernels
        # take either form (formats.scale_byte_strides), so no dtype view and squeeze per call
        words = d // (4 * MXFP4_BLOCK_SIZE)
        if words == 1:
            scale = torch.empty(t, h, dtype=torch.int32, device=dev)
        else:
            scale = torch.empty(t, h, words, dtype=torch.int32, device=dev)
        w = torch.empty(t, h, dtype=weights_out_dtype, device=dev)
        if t > 0:
            _ops.fused_indexer_q_rope_quant(positions, index_q, index_q_cos_sin_cache, index_weights, ss, hs, True, False, q, scale, w)
        return (q, scale), w
    if fp8_dtype is None:
        fp8_dtype = _platform.probe().fp8_flavour.dtype
    q = torch.empty(t, h, d, dtype=fp8_dtype, device=dev)
    w = torch.empty(t, h, dtype=torch.float32, device=dev)
    if t > 0:
        empty = torch.empty(0, dtype=torch.uint8, device=dev)
        _ops.fused_indexer_q_rope_quant(
            positions, index_q, index_q_cos_sin_cache, index_weights, ss, hs, False,
            fp8_dtype == torch.float8_e4m3fnuz, q, empty, w,
        )
    return q, w
