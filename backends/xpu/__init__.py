"""Intel XPU backend: the shared Triton kernels through ``torch.xpu`` (PyTorch's XPU builds
carry Intel's Triton backend).  intel-extension-for-pytorch is not used: it is end-of-life and
pins torch 2.8."""

from dsv41.backends.triton.sheet import TRITON_KERNELS
from dsv41.core.registry import Backend


class XpuBackend(Backend):
    name = "xpu"
    family = "xpu"
    device_type = "xpu"
    vendors = ("intel",)
    requires = ("triton",)
    kernels = dict(TRITON_KERNELS)
    triton_source = True
