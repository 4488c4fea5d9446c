"""The Triton kernels' Σx² in vLLM's order equals ``gpu_approx.tl_sum_sq``, bit for bit.

``reductions._row_sum_sq`` sums a tile the kernel already holds and leaves out the threads and
registers of vLLM's layout that would hold only zeros; ``gpu_approx.tl_sum_sq`` (what the
reference uses, measured on an H200) walks the whole block.  Both run here on rows of varied
magnitudes (sums that round differently in any other order) for every layout shape the tile
path distinguishes: a lane of 1, 2, 4, 8 or 16 registers, repetitions across the block (a
permuted tile), fewer threads than a warp, fewer warps than the layout, tiles wider than the
block, and rows narrower than their tile.  Needs a GPU or ``TRITON_INTERPRET=1`` (the README's
fourth test step).
"""

from __future__ import annotations

import os

import pytest
import torch

triton = pytest.importorskip("triton")
import triton.language as tl  # noqa: E402

from dsv41.backends.triton import reductions  # noqa: E402
from dsv41.core.gpu_approx import tl_sum_sq  # noqa: E402
from dsv41.reference.output_quant import vllm_norm_layout  # noqa: E402

RUNS = os.environ.get("TRITON_INTERPRET") == "1" or torch.cuda.is_available()
pytestmark = pytest.mark.skipif(not RUNS, reason="needs a GPU or TRITON_INTERPRET=1")


@triton.jit
def _sums(x_ptr, out_ptr, n_rows, size, BT: tl.constexpr, W: tl.constexpr, VB: tl.constexpr,
          VW: tl.constexpr, VP: tl.constexpr):
    r = tl.program_id(0) * BT + tl.arange(0, BT)
    col = tl.arange(0, W)
    m = (r < n_rows)[:, None] & (col < size)[None, :]
    x = tl.load(x_ptr + r[:, None] * size + col[None, :], mask=m, other=0.0)
    tl.store(out_ptr + r, reductions._row_sum_sq(x, BT, W, VB, VW, VP), mask=r < n_rows)


def _rows(n_rows: int, size: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n_rows, size, generator=g)
    # rows of magnitudes spread over a few binades (every partial sum's rounding shows in the
    # total, so any other order differs in some rows) and over many (a few terms dominate)
    spread = torch.where(torch.arange(n_rows) % 4 == 3, 20, 3)[:, None]
    x = x * torch.exp2((torch.rand(n_rows, size, generator=g) * 2 - 1).mul(spread).round())
    x[0] = 0.0
    x[1, size // 2:] = 0.0
    return x


# (row width, tile width W, (VB, VW, VP)): layouts of vllm_norm_layout and the edge shapes
CASES = [
    (1536, 2048, vllm_norm_layout(1536, 512, 2)),  # the Q rows (bf16): 8 per lane, one pass
    (512, 512, vllm_norm_layout(1536, 512, 2)),    # the KV rows: 64 of the 256 threads
    (1536, 2048, vllm_norm_layout(1536, 512, 4)),  # fp32 rows: 4 per load, two passes
    (512, 512, vllm_norm_layout(1536, 512, 4)),    # fp32 KV rows: 128 threads, one pass
    (4096, 4096, vllm_norm_layout(4096, 512, 2)),  # 16 per lane (two passes of 8)
    (96, 128, vllm_norm_layout(96, 32, 2)),        # a block narrower than its warps
    (64, 128, vllm_norm_layout(64, 32, 2)),        # the tile wider than the block
    (40, 64, (64, 2, 1)),                          # 1 per lane, two warps
    (24, 32, (64, 1, 2)),                          # 2 per lane, 16 threads
    (1024, 1024, (4096, 8, 8)),                    # the block wider than the tile
]


@pytest.mark.parametrize("size,W,layout", CASES, ids=[f"{c[0]}-W{c[1]}-{c[2]}" for c in CASES])
@pytest.mark.parametrize("bt", [1, 2])
def test_tile_sums_are_the_blocks_sums(size, W, layout, bt):
    dev = "cpu" if os.environ.get("TRITON_INTERPRET") == "1" else "cuda"
    vb, vw, vp = layout
    x = _rows(64, size, seed=size + W + vb)
    want = tl_sum_sq(x, warps=vw, per_thread=vp, block=max(vb, W))
    got = torch.empty(x.shape[0])
    xd, gd = x.to(dev), got.to(dev)
    _sums[(triton.cdiv(x.shape[0], bt),)](xd, gd, x.shape[0], size, BT=bt, W=W, VB=vb, VW=vw, VP=vp)
    assert torch.equal(gd.cpu().view(torch.int32), want.view(torch.int32))
