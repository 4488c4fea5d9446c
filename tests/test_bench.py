"""``python -m dsv41 bench`` (dsv41.tools.bench.main): a tiny run, its JSON records and its table."""

from __future__ import annotations

import json
import math
import sys

import pytest

from dsv41.tools import bench

CHEAP_OPS = ("compute_global_topk_indices_and_lens", "combine_topk_swa_indices")
KEYS = {
    "op", "variant", "name", "backend", "tokens", "seconds", "bytes", "gbps", "copy_gbps",
    "fraction_of_copy", "speedup_vs_reference", "graph_seconds", "copy_graph_seconds",
    "graph_fraction_of_copy", "host_seconds", "host_public_seconds",
    "timed_calls", "device",
}
POSITIVE = ("seconds", "bytes", "gbps", "copy_gbps", "fraction_of_copy")
POSITIVE_OR_NULL = ("speedup_vs_reference", "graph_seconds", "copy_graph_seconds", "graph_fraction_of_copy",
                    "host_seconds", "host_public_seconds")


def _positive(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x) and x > 0


def test_bench_json_schema(tmp_path, capsys):
    path = tmp_path / "bench.json"
    rc = bench.main(["--tokens", "8", "--op", *CHEAP_OPS, "--repeats", "3", "--json", str(path)])
    assert rc == 0
    records = json.loads(path.read_text())
    assert isinstance(records, list) and records
    seen = set()
    for r in records:
        assert KEYS <= set(r), f"missing keys {KEYS - set(r)}"
        assert r["op"] in CHEAP_OPS
        assert r["name"] == (r["op"] if r["variant"] is None else f"{r['op']} [{r['variant']}]")
        assert r["tokens"] == 8
        assert isinstance(r["bytes"], int)
        for k in POSITIVE:
            assert _positive(r[k]), (k, r[k])
        for k in POSITIVE_OR_NULL:
            assert r[k] is None or _positive(r[k]), (k, r[k])
        assert math.isclose(r["gbps"], r["bytes"] / r["seconds"] / 1e9, rel_tol=1e-9)
        assert math.isclose(r["fraction_of_copy"], r["gbps"] / r["copy_gbps"], rel_tol=1e-9)
        assert isinstance(r["backend"], str) and r["backend"]
        assert isinstance(r["timed_calls"], int) and r["timed_calls"] >= 1
        seen.add((r["op"], r["backend"]))
    # The reference runs everywhere: its rows exist and it is its own baseline.
    for op in CHEAP_OPS:
        assert (op, "reference") in seen
    for r in records:
        if r["backend"] == "reference":
            assert r["speedup_vs_reference"] == pytest.approx(1.0)
        else:
            assert _positive(r["speedup_vs_reference"])
    out = capsys.readouterr().out
    assert "frac_copy" in out and "vs_ref" in out and "host_us" in out and "call_us" in out
    for op in CHEAP_OPS:
        assert op in out
    # decode sizes: wall time per call of the kernel on every implementation, and of the public
    # function for the implementation the registry selects (the public call does more)
    plat = bench._platform.probe()
    for r in records:
        assert _positive(r["host_seconds"])
        kernels = {i.name: i.fn for i in bench._implementations(r["op"], plat, "cpu")[0]}
        selected = kernels[r["backend"]] is bench.registry.kernel(r["op"], "cpu")
        assert (r["host_public_seconds"] is not None) == selected, r["backend"]


def test_bench_profile_needs_cuda(capsys):
    """--profile is for ``ncu --profile-from-start off`` on a CUDA device; elsewhere it says so."""
    assert bench.main(["--profile", "--device", "cpu", "--op", CHEAP_OPS[0], "--tokens", "8"]) == 2
    assert "--profile needs --device cuda" in capsys.readouterr().err


def test_bench_variant_selection():
    names = [v.name for v in bench._select_variants(["quantize_and_insert_k_cache:528"])]
    assert names == ["quantize_and_insert_k_cache [528]"]
    names = [v.name for v in bench._select_variants(["dequantize_and_gather_k_cache"])]
    assert names == [f"dequantize_and_gather_k_cache [{w}]" for w in ("584", "528", "288")]
    with pytest.raises(ValueError, match="unknown op"):
        bench._select_variants(["no_such_op"])
    assert bench.main(["--op", "no_such_op"]) == 2
    # Every registry op has at least one benchmark variant.
    assert {v.op for v in bench.VARIANTS} == set(bench.registry.OPS)


def test_bench_plot_without_matplotlib(tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib -> ImportError
    rc = bench.main(["--tokens", "1", "--op", "combine_topk_swa_indices", "--backend", "reference",
                     "--repeats", "1", "--plot", str(tmp_path / "p.png")])
    assert rc == 2
    assert "matplotlib" in capsys.readouterr().err
    assert not (tmp_path / "p.png").exists()
