"""The ``torch.ops.dsv41.*`` custom ops: one per kernel, declaring what it mutates.

Every op here has the kernel-contract signature (docs/kernel_contract.md): the
public function has already validated arguments and allocated outputs, so each
op only writes into tensors it was given and returns nothing.  That makes the
fake (meta) implementation trivial and the ops opaque, graph-capturable
boundaries for ``torch.compile``.  The body is one registry lookup keyed by the
tensors' device type, then the kernel.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from . import registry

LIB = "dsv41"


def _define(name: str, mutates: tuple):
    """Register ``fn`` as ``dsv41::name`` whose real body dispatches through the registry."""

    def wrap(fn):
        op = torch.library.custom_op(f"{LIB}::{name}", mutates_args=mutates)(fn)

        @op.register_fake
        def _fake(*args, **kwargs):
            return None

        return op

    return wrap


def _run(name: str, device: torch.device, *args) -> None:
    registry.kernel(name, device.type)(*args)


@_define("quantize_and_insert_k_cache", ("k_cache",))
def quantize_and_insert_k_cache(
    k: Tensor,
    k_cache: Tensor,
    slot_mapping: Tensor,
    block_size: int,
    use_fnuz: bool,
    bytes_per_token: int,
    interleaved: bool = False,
) -> None:
    _run(
        "quantize_and_insert_k_cache", k.device, k, k_cache, slot_mapping, block_size, use_fnuz, bytes_per_token,
        interleaved,
    )


@_define("dequantize_and_gather_k_cache", ("out",))
def dequantize_and_gather_k_cache(
    out: Tensor,
    k_cache: Tensor,
    seq_lens: Tensor,
    gather_lens: Optional[Tensor],
    block_table: Tensor,
    block_size: int,
    offset: int,
    use_fnuz: bool,
    interleaved: bool = False,
) -> None:
    _run(
        "dequantize_and_gather_k_cache", out.device, out, k_cache, seq_lens, gather_lens, block_table, block_size, offset,
        use_fnuz, interleaved,
    )


@_define("compute_global_topk_indices_and_lens", ("global_topk_indices", "topk_lens"))
def compute_global_topk_indices_and_lens(
    topk_indices: Tensor,
    token_to_req_indices: Tensor,
    block_table: Tensor,
    block_size: int,
    is_valid_token: Tensor,
    global_topk_indices: Tensor,
    topk_lens: Tensor,
    compact: bool = False,
) -> None:
    _run(
        "compute_global_topk_indices_and_lens",
        topk_indices.device,
        topk_indices,
        token_to_req_indices,
        block_table,
        block_size,
        is_valid_token,
        global_topk_indices,
        topk_lens,
        compact,
    )


@_define("combine_topk_swa_indices", ("combined_indices", "combined_lens"))
def combine_topk_swa_indices(
    topk_indices: Tensor,
    query_start_loc: Tensor,
    seq_lens: Tensor,
    gather_lens: Tensor,
    window_size: int,
    compress_ratio: int,
    topk: int,
    M: int,
    N: int,
    combined_indices: Tensor,
    combined_lens: Tensor,
) -> None:
    _run(
        "combine_topk_swa_indices",
        topk_indices.device,
        topk_indices,
        query_start_loc,
        seq_lens,
        gather_lens,
        window_size,
        compress_ratio,
        topk,
        M,
        N,
        combined_indices,
        combined_lens,
    )


@_define("build_flashinfer_mixed_sparse_indices", ("sparse_indices", "sparse_topk_lens"))
def build_flashinfer_mixed_sparse_indices(
    decode_swa_indices: Tensor,
    decode_compressed_indices: Optional[Tensor],
    decode_compressed_topk_lens: Optional[Tensor],
    prefill_topk_indices: Tensor,
    query_start_loc: Tensor,
    seq_lens: Tensor,
    token_to_req_indices: Tensor,
    swa_block_table: Tensor,
    swa_block_size: int,
    compressed_block_table: Tensor,
    compressed_block_size: int,
    window_size: int,
    compress_ratio: int,
    topk: int,
    decode_compressed_indices_are_local: bool,
    decode_is_valid_token: Optional[Tensor],
    swa_block_span: int,
    compressed_block_span: int,
    replay_start: Tensor,
    sparse_indices: Tensor,
    sparse_topk_lens: Tensor,
) -> None:
    _run(
        "build_flashinfer_mixed_sparse_indices",
        sparse_indices.device,
        decode_swa_indices,
        decode_compressed_indices,
        decode_compressed_topk_lens,
        prefill_topk_indices,
        query_start_loc,
        seq_lens,
        token_to_req_indices,
        swa_block_table,
        swa_block_size,
        compressed_block_table,
        compressed_block_size,
        window_size,
        compress_ratio,
        topk,
        decode_compressed_indices_are_local,
        decode_is_valid_token,
        swa_block_span,
        compressed_block_span,
        replay_start,
        sparse_indices,
        sparse_topk_lens,
    )


@_define("fused_save_compress_norm", ("state_cache", "latent_out"))
def fused_save_compress_norm(
    kv_score: Tensor,
    positions: Tensor,
    state_cache: Optional[Tensor],
    slot_mapping: Tensor,
    query_start_loc: Optional[Tensor],
    token_to_req_indices: Optional[Tensor],
    rms_norm_weight: Tensor,
    rms_norm_eps: float,
    compress_ratio: int,
    latent_out: Tensor,
    prev_rows: Optional[Tensor] = None,
    prev_row_indices: Optional[Tensor] = None,
) -> None:
    _run(
        "fused_save_compress_norm",
        kv_score.device,
        kv_score,
        positions,
        state_cache,
        slot_mapping,
        query_start_loc,
        token_to_req_indices,
        rms_norm_weight,
        rms_norm_eps,
        compress_ratio,
        latent_out,
        prev_rows,
        prev_row_indices,
    )


@_define("save_ring_rows", ("state_cache",))
def save_ring_rows(rows: Tensor, slot_mapping: Tensor, state_cache: Tensor) -> None:
    _run("save_ring_rows", rows.device, rows, slot_mapping, state_cache)


@_define("rope_quant_insert", ("kv_cache",))
def rope_quant_insert(
    latent: Tensor,
    positions: Tensor,
    cos_sin_cache: Tensor,
    kv_cache: Tensor,
    slot_mapping: Tensor,
    compress_ratio: int,
    fp8_scale: Optional[Tensor],
    sanitize_nans: bool,
    interleaved: bool = False,
) -> None:
    _run(
        "rope_quant_insert",
        latent.device,
        latent,
        positions,
        cos_sin_cache,
        kv_cache,
        slot_mapping,
        compress_ratio,
        fp8_scale,
        sanitize_nans,
        interleaved,
    )


@_define("indexer_k_norm_rope_store", ("k_cache",))
def indexer_k_norm_rope_store(
    k_pre: Tensor,
    positions: Tensor,
    cos_sin_cache: Tensor,
    rms_norm_weight: Tensor,
    rms_norm_eps: float,
    k_cache: Tensor,
    kv_slot_mapping: Tensor,
    compress_ratio: int,
    use_fp4_cache: bool,
    mxfp4_n_per_tile: int,
    tiled: bool,
) -> None:
    _run(
        "indexer_k_norm_rope_store",
        k_pre.device,
        k_pre,
        positions,
        cos_sin_cache,
        rms_norm_weight,
        rms_norm_eps,
        k_cache,
        kv_slot_mapping,
        compress_ratio,
        use_fp4_cache,
        mxfp4_n_per_tile,
        tiled,
    )


@_define("fused_indexer_q_rope_quant", ("q_out", "q_scale_out", "weights_out"))
def fused_indexer_q_rope_quant(
    positions: Tensor,
    index_q: Tensor,
    cos_sin_cache: Tensor,
    index_weights: Tensor,
    softmax_scale: float,
    head_scale: float,
    use_fp4: bool,
    use_fnuz: bool,
    q_out: Tensor,
    q_scale_out: Tensor,
    weights_out: Tensor,
) -> None:
    _run(
        "fused_indexer_q_rope_quant",
        index_q.device,
        positions,
        index_q,
        cos_sin_cache,
        index_weights,
        softmax_scale,
        head_scale,
        use_fp4,
        use_fnuz,
        q_out,
        q_scale_out,
        weights_out,
    )


@_define("fused_inv_rope_fp8_quant", ("out_buf", "scale_buf"))
def fused_inv_rope_fp8_quant(
    o: Tensor,
    positions: Tensor,
    cos_sin_cache: Tensor,
    n_groups: int,
    heads_per_group: int,
    nope_dim: int,
    rope_dim: int,
    quant_group_size: int,
    tma_aligned_scales: bool,
    quantize: bool,
    permuted_output: bool,
    out_buf: Tensor,
    scale_buf: Tensor,
) -> None:
    _run(
        "fused_inv_rope_fp8_quant",
        o.device,
        o,
        positions,
        cos_sin_cache,
        n_groups,
        heads_per_group,
        nope_dim,
        rope_dim,
        quant_group_size,
        tma_aligned_scales,
        quantize,
        permuted_output,
        out_buf,
        scale_buf,
    )


@_define("fused_q_kv_rmsnorm_quant", ("q_out", "q_scale_out", "kv_out"))
def fused_q_kv_rmsnorm_quant(
    qr: Tensor,
    kv: Tensor,
    q_weight: Tensor,
    kv_weight: Tensor,
    eps: float,
    q_out: Tensor,
    q_scale_out: Tensor,
    kv_out: Tensor,
) -> None:
    _run("fused_q_kv_rmsnorm_quant", qr.device, qr, kv, q_weight, kv_weight, eps, q_out, q_scale_out, kv_out)


@_define("pad_fused_q_heads", ("out",))
def pad_fused_q_heads(q: Tensor, out: Tensor) -> None:
    _run("pad_fused_q_heads", q.device, q, out)
