"""The conformance matrix: op × implementation × case, bytes compared with the reference.

Every case (``dsv41.tools.conformance.CASES``) is run by the reference and by each
registered implementation on clones of the same arguments; the *whole storage*
of every written tensor must be identical, so a stray write into the canary
bytes around the target slots (page padding, neighbouring slots, rows outside
the gather window) fails too.  Implementations that cannot run here are
skipped with the registry's reasons.
"""

from __future__ import annotations

import pytest
import torch

from dsv41.tools.conformance import CASES, _on, clone_args, written_bytes
from dsv41.reference import ReferenceBackend
from impls import implementations

IMPLS = implementations()
REF = ReferenceBackend()


def _run_both(impl, case, args):
    """(reference outputs, ``impl``'s outputs) of ``case`` on copies of ``args``; the device
    copy keeps the same views (page padding, offsets)."""
    want = clone_args(args)
    REF.load(case.op)(*want)
    return want, _run(impl, case, args)


def _run(impl, case, args):
    got = _on(impl.device, clone_args(args))
    impl.kernel(case.op)(*got)
    if impl.device not in ("cpu",):
        getattr(torch, impl.device).synchronize()
    return got


def _mismatch_report(name, got, want):
    diff = (got != want).nonzero().flatten()
    return f"{name}: {diff.numel()} of {want.numel()} bytes differ, first at byte offsets {diff[:8].tolist()}"


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
@pytest.mark.parametrize("impl", IMPLS, ids=[i.name for i in IMPLS])
def test_conformance(case, impl):
    why = impl.skip_reason(case.op)
    if why:
        pytest.skip(why)
    args = case.build("cpu")
    want, got = _run_both(impl, case, args)
    problems = []
    for i in case.writes:
        if want[i] is None:
            continue
        w, g = written_bytes(want[i]), written_bytes(got[i])
        if w.numel() != g.numel() or not torch.equal(w, g):
            problems.append(_mismatch_report(f"arg {i}", g, w))
    assert not problems, "; ".join(problems)


MXFP4_Q = [c for c in CASES if c.op == "fused_indexer_q_rope_quant" and c.id.split("[")[-1].startswith("mxfp4")]


@pytest.mark.parametrize("case", MXFP4_Q, ids=[c.id for c in MXFP4_Q])
@pytest.mark.parametrize("impl", IMPLS, ids=[i.name for i in IMPLS])
def test_indexer_q_scale_as_int32_words(case, impl):
    """The MXFP4 indexer Q's scale output may be the uint8 [T, H, D/32] codes or the same bytes
    as int32 words ([T, H] for D = 128, vLLM's return form, which the public function
    allocates): every implementation writes the reference's bytes into both."""
    why = impl.skip_reason(case.op)
    if why:
        pytest.skip(why)
    args = case.build("cpu")
    t, h, nb = args[9].shape
    words = torch.full((t, h) if nb == 4 else (t, h, nb // 4), -1, dtype=torch.int32)
    want = clone_args(args)  # the reference writes the uint8 codes
    REF.load(case.op)(*want)
    got = _run(impl, case, [*args[:9], words, *args[10:]])
    g = got[9].cpu().contiguous().view(torch.uint8).reshape(-1)
    assert torch.equal(g, want[9].contiguous().reshape(-1)), _mismatch_report("q_scale_out", g, want[9].reshape(-1))
    for i in (8, 10):
        assert torch.equal(written_bytes(got[i]).cpu(), written_bytes(want[i])), f"arg {i} differs"
