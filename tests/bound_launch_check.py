"""Whether ``backends/triton/bound.py`` launches exactly what Triton's own ``JITFunction.run``
launches, checked on a machine without a GPU.

A stand-in for Triton's active driver compiles for sm_90 (Triton's own compiler and ``ptxas``
run on the CPU) and, instead of launching, records what the compiled launcher receives: which
compiled kernel, the grid, the stream, the function handle, the packed metadata and every
argument.  Each call is made twice, once through Triton's path and once through the bound
launcher, and the two records must agree, except that Triton's path passes launch metadata and
its two hook chains (which must be empty: what they do then is nothing) where the bound
launcher passes ``None``.  The device index is one no GPU has, so Triton's per-device caches of
a process with a GPU are never touched; ``tests/test_bound_launch.py`` runs this file in a
child process anyway (compiling in a process that ran interpreted kernels is not safe).

    python tests/bound_launch_check.py unit        # a probe kernel: alignment, 1, %16, types,
                                                   # constexprs, options, hooks, the env switch
    python tests/bound_launch_check.py ops [T ...] # every Triton launcher on the bench inputs
    python tests/bound_launch_check.py replay [T ...]  # backends/triton/replay.py against the
                                                   # launchers (every op) and on a probe launcher
    python tests/bound_launch_check.py direct      # bound.firing against Triton's own launcher
    python tests/bound_launch_check.py time [T]    # host us per launcher call, both paths

``unit``, ``ops``, ``replay`` and ``direct`` print one JSON object: {"checks": n, "hits": n, "failures": [...]}.
``time`` prints a table: wall time per call of each launcher on the bench's inputs (min of 5
repeats of 2000 calls), through Triton's path and bound; the stand-in launcher does nothing, so
this is the host's Python work per launch minus the compiled launcher's own C code.
"""

from __future__ import annotations

import importlib
import json
import os
import sys

import torch
import triton
import triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.runtime.driver import driver as _triton_driver

DEVICE = 1000  # no GPU has this index: Triton's caches for real devices are not touched
STREAM = 77

_records: list = []
_recording = [True]


def _normal(a):
    if isinstance(a, torch.Tensor):
        return ("tensor", a.data_ptr(), a.dtype, tuple(a.shape), tuple(a.stride()))
    return (type(a).__name__, a)


class _Launcher:
    """What a compiled kernel's launcher receives, recorded."""

    def __init__(self, name):
        self.name = name

    def __call__(self, gx, gy, gz, stream, function, packed, launch_metadata, enter, exit_, *args):
        if not _recording[0]:
            return
        _records.append({
            "launcher": id(self), "name": self.name, "grid": (gx, gy, gz), "stream": stream,
            "function": function, "packed": repr(packed), "metadata": launch_metadata,
            "hooks": (enter, exit_), "args": [_normal(a) for a in args],
        })
        # as Triton's compiled launcher does around the launch
        if enter is not None:
            enter(launch_metadata)
        if exit_ is not None:
            exit_(launch_metadata)


class _Utils:
    def load_binary(self, name, kernel, shared, device):
        return (1, 2, 32, 0, 1024)  # module, function, registers, spills, max threads

    def get_device_properties(self, device):
        return {"max_shared_mem": 232448, "multiprocessor_count": 132, "max_num_regs": 65536,
                "warpSize": 32, "sm_clock_rate": 1, "mem_clock_rate": 1, "mem_bus_width": 1}


class RecordingDriver:
    """Compiles for sm_90; its launchers record instead of launching."""

    utils = _Utils()

    def get_current_device(self):
        return DEVICE

    def get_current_stream(self, device=None):
        return STREAM

    def get_current_target(self):
        return GPUTarget("cuda", 90, 32)

    def get_active_torch_device(self):
        return torch.device("cpu")

    def launcher_cls(self, src, metadata):
        return _Launcher(getattr(src, "name", "?"))

    def is_active(self):
        return True


def _install():
    _triton_driver.set_active(RecordingDriver())


@triton.jit
def _probe(x_ptr, y_ptr, n, m, f, flag, BLOCK: tl.constexpr, SHIFT: tl.constexpr = 0):
    offs = tl.arange(0, BLOCK)
    mask = offs < n
    v = tl.load(x_ptr + offs * m, mask=mask, other=0).to(tl.float32)
    if flag:
        v = v + 1.0
    tl.store(y_ptr + offs + SHIFT, v * f, mask=mask)


def _both(launch, call):
    """Run ``call(launch)`` through Triton's path and through the bound launcher; compare."""
    from dsv41.backends.triton import bound

    out = []
    for fast in (False, True):
        bound._ENABLED = fast
        del _records[:]
        call(launch)
        out.append(list(_records))
    bound._ENABLED = None
    slow, fast = out
    problems = []
    if len(slow) != len(fast) or not slow:
        return [f"{len(slow)} launches through Triton, {len(fast)} bound"]
    for a, b in zip(slow, fast):
        for chain in a["hooks"]:
            if chain is not None and getattr(chain, "calls", None):
                problems.append("Triton's path had launch hooks")
        if b["metadata"] is not None or b["hooks"] != (None, None):
            problems.append("the bound launch passed launch metadata or hooks")
        for k in ("launcher", "grid", "stream", "function", "packed", "args"):
            if a[k] != b[k]:
                problems.append(f"{k} differs: Triton {str(a[k])[:300]} / bound {str(b[k])[:300]}")
    return problems


def _kept_keys() -> int:
    return sum(len(b._kept) for b in _bound_kernels())


def _bound_kernels():
    from dsv41.backends.triton import bound

    for name in ("cache_kernels", "index_kernels", "rope_kernels", "transcode_kernel"):
        mod = importlib.import_module("dsv41.backends.triton." + name)
        for v in vars(mod).values():
            if isinstance(v, bound.BoundKernel):
                yield v


_PROBE = None


def unit() -> dict:
    global _PROBE
    from dsv41.backends.triton import bound

    _PROBE = bound.bind(_probe)
    x = torch.arange(64, dtype=torch.int32)
    xf = x.float()
    y = torch.zeros(80)
    calls = {
        "aligned": ((1,), (x, y, 16, 1, 2.0, True), {"BLOCK": 32}),
        "misaligned x": ((1,), (x[1:], y, 16, 1, 2.0, True), {"BLOCK": 32}),
        "misaligned y": ((1,), (x, y[3:], 16, 1, 2.0, True), {"BLOCK": 32}),
        "n == 1": ((1,), (x, y, 1, 1, 2.0, True), {"BLOCK": 32}),
        "n odd": ((1,), (x, y, 17, 1, 2.0, True), {"BLOCK": 32}),
        "m % 16": ((1,), (x, y, 4, 16, 2.0, True), {"BLOCK": 32}),
        "n int64": ((1,), (x, y, 2**31 + 16, 1, 2.0, True), {"BLOCK": 32}),
        "flag int": ((1,), (x, y, 16, 1, 2.0, 1), {"BLOCK": 32}),
        "flag False": ((1,), (x, y, 16, 1, 2.0, False), {"BLOCK": 32}),
        "f int": ((1,), (x, y, 16, 1, 2, True), {"BLOCK": 32}),
        "x float": ((1,), (xf, y, 16, 1, 2.0, True), {"BLOCK": 32}),
        "BLOCK 64": ((2, 1), (x, y, 16, 1, 2.0, True), {"BLOCK": 64}),
        "SHIFT given": ((1, 1, 1), (x, y, 16, 1, 2.0, True), {"BLOCK": 32, "SHIFT": 8}),
        "num_warps 2": ((1,), (x, y, 16, 1, 2.0, True), {"BLOCK": 32, "num_warps": 2}),
    }
    failures, checks, hits = [], 0, 0
    # twice over: the second pass meets every key again and must hit
    for rnd in range(2):
        for name, (grid, args, kw) in calls.items():
            before = len(_PROBE._kept)
            for p in _both(_PROBE, lambda launch, g=grid, a=args, k=kw: launch(g, *a, **k)):
                failures.append(f"{name}: {p}")
            checks += 1
            if rnd == 1:
                if len(_PROBE._kept) != before:
                    failures.append(f"{name}: a repeated key was not kept")
                else:
                    hits += 1
    # a different kernel for every call that Triton specializes differently
    distinct = len({id(k[0]) for k in _PROBE._kept.values()})
    if distinct < 10:
        failures.append(f"only {distinct} compiled kernels for {len(calls)} specializations")
    failures += _fallbacks(x, y)
    return {"checks": checks, "hits": hits, "failures": failures}


def _fallbacks(x, y) -> list:
    """Launch hooks installed, or the env switch: Triton's own path."""
    from triton import knobs

    from dsv41.backends.triton import bound

    failures = []
    seen = []
    knobs.runtime.launch_enter_hook.add(seen.append)
    try:
        bound._ENABLED = None
        del _records[:]
        _PROBE((1,), x, y, 16, 1, 2.0, True, BLOCK=32)
        if not seen or _records[-1]["metadata"] is None:
            failures.append("with a launch hook installed the bound launcher skipped it")
    finally:
        knobs.runtime.launch_enter_hook.remove(seen.append)
    os.environ["DSV41_TRITON_SLOW_LAUNCH"] = "1"
    bound._ENABLED = None
    if bound.enabled():
        failures.append("DSV41_TRITON_SLOW_LAUNCH=1 left the bound launcher on")
    del os.environ["DSV41_TRITON_SLOW_LAUNCH"]
    bound._ENABLED = None
    return failures


def _launcher_cases(tokens):
    """``(variant name, tokens, kernel arguments, launcher)`` of every shared Triton launcher on
    the bench's inputs at each size."""
    from dsv41.backends.triton.sheet import TRITON_KERNELS
    from dsv41.core import platform as P
    from dsv41.tools import bench as B

    plat = P.probe()
    for t in tokens:
        for v in B.VARIANTS:
            if v.op not in TRITON_KERNELS:
                continue
            case = v.build(B._Gen("cpu", t), t, plat)
            modname, fn = TRITON_KERNELS[v.op].split(":")
            yield v.name, t, case.args, getattr(importlib.import_module(modname), fn)


def ops(tokens=(1, 17, 64)) -> dict:
    failures, checks = [], 0
    for name, t, args, launcher in _launcher_cases(tokens):
        for p in _both(launcher, lambda _l, f=launcher, a=args: f(*a)):
            failures.append(f"{name} at {t} tokens: {p}")
        checks += 1
    return {"checks": checks, "hits": _kept_keys(), "failures": failures}


def _launched(call) -> list:
    del _records[:]
    call()
    return [dict(r) for r in _records]


def _same_launches(direct: list, replayed: list, tensors) -> list:
    """A replayed launch is the direct one with every pointer passed as an integer."""
    if len(direct) != len(replayed) or not direct:
        return [f"{len(direct)} direct launches, {len(replayed)} replayed"]
    problems = []
    for a, b in zip(direct, replayed):
        for k in ("launcher", "grid", "stream", "function", "packed"):
            if a[k] != b[k]:
                problems.append(f"{k} differs: direct {str(a[k])[:200]} / replayed {str(b[k])[:200]}")
        want, got = ([("int", x[1]) if x[0] == "tensor" else x for x in r["args"]] for r in (a, b))
        if want != got:
            problems.append(f"arguments differ: direct {str(want)[:300]} / replayed {str(got)[:300]}")
    return problems


def _fresh(args, shift: int = 0):
    """Copies of the tensor arguments at other addresses (``shift`` elements in: another
    alignment), the rest as is."""
    out = []
    for a in args:
        if isinstance(a, torch.Tensor) and type(a) is torch.Tensor:
            base = torch.empty(a.numel() + shift + 64, dtype=a.dtype) if a.numel() else a.new_empty(0)
            if a.numel():
                c = base[shift:shift + a.numel()].view(a.shape) if a.is_contiguous() else a.clone()
                c.copy_(a)
                out.append(c)
            else:
                out.append(a.clone())
        else:
            out.append(a)
    return tuple(out)


def replay(tokens=(1, 17, 64)) -> dict:
    """Each launcher wrapped in ``Replaying``: after a recorded call, a call with the same launch
    key on new tensors skips the launcher and launches what the launcher itself launches on
    them; a launcher's Python never runs on a replayed call."""
    from dsv41.backends.triton import replay as R

    failures, checks, replayed = [], 0, 0
    for name, t, case_args, launcher in _launcher_cases(tokens):
        ran = []
        wrapped = R.Replaying(lambda *a, f=launcher: (ran.append(1), f(*a))[1])
        for _ in range(R._TRIES):  # a first call may build a table the backend keeps
            wrapped(*case_args)
        checks += 1
        for shift in (0, 1):
            args = _fresh(case_args, shift)
            direct = _launched(lambda: launcher(*args))
            rec = wrapped.record_for(*args)  # before the call: it may record
            del ran[:]
            again = _launched(lambda: wrapped(*args))
            if shift == 0 and ran:
                failures.append(f"{name} at {t} tokens: not replayed")
                continue
            if not ran:
                replayed += 1
            if (rec is None) != bool(ran) or (rec is not None and len(rec.launches) != len(direct)):
                failures.append(f"{name} at {t} tokens (shift {shift}): record_for gives "
                                f"{'no record' if rec is None else len(rec.launches)} but the call "
                                f"{'ran the launcher' if ran else 'replayed'} ({len(direct)} launches)")
            for p in _same_launches(direct, again, args):
                failures.append(f"{name} at {t} tokens (shift {shift}): {p}")
    failures += _replay_rules()
    return {"checks": checks, "hits": replayed, "failures": failures}


def _replay_rules() -> list:
    """On a probe launcher: what may and may not be replayed, and what a key holds."""
    from dsv41.backends.triton import bound, conversions, tuning
    from dsv41.backends.triton import replay as R

    probe = bound.bind(_probe)
    failures = []
    ran = []

    def plain(x, y, n, flag):
        ran.append(1)
        probe((1,), x, y, n, 1, 2.0, flag, BLOCK=32, SHIFT=tuning.OVERRIDES.get("shift", 0))

    def allocates(x, y, n, flag):
        ran.append(1)
        y.zero_()
        probe((1,), x, y, n, 1, 2.0, flag, BLOCK=32)

    def address(x, y, n, flag):
        ran.append(1)
        probe((1,), x, y, n, x.data_ptr(), 2.0, flag, BLOCK=32)

    def view(x, y, n, flag):
        ran.append(1)
        probe((1,), x.view(torch.float32), y, n, 1, 2.0, flag, BLOCK=32)

    def offset(x, y, n, flag):
        ran.append(1)
        probe((1,), x[4:], y, n, 1, 2.0, flag, BLOCK=32)

    def offset_address(x, y, n, flag):
        ran.append(1)
        probe((1,), x, y, n, x.data_ptr() + 64, 2.0, flag, BLOCK=32)

    x = torch.arange(64, dtype=torch.int32)
    y = torch.zeros(80)

    def runs(wrapped, *args) -> bool:
        del ran[:]
        wrapped(*args)
        return bool(ran)

    w = R.Replaying(plain)
    runs(w, x, y, 16, True)
    if runs(w, x.clone(), y.clone(), 16, True):
        failures.append("a plain launcher was not replayed")
    if w.record_for(x.clone(), y.clone(), 17, True) is not None:
        failures.append("record_for found a record for an integer argument never called")
    if not runs(w, x.clone(), y.clone(), 17, True):
        failures.append("another integer argument replayed the old record")
    _probe.pre_run_hooks.append(lambda *a, **k: None)  # as a profiler installs one
    try:
        if w.record_for(x.clone(), y.clone(), 16, True) is not None:
            failures.append("record_for gave a record with a pre-run hook on the kernel")
        if not runs(w, x.clone(), y.clone(), 16, True):
            failures.append("a kernel with a pre-run hook replayed")
    finally:
        _probe.pre_run_hooks.pop()
    if w.record_for(x.clone(), y.clone(), 16, True) is None:
        failures.append("record_for gave no record for a replayed call")
    if not runs(w, x[1:], y, 16, True):
        failures.append("another alignment replayed the old record")
    if not runs(w, x.reshape(8, 8), y, 16, True):
        failures.append("another shape replayed the old record")
    if not runs(w, x, y.double(), 16, True):
        failures.append("another dtype replayed the old record")
    tuning.OVERRIDES["shift"] = 8
    try:
        if not runs(w, x, y, 16, True):
            failures.append("a changed tuning override replayed the old record")
    finally:
        del tuning.OVERRIDES["shift"]
    with conversions.forced("integer"):
        if not runs(w, x, y, 16, True):
            failures.append("a forced conversion path replayed the old record")
    for name, fn, x_ in (("allocates", allocates, x), ("passes an address", address, x),
                         ("launches a view", view, x), ("launches a view at an offset", offset, x),
                         ("passes an address inside an argument", offset_address, x)):
        w = R.Replaying(fn)
        for _ in range(R._TRIES + 1):
            runs(w, x_.clone(), y.clone(), 16, True)
        again = runs(w, x_.clone(), y.clone(), 16, True)
        if name == "launches a view" and again:
            failures.append("a launcher that launches a dtype view of an argument was not replayed")
        if name != "launches a view" and not again:
            failures.append(f"a launcher that {name} was replayed")
    os.environ["DSV41_TRITON_SLOW_LAUNCH"] = "1"
    bound._ENABLED = None
    try:
        w = R.Replaying(plain)
        runs(w, x, y, 16, True)
        if not runs(w, x, y, 16, True):
            failures.append("DSV41_TRITON_SLOW_LAUNCH=1 replayed")
    finally:
        del os.environ["DSV41_TRITON_SLOW_LAUNCH"]
        bound._ENABLED = None
    return failures


def time_launchers(tokens: int = 1) -> None:
    import timeit

    from dsv41.backends.triton import bound
    from dsv41.backends.triton.sheet import TRITON_KERNELS
    from dsv41.core import platform as P
    from dsv41.tools import bench as B

    plat = P.probe()
    _recording[0] = False
    print(f"Triton {triton.__version__}, torch {torch.__version__}, {tokens} token(s): us per launcher call")
    print(f"{'variant':48s} {'Triton path':>12s} {'bound':>8s}")
    for v in B.VARIANTS:
        if v.op not in TRITON_KERNELS:
            continue
        case = v.build(B._Gen("cpu", 0), tokens, plat)
        modname, fn = TRITON_KERNELS[v.op].split(":")
        launcher = getattr(importlib.import_module(modname), fn)
        row = []
        for fast in (False, True):
            bound._ENABLED = fast
            for _ in range(200):
                launcher(*case.args)
            row.append(min(timeit.repeat(lambda f=launcher, a=case.args: f(*a), number=2000, repeat=5)) / 2000 * 1e6)
        print(f"{v.name:48s} {row[0]:12.2f} {row[1]:8.2f}", flush=True)
    bound._ENABLED = None


def direct() -> dict:
    """``bound.firing`` against the installed Triton's own NVIDIA launcher: an instance of its
    ``CudaLauncher`` (made without compiling: its attributes set as its ``__init__`` sets them)
    whose compiled ``launch`` records what it receives, called as a launch does through its
    ``__call__`` and through ``firing``'s direct form; both must hand ``launch`` the same."""
    from triton.backends.nvidia.driver import CudaLauncher

    from dsv41.backends.triton import bound

    got: list = []
    failures, checks = [], 0
    kernel_args = (0x7F00_0000_0000, 17, 2.5, True, None, 0x7F00_0000_1000, 64)
    for coop in (False, True):
        for pdl in (False, True):
            for scratch in (0, 256):
                L = object.__new__(CudaLauncher)
                L.num_ctas = 1
                L.global_scratch_size, L.global_scratch_align = scratch, 128
                L.profile_scratch_size, L.profile_scratch_align = 0, 1
                L.launch_cooperative_grid, L.launch_pdl = coop, pdl
                L.gsan_enabled = False
                L.arg_annotations, L.kernel_signature = ["annotations"], b"signature"
                L.launch = lambda *a: got.append(a)
                function, metadata = 0xF00, ("packed", 4, 1, 0)
                fire = bound.firing(L, function, metadata)
                direct = fire.__code__ is not bound.firing(object(), function, metadata).__code__
                want_direct = scratch == 0 and bound._version() in bound._DIRECT_FORMS
                checks += 1
                if direct != want_direct:
                    failures.append(f"coop={coop} pdl={pdl} scratch={scratch}: direct form {direct}, expected {want_direct}")
                if not direct:
                    continue  # with scratch memory the launcher allocates: only its own call is right
                del got[:]
                L(3, 2, 1, STREAM, function, metadata, None, None, None, *kernel_args)
                fire(3, 2, 1, STREAM, kernel_args)
                checks += 1
                if len(got) != 2 or got[0] != got[1]:
                    failures.append(f"coop={coop} pdl={pdl}: __call__ passed {got[:1]}, firing {got[1:]}")
    if set(bound._DIRECT_FORMS) != set(bound.TESTED_TRITON):
        failures.append(f"direct forms for {sorted(bound._DIRECT_FORMS)}, tested releases {bound.TESTED_TRITON}")
    return {"checks": checks, "hits": 0, "failures": failures}


def main(argv) -> int:
    _install()
    what = argv[0] if argv else "unit"
    if what == "time":
        time_launchers(int(argv[1]) if len(argv) > 1 else 1)
        return 0
    if what == "unit":
        res = unit()
    elif what == "replay":
        res = replay(tuple(int(t) for t in argv[1:]) or (1, 17, 64))
    elif what == "direct":
        res = direct()
    else:
        res = ops(tuple(int(t) for t in argv[1:]) or (1, 17, 64))
    res["triton"] = triton.__version__
    print(json.dumps(res))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
