"""Cross-backend cache interchange: a cache written by one implementation and read by another
gives the reference's result, in both fp8 flavours (and after an FNUZ<->OCP transcode).

Pairs are every (writer, reader) of the implementations that can run here: the reference, the
cpu backend, the Triton backends under TRITON_INTERPRET=1 and the CUDA ones on a GPU.
"""

from __future__ import annotations

import itertools

import pytest
import torch

from dsv41.tools.conformance import _on, _paged, _slots, clone_args, edge_rows, written_bytes
from dsv41.reference import ReferenceBackend
from impls import Impl, implementations

IMPLS = [Impl("reference", ReferenceBackend(), "cpu")] + [i for i in implementations() if i.device is not None]
PAIRS = list(itertools.product(IMPLS, IMPLS))
BS, NB, N = 64, 4, 150


def _write_args(width, fnuz, writer_kind):
    k = edge_rows(N, 512, seed=21).to(torch.bfloat16)
    cache = _paged(NB, BS, width, 512)
    slots = _slots(N, NB, BS, seed=21, holes=(-1,))
    if writer_kind == "insert":
        flat = cache.as_strided((NB, cache.stride(0)), (cache.stride(0), 1))
        return [k, flat, slots, BS, fnuz, width], cache
    pos = torch.arange(N, dtype=torch.int64)
    from dsv41.tools.conformance import _cos_sin

    return [k, pos, _cos_sin(N, 64), cache, slots, 1, None, False], cache


def _read_args(cache):
    seq = torch.tensor([BS * 2, BS + 20, 7], dtype=torch.int32)
    table = torch.tensor([[0, 1, -1], [2, 3, -1], [1, -1, -1]], dtype=torch.int32)
    out = torch.zeros(3, 2 * BS, 512, dtype=torch.bfloat16)
    return [out, cache, seq, None, table, BS, 0]


def _roundtrip(writer, reader, op, width, fnuz):
    args, _ = _write_args(width, fnuz, "insert" if op == "quantize_and_insert_k_cache" else "rope")
    cache_idx = 1 if op == "quantize_and_insert_k_cache" else 3
    w = _on(writer.device, clone_args(args))
    writer.kernel(op)(*w)
    cache = w[cache_idx]
    if cache.dim() == 2:
        cache = cache.as_strided((NB, BS, width), (cache.stride(0), width, 1))
    r = _on(reader.device, clone_args(_read_args(cache.cpu() if writer.device != "cpu" else cache)))
    reader.kernel("dequantize_and_gather_k_cache")(*r, fnuz)
    return written_bytes(r[0])


@pytest.mark.parametrize("fnuz", [False, True], ids=["ocp", "fnuz"])
@pytest.mark.parametrize("width", [584, 528])
@pytest.mark.parametrize("op", ["quantize_and_insert_k_cache", "rope_quant_insert"])
@pytest.mark.parametrize("writer,reader", PAIRS, ids=[f"{a.name}->{b.name}" for a, b in PAIRS])
def test_write_on_one_read_on_another(writer, reader, op, width, fnuz):
    if op == "rope_quant_insert" and fnuz:
        pytest.skip("rope_quant_insert writes OCP caches only (spec C §8.2)")
    for impl, o in ((writer, op), (reader, "dequantize_and_gather_k_cache")):
        if impl.skip_reason(o):
            pytest.skip(impl.skip_reason(o))
    ref = ReferenceBackend()
    want = _roundtrip(Impl("reference", ref, "cpu"), Impl("reference", ref, "cpu"), op, width, fnuz)
    got = _roundtrip(writer, reader, op, width, fnuz)
    assert torch.equal(got, want), f"{(got != want).sum().item()} bytes differ"


@pytest.mark.parametrize("writer,reader", PAIRS, ids=[f"{a.name}->{b.name}" for a, b in PAIRS])
def test_fnuz_cache_transcoded_to_ocp_reads_the_same(writer, reader):
    """FNUZ cache written by one backend, transcoded to OCP by another, read as OCP = read as FNUZ."""
    for impl, o in ((writer, "quantize_and_insert_k_cache"), (reader, "transcode_k_cache")):
        if impl.skip_reason(o):
            pytest.skip(impl.skip_reason(o))
    args, cache = _write_args(528, True, "insert")
    w = _on(writer.device, clone_args(args))
    writer.kernel("quantize_and_insert_k_cache")(*w)
    fnuz_cache = w[1].as_strided((NB, BS, 528), (w[1].stride(0), 528, 1)).cpu()
    ref = ReferenceBackend()
    as_fnuz = _read_args(fnuz_cache)
    ref.load("dequantize_and_gather_k_cache")(*as_fnuz, True)
    src = _on(reader.device, clone_args([fnuz_cache]))[0]
    dst = _on(reader.device, clone_args([fnuz_cache]))[0]
    ids = torch.arange(NB, dtype=torch.int64, device=src.device)
    reader.kernel("transcode_k_cache")(src, dst, ids, BS, 528, True, False, False)
    as_ocp = _read_args(dst.cpu())
    ref.load("dequantize_and_gather_k_cache")(*as_ocp, False)
    assert torch.equal(written_bytes(as_ocp[0]), written_bytes(as_fnuz[0]))
