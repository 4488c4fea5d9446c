"""The argument layouts each public op has already accepted.

A public function's argument checks (``_validate.Check``) read metadata only: types, dtypes,
shapes, strides, devices and the values of the non-tensor arguments.  Two calls that agree on
all of that pass or fail the same checks, so a call whose *layout* was accepted before skips
them.  A serving engine calls each op with a handful of layouts (decode batch sizes, CUDA-graph
sizes), so the checks run a few times per layout instead of on every call.

``new()`` takes the calling function's parameters, every one, in order, as its first
statement (``tests/test_accepted_layouts.py`` holds each public function to that)::

    _accepted = AcceptedLayouts()

    def op(x, y, n=1):
        new = _accepted.new((x, y, n))
        if new is not None:
            c = Check("op")
            ...
            _accepted.add(new)

A layout is, per argument: its type; for a tensor its dtype, shape, strides and device (and
what else PyTorch's own guards compare: requires_grad, dispatch keys); for a tuple or list the
same of each element; for anything else its value (with its type, ``True`` and ``1`` differ).
The tensor part is compared by ``torch.compile``'s C++ tensor guards where this PyTorch has them
(about 50 ns a tensor; reading the same metadata from Python costs about 350 ns), else by a tuple
of the metadata.  Index *values* (slots, block tables) are never part of a layout: their checks
(``index_checks``) run on every call.  Calls that cannot be keyed always run their checks:
tensor subclasses (fake, functional, DTensor), unhashable values, and calls traced by
``torch.compile``.  What is kept is bounded: per op at most ``limit`` patterns of argument
types, per pattern at most ``limit`` combinations of non-tensor values (the oldest dropped), each
with its ``_PER_KEY`` most recent tensor layouts.
"""

from __future__ import annotations

from operator import itemgetter

import torch

__all__ = ["AcceptedLayouts", "UNKEYED", "tuple_getter"]

_Tensor = torch.Tensor
_PLAIN_TENSORS = (torch.Tensor, torch.nn.Parameter)
_SEQUENCES = (tuple, list)
_is_compiling = torch.compiler.is_compiling

# The key of a call whose layout cannot be remembered: its checks run, nothing is added.
UNKEYED = object()

# Layouts kept per op and per pattern of argument types.
_PER_KEY = 8


def _metadata(tensors) -> tuple:
    return tuple([(t.dtype, t.shape, t.stride(), t.device, t.requires_grad) for t in tensors])


def _python_guard(tensors):
    want = _metadata(tensors)
    return lambda *ts: _metadata(ts) == want


def _compiled_guards():
    """``torch.compile``'s tensor guards as a guard factory, if they work here as assumed."""
    try:
        from torch._C._dynamo.guards import TensorGuards
    except ImportError:
        return None

    def make(tensors):
        return TensorGuards(
            *tensors,
            dynamic_dims_sizes=[list(t.shape) for t in tensors],
            dynamic_dims_strides=[list(t.stride()) for t in tensors],
        ).check

    try:
        x = torch.zeros(2, 3)
        check = make((x, x))
        ok = (check(x, torch.ones(2, 3)) and not check(x, x.t()) and not check(x, x.double())
              and not check(x, torch.zeros(2, 4)))
    except Exception:  # noqa: BLE001 - a private API: any surprise means "not available"
        return None
    return make if ok else None


_make_guard = None


def _guard(tensors):
    global _make_guard
    if _make_guard is None:
        _make_guard = _compiled_guards() or _python_guard
    return _make_guard(tensors)


def _layout(values) -> tuple | None:
    """A hashable layout of ``values`` (tensor metadata, typed scalars); None for a tensor subclass."""
    key = []
    add = key.append
    for v in values:
        if isinstance(v, _Tensor):
            if type(v) not in _PLAIN_TENSORS:
                return None
            add((type(v), v.dtype, v.shape, v.stride(), v.device))
        elif type(v) in _SEQUENCES:
            inner = _layout(v)
            if inner is None:
                return None
            add((type(v), inner))
        else:
            add((type(v), v))
    return tuple(key)


def tuple_getter(positions: list):
    """A C-level getter of ``values[i] for i in positions`` that always returns a tuple."""
    if len(positions) > 1:
        return itemgetter(*positions)
    if positions:
        i = positions[0]
        return lambda values: (values[i],)
    return lambda values: ()


def _split(types: tuple):
    """(tensors getter, others getter) for a pattern of argument types; None when it cannot be
    split this way (a tensor subclass, or a tuple / list whose elements need a look of their own)."""
    tensors, others = [], []
    for i, t in enumerate(types):
        if t in _PLAIN_TENSORS:
            tensors.append(i)
        elif issubclass(t, _Tensor) or t in _SEQUENCES:
            return None
        else:
            others.append(i)
    return tuple_getter(tensors), tuple_getter(others)


class AcceptedLayouts:
    """The layouts whose checks passed for one op (the most recent, a bounded number)."""

    __slots__ = ("_by_types", "_slow", "limit")

    def __init__(self, limit: int = 32):
        # argument types -> (tensors getter, others getter, {other values: [tensor guards]}),
        # or None when calls of those types cannot be split (then ``_slow`` holds full layouts)
        self._by_types: dict = {}
        self._slow: dict = {}
        self.limit = limit

    def new(self, values: tuple):
        """``None`` when this call's layout was accepted before (skip the checks); otherwise the
        key to ``add`` once the checks pass.  ``values``: the caller's parameters in order (a
        tuple written out: reading the caller's frame instead costs 1-3 us a call)."""
        if _is_compiling():
            return UNKEYED
        types = tuple(map(type, values))
        entry = self._by_types.get(types, False)
        if entry is False:
            split = _split(types)
            entry = None if split is None else (*split, {})
            if len(self._by_types) >= self.limit:
                self._by_types.clear()
            self._by_types[types] = entry
        if entry is None:
            return self._new_slow(values)
        tensors_of, others_of, table = entry
        tensors, others = tensors_of(values), others_of(values)
        try:
            guards = table.get(others)
        except TypeError:  # an unhashable argument: the checks will say what is wrong with it
            return UNKEYED
        if guards:
            for check in guards:
                if check(*tensors):
                    return None
        return (table, others, tensors)

    def _new_slow(self, values):
        key = _layout(values)
        if key is None:
            return UNKEYED
        try:
            if key in self._slow:
                return None
        except TypeError:
            return UNKEYED
        return (self._slow, key, None)

    def add(self, new) -> None:
        """Remember a layout whose checks passed (``new``: what ``new()`` returned)."""
        if new is UNKEYED or new is None:
            return
        table, key, tensors = new
        if key not in table and len(table) >= self.limit:
            try:
                del table[next(iter(table))]
            except (KeyError, StopIteration, RuntimeError):  # another thread got there first
                pass
        if table is self._slow:
            table[key] = None
        else:
            table[key] = [_guard(tensors), *table.get(key, ())][:_PER_KEY]

    def clear(self) -> None:
        self._by_types.clear()
        self._slow.clear()
