"""Reference of the output / query quantizers (R §4, §5, §6.3) and the FlashMLA permutations (R §6).

* every golden ``fused_inv_rope_fp8_quant`` case of vllm-sm90.tar.xz, byte for byte over the full
  backing storage of both outputs;
* ``permuted_output`` = the standard output permuted by ``o_fused_permutation``;
* the (L) scale exponent and the ±448 clamp of §4.3;
* ``fused_q_kv_rmsnorm_quant`` against an independent per-row scalar check (numpy fp32);
* ``pad_fused_q_heads``; the permutations and their weight appliers.
"""

from __future__ import annotations

import io
import math
import os
import struct
import tarfile
from pathlib import Path

import numpy as np
import pytest
import torch

import golden  # noqa: E402  (tests/ is on sys.path)

from dsv41.core.codecs import bit_ceil_log2, ceil_log2, inv_const
from dsv41.fused_layout import (
    apply_o_fused_permutation,
    apply_q_fused_permutation,
    o_fused_chunk_permutation,
    o_fused_permutation,
    q_fused_permutation,
)
from dsv41.reference.output_quant import (
    _flashinfer_ue8m0,
    fused_inv_rope_fp8_quant,
    fused_q_kv_rmsnorm_quant,
    pad_fused_q_heads,
)

REPO = Path(__file__).resolve().parents[1]
VECTORS = str(golden.ARCHIVE)  # tests/vectors (DSV41_VECTORS overrides)
OP = "fused_inv_rope_fp8_quant"


# --------------------------------------------------------------------------- helpers


def storage_bytes(t: torch.Tensor) -> torch.Tensor:
    """All bytes of t's backing storage, as a flat uint8 tensor."""
    st = t.untyped_storage()
    return torch.empty(0, dtype=torch.uint8).set_(st, 0, (st.nbytes(),), (1,))


def inv_rope_buffers(T, G, HG, Dh, qgs, tma, quantize, val_dtype, fill=0xA5):
    """Backing buffers as the public op allocates them (kernel contract), filled with a canary."""
    Dg = HG * Dh
    S = Dg // qgs
    Ta = (T + 3) // 4 * 4 if quantize else T
    K = ((S + 3) // 4 if tma else S) if quantize else 0
    out_buf = torch.empty(G, T, Dg, dtype=torch.float8_e4m3fn if quantize else val_dtype)
    scale_buf = torch.empty(G, K * Ta, dtype=torch.int32 if tma else torch.float32)
    out_buf.view(torch.uint8).fill_(fill)
    if scale_buf.numel():
        scale_buf.view(torch.uint8).fill_(fill)
    return out_buf, scale_buf, K, Ta


def public_scales(scale_buf, T, G, K, Ta):
    """The [T, G, K] view the public op returns: [G, T, K] strides (K·Ta, 1, Ta), transposed."""
    return scale_buf.as_strided((G, T, K), (K * Ta, 1, Ta)).transpose(0, 1)


def run_inv_rope(o, positions, cache, G, HG, nope, rope, qgs, tma, quantize, permuted):
    T, _, Dh = o.shape
    out_buf, scale_buf, K, Ta = inv_rope_buffers(T, G, HG, Dh, qgs, tma, quantize, o.dtype)
    ret = fused_inv_rope_fp8_quant(
        o, positions, cache, G, HG, nope, rope, qgs, tma, quantize, permuted, out_buf, scale_buf
    )
    assert ret is None
    return out_buf, scale_buf, K, Ta


def unpack_scale_bytes(scale_buf, G, K, Ta):
    """int32 packed ue8m0 -> bytes [G, Ta, 4K] (block 4k+b = byte b of word k)."""
    words = scale_buf.view(G, K, Ta).permute(0, 2, 1).reshape(G * Ta * K)
    return words.view(torch.uint8).view(G, Ta, 4 * K)


def random_o(T, NH, Dh, seed):
    g = torch.Generator().manual_seed(seed)
    # per-32-dim group magnitudes 2^-6 .. 2^6, like the vectors' "normal" rows
    mag = torch.exp2(torch.randint(-6, 7, (T, NH, Dh // 32, 1), generator=g).float())
    x = torch.randn(T, NH, Dh // 32, 32, generator=g) * mag
    return x.view(T, NH, Dh).to(torch.bfloat16)


def random_cache(max_pos, rope, seed):
    g = torch.Generator().manual_seed(seed)
    theta = torch.rand(max_pos, rope // 2, generator=g, dtype=torch.float64) * 2 * math.pi
    return torch.cat((theta.cos(), theta.sin()), dim=1).float()


# --------------------------------------------------------------------------- golden vectors


def _golden_cases():
    if not os.path.exists(VECTORS):
        return {}
    cases = {}
    with tarfile.open(VECTORS, "r:xz") as tf:
        for m in tf.getmembers():
            if not m.isfile() or not m.name.endswith(".pt"):
                continue
            raw = tf.extractfile(m).read()
            case = torch.load(io.BytesIO(raw), weights_only=True)
            if case["op"] == OP:
                cases[Path(m.name).stem] = case
    return cases


_CASES = _golden_cases()
_CASE_PARAMS = sorted(_CASES) or [
    pytest.param(None, marks=pytest.mark.skip(reason=f"golden vectors not found at {VECTORS} (set DSV41_VECTORS)"))
]


def test_golden_cases_present():
    if not _CASES:
        pytest.skip(f"golden vectors not found at {VECTORS} (set DSV41_VECTORS)")
    assert {"inv_rope_fp32scales", "inv_rope_tma", "inv_rope_noquant",
            "inv_rope_qgs32_fp32scales", "inv_rope_permuted"} <= set(_CASES)


@pytest.mark.parametrize("name", _CASE_PARAMS)
def test_inv_rope_golden(name):
    case = _CASES[name]
    a, gold = case["args"], case["out"]
    o = a["o"]
    T, NH, Dh = o.shape
    G, HG, qgs = a["n_groups"], a["heads_per_group"], a["quant_group_size"]
    tma, quantize = a["tma_aligned_scales"], a["quantize"]
    out_buf, scale_buf, K, Ta = run_inv_rope(
        o, a["positions"], a["cos_sin_cache"], G, HG, a["nope_dim"], a["rope_dim"], qgs,
        tma, quantize, a["permuted_output"],
    )

    # values: the public view is out_buf.transpose(0, 1)
    output = out_buf.transpose(0, 1)
    g_out = gold["output"]
    assert output.dtype == g_out.dtype
    assert (output.shape, output.stride(), output.storage_offset()) == (
        g_out.shape, g_out.stride(), g_out.storage_offset())
    mine, ref = storage_bytes(output), storage_bytes(g_out)
    assert mine.numel() == ref.numel()
    bad = (mine != ref).nonzero().flatten()
    assert bad.numel() == 0, f"{name}: {bad.numel()} value bytes differ, first at {bad[:8].tolist()}"

    # scales
    g_sc = gold["scales"]
    if quantize:
        scales = public_scales(scale_buf, T, G, K, Ta)
        assert scales.dtype == g_sc.dtype
        assert (scales.shape, scales.stride(), scales.storage_offset()) == (
            g_sc.shape, g_sc.stride(), g_sc.storage_offset())
    else:
        assert scale_buf.shape == (G, 0) and g_sc.numel() == 0
    mine, ref = storage_bytes(scale_buf), storage_bytes(g_sc)
    assert mine.numel() == ref.numel()
    bad = (mine != ref).nonzero().flatten()
    assert bad.numel() == 0, f"{name}: {bad.numel()} scale bytes differ, first at {bad[:8].tolist()}"


# --------------------------------------------------------------------------- §4 properties


@pytest.mark.parametrize("T,HG", [(7, 8), (4, 4), (1, 2)])
def test_permuted_output_is_o_fused_permutation(T, HG):
    G, Dh, nope, rope, qgs = 2, 512, 448, 64, 32
    o = random_o(T, G * HG, Dh, seed=T * 10 + HG)
    cache = random_cache(64, rope, seed=3)
    pos = torch.randint(0, 64, (T,), generator=torch.Generator().manual_seed(5))
    std_out, std_sc, K, Ta = run_inv_rope(o, pos, cache, G, HG, nope, rope, qgs, True, True, False)
    prm_out, prm_sc, K2, Ta2 = run_inv_rope(o, pos, cache, G, HG, nope, rope, qgs, True, True, True)
    assert (K, Ta) == (K2, Ta2)

    perm = o_fused_permutation(HG, Dh, qgs)
    chunk_perm = o_fused_chunk_permutation(HG, Dh, qgs)
    assert torch.equal(prm_out.view(torch.uint8), std_out.view(torch.uint8)[:, :, perm])

    std_b = unpack_scale_bytes(std_sc, G, K, Ta)
    prm_b = unpack_scale_bytes(prm_sc, G, K, Ta)
    assert torch.equal(prm_b, std_b[:, :, chunk_perm])
    assert not prm_b[:, T:].any()  # padding rows zero
    assert prm_b[:, :T].min() > 0  # every real block has a ue8m0 byte (E >= -42)


def test_inv_rope_layouts_agree():
    """fp32 scales, packed ue8m0 and the unquantized output describe the same numbers."""
    T, G, HG, Dh, nope, rope = 6, 3, 2, 512, 448, 64
    o = random_o(T, G * HG, Dh, seed=11)
    cache = random_cache(32, rope, seed=12)
    pos = torch.tensor([0, 31, 7, 7, 2, 19])
    for qgs in (32, 64, 128):
        f_out, f_sc, K, Ta = run_inv_rope(o, pos, cache, G, HG, nope, rope, qgs, False, True, False)
        p_out, p_sc, Kp, _ = run_inv_rope(o, pos, cache, G, HG, nope, rope, qgs, True, True, False)
        assert torch.equal(f_out.view(torch.uint8), p_out.view(torch.uint8))
        fsc = f_sc.view(G, K, Ta)
        assert not fsc[:, :, T:].any()
        e_bytes = ((fsc.view(torch.int32) >> 23) & 0xFF).to(torch.uint8).permute(0, 2, 1)
        assert torch.equal(unpack_scale_bytes(p_sc, G, Kp, Ta)[:, :, :K], e_bytes)

    # quantize=False: RNbf of the fp32 rotation, and dequantized fp8 is close to it
    n_out, n_sc, _, _ = run_inv_rope(o, pos, cache, G, HG, nope, rope, 128, False, False, False)
    assert n_out.dtype == torch.bfloat16 and n_sc.shape == (G, 0)
    # NoPE dims are copied unchanged
    std = n_out.transpose(0, 1).reshape(T, G * HG, Dh)
    assert torch.equal(std[:, :, :nope].view(torch.int16), o[:, :, :nope].view(torch.int16))
    scale = fsc.view(G, HG, Dh // 128, Ta)[..., :T].permute(0, 3, 1, 2).unsqueeze(-1)
    deq = f_out.float().view(G, T, HG, Dh // 128, 128) * scale
    ref = n_out.float().view(G, T, HG, Dh // 128, 128)
    # e4m3: half an ulp is 2^-4 relative (normal) or 2^-10·scale (subnormal); plus bf16 rounding
    assert ((deq - ref).abs() <= ref.abs() * (2 ** -4 + 2 ** -8) + scale * 2 ** -10).all()


def test_inv_rope_log_ceil_and_clamp():
    """§4.3: E = ceil(RN32(log2 s)) (L), not the bit-ceil (B); the ±448 clamp then saturates."""
    A = torch.tensor(0.4375, dtype=torch.float32)  # 448·2^-10
    A = torch.nextafter(A, torch.tensor(1.0))  # one ulp above
    s = A * inv_const(448.0)
    assert ceil_log2(s).item() == -10 and bit_ceil_log2(s).item() == -9  # the (L)/(B) split
    T, G, HG, Dh, nope, rope, qgs = 1, 1, 1, 512, 448, 64, 32
    o = torch.zeros(T, 1, Dh, dtype=torch.bfloat16)
    o[0, 0, nope] = 1.0  # even lane of rope pair 0, partner 0
    o[0, 0, nope + 2] = -0.25
    cache = torch.zeros(1, rope)
    cache[0, : rope // 2] = A  # cos = A, sin = 0 -> rotated even lane = A exactly
    out_buf, scale_buf, K, Ta = run_inv_rope(o, torch.tensor([0]), cache, G, HG, nope, rope, qgs,
                                             False, True, False)
    chunk = nope // qgs  # rope pair 0 starts chunk 14
    assert scale_buf.view(G, K, Ta)[0, chunk, 0].item() == 2.0 ** -10
    codes = out_buf.view(torch.uint8)[0, 0]
    assert codes[nope].item() == 0x7E  # A/2^-10 = 448.06… clamped to 448
    assert out_buf[0, 0, nope + 2].float().item() == -112.0  # -0.25·A·2^10 = -112.0000076 -> RNE
    # an all-zero chunk: amax floor 1e-10 -> E = ceil(log2(1e-10/448)) = -42, codes 0
    assert scale_buf.view(G, K, Ta)[0, 0, 0].item() == 2.0 ** -42
    assert not codes[:nope].any()
    assert not scale_buf.view(G, K, Ta)[:, :, T:].any()


# (e bf16, o bf16, cos fp32, sin fp32, lane, bf16 of the §1.3 fused form, bf16 of the unfused form);
# the fused results were cross-checked with exact rational arithmetic.
_CONTRACTION_CASES = [
    (0xBE96, 0x3F94, 0xBF782807, 0xBE7B896B, 0, 0xB7FF, 0xB800),
    (0x3E54, 0x3ECF, 0xBF62DE38, 0x3EED3535, 0, 0x3B7B, 0x3B7C),
    (0x3F88, 0x3E99, 0xBF2DCDE5, 0x3F3BF528, 0, 0xBF01, 0xBF00),
    (0x3F7D, 0x3FB4, 0xBF1330BA, 0xBF51743D, 1, 0x3857, 0x3856),
    (0xBF3C, 0xBFB1, 0x3EF01A5A, 0x3F621AFB, 1, 0x3919, 0x391A),
    (0x3F8E, 0xBEDA, 0x3F6EFCE2, 0xBEB787B1, 1, 0x3939, 0x393A),
]


def test_inv_rope_contraction():
    """§1.3: e' = fma(e, c, RN32(o·s)), o' = fma(o, c, −RN32(e·s)), visible after RNbf (quantize=False)."""
    T, Dh, nope, rope = len(_CONTRACTION_CASES), 512, 448, 64

    def as_f32(b):
        return torch.tensor(b, dtype=torch.int64).to(torch.int32).view(torch.float32)

    def as_bf16(b):
        return torch.tensor(b - (1 << 16) if b >= 1 << 15 else b, dtype=torch.int16).view(torch.bfloat16)

    o = torch.zeros(T, 1, Dh, dtype=torch.bfloat16)
    cache = torch.zeros(T, rope)
    for t, (e, od, c, s, _, _, _) in enumerate(_CONTRACTION_CASES):
        o[t, 0, nope], o[t, 0, nope + 1] = as_bf16(e), as_bf16(od)
        cache[t, 0], cache[t, rope // 2] = as_f32(c), as_f32(s)
    out_buf, _, _, _ = run_inv_rope(o, torch.arange(T), cache, 1, 1, nope, rope, 128,
                                    False, False, False)
    bits = out_buf.view(torch.int16).to(torch.int32) & 0xFFFF
    for t, (*_, lane, fused, unfused) in enumerate(_CONTRACTION_CASES):
        assert bits[0, t, nope + lane].item() == fused != unfused, t


def test_inv_rope_nonfinite_decisions():
    """Outside the contract; mirrors upstream finding 3: NaN ignored by the amax, every NaN
    that reaches the clamp is the canonical +NaN -> 0x7E; inf gives scale inf / ue8m0 255."""
    T, G, HG, Dh, nope, rope, qgs = 1, 1, 1, 512, 448, 64, 128
    o = torch.zeros(T, 1, Dh, dtype=torch.bfloat16)
    o[0, 0, 0] = float("nan")
    o[0, 0, 1] = 3.0
    o[0, 0, 128] = float("-inf")
    o[0, 0, 129] = 5.0
    cache = random_cache(1, rope, seed=1)
    out_buf, scale_buf, K, Ta = run_inv_rope(o, torch.tensor([0]), cache, G, HG, nope, rope, qgs,
                                             False, True, False)
    codes = out_buf.view(torch.uint8)[0, 0]
    sc = scale_buf.view(G, K, Ta)[0, :, 0]
    assert sc[0].item() == 2.0 ** -7  # amax 3 (NaN ignored): ceil(log2(3/448)) = -7
    assert codes[0].item() == 0x7E and codes[1].item() == 0x7C  # 3·2^7 = 384 = 1.5·2^8
    assert sc[1].item() == float("inf")
    assert codes[128].item() == 0x7E and codes[129].item() == 0x00
    _, p_sc, Kp, Tap = run_inv_rope(o, torch.tensor([0]), cache, G, HG, nope, rope, qgs,
                                    True, True, False)
    assert unpack_scale_bytes(p_sc, G, Kp, Tap)[0, 0, :2].tolist() == [120, 255]
    n_out, _, _, _ = run_inv_rope(o, torch.tensor([0]), cache, G, HG, nope, rope, qgs,
                                  False, False, False)
    assert n_out.view(torch.int16)[0, 0, 0].item() == 0x7FFF


# --------------------------------------------------------------------------- §5 independent check


def f32(x) -> np.float32:
    return np.float32(x)


def f32_bits(x: np.float32) -> int:
    return struct.unpack("<I", struct.pack("<f", float(x)))[0]


def bits_f32(b: int) -> np.float32:
    return np.float32(struct.unpack("<f", struct.pack("<I", b & 0xFFFFFFFF))[0])


def rne_bf16(x: np.float32) -> np.float32:
    b = f32_bits(x)
    b = (b + 0x7FFF + ((b >> 16) & 1)) >> 16
    return bits_f32(b << 16)


# positive e4m3fn values of codes 0..126 (0x7F is NaN)
_E4M3 = [(c >> 3, c & 7) for c in range(127)]
_E4M3 = [(2.0 ** -6) * m / 8 if e == 0 else (2.0 ** (e - 7)) * (1 + m / 8) for e, m in _E4M3]


def e4m3_slow(v: float) -> int:
    sign = 0x80 if math.copysign(1.0, v) < 0 else 0
    a = abs(v)
    if a >= 448:
        return sign | 0x7E
    best = min(range(127), key=lambda c: (abs(_E4M3[c] - a), c & 1))  # nearest, ties to even
    return sign | best


def ue8m0_slow(n: np.float32) -> int:
    if n <= 0:
        return 0
    b = f32_bits(n)
    e, m = (b >> 23) & 0xFF, b & 0x7FFFFF
    bump = 1 if (m != 0 and not (e == 0 and m <= 0x400000)) else 0
    return min(e + bump, 254)


def rmsnorm_row_slow(x, w, eps):
    ms = math.fsum(float(v) * float(v) for v in x) / len(x)
    ms = f32(f32(ms) + f32(eps))
    rrms = f32(1.0 / math.sqrt(float(ms)))
    return [f32(f32(f32(v) * rrms) * f32(wi)) for v, wi in zip(x, w)]


def swizzle_slow(r, j, Gp):
    tile, rr = divmod(r, 128)
    return tile * 128 * Gp + (j // 4) * 512 + (rr % 32) * 16 + (rr // 32) * 4 + (j % 4)


def test_flashinfer_ue8m0_rule():
    cases = [0.0, -0.0, 2.0 ** -126, 1.5, 1.0, 448.0, float("inf"), 3.0e38,
             bits_f32(0x00400000), bits_f32(0x00400001), bits_f32(0x00000001), bits_f32(0x007FFFFF),
             bits_f32(0x7F000001), bits_f32(0x7F7FFFFF)]
    n = torch.tensor([float(c) for c in cases], dtype=torch.float32)
    got = _flashinfer_ue8m0(n).tolist()
    assert got == [ue8m0_slow(f32(c)) for c in cases]
    assert got[8:12] == [0, 1, 0, 1] and got[6] == 254 and got[-1] == 254


@pytest.mark.parametrize("T,Qs,Ks", [(130, 192, 64), (3, 256, 96), (1, 32, 32)])
def test_q_kv_rmsnorm_quant_slow(T, Qs, Ks):
    g = torch.Generator().manual_seed(T + Qs)
    eps = 1e-6
    qr = (torch.randn(T, Qs, generator=g) * torch.exp2(torch.randint(-8, 8, (T, 1), generator=g).float()))
    kv = torch.randn(T, Ks, generator=g) * 3
    qr[0] = 0.0  # zero row: sf 0, inverse 0, codes 0
    if T > 2:
        qr[2, : Qs // 2] = 0.0
    q_weight = (torch.rand(Qs, generator=g) + 0.5)
    if Qs >= 96:
        q_weight[64:96] = 1e-37  # a group whose n is fp32-subnormal (e == 0 branch)
    kv_weight = torch.rand(Ks, generator=g) + 0.5
    qr, kv = qr.bfloat16(), kv.bfloat16()
    q_weight, kv_weight = q_weight.bfloat16(), kv_weight.bfloat16()

    Gq = Qs // 32
    Tp, Gp = (T + 127) // 128 * 128, (Gq + 3) // 4 * 4
    q_out = torch.empty(T, Qs, dtype=torch.float8_e4m3fn)
    q_out.view(torch.uint8).fill_(0xA5)
    q_scale_out = torch.full((Tp * Gp,), 0xA5, dtype=torch.uint8)
    kv_out = torch.full((T, Ks), float("nan"), dtype=torch.bfloat16)
    ret = fused_q_kv_rmsnorm_quant(qr, kv, q_weight, kv_weight, eps, q_out, q_scale_out, kv_out)
    assert ret is None

    # sampled rows against the slow reference; every pad scale byte 0 (below)
    rows = sorted({0, 1, 2, T // 2, T - 1} & set(range(T)))
    qb = q_out.view(torch.uint8)
    wq = [float(v) for v in q_weight.float()]
    wk = [float(v) for v in kv_weight.float()]
    for r in rows:
        y = [rne_bf16(v) for v in rmsnorm_row_slow(qr[r].float().tolist(), wq, eps)]
        for j in range(Gq):
            grp = y[32 * j: 32 * j + 32]
            sf = ue8m0_slow(f32(max(abs(v) for v in grp)) * f32(1.0 / 448.0))
            inv = f32(0.0) if sf == 0 else bits_f32((254 - sf) << 23)
            assert q_scale_out[swizzle_slow(r, j, Gp)].item() == sf, (r, j)
            codes = [e4m3_slow(float(f32(v * inv))) for v in grp]
            assert qb[r, 32 * j: 32 * j + 32].tolist() == codes, (r, j)
        ky = [rne_bf16(v) for v in rmsnorm_row_slow(kv[r].float().tolist(), wk, eps)]
        assert kv_out[r].float().tolist() == [float(v) for v in ky], r
    # zero row
    assert not qb[0].any()
    # pads: rows >= T and groups >= Gq are 0; the swizzle is a bijection over the buffer
    pos = [swizzle_slow(r, j, Gp) for r in range(Tp) for j in range(Gp)]
    assert sorted(pos) == list(range(Tp * Gp))
    for r in range(Tp):
        for j in range(Gp):
            if r >= T or j >= Gq:
                assert q_scale_out[swizzle_slow(r, j, Gp)].item() == 0, (r, j)
    assert not torch.isnan(kv_out.float()).any()
    if Qs >= 96 and T > 1:
        assert 0 <= q_scale_out[swizzle_slow(1, 2, Gp)].item() <= 1  # fp32-subnormal n


# --------------------------------------------------------------------------- §6.3


@pytest.mark.parametrize("H,Hp", [(5, 16), (16, 32), (16, 16)])
def test_pad_fused_q_heads(H, Hp):
    T, D = 3, 512
    g = torch.Generator().manual_seed(H)
    big = torch.randn(T, H + 1, D, generator=g).bfloat16()
    q = big[:, :H]  # token stride (H+1)·512: not contiguous across tokens
    out = torch.empty(T, Hp, D, dtype=torch.bfloat16)
    out.view(torch.int16).fill_(-8531)  # 0xDEAD canary
    assert pad_fused_q_heads(q, out) is None
    qi = q.reshape(T, H * D).view(torch.int16)
    oi = out.view(T, Hp * D).view(torch.int16)
    c = torch.arange(32).view(-1, 1, 1)
    h = torch.arange(Hp).view(1, -1, 1)
    j = torch.arange(16).view(1, 1, -1)
    dst = (c * (Hp * 16) + h * 16 + j)
    src = (c * (H * 16) + h.clamp(max=H - 1) * 16 + j)
    real = (h < H).expand_as(dst)
    assert torch.equal(oi[:, dst[real]], qi[:, src[real]])
    assert not oi[:, dst[~real]].any()
    assert oi.numel() == dst.numel() * T


# --------------------------------------------------------------------------- §6.1 / §6.2


@pytest.mark.parametrize("H", [1, 4, 16, 128])
def test_q_fused_permutation(H):
    perm = q_fused_permutation(H)
    assert perm.dtype == torch.long and perm.numel() == H * 512
    assert torch.equal(perm.sort().values, torch.arange(H * 512))
    # fused = standard[perm]: fused[(d//16)·(H·16) + h·16 + d%16] = standard[h·512 + d]
    standard = torch.arange(H * 512) * 7 + 3
    fused = standard[perm]
    for h in {0, H // 2, H - 1}:
        for d in (0, 15, 16, 100, 511):
            assert fused[(d // 16) * (H * 16) + h * 16 + d % 16] == standard[h * 512 + d]
    assert torch.equal(q_fused_permutation(H, 64, 8), q_fused_permutation(H, head_dim=64, chunk=8))


@pytest.mark.parametrize("G", [1, 4, 8])
def test_o_fused_permutation(G):
    perm = o_fused_permutation(G)
    assert torch.equal(perm.sort().values, torch.arange(G * 512))
    standard = torch.arange(G * 512) * 5 + 1
    fused = standard[perm]
    for h in range(G):
        for c in range(16):
            for j in (0, 31):
                assert fused[(c * G + h) * 32 + j] == standard[h * 512 + c * 32 + j]
    chunk_perm = o_fused_chunk_permutation(G)
    assert torch.equal(chunk_perm, perm[::32] // 32)
    assert torch.equal(chunk_perm.sort().values, torch.arange(G * 16))
    p = torch.arange(G * 16)
    assert torch.equal(chunk_perm, (p % G) * 16 + p // G)  # fused chunk c·G+h <- standard h·16+c


def test_apply_q_fused_permutation_fp8():
    H, K = 4, 64
    g = torch.Generator().manual_seed(0)
    w = torch.randint(0, 256, (H * 512, K), generator=g, dtype=torch.uint8).view(torch.float8_e4m3fn)
    s = torch.randint(0, 256, (H * 512, K // 32), generator=g, dtype=torch.uint8)
    nw, ns = apply_q_fused_permutation(w, s, H)
    perm = q_fused_permutation(H)
    assert nw.dtype == torch.float8_e4m3fn and ns.dtype == torch.uint8
    assert torch.equal(nw.view(torch.uint8), w.view(torch.uint8)[perm])  # NaN bytes kept
    assert torch.equal(ns, s[perm])
    nw2, ns2 = apply_q_fused_permutation(w, None, H)
    assert ns2 is None and torch.equal(nw2.view(torch.uint8), nw.view(torch.uint8))


def test_apply_o_fused_permutation():
    G, N = 8, 6
    g = torch.Generator().manual_seed(1)
    w = torch.randint(0, 256, (N, G * 512), generator=g, dtype=torch.uint8).view(torch.float8_e4m3fn)
    s = torch.rand(N, G * 16, generator=g)
    nw, ns = apply_o_fused_permutation(w, s, G)
    perm, chunk_perm = o_fused_permutation(G), o_fused_chunk_permutation(G)
    assert torch.equal(nw.view(torch.uint8), w.view(torch.uint8)[:, perm])
    assert torch.equal(ns.view(torch.int32), s.view(torch.int32)[:, chunk_perm])
    # bf16 weights move bit for bit too (including NaN payloads)
    wb = torch.randint(-32768, 32767, (N, G * 512), generator=g, dtype=torch.int16).view(torch.bfloat16)
    nb, _ = apply_o_fused_permutation(wb, None, G)
    assert torch.equal(nb.view(torch.int16), wb.view(torch.int16)[:, perm])
    # the permuted weight consumes the permuted activation: same dot products
    x = torch.randn(3, G * 512, dtype=torch.float64)
    wd = torch.randn(N, G * 512, dtype=torch.float64)
    nd, _ = apply_o_fused_permutation(wd, None, G)
    assert torch.allclose(x[:, perm] @ nd.T, x @ wd.T)


@pytest.mark.parametrize(
    "call, exc, words",
    [
        (lambda: q_fused_permutation("4"), TypeError, ["q_fused_permutation", "num_heads", "int", "str"]),
        (lambda: q_fused_permutation(True), TypeError, ["q_fused_permutation", "num_heads"]),
        (lambda: q_fused_permutation(0), ValueError, ["q_fused_permutation", "num_heads", ">= 1", "0"]),
        (lambda: q_fused_permutation(4, head_dim=500), ValueError, ["q_fused_permutation", "head_dim", "500"]),
        (lambda: o_fused_permutation(-1), ValueError, ["o_fused_permutation", "heads_per_group", "-1"]),
        (lambda: o_fused_permutation(8, 512, 2.0), TypeError, ["o_fused_permutation", "chunk", "float"]),
        (lambda: o_fused_chunk_permutation(8, 100), ValueError, ["o_fused_permutation", "head_dim", "100"]),
        (lambda: apply_q_fused_permutation(torch.zeros(100, 4), None, 1), ValueError,
         ["apply_q_fused_permutation", "weight.shape[0]", "512", "100"]),
        (lambda: apply_q_fused_permutation(torch.zeros(512, 4), torch.zeros(511, 1), 1), ValueError,
         ["apply_q_fused_permutation", "scale.shape[0]", "512", "511"]),
        (lambda: apply_q_fused_permutation([1, 2], None, 1), TypeError,
         ["apply_q_fused_permutation", "weight", "Tensor", "list"]),
        (lambda: apply_o_fused_permutation(torch.zeros(2, 1024), None, 1), ValueError,
         ["apply_o_fused_permutation", "weight.shape[-1]", "512", "1024"]),
        (lambda: apply_o_fused_permutation(torch.zeros(2, 512), torch.zeros(2, 15), 1), ValueError,
         ["apply_o_fused_permutation", "scale.shape[-1]", "16", "15"]),
    ],
)
def test_fused_layout_validation(call, exc, words):
    with pytest.raises(exc) as info:
        call()
    for w in words:
        assert w in str(info.value), (w, str(info.value))
