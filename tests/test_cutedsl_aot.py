"""The ``cuda:cutedsl`` backend without a GPU.

1. AOT: every CuTe DSL kernel variant compiles (host code, PTX, cubin through ptxas) for sm_90a
   and sm_100a (``backends/cuda/cutedsl_aot.compile_all``); skipped without ``cutlass``.
2. The generated PTX keeps the numerics we rely on (no flush-to-zero, no approximate math,
   every fp32 multiply / fma with an explicit rounding so ptxas cannot contract it).
3. The launch fast path marshals one pointer per argument (checked through the DSL's own
   argument marshalling, which needs no GPU).
4. CPU models of the kernels: the per-thread work of each kernel (its index math, taken from the
   kernel modules' own geometry helpers, and its PTX arithmetic emulated in torch) mapped over
   every thread of the launch grid, compared byte for byte with ``dsv41.reference``.  Plus the
   exhaustive check that the kernels' bit-ceil scale rule equals the reference's log-ceil rule
   for every bf16-valued amax.  These need torch only.
"""

import os
import struct
import subprocess
import sys
import textwrap

import pytest
import torch

from dsv41.backends.cuda import cutedsl_gather as G
from dsv41.backends.cuda import cutedsl_indexer_q as Q
from dsv41.core.codecs import F32_1E_4, fma32, inv_const
from dsv41.reference.indexer import fused_indexer_q_rope_quant as ref_indexer_q
from dsv41.reference.k_cache import (
    dequantize_and_gather_k_cache as ref_gather,
    quantize_and_insert_k_cache as ref_insert,
)

# -P: child processes import the installed package, not the checkout's dsv41/ (on a GPU host the
# checkout lacks dsv41.backends, which installs from backends/)
SAFE_PATH = ["-P"] if sys.version_info >= (3, 11) else []

try:
    import cutlass.cute  # noqa: F401

    HAVE_CUTLASS = True
except Exception:  # pragma: no cover - depends on the machine
    HAVE_CUTLASS = False

needs_cutlass = pytest.mark.skipif(not HAVE_CUTLASS, reason="nvidia-cutlass-dsl (cutlass) not importable")

F32, BF16, U8, I32 = torch.float32, torch.bfloat16, torch.uint8, torch.int32


# --------------------------------------------------------------------------------------
# 1-3. Compilation
# --------------------------------------------------------------------------------------


@needs_cutlass
@pytest.mark.parametrize("arch", ["sm_90a", "sm_100a"])
def test_compile_all(arch):
    from dsv41.backends.cuda.cutedsl_aot import compile_all

    res = compile_all(arch)
    assert res, "no CuTe kernel variants registered"
    bad = [(name, err) for name, a, ok, err in res if not ok]
    assert not bad, "\n\n".join(f"{n}:\n{e}" for n, e in bad)
    assert {a for _, a, _, _ in res} == {arch}
    names = {n for n, *_ in res}
    assert any("gather[584" in n for n in names) and any("gather[528" in n for n in names)
    assert any("gather[528,il" in n for n in names)
    assert any("mxfp4" in n for n in names) and any("fp8" in n for n in names)


@needs_cutlass
def test_fast_launch_layout():
    """The fast path writes one ctypes cell per argument: the DSL must marshal it the same way."""
    vals = tuple(0x7F0000001000 + 17 * k for k in range(11)) + (64, 3, 6, 13, 200, 5, 7)
    for interleaved in (False, True):
        g = G.compile_gather("sm_90a", 528, interleaved=interleaved)
        assert g.check_layout(vals, 0x5A5A5A5A5A)
    q = Q.compile_indexer_q("sm_90a")
    vals = tuple(0x7F0000002000 + 3 * k for k in range(19)) + (9, 64, 0.08838834764831845, 0.125, 4096, 11)
    assert q.check_layout(vals, 0x1234)


_PTX_SCRIPT = textwrap.dedent(
    """
    from dsv41.backends.cuda import cutedsl_gather as G, cutedsl_indexer_q as Q
    fns = [G.compile_gather("sm_90a", 584), G.compile_gather("sm_90a", 528),
           Q.compile_indexer_q("sm_90a", fp4=False), Q.compile_indexer_q("sm_90a", fp4=True, wout_bf16=True),
           Q.compile_indexer_q("sm_90a", cs_bf16=True, w_bf16=False, fp4=False),
           G.compile_gather("sm_90a", 528, interleaved=True)]
    import sys
    for f in fns:
        sys.stdout.write(f.compiled.artifacts.PTX + "\\n#####\\n")
    """
)


@needs_cutlass
def test_ptx_numerics(tmp_path):
    env = dict(os.environ, CUTE_DSL_KEEP="ptx", CUTE_DSL_DUMP_DIR=str(tmp_path))
    out = subprocess.run([sys.executable, *SAFE_PATH, "-c", _PTX_SCRIPT], env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-4000:]
    ptxs = [p for p in out.stdout.split("#####") if ".entry" in p]
    assert len(ptxs) == 6
    for ptx in ptxs:
        body = [ln.strip() for ln in ptx.splitlines() if not ln.strip().startswith("//")]
        for ln in body:
            op = ln.split(" ")[0].split("\t")[0]
            assert ".ftz" not in op and ".approx" not in op, ln
            if op.startswith(("mul.f32", "fma.f32", "add.f32", "sub.f32", "mad.f32", "div.f32", "div.full", "rcp.")):
                raise AssertionError(f"fp32 arithmetic without explicit rounding (contractible): {ln}")
    assert "cvt.rn.f16x2.e4m3x2" in ptxs[0] and "ld.global.nc.v4.u32" in ptxs[0]
    assert "st.global.v4.u32" in ptxs[0] and "st.global.v4.u32" in ptxs[1]
    assert "ld.global.nc.v4.u32" in ptxs[5] and "st.global.v4.u32" in ptxs[5]
    assert "fma.rn.f32" in ptxs[2] and "cvt.rn.satfinite.e4m3x2.f32" in ptxs[2]
    assert "shfl.sync.bfly" in ptxs[2] and "shfl.sync.bfly" in ptxs[3]


# --------------------------------------------------------------------------------------
# 4a. Gather model
# --------------------------------------------------------------------------------------


def _flat(cache):
    span = 1 + sum((s - 1) * st for s, st in zip(cache.shape, cache.stride()))
    return cache.as_strided((span,), (1,), cache.storage_offset())


def _decode_lane(vbytes16, code):
    """The kernel's _DEC_WORD on 16 e4m3 bytes and one scale code -> 16 bf16 bit patterns."""
    vals = vbytes16.contiguous().view(torch.float8_e4m3fn).to(F32)  # cvt.rn.f16x2.e4m3x2 + cvt.f32.f16
    scale = torch.tensor([int(code) << 23], dtype=torch.int32).view(F32)  # shl 23
    p = vals * scale  # mul.rn.f32
    bits = p.to(BF16).view(torch.int16)  # cvt.rn.bf16x2.f32
    return torch.where(torch.isnan(p), torch.full_like(bits, 0x7FFF), bits)


def model_gather(out, k_cache, seq_lens, gather_lens, block_table, block_size, offset, num_sms=3,
                 interleaved=False):
    """Every thread of the CuTe gather launch, in Python, with the module's geometry helpers."""
    width = int(k_cache.shape[-1])
    vb, sb, qd, group = G.RECORDS[width]
    flat = _flat(k_cache)
    page_bytes = k_cache.stride(0)
    num_reqs = seq_lens.shape[0]
    gx, gy = G.gather_grid(num_reqs, out.shape[1] - offset, num_sms)
    out_bits = out.view(torch.int16)
    U, TPC = G.TOKENS_PER_WARP, G.TOKENS_PER_CTA
    py_sel = lambda c, a, b: a if c else b  # noqa: E731
    for r in range(gx):
        L = int(seq_lens[r])
        n = int(gather_lens[r]) if gather_lens is not None else L
        start = L - n
        for cy in range(gy):
            for c in range(cy * TPC, n, gy * TPC):
                for warp in range(G.WARPS):
                    i0 = c + warp * U
                    for u in range(U):
                        i = min(i0 + u, n - 1)
                        pos = start + i
                        bi, t = pos // block_size, pos % block_size
                        blk = int(block_table[r, bi])
                        voff, soff = G.token_addresses(width, block_size, page_bytes, blk, t, interleaved)
                        valid = i0 + u < n
                        for lane in range(32):
                            is_quant, value_off, scale_off = G.lane_layout(width, lane, py_sel)
                            is_quant = True if is_quant is None else is_quant
                            a = voff + value_off
                            raw = flat[a : a + (32 if qd < 512 else 16)]
                            code = flat[soff + scale_off]
                            if is_quant:
                                words = _decode_lane(raw[:16], code)
                            else:
                                words = raw.view(torch.int16)
                            if valid:
                                out_bits[r, offset + i0 + u, 16 * lane : 16 * lane + 16] = words


def _make_cache(width, num_blocks, block_size, pad, gen, specials=True):
    """A cache filled by the reference writer, then salted with special bytes."""
    k_pages = torch.zeros(num_blocks, block_size * width + pad, dtype=U8)
    k_pages.random_(0, 256, generator=gen)
    k_cache = k_pages[:, : block_size * width].view(num_blocks, block_size, width)
    T = num_blocks * block_size
    k = (torch.randn(T, 512, generator=gen) * torch.exp2(torch.randint(-20, 20, (T, 1), generator=gen).float())).to(BF16)
    slots = torch.randperm(T, generator=gen)[: T - 3].to(torch.int64)
    ref_insert(k, k_cache, slots, block_size, False, width)
    if specials:
        flat = _flat(k_cache)
        vb, sb, qd, group = G.RECORDS[width]
        for blk in range(num_blocks):
            for t in range(0, block_size, 3):
                base = blk * k_cache.stride(0)
                sbase = base + block_size * vb + t * sb
                g = (blk + t) % (qd // group)
                flat[sbase + g] = [0, 255, 1, 254, 127][(blk + t) % 5]  # codes 0/255/extremes
                flat[base + t * vb + (t * 7) % qd] = [0x7F, 0xFF, 0x80, 0x00, 0x01][(blk * t) % 5]
    return k_cache


def _interleave(k_cache):
    """The same records in the interleaved layout (each token's value record followed by its
    scale record), in a new storage with k_cache's shape and strides (page padding kept)."""
    nb, bs, width = k_cache.shape
    vb, sb = G.RECORDS[width][:2]
    src = _flat(k_cache)
    dst = src.clone()
    ps = k_cache.stride(0)
    for blk in range(nb):
        page = src[blk * ps : blk * ps + bs * width]
        recs = torch.cat((page[: bs * vb].view(bs, vb), page[bs * vb :].view(bs, sb)), 1)
        dst[blk * ps : blk * ps + bs * width] = recs.flatten()
    return dst.as_strided(k_cache.shape, k_cache.stride(), 0)


LAYOUTS = [(584, False), (528, False), (528, True)]
LAYOUT_IDS = ["584", "528", "528-interleaved"]


@pytest.mark.parametrize("width,interleaved", LAYOUTS, ids=LAYOUT_IDS)
@pytest.mark.parametrize("with_gather_lens", [True, False])
def test_gather_model_matches_reference(width, interleaved, with_gather_lens):
    """The interleaved model reads a copy of the paged cache rearranged by the layout formulas,
    so it must give the reference's bytes for the paged cache."""
    gen = torch.Generator().manual_seed(width + with_gather_lens)
    block_size, num_blocks = 16, 24
    k_cache = _make_cache(width, num_blocks, block_size, pad=40, gen=gen)
    k_model = _interleave(k_cache) if interleaved else k_cache
    num_reqs = 4
    seq_lens = torch.tensor([37, 1, 100, 64], dtype=I32)
    gather_lens = torch.tensor([37, 1, 45, 0], dtype=I32) if with_gather_lens else None
    max_blocks = 8
    bt_store = torch.randint(0, num_blocks, (num_reqs, 11), generator=gen, dtype=I32)
    block_table = bt_store[:, 1 : 1 + max_blocks]  # stride(0) = 11 != shape[1]
    offset, rows = 3, 110
    sentinel = torch.full((num_reqs + 1, rows, 512), -7.25, dtype=BF16)
    exp = sentinel.clone()
    got = sentinel.clone()
    ref_gather(exp, k_cache, seq_lens, gather_lens, block_table, block_size, offset, False)
    if interleaved:  # the rearranged copy is what the reference reads as the interleaved layout
        exp_il = sentinel.clone()
        ref_gather(exp_il, k_model, seq_lens, gather_lens, block_table, block_size, offset, False, True)
        assert torch.equal(exp_il.view(torch.int16), exp.view(torch.int16))
    model_gather(got, k_model, seq_lens, gather_lens, block_table, block_size, offset, interleaved=interleaved)
    assert torch.equal(got.view(torch.int16), exp.view(torch.int16))
    # and the same with a grid of one CTA per request (grid-width invariance)
    got2 = sentinel.clone()
    model_gather(got2, k_model, seq_lens, gather_lens, block_table, block_size, offset, num_sms=0,
                 interleaved=interleaved)
    assert torch.equal(got2.view(torch.int16), exp.view(torch.int16))


def test_gather_geometry():
    assert G.gather_grid(4, 16384, 132) == (4, 264)
    assert G.gather_grid(1, 0, 132) == (1, 1)
    assert G.alignment(0x1000, 576 * 64) == 16 and G.alignment(0x1001) == 1 and G.alignment(6) == 2
    # lane layouts: every output dim covered once; every quantized lane in one scale group
    for width in (584, 528):
        vb, sb, qd, group = G.RECORDS[width]
        seen = []
        for lane in range(32):
            q, v, s = G.lane_layout(width, lane, lambda c, a, b: a if c else b)
            q = True if q is None else q
            if q:
                assert v == 16 * lane and s == (16 * lane) // group
            else:
                assert v == qd + 32 * (lane - qd // 16) and v + 32 <= vb
            seen.extend(range(16 * lane, 16 * lane + 16))
        assert seen == list(range(512))
    # record addresses: paged (values, then scales, per page) and interleaved (528 bytes a token)
    assert G.token_addresses(528, 64, 40000, 2, 5) == (80000 + 5 * 512, 80000 + 64 * 512 + 5 * 16)
    assert G.token_addresses(528, 64, 40000, 2, 5, True) == (80000 + 5 * 528, 80000 + 5 * 528 + 512)
    assert G.INTERLEAVED_RECORDS == (528,)
    with pytest.raises(ValueError):
        G.compile_gather("sm_90a", 584, interleaved=True)


# --------------------------------------------------------------------------------------
# 4b. Indexer-Q model
# --------------------------------------------------------------------------------------


def _bits(x):
    return x.view(torch.int32).to(torch.int64) & 0xFFFFFFFF


def _f32(bits):
    b = bits.to(torch.int64)
    b = torch.where(b >= 2**31, b - 2**32, b)
    return b.to(torch.int32).view(F32)


def _cvt_bf16(x):
    """cvt.rn.bf16x2.f32 (RNE; NaN -> 0x7FFF) back to fp32."""
    b = x.to(BF16).to(F32)
    return torch.where(torch.isnan(x), _f32(torch.full_like(_bits(x), 0x7FFF0000)), b)


def _scale(amax, eps_bits, inv_const_f32, clamp):
    """The kernel's _SCALE block: (2^E, 2^-E or 0, E + 127)."""
    a = torch.fmax(amax, _f32(torch.full_like(_bits(amax), eps_bits)))
    s = a * torch.tensor(inv_const_f32, dtype=F32)
    e = torch.clamp((_bits(s) + 0x7FFFFF) >> 23, max=clamp)
    qs = _f32(e << 23)
    ei = (254 - torch.clamp(e, max=254)) << 23
    return qs, _f32(ei), e


def _e2m1(y):
    a = y.abs()
    c = ((a > 0.25).long() + (a >= 0.75).long() + (a > 1.25).long() + (a >= 1.75).long()
         + (a > 2.5).long() + (a >= 3.5).long() + (a > 5.0).long())
    return c | ((_bits(y) >> 28) & 8)


def model_indexer_q(positions, index_q, cos_sin, index_weights, softmax_scale, head_scale, use_fp4,
                    q_out, q_scale_out, weights_out):
    """Every thread of the CuTe indexer-Q launch, vectorized in torch."""
    T, H, D = index_q.shape
    R = cos_sin.shape[1]
    Gt = D // 16
    hpc = Q.THREADS // Gt
    TH = T * H
    grid = -(-TH // hpc)
    bx = torch.arange(grid).repeat_interleave(Q.THREADS)
    tid = torch.arange(Q.THREADS).repeat(grid)
    t, h, sub, valid = Q.head_mapping(D, bx, tid, TH, H, lambda a, b: torch.clamp(a, max=b))
    d16 = torch.arange(16)
    x = index_q[t[:, None], h[:, None], sub[:, None] * 16 + d16].to(F32)  # [N, 16]
    if R:
        nope_t = (D - R) // 16
        is_rope = (sub >= nope_t)[:, None]
        k = torch.clamp(sub - nope_t, min=0)
        p = positions[t].long()
        j8 = torch.arange(8)
        c = cos_sin[p[:, None], k[:, None] * 8 + j8].to(F32)
        s = cos_sin[p[:, None], R // 2 + k[:, None] * 8 + j8].to(F32)
        e, o = x[:, 0::2], x[:, 1::2]
        e2 = fma32(e, c, -(o * s))
        o2 = fma32(o, c, e * s)
        rot = _cvt_bf16(torch.stack((e2, o2), -1).flatten(-2))
        x = torch.where(is_rope, rot, x)
    amax = torch.where(torch.isnan(x), torch.zeros_like(x), x.abs()).amax(-1)
    w = index_weights[t, h].to(F32)
    S = torch.tensor(softmax_scale, dtype=F32)
    Hs = torch.tensor(head_scale, dtype=F32)
    lead = valid & (sub == 0)
    tv, hv, sv = t[valid], h[valid], sub[valid]
    if not use_fp4:
        amax = amax.view(-1, Gt).amax(-1).repeat_interleave(Gt)  # butterfly over the G threads
        qs, inv, _ = _scale(amax, 0x38D1B717, inv_const(448.0), 255)
        y = x * inv[:, None]
        y = torch.where(torch.isnan(y), torch.full_like(y, float("nan")), y)
        codes = torch.where(
            torch.isnan(y), torch.full_like(y, 0x7F, dtype=U8),
            y.clamp(-448, 448).to(torch.float8_e4m3fn).view(U8),
        )
        q_out.view(U8)[tv[:, None], hv[:, None], sv[:, None] * 16 + d16] = codes[valid]
        wo = ((w * qs) * S) * Hs
        weights_out[t[lead], h[lead]] = wo[lead].to(weights_out.dtype)
        return
    amax = amax.view(-1, 2).amax(-1).repeat_interleave(2)  # thread pairs
    _, inv, e = _scale(amax, 0x01C00000, inv_const(6.0), 254)
    y = x * inv[:, None]
    codes = _e2m1(y)
    packed = (codes[:, 0::2] | (codes[:, 1::2] << 4)).to(U8)  # [N, 8]
    q_out[tv[:, None], hv[:, None], sv[:, None] * 8 + torch.arange(8)] = packed[valid]
    ev = valid & (sub % 2 == 0)
    q_scale_out[t[ev], h[ev], sub[ev] // 2] = e[ev].to(U8)
    wo = (w * S) * Hs
    weights_out[t[lead], h[lead]] = wo[lead].to(weights_out.dtype)


def _indexer_inputs(T, H, D, R, cs_dtype, w_dtype, gen, nan=False):
    q = torch.randn(T, H, D, generator=gen) * torch.exp2(torch.randint(-12, 12, (T, H, 1), generator=gen).float())
    q[0, 0] = 0.0  # all-zero head -> amax floor
    q[0, 1, ::3] = -0.0
    if H > 2:
        q[-1, 2, 5] = 3.0e38  # huge NoPE value (bf16-finite)
        q[-1, 2, D - 3] = 1e-40  # subnormal in the RoPE part
    if nan:
        q[1 % T, 0, 7] = float("nan")
        q[1 % T, 1, D - 1] = float("nan")
        q[-1, 0, 3] = float("inf")  # amax inf -> q_scale inf
    q = q.to(BF16)
    max_pos = 300
    ang = torch.arange(max_pos)[:, None].float() * torch.exp2(-torch.arange(R // 2).float() / 4)[None]
    cs = torch.cat((torch.cos(ang), torch.sin(ang)), -1).to(cs_dtype)
    cs_store = torch.zeros(max_pos, R + 16, dtype=cs_dtype)
    cs_store[:, :R] = cs
    cos_sin = cs_store[:, :R]  # row stride R + 16
    positions = torch.randint(0, max_pos, (T,), generator=gen)
    w = (torch.randn(T, H, generator=gen) + 0.1).to(w_dtype)
    return positions, q, cos_sin, w


@pytest.mark.parametrize("T,H", [(1, 3), (5, 64), (33, 16)])
@pytest.mark.parametrize("cs_dtype", [F32, BF16])
@pytest.mark.parametrize("w_dtype", [BF16, F32])
def test_indexer_fp8_model_matches_reference(T, H, cs_dtype, w_dtype):
    gen = torch.Generator().manual_seed(T * 131 + H)
    D, R = 128, 64
    pos, q, cs, w = _indexer_inputs(T, H, D, R, cs_dtype, w_dtype, gen, nan=True)
    ss, hs = 128**-0.5, 0.3  # head_scale deliberately not a power of two
    outs = []
    for fn in (ref_indexer_q, None):
        q_out = torch.full((T, H, D), 0xA5, dtype=U8).view(torch.float8_e4m3fn)
        w_out = torch.full((T, H), -3.0, dtype=F32)
        empty = torch.empty(0, dtype=U8)
        if fn is None:
            model_indexer_q(pos, q, cs, w, ss, hs, False, q_out, empty, w_out)
        else:
            fn(pos, q, cs, w, ss, hs, False, False, q_out, empty, w_out)
        outs.append((q_out.view(U8).clone(), w_out.view(torch.int32).clone()))
    assert torch.equal(outs[0][0], outs[1][0])
    assert torch.equal(outs[0][1], outs[1][1])


@pytest.mark.parametrize("T,H", [(1, 3), (7, 64)])
@pytest.mark.parametrize("cs_dtype", [F32, BF16])
@pytest.mark.parametrize("wout_dtype", [F32, BF16])
def test_indexer_mxfp4_model_matches_reference(T, H, cs_dtype, wout_dtype):
    gen = torch.Generator().manual_seed(T * 7 + H)
    D, R = 128, 64
    pos, q, cs, w = _indexer_inputs(T, H, D, R, cs_dtype, BF16, gen, nan=False)
    ss, hs = 128**-0.5, 0.125
    outs = []
    for fn in (ref_indexer_q, None):
        q_out = torch.full((T, H, D // 2), 0xA5, dtype=U8)
        s_out = torch.full((T, H, D // 32), 0xA5, dtype=U8)
        w_out = torch.full((T, H), -3.0, dtype=wout_dtype)
        if fn is None:
            model_indexer_q(pos, q, cs, w, ss, hs, True, q_out, s_out, w_out)
        else:
            fn(pos, q, cs, w, ss, hs, True, False, q_out, s_out, w_out)
        outs.append((q_out.clone(), s_out.clone(), w_out.clone()))
    for a, b in zip(*outs):
        assert torch.equal(a.view(U8), b.view(U8))


@pytest.mark.parametrize("D,R", [(64, 32), (256, 64), (128, 0), (512, 128)])
def test_indexer_fp8_model_other_shapes(D, R):
    gen = torch.Generator().manual_seed(D + R)
    T, H = 6, 5
    pos, q, cs, w = _indexer_inputs(T, H, D, max(R, 2), F32, BF16, gen, nan=True)
    cs = cs[:, :R]
    outs = []
    for fn in (ref_indexer_q, None):
        q_out = torch.full((T, H, D), 0xA5, dtype=U8).view(torch.float8_e4m3fn)
        w_out = torch.full((T, H), -3.0, dtype=F32)
        empty = torch.empty(0, dtype=U8)
        if fn is None:
            model_indexer_q(pos, q, cs, w, 0.1, 0.3, False, q_out, empty, w_out)
        else:
            fn(pos, q, cs, w, 0.1, 0.3, False, False, q_out, empty, w_out)
        outs.append((q_out.view(U8).clone(), w_out.view(torch.int32).clone()))
    assert torch.equal(outs[0][0], outs[1][0]) and torch.equal(outs[0][1], outs[1][1])


@needs_cutlass
@pytest.mark.parametrize("D,R,fp4", [(64, 32, False), (256, 64, False), (128, 0, False), (512, 128, True)])
def test_indexer_other_shapes_compile(D, R, fp4):
    Q.compile_indexer_q("sm_90a", D, R, fp4=fp4)


def test_indexer_shapes():
    assert Q.shape_supported(128, 64, False) and Q.shape_supported(128, 64, True)
    assert Q.shape_supported(64, 32, False) and not Q.shape_supported(64, 32, True)
    assert not Q.shape_supported(128, 40, False) and not Q.shape_supported(96, 32, False)


# --------------------------------------------------------------------------------------
# 4c. Scale rule: bit-ceil of amax * RN32(1/M) == log-ceil of the reference, every bf16 amax
# --------------------------------------------------------------------------------------


def _all_bf16_amax():
    bits = torch.arange(0, 0x7F81, dtype=torch.int32)  # +0 .. +inf
    return (bits << 16).view(F32)


def test_scale_rule_fp8_exhaustive():
    from dsv41.core.codecs import ceil_log2, exp2i

    a = torch.cat((_all_bf16_amax(), torch.tensor([F32_1E_4])))
    qs, inv, _ = _scale(a, 0x38D1B717, inv_const(448.0), 255)
    am = a.clamp_min(F32_1E_4)
    ref = exp2i(ceil_log2(am / torch.full_like(am, 448.0)))
    assert torch.equal(_bits(qs), _bits(ref))
    fin = torch.isfinite(ref)
    # x * 2^-E == x / 2^E exactly (both one rounding of the same real); inf scale -> inv 0
    assert torch.equal(_bits(inv[fin] * ref[fin]), _bits(torch.ones_like(ref[fin])))
    assert torch.all(inv[~fin] == 0)


def test_scale_rule_mxfp4_exhaustive():
    from dsv41.core.codecs import ceil_log2, exp2i

    a = _all_bf16_amax()
    _, inv, e = _scale(a, 0x01C00000, inv_const(6.0), 254)
    am = a.clamp_min(6.0 * 2.0**-126)
    e_ref = ceil_log2(am * inv_const(6.0)).clamp(-127.0, 127.0)
    assert torch.equal(e, (e_ref + 127).long())
    assert torch.equal(_bits(inv), _bits(exp2i(-e_ref)))


def test_ptx_constants():
    assert Q._INV_448 == "0f%08X" % (_bits(torch.tensor(inv_const(448.0))).item())
    assert Q._INV_6 == "0f%08X" % (_bits(torch.tensor(inv_const(6.0))).item())
    assert Q._EPS_FP8 == "0f%08X" % (_bits(torch.tensor(F32_1E_4)).item())
    assert Q._EPS_FP4 == "0f%08X" % (_bits(torch.tensor(6.0 * 2.0**-126)).item())
    for lit, v in [("0f3E800000", 0.25), ("0f3F400000", 0.75), ("0f3FA00000", 1.25), ("0f3FE00000", 1.75),
                   ("0f40200000", 2.5), ("0f40600000", 3.5), ("0f40A00000", 5.0)]:
        assert lit in Q._FP4_2WORDS and struct.unpack("<f", bytes.fromhex(lit[2:])[::-1])[0] == v


# --------------------------------------------------------------------------------------
# 5. On a GPU (python -m pytest -m gpu tests/test_cutedsl_aot.py): the real kernels vs the
#    reference on the same device, odd alignments, no recompiles, CUDA-graph replay.
# --------------------------------------------------------------------------------------

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def _gpu_gather_case(width, with_gather_lens, misalign=False, interleaved=False):
    """(out, cache for the kernel, seq_lens, gather_lens, block_table, block_size, offset, paged
    cache for the reference): the kernel's cache holds the paged cache's records in its layout."""
    gen = torch.Generator().manual_seed(11 * width + with_gather_lens)
    block_size, num_blocks = 16, 24
    k_cache = _make_cache(width, num_blocks, block_size, pad=40 + (1 if misalign else 0), gen=gen)
    k_kern = _interleave(k_cache) if interleaved else k_cache
    seq_lens = torch.tensor([37, 1, 100, 64, 250], dtype=I32)
    gather_lens = torch.tensor([37, 1, 45, 0, 200], dtype=I32) if with_gather_lens else None
    if not with_gather_lens:
        seq_lens[4] = 200
    bt_store = torch.randint(0, num_blocks, (5, 19), generator=gen, dtype=I32)
    block_table = bt_store[:, 2:18]
    offset, rows = 5, 220
    out = torch.full((6, rows, 512 + (1 if misalign else 0)), -7.25, dtype=BF16)
    if misalign:
        out = out[:, :, 1:]
    dev = lambda x: None if x is None else x.cuda()  # noqa: E731
    kc = k_kern.cuda() if not misalign else _to_cuda_view(k_kern)
    out = out.cuda() if not misalign else _to_cuda_view(out)
    return out, kc, dev(seq_lens), dev(gather_lens), dev(block_table), block_size, offset, k_cache.cuda()


def _to_cuda_view(t):
    """A CUDA tensor with t's exact strides and storage offset."""
    base = torch.empty(t.untyped_storage().nbytes() // t.element_size(), dtype=t.dtype, device="cuda")
    base.copy_(torch.as_strided(t, (base.numel(),), (1,), 0))
    return base.as_strided(t.shape, t.stride(), t.storage_offset())


@pytest.mark.gpu
@needs_cuda
@needs_cutlass
@pytest.mark.parametrize("width,interleaved", LAYOUTS, ids=LAYOUT_IDS)
@pytest.mark.parametrize("with_gather_lens", [True, False])
@pytest.mark.parametrize("misalign", [False, True])
def test_gpu_gather_matches_reference(width, interleaved, with_gather_lens, misalign):
    out, kc, sl, gl, bt, bs, off, paged = _gpu_gather_case(width, with_gather_lens, misalign, interleaved)
    exp = out.clone()
    ref_gather(exp, paged, sl, gl, bt, bs, off, False)
    G.dequantize_and_gather_k_cache(out, kc, sl, gl, bt, bs, off, False, interleaved)
    torch.cuda.synchronize()
    assert torch.equal(out.view(torch.int16), exp.view(torch.int16))
    # CUDA graph: capture once, change the lengths on the device, replay
    g = torch.cuda.CUDAGraph()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s), torch.cuda.graph(g, stream=s):
        G.dequantize_and_gather_k_cache(out, kc, sl, gl, bt, bs, off, False, interleaved)
    torch.cuda.current_stream().wait_stream(s)
    (gl if gl is not None else sl)[0] -= 5
    out.fill_(3.0)
    exp = out.clone()
    ref_gather(exp, paged, sl, gl, bt, bs, off, False)
    n_compiled = len(G._COMPILED)
    g.replay()
    torch.cuda.synchronize()
    assert torch.equal(out.view(torch.int16), exp.view(torch.int16))
    assert len(G._COMPILED) == n_compiled


@pytest.mark.gpu
@needs_cuda
@needs_cutlass
@pytest.mark.parametrize("fp4", [False, True])
@pytest.mark.parametrize("cs_dtype", [F32, BF16])
@pytest.mark.parametrize("T", [1, 9, 1000])
def test_gpu_indexer_matches_reference(fp4, cs_dtype, T):
    gen = torch.Generator().manual_seed(T + 3 * fp4)
    H, D, R = 64, 128, 64
    pos, q, cs, w = (x.cuda() for x in _indexer_inputs(T, H, D, R, cs_dtype, BF16, gen, nan=not fp4))
    ss, hs = 128**-0.5, 0.125
    res = []
    for fn in (ref_indexer_q, Q.fused_indexer_q_rope_quant):
        if fp4:
            q_out = torch.full((T, H, D // 2), 0xA5, dtype=U8, device="cuda")
            s_out = torch.full((T, H, D // 32), 0xA5, dtype=U8, device="cuda")
            w_out = torch.full((T, H), -3.0, dtype=BF16, device="cuda")
        else:
            q_out = torch.full((T, H, D), 0xA5, dtype=U8, device="cuda").view(torch.float8_e4m3fn)
            s_out = torch.empty(0, dtype=U8, device="cuda")
            w_out = torch.full((T, H), -3.0, dtype=F32, device="cuda")
        fn(pos, q, cs, w, ss, hs, fp4, False, q_out, s_out, w_out)
        res.append((q_out.view(U8).clone(), s_out.clone(), w_out.view(torch.int16 if fp4 else torch.int32).clone()))
    torch.cuda.synchronize()
    for a, b in zip(*res):
        assert torch.equal(a, b)


def test_unsupported_reason_guards():
    kc584 = torch.zeros(1, 4, 584, dtype=U8)
    kc288 = torch.zeros(1, 4, 288, dtype=U8)
    table = torch.zeros(1, 2, dtype=torch.int32)
    args = lambda kc, fnuz, table=table: (None, kc, None, None, table, 4, 0, fnuz)  # noqa: E731
    assert G.unsupported_reason(*args(kc584, False)) is None
    assert G.unsupported_reason(*args(kc584[:0], False)) and G.unsupported_reason(*args(kc584, False, table[:, :0]))
    assert G.unsupported_reason(*args(kc584, True)) and G.unsupported_reason(*args(kc288, False))
    kc528 = torch.zeros(1, 4, 528, dtype=U8)
    assert G.unsupported_reason(*args(kc528, False), True) is None
    assert G.unsupported_reason(*args(kc584, False), True) and G.unsupported_reason(*args(kc288, False), True)
    q = torch.zeros(2, 3, 128, dtype=BF16)
    cs = torch.zeros(10, 64)
    qa = lambda fp4, fnuz, cs=cs: (None, q, cs, None, 1.0, 1.0, fp4, fnuz, None, None, None)  # noqa: E731
    assert Q.unsupported_reason(*qa(False, False)) is None and Q.unsupported_reason(*qa(True, False)) is None
    assert Q.unsupported_reason(*qa(True, True)) is None  # FNUZ is ignored on the MXFP4 path
    assert Q.unsupported_reason(*qa(False, True))
    assert Q.unsupported_reason(*qa(False, False, torch.zeros(10, 40)))


def test_unsupported_calls_go_to_triton(monkeypatch):
    """FNUZ caches, the 288 record, FNUZ FP8 output and odd widths are handed, unchanged, to the
    Triton launcher of the same op (checked on CPU tensors with a stub in its place)."""
    calls = []
    monkeypatch.setitem(G._FALLBACK, "dequantize_and_gather_k_cache", lambda *a: calls.append(("g", a)))
    monkeypatch.setitem(G._FALLBACK, "fused_indexer_q_rope_quant", lambda *a: calls.append(("q", a)))
    kc584 = torch.zeros(1, 4, 584, dtype=U8)
    kc528 = torch.zeros(1, 4, 528, dtype=U8)
    kc288 = torch.zeros(1, 4, 288, dtype=U8)
    for kc, fnuz, il in ((kc584, True, False), (kc288, False, False), (kc288, False, True), (kc528, True, True),
                         (kc584, False, True)):
        args = (torch.zeros(1, 4, 512, dtype=BF16), kc, torch.ones(1, dtype=I32), None,
                torch.zeros(1, 1, dtype=I32), 4, 0, fnuz)
        G.dequantize_and_gather_k_cache(*args, il)
        got = calls[-1][1]
        assert calls[-1][0] == "g" and len(got) == 9 and all(x is y for x, y in zip(got, args)) and got[8] is il
    q = torch.zeros(2, 3, 128, dtype=BF16)
    for cs, fnuz in ((torch.zeros(10, 64), True), (torch.zeros(10, 40), False)):
        args = (torch.zeros(2, dtype=torch.int64), q, cs, torch.zeros(2, 3, dtype=BF16), 1.0, 1.0, False, fnuz,
                torch.zeros(2, 3, 128, dtype=U8), torch.empty(0, dtype=U8), torch.zeros(2, 3))
        Q.fused_indexer_q_rope_quant(*args)
        assert calls[-1][0] == "q" and all(x is y for x, y in zip(calls[-1][1], args))
    assert len(calls) == 7


def test_triton_fallback_resolves():
    pytest.importorskip("triton")
    for op in ("dequantize_and_gather_k_cache", "fused_indexer_q_rope_quant"):
        G._FALLBACK.pop(op, None)
        assert callable(G.triton_fallback(op))
