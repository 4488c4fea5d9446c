"""CPU kernels (OpenMP C++) of the index builders and the RoPE / quantization ops.

Each function has exactly the kernel-contract signature (docs/kernel_contract.md): it gets
validated inputs and preallocated outputs, writes the outputs in place and returns None, and
its bytes equal ``dsv41.reference``'s.  The C++ lives next to this file:

* ``index_kernels.cpp`` (library ``dsv41_cpu_index``): compute_global_topk_indices_and_lens,
  combine_topk_swa_indices, build_flashinfer_mixed_sparse_indices (C §5-§7);
* ``rope_kernels.cpp`` (library ``dsv41_cpu_rope``): fused_save_compress_norm and
  save_ring_rows (C §8.1),
  fused_indexer_q_rope_quant (R §2), fused_inv_rope_fp8_quant (R §4),
  fused_q_kv_rmsnorm_quant (R §5), pad_fused_q_heads (R §6.3).

The kernels take raw pointers plus element strides (views, sliced / transposed block tables,
strided 1-D inputs are read in place).  Layouts or dtypes the C++ does not cover (none of them
produced by the public functions: a column-strided index matrix, an fp16 attention output, an
odd NoPE width in the inverse RoPE, more ``seq_lens`` than requests in ``combine``'s
``query_start_loc``, ...) go to the reference, so every call still gives the reference's bytes;
``FALLBACKS`` counts those calls per op.

Registry mapping (op -> kernel): ``dsv41.backends.cpu.ops:<op name>`` for the nine ops above.
"""

from __future__ import annotations

import ctypes

import torch

from dsv41.core import gpu_approx
from dsv41.core.formats import scale_byte_strides
from dsv41.core.op_specs import spec
from dsv41.reference.output_quant import vllm_norm_layout

from . import bounds
from ._build import build_error as _build_error
from ._build import load

__all__ = [
    "compute_global_topk_indices_and_lens",
    "combine_topk_swa_indices",
    "build_flashinfer_mixed_sparse_indices",
    "fused_save_compress_norm",
    "save_ring_rows",
    "fused_indexer_q_rope_quant",
    "fused_inv_rope_fp8_quant",
    "fused_q_kv_rmsnorm_quant",
    "pad_fused_q_heads",
    "build_error",
    "FALLBACKS",
]

_INDEX = ("dsv41_cpu_index", ["index_kernels.cpp"])
_ROPE = ("dsv41_cpu_rope", ["rope_kernels.cpp"])

_P = ctypes.c_void_p
_I = ctypes.c_int64
_D = ctypes.c_double
_CT = {"p": _P, "i": _I, "d": _D}

# argument kinds per C entry point ("p" pointer, "i" int64, "d" double)
_SIGS = {
    "dsv41_compute_global_topk_indices_and_lens": (_INDEX, "piii" "pi" "piiii" "i" "pi" "pi" "pi" "i"),
    "dsv41_combine_topk_swa_indices": (_INDEX, "piii" "pi" "pii" "pii" "i" "iiiii" "pii" "pi"),
    "dsv41_build_flashinfer_mixed_sparse_indices": (
        _INDEX,
        "piii" "pii" "pi" "piii" "pii" "pii" "pi" "piiii" "i" "piiii" "i" "iii" "i" "pi" "ii" "pii" "pii" "pi",
    ),
    "dsv41_fused_save_compress_norm": (
        _ROPE,
        "pii" "pii" "piiii" "piii" "piii" "pii" "pii" "di" "pi" "pppp" "pii" "piii",
    ),
    "dsv41_save_ring_rows": (_ROPE, "pii" "pii" "piiii"),
    "dsv41_fused_indexer_q_rope_quant": (
        _ROPE,
        "pii" "piiiii" "piiii" "piii" "ddii" "pii" "pii" "piii",
    ),
    "dsv41_fused_inv_rope_fp8_quant": (
        _ROPE,
        "piiiii" "pii" "pii" "iiiii" "iii" "pii" "piii",
    ),
    "dsv41_fused_q_kv_rmsnorm_quant": (
        _ROPE,
        "piii" "pii" "pipi" "d" "pi" "pii" "pi" "pp" "iii",
    ),
    "dsv41_pad_fused_q_heads": (_ROPE, "piiii" "piii"),
}

_fns: dict = {}


def _approx_ptrs() -> tuple:
    """Addresses of the int32 tables of ``dsv41.core.gpu_approx`` (rsqrt, rcp, ex2, ex2neg)
    the kernels read; the tables stay cached for the process."""
    return tuple(gpu_approx.result_bits(n, "cpu").data_ptr() for n in ("rsqrt", "rcp", "ex2", "ex2neg"))

# op -> number of calls that went to the reference (a layout / dtype the C++ does not take)
FALLBACKS: dict = {}


def _reference(module: str, op: str):
    import importlib

    FALLBACKS[op] = FALLBACKS.get(op, 0) + 1
    return getattr(importlib.import_module("dsv41.reference." + module), op)


def _fn(name: str):
    f = _fns.get(name)
    if f is None:
        (lib_name, sources), kinds = _SIGS[name]
        f = getattr(load(lib_name, sources), name)
        f.argtypes = [_CT[k] for k in kinds]
        f.restype = None
        _fns[name] = f
    return f


_LIB_OF_OP = {
    "compute_global_topk_indices_and_lens": _INDEX,
    "combine_topk_swa_indices": _INDEX,
    "build_flashinfer_mixed_sparse_indices": _INDEX,
    "fused_save_compress_norm": _ROPE,
    "save_ring_rows": _ROPE,
    "fused_indexer_q_rope_quant": _ROPE,
    "fused_inv_rope_fp8_quant": _ROPE,
    "fused_q_kv_rmsnorm_quant": _ROPE,
    "pad_fused_q_heads": _ROPE,
}


def build_error(op: str | None = None) -> str | None:
    """None when the kernel library of ``op`` (both libraries when None) builds and loads,
    else the reason (for the capability sheet's ``extra_reasons``)."""
    if op is not None:
        lib = _LIB_OF_OP.get(op)
        return f"no CPU kernel for {op}" if lib is None else _build_error(*lib)
    return _build_error(*_INDEX) or _build_error(*_ROPE)


def _ptr(t: torch.Tensor | None):
    return None if t is None else t.data_ptr()


_I32 = torch.int32
_IDX = (torch.int32, torch.int64)
_BF16 = torch.bfloat16
_F32 = torch.float32


def _rows_ok(*ts) -> bool:
    """2-D tensors with a unit last stride (or a last dim of size <= 1)."""
    return all(t is None or t.dim() != 2 or t.shape[1] <= 1 or t.stride(1) == 1 for t in ts)


def _s0(t: torch.Tensor) -> int:
    return t.stride(0) if t.dim() > 0 else 0


# ============================================================================ C §5


def compute_global_topk_indices_and_lens(
    topk_indices, token_to_req_indices, block_table, block_size, is_valid_token, global_topk_indices, topk_lens,
    compact=False,
) -> None:
    n, K = topk_indices.shape
    if n == 0:
        return None
    if (
        any(t.dtype != _I32 for t in (topk_indices, token_to_req_indices, block_table, global_topk_indices, topk_lens))
        or is_valid_token.dtype != torch.bool
        or not _rows_ok(topk_indices, global_topk_indices)
    ):
        return _reference("sparse_indices", "compute_global_topk_indices_and_lens")(
            topk_indices, token_to_req_indices, block_table, block_size, is_valid_token, global_topk_indices, topk_lens,
            compact,
        )
    _fn("dsv41_compute_global_topk_indices_and_lens")(
        _ptr(topk_indices), n, K, _s0(topk_indices),
        _ptr(token_to_req_indices), _s0(token_to_req_indices),
        _ptr(block_table), block_table.shape[0], block_table.shape[1], block_table.stride(0), block_table.stride(1),
        int(block_size),
        _ptr(is_valid_token), _s0(is_valid_token),
        _ptr(global_topk_indices), global_topk_indices.stride(0),
        _ptr(topk_lens), _s0(topk_lens),
        int(bool(compact)),
    )
    return None


# ============================================================================ C §6


def combine_topk_swa_indices(
    topk_indices, query_start_loc, seq_lens, gather_lens, window_size, compress_ratio, topk, M, N,
    combined_indices, combined_lens,
) -> None:
    T, K = topk_indices.shape
    if T == 0:
        return None
    if any(
        t.dtype != _I32 for t in (topk_indices, query_start_loc, seq_lens, gather_lens, combined_indices, combined_lens)
    ) or not _rows_ok(topk_indices, combined_indices) or seq_lens.shape[0] > query_start_loc.shape[0] - 1:
        # (more seq_lens than requests in query_start_loc: the reference raises IndexError)
        return _reference("sparse_indices", "combine_topk_swa_indices")(
            topk_indices, query_start_loc, seq_lens, gather_lens, window_size, compress_ratio, topk, M, N,
            combined_indices, combined_lens,
        )
    R = seq_lens.shape[0]
    _fn("dsv41_combine_topk_swa_indices")(
        _ptr(topk_indices), T, K, topk_indices.stride(0),
        _ptr(query_start_loc), _s0(query_start_loc),
        _ptr(seq_lens), seq_lens.shape[0], _s0(seq_lens),
        _ptr(gather_lens), gather_lens.shape[0], _s0(gather_lens),
        R,
        int(window_size), int(compress_ratio), int(topk), int(M), int(N),
        _ptr(combined_indices), combined_indices.shape[1], combined_indices.stride(0),
        _ptr(combined_lens), _s0(combined_lens),
    )
    return None


# ============================================================================ C §7


def build_flashinfer_mixed_sparse_indices(*args, **kwargs) -> None:
    # 21 kernel arguments: bound by the op's declaration rather than listed a second time
    a = _FLASHINFER.bind(*args, **kwargs)
    dsi, pti = a.decode_swa_indices, a.prefill_topk_indices
    D, W_swa = dsi.shape
    P, K_pre = pti.shape
    if D + P == 0:
        return None
    dci, dcl, dvt = a.decode_compressed_indices, a.decode_compressed_topk_lens, a.decode_is_valid_token
    qsl, seq, t2r, rs = a.query_start_loc, a.seq_lens, a.token_to_req_indices, a.replay_start
    swa, comp, out, lens = a.swa_block_table, a.compressed_block_table, a.sparse_indices, a.sparse_topk_lens
    if (
        any(t is not None and t.dtype != _I32 for t in (dsi, dci, dcl, pti, qsl, seq, t2r, swa, comp, rs, out, lens))
        or (dvt is not None and dvt.dtype != torch.bool)
        or not _rows_ok(dsi, dci, pti, out)
    ):
        return _reference("sparse_indices", "build_flashinfer_mixed_sparse_indices")(*a)
    k_dec = 0 if dci is None else dci.shape[1]
    _fn("dsv41_build_flashinfer_mixed_sparse_indices")(
        _ptr(dsi), D, W_swa, dsi.stride(0),
        _ptr(dci), k_dec, dci.stride(0) if dci is not None else 0,
        _ptr(dcl), _s0(dcl) if dcl is not None else 0,
        _ptr(pti), P, K_pre, pti.stride(0),
        _ptr(qsl), qsl.shape[0], _s0(qsl),
        _ptr(seq), seq.shape[0], _s0(seq),
        _ptr(t2r), _s0(t2r),
        _ptr(swa), swa.shape[0], swa.shape[1], swa.stride(0), swa.stride(1),
        int(a.swa_block_size),
        _ptr(comp), comp.shape[0], comp.shape[1], comp.stride(0), comp.stride(1),
        int(a.compressed_block_size),
        int(a.window_size), int(a.compress_ratio), int(a.topk),
        int(bool(a.decode_compressed_indices_are_local)),
        _ptr(dvt), _s0(dvt) if dvt is not None else 0,
        int(a.swa_block_span), int(a.compressed_block_span),
        _ptr(rs), rs.shape[0], _s0(rs),
        _ptr(out), out.shape[1], out.stride(0),
        _ptr(lens), _s0(lens),
    )
    return None


_FLASHINFER = spec("build_flashinfer_mixed_sparse_indices")


# ============================================================================ C §8.1


def fused_save_compress_norm(
    kv_score, positions, state_cache, slot_mapping, query_start_loc, token_to_req_indices,
    rms_norm_weight, rms_norm_eps, compress_ratio, latent_out,
    prev_rows=None, prev_row_indices=None,
) -> None:
    T = slot_mapping.numel()
    if T == 0:
        return None
    cr = int(compress_ratio)
    if cr != 2:
        prev_rows = prev_row_indices = None  # only CR 2 has a predecessor row
    ok = (
        cr in (1, 2)
        and kv_score.dtype == _F32 and kv_score.dim() == 2 and kv_score.stride(1) == 1
        and kv_score.shape[1] >= 512 * cr
        and positions.dtype in _IDX and slot_mapping.dtype in _IDX and slot_mapping.dim() == 1
        and rms_norm_weight.dtype in (_BF16, _F32) and rms_norm_weight.numel() >= 512
        and latent_out.dtype == _BF16 and latent_out.dim() == 2 and latent_out.stride(1) == 1
    )
    if ok and cr == 2:
        ok = (
            state_cache is not None and state_cache.dtype == _F32 and state_cache.dim() == 3
            and state_cache.stride(2) == 1 and state_cache.shape[2] >= 1024 and state_cache.shape[1] > 0
            and query_start_loc is not None and query_start_loc.dtype in _IDX and query_start_loc.dim() == 1
            and token_to_req_indices is not None and token_to_req_indices.dtype in _IDX
        )
    if ok and prev_rows is not None:
        ok = (
            prev_rows.dtype == _F32 and prev_rows.dim() == 2 and prev_rows.stride(1) == 1
            and prev_rows.shape[1] >= 1024
            and prev_row_indices is not None and prev_row_indices.dtype in _IDX
        )
    if not ok:
        args = (
            kv_score, positions, state_cache, slot_mapping, query_start_loc, token_to_req_indices,
            rms_norm_weight, rms_norm_eps, compress_ratio, latent_out,
        )
        ref = _reference("compress", "fused_save_compress_norm")
        return ref(*args) if prev_rows is None else ref(*args, prev_rows, prev_row_indices)
    if cr == 2 and bounds.save_first_bad(
        slot_mapping.reshape(-1), positions.reshape(-1), token_to_req_indices.reshape(-1), query_start_loc,
        state_cache.shape[0] * state_cache.shape[1],
        None if prev_rows is None else prev_row_indices.reshape(-1), 0 if prev_rows is None else prev_rows.shape[0],
    ) >= 0:
        bounds.reject("fused_save_compress_norm",
                      [kv_score, positions, state_cache, slot_mapping, query_start_loc, token_to_req_indices,
                       rms_norm_weight, rms_norm_eps, compress_ratio, latent_out, prev_rows, prev_row_indices],
                      "slot_mapping")
    if prev_rows is not None:
        pidx = prev_row_indices.reshape(-1)
        prev_args = (_ptr(prev_rows), prev_rows.shape[0], prev_rows.stride(0),
                     _ptr(pidx), int(pidx.dtype == torch.int64), pidx.shape[0], _s0(pidx))
    else:
        prev_args = (None, 0, 0, None, 0, 0, 0)
    pos = positions.reshape(-1)
    if cr == 2:
        st, qsl, t2r = state_cache, query_start_loc, token_to_req_indices.reshape(-1)
        st_args = (_ptr(st), st.shape[0], st.shape[1], st.stride(0), st.stride(1))
        qsl_args = (_ptr(qsl), int(qsl.dtype == torch.int64), qsl.shape[0], _s0(qsl))
        t2r_args = (_ptr(t2r), int(t2r.dtype == torch.int64), _s0(t2r))
    else:
        st_args = (None, 0, 1, 0, 0)
        qsl_args = (None, 0, 0, 0)
        t2r_args = (None, 0, 0)
    _fn("dsv41_fused_save_compress_norm")(
        _ptr(kv_score), kv_score.shape[0], kv_score.stride(0),
        _ptr(pos), int(pos.dtype == torch.int64), _s0(pos),
        *st_args,
        _ptr(slot_mapping), int(slot_mapping.dtype == torch.int64), _s0(slot_mapping), T,
        *qsl_args,
        *t2r_args,
        _ptr(rms_norm_weight), int(rms_norm_weight.dtype == _BF16), _s0(rms_norm_weight.reshape(-1)),
        float(rms_norm_eps), cr,
        _ptr(latent_out), latent_out.stride(0),
        *_approx_ptrs(),
        *prev_args,
    )
    return None


def save_ring_rows(rows, slot_mapping, state_cache) -> None:
    N = slot_mapping.numel()
    if N == 0:
        return None
    ok = (
        rows.dtype == _F32 and rows.dim() == 2 and rows.stride(1) == 1 and rows.shape[1] >= 1024
        and slot_mapping.dtype in _IDX
        and state_cache.dtype == _F32 and state_cache.dim() == 3 and state_cache.stride(2) == 1
        and state_cache.shape[2] >= 1024
    )
    if not ok:
        return _reference("compress", "save_ring_rows")(rows, slot_mapping, state_cache)
    slots = slot_mapping.reshape(-1)
    if bounds.first_outside(slots, N, 0, state_cache.shape[0] * state_cache.shape[1], skip_negative=True) >= 0:
        bounds.reject("save_ring_rows", [rows, slot_mapping, state_cache], "slot_mapping")
    _fn("dsv41_save_ring_rows")(
        _ptr(rows), N, rows.stride(0),
        _ptr(slots), int(slots.dtype == torch.int64), _s0(slots),
        _ptr(state_cache), state_cache.shape[0], state_cache.shape[1],
        state_cache.stride(0), state_cache.stride(1),
    )
    return None


# ============================================================================ R §2


def _scale_rows_ok(q_scale_out, D: int) -> bool:
    """An MXFP4 scale output whose (token, head) rows of D/32 bytes are contiguous: uint8
    [T, H, D/32], or int32 words [T, H] (D = 128) / [T, H, D/128]."""
    if q_scale_out.dtype == torch.uint8:
        return q_scale_out.dim() == 3 and q_scale_out.stride(2) == 1
    if q_scale_out.dtype == torch.int32:
        if q_scale_out.dim() == 2:
            return D == 128
        return q_scale_out.dim() == 3 and q_scale_out.stride(2) == 1
    return False


def fused_indexer_q_rope_quant(
    positions, index_q, cos_sin_cache, index_weights, softmax_scale, head_scale, use_fp4, use_fnuz,
    q_out, q_scale_out, weights_out,
) -> None:
    T, H, D = index_q.shape
    if T == 0:
        return None
    R = cos_sin_cache.shape[-1]
    ok = (
        index_q.dtype == _BF16 and index_q.stride(2) == 1
        and positions.dtype in _IDX
        and cos_sin_cache.dtype in (_F32, _BF16) and cos_sin_cache.dim() == 2 and cos_sin_cache.stride(1) == 1
        and cos_sin_cache.shape[0] > 0 and R % 2 == 0 and R <= D
        and index_weights.dtype in (_F32, _BF16) and index_weights.dim() == 2
        and weights_out.dtype in (_F32, _BF16) and weights_out.dim() == 2
    )
    if ok and use_fp4:
        ok = (
            D % 32 == 0 and q_out.dtype == torch.uint8 and q_out.dim() == 3 and q_out.stride(2) == 1
            and _scale_rows_ok(q_scale_out, D)
        )
    elif ok:
        ok = q_out.element_size() == 1 and q_out.dim() == 3 and q_out.stride(2) == 1
    if not ok:
        return _reference("indexer", "fused_indexer_q_rope_quant")(
            positions, index_q, cos_sin_cache, index_weights, softmax_scale, head_scale, use_fp4, use_fnuz,
            q_out, q_scale_out, weights_out,
        )
    pos = positions.reshape(-1)
    if bounds.first_outside(pos, T, 0, cos_sin_cache.shape[0]) >= 0:
        bounds.reject("fused_indexer_q_rope_quant", [positions, index_q, cos_sin_cache], "positions")
    qo = q_out.view(torch.uint8)
    if use_fp4:
        qs_args = (_ptr(q_scale_out), *scale_byte_strides(q_scale_out))
    else:
        qs_args = (None, 0, 0)
    _fn("dsv41_fused_indexer_q_rope_quant")(
        _ptr(pos), int(pos.dtype == torch.int64), _s0(pos),
        _ptr(index_q), T, H, D, index_q.stride(0), index_q.stride(1),
        _ptr(cos_sin_cache), int(cos_sin_cache.dtype == _BF16), cos_sin_cache.shape[0], R, cos_sin_cache.stride(0),
        _ptr(index_weights), int(index_weights.dtype == _BF16), index_weights.stride(0), index_weights.stride(1),
        float(softmax_scale), float(head_scale), int(bool(use_fp4)), int(bool(use_fnuz)),
        _ptr(qo), qo.stride(0), qo.stride(1),
        *qs_args,
        _ptr(weights_out), int(weights_out.dtype == _BF16), weights_out.stride(0), weights_out.stride(1),
    )
    return None


# ============================================================================ R §4


def fused_inv_rope_fp8_quant(
    o, positions, cos_sin_cache, n_groups, heads_per_group, nope_dim, rope_dim, quant_group_size,
    tma_aligned_scales, quantize, permuted_output, out_buf, scale_buf,
) -> None:
    T, NH, Dh = o.shape
    G, HG, QG = int(n_groups), int(heads_per_group), int(quant_group_size)
    S = HG * (Dh // QG) if QG > 0 else 0
    K = ((S + 3) // 4 if tma_aligned_scales else S) if quantize else 0
    ok = (
        o.dtype == _BF16 and o.stride(2) == 1 and positions.dtype in _IDX
        and cos_sin_cache.dtype == _F32 and cos_sin_cache.dim() == 2 and cos_sin_cache.stride(1) == 1
        and cos_sin_cache.shape[0] > 0
        and NH == G * HG and Dh == nope_dim + rope_dim and QG > 0 and Dh % QG == 0
        and nope_dim % 2 == 0 and rope_dim % 2 == 0 and cos_sin_cache.shape[1] >= rope_dim
        and out_buf.dim() == 3 and out_buf.stride(2) == 1
        and (out_buf.element_size() == 1 if quantize else out_buf.dtype == _BF16)
        and (not permuted_output or quantize)
    )
    if ok and quantize:
        ok = (
            scale_buf.dim() == 2 and scale_buf.element_size() == 4 and (scale_buf.shape[1] <= 1 or scale_buf.stride(1) == 1)
            and scale_buf.dtype == (torch.int32 if tma_aligned_scales else _F32)
            and K > 0 and scale_buf.shape[1] % K == 0 and scale_buf.shape[1] // K >= T
        )
    if not ok:
        return _reference("output_quant", "fused_inv_rope_fp8_quant")(
            o, positions, cos_sin_cache, n_groups, heads_per_group, nope_dim, rope_dim, quant_group_size,
            tma_aligned_scales, quantize, permuted_output, out_buf, scale_buf,
        )
    if T == 0 and not quantize:
        return None
    pos = positions.reshape(-1)
    if bounds.first_outside(pos, T, 0, cos_sin_cache.shape[0]) >= 0:
        bounds.reject("fused_inv_rope_fp8_quant", [o, positions, cos_sin_cache], "positions")
    Ta = scale_buf.shape[1] // K if quantize else 0
    _fn("dsv41_fused_inv_rope_fp8_quant")(
        _ptr(o), T, NH, Dh, o.stride(0), o.stride(1),
        _ptr(pos), int(pos.dtype == torch.int64), _s0(pos),
        _ptr(cos_sin_cache), cos_sin_cache.shape[0], cos_sin_cache.stride(0),
        G, HG, int(nope_dim), int(rope_dim), QG,
        int(bool(tma_aligned_scales)), int(bool(quantize)), int(bool(permuted_output)),
        _ptr(out_buf), out_buf.stride(0), out_buf.stride(1),
        _ptr(scale_buf) if quantize else None, scale_buf.stride(0) if quantize else 0, Ta, K,
    )
    return None


# ============================================================================ R §5


def fused_q_kv_rmsnorm_quant(qr, kv, q_weight, kv_weight, eps, q_out, q_scale_out, kv_out) -> None:
    T, Qs = qr.shape
    Ks = kv.shape[1]
    Tp = (T + 127) // 128 * 128
    Gp = (Qs // 32 + 3) // 4 * 4
    ok = (
        qr.dtype == _BF16 and kv.dtype == _BF16 and _rows_ok(qr, kv, q_out, kv_out)
        and Qs % 32 == 0
        and q_weight.dtype in (_BF16, _F32) and kv_weight.dtype in (_BF16, _F32)
        and q_weight.is_contiguous() and kv_weight.is_contiguous()
        and q_out.element_size() == 1 and kv_out.dtype == _BF16
        and q_scale_out.dtype == torch.uint8 and q_scale_out.is_contiguous() and q_scale_out.numel() >= Tp * Gp
    )
    if not ok:
        return _reference("output_quant", "fused_q_kv_rmsnorm_quant")(qr, kv, q_weight, kv_weight, eps, q_out, q_scale_out, kv_out)
    if Tp == 0:
        return None
    qo = q_out.view(torch.uint8)
    _fn("dsv41_fused_q_kv_rmsnorm_quant")(
        _ptr(qr), T, Qs, qr.stride(0) if T else 0,
        _ptr(kv), Ks, kv.stride(0) if T else 0,
        _ptr(q_weight), int(q_weight.dtype == _BF16), _ptr(kv_weight), int(kv_weight.dtype == _BF16),
        float(eps),
        _ptr(qo), qo.stride(0) if T else 0,
        _ptr(q_scale_out), Tp, Gp,
        _ptr(kv_out), kv_out.stride(0) if T else 0,
        gpu_approx.result_bits("rsqrt", "cpu").data_ptr(), gpu_approx.result_bits("rcp", "cpu").data_ptr(),
        *vllm_norm_layout(Qs, Ks, 2),
    )
    return None


# ============================================================================ R §6.3


def pad_fused_q_heads(q, out) -> None:
    T, H, D = q.shape
    Hp = out.shape[1]
    if T == 0 or out.numel() == 0:
        return None
    ok = (
        q.dtype == out.dtype and D % 16 == 0 and Hp >= H
        and q.stride(2) == 1 and q.stride(1) == D and out.stride(2) == 1 and out.stride(1) == D
    )
    if not ok:
        return _reference("output_quant", "pad_fused_q_heads")(q, out)
    e = q.element_size()
    _fn("dsv41_pad_fused_q_heads")(
        _ptr(q), T, H, D, q.stride(0) * e,
        _ptr(out), Hp, out.stride(0) * e, e,
    )
    return None
