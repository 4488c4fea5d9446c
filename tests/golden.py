"""The golden vectors of ../shared/vectors (bytes vLLM's kernels wrote on an H200).

Tests read the archive where it lies (``DSV41_VECTORS`` overrides the path).
"""

from __future__ import annotations

import dataclasses
import io
import os
import tarfile
from pathlib import Path

import torch

from dsv41.conformance import _view_on, written_bytes

ROOT = Path(__file__).resolve().parents[1]
ARCHIVE = Path(os.environ.get("DSV41_VECTORS", ROOT.parent / "shared" / "vectors" / "vllm-sm90.tar.xz"))


@dataclasses.dataclass
class Golden:
    name: str
    op: str
    args: dict
    out: dict

    @property
    def id(self):
        return self.name


def load_all() -> list[Golden]:
    if not ARCHIVE.exists():
        return []
    out = []
    with tarfile.open(ARCHIVE, "r:xz") as tf:
        for m in tf.getmembers():
            if m.name.endswith(".pt"):
                d = torch.load(io.BytesIO(tf.extractfile(m).read()), weights_only=True)
                out.append(Golden(Path(m.name).stem, d["op"], d["args"], d["out"]))
    return sorted(out, key=lambda g: g.name)


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
