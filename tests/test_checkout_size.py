"""The tracked tree stays small enough to travel to the GPU host beside the CuTe DSL bundle.

A call to the GPU host carries the working tree and the bundle (``.device/cutedsl.tar.xz``,
56 116 444 bytes for nvidia-cutlass-dsl 4.8.1, docs/gpu.md) under one 64 MiB limit, so the
tracked files get what is left, less room for the run scripts and a baseline archive carried
beside them.  Bulky measurement logs are the usual way to outgrow it: the machine-readable ones
under ``docs/measurements/`` are stored xz-compressed (docs/performance.md).
"""

from __future__ import annotations

import pathlib
import shutil
import subprocess

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
CARRY_LIMIT = 64 * 2**20
CUTEDSL_BUNDLE = 56_116_444
SCRIPT_ROOM = 512 * 2**10
TREE_LIMIT = CARRY_LIMIT - CUTEDSL_BUNDLE - SCRIPT_ROOM


def _tracked_files() -> list[pathlib.Path]:
    if shutil.which("git") is None or not (ROOT / ".git").exists():
        pytest.skip("not a git checkout: the tracked tree is what a GPU call carries")
    out = subprocess.run(
        ["git", "-C", str(ROOT), "ls-files", "-z"], capture_output=True, check=True
    ).stdout
    return [ROOT / name.decode() for name in out.split(b"\0") if name]


def test_tracked_tree_fits_beside_the_cutedsl_bundle():
    sizes = {p: p.stat().st_size for p in _tracked_files() if p.is_file()}
    total = sum(sizes.values())
    largest = sorted(sizes.items(), key=lambda kv: -kv[1])[:5]
    assert total <= TREE_LIMIT, (
        f"tracked files take {total} bytes, over the {TREE_LIMIT} that fit beside the CuTe DSL "
        "bundle in one GPU call; largest: "
        + ", ".join(f"{p.relative_to(ROOT)} ({n})" for p, n in largest)
    )


def test_measurement_data_is_compressed():
    plain = [
        str(p.relative_to(ROOT))
        for p in _tracked_files()
        if p.parent == ROOT / "docs" / "measurements" and p.suffix in (".json", ".jsonl")
    ]
    assert not plain, f"store these xz-compressed (xz -9e FILE) and cite the .xz name: {plain}"
