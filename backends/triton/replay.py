"""Eager calls that go straight to the compiled kernel: a launcher's launches, replayed.

A Triton launcher (``backends/triton/*_kernels.py``) turns kernel arguments into one or more
launches: it reads shapes, strides, dtypes and a few address bits, picks a launch shape,
and calls a ``bound.BoundKernel``, which picks the compiled kernel.  All of that is a function
of the call's *launch key*: the kernel arguments' types, each tensor's metadata (dtype, shape,
strides, device, as ``torch.compile``'s tensor guards compare them) and address mod 16, every
non-tensor argument's value, the current device, Triton's per-call compile settings and the
backend's launch settings (``tuning.settings``).  Only the tensors' addresses change between
two calls with one key.

``Replaying(launcher)`` records, for a key, what the launcher did: each launch's compiled
launcher, grid, and positional arguments, every tensor among them matched to the kernel
argument at the same address.  A later call with the same key passes the compiled launchers
the new addresses and the recorded rest, skipping the launcher's Python and Triton's binding.

A call is recorded only when the replay provably does what the launcher does:

* every launch went through ``BoundKernel``'s direct path (not Triton's own ``run``);
* the launcher ran no PyTorch operation other than views (an allocation, a fill, a copy or a
  read of a tensor's values is work a replay would skip) -- a ``TorchDispatchMode`` watches;
* every launched tensor is a kernel argument at the same address (a view of one, e.g. a dtype
  view, counts as that argument) matched by exactly one kernel argument, or a tensor that
  existed before the call and lies outside every argument's storage (a table the backend
  keeps; the record holds it) -- a view at an offset into an argument is refused;
* no launched integer is an address inside a kernel tensor's storage (a launcher that passed
  an address as an integer would have it frozen).

Launched pointers are passed as integers (Triton's launchers take them so; they then skip the
driver's pointer-attribute query, which the argument checks made redundant).  Keys that cannot
be recorded after ``_TRIES`` calls run the launcher from then on.  ``DSV41_REPLAY=0`` turns
replay off (read once).  ``tests/test_bound_launch.py`` checks replayed launches against the
launchers' own on the CPU with a driver that compiles for sm_90 and records instead of
launching (``tests/bound_launch_check.py replay``); the GPU suite compares the bytes.
"""

from __future__ import annotations

import os
from functools import reduce
from operator import or_

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from dsv41.core import accepted_layouts

from . import bound, tuning

__all__ = ["Replaying", "enabled"]

_Tensor = torch.Tensor
_ADDRESS = torch.Tensor.data_ptr
_LOW4 = (15).__and__
_OR = or_
# records kept per pattern of argument types (the oldest dropped beyond) and per key
_KEYS = 256
_PER_KEY = 4
# calls of one key that may fail to record before the key runs the launcher for good (a first
# call may build a table the backend then keeps)
_TRIES = 3

_ENABLED: bool | None = None


def enabled() -> bool:
    """Whether replay is on in this process (``DSV41_REPLAY`` unset or not 0); read once."""
    global _ENABLED
    if _ENABLED is None:
        _ENABLED = os.environ.get("DSV41_REPLAY", "1").strip() != "0"
    return _ENABLED


class _Watch(TorchDispatchMode):
    """Notes every PyTorch operation but views run while a call is recorded."""

    def __init__(self):
        super().__init__()
        self.ops: list = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not func.is_view:
            self.ops.append(func)
        return func(*args, **(kwargs or {}))


class _Launch:
    """One recorded launch: how to fire the compiled kernel (``bound.firing``) and its
    arguments, addresses left open."""

    __slots__ = ("fire", "grid", "pick", "consts", "kernel")

    def __init__(self, fire, grid, pick, consts, kernel):
        self.fire, self.grid, self.pick, self.consts, self.kernel = fire, grid, pick, consts, kernel


def _low(ptrs: tuple):
    """The addresses mod 16 as a record keeps them: None when every one is 0 (the common case,
    tested with one ``or`` over all of them), else the tuple."""
    return None if not reduce(_OR, ptrs, 0) & 15 else tuple(map(_LOW4, ptrs))


class _Record:
    __slots__ = ("low", "guard", "launches")

    def __init__(self, low, guard, launches):
        self.low, self.guard, self.launches = low, guard, launches


def _launches(seen, tensors, ptrs):
    """The ``_Launch``es of a recorded call, or None when it cannot be replayed."""
    n = len(ptrs)
    where = {}
    for i, p in enumerate(ptrs):
        where.setdefault(p, []).append(i)
    # the arguments' storages: an address inside one but at no argument's own address is a
    # view at an offset (or an address computed from one), which would change with the call
    spans = [(st.data_ptr(), st.nbytes()) for st in (t.untyped_storage() for t in tensors)]

    def inside(p) -> bool:
        return any(base <= p < base + size for base, size in spans if size)

    out = []
    for item in seen:
        if item is None:  # a launch through Triton's own path
            return None
        fire, grid, args, tail, kernel = item
        pick, consts = [], []
        for a in (*args, *tail):
            if isinstance(a, _Tensor):
                hits = where.get(a.data_ptr())
                if hits is None:
                    if inside(a.data_ptr()):
                        return None
                    # not an argument: a tensor that existed before the call (nothing was
                    # allocated, the watch says), kept alive by the record
                    pick.append(n + len(consts))
                    consts.append(a)
                    continue
                if len(hits) != 1:
                    return None
                pick.append(hits[0])
            else:
                if type(a) is int and a != 0 and (a in where or inside(a)):
                    return None
                pick.append(n + len(consts))
                consts.append(a)
        grid = tuple(grid) + (1,) * (3 - len(grid))
        out.append(_Launch(fire, grid, accepted_layouts.tuple_getter(pick), tuple(consts), kernel))
    return out


class Replaying:
    """``Replaying(launcher)(*kernel_args)``: the launcher's effect, replayed where recorded."""

    __slots__ = ("fn", "_by_types", "__wrapped__")

    def __init__(self, fn):
        self.fn = fn
        self.__wrapped__ = fn
        # argument types -> (tensors getter, others getter, {key: records or tries}) or None
        self._by_types: dict = {}

    def __repr__(self) -> str:
        return f"Replaying({getattr(self.fn, '__module__', '?')}.{getattr(self.fn, '__name__', '?')})"

    def __call__(self, *args):
        if not (_ENABLED or enabled()):
            return self.fn(*args)
        state = bound.direct_state()
        if state is None:
            return self.fn(*args)
        types = tuple(map(type, args))
        entry = self._by_types.get(types, False)
        if entry is False:
            entry = self._split(types)
        if entry is None:
            return self.fn(*args)
        tensors_of, others_of, table = entry
        tensors = tensors_of(args)
        try:
            key = (others_of(args), *state, *tuning.settings())
            records = table.get(key)
        except TypeError:  # an unhashable argument
            return self.fn(*args)
        ptrs = tuple(map(_ADDRESS, tensors))
        if type(records) is list:
            low = _low(ptrs)
            for r in records:
                if r.low == low and r.guard(*tensors):
                    for la in r.launches:
                        if la.kernel.pre_run_hooks:  # installed since (a profiler): Triton's path
                            return self.fn(*args)
                    stream = state[0].get_current_stream(state[1])
                    for la in r.launches:
                        g = la.grid
                        la.fire(g[0], g[1], g[2], stream, la.pick(ptrs + la.consts))
                    return None
        elif records is not None and records >= _TRIES:
            return self.fn(*args)
        return self._record(args, tensors, ptrs, table, key, records)

    def record_for(self, *args):
        """The record a call with these kernel arguments would replay now (its ``launches``:
        what fires), or None where the call would run the launcher.  For tools that time the
        replayed launches apart from the call; ``__call__`` inlines the same lookup."""
        state = bound.direct_state() if enabled() else None
        entry = self._by_types.get(tuple(map(type, args)))
        if state is None or not entry:
            return None
        tensors_of, others_of, table = entry
        tensors = tensors_of(args)
        try:
            records = table.get((others_of(args), *state, *tuning.settings()))
        except TypeError:
            return None
        if type(records) is not list:
            return None
        low = _low(tuple(map(_ADDRESS, tensors)))
        for r in records:
            if r.low == low and r.guard(*tensors):
                # a hook installed since (a profiler) sends the call down Triton's path
                return None if any(la.kernel.pre_run_hooks for la in r.launches) else r
        return None

    def _split(self, types: tuple):
        # the split of accepted_layouts: None for a tensor subclass or a tuple / list argument
        split = accepted_layouts._split(types)
        if len(self._by_types) >= 64:
            self._by_types.clear()
        entry = self._by_types[types] = None if split is None else (*split, {})
        return entry

    def _record(self, args, tensors, ptrs, table, key, records):
        seen: list = []
        watch = _Watch()
        with bound.recording(seen), watch:
            result = self.fn(*args)
        launches = None
        if result is None and not watch.ops:
            launches = _launches(seen, tensors, ptrs)
        if len(table) >= _KEYS and key not in table:
            for old in list(table)[: _KEYS // 2]:
                table.pop(old, None)
        if launches is None:
            tries = (records if type(records) is int else 0) + 1
            table[key] = tries
        else:
            rec = _Record(_low(ptrs), accepted_layouts._guard(tensors), launches)
            kept = records if type(records) is list else []
            table[key] = [rec, *kept][:_PER_KEY]
        return result
