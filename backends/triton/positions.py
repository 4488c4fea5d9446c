"""The cos/sin table row a position reads, shared by every Triton kernel that reads the table.

A position outside the table reads the table's nearest row, never past it
(docs/bad_input.md): positions are int64 and may lie past int32, so the clamp must see the
whole value; the row it returns fits in int32.
"""

import triton
import triton.language as tl


@triton.jit
def table_row(pos, rows):
    """int64 positions ``pos`` clamped into ``[0, rows)`` (``rows >= 1``), as int32.

    Computed on the two 32-bit halves: where a program holds one token the position is
    uniform, and 64-bit compares on it go through the uniform datapath (two register moves and
    seven uniform operations ahead of the cos/sin load: 0.07-0.08 us of a decode-size indexer-Q
    launch on an H100, docs/performance.md "Against the last table").  High word 0: the row is
    min(low word, rows - 1) unsigned; otherwise the position is negative (row 0) or at least
    2^32 (the last row)."""
    lo = pos.to(tl.int32).to(tl.uint32, bitcast=True)
    hi = (pos >> 32).to(tl.int32)
    last = tl.cast(rows - 1, tl.uint32)
    row = tl.where(hi == 0, tl.minimum(lo, last), tl.where(hi < 0, 0, last))
    return row.to(tl.int32, bitcast=True)
