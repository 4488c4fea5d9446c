"""Paged K-cache management and sparse-attention index ops (seed module ``cache_utils``).

Each public function checks its arguments (``_validate.Check``), allocates its
outputs, and runs the implementation the registry chose for the tensors'
device through the ``torch.ops.dsv41`` custom op.  Byte-level behaviour:
spec cache_ops.md §3-§7; project decisions: docs/decisions.md.
"""

from __future__ import annotations

import inspect

import torch

from .core import _calls
from .core import index_checks as _ic
from .core._validate import INT_INDEX, Check
from .core import registry as _registry
from .core.accepted_layouts import AcceptedLayouts
from .core.formats import (
    DEFAULT_V41_LAYOUT,
    V4_BYTES_PER_TOKEN,
    V41_BYTES_PER_TOKEN,
    V41_LAYOUTS,
    V41_MXFP8,
    V41_NVFP4,
    V41_NVFP4_BYTES_PER_TOKEN,
    interleaved_for,
)

# vLLM 0.33's names for the V4.1 record geometry (dsv41.core.formats holds the records).
V41_QUANT_BLOCK = V41_MXFP8.group
V41_NUM_SCALES = V41_MXFP8.n_groups
V41_NVFP4_QUANT_BLOCK = V41_NVFP4.group
V41_NVFP4_NUM_SCALES = V41_NVFP4.n_groups

# vLLM 0.33's gather launch width: one worker per 8 gathered rows, 128 to 8192 workers.
_GATHER_ROWS_PER_WORKER = 8
_GATHER_WORKERS = (128, 8192)

__all__ = [
    "quantize_and_insert_k_cache",
    "dequantize_and_gather_k_cache",
    "dequantize_and_gather_k_cache_triton",
    "gather_num_workers",
    "V4_BYTES_PER_TOKEN",
    "V41_BYTES_PER_TOKEN",
    "V41_QUANT_BLOCK",
    "V41_NUM_SCALES",
    "V41_NVFP4_BYTES_PER_TOKEN",
    "V41_NVFP4_QUANT_BLOCK",
    "V41_NVFP4_NUM_SCALES",
    "compute_global_topk_indices_and_lens",
    "combine_topk_swa_indices",
    "build_flashinfer_mixed_sparse_indices",
]

_ops = _calls.ops
I32 = torch.int32
_accepted = {name: AcceptedLayouts() for name in ("insert", "gather", "global_topk", "combine", "flashinfer")}


def quantize_and_insert_k_cache(
    k: torch.Tensor,
    k_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    block_size: int = 64,
    is_ue8m0: bool = True,
    use_fnuz: bool = False,
    bytes_per_token: int = V4_BYTES_PER_TOKEN,
    *,
    v41_layout: str = DEFAULT_V41_LAYOUT,
) -> None:
    """Quantize K (``[>=T, 512]`` bf16) and insert it into the paged K cache.

    ``bytes_per_token`` picks the record: 584 (V4: 448 fp8 + 64 bf16 RoPE dims)
    or 528 (V4.1 MXFP8, all 512 dims).  ``use_fnuz`` picks the cache's fp8
    flavour (FNUZ e4m3, clamp 224) and is legal on every platform: the flavour
    belongs to the cache.  ``T = slot_mapping.shape[0]`` (DP padding rows of
    ``k`` past T are never read); a negative slot skips a token.
    ``v41_layout`` (keyword-only) places the 528 record's scales: ``"interleaved"``
    (vLLM 0.33, the default) or ``"paged"`` (vLLM's development snapshot); see
    ``dsv41.core.formats``.
    """
    new = _accepted["insert"].new((
        k, k_cache, slot_mapping, block_size, is_ue8m0, use_fnuz, bytes_per_token, v41_layout,
    ))
    if new is not None:
        c = Check("quantize_and_insert_k_cache")
        c.tensor("k", k, dtype=torch.bfloat16, ndim=2)
        c.size("k", k, 1, expected=512)
        c.stride("k", k, 1, expected=1)
        c.stride("k", k, 0, expected=512)
        c.integer("bytes_per_token", bytes_per_token, choices=(V4_BYTES_PER_TOKEN, V41_BYTES_PER_TOKEN))
        c.integer("block_size", block_size, min_value=1)
        c.paged_cache("k_cache", k_cache, block_size, bytes_per_token)
        c.tensor("slot_mapping", slot_mapping, dtype=INT_INDEX, ndim=1)
        c.size("k", k, 0, at_least=slot_mapping.shape[0])
        c.flag("is_ue8m0", is_ue8m0)
        if not is_ue8m0:
            c.fail("is_ue8m0", "True (only UE8M0 power-of-two scales exist in these records)", is_ue8m0)
        c.flag("use_fnuz", use_fnuz)
        c.choice("v41_layout", v41_layout, V41_LAYOUTS)
        _accepted["insert"].add(new)
    if slot_mapping.shape[0] == 0:
        return
    _ic.check_quantize_and_insert_k_cache(k, k_cache, slot_mapping, block_size)
    _ops.quantize_and_insert_k_cache(
        k, k_cache, slot_mapping, block_size, use_fnuz, bytes_per_token, interleaved_for(bytes_per_token, v41_layout)
    )


def gather_num_workers(max_gather_len: int | None) -> int:
    """vLLM 0.33's launch width (programs per request) for a gather of at most
    ``max_gather_len`` rows: 128 when unknown, else ``ceil(n / 8)`` within [128, 8192].

    dsv41's kernels size their own grids; this is kept for callers that size buffers
    or graphs with it."""
    if max_gather_len is None:
        return _GATHER_WORKERS[0]
    if isinstance(max_gather_len, bool) or not isinstance(max_gather_len, int):
        raise TypeError(f"gather_num_workers: argument 'max_gather_len' expected an int or None, "
                        f"got {type(max_gather_len).__name__}")
    workers = -(-max_gather_len // _GATHER_ROWS_PER_WORKER)
    return max(_GATHER_WORKERS[0], min(_GATHER_WORKERS[1], workers))


def dequantize_and_gather_k_cache(
    out: torch.Tensor,
    k_cache: torch.Tensor,
    seq_lens: torch.Tensor,
    gather_lens: torch.Tensor | None,
    block_table: torch.Tensor,
    block_size: int,
    offset: int,
    use_fnuz: bool = False,
    max_gather_len: int | None = None,
    *,
    v41_layout: str = DEFAULT_V41_LAYOUT,
    _kernel_attribute: str | None = None,
) -> None:
    """Dequantize and gather a paged K cache into ``out[r, offset:offset+n]`` (bf16).

    The record is read off ``k_cache.shape[-1]`` (584, 528 or 288).  Request r
    gathers its last ``n = gather_lens[r]`` tokens (all ``seq_lens[r]`` when
    ``gather_lens`` is None); other rows of ``out`` are left untouched.
    ``use_fnuz`` must match the writer of this cache (ignored for NVFP4).
    ``max_gather_len`` is accepted for vLLM compatibility; it only sized vLLM's
    launch grid and changes nothing here.  ``v41_layout`` (keyword-only) says
    where the 528 / 288 records keep their scales (``dsv41.core.formats``).
    """
    new = _accepted["gather"].new((
        out, k_cache, seq_lens, gather_lens, block_table, block_size, offset, use_fnuz, max_gather_len,
        v41_layout, _kernel_attribute,
    ))
    if new is not None:
        c = Check("dequantize_and_gather_k_cache")
        c.tensor("out", out, dtype=torch.bfloat16, ndim=3)
        c.size("out", out, 2, expected=512)
        c.stride("out", out, 2, expected=1)
        c.tensor("k_cache", k_cache, dtype=torch.uint8, ndim=3)
        if k_cache.shape[-1] not in (584, 528, 288):
            c.fail("k_cache", "a last dim of 584, 528 or 288 bytes", f"shape {tuple(k_cache.shape)}")
        c.integer("block_size", block_size, min_value=1)
        c.paged_cache("k_cache", k_cache, block_size, k_cache.shape[-1])
        c.tensor("seq_lens", seq_lens, dtype=I32, ndim=1)
        c.size("out", out, 0, at_least=seq_lens.shape[0])
        c.tensor("gather_lens", gather_lens, dtype=I32, ndim=1, optional=True)
        if gather_lens is not None:
            c.size("gather_lens", gather_lens, 0, expected=seq_lens.shape[0])
        c.tensor("block_table", block_table, dtype=I32, ndim=2)
        c.size("block_table", block_table, 0, at_least=seq_lens.shape[0])
        c.stride("block_table", block_table, 1, expected=1)
        c.integer("offset", offset, min_value=0)
        c.flag("use_fnuz", use_fnuz)
        if max_gather_len is not None:
            c.integer("max_gather_len", max_gather_len, min_value=0)
        c.choice("v41_layout", v41_layout, V41_LAYOUTS)
        _accepted["gather"].add(new)
    if seq_lens.shape[0] == 0:
        return
    _ic.check_dequantize_and_gather_k_cache(out, k_cache, seq_lens, gather_lens, block_table, block_size, offset)
    args = (
        out, k_cache, seq_lens, gather_lens, block_table, block_size, offset, use_fnuz,
        interleaved_for(k_cache.shape[-1], v41_layout),
    )
    if _kernel_attribute is None:
        _ops.dequantize_and_gather_k_cache(*args)
    else:
        kernel = _registry.preferred_kernel("dequantize_and_gather_k_cache", out.device.type, _kernel_attribute)
        _calls.stop_if_capturing("dequantize_and_gather_k_cache", args, kernel)
        kernel(*args)


def _gather_preferring(attribute: str, name: str, doc: str):
    """``dequantize_and_gather_k_cache`` run by the kernel of the first backend whose sheet sets
    ``attribute``, with the public signature (less the private keyword)."""

    def gather(*args, **kwargs):
        dequantize_and_gather_k_cache(*args, **kwargs, _kernel_attribute=attribute)

    sig = inspect.signature(dequantize_and_gather_k_cache)
    gather.__signature__ = sig.replace(parameters=[p for p in sig.parameters.values() if not p.name.startswith("_")])
    gather.__name__ = gather.__qualname__ = name
    gather.__doc__ = doc
    return gather


dequantize_and_gather_k_cache_triton = _gather_preferring(
    "triton_source",
    "dequantize_and_gather_k_cache_triton",
    """``dequantize_and_gather_k_cache`` through a Triton kernel where one runs on ``out``'s
    device (cuda:triton, rocm, xpu), else the selected implementation: the bytes are the same
    either way.""",
)


def compute_global_topk_indices_and_lens(
    topk_indices: torch.Tensor,
    token_to_req_indices: torch.Tensor,
    block_table: torch.Tensor,
    block_size: int,
    is_valid_token: torch.Tensor,
    *,
    compact: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Map local top-k indices to global cache slots and count valid entries.

    Returns ``(global_topk_indices [N, K] int32, topk_lens [N] int32)``.  An entry
    is valid when it is ``>= 0``, its token's request index is a row of
    ``block_table`` and its logical block ``x // block_size`` is inside the
    table's width; every other entry becomes −1 and is not counted.  Without
    ``compact`` (keyword-only) the −1 holes stay in place; with it each row's
    valid entries move to its front in their original order, −1 after them.
    Padding tokens (``is_valid_token`` False) get length 0 but their row is
    still translated (and compacted).
    """
    new = _accepted["global_topk"].new((
        topk_indices, token_to_req_indices, block_table, block_size, is_valid_token, compact,
    ))
    if new is not None:
        c = Check("compute_global_topk_indices_and_lens")
        c.tensor("topk_indices", topk_indices, dtype=I32, ndim=2)
        c.stride("topk_indices", topk_indices, 1, expected=1)
        c.tensor("token_to_req_indices", token_to_req_indices, dtype=I32, ndim=1)
        c.size("token_to_req_indices", token_to_req_indices, 0, at_least=topk_indices.shape[0])
        c.tensor("block_table", block_table, dtype=I32, ndim=2)
        c.stride("block_table", block_table, 1, expected=1)
        c.integer("block_size", block_size, min_value=1)
        c.tensor("is_valid_token", is_valid_token, dtype=torch.bool, ndim=1)
        c.size("is_valid_token", is_valid_token, 0, at_least=topk_indices.shape[0])
        c.flag("compact", compact)
        _accepted["global_topk"].add(new)
    n = topk_indices.shape[0]
    out = torch.empty(n, topk_indices.shape[1], dtype=I32, device=topk_indices.device)
    lens = torch.empty(n, dtype=I32, device=topk_indices.device)
    if n > 0:
        _ic.check_compute_global_topk_indices_and_lens(topk_indices, token_to_req_indices, block_table, block_size, is_valid_token)
        _ops.compute_global_topk_indices_and_lens(
            topk_indices, token_to_req_indices, block_table, block_size, is_valid_token, out, lens, compact
        )
    return out, lens


def combine_topk_swa_indices(
    topk_indices: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    gather_lens: torch.Tensor,
    window_size: int,
    compress_ratio: int,
    topk: int,
    M: int,
    N: int,
    out: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sparse-prefill index rows into a gathered workspace (spec cache_ops.md §6).

    Request b owns rows ``[b*M, (b+1)*M)`` of the workspace: compressed tokens
    at ``b*M + j`` and its SWA tail at ``b*M + N + i``.  Returns
    ``(combined_indices [T, roundup(topk + window_size, 128)], combined_lens [T])``;
    ``out`` reuses preallocated buffers of those shapes.
    """
    new = _accepted["combine"].new((
        topk_indices, query_start_loc, seq_lens, gather_lens, window_size, compress_ratio, topk, M, N, out,
    ))
    if new is not None:
        c = Check("combine_topk_swa_indices")
        c.tensor("topk_indices", topk_indices, dtype=I32, ndim=2)
        c.stride("topk_indices", topk_indices, 1, expected=1)
        c.tensor("query_start_loc", query_start_loc, dtype=I32, ndim=1)
        c.size("query_start_loc", query_start_loc, 0, at_least=1)
        num_reqs = query_start_loc.shape[0] - 1
        c.tensor("seq_lens", seq_lens, dtype=I32, ndim=1)
        c.size("seq_lens", seq_lens, 0, at_least=num_reqs)
        c.tensor("gather_lens", gather_lens, dtype=I32, ndim=1)
        c.size("gather_lens", gather_lens, 0, at_least=num_reqs)
        c.integer("window_size", window_size, min_value=0)
        c.integer("compress_ratio", compress_ratio, min_value=0)
        c.integer("topk", topk, min_value=0)
        c.size("topk_indices", topk_indices, 1, at_least=topk)
        c.integer("M", M, min_value=0)
        c.integer("N", N, min_value=0)
        if out is not None:
            if not isinstance(out, (tuple, list)) or len(out) != 2:
                c.fail("out", "a (combined_indices, combined_lens) tuple or None", type(out).__name__, TypeError)
            t = topk_indices.shape[0]
            c.tensor("out[0]", out[0], dtype=I32, ndim=2)
            c.size("out[0]", out[0], 0, expected=t)
            c.size("out[0]", out[0], 1, expected=(topk + window_size + 127) // 128 * 128)
            c.stride("out[0]", out[0], 1, expected=1)
            c.tensor("out[1]", out[1], dtype=I32, ndim=1)
            c.size("out[1]", out[1], 0, expected=t)
        _accepted["combine"].add(new)
    t = topk_indices.shape[0]
    if out is None:
        width = (topk + window_size + 127) // 128 * 128
        idx = torch.empty(t, width, dtype=I32, device=topk_indices.device)
        lens = torch.empty(t, dtype=I32, device=topk_indices.device)
    else:
        idx, lens = out
    if t > 0:
        _ic.check_combine_topk_swa_indices(topk_indices, query_start_loc, seq_lens, gather_lens, window_size, compress_ratio, topk, M, N)
        _ops.combine_topk_swa_indices(
            topk_indices, query_start_loc, seq_lens, gather_lens, window_size, compress_ratio, topk, M, N, idx, lens
        )
    return idx, lens


def build_flashinfer_mixed_sparse_indices(
    decode_swa_indices: torch.Tensor,
    decode_compressed_indices: torch.Tensor | None,
    decode_compressed_topk_lens: torch.Tensor | None,
    prefill_topk_indices: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    token_to_req_indices: torch.Tensor,
    swa_block_table: torch.Tensor,
    swa_block_size: int,
    compressed_block_table: torch.Tensor | None,
    compressed_block_size: int,
    window_size: int,
    compress_ratio: int,
    topk: int,
    decode_compressed_indices_are_local: bool = False,
    decode_is_valid_token: torch.Tensor | None = None,
    swa_block_span: int | None = None,
    compressed_block_span: int | None = None,
    *,
    replay_start: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Build the FlashInfer DSV4 sparse-index matrix for decode-first batches.

    Returns ``sparse_indices [D+P, W_swa + roundup4(max(topk, K_dec))]`` (SWA
    slot ids, then compressed slot ids, −1 padded) and ``sparse_topk_lens
    [D+P]``.  Rows are 16-byte aligned for FlashInfer's vectorized loads.
    ``replay_start`` lower-bounds every prefill token's SWA window.
    """
    new = _accepted["flashinfer"].new((
        decode_swa_indices, decode_compressed_indices, decode_compressed_topk_lens, prefill_topk_indices,
        query_start_loc, seq_lens, token_to_req_indices, swa_block_table, swa_block_size,
        compressed_block_table, compressed_block_size, window_size, compress_ratio, topk,
        decode_compressed_indices_are_local, decode_is_valid_token, swa_block_span, compressed_block_span,
        replay_start,
    ))
    if new is not None:
        c = Check("build_flashinfer_mixed_sparse_indices")
        c.tensor("decode_swa_indices", decode_swa_indices, dtype=I32, ndim=2)
        c.stride("decode_swa_indices", decode_swa_indices, 1, expected=1)
        w_swa = decode_swa_indices.shape[1]
        c.integer("window_size", window_size, min_value=0)
        if w_swa < window_size:
            c.fail("decode_swa_indices", f"width >= window_size ({window_size})", f"shape {tuple(decode_swa_indices.shape)}")
        c.tensor("prefill_topk_indices", prefill_topk_indices, dtype=I32, ndim=2)
        c.stride("prefill_topk_indices", prefill_topk_indices, 1, expected=1)
        d = decode_swa_indices.shape[0]
        p = prefill_topk_indices.shape[0]
        c.tensor("query_start_loc", query_start_loc, dtype=I32, ndim=1)
        c.tensor("seq_lens", seq_lens, dtype=I32, ndim=1)
        c.tensor("token_to_req_indices", token_to_req_indices, dtype=I32, ndim=1)
        c.size("token_to_req_indices", token_to_req_indices, 0, at_least=d + p)
        c.tensor("replay_start", replay_start, dtype=I32, ndim=1)
        c.size("replay_start", replay_start, 0, at_least=seq_lens.shape[0])
        c.size("query_start_loc", query_start_loc, 0, at_least=seq_lens.shape[0] + 1)
        c.tensor("swa_block_table", swa_block_table, dtype=I32, ndim=2)
        c.stride("swa_block_table", swa_block_table, 1, expected=1)
        c.integer("swa_block_size", swa_block_size, min_value=1)
        c.integer("compressed_block_size", compressed_block_size, min_value=1)
        c.integer("compress_ratio", compress_ratio, min_value=0)
        c.integer("topk", topk, min_value=0)
        c.flag("decode_compressed_indices_are_local", decode_compressed_indices_are_local)
        k_dec = 0
        if decode_compressed_indices is not None:
            c.tensor("decode_compressed_indices", decode_compressed_indices, dtype=I32, ndim=2)
            c.stride("decode_compressed_indices", decode_compressed_indices, 1, expected=1)
            c.size("decode_compressed_indices", decode_compressed_indices, 0, expected=d)
            k_dec = decode_compressed_indices.shape[1]
        if decode_compressed_topk_lens is not None:
            c.tensor("decode_compressed_topk_lens", decode_compressed_topk_lens, dtype=I32, ndim=1)
            c.size("decode_compressed_topk_lens", decode_compressed_topk_lens, 0, at_least=d)
        if k_dec > 0 and decode_compressed_indices_are_local:
            if decode_is_valid_token is None:
                c.fail("decode_is_valid_token", "a bool tensor when decode indices are local", "None", TypeError)
            c.tensor("decode_is_valid_token", decode_is_valid_token, dtype=torch.bool, ndim=1)
            c.size("decode_is_valid_token", decode_is_valid_token, 0, at_least=d)
        if compressed_block_table is not None:
            c.tensor("compressed_block_table", compressed_block_table, dtype=I32, ndim=2)
            c.stride("compressed_block_table", compressed_block_table, 1, expected=1)
        if swa_block_span is not None:
            c.integer("swa_block_span", swa_block_span, min_value=1)
        if compressed_block_span is not None:
            c.integer("compressed_block_span", compressed_block_span, min_value=1)
        _accepted["flashinfer"].add(new)
    d = decode_swa_indices.shape[0]
    p = prefill_topk_indices.shape[0]
    w_swa = decode_swa_indices.shape[1]
    k_dec = 0 if decode_compressed_indices is None else decode_compressed_indices.shape[1]
    if not (k_dec > 0 and decode_compressed_indices_are_local):
        decode_is_valid_token = None
    if compressed_block_table is None:
        compressed_block_table = swa_block_table
    swa_span = swa_block_size if swa_block_span is None else swa_block_span
    comp_span = compressed_block_size if compressed_block_span is None else compressed_block_span
    padded_topk = (max(topk, k_dec) + 3) // 4 * 4
    dev = decode_swa_indices.device
    sparse_indices = torch.empty(d + p, w_swa + padded_topk, dtype=I32, device=dev)
    sparse_topk_lens = torch.empty(d + p, dtype=I32, device=dev)
    if d + p == 0:
        return sparse_indices, sparse_topk_lens
    args = (
        decode_swa_indices, decode_compressed_indices, decode_compressed_topk_lens, prefill_topk_indices,
        query_start_loc, seq_lens, token_to_req_indices, swa_block_table, swa_block_size, compressed_block_table,
        compressed_block_size, window_size, compress_ratio, topk, decode_compressed_indices_are_local,
        decode_is_valid_token, swa_span, comp_span, replay_start, sparse_indices, sparse_topk_lens,
    )
    _ic.check_kernel_args("build_flashinfer_mixed_sparse_indices", args)
    _ops.build_flashinfer_mixed_sparse_indices(*args)
    return sparse_indices, sparse_topk_lens
