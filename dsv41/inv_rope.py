"""Fused inverse RoPE + block-scaled FP8 quantization of the attention output
(spec rope_quant_ops.md §4), feeding the grouped O-projection."""

from __future__ import annotations

import torch

from .core import _calls
from .core import index_checks as _ic
from .core._validate import INT_INDEX, Check
from .core.accepted_layouts import AcceptedLayouts

__all__ = ["fused_inv_rope_fp8_quant", "tma_aligned_size"]

_ops = _calls.ops
_accepted = {"inv_rope": AcceptedLayouts()}


def tma_aligned_size(x: int, element_size: int) -> int:
    """Round x up so 16-byte TMA rows start aligned (DeepGEMM's get_tma_aligned_size)."""
    align = 16 // element_size
    return (x + align - 1) // align * align


def fused_inv_rope_fp8_quant(
    o: torch.Tensor,
    positions: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    n_groups: int,
    heads_per_group: int,
    nope_dim: int = 448,
    rope_dim: int = 64,
    quant_group_size: int = 128,
    tma_aligned_scales: bool = False,
    quantize: bool = True,
    permuted_output: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Fused inverse RoPE + block-scaled FP8 quantization.

    ``o``: ``[T, n_groups*heads_per_group, nope_dim+rope_dim]`` bf16.  Returns
    ``(output [T, G, heads_per_group*head_dim], scales [T, G, K])`` as views of
    group-major buffers (each ``[:, g]`` slice contiguous).  Scales are fp32
    powers of two (SM90, ``tma_aligned_scales=False``) or int32 words of four
    ue8m0 bytes (SM100); their rows are padded to a multiple of 4 tokens
    (padding written 0).  ``quantize=False`` returns the rotated bf16 output and
    an empty scale tensor.  ``permuted_output`` (needs quantize,
    tma_aligned_scales and quant_group_size 32) writes FlashMLA's chunk order.
    """
    new = _accepted["inv_rope"].new((
        o, positions, cos_sin_cache, n_groups, heads_per_group, nope_dim, rope_dim, quant_group_size,
        tma_aligned_scales, quantize, permuted_output,
    ))
    if new is not None:
        c = Check("fused_inv_rope_fp8_quant")
        c.tensor("o", o, dtype=torch.bfloat16, ndim=3)
        c.contiguous("o", o)
        t, nh, dh = o.shape
        c.tensor("positions", positions, dtype=INT_INDEX, ndim=1)
        c.size("positions", positions, 0, expected=t)
        c.integer("n_groups", n_groups, min_value=1)
        c.integer("heads_per_group", heads_per_group, min_value=1)
        c.integer("nope_dim", nope_dim, min_value=0)
        c.integer("rope_dim", rope_dim, min_value=0)
        c.integer("quant_group_size", quant_group_size, min_value=1)
        c.flag("tma_aligned_scales", tma_aligned_scales)
        c.flag("quantize", quantize)
        c.flag("permuted_output", permuted_output)
        if nh != n_groups * heads_per_group:
            c.fail("o", f"n_groups*heads_per_group = {n_groups * heads_per_group} heads", f"shape {tuple(o.shape)}")
        if dh != nope_dim + rope_dim:
            c.fail("o", f"head_dim nope_dim+rope_dim = {nope_dim + rope_dim}", f"shape {tuple(o.shape)}")
        if dh % quant_group_size != 0:
            c.fail("quant_group_size", f"a divisor of head_dim {dh}", quant_group_size)
        if rope_dim % 2 != 0:
            c.fail("rope_dim", "an even number", rope_dim)
        c.cos_sin("cos_sin_cache", cos_sin_cache, rope_dim=rope_dim, dtypes=torch.float32)
        chunks = dh // quant_group_size
        if quantize and tma_aligned_scales and chunks % 4 != 0:
            c.fail("quant_group_size", "head_dim/quant_group_size a multiple of 4 for packed scales", quant_group_size)
        if permuted_output and not (quantize and tma_aligned_scales and quant_group_size == 32):
            c.fail("permuted_output", "quantize=True, tma_aligned_scales=True and quant_group_size=32",
                   f"quantize={quantize}, tma_aligned_scales={tma_aligned_scales}, quant_group_size={quant_group_size}")
        _accepted["inv_rope"].add(new)
    t, _, dh = o.shape
    dg = heads_per_group * dh
    dev = o.device
    out_buf = torch.empty(n_groups, t, dg, dtype=torch.float8_e4m3fn if quantize else o.dtype, device=dev)
    if quantize:
        ta = (t + 3) // 4 * 4  # tma_aligned_size(t, 4), inline: this is the hot path
        k = (dg // quant_group_size + 3) // 4 if tma_aligned_scales else dg // quant_group_size
        scale_buf = torch.empty(n_groups, k * ta, dtype=torch.int32 if tma_aligned_scales else torch.float32, device=dev)
    else:
        ta = k = 0
        scale_buf = torch.empty(n_groups, 0, dtype=torch.float32, device=dev)
    _ic.check_fused_inv_rope_fp8_quant(o, positions, cos_sin_cache)
    if t > 0:
        _ops.fused_inv_rope_fp8_quant(
            o, positions, cos_sin_cache, n_groups, heads_per_group, nope_dim, rope_dim, quant_group_size,
            tma_aligned_scales, quantize, permuted_output, out_buf, scale_buf,
        )
    output = out_buf.transpose(0, 1)
    if not quantize:
        return output, torch.empty(0, dtype=torch.float32, device=dev)
    # element (t, g, k) lives at scale_buf[g, k*ta + t]: MN-major per group.
    scales = scale_buf.as_strided((t, n_groups, k), (1, k * ta, ta))
    return output, scales
