"""Stand-in for ``vllm.model_executor.layers.fusion.quant_activation``."""

import dataclasses

import torch

from vllm.model_executor.layers.quantization.utils.quant_utils import QuantKey


@dataclasses.dataclass
class QuantizedActivation:
    data: torch.Tensor
    scale: torch.Tensor
    orig_dtype: torch.dtype
    orig_shape: torch.Size
    quant_key: QuantKey


def get_input_quant_key(layer) -> QuantKey | None:
    if getattr(layer, "requires_unquantized_input", False):
        return None
    return getattr(layer, "_input_quant_key", None)
