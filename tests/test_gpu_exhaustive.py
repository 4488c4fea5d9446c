"""Exhaustive checks, on the GPU, of the two float helpers of the CR-2 pooling
(``fused_save_compress_norm``) that replace IEEE library calls by cheaper exact sequences.

* ``_pool_weights`` (PTX): 1 / (1 + s) and s / (1 + s) by one shared reciprocal and the fma
  steps of div.rn's fast path -- bit for bit ``div_rn`` for every fp32 s in [0, 1].
* ``_exp2_rn``: fl32(2^y) through a float64 polynomial -- for every fp32 y in [-151, 0]
  equal to the reference's ``fl32(exp2(float64 y))`` (``dsv41.reference.compress._exp``).
  The GPU's float64 exp2 stands in for the host's except where its value lies within 2^-40
  of an fp32 rounding midpoint (there two accurate float64 exp2 may round differently);
  those few thousand inputs are compared with the reference on the host.

Each takes a few seconds on an H200 (about 10^9 inputs).
"""

from __future__ import annotations

import pytest
import torch
import triton
import triton.language as tl

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
