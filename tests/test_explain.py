"""``dsv41.explain``: the implementation a public call runs, and why the candidates before it
do not -- platform reasons from the resolution, per-input reasons from the sheets'
``input_limits`` (the same functions the kernels consult)."""

from __future__ import annotations

import pytest
import torch

import dsv41
from dsv41.tools import bench
from dsv41.core import platform, registry
from dsv41.tools.conformance import CASES, clone_args, written_bytes
from dsv41.tools.public_calls import public_call

FIRST = {}
for _c in CASES:
    FIRST.setdefault(_c.op, _c)


@pytest.mark.parametrize("variant", bench.VARIANTS, ids=[v.name for v in bench.VARIANTS])
def test_explain_names_the_selected_kernel_and_writes_nothing(variant):
    case = variant.build(bench._Gen(torch.device("cpu"), 1), 8, platform.probe())
    fn, args, kwargs = public_call(variant.op, clone_args(case.args))
    before = [written_bytes(a) if isinstance(a, torch.Tensor) else None for a in args]
    e = dsv41.explain(fn, *args, **kwargs)
    assert e.op == variant.op and e.device_type == "cpu"
    assert e.runs == registry.resolve(variant.op).selected_for("cpu")[0]
    assert e.steps[-1] == (e.runs, "runs")
    assert f"runs on {e.runs}" in str(e)
    for a, b in zip(args, before):
        if b is not None:
            assert torch.equal(written_bytes(a), b)


def test_explain_by_op_name_and_bad_input():
    k = torch.randn(2, 512).to(torch.bfloat16)
    cache = torch.zeros(1, 64, 528, dtype=torch.uint8)
    e = dsv41.explain("quantize_and_insert_k_cache", k, cache, torch.tensor([0, 1]), 64, True, False, 528)
    assert e.runs == "cpu"
    # no tokens: no kernel to run
    assert dsv41.explain("quantize_and_insert_k_cache", k, cache, torch.tensor([], dtype=torch.int64), 64, True, False, 528) is None
    with pytest.raises(ValueError, match="bytes_per_token"):
        dsv41.explain("quantize_and_insert_k_cache", k, cache, torch.tensor([0]), 64, True, False, 100)
    with pytest.raises(ValueError, match="unknown op"):
        dsv41.explain("no_such_op")
    with pytest.raises(TypeError, match="'fn'"):
        dsv41.explain(3)
    # after explain, calls run their kernels again
    dsv41.quantize_and_insert_k_cache(k, cache, torch.tensor([0, 1]), 64, True, False, 528)
    assert cache.any()


def _gather_args(width, fnuz, pages=2):
    out = torch.zeros(1, 8, 512, dtype=torch.bfloat16)
    cache = torch.zeros(pages, 64, width, dtype=torch.uint8)
    return (out, cache, torch.tensor([8], dtype=torch.int32), None,
            torch.tensor([[0, 1]], dtype=torch.int32), 64, 0, fnuz, False)


@pytest.mark.parametrize("arch", ["sm_90", "sm_100"])
def test_input_limits_on_nvidia_platforms(arch, fresh_registry):
    """Where the CuTe gather is selected (SM100: measured ahead of Triton) it serves OCP 584 /
    528 caches; an FNUZ cache, the 288 record or an empty cache is outside its limits and
    runs on the Triton kernel its launcher hands it to.  On SM90 Triton is selected and runs
    everything."""
    fresh_registry.setenv("DSV41_PLATFORM", arch)
    fresh_registry.delenv("DSV41_BACKEND", raising=False)
    op = "dequantize_and_gather_k_cache"
    selected = registry.resolve(op).selected_for("cuda")[0]
    if arch == "sm_100" and registry.candidates(op, platform.probe())[0].reasons(op, platform.probe()):
        pytest.skip("cuda:cutedsl cannot run here (CuTe DSL not importable)")
    assert selected == {"sm_90": "cuda:triton", "sm_100": "cuda:cutedsl"}[arch]
    ok = registry.explain(op, *_gather_args(584, False), device_type="cuda")
    assert ok.runs == selected and ok.steps[-1] == (selected, "runs")
    for args in (_gather_args(584, True), _gather_args(288, False), _gather_args(584, False, pages=0)):
        e = registry.explain(op, *args, device_type="cuda")
        assert e.runs == "cuda:triton", str(e)
        if selected == "cuda:cutedsl":
            name, why = e.steps[-2]
            assert name == "cuda:cutedsl" and "hands the call to cuda:triton" in why[-1], str(e)


def test_kernels_consult_their_declared_limits():
    """The CuTe launchers hand a call to Triton exactly when the sheet's limit function gives a
    reason (one predicate for dispatch and for explain)."""
    import inspect

    from dsv41.backends import ALL_BACKENDS

    for cls in ALL_BACKENDS:
        b = cls()
        for op, where in b.input_limits.items():
            assert op in b.kernels and b.input_fallback, (b.name, op)
            module, _, fn_name = where.partition(":")
            assert fn_name in inspect.getsource(b.load(op)), (b.name, op)


def test_explain_stops_before_a_relayout_writes():
    """transcode_k_cache between layouts moves bytes around its kernel: explain stops first."""
    from dsv41.transcode import transcode_k_cache

    src = torch.randint(0, 255, (3, 16, 528), dtype=torch.uint8)
    dst = torch.zeros_like(src)
    e = dsv41.explain(transcode_k_cache, src, dst, torch.tensor([0, 2]), False, False, 16,
                      src_v41_layout="interleaved", dst_v41_layout="paged")
    assert e.op == "transcode_k_cache" and e.runs == "cpu"
    assert not dst.any()
    transcode_k_cache(src, dst, torch.tensor([0, 2]), False, False, 16,
                      src_v41_layout="interleaved", dst_v41_layout="paged")
    assert dst.any()


def test_explain_a_function_that_picks_its_kernel():
    """dequantize_and_gather_k_cache_triton picks a Triton kernel where one runs (none on a CPU
    machine without the interpreter: the selected one); explain names it and writes nothing."""
    out, cache, seq, gl, table, bs, off, fnuz, _ = _gather_args(528, False)
    cache.copy_(torch.randint(0, 120, cache.shape, dtype=torch.uint8))  # a real gather writes non-zeros
    e = dsv41.explain(dsv41.dequantize_and_gather_k_cache_triton, out, cache, seq, gl, table, bs, off, fnuz)
    kernel = registry.preferred_kernel("dequantize_and_gather_k_cache", "cpu", "triton_source")
    names = [b.name for b in registry._backends() if b.kernels.get("dequantize_and_gather_k_cache")
             and b.load("dequantize_and_gather_k_cache") is kernel]
    assert e.runs in names
    assert not out.any()
    dsv41.dequantize_and_gather_k_cache_triton(out, cache, seq, gl, table, bs, off, fnuz)
    assert out.any()
