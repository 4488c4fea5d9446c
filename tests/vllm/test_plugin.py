"""(a) vLLM's own plugin loader routes the compatible names to dsv41 everywhere they are held
and keeps the rest, one log line per op; (b) DSV41_VLLM_OPS chooses.  Each scenario runs in a
fresh process (vLLM loads plugins once per process)."""

from __future__ import annotations

import functools
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("vllm.plugins", reason="tests/vllm needs vLLM installed (bash .ci/vllm_plugin.sh)")

from dsv41.integrations import vllm_plugin as vp  # noqa: E402

HERE = Path(__file__).resolve().parent
V41 = "vllm.models.deepseek_v41.common.ops"
V4 = "vllm.models.deepseek_v4.common.ops"

# vLLM 0.33.0 names dsv41 keeps by default, and the start of each reason.
KEPT_0_33 = {
    f"{V41}.query_quant.can_fuse_query_quant": "decides from vLLM's own layer",
    f"{V41}.query_quant.mxfp8_scale_offset": "vLLM's is a Triton device function",
    f"{V4}.cache_utils.combine_topk_swa_indices": "signature differs: dsv41 lacks parameter 'left_visible'",
    f"{V4}.cache_utils.build_flashinfer_mixed_sparse_indices": "signature differs: dsv41 lacks parameter 'prefill_left_visible'",
}


# Scenarios after the first run in the first probe process (a process costs ~15 s of imports).
SCENARIOS = [
    {"env": {"DSV41_VLLM_OPS": "none"}},
    {"env": {"DSV41_VLLM_OPS": "rope_quant_insert, fused_q_kv_rmsnorm_quant," + f"{V4}.cache_utils.dequantize_and_gather_k_cache"}},
    {"env": {"DSV41_VLLM_OPS": "all"}},
    {"version": "0.99.0"},
    {"version": "0.99.0", "env": {"DSV41_VLLM_OPS": "save_ring_rows"}},
    {"version": "0.33.0+cu130"},
]


@functools.lru_cache(maxsize=None)
def _run(vllm_plugins: str | None, scenarios: str) -> list:
    e = {k: v for k, v in os.environ.items() if k not in ("DSV41_VLLM_OPS", "VLLM_PLUGINS")}
    if vllm_plugins is not None:
        e["VLLM_PLUGINS"] = vllm_plugins
    e["PROBE_SCENARIOS"] = scenarios
    r = subprocess.run([sys.executable, str(HERE / "probe_plugin.py")], env=e, capture_output=True, text=True, timeout=300)
    lines = [ln for ln in r.stdout.splitlines() if ln.startswith("PROBE ")]
    assert r.returncode == 0 and lines, f"probe failed ({r.returncode}):\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}"
    return json.loads(lines[-1][len("PROBE "):])


def probe(DSV41_VLLM_OPS=None, PROBE_FAKE_VLLM_VERSION=None, VLLM_PLUGINS=None) -> dict:
    if VLLM_PLUGINS is not None:
        return _run(VLLM_PLUGINS, "[]")[0]
    results = _run(None, json.dumps(SCENARIOS))
    if DSV41_VLLM_OPS is None and PROBE_FAKE_VLLM_VERSION is None:
        return results[0]
    want = {"version": PROBE_FAKE_VLLM_VERSION} if PROBE_FAKE_VLLM_VERSION else {}
    if DSV41_VLLM_OPS is not None:
        want["env"] = {"DSV41_VLLM_OPS": DSV41_VLLM_OPS}
    return results[1 + SCENARIOS.index(want)]


def by_name(result) -> dict:
    return {d["name"]: d for d in result["decisions"]}


def check_bindings(result):
    """Routed: dsv41's function on the defining module and on every vllm.* module that held
    vLLM's; kept: vLLM's function untouched."""
    for d in result["decisions"]:
        if d["routed"]:
            assert d["new_is_dsv41"], d
            assert d["defining_is_new"], d
            assert d["old_at"] == [], f"{d['name']} still held as vLLM's at {d['old_at']}"
            assert any(a == d["name"] for a in d["new_at"]), d
        else:
            assert not d["defining_is_new"] and d["new_at"] == [], d
            assert d["defining_is_old"], d


def test_default_routes_everything_compatible():
    res = probe()
    table = by_name(res)
    assert set(table) == {t.vllm_name for t in vp.KNOWN["0.33.0"].targets}
    kept = {n: d["detail"] for n, d in table.items() if not d["routed"]}
    assert set(kept) == set(KEPT_0_33), kept
    for name, why in KEPT_0_33.items():
        assert kept[name].startswith(why), (name, kept[name])
    check_bindings(res)
    assert not any(d["warn"] for d in res["decisions"])


def test_call_sites_imported_before_and_after_the_plugin_get_dsv41():
    table = by_name(probe(DSV41_VLLM_OPS="all"))  # every compatible name routed
    # imported before load_general_plugins()
    for short in ("fused_indexer_q_rope_quant", "indexer_k_norm_rope_store"):
        d = next(d for d in table.values() if d["short"] == short)
        assert f"vllm.models.deepseek_v41.attention.{short}" in d["new_at"], d["new_at"]
    # imported after it
    for short in ("fused_save_compress_norm", "rope_quant_insert", "save_ring_rows"):
        d = table[f"{V41}.fused_compress_quant_cache.{short}"]
        assert f"vllm.models.deepseek_v41.compressor.{short}" in d["new_at"], d["new_at"]
    # the V4.1 package re-exports the V4 functions: one object, rebound in both packages
    d = table[f"{V4}.fused_indexer_q.fused_indexer_q_rope_quant"]
    assert {f"{V41}.fused_indexer_q_rope_quant", f"{V4}.fused_indexer_q_rope_quant"} <= set(d["new_at"])


def test_one_log_line_per_op():
    res = probe()
    lines = [msg for _, msg in res["logs"] if msg.startswith(("routed ", "kept "))]
    assert sorted(lines) == sorted(d["line"] for d in res["decisions"])
    assert len(lines) == len(res["decisions"])
    for d in res["decisions"]:
        if d["routed"] and d["short"] == "rope_quant_insert":
            # the implementation dsv41's registry selected here (a CPU machine)
            assert d["line"].endswith("-> dsv41 rope_quant_insert [cpu]"), d["line"]
    assert res["second_call_logs"] == 0  # register() is idempotent


def test_vllm_plugins_selects_by_entry_point_name():
    assert by_name(probe(VLLM_PLUGINS="dsv41")) == by_name(probe())
    assert probe(VLLM_PLUGINS="")["decisions"] == []


def test_none_routes_nothing():
    res = probe(DSV41_VLLM_OPS="none")
    assert res["decisions"] and not any(d["routed"] for d in res["decisions"])
    check_bindings(res)


def test_a_list_routes_only_those():
    res = probe(DSV41_VLLM_OPS=SCENARIOS[1]["env"]["DSV41_VLLM_OPS"])
    routed = {d["name"] for d in res["decisions"] if d["routed"]}
    assert routed == {
        f"{V41}.fused_compress_quant_cache.rope_quant_insert",
        f"{V41}.query_quant.fused_q_kv_rmsnorm_quant",
        f"{V4}.cache_utils.dequantize_and_gather_k_cache",
    }
    check_bindings(res)
    for d in res["decisions"]:
        if not d["routed"] and d["detail"].startswith("not named"):
            assert d["detail"] == "not named in DSV41_VLLM_OPS"
    assert not any(d["warn"] for d in res["decisions"])


def test_all_routes_every_compatible_name():
    res = probe(DSV41_VLLM_OPS="all")
    table = by_name(res)
    q = table[f"{V41}.query_quant.fused_q_kv_rmsnorm_quant"]
    assert q["routed"] and not q["warn"]  # vLLM 0.33.0's bytes: no op is byte-different
    assert table[f"{V41}.query_quant.can_fuse_query_quant"]["routed"]
    kept = {n for n, d in table.items() if not d["routed"]}
    assert kept == {n for n, why in KEPT_0_33.items() if why.startswith(("signature", "vLLM's is"))}
    check_bindings(res)


def test_unknown_vllm_version_keeps_everything_unless_told():
    res = probe(PROBE_FAKE_VLLM_VERSION="0.99.0")
    assert res["decisions"] and not any(d["routed"] for d in res["decisions"])
    for d in res["decisions"]:
        if not d["detail"].startswith(("signature", "vLLM's is")):
            assert "0.99.0 is not a version dsv41 was checked against" in d["detail"], d
    check_bindings(res)
    res = probe(PROBE_FAKE_VLLM_VERSION="0.99.0", DSV41_VLLM_OPS="save_ring_rows")
    routed = [d for d in res["decisions"] if d["routed"]]
    assert [d["short"] for d in routed] == ["save_ring_rows"] and routed[0]["warn"]
    assert ["WARNING", routed[0]["line"]] in res["logs"]
    check_bindings(res)


def test_a_local_build_tag_is_the_same_release():
    res = probe(PROBE_FAKE_VLLM_VERSION="0.33.0+cu130")
    assert {n for n, d in by_name(res).items() if not d["routed"]} == set(KEPT_0_33)


def test_importing_dsv41_and_the_plugin_does_not_import_vllm():
    code = "import sys, dsv41, dsv41.integrations.vllm_plugin; print(sorted(m for m in sys.modules if m.split('.')[0] == 'vllm'))"
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and r.stdout.strip() == "[]", r.stdout + r.stderr


def test_entry_point_is_installed():
    from importlib.metadata import entry_points

    eps = [ep for ep in entry_points(group="vllm.general_plugins") if ep.name == "dsv41"]
    assert [ep.value for ep in eps] == ["dsv41.integrations.vllm_plugin:register"]


def _f(a, b, c=1, *, d=None):
    pass


@pytest.mark.parametrize(
    "other, problem",
    [
        (lambda a, b, c=1, *, d=None: None, None),
        (lambda a, b, c=1, e=2, *, d=None, f=3: None, None),  # extras with defaults
        (lambda a, b, c=2, *, d=None: None, "defaults to 1 in vLLM, 2 in dsv41"),
        (lambda a, x, c=1, *, d=None: None, "parameter 2 is 'b' in vLLM, 'x' in dsv41"),
        (lambda a, b, c=1: None, "lacks keyword-only parameter 'd'"),
        (lambda a, b, c=1, *, d=None, g: None, "requires keyword-only parameter 'g'"),
        (lambda a, b, c=1, e=None, *, d=None: None, None),
        (lambda a, b: None, "lacks parameter 'c'"),
        (lambda a, b, c=1, d=None: None, "is keyword-only in vLLM"),
    ],
)
def test_signature_rule(other, problem):
    got = vp.signature_problem(_f, other)
    assert (got is None) if problem is None else (problem in (got or "")), got
