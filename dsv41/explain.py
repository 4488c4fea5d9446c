"""``dsv41.explain(fn, *args, **kwargs)``: which implementation a public call would run, and why.

The public function runs its argument checks and allocations as usual and stops where it would
launch its kernel (``_calls.capturing``): nothing is written.  The kernel arguments it would pass
go to ``registry.explain``, which walks the op's candidates: rejected for this platform (the
reasons the registry recorded at resolution), or outside the input limits of their capability
sheet for these arguments (``Backend.input_limits``), up to the one that runs them.
"""

from __future__ import annotations

from typing import Callable

from .core import _calls, registry
from .core.op_specs import OPS

__all__ = ["explain"]


def explain(fn: Callable | str, *args, **kwargs) -> registry.Explanation | None:
    """What runs ``fn(*args, **kwargs)`` (``fn``: a public function or its op name).  Invalid
    arguments raise the public function's own ``ValueError`` / ``TypeError``.  Returns None
    when the call launches no kernel (nothing to do, e.g. zero tokens)."""
    if isinstance(fn, str):
        from .tools.public_calls import public_function

        if fn not in OPS:
            raise ValueError(f"explain: unknown op {fn!r}; ops are {', '.join(OPS)}")
        fn = public_function(fn)
    elif not callable(fn):
        raise TypeError(f"explain: argument 'fn' expected a public dsv41 function or an op name, "
                        f"got {type(fn).__name__}")
    try:
        with _calls.capturing():
            fn(*args, **kwargs)
    except _calls.KernelCall as call:
        e = registry.explain(call.name, *call.args)
        if call.kernel is not None:  # the public function picked its kernel itself
            picked = next((b.name for b in registry._backends()
                           if call.name in b.kernels and b.load(call.name) is call.kernel), None)
            if picked is not None and picked != e.runs:
                e.steps.append((picked, f"runs: {getattr(fn, '__name__', fn)} prefers it"))
                e.runs = picked
        return e
    return None
