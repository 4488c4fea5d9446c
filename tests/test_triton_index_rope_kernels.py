"""The shared Triton kernels of backends/triton/index_kernels.py and rope_kernels.py, byte for
byte against the reference (dsv41.reference) and vLLM's H200 golden vectors.

CPU: the kernels run in Triton's interpreter on CPU tensors.  The kernel modules are loaded
as private interpreted copies (``tests/triton_interp.load_interpreted``), so this file runs
with or without ``TRITON_INTERPRET=1``.  Float kernels are checked in both conversion modes:
``int`` (integer-arithmetic bf16 / e4m3 encoders, what ROCm and XPU run; exact in the plain
interpreter) and ``hw`` (Triton's float converts, what NVIDIA runs; needs the exact
interpreter of ``tests/triton_interp.enable_exact_interpreter``).  Interpreter runs are kept
to a few programs each.

GPU (``-m gpu``, needs CUDA): the compiled kernels against the reference on the device, and a
bandwidth / CUDA-graph report (printed, with ``-s``).
"""

from __future__ import annotations

import contextlib
import functools
import io
import os
import pathlib
import sys
import tarfile

import pytest
import torch

import golden  # noqa: E402  (tests/ is on sys.path)
from hostile import positions_past_the_table  # noqa: E402

triton = pytest.importorskip("triton")
import triton.language as tl  # noqa: E402
from triton_interp import interpreter_unsupported_reason  # noqa: E402

if not torch.cuda.is_available() and interpreter_unsupported_reason():
    pytest.skip(f"Triton interpreter not usable here: {interpreter_unsupported_reason()}",
                allow_module_level=True)

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))

from dsv41.backends.triton import conversions  # noqa: E402
from dsv41.core import codecs  # noqa: E402
from dsv41.reference import indexer as ref_indexer  # noqa: E402
from dsv41.reference import output_quant as ref_oq  # noqa: E402
from dsv41.reference import sparse_indices as ref_si  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")  # numpy in the interpreter

REPO = pathlib.Path(__file__).resolve().parents[1]
VECTORS = golden.ARCHIVE  # tests/vectors (DSV41_VECTORS overrides)
I32 = torch.int32
BF16 = torch.bfloat16
F32 = torch.float32

INDEX_OPS = (
    "compute_global_topk_indices_and_lens",
    "combine_topk_swa_indices",
    "build_flashinfer_mixed_sparse_indices",
)
ROPE_OPS = ("fused_indexer_q_rope_quant", "fused_inv_rope_fp8_quant")


# ------------------------------------------------------------------------ kernel modules


@functools.lru_cache(maxsize=None)
def _module(name: str):
    full = f"dsv41.backends.triton.{name}"
    if os.environ.get("TRITON_INTERPRET") == "1":
        import importlib

        return importlib.import_module(full)
    from triton_interp import load_interpreted

    return load_interpreted(full, also=("dsv41.backends.triton.reductions",))


def idx():
    return _module("index_kernels")


def rope():
    return _module("rope_kernels")


@pytest.fixture(params=["int", "hw"])
def cvt(request):
    """Conversion mode of the float kernels (see module docstring)."""
    rope()
    if request.param == "hw":
        try:
            from triton_interp import enable_exact_interpreter

            enable_exact_interpreter()
        except Exception as exc:  # pragma: no cover - depends on the Triton version
            pytest.skip(f"exact interpreter unavailable: {exc}")
    with conversions.forced("hardware" if request.param == "hw" else "integer"):
        yield request.param


# ------------------------------------------------------------------------ golden vectors


@functools.lru_cache(maxsize=1)
def _golden() -> dict:
    cases = {}
    if not VECTORS.is_file():
        return cases
    with tarfile.open(VECTORS, "r:xz") as tar:
        for m in tar.getmembers():
            if not m.isfile() or not m.name.endswith(".pt"):
                continue
            case = torch.load(io.BytesIO(tar.extractfile(m).read()), weights_only=True)
            if case["op"] in INDEX_OPS + ROPE_OPS:
                cases[pathlib.Path(m.name).name] = case
    return cases


def _golden_names(ops) -> list:
    names = sorted(n for n, c in _golden().items() if c["op"] in ops)
    return names or [pytest.param("none", marks=pytest.mark.skip(reason=f"no golden vectors at {VECTORS}"))]


def _roundup(x: int, m: int) -> int:
    return (x + m - 1) // m * m


def _storage(t: torch.Tensor) -> torch.Tensor:
    """Every byte of t's backing storage."""
    return torch.empty(0, dtype=torch.uint8, device=t.device).set_(t.untyped_storage())


def _fresh_like(t: torch.Tensor, fill_byte: int = 0xA5) -> torch.Tensor:
    """A tensor with t's view (size, stride, offset) over a new storage filled with a canary."""
    raw = torch.full((t.untyped_storage().nbytes(),), fill_byte, dtype=torch.uint8, device=t.device)
    return torch.empty(0, dtype=t.dtype, device=t.device).set_(
        raw.untyped_storage(), t.storage_offset(), t.shape, t.stride())


# ------------------------------------------------------------- public args -> kernel calls


def _call_global_topk(fn, a, out=None):
    N = a["topk_indices"].shape[0]
    if out is None:
        out = (_padded((N, a["topk_indices"].shape[1]), I32, -7), _padded((N,), I32, -7))
    fn(a["topk_indices"], a["token_to_req_indices"], a["block_table"], a["block_size"],
       a["is_valid_token"], *out)
    return out


def _call_combine(fn, a, out=None):
    T = a["topk_indices"].shape[0]
    if out is None:
        if a.get("out") is not None:
            out = tuple(_fresh_like(x, 0xF9) for x in a["out"])
            for x, y in zip(out, a["out"]):
                x.copy_(y)
        else:
            out = (_padded((T, _roundup(a["topk"] + a["window_size"], 128)), I32, -7),
                   _padded((T,), I32, -7))
    fn(a["topk_indices"], a["query_start_loc"], a["seq_lens"], a["gather_lens"],
       a["window_size"], a["compress_ratio"], a["topk"], a["M"], a["N"], *out)
    return out


def _call_flashinfer(fn, a, out=None):
    D, W = a["decode_swa_indices"].shape
    P = a["prefill_topk_indices"].shape[0]
    dci = a["decode_compressed_indices"]
    K_dec = 0 if dci is None else dci.shape[1]
    if out is None:
        PT = _roundup(max(a["topk"], K_dec), 4)
        out = (_padded((D + P, W + PT), I32, -7), _padded((D + P,), I32, -7))
    ctab = a["compressed_block_table"]
    ctab = a["swa_block_table"] if ctab is None else ctab
    sspan = a["swa_block_span"] if a["swa_block_span"] is not None else a["swa_block_size"]
    cspan = (a["compressed_block_span"] if a["compressed_block_span"] is not None
             else a["compressed_block_size"])
    fn(a["decode_swa_indices"], dci, a["decode_compressed_topk_lens"], a["prefill_topk_indices"],
       a["query_start_loc"], a["seq_lens"], a["token_to_req_indices"], a["swa_block_table"],
       a["swa_block_size"], ctab, a["compressed_block_size"], a["window_size"],
       a["compress_ratio"], a["topk"], bool(a["decode_compressed_indices_are_local"]),
       a["decode_is_valid_token"], sspan, cspan, a["replay_start"], *out)
    return out


def _padded(shape, dtype, fill, device="cpu"):
    """An output view inside a larger canary-filled buffer (extra row and columns), so that a
    write outside the view shows up in the storage comparison."""
    if len(shape) == 1:
        return torch.full((shape[0] + 5,), fill, dtype=dtype, device=device)[2: 2 + shape[0]]
    rows, cols = shape[0], shape[1]
    big = torch.full((rows + 1, cols + 3) + tuple(shape[2:]), fill, dtype=dtype, device=device)
    return big[:rows, 1: cols + 1]


CALL = {
    "compute_global_topk_indices_and_lens": _call_global_topk,
    "combine_topk_swa_indices": _call_combine,
    "build_flashinfer_mixed_sparse_indices": _call_flashinfer,
}


def _check_index_op(op, args, golden_out=None):
    """Run the Triton kernel and the reference on the same inputs and canary-filled outputs;
    compare every byte of the outputs' backing storages (nothing written outside, everything
    inside written the same), and the golden outputs when given."""
    got = CALL[op](getattr(idx(), op), args)
    want = CALL[op](getattr(ref_si, op), args)
    for g, w in zip(got, want):
        assert torch.equal(_storage(g), _storage(w)), f"{op}: bytes differ from the reference"
    if golden_out is not None:
        for g, w in zip(got, golden_out):
            assert torch.equal(g, w), f"{op}: bytes differ from the golden vector"
    return got


# ============================================================================ index ops


@pytest.mark.parametrize("name", _golden_names(INDEX_OPS))
def test_index_golden(name):
    case = _golden()[name]
    _check_index_op(case["op"], case["args"], list(case["out"].values()))


def _rand_table(R, nb, gen, transposed=False, extra=3):
    """A block table view: non-contiguous ([:, :nb] of a wider table, or a transpose)."""
    if transposed:
        base = torch.randperm(4 * R * nb, generator=gen)[: R * nb].to(I32).view(nb, R)
        return base.t()
    base = torch.randint(0, 1000, (R, nb + extra), generator=gen, dtype=I32)
    return base[:, :nb]


@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("K", [1, 37, 1030])
def test_global_topk_random(seed, K):
    gen = torch.Generator().manual_seed(seed)
    N, R, nb, B = 9, 3, 5, 16
    x = torch.randint(-3, nb * B, (N, K), generator=gen, dtype=I32)
    x[0] = -1  # an all-empty row
    x[1, ::2] = -1
    req = torch.randint(0, R, (N + 2,), generator=gen, dtype=I32)
    req[2] = R + 4  # out of range request -> −1 entries (reference rule)
    req[3] = -1
    x[4, 0] = nb * B + 7  # logical block past the table width -> −1
    args = dict(topk_indices=x, token_to_req_indices=req,
                block_table=_rand_table(R, nb, gen, transposed=seed == 1), block_size=B,
                is_valid_token=torch.rand(N + 1, generator=gen) > 0.3)
    _check_index_op("compute_global_topk_indices_and_lens", args)


def test_global_topk_empty():
    args = dict(topk_indices=torch.empty(0, 8, dtype=I32), token_to_req_indices=torch.empty(0, dtype=I32),
                block_table=torch.zeros(2, 3, dtype=I32), block_size=64,
                is_valid_token=torch.empty(0, dtype=torch.bool))
    _check_index_op("compute_global_topk_indices_and_lens", args)


def _combine_args(gen, qlens, T, topk, window, cr, base=5, M=300, N=200):
    R = len(qlens)
    qsl = torch.tensor([0] + torch.tensor(qlens, dtype=torch.long).cumsum(0).tolist(), dtype=I32) + base
    seq = torch.tensor([q + int(torch.randint(0, 150, (1,), generator=gen)) for q in qlens], dtype=I32)
    gl = torch.minimum(seq, torch.randint(1, 140, (R,), generator=gen, dtype=I32))
    K_in = max(topk + 3, 1)
    return dict(topk_indices=torch.randint(-3, N + 20, (T, K_in), generator=gen, dtype=I32),
                query_start_loc=qsl, seq_lens=seq, gather_lens=gl, window_size=window,
                compress_ratio=cr, topk=topk, M=M, N=N, out=None)


@pytest.mark.parametrize("cr,topk", [(4, 50), (0, 0), (1, 7)])
def test_combine_random(cr, topk):
    gen = torch.Generator().manual_seed(cr)
    args = _combine_args(gen, [3, 0, 9, 1, 0, 6], 22, topk, 16, cr)
    _check_index_op("combine_topk_swa_indices", args)


def test_combine_edge():
    gen = torch.Generator().manual_seed(7)
    # no requests at all: every row −1, length 0
    args = _combine_args(gen, [], 4, 8, 16, 4)
    _check_index_op("combine_topk_swa_indices", args)
    # a single request and T = 0
    args = _combine_args(gen, [5], 5, 8, 16, 4)
    _check_index_op("combine_topk_swa_indices", args)
    args = _combine_args(gen, [5], 0, 8, 16, 4)
    args["topk_indices"] = torch.empty(0, 11, dtype=I32)
    _check_index_op("combine_topk_swa_indices", args)


def _flashinfer_args(gen, D, qlens, K_dec, local, with_lens, with_valid, spans, topk=10,
                     window=8, W_swa=12, cr=4, sbs=16, cbs=8, none_ctab=False):
    R = len(qlens) + D
    P = sum(qlens)
    qsl = torch.tensor([0] + torch.tensor([1] * D + qlens, dtype=torch.long).cumsum(0).tolist(), dtype=I32)
    seq = torch.randint(1, 90, (R,), generator=gen, dtype=I32)
    for r in range(D, R):
        seq[r] = max(int(seq[r]), qlens[r - D])
    t2r = torch.cat([torch.arange(D, dtype=I32),
                     torch.repeat_interleave(torch.arange(D, R, dtype=I32), torch.tensor(qlens, dtype=torch.long))])
    t2r = torch.cat([t2r, torch.tensor([0], dtype=I32)])
    dswa = torch.randint(-2, 400, (D, W_swa), generator=gen, dtype=I32)
    if K_dec is None:
        dci = None
    elif local:
        dci = torch.randint(-2, 60, (D, K_dec), generator=gen, dtype=I32)
    else:
        dci = torch.randint(-2, 600, (D, K_dec), generator=gen, dtype=I32)
    swa_tab = _rand_table(R, 8, gen)
    ctab = None if none_ctab else _rand_table(R, 9, gen, transposed=True)
    return dict(
        decode_swa_indices=dswa, decode_compressed_indices=dci,
        decode_compressed_topk_lens=(torch.randint(0, 9, (D + 1,), generator=gen, dtype=I32)
                                     if with_lens else None),
        prefill_topk_indices=torch.randint(-2, 70, (P, topk + 2), generator=gen, dtype=I32),
        query_start_loc=qsl, seq_lens=seq, token_to_req_indices=t2r,
        swa_block_table=swa_tab, swa_block_size=sbs, compressed_block_table=ctab,
        compressed_block_size=cbs, window_size=window, compress_ratio=cr, topk=topk,
        decode_compressed_indices_are_local=local,
        decode_is_valid_token=(torch.rand(D + 2, generator=gen) > 0.3) if with_valid else None,
        swa_block_span=spans[0], compressed_block_span=spans[1],
        replay_start=torch.randint(0, 40, (R,), generator=gen, dtype=I32),
    )


@pytest.mark.parametrize(
    "D,qlens,K_dec,local,lens,valid,spans,cr",
    [
        (3, [4, 5], 13, False, True, False, (None, None), 4),
        (2, [3], 9, False, False, False, (20, None), 4),
        (4, [6, 0, 2], 11, True, False, True, (24, 11), 2),
        (3, [2, 3], None, False, False, False, (None, None), 0),
        (0, [5, 4], None, False, False, False, (None, None), 4),
        (5, [], 6, True, False, False, (None, 9), 4),
        (2, [3], 0, True, False, False, (None, None), 4),
        # the compress ratio is a build constant: other powers of two, a divisor that is not
        # one, and a negative ratio (no top-k columns)
        (1, [5, 3], 7, False, True, False, (None, None), 1),
        (1, [4, 6], 7, False, True, False, (None, None), 3),
        (1, [6], 7, False, False, False, (None, None), 128),
        (1, [3, 2], 7, False, False, False, (None, None), -4),
    ],
)
def test_flashinfer_random(D, qlens, K_dec, local, lens, valid, spans, cr):
    gen = torch.Generator().manual_seed(D * 7 + len(qlens))
    args = _flashinfer_args(gen, D, qlens, K_dec, local, lens, valid, spans, cr=cr,
                            none_ctab=K_dec is None)
    _check_index_op("build_flashinfer_mixed_sparse_indices", args)


@pytest.mark.parametrize("sbs,cbs", [(16, 8), (12, 6), (64, 48)])
@pytest.mark.parametrize("local", [False, True])
def test_flashinfer_table_entries_near_int32(sbs, cbs, local):
    """Every block-table entry through the lookup and the span remap, the page sizes powers of
    two (one step: the slot's page is the entry, its sign the entry's bit 31 - k) or not (two
    steps): entries whose ``entry * block_size`` is just inside, at and past int32, negative,
    and INT32_MAX, against the reference's int32 arithmetic."""
    gen = torch.Generator().manual_seed(sbs * 3 + cbs + local)
    args = _flashinfer_args(gen, 3, [5, 4], 11, local, False, False, (20, 7), sbs=sbs, cbs=cbs)
    edges = []
    for b in (sbs, cbs):
        lim = (2**31 - 1) // b
        edges += [lim - 1, lim, lim + 1, 2 * lim + 1, -1, -lim - 1]
    edges = torch.tensor(edges + [2**31 - 1, -(2**31)], dtype=I32)
    for key in ("swa_block_table", "compressed_block_table"):
        t = args[key]
        flat = torch.randint(0, len(edges), (t.numel(),), generator=gen)
        pick = torch.rand(t.numel(), generator=gen) < 0.5
        vals = torch.where(pick, edges[flat], t.reshape(-1))
        t.copy_(vals.view(t.shape))
    _check_index_op("build_flashinfer_mixed_sparse_indices", args)


def test_flashinfer_worked_example_and_empty():
    # cache_ops.md §7 worked example: D = 0, one prefill token, seq 4, window 4, W_swa 8.
    args = dict(
        decode_swa_indices=torch.empty(0, 8, dtype=I32), decode_compressed_indices=None,
        decode_compressed_topk_lens=None, prefill_topk_indices=torch.empty(1, 0, dtype=I32),
        query_start_loc=torch.tensor([0, 1], dtype=I32), seq_lens=torch.tensor([4], dtype=I32),
        token_to_req_indices=torch.tensor([0], dtype=I32),
        swa_block_table=torch.tensor([[0]], dtype=I32), swa_block_size=64,
        compressed_block_table=None, compressed_block_size=64, window_size=4,
        compress_ratio=4, topk=0, decode_compressed_indices_are_local=False,
        decode_is_valid_token=None, swa_block_span=None, compressed_block_span=None,
        replay_start=torch.tensor([0], dtype=I32),
    )
    idx_out, lens = _check_index_op("build_flashinfer_mixed_sparse_indices", args)
    assert idx_out.tolist() == [[0, 1, 2, 3, -1, -1, -1, -1]] and lens.tolist() == [8]
    args["prefill_topk_indices"] = torch.empty(0, 0, dtype=I32)
    _check_index_op("build_flashinfer_mixed_sparse_indices", args)  # D + P = 0: nothing


# ===================================================================== codec helpers


def _probe(x_ptr, out_ptr, n, HELPER: tl.constexpr, A: tl.constexpr, B: tl.constexpr,
           C: tl.constexpr, BLOCK: tl.constexpr):
    """One program applying a number helper (backends/triton/numerics.py) elementwise."""
    i = tl.arange(0, BLOCK)
    m = i < n
    x = tl.load(x_ptr + i, mask=m, other=1.0)
    if A is None:
        y = HELPER(x)
    elif B is None:
        y = HELPER(x, A)
    elif C is None:
        y = HELPER(x, A, B)
    else:
        y = HELPER(x, A, B, C)
    tl.store(out_ptr + i, y, mask=m)


def _run_probe(helper_name, x, out_dtype, A=None, B=None, C=None):
    from triton.runtime.interpreter import InterpretedFunction

    out = torch.empty(x.shape, dtype=out_dtype)
    InterpretedFunction(_probe)[(1,)](x, out, x.numel(), HELPER=getattr(_module("numerics"), helper_name),
                                      A=A, B=B, C=C, BLOCK=triton.next_power_of_2(x.numel()))
    return out


def _fp32_edge_values(max_val: float) -> torch.Tensor:
    """fp32 values around every e4m3 code / tie of both flavours and a random spread."""
    grid = torch.cat([codecs.e4m3_decode(torch.arange(256, dtype=torch.uint8), fnuz=f) for f in (False, True)])
    grid = grid[torch.isfinite(grid)].unique()
    mids = (grid[:-1] + grid[1:]) / 2
    pts = torch.cat([grid, mids, grid * 2.0**-12, torch.tensor([max_val, 464.0, 480.0, 240.0, 248.0, 1e30])])
    bits = pts.to(F32).view(I32)
    near = torch.stack([bits - 1, bits, bits + 1]).flatten().view(F32)
    gen = torch.Generator().manual_seed(3)
    rnd = torch.randn(20000, generator=gen) * torch.exp2(torch.randint(-24, 10, (20000,), generator=gen).float())
    sp = torch.tensor([0.0, -0.0, float("inf"), float("-inf"), float("nan"), -float("nan"),
                       2.0**-149, -(2.0**-149), 2.0**-126, 3.4e38])
    x = torch.cat([near, -near, rnd, sp])
    return x


@pytest.mark.parametrize("fnuz", [False, True])
def test_e4m3_integer_encoder(fnuz):
    x = _fp32_edge_values(448.0)
    got = _run_probe("_e4m3_code", x, I32, A=fnuz, B=False, C=0x7F)
    want = codecs.e4m3_encode(x, fnuz=fnuz).to(I32)
    assert torch.equal(got, want), x[got != want][:8]
    if not fnuz:  # NaN code 0x7E = the clamp of R §4.3 (NaN -> +448) before the encoder
        got = _run_probe("_e4m3_code", x, I32, A=False, B=False, C=0x7E)
        want = codecs.e4m3_encode(codecs.clamp_sym(x.abs().where(torch.isnan(x), x), 448.0)).to(I32)
        assert torch.equal(got, want)


def test_bit_ceil_equals_log2_ceil_for_bf16_amax():
    """The indexer Q computes scale exponents with the exact (bit) ceiling; for every
    bf16-valued amax (and the floors) it equals the reference's fp32-log2 ceiling."""
    a = (torch.arange(1, 0x7F80, dtype=I32) << 16).view(F32)  # every positive finite bf16
    for m, floor in ((448.0, codecs.F32_1E_4), (224.0, codecs.F32_1E_4), (6.0, 6.0 * 2.0**-126)):
        amax = torch.cat([a, torch.tensor([floor])]).clamp_min(floor)
        s = amax * codecs.inv_const(m)
        want = codecs.ceil_log2(amax / torch.full_like(amax, m) if m != 6.0 else s)
        assert torch.equal(codecs.bit_ceil_log2(s), want)
    s = torch.cat([a * codecs.inv_const(448.0), torch.tensor([float("inf")])])
    got = _run_probe("_ceil_exp_bits", s, I32)
    assert torch.equal(got, torch.where(torch.isinf(s), 128, codecs.bit_ceil_log2(s).nan_to_num(0).to(I32)))


def test_e2m1_and_bf16_integer_encoders():
    ties = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0, 7.0, 0.0, 1e-30])
    bits = ties.view(I32)
    x = torch.cat([torch.stack([bits - 1, bits, bits + 1]).flatten().view(F32), torch.randn(5000) * 3])
    x = torch.cat([x, -x, torch.tensor([float("inf"), -float("inf"), float("nan"), -float("nan")])])
    for helper in ("_e2m1_code_search", "_e2m1_code"):  # the two forms: same codes, NaN included
        got = _run_probe(helper, x, I32)
        assert torch.equal(got, codecs.e2m1_encode(x).to(I32)), helper

    gen = torch.Generator().manual_seed(5)
    r = torch.randint(-(2**31), 2**31 - 1, (50000,), generator=gen, dtype=I32).view(F32)
    tie = (torch.randint(0, 2**16, (5000,), generator=gen, dtype=I32) << 16 | 0x8000).view(F32)
    x = torch.cat([r, tie, torch.tensor([3.4e38, 3.3961e38, -3.39e38, float("inf"), float("nan")])])
    want = x.to(BF16).view(torch.int16).to(I32) & 0xFFFF
    want = torch.where(torch.isnan(x), 0x7FFF, want)
    got = _run_probe("_bf16_bits_i32", x, I32, A=False)
    assert torch.equal(got & 0xFFFF, want)
    got = _run_probe("_bf16_bits", x, torch.int16, A=True)  # the cache kernels' int16 form
    assert torch.equal(got.to(I32) & 0xFFFF, want)


def test_both_sign_flips_agree_off_nan():
    x = torch.cat([torch.tensor([0.0, -0.0, 1.5, -2.0**-149, float("inf"), -float("inf"), 3.4e38]),
                   torch.randn(1000)])
    for helper in ("_neg", "_neg_sign_bit"):
        got = _run_probe(helper, x, F32)
        assert torch.equal(got.view(I32), (-x).view(I32)), helper


def test_ceil_exp_log_matches_fp32_log2_ceiling():
    # s = 2^k (1 + m 2^-23) with m near 0 and near 2^23, for every exponent; plus random.
    k = torch.arange(-126, 128, dtype=I32)
    m = torch.cat([torch.arange(0, 80), torch.arange(2**23 - 20, 2**23)]).to(I32)
    s = (((k[:, None] + 127) << 23) | m[None, :]).reshape(-1).view(F32)
    gen = torch.Generator().manual_seed(11)
    rnd = torch.rand(30000, generator=gen) * torch.exp2(torch.randint(-60, 60, (30000,), generator=gen).float())
    s = torch.cat([s, rnd[rnd > 0], torch.tensor([float("inf")])])
    got = _run_probe("_ceil_exp_log", s, I32)
    want = codecs.ceil_log2(s)
    want = torch.where(torch.isinf(want), 128.0, want).to(I32)
    assert torch.equal(got, want)


# =========================================================== fused_indexer_q_rope_quant


def _cos_sin_cache(max_pos=64, R=64, dtype=F32, theta=10000.0):
    inv = 1.0 / theta ** (torch.arange(0, R, 2, dtype=torch.float64) / R)
    ang = torch.arange(max_pos, dtype=torch.float64)[:, None] * inv[None, :]
    return torch.cat([ang.cos(), ang.sin()], dim=-1).to(dtype)


def _indexer_q_inputs(T, H, D=128, R=64, seed=0, nonfinite=False, mxfp4=False, finite_rope=False):
    """Rows of every kind; ``finite_rope`` replaces the rows whose RoPE overflows (±3.39e38,
    whose NaNs carry a platform-dependent sign into e2m1 codes) for device comparisons."""
    gen = torch.Generator().manual_seed(seed)
    scale = torch.exp2(torch.randint(-6, 7, (T, H, D // 32), generator=gen).float()).repeat_interleave(32, -1)
    q = torch.randn(T, H, D, generator=gen) * scale
    kinds = ["normal", "zero", "negzero", "exact", "ties", "huge", "maxbf16", "tiny", "mixed"]
    if finite_rope:
        kinds[6] = "huge"
    nope = D - R
    for n in range(T * H):
        t, h = divmod(n, H)
        kind = kinds[n % len(kinds)]
        row = q[t, h]
        if kind == "zero":
            row.zero_()
        elif kind == "negzero":
            row.fill_(-0.0)
        elif kind == "exact":  # amax exactly FP8_MAX * 2^k in the NoPE dims
            row[:nope] = torch.randn(nope, generator=gen).clamp(-3, 3)
            row[3] = 448.0 * 2.0 ** (n % 5 - 2)
        elif kind == "ties":
            if mxfp4:  # block amax 6 (scale 2^0), every e2m1 tie point and its negation
                v = torch.tensor([6.0, 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, -0.25, -0.75,
                                  -1.25, -1.75, -2.5, -3.5, -5.0, 0.1, -0.1, 5.5, -6.0, 0.5])
                row[: v.numel()] = v
                row[32: 32 + v.numel()] = v * 4
            else:  # amax 448 (scale 2^0), e4m3 ties incl. subnormal ones
                v = torch.tensor([448.0, 1.0625, 1.1875, 17.0, -17.0, 2.0**-10, 3 * 2.0**-10,
                                  -(5 * 2.0**-10), 240.0, 232.0, 0.001])
                row[: v.numel()] = v
        elif kind == "huge":
            row.mul_(3e30)
        elif kind == "maxbf16":
            row.copy_(torch.where(torch.arange(D) % 3 == 0, 3.3895e38, -3.3895e38))
        elif kind == "tiny":
            row.mul_(1e-30)
        elif kind == "mixed":
            row[: D // 2] *= 1e4
    if nonfinite:
        q[0, 1, 5] = float("nan")
        q[0, 2, 7] = float("inf")
        q[-1, 0, 0] = -float("inf")
        if not mxfp4:
            q[-1, 1, nope + 4] = float("nan")  # NaN into the RoPE arithmetic
            q[-1, 2, nope + 9] = float("inf")
    index_q = q.to(BF16)
    w = (torch.randn(T, H, generator=gen) * 2).to(BF16)
    pos = torch.randint(0, 64, (T,), generator=gen)
    return pos, index_q, w


def _run_indexer_q(fn, pos, index_q, cache, w, use_fp4, use_fnuz, wo_dtype, softmax_scale=128**-0.5,
                   head_scale=0.125):
    T, H, D = index_q.shape
    if use_fp4:
        q_out = _padded((T, H, D // 2), torch.uint8, 0xA5)
        q_scale = _padded((T, H, D // 32), torch.uint8, 0xA5)
    else:
        fdt = torch.float8_e4m3fnuz if use_fnuz else torch.float8_e4m3fn
        q_out = _padded((T, H, D), torch.uint8, 0xA5).view(fdt)
        q_scale = torch.empty(0, dtype=torch.uint8)
    wo = _padded((T, H), wo_dtype, -3.0)
    fn(pos, index_q, cache, w, softmax_scale, head_scale, use_fp4, use_fnuz, q_out, q_scale, wo)
    return q_out, q_scale, wo


def _check_indexer_q(pos, index_q, cache, w, use_fp4, use_fnuz, wo_dtype, **kw):
    got = _run_indexer_q(rope().fused_indexer_q_rope_quant, pos, index_q, cache, w, use_fp4,
                         use_fnuz, wo_dtype, **kw)
    want = _run_indexer_q(ref_indexer.fused_indexer_q_rope_quant, pos, index_q, cache, w,
                          use_fp4, use_fnuz, wo_dtype, **kw)
    for name, g, r in zip(("q", "q_scale", "weights"), got, want):
        assert torch.equal(_storage(g), _storage(r)), f"{name} bytes differ from the reference"
    return got


@pytest.mark.parametrize("name", _golden_names(("fused_indexer_q_rope_quant",)))
def test_indexer_q_golden(name, cvt):
    a = _golden()[name]["args"]
    out = _golden()[name]["out"]
    q, _, wo = _check_indexer_q(a["positions"], a["index_q"], a["index_q_cos_sin_cache"],
                                a["index_weights"], a["use_fp4"], False, F32,
                                softmax_scale=a["index_weights_softmax_scale"],
                                head_scale=a["index_weights_head_scale"])
    assert torch.equal(q.view(torch.uint8), out["q_fp8"].view(torch.uint8))
    assert torch.equal(wo.view(I32), out["weights_out"].view(I32))


@pytest.mark.parametrize("mode", ["fp8", "fnuz", "mxfp4"])
def test_indexer_q_edge_cases(mode, cvt):
    fp4, fnuz = mode == "mxfp4", mode == "fnuz"
    pos, index_q, w = _indexer_q_inputs(3, 6, seed=1, nonfinite=True, mxfp4=fp4)
    _check_indexer_q(pos, index_q, _cos_sin_cache(), w, fp4, fnuz, BF16 if fp4 else F32)


@pytest.mark.parametrize("mode", ["fp8", "fnuz", "mxfp4"])
def test_indexer_q_layouts(mode):
    """bf16 cos/sin cache, fp32 weights, non-contiguous q (token stride > H·D), odd head count,
    D 64 with R 32, fp32 weights_out for MXFP4, non-power-of-two scales."""
    fp4, fnuz = mode == "mxfp4", mode == "fnuz"
    pos, q, w = _indexer_q_inputs(4, 5, D=64, R=32, seed=2, mxfp4=fp4)
    big = torch.zeros(4, 7, 64, dtype=BF16)
    big[:, 1:6] = q
    _check_indexer_q(pos, big[:, 1:6], _cos_sin_cache(R=32, dtype=BF16), w.float(), fp4, fnuz,
                     F32, softmax_scale=0.3, head_scale=0.7)


def test_indexer_q_mxfp4_widths_not_powers_of_two(cvt):
    """MXFP4 with NoPE 96 + RoPE 32 (D 128): the general path (every pair of the head in one
    tile, RoPE pairs selected), not the split path the production 64 + 64 takes."""
    pos, q, w = _indexer_q_inputs(3, 5, D=128, R=32, seed=6, nonfinite=True, mxfp4=True)
    _check_indexer_q(pos, q, _cos_sin_cache(R=32), w, True, False, BF16)


@pytest.mark.parametrize("mode", ["fp8", "mxfp4", "fp8-words"])
def test_indexer_q_odd_offset(mode, monkeypatch):
    """q at an odd bf16 offset (not 4-byte aligned): the MXFP4 pair loads go element-wise, and
    the FP8 path asked to hold NoPE words (``INDEXER_Q_FP8_NOPE = "words"``) holds fp32."""
    from dsv41.backends.triton import tuning

    fp4 = mode == "mxfp4"
    if mode == "fp8-words":
        monkeypatch.setitem(tuning.OVERRIDES, "fused_indexer_q_rope_quant",
                            dict(BLOCK_T=1, BLOCK_H=4, num_warps=4, nope="words"))
    pos, q, w = _indexer_q_inputs(3, 4, seed=5, nonfinite=True, mxfp4=fp4)
    buf = torch.zeros(q.numel() + 1, dtype=BF16)
    buf[1:] = q.flatten()
    qo = buf[1:].view(q.shape)
    assert qo.data_ptr() % 4 != 0
    _check_indexer_q(pos, qo, _cos_sin_cache(), w, fp4, False, BF16 if fp4 else F32)


def test_indexer_q_words_with_an_odd_output_offset(monkeypatch):
    """FP8 with ``INDEXER_Q_FP8_NOPE = "words"`` writes each pair's two codes as one int16:
    an output at an odd byte offset (rows not 2-byte aligned) is written byte-wise instead."""
    from dsv41.backends.triton import tuning

    monkeypatch.setitem(tuning.OVERRIDES, "fused_indexer_q_rope_quant",
                        dict(BLOCK_T=1, BLOCK_H=4, num_warps=4, nope="words"))
    pos, q, w = _indexer_q_inputs(3, 4, seed=7, nonfinite=True)
    cache = _cos_sin_cache()
    outs = []
    for fn in (rope().fused_indexer_q_rope_quant, ref_indexer.fused_indexer_q_rope_quant):
        buf = torch.full((q.numel() + 3,), 0xA5, dtype=torch.uint8)
        q_out = buf[1: 1 + q.numel()].view(q.shape).view(torch.float8_e4m3fn)
        wo = _padded((3, 4), F32, -3.0)
        fn(pos, q, cache, w, 128**-0.5, 0.125, False, False, q_out, torch.empty(0, dtype=torch.uint8), wo)
        outs.append((buf, wo))
    assert torch.equal(outs[0][0], outs[1][0]), "q bytes (and the canaries around them) differ"
    assert torch.equal(_storage(outs[0][1]), _storage(outs[1][1])), "weights differ"


def test_indexer_q_empty():
    pos, q, w = _indexer_q_inputs(1, 4)
    _check_indexer_q(pos[:0], q[:0], _cos_sin_cache(), w[:0], False, False, F32)


@pytest.mark.parametrize("rows", [64, 1])  # 1: every position reads row 0
@pytest.mark.parametrize("op", ["indexer_q_fp8", "indexer_q_mxfp4", "inv_rope"])
def test_rope_positions_outside_the_table_read_the_nearest_row(op, rows):
    """docs/bad_input.md: a position outside the cos/sin table reads the table's nearest row
    (the bytes of the same call with the positions clamped into it, which the reference
    checks); nothing outside the outputs is written (canary-padded outputs)."""
    cache = _cos_sin_cache(max_pos=rows)
    bad = positions_past_the_table(cache.shape[0])
    clamped = bad.clamp(0, cache.shape[0] - 1)
    T = bad.numel()
    if op == "inv_rope":
        o, _ = _inv_rope_input(T, 8, 128, 64, seed=11, nonfinite=False)
        args = (cache, 2, 4, 64, 64, 32, True, True, False)
        want = _check_inv_rope(o, clamped, *args)
        got = _run_inv_rope(rope().fused_inv_rope_fp8_quant, o, bad, *args)
    else:
        fp4 = op == "indexer_q_mxfp4"
        _, q, w = _indexer_q_inputs(T, 2, seed=12, mxfp4=fp4)
        want = _check_indexer_q(clamped, q, cache, w, fp4, False, F32)
        got = _run_indexer_q(rope().fused_indexer_q_rope_quant, bad, q, cache, w, fp4, False, F32)
    for g, r in zip(got, want):
        assert torch.equal(_storage(g), _storage(r))


# ============================================================= fused_inv_rope_fp8_quant


def _inv_rope_outputs(T, G, HG, Dh, qgs, tma, quantize, dtype_noquant=BF16):
    Dg = HG * Dh
    if quantize:
        out = _padded((G, T, Dg), torch.uint8, 0xA5).view(torch.float8_e4m3fn)
        S = HG * (Dh // qgs)
        K = (S + 3) // 4 if tma else S
        Ta = _roundup(T, 4)
        sdt = I32 if tma else F32
        scale = torch.full((G * K * Ta + 8,), 77, dtype=I32).view(sdt)[4: 4 + G * K * Ta].view(G, K * Ta)
    else:
        out = _padded((G, T, Dg), dtype_noquant, -5.0)
        scale = torch.empty(G, 0)
    # out_buf must have stride(2) == 1: the padded view keeps the last dim contiguous
    out = out.contiguous() if out.stride(-1) != 1 else out
    return out, scale


def _run_inv_rope(fn, o, pos, cache, G, HG, nope, rope_dim, qgs, tma, quantize, perm):
    T, NH, Dh = o.shape
    out, scale = _inv_rope_outputs(T, G, HG, Dh, qgs, tma, quantize)
    fn(o, pos, cache, G, HG, nope, rope_dim, qgs, tma, quantize, perm, out, scale)
    return out, scale


def _check_inv_rope(o, pos, cache, G, HG, nope, rope_dim, qgs, tma, quantize, perm):
    got = _run_inv_rope(rope().fused_inv_rope_fp8_quant, o, pos, cache, G, HG, nope, rope_dim,
                        qgs, tma, quantize, perm)
    want = _run_inv_rope(ref_oq.fused_inv_rope_fp8_quant, o, pos, cache, G, HG, nope, rope_dim,
                         qgs, tma, quantize, perm)
    for name, g, r in zip(("out", "scales"), got, want):
        assert torch.equal(_storage(g), _storage(r)), f"{name} bytes differ from the reference"
    return got


@pytest.mark.parametrize("name", _golden_names(("fused_inv_rope_fp8_quant",)))
def test_inv_rope_golden(name, cvt):
    a = _golden()[name]["args"]
    out = _golden()[name]["out"]
    ob, sb = out["output"], out["scales"]
    G, HG = a["n_groups"], a["heads_per_group"]
    T, _, Dh = a["o"].shape
    buf = torch.empty(G, T, HG * Dh, dtype=ob.dtype)
    scale = (torch.empty(G, sb.untyped_storage().nbytes() // (4 * G), dtype=sb.dtype)
             if a["quantize"] else torch.empty(G, 0))
    args = (a["o"], a["positions"], a["cos_sin_cache"], G, HG, a["nope_dim"], a["rope_dim"],
            a["quant_group_size"], a["tma_aligned_scales"], a["quantize"], a["permuted_output"])
    rope().fused_inv_rope_fp8_quant(*args, buf, scale)
    assert torch.equal(_storage(buf), _storage(ob))
    assert torch.equal(_storage(scale), _storage(sb))
    _check_inv_rope(*args)


def _inv_rope_input(T, NH, Dh, nope, seed, nonfinite=True):
    gen = torch.Generator().manual_seed(seed)
    sc = torch.exp2(torch.randint(-8, 8, (T, NH, Dh // 32), generator=gen).float()).repeat_interleave(32, -1)
    o = torch.randn(T, NH, Dh, generator=gen) * sc
    o[0, 0].zero_()
    if NH > 1:
        o[0, 1].fill_(-0.0)
    o[-1, -1, :32] = 448.0 * 2.0 ** -5  # chunk amax exactly 448·2^k
    o[-1, 0, 5] = 448.0 * 2.0**3
    if T > 1:
        o[1, 0] *= 1e30
    if nonfinite:
        o[0, -1, 3] = float("nan")
        o[0, -1, nope + 2] = float("inf")
        o[-1, -1, 40] = -float("inf")
        o[-1, 0, nope + 5] = float("nan")
    return o.to(BF16), torch.randint(0, 64, (T,), generator=gen)


@pytest.mark.parametrize(
    "qgs,tma,quantize,perm",
    [(128, False, True, False), (128, True, True, False), (32, False, True, False),
     (32, True, True, True), (128, False, False, False)],
)
def test_inv_rope_modes(qgs, tma, quantize, perm, cvt):
    # T 5 -> scale rows padded to 8; 2 groups x 3 heads (not a power of two).
    o, pos = _inv_rope_input(5, 6, 512, 448, seed=qgs + tma)
    _check_inv_rope(o, pos, _cos_sin_cache(), 2, 3, 448, 64, qgs, tma, quantize, perm)


def test_inv_rope_small_head_dim():
    # Dh 128 = 64 NoPE + 64 RoPE, qgs 32 (RoPE spans two scale blocks), 4 heads per group.
    o, pos = _inv_rope_input(3, 8, 128, 64, seed=9)
    for tma, perm in ((False, False), (True, False), (True, True)):
        _check_inv_rope(o, pos, _cos_sin_cache(), 2, 4, 64, 64, 32, tma, True, perm)


def test_inv_rope_empty():
    o, pos = _inv_rope_input(1, 4, 512, 448, seed=1, nonfinite=False)
    _check_inv_rope(o[:0], pos[:0], _cos_sin_cache(), 1, 4, 448, 64, 128, False, True, False)


# ============================================================ fused_q_kv_rmsnorm_quant


def _qkv_inputs(T, Qs, Ks, seed, nonfinite=True):
    gen = torch.Generator().manual_seed(seed)
    qr = torch.randn(T, Qs, generator=gen) * torch.exp2(torch.randint(-4, 5, (T, 1), generator=gen).float())
    kv = torch.randn(T, Ks, generator=gen) * 3
    qr[0].zero_()
    if T > 2:
        qr[1, : Qs // 2] = 0.0  # zero groups: scale byte 0
        qr[2] *= 1e30
        kv[2].zero_()
    if nonfinite and T > 4:
        qr[3, 7] = float("nan")
        kv[3, 1] = float("nan")
        qr[4, 9] = float("inf")
        kv[4, 0] = -float("inf")
    qw = (torch.rand(Qs, generator=gen) + 0.5).to(BF16)
    kw = (torch.rand(Ks, generator=gen) + 0.5).to(BF16)
    return qr.to(BF16), kv.to(BF16), qw, kw


def _run_qkv(fn, qr, kv, qw, kw, eps):
    T, Qs = qr.shape
    Tp, Gp = _roundup(T, 128), _roundup(Qs // 32, 4)
    q_out = _padded((T, Qs), torch.uint8, 0xA5).view(torch.float8_e4m3fn)
    q_scale = torch.full((Tp * Gp + 6,), 0xA5, dtype=torch.uint8)[3: 3 + Tp * Gp]
    kv_out = _padded((T, kv.shape[1]), BF16, -9.0)
    fn(qr, kv, qw, kw, eps, q_out, q_scale, kv_out)
    return q_out, q_scale, kv_out


@pytest.mark.parametrize("T,Qs,Ks", [(6, 96, 64), (130, 256, 32)])
def test_q_kv_rmsnorm_quant(T, Qs, Ks, cvt):
    qr, kv, qw, kw = _qkv_inputs(T, Qs, Ks, seed=T)
    got = _run_qkv(rope().fused_q_kv_rmsnorm_quant, qr, kv, qw, kw, 1e-6)
    want = _run_qkv(ref_oq.fused_q_kv_rmsnorm_quant, qr, kv, qw, kw, 1e-6)
    for name, g, r in zip(("q", "q_scale", "kv"), got, want):
        assert torch.equal(_storage(g), _storage(r)), f"{name} bytes differ from the reference"


# ==================================================================== pad_fused_q_heads


@pytest.mark.parametrize("H,Hp", [(3, 16), (16, 16), (20, 32)])
def test_pad_fused_q_heads(H, Hp):
    gen = torch.Generator().manual_seed(H)
    T = 3
    bits = torch.randint(-(2**15), 2**15, (T, H + 1, 512), generator=gen, dtype=torch.int16)
    bits[0, 0, :4] = torch.tensor([0x7FC1, -1, 0x7F80, -32768], dtype=torch.int16)  # NaN payloads, -0
    q = bits.view(BF16)[:, :H]  # token stride (H+1)·512
    outs = []
    for fn in (rope().pad_fused_q_heads, ref_oq.pad_fused_q_heads):
        big = torch.full((T + 1, Hp, 512), -7.0, dtype=BF16)
        fn(q, big[:T])
        outs.append(big)
    assert torch.equal(outs[0].view(torch.int16), outs[1].view(torch.int16))


# ====================================================================== GPU (-m gpu)

gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def _to(x, dev):
    return x.to(dev) if isinstance(x, torch.Tensor) else x


@pytest.mark.gpu
@gpu
def test_gpu_against_reference():
    """The compiled kernels on the GPU against the reference on the GPU (finite inputs)."""
    import importlib

    _device_checks("cuda", importlib.import_module("dsv41.backends.triton.index_kernels"),
                   importlib.import_module("dsv41.backends.triton.rope_kernels"))


def _diff(label, got, want, fails):
    """Record a byte difference between a device result and the CPU reference."""
    g = _storage(got).cpu()
    w = _storage(want).cpu()
    if g.shape != w.shape:
        fails.append(f"{label}: storage sizes differ {g.shape} vs {w.shape}")
    elif not torch.equal(g, w):
        bad = (g != w).nonzero().flatten()
        fails.append(f"{label}: {bad.numel()} bytes differ, first at {bad[:6].tolist()}: "
                     f"got {g[bad[:6]].tolist()} want {w[bad[:6]].tolist()}")


def _device_checks(dev, ik, rk):
    """Device kernels against the CPU reference (the reference is byte-exact with the golden
    vectors on the CPU); every difference is collected and reported."""
    fails = []
    for name, case in _golden().items():
        op = case["op"]
        if op not in CALL:
            continue
        a = {k: (_to(v, dev) if not isinstance(v, (tuple, list)) else type(v)(_to(x, dev) for x in v))
             for k, v in case["args"].items()}
        got = CALL[op](getattr(ik, op), a, out=_gpu_out(op, a, dev))
        for g, o in zip(got, case["out"].values()):
            _diff(f"{name}", g, o.contiguous(), fails)
    for T, H, mode in ((1, 64, "fp8"), (37, 64, "fp8"), (300, 64, "fp8"), (37, 32, "fnuz"),
                       (300, 64, "mxfp4")):
        fp4, fnuz = mode == "mxfp4", mode == "fnuz"
        pos, q, w = _indexer_q_inputs(T, H, seed=T, mxfp4=fp4, finite_rope=fp4)
        cache = _cos_sin_cache(max_pos=64)
        args = (pos, q, cache, w, fp4, fnuz, BF16 if fp4 else F32)
        want = _run_indexer_q_dev(ref_indexer.fused_indexer_q_rope_quant, *args)
        for hw in (None, False):  # the device's own conversion path, then the integer one
            with contextlib.nullcontext() if hw is None else conversions.forced("integer"):
                got = _run_indexer_q_dev(rk.fused_indexer_q_rope_quant, *(_to(x, dev) for x in args))
            for lab, g, r in zip(("q", "q_scale", "weights"), got, want):
                _diff(f"indexer_q T{T} H{H} {mode} cvt={hw} {lab}", g, r, fails)
    for T, qgs, tma, quant, perm in ((1, 128, False, True, False), (77, 128, True, True, False),
                                     (300, 32, True, True, True), (77, 32, False, True, False),
                                     (33, 128, False, False, False)):
        o, pos = _inv_rope_input(T, 16, 512, 448, seed=T, nonfinite=False)
        cache = _cos_sin_cache()
        outs = []
        for fn, d in ((rk.fused_inv_rope_fp8_quant, dev), (ref_oq.fused_inv_rope_fp8_quant, "cpu")):
            out, scale = _inv_rope_outputs(T, 2, 8, 512, qgs, tma, quant)
            out, scale = out.contiguous().clone().to(d), scale.clone().to(d)
            fn(o.to(d), pos.to(d), cache.to(d), 2, 8, 448, 64, qgs, tma, quant, perm, out, scale)
            outs.append((out, scale))
        for lab, g, r in zip(("out", "scale"), *outs):
            _diff(f"inv_rope T{T} qgs{qgs} tma{tma} q{quant} perm{perm} {lab}", g, r, fails)
    for T in (1, 5, 130, 1000):
        qr, kv, qw, kw = _qkv_inputs(T, 1536, 512, seed=T, nonfinite=False)
        outs = []
        for fn, d in ((rk.fused_q_kv_rmsnorm_quant, dev), (ref_oq.fused_q_kv_rmsnorm_quant, "cpu")):
            Tp, Gp = _roundup(T, 128), 48
            q_out = torch.empty(T, 1536, dtype=torch.float8_e4m3fn, device=d)
            q_scale = torch.full((Tp * Gp,), 0xA5, dtype=torch.uint8, device=d)
            kv_out = torch.empty(T, 512, dtype=BF16, device=d)
            fn(qr.to(d), kv.to(d), qw.to(d), kw.to(d), 1e-6, q_out, q_scale, kv_out)
            outs.append((q_out, q_scale, kv_out))
        for lab, g, r in zip(("q", "q_scale", "kv"), *outs):
            _diff(f"q_kv_rmsnorm T{T} {lab}", g, r, fails)
    for H, Hp in ((3, 16), (64, 128)):
        q = torch.randn(7, H, 512).to(BF16)
        outs = []
        for fn, d in ((rk.pad_fused_q_heads, dev), (ref_oq.pad_fused_q_heads, "cpu")):
            out = torch.full((7, Hp, 512), -1.0, dtype=BF16, device=d)
            fn(q.to(d), out)
            outs.append(out)
        _diff(f"pad H{H} Hp{Hp}", *outs, fails)
    print("\n".join(["device checks:"] + (fails or ["all equal"])))
    assert not fails


def _gpu_out(op, a, dev):
    if op == "compute_global_topk_indices_and_lens":
        N, K = a["topk_indices"].shape
        return (torch.full((N, K), -7, dtype=I32, device=dev), torch.full((N,), -7, dtype=I32, device=dev))
    if op == "combine_topk_swa_indices":
        if a.get("out") is not None:
            return tuple(x.clone() for x in a["out"])
        T = a["topk_indices"].shape[0]
        W = _roundup(a["topk"] + a["window_size"], 128)
        return (torch.full((T, W), -7, dtype=I32, device=dev), torch.full((T,), -7, dtype=I32, device=dev))
    D, W = a["decode_swa_indices"].shape
    P = a["prefill_topk_indices"].shape[0]
    dci = a["decode_compressed_indices"]
    PT = _roundup(max(a["topk"], 0 if dci is None else dci.shape[1]), 4)
    return (torch.full((D + P, W + PT), -7, dtype=I32, device=dev), torch.full((D + P,), -7, dtype=I32, device=dev))


def _run_indexer_q_dev(fn, pos, q, cache, w, fp4, fnuz, wo_dtype):
    T, H, D = q.shape
    dev = q.device
    if fp4:
        q_out = torch.full((T, H, D // 2), 0xA5, dtype=torch.uint8, device=dev)
        q_scale = torch.full((T, H, D // 32), 0xA5, dtype=torch.uint8, device=dev)
    else:
        q_out = torch.full((T, H, D), 0xA5, dtype=torch.uint8, device=dev).view(
            torch.float8_e4m3fnuz if fnuz else torch.float8_e4m3fn)
        q_scale = torch.empty(0, dtype=torch.uint8, device=dev)
    wo = torch.full((T, H), -3.0, dtype=wo_dtype, device=dev)
    fn(pos, q, cache, w, 128**-0.5, 0.125, fp4, fnuz, q_out, q_scale, wo)
    return q_out, q_scale, wo


def _bench(fn, copy_bytes, dev="cuda"):
    """(fraction of a same-size device copy's time, µs per call under CUDA-graph replay)."""
    from triton.testing import do_bench

    t_op = do_bench(fn, warmup=25, rep=200)
    src = torch.empty(copy_bytes // 2, dtype=torch.uint8, device=dev)
    dst = torch.empty_like(src)
    t_copy = do_bench(lambda: dst.copy_(src), warmup=25, rep=200)
    return t_copy / t_op


def _graph_us(fn, n=100):
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(n):
            fn()
    g.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(10):
        g.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1000 / (10 * n)


def _perf_makers(rk, ik, dev="cuda"):
    """op label -> make(T) -> (callable, bytes moved); production shapes."""
    cache = _cos_sin_cache(max_pos=4096).to(dev)

    def make_iq(T, H=64, fp4=False):
        q = torch.randn(T, H, 128, device=dev).to(BF16)
        pos = torch.randint(0, 4096, (T,), device=dev)
        w = torch.randn(T, H, device=dev).to(BF16)
        qo = torch.empty(T, H, 64 if fp4 else 128, dtype=torch.uint8 if fp4 else torch.float8_e4m3fn, device=dev)
        qs = torch.empty(T, H, 4, dtype=torch.uint8, device=dev) if fp4 else torch.empty(0, dtype=torch.uint8, device=dev)
        wo = torch.empty(T, H, dtype=BF16 if fp4 else F32, device=dev)
        nbytes = q.numel() * 2 + qo.numel() + w.numel() * 2 + wo.numel() * wo.element_size() + qs.numel()
        return (lambda: rk.fused_indexer_q_rope_quant(pos, q, cache, w, 0.088, 0.125, fp4, False, qo, qs, wo)), nbytes

    def make_ir(T, NH=64, HG=8, qgs=128, tma=False, perm=False):
        o = torch.randn(T, NH, 512, device=dev).to(BF16)
        pos = torch.randint(0, 4096, (T,), device=dev)
        G = NH // HG
        out = torch.empty(G, T, HG * 512, dtype=torch.float8_e4m3fn, device=dev)
        S = HG * 512 // qgs
        K = S // 4 if tma else S
        Ta = _roundup(T, 4)
        sc = torch.empty(G, K * Ta, dtype=I32 if tma else F32, device=dev)
        nbytes = o.numel() * 2 + out.numel() + sc.numel() * 4
        return (lambda: rk.fused_inv_rope_fp8_quant(o, pos, cache, G, HG, 448, 64, qgs, tma, True, perm, out, sc)), nbytes

    def make_qq(T, Qs=1536, Ks=512):
        qr = torch.randn(T, Qs, device=dev).to(BF16)
        kv = torch.randn(T, Ks, device=dev).to(BF16)
        qw = torch.rand(Qs, device=dev).to(BF16)
        kw = torch.rand(Ks, device=dev).to(BF16)
        Tp = _roundup(T, 128)
        qo = torch.empty(T, Qs, dtype=torch.float8_e4m3fn, device=dev)
        qs = torch.empty(Tp * Qs // 32, dtype=torch.uint8, device=dev)
        ko = torch.empty(T, Ks, dtype=BF16, device=dev)
        nbytes = (qr.numel() + kv.numel()) * 2 + qo.numel() + qs.numel() + ko.numel() * 2
        return (lambda: rk.fused_q_kv_rmsnorm_quant(qr, kv, qw, kw, 1e-6, qo, qs, ko)), nbytes

    def make_pad(T, H=64, Hp=128):
        q = torch.randn(T, H, 512, device=dev).to(BF16)
        out = torch.empty(T, Hp, 512, dtype=BF16, device=dev)
        return (lambda: rk.pad_fused_q_heads(q, out)), q.numel() * 2 + out.numel() * 2

    def make_gt(T, K=2048):
        x = torch.randint(-1, 8192, (T, K), device=dev, dtype=I32)
        req = torch.randint(0, 16, (T,), device=dev, dtype=I32)
        tab = torch.randint(0, 100000, (16, 128), device=dev, dtype=I32)
        valid = torch.ones(T, dtype=torch.bool, device=dev)
        out = torch.empty_like(x)
        lens = torch.empty(T, dtype=I32, device=dev)
        return (lambda: ik.compute_global_topk_indices_and_lens(x, req, tab, 64, valid, out, lens)), x.numel() * 8

    return {
        "fused_indexer_q_rope_quant": make_iq,
        "fused_indexer_q_rope_quant mxfp4": lambda T: make_iq(T, fp4=True),
        "fused_inv_rope_fp8_quant": make_ir,
        "fused_inv_rope_fp8_quant qgs32 tma perm": lambda T: make_ir(T, qgs=32, tma=True, perm=True),
        "fused_q_kv_rmsnorm_quant": make_qq,
        "pad_fused_q_heads": make_pad,
        "compute_global_topk_indices_and_lens": make_gt,
    }


def _perf_line(label, make, big=65536):
    fn, nbytes = make(big)
    frac = _bench(fn, nbytes)
    us = [_graph_us(make(T)[0]) for T in (1, 8, 64)]
    return f"{label:42s} {frac:5.2f} of copy   graph us/call 1/8/64: " + " / ".join(f"{u:.2f}" for u in us)


@pytest.mark.gpu
@gpu
def test_gpu_performance_report():
    """Fraction of copy bandwidth at 65 536 tokens (16 384 for the top-k translation) and
    CUDA-graph µs/call at 1 / 8 / 64 tokens.  Printed (run with -s)."""
    import importlib

    rk = importlib.import_module("dsv41.backends.triton.rope_kernels")
    ik = importlib.import_module("dsv41.backends.triton.index_kernels")
    lines = [_perf_line(label, make, 16384 if "topk" in label else 65536)
             for label, make in _perf_makers(rk, ik).items()]
    print("\n" + "\n".join(lines))


@pytest.mark.gpu
@gpu
def test_gpu_tuning_sweep():
    """Launch shapes tried through the TUNE tables (printed; run with -s and
    DSV41_TUNE_SWEEP=1, it takes a few minutes)."""
    if os.environ.get("DSV41_TUNE_SWEEP") != "1":
        pytest.skip("set DSV41_TUNE_SWEEP=1")
    import importlib

    rk = importlib.import_module("dsv41.backends.triton.rope_kernels")
    ik = importlib.import_module("dsv41.backends.triton.index_kernels")
    makers = _perf_makers(rk, ik)
    sweeps = {
        "fused_indexer_q_rope_quant": (rk, [dict(BLOCK_T=bt, BLOCK_H=bh, num_warps=w) for bt, bh, w in (
            (1, 32, 4), (1, 64, 4), (1, 16, 2), (2, 32, 4), (1, 64, 8))]),
        "fused_inv_rope_fp8_quant": (rk, [dict(BLOCK_T=bt, BLOCK_H=bh, num_warps=w) for bt, bh, w in (
            (1, 8, 8), (1, 4, 4), (1, 8, 4), (1, 16, 8))]),
        "fused_q_kv_rmsnorm_quant": (rk, [dict(BLOCK_T=bt, num_warps=w, BLOCK_TKV=bk) for bt, w, bk in (
            (1, 4, 4), (1, 2, 2), (2, 4, 8), (1, 8, 4))]),
    }
    lines = []
    for op, (mod, cfgs) in sweeps.items():
        for cfg in cfgs:
            mod.TUNE[op] = cfg
            try:
                lines.append(_perf_line(f"{op[:26]} {cfg}", makers[op], 16384 if "topk" in op else 65536))
            except Exception as exc:  # a shape the compiler rejects
                lines.append(f"{op} {cfg}: {type(exc).__name__} {str(exc)[:100]}")
            finally:
                mod.TUNE.pop(op, None)
            print(lines[-1], flush=True)
