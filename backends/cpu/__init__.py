"""CPU backend: C++/OpenMP kernels (vectorizable inner loops), built on first use.

The build needs only a C++ compiler (``backends/cpu/_build.py``); without one, the capability
sheet reports the compiler error and the registry falls back to the reference, logging why.
"""

from dsv41.core.registry import Backend

_C = "dsv41.backends.cpu."


class CpuBackend(Backend):
    name = "cpu"
    family = "cpu"
    device_type = "cpu"
    kernels = {
        "quantize_and_insert_k_cache": _C + "cache_ops:quantize_and_insert_k_cache",
        "dequantize_and_gather_k_cache": _C + "cache_ops:dequantize_and_gather_k_cache",
        "rope_quant_insert": _C + "cache_ops:rope_quant_insert",
        "indexer_k_norm_rope_store": _C + "cache_ops:indexer_k_norm_rope_store",
        "compute_global_topk_indices_and_lens": _C + "ops:compute_global_topk_indices_and_lens",
        "combine_topk_swa_indices": _C + "ops:combine_topk_swa_indices",
        "build_flashinfer_mixed_sparse_indices": _C + "ops:build_flashinfer_mixed_sparse_indices",
        "fused_save_compress_norm": _C + "ops:fused_save_compress_norm",
        "save_ring_rows": _C + "ops:save_ring_rows",
        "fused_indexer_q_rope_quant": _C + "ops:fused_indexer_q_rope_quant",
        "fused_inv_rope_fp8_quant": _C + "ops:fused_inv_rope_fp8_quant",
        "fused_q_kv_rmsnorm_quant": _C + "ops:fused_q_kv_rmsnorm_quant",
        "pad_fused_q_heads": _C + "ops:pad_fused_q_heads",
        "transcode_k_cache": _C + "transcode:transcode_k_cache",
    }

    def extra_reasons(self, op, plat):
        import importlib

        module = self.kernels[op].partition(":")[0]
        err = importlib.import_module(module).build_error()
        return [err] if err else []
