"""Reference sparse-index builders (dsv41.reference.sparse_indices) vs the spec and vLLM.

* Golden vectors: every case of compute_global_topk_indices_and_lens,
  combine_topk_swa_indices and build_flashinfer_mixed_sparse_indices in
  ``vllm-sm90.tar.xz`` (what vLLM's Triton kernels wrote on an H200), compared exactly.
* Hand-made cases: empty batch, the worked example of cache_ops.md §7, non-contiguous block
  tables, and random inputs against a per-token loop transcribed from the spec text.
"""

from __future__ import annotations

import functools
import io
import os
import random
import tarfile
from pathlib import Path

import pytest
import torch

import golden  # noqa: E402  (tests/ is on sys.path)

from dsv41.reference.sparse_indices import (
    build_flashinfer_mixed_sparse_indices,
    combine_topk_swa_indices,
    compute_global_topk_indices_and_lens,
)

_REPO = Path(__file__).resolve().parents[1]
VECTORS = golden.ARCHIVE  # tests/vectors (DSV41_VECTORS overrides)
OPS = (
    "compute_global_topk_indices_and_lens",
    "combine_topk_swa_indices",
    "build_flashinfer_mixed_sparse_indices",
)
CANARY = -7  # outputs start with this so that an unwritten element shows up
I32 = torch.int32


def _roundup(x: int, m: int) -> int:
    return (x + m - 1) // m * m


@functools.lru_cache(maxsize=1)
def _golden_cases() -> dict[str, dict]:
    cases = {}
    with tarfile.open(VECTORS, "r:xz") as tf:
        for member in tf.getmembers():
            if not member.isfile() or not member.name.endswith(".pt"):
                continue
            case = torch.load(io.BytesIO(tf.extractfile(member).read()), weights_only=True)
            if case["op"] in OPS:
                cases[os.path.basename(member.name)] = case
    return cases


def _golden_names() -> list:
    if not VECTORS.is_file():
        return [
            pytest.param(
                None,
                marks=pytest.mark.skip(
                    reason=f"golden vectors not found at {VECTORS} (set DSV41_VECTORS)"
                ),
            )
        ]
    return sorted(_golden_cases())


# ------------------------------------------------------------------ public-layer stand-ins
# What the public functions will do before calling a kernel: resolve defaults, allocate.


def run_global_topk(topk_indices, token_to_req_indices, block_table, block_size, is_valid_token):
    out = torch.full_like(topk_indices, CANARY, dtype=I32)
    lens = torch.full((topk_indices.shape[0],), CANARY, dtype=I32)
    r = compute_global_topk_indices_and_lens(
        topk_indices, token_to_req_indices, block_table, block_size, is_valid_token, out, lens
    )
    assert r is None
    return out, lens


def run_combine(topk_indices, query_start_loc, seq_lens, gather_lens, window_size,
                compress_ratio, topk, M, N, out=None):
    if out is None:
        T = topk_indices.shape[0]
        w_out = _roundup(topk + window_size, 128)
        out = (torch.full((T, w_out), CANARY, dtype=I32), torch.full((T,), CANARY, dtype=I32))
    r = combine_topk_swa_indices(
        topk_indices, query_start_loc, seq_lens, gather_lens, window_size, compress_ratio,
        topk, M, N, out[0], out[1],
    )
    assert r is None
    return out


def run_flashinfer(decode_swa_indices, decode_compressed_indices, decode_compressed_topk_lens,
                   prefill_topk_indices, query_start_loc, seq_lens, token_to_req_indices,
                   swa_block_table, swa_block_size, compressed_block_table,
                   compressed_block_size, window_size, compress_ratio, topk,
                   decode_compressed_indices_are_local=False, decode_is_valid_token=None,
                   swa_block_span=None, compressed_block_span=None, *, replay_start):
    if compressed_block_table is None:
        compressed_block_table = swa_block_table
    if swa_block_span is None:
        swa_block_span = swa_block_size
    if compressed_block_span is None:
        compressed_block_span = compressed_block_size
    D, w_swa = decode_swa_indices.shape
    P = prefill_topk_indices.shape[0]
    k_dec = 0 if decode_compressed_indices is None else decode_compressed_indices.shape[1]
    padded = _roundup(max(topk, k_dec), 4)
    idx = torch.full((D + P, w_swa + padded), CANARY, dtype=I32)
    lens = torch.full((D + P,), CANARY, dtype=I32)
    r = build_flashinfer_mixed_sparse_indices(
        decode_swa_indices, decode_compressed_indices, decode_compressed_topk_lens,
        prefill_topk_indices, query_start_loc, seq_lens, token_to_req_indices,
        swa_block_table, swa_block_size, compressed_block_table, compressed_block_size,
        window_size, compress_ratio, topk, decode_compressed_indices_are_local,
        decode_is_valid_token, swa_block_span, compressed_block_span, replay_start,
        idx, lens,
    )
    assert r is None
    return idx, lens


# ------------------------------------------------------------------------ golden vectors


def _assert_same(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    assert got.dtype == want.dtype and got.shape == want.shape, (what, got.shape, want.shape)
    if not torch.equal(got, want):
        bad = (got != want).nonzero()
        raise AssertionError(
            f"{what}: {bad.shape[0]} elements differ, first at {bad[0].tolist()}: "
            f"got {got[tuple(bad[0])].item()} want {want[tuple(bad[0])].item()}"
        )


@pytest.mark.parametrize("name", _golden_names())
def test_golden(name):
    case = _golden_cases()[name]
    args, want = dict(case["args"]), case["out"]
    op = case["op"]
    if op == "compute_global_topk_indices_and_lens":
        got = run_global_topk(**args)
        keys = ("global_topk_indices", "topk_lens")
    elif op == "combine_topk_swa_indices":
        got = run_combine(**args)
        keys = ("combined_indices", "combined_lens")
        if args["out"] is not None:  # the given buffers are the ones written
            assert got[0] is args["out"][0] and got[1] is args["out"][1]
    else:
        got = run_flashinfer(**args)
        keys = ("sparse_indices", "sparse_topk_lens")
    assert set(want) == set(keys), set(want)
    for g, k in zip(got, keys):
        _assert_same(g, want[k], f"{name}:{k}")
        assert not (g == CANARY).any() or (want[k] == CANARY).any()


# -------------------------------------------------------------- loop oracles (spec text)


def _oracle_global_topk(topk_indices, t2r, table, B, valid):
    n, k = topk_indices.shape
    out = [[-1] * k for _ in range(n)]
    lens = [0] * n
    for i in range(n):
        c = 0
        for j in range(k):
            x = int(topk_indices[i, j])
            if x >= 0:
                out[i][j] = int(table[int(t2r[i]), x // B]) * B + x % B
                c += 1
        lens[i] = c if bool(valid[i]) else 0
    return torch.tensor(out, dtype=I32).reshape(n, k), torch.tensor(lens, dtype=I32)


def _oracle_combine(topk_indices, qsl, seq_lens, gather_lens, window, cr, topk, M, N, w_out):
    T, K = topk_indices.shape
    R = seq_lens.shape[0]
    base = int(qsl[0])
    q = [int(v) - base for v in qsl]
    out = [[-1] * w_out for _ in range(T)]
    lens = [0] * T
    for t in range(T):
        b = max(i for i in range(R) if q[i] <= t)
        if not t < q[R]:
            continue
        qs, qe, L, g = q[b], q[b + 1], int(seq_lens[b]), int(gather_lens[b])
        pos = L - (qe - qs) + (t - qs)
        gstart = L - g
        k_len = min(max((pos + 1) // cr, 0), topk) if cr > 0 else 0
        swa_start = max(pos - window + 1, 0, gstart)
        swa_len = max(pos - swa_start + 1, 0)
        for j in range(w_out):
            if j < k_len:
                v = int(topk_indices[t, j]) if j < K else -1
                out[t][j] = v + M * b if 0 <= v < N else -1
            elif j < k_len + swa_len:
                out[t][j] = M * b + N + (swa_start + (j - k_len) - gstart)
        lens[t] = k_len + swa_len
    return torch.tensor(out, dtype=I32).reshape(T, w_out), torch.tensor(lens, dtype=I32)


def _oracle_flashinfer(dswa, dcomp, dlens, ptopk, qsl, seq_lens, t2r, stab, sbs, ctab, cbs,
                       window, cr, topk, local, dvalid, sspan, cspan, replay_start):
    D, w_swa = dswa.shape
    P, k_pre = ptopk.shape
    k_dec = 0 if dcomp is None else dcomp.shape[1]
    padded = _roundup(max(topk, k_dec), 4)
    rs = lambda v: -1 if v < 0 else (v // sbs) * sspan + v % sbs  # noqa: E731
    rc = lambda v: -1 if v < 0 else (v // cbs) * cspan + v % cbs  # noqa: E731
    out, lens = [], []
    for n in range(D):
        row = [rs(int(dswa[n, j])) for j in range(w_swa)]
        c = 0
        for j in range(padded):
            v = int(dcomp[n, j]) if j < k_dec else -1
            if local:
                if v >= 0:
                    c += int(bool(dvalid[n]))
                    v = int(ctab[int(t2r[n]), v // cbs]) * cbs + v % cbs
            row.append(rc(v))
        if k_dec == 0:
            c_len = 0
        elif local:
            c_len = c
        else:
            c_len = int(dlens[n]) if dlens is not None else k_dec
        out.append(row)
        lens.append(w_swa + c_len)
    for n in range(D, D + P):
        p, req = n - D, int(t2r[n])
        ql = int(qsl[req + 1]) - int(qsl[req])
        pos = int(seq_lens[req]) - ql + (n - int(qsl[req]))
        swa_start = max(pos - window + 1, 0, int(replay_start[req]))
        swa_len = pos - swa_start + 1
        k_len = min((pos + 1) // cr, topk) if cr > 0 else 0
        row = []
        for j in range(w_swa):
            if j < swa_len:
                qq = swa_start + j
                row.append(rs(int(stab[req, qq // sbs]) * sbs + qq % sbs))
            else:
                row.append(-1)
        for j in range(padded):
            x = int(ptopk[p, j]) if (j < k_pre and j < k_len) else -1
            row.append(rc(int(ctab[req, x // cbs]) * cbs + x % cbs) if x >= 0 else -1)
        out.append(row)
        lens.append(w_swa + k_len)
    return (torch.tensor(out, dtype=I32).reshape(D + P, w_swa + padded),
            torch.tensor(lens, dtype=I32))


# ----------------------------------------------------------------------------- hand-made


def test_empty_batch():
    # §5: N = 0
    out, lens = run_global_topk(
        torch.empty(0, 16, dtype=I32), torch.zeros(3, dtype=I32),
        torch.zeros(2, 4, dtype=I32), 64, torch.ones(3, dtype=torch.bool),
    )
    assert out.shape == (0, 16) and lens.shape == (0,)
    # §6: T = 0, with a preallocated buffer larger than T: nothing written
    buf = (torch.full((2, 128), CANARY, dtype=I32), torch.full((2,), CANARY, dtype=I32))
    run_combine(torch.empty(0, 8, dtype=I32), torch.tensor([5, 5], dtype=I32),
                torch.tensor([3], dtype=I32), torch.tensor([3], dtype=I32),
                64, 4, 8, 256, 128, out=buf)
    assert (buf[0] == CANARY).all() and (buf[1] == CANARY).all()
    # §7: D + P = 0
    idx, lens = run_flashinfer(
        torch.empty(0, 8, dtype=I32), None, None, torch.empty(0, 4, dtype=I32),
        torch.zeros(1, dtype=I32), torch.empty(0, dtype=I32), torch.empty(0, dtype=I32),
        torch.zeros(0, 4, dtype=I32), 64, None, 64, 8, 4, 4, replay_start=torch.empty(0, dtype=I32),
    )
    assert idx.shape == (0, 12) and lens.shape == (0,)


def test_flashinfer_worked_example():
    # §7: D = 0, one prefill token, seq_len 4, window 4, W_swa 8, table [[0]], B 64, topk 0
    idx, lens = run_flashinfer(
        torch.empty(0, 8, dtype=I32), None, None, torch.empty(1, 0, dtype=I32),
        torch.tensor([0, 1], dtype=I32), torch.tensor([4], dtype=I32),
        torch.tensor([0], dtype=I32), torch.tensor([[0]], dtype=I32), 64, None, 64,
        4, 4, 0, replay_start=torch.tensor([0], dtype=I32),
    )
    assert idx.tolist() == [[0, 1, 2, 3, -1, -1, -1, -1]]
    assert lens.tolist() == [8]


def test_combine_cr0_rows_past_last_request():
    # §6, CR 0 (topk 0): tokens past qsl[R] get −1 / 0; rebasing of a global qsl
    qsl = torch.tensor([100, 102, 102, 105], dtype=I32)
    seq_lens = torch.tensor([10, 0, 3], dtype=I32)
    gather_lens = torch.tensor([2, 0, 3], dtype=I32)
    idx, lens = run_combine(torch.zeros(7, 0, dtype=I32), qsl, seq_lens, gather_lens,
                            4, 0, 0, 1000, 50)
    assert lens.tolist() == [1, 2, 1, 2, 3, 0, 0]
    assert idx[0, :2].tolist() == [50, -1]  # pos 8: window [5, 8] clamped to gstart 8
    assert idx[1, :3].tolist() == [50, 51, -1]  # pos 9: positions 8, 9
    assert idx[2, :2].tolist() == [2050, -1]  # request 2, pos 0
    assert idx[4, :4].tolist() == [2050, 2051, 2052, -1]
    assert (idx[5:] == -1).all()
    assert (idx[:, 4:] == -1).all()


def _random_table(g, rows, cols, nblocks):
    return torch.randint(0, nblocks, (rows, cols), generator=g, dtype=I32)


def test_noncontiguous_block_tables():
    g = torch.Generator().manual_seed(7)
    B = 16
    wide = _random_table(g, 4, 13, 500)
    views = {
        "slice": wide[:, :6],  # stride(0) = 13
        "transposed": _random_table(g, 6, 4, 500).t(),  # stride(1) = 4
        "strided": wide[:, ::2],  # stride(1) = 2, width 7
    }
    for name, table in views.items():
        assert not table.is_contiguous(), name
        w = table.shape[1]
        topk = torch.randint(-1, w * B, (9, 20), generator=g, dtype=I32)
        t2r = torch.randint(0, 4, (11,), generator=g, dtype=I32)
        valid = torch.rand(11, generator=g) > 0.3
        got = run_global_topk(topk, t2r, table, B, valid)
        want = run_global_topk(topk, t2r, table.contiguous(), B, valid)
        oracle = _oracle_global_topk(topk, t2r, table, B, valid)
        for a, b_, c in zip(got, want, oracle):
            _assert_same(a, b_, name)
            _assert_same(a, c, name)

        # §7 through the same view for both tables
        qsl = torch.tensor([0, 1, 2, 5, 9], dtype=I32)
        seq_lens = torch.tensor([30, 50, 40, w * B], dtype=I32)
        t2r7 = torch.tensor([0, 1, 2, 2, 2, 3, 3, 3, 3], dtype=I32)
        args = dict(
            decode_swa_indices=torch.randint(-1, 2000, (2, 16), generator=g, dtype=I32),
            decode_compressed_indices=torch.randint(-1, 60, (2, 10), generator=g, dtype=I32),
            decode_compressed_topk_lens=None,
            prefill_topk_indices=torch.randint(-1, 12, (7, 12), generator=g, dtype=I32),
            query_start_loc=qsl, seq_lens=seq_lens, token_to_req_indices=t2r7,
            swa_block_table=table, swa_block_size=B, compressed_block_table=table,
            compressed_block_size=4, window_size=16, compress_ratio=4, topk=12,
            decode_compressed_indices_are_local=True,
            decode_is_valid_token=torch.tensor([True, False]),
            swa_block_span=20, compressed_block_span=None,
            replay_start=torch.zeros(4, dtype=I32),
        )
        got = run_flashinfer(**args)
        contiguous = dict(args, swa_block_table=table.contiguous(),
                          compressed_block_table=table.contiguous())
        want = run_flashinfer(**contiguous)
        for a, b_ in zip(got, want):
            _assert_same(a, b_, name)


def test_global_topk_random_vs_oracle():
    g = torch.Generator().manual_seed(1)
    for _ in range(5):
        n, k, R, w, B = 13, int(torch.randint(1, 40, (1,), generator=g)), 3, 5, 8
        table = _random_table(g, R, w, 100)
        table[0, 1] = -1  # a −1 block id is translated as-is (no remap in §5)
        topk = torch.randint(-3, w * B, (n, k), generator=g, dtype=I32)
        topk[2] = -1
        t2r = torch.randint(0, R, (n + 2,), generator=g, dtype=I32)
        valid = torch.rand(n + 2, generator=g) > 0.3
        for a, b_ in zip(run_global_topk(topk, t2r, table, B, valid),
                         _oracle_global_topk(topk, t2r, table, B, valid)):
            _assert_same(a, b_, "random global topk")


def _random_batch(rng: random.Random, n_req: int, max_q: int, max_seq: int):
    q_lens = [rng.choice([0, rng.randint(1, max_q)]) for _ in range(n_req)]
    seq = [ql + rng.randint(0, max_seq) for ql in q_lens]
    return q_lens, seq


@pytest.mark.parametrize("seed", range(6))
def test_combine_random_vs_oracle(seed):
    rng = random.Random(seed)
    R = rng.randint(1, 5)
    q_lens, seq = _random_batch(rng, R, 9, 200)
    base = rng.randint(0, 30)
    qsl = [base]
    for ql in q_lens:
        qsl.append(qsl[-1] + ql)
    T = qsl[-1] - base + rng.randint(0, 3)  # some tokens past the last request
    gather = [rng.randint(0, s) for s in seq]
    cr = rng.choice([0, 1, 4, 128])
    topk = 0 if cr == 0 else rng.choice([5, 20])
    window = rng.choice([8, 16])
    M, N = 512, 64
    K = topk + rng.choice([-2, 0, 3]) if topk else rng.randint(0, 4)
    K = max(K, 0)  # K < topk: columns past the top-k width read as −1
    topk_indices = torch.tensor(
        [[rng.randint(-3, N + 10) for _ in range(K)] for _ in range(T)], dtype=I32
    ).reshape(T, K)
    args = (topk_indices, torch.tensor(qsl, dtype=I32), torch.tensor(seq, dtype=I32),
            torch.tensor(gather, dtype=I32), window, cr, topk, M, N)
    got = run_combine(*args)
    want = _oracle_combine(*args, _roundup(topk + window, 128))
    for a, b_ in zip(got, want):
        _assert_same(a, b_, f"combine seed {seed}")


@pytest.mark.parametrize("seed", range(8))
def test_flashinfer_random_vs_oracle(seed):
    rng = random.Random(100 + seed)
    g = torch.Generator().manual_seed(seed)
    n_dec = rng.randint(0, 3)
    n_pre_req = rng.randint(0, 3)
    pre_q, pre_seq = _random_batch(rng, n_pre_req, 7, 150)
    q_lens = [1] * n_dec + pre_q
    seq = [rng.randint(1, 150) for _ in range(n_dec)] + pre_seq
    R = len(q_lens)
    qsl = [0]
    for ql in q_lens:
        qsl.append(qsl[-1] + ql)
    t2r = [r for r in range(R) for _ in range(q_lens[r])]
    D, P = n_dec, len(t2r) - n_dec
    sbs, cbs = rng.choice([(16, 16), (16, 8), (64, 4)])
    window = rng.choice([8, 16])
    w_swa = window + rng.choice([0, 4])
    cr = rng.choice([0, 4, 128])
    topk = 0 if cr == 0 else rng.choice([6, 10])
    local = rng.random() < 0.5
    k_dec = rng.choice([0, 5, 13]) if rng.random() < 0.8 else None
    stab = _random_table(g, max(R, 1), 160 // sbs + 1, 300)
    ctab = _random_table(g, max(R, 1), 160 // cbs + 1, 300)
    stab[0, 0] = -1  # an unmapped page → −1 after the remap
    if rng.random() < 0.2:
        ctab = None  # the SWA table stands in for the compressed one
    ctab_eff = stab if ctab is None else ctab
    comp_max = ctab_eff.shape[1] * cbs  # local indices stay inside the table
    dcomp = (None if k_dec is None else
             torch.randint(-1, comp_max if local else 3000, (D, k_dec), generator=g,
                           dtype=I32))
    dlens = (torch.randint(0, 20, (D + 1,), generator=g, dtype=I32)
             if (k_dec is not None and not local and rng.random() < 0.5) else None)
    dvalid = torch.rand(D + 2, generator=g) > 0.3 if local else None
    k_pre = rng.choice([topk, topk + 3, max(topk - 2, 0)])
    ptopk = torch.randint(-1, comp_max, (P, k_pre), generator=g, dtype=I32)
    replay = torch.tensor([rng.randint(0, s) for s in seq], dtype=I32)
    sspan = rng.choice([None, sbs + 5])
    cspan = rng.choice([None, cbs * 2])
    args = dict(
        decode_swa_indices=torch.randint(-1, 3000, (D, w_swa), generator=g, dtype=I32),
        decode_compressed_indices=dcomp, decode_compressed_topk_lens=dlens,
        prefill_topk_indices=ptopk, query_start_loc=torch.tensor(qsl, dtype=I32),
        seq_lens=torch.tensor(seq, dtype=I32), token_to_req_indices=torch.tensor(t2r, dtype=I32),
        swa_block_table=stab, swa_block_size=sbs,
        compressed_block_table=ctab,
        compressed_block_size=cbs, window_size=window, compress_ratio=cr, topk=topk,
        decode_compressed_indices_are_local=local, decode_is_valid_token=dvalid,
        swa_block_span=sspan, compressed_block_span=cspan, replay_start=replay,
    )
    got = run_flashinfer(**args)
    o = dict(args)
    want = _oracle_flashinfer(
        o["decode_swa_indices"], dcomp, dlens, ptopk, o["query_start_loc"], o["seq_lens"],
        o["token_to_req_indices"], stab, sbs, ctab_eff, cbs, window, cr, topk, local,
        dvalid, sspan or sbs, cspan or cbs, replay,
    )
    for a, b_ in zip(got, want):
        _assert_same(a, b_, f"flashinfer seed {seed}")
