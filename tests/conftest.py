"""Shared fixtures and the conformance summary matrix printed at the end of the run."""

from __future__ import annotations

import collections
import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

if os.environ.get("TRITON_INTERPRET") == "1":
    # Must happen before any kernel runs: exact fp8/bf16 conversions and tl.fma.
    from triton_interp import enable_exact_interpreter  # noqa: E402

    enable_exact_interpreter()

MATRIX = collections.defaultdict(collections.Counter)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    rep = outcome.get_result()
    params = getattr(getattr(item, "callspec", None), "params", {})
    impl, subject = params.get("impl"), params.get("case") or params.get("golden")
    if impl is not None and subject is not None and (rep.when == "call" or rep.skipped):
        impl = impl.name
        op = subject.op
        MATRIX[(op, impl)][rep.outcome] += 1


def pytest_terminal_summary(terminalreporter):
    if not MATRIX:
        return
    impls = sorted({i for _, i in MATRIX})
    ops = sorted({o for o, _ in MATRIX})
    tr = terminalreporter
    tr.section("conformance matrix (passed/failed/skipped cases, bytes vs reference and golden vectors)")
    w = max(len(o) for o in ops) + 2
    tr.write_line("op".ljust(w) + "".join(i.ljust(22) for i in impls))
    tot = collections.Counter()
    for o in ops:
        cells = []
        for i in impls:
            c = MATRIX.get((o, i), collections.Counter())
            tot.update(c)
            cells.append(f"{c['passed']}/{c['failed']}/{c['skipped']}".ljust(22))
        tr.write_line(o.ljust(w) + "".join(cells))
    tr.write_line(f"total: {tot['passed']} passed, {tot['failed']} failed, {tot['skipped']} skipped")


@pytest.fixture
def fresh_registry(monkeypatch):
    """Registry and platform probe recomputed for the test (env changes take effect)."""
    from dsv41 import registry

    registry.reset()
    yield monkeypatch
    registry.reset()
