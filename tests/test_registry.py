"""Registry and platform probe: per-platform choices, overrides, reasons, once-only resolution."""

from __future__ import annotations

import json
import subprocess
import sys
import threading

import pytest
import torch

import dsv41
from dsv41.core import platform, registry

# What the design intends each platform to run (DSV41_PLATFORM injection):
# NVIDIA -> the Triton kernels (CuTe DSL where cutlass imports and the op has one),
# AMD -> rocm (either fp8 flavour), Intel -> xpu, CPU -> the cpu backend.
INTENDED = {"sm_90": "cuda:triton", "sm_100": "cuda:triton", "gfx942": "rocm", "gfx950": "rocm", "xpu": "xpu", "cpu": "cpu"}


def _selected(op):
    res = registry.resolve(op)
    return res.selected_for(platform.probe().device_type)[0]


@pytest.mark.parametrize("plat", sorted(INTENDED))
@pytest.mark.parametrize("op", registry.OPS)
def test_platform_choice(plat, op, fresh_registry):
    fresh_registry.setenv("DSV41_PLATFORM", plat)
    fresh_registry.delenv("DSV41_BACKEND", raising=False)
    sel = _selected(op)
    want = INTENDED[plat]
    names = [b.name for b in registry.candidates(op, platform.probe())]
    cute = registry.candidates(op, platform.probe())[names.index("cuda:cutedsl")]
    # CuTe where it runs, unless a measurement on this arch ranked Triton above it
    if plat.startswith("sm_") and not cute.reasons(op, platform.probe()) \
            and names.index("cuda:cutedsl") < names.index("cuda:triton"):
        want = "cuda:cutedsl"
    assert sel == want, registry.resolve(op).rejected


def test_measured_order_is_followed(fresh_registry):
    from dsv41.backends import MEASURED_ORDER

    for (op, arch), ahead in MEASURED_ORDER.items():
        fresh_registry.setenv("DSV41_PLATFORM", arch)
        names = [b.name for b in registry.candidates(op, platform.probe())]
        assert names[: len(ahead)] == list(ahead), (op, arch, names)


def test_every_backend_is_reachable_for_every_op_it_implements():
    """A backend missing from an op's order would never run for it, silently."""
    from dsv41.backends import ALL_BACKENDS, DEFAULT_ORDER, MEASURED_ORDER, order_for

    names = [cls.name for cls in ALL_BACKENDS]
    assert sorted(names) == sorted(DEFAULT_ORDER) and len(set(DEFAULT_ORDER)) == len(DEFAULT_ORDER)
    archs = {a for cls in ALL_BACKENDS for a in cls.archs} | {a for _, a in MEASURED_ORDER} | {"cpu", "xpu"}
    for cls in ALL_BACKENDS:
        for op in cls.kernels:
            assert op in registry.OPS, (cls.name, op)
            for arch in archs:
                order = order_for(op, arch)
                assert cls.name in order and len(set(order)) == len(order), (cls.name, op, arch, order)
    for (op, _), ahead in MEASURED_ORDER.items():
        for n in ahead:
            cls = next(c for c in ALL_BACKENDS if c.name == n)
            assert op in cls.kernels, (op, n)


@pytest.mark.parametrize("plat,native", [("gfx942", "e4m3fnuz"), ("gfx950", "e4m3fn"), ("sm_90", "e4m3fn"), ("xpu", "e4m3fn")])
def test_native_fp8_flavour(plat, native, fresh_registry):
    fresh_registry.setenv("DSV41_PLATFORM", plat)
    assert platform.probe().to_json()["native_fp8"] == [native]


def test_unknown_platform_is_rejected(fresh_registry):
    fresh_registry.setenv("DSV41_PLATFORM", "sm_0")
    with pytest.raises(ValueError, match="DSV41_PLATFORM"):
        platform.probe()


def test_forced_unknown_name_lists_valid_names(fresh_registry):
    fresh_registry.setenv("DSV41_BACKEND", "nonsense")
    with pytest.raises(registry.BackendUnavailable) as e:
        registry.resolve("quantize_and_insert_k_cache")
    for name in ("cuda", "cuda:triton", "cuda:cutedsl", "rocm", "xpu", "cpu", "reference"):
        assert name in str(e.value)


def test_forced_cuda_on_cpu_machine_gives_reasons(fresh_registry):
    fresh_registry.delenv("DSV41_PLATFORM", raising=False)
    fresh_registry.setenv("DSV41_BACKEND_ROPE_QUANT_INSERT", "cuda")
    with pytest.raises(registry.BackendUnavailable, match="needs vendor nvidia"):
        registry.resolve("rope_quant_insert")
    # other ops are not affected by a per-op override
    assert registry.resolve("quantize_and_insert_k_cache").forced is None


def test_forced_reference_for_all_ops(fresh_registry):
    fresh_registry.setenv("DSV41_BACKEND", "reference")
    for op in registry.OPS:
        res = registry.resolve(op)
        assert res.selected_for("cpu")[0] == "reference"
        assert all("forced" in r[0] for n, r in res.rejected.items())


def test_forced_backend_rejects_other_device(fresh_registry):
    fresh_registry.delenv("DSV41_PLATFORM", raising=False)
    fresh_registry.setenv("DSV41_BACKEND", "cpu")
    if "quantize_and_insert_k_cache" not in dsv41.backends.cpu.CpuBackend.kernels:
        pytest.skip("cpu backend has no quantize kernel")
    with pytest.raises(registry.BackendUnavailable, match="no implementation runs on meta"):
        registry.kernel("quantize_and_insert_k_cache", "meta")


def test_cpu_tensors_on_gpu_platform_use_a_cpu_implementation(fresh_registry):
    fresh_registry.setenv("DSV41_PLATFORM", "sm_90")
    res = registry.resolve("compute_global_topk_indices_and_lens")
    assert res.selected_for("cpu")[0] in ("cpu", "reference")
    out, lens = dsv41.compute_global_topk_indices_and_lens(
        torch.tensor([[0, 70, -1]], dtype=torch.int32), torch.zeros(1, dtype=torch.int32),
        torch.tensor([[4, 9]], dtype=torch.int32), 64, torch.ones(1, dtype=torch.bool))
    assert out.tolist() == [[256, 582, -1]] and lens.tolist() == [2]


def test_resolution_happens_once_across_threads(fresh_registry):
    calls = []
    real = registry._resolve
    fresh_registry.setattr(registry, "_resolve", lambda op: calls.append(op) or real(op))
    results, errors = [], []

    def work():
        try:
            out, lens = dsv41.compute_global_topk_indices_and_lens(
                torch.tensor([[1, 2]], dtype=torch.int32), torch.zeros(1, dtype=torch.int32),
                torch.tensor([[3]], dtype=torch.int32), 64, torch.ones(1, dtype=torch.bool))
            results.append(out.tolist())
        except Exception as exc:  # pragma: no cover - reported below
            errors.append(exc)

    threads = [threading.Thread(target=work) for _ in range(16)]
    [t.start() for t in threads]
    [t.join() for t in threads]
    assert not errors
    assert calls == ["compute_global_topk_indices_and_lens"]
    assert results == [[[193, 194]]] * 16


def _cli(*args, env=None):
    import os

    e = dict(os.environ)
    e.pop("DSV41_BACKEND", None)
    e.update(env or {})
    return subprocess.run([sys.executable, "-m", "dsv41", *args], capture_output=True, text=True, env=e)


def test_cli_info_json_lists_every_op():
    p = _cli("info", "--json")
    assert p.returncode == 0, p.stderr
    d = json.loads(p.stdout)
    assert set(d["ops"]) == set(registry.OPS)
    for op, o in d["ops"].items():
        assert o["selected"]
        assert o["selected"] not in o["candidates"]
        assert all(isinstance(r, list) and r for r in o["candidates"].values())
    assert {"vendor", "arch", "native_fp8", "packages"} <= set(d["platform"])


def test_cli_info_forced_nonsense_fails():
    p = _cli("info", env={"DSV41_BACKEND": "nonsense"})
    assert p.returncode != 0 and "valid names" in p.stderr and "cuda:triton" in p.stderr


def test_cli_info_forced_cuda_for_one_op_fails():
    p = _cli("info", env={"DSV41_BACKEND_DEQUANTIZE_AND_GATHER_K_CACHE": "cuda", "DSV41_PLATFORM": "cpu"})
    assert p.returncode != 0 and "dequantize_and_gather_k_cache" in p.stderr and "nvidia" in p.stderr


def test_import_creates_no_gpu_context():
    code = "import torch, dsv41; import dsv41.backends; print(torch.cuda.is_initialized())"
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert p.returncode == 0 and p.stdout.strip() == "False", p.stderr


def test_op_spec_binds_kernel_arguments_by_name():
    from dsv41.core.op_specs import spec

    s = spec("compute_global_topk_indices_and_lens")
    a = s.bind(*range(7))  # compact takes its declared default
    assert a.topk_indices == 0 and a.topk_lens == 6 and a.compact is False
    assert tuple(a) == (*range(7), False)
    assert s.bind(*range(7), compact=True).compact is True
    with pytest.raises(TypeError):
        s.bind(*range(3))
