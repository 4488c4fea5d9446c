"""``compute_global_topk_indices_and_lens``, bounds-checked (spec cache_ops.md §5, "Variant"):
what a bounds test of vLLM's newer kernel checks, on every implementation that runs here.

An entry ``x = topk_indices[n, j]`` is valid when ``x >= 0``, the token's request index ``r``
is in ``[0, block_table.shape[0])`` and ``x // B < block_table.shape[1]`` (the table's logical
width, not its row stride).  A valid entry becomes ``block_table[r, x // B] * B + x % B``,
every other one −1, and ``topk_lens[n]`` counts the valid entries (0 for an invalid token,
whose row is still translated).  ``compact=True`` moves the valid entries to the front of the
row in their original order, −1 after them.

The expected values are written out by hand or computed by the plain loops of ``_expected``;
the reference is one implementation under test here, not the oracle.  Implementations come from
``tests/impls.py`` (the reference included); Triton's run in its interpreter when the process
runs with ``TRITON_INTERPRET=1``, and are skipped otherwise.
"""

from __future__ import annotations

import pytest
import torch
from impls import implementations

import dsv41
from dsv41.core import index_checks
from dsv41.tools.conformance import _on

OP = "compute_global_topk_indices_and_lens"
I32 = torch.int32
IMPLS = implementations(include_reference=True)
INT32_MIN, INT32_MAX = -(2**31), 2**31 - 1


def _wrap32(v: int) -> int:
    return (v + 2**31) % 2**32 - 2**31


def _expected(idx, t2r, table, B, valid, compact):
    """Plain-Python model.  ``table``: the logical ``[R, W]`` block table as nested lists."""
    out, lens = [], []
    for n, row in enumerate(idx):
        r = t2r[n]
        slots, kept = [], []
        for x in row:
            if x >= 0 and 0 <= r < len(table) and x // B < len(table[r]):
                s = _wrap32(table[r][x // B] * B + x % B)
                slots.append(s)
                kept.append(s)
            else:
                slots.append(-1)
        if compact:
            slots = kept + [-1] * (len(row) - len(kept))
        out.append(slots)
        lens.append(len(kept) if valid[n] else 0)
    return out, lens


def _run(impl, idx, t2r, table, B, valid, compact):
    """Run ``impl``'s kernel on canary-filled outputs; the outputs and whether the canaries
    around them (a wider output row, one row and 5 entries of ``lens`` more) survived."""
    if impl.skip_reason(OP):
        pytest.skip(impl.skip_reason(OP))
    N, K = idx.shape
    out_buf = torch.full((N + 1, K + 3), -7, dtype=I32)
    lens_buf = torch.full((N + 5,), -7, dtype=I32)
    args = [idx, t2r, table, B, valid, out_buf[:N, 1: K + 1], lens_buf[2: N + 2], compact]
    args = _on(impl.device, args)  # same views over a copy of the whole buffers
    impl.kernel(OP)(*args)
    out_buf, lens_buf = _whole(args[5], out_buf.shape), _whole(args[6], lens_buf.shape)
    canaries = (out_buf[N] == -7).all() and (out_buf[:, 0] == -7).all() and (out_buf[:, K + 1:] == -7).all() \
        and (lens_buf[:2] == -7).all() and (lens_buf[N + 2:] == -7).all()
    return out_buf[:N, 1: K + 1].tolist(), lens_buf[2: N + 2].tolist(), bool(canaries)


def _whole(view, shape):
    """The contiguous buffer of ``shape`` that ``view`` lies in (its whole storage), on the CPU."""
    full = torch.empty(0, dtype=view.dtype, device=view.device)
    full.set_(view.untyped_storage(), 0, shape)
    return full.cpu()


def _table_view(rows, width, stride, fill=99):
    """A ``[R, width]`` view of an ``[R, stride]`` table: the columns past ``width`` hold
    ``fill``, so a kernel that bounded the logical block by the stride would read them."""
    wide = torch.full((len(rows), stride), fill, dtype=I32)
    wide[:, :width] = torch.tensor(rows, dtype=I32)
    return wide[:, :width]


def _check(impl, idx, t2r, table, B, valid, compact):
    got_out, got_lens, canaries = _run(impl, idx, t2r, table, B, valid, compact)
    want_out, want_lens = _expected(idx.tolist(), t2r.tolist(), table.tolist(), B, valid.tolist(), compact)
    assert got_out == want_out
    assert got_lens == want_lens
    assert canaries, "a write outside the outputs"


impl_param = pytest.mark.parametrize("impl", IMPLS, ids=[i.name for i in IMPLS])


# ------------------------------------------------------------------ hand-written expectations

# block table [[10, 11], [20, 21]] (logical width 2, row stride 5), B = 4
HAND_IDX = [
    [0, 5, -1, 8, 3],  # req 0: 8 // 4 = 2 is past the width (column 2 of the stride is 99)
    [0, 1, 2, 3, 4],  # req -1
    [0, 1, 2, 3, 4],  # req 2 = block_table.shape[0]
    [1, 7, -1, 4, 100],  # req 1, invalid token
    [-1, -1, 6, -5, 2],  # req 1: holes before the valid entries
    [0, 1, 2, 3, 4],  # req INT32_MAX
    [0, 1, 2, 3, 4],  # req INT32_MIN
    [INT32_MAX, 7, 11, 0, 4],  # req 0: 2^31 - 1 // 4 is far past the width
]
HAND_T2R = [0, -1, 2, 1, 1, INT32_MAX, INT32_MIN, 0, 1]  # one extra entry (never read)
HAND_VALID = [True, True, True, False, True, True, True, True, False]
HAND_WANT = {
    False: ([[40, 45, -1, -1, 43], [-1] * 5, [-1] * 5, [81, 87, -1, 84, -1], [-1, -1, 86, -1, 82],
             [-1] * 5, [-1] * 5, [-1, 47, -1, 40, 44]],
            [3, 0, 0, 0, 2, 0, 0, 3]),
    True: ([[40, 45, 43, -1, -1], [-1] * 5, [-1] * 5, [81, 87, 84, -1, -1], [86, 82, -1, -1, -1],
            [-1] * 5, [-1] * 5, [47, 40, 44, -1, -1]],
           [3, 0, 0, 0, 2, 0, 0, 3]),
}


@impl_param
@pytest.mark.parametrize("compact", [False, True], ids=["holes", "compact"])
def test_global_topk_bounds_hand_written(impl, compact):
    idx = torch.tensor(HAND_IDX, dtype=I32)
    table = _table_view([[10, 11], [20, 21]], 2, 5)
    got_out, got_lens, canaries = _run(impl, idx, torch.tensor(HAND_T2R, dtype=I32), table, 4,
                                       torch.tensor(HAND_VALID), compact)
    want_out, want_lens = HAND_WANT[compact]
    assert got_out == want_out
    assert got_lens == want_lens
    assert canaries
    # the model agrees with the hand-written values
    assert _expected(HAND_IDX, HAND_T2R, [[10, 11], [20, 21]], 4, HAND_VALID, compact) == (want_out, want_lens)


# ------------------------------------------------------------------ random inputs vs the model


def _random_case(seed, N, K, R, W, B, stride_extra=3, p_hole=0.2, p_past=0.15, p_bad_req=0.3):
    g = torch.Generator().manual_seed(seed)
    idx = torch.randint(0, W * B, (N, K), generator=g, dtype=I32)
    past = torch.randint(W * B, (W + 40) * B, (N, K), generator=g, dtype=I32)
    idx = torch.where(torch.rand(N, K, generator=g) < p_past, past, idx)
    holes = torch.rand(N, K, generator=g) < p_hole
    idx = torch.where(holes, torch.randint(-3, 0, (N, K), generator=g, dtype=I32), idx)
    if N > 1:
        idx[1] = -1  # an all-empty row
    t2r = torch.randint(0, R, (N + 2,), generator=g, dtype=I32)
    bad = torch.tensor([-1, R, R + 1000, INT32_MAX, INT32_MIN], dtype=I32)
    pick = torch.randint(0, bad.numel(), (N + 2,), generator=g)
    t2r = torch.where(torch.rand(N + 2, generator=g) < p_bad_req, bad[pick], t2r)
    rows = torch.randint(0, 100_000, (R, W), generator=g, dtype=I32).tolist()
    table = _table_view(rows, W, W + stride_extra)
    valid = torch.rand(N + 2, generator=g) > 0.25
    return idx, t2r, table, B, valid


@impl_param
@pytest.mark.parametrize("compact", [False, True], ids=["holes", "compact"])
@pytest.mark.parametrize("N,K,R,W,B", [(9, 37, 3, 5, 16), (6, 1030, 4, 40, 64), (5, 2053, 2, 9, 300),
                                       (7, 64, 3, 4, 3), (4, 11, 1, 1, 1)],
                         ids=["k37", "k1030", "k2053-b300", "b3", "one-block"])
def test_global_topk_bounds_random(impl, compact, N, K, R, W, B):
    for seed in (0, 1):
        _check(impl, *_random_case(seed, N, K, R, W, B), compact)


@impl_param
@pytest.mark.parametrize("compact", [False, True], ids=["holes", "compact"])
def test_global_topk_bounds_large_topk_all_valid_and_none_valid(impl, compact):
    """2048 + 5 columns: every entry valid (compaction is the identity, lens = K), then none
    (request outside the table / every block past the width, lens 0)."""
    K, B, W = 2053, 64, 40
    g = torch.Generator().manual_seed(5)
    idx = torch.randint(0, W * B, (3, K), generator=g, dtype=I32)
    idx[2] = torch.randint(W * B, 2 * W * B, (K,), generator=g, dtype=I32)
    table = _table_view(torch.randint(0, 5000, (2, W), generator=g, dtype=I32).tolist(), W, W + 1)
    t2r = torch.tensor([1, 2, 0], dtype=I32)
    _check(impl, idx, t2r, table, B, torch.ones(3, dtype=torch.bool), compact)
    got_out, got_lens, _ = _run(impl, idx, t2r, table, B, torch.ones(3, dtype=torch.bool), compact)
    assert got_lens == [K, 0, 0]
    assert got_out[1] == [-1] * K and got_out[2] == [-1] * K


@impl_param
def test_global_topk_bounds_compact_keeps_order_and_duplicates(impl):
    """Compaction is stable: valid entries keep their order, duplicates included."""
    table = _table_view([[3, 1, 2]], 3, 3)
    idx = torch.tensor([[9, -1, 0, 30, 9, 5, -1, 0, 17]], dtype=I32)  # B = 8: 30 // 8 = 3 is past
    got_out, got_lens, _ = _run(impl, idx, torch.tensor([0], dtype=I32), table, 8, torch.tensor([True]), True)
    assert got_out == [[9, 24, 9, 29, 24, 17, -1, -1, -1]]
    assert got_lens == [6]


@impl_param
@pytest.mark.parametrize("compact", [False, True], ids=["holes", "compact"])
def test_global_topk_bounds_empty_table(impl, compact):
    """A table with no rows or no columns: no entry is valid."""
    idx = torch.tensor([[0, 1, -1], [5, 2, 3]], dtype=I32)
    valid = torch.tensor([True, True])
    for table in (torch.zeros(0, 4, dtype=I32), torch.zeros(3, 8, dtype=I32)[:, :0]):
        got_out, got_lens, _ = _run(impl, idx, torch.tensor([0, 1], dtype=I32), table, 4, valid, compact)
        assert got_out == [[-1] * 3] * 2 and got_lens == [0, 0]


@impl_param
@pytest.mark.parametrize("compact", [False, True], ids=["holes", "compact"])
def test_global_topk_bounds_small_tiles(impl, compact, monkeypatch):
    """Kernels with a launch-shape table (Triton's ``TUNE``) run with several rows per program
    and many column steps, so compaction carries its count across steps."""
    if impl.skip_reason(OP):
        pytest.skip(impl.skip_reason(OP))
    tune = getattr(impl.kernel(OP), "__globals__", {}).get("TUNE")
    if tune is None:
        pytest.skip(f"{impl.name} has no launch-shape table")
    monkeypatch.setitem(tune, OP, {"BLOCK_R": 4, "BLOCK_C": 16, "num_warps": 4})
    _check(impl, *_random_case(3, 7, 150, 3, 6, 16, p_hole=0.3, p_past=0.3), compact)


# ------------------------------------------------------------------ the public function


def test_global_topk_public_compact_flag():
    idx = torch.tensor(HAND_IDX, dtype=I32)
    args = (idx, torch.tensor(HAND_T2R, dtype=I32), _table_view([[10, 11], [20, 21]], 2, 5), 4,
            torch.tensor(HAND_VALID))
    for compact in (False, True):
        out, lens = dsv41.compute_global_topk_indices_and_lens(*args, compact=compact)
        assert (out.tolist(), lens.tolist()) == HAND_WANT[compact]
    out, lens = dsv41.compute_global_topk_indices_and_lens(*args)  # default: holes in place
    assert (out.tolist(), lens.tolist()) == HAND_WANT[False]
    with pytest.raises(TypeError, match="'compact'"):
        dsv41.compute_global_topk_indices_and_lens(*args, compact=1)
    with pytest.raises(TypeError):  # keyword-only
        dsv41.compute_global_topk_indices_and_lens(*args, True)


def test_global_topk_validate_accepts_out_of_table(monkeypatch):
    """With ``DSV41_VALIDATE=1`` request indices and logical blocks outside the table are not
    errors (the op defines them); a negative block id that is read still is."""
    monkeypatch.setenv(index_checks.ENV, "1")
    assert index_checks.refresh()
    try:
        idx = torch.tensor(HAND_IDX, dtype=I32)
        t2r = torch.tensor(HAND_T2R, dtype=I32)
        valid = torch.tensor(HAND_VALID)
        table = _table_view([[10, 11], [20, 21]], 2, 5)
        out, lens = dsv41.compute_global_topk_indices_and_lens(idx, t2r, table, 4, valid, compact=True)
        assert (out.tolist(), lens.tolist()) == HAND_WANT[True]
        with pytest.raises(ValueError, match="'block_table'.*block id -1"):
            dsv41.compute_global_topk_indices_and_lens(idx, t2r, _table_view([[10, -1], [20, 21]], 2, 5), 4, valid)
    finally:
        monkeypatch.undo()
        index_checks.refresh()


@pytest.mark.parametrize("compact", [False, True], ids=["holes", "compact"])
def test_global_topk_opcheck_compact(compact):
    """The torch.library op takes ``compact`` as a trailing argument with a default."""
    idx = torch.tensor(HAND_IDX, dtype=I32)
    args = (idx, torch.tensor(HAND_T2R, dtype=I32), _table_view([[10, 11], [20, 21]], 2, 5), 4,
            torch.tensor(HAND_VALID), torch.full(idx.shape, -7, dtype=I32), torch.full((idx.shape[0],), -7, dtype=I32),
            compact)
    op = torch.ops.dsv41.compute_global_topk_indices_and_lens
    torch.library.opcheck(op.default, args,
                          test_utils=("test_schema", "test_autograd_registration", "test_faketensor"))
    op(*args)
    assert (args[5].tolist(), args[6].tolist()) == HAND_WANT[compact]


@impl_param
@pytest.mark.parametrize("compact", [False, True], ids=["holes", "compact"])
def test_global_topk_bounds_negative_entries_under_a_huge_page(impl, compact):
    """B = 2^24 and a table 300 blocks wide: a negative entry read as uint32 lands on block 128
    or more (-1 on block 255), inside the table's width, so a kernel that tests the block
    unsigned must also bound the width by 2^31 // B = 128 (no non-negative int32 entry reaches
    block 128)."""
    B, W = 2**24, 300
    g = torch.Generator().manual_seed(11)
    pos = torch.randint(0, INT32_MAX, (3, 40), generator=g, dtype=I32)
    neg = torch.tensor([-1, INT32_MIN, -(2**24), -(2**24) - 1, -(2**30), -5], dtype=I32)
    idx = torch.where(torch.rand(3, 40, generator=g) < 0.5, neg[torch.randint(0, 6, (3, 40), generator=g)], pos)
    table = _table_view(torch.randint(0, 100, (2, W), generator=g, dtype=I32).tolist(), W, W + 2)
    _check(impl, idx, torch.tensor([0, 1, 1], dtype=I32), table, B, torch.ones(3, dtype=torch.bool), compact)
