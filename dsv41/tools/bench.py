"""``python -m dsv41 bench``: time every runnable implementation of every op.

For each op (and record variant: ``quantize_and_insert_k_cache [528]``), each
implementation the registry can run on this machine's device, and each token
count, the kernel function is called directly with kernel-contract arguments
(docs/kernel_contract.md) built here at V4.1 production shapes, outputs
preallocated once.  Reported per row:

* ``seconds``: median over timed calls after warm-up (CPU ``perf_counter``;
  GPU events around each call, each call preceded by an L2 eviction and a short
  device sleep, so the events see a cold L2 and no host launch gap);
* ``host_seconds`` (tokens <= 64): wall time per call of the kernel function, calls made
  back to back, the median of ``HOST_BLOCKS`` blocks of them (on GPUs the launch path and
  argument handling: the device never makes the host wait; on the CPU the kernel's work
  included);
* ``host_public_seconds`` (tokens <= 64, the implementation the registry selects): the same
  for the public function with vLLM's signature on the same arguments
  (``dsv41.tools.public_calls``): argument checks, output allocation and dispatch included, so
  ``host_public_seconds - host_seconds`` is what a public call adds to its kernel;
* ``graph_seconds`` (CUDA, tokens <= 64): median per-call time of CUDA-graph
  replay (``GRAPH_CALLS`` calls captured in one graph);
* ``bytes``: what the op must read and write by its contract (payload, index
  and metadata tensors, each token's cos/sin row; small per-call tensors such
  as norm weights and block tables counted once);
* ``gbps`` = bytes / seconds; ``copy_gbps``: a ``dst.copy_(src)`` of a uint8
  buffer of ``bytes/2`` (read + write = the op's bytes) timed the same way right
  after the op on the same device; ``fraction_of_copy`` = gbps / copy_gbps;
  ``graph_fraction_of_copy`` = copy graph time / op graph time (CUDA, <= 64 tokens);
* ``speedup_vs_reference`` = reference seconds / seconds at the same size (the
  reference is skipped where it would take more than ``REFERENCE_LIMIT_S`` per
  call, except on CPU at <= 16384 tokens, where it always runs).

Inputs are generated on the device from a seed (no per-token Python loops):
64-token pages in scrambled order, gathers over 4 requests of ``tokens/4``
rows, decode-sized insertions (<= 64 tokens) scattered one token per page.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import statistics
import sys
import time
import zlib
from collections.abc import Callable

import torch

from ..core import platform as _platform
from ..core import registry
from .public_calls import public_call
from ..core.formats import DEFAULT_V41_LAYOUT, interleaved_for

__all__ = ["DEFAULT_TOKENS_CPU", "DEFAULT_TOKENS_GPU", "VARIANTS", "main"]

DEFAULT_TOKENS_GPU = (1, 8, 64, 4096, 16384, 65536)
DEFAULT_TOKENS_CPU = (1, 8, 64, 4096, 16384)
DECODE_MAX = 64  # sizes up to this are "decode" (CUDA-graph timing, scattered slots)
BLOCK = 64  # cache block size (tokens per page)
REFERENCE_LIMIT_S = 20.0  # skip the reference where one call would take longer ...
CPU_REFERENCE_ALWAYS = 16384  # ... except on CPU at or below this many tokens
GRAPH_CALLS = 16  # kernel calls captured per CUDA graph
# Device sleep queued before each timed GPU call (~200 us at the H200's 1.98 GHz).  It must
# outlast the host's enqueueing of the whole call, or the events time the host's launch gaps:
# measured on the H200 with a 50 us sleep, CR 2's two launches (60-95 us of host time) read
# 30 us at 4096 and 16384 tokens against ~13 us of device time, and rope 528 up to 20 us at
# 4096 (docs/performance.md).
FLUSH_SLEEP_CYCLES = 400_000
WARMUP_CALLS, WARMUP_S = 3, 0.1  # warm-up: at least this many calls and this long
HOST_WARMUP_CALLS = 20  # untimed calls before a host-time measurement
HOST_BLOCKS = 5  # timed blocks of back-to-back calls per host-time measurement (the median)
SPIN_UP_S, SPIN_S = 3.0, 0.2  # accelerator load before the run / before each size (_Timer.spin)
MAX_POS = 65536  # rows of the cos/sin caches (positions wrap below it)

I32, I64, U8, BF16, F32 = torch.int32, torch.int64, torch.uint8, torch.bfloat16, torch.float32


# ----------------------------------------------------------------------------- inputs


@dataclasses.dataclass
class Case:
    args: tuple  # kernel-contract arguments, outputs preallocated
    bytes: int  # bytes the op must read + write


class _Gen:
    """Seeded generators on the bench device (deterministic per op, variant and size)."""

    def __init__(self, device: torch.device, seed: int):
        self.device = device
        self.g = torch.Generator(device=device)
        self.g.manual_seed(seed)

    def randn(self, *shape, dtype=F32, scale=1.0):
        x = torch.randn(shape, generator=self.g, device=self.device, dtype=F32)
        if scale != 1.0:
            x.mul_(scale)
        return x.to(dtype)

    def randint(self, low, high, *shape, dtype=I32):
        return torch.randint(low, high, shape, generator=self.g, device=self.device, dtype=dtype)

    def rand(self, *shape):
        return torch.rand(shape, generator=self.g, device=self.device)

    def randperm(self, n, dtype=I64):
        return torch.randperm(n, generator=self.g, device=self.device).to(dtype)

    def empty(self, *shape, dtype):
        return torch.empty(shape, dtype=dtype, device=self.device)

    def zeros(self, *shape, dtype):
        return torch.zeros(shape, dtype=dtype, device=self.device)

    def arange(self, n, dtype=I64):
        return torch.arange(n, dtype=dtype, device=self.device)


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _split(total: int, parts: int) -> list[int]:
    """``total`` rows over ``parts`` requests, as evenly as possible (first ones larger)."""
    q, r = divmod(total, parts)
    return [q + (i < r) for i in range(parts)]


def _insert_slots(gen: _Gen, t: int) -> tuple[torch.Tensor, int]:
    """int64 slot mapping of ``t`` tokens and the number of pages it needs.

    Decode sizes: one token per page (each token its own request), pages and
    in-page rows random.  Prefill sizes: one sequence filling pages in a
    scrambled page order.
    """
    if t <= DECODE_MAX:
        pages = gen.randperm(t + 1)[:t]
        return pages * BLOCK + gen.randint(0, BLOCK, t, dtype=I64), t + 1
    n_pages = _cdiv(t, BLOCK)
    pages = gen.randperm(n_pages)
    tok = gen.arange(t)
    return pages[tok // BLOCK] * BLOCK + tok % BLOCK, n_pages


def _positions(gen: _Gen, t: int) -> torch.Tensor:
    if t <= DECODE_MAX:
        return gen.randint(0, MAX_POS, t, dtype=I64)
    return gen.arange(t) % MAX_POS


def _cos_sin(gen: _Gen, rope_dim: int = 64) -> torch.Tensor:
    """``[MAX_POS, rope_dim]`` fp32, cos half then sin half (spec R §1.1)."""
    half = rope_dim // 2
    inv_freq = 1.0 / (10000.0 ** (torch.arange(half, dtype=F32, device=gen.device) / half))
    ang = torch.arange(MAX_POS, dtype=F32, device=gen.device).unsqueeze(1) * inv_freq
    return torch.cat([ang.cos(), ang.sin()], dim=1).contiguous()


def _fp8_bytes(gen: _Gen, n: int) -> torch.Tensor:
    """``n`` valid (finite) e4m3fn codes as uint8."""
    return gen.randn(n, scale=8.0).clamp(-448, 448).to(torch.float8_e4m3fn).view(U8)


def _filled_k_cache(gen: _Gen, n_pages: int, width: int, interleaved: bool = False) -> torch.Tensor:
    """A ``[n_pages, BLOCK, width]`` paged K cache of plausible records (finite values)."""
    from ..core.formats import record_for_width

    rec = record_for_width(width)
    cache = gen.empty(n_pages, BLOCK, width, dtype=U8)
    pages = cache.view(n_pages, BLOCK * width)
    vb, sb = BLOCK * rec.value_bytes, BLOCK * rec.scale_bytes
    values = pages[:, :vb]
    if rec.holds_fp8:
        values.copy_(_fp8_bytes(gen, n_pages * vb).view(n_pages, vb))
    else:  # packed e2m1: every byte is a valid pair of codes
        values.copy_(gen.randint(0, 256, n_pages, vb, dtype=U8))
    if rec.bf16_dims:  # V4 record: the RoPE dims are raw bf16 after the fp8 bytes
        v = values.view(n_pages, BLOCK, rec.value_bytes)
        v[:, :, rec.quant_dims :].copy_(gen.randn(n_pages, BLOCK, rec.bf16_dims, dtype=BF16).view(U8))
    scales = pages[:, vb : vb + sb]
    if rec.scale == "ue8m0":
        scales.copy_(gen.randint(118, 131, n_pages, sb, dtype=U8))
    else:  # NVFP4 block scales are positive e4m3 values around 1
        scales.copy_(gen.randint(0x30, 0x41, n_pages, sb, dtype=U8))
    pages[:, vb + sb :].zero_()
    if interleaved:  # the same records at their interleaved places
        from ..transcode import _record_order

        order = _record_order(width, BLOCK, True).to(pages.device)
        moved = pages.clone()
        pages[:, order] = moved[:, : BLOCK * width]
    return cache


def _build_quantize_insert(gen: _Gen, t: int, width: int, plat) -> Case:
    k = gen.randn(t, 512, dtype=BF16)
    slots, n_pages = _insert_slots(gen, t)
    cache = gen.zeros(n_pages, BLOCK, width, dtype=U8)
    nbytes = t * 512 * 2 + t * 8 + t * width
    return Case((k, cache, slots, BLOCK, False, width, interleaved_for(width, DEFAULT_V41_LAYOUT)), nbytes)


def _build_gather(gen: _Gen, t: int, width: int, plat) -> Case:
    reqs = min(4, t)
    lens = _split(t, reqs)
    max_blocks = _cdiv(max(lens), BLOCK)
    table = gen.randperm(reqs * max_blocks, dtype=I32).view(reqs, max_blocks).contiguous()
    cache = _filled_k_cache(gen, reqs * max_blocks, width, interleaved_for(width, DEFAULT_V41_LAYOUT))
    out = gen.empty(reqs, max(lens), 512, dtype=BF16)
    seq_lens = torch.tensor(lens, dtype=I32, device=gen.device)
    nbytes = t * width + t * 512 * 2 + reqs * 4 + table.numel() * 4
    return Case((out, cache, seq_lens, None, table, BLOCK, 0, False, interleaved_for(width, DEFAULT_V41_LAYOUT)), nbytes)


def _build_transcode(gen: _Gen, t: int, width: int, plat) -> Case:
    """OCP -> FNUZ over the pages holding t tokens (read and write every record byte)."""
    n_pages = _cdiv(t, BLOCK)
    src = _filled_k_cache(gen, n_pages, width)
    dst = gen.zeros(n_pages, BLOCK, width, dtype=U8)
    ids = gen.arange(n_pages)
    nbytes = 2 * n_pages * BLOCK * width + n_pages * 8
    return Case((src, dst, ids, BLOCK, width, False, True, False), nbytes)


TOPK_GLOBAL = 2048  # compute_global_topk_indices_and_lens: top-k width per token
COMPRESSED_CTX = 16384  # compressed tokens per request the local indices point into


def _build_global_topk(gen: _Gen, t: int, compact: bool, plat) -> Case:
    reqs = t if t <= DECODE_MAX else 4
    width = COMPRESSED_CTX // BLOCK
    table = gen.randperm(reqs * width, dtype=I32).view(reqs, width).contiguous()
    idx = gen.randint(0, COMPRESSED_CTX, t, TOPK_GLOBAL)
    idx.masked_fill_(gen.rand(t, TOPK_GLOBAL) < 0.03, -1)  # a few holes
    t2r = (gen.arange(t) * reqs // t).to(I32)
    valid = torch.ones(t, dtype=torch.bool, device=gen.device)
    out = gen.empty(t, TOPK_GLOBAL, dtype=I32)
    lens = gen.empty(t, dtype=I32)
    nbytes = t * TOPK_GLOBAL * 4 * 2 + t * 4 + t + t * 4 + table.numel() * 4
    return Case((idx, t2r, table, BLOCK, valid, out, lens, compact), nbytes)


TOPK_SPARSE = 512  # combine / flashinfer: compressed top-k per token
WINDOW = 128  # SWA window
CR_SPARSE = 4  # compress ratio of the compressed sparse layer
PREFIX = 8192  # tokens already in each request's cache before the chunk


def _prefill_batch(gen: _Gen, t: int):
    """Requests of a prefill chunk: (reqs, query lens, query_start_loc, seq_lens, token->req)."""
    reqs = min(4, t)
    qlens = _split(t, reqs)
    qsl = torch.tensor([0] + list(_cumsum(qlens)), dtype=I32, device=gen.device)
    seq = [PREFIX + q for q in qlens]
    seq_lens = torch.tensor(seq, dtype=I32, device=gen.device)
    t2r = torch.repeat_interleave(
        torch.arange(reqs, dtype=I32, device=gen.device), torch.tensor(qlens, device=gen.device)
    )
    return reqs, qlens, qsl, seq, seq_lens, t2r


def _cumsum(xs):
    s = 0
    for x in xs:
        s += x
        yield s


def _build_combine(gen: _Gen, t: int, plat) -> Case:
    reqs, qlens, qsl, seq, seq_lens, _ = _prefill_batch(gen, t)
    glens = [min(L, q + WINDOW - 1) for L, q in zip(seq, qlens)]
    gather_lens = torch.tensor(glens, dtype=I32, device=gen.device)
    n = _cdiv(max(seq) // CR_SPARSE, BLOCK) * BLOCK
    m = n + _cdiv(max(glens), BLOCK) * BLOCK
    topk = gen.randint(0, PREFIX // CR_SPARSE, t, TOPK_SPARSE)
    w_out = _cdiv(TOPK_SPARSE + WINDOW, 128) * 128
    out = gen.empty(t, w_out, dtype=I32)
    lens = gen.empty(t, dtype=I32)
    nbytes = t * TOPK_SPARSE * 4 + t * w_out * 4 + t * 4 + reqs * 4 * 3
    return Case((topk, qsl, seq_lens, gather_lens, WINDOW, CR_SPARSE, TOPK_SPARSE, m, n, out, lens), nbytes)


def _build_flashinfer(gen: _Gen, t: int, plat) -> Case:
    reqs, _, qsl, seq, seq_lens, t2r = _prefill_batch(gen, t)
    swa_w = _cdiv(max(seq), BLOCK)
    swa_table = gen.randperm(reqs * swa_w, dtype=I32).view(reqs, swa_w).contiguous()
    comp_ctx = max(seq) // CR_SPARSE
    comp_w = _cdiv(comp_ctx, BLOCK)
    comp_table = gen.randperm(reqs * comp_w, dtype=I32).view(reqs, comp_w).contiguous()
    prefill_topk = gen.randint(0, PREFIX // CR_SPARSE, t, TOPK_SPARSE)
    decode_swa = gen.empty(0, WINDOW, dtype=I32)
    replay_start = gen.zeros(reqs, dtype=I32)
    width = WINDOW + _cdiv(TOPK_SPARSE, 4) * 4
    out = gen.empty(t, width, dtype=I32)
    lens = gen.empty(t, dtype=I32)
    nbytes = (
        t * TOPK_SPARSE * 4 + t * 4 + t * width * 4 + t * 4 + reqs * 4 * 3
        + swa_table.numel() * 4 + comp_table.numel() * 4
    )
    args = (
        decode_swa, None, None, prefill_topk, qsl, seq_lens, t2r, swa_table, BLOCK, comp_table, BLOCK,
        WINDOW, CR_SPARSE, TOPK_SPARSE, False, None, BLOCK, BLOCK, replay_start, out, lens,
    )
    return Case(args, nbytes)


def _build_save_compress(gen: _Gen, t: int, plat) -> Case:
    kv = gen.randn(t, 512)
    positions = _positions(gen, t)
    slots = gen.arange(t)
    weight = gen.randn(512, dtype=BF16)
    latent = gen.empty(t, 512, dtype=BF16)
    nbytes = t * 512 * 4 + t * 8 * 2 + 512 * 2 + t * 512 * 2
    return Case((kv, positions, None, slots, None, None, weight, 1e-6, 1, latent), nbytes)


def _build_save_compress_cr2(gen: _Gen, t: int, plat) -> Case:
    """CR 2 prefill: consecutive positions per request (odd starts pool with the ring row)."""
    reqs, qlens, qsl, _, _, t2r = _prefill_batch(gen, t)
    cap = 4  # ring rows per request
    starts = [PREFIX + 1 + 2 * r for r in range(reqs)]  # odd first position: reads the ring
    positions = torch.cat([torch.arange(s, s + q, dtype=I64, device=gen.device)
                           for s, q in zip(starts, qlens)])
    ring_block = gen.randperm(reqs)
    slots = ring_block[t2r.long()] * cap + positions % cap
    kv = gen.randn(t, 1024)
    state = gen.randn(reqs, cap, 1024)
    weight = gen.randn(512, dtype=BF16)
    latent = gen.empty(t, 512, dtype=BF16)
    closing = t // 2
    # rows + positions, slots, token->request; closing rows out; one ring row read per
    # request (odd start); the last min(q, cap) rows of each request saved to the ring
    nbytes = (t * 1024 * 4 + t * 8 * 2 + t * 4 + 512 * 2 + closing * 512 * 2
              + reqs * 1024 * 4 + sum(min(cap, q) for q in qlens) * 1024 * 4)
    return Case((kv, positions, state, slots, qsl, t2r, weight, 1e-6, 2, latent), nbytes)


def _build_save_compress_cr2_prev(gen: _Gen, t: int, plat) -> Case:
    """CR 2 prefill with ``prev_rows`` (vLLM 0.33): every other request's first token pools
    with a row of ``prev_rows``, the others' with their ring row; the op writes no ring row
    (the caller saves them with ``save_ring_rows``)."""
    kv, positions, state, slots, qsl, t2r, weight, eps, cr, latent = _build_save_compress_cr2(gen, t, plat).args
    reqs = qsl.numel() - 1
    prev_rows = gen.randn(2 * reqs, 1024)
    prev_idx = gen.randperm(2 * reqs)[:reqs].to(I32)
    prev_idx[::2] = -1  # the ring row
    nbytes = (t * 1024 * 4 + t * 8 * 2 + t * 4 + 512 * 2 + (t // 2) * 512 * 2
              + reqs * (1024 * 4 + 4))
    return Case((kv, positions, state, slots, qsl, t2r, weight, eps, cr, latent, prev_rows,
                 prev_idx), nbytes)


def _build_save_ring_rows(gen: _Gen, t: int, plat) -> Case:
    """Every row to a distinct ring slot (rows gathered from other ranks, stored after pooling)."""
    cap = 4
    rows = gen.randn(t, 1024)
    slots = gen.randperm(t).to(I64)
    state = gen.randn(_cdiv(t, cap), cap, 1024)
    nbytes = 2 * t * 1024 * 4 + t * 8
    return Case((rows, slots, state), nbytes)


def _build_rope_quant_insert(gen: _Gen, t: int, variant: str, plat) -> Case:
    latent = gen.randn(t, 512, dtype=BF16)
    positions = _positions(gen, t)
    cos_sin = _cos_sin(gen)
    slots, n_pages = _insert_slots(gen, t)
    if variant == "bf16":
        cache = gen.zeros(n_pages, BLOCK, 512, dtype=BF16)
        written = 1024
    else:
        cache = gen.zeros(n_pages, BLOCK, int(variant), dtype=U8)
        written = int(variant)
    sanitize = plat.arch == "gfx950"
    nbytes = t * 1024 + t * 8 * 2 + t * 64 * 4 + t * written
    interleaved = variant != "bf16" and interleaved_for(int(variant), DEFAULT_V41_LAYOUT)
    return Case((latent, positions, cos_sin, cache, slots, 1, None, sanitize, interleaved), nbytes)


def _build_indexer_k(gen: _Gen, t: int, plat) -> Case:
    k_pre = gen.randn(t, 128, dtype=BF16)
    positions = _positions(gen, t)
    cos_sin = _cos_sin(gen)
    weight = gen.randn(128, dtype=BF16)
    slots, n_pages = _insert_slots(gen, t)
    cache = gen.zeros(n_pages, BLOCK, 132, dtype=U8)
    nbytes = t * 128 * 2 + t * 8 * 2 + t * 64 * 4 + 128 * 2 + t * 132
    return Case((k_pre, positions, cos_sin, weight, 1e-6, cache, slots, 1, False, 0, plat.is_rocm), nbytes)


INDEXER_HEADS, INDEXER_DIM = 64, 128


def _build_indexer_q(gen: _Gen, t: int, fp4: bool, plat) -> Case:
    """FP8 (the platform's flavour, fp32 weights) or MXFP4 (packed e2m1 + ue8m0, bf16 weights)."""
    h, d = INDEXER_HEADS, INDEXER_DIM
    positions = _positions(gen, t)
    q = gen.randn(t, h, d, dtype=BF16)
    cos_sin = _cos_sin(gen)
    weights = gen.randn(t, h, dtype=BF16)
    fnuz = plat.fp8_flavour.fnuz and not fp4
    if fp4:
        q_out = gen.empty(t, h, d // 2, dtype=U8)
        scale_out = gen.empty(t, h, d // 32, dtype=U8)
        w_out = gen.empty(t, h, dtype=BF16)
        out_bytes = t * h * (d // 2 + d // 32) + t * h * 2
    else:
        q_out = gen.empty(t, h, d, dtype=torch.float8_e4m3fnuz if fnuz else torch.float8_e4m3fn)
        scale_out = gen.empty(0, dtype=U8)
        w_out = gen.empty(t, h, dtype=F32)
        out_bytes = t * h * d + t * h * 4
    nbytes = t * 8 + t * 64 * 4 + t * h * d * 2 + t * h * 2 + out_bytes
    return Case((positions, q, cos_sin, weights, d ** -0.5, h ** -0.5, fp4, fnuz, q_out, scale_out, w_out), nbytes)


INV_GROUPS, INV_HEADS_PER_GROUP, INV_QGS = 2, 8, 128


def _build_inv_rope(gen: _Gen, t: int, plat) -> Case:
    g, hpg, qgs = INV_GROUPS, INV_HEADS_PER_GROUP, INV_QGS
    o = gen.randn(t, g * hpg, 512, dtype=BF16)
    positions = _positions(gen, t)
    cos_sin = _cos_sin(gen)
    dg = hpg * 512
    ta = _cdiv(t, 4) * 4
    k = dg // qgs
    out = gen.empty(g, t, dg, dtype=torch.float8_e4m3fn)
    scale = gen.empty(g, k * ta, dtype=F32)
    nbytes = t * g * hpg * 512 * 2 + t * 8 + t * 64 * 4 + t * g * dg + g * k * ta * 4
    return Case((o, positions, cos_sin, g, hpg, 448, 64, qgs, False, True, False, out, scale), nbytes)


QS, KS = 1536, 512


def _build_q_kv_rmsnorm(gen: _Gen, t: int, plat) -> Case:
    qr = gen.randn(t, QS, dtype=BF16)
    kv = gen.randn(t, KS, dtype=BF16)
    qw = gen.randn(QS, dtype=BF16)
    kw = gen.randn(KS, dtype=BF16)
    tp, gp = _cdiv(t, 128) * 128, _cdiv(QS // 32, 4) * 4
    q_out = gen.empty(t, QS, dtype=torch.float8_e4m3fn)
    q_scale = gen.empty(tp * gp, dtype=U8)
    kv_out = gen.empty(t, KS, dtype=BF16)
    nbytes = t * (QS + KS) * 2 + (QS + KS) * 2 + t * QS + tp * gp + t * KS * 2
    return Case((qr, kv, qw, kw, 1e-6, q_out, q_scale, kv_out), nbytes)


PAD_FROM, PAD_TO = 8, 16


def _build_pad_q(gen: _Gen, t: int, plat) -> Case:
    q = gen.randn(t, PAD_FROM, 512, dtype=BF16)
    out = gen.empty(t, PAD_TO, 512, dtype=BF16)
    return Case((q, out), t * PAD_FROM * 1024 + t * PAD_TO * 1024)


@dataclasses.dataclass(frozen=True)
class Variant:
    op: str  # registry op name
    variant: str | None  # record / row format, None when the op has one shape
    build: Callable  # (gen, tokens, platform) -> Case

    @property
    def name(self) -> str:
        return self.op if self.variant is None else f"{self.op} [{self.variant}]"


def _with(fn, *extra):
    return lambda gen, t, plat: fn(gen, t, *extra, plat)


VARIANTS = (
    Variant("quantize_and_insert_k_cache", "584", _with(_build_quantize_insert, 584)),
    Variant("quantize_and_insert_k_cache", "528", _with(_build_quantize_insert, 528)),
    Variant("dequantize_and_gather_k_cache", "584", _with(_build_gather, 584)),
    Variant("dequantize_and_gather_k_cache", "528", _with(_build_gather, 528)),
    Variant("dequantize_and_gather_k_cache", "288", _with(_build_gather, 288)),
    Variant("compute_global_topk_indices_and_lens", None, _with(_build_global_topk, False)),
    Variant("compute_global_topk_indices_and_lens", "compact", _with(_build_global_topk, True)),
    Variant("combine_topk_swa_indices", None, _build_combine),
    Variant("build_flashinfer_mixed_sparse_indices", None, _build_flashinfer),
    Variant("fused_save_compress_norm", "CR1", _build_save_compress),
    Variant("fused_save_compress_norm", "CR2", _build_save_compress_cr2),
    Variant("fused_save_compress_norm", "CR2 prev", _build_save_compress_cr2_prev),
    Variant("save_ring_rows", None, _build_save_ring_rows),
    Variant("rope_quant_insert", "584", _with(_build_rope_quant_insert, "584")),
    Variant("rope_quant_insert", "528", _with(_build_rope_quant_insert, "528")),
    Variant("rope_quant_insert", "288", _with(_build_rope_quant_insert, "288")),
    Variant("rope_quant_insert", "bf16", _with(_build_rope_quant_insert, "bf16")),
    Variant("indexer_k_norm_rope_store", "FP8", _build_indexer_k),
    Variant("fused_indexer_q_rope_quant", "FP8", _with(_build_indexer_q, False)),
    Variant("fused_indexer_q_rope_quant", "MXFP4", _with(_build_indexer_q, True)),
    Variant("fused_inv_rope_fp8_quant", None, _build_inv_rope),
    Variant("fused_q_kv_rmsnorm_quant", None, _build_q_kv_rmsnorm),
    Variant("pad_fused_q_heads", None, _build_pad_q),
    Variant("transcode_k_cache", "528", _with(_build_transcode, 528)),
)
if {v.op for v in VARIANTS} != set(registry.OPS):  # a new op must get a benchmark shape
    raise RuntimeError("every registry op needs a bench variant")


# ----------------------------------------------------------------------------- timing


class _Timer:
    """Times calls on one device: perf_counter on CPU, events on GPUs, CUDA-graph replay on CUDA."""

    def __init__(self, device: torch.device, repeats: int, budget_s: float):
        self.device = device
        self.repeats = max(1, repeats)
        # The copy baseline is cheap: always take at least this many samples of it.
        self.copy_repeats = max(self.repeats, 25)
        self.budget = budget_s
        self.accel = device.type != "cpu"
        self.mod = getattr(torch, device.type) if self.accel else None
        self._flush_buf = None

    def _cold(self) -> None:
        """Before a timed GPU call: evict the L2 cache (overwrite a buffer twice its size) and,
        on CUDA, queue a short device-side sleep.  The call is then timed with a cold L2 like a
        serving engine's first touch of a big cache, and the host has enqueued it before the
        GPU reaches the start event, so the events measure the kernel and not the Python
        launch path (per-call host time is what ``host_seconds`` reports)."""
        if self._flush_buf is None:
            l2 = 0
            if self.device.type == "cuda":
                l2 = getattr(torch.cuda.get_device_properties(self.device), "L2_cache_size", 0)
            nbytes = max(2 * l2, 128 << 20)
            self._flush_buf = torch.empty(nbytes, dtype=U8, device=self.device)
        self._flush_buf.zero_()
        if self.device.type == "cuda":
            torch.cuda._sleep(FLUSH_SLEEP_CYCLES)

    def sync(self):
        if self.accel:
            self.mod.synchronize(self.device)

    def spin(self, seconds: float) -> None:
        """Keep an accelerator busy (bf16 matmuls) for about ``seconds``, so the timings that
        follow run at its loaded clocks.  An idle GPU sits at a low SM clock (the H200 was
        seen at 345 MHz) and ramps up under load; without this, the first measurements of a
        compute-heavy kernel come out slow while the copy it is compared with (bound by
        memory, not SM clock) does not."""
        if not self.accel:
            return
        a = torch.ones(2048, 2048, dtype=BF16, device=self.device)
        end = time.perf_counter() + seconds
        while time.perf_counter() < end:
            for _ in range(8):
                a = torch.mm(a, a).clamp_(-1, 1)
            self.sync()

    def _count(self, est: float, repeats: int) -> int:
        floor = 1 if est > 2.0 else 3
        return max(1, min(repeats, max(floor, int(self.budget / max(est, 1e-9)))))

    def eager(self, fn: Callable[[], None], repeats: int | None = None) -> tuple[float, int]:
        """(median seconds per call, number of timed calls)."""
        t0 = time.perf_counter()
        fn()  # warm-up (compiles, allocates caches, starts thread pools)
        self.sync()
        first = time.perf_counter() - t0
        if first > 2.0:  # JIT compilation, or a genuinely slow call: a second call tells which
            t0 = time.perf_counter()
            fn()
            self.sync()
            second = time.perf_counter() - t0
            if second > 2.0:  # slow: this call is the (only) sample, as one more would be
                return second, 1
        # Keep warming for >= WARMUP_CALLS calls and >= WARMUP_S seconds: the first calls at
        # a new size can be 100x slower (allocator growth, thread-pool start, autotuning).
        warm, start = [], time.perf_counter()
        while len(warm) < WARMUP_CALLS or (time.perf_counter() - start < WARMUP_S and len(warm) < 1000):
            t0 = time.perf_counter()
            fn()
            self.sync()
            warm.append(time.perf_counter() - t0)
        est = statistics.median(warm)
        n = self._count(est, repeats or self.repeats)
        if not self.accel:
            times = []
            for _ in range(n):
                t0 = time.perf_counter()
                fn()
                times.append(time.perf_counter() - t0)
            return statistics.median(times), n
        ev = self.mod.Event
        starts = [ev(enable_timing=True) for _ in range(n)]
        ends = [ev(enable_timing=True) for _ in range(n)]
        for s, e in zip(starts, ends):
            self._cold()
            s.record()
            fn()
            e.record()
        self.sync()
        return statistics.median(s.elapsed_time(e) / 1e3 for s, e in zip(starts, ends)), n

    def host(self, fn: Callable[[], None], calls: int = 200) -> float:
        """Host seconds per call when ``calls`` calls are enqueued back to back (first behind a
        ~1 ms device-side sleep, so the earliest launches do not find an idle GPU): the launch
        path's own cost, argument handling included.  Launches are asynchronous and these
        kernels are short, so the host never waits for the device here.  A few untimed calls
        first, so one-time costs (first-use lookups, allocator growth) are not spread over the
        timed ones.  The median of ``HOST_BLOCKS`` such blocks: one block that meets a garbage
        collection or another process's burst on the host says nothing about the call."""
        for _ in range(HOST_WARMUP_CALLS):
            fn()
        self.sync()
        blocks = []
        for _ in range(HOST_BLOCKS):
            if self.device.type == "cuda":
                torch.cuda._sleep(FLUSH_SLEEP_CYCLES * 5)
            t0 = time.perf_counter()
            for _ in range(calls):
                fn()
            blocks.append((time.perf_counter() - t0) / calls)
            self.sync()
        return statistics.median(blocks)

    def graph(self, fn: Callable[[], None]) -> float:
        """Median seconds per call when GRAPH_CALLS calls are replayed from one CUDA graph."""
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):
            for _ in range(2):
                fn()
        torch.cuda.current_stream(self.device).wait_stream(side)
        self.sync()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            for _ in range(GRAPH_CALLS):
                fn()
        g.replay()
        self.sync()
        n = max(5, min(self.repeats, 50))
        starts = [torch.cuda.Event(enable_timing=True) for _ in range(n)]
        ends = [torch.cuda.Event(enable_timing=True) for _ in range(n)]
        for s, e in zip(starts, ends):
            s.record()
            g.replay()
            e.record()
        self.sync()
        med = statistics.median(s.elapsed_time(e) / 1e3 for s, e in zip(starts, ends))
        del g
        return med / GRAPH_CALLS


# ----------------------------------------------------------------------------- running


@dataclasses.dataclass
class Impl:
    name: str
    fn: Callable


def _expand_backend_names(names) -> set:
    """``--backend`` takes every name ``DSV41_BACKEND`` does: a family ("cuda") means its variants."""
    valid = registry.backend_names()
    out = set()
    for n in names:
        if n not in valid:
            raise ValueError(f"--backend {n!r} is not a backend name; valid names: {', '.join(valid)}")
        out.update(b.name for b in registry._backends() if n in (b.name, b.family))
    return out


def _implementations(op: str, plat, device_type: str) -> tuple[list[Impl], dict]:
    """Backends that can run ``op`` on ``device_type`` here, in registry order; and why the others cannot."""
    impls, why_not = [], {}
    for b in registry.candidates(op, plat):
        if b.device_type not in (None, device_type):
            why_not[b.name] = [f"runs on {b.device_type} tensors, bench device is {device_type}"]
            continue
        why = b.reasons(op, plat)
        if why:
            why_not[b.name] = why
            continue
        try:
            fn = b.load(op)
        except Exception as exc:  # a broken kernel module must not stop the bench
            why_not[b.name] = [f"failed to load: {type(exc).__name__}: {exc}"]
            continue
        impls.append(Impl(b.name, fn))
    return impls, why_not


def _selected(op: str, device_type: str):
    """The kernel the public function of ``op`` runs on ``device_type`` (None if none)."""
    try:
        return registry.kernel(op, device_type)
    except registry.BackendUnavailable:
        return None


class _Progress:
    """A plain-text progress bar on stderr (one line per step when stderr is not a terminal)."""

    def __init__(self, total: int, stream=None, width: int = 30):
        self.total = max(1, total)
        self.done = 0
        self.stream = stream or sys.stderr
        self.width = width
        self.tty = hasattr(self.stream, "isatty") and self.stream.isatty()
        self.t0 = time.perf_counter()

    def step(self, label: str):
        self.done += 1
        frac = min(1.0, self.done / self.total)
        fill = round(frac * self.width)
        bar = "#" * fill + "." * (self.width - fill)
        line = f"[{bar}] {self.done}/{self.total} {time.perf_counter() - self.t0:6.1f}s {label}"
        if self.tty:
            self.stream.write("\r\033[K" + line[:160])
        else:
            self.stream.write(line + "\n")
        self.stream.flush()

    def note(self, msg: str):
        self.stream.write(("\r\033[K" if self.tty else "") + msg + "\n")
        self.stream.flush()

    def close(self):
        if self.tty:
            self.stream.write("\n")
            self.stream.flush()


def _device_label(plat, device: torch.device) -> str:
    if device.type == "cpu":
        return "cpu"
    name = plat.device_name or device.type
    return f"{name} ({plat.arch})"


def _measure_copy(timer: _Timer, device: torch.device, nbytes: int, graph: bool):
    half = max(1, nbytes // 2)
    src = torch.empty(half, dtype=U8, device=device)
    src.fill_(7)
    dst = torch.empty_like(src)

    def fn():
        dst.copy_(src)

    sec, _ = timer.eager(fn, timer.copy_repeats)
    gsec = None
    if graph:
        try:
            gsec = timer.graph(fn)
        except Exception:
            gsec = None
    return sec, gsec


def _seed(base: int, variant: Variant, tokens: int) -> int:
    return (zlib.crc32(f"{variant.name}|{tokens}".encode()) + base) % (2**63)


def _select_variants(requested: list[str] | None) -> list[Variant]:
    if not requested:
        return list(VARIANTS)
    chosen = []
    for r in requested:
        key = r.strip()
        op, _, var = key.replace("[", ":").replace("]", "").replace(" ", "").partition(":")
        hits = [v for v in VARIANTS if v.op == op and (not var or (v.variant or "").lower() == var.lower())]
        if not hits:
            names = sorted({v.op for v in VARIANTS})
            raise ValueError(
                f"unknown op {r!r}; ops: {', '.join(names)} "
                f"(pick one record with OP:VARIANT, e.g. quantize_and_insert_k_cache:528)"
            )
        chosen.extend(h for h in hits if h not in chosen)
    return chosen


def _fmt(x, spec):
    return "-" if x is None else format(x, spec)


def _table(records: list[dict]) -> str:
    head = ("op", "backend", "tokens", "frac_copy", "graph_frac", "vs_ref", "us", "graph_us", "host_us",
            "call_us", "GB/s", "copy_GB/s")
    rows = [
        (
            r["name"],
            r["backend"],
            str(r["tokens"]),
            _fmt(r["fraction_of_copy"], ".3f"),
            _fmt(r["graph_fraction_of_copy"], ".3f"),
            _fmt(r["speedup_vs_reference"], ".2f"),
            _fmt(r["seconds"] * 1e6, ".1f"),
            _fmt(None if r["graph_seconds"] is None else r["graph_seconds"] * 1e6, ".2f"),
            _fmt(None if r.get("host_seconds") is None else r["host_seconds"] * 1e6, ".1f"),
            _fmt(None if r.get("host_public_seconds") is None else r["host_public_seconds"] * 1e6, ".1f"),
            _fmt(r["gbps"], ".2f"),
            _fmt(r["copy_gbps"], ".2f"),
        )
        for r in records
    ]
    widths = [max(len(h), *(len(row[i]) for row in rows)) if rows else len(h) for i, h in enumerate(head)]
    lines = []
    for i, row in enumerate([head] + rows):
        cells = [c.ljust(w) if j < 2 else c.rjust(w) for j, (c, w) in enumerate(zip(row, widths))]
        lines.append("  ".join(cells).rstrip())
        if i == 0:
            lines.append("  ".join("-" * w for w in widths))
    return "\n".join(lines)


def _plot(records: list[dict], path: str) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as exc:
        raise RuntimeError(
            f"--plot needs matplotlib, which is not importable here ({exc}); "
            "install it (pip install 'dsv41[bench]') or use --json and plot elsewhere"
        ) from None
    names = list(dict.fromkeys(r["name"] for r in records))
    cols = min(3, max(1, len(names)))
    rows = _cdiv(len(names), cols)
    fig, axes = plt.subplots(rows, cols, figsize=(5.2 * cols, 3.4 * rows), squeeze=False)
    for ax, name in zip(axes.flat, names):
        mine = [r for r in records if r["name"] == name]
        for backend in dict.fromkeys(r["backend"] for r in mine):
            pts = sorted((r["tokens"], r["fraction_of_copy"]) for r in mine if r["backend"] == backend)
            line = ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=backend)[0]
            gpts = sorted((r["tokens"], r["graph_fraction_of_copy"]) for r in mine
                          if r["backend"] == backend and r.get("graph_fraction_of_copy"))
            if gpts:
                ax.plot([p[0] for p in gpts], [p[1] for p in gpts], marker="x", linestyle="--",
                        color=line.get_color(), label=f"{backend} (CUDA graph)")
        ax.set_xscale("log", base=2)
        ax.set_title(name, fontsize=9)
        ax.set_xlabel("tokens")
        ax.set_ylabel("fraction of copy")
        ax.set_ylim(bottom=0)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=7)
    for ax in list(axes.flat)[len(names) :]:
        ax.set_visible(False)
    dev = records[0]["device"] if records else ""
    fig.suptitle(f"dsv41 bench: bandwidth as a fraction of a same-size copy ({dev})")
    fig.tight_layout(rect=(0, 0, 1, 0.97))
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _profile(plan, tokens: list[int], device: torch.device, plat, seed: int) -> int:
    """One profiled call per (variant, implementation, size), references excluded: the kernels
    an ``ncu --profile-from-start off`` run sees are exactly these, in this printed order."""
    if device.type != "cuda":
        print("dsv41 bench: --profile needs --device cuda", file=sys.stderr)
        return 2
    for v, shown, _ in plan:
        for t in tokens:
            case = v.build(_Gen(device, _seed(seed, v, t)), t, plat)
            for impl in shown:
                if impl.name == "reference":
                    continue
                for _ in range(3):  # compile and warm up outside the profiled range
                    impl.fn(*case.args)
                torch.cuda.synchronize(device)
                torch.cuda.profiler.start()
                impl.fn(*case.args)
                torch.cuda.synchronize(device)
                torch.cuda.profiler.stop()
                print(f"profiled {v.name} {impl.name} tokens={t}", flush=True)
            case = None
            _free(device.type)
    return 0


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m dsv41 bench",
        description="Time every runnable implementation of every dsv41 op against a same-size copy "
        "and the reference.",
    )
    p.add_argument("--op", action="extend", nargs="+", metavar="OP",
                   help="ops to run (all by default); OP:VARIANT picks one record, e.g. "
                   "quantize_and_insert_k_cache:528")
    p.add_argument("--backend", action="extend", nargs="+", metavar="NAME",
                   help="implementations to report (all runnable by default), e.g. reference cpu cuda:triton")
    p.add_argument("--tokens", action="extend", nargs="+", type=int, metavar="N",
                   help="token counts (default: 1 8 64 4096 16384 65536 on GPUs, 1 8 64 4096 16384 on CPU)")
    p.add_argument("--json", metavar="PATH", help="write the records as a JSON list")
    p.add_argument("--plot", metavar="PATH", help="write a PNG of fraction-of-copy per op and size (matplotlib)")
    p.add_argument("--repeats", type=int, default=None, metavar="R",
                   help="most timed calls per measurement (default 50 on GPUs, 10 on CPU; "
                   "fewer when a call is slow)")
    p.add_argument("--budget", type=float, default=1.0, metavar="S",
                   help="target seconds of timed calls per measurement (default 1)")
    p.add_argument("--device", default=None, help="torch device type to bench on (default: the platform's)")
    p.add_argument("--no-reference", action="store_true",
                   help="do not run the reference for speedups (its own rows only if asked by --backend)")
    p.add_argument("--no-graph", action="store_true", help="skip CUDA-graph replay timing")
    p.add_argument("--threads", type=int, default=None, metavar="N",
                   help="torch CPU threads (torch.set_num_threads) for CPU runs")
    p.add_argument("--seed", type=int, default=0, help="input seed (default 0)")
    p.add_argument("--list", action="store_true", help="list the ops, variants and runnable backends, then exit")
    p.add_argument("--profile", action="store_true",
                   help="no timing: call each implementation a few times, then once between "
                   "cudaProfilerStart/Stop, for `ncu --profile-from-start off` (docs/gpu.md)")
    return p


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        variants = _select_variants(args.op)
    except ValueError as exc:
        print(f"dsv41 bench: {exc}", file=sys.stderr)
        return 2
    if args.threads:
        torch.set_num_threads(args.threads)
    plat = _platform.probe()
    dev_type = args.device or plat.device_type
    if dev_type != "cpu":
        mod = getattr(torch, dev_type, None)
        if mod is None or not mod.is_available():
            print(f"dsv41 bench: device {dev_type!r} is not available here (use --device cpu)", file=sys.stderr)
            return 2
    device = torch.device(dev_type, 0) if dev_type != "cpu" else torch.device("cpu")
    if dev_type == "cuda":
        torch.cuda.set_device(device)
    accel = dev_type != "cpu"
    tokens = sorted(set(args.tokens)) if args.tokens else list(DEFAULT_TOKENS_GPU if accel else DEFAULT_TOKENS_CPU)
    if any(t < 1 for t in tokens):
        print("dsv41 bench: --tokens must be >= 1", file=sys.stderr)
        return 2
    repeats = args.repeats if args.repeats is not None else (50 if accel else 10)
    timer = _Timer(device, repeats, args.budget)
    timer.spin(SPIN_UP_S)
    use_graph = dev_type == "cuda" and not args.no_graph
    wanted = None
    if args.backend:
        try:
            wanted = _expand_backend_names(args.backend)
        except ValueError as exc:
            print(f"dsv41 bench: {exc}", file=sys.stderr)
            return 2
    device_label = _device_label(plat, device)

    if args.list:
        for v in variants:
            impls, why_not = _implementations(v.op, plat, dev_type)
            print(f"{v.name}: {', '.join(i.name for i in impls) or '(none runnable)'}")
        return 0

    # Plan: per variant, the implementations to report, plus the reference for speedups.
    plan = []
    for v in variants:
        impls, why_not = _implementations(v.op, plat, dev_type)
        ref = next((i for i in impls if i.name == "reference"), None)
        shown = [i for i in impls if wanted is None or i.name in wanted]
        if wanted:
            for name in sorted(wanted - {i.name for i in impls}):
                reason = "; ".join(why_not.get(name, ["not a backend of this registry"]))
                print(f"dsv41 bench: {v.name}: {name} not runnable here ({reason})", file=sys.stderr)
        if not shown:
            continue
        run_ref = ref is not None and (not args.no_reference or ref in shown)
        plan.append((v, shown, ref if run_ref else None))

    if args.profile:
        return _profile(plan, tokens, device, plat, args.seed)

    total = sum(len(tokens) * (len(shown) + (ref is not None and ref not in shown)) for v, shown, ref in plan)
    progress = _Progress(total)
    records, errors = [], []
    graph_failed: set = set()
    for v, shown, ref in plan:
        last_ref = None  # (tokens, seconds) of the last reference run of this variant
        for t in tokens:
            timer.spin(SPIN_S)
            try:
                case = v.build(_Gen(device, _seed(args.seed, v, t)), t, plat)
                timer.sync()
            except Exception as exc:
                errors.append(f"{v.name} tokens={t}: building inputs failed: {type(exc).__name__}: {exc}")
                progress.done += len(shown) + (ref is not None and ref not in shown)
                progress.note(f"  {errors[-1]}")
                _free(dev_type)
                continue
            copy_cache: dict = {}
            ref_sec = None
            order = ([ref] if ref is not None else []) + [i for i in shown if i is not ref]
            for impl in order:
                is_ref = impl is ref
                progress.step(f"{v.name} {impl.name} T={t}")
                if is_ref and last_ref is not None:
                    est = last_ref[1] * t / last_ref[0]
                    always = not accel and t <= CPU_REFERENCE_ALWAYS
                    if est > REFERENCE_LIMIT_S and not always:
                        progress.note(f"  {v.name} T={t}: reference skipped (about {est:.0f} s per call)")
                        continue
                try:
                    call = functools.partial(impl.fn, *case.args)
                    sec, n = timer.eager(call)
                    gsec = hsec = psec = None
                    if t <= DECODE_MAX:
                        hsec = timer.host(call)
                        if impl.fn is _selected(v.op, dev_type):
                            fn, pargs, pkw = public_call(v.op, case.args)
                            psec = timer.host(functools.partial(fn, *pargs, **pkw))
                    if use_graph and t <= DECODE_MAX:
                        try:
                            gsec = timer.graph(call)
                        except Exception as exc:  # noqa: BLE001 - reported, the row keeps graph_seconds null
                            _recover(timer)
                            if (v.name, impl.name) not in graph_failed:
                                graph_failed.add((v.name, impl.name))
                                progress.note(f"  {v.name} {impl.name} T={t}: CUDA graph capture failed "
                                              f"(graph_seconds null): {_root_cause(exc)}")
                except Exception as exc:
                    errors.append(f"{v.name} {impl.name} tokens={t}: {type(exc).__name__}: {str(exc)[:300]}")
                    progress.note(f"  {errors[-1]}")
                    _free(dev_type)
                    continue
                if is_ref:
                    ref_sec = sec
                    last_ref = (t, sec)
                if impl not in shown:
                    continue
                if case.bytes not in copy_cache:
                    copy_cache[case.bytes] = _measure_copy(timer, device, case.bytes, use_graph and t <= DECODE_MAX)
                copy_sec, copy_gsec = copy_cache[case.bytes]
                gbps = case.bytes / sec / 1e9
                copy_gbps = case.bytes / copy_sec / 1e9
                records.append(
                    {
                        "op": v.op,
                        "variant": v.variant,
                        "name": v.name,
                        "backend": impl.name,
                        "tokens": t,
                        "seconds": sec,
                        "bytes": case.bytes,
                        "gbps": gbps,
                        "copy_gbps": copy_gbps,
                        "fraction_of_copy": gbps / copy_gbps,
                        "speedup_vs_reference": (ref_sec / sec) if ref_sec is not None else None,
                        "graph_seconds": gsec,
                        "copy_graph_seconds": copy_gsec,
                        "graph_fraction_of_copy": (copy_gsec / gsec) if gsec and copy_gsec else None,
                        "host_seconds": hsec,
                        "host_public_seconds": psec,
                        "timed_calls": n,
                        "device": device_label,
                    }
                )
            case = call = None  # free the inputs before the next size
            _free(dev_type)
    progress.close()

    if records:
        print(_table(records))
    else:
        print("dsv41 bench: nothing was measured", file=sys.stderr)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(records, f, indent=1)
    rc = 0 if records else 1
    if args.plot and records:
        try:
            _plot(records, args.plot)
        except RuntimeError as exc:
            print(f"dsv41 bench: {exc}", file=sys.stderr)
            rc = 2
    if errors:
        print(f"dsv41 bench: {len(errors)} measurement(s) failed:", file=sys.stderr)
        for e in errors:
            print(f"  {e}", file=sys.stderr)
        rc = rc or 1
    return rc


def _root_cause(exc: BaseException) -> str:
    """The first exception of a chain (a failed capture's own error hides the one that broke it)."""
    seen = exc
    while seen.__context__ is not None and seen.__context__ is not seen:
        seen = seen.__context__
    msg = f"{type(seen).__name__}: {str(seen).strip().splitlines()[0][:200] if str(seen).strip() else ''}"
    if seen is not exc:
        msg += f" (then {type(exc).__name__})"
    return msg


def _recover(timer: _Timer) -> None:
    try:
        timer.sync()
    except Exception:  # a sticky error from the failed capture surfaces here once
        pass


def _free(dev_type: str) -> None:
    if dev_type == "cuda":
        torch.cuda.empty_cache()


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
