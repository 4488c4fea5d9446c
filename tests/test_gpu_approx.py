"""``dsv41.core.gpu_approx`` on the CPU: the tables' accuracy (what PTX documents for each
instruction), special values, the reductions the functions rely on, and shapes / dtypes.

That the tables are the GPU's instructions bit for bit is checked on an SM90 GPU over every fp32
input (``tests/test_gpu_exhaustive.py::test_gpu_approx_equals_the_instructions``); here the
golden vectors (set C, set D) check it through the ops."""

from __future__ import annotations

import math

import pytest
import torch

from dsv41.core import gpu_approx as GA

F32, F64, I32 = torch.float32, torch.float64, torch.int32


def _bits(x):
    return x.view(I32).to(torch.int64)


def _ulps(got, exact64):
    """Distance in fp32 ulps between ``got`` and the float64 value (both positive, normal)."""
    ulp = torch.ldexp(torch.ones_like(exact64), torch.frexp(exact64).exponent - 24)
    return ((got.double() - exact64) / ulp).abs()


def _random_normal(n, lo_exp, hi_exp, seed):
    g = torch.Generator().manual_seed(seed)
    m = torch.rand(n, generator=g, dtype=F64) + 1.0
    e = torch.randint(lo_exp, hi_exp, (n,), generator=g)
    return torch.ldexp(m, e).float()


def test_rsqrt_accuracy_and_scaling():
    """Within 2 ulp of 1/sqrt (PTX: max relative error 2^-22.9 over the range), and
    rsqrt(4x) = rsqrt(x) / 2 exactly for normal results."""
    x = _random_normal(200000, -120, 120, 1)
    r = GA.rsqrt_approx(x)
    assert float(_ulps(r, torch.rsqrt(x.double())).max()) <= 2.0
    r4 = GA.rsqrt_approx(x * 4.0)
    ok = (x * 4.0).isfinite()
    assert torch.equal(_bits(r4)[ok], (_bits(r) - (1 << 23))[ok])
    # most results are the correctly rounded ones: a corrupted table would not be
    assert float((r == torch.rsqrt(x.double()).float()).double().mean()) > 0.7


def test_rsqrt_specials():
    x = torch.tensor([0.0, -0.0, 1e-40, -1e-40, float("inf"), -float("inf"), -1.0, float("nan"), 1.0, 4.0, 0.25])
    r = GA.rsqrt_approx(x)
    assert _bits(r)[:6].tolist() == [0x7F800000, -0x800000, 0x7F800000, -0x800000, 0, 0x7FFFFFFF]
    assert torch.isnan(r[6:8]).all()
    assert r[8:].tolist() == [1.0, 0.5, 2.0]


def test_div_full_is_a_times_rcp():
    """div.full(a, b) = fl32(a · rcp(b)); rcp within 1 ulp of 1/b, exact for powers of two,
    sign-symmetric; 1/0 = inf, 1/inf = 0, subnormal results flushed."""
    b = _random_normal(200000, -100, 100, 2)
    r = GA.rcp_approx(b)
    assert float(_ulps(r, 1.0 / b.double()).max()) <= 1.0
    assert torch.equal(GA.rcp_approx(-b), -r)
    a = _random_normal(200000, -20, 20, 3)
    assert torch.equal(GA.div_full(a, b), a * r)
    p2 = torch.ldexp(torch.ones(40), torch.arange(-20, 20))
    assert torch.equal(GA.rcp_approx(p2), 1.0 / p2)
    sp = GA.rcp_approx(torch.tensor([0.0, -0.0, float("inf"), -float("inf"), 2.0**127 * 1.5, float("nan")]))
    assert _bits(sp)[:5].tolist() == [0x7F800000, -0x800000, 0, -(1 << 31), 0] and torch.isnan(sp[5])


def test_ex2_accuracy_integer_part_and_specials():
    """ex2 within 3 ulp over normal results (PTX: max relative error 2^-22.5, i.e. up to 2.8 ulp),
    exact at integers; the argument's fraction below 2^-23 does not matter (fixed point,
    truncated)."""
    g = torch.Generator().manual_seed(4)
    x = ((torch.rand(200000, generator=g, dtype=F64) - 0.5) * 250).float()
    y = GA.ex2_approx_ftz(x)
    normal = (y > 1.2e-38) & y.isfinite()
    assert float(_ulps(y[normal], torch.exp2(x.double())[normal]).max()) <= 3.0
    k = torch.arange(-126, 128).float()
    assert torch.equal(GA.ex2_approx_ftz(k), torch.exp2(k))
    small = torch.tensor([1e-8, 1e-12, 2.0**-24, 2.0**-30])
    assert torch.equal(GA.ex2_approx_ftz(small), torch.ones(4))
    sp = GA.ex2_approx_ftz(torch.tensor([float("inf"), -float("inf"), 128.0, -127.5, -200.0, float("nan")]))
    assert sp[:5].tolist() == [float("inf"), 0.0, float("inf"), 0.0, 0.0] and torch.isnan(sp[5])


def test_exp_below_minus_126_squares_the_half():
    """tl.exp's ex2 keeps subnormal results: below -126 it is fl32(h·h), h = ex2ftz(arg / 2)."""
    z = torch.linspace(-103.0, -87.4, 5000)
    arg = z * GA.LOG2E_F32
    h = GA.ex2_approx_ftz(arg * 0.5)
    e = GA.exp_approx(z)
    assert torch.equal(e[arg < -126], (h * h)[arg < -126])
    assert torch.equal(e[arg >= -126], GA.ex2_approx_ftz(arg)[arg >= -126])
    assert bool((e > 0).any() & (e < 1.1754944e-38).any())  # subnormals occur
    assert GA.LOG2E_F32 == float(torch.tensor(math.log2(math.e), dtype=F32))


@pytest.mark.parametrize("fn", [GA.rsqrt_approx, GA.rcp_approx, GA.ex2_approx_ftz, GA.exp_approx])
def test_shapes_and_dtype(fn):
    x = torch.rand(3, 5, 7) + 0.5
    y = fn(x)
    assert y.shape == x.shape and y.dtype == F32
    assert torch.equal(fn(x.transpose(0, 2)), y.transpose(0, 2))
    with pytest.raises(TypeError, match="float32"):
        fn(x.double())


def test_tl_sum_sq_is_the_h200s_order():
    """``tl_sum_sq`` (with the Q/KV norm's layout rule) against the sums and means an H200 wrote
    for the first 2048 of the probe rows (tools/approx_dump.py rowsum; tests/vectors/README.md)."""
    import numpy as np
    from pathlib import Path

    from dsv41.reference.output_quant import vllm_norm_layout

    data = np.load(Path(__file__).parent / "vectors" / "h200-rowsum.npz")
    gen = torch.Generator().manual_seed(0)
    rows = 16384  # the probe's inputs, regenerated (only the first 2048 rows are kept)
    for name, size, dtype, layout in (("f32_512_w4", 512, F32, (512, 4, 4)),
                                      ("bf16_512_b2048_w8", 512, torch.bfloat16, vllm_norm_layout(1536, 512, 2)),
                                      ("bf16_1536_b2048_w8", 1536, torch.bfloat16, vllm_norm_layout(1536, 512, 2))):
        mag = torch.exp2(torch.randint(-8, 8, (rows, 1), generator=gen).float())
        x = torch.randn(rows, size, generator=gen) * mag * torch.exp2(torch.randint(-3, 3, (rows, size), generator=gen).float())
        x = x.to(dtype).float()[:2048]
        block, warps, per = layout
        ss = GA.tl_sum_sq(x, warps=warps, per_thread=per, block=block)
        assert torch.equal(ss.view(I32), torch.from_numpy(data[name]).view(I32)), name
        mean = GA.div_full(ss, torch.full_like(ss, float(size)))
        assert torch.equal(mean.view(I32), torch.from_numpy(data[name + "_mean"]).view(I32)), name
        # the order matters: a correctly rounded sum differs in many rows
        assert int(((x.double() ** 2).sum(-1).float() != ss).sum()) > 100


def _wide_rows(t, d, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(t, d, generator=g)
    x = x * torch.exp2(torch.randint(-20, 21, (t, 1), generator=g).float())
    return x * torch.exp2(torch.randint(-4, 5, (t, d), generator=g).float())


def test_cpu_norm_kernels_match_the_reference_at_scale(monkeypatch):
    """Randomized parity at scale (thousands of rows at wide magnitudes) between the CPU kernels
    and the reference for the three norm ops -- and the inputs are large enough that the
    correctly rounded rsqrt the reference used to take (set C's difference) changes bytes."""
    from dsv41.core import registry
    import dsv41.reference.compress as RC
    import dsv41.reference.output_quant as RO

    t = 6144
    kv = _wide_rows(t, 512, 1)
    w = (torch.rand(512, generator=torch.Generator().manual_seed(2)) + 0.5).to(torch.bfloat16)
    pos = torch.arange(t)
    cr1 = [kv, pos, None, pos.clone(), None, None, w, 1e-6, 1]
    qr = _wide_rows(t, 1536, 3).to(torch.bfloat16)
    kvr = _wide_rows(t, 512, 4).to(torch.bfloat16)
    qw = (torch.rand(1536, generator=torch.Generator().manual_seed(5)) + 0.5).to(torch.bfloat16)
    tp = (t + 127) // 128 * 128

    def run(fn_cr1, fn_qkv):
        lat = torch.zeros(t, 512, dtype=torch.bfloat16)
        fn_cr1(*cr1, lat)
        qo = torch.zeros(t, 1536, dtype=torch.uint8).view(torch.float8_e4m3fn)
        so = torch.zeros(tp * 48, dtype=torch.uint8)
        ko = torch.zeros(t, 512, dtype=torch.bfloat16)
        fn_qkv(qr, kvr, qw, w, 1e-6, qo, so, ko)
        return lat.view(torch.int16), qo.view(torch.uint8), so, ko.view(torch.int16)

    cpu = run(registry.kernel("fused_save_compress_norm", "cpu"), registry.kernel("fused_q_kv_rmsnorm_quant", "cpu"))
    ref = run(RC.fused_save_compress_norm, RO.fused_q_kv_rmsnorm_quant)
    for a, b in zip(cpu, ref):
        assert torch.equal(a, b)
    exact = lambda v: torch.rsqrt(v.double()).float()  # noqa: E731
    monkeypatch.setattr(RC, "rsqrt_approx", exact)
    monkeypatch.setattr(RO, "rsqrt_approx", exact)
    old = run(RC.fused_save_compress_norm, RO.fused_q_kv_rmsnorm_quant)
    assert sum(int((a != b).sum()) for a, b in zip(cpu, old)) > 0
