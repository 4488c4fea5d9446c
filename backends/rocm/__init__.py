"""AMD backend: the shared Triton kernels built with the ROCm tiled layout and the cache's fp8 flavour."""

from dsv41.registry import Backend


class RocmBackend(Backend):
    name = "rocm"
    family = "rocm"
    device_type = "cuda"  # PyTorch's ROCm builds expose HIP devices as "cuda"
    vendors = ("amd",)
    archs = ("gfx942", "gfx950")
    requires = ("triton",)
    kernels: dict = {}
