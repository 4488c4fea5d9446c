"""Stand-in for ``vllm.platforms``: ``current_platform`` answering as vLLM's CUDA platform on
an SM 9.0 GPU (the H200), with the methods the packed op files and the dsv41 plugin call."""

from typing import NamedTuple

import torch


class DeviceCapability(NamedTuple):
    major: int
    minor: int

    def to_int(self) -> int:
        return self.major * 10 + self.minor


class _CudaSm90:
    # tensors live here; "cpu" only for the --smoke run in Triton's interpreter
    device_type = "cuda" if torch.cuda.is_available() else "cpu"

    def is_cuda(self) -> bool:
        return True

    def is_rocm(self) -> bool:
        return False

    def is_xpu(self) -> bool:
        return False

    def is_cpu(self) -> bool:
        return False

    def get_device_capability(self, device_id: int = 0) -> DeviceCapability:
        return DeviceCapability(9, 0)

    def is_device_capability_family(self, capability: int, device_id: int = 0) -> bool:
        return self.get_device_capability(device_id).to_int() // 10 == capability // 10

    def fp8_dtype(self) -> torch.dtype:
        return torch.float8_e4m3fn

    def is_fp8_fnuz(self) -> bool:
        return False

    def is_arch_support_pdl(self) -> bool:
        # vLLM's CUDA platform: the GPU's major capability >= 9 (False without a GPU)
        if not torch.cuda.is_available():
            return False
        return torch.cuda.get_device_capability(torch.cuda.current_device())[0] >= 9


current_platform = _CudaSm90()
