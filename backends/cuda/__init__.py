"""NVIDIA backend: the shared Triton kernels (``backends/triton``) and CuTe DSL kernels."""

from dsv41.backends.triton.sheet import TRITON_KERNELS
from dsv41.core.registry import Backend

NVIDIA_ARCHS = ("sm_90", "sm_100", "sm_103", "sm_120")


class CudaTritonBackend(Backend):
    name = "cuda:triton"
    family = "cuda"
    device_type = "cuda"
    vendors = ("nvidia",)
    archs = NVIDIA_ARCHS
    requires = ("triton",)
    kernels = dict(TRITON_KERNELS)
    triton_source = True

    def load(self, op: str):
        # an eager call whose launch key was seen before replays the launcher's launches
        # (backends/triton/replay.py); imported here: a sheet imports no kernel
        from dsv41.backends.triton.replay import Replaying

        return Replaying(super().load(op))


class CudaCuteDSLBackend(Backend):
    """CuTe DSL kernels where the seed has them: the fp8 gather and the indexer-Q quantizer.

    Calls these kernels cannot serve (FNUZ caches, the NVFP4 record, shapes outside the
    compiled classes: ``input_limits``) are passed to the Triton kernel inside the launcher,
    which consults the same functions, so the selection stays per op and
    ``dsv41.explain`` names the kernel that runs a given call.
    """

    name = "cuda:cutedsl"
    family = "cuda"
    device_type = "cuda"
    vendors = ("nvidia",)
    archs = ("sm_90", "sm_100", "sm_103")
    requires = ("cutlass", "triton")
    kernels = {
        "dequantize_and_gather_k_cache": "dsv41.backends.cuda.cutedsl_gather:dequantize_and_gather_k_cache",
        "fused_indexer_q_rope_quant": "dsv41.backends.cuda.cutedsl_indexer_q:fused_indexer_q_rope_quant",
    }
    input_limits = {
        "dequantize_and_gather_k_cache": "dsv41.backends.cuda.cutedsl_gather:unsupported_reason",
        "fused_indexer_q_rope_quant": "dsv41.backends.cuda.cutedsl_indexer_q:unsupported_reason",
    }
    input_fallback = "cuda:triton"
