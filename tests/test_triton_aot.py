"""Ahead-of-time builds of every registered shared Triton kernel (backends/triton/aot.py)
for sm90, sm100 (PTX + cubin) and gfx942, gfx950 (AMDGCN + hsaco), on a machine without
any GPU.

When the process runs with ``TRITON_INTERPRET=1`` (the kernels were decorated as
interpreter functions, which cannot be compiled), or interpreter tests ran before in this
process, the builds run in a child process without that variable.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

# -P: child processes import the installed package, not the checkout's dsv41/ (on a GPU host the
# checkout lacks dsv41.backends, which installs from backends/)
SAFE_PATH = ["-P"] if sys.version_info >= (3, 11) else []

triton = pytest.importorskip("triton")

TARGETS = ("sm90", "sm100", "gfx942", "gfx950")
JOBS = max(1, min(2, os.cpu_count() or 1))


def _interpreted() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def _language_patched() -> bool:
    """Triton's interpreter re-patches ``triton.language`` whenever an interpreted kernel
    calls a jit helper, and never undoes it; after the interpreter tests ran in this process
    (any order other than the suite's alphabetical one) a compile would see those patches."""
    import triton.language.core as core

    return "_patch_attr" in getattr(core.load, "__qualname__", "")


def _compile(target: str, ones: bool = False) -> list:
    if not _interpreted() and not _language_patched():
        from dsv41.backends.triton.aot import compile_all

        return [tuple(r) for r in compile_all(target, jobs=JOBS, ones=ones)]
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    code = (
        "import json, sys\n"
        "from dsv41.backends.triton.aot import compile_all\n"
        f"print(json.dumps(compile_all({target!r}, jobs={JOBS}, ones={ones!r})))\n"
    )
    proc = subprocess.run([sys.executable, *SAFE_PATH, "-c", code], env=env, capture_output=True, text=True,
                          timeout=1800)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return [tuple(r) for r in json.loads(proc.stdout.strip().splitlines()[-1])]


@pytest.mark.parametrize("target", TARGETS)
def test_aot_builds(target):
    results = _compile(target)
    failed = [(name, tgt, err) for name, tgt, ok, err in results if not ok]
    assert not failed, "\n\n".join(f"{n} @ {t}:\n{e}" for n, t, e in failed)
    built = {name for name, tgt, ok, _ in results if ok}
    # every kernel of cache_kernels.py builds for every target
    for kernel in ("_quant_insert_kernel", "_gather_kernel", "_rope_quant_insert_kernel",
                   "_indexer_k_kernel", "_compress_norm_kernel", "_ring_save_kernel",
                   "_save_ring_rows_kernel"):
        assert any(f"cache_kernels.{kernel}[" in n for n in built), (kernel, target)
    # the interleaved 528 / 288 records and CR 2 with prev_rows build beside the paged ones
    for kernel, recs in (("_quant_insert_kernel", (528,)), ("_gather_kernel", (528, 288)),
                         ("_rope_quant_insert_kernel", (528, 288))):
        for rec in recs:
            assert any(n.startswith(f"cache_kernels.{kernel}[{rec},") and ",il" in n
                       for n in built), (kernel, rec, target)
    assert any(n.startswith("cache_kernels._compress_norm_kernel[cr2,") and ",prev" in n
               for n in built), target
    if target == "gfx942":
        assert any("fnuz" in n for n in built)


def test_aot_builds_with_integer_arguments_equal_to_one():
    """Triton's JIT passes an integer argument equal to 1 as a constexpr (a Python int in the
    kernel body): every kernel must build that way too (a batch of one request, a ring of one
    row, a stride of 1).  sm_90 only: the kernel bodies are the same for every target."""
    results = _compile("sm90", ones=True)
    failed = [(name, err) for name, _, ok, err in results if not ok]
    assert not failed, "\n\n".join(f"{n}:\n{e}" for n, e in failed)


def test_registry_shape():
    from dsv41.backends.triton import aot

    aot.discover()
    names = [s.name for s in aot.AOT_SPECS]
    assert len(names) == len(set(names))
    for s in aot.AOT_SPECS:
        assert set(s.targets) <= set(aot.TARGETS), s.name
        assert set(s.signature) == set(s.kernel.arg_names), s.name
        # every constexpr has a value (a defaulted one its kernel's default), so no build
        # takes a path the launches never take (ASTSource builds a missing one as None)
        assert aot.constexpr_params(s.kernel) <= set(s.constexprs), s.name
    il = [s for s in aot.AOT_SPECS if ",il" in s.name]
    assert il and all(s.constexprs["INTERLEAVED"] is True for s in il)
    assert all(s.constexprs.get("INTERLEAVED", False) is False for s in aot.AOT_SPECS
               if ",il" not in s.name)
    prev = [s for s in aot.AOT_SPECS if ",prev" in s.name]
    assert prev and all(s.constexprs["HAS_PREV"] is True for s in prev)
    rope288 = next(s for s in aot.AOT_SPECS if s.name.startswith("cache_kernels._rope_quant_insert_kernel[288,native,sm90"))
    assert rope288.constexprs["ROPE_WORDS"] is True and rope288.constexprs["PTX"] is True


@pytest.mark.skipif(_interpreted(), reason="compiled kernels only (run without TRITON_INTERPRET)")
def test_sass_instruction_mix():
    """``python -m dsv41.backends.triton.sass``: the sm_90 build of one writer disassembles into
    a plausible instruction mix (the counts docs/performance.md quotes come from this tool)."""
    import collections

    # built in a child process: interpreter tests that ran before in this process leave
    # Triton's JIT seeing interpreter functions
    code = (
        "import json\n"
        "from dsv41.backends.triton import aot, sass\n"
        "aot.discover()\n"
        "spec = next(s for s in aot.AOT_SPECS\n"
        "            if s.name == 'cache_kernels._quant_insert_kernel[528,ocp,native]')\n"
        "print(json.dumps(sass.mix(spec, 'sm90')[0]))\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, *SAFE_PATH, "-c", code], env=env, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    ops = collections.Counter(json.loads(proc.stdout.strip().splitlines()[-1]))
    total = sum(ops.values())
    assert 50 < total < 5000, total
    # the native OCP path packs fp8 pairs with the saturating convert and stores 16 bytes at once
    assert any(op.startswith("F2FP.SATFINITE.E4M3") for op in ops), ops.most_common(10)
    assert any(op.startswith("STG.E.128") for op in ops), ops.most_common(10)
    assert "EXIT" in ops and "NOP" not in ops


@pytest.mark.skipif(_interpreted(), reason="compiled kernels only (run without TRITON_INTERPRET)")
def test_sass_cli_other_shapes_and_one_branch():
    """``sass --set K=V --one P --num-warps N --from-label L``: the spec is built with the given
    constexprs, unit integer parameters and warps (its name says so), the count from a label is
    part of the whole kernel's, and a constexpr the kernel lacks, an integer parameter it lacks
    or a label its SASS lacks is a usage error."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    name = "_flashinfer_mixed_kernel[----]"

    def run(*extra):
        return subprocess.run([sys.executable, *SAFE_PATH, "-m", "dsv41.backends.triton.sass", name, *extra],
                              env=env, capture_output=True, text=True, timeout=600)

    def count(proc):
        assert proc.returncode == 0, proc.stderr[-4000:]
        line = next(ln for ln in proc.stdout.splitlines() if "instructions" in ln)
        return line, int(line.split("]: ")[1].split()[0])

    shape = ["--set", "BLOCK_R=2", "--set", "BLOCK_C=512", "--set", "BLOCK_W=128", "--num-warps", "2"]
    line, whole = count(run(*shape))
    assert "{BLOCK_R=2,BLOCK_C=512,BLOCK_W=128,2 warps} [2 warps," in line, line
    _, branch = count(run(*shape, "--from-label", ".L_x_0"))
    assert 0 < branch < whole
    _, default = count(run())
    assert default != whole  # the default spec is 16 rows x 256 columns, 4 warps
    bad = run("--set", "NO_SUCH_CONSTEXPR=1")
    assert bad.returncode == 2 and "has no constexpr NO_SUCH_CONSTEXPR" in bad.stderr
    bad = run("--from-label", ".L_no_such_label")
    assert bad.returncode == 2 and "label '.L_no_such_label' not in the SASS" in bad.stderr
    bad = run("--set", "BLOCK_R")
    assert bad.returncode == 2 and "--set takes NAME=VALUE" in bad.stderr
    # --one: integer parameters built as the constant 1, as the JIT builds an argument equal
    # to 1 (contiguous strides): another build, named so, with fewer instructions
    line, unit = count(run(*shape, "--one", "s_out1,s_ptk1", "--one", "s_cmp1"))
    assert "s_out1=1,s_ptk1=1,s_cmp1=1,2 warps}" in line, line
    assert unit < whole
    bad = run("--one", "BLOCK_R")  # a constexpr, not an integer argument
    assert bad.returncode == 2 and "has no integer parameter BLOCK_R" in bad.stderr
