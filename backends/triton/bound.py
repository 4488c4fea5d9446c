"""Launching a Triton kernel without Triton's per-call argument binding.

``kernel[grid](*args, **kw)`` runs ``JITFunction.run`` on every call: it re-reads Triton's
debug and instrumentation settings, binds and specializes every argument, builds a string of
the options for the cache key, builds launch metadata for the launch hooks, and the compiled
launcher then calls both (empty) hook chains.  On a host CPU that is 10-20 us per launch for
these kernels (20-40 arguments), more than most of them take on the GPU at decode sizes.

``bind(kernel)`` returns a launcher with the same call form, ``launcher(grid, *args, **kw)``,
that keeps, per *launch key*, the ``CompiledKernel`` Triton itself chose for that key and calls
its compiled launcher directly.  The key holds everything Triton's choice depends on, and more:

* the current device (Triton keeps its compiled kernels per current device);
* each positional argument's type; for a tensor its dtype and its address mod 16 (Triton's
  NVIDIA specialization reads a tensor's dtype and whether that is 0, nothing else); any other
  value itself (an integer's exact value decides more than Triton's ``== 1`` / ``% 16`` / range);
* the keyword arguments (constexprs and launch options) as given;
* Triton's compile settings that ``JITFunction.run`` reads per call (debug, instrumentation).

Two calls with equal keys are specialized identically by Triton, so the kernel kept for a key is
the one ``JITFunction.run`` would launch; on a key not seen before the launcher asks Triton
(``run(..., warmup=True)``: Triton's own binding, cache and compilation) and keeps the answer.
The launch passes the compiled launcher the same arguments ``JITFunction.run`` passes (every
parameter in order, defaults filled), with no launch metadata and no hooks -- which is what an
empty hook chain does.  For Triton's NVIDIA launcher of a tested release and a kernel without
scratch memory, ``firing`` goes one step further: it calls the launcher's compiled launch
function with what the launcher's own ``__call__`` would pass it (that Python frame costs about
1 us a launch on a host CPU).  ``tests/test_bound_launch.py`` checks both statements against Triton's
own path (same compiled kernel, same launcher arguments) for every launcher on the CPU with a
driver that compiles for sm_90 and records instead of launching; the GPU suite runs the real
launches.

Triton's own path is taken instead where the key argument does not hold or cannot be checked
cheaply: Triton's interpreter, a non-NVIDIA driver (the AMD backend also specializes on buffer
sizes), a Triton version the test has not covered (``TESTED_TRITON``), launch hooks installed
(profilers), pre-run hooks on the kernel, and ``DSV41_TRITON_SLOW_LAUNCH=1``.  What is kept is
bounded: ``_KEYS`` launch keys per kernel (the oldest half dropped beyond that), so a prefill
workload with ever-new token counts keeps a bounded cache and pays Triton's path on new keys.
"""

from __future__ import annotations

import contextlib
import inspect
import os
import threading
from operator import attrgetter

import torch
import triton

from dsv41.core.accepted_layouts import tuple_getter

__all__ = ["bind", "BoundKernel", "TESTED_TRITON", "enabled", "direct_state", "firing", "recording"]

# Triton releases (major.minor) whose run/launcher interface ``tests/test_bound_launch.py`` has
# checked this module against; others take Triton's own path.
TESTED_TRITON = ("3.6", "3.9")
_KEYS = 512
_Tensor = torch.Tensor
_DTYPE = attrgetter("dtype")
_ADDRESS = torch.Tensor.data_ptr
_LOW4 = (15).__and__  # address % 16: Triton's alignment test reads whether it is 0


def _version() -> str:
    return ".".join(triton.__version__.split(".")[:2])


def _slow_env() -> bool:
    return os.environ.get("DSV41_TRITON_SLOW_LAUNCH", "0").strip() not in ("", "0")


_ENABLED: bool | None = None


def enabled() -> bool:
    """Whether launches may bypass ``JITFunction.run`` in this process (Triton version tested,
    ``DSV41_TRITON_SLOW_LAUNCH`` unset); read once."""
    global _ENABLED
    if _ENABLED is None:
        _ENABLED = _version() in TESTED_TRITON and not _slow_env()
    return _ENABLED


def _hook_chain_type():
    try:
        from triton.knobs import HookChain
    except ImportError:
        return None
    return HookChain


_HookChain = _hook_chain_type()


def _quiet(chain) -> bool:
    """True for a launch hook that does nothing: None or an empty ``HookChain``."""
    return chain is None or (type(chain) is _HookChain and not chain.calls)


class _Driver:
    """Triton's active driver (looked up per call: a test or tool may swap it) and the settings
    ``JITFunction.run`` reads per call."""

    def __init__(self):
        from triton import knobs
        from triton.runtime.driver import driver

        self.driver = driver
        self.runtime = knobs.runtime
        self.last = None  # the active driver ``nvidia`` describes
        self.nvidia = False
        # the compile settings JITFunction.run folds into the options on every call (by version)
        names = [n for n in ("instrumentation_mode", "fpsan_homomorphic_casts") if hasattr(type(knobs.compilation), n)]
        compilation, runtime = knobs.compilation, knobs.runtime
        get = attrgetter(*names) if names else (lambda _: ())
        self.state = lambda: (runtime.debug, get(compilation))
        self.device = None  # the current device of ``last`` (``_device_getter``)

    def refresh(self, d) -> None:
        try:
            self.nvidia = d.get_current_target().backend == "cuda"
        except Exception:  # noqa: BLE001 - no usable target: Triton's own path reports it
            self.nvidia = False
        self.last = d
        self.device = self._device_getter(d)

    def _device_getter(self, d):
        """``d.get_current_device``; where that is ``torch.cuda.current_device`` and CUDA is
        initialized, the C function it ends in (its lazy-init test is then a no-op, and costs
        about 0.5 us of a GPU host's time per call).  Before CUDA is initialized: the driver's
        own, which upgrades itself once a call finds CUDA initialized."""
        get = d.get_current_device
        raw = getattr(torch._C, "_cuda_getDevice", None)
        if get is not torch.cuda.current_device or raw is None:
            return get
        if torch.cuda.is_initialized():
            return raw

        def first():
            device = get()
            if torch.cuda.is_initialized() and self.last is d:
                self.device = raw
            return device

        return first


_DRIVER: _Driver | None = None


def _driver() -> _Driver:
    global _DRIVER
    if _DRIVER is None:
        _DRIVER = _Driver()
    return _DRIVER


def direct_state():
    """``(driver, current device, compile settings)`` while launches may take the direct path
    (tested Triton, an NVIDIA driver, no launch hooks), else None: what a launch key holds
    besides the call's own arguments (``replay`` keys its records with it)."""
    if not _ENABLED and not enabled():
        return None
    drv = _DRIVER or _driver()
    try:
        d = drv.driver.active
    except RuntimeError:  # no usable driver (a CPU-only host): nothing launches directly
        return None
    if d is not drv.last:
        drv.refresh(d)
    if not drv.nvidia:
        return None
    rt = drv.runtime
    enter, leave = rt.launch_enter_hook, rt.launch_exit_hook
    # _quiet, inlined (this runs on every replayed call)
    if (enter is not None and (type(enter) is not _HookChain or enter.calls)) or \
            (leave is not None and (type(leave) is not _HookChain or leave.calls)):
        return None
    return d, drv.device(), drv.state()


class _Recording(threading.local):
    seen = None  # a list while ``recording`` is in force in this thread


_RECORDING = _Recording()


@contextlib.contextmanager
def recording(seen: list):
    """Within this block (this thread) every launch is also noted in ``seen``: a direct one as
    ``(fire, grid, args, tail, kernel)`` (``firing``), one through Triton's own path as None."""
    before = _RECORDING.seen
    _RECORDING.seen = seen
    try:
        yield seen
    finally:
        _RECORDING.seen = before


def _fire_36(launcher, function, metadata):
    # Triton 3.6: __call__(gx, gy, gz, stream, function, *args) -> launch(gx, gy, gz, stream,
    # function, cooperative, pdl, global scratch, profile scratch, *args), args beginning with
    # the packed metadata, the launch metadata and the two hooks
    launch, coop, pdl = launcher.launch, launcher.launch_cooperative_grid, launcher.launch_pdl

    def fire(gx, gy, gz, stream, args):
        launch(gx, gy, gz, stream, function, coop, pdl, None, None, metadata, None, None, None, *args)

    return fire


def _fire_39(launcher, function, metadata):
    # Triton 3.9: __call__(gx, gy, gz, stream, function, metadata, launch metadata, enter, exit,
    # *args) -> launch(gx, gy, gz, stream, function, cooperative, pdl, metadata, launch metadata,
    # enter, exit, global scratch, profile scratch, annotations, signature, args)
    launch, coop, pdl = launcher.launch, launcher.launch_cooperative_grid, launcher.launch_pdl
    annotations, signature = launcher.arg_annotations, launcher.kernel_signature

    def fire(gx, gy, gz, stream, args):
        launch(gx, gy, gz, stream, function, coop, pdl, metadata, None, None, None, None, None,
               annotations, signature, args)

    return fire


# Triton release -> how its NVIDIA launcher's ``__call__`` calls its compiled launch function
_DIRECT_FORMS = {"3.6": _fire_36, "3.9": _fire_39}


def _takes_direct_form(launcher) -> bool:
    """Triton's NVIDIA launcher, for a kernel that needs no scratch memory and no sanitizer:
    its ``__call__`` then only forwards to ``launch`` (no allocation, nothing else read)."""
    cls = type(launcher)
    return (cls.__name__ == "CudaLauncher" and cls.__module__ == "triton.backends.nvidia.driver"
            and getattr(launcher, "global_scratch_size", None) == 0
            and getattr(launcher, "profile_scratch_size", None) == 0
            and not getattr(launcher, "gsan_enabled", False)
            and hasattr(launcher, "launch"))


def firing(launcher, function, metadata):
    """``fire(gx, gy, gz, stream, args)``: what ``launcher(gx, gy, gz, stream, function, metadata,
    None, None, None, *args)`` does (a launch without launch metadata and hooks; ``args`` a tuple).

    For Triton's NVIDIA launcher of a tested release (``_DIRECT_FORMS``) and a kernel that needs
    no scratch memory, ``fire`` calls the compiled launch function with the arguments the
    launcher's ``__call__`` would pass it: that Python frame defines two closures and calls them
    on every launch, about 1 us of a host CPU's time (``tests/test_bound_launch.py`` compares
    both against the installed Triton's own ``__call__``).  Anything else: the launcher itself."""
    form = _DIRECT_FORMS.get(_version())
    if form is not None and _takes_direct_form(launcher):
        return form(launcher, function, metadata)

    def fire(gx, gy, gz, stream, args):
        launcher(gx, gy, gz, stream, function, metadata, None, None, None, *args)

    return fire


def _triton_path(kernel, grid, args, kwargs):
    if _RECORDING.seen is not None:
        _RECORDING.seen.append(None)
    return kernel[grid](*args, **kwargs)


class BoundKernel:
    """``launcher(grid, *args, **kw)``: launch ``kernel`` on ``grid`` (a tuple of 1-3 ints, as every
    launcher passes) like ``kernel[grid](*args, **kw)``, through the kernel Triton chose for the
    call's launch key (module docstring)."""

    __slots__ = ("kernel", "_plans", "_kept", "_tail_names", "_defaults")

    def __init__(self, kernel):
        self.kernel = kernel
        self._plans: dict = {}  # argument types -> (tensors getter, others getter)
        # launch key -> (compiled launcher, its ``firing``, tail)
        self._kept: dict = {}
        params = inspect.signature(kernel.fn).parameters
        self._tail_names = list(params)
        self._defaults = {n: p.default for n, p in params.items() if p.default is not inspect.Parameter.empty}

    def __call__(self, grid, *args, **kwargs):
        kernel = self.kernel
        if not _ENABLED and not enabled():
            return _triton_path(kernel, grid, args, kwargs)
        drv = _DRIVER or _driver()
        d = drv.driver.active
        if d is not drv.last:
            drv.refresh(d)
        rt = drv.runtime
        if not drv.nvidia or kernel.pre_run_hooks or not (_quiet(rt.launch_enter_hook) and _quiet(rt.launch_exit_hook)):
            return _triton_path(kernel, grid, args, kwargs)
        types = tuple(map(type, args))
        plan = self._plans.get(types)
        if plan is None:
            plan = self._plan(types)
        tensors = plan[0](args)
        device = drv.device()
        # the plan stands for the argument types (one plan object per types tuple, kept while
        # its keys are): hashing it is hashing an id
        key = (device, plan, plan[1](args), *map(_DTYPE, tensors), *map(_LOW4, map(_ADDRESS, tensors)),
               *kwargs.items(), *drv.state())
        kept = self._kept.get(key)
        if kept is None:
            kept = self._keep(key, grid, args, kwargs)
        fire, tail = kept[1], kept[2]
        n = len(grid)
        fire(grid[0], grid[1] if n > 1 else 1, grid[2] if n > 2 else 1, d.get_current_stream(device), (*args, *tail))
        if _RECORDING.seen is not None:
            _RECORDING.seen.append((fire, grid, args, tail, kernel))

    def _plan(self, types: tuple):
        tensors = [i for i, t in enumerate(types) if issubclass(t, _Tensor)]
        others = [i for i, t in enumerate(types) if not issubclass(t, _Tensor)]
        plan = (tuple_getter(tensors), tuple_getter(others))
        if len(self._plans) >= 64:  # keys name plans: both go
            self._plans.clear()
            self._kept.clear()
        self._plans[types] = plan
        return plan

    def _keep(self, key, grid, args, kwargs):
        """Ask Triton for the kernel of this launch key (its own binding, cache and compile)."""
        compiled = self.kernel.run(*args, grid=grid, warmup=True, **kwargs)
        if hasattr(compiled, "result"):  # an asynchronous compile's future
            compiled = compiled.result()
        launcher = compiled.run  # loads the module: ``function`` is set from here on
        # the parameters after the positional ones, as JITFunction.run passes them: given by
        # keyword, else their defaults (a constexpr's default is its value)
        tail = tuple(kwargs[n] if n in kwargs else self._defaults[n] for n in self._tail_names[len(args):])
        kept = (launcher, firing(launcher, compiled.function, compiled.packed_metadata), tail)
        if len(self._kept) >= _KEYS:
            for old in list(self._kept)[: _KEYS // 2]:
                self._kept.pop(old, None)
        self._kept[key] = kept
        return kept

    def forget(self) -> None:
        """Drop every kept kernel (they are Triton's; its own cache still holds them)."""
        self._kept.clear()
        self._plans.clear()


def bind(kernel):
    """A ``launcher(grid, *args, **kw)`` for ``kernel``: a ``BoundKernel`` for a compiled Triton
    kernel, a plain forwarder for the interpreter's functions."""
    if not hasattr(kernel, "pre_run_hooks") or type(kernel).__name__ == "InterpretedFunction":
        return lambda grid, *args, **kwargs: _triton_path(kernel, grid, args, kwargs)
    return BoundKernel(kernel)
