"""NVIDIA backend: Triton kernels (shared source in ``backends/triton``) and CuTe DSL kernels."""

from dsv41.registry import Backend

NVIDIA_ARCHS = ("sm_90", "sm_100", "sm_103", "sm_120")


class CudaTritonBackend(Backend):
    name = "cuda:triton"
    family = "cuda"
    device_type = "cuda"
    vendors = ("nvidia",)
    archs = NVIDIA_ARCHS
    requires = ("triton",)
    kernels: dict = {}


class CudaCuteDSLBackend(Backend):
    name = "cuda:cutedsl"
    family = "cuda"
    device_type = "cuda"
    vendors = ("nvidia",)
    archs = ("sm_90", "sm_100", "sm_103")
    requires = ("cutlass",)
    kernels: dict = {}
