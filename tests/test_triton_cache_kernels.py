"""The shared Triton cache kernels (backends/triton/cache_kernels.py) in Triton's CPU
interpreter, byte for byte against the pure-PyTorch reference and the H200 golden vectors.

Interpreter setup (works when the whole suite runs in one process, whatever was imported
before, with or without ``TRITON_INTERPRET`` in the environment):

* ``triton_interp.enable_exact_interpreter()`` makes the interpreter bit-exact (fp8 / bf16
  casts through torch, single-rounding fma, float64-evaluated log2) and lets interpreted
  kernels call compiled-mode ``@triton.jit`` functions (Triton's own ``tl.max``...);
* ``triton_interp.load_interpreted()`` imports a *private* copy of the kernel module with
  ``TRITON_INTERPRET=1`` set only for that import; ``sys.modules`` keeps the real module.

Every kernel runs in both vendor flavours: ``native`` (OCP e4m3 / bf16 through Triton's
casts, as on NVIDIA) and ``soft`` (integer encoders, as on ROCm / XPU).  Inputs are small
(a few programs per launch) so the file runs in well under two minutes on two cores.
"""

from __future__ import annotations

import functools
import inspect
import io
import os
import pathlib
import tarfile

import pytest
import torch

import golden  # noqa: E402  (tests/ is on sys.path)
from hostile import positions_past_the_table  # noqa: E402

pytest.importorskip("triton")

import triton.language as tl  # noqa: E402
import triton_interp  # noqa: E402  (tests/ is on sys.path: conftest / rootdir import)

from dsv41.backends.triton import conversions  # noqa: E402
from dsv41.core.codecs import (  # noqa: E402
    ceil_log2,
    e2m1_decode,
    e2m1_encode,
    e4m3_decode,
    e4m3_encode,
)
from dsv41.reference import compress as ref_compress  # noqa: E402
from dsv41.reference import indexer as ref_indexer  # noqa: E402
from dsv41.reference import k_cache as ref_k_cache  # noqa: E402

try:
    triton_interp.enable_exact_interpreter()
    CK = triton_interp.load_interpreted("dsv41.backends.triton.cache_kernels")
    INTERP_ERROR = None
except RuntimeError as _exc:
    # An unverified Triton (e.g. 3.6 on the GPU host): run only the GPU tests below, or skip
    # the file with the reason where there is no GPU.
    if not torch.cuda.is_available():
        pytest.skip(f"Triton interpreter not usable here: {_exc}", allow_module_level=True)
    CK = None
    INTERP_ERROR = str(_exc)

HAS_CUDA = torch.cuda.is_available()
gpu = pytest.mark.gpu
needs_cuda = pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")


@pytest.fixture(autouse=True)
def _interpreter_or_gpu(request):
    if CK is None and request.node.get_closest_marker("gpu") is None:
        pytest.skip(f"Triton interpreter not usable here: {INTERP_ERROR}")

REPO = pathlib.Path(__file__).resolve().parents[1]
VECTORS = golden.ARCHIVE  # tests/vectors (DSV41_VECTORS overrides)

F32 = torch.float32
BF16 = torch.bfloat16

# numpy warns about the overflows / NaNs the edge-case inputs are made of
pytestmark = pytest.mark.filterwarnings(
    "ignore:invalid value encountered:RuntimeWarning",
    "ignore:overflow encountered:RuntimeWarning",
)


@pytest.fixture(params=["native", "soft"])
def flavour(request):
    """Vendor flavour of the conversions (native casts as on NVIDIA, integer encoders)."""
    if CK is None:
        pytest.skip(f"Triton interpreter not usable here: {INTERP_ERROR}")
    with conversions.forced("integer" if request.param == "soft" else "hardware"):
        yield request.param


@pytest.fixture
def log2_mode(request):
    if CK is None:
        pytest.skip(f"Triton interpreter not usable here: {INTERP_ERROR}")
    old = CK.CONFIG["exact_log2"]
    CK.CONFIG["exact_log2"] = request.param
    yield request.param
    CK.CONFIG["exact_log2"] = old


# --------------------------------------------------------------------------------------
# helpers
# --------------------------------------------------------------------------------------


def _clone(v):
    """Copy of a tensor with its whole backing storage, same view (size, stride, offset)."""
    if not torch.is_tensor(v):
        return v
    raw = torch.empty(v.untyped_storage().nbytes(), dtype=torch.uint8)
    raw.untyped_storage().copy_(v.untyped_storage())
    return torch.empty(0, dtype=v.dtype).set_(raw.untyped_storage(), v.storage_offset(),
                                              v.shape, v.stride())


def _storage(v: torch.Tensor) -> torch.Tensor:
    return torch.empty(0, dtype=torch.uint8, device=v.device).set_(v.untyped_storage())


def _both(kernel, reference, args: list, outs: list[int]):
    """Run kernel and reference on separate clones; assert every storage byte of every
    output argument agrees (padding and canaries included)."""
    a = [_clone(x) for x in args]
    b = [_clone(x) for x in args]
    kernel(*a)
    reference(*b)
    for i in outs:
        got, exp = _storage(a[i]), _storage(b[i])
        bad = (got != exp).nonzero().flatten()
        assert bad.numel() == 0, (
            f"arg {i}: {bad.numel()} bytes differ, first at {bad[:8].tolist()}: "
            f"got {got[bad[:8]].tolist()} expected {exp[bad[:8]].tolist()}"
        )
    return a, b


def _paged(nb: int, B: int, width: int, pad: int, fill=0xA5, offset=0):
    """uint8 ``[nb, B, width]`` view with page stride ``B*width + pad`` (+ storage offset)."""
    page = B * width + pad
    base = torch.full((offset + nb * page + 7,), fill, dtype=torch.uint8)
    return base.as_strided((nb, B, width), (page, width, 1), offset)


def _cos_sin(max_pos=64, dtype=F32):
    inv = 10000.0 ** (-torch.arange(32, dtype=torch.float64) / 32)
    ang = torch.arange(max_pos, dtype=torch.float64)[:, None] * inv[None]
    return torch.cat((ang.cos(), ang.sin()), 1).to(dtype)


def _rows(n: int, width: int = 512, seed: int = 0, nonfinite: bool = False) -> torch.Tensor:
    """bf16 rows of the edge kinds the spec cares about (one kind per row, cycling)."""
    g = torch.Generator().manual_seed(seed)
    out = torch.empty(n, width, dtype=F32)
    kinds = ["normal", "zero", "negzero", "signedzeros", "tiny", "verytiny", "huge", "maxbf16",
             "exact448", "ties", "mixed", "large"]
    if nonfinite:
        kinds += ["inf", "nan"]
    for r in range(n):
        kind = kinds[r % len(kinds)]
        x = torch.randn(width, generator=g)
        if kind == "normal":
            sc = torch.exp2(torch.randint(-6, 7, (width // 32,), generator=g).float())
            x = x * sc.repeat_interleave(32)
        elif kind == "zero":
            x = torch.zeros(width)
        elif kind == "negzero":
            x = torch.full((width,), -0.0)
        elif kind == "signedzeros":
            x = torch.where(torch.rand(width, generator=g) < 0.5, 0.0, -0.0)
            x[::7] = torch.randn(x[::7].shape, generator=g)
        elif kind == "tiny":
            x = x * 1e-6
        elif kind == "verytiny":
            x = x * 1e-30
        elif kind == "huge":
            x = x * 3e30
        elif kind == "maxbf16":
            x = torch.where(torch.rand(width, generator=g) < 0.5, 3.3895e38, -3.3895e38) * (
                torch.rand(width, generator=g) < 0.3).float()
        elif kind == "exact448":
            x = x.clamp(-3, 3)
            for grp in range(0, width, 32):
                k = int(torch.randint(-8, 8, (1,), generator=g))
                x[grp + (grp // 32) % 32] = 448.0 * 2.0**k * (1 if grp % 64 else -1)
        elif kind == "ties":
            # e4m3 rounding ties and subnormals at scale 2^0 (group amax 448)
            ties = torch.tensor([1.0625, 2.125, 9.5, 17.0, 0.0029296875, 0.0048828125, 0.5625,
                                 -1.0625, -9.5, 208.0, 240.0, 232.0, -0.0009765625, 3.0e-3])
            x = ties[torch.randint(0, len(ties), (width,), generator=g)]
            x[::32] = 448.0
        elif kind == "mixed":
            x[:32] = 0.0
            x[32:64] = -0.0
            x[64:96] *= 1e-6
            x[96:128] *= 1e4
        elif kind == "large":
            x = x * 1e4
        elif kind == "inf":
            x[5] = float("inf")
            x[40] = float("-inf")
            x[300] = float("inf")
        elif kind == "nan":
            x[3] = float("nan")
            x[77] = float("nan")
            x[460] = float("nan")
        out[r] = x
    return out.to(BF16)


# --------------------------------------------------------------------------------------
# number helpers, one interpreted probe kernel per helper
# --------------------------------------------------------------------------------------


def _probe(x_ptr, out_ptr, n, OP: tl.constexpr, FNUZ: tl.constexpr, SOFT: tl.constexpr,
           EXACT: tl.constexpr, BLOCK: tl.constexpr):
    """Interpreted probe of one number helper (not a compiled kernel)."""
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = offs < n
    if OP == 0:
        y = CK._ceil_log2(tl.load(x_ptr + offs, mask=m, other=1.0), EXACT)
    elif OP == 1:
        y = CK._e4m3_encode(tl.load(x_ptr + offs, mask=m, other=0.0), FNUZ, SOFT)
    elif OP == 2:
        y = CK._e4m3_decode(tl.load(x_ptr + offs, mask=m, other=0), FNUZ, SOFT)
    elif OP == 3:
        y = CK._bf16_bits(tl.load(x_ptr + offs, mask=m, other=0.0), SOFT)
    elif OP == 5:
        y = CK._e2m1_code(tl.load(x_ptr + offs, mask=m, other=0.0)).to(tl.uint8)
    else:
        # e2m1 byte (code in the low nibble, junk in the high one) -> value * 2^-14
        y = CK._e2m1_half(tl.load(x_ptr + offs, mask=m, other=0).to(tl.int32) & 0xFF)
    tl.store(out_ptr + offs, y, mask=m)


@functools.lru_cache(maxsize=None)
def _probe_kernel():
    from triton.runtime.interpreter import InterpretedFunction

    return InterpretedFunction(_probe)


def _run_probe(op, x, out_dtype, fnuz=False, soft=True, exact=True):
    out = torch.empty(x.shape, dtype=out_dtype)
    n = x.numel()
    block = 1 << max(4, (n - 1).bit_length())
    _probe_kernel()[(1,)](x, out, n, OP=op, FNUZ=fnuz, SOFT=soft, EXACT=exact, BLOCK=block)
    return out


def _ceil_log2_inputs() -> torch.Tensor:
    k = torch.arange(-126, 128, dtype=torch.int64)
    j = torch.cat((torch.arange(0, 48), torch.tensor([1 << 20, (1 << 23) - 2, (1 << 23) - 1])))
    bits = ((k[:, None] + 127) << 23) | j[None, :]
    g = torch.Generator().manual_seed(3)
    rnd = torch.randint(0x00800000, 0x7F800000, (4000,), generator=g)
    bits = torch.cat((bits.flatten(), rnd, torch.tensor([0x7F800000])))
    return bits.to(torch.int32).view(F32)


@pytest.mark.parametrize("exact", [True, False], ids=["bits", "log2"])
def test_ceil_log2(exact):
    """``_ceil_log2`` == ceil(fl32(log2 r)) (codecs.ceil_log2) on every binade and the
    mantissas where the fp32 log2 rounds onto the integer (spec rope_quant_ops §1.5)."""
    r = _ceil_log2_inputs()
    got = _run_probe(0, r, F32, exact=exact)
    exp = ceil_log2(r)
    assert torch.equal(got, exp), (r[got != exp][:8], got[got != exp][:8], exp[got != exp][:8])


@pytest.mark.parametrize("fnuz", [False, True], ids=["ocp", "fnuz"])
@pytest.mark.parametrize("soft", [False, True], ids=["native", "soft"])
def test_e4m3_codec(fnuz, soft):
    if fnuz and not soft:
        soft = True  # FNUZ is always the integer encoder
    m = 224.0 if fnuz else 448.0
    # every bf16 in range, every e4m3 midpoint +- 1 ulp, random fp32
    allbf = torch.arange(0, 1 << 16, dtype=torch.int32).to(torch.int16).view(BF16).to(F32)
    allbf = allbf[torch.isfinite(allbf) & (allbf.abs() <= m)]
    grid = e4m3_decode(torch.arange(256, dtype=torch.uint8), fnuz)
    grid = grid[torch.isfinite(grid)].unique()
    mids = (grid[1:] + grid[:-1]) / 2
    mids = torch.cat((mids, torch.nextafter(mids, torch.full_like(mids, 1e9)),
                      torch.nextafter(mids, torch.full_like(mids, -1e9))))
    g = torch.Generator().manual_seed(1)
    rnd = (torch.rand(20000, generator=g) * 2 - 1) * torch.exp2(torch.randint(-14, 9, (20000,), generator=g).float())
    x = torch.cat((allbf, mids, rnd, torch.tensor([m, -m, 0.0, -0.0]))).clamp(-m, m)
    got = _run_probe(1, x, torch.uint8, fnuz=fnuz, soft=soft)
    exp = e4m3_encode(x, fnuz)
    assert torch.equal(got, exp), (x[got != exp][:8], got[got != exp][:8], exp[got != exp][:8])
    b = torch.arange(256, dtype=torch.uint8)
    dec = _run_probe(2, b, F32, fnuz=fnuz, soft=soft)
    ref = e4m3_decode(b, fnuz)
    same = (dec.view(torch.int32) == ref.view(torch.int32)) | (torch.isnan(dec) & torch.isnan(ref))
    assert bool(same.all()), b[~same]


@pytest.mark.parametrize("soft", [False, True], ids=["native", "soft"])
def test_bf16_bits(soft):
    g = torch.Generator().manual_seed(2)
    bits = torch.randint(-(1 << 31), (1 << 31) - 1, (30000,), generator=g, dtype=torch.int64)
    ties = (torch.randint(0, 1 << 16, (2000,), generator=g) << 16) | 0x8000
    x = torch.cat((bits, ties, torch.tensor([0x7F7FFFFF, 0x7F7F8000, 0x00000001, 0x80008000])))
    x = x.to(torch.int32).view(F32)
    got = _run_probe(3, x, torch.int16, soft=soft)
    exp = ref_k_cache._bf16_bits(x)
    assert torch.equal(got, exp)


def _approx_probe(x_ptr, out_ptr, n, rs_ptr, rc_ptr, e2_ptr, e2n_ptr, OP: tl.constexpr,
                  BLOCK: tl.constexpr):
    """Interpreted probe of the table forms of the GPU's approximate primitives."""
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = offs < n
    x = tl.load(x_ptr + offs, mask=m, other=1.0)
    if OP == 0:
        y = CK._rsqrt_approx(x, rs_ptr, False)
    elif OP == 1:
        y = CK._div_full(tl.full(x.shape, 1.0, tl.float32), x, rc_ptr, False)
    else:
        y = CK._exp_approx(x, e2_ptr, e2n_ptr, False)
    tl.store(out_ptr + offs, y, mask=m)


def _approx_inputs(op) -> torch.Tensor:
    """Random bit patterns of every class, both signs, plus edges (0, subnormals, inf, NaN, the
    ends of each table's domain, exp's -126 boundary and overflow)."""
    g = torch.Generator().manual_seed(11 + op)
    rnd = torch.randint(0, 1 << 32, (60000,), generator=g, dtype=torch.int64).to(torch.int32).view(F32)
    edges = [0.0, -0.0, 1e-45, -1e-45, 1e-39, 1.1754944e-38, 1.0, 2.0, 3.9999998, 4.0, 0.5,
             float("inf"), -float("inf"), float("nan"), 3.4028235e38, -1.0]
    if op == 2:
        z = torch.cat(((torch.rand(30000, generator=g) - 0.9) * 200, torch.tensor(
            [-87.33654, -87.33655, -87.3365, -88.0, -103.28, -103.3, -104.0, 88.72, 88.73, 89.0, -0.0])))
        return torch.cat((rnd.clamp(-1e4, 1e4), z, torch.tensor(edges)))
    return torch.cat((rnd, torch.rand(20000, generator=g) * 3 + 1, torch.tensor(edges)))


@pytest.mark.parametrize("op", ["rsqrt", "recip", "exp"])
def test_gpu_approx_table_forms(op):
    """The Triton table forms (``numerics._rsqrt_approx`` / ``_div_full`` / ``_exp_approx``
    without HW, what every non-SM90 launch runs) write the bits of ``dsv41.core.gpu_approx``."""
    from triton.runtime.interpreter import InterpretedFunction

    from dsv41.core import gpu_approx as GA

    code = ["rsqrt", "recip", "exp"].index(op)
    x = _approx_inputs(code).to(F32)
    tabs = [GA.result_bits(n, "cpu") for n in ("rsqrt", "rcp", "ex2", "ex2neg")]
    out = torch.empty_like(x)
    InterpretedFunction(_approx_probe)[(1,)](x, out, x.numel(), *tabs, OP=code,
                                             BLOCK=1 << (x.numel() - 1).bit_length())
    want = {"rsqrt": GA.rsqrt_approx, "recip": lambda v: GA.div_full(torch.ones_like(v), v),
            "exp": GA.exp_approx}[op](x)
    same = (out.view(torch.int32) == want.view(torch.int32)) | (torch.isnan(out) & torch.isnan(want))
    assert bool(same.all()), (x[~same][:8], out[~same][:8], want[~same][:8])


def test_e2m1_code():
    x = torch.linspace(-7, 7, 2801).to(F32)
    ties = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0, 6.5, 1e9, 0.0, -0.0,
                         float("inf"), 3e38, 1e-40, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0])
    g = torch.Generator().manual_seed(6)
    rnd = torch.randint(0, 1 << 32, (50000,), generator=g, dtype=torch.int64).to(torch.int32).view(F32)
    x = torch.cat((x, ties, -ties, torch.nextafter(ties, ties + 1), torch.nextafter(ties, ties - 1),
                   rnd, torch.tensor([float("nan"), -float("nan")])))
    got = _run_probe(5, x, torch.uint8)
    assert torch.equal(got, e2m1_encode(x))


def test_e2m1_half():
    """The gather's e2m1 decode: every nibble, times every finite e4m3 scale (negative ones
    and subnormals included), is the reference decode times the scale, bit for bit: code 8
    (-0) decodes to +0 (finding 1), so +0 * S keeps S's sign, as in the reference."""
    b = torch.arange(256, dtype=torch.uint8)
    half = _run_probe(7, b, F32)
    assert torch.equal(half * 16384.0, e2m1_decode((b & 0xF).to(torch.uint8), signed_zero=False))
    scales = e4m3_decode(torch.arange(256, dtype=torch.uint8), False)
    scales = scales[torch.isfinite(scales)]
    got = half[None, :16] * (scales * 16384.0)[:, None]
    exp = e2m1_decode(torch.arange(16, dtype=torch.uint8), signed_zero=False)[None, :] * scales[:, None]
    assert torch.equal(got.view(torch.int32), exp.view(torch.int32))


# --------------------------------------------------------------------------------------
# quantize_and_insert_k_cache
# --------------------------------------------------------------------------------------


@pytest.mark.parametrize("log2_mode", [True, False], ids=["bits", "log2"], indirect=True)
@pytest.mark.parametrize("fnuz", [False, True], ids=["ocp", "fnuz"])
@pytest.mark.parametrize("bpt", [584, 528])
def test_quantize_insert(flavour, log2_mode, fnuz, bpt):
    B, nb, T = 16, 4, 22
    k = _rows(T + 3, seed=bpt + fnuz, nonfinite=True)
    k[T:] = float("nan")  # DP padding rows: never read
    cache = _paged(nb, B, bpt, pad=64 if bpt == 584 else 32)
    g = torch.Generator().manual_seed(7)
    slots = torch.randperm(nb * B, generator=g)[:T]
    slots[2] = -1
    slots[9] = -1
    slots[0] = 0
    slots[1] = nb * B - 1  # last slot of the last page
    # flattened page view for the 584 record (as vLLM passes it), [nb, B, W] otherwise
    kc = cache.as_strided((nb, cache.stride(0)), (cache.stride(0), 1)) if bpt == 584 else cache
    _both(CK.quantize_and_insert_k_cache, ref_k_cache.quantize_and_insert_k_cache,
          [k, kc, slots, B, fnuz, bpt], [1])


@pytest.mark.parametrize("bpt", [584, 528])
def test_quantize_insert_misaligned_and_empty(flavour, bpt):
    """Odd storage offset and odd page stride (the bf16 tail is stored byte-wise), int32
    slots, and an empty batch that must write nothing."""
    B, nb, T = 8, 3, 9
    k = _rows(T, seed=11)
    cache = _paged(nb, B, bpt, pad=3, offset=1)
    slots = torch.tensor([5, -1, 0, 23, 7, 16, 1, 2, 3], dtype=torch.int32)
    _both(CK.quantize_and_insert_k_cache, ref_k_cache.quantize_and_insert_k_cache,
          [k, cache, slots, B, False, bpt], [1])
    empty = torch.empty(0, dtype=torch.int64)
    a, _ = _both(CK.quantize_and_insert_k_cache, ref_k_cache.quantize_and_insert_k_cache,
                 [k, cache, empty, B, False, bpt], [1])
    assert bool((_storage(a[1])[1:-7] == 0xA5).all())


# --------------------------------------------------------------------------------------
# dequantize_and_gather_k_cache
# --------------------------------------------------------------------------------------


def _gather_case(width, B=16, nb=6, seed=0, offset_storage=0, pad=48):
    g = torch.Generator().manual_seed(seed)
    cache = _paged(nb, B, width, pad=pad, offset=offset_storage)
    # random bytes: every e4m3 / e2m1 code, scale codes 0 and 255, NaN bytes
    flat = torch.randint(0, 256, (_storage(cache).numel(),), generator=g, dtype=torch.int64)
    _storage(cache).copy_(flat.to(torch.uint8))
    # a page written by the quantizer for realistic scales (records 584/528)
    if width in (584, 528):
        ref_k_cache.quantize_and_insert_k_cache(_rows(B, seed=seed + 1), cache,
                                                torch.arange(B) + B, B, False, width)
    seq = torch.tensor([37, 5, 0, 20], dtype=torch.int32)
    table_wide = torch.full((4, 9), -1, dtype=torch.int32)
    table_wide[:, :4] = torch.tensor([[3, 1, 5, 0], [2, -1, -1, -1], [-1] * 4, [1, 4, -1, -1]],
                                     dtype=torch.int32)
    table = table_wide[:, :4]  # row stride 9
    out = torch.full((4, 48, 512), 0, dtype=BF16)
    out.view(torch.int16).fill_(-8531)  # 0xDEAD canary
    return cache, seq, table, out


@pytest.mark.parametrize("fnuz", [False, True], ids=["ocp", "fnuz"])
@pytest.mark.parametrize("width", [584, 528, 288])
def test_gather(flavour, fnuz, width):
    if width == 288 and fnuz:
        pytest.skip("NVFP4 has no fp8 flavour")
    cache, seq, table, out = _gather_case(width, seed=width)
    _both(CK.dequantize_and_gather_k_cache, ref_k_cache.dequantize_and_gather_k_cache,
          [out, cache, seq, None, table, 16, 0, fnuz], [0])
    gl = torch.tensor([13, 5, 0, 0], dtype=torch.int32)
    _both(CK.dequantize_and_gather_k_cache, ref_k_cache.dequantize_and_gather_k_cache,
          [out, cache, seq, gl, table, 16, 3, fnuz], [0])


@pytest.mark.parametrize("width", [584, 288])
def test_gather_table_read_stays_in_its_row(flavour, width):
    """The kernel reads the block table at the logical block clamped into the row: a table of
    width 0, and rows whose logical block is past the width or whose position is negative
    (gather_lens > seq_lens), are written as zeros and nothing else moves; the rows in range
    are the plain gather's.  The table is a column slice of a wider tensor of valid block ids,
    so a row past the width written from the clamped entry, or from the one past the slice,
    would show as data."""
    cache, seq, _, out = _gather_case(width, seed=5)
    wide = torch.tensor([[3, 1, 5, 0, 2, 4]] * 4, dtype=torch.int32)
    canary = _storage(out).clone()
    a = _clone(out)
    CK.dequantize_and_gather_k_cache(a, cache, seq, None, wide[:, :0], 16, 0, False)
    rows = [min(int(n), 48) for n in seq]
    want = canary.view(4, 48, 1024).clone()
    for r, n in enumerate(rows):
        want[r, :n] = 0
    assert torch.equal(_storage(a), want.flatten())

    # width 2 = 32 positions: request 0 (L 37) has positions 32..36 past it; with
    # gather_lens 40 > L its first three rows have negative positions
    table = wide[:, :2]
    gl = torch.tensor([40, 5, 0, 20], dtype=torch.int32)
    a = _clone(out)
    CK.dequantize_and_gather_k_cache(a, cache, seq, gl, table, 16, 0, False)
    got = a.view(torch.int16)
    assert (got[0, :3] == 0).all() and (got[0, 3 + 32:40] == 0).all()
    assert torch.equal(a[0, 40:].view(torch.uint8), canary.view(4, 48, 1024)[0, 40:])
    plain = _clone(out)[:1, :32]
    CK.dequantize_and_gather_k_cache(plain, cache, torch.tensor([32], dtype=torch.int32), None,
                                     table[:1], 16, 0, False)
    assert torch.equal(got[0, 3:35], plain.view(torch.int16)[0])
    assert (got[0, 3:35] != 0).any()


@pytest.mark.parametrize("width", [584, 528, 288])
def test_gather_misaligned_narrow_grid(flavour, width):
    """Odd cache base / page stride and a grid of one worker per request (the loop)."""
    cache, seq, table, out = _gather_case(width, seed=3, offset_storage=1, pad=5)
    old = CK.CONFIG["gather_programs"]
    CK.CONFIG["gather_programs"] = 1
    try:
        _both(CK.dequantize_and_gather_k_cache, ref_k_cache.dequantize_and_gather_k_cache,
              [out, cache, seq, None, table, 16, 2, False], [0])
    finally:
        CK.CONFIG["gather_programs"] = old


# --------------------------------------------------------------------------------------
# rope_quant_insert
# --------------------------------------------------------------------------------------


def _rope_args(kind, cr, sanitize, cs_dtype=F32, seed=0, misaligned=False, odd_latent=False):
    B, nb, T = 16, 3, 20
    lat = _rows(T + 2, seed=seed, nonfinite=True)
    lat[T:] = float("nan")
    if odd_latent:
        # contiguous rows at an odd bf16 offset: not 4-byte aligned, read element-wise
        buf = torch.full(((T + 2) * 512 + 1,), float("nan"), dtype=lat.dtype)
        buf[1:] = lat.flatten()
        lat = buf[1:].view(T + 2, 512)
    pos = torch.arange(T + 2, dtype=torch.int64) + 5
    g = torch.Generator().manual_seed(seed)
    slots = torch.randperm(nb * B, generator=g)[:T]
    slots[3] = -1
    slots[6] = -5
    if kind in (584, 528, 288):
        cache = _paged(nb, B, kind, pad=7 if misaligned else 512, offset=1 if misaligned else 0)
    else:
        dt = BF16 if kind == "bf16" else torch.float8_e4m3fn
        base = torch.full((nb, B, 521 if misaligned else 520), 0, dtype=dt)  # 521: odd rows
        base.view(torch.uint8).fill_(0xA5)
        cache = base[:, :, :512]  # row padding: never written
    scale = torch.tensor([0.0375], dtype=F32) if kind == "fp8" else None
    return [lat, pos, _cos_sin(64, cs_dtype), cache, slots, cr, scale, sanitize]


@pytest.mark.parametrize("sanitize", [False, True], ids=["plain", "sanitize"])
@pytest.mark.parametrize("cr", [1, 2])
@pytest.mark.parametrize("kind", [584, 528, 288, "bf16", "fp8"])
def test_rope_quant_insert(flavour, kind, cr, sanitize):
    args = _rope_args(kind, cr, sanitize, cs_dtype=BF16 if cr == 1 else F32, seed=cr)
    _both(CK.rope_quant_insert, ref_compress.rope_quant_insert, args, [3])


@pytest.mark.parametrize("kind", [584, 528, 288, "bf16", "fp8"])
def test_rope_quant_insert_misaligned_cache_and_latent(flavour, kind):
    """Byte-aligned caches (byte stores) and an odd-offset latent (element-wise pair loads)."""
    args = _rope_args(kind, 2, False, misaligned=True, odd_latent=True, seed=11)
    assert args[0].data_ptr() % 4 != 0
    _both(CK.rope_quant_insert, ref_compress.rope_quant_insert, args, [3])


def test_rope_quant_insert_misaligned_int32_and_empty(flavour):
    args = _rope_args(584, 1, False, misaligned=True, seed=9)
    args[4] = args[4].to(torch.int32)
    args[1] = args[1].to(torch.int32)
    _both(CK.rope_quant_insert, ref_compress.rope_quant_insert, args, [3])
    args[4] = args[4][:0]
    _both(CK.rope_quant_insert, ref_compress.rope_quant_insert, args, [3])


def test_rope_quant_insert_zero_signs(flavour):
    """Finding 2: the NoPE "identity" rotation flips zero signs by the partner's sign."""
    args = _rope_args(528, 1, False, seed=4)
    lat = args[0]
    z = torch.tensor([0.0, -0.0, 1.0, -1.0, 0.0, 1.0, -0.0, -1.0], dtype=BF16)
    lat[:, :448] = z.repeat(56)
    for kind in (528, 288, "bf16"):
        a = _rope_args(kind, 1, False, seed=4)
        a[0] = lat.clone()
        _both(CK.rope_quant_insert, ref_compress.rope_quant_insert, a, [3])


# --------------------------------------------------------------------------------------
# indexer_k_norm_rope_store
# --------------------------------------------------------------------------------------


def _indexer_args(fp4, tiled, npt, cr, seed=0):
    B, nb, T = 64, 2, 24
    g = torch.Generator().manual_seed(seed)
    k = (torch.randn(T + 2, 128, generator=g) * torch.exp2(
        torch.randint(-4, 5, (T + 2, 1), generator=g).float())).to(BF16)
    k[1] = 0.0
    k[2] = -0.0
    k[4, :64] = 0.0
    k[5] = 3e30  # sum of squares overflows: an all-zero key (finding 3)
    k[7] = 1e-30
    pos = torch.arange(T + 2, dtype=torch.int64) * 3 + 1
    slots = torch.randperm(nb * B, generator=g)[:T]
    slots[0] = 0
    slots[3] = -1
    if cr == 2:
        # tokens that do not close a group are never read: poison them
        for t in range(T):
            if (int(pos[t]) + 1) % 2 != 0:
                k[t] = float("nan")
    k[T:] = float("nan")
    width = 68 if fp4 else 132
    cache = _paged(nb, B, width, pad=64)
    w = (torch.rand(128, generator=g) + 0.5).to(BF16)
    return [k, pos, _cos_sin(256), w, 1e-6, cache, slots, cr, fp4, npt if (fp4 and tiled) else 0,
            tiled]


@pytest.mark.parametrize("cr", [1, 2])
@pytest.mark.parametrize("layout", ["fp8", "fp8-tiled", "mxfp4", "mxfp4-tiled16",
                                    "mxfp4-tiled32", "mxfp4-tiled64"])
def test_indexer_k_store(flavour, layout, cr):
    fp4 = layout.startswith("mxfp4")
    tiled = "tiled" in layout
    npt = int(layout.rpartition("tiled")[2]) if (fp4 and tiled) else 0
    args = _indexer_args(fp4, tiled, npt, cr, seed=cr)
    _both(CK.indexer_k_norm_rope_store, ref_indexer.indexer_k_norm_rope_store, args, [5])


def test_indexer_k_store_empty(flavour):
    args = _indexer_args(False, False, 0, 1)
    args[6] = args[6][:0]
    _both(CK.indexer_k_norm_rope_store, ref_indexer.indexer_k_norm_rope_store, args, [5])


@pytest.mark.parametrize("cr", [1, 2])
@pytest.mark.parametrize("op", ["rope_quant_insert", "indexer_k_norm_rope_store"])
def test_positions_outside_the_table_read_the_nearest_row(flavour, op, cr):
    """docs/bad_input.md: a position outside the cos/sin table reads the table's nearest row
    (CR 2: and closes a group as that row's position would): the bytes of the same call with
    the positions clamped into the table, which the reference checks."""
    if op == "rope_quant_insert":
        args, out = _rope_args(528, cr, False, seed=21), 3
        kernel, ref = CK.rope_quant_insert, ref_compress.rope_quant_insert
    else:
        args, out = _indexer_args(False, False, 0, cr, seed=21), 5
        kernel, ref = CK.indexer_k_norm_rope_store, ref_indexer.indexer_k_norm_rope_store
    bad = positions_past_the_table(args[2].shape[0])
    args[1] = args[1].clone()
    args[1][: bad.numel()] = bad
    clamped = args[1].clamp(0, args[2].shape[0] - 1)
    _both(kernel, lambda *a: kernel(a[0], clamped, *a[2:]), args, [out])
    _both(kernel, ref, [args[0], clamped] + args[2:], [out])


# --------------------------------------------------------------------------------------
# fused_save_compress_norm
# --------------------------------------------------------------------------------------


def test_save_compress_norm_cr1(flavour):
    g = torch.Generator().manual_seed(0)
    rows = 12
    kvw = torch.randn(rows, 528, generator=g, dtype=F32) * 3
    kv = kvw[:, :512]
    kv[1] = 0.0
    kv[2] = 1e4
    kv[3] = 1e-6
    slots = torch.tensor([0, 1, -1, 3, 4, -1, 6, 7, 8, 9])
    out = torch.full((rows, 512), float("nan"), dtype=BF16)
    w = (torch.rand(512, generator=g) + 0.5).to(BF16)
    _both(CK.fused_save_compress_norm, ref_compress.fused_save_compress_norm,
          [kv, torch.arange(rows), None, slots, None, None, w, 1e-6, 1, out], [9])


def _cr2_args(starts=(6, 3, 0, 11), lens=(3, 7, 0, 2)):
    """Ring of capacity 4: a chunk starting on an odd position (pools with the ring row the
    previous chunk stored), a chunk longer than the ring (its writes must come after the
    ring read), a chunk whose first slot is -1, an empty request, a token past the last
    request.  (Defaults -- r0: 6..8, r1: 3..9 (starts odd, longer than the ring), r2: empty,
    r3: 11..12 (first slot -1); request r's ring is block r.)"""
    g = torch.Generator().manual_seed(1)
    cap, nblk = 4, len(starts)
    qsl = [0]
    pos, t2r, slots = [], [], []
    for r, (s, n) in enumerate(zip(starts, lens)):
        for i in range(n):
            p = s + i
            pos.append(p)
            t2r.append(r)
            slots.append(r * cap + p % cap)
        qsl.append(qsl[-1] + n)
    slots[qsl[3]] = -1
    pos.append(13)  # one token past the last request
    t2r.append(3)
    slots.append(3 * cap + 13 % cap)
    T = len(slots)
    rows = T + 2
    kv = torch.randn(rows, 1024, generator=g, dtype=F32)
    kv[:, 512:] *= 4
    kv[2, :512] = 0.0
    kv[5, 512:] = -1e4  # one row's weights vanish
    state = torch.randn(nblk, cap, 1024, generator=g, dtype=F32)
    out = torch.full((rows, 512), float("nan"), dtype=BF16)
    w = (torch.rand(512, generator=g) + 0.5).to(BF16)
    return [kv, torch.tensor(pos + [0, 0]), state, torch.tensor(slots),
            torch.tensor(qsl, dtype=torch.int32), torch.tensor(t2r + [0, 0], dtype=torch.int32),
            w, 1e-6, 2, out]


def test_save_compress_norm_cr2(flavour):
    _both(CK.fused_save_compress_norm, ref_compress.fused_save_compress_norm, _cr2_args(), [2, 9])


def _has_param(fn, name: str) -> bool:
    return name in inspect.signature(fn).parameters


def _prev_rows_refs():
    """Expectations of fused_save_compress_norm with prev_rows: the construction below, and
    the reference itself where it has the parameters."""
    refs = [_ref_prev_rows]
    if _has_param(ref_compress.fused_save_compress_norm, "prev_rows"):
        refs.append(ref_compress.fused_save_compress_norm)
    return refs


def _ref_prev_rows(kv, pos, state, slots, qsl, t2r, w, eps, cr, out, prev_rows=None,
                   prev_row_indices=None):
    """The paged reference without prev_rows run on a copy of the ring whose rows read by
    the chunks' first tokens are replaced by their prev_rows rows (prev_row_indices[r] >= 0),
    so latent_out is the pooled result and the ring itself is left as it was (no ring
    writes)."""
    if prev_rows is None or cr == 1:
        ref_compress.fused_save_compress_norm(kv, pos, state, slots, qsl, t2r, w, eps, cr, out)
        return
    ring = state.clone()
    cap = state.shape[1]
    for r in range(qsl.numel() - 1):
        t0 = int(qsl[r])
        if t0 == int(qsl[r + 1]) or int(prev_row_indices[r]) < 0:
            continue
        s, p = int(slots[t0]), int(pos[t0])
        if s >= 0 and p % 2 == 1:
            ring[s // cap, (p - 1) % cap] = prev_rows[int(prev_row_indices[r])]
    ref_compress.fused_save_compress_norm(kv, pos, ring, slots, qsl, t2r, w, eps, cr, out)


def _cr2_prev_args(idx_dtype=torch.int64):
    """``_cr2_args`` plus r4 (7..9: its first token closes a group, prev row -1: the ring
    row) and prev_rows (row stride 1040) for r1 (row 2) and r3 (row 0: its first slot is -1,
    never read); r0 starts a group (index never read), r2 is empty."""
    args = _cr2_args(starts=(6, 3, 0, 11, 7), lens=(3, 7, 0, 2, 3))
    g = torch.Generator().manual_seed(5)
    prev = (torch.randn(4, 1040, generator=g) * 2)[:, :1024]
    prev[1] = float("nan")  # never referenced
    prev[2, 512:] *= 8
    idx = torch.tensor([1, 2, -1, 0, -1, 3], dtype=idx_dtype)  # more entries than requests
    return args + [prev, idx]


@pytest.mark.parametrize("path", ["decode", "pairs"])
@pytest.mark.parametrize("idx_dtype", [torch.int64, torch.int32], ids=["i64", "i32"])
def test_save_compress_norm_cr2_prev_rows(flavour, path, idx_dtype, monkeypatch):
    """prev_rows: a chunk's first closing token pools with prev_rows[prev_row_indices[r]]
    (the ring row where the index is < 0), and the op writes no ring row."""
    if path == "pairs":
        monkeypatch.setattr(CK.launch, "DECODE_T", 0)  # the pair programs of large launches
    args = _cr2_prev_args(idx_dtype)
    for ref in _prev_rows_refs():
        a, _ = _both(CK.fused_save_compress_norm, ref, args, [2, 9])
    assert torch.equal(_storage(a[2]), _storage(args[2]))  # no ring row written
    # r1 really read its prev row: the ring row gives other bytes
    ring_only = _cr2_prev_args(idx_dtype)
    ring_only[11] = torch.full_like(ring_only[11], -1)
    for ref in _prev_rows_refs():
        b, _ = _both(CK.fused_save_compress_norm, ref, ring_only, [2, 9])
    t1 = int(args[4][1])
    assert not torch.equal(a[9][t1].view(torch.int16), b[9][t1].view(torch.int16))
    # without prev_rows: today's op (ring writes included)
    plain = _cr2_prev_args(idx_dtype)[:10]
    _both(CK.fused_save_compress_norm, ref_compress.fused_save_compress_norm, plain, [2, 9])


def test_save_compress_norm_cr1_ignores_prev_rows(flavour):
    g = torch.Generator().manual_seed(0)
    kv = torch.randn(6, 512, generator=g, dtype=F32)
    out = torch.full((6, 512), float("nan"), dtype=BF16)
    w = (torch.rand(512, generator=g) + 0.5).to(BF16)
    prev = torch.randn(2, 1024, generator=g)
    for ref in _prev_rows_refs():
        _both(CK.fused_save_compress_norm, ref,
              [kv, torch.arange(6), None, torch.tensor([0, -1, 2, 3, 4, 5]), None, None, w, 1e-6,
               1, out, prev, torch.tensor([0, 1])], [9])


# --------------------------------------------------------------------------------------
# save_ring_rows
# --------------------------------------------------------------------------------------


def _ref_save_ring_rows(rows, slot_mapping, state_cache):
    """Row i to (s // C, s % C) for each s >= 0."""
    cap = state_cache.shape[1]
    for i, s in enumerate(slot_mapping.tolist()):
        if s >= 0:
            state_cache[s // cap, s % cap] = rows[i]


@pytest.mark.parametrize("slot_dtype", [torch.int64, torch.int32], ids=["i64", "i32"])
def test_save_ring_rows(slot_dtype):
    g = torch.Generator().manual_seed(3)
    blocks, cap, N = 3, 4, 9
    rows = torch.randn(N + 1, 1040, generator=g)[:N, :1024]  # row stride 1040
    rows[2] = float("nan")
    rows[4] = -0.0
    # padded ring rows (stride(1) 1040) and a padded block (stride(0)): padding untouched
    base = torch.full((blocks, cap + 1, 1040), 0.0).view(torch.int32).fill_(0x7FA5A5A5).view(F32)
    state = base[:, :cap, :1024]
    slots = torch.tensor([5, -1, 0, 11, 7, -3, 2, 8, 9], dtype=slot_dtype)
    refs = [_ref_save_ring_rows] + ([ref_compress.save_ring_rows]
                                    if hasattr(ref_compress, "save_ring_rows") else [])
    for ref in refs:
        _both(CK.save_ring_rows, ref, [rows, slots, state], [2])
        a, _ = _both(CK.save_ring_rows, ref, [rows, slots[:0], state], [2])
        assert torch.equal(_storage(a[2]), _storage(state))


# --------------------------------------------------------------------------------------
# the interleaved V4.1 records (vLLM 0.33): token t's scales right after its values
# --------------------------------------------------------------------------------------

_SPLIT = {528: (512, 16), 288: (256, 32)}  # record width -> (value bytes, scale bytes)


def _il_index(B: int, width: int) -> torch.Tensor:
    """For every byte k of an interleaved page, the byte of the paged page holding it."""
    VB, SB = _SPLIT[width]
    k = torch.arange(B * width)
    t, j = k // width, k % width
    return torch.where(j < VB, VB * t + j, B * VB + SB * t + (j - VB))


def _relayout(cache: torch.Tensor, to_interleaved: bool) -> None:
    """Permute the record bytes of every page of ``cache`` (uint8 [nb, B, W], any page
    stride) between the paged and the interleaved layout, in place; bytes past the B
    records of a page stay where they are."""
    B, W = cache.shape[1], cache.shape[2]
    idx = _il_index(B, W)
    st = _storage(cache)
    for p in range(cache.shape[0]):
        base = cache.storage_offset() + p * cache.stride(0)
        page = st[base:base + B * W]
        if to_interleaved:
            page.copy_(page[idx])
        else:
            new = torch.empty_like(page)
            new[idx] = page
            page.copy_(new)


def _il_ref(ref_fn, cache_arg: int):
    """Expected bytes of an ``interleaved=True`` call of an op: the paged reference run on the
    cache permuted to the paged layout, then permuted back (its last argument is the flag)."""
    def run(*args):
        *rest, interleaved = args
        cache = rest[cache_arg]
        assert interleaved
        _relayout(cache, to_interleaved=False)
        ref_fn(*rest)
        _relayout(cache, to_interleaved=True)
    return run


def _ref_direct(ref_fn):
    """The reference itself once it has the ``interleaved`` parameter (None until then)."""
    return ref_fn if _has_param(ref_fn, "interleaved") else None


def test_il_index_is_the_layout():
    """The permutation matches the byte formulas of the interleaved layout."""
    B = 4
    for W, (VB, SB) in _SPLIT.items():
        idx = _il_index(B, W)
        for t in range(B):
            for j in (0, VB - 1):
                assert int(idx[W * t + j]) == VB * t + j
            for j in (0, SB - 1):
                assert int(idx[W * t + VB + j]) == B * VB + SB * t + j
        assert torch.equal(idx.sort().values, torch.arange(B * W))


@pytest.mark.parametrize("fnuz", [False, True], ids=["ocp", "fnuz"])
@pytest.mark.parametrize("layout", ["aligned", "misaligned"])
def test_quantize_insert_interleaved(flavour, fnuz, layout):
    B, nb, T = 16, 4, 22
    k = _rows(T + 3, seed=30 + fnuz, nonfinite=True)
    k[T:] = float("nan")
    mis = layout == "misaligned"
    cache = _paged(nb, B, 528, pad=3 if mis else 32, offset=1 if mis else 0)
    slots = torch.randperm(nb * B, generator=torch.Generator().manual_seed(8))[:T]
    slots[2] = -1
    slots[0] = 0
    slots[1] = nb * B - 1
    args = [k, cache, slots, B, fnuz, 528, True]
    _both(CK.quantize_and_insert_k_cache, _il_ref(ref_k_cache.quantize_and_insert_k_cache, 1),
          args, [1])
    ref = _ref_direct(ref_k_cache.quantize_and_insert_k_cache)
    if ref is not None:
        _both(CK.quantize_and_insert_k_cache, ref, args, [1])
    # interleaved=False is today's paged op
    _both(CK.quantize_and_insert_k_cache, ref_k_cache.quantize_and_insert_k_cache,
          args[:6] + [False], [1])


@pytest.mark.parametrize("fnuz", [False, True], ids=["ocp", "fnuz"])
@pytest.mark.parametrize("width", [528, 288])
def test_gather_interleaved(flavour, fnuz, width):
    if width == 288 and fnuz:
        pytest.skip("NVFP4 has no fp8 flavour")
    cache, seq, table, out = _gather_case(width, seed=width + 1)
    il = _clone(cache)
    _relayout(il, to_interleaved=True)
    gl = torch.tensor([13, 5, 0, 0], dtype=torch.int32)
    for args in ([out, il, seq, None, table, 16, 0, fnuz, True],
                 [out, il, seq, gl, table, 16, 3, fnuz, True]):
        a, _ = _both(CK.dequantize_and_gather_k_cache,
                     _il_ref(ref_k_cache.dequantize_and_gather_k_cache, 1), args, [0])
        # the interleaved copy of a cache gathers to the same rows as the paged one
        p = _clone(args[0])
        CK.dequantize_and_gather_k_cache(p, cache, *args[2:8], False)
        assert torch.equal(a[0].view(torch.int16), p.view(torch.int16))
        ref = _ref_direct(ref_k_cache.dequantize_and_gather_k_cache)
        if ref is not None:
            _both(CK.dequantize_and_gather_k_cache, ref, args, [0])


def test_gather_interleaved_misaligned_narrow_grid(flavour):
    for width in (528, 288):
        cache, seq, table, out = _gather_case(width, seed=5, offset_storage=1, pad=5)
        _relayout(cache, to_interleaved=True)
        old = CK.CONFIG["gather_programs"]
        CK.CONFIG["gather_programs"] = 1
        try:
            _both(CK.dequantize_and_gather_k_cache,
                  _il_ref(ref_k_cache.dequantize_and_gather_k_cache, 1),
                  [out, cache, seq, None, table, 16, 2, False, True], [0])
        finally:
            CK.CONFIG["gather_programs"] = old


@pytest.mark.parametrize("sanitize", [False, True], ids=["plain", "sanitize"])
@pytest.mark.parametrize("cr", [1, 2])
@pytest.mark.parametrize("kind", [528, 288])
def test_rope_quant_insert_interleaved(flavour, kind, cr, sanitize):
    args = _rope_args(kind, cr, sanitize, cs_dtype=BF16 if cr == 1 else F32, seed=10 + cr) + [True]
    _both(CK.rope_quant_insert, _il_ref(ref_compress.rope_quant_insert, 3), args, [3])
    ref = _ref_direct(ref_compress.rope_quant_insert)
    if ref is not None:
        _both(CK.rope_quant_insert, ref, args, [3])


@pytest.mark.parametrize("kind", [528, 288])
def test_rope_quant_insert_interleaved_misaligned(flavour, kind):
    args = _rope_args(kind, 2, False, misaligned=True, odd_latent=True, seed=12) + [True]
    _both(CK.rope_quant_insert, _il_ref(ref_compress.rope_quant_insert, 3), args, [3])
    ref = _ref_direct(ref_compress.rope_quant_insert)
    if ref is not None:
        _both(CK.rope_quant_insert, ref, args, [3])


# --------------------------------------------------------------------------------------
# golden vectors (vLLM's kernels on an H200)
# --------------------------------------------------------------------------------------

KERNEL_ARGS = {
    "quantize_and_insert_k_cache": ("k", "k_cache", "slot_mapping", "block_size", "use_fnuz",
                                    "bytes_per_token"),
    "dequantize_and_gather_k_cache": ("out", "k_cache", "seq_lens", "gather_lens",
                                      "block_table", "block_size", "offset", "use_fnuz"),
    "rope_quant_insert": ("latent", "positions", "cos_sin_cache", "kv_cache", "slot_mapping",
                          "compress_ratio", "fp8_scale", "sanitize_nans"),
    "indexer_k_norm_rope_store": ("k_pre", "positions", "cos_sin_cache", "rms_norm_weight",
                                  "rms_norm_eps", "k_cache", "kv_slot_mapping", "compress_ratio",
                                  "use_fp4_cache", "mxfp4_n_per_tile", "tiled"),
    "fused_save_compress_norm": ("kv_score", "positions", "state_cache", "slot_mapping",
                                 "query_start_loc", "token_to_req_indices", "rms_norm_weight",
                                 "rms_norm_eps", "compress_ratio", "latent_out"),
}
DEFAULTS = {"use_fnuz": False, "sanitize_nans": False, "mxfp4_n_per_tile": 0, "tiled": False}


@functools.lru_cache(maxsize=1)
def _golden() -> dict:
    cases = {}
    with tarfile.open(VECTORS, "r:xz") as tar:
        for m in tar.getmembers():
            if not (m.isfile() and m.name.endswith(".pt")):
                continue
            case = torch.load(io.BytesIO(tar.extractfile(m).read()), weights_only=True)
            if case["op"] in KERNEL_ARGS:
                cases[pathlib.Path(m.name).stem] = case
    return cases


def _golden_names():
    return sorted(_golden()) if VECTORS.is_file() else []


@pytest.mark.skipif(not VECTORS.is_file(), reason=f"golden vectors not found at {VECTORS}")
@pytest.mark.parametrize("name", _golden_names())
def test_golden(flavour, name):
    case = _golden()[name]
    args = {k: _clone(v) for k, v in case["args"].items()}
    CK.__dict__[case["op"]](*[args.get(n, DEFAULTS.get(n)) for n in KERNEL_ARGS[case["op"]]])
    for key, want in case["out"].items():
        got, exp = _storage(args[key]), _storage(want)
        bad = (got != exp).nonzero().flatten()
        assert bad.numel() == 0, f"{name}/{key}: {bad.numel()} bytes differ (first {bad[:8].tolist()})"


def test_golden_cases_present():
    if not VECTORS.is_file():
        pytest.skip(f"golden vectors not found at {VECTORS}")
    names = set(_golden_names())
    assert len(names) == 21, sorted(names)


# --------------------------------------------------------------------------------------
# GPU: the compiled kernels (python -m pytest -m gpu), same cases, reference on the CPU
# --------------------------------------------------------------------------------------


def _real():
    import dsv41.backends.triton.cache_kernels as real

    return real


@pytest.fixture(params=["native", "soft"])
def gpu_flavour(request):
    with conversions.forced("integer" if request.param == "soft" else "hardware"):
        yield _real()


def _to_cuda(v):
    """CUDA copy keeping the view (whole storage copied)."""
    if not torch.is_tensor(v):
        return v
    raw = _storage(v).to("cuda")
    return torch.empty(0, dtype=v.dtype, device="cuda").set_(
        raw.untyped_storage(), v.storage_offset(), v.shape, v.stride())


def _both_gpu(kernel, reference, args, outs):
    a = [_to_cuda(x) for x in args]
    b = [_clone(x) for x in args]
    kernel(*a)
    torch.cuda.synchronize()
    reference(*b)
    for i in outs:
        got, exp = _storage(a[i]).cpu(), _storage(b[i])
        bad = (got != exp).nonzero().flatten()
        assert bad.numel() == 0, f"arg {i}: {bad.numel()} bytes differ, first at {bad[:8].tolist()}"


def _gpu_cases():
    cases = []
    for bpt in (584, 528):
        for fnuz in (False, True):
            def c(bpt=bpt, fnuz=fnuz):
                B, nb, T = 16, 4, 22
                k = _rows(T + 3, seed=bpt + fnuz, nonfinite=True)
                slots = torch.randperm(nb * B, generator=torch.Generator().manual_seed(7))[:T]
                slots[2] = -1
                return ("quantize_and_insert_k_cache", ref_k_cache.quantize_and_insert_k_cache,
                        [k, _paged(nb, B, bpt, pad=64), slots, B, fnuz, bpt], [1])
            cases.append((f"insert-{bpt}-{'fnuz' if fnuz else 'ocp'}", c))
    for width in (584, 528, 288):
        for fnuz in ((False, True) if width != 288 else (False,)):
            def c(width=width, fnuz=fnuz):
                cache, seq, table, out = _gather_case(width, seed=width)
                gl = torch.tensor([13, 5, 0, 0], dtype=torch.int32)
                return ("dequantize_and_gather_k_cache", ref_k_cache.dequantize_and_gather_k_cache,
                        [out, cache, seq, gl, table, 16, 3, fnuz], [0])
            cases.append((f"gather-{width}-{'fnuz' if fnuz else 'ocp'}", c))
    for kind in (584, 528, 288, "bf16", "fp8"):
        for cr in (1, 2):
            for sanitize in (False, True):
                def c(kind=kind, cr=cr, sanitize=sanitize):
                    return ("rope_quant_insert", ref_compress.rope_quant_insert,
                            _rope_args(kind, cr, sanitize, cs_dtype=BF16 if cr == 1 else F32,
                                       seed=cr), [3])
                cases.append((f"rope-{kind}-cr{cr}-{'san' if sanitize else 'plain'}", c))
    for kind in (584, 528, 288, "bf16", "fp8"):
        def c(kind=kind):
            return ("rope_quant_insert", ref_compress.rope_quant_insert,
                    _rope_args(kind, 1, False, misaligned=True, odd_latent=True, seed=9), [3])
        cases.append((f"rope-{kind}-misaligned-cache-and-latent", c))
    for layout in ("fp8", "fp8-tiled", "mxfp4", "mxfp4-tiled16", "mxfp4-tiled32", "mxfp4-tiled64"):
        for cr in (1, 2):
            def c(layout=layout, cr=cr):
                fp4 = layout.startswith("mxfp4")
                tiled = "tiled" in layout
                npt = int(layout.rpartition("tiled")[2]) if (fp4 and tiled) else 0
                return ("indexer_k_norm_rope_store", ref_indexer.indexer_k_norm_rope_store,
                        _indexer_args(fp4, tiled, npt, cr, seed=cr), [5])
            cases.append((f"indexer-{layout}-cr{cr}", c))
    # the interleaved 528 / 288 records (expected bytes: the paged reference, permuted)
    for fnuz in (False, True):
        def c(fnuz=fnuz):
            B, nb, T = 16, 4, 22
            slots = torch.randperm(nb * B, generator=torch.Generator().manual_seed(8))[:T]
            slots[2] = -1
            return ("quantize_and_insert_k_cache",
                    _il_ref(ref_k_cache.quantize_and_insert_k_cache, 1),
                    [_rows(T + 3, seed=30 + fnuz, nonfinite=True), _paged(nb, B, 528, pad=32),
                     slots, B, fnuz, 528, True], [1])
        cases.append((f"insert-528-{'fnuz' if fnuz else 'ocp'}-il", c))
    for width in (528, 288):
        def c(width=width):
            cache, seq, table, out = _gather_case(width, seed=width + 1)
            _relayout(cache, to_interleaved=True)
            gl = torch.tensor([13, 5, 0, 0], dtype=torch.int32)
            return ("dequantize_and_gather_k_cache",
                    _il_ref(ref_k_cache.dequantize_and_gather_k_cache, 1),
                    [out, cache, seq, gl, table, 16, 3, False, True], [0])
        cases.append((f"gather-{width}-il", c))
        for cr in (1, 2):
            def c(width=width, cr=cr):
                return ("rope_quant_insert", _il_ref(ref_compress.rope_quant_insert, 3),
                        _rope_args(width, cr, False, cs_dtype=BF16 if cr == 1 else F32,
                                   seed=10 + cr) + [True], [3])
            cases.append((f"rope-{width}-cr{cr}-il", c))
    return cases


GPU_CASES = _gpu_cases()


@gpu
@needs_cuda
@pytest.mark.parametrize("case", [c for _, c in GPU_CASES], ids=[n for n, _ in GPU_CASES])
def test_gpu_against_reference(gpu_flavour, case):
    op, ref, args, outs = case()
    _both_gpu(getattr(gpu_flavour, op), ref, args, outs)


@gpu
@needs_cuda
@pytest.mark.skipif(not VECTORS.is_file(), reason=f"golden vectors not found at {VECTORS}")
@pytest.mark.parametrize("name", _golden_names())
def test_gpu_golden(gpu_flavour, name):
    case = _golden()[name]
    args = {k: _to_cuda(v) for k, v in case["args"].items()}
    getattr(gpu_flavour, case["op"])(*[args.get(n, DEFAULTS.get(n)) for n in KERNEL_ARGS[case["op"]]])
    torch.cuda.synchronize()
    for key, want in case["out"].items():
        got, exp = _storage(args[key]).cpu(), _storage(want)
        assert torch.equal(got, exp), f"{name}/{key}: {(got != exp).sum().item()} bytes differ"


@gpu
@needs_cuda
def test_gpu_save_compress_norm(gpu_flavour):
    g = torch.Generator().manual_seed(0)
    kv = torch.randn(12, 528, generator=g)[:, :512]
    slots = torch.tensor([0, 1, -1, 3, 4, -1, 6, 7, 8, 9])
    out = torch.full((12, 512), float("nan"), dtype=BF16)
    w = (torch.rand(512, generator=g) + 0.5).to(BF16)
    _both_gpu(gpu_flavour.fused_save_compress_norm, ref_compress.fused_save_compress_norm,
              [kv, torch.arange(12), None, slots, None, None, w, 1e-6, 1, out], [9])
    _both_gpu(gpu_flavour.fused_save_compress_norm, ref_compress.fused_save_compress_norm,
              _cr2_args(), [2, 9])


@gpu
@needs_cuda
@pytest.mark.parametrize("tokens", ["decode", "pairs"])
def test_gpu_save_compress_norm_prev_rows_and_save_ring_rows(gpu_flavour, tokens, monkeypatch):
    if tokens == "pairs":
        monkeypatch.setattr(gpu_flavour.launch, "DECODE_T", 0)
    _both_gpu(gpu_flavour.fused_save_compress_norm, _ref_prev_rows, _cr2_prev_args(), [2, 9])
    g = torch.Generator().manual_seed(3)
    rows = torch.randn(10, 1040, generator=g)[:9, :1024]
    state = torch.randn(3, 5, 1040, generator=g)[:, :4, :1024]
    _both_gpu(gpu_flavour.save_ring_rows, _ref_save_ring_rows,
              [rows, torch.tensor([5, -1, 0, 11, 7, -3, 2, 8, 9]), state], [2])


@gpu
@needs_cuda
@pytest.mark.skipif(os.environ.get("DSV41_BENCH") != "1", reason="set DSV41_BENCH=1")
def test_gpu_bench():
    """Time every launcher at 65 536 tokens (gathers 4 x 16 384) against a device copy of
    the same number of bytes (read + write), and CUDA-graph replay at 1 / 8 / 64 tokens.

    ``DSV41_BENCH_CONFIGS="8x8,16x8"`` sweeps tokens-per-program x warps (all kernels);
    ``DSV41_BENCH_OPS`` filters ops by substring."""
    from triton.testing import do_bench

    real = _real()
    dev = "cuda"
    N, B = 65536, 64
    nb = N // B
    g = torch.Generator(device=dev).manual_seed(0)
    perm = torch.randperm(nb, device=dev, generator=g)
    slots = (perm[:, None] * B + torch.arange(B, device=dev)).flatten()
    k = torch.randn(N, 512, device=dev, dtype=BF16)
    pos = torch.arange(N, device=dev)
    cs = _cos_sin(N).to(dev)
    only = os.environ.get("DSV41_BENCH_OPS", "")
    copy_cache = {}

    def copy_time(nbytes):
        if nbytes not in copy_cache:
            src = torch.empty(nbytes // 2, dtype=torch.uint8, device=dev)
            dst = torch.empty_like(src)
            copy_cache[nbytes] = do_bench(lambda: dst.copy_(src))
        return copy_cache[nbytes]

    rows = []

    def bench(name, fn, nbytes):
        if only and not any(o in name for o in only.split(",")):
            return
        try:
            fn()
            t = do_bench(fn)
        except Exception as exc:  # e.g. out of resources for a sweep config
            rows.append((name, float("nan"), 0.0, 0.0, type(exc).__name__))
            return
        rows.append((name, t * 1e3, nbytes / t / 1e6, copy_time(nbytes) / t, ""))

    def run_all():
        for w in (584, 528):
            cache = torch.zeros(nb, B * w + 512, dtype=torch.uint8, device=dev)
            bench(f"quantize_insert_{w}", lambda cache=cache, w=w: real.quantize_and_insert_k_cache(
                k, cache, slots, B, False, w), N * (1024 + w + 8))
        R, L = 4, N // 4
        table = perm.view(R, -1).to(torch.int32)
        seq = torch.full((R,), L, dtype=torch.int32, device=dev)
        out = torch.empty(R, L, 512, dtype=BF16, device=dev)
        for w in (584, 528, 288):
            cache = torch.randint(0, 120, (nb, B * w + 512), dtype=torch.uint8, device=dev)
            cache3 = cache.as_strided((nb, B, w), (cache.stride(0), w, 1))
            bench(f"gather_{w}", lambda cache3=cache3: real.dequantize_and_gather_k_cache(
                out, cache3, seq, None, table, B, 0, False), N * (w + 1024))
        for kind in (584, 528, 288, "bf16"):
            if kind == "bf16":
                cache = torch.empty(nb, B, 512, dtype=BF16, device=dev)
                w = 1024
            else:
                w = kind
                cache = torch.zeros(nb, B * w + 512, dtype=torch.uint8, device=dev).as_strided(
                    (nb, B, w), (B * w + 512, w, 1))
            bench(f"rope_quant_insert_{kind}", lambda cache=cache: real.rope_quant_insert(
                k, pos, cs, cache, slots, 1, None, False), N * (1024 + w + 16 + 256))
        kidx = torch.randn(N, 128, device=dev, dtype=BF16)
        icache = torch.zeros(nb, B * 132 + 64, dtype=torch.uint8, device=dev).as_strided(
            (nb, B, 132), (B * 132 + 64, 132, 1))
        wgt = torch.ones(128, device=dev, dtype=BF16)
        bench("indexer_k_store_fp8", lambda: real.indexer_k_norm_rope_store(
            kidx, pos, cs, wgt, 1e-6, icache, slots, 1, False, 0, False), N * (256 + 132 + 16 + 256))
        kv1 = torch.randn(N, 512, device=dev)
        lat = torch.empty(N, 512, device=dev, dtype=BF16)
        w512 = torch.ones(512, device=dev, dtype=BF16)
        bench("save_compress_norm_cr1", lambda: real.fused_save_compress_norm(
            kv1, pos, None, slots, None, None, w512, 1e-6, 1, lat), N * (2048 + 1024 + 8))
        kv2 = torch.randn(N, 1024, device=dev)
        nreq = 64
        qsl = (torch.arange(nreq + 1, device=dev) * (N // nreq)).to(torch.int32)
        t2r = (torch.arange(N, device=dev) // (N // nreq)).to(torch.int32)
        state = torch.zeros(nreq, 4, 1024, device=dev)
        rslots = t2r.long() * 4 + pos % 4
        bench("save_compress_norm_cr2", lambda: real.fused_save_compress_norm(
            kv2, pos, state, rslots, qsl, t2r, w512, 1e-6, 2, lat), N * (4096 + 512 + 16))

    configs = [c for c in os.environ.get("DSV41_BENCH_CONFIGS", "").split(",") if c]
    old = {key: dict(real.CONFIG[key]) for key in ("block_t", "num_warps")}
    try:
        for cfg in configs or [None]:
            if cfg is not None:
                bt, nw = (int(v) for v in cfg.split("x"))
                for key in old["block_t"]:
                    real.CONFIG["block_t"][key] = bt
                for key in old["num_warps"]:
                    if key != "ring":
                        real.CONFIG["num_warps"][key] = nw
            before = len(rows)
            run_all()
            for i in range(before, len(rows)):
                rows[i] = (f"[{cfg or 'default'}] {rows[i][0]}",) + rows[i][1:]
    finally:
        for key, val in old.items():
            real.CONFIG[key].clear()
            real.CONFIG[key].update(val)

    # CUDA-graph replay at small sizes
    cache = torch.zeros(nb, B * 528 + 512, dtype=torch.uint8, device=dev)
    for n in (1, 8, 64) if not configs else ():
        fns = {
            "quantize_insert_528": lambda n=n: real.quantize_and_insert_k_cache(
                k[:n], cache, slots[:n], B, False, 528),
            "rope_quant_insert_528": lambda n=n: real.rope_quant_insert(
                k, pos, cs, cache.as_strided((nb, B, 528), (cache.stride(0), 528, 1)),
                slots[:n], 1, None, False),
        }
        for name, fn in fns.items():
            fn()
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                for _ in range(20):
                    fn()
            t = do_bench(graph.replay) / 20
            rows.append((f"graph {name} x{n}", t * 1e3, 0.0, 0.0, ""))
    print()
    for name, us, gbs, frac, err in rows:
        print(f"{name:40s} {us:9.2f} us {gbs:9.1f} GB/s  {frac:5.2f} of copy {err}")
