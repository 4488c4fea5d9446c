"""transcode_k_cache: OCP <-> FNUZ paged K caches (rules: dsv41/transcode.py docstring).

* the four byte maps against float oracles (all 256 bytes);
* exhaustive groups (every value byte x every ue8m0 code; fp32 scales at every special
  exponent): the mode each group gets, its bytes and scale, and that the decoded values are
  exact where the table says so (bounded where it does not);
* named edge bytes (−0, NaN, ±240, codes 0 / 1 / 254 / 255, fp32 zero / subnormal / inf / NaN);
* round trips on caches written by dsv41's quantizers (584, 528 in both flavours; indexer 132
  row-major and tiled): FNUZ -> OCP -> FNUZ bit-exact, OCP -> FNUZ -> OCP bit-exact but −0,
  decoded values identical after one hop;
* −1 / out-of-range pages, padding and unlisted pages untouched, in place, flat views;
* reference vs CPU vs Triton (interpreter, only when TRITON_INTERPRET=1) byte equality;
* validation errors; torch.library opcheck.
"""

from __future__ import annotations

import os

import pytest
import torch

import dsv41
from dsv41.core import registry
from dsv41 import transcode as T
from dsv41.core.codecs import e4m3_decode, e4m3_encode, ue8m0_decode
from dsv41.tools.conformance import cases_for, clone_args, edge_rows, written_bytes
from dsv41.core.formats import INDEXER_FP8, RECORDS, CacheLayout
from dsv41.reference import transcode as R
from dsv41.reference.k_cache import dequantize_and_gather_k_cache as ref_gather
from dsv41.reference.k_cache import quantize_and_insert_k_cache as ref_insert

OP = "transcode_k_cache"
# These tests cover the flavour rules on the per-page layout the reference kernel works in;
# tests/test_v41_layouts.py covers the interleaved V4.1 records.
PAGED = dict(src_v41_layout="paged", dst_v41_layout="paged")
U8, I32, I64, F32 = torch.uint8, torch.int32, torch.int64, torch.float32
BYTES = torch.arange(256, dtype=I32)
CANARY = 0xA5


# ------------------------------------------------------------------------------ helpers


@pytest.fixture
def registered(monkeypatch):
    """Make the registry dispatch the op even before the lead adds it to OPS / the sheets
    (a no-op once they list it)."""
    from dsv41.backends.cpu import CpuBackend
    from dsv41.reference import ReferenceBackend

    if OP not in registry.OPS:
        monkeypatch.setattr(registry, "OPS", registry.OPS + (OP,))
    if OP not in ReferenceBackend.kernels:
        monkeypatch.setattr(ReferenceBackend, "kernels",
                            {**ReferenceBackend.kernels, OP: "dsv41.reference.transcode:transcode_k_cache"})
    if OP not in CpuBackend.kernels:
        monkeypatch.setattr(CpuBackend, "kernels",
                            {**CpuBackend.kernels, OP: "dsv41.backends.cpu.transcode:transcode_k_cache"})
    registry.reset()
    yield
    registry.reset()


def _cpu_kernel():
    from dsv41.backends.cpu import transcode as cpu

    why = cpu.build_error()
    if why:
        pytest.skip(why)
    return cpu.transcode_k_cache


def _triton_kernel():
    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("Triton kernel runs here only in the interpreter (TRITON_INTERPRET=1)")
    from dsv41.backends.triton.transcode_kernel import transcode_k_cache

    return transcode_k_cache


KERNELS = {"reference": lambda: R.transcode_k_cache, "cpu": _cpu_kernel, "triton@interp": _triton_kernel}


def nan_eq(a: torch.Tensor, b: torch.Tensor, signed_zero: bool = True) -> torch.Tensor:
    """Elementwise: equal fp32 values (NaN == NaN; with signed_zero, −0 != +0)."""
    same = (a == b) | (torch.isnan(a) & torch.isnan(b))
    if signed_zero:
        same &= torch.isnan(a) | (torch.signbit(a) == torch.signbit(b))
    return same


def paged(nb, B, W, pad=48, fill=CANARY, seed=None):
    """[nb, B, W] uint8 view over padded pages (padding = fill), record bytes random if seed."""
    page = B * W + pad
    buf = torch.full((nb * page + 40,), fill, dtype=U8)
    cache = buf[24:].as_strided((nb, B, W), (page, W, 1))
    if seed is not None:
        g = torch.Generator().manual_seed(seed)
        cache.copy_(torch.randint(0, 256, (nb, B, W), generator=g, dtype=U8))
    return cache


def rows_of(cache: torch.Tensor, block_size: int, tiled: bool = False):
    """(value bytes [nb*B, VB], scale bytes [nb*B, SB]) of every token, in dim order."""
    rec = RECORDS[cache.shape[-1]]
    lay = CacheLayout(rec, block_size, cache.stride(0), tiled=tiled)
    ids = torch.arange(cache.shape[0])
    v, s = R._page_indices(lay, ids)
    flat = R._flat_bytes(cache)
    return flat[v], flat[s]


def decode(vbytes: torch.Tensor, sbytes: torch.Tensor, width: int, fnuz: bool) -> torch.Tensor:
    """fp32 decoded fp8 dims [M, NG, G]: e4m3 * S (ue8m0: code 0 -> 0, 255 -> inf; fp32: the
    scale itself, one fp32 rounding)."""
    rec = RECORDS[width]
    m = vbytes.shape[0]
    x = e4m3_decode(vbytes[:, : rec.quant_dims].contiguous(), fnuz).view(m, rec.n_groups, rec.group)
    if rec.scale == "fp32":
        s = sbytes[:, :4].contiguous().view(F32)  # little-endian host
        return x * s.unsqueeze(-1)
    return x * ue8m0_decode(sbytes[:, : rec.n_groups]).unsqueeze(-1)


def fp32_from_bits(bits):
    return torch.tensor(bits, dtype=torch.int64).to(I32).view(F32)


# ------------------------------------------------------------------------------ byte maps


def test_same_value_maps_equal_float_reencoding():
    u = BYTES.to(U8)
    assert torch.equal(R.ocp_to_fnuz_same_value(BYTES).to(U8), e4m3_encode(e4m3_decode(u, False), True))
    assert torch.equal(R.fnuz_to_ocp_same_value(BYTES).to(U8), e4m3_encode(e4m3_decode(u, True), False))


def test_same_bits_maps_halve_or_double_every_non_special_byte():
    u = BYTES.to(U8)
    o2f = R.ocp_to_fnuz_same_bits(BYTES).to(U8)
    assert nan_eq(e4m3_decode(o2f, True), e4m3_decode(u, False) / 2, signed_zero=False).all()
    assert o2f[0x80] == 0x00 and o2f[0x7F] == 0x80 and o2f[0xFF] == 0x80
    keep = torch.ones(256, dtype=torch.bool)
    keep[[0x80, 0x7F, 0xFF]] = False
    assert torch.equal(o2f[keep], u[keep])
    # OCP's largest finite byte stays below FNUZ's 0x7F: no overflow with the same bits.
    assert int(o2f[keep].max()) == 0xFE and int((o2f[keep] & 0x7F).max()) == 0x7E

    f2o = R.fnuz_to_ocp_same_bits(BYTES).to(U8)
    ordinary = torch.ones(256, dtype=torch.bool)
    ordinary[[0x7F, 0xFF]] = False
    assert nan_eq(e4m3_decode(f2o, False)[ordinary], (e4m3_decode(u, True) * 2)[ordinary]).all()
    assert f2o[0x80] == 0x7F and f2o[0x7F] == 0x7E and f2o[0xFF] == 0xFE
    ordinary[0x80] = False
    assert torch.equal(f2o[ordinary], u[ordinary])


def test_fnuz_to_ocp_same_value_rounding():
    f2o = R.fnuz_to_ocp_same_value(BYTES)
    v_f = e4m3_decode(BYTES.to(U8), True)
    v_o = e4m3_decode(f2o.to(U8), False)
    mag = BYTES & 0x7F
    exact = (mag >= 16) | (mag % 2 == 0)
    ok = nan_eq(v_o, v_f)
    assert ok[exact & (BYTES != 0x80)].all()
    assert not ok[(~exact) & (mag != 0x7F)].any()  # odd multiples of 2^-10 below 2^-6 round
    assert ((v_o - v_f).abs()[BYTES != 0x80] <= 2.0**-10).all()
    assert int(f2o[0x7F]) == 0x77 and e4m3_decode(torch.tensor([0x77], dtype=U8), False).item() == 240.0
    assert int(f2o[0x01]) == 0x00 and int(f2o[0x81]) == 0x80  # 2^-10 ties to even zero, sign kept
    assert int(f2o[0x03]) == 0x02 and int(f2o[0x05]) == 0x02 and int(f2o[0x0F]) == 0x08


# ------------------------------------------------------------------------------ exhaustive groups


def _ue8m0_rows(width):
    """One token per ue8m0 code (0..255) per chunk set: the groups of a token cycle through
    every byte (chunks of arange(256)) and 'clean' chunks without ±240 / NaN / −0."""
    rec = RECORDS[width]
    G = rec.group
    chunks = BYTES.view(-1, G)
    clean = chunks.clone()
    clean[(clean & 0x7F) == 0x7F] = 0x3C
    clean[clean == 0x80] = 0x00
    all_chunks = torch.cat([chunks, clean])  # [2*256/G, G]
    ng = rec.n_groups
    reps = -(-all_chunks.shape[0] // ng)
    rows = []
    codes = []
    for c in range(256):
        for r in range(reps):
            idx = (torch.arange(ng) + r * ng) % all_chunks.shape[0]
            rows.append(all_chunks[idx].reshape(-1))
            codes.append(torch.full((ng,), c, dtype=I32))
    q = torch.stack(rows).to(U8)
    v = torch.zeros(q.shape[0], rec.value_bytes, dtype=U8)
    v[:, : rec.quant_dims] = q
    if rec.bf16_dims:
        v[:, rec.quant_dims:] = torch.randint(0, 256, (q.shape[0], rec.value_bytes - rec.quant_dims),
                                              generator=torch.Generator().manual_seed(0), dtype=U8)
    s = torch.full((q.shape[0], rec.scale_bytes), 0x5A, dtype=U8)
    s[:, :ng] = torch.stack(codes).to(U8)
    return v, s


def _expected_ue8m0(code, has240, src_fnuz):
    if code in (0, 255):
        return R.PASS, code
    if not src_fnuz:
        return (R.KEEP, code) if code == 254 else (R.RESCALE, code + 1)
    return (R.KEEP, code) if (code == 1 or has240) else (R.RESCALE, code - 1)


@pytest.mark.parametrize("width", [584, 528])
@pytest.mark.parametrize("src_fnuz", [False, True], ids=["ocp-to-fnuz", "fnuz-to-ocp"])
def test_ue8m0_groups_exhaustive(width, src_fnuz):
    rec = RECORDS[width]
    v, s = _ue8m0_rows(width)
    v2, s2 = R.transcode_records(v, s, rec, src_fnuz, not src_fnuz)
    m = v.shape[0]
    # untouched bytes: the 584 bf16 tail and pad scale byte
    assert torch.equal(v2[:, rec.quant_dims:], v[:, rec.quant_dims:])
    assert torch.equal(s2[:, rec.n_groups:], s[:, rec.n_groups:])

    q = v[:, : rec.quant_dims].to(I32).view(m, rec.n_groups, rec.group)
    q2 = v2[:, : rec.quant_dims].to(I32).view(m, rec.n_groups, rec.group)
    code, code2 = s[:, : rec.n_groups].to(I32), s2[:, : rec.n_groups].to(I32)
    has240 = ((q & 0x7F) == 0x7F).any(-1)
    modes = torch.empty_like(code)
    for i in range(m):
        for g in range(rec.n_groups):
            mode, want = _expected_ue8m0(int(code[i, g]), bool(has240[i, g]), src_fnuz)
            modes[i, g] = mode
            assert int(code2[i, g]) == want, (i, g, int(code[i, g]))
    assert torch.equal(modes, R.group_modes(q, code, False, src_fnuz))
    same_bits = R.fnuz_to_ocp_same_bits(q) if src_fnuz else R.ocp_to_fnuz_same_bits(q)
    same_val = R.fnuz_to_ocp_same_value(q) if src_fnuz else R.ocp_to_fnuz_same_value(q)
    keep = (modes == R.KEEP).unsqueeze(-1)
    assert torch.equal(q2, torch.where(keep, same_val, same_bits))
    # every mode occurs
    assert {int(x) for x in modes.unique()} == {R.RESCALE, R.PASS, R.KEEP}

    before = decode(v, s, width, src_fnuz)
    after = decode(v2, s2, width, not src_fnuz)
    ok = nan_eq(after, before, signed_zero=src_fnuz)  # writing FNUZ: −0 -> +0 allowed
    if not src_fnuz:
        assert ok.all(), "OCP -> FNUZ must keep every decoded value"
    else:
        exact_groups = (modes != R.KEEP).unsqueeze(-1)
        assert ok[exact_groups.expand_as(ok)].all(), "RESCALE / PASS must keep every decoded value"
        # KEEP: exact for |x| >= 2^-6 * S (the ±240s included), else within 2^-10 * S
        S = ue8m0_decode(code).unsqueeze(-1).expand_as(before)
        mag = (q & 0x7F)
        big = (mag >= 16) | (mag % 2 == 0)
        kq = keep.expand_as(ok)
        assert ok[kq & big].all()
        assert ((after - before).abs()[kq & ~big] <= 2.0**-10 * S[kq & ~big]).all()


_FP32_SCALES = [
    0x00000000, 0x80000000,  # ±0
    0x00000001, 0x00000002, 0x007FFFFF, 0x007FFFFE, 0x80000003,  # subnormals, odd / even
    0x00800000, 0x00800001, 0x80800000, 0x00FFFFFF,  # e = 1
    0x01000000, 0x01000001,  # e = 2
    0x34800000,  # 2^-22: the zero-key scale of the indexer
    0x3F800000, 0xBF800000, 0x3F912345,  # 1, −1, not a power of two
    0x7E800000, 0x7EFFFFFF,  # e = 253
    0x7F000000, 0x7F7FFFFF, 0xFF000000,  # e = 254
    0x7F800000, 0xFF800000, 0x7FC00000, 0x7F800001, 0xFFFFFFFF,  # ±inf, NaNs
]


def _fp32_rows():
    chunks = BYTES.view(2, 128)
    clean = chunks.clone()
    clean[(clean & 0x7F) == 0x7F] = 0x3C
    clean[clean == 0x80] = 0x00
    all_chunks = torch.cat([chunks, clean])
    v = all_chunks.repeat(len(_FP32_SCALES), 1).to(U8)
    bits = torch.tensor(_FP32_SCALES, dtype=I64).repeat_interleave(all_chunks.shape[0])
    s = ((bits.unsqueeze(1) >> torch.tensor([0, 8, 16, 24])) & 0xFF).to(U8)
    return v, s, bits


def _expected_fp32(bits, has240, src_fnuz):
    sign, mag = bits & 0x80000000, bits & 0x7FFFFFFF
    e = mag >> 23
    if e == 255:
        return R.PASS, bits
    if not src_fnuz:
        if e == 254:
            return R.KEEP, bits
        return R.RESCALE, (bits + (1 << 23)) if e >= 1 else (sign | (mag << 1))
    halvable = e >= 2 or bits % 2 == 0
    if has240 or not halvable:
        return R.KEEP, bits
    return R.RESCALE, (bits - (1 << 23)) if e >= 2 else (sign | (mag >> 1))


@pytest.mark.parametrize("src_fnuz", [False, True], ids=["ocp-to-fnuz", "fnuz-to-ocp"])
def test_fp32_scale_groups_exhaustive(src_fnuz):
    v, s, bits = _fp32_rows()
    v2, s2 = R.transcode_records(v, s, INDEXER_FP8, src_fnuz, not src_fnuz)
    s2_bits = R._fp32_bits(s2).squeeze(1)
    q = v.to(I32)
    has240 = ((q & 0x7F) == 0x7F).any(-1)
    modes = []
    for i in range(v.shape[0]):
        mode, want = _expected_fp32(int(bits[i]), bool(has240[i]), src_fnuz)
        modes.append(mode)
        assert int(s2_bits[i]) == want, (i, hex(int(bits[i])))
    modes = torch.tensor(modes)
    same_bits = R.fnuz_to_ocp_same_bits(q) if src_fnuz else R.ocp_to_fnuz_same_bits(q)
    same_val = R.fnuz_to_ocp_same_value(q) if src_fnuz else R.ocp_to_fnuz_same_value(q)
    assert torch.equal(v2.to(I32), torch.where((modes == R.KEEP).unsqueeze(1), same_val, same_bits))
    # halving / doubling really is exact where RESCALE is chosen
    sf, sf2 = fp32_from_bits(bits.tolist()), fp32_from_bits(s2_bits.tolist())
    resc = modes == R.RESCALE
    factor = 0.5 if src_fnuz else 2.0
    assert nan_eq(sf2[resc], (sf[resc].double() * factor).float()).all()

    before = decode(v, s, 132, src_fnuz)
    after = decode(v2, s2, 132, not src_fnuz)
    ok = nan_eq(after, before, signed_zero=src_fnuz)
    if not src_fnuz:
        assert ok.all()
    else:
        assert ok[(modes != R.KEEP)].all()
        mag = q.view_as(before) & 0x7F
        big = (mag >= 16) | (mag % 2 == 0)
        kq = (modes == R.KEEP).view(-1, 1, 1).expand_as(ok)
        assert ok[kq & big].all()


@pytest.mark.parametrize("width", [584, 528, 132])
def test_round_trip_claims_on_exhaustive_groups(width):
    """FNUZ -> OCP -> FNUZ is bit-exact for every group without a ±240 byte that does not take
    KEEP; OCP -> FNUZ -> OCP is bit-exact except −0 -> +0, 0xFF -> 0x7F and KEEP (code /
    exponent 254) groups."""
    rec = RECORDS[width]
    if width == 132:
        v, s, _ = _fp32_rows()
        scale = R._fp32_bits(s)
    else:
        v, s = _ue8m0_rows(width)
        scale = s[:, : rec.n_groups].to(I32)
    m = v.shape[0]
    q = v[:, : rec.quant_dims].to(I32).view(m, rec.n_groups, rec.group)

    mode = R.group_modes(q, scale, width == 132, True)
    mode = torch.where(((q & 0x7F) == 0x7F).any(-1), R.KEEP, mode)  # ±240: not claimed
    v1, s1 = R.transcode_records(v, s, rec, True, False)
    v2, s2 = R.transcode_records(v1, s1, rec, False, True)
    exact = (mode != R.KEEP).unsqueeze(-1).expand_as(q)
    q2 = v2[:, : rec.quant_dims].to(I32).view_as(q)
    assert torch.equal(q2[exact], q[exact])
    assert torch.equal(v2[:, rec.quant_dims:], v[:, rec.quant_dims:])
    if width == 132:
        assert torch.equal(s2[exact[:, 0, 0]], s[exact[:, 0, 0]])
    else:
        sc2 = s2[:, : rec.n_groups].to(I32)
        assert torch.equal(sc2[mode != R.KEEP], scale[mode != R.KEEP])

    mode = R.group_modes(q, scale, width == 132, False)
    v1, s1 = R.transcode_records(v, s, rec, False, True)
    v2, s2 = R.transcode_records(v1, s1, rec, True, False)
    q2 = v2[:, : rec.quant_dims].to(I32).view_as(q)
    want = torch.where(q == 0x80, 0, torch.where(q == 0xFF, 0x7F, q))
    exact = (mode != R.KEEP).unsqueeze(-1).expand_as(q)
    assert torch.equal(q2[exact], want[exact])
    if width == 132:
        assert torch.equal(s2[exact[:, 0, 0]], s[exact[:, 0, 0]])
    else:
        sc2 = s2[:, : rec.n_groups].to(I32)
        assert torch.equal(sc2[mode != R.KEEP], scale[mode != R.KEEP])
    assert (mode == R.KEEP).any()


# ------------------------------------------------------------------------------ named edge cases


def _one_group(width, byte_list, scale):
    """One token: group 0 = byte_list (+ zeros), every ue8m0 code = scale (or the fp32 bits)."""
    rec = RECORDS[width]
    v = torch.zeros(1, rec.value_bytes, dtype=U8)
    v[0, : len(byte_list)] = torch.tensor(byte_list, dtype=U8)
    s = torch.zeros(1, rec.scale_bytes, dtype=U8)
    if rec.scale == "fp32":
        s[0] = torch.tensor([(scale >> k) & 0xFF for k in (0, 8, 16, 24)], dtype=U8)
    else:
        s[0, : rec.n_groups] = scale
    return v, s


def _run(width, byte_list, scale, src_fnuz):
    rec = RECORDS[width]
    v, s = _one_group(width, byte_list, scale)
    v2, s2 = R.transcode_records(v, s, rec, src_fnuz, not src_fnuz)
    out_scale = int(R._fp32_bits(s2)) if rec.scale == "fp32" else int(s2[0, 0])
    return v2[0, : len(byte_list)].tolist(), out_scale


EDGES = [
    # (name, width, src_fnuz, bytes, scale, expected bytes, expected scale)
    ("ocp -0 and NaN, rescale", 528, False, [0x80, 0x7F, 0xFF, 0x38, 0xFE, 0x01], 127,
     [0x00, 0x80, 0x80, 0x38, 0xFE, 0x01], 128),
    ("ocp code 253 -> 254", 584, False, [0x7E], 253, [0x7E], 254),
    ("ocp code 254 keeps, values re-encoded", 528, False, [0x7E, 0xF8, 0x77, 0x40, 0x01, 0x07, 0x80, 0xFF],
     254, [0x7F, 0xFF, 0x7F, 0x48, 0x02, 0x0E, 0x00, 0x80], 254),
    ("ocp code 255 passes", 584, False, [0x00, 0x80, 0x7E, 0x01, 0x7F], 255, [0x00, 0x00, 0x7E, 0x01, 0x80], 255),
    ("ocp code 0 passes", 528, False, [0x80, 0x7E, 0x81], 0, [0x00, 0x7E, 0x81], 0),
    ("ocp code 1 -> 2", 528, False, [0x40], 1, [0x40], 2),
    ("fnuz NaN, rescale", 528, True, [0x80, 0x7E, 0x00, 0x81], 127, [0x7F, 0x7E, 0x00, 0x81], 126),
    ("fnuz 240 keeps the code, halves the group", 528, True,
     [0x7F, 0xFF, 0x40, 0x48, 0x01, 0x81, 0x03, 0x0F, 0x80, 0x00], 130,
     [0x77, 0xF7, 0x38, 0x40, 0x00, 0x80, 0x02, 0x08, 0x7F, 0x00], 130),
    ("fnuz 240 with code 255 passes (saturates to 448)", 584, True, [0x7F, 0xFF, 0x01, 0x80], 255,
     [0x7E, 0xFE, 0x01, 0x7F], 255),
    ("fnuz code 0 passes", 528, True, [0x7F, 0x01, 0x80], 0, [0x7E, 0x01, 0x7F], 0),
    ("fnuz code 1 keeps", 528, True, [0x40, 0x01, 0x11], 1, [0x38, 0x00, 0x09], 1),
    ("fnuz code 2 -> 1", 528, True, [0x40, 0x01], 2, [0x40, 0x01], 1),
    ("fnuz code 254 -> 253", 584, True, [0x7E], 254, [0x7E], 253),
    ("fp32 ocp 2^-22 doubles", 132, False, [0x80, 0x7F, 0x38], 0x34800000, [0x00, 0x80, 0x38], 0x35000000),
    ("fp32 ocp subnormal doubles", 132, False, [0x38], 0x00400001, [0x38], 0x00800002),
    ("fp32 ocp zero stays", 132, False, [0x38, 0x80], 0x80000000, [0x38, 0x00], 0x80000000),
    ("fp32 ocp e=254 keeps", 132, False, [0x7E, 0x38], 0x7F000000, [0x7F, 0x40], 0x7F000000),
    ("fp32 ocp inf passes", 132, False, [0x7E, 0x80], 0x7F800000, [0x7E, 0x00], 0x7F800000),
    ("fp32 ocp NaN passes (payload kept)", 132, False, [0x38], 0xFFC01234, [0x38], 0xFFC01234),
    ("fp32 fnuz halves", 132, True, [0x80, 0x40], 0xBF800000, [0x7F, 0x40], 0xBF000000),
    ("fp32 fnuz min normal halves to subnormal", 132, True, [0x40], 0x00800000, [0x40], 0x00400000),
    ("fp32 fnuz odd tiny keeps", 132, True, [0x40, 0x01], 0x00800001, [0x38, 0x00], 0x00800001),
    ("fp32 fnuz 240 keeps", 132, True, [0x7F, 0x40], 0x3B800000, [0x77, 0x38], 0x3B800000),
    ("fp32 fnuz inf passes", 132, True, [0x7F, 0x80], 0xFF800000, [0x7E, 0x7F], 0xFF800000),
]


@pytest.mark.parametrize("edge", EDGES, ids=[e[0] for e in EDGES])
def test_edge(edge):
    _, width, src_fnuz, b, scale, want_b, want_s = edge
    got_b, got_s = _run(width, b, scale, src_fnuz)
    assert got_b == want_b
    assert got_s == want_s, hex(got_s)


# ------------------------------------------------------------------------------ quantizer round trips


def _quantized(width, fnuz, nb=3, B=16, seed=5):
    n = nb * B
    k = edge_rows(n, 512, seed, nonfinite=True).to(torch.bfloat16)
    cache = paged(nb, B, width)
    ref_insert(k, cache, torch.arange(n), B, fnuz, width)
    return cache


def _gather(cache, B, fnuz):
    nb = cache.shape[0]
    out = torch.zeros(1, nb * B, 512, dtype=torch.bfloat16)
    ref_gather(out, cache, torch.tensor([nb * B], dtype=I32), None, torch.arange(nb, dtype=I32).view(1, -1), B, 0, fnuz)
    return out


@pytest.mark.parametrize("width", [584, 528])
def test_round_trip_fnuz_ocp_fnuz_bit_exact_on_quantizer_caches(width, registered):
    B = 16
    src = _quantized(width, True)
    v, s = rows_of(src, B)
    assert not ((v[:, : RECORDS[width].quant_dims] & 0x7F) == 0x7F).any()  # the 224 clamp
    mid = paged(3, B, width, fill=0x11)
    back = paged(3, B, width, fill=0x22)
    ids = torch.arange(3)
    T.transcode_k_cache(src, mid, ids, True, False, **PAGED)
    T.transcode_k_cache(mid, back, ids, False, True, **PAGED)
    assert torch.equal(rows_of(back, B)[0], v) and torch.equal(rows_of(back, B)[1], s)
    # one hop keeps every decoded bf16 bit (the readers of both flavours)
    a, b = _gather(src, B, True), _gather(mid, B, False)
    assert torch.equal(a.view(torch.int16), b.view(torch.int16))


@pytest.mark.parametrize("width", [584, 528])
def test_round_trip_ocp_fnuz_ocp_on_quantizer_caches(width, registered):
    B = 16
    rec = RECORDS[width]
    src = _quantized(width, False)
    v, s = rows_of(src, B)
    mid = paged(3, B, width)
    back = paged(3, B, width)
    ids = torch.arange(3)
    T.transcode_k_cache(src, mid, ids, False, True, **PAGED)
    T.transcode_k_cache(mid, back, ids, True, False, **PAGED)
    v3, s3 = rows_of(back, B)
    assert torch.equal(s3, s)
    diff = v3 != v
    assert diff.any() and torch.equal(diff, (v == 0x80) & (torch.arange(rec.value_bytes) < rec.quant_dims))
    assert (v3[diff] == 0x00).all()  # −0 comes back +0, nothing else changes
    a, b = _gather(src, B, False).float(), _gather(mid, B, True).float()
    assert nan_eq(a, b, signed_zero=False).all()


@pytest.mark.parametrize("tiled", [False, True], ids=["rows", "tiled"])
def test_round_trip_indexer_fp8(tiled, registered):
    from dsv41.tools.conformance import _cos_sin

    B, nb = 32, 3
    n = nb * B
    g = torch.Generator().manual_seed(2)
    k = edge_rows(n, 128, 4).to(torch.bfloat16)
    cache = paged(nb, B, 132)
    dsv41.indexer_k_norm_rope_store(k, torch.randint(0, 256, (n,), generator=g), _cos_sin(256, 64),
                                    torch.ones(128, dtype=torch.bfloat16), 1e-6, cache, torch.arange(n), 1, False,
                                    tiled=tiled)
    v, s = rows_of(cache, B, tiled)
    ids = torch.arange(nb)
    fnuz = paged(nb, B, 132)
    T.transcode_k_cache(cache, fnuz, ids, False, True, tiled=tiled, **PAGED)
    vf, sf = rows_of(fnuz, B, tiled)
    assert nan_eq(decode(vf, sf, 132, True), decode(v, s, 132, False), signed_zero=False).all()
    back = paged(nb, B, 132)
    T.transcode_k_cache(fnuz, back, ids, True, False, tiled=tiled, **PAGED)
    vb, sb = rows_of(back, B, tiled)
    assert torch.equal(sb, s)
    assert torch.equal(vb, torch.where(v == 0x80, torch.zeros_like(v), v))
    # and FNUZ -> OCP -> FNUZ is bit-exact
    again = paged(nb, B, 132)
    T.transcode_k_cache(back, again, ids, False, True, tiled=tiled, **PAGED)
    assert torch.equal(written_bytes(again), written_bytes(fnuz))


# ------------------------------------------------------------------------------ paging behaviour


@pytest.mark.parametrize("backend", list(KERNELS))
@pytest.mark.parametrize("width", [584, 528, 132])
def test_pages_padding_and_skips(backend, width):
    kern = KERNELS[backend]()
    B, nb = 16, 5
    src = paged(nb, B, width, pad=40, seed=1)
    dst = paged(nb + 1, B, width, pad=72, fill=0x3C)
    before = written_bytes(dst)
    ids = torch.tensor([3, -1, 1, -5, 9, 5], dtype=I32)  # 9, 5: past src's pages (5 is dst's last)
    kern(src, dst, ids, B, width, False, True, False)
    after = written_bytes(dst)
    # exactly the record bytes of pages 1 and 3 changed hands
    page_d, used = dst.stride(0), B * width
    exp = paged(nb + 1, B, width, pad=72, fill=0x3C)
    R.transcode_k_cache(src, exp, torch.tensor([1, 3]), B, width, False, True, False)
    want = written_bytes(exp)
    assert torch.equal(after, want)
    off = dst.storage_offset()
    touched = torch.zeros_like(before, dtype=torch.bool)
    for p in (1, 3):
        touched[off + p * page_d: off + p * page_d + used] = True
    assert torch.equal(after[~touched], before[~touched])  # padding, other pages, slack: untouched


@pytest.mark.parametrize("backend", list(KERNELS))
@pytest.mark.parametrize("width,tiled", [(584, False), (528, False), (132, False), (132, True)])
@pytest.mark.parametrize("src_fnuz", [False, True], ids=["ocp-to-fnuz", "fnuz-to-ocp"])
def test_in_place_equals_out_of_place(backend, width, tiled, src_fnuz):
    kern = KERNELS[backend]()
    B, nb = 16, 4
    src = paged(nb, B, width, seed=7)
    ids = torch.tensor([2, 0, -1], dtype=I64)
    out = paged(nb, B, width)
    out.copy_(src)
    R.transcode_k_cache(src, out, ids, B, width, src_fnuz, not src_fnuz, tiled)
    inplace = src.clone()
    kern(inplace, inplace, ids, B, width, src_fnuz, not src_fnuz, tiled)
    assert torch.equal(inplace, out)


def _exhaustive_cache(width, B=16):
    """A cache holding the exhaustive groups (every byte x every code / fp32 special scale)."""
    if width == 132:
        v, s, _ = _fp32_rows()
    else:
        v, s = _ue8m0_rows(width)
    m = v.shape[0]
    nb = -(-m // B)
    cache = paged(nb, B, width, seed=11)
    lay = CacheLayout(RECORDS[width], B, cache.stride(0))
    vi, si = R._page_indices(lay, torch.arange(nb))
    flat = R._flat_bytes(cache)
    flat[vi[:m].reshape(-1)] = v.reshape(-1)
    flat[si[:m].reshape(-1)] = s.reshape(-1)
    return cache, nb


@pytest.mark.parametrize("backend", ["cpu", "triton@interp"])
@pytest.mark.parametrize("width", [584, 528, 132])
@pytest.mark.parametrize("src_fnuz,dst_fnuz", [(False, True), (True, False), (True, True)],
                         ids=["ocp-to-fnuz", "fnuz-to-ocp", "identity"])
def test_impl_bytes_equal_reference_exhaustive(backend, width, src_fnuz, dst_fnuz):
    kern = KERNELS[backend]()
    B = 16
    src, nb = _exhaustive_cache(width, B)
    ids = torch.arange(nb - 1, -1, -1, dtype=I32)
    for tiled in ([False, True] if width == 132 else [False]):
        want = paged(nb, B, width, pad=8, seed=3)
        got = paged(nb, B, width, pad=8, seed=3)
        R.transcode_k_cache(src, want, ids, B, width, src_fnuz, dst_fnuz, tiled)
        kern(src, got, ids, B, width, src_fnuz, dst_fnuz, tiled)
        assert torch.equal(written_bytes(got), written_bytes(want))


CASES = cases_for("transcode_k_cache")


@pytest.mark.parametrize("backend", ["cpu", "triton@interp"])
@pytest.mark.parametrize("ccase", CASES, ids=[c.name for c in CASES])
def test_impl_bytes_equal_reference_conformance_cases(backend, ccase):
    kern = KERNELS[backend]()
    args = ccase.build("cpu")
    want, got = clone_args(args), clone_args(args)
    R.transcode_k_cache(*want)
    kern(*got)
    assert torch.equal(written_bytes(got[1]), written_bytes(want[1]))
    assert torch.equal(written_bytes(got[0]), written_bytes(args[0]))  # src never written


# ------------------------------------------------------------------------------ public API


def test_public_flat_views_and_defaults(registered):
    B, W, nb = 16, 528, 3
    src = paged(nb, B, W, pad=0, seed=4)
    want = paged(nb, B, W, pad=0)
    R.transcode_k_cache(src, want, torch.tensor([0, 2]), B, W, False, True, False)
    # flat src and dst with explicit block_size
    dst = paged(nb, B, W, pad=0)
    T.transcode_k_cache(src.view(nb, -1), dst.view(nb, -1), torch.tensor([0, 2]), False, True, B, **PAGED)
    assert torch.equal(dst, want)
    # flat src + 3-D dst: width and block_size from dst
    dst = paged(nb, B, W, pad=0)
    T.transcode_k_cache(src.view(nb, -1), dst, torch.tensor([0, 2], dtype=I32), False, True, **PAGED)
    assert torch.equal(dst, want)
    # in place through the public op
    inplace = src.clone()
    T.transcode_k_cache(inplace, inplace, torch.tensor([0, 2]), False, True, **PAGED)
    ref = src.clone()
    R.transcode_k_cache(src, ref, torch.tensor([0, 2]), B, W, False, True, False)
    assert torch.equal(inplace, ref)
    # empty id list: nothing happens (and no kernel runs)
    before = dst.clone()
    T.transcode_k_cache(src, dst, torch.empty(0, dtype=I64), True, False, **PAGED)
    assert torch.equal(dst, before)


def test_public_tiled_default_is_rows_off_rocm(registered):
    B, nb = 16, 2
    src = paged(nb, B, 132, seed=9)
    rows = paged(nb, B, 132)
    tiled = paged(nb, B, 132)
    T.transcode_k_cache(src, rows, torch.arange(nb), True, False, **PAGED)
    T.transcode_k_cache(src, tiled, torch.arange(nb), True, False, tiled=True, **PAGED)
    want = paged(nb, B, 132)
    R.transcode_k_cache(src, want, torch.arange(nb), B, 132, True, False, False)
    assert torch.equal(rows, want)
    want_t = paged(nb, B, 132)
    R.transcode_k_cache(src, want_t, torch.arange(nb), B, 132, True, False, True)
    assert torch.equal(tiled, want_t)


def test_opcheck(registered):
    args = CASES[1].build("cpu")
    torch.library.opcheck(torch.ops.dsv41.transcode_k_cache.default, tuple(args),
                          test_utils=("test_schema", "test_autograd_registration", "test_faketensor",
                                      "test_aot_dispatch_dynamic"))


# ------------------------------------------------------------------------------ validation


def c3(width=528, nb=2, b=16):
    return torch.zeros(nb, b, width, dtype=U8)


IDS = torch.arange(2)

BAD = {
    "src not a tensor": (lambda: T.transcode_k_cache([1], c3(), IDS, False, True), TypeError, ["transcode_k_cache", "'src'", "torch.Tensor", "list"]),
    "src dtype": (lambda: T.transcode_k_cache(c3().float(), c3(), IDS, False, True), TypeError, ["'src'", "uint8", "float32"]),
    "dst dtype": (lambda: T.transcode_k_cache(c3(), c3().to(I32), IDS, False, True), TypeError, ["'dst'", "uint8", "int32"]),
    "src rank": (lambda: T.transcode_k_cache(torch.zeros(5, dtype=U8), c3(), IDS, False, True), ValueError, ["'src'", "(2, 3)-D", "1-D"]),
    "ids dtype": (lambda: T.transcode_k_cache(c3(), c3(), IDS.float(), False, True), TypeError, ["'block_ids'", "int32 or int64", "float32"]),
    "ids rank": (lambda: T.transcode_k_cache(c3(), c3(), IDS.view(1, 2), False, True), ValueError, ["'block_ids'", "1-D", "2-D"]),
    "flag type": (lambda: T.transcode_k_cache(c3(), c3(), IDS, 0, True), TypeError, ["'src_fnuz'", "bool", "int"]),
    "dst flag type": (lambda: T.transcode_k_cache(c3(), c3(), IDS, False, "fnuz"), TypeError, ["'dst_fnuz'", "bool", "str"]),
    "nvfp4 record": (lambda: T.transcode_k_cache(c3(288), c3(288), IDS, False, True), ValueError,
                     ["'src'", "holds fp8", "132, 528, 584", "288 (NVFP4)", "no fp8", "288 bytes per token"]),
    "mxfp4 record": (lambda: T.transcode_k_cache(c3(68), c3(68), IDS, False, True), ValueError, ["'src'", "holds fp8", "68 bytes per token"]),
    "unknown record": (lambda: T.transcode_k_cache(c3(500), c3(500), IDS, False, True), ValueError, ["'src'", "holds fp8", "500"]),
    "width mismatch": (lambda: T.transcode_k_cache(c3(584), c3(528), IDS, False, True), ValueError, ["'dst'", "584", "(2, 16, 528)"]),
    "flat without block_size": (lambda: T.transcode_k_cache(c3().view(2, -1), c3().view(2, -1), IDS, False, True), ValueError, ["'block_size'", "an int", "None"]),
    "flat not divisible": (lambda: T.transcode_k_cache(torch.zeros(2, 1000, dtype=U8), torch.zeros(2, 1000, dtype=U8), IDS, False, True, 16), ValueError, ["'src'", "block_size * width", "(2, 1000)"]),
    "block_size mismatch": (lambda: T.transcode_k_cache(c3(), c3(), IDS, False, True, 8), ValueError, ["'src'", "size 8 in dim 1"]),
    "block_size type": (lambda: T.transcode_k_cache(c3(), c3(), IDS, False, True, 16.0), TypeError, ["'block_size'", "an int", "float"]),
    "block_size zero": (lambda: T.transcode_k_cache(c3().view(2, -1), c3().view(2, -1), IDS, False, True, 0), ValueError, ["'block_size'", ">= 1", "0"]),
    "page too small": (lambda: T.transcode_k_cache(torch.zeros(2, 16 * 528, dtype=U8), torch.zeros(2, 16 * 528 + 16, dtype=U8)[:, :100], IDS, False, True, 16), ValueError, ["'dst'", "size >= 8448"]),
    "tiled wrong record": (lambda: T.transcode_k_cache(c3(), c3(), IDS, False, True, tiled=True), ValueError, ["'tiled'", "132"]),
    "tiled block size": (lambda: T.transcode_k_cache(c3(132, b=8), c3(132, b=8), IDS, False, True, tiled=True), ValueError, ["'block_size'", "multiple of 16", "8"]),
    "tiled type": (lambda: T.transcode_k_cache(c3(132), c3(132), IDS, False, True, tiled=1), TypeError, ["'tiled'", "bool", "int"]),
    "device mismatch": (lambda: T.transcode_k_cache(c3(), c3(), IDS.to("meta"), False, True), ValueError, ["'block_ids'", "cpu", "meta"]),
    "overlapping views": (lambda: (lambda buf: T.transcode_k_cache(buf[:2], buf[1:], IDS, False, True))(c3(nb=3)), ValueError, ["'dst'", "share storage"]),
}


@pytest.mark.parametrize("name", list(BAD))
def test_validation(name):
    call, exc, fragments = BAD[name]
    with pytest.raises(exc) as info:
        call()
    msg = str(info.value)
    for f in fragments:
        assert f in msg, f"{f!r} not in {msg!r}"


def test_torch_compile_fullgraph(registered):
    """The public op traces (validation reads metadata only) and in-place calls compile too."""
    torch._dynamo.reset()
    src = paged(3, 16, 528, pad=0, seed=6)
    ids = torch.tensor([0, 2])

    def hop(src, dst, ids):
        T.transcode_k_cache(src, dst, ids, False, True)
        T.transcode_k_cache(dst, dst, ids, True, False)
        T.transcode_k_cache(dst, dst, ids, False, False, dst_v41_layout="paged")
        return dst.float().sum()

    d_eager, d_comp = torch.zeros_like(src), torch.zeros_like(src)
    want = hop(src, d_eager, ids)
    got = torch.compile(hop, fullgraph=True, backend="inductor")(src, d_comp, ids)
    assert torch.equal(d_eager, d_comp) and torch.equal(want, got)
