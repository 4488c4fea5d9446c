"""Which float-conversion path the shared Triton kernels take, and a switch to force one.

On NVIDIA GPUs the kernels use the hardware converts (``cvt.rn.satfinite.e4m3x2``,
``cvt.rn.bf16.f32``); everywhere else (ROCm, XPU, the interpreter) they encode fp8 / bf16
with integer bit operations.  Both paths write the same bytes.  ``portable()`` forces the
integer path, which is how the ROCm and XPU kernels run natively on an NVIDIA GPU in the
test suite (the only AMD-specific part of those kernels is this conversion path).
"""

from __future__ import annotations

import contextlib

from . import cache_kernels, launch, rope_kernels


@contextlib.contextmanager
def portable():
    """Force the integer-encoder conversion path of every shared Triton kernel (not thread-safe)."""
    saved = cache_kernels.CONFIG["soft_fp8"], rope_kernels.CVT_HW_OVERRIDE, launch.PDL_OVERRIDE
    cache_kernels.CONFIG["soft_fp8"], rope_kernels.CVT_HW_OVERRIDE = True, False
    launch.PDL_OVERRIDE = False  # nor PDL: NVIDIA-only, as the paired PTX converts
    try:
        yield
    finally:
        cache_kernels.CONFIG["soft_fp8"], rope_kernels.CVT_HW_OVERRIDE, launch.PDL_OVERRIDE = saved
