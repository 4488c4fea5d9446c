"""Times the FlashInfer-indices kernel of an earlier commit beside the current one with the
inputs resident in L2, where the kernel is bound by the SM (instructions issued, reads waited
on one after another) rather than by DRAM: what a GPU with faster DRAM than this one's sees at
any size.  Same process, same inputs (the bench's), CUDA-graph replay of 50 back-to-back calls
(no host time, no L2 flush), a same-size device copy timed the same way; bytes of the two
kernels compared.

    git show b8e3a0c:backends/triton/index_kernels.py > /tmp/index_kernels_old.py
    python -P tools/flashinfer_warm_l2.py /tmp/index_kernels_old.py --tokens 1024 2048 4096 8192 65536

The old source is loaded as a private module beside the installed package (its AOT
registrations skipped); both launchers run with the launch shapes given below, through
``tuning.OVERRIDES``.
"""

from __future__ import annotations

import argparse
import importlib.util
import sys

import torch
from dsv41.backends.triton import index_kernels, tuning

from dsv41.tools import bench

OP = "build_flashinfer_mixed_sparse_indices"
OLD_SHAPE = {"BLOCK_R": 2, "BLOCK_C": 512, "BLOCK_W": 64, "num_warps": 4}
NEW_SHAPE = {"BLOCK_R": 1, "BLOCK_C": 512, "BLOCK_W": 64, "num_warps": 1}


def _load_old(path: str):
    with open(path) as f:
        src = f.read().replace("\n_register_aot()\n", "\n")
    name = "dsv41.backends.triton._index_kernels_old"
    mod = importlib.util.module_from_spec(importlib.util.spec_from_loader(name, loader=None))
    mod.__package__, mod.__file__ = "dsv41.backends.triton", path
    sys.modules[name] = mod
    # Triton reads the kernels' source back from `path`
    exec(compile(src, path, "exec"), mod.__dict__)  # noqa: S102 -- the caller's own checkout
    return mod


def _replay_us(fn, args, calls: int = 50, replays: int = 10) -> float:
    """µs per call of ``fn(*args)``: 50 calls captured in a CUDA graph, replayed 10 times (on a
    CPU: three calls, no time)."""
    for _ in range(3):
        fn(*args)
    if not torch.cuda.is_available():
        return float("nan")
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(calls):
            fn(*args)
    g.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(replays):
        g.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1000 / (calls * replays)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("old_source", help="index_kernels.py of the earlier commit")
    p.add_argument("--tokens", type=int, nargs="+", default=[1024, 2048, 4096, 8192, 65536])
    a = p.parse_args(argv)
    # on a CPU (TRITON_INTERPRET=1) the bytes are compared and nothing is timed
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    old = _load_old(a.old_source)
    runs = (("old kernel, old shape", old, OLD_SHAPE), ("new kernel, old shape", index_kernels, OLD_SHAPE),
            ("new kernel, new shape", index_kernels, NEW_SHAPE))
    name = torch.cuda.get_device_name() if dev.type == "cuda" else "CPU (no times)"
    print(f"{name}; rows, kernel, shape, us per call, warm copy us, ratio")
    for t in a.tokens:
        case = bench._build_flashinfer(bench._Gen(dev, 0), t, None)
        out = case.args[-2]
        src = torch.empty(case.bytes // 2, dtype=torch.uint8, device=dev)
        dst = torch.empty_like(src)
        copy_us = _replay_us(dst.copy_, (src,))
        first = None
        try:
            for label, mod, shape in runs:
                tuning.OVERRIDES[OP] = dict(shape)
                out.fill_(-7)  # a canary, so that "equal" means written alike
                us = _replay_us(getattr(mod, OP), case.args)
                first = out.clone() if first is None else first
                same = torch.equal(out, first)
                print(f"{t:6d}  {label:22s} {shape}  {us:7.2f}  {copy_us:7.2f}  {us / copy_us:5.2f}"
                      f"  bytes {'equal' if same else 'DIFFER'}", flush=True)
        finally:
            tuning.OVERRIDES.pop(OP, None)
    return 0


if __name__ == "__main__":
    sys.exit(main())
