"""Always-on index checks of the CPU kernels (C++ pre-scans in ``bounds.cpp``).

A CPU kernel follows slots, block ids, lengths, request indices and positions as raw
pointers, so an index outside its tensor would write past a cache or crash the process.
Before a kernel runs, its launcher scans the index vectors (one vectorized pass over the
indices, never over the data: about 4 us per call at 1 to 16384 tokens, measured on the
2-core CI machine, 0.3-1.2 % of the kernels at 16384 tokens) and, on a hit, raises the
``ValueError`` that ``DSV41_VALIDATE=1`` gives -- op, argument, position, value, valid
range (``dsv41.core.index_checks.enforce``) -- before anything is written.  The rule per
argument is docs/bad_input.md's table.
"""

from __future__ import annotations

import ctypes

import torch

from dsv41.core import index_checks

from ._build import load_typed

__all__ = ["first_outside", "gather_first_bad", "save_first_bad", "reject"]

_P, _I32, _I64 = ctypes.c_void_p, ctypes.c_int32, ctypes.c_int64
_IDX = [_P, _I32, _I64]  # pointer, is-int64, element stride

_SIGNATURES = {
    "dsv41_first_outside": _IDX + [_I64, _I64, _I64, _I32] + _IDX,
    "dsv41_gather_first_bad": _IDX + _IDX + [_I64] + _IDX + [_I64] * 5 + [_I64],
    "dsv41_save_first_bad": _IDX + [_I64] + _IDX + _IDX + _IDX + [_I64, _I64] + _IDX + [_I64, _I64],
}

_lib = None


def _library():
    global _lib
    if _lib is None:
        lib = load_typed("dsv41_cpu_bounds", ["bounds.cpp"], _SIGNATURES)
        for name in _SIGNATURES:
            getattr(lib, name).restype = ctypes.c_int64
        _lib = lib
    return _lib


def _vec(t: torch.Tensor | None):
    """(pointer, is-int64, element stride) of a 1-D int32/int64 vector (None -> null)."""
    if t is None:
        return (None, 0, 0)
    if t.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"index vector of dtype {t.dtype}: expected int32 or int64")
    return (t.data_ptr(), int(t.dtype == torch.int64), t.stride(0) if t.dim() else 0)


def first_outside(v: torch.Tensor, n: int, lo: int, hi: int, skip_negative: bool = False,
                  mask: torch.Tensor | None = None) -> int:
    """First i < n with ``v[i]`` outside ``[lo, hi)`` (negative values allowed with
    ``skip_negative``; only where ``mask[i] >= 0`` when a mask is given), else -1."""
    return _library().dsv41_first_outside(*_vec(v), n, lo, hi, int(skip_negative), *_vec(mask))


def gather_first_bad(seq_lens, gather_lens, block_table, num_blocks: int, block_size: int,
                     offset: int, out_rows: int) -> int:
    """First request whose gather would leave ``out``, the block table or the cache, else -1."""
    bt = block_table
    return _library().dsv41_gather_first_bad(
        *_vec(seq_lens), *_vec(gather_lens), seq_lens.shape[0],
        bt.data_ptr(), int(bt.dtype == torch.int64), bt.stride(0), bt.stride(1), bt.shape[1],
        num_blocks, block_size, offset, out_rows,
    )


def save_first_bad(slot_mapping, positions, token_to_req_indices, query_start_loc, ring_slots: int,
                   prev_row_indices=None, prev_rows_n: int = 0) -> int:
    """fused_save_compress_norm (CR 2): -1 when every index it follows is inside its tensor."""
    R = query_start_loc.shape[0] - 1
    return _library().dsv41_save_first_bad(
        *_vec(slot_mapping), slot_mapping.shape[0], *_vec(positions), *_vec(token_to_req_indices),
        *_vec(query_start_loc), R, ring_slots,
        *_vec(prev_row_indices), 0 if prev_row_indices is None else prev_row_indices.shape[0], prev_rows_n,
    )


def reject(op: str, args: list, arg: str) -> None:
    """Raise the typed error for kernel arguments a pre-scan found out of range."""
    index_checks.enforce(op, args)
    # The scans never flag more than index_checks rejects; this is the backstop.
    raise ValueError(f"{op}: argument '{arg}' holds an index outside the tensor it addresses "
                     "(see docs/bad_input.md)")
