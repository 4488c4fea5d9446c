"""V4.1 Q/KV RMSNorm with MXFP8 query quantization (seed module ``query_quant``;
spec rope_quant_ops.md §5)."""

from __future__ import annotations

import torch

from . import _library  # noqa: F401
from ._validate import Check

__all__ = ["fused_q_kv_rmsnorm_quant", "swizzled_scale_bytes"]

_ops = torch.ops.dsv41


def swizzled_scale_bytes(num_tokens: int, q_size: int) -> tuple[int, int]:
    """(Tp, Gp) of FlashInfer's F8_128x4 scale swizzle: rows padded to 128, groups to 4."""
    return (num_tokens + 127) // 128 * 128, (q_size // 32 + 3) // 4 * 4


def fused_q_kv_rmsnorm_quant(
    qr: torch.Tensor,
    kv: torch.Tensor,
    q_weight: torch.Tensor,
    kv_weight: torch.Tensor,
    eps: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """RMSNorm both Q and KV rows; quantize Q to MXFP8 for FlashInfer's MXFP8 GEMM.

    Returns ``(q_fp8 [T, Qs] e4m3fn, q_scale, kv_out [T, Ks])`` where ``q_scale``
    is the flat uint8 buffer of ``Tp*Gp`` ue8m0 bytes in FlashInfer's F8_128x4
    swizzle (see ``swizzled_scale_bytes``; padding bytes are 0).
    """
    c = Check("fused_q_kv_rmsnorm_quant")
    c.tensor("qr", qr, dtype=torch.bfloat16, ndim=2)
    c.stride("qr", qr, 1, expected=1)
    c.tensor("kv", kv, dtype=torch.bfloat16, ndim=2)
    c.stride("kv", kv, 1, expected=1)
    t, qs = qr.shape
    c.size("kv", kv, 0, expected=t)
    ks = kv.shape[1]
    if qs % 32 != 0:
        c.fail("qr", "a row size that is a multiple of 32 (MXFP8 groups)", f"shape {tuple(qr.shape)}")
    c.tensor("q_weight", q_weight, ndim=1)
    c.size("q_weight", q_weight, 0, expected=qs)
    c.contiguous("q_weight", q_weight)
    c.tensor("kv_weight", kv_weight, ndim=1)
    c.size("kv_weight", kv_weight, 0, expected=ks)
    c.contiguous("kv_weight", kv_weight)
    eps = c.number("eps", eps)
    tp, gp = swizzled_scale_bytes(t, qs)
    q_out = torch.empty((t, qs), dtype=torch.float8_e4m3fn, device=qr.device)
    q_scale = torch.empty((tp * gp,), dtype=torch.uint8, device=qr.device)
    kv_out = torch.empty((t, ks), dtype=kv.dtype, device=kv.device)
    if t > 0:
        _ops.fused_q_kv_rmsnorm_quant(qr, kv, q_weight, kv_weight, eps, q_out, q_scale, kv_out)
    return q_out, q_scale, kv_out
