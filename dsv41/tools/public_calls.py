"""The public call that a set of kernel-contract arguments stands for.

``public_call(op, args)`` returns ``(function, args, kwargs)``: the public function of ``op``
(vLLM's signature) and the arguments under which it runs its kernel on exactly ``args``
(outputs the public function allocates itself are left to it).  The bench times it against the
kernel alone (``host_public_seconds`` vs ``host_seconds``: what the public call adds), and the
vLLM side-by-side run calls vLLM's functions with the same arguments.
"""

from __future__ import annotations

from typing import Callable


def _layout(interleaved: bool) -> str:
    return "interleaved" if interleaved else "paged"


def _insert(a):
    k, cache, slots, block, fnuz, width, il = a
    return (k, cache, slots), dict(block_size=block, is_ue8m0=True, use_fnuz=fnuz, bytes_per_token=width,
                                   v41_layout=_layout(il))


def _gather(a):
    out, cache, seq, glens, table, block, offset, fnuz, il = a
    return (out, cache, seq, glens, table, block, offset, fnuz), dict(v41_layout=_layout(il))


def _global_topk(a):
    return tuple(a[:5]), dict(compact=a[7])


def _combine(a):
    return tuple(a[:9]), dict(out=(a[9], a[10]))


def _flashinfer(a):
    return tuple(a[:18]), dict(replay_start=a[18])


def _save_compress(a):
    return tuple(a[:12]), {}


def _rope_insert(a):
    latent, pos, cs, cache, slots, cr, scale, sanitize, il = a
    return (latent, pos, cs, cache, slots, cr, scale), dict(sanitize_nans=sanitize, v41_layout=_layout(il))


def _indexer_k(a):
    return tuple(a[:10]), dict(tiled=a[10])


def _indexer_q(a):
    pos, q, cs, w, ss, hs, fp4, _fnuz, q_out, _scale, w_out = a
    kw = dict(weights_out_dtype=w_out.dtype)
    if not fp4:
        kw["fp8_dtype"] = q_out.dtype
    return (pos, q, cs, w, ss, hs, fp4), kw


def _pad(a):
    return (a[0], a[1].shape[1]), {}


def _transcode(a):
    src, dst, ids, block, _width, sf, df, tiled = a
    return (src, dst, ids, sf, df, block), dict(tiled=tiled, src_v41_layout="paged", dst_v41_layout="paged")


def _leading(n: int):
    return lambda a: (tuple(a[:n]), {})


_ARGS = {
    "quantize_and_insert_k_cache": _insert,
    "dequantize_and_gather_k_cache": _gather,
    "compute_global_topk_indices_and_lens": _global_topk,
    "combine_topk_swa_indices": _combine,
    "build_flashinfer_mixed_sparse_indices": _flashinfer,
    "fused_save_compress_norm": _save_compress,
    "save_ring_rows": _leading(3),
    "rope_quant_insert": _rope_insert,
    "indexer_k_norm_rope_store": _indexer_k,
    "fused_indexer_q_rope_quant": _indexer_q,
    "fused_inv_rope_fp8_quant": _leading(11),
    "fused_q_kv_rmsnorm_quant": _leading(5),
    "pad_fused_q_heads": _pad,
    "transcode_k_cache": _transcode,
}


def public_function(op: str) -> Callable:
    if op == "transcode_k_cache":
        from ..transcode import transcode_k_cache

        return transcode_k_cache
    import dsv41

    return getattr(dsv41, op)


def public_call(op: str, args) -> tuple[Callable, tuple, dict]:
    """``(public function, args, kwargs)`` running ``op``'s kernel on the kernel arguments ``args``."""
    pos, kw = _ARGS[op](list(args))
    return public_function(op), pos, kw
