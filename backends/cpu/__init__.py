"""CPU backend: multithreaded, vectorized kernels for offload hosts and CI."""

from dsv41.registry import Backend


class CpuBackend(Backend):
    name = "cpu"
    family = "cpu"
    device_type = "cpu"
    kernels: dict = {}
