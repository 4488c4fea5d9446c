"""Exhaustive checks, on the GPU, of float helpers that replace IEEE library calls or
fp32 compares by cheaper exact sequences: the two of the CR-2 pooling
(``fused_save_compress_norm``) and the 288 record's bf16x2 e2m1 compares of fp32 values.

* ``_pool_weights`` (PTX): 1 / (1 + s) and s / (1 + s) by one shared reciprocal and the fma
  steps of div.rn's fast path -- bit for bit ``div_rn`` for every fp32 s in [0, 1].
* ``_exp2_rn``: fl32(2^y) through a float64 polynomial -- for every fp32 y in [-151, 0]
  equal to the reference's ``fl32(exp2(float64 y))`` (``dsv41.reference.compress._exp``).
  The GPU's float64 exp2 stands in for the host's except where its value lies within 2^-40
  of an fp32 rounding midpoint (there two accurate float64 exp2 may round differently);
  those few thousand inputs are compared with the reference on the host.
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
def _weights_probe(bad_ptr, first_ptr, lo, n, BLOCK: tl.constexpr):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = i < n
    s = (lo + i).to(tl.float32, bitcast=True)
    a1, a2 = CK._pool_weights(s, True)
    b1, b2 = CK._pool_weights(s, False)
    diff = m & ((a1.to(tl.int32, bitcast=True) != b1.to(tl.int32, bitcast=True))
                | (a2.to(tl.int32, bitcast=True) != b2.to(tl.int32, bitcast=True)))
    nbad = tl.sum(diff.to(tl.int32), axis=0)
    if nbad > 0:
        tl.atomic_add(bad_ptr, nbad)
        tl.atomic_min(first_ptr, tl.min(tl.where(diff, lo + i, 0x7FFFFFFF), axis=0))


def test_pool_weights_exhaustive():
    """The PTX division sequence equals div_rn for every fp32 s in [0, 1] (bits 0 .. 1.0)."""
    lo, hi = 0, 0x3F800000
    n = hi - lo + 1
    bad = torch.zeros(1, dtype=torch.int32, device="cuda")
    first = torch.full((1,), 0x7FFFFFFF, dtype=torch.int32, device="cuda")
    _weights_probe[(triton.cdiv(n, BLOCK),)](bad, first, lo, n, BLOCK=BLOCK)
    assert int(bad) == 0, f"{int(bad)} inputs differ, first s bits {int(first):#x}"


@triton.jit
def _exp2_probe(y_ptr, out_ptr, n, BLOCK: tl.constexpr):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = i < n
    tl.store(out_ptr + i, CK._exp2_rn(tl.load(y_ptr + i, mask=m, other=0.0)), mask=m)


def _near_midpoint(ref64: torch.Tensor) -> torch.Tensor:
    """Where a float64 value lies within 2^-40 (relative) of a midpoint between two fp32."""
    r32 = ref64.float()
    up = torch.nextafter(r32, torch.full_like(r32, float("inf"))).double()
    down = torch.nextafter(r32, torch.full_like(r32, -float("inf"))).double()
    r = r32.double()
    dist = torch.minimum((ref64 - (r + up) / 2).abs(), (ref64 - (r + down) / 2).abs())
    return dist <= ref64.abs() * 2.0 ** -40


def test_exp2_rn_exhaustive():
    """``_exp2_rn`` equals the reference's fl32(exp2 in float64) for every fp32 y in [-151, 0]."""
    lo, hi = 0x80000000, 0xC3170000  # -0.0 .. -151.0
    chunk = 1 << 26
    near_y, near_got, mismatches, checked = [], [], 0, 0
    for s in range(lo, hi + 1, chunk):
        e = min(s + chunk, hi + 1)
        bits = torch.arange(s, e, dtype=torch.int64, device="cuda")
        y = (bits - (1 << 32)).to(torch.int32).view(torch.float32)  # two's complement view
        got = torch.empty_like(y)
        _exp2_probe[(triton.cdiv(y.numel(), BLOCK),)](y, got, y.numel(), BLOCK=BLOCK)
        ref64 = torch.exp2(y.double())
        near = _near_midpoint(ref64)
        far = ~near
        mismatches += int((got[far].view(torch.int32) != ref64[far].float().view(torch.int32)).sum())
        near_y.append(y[near].cpu())
        near_got.append(got[near].cpu())
        checked += y.numel()
    assert checked == hi - lo + 1
    assert mismatches == 0, f"{mismatches} inputs away from a midpoint differ"
    ny, ng = torch.cat(near_y), torch.cat(near_got)
    ref = torch.exp2(ny.double()).float()  # on the host, as dsv41.reference.compress._exp
    diff = ng.view(torch.int32) != ref.view(torch.int32)
    assert not diff.any(), (f"{int(diff.sum())} of {ny.numel()} near-midpoint inputs differ",
                            ny[diff][:8].view(torch.int32).tolist())


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
