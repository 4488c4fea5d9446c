"""Backends: one folder per implementation family, each with a capability sheet.

Adding a backend (see docs/adding_a_backend.md):
1. make ``backends/<name>/__init__.py`` with a ``Backend`` subclass whose attributes
   say what it needs (device type, vendors, archs, packages) and which ops it has
   (``kernels = {op: "module:function"}``, functions with the signatures of
   docs/kernel_contract.md);
2. list it in ``ALL_BACKENDS`` below and, if it should outrank others, in ``DEFAULT_ORDER``.
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

# (op, arch) -> order, where a measurement on that arch ranked the variants
# differently from DEFAULT_ORDER (docs/performance.md has the numbers).
MEASURED_ORDER: dict = {}


def order_for(op: str, arch: str) -> tuple:
    return MEASURED_ORDER.get((op, arch), DEFAULT_ORDER)
