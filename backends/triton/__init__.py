"""Triton kernel source shared by the cuda, rocm and xpu backends, parametrized by
fp8 flavour, layout and FMA pinning rather than copied per vendor."""
