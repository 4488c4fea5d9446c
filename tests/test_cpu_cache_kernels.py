"""CPU kernels of the paged K-cache ops (dsv41.backends.cpu.cache_ops) against the
pure-PyTorch reference, byte for byte.

* common.h numerics (bf16 RNE, e4m3 OCP/FNUZ encode/decode, e2m1, the fp32-log2 ceiling,
  exp2i, clamp_sym) and their AVX-512 twins against dsv41.core.codecs on exhaustive / adversarial
  inputs.
* quantize_and_insert_k_cache (584 / 528, OCP / FNUZ), dequantize_and_gather_k_cache
  (584 / 528 / 288), rope_quant_insert (584 / 528 / 288 / plain bf16 / plain fp8 rows,
  sanitize_nans) and indexer_k_norm_rope_store (FP8 / MXFP4, row-major / tiled) on random
  inputs with edge cases: -1 (and other negative) slots, partial pages, block sizes 16 / 64,
  padded page strides and a non-zero storage offset (the padding canaries must survive),
  NaN / ±inf, values at the fp8 max, zeros and -0, exact e4m3 / e2m1 rounding ties, huge and
  tiny rows, empty batches, strided inputs.  Every output is compared through its whole
  backing storage, from identical canaries.
* The interleaved 528 / 288 records (vLLM 0.33): insert / gather / rope_quant_insert with
  ``interleaved=True`` equal the paged results permuted into interleaved positions, byte for
  byte, padding included (and the reference, where it takes ``interleaved``).
* The golden vectors of these four ops (vLLM's Triton kernels on an H200).
* The portable C++ path (built without -march=native, so without AVX-512): the same file
  re-run in a subprocess with DSV41_CPU_MARCH=none.
"""

from __future__ import annotations

import ctypes
import functools
import inspect
import io
import os
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest
import torch

import golden  # noqa: E402  (tests/ is on sys.path)

from dsv41.core import codecs
from dsv41.reference import compress as ref_compress
from dsv41.reference import indexer as ref_indexer
from dsv41.reference import k_cache as ref_k

cache_ops = pytest.importorskip("dsv41.backends.cpu.cache_ops")

_err = cache_ops.build_error()
pytestmark = pytest.mark.skipif(_err is not None, reason=f"CPU kernels unavailable: {_err}")

REPO = Path(__file__).resolve().parents[1]
VECTORS = golden.ARCHIVE  # tests/vectors (DSV41_VECTORS overrides)
U8, I32, I64, BF16, F32 = torch.uint8, torch.int32, torch.int64, torch.bfloat16, torch.float32
NAN, INF = float("nan"), float("inf")


# ----------------------------------------------------------------------------- helpers


def _storage(t: torch.Tensor) -> torch.Tensor:
    """A uint8 copy of ``t``'s whole backing storage."""
    return torch.empty(0, dtype=U8).set_(t.untyped_storage()).clone()


def _clone_view(t: torch.Tensor) -> torch.Tensor:
    """A copy of ``t``'s whole backing storage, viewed with the same size/stride/offset."""
    buf = torch.empty(t.untyped_storage().nbytes(), dtype=U8)
    buf.untyped_storage().copy_(t.untyped_storage())
    return torch.empty(0, dtype=t.dtype).set_(buf.untyped_storage(), t.storage_offset(), t.shape, t.stride())


def _assert_same_storage(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    x, y = _storage(got), _storage(want)
    assert x.numel() == y.numel(), f"{what}: storage sizes differ"
    if torch.equal(x, y):
        return
    bad = torch.nonzero(x != y).flatten()
    raise AssertionError(
        f"{what}: {bad.numel()} of {x.numel()} storage bytes differ; first at byte "
        f"{bad[:8].tolist()}: cpu {x[bad[:8]].tolist()} reference {y[bad[:8]].tolist()}"
    )


def _run_both(cpu_fn, ref_fn, args: list, out_pos: int, what: str) -> None:
    """Run the CPU kernel and the reference on copies of ``args[out_pos]``; compare storages."""
    a_cpu, a_ref = list(args), list(args)
    a_cpu[out_pos] = _clone_view(args[out_pos])
    a_ref[out_pos] = _clone_view(args[out_pos])
    assert cpu_fn(*a_cpu) is None
    ref_fn(*a_ref)
    _assert_same_storage(a_cpu[out_pos], a_ref[out_pos], what)


def _paged(nb: int, B: int, W: int, pad: int, dtype=U8, fill: int = 0xA5, lead: int = 48,
           flat: bool = False) -> torch.Tensor:
    """``[nb, B, W]`` (or flat ``[nb, page]``) view over a canary-filled buffer with ``pad``
    padding elements per page and ``lead`` elements before the first page (so the view has a
    non-zero storage offset).  ``fill`` is a byte (1-byte dtypes) or an int16 (bf16)."""
    page = B * W + pad
    buf = torch.empty(lead + nb * page + 32, dtype=dtype)
    if dtype.itemsize == 1:
        buf.view(U8).fill_(fill)
    else:
        buf.view(torch.int16).fill_(fill)
    if flat:
        return buf.as_strided((nb, page), (page, 1), lead)
    return buf.as_strided((nb, B, W), (page, W, 1), lead)


def _slots(gen, nb: int, B: int, T: int, neg: tuple = (-1,)) -> torch.Tensor:
    """T distinct slots (partial pages: only some tokens of a page), some negative."""
    perm = torch.randperm(nb * B, generator=gen)[:T]
    s = perm.clone()
    k = max(1, T // 8)
    idx = torch.randperm(T, generator=gen)[:k]
    s[idx] = torch.tensor([neg[i % len(neg)] for i in range(k)])
    return s.to(I64)


E4M3_POS = codecs.e4m3_decode(torch.arange(0, 0x7F, dtype=U8))  # 0 .. 448, 127 values


def _e4m3_ties(fnuz: bool) -> torch.Tensor:
    vals = E4M3_POS / 2 if fnuz else E4M3_POS
    return (vals[:-1] + vals[1:]) / 2  # every midpoint of the positive grid (bf16-exact)


_KINDS = ("normal", "zero", "negzero", "unit", "large", "tiny", "verytiny", "huge", "maxbf16",
          "exact448", "ties", "ties_fnuz", "fp8max", "e2m1ties", "mixed", "subnormal")
_NONFINITE = ("nan", "inf", "neginf", "nanmix", "infmix")


def _row(kind: str, width: int, gen) -> torch.Tensor:
    """One fp32 row of a named kind (every value bf16-representable)."""
    r = torch.randn(width, generator=gen)
    sgn = torch.where(torch.rand(width, generator=gen) < 0.5, -1.0, 1.0)
    if kind == "normal":
        g = torch.randint(-6, 7, (width // 32,), generator=gen).float()
        return r * torch.exp2(g).repeat_interleave(32)
    if kind == "zero":
        return torch.zeros(width)
    if kind == "negzero":
        return torch.full((width,), -0.0)
    if kind == "unit":
        return torch.ones(width)
    if kind == "large":
        return r * 1e4
    if kind == "tiny":
        return r * 1e-6
    if kind == "verytiny":
        return r * 1e-30
    if kind == "huge":
        return r * 3e30
    if kind == "maxbf16":
        return sgn * 3.3895313892515355e38
    if kind == "exact448":  # group amax exactly 448 * 2^k
        g = torch.randint(-8, 8, (width // 32,), generator=gen).float()
        x = (r.clamp(-1, 1) * 300).reshape(-1, 32)
        x[:, 5] = 448.0 * sgn.reshape(-1, 32)[:, 5]
        return (x * torch.exp2(g)[:, None]).flatten()
    if kind in ("ties", "ties_fnuz"):  # amax 448 (224) per 16 dims -> scale 1; all midpoints
        fnuz = kind == "ties_fnuz"
        t = _e4m3_ties(fnuz)
        x = t[torch.arange(width) % t.numel()].clone() * sgn
        x.reshape(-1, 16)[:, 0] = 224.0 if fnuz else 448.0
        return x
    if kind == "fp8max":
        return sgn * 448.0
    if kind == "e2m1ties":  # NVFP4: amax 6 per 16 dims -> e4m3 scale 1; every e2m1 tie
        t = torch.tensor([6.0, 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 0.125, 5.5])
        return t.repeat(width // 16) * torch.where(torch.arange(width) % 16 == 0, 1.0, sgn)
    if kind == "mixed":
        parts = [_row(k, 32, gen) for k in ("normal", "zero", "tiny", "large", "negzero", "ties", "huge", "unit")]
        return torch.cat(parts * (width // 256 + 1))[:width]
    if kind == "subnormal":  # bf16 subnormals mixed with zeros
        return r * 1e-39
    if kind == "nan":
        return torch.full((width,), NAN)
    if kind == "inf":
        x = r.clone()
        x[3::37] = INF
        return x
    if kind == "neginf":
        x = r.clone()
        x[7::41] = -INF
        return x
    if kind == "nanmix":
        x = r.clone()
        x[::29] = NAN
        x[1::29] = -0.0
        return x
    if kind == "infmix":
        x = _row("normal", width, gen)
        x[::50] = INF
        x[25::50] = -INF
        x[10::77] = NAN
        return x
    raise ValueError(kind)


def _rows(n: int, width: int, gen, nonfinite: bool = True, kinds=None) -> torch.Tensor:
    kinds = kinds or (_KINDS + (_NONFINITE if nonfinite else ()))
    return torch.stack([_row(kinds[i % len(kinds)], width, gen) for i in range(n)]).to(BF16)


def _lib():
    return cache_ops.library()


def _ptr(t):
    return ctypes.c_void_p(t.data_ptr())


# ----------------------------------------------------------------------------- common.h


def _adversarial_f32(gen) -> torch.Tensor:
    """fp32 values around every e4m3 (OCP and FNUZ) grid point and midpoint, every e2m1
    threshold, bf16 ties, specials, random bit patterns."""
    grid = torch.cat([E4M3_POS, E4M3_POS / 2, torch.tensor([6.0, 4, 3, 2, 1.5, 1, 0.5, 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5])])
    pts = torch.cat([grid, _e4m3_ties(False), _e4m3_ties(True), torch.tensor([464.0, 480, 240, 248, 224, 232, 1e30, 2.0**-10, 2.0**-11, 2.0**-12])])
    bits = pts.view(I32)
    near = torch.cat([bits + d for d in range(-3, 4)]).view(F32)
    rnd = torch.randint(-(2**31), 2**31 - 1, (40000,), generator=gen, dtype=I64).to(I32).view(F32)
    small = torch.randn(20000, generator=gen) * torch.exp2(torch.randint(-30, 12, (20000,), generator=gen).float())
    spec = torch.tensor([0.0, -0.0, INF, -INF, NAN, -NAN, 2.0**-149, -(2.0**-149), 2.0**-126, 3.4e38])
    x = torch.cat([near, -near, rnd, small, spec])
    return x.contiguous()


@pytest.mark.parametrize("fnuz", [False, True])
def test_e4m3_encode(fnuz):
    x = _adversarial_f32(torch.Generator().manual_seed(1))
    out = torch.empty(x.numel(), dtype=U8)
    _lib().dsv41_codec_e4m3_encode(_ptr(x), _ptr(out), x.numel(), int(fnuz))
    assert torch.equal(out, codecs.e4m3_encode(x, fnuz=fnuz))
    if cache_ops.simd():
        n = x.numel() // 16 * 16
        v = torch.empty(n, dtype=U8)
        sat = 0x43700000 if fnuz else 0x43E00000
        nan_code = 0x80 if fnuz else 0x7F
        assert _lib().dsv41_codec_v16_e4m3_encode(_ptr(x), _ptr(v), n, int(fnuz), sat, nan_code) == 0
        assert torch.equal(v, out[:n])
        # quantizer form: clamp to 224/448 with NaN -> +max
        m = 224.0 if fnuz else 448.0
        want = codecs.e4m3_encode(torch.where(torch.isnan(x[:n]), m, codecs.clamp_sym(x[:n], m)), fnuz=fnuz)
        assert _lib().dsv41_codec_v16_e4m3_encode(_ptr(x), _ptr(v), n, int(fnuz), 0x43600000 if fnuz else 0x43E00000, 0x7E) == 0
        assert torch.equal(v, want)
        # the same through V16_NAN_POS_SAT (0x200: NaN -> +max by vfixupimm)
        assert _lib().dsv41_codec_v16_e4m3_encode(_ptr(x), _ptr(v), n, int(fnuz), 0x43600000 if fnuz else 0x43E00000, 0x200) == 0
        assert torch.equal(v, want)
        # clamp_sym form (NaN keeps its sign): V16_NAN_SIGNED_SAT (0x100)
        want = codecs.e4m3_encode(codecs.clamp_sym(x[:n], m), fnuz=fnuz)
        assert _lib().dsv41_codec_v16_e4m3_encode(_ptr(x), _ptr(v), n, int(fnuz), 0x43600000 if fnuz else 0x43E00000, 0x100) == 0
        assert torch.equal(v, want)


@pytest.mark.parametrize("fnuz", [False, True])
def test_e4m3_decode(fnuz):
    b = torch.arange(256, dtype=U8)
    want = codecs.e4m3_decode(b, fnuz=fnuz)
    for table in (0, 1):
        out = torch.empty(256, dtype=F32)
        _lib().dsv41_codec_e4m3_decode(_ptr(b), _ptr(out), 256, int(fnuz), table)
        assert torch.equal(torch.isnan(out), torch.isnan(want))
        ok = ~torch.isnan(want)
        assert torch.equal(out[ok].view(I32), want[ok].view(I32))
    if cache_ops.simd():
        out = torch.empty(256, dtype=F32)
        assert _lib().dsv41_codec_v16_e4m3_decode(_ptr(b), _ptr(out), 256, int(fnuz)) == 0
        assert torch.equal(torch.isnan(out), torch.isnan(want))
        assert torch.equal(out[~torch.isnan(want)].view(I32), want[~torch.isnan(want)].view(I32))


def test_e2m1_encode():
    x = _adversarial_f32(torch.Generator().manual_seed(2))
    out = torch.empty(x.numel(), dtype=U8)
    _lib().dsv41_codec_e2m1_encode(_ptr(x), _ptr(out), x.numel())
    assert torch.equal(out, codecs.e2m1_encode(x))
    if cache_ops.simd():
        n = x.numel() // 16 * 16
        v = torch.empty(n, dtype=U8)
        assert _lib().dsv41_codec_v16_e2m1_encode(_ptr(x), _ptr(v), n) == 0
        assert torch.equal(v, out[:n])


def test_bf16_rne():
    x = _adversarial_f32(torch.Generator().manual_seed(3))
    ties = (torch.randint(0, 2**16, (5000,), dtype=I32) << 16 | 0x8000).view(F32)  # exact bf16 ties
    x = torch.cat([x, ties, ties + 0.0]).contiguous()
    nan = torch.isnan(x)
    torch_bits = x.to(BF16).view(torch.int16)
    for nan_bits in (0x7FFF, 0xFFFF):
        out = torch.empty(x.numel(), dtype=torch.int16)
        _lib().dsv41_codec_bf16_rne(_ptr(x), _ptr(out), x.numel(), nan_bits)
        want = torch.where(nan, torch.tensor(nan_bits, dtype=I32).to(torch.int16), torch_bits)
        assert torch.equal(out, want)
        if cache_ops.simd():
            n = x.numel() // 16 * 16
            v = torch.empty(n, dtype=torch.int16)
            assert _lib().dsv41_codec_v16_bf16(_ptr(x), _ptr(v), n, int(nan_bits == 0xFFFF)) == 0
            assert torch.equal(v, out[:n])
    # what torch's own CPU cast writes for NaN (the rule common.h's *_torch variants copy)
    assert torch.equal(torch_bits[nan], torch.full_like(torch_bits[nan], -1))


def test_ceil_log2_exact():
    """The table-driven ceil(fl32(log2 r)) equals libm's and torch's (codecs.ceil_log2) on
    every normal fp32 within 4096 ulps above each power of two, and on random values."""
    E = torch.arange(1, 255, dtype=I32)
    j = torch.arange(0, 4096, dtype=I32)
    near = ((E[:, None] << 23) | j[None, :]).flatten()
    far = ((E[:, None] << 23) | (0x7FFFFF - j[None, :64])).flatten()
    rnd = torch.randint(0x00800000, 0x7F7FFFFF, (200000,), generator=torch.Generator().manual_seed(4), dtype=I64).to(I32)
    x = torch.cat([near, far, rnd]).view(F32).contiguous()
    fast = torch.empty_like(x)
    slow = torch.empty_like(x)
    _lib().dsv41_codec_ceil_log2(_ptr(x), _ptr(fast), x.numel(), 0)
    _lib().dsv41_codec_ceil_log2(_ptr(x), _ptr(slow), x.numel(), 1)
    want = codecs.ceil_log2(x)
    assert torch.equal(slow, want)
    assert torch.equal(fast, want)
    if cache_ops.simd():
        v = torch.empty(x.numel(), dtype=I32)
        assert _lib().dsv41_codec_v16_ceil_log2(_ptr(x), _ptr(v), x.numel()) == 0
        assert torch.equal(v.to(F32), want)
    sp = torch.tensor([0.0, 2.0**-149, 2.0**-130, INF, 1.0, 0.75], dtype=F32)
    out = torch.empty_like(sp)
    _lib().dsv41_codec_ceil_log2(_ptr(sp), _ptr(out), sp.numel(), 0)
    assert torch.equal(out, codecs.ceil_log2(sp))


def test_exp2i_and_clamp_sym():
    e = torch.cat([torch.arange(-200, 200, dtype=F32), torch.tensor([INF, -INF, NAN])])
    out = torch.empty_like(e)
    _lib().dsv41_codec_exp2i(_ptr(e), _ptr(out), e.numel())
    want = codecs.exp2i(e)
    assert torch.equal(torch.isnan(out), torch.isnan(want))
    assert torch.equal(out[~torch.isnan(want)], want[~torch.isnan(want)])
    x = _adversarial_f32(torch.Generator().manual_seed(5))
    for m in (448.0, 224.0, 6.0):
        out = torch.empty_like(x)
        _lib().dsv41_codec_clamp_sym(_ptr(x), _ptr(out), x.numel(), ctypes.c_float(m))
        assert torch.equal(out.view(I32), codecs.clamp_sym(x, m).view(I32))


# ----------------------------------------------------------------------------- quantize_and_insert_k_cache


@pytest.mark.parametrize("W", [584, 528])
@pytest.mark.parametrize("fnuz", [False, True])
@pytest.mark.parametrize("B", [16, 64])
@pytest.mark.parametrize("flat", [False, True])
def test_quantize_insert(W, fnuz, B, flat):
    gen = torch.Generator().manual_seed(W + B + 7 * fnuz + 3 * flat)
    nb, T = 7, 5 * B // 2 + 3
    rows = _rows(T + 4, 512, gen)
    rows[T:] = NAN  # DP padding rows: never read
    cache = _paged(nb, B, W, pad=512 if W == 528 else 576, flat=flat)
    slots = _slots(gen, nb, B, T)
    args = [rows, cache, slots, B, fnuz, W]
    _run_both(cache_ops.quantize_and_insert_k_cache, ref_k.quantize_and_insert_k_cache, args, 1, f"insert {W}")


def test_quantize_insert_strided_k_and_int32_slots():
    gen = torch.Generator().manual_seed(11)
    B, nb, T = 64, 3, 100
    wide = _rows(T, 640, gen)
    k = wide[:, 64:576]  # row stride 640
    cache = _paged(nb, B, 528, pad=0)
    slots = _slots(gen, nb, B, T).to(I32)
    for W in (528, 584):
        cache = _paged(nb, B, W, pad=8)
        _run_both(cache_ops.quantize_and_insert_k_cache, ref_k.quantize_and_insert_k_cache,
                  [k, cache, slots, B, False, W], 1, f"strided {W}")


def test_quantize_insert_empty_and_all_skipped():
    cache = _paged(2, 16, 584, pad=0)
    before = _storage(cache)
    k = _rows(4, 512, torch.Generator().manual_seed(0))
    cache_ops.quantize_and_insert_k_cache(k, cache, torch.empty(0, dtype=I64), 16, False, 584)
    cache_ops.quantize_and_insert_k_cache(k, cache, torch.full((4,), -1, dtype=I64), 16, False, 584)
    assert torch.equal(_storage(cache), before)


# ----------------------------------------------------------------------------- dequantize_and_gather_k_cache


def _gather_case(gen, W, B, fnuz, from_writer: bool, glens_mode: str, offset: int):
    nb = 9
    pad = {584: 576, 528: 512, 288: 512}[W]
    cache = _paged(nb, B, W, pad=pad)
    # page bytes: uniformly random (every code incl. 0 and 255, NaN e4m3 / bf16, negative
    # NVFP4 scales), then (MXFP8 / V4 records) most pages written by the quantizer.
    pages = cache.as_strided((nb, B * W), (cache.stride(0), 1), cache.storage_offset())
    pages.copy_(torch.randint(0, 256, pages.shape, generator=gen, dtype=I32).to(U8))
    if from_writer and W != 288:
        slots = torch.arange(0, (nb - 2) * B, dtype=I64)
        rows = _rows(slots.numel(), 512, gen)
        ref_k.quantize_and_insert_k_cache(rows, cache, slots, B, fnuz, W)
    R = 4
    seq = torch.tensor([3 * B + 5, 0, B, 2 * B + 1], dtype=I32)
    maxb = 8
    bt_wide = torch.full((R, maxb + 3), -1, dtype=I32)
    for r in range(R):
        need = (int(seq[r]) + B - 1) // B
        bt_wide[r, :need] = torch.randperm(nb, generator=gen)[:need].to(I32)
    bt = bt_wide[:, :maxb]  # row stride maxb + 3
    if glens_mode == "none":
        glens = None
        rows_out = int(seq.max()) + offset
    else:
        glens = torch.tensor([7, 0, B, 2 * B + 1], dtype=I32)
        rows_out = int(glens.max()) + offset + 2
        if glens_mode == "short":  # blocks of positions < L - n are never read
            for r in range(R):
                first_needed = (int(seq[r]) - int(glens[r])) // B
                bt[r, :first_needed] = -1
    out = torch.empty(R, rows_out, 512, dtype=BF16)
    out.view(torch.int16).fill_(-8531)  # 0xDEAD canary
    return [out, cache, seq, glens, bt, B, offset, fnuz]


@pytest.mark.parametrize("W", [584, 528, 288])
@pytest.mark.parametrize("fnuz", [False, True])
@pytest.mark.parametrize("B", [16, 64])
@pytest.mark.parametrize("glens_mode,offset", [("none", 0), ("short", 3)])
def test_gather(W, fnuz, B, glens_mode, offset):
    if W == 288 and fnuz:
        pytest.skip("NVFP4 ignores use_fnuz")
    for from_writer in (False, True):
        gen = torch.Generator().manual_seed(W * 3 + B + fnuz + offset + from_writer)
        args = _gather_case(gen, W, B, fnuz, from_writer, glens_mode, offset)
        _run_both(cache_ops.dequantize_and_gather_k_cache, ref_k.dequantize_and_gather_k_cache,
                  args, 0, f"gather {W} writer={from_writer}")


def test_gather_empty():
    gen = torch.Generator().manual_seed(3)
    args = _gather_case(gen, 528, 16, False, False, "none", 0)
    out = args[0]
    before = _storage(out)
    args[2] = torch.zeros(4, dtype=I32)
    cache_ops.dequantize_and_gather_k_cache(*args)
    args[3] = torch.zeros(4, dtype=I32)
    cache_ops.dequantize_and_gather_k_cache(*args)
    args[2], args[3], args[4] = torch.empty(0, dtype=I32), None, torch.empty(0, 4, dtype=I32)
    cache_ops.dequantize_and_gather_k_cache(*args)
    assert torch.equal(_storage(out), before)


# ----------------------------------------------------------------------------- rope_quant_insert


def _cos_sin(gen, max_pos: int, dtype, strided: bool) -> torch.Tensor:
    cs = torch.randn(max_pos, 80 if strided else 64, generator=gen) * 1.5
    cs[::7, 3] = -0.0
    cs[::11, 40] = 0.0
    cs = cs.to(dtype)
    return cs[:, 8:72] if strided else cs


@pytest.mark.parametrize("kind", [584, 528, 288, "bf16", "fp8"])
@pytest.mark.parametrize("CR", [1, 2])
@pytest.mark.parametrize("sanitize", [False, True])
@pytest.mark.parametrize("cs_mode", ["f32", "bf16", "f32_strided"])
def test_rope_quant_insert(kind, CR, sanitize, cs_mode):
    gen = torch.Generator().manual_seed(hash((str(kind), CR, sanitize, cs_mode)) % 2**31)
    B, nb = (16 if CR == 1 else 64), 6
    T = nb * B // 2 + 5
    latent = _rows(T + 2, 512, gen)
    positions = torch.randint(0, 300, (T + 2,), generator=gen, dtype=I64)
    slots = _slots(gen, nb, B, T, neg=(-1, -5))
    # rows of non-writing tokens are never read: poison them
    skip = (slots < 0) | ((positions[:T] + 1) % CR != 0)
    latent[:T][skip] = NAN
    cs = _cos_sin(gen, 320, BF16 if cs_mode == "bf16" else F32, cs_mode == "f32_strided")
    scale = None
    if kind == "bf16":
        cache = _paged(nb, B, 512, pad=64, dtype=BF16, fill=-8531)
    elif kind == "fp8":
        cache = _paged(nb, B, 512, pad=64, dtype=torch.float8_e4m3fn)
        scale = torch.tensor([0.0375], dtype=F32)
    else:
        cache = _paged(nb, B, kind, pad=512)
    args = [latent, positions, cs, cache, slots, CR, scale, sanitize]
    _run_both(cache_ops.rope_quant_insert, ref_compress.rope_quant_insert, args, 3, f"rope_quant_insert {kind}")


def test_rope_quant_insert_int32_positions_and_empty():
    gen = torch.Generator().manual_seed(21)
    B, nb, T = 16, 4, 40
    latent = _rows(T, 512, gen, nonfinite=False)
    positions = torch.arange(T, dtype=I32)
    slots = _slots(gen, nb, B, T)
    cs = _cos_sin(gen, 64, F32, False)
    cache = _paged(nb, B, 528, pad=0)
    _run_both(cache_ops.rope_quant_insert, ref_compress.rope_quant_insert,
              [latent, positions, cs, cache, slots.to(I32), 2, None, False], 3, "int32")
    before = _storage(cache)
    cache_ops.rope_quant_insert(latent, positions, cs, cache, torch.empty(0, dtype=I64), 1, None, False)
    assert torch.equal(_storage(cache), before)


# ----------------------------------------------------------------------------- interleaved 528 / 288


_VB = {528: 512, 288: 256}  # value bytes per token; the rest of the record are its scales


def _ref_has(fn, name: str) -> bool:
    return name in inspect.signature(fn).parameters


def _interleave(cache: torch.Tensor, B: int, W: int) -> torch.Tensor:
    """A copy of ``cache`` (same view over a cloned storage; ``[nb, B, W]`` or a flat
    ``[nb, page]`` view) whose used page bytes are
    rearranged from the paged layout (all values, then all scales) into the interleaved one
    (each token's values followed by its scales); padding and bytes outside pages keep theirs."""
    out = _clone_view(cache)
    nb, vb = cache.shape[0], _VB[W]
    src = cache.as_strided((nb, B * W), (cache.stride(0), 1), cache.storage_offset())
    dst = out.as_strided((nb, B * W), (out.stride(0), 1), out.storage_offset())
    vals = src[:, : B * vb].reshape(nb, B, vb)
    scales = src[:, B * vb :].reshape(nb, B, W - vb)
    dst.copy_(torch.cat((vals, scales), dim=-1).reshape(nb, B * W))
    return out


def _random_pages(cache: torch.Tensor, B: int, W: int, gen) -> None:
    pages = cache.as_strided((cache.shape[0], B * W), (cache.stride(0), 1), cache.storage_offset())
    pages.copy_(torch.randint(0, 256, pages.shape, generator=gen, dtype=I32).to(U8))


def test_interleave_helper_places_bytes():
    """The test's own permutation against the layout formulas, byte by byte."""
    B, W, nb = 4, 288, 2
    cache = _paged(nb, B, W, pad=40)
    _random_pages(cache, B, W, torch.Generator().manual_seed(0))
    il = _interleave(cache, B, W)
    vb, sb = 256, 32
    flat_p, flat_i = _storage(cache), _storage(il)
    base0 = cache.storage_offset()
    for blk in range(nb):
        base = base0 + blk * cache.stride(0)
        for t in range(B):
            for j in (0, 1, vb - 1):
                assert flat_i[base + W * t + j] == flat_p[base + vb * t + j]
            for j in (0, sb - 1):
                assert flat_i[base + W * t + vb + j] == flat_p[base + B * vb + sb * t + j]
    pad_lo = base0 + B * W
    assert torch.equal(flat_i[pad_lo : pad_lo + 40], flat_p[pad_lo : pad_lo + 40])


@pytest.mark.parametrize("fnuz", [False, True])
@pytest.mark.parametrize("B", [16, 64])
@pytest.mark.parametrize("flat", [False, True])
def test_quantize_insert_interleaved(fnuz, B, flat):
    """Interleaved insert == paged insert with every page permuted into interleaved order, from
    random page bytes (untouched records and page padding must survive)."""
    W = 528
    gen = torch.Generator().manual_seed(101 + B + 7 * fnuz + 3 * flat)
    nb, T = 7, 5 * B // 2 + 3
    rows = _rows(T + 4, 512, gen)
    rows[T:] = NAN
    cache = _paged(nb, B, W, pad=512, flat=flat)
    _random_pages(cache, B, W, gen)
    slots = _slots(gen, nb, B, T)
    paged = _clone_view(cache)
    cache_ops.quantize_and_insert_k_cache(rows, paged, slots, B, fnuz, W)
    il = _interleave(cache, B, W)
    assert cache_ops.quantize_and_insert_k_cache(rows, il, slots, B, fnuz, W, True) is None
    _assert_same_storage(il, _interleave(paged, B, W), f"interleaved insert B={B}")
    if _ref_has(ref_k.quantize_and_insert_k_cache, "interleaved"):
        _run_both(cache_ops.quantize_and_insert_k_cache, ref_k.quantize_and_insert_k_cache,
                  [rows, _interleave(cache, B, W),
                   slots, B, fnuz, W, True], 1, "interleaved insert vs reference")


@pytest.mark.parametrize("W", [528, 288])
@pytest.mark.parametrize("fnuz", [False, True])
@pytest.mark.parametrize("B", [16, 64])
def test_gather_interleaved(W, fnuz, B):
    """Gathering interleaved records gives the bytes the paged gather gives for the same
    records; the cache is not written."""
    if W == 288 and fnuz:
        pytest.skip("NVFP4 ignores use_fnuz")
    for from_writer in (False, True):
        gen = torch.Generator().manual_seed(W + B + fnuz + 5 * from_writer)
        args = _gather_case(gen, W, B, fnuz, from_writer, "short", 3)
        out_p = _clone_view(args[0])
        cache_ops.dequantize_and_gather_k_cache(out_p, *args[1:])
        il = _interleave(args[1], B, W)
        before = _storage(il)
        out_i = _clone_view(args[0])
        assert cache_ops.dequantize_and_gather_k_cache(out_i, il, *args[2:], True) is None
        _assert_same_storage(out_i, out_p, f"interleaved gather {W}")
        assert torch.equal(_storage(il), before)
        if _ref_has(ref_k.dequantize_and_gather_k_cache, "interleaved"):
            _run_both(cache_ops.dequantize_and_gather_k_cache, ref_k.dequantize_and_gather_k_cache,
                      [args[0], il, *args[2:], True], 0, f"interleaved gather {W} vs reference")


@pytest.mark.parametrize("W", [528, 288])
@pytest.mark.parametrize("CR", [1, 2])
@pytest.mark.parametrize("sanitize", [False, True])
def test_rope_quant_insert_interleaved(W, CR, sanitize):
    gen = torch.Generator().manual_seed(W * 5 + CR + 2 * sanitize)
    B, nb = (16 if CR == 1 else 64), 6
    T = nb * B // 2 + 5
    latent = _rows(T + 2, 512, gen)
    positions = torch.randint(0, 300, (T + 2,), generator=gen, dtype=I64)
    slots = _slots(gen, nb, B, T, neg=(-1, -5))
    cs = _cos_sin(gen, 320, F32, True)
    cache = _paged(nb, B, W, pad=512)
    _random_pages(cache, B, W, gen)
    paged = _clone_view(cache)
    cache_ops.rope_quant_insert(latent, positions, cs, paged, slots, CR, None, sanitize)
    il = _interleave(cache, B, W)
    assert cache_ops.rope_quant_insert(latent, positions, cs, il, slots, CR, None, sanitize, True) is None
    _assert_same_storage(il, _interleave(paged, B, W), f"interleaved rope_quant_insert {W}")
    if _ref_has(ref_compress.rope_quant_insert, "interleaved"):
        _run_both(cache_ops.rope_quant_insert, ref_compress.rope_quant_insert,
                  [latent, positions, cs, _interleave(cache, B, W), slots, CR, None, sanitize, True], 3,
                  f"interleaved rope_quant_insert {W} vs reference")


def test_interleaved_parallel_and_584_rejected():
    """Enough tokens for the OpenMP path; the 584 record has no interleaved layout."""
    gen = torch.Generator().manual_seed(5)
    B, nb, T = 64, 12, 700
    rows = _rows(T, 512, gen, nonfinite=False)
    slots = _slots(gen, nb, B, T)
    cache = _paged(nb, B, 528, pad=64)
    paged = _clone_view(cache)
    cache_ops.quantize_and_insert_k_cache(rows, paged, slots, B, False, 528)
    il = _interleave(cache, B, 528)
    cache_ops.quantize_and_insert_k_cache(rows, il, slots, B, False, 528, True)
    _assert_same_storage(il, _interleave(paged, B, 528), "interleaved insert parallel")
    with pytest.raises(ValueError):
        cache_ops.quantize_and_insert_k_cache(rows, _paged(nb, B, 584, pad=0), slots, B, False, 584, True)


# ----------------------------------------------------------------------------- indexer_k_norm_rope_store


@pytest.mark.parametrize("fp4,tiled,npt", [(False, False, 0), (False, True, 0), (True, False, 0),
                                           (True, True, 16), (True, True, 32), (True, True, 64)])
@pytest.mark.parametrize("CR", [1, 2])
@pytest.mark.parametrize("B", [16, 64])
@pytest.mark.parametrize("cs_mode", ["f32", "bf16", "f32_strided"])
def test_indexer_k_store(fp4, tiled, npt, CR, B, cs_mode):
    if tiled and fp4 and B % npt:
        pytest.skip("block size not a multiple of the MXFP4 tile")
    gen = torch.Generator().manual_seed(hash((fp4, tiled, npt, CR, B, cs_mode)) % 2**31)
    nb = 5
    T = nb * B // 2 + 3
    kinds = ("normal", "zero", "negzero", "unit", "large", "tiny", "verytiny", "huge", "maxbf16",
             "mixed", "subnormal", "nan", "inf", "nanmix", "infmix")
    k_pre = _rows(T + 1, 128, gen, kinds=kinds)
    positions = torch.randint(0, 200, (T + 1,), generator=gen, dtype=I64)
    slots = _slots(gen, nb, B, T)
    skip = (slots < 0) | ((positions[:T] + 1) % CR != 0)
    k_pre[:T][skip] = NAN
    cs = _cos_sin(gen, 256, BF16 if cs_mode == "bf16" else F32, cs_mode == "f32_strided")
    w = (torch.randn(128, generator=gen) * 2).to(BF16)
    W = 68 if fp4 else 132
    cache = _paged(nb, B, W, pad=64)
    args = [k_pre, positions, cs, w, 1e-6, cache, slots, CR, fp4, npt, tiled]
    _run_both(cache_ops.indexer_k_norm_rope_store, ref_indexer.indexer_k_norm_rope_store, args, 5,
              f"indexer fp4={fp4} tiled={tiled}")


def test_indexer_k_store_empty():
    cache = _paged(2, 16, 132, pad=0)
    before = _storage(cache)
    k = torch.zeros(3, 128, dtype=BF16)
    cs = torch.zeros(8, 64)
    cache_ops.indexer_k_norm_rope_store(k, torch.zeros(3, dtype=I64), cs, torch.ones(128, dtype=BF16), 1e-6,
                                        cache, torch.empty(0, dtype=I64), 1, False, 0, False)
    assert torch.equal(_storage(cache), before)


# ----------------------------------------------------------------------------- golden vectors

GOLDEN_ARGS = {
    "quantize_and_insert_k_cache": (
        ("k", "k_cache", "slot_mapping", "block_size", "use_fnuz", "bytes_per_token"), "k_cache"),
    "dequantize_and_gather_k_cache": (
        ("out", "k_cache", "seq_lens", "gather_lens", "block_table", "block_size", "offset", "use_fnuz"), "out"),
    "rope_quant_insert": (
        ("latent", "positions", "cos_sin_cache", "kv_cache", "slot_mapping", "compress_ratio", "fp8_scale",
         "sanitize_nans"), "kv_cache"),
    "indexer_k_norm_rope_store": (
        ("k_pre", "positions", "cos_sin_cache", "rms_norm_weight", "rms_norm_eps", "k_cache", "kv_slot_mapping",
         "compress_ratio", "use_fp4_cache", "mxfp4_n_per_tile", "tiled"), "k_cache"),
}
# kernel arguments the public layer resolves (the vectors were made on CUDA: no gfx950
# sanitizing, no ROCm tiling)
GOLDEN_DEFAULTS = {"sanitize_nans": False, "tiled": False}


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
            if case["op"] in GOLDEN_ARGS:
                cases[Path(m.name).name] = case
    return cases


def _golden_names():
    try:
        return sorted(_golden())
    except Exception:  # unreadable archive: reported by the test below
        return []


@pytest.mark.parametrize("name", _golden_names() or ["<no vectors>"])
def test_golden(name):
    if name == "<no vectors>":
        pytest.skip(f"golden vectors not found at {VECTORS}")
    case = _golden()[name]
    names, out_name = GOLDEN_ARGS[case["op"]]
    a = dict(GOLDEN_DEFAULTS, **case["args"])
    args = [a[n] for n in names]
    out_pos = names.index(out_name)
    args[out_pos] = _clone_view(args[out_pos])
    fn = getattr(cache_ops, case["op"])
    assert fn(*args) is None
    _assert_same_storage(args[out_pos], case["out"][out_name], name)


def test_golden_vectors_present():
    if not VECTORS.is_file():
        pytest.skip(f"golden vectors not found at {VECTORS}")
    ops = {c["op"] for c in _golden().values()}
    assert ops == set(GOLDEN_ARGS)


# ----------------------------------------------------------------------------- portable path


def test_simd_state():
    expect = os.environ.get("DSV41_TEST_EXPECT_PORTABLE")
    if expect == "1":
        assert not cache_ops.simd(), "DSV41_CPU_MARCH=none build still has the AVX-512 paths"


@pytest.mark.skipif(os.environ.get("DSV41_TEST_EXPECT_PORTABLE") == "1", reason="already the portable run")
def test_portable_path_subprocess(tmp_path):
    """The same file with the library built for a baseline CPU (no -march=native): the
    portable C++ token paths must give the same bytes."""
    if not cache_ops.simd():
        pytest.skip("this build already runs the portable paths")
    env = dict(os.environ, DSV41_CPU_MARCH="none", DSV41_TEST_EXPECT_PORTABLE="1")
    cmd = [sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", __file__,
           "-k", "not portable_path"]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, cwd=str(REPO))
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
