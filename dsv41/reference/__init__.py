"""The pure-PyTorch reference: every op, device-agnostic, vectorized, byte-exact with the spec.

It is the ground truth every backend is compared with, and the last fallback of the
registry (it runs on any device, slowly).
"""

from dsv41.core.registry import Backend

_R = "dsv41.reference."


class ReferenceBackend(Backend):
    name = "reference"
    family = "reference"
    device_type = None  # any device
    kernels = {
        "quantize_and_insert_k_cache": _R + "k_cache:quantize_and_insert_k_cache",
        "dequantize_and_gather_k_cache": _R + "k_cache:dequantize_and_gather_k_cache",
        "compute_global_topk_indices_and_lens": _R + "sparse_indices:compute_global_topk_indices_and_lens",
        "combine_topk_swa_indices": _R + "sparse_indices:combine_topk_swa_indices",
        "build_flashinfer_mixed_sparse_indices": _R + "sparse_indices:build_flashinfer_mixed_sparse_indices",
        "fused_save_compress_norm": _R + "compress:fused_save_compress_norm",
        "save_ring_rows": _R + "compress:save_ring_rows",
        "rope_quant_insert": _R + "compress:rope_quant_insert",
        "indexer_k_norm_rope_store": _R + "indexer:indexer_k_norm_rope_store",
        "fused_indexer_q_rope_quant": _R + "indexer:fused_indexer_q_rope_quant",
        "fused_inv_rope_fp8_quant": _R + "output_quant:fused_inv_rope_fp8_quant",
        "fused_q_kv_rmsnorm_quant": _R + "output_quant:fused_q_kv_rmsnorm_quant",
        "pad_fused_q_heads": _R + "output_quant:pad_fused_q_heads",
        "transcode_k_cache": _R + "transcode:transcode_k_cache",
    }
