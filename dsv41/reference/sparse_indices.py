"""Pure-PyTorch reference of the sparse-attention index builders (spec cache_ops.md §5-§7).

Kernel contract (docs/kernel_contract.md): every function receives validated inputs and
preallocated outputs, writes the outputs in place and returns ``None``.

Conventions shared by the three ops:

* Index arithmetic is int32, like the Triton kernels (values wrap exactly as they would
  there); only the positions used to *read* a tensor are widened to int64.
* A block table is read with 2-D advanced indexing, so its strides (a ``[:, :w]`` view with
  ``stride(0) > w``, a transposed table, ...) are honoured.  Entries the spec says are not
  read are masked, and the index used for the read is clamped, so nothing is ever read out
  of range.  A table read that falls outside the table's logical shape (a bad request
  index or a logical block past the table width) yields the "no slot" sentinel -1 instead
  of whatever memory the GPU kernel would have read; §5 defines it so (bounds-checked
  variant) and does not count such entries.
* Integer division of values that may be negative uses C truncation (``rounding_mode=
  "trunc"``), as Triton does; every other ``//`` / ``%`` here has a non-negative left
  operand (spec §0.2), where floor and truncation agree.
"""

from __future__ import annotations

import torch

__all__ = [
    "compute_global_topk_indices_and_lens",
    "combine_topk_swa_indices",
    "build_flashinfer_mixed_sparse_indices",
]

_I32 = torch.int32


# --------------------------------------------------------------------------- helpers


def _table_lookup(
    table: torch.Tensor, rows: torch.Tensor, cols: torch.Tensor, read: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """``table[rows, cols]`` (int32) where ``read``; also returns the mask of the entries
    actually read (``read`` and inside the table's logical shape).  Other entries are 0.

    ``rows``, ``cols`` and ``read`` broadcast together.  Only valid positions are used:
    the read index is clamped to ``(0, 0)`` elsewhere, and the result is masked by the
    caller with the returned mask (spec §1.1: ``slot = table[r, p // B] * B + p % B``).
    """
    rows, cols, read = torch.broadcast_tensors(rows, cols, read)
    n_rows, n_cols = table.shape
    ok = read & (rows >= 0) & (rows < n_rows) & (cols >= 0) & (cols < n_cols)
    if n_rows == 0 or n_cols == 0:  # nothing can be read from an empty table
        return torch.zeros(rows.shape, dtype=_I32, device=rows.device), ok
    r = torch.where(ok, rows, 0).long()
    c = torch.where(ok, cols, 0).long()
    return table[r, c].to(_I32), ok


def _per_request(values: torch.Tensor, req: torch.Tensor) -> torch.Tensor:
    """``values[req]`` for a per-request int32 array; ``req`` is clamped into range (an
    out-of-range request index is outside every op's contract; it must not crash)."""
    if values.shape[0] == 0:
        return torch.zeros(req.shape, dtype=_I32, device=req.device)
    return values[req.clamp(0, values.shape[0] - 1).long()].to(_I32)


def _div_trunc(a: torch.Tensor, b: int) -> torch.Tensor:
    """Triton/C integer division (truncation toward zero)."""
    return torch.div(a, b, rounding_mode="trunc")


def _columns(src: torch.Tensor | None, rows: int, width: int, device) -> torch.Tensor:
    """``[rows, width]`` int32: the first ``width`` columns of ``src``, −1 past its width
    (or everywhere when ``src`` is None)."""
    out = torch.full((rows, width), -1, dtype=_I32, device=device)
    if src is not None:
        w = min(width, src.shape[1])
        out[:, :w] = src[:rows, :w]
    return out


# ------------------------------------------------------------------------------ §5


def compute_global_topk_indices_and_lens(
    topk_indices, token_to_req_indices, block_table, block_size, is_valid_token, global_topk_indices,
    topk_lens, compact=False,
) -> None:
    """§5 with the bounds-checked variant's rules: local top-k indices → global slots.

    An entry ``x = topk_indices[n, j]`` is valid when ``x ≥ 0``, ``r = token_to_req[n]`` is
    in ``[0, block_table.shape[0])`` and ``x // B < block_table.shape[1]`` (the logical
    width, not the stride); it becomes ``table[r, x // B] * B + x % B``, every other entry
    −1.  ``topk_lens[n]`` = number of valid entries if the token is valid, else 0; rows of
    invalid tokens are still translated (and compacted).  ``compact`` moves the valid
    entries of each row to its front in their original order, −1 after them; otherwise
    the −1 holes stay in place.
    """
    n_tok = topk_indices.shape[0]
    if n_tok == 0:
        return None
    B = block_size
    x = topk_indices.to(_I32)
    present = x >= 0  # −1 (any negative) = empty entry
    req = token_to_req_indices[:n_tok].to(_I32).unsqueeze(1)
    xs = torch.where(present, x, 0)
    block_id, ok = _table_lookup(block_table, req, xs // B, present)
    slots = torch.where(ok, block_id * B + xs % B, -1)
    if compact:
        # a stable sort on "invalid" keeps the valid entries' order; the rest are all −1
        order = torch.argsort((~ok).to(torch.uint8), dim=1, stable=True)
        slots = torch.gather(slots, 1, order)
    global_topk_indices.copy_(slots)

    count = ok.sum(dim=1, dtype=_I32)
    topk_lens.copy_(torch.where(is_valid_token[:n_tok].bool(), count, 0))
    return None


# ------------------------------------------------------------------------------ §6


def combine_topk_swa_indices(
    topk_indices, query_start_loc, seq_lens, gather_lens, window_size, compress_ratio, topk, M, N,
    combined_indices, combined_lens,
) -> None:
    """§6 (current token-parallel version): sparse prefill rows into the gathered workspace.

    Request b owns workspace rows ``[b·M, (b+1)·M)``: compressed tokens at ``b·M + j``,
    the SWA tail (positions ``L − g … L − 1``) at ``b·M + N + i``.  Writes every column of
    rows ``t < T``.
    """
    T = topk_indices.shape[0]
    if T == 0:  # §6: returns immediately when T = 0
        return None
    dev = topk_indices.device
    # R = number of requests = len(query_start_loc) - 1 (seq_lens / gather_lens may be longer)
    R = query_start_loc.shape[0] - 1
    W_out = combined_indices.shape[1]
    idx_out = combined_indices[:T]
    lens_out = combined_lens[:T]
    if R == 0:  # no request owns any token: every row is −1, length 0
        idx_out.fill_(-1)
        lens_out.fill_(0)
        return None

    # Rebase: query_start_loc may be a slice of a global tensor.
    qsl = query_start_loc[: R + 1].to(_I32) - query_start_loc[0].to(_I32)
    t = torch.arange(T, dtype=_I32, device=dev)

    # Request of token t: the last b ∈ [0, R−1] with qsl[b] ≤ t (zero-length requests
    # are skipped naturally); tokens at or past qsl[R] are owned by nobody.
    b = torch.searchsorted(qsl[:R].contiguous(), t, right=True, out_int32=True) - 1
    b = b.clamp(0, R - 1)
    owned = t < qsl[R]

    qs = _per_request(qsl[:R], b)
    qe = _per_request(qsl[1:], b)
    L = _per_request(seq_lens, b)
    g = _per_request(gather_lens, b)
    pos = L - (qe - qs) + (t - qs)
    gstart = L - g  # first position present in the gathered SWA tail

    if compress_ratio > 0:
        k_len = _div_trunc(pos + 1, compress_ratio).clamp(0, topk)
    else:  # CR = 0: SWA-only layer (caller passes topk = 0)
        k_len = torch.zeros_like(pos)
    swa_start = torch.maximum(torch.maximum(pos - window_size + 1, torch.zeros_like(pos)), gstart)
    swa_len = (pos - swa_start + 1).clamp(min=0)
    k_len = torch.where(owned, k_len, 0)
    swa_len = torch.where(owned, swa_len, 0)

    j = torch.arange(W_out, dtype=_I32, device=dev).unsqueeze(0)
    k_len2, swa_len2 = k_len.unsqueeze(1), swa_len.unsqueeze(1)
    base = (M * b).unsqueeze(1)  # int32, as in the kernel

    # Top-k columns j < k_len: v + M·b if 0 ≤ v < N else −1 (column kept, still counted).
    v = _columns(topk_indices, T, W_out, dev)
    topk_val = torch.where((v >= 0) & (v < N), v + base, -1)
    # SWA columns k_len ≤ j < k_len + swa_len: M·b + N + (position − gstart).
    swa_val = base + N + (swa_start.unsqueeze(1) + (j - k_len2) - gstart.unsqueeze(1))

    in_topk = j < k_len2
    in_swa = (j >= k_len2) & (j < k_len2 + swa_len2)
    idx_out.copy_(torch.where(in_topk, topk_val, torch.where(in_swa, swa_val, -1)))
    lens_out.copy_(k_len + swa_len)
    return None


# ------------------------------------------------------------------------------ §7


def _remap(v: torch.Tensor, block_size: int, span: int) -> torch.Tensor:
    """§7 span remap: −1 if v < 0 else (v // bs)·span + v % bs (packed pages)."""
    vs = torch.where(v >= 0, v, 0)
    return torch.where(v >= 0, (vs // block_size) * span + vs % block_size, -1)


def build_flashinfer_mixed_sparse_indices(
    decode_swa_indices, decode_compressed_indices, decode_compressed_topk_lens, prefill_topk_indices,
    query_start_loc, seq_lens, token_to_req_indices, swa_block_table, swa_block_size,
    compressed_block_table, compressed_block_size, window_size, compress_ratio, topk,
    decode_compressed_indices_are_local, decode_is_valid_token, swa_block_span, compressed_block_span,
    replay_start, sparse_indices, sparse_topk_lens,
) -> None:
    """§7: FlashInfer sparse-MLA index rows, D decode rows then P prefill rows.

    Row layout: ``[W_swa SWA slots | padded_topk compressed slots]``; every emitted slot
    goes through the span remap.  Every element of both outputs is written.
    """
    D, W_swa = decode_swa_indices.shape
    P = prefill_topk_indices.shape[0]
    if D + P == 0:  # §7: outputs returned uninitialised
        return None
    dev = sparse_indices.device
    padded_topk = sparse_indices.shape[1] - W_swa  # roundup4(max(topk, K_dec))
    sbs, cbs = swa_block_size, compressed_block_size
    sspan, cspan = swa_block_span, compressed_block_span

    # ---- decode rows n < D
    if D > 0:
        # SWA columns: already-global slots, remapped.
        sparse_indices[:D, :W_swa] = _remap(decode_swa_indices.to(_I32), sbs, sspan)

        K_dec = 0 if decode_compressed_indices is None else decode_compressed_indices.shape[1]
        v = _columns(decode_compressed_indices, D, padded_topk, dev)  # −1 for j ≥ K_dec
        if K_dec == 0:
            c_len = torch.zeros(D, dtype=_I32, device=dev)
        elif decode_compressed_indices_are_local:
            # Local indices: translate through the compressed table of the token's request;
            # count the v ≥ 0 entries of valid tokens only.
            present = v >= 0
            req = token_to_req_indices[:D].to(_I32).unsqueeze(1)
            vs = torch.where(present, v, 0)
            block_id, ok = _table_lookup(compressed_block_table, req, vs // cbs, present)
            v = torch.where(ok, block_id * cbs + vs % cbs, -1)
            if decode_is_valid_token is None:
                valid = torch.ones(D, dtype=torch.bool, device=dev)
            else:
                valid = decode_is_valid_token[:D].bool()
            c_len = (present & valid.unsqueeze(1)).sum(dim=1, dtype=_I32)
        elif decode_compressed_topk_lens is not None:
            c_len = decode_compressed_topk_lens[:D].to(_I32)
        else:
            c_len = torch.full((D,), K_dec, dtype=_I32, device=dev)
        sparse_indices[:D, W_swa:] = _remap(v, cbs, cspan)
        # The whole SWA width counts, −1 holes included.
        sparse_topk_lens[:D] = W_swa + c_len

    # ---- prefill rows n ≥ D
    if P > 0:
        n = torch.arange(D, D + P, dtype=_I32, device=dev)
        req = token_to_req_indices[D : D + P].to(_I32)
        R = seq_lens.shape[0]
        qs = _per_request(query_start_loc[:R], req)  # absolute offsets, not rebased
        qe = _per_request(query_start_loc[1 : R + 1], req)
        pos = _per_request(seq_lens, req) - (qe - qs) + (n - qs)
        zero = torch.zeros_like(pos)
        swa_start = torch.maximum(
            torch.maximum(pos - window_size + 1, zero), _per_request(replay_start, req)
        )
        swa_len = pos - swa_start + 1  # may be ≤ 0 when replay_start > pos
        if compress_ratio > 0:
            k_len = torch.minimum(_div_trunc(pos + 1, compress_ratio), zero + topk)
        else:  # CR = 0 guard
            k_len = zero
        req2 = req.unsqueeze(1)

        # SWA columns j < swa_len: slot of position swa_start + j through the SWA table.
        j = torch.arange(W_swa, dtype=_I32, device=dev).unsqueeze(0)
        in_swa = j < swa_len.unsqueeze(1)
        q = torch.where(in_swa, swa_start.unsqueeze(1) + j, 0)
        block_id, ok = _table_lookup(swa_block_table, req2, q // sbs, in_swa)
        swa_slot = torch.where(ok, block_id * sbs + q % sbs, -1)
        sparse_indices[D : D + P, :W_swa] = _remap(swa_slot, sbs, sspan)

        # Compressed columns j < min(K_pre, k_len): local index → compressed-table slot.
        jc = torch.arange(padded_topk, dtype=_I32, device=dev).unsqueeze(0)
        x = _columns(prefill_topk_indices, P, padded_topk, dev)  # −1 for j ≥ K_pre
        x = torch.where(jc < k_len.unsqueeze(1), x, -1)
        present = x >= 0
        xs = torch.where(present, x, 0)
        block_id, ok = _table_lookup(compressed_block_table, req2, xs // cbs, present)
        comp_slot = torch.where(ok, block_id * cbs + xs % cbs, -1)
        sparse_indices[D : D + P, W_swa:] = _remap(comp_slot, cbs, cspan)

        sparse_topk_lens[D : D + P] = W_swa + k_len
    return None
