"""CPU kernel of ``transcode_k_cache`` (C++/OpenMP in ``transcode.cpp``; rules in
``dsv41/transcode.py``).

Kernel-contract signature (docs/kernel_contract.md): validated arguments, ``dst`` written in
place, ``None`` returned.  The caches are addressed through ``data_ptr()`` (storage offset
included) and ``stride(0)``, so views and padded pages are written in place and page padding
is never touched; only ``block_ids`` is converted to contiguous int64 when it is not already.
"""

from __future__ import annotations

import ctypes

import torch

from ._build import build_error as _build_error
from ._build import load_typed

__all__ = ["transcode_k_cache", "build_error", "library"]

LIB_NAME = "dsv41_cpu_transcode"
SOURCES = ["transcode.cpp"]

_P = ctypes.c_void_p
_I64 = ctypes.c_int64
_I32 = ctypes.c_int32

_SIGNATURES = {"dsv41_transcode_k_cache": [_P, _I64, _P, _I64, _P, _I64, _I64, _I64, _I32, _I32, _I32, _I32]}


def library() -> ctypes.CDLL:
    """The compiled library with its argument types set (built on first use, then cached)."""
    return load_typed(LIB_NAME, SOURCES, _SIGNATURES)


def build_error() -> str | None:
    """None if the library builds and loads, else the reason (for the capability sheet)."""
    return _build_error(LIB_NAME, SOURCES)


def transcode_k_cache(src, dst, block_ids, block_size, width, src_fnuz, dst_fnuz, tiled) -> None:
    n = block_ids.shape[0]
    if n == 0:
        return
    ids = block_ids.reshape(-1)
    if ids.dtype != torch.int64:
        ids = ids.to(torch.int64)
    ids = ids.contiguous()
    rc = library().dsv41_transcode_k_cache(
        src.data_ptr(), src.stride(0), dst.data_ptr(), dst.stride(0),
        ids.data_ptr(), n, min(src.shape[0], dst.shape[0]), int(block_size),
        int(width), int(bool(src_fnuz)), int(bool(dst_fnuz)), int(bool(tiled)),
    )
    if rc != 0:
        raise ValueError(f"transcode_k_cache: CPU kernel rejected its arguments (code {rc})")
