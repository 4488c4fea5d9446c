"""Which implementations the conformance matrix runs here, and on which device.

An implementation joins the matrix by registering in the registry: nothing here
names a backend.  Implementations the platform cannot run are skipped with the
registry's own reasons, except Triton-source backends under
``TRITON_INTERPRET=1``, which run their real kernels on CPU tensors in Triton's
interpreter (made bit-exact by ``tests/triton_interp.py``).
"""

from __future__ import annotations

import dataclasses
import os

import torch

from dsv41.core import platform, registry
from dsv41.backends import ALL_BACKENDS


@dataclasses.dataclass
class Impl:
    name: str
    backend: object
    device: str | None  # None: cannot run here
    why: str = ""
    interpreted: bool = False
    portable: bool = False  # Triton source run natively with its non-NVIDIA conversion path

    def kernel(self, op):
        fn = self.backend.load(op)
        if not self.portable:
            return fn

        from dsv41.backends.triton import conversions  # only where Triton runs

        def run(*args):
            with conversions.portable():
                return fn(*args)

        return run

    def skip_reason(self, op) -> str | None:
        if op not in self.backend.kernels:
            return f"{self.name} has no implementation of {op}"
        if self.device is None:
            return self.why
        return None


def interpreter_on() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


def nvidia_gpu() -> bool:
    return torch.cuda.is_available() and torch.version.hip is None


def implementations(include_reference: bool = False) -> list[Impl]:
    """One entry per backend; Triton-source backends of other vendors (rocm, xpu) also run
    natively on an NVIDIA GPU (``name@cuda``), with their own conversion path forced."""
    plat = platform.probe()
    out = []
    for cls in ALL_BACKENDS:
        b = cls()
        if b.name == "reference" and not include_reference:
            continue
        why = b.reasons(next(iter(b.kernels), "quantize_and_insert_k_cache"), plat) if b.kernels else [f"{b.name} has no kernels yet"]
        why = [w for w in why if "has no implementation" not in w]
        dev = b.device_type or "cpu"
        if not why and (dev == "cpu" or (dev == "cuda" and torch.cuda.is_available()) or (dev == "xpu" and hasattr(torch, "xpu") and torch.xpu.is_available())):
            out.append(Impl(b.name, b, dev))
        elif getattr(b, "triton_source", False) and interpreter_on() and plat.device_type == "cpu":
            from triton_interp import interpreter_unsupported_reason

            unsupported = interpreter_unsupported_reason()
            if unsupported:
                out.append(Impl(b.name + "@interp", b, None, unsupported, interpreted=True))
            else:
                out.append(Impl(b.name + "@interp", b, "cpu", interpreted=True))
        elif getattr(b, "triton_source", False) and b.family != "cuda" and nvidia_gpu():
            out.append(Impl(b.name + "@cuda", b, "cuda", portable=True))
        else:
            out.append(Impl(b.name, b, None, "; ".join(why) or "cannot run on this machine"))
    return out
