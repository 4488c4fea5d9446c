"""Stand-in for ``vllm.utils.deep_gemm``: the two helpers the op files call."""

from vllm.platforms import current_platform


def mqa_logits_use_mx_scales() -> bool:
    # MX-scaled indexer caches are for SM 10.x only
    return current_platform.is_cuda() and current_platform.is_device_capability_family(100)


def get_tma_aligned_size(x: int, element_size: int) -> int:
    align = 16 // element_size
    return (x + align - 1) // align * align
