"""Tests of dsv41.reference.indexer (spec rope_quant_ops.md §2, §3).

* golden vectors (vLLM's Triton kernels on an H200): every byte of the FP8 indexer K cache
  (whole backing storage: page padding and untouched slots included) and of the FP8 Q path;
* hand-made cases the vectors cannot cover (MXFP4, FNUZ, ROCm tiled layouts), checked
  against a slow scalar re-derivation of the spec written independently of the reference:
  exact rational arithmetic (``fractions.Fraction``) rounded once per spec step.
"""

from __future__ import annotations

import io
import math
import struct
import tarfile
from fractions import Fraction
from pathlib import Path

import pytest
import torch

import golden  # noqa: E402  (tests/ is on sys.path)

from dsv41.reference.indexer import (
    fused_indexer_q_rope_quant,
    indexer_k_norm_rope_store,
)

_REPO = Path(__file__).resolve().parents[1]
VECTORS = golden.ARCHIVE  # tests/vectors (DSV41_VECTORS overrides)

U8 = torch.uint8
F32 = torch.float32
BF16 = torch.bfloat16
CANARY = 0xA5


# --------------------------------------------------------------------------------------
# Golden vectors
# --------------------------------------------------------------------------------------


def _load_case(name: str) -> dict:
    if not VECTORS.is_file():
        pytest.skip(f"golden vectors not found at {VECTORS} (set DSV41_VECTORS)")
    with tarfile.open(VECTORS, "r:xz") as tar:
        member = next((m for m in tar.getmembers() if Path(m.name).name == name), None)
        if member is None:
            pytest.skip(f"{name} is not in {VECTORS}")
        return torch.load(io.BytesIO(tar.extractfile(member).read()), weights_only=True)


def _clone_view(t: torch.Tensor) -> torch.Tensor:
    """Deep copy that keeps the view: same backing storage size, offset, sizes, strides."""
    storage = t.untyped_storage().clone()
    base = torch.empty(0, dtype=t.dtype, device=t.device)
    base.set_(storage, 0, (storage.nbytes() // t.element_size(),), (1,))
    return base.as_strided(t.size(), t.stride(), t.storage_offset())


def _storage_bytes(t: torch.Tensor) -> torch.Tensor:
    return torch.empty(0, dtype=U8, device=t.device).set_(t.untyped_storage())


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(U8)


@pytest.mark.parametrize("case", ["indexer_k_store_fp8_cr1.pt", "indexer_k_store_fp8_cr2.pt"])
def test_golden_k_store(case):
    d = _load_case(case)
    a = d["args"]
    k_cache = _clone_view(a["k_cache"])
    indexer_k_norm_rope_store(
        a["k_pre"], a["positions"], a["cos_sin_cache"], a["rms_norm_weight"], a["rms_norm_eps"],
        k_cache, a["kv_slot_mapping"], a["compress_ratio"], a["use_fp4_cache"],
        a["mxfp4_n_per_tile"], False,
    )
    got, want = _storage_bytes(k_cache), _storage_bytes(d["out"]["k_cache"])
    assert got.numel() == want.numel()
    bad = torch.nonzero(got != want).flatten()
    assert bad.numel() == 0, f"{bad.numel()} cache bytes differ, first at {bad[:8].tolist()}"


def test_golden_q_fp8():
    d = _load_case("indexer_q_fp8.pt")
    a = d["args"]
    q = a["index_q"]
    q_out = torch.empty_like(q, dtype=torch.float8_e4m3fn)
    weights_out = torch.empty_like(a["index_weights"], dtype=F32)
    fused_indexer_q_rope_quant(
        a["positions"], q, a["index_q_cos_sin_cache"], a["index_weights"],
        a["index_weights_softmax_scale"], a["index_weights_head_scale"], a["use_fp4"], False,
        q_out, torch.empty(0, dtype=U8), weights_out,
    )
    bad_q = int((_bytes(q_out) != _bytes(d["out"]["q_fp8"])).sum())
    bad_w = int((_bytes(weights_out) != _bytes(d["out"]["weights_out"])).sum())
    assert (bad_q, bad_w) == (0, 0), f"{bad_q} q bytes and {bad_w} weight bytes differ"


# --------------------------------------------------------------------------------------
# Independent scalar model of the spec (exact rationals, one rounding per step)
# --------------------------------------------------------------------------------------


def _round(x: Fraction, mant_bits: int) -> Fraction:
    """RNE of a non-zero rational to ``mant_bits`` fraction bits, fp32 exponent range."""
    a = abs(x)
    e = a.numerator.bit_length() - a.denominator.bit_length()
    if Fraction(2) ** e > a:
        e -= 1
    e = max(e, -126)  # subnormals share the quantum of the smallest binade
    quantum = Fraction(2) ** (e - mant_bits)
    n, rem = divmod(a, quantum)
    if rem > quantum / 2 or (rem == quantum / 2 and n % 2 == 1):
        n += 1
    r = n * quantum
    if r >= Fraction(2) ** 128:
        raise OverflowError("fp32 overflow (not reached by these tests)")
    return r if x > 0 else -r


def _to_float(x: Fraction | float, neg_zero: bool, mant_bits: int) -> float:
    if x == 0:
        return -0.0 if neg_zero else 0.0
    return float(_round(Fraction(x), mant_bits))


def f32(x, neg_zero: bool = False) -> float:
    return _to_float(x, neg_zero, 23)


def bf(x: float) -> float:
    """RNbf: fp32 -> bf16 (RNE) -> fp32, sign of zero kept."""
    return _to_float(x, math.copysign(1.0, x) < 0, 7)


def mul32(a: float, b: float) -> float:
    p = a * b  # exact in double for fp32 operands of these tests; keeps the zero sign
    return f32(Fraction(p), math.copysign(1.0, p) < 0)


def fma32(a: float, b: float, c: float) -> float:
    exact = Fraction(a) * Fraction(b) + Fraction(c)
    if exact == 0:  # IEEE: the sum of two zeros is -0 only if both are -0; else +0
        p_neg = math.copysign(1.0, a) * math.copysign(1.0, b) < 0
        neg = (a * b == 0) and p_neg and math.copysign(1.0, c) < 0
        return -0.0 if neg else 0.0
    return f32(exact)


def ceil_log2_exact(s: float) -> int:
    m, e = math.frexp(s)  # s = m * 2^e, m in [0.5, 1)
    return e - 1 if m == 0.5 else e


def rsqrt_gpu(v: float) -> float:
    """The GPU's ``rsqrt.approx.ftz.f32`` of fp32 ``v`` (R §3.3 as vLLM computes it), from
    ``dsv41.core.gpu_approx`` (checked there against the instruction over every input)."""
    from dsv41.core.gpu_approx import rsqrt_approx

    return float(rsqrt_approx(torch.tensor([v], dtype=F32)))


_E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)


def e2m1_code(x: float) -> int:
    """Nearest e2m1 magnitude, ties to the even code, saturating at 6; sign bit kept."""
    a = abs(x)
    best = min(range(8), key=lambda c: (abs(_E2M1[c] - a), c % 2))
    return best | (8 if math.copysign(1.0, x) < 0 else 0)


def _e4m3_table(fnuz: bool) -> list[tuple[float, int]]:
    bias, out = (8 if fnuz else 7), []
    for code in range(0x80):
        e, m = code >> 3, code & 7
        if not fnuz and code == 0x7F:
            continue  # NaN
        v = 2.0 ** (1 - bias) * m / 8 if e == 0 else 2.0 ** (e - bias) * (1 + m / 8)
        out.append((v, code))
    return out


def e4m3_code(x: float, fnuz: bool) -> int:
    """Nearest e4m3 value (RNE: ties to the even code); -0 -> 0x80 (OCP) / 0x00 (FNUZ)."""
    a = abs(x)
    _, code = min(_e4m3_table(fnuz), key=lambda vc: (abs(vc[0] - a), vc[1] % 2))
    neg = math.copysign(1.0, x) < 0
    if neg and not (fnuz and code == 0):
        code |= 0x80
    return code


def mxfp4_scalar(x: list[float]) -> tuple[list[int], list[int]]:
    """§1.8 on a vector of 32k values: packed bytes (low nibble first) and ue8m0 bytes."""
    packed, scales = [], []
    inv6 = f32(Fraction(1, 6))
    for b in range(0, len(x), 32):
        blk = x[b:b + 32]
        amax = max(max(abs(v) for v in blk), 6.0 * 2.0**-126)
        e = max(-127, min(127, ceil_log2_exact(mul32(amax, inv6))))
        scales.append(e + 127)
        codes = [e2m1_code(v * 2.0**-e) for v in blk]
        packed += [codes[i] | (codes[i + 1] << 4) for i in range(0, 32, 2)]
    return packed, scales


def rope_scalar(x: list[float], cos: list[float], sin: list[float]) -> list[float]:
    """§1.2 on consecutive pairs of x (one cos/sin per pair), then RNbf."""
    out = []
    for i, (c, s) in enumerate(zip(cos, sin)):
        e, o = x[2 * i], x[2 * i + 1]
        out += [bf(fma32(e, c, -mul32(o, s))), bf(fma32(o, c, mul32(e, s)))]
    return out


def sum_sq_scalar(k: list[float]) -> float:
    """Σ k² in the Triton order: 32 lanes x 4 contiguous squares, then xor 16, 8, 4, 2, 1."""
    lanes = [0.0] * 32
    for lane in range(32):
        for v in k[4 * lane: 4 * lane + 4]:
            lanes[lane] = f32(Fraction(lanes[lane]) + Fraction(v) ** 2)
    for dist in (16, 8, 4, 2, 1):
        lanes = [f32(Fraction(lanes[i]) + Fraction(lanes[i ^ dist])) for i in range(32)]
    return lanes[0]


def k_store_scalar(k: list[float], w: list[float], eps: float, cos: list[float], sin: list[float]):
    """R §3.3 for one key: returns the post-RoPE bf16-valued vector."""
    var = f32(Fraction(sum_sq_scalar(k)) / 128)
    r = rsqrt_gpu(f32(Fraction(var) + Fraction(f32(Fraction(eps)))))
    kn = [bf(mul32(mul32(v, r), wd)) for v, wd in zip(k, w)]
    nope_pairs = (len(k) - 2 * len(cos)) // 2
    return rope_scalar(kn, [1.0] * nope_pairs + cos, [0.0] * nope_pairs + sin)


def _row(t: torch.Tensor) -> list[float]:
    return [float(v) for v in t.to(F32).flatten()]


# --------------------------------------------------------------------------------------
# Hand-made cases
# --------------------------------------------------------------------------------------

# Tie points of e2m1 and exact codes, for blocks of scale 2^0 (amax 6 in every block).
_TIES = [0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0, 0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 0.125]


def _tie_weight() -> torch.Tensor:
    """k_norm weights that turn a ±1 key into e2m1 ties, at four block scales."""
    blk = torch.tensor(_TIES * 2)
    return torch.cat([blk, blk * 2, blk * 0.5, blk * 4]).to(BF16)


def _cache(num_blocks: int, block_size: int, width: int, pad: int) -> torch.Tensor:
    page = block_size * width + pad
    buf = torch.full((num_blocks * page,), CANARY, dtype=U8)
    return buf.as_strided((num_blocks, block_size, width), (page, width, 1))


def _k_inputs(seed: int, cache_dtype=F32):
    """Keys: a ±1 'ties' key (RMS exactly 1, cos=1/sin=0 row), a zero key, random keys."""
    g = torch.Generator().manual_seed(seed)
    T = 12
    k = torch.randn(T, 128, generator=g) * torch.logspace(-2, 1, T).unsqueeze(-1)
    signs = torch.where(torch.arange(128) % 3 == 0, -1.0, 1.0)
    k[0] = signs  # Σk²/128 = 1 exactly -> r = 1 -> k_norm = ±w (w = _tie_weight)
    k[1] = 0.0  # zero key
    k[2, :64] = -0.0  # -0 NoPE dims next to random partners (finding 2 zero signs)
    k = k.to(BF16)
    positions = torch.tensor([7, 9, 3, 0, 4, 5, 11, 12, 13, 21, 22, 23])
    cos_sin = torch.rand(32, 64, generator=g) * 2 - 1
    cos_sin[6, :32], cos_sin[6, 32:] = 1.0, 0.0  # token 0: group position 6 (CR 2)
    slots = torch.tensor([3, 17, 40, -1, 0, 5, 47, 46, 30, 2, 31, 16])
    return k, positions, cos_sin.to(cache_dtype), slots


def _page_of(cache: torch.Tensor) -> torch.Tensor:
    """Flat bytes of the storage span of a cache view."""
    return _storage_bytes(cache)[cache.storage_offset():]


@pytest.mark.parametrize("cache_dtype", [F32, BF16])
def test_mxfp4_k_store_vs_scalar(cache_dtype):
    k, positions, cos_sin, slots = _k_inputs(1, cache_dtype)
    w = _tie_weight()
    eps = 2.0**-40  # 1 + eps rounds to 1 in fp32: the ties key keeps r = 1 exactly
    B, pad = 16, 24
    cache = _cache(4, B, 68, pad)
    before = _storage_bytes(cache).clone()
    indexer_k_norm_rope_store(k, positions, cos_sin, w, eps, cache, slots, 2, True, 0, False)
    flat = _page_of(cache)
    page = B * 68 + pad
    expect = before.clone()
    for t in range(len(slots)):
        slot, p = int(slots[t]), int(positions[t])
        if slot < 0 or (p + 1) % 2:
            continue
        gp = (p // 2) * 2
        v = k_store_scalar(_row(k[t]), _row(w), eps, _row(cos_sin[gp, :32]), _row(cos_sin[gp, 32:]))
        packed, scales = mxfp4_scalar(v)
        base, o = (slot // B) * page, slot % B
        expect[base + o * 64: base + o * 64 + 64] = torch.tensor(packed, dtype=U8)
        expect[base + B * 64 + o * 4: base + B * 64 + o * 4 + 4] = torch.tensor(scales, dtype=U8)
        if t == 0:  # the ties key: every block amax is a power-of-two multiple of 6
            assert scales == [127, 128, 126, 129]
        if t == 1:  # zero key: scale bytes 1, codes ±0 (RoPE may give -0, finding 2)
            assert scales == [1, 1, 1, 1] and {b & 0x77 for b in packed} == {0}
    bad = torch.nonzero(flat != expect[: flat.numel()]).flatten()
    assert bad.numel() == 0, f"{bad.numel()} bytes differ, first at {bad[:8].tolist()}"


def _q_inputs(seed: int, T=3, H=16, cache_dtype=F32):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(T, H, 128, generator=g) * torch.logspace(-3, 2, T * H).view(T, H, 1)
    q[0, 0, :32] = torch.tensor(_TIES * 2)  # NoPE block 0 of scale 2^0: every e2m1 tie
    q[0, 0, 32:64] = -torch.tensor(_TIES * 2)
    q[0, 1] = 0.0  # zero head
    q[0, 2, :64] = -0.0  # -0 NoPE dims (kept: the Q path does not rotate NoPE)
    q[1, 0, :] = 0.0
    q[1, 0, 5] = 448.0  # amax exactly 448 (OCP scale 2^0, FNUZ 2^1)
    q[1, 1, :] = 0.0
    q[1, 1, 10] = 230.0  # just above 224 (a NoPE dim: not rotated)
    q = q.to(BF16)
    positions = torch.tensor([5, 0, 17])[:T]
    cos_sin = (torch.rand(20, 64, generator=g) * 2 - 1).to(cache_dtype)
    weights = (torch.randn(T, H, generator=g)).to(BF16)
    return positions, q, cos_sin, weights


def _q_scalar_rows(positions, q, cos_sin):
    T, H, D = q.shape
    R = cos_sin.shape[-1]
    for t in range(T):
        p = int(positions[t])
        cos, sin = _row(cos_sin[p, : R // 2]), _row(cos_sin[p, R // 2:])
        for h in range(H):
            x = _row(q[t, h])
            yield t, h, x[: D - R] + rope_scalar(x[D - R:], cos, sin)


@pytest.mark.parametrize("w_dtype", [F32, BF16])
def test_mxfp4_q_vs_scalar(w_dtype):
    positions, q, cos_sin, weights = _q_inputs(2, cache_dtype=BF16)
    T, H, D = q.shape
    q_out = torch.full((T, H, D // 2), CANARY, dtype=U8)
    s_out = torch.full((T, H, D // 32), CANARY, dtype=U8)
    w_out = torch.empty(T, H, dtype=w_dtype)
    sm, hs = 128**-0.5, 0.3
    fused_indexer_q_rope_quant(positions, q, cos_sin, weights, sm, hs, True, False, q_out, s_out, w_out)
    S, Hs = f32(Fraction(sm)), f32(Fraction(hs))
    for t, h, x in _q_scalar_rows(positions, q, cos_sin):
        packed, scales = mxfp4_scalar(x)
        assert q_out[t, h].tolist() == packed, (t, h)
        assert s_out[t, h].tolist() == scales, (t, h)
        want = mul32(mul32(float(weights[t, h]), S), Hs)
        want = bf(want) if w_dtype == BF16 else want
        assert float(w_out[t, h]) == want, (t, h)
    assert s_out[0, 1].tolist() == [1, 1, 1, 1]  # zero head
    assert s_out[0, 0, 0] == 127  # the ties block: amax 6 -> 2^0


@pytest.mark.parametrize("use_fnuz", [False, True])
def test_fp8_q_vs_scalar(use_fnuz):
    positions, q, cos_sin, weights = _q_inputs(3)
    T, H, D = q.shape
    dt = torch.float8_e4m3fnuz if use_fnuz else torch.float8_e4m3fn
    q_out = torch.empty(T, H, D, dtype=dt)
    w_out = torch.empty(T, H, dtype=F32)
    sm, hs = 128**-0.5, 0.3  # not a power of two: pins the left-to-right fold
    fused_indexer_q_rope_quant(
        positions, q, cos_sin, weights, sm, hs, False, use_fnuz, q_out, torch.empty(0, dtype=U8), w_out
    )
    fp8_max = 224.0 if use_fnuz else 448.0
    S, Hs = f32(Fraction(sm)), f32(Fraction(hs))
    for t, h, x in _q_scalar_rows(positions, q, cos_sin):
        amax = max(max(abs(v) for v in x), f32(Fraction(1, 10**4)))
        e = ceil_log2_exact(f32(Fraction(amax) / Fraction(fp8_max)))
        codes = [e4m3_code(v * 2.0**-e, use_fnuz) for v in x]
        assert _bytes(q_out[t, h]).tolist() == codes, (t, h)
        want = mul32(mul32(mul32(float(weights[t, h]), 2.0**e), S), Hs)
        assert float(w_out[t, h]) == want, (t, h)
    dec = q_out.to(F32)
    assert not torch.isnan(dec).any() and dec.abs().max() <= fp8_max
    # Zero head: scale 2^-22 (OCP) / 2^-21 (FNUZ) folded into the weight.
    e0 = -21 if use_fnuz else -22
    assert float(w_out[0, 1]) == mul32(mul32(mul32(float(weights[0, 1]), 2.0**e0), S), Hs)
    # amax exactly 448: OCP keeps 2^0 (code 448), FNUZ takes 2^1 (code 224 = 0x7E in both).
    assert _bytes(q_out[1, 0, 5]).item() == 0x7E
    assert float(q_out[1, 0, 5].float()) == fp8_max
    # Just above 224: FNUZ takes 2^1 (115 -> 112), OCP keeps 2^0 (230 -> 224).
    assert float(q_out[1, 1, 10].float()) == (112.0 if use_fnuz else 224.0)
    if use_fnuz:  # FNUZ has no -0: -0 NoPE dims encode as 0x00
        assert set(_bytes(q_out[0, 2, :64]).tolist()) == {0}
    else:
        assert set(_bytes(q_out[0, 2, :64]).tolist()) == {0x80}


def test_rope_canonical_contraction():
    """§1.2 on fp32 values (before the bf16 round trip hides most of the difference)."""
    from dsv41.reference.indexer import _rope_pairs

    g = torch.Generator().manual_seed(5)
    x = torch.randn(64, 64, generator=g) * torch.logspace(-3, 3, 64).unsqueeze(-1)
    cs = torch.rand(64, 64, generator=g) * 2 - 1
    got = _rope_pairs(x, cs[:, :32], cs[:, 32:])
    unfused = 0
    for r in range(x.shape[0]):
        xr, c, s = _row(x[r]), _row(cs[r, :32]), _row(cs[r, 32:])
        for i in range(32):
            e, o = xr[2 * i], xr[2 * i + 1]
            want = (fma32(e, c[i], -mul32(o, s[i])), fma32(o, c[i], mul32(e, s[i])))
            assert (float(got[r, 2 * i]), float(got[r, 2 * i + 1])) == want, (r, i)
            unfused += want[0] != f32(Fraction(mul32(e, c[i])) - Fraction(mul32(o, s[i])))
    assert unfused > 0  # the inputs do tell the fused form from the unfused one


def test_variance_summation_order():
    """R §3.3 variance: the H200 Triton order (the spec leaves it open; gpu_approx.tl_sum_sq)."""
    from dsv41.core.gpu_approx import tl_sum_sq

    g = torch.Generator().manual_seed(6)
    k = (torch.randn(32, 128, generator=g) * torch.logspace(-4, 4, 128)).to(BF16).to(F32)
    got = tl_sum_sq(k, warps=1, per_thread=4)
    differs_from_exact = 0
    for r in range(k.shape[0]):
        row = _row(k[r])
        assert float(got[r]) == sum_sq_scalar(row), r
        differs_from_exact += float(got[r]) != f32(sum(Fraction(v) ** 2 for v in row))
    assert differs_from_exact > 0  # the inputs do tell the order from a correctly rounded sum


def test_zero_key_fp8_scale():
    k = torch.zeros(2, 128, dtype=BF16)
    cache = _cache(1, 16, 132, 8)
    indexer_k_norm_rope_store(
        k, torch.tensor([0, 1]), torch.rand(4, 64), torch.ones(128, dtype=BF16), 1e-6,
        cache, torch.tensor([3, -1]), 1, False, 0, False,
    )
    flat = _page_of(cache)
    # cos, sin >= 0 here, so every rotated zero stays +0 (code 0x00).
    assert flat[3 * 128: 4 * 128].tolist() == [0] * 128
    scale = flat[16 * 128 + 12: 16 * 128 + 16]
    assert scale.tolist() == list(struct.pack("<f", 2.0**-22))  # 00 00 80 34
    touched = set(range(3 * 128, 4 * 128)) | set(range(16 * 128 + 12, 16 * 128 + 16))
    untouched = [i for i in range(flat.numel()) if i not in touched]
    assert all(v == CANARY for v in flat[untouched].tolist())


def _fp8_tiled_pos(o: int, d: int) -> int:
    """R §3.4 ROCm FP8 tile: [P/16][128/16][16 tokens][16 bytes]."""
    return (o // 16) * (16 * 128) + (d // 16) * 256 + (o % 16) * 16 + (d % 16)


def _mxfp4_tiled_pos(o: int, b: int, n: int) -> int:
    return (o // n) * (n * 64) + (b // 16) * (n * 16) + (o % n) * 16 + (b % 16)


def _mxfp4_tiled_scale(o: int, s: int, n: int) -> int:
    s_lo = 64 // n
    s_hi = 4 // s_lo
    return (o // n) * (n * 4) + (s % s_lo) * (n * s_hi) + (o % n) * s_hi + s // s_lo


@pytest.mark.parametrize("fmt", ["fp8", "mxfp4_16", "mxfp4_32", "mxfp4_64"])
def test_tiled_layout_is_row_major_permuted(fmt):
    """ROCm tiled pages = the row-major pages with every byte moved per R §3.4."""
    use_fp4 = fmt != "fp8"
    n = int(fmt.split("_")[1]) if use_fp4 else 0
    vb, width = (64, 68) if use_fp4 else (128, 132)
    B, pad, nb = 64, 40, 3
    g = torch.Generator().manual_seed(4)
    T = 70
    k = (torch.randn(T, 128, generator=g) * 3).to(BF16)
    positions = torch.arange(T)
    slots = torch.randperm(nb * B, generator=g)[:T]
    slots[::9] = -1
    cos_sin = torch.rand(T, 64, generator=g) * 2 - 1
    w = (torch.rand(128, generator=g) + 0.5).to(BF16)
    caches = {}
    for tiled in (False, True):
        cache = _cache(nb, B, width, pad)
        indexer_k_norm_rope_store(k, positions, cos_sin, w, 1e-6, cache, slots, 1, use_fp4, n, tiled)
        caches[tiled] = _page_of(cache)
    row, til = caches[False], caches[True]
    page = B * width + pad
    expect = torch.full_like(row, CANARY)
    written = {int(s) for s in slots if s >= 0}
    for slot in written:
        base, o = (slot // B) * page, slot % B
        for byte in range(vb):
            pos = _mxfp4_tiled_pos(o, byte, n) if use_fp4 else _fp8_tiled_pos(o, byte)
            expect[base + pos] = row[base + o * vb + byte]
        for s in range(4):
            pos = _mxfp4_tiled_scale(o, s, n) if use_fp4 else o * 4 + s
            expect[base + B * vb + pos] = row[base + B * vb + o * 4 + s]
    assert torch.equal(til, expect)
    if fmt == "mxfp4_64":  # N = 64 keeps the row-major scale order
        for slot in written:
            base, o = (slot // B) * page, slot % B
            assert torch.equal(til[base + B * 64 + o * 4: base + B * 64 + o * 4 + 4],
                               row[base + B * 64 + o * 4: base + B * 64 + o * 4 + 4])


def test_empty_batch():
    cache = _cache(2, 16, 132, 0)
    before = _storage_bytes(cache).clone()
    indexer_k_norm_rope_store(
        torch.empty(0, 128, dtype=BF16), torch.empty(0, dtype=torch.int64), torch.rand(4, 64),
        torch.ones(128, dtype=BF16), 1e-6, cache, torch.empty(0, dtype=torch.int64), 1, False, 0, False,
    )
    assert torch.equal(_storage_bytes(cache), before)
    q = torch.empty(0, 8, 128, dtype=BF16)
    for use_fp4 in (False, True):
        q_out = torch.empty(0, 8, 64 if use_fp4 else 128, dtype=U8 if use_fp4 else torch.float8_e4m3fn)
        s_out = torch.empty(0, 8, 4, dtype=U8) if use_fp4 else torch.empty(0, dtype=U8)
        fused_indexer_q_rope_quant(
            torch.empty(0, dtype=torch.int64), q, torch.rand(4, 64), torch.empty(0, 8, dtype=BF16),
            0.1, 0.125, use_fp4, False, q_out, s_out, torch.empty(0, 8, dtype=F32),
        )


def test_no_writer_tokens():
    """CR 2 with only odd-length groups open: nothing is written (poison rows never read)."""
    cache = _cache(1, 16, 132, 4)
    before = _storage_bytes(cache).clone()
    k = torch.full((3, 128), float("nan"), dtype=BF16)
    indexer_k_norm_rope_store(
        k, torch.tensor([0, 2, 4]), torch.rand(8, 64), torch.ones(128, dtype=BF16), 1e-6,
        cache, torch.tensor([0, 1, 2]), 2, False, 0, False,
    )
    assert torch.equal(_storage_bytes(cache), before)
