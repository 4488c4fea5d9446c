"""Reference ``fused_save_compress_norm`` / ``rope_quant_insert`` (spec cache_ops.md §8).

* every golden case of both ops from ``vllm-sm90.tar.xz`` must be reproduced byte for byte,
  over the whole backing storage of each in-place output (page / row padding included);
* hand-made cases for what the vectors cannot show: the 288-byte NVFP4 record (no SM90
  vector exists), the gfx950 sanitize rule (C §2.5), T = 0.
"""

from __future__ import annotations

import io
import os
import pathlib
import tarfile

import pytest
import torch

import golden  # noqa: E402  (tests/ is on sys.path)

from dsv41.core.codecs import e2m1_decode, e4m3_decode, unpack_nibbles
from dsv41.reference.compress import fused_save_compress_norm, rope_quant_insert

REPO = pathlib.Path(__file__).resolve().parents[1]
VECTORS = str(golden.ARCHIVE)  # tests/vectors (DSV41_VECTORS overrides)
OPS = ("fused_save_compress_norm", "rope_quant_insert")


def _load_cases():
    if not os.path.exists(VECTORS):
        return None
    cases = []
    with tarfile.open(VECTORS, "r:xz") as tf:
        for m in tf.getmembers():
            if not (m.isfile() and m.name.endswith(".pt")):
                continue
            d = torch.load(io.BytesIO(tf.extractfile(m).read()), weights_only=True)
            if d["op"] in OPS:
                cases.append((pathlib.Path(m.name).stem, d))
    return sorted(cases, key=lambda c: c[0])


_CASES = _load_cases()


def _clone(v):
    """Clone a tensor together with its whole backing storage, keeping the view."""
    if not torch.is_tensor(v):
        return v
    st = v.untyped_storage().clone()
    base = torch.empty(0, dtype=v.dtype, device=v.device).set_(st)
    return base.as_strided(v.size(), v.stride(), v.storage_offset())


def _storage_bytes(v: torch.Tensor) -> torch.Tensor:
    st = v.untyped_storage()
    return torch.empty(0, dtype=torch.uint8).set_(st)


def _run(op, args):
    if op == "fused_save_compress_norm":
        fused_save_compress_norm(
            args["kv_score"], args["positions"], args["state_cache"], args["slot_mapping"],
            args["query_start_loc"], args["token_to_req_indices"], args["rms_norm_weight"],
            args["rms_norm_eps"], args["compress_ratio"], args["latent_out"],
        )
    else:
        rope_quant_insert(
            args["latent"], args["positions"], args["cos_sin_cache"], args["kv_cache"],
            args["slot_mapping"], args["compress_ratio"], args["fp8_scale"], False,
        )


@pytest.mark.skipif(
    _CASES is None, reason=f"golden vectors not found at {VECTORS} (set DSV41_VECTORS)"
)
@pytest.mark.parametrize("name", [c[0] for c in (_CASES or [])])
def test_golden(name):
    d = dict(_CASES)[name]
    args = {k: _clone(v) for k, v in d["args"].items()}
    _run(d["op"], args)
    assert d["out"], name
    for key, want in d["out"].items():
        got_b, want_b = _storage_bytes(args[key]), _storage_bytes(want)
        assert got_b.numel() == want_b.numel()
        bad = int((got_b != want_b).sum())
        assert bad == 0, f"{name}: {key}: {bad} of {want_b.numel()} storage bytes differ"
    # inputs that are not outputs stay untouched
    for key, v in d["args"].items():
        if torch.is_tensor(v) and key not in d["out"]:
            assert torch.equal(_storage_bytes(args[key]), _storage_bytes(v)), key


def test_golden_cases_present():
    if _CASES is None:
        pytest.skip(f"golden vectors not found at {VECTORS}")
    names = {c[0] for c in _CASES}
    assert {"save_compress_norm_cr1", "save_compress_norm_cr2"} <= names
    assert sum(n.startswith("rope_quant_insert") for n in names) == 7


# ---------------------------------------------------------------------------------------
# hand-made cases
# ---------------------------------------------------------------------------------------

B = 16


def _cos_sin(max_pos=64, dtype=torch.float32):
    inv = 10000.0 ** (-torch.arange(32, dtype=torch.float64) / 32)
    ang = torch.arange(max_pos, dtype=torch.float64)[:, None] * inv[None]
    return torch.cat((ang.cos(), ang.sin()), 1).to(dtype)


def _paged(nb, width, pad, fill=0xA5):
    """uint8 [nb, B, width] view with page stride B*width + pad; returns (view, base)."""
    page = B * width + pad
    base = torch.full((nb * page,), fill, dtype=torch.uint8)
    return base.as_strided((nb, B, width), (page, width, 1)), base


def _rotate64(x, cs):
    """fp64 GPT-J RoPE of dims 448..511 (for value checks, not bytes)."""
    y = x.double().clone()
    c, s = cs[:, :32].double(), cs[:, 32:].double()
    e, o = x[:, 448::2].double(), x[:, 449::2].double()
    y[:, 448::2] = e * c - o * s
    y[:, 449::2] = o * c + e * s
    return y


def _half_gap(x):
    """Half the e2m1 grid spacing at |x| (values past 6 are saturated)."""
    a = x.abs()
    return torch.where(a < 2, 0.25, torch.where(a < 4, 0.5, 1.0))


def test_nvfp4_288_round_trip():
    torch.manual_seed(0)
    T, nb, pad = 12, 3, 512
    scales = torch.exp2(torch.randint(-6, 7, (T, 32)).float()).repeat_interleave(16, 1)
    latent = (torch.randn(T, 512) * scales).to(torch.bfloat16)
    positions = torch.arange(T) + 5
    slots = torch.tensor([0, 17, -1, 47, 3, 30, 15, 16, -3, 40, 2, 33])
    cos_sin = _cos_sin()
    kv, base = _paged(nb, 288, pad)
    before = base.clone()
    rope_quant_insert(latent, positions, cos_sin, kv, slots, 1, None, False)

    page_bytes = B * 288 + pad
    written = torch.zeros_like(base, dtype=torch.bool)
    want = _rotate64(latent.float(), cos_sin[positions])
    for t in range(T):
        s = int(slots[t])
        if s < 0:
            continue
        p, r = divmod(s, B)
        vo = p * page_bytes + 256 * r
        so = p * page_bytes + 256 * B + 32 * r
        written[vo : vo + 256] = True
        written[so : so + 32] = True
        S = e4m3_decode(base[so : so + 32]).repeat_interleave(16)
        codes = unpack_nibbles(base[vo : vo + 256])
        dec = e2m1_decode(codes).double() * S.double()
        v = want[t]
        assert torch.all(S > 0)
        # |decoded - value| within half an e2m1 step at the group's scale, plus the
        # saturation past 6·S (a subnormal e4m3 scale can round well below amax/6)
        err = (dec - v).abs()
        bound = _half_gap(v / S) * S + (v.abs() - 6 * S).clamp(min=0)
        assert torch.all(err <= bound + 1e-12), (t, float((err / S).max()))
    # nothing else (other records, page padding) was written
    assert torch.equal(base[~written], before[~written])


def test_nvfp4_288_e2m1_ties():
    # One NoPE group (dims 0..15) with amax 6 -> scale e4m3(1.0) = 0x38, holding every tie.
    vals = [0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0,
            -0.25, -0.75, -1.25, -1.75, -2.5, -3.5, -5.0, 0.1]
    want = [0x0, 0x2, 0x2, 0x4, 0x4, 0x6, 0x6, 0x7,
            0x8, 0xA, 0xA, 0xC, 0xC, 0xE, 0xE, 0x0]
    latent = torch.ones(1, 512)
    latent[0, :16] = torch.tensor(vals)
    latent = latent.to(torch.bfloat16)
    kv, base = _paged(1, 288, 0)
    rope_quant_insert(latent, torch.tensor([0]), _cos_sin(), kv, torch.tensor([5]), 1, None, False)
    rec = base[256 * 5 : 256 * 5 + 256]
    assert unpack_nibbles(rec[:8]).tolist() == want
    assert int(base[256 * B + 32 * 5]) == 0x38  # scale 1.0
    # group 1 is all ones: amax 1 -> s = e4m3(1/6) = 0x23 (0.171875); 1/s = 5.818 -> 6 (0x7)
    assert int(base[256 * B + 32 * 5 + 1]) == 0x23
    assert unpack_nibbles(rec[8:16]).tolist() == [0x7] * 16


def _one_token_case(width, row):
    latent = row.reshape(1, 512).to(torch.bfloat16)
    kv, base = _paged(1, width, 64)
    return latent, kv, base


def test_sanitize_528():
    row = torch.ones(512)
    row[0] = float("inf")  # group 0: code 255 (254 sanitized)
    row[40] = float("nan")  # group 1: NaN (0x7E, or 0 sanitized)
    row[480] = float("nan")  # RoPE pair 16: both lanes NaN after rotation
    out = {}
    for sanitize in (False, True):
        latent, kv, base = _one_token_case(528, row)
        rope_quant_insert(
            latent, torch.tensor([3]), _cos_sin(), kv, torch.tensor([2]), 1, None, sanitize
        )
        vals = base[512 * 2 : 512 * 3]
        codes = base[512 * B + 16 * 2 : 512 * B + 16 * 3]
        out[sanitize] = (vals.clone(), codes.clone())
    (v0, c0), (v1, c1) = out[False], out[True]
    assert int(c0[0]) == 255 and int(c1[0]) == 254
    assert int(v0[0]) == 0x7E and int(v1[0]) == 0x7E  # inf·2^-inf = NaN -> +448, both modes
    assert int(v0[1]) == 0x7E and int(v1[1]) == 0x00  # its partner lane is NaN (F2)
    assert int(v0[40]) == 0x7E and int(v1[40]) == 0x00
    assert int(v0[41]) == 0x7E and int(v1[41]) == 0x00  # NaN partner (F2)
    assert int(v0[480]) == 0x7E and int(v0[481]) == 0x7E
    assert int(v1[480]) == 0x00 and int(v1[481]) == 0x00
    # only the NaN positions and the codes differ
    diff = (v0 != v1).nonzero().flatten().tolist()
    assert diff == [1, 40, 41, 480, 481]
    assert torch.equal(c0[1:], c1[1:])


def test_sanitize_584():
    row = torch.ones(512)
    row[64] = float("inf")  # NoPE group 1: code 255 / 254
    row[500] = float("nan")  # RoPE pair 26 -> bf16 0x7FFF or 0
    out = {}
    for sanitize in (False, True):
        latent, kv, base = _one_token_case(584, row)
        rope_quant_insert(
            latent, torch.tensor([1]), _cos_sin(), kv, torch.tensor([0]), 2, None, sanitize
        )
        out[sanitize] = (base[:576].clone(), base[576 * B : 576 * B + 8].clone())
    (v0, c0), (v1, c1) = out[False], out[True]
    assert int(c0[0]) == 119 and int(c0[1]) == 255  # ones: e = ceil(log2(1/448)) = -8
    assert int(c1[1]) == 254 and int(c0[7]) == 0 and int(c1[7]) == 0
    rope0 = v0[448:].view(torch.int16)
    rope1 = v1[448:].view(torch.int16)
    j = (500 - 448)
    assert int(rope0[j]) == 0x7FFF and int(rope0[j + 1]) == 0x7FFF
    assert int(rope1[j]) == 0 and int(rope1[j + 1]) == 0
    # the unrotated NoPE quantization is not sanitized: the inf becomes +448 either way
    assert int(v0[64]) == 0x7E and int(v1[64]) == 0x7E
    assert torch.equal(v0[:448], v1[:448])


def test_t0_writes_nothing():
    empty = torch.zeros(0, dtype=torch.int64)
    latent = torch.full((4, 512), float("nan"), dtype=torch.bfloat16)
    for width in (584, 528, 288):
        kv, base = _paged(2, width, 32)
        before = base.clone()
        rope_quant_insert(latent, torch.arange(4), _cos_sin(), kv, empty, 1, None, True)
        assert torch.equal(base, before)
    plain = torch.full((2, B, 512), 3.0, dtype=torch.bfloat16)
    rope_quant_insert(latent, torch.arange(4), _cos_sin(), plain, empty, 1, None, False)
    assert bool((plain == 3.0).all())

    kv_score = torch.randn(4, 1024)
    state = torch.randn(2, 4, 1024)
    state_before = state.clone()
    lat = torch.full((4, 512), float("nan"), dtype=torch.bfloat16)
    w = torch.ones(512, dtype=torch.bfloat16)
    fused_save_compress_norm(kv_score, torch.arange(4), state, empty,
                             torch.tensor([0, 0], dtype=torch.int32),
                             torch.zeros(0, dtype=torch.int32), w, 1e-6, 2, lat)
    assert bool(lat.isnan().all()) and torch.equal(state, state_before)
    fused_save_compress_norm(kv_score[:, :512], torch.arange(4), None, empty, None, None,
                             w, 1e-6, 1, lat)
    assert bool(lat.isnan().all())


@pytest.mark.parametrize("width", [584, 528, 288])
def test_paged_views_honoured(width):
    """Same records in a tight cache and in an offset, padded page view; nothing else written."""
    torch.manual_seed(1)
    T = 9
    latent = (torch.randn(T, 512) * 3).to(torch.bfloat16)
    positions = torch.arange(T) * 2 + 1
    slots = torch.tensor([5, 31, -1, 16, 0, 47, 20, 33, 2])
    cos_sin = _cos_sin(64)
    tight = torch.full((3, B, width), 0xA5, dtype=torch.uint8)
    rope_quant_insert(latent, positions, cos_sin, tight, slots, 2, None, False)
    page, off = B * width + 320, 13
    base = torch.full((off + 3 * page,), 0x5A, dtype=torch.uint8)
    view = base.as_strided((3, B, width), (page, width, 1), off)
    view.copy_(torch.full_like(view, 0xA5))
    before = base.clone()
    rope_quant_insert(latent, positions, cos_sin, view, slots, 2, None, False)
    assert torch.equal(view, tight)
    outside = torch.ones_like(base, dtype=torch.bool)
    for p in range(3):
        outside[off + p * page : off + p * page + B * width] = False
    assert torch.equal(base[outside], before[outside])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float8_e4m3fn])
def test_plain_row_views_honoured(dtype):
    """Plain rows as a [:, :, :512] slice of wider rows: the other columns stay untouched."""
    torch.manual_seed(2)
    T = 6
    latent = torch.randn(T, 512).to(torch.bfloat16)
    positions = torch.arange(T) + 3
    slots = torch.tensor([3, -1, 17, 0, 30, 9])
    cos_sin = _cos_sin(64, torch.bfloat16)
    scale = torch.tensor([0.05], dtype=torch.float32) if dtype != torch.bfloat16 else None
    tight = torch.zeros(2, B, 512, dtype=dtype)
    rope_quant_insert(latent, positions, cos_sin, tight, slots, 1, scale, False)
    wide = torch.zeros(2, B, 576, dtype=dtype)
    wide.view(torch.uint8).fill_(0x77)
    before = wide.clone()
    view = wide[:, :, :512]
    untouched = view.clone()
    rope_quant_insert(latent, positions, cos_sin, view, slots, 1, scale, False)
    assert torch.equal(wide[:, :, 512:].view(torch.uint8), before[:, :, 512:].view(torch.uint8))
    s = slots[slots >= 0]
    got, want = view.view(torch.uint8), tight.view(torch.uint8)
    assert torch.equal(got[s // B, s % B], want[s // B, s % B])
    mask = torch.ones(2, B, dtype=torch.bool)
    mask[s // B, s % B] = False
    assert torch.equal(got[mask], untouched.view(torch.uint8)[mask])
