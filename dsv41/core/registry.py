"""Per-op choice of implementation, made once and explained.

Each backend (``dsv41/backends/<name>/``) publishes a capability sheet: a
``Backend`` subclass whose plain attributes say which device type, vendors,
architectures and packages it needs and which ops it implements.  For every op
the registry walks the candidates in order, keeps the first runnable one per
torch device type, and remembers why every other candidate was rejected.

Overrides: ``DSV41_BACKEND=<name>`` forces every op, ``DSV41_BACKEND_<OP>=<name>``
one op (``<OP>`` = the op name in capitals).  A forced backend that cannot run
raises ``BackendUnavailable`` with the reasons; an automatic choice falls back
along the list and logs the fallback once.
"""

from __future__ import annotations

import dataclasses
import importlib
import logging
import os
import threading
from typing import Callable

from . import env as _env
from . import op_specs as _op_specs
from . import platform as _platform

__all__ = [
    "Backend",
    "BackendUnavailable",
    "Resolution",
    "Explanation",
    "explain",
    "OPS",
    "backend_names",
    "resolve",
    "kernel",
    "reset",
    "candidates",
]

log = logging.getLogger("dsv41")

# Every dispatched op, in pipeline order (declared in dsv41.core.op_specs).
OPS = _op_specs.OPS


class BackendUnavailable(RuntimeError):
    """A forced backend cannot run, or no backend can run an op on a device."""


class Backend:
    """Capability sheet of one implementation family.  Subclasses set attributes only.

    name:         registry name ("cuda:triton", "rocm", "cpu", ...)
    family:       what ``DSV41_BACKEND=<family>`` selects ("cuda" for both cuda variants)
    device_type:  torch device type its kernels run on; None = any device
    vendors:      platform vendors it supports; empty = any
    archs:        architecture names it supports; empty = any of the vendors'
    requires:     packages (keys of ``platform.PACKAGES``) that must import
    kernels:      op name -> "module:function" (imported lazily, on first use)
    arch_ops:     op name -> archs that op needs beyond ``archs`` (e.g. FP4 PTX on SM100)
    input_limits: op name -> "module:function" taking the kernel arguments and returning why
                  this backend's kernel cannot take them (None: it can); the kernel consults
                  the same function and hands such calls to ``input_fallback``
    input_fallback: the backend whose kernel takes the calls outside ``input_limits``
    """

    name: str = ""
    family: str = ""
    device_type: str | None = None
    vendors: tuple = ()
    archs: tuple = ()
    requires: tuple = ()
    kernels: dict = {}
    arch_ops: dict = {}
    input_limits: dict = {}
    input_fallback: str = ""

    def reasons(self, op: str, plat) -> list[str]:
        """Why this backend cannot run ``op`` on ``plat`` (empty list: it can)."""
        why = []
        if op not in self.kernels:
            why.append(f"{self.name} has no implementation of {op}")
        if self.vendors and plat.vendor not in self.vendors:
            why.append(f"needs vendor {'/'.join(self.vendors)}, platform is {plat.vendor} ({plat.arch})")
        elif self.archs and plat.arch not in self.archs:
            why.append(f"needs arch {'/'.join(self.archs)}, platform is {plat.arch}")
        elif op in self.arch_ops and plat.arch not in self.arch_ops[op]:
            why.append(f"{op} needs arch {'/'.join(self.arch_ops[op])}, platform is {plat.arch}")
        for pkg in self.requires:
            st = plat.packages.get(pkg)
            if st is None or not st.available:
                why.append(f"package {pkg} unavailable ({st.error if st else 'not probed'})")
        if not why:
            why.extend(self.extra_reasons(op, plat))
        return why

    def extra_reasons(self, op: str, plat) -> list[str]:
        """Hook for checks beyond the sheet (e.g. a compiled extension failed to build)."""
        return []

    def load(self, op: str) -> Callable:
        return _load(self.kernels[op])

    def unsupported(self, op: str, args) -> list[str]:
        """Why this backend's kernel of ``op`` cannot take these kernel arguments (empty: it can)."""
        limit = self.input_limits.get(op)
        why = _load(limit)(*args) if limit else None
        return [why] if why else []


def _load(where: str) -> Callable:
    module, _, fn = where.partition(":")
    return getattr(importlib.import_module(module), fn)


def _backends() -> list[Backend]:
    """All backends, in the default order of preference."""
    from ..backends import ALL_BACKENDS

    return [cls() for cls in ALL_BACKENDS]


def candidates(op: str, plat) -> list[Backend]:
    from ..backends import order_for

    by_name = {b.name: b for b in _backends()}
    return [by_name[n] for n in order_for(op, plat.arch) if n in by_name]


def _names() -> list[str]:
    names = []
    for b in _backends():
        if b.family not in names:
            names.append(b.family)
        if b.name not in names:
            names.append(b.name)
    return names


def backend_names() -> list[str]:
    """Every name ``DSV41_BACKEND`` accepts: families ("cuda") and variants ("cuda:triton")."""
    return _names()


@dataclasses.dataclass
class Resolution:
    op: str
    forced: str | None
    # torch device type -> (backend name, kernel); "*" = any device (the reference)
    by_device: dict
    rejected: dict  # backend name -> [reasons]
    order: list

    def selected_for(self, device_type: str):
        return self.by_device.get(device_type) or self.by_device.get("*")


def _forced_name(op: str) -> str | None:
    value = os.environ.get(f"DSV41_BACKEND_{op.upper()}") or os.environ.get("DSV41_BACKEND")
    value = (value or "").strip()
    if not value:
        return None
    valid = _names()
    if value not in valid:
        raise BackendUnavailable(
            f"DSV41_BACKEND{'_' + op.upper() if os.environ.get(f'DSV41_BACKEND_{op.upper()}') else ''}"
            f"={value!r} is not a backend name; valid names: {', '.join(valid)}"
        )
    return value


def _resolve(op: str) -> Resolution:
    if op not in OPS:
        raise ValueError(f"unknown op {op!r}; ops are {', '.join(OPS)}")
    _env.check()
    plat = _platform.probe()
    forced = _forced_name(op)
    by_device: dict = {}
    rejected: dict = {}
    order = []
    for b in candidates(op, plat):
        order.append(b.name)
        if forced and forced not in (b.name, b.family):
            rejected[b.name] = [f"not the forced backend {forced!r}"]
            continue
        why = b.reasons(op, plat)
        dev = b.device_type or "*"
        if why:
            rejected[b.name] = why
        elif dev in by_device or ("*" in by_device and dev != "*"):
            first = by_device.get(dev) or by_device["*"]
            rejected[b.name] = [f"runnable, ranked below {first[0]}"]
        else:
            by_device[dev] = (b.name, b.load(op))
    if forced and not by_device:
        lines = "; ".join(f"{n}: {', '.join(r)}" for n, r in rejected.items() if n == forced or n.startswith(forced + ":"))
        raise BackendUnavailable(
            f"{op}: forced backend {forced!r} cannot run on {plat.arch}: {lines}. "
            f"Valid names: {', '.join(_names())}"
        )
    if not forced:
        primary = by_device.get(plat.device_type) or by_device.get("*")
        skipped = [n for n in order[: order.index(primary[0])] if n in rejected] if primary else []
        if skipped:
            log.info(
                "dsv41: %s uses %s on %s (%s)",
                op,
                primary[0],
                plat.arch,
                "; ".join(f"{n}: {', '.join(rejected[n])}" for n in skipped),
            )
    return Resolution(op, forced, by_device, rejected, order)


_lock = threading.Lock()
_resolved: dict = {}


def resolve(op: str) -> Resolution:
    """The resolution of ``op``, computed once (thread-safe)."""
    res = _resolved.get(op)
    if res is None:
        with _lock:
            res = _resolved.get(op)
            if res is None:
                res = _resolve(op)
                _resolved[op] = res
    return res


def kernel(op: str, device_type: str) -> Callable:
    """The kernel that runs ``op`` on tensors of ``device_type`` (the hot path: two dict lookups)."""
    res = _resolved.get(op) or resolve(op)
    entry = res.by_device.get(device_type) or res.by_device.get("*")
    if entry is None:
        raise BackendUnavailable(
            f"{op}: no implementation runs on {device_type} tensors "
            f"(forced={res.forced!r}); candidates: "
            + "; ".join(f"{n}: {', '.join(r)}" for n, r in res.rejected.items())
        )
    return entry[1]


@dataclasses.dataclass
class Explanation:
    """Which implementation runs one call of ``op``, and why each candidate before it does not."""

    op: str
    device_type: str
    runs: str | None  # backend name; None: nothing runs these arguments here
    steps: list  # (backend name, verdict): "runs" or the reasons it does not

    def __str__(self) -> str:
        lines = [f"{self.op} on {self.device_type} tensors: "
                 + (f"runs on {self.runs}" if self.runs else "no implementation runs these arguments")]
        for name, verdict in self.steps:
            lines.append(f"  {name}: {verdict if isinstance(verdict, str) else '; '.join(verdict)}")
        return "\n".join(lines)


def explain(op: str, *args, device_type: str | None = None) -> Explanation:
    """Which backend runs ``op`` on these kernel-contract arguments (docs/kernel_contract.md;
    ``dsv41.tools.public_calls`` maps a public call to them) and why the candidates ranked above it
    do not: rejected for the platform, or outside the input limits of their sheet.  The
    device type is the tensors' unless given."""
    if device_type is None:
        device_type = next((a.device.type for a in args if hasattr(a, "device") and hasattr(a, "dtype")), None)
        if device_type is None:
            raise TypeError(f"explain({op!r}, ...): no tensor among the arguments; pass device_type=")
    res = resolve(op)
    entry = res.by_device.get(device_type) or res.by_device.get("*")
    by_name = {b.name: b for b in _backends()}
    steps: list = []
    runs = None
    for name in res.order:
        if entry is not None and name == entry[0]:
            why = by_name[name].unsupported(op, args)
            if not why:
                steps.append((name, "runs"))
                runs = name
                break
            fallback = by_name[name].input_fallback
            steps.append((name, why + ([f"its kernel hands the call to {fallback}"] if fallback else [])))
            if fallback:
                steps.append((fallback, "runs"))
                runs = fallback
            break
        steps.append((name, res.rejected.get(name, [f"does not run on {device_type} tensors"])))
    return Explanation(op, device_type, runs, steps)


_preferred: dict = {}


def preferred_kernel(op: str, device_type: str, attribute: str) -> Callable:
    """The kernel of the first backend (in ``op``'s order) that runs ``op`` on ``device_type``
    and whose sheet sets ``attribute`` (e.g. ``triton_source``); the selected kernel when none
    does.  Computed once per (op, device type, attribute)."""
    key = (op, device_type, attribute)
    fn = _preferred.get(key)
    if fn is None:
        res = resolve(op)
        fn = kernel(op, device_type)
        plat = _platform.probe()
        for b in candidates(op, plat):
            if getattr(b, attribute, False) and b.device_type == device_type and not res.forced:
                if not b.reasons(op, plat):
                    fn = b.load(op)
                    break
        _preferred[key] = fn
    return fn


# Called by reset(): caches of resolved kernels kept elsewhere (the eager call path's).
_reset_hooks: list = []


def on_reset(hook: Callable[[], None]) -> None:
    """Have ``reset()`` call ``hook`` (a cache of ``kernel()`` results forgets them)."""
    _reset_hooks.append(hook)


def reset() -> None:
    """Forget all resolutions and the platform probe (for tests that change the environment)."""
    with _lock:
        _resolved.clear()
        _preferred.clear()
        for hook in _reset_hooks:
            hook()
    _platform.reset()
    _env.reset()
