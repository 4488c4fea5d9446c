"""CuTe DSL kernel: ``fused_indexer_q_rope_quant`` (spec rope_quant_ops.md §2), FP8 and MXFP4.

Per (token t, head h) of ``index_q [T, H, D]`` (bf16): GPT-J RoPE on the last R dims at
``positions[t]``, bf16 round trip of the rotated values, then

* FP8 (OCP e4m3fn, max 448): one power-of-two scale per head, the q scale folded into
  ``weights_out = RN32(RN32(RN32(w * q_scale) * S) * Hs)`` (fp32);
* MXFP4: per-32 ue8m0 scales, e2m1 codes packed two per byte (even dim in the low nibble),
  ``weights_out = RN32(RN32(w * S) * Hs)`` (fp32 or bf16).

Numerics follow OUR reference (``dsv41.reference.indexer``) bit for bit, not vLLM's CuteDSL
kernel (§2.5): the indexer-Q RoPE contraction ``e' = fma(e, c, -RN32(o*s))``,
``o' = fma(e, s, RN32(o*c))`` written as explicit ``mul.rn`` / ``fma.rn`` (so neither LLVM nor
ptxas can re-associate or fuse differently), the Triton-style three-rounding weight fold with
``S = RN32(softmax_scale)``, ``Hs = RN32(head_scale)``, and the scale exponent by bit-ceil of
``amax * RN32(1/M)`` — equal to the reference's log-ceil of ``amax / M`` for every bf16-valued
amax (§1.5; the test suite re-checks this exhaustively).  amax ignores NaN (PTX ``max.f32``);
no flush-to-zero anywhere.  FP8 codes come from ``cvt.rn.satfinite.e4m3x2.f32`` (NaN forced to
+NaN first, so NaN -> 0x7F as in ``codecs.e4m3_encode``).  e2m1 codes are computed with float
compares (the reference's threshold staircase, ties to the even code, sign bit kept), so the
MXFP4 path needs no SM100 FP4 convert and runs on SM90 too.

**OCP only**: the CuTe kernel does not write e4m3fnuz / 224 (``SUPPORTS_FNUZ`` is False); an
FP8 call with ``use_fnuz=True``, or a head / rope width outside ``shape_supported``, is handed
unchanged to the Triton kernel of the same op (``unsupported_reason`` says why), so the op never
raises for them.

Supported shapes: ``D % 16 == 0``, ``R % 16 == 0`` (so the NoPE width is a multiple of 16),
``D / 16`` a power of two <= 32 (production: D = 128, R = 64); MXFP4 additionally needs the
public layer's ``D % 128 == 0`` and ``NOPE % 32 == 0``.  ``shape_supported`` says whether a
call fits.

Thread mapping: ``G = D/16`` threads per head, each owning 16 consecutive dims (two 16-byte
loads of q; a RoPE thread also loads its 8 cos and 8 sin values); 128 threads per CTA =
``128/G`` heads.  The FP8 head amax is a butterfly over the G threads; an MXFP4 block (32 dims)
is a pair of threads.  Threads past ``T*H`` recompute the last head (so every lane joins the
shuffles) and store nothing.  Compiled once per (arch, D, R, dtypes of cos/sin, weights,
positions and weights_out, path, alignment class); T, H, strides and scales are runtime
arguments.
"""

import struct

import torch

from dsv41.core.formats import scale_byte_strides

from .cutedsl_gather import (
    FastLaunch,
    alignment,
    compile_options,
    device_arch,
    device_index,
    ld_words,
    scale4_ptx,
    st_words,
    to_global,
    sel_u32,
    triton_fallback,
    _LOCK,
)

__all__ = [
    "fused_indexer_q_rope_quant",
    "unsupported_reason",
    "SUPPORTS_FNUZ",
    "compile_indexer_q",
    "aot_variants",
    "shape_supported",
    "head_mapping",
]

SUPPORTS_FNUZ = False
THREADS = 128


def _f32_hex(v: float) -> str:
    """PTX hex literal of RN32(v)."""
    return "0f%08X" % struct.unpack("<I", struct.pack("<f", v))[0]


_INV_448 = _f32_hex(1.0 / 448.0)
_INV_6 = _f32_hex(1.0 / 6.0)
_EPS_FP8 = _f32_hex(1e-4)  # fl32(1e-4) = 0x38D1B717
_EPS_FP4 = "0f01C00000"  # 6 * 2^-126


def shape_supported(head_dim: int, rope_dim: int, use_fp4: bool) -> bool:
    g = head_dim // 16
    ok = head_dim % 16 == 0 and rope_dim % 16 == 0 and 0 <= rope_dim <= head_dim and 1 <= g <= 32 and g & (g - 1) == 0
    if use_fp4:
        ok = ok and head_dim % 128 == 0 and (head_dim - rope_dim) % 32 == 0
    return ok


def head_mapping(head_dim: int, block, tid, num_heads_total, num_heads, minimum):
    """Thread -> (head, token, head index, sub-thread, valid) of the kernel.

    Works on Python ints / torch tensors (``minimum`` = their min) or DSL values.  Threads past
    the last head are clamped onto it (``valid`` false)."""
    g = head_dim // 16
    hpc = THREADS // g
    hid = block * hpc + tid // g
    sub = tid % g
    valid = hid < num_heads_total
    hidc = minimum(hid, num_heads_total - 1)
    t = hidc // num_heads
    h = hidc - t * num_heads
    return t, h, sub, valid


# --------------------------------------------------------------------------------------
# PTX blocks
# --------------------------------------------------------------------------------------

# RoPE of one bf16x2 word (e = low half, o = high half) by (c, s), the indexer-Q contraction
# (e' = fma(e, c, -RN(o*s)), o' = fma(e, s, RN(o*c))), result rounded back to bf16x2 (RNE).
_ROPE_WORD = """{
.reg .b32 a, b;
.reg .f32 e, o, t0, t1, e2, o2;
shl.b32 a, {$r0}, 16;
and.b32 b, {$r0}, 0xFFFF0000;
mov.b32 e, a;
mov.b32 o, b;
mul.rn.f32 t0, o, {$r2};
neg.f32 t0, t0;
fma.rn.f32 e2, e, {$r1}, t0;
mul.rn.f32 t1, o, {$r1};
fma.rn.f32 o2, e, {$r2}, t1;
cvt.rn.bf16x2.f32 {$w0}, o2, e2;
}"""

# acc' = max(acc, |lo|, |hi|) of a bf16x2 word (max.f32 ignores NaN).
_AMAX_WORD = """{
.reg .b32 a, b;
.reg .f32 fa, fb;
shl.b32 a, {$r0}, 16;
and.b32 b, {$r0}, 0xFFFF0000;
mov.b32 fa, a;
mov.b32 fb, b;
abs.f32 fa, fa;
abs.f32 fb, fb;
max.f32 fa, fa, fb;
max.f32 {$w0}, {$r1}, fa;
}"""

_FMAX = "max.f32 {$w0}, {$r0}, {$r1};"

# amax -> (2^E as fp32, 2^-E as fp32 [0 when E >= 127], E + 127 clamped to <= CLAMP) with
# s = max(amax, EPS) * INV and E = bit-ceil(log2 s).
_SCALE = """{{
.reg .f32 a, s;
.reg .b32 b, e, ei;
max.f32 a, {{$r0}}, {eps};
mul.rn.f32 s, a, {inv};
mov.b32 b, s;
add.u32 b, b, 0x7FFFFF;
shr.u32 e, b, 23;
min.u32 e, e, {clamp};
shl.b32 b, e, 23;
mov.b32 {{$w0}}, b;
min.u32 ei, e, 254;
sub.u32 ei, 254, ei;
shl.b32 ei, ei, 23;
mov.b32 {{$w1}}, ei;
mov.b32 {{$w2}}, e;
}}"""
_SCALE_FP8 = _SCALE.format(eps=_EPS_FP8, inv=_INV_448, clamp=255)
_SCALE_FP4 = _SCALE.format(eps=_EPS_FP4, inv=_INV_6, clamp=254)

# Two bf16x2 words times inv -> four e4m3 bytes (one word, element 0 in the low byte).
_FP8_2WORDS = """{
.reg .b32 a0, a1, a2, a3;
.reg .f32 f0, f1, f2, f3;
.reg .b16 h0, h1;
.reg .pred n0, n1, n2, n3;
shl.b32 a0, {$r0}, 16;
and.b32 a1, {$r0}, 0xFFFF0000;
shl.b32 a2, {$r1}, 16;
and.b32 a3, {$r1}, 0xFFFF0000;
mov.b32 f0, a0;
mov.b32 f1, a1;
mov.b32 f2, a2;
mov.b32 f3, a3;
""" + scale4_ptx("{$r2}") + """cvt.rn.satfinite.e4m3x2.f32 h0, f1, f0;
cvt.rn.satfinite.e4m3x2.f32 h1, f3, f2;
mov.b32 {$w0}, {h0, h1};
}"""


def _e2m1_ptx(src: str, dst: str) -> str:
    """PTX computing the e2m1 code of fp32 register ``src`` into b32 register ``dst``
    (threshold staircase of codecs.e2m1_encode; NaN -> 0 | sign)."""
    steps = [
        ("gt", "0f3E800000"),  # 0.25
        ("ge", "0f3F400000"),  # 0.75
        ("gt", "0f3FA00000"),  # 1.25
        ("ge", "0f3FE00000"),  # 1.75
        ("gt", "0f40200000"),  # 2.5
        ("ge", "0f40600000"),  # 3.5
        ("gt", "0f40A00000"),  # 5.0
    ]
    lines = [f"abs.f32 ab, {src};", f"set.{steps[0][0]}.u32.f32 {dst}, ab, {steps[0][1]};"]
    for op, lit in steps[1:]:
        lines.append(f"set.{op}.u32.f32 tt, ab, {lit};")
        lines.append(f"add.u32 {dst}, {dst}, tt;")
    lines += [
        f"neg.s32 {dst}, {dst};",
        f"mov.b32 tt, {src};",
        "shr.u32 tt, tt, 28;",
        "and.b32 tt, tt, 8;",
        f"or.b32 {dst}, {dst}, tt;",
    ]
    return "\n".join(lines)


# Two bf16x2 words times inv -> four e2m1 codes in bits 0..15 (element k in nibble k).
_FP4_2WORDS = (
    "{\n.reg .b32 a0, a1, a2, a3, c0, c1, c2, c3, tt;\n.reg .f32 f0, f1, f2, f3, ab;\n"
    "shl.b32 a0, {$r0}, 16;\nand.b32 a1, {$r0}, 0xFFFF0000;\n"
    "shl.b32 a2, {$r1}, 16;\nand.b32 a3, {$r1}, 0xFFFF0000;\n"
    "mov.b32 f0, a0;\nmov.b32 f1, a1;\nmov.b32 f2, a2;\nmov.b32 f3, a3;\n"
    "mul.rn.f32 f0, f0, {$r2};\nmul.rn.f32 f1, f1, {$r2};\n"
    "mul.rn.f32 f2, f2, {$r2};\nmul.rn.f32 f3, f3, {$r2};\n"
    + "\n".join(_e2m1_ptx(f"f{k}", f"c{k}") for k in range(4))
    + "\nbfi.b32 c0, c1, c0, 4, 4;\nbfi.b32 c0, c2, c0, 8, 4;\nbfi.b32 {$w0}, c3, c0, 12, 4;\n}"
)

_BF16_LO = "{ .reg .b32 t; shl.b32 t, {$r0}, 16; mov.b32 {$w0}, t; }"
_BF16_HI = "{ .reg .b32 t; and.b32 t, {$r0}, 0xFFFF0000; mov.b32 {$w0}, t; }"
_AS_F32 = "mov.b32 {$w0}, {$r0};"
_MUL = "mul.rn.f32 {$w0}, {$r0}, {$r1};"

# Runtime argument kinds of the host function (stream last, implicit).
_Q_ARGS = (
    "i64", "i64", "i64", "i64",  # index_q, positions, cos_sin_cache, index_weights
    "i64", "i64", "i64",  # q_out, q_scale_out, weights_out
    "i64", "i64",  # index_q strides 0, 1 (bytes)
    "i64",  # positions stride (bytes)
    "i64",  # cos_sin_cache stride 0 (bytes)
    "i64", "i64",  # index_weights strides (bytes)
    "i64", "i64",  # q_out strides (bytes)
    "i64", "i64",  # q_scale_out strides (bytes)
    "i64", "i64",  # weights_out strides (bytes)
    "i32", "i32",  # T, H
    "f32", "f32",  # RN32(softmax_scale), RN32(head_scale)
    "i32",  # cos_sin_cache.shape[0] (rows a position may name)
    "i32",  # grid x
)


def _make_indexer_q(D: int, R: int, cs_bf16: bool, w_bf16: bool, pos_i64: bool, fp4: bool,
                    wout_bf16: bool, align_q: int, align_cs: int, align_qo: int):
    import cuda.bindings.driver as cuda
    import cutlass
    import cutlass.cute as cute
    from cutlass import Float32, Int32, Int64, Uint32
    from cutlass.cute.arch import inline_ptx

    G = D // 16
    NOPE_T = (D - R) // 16  # threads of a head that hold NoPE dims only
    cs_es = 2 if cs_bf16 else 4
    BFLY = tuple(G >> (k + 1) for k in range(G.bit_length() - 1))  # G/2, G/4, ..., 1

    def f32(ptx, *args):
        return inline_ptx(ptx, write_only_types=[Float32], read_only_args=list(args))

    def u32(ptx, *args):
        return inline_ptx(ptx, write_only_types=[Uint32], read_only_args=list(args))

    @cute.kernel
    def q_kernel(
        q: Int64, positions: Int64, cos_sin: Int64, weights: Int64,
        q_out: Int64, scale_out: Int64, w_out: Int64,
        q_s0: Int64, q_s1: Int64, pos_s: Int64, cs_s0: Int64, w_s0: Int64, w_s1: Int64,
        qo_s0: Int64, qo_s1: Int64, so_s0: Int64, so_s1: Int64, wo_s0: Int64, wo_s1: Int64,
        T: Int32, H: Int32, s_scale: Float32, h_scale: Float32, cs_rows: Int32,
    ):
        tid, _, _ = cute.arch.thread_idx()
        bx, _, _ = cute.arch.block_idx()
        t, h, sub, valid = head_mapping(D, bx, tid, T * H, H, cutlass.min)
        t64 = Int64(t)
        h64 = Int64(h)

        # 16 bf16 of q (8 bf16x2 words)
        xw = ld_words(to_global(q) + t64 * q_s0 + h64 * q_s1 + Int64(sub * 32), 32, align_q)

        if cutlass.const_expr(R > 0):
            is_rope = sub >= NOPE_T
            k = cutlass.max(sub - NOPE_T, 0)  # NoPE threads read row start (valid), unused
            if cutlass.const_expr(pos_i64):
                p = inline_ptx(
                    "ld.global.nc.s64 {$w0}, [{$r0}];", write_only_types=[Int64],
                    read_only_args=[to_global(positions) + t64 * pos_s],
                )
            else:
                p = Int64(inline_ptx(
                    "ld.global.nc.s32 {$w0}, [{$r0}];", write_only_types=[Int32],
                    read_only_args=[to_global(positions) + t64 * pos_s],
                ))
            # a position outside the table reads its nearest row, as in the Triton kernel
            # (docs/bad_input.md)
            p = cutlass.min(cutlass.max(p, Int64(0)), Int64(cs_rows) - Int64(1))
            row = to_global(cos_sin) + p * cs_s0
            cw = ld_words(row + Int64(k * 8 * cs_es), 8 * cs_es, align_cs)
            sw = ld_words(row + Int64((R // 2) * cs_es) + Int64(k * 8 * cs_es), 8 * cs_es, align_cs)
            rot = []
            for i in cutlass.range_constexpr(8):
                if cutlass.const_expr(cs_bf16):
                    c = f32(_BF16_LO if i % 2 == 0 else _BF16_HI, cw[i // 2])
                    s = f32(_BF16_LO if i % 2 == 0 else _BF16_HI, sw[i // 2])
                else:
                    c = f32(_AS_F32, cw[i])
                    s = f32(_AS_F32, sw[i])
                rot.append(u32(_ROPE_WORD, xw[i], c, s))
            xw = [sel_u32(is_rope, rot[i], xw[i]) for i in range(8)]

        # weight of (t, h)
        w_addr = to_global(weights) + t64 * w_s0 + h64 * w_s1
        if cutlass.const_expr(w_bf16):
            wv = f32(
                "{ .reg .b32 t; ld.global.nc.u16 t, [{$r0}]; shl.b32 t, t, 16; mov.b32 {$w0}, t; }",
                w_addr,
            )
        else:
            wv = f32("ld.global.nc.f32 {$w0}, [{$r0}];", w_addr)
        wo_addr = to_global(w_out) + t64 * wo_s0 + h64 * wo_s1
        lead = valid & (sub == 0)

        amax = Float32(0.0)
        for i in cutlass.range_constexpr(8):
            amax = f32(_AMAX_WORD, xw[i], amax)

        if cutlass.const_expr(not fp4):
            # FP8: one scale per head (G threads)
            for j in cutlass.range_constexpr(len(BFLY)):
                amax = f32(_FMAX, amax, cute.arch.shuffle_sync_bfly(amax, offset=BFLY[j]))
            qscale, inv, _ = inline_ptx(
                _SCALE_FP8, write_only_types=[Float32, Float32, Uint32], read_only_args=[amax]
            )
            codes = [u32(_FP8_2WORDS, xw[2 * j], xw[2 * j + 1], inv) for j in range(4)]
            st_words(to_global(q_out) + t64 * qo_s0 + h64 * qo_s1 + Int64(sub * 16), codes, align_qo, pred=valid)
            wo = f32(_MUL, f32(_MUL, f32(_MUL, wv, qscale), s_scale), h_scale)
            inline_ptx("st.global.f32 [{$r0}], {$r1};", read_only_args=[wo_addr, wo], predicate=lead)
        else:
            # MXFP4: one scale per 32 dims (thread pair)
            amax = f32(_FMAX, amax, cute.arch.shuffle_sync_bfly(amax, offset=1))
            _, inv, sbyte = inline_ptx(
                _SCALE_FP4, write_only_types=[Float32, Float32, Uint32], read_only_args=[amax]
            )
            halves = [u32(_FP4_2WORDS, xw[2 * j], xw[2 * j + 1], inv) for j in range(4)]
            packed = [
                u32("bfi.b32 {$w0}, {$r1}, {$r0}, 16, 16;", halves[0], halves[1]),
                u32("bfi.b32 {$w0}, {$r1}, {$r0}, 16, 16;", halves[2], halves[3]),
            ]
            st_words(to_global(q_out) + t64 * qo_s0 + h64 * qo_s1 + Int64(sub * 8), packed, min(align_qo, 8), pred=valid)
            inline_ptx(
                "st.global.u8 [{$r0}], {$r1};",
                read_only_args=[to_global(scale_out) + t64 * so_s0 + h64 * so_s1 + Int64(sub // 2), sbyte],
                predicate=valid & (sub % 2 == 0),
            )
            wo = f32(_MUL, f32(_MUL, wv, s_scale), h_scale)
            if cutlass.const_expr(wout_bf16):
                wb = u32("{ .reg .b16 t; cvt.rn.bf16.f32 t, {$r0}; cvt.u32.u16 {$w0}, t; }", wo)
                inline_ptx("st.global.u16 [{$r0}], {$r1};", read_only_args=[wo_addr, wb], predicate=lead)
            else:
                inline_ptx("st.global.f32 [{$r0}], {$r1};", read_only_args=[wo_addr, wo], predicate=lead)

    @cute.jit
    def q_host(
        q: Int64, positions: Int64, cos_sin: Int64, weights: Int64,
        q_out: Int64, scale_out: Int64, w_out: Int64,
        q_s0: Int64, q_s1: Int64, pos_s: Int64, cs_s0: Int64, w_s0: Int64, w_s1: Int64,
        qo_s0: Int64, qo_s1: Int64, so_s0: Int64, so_s1: Int64, wo_s0: Int64, wo_s1: Int64,
        T: Int32, H: Int32, s_scale: Float32, h_scale: Float32, cs_rows: Int32, grid_x: Int32,
        stream: cuda.CUstream,
    ):
        q_kernel(
            q, positions, cos_sin, weights, q_out, scale_out, w_out,
            q_s0, q_s1, pos_s, cs_s0, w_s0, w_s1, qo_s0, qo_s1, so_s0, so_s1, wo_s0, wo_s1,
            T, H, s_scale, h_scale, cs_rows,
        ).launch(grid=[grid_x, 1, 1], block=[THREADS, 1, 1], stream=stream)

    return q_kernel, q_host


_COMPILED: dict = {}


def _example_args():
    from cutlass import Float32, Int32, Int64

    return [Int64(0)] * 19 + [Int32(1), Int32(1), Float32(1.0), Float32(1.0), Int32(1), Int32(1)]


def compile_indexer_q(arch: str, D: int = 128, R: int = 64, cs_bf16: bool = False, w_bf16: bool = True,
                      pos_i64: bool = True, fp4: bool = False, wout_bf16: bool = False,
                      align_q: int = 16, align_cs: int = 16, align_qo: int = 16):
    """Compile (or fetch) one variant for ``arch``; needs no GPU.  Returns a ``FastLaunch``."""
    if not shape_supported(D, R, fp4):
        raise ValueError(f"cuda:cutedsl fused_indexer_q_rope_quant: unsupported head_dim {D} / rope {R}")
    if not fp4:
        wout_bf16 = False
    key = (arch, D, R, cs_bf16, w_bf16, pos_i64, fp4, wout_bf16, align_q, align_cs, align_qo)
    fn = _COMPILED.get(key)
    if fn is not None:
        return fn
    with _LOCK:
        fn = _COMPILED.get(key)
        if fn is None:
            import cutlass.cute as cute
            from cutlass.cute.runtime import make_fake_stream

            _, host = _make_indexer_q(D, R, cs_bf16, w_bf16, pos_i64, fp4, wout_bf16, align_q, align_cs, align_qo)
            compiled = cute.compile[compile_options(arch)](host, *_example_args(), make_fake_stream())
            fn = _COMPILED[key] = FastLaunch(compiled, _Q_ARGS)
    return fn


def aot_variants():
    """(name, builder(arch)) pairs that ``cutedsl_aot.compile_all`` builds."""
    out = []
    for fp4 in (False, True):
        for cs_bf16 in (False, True):
            for w_bf16 in (True, False):
                wouts = (False, True) if fp4 else (False,)
                for wout_bf16 in wouts:
                    name = (
                        f"indexer_q[{'mxfp4' if fp4 else 'fp8'},D128,R64,cs={'bf16' if cs_bf16 else 'f32'},"
                        f"w={'bf16' if w_bf16 else 'f32'},wout={'bf16' if wout_bf16 else 'f32'}]"
                    )
                    out.append((name, lambda arch, a=fp4, b=cs_bf16, c=w_bf16, d=wout_bf16: compile_indexer_q(
                        arch, 128, 64, b, c, True, a, d)))
    out.append(("indexer_q[fp8,D128,R64,pos=i32,unaligned]",
                lambda arch: compile_indexer_q(arch, 128, 64, False, True, False, False, False, 2, 4, 1)))
    out.append(("indexer_q[mxfp4,D128,R64,pos=i32,unaligned]",
                lambda arch: compile_indexer_q(arch, 128, 64, True, True, False, True, True, 2, 2, 1)))
    return out


_SCALES: dict = {}


def _rn32(v: float) -> float:
    r = _SCALES.get(v)
    if r is None:
        r = _SCALES[v] = float(torch.tensor(v, dtype=torch.float32))
    return r


def unsupported_reason(positions, index_q, cos_sin_cache, index_weights, softmax_scale, head_scale,
                       use_fp4, use_fnuz, q_out, q_scale_out, weights_out):
    """None when the CuTe kernel handles the call (kernel-contract arguments), else why the
    launcher hands it to the Triton kernel (FNUZ FP8 output, widths outside ``shape_supported``).
    The sheet's ``input_limits`` names this function."""
    if use_fnuz and not use_fp4:
        return "cuda:cutedsl indexer Q writes OCP e4m3fn only (use_fnuz=True)"
    D, R = index_q.shape[-1], cos_sin_cache.shape[-1]
    if not shape_supported(D, R, bool(use_fp4)):
        return f"cuda:cutedsl indexer Q: unsupported head_dim {D} / rope_dim {R}"
    return None


def fused_indexer_q_rope_quant(
    positions, index_q, cos_sin_cache, index_weights, softmax_scale: float, head_scale: float,
    use_fp4: bool, use_fnuz: bool, q_out, q_scale_out, weights_out,
) -> None:
    """Kernel-contract entry (docs/kernel_contract.md).

    Calls outside ``unsupported_reason`` (FNUZ FP8 output, unsupported widths) go to the
    Triton kernel."""
    T, H, D = index_q.shape
    R = cos_sin_cache.shape[-1]
    fp4 = bool(use_fp4)
    if unsupported_reason(positions, index_q, cos_sin_cache, index_weights, softmax_scale, head_scale,
                          use_fp4, use_fnuz, q_out, q_scale_out, weights_out) is not None:
        return triton_fallback("fused_indexer_q_rope_quant")(
            positions, index_q, cos_sin_cache, index_weights, softmax_scale, head_scale,
            use_fp4, use_fnuz, q_out, q_scale_out, weights_out,
        )
    if T == 0 or H == 0:
        return
    idx = device_index(index_q.device)
    cs_es = cos_sin_cache.element_size()
    w_es = index_weights.element_size()
    wo_es = weights_out.element_size()
    q_ptr, cs_ptr, qo_ptr = index_q.data_ptr(), cos_sin_cache.data_ptr(), q_out.data_ptr()
    qs0, qs1, _ = index_q.stride()
    q_s0, q_s1 = 2 * qs0, 2 * qs1
    cs_s0 = cs_es * cos_sin_cache.stride(0)
    qo_es = q_out.element_size()
    qos = q_out.stride()
    qo_s0, qo_s1 = qo_es * qos[0], qo_es * qos[1]
    ws = index_weights.stride()
    wos = weights_out.stride()
    fn = compile_indexer_q(
        device_arch(idx), D, R, cos_sin_cache.dtype == torch.bfloat16, index_weights.dtype == torch.bfloat16,
        positions.dtype == torch.int64, fp4, fp4 and weights_out.dtype == torch.bfloat16,
        alignment(q_ptr, q_s0, q_s1), alignment(cs_ptr, cs_s0), alignment(qo_ptr, qo_s0, qo_s1),
    )
    if fp4:
        so_ptr = q_scale_out.data_ptr()
        so_s0, so_s1 = scale_byte_strides(q_scale_out)
    else:
        so_ptr, so_s0, so_s1 = 0, 0, 0
    heads = T * H
    hpc = THREADS // (D // 16)
    fn(
        (
            q_ptr, positions.data_ptr(), cs_ptr, index_weights.data_ptr(),
            qo_ptr, so_ptr, weights_out.data_ptr(),
            q_s0, q_s1, positions.element_size() * positions.stride(0), cs_s0,
            w_es * ws[0], w_es * ws[1], qo_s0, qo_s1, so_s0, so_s1, wo_es * wos[0], wo_es * wos[1],
            T, H, _rn32(float(softmax_scale)), _rn32(float(head_scale)), cos_sin_cache.shape[0],
            -(-heads // hpc),
        ),
        torch.cuda.current_stream(idx).cuda_stream,
        idx,
    )
