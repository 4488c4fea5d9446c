"""Golden vectors from vLLM 0.33.0's own Triton kernels, run on the CPU in Triton's interpreter.

Set D (``tests/vectors/vllm-sm90-setD-0.33.0.tar.xz``) was written on an H200, where vLLM's e2m1
encoder -- the PTX ``cvt.rn.satfinite.e2m1x2.f32`` in an inline-asm helper -- does not assemble
(sm_90a).  This script fills that gap: it imports the released vLLM wheel at run time, runs its
kernels in Triton's CPU interpreter made bit-exact by ``tests/triton_interp.py``, and swaps only
the inline-asm helper for an emulation written from the PTX ISA's definition of that instruction.
No vLLM code is copied here, and nothing here imports dsv41: the vectors are an independent oracle.

Needs a separate venv with torch (CPU), triton 3.8/3.9, and ``vllm==0.33.0`` installed with
``--no-deps`` plus the small packages its imports pull in (tests/vectors/README.md lists them).

    python tools/vllm_interp_vectors.py                       # writes tests/vectors/vllm-interp-0.33.0.tar.xz
    python tools/vllm_interp_vectors.py --validate-set-d PATH # also re-runs six set-D cases and compares bytes

Case format and replay rule are set D's: one ``*.pt`` per case, ``{"op", "args", "out", "meta"}``,
``op(**args)`` replays it; in-place buffers in ``args`` are as they were before the call, views keep
their whole backing storage.
"""

from __future__ import annotations

import os

# Both must be set before torch/triton/vLLM are imported: vLLM picks its platform from the visible
# devices, and Triton turns @triton.jit into interpreter functions only when this is set at import.
os.environ["CUDA_VISIBLE_DEVICES"] = ""
os.environ["TRITON_INTERPRET"] = "1"

import argparse  # noqa: E402
import datetime  # noqa: E402
import glob  # noqa: E402
import hashlib  # noqa: E402
import importlib.util  # noqa: E402
import io  # noqa: E402
import json  # noqa: E402
import math  # noqa: E402
import sys  # noqa: E402
import tarfile  # noqa: E402
import time  # noqa: E402
from fractions import Fraction  # noqa: E402
from pathlib import Path  # noqa: E402

import torch  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
VLLM_VERSION = "0.33.0"
SEED = 1234
CANARY_U8 = 0xA5
CANARY_BF16 = 0xDEAD
P_FUSED = "vllm/models/deepseek_v41/common/ops/fused_compress_quant_cache.py"
P_INDEXER = "vllm/models/deepseek_v41/common/ops/indexer_k_store.py"
P_CACHE = "vllm/models/deepseek_v41/common/ops/cache_utils.py"


# --------------------------------------------------------------------------------------------
# cvt.rn.satfinite.e2m1x2.f32, from the PTX ISA (section "cvt", PTX 8.6+):
#   d[7:4] = convert(a), d[3:0] = convert(b); .rn = round to nearest, ties to even;
#   .satfinite: |x| > MAX_NORM (6) -> sign-preserved MAX_NORM (so +-inf -> +-6), and since e2m1
#   has no NaN encoding, "NaN results are converted to positive MAX_NORM" (0b0111).
# e2m1 code c (sign in bit 3) has magnitude {0, 0.5, 1, 1.5, 2, 3, 4, 6}[c & 7]; ties go to the
# even code, i.e. the midpoints 0.25, 1.25, 2.5, 5 round down and 0.75, 1.75, 3.5 round up.
# A result of zero keeps the input's sign (IEEE rounding), so -0.0 and small negatives give 0b1000.
# vLLM passes (x_hi, x_lo) as (a, b): the odd element lands in the high nibble.
# --------------------------------------------------------------------------------------------


@triton.jit
def _e2m1_rn_satfinite(x):
    a = tl.abs(x)
    code = (
        (a > 0.25).to(tl.uint32)
        + (a >= 0.75).to(tl.uint32)
        + (a > 1.25).to(tl.uint32)
        + (a >= 1.75).to(tl.uint32)
        + (a > 2.5).to(tl.uint32)
        + (a >= 3.5).to(tl.uint32)
        + (a > 5.0).to(tl.uint32)
    )
    sign = x.to(tl.uint32, bitcast=True) >> 31
    is_nan = x != x
    code = tl.where(is_nan, 7, code)
    sign = tl.where(is_nan, 0, sign)
    return (sign << 3) | code


@triton.jit
def e2m1x2_rn_satfinite(x_lo, x_hi):
    """Stand-in for vLLM's ``_fp32x2_to_fp4x2(x_lo, x_hi)``: one byte, x_hi in the high nibble."""
    return ((_e2m1_rn_satfinite(x_hi) << 4) | _e2m1_rn_satfinite(x_lo)).to(tl.uint8)


@triton.jit
def _e2m1_probe_kernel(x_ptr, out_ptr, N: tl.constexpr):
    i = tl.arange(0, N)
    lo = tl.load(x_ptr + 2 * i)
    hi = tl.load(x_ptr + 2 * i + 1)
    tl.store(out_ptr + i, e2m1x2_rn_satfinite(lo, hi))


_E2M1_GRID = [Fraction(0), Fraction(1, 2), Fraction(1), Fraction(3, 2), Fraction(2), Fraction(3),
              Fraction(4), Fraction(6)]


def _e2m1_expected(x: float) -> int:
    """Independent scalar reading of the same PTX rule, in exact rational arithmetic."""
    if math.isnan(x):
        return 0x7
    sign = 0x8 if math.copysign(1.0, x) < 0 else 0
    if math.isinf(x):
        return sign | 0x7
    a = Fraction(abs(x))
    best = min(range(8), key=lambda c: (abs(_E2M1_GRID[c] - a), c & 1))
    return sign | best


def check_e2m1_emulation() -> int:
    """Run the Triton emulation on edge values; raise on any disagreement with the scalar rule."""
    f32 = lambda v: float(torch.tensor(v, dtype=torch.float32))  # noqa: E731
    vals = [0.0, -0.0, 1e-45, -1e-45, 1e-30, -0.1, 0.25, -0.25, f32(0.25 + 2**-24), 0.5, 0.75,
            f32(0.75 - 2**-24), 1.0, 1.25, f32(1.25 + 2**-22), 1.5, 1.75, -1.75, 2.0, 2.5, -2.5,
            3.0, 3.5, 4.0, 5.0, -5.0, f32(5.0 + 2**-21), 6.0, 6.5, 7.0, -7.0, 1e30, -1e30,
            float("inf"), float("-inf"), float("nan"), -float("nan"), 0.3, 2.9, 4.4, -0.7, 0.26]
    vals += [float(v) for v in torch.linspace(-8, 8, 257)]
    if len(vals) % 2:
        vals.append(0.0)
    x = torch.tensor(vals, dtype=torch.float32)
    n = len(vals) // 2
    npow = triton.next_power_of_2(n)
    xp = torch.zeros(2 * npow, dtype=torch.float32)
    xp[: len(vals)] = x
    out = torch.zeros(npow, dtype=torch.uint8)
    _e2m1_probe_kernel[(1,)](xp, out, N=npow)
    for i in range(n):
        lo, hi = float(x[2 * i]), float(x[2 * i + 1])
        exp = (_e2m1_expected(hi) << 4) | _e2m1_expected(lo)
        if int(out[i]) != exp:
            raise RuntimeError(f"e2m1 emulation: ({lo!r}, {hi!r}) -> {int(out[i]):#04x}, expected {exp:#04x}")
    return len(vals)


# --------------------------------------------------------------------------------------------
# set-up: exact interpreter, vLLM import, the e2m1 swap
# --------------------------------------------------------------------------------------------


def enable_exact_interpreter():
    spec = importlib.util.spec_from_file_location("dsv41_tests_triton_interp", ROOT / "tests" / "triton_interp.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    mod.enable_exact_interpreter()
    # Float unary minus: Triton 3.9 lowers ``-x`` to fneg (-(+0) = -0); the Triton that compiled set D
    # on the H200 emitted ``0 - x`` (+0 for either zero), which is what the NVFP4 gather's zero signs
    # in set D show (spec/upstream_findings.md, finding 1).  Interpreted kernels follow the GPU here.
    import numpy as np
    from triton.runtime import interpreter as interp

    from triton._C.libtriton import ir

    B = interp.InterpreterBuilder
    if getattr(B, "_vllm_oracle_patched", False):
        return
    B.create_fneg = lambda self, x: self.unary_op(x, lambda v: np.subtract(np.zeros_like(v), v))
    # A symmetric ``tl.clamp(x, -m, m)`` compiles on sm90 to ``min.xorsign.abs``, which returns +m for
    # a NaN that came out of arithmetic (the GPU's NaN is positive); the interpreter's fmax/fmin gives
    # -m.  Seen in set D's 528 records (finding 3).  The 288 and MXFP4 kernels have no such clamp.
    clampf = B.create_clampf

    def create_clampf(self, arg, lo, hi, propagate_nans):
        out = clampf(self, arg, lo, hi, propagate_nans)
        if propagate_nans == ir.PROPAGATE_NAN.NONE and np.all(lo.data == -hi.data):
            out.data[...] = np.where(np.isnan(arg.data), hi.data, out.data)
        return out

    B.create_clampf = create_clampf
    B._vllm_oracle_patched = True


def import_vllm():
    import vllm

    if vllm.__version__ != VLLM_VERSION:
        raise SystemExit(f"need vllm=={VLLM_VERSION}, found {vllm.__version__}")
    import vllm.models.deepseek_v4.common.ops.fused_indexer_q as fiq
    import vllm.models.deepseek_v41.common.ops as ops41
    import vllm.models.deepseek_v41.common.ops.cache_utils as cu
    import vllm.models.deepseek_v41.common.ops.fused_compress_quant_cache as fcq
    import vllm.models.deepseek_v41.common.ops.indexer_k_store as iks

    original = fiq._fp32x2_to_fp4x2
    swapped = []
    for name, mod in sorted(sys.modules.items()):
        if name.startswith("vllm") and getattr(mod, "_fp32x2_to_fp4x2", None) is original:
            mod._fp32x2_to_fp4x2 = e2m1x2_rn_satfinite
            swapped.append(name)
    for need in (fcq.__name__, iks.__name__):
        if need not in swapped:
            raise SystemExit(f"{need} does not hold vLLM's e2m1 helper; the swap would miss it")
    return {
        "rope_quant_insert": fcq.rope_quant_insert,
        "indexer_k_norm_rope_store": ops41.indexer_k_norm_rope_store,
        "dequantize_and_gather_k_cache": cu.dequantize_and_gather_k_cache,
        "quantize_and_insert_k_cache": cu.quantize_and_insert_k_cache,
    }, swapped


def wheel_sha256(path: str | None) -> tuple[str | None, str | None]:
    if not path:
        return None, None
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return Path(path).name, h.hexdigest()


# --------------------------------------------------------------------------------------------
# inputs
# --------------------------------------------------------------------------------------------


def whole_clone(t: torch.Tensor) -> torch.Tensor:
    """Copy of ``t`` with its whole backing storage and the same view."""
    nbytes = t.untyped_storage().nbytes()
    raw = torch.empty(nbytes, dtype=torch.uint8)
    raw.untyped_storage().copy_(t.untyped_storage())
    base = raw.view(t.dtype) if t.element_size() == 1 else torch.empty(0, dtype=t.dtype).set_(
        raw.untyped_storage())
    return base.as_strided(t.shape, t.stride(), t.storage_offset())


def clone_arg(v):
    return whole_clone(v) if isinstance(v, torch.Tensor) else v


def paged_u8(pages: int, block: int, width: int, pad: int) -> torch.Tensor:
    """[pages, block, width] uint8 view of a flat canary buffer with ``pad`` bytes after each page."""
    stride = block * width + pad
    flat = torch.full((pages * stride,), CANARY_U8, dtype=torch.uint8)
    return flat.as_strided((pages, block, width), (stride, width, 1))


def cos_sin_table(rows: int, dtype=torch.float32) -> torch.Tensor:
    inv = 1.0 / (10000.0 ** (torch.arange(0, 64, 2, dtype=torch.float64) / 64))
    ang = torch.arange(rows, dtype=torch.float64)[:, None] * inv[None, :]
    return torch.cat([ang.cos(), ang.sin()], 1).to(dtype).contiguous()


# Row kinds for the 512-dim latent (tiles of 16 = one NVFP4 scale each).
TIE_PATTERN = [6.0, 5.0, 3.5, 2.5, 1.75, 1.25, 0.75, 0.25, 0.0, -0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0]
TIE_SCALES = [1.0, 0.5, 2.0, 0.375, 2.0**-7, 48.0, 448.0, 2.0**-9, 0.8125, 2.0**-8 * 3]
# amax / 6 on e4m3 rounding midpoints (normal and subnormal) and on the clamp bounds 2^-9, 448.
SCALE_EDGES = [1.0625, 1.1875, 0.0146484375, 1.5 * 2.0**-9, 2.5 * 2.0**-9, 2.0**-9, 0.5 * 2.0**-9,
               448.0, 464.0, 240.0 + 8.0, 0.0068359375, 3.0 * 2.0**-10]


def _signs(g, n):
    return torch.where(torch.rand(n, generator=g) < 0.5, -1.0, 1.0).to(torch.float64)


def latent_row(kind: str, g: torch.Generator, dim: int = 512) -> torch.Tensor:
    t = dim // 16
    if kind == "normal":
        sc = 2.0 ** torch.randint(-6, 7, (t,), generator=g).to(torch.float64)
        return (torch.randn(t, 16, generator=g, dtype=torch.float64) * sc[:, None]).reshape(dim)
    if kind == "unit":
        return _signs(g, dim)
    if kind == "zero":
        return torch.zeros(dim, dtype=torch.float64)
    if kind == "negzero":
        return torch.full((dim,), -0.0, dtype=torch.float64)
    if kind == "large":
        return torch.randn(dim, generator=g, dtype=torch.float64) * 1e4
    if kind == "tiny":
        return torch.randn(dim, generator=g, dtype=torch.float64) * 1e-6
    if kind == "verytiny":
        return torch.randn(dim, generator=g, dtype=torch.float64) * 1e-30
    if kind == "huge":
        return torch.randn(dim, generator=g, dtype=torch.float64) * 3e30
    if kind == "maxbf16":
        return _signs(g, dim) * 3.3895313892515355e38
    if kind == "exact6":  # every tile's amax exactly 6 * 2^k
        k = torch.randint(-9, 9, (t,), generator=g).to(torch.float64)
        x = (torch.rand(t, 16, generator=g, dtype=torch.float64) * 2 - 1) * 6 * (2.0**k)[:, None]
        x[torch.arange(t), torch.randint(0, 16, (t,), generator=g)] = 6 * 2.0**k
        return x.reshape(dim)
    if kind == "ties":  # e2m1 midpoints at several exact e4m3 scales
        rows = []
        for i in range(t):
            s = TIE_SCALES[i % len(TIE_SCALES)]
            p = torch.tensor(TIE_PATTERN, dtype=torch.float64)[torch.randperm(16, generator=g)]
            sg = _signs(g, 16)
            rows.append(torch.where(p == 0, p, p * sg) * s)
        return torch.cat(rows)
    if kind == "scaleedge":
        rows = []
        for i in range(t):
            m = SCALE_EDGES[i % len(SCALE_EDGES)]
            x = (torch.rand(16, generator=g, dtype=torch.float64) * 2 - 1) * 6 * m
            x[int(torch.randint(0, 16, (1,), generator=g))] = -6 * m if i % 2 else 6 * m
            rows.append(x)
        return torch.cat(rows)
    if kind == "mixed":
        kinds = ["normal", "zero", "negzero", "ties", "large", "tiny", "exact6", "scaleedge"]
        x = torch.stack([latent_row(k, g, dim) for k in kinds]).reshape(len(kinds), t, 16)
        pick = torch.randint(0, len(kinds), (t,), generator=g)
        return x[pick, torch.arange(t)].reshape(dim)
    if kind in ("inf", "nan"):
        x = latent_row("normal", g, dim)
        idx = torch.randperm(dim, generator=g)[:6]
        idx[0] = int(torch.randint(448, dim, (1,), generator=g))  # one in the RoPE dims
        bad = float("inf") if kind == "inf" else float("nan")
        x[idx] = bad * _signs(g, 6)
        return x
    raise ValueError(kind)


def build_rows(n: int, kinds: dict, g, dim=512, default="normal") -> torch.Tensor:
    rows = [latent_row(kinds.get(i, default), g, dim) for i in range(n)]
    return torch.stack(rows).to(torch.bfloat16)


KINDS_288 = {1: "unit", 5: "ties", 9: "zero", 13: "scaleedge", 17: "negzero", 21: "exact6", 25: "large",
             29: "ties", 33: "tiny", 37: "scaleedge", 41: "verytiny", 45: "mixed", 49: "huge", 53: "ties",
             57: "maxbf16", 61: "exact6", 65: "scaleedge", 69: "mixed", 73: "ties", 77: "mixed",
             81: "scaleedge", 85: "ties", 89: "exact6", 93: "mixed"}
KINDS_288_NONFINITE = {1: "inf", 7: "nan", 15: "inf", 23: "nan", 31: "mixed", 39: "inf", 47: "nan",
                       55: "ties", 63: "inf", 71: "nan", 79: "zero", 87: "negzero"}


def index_row(kind: str, g: torch.Generator) -> torch.Tensor:
    """128-dim indexer key before k_norm.  ``ties`` / ``exact6`` rows have a mean square of exactly
    1, so k_norm (weight 1 on dims 0..31) leaves dims 0..31 unchanged after the bf16 round trip and
    the first MXFP4 block sees exact e2m1 midpoints (scale 2^-2) or an amax of exactly 6 * 2^-2."""
    if kind in ("ties", "exact6"):
        base = ([0.0625, 0.1875, 0.3125, 0.4375, 0.625, 0.875, 1.25, 0.125] if kind == "ties"
                else [1.5, 1.0, 0.75, 0.5, 0.25, 0.125, 1.125, 0.375])
        b0 = torch.tensor(base * 4, dtype=torch.float64)[torch.randperm(32, generator=g)] * _signs(g, 32)
        rest = Fraction(128) - sum(Fraction(float(v)) ** 2 for v in b0)
        fill = _square_fill(rest, 96)
        fill = fill[torch.randperm(96, generator=g)] * _signs(g, 96)
        return torch.cat([b0, fill])
    return latent_row(kind, g, 128)


def _square_fill(rest: Fraction, n: int) -> torch.Tensor:
    """n magnitudes from {1.5, 1, 0.5, 0.25, 0} whose squares add up to exactly ``rest``."""
    for c25 in range(16):
        for c5 in range(4):
            for a in range(n + 1):
                b = rest - Fraction(9, 4) * a - Fraction(1, 4) * c5 - Fraction(1, 16) * c25
                if b >= 0 and b.denominator == 1 and a + int(b) + c5 + c25 <= n:
                    vals = [1.5] * a + [1.0] * int(b) + [0.5] * c5 + [0.25] * c25
                    return torch.tensor(vals + [0.0] * (n - len(vals)), dtype=torch.float64)
    raise RuntimeError(f"no exact fill for {rest}")


KINDS_INDEX = {1: "unit", 5: "ties", 9: "zero", 13: "exact6", 17: "large", 21: "ties", 25: "tiny",
               29: "verytiny", 33: "exact6", 37: "mixed", 41: "ties", 45: "normal", 49: "exact6",
               53: "negzero", 57: "mixed", 61: "ties"}


# --------------------------------------------------------------------------------------------
# cases
# --------------------------------------------------------------------------------------------


def run_case(fn, args: dict, outputs: list[str], returned: bool = False):
    work = {k: clone_arg(v) for k, v in args.items()}
    t0 = time.time()
    ret = fn(**work)
    out = {k: work[k] for k in outputs}
    if returned:
        out["ret"] = ret
    return out, time.time() - t0


def slots_for(T: int, start: int, page_order: list[int], block: int, holes: dict) -> torch.Tensor:
    s = []
    for t in range(T):
        logical = start + t
        s.append(page_order[logical // block] * block + logical % block)
    for t, v in holes.items():
        s[t] = v
    return torch.tensor(s, dtype=torch.int64)


def poison(rows: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor, cr: int) -> list[int]:
    """NaN the rows the op must never read (slot < 0, not closing a group, DP padding)."""
    T = slots.numel()
    bad = [t for t in range(rows.shape[0])
           if t >= T or int(slots[t]) < 0 or (int(positions[t]) + 1) % cr != 0]
    rows[bad] = float("nan")
    return bad


def rope_288_case(ops, name, cr, kinds, g, cos_dtype=torch.float32):
    T, pad_rows, block = 96, 2, 64
    p0 = 57
    positions = torch.arange(p0, p0 + T + pad_rows, dtype=torch.int64)
    holes = {3: -1, 17: -5, 40: -1, 61: -1, 95: -1}
    slots = slots_for(T, 40, [3, 0, 2], block, holes)
    latent = build_rows(T + pad_rows, kinds, g)
    bad = poison(latent, positions, slots, cr)
    args = {
        "latent": latent,
        "positions": positions,
        "cos_sin_cache": cos_sin_table(p0 + T + pad_rows, cos_dtype),
        "kv_cache": paged_u8(4, block, 288, 256),
        "slot_mapping": slots,
        "compress_ratio": cr,
    }
    out, dt = run_case(ops["rope_quant_insert"], args, ["kv_cache"])
    notes = (f"record 288 (NVFP4, interleaved per token), CR {cr}, T={T} (+{pad_rows} DP-padding rows past "
             f"slot_mapping), positions {p0}..{p0 + T - 1}, {str(cos_dtype).split('.')[-1]} cos/sin; "
             f"4 pages of 64, page padding 256 B, canary 0xA5, pages used in order [3, 0, 2] from "
             f"in-page slot 40 (page 1 untouched); slot holes {holes}; NaN poison rows (never read) "
             f"{bad}; row kinds (others normal): {kinds}")
    return name, "rope_quant_insert", P_FUSED, args, out, notes, dt


def indexer_case(ops, name, cr, g):
    T, pad_rows, block = 64, 2, 64
    p0 = 62
    positions = torch.arange(p0, p0 + T + pad_rows, dtype=torch.int64)
    holes = {4: -1, 19: -1, 50: -3}
    slots = slots_for(T, 20, [2, 0], block, holes)
    k_pre = torch.stack([index_row(KINDS_INDEX.get(i, "normal"), g) for i in range(T + pad_rows)]).to(torch.bfloat16)
    bad = poison(k_pre, positions, slots, cr)
    w = torch.ones(128, dtype=torch.float64)
    w[32:] = 0.8 + 0.4 * torch.rand(96, generator=g, dtype=torch.float64)
    args = {
        "k_pre": k_pre,
        "positions": positions,
        "cos_sin_cache": cos_sin_table(p0 + T + pad_rows),
        "rms_norm_weight": w.to(torch.bfloat16),
        "rms_norm_eps": 1e-6,
        "k_cache": paged_u8(3, block, 68, 64),
        "kv_slot_mapping": slots,
        "compress_ratio": cr,
        "use_fp4_cache": True,
    }
    out, dt = run_case(ops["indexer_k_norm_rope_store"], args, ["k_cache"])
    notes = (f"MXFP4 indexer cache (68 B/token: 64 B e2m1 pairs, page scale region of 4 UE8M0 per token), "
             f"page stride 4416 (64 B padding), CR {cr}, T={T} (+{pad_rows} DP-padding rows), positions "
             f"{p0}..{p0 + T - 1}, fp32 cos/sin, rms_norm_weight 1.0 on dims 0..31 else 0.8..1.2; pages "
             f"used in order [2, 0] from in-page slot 20 (page 1 untouched), canary 0xA5; slot holes {holes}; "
             f"NaN poison rows {bad}; row kinds (others normal): {KINDS_INDEX} ('ties'/'exact6': mean square "
             f"exactly 1, dims 0..31 on e2m1 midpoints / amax 6 at scale 2^-2)")
    return name, "indexer_k_norm_rope_store", P_INDEXER, args, out, notes, dt


GATHER_KINDS = {3: "unit", 20: "ties", 34: "zero", 50: "scaleedge", 65: "negzero", 80: "exact6",
                96: "large", 110: "ties", 127: "tiny", 140: "mixed", 158: "verytiny", 189: "huge",
                160: "maxbf16"}


def write_288_cache(ops, g):
    """A cache written by vLLM's 288 writer for 3 requests (seq 70, 90, 5)."""
    block = 64
    seqs = [70, 90, 5]
    table = [[4, 1, -1], [0, 5, -1], [2, -1, -1]]  # page 3 never referenced
    slots, positions = [], []
    for r, n in enumerate(seqs):
        for j in range(n):
            slots.append(table[r][j // block] * block + j % block)
            positions.append(j)
    T = len(slots)
    perm = torch.randperm(T, generator=g)  # write order scrambled
    slots = torch.tensor(slots, dtype=torch.int64)[perm]
    positions = torch.tensor(positions, dtype=torch.int64)[perm]
    latent = build_rows(T, GATHER_KINDS, g)
    cache = paged_u8(6, block, 288, 128)
    ops["rope_quant_insert"](latent, positions, cos_sin_table(96), cache, slots, 1)
    return cache, torch.tensor(seqs, dtype=torch.int32), torch.tensor(table, dtype=torch.int32)


def gather_288_cases(ops, g):
    cache, seq_lens, table = write_288_cache(ops, g)
    out_buf = torch.full((3, 96, 512), CANARY_BF16, dtype=torch.int32).to(torch.int16).view(torch.bfloat16)
    cases = []
    for name, gl, off, mgl in (("gather_288_full", None, 0, None),
                               ("gather_288_partial", torch.tensor([13, 90, 0], dtype=torch.int32), 3, 90)):
        args = {"out": out_buf.clone(), "k_cache": cache, "seq_lens": seq_lens, "gather_lens": gl,
                "block_table": table, "block_size": 64, "offset": off, "use_fnuz": False, "max_gather_len": mgl}
        out, dt = run_case(ops["dequantize_and_gather_k_cache"], args, ["out"])
        notes = (f"record 288 (NVFP4, interleaved per token); 3 requests seq [70, 90, 5]; gather_lens "
                 f"{None if gl is None else gl.tolist()}, offset {off}, max_gather_len {mgl}; block table "
                 f"[[4, 1, -1], [0, 5, -1], [2, -1, -1]] (-1 never read); out canary bf16 0xDEAD; cache written "
                 f"by vLLM 0.33.0's rope_quant_insert (record 288, CR 1, fp32 cos/sin, position = token index "
                 f"in its request, write order scrambled) from rows of kinds {GATHER_KINDS} (others normal), "
                 f"128 B page padding and page 3 left as canary 0xA5")
        cases.append((name, "dequantize_and_gather_k_cache", P_CACHE, args, out, notes, dt))
    return cases


def generate(ops):
    g = torch.Generator().manual_seed(SEED)
    cases = [
        rope_288_case(ops, "rope_quant_insert_288_cr1", 1, KINDS_288, g),
        rope_288_case(ops, "rope_quant_insert_288_cr2", 2, KINDS_288, g),
        rope_288_case(ops, "rope_quant_insert_288_cr1_bf16cos", 1, {5: "ties", 13: "scaleedge", 29: "mixed"}, g,
                      cos_dtype=torch.bfloat16),
        rope_288_case(ops, "rope_quant_insert_288_cr1_nonfinite", 1, KINDS_288_NONFINITE, g),
        rope_288_case(ops, "rope_quant_insert_288_cr2_nonfinite", 2, KINDS_288_NONFINITE, g),
        indexer_case(ops, "indexer_k_store_mxfp4_cr1", 1, g),
        indexer_case(ops, "indexer_k_store_mxfp4_cr2", 2, g),
    ]
    cases += gather_288_cases(ops, g)
    return cases


# --------------------------------------------------------------------------------------------
# set-D cross-check: the same inputs through the interpreter must give the H200's bytes
# --------------------------------------------------------------------------------------------

VALIDATE = ["rope_quant_insert_528_cr1", "rope_quant_insert_528_cr1_nonfinite", "indexer_k_store_fp8_cr1",
            "indexer_k_store_fp8_cr2", "gather_288_full", "quantize_insert_528"]


def validate_set_d(ops, path: str) -> list[dict]:
    results = []
    with tarfile.open(path, "r:xz") as tf:
        for name in VALIDATE:
            case = torch.load(io.BytesIO(tf.extractfile(name + ".pt").read()), weights_only=True)
            fn = ops[case["op"]]
            out, dt = run_case(fn, case["args"], list(case["out"]))
            diffs = {}
            for k, ref in case["out"].items():
                a = out[k].untyped_storage()
                b = ref.untyped_storage()
                ab = torch.frombuffer(bytearray(bytes(a)), dtype=torch.uint8)
                bb = torch.frombuffer(bytearray(bytes(b)), dtype=torch.uint8)
                diffs[k] = int((ab != bb).sum()) if ab.numel() == bb.numel() else "size differs"
            ok = all(v == 0 for v in diffs.values())
            results.append({"case": name, "identical": ok, "bytes_differing": diffs, "seconds": round(dt, 2)})
            print(f"  set D {name}: {'identical' if ok else 'DIFFERENT'} {diffs} ({dt:.1f}s)", flush=True)
    return results


# --------------------------------------------------------------------------------------------


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=str(ROOT / "tests" / "vectors" / "vllm-interp-0.33.0.tar.xz"))
    ap.add_argument("--wheel", default=None, help="the vLLM wheel installed (for its sha256 in meta)")
    ap.add_argument("--validate-set-d", default=None, metavar="ARCHIVE")
    a = ap.parse_args()

    enable_exact_interpreter()
    n_probe = check_e2m1_emulation()
    print(f"e2m1 emulation: {n_probe} probe values agree with the scalar PTX rule", flush=True)
    ops, swapped = import_vllm()
    print(f"vLLM {VLLM_VERSION}: e2m1 helper swapped in {swapped}", flush=True)
    wheel = a.wheel or next(iter(sorted(glob.glob("/work/vllm033/wheel/vllm-0.33.0-*.whl"))), None)
    wheel_name, sha = wheel_sha256(wheel)

    validation = validate_set_d(ops, a.validate_set_d) if a.validate_set_d else None

    meta_common = {
        "vllm_version": VLLM_VERSION, "wheel": wheel_name, "wheel_sha256": sha, "set": "interp",
        "device": "CPU: Triton interpreter (TRITON_INTERPRET=1) with tests/triton_interp.py's exact patch",
        "torch": str(torch.__version__), "triton": str(triton.__version__), "seed": SEED,
        "e2m1": "vLLM's _fp32x2_to_fp4x2 (inline PTX cvt.rn.satfinite.e2m1x2.f32) replaced by an emulation "
                "of that instruction per the PTX ISA (RNE, saturate to +-6, NaN -> +6, zero keeps its sign)",
    }
    manifest = dict(meta_common, generated=datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC"),
                    generator="tools/vllm_interp_vectors.py", e2m1_swapped_in=swapped, cases=[],
                    set_d_validation=validation)
    buf = io.BytesIO()
    t_all = time.time()
    with tarfile.open(fileobj=buf, mode="w:xz", preset=9) as tf:
        def add(name, data: bytes):
            info = tarfile.TarInfo(name)
            info.size = len(data)
            info.mtime = 0
            tf.addfile(info, io.BytesIO(data))

        for name, op, vpath, args, out, notes, dt in generate(ops):
            meta = dict(meta_common, vllm_path=vpath, notes=notes, case=name)
            b = io.BytesIO()
            torch.save({"op": op, "args": args, "out": out, "meta": meta}, b)
            add(name + ".pt", b.getvalue())
            manifest["cases"].append({"file": name + ".pt", "op": op, "vllm_path": vpath,
                                      "outputs": list(out), "notes": notes})
            print(f"  {name}: {dt:.1f}s", flush=True)
        add("manifest.json", json.dumps(manifest, indent=1).encode())
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_bytes(buf.getvalue())
    print(f"wrote {a.out} ({len(buf.getvalue())} B, {len(manifest['cases'])} cases) in {time.time() - t_all:.0f}s")
    if validation and not all(r["identical"] for r in validation):
        sys.exit(1)


if __name__ == "__main__":
    main()
