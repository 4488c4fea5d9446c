"""Tabulate the GPU's approximate fp32 primitives as Triton emits them (run on an NVIDIA GPU).

vLLM's Triton kernels use ``tl.rsqrt`` (``rsqrt.approx.ftz.f32``), ``tl.exp`` / ``tl.exp2``
(``ex2.approx``) and fp32 ``/`` (``div.full.f32``).  Their results are not specified to the
bit, so a CPU reference that writes vLLM's bytes needs them as measured.  This script
evaluates each primitive over its whole reduced domain, checks the reductions a table-driven
model relies on (exponent scaling, fixed-point quantization of ex2's argument, division as a
product with the reciprocal), and writes:

  approx-<name>.npz   the table: the result's bits minus the correctly rounded result's bits
                      (int8), over the reduced domain
  approx-checks.json  mismatch counts of every reduction checked, the PTX each op became

Usage:  python tools/approx_dump.py --out DIR
"""

from __future__ import annotations

import argparse
import json
import math
import os

import numpy as np
import torch
import triton
import triton.language as tl

BLOCK = 1024


@triton.jit
def _unary(x_ptr, y_ptr, n, OP: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    m = offs < n
    x = tl.load(x_ptr + offs, mask=m, other=1.0)
    if OP == 0:
        y = tl.rsqrt(x)
    elif OP == 1:
        y = tl.exp2(x)
    elif OP == 2:
        y = tl.exp(x)
    elif OP == 3:
        y = 1.0 / x
    elif OP == 4:
        y = tl.inline_asm_elementwise("rcp.approx.ftz.f32 $0, $1;", "=f,f", [x], dtype=tl.float32,
                                      is_pure=True, pack=1)
    elif OP == 5:
        y = tl.inline_asm_elementwise("ex2.approx.ftz.f32 $0, $1;", "=f,f", [x], dtype=tl.float32,
                                      is_pure=True, pack=1)
    else:
        y = tl.inline_asm_elementwise("rsqrt.approx.f32 $0, $1;", "=f,f", [x], dtype=tl.float32,
                                      is_pure=True, pack=1)
    tl.store(y_ptr + offs, y, mask=m)


@triton.jit
def _divide(a_ptr, b_ptr, y_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    m = offs < n
    a = tl.load(a_ptr + offs, mask=m, other=1.0)
    b = tl.load(b_ptr + offs, mask=m, other=1.0)
    tl.store(y_ptr + offs, a / b, mask=m)


OPS = {"rsqrt": 0, "exp2": 1, "exp": 2, "recip": 3, "rcp_asm": 4, "ex2_ftz_asm": 5, "rsqrt_noftz_asm": 6}
PTX: dict[str, list[str]] = {}


def run(op: str, x: torch.Tensor) -> torch.Tensor:
    y = torch.empty_like(x)
    n = x.numel()
    k = _unary[(triton.cdiv(n, BLOCK),)](x, y, n, OP=OPS[op], BLOCK=BLOCK)
    if op not in PTX:
        PTX[op] = [ln.strip() for ln in k.asm["ptx"].splitlines()
                   if any(w in ln for w in ("approx", "div.", "rcp", "ex2", "rsqrt", "mul.f32", "lg2"))]
    return y


def divide(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    y = torch.empty_like(a)
    k = _divide[(triton.cdiv(a.numel(), BLOCK),)](a, b, y, a.numel(), BLOCK=BLOCK)
    PTX.setdefault("divide", [ln.strip() for ln in k.asm["ptx"].splitlines()
                              if any(w in ln for w in ("approx", "div.", "rcp", "mul.f32"))])
    return y


def floats(lo_bits: int, hi_bits: int) -> torch.Tensor:
    return torch.arange(lo_bits, hi_bits, dtype=torch.int64, device="cuda").to(torch.int32).view(torch.float32)


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int32).to(torch.int64)


def table(y: torch.Tensor, exact: torch.Tensor, name: str, out: str, meta: dict) -> torch.Tensor:
    d = bits(y) - bits(exact.float())
    lo, hi = int(d.min()), int(d.max())
    meta[name] = {"min_delta": lo, "max_delta": hi, "count": d.numel(),
                  "histogram": {str(v): int((d == v).sum()) for v in range(max(lo, -8), min(hi, 8) + 1)}}
    assert -128 <= lo and hi <= 127, (name, lo, hi)
    np.savez_compressed(os.path.join(out, f"approx-{name}.npz"), delta=d.to(torch.int8).cpu().numpy())
    return y


ONE = 0x3F800000  # 1.0
M = 1 << 23  # one binade of fp32 mantissas
N_PAIRS = 1 << 26


def rsqrt_part(out: str, meta: dict, checks: dict) -> None:
    """rsqrt over [1, 4) (mantissa and exponent parity), then exponent scaling and specials."""
    x = floats(ONE, ONE + 2 * M)
    rb = bits(table(run("rsqrt", x), torch.rsqrt(x.double()), "rsqrt", out, meta))
    bad = {}
    for k in range(-63, 64):
        if k == 0:
            continue
        xs = torch.ldexp(x, torch.tensor(2.0 * k, device="cuda"))
        want = rb - (k << 23)
        ok = (want > 0x007FFFFF) & (want < 0x7F800000) & (bits(xs) > 0x007FFFFF) & (bits(xs) < 0x7F800000)
        bad[k] = int(((bits(run("rsqrt", xs)) != want) & ok).sum())
    checks["rsqrt_scaling_mismatches_by_k"] = {k: v for k, v in bad.items() if v}
    checks["rsqrt_scaling_total_mismatches"] = sum(bad.values())
    checks["rsqrt_noftz_vs_ftz_mismatches"] = int((bits(run("rsqrt_noftz_asm", x)) != rb).sum())
    sp = torch.tensor([0.0, -0.0, 1e-40, float("inf"), -1.0, float("nan"), 1e-38, 3e38], device="cuda")
    checks["rsqrt_specials"] = {str(float(v)): hex(int(b) & 0xFFFFFFFF)
                                for v, b in zip(sp.tolist(), bits(run("rsqrt", sp)).tolist())}


def recip_part(out: str, meta: dict, checks: dict) -> None:
    """1 / x over [1, 2), exponent scaling, and a / b against fl(a * (1 / b))."""
    x = floats(ONE, ONE + M)
    rc = table(run("recip", x), 1.0 / x.double(), "recip", out, meta)
    checks["recip_vs_rcp_approx_ftz_mismatches"] = int((bits(run("rcp_asm", x)) != bits(rc)).sum())
    bad = {}
    for k in range(-126, 127):
        xs = torch.ldexp(x, torch.tensor(float(k), device="cuda"))
        want = bits(rc) - (k << 23)
        ok = (want > 0x007FFFFF) & (want < 0x7F800000)
        bad[k] = int(((bits(run("recip", xs)) != want) & ok).sum())
    checks["recip_scaling_mismatches_by_k"] = {k: v for k, v in bad.items() if v}
    n = N_PAIRS
    av = (torch.rand(n, device="cuda") * 2 - 1) * torch.exp2(torch.randint(-40, 40, (n,), device="cuda").float())
    bv = (torch.rand(n, device="cuda") + 0.01) * torch.exp2(torch.randint(-40, 40, (n,), device="cuda").float())
    q = divide(av, bv)
    checks["div_vs_a_times_recip_mismatches"] = int((bits(q) != bits(av * run("recip", bv))).sum())
    checks["div_vs_correctly_rounded_mismatches"] = int((bits(q) != bits((av.double() / bv.double()).float())).sum())
    checks["div_random_pairs"] = n
    # divisors of magnitude >= 2^126 and subnormal ones: both operands scaled first?
    g = torch.Generator(device="cuda").manual_seed(1)
    for name, lo, hi, scale, amp in (("big", 0x7E800000, 0x7F800000, 0.25, 3e38),
                                     ("subnormal", 1, 0x00800000, 2.0**24, 1e-30)):
        d = floats(lo, hi)
        a1 = (torch.rand(d.shape, device="cuda", generator=g) * 2 - 1) * amp
        q = divide(a1, d)
        checks[f"div_{name}_divisor_count"] = d.numel()
        checks[f"div_{name}_divisor_vs_scaled_operands_mismatches"] = int(
            (bits(q) != bits((a1 * scale) * run("rcp_asm", d * scale))).sum())
        checks[f"div_{name}_divisor_vs_unscaled_mismatches"] = int((bits(q) != bits(a1 * run("rcp_asm", d))).sum())


def exp2_part(out: str, meta: dict, checks: dict) -> None:
    """ex2 over [0, 1) and (-1, 0] in steps of 2^-23, the integer part, finer fractions, and
    tl.exp's non-ftz ex2 below -126."""
    j = torch.arange(M, device="cuda", dtype=torch.float64)
    f = (j / M).float()
    tb = bits(table(run("exp2", f), torch.exp2(f.double()), "exp2", out, meta))
    tn = bits(table(run("exp2", -f), torch.exp2(-f.double()), "exp2neg", out, meta))
    checks["exp2_vs_ex2_ftz_asm_mismatches_0_1"] = int((bits(run("ex2_ftz_asm", f)) != tb).sum())
    bad = {}
    for nint in range(-140, 129):
        neg = nint < 0
        xs = (nint - f) if neg else (f + nint)  # x = n + f, or -(|n| + f)
        exact = (xs.double() == (nint - f.double() if neg else f.double() + nint))
        want = (tn + (nint << 23)) if neg else (tb + (nint << 23))
        ok = exact & (want > 0x007FFFFF) & (want < 0x7F800000)
        bad[nint] = int(((bits(run("exp2", xs)) != want) & ok).sum())
    checks["exp2_integer_part_mismatches"] = {k: v for k, v in bad.items() if v}
    checks["exp2_integer_part_total"] = sum(bad.values())
    quant = {}
    for e in range(-1, -33, -1):
        for sign in (1.0, -1.0):
            xs = sign * torch.ldexp(floats(ONE, ONE + M), torch.tensor(float(e), device="cuda"))
            got = bits(run("exp2", xs))
            row = {}
            for F in (23, 24):
                s = float(2 ** F)
                for mode, fn in (("floor", torch.floor), ("nearest", torch.round), ("trunc", torch.trunc)):
                    qx = (fn(xs.double() * s) / s).float()
                    row[f"{mode}{F}"] = int((bits(run("exp2", qx)) != got).sum())
            quant[f"{'+' if sign > 0 else '-'}2^{e}"] = row
    checks["exp2_quantization_mismatches"] = quant
    n = N_PAIRS
    z = (torch.rand(n, device="cuda") - 0.9) * 100
    l2e = torch.tensor(math.log2(math.e), device="cuda", dtype=torch.float32)
    zl = z * l2e
    e_plain = bits(run("exp", z))
    e_ftz = bits(run("exp2", zl))
    checks["exp_vs_ex2ftz_of_product_mismatches"] = int((e_plain != e_ftz).sum())
    checks["exp_vs_ex2ftz_of_product_mismatches_above_m126"] = int(((e_plain != e_ftz) & (zl >= -126)).sum())
    # below -126 (subnormal results), hypothesis: ex2.approx.f32(x) = fl(h * h), h = ex2ftz(x / 2)
    low = -torch.rand(n, device="cuda") * 30 - 126
    zlow = low / l2e
    h = run("exp2", (zlow * l2e) * 0.5)
    got = bits(run("exp", zlow))
    checks["exp_below_m126_vs_square_of_half_mismatches"] = int((got != bits(h * h)).sum())
    checks["exp_below_m126_vs_correctly_rounded_mismatches"] = int(
        (got != bits(torch.exp2((zlow * l2e).double()).float())).sum())
    checks["exp_below_m126_count"] = n


@triton.jit
def _row_sum_sq(x_ptr, out_ptr, mean_ptr, SIZE: tl.constexpr, BLOCK: tl.constexpr):
    """Σx² of one row as vLLM's norms write it: ``tl.sum(v * v, 0)`` of a row loaded whole, and
    that sum ``/ SIZE`` (a division by a constant)."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    v = tl.load(x_ptr + row * SIZE + cols, cols < SIZE, 0).to(tl.float32)
    ss = tl.sum(v * v, 0)
    tl.store(out_ptr + row, ss)
    tl.store(mean_ptr + row, ss / SIZE)


def rowsum_part(out: str, meta: dict, checks: dict) -> None:
    """The summation order of ``tl.sum`` over a row: fp32 rows of 512 with 4 warps (the compressor's
    latent norm), bf16 rows of 512 / 1536 in a 2048 block with 8 warps (the q / kv norm).  Inputs
    come from a CPU generator (seed 0) so the reader regenerates them."""
    gen = torch.Generator().manual_seed(0)
    rows = 16384
    res = {}
    for name, size, block, dtype, warps in (("f32_512_w4", 512, 512, torch.float32, 4),
                                            ("bf16_512_b2048_w8", 512, 2048, torch.bfloat16, 8),
                                            ("bf16_1536_b2048_w8", 1536, 2048, torch.bfloat16, 8)):
        mag = torch.exp2(torch.randint(-8, 8, (rows, 1), generator=gen).float())
        x = (torch.randn(rows, size, generator=gen) * mag * torch.exp2(torch.randint(-3, 3, (rows, size), generator=gen).float()))
        x = x.to(dtype).cuda()
        y = torch.empty(rows, device="cuda", dtype=torch.float32)
        mean = torch.empty(rows, device="cuda", dtype=torch.float32)
        _row_sum_sq[(rows,)](x, y, mean, SIZE=size, BLOCK=block, num_warps=warps)
        res[name] = y.cpu().view(torch.int32).numpy()
        res[name + "_mean"] = mean.cpu().view(torch.int32).numpy()
        meta[f"rowsum_{name}_first_input_bits"] = int(x.float().view(torch.int32)[0, :8].sum())
    np.savez_compressed(os.path.join(out, "approx-rowsum.npz"), **res)


PARTS = {"rsqrt": rsqrt_part, "recip": recip_part, "exp2": exp2_part, "rowsum": rowsum_part}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--parts", nargs="+", default=list(PARTS), choices=list(PARTS))
    a = p.parse_args()
    os.makedirs(a.out, exist_ok=True)
    torch.manual_seed(0)
    meta: dict = {"device": torch.cuda.get_device_name(), "triton": triton.__version__, "torch": torch.__version__}
    checks: dict = {}
    for part in a.parts:
        PARTS[part](a.out, meta, checks)
    checks["ptx"] = PTX
    with open(os.path.join(a.out, "approx-checks.json"), "w") as fh:
        json.dump({"meta": meta, "checks": checks}, fh, indent=1)
    print(json.dumps(meta, indent=1))
    print(json.dumps({k: v for k, v in checks.items() if k not in ("exp2_quantization_mismatches", "ptx")}, indent=1))
    for k, row in checks.get("exp2_quantization_mismatches", {}).items():
        print(k, {m: v for m, v in row.items() if v == 0})


if __name__ == "__main__":
    main()
