"""Measured launch shapes of the shared Triton kernels: one table, one format.

``TABLE`` maps a key to a ``Measured``: the launch parameters (``BLOCK_T``, ``num_warps``,
``BLOCK_H``, ``BLOCK_D``, ...) and the measurement they came from (a file under
``docs/measurements/``).  Keys are ``"<kernel>:<variant>"`` for the cache kernels (e.g.
``"rope:288"``) and the op name (with ``":<variant>"`` where a variant has its own) for the
others, for launches of more than ``launch.DECODE_T`` tokens (the best fraction of copy at
65536); ``":decode"`` holds the shape for launches of at most ``DECODE_T`` tokens (the best
CUDA-graph replay at 64) and ``":tiny"`` for at most ``launch.TINY_T`` where that differs.
A launcher without an entry uses its own heuristics.  Shapes never change the bytes written
(``tests/test_launch_shapes.py``).

``OVERRIDES`` maps a key to a shape in force at every size, ahead of the table: what the sweep
tool (``python -m dsv41.backends.triton.sweep``) and the tests try.
"""

from __future__ import annotations

import dataclasses

from . import conversions, launch

__all__ = ["Measured", "TABLE", "OVERRIDES", "Settings", "settings", "shape", "remembered"]

_GENERATION = [0]  # changes of every ``Settings`` dict so far


class Settings(dict):
    """A dict of launch settings (``OVERRIDES``, ``cache_kernels.CONFIG``) that counts its
    changes, nested dicts included (they become ``Settings`` when stored): ``settings()`` reads
    the count, so whatever a launcher derived from the old contents is known to be stale."""

    __slots__ = ()

    def __init__(self, *args, **kwargs):
        super().__init__()
        self.update(*args, **kwargs)

    def __setitem__(self, key, value):
        dict.__setitem__(self, key, Settings(value) if type(value) is dict else value)
        _GENERATION[0] += 1

    def __delitem__(self, key):
        dict.__delitem__(self, key)
        _GENERATION[0] += 1

    def update(self, *args, **kwargs):
        for key, value in dict(*args, **kwargs).items():
            self[key] = value

    def __ior__(self, other):
        self.update(other)
        return self

    def setdefault(self, key, default=None):
        if key not in self:
            self[key] = default
        return self[key]

    def pop(self, *args):
        out = dict.pop(self, *args)
        _GENERATION[0] += 1
        return out

    def popitem(self):
        out = dict.popitem(self)
        _GENERATION[0] += 1
        return out

    def clear(self):
        dict.clear(self)
        _GENERATION[0] += 1


def settings() -> tuple:
    """The process state a launcher reads besides its arguments: the count of settings changes,
    the conversion path forced in this context (``conversions.forced``) and where decode
    launches end (``launch.DECODE_T``, which tests move)."""
    return _GENERATION[0], conversions._FORCED.get(), launch.DECODE_T


@dataclasses.dataclass(frozen=True)
class Measured:
    shape: dict  # launch parameters
    source: str  # the measurement: a file under docs/measurements/, or how it was measured


def _m(source: str, **shape) -> Measured:
    return Measured(shape, source)


_S2, _S3, _S5 = "h200-sweep-2.txt", "h200-sweep-3.txt", "h200-sweep-5.jsonl.xz"
_S11 = "h100-sweep-11-index-builders.jsonl.xz"
_S13 = "h100-sweep-13-norms.jsonl.xz"
_S36 = "h100-sweep-36-qkv-decode.jsonl.xz"

TABLE: dict = {
    # cache kernels (BLOCK_T tokens per program, num_warps)
    "insert:584": _m(_S2, BLOCK_T=8, num_warps=2), "insert:584:decode": _m(_S2, BLOCK_T=4, num_warps=4),
    "insert:528": _m(_S2, BLOCK_T=8, num_warps=8), "insert:528:decode": _m(_S2, BLOCK_T=4, num_warps=4),
    "gather:584": _m(_S2, BLOCK_T=8, num_warps=2), "gather:584:decode": _m(_S2, BLOCK_T=4, num_warps=8),
    "gather:528": _m(_S2, BLOCK_T=32, num_warps=4), "gather:528:decode": _m(_S2, BLOCK_T=4, num_warps=8),
    "gather:288": _m(_S2, BLOCK_T=8, num_warps=8), "gather:288:decode": _m(_S2, BLOCK_T=4, num_warps=8),
    # the pair-word writers, within 0.01 of the best
    "rope:584": _m(_S3, BLOCK_T=4, num_warps=4), "rope:584:decode": _m(_S3, BLOCK_T=4, num_warps=4),
    "rope:528:decode": _m(_S3, BLOCK_T=4, num_warps=4),
    "rope:bf16:decode": _m(_S3, BLOCK_T=4, num_warps=8),
    # the 288 record's bf16x2 NVIDIA path: 4 x 1 0.83 of copy (16 x 4: 0.69), decode 1.21 us
    "rope:288": _m(_S5, BLOCK_T=4, num_warps=1), "rope:288:decode": _m(_S5, BLOCK_T=1, num_warps=1),
    "indexer:fp8": _m(_S2, BLOCK_T=32, num_warps=8), "indexer:fp8:decode": _m(_S2, BLOCK_T=8, num_warps=4),
    "norm1:None": _m(_S2, BLOCK_T=1, num_warps=2), "norm1:None:decode": _m(_S2, BLOCK_T=1, num_warps=4),
    # CR 2 beyond decode sizes: pair programs (two tokens, BLOCK_T 1) of one warp (0.88 of
    # copy; 2 / 4 warps 0.83 / 0.84)
    "norm2:None": _m("h200-sweep-6-call2.jsonl.xz", BLOCK_T=1, num_warps=1),
    # decode sizes: one token per program, 4 warps (H100 sweep, CUDA-graph replay at 64 tokens:
    # 2.47 us; 8 warps 3.65, 1 / 2 warps 2.93 / 2.94; sm_90 SASS 466 instructions against 1039
    # with 8 warps, whose layout repeats the vLLM-order sum of squares in every thread)
    "norm2:None:decode": _m(_S13, BLOCK_T=1, num_warps=4),
    # RoPE / quantization kernels
    "fused_inv_rope_fp8_quant": _m("the GPU suite's tuning sweep (test_gpu_tuning_sweep); no file kept",
                                   BLOCK_T=2, BLOCK_H=8, num_warps=4),
    # decode sizes: programs of one quant chunk (BLOCK_D 128), so only the chunk with the RoPE
    # dims waits for position -> cos/sin.  <= 8 tokens: 1 token x 1 head, one warp (it holds a
    # whole quant group: no cross-warp step for its max; 1.19 / 1.20 / 1.22 / 1.27 us at
    # 1 / 2 / 4 / 8 tokens, against 1.31 / 1.21 / 1.19 / 1.39 for 1 x 4 heads x 4 warps);
    # 9-64 tokens 4 x 4 x 128 (1.78-1.88 us at 64; whole rows of 4 x 1 1.97-1.98)
    "fused_inv_rope_fp8_quant:tiny": _m("h200-sweep-8-call3.jsonl.xz",
                                        BLOCK_T=1, BLOCK_H=1, num_warps=1, BLOCK_D=128),
    "fused_inv_rope_fp8_quant:decode": _m("h200-sweep-7-call2-inv-decode.jsonl.xz",
                                          BLOCK_T=4, BLOCK_H=4, num_warps=4, BLOCK_D=128),
    # one warp per row: its reductions stay in warp shuffles (H200: 0.77 of copy at 65536 rows,
    # 0.54 with 2 rows x 2 warps; H100, h100-sweep-36-qkv-decode.jsonl.xz: 1.00, one row x 2 warps
    # 0.88, x 4 warps 0.75-0.84)
    "fused_q_kv_rmsnorm_quant": _m(_S2, BLOCK_T=1, num_warps=1),
    # decode sizes: one Q row per program of 4 warps, KV rows two per program (H100 sweep,
    # CUDA-graph replay at 1 / 8 / 64 tokens: 1.41-1.45 / 1.55-1.57 / 1.63-1.64 us, 4 KV rows
    # alike; 8 warps 1.37-1.50 / 1.58-1.64 / 1.64-1.77, 2 warps 1.62 / 1.70 / 1.79)
    "fused_q_kv_rmsnorm_quant:decode": _m(_S36, BLOCK_T=1, num_warps=4, BLOCK_TKV=2),
    # the MXFP4 split path: 2.13 us at 64 tokens (8 warps: 2.25); at 65536 the heuristic shape
    # (1 x 64 heads, 4 warps) is the best, 0.77
    "fused_indexer_q_rope_quant:mxfp4:decode": _m(_S3, BLOCK_T=1, BLOCK_H=16, num_warps=4),
    # index builders above decode sizes (decode sizes: one row per program, index_kernels._row_shape).
    # H100 sweep at 65536 rows: combine 1.00 of copy (bandwidth tiling 8 x 1024 x 4 warps: 0.85)
    "combine_topk_swa_indices": _m(_S11, BLOCK_R=4, BLOCK_C=256, num_warps=8),
    # FlashInfer indices: one row per program of one warp.  Issue is its bound where DRAM is
    # fast (H200), and a row's prologue (token -> request -> lengths) runs in every thread that
    # holds the row: sm_90 SASS of the prefill path, 490 warp-instructions per row against 762
    # for 2 rows x 512 x 64 with 4 warps.  H100 sweeps (the kernel with CR still a run-time
    # value), 65536 / 4096 rows: 107.1 / 12.2 us against 113.1 / 13.3 for that shape, the best
    # of the grid at both sizes (h100-sweep-30-flashinfer-4096.jsonl.xz the other size).
    "build_flashinfer_mixed_sparse_indices": _m("h100-sweep-30-flashinfer-65536.jsonl.xz", BLOCK_R=1,
                                                BLOCK_C=512, BLOCK_W=64, num_warps=1),
}

OVERRIDES: dict = Settings()


def shape(key: str, tokens: int | None, override: str | None = None) -> dict | None:
    """The launch parameters for ``key`` at a launch of ``tokens`` tokens (rows): the override
    of ``override`` (default ``key``) if any, else the measured entry of that size class, else
    None (the launcher's heuristics)."""
    hit = OVERRIDES.get(key if override is None else override)
    if hit is not None:
        return hit
    m = launch.measured(TABLE, key, tokens)
    return None if m is None else m.shape


# Launch configurations that depend on integers only (sizes, strides, flags), per launcher and
# key: a decode step repeats a handful of them.  Computed afresh while an override is in force
# (the sweep and tests set ``OVERRIDES``), so an override always takes effect.
_CONFIGS: dict = {}
_CONFIGS_MAX = 1024


def remembered(key: tuple, make, *args):
    """``make(*args)``, remembered under ``key`` (which must determine it)."""
    if OVERRIDES:
        return make(*args)
    cfg = _CONFIGS.get(key)
    if cfg is None:
        if len(_CONFIGS) >= _CONFIGS_MAX:
            _CONFIGS.clear()
        cfg = _CONFIGS[key] = make(*args)
    return cfg
