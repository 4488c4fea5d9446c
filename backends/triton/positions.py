"""The cos/sin table row a position reads, shared by every Triton kernel that reads the table.

A position outside the table reads the table's nearest row, never past it
(docs/bad_input.md): positions are int64 and may lie past int32, so the clamp must see the
whole value.
"""

import triton
import triton.language as tl


@triton.jit
def table_row(pos, rows):
    """int64 positions ``pos`` clamped into ``[0, rows)`` (``rows >= 1``), as int64.

    One 64-bit max and min.  A form on the position's two 32-bit halves (high word 0: the
    unsigned min of the low word and ``rows - 1``; else row 0 or the last row) has fewer sm_90
    instructions but timed slower under CUDA-graph replay on an H100: the MXFP4 indexer Q
    +0.08 us at 1 and 64 tokens, the FP8 one +0.01-0.02 us, against this form, on two quiet
    H100s where 9e78256 timed alike (docs/measurements/h100-regression-32-vs-9e78256.txt;
    this form: section 4 of h100-regression-31-vs-9e78256.txt)."""
    return tl.minimum(tl.maximum(pos, 0), rows - 1)
