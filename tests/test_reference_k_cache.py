"""The K-cache reference (dsv41.reference.k_cache) against vLLM's H200 golden vectors,
plus hand-made FNUZ / skip / empty cases."""

from __future__ import annotations

import functools
import io
import os
import pathlib
import tarfile

import pytest
import torch

import golden  # noqa: E402  (tests/ is on sys.path)

from dsv41.core.codecs import e4m3_decode
from dsv41.core.formats import V4_FP8, V41_MXFP8, V41_NVFP4
from dsv41.reference.k_cache import (
    dequantize_and_gather_k_cache,
    quantize_and_insert_k_cache,
    quantize_nvfp4_groups,
    quantize_ue8m0_groups,
)

REPO = pathlib.Path(__file__).resolve().parents[1]
VECTORS = golden.ARCHIVE  # tests/vectors (DSV41_VECTORS overrides)
OPS = ("quantize_and_insert_k_cache", "dequantize_and_gather_k_cache")
# Arguments the public layer consumes before calling a kernel.
PUBLIC_ONLY = ("is_ue8m0", "max_gather_len")
KERNEL_ARGS = {
    "quantize_and_insert_k_cache": (
        "k", "k_cache", "slot_mapping", "block_size", "use_fnuz", "bytes_per_token"),
    "dequantize_and_gather_k_cache": (
        "out", "k_cache", "seq_lens", "gather_lens", "block_table", "block_size",
        "offset", "use_fnuz"),
}
REFERENCE = {
    "quantize_and_insert_k_cache": quantize_and_insert_k_cache,
    "dequantize_and_gather_k_cache": dequantize_and_gather_k_cache,
}


@functools.lru_cache(maxsize=1)
def _cases() -> dict[str, dict]:
    cases = {}
    with tarfile.open(VECTORS, "r:xz") as tar:
        for member in tar.getmembers():
            if not member.isfile() or not member.name.endswith(".pt"):
                continue
            case = torch.load(io.BytesIO(tar.extractfile(member).read()), weights_only=True)
            if case["op"] in OPS:
                cases[pathlib.Path(member.name).name] = case
    return cases


def _case_names() -> list[str]:
    if not VECTORS.is_file():
        return []
    return sorted(_cases())


def _clone_view(t):
    """Deep copy that keeps the view: same size, stride and offset over a cloned storage."""
    if not isinstance(t, torch.Tensor):
        return t
    storage = t.untyped_storage()
    new = torch.UntypedStorage(storage.nbytes(), device=t.device)
    new.copy_(storage)
    return torch.empty(0, dtype=t.dtype, device=t.device).set_(
        new, t.storage_offset(), t.size(), t.stride()
    )


def _storage_bytes(t: torch.Tensor) -> torch.Tensor:
    return torch.empty(0, dtype=torch.uint8, device=t.device).set_(t.untyped_storage())


needs_vectors = pytest.mark.skipif(
    not VECTORS.is_file(), reason=f"golden vectors not found at {VECTORS} (set DSV41_VECTORS)"
)


@needs_vectors
def test_vectors_present():
    names = _case_names()
    assert sum(n.startswith("quantize_insert") for n in names) == 4
    assert sum(n.startswith("gather_") for n in names) == 6


@needs_vectors
@pytest.mark.parametrize("name", _case_names() or ["<no vectors>"])
def test_golden(name):
    case = _cases()[name]
    op = case["op"]
    args = {k: _clone_view(v) for k, v in case["args"].items() if k not in PUBLIC_ONLY}
    assert set(args) == set(KERNEL_ARGS[op])
    inputs_before = {k: _storage_bytes(v).clone() for k, v in args.items()
                     if isinstance(v, torch.Tensor) and k not in case["out"]}
    assert REFERENCE[op](*(args[k] for k in KERNEL_ARGS[op])) is None
    for key, expected in case["out"].items():
        got = _storage_bytes(args[key])
        want = _storage_bytes(expected)
        bad = (got != want).nonzero().flatten()
        assert bad.numel() == 0, (
            f"{name}: {key}: {bad.numel()} of {want.numel()} storage bytes differ, "
            f"first at byte {bad[:8].tolist()}: got {got[bad[:8]].tolist()} "
            f"want {want[bad[:8]].tolist()}"
        )
    for key, before in inputs_before.items():
        assert torch.equal(_storage_bytes(args[key]), before), f"input {key} was modified"


# ---------------------------------------------------------------------------------------
# Hand-made cases
# ---------------------------------------------------------------------------------------

B = 16
CANARY = 0xA5


def _cache(rec, num_blocks=4, pad=64, as_3d=True):
    """A canary-filled cache view with page padding (stride(0) > B * width)."""
    page = B * rec.width + pad
    buf = torch.full((num_blocks * page + 32,), CANARY, dtype=torch.uint8)
    if as_3d:
        return buf.as_strided((num_blocks, B, rec.width), (page, rec.width, 1), 16)
    return buf.as_strided((num_blocks, page), (page, 1), 16)


def _k(t, seed=0):
    g = torch.Generator().manual_seed(seed)
    scales = 2.0 ** torch.randint(-6, 7, (t, 16, 1), generator=g).float()
    return (torch.randn(t, 16, 32, generator=g) * scales).reshape(t, 512).to(torch.bfloat16)


def _gather(cache, t, use_fnuz):
    """Gather slots 0..t-1 as positions 0..t-1 of one request (identity block table)."""
    table = torch.arange(cache.shape[0], dtype=torch.int32).reshape(1, -1)
    out = torch.full((1, t, 512), 7.0, dtype=torch.bfloat16)
    dequantize_and_gather_k_cache(
        out, cache, torch.tensor([t], dtype=torch.int32), None, table, B, 0, use_fnuz)
    return out[0]


@pytest.mark.parametrize("rec", [V4_FP8, V41_MXFP8], ids=["584", "528"])
@pytest.mark.parametrize("as_3d", [True, False], ids=["3d", "flat"])
def test_fnuz_round_trip(rec, as_3d):
    t = 2 * B + 5
    k = _k(t, seed=1)
    slots = torch.arange(t, dtype=torch.int64)
    cache = _cache(rec, as_3d=as_3d)
    quantize_and_insert_k_cache(k, cache, slots, B, True, rec.width)
    # The gather takes the record width from shape[-1]: re-view a flat cache as [nb, B, W].
    view = cache if as_3d else cache.as_strided(
        (cache.shape[0], B, rec.width), (cache.stride(0), rec.width, 1))
    got = _gather(view, t, True).float()
    ref = k.float()
    # e4m3 keeps 3 mantissa bits: |err| <= 2^-4 * |x| rounded, plus scale-granularity
    # subnormals; bound per group by 2^-4 of the group amax.
    g = rec.group
    amax = ref[:, : rec.quant_dims].reshape(t, -1, g).abs().amax(-1, keepdim=True)
    err = (got[:, : rec.quant_dims] - ref[:, : rec.quant_dims]).reshape(t, -1, g).abs()
    assert bool((err <= amax * 2.0**-4).all())
    assert torch.equal(got[:, rec.quant_dims :], ref[:, rec.quant_dims :])


@pytest.mark.parametrize("rec", [V4_FP8, V41_MXFP8], ids=["584", "528"])
def test_fnuz_vs_ocp_bytes(rec):
    """FNUZ (clamp 224, bias 8) vs OCP (clamp 448, bias 7), same UE8M0 bias 127 (§2.4).

    r_fnuz = A'*fl32(1/224) = 2*r_ocp exactly, so e_fnuz = e_ocp + 1 (code + 1) and the
    scaled value halves; an FNUZ byte decodes to half the OCP value of the same bits, so
    the value bytes are identical except that FNUZ has no -0 (0x80 -> 0x00), and both
    caches dequantize to the same bf16 rows.
    """
    t = 9
    k = _k(t, seed=2)
    k[3] = 0.0
    k[4] = -0.0
    k[5, :64] = 448.0 * 2.0**-3  # amax exactly on a power-of-two boundary
    slots = torch.arange(t, dtype=torch.int64)
    ocp, fnuz = _cache(rec), _cache(rec)
    quantize_and_insert_k_cache(k, ocp, slots, B, False, rec.width)
    quantize_and_insert_k_cache(k, fnuz, slots, B, True, rec.width)
    n, vb, sb = rec.quant_dims, rec.value_bytes, rec.scale_bytes
    page_o, page_f = ocp[0].reshape(-1), fnuz[0].reshape(-1)
    vo = page_o[: t * vb].reshape(t, vb)
    vf = page_f[: t * vb].reshape(t, vb)
    so = page_o[B * vb : B * vb + t * sb].reshape(t, sb)
    sf = page_f[B * vb : B * vb + t * sb].reshape(t, sb)
    g = rec.n_groups
    assert torch.equal(sf[:, :g].int(), so[:, :g].int() + 1)
    assert torch.equal(sf[:, g:], so[:, g:])  # pad byte (584)
    assert torch.equal(vf[:, :n], torch.where(vo[:, :n] == 0x80, 0, vo[:, :n]))
    assert torch.equal(vf[:, n:], vo[:, n:])  # bf16 tail (584)
    assert bool((vo[4, :n] == 0x80).all()) and bool((vf[4, :n] == 0x00).all())
    assert torch.equal(e4m3_decode(vf[:, :n], fnuz=True), e4m3_decode(vo[:, :n]) / 2)
    assert torch.equal(_gather(fnuz, t, True), _gather(ocp, t, False))


@pytest.mark.parametrize("rec", [V4_FP8, V41_MXFP8], ids=["584", "528"])
def test_empty_slot_mapping_writes_nothing(rec):
    cache = _cache(rec)
    before = _storage_bytes(cache).clone()
    empty = torch.empty(0, dtype=torch.int64)
    quantize_and_insert_k_cache(_k(3), cache, empty, B, False, rec.width)
    assert torch.equal(_storage_bytes(cache), before)


@pytest.mark.parametrize("rec", [V4_FP8, V41_MXFP8], ids=["584", "528"])
def test_negative_slots_leave_canaries(rec):
    cache = _cache(rec, as_3d=False)
    k = _k(6, seed=3)
    k[[1, 4]] = float("nan")  # skipped rows are never read
    slots = torch.tensor([5, -1, B + 2, -1, 3 * B + B - 1, -7], dtype=torch.int64)
    quantize_and_insert_k_cache(k, cache, slots, B, False, rec.width)
    mem = _storage_bytes(cache)
    written = torch.zeros_like(mem, dtype=torch.bool)
    page = cache.stride(0)
    for s in (5, B + 2, 4 * B - 1):
        base = 16 + (s // B) * page
        t = s % B
        written[base + t * rec.value_bytes : base + (t + 1) * rec.value_bytes] = True
        sb = base + B * rec.value_bytes + t * rec.scale_bytes
        written[sb : sb + rec.scale_bytes] = True
    assert bool((mem[~written] == CANARY).all())
    assert not bool((mem[written] == CANARY).all())


def test_gather_writes_only_its_rows():
    rec = V41_MXFP8
    cache = _cache(rec, num_blocks=3)
    quantize_and_insert_k_cache(_k(3 * B), cache, torch.arange(3 * B), B, False, rec.width)
    out = torch.full((2, 40, 512), -3.0, dtype=torch.bfloat16)
    # Non-contiguous table rows (stride 5) with garbage in entries never read.
    table = torch.full((2, 5), -1, dtype=torch.int32)[:, :3]
    table[0, :2] = torch.tensor([2, 0], dtype=torch.int32)
    table[1, :3] = torch.tensor([1, 0, 2], dtype=torch.int32)
    seq = torch.tensor([20, 40], dtype=torch.int32)
    glen = torch.tensor([6, 0], dtype=torch.int32)
    dequantize_and_gather_k_cache(out, cache, seq, glen, table, B, 4, False)
    assert bool((out[0, :4] == -3).all()) and bool((out[0, 10:] == -3).all())
    assert bool((out[1] == -3).all())
    full = torch.full((1, 48, 512), 0.0, dtype=torch.bfloat16)
    dequantize_and_gather_k_cache(
        full, cache, torch.tensor([48], dtype=torch.int32), None,
        torch.tensor([[2, 0, 1]], dtype=torch.int32), B, 0, False)
    assert torch.equal(out[0, 4:10], full[0, 14:20])


def test_ue8m0_nonfinite_and_sanitize():
    x = torch.zeros(1, 64)
    x[0, :32] = torch.linspace(-3, 3, 32)
    x[0, 5] = float("nan")
    x[0, 32:] = torch.linspace(-1, 1, 32)
    x[0, 40] = float("-inf")
    x[0, 41] = float("inf")
    q, code = quantize_ue8m0_groups(x, 32, 448.0, False)
    # NaN ignored in the amax: group 0 scale from max |v| = 3 -> e = ceil(log2(3/448)) = -7.
    assert code.tolist() == [[120, 255]]
    assert q[0, 5] == 0x7E
    assert q[0, 40] == 0x7E and q[0, 41] == 0x7E  # +-inf -> canonical +NaN -> +448
    fin = [i for i in range(32, 64) if i not in (40, 41)]
    assert set(q[0, fin].tolist()) <= {0x00, 0x80}
    _, code_s = quantize_ue8m0_groups(x, 32, 448.0, False, sanitize=True)
    assert code_s.tolist() == [[120, 254]]
    # all-zero / -0 groups: code 105, bytes keep the sign of zero (OCP), 0x00 in FNUZ.
    z = torch.tensor([[-0.0] * 32])
    qz, cz = quantize_ue8m0_groups(z, 32, 448.0, False)
    assert cz.item() == 105 and set(qz.flatten().tolist()) == {0x80}
    qf, cf = quantize_ue8m0_groups(z, 32, 224.0, True)
    assert cf.item() == 106 and set(qf.flatten().tolist()) == {0x00}


def test_nvfp4_round_trip():
    # x8 keeps every group scale a normal, unsaturated e4m3 (2^-6 <= amax/6 <= 448),
    # so S <= amax/6 * (1 + 2^-4).
    x = _k(4, seed=5).float() * 8
    packed, scales = quantize_nvfp4_groups(x)
    assert packed.shape == (4, 256) and scales.shape == (4, 32)
    cache = _cache(V41_NVFP4, num_blocks=1)
    page = cache[0].reshape(-1)
    page[: 4 * 256] = packed.reshape(-1)
    page[B * 256 : B * 256 + 4 * 32] = scales.reshape(-1)
    out = torch.zeros(1, 4, 512, dtype=torch.bfloat16)
    dequantize_and_gather_k_cache(
        out, cache, torch.tensor([4], dtype=torch.int32), None,
        torch.zeros(1, 1, dtype=torch.int32), B, 0, False)
    got = out[0].float().reshape(4, 32, 16)
    ref = x.reshape(4, 32, 16)
    amax = ref.abs().amax(-1, keepdim=True)
    # e2m1 step is at most 1 at the top of [0, 6]: |err| <= S with S ~ amax/6 (+e4m3 rounding).
    assert bool(((got - ref).abs() <= amax / 6 * (1 + 2.0**-4)).all())
