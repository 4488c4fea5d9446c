"""The NVFP4 encoder's division-free e2m1 codes equal the codes of the rounded quotient.

``cache_kernels._e2m1_code_of_quotient(x, S)`` compares |x| with t·S for each e2m1 threshold t;
``_e2m1_code(div_rn(x, S))`` rounds x / S first.  Both run here in one Triton kernel over
every e4m3 scale the encoder can produce (2^-9 .. 448) and the fp32 values at and next to
every threshold·S (the only places they could differ), plus random values.  Needs a GPU or
``TRITON_INTERPRET=1`` (the README's third test step).
"""

from __future__ import annotations

import os

import pytest
import torch

triton = pytest.importorskip("triton")
import triton.language as tl  # noqa: E402

from dsv41.backends.triton import cache_kernels as ck  # noqa: E402

RUNS = os.environ.get("TRITON_INTERPRET") == "1" or torch.cuda.is_available()
pytestmark = pytest.mark.skipif(not RUNS, reason="needs a GPU or TRITON_INTERPRET=1")


@triton.jit
def _both_codes(x_ptr, s_ptr, quotient_ptr, compare_ptr, N, BLOCK: tl.constexpr):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = i < N
    x = tl.load(x_ptr + i, mask=m, other=0.0)
    s = tl.load(s_ptr + i, mask=m, other=1.0)
    tl.store(quotient_ptr + i, ck._e2m1_code(tl.math.div_rn(x, s)), mask=m)
    tl.store(compare_ptr + i, ck._e2m1_code_of_quotient(x, s), mask=m)


def _inputs():
    scales = torch.arange(1, 0x7F, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
    scales = scales[(scales >= 2.0**-9) & (scales <= 448.0)]
    xs, ss = [], []
    for t in (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0):
        c = t * scales
        up, down = c.clone(), c.clone()
        xs.append(c)
        for _ in range(3):
            up = torch.nextafter(up, torch.full_like(up, float("inf")))
            down = torch.nextafter(down, torch.zeros_like(down))
            xs += [up.clone(), down.clone()]
        ss += [scales] * 7
    x, s = torch.cat(xs), torch.cat(ss)
    g = torch.Generator().manual_seed(0)
    rx = torch.randn(20000, generator=g) * torch.exp2(torch.randint(-12, 12, (20000,), generator=g).float())
    rs = scales[torch.randint(0, scales.numel(), (20000,), generator=g)]
    x = torch.cat([x, -x, rx, torch.tensor([0.0, -0.0, float("inf"), -float("inf")])])
    s = torch.cat([s, s, rs, scales[:4]])
    return x, s


def test_division_free_codes_match_the_quotient():
    dev = "cpu" if os.environ.get("TRITON_INTERPRET") == "1" else "cuda"
    x, s = (t.to(dev) for t in _inputs())
    q = torch.empty(x.numel(), dtype=torch.int32, device=dev)
    c = torch.empty_like(q)
    block = 4096
    _both_codes[(triton.cdiv(x.numel(), block),)](x, s, q, c, x.numel(), BLOCK=block)
    diff = (q != c).nonzero().flatten()
    assert diff.numel() == 0, f"{diff.numel()} codes differ, e.g. x={x[diff[:4]].tolist()} S={s[diff[:4]].tolist()}"
