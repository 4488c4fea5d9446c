"""Shared fixtures and the conformance summary matrix printed at the end of the run."""

from __future__ import annotations

import collections
import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

if os.environ.get("TRITON_INTERPRET") == "1":
    # Must happen before any kernel runs: exact fp8/bf16 conversions and tl.fma.  With a
    # Triton the patch was not verified with, the interpreted implementations are skipped
    # (tests/impls.py says why) instead of failing collection.
    from triton_interp import enable_exact_interpreter, interpreter_unsupported_reason  # noqa: E402

    if interpreter_unsupported_reason() is None:
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
    from dsv41.core import registry

    registry.reset()
    yield monkeypatch
    registry.reset()


# --------------------------------------------------------------------------- test tiers
#
# ``DSV41_TEST_TIER=fast`` (what ``bash tests/run.sh`` uses) keeps a slice of the suite that
# still reaches every op on every implementation that runs here; ``full`` (the default for a
# plain ``pytest``, and ``bash tests/run.sh --full``) keeps everything.  The slice:
#  * matrix tests (an ``impl`` and a ``case``/``golden`` parameter): every case on the
#    reference and the cpu backend; for implementations run in Triton's interpreter, one case
#    per (op, implementation);
#  * other parametrized tests: the first parametrizations (in collection order) that together
#    take every value of every parameter at least once;
#  * the tests of FULL_ONLY: too slow for minutes on two cores, run in the full tier.
TIER = os.environ.get("DSV41_TEST_TIER", "full").strip() or "full"
if TIER not in ("fast", "full"):
    raise pytest.UsageError(f"DSV41_TEST_TIER must be 'fast' or 'full', got {TIER!r}")

FULL_ONLY = {
    "test_torch_compile_fullgraph_pipeline": "torch.compile of the whole pipeline (~80 s)",
    "test_aot_builds": "ahead-of-time builds for four GPU targets (~2 min)",
    "test_compile_all": "CuTe DSL ahead-of-time builds",
    "test_ptx_numerics": "CuTe DSL PTX builds",
    "test_inv_rope_golden": "interpreter runs of ~20 s each; the interpreter slice replays these vectors",
    "test_inv_rope_modes": "interpreter runs of ~6 s each; the conformance slice covers the modes",
    "test_rope_288_every_swept_shape": "every swept launch shape in the interpreter",
    "test_inv_rope_split_rows": "inverse-RoPE row splits in the interpreter (~30 s per implementation)",
    "test_bound_launch_matches_triton_for_every_launcher": "every Triton launcher compiled for sm_90 (~30 s)",
    "test_row_builder_swept_shapes": "56 launch shapes x every case of two row builders, interpreted (~30 s)",
}
# Where the interpreter slice takes one case of an op, take this one (the op's cheapest there).
FAST_PREFERRED = {"t1-decode", "inv_rope_noquant"}
CHEAP_IMPLS = ("reference", "cpu")


def _value_key(v):
    for attr in ("name", "id"):
        got = getattr(v, attr, None)
        if isinstance(got, str):
            return got
    return repr(v)


def _coverage_keys(item):
    params = getattr(getattr(item, "callspec", None), "params", {})
    impl = params.get("impl")
    subject = params.get("case") or params.get("golden")
    if impl is not None and subject is not None and getattr(subject, "op", None):
        if impl.name in CHEAP_IMPLS:
            return None  # always kept
        return {("op x impl", subject.op, impl.name)}
    return {(name, _value_key(v)) for name, v in params.items()}


def pytest_collection_modifyitems(config, items):
    if TIER == "full":
        return

    def preferred(item):
        params = getattr(getattr(item, "callspec", None), "params", {})
        subject = params.get("case") or params.get("golden")
        return getattr(subject, "name", None) in FAST_PREFERRED

    kept = set()
    covered: dict = collections.defaultdict(set)
    for item in sorted(items, key=lambda i: not preferred(i)):  # stable: preferred cases first
        fn = getattr(item, "originalname", item.name)
        if fn in FULL_ONLY:
            continue
        keys = _coverage_keys(item)
        seen = covered[(item.module.__name__ if item.module else "", fn)]
        if keys is None or not keys or not keys <= seen:
            kept.add(item.nodeid)
            seen.update(keys or ())
    keep = [i for i in items if i.nodeid in kept]
    drop = [i for i in items if i.nodeid not in kept]
    if drop:
        config.hook.pytest_deselected(items=drop)
        items[:] = keep


def pytest_report_header(config):
    return f"dsv41 test tier: {TIER}" + (" (DSV41_TEST_TIER=full or tests/run.sh --full for everything)" if TIER == "fast" else "")
