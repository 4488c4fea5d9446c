"""Launch-shape sweep of the shared Triton kernels on a GPU (how the defaults were chosen).

``python -m dsv41.backends.triton.sweep --out DIR [--jobs N] [--only NAME ...]``

For each benchmark variant of ``dsv41.tools.bench`` that has tunable launch shapes, every shape
of its grid is timed at ``--tokens`` (default 65536) against a same-size device copy
(fraction of copy, as in the benchmark) and, at 64 tokens, under CUDA-graph replay.  Launch
shapes never change the bytes a kernel writes (docs/kernel_contract.md); the conformance
suite checks the chosen defaults.  Phase 1 compiles every shape in ``--jobs`` worker
processes (Triton's on-disk cache is shared), phase 2 times them one after the other, so
the timing runs alone on the device.  Results: ``DIR/sweep.jsonl`` (one line per shape) and
``DIR/sweep.txt`` (best shape per variant next to the built-in default).  ``--graph-tokens``
times the replay at other decode sizes too (e.g. ``1 8 64``); ``--repeat N`` times every
shape N times, in N passes, and the summary takes medians (decode-size replay times move
by +-0.2 us between moments of one run).
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import subprocess
import sys
import time

import torch
from dsv41.backends.triton import cache_kernels, tuning

from dsv41.tools import bench

DEFAULT = None  # the built-in launch shape of a launcher
_ABSENT = object()  # a table key the sweep added (removed again afterwards)


def _grid(**axes):
    keys = list(axes)
    return [dict(zip(keys, vals)) for vals in itertools.product(*(axes[k] for k in keys))]


_CACHE_BT_NW = _grid(bt=(4, 8, 16, 32), nw=(2, 4, 8))

# space name -> (how to apply a shape, the shapes[, the benchmark variant when the space's
# name is not that variant's])
SPACES = {
    "quantize_and_insert_k_cache [584]": (("cache", "insert:584"), _CACHE_BT_NW),
    "quantize_and_insert_k_cache [528]": (("cache", "insert:528"), _CACHE_BT_NW),
    "dequantize_and_gather_k_cache [584]": (("cache", "gather:584"), _CACHE_BT_NW),
    "dequantize_and_gather_k_cache [528]": (("cache", "gather:528"), _CACHE_BT_NW),
    "dequantize_and_gather_k_cache [288]": (("cache", "gather:288"), _CACHE_BT_NW),
    "rope_quant_insert [584]": (("cache", "rope:584"), _CACHE_BT_NW),
    "rope_quant_insert [528]": (("cache", "rope:528"), _CACHE_BT_NW),
    # without 16 tokens x 1 warp: on an H100 (Triton 3.6) that build of the NVIDIA path wrote
    # wrong bytes on every case of test_rope_288_every_swept_shape (h100-gpu-tests-40.txt; the
    # interpreter and rocm@cuda pass at that shape): ptxas 12.8, which Triton 3.6 ships, decodes
    # two of its e4m3 scales from registers nothing wrote (h100-gpu-tests-41.txt), so the sweep
    # must not pick it
    "rope_quant_insert [288]": (("cache", "rope:288"),
                                [s for s in _grid(bt=(1, 2, 4, 8, 16), nw=(1, 2, 4)) if (s["bt"], s["nw"]) != (16, 1)]),
    "rope_quant_insert [bf16]": (("cache", "rope:bf16"), _CACHE_BT_NW),
    # the 288 writer's RoPE groups: e2m1 compares on bf16x2 words or on fp32 values
    "rope_quant_insert [288] rope compares": (("flag", "rope288_words"), [{"value": False}],
                                              "rope_quant_insert [288]"),
    "indexer_k_norm_rope_store [FP8]": (("cache", "indexer:fp8"), _grid(bt=(8, 16, 32, 64), nw=(2, 4, 8))),
    "fused_save_compress_norm [CR1]": (("cache", "norm1:None"), _grid(bt=(1, 2, 4, 8), nw=(2, 4, 8))),
    # CR 2 at prefill sizes runs one program per two tokens (BLOCK_T 1); the decode shape
    # takes BLOCK_T from the grid
    "fused_save_compress_norm [CR2]": (("cache", "norm2:None"), _grid(bt=(1, 2, 4), nw=(1, 2, 4, 8))),
    # CR 2 pair programs (one warp) under a register cap: the compiler's 70 registers hold an
    # SM to 28 resident warps, 64 (the default) lets the 32-block limit bind
    "fused_save_compress_norm [CR2] maxnreg": (("flag", "norm2_maxnreg"), [{"value": None}, {"value": 56}],
                                               "fused_save_compress_norm [CR2]"),
    # with prev_rows (the HAS_PREV build: the older row from prev_rows or the ring)
    "fused_save_compress_norm [CR2 prev] maxnreg": (("flag", "norm2_maxnreg"),
                                                    [{"value": None}, {"value": 72}, {"value": 80}],
                                                    "fused_save_compress_norm [CR2 prev]"),
    # CR 2 ring save: PDL at every size with its loads before the wait (default) against
    # the plain order (PDL at decode sizes, the wait before every load)
    "fused_save_compress_norm [CR2] ring": (("flag", "ring_pdl"), [{"value": False}],
                                            "fused_save_compress_norm [CR2]"),
    "fused_indexer_q_rope_quant [FP8]": (("rope", "fused_indexer_q_rope_quant"),
                                         _grid(BLOCK_T=(1, 2, 4), BLOCK_H=(16, 32, 64), num_warps=(4, 8))),
    # the FP8 production shape (1 token x 64 heads, 4 warps) under register caps (None: the
    # compiler's choice; rope_kernels.INDEXER_Q_FP8_MAXNREG is the default)
    "fused_indexer_q_rope_quant [FP8] maxnreg": (("rope", "fused_indexer_q_rope_quant"),
                                                 [dict(BLOCK_T=1, BLOCK_H=64, num_warps=4, maxnreg=r)
                                                  for r in (None, 72, 80, 88)],
                                                 "fused_indexer_q_rope_quant [FP8]"),
    # the same shape in each NoPE mode (rope_kernels.INDEXER_Q_FP8_NOPE: held as fp32, loaded
    # again for its codes, uncapped and at 64 registers, held as bf16 pair words)
    "fused_indexer_q_rope_quant [FP8] nope": (("rope", "fused_indexer_q_rope_quant"),
                                              [dict(BLOCK_T=1, BLOCK_H=64, num_warps=4, nope=n, maxnreg=m)
                                               for n, m in (("fp32", None), ("reload", None), ("reload", 64),
                                                            ("words", None))],
                                              "fused_indexer_q_rope_quant [FP8]"),
    "fused_indexer_q_rope_quant [MXFP4]": (("rope", "fused_indexer_q_rope_quant"),
                                           _grid(BLOCK_T=(1, 2, 4), BLOCK_H=(16, 32, 64), num_warps=(4, 8))),
    "fused_inv_rope_fp8_quant": (("rope", "fused_inv_rope_fp8_quant"),
                                 _grid(BLOCK_T=(1, 2, 4, 8), BLOCK_H=(1, 2, 4, 8, 16), num_warps=(1, 2, 4, 8))),
    # decode shapes whose programs take one quant chunk (128 dims) or half a row: only the
    # chunk with the RoPE dims waits for position -> cos/sin
    "fused_inv_rope_fp8_quant [split rows]": (("rope", "fused_inv_rope_fp8_quant"),
                                              _grid(BLOCK_T=(1, 2, 4), BLOCK_H=(1, 2, 4),
                                                    num_warps=(1, 2, 4), BLOCK_D=(128, 256)),
                                              "fused_inv_rope_fp8_quant"),
    # the split-row shapes that led at 1 / 8 / 64 tokens in a pass over "split rows",
    # timed again with --repeat
    "fused_inv_rope_fp8_quant [decode shortlist]": (
        ("rope", "fused_inv_rope_fp8_quant"),
        [dict(BLOCK_T=bt, BLOCK_H=bh, num_warps=nw, BLOCK_D=bd) for bt, bh, nw, bd in (
            (1, 4, 4, 128), (1, 2, 4, 128), (1, 1, 2, 128), (2, 2, 1, 128), (2, 2, 2, 128),
            (1, 4, 2, 128), (2, 4, 4, 128), (4, 2, 4, 128), (4, 4, 4, 128), (4, 1, 4, 128),
            (4, 1, 4, 256), (2, 2, 4, 256), (4, 4, 4, 256), (4, 1, 4, 512))],
        "fused_inv_rope_fp8_quant"),
    # decode shapes for <= 8 tokens: the best 1-token and 8-token shapes of the shortlist
    # and their neighbours, timed at 1, 2, 4, 8 tokens with --repeat
    "fused_inv_rope_fp8_quant [tiers]": (
        ("rope", "fused_inv_rope_fp8_quant"),
        [dict(BLOCK_T=bt, BLOCK_H=bh, num_warps=nw, BLOCK_D=128) for bt, bh, nw in (
            (1, 4, 4), (1, 1, 2), (1, 2, 2), (1, 1, 1), (2, 1, 2), (1, 2, 4), (4, 4, 4))],
        "fused_inv_rope_fp8_quant"),
    # one warp per program (the best of "tiers" at 1-8 tokens) and its neighbours, against
    # the shortlist's best 1-token shape (1 x 4 heads, 4 warps)
    "fused_inv_rope_fp8_quant [one warp]": (
        ("rope", "fused_inv_rope_fp8_quant"),
        [dict(BLOCK_T=bt, BLOCK_H=bh, num_warps=nw, BLOCK_D=128) for bt, bh, nw in (
            (1, 1, 1), (1, 4, 4), (1, 2, 1), (2, 1, 1), (1, 4, 1), (2, 2, 1))],
        "fused_inv_rope_fp8_quant"),
    "fused_q_kv_rmsnorm_quant": (("rope", "fused_q_kv_rmsnorm_quant"),
                                 _grid(BLOCK_T=(1, 2, 4, 8), num_warps=(1, 2, 4, 8))),
    # decode sizes: one Q row per program; KV rows per program too (at most 4 by default)
    "fused_q_kv_rmsnorm_quant [decode]": (("rope", "fused_q_kv_rmsnorm_quant"),
                                          _grid(BLOCK_T=(1,), num_warps=(1, 2, 4, 8), BLOCK_TKV=(1, 2, 4)),
                                          "fused_q_kv_rmsnorm_quant"),
    "compute_global_topk_indices_and_lens": (("index", "compute_global_topk_indices_and_lens"),
                                             _grid(BLOCK_R=(1, 2), BLOCK_C=(512, 1024, 2048),
                                                   num_warps=(4, 8, 16))),
    # 64-bit element offsets where 32-bit ones would do (the launcher's default is 32-bit)
    "compute_global_topk_indices_and_lens [64-bit offsets]": (
        ("index", "compute_global_topk_indices_and_lens"),
        _grid(BLOCK_R=(1,), BLOCK_C=(512, 1024, 2048), num_warps=(4, 8), OFF32=(0,)),
        "compute_global_topk_indices_and_lens"),
    # the row builders: one row per program (vLLM's shape) up to the bandwidth tiling
    # One and two warps too: every thread of a program repeats the per-row prologue (the
    # request's values, positions), so fewer warps per row issue fewer instructions per row,
    # which is what bounds the FlashInfer kernel where DRAM is fast (docs/performance.md, "The
    # index builders since the table": 490 warp-instructions per row with one warp, 762 for
    # 2 rows x 4 warps).
    "combine_topk_swa_indices": (("index", "combine_topk_swa_indices"),
                                 _grid(BLOCK_R=(1, 2, 4, 8), BLOCK_C=(256, 512, 1024), num_warps=(1, 2, 4, 8))),
    "build_flashinfer_mixed_sparse_indices": (("index", "build_flashinfer_mixed_sparse_indices"),
                                              _grid(BLOCK_R=(1, 2, 4, 8), BLOCK_C=(256, 512),
                                                    BLOCK_W=(64, 128), num_warps=(1, 2, 4, 8))),
    "build_flashinfer_mixed_sparse_indices [64-bit offsets]": (
        ("index", "build_flashinfer_mixed_sparse_indices"),
        _grid(BLOCK_R=(1, 2), BLOCK_C=(256, 512), BLOCK_W=(128,), num_warps=(4,), OFF32=(0,)),
        "build_flashinfer_mixed_sparse_indices"),
}


class _Applied:
    """Context manager: one launch shape (or a ``flag`` of cache_kernels.CONFIG) in force at
    every size (DEFAULT: the built-in ones)."""

    def __init__(self, where, shape):
        self.kind, self.key = where
        self.shape = shape
        self.saved = {}

    def _table(self):
        if self.kind == "flag":
            return cache_kernels.CONFIG
        return tuning.OVERRIDES  # shapes of every kernel, in force at every size

    def __enter__(self):
        table = self._table()
        keys = (self.key,)
        self.saved = {k: table.get(k, _ABSENT) for k in keys}
        if self.shape is not None:
            if self.kind == "flag":
                value = self.shape["value"]
            elif self.kind == "cache":
                value = {"BLOCK_T": self.shape["bt"], "num_warps": self.shape["nw"]}
            else:
                value = dict(self.shape)
            for k in keys:
                table[k] = value
        return self

    def __exit__(self, *exc):
        table = self._table()
        for k, v in self.saved.items():
            if v is _ABSENT:
                table.pop(k, None)
            else:
                table[k] = v


def _variant(name):
    for v in bench.VARIANTS:
        if v.name == name:
            return v
    raise SystemExit(f"unknown variant {name!r}")


def _fn(name, tokens, device):
    v = _variant(SPACES[name][2] if len(SPACES[name]) > 2 else name)
    gen = bench._Gen(device, bench._seed(0, v, tokens))
    case = v.build(gen, tokens, bench._platform.probe())
    from dsv41.backends.cuda import CudaTritonBackend

    kernel = CudaTritonBackend().load(v.op)
    return (lambda: kernel(*case.args)), case.bytes


def _jobs(only):
    names = [n for n in SPACES if not only or any(o in n for o in only)]
    return [(n, i) for n in names for i in range(len(SPACES[n][1]) + 1)]  # index 0: default


def _shape(name, i):
    return DEFAULT if i == 0 else SPACES[name][1][i - 1]


def _compile(jobs, tokens, graph_tokens, device):
    for name, i in jobs:
        try:
            with _Applied(SPACES[name][0], _shape(name, i)):
                for t in (tokens, *graph_tokens):
                    fn, _ = _fn(name, t, device)
                    fn()
            torch.cuda.synchronize()
        except Exception as exc:  # a shape a kernel cannot take is reported in phase 2
            print(f"compile {name} #{i}: {type(exc).__name__}: {exc}", file=sys.stderr)


def _time(jobs, tokens, graph_tokens, device, out, repeat=1):
    timer = bench._Timer(device, 50, 0.2)
    timer.spin(bench.SPIN_UP_S)
    # passes over every shape, one after the other, so that a slow stretch of the device
    # (clocks, a neighbour) hits all shapes alike; the summary takes each figure's median
    for (rep, (name, i)) in ((r, j) for r in range(repeat) for j in jobs):
        timer.spin(bench.SPIN_S / 2)
        rec = {"variant": name, "shape": _shape(name, i), "tokens": tokens, "rep": rep}
        try:
            with _Applied(SPACES[name][0], rec["shape"]):
                fn, nbytes = _fn(name, tokens, device)
                sec, _ = timer.eager(fn)
                copy, _ = bench._measure_copy(timer, device, nbytes, graph=False)
                rec.update(seconds=sec, fraction_of_copy=(nbytes / sec) / (nbytes / copy))
                for gt in graph_tokens:
                    fng, bg = _fn(name, gt, device)
                    g = timer.graph(fng)
                    _, gcopy = bench._measure_copy(timer, device, bg, graph=True)
                    rec.update({f"graph_us_{gt}": g * 1e6,
                                f"copy_graph_us_{gt}": gcopy * 1e6 if gcopy else None})
        except Exception as exc:
            rec["error"] = f"{type(exc).__name__}: {exc}"[:300]
        out.write(json.dumps(rec) + "\n")
        out.flush()


def _medians(rows):
    """One row per (variant, shape): the median of each figure over its passes."""
    groups = {}
    for r in rows:
        groups.setdefault((r["variant"], json.dumps(r["shape"], sort_keys=True)), []).append(r)
    merged = []
    for rs in groups.values():
        ok = [r for r in rs if "error" not in r]
        if not ok:
            merged.append(rs[0])
            continue
        m = dict(ok[0])
        for key, val in ok[0].items():
            if key != "rep" and isinstance(val, float):
                vals = sorted(r[key] for r in ok if r.get(key) is not None)
                m[key] = vals[len(vals) // 2] if vals else None
        merged.append(m)
    return merged


def _summary(path, graph_tokens=(64,)):
    rows = _medians([json.loads(line) for line in open(path)])
    lines = []
    for name in dict.fromkeys(r["variant"] for r in rows):
        rs = [r for r in rows if r["variant"] == name and "error" not in r]
        if not rs:
            lines.append(f"{name}: every shape failed")
            continue
        default = next((r for r in rs if r["shape"] is None), None)
        best = max(rs, key=lambda r: r["fraction_of_copy"])
        g0 = f"graph_us_{graph_tokens[-1]}"
        d = f"{default['fraction_of_copy']:.2f} / {default[g0]:.2f} us" if default else "-"
        line = f"{name}: default {d}; best bw {best['shape']} {best['fraction_of_copy']:.2f} ({best[g0]:.2f} us)"
        for gt in graph_tokens:
            key = f"graph_us_{gt}"

            def rel(r, key=key, gt=gt):  # replay time over the copy's, timed right after it
                c = r.get(f"copy_graph_us_{gt}")
                return r[key] / c if c else r[key]

            fast = min(rs, key=rel)
            dg = f", default {default[key]:.2f} us = {rel(default):.2f} x copy" if default else ""
            line += (f"; best graph{gt} {fast['shape']} {fast[key]:.2f} us = {rel(fast):.2f} x copy"
                     f" ({fast['fraction_of_copy']:.2f}{dg})")
        lines.append(line)
    return "\n".join(lines)


def main(argv=None):
    p = argparse.ArgumentParser(prog="python -m dsv41.backends.triton.sweep", description=__doc__.split("\n")[0])
    p.add_argument("--out", required=True)
    p.add_argument("--tokens", type=int, default=65536)
    p.add_argument("--graph-tokens", type=int, nargs="+", default=[64],
                   help="decode sizes timed under CUDA-graph replay (default 64)")
    p.add_argument("--jobs", type=int, default=8, help="compile workers (phase 1)")
    p.add_argument("--repeat", type=int, default=1,
                   help="timing passes over all shapes (the summary takes medians)")
    p.add_argument("--only", nargs="+", help="variants whose name contains one of these")
    p.add_argument("--worker", type=int, nargs=2, metavar=("K", "N"), help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    device = torch.device("cuda", 0)
    jobs = _jobs(a.only)
    if a.worker:
        k, n = a.worker
        _compile(jobs[k::n], a.tokens, a.graph_tokens, device)
        return 0
    os.makedirs(a.out, exist_ok=True)
    t0 = time.time()
    cmd = [sys.executable, "-P", "-m", "dsv41.backends.triton.sweep", "--out", a.out, "--tokens", str(a.tokens),
           "--graph-tokens", *map(str, a.graph_tokens)]
    if a.only:
        cmd += ["--only", *a.only]
    procs = [subprocess.Popen([*cmd, "--worker", str(k), str(a.jobs)]) for k in range(a.jobs)]
    for pr in procs:
        pr.wait()
    print(f"compiled {len(jobs)} shapes in {time.time() - t0:.0f} s", flush=True)
    path = os.path.join(a.out, "sweep.jsonl")
    with open(path, "w") as out:
        _time(jobs, a.tokens, a.graph_tokens, device, out, a.repeat)
    text = _summary(path, a.graph_tokens)
    open(os.path.join(a.out, "sweep.txt"), "w").write(text + "\n")
    print(text)
    print(f"sweep done in {time.time() - t0:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
