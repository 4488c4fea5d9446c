"""What machine are we on?  Vendor, architecture, native fp8 flavours, packages.

Nothing here runs at import time: ``probe()`` is called on the first op call
(or by ``python -m dsv41 info``), so ``import dsv41`` never creates a GPU
context.  ``DSV41_PLATFORM=<sm_90|sm_100|sm_120|gfx942|gfx950|xpu|cpu>``
replaces the hardware part of the probe, so tests can ask "what would run on
an MI300?" on a CPU machine; package availability is always real.
"""

from __future__ import annotations

import dataclasses
import importlib
import os
import threading

import torch

from .formats import Fp8Flavour

__all__ = ["Platform", "probe", "reset", "INJECTABLE", "package_status"]

# Injectable platforms -> (vendor, torch device type, native fp8 flavours).
INJECTABLE = {
    "sm_90": ("nvidia", "cuda", (Fp8Flavour.OCP,)),
    "sm_100": ("nvidia", "cuda", (Fp8Flavour.OCP,)),
    "sm_120": ("nvidia", "cuda", (Fp8Flavour.OCP,)),
    "gfx942": ("amd", "cuda", (Fp8Flavour.FNUZ,)),
    "gfx950": ("amd", "cuda", (Fp8Flavour.OCP,)),
    "xpu": ("intel", "xpu", (Fp8Flavour.OCP,)),
    "cpu": ("cpu", "cpu", ()),
}

# Optional packages and the module that proves each one usable.
PACKAGES = {"triton": "triton", "cutlass": "cutlass.cute", "flashinfer": "flashinfer"}


@dataclasses.dataclass(frozen=True)
class PackageStatus:
    available: bool
    version: str | None = None
    error: str | None = None


@dataclasses.dataclass(frozen=True)
class Platform:
    vendor: str  # nvidia | amd | intel | cpu
    device_type: str  # the torch device type of the accelerator ("cuda" also on ROCm)
    arch: str  # sm_90, sm_100, gfx942, gfx950, xpu, cpu, ...
    native_fp8: tuple  # Fp8Flavour values the hardware converts natively
    source: str  # "probe" or "DSV41_PLATFORM"
    packages: dict = dataclasses.field(default_factory=dict)
    device_name: str | None = None

    @property
    def fp8_flavour(self) -> Fp8Flavour:
        """The flavour a new cache gets by default on this machine (OCP where none is native)."""
        return self.native_fp8[0] if self.native_fp8 else Fp8Flavour.OCP

    @property
    def is_rocm(self) -> bool:
        return self.vendor == "amd"

    def has(self, package: str) -> bool:
        st = self.packages.get(package)
        return bool(st and st.available)

    def to_json(self) -> dict:
        return {
            "vendor": self.vendor,
            "device_type": self.device_type,
            "arch": self.arch,
            "device_name": self.device_name,
            "native_fp8": [f.value for f in self.native_fp8],
            "source": self.source,
            "torch": torch.__version__,
            "packages": {
                name: {"available": s.available, "version": s.version, "error": s.error}
                for name, s in self.packages.items()
            },
        }


def package_status(module: str) -> PackageStatus:
    try:
        mod = importlib.import_module(module)
    except Exception as exc:  # ImportError, or a broken install raising anything else
        return PackageStatus(False, error=f"{type(exc).__name__}: {exc}")
    root = importlib.import_module(module.split(".")[0])
    return PackageStatus(True, version=getattr(root, "__version__", None) or getattr(mod, "__version__", None))


def _probe_hardware() -> tuple:
    if torch.cuda.is_available():
        if torch.version.hip is not None:
            arch = torch.cuda.get_device_properties(0).gcnArchName.split(":")[0]
            native = (Fp8Flavour.FNUZ,) if arch.startswith("gfx94") else (Fp8Flavour.OCP,)
            return "amd", "cuda", arch, native, torch.cuda.get_device_name(0)
        major, minor = torch.cuda.get_device_capability(0)
        arch = f"sm_{major}{minor}"
        native = (Fp8Flavour.OCP,) if (major, minor) >= (8, 9) else ()
        return "nvidia", "cuda", arch, native, torch.cuda.get_device_name(0)
    xpu = getattr(torch, "xpu", None)
    if xpu is not None and xpu.is_available():
        return "intel", "xpu", "xpu", (Fp8Flavour.OCP,), xpu.get_device_name(0)
    return "cpu", "cpu", "cpu", (), None


_lock = threading.Lock()
_cached: Platform | None = None


def probe() -> Platform:
    """The platform, probed once and cached (thread-safe)."""
    global _cached
    if _cached is not None:
        return _cached
    with _lock:
        if _cached is None:
            _cached = _build()
    return _cached


def reset() -> None:
    """Forget the cached probe (tests that change DSV41_PLATFORM call this)."""
    global _cached
    with _lock:
        _cached = None


def _build() -> Platform:
    packages = {name: package_status(mod) for name, mod in PACKAGES.items()}
    forced = os.environ.get("DSV41_PLATFORM", "").strip()
    if forced:
        if forced not in INJECTABLE:
            raise ValueError(
                f"DSV41_PLATFORM={forced!r} is not a known platform; expected one of "
                f"{sorted(INJECTABLE)}"
            )
        vendor, dev, native = INJECTABLE[forced]
        return Platform(vendor, dev, forced, native, "DSV41_PLATFORM", packages)
    vendor, dev, arch, native, name = _probe_hardware()
    return Platform(vendor, dev, arch, native, "probe", packages, name)
