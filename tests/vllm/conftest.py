"""tests/vllm: dsv41's vLLM plugin against an installed vLLM (the CI step .ci/vllm_plugin.sh).

Collected only when named on the command line (``pytest tests/vllm``), never as part of
``pytest tests`` / tests/run.sh: they need vLLM, and the tiers run without it.  Without vLLM
the modules skip, saying so.
"""

from __future__ import annotations

from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent


def _named_explicitly(config) -> bool:
    base = Path(config.invocation_params.dir)
    for arg in config.args:
        p = (base / arg.split("::")[0]).resolve()
        if p == HERE or HERE in p.parents:
            return True
    return False


def pytest_ignore_collect(collection_path, config):
    if not _named_explicitly(config):
        return True
    return None


@pytest.fixture(scope="session")
def exact_rsqrt_exp2():
    """Triton's interpreter computes fp32 ``rsqrt`` as ``1 / sqrt`` (two roundings) and ``exp2``
    with numpy's fp32 routine.  dsv41's contract is the exact value rounded once to fp32 (the
    GPU's ``rsqrt.approx`` / ``ex2.approx`` are the known set-D differences), so vLLM's kernels
    are run with that here: float64, then one rounding.  Test harness only."""
    import numpy as np

    try:
        from triton.runtime import interpreter as interp
    except ImportError:
        yield
        return
    B = interp.InterpreterBuilder
    saved = B.create_rsqrt, B.create_exp2

    def create_rsqrt(self, arg):
        if arg.data.dtype == np.float32:
            with np.errstate(all="ignore"):
                out = (1.0 / np.sqrt(arg.data.astype(np.float64))).astype(np.float32)
            return interp.TensorHandle(out, arg.dtype.scalar)
        return saved[0](self, arg)

    def create_exp2(self, arg):
        if arg.data.dtype == np.float32:
            with np.errstate(all="ignore"):
                out = np.exp2(arg.data.astype(np.float64)).astype(np.float32)
            return interp.TensorHandle(out, arg.dtype.scalar)
        return saved[1](self, arg)

    B.create_rsqrt, B.create_exp2 = create_rsqrt, create_exp2
    yield
    B.create_rsqrt, B.create_exp2 = saved


@pytest.fixture(scope="module")
def h200_interp_rules(exact_rsqrt_exp2):
    """Two interpreter rules under which vLLM's kernels write in the interpreter what the H200
    wrote in set D (helpers' oracle notes; tools/vllm_interp_vectors.py applies the same):

    1. float unary minus is ``0 - x``: the Triton that built set D emitted that (so -(+0) is +0,
       the NVFP4 gather's zero signs); Triton 3.9's interpreter uses a true negation;
    2. a symmetric ``tl.clamp(x, -m, m)`` maps NaN to +m: sm90's ``min.xorsign.abs`` on the GPU's
       positive NaN; the interpreter's fmax/fmin gives -m;
    3. fp32 ``exp2`` flushes a subnormal result to +0 (``ex2.approx.ftz``): a UE8M0 scale byte 0
       decodes to 0, not 2^-127.  Applied on top of ``exact_rsqrt_exp2``'s exact exp2.

    Test harness only; undone after the module."""
    import numpy as np

    try:
        from triton._C.libtriton import ir
        from triton.runtime import interpreter as interp
    except ImportError:
        yield
        return
    B = interp.InterpreterBuilder
    saved = B.create_fneg, B.create_clampf, B.create_exp2

    def create_fneg(self, arg):
        return self.unary_op(arg, lambda v: np.subtract(np.zeros_like(v), v))

    def create_clampf(self, arg, lo, hi, propagate_nans):
        out = saved[1](self, arg, lo, hi, propagate_nans)
        if propagate_nans == ir.PROPAGATE_NAN.NONE and np.all(lo.data == -hi.data):
            out.data[...] = np.where(np.isnan(arg.data), hi.data, out.data)
        return out

    def create_exp2(self, arg):
        out = saved[2](self, arg)
        if out.data.dtype == np.float32:
            tiny = np.finfo(np.float32).tiny
            out.data[...] = np.where(np.abs(out.data) < tiny, np.float32(0), out.data)
        return out

    B.create_fneg, B.create_clampf, B.create_exp2 = create_fneg, create_clampf, create_exp2
    yield
    B.create_fneg, B.create_clampf, B.create_exp2 = saved
