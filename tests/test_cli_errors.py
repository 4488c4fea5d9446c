"""Errors a person can act on: unknown DSV41_* variables, bad --device / DSV41_PLATFORM /
backend names (one line, exit 2), info's per-family summary, the missing-compiler warning."""

from __future__ import annotations

import logging
import os
import subprocess
import sys

import pytest
import torch

from dsv41.core import env, registry
from dsv41.backends.cpu import _build


def _cli(*args, env_vars=None):
    e = {k: v for k, v in os.environ.items() if not k.startswith("DSV41_BACKEND") and k != "DSV41_PLATFORM"}
    e.update(env_vars or {})
    # -P: the installed package, not the checkout's dsv41/ (whose backends install as dsv41.backends)
    safe_path = ["-P"] if sys.version_info >= (3, 11) else []
    return subprocess.run([sys.executable, *safe_path, "-m", "dsv41", *args], capture_output=True, text=True, env=e)


def test_unknown_variables_name_the_closest_valid_one():
    found = dict(env.unknown({
        "DSV41_BAKCEND": "cpu",
        "DSV41_BACKEND_rope_quant_insert": "cpu",
        "DSV41_BACKEND_ROPE_QUANT_INSERT": "cpu",  # valid
        "DSV41_PDL": "0",  # valid
        "DSV41_ZZZZZZZZZZ": "1",
        "PATH": "/bin",
    }))
    assert found == {
        "DSV41_BAKCEND": "DSV41_BACKEND",
        "DSV41_BACKEND_rope_quant_insert": "DSV41_BACKEND_ROPE_QUANT_INSERT",
        "DSV41_ZZZZZZZZZZ": None,
    }


def test_unknown_variables_are_reported_once(caplog, monkeypatch):
    monkeypatch.setenv("DSV41_BACKEND_quantize_and_insert_k_cache", "cpu")
    env.reset()
    with caplog.at_level(logging.WARNING, logger="dsv41"):
        env.check()
        env.check()
    lines = [r.getMessage() for r in caplog.records if "DSV41_BACKEND_quantize_and_insert_k_cache" in r.getMessage()]
    assert len(lines) == 1 and "DSV41_BACKEND_QUANTIZE_AND_INSERT_K_CACHE" in lines[0]
    env.reset()


def test_every_documented_variable_is_known():
    from dsv41.core.registry import OPS

    known = set(env.known_names())
    assert {"DSV41_BACKEND", "DSV41_PLATFORM", "DSV41_VALIDATE", "DSV41_PDL"} <= known
    assert {f"DSV41_BACKEND_{op.upper()}" for op in OPS} <= known


def test_cli_warns_about_a_misspelt_override():
    p = _cli("info", env_vars={"DSV41_BACKEND_rope_quant_insert": "cpu"})
    assert p.returncode == 0
    assert p.stderr.count("DSV41_BACKEND_rope_quant_insert") == 1
    assert "did you mean DSV41_BACKEND_ROPE_QUANT_INSERT" in p.stderr


@pytest.mark.parametrize("args, env_vars, needle", [
    (("info",), {"DSV41_PLATFORM": "nonsense"}, "DSV41_PLATFORM='nonsense'"),
    (("check",), {"DSV41_PLATFORM": "nonsense"}, "DSV41_PLATFORM='nonsense'"),
    (("bench", "--list"), {"DSV41_PLATFORM": "nonsense"}, "DSV41_PLATFORM='nonsense'"),
    (("check", "--device", "banana"), {}, "--device 'banana'"),
    (("bench", "--backend", "banana"), {}, "--backend 'banana'"),
])
def test_cli_bad_values_give_one_line_and_exit_2(args, env_vars, needle):
    p = _cli(*args, env_vars=env_vars)
    assert p.returncode == 2, (p.stdout, p.stderr)
    err = [line for line in p.stderr.splitlines() if line.strip()]
    assert len(err) == 1 and needle in err[0], p.stderr
    assert "Traceback" not in p.stderr


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_cli_check_cuda_without_a_gpu():
    p = _cli("check", "--device", "cuda")
    assert p.returncode == 2 and "no CUDA" in p.stderr and "Traceback" not in p.stderr
    assert len(p.stderr.strip().splitlines()) == 1


def test_bench_backend_accepts_family_names():
    from dsv41.tools.bench import _expand_backend_names

    assert _expand_backend_names(["cuda"]) == {"cuda:cutedsl", "cuda:triton"}
    assert _expand_backend_names(["cpu", "cuda:triton"]) == {"cpu", "cuda:triton"}
    assert all(_expand_backend_names([n]) for n in registry.backend_names())
    with pytest.raises(ValueError, match="valid names"):
        _expand_backend_names(["banana"])


def test_info_one_line_per_rejected_family():
    p = _cli("info", env_vars={"DSV41_PLATFORM": "cpu"})
    assert p.returncode == 0, p.stderr
    block = p.stdout.split("quantize_and_insert_k_cache: ")[1].split("\n")
    assert block[0] == "cpu"
    rejected = []
    for line in block[1:]:
        if not line.startswith("    "):
            break
        rejected.append(line)
    families = [line.split()[1].rstrip(":") for line in rejected]
    assert sorted(families) == sorted(set(families)) and "cuda" in families
    assert "needs vendor nvidia" in rejected[families.index("cuda")]
    verbose = _cli("info", "--verbose", env_vars={"DSV41_PLATFORM": "cpu"}).stdout
    assert "    cuda:triton: " in verbose and "    cuda:cutedsl: " in verbose


def test_missing_compiler_is_one_warning_naming_the_fix(monkeypatch, caplog):
    monkeypatch.setattr(_build, "_compiler", lambda: None)
    monkeypatch.setattr(_build, "_libs", {})
    monkeypatch.setattr(_build, "_errors", {})
    monkeypatch.setattr(_build, "_warned", False)
    with caplog.at_level(logging.WARNING, logger="dsv41"):
        for name in ("a", "b"):
            with pytest.raises(RuntimeError, match="no C\\+\\+ compiler"):
                _build.load(name, [])
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1
    msg = warnings[0].getMessage()
    assert "reference" in msg and "g++" in msg and "CXX" in msg
