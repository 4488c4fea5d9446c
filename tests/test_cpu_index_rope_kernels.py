"""CPU kernels (dsv41.backends.cpu.ops) of the index builders and the RoPE / quant ops
against the pure-PyTorch reference, byte for byte.

* Golden vectors (vLLM's Triton kernels on an H200, ``vllm-sm90.tar.xz``): every case of
  compute_global_topk_indices_and_lens, combine_topk_swa_indices,
  build_flashinfer_mixed_sparse_indices, fused_save_compress_norm,
  fused_indexer_q_rope_quant and fused_inv_rope_fp8_quant, whole output storages compared.
* fused_save_compress_norm's prev_rows / prev_row_indices (CR 2: a chunk's first token pools
  with prev_rows[idx] where idx >= 0; the ring is then never written) and save_ring_rows,
  against the reference where it has them, else against expectations built from it.
* Random inputs with edge cases (−1 entries, empty batches, non-contiguous block tables,
  int32 wrap-around, ±0, NaN / ±inf, fp8-max and rounding-tie values, FNUZ, MXFP4, every
  inverse-RoPE scale layout), run through the reference and the CPU kernel from identical
  output canaries; the complete backing storage of every output must match.
"""

from __future__ import annotations

import functools
import inspect
import io
import os
import tarfile
from pathlib import Path

import pytest
import torch

import golden  # noqa: E402  (tests/ is on sys.path)

from dsv41.reference import compress as ref_compress
from dsv41.reference import indexer as ref_indexer
from dsv41.reference import output_quant as ref_oq
from dsv41.reference import sparse_indices as ref_si

ops = pytest.importorskip("dsv41.backends.cpu.ops")

_err = ops.build_error()
pytestmark = pytest.mark.skipif(_err is not None, reason=f"CPU kernels unavailable: {_err}")

_REPO = Path(__file__).resolve().parents[1]
VECTORS = golden.ARCHIVE  # tests/vectors (DSV41_VECTORS overrides)
I32 = torch.int32
BF16 = torch.bfloat16
F32 = torch.float32
GOLDEN_OPS = (
    "compute_global_topk_indices_and_lens",
    "combine_topk_swa_indices",
    "build_flashinfer_mixed_sparse_indices",
    "fused_save_compress_norm",
    "fused_indexer_q_rope_quant",
    "fused_inv_rope_fp8_quant",
)


# ----------------------------------------------------------------------------- helpers


@pytest.fixture(autouse=True)
def _native_only(request):
    """Every test here must run the C++ kernels, never the reference fallback of ops.py
    (except the fallback test itself), or the comparison would be vacuous."""
    before = dict(ops.FALLBACKS)
    yield
    if request.node.name != "test_unsupported_layouts_fall_back_to_reference":
        assert ops.FALLBACKS == before, f"reference fallback used: {ops.FALLBACKS} (before {before})"


def test_c_signatures_match_wrappers():
    """The argument kinds ops.py declares for ctypes equal the C parameter lists."""
    import re

    here = Path(ops.__file__).resolve().parent
    src = (here / "index_kernels.cpp").read_text() + (here / "rope_kernels.cpp").read_text()
    for name, (_lib, kinds) in ops._SIGS.items():
        m = re.search(r"void " + name + r"\((.*?)\)\s*\{", src, re.S)
        assert m, name
        params = [p.strip() for p in m.group(1).split(",")]
        got = "".join("p" if "*" in p else ("d" if p.startswith("double") else "i") for p in params)
        assert got == kinds, (name, got, kinds)


def _storage_bytes(t: torch.Tensor) -> torch.Tensor:
    return torch.empty(0, dtype=torch.uint8, device=t.device).set_(t.untyped_storage())


def _clone_view(t):
    """Deep copy that keeps the view: same size, stride and offset over a cloned storage."""
    if not isinstance(t, torch.Tensor):
        return t
    storage = t.untyped_storage()
    new = torch.UntypedStorage(storage.nbytes(), device=t.device)
    new.copy_(storage)
    return torch.empty(0, dtype=t.dtype, device=t.device).set_(new, t.storage_offset(), t.size(), t.stride())


def _assert_bytes(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    g, w = _storage_bytes(got), _storage_bytes(want)
    assert g.numel() == w.numel(), (what, g.numel(), w.numel())
    bad = (g != w).nonzero().flatten()
    assert bad.numel() == 0, (
        f"{what}: {bad.numel()} of {w.numel()} storage bytes differ, first at {bad[:8].tolist()}: "
        f"got {g[bad[:8]].tolist()} want {w[bad[:8]].tolist()}"
    )


def _run_both(ref_fn, cpu_fn, args: list, out_idx: list, what: str):
    """Run reference and CPU kernel on independent deep copies; compare every output storage
    and check that no input was modified."""
    a_ref = [_clone_view(a) for a in args]
    a_cpu = [_clone_view(a) for a in args]
    before = {i: _storage_bytes(a).clone() for i, a in enumerate(args) if isinstance(a, torch.Tensor) and i not in out_idx}
    assert ref_fn(*a_ref) is None
    assert cpu_fn(*a_cpu) is None
    for i in out_idx:
        _assert_bytes(a_cpu[i], a_ref[i], f"{what}: output arg {i}")
    for i, b in before.items():
        assert torch.equal(_storage_bytes(a_cpu[i]), b), f"{what}: input arg {i} modified"
    return a_cpu, a_ref


def _bf16_from_bits(bits) -> torch.Tensor:
    return torch.tensor(bits, dtype=torch.int32).to(torch.int16).view(BF16)


def _special_values(g: torch.Generator, shape, kind: str) -> torch.Tensor:
    """fp32 tensors of a given flavour of values (rows are bf16-representable for bf16 inputs)."""
    n = 1
    for s in shape:
        n *= s
    if kind == "normal":
        x = torch.randn(n, generator=g) * torch.exp2(torch.randint(-6, 7, (n,), generator=g).float())
    elif kind == "zero":
        x = torch.zeros(n)
    elif kind == "negzero":
        x = torch.full((n,), -0.0)
    elif kind == "mixzero":
        x = torch.where(torch.rand(n, generator=g) < 0.5, torch.zeros(n), torch.full((n,), -0.0))
    elif kind == "large":
        x = torch.randn(n, generator=g) * 1e4
    elif kind == "tiny":
        x = torch.randn(n, generator=g) * 1e-6
    elif kind == "verytiny":
        x = torch.randn(n, generator=g) * 1e-30
    elif kind == "huge":
        x = torch.randn(n, generator=g) * 3e30
    elif kind == "maxbf16":
        x = torch.where(torch.rand(n, generator=g) < 0.5, 1.0, -1.0) * 3.3895313892515355e38
    elif kind == "fp8max":
        # values at the e4m3 extremes for unit scales: 448, 240, 224, 464 (tie), 480
        vals = torch.tensor([448.0, -448.0, 240.0, 224.0, 464.0, -480.0, 232.0, 0.001953125, -0.0009765625, 1.0])
        x = vals[torch.randint(0, vals.numel(), (n,), generator=g)] * torch.exp2(
            torch.randint(-3, 4, (n,), generator=g).float()
        )
    elif kind == "ties":
        # e4m3 / e2m1 rounding ties and subnormals at scale 2^0
        vals = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 1.0625, 1.1875, 0.0029296875, 17.0, 19.0, 300.0])
        x = vals[torch.randint(0, vals.numel(), (n,), generator=g)]
        x = torch.where(torch.rand(n, generator=g) < 0.5, x, -x)
    elif kind == "nonfinite":
        x = torch.randn(n, generator=g)
        r = torch.rand(n, generator=g)
        x = torch.where(r < 0.05, float("nan"), x)
        x = torch.where((r >= 0.05) & (r < 0.1), float("inf"), x)
        x = torch.where((r >= 0.1) & (r < 0.15), float("-inf"), x)
    else:
        raise ValueError(kind)
    return x.reshape(shape)


# ---------------------------------------------------------------------- golden vectors


@functools.lru_cache(maxsize=1)
def _golden_cases() -> dict:
    cases = {}
    with tarfile.open(VECTORS, "r:xz") as tf:
        for member in tf.getmembers():
            if not member.isfile() or not member.name.endswith(".pt"):
                continue
            case = torch.load(io.BytesIO(tf.extractfile(member).read()), weights_only=True)
            if case["op"] in GOLDEN_OPS:
                cases[os.path.basename(member.name)] = case
    return cases


def _golden_names():
    if not VECTORS.is_file():
        return [pytest.param(None, marks=pytest.mark.skip(reason=f"golden vectors not found at {VECTORS}"))]
    return sorted(_golden_cases())


def _roundup(x: int, m: int) -> int:
    return (x + m - 1) // m * m


def _golden_run(op: str, a: dict):
    """Kernel-contract call of the CPU op for a golden case (public defaults resolved,
    outputs preallocated with canaries); returns {out key: tensor}."""
    if op == "compute_global_topk_indices_and_lens":
        n, k = a["topk_indices"].shape
        out = torch.full((n, k), -7, dtype=I32)
        lens = torch.full((n,), -7, dtype=I32)
        ops.compute_global_topk_indices_and_lens(
            a["topk_indices"], a["token_to_req_indices"], a["block_table"], a["block_size"], a["is_valid_token"],
            out, lens,
        )
        return {"global_topk_indices": out, "topk_lens": lens}
    if op == "combine_topk_swa_indices":
        if a["out"] is None:
            T = a["topk_indices"].shape[0]
            w = _roundup(a["topk"] + a["window_size"], 128)
            idx, lens = torch.full((T, w), -7, dtype=I32), torch.full((T,), -7, dtype=I32)
        else:
            idx, lens = (_clone_view(t) for t in a["out"])
        ops.combine_topk_swa_indices(
            a["topk_indices"], a["query_start_loc"], a["seq_lens"], a["gather_lens"], a["window_size"],
            a["compress_ratio"], a["topk"], a["M"], a["N"], idx, lens,
        )
        return {"combined_indices": idx, "combined_lens": lens}
    if op == "build_flashinfer_mixed_sparse_indices":
        ctab = a["compressed_block_table"]
        ctab = a["swa_block_table"] if ctab is None else ctab
        sspan = a["swa_block_span"] or a["swa_block_size"]
        cspan = a["compressed_block_span"] or a["compressed_block_size"]
        D, wswa = a["decode_swa_indices"].shape
        P = a["prefill_topk_indices"].shape[0]
        dci = a["decode_compressed_indices"]
        kdec = 0 if dci is None else dci.shape[1]
        padded = _roundup(max(a["topk"], kdec), 4)
        idx = torch.full((D + P, wswa + padded), -7, dtype=I32)
        lens = torch.full((D + P,), -7, dtype=I32)
        dvt = a["decode_is_valid_token"] if (kdec > 0 and a["decode_compressed_indices_are_local"]) else None
        ops.build_flashinfer_mixed_sparse_indices(
            a["decode_swa_indices"], dci, a["decode_compressed_topk_lens"], a["prefill_topk_indices"],
            a["query_start_loc"], a["seq_lens"], a["token_to_req_indices"], a["swa_block_table"],
            a["swa_block_size"], ctab, a["compressed_block_size"], a["window_size"], a["compress_ratio"],
            a["topk"], a["decode_compressed_indices_are_local"], dvt, sspan, cspan, a["replay_start"], idx, lens,
        )
        return {"sparse_indices": idx, "sparse_topk_lens": lens}
    if op == "fused_save_compress_norm":
        lat = _clone_view(a["latent_out"])
        st = _clone_view(a["state_cache"])
        ops.fused_save_compress_norm(
            a["kv_score"], a["positions"], st, a["slot_mapping"], a["query_start_loc"], a["token_to_req_indices"],
            a["rms_norm_weight"], a["rms_norm_eps"], a["compress_ratio"], lat,
        )
        res = {"latent_out": lat}
        if st is not None:
            res["state_cache"] = st
        return res
    if op == "fused_indexer_q_rope_quant":
        q = a["index_q"]
        q_out = torch.full(q.shape, 0xA5, dtype=torch.uint8).view(torch.float8_e4m3fn)
        w_out = torch.full(a["index_weights"].shape, float("nan"), dtype=F32)
        ops.fused_indexer_q_rope_quant(
            a["positions"], q, a["index_q_cos_sin_cache"], a["index_weights"], a["index_weights_softmax_scale"],
            a["index_weights_head_scale"], a["use_fp4"], False, q_out, torch.empty(0, dtype=torch.uint8), w_out,
        )
        return {"q_fp8": q_out, "weights_out": w_out}
    if op == "fused_inv_rope_fp8_quant":
        o = a["o"]
        T, NH, Dh = o.shape
        G, HG, QG = a["n_groups"], a["heads_per_group"], a["quant_group_size"]
        quant = a["quantize"]
        dt = torch.float8_e4m3fn if quant else o.dtype
        out_buf = torch.full((G, T, HG * Dh), 0x5A, dtype=torch.uint8).view(dt) if quant else torch.full(
            (G, T, HG * Dh), float("nan"), dtype=dt
        )
        S = HG * Dh // QG
        if quant:
            K = (S + 3) // 4 if a["tma_aligned_scales"] else S
            Ta = _roundup(T, 4)
            sdt = torch.int32 if a["tma_aligned_scales"] else F32
            scale_buf = torch.full((G, K * Ta), 0x5A5A5A5A, dtype=torch.int32).view(sdt)
        else:
            K, Ta = 0, T
            scale_buf = torch.empty((G, 0), dtype=F32)
        ops.fused_inv_rope_fp8_quant(
            o, a["positions"], a["cos_sin_cache"], G, HG, a["nope_dim"], a["rope_dim"], QG,
            a["tma_aligned_scales"], quant, a["permuted_output"], out_buf, scale_buf,
        )
        res = {"output": out_buf.transpose(0, 1)}
        res["scales"] = scale_buf.view(G, K, Ta).permute(2, 0, 1)[:T] if quant else scale_buf.reshape(0)
        return res
    raise AssertionError(op)


@pytest.mark.parametrize("name", _golden_names())
def test_golden(name):
    case = _golden_cases()[name]
    args = {k: _clone_view(v) if isinstance(v, torch.Tensor) else v for k, v in case["args"].items()}
    if isinstance(case["args"].get("out"), tuple):
        args["out"] = case["args"]["out"]
    inputs_before = {k: _storage_bytes(v).clone() for k, v in args.items() if isinstance(v, torch.Tensor)}
    got = _golden_run(case["op"], args)
    assert set(got) == set(case["out"]), (set(got), set(case["out"]))
    for key, want in case["out"].items():
        g = got[key]
        assert g.shape == want.shape and g.dtype == want.dtype, (key, g.shape, want.shape, g.dtype, want.dtype)
        if key in ("output", "scales") and want.numel() > 0:
            # views over the backing buffers: compare the whole backing storage (padding rows too)
            _assert_bytes(g, want, f"{name}:{key}")
        elif key in ("latent_out", "state_cache"):
            _assert_bytes(g, want, f"{name}:{key}")
        else:
            gb, wb = g.contiguous().view(torch.uint8), want.contiguous().view(torch.uint8)
            bad = (gb != wb).nonzero()
            assert bad.shape[0] == 0, f"{name}:{key}: {bad.shape[0]} bytes differ, first at {bad[:4].tolist()}"
    for k, before in inputs_before.items():
        if k in ("latent_out", "state_cache", "out"):
            continue
        assert torch.equal(_storage_bytes(args[k]), before), f"{name}: input {k} modified"


def test_golden_cases_present():
    if not VECTORS.is_file():
        pytest.skip("no golden vectors")
    ops_seen = {c["op"] for c in _golden_cases().values()}
    assert ops_seen == set(GOLDEN_OPS)


# ------------------------------------------------------------------- §5 global top-k


def _tables(g, rows, cols, nblocks):
    base = torch.randint(-1, nblocks, (rows, cols + 5), generator=g, dtype=I32)
    return {
        "contiguous": base[:, :cols].contiguous(),
        "row_slice": base[:, :cols],  # stride(0) > width
        "transposed": torch.randint(-1, nblocks, (cols, rows), generator=g, dtype=I32).t(),
        "col_strided": torch.randint(-1, nblocks, (rows, 2 * cols), generator=g, dtype=I32)[:, ::2],
    }


@pytest.mark.parametrize("layout", ["contiguous", "row_slice", "transposed", "col_strided"])
@pytest.mark.parametrize("B", [64, 16, 1, 48, 7])
def test_global_topk_random(layout, B):
    g = torch.Generator().manual_seed(B * 31 + len(layout))
    rows, cols = 5, 9
    table = _tables(g, rows, cols, 10_000)[layout]
    for n, K in [(0, 8), (1, 1), (37, 33), (200, 260)]:
        topk = torch.randint(-3, cols * B + 2 * B, (n, K), generator=g, dtype=I32)
        topk[:, ::5] = -1
        if n > 3:
            topk[3] = -1  # an all −1 row
        t2r = torch.randint(-1, rows + 1, (n + 3,), generator=g, dtype=I32)  # incl. out of range
        valid = torch.rand(n + 3, generator=g) < 0.7
        out = torch.full((n, K), -7, dtype=I32)
        lens = torch.full((n,), -7, dtype=I32)
        _run_both(
            ref_si.compute_global_topk_indices_and_lens, ops.compute_global_topk_indices_and_lens,
            [topk, t2r, table, B, valid, out, lens], [5, 6], f"global n={n} K={K}",
        )


def test_global_topk_wrap_and_views():
    # block ids near 2^31: id * B wraps in int32 exactly like the reference
    g = torch.Generator().manual_seed(3)
    table = torch.tensor([[2**31 - 1, 2**30, -(2**31), 123]], dtype=I32)
    topk = torch.randint(-1, 4 * 64, (50, 40), generator=g, dtype=I32)
    t2r = torch.zeros(50, dtype=I32)
    valid = torch.ones(50, dtype=torch.bool)
    # strided 1-D token_to_req / is_valid_token views
    t2r2 = torch.zeros(100, dtype=I32)[::2]
    valid2 = torch.ones(100, dtype=torch.bool)[1::2]
    for tr, vl in ((t2r, valid), (t2r2, valid2)):
        out = torch.full((50, 40), -7, dtype=I32)
        lens = torch.full((50,), -7, dtype=I32)
        _run_both(ref_si.compute_global_topk_indices_and_lens, ops.compute_global_topk_indices_and_lens,
                  [topk, tr, table, 64, vl, out, lens], [5, 6], "global wrap")
    # empty table
    out = torch.full((4, 6), -7, dtype=I32)
    lens = torch.full((4,), -7, dtype=I32)
    _run_both(ref_si.compute_global_topk_indices_and_lens, ops.compute_global_topk_indices_and_lens,
              [topk[:4, :6], t2r, torch.zeros(0, 3, dtype=I32), 64, valid, out, lens], [5, 6], "empty table")


# ----------------------------------------------------------------------- §6 combine


def _combine_case(g, T, R, window, cr, topk, M, N, K=None, qsl0=11, zero_len=True, extra=3):
    K = topk if K is None else K
    lens_ = torch.randint(0, 7, (R,), generator=g)
    if zero_len and R > 1:
        lens_[R // 2] = 0
    owned = int(lens_.sum())
    T = owned + extra if T is None else T
    qsl = torch.cat([torch.zeros(1, dtype=torch.long), lens_.cumsum(0)]).to(I32) + qsl0
    seq = (lens_ + torch.randint(0, 300, (R,), generator=g)).to(I32)
    gath = torch.minimum(seq, torch.randint(0, 200, (R,), generator=g).to(I32))
    topk_idx = torch.randint(-2, N + 20, (T, K), generator=g, dtype=I32)
    return topk_idx, qsl, seq, gath


@pytest.mark.parametrize(
    "R,window,cr,topk,M,N,K",
    [
        (4, 128, 4, 50, 1024, 512, 55),
        (3, 128, 0, 0, 1024, 512, 6),
        (1, 64, 2, 100, 4096, 2048, 100),
        (5, 0, 1, 7, 300, 100, 3),   # K < topk: columns past K are −1
        (6, 16, 3, 40, 2**29, 64, 40),  # M·b wraps in int32
        (0, 128, 4, 50, 1024, 512, 50),  # no requests
    ],
)
def test_combine_random(R, window, cr, topk, M, N, K):
    g = torch.Generator().manual_seed(R * 7 + cr)
    for _ in range(3):
        if R == 0:
            topk_idx = torch.randint(-1, 10, (5, K), generator=g, dtype=I32)
            qsl, seq, gath = torch.tensor([3], dtype=I32), torch.empty(0, dtype=I32), torch.empty(0, dtype=I32)
        else:
            topk_idx, qsl, seq, gath = _combine_case(g, None, R, window, cr, topk, M, N, K)
        T = topk_idx.shape[0]
        w = _roundup(topk + window, 128)
        idx = torch.full((T, w), -7, dtype=I32)
        lens = torch.full((T,), -7, dtype=I32)
        _run_both(ref_si.combine_topk_swa_indices, ops.combine_topk_swa_indices,
                  [topk_idx, qsl, seq, gath, window, cr, topk, M, N, idx, lens], [9, 10], "combine")


def test_combine_empty_and_views():
    g = torch.Generator().manual_seed(5)
    buf = (torch.full((2, 128), -7, dtype=I32), torch.full((2,), -7, dtype=I32))
    # T = 0: nothing written
    ops.combine_topk_swa_indices(torch.empty(0, 8, dtype=I32), torch.tensor([5, 5], dtype=I32),
                                 torch.tensor([3], dtype=I32), torch.tensor([3], dtype=I32), 64, 4, 8, 256, 128,
                                 buf[0][:0], buf[1][:0])
    assert (buf[0] == -7).all() and (buf[1] == -7).all()
    # strided 1-D inputs and a row-strided topk view, preallocated output rows of a bigger buffer
    topk_idx, qsl, seq, gath = _combine_case(g, None, 4, 32, 4, 20, 512, 256, 20)
    T = topk_idx.shape[0]
    wide = torch.randint(-1, 300, (T, 31), generator=g, dtype=I32)
    wide[:, :20] = topk_idx
    qsl_v = torch.stack([qsl, qsl], 1).reshape(-1)[::2]
    big = torch.full((T + 2, 128), -9, dtype=I32)
    big_l = torch.full((2 * T,), -9, dtype=I32)
    _run_both(ref_si.combine_topk_swa_indices, ops.combine_topk_swa_indices,
              [wide[:, :20], qsl_v, seq, gath, 32, 4, 20, 512, 256, big[:T], big_l[::2]], [9, 10], "combine views")


# -------------------------------------------------------------------- §7 flashinfer


def _flashinfer_args(g, D, P, R, *, kdec, topk, local, lens_given, valid_given, wswa=128, window=128,
                     sbs=64, cbs=64, sspan=None, cspan=None, cr=4, table_layout="contiguous", same_table=False,
                     bad_req=False):
    per = torch.randint(1, 6, (R,), generator=g)
    per[: min(D, R)] = 1  # decode requests (one token each) first
    P_tot = int(per[min(D, R):].sum()) if R > D else 0
    D = min(D, R)
    P = P_tot if P is None else P
    qsl = torch.cat([torch.zeros(1, dtype=torch.long), per.cumsum(0)]).to(I32)
    seq = (per + torch.randint(0, 600, (R,), generator=g)).to(I32)
    t2r = torch.repeat_interleave(torch.arange(R, dtype=I32), per)[: D + P]
    if t2r.numel() < D + P:
        t2r = torch.cat([t2r, torch.zeros(D + P - t2r.numel(), dtype=I32)])
    if bad_req and t2r.numel() > 2:
        t2r[-1] = R + 2
        t2r[-2] = -1
    t2r = torch.cat([t2r, torch.randint(0, R, (2,), generator=g, dtype=I32)])
    replay = torch.where(torch.rand(R, generator=g) < 0.3, seq + 5, torch.randint(0, 200, (R,), generator=g).to(I32))
    replay = replay.to(I32)
    scols, ccols = 700 // sbs + 2, 700 // (cr or 1) // cbs + 2
    stab = _tables(g, R, scols, 5000)[table_layout]
    ctab = stab if same_table else _tables(g, R, ccols, 5000)[table_layout]
    dswa = torch.randint(-1, 300_000, (D, wswa), generator=g, dtype=I32)
    dswa[:, -7:] = -1
    dci = None
    if kdec is not None:
        hi = 600 if local else 300_000
        dci = torch.randint(-1, hi, (D, kdec), generator=g, dtype=I32)
    dlens = torch.randint(0, (kdec or 0) + 1, (D + 1,), generator=g, dtype=I32) if lens_given else None
    dvt = (torch.rand(D + 1, generator=g) < 0.7) if valid_given else None
    pti = torch.randint(-1, 200, (P, topk + 3), generator=g, dtype=I32)
    padded = _roundup(max(topk, kdec or 0), 4)
    idx = torch.full((D + P, wswa + padded), -7, dtype=I32)
    lens = torch.full((D + P,), -7, dtype=I32)
    return [dswa, dci, dlens, pti, qsl, seq, t2r, stab, sbs, ctab, cbs, window, cr, topk, local, dvt,
            sspan or sbs, cspan or cbs, replay, idx, lens]


@pytest.mark.parametrize(
    "kw",
    [
        dict(D=3, P=None, R=8, kdec=50, topk=50, local=False, lens_given=True, valid_given=False),
        dict(D=3, P=None, R=8, kdec=53, topk=50, local=False, lens_given=False, valid_given=False),
        dict(D=3, P=None, R=8, kdec=44, topk=50, local=True, lens_given=False, valid_given=True, sspan=80, cspan=70),
        dict(D=3, P=None, R=8, kdec=None, topk=50, local=False, lens_given=False, valid_given=False, same_table=True),
        dict(D=0, P=None, R=5, kdec=None, topk=20, local=False, lens_given=False, valid_given=False),
        dict(D=6, P=0, R=6, kdec=12, topk=0, local=True, lens_given=False, valid_given=True),
        dict(D=2, P=None, R=6, kdec=10, topk=16, local=True, lens_given=False, valid_given=False, cr=0),
        dict(D=2, P=None, R=9, kdec=10, topk=30, local=True, lens_given=False, valid_given=True, sbs=48, cbs=40,
             sspan=50, cspan=41, table_layout="transposed"),
        dict(D=2, P=None, R=9, kdec=10, topk=30, local=True, lens_given=False, valid_given=True, sbs=16, cbs=32,
             table_layout="col_strided", bad_req=True),
        dict(D=2, P=None, R=9, kdec=0, topk=30, local=True, lens_given=False, valid_given=True, wswa=132, window=100,
             table_layout="row_slice", cr=3),
    ],
)
def test_flashinfer_random(kw):
    g = torch.Generator().manual_seed(len(str(kw)))
    for _ in range(3):
        args = _flashinfer_args(g, **kw)
        if args[1] is None or args[1].shape[1] == 0 or not args[14]:
            args[15] = None  # the public layer passes no validity mask then
        _run_both(ref_si.build_flashinfer_mixed_sparse_indices, ops.build_flashinfer_mixed_sparse_indices,
                  args, [19, 20], f"flashinfer {kw}")


def test_flashinfer_short_query_start_loc():
    """query_start_loc shorter than seq_lens + 1 (not validated by the public layer): the
    per-request reads clamp into each array's own length, as the reference's do."""
    g = torch.Generator().manual_seed(21)
    args = _flashinfer_args(g, D=2, P=None, R=7, kdec=10, topk=20, local=True, lens_given=False,
                            valid_given=True, bad_req=True)
    for n_qsl in (8, 6, 3, 1):
        a = list(args)
        a[4] = args[4][:n_qsl].clone()
        _run_both(ref_si.build_flashinfer_mixed_sparse_indices, ops.build_flashinfer_mixed_sparse_indices,
                  a, [19, 20], f"flashinfer qsl[:{n_qsl}]")


def test_flashinfer_empty():
    idx = torch.full((0, 12), -7, dtype=I32)
    lens = torch.full((0,), -7, dtype=I32)
    args = [torch.empty(0, 8, dtype=I32), None, None, torch.empty(0, 4, dtype=I32), torch.zeros(1, dtype=I32),
            torch.empty(0, dtype=I32), torch.empty(0, dtype=I32), torch.zeros(0, 4, dtype=I32), 64,
            torch.zeros(0, 4, dtype=I32), 64, 8, 4, 4, False, None, 64, 64, torch.empty(0, dtype=I32), idx, lens]
    _run_both(ref_si.build_flashinfer_mixed_sparse_indices, ops.build_flashinfer_mixed_sparse_indices,
              args, [19, 20], "flashinfer empty")
    # §7 worked example
    idx = torch.full((1, 8), -7, dtype=I32)
    lens = torch.full((1,), -7, dtype=I32)
    ops.build_flashinfer_mixed_sparse_indices(
        torch.empty(0, 8, dtype=I32), None, None, torch.empty(1, 0, dtype=I32), torch.tensor([0, 1], dtype=I32),
        torch.tensor([4], dtype=I32), torch.tensor([0], dtype=I32), torch.tensor([[0]], dtype=I32), 64,
        torch.tensor([[0]], dtype=I32), 64, 4, 4, 0, False, None, 64, 64, torch.tensor([0], dtype=I32), idx, lens)
    assert idx.tolist() == [[0, 1, 2, 3, -1, -1, -1, -1]] and lens.tolist() == [8]


# --------------------------------------------------------- C §8.1 save_compress_norm


def _kv_rows(g, rows, width, kinds):
    out = []
    for r in range(rows):
        kind = kinds[r % len(kinds)]
        out.append(_special_values(g, (width,), kind))
    return torch.stack(out)


@pytest.mark.parametrize("kinds", [["normal"], ["normal", "zero", "large", "tiny", "negzero", "mixzero"],
                                   ["normal", "nonfinite", "verytiny", "huge"]])
def test_save_compress_norm_cr1(kinds):
    g = torch.Generator().manual_seed(len(kinds))
    for T, rows in [(0, 3), (1, 1), (37, 40), (300, 300)]:
        wide = _kv_rows(g, rows, 528, kinds)
        kv = wide[:, :512]  # row stride 528
        pos = torch.randint(0, 1000, (rows + 2,), generator=g)
        slot = torch.randint(-1, 50, (T,), generator=g)
        w = (torch.randn(512, generator=g) * 0.5 + 1).to(BF16)
        lat = torch.full((rows, 512), float("nan"), dtype=BF16)
        _run_both(ref_compress.fused_save_compress_norm, ops.fused_save_compress_norm,
                  [kv, pos, None, slot, None, None, w, 1e-6, 1, lat], [9], f"cr1 T={T}")


def _cr2_case(g, kinds, R, cap, nblocks):
    per = torch.randint(0, 7, (R,), generator=g)
    T = int(per.sum())
    qsl = torch.cat([torch.zeros(1, dtype=torch.long), per.cumsum(0)]).to(I32)
    t2r = torch.repeat_interleave(torch.arange(R, dtype=I32), per)
    start = torch.randint(0, 40, (R,), generator=g)
    pos = torch.cat([torch.arange(int(s), int(s) + int(n)) for s, n in zip(start, per)] or [torch.empty(0, dtype=torch.long)])
    ring_blk = torch.randperm(nblocks, generator=g)[:R]
    slot = torch.cat([blk * cap + torch.arange(int(s), int(s) + int(n)) % cap
                      for blk, s, n in zip(ring_blk, start, per)] or [torch.empty(0, dtype=torch.long)])
    if T > 0:
        neg = torch.rand(T, generator=g) < 0.15
        slot = torch.where(neg, -1, slot)
    rows = T + 3
    kv = _kv_rows(g, rows, 1024, kinds)
    kv[T:] = float("nan")  # poison rows past T
    state = _kv_rows(g, nblocks * cap, 1024, ["normal"]).view(nblocks, cap, 1024)
    return kv, pos, state, slot, qsl, t2r


@pytest.mark.parametrize("kinds", [["normal"], ["normal", "zero", "large", "tiny", "negzero"],
                                   ["normal", "nonfinite", "huge", "mixzero"]])
@pytest.mark.parametrize("cap", [4, 2, 8])
def test_save_compress_norm_cr2(kinds, cap):
    g = torch.Generator().manual_seed(cap * 10 + len(kinds))
    for R in [1, 3, 9, 40]:
        kv, pos, state, slot, qsl, t2r = _cr2_case(g, kinds, R, cap, R + 2)
        w = (torch.randn(512, generator=g) * 0.5 + 1).to(BF16)
        lat = torch.full((kv.shape[0], 512), float("nan"), dtype=BF16)
        _run_both(ref_compress.fused_save_compress_norm, ops.fused_save_compress_norm,
                  [kv, pos, state, slot, qsl, t2r, w, 1e-6, 2, lat], [2, 9], f"cr2 R={R}")


def test_save_compress_norm_cr2_ring_collisions_and_views():
    # two requests mapped to the same ring block (last writer wins), an odd chunk start that
    # pools with the ring, a chunk whose first slot is −1, state_cache as a strided view
    g = torch.Generator().manual_seed(11)
    cap = 4
    pos = torch.tensor([5, 6, 7, 8, 9, 3, 4, 5, 10, 11, 12], dtype=torch.long)
    qsl = torch.tensor([0, 5, 8, 11], dtype=I32)
    t2r = torch.tensor([0] * 5 + [1] * 3 + [2] * 3, dtype=I32)
    slot = torch.tensor([1 * cap + p % cap for p in [5, 6, 7, 8, 9]] + [1 * cap + p % cap for p in [3, 4, 5]]
                        + [-1, 2 * cap + 3, 2 * cap + 0], dtype=torch.long)
    kv = _kv_rows(g, 11, 1024, ["normal", "large"])
    big = _kv_rows(g, 3 * 5, 1040, ["normal"]).view(3, 5, 1040)
    state = big[:, :cap, :1024]
    w = torch.randn(512, generator=g).to(BF16)
    lat = torch.full((11, 512), float("nan"), dtype=BF16)
    _run_both(ref_compress.fused_save_compress_norm, ops.fused_save_compress_norm,
              [kv, pos, state, slot, qsl, t2r, w, 1e-5, 2, lat], [2, 9], "cr2 collisions")
    # fp32 weight, int32 positions / slots
    lat = torch.full((11, 512), float("nan"), dtype=BF16)
    _run_both(ref_compress.fused_save_compress_norm, ops.fused_save_compress_norm,
              [kv, pos.to(I32), state, slot.to(I32), qsl, t2r, w.float(), 1e-5, 2, lat], [2, 9], "cr2 int32")


def _ref_takes(fn, name: str) -> bool:
    return name in inspect.signature(fn).parameters


def _prev_rows_case(g, R, cap, kinds=("normal", "large", "nonfinite")):
    """A CR-2 batch plus prev_rows (a strided fp32 view) and per-request indices: some
    requests take a row (in any order), some -1 (the ring); one entry more than num_reqs."""
    kv, pos, state, slot, qsl, t2r = _cr2_case(g, list(kinds), R, cap, R + 2)
    P = R + 3
    prev = _kv_rows(g, P, 1040, list(kinds))[:, 8:1032]  # row stride 1040
    idx = torch.randperm(P, generator=g)[: R + 1].to(I32)
    idx[torch.rand(R + 1, generator=g) < 0.3] = -1
    return kv, pos, state, slot, qsl, t2r, prev, idx


def _expected_prev_rows(kv, pos, state, slot, qsl, t2r, w, eps, lat, prev, idx):
    """The prev_rows semantics through today's reference: a chunk's first token that closes a
    group reads prev[idx[r]] where idx[r] >= 0, i.e. the reference run on a ring whose row
    (slot // cap, (pos - 1) % cap) holds that row; the ring itself is never written."""
    ring = state.clone()
    cap = state.shape[1]
    for r in range(qsl.numel() - 1):
        t = int(qsl[r])
        if t >= int(qsl[r + 1]) or int(slot[t]) < 0 or int(pos[t]) % 2 == 0 or int(idx[r]) < 0:
            continue
        ring[int(slot[t]) // cap, (int(pos[t]) - 1) % cap] = prev[int(idx[r])]
    lat = _clone_view(lat)
    ref_compress.fused_save_compress_norm(kv, pos, ring, slot, qsl, t2r, w, eps, 2, lat)
    return lat


@pytest.mark.parametrize("cap", [2, 4, 8])
def test_save_compress_norm_prev_rows(cap):
    g = torch.Generator().manual_seed(500 + cap)
    for R in [1, 3, 9, 40]:
        kv, pos, state, slot, qsl, t2r, prev, idx = _prev_rows_case(g, R, cap)
        w = (torch.randn(512, generator=g) * 0.5 + 1).to(BF16)
        lat = torch.full((kv.shape[0], 512), float("nan"), dtype=BF16)
        want = _expected_prev_rows(kv, pos, state, slot, qsl, t2r, w, 1e-6, lat, prev, idx)
        for pidx in (idx, idx.long()):
            st, got = _clone_view(state), _clone_view(lat)
            before = _storage_bytes(st).clone()
            assert ops.fused_save_compress_norm(kv, pos, st, slot, qsl, t2r, w, 1e-6, 2, got, prev, pidx) is None
            _assert_bytes(got, want, f"prev_rows R={R} latent")
            assert torch.equal(_storage_bytes(st), before), "prev_rows given: the ring must not be written"
        if _ref_takes(ref_compress.fused_save_compress_norm, "prev_rows"):
            _run_both(ref_compress.fused_save_compress_norm, ops.fused_save_compress_norm,
                      [kv, pos, state, slot, qsl, t2r, w, 1e-6, 2, lat, prev, idx], [2, 9],
                      f"prev_rows R={R} vs reference")


def test_save_compress_norm_prev_rows_all_ring_and_cr1():
    """Every index -1: the ring's latents, still no ring writes.  CR 1 ignores prev_rows."""
    g = torch.Generator().manual_seed(7)
    kv, pos, state, slot, qsl, t2r, prev, idx = _prev_rows_case(g, 30, 4)
    w = torch.randn(512, generator=g).to(BF16)
    lat = torch.full((kv.shape[0], 512), float("nan"), dtype=BF16)
    want = _clone_view(lat)
    ref_compress.fused_save_compress_norm(kv, pos, _clone_view(state), slot, qsl, t2r, w, 1e-6, 2, want)
    st, got = _clone_view(state), _clone_view(lat)
    ops.fused_save_compress_norm(kv, pos, st, slot, qsl, t2r, w, 1e-6, 2, got, prev, torch.full_like(idx, -1))
    _assert_bytes(got, want, "prev_rows all -1")
    _assert_bytes(st, state, "prev_rows all -1: ring")
    kv1 = kv[:, :512].contiguous()
    lat1 = torch.full((kv.shape[0], 512), float("nan"), dtype=BF16)
    want1 = _clone_view(lat1)
    ref_compress.fused_save_compress_norm(kv1, pos, None, slot, None, None, w, 1e-6, 1, want1)
    ops.fused_save_compress_norm(kv1, pos, None, slot, None, None, w, 1e-6, 1, lat1, prev, idx)
    _assert_bytes(lat1, want1, "cr1 ignores prev_rows")


def _expected_ring_rows(rows, slot, state):
    out = _clone_view(state)
    cap = state.shape[1]
    for i, s in enumerate(slot.tolist()):
        if s >= 0:
            out[s // cap, s % cap] = rows[i, :1024]
    return out


@pytest.mark.parametrize("N", [0, 1, 5, 37, 300])
def test_save_ring_rows(N):
    g = torch.Generator().manual_seed(900 + N)
    nb, cap = 90, 4
    big = _kv_rows(g, nb * 5, 1040, ["normal"]).view(nb, 5, 1040)
    state = big[:, :cap, :1024]  # padded rows and blocks: their bytes must survive
    rows = _kv_rows(g, N + 2, 1032, ["normal", "nonfinite", "negzero"])[:, :1024]  # row stride 1032
    slot = torch.randperm(nb * cap, generator=g)[:N]
    slot[torch.rand(N, generator=g) < 0.2] = -1
    want = _expected_ring_rows(rows, slot, state)
    for s in (slot, slot.to(I32)):
        got = _clone_view(state)
        assert ops.save_ring_rows(rows[:N], s, got) is None
        _assert_bytes(got, want, f"save_ring_rows N={N}")
    if hasattr(ref_compress, "save_ring_rows"):
        _run_both(ref_compress.save_ring_rows, ops.save_ring_rows, [rows[:N], slot, state], [2],
                  f"save_ring_rows N={N} vs reference")


def test_save_ring_rows_rejects_slots_outside_the_ring():
    """A slot past blocks * cap raises the typed error naming it and writes nothing."""
    g = torch.Generator().manual_seed(3)
    nb, cap = 3, 4
    buf = _kv_rows(g, nb * cap + 4, 1024, ["normal"])
    state = buf[: nb * cap].view(nb, cap, 1024)
    rows = _kv_rows(g, 4, 1024, ["large"])
    want = _clone_view(buf)
    for bad in (nb * cap, nb * cap + 3, 2**31 - 1):
        slot = torch.tensor([5, bad, -1, 7])
        with pytest.raises(ValueError, match=f"'slot_mapping' has value {bad} at \\[1\\]"):
            ops.save_ring_rows(rows, slot, state)
        _assert_bytes(buf, want, "out-of-ring slots")


def test_compress_exp_matches_reference():
    """The softmax weights: fl32(2^y) through the kernel's double polynomial vs torch.exp2 in
    float64 (the reference's _exp), over many y <= 0 incl. exact integers and the fp32 underflow edge."""
    g = torch.Generator().manual_seed(0)
    n = 1 << 16
    sa = torch.cat([torch.randn(n, generator=g) * 8, -torch.rand(n, generator=g) * 110,
                    torch.tensor([-103.28, -103.279, -87.3, -0.0, 0.0, -1e-30])])
    sb = torch.zeros_like(sa)
    rows = sa.numel() // 512 + 1
    pad = rows * 512 - sa.numel()
    sa = torch.cat([sa, torch.zeros(pad)]).view(rows, 512)
    kv = torch.cat([torch.randn(rows, 512, generator=g), sa], 1)
    kv2 = torch.cat([torch.randn(rows, 512, generator=g), sb[:1].expand(rows, 512) * 0], 1)
    # rows alternate: (t-1, t) pairs pool a random score row with a zero score row
    inter = torch.stack([kv2, kv], 1).reshape(2 * rows, 1024).contiguous()
    T = 2 * rows
    pos = torch.arange(T)
    slot = torch.arange(T)
    qsl = torch.tensor([0, T], dtype=I32)
    t2r = torch.zeros(T, dtype=I32)
    state = torch.zeros(T // 4 + 2, 4, 1024)
    w = torch.ones(512, dtype=BF16)
    lat = torch.full((T, 512), float("nan"), dtype=BF16)
    _run_both(ref_compress.fused_save_compress_norm, ops.fused_save_compress_norm,
              [inter, pos, state, slot, qsl, t2r, w, 1e-6, 2, lat], [2, 9], "exp sweep")


# ------------------------------------------------------------- R §2 indexer Q


def _index_q_case(g, T, H, D, R, kinds, cache_dtype, w_dtype, strided=False):
    x = torch.stack([_special_values(g, (H, D), kinds[t % len(kinds)]) for t in range(T)]) if T else torch.empty(0, H, D)
    q = x.to(BF16)
    if strided:  # a head-strided, row-strided view
        big = torch.zeros(T, 2 * H, D + 8, dtype=BF16)
        big[:, ::2, :D] = q
        q = big[:, ::2, :D]
    max_pos = 300
    ang = torch.arange(max_pos).float()[:, None] * torch.exp2(-torch.arange(R // 2).float() / 3)
    cache = torch.cat([torch.cos(ang), torch.sin(ang)], 1).to(cache_dtype)
    pos = torch.randint(0, max_pos, (T,), generator=g)
    w = (torch.randn(T, H, generator=g) * 3).to(w_dtype)
    return pos, q, cache, w


INDEXER_KINDS = [
    ["normal"],
    ["normal", "zero", "negzero", "mixzero", "large", "tiny"],
    ["fp8max", "ties", "maxbf16", "verytiny", "huge"],
]


@pytest.mark.parametrize("use_fnuz", [False, True])
@pytest.mark.parametrize("kinds", INDEXER_KINDS)
@pytest.mark.parametrize("cache_dtype", [F32, BF16])
def test_indexer_q_fp8(use_fnuz, kinds, cache_dtype):
    g = torch.Generator().manual_seed(int(use_fnuz) + 2 * len(kinds))
    for T, H, D, R, strided in [(0, 4, 128, 64, False), (7, 64, 128, 64, False), (33, 8, 128, 64, True),
                                (5, 3, 96, 32, False), (4, 3, 99, 32, False)]:  # odd NoPE width
        pos, q, cache, w = _index_q_case(g, T, H, D, R, kinds, cache_dtype, BF16 if T % 2 else F32, strided)
        dt = torch.float8_e4m3fnuz if use_fnuz else torch.float8_e4m3fn
        q_out = torch.full((T, H, D), 0xA5, dtype=torch.uint8).view(dt)
        w_out = torch.full((T, H), float("nan"), dtype=F32)
        _run_both(ref_indexer.fused_indexer_q_rope_quant, ops.fused_indexer_q_rope_quant,
                  [pos, q, cache, w, 128**-0.5, H**-0.5, False, use_fnuz, q_out, torch.empty(0, dtype=torch.uint8),
                   w_out], [8, 10], f"indexer fp8 T={T} H={H}")


def test_indexer_q_fp8_nonfinite():
    g = torch.Generator().manual_seed(99)
    for use_fnuz in (False, True):
        pos, q, cache, w = _index_q_case(g, 9, 16, 128, 64, ["nonfinite", "normal"], F32, BF16)
        dt = torch.float8_e4m3fnuz if use_fnuz else torch.float8_e4m3fn
        q_out = torch.full((9, 16, 128), 0xA5, dtype=torch.uint8).view(dt)
        w_out = torch.full((9, 16), 1.0, dtype=F32)
        _run_both(ref_indexer.fused_indexer_q_rope_quant, ops.fused_indexer_q_rope_quant,
                  [pos, q, cache, w, 0.3, 0.125, False, use_fnuz, q_out, torch.empty(0, dtype=torch.uint8), w_out],
                  [8, 10], "indexer fp8 nonfinite")


@pytest.mark.parametrize("kinds", INDEXER_KINDS + [["nonfinite_nope"], ["nonfinite", "normal"]])
@pytest.mark.parametrize("cache_dtype", [F32, BF16])
def test_indexer_q_mxfp4(kinds, cache_dtype):
    # ["nonfinite", ...]: NaN also in RoPE dims.  Its e2m1 sign bit is the sign of the bf16
    # round trip's NaN, which the kernel takes from torch's CPU cast (0xFFFF, sign set), so the
    # bytes match the reference on the CPU; on the GPU this sign is implementation-defined.
    g = torch.Generator().manual_seed(7 + len(kinds))
    for T, H, D, R, strided in [(0, 4, 128, 64, False), (7, 64, 128, 64, False), (21, 8, 128, 64, True),
                                (4, 5, 192, 32, False), (3, 2, 96, 48, False)]:  # a block straddles NoPE/RoPE
        if kinds == ["nonfinite_nope"]:
            # NaN/inf only in the NoPE blocks (the MXFP4 sign of a *computed* NaN is
            # implementation-defined, spec R §2.7, so RoPE dims stay finite here)
            pos, q, cache, w = _index_q_case(g, T, H, D, R, ["normal"], cache_dtype, BF16, strided)
            if T:
                nf = _special_values(g, (T, H, D - R), "nonfinite").to(BF16)
                q[..., : D - R] = nf
        else:
            pos, q, cache, w = _index_q_case(g, T, H, D, R, kinds, cache_dtype, BF16 if T % 2 else F32, strided)
        q_out = torch.full((T, H, D // 2), 0xA5, dtype=torch.uint8)
        s_out = torch.full((T, H, D // 32), 0xA5, dtype=torch.uint8)
        w_out = torch.full((T, H), float("nan"), dtype=BF16)
        _run_both(ref_indexer.fused_indexer_q_rope_quant, ops.fused_indexer_q_rope_quant,
                  [pos, q, cache, w, 128**-0.5, 0.125, True, False, q_out, s_out, w_out], [8, 9, 10],
                  f"indexer mxfp4 T={T}")


# ------------------------------------------------------------- R §4 inverse RoPE


def _inv_rope_case(g, T, G, HG, Dh, R, kinds):
    NH = G * HG
    x = torch.stack([_special_values(g, (NH, Dh), kinds[t % len(kinds)]) for t in range(T)]) if T else torch.empty(0, NH, Dh)
    o = x.to(BF16)
    max_pos = 200
    ang = torch.arange(max_pos).float()[:, None] * torch.exp2(-torch.arange(R // 2).float() / 2)
    cache = torch.cat([torch.cos(ang), torch.sin(ang)], 1)
    pos = torch.randint(0, max_pos, (T,), generator=g)
    return o, pos, cache


def _inv_rope_bufs(T, G, HG, Dh, QG, tma, quantize, o_dtype=BF16):
    Dg = HG * Dh
    if not quantize:
        return torch.full((G, T, Dg), float("nan"), dtype=o_dtype), torch.empty((G, 0), dtype=F32)
    S = HG * Dh // QG
    K = (S + 3) // 4 if tma else S
    Ta = _roundup(T, 4)
    out = torch.full((G, T, Dg), 0x5A, dtype=torch.uint8).view(torch.float8_e4m3fn)
    sb = torch.full((G, K * Ta), 0x5A5A5A5A, dtype=torch.int32)
    return out, (sb if tma else sb.view(F32))


INV_MODES = [
    # (QG, tma, quantize, permuted)
    (128, False, True, False),
    (128, True, True, False),
    (128, False, False, False),
    (32, False, True, False),
    (32, True, True, True),
    (32, True, True, False),
    (64, False, True, True),
    (512, True, True, False),  # C = 1: one packed word spans four heads
    (256, False, True, False),
]


@pytest.mark.parametrize("mode", INV_MODES)
@pytest.mark.parametrize("kinds", [["normal"], ["normal", "zero", "negzero", "mixzero", "large", "tiny"],
                                   ["fp8max", "ties", "maxbf16", "verytiny", "huge", "nonfinite"]])
def test_inv_rope(mode, kinds):
    QG, tma, quantize, permuted = mode
    g = torch.Generator().manual_seed(QG + 3 * len(kinds))
    for T, G, HG in [(0, 2, 4), (5, 2, 4), (9, 1, 8), (3, 3, 2)]:
        Dh, R = 512, 64
        o, pos, cache = _inv_rope_case(g, T, G, HG, Dh, R, kinds)
        out, sb = _inv_rope_bufs(T, G, HG, Dh, QG, tma, quantize)
        _run_both(ref_oq.fused_inv_rope_fp8_quant, ops.fused_inv_rope_fp8_quant,
                  [o, pos, cache, G, HG, Dh - R, R, QG, tma, quantize, permuted, out, sb], [11, 12],
                  f"inv rope {mode} T={T}")


def test_inv_rope_strided_and_small_dims():
    g = torch.Generator().manual_seed(4)
    # a head-strided attention output, int32 positions, and a small head (nope 24, rope 8)
    o, pos, cache = _inv_rope_case(g, 6, 2, 3, 512, 64, ["normal", "large"])
    big = torch.zeros(6, 12, 520, dtype=BF16)
    big[:, ::2, :512] = o
    for quantize, tma, QG in ((True, False, 128), (True, True, 32), (False, False, 128)):
        out, sb = _inv_rope_bufs(6, 2, 3, 512, QG, tma, quantize)
        _run_both(ref_oq.fused_inv_rope_fp8_quant, ops.fused_inv_rope_fp8_quant,
                  [big[:, ::2, :512], pos.to(I32), cache, 2, 3, 448, 64, QG, tma, quantize, False, out, sb],
                  [11, 12], "inv rope strided")
    o, pos, cache = _inv_rope_case(g, 7, 2, 2, 32, 8, ["normal", "nonfinite"])
    out, sb = _inv_rope_bufs(7, 2, 2, 32, 16, True, True)
    _run_both(ref_oq.fused_inv_rope_fp8_quant, ops.fused_inv_rope_fp8_quant,
              [o, pos, cache, 2, 2, 24, 8, 16, True, True, True, out, sb], [11, 12], "inv rope small")


# (position, rope pair i, even value e, odd value o): with the test cos/sin cache, the rotated
# even lane fma(e, c, RN(o*s)) is an fp32 whose s = |y| * fl32(1/448) lies a few ulps above a
# power of two, where the fp32-log2 ceiling (L) is one binade below the exact one (B) (R §1.5);
# found by a search over random bf16 pairs.
LOG_CEIL_EDGE = [
    (113, 0, 1.3301360013429075e-11, 5.201172825763933e-12),
    (47, 3, -220160.0, 26112.0),
    (31, 17, 1.2689270079135895e-08, 4.627509042620659e-09),
    (112, 1, -0.00035858154296875, -0.0002346038818359375),
    (63, 11, 1.318767317570746e-10, -1.2732925824820995e-10),
    (91, 13, 1.2934207916259766e-05, -1.2159347534179688e-05),
]


def test_inv_rope_log_ceil_edge():
    """Chunks whose fp32 amax sits a few ulps above 448·2^k: the (L) ceiling lands one binade
    low and the ±448 clamp keeps the codes in range (R §1.5, §4.3)."""
    from dsv41.core.codecs import bit_ceil_log2, ceil_log2, inv_const

    g = torch.Generator().manual_seed(1)
    n = len(LOG_CEIL_EDGE)
    o, _, cache = _inv_rope_case(g, n, 1, 1, 512, 64, ["zero"])
    pos = torch.tensor([c[0] for c in LOG_CEIL_EDGE])
    for r, (_, i, e, od) in enumerate(LOG_CEIL_EDGE):
        o[r, 0, 448 + 2 * i] = e
        o[r, 0, 448 + 2 * i + 1] = od
    assert torch.equal(o.float(), o.to(BF16).float())
    # the edge is really hit: the amax of the RoPE chunk (dims 448..511) has (L) != (B)
    from dsv41.core.codecs import fma32

    x = o.float()
    d = torch.arange(448, 512)
    row = cache[pos]
    cs, sn = row[:, (d - 448) >> 1], row[:, 32 + ((d - 448) >> 1)]
    ps = x[:, 0, d ^ 1] * sn
    y = fma32(x[:, 0, d], cs, torch.where((d & 1) == 0, ps, -ps))
    sc = y.abs().amax(-1) * inv_const(448.0)
    assert (ceil_log2(sc) != bit_ceil_log2(sc)).sum() >= 3
    for QG, tma in ((64, False), (32, True), (128, False), (512, True)):
        out, sb = _inv_rope_bufs(n, 1, 1, 512, QG, tma, True)
        _run_both(ref_oq.fused_inv_rope_fp8_quant, ops.fused_inv_rope_fp8_quant,
                  [o, pos, cache, 1, 1, 448, 64, QG, tma, True, False, out, sb], [11, 12], f"inv rope edge {QG}")


# ------------------------------------------------------------- R §5 Q/KV RMSNorm quant


@pytest.mark.parametrize("kinds", [["normal"], ["normal", "zero", "negzero", "large", "tiny", "mixzero"],
                                   ["fp8max", "ties", "maxbf16", "verytiny", "huge", "nonfinite"]])
# the sums of squares' layouts: rows that end at a thread's boundary (1536 / 512: 8 per
# thread), one element per thread (96 / 64), a row ending inside a thread (516) and two passes
# over the threads (a 4096 block)
@pytest.mark.parametrize("Qs,Ks", [(1536, 512), (96, 64), (32, 576), (1536, 516), (4096, 520)])
def test_q_kv_rmsnorm_quant(kinds, Qs, Ks):
    g = torch.Generator().manual_seed(Qs + len(kinds))
    for T in [0, 1, 5, 130, 257]:
        def rows(n):
            if T == 0:
                return torch.empty(0, n)
            return torch.stack([_special_values(g, (n,), kinds[t % len(kinds)]) for t in range(T)])
        qr = rows(Qs).to(BF16)
        kv = rows(Ks).to(BF16)
        qw = (torch.randn(Qs, generator=g) * 0.3 + 1).to(BF16)
        kw = (torch.randn(Ks, generator=g) * 0.3 + 1)
        kw = kw.to(BF16) if T % 2 else kw
        Tp, Gp = _roundup(T, 128), _roundup(Qs // 32, 4)
        q_out = torch.full((T, Qs), 0xA5, dtype=torch.uint8).view(torch.float8_e4m3fn)
        q_sc = torch.full((Tp * Gp,), 0xA5, dtype=torch.uint8)
        kv_out = torch.full((T, Ks), float("nan"), dtype=BF16)
        _run_both(ref_oq.fused_q_kv_rmsnorm_quant, ops.fused_q_kv_rmsnorm_quant,
                  [qr, kv, qw, kw, 1e-6, q_out, q_sc, kv_out], [5, 6, 7], f"q_kv T={T}")


def test_q_kv_rmsnorm_quant_views():
    g = torch.Generator().manual_seed(8)
    T, Qs, Ks = 40, 128, 96
    big = torch.randn(T, 300, generator=g).to(BF16)
    qr, kv = big[:, :Qs], big[:, 150:150 + Ks]
    qw, kw = torch.randn(Qs, generator=g).to(BF16), torch.randn(Ks, generator=g).to(BF16)
    q_out = torch.full((T, Qs), 0xA5, dtype=torch.uint8).view(torch.float8_e4m3fn)
    q_sc = torch.full((128 * 4,), 0xA5, dtype=torch.uint8)
    kv_out = torch.full((T, Ks), 0.5, dtype=BF16)
    _run_both(ref_oq.fused_q_kv_rmsnorm_quant, ops.fused_q_kv_rmsnorm_quant,
              [qr, kv, qw, kw, 1e-5, q_out, q_sc, kv_out], [5, 6, 7], "q_kv views")


# ------------------------------------------------------------- R §6.3 pad_fused_q_heads


@pytest.mark.parametrize("H,Hp", [(8, 16), (16, 16), (3, 32), (1, 16), (20, 64)])
def test_pad_fused_q_heads(H, Hp):
    g = torch.Generator().manual_seed(H * Hp)
    for T in (0, 1, 17):
        x = _special_values(g, (T, H, 512), "nonfinite").to(BF16)
        out = torch.full((T, Hp, 512), float("nan"), dtype=BF16)
        _run_both(ref_oq.pad_fused_q_heads, ops.pad_fused_q_heads, [x, out], [1], f"pad H={H} Hp={Hp}")
        # row-strided q (a slice of a wider buffer)
        wide = torch.zeros(T, H * 512 + 64, dtype=BF16)
        wide[:, : H * 512] = x.reshape(T, H * 512)
        qv = wide[:, : H * 512].view(T, H, 512) if T else x
        out = torch.full((T, Hp, 512), 7.0, dtype=BF16)
        _run_both(ref_oq.pad_fused_q_heads, ops.pad_fused_q_heads, [qv, out], [1], f"pad strided H={H}")


# ------------------------------------------------------------- fallback for odd layouts


def test_unsupported_layouts_fall_back_to_reference():
    """Layouts the public functions never pass (column-strided index rows, an fp16 attention
    output) still give the reference's bytes, through the reference."""
    g = torch.Generator().manual_seed(2)
    topk = torch.randint(-1, 100, (9, 12), generator=g, dtype=I32).t().contiguous().t()  # stride(1) = 9
    table = torch.randint(0, 50, (3, 4), generator=g, dtype=I32)
    t2r = torch.randint(0, 3, (9,), generator=g, dtype=I32)
    valid = torch.ones(9, dtype=torch.bool)
    n0 = ops.FALLBACKS.get("compute_global_topk_indices_and_lens", 0)
    _run_both(ref_si.compute_global_topk_indices_and_lens, ops.compute_global_topk_indices_and_lens,
              [topk, t2r, table, 64, valid, torch.full((9, 12), -7, dtype=I32), torch.full((9,), -7, dtype=I32)],
              [5, 6], "fallback global")
    assert ops.FALLBACKS["compute_global_topk_indices_and_lens"] == n0 + 1
    # more seq_lens than requests in query_start_loc: only the first len(qsl)-1 are requests
    _run_both(ref_si.combine_topk_swa_indices, ops.combine_topk_swa_indices,
              [torch.zeros(4, 4, dtype=I32), torch.tensor([0, 2, 4], dtype=I32), torch.tensor([5, 6, 7], dtype=I32),
               torch.tensor([1, 1, 1], dtype=I32), 8, 4, 4, 100, 50, torch.full((4, 128), -7, dtype=I32),
               torch.full((4,), -7, dtype=I32)], [9, 10], "combine extra seq_lens")
    o, pos, cache = _inv_rope_case(g, 3, 1, 2, 512, 64, ["normal"])
    out = torch.full((1, 3, 1024), 1.0, dtype=torch.float16)
    _run_both(ref_oq.fused_inv_rope_fp8_quant, ops.fused_inv_rope_fp8_quant,
              [o.half(), pos, cache, 1, 2, 448, 64, 128, False, False, False, out, torch.empty(1, 0)], [11],
              "fallback inv rope fp16")


# ----------------------------------------------------------- sizes that take the OpenMP path


def test_parallel_sizes():
    """Inputs big enough for every kernel's multithreaded path (the cases above are mostly
    below the single-thread thresholds)."""
    g = torch.Generator().manual_seed(77)
    args = _flashinfer_args(g, D=40, P=None, R=120, kdec=64, topk=64, local=True, lens_given=False, valid_given=True)
    _run_both(ref_si.build_flashinfer_mixed_sparse_indices, ops.build_flashinfer_mixed_sparse_indices,
              args, [19, 20], "flashinfer parallel")
    topk_idx, qsl, seq, gath = _combine_case(g, None, 60, 128, 4, 100, 4096, 2048, 100)
    T = topk_idx.shape[0]
    _run_both(ref_si.combine_topk_swa_indices, ops.combine_topk_swa_indices,
              [topk_idx, qsl, seq, gath, 128, 4, 100, 4096, 2048, torch.full((T, 256), -7, dtype=I32),
               torch.full((T,), -7, dtype=I32)], [9, 10], "combine parallel")
    kv, pos, state, slot, qsl, t2r = _cr2_case(g, ["normal", "large", "nonfinite"], 90, 4, 100)
    w = torch.randn(512, generator=g).to(BF16)
    _run_both(ref_compress.fused_save_compress_norm, ops.fused_save_compress_norm,
              [kv, pos, state, slot, qsl, t2r, w, 1e-6, 2, torch.full((kv.shape[0], 512), float("nan"), dtype=BF16)],
              [2, 9], "cr2 parallel")
    o, pos, cache = _inv_rope_case(g, 40, 2, 4, 512, 64, ["normal", "ties", "nonfinite"])
    for QG, tma, quant, perm in INV_MODES[:5]:
        out, sb = _inv_rope_bufs(40, 2, 4, 512, QG, tma, quant)
        _run_both(ref_oq.fused_inv_rope_fp8_quant, ops.fused_inv_rope_fp8_quant,
                  [o, pos, cache, 2, 4, 448, 64, QG, tma, quant, perm, out, sb], [11, 12], "inv rope parallel")
