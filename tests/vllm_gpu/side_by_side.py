"""vLLM 0.33.0's DeepSeek V4 / V4.1 kernels and the dsv41 ops its plugin routes to, side by
side through the same vLLM call sites: bytes written and time (issue 18, tests/gpu_run.sh
step ``vllm``, docs/gpu.md "vLLM side by side").

vLLM is not installed where this runs.  A stand-in ``vllm`` package is laid out in a temporary
directory: vLLM's own op files from the archive tools/vllm_gpu_pack.sh builds from the
0.33.0 wheel, and the small shims of tests/vllm_gpu/shims for the modules they import
(``current_platform`` answers as CUDA SM 9.0 without CuTe DSL, so vLLM runs its Triton kernels).

1. Every compared name is looked up on the vLLM module its model code imports it from (the
   V4.1 ops package, else the defining submodule) and called on seeded inputs of the project's
   bench shapes (dsv41.tools.bench): the bytes of every tensor argument and return value are kept,
   and the call is timed.
2. ``vllm.plugins.load_general_plugins()`` runs dsv41's entry point (``register()`` directly
   when dsv41 is not installed with its entry point), with ``DSV41_VLLM_OPS=all`` unless set.
3. The same names are looked up again (now dsv41's), called on the same inputs, compared
   byte for byte with step 1 and timed.

Device time: CUDA events around one eager call, L2 flushed and the launch queued behind a
short device sleep (as ``python -m dsv41 bench``), median of ``--iters`` calls after warm-up.
``--graph``: also µs per call replayed from a CUDA graph at sizes up to 64 tokens, as ``python
-m dsv41 bench`` times it (16 calls per graph, median over replays), each side captured during
its own pass.
Host time: wall time of ``--host-calls`` back-to-back eager calls at 64 tokens, per call, the
median of seven such blocks per side, the two sides' blocks taken in turn once both are loaded
(a host that slows down mid-run charges both alike; the figures taken during each side's own
pass are kept in the JSON as ``*_host_us_alone``).

    python tests/vllm_gpu/side_by_side.py --archive .device/vllm033-ops.tar.xz --out $OUT
    TRITON_INTERPRET=1 python tests/vllm_gpu/side_by_side.py --smoke   # CPU, tiny sizes
    python tests/vllm_gpu/side_by_side.py --stand-in-driver --out DIR  # CPU, host time only

``--stand-in-driver`` (a CPU without a GPU): both sides' Triton kernels are compiled for sm_90 by
the recording driver of tests/bound_launch_check.py, which launches nothing, and dsv41's public
functions are pointed at its cuda:triton kernels for CPU tensors.  No bytes are compared and no
device time is taken: what is measured is each side's host work per eager call (Python, Triton's
launch path or the bound launcher), less the compiled launcher's C code, on the same CPU.

Writes ``vllm_side_by_side.json`` and ``vllm_side_by_side.txt`` to ``--out``; exits 1 when a
compared pair's bytes differ or a call fails.  Not a pytest module (tests/run.sh never runs it).
"""

from __future__ import annotations

import argparse
import importlib
import json
import logging
import os
import shutil
import statistics
import sys
import tarfile
import tempfile
import time
import types
import zlib
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
SHIMS = HERE / "shims"
V41 = "vllm.models.deepseek_v41.common.ops"
V4 = "vllm.models.deepseek_v4.common.ops"

# (label, vLLM module the call site imports from, function, bench op, bench variant,
#  how many of the bench case's leading arguments are vLLM's positional ones, skip reason)
# The bench cases' arguments are dsv41's kernel contract, whose leading part is vLLM's
# signature except where ``_vllm_args`` rearranges them.
CASES = [
    ("insert 584", V41, "quantize_and_insert_k_cache", "quantize_and_insert_k_cache", "584", None, None),
    ("insert 528", V41, "quantize_and_insert_k_cache", "quantize_and_insert_k_cache", "528", None, None),
    ("gather 584", V41, "dequantize_and_gather_k_cache", "dequantize_and_gather_k_cache", "584", 8, None),
    ("gather 528", V41, "dequantize_and_gather_k_cache", "dequantize_and_gather_k_cache", "528", 8, None),
    ("gather 288", V41, "dequantize_and_gather_k_cache", "dequantize_and_gather_k_cache", "288", 8, None),
    ("global topk indices", V41, "compute_global_topk_indices_and_lens", "compute_global_topk_indices_and_lens", None, 5, None),
    ("combine topk+swa", V41, "combine_topk_swa_indices", "combine_topk_swa_indices", None, 9, None),
    ("flashinfer sparse indices", V41, "build_flashinfer_mixed_sparse_indices", "build_flashinfer_mixed_sparse_indices", None, None, None),
    ("save_compress CR1", f"{V41}.fused_compress_quant_cache", "fused_save_compress_norm", "fused_save_compress_norm", "CR1", 10, None),
    ("save_compress CR2", f"{V41}.fused_compress_quant_cache", "fused_save_compress_norm", "fused_save_compress_norm", "CR2", 10, None),
    ("save_compress CR2 prev_rows", f"{V41}.fused_compress_quant_cache", "fused_save_compress_norm", "fused_save_compress_norm", "CR2", None, None),
    ("save_ring_rows", f"{V41}.fused_compress_quant_cache", "save_ring_rows", "save_ring_rows", None, 3, None),
    ("rope_quant_insert 584", f"{V41}.fused_compress_quant_cache", "rope_quant_insert", "rope_quant_insert", "584", 7, None),
    ("rope_quant_insert 528", f"{V41}.fused_compress_quant_cache", "rope_quant_insert", "rope_quant_insert", "528", 7, None),
    ("rope_quant_insert 288", f"{V41}.fused_compress_quant_cache", "rope_quant_insert", "rope_quant_insert", "288", 7,
     "vLLM's NVFP4 writer packs e2m1 with inline PTX that does not assemble for sm_90a"),
    ("rope_quant_insert bf16", f"{V41}.fused_compress_quant_cache", "rope_quant_insert", "rope_quant_insert", "bf16", 7, None),
    ("rope_quant_insert fp8", f"{V41}.fused_compress_quant_cache", "rope_quant_insert", "rope_quant_insert", "bf16", None, None),
    ("indexer K FP8", V41, "indexer_k_norm_rope_store", "indexer_k_norm_rope_store", "FP8", 9, None),
    ("indexer Q FP8", V41, "fused_indexer_q_rope_quant", "fused_indexer_q_rope_quant", "FP8", 7, None),
    ("inverse RoPE fp8", V41, "fused_inv_rope_fp8_quant", "fused_inv_rope_fp8_quant", None, 10, None),
    ("q/kv rmsnorm quant", f"{V41}.query_quant", "fused_q_kv_rmsnorm_quant", "fused_q_kv_rmsnorm_quant", None, 5, None),
]
SMOKE_SKIP = {  # what Triton's interpreter cannot run
    "rope_quant_insert 288": "inline PTX",
}


# ----------------------------------------------------------------------------- stand-in


def lay_out_stand_in(archive: Path, dest: Path) -> str:
    """Shims, then the archive's vLLM files, under ``dest``; returns the archive's MANIFEST."""
    shutil.copytree(SHIMS / "vllm", dest / "vllm")
    with tarfile.open(archive) as tar:
        members = [m for m in tar.getmembers()
                   if m.isfile() and (m.name == "MANIFEST" or m.name.startswith("vllm/")) and ".." not in m.name]
        for m in members:
            with tar.extractfile(m) as src:
                target = dest / m.name
                target.parent.mkdir(parents=True, exist_ok=True)
                target.write_bytes(src.read())
    return (dest / "MANIFEST").read_text() if (dest / "MANIFEST").exists() else ""


def import_stand_in(dest: Path):
    if "vllm" in sys.modules:
        raise RuntimeError("vllm is already imported; run this in a fresh interpreter")
    sys.path.insert(0, str(dest))
    import vllm

    if not Path(vllm.__file__).resolve().is_relative_to(dest.resolve()):
        raise RuntimeError(f"imported {vllm.__file__}, not the stand-in under {dest}")
    return vllm


def resolve(module: str, name: str):
    return getattr(importlib.import_module(module), name)


# ----------------------------------------------------------------------------- inputs


def _plat():
    # what the bench builders read of the platform: an H200 (OCP fp8, no NaN sanitizing)
    return types.SimpleNamespace(arch="sm_90", is_rocm=False, fp8_flavour=types.SimpleNamespace(fnuz=False))


def _variant(op: str, variant):
    from dsv41.tools import bench

    return next(v for v in bench.VARIANTS if v.op == op and v.variant == variant)


def build_args(torch, case, tokens: int, device):
    """(args, kwargs) of the vLLM call for ``case`` at ``tokens`` tokens (seeded: the same
    values on every call).  Buffers the op allocates empty are filled with 0x5A, so bytes an
    op leaves unwritten compare equal."""
    from dsv41.tools import bench

    label, _, _, op, variant, n, _ = case

    class Gen(bench._Gen):
        def empty(self, *shape, dtype):
            t = torch.empty(shape, dtype=dtype, device=self.device)
            t.view(torch.uint8).fill_(0x5A) if t.numel() else None
            return t

    gen = Gen(device, zlib.crc32(f"{label}/{tokens}".encode()))
    a = _variant(op, variant).build(gen, tokens, _plat()).args
    if op == "quantize_and_insert_k_cache":  # dsv41: (k, cache, slots, block, fnuz, width, interleaved)
        return (a[0], a[1], a[2]), dict(block_size=a[3], is_ue8m0=True, use_fnuz=a[4], bytes_per_token=a[5])
    if op == "build_flashinfer_mixed_sparse_indices":
        return tuple(a[:18]), dict(replay_start=a[18])
    if label == "save_compress CR2 prev_rows":
        kv, positions, state, slots, qsl, t2r = a[:6]
        reqs = qsl.numel() - 1
        prev_rows = gen.randn(2 * reqs, 1024)
        prev_idx = gen.randperm(2 * reqs, dtype=torch.int32)[:reqs].contiguous()
        prev_idx[::2] = -1  # every other request reads its ring row
        return tuple(a[:10]) + (prev_rows, prev_idx), {}
    if label == "rope_quant_insert fp8":
        cache = torch.zeros(a[3].shape, dtype=torch.float8_e4m3fn, device=device)  # [pages, block, 512]
        return (a[0], a[1], a[2], cache, a[4], a[5], torch.full((1,), 0.0625, device=device)), {}
    return tuple(a[:n]), {}


def tensors_of(torch, args, kwargs, result) -> list:
    """Every tensor an op could write or return: its tensor arguments, then its return value
    (vLLM's QuantizedActivation and dsv41's counterpart as data, scale)."""
    found = [x for x in list(args) + list(kwargs.values()) if isinstance(x, torch.Tensor)]

    def flat(r):
        if r is None:
            return []
        if isinstance(r, torch.Tensor):
            return [r]
        if isinstance(r, (tuple, list)):
            return [t for x in r for t in flat(x)]
        if hasattr(r, "data") and hasattr(r, "scale"):
            return [r.data, r.scale]
        return [torch.tensor(r)]

    return found + flat(result)


def as_bytes(torch, t):
    return t.detach().contiguous().reshape(-1).view(torch.uint8)


# ----------------------------------------------------------------------------- timing


class Timer:
    def __init__(self, torch, device, iters: int, host_calls: int):
        self.torch, self.device, self.iters, self.host_calls = torch, device, iters, host_calls
        self.cuda = device.type == "cuda"
        self.stand_in = False
        self.flush = None
        self.graphs = None  # dsv41.tools.bench's timer, for CUDA-graph replay (--graph)
        if self.cuda:
            l2 = getattr(torch.cuda.get_device_properties(device), "L2_cache_size", 0)
            self.flush = torch.empty(max(2 * l2, 128 << 20), dtype=torch.uint8, device=device)

    def sync(self):
        if self.cuda:
            self.torch.cuda.synchronize(self.device)

    def device_us(self, call) -> float:
        """Median µs of one call: CUDA events with a cold L2 and the launch queued behind a
        device sleep (the kernel, not Python's launch path); wall clock on the CPU."""
        torch = self.torch
        for _ in range(3):
            call()
        self.sync()
        times = []
        for _ in range(self.iters):
            if self.cuda:
                self.flush.zero_()
                torch.cuda._sleep(400_000)
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                call()
                end.record()
                end.synchronize()
                times.append(start.elapsed_time(end) * 1e3)
            else:
                t0 = time.perf_counter()
                call()
                times.append((time.perf_counter() - t0) * 1e6)
        return statistics.median(times)

    def host_us(self, call) -> float:
        """Wall µs per eager call over back-to-back calls (the host's launch path): the median
        of five blocks of ``host_calls`` calls, after a few untimed ones (a block that meets a
        garbage collection or a one-time cost says nothing about the call)."""
        for _ in range(3):
            call()
        self.sync()
        blocks = []
        for _ in range(5):
            t0 = time.perf_counter()
            for _ in range(self.host_calls):
                call()
            blocks.append((time.perf_counter() - t0) / self.host_calls * 1e6)
            self.sync()
        return statistics.median(blocks)

    def host_us_in_turn(self, calls: dict, before_block, rounds: int = 7) -> dict:
        """``host_us`` for several calls at once, their blocks taken in turn (a round is one
        block of each, the order reversed every other round), so that a host whose speed drifts
        during the run (other tenants, clocks) charges every side alike: median per side.
        ``before_block(side)`` runs untimed before each of that side's blocks."""
        for side, call in calls.items():
            before_block(side)
            for _ in range(3):
                call()
        self.sync()
        blocks = {side: [] for side in calls}
        for i in range(rounds):
            for side in (list(calls) if i % 2 == 0 else list(reversed(calls))):
                call = calls[side]
                before_block(side)
                t0 = time.perf_counter()
                for _ in range(self.host_calls):
                    call()
                blocks[side].append((time.perf_counter() - t0) / self.host_calls * 1e6)
                self.sync()
        return {side: statistics.median(b) for side, b in blocks.items()}


# ----------------------------------------------------------------------------- run


GRAPH_MAX_TOKENS = 64  # the bench's decode sizes: CUDA-graph replay there


def graph_us(timer, call, row: dict, side: str):
    """µs per call replayed from a CUDA graph of the bench's ``GRAPH_CALLS`` calls (the same
    method as ``python -m dsv41 bench``); None, with a note in the row, where capture fails.
    Each side is captured during its own pass: vLLM's before the plugin routes its names."""
    from dsv41.tools import bench

    try:
        return timer.graphs.graph(call) * 1e6
    except Exception as exc:  # one op's capture failing must not hide the others
        bench._recover(timer.graphs)
        row.setdefault("graph_note", f"{side}: capture failed: {type(exc).__name__}: {str(exc)[:200]}")
        return None


def host_in_turn(torch, before: dict, after: dict, tokens: int, timer, device, rows: dict, only):
    """Host µs per eager call of both sides at ``tokens`` tokens, measured in turn once the
    plugin has routed.  Before each vLLM block every name the plugin rebound holds vLLM's
    object again (vLLM's public functions call routed helpers through their module's names),
    and dsv41's before each dsv41 block."""
    from dsv41.integrations import vllm_plugin

    bindings = list(vllm_plugin._bindings)  # (module, attribute, vLLM's object, dsv41's object)

    def names(side):
        for mod, attr, old, new in bindings:
            setattr(mod, attr, old if side == "vllm" else new)

    try:
        for case in CASES:
            label = case[0]
            row = rows.get((label, tokens))
            if (only and not any(o in label for o in only)) or row is None or row.get("skipped") \
                    or row.get("error") or label not in before or label not in after:
                continue
            calls = {}
            for side, fn in (("vllm", before[label]), ("dsv41", after[label])):
                args, kwargs = build_args(torch, case, tokens, device)
                calls[side] = (lambda fn=fn, args=args, kwargs=kwargs: fn(*args, **kwargs))
            try:
                got = timer.host_us_in_turn(calls, names)
            except Exception as exc:
                row["error"] = f"host: {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"[:300]
                continue
            for side, us in got.items():
                row[f"{side}_host_us_alone"] = row.get(f"{side}_host_us")
                row[f"{side}_host_us"] = us
            del calls
            if device.type == "cuda":
                torch.cuda.empty_cache()
    finally:
        names("dsv41")


def run_side(torch, side: str, funcs: dict, sizes, timer, device, keep: dict, rows: dict, only):
    """Call ``funcs[label]`` on every case and size: keep (vLLM side) or compare (dsv41 side)."""
    for case in CASES:
        label = case[0]
        if only and not any(o in label for o in only):
            continue
        for tokens in sizes:
            row = rows.setdefault((label, tokens), {"op": label, "vllm_name": f"{case[1]}.{case[2]}", "tokens": tokens})
            if case[6] or label in SMOKE_SKIP and device.type == "cpu" and not timer.stand_in:
                row["skipped"] = case[6] or f"Triton's interpreter cannot run it ({SMOKE_SKIP[label]})"
                continue
            if row.get("error") or label not in funcs:
                continue
            fn = funcs[label]
            try:
                args, kwargs = build_args(torch, case, tokens, device)
                if timer.stand_in:  # nothing is launched: host time only
                    row[f"{side}_host_us"] = timer.host_us(lambda: fn(*args, **kwargs))
                    row["note"] = "stand-in driver: no launches, host time only"
                    del args, kwargs
                    print(f"  {side:5s} {label:28s} {tokens:6d}", flush=True)
                    continue
                result = fn(*args, **kwargs)
                timer.sync()
                got = [as_bytes(torch, t).clone() for t in tensors_of(torch, args, kwargs, result)]
                if side == "vllm":
                    keep[(label, tokens)] = got
                else:
                    want = keep[(label, tokens)]
                    if len(got) != len(want) or any(g.numel() != w.numel() for g, w in zip(got, want)):
                        row["bytes_equal"] = False
                        row["differing_bytes"] = None
                        row["note"] = "outputs differ in number or size"
                    else:
                        diff = sum(int((g != w).sum()) for g, w in zip(got, want))
                        row["bytes_equal"] = diff == 0
                        row["differing_bytes"] = diff
                        row["compared_bytes"] = sum(w.numel() for w in want)
                    del keep[(label, tokens)]
                del got, result
                row[f"{side}_us"] = timer.device_us(lambda: fn(*args, **kwargs))
                if timer.graphs is not None and tokens <= GRAPH_MAX_TOKENS:
                    row[f"{side}_graph_us"] = graph_us(timer, lambda: fn(*args, **kwargs), row, side)
                if tokens == 64 or (device.type == "cpu" and tokens == max(sizes)):
                    row[f"{side}_host_us"] = timer.host_us(lambda: fn(*args, **kwargs))
                del args, kwargs
            except Exception as exc:  # one failing op must not hide the others
                row["error"] = f"{side}: {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"[:300]
            finally:
                if device.type == "cuda":
                    torch.cuda.empty_cache()
            print(f"  {side:5s} {label:28s} {tokens:6d}  {row.get('error') or ''}", flush=True)


def table(rows: list) -> str:
    def f(x, spec=".1f"):
        return "-" if x is None else format(x, spec)

    graphs = any("vllm_graph_us" in r or "dsv41_graph_us" in r for r in rows)
    lines = [f"{'op':28s} {'tokens':>6s} {'vLLM us':>9s} {'dsv41 us':>9s} {'ratio':>6s}  "
             f"{'host vLLM':>9s} {'host dsv41':>10s}  "
             + (f"{'graph vLLM':>10s} {'graph dsv41':>11s}  " if graphs else "") + "bytes"]
    for r in rows:
        if r.get("skipped"):
            lines.append(f"{r['op']:28s} {r['tokens']:6d}  skipped: {r['skipped']}")
            continue
        v, d = r.get("vllm_us"), r.get("dsv41_us")
        ratio = d / v if v and d else None
        if r.get("error"):
            b = f"ERROR {r['error']}"
        elif r.get("bytes_equal"):
            b = f"equal ({r['compared_bytes']} B)"
        elif "bytes_equal" in r:
            b = f"DIFFER: {r['differing_bytes']} of {r.get('compared_bytes', '?')} B {r.get('note', '')}".rstrip()
        else:
            b = "-"
        g = (f"{f(r.get('vllm_graph_us'), '.2f'):>10s} {f(r.get('dsv41_graph_us'), '.2f'):>11s}  "
             if graphs else "")
        if r.get("graph_note"):
            b += f"; graph: {r['graph_note']}"
        lines.append(f"{r['op']:28s} {r['tokens']:6d} {f(v):>9s} {f(d):>9s} {f(ratio, '.2f'):>6s}  "
                     f"{f(r.get('vllm_host_us')):>9s} {f(r.get('dsv41_host_us')):>10s}  {g}{b}")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--archive", default=os.environ.get("VLLM_OPS_ARCHIVE", str(ROOT / ".device/vllm033-ops.tar.xz")))
    p.add_argument("--out", default=os.environ.get("OUT", str(ROOT / "gpu-out")))
    p.add_argument("--tokens", type=int, nargs="+", help="sizes (default 1 64 65536; --smoke: 1 5)")
    p.add_argument("--iters", type=int, help="timed calls per size (default 50; --smoke: 2)")
    p.add_argument("--host-calls", type=int, help="back-to-back calls for host time (default 200; --smoke: 3)")
    p.add_argument("--only", nargs="+", help="only the ops whose label contains one of these")
    p.add_argument("--graph", action="store_true",
                   help=f"also CUDA-graph replay of both sides at sizes up to {GRAPH_MAX_TOKENS} tokens")
    p.add_argument("--smoke", action="store_true", help="CPU, Triton's interpreter (TRITON_INTERPRET=1), tiny sizes")
    p.add_argument("--stand-in-driver", action="store_true",
                   help="CPU: kernels compiled for sm_90, nothing launched, host time only")
    a = p.parse_args(argv)
    sizes = a.tokens or ([1, 5] if a.smoke else [1, 64] if a.stand_in_driver else [1, 64, 65536])
    iters = a.iters or (2 if a.smoke else 50)
    host_calls = a.host_calls or (3 if a.smoke else 200)

    if a.smoke:
        if os.environ.get("TRITON_INTERPRET") != "1":
            p.error("--smoke runs Triton's interpreter: set TRITON_INTERPRET=1")
        sys.path.insert(0, str(ROOT / "tests"))
        from triton_interp import enable_exact_interpreter

        enable_exact_interpreter()

    if a.stand_in_driver:
        if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
            p.error("--stand-in-driver compiles the kernels: unset TRITON_INTERPRET")
        sys.path.insert(0, str(ROOT / "tests"))
        import bound_launch_check

        bound_launch_check._install()
        bound_launch_check._recording[0] = False

    import torch

    cpu_only = a.smoke or a.stand_in_driver
    device = torch.device("cuda" if torch.cuda.is_available() and not cpu_only else "cpu")
    if device.type == "cpu" and not cpu_only:
        p.error("no CUDA GPU here (use --smoke with TRITON_INTERPRET=1, or --stand-in-driver, on a CPU)")
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    stand_in = Path(tempfile.mkdtemp(prefix="vllm033-stand-in-"))
    manifest = lay_out_stand_in(Path(a.archive), stand_in)
    vllm = import_stand_in(stand_in)
    for pkg in (V4, V41):
        importlib.import_module(pkg)

    log_lines = []

    class Keep(logging.Handler):
        def emit(self, record):
            log_lines.append(record.getMessage())

    logging.getLogger("dsv41.vllm").addHandler(Keep())
    logging.getLogger("dsv41.vllm").setLevel(logging.INFO)

    timer = Timer(torch, device, iters, host_calls)
    timer.stand_in = a.stand_in_driver
    if a.graph:
        if device.type != "cuda":
            p.error("--graph needs a CUDA GPU")
        from dsv41.tools import bench

        timer.graphs = bench._Timer(device, iters, 1.0)
    rows, keep = {}, {}
    before = {c[0]: resolve(c[1], c[2]) for c in CASES}
    print(f"vLLM {vllm.__version__} stand-in at {stand_in}; device {device}")
    run_side(torch, "vllm", before, sizes, timer, device, keep, rows, a.only)

    # the plugin, as vLLM loads it
    os.environ.setdefault("DSV41_VLLM_OPS", "all")
    os.environ.setdefault("VLLM_PLUGINS", "dsv41")
    import vllm.plugins
    from dsv41.integrations import vllm_plugin

    vllm.plugins.load_general_plugins()
    how = "vllm.plugins.load_general_plugins() (entry point vllm.general_plugins: dsv41)"
    if not vllm_plugin.routed():
        vllm_plugin.register()
        how = "dsv41.integrations.vllm_plugin.register() (no dsv41 entry point installed)"
    after, not_routed = {}, {}
    for c in CASES:
        fn = resolve(c[1], c[2])
        if fn is before[c[0]] or not getattr(fn, "__module__", "").startswith("dsv41"):
            not_routed[c[0]] = f"{c[1]}.{c[2]} is still {getattr(fn, '__module__', '?')}.{c[2]}"
        else:
            after[c[0]] = fn
    for label, why in not_routed.items():
        for tokens in sizes:
            rows.setdefault((label, tokens), {"op": label, "tokens": tokens})["error"] = f"not routed: {why}"
    print(f"plugin: {how}")
    if a.stand_in_driver:
        # CPU tensors, NVIDIA kernels: each op's eager call object runs cuda:triton for "cpu"
        from dsv41.backends.cuda import CudaTritonBackend
        from dsv41.core import _calls
        from dsv41.core.registry import OPS

        triton_backend = CudaTritonBackend()
        for op in OPS:
            if op in triton_backend.kernels:
                getattr(_calls.ops, op).kernels[device] = triton_backend.load(op)
    run_side(torch, "dsv41", after, sizes, timer, device, keep, rows, a.only)
    host_tokens = 64 if 64 in sizes else max(sizes) if device.type == "cpu" else None
    if host_tokens is not None:
        host_in_turn(torch, before, after, host_tokens, timer, device, rows, a.only)

    ordered = list(rows.values())
    bad = [r for r in ordered if not r.get("skipped") and (r.get("error") or r.get("bytes_equal") is False)]
    info = {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda"
        else "cpu (stand-in driver: sm_90 builds, no launches)" if a.stand_in_driver else "cpu (Triton interpreter)",
        "torch": torch.__version__,
        "triton": importlib.import_module("triton").__version__,
        "dsv41": importlib.import_module("dsv41").__version__,
        "vllm_stand_in": vllm.__version__,
        "archive_manifest": manifest.splitlines(),
        "plugin": how,
        "plugin_log": log_lines,
        "DSV41_VLLM_OPS": os.environ.get("DSV41_VLLM_OPS"),
        "sizes": sizes,
        "iters": iters,
        "host_calls": host_calls,
        "timing": "device: CUDA events, cold L2, launch queued behind a device sleep, median; "
                  "host: wall time per eager call over back-to-back calls at 64 tokens, "
                  "both sides' blocks in turn"
                  + ("; graph: CUDA-graph replay of 16 calls, median per call, sizes <= 64" if a.graph else ""),
        "rows": ordered,
        "problems": len(bad),
    }
    (out / "vllm_side_by_side.json").write_text(json.dumps(info, indent=1) + "\n")
    text = table(ordered)
    text += f"\n{how}\n{sum(r.get('bytes_equal') is True for r in ordered)} byte-equal, {len(bad)} differing or failed, " \
            f"{sum(bool(r.get('skipped')) for r in ordered)} skipped\n"
    (out / "vllm_side_by_side.txt").write_text(text)
    print(text)
    shutil.rmtree(stand_in, ignore_errors=True)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
