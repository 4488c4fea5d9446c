"""A Triton kernel that writes ``mxfp8_scale_offset(row, group, GROUPS)`` for every (row, group)
of a matrix, so the device function can be compared with the reference's swizzle."""

import triton
import triton.language as tl

from dsv41.backends.triton.scale_swizzle import mxfp8_scale_offset


@triton.jit
def offsets_kernel(out, ROWS: tl.constexpr, GROUPS: tl.constexpr, GP: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    g = tl.arange(0, BLOCK)
    tl.store(out + row * GP + g, mxfp8_scale_offset(row, g, GROUPS), mask=g < GP)
