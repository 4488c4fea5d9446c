"""CuTe DSL kernel: ``dequantize_and_gather_k_cache`` for the fp8 records (spec cache_ops.md §4).

Records (``k_cache.shape[-1]``):

* 584 (V4 "fp8_ds_mla"): 448 e4m3 values x ue8m0 per 64 dims, then 64 raw bf16 (dims 448..511),
  then 8 scale bytes (7 codes + pad) in the page's scale region;
* 528 (V4.1 MXFP8): 512 e4m3 values x ue8m0 per 32 dims, 16 scale bytes.

Page layout: *paged* (a page holds every token's value record, then every token's scale record)
or, for 528 only, *interleaved* (``interleaved=True``, what vLLM 0.33.0 writes: each token's value
record is followed directly by its scale record, ``width`` bytes per token).  The layout is a
compile-time constant of the variant, so the paged kernels are unchanged by it.

The 288-byte NVFP4 record (either layout) is not decoded here: it goes to the Triton kernel.

Numerics (§2.2, bit-exact with ``dsv41.reference.k_cache``): ``out = bf16_RNE(fp32(e4m3) *
2^(code-127))`` with the scale built from its bits (``code << 23``: code 0 -> 0, 255 -> +inf), the
e4m3 -> fp32 conversion exact (``cvt.rn.f16x2.e4m3x2`` then ``cvt.f32.f16``), the product a single
``mul.rn.f32`` (exact: an e4m3 value times a power of two fits fp32, subnormals included) and one
``cvt.rn.bf16x2.f32``.  Every NaN result (e4m3 NaN bytes, ``0 * inf``) is written as bf16 0x7FFF.
The 584 tail is copied verbatim (NaN payloads kept).

**OCP e4m3 (e4m3fn) only.**  The CuTe kernel does not decode FNUZ caches (``SUPPORTS_FNUZ`` is
False), the 288 record, nor an interleaved 584 (which no caller writes): for those calls
(``unsupported_reason`` says why) the launcher hands the call, unchanged, to the Triton kernel of
the same op (``backends/triton/sheet.py``), so the op never raises for them and the selection
stays per op.

Work decomposition (bandwidth design): one warp per token, 8 warps per CTA, each warp keeps
``_TOKENS_PER_WARP`` tokens in flight (all block-table and 16-byte record loads are issued before
any decode).  Lane ``l`` owns output dims ``16l .. 16l+15`` (two 16-byte stores): for a quantized
lane that is one 16-byte load of e4m3 bytes plus its scale byte; on the 584 record lanes 28..31
copy the 128-byte bf16 tail (32 bytes each).  Grid ``(num_reqs, W)``; CTA ``(r, y)`` walks the
token chunks ``y, y+W, ...`` of request r (grid-stride), so the result does not depend on W and
``n`` (read on the device) needs no host sync.  Out-of-range tokens of the last chunk re-read the
last valid token (always a valid address) and skip the store: only rows ``[offset, offset+n)`` are
written.  ``block_table.stride(0)`` (and every other stride) is honoured.

Compiled once per (arch, record, layout, alignment class of the cache / output, gather_lens
given) — every size, stride, pointer and ``block_size`` / ``offset`` is a runtime argument, so a
new token count never recompiles.  The launch goes on the current torch CUDA stream, with no host sync and no
allocation.

The module also holds the small CuTe-DSL helpers shared with ``cutedsl_indexer_q`` (raw
global loads/stores of 32-bit words at a given alignment, compile cache, fast launcher).
``cutlass`` is imported lazily, so the pure-Python parts (geometry, ``lane_layout``,
``token_addresses``) import without it.
"""

import ctypes
import importlib
import os
import threading

import torch

from dsv41.core import formats as _formats

__all__ = [
    "dequantize_and_gather_k_cache",
    "unsupported_reason",
    "SUPPORTS_FNUZ",
    "RECORDS",
    "INTERLEAVED_RECORDS",
    "compile_gather",
    "aot_variants",
    "lane_layout",
    "token_addresses",
    "gather_grid",
]

SUPPORTS_FNUZ = False

WARPS = 8  # warps per CTA (256 threads)
TOKENS_PER_WARP = 4  # tokens a warp keeps in flight per chunk
TOKENS_PER_CTA = WARPS * TOKENS_PER_WARP
THREADS = WARPS * 32
# CTAs per request are capped at about this many waves' worth of CTAs over all requests
# (the grid-stride loop covers the rest); 8 CTAs of 256 threads fill one SM.
_CTAS_PER_SM = 8

# record width -> (value bytes, scale bytes, quantized dims, group) of the fp8 KV records the
# kernel decodes (dsv41.core.formats)
RECORDS = {
    r.width: (r.value_bytes, r.scale_bytes, r.quant_dims, r.group) for r in (_formats.V4_FP8, _formats.V41_MXFP8)
}
# records that also come in the interleaved layout (the 584 record is always paged)
INTERLEAVED_RECORDS = (528,)


# --------------------------------------------------------------------------------------
# Pure-Python geometry (shared by the kernel and the CPU model used in the tests)
# --------------------------------------------------------------------------------------


def lane_layout(width: int, lane, select):
    """Per-lane constants of the gather.

    Returns ``(is_quant, value_off, scale_off)``: whether lane ``lane`` decodes e4m3 (else it
    copies 32 bytes of the 584 bf16 tail), the byte offset of its first value byte inside the
    token's value record, and the offset of its scale byte inside the token's scale record.
    ``select(cond, a, b)`` is the where-function of the caller (Python / torch / DSL).
    """
    vb, sb, qd, group = RECORDS[width]
    quant_lanes = qd // 16
    per_scale = group // 16  # lanes sharing one scale byte
    if quant_lanes == 32:
        is_quant = None  # every lane
        value_off = lane * 16
    else:
        is_quant = lane < quant_lanes
        value_off = select(is_quant, lane * 16, qd + (lane - quant_lanes) * 32)
    scale_off = lane // per_scale  # tail lanes land on the pad byte (never used)
    return is_quant, value_off, scale_off


def token_addresses(width: int, block_size, page_bytes, blk, t, interleaved: bool = False):
    """Byte offsets (from the cache's first byte) of the value record and the scale record of
    page token ``t`` of block ``blk`` (spec §1.1-§1.3).  Works on ints, torch or DSL values;
    ``interleaved`` is a Python bool (the layout of the variant)."""
    vb, sb, _, _ = RECORDS[width]
    page = blk * page_bytes
    if interleaved:
        rec = page + t * width
        return rec, rec + vb
    return page + t * vb, page + block_size * vb + t * sb


def gather_grid(num_reqs: int, max_rows: int, num_sms: int) -> tuple[int, int]:
    """Launch grid ``(num_reqs, W)``; any W >= 1 gives the same bytes (grid-stride loop)."""
    chunks = max(1, -(-max_rows // TOKENS_PER_CTA))
    cap = max(1, -(-(num_sms * _CTAS_PER_SM) // max(num_reqs, 1)))
    return num_reqs, max(1, min(chunks, cap, 65535))


def alignment(*values: int) -> int:
    """Largest power of two <= 16 dividing every value (addresses and byte strides)."""
    a = 16
    for v in values:
        while a > 1 and v % a:
            a //= 2
    return a


# --------------------------------------------------------------------------------------
# CuTe DSL helpers (shared with cutedsl_indexer_q)
# --------------------------------------------------------------------------------------


def ld_words(addr, nbytes: int, align: int, pred=None, nc: bool = True):
    """Load ``nbytes`` (a multiple of 4) from global byte address ``addr`` (Int64) as a list of
    Uint32 words (little endian), with the widest accesses ``align`` allows.

    ``pred`` (only honoured for single-instruction accesses, align >= 4) skips the load when
    false (the words are then undefined and must not be used)."""
    from cutlass import Int64, Uint32
    from cutlass.cute.arch import inline_ptx

    sp = ".nc" if nc else ""
    words = []
    if align >= 4:
        vec = min(align // 4, 4, nbytes // 4)
        while (nbytes // 4) % vec:
            vec //= 2
        for off in range(0, nbytes, 4 * vec):
            a = addr + Int64(off) if off else addr
            if vec == 1:
                ptx = f"ld.global{sp}.u32 {{$w0}}, [{{$r0}}];"
            else:
                regs = ", ".join(f"{{$w{k}}}" for k in range(vec))
                ptx = f"ld.global{sp}.v{vec}.u32 {{{regs}}}, [{{$r0}}];"
            res = inline_ptx(ptx, write_only_types=[Uint32] * vec, read_only_args=[a], predicate=pred)
            words.extend([res] if vec == 1 else list(res))
        return words
    for off in range(0, nbytes, 4):
        if align == 2:
            ptx = (
                "{ .reg .b16 lo, hi;\n"
                f"ld.global{sp}.u16 lo, [{{$r0}}+{off}];\n"
                f"ld.global{sp}.u16 hi, [{{$r0}}+{off + 2}];\n"
                "mov.b32 {$w0}, {lo, hi}; }"
            )
        else:
            ptx = (
                "{ .reg .b32 b0, b1, b2, b3;\n"
                f"ld.global{sp}.u8 b0, [{{$r0}}+{off}];\n"
                f"ld.global{sp}.u8 b1, [{{$r0}}+{off + 1}];\n"
                f"ld.global{sp}.u8 b2, [{{$r0}}+{off + 2}];\n"
                f"ld.global{sp}.u8 b3, [{{$r0}}+{off + 3}];\n"
                "prmt.b32 b0, b0, b1, 0x3340;\n"
                "prmt.b32 b2, b2, b3, 0x3340;\n"
                "prmt.b32 {$w0}, b0, b2, 0x5410; }"
            )
        words.append(inline_ptx(ptx, write_only_types=[Uint32], read_only_args=[addr]))
    return words


def st_words(addr, words, align: int, pred=None) -> None:
    """Store Uint32 ``words`` at global byte address ``addr`` (Int64), widest accesses allowed by
    ``align``; every store instruction is predicated on ``pred`` (None: unconditional)."""
    from cutlass import Int64, Uint32
    from cutlass.cute.arch import inline_ptx

    n = len(words)
    if align >= 4:
        vec = min(align // 4, 4, n)
        while n % vec:
            vec //= 2
        for k in range(0, n, vec):
            a = addr + Int64(4 * k) if k else addr
            if vec == 1:
                ptx = "st.global.u32 [{$r0}], {$r1};"
            else:
                regs = ", ".join(f"{{$r{j + 1}}}" for j in range(vec))
                ptx = f"st.global.v{vec}.u32 [{{$r0}}], {{{regs}}};"
            inline_ptx(ptx, read_only_args=[a] + list(words[k : k + vec]), predicate=pred)
        return
    for k, w in enumerate(words):
        a = addr + Int64(4 * k) if k else addr
        if align == 2:
            lo = inline_ptx("and.b32 {$w0}, {$r0}, 0xFFFF;", write_only_types=[Uint32], read_only_args=[w])
            hi = inline_ptx("shr.u32 {$w0}, {$r0}, 16;", write_only_types=[Uint32], read_only_args=[w])
            inline_ptx("st.global.u16 [{$r0}], {$r1};", read_only_args=[a, lo], predicate=pred)
            inline_ptx("st.global.u16 [{$r0}+2], {$r1};", read_only_args=[a, hi], predicate=pred)
        else:
            for j in range(4):
                b = inline_ptx(
                    f"bfe.u32 {{$w0}}, {{$r0}}, {8 * j}, 8;", write_only_types=[Uint32], read_only_args=[w]
                )
                inline_ptx(f"st.global.u8 [{{$r0}}+{j}], {{$r1}};", read_only_args=[a, b], predicate=pred)


def ld_s32(addr):
    """Scalar int32 load (read-only path)."""
    from cutlass import Int32
    from cutlass.cute.arch import inline_ptx

    return inline_ptx("ld.global.nc.s32 {$w0}, [{$r0}];", write_only_types=[Int32], read_only_args=[addr])


def ld_u8(addr):
    """Scalar byte load, zero-extended to Uint32."""
    from cutlass import Uint32
    from cutlass.cute.arch import inline_ptx

    return inline_ptx("ld.global.nc.u8 {$w0}, [{$r0}];", write_only_types=[Uint32], read_only_args=[addr])


def to_global(addr):
    """``cvta.to.global`` of a generic address passed from Python (identity on current GPUs)."""
    from cutlass import Int64
    from cutlass.cute.arch import inline_ptx

    return inline_ptx("cvta.to.global.u64 {$w0}, {$r0};", write_only_types=[Int64], read_only_args=[addr])


def sel_u32(cond, a, b):
    """``cond ? a : b`` on Uint32 words."""
    import cutlass
    from cutlass import Uint32

    return Uint32(cutlass.select_(cond, a, b))


# --------------------------------------------------------------------------------------
# Compile cache and launch plumbing (shared with cutedsl_indexer_q)
# --------------------------------------------------------------------------------------

_LOCK = threading.RLock()


_ARCH: dict = {}


def device_arch(idx: int) -> str:
    """``sm_90a`` / ``sm_100a`` / ``sm_103a`` ... of CUDA device ``idx`` (cached)."""
    arch = _ARCH.get(idx)
    if arch is None:
        major, minor = torch.cuda.get_device_capability(idx)
        arch = _ARCH[idx] = f"sm_{major}{minor}a"
    return arch


_SM_COUNT: dict = {}


def sm_count(idx: int) -> int:
    n = _SM_COUNT.get(idx)
    if n is None:
        n = _SM_COUNT[idx] = torch.cuda.get_device_properties(idx).multi_processor_count
    return n


def device_index(device) -> int:
    idx = device.index
    return idx if idx is not None else torch.cuda.current_device()


_CTYPES = {"i64": ctypes.c_int64, "i32": ctypes.c_int32, "f32": ctypes.c_float}


class FastLaunch:
    """Calls a ``cute.compile``d host function whose arguments are scalars only.

    ``kinds`` lists the argument kinds (``"i64"``, ``"i32"``, ``"f32"``); the CUDA stream comes
    last (implicit).  One executor per device (``compiled.to(device)``, which loads the module
    once).  The fast path writes the values into preallocated per-thread ctypes cells and runs
    the compiled program directly, skipping the DSL's per-call argument marshalling (~1 us of
    Python per argument); it is used only after ``check_layout`` confirmed, on the first call,
    that the DSL marshals the same arguments to the same bytes.  ``DSV41_CUTEDSL_SLOW_LAUNCH=1``
    forces the DSL's own marshalling.
    """

    def __init__(self, compiled, kinds: tuple):
        self.compiled = compiled
        self.kinds = tuple(kinds)
        self._tls = threading.local()
        self._executors: dict = {}
        self._fast = os.environ.get("DSV41_CUTEDSL_SLOW_LAUNCH", "0") in ("", "0")
        self._verified = None

    def _typed(self, values, stream):
        from cutlass import Float32, Int32, Int64

        conv = {"i64": Int64, "i32": Int32, "f32": Float32}
        return [conv[k](v) for k, v in zip(self.kinds, values)] + [stream]

    def _cells(self, values, stream_handle: int):
        cells = getattr(self._tls, "cells", None)
        if cells is None:
            store = [_CTYPES[k]() for k in self.kinds] + [ctypes.c_void_p()]
            ptrs = [ctypes.c_void_p(ctypes.addressof(c)) for c in store]
            cells = self._tls.cells = (store, ptrs)
        store, ptrs = cells
        for cell, v in zip(store, values):
            cell.value = v
        store[-1].value = stream_handle
        return store, ptrs

    def check_layout(self, values, stream_handle: int) -> bool:
        """True when the DSL marshals ``values`` (+ stream) as one pointer per argument to the
        same bytes the fast path's cells hold.  Needs no GPU."""
        import cuda.bindings.driver as cuda

        st = cuda.CUstream(stream_handle)
        typed = self._typed(values, st)
        exe_args, keep = self.compiled.generate_execution_args(*typed)
        store, _ = self._cells(values, stream_handle)
        if len(exe_args) != len(store):
            return False
        for ea, cell in zip(exe_args, store):
            addr = ea.value if isinstance(ea, ctypes.c_void_p) else int(ea)
            if not addr or ctypes.string_at(addr, ctypes.sizeof(cell)) != bytes(cell):
                return False
        del keep, typed
        return True

    def executor(self, device_index: int):
        ex = self._executors.get(device_index)
        if ex is None:
            with _LOCK:
                ex = self._executors.get(device_index)
                if ex is None:
                    ex = self._executors[device_index] = self.compiled.to(device_index)
        return ex

    def __call__(self, values, stream_handle: int, device_index: int) -> None:
        ex = self.executor(device_index)
        if self._fast:
            if self._verified is None:
                self._verified = self.check_layout(values, stream_handle)
            if self._verified:
                _, ptrs = self._cells(values, stream_handle)
                ex.run_compiled_program(ptrs)
                return
        import cuda.bindings.driver as cuda

        typed = self._typed(values, cuda.CUstream(stream_handle))
        exe_args, keep = self.compiled.generate_execution_args(*typed)
        ex.run_compiled_program(exe_args)
        del keep


def compile_options(arch: str):
    import cutlass.cute as cute

    return cute.GPUArch(arch)


_FALLBACK: dict = {}


def triton_fallback(op: str):
    """The shared Triton launcher of ``op`` (what the cuda:triton sheet runs), loaded once."""
    fn = _FALLBACK.get(op)
    if fn is None:
        from dsv41.backends.triton.sheet import TRITON_KERNELS

        module, _, name = TRITON_KERNELS[op].partition(":")
        fn = _FALLBACK[op] = getattr(importlib.import_module(module), name)
    return fn


# --------------------------------------------------------------------------------------
# The kernel
# --------------------------------------------------------------------------------------

def scale4_ptx(scale: str) -> str:
    """PTX lines multiplying fp32 registers f0..f3 (and predicates n0..n3 declared) by the
    operand ``scale``, then writing every NaN product as 0x7FFFFFFF: the canonical NaN each
    encoder after them expects, whatever NaN the inputs carried."""
    return "".join(f"mul.rn.f32 f{i}, f{i}, {scale};\n" for i in range(4)) + "".join(
        f"setp.nan.f32 n{i}, f{i}, f{i};\n" for i in range(4)) + "".join(
        f"selp.f32 f{i}, 0f7FFFFFFF, f{i}, n{i};\n" for i in range(4))


# e4m3 x4 (one word) times an fp32 power of two -> two bf16x2 words; NaN -> 0x7FFF.
_DEC_WORD = """{
.reg .b16 q0, q1, h0, h1, h2, h3;
.reg .b32 p0, p1;
.reg .f32 f0, f1, f2, f3;
.reg .pred n0, n1, n2, n3;
mov.b32 {q0, q1}, {$r0};
cvt.rn.f16x2.e4m3x2 p0, q0;
cvt.rn.f16x2.e4m3x2 p1, q1;
mov.b32 {h0, h1}, p0;
mov.b32 {h2, h3}, p1;
cvt.f32.f16 f0, h0;
cvt.f32.f16 f1, h1;
cvt.f32.f16 f2, h2;
cvt.f32.f16 f3, h3;
""" + scale4_ptx("{$r1}") + """cvt.rn.bf16x2.f32 {$w0}, f1, f0;
cvt.rn.bf16x2.f32 {$w1}, f3, f2;
}"""

_SCALE_FROM_CODE = "{ .reg .b32 t; shl.b32 t, {$r0}, 23; mov.b32 {$w0}, t; }"

# Runtime argument kinds of the host function (stream last, implicit).
_GATHER_ARGS = (
    "i64",  # out address
    "i64",  # k_cache address
    "i64",  # seq_lens address
    "i64",  # gather_lens address (0 when absent)
    "i64",  # block_table address
    "i64",  # out.stride(0) in bytes
    "i64",  # out.stride(1) in bytes
    "i64",  # k_cache.stride(0) (page bytes)
    "i64",  # block_table.stride(0) in bytes
    "i64",  # seq_lens.stride(0) in bytes
    "i64",  # gather_lens.stride(0) in bytes
    "i32",  # block_size
    "i32",  # offset
    "i32",  # block_table.shape[1] (logical width)
    "i32",  # k_cache.shape[0] (pages)
    "i32",  # out.shape[1] - offset (rows a request may fill)
    "i32",  # grid x (num_reqs)
    "i32",  # grid y (W)
)


def _make_gather(width: int, align_in: int, align_out: int, has_gather: bool, interleaved: bool = False):
    """Build the (kernel, host) pair for one variant.  All variant parameters are Python
    constants captured by the closures (compile-time); everything else is a runtime argument."""
    import cuda.bindings.driver as cuda
    import cutlass
    import cutlass.cute as cute
    from cutlass import Float32, Int32, Int64, Uint32
    from cutlass.cute.arch import inline_ptx

    vb, sb, qd, group = RECORDS[width]
    has_tail = qd < 512
    U = TOKENS_PER_WARP

    @cute.kernel
    def gather_kernel(
        out: Int64, cache: Int64, seq_lens: Int64, gather_lens: Int64, block_table: Int64,
        out_s0: Int64, out_s1: Int64, page_bytes: Int64, bt_s0: Int64, sl_s: Int64, gl_s: Int64,
        block_size: Int32, offset: Int32, bt_width: Int32, num_blocks: Int32, out_rows: Int32,
    ):
        tid, _, _ = cute.arch.thread_idx()
        r, cy, _ = cute.arch.block_idx()
        _, ny, _ = cute.arch.grid_dim()
        lane = tid % 32
        warp = tid // 32

        # Out-of-contract lengths and block ids never leave a tensor (docs/bad_input.md): rows
        # past out.shape[1] are not written, and a row whose position is negative, whose
        # logical block is past the table width or whose block id is outside the cache reads
        # token 0 of page 0 instead and is written as zeros.  Lengths in int64 (no wrap).
        L = Int64(ld_s32(to_global(seq_lens) + Int64(r) * sl_s))
        n64 = L
        if cutlass.const_expr(has_gather):
            n64 = Int64(ld_s32(to_global(gather_lens) + Int64(r) * gl_s))
        start = L - n64
        n = Int32(cutlass.min(n64, Int64(out_rows)))
        bsz = Uint32(block_size)
        bt_row = to_global(block_table) + Int64(r) * bt_s0
        base = to_global(cache)
        out_row = to_global(out) + Int64(r) * out_s0 + Int64(offset) * out_s1 + Int64(lane * 32)

        is_quant, value_off, scale_off = lane_layout(
            width, lane, lambda c, a, b: Int32(cutlass.select_(c, a, b))
        )
        value_off = Int64(value_off)
        scale_off = Int64(scale_off)
        tail_pred = None
        if cutlass.const_expr(has_tail):
            tail_pred = lane >= qd // 16

        for c in cutlass.range(cy * TOKENS_PER_CTA, n, ny * TOKENS_PER_CTA):
            i0 = c + warp * U
            if i0 < n:  # warp-uniform: warps past the end of a short request do nothing
                # 1) addresses of U tokens (the last chunk's overhang re-reads token n-1)
                vaddr = []
                saddr = []
                oks = []
                for u in cutlass.range_constexpr(U):
                    i = cutlass.min(i0 + u, n - 1)
                    p64 = start + Int64(i)
                    pos_ok = p64 >= Int64(0)
                    pos = Uint32(cutlass.select_(pos_ok, p64, Int64(0)))  # unsigned: exact, cheaper
                    bi = pos // bsz
                    bi_ok = pos_ok & (bi < Uint32(bt_width))
                    blk = ld_s32(bt_row + Int64(cutlass.select_(bi_ok, bi, Uint32(0))) * 4)
                    ok = bi_ok & (blk >= 0) & (blk < num_blocks)
                    oks.append(ok)
                    t = cutlass.select_(ok, pos - bi * bsz, Uint32(0))
                    voff, soff = token_addresses(
                        width, Int64(block_size), page_bytes, Int64(cutlass.select_(ok, blk, Int32(0))), Int64(t),
                        interleaved,
                    )
                    vaddr.append(base + voff + value_off)
                    saddr.append(base + soff + scale_off)
                # 2) all record loads in flight
                raw = []
                codes = []
                for u in cutlass.range_constexpr(U):
                    w = ld_words(vaddr[u], 16, align_in)
                    if cutlass.const_expr(has_tail):
                        # 584: the second 16 bytes are needed by the bf16-tail lanes only (for the
                        # others the address is still inside the record, so a load is harmless)
                        w = w + ld_words(vaddr[u] + Int64(16), 16, align_in, pred=tail_pred if align_in >= 4 else None)
                    raw.append(w)
                    codes.append(ld_u8(saddr[u]))
                # 3) decode and store
                for u in cutlass.range_constexpr(U):
                    scale = inline_ptx(_SCALE_FROM_CODE, write_only_types=[Float32], read_only_args=[codes[u]])
                    words = []
                    for k in cutlass.range_constexpr(4):
                        o0, o1 = inline_ptx(
                            _DEC_WORD, write_only_types=[Uint32, Uint32], read_only_args=[raw[u][k], scale]
                        )
                        words.append(o0)
                        words.append(o1)
                    if cutlass.const_expr(has_tail):
                        words = [sel_u32(is_quant, words[k], raw[u][k]) for k in range(8)]
                    words = [sel_u32(oks[u], words[k], Uint32(0)) for k in range(8)]
                    valid = i0 + u < n
                    st_words(out_row + Int64(i0 + u) * out_s1, words, align_out, pred=valid)

    @cute.jit
    def gather_host(
        out: Int64, cache: Int64, seq_lens: Int64, gather_lens: Int64, block_table: Int64,
        out_s0: Int64, out_s1: Int64, page_bytes: Int64, bt_s0: Int64, sl_s: Int64, gl_s: Int64,
        block_size: Int32, offset: Int32, bt_width: Int32, num_blocks: Int32, out_rows: Int32,
        grid_x: Int32, grid_y: Int32, stream: cuda.CUstream,
    ):
        gather_kernel(
            out, cache, seq_lens, gather_lens, block_table, out_s0, out_s1, page_bytes,
            bt_s0, sl_s, gl_s, block_size, offset, bt_width, num_blocks, out_rows,
        ).launch(grid=[grid_x, grid_y, 1], block=[THREADS, 1, 1], stream=stream)

    return gather_kernel, gather_host


_COMPILED: dict = {}


def _example_args():
    from cutlass import Int32, Int64

    return [Int64(0)] * 11 + [Int32(64), Int32(0), Int32(1), Int32(1), Int32(1), Int32(1), Int32(1)]


def compile_gather(
    arch: str, width: int, align_in: int = 16, align_out: int = 16, has_gather: bool = True,
    interleaved: bool = False,
):
    """Compile (or fetch) one variant for ``arch`` (``sm_90a``, ``sm_100a``, ...); needs no GPU.
    Returns a ``FastLaunch``."""
    if interleaved and width not in INTERLEAVED_RECORDS:
        raise ValueError(f"no interleaved layout for the {width} record")
    key = (arch, width, align_in, align_out, has_gather, interleaved)
    fn = _COMPILED.get(key)
    if fn is not None:
        return fn
    with _LOCK:
        fn = _COMPILED.get(key)
        if fn is None:
            import cutlass.cute as cute
            from cutlass.cute.runtime import make_fake_stream

            _, host = _make_gather(width, align_in, align_out, has_gather, interleaved)
            compiled = cute.compile[compile_options(arch)](host, *_example_args(), make_fake_stream())
            fn = _COMPILED[key] = FastLaunch(compiled, _GATHER_ARGS)
    return fn


def aot_variants():
    """(name, builder(arch)) pairs that ``cutedsl_aot.compile_all`` builds."""
    out = []
    layouts = [(w, False) for w in RECORDS] + [(w, True) for w in INTERLEAVED_RECORDS]
    for width, il in layouts:
        rec = f"{width},il" if il else f"{width}"
        for has_gather in (True, False):
            out.append((
                f"gather[{rec},a16,o16,gl={int(has_gather)}]",
                lambda arch, w=width, g=has_gather, il=il: compile_gather(arch, w, 16, 16, g, il),
            ))
        # the fallback for oddly aligned views
        out.append((
            f"gather[{rec},a1,o2,gl=1]",
            lambda arch, w=width, il=il: compile_gather(arch, w, 1, 2, True, il),
        ))
    return out


# --------------------------------------------------------------------------------------
# Launcher (kernel-contract signature)
# --------------------------------------------------------------------------------------


def unsupported_reason(
    out, k_cache, seq_lens, gather_lens, block_table, block_size, offset, use_fnuz, interleaved=False
):
    """None when the CuTe kernel handles the call (kernel-contract arguments), else why the
    launcher hands it to the Triton kernel (the 288 NVFP4 record, FNUZ caches, an empty cache
    or block table).  The sheet's ``input_limits`` names this function."""
    width = k_cache.shape[-1]
    if width not in RECORDS:
        return f"cuda:cutedsl gather handles the 584 / 528 records, not {width}"
    if interleaved and width not in INTERLEAVED_RECORDS:
        return f"cuda:cutedsl gather has no interleaved layout for the {width} record"
    if use_fnuz:
        return "cuda:cutedsl gather decodes OCP e4m3 only (use_fnuz=True)"
    # an empty cache or table has no in-bounds token 0 of page 0 to read in place of a bad
    # one: the Triton kernel (masked loads) takes those calls
    if k_cache.shape[0] == 0 or block_table.shape[1] == 0:
        return "cuda:cutedsl gather needs a non-empty cache and block table (it reads page 0 for bad rows)"
    return None


def dequantize_and_gather_k_cache(
    out, k_cache, seq_lens, gather_lens, block_table, block_size: int, offset: int, use_fnuz: bool,
    interleaved: bool = False,
) -> None:
    """Kernel-contract entry (docs/kernel_contract.md): writes ``out[r, offset:offset+n]``.

    Calls outside ``unsupported_reason`` go to the Triton kernel."""
    width = k_cache.shape[-1]
    interleaved = bool(interleaved)
    if unsupported_reason(out, k_cache, seq_lens, gather_lens, block_table, block_size, offset, use_fnuz,
                          interleaved) is not None:
        return triton_fallback("dequantize_and_gather_k_cache")(
            out, k_cache, seq_lens, gather_lens, block_table, block_size, offset, use_fnuz, interleaved
        )
    num_reqs = seq_lens.shape[0]
    if num_reqs == 0 or out.shape[1] <= offset:
        return
    dev = out.device
    idx = device_index(dev)
    cache_ptr = k_cache.data_ptr()
    page_bytes = k_cache.stride(0)
    out_ptr = out.data_ptr()
    os0, os1, _ = out.stride()
    s0, s1 = 2 * os0, 2 * os1
    has_gather = gather_lens is not None
    fn = compile_gather(
        device_arch(idx), width, alignment(cache_ptr, page_bytes), alignment(out_ptr, s0, s1), has_gather,
        interleaved,
    )
    grid_x, grid_y = gather_grid(num_reqs, out.shape[1] - offset, sm_count(idx))
    fn(
        (
            out_ptr, cache_ptr, seq_lens.data_ptr(), gather_lens.data_ptr() if has_gather else 0,
            block_table.data_ptr(), s0, s1, page_bytes, 4 * block_table.stride(0),
            4 * seq_lens.stride(0), 4 * gather_lens.stride(0) if has_gather else 0,
            block_size, offset, block_table.shape[1], k_cache.shape[0], out.shape[1] - offset, grid_x, grid_y,
        ),
        torch.cuda.current_stream(idx).cuda_stream,
        idx,
    )
