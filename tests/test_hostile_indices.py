"""Hostile-index matrix: no index may crash the process, hang, or touch memory outside the
tensors it was given (tests/hostile.py has the enumeration, the canaries, the fork server and
the expected outcomes).

One test per (implementation, op) runs every hostile case of the op in forked children of one
fork server and reports every failing case in one assertion message.  Implementations: the
reference and the cpu backend; with ``TRITON_INTERPRET=1`` also the Triton-source backends in
Triton's interpreter (the cuda one in the fast tier, all with ``DSV41_TEST_TIER=full``, the
default of a plain pytest run).  The rest of the file tests the harness itself.

The GPU host runs the same matrix in one process (no fork after CUDA init) with
``python tests/hostile.py --device cuda --impl all`` (under ``compute-sanitizer``).
"""

from __future__ import annotations

import json
import os

import hostile
import pytest
import torch
from impls import implementations

TIER = os.environ.get("DSV41_TEST_TIER", "full").strip() or "full"


def _impl_names() -> tuple[list[str], dict]:
    """(implementations that run here, {implementation: why it cannot run})."""
    names, interp, skipped = [], [], {}
    for im in implementations(include_reference=True):
        if im.name not in hostile.HOST_IMPLS and not im.interpreted:
            continue  # GPU kernels: tests/hostile.py --device cuda on the GPU host
        if im.device != "cpu":
            skipped[im.name] = im.why
        elif im.interpreted:
            interp.append(im.name)
        else:
            names.append(im.name)
    if TIER == "fast":
        interp = [n for n in interp if n.startswith("cuda")][:1] or interp[:1]
    return names + interp, skipped


IMPL_NAMES, SKIPPED = _impl_names()
OPS = hostile.ops_with_sites()
# one parameter (not 'impl' / 'case'): the conftest's fast-tier slicing keeps every target
TARGETS = [f"{i}::{op}" for i in IMPL_NAMES for op in OPS]
TARGETS += [pytest.param(f"{i}::*", marks=pytest.mark.skip(reason=why)) for i, why in SKIPPED.items()]


@pytest.fixture(scope="module")
def server():
    srv = hostile.ForkServer("cpu")
    yield srv
    srv.close()


# --------------------------------------------------------------------------- the matrix


@pytest.mark.parametrize("target", TARGETS)
def test_hostile_indices(target, server):
    impl, op = target.split("::")
    outcomes = hostile.run_matrix(server, impl, op)
    bad = [o for o in outcomes if not o.ok]
    assert not bad, (f"{impl} {op}: {len(bad)} of {len(outcomes)} hostile-index outcomes fail\n"
                     + "\n".join(hostile.format_outcome(o) for o in bad))


def test_validate_flag_makes_cpu_path_raise(server):
    """DSV41_VALIDATE=1: the public ops' index checks (``check_kernel_args``) in front of the cpu
    kernel reject a sample of the invalid cases (the bound, and -2 where negative is invalid)
    with a ValueError, before anything is written."""
    if "cpu" not in IMPL_NAMES:
        pytest.skip("the cpu backend does not run here")
    sample = hostile.validate_sample()
    assert len(sample) >= 20
    jobs = [hostile._job("cpu", hostile.SITE_BY_ID[c.site].op, hostile.SITE_BY_ID[c.site].case, c.site, c.value,
                         validate=True) for c in sample]
    problems = []
    for c, rec in zip(sample, server.run(jobs)):
        names = hostile.arg_names(hostile.SITE_BY_ID[c.site].op)
        f = hostile._basic_failures(rec, "cpu", names)
        if not f:
            r = rec["runs"][0]
            if r["outcome"] != "raised" or r["exc"] != "ValueError":
                f.append(f"expected ValueError, got {hostile._describe(rec)}")
            elif r["written"] != r["pre_written"]:
                f.append("wrote before raising")
        if f:
            problems.append(f"{c.id}: " + "; ".join(f))
    assert not problems, "\n".join(problems)


# --------------------------------------------------------------------------- the harness


def test_server_forks_without_thread_pools(server):
    """The fork server must run no OpenMP / torch intra-op work before forking: it has one
    thread when it forks, and a child's OpenMP kernels (torch's pool and the CPU kernels'
    regions) then run to the end, several times in a row."""
    assert server.hello["threads"] == 1, server.hello
    if "cpu" not in IMPL_NAMES:
        pytest.skip("the cpu backend does not run here")
    jobs = [{"impl": "cpu", "op": "-", "case": "-", "selftest": "openmp", "n": k, "timeout": 20} for k in range(3)]
    jobs.append({"impl": "cpu", "op": "-", "case": "-", "selftest": "threads", "timeout": 20})
    recs = server.run(jobs)
    for rec in recs[:3]:
        assert rec["status"] == "ok", rec
        assert rec["threads"] == server.hello["torch_threads"]  # restored in the child
        for r in rec["runs"]:
            assert r["outcome"] == "returned" and not r["canary"], r
    assert recs[3]["threads_in_child"] == 1, recs[3]
    assert server.last_threads == 1, "the server started a thread while serving"


@pytest.mark.parametrize("what,signame", [("segv", "SIGSEGV"), ("abort", "SIGABRT"), ("exit3", None)])
def test_crash_is_attributed_and_survived(server, what, signame):
    rec, after = server.run([{"impl": "-", "op": "-", "case": what, "selftest": what, "timeout": 20},
                             hostile._job("reference", "save_ring_rows", "basic")])
    assert rec["status"] == "crash", rec
    assert rec["phase"] == what
    if signame:
        assert rec["signal"] == signame
    else:
        assert rec["exit"] == 3
    assert after["status"] == "ok" and after["runs"][0]["outcome"] == "returned", after
    f = hostile._basic_failures(rec, "cpu", ["a"])
    assert f and f[0].startswith("crash"), f


def test_hang_is_killed(server):
    rec, after = server.run([{"impl": "-", "op": "-", "case": "hang", "selftest": "sleep", "timeout": 1.5},
                             hostile._job("reference", "save_ring_rows", "basic")])
    assert rec["status"] == "hang" and rec["phase"] == "sleep", rec
    assert 1.5 <= rec["wall"] < 10
    assert after["status"] == "ok", after


def test_out_of_bounds_write_is_caught_by_canaries(server):
    """8 bytes written 16 bytes past argument 0's storage and 8 bytes 40 bytes before it: both
    are reported, on argument 0 only."""
    (rec,) = server.run([{"impl": "-", "op": "-", "case": "oob", "selftest": "oob_write", "timeout": 20}])
    canary = rec["runs"][0]["canary"]
    assert set(canary) == {"0"}, canary
    assert "8 canary bytes before" in canary["0"] and "8 canary bytes after" in canary["0"], canary
    assert "offsets -40..-33" in canary["0"] and "offsets 416..423" in canary["0"], canary
    f = hostile._basic_failures(rec, "cpu", ["x", "y"])
    assert any("canary around arg 0 'x'" in m for m in f), f


def test_out_of_bounds_kernel_write_is_caught(server):
    """The CPU insert kernel's C entry point called directly (no bounds scan) with the first
    slot past the cache writes a record past the cache's storage: the canaries catch it."""
    if "cpu" not in IMPL_NAMES:
        pytest.skip("the cpu backend does not run here")
    (rec,) = server.run([{"impl": "cpu", "op": "-", "case": "oob", "selftest": "oob_kernel", "timeout": 20}])
    assert rec["status"] == "ok", rec
    canary = rec["runs"][0]["canary"]
    assert set(canary) == {"1"}, canary  # the cache (arg 1), nothing else
    assert "after the storage" in canary["1"]


@pytest.mark.parametrize("use_numpy", [True, False], ids=["numpy-buffers", "torch-buffers"])
def test_rehome_keeps_views_and_bytes(use_numpy):
    """Every site's case: rehomed arguments have the same shape, strides, storage offset
    (relative to their storage), dtype and bytes; the reference writes the same bytes.  The
    torch-buffer path is the one CUDA tensors take."""
    from dsv41.tools.conformance import clone_args
    from dsv41.reference import ReferenceBackend

    ref = ReferenceBackend()
    done = set()
    for s in hostile.SITES:
        if (s.op, s.case) in done:
            continue
        done.add((s.op, s.case))
        case = hostile._case(s.op, s.case)
        args = case.build("cpu")
        rh = hostile.Rehomed(clone_args(args), "cpu", use_numpy=use_numpy)
        for i, (a, b) in enumerate(zip(args, rh.args)):
            if not isinstance(a, torch.Tensor):
                assert a == b or (a is None and b is None)
                continue
            assert (a.shape, a.stride(), a.dtype) == (b.shape, b.stride(), b.dtype), (case.id, i)
            assert b.storage_offset() - hostile.PAD // a.element_size() == a.storage_offset(), (case.id, i)
            assert rh.storage_bytes_equal(i, a), (case.id, i)
        want = clone_args(args)
        ref.load(s.op)(*want)
        ref.load(s.op)(*rh.args)
        assert not rh.check_canaries()
        for i in case.writes:
            if want[i] is not None:
                assert rh.storage_bytes_equal(i, want[i]), (case.id, i)


def test_sites_match_the_contract():
    """Each site names its argument as the reference does, the hostile element is inside the
    tensor, and the values are the ones asked for."""
    for s in hostile.SITES:
        names = hostile.arg_names(s.op)
        assert names[s.index] == s.arg, (s.id, names)
    cases = hostile.hostile_cases()
    assert len({c.id for c in cases}) == len(cases)
    per_site = {}
    for c in cases:
        per_site.setdefault(c.site, []).append(c.value)
    for sid, vals in per_site.items():
        s = hostile.SITE_BY_ID[sid]
        assert {10**6, 2**31 - 1} <= set(vals), sid
        if s.element is not None:
            assert {-2, -(10**6), -(2**31)} <= set(vals), sid
        else:
            assert min(vals) >= 0, sid
    assert set(hostile.ops_with_sites()) | set(hostile.NO_INDEX_OPS) == set(__import__("dsv41.core.registry", fromlist=["OPS"]).OPS)


def test_bounds_agree_with_index_checks(monkeypatch):
    """The first invalid value of every non-defined site is rejected by ``DSV41_VALIDATE``'s
    checks, the value below it (where the bound is tight) and the unmodified case are not, and
    negative values are rejected exactly where they are invalid."""
    from dsv41.core import index_checks

    monkeypatch.setenv("DSV41_VALIDATE", "1")
    index_checks.refresh()
    try:
        problems = []
        for s in hostile.SITES:
            if "defined" in s.neg + s.pos + s.inrange:
                continue
            args, elem, bound, _ = hostile.build_site_args(s)

            def rejects(v, s=s):
                a = hostile.apply_value(s, hostile._fresh_args(hostile._case(s.op, s.case)), v)
                try:
                    index_checks.check_kernel_args(s.op, a)
                except ValueError as exc:
                    # a duplicate slot (the case's other slots include bound - 1) is a race,
                    # not a range violation
                    return "duplicate" not in str(exc)
                return False

            if rejects(int(args[s.index]) if elem is None else int(args[s.index][elem])):
                problems.append(f"{s.id}: the unmodified case is rejected")
            if bound is not None and not rejects(bound):
                problems.append(f"{s.id}: bound {bound} is accepted")
            if bound is not None and s.tight and rejects(bound - 1):
                problems.append(f"{s.id}: {bound - 1} (below the bound) is rejected")
            if elem is not None and rejects(-2) != (s.neg == "invalid"):
                problems.append(f"{s.id}: -2 {'rejected' if s.neg != 'invalid' else 'accepted'}")
        assert not problems, "\n".join(problems)
    finally:
        monkeypatch.delenv("DSV41_VALIDATE")
        index_checks.refresh()


def test_hostile_elements_are_live(monkeypatch):
    """The hostile element is one the op uses: an in-range change of it changes what the
    reference writes (index checks switched off, so the plain computation decides)."""
    from dsv41.core import index_checks
    from dsv41.tools.conformance import clone_args
    from dsv41.reference import ReferenceBackend

    if hasattr(index_checks, "enforce"):
        monkeypatch.setattr(index_checks, "enforce", lambda op, args: None)
    monkeypatch.delenv("DSV41_VALIDATE", raising=False)
    index_checks.refresh()
    ref = ReferenceBackend()
    dead = []
    for s in hostile.SITES:
        case = hostile._case(s.op, s.case)
        args, elem, bound, _ = hostile.build_site_args(s)
        orig = int(args[s.index]) if elem is None else int(args[s.index][elem])
        alt = s.alt(args, orig)
        assert alt != orig and alt >= -1 and (bound is None or alt < bound), (s.id, orig, alt)
        a0 = clone_args(args)
        a1 = hostile.apply_value(s, clone_args(args), alt)
        ref.load(s.op)(*a0)
        ref.load(s.op)(*a1)
        from dsv41.tools.conformance import written_bytes

        if all(torch.equal(written_bytes(a0[i]), written_bytes(a1[i])) for i in case.writes if a0[i] is not None):
            dead.append(f"{s.id}: {orig} -> {alt} changes nothing")
    assert not dead, "\n".join(dead)


def test_expectations_logic():
    """evaluate() on synthetic records: the rules of docs/bad_input.md as the matrix applies them."""
    ok = {"outcome": "returned", "canary": {}, "inputs_modified": [], "written": {"1": "a"}, "pre_written": {"1": "p"}}
    raised = dict(ok, outcome="raised", exc="ValueError",
                  msg="quantize_and_insert_k_cache: argument 'slot_mapping' has value 192", written={"1": "p"})
    site = "quantize_and_insert_k_cache[528-ocp-interleaved].slot_mapping"
    inv = hostile.HostileCase(site, 192, "invalid", (0,), 192, 0)
    skip = hostile.HostileCase(site, -2, "skip", (0,), 192, 0)
    names = hostile.arg_names("quantize_and_insert_k_cache")
    rec = lambda *runs: {"status": "ok", "runs": list(runs)}
    m1 = rec(dict(ok, written={"1": "m"}))
    base = {"orig": rec(ok), "minus1": m1, "ref": None}
    assert hostile.evaluate("cpu", inv, rec(raised), base, names) == []
    assert hostile.evaluate("cpu", inv, rec(ok), base, names)  # returned: fails
    assert hostile.evaluate("cpu", inv, rec(dict(raised, msg="bad index")), base, names)  # arg not named
    assert hostile.evaluate("cpu", inv, rec(dict(raised, written={"1": "x"})), base, names)  # wrote
    assert hostile.evaluate("cpu", inv, rec(dict(raised, exc="IndexError")), base, names)
    assert hostile.evaluate("cpu", skip, rec(dict(ok, written={"1": "m"})), base, names) == []
    assert hostile.evaluate("cpu", skip, rec(ok), base, names)  # differs from the -1 call
    gpu = "cuda:triton@interp"
    assert hostile.evaluate(gpu, inv, rec(dict(ok, written={"1": "m"}), dict(ok, written={"1": "m"})), base, names) == []
    assert hostile.evaluate(gpu, inv, rec(ok, ok), base, names)  # slot: must equal the -1 call
    assert hostile.evaluate(gpu, inv, rec(dict(ok, written={"1": "m"}), dict(ok, written={"1": "n"})), base, names)
    assert hostile.evaluate(gpu, inv, rec(raised, raised), base, names)  # a GPU kernel must not raise
    assert hostile.evaluate("cpu", inv, {"status": "hang", "timeout": 20}, base, names)
    assert hostile.evaluate("cpu", inv, rec(dict(raised, canary={"1": "changed"})), base, names)
    json.dumps(hostile.evaluate("cpu", inv, {"status": "crash", "signal": "SIGSEGV"}, base, names))
