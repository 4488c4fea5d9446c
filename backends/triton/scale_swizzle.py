"""FlashInfer's F8_128x4 scale swizzle as a Triton device function, for callers' own kernels.

The byte of (row, group) for a matrix with ``GROUPS`` scale groups per row sits in 512-byte
tiles of 128 rows x 4 groups: tile (row // 128, group // 4), and inside a tile at
``(row % 32) * 16 + ((row % 128) // 32) * 4 + group % 4`` (rope_quant_ops.md §5).
"""

import triton
import triton.language as tl


@triton.jit
def mxfp8_scale_offset(row, group, GROUPS: tl.constexpr):
    tiles_per_row_block: tl.constexpr = (GROUPS + 3) // 4
    tile = row // 128 * tiles_per_row_block + group // 4
    return tile * 512 + (row % 32) * 16 + (row % 128) // 32 * 4 + group % 4
