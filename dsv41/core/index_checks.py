"""Index-range validation of the public ops: opt-in in full (``DSV41_VALIDATE=1``), always
for the bounds on the implementations that own the host.

The host-side checks of ``_validate`` read tensor metadata only and always run.
The checks here read tensor *values* (slots, block-table entries, positions,
request indices, lengths), so they need the values on the host: each call does
its reductions on the tensors' device and then synchronizes once (one
``.tolist()`` of a handful of booleans; a second small sync only when something
is wrong).  That costs a device round trip per op, hence opt-in in the public ops:
set ``DSV41_VALIDATE=1`` in the environment (read once, on first use; ``refresh()``
re-reads it).  ``enforce(op, args)`` runs the bounds part whatever the variable says:
the reference calls it on every call and the CPU kernels when their C++ pre-scan finds
an index out of range, so those raise the same error with validation off
(docs/bad_input.md; GPU kernels skip such indices instead).  The checks are skipped
while ``torch.compile`` traces and during CUDA-graph capture, where a sync is impossible.

Every ``check_<op>`` takes (a subset of) the public op's arguments under the
same names, returns ``None`` immediately when validation is off, and otherwise
raises ``ValueError`` naming the op, the argument, the bad value and where it
is, e.g.::

    quantize_and_insert_k_cache: argument 'slot_mapping' has value 4096 at [7],
    expected a negative value (skip) or a slot < num_blocks*block_size = 4096
    (DSV41_VALIDATE)

What is checked is exactly what the kernels would otherwise read or write out
of range (spec cache_ops.md §1.1 slot math, §4-§8; rope_quant_ops.md §2-§4):

* slots of tokens that write: ``slot < num_blocks * block_size`` (any negative
  slot skips a token in every writer, docs/decisions.md); two writing tokens
  with the same slot (a race in every kernel) are reported too;
* block-table entries a kernel reads: in ``[0, num_blocks)`` (gather) or
  ``>= 0`` (index builders, which do not see the cache), and the logical block
  inside the table's width;
* positions that index a cos/sin cache: ``0 <= p < cos_sin_cache.shape[0]``;
* request indices (``token_to_req_indices``) in ``[0, num_requests)`` and
  consistent with ``query_start_loc`` (``compute_global_topk_indices_and_lens``
  defines a request index or logical block outside its table: the entry is −1);
* lengths: ``0 <= gather_lens <= seq_lens``, the gathered rows inside ``out``
  (``offset + n <= out.shape[1]``) or inside the request's workspace rows;
* ``transcode_k_cache``: no page listed twice (ids past a cache are skipped by contract).

``check_kernel_args(op, args)`` runs the check of ``op`` on its kernel-contract argument
list (a conformance case, a fuzz example).

Tokens that a kernel skips (negative slot, a CR-2 token that does not close its
group for the duplicate check) are not checked beyond what the kernel reads.
"""

from __future__ import annotations

import inspect
import os
import threading

import torch

from . import op_specs

__all__ = [
    "ENFORCED_OPS",
    "ENV",
    "check_build_flashinfer_mixed_sparse_indices",
    "check_combine_topk_swa_indices",
    "check_compute_global_topk_indices_and_lens",
    "check_dequantize_and_gather_k_cache",
    "check_fused_indexer_q_rope_quant",
    "check_fused_inv_rope_fp8_quant",
    "check_fused_save_compress_norm",
    "check_save_ring_rows",
    "check_indexer_k_norm_rope_store",
    "check_kernel_args",
    "check_quantize_and_insert_k_cache",
    "check_rope_quant_insert",
    "check_transcode_k_cache",
    "enforce",
    "refresh",
    "validate_enabled",
]

ENV = "DSV41_VALIDATE"
_I64 = torch.int64
_INT32_MAX = 2**31 - 1

_enabled: bool | None = None


def refresh() -> bool:
    """Re-read ``DSV41_VALIDATE`` (tests; the value is otherwise read once)."""
    global _enabled
    _enabled = os.environ.get(ENV, "").strip() == "1"
    return _enabled


def validate_enabled() -> bool:
    """True when ``DSV41_VALIDATE=1`` (read on the first call, then cached)."""
    if _enabled is None:
        return refresh()
    return _enabled


# Set while ``enforce`` runs a check whatever ``DSV41_VALIDATE`` says (per thread).
class _Enforcing(threading.local):
    on = False  # a class default: a missing thread-local attribute is slow to read


_enforcing = _Enforcing()

# Ops whose out-of-range indices are errors.  The index builders define a result for every
# index (a read outside the block table gives the entry -1) and transcode_k_cache skips ids
# outside either cache, so they have nothing to enforce.
ENFORCED_OPS = frozenset(s.name for s in op_specs.SPECS if s.enforced)


def enforce(op: str, args: list) -> None:
    """Raise the ``ValueError`` of ``check_<op>`` for the kernel arguments ``args`` whatever
    ``DSV41_VALIDATE`` says: the always-on rule of the implementations that can afford it
    (the reference, and the CPU kernels when their pre-scan finds an index out of range).
    Without ``DSV41_VALIDATE`` only bounds are enforced: duplicate slots (a write race on a
    GPU, but never a write outside the tensors) are reported under ``DSV41_VALIDATE=1`` only."""
    if op not in ENFORCED_OPS:
        return
    _enforcing.on = True
    try:
        check_kernel_args(op, args)
    finally:
        _enforcing.on = False


def _active() -> bool:
    """Validation on (or ``enforce`` running), and the call is not being traced by
    ``torch.compile`` nor captured into a CUDA graph (a device sync is impossible there: the
    checks are skipped)."""
    if not (validate_enabled() or _enforcing.on):
        return False
    if torch.compiler.is_compiling():
        return False
    if torch.cuda.is_initialized() and torch.cuda.is_current_stream_capturing():
        return False
    return True


# --------------------------------------------------------------------------- machinery


class _Checks:
    """Collects ``bad`` masks of one op call; ``run()`` syncs once and raises on the first."""

    def __init__(self, op: str):
        self.op = op
        self.items = []  # (arg, bad mask, values or None, expected, what, locate)

    def add(self, arg: str, bad: torch.Tensor, values: torch.Tensor | None, expected: str,
            what: str = "value", locate=None):
        """Register a check: ``bad`` marks the offending elements, ``values`` (same shape)
        their values.  ``what`` names the value ("value", "block id", ...) or is a whole
        phrase with ``{v}`` and ``{at}`` placeholders; ``locate(index)`` turns the index of
        the first bad element into the text of ``{at}`` (default: ``[i, j]``)."""
        if bad.numel() == 0:
            return
        self.items.append((arg, bad, values, expected, what, locate))

    def run(self) -> None:
        if not self.items:
            return
        flags = torch.stack([it[1].any() for it in self.items]).tolist()  # the one sync
        for any_bad, (arg, bad, values, expected, what, locate) in zip(flags, self.items):
            if not any_bad:
                continue
            where = bad.nonzero()[0].tolist()
            at = locate(where) if locate is not None else "[" + ", ".join(str(i) for i in where) + "]"
            tag = f" ({ENV})" if validate_enabled() else ""
            if values is None:
                raise ValueError(f"{self.op}: argument '{arg}' at {at}: expected {expected}{tag}")
            v = values[tuple(where)].item()
            said = what.format(v=v, at=at) if "{v}" in what else f"has {what} {v} at {at}"
            raise ValueError(f"{self.op}: argument '{arg}' {said}, expected {expected}{tag}")


def _slots(ch: _Checks, arg: str, slot_mapping, limit: int, limit_text: str, writes=None):
    """Slots of writing tokens (slot >= 0 and ``writes``) must be < limit and distinct."""
    s = slot_mapping.to(_I64)
    valid = s >= 0
    ch.add(arg, valid & (s >= limit), s, f"a negative value (skip) or a slot < {limit_text} = {limit}")
    w = valid if writes is None else valid & writes
    _duplicates(ch, arg, s, w)


def _duplicates(ch: _Checks, arg: str, s: torch.Tensor, w: torch.Tensor, what: str = "duplicate slot",
                expected: str = "distinct slots for the tokens that write (two tokens writing one slot race)"):
    """Report the second of two writing tokens that share a slot (a write race)."""
    n = s.shape[0]
    if n < 2 or not validate_enabled():
        return
    # Non-writing tokens get distinct negative keys; writing ones their slot.
    key = torch.where(w, s, -1 - torch.arange(n, device=s.device, dtype=_I64))
    order = torch.sort(key, stable=True).indices
    sk = key[order]
    dup_sorted = torch.zeros_like(sk, dtype=torch.bool)
    dup_sorted[1:] = (sk[1:] == sk[:-1]) & (sk[1:] >= 0)
    dup = torch.zeros_like(dup_sorted).index_put_((order,), dup_sorted)
    ch.add(arg, dup, s, expected, what=what)


def _positions(ch: _Checks, arg: str, positions, n: int, rows: int, table_arg: str, mask=None):
    """``positions[:n]`` (where ``mask``) index a cos/sin cache of ``rows`` rows."""
    p = positions.reshape(-1)[:n].to(_I64)
    bad = (p < 0) | (p >= rows)
    if mask is not None:
        bad = bad & mask
    ch.add(arg, bad, p, f"0 <= position < {table_arg}.shape[0] = {rows}")


def _requests(ch: _Checks, arg: str, req: torch.Tensor, num_reqs: int, what_reqs: str, mask=None):
    r = req.to(_I64)
    bad = (r < 0) | (r >= num_reqs)
    if mask is not None:
        bad = bad & mask
    ch.add(arg, bad, r, f"a request index in [0, {what_reqs} = {num_reqs})")


def _table_reads(ch: _Checks, arg: str, table: torch.Tensor, rows: torch.Tensor, cols: torch.Tensor,
                 read: torch.Tensor, num_blocks: int | None, block_size: int, why: str, reader: str,
                 table_arg: str | None = None, row_offset: int = 0):
    """Entries ``table[rows, cols]`` where ``read`` (a [tokens, columns] grid): the logical
    block (column) inside the table width; the entry a valid block id, ``[0, num_blocks)``,
    or, when the cache is not known (index builders), ``>= 0`` with ``id * block_size``
    inside int32.  ``rows`` must be in range where ``read``.  Bad columns are reported on
    ``arg`` (the tensor that asked for them), bad entries on ``table_arg``."""
    rows, cols, read = torch.broadcast_tensors(rows.to(_I64), cols.to(_I64), read)
    n_rows, width = table.shape
    table_arg = table_arg or arg

    def at_grid(w):
        return f"[{w[0]}, {w[1]}] ({reader} {w[0] + row_offset})"

    def at_table(w):
        return f"[{rows[w[0], w[1]].item()}, {cols[w[0], w[1]].item()}] (read for {reader} {w[0] + row_offset})"

    ch.add(arg, read & (cols >= width), cols,
           f"a logical block ({why}) < the width {width} of '{table_arg}'", what="logical block", locate=at_grid)
    ok = read & (cols >= 0) & (cols < width) & (rows >= 0) & (rows < n_rows)
    if n_rows == 0 or width == 0:
        return
    e = table[torch.where(ok, rows, 0), torch.where(ok, cols, 0)].to(_I64)
    if num_blocks is not None:
        ch.add(table_arg, ok & ((e < 0) | (e >= num_blocks)), e,
               f"a block id in [0, num_blocks = {num_blocks}) for every entry read ({why})", what="block id",
               locate=at_table)
    else:
        ch.add(table_arg, ok & (e < 0), e, f"a block id >= 0 for every entry read ({why})", what="block id",
               locate=at_table)
        lim = (_INT32_MAX - (block_size - 1)) // block_size
        ch.add(table_arg, ok & (e > lim), e, f"block id * block_size to fit int32 (block id <= {lim})",
               what="block id", locate=at_table)


def _qsl(ch: _Checks, arg: str, qsl: torch.Tensor, first_min: int | None = 0):
    q = qsl.to(_I64)
    if q.shape[0] >= 2:
        bad = torch.zeros_like(q, dtype=torch.bool)
        bad[1:] = q[1:] < q[:-1]
        ch.add(arg, bad, q, "a non-decreasing sequence of token offsets", what="offset")
    if first_min is not None and q.shape[0] >= 1:
        ch.add(arg, q[:1] < first_min, q[:1], f"query_start_loc[0] >= {first_min}", what="offset")


# --------------------------------------------------------------------------- cache_utils


def check_quantize_and_insert_k_cache(k, k_cache, slot_mapping, block_size) -> None:
    """Slots < ``k_cache.shape[0] * block_size``; no two tokens share a slot."""
    if not _active():
        return
    ch = _Checks("quantize_and_insert_k_cache")
    nb = k_cache.shape[0]
    _slots(ch, "slot_mapping", slot_mapping, nb * block_size, f"num_blocks*block_size ({nb}*{block_size})")
    ch.run()


def check_dequantize_and_gather_k_cache(out, k_cache, seq_lens, gather_lens, block_table, block_size, offset) -> None:
    """``0 <= n <= L``, ``offset + n <= out.shape[1]``, every block-table entry the gather
    reads (logical blocks ``(L-n)//B … (L-1)//B``) inside the table and in ``[0, num_blocks)``."""
    if not _active():
        return
    ch = _Checks("dequantize_and_gather_k_cache")
    R = seq_lens.shape[0]
    dev = seq_lens.device
    L = seq_lens.to(_I64)
    ch.add("seq_lens", L < 0, L, "a length >= 0", what="length")
    if gather_lens is None:
        n, arg_n = L.clamp(min=0), "seq_lens"
    else:
        n, arg_n = gather_lens.to(_I64), "gather_lens"
        ch.add("gather_lens", n < 0, n, "a length >= 0", what="length")
        ch.add("gather_lens", n > L, n, "gather_lens[r] <= seq_lens[r]", what="length")
    rows = out.shape[1]
    n = n.clamp(min=0)
    ch.add(arg_n, offset + n > rows, n,
           f"offset + n <= out.shape[1] (argument 'offset' = {offset}, out.shape[1] = {rows})", what="length")
    if R > 0:
        B = block_size
        Lc = L.clamp(min=0)
        nc = torch.minimum(n, Lc)
        first = (Lc - nc) // B  # first and last logical block read
        last = (Lc - 1).clamp(min=0) // B
        width = block_table.shape[1]
        reads = nc > 0
        ch.add("seq_lens", reads & (last >= width), L,
               f"positions L-n ... L-1 inside the width of 'block_table' ({width} blocks of {B} = {width * B} positions)",
               what="length")
        j = torch.arange(width, device=dev, dtype=_I64).unsqueeze(0)
        read = reads.unsqueeze(1) & (j >= first.unsqueeze(1)) & (j <= last.unsqueeze(1))
        r = torch.arange(R, device=dev, dtype=_I64).unsqueeze(1)
        _table_reads(ch, "block_table", block_table, r, j, read, k_cache.shape[0], B,
                     "read for positions L-n ... L-1", "request")
    ch.run()


def check_compute_global_topk_indices_and_lens(topk_indices, token_to_req_indices, block_table, block_size, is_valid_token) -> None:
    """Entries the op translates, ``block_table[token_to_req[n], x // B]`` for ``x >= 0``, must
    be >= 0 with ``id * B`` inside int32.  A request index outside ``[0, block_table.shape[0])``
    or a logical block past the table width is not checked: the op defines it (entry −1, not
    counted; spec §5, bounds-checked variant)."""
    if not _active():
        return
    ch = _Checks("compute_global_topk_indices_and_lens")
    n = topk_indices.shape[0]
    x = topk_indices.to(_I64)
    present = x >= 0
    req = token_to_req_indices[:n].to(_I64)
    nr, width = block_table.shape
    blk = torch.where(present, x, 0) // block_size
    read = present & ((req >= 0) & (req < nr)).unsqueeze(1) & (blk < width)
    _table_reads(ch, "topk_indices", block_table, req.unsqueeze(1), blk, read, None, block_size,
                 "topk_indices[n, j] // block_size", "token", table_arg="block_table")
    ch.run()


def check_combine_topk_swa_indices(topk_indices, query_start_loc, seq_lens, gather_lens, window_size, compress_ratio, topk, M, N) -> None:
    """Per request b: ``query_start_loc`` non-decreasing, ``seq_lens[b] >=`` its query length
    (positions >= 0), ``0 <= gather_lens[b] <= seq_lens[b]``, the SWA tail inside the request's
    workspace rows (``N + gather_lens[b] <= M``) and ``M * num_reqs`` within int32."""
    if not _active():
        return
    ch = _Checks("combine_topk_swa_indices")
    R = query_start_loc.shape[0] - 1
    _qsl(ch, "query_start_loc", query_start_loc, first_min=None)
    if R > 0:
        if M * R > _INT32_MAX:
            raise ValueError(
                f"combine_topk_swa_indices: argument 'M' is {M}, expected M * num_reqs ({R}) <= 2^31-1 ({ENV})"
            )
        q = query_start_loc.to(_I64)
        ql = q[1:] - q[:-1]
        L = seq_lens[:R].to(_I64)
        g = gather_lens[:R].to(_I64)
        ch.add("seq_lens", L < ql, L, "seq_lens[b] >= the request's query length (positions >= 0)", what="length")
        ch.add("gather_lens", g < 0, g, "a length >= 0", what="length")
        ch.add("gather_lens", g > L, g, "gather_lens[b] <= seq_lens[b]", what="length")
        ch.add("gather_lens", N + g > M, g,
               f"N + gather_lens[b] <= M (the SWA tail inside the request's workspace rows; N {N}, M {M})",
               what="length")
    ch.run()


def check_build_flashinfer_mixed_sparse_indices(
    decode_swa_indices,
    decode_compressed_indices,
    decode_compressed_topk_lens,
    prefill_topk_indices,
    query_start_loc,
    seq_lens,
    token_to_req_indices,
    swa_block_table,
    swa_block_size,
    compressed_block_table,
    compressed_block_size,
    window_size,
    compress_ratio,
    topk,
    decode_compressed_indices_are_local=False,
    decode_is_valid_token=None,
    *,
    replay_start,
) -> None:
    """Request index of every row in ``[0, num_reqs)`` (and inside the tables it reads);
    prefill rows inside their request's ``query_start_loc`` range with positions >= 0;
    decode lengths in ``[0, K_dec]``; every table entry read (local decode indices, the
    prefill SWA window, prefill top-k indices) inside the table width and >= 0."""
    if not _active():
        return
    ch = _Checks("build_flashinfer_mixed_sparse_indices")
    if compressed_block_table is None:
        compressed_block_table = swa_block_table
    D = decode_swa_indices.shape[0]
    P = prefill_topk_indices.shape[0]
    R = seq_lens.shape[0]
    dev = decode_swa_indices.device
    k_dec = 0 if decode_compressed_indices is None else decode_compressed_indices.shape[1]
    cbs, sbs = compressed_block_size, swa_block_size
    req_all = token_to_req_indices[: D + P].to(_I64)
    _requests(ch, "token_to_req_indices", req_all, R, "seq_lens.shape[0]")
    if D > 0 and k_dec > 0:
        if decode_compressed_indices_are_local:
            v = decode_compressed_indices.to(_I64)
            present = v >= 0
            req = req_all[:D]
            nr = compressed_block_table.shape[0]
            _requests(ch, "token_to_req_indices", req, nr, "compressed_block_table.shape[0]", present.any(dim=1))
            req_ok = (req >= 0) & (req < nr)
            _table_reads(ch, "decode_compressed_indices", compressed_block_table, req.unsqueeze(1),
                         torch.where(present, v, 0) // cbs, present & req_ok.unsqueeze(1), None, cbs,
                         "decode_compressed_indices[n, j] // compressed_block_size", "decode row",
                         table_arg="compressed_block_table")
        elif decode_compressed_topk_lens is not None:
            lens = decode_compressed_topk_lens[:D].to(_I64)
            ch.add("decode_compressed_topk_lens", (lens < 0) | (lens > k_dec), lens,
                   f"a length in [0, K_dec = {k_dec}]", what="length")
    if P > 0:
        q = query_start_loc[: R + 1].to(_I64)
        _qsl(ch, "query_start_loc", q)
        req = req_all[D:]
        req_ok = (req >= 0) & (req < R)
        rq = torch.where(req_ok, req, 0)
        qs, qe = q[rq], q[rq + 1]
        t = torch.arange(D, D + P, device=dev, dtype=_I64)
        row = lambda w: f"[{D + w[0]}]"
        ch.add("token_to_req_indices", req_ok & ((t < qs) | (t >= qe)), req,
               "the request whose query_start_loc range holds the row", what="request index", locate=row)
        L = seq_lens.to(_I64)[rq]
        pos = L - (qe - qs) + (t - qs)
        ok = req_ok & (t >= qs) & (t < qe)
        ch.add("seq_lens", ok & (pos < 0), L, "seq_lens[req] >= the request's query length (positions >= 0)",
               what="length", locate=lambda w: f"[{rq[w[0]].item()}] (request of row {D + w[0]})")
        ok = ok & (pos >= 0)
        swa_start = torch.maximum(torch.maximum(pos - window_size + 1, torch.zeros_like(pos)),
                                  replay_start.to(_I64)[rq])
        has_swa = ok & (pos >= swa_start)
        # SWA columns read: logical blocks swa_start//sbs ... pos//sbs of the request's row.
        nr = swa_block_table.shape[0]
        ch.add("token_to_req_indices", has_swa & (req >= nr), req,
               f"a request index < swa_block_table.shape[0] = {nr}", what="request index", locate=row)
        has_swa = has_swa & (req < nr)
        width = swa_block_table.shape[1]
        last = pos.clamp(min=0) // sbs
        ch.add("swa_block_table", has_swa & (last >= width), last + 1,
               f"a table width >= the logical blocks read (table width {width})",
               what="is too narrow: the SWA window of row {at} reads {v} logical blocks", locate=row)
        j = torch.arange(width, device=dev, dtype=_I64).unsqueeze(0)
        read = has_swa.unsqueeze(1) & (j >= (swa_start // sbs).unsqueeze(1)) & (j <= last.unsqueeze(1))
        _table_reads(ch, "swa_block_table", swa_block_table, rq.unsqueeze(1), j, read, None,
                     sbs, "SWA window positions // swa_block_size", "row", row_offset=D)
        # Compressed columns j < min(K_pre, k_len) with x >= 0.
        k_pre = prefill_topk_indices.shape[1]
        if k_pre > 0 and compress_ratio > 0:
            k_len = torch.minimum(torch.div(pos + 1, compress_ratio, rounding_mode="trunc"),
                                  torch.full_like(pos, topk))
            jc = torch.arange(k_pre, device=dev, dtype=_I64).unsqueeze(0)
            x = prefill_topk_indices.to(_I64)
            present = (x >= 0) & (jc < k_len.unsqueeze(1)) & ok.unsqueeze(1)
            nr = compressed_block_table.shape[0]
            ch.add("token_to_req_indices", present.any(dim=1) & (req >= nr), req,
                   f"a request index < compressed_block_table.shape[0] = {nr}", what="request index", locate=row)
            _table_reads(ch, "prefill_topk_indices", compressed_block_table, rq.unsqueeze(1),
                         torch.where(present, x, 0) // cbs, present & (req < nr).unsqueeze(1), None, cbs,
                         "prefill_topk_indices[p, j] // compressed_block_size", "row",
                         table_arg="compressed_block_table", row_offset=D)
    ch.run()


# --------------------------------------------------------------------------- fused_compress_quant_cache


def check_fused_save_compress_norm(positions, state_cache, slot_mapping, query_start_loc, token_to_req_indices, compress_ratio,
                                   prev_rows=None, prev_row_indices=None) -> None:
    """CR 2 only (CR 1 reads no index: any slot >= 0 just marks a valid token).  Bounds
    (``enforce`` too): ring slots ``< state_cache.shape[0] * capacity``, the
    ``token_to_req_indices`` of tokens with a slot in ``[0, num_reqs)``, ``query_start_loc`` in
    ``[0, T]``, positions of tokens with a slot in ``[0, 2^31)``,
    ``prev_row_indices[:num_reqs] < prev_rows.shape[0]`` (negative: read the ring).
    Consistency (``DSV41_VALIDATE=1`` only: no index leaves its tensor without it):
    ``query_start_loc`` non-decreasing, every request index in range, every token with a
    slot inside its request's chunk."""
    if not _active() or compress_ratio != 2:
        return
    full = validate_enabled()
    ch = _Checks("fused_save_compress_norm")
    T = slot_mapping.shape[0]
    nb, cap = state_cache.shape[0], state_cache.shape[1]
    s = slot_mapping.to(_I64)
    valid = s >= 0
    ch.add("slot_mapping", valid & (s >= nb * cap), s,
           f"a negative value (skip) or a ring slot < state_cache.shape[0]*capacity ({nb}*{cap}) = {nb * cap}")
    R = query_start_loc.shape[0] - 1
    q = query_start_loc.to(_I64)
    if full:
        _qsl(ch, "query_start_loc", query_start_loc)
        ch.add("query_start_loc", q[-1:] > T, q[-1:], f"query_start_loc[-1] <= the token count {T}",
               what="offset", locate=lambda w: f"[{q.shape[0] - 1}]")
    else:
        ch.add("query_start_loc", (q < 0) | (q > T), q, f"token offsets in [0, T = {T}]", what="offset")
    req = token_to_req_indices[:T].to(_I64)
    _requests(ch, "token_to_req_indices", req, R, "query_start_loc.shape[0]-1", None if full else valid)
    if full and R > 0 and T > 0:
        req_ok = (req >= 0) & (req < R)
        rq = torch.where(req_ok, req, 0)
        t = torch.arange(T, device=s.device, dtype=_I64)
        ch.add("token_to_req_indices", valid & req_ok & ((t < q[rq]) | (t >= q[rq + 1])), req,
               "the request whose range in 'query_start_loc' holds the token", what="request index")
    p = positions.reshape(-1)[:T].to(_I64)
    ch.add("positions", valid & ((p < 0) | (p > _INT32_MAX)), p,
           "a position in [0, 2^31) for every token with a slot", what="value")
    if prev_rows is not None and R > 0:
        pi = prev_row_indices[:R].to(_I64)
        ch.add("prev_row_indices", pi >= prev_rows.shape[0], pi,
               f"a negative value (read the ring) or a row < prev_rows.shape[0] = {prev_rows.shape[0]}", what="value")
    ch.run()


def check_save_ring_rows(rows, slot_mapping, state_cache) -> None:
    """Slots >= 0 ``< state_cache.shape[0] * capacity``."""
    if not _active():
        return
    ch = _Checks("save_ring_rows")
    nb, cap = state_cache.shape[0], state_cache.shape[1]
    s = slot_mapping.to(_I64)
    ch.add("slot_mapping", (s >= 0) & (s >= nb * cap), s,
           f"a negative value (skip) or a ring slot < state_cache.shape[0]*capacity ({nb}*{cap}) = {nb * cap}")
    ch.run()


def _group_writer(op, positions, cos_sin_cache, cache, slot_arg, slot_mapping, compress_ratio) -> None:
    """The writers of one row per group of ``compress_ratio`` tokens: slots >= 0 inside the paged
    ``cache`` (no two group-closing tokens on one slot) and their positions inside the table."""
    ch = _Checks(op)
    T = slot_mapping.shape[0]
    nb, B = cache.shape[0], cache.shape[1]
    p = positions.reshape(-1)[:T].to(_I64)
    closes = (p + 1) % compress_ratio == 0
    _slots(ch, slot_arg, slot_mapping, nb * B, f"num_blocks*block_size ({nb}*{B})", writes=closes)
    _positions(ch, "positions", positions, T, cos_sin_cache.shape[0], "cos_sin_cache", mask=slot_mapping >= 0)
    ch.run()


def check_rope_quant_insert(positions, cos_sin_cache, kv_cache, slot_mapping, compress_ratio) -> None:
    """Slots of tokens with a slot >= 0 ``< kv_cache.shape[0] * kv_cache.shape[1]`` and their
    positions inside ``cos_sin_cache``; no two group-closing tokens share a slot."""
    if not _active():
        return
    _group_writer("rope_quant_insert", positions, cos_sin_cache, kv_cache, "slot_mapping", slot_mapping,
                  compress_ratio)


# --------------------------------------------------------------------------- indexer


def check_indexer_k_norm_rope_store(positions, cos_sin_cache, k_cache, kv_slot_mapping, compress_ratio) -> None:
    """Slots of tokens with a slot >= 0 ``< k_cache.shape[0] * k_cache.shape[1]`` and their
    positions inside ``cos_sin_cache``; no two group-closing tokens share a slot."""
    if not _active():
        return
    _group_writer("indexer_k_norm_rope_store", positions, cos_sin_cache, k_cache, "kv_slot_mapping",
                  kv_slot_mapping, compress_ratio)


def check_fused_indexer_q_rope_quant(positions, index_q, index_q_cos_sin_cache) -> None:
    """Every position (one per token) inside ``index_q_cos_sin_cache``."""
    if not _active():
        return
    ch = _Checks("fused_indexer_q_rope_quant")
    _positions(ch, "positions", positions, index_q.shape[0], index_q_cos_sin_cache.shape[0], "index_q_cos_sin_cache")
    ch.run()


def check_fused_inv_rope_fp8_quant(o, positions, cos_sin_cache) -> None:
    """Every position (one per token) inside ``cos_sin_cache``."""
    if not _active():
        return
    ch = _Checks("fused_inv_rope_fp8_quant")
    _positions(ch, "positions", positions, o.shape[0], cos_sin_cache.shape[0], "cos_sin_cache")
    ch.run()


# --------------------------------------------------------------------------- transcode


def check_transcode_k_cache(src, dst, block_ids) -> None:
    """Block ids that convert a page (``0 <= id < min(src.shape[0], dst.shape[0])``; negative
    ids and ids past either cache are skipped by contract) must be distinct: with a duplicate
    an in-place call may convert a page twice on parallel backends."""
    if not _active():
        return
    ch = _Checks("transcode_k_cache")
    ids = block_ids.to(_I64)
    nb = min(src.shape[0], dst.shape[0])
    converts = (ids >= 0) & (ids < nb)
    _duplicates(ch, "block_ids", ids, converts, what="duplicate block id",
                expected="distinct block ids (a page listed twice may be converted twice in place)")
    ch.run()


# --------------------------------------------------------------------------- kernel-contract arguments


def _bind(op: str):
    """``(check function, (name, position) of each of its parameters among the kernel
    arguments)`` from the op's declaration (``dsv41.core.op_specs``): a check takes the kernel
    arguments it names."""
    hit = _bound.get(op)
    if hit is None:
        s = op_specs.spec(op)
        if s.index_check is None:
            hit = (None, ())
        else:
            fn = globals()[s.index_check]
            params = list(inspect.signature(fn).parameters)
            hit = (fn, tuple((p, s.position(p)) for p in params))
        _bound[op] = hit
    return hit


_bound: dict = {}


def check_kernel_args(op: str, args) -> None:
    """Run the index check of ``op`` on its positional kernel arguments
    (docs/kernel_contract.md), e.g. a conformance case; honours ``DSV41_VALIDATE``.  Trailing
    arguments left out take the check's defaults."""
    if not _active():  # each check starts with this test: skip building its arguments
        return
    fn, where = _bind(op)
    if fn is not None:
        n = len(args)
        fn(**{p: args[i] for p, i in where if i < n})
