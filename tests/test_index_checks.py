"""Opt-in index-range validation (``DSV41_VALIDATE=1``, ``dsv41.core.index_checks``).

For every op and every bad-index class (block id >= num_blocks, slot beyond the cache,
negative values where they are not allowed, positions beyond the cos/sin cache,
``token_to_req`` out of range, ``gather_lens > seq_lens``, ...):

* with the flag, the check function raises ``ValueError`` naming the op, the argument,
  the bad value and its position, called directly and through the public op (the latter
  is skipped while the public op does not call its check yet);
* without the flag nothing is checked: the check returns and the public op reaches its
  kernel (replaced here by a recorder, so no kernel ever sees an out-of-range index);
* inputs the contract allows (any negative slot, garbage in unread table entries,
  duplicate slots of tokens that do not write, every conformance case) pass.
"""

from __future__ import annotations

import inspect

import pytest
import torch

import dsv41
from dsv41.core import index_checks, op_specs
from dsv41.tools.conformance import CASES

BF16, F32, I32, I64, U8 = torch.bfloat16, torch.float32, torch.int32, torch.int64, torch.uint8


def t32(*v):
    return torch.tensor(v, dtype=I32)


def t64(*v):
    return torch.tensor(v, dtype=I64)


# ------------------------------------------------------------------ valid public-op arguments


def good(op: str) -> dict:
    """Small valid keyword arguments of the public op (fresh tensors every call)."""
    if op == "quantize_and_insert_k_cache":
        return dict(k=torch.zeros(4, 512, dtype=BF16), k_cache=torch.zeros(2, 16, 528, dtype=U8),
                    slot_mapping=t64(0, 5, -1, 31), block_size=16, bytes_per_token=528)
    if op == "dequantize_and_gather_k_cache":
        # request 0 gathers positions 14..19 (blocks 0, 1), request 1 positions 0..4 (block 0)
        return dict(out=torch.zeros(2, 8, 512, dtype=BF16), k_cache=torch.zeros(3, 16, 528, dtype=U8),
                    seq_lens=t32(20, 5), gather_lens=t32(6, 5), block_table=t32(0, 2, 1, 99).view(2, 2),
                    block_size=16, offset=2)
    if op == "compute_global_topk_indices_and_lens":
        return dict(topk_indices=t32(0, 17, -1, 5, -1, -1).view(2, 3), token_to_req_indices=t32(0, 1, 7),
                    block_table=t32(3, 4, 7, 0).view(2, 2), block_size=16, is_valid_token=torch.tensor([True, False]))
    if op == "combine_topk_swa_indices":
        return dict(topk_indices=torch.zeros(4, 3, dtype=I32), query_start_loc=t32(0, 2, 4), seq_lens=t32(10, 3),
                    gather_lens=t32(5, 3), window_size=4, compress_ratio=2, topk=2, M=16, N=8)
    if op == "build_flashinfer_mixed_sparse_indices":
        # one decode row (request 0), two prefill rows (request 1 at positions 18, 19)
        return dict(decode_swa_indices=torch.zeros(1, 8, dtype=I32), decode_compressed_indices=t32(0, 3, -1, 20).view(1, 4),
                    decode_compressed_topk_lens=None, prefill_topk_indices=t32(0, 1, 31, -1, 2, -1, -1, -1).view(2, 4),
                    query_start_loc=t32(0, 1, 3), seq_lens=t32(5, 20), token_to_req_indices=t32(0, 1, 1),
                    swa_block_table=t32(0, 1, 2, 3).view(2, 2), swa_block_size=16,
                    compressed_block_table=t32(4, 5, 6, 7).view(2, 2), compressed_block_size=16, window_size=4,
                    compress_ratio=2, topk=4, decode_compressed_indices_are_local=True,
                    decode_is_valid_token=torch.tensor([True]), replay_start=t32(0, 0))
    if op == "fused_save_compress_norm":
        # CR 2, capacity 4: request 0 (positions 10..12) in ring 0, request 1 (7..9) in ring 2
        return dict(kv_score=torch.zeros(6, 1024), positions=t64(10, 11, 12, 7, 8, 9), state_cache=torch.zeros(3, 4, 1024),
                    slot_mapping=t64(2, 3, 0, 11, 8, 9), query_start_loc=t32(0, 3, 6),
                    token_to_req_indices=t32(0, 0, 0, 1, 1, 1), rms_norm_weight=torch.ones(512, dtype=BF16),
                    rms_norm_eps=1e-6, compress_ratio=2, latent_out=torch.zeros(6, 512, dtype=BF16))
    if op == "save_ring_rows":
        return dict(rows=torch.zeros(4, 1024), slot_mapping=t64(0, 11, -1, 5), state_cache=torch.zeros(3, 4, 1024))
    if op == "rope_quant_insert":
        return dict(latent=torch.zeros(4, 512, dtype=BF16), positions=t64(0, 1, 62, 63), cos_sin_cache=torch.zeros(64, 64),
                    kv_cache=torch.zeros(2, 16, 528, dtype=U8), slot_mapping=t64(0, 1, -1, 31), compress_ratio=1,
                    sanitize_nans=False)
    if op == "indexer_k_norm_rope_store":
        return dict(k_pre=torch.zeros(4, 128, dtype=BF16), positions=t64(0, 1, 62, 63), cos_sin_cache=torch.zeros(64, 64),
                    rms_norm_weight=torch.ones(128, dtype=BF16), rms_norm_eps=1e-6,
                    k_cache=torch.zeros(2, 16, 132, dtype=U8), kv_slot_mapping=t64(0, 1, -1, 31), compress_ratio=1,
                    use_fp4_cache=False, tiled=False)
    if op == "fused_indexer_q_rope_quant":
        return dict(positions=t64(0, 63), index_q=torch.zeros(2, 4, 128, dtype=BF16),
                    index_q_cos_sin_cache=torch.zeros(64, 64), index_weights=torch.zeros(2, 4, dtype=BF16),
                    index_weights_softmax_scale=0.1, index_weights_head_scale=0.5, fp8_dtype=torch.float8_e4m3fn)
    if op == "fused_inv_rope_fp8_quant":
        return dict(o=torch.zeros(2, 8, 512, dtype=BF16), positions=t64(0, 63), cos_sin_cache=torch.zeros(64, 64),
                    n_groups=2, heads_per_group=4)
    if op == "fused_q_kv_rmsnorm_quant":
        return dict(qr=torch.zeros(2, 64, dtype=BF16), kv=torch.zeros(2, 32, dtype=BF16), q_weight=torch.ones(64, dtype=BF16),
                    kv_weight=torch.ones(32, dtype=BF16), eps=1e-6)
    if op == "pad_fused_q_heads":
        return dict(q=torch.zeros(2, 8, 512, dtype=BF16), padded_heads=16)
    if op == "transcode_k_cache":
        return dict(src=torch.zeros(3, 16, 528, dtype=U8), dst=torch.zeros(4, 16, 528, dtype=U8),
                    block_ids=t64(2, -1, 0, 7), src_fnuz=False, dst_fnuz=True)
    raise KeyError(op)


def with_(op, **changes):
    def make():
        kw = good(op)
        for k, v in changes.items():
            kw[k] = v() if callable(v) and not isinstance(v, torch.Tensor) else v
        return kw

    return make


def table(rows, *v):
    return t32(*v).view(rows, -1)


# (id, op, bad kwargs factory, fragments of the message)
BAD = [
    # ---- cache writers: slot beyond the cache, duplicate slots of writing tokens
    ("insert-slot-beyond-cache", "quantize_and_insert_k_cache", with_("quantize_and_insert_k_cache", slot_mapping=t64(0, 5, -1, 32)),
     ["'slot_mapping'", "value 32 at [3]", "num_blocks*block_size (2*16) = 32"]),
    ("insert-slot-int32-beyond", "quantize_and_insert_k_cache", with_("quantize_and_insert_k_cache", slot_mapping=t32(0, 2**31 - 1, -1, 3)),
     ["'slot_mapping'", "2147483647 at [1]"]),
    ("insert-duplicate-slot", "quantize_and_insert_k_cache", with_("quantize_and_insert_k_cache", slot_mapping=t64(0, 5, -1, 5)),
     ["'slot_mapping'", "duplicate slot 5 at [3]"]),
    ("rope-slot-beyond-cache", "rope_quant_insert", with_("rope_quant_insert", slot_mapping=t64(0, 1, -1, 40)),
     ["rope_quant_insert", "'slot_mapping'", "value 40 at [3]", "= 32"]),
    ("rope-duplicate-closing-slot", "rope_quant_insert", with_("rope_quant_insert", slot_mapping=t64(7, 1, -1, 7)),
     ["'slot_mapping'", "duplicate slot 7 at [3]"]),
    ("idxk-slot-beyond-cache", "indexer_k_norm_rope_store", with_("indexer_k_norm_rope_store", kv_slot_mapping=t64(0, 32, -1, 3)),
     ["indexer_k_norm_rope_store", "'kv_slot_mapping'", "value 32 at [1]"]),
    ("idxk-duplicate-slot", "indexer_k_norm_rope_store", with_("indexer_k_norm_rope_store", kv_slot_mapping=t64(4, 4, -1, 3)),
     ["'kv_slot_mapping'", "duplicate slot 4 at [1]"]),
    ("ring-slot-beyond-state", "fused_save_compress_norm", with_("fused_save_compress_norm", slot_mapping=t64(2, 3, 0, 12, 8, 9)),
     ["fused_save_compress_norm", "'slot_mapping'", "value 12 at [3]", "state_cache.shape[0]*capacity (3*4) = 12"]),
    # ---- positions beyond / below the cos/sin cache
    ("rope-position-beyond", "rope_quant_insert", with_("rope_quant_insert", positions=t64(0, 1, 62, 64)),
     ["'positions'", "value 64 at [3]", "cos_sin_cache.shape[0] = 64"]),
    ("rope-position-negative", "rope_quant_insert", with_("rope_quant_insert", positions=t64(-1, 1, 62, 63)),
     ["'positions'", "value -1 at [0]", "0 <= position"]),
    ("idxk-position-beyond", "indexer_k_norm_rope_store", with_("indexer_k_norm_rope_store", positions=t64(0, 100, 62, 63)),
     ["'positions'", "value 100 at [1]", "cos_sin_cache.shape[0] = 64"]),
    ("idxk-position-negative", "indexer_k_norm_rope_store", with_("indexer_k_norm_rope_store", positions=t64(0, 1, 62, -7)),
     ["'positions'", "value -7 at [3]"]),
    ("idxq-position-beyond", "fused_indexer_q_rope_quant", with_("fused_indexer_q_rope_quant", positions=t64(0, 64)),
     ["fused_indexer_q_rope_quant", "'positions'", "value 64 at [1]", "index_q_cos_sin_cache.shape[0] = 64"]),
    ("idxq-position-negative", "fused_indexer_q_rope_quant", with_("fused_indexer_q_rope_quant", positions=t32(-3, 0)),
     ["'positions'", "value -3 at [0]"]),
    ("invrope-position-beyond", "fused_inv_rope_fp8_quant", with_("fused_inv_rope_fp8_quant", positions=t64(65, 0)),
     ["fused_inv_rope_fp8_quant", "'positions'", "value 65 at [0]", "cos_sin_cache.shape[0] = 64"]),
    ("invrope-position-negative", "fused_inv_rope_fp8_quant", with_("fused_inv_rope_fp8_quant", positions=t64(0, -1)),
     ["'positions'", "value -1 at [1]"]),
    ("ring-rows-slot-beyond-state", "save_ring_rows", with_("save_ring_rows", slot_mapping=t64(0, 12, -1, 5)),
     ["save_ring_rows", "'slot_mapping'", "value 12 at [1]", "state_cache.shape[0]*capacity (3*4) = 12"]),
    ("prev-row-index-beyond", "fused_save_compress_norm",
     with_("fused_save_compress_norm", prev_rows=torch.zeros(2, 1024), prev_row_indices=t32(-1, 2)),
     ["fused_save_compress_norm", "'prev_row_indices'", "value 2 at [1]", "prev_rows.shape[0] = 2"]),
    ("ring-position-negative", "fused_save_compress_norm", with_("fused_save_compress_norm", positions=t64(-1, 11, 12, 7, 8, 9)),
     ["'positions'", "value -1 at [0]", "[0, 2^31)"]),
    ("ring-position-past-int32", "fused_save_compress_norm",
     with_("fused_save_compress_norm", positions=t64(2**31 + 1, 11, 12, 7, 8, 9)),
     ["'positions'", f"value {2**31 + 1} at [0]", "[0, 2^31)"]),
    # ---- gather: block ids, lengths, table width, output rows
    ("gather-block-id-beyond", "dequantize_and_gather_k_cache", with_("dequantize_and_gather_k_cache", block_table=table(2, 0, 3, 1, 99)),
     ["dequantize_and_gather_k_cache", "'block_table'", "block id 3 at [0, 1]", "num_blocks = 3"]),
    ("gather-block-id-negative", "dequantize_and_gather_k_cache", with_("dequantize_and_gather_k_cache", block_table=table(2, -1, 2, 1, 99)),
     ["'block_table'", "block id -1 at [0, 0]", "[0, num_blocks = 3)"]),
    ("gather-lens-above-seq-lens", "dequantize_and_gather_k_cache", with_("dequantize_and_gather_k_cache", gather_lens=t32(6, 6)),
     ["'gather_lens'", "length 6 at [1]", "gather_lens[r] <= seq_lens[r]"]),
    ("gather-lens-negative", "dequantize_and_gather_k_cache", with_("dequantize_and_gather_k_cache", gather_lens=t32(-2, 5)),
     ["'gather_lens'", "length -2 at [0]", ">= 0"]),
    ("gather-seq-lens-negative", "dequantize_and_gather_k_cache", with_("dequantize_and_gather_k_cache", seq_lens=t32(20, -1), gather_lens=None, offset=0,
                                                                          out=lambda: torch.zeros(2, 24, 512, dtype=BF16)),
     ["'seq_lens'", "length -1 at [1]"]),
    ("gather-rows-beyond-out", "dequantize_and_gather_k_cache", with_("dequantize_and_gather_k_cache", offset=3),
     ["'gather_lens'", "length 6 at [0]", "offset + n <= out.shape[1] (argument 'offset' = 3, out.shape[1] = 8)"]),
    ("gather-table-too-narrow", "dequantize_and_gather_k_cache", with_("dequantize_and_gather_k_cache", seq_lens=t32(40, 5)),
     ["'seq_lens'", "length 40 at [0]", "inside the width of 'block_table' (2 blocks of 16 = 32 positions)"]),
    # ---- index builders: negative entries read (compute_global_topk_indices_and_lens defines
    # request indices and logical blocks outside its table: see ALLOWED)
    ("topk-negative-block-id", "compute_global_topk_indices_and_lens",
     with_("compute_global_topk_indices_and_lens", block_table=table(2, 3, -1, 7, 0)),
     ["'block_table'", "block id -1 at [0, 1] (read for token 0)", ">= 0"]),
    ("topk-block-id-int32", "compute_global_topk_indices_and_lens",
     with_("compute_global_topk_indices_and_lens", block_table=table(2, 2**30, 4, 7, 0)),
     ["'block_table'", "block id 1073741824 at [0, 0]", "fit int32"]),
    ("combine-gather-above-seq", "combine_topk_swa_indices", with_("combine_topk_swa_indices", gather_lens=t32(11, 3)),
     ["combine_topk_swa_indices", "'gather_lens'", "length 11 at [0]", "gather_lens[b] <= seq_lens[b]"]),
    ("combine-gather-negative", "combine_topk_swa_indices", with_("combine_topk_swa_indices", gather_lens=t32(5, -1)),
     ["'gather_lens'", "length -1 at [1]"]),
    ("combine-seq-below-query", "combine_topk_swa_indices", with_("combine_topk_swa_indices", seq_lens=t32(10, 1)),
     ["'seq_lens'", "length 1 at [1]", "query length"]),
    ("combine-tail-beyond-workspace", "combine_topk_swa_indices", with_("combine_topk_swa_indices", M=12),
     ["'gather_lens'", "length 5 at [0]", "N + gather_lens[b] <= M", "M 12"]),
    ("combine-qsl-decreasing", "combine_topk_swa_indices", with_("combine_topk_swa_indices", query_start_loc=t32(0, 3, 2)),
     ["'query_start_loc'", "offset 2 at [2]", "non-decreasing"]),
    ("flashinfer-token-to-req-beyond", "build_flashinfer_mixed_sparse_indices",
     with_("build_flashinfer_mixed_sparse_indices", token_to_req_indices=t32(0, 2, 1)),
     ["build_flashinfer_mixed_sparse_indices", "'token_to_req_indices'", "value 2 at [1]", "seq_lens.shape[0] = 2"]),
    ("flashinfer-token-outside-request", "build_flashinfer_mixed_sparse_indices",
     with_("build_flashinfer_mixed_sparse_indices", token_to_req_indices=t32(0, 0, 1)),
     ["'token_to_req_indices'", "request index 0 at [1]", "query_start_loc range"]),
    ("flashinfer-seq-below-query", "build_flashinfer_mixed_sparse_indices",
     with_("build_flashinfer_mixed_sparse_indices", seq_lens=t32(5, 1)),
     ["'seq_lens'", "length 1 at [1] (request of row 1)"]),
    ("flashinfer-swa-table-too-narrow", "build_flashinfer_mixed_sparse_indices",
     with_("build_flashinfer_mixed_sparse_indices", seq_lens=t32(5, 40)),
     ["'swa_block_table'", "too narrow: the SWA window of row [1] reads 3 logical blocks", "table width 2"]),
    ("flashinfer-swa-negative-block", "build_flashinfer_mixed_sparse_indices",
     with_("build_flashinfer_mixed_sparse_indices", swa_block_table=table(2, 0, 1, 2, -1)),
     ["'swa_block_table'", "block id -1 at [1, 1] (read for row 1)", ">= 0"]),
    ("flashinfer-prefill-block-past-table", "build_flashinfer_mixed_sparse_indices",
     with_("build_flashinfer_mixed_sparse_indices", prefill_topk_indices=t32(0, 1, 40, -1, 2, -1, -1, -1).view(2, 4)),
     ["'prefill_topk_indices'", "logical block 2 at [0, 2] (row 1)", "width 2 of 'compressed_block_table'"]),
    ("flashinfer-prefill-negative-block", "build_flashinfer_mixed_sparse_indices",
     with_("build_flashinfer_mixed_sparse_indices", compressed_block_table=table(2, 4, 5, 6, -1)),
     ["'compressed_block_table'", "block id -1 at [1, 1]"]),
    ("flashinfer-decode-local-past-table", "build_flashinfer_mixed_sparse_indices",
     with_("build_flashinfer_mixed_sparse_indices", decode_compressed_indices=t32(0, 3, -1, 32).view(1, 4)),
     ["'decode_compressed_indices'", "logical block 2 at [0, 3]"]),
    ("flashinfer-decode-lens-above-k", "build_flashinfer_mixed_sparse_indices",
     with_("build_flashinfer_mixed_sparse_indices", decode_compressed_indices_are_local=False, decode_compressed_topk_lens=t32(5)),
     ["'decode_compressed_topk_lens'", "length 5 at [0]", "[0, K_dec = 4]"]),
    ("ring-token-to-req-beyond", "fused_save_compress_norm",
     with_("fused_save_compress_norm", token_to_req_indices=t32(0, 0, 0, 1, 1, 2)),
     ["'token_to_req_indices'", "value 2 at [5]", "query_start_loc.shape[0]-1 = 2"]),
    ("ring-token-outside-request", "fused_save_compress_norm",
     with_("fused_save_compress_norm", token_to_req_indices=t32(0, 0, 1, 1, 1, 1)),
     ["'token_to_req_indices'", "request index 1 at [2]", "range in 'query_start_loc'"]),
    ("ring-qsl-beyond-tokens", "fused_save_compress_norm",
     with_("fused_save_compress_norm", query_start_loc=t32(0, 3, 7)),
     ["'query_start_loc'", "offset 7 at [2]", "<= the token count 6"]),
]

BAD += [
    ("transcode-duplicate-block-id", "transcode_k_cache", with_("transcode_k_cache", block_ids=t32(2, -1, 0, 2)),
     ["transcode_k_cache", "'block_ids'", "duplicate block id 2 at [3]", "distinct block ids"]),
]

# Inputs the contract allows although they look odd: no error with the flag either.
ALLOWED = [
    ("insert-any-negative-slot-skips", "quantize_and_insert_k_cache", with_("quantize_and_insert_k_cache", slot_mapping=t64(0, -3, -1, -2**40))),
    ("gather-unread-table-entries-garbage", "dequantize_and_gather_k_cache", with_("dequantize_and_gather_k_cache", block_table=table(2, 0, 2, 1, -77))),
    ("gather-zero-length-request", "dequantize_and_gather_k_cache", with_("dequantize_and_gather_k_cache", gather_lens=t32(6, 0), block_table=table(2, 0, 2, -1, -1))),
    ("topk-negative-indices-are-empty", "compute_global_topk_indices_and_lens",
     with_("compute_global_topk_indices_and_lens", topk_indices=t32(-5, 17, -1, -1, -1, -1).view(2, 3), token_to_req_indices=t32(0, 9))),
    # request indices outside the table and logical blocks past its width: entries −1, not counted
    ("topk-token-to-req-beyond", "compute_global_topk_indices_and_lens",
     with_("compute_global_topk_indices_and_lens", token_to_req_indices=t32(0, 2))),
    ("topk-token-to-req-negative", "compute_global_topk_indices_and_lens",
     with_("compute_global_topk_indices_and_lens", token_to_req_indices=t32(-1, 1))),
    ("topk-block-past-table", "compute_global_topk_indices_and_lens",
     with_("compute_global_topk_indices_and_lens", topk_indices=t32(0, 40, -1, 5, -1, -1).view(2, 3))),
    ("topk-block-past-table-compact", "compute_global_topk_indices_and_lens",
     with_("compute_global_topk_indices_and_lens", topk_indices=t32(0, 40, -1, 5, -1, 2**31 - 1).view(2, 3),
           token_to_req_indices=t32(0, 2**31 - 1), compact=True)),
    ("rope-slot-skipped-position-unchecked", "rope_quant_insert", with_("rope_quant_insert", positions=t64(0, 1, 999, 63), slot_mapping=t64(0, 1, -1, 31))),
    ("rope-cr2-non-closing-shares-slot", "rope_quant_insert",
     with_("rope_quant_insert", positions=t64(0, 1, 2, 3), slot_mapping=t64(5, 5, 6, 6), compress_ratio=2)),
    ("ring-cr1-any-slot", "fused_save_compress_norm",
     with_("fused_save_compress_norm", compress_ratio=1, kv_score=lambda: torch.zeros(6, 512), slot_mapping=t64(10**9, -5, 0, 0, 1, 2))),
    ("ring-duplicate-ring-rows-in-long-chunk", "fused_save_compress_norm",
     with_("fused_save_compress_norm", positions=t64(10, 11, 12, 13, 14, 15), slot_mapping=t64(2, 3, 0, 1, 2, 3),
           query_start_loc=t32(0, 6), token_to_req_indices=t32(0, 0, 0, 0, 0, 0))),
    ("transcode-negative-and-past-cache-ids-skip", "transcode_k_cache",
     with_("transcode_k_cache", block_ids=t64(-1, -5, 3, 3, 99, 1))),  # 3 is past src's 3 pages: skipped, so no race
    ("flashinfer-replay-above-position", "build_flashinfer_mixed_sparse_indices",
     with_("build_flashinfer_mixed_sparse_indices", replay_start=t32(0, 19), swa_block_table=table(2, 0, 1, -1, 3))),
]


# ------------------------------------------------------------------ helpers


@pytest.fixture
def validate_on(monkeypatch):
    monkeypatch.setenv(index_checks.ENV, "1")
    assert index_checks.refresh()
    yield
    monkeypatch.undo()
    index_checks.refresh()


@pytest.fixture
def validate_off(monkeypatch):
    monkeypatch.delenv(index_checks.ENV, raising=False)
    assert not index_checks.refresh()
    yield
    monkeypatch.undo()
    index_checks.refresh()


def check_fn(op):
    name = op_specs.spec(op).index_check
    return getattr(index_checks, name) if name else (lambda: None)


def call_check(op, kw):
    fn = check_fn(op)
    params = inspect.signature(fn).parameters
    return fn(**{k: v for k, v in kw.items() if k in params})


class KernelRecorder:
    """Stands in for every kernel (``dsv41.core.registry.kernel``): records the calls."""

    def __init__(self):
        self.calls = []

    def kernel(self, op, device_type):
        def run(*args, **kwargs):
            self.calls.append(op)

        return run


def public(op):
    if op == "transcode_k_cache":
        from dsv41.transcode import transcode_k_cache

        return transcode_k_cache
    return getattr(dsv41, op)


def wired(op) -> bool:
    return f"check_{op}" in inspect.getsource(public(op))


@pytest.fixture
def recorder(monkeypatch):
    """Every torch.ops.dsv41 op dispatches through ``registry.kernel``: record instead of
    running a kernel (no kernel ever sees an out-of-range index here)."""
    from dsv41.core import registry

    rec = KernelRecorder()
    monkeypatch.setattr(registry, "kernel", rec.kernel)
    return rec


def assert_message(exc, op, fragments):
    msg = str(exc.value)
    assert msg.startswith(op + ": "), msg
    for f in fragments:
        assert f in msg, f"{f!r} not in {msg!r}"
    assert index_checks.ENV in msg


# ------------------------------------------------------------------ tests


def test_every_op_has_one_check():
    """Each declared check takes kernel arguments by their names, which are also the public
    function's; the ops declared without one take no index argument."""
    for s in op_specs.SPECS:
        if s.index_check is None:
            assert not any(n.endswith(("slot_mapping", "indices", "positions", "block_table", "block_ids"))
                           for n in s.arg_names), s.name
            continue
        params = set(inspect.signature(check_fn(s.name)).parameters)
        pub = set(inspect.signature(public(s.name)).parameters)
        assert params <= set(s.arg_names), f"{s.index_check} takes {params - set(s.arg_names)}, not kernel arguments"
        assert params <= pub, f"{s.index_check} takes {params - pub}, not arguments of {s.name}"


def test_env_read_once(monkeypatch):
    monkeypatch.setenv(index_checks.ENV, "1")
    assert index_checks.refresh() is True
    monkeypatch.setenv(index_checks.ENV, "0")
    assert index_checks.validate_enabled() is True  # cached until refresh()
    assert index_checks.refresh() is False
    monkeypatch.undo()
    index_checks.refresh()


def _ops():
    from dsv41.core.registry import OPS

    return OPS


@pytest.mark.parametrize("op", _ops())
def test_good_inputs_pass(op, validate_on, recorder):
    call_check(op, good(op))
    public(op)(**good(op))
    assert recorder.calls == [op]


@pytest.mark.parametrize("case", [b for b in BAD], ids=[b[0] for b in BAD])
def test_bad_index_direct(case, validate_on):
    _, op, make, fragments = case
    with pytest.raises(ValueError) as exc:
        call_check(op, make())
    assert_message(exc, op, fragments)


@pytest.mark.parametrize("case", [b for b in BAD], ids=[b[0] for b in BAD])
def test_bad_index_via_public_op(case, validate_on, recorder):
    _, op, make, fragments = case
    if not wired(op):
        pytest.skip(f"{op} does not call index_checks.check_{op} yet")
    with pytest.raises(ValueError) as exc:
        public(op)(**make())
    assert_message(exc, op, fragments)
    assert recorder.calls == [], "the kernel ran although the index check failed"


@pytest.mark.parametrize("case", [b for b in BAD], ids=[b[0] for b in BAD])
def test_without_flag_nothing_is_checked(case, validate_off, recorder):
    _, op, make, _ = case
    assert call_check(op, make()) is None
    public(op)(**make())  # reaches the (recorded) kernel: no index check ran
    assert recorder.calls == [op]


@pytest.mark.parametrize("case", ALLOWED, ids=[a[0] for a in ALLOWED])
def test_allowed_inputs_pass(case, validate_on, recorder):
    _, op, make = case
    call_check(op, make())
    public(op)(**make())
    assert recorder.calls == [op]


def test_conformance_cases_pass(validate_on):
    """No false positives on the kernel arguments of every conformance case."""
    for case in CASES:
        index_checks.check_kernel_args(case.op, case.build("cpu"))


def test_one_sync_when_valid(validate_on, monkeypatch):
    """A valid call synchronizes once (one ``.tolist()`` of the stacked flags)."""
    calls = []
    real = torch.Tensor.tolist

    def counting(self):
        calls.append(tuple(self.shape))
        return real(self)

    monkeypatch.setattr(torch.Tensor, "tolist", counting)
    call_check("build_flashinfer_mixed_sparse_indices", good("build_flashinfer_mixed_sparse_indices"))
    assert len(calls) == 1
