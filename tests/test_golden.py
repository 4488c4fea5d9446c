"""vLLM's own bytes (golden vectors written on an H200) through every implementation.

Each case replays the public op with vLLM's arguments; the registry's kernel
lookup is pointed at one implementation at a time.  In-place buffers are compared
over their whole backing storage (page padding and canaries included), returned
tensors over their buffers.
"""

from __future__ import annotations

import inspect

import pytest
import torch

import dsv41
from dsv41.core import registry
from dsv41.reference import ReferenceBackend
from golden import SET_FILES, clone_value, differences, load_set, outputs
from impls import Impl, implementations

GOLDEN, MISSING = [], {}
for _set in SET_FILES:
    try:
        GOLDEN.extend(load_set(_set))
    except FileNotFoundError as exc:
        MISSING[_set] = str(exc)
IMPLS = [Impl("reference", ReferenceBackend(), "cpu")] + implementations()


@pytest.mark.parametrize("set_name", sorted(SET_FILES))
def test_vectors_present(set_name):
    """Parity with vLLM is checked in every clone: a missing archive fails, it never skips."""
    assert set_name not in MISSING, MISSING.get(set_name)


def _param(g):
    marks = ()
    if g.known_difference:
        marks = (pytest.mark.xfail(strict=True, reason=g.known_difference),)
    return pytest.param(g, id=g.id, marks=marks)


@pytest.mark.parametrize("golden", [_param(g) for g in GOLDEN])
@pytest.mark.parametrize("impl", IMPLS, ids=[i.name for i in IMPLS])
def test_golden_vector(golden, impl, monkeypatch):
    if golden.op in registry.OPS:
        why = impl.skip_reason(golden.op)
        if why:
            pytest.skip(why)
        kern = impl.kernel(golden.op)
        monkeypatch.setattr(registry, "kernel", lambda op, dev: kern)
    elif impl.name != "reference":
        pytest.skip(f"{golden.op} is a host-side helper (no kernel): checked once, under reference")
    fn = getattr(dsv41, golden.op)
    args = {k: clone_value(v, impl.device) for k, v in golden.args.items()}
    kw_only = {n for n, p in inspect.signature(fn).parameters.items() if p.kind is p.KEYWORD_ONLY}
    pos = {k: v for k, v in args.items() if k not in kw_only}
    result = fn(**pos, **{k: args[k] for k in kw_only if k in args}, **golden.call_kwargs(fn))
    if impl.device != "cpu":
        getattr(torch, impl.device).synchronize()
    problems = differences(outputs(golden.out, args, result), golden.out)
    assert not problems, "; ".join(problems)
