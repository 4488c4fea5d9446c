"""Exhaustive checks, on the GPU, of float helpers: the 288 record's bf16x2 e2m1 compares of
fp32 values, and the tables of the GPU's approximate primitives against the instructions.

* ``_bf16x2_bounds`` + ``_e2m1x2_of_quotient_words`` (PTX): the e2m1 code of fp32 x / S
  from |x| rounded to bf16 toward zero (``>=`` thresholds) and up (``>``) -- equal to
  ``_e2m1_code_of_quotient`` for every e4m3 scale S the encoder makes and every fp32 x
  within 2^17 ulps of each threshold t·S (where rounding to bf16 could cross it: a bf16
  step is 2^16 fp32 ulps), both signs, plus zeros, Inf, the largest finite value and
  the canonical NaN.

Each takes a few seconds on an H200 (about 10^9 inputs).
"""

from __future__ import annotations

import pytest
import torch

triton = pytest.importorskip("triton")
import triton.language as tl  # noqa: E402

from dsv41.backends.triton import cache_kernels as CK

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

BLOCK = 2048


@triton.jit
def _e2m1_words_probe(s_ptr, bad_ptr, first_ptr, K: tl.constexpr, BLOCK: tl.constexpr):
    # program (scale j, threshold k, block b): x = t_k * S_j moved by -K .. K-1 fp32 ulps,
    # e = x, o = -(x one ulp further) (both halves, both signs)
    j = tl.program_id(0)
    k = tl.program_id(1)
    S = tl.load(s_ptr + j)
    t = tl.where(k == 0, 0.25, tl.where(k == 1, 0.75, tl.where(k == 2, 1.25, tl.where(
        k == 3, 1.75, tl.where(k == 4, 2.5, tl.where(k == 5, 3.5, 5.0))))))
    d = tl.program_id(2) * BLOCK + tl.arange(0, BLOCK) - K
    xb = (t * S).to(tl.int32, bitcast=True) + d
    e = xb.to(tl.float32, bitcast=True)
    o = _neg_f32(xb + 1)
    _check_words(e, o, S, bad_ptr, first_ptr, xb)


@triton.jit
def _neg_f32(bits):
    return (bits ^ -2147483648).to(tl.float32, bitcast=True)


@triton.jit
def _check_words(e, o, S, bad_ptr, first_ptr, tag):
    SS = tl.broadcast_to(S, e.shape)
    th = CK._e2m1_thresholds_bf16x2(SS)
    z, u, r = CK._bf16x2_bounds(e.to(tl.int32, bitcast=True), o.to(tl.int32, bitcast=True))
    w = CK._e2m1x2_of_quotient_words(z, u, r, *th)
    ce = (w >> 12) & 0xF
    co = (w >> 28) & 0xF
    diff = (ce != CK._e2m1_code_of_quotient(e, SS)) | (co != CK._e2m1_code_of_quotient(o, SS))
    nbad = tl.sum(diff.to(tl.int32), axis=0)
    if nbad > 0:
        tl.atomic_add(bad_ptr, nbad)
        tl.atomic_min(first_ptr, tl.min(tl.where(diff, tag, 0x7FFFFFFF), axis=0))


@triton.jit
def _e2m1_words_list(e_ptr, o_ptr, s_ptr, bad_ptr, first_ptr, n, BLOCK: tl.constexpr):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = i < n
    e = tl.load(e_ptr + i, mask=m, other=0.0)
    o = tl.load(o_ptr + i, mask=m, other=0.0)
    S = tl.load(s_ptr + i, mask=m, other=1.0)
    SS = S
    th = CK._e2m1_thresholds_bf16x2(SS)
    z, u, r = CK._bf16x2_bounds(e.to(tl.int32, bitcast=True), o.to(tl.int32, bitcast=True))
    w = CK._e2m1x2_of_quotient_words(z, u, r, *th)
    diff = m & (((w >> 12) & 0xF) != CK._e2m1_code_of_quotient(e, SS)) | (
        m & (((w >> 28) & 0xF) != CK._e2m1_code_of_quotient(o, SS)))
    nbad = tl.sum(diff.to(tl.int32), axis=0)
    if nbad > 0:
        tl.atomic_add(bad_ptr, nbad)
        tl.atomic_min(first_ptr, tl.min(tl.where(diff, i, 0x7FFFFFFF), axis=0))


def _e4m3_scales() -> torch.Tensor:
    """Every e4m3 value the NVFP4 encoder can use as a scale (2^-9 .. 448)."""
    s = torch.arange(1, 0x7F, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
    return s[(s >= 2.0**-9) & (s <= 448.0)]


def test_e2m1_words_of_fp32_exhaustive():
    """The bf16x2 compares give the fp32 compares' e2m1 codes near every threshold of every
    scale (2^18 inputs around each) and for the special values."""
    scales = _e4m3_scales().cuda()
    K = 1 << 17
    bad = torch.zeros(1, dtype=torch.int32, device="cuda")
    first = torch.full((1,), 0x7FFFFFFF, dtype=torch.int32, device="cuda")
    _e2m1_words_probe[(scales.numel(), 7, 2 * K // BLOCK)](scales, bad, first, K=K, BLOCK=BLOCK)
    assert int(bad) == 0, f"{int(bad)} codes differ, first x bits {int(first):#x}"

    big = torch.finfo(torch.float32).max
    canon_nan = torch.tensor([0x7FFFFFFF], dtype=torch.int32).view(torch.float32)
    special = torch.cat([torch.tensor([0.0, -0.0, float("inf"), -float("inf"), big, -big,
                                       1e-45, -1e-45, 2.0**-126, 1.0, 6.0 * 448, 5.0 * 448]),
                         canon_nan])
    e = special.repeat_interleave(special.numel())
    o = special.repeat(special.numel())
    sc = _e4m3_scales()
    e, o = e.repeat(sc.numel()), o.repeat(sc.numel())
    s = sc.repeat_interleave(special.numel() ** 2)
    e, o, s = e.cuda(), o.cuda(), s.cuda()
    bad.zero_()
    first.fill_(0x7FFFFFFF)
    _e2m1_words_list[(triton.cdiv(e.numel(), BLOCK),)](e, o, s, bad, first, e.numel(), BLOCK=BLOCK)
    assert int(bad) == 0, f"{int(bad)} special pairs differ, first index {int(first)}"


# --------------------------------------------------------------------------------------
# dsv41.core.gpu_approx: the tables against the GPU's own approximate instructions
# --------------------------------------------------------------------------------------


@triton.jit
def _approx_probe(x_ptr, y_ptr, n, OP: tl.constexpr, BLOCK: tl.constexpr):
    i = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    m = i < n
    x = tl.load(x_ptr + i, mask=m, other=1.0)
    if OP == 0:
        y = tl.rsqrt(x)
    elif OP == 1:
        y = 1.0 / x
    elif OP == 2:
        y = tl.exp2(x)
    else:
        y = tl.exp(x)
    tl.store(y_ptr + i, y, mask=m)


def _sm90():
    return torch.cuda.get_device_capability() == (9, 0)


@pytest.mark.parametrize("op", ["rsqrt", "recip", "exp2", "exp"])
def test_gpu_approx_equals_the_instructions(op):
    """Every fp32 bit pattern (2^32, in chunks): ``dsv41.core.gpu_approx`` evaluated with torch on
    the GPU writes the bits of ``tl.rsqrt`` / fp32 ``1 / x`` / ``tl.exp2`` / ``tl.exp`` (NaNs
    compared as NaN).  The tables were measured on SM90; other architectures are not claimed."""
    if not _sm90():
        pytest.skip("the approximation tables are SM90's (H100 / H200)")
    from dsv41.core import gpu_approx as GA

    emulate = {"rsqrt": GA.rsqrt_approx, "recip": lambda x: GA.div_full(torch.ones_like(x), x),
               "exp2": GA.ex2_approx_ftz, "exp": GA.exp_approx}[op]
    code = ["rsqrt", "recip", "exp2", "exp"].index(op)
    chunk = 1 << 27
    bad, first = 0, None
    for lo in range(0, 1 << 32, chunk):
        x = torch.arange(lo, lo + chunk, dtype=torch.int64, device="cuda").to(torch.int32).view(torch.float32)
        hw = torch.empty_like(x)
        _approx_probe[(triton.cdiv(chunk, 4096),)](x, hw, chunk, OP=code, BLOCK=4096)
        em = emulate(x)
        diff = (hw.view(torch.int32) != em.view(torch.int32)) & ~(torch.isnan(hw) & torch.isnan(em))
        nd = int(diff.sum())
        if nd:
            bad += nd
            if first is None:
                j = int(diff.nonzero()[0])
                first = (hex(lo + j), hex(int(hw.view(torch.int32)[j]) & 0xFFFFFFFF),
                         hex(int(em.view(torch.int32)[j]) & 0xFFFFFFFF))
    assert bad == 0, f"{op}: {bad} of 2^32 inputs differ; first (x, GPU, table): {first}"
