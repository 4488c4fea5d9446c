"""Convert paged K caches between the OCP (e4m3fn) and FNUZ (e4m3fnuz) fp8 flavours, and
between the two places of the V4.1 records' scales.

``transcode_k_cache(src, dst, block_ids, src_fnuz, dst_fnuz, block_size=None, *, tiled=None,
src_v41_layout="interleaved", dst_v41_layout="interleaved")`` rewrites the listed pages of
``src`` into the same pages of ``dst`` (``dst`` may be ``src``).

Layouts (528 and 288 records; ``dsv41.core.formats``): ``"interleaved"`` is what vLLM 0.33 writes,
``"paged"`` what its development snapshot writes.  With different ``src_v41_layout`` and
``dst_v41_layout`` every record byte moves to its place in the other layout (values and
scales unchanged unless the flavour changes too), so a cache written by one vLLM version
becomes readable by the other.  The 288 record (NVFP4, no fp8 values, e4m3 scales in OCP)
can only change layout.

Flavours, for every record that holds fp8:

* 584 (V4): 448 e4m3 dims in 7 groups of 64, one ue8m0 code each; the 64 bf16 RoPE dims
  and the pad scale byte are copied verbatim;
* 528 (V4.1 MXFP8): 512 e4m3 dims in 16 groups of 32, one ue8m0 code each;
* 132 (indexer FP8): 128 e4m3 dims, one fp32 scale, row-major or ROCm 16x16 tiled.

The NVFP4 (288) and MXFP4 (68) records hold no fp8 and are rejected (ValueError).

Why it is almost free
---------------------
Both flavours are S.EEEE.MMM; FNUZ has exponent bias 8, OCP bias 7, so for every byte b
other than the special ones, ``fnuz(b) == ocp(b) / 2`` (subnormals included; spec
rope_quant_ops.md §8.1-8.2).  A group decodes as ``x_i * S`` (cache_ops.md §2.2), so it keeps
its values when the bytes stay and ``S`` doubles (OCP -> FNUZ) or halves (FNUZ -> OCP).  The
ue8m0 code *is* the fp32 exponent field of ``S = 2^(code-127)``, so that is code +1 / −1;
an fp32 scale is multiplied by 2 / divided by 2 exactly (bit operations, no rounding).

"Decoded value" below is the readers' definition (cache_ops.md §2.2): ``fp32(e4m3(b)) * S``
with ue8m0 code 0 -> S = 0 (flush) and code 255 -> S = +inf.  "Exact" = every decoded value
of the group is the same fp32 number (NaN stays NaN), except that −0 becomes +0 when
writing FNUZ (FNUZ has no −0).

Decisions, per group (first matching row wins; e = the scale's exponent field: the ue8m0
code, or bits 30..23 of the fp32 scale; ±240 = FNUZ bytes 0x7F / 0xFF, NaN patterns in OCP)
-------------------------------------------------------------------------------------------

======== ============================================ ======= ========= ============================================= ===========================
dir      condition                                    mode    scale     value bytes                                   exact?
======== ============================================ ======= ========= ============================================= ===========================
O -> F   ue8m0 code 0 or 255; fp32 e = 255 (inf/NaN)  PASS    kept      same bits; 0x80 (−0) -> 0x00;                 yes (S = 0 or inf: x*S
                                                                        0x7F / 0xFF (NaN) -> 0x80                     depends only on sign,
                                                                                                                      zero-ness, NaN-ness)
O -> F   ue8m0 code 254; fp32 e = 254                 KEEP    kept      FNUZ byte of the same value: exact for        yes (S >= 2^127: |x| >= 2
                                                                        |x| <= 240, 256..448 saturate to ±240;        overflows fp32 to ±inf
                                                                        ±0 -> 0x00; NaN -> 0x80                       either way)
O -> F   ue8m0 code 1..253; fp32 e <= 253             RESCALE x2        same bits; 0x80 (−0) -> 0x00;                 yes
         (zero and subnormal scales included)                           0x7F / 0xFF (NaN) -> 0x80
F -> O   ue8m0 code 0 or 255; fp32 e = 255            PASS    kept      same bits; 0x80 (NaN) -> 0x7F;                yes
                                                                        ±240 -> ±448 (0x7E / 0xFE)
F -> O   the group holds a ±240 byte                  KEEP    kept      OCP byte of the same value, round to          exact for |x| >= 2^-6
                                                                        nearest even; NaN -> 0x7F; sign kept          (the 240s included); odd
                                                                        (a negative rounding to 0 gives −0)           multiples of 2^-10 below
                                                                                                                      round (error <= 2^-10*S)
F -> O   ue8m0 code 1; fp32 s/2 not exact             KEEP    kept      as above                                      as above
         (e <= 1 and an odd significand)
F -> O   ue8m0 code 2..254; fp32 s/2 exact            RESCALE /2        same bits; 0x80 (NaN) -> 0x7F                 yes
======== ============================================ ======= ========= ============================================= ===========================

Why these and not the alternatives:

* OCP -> FNUZ never overflows with the same bits: OCP's largest finite byte 0x7E (448) is
  FNUZ 224 at twice the scale; no OCP finite byte becomes FNUZ 0x7F.
* FNUZ ±240 -> OCP: at S/2 it would be 480 > 448.  Saturating it to 448 (= 224*S) would lose
  16*S (6.7 %) on the group's largest value; KEEP keeps the code and halves the bytes
  instead, which loses at most 2^-10*S, on values below 2^-6*S only.
* code 255 (S = inf, the code of an inf group): +1 is impossible and no value shift can
  change inf; PASS keeps every decoded ±inf / NaN.  Code 0 (S = 0 for the FTZ readers):
  +1 would turn the zeros into values, −1 is impossible; PASS keeps every ±0 / NaN.
* code 254 OCP -> FNUZ: 255 would turn the finite 2^127 into inf (0 -> NaN); KEEP is exact.
* code 1 FNUZ -> OCP: 0 would flush the group to zeros; KEEP is exact above 2^-6*S.
* fp32 scales follow the same rules with their exponent field; x2 of a zero or subnormal
  scale is exact (RESCALE), /2 is RESCALE whenever it is exact.

Round trips (``tests/test_transcode.py``):

* FNUZ -> OCP -> FNUZ is bit-exact for every group without a ±240 byte whose scale is not
  ue8m0 code 1 (fp32: whose half is exact) — in particular for every cache dsv41's quantizers
  write (FNUZ clamps at 224, so 0x7F / 0xFF / 0x80 never occur; codes are 105..247 or 255;
  the indexer's fp32 scales are powers of two 2^-22 .. 2^120 or inf).
* OCP -> FNUZ -> OCP is bit-exact except −0 -> +0, 0xFF (NaN) -> 0x7F and code-254 (fp32
  e = 254) groups, whose bytes may change (448 -> 240) but decode to the same values.
* A foreign FNUZ group holding ±240 goes through KEEP, so the way back (OCP -> FNUZ, RESCALE)
  gives other bytes with the same decoded values (or PASS at code 0 / 255: ±240 -> ±448).

Layout and scope: values stay in place; only the record bytes of the listed pages
(``block_size * width`` bytes per page) are written, never the page padding nor other pages.
The mode is per group, and the group of the 132 record is a token's 128 value bytes, which
the tiled layout scatters over the page, hence ``tiled`` (keyword-only, default as
``indexer_k_norm_rope_store``: on for ROCm platforms with ``block_size > 1``; only valid for
the 132 record).  ``src_fnuz == dst_fnuz`` copies the record bytes (a no-op in place).
Negative block ids, and ids past either cache's page count, are skipped.  Ids must be
distinct (with duplicates an in-place call may convert a page twice on parallel backends).
"""

from __future__ import annotations

import torch
from torch import Tensor

from .core import _calls
from .core import platform as _platform
from .core import index_checks as _ic
from .core._validate import INT_INDEX, Check
from .core.accepted_layouts import AcceptedLayouts
from .core.formats import DEFAULT_V41_LAYOUT, INDEXER_FP8, RECORDS, TILE, V41_LAYOUTS, V41_NVFP4, CacheLayout, interleaved_for

__all__ = ["transcode_k_cache"]

OP = "transcode_k_cache"
FP8_WIDTHS = tuple(sorted(w for w, r in RECORDS.items() if r.holds_fp8))  # (132, 528, 584)


# --------------------------------------------------------------------------------------
# Public op
# --------------------------------------------------------------------------------------


def _storage_ptr(t: Tensor):
    if torch.compiler.is_compiling():  # no storage under tracing: the overlap check is eager-only
        return None
    try:
        return t.untyped_storage().data_ptr()
    except Exception:  # fake / functional tensors under tracing: no overlap check
        return None


def _default_tiled(width: int, block_size: int) -> bool:
    """The 132-byte indexer record is tiled on ROCm for pages of more than one token (as vLLM)."""
    return width == INDEXER_FP8.width and block_size > 1 and _platform.probe().is_rocm


_accepted = AcceptedLayouts()


def transcode_k_cache(
    src: Tensor,
    dst: Tensor,
    block_ids: Tensor,
    src_fnuz: bool,
    dst_fnuz: bool,
    block_size: int | None = None,
    *,
    tiled: bool | None = None,
    src_v41_layout: str = DEFAULT_V41_LAYOUT,
    dst_v41_layout: str = DEFAULT_V41_LAYOUT,
) -> None:
    """Rewrite pages ``block_ids`` of the paged K cache ``src`` (fp8 flavour ``src_fnuz``) into
    the same pages of ``dst`` in flavour ``dst_fnuz`` (rules: module docstring).

    src, dst: uint8 caches of one record, ``[num_blocks, B, W]`` or flat
        ``[num_blocks, page_bytes]`` views (then ``block_size`` is required when both are flat,
        and W = page_bytes / block_size); page strides may differ.  ``dst`` may be ``src``.
    block_ids: int32 / int64 ``[N]`` page indices; −1 (any negative) skips.
    tiled: the 132 record's ROCm 16x16 tiled layout (keyword-only; default: ROCm and B > 1).
    src_v41_layout, dst_v41_layout: where the 528 / 288 records keep their scales in each
        cache, ``"interleaved"`` or ``"paged"`` (keyword-only; ignored for other records).
    """
    new = _accepted.new((src, dst, block_ids, src_fnuz, dst_fnuz, block_size, tiled, src_v41_layout, dst_v41_layout))
    if new is not None:
        c = Check(OP)
        c.tensor("src", src, dtype=torch.uint8, ndim=(2, 3))
        c.tensor("dst", dst, dtype=torch.uint8, ndim=(2, 3))
        c.tensor("block_ids", block_ids, dtype=INT_INDEX, ndim=1)
        c.flag("src_fnuz", src_fnuz)
        c.flag("dst_fnuz", dst_fnuz)

        three_d = [(n, t) for n, t in (("src", src), ("dst", dst)) if t.dim() == 3]
        if block_size is None:
            if not three_d:
                c.fail("block_size", "an int when src and dst are both flat [num_blocks, page_bytes] views", None)
            block_size = three_d[0][1].shape[1]
        c.integer("block_size", block_size, min_value=1)
        if three_d:
            name, ref = three_d[0]
            width = ref.shape[2]
            for n, t in three_d[1:]:
                if t.shape[2] != width:
                    c.fail(n, f"the record width of '{name}' ({width} bytes per token)", f"shape {tuple(t.shape)}")
        else:
            if src.shape[1] % block_size != 0:
                c.fail(
                    "src",
                    f"a flat page of block_size * width bytes (block_size {block_size}); pass a "
                    "[num_blocks, B, W] view for padded pages",
                    f"shape {tuple(src.shape)}",
                )
            width = src.shape[1] // block_size
        c.choice("src_v41_layout", src_v41_layout, V41_LAYOUTS)
        c.choice("dst_v41_layout", dst_v41_layout, V41_LAYOUTS)
        src_il, dst_il = interleaved_for(width, src_v41_layout), interleaved_for(width, dst_v41_layout)
        relayout = width == V41_NVFP4.width and src_il != dst_il
        if relayout and (src_fnuz or dst_fnuz):
            c.fail("src_fnuz", "False with dst_fnuz False for the 288-byte record (NVFP4 has no FNUZ flavour)",
                   f"src_fnuz={src_fnuz}, dst_fnuz={dst_fnuz}")
        if width not in FP8_WIDTHS and not relayout:
            holds = "; 288 (NVFP4) and 68 (MXFP4) hold no fp8" if width in RECORDS else ""
            c.fail(
                "src",
                f"a record that holds fp8: {', '.join(map(str, FP8_WIDTHS))} bytes per token{holds}",
                f"{width} bytes per token (shape {tuple(src.shape)}, block_size {block_size})",
            )
        c.paged_cache("src", src, block_size, width)
        c.paged_cache("dst", dst, block_size, width)

        if tiled is not None:
            c.flag("tiled", tiled)
        tiled = _default_tiled(width, block_size) if tiled is None else tiled
        if tiled and width != INDEXER_FP8.width:
            c.fail("tiled", f"False for the {width}-byte record (only the 132-byte indexer record is tiled)", tiled)
        if tiled and block_size % TILE != 0:
            c.fail("block_size", f"a multiple of {TILE} for the tiled layout", block_size)
        _accepted.add(new)
    if block_size is None:
        block_size = (src if src.dim() == 3 else dst).shape[1]
    width = (src.shape[2] if src.dim() == 3 else dst.shape[2] if dst.dim() == 3 else src.shape[1] // block_size)
    src_il, dst_il = interleaved_for(width, src_v41_layout), interleaved_for(width, dst_v41_layout)
    if tiled is None:
        tiled = _default_tiled(width, block_size)

    if src is not dst:
        ps, pd = _storage_ptr(src), _storage_ptr(dst)
        if ps is not None and ps == pd and ps != 0:
            same_view = (
                src.data_ptr() == dst.data_ptr() and src.stride(0) == dst.stride(0) and src.shape[0] == dst.shape[0]
            )
            if not same_view:
                Check(OP).fail("dst", "src itself (in place) or a cache that does not share storage with src",
                               "a different view of src's storage")

    if block_ids.shape[0] == 0:
        return
    _ic.check_transcode_k_cache(src, dst, block_ids)
    if not (src_il or dst_il):
        _calls.ops.transcode_k_cache(src, dst, block_ids, block_size, width, src_fnuz, dst_fnuz, tiled)
        return
    # the relayout moves bytes around the selected kernel: dsv41.explain stops before it
    _calls.stop_if_capturing(OP, (src, dst, block_ids, block_size, width, src_fnuz, dst_fnuz, tiled))
    _relayout_op(src, dst, block_ids, block_size, width, src_fnuz, dst_fnuz, src_il, dst_il)


def _record_order(width: int, block_size: int, interleaved: bool) -> Tensor:
    """For each record byte of a page in the paged layout (value bytes of every token, then
    scale bytes of every token), its offset in the page under ``interleaved``."""
    rec = RECORDS[width]
    lay = CacheLayout(rec, block_size, block_size * width, interleaved=interleaved)
    t = torch.arange(block_size).unsqueeze(1)
    v = lay.value_index(t, torch.arange(rec.value_bytes).unsqueeze(0)).reshape(-1)
    s = lay.scale_index(t, torch.arange(rec.scale_bytes).unsqueeze(0)).reshape(-1)
    return torch.cat((v, s))


def _pages(cache: Tensor, block_size: int, width: int) -> Tensor:
    """``[num_blocks, block_size * width]`` view of every page's record bytes."""
    return cache.as_strided((cache.shape[0], block_size * width), (cache.stride(0), 1), cache.storage_offset())


# An opaque op (like every dispatched op) so that torch.compile sees one call, not the
# data-dependent page selection inside.
@torch.library.custom_op("dsv41::transcode_k_cache_interleaved", mutates_args=("dst",))
def _relayout_op(
    src: Tensor, dst: Tensor, block_ids: Tensor, block_size: int, width: int, src_fnuz: bool, dst_fnuz: bool,
    src_il: bool, dst_il: bool,
) -> None:
    """Pages with interleaved records on either side: gather the listed pages into paged order,
    convert the flavour there with the selected kernel (paged records), scatter into ``dst``'s
    layout.  Pure byte moves around the kernel, so every device runs it; it costs two extra
    copies of the listed pages (a transcode runs when a cache changes hands, not per step)."""
    nb = min(src.shape[0], dst.shape[0])
    ids = block_ids.to(src.device, torch.int64)
    ids = ids[(ids >= 0) & (ids < nb)]
    if ids.numel() == 0:
        return
    order_src = _record_order(width, block_size, src_il).to(src.device)
    order_dst = _record_order(width, block_size, dst_il).to(dst.device)
    paged = _pages(src, block_size, width)[ids][:, order_src].contiguous()
    if width in FP8_WIDTHS and src_fnuz != dst_fnuz:
        pages = paged.view(ids.numel(), block_size, width)
        local = torch.arange(ids.numel(), dtype=torch.int64, device=src.device)
        _calls.ops.transcode_k_cache(pages, pages, local, block_size, width, src_fnuz, dst_fnuz, False)
    out = _pages(dst, block_size, width)
    rows = out[ids]
    rows[:, order_dst] = paged.to(dst.device)
    out[ids] = rows


@_relayout_op.register_fake
def _(*args, **kwargs):
    return None
