"""Calling an op through vLLM's name and comparing what it wrote (tests/vllm)."""

from __future__ import annotations

import importlib

from dsv41.integrations import vllm_plugin as vp
from golden import differences, outputs, returned  # noqa: F401  (the comparison helpers, re-exported)

V41 = vp.V41


def vllm_function(op: str):
    """The function a vLLM 0.33 call site reaches for ``op`` right now: the V4.1 ops package's
    attribute where it has one, else the submodule that defines it."""
    pkg = importlib.import_module(V41)
    if hasattr(pkg, op):
        return getattr(pkg, op)
    t = next(t for t in vp.KNOWN["0.33.0"].targets if t.name == op and t.module.startswith(V41))
    return getattr(importlib.import_module(t.module), op)


def dsv41_function(op: str):
    t = next(t for t in vp.KNOWN["0.33.0"].targets if t.name == op)
    return getattr(importlib.import_module(t.dsv41), op)
