"""AMD backend: the shared Triton kernels (``backends/triton``), parametrized by the cache's
fp8 flavour (FNUZ on gfx942 caches, OCP on gfx950) and the ROCm tiled indexer layout."""

from dsv41.backends.triton.sheet import TRITON_KERNELS
from dsv41.core.registry import Backend


class RocmBackend(Backend):
    name = "rocm"
    family = "rocm"
    device_type = "cuda"  # PyTorch's ROCm builds expose HIP devices as "cuda"
    vendors = ("amd",)
    archs = ("gfx942", "gfx950")
    requires = ("triton",)
    kernels = dict(TRITON_KERNELS)
    triton_source = True
