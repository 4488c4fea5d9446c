"""Launch choices shared by the Triton launchers: where decode shapes begin, the lookup of a
measured shape (``python -m dsv41.backends.triton.sweep`` chose them; docs/performance.md),
whether a launch uses programmatic dependent launch (PDL) and the kernels' PDL prologue, and
the launchers' host-side integer helpers."""

from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl

from . import conversions

# Launches of at most this many tokens (rows for the index builders) take the shapes measured
# for latency (CUDA-graph replay at 64 tokens); larger ones those measured for bandwidth.
DECODE_T = 64
# A table may give launches of at most this many tokens a shape of their own (":tiny"; the
# best shape at 1-8 tokens can be a poor one at 64).
TINY_T = 8


def measured(table: dict, key: str, tokens: int | None):
    """``table[key + ":tiny"]`` for a launch of at most TINY_T tokens if present, else
    ``table[key + ":decode"]`` for a decode-sized launch if present, else ``table[key]``,
    else None (the launcher's own heuristics)."""
    if tokens is not None and tokens <= DECODE_T:
        hit = table.get(key + ":tiny") if tokens <= TINY_T else None
        if hit is None:
            hit = table.get(key + ":decode")
        if hit is not None:
            return hit
    return table.get(key)


def size_class(tokens: int | None):
    """The classes ``measured`` tells apart: None (no size given), 0 (at most TINY_T tokens),
    1 (at most DECODE_T), 2 (larger)."""
    if tokens is None:
        return None
    return 0 if tokens <= TINY_T else 1 if tokens <= DECODE_T else 2


def decode_pdl(device, tokens: int) -> bool:
    """PDL for a launch of at most DECODE_T tokens (rows) on ``device`` (``pdl``): the
    launch latency is what such a launch costs, and PDL hides it behind the kernel before."""
    return tokens <= DECODE_T and pdl(device)


def pdl(device) -> bool:
    """Whether a launch on ``device`` uses programmatic dependent launch: NVIDIA SM90+ and a
    Triton with grid-dependency control (``launch_pdl``, ``tl.extra.cuda.gdc_*``).  A kernel
    launched that way may be scheduled while the kernel before it in the stream finishes; it
    calls ``gdc_wait()`` before touching memory, so it still sees everything that kernel
    wrote, and only the launch latency overlaps.  ``DSV41_PDL=0`` turns it off (read once per
    device, like the device's capability)."""
    if device.type != "cuda" or conversions._ROCM_TORCH or not conversions.pdl_allowed():
        return False
    index = device.index
    return _pdl_capable(index if index is not None else torch.cuda.current_device())


@functools.lru_cache(maxsize=None)
def _pdl_capable(index: int) -> bool:
    if os.environ.get("DSV41_PDL", "1") == "0":
        return False
    try:
        from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait  # noqa: F401
    except ImportError:
        return False
    return torch.cuda.get_device_capability(index)[0] >= 9


@triton.jit
def pdl_prologue(PDL: tl.constexpr):
    """First statement of every kernel a launcher may launch with ``pdl_kwargs(True)``: wait
    for the kernels before it in the stream (their writes are then visible), then let the
    next PDL kernel be scheduled at once -- it waits for this one in turn, so only launch
    latencies overlap.  Nothing with PDL off (the interpreter and other vendors never see
    the grid-dependency ops).  One kernel calls it later: CR 2's ring save, whose loads
    read only what the pooling kernel launched just before it never writes
    (cache_kernels._ring_save_kernel)."""
    if PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()


def pdl_kwargs(on: bool) -> dict:
    """Launch keyword for a PDL launch (none otherwise, so Triton builds without the option
    and the interpreter never see it)."""
    return {"launch_pdl": True} if on else {}


def maxnreg_kwargs(regs, nvidia: bool) -> dict:
    """Launch keyword capping registers per thread (ptxas ``maxnreg``) where ``regs`` is set
    and the build is an NVIDIA one (none otherwise: other backends have no such option)."""
    return {"maxnreg": int(regs)} if regs and nvidia else {}


# Host-side integer helpers for the launchers.  ``triton.cdiv`` / ``triton.next_power_of_2``
# are constexpr functions in recent Triton, and calling one from Python goes through
# argument unwrapping (~1-2 us each, several per launch); these are plain integer math.


def cdiv(a: int, b: int) -> int:
    """ceil(a / b) for non-negative ints."""
    return -(-int(a) // int(b))


def pow2(n: int) -> int:
    """The smallest power of two >= max(n, 1)."""
    return 1 << (max(int(n), 1) - 1).bit_length()


# 32- or 64-bit element offsets: a launcher passes int32 offsets to its kernel when every element
# offset its tensors reach is below this (the margin covers a tile's masked lanes, which compute
# offsets past the end without dereferencing them).
I32_SAFE = 2**31 - 2**20


def span(*tensors) -> int:
    """Largest element offset any of the tensors reaches from its storage's start (None and
    empty tensors: 0)."""
    m = 0
    for t in tensors:  # plain loops: this runs on every launch (host time)
        if t is None:
            continue
        n = t.numel()
        if n == 0:
            continue
        if t.is_contiguous():  # the common case, three C calls: offset + numel - 1 exactly
            off = t.storage_offset() + n - 1
        else:
            off = t.storage_offset()
            for size, st in zip(t.shape, t.stride()):
                off += (size - 1) * (st if st >= 0 else -st)
        if off > m:
            m = off
    return m


def layout_span(*layouts) -> int:
    """``span`` from ``(shape, stride)`` pairs (offsets from each tensor's first element), for
    launch plans keyed on integers."""
    m = 0
    for shape, stride in layouts:
        if all(shape):
            m = max(m, sum((n - 1) * abs(st) for n, st in zip(shape, stride)))
    return m
