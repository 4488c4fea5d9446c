"""Intel XPU backend: the shared Triton kernels through torch.xpu (Intel's Triton backend).

intel-extension-for-pytorch is not needed: it is end-of-life and pins torch 2.8.
"""

from dsv41.registry import Backend


class XpuBackend(Backend):
    name = "xpu"
    family = "xpu"
    device_type = "xpu"
    vendors = ("intel",)
    requires = ("triton",)
    kernels: dict = {}
