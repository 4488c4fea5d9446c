"""The golden vectors of ``tests/vectors`` (bytes vLLM's kernels wrote on an H200).

``DSV41_VECTORS`` overrides where they are read: a directory holding the archives, or the
set-A archive itself.  A missing archive is an error, never a silent skip.
"""

from __future__ import annotations

import dataclasses
import functools
import io
import os
import tarfile
from pathlib import Path

import torch

from dsv41.tools.conformance import _view_on, written_bytes

ROOT = Path(__file__).resolve().parents[1]
SET_FILES = {
    "A": "vllm-sm90.tar.xz",
    "C": "vllm-sm90-setC.tar.xz",
    "D": "vllm-sm90-setD-0.33.0.tar.xz",
    "E": "vllm-interp-0.33.0.tar.xz",
}
# Sets A and C come from vLLM's development snapshot, which keeps the V4.1 records' scales per
# page; sets D and E from the released vLLM 0.33.0 (dsv41's default, interleaved records).
SET_KWARGS = {"A": {"v41_layout": "paged"}, "C": {"v41_layout": "paged"}, "D": {}, "E": {}}
# Sets or single cases with a known, explained difference (none at present: every set is
# reproduced byte for byte; tests/vectors/README.md).
KNOWN_DIFFERENT_SETS: dict = {}
KNOWN_DIFFERENT_CASES: dict = {}


def archive(set_name: str = "A") -> Path:
    """Path of one set's archive (it may not exist: callers fail loudly)."""
    override = os.environ.get("DSV41_VECTORS")
    if override:
        p = Path(override)
        if p.is_dir():
            return p / SET_FILES[set_name]
        if set_name == "A":
            return p
        return p.parent / SET_FILES[set_name]
    return ROOT / "tests" / "vectors" / SET_FILES[set_name]


ARCHIVE = archive("A")


@dataclasses.dataclass
class Golden:
    name: str
    op: str
    args: dict
    out: dict
    set: str = "A"

    @property
    def id(self):
        return self.name if self.set == "A" else f"set{self.set}-{self.name}"

    @property
    def known_difference(self) -> str | None:
        return KNOWN_DIFFERENT_SETS.get(self.set) or KNOWN_DIFFERENT_CASES.get((self.set, self.name))

    def call_kwargs(self, fn) -> dict:
        """The set's layout keywords that ``fn`` accepts."""
        import inspect

        params = inspect.signature(fn).parameters
        return {k: v for k, v in SET_KWARGS.get(self.set, {}).items() if k in params}


@functools.lru_cache(maxsize=None)
def _read(path: str) -> tuple:
    out = []
    with tarfile.open(path, "r:xz") as tf:
        for m in tf.getmembers():
            if m.name.endswith(".pt"):
                d = torch.load(io.BytesIO(tf.extractfile(m).read()), weights_only=True)
                out.append((Path(m.name).stem, d))
    return tuple(sorted(out, key=lambda x: x[0]))


def load_set(set_name: str = "A") -> list[Golden]:
    """Every case of one set; FileNotFoundError names the missing archive."""
    path = archive(set_name)
    if not path.is_file():
        raise FileNotFoundError(
            f"golden vectors (set {set_name}) not found at {path}; they ship in tests/vectors "
            f"(DSV41_VECTORS overrides the location)"
        )
    return [Golden(name, d["op"], d["args"], d["out"], set_name) for name, d in _read(str(path))]


def load_all(sets=("A",)) -> list[Golden]:
    out = []
    for s in sets:
        out.extend(load_set(s))
    return out


def clone_view(t: torch.Tensor, device="cpu") -> torch.Tensor:
    """Copy of ``t`` with its whole backing storage, same view (size, stride, offset)."""
    return _view_on(t, device)


def clone_value(v, device="cpu"):
    if isinstance(v, torch.Tensor):
        return clone_view(v, device)
    if isinstance(v, (tuple, list)):
        return type(v)(clone_value(x, device) for x in v)
    return v


storage_bytes = written_bytes  # the whole backing storage as uint8 on the CPU


def view_bytes(t: torch.Tensor) -> torch.Tensor:
    """Bytes of the logical elements of ``t`` (layout-independent)."""
    return t.detach().cpu().contiguous().view(torch.uint8).flatten()


def returned(result) -> list:
    """A return value as the list of tensors a case's ``out`` names (a ``QuantizedActivation``,
    dsv41's or vLLM's, is its data and scale; a plain int is a 0-d tensor)."""
    if result is None:
        return []
    flat = []
    for r in result if isinstance(result, tuple) else (result,):
        if hasattr(r, "data") and hasattr(r, "scale") and not isinstance(r, torch.Tensor):
            flat.extend((r.data, r.scale))
        elif isinstance(r, int):
            flat.append(torch.tensor(r))
        else:
            flat.append(r)
    return flat


def outputs(case_out: dict, args: dict, result) -> dict:
    """name -> tensor written or returned, for the names of a case's ``out``."""
    it = iter(returned(result))
    got = {}
    for key in case_out:
        t = args[key] if key in args else next(it)
        got[key] = t[0] if isinstance(t, tuple) else t
    return got


def differences(got: dict, want: dict) -> list[str]:
    """Whole-storage byte comparison (the view's bytes where the storages differ in size)."""
    problems = []
    for key, w in want.items():
        g = got[key]
        if storage_bytes(g).numel() == storage_bytes(w).numel():
            a, b = storage_bytes(g), storage_bytes(w)
        else:
            a, b = view_bytes(g), view_bytes(w)
        if not torch.equal(a, b):
            bad = (a != b).nonzero().flatten()
            problems.append(f"{key}: {bad.numel()} of {b.numel()} bytes differ (first offsets {bad[:8].tolist()})")
    return problems
