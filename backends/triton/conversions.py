"""Which float-conversion path a launch of the shared Triton kernels takes: the one switch.

On NVIDIA GPUs the kernels use the hardware converts (``cvt.rn.satfinite.e4m3x2``,
``cvt.rn.bf16.f32``, the inline-PTX pair encoders) and may launch with PDL; everywhere else
(ROCm, XPU, Triton's interpreter) they encode fp8 / bf16 with integer bit operations.  Both
paths write the same bytes.  The path is decided per launch from the tensors' device and
passed to the kernel as a constexpr (``SOFT`` in ``cache_kernels``, ``CVT_HW`` in
``rope_kernels``).

``forced("integer")`` / ``portable()`` make every launch in this thread (context) take the
integer path, with PDL off -- how the ROCm and XPU kernels run natively on an NVIDIA GPU in
the tests (the only vendor-specific part of those kernels is this conversion path);
``forced("hardware")`` takes the hardware converts anywhere (Triton's interpreter runs them as
casts).  A context variable, not a module global: two threads may use two paths at once.
"""

from __future__ import annotations

import contextlib
import contextvars

import torch

__all__ = ["forced", "portable", "integer_path", "ptx", "paths", "pdl_allowed", "PATHS"]

PATHS = ("integer", "hardware")
_FORCED: contextvars.ContextVar = contextvars.ContextVar("dsv41_triton_conversion_path", default=None)


# a ROCm build of PyTorch names its GPUs "cuda" too; fixed for the process (read per launch)
_ROCM_TORCH = torch.version.hip is not None


def _nvidia(device: torch.device) -> bool:
    return device.type == "cuda" and not _ROCM_TORCH


def integer_path(device: torch.device) -> bool:
    """Whether a launch on ``device`` encodes with integer operations (else hardware converts)."""
    path = _FORCED.get()
    if path is not None:
        return path == "integer"
    return not _nvidia(device)


def ptx(device: torch.device) -> bool:
    """Whether a launch on ``device`` may use inline PTX (the paired converts / encoders): an
    NVIDIA GPU on the hardware path (never the interpreter, which cannot run PTX)."""
    return _nvidia(device) and not integer_path(device)


def paths(device: torch.device) -> tuple[bool, bool]:
    """``(integer_path(device), ptx(device))`` in one look (a launcher asks for both)."""
    path = _FORCED.get()
    nvidia = _nvidia(device)
    integer = path == "integer" if path is not None else not nvidia
    return integer, nvidia and not integer


def pdl_allowed() -> bool:
    """False inside ``forced("integer")``: PDL is NVIDIA-only, like the hardware converts."""
    return _FORCED.get() != "integer"


@contextlib.contextmanager
def forced(path: str):
    """Every launch in this context takes ``path`` (``"integer"`` or ``"hardware"``)."""
    if path not in PATHS:
        raise ValueError(f"forced: path expected one of {PATHS}, got {path!r}")
    token = _FORCED.set(path)
    try:
        yield
    finally:
        _FORCED.reset(token)


def portable():
    """``forced("integer")``: the conversion path of the ROCm and XPU kernels."""
    return forced("integer")
