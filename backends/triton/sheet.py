"""The op -> launcher map of the shared Triton source, used by the cuda, rocm and xpu sheets."""

_T = "dsv41.backends.triton."

TRITON_KERNELS = {
    "quantize_and_insert_k_cache": _T + "cache_kernels:quantize_and_insert_k_cache",
    "dequantize_and_gather_k_cache": _T + "cache_kernels:dequantize_and_gather_k_cache",
    "rope_quant_insert": _T + "cache_kernels:rope_quant_insert",
    "indexer_k_norm_rope_store": _T + "cache_kernels:indexer_k_norm_rope_store",
    "fused_save_compress_norm": _T + "cache_kernels:fused_save_compress_norm",
    "save_ring_rows": _T + "cache_kernels:save_ring_rows",
    "compute_global_topk_indices_and_lens": _T + "index_kernels:compute_global_topk_indices_and_lens",
    "combine_topk_swa_indices": _T + "index_kernels:combine_topk_swa_indices",
    "build_flashinfer_mixed_sparse_indices": _T + "index_kernels:build_flashinfer_mixed_sparse_indices",
    "fused_indexer_q_rope_quant": _T + "rope_kernels:fused_indexer_q_rope_quant",
    "fused_inv_rope_fp8_quant": _T + "rope_kernels:fused_inv_rope_fp8_quant",
    "fused_q_kv_rmsnorm_quant": _T + "rope_kernels:fused_q_kv_rmsnorm_quant",
    "pad_fused_q_heads": _T + "rope_kernels:pad_fused_q_heads",
    "transcode_k_cache": _T + "transcode_kernel:transcode_k_cache",
}
