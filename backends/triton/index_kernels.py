"""Triton kernels of the sparse-attention index builders (spec cache_ops.md §5-§7).

Shared by the cuda:triton, rocm and xpu backends.  Pure int32 index arithmetic, so the
kernels carry no vendor switch: every backend writes the bytes of
``dsv41.reference.sparse_indices``.

Launchers follow docs/kernel_contract.md: they receive validated tensors and preallocated
outputs, write the outputs in place and return None.  They never allocate, never read a
tensor on the host (CUDA-graph capture safe) and launch exactly one kernel.

Conventions (all three kernels):

* a program handles a 2-D tile ``[BLOCK_R rows, BLOCK_C columns]`` and loops over the
  columns, so one launch covers any width;
* index arithmetic is int32, like the reference and upstream (values wrap identically);
  only memory offsets are widened to int64;
* a block-table read outside the table's logical shape, or for a negative request, yields
  the "no slot" sentinel −1 (the reference's rule; §5 defines it so and does not count the
  entry, the other ops' contracts exclude such reads, which would read unrelated memory
  upstream);
* ``//`` and ``%`` are Triton's C-style truncating ops, the reference's ``_div_trunc``;
  every other division has a non-negative left operand (spec §0.2);
* nothing outside the output tensors' logical extent is written.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from dsv41.core.op_specs import spec

from . import launch, tuning
from .bound import bind
from .reductions import _rcumsum, _rsum

__all__ = [
    "compute_global_topk_indices_and_lens",
    "combine_topk_swa_indices",
    "build_flashinfer_mixed_sparse_indices",
]

_NUM_WARPS = 4
_TILE = 4096  # int32 elements per program and column step (16 KiB read + 16 KiB written)

# Launch-shape overrides per op name (absent: the measured shapes of ``tuning.TABLE`` above
# decode sizes, else the heuristics below), e.g.
# TUNE["compute_global_topk_indices_and_lens"] = {"BLOCK_R": 1, "BLOCK_C": 2048, "num_warps": 8}.
# The one override table of ``tuning``.
TUNE: dict = tuning.OVERRIDES


def _cfg(op: str, block_r: int, block_c: int) -> tuple[int, int, int]:
    cfg = TUNE.get(op)
    if cfg:
        return cfg["BLOCK_R"], cfg["BLOCK_C"], cfg["num_warps"]
    return block_r, block_c, _NUM_WARPS


def _pow2(n: int) -> int:
    return launch.pow2(n)


def _tile(rows: int, cols: int, max_cols: int = 1024) -> tuple[int, int]:
    """(BLOCK_R, BLOCK_C): columns up to ``max_cols`` per step, rows fill ``_TILE``.  (Steps
    that fit the row better, 5 x 128 for a 640-column combined row instead of one of 1024,
    measured slower on the H200: 0.48 of copy against 0.55 at 65536 rows.)"""
    block_c = min(_pow2(cols), max_cols)
    block_r = max(1, min(_pow2(rows), _TILE // block_c))
    return block_r, block_c


def _row_shape(op: str, rows: int, cols: int) -> tuple[int, int, int]:
    """(BLOCK_R, BLOCK_C, num_warps) of the row-builder kernels.  At decode sizes one row per
    program, whole rows (up to 2048 columns) in one step, 8 warps: the work is a chain of
    dependent loads (index -> block table -> slot), and more programs with fewer elements
    per thread shorten it (H200, CUDA-graph replay at 8-64 rows: 3.8-8.7 us with the
    bandwidth tiling, 2.2-2.7 us with this); above that the op's measured shape
    (``tuning.TABLE``), else the bandwidth tiling."""
    if op in TUNE:
        return _cfg(op, 0, 0)
    if rows <= launch.DECODE_T:
        return 1, min(_pow2(cols), 2048), 8
    m = tuning.TABLE.get(op)
    if m is not None:
        return m.shape["BLOCK_R"], m.shape["BLOCK_C"], m.shape["num_warps"]
    return (*_tile(rows, cols), _NUM_WARPS)


def _measured(op: str, rows: int) -> dict:
    """The op's launch parameters beyond the tile from an override or, above decode sizes, its
    measured shape (``BLOCK_W``: the FlashInfer kernel's SWA step width; ``OFF32``: False
    keeps 64-bit addresses where 32-bit ones would do); {}: the launcher's defaults."""
    cfg = TUNE.get(op)
    if cfg is None and rows > launch.DECODE_T:
        m = tuning.TABLE.get(op)
        cfg = m.shape if m is not None else None
    return cfg or {}


def _table_strides(t: torch.Tensor) -> tuple[int, int, int, int]:
    """(rows, cols, stride(0), stride(1)) of a 2-D block table."""
    return t.shape[0], t.shape[1], t.stride(0), t.stride(1)


# ------------------------------------------------------------------------ helpers


@triton.jit
def _table_entry(table_ptr, n_rows, n_cols, s_row, s_col, req, pos, read, B, OFF32: tl.constexpr = False):
    """``(block_id, p, hit)``: ``hit`` where ``read`` and ``table[req, pos // B]`` is inside the
    table's logical shape (a negative position, e.g. from int32 arithmetic on out-of-contract
    lengths, is outside); ``block_id`` that entry there (0 elsewhere) and ``p`` the position as
    unsigned (meaningful where ``hit``).

    ``req`` broadcasts against ``pos``/``read``; what depends on the request alone (is it a
    row of the table, where its row starts) is computed once per row, and a request outside
    the table leaves no column to hit.  The page arithmetic is unsigned (the position is
    non-negative wherever it is used): a shift and a mask for a power-of-two ``B``, with no
    sign fix-up.  Lanes that do not hit read nothing; their offsets are never used."""
    row_ok = (req >= 0) & (req < n_rows)
    cols = tl.where(row_ok, n_cols, 0)
    p = pos.to(tl.uint32)
    blk = (p // B).to(tl.int32)
    hit = read & (pos >= 0) & (blk < cols)
    off = _offs(tl.where(row_ok, req, 0), OFF32) * s_row + _offs(blk, OFF32) * s_col
    block_id = tl.load(table_ptr + off, mask=hit, other=0)
    return block_id, p, hit


@triton.jit
def _lookup_remapped(table_ptr, n_rows, n_cols, s_row, s_col, req, pos, read, keep, B, span,
                     OFF32: tl.constexpr = False):
    """§7 column: the slot ``table[req, pos // B] * B + pos % B`` where ``hit`` (``_table_entry``)
    and ``keep``, else −1, remapped (``_remap(slot, B, span)``), with the bytes of those two
    steps for every table entry (int32 wrapping included).

    For a power-of-two ``B = 2^k`` the slot ``block_id * B + r`` (``r = p % B``) is
    ``(block_id << k) | r``: it is negative exactly when ``block_id << k`` is, its page is
    ``(block_id << k) >> k`` (unsigned) and its offset ``r``, so the remap needs no division
    of the slot and no second sign test; other ``B`` take the two steps as written."""
    block_id, p, hit = _table_entry(table_ptr, n_rows, n_cols, s_row, s_col, req, pos, read, B, OFF32)
    r = (p % B).to(tl.int32)
    if (B & (B - 1)) == 0:
        hi = block_id * B
        page = (hi.to(tl.uint32) // B).to(tl.int32)
        out = tl.where(hit & keep & (hi >= 0), page * span + r, -1)
    else:
        out = _remap(tl.where(hit & keep, block_id * B + r, -1), B, span)
    return out


@triton.jit
def _offs(x, OFF32: tl.constexpr):
    """``x`` as an element offset: int32 where the launcher checked that every offset of the
    kernel's tensors fits (32-bit address arithmetic, as vLLM's kernels use throughout), else
    int64."""
    if OFF32:
        r = x
    else:
        r = x.to(tl.int64)
    return r


@triton.jit
def _remap(v, bs, span):
    """§7 span remap: −1 if v < 0 else (v // bs) * span + v % bs (unsigned, as in
    ``_table_entry``)."""
    vs = tl.where(v >= 0, v, 0).to(tl.uint32)
    return tl.where(v >= 0, (vs // bs).to(tl.int32) * span + (vs % bs).to(tl.int32), -1)


# ------------------------------------------------------------------------------ §5


# Row widths (K_in / W_out / K_dec / K_pre below) are specialized: Triton
# then knows a width that is a multiple of 16 (every model's) and loads and stores whole rows
# in 16-byte vectors (sm_90 SASS, specialized against not: the top-k step 86 against 104
# instructions per warp and 512 columns before its unsigned block test, which took the whole
# kernel at 2048-column rows from 376 to 272; the combine kernel 894 against 1061 with its stores
# vectorized, the FlashInfer kernel's memory instructions 209 against 309).  Row counts and table sizes, which change from call to call,
# are not (one build serves them all).  The widths the kernels loop over (top-k K, the
# FlashInfer kernel's W_swa / PT) are constexprs, as in vLLM's kernels (a model has one or
# two): the column loops have a known trip count and their masks fold away.
@triton.jit
def _topk_row(topk_ptr, s_tk0, s_tk1, req_ptr, s_req, table_ptr, n_tab_rows, n_cols_u, s_tab0, s_tab1,
              valid_ptr, s_valid, out_ptr, s_out0, s_out1, lens_ptr, s_lens, row, rm,
              K: tl.constexpr, B: tl.constexpr, BLOCK_C: tl.constexpr, COMPACT: tl.constexpr,
              OFF32: tl.constexpr):
    """Row ``row`` (``[1]``) of the top-k translation (``rm``: the row exists), in 1-D steps of
    ``BLOCK_C`` columns.  One-row 2-D tiles ``[1, BLOCK_C]`` had Triton 3.6 give the table
    gather a layout of its own and convert between the two through shared memory (sm_90: 24
    barriers, 79 registers, half the occupancy of vLLM's kernel); 1-D steps keep one layout."""
    row64 = row.to(tl.int64)
    req = tl.load(req_ptr + row64 * s_req, mask=rm, other=-1)
    # loaded before the loop: after its stores the compiler could not move the load up
    # (the output might alias it), and at decode sizes it would cost one more memory
    # round trip at the end of the kernel
    valid = tl.load(valid_ptr + row64 * s_valid, mask=rm, other=0)
    # OFF32: every element offset of the input, the output and the table fits in int32 (the
    # launcher checked): the per-element address arithmetic stays 32-bit
    in_row = _offs(row, OFF32) * s_tk0
    out_row = _offs(row, OFF32) * s_out0
    row_ok = (req >= 0) & (req < n_tab_rows)
    req_off = _offs(tl.where(row_ok, req, 0), OFF32) * s_tab0
    count = tl.zeros([1], tl.int32)
    # without compaction the valid entries are counted per lane and summed across the program
    # once, after the loop (a cross-warp sum costs two barriers; once per step is not needed)
    lane_hits = tl.zeros([BLOCK_C], tl.int32)
    for k0 in range(0, K, BLOCK_C):
        cols = k0 + tl.arange(0, BLOCK_C)
        m = (cols < K) & rm
        cols_o = _offs(cols, OFF32)
        x = tl.load(topk_ptr + in_row + cols_o * s_tk1, mask=m, other=-1)
        # valid: x >= 0 and the table entry exists (request row, logical block < width).  One
        # unsigned compare for both conditions on the entry: a negative x is 2^31 or more as
        # uint32, so its block is at least 2^31 // B, which the launcher's width never exceeds
        # (``_topk_width``); the request row's test is the row's (``row_ok``)
        p = x.to(tl.uint32)
        blk = p // B
        ok = (blk < n_cols_u) & row_ok
        off = req_off + _offs(blk.to(tl.int32), OFF32) * s_tab1
        block_id = tl.load(table_ptr + off, mask=ok, other=0)
        out = tl.where(ok, block_id * B + (p % B).to(tl.int32), -1)
        hits = ok.to(tl.int32)
        if COMPACT:
            # a valid entry's column in the output: the row's valid entries in earlier steps
            # plus those before it in this one (an exclusive prefix sum), so order is kept
            dst = count + _rcumsum(hits, axis=0) - hits
            tl.store(out_ptr + out_row + _offs(dst, OFF32) * s_out1, out, mask=m & ok)
            count += _rsum(hits, axis=0)
        else:
            tl.store(out_ptr + out_row + cols_o * s_out1, out, mask=m)
            lane_hits += hits
    if not COMPACT:
        count = _rsum(lane_hits, axis=0)
    if COMPACT:
        # −1 after the valid entries: only now is the row's count known, and this pass
        # writes exactly the columns the first one left, so no column is written twice
        for k0 in range(0, K, BLOCK_C):
            cols = k0 + tl.arange(0, BLOCK_C)
            m = (cols < K) & rm & (cols >= count)
            tl.store(out_ptr + row64 * s_out0 + cols.to(tl.int64) * s_out1,
                     tl.full([BLOCK_C], -1, tl.int32), mask=m)
    tl.store(lens_ptr + row64 * s_lens, tl.where(valid != 0, count, 0), mask=rm)


@triton.jit(do_not_specialize=["n_tab_rows", "n_tab_cols", "N"])
def _global_topk_kernel(
    topk_ptr, s_tk0, s_tk1,
    req_ptr, s_req,
    table_ptr, n_tab_rows, n_tab_cols, s_tab0, s_tab1,
    valid_ptr, s_valid,
    out_ptr, s_out0, s_out1,
    lens_ptr, s_lens,
    N, K: tl.constexpr, B: tl.constexpr,
    BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr, PDL: tl.constexpr = False, COMPACT: tl.constexpr = False,
    OFF32: tl.constexpr = False,
):
    launch.pdl_prologue(PDL)
    # B (the page size) is a constexpr: pos // B and pos % B by a constant (a shift and a
    # mask for a power of two) instead of an integer division per index
    n_cols_u = (n_tab_cols + tl.zeros([1], tl.int32)).to(tl.uint32)  # a Python int when it is 1
    for i in tl.static_range(BLOCK_R):
        # a one-element vector, not a scalar: a masked scalar load is not what every Triton
        # (its interpreter included) takes
        row = tl.program_id(0) * BLOCK_R + i + tl.zeros([1], tl.int32)
        if BLOCK_R == 1:
            rm = tl.full([1], 1, tl.int1)  # the grid has exactly N programs
        else:
            rm = row < N
        _topk_row(topk_ptr, s_tk0, s_tk1, req_ptr, s_req, table_ptr, n_tab_rows, n_cols_u, s_tab0, s_tab1,
                  valid_ptr, s_valid, out_ptr, s_out0, s_out1, lens_ptr, s_lens, row, rm,
                  K, B, BLOCK_C, COMPACT, OFF32)


_global_topk_launch = bind(_global_topk_kernel)


def compute_global_topk_indices_and_lens(
    topk_indices, token_to_req_indices, block_table, block_size, is_valid_token,
    global_topk_indices, topk_lens, compact=False,
):
    """§5, bounds-checked: local top-k indices -> global slots.  An entry whose request index
    is not a table row or whose logical block is past the table width is −1 and not counted;
    ``compact`` moves each row's valid entries to its front in their order."""
    N, K = topk_indices.shape
    if N == 0:
        return None
    s_in, s_out = topk_indices.stride(), global_topk_indices.stride()
    tab = _table_strides(block_table)
    tab = (tab[0], _topk_width(tab[1], block_size), *tab[2:])
    pdl = launch.decode_pdl(topk_indices.device, N)
    grid, kw = tuning.remembered(("topk", N, K, s_in, s_out, tab, bool(compact), pdl, launch.DECODE_T),
                                 _topk_plan, N, K, s_in, s_out, tab, bool(compact), pdl)
    valid = is_valid_token.view(torch.uint8) if is_valid_token.dtype == torch.bool else is_valid_token
    _global_topk_launch(grid,
        topk_indices, *s_in,
        token_to_req_indices, token_to_req_indices.stride(0),
        block_table, *tab,
        valid, valid.stride(0),
        global_topk_indices, *s_out,
        topk_lens, topk_lens.stride(0),
        N, K, block_size, **kw,
    )
    return None


def _topk_width(cols: int, block_size: int) -> int:
    """The table width the top-k kernel compares blocks with: ``cols``, or ``2^31 // B`` where
    that is smaller -- every block of a non-negative int32 index is below it, every block of a
    negative one (read as uint32) at or above it, and no block at or above it exists for an
    index of either sign."""
    return min(cols, 2**31 // block_size)


def _topk_plan(N, K, s_in, s_out, tab, compact, pdl):
    """(grid, launch keywords) of a top-k launch; the launcher keeps it per shape class
    (``tuning.remembered``, keyed with ``launch.DECODE_T``, which the shape depends on)."""
    # One token per program, whole rows (up to 2048 columns) in one step: at decode sizes
    # with 16 warps (latency; 2.65 against 2.85 us with 8 at 64 rows, H200 sweep without PDL,
    # h200-sweep-5-topk-nopdl.jsonl.xz), at prefill sizes with 4 (bandwidth; H100 sweep at 65536
    # rows, h100-sweep-26-topk-65536.jsonl.xz: 1.00 of copy, 8 / 16 warps 1.01 / 0.98, 1024 or
    # 512 columns 0.80-1.00; at 4096 rows no shape above its 0.97, h100-bench-26-topk.txt).
    if N * K <= 1024 * 2048:
        block_r, block_c, warps = 1, min(_pow2(K), 2048), 16 if N <= launch.DECODE_T else 8
    else:
        block_r, block_c, warps = 1, min(_pow2(K), 2048), 4
    cfg = TUNE.get("compute_global_topk_indices_and_lens") \
        or (_measured("compute_global_topk_indices_and_lens", N) if N * K > 1024 * 2048 else {})
    if cfg:
        block_r, block_c, warps = cfg["BLOCK_R"], cfg["BLOCK_C"], cfg["num_warps"]
    # every element offset of the three 2-D tensors in int32 range: 32-bit address arithmetic
    off32 = cfg.get("OFF32", True) and launch.layout_span(
        ((N, K), s_in), ((N, K), s_out), (tab[:2], tab[2:])) < launch.I32_SAFE
    kw = dict(BLOCK_R=block_r, BLOCK_C=block_c, PDL=pdl, COMPACT=compact, num_warps=warps,
              OFF32=bool(off32), **launch.pdl_kwargs(pdl))
    return (launch.cdiv(N, block_r),), kw


# ------------------------------------------------------------------------------ §6


@triton.jit(do_not_specialize=["T", "R", "n_iter", "window", "CR", "topk", "M", "N"])
def _combine_topk_swa_kernel(
    topk_ptr, s_tk0, s_tk1, K_in,
    qsl_ptr, s_qsl,
    seq_ptr, s_seq,
    gl_ptr, s_gl,
    out_ptr, s_out0, s_out1,
    lens_ptr, s_lens,
    T, R, n_iter, W_out,
    window, CR, topk, M, N,
    BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr,
    PDL: tl.constexpr = False,
):
    launch.pdl_prologue(PDL)
    t = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    tmask = t < T
    t64 = t.to(tl.int64)

    # Rebase on query_start_loc[0]; owned = t < qsl[R] - base.
    base = tl.load(qsl_ptr)
    end = tl.load(qsl_ptr + R * s_qsl) - base
    owned = tmask & (t < end)

    # Request of t: the last b in [0, R-1] with qsl[b] - base <= t (binary search over
    # qsl[0..R-1], n_iter = bit_length(R) steps; zero-length requests skipped naturally).
    lo = tl.full([BLOCK_R], 0, tl.int32)
    hi = tl.full([BLOCK_R], 0, tl.int32) + R
    for _ in range(n_iter):
        act = lo < hi
        mid = (lo + hi) // 2
        v = tl.load(qsl_ptr + mid.to(tl.int64) * s_qsl, mask=owned & act, other=0) - base
        right = act & (v <= t)
        lo = tl.where(right, mid + 1, lo)
        hi = tl.where(act & (v > t), mid, hi)
    b = tl.maximum(tl.minimum(lo - 1, R - 1), 0)
    b64 = b.to(tl.int64)

    qs = tl.load(qsl_ptr + b64 * s_qsl, mask=owned, other=0) - base
    qe = tl.load(qsl_ptr + (b64 + 1) * s_qsl, mask=owned, other=0) - base
    L = tl.load(seq_ptr + b64 * s_seq, mask=owned, other=0)
    g = tl.load(gl_ptr + b64 * s_gl, mask=owned, other=0)
    pos = L - (qe - qs) + (t - qs)
    gstart = L - g

    k_len = (pos + 1) // tl.maximum(CR, 1)  # truncating, like the reference
    k_len = tl.minimum(tl.maximum(k_len, 0), topk)
    k_len = tl.where(CR > 0, k_len, 0)
    swa_start = tl.maximum(tl.maximum(pos - window + 1, 0), gstart)
    swa_len = tl.maximum(pos - swa_start + 1, 0)
    k_len = tl.where(owned, k_len, 0)
    swa_len = tl.where(owned, swa_len, 0)
    mb = M * b  # int32, as in the kernel

    for j0 in range(0, W_out, BLOCK_C):
        j = j0 + tl.arange(0, BLOCK_C)
        jm = j < W_out
        m = tmask[:, None] & jm[None, :]
        j2 = j[None, :]
        in_topk = j2 < k_len[:, None]
        v = tl.load(topk_ptr + t64[:, None] * s_tk0 + j2.to(tl.int64) * s_tk1,
                    mask=m & in_topk & (j2 < K_in), other=-1)
        topk_val = tl.where((v >= 0) & (v < N), v + mb[:, None], -1)
        swa_val = mb[:, None] + N + (swa_start[:, None] + (j2 - k_len[:, None]) - gstart[:, None])
        in_swa = (j2 >= k_len[:, None]) & (j2 < (k_len + swa_len)[:, None])
        out = tl.where(in_topk, topk_val, tl.where(in_swa, swa_val, -1))
        tl.store(out_ptr + t64[:, None] * s_out0 + j2.to(tl.int64) * s_out1, out, mask=m)
    tl.store(lens_ptr + t64 * s_lens, k_len + swa_len, mask=tmask)


_combine_topk_swa_launch = bind(_combine_topk_swa_kernel)


def combine_topk_swa_indices(
    topk_indices, query_start_loc, seq_lens, gather_lens, window_size, compress_ratio,
    topk, M, N, combined_indices, combined_lens,
):
    """§6 (token-parallel version): sparse prefill rows into the gathered workspace."""
    T = topk_indices.shape[0]
    if T == 0:
        return None
    R = seq_lens.shape[0]
    W_out = combined_indices.shape[1]
    block_r, block_c, warps = _row_shape("combine_topk_swa_indices", T, W_out)
    pdl = launch.decode_pdl(topk_indices.device, T)
    _combine_topk_swa_launch((launch.cdiv(T, block_r),),
        topk_indices, topk_indices.stride(0), topk_indices.stride(1), topk_indices.shape[1],
        query_start_loc, query_start_loc.stride(0),
        seq_lens, seq_lens.stride(0),
        gather_lens, gather_lens.stride(0),
        combined_indices, combined_indices.stride(0), combined_indices.stride(1),
        combined_lens, combined_lens.stride(0),
        T, R, int(R).bit_length(), W_out,
        window_size, compress_ratio, topk, M, N,
        BLOCK_R=block_r, BLOCK_C=block_c, PDL=pdl, num_warps=warps, **launch.pdl_kwargs(pdl),
    )
    return None


# ------------------------------------------------------------------------------ §7


@triton.jit(do_not_specialize=[
    "R", "swa_rows", "swa_cols", "sspan", "cmp_rows", "cmp_cols",
    "cspan", "n_replay", "D", "P", "n_dec_tiles", "window", "topk",
])
def _flashinfer_mixed_kernel(
    dswa_ptr, s_dswa0, s_dswa1,
    dci_ptr, s_dci0, s_dci1, K_dec,
    dlens_ptr, s_dlens,
    dvalid_ptr, s_dvalid,
    ptk_ptr, s_ptk0, s_ptk1, K_pre,
    qsl_ptr, s_qsl,
    seq_ptr, s_seq, R,
    t2r_ptr, s_t2r,
    swa_tab_ptr, swa_rows, swa_cols, s_swa0, s_swa1, sbs: tl.constexpr, sspan,
    cmp_tab_ptr, cmp_rows, cmp_cols, s_cmp0, s_cmp1, cbs: tl.constexpr, cspan,
    replay_ptr, s_replay, n_replay,
    out_ptr, s_out0, s_out1,
    lens_ptr, s_lens,
    D, P, W_swa: tl.constexpr, PT: tl.constexpr, n_dec_tiles,
    window, CR: tl.constexpr, topk,
    HAS_DCI: tl.constexpr, HAS_DLENS: tl.constexpr, HAS_DVALID: tl.constexpr,
    IS_LOCAL: tl.constexpr,
    BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_W: tl.constexpr,
    PDL: tl.constexpr = False, OFF32: tl.constexpr = False,
):
    # BLOCK_W: SWA columns per step, BLOCK_C: compressed columns per step.  The SWA part is
    # usually far narrower (128 against 512); a step as wide as the compressed one would
    # leave most of its lanes masked off.  The page sizes sbs / cbs are constexprs, like the
    # top-k kernel's B: each element divides by them twice (table lookup, span remap), a
    # shift and a mask for a power of two instead of an integer division (a model has one or
    # two page sizes, so one or two builds).  The compress ratio CR is one too, as in vLLM's
    # kernel: a row's top-k length divides by it, a shift for a power of two where a run-time
    # divisor costs an integer-division sequence in every thread (a model has one or two).
    launch.pdl_prologue(PDL)
    pid = tl.program_id(0)
    if pid < n_dec_tiles:
        # ---------------------------------------------------------------- decode rows
        n = pid * BLOCK_R + tl.arange(0, BLOCK_R)
        nmask = n < D
        n64 = n.to(tl.int64)
        # SWA columns: already-global slots, remapped.  When they fit one step they are read
        # here and written after the compressed columns, so that no store stands before the
        # compressed columns' reads (a store keeps every later load behind it: the compiler
        # cannot know the output does not alias an input) and a row waits on two reads one
        # after another (token -> block table), not three.
        ONE_SWA_STEP: tl.constexpr = W_swa <= BLOCK_W
        if ONE_SWA_STEP:
            js = tl.arange(0, BLOCK_W)
            ms = nmask[:, None] & (js < W_swa)[None, :]
            js64 = js.to(tl.int64)[None, :]
            v_swa = tl.load(dswa_ptr + n64[:, None] * s_dswa0 + js64 * s_dswa1, mask=ms, other=-1)
        # Compressed columns W_swa + j, j < PT (−1 past K_dec).
        req = tl.load(t2r_ptr + n64 * s_t2r, mask=nmask, other=-1)
        if HAS_DVALID:
            valid = tl.load(dvalid_ptr + n64 * s_dvalid, mask=nmask, other=0) != 0
        else:
            valid = nmask
        GIVEN_LENS: tl.constexpr = HAS_DLENS and not IS_LOCAL
        if GIVEN_LENS:
            c_len = tl.load(dlens_ptr + n64 * s_dlens, mask=nmask, other=0)
        count = tl.full([BLOCK_R], 0, tl.int32)
        for j0 in range(0, PT, BLOCK_C):
            j = j0 + tl.arange(0, BLOCK_C)
            m = nmask[:, None] & (j < PT)[None, :]
            j64 = j.to(tl.int64)[None, :]
            if HAS_DCI:
                v = tl.load(dci_ptr + n64[:, None] * s_dci0 + j64 * s_dci1,
                            mask=m & (j < K_dec)[None, :], other=-1)
            else:
                v = tl.full([BLOCK_R, BLOCK_C], -1, tl.int32)
            if IS_LOCAL:
                present = v >= 0
                count += _rsum((present & valid[:, None]).to(tl.int32), axis=1)
                v = _lookup_remapped(cmp_tab_ptr, cmp_rows, cmp_cols, s_cmp0, s_cmp1,
                                     req[:, None], v, present, True, cbs, cspan)
            else:
                v = _remap(v, cbs, cspan)
            tl.store(out_ptr + n64[:, None] * s_out0 + (W_swa + j64) * s_out1, v, mask=m)
        if ONE_SWA_STEP:
            tl.store(out_ptr + n64[:, None] * s_out0 + js64 * s_out1, _remap(v_swa, sbs, sspan), mask=ms)
        else:
            for j0 in range(0, W_swa, BLOCK_W):
                j = j0 + tl.arange(0, BLOCK_W)
                m = nmask[:, None] & (j < W_swa)[None, :]
                j64 = j.to(tl.int64)[None, :]
                v = tl.load(dswa_ptr + n64[:, None] * s_dswa0 + j64 * s_dswa1, mask=m, other=-1)
                tl.store(out_ptr + n64[:, None] * s_out0 + j64 * s_out1, _remap(v, sbs, sspan), mask=m)
        if IS_LOCAL:
            c_len = count
        elif not GIVEN_LENS:
            c_len = tl.full([BLOCK_R], 0, tl.int32) + K_dec
        c_len = tl.where(K_dec == 0, 0, c_len)
        tl.store(lens_ptr + n64 * s_lens, W_swa + c_len, mask=nmask)
    else:
        # --------------------------------------------------------------- prefill rows
        n = D + (pid - n_dec_tiles) * BLOCK_R + tl.arange(0, BLOCK_R)
        nmask = n < D + P
        n64 = n.to(tl.int64)
        n_o = _offs(n, OFF32)
        p_o = n_o - D
        req = tl.load(t2r_ptr + n64 * s_t2r, mask=nmask, other=0)
        # Per-request values with the index clamped into range (out-of-contract requests
        # must not crash; the reference clamps the same way); 0 when R == 0.
        zero = tl.full([BLOCK_R], 0, tl.int32)
        rm = nmask & ((zero + R) > 0)
        rc = tl.minimum(tl.maximum(req, 0), R - 1).to(tl.int64)
        qs = tl.load(qsl_ptr + rc * s_qsl, mask=rm, other=0)
        qe = tl.load(qsl_ptr + (rc + 1) * s_qsl, mask=rm, other=0)
        L = tl.load(seq_ptr + rc * s_seq, mask=rm, other=0)
        rr = tl.minimum(tl.maximum(req, 0), n_replay - 1).to(tl.int64)
        rs = tl.load(replay_ptr + rr * s_replay, mask=nmask & ((zero + n_replay) > 0), other=0)
        pos = L - (qe - qs) + (n - qs)
        swa_start = tl.maximum(tl.maximum(pos - window + 1, 0), rs)
        swa_len = pos - swa_start + 1  # may be <= 0 when replay_start > pos
        if CR > 0:
            k_len = tl.minimum((pos + 1) // CR, topk)  # truncating division
        else:
            k_len = zero
        req2 = req[:, None]
        kmax = tl.minimum(k_len, K_pre)[:, None]  # compressed columns kept: j < min(K_pre, k_len)
        # Compressed columns first, and their reads do not wait for the request's lengths:
        # the whole row of local indices is read (masked to the row's K_pre columns only, so
        # the load stays one 16-byte vector per four columns) and looked up, and the columns
        # past k_len are set to -1 afterwards.  A store keeps every later load behind it (the
        # compiler cannot know the output does not alias an input), so in this order a row
        # waits on three reads one after another (token -> request lengths -> SWA table)
        # where the SWA-first order waited on five.
        for j0 in range(0, PT, BLOCK_C):
            j = j0 + tl.arange(0, BLOCK_C)
            m = nmask[:, None] & (j < PT)[None, :]
            j2 = j[None, :]
            x = tl.load(ptk_ptr + p_o[:, None] * s_ptk0 + _offs(j2, OFF32) * s_ptk1,
                        mask=m & (j2 < K_pre), other=-1)
            v = _lookup_remapped(cmp_tab_ptr, cmp_rows, cmp_cols, s_cmp0, s_cmp1,
                                 req2, x, x >= 0, j2 < kmax, cbs, cspan, OFF32)
            tl.store(out_ptr + n_o[:, None] * s_out0 + _offs(W_swa + j2, OFF32) * s_out1, v, mask=m)
        # SWA columns j < swa_len: slot of position swa_start + j.
        for j0 in range(0, W_swa, BLOCK_W):
            j = j0 + tl.arange(0, BLOCK_W)
            m = nmask[:, None] & (j < W_swa)[None, :]
            j2 = j[None, :]
            in_swa = m & (j2 < swa_len[:, None])
            v = _lookup_remapped(swa_tab_ptr, swa_rows, swa_cols, s_swa0, s_swa1,
                                 req2, swa_start[:, None] + j2, in_swa, True, sbs, sspan, OFF32)
            tl.store(out_ptr + n_o[:, None] * s_out0 + _offs(j2, OFF32) * s_out1, v, mask=m)
        tl.store(lens_ptr + n64 * s_lens, W_swa + k_len, mask=nmask)


_flashinfer_mixed_launch = bind(_flashinfer_mixed_kernel)


def build_flashinfer_mixed_sparse_indices(*args, **kwargs):
    """§7: FlashInfer sparse-MLA rows, D decode rows then P prefill rows (one launch).
    Its 21 kernel arguments are bound by the op's declaration (dsv41.core.op_specs)."""
    a = _FLASHINFER.bind(*args, **kwargs)
    decode_swa_indices, prefill_topk_indices = a.decode_swa_indices, a.prefill_topk_indices
    sparse_indices, sparse_topk_lens = a.sparse_indices, a.sparse_topk_lens
    D, W_swa = decode_swa_indices.shape
    P = prefill_topk_indices.shape[0]
    if D + P == 0:
        return None
    PT = sparse_indices.shape[1] - W_swa  # padded_topk
    has_dci = a.decode_compressed_indices is not None
    K_dec = a.decode_compressed_indices.shape[1] if has_dci else 0
    is_local = bool(a.decode_compressed_indices_are_local) and K_dec > 0
    has_dlens = a.decode_compressed_topk_lens is not None
    has_dvalid = a.decode_is_valid_token is not None
    dummy = sparse_topk_lens
    dci = a.decode_compressed_indices if has_dci else sparse_indices
    dlens = a.decode_compressed_topk_lens if has_dlens else dummy
    dvalid = a.decode_is_valid_token if has_dvalid else dummy
    if dvalid.dtype == torch.bool:
        dvalid = dvalid.view(torch.uint8)
    qsl, seq, t2r, rs = a.query_start_loc, a.seq_lens, a.token_to_req_indices, a.replay_start
    swa, comp = a.swa_block_table, a.compressed_block_table

    s_out, s_ptk = sparse_indices.stride(), prefill_topk_indices.stride()
    tab_s, tab_c = _table_strides(swa), _table_strides(comp)
    pdl = launch.decode_pdl(sparse_indices.device, D + P)
    K_pre = prefill_topk_indices.shape[1]
    grid, n_dec_tiles, kw = tuning.remembered(
        ("flashinfer", D, P, W_swa, PT, K_pre, s_out, s_ptk, tab_s, tab_c, pdl, launch.DECODE_T),
        _flashinfer_plan, D, P, W_swa, PT, K_pre, s_out, s_ptk, tab_s, tab_c, pdl)
    _flashinfer_mixed_launch(grid,
        decode_swa_indices, decode_swa_indices.stride(0), decode_swa_indices.stride(1),
        dci, dci.stride(0), dci.stride(1), K_dec,
        dlens, dlens.stride(0),
        dvalid, dvalid.stride(0),
        prefill_topk_indices, *s_ptk, K_pre,
        qsl, qsl.stride(0),
        seq, seq.stride(0), seq.shape[0],
        t2r, t2r.stride(0),
        swa, *tab_s, a.swa_block_size, a.swa_block_span,
        comp, *tab_c, a.compressed_block_size, a.compressed_block_span,
        rs, rs.stride(0), rs.shape[0],
        sparse_indices, *s_out,
        sparse_topk_lens, sparse_topk_lens.stride(0),
        D, P, W_swa, PT, n_dec_tiles,
        a.window_size, a.compress_ratio, a.topk,
        HAS_DCI=has_dci, HAS_DLENS=has_dlens, HAS_DVALID=has_dvalid, IS_LOCAL=is_local, **kw,
    )
    return None


_FI_OP = "build_flashinfer_mixed_sparse_indices"


def _flashinfer_plan(D, P, W_swa, PT, K_pre, s_out, s_ptk, tab_s, tab_c, pdl):
    """(grid, decode tiles, launch keywords) of a FlashInfer-indices launch; the launcher keeps
    it per shape class, like the top-k plan."""
    block_r, block_c, warps = _row_shape(_FI_OP, D + P, max(W_swa, PT, 1))
    extra = _measured(_FI_OP, D + P)
    block_w = extra.get("BLOCK_W") or min(_pow2(max(W_swa, 1)), block_c)
    # the prefill rows' offsets (output, local indices, both tables) in 32 bits where they fit
    off32 = extra.get("OFF32", True) and launch.layout_span(
        ((D + P, W_swa + PT), s_out), ((P, K_pre), s_ptk), (tab_s[:2], tab_s[2:]),
        (tab_c[:2], tab_c[2:])) < launch.I32_SAFE
    n_dec_tiles = launch.cdiv(D, block_r)
    kw = dict(BLOCK_R=block_r, BLOCK_C=block_c, BLOCK_W=block_w, PDL=pdl, num_warps=warps,
              OFF32=bool(off32), **launch.pdl_kwargs(pdl))
    return (n_dec_tiles + launch.cdiv(P, block_r),), n_dec_tiles, kw


_FLASHINFER = spec("build_flashinfer_mixed_sparse_indices")


# ------------------------------------------------------------------------------ AOT


def _aot_signature(kernel, pointers: dict) -> dict:
    """Triton signature: the given pointer types, "constexpr" for the kernel's constexpr
    parameters (those a spec does not set build with their defaults), i32 else."""
    from .aot import constexpr_params

    cx = constexpr_params(kernel)
    return {a: ("constexpr" if a in cx else pointers.get(a, "i32")) for a in kernel.arg_names}


def _register_aot() -> None:
    """Representative variants for ``backends/triton/aot.py`` (built for sm90, sm100,
    gfx942 and gfx950: the index kernels are pure int32 and build everywhere)."""
    from .aot import AotSpec, register

    i32 = "*i32"
    p = {"topk_ptr": i32, "req_ptr": i32, "table_ptr": i32, "valid_ptr": "*u8",
         "out_ptr": i32, "lens_ptr": i32}
    # as the JIT specializes a model's launch: 16-aligned rows and widths (2048 / 512 columns)
    topk_div = ("topk_ptr", "out_ptr", "s_tk0", "s_out0")
    # rows per program one after another (``_topk_row``): whole rows, narrower steps, 4 rows
    for br, bc in ((1, 2048), (1, 512), (4, 1024)):
        c = {"B": 64, "K": 2048, "BLOCK_R": br, "BLOCK_C": bc}
        register(AotSpec(f"index_kernels._global_topk_kernel[{br}x{bc}]", _global_topk_kernel,
                         _aot_signature(_global_topk_kernel, p), c, num_warps=_NUM_WARPS,
                         divisible=topk_div))
    # the decode launch on SM90+ (PDL; NVIDIA only)
    c = {"B": 64, "K": 2048, "BLOCK_R": 1, "BLOCK_C": 2048, "PDL": True}
    register(AotSpec("index_kernels._global_topk_kernel[1x2048,pdl]", _global_topk_kernel,
                     _aot_signature(_global_topk_kernel, p), c, num_warps=16,
                     targets=("sm90", "sm100"), divisible=topk_div))
    # the compacting launches (decode and prefill tilings)
    for br, bc, warps in ((1, 2048, 16), (1, 512, _NUM_WARPS)):
        c = {"B": 64, "K": 2048, "BLOCK_R": br, "BLOCK_C": bc, "COMPACT": True}
        register(AotSpec(f"index_kernels._global_topk_kernel[{br}x{bc},compact]", _global_topk_kernel,
                         _aot_signature(_global_topk_kernel, p), c, num_warps=warps,
                         divisible=topk_div))
    p = {"topk_ptr": i32, "qsl_ptr": i32, "seq_ptr": i32, "gl_ptr": i32, "out_ptr": i32,
         "lens_ptr": i32}
    c = {"BLOCK_R": 16, "BLOCK_C": 256}
    register(AotSpec("index_kernels._combine_topk_swa_kernel[16x256]", _combine_topk_swa_kernel,
                     _aot_signature(_combine_topk_swa_kernel, p), c, num_warps=_NUM_WARPS,
                     divisible=("topk_ptr", "out_ptr", "s_tk0", "s_out0", "K_in", "W_out")))
    p = {a: i32 for a in _flashinfer_mixed_kernel.arg_names if a.endswith("_ptr")}
    p["dvalid_ptr"] = "*u8"
    for dci, dlens, dvalid, local in ((True, True, False, False), (True, False, True, True),
                                      (False, False, False, False)):
        c = {"HAS_DCI": dci, "HAS_DLENS": dlens, "HAS_DVALID": dvalid, "IS_LOCAL": local,
             "BLOCK_R": 16, "BLOCK_C": 256, "BLOCK_W": 128, "sbs": 64, "cbs": 64, "W_swa": 128, "PT": 512,
             "CR": 4}
        tag = "".join(k[0] if v else "-" for k, v in (("d", dci), ("l", dlens), ("v", dvalid), ("L", local)))
        register(AotSpec(f"index_kernels._flashinfer_mixed_kernel[{tag}]", _flashinfer_mixed_kernel,
                         _aot_signature(_flashinfer_mixed_kernel, p), c, num_warps=_NUM_WARPS,
                         divisible=("out_ptr", "dswa_ptr", "dci_ptr", "ptk_ptr", "s_dswa0", "s_dci0", "s_ptk0",
                                    "s_out0", "K_dec", "K_pre")))


_register_aot()
