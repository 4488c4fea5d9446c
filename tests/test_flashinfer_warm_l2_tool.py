"""``tools/flashinfer_warm_l2.py`` on the CPU: the FlashInfer kernel of the commit the tool's
measurement compares against (b8e3a0c) and the current one, in Triton's interpreter, write the
same bytes at both launch shapes (the tool's byte check; the GPU timing itself is not run here).
Skipped where the checkout has no history to read the old kernel from (a shallow clone)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")

ROOT = Path(__file__).resolve().parent.parent
SAFE_PATH = ["-P"] if sys.version_info >= (3, 11) else []
OLD = "b8e3a0c"


def test_old_and_new_kernels_write_the_same_bytes(tmp_path):
    show = subprocess.run(["git", "-C", str(ROOT), "show", f"{OLD}:backends/triton/index_kernels.py"],
                          capture_output=True, text=True)
    if show.returncode != 0:
        pytest.skip(f"commit {OLD} not in this checkout's history: {show.stderr.strip()[:200]}")
    old = tmp_path / "index_kernels_old.py"
    old.write_text(show.stdout)
    env = {**os.environ, "TRITON_INTERPRET": "1", "CUDA_VISIBLE_DEVICES": ""}
    proc = subprocess.run([sys.executable, *SAFE_PATH, str(ROOT / "tools" / "flashinfer_warm_l2.py"), str(old),
                           "--tokens", "40", "70"], env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-4000:]
    rows = [ln for ln in proc.stdout.splitlines() if ln.split()[:1] and ln.split()[0].isdigit()]
    assert len(rows) == 6, proc.stdout
    assert all(ln.endswith("bytes equal") for ln in rows), proc.stdout
