"""The two places of the V4.1 records' scales (``dsv41.core.formats``) through the public API.

* the default is vLLM 0.33's interleaved record: each token's scales right after its values;
* ``v41_layout="paged"`` writes the development snapshot's page layout, and the two hold the
  same record bytes at permuted offsets (insert, rope_quant_insert), page padding untouched;
* a gather reads back the same bf16 from either layout; reading with the wrong layout does not;
* ``transcode_k_cache`` moves a cache between the layouts (with or without a flavour change),
  and the result equals what the writer produces in the target layout.
"""

from __future__ import annotations

import pytest
import torch

import dsv41
from dsv41.tools.conformance import edge_rows
from dsv41.core.formats import RECORDS, CacheLayout

U8, I32, I64, BF16, F32 = torch.uint8, torch.int32, torch.int64, torch.bfloat16, torch.float32
CANARY = 0xA5
B, NB, PAD = 16, 5, 48


def _cache(width: int) -> torch.Tensor:
    """``[NB, B, width]`` view on canary-filled pages with PAD bytes of padding each."""
    raw = torch.full((NB, B * width + PAD), CANARY, dtype=U8)
    return raw[:, : B * width].view(NB, B, width)


def _storage(t: torch.Tensor) -> torch.Tensor:
    return t.as_strided((t.shape[0], t.stride(0)), (t.stride(0), 1)).clone()


def _to_layout(cache: torch.Tensor, interleaved: bool) -> torch.Tensor:
    """The record bytes of a paged-layout cache moved to ``interleaved`` offsets (test oracle,
    from ``CacheLayout``'s index maps)."""
    width = cache.shape[-1]
    rec = RECORDS[width]
    src = CacheLayout(rec, B, cache.stride(0))
    dst = CacheLayout(rec, B, cache.stride(0), interleaved=interleaved)
    out = _storage(cache)
    t = torch.arange(B).unsqueeze(1)
    for idx in ("value", "scale"):
        n = rec.value_bytes if idx == "value" else rec.scale_bytes
        j = torch.arange(n).unsqueeze(0)
        s = getattr(src, f"{idx}_index")(t, j).reshape(-1)
        d = getattr(dst, f"{idx}_index")(t, j).reshape(-1)
        out[:, d] = _storage(cache)[:, s]
    return out


def _insert(width, layout=None):
    k = edge_rows(40, 512, 3).to(BF16)
    slots = torch.randperm(NB * B, generator=torch.Generator().manual_seed(4))[:40].to(I64)
    slots[5] = -1
    cache = _cache(width)
    kw = {} if layout is None else {"v41_layout": layout}
    dsv41.quantize_and_insert_k_cache(k, cache, slots, B, bytes_per_token=width, **kw)
    return cache


def _rope_insert(width, layout=None):
    g = torch.Generator().manual_seed(5)
    latent = edge_rows(30, 512, 6).to(BF16)
    pos = torch.randint(0, 200, (30,), generator=g, dtype=I64)
    cs = torch.randn(256, 64, generator=g, dtype=F32)
    slots = torch.randperm(NB * B, generator=g)[:30].to(I64)
    slots[2] = -1
    cache = _cache(width)
    kw = {} if layout is None else {"v41_layout": layout}
    dsv41.rope_quant_insert(latent, pos, cs, cache, slots, 1, **kw)
    return cache


WRITERS = {"insert": (_insert, (528,)), "rope_quant_insert": (_rope_insert, (528, 288))}
CASES = [(w, width) for w, (_, widths) in WRITERS.items() for width in widths]


@pytest.mark.parametrize("writer,width", CASES)
def test_default_is_interleaved_and_layouts_are_a_permutation(writer, width):
    fn = WRITERS[writer][0]
    default, interleaved, paged = fn(width), fn(width, "interleaved"), fn(width, "paged")
    assert torch.equal(_storage(default), _storage(interleaved))
    assert not torch.equal(_storage(interleaved), _storage(paged))
    assert torch.equal(_storage(interleaved), _to_layout(paged, True))
    # padding past the records never written in either layout
    assert bool((_storage(interleaved)[:, B * width:] == CANARY).all())


def _gather(cache, layout):
    out = torch.zeros((1, NB * B, 512), dtype=BF16)
    seq = torch.tensor([NB * B], dtype=I32)
    table = torch.arange(NB, dtype=I32).unsqueeze(0)
    dsv41.dequantize_and_gather_k_cache(out, cache, seq, None, table, B, 0, v41_layout=layout)
    return out


@pytest.mark.parametrize("writer,width", CASES)
def test_gather_reads_either_layout(writer, width):
    fn = WRITERS[writer][0]
    want = _gather(fn(width, "paged"), "paged")
    assert torch.equal(_gather(fn(width, "interleaved"), "interleaved").view(torch.int16), want.view(torch.int16))
    wrong = _gather(fn(width, "interleaved"), "paged")
    assert not torch.equal(wrong.view(torch.int16), want.view(torch.int16))


@pytest.mark.parametrize("width", (528, 288))
@pytest.mark.parametrize("direction", ("paged-to-interleaved", "interleaved-to-paged"))
def test_transcode_changes_layout(width, direction):
    src_layout, dst_layout = direction.split("-to-")
    writer = _insert if width == 528 else _rope_insert
    src = writer(width, src_layout)
    want = writer(width, dst_layout)
    ids = torch.tensor([3, -1, 0, 1, 2, 4, 9], dtype=I32)
    dst = _cache(width)
    dsv41.transcode_k_cache(src, dst, ids, False, False, src_v41_layout=src_layout, dst_v41_layout=dst_layout)
    assert torch.equal(_storage(dst), _storage(want))
    # in place
    dsv41.transcode_k_cache(src, src, ids, False, False, src_v41_layout=src_layout, dst_v41_layout=dst_layout)
    assert torch.equal(_storage(src), _storage(want))


def test_transcode_flavour_and_layout_at_once():
    """OCP paged (snapshot) -> FNUZ interleaved equals OCP paged -> FNUZ paged, relaid out;
    and the way back decodes to the same values as the original (FNUZ has no −0: it becomes +0)."""
    src = _insert(528, "paged")
    ids = torch.arange(NB, dtype=I32)
    fnuz_paged = _cache(528)
    dsv41.transcode_k_cache(src, fnuz_paged, ids, False, True, src_v41_layout="paged", dst_v41_layout="paged")
    fnuz_il = _cache(528)
    dsv41.transcode_k_cache(src, fnuz_il, ids, False, True, src_v41_layout="paged")
    assert torch.equal(_storage(fnuz_il), _to_layout(fnuz_paged, True))
    back = _cache(528)
    dsv41.transcode_k_cache(fnuz_il, back, ids, True, False, dst_v41_layout="paged")
    got, want = _gather(back, "paged").float(), _gather(src, "paged").float()
    assert torch.equal(got.isnan(), want.isnan())
    assert torch.equal(torch.nan_to_num(got) + 0.0, torch.nan_to_num(want) + 0.0)
    assert bool((_storage(back)[:, B * 528:] == CANARY).all())


def test_bad_layout_names_the_argument():
    k = torch.zeros(2, 512, dtype=BF16)
    with pytest.raises(ValueError, match="v41_layout.*interleaved.*paged"):
        dsv41.quantize_and_insert_k_cache(k, _cache(528), torch.zeros(2, dtype=I64), B,
                                          bytes_per_token=528, v41_layout="per-token")
    with pytest.raises(TypeError, match="v41_layout"):
        dsv41.quantize_and_insert_k_cache(k, _cache(528), torch.zeros(2, dtype=I64), B,
                                          bytes_per_token=528, v41_layout=True)
    with pytest.raises(ValueError, match="src_fnuz"):
        dsv41.transcode_k_cache(_cache(288), _cache(288), torch.zeros(1, dtype=I32), True, False,
                                src_v41_layout="paged")
