"""The NVIDIA GPU's approximate fp32 primitives, bit for bit, as tables (any device).

vLLM's Triton kernels compute a norm's ``rsqrt`` with ``rsqrt.approx.ftz.f32``, a softmax's
``tl.exp`` with ``ex2.approx.f32`` and an fp32 ``/`` with ``div.full.f32``.  None of them is
correctly rounded (1-2 ulp off for 5-40 % of inputs) and PTX does not specify their bits, so
writing vLLM's bytes means computing what the hardware computes.  These functions do, from
tables measured on an H200 (SM90) by ``tools/approx_dump.py`` over each primitive's whole
reduced domain; the tables hold the hardware result's bits minus the correctly rounded result's
bits (int8, -2..1), xz-compressed in ``approx_tables/``.

What the measurement established, and these functions rely on (docs/kernel_contract.md,
"Approximate primitives"):

* ``rsqrt.approx.ftz``: the result depends on the mantissa and the exponent's parity only
  (``rsqrt(x·4^k) = rsqrt(x)·2^-k`` for every normal result, checked for k in [-63, 63]);
  subnormal inputs are zero (→ ±inf), +inf → +0, negatives and NaN → the canonical NaN.
* ``div.full.f32(a, b)`` is ``fl32(a · rcp(b))`` (67 M random pairs, no exception), where
  ``rcp`` (= ``rcp.approx.ftz``) depends on the mantissa only; a subnormal divisor scales both
  operands by 2^24 first, one of magnitude >= 2^126 by 1/4.
* ``ex2.approx.ftz``: the argument becomes sign-magnitude fixed point with 23 fraction bits,
  truncated; ``2^-(m + f)`` (m integer, f the fraction) is ``T_sign[f]·2^∓m``, one table per
  sign.  ``ex2.approx.f32`` (no ftz, what ``tl.exp`` emits) agrees wherever the result is
  normal and squares the half-argument's result below -126.

Each table is read, expanded to result bits and cached per device on first use (~0.3 s;
int32: 64 + 32 + 32 + 32 MB).
"""

from __future__ import annotations

import lzma
import math
import threading
import zlib
from pathlib import Path

import torch

from .codecs import fma32

__all__ = ["rsqrt_approx", "rcp_approx", "div_full", "ex2_approx_ftz", "exp_approx", "LOG2E_F32", "result_bits",
           "TABLES", "tl_sum_sq"]

F32, F64, I32, I64 = torch.float32, torch.float64, torch.int32, torch.int64
_DIR = Path(__file__).with_name("approx_tables")
_M = 1 << 23  # mantissas of one binade
_ONE = 0x3F800000  # bits of 1.0
_INF, _NAN = 0x7F800000, 0x7FFFFFFF  # +inf; the GPU's canonical NaN
# fl32(log2 e), the constant tl.exp multiplies by (0x3FB8AA3B)
LOG2E_F32 = float(torch.tensor(math.log2(math.e), dtype=F32))

# table name -> its reduced domain, as the kernels index it
TABLES = {
    "rsqrt": "x in [1, 4): index = (exponent parity) << 23 | mantissa",
    "rcp": "x in [1, 2): index = mantissa",
    "ex2": "x = j / 2^23 in [0, 1): index = j",
    "ex2neg": "x = -j / 2^23 in (-1, 0]: index = j",
}

# CRC-32 of each expanded table (int32 result bits, little-endian): the expansion adds the stored
# differences to correctly rounded results computed here in float64, so a host whose float64
# exp2 rounded differently would rebuild other bits; the check turns that into an error.
TABLE_CRC = {"rsqrt": 0x9D0587E4, "rcp": 0xA9F2ECFC, "ex2": 0x3FE67D9B, "ex2neg": 0x8AF5EA7C}

_lock = threading.Lock()
_tables: dict = {}  # (name, device) -> int32 result bits over the reduced domain


def _exact(name: str, x64: torch.Tensor) -> torch.Tensor:
    if name == "rsqrt":
        return torch.rsqrt(x64)
    if name == "rcp":
        return 1.0 / x64
    return torch.exp2(x64)  # ex2 (x >= 0) and ex2neg (x <= 0)


def _domain(name: str) -> torch.Tensor:
    """The reduced domain's inputs (float64, exact): [1, 4) for rsqrt, [1, 2) for rcp, the
    2^-23 grid of [0, 1) / (-1, 0] for ex2."""
    if name == "rsqrt":
        return torch.arange(_ONE, _ONE + 2 * _M, dtype=I64).to(I32).view(F32).to(F64)
    if name == "rcp":
        return torch.arange(_ONE, _ONE + _M, dtype=I64).to(I32).view(F32).to(F64)
    grid = torch.arange(_M, dtype=F64) / _M
    return -grid if name == "ex2neg" else grid


def _table(name: str, device: torch.device) -> torch.Tensor:
    key = (name, device)
    t = _tables.get(key)
    if t is None:
        with _lock:
            t = _tables.get(key)
            if t is None:
                cpu = _tables.get((name, torch.device("cpu")))
                if cpu is None:
                    raw = lzma.decompress((_DIR / f"{name}.i8.xz").read_bytes())
                    delta = torch.frombuffer(bytearray(raw), dtype=torch.int8).to(I64)
                    exact = _exact(name, _domain(name)).to(F32).view(I32).to(I64)
                    cpu = (exact + delta).to(I32).contiguous()
                    crc = zlib.crc32(cpu.numpy().tobytes())
                    if crc != TABLE_CRC[name]:
                        raise RuntimeError(
                            f"dsv41: the {name} table of the GPU's approximate primitives expanded to "
                            f"other bits on this host (CRC-32 {crc:#010x}, expected {TABLE_CRC[name]:#010x}): "
                            "its float64 results differ from the ones the table was made with")
                    _tables[(name, torch.device("cpu"))] = cpu
                if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
                    raise RuntimeError(
                        f"dsv41: the {name} table of the GPU's approximate primitives is not on "
                        f"{device} yet and cannot be copied there during CUDA-graph capture: call "
                        "the op once before capturing (a warm-up run)")
                t = cpu.to(device)
                _tables[key] = t
    return t


def result_bits(name: str, device) -> torch.Tensor:
    """The table ``name`` (``TABLES``) as int32 result bit patterns on ``device``, contiguous:
    what the CPU and Triton kernels index (the tensor is cached; do not write to it)."""
    return _table(name, torch.device(device))


def _bits(x: torch.Tensor) -> torch.Tensor:
    if x.dtype != F32:
        raise TypeError(f"gpu_approx: expected a float32 tensor, got {x.dtype}")
    return x.contiguous().view(I32).to(I64) & 0xFFFFFFFF


def _float(b: torch.Tensor) -> torch.Tensor:
    """uint32 bit patterns held in int64 -> float32."""
    return torch.where(b >= 1 << 31, b - (1 << 32), b).to(I32).view(F32)


def rsqrt_approx(x: torch.Tensor) -> torch.Tensor:
    """``rsqrt.approx.ftz.f32`` (``tl.rsqrt`` on NVIDIA) of an fp32 tensor."""
    b = _bits(x)
    neg = b >= 1 << 31
    e_field = (b >> 23) & 0xFF
    e = e_field - 127
    idx = ((e & 1) << 23) | (b & (_M - 1))
    t = _table("rsqrt", x.device)
    out = t[torch.where((e_field > 0) & (e_field < 255), idx, 0)].to(I64) - ((e >> 1) << 23)
    zero = e_field == 0  # zero or subnormal (flushed): +-inf
    out = torch.where(zero, torch.where(neg, _INF | (1 << 31), _INF), out)
    out = torch.where(~zero & neg, _NAN, out)  # negative (including -inf) or NaN below
    out = torch.where((e_field == 255) & ~neg, torch.where((b & (_M - 1)) == 0, 0, _NAN), out)
    return _float(out).view(x.shape)


def rcp_approx(x: torch.Tensor) -> torch.Tensor:
    """``rcp.approx.ftz.f32`` of an fp32 tensor: ``div.full.f32(1, x)``."""
    b = _bits(x)
    sign = b & (1 << 31)
    e_field = (b >> 23) & 0xFF
    mag = _table("rcp", x.device)[b & (_M - 1)].to(I64) - ((e_field - 127) << 23)
    mag = torch.where(mag < (1 << 23), 0, mag)  # a subnormal result is flushed to zero
    mag = torch.where(e_field == 0, _INF, mag)  # 1 / +-0 (subnormals are zero)
    mag = torch.where(e_field == 255, torch.where((b & (_M - 1)) == 0, 0, _NAN), mag)
    out = torch.where(mag == _NAN, _NAN, mag | sign)
    return _float(out).view(x.shape)


def div_full(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``div.full.f32`` (an fp32 ``a / b`` in Triton on NVIDIA): ``fl32(a · rcp(b))``, both
    operands first scaled by 2^24 where ``|b|`` is subnormal and by 1/4 where ``|b| >= 2^126``
    (measured on an H200: every subnormal and every such divisor, random dividends)."""
    mag = b.abs()
    scale = torch.where(mag >= 2.0**126, 0.25, torch.where(mag < 2.0**-126, 2.0**24, 1.0)).to(F32)
    return (a * scale) * rcp_approx(b * scale)


def ex2_approx_ftz(x: torch.Tensor) -> torch.Tensor:
    """``ex2.approx.ftz.f32`` (``tl.exp2`` on NVIDIA) of an fp32 tensor."""
    b = _bits(x)
    neg = b >= 1 << 31
    mag = torch.where(neg, b - (1 << 31), b).to(I32).view(F32).to(F64)
    # |x| as fixed point with 23 fraction bits, truncated (exact in float64: |x| < 2^30 here)
    q = torch.trunc(torch.clamp(mag, max=2.0**30) * _M).to(I64)
    m, f = q >> 23, q & (_M - 1)
    pos_t, neg_t = _table("ex2", x.device), _table("ex2neg", x.device)
    out = torch.where(neg, neg_t[f].to(I64) - (m << 23), pos_t[f].to(I64) + (m << 23))
    out = torch.where(out < (1 << 23), 0, out)  # subnormal results are flushed
    out = torch.where(out >= _INF, _INF, out)
    out = torch.where(torch.isnan(x.reshape(b.shape)), _NAN, out)
    return _float(out).view(x.shape)


def exp_approx(z: torch.Tensor) -> torch.Tensor:
    """``tl.exp`` on NVIDIA: ``ex2.approx.f32(fl32(z · fl32(log2 e)))``, the ex2 without ftz: a
    result below 2^-126 is ``fl32(h·h)`` with ``h = ex2.approx.ftz(arg / 2)``."""
    arg = z * LOG2E_F32
    low = arg < -126.0
    h = ex2_approx_ftz(arg * 0.5)
    return torch.where(low, h * h, ex2_approx_ftz(arg))


def tl_sum_sq(x: torch.Tensor, warps: int, per_thread: int, block: int | None = None) -> torch.Tensor:
    """``tl.sum(v * v, 0)`` of fp32 rows ``x[..., n]`` as Triton's reduction computes it on an
    NVIDIA GPU, for a row held in a blocked layout of ``per_thread`` contiguous elements per
    thread and ``warps`` warps over ``block`` (>= n, power of two; the rest reads as 0):

    * thread ``t`` holds elements ``c·T·p + t·p + i`` (``T`` = 32·warps threads, ``p`` =
      per_thread, ``c`` the repetition when the block is wider than one pass) and accumulates
      them in that order with every square but one fused into an addition (LLVM contracts
      the multiply-adds): ``fma(e0, e0, fl(e1²))``, then ``fma(ek, ek, acc)`` -- measured on an
      H200 (``tools/approx_dump.py`` rowsum: 0 of 16 384 fp32 rows differ; the order with the
      second square fused instead differs in 10 %);
    * each warp folds its 32 lanes with the xor butterfly (16, 8, 4, 2, 1);
    * the warp sums fold the same way (xor warps/2 .. 1).
    """
    block = block or x.shape[-1]
    threads = 32 * warps
    if block % (threads * per_thread) or x.shape[-1] > block:
        raise ValueError(f"tl_sum_sq: block {block} is not a multiple of {threads} x {per_thread} "
                         f"threads x elements, or narrower than the row ({x.shape[-1]})")
    if x.shape[-1] < block:
        x = torch.nn.functional.pad(x, (0, block - x.shape[-1]))
    reps = block // (threads * per_thread)
    # [..., reps, threads, per_thread] -> [..., threads, reps * per_thread] in register order
    v = x.unflatten(-1, (reps, threads, per_thread)).movedim(-3, -2).flatten(-2)
    if v.shape[-1] == 1:
        acc = v[..., 0] * v[..., 0]
    else:
        acc = fma32(v[..., 0], v[..., 0], v[..., 1] * v[..., 1])
    for k in range(2, v.shape[-1]):
        acc = fma32(v[..., k], v[..., k], acc)
    acc = acc.unflatten(-1, (warps, 32))
    lane = torch.arange(32, device=x.device)
    for dist in (16, 8, 4, 2, 1):
        acc = acc + acc[..., lane ^ dist]
    w = acc[..., 0]
    idx = torch.arange(warps, device=x.device)
    dist = warps // 2
    while dist:
        w = w + w[..., idx ^ dist]
        dist //= 2
    return w[..., 0]
