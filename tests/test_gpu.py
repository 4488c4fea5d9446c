"""GPU-only checks (``python -m pytest -m gpu tests``): CUDA-graph capture/replay of every
kernel of every CUDA implementation, and torch.compile on CUDA.  The conformance matrix and
the golden vectors run the CUDA implementations automatically when a GPU is present."""

from __future__ import annotations

import pytest
import torch

import dsv41
from dsv41.tools.conformance import CASES, _on, clone_args, written_bytes
from dsv41.reference import ReferenceBackend
from impls import implementations

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

CUDA_IMPLS = [i for i in implementations() if i.device == "cuda"]
FIRST = {}
for _c in CASES:
    if not _c.id.endswith("empty"):
        FIRST.setdefault(_c.op, []).append(_c)
GRAPH_CASES = [cs[0] for cs in FIRST.values()]


def _perturb(args, writes):
    """New input values of the same shapes: floats scaled by -2, so every output changes."""
    out = []
    for i, a in enumerate(args):
        if isinstance(a, torch.Tensor) and i not in writes and a.dtype in (torch.float32, torch.bfloat16):
            out.append(a * -2)
        else:
            out.append(a)
    return out


@pytest.mark.parametrize("case", GRAPH_CASES, ids=[c.id for c in GRAPH_CASES])
@pytest.mark.parametrize("impl", CUDA_IMPLS or [None], ids=[i.name for i in CUDA_IMPLS] or ["none"])
def test_cuda_graph_capture_and_replay(case, impl):
    if impl is None:
        pytest.skip("no CUDA implementation can run here")
    why = impl.skip_reason(case.op)
    if why:
        pytest.skip(why)
    kern = impl.kernel(case.op)
    host = case.build("cpu")
    dev = _on("cuda", clone_args(host))
    initial = [written_bytes(dev[i]) if dev[i] is not None else None for i in case.writes]
    kern(*dev)  # warm-up: compiles outside the capture
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        with torch.cuda.graph(g, stream=s):
            kern(*dev)
    torch.cuda.current_stream().wait_stream(s)
    # change the inputs in place, reset the outputs, replay, compare with the reference
    new_host = _perturb(host, case.writes)
    for i, (a, b) in enumerate(zip(dev, new_host)):
        if isinstance(a, torch.Tensor) and i not in case.writes:
            a.copy_(b.to("cuda"))
    for i, init in zip(case.writes, initial):
        if init is not None:
            dev[i].untyped_storage().copy_(init.cuda().untyped_storage())
    g.replay()
    torch.cuda.synchronize()
    want = clone_args(new_host)
    ReferenceBackend().load(case.op)(*want)
    for i in case.writes:
        if want[i] is None:
            continue
        got, ref = written_bytes(dev[i]), written_bytes(want[i])
        assert torch.equal(got, ref), f"{case.id} arg {i}: {(got != ref).sum().item()} bytes differ after replay"


def test_torch_compile_fullgraph_on_cuda():
    torch._dynamo.reset()
    g = torch.Generator().manual_seed(0)
    k = torch.randn(8, 512, generator=g).to(torch.bfloat16).cuda()
    o = torch.randn(8, 2, 512, generator=g).to(torch.bfloat16).cuda()
    pos = torch.arange(8, dtype=torch.int64, device="cuda")
    cs = torch.randn(64, 64, generator=g).cuda()

    def pipeline(k, cache, slots, out, seq, table, o):
        dsv41.quantize_and_insert_k_cache(k, cache, slots, 16, True, False, 528)
        dsv41.dequantize_and_gather_k_cache(out, cache.view(4, 16, 528), seq, None, table, 16, 0)
        q, s = dsv41.fused_inv_rope_fp8_quant(o, pos, cs, 1, 2)
        return out.float().sum() + q.float().sum() + s.sum()

    def inputs():
        return [k, torch.zeros(4, 16 * 528, dtype=torch.uint8, device="cuda"),
                torch.tensor([0, 1, 2, 3, 16, 17, 18, 19], device="cuda"),
                torch.zeros(1, 8, 512, dtype=torch.bfloat16, device="cuda"),
                torch.tensor([8], dtype=torch.int32, device="cuda"), torch.tensor([[0, 1]], dtype=torch.int32, device="cuda"), o]

    a, b = inputs(), inputs()
    want = pipeline(*a)
    got = torch.compile(pipeline, fullgraph=True)(*b)
    assert torch.equal(want, got) and torch.equal(a[1], b[1])


@pytest.mark.parametrize("impl", CUDA_IMPLS or [None], ids=[i.name for i in CUDA_IMPLS] or ["none"])
def test_cr2_prefill_ring_read_before_save(impl):
    """CR 2 at prefill size, two calls back to back: every chunk starts at an odd position,
    so its first token pools with the ring row that the same chunk's save then overwrites
    where the chunk is longer than the ring (most are; chunks of 1-3 rows too), and the
    second call reads the rows the first saved.  On SM90+ the ring save loads its rows while the pooling
    kernel runs and waits for it only before storing; the bytes must be the reference's."""
    if impl is None:
        pytest.skip("no CUDA implementation can run here")
    op = "fused_save_compress_norm"
    if impl.skip_reason(op):
        pytest.skip(impl.skip_reason(op))
    g = torch.Generator().manual_seed(9)
    cap, lens = 4, [1, 5, 4093, 2, 9000, 3, 7000]
    T = sum(lens)
    qsl = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32)
    t2r = torch.repeat_interleave(torch.arange(len(lens), dtype=torch.int32), torch.tensor(lens))
    block = torch.randperm(len(lens), generator=g)
    w = (torch.rand(512, generator=g) + 0.5).to(torch.bfloat16)

    def call_args(start):
        pos = torch.cat([torch.arange(start + 2 * r + 1, start + 2 * r + 1 + n) for r, n in enumerate(lens)])
        slots = block[t2r.long()] * cap + pos % cap
        kv = torch.randn(T, 1024, generator=g)
        latent = torch.full((T, 512), float("nan"), dtype=torch.bfloat16)
        return [kv, pos, None, slots, qsl, t2r, w, 1e-6, 2, latent]

    state = torch.randn(len(lens), cap, 1024, generator=g)
    calls = [call_args(100), call_args(20001)]
    want_state = state.clone()
    want = []
    for a in calls:
        a = clone_args(a)
        a[2] = want_state
        ReferenceBackend().load(op)(*a)
        want.append(a[9])
    dev_state = state.cuda()
    dev = [_on("cuda", clone_args(a)) for a in calls]
    kern = impl.kernel(op)
    for a in dev:
        a[2] = dev_state
        kern(*a)
    torch.cuda.synchronize()
    for i, (a, w_out) in enumerate(zip(dev, want)):
        assert torch.equal(written_bytes(a[9]).cpu(), written_bytes(w_out)), f"call {i}: latent_out differs"
    assert torch.equal(dev_state.cpu(), want_state), "state cache differs"


@pytest.mark.parametrize("eager", [True, False], ids=["eager-path", "op-path"])
def test_public_calls_capture_on_both_paths(eager, monkeypatch):
    """A public call captures into a CUDA graph whether it goes straight to the kernel (eager
    path) or through torch.ops.dsv41 (DSV41_EAGER_OPS=0), and replays to the eager bytes."""
    from dsv41.core import _calls

    monkeypatch.setattr(_calls, "_eager", eager)
    g = torch.Generator().manual_seed(1)
    k = torch.randn(16, 512, generator=g).to(torch.bfloat16).cuda()
    slots = torch.arange(16, device="cuda") * 3
    cache = torch.zeros(4, 64, 528, dtype=torch.uint8, device="cuda")
    out = torch.zeros(1, 48, 512, dtype=torch.bfloat16, device="cuda")
    seq = torch.tensor([48], dtype=torch.int32, device="cuda")
    table = torch.tensor([[0]], dtype=torch.int32, device="cuda")

    def step():
        dsv41.quantize_and_insert_k_cache(k, cache, slots, 64, True, False, 528)
        dsv41.dequantize_and_gather_k_cache(out, cache, seq, None, table, 64, 0)

    step()  # warm-up (compiles)
    torch.cuda.synchronize()
    want_cache, want_out = cache.clone(), out.clone()
    graph = torch.cuda.CUDAGraph()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s), torch.cuda.graph(graph, stream=s):
        step()
    torch.cuda.current_stream().wait_stream(s)
    cache.zero_()
    out.zero_()
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(cache, want_cache) and torch.equal(out, want_out)


@pytest.mark.parametrize("case", GRAPH_CASES, ids=[c.id for c in GRAPH_CASES])
@pytest.mark.parametrize("impl", CUDA_IMPLS or [None], ids=[i.name for i in CUDA_IMPLS] or ["none"])
def test_bound_launch_writes_what_triton_launch_writes(case, impl, monkeypatch):
    """Each Triton kernel launched through Triton's own path, through the bound launcher
    (backends/triton/bound.py) and replayed (backends/triton/replay.py: the first bound call
    records, the next ones replay), each on fresh copies of the same inputs: the same bytes."""
    from dsv41.backends.triton import bound

    if impl is None:
        pytest.skip("no CUDA implementation can run here")
    why = impl.skip_reason(case.op)
    if why:
        pytest.skip(why)
    if not bound.enabled():
        pytest.skip(f"bound launches are off here (Triton {bound.triton.__version__} or DSV41_TRITON_SLOW_LAUNCH)")
    kern = impl.kernel(case.op)
    host = case.build("cpu")
    written = []
    for fast in (False, True, True, True):  # then the kept kernel, then replays
        monkeypatch.setattr(bound, "_ENABLED", fast)
        dev = _on("cuda", clone_args(host))
        kern(*dev)
        torch.cuda.synchronize()
        written.append([written_bytes(dev[i]).cpu() if dev[i] is not None else None for i in case.writes])
    for got in written[1:]:
        for i, (a, b) in enumerate(zip(written[0], got)):
            assert (a is None and b is None) or torch.equal(a, b), f"written argument {case.writes[i]} differs"
