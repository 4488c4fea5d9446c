"""Backends: one folder per implementation family, each with a capability sheet.

Adding a backend (see docs/adding_a_backend.md):
1. make ``backends/<name>/__init__.py`` with a ``Backend`` subclass whose attributes
   say what it needs (device type, vendors, archs, packages) and which ops it has
   (``kernels = {op: "module:function"}``, functions with the signatures of
   docs/kernel_contract.md);
2. list it in ``ALL_BACKENDS`` below and its name in ``DEFAULT_ORDER`` (its place there decides
   whom it outranks; ``MEASURED_ORDER`` moves measured winners ahead per op and arch).
The conformance tests pick it up from the registry with no new test code.

Importing this package imports only the sheets, never a kernel or a GPU runtime.
"""

from __future__ import annotations

from dsv41.reference import ReferenceBackend
from .cpu import CpuBackend
from .cuda import CudaCuteDSLBackend, CudaTritonBackend
from .rocm import RocmBackend
from .xpu import XpuBackend

ALL_BACKENDS = (
    CudaCuteDSLBackend,
    CudaTritonBackend,
    RocmBackend,
    XpuBackend,
    CpuBackend,
    ReferenceBackend,
)

DEFAULT_ORDER = ("cuda:cutedsl", "cuda:triton", "rocm", "xpu", "cpu", "reference")

# (op, arch) -> the backends a measurement on that arch ranked ahead of DEFAULT_ORDER, in their
# measured order; every other backend keeps its default place after them (docs/performance.md
# has the numbers).  A delta, so a backend added to DEFAULT_ORDER is never left out of an op.
MEASURED_ORDER: dict = {
    # H200 (sm_90), `python -m dsv41 bench --device cuda`, cold-L2 timing (docs/performance.md,
    # docs/measurements/h200-bench-9.json.xz): the Triton indexer-Q kernel beats the CuTe one at
    # 65536 tokens (FP8 0.96 vs 0.84 of copy, MXFP4 0.77 vs 0.35) and under CUDA-graph replay
    # at 1-64 tokens; the Triton gather too (65536 rows: 584 1.01 vs 0.77, 528 1.02 vs 0.60,
    # 288 1.01 vs 1.02, a tie; CUDA-graph replay at 1-64 tokens: 584 / 528 1.2-1.45 vs
    # 1.8-2.6 us, 288 1.25-1.37 for both).
    ("fused_indexer_q_rope_quant", "sm_90"): ("cuda:triton",),
    ("dequantize_and_gather_k_cache", "sm_90"): ("cuda:triton",),
}


def order_for(op: str, arch: str) -> tuple:
    ahead = MEASURED_ORDER.get((op, arch), ())
    return tuple(ahead) + tuple(n for n in DEFAULT_ORDER if n not in ahead)
