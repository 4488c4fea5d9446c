"""Bit-exact number codecs and fp32 primitives, in plain (vectorized) PyTorch.

Every function works on any device and reproduces what the upstream Triton
kernels compute on an H200 (spec cache_ops.md §0.3, rope_quant_ops.md §1, §8):

* ``fma32``     — fp32 fused multiply-add with a single rounding,
* ``clamp_sym`` — ``sign(x) * min(|x|, m)``, NaN -> ±m by its sign bit (PTX min.xorsign.abs),
* ``e4m3_encode`` / ``e4m3_decode`` for the OCP (e4m3fn) and FNUZ (e4m3fnuz) flavours,
* ``e2m1_encode`` / ``e2m1_decode`` and nibble packing (even dim in the low nibble),
* ``ue8m0`` scale codes, ``ceil_log2`` with the fp32-rounded log2 the kernels use.
"""

from __future__ import annotations

import torch

__all__ = [
    "rn32",
    "rnbf16",
    "fma32",
    "clamp_sym",
    "e4m3_encode",
    "e4m3_decode",
    "e2m1_encode",
    "e2m1_decode",
    "pack_nibbles",
    "unpack_nibbles",
    "ceil_log2",
    "bit_ceil_log2",
    "exp2i",
    "ue8m0_decode",
    "F32_1E_4",
    "inv_const",
]

F32 = torch.float32
F64 = torch.float64

# fl32(1e-4): the amax floor of every ue8m0 quantizer (0x38D1B717).
F32_1E_4 = float(torch.tensor(1e-4, dtype=F32))


def inv_const(m: float) -> float:
    """``fl32(1/m)``, the constant the kernels multiply by instead of dividing."""
    return float(torch.tensor(1.0 / m, dtype=F32))


def rn32(x: torch.Tensor) -> torch.Tensor:
    return x.to(F32)


def rnbf16(x: torch.Tensor) -> torch.Tensor:
    """fp32 -> bf16 (round to nearest even) -> fp32."""
    return x.to(torch.bfloat16).to(F32)


def fma32(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
    """``fl32(a*b + c)`` with one rounding, for fp32 inputs.

    a*b is exact in float64 (24+24 bits).  The sum is formed in float64 and
    rounded *to odd* (TwoSum gives the exact error), which makes the final
    float64 -> fp32 rounding correct (53 >= 24 + 2).
    """
    p = a.to(F64) * b.to(F64)
    c64 = c.to(F64)
    s = p + c64
    bv = s - p
    err = (p - (s - bv)) + (c64 - bv)
    inexact = (err != 0) & torch.isfinite(s)
    even = (s.view(torch.int64) & 1) == 0
    toward = torch.where(err > 0, torch.full_like(s, float("inf")), torch.full_like(s, float("-inf")))
    s = torch.where(inexact & even, torch.nextafter(s, toward), s)
    return s.to(F32)


def clamp_sym(x: torch.Tensor, m: float) -> torch.Tensor:
    """``sign(x) * min(|x|, m)``; NaN becomes ±m with the NaN's sign bit."""
    mag = torch.where(torch.isnan(x), torch.full_like(x, m), x.abs().clamp(max=m))
    return torch.where(torch.signbit(x), -mag, mag)


def e4m3_encode(x: torch.Tensor, fnuz: bool = False) -> torch.Tensor:
    """fp32 -> e4m3 bytes (uint8), round to nearest even.

    OCP: saturating like ``cvt.rn.satfinite`` (|x| > 448 and ±inf -> ±448,
    NaN -> 0x7F).  FNUZ: |x| is saturated to 240, NaN -> 0x80, −0 -> 0x00.
    Callers that clamp first (all quantizers do) never reach saturation.
    """
    x = x.to(F32)
    if fnuz:
        y = torch.where(torch.isnan(x), x, x.clamp(-240.0, 240.0))
        return y.to(torch.float8_e4m3fnuz).view(torch.uint8)
    nan = torch.isnan(x)
    y = torch.where(nan, torch.zeros_like(x), x.clamp(-448.0, 448.0))
    b = y.to(torch.float8_e4m3fn).view(torch.uint8)
    return torch.where(nan, torch.full_like(b, 0x7F), b)


def e4m3_decode(b: torch.Tensor, fnuz: bool = False) -> torch.Tensor:
    """e4m3 bytes -> exact fp32 (NaN bytes give NaN)."""
    dt = torch.float8_e4m3fnuz if fnuz else torch.float8_e4m3fn
    return b.contiguous().view(dt).to(F32)


# e2m1 magnitudes of codes 0..7 and the rounding thresholds between them.
# Ties go to the even code: 0.25->0, 0.75->1.0, 1.25->1.0, 1.75->2, 2.5->2, 3.5->4, 5->4.
_E2M1_MAG = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)


def e2m1_encode(x: torch.Tensor) -> torch.Tensor:
    """fp32 -> 4-bit e2m1 codes (uint8 0..15): RNE on codes, |x| > 6 -> 6, sign bit kept (−0 -> 0x8)."""
    a = x.to(F32).abs()
    code = torch.zeros_like(a, dtype=torch.uint8)
    # (threshold, inclusive?) for moving to the next code: "<=" where the lower
    # code is even (a tie stays down), "<" where it is odd (a tie goes up).
    code = code + (a > 0.25).to(torch.uint8)
    code = code + (a >= 0.75).to(torch.uint8)
    code = code + (a > 1.25).to(torch.uint8)
    code = code + (a >= 1.75).to(torch.uint8)
    code = code + (a > 2.5).to(torch.uint8)
    code = code + (a >= 3.5).to(torch.uint8)
    code = code + (a > 5.0).to(torch.uint8)
    sign = torch.signbit(x).to(torch.uint8) << 3
    return code | sign


def e2m1_decode(code: torch.Tensor, signed_zero: bool = True) -> torch.Tensor:
    """4-bit codes -> fp32.  ``signed_zero=False`` decodes 0x8 as +0 (the NVFP4 gather, finding 1)."""
    mag = torch.tensor(_E2M1_MAG, dtype=F32, device=code.device)[(code & 7).long()]
    neg = (code & 8) != 0
    if signed_zero:
        return torch.where(neg, -mag, mag)
    return torch.where(neg, 0.0 - mag, mag)


def pack_nibbles(codes: torch.Tensor) -> torch.Tensor:
    """[..., 2n] codes -> [..., n] bytes, element 2k in the low nibble."""
    c = codes.to(torch.uint8)
    return c[..., 0::2] | (c[..., 1::2] << 4)


def unpack_nibbles(b: torch.Tensor) -> torch.Tensor:
    """[..., n] bytes -> [..., 2n] codes."""
    lo = b & 0xF
    hi = b >> 4
    return torch.stack((lo, hi), dim=-1).flatten(-2)


def ceil_log2(r: torch.Tensor) -> torch.Tensor:
    """``ceil(fl32(log2(r)))`` as float32 (log2 evaluated in float64, rounded to fp32).

    This is the "(L) log-ceil" of the Triton kernels: it lands one binade low
    when r is a few ulps above a power of two with |exponent| >= 4.
    """
    return torch.ceil(torch.log2(r.to(F64)).to(F32))


def bit_ceil_log2(s: torch.Tensor) -> torch.Tensor:
    """Exact ``ceil(log2(s))`` of normal fp32 s from its bits ("(B) bit-ceil")."""
    bits = s.to(F32).view(torch.int32)
    e = ((bits >> 23) & 0xFF) - 127
    bump = (bits & 0x7FFFFF) != 0
    return (e + bump.to(torch.int32)).to(F32)


def exp2i(e: torch.Tensor) -> torch.Tensor:
    """2^e for integer-valued fp32 e, like ``ex2.approx.ftz``: e <= -127 -> 0, e >= 128 -> inf."""
    e = e.to(F32)
    out = torch.exp2(e.clamp(-126.0, 127.0).to(F64)).to(F32)
    out = torch.where(e <= -127, torch.zeros_like(out), out)
    out = torch.where(e >= 128, torch.full_like(out, float("inf")), out)
    return torch.where(torch.isnan(e), e, out)


def ue8m0_decode(code: torch.Tensor) -> torch.Tensor:
    """Scale byte -> fp32 ``2^(code-127)`` with flush: code 0 -> 0, code 255 -> inf."""
    return exp2i(code.to(F32) - 127.0)
