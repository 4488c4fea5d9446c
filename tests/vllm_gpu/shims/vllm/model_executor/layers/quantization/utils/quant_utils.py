"""Stand-in for ``vllm.model_executor.layers.quantization.utils.quant_utils``."""

import dataclasses

import torch

from vllm.platforms import current_platform


def get_fp8_min_max() -> tuple[float, float]:
    if current_platform.is_fp8_fnuz():
        return -224.0, 224.0
    finfo = torch.finfo(current_platform.fp8_dtype())
    return finfo.min, finfo.max


@dataclasses.dataclass(frozen=True)
class QuantKey:
    dtype: torch.dtype
    scale_dtype: torch.dtype
    group: tuple
    static: bool = False
    symmetric: bool = True


# MXFP8 activations: e4m3 values, one dynamic UE8M0 scale per 32 elements
kMxfp8Dynamic = QuantKey(torch.float8_e4m3fn, torch.uint8, (1, 32))
