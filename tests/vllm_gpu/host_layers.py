"""Host µs per eager call on a GPU host, by layer, for the ops of ``side_by_side.py`` at 64
tokens: the public function, its kernel (the registry's, for cuda:triton the replaying launcher
of backends/triton/replay.py), and the bare compiled launcher(s) of the replayed record; with an
empty Triton kernel's launch (Triton's path, its compiled launcher, and ``bound.firing``'s direct
call of the launcher's compiled launch function) and a ``torch.empty`` for scale.  Wall time of
back-to-back calls, the median of five blocks of 200.

    python -P tests/vllm_gpu/host_layers.py > host_layers.txt
    python -P tests/vllm_gpu/host_layers.py --profile "global topk indices"   # + cProfile of one op

Not a pytest module (tests/run.sh never runs it); docs/performance.md quotes its output.
"""

from __future__ import annotations

import importlib
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402
import triton  # noqa: E402

import side_by_side as sbs  # noqa: E402
from dsv41.backends.triton import bound  # noqa: E402
from dsv41.core import _calls  # noqa: E402

MODULES = ("cache_utils", "fused_compress_quant_cache", "query_quant", "indexer_k_store", "indexer_q", "inv_rope")


def per_call(f, n: int = 200) -> float:
    for _ in range(20):
        f()
    torch.cuda.synchronize()
    blocks = []
    for _ in range(5):
        t0 = time.perf_counter()
        for _ in range(n):
            f()
        blocks.append((time.perf_counter() - t0) / n * 1e6)
        torch.cuda.synchronize()
    return statistics.median(blocks)


@triton.jit
def _empty(a, b, c, d, n):
    pass


def _profile(call, n: int = 2000) -> str:
    """cProfile of ``n`` public calls, the 25 entries of most own time."""
    import cProfile
    import io
    import pstats

    prof = cProfile.Profile()
    prof.enable()
    for _ in range(n):
        call()
    torch.cuda.synchronize()
    prof.disable()
    out = io.StringIO()
    pstats.Stats(prof, stream=out).sort_stats("tottime").print_stats(25)
    return out.getvalue()


def main(argv) -> int:
    profile = argv[argv.index("--profile") + 1] if "--profile" in argv else None
    dev = torch.device("cuda")
    x = torch.zeros(16, device=dev)
    comp = _empty.run(x, x, x, x, 1, grid=(1,), warmup=True)
    comp = comp.result() if hasattr(comp, "result") else comp
    launcher, function, metadata = comp.run, comp.function, comp.packed_metadata
    stream = torch.cuda.current_stream().cuda_stream
    p = x.data_ptr()
    print(f"{torch.cuda.get_device_name()}, Triton {triton.__version__}, torch {torch.__version__}")
    fire = bound.firing(launcher, function, metadata)
    print(f"empty kernel: Triton's path {per_call(lambda: _empty[(1,)](x, x, x, x, 1)):.1f} us, its compiled launcher "
          f"{per_call(lambda: launcher(1, 1, 1, stream, function, metadata, None, None, None, p, p, p, p, 1)):.1f}, "
          f"bound.firing {per_call(lambda: fire(1, 1, 1, stream, (p, p, p, p, 1))):.1f}; "
          f"torch.empty(64, 512, bf16) {per_call(lambda: torch.empty(64, 512, dtype=torch.bfloat16, device=dev)):.1f}")
    mods = [importlib.import_module("dsv41." + m) for m in MODULES]
    for case in sbs.CASES:
        if case[6]:
            continue
        fn = next(getattr(m, case[2]) for m in mods if hasattr(m, case[2]))
        args, kw = sbs.build_args(torch, case, 64, dev)

        def public(fn=fn, args=args, kw=kw):
            fn(*args, **kw)

        public()
        try:
            with _calls.capturing():
                public()
        except _calls.KernelCall as kc:
            op, kargs = kc.name, kc.args
        kern = getattr(_calls.ops, op).kernels[kargs[0].device]
        rec = kern.record_for(*kargs) if hasattr(kern, "record_for") else None
        bare = float("nan")
        if rec is not None:
            ptrs = tuple(a.data_ptr() for a in kargs if isinstance(a, torch.Tensor))

            def raw():
                for la in rec.launches:
                    g = la.grid
                    la.fire(g[0], g[1], g[2], stream, la.pick(ptrs + la.consts))

            bare = per_call(raw)
        print(f"{case[0]:30s} public {per_call(public):6.1f}  kernel {per_call(lambda: kern(*kargs)):6.1f}  "
              f"bare launches {bare:6.1f}  ({type(kern).__name__}, {len(rec.launches) if rec else '-'} launch)", flush=True)
        if case[0] == profile:
            allocs = ", ".join(f"{tuple(a.shape)} {str(a.dtype)[6:]} {per_call(lambda a=a: torch.empty_like(a)):.1f}"
                               for a in kargs if isinstance(a, torch.Tensor))
            print(f"empty_like of each kernel tensor, us: {allocs}", flush=True)
            print(_profile(public), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
