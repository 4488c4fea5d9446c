"""The bound Triton launcher (``backends/triton/bound.py``) launches what Triton's own path
launches: the same compiled kernel, grid, stream and arguments, for every launcher.  The checks
run in a child process (``tests/bound_launch_check.py``: a stand-in driver that compiles for
sm_90 on this CPU and records launches instead of making them); on a GPU, ``tests/test_gpu.py``
compares the bytes both paths write."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

triton = pytest.importorskip("triton")

from dsv41.backends.triton import bound  # noqa: E402

CHECK = Path(__file__).with_name("bound_launch_check.py")
SAFE_PATH = ["-P"] if sys.version_info >= (3, 11) else []


def _run(*args) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "DSV41_TRITON_SLOW_LAUNCH")}
    proc = subprocess.run([sys.executable, *SAFE_PATH, str(CHECK), *args], env=env, capture_output=True,
                          text=True, timeout=1200)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _tested_triton() -> bool:
    return ".".join(triton.__version__.split(".")[:2]) in bound.TESTED_TRITON


@pytest.mark.skipif(not _tested_triton(), reason=f"Triton {triton.__version__}: bound launches are off")
def test_bound_launch_matches_triton_on_a_probe_kernel():
    """Aligned and misaligned pointers, integers equal to 1, multiples of 16 and past int32,
    bool / int / float positionals, constexprs given and defaulted, a launch option; a repeated
    call finds its kept kernel; a launch hook or DSV41_TRITON_SLOW_LAUNCH=1 takes Triton's path."""
    res = _run("unit")
    assert res["failures"] == []
    assert res["checks"] >= 28 and res["hits"] >= 14


@pytest.mark.skipif(not _tested_triton(), reason=f"Triton {triton.__version__}: bound launches are off")
def test_bound_launch_matches_triton_for_every_launcher():
    """Every shared Triton launcher on the bench's inputs at 1, 17 and 64 tokens."""
    res = _run("ops", "1", "17", "64")
    assert res["failures"] == []
    assert res["checks"] >= 60


@pytest.mark.skipif(not _tested_triton(), reason=f"Triton {triton.__version__}: bound launches are off")
def test_replayed_launches_match_the_launchers():
    """``backends/triton/replay.py``: for every shared Triton launcher on the bench's inputs at
    1, 17 and 64 tokens, a call with a recorded launch key on new tensors launches what the
    launcher launches on them, without running it; on a probe launcher, another integer,
    alignment, shape, dtype, tuning override or forced conversion path is another key, and a
    launcher that runs a PyTorch operation, launches a view at an offset into an argument or
    passes an address inside one as an integer is never replayed (one that launches a dtype
    view of an argument is)."""
    res = _run("replay", "1", "17", "64")
    assert res["failures"] == []
    assert res["checks"] >= 60 and res["hits"] == res["checks"]


@pytest.mark.skipif(not _tested_triton(), reason=f"Triton {triton.__version__}: bound launches are off")
def test_direct_launch_passes_what_tritons_launcher_passes():
    """``bound.firing``: for Triton's NVIDIA launcher (this release's own class and
    ``__call__``), the compiled launch function receives the same arguments from the direct
    form as from the launcher, with and without cooperative grids and PDL; a kernel that needs
    scratch memory keeps the launcher's own call; a direct form exists for every tested release."""
    res = _run("direct")
    assert res["failures"] == []
    assert res["checks"] == 12


def test_current_device_read_without_the_lazy_init_once_cuda_is_up(monkeypatch):
    """A driver whose ``get_current_device`` is ``torch.cuda.current_device`` is read through the
    C function that ends in once CUDA is initialized; before that through the driver's own,
    which hands over once a call finds CUDA initialized; any other driver's own always."""
    import torch

    raw = lambda: 7  # noqa: E731
    monkeypatch.setattr(torch._C, "_cuda_getDevice", raw, raising=False)
    up = [False]
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: up[0])
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 7)

    class Cuda:
        get_current_device = staticmethod(torch.cuda.current_device)

    class Other:
        @staticmethod
        def get_current_device():
            return 3

    drv = bound._Driver()
    drv.last = Cuda
    first = drv._device_getter(Cuda)
    drv.device = first
    assert first is not raw and first() == 7 and drv.device is first  # CUDA not up: stays
    up[0] = True
    assert first() == 7 and drv.device is raw  # hands over
    assert drv._device_getter(Cuda) is raw
    assert drv._device_getter(Other) is Other.get_current_device


def test_untested_triton_takes_triton_path(monkeypatch):
    monkeypatch.setattr(bound, "TESTED_TRITON", ())
    monkeypatch.setattr(bound, "_ENABLED", None)
    assert not bound.enabled()


def test_interpreter_functions_are_forwarded():
    """Under Triton's interpreter there is nothing to bind: the launcher is ``kernel[grid]``."""
    calls = []

    class Interp:
        def __getitem__(self, grid):
            return lambda *a, **k: calls.append((grid, a, k))

    Interp.__name__ = "InterpretedFunction"
    bound.bind(Interp())((3,), 1, X=2)
    assert calls == [((3,), (1,), {"X": 2})]


def test_every_triton_launch_is_bound():
    """No launcher of the shared Triton kernels calls ``kernel[grid](...)`` itself: each launches
    through its ``bind(kernel)`` launcher (a new kernel left on Triton's path would still work,
    only slower on the host)."""
    import ast

    root = Path(__file__).resolve().parents[1] / "backends" / "triton"
    direct = []
    for path in sorted(root.glob("*.py")):
        if path.name in ("sweep.py", "aot.py", "sass.py"):  # tools: compile, never launch per call
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Subscript)
                    and isinstance(node.func.value, ast.Name) and node.func.value.id.endswith("_kernel")):
                direct.append(f"{path.name}:{node.lineno} {node.func.value.id}[...](...)")
    assert direct == [], direct
    bound_names = {n for p in root.glob("*.py") for n in ast.parse(p.read_text()).body
                   if isinstance(n, ast.Assign) and isinstance(n.value, ast.Call)
                   and getattr(n.value.func, "id", None) == "bind"}
    assert len(bound_names) >= 15
