"""How a public function reaches its kernel: ``ops.<name>(*kernel_args)``.

Two paths, the same kernel, the same bytes:

* **eager** (the common case): the registry's resolved kernel is called directly.  A
  ``torch.library`` custom op costs tens of microseconds per call on the host (default
  filling, the autograd and ADInplaceOrView redispatch, the dynamo-disable wrapper), more
  than most of these kernels take at decode sizes, and eager calls are what serving engines
  make outside CUDA graphs.
* **through ``torch.ops.dsv41.<name>``** whenever PyTorch has to see the op: while
  ``torch.compile`` traces, under any dispatch mode (fake tensors, functionalization, the
  ``opcheck`` and ``make_fx`` machinery), inside functorch transforms, and when a tensor
  argument is a subclass (``FakeTensor``, ``FunctionalTensor``, DTensor, ...).

Both paths are graph-capturable: the kernel launch is the same.  ``DSV41_EAGER_OPS=0`` forces
the op path everywhere (read once, on first use).
"""

from __future__ import annotations

import os
import threading

import torch
from torch import Tensor

from . import _library  # noqa: F401  (registers torch.ops.dsv41.*)
from . import registry

__all__ = ["ops", "eager_enabled", "takes_op_path", "capturing", "KernelCall", "stop_if_capturing"]

_eager: bool | None = None


def eager_enabled() -> bool:
    """False when ``DSV41_EAGER_OPS=0`` (every call then goes through ``torch.ops.dsv41``)."""
    global _eager
    if _eager is None:
        _eager = os.environ.get("DSV41_EAGER_OPS", "1").strip() != "0"
    return _eager


_functorch_active = getattr(torch._C, "_are_functorch_transforms_active", lambda: False)
_dispatch_modes = torch._C._len_torch_dispatch_stack
_is_compiling = torch.compiler.is_compiling


# Types a kernel argument may have on the eager path without a closer look (one C-level pass
# over the arguments); anything else is examined one by one.  ``nn.Parameter`` is a plain
# tensor to the dispatcher (weights arrive as parameters).
_PLAIN_TENSORS = (Tensor, torch.nn.Parameter)
_PLAIN_TYPES = frozenset({*_PLAIN_TENSORS, int, float, bool, str, type(None), torch.dtype})


def _has_subclass(args) -> bool:
    for a in args:
        if isinstance(a, Tensor) and type(a) not in _PLAIN_TENSORS:
            return True
    return False


def takes_op_path(args) -> bool:
    """Whether a call with these kernel arguments must go through the custom op: tracing
    (tested first: torch.compile folds it and never sees the rest),
    a dispatch mode, a functorch transform, or a tensor subclass (fake, functional, DTensor)."""
    if _is_compiling() or _dispatch_modes() or _functorch_active() or not eager_enabled():
        return True
    return not _PLAIN_TYPES.issuperset(map(type, args)) and _has_subclass(args)


class KernelCall(Exception):
    """Raised in place of a kernel launch inside ``capturing()``: the op and its kernel arguments."""

    def __init__(self, name: str, args: tuple, kernel=None):
        super().__init__(name)
        # kernel: the function that would run, where the caller chose it instead of the registry
        self.name, self.args, self.kernel = name, args, kernel


class _Capturing(threading.local):
    # a class default: reading a missing attribute of a thread-local costs ~0.4 us (an exception)
    on = False


_capture = _Capturing()


class capturing:
    """Within this block (this thread), a public function stops at its kernel launch by raising
    ``KernelCall`` (``dsv41.explain`` uses it to learn the kernel arguments of a public call)."""

    def __enter__(self):
        _capture.on = True

    def __exit__(self, *exc):
        _capture.on = False


def stop_if_capturing(name: str, args: tuple, kernel=None) -> None:
    """For a public function that reaches its kernel other than through ``ops`` (a composite step
    that may move bytes first, or a kernel it picked itself): inside ``capturing()`` stop here,
    before anything is written."""
    if _capture.on:
        raise KernelCall(name, args, kernel)


class _Call:
    __slots__ = ("name", "op", "kernels", "source")

    def __init__(self, name: str):
        self.name = name
        self.op = getattr(torch.ops.dsv41, name)
        # torch.device -> the kernel ``source`` (registry.kernel) resolved for it; emptied by
        # registry.reset() and whenever registry.kernel is another function (a test, a tool
        # that substitutes the kernels)
        self.kernels: dict = {}
        self.source = registry.kernel
        registry.on_reset(self.kernels.clear)

    def __call__(self, *args):
        if _capture.on:
            raise KernelCall(self.name, args)
        if takes_op_path(args):
            return self.op(*args)
        if self.source is not registry.kernel:
            self.kernels.clear()
            self.source = registry.kernel
        try:
            # every op's first kernel argument is a tensor (op_specs): the one that names the device
            kernel = self.kernels[args[0].device]
        except (KeyError, IndexError, AttributeError):
            return self._first(args)
        return kernel(*args)

    def _first(self, args):
        first = args[0] if args else None
        if not isinstance(first, Tensor):
            return self.op(*args)  # let the op say what is wrong
        kernel = self.source(self.name, first.device.type)  # raises if nothing runs here
        self.kernels[first.device] = kernel
        return kernel(*args)


class _Ops:
    """``ops.<op name>``: a callable per op, made on first use."""

    def __getattr__(self, name: str) -> _Call:
        if name.startswith("__"):
            raise AttributeError(name)
        call = _Call(name)
        setattr(self, name, call)
        return call


ops = _Ops()
