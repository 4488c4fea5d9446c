"""GPU-only checks (``python -m pytest -m gpu tests``): CUDA-graph capture/replay of every
kernel of every CUDA implementation, and torch.compile on CUDA.  The conformance matrix and
the golden vectors run the CUDA implementations automatically when a GPU is present."""

from __future__ import annotations

import pytest
import torch

import dsv41
from dsv41.conformance import CASES, _on, clone_args, written_bytes
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
