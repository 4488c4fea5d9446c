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

from dsv41.core import gpu_approx

__all__ = ["forced", "portable", "integer_path", "ptx", "paths", "pdl_allowed", "approx_hw", "approx_table",
           "PATHS"]

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


# The architectures whose approximate rsqrt / rcp / ex2 were measured equal to the tables of
# dsv41.core.gpu_approx (tests/test_gpu_exhaustive.py, every fp32 input): (major, minor).
APPROX_MEASURED = ((9, 0),)
_approx_arch: dict = {}


def approx_hw(device: torch.device) -> bool:
    """Whether a launch on ``device`` computes the GPU's approximate primitives (``tl.rsqrt``,
    fp32 ``/``, ``tl.exp``) with the instructions themselves: the hardware path on an NVIDIA GPU
    whose instructions are the tables' (``APPROX_MEASURED``); elsewhere the kernels read the
    tables, for the same bits."""
    if not ptx(device):
        return False
    index = device.index if device.index is not None else torch.cuda.current_device()
    hw = _approx_arch.get(index)
    if hw is None:
        hw = _approx_arch[index] = torch.cuda.get_device_capability(index) in APPROX_MEASURED
    return hw


def approx_table(hw: bool, name: str, device, stand_in):
    """The int32 table ``name`` of ``dsv41.core.gpu_approx`` on ``device`` for a launch that
    computes the GPU's approximate primitive from it; a launch on the instruction itself
    (``hw``) never reads it and gets ``stand_in`` (any tensor of the call)."""
    return stand_in if hw else gpu_approx.result_bits(name, device)


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
