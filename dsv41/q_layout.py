"""V4.1 Q head padding for FlashMLA's fused layout (spec rope_quant_ops.md §6.3)."""

from __future__ import annotations

import torch

from .core import _calls
from .core._validate import Check
from .core.accepted_layouts import AcceptedLayouts

__all__ = ["pad_fused_q_heads"]

_ops = _calls.ops
_accepted = {"pad": AcceptedLayouts()}


def pad_fused_q_heads(q: torch.Tensor, padded_heads: int) -> torch.Tensor:
    """Pad fused-layout Q ``[T, H, 512]`` to ``padded_heads`` heads with zeros.

    Per token the fused layout is 32 chunks of ``[H, 16]``; padding inserts
    zero heads inside every chunk.  Returns ``q`` itself when no padding is needed.
    """
    new = _accepted["pad"].new((q, padded_heads))
    if new is not None:
        c = Check("pad_fused_q_heads")
        c.tensor("q", q, ndim=3)
        c.size("q", q, 2, expected=512)
        c.stride("q", q, 2, expected=1)
        c.stride("q", q, 1, expected=512)
        c.integer("padded_heads", padded_heads, min_value=q.shape[1])
        if padded_heads % 16 != 0:
            c.fail("padded_heads", "a multiple of 16", padded_heads)
        _accepted["pad"].add(new)
    if padded_heads == q.shape[1]:
        return q
    out = torch.empty(q.shape[0], padded_heads, 512, dtype=q.dtype, device=q.device)
    if q.shape[0] > 0:
        _ops.pad_fused_q_heads(q, out)
    return out
