"""Calling an op through vLLM's name and comparing what it wrote (tests/vllm)."""

from __future__ import annotations

import importlib

import torch

from dsv41.integrations import vllm_plugin as vp
from golden import storage_bytes, view_bytes

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


def returned(result) -> list:
    """A return value as the list of tensors a golden case's ``out`` names."""
    if result is None:
        return []
    flat = []
    for r in result if isinstance(result, tuple) else (result,):
        if hasattr(r, "data") and hasattr(r, "scale") and not isinstance(r, torch.Tensor):
            flat.extend((r.data, r.scale))  # QuantizedActivation (vLLM's or dsv41's)
        elif isinstance(r, int):
            flat.append(torch.tensor(r))
        else:
            flat.append(r)
    return flat


def outputs(case_out: dict, args: dict, result) -> dict:
    """name -> tensor written or returned, for the names of a golden case's ``out``."""
    it = iter(returned(result))
    got = {}
    for key in case_out:
        t = args[key] if key in args else next(it)
        got[key] = t[0] if isinstance(t, tuple) else t
    return got


def differences(got: dict, want: dict) -> list[str]:
    """Whole-storage byte comparison (view bytes where the storages differ in size)."""
    problems = []
    for key, w in want.items():
        g = got[key]
        if storage_bytes(g).numel() == storage_bytes(w).numel():
            a, b = storage_bytes(g), storage_bytes(w)
        else:
            a, b = view_bytes(g), view_bytes(w)
        if not torch.equal(a, b):
            bad = (a != b).nonzero().flatten()
            problems.append(f"{key}: {bad.numel()} of {b.numel()} bytes differ (first offsets {bad[:6].tolist()})")
    return problems
