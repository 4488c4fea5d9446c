"""V4.1 Q/KV RMSNorm with MXFP8 query quantization (seed module ``query_quant``;
spec rope_quant_ops.md §5)."""

from __future__ import annotations

import dataclasses

import torch

from .core import _calls
from .core._validate import Check
from .core.accepted_layouts import AcceptedLayouts

__all__ = [
    "fused_q_kv_rmsnorm_quant",
    "QuantizedActivation",
    "QuantKey",
    "MXFP8_DYNAMIC",
    "can_fuse_query_quant",
    "mxfp8_scale_bytes",
    "mxfp8_scale_offset",
    "swizzled_scale_bytes",
]

_ops = _calls.ops
_accepted = {"q_kv": AcceptedLayouts()}

MXFP8_GROUP = 32  # dims per ue8m0 scale


@dataclasses.dataclass(frozen=True)
class QuantKey:
    """How to read a quantized activation: element dtype, scale dtype, scale group shape
    (rows, cols), whether the scale is static, and symmetry — the fields vLLM's
    ``QuantKey`` / ``ScaleDesc`` carry, without importing vLLM."""

    dtype: torch.dtype
    scale_dtype: torch.dtype
    group_shape: tuple
    static: bool = False
    symmetric: bool = True


# MXFP8 with one dynamic ue8m0 scale per 32 dims of a row (vLLM's ``kMxfp8Dynamic``).
MXFP8_DYNAMIC = QuantKey(torch.float8_e4m3fn, torch.uint8, (1, MXFP8_GROUP))


@dataclasses.dataclass
class QuantizedActivation:
    """A quantized activation with its scales and what it was quantized from — the fields
    of vLLM 0.33's ``QuantizedActivation`` (``data``, ``scale``, ``orig_dtype``,
    ``orig_shape``, ``quant_key``).  The dsv41 vLLM plugin turns it into vLLM's class."""

    data: torch.Tensor
    scale: torch.Tensor
    orig_dtype: torch.dtype
    orig_shape: torch.Size
    quant_key: QuantKey = MXFP8_DYNAMIC


def swizzled_scale_bytes(num_tokens: int, q_size: int) -> tuple[int, int]:
    """(Tp, Gp) of FlashInfer's F8_128x4 scale swizzle: rows padded to 128, groups to 4."""
    return (num_tokens + 127) // 128 * 128, (q_size // MXFP8_GROUP + 3) // 4 * 4


def mxfp8_scale_bytes(tokens: int, width: int) -> int:
    """Bytes of the F8_128x4 scale buffer for ``tokens`` rows of ``width`` MXFP8 values."""
    c = Check("mxfp8_scale_bytes")
    c.integer("tokens", tokens, min_value=0)
    c.integer("width", width, min_value=0)
    tp, gp = swizzled_scale_bytes(tokens, width)
    return tp * gp


def __getattr__(name: str):
    # ``mxfp8_scale_offset`` is a Triton device function (for callers' own kernels); it is
    # built on first access so that importing dsv41 never needs Triton.
    if name == "mxfp8_scale_offset":
        from .backends.triton.scale_swizzle import mxfp8_scale_offset

        return mxfp8_scale_offset
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


_MXFP8_GEMM_KERNELS = ("FlashInferCutedslMxfp8LinearKernel", "FlashInferCutlassMxfp8LinearKernel")


def _is_mxfp8_dynamic(key) -> bool:
    """Duck-typed: a key (dsv41's or vLLM's) for dynamic e4m3 data with ue8m0 scales per 1x32."""
    if key is None:
        return False
    if isinstance(key, QuantKey):
        return key == MXFP8_DYNAMIC
    scale = getattr(key, "scale", None)
    shape = getattr(scale, "group_shape", None)
    try:
        shape = tuple(int(v) for v in shape)
    except TypeError:
        return False
    return (
        getattr(key, "dtype", None) == torch.float8_e4m3fn
        and getattr(scale, "static", True) is False
        and shape == (1, MXFP8_GROUP)
        and getattr(key, "scale2", None) is None
    )


def can_fuse_query_quant(linears: list) -> bool:
    """Whether every layer in ``linears`` takes the pre-quantized MXFP8 activation that
    ``fused_q_kv_rmsnorm_quant`` produces (the F8_128x4 scale layout of FlashInfer's
    MXFP8 GEMMs), as vLLM 0.33 decides it: the layer advertises an MXFP8-dynamic input key
    (``_input_quant_key``, unless ``requires_unquantized_input``) and its quant method's
    kernel is one of FlashInfer's MXFP8 linear kernels, on an NVIDIA CUDA device."""
    if not (torch.cuda.is_available() and torch.version.hip is None):
        return False
    for layer in linears:
        if getattr(layer, "requires_unquantized_input", False):
            return False
        if not _is_mxfp8_dynamic(getattr(layer, "_input_quant_key", None)):
            return False
        kernel = getattr(getattr(layer, "quant_method", None), "kernel", None)
        if type(kernel).__name__ not in _MXFP8_GEMM_KERNELS:
            return False
    return True


def fused_q_kv_rmsnorm_quant(
    qr: torch.Tensor,
    kv: torch.Tensor,
    q_weight: torch.Tensor,
    kv_weight: torch.Tensor,
    eps: float,
) -> tuple[QuantizedActivation, torch.Tensor]:
    """RMSNorm both Q and KV rows; quantize Q to MXFP8 for FlashInfer's MXFP8 GEMM.

    Returns ``(q, kv_out [T, Ks])`` as vLLM 0.33 does: ``q.data`` is ``[T, Qs]``
    e4m3fn, ``q.scale`` the flat uint8 buffer of ``mxfp8_scale_bytes(T, Qs)`` ue8m0
    bytes in FlashInfer's F8_128x4 swizzle (padding bytes are 0), ``q.orig_dtype`` /
    ``q.orig_shape`` those of ``qr``, ``q.quant_key`` ``MXFP8_DYNAMIC``.
    """
    new = _accepted["q_kv"].new((qr, kv, q_weight, kv_weight, eps))
    if new is not None:
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
        c.number("eps", eps)
        _accepted["q_kv"].add(new)
    t, qs = qr.shape
    ks = kv.shape[1]
    tp, gp = swizzled_scale_bytes(t, qs)
    q_out = torch.empty(t, qs, dtype=torch.float8_e4m3fn, device=qr.device)
    q_scale = torch.empty(tp * gp, dtype=torch.uint8, device=qr.device)
    kv_out = torch.empty(t, ks, dtype=kv.dtype, device=kv.device)
    if t > 0:
        _ops.fused_q_kv_rmsnorm_quant(qr, kv, q_weight, kv_weight, float(eps), q_out, q_scale, kv_out)
    # quant_key passed explicitly: torch.compile cannot trace a dataclass default it has no source for
    return QuantizedActivation(q_out, q_scale, qr.dtype, qr.shape, MXFP8_DYNAMIC), kv_out
