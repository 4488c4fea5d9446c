"""The ``DSV41_*`` environment variables dsv41 reads, and a check for names it does not know.

A misspelt override (``DSV41_BAKCEND=cpu``, ``DSV41_BACKEND_rope_quant_insert=cpu``) would
otherwise be ignored without a word.  ``check()`` runs once, on the first op resolution (and
in every CLI command), and logs one WARNING per unknown name with the closest known one.
"""

from __future__ import annotations

import difflib
import logging
import os
import threading

__all__ = ["VARIABLES", "known_names", "unknown", "check", "reset"]

log = logging.getLogger("dsv41")

# name -> what it does (README "Dispatch and overrides", docs/gpu.md, tests/run.sh).
VARIABLES = {
    "DSV41_BACKEND": "force one backend for every op",
    "DSV41_PLATFORM": "replace the hardware probe (sm_90, sm_100, sm_120, gfx942, gfx950, xpu, cpu)",
    "DSV41_VALIDATE": "1: check every index against its bound before the kernel runs (synchronizes)",
    "DSV41_EAGER_OPS": "0: call every kernel through torch.ops.dsv41 (default: eager calls go direct)",
    "DSV41_HOSTILE_MEM_GB": "tests: memory limit of a hostile-index child process over its server",
    "DSV41_PDL": "0: no programmatic dependent launch on NVIDIA",
    "DSV41_CACHE_DIR": "where the CPU kernels are built (default ~/.cache/dsv41)",
    "DSV41_CPU_MARCH": "-march of the CPU build (default native; none: portable)",
    "DSV41_CUTEDSL_SLOW_LAUNCH": "1: launch CuTe DSL kernels through the DSL's own argument marshalling",
    "DSV41_REPLAY": "0: no replayed launches (every eager Triton call runs its launcher)",
    "DSV41_TRITON_SLOW_LAUNCH": "1: launch Triton kernels through Triton's own JITFunction.run (no bound launcher)",
    "DSV41_VLLM_OPS": "vLLM plugin: which vLLM op names to route to dsv41 (all, none, or a comma list)",
    # test and benchmark harness
    "DSV41_VECTORS": "tests: where the golden vectors are",
    "DSV41_TEST_TIER": "tests: fast or full",
    "DSV41_FUZZ_PROFILE": "tests: hypothesis profile (fast, ci, long)",
    "DSV41_TEST_EXPECT_PORTABLE": "tests: internal, the portable CPU build's child run",
    "DSV41_TUNE_SWEEP": "tests: run the launch-shape sweep test",
    "DSV41_BENCH": "tests: run the GPU bench test",
    "DSV41_BENCH_OPS": "tests: GPU bench test op filter",
    "DSV41_BENCH_CONFIGS": "tests: GPU bench test launch configurations",
}
PER_OP_PREFIX = "DSV41_BACKEND_"


def known_names() -> list[str]:
    from .registry import OPS

    return sorted(VARIABLES) + [PER_OP_PREFIX + op.upper() for op in OPS]


def unknown(environ=None) -> list[tuple[str, str | None]]:
    """(name, closest known name or None) for every ``DSV41_*`` variable dsv41 does not read."""
    environ = os.environ if environ is None else environ
    known = known_names()
    known_set = set(known)
    out = []
    for name in sorted(environ):
        if not name.upper().startswith("DSV41_") or name in known_set:
            continue
        upper = name.upper()
        if upper in known_set:
            out.append((name, upper))
            continue
        close = difflib.get_close_matches(upper, known, n=1, cutoff=0.6)
        out.append((name, close[0] if close else None))
    return out


_lock = threading.Lock()
_checked = False


def check(environ=None) -> list[tuple[str, str | None]]:
    """Log one WARNING per unknown ``DSV41_*`` variable, the first time it is called."""
    global _checked
    with _lock:
        if _checked:
            return []
        _checked = True
    found = unknown(environ)
    for name, close in found:
        hint = f"; did you mean {close}?" if close else ""
        log.warning("dsv41: environment variable %s is not one dsv41 reads, it has no effect%s", name, hint)
    return found


def reset() -> None:
    """Check again on the next call (tests that change the environment)."""
    global _checked
    with _lock:
        _checked = False
