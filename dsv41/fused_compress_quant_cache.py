"""V4.1 compressor state saving/compression and independently schedulable cache insertion
(seed module ``fused_compress_quant_cache``; spec cache_ops.md §8)."""

from __future__ import annotations

import torch

from .core import _calls
from .core import index_checks as _ic
from .core import platform as _platform
from .core._validate import INT_INDEX, Check
from .core.accepted_layouts import AcceptedLayouts
from .core.formats import DEFAULT_V41_LAYOUT, V41_LAYOUTS, interleaved_for

__all__ = ["fused_save_compress_norm", "save_ring_rows", "rope_quant_insert"]

_ops = _calls.ops
_accepted = {name: AcceptedLayouts() for name in ("save_compress", "save_ring_rows", "rope_insert")}


def fused_save_compress_norm(
    kv_score: torch.Tensor,
    positions: torch.Tensor,
    state_cache: torch.Tensor | None,
    slot_mapping: torch.Tensor,
    query_start_loc: torch.Tensor | None,
    token_to_req_indices: torch.Tensor | None,
    rms_norm_weight: torch.Tensor,
    rms_norm_eps: float,
    compress_ratio: int,
    latent_out: torch.Tensor,
    prev_rows: torch.Tensor | None = None,
    prev_row_indices: torch.Tensor | None = None,
) -> None:
    """Pool (CR 2: softmax over a position pair), RMSNorm and save ring state.

    Writes ``latent_out`` (bf16 ``[rows, 512]``) for every token that closes a
    compression group and has a slot >= 0; CR 2 also copies the chunk's last
    ``capacity`` kv/score rows into the request's ring in ``state_cache``.
    Rows not written keep their previous contents.

    ``prev_rows`` (fp32 ``[rows, 1024]``, CR 2; e.g. rows gathered from other
    context-parallel ranks) with ``prev_row_indices`` (``[>= num_reqs]``): request
    r's first token pools with ``prev_rows[prev_row_indices[r]]`` instead of its
    ring row where that index is >= 0, and the ring is not written — the caller
    stores it with ``save_ring_rows``.  Both are ignored for CR 1.
    """
    new = _accepted["save_compress"].new((
        kv_score, positions, state_cache, slot_mapping, query_start_loc, token_to_req_indices, rms_norm_weight,
        rms_norm_eps, compress_ratio, latent_out, prev_rows, prev_row_indices,
    ))
    if new is not None:
        c = Check("fused_save_compress_norm")
        c.integer("compress_ratio", compress_ratio, choices=(1, 2))
        c.tensor("kv_score", kv_score, dtype=torch.float32, ndim=2)
        c.size("kv_score", kv_score, 1, expected=512 * compress_ratio)
        c.stride("kv_score", kv_score, 1, expected=1)
        c.stride("kv_score", kv_score, 0, multiple_of=16)
        c.tensor("positions", positions, dtype=INT_INDEX, ndim=1)
        c.contiguous("positions", positions)
        c.tensor("slot_mapping", slot_mapping, dtype=INT_INDEX, ndim=1)
        c.contiguous("slot_mapping", slot_mapping)
        t = slot_mapping.shape[0]
        c.size("kv_score", kv_score, 0, at_least=t)
        c.size("positions", positions, 0, at_least=t)
        c.tensor("rms_norm_weight", rms_norm_weight, dtype=torch.bfloat16, ndim=1)
        c.size("rms_norm_weight", rms_norm_weight, 0, expected=512)
        c.contiguous("rms_norm_weight", rms_norm_weight)
        c.number("rms_norm_eps", rms_norm_eps)
        c.tensor("latent_out", latent_out, dtype=torch.bfloat16, ndim=2)
        c.size("latent_out", latent_out, 0, expected=kv_score.shape[0])
        c.size("latent_out", latent_out, 1, expected=512)
        c.contiguous("latent_out", latent_out)
        if compress_ratio == 2:
            c.tensor("state_cache", state_cache, dtype=torch.float32, ndim=3)
            c.size("state_cache", state_cache, 2, expected=1024)
            c.stride("state_cache", state_cache, 2, expected=1)
            c.stride("state_cache", state_cache, 1, multiple_of=16)
            c.tensor("query_start_loc", query_start_loc, dtype=torch.int32, ndim=1)
            c.contiguous("query_start_loc", query_start_loc)
            c.size("query_start_loc", query_start_loc, 0, at_least=1)
            c.tensor("token_to_req_indices", token_to_req_indices, dtype=torch.int32, ndim=1)
            c.contiguous("token_to_req_indices", token_to_req_indices)
            c.size("token_to_req_indices", token_to_req_indices, 0, at_least=t)
            if prev_rows is not None or prev_row_indices is not None:
                c.tensor("prev_rows", prev_rows, dtype=torch.float32, ndim=2)
                c.size("prev_rows", prev_rows, 1, expected=1024)
                c.stride("prev_rows", prev_rows, 1, expected=1)
                c.stride("prev_rows", prev_rows, 0, multiple_of=16)
                c.tensor("prev_row_indices", prev_row_indices, dtype=INT_INDEX, ndim=1)
                c.contiguous("prev_row_indices", prev_row_indices)
                c.size("prev_row_indices", prev_row_indices, 0, at_least=query_start_loc.shape[0] - 1)
        _accepted["save_compress"].add(new)
    t = slot_mapping.shape[0]
    if compress_ratio != 2:
        state_cache = query_start_loc = token_to_req_indices = None  # CR 1 keeps no state
        prev_rows = prev_row_indices = None
    if t == 0:
        return
    _ic.check_fused_save_compress_norm(
        positions, state_cache, slot_mapping, query_start_loc, token_to_req_indices, compress_ratio,
        prev_rows, prev_row_indices,
    )
    _ops.fused_save_compress_norm(
        kv_score, positions, state_cache, slot_mapping, query_start_loc, token_to_req_indices,
        rms_norm_weight, float(rms_norm_eps), compress_ratio, latent_out, prev_rows, prev_row_indices,
    )


def save_ring_rows(rows: torch.Tensor, slot_mapping: torch.Tensor, state_cache: torch.Tensor) -> None:
    """Store fp32 ``[kv | score]`` rows (``[N, 1024]``) to their ring slots.

    Row i goes to ``state_cache[s // capacity, s % capacity]`` for ``s =
    slot_mapping[i] >= 0``; a negative slot skips the row.  This is the ring
    update ``fused_save_compress_norm`` leaves to the caller when given
    ``prev_rows``.  Two rows with one slot: which one stays is unspecified.
    """
    new = _accepted["save_ring_rows"].new((rows, slot_mapping, state_cache))
    if new is not None:
        c = Check("save_ring_rows")
        c.tensor("rows", rows, dtype=torch.float32, ndim=2)
        c.size("rows", rows, 1, expected=1024)
        c.stride("rows", rows, 1, expected=1)
        c.tensor("slot_mapping", slot_mapping, dtype=INT_INDEX, ndim=1)
        c.size("slot_mapping", slot_mapping, 0, expected=rows.shape[0])
        c.contiguous("slot_mapping", slot_mapping)
        c.tensor("state_cache", state_cache, dtype=torch.float32, ndim=3)
        c.size("state_cache", state_cache, 2, expected=1024)
        c.stride("state_cache", state_cache, 2, expected=1)
        _accepted["save_ring_rows"].add(new)
    if rows.shape[0] == 0:
        return
    _ic.check_save_ring_rows(rows, slot_mapping, state_cache)
    _ops.save_ring_rows(rows, slot_mapping, state_cache)


def rope_quant_insert(
    latent: torch.Tensor,
    positions: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    compress_ratio: int,
    fp8_scale: torch.Tensor | None = None,
    *,
    sanitize_nans: bool | None = None,
    v41_layout: str = DEFAULT_V41_LAYOUT,
) -> None:
    """RoPE + quantize the compressed latent and write it into the compressed cache.

    ``kv_cache`` is a uint8 paged cache of record 584 / 528 / 288 bytes, or
    plain ``[num_blocks, B, 512]`` rows of bf16 or float8_e4m3fn (the latter
    with a 1-element fp32 ``fp8_scale``).  Tokens with a negative slot or
    that do not close a compression group are skipped.  ``sanitize_nans``
    (keyword-only, default: on for gfx950, which reads scale code 255 as NaN)
    clamps scale codes to 254 and replaces NaN rotated values by 0.
    ``v41_layout`` (keyword-only) places the 528 / 288 records' scales:
    ``"interleaved"`` (vLLM 0.33, the default) or ``"paged"`` (``dsv41.core.formats``).
    """
    new = _accepted["rope_insert"].new((
        latent, positions, cos_sin_cache, kv_cache, slot_mapping, compress_ratio, fp8_scale, sanitize_nans,
        v41_layout,
    ))
    if new is not None:
        c = Check("rope_quant_insert")
        c.integer("compress_ratio", compress_ratio, choices=(1, 2))
        c.tensor("latent", latent, dtype=torch.bfloat16, ndim=2)
        c.size("latent", latent, 1, expected=512)
        c.contiguous("latent", latent)
        c.tensor("positions", positions, dtype=INT_INDEX, ndim=1)
        c.tensor("slot_mapping", slot_mapping, dtype=INT_INDEX, ndim=1)
        t = slot_mapping.shape[0]
        c.size("latent", latent, 0, at_least=t)
        c.size("positions", positions, 0, at_least=t)
        c.cos_sin("cos_sin_cache", cos_sin_cache, rope_dim=64)
        c.tensor("kv_cache", kv_cache, dtype=(torch.uint8, torch.bfloat16, torch.float8_e4m3fn), ndim=3)
        b = kv_cache.shape[1]
        if kv_cache.dtype == torch.uint8:
            if kv_cache.shape[2] not in (584, 528, 288):
                c.fail("kv_cache", "a uint8 record width of 584, 528 or 288 (unsupported paged KV record width)",
                       f"shape {tuple(kv_cache.shape)}")
            c.paged_cache("kv_cache", kv_cache, b, kv_cache.shape[2])
        else:
            c.size("kv_cache", kv_cache, 2, expected=512)
            c.stride("kv_cache", kv_cache, 2, expected=1)
        if kv_cache.dtype == torch.float8_e4m3fn:
            c.tensor("fp8_scale", fp8_scale, dtype=torch.float32)
            if fp8_scale.numel() != 1:
                c.fail("fp8_scale", "a 1-element tensor", f"shape {tuple(fp8_scale.shape)}")
        if sanitize_nans is not None:
            c.flag("sanitize_nans", sanitize_nans)
        c.choice("v41_layout", v41_layout, V41_LAYOUTS)
        _accepted["rope_insert"].add(new)
    t = slot_mapping.shape[0]
    if kv_cache.dtype != torch.float8_e4m3fn:
        fp8_scale = None
    if sanitize_nans is None:
        sanitize_nans = _platform.probe().arch == "gfx950"
    if t == 0:
        return
    interleaved = kv_cache.dtype == torch.uint8 and interleaved_for(kv_cache.shape[2], v41_layout)
    _ic.check_rope_quant_insert(positions, cos_sin_cache, kv_cache, slot_mapping, compress_ratio)
    _ops.rope_quant_insert(
        latent, positions, cos_sin_cache, kv_cache, slot_mapping, compress_ratio, fp8_scale, sanitize_nans, interleaved
    )
