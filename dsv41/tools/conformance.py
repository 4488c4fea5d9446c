"""Conformance cases: kernel-contract arguments for every op, edge cases included.

Each ``Case`` builds the positional kernel arguments of one op (see
docs/kernel_contract.md) on a device, and names which arguments the kernel
writes.  Tests (``tests/test_conformance.py``) and ``python -m dsv41 check``
run an implementation and the reference on clones of the same arguments and
compare the written tensors' *whole storage* byte for byte, so stray writes
into canary bytes around the target slots show up as mismatches too.

Inputs cover: −1 slots and other negatives, DP padding rows (poisoned with
NaN: never read), partial pages, padded page strides, scrambled pages,
non-contiguous block tables, empty batches, zeros and −0, values at the fp8
max, e4m3 rounding ties, tiny/huge values, NaN/Inf, large positions.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Callable

import torch

from ..core import op_specs
from ..core.formats import RECORDS

__all__ = ["Case", "CASES", "cases_for", "clone_args", "written_bytes", "PIPELINE"]

I32, I64, BF16, F32, U8 = torch.int32, torch.int64, torch.bfloat16, torch.float32, torch.uint8
CANARY = 0xA5


@dataclasses.dataclass(frozen=True)
class Case:
    op: str
    name: str
    build: Callable  # (device) -> list of kernel args
    # positions of the args the kernel writes; by default every tensor its declaration
    # (dsv41.core.op_specs) marks as written, a subset where this case's mode writes fewer
    writes: tuple | None = None

    def __post_init__(self):
        if self.writes is None:
            object.__setattr__(self, "writes", op_specs.spec(self.op).writes)

    @property
    def id(self) -> str:
        return f"{self.op}[{self.name}]"


# --------------------------------------------------------------------------- values


def _gen(seed: int) -> torch.Generator:
    g = torch.Generator()
    g.manual_seed(seed)
    return g


def edge_rows(n: int, d: int, seed: int, nonfinite: bool = False) -> torch.Tensor:
    """bf16-valued fp32 rows cycling through value kinds; per-32-dim groups at varied scales."""
    g = _gen(seed)
    x = torch.randn(n, d, generator=g) * torch.exp2(torch.randint(-6, 7, (n, d // 32, 1), generator=g).float()).repeat_interleave(32, 1).view(n, d)
    kinds = [
        lambda r: r,  # normal
        lambda r: torch.zeros_like(r),  # all-zero groups
        lambda r: torch.full_like(r, -0.0),  # −0: the sign of zero must survive
        lambda r: r * 1e4,  # large
        lambda r: r * 1e-6,  # tiny (below the 1e-4 amax floor)
        lambda r: torch.where(torch.arange(d) % 7 == 0, torch.full_like(r, 448.0), r.clamp(-448, 448)),  # fp8 max
        lambda r: (torch.arange(d) % 16).float() * 0.0625 + 1.0 / 1024,  # e4m3 ties / subnormals at scale 1
        lambda r: r * 3e30,  # huge (sum of squares overflows fp32)
        lambda r: torch.where(torch.arange(d) % 32 == 5, torch.full_like(r, 448.0 * 4), r),  # amax exactly 448*2^k
    ]
    if nonfinite:
        kinds.append(lambda r: torch.where(torch.arange(d) % 9 == 1, torch.full_like(r, float("nan")), r))
        kinds.append(lambda r: torch.where(torch.arange(d) % 11 == 2, torch.full_like(r, float("inf")), r))
        kinds.append(lambda r: torch.where(torch.arange(d) % 13 == 3, torch.full_like(r, float("-inf")), r))
    rows = [kinds[i % len(kinds)](x[i]) for i in range(n)]
    out = torch.stack(rows) if rows else x
    return out.to(BF16).to(F32)


def _cos_sin(max_pos: int, rope: int, dtype=F32, base: float = 10000.0) -> torch.Tensor:
    half = rope // 2
    inv = 1.0 / (base ** (torch.arange(half, dtype=torch.float64) * 2 / rope))
    ang = torch.arange(max_pos, dtype=torch.float64)[:, None] * inv[None]
    return torch.cat([ang.cos(), ang.sin()], 1).to(dtype)


def _slots(n: int, num_blocks: int, block_size: int, seed: int, holes=(-1,)) -> torch.Tensor:
    """Distinct slots in scrambled pages, the first/last slot of a page included, holes at a few rows."""
    g = _gen(seed)
    total = num_blocks * block_size
    perm = torch.randperm(total, generator=g)
    if n >= 2:  # slots 0 and total - 1 to the front (swapped: slots stay distinct)
        for i, v in ((0, 0), (1, total - 1)):
            j = int((perm == v).nonzero()[0])
            perm[i], perm[j] = perm[j].clone(), perm[i].clone()
    s = perm[:n].to(I64)
    for i, h in enumerate(holes):
        if 3 + 5 * i < n:
            s[3 + 5 * i] = h
    return s


def _paged(num_blocks: int, block_size: int, width: int, pad: int, dtype=U8, fill=CANARY) -> torch.Tensor:
    """A [num_blocks, B, width] cache view over pages padded by ``pad`` bytes (canary-filled)."""
    page = block_size * width + pad
    if dtype == U8:
        buf = torch.full((num_blocks * page + 64,), fill, dtype=U8)
        return buf[32:].as_strided((num_blocks, block_size, width), (page, width, 1))
    # plain element rows: width and pad count elements
    buf = torch.zeros((num_blocks * page + 16,), dtype=dtype)
    buf.view(U8).fill_(fill)
    return buf.as_strided((num_blocks, block_size, width), (page, width, 1), 8)


def _random_cache_bytes(cache: torch.Tensor, seed: int) -> None:
    g = _gen(seed)
    cache.copy_(torch.randint(0, 256, cache.shape, generator=g, dtype=U8))


def _on(device, xs):
    """Move tensors to ``device`` keeping views (size, stride, offset) over a copy of their storage."""
    if device == "cpu":
        return xs
    return [_view_on(x, device) if isinstance(x, torch.Tensor) else x for x in xs]


def _view_on(x, device):
    st = x.untyped_storage()
    raw = torch.empty(st.nbytes(), dtype=U8)
    raw.untyped_storage().copy_(st)
    raw = raw.to(device)
    new = torch.empty(0, dtype=x.dtype, device=device)
    new.set_(raw.untyped_storage(), x.storage_offset(), x.shape, x.stride())
    return new


def clone_args(args: list) -> list:
    """Deep copy keeping views: each tensor gets its own copy of its whole storage."""
    out = []
    for x in args:
        if isinstance(x, torch.Tensor):
            st = x.untyped_storage()
            new = torch.empty(0, dtype=x.dtype, device=x.device)
            raw = torch.empty(st.nbytes(), dtype=U8, device=x.device)
            raw.untyped_storage().copy_(st)
            new.set_(raw.untyped_storage(), x.storage_offset(), x.shape, x.stride())
            out.append(new)
        else:
            out.append(x)
    return out


def written_bytes(t: torch.Tensor) -> torch.Tensor:
    """The whole backing storage of ``t`` as uint8 on the CPU."""
    st = t.untyped_storage()
    raw = torch.empty(st.nbytes(), dtype=U8, device=t.device)
    raw.untyped_storage().copy_(st)
    return raw.cpu()


# --------------------------------------------------------------------------- builders


def _quant_insert(width, fnuz, block_size=64, n=40, pad=512, nonfinite=False, seed=1, interleaved=False):
    def build(device):
        nb = max(3, math.ceil(n / block_size) + 2)
        k = edge_rows(n + 4, 512, seed, nonfinite).to(BF16)
        k[n:] = float("nan")  # DP padding rows: never read
        cache = _paged(nb, block_size, width, pad)
        flat = cache.as_strided((nb, cache.stride(0)), (cache.stride(0), 1))
        slots = _slots(n, nb, block_size, seed, holes=(-1, -1, -3))
        return _on(device, [k, flat, slots, block_size, fnuz, width] + ([True] if interleaved else []))

    return build


def _gather(width, fnuz, partial=False, noncontig=False, block_size=64, seed=2, interleaved=False):
    def build(device):
        from ..reference.k_cache import quantize_and_insert_k_cache as ref_insert

        nb = 7
        cache = _paged(nb, block_size, width, 512)
        if width == 288:
            _random_cache_bytes(cache, seed)
        else:
            _random_cache_bytes(cache[5:], seed)  # one page of random bytes: codes 0/255, NaN bytes
            rows = edge_rows(5 * block_size, 512, seed).to(BF16)
            flat = cache.as_strided((nb, cache.stride(0)), (cache.stride(0), 1))
            ref_insert(rows, flat, torch.arange(5 * block_size, dtype=I64), block_size, fnuz, width, interleaved)
        seq = torch.tensor([block_size + 6, 2 * block_size + 9, 5, 0], dtype=I32)
        table = torch.tensor([[0, 2, 5, -1], [3, 1, 4, 5], [6, -1, -1, -1], [-1, -1, -1, -1]], dtype=I32)
        if noncontig:  # rows 9 apart in a wider table, entries never read are garbage
            wide = torch.randint(-50, 50, (4, 9), generator=_gen(seed), dtype=I32)
            wide[:, :4] = table
            table = wide[:, :4]
        gl = torch.tensor([13, 2 * block_size + 9, 0, 0], dtype=I32) if partial else None
        offset = 3 if partial else 0
        rows_out = 2 * block_size + 9 + offset + 2
        out = torch.empty((4, rows_out, 512), dtype=BF16)
        out.view(torch.int16).fill_(-8531)  # 0xDEAD canary
        return _on(device, [out, cache, seq, gl, table, block_size, offset, fnuz] + ([True] if interleaved else []))

    return build


def _global_topk(k=37, noncontig=True, n=12, seed=3, compact=False, oob=False, width=6):
    """Table of 3 requests, ``width`` logical blocks of 64 (a ``[:, :width]`` view of an
    11-block-wide table when ``noncontig``).  ``oob``: request indices outside the table
    (−1, 3 = the row count, ±2^31 ends) and logical blocks past the width (blocks 6-10 lie
    inside the wide table's stride, the last column is 2^31 - 1), which the op defines as
    invalid entries (−1, not counted)."""
    def build(device):
        g = _gen(seed)
        idx = torch.randint(-1, 6 * 64, (n, k), generator=g, dtype=I32)
        if n > 2:
            idx[2] = -1
        wide = torch.randint(0, 50, (3, 11), generator=g, dtype=I32)
        table = wide[:, :width] if noncontig else wide[:, :width].contiguous()
        t2r = torch.randint(0, 3, (n + 3,), generator=g, dtype=I32)
        valid = torch.rand(n + 3, generator=g) > 0.25
        if oob:
            past = torch.randint(6 * 64, 11 * 64, (n, k), generator=g, dtype=I32)
            idx = torch.where(torch.rand(n, k, generator=g) < 0.3, past, idx)
            if k:
                idx[:, -1] = 2**31 - 1
            bad = torch.tensor([-1, 3, 2**31 - 1, -(2**31)], dtype=I32)[: max(0, n - 3)]
            t2r[3: 3 + bad.numel()] = bad
        out = torch.full((n, k), -7, dtype=I32)
        lens = torch.full((n,), -7, dtype=I32)
        return _on(device, [idx, t2r, table, 64, valid, out, lens, compact])

    return build


def _combine(cr, topk, window=128, seed=4, rebased=True):
    def build(device):
        g = _gen(seed)
        ql = [5, 0, 7, 9]
        base = 11 if rebased else 0
        qsl = torch.tensor([base] + [base + sum(ql[: i + 1]) for i in range(len(ql))], dtype=I32)
        t = sum(ql) + 3  # 3 tokens past the last request
        seq = torch.tensor([40, 3, 300, 9], dtype=I32)
        gl = torch.tensor([30, 3, 200, 9], dtype=I32)
        width = max(topk, 1) + 5
        idx = torch.randint(-1, 120, (t, width), generator=g, dtype=I32)
        w_out = (topk + window + 127) // 128 * 128
        out = torch.full((t, w_out), -7, dtype=I32)
        lens = torch.full((t,), -7, dtype=I32)
        return _on(device, [idx, qsl, seq, gl, window, cr, topk, 1024, 512, out, lens])

    return build


def _flashinfer(local=False, decode_comp=True, lens=True, spans=(None, None), d=3, p=15, seed=5,
                topk=50, seq=(20, 600)):
    def build(device):
        g = _gen(seed)
        window, cr, bs = 128, 4, 64
        w_swa = 128
        reqs_dec = d
        ql_pre = [7, 8] if p else []
        ql = [1] * reqs_dec + ql_pre
        r = len(ql)
        qsl = torch.tensor([0] + [sum(ql[: i + 1]) for i in range(r)], dtype=I32)
        seq_lens = torch.randint(*seq, (r,), generator=g, dtype=I32)
        replay = torch.zeros(r, dtype=I32)
        if r > 1:
            replay[-1] = int(seq_lens[-1]) - 3  # above some positions: swa_len <= 0
        t2r = torch.cat([torch.full((n,), i, dtype=I32) for i, n in enumerate(ql)] + [torch.zeros(2, dtype=I32)])
        # tables as wide as the windows and local indices read (the index contract)
        swa_w, comp_w = (12, 5) if topk <= 50 else (-(-seq[1] // bs), 7)
        swa_table = torch.randint(0, 40, (r, swa_w), generator=g, dtype=I32)
        comp_table = torch.randint(0, 40, (r, comp_w), generator=g, dtype=I32)
        dswa = torch.randint(-1, 2000, (d, w_swa), generator=g, dtype=I32)
        k_dec = 44 if local else 53
        dcomp = torch.randint(-1, 300 if local else 5000, (d, k_dec), generator=g, dtype=I32) if decode_comp else None
        dlens = torch.randint(0, k_dec, (d + 1,), generator=g, dtype=I32) if (lens and decode_comp and not local) else None
        valid = (torch.rand(d + 1, generator=g) > 0.3) if local else None
        pre = torch.randint(-1, 150 if topk <= 50 else comp_w * bs, (p, topk), generator=g, dtype=I32)
        padded = (max(topk, k_dec if decode_comp else 0) + 3) // 4 * 4
        out = torch.full((d + p, w_swa + padded), -7, dtype=I32)
        out_lens = torch.full((d + p,), -7, dtype=I32)
        sspan = spans[0] if spans[0] is not None else bs
        cspan = spans[1] if spans[1] is not None else bs
        return _on(
            device,
            [dswa, dcomp, dlens, pre, qsl, seq_lens, t2r, swa_table, bs, comp_table, bs, window, cr, topk,
             local and decode_comp, valid, sspan, cspan, replay, out, out_lens],
        )

    return build


def _wide(x: torch.Tensor, g) -> torch.Tensor:
    """``x`` with each row at its own power-of-two scale (2^-20 .. 2^20) and each element at
    2^-4 .. 2^4 of it: fp32 sums of squares whose order shows, the GPU's approximate primitives
    over many binades (the norms, the softmax weights)."""
    rows = torch.exp2(torch.randint(-20, 21, (x.shape[0], 1), generator=g).float())
    return x * rows * torch.exp2(torch.randint(-4, 5, x.shape, generator=g).float())


def _save_compress_wide(cr, t, seed=21):
    """Many tokens of one request at wide magnitudes: CR 1 rows, or CR 2 pairs whose score
    differences reach past -87 (subnormal softmax weights)."""
    def build(device):
        g = _gen(seed)
        if cr == 1:
            kv = _wide(torch.randn(t, 512, generator=g), g)
            w = (torch.rand(512, generator=g) + 0.5).to(BF16)
            latent = torch.full((t, 512), float("nan"), dtype=BF16)
            return _on(device, [kv, torch.arange(t, dtype=I64), None, torch.arange(t, dtype=I64),
                                None, None, w, 1e-6, 1, latent])
        cap = 8
        kv = _wide(torch.randn(t, 1024, generator=g), g)
        kv[:, 512:] = (torch.rand(t, 512, generator=g) - 0.5) * 240.0  # scores
        pos = torch.arange(t, dtype=I64)
        qsl = torch.tensor([0, t], dtype=I32)
        t2r = torch.zeros(t, dtype=I32)
        state = torch.randn(1, cap, 1024, generator=g)
        latent = torch.full((t, 512), float("nan"), dtype=BF16)
        w = (torch.rand(512, generator=g) + 0.5).to(BF16)
        return _on(device, [kv, pos, state, pos % cap, qsl, t2r, w, 1e-6, 2, latent])

    return build


def _save_compress(cr, seed=6, boundary=False, prev=False):
    def build(device):
        g = _gen(seed)
        if cr == 1:
            rows = 12
            kv = torch.randn(rows, 528, generator=g)[:, :512]
            kv[3] = 0.0
            kv[4] *= 1e4
            kv[5] *= 1e-6
            slots = torch.tensor([0, 1, -1, 3, 4, 5, -1, 7, 8, 9], dtype=I64)
            kv[10:] = float("nan")
            pos = torch.arange(rows, dtype=I64) + 100
            latent = torch.full((rows, 512), float("nan"), dtype=BF16)
            w = (torch.rand(512, generator=g) + 0.5).to(BF16)
            return _on(device, [kv, pos, None, slots, None, None, w, 1e-6, 1, latent])
        cap = 4
        if boundary:
            # odd chunk lengths: tokens 4 and 5 both close a pair (the last of request 0 at an
            # odd position, the first of request 1 at an odd position, from the ring)
            qsl = torch.tensor([0, 5, 12, 19], dtype=I32)
            starts = [11, 9, 20]
        else:
            qsl = torch.tensor([0, 6, 11, 19], dtype=I32)
            starts = [10, 7, 20]  # even start, odd start (pools with the ring), first slot −1
        pos = torch.cat([torch.arange(s, s + int(qsl[i + 1] - qsl[i])) for i, s in enumerate(starts)]).to(I64)
        t = 19
        kv = torch.randn(t + 2, 1024, generator=g)
        kv[t:] = float("nan")
        pos = torch.cat([pos, torch.zeros(2, dtype=I64)])
        lens = (qsl[1:] - qsl[:-1]).tolist()
        t2r = torch.repeat_interleave(torch.arange(3, dtype=I32), torch.tensor(lens))
        ring_block = torch.tensor([0, 2, 3])
        slots = (ring_block[t2r.long()] * cap + pos[:t] % cap).to(I64)
        slots[int(qsl[2])] = -1  # the last request's first slot: no ring save for it
        state = torch.randn(4, cap, 1024, generator=g)
        latent = torch.full((t + 2, 512), float("nan"), dtype=BF16)
        w = (torch.rand(512, generator=g) + 0.5).to(BF16)
        args = [kv, pos, state, slots, qsl, t2r, w, 1e-6, 2, latent]
        if prev:
            # rows from other context-parallel ranks, rows 16 floats apart in a wider buffer;
            # request 0 reads row 2, request 1 the ring (-1), request 2 row 0
            wide = torch.randn(3, 1024 + 16, generator=g)
            args += [wide[:, :1024], torch.tensor([2, -1, 0], dtype=I32)]
        return _on(device, args)

    return build


def _save_ring_rows(n=10, seed=13):
    def build(device):
        g = _gen(seed)
        cap = 4
        wide = torch.randn(n + 1, 1024 + 32, generator=g)
        rows = wide[:n, :1024]  # strided rows
        slots = torch.randperm(3 * cap, generator=g)[:n].to(I64)
        slots[1] = -1
        slots[n - 2] = -7
        state = torch.randn(3, cap, 1024, generator=g)
        return _on(device, [rows, slots, state])

    return build


def _rope_insert(kind, cr, sanitize=False, nonfinite=False, cs_dtype=F32, seed=7, large_pos=False, interleaved=False):
    def build(device):
        n, bs, nb = 24, 64, 5
        latent = edge_rows(n + 2, 512, seed, nonfinite).to(BF16)
        if nonfinite:
            # NaNs of both signs (a NaN's sign must not reach a code or a byte): the bf16
            # conversion made them 0xFFFF, every third column gets 0x7FC0
            bits = latent.view(torch.int16)
            bits[:, ::3] = torch.where(latent[:, ::3].isnan(),
                                       torch.tensor(0x7FC0, dtype=torch.int16), bits[:, ::3])
        latent[n:] = float("nan")
        max_pos = 70000 if large_pos else 512
        pos = torch.randint(0, max_pos, (n + 2,), generator=_gen(seed), dtype=I64)
        pos[:8] = torch.arange(8) + (max_pos - 8)
        cs = _cos_sin(max_pos, 64, cs_dtype)
        slots = _slots(n, nb, bs, seed, holes=(-1, -5))
        scale = None
        if kind in (584, 528, 288):
            cache = _paged(nb, bs, kind, 512)
        elif kind == "bf16":
            cache = _paged(nb, bs, 512, 0, BF16)
        else:
            cache = _paged(nb, bs, 512, 0, torch.float8_e4m3fn)
            scale = torch.tensor([0.0375], dtype=F32)
        return _on(device, [latent, pos, cs, cache, slots, cr, scale, sanitize] + ([True] if interleaved else []))

    return build


def _indexer_k(fp4, tiled, cr, n_per_tile=0, seed=8, eps=1e-6, n=20, wide=False):
    def build(device):
        bs, nb = 64, max(4, n // 64 + 2)
        k = edge_rows(n + 3, 128, seed).to(BF16)
        if wide:
            k = _wide(torch.randn(n + 3, 128, generator=_gen(seed)), _gen(seed + 5)).to(BF16)
        k[n:] = float("nan")
        pos = torch.randint(0, 512, (n + 3,), generator=_gen(seed), dtype=I64)
        cs = _cos_sin(512, 64)
        w = (torch.rand(128, generator=_gen(seed + 1)) + 0.5).to(BF16)
        width = 68 if fp4 else 132
        cache = _paged(nb, bs, width, 64)
        slots = _slots(n, nb, bs, seed, holes=(-1,))
        return _on(device, [k, pos, cs, w, eps, cache, slots, cr, fp4, n_per_tile, tiled])

    return build


def _indexer_q(fp4, fnuz=False, weights_bf16=False, cs_dtype=F32, t=6, h=8, seed=9):
    def build(device):
        q = edge_rows(t * h, 128, seed).view(t, h, 128).to(BF16)
        pos = torch.randint(0, 512, (t,), generator=_gen(seed), dtype=I64)
        cs = _cos_sin(512, 64, cs_dtype)
        w = torch.randn(t, h, generator=_gen(seed + 1)).to(BF16)
        if fp4:
            q_out = torch.full((t, h, 64), CANARY, dtype=U8)
            s_out = torch.full((t, h, 4), CANARY, dtype=U8)
            w_out = torch.full((t, h), 7.0, dtype=BF16 if weights_bf16 else F32)
        else:
            q_out = torch.full((t, h, 128), CANARY, dtype=U8).view(torch.float8_e4m3fnuz if fnuz else torch.float8_e4m3fn)
            s_out = torch.empty((0,), dtype=U8)
            w_out = torch.full((t, h), 7.0, dtype=F32)
        return _on(device, [pos, q, cs, w, 128 ** -0.5, 0.125, fp4, fnuz, q_out, s_out, w_out])

    return build


def _inv_rope(qgs=128, tma=False, quantize=True, permuted=False, t=5, seed=10):
    def build(device):
        g_, hpg, dh = 2, 4, 512
        o = edge_rows(t * g_ * hpg, dh, seed).view(t, g_ * hpg, dh).to(BF16)
        pos = torch.randint(0, 512, (t,), generator=_gen(seed), dtype=I64)
        cs = _cos_sin(512, 64)
        dg = hpg * dh
        if quantize:
            ta = (t + 3) // 4 * 4
            k = (dg // qgs + 3) // 4 if tma else dg // qgs
            out = torch.full((g_, t, dg), CANARY, dtype=U8).view(torch.float8_e4m3fn)
            sc = torch.full((g_, k * ta), -7, dtype=torch.int32)
            if not tma:
                sc = sc.view(F32)
        else:
            out = torch.full((g_, t, dg), 7.0, dtype=BF16)
            sc = torch.empty((g_, 0), dtype=F32)
        return _on(device, [o, pos, cs, g_, hpg, 448, 64, qgs, tma, quantize, permuted, out, sc])

    return build


def _qkv_norm(t, qs=1536, ks=512, seed=11, wide=False):
    def build(device):
        qr = edge_rows(t, qs, seed).to(BF16)
        kv = edge_rows(t, ks, seed + 1).to(BF16)
        if wide:
            qr = _wide(torch.randn(t, qs, generator=_gen(seed)), _gen(seed + 2)).to(BF16)
            kv = _wide(torch.randn(t, ks, generator=_gen(seed + 1)), _gen(seed + 3)).to(BF16)
        qw = (torch.rand(qs, generator=_gen(seed)) + 0.5).to(BF16)
        kw = (torch.rand(ks, generator=_gen(seed + 1)) + 0.5).to(BF16)
        tp, gp = (t + 127) // 128 * 128, (qs // 32 + 3) // 4 * 4
        q_out = torch.full((t, qs), CANARY, dtype=U8).view(torch.float8_e4m3fn)
        s_out = torch.full((tp * gp,), CANARY, dtype=U8)
        kv_out = torch.full((t, ks), 7.0, dtype=BF16)
        return _on(device, [qr, kv, qw, kw, 1e-6, q_out, s_out, kv_out])

    return build


def _pad_q(t, h, hp, seed=12):
    def build(device):
        q = torch.randn(t, h, 512, generator=_gen(seed)).to(BF16)
        out = torch.full((t, hp, 512), 7.0, dtype=BF16)
        return _on(device, [q, out])

    return build


# --------------------------------------------------------------------------- transcode_k_cache

_TRANSCODE = "transcode_k_cache"
_FP8_WIDTHS = tuple(sorted(w for w, r in RECORDS.items() if r.holds_fp8))  # (132, 528, 584)


def _edge_cache(width: int, block_size: int, pad: int, num_blocks: int, seed: int):
    """A canary-padded ``[num_blocks, B, W]`` cache whose pages hold every value byte, the
    special scale codes / exponents next to ordinary ones, and (even pages) FNUZ-writer-like
    value bytes (no 0x7F / 0xFF / 0x80)."""
    g = _gen(seed)
    cache = _paged(num_blocks, block_size, width, pad)
    rec = RECORDS[width]
    raw = torch.randint(0, 256, (num_blocks, block_size * width), generator=g, dtype=torch.uint8)
    vb = block_size * rec.value_bytes
    clean = raw[::2, :vb]
    clean.copy_(torch.where((clean & 0x7F) == 0x7F, clean - 1, clean))
    clean.copy_(torch.where(clean == 0x80, torch.zeros_like(clean), clean))
    if rec.scale == "ue8m0":
        special = torch.tensor([0, 1, 2, 105, 127, 247, 253, 254, 255], dtype=torch.uint8)
        n = raw[:, vb:].numel()
        codes = torch.where(
            torch.randint(0, 3, (n,), generator=g) == 0,
            special[torch.randint(0, len(special), (n,), generator=g)],
            torch.randint(100, 140, (n,), generator=g, dtype=torch.uint8),
        )
        raw[:, vb:] = codes.view(num_blocks, -1)
    else:
        n = num_blocks * block_size
        exps = torch.tensor([0, 1, 2, 105, 127, 253, 254, 255], dtype=torch.int64)
        e = torch.where(torch.randint(0, 2, (n,), generator=g) == 0,
                        exps[torch.randint(0, len(exps), (n,), generator=g)],
                        torch.randint(100, 140, (n,), generator=g))
        mant = torch.randint(0, 1 << 23, (n,), generator=g)
        mant = torch.where(torch.randint(0, 2, (n,), generator=g) == 0, mant & ~1, mant)
        mant = torch.where(torch.randint(0, 2, (n,), generator=g) == 0, torch.zeros_like(mant), mant)
        bits = (torch.randint(0, 2, (n,), generator=g) << 31) | (e << 23) | mant
        sh = torch.tensor([0, 8, 16, 24])
        raw[:, vb:] = ((bits.unsqueeze(1) >> sh) & 0xFF).to(torch.uint8).view(num_blocks, -1)
    cache.copy_(raw.view(num_blocks, block_size, width))
    return cache


def _transcode(width, src_fnuz, dst_fnuz, block_size=16, pad=64, tiled=False, ids_dtype=torch.int32, seed=3):
    """Kernel-contract case: paged records on both sides (interleaved ones are byte moves
    around this kernel, tested in tests/test_transcode.py)."""
    def build(device):
        src = _edge_cache(width, block_size, pad, 6, seed)
        dst = _edge_cache(width, block_size, pad + 32, 7, seed + 1)
        ids = torch.tensor([4, -1, 0, 2, 5, -7, 6], dtype=ids_dtype)  # 6: past src's 6 pages
        return _on(device, [src, dst, ids, block_size, width, src_fnuz, dst_fnuz, tiled])

    return build


def _transcode_cases() -> list:
    """Kernel-contract cases of ``transcode_k_cache`` (every fp8 record, both directions, the
    tiled indexer layout, identity), in the format of ``dsv41.tools.conformance.CASES``.  In-place
    calls are tested in tests/test_transcode.py (the conformance harness clones each argument
    separately, so it cannot express aliasing)."""
    out = []
    for w in _FP8_WIDTHS:
        for s, d in ((False, True), (True, False)):
            tag = f"{w}-{'fnuz' if s else 'ocp'}-to-{'fnuz' if d else 'ocp'}"
            out.append(Case(_TRANSCODE, tag, _transcode(w, s, d)))
        out.append(Case(_TRANSCODE, f"{w}-fnuz-to-ocp-b5-nopad-i64", _transcode(w, True, False, block_size=5, pad=0, ids_dtype=torch.int64)))
        out.append(Case(_TRANSCODE, f"{w}-identity", _transcode(w, True, True)))
    out.append(Case(_TRANSCODE, "132-tiled-ocp-to-fnuz", _transcode(132, False, True, tiled=True)))
    out.append(Case(_TRANSCODE, "132-tiled-fnuz-to-ocp-b32", _transcode(132, True, False, block_size=32, tiled=True)))
    return out


def _all_cases() -> list[Case]:
    c = []
    A = c.append
    for w in (584, 528):
        for fnuz in (False, True):
            f = "fnuz" if fnuz else "ocp"
            A(Case("quantize_and_insert_k_cache", f"{w}-{f}", _quant_insert(w, fnuz)))
            A(Case("quantize_and_insert_k_cache", f"{w}-{f}-nonfinite", _quant_insert(w, fnuz, nonfinite=True)))
            A(Case("quantize_and_insert_k_cache", f"{w}-{f}-b16-nopad", _quant_insert(w, fnuz, block_size=16, pad=0, n=50)))
        A(Case("quantize_and_insert_k_cache", f"{w}-empty", _quant_insert(w, False, n=0)))
    for w in (584, 528, 288):
        for fnuz in ((False, True) if w != 288 else (False,)):
            f = "fnuz" if fnuz else "ocp"
            A(Case("dequantize_and_gather_k_cache", f"{w}-{f}-full", _gather(w, fnuz)))
            A(Case("dequantize_and_gather_k_cache", f"{w}-{f}-partial", _gather(w, fnuz, partial=True)))
        A(Case("dequantize_and_gather_k_cache", f"{w}-noncontig-table", _gather(w, False, noncontig=True)))
        A(Case("dequantize_and_gather_k_cache", f"{w}-b16", _gather(w, False, block_size=16, partial=True)))
    # vLLM 0.33's interleaved V4.1 records (dsv41.core.formats)
    for fnuz in (False, True):
        f = "fnuz" if fnuz else "ocp"
        A(Case("quantize_and_insert_k_cache", f"528-{f}-interleaved", _quant_insert(528, fnuz, interleaved=True)))
    A(Case("quantize_and_insert_k_cache", "528-interleaved-b16-nopad",
           _quant_insert(528, False, block_size=16, pad=0, n=50, interleaved=True)))
    for w in (528, 288):
        A(Case("dequantize_and_gather_k_cache", f"{w}-interleaved-full", _gather(w, False, interleaved=True)))
        A(Case("dequantize_and_gather_k_cache", f"{w}-interleaved-partial",
               _gather(w, False, partial=True, interleaved=True)))
        A(Case("dequantize_and_gather_k_cache", f"{w}-interleaved-noncontig-table",
               _gather(w, False, noncontig=True, interleaved=True)))
        A(Case("dequantize_and_gather_k_cache", f"{w}-interleaved-b16",
               _gather(w, False, block_size=16, partial=True, interleaved=True)))
    A(Case("dequantize_and_gather_k_cache", "528-fnuz-interleaved-partial",
           _gather(528, True, partial=True, interleaved=True)))
    A(Case("compute_global_topk_indices_and_lens", "basic", _global_topk()))
    A(Case("compute_global_topk_indices_and_lens", "wide-1030", _global_topk(k=1030, noncontig=False)))
    A(Case("compute_global_topk_indices_and_lens", "empty", _global_topk(n=0)))
    A(Case("compute_global_topk_indices_and_lens", "compact", _global_topk(compact=True)))
    A(Case("compute_global_topk_indices_and_lens", "out-of-table", _global_topk(oob=True)))
    A(Case("compute_global_topk_indices_and_lens", "out-of-table-compact", _global_topk(oob=True, compact=True)))
    A(Case("compute_global_topk_indices_and_lens", "wide-1030-out-of-table-compact",
           _global_topk(k=1030, noncontig=False, oob=True, compact=True, seed=7)))
    A(Case("compute_global_topk_indices_and_lens", "width-0-compact", _global_topk(width=0, compact=True)))
    A(Case("compute_global_topk_indices_and_lens", "empty-compact", _global_topk(n=0, compact=True)))
    A(Case("combine_topk_swa_indices", "cr4", _combine(4, 50)))
    A(Case("combine_topk_swa_indices", "cr0-swa-only", _combine(0, 0)))
    A(Case("combine_topk_swa_indices", "cr1-not-rebased", _combine(1, 64, rebased=False)))
    A(Case("build_flashinfer_mixed_sparse_indices", "global", _flashinfer()))
    A(Case("build_flashinfer_mixed_sparse_indices", "global-nolens", _flashinfer(lens=False)))
    A(Case("build_flashinfer_mixed_sparse_indices", "local-span", _flashinfer(local=True, spans=(80, 70))))
    A(Case("build_flashinfer_mixed_sparse_indices", "no-decode-compressed", _flashinfer(decode_comp=False)))
    A(Case("build_flashinfer_mixed_sparse_indices", "decode-only", _flashinfer(p=0)))
    A(Case("build_flashinfer_mixed_sparse_indices", "prefill-only", _flashinfer(d=0, decode_comp=False)))
    # rows wider than one column step of every launch shape (k_len up to the top-k of 520)
    A(Case("build_flashinfer_mixed_sparse_indices", "wide-rows",
           _flashinfer(d=2, topk=520, seq=(1800, 2600), seed=9)))
    A(Case("fused_save_compress_norm", "cr1", _save_compress(1), (9,)))
    A(Case("fused_save_compress_norm", "cr2-ring", _save_compress(2)))
    A(Case("fused_save_compress_norm", "cr2-boundary", _save_compress(2, seed=16, boundary=True)))
    A(Case("fused_save_compress_norm", "cr2-prev-rows", _save_compress(2, prev=True)))
    A(Case("fused_save_compress_norm", "cr2-boundary-prev-rows", _save_compress(2, seed=16, boundary=True, prev=True)))
    A(Case("fused_save_compress_norm", "cr1-wide-256", _save_compress_wide(1, 256), (9,)))
    A(Case("fused_save_compress_norm", "cr2-wide-256", _save_compress_wide(2, 256)))
    A(Case("save_ring_rows", "basic", _save_ring_rows()))
    A(Case("save_ring_rows", "one-row", _save_ring_rows(n=3, seed=14)))
    for kind in (584, 528, 288, "bf16", "fp8"):
        for cr in (1, 2):
            A(Case("rope_quant_insert", f"{kind}-cr{cr}", _rope_insert(kind, cr)))
    for kind in (584, 528, 288):
        A(Case("rope_quant_insert", f"{kind}-nonfinite", _rope_insert(kind, 1, nonfinite=True)))
        A(Case("rope_quant_insert", f"{kind}-sanitize", _rope_insert(kind, 1, sanitize=True, nonfinite=True)))
    for kind in (528, 288):
        for cr in (1, 2):
            A(Case("rope_quant_insert", f"{kind}-interleaved-cr{cr}", _rope_insert(kind, cr, interleaved=True)))
        A(Case("rope_quant_insert", f"{kind}-interleaved-sanitize",
               _rope_insert(kind, 1, sanitize=True, nonfinite=True, interleaved=True)))
    A(Case("rope_quant_insert", "528-bf16-cos-sin", _rope_insert(528, 1, cs_dtype=BF16)))
    A(Case("rope_quant_insert", "528-large-positions", _rope_insert(528, 2, large_pos=True)))
    for fp4 in (False, True):
        for tiled in (False, True):
            for cr in (1, 2):
                A(Case("indexer_k_norm_rope_store", f"{'mxfp4' if fp4 else 'fp8'}-{'tiled' if tiled else 'rows'}-cr{cr}",
                       _indexer_k(fp4, tiled, cr, n_per_tile=16 if fp4 and tiled else 0)))
    A(Case("indexer_k_norm_rope_store", "mxfp4-tiled-n64", _indexer_k(True, True, 1, n_per_tile=64)))
    for fp4 in (False, True):  # eps 0: an all-zero key normalizes to 0 * inf = NaN (+NaN as on GPUs)
        A(Case("indexer_k_norm_rope_store", f"{'mxfp4' if fp4 else 'fp8'}-rows-eps0", _indexer_k(fp4, False, 1, eps=0.0)))
    A(Case("indexer_k_norm_rope_store", "fp8-rows-wide-200", _indexer_k(False, False, 1, n=200, wide=True)))
    A(Case("fused_indexer_q_rope_quant", "fp8-ocp", _indexer_q(False), (8, 10)))
    A(Case("fused_indexer_q_rope_quant", "fp8-fnuz", _indexer_q(False, fnuz=True), (8, 10)))
    A(Case("fused_indexer_q_rope_quant", "fp8-bf16-cos-sin", _indexer_q(False, cs_dtype=BF16), (8, 10)))
    A(Case("fused_indexer_q_rope_quant", "mxfp4", _indexer_q(True)))
    A(Case("fused_indexer_q_rope_quant", "mxfp4-bf16-weights", _indexer_q(True, weights_bf16=True)))
    A(Case("fused_inv_rope_fp8_quant", "fp32-scales", _inv_rope()))
    A(Case("fused_inv_rope_fp8_quant", "tma-packed", _inv_rope(tma=True)))
    A(Case("fused_inv_rope_fp8_quant", "no-quant", _inv_rope(quantize=False)))
    A(Case("fused_inv_rope_fp8_quant", "qgs32", _inv_rope(qgs=32)))
    A(Case("fused_inv_rope_fp8_quant", "permuted", _inv_rope(qgs=32, tma=True, permuted=True)))
    A(Case("fused_inv_rope_fp8_quant", "t8-no-pad", _inv_rope(t=8)))
    # one token (batch-1 decode), scales padded to 4 rows
    A(Case("fused_inv_rope_fp8_quant", "t1-decode", _inv_rope(tma=True, t=1, seed=12)))
    A(Case("fused_q_kv_rmsnorm_quant", "t5", _qkv_norm(5)))
    A(Case("fused_q_kv_rmsnorm_quant", "t130-two-tiles", _qkv_norm(130, qs=1024, ks=448)))
    A(Case("fused_q_kv_rmsnorm_quant", "t256-wide", _qkv_norm(256, wide=True)))
    A(Case("pad_fused_q_heads", "8to16", _pad_q(3, 8, 16)))
    A(Case("pad_fused_q_heads", "5to32", _pad_q(2, 5, 32)))
    c.extend(_transcode_cases())
    return c


CASES = _all_cases()

# The pipeline ``python -m dsv41 check`` runs: insert -> gather -> sparse indices
# -> indexer q/k -> inverse-RoPE quant, plus the module ops around them.
PIPELINE = (
    "quantize_and_insert_k_cache[528-ocp-interleaved]",
    "quantize_and_insert_k_cache[584-ocp]",
    "dequantize_and_gather_k_cache[528-interleaved-partial]",
    "dequantize_and_gather_k_cache[584-ocp-full]",
    "dequantize_and_gather_k_cache[288-interleaved-full]",
    "compute_global_topk_indices_and_lens[basic]",
    "combine_topk_swa_indices[cr4]",
    "build_flashinfer_mixed_sparse_indices[global]",
    "fused_save_compress_norm[cr2-ring]",
    "save_ring_rows[basic]",
    "rope_quant_insert[528-interleaved-cr2]",
    "indexer_k_norm_rope_store[fp8-rows-cr2]",
    "fused_indexer_q_rope_quant[fp8-ocp]",
    "fused_inv_rope_fp8_quant[fp32-scales]",
    "fused_q_kv_rmsnorm_quant[t5]",
    "pad_fused_q_heads[8to16]",
)


def cases_for(op: str) -> list[Case]:
    return [c for c in CASES if c.op == op]
