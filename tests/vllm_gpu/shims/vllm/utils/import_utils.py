"""Stand-in for ``vllm.utils.import_utils``.

``has_cutedsl`` is False: vLLM's CuTe DSL gather and indexer-Q kernels need nvidia-cutlass-dsl,
quack and vllm_flash_attn, none of which the GPU host has; vLLM then runs its Triton kernels,
which are what the side-by-side compares."""


def has_cutedsl() -> bool:
    return False
