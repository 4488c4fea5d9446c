"""dsv41 — DeepSeek V4.1 fused KV-cache, RoPE and quantization ops, on every accelerator.

The public ops keep vLLM's signatures (``vllm.models.deepseek_v41.common.ops``).
Per op, a registry picks the best implementation for the machine once, on first
use (``python -m dsv41 info`` explains the choice); every implementation writes
the same bytes as the pure-PyTorch reference in ``dsv41.reference``.

Importing this package creates no GPU context: the platform is probed on the
first op call.
"""

from . import cache_utils, fused_compress_quant_cache, fused_layout, indexer_k_store, q_layout, query_quant, transcode
from .cache_utils import (
    build_flashinfer_mixed_sparse_indices,
    combine_topk_swa_indices,
    compute_global_topk_indices_and_lens,
    dequantize_and_gather_k_cache,
    dequantize_and_gather_k_cache_triton,
    gather_num_workers,
    quantize_and_insert_k_cache,
)
from .core.formats import (
    MXFP4_BLOCK_SIZE,
    V4_BYTES_PER_TOKEN,
    V41_BYTES_PER_TOKEN,
    V41_NVFP4_BYTES_PER_TOKEN,
    DEFAULT_V41_LAYOUT,
    V41_LAYOUTS,
    CacheLayout,
    Fp8Flavour,
)
from .fused_compress_quant_cache import fused_save_compress_norm, rope_quant_insert, save_ring_rows
from .fused_layout import o_fused_permutation, q_fused_permutation
from .indexer_k_store import indexer_k_norm_rope_store
from .indexer_q import fused_indexer_q_rope_quant
from .inv_rope import fused_inv_rope_fp8_quant
from .q_layout import pad_fused_q_heads
from .query_quant import QuantizedActivation, can_fuse_query_quant, fused_q_kv_rmsnorm_quant, mxfp8_scale_bytes
from .explain import explain
from .core.registry import BackendUnavailable
from .transcode import transcode_k_cache

__version__ = "0.1.0"

__all__ = [
    "quantize_and_insert_k_cache",
    "dequantize_and_gather_k_cache",
    "compute_global_topk_indices_and_lens",
    "build_flashinfer_mixed_sparse_indices",
    "fused_indexer_q_rope_quant",
    "fused_inv_rope_fp8_quant",
    "indexer_k_norm_rope_store",
    "combine_topk_swa_indices",
    "fused_save_compress_norm",
    "save_ring_rows",
    "rope_quant_insert",
    "fused_q_kv_rmsnorm_quant",
    "QuantizedActivation",
    "can_fuse_query_quant",
    "mxfp8_scale_bytes",
    "gather_num_workers",
    "dequantize_and_gather_k_cache_triton",
    "pad_fused_q_heads",
    "transcode_k_cache",
    "q_fused_permutation",
    "o_fused_permutation",
    "cache_utils",
    "fused_compress_quant_cache",
    "fused_layout",
    "indexer_k_store",
    "query_quant",
    "q_layout",
    "transcode",
    "CacheLayout",
    "Fp8Flavour",
    "BackendUnavailable",
    "explain",
    "V4_BYTES_PER_TOKEN",
    "V41_BYTES_PER_TOKEN",
    "V41_NVFP4_BYTES_PER_TOKEN",
    "MXFP4_BLOCK_SIZE",
    "DEFAULT_V41_LAYOUT",
    "V41_LAYOUTS",
]
