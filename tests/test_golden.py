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
from dsv41 import registry
from dsv41.reference import ReferenceBackend
from golden import SET_FILES, clone_value, load_set, storage_bytes, view_bytes
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


def _returned(result) -> list:
    """The op's return value as the list of tensors a case's ``out`` names (a
    ``QuantizedActivation`` is its data and scale; a plain int is a 0-d tensor)."""
    if result is None:
        return []
    items = result if isinstance(result, tuple) else (result,)
    flat = []
    for r in items:
        if isinstance(r, dsv41.QuantizedActivation):
            flat.extend((r.data, r.scale))
        elif isinstance(r, int):
            flat.append(torch.tensor(r))
        else:
            flat.append(r)
    return flat


def _compare(name, got, want):
    if storage_bytes(got).numel() == storage_bytes(want).numel():
        g, w = storage_bytes(got), storage_bytes(want)
    else:
        g, w = view_bytes(got), view_bytes(want)
    if not torch.equal(g, w):
        bad = (g != w).nonzero().flatten()
        return f"{name}: {bad.numel()} of {w.numel()} bytes differ (first offsets {bad[:8].tolist()})"
    return None


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
    returned = iter(_returned(result))
    problems = []
    for key, want in golden.out.items():
        got = args[key] if key in args else next(returned)
        if isinstance(got, tuple):
            got = got[0]
        p = _compare(key, got, want)
        if p:
            problems.append(p)
    assert not problems, "; ".join(problems)
