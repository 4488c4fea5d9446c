"""Bad input gets a clear TypeError/ValueError naming the op, the argument, what was
expected and what came.  CI also runs this file under ``python -O`` (no assert)."""

from __future__ import annotations

import pytest
import torch

import dsv41

BF16, I32, I64, U8 = torch.bfloat16, torch.int32, torch.int64, torch.uint8


def k(n=4):
    return torch.zeros(n, 512, dtype=BF16)


def cache(width=528, nb=2, b=16):
    return torch.zeros(nb, b, width, dtype=U8)


def slots(n=4):
    return torch.arange(n, dtype=I64)


CS = torch.zeros(64, 64)

# (call, exception type, fragments the message must contain)
BAD = {
    "k wrong dtype": (lambda: dsv41.quantize_and_insert_k_cache(k().float(), cache().view(2, -1), slots(), 16, bytes_per_token=528),
                      TypeError, ["quantize_and_insert_k_cache", "'k'", "bfloat16", "float32"]),
    "k wrong width": (lambda: dsv41.quantize_and_insert_k_cache(torch.zeros(4, 256, dtype=BF16), cache().view(2, -1), slots(), 16, bytes_per_token=528),
                      ValueError, ["'k'", "size 512"]),
    "k not a tensor": (lambda: dsv41.quantize_and_insert_k_cache([1, 2], cache(), slots(), 16),
                       TypeError, ["'k'", "torch.Tensor", "list"]),
    "record width": (lambda: dsv41.quantize_and_insert_k_cache(k(), cache().view(2, -1), slots(), 16, bytes_per_token=600),
                     ValueError, ["'bytes_per_token'", "528", "600"]),
    "page too small": (lambda: dsv41.quantize_and_insert_k_cache(k(), torch.zeros(2, 100, dtype=U8), slots(), 16, bytes_per_token=528),
                       ValueError, ["'k_cache'", "size >= 8448"]),
    "is_ue8m0 False": (lambda: dsv41.quantize_and_insert_k_cache(k(), cache().view(2, -1), slots(), 16, is_ue8m0=False, bytes_per_token=528),
                       ValueError, ["'is_ue8m0'", "True"]),
    "too few k rows": (lambda: dsv41.quantize_and_insert_k_cache(k(2), cache().view(2, -1), slots(4), 16, bytes_per_token=528),
                       ValueError, ["'k'", ">= 4"]),
    "slot dtype": (lambda: dsv41.quantize_and_insert_k_cache(k(), cache().view(2, -1), slots().float(), 16, bytes_per_token=528),
                   TypeError, ["'slot_mapping'", "int32 or int64"]),
    "block_size not int": (lambda: dsv41.quantize_and_insert_k_cache(k(), cache().view(2, -1), slots(), 16.0, bytes_per_token=528),
                           TypeError, ["'block_size'", "int", "float"]),
    "device mismatch": (lambda: dsv41.quantize_and_insert_k_cache(k(), cache().view(2, -1), slots().to("meta"), 16, bytes_per_token=528),
                        ValueError, ["'slot_mapping'", "cpu", "meta"]),
    "gather record": (lambda: dsv41.dequantize_and_gather_k_cache(torch.zeros(1, 4, 512, dtype=BF16), torch.zeros(2, 16, 500, dtype=U8),
                                                                    torch.ones(1, dtype=I32), None, torch.zeros(1, 1, dtype=I32), 16, 0),
                      ValueError, ["dequantize_and_gather_k_cache", "'k_cache'", "584, 528 or 288", "500"]),
    "gather out dtype": (lambda: dsv41.dequantize_and_gather_k_cache(torch.zeros(1, 4, 512), cache(), torch.ones(1, dtype=I32), None,
                                                                       torch.zeros(1, 1, dtype=I32), 16, 0),
                         TypeError, ["'out'", "bfloat16"]),
    "gather negative offset": (lambda: dsv41.dequantize_and_gather_k_cache(torch.zeros(1, 4, 512, dtype=BF16), cache(), torch.ones(1, dtype=I32), None,
                                                                             torch.zeros(1, 1, dtype=I32), 16, -1),
                               ValueError, ["'offset'", ">= 0", "-1"]),
    "gather table strided": (lambda: dsv41.dequantize_and_gather_k_cache(torch.zeros(1, 4, 512, dtype=BF16), cache(), torch.ones(1, dtype=I32), None,
                                                                           torch.zeros(1, 4, dtype=I32)[:, ::2], 16, 0),
                             ValueError, ["'block_table'", "stride 1"]),
    "topk rank": (lambda: dsv41.compute_global_topk_indices_and_lens(torch.zeros(4, dtype=I32), torch.zeros(4, dtype=I32),
                                                                       torch.zeros(1, 1, dtype=I32), 64, torch.ones(4, dtype=torch.bool)),
                  ValueError, ["'topk_indices'", "2-D", "1-D"]),
    "valid mask dtype": (lambda: dsv41.compute_global_topk_indices_and_lens(torch.zeros(4, 2, dtype=I32), torch.zeros(4, dtype=I32),
                                                                              torch.zeros(1, 1, dtype=I32), 64, torch.ones(4, dtype=I32)),
                         TypeError, ["'is_valid_token'", "bool"]),
    "combine out shape": (lambda: dsv41.combine_topk_swa_indices(torch.zeros(2, 8, dtype=I32), torch.tensor([0, 2], dtype=I32),
                                                                   torch.tensor([4], dtype=I32), torch.tensor([4], dtype=I32), 128, 4, 8, 256, 128,
                                                                   out=(torch.zeros(2, 100, dtype=I32), torch.zeros(2, dtype=I32))),
                          ValueError, ["'out[0]'", "size 256"]),
    "flashinfer window": (lambda: dsv41.build_flashinfer_mixed_sparse_indices(
        torch.zeros(1, 64, dtype=I32), None, None, torch.zeros(0, 8, dtype=I32), torch.tensor([0, 1], dtype=I32),
        torch.tensor([4], dtype=I32), torch.zeros(1, dtype=I32), torch.zeros(1, 1, dtype=I32), 64, None, 64, 128, 4, 8,
        replay_start=torch.zeros(1, dtype=I32)),
        ValueError, ["'decode_swa_indices'", "window_size (128)"]),
    "flashinfer local needs mask": (lambda: dsv41.build_flashinfer_mixed_sparse_indices(
        torch.zeros(1, 128, dtype=I32), torch.zeros(1, 8, dtype=I32), None, torch.zeros(0, 8, dtype=I32), torch.tensor([0, 1], dtype=I32),
        torch.tensor([4], dtype=I32), torch.zeros(1, dtype=I32), torch.zeros(1, 1, dtype=I32), 64, None, 64, 128, 4, 8, True,
        replay_start=torch.zeros(1, dtype=I32)),
        TypeError, ["'decode_is_valid_token'", "None"]),
    "compress ratio": (lambda: dsv41.rope_quant_insert(k(), slots(), CS, cache(), slots(), 4),
                       ValueError, ["rope_quant_insert", "'compress_ratio'", "[1, 2]", "4"]),
    "rope record width": (lambda: dsv41.rope_quant_insert(k(), slots(), CS, torch.zeros(2, 16, 300, dtype=U8), slots(), 1),
                          ValueError, ["'kv_cache'", "584, 528 or 288", "300"]),
    "fp8 rows need scale": (lambda: dsv41.rope_quant_insert(k(), slots(), CS, torch.zeros(2, 16, 512, dtype=torch.float8_e4m3fn), slots(), 1),
                            TypeError, ["'fp8_scale'", "None"]),
    "cos_sin width": (lambda: dsv41.rope_quant_insert(k(), slots(), torch.zeros(64, 32), cache(), slots(), 1),
                      ValueError, ["'cos_sin_cache'", "size 64"]),
    "indexer k width": (lambda: dsv41.indexer_k_norm_rope_store(torch.zeros(4, 64, dtype=BF16), slots(), CS, torch.ones(128, dtype=BF16), 1e-6,
                                                                  torch.zeros(2, 16, 132, dtype=U8), slots(), 1, False),
                        ValueError, ["indexer_k_norm_rope_store", "'k_pre'", "size 128"]),
    "indexer tiled block": (lambda: dsv41.indexer_k_norm_rope_store(torch.zeros(4, 128, dtype=BF16), slots(), CS, torch.ones(128, dtype=BF16), 1e-6,
                                                                      torch.zeros(2, 8, 132, dtype=U8), slots(), 1, False, tiled=True),
                            ValueError, ["'k_cache'", "% 16"]),
    "indexer tiled mxfp4 n": (lambda: dsv41.indexer_k_norm_rope_store(torch.zeros(4, 128, dtype=BF16), slots(), CS, torch.ones(128, dtype=BF16), 1e-6,
                                                                        torch.zeros(2, 16, 68, dtype=U8), slots(), 1, True, 0, tiled=True),
                              ValueError, ["'mxfp4_n_per_tile'", "16, 32 or 64", "0"]),
    "indexer q fp8 dtype": (lambda: dsv41.fused_indexer_q_rope_quant(slots(2), torch.zeros(2, 4, 128, dtype=BF16), CS, torch.zeros(2, 4, dtype=BF16),
                                                                       0.1, 0.1, fp8_dtype=torch.float16),
                            TypeError, ["'fp8_dtype'", "float8_e4m3fn"]),
    "indexer q weights dtype": (lambda: dsv41.fused_indexer_q_rope_quant(slots(2), torch.zeros(2, 4, 128, dtype=BF16), CS, torch.zeros(2, 4, dtype=BF16),
                                                                           0.1, 0.1, False, torch.bfloat16),
                                TypeError, ["'weights_out_dtype'", "float32"]),
    "indexer q scale type": (lambda: dsv41.fused_indexer_q_rope_quant(slots(2), torch.zeros(2, 4, 128, dtype=BF16), CS, torch.zeros(2, 4, dtype=BF16),
                                                                        "0.1", 0.1),
                             TypeError, ["'index_weights_softmax_scale'", "float", "str"]),
    "inv rope heads": (lambda: dsv41.fused_inv_rope_fp8_quant(torch.zeros(2, 6, 512, dtype=BF16), slots(2), CS, 2, 4),
                       ValueError, ["fused_inv_rope_fp8_quant", "'o'", "8 heads"]),
    "inv rope cache dtype": (lambda: dsv41.fused_inv_rope_fp8_quant(torch.zeros(2, 8, 512, dtype=BF16), slots(2), CS.to(BF16), 2, 4),
                             TypeError, ["'cos_sin_cache'", "float32", "bfloat16"]),
    "inv rope permuted": (lambda: dsv41.fused_inv_rope_fp8_quant(torch.zeros(2, 8, 512, dtype=BF16), slots(2), CS, 2, 4, permuted_output=True),
                          ValueError, ["'permuted_output'", "quant_group_size=32"]),
    "query quant groups": (lambda: dsv41.fused_q_kv_rmsnorm_quant(torch.zeros(2, 100, dtype=BF16), torch.zeros(2, 64, dtype=BF16),
                                                                   torch.ones(100, dtype=BF16), torch.ones(64, dtype=BF16), 1e-6),
                           ValueError, ["fused_q_kv_rmsnorm_quant", "'qr'", "multiple of 32"]),
    "pad heads": (lambda: dsv41.pad_fused_q_heads(torch.zeros(2, 8, 512, dtype=BF16), 20),
                  ValueError, ["pad_fused_q_heads", "'padded_heads'", "multiple of 16", "20"]),
    "save norm ratio": (lambda: dsv41.fused_save_compress_norm(torch.zeros(2, 512), slots(2), None, slots(2), None, None,
                                                                 torch.ones(512, dtype=BF16), 1e-6, 3, torch.zeros(2, 512, dtype=BF16)),
                        ValueError, ["fused_save_compress_norm", "'compress_ratio'"]),
    "save norm state missing": (lambda: dsv41.fused_save_compress_norm(torch.zeros(2, 1024), slots(2), None, slots(2), None, None,
                                                                         torch.ones(512, dtype=BF16), 1e-6, 2, torch.zeros(2, 512, dtype=BF16)),
                                TypeError, ["'state_cache'", "None"]),
}


def test_asserts_are_not_what_validates():
    """Under -O this still runs; it proves the suite is not relying on assert statements."""
    with pytest.raises(ValueError):
        dsv41.pad_fused_q_heads(torch.zeros(2, 8, 512, dtype=BF16), 20)


@pytest.mark.parametrize("name", sorted(BAD))
def test_bad_input(name):
    call, exc, fragments = BAD[name]
    with pytest.raises(exc) as e:
        call()
    msg = str(e.value)
    # explicit checks, not assert: CI runs this file under python -O
    for f in fragments + ["expected", "got"]:
        if f not in msg:
            pytest.fail(f"{name}: {f!r} not in {msg!r}")


def test_empty_batches_are_no_ops():
    c = cache()
    before = c.clone()
    dsv41.quantize_and_insert_k_cache(k(0), c.view(2, -1), slots(0), 16, bytes_per_token=528)
    dsv41.rope_quant_insert(k(0), slots(0), CS, c, slots(0), 1)
    _check(torch.equal(c, before))
    idx, lens = dsv41.compute_global_topk_indices_and_lens(torch.zeros(0, 5, dtype=I32), torch.zeros(0, dtype=I32),
                                                           torch.zeros(1, 1, dtype=I32), 64, torch.zeros(0, dtype=torch.bool))
    _check(idx.shape == (0, 5) and lens.shape == (0,))
    q, w = dsv41.fused_indexer_q_rope_quant(slots(0), torch.zeros(0, 4, 128, dtype=BF16), CS, torch.zeros(0, 4, dtype=BF16), 0.1, 0.1)
    _check(q.shape == (0, 4, 128) and w.shape == (0, 4))
    o, s = dsv41.fused_inv_rope_fp8_quant(torch.zeros(0, 8, 512, dtype=BF16), slots(0), CS, 2, 4)
    _check(o.shape == (0, 2, 2048) and s.shape == (0, 2, 16))


def _check(ok):
    if not ok:
        pytest.fail("empty batch produced a wrong result")
